"""Give a random-weight model a tokenizer whose vocabulary covers the model's (GPU host only).

The GPU host kit's ``make_model.py`` trains a 32,000-token BPE for every model, whatever the config's
``vocab_size``. A random-weight 8B (vocab 128,256) or 14B (152,064) model samples ids uniformly
over its own vocabulary, so 75-79% of the ids it produced in the 2026-12-01 scale runs had no
token in the tokenizer, and vLLM's API server detokenized them on a path that real models never
take: those windows showed the API server 65-87% busy, ~20 tokens per SSE chunk and prefill-heavy
steps 1.5-2.3x slower than the kernels' rooflines. A real Llama-3.1 or Qwen2.5 checkpoint has one
token per id. This script writes a byte-level BPE with exactly ``vocab_size`` entries into the
model folder (replacing make_model's): ids 0-2 are ``<unk> <s> </s>`` (the ids make_model wrote
into the config), then the 256 byte symbols, then lower-case ASCII words built by merges, so
every id decodes to valid UTF-8 text, as the ids of a real checkpoint almost always do.

Usage on the host::

    python3 benchmarks/real_vllm/full_vocab_tokenizer.py /root/m8b
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<unk>", "<s>", "</s>"]


def build(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE of exactly ``vocab_size`` tokens whose merged tokens are ASCII words."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab: dict[str, int] = {}
    for tok in SPECIALS + sorted(alphabet):
        vocab.setdefault(tok, len(vocab))
    # Words by length, breadth first: each new token is (a token one letter shorter) + (a letter),
    # so every merge joins two tokens already in the vocabulary, and no candidate is drawn twice.
    letters = list("abcdefghijklmnopqrstuvwxyz")
    space = "\u0120"  # the byte-level symbol of a space: it only starts a word
    level = letters + [space]
    merges: list[tuple[str, str]] = []
    rng = random.Random(seed)
    while len(vocab) < vocab_size:
        nxt = [t + c for t in level for c in letters]
        rng.shuffle(nxt)
        for new in nxt:
            if len(vocab) >= vocab_size:
                break
            vocab[new] = len(vocab)
            merges.append((new[:-1], new[-1]))
        level = nxt
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def main() -> None:
    out = Path(sys.argv[1])
    cfg = json.loads((out / "config.json").read_text())
    vocab_size = int(cfg["vocab_size"])
    tok = build(vocab_size)
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.model_max_length = int(cfg.get("max_position_embeddings", 8192))
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / stale).unlink(missing_ok=True)
    fast.save_pretrained(str(out))
    ids = list(range(3, vocab_size, max(1, vocab_size // 2000)))
    text = fast.decode(ids)
    print(json.dumps({"model": str(out), "vocab_size": vocab_size, "tokenizer_size": len(fast),
                      "bos": fast.bos_token_id, "eos": fast.eos_token_id,
                      "config_bos_eos": [cfg.get("bos_token_id"), cfg.get("eos_token_id")],
                      "replacement_chars_in_sample": text.count("\ufffd"), "sample": text[:80]}), flush=True)


if __name__ == "__main__":
    main()
