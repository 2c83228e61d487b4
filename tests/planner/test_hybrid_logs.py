"""The published starts of hybrid models (tests/fixtures/published_logs/hybrid.yaml), and the planner judged on them.

The index: the file parses with ``parse_index``; every start is a held-out ``hybrid`` start of vLLM 0.10 or later
with a named source; every model config it points to exists and says where it came from; the kept log lines read,
with the product's own log parser, as the figures the entry records (a start whose source quotes its figures
without the log says so in the source entry).

The judgement (nothing fitted: every start is held out): ``benchmarks/results/published_logs_hybrid.json`` is
re-derived from the product's planner; each planned start's KV tokens sit in the band recorded here (the misses
kept visible, with what is known of them); the attention block vLLM logged is the planner's; the weights are
"Model loading took" within 0.3%; the refused start is refused in one line, and vLLM's Mamba-cache-block refusal
is foreseen with vLLM's own words.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from servetune.engines.vllm.logs import parse_log
from servetune.errors import SpecError
from servetune.planner import memory
from servetune.planner.engine_config import resolve_engine_config
from servetune.planner.evidence import PublishedStart, judge, parse_index
from servetune.planner.gpus import get_gpu
from servetune.planner.modelinfo import load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "published_logs"
DOC: dict[str, Any] = yaml.safe_load((FIXTURES / "hybrid.yaml").read_text(encoding="utf-8"))
STARTS: list[PublishedStart] = parse_index(DOC)
FIELDS = {"weights": "weights_gib", "kv_cache": "available_kv_gib", "kv_tokens": "kv_cache_tokens",
          "max_concurrency": "max_concurrency"}


def _read(rel: str) -> str:
    """The kept lines of one start: untrusted text, read with a size cap."""
    with open(FIXTURES / rel, "rb") as fh:
        data = fh.read(1 << 20)
    assert len(data) < 1 << 20, rel
    return data.decode("utf-8", errors="replace")


def test_every_start_is_a_held_out_hybrid_of_vllm_0_10_or_later():
    assert len(STARTS) >= 5
    assert {s.kind for s in STARTS} == {"hybrid"}
    assert {s.role for s in STARTS} == {"held_out"}, "nothing is fitted on the hybrid starts"
    assert all(memory.parse_vllm_version(s.vllm) >= (0, 10, 0) for s in STARTS)
    assert any(s.failed for s in STARTS) and any(not s.failed for s in STARTS)


def test_every_source_has_an_address_and_says_what_it_is():
    used = {s.source for s in STARTS}
    assert used == set(DOC["sources"]), "a source no start uses, or a start without a source"
    for name in used:
        entry = DOC["sources"][name]
        assert entry["url"] and len(entry["what"]) > 80, name


ROOT = Path(__file__).resolve().parents[2]


def _config_path(start: PublishedStart) -> Path:
    """A start's config.json: a path under the fixture folder, or a shipped model's."""
    if "/" in start.model:
        return FIXTURES / start.model / "config.json"
    return ROOT / "platform" / "servetune" / "data" / "models" / start.model / "config.json"


@pytest.mark.parametrize("start", STARTS, ids=lambda s: s.id)
def test_the_model_config_exists_and_names_its_source(start: PublishedStart):
    cfg = json.loads(_config_path(start).read_text(encoding="utf-8"))
    assert "_source" in cfg and len(cfg["_source"]) > 40
    text = cfg.get("text_config", cfg)
    assert int(text["num_hidden_layers"]) > 0 and int(text["num_attention_heads"]) > 0


def test_most_starts_keep_their_published_lines_and_the_rest_say_why():
    kept = [s for s in STARTS if s.log is not None]
    assert len(kept) >= 5
    for s in STARTS:
        if s.log is None:  # figures quoted by the source, not its log: the source entry says so
            assert "not the log itself" in DOC["sources"][s.source]["what"], s.id


@pytest.mark.parametrize("start", [s for s in STARTS if s.log is not None and not s.failed], ids=lambda s: s.id)
def test_kept_lines_read_as_the_logged_figures(start: PublishedStart):
    assert start.log is not None, start.id
    parsed = parse_log(_read(start.log))
    read = {k: getattr(parsed, a) for k, a in FIELDS.items() if getattr(parsed, a) is not None}
    assert read.keys() == FIELDS.keys(), (start.id, read)
    for key, value in read.items():
        assert float(start.logged[key]) == pytest.approx(float(value)), (start.id, key)


@pytest.mark.parametrize("start", [s for s in STARTS if s.failed], ids=lambda s: s.id)
def test_a_refused_start_keeps_the_refusal_with_its_figures(start: PublishedStart):
    assert start.log is not None, start.id
    found = re.search(r"max_num_seqs \((\d+)\) exceeds available Mamba cache blocks \((\d+)\)", _read(start.log))
    assert found and start.logged["failure"] == "mamba_blocks", start.id
    assert (int(found.group(1)), int(found.group(2))) == (start.logged["max_num_seqs"], start.logged["mamba_blocks"])


def _bench() -> Any:
    import importlib.util
    spec = importlib.util.spec_from_file_location("published_logs_bench", ROOT / "benchmarks" / "published_logs.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


REPORT: dict[str, Any] = json.loads(json.dumps(_bench().hybrid_report()))
ROWS = {r["id"]: r for r in REPORT["per_start"]}


def test_the_committed_hybrid_report_is_what_the_planner_gives_now():
    """benchmarks/results/published_logs_hybrid.json is re-derived from the product's planner, not copied."""
    committed = json.loads((ROOT / "benchmarks" / "results" / "published_logs_hybrid.json").read_text())
    assert committed == REPORT


def test_every_start_is_planned_or_refused_by_name():
    """No start is dropped: 8 in the file, 7 planned, the unnamed W4A16 Qwen3-Next checkpoint refused in one line."""
    assert [r["id"] for r in REPORT["per_start"]] == [s.id for s in STARTS]
    held = REPORT["held_out"]
    assert held["starts_in_file"] == len(STARTS) == held["starts"] + len(held["refused"])
    assert [r["id"] for r in held["refused"]] == ["aether_qwen3_next_w4a16_tp2_l40s"]
    for r in held["refused"]:
        assert ROWS[r["id"]]["predicted"] == "refused" and r["reason"] and "\n" not in r["reason"]


#: Held-out KV-token error (%) of each planned healthy start, as judged; a change of more than 0.3 points fails.
#: The four Qwen3.5 / Qwen3.8 starts are SEEN, not held out for the vision encoder's rule
#: (modelclass.qwen3_vl_encoder_profile, 2026-12-06): their errors (then +3.18, +3.80, +5.24, +5.41 with the
#: gemma-3 constant standing in for the encoder) were read before it was written, and the choice not to add the
#: text model's fixed ACT_FIXED_GIB to the encoder's peak was made with the 9B start's gap and the study note's
#: 1.36 GiB split in view. The rule itself counts tensors from vLLM's source; nothing in it is fitted.
HYBRID_KV_BANDS = {
    "retriva_granite_h_1b_tp1_rtx3060": -1.50,  # another vLLM server shared the GPU (see the source)
    # Qwen3-Next-80B at TP=2, vLLM 0.10.2, FlashInfer absent: weights exact (74.28 GiB); -3.13% until the rule that
    # 0.10's fused-MoE workspaces are freed after each layer (VllmMemoryRules.moe_workspace_kept, read after that
    # figure); with the multicast term the plan's peak + non-torch was 0.7 GiB over what the log leaves (0.10's sort-based sampler at
    # 1,024 rows of a 151,936 vocabulary dominates it; not traced further). 2026-12-06, two rules read in vLLM's
    # source after this figure was seen (so not a blind check of them): the ~2 GiB "multicast" term charged at every
    # version is 0.17+'s FlashInfer all-reduce fusion (comm.fused_allreduce_runs; +1.68% without it), and 0.10.x
    # takes its init snapshot before it builds the communicators (v1/worker/gpu_worker.py:175 / :193@0.10.2), so
    # their memory over NVLink (comm.CONTEXT_GIB_MULTI less CONTEXT_GIB_SINGLE, 0.95 GiB, measured on the H200 at
    # 0.26, not fitted here) is charged there (-0.45%)
    "legalai_qwen3_next_80b_tp2_h200": -0.45,
    # Qwen3.5-9B, 0.19.0, offline LLM() (8,192 batched tokens), seen: the encoder pass of one 16,384-token image
    # (65,536 patches) peaks at 1.875 GiB, above the language model's 1.04 GiB plus the 0.30 GiB it holds, and
    # 0.19's accounting (torch peak increase + non-torch growth) charges exactly that: the logged tokens to the
    # block (+3.18% with the gemma-3 constant)
    "l40s_qwen35_9b_tp1_l40s": 0.00,
    # vLLM 0.28.0 on an A100 80GB PCIe (a study note's quotes), seen. The encoder pass now sets the peak (1.31 GiB
    # planned for the 0.8B tower; the note's split of the serve start reads 1.36), but 0.27+'s accounting charges
    # what stays allocated after profiling (``total_consumed``): the note quotes 4.18 GiB of weights + non-torch for
    # the 0.8B serve start and 4.31 for the offline one (2.5 GiB beyond the 1.72 loaded; 0.22 planned) and 51.61 for
    # the 27B (0.5 beyond the 51.1): not traced (+3.80 / +5.24 / +5.41 with the gemma-3 constant). Since
    # VllmMemoryRules.charges_v1_runner_buffers (0.27+ charges the V1 runner's inputs_embeds buffer, 16 MiB here, 80
    # for the 27B; read from source after these figures, nothing fitted) +3.45 / +3.49 / +2.58 (were +3.48 / +3.50 /
    # +2.83). What is left, by the note's quoted "consumed memory (weights + non-torch)" against the plan's weights
    # and non-torch: 2.36 (0.8B offline), 2.24 (0.8B serve) and 0.33 GiB (27B, 0.13 of it the mrope weights below)
    "studynote_qwen35_08b_offline_tp1_a100": 3.45,
    "studynote_qwen35_08b_serve_tp1_a100": 3.49,
    # Qwen3.8-27B: its fixture config has no mrope_section (none found for this model), so the 4 x mrope cos/sin
    # cache is not counted: the weights 0.13 GiB under the logged 51.1
    "studynote_qwen38_27b_offline_tp1_a100": 2.58,
}


def test_held_out_kv_tokens_are_the_recorded_figures():
    """Every planned healthy start is called a fit and lands in its band; 4 of 6 within 3%: the misses are kept."""
    healthy = [r for r in REPORT["per_start"] if r["logged"] == "ok" and r["predicted"] != "refused"]
    assert {r["id"] for r in healthy} == set(HYBRID_KV_BANDS)
    for r in healthy:
        assert r["predicted"] == "fits", r["id"]
        assert HYBRID_KV_BANDS[r["id"]] - 0.3 <= r["kv_error_pct"] <= HYBRID_KV_BANDS[r["id"]] + 0.3, r
    assert REPORT["held_out"]["within_3pct"] == sum(abs(e) <= 3.0 for e in HYBRID_KV_BANDS.values())


def test_weights_are_what_vllm_loaded():
    """The Qwen3.5 rules (dense GDN layers, MTP skipped, the tower, the 4 x mrope cos/sin cache) and Qwen3-Next's
    give "Model loading took" (printed to 0.01 GiB, 0.0001 at 0.10.2) within 0.015 GiB: Qwen3-Next-80B 74.281
    against 74.2812, Qwen3.5-9B 17.648 against 17.66, Qwen3.5-0.8B 1.714 against 1.72. Kept apart: the Qwen3.8-27B
    config without an mrope_section (50.974 against 51.1) and granite-4.0-h-1b (2.754 against 2.72; not traced)."""
    gaps = {"retriva_granite_h_1b_tp1_rtx3060": (0.02, 0.05), "studynote_qwen38_27b_offline_tp1_a100": (-0.15, -0.1)}
    checked = [r for r in REPORT["per_start"] if r.get("logged_weights_gib")]
    assert len(checked) == 5
    for r in checked:
        gap = r["weights_gib"] - float(r["logged_weights_gib"])
        low, high = gaps.get(r["id"], (-0.015, 0.015))
        assert low <= gap <= high, (r["id"], gap)


#: The attention block size vLLM set ("Setting attention block size to N tokens"), from the kept lines or, for the
#: study note's starts, its quotes (hybrid.yaml's comments).
LOGGED_BLOCKS = {"retriva_granite_h_1b_tp1_rtx3060": 400, "legalai_qwen3_next_80b_tp2_h200": 544,
                 "l40s_qwen35_9b_tp1_l40s": 528, "studynote_qwen35_08b_offline_tp1_a100": 544,
                 "studynote_qwen38_27b_offline_tp1_a100": 784}


@pytest.mark.parametrize("sid", sorted(LOGGED_BLOCKS))
def test_the_attention_block_is_the_one_vllm_set(sid: str):
    start = next(s for s in STARTS if s.id == sid)
    if start.log is not None:
        found = re.search(r"Setting attention block size to (\d+) tokens", _read(start.log))
        assert found and int(found.group(1)) == LOGGED_BLOCKS[sid]
    model = load_model(start.model if "/" not in start.model else str(FIXTURES / start.model))
    assert resolve_engine_config(start.flags, model, get_gpu(start.gpu), start.vllm).block_size == LOGGED_BLOCKS[sid]


def test_the_mamba_block_refusal_is_foreseen_with_vllms_reason():
    """vllm-project/vllm#49064: Qwen3.8-27B at 132,000 tokens and 0.90 on one H100, vLLM 0.28.0's default 1,024
    sequences: refused with "max_num_seqs (1024) exceeds available Mamba cache blocks (969)". The plan refuses it
    with vLLM's words, but with 318 blocks (319 before the V1 runner's inputs_embeds was charged): the number is
    the shared KV pool's ``num_blocks`` (VllmMemoryRules.mamba_blocks_cover_max_num_seqs, unchanged 0.22-0.28), and
    a bf16 27B leaves ~15 GiB of KV on an 80 GB card at 0.90, where 969 blocks of 49 MiB (16 layers x 784 tokens x
    4 KiB) need ~46 GiB beside ~51 GiB of weights. The same comment's second reproduction ran "the same checkpoint"
    on two 20 GB cards (next test), where neither the bf16 nor an FP8 27B fits: the checkpoint was a ~4-bit one the
    thread does not name, so the count is not judged."""
    start = next(s for s in STARTS if s.failed)
    row = ROWS[start.id]
    assert row["predicted"] == "kv_too_small" and REPORT["held_out"]["failed_foreseen"] == 1
    logged = re.search(r"max_num_seqs \((\d+)\) exceeds available Mamba cache blocks \((\d+)\)", _read(start.log or ""))
    planned = re.search(r"max_num_seqs \((\d+)\) exceeds available Mamba cache blocks \((\d+)\)", row["cause"])
    assert logged and planned and planned.group(1) == logged.group(1) == "1024"
    assert int(planned.group(2)) == 318 < int(logged.group(2))


def test_the_mamba_block_count_is_the_shared_pool_and_the_49064_checkpoint_is_not_bf16():
    """What vLLM counts in the refusal, checked on the figures of vllm-project/vllm#49064's comment of 2026-09-03
    (seen: the thread's figures were read while this was written; nothing is fitted on them):

    - its second reproduction (2 x RX 7900 XT, ROCm, vLLM 0.23.1, TP=2, the same checkpoint, 0.85, max_model_len
      122,633) quotes 3.86 GiB of KV, 123,399 tokens and "exceeds available Mamba cache blocks (161)". The
      planner's TP=2 block (16 layers x 784 tokens x 2 KV heads x 256 x 2 x 2 bytes) gives 161 blocks for 3.86 GiB,
      and 161 over the 160 blocks one request holds (157 attention, one per GDN group) times 122,633 gives the
      123,399 tokens: the count is ``available // page // group_size`` of the one pool every group shares
      (``get_num_blocks``; AMD cards are outside servetune's rules, so this is a check of the geometry only);
    - at TP=1 the same block is 49 MiB: 969 of them are 46.4 GiB, which with 0.90 of the H100's 79.19 GiB leaves
      24.9 GiB for weights, peak and non-torch memory, under the bf16 checkpoint's 51 GiB; and 0.85 of a 20 GB card
      leaves under 17 GiB a rank, under half the bf16 checkpoint (25.5 GiB) and, with the 3.86 GiB of KV, under half
      an FP8 one (28.8 GB).
    """
    model = load_model(str(FIXTURES / "models" / "qwen3.8-27b"))
    from servetune.planner.modelclass import kv_layout
    tp2 = kv_layout(model, 2, 0, 1, 784, 2)
    assert tp2.block_bytes == 784 * 2 * 2 * 256 * 2 * 16 and tp2.groups == ("full", "mamba", "mamba", "mamba")
    blocks = int(3.86 * 2**30) // tp2.block_bytes
    assert blocks == 161
    per_request = tp2.blocks_per_request(122_633, 784, 0)
    assert per_request == 160 and int(blocks / per_request * 122_633) == 123_399
    tp1 = kv_layout(model, 1, 0, 1, 784, 2)
    h100 = resolve_engine_config({"gpu_memory_utilization": 0.9, "max_model_len": 132000}, model,
                                 get_gpu("H100-80GB"), "0.28.0")
    left = int(get_gpu("H100-80GB").memory_gib * 2**30 * 0.9) - 969 * tp1.block_bytes
    assert 24.8 < left / 2**30 < 25.0 < ROWS["vllm49064_qwen38_27b_tp1_h100_failed"]["weights_gib"]
    assert h100.block_size == 784


def test_the_refused_start_is_refused_as_plan_would():
    """The W4A16-expert Qwen3-Next checkpoint is not named, so its quantization config is not known: the planner
    refuses its flags in one line, for compressed-tensors without a config. Its --disable-custom-all-reduce is a
    flag the planner knows (it was refused for it too until 2026-12-06): without the quantization it resolves."""
    start = next(s for s in STARTS if s.id == "aether_qwen3_next_w4a16_tp2_l40s")
    model = load_model(start.model)
    with pytest.raises(SpecError) as err:
        judge(start, model)
    assert err.value.field == "quantization" and err.value.fix and "\n" not in str(err.value)
    flags = {k: v for k, v in start.flags.items() if k != "quantization"}
    assert resolve_engine_config(flags, model, get_gpu(start.gpu), start.vllm).disable_custom_all_reduce is True
