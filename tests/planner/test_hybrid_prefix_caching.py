"""Prefix caching on a Mamba2 / gated-delta-net hybrid: vLLM's Mamba cache modes, read from its wheels.

The rules (``servetune.planner.vllm_rules.hybrid_prefix_caching_mode``, ``hybrid.hybrid_block_size`` /
``mamba_group_block_size``, ``KVLayout.blocks_per_request``), with the source lines in their docstrings:

- 0.10.x and 0.11.0 turn prefix caching off for every hybrid. 0.11.1 to 0.14.x keep it for the classes with
  ``SupportsMambaPrefixCaching`` (granite-4.0-h, Nemotron-H, Falcon-H1, Bamba; not Qwen3-Next, which is turned
  off) and page the Mamba state per block; 0.15.0 names that 'all' and adds 'align' (the default for the other
  classes, and ``--mamba-cache-mode``); 0.28.0 makes 'align' every class's default. 0.29 on is refused.
- 'all': the attention block is a multiple of ``lcm(chunk, align)`` (the Mamba2 kernel's chunk, 256 for granite)
  holding one state, the Mamba block the same; a request holds ``cdiv(max_model_len, mamba_block)`` blocks in
  every Mamba group. 'align': the block rule without prefix caching, the Mamba block the attention block, two
  blocks a Mamba group per request. The "max_num_seqs exceeds available Mamba cache blocks" check is the same in
  every mode (``config/compilation.py`` lines 1476-1497 of 0.26.0: one block per decode sequence).

Worked example, granite-4.0-h-tiny on one H100, vLLM 0.26.0, 8,192 tokens, prefix caching on (by hand; the
model's sizes are in test_hybrid_models.py): 'all' mode (GraniteMoeHybridForCausalLM supports it); one Mamba
state of 806,400 B is cdiv(806,400, 2,048) = 394 attention tokens, so the block is 256 x cdiv(394, 256) = 512
(a multiple of the chunk, not 400), the state padded by (512 x 2,048 - 806,400) / 806,400 = 30.03%; a block over
a group of 4 layers is 4 x 512 x 2,048 = 4,194,304 B; a request holds 16 attention blocks and 16 in each of the
9 Mamba groups: 160 blocks.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path

import pytest
from _fidelity import serving_flags

from servetune.engines.vllm.logs import parse_log
from servetune.errors import NotModelled, SpecError
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.hybrid import mamba_ssm_dtype_bytes, mamba_state_bytes, supports_mamba_prefix_caching
from servetune.planner.modelclass import kv_layout
from servetune.planner.modelinfo import ModelProfile, load_model, profile_from_config

ROOT = Path(__file__).resolve().parents[2]
H100 = get_gpu("H100-80GB")
PC = {"gpu_memory_utilization": 0.9, "max_model_len": 8192, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
      "enable_prefix_caching": True}
GRANITE_PC = ROOT / "tests" / "fixtures" / "real_h100_classes" / "2026-12-06_ghtiny_pc_u09_s256_mbt8192"


@pytest.mark.parametrize("version, granite, qwen3_next", [
    ("0.10.2", (False, "none"), (False, "none")),     # models/config.py 308-309 of 0.10.2: forced off
    ("0.11.0", (False, "none"), (False, "none")),     # 295-296 of 0.11.0
    ("0.11.1", (True, "all"), (False, "none")),       # 293-305 of 0.11.1: "... without support for prefix caching: disabling."
    ("0.13.0", (True, "all"), (False, "none")),       # 289-306 of 0.13.0 (the published L40S Qwen3-Next start below)
    ("0.14.1", (True, "all"), (False, "none")),       # no mamba_cache_mode yet
    ("0.15.0", (True, "all"), (True, "align")),       # 335: "all" if supports_mamba_prefix_caching else "align"
    ("0.26.0", (True, "all"), (True, "align")),       # 561
    ("0.27.0", (True, "all"), (True, "align")),       # 616
    ("0.28.0", (True, "align"), (True, "align")),     # 604: "align" for every class
])
def test_mode_by_release_and_class(version, granite, qwen3_next):
    m, q = load_model("granite-4.0-h-tiny"), load_model("qwen3-next-80b-a3b")
    assert supports_mamba_prefix_caching(m) and not supports_mamba_prefix_caching(q)
    c = resolve_engine_config(PC, m, H100, version)
    assert (c.enable_prefix_caching, c.mamba_cache_mode) == granite
    c = resolve_engine_config({"tensor_parallel_size": 4, "max_model_len": 8192, "enable_prefix_caching": True}, q,
                              get_gpu("H200"), version)
    assert (c.enable_prefix_caching, c.mamba_cache_mode) == qwen3_next
    assert resolve_engine_config({**PC, "enable_prefix_caching": False}, m, H100, version).mamba_cache_mode == "none"


def test_from_029_prefix_caching_on_a_hybrid_is_not_modelled_even_as_vllms_default():
    # 0.28 on turns prefix caching on for hybrids unless told; from 0.29 'align' holds prefill checkpoint
    # blocks the planner does not count: unset or asked for, the plan says so in one line and names the way
    # out (turning it off), which plans.
    m = load_model("granite-4.0-h-tiny")
    unset = {k: v for k, v in PC.items() if k != "enable_prefix_caching"}
    for flags in (unset, PC):
        with pytest.raises(NotModelled) as err:
            resolve_engine_config(flags, m, H100, "0.29.0")
        assert err.value.field == "enable_prefix_caching" and "set enable_prefix_caching=false" in err.value.fix
    off = resolve_engine_config({**PC, "enable_prefix_caching": False}, m, H100, "0.29.0")
    assert not off.enable_prefix_caching and plan_memory(m, H100, off).fits


def test_granite_all_mode_worked_example():
    """The module docstring's hand computation; vLLM logs it as "Setting attention block size to 512 tokens" and
    "Padding mamba page size by 30.03%"."""
    m = load_model("granite-4.0-h-tiny")
    assert m.mamba_chunk_size == 256
    c = resolve_engine_config(PC, m, H100, "0.26.0")
    assert (c.block_size, c.mamba_block_size, c.mamba_cache_mode) == (512, 512, "all")
    assert c.block_size % m.mamba_chunk_size == 0
    assert round(100 * (512 * 2048 - 806_400) / 806_400, 2) == 30.03
    lay = kv_layout(m, 1, 0, 1, c.block_size, 2, c.mamba_block_size, c.mamba_cache_mode)
    assert lay.block_bytes == 4 * 512 * 2048 and lay.groups == ("full",) + ("mamba",) * 9
    assert lay.blocks_per_request(8192, 512, 8192) == 16 + 9 * 16 == 160
    p = plan_memory(m, H100, c)
    assert p.fits and p.max_concurrency == pytest.approx(p.num_gpu_blocks / 160)
    assert p.kv_cache_tokens == int(p.num_gpu_blocks / 160 * 8192)
    assert any("Mamba cache mode 'all'" in n and "160 blocks" in n for n in p.notes)
    assert c.as_flags()["mamba_cache_mode"] == "all"
    assert "mamba_cache_mode" not in resolve_engine_config(PC, m, H100, "0.13.0").as_flags()  # no such flag yet


def test_the_real_granite_all_mode_start():
    """vLLM 0.26.0 on one H100 SXM, 2026-12-06 (random weights): 'all' mode, block 512, 14,574 blocks, 746,188
    tokens, 91.09x. Read before the rule was written (a hand count of 160 blocks a request was made from it), so a
    check, not held-out evidence. From vLLM's own 14,574 blocks the layout gives its two figures exactly; the plan's
    blocks differ by what its KV budget differs (57.01 GiB planned, 56.93 logged: the same 0.08 GiB as the start
    without prefix caching, 2026-12-06_ghtiny_u09_s256_mbt8192)."""
    summary = json.loads((GRANITE_PC / "summary.json").read_text())
    text = gzip.decompress((GRANITE_PC / "server.log.gz").read_bytes()).decode()
    parsed = parse_log(text)
    assert "Mamba cache mode is set to 'all' for GraniteMoeHybridForCausalLM" in text
    assert "Setting attention block size to 512 tokens" in text and "Padding mamba page size by 30.03%" in text
    m = load_model("granite-4.0-h-tiny")
    c = resolve_engine_config(serving_flags(summary["flags"]), m, H100, "0.26.0")
    lay = kv_layout(m, 1, 0, 1, c.block_size, 2, c.mamba_block_size, c.mamba_cache_mode)
    # the block count as the metrics logger prints it (the log parser derives one from the tokens at 16 a block)
    assert re.findall(r"num_gpu_blocks is: (\d+)", text) == ["14574"] and parsed.available_kv_gib == 56.93
    assert 14574 * lay.block_bytes / 2**30 == pytest.approx(56.93, abs=0.005)
    per_request = lay.blocks_per_request(8192, c.block_size, c.max_in_flight_tokens)
    assert parsed.max_concurrency == round(14574 / per_request, 2) == 91.09
    assert parsed.kv_cache_tokens == int(14574 / per_request * 8192) == 746_188
    p = plan_memory(m, H100, c, compile_cache_warm=bool(parsed.compile_cache_hit))
    assert p.fits and p.block_size == 512
    assert p.kv_cache_tokens / 746_188 - 1 == pytest.approx(0, abs=0.005)  # planned 747,212 (+0.14%)
    assert p.max_concurrency == pytest.approx(91.09, rel=0.005)


def test_align_mode_holds_two_blocks_a_mamba_group():
    """'align' (vLLM 0.15+ for Qwen3-Next, every class's default from 0.28, or --mamba-cache-mode align): the block of
    the rule without prefix caching, the Mamba block the same, two blocks a Mamba group per request
    (MambaSpec.max_memory_usage_bytes: page x (2 + speculative blocks))."""
    m = load_model("granite-4.0-h-tiny")
    for flags, version in (({**PC, "mamba_cache_mode": "align"}, "0.26.0"), (PC, "0.28.0")):
        c = resolve_engine_config(flags, m, H100, version)
        assert (c.block_size, c.mamba_block_size, c.mamba_cache_mode) == (400, 400, "align")
        p = plan_memory(m, H100, c)
        assert p.max_concurrency == pytest.approx(p.num_gpu_blocks / (21 + 9 * 2))
    q = load_model("qwen3-next-80b-a3b")
    c = resolve_engine_config({"tensor_parallel_size": 2, "max_model_len": 32768, "enable_prefix_caching": True}, q,
                              get_gpu("H200"), "0.26.0")
    assert (c.block_size, c.mamba_block_size, c.mamba_cache_mode) == (544, 544, "align")
    p = plan_memory(q, get_gpu("H200"), c)
    assert p.fits and p.max_concurrency == pytest.approx(p.num_gpu_blocks / (-(-32768 // 544) + 3 * 2))
    # 'all' asked of a class without the support falls back to 'align' (models/config.py 569-573 of 0.26.0)
    asked = {"tensor_parallel_size": 2, "enable_prefix_caching": True, "mamba_cache_mode": "all"}
    assert resolve_engine_config(asked, q, get_gpu("H200"), "0.26.0").mamba_cache_mode == "align"


def test_what_align_mode_asserts():
    """Chunked prefill (0.15+), block_size <= max_num_batched_tokens (0.17-0.26), long_prefill_token_threshold >=
    block_size where set (0.15-0.26): vLLM's AssertionErrors at startup, planned as refusals naming the flag."""
    m = load_model("granite-4.0-h-tiny")
    align = {**PC, "mamba_cache_mode": "align"}
    with pytest.raises(SpecError) as err:
        resolve_engine_config({**align, "enable_chunked_prefill": False}, m, H100, "0.26.0")
    assert err.value.field == "enable_chunked_prefill" and "Chunked prefill is required" in err.value.message
    with pytest.raises(SpecError) as err:
        resolve_engine_config({**align, "max_num_batched_tokens": 256, "max_num_seqs": 128}, m, H100, "0.26.0")
    assert err.value.field == "max_num_batched_tokens" and "block_size (400) must be <=" in err.value.message
    assert resolve_engine_config({**align, "max_num_batched_tokens": 256, "max_num_seqs": 128}, m, H100, "0.16.0")
    assert resolve_engine_config({**align, "max_num_batched_tokens": 256, "max_num_seqs": 128}, m, H100, "0.27.0")
    with pytest.raises(SpecError) as err:
        resolve_engine_config({**align, "long_prefill_token_threshold": 128}, m, H100, "0.15.0")
    assert err.value.field == "long_prefill_token_threshold"
    # 'all' mode asserts none of these
    assert resolve_engine_config({**PC, "enable_chunked_prefill": False}, m, H100, "0.26.0").mamba_cache_mode == "all"


def test_all_mode_before_0_25_logs_the_smallest_group_block():
    """0.19.0 ('all', 16-aligned): block 512, tokens num_blocks // 10 x 512; 0.11.1 the same sizing."""
    m = load_model("granite-4.0-h-tiny")
    for version in ("0.11.1", "0.19.0"):
        c = resolve_engine_config(PC, m, H100, version)
        assert (c.block_size, c.mamba_block_size) == (512, 512)
        p = plan_memory(m, H100, c)
        assert p.kv_cache_tokens == p.num_gpu_blocks // 10 * 512
        assert p.max_concurrency == pytest.approx(p.num_gpu_blocks / 160)


def test_all_mode_shortens_the_longest_length_that_fits():
    """vLLM's estimate_max_model_len counts every Mamba group's cdiv(len, 512) blocks in 'all' mode."""
    m = load_model("granite-4.0-h-tiny")
    flags = {**PC, "kv_cache_memory_bytes": 100 * 4 * 512 * 2048, "max_num_seqs": 64}
    p = plan_memory(m, H100, resolve_engine_config(flags, m, H100, "0.26.0"))
    assert p.failure is not None and p.failure.value == "kv_too_small"
    assert p.fix is not None and "max_model_len to <= 5120" in p.fix  # 10 x cdiv(5120, 512) = 100 blocks
    off = plan_memory(m, H100, resolve_engine_config({**flags, "enable_prefix_caching": False}, m, H100, "0.26.0"))
    assert off.fits  # 21 + 9 blocks of 400 without prefix caching


def test_nemotron_h_needs_its_chunk_for_all_mode():
    """Nemotron-H names its chunk ``chunk_size`` (256 in the Nemotron-H-8B config served on the H100); a config
    without one is refused in 'all' mode (transformers' class says 128, vLLM's own 256), served in 'align'."""
    cfg = json.loads((ROOT / "tests/fixtures/real_h100_classes/2026-12-06_h100_host_e/nemh8b/config.json").read_text())
    n = profile_from_config(cfg, "nemh8b")
    assert n.mamba_chunk_size == 256
    c = resolve_engine_config(PC, n, H100, "0.26.0")
    plain = resolve_engine_config({**PC, "enable_prefix_caching": False}, n, H100, "0.26.0").block_size
    assert c.mamba_cache_mode == "all" and c.block_size % 256 == 0 and c.block_size >= plain
    assert c.block_size == 256 * math.ceil(_state_tokens(n) / 256)
    no_chunk = profile_from_config({k: v for k, v in cfg.items() if k != "chunk_size"}, "nemh8b-nochunk")
    with pytest.raises(SpecError, match="Mamba2 chunk"):
        resolve_engine_config(PC, no_chunk, H100, "0.26.0")
    assert resolve_engine_config({**PC, "mamba_cache_mode": "align"}, no_chunk, H100, "0.26.0").block_size == plain


def _state_tokens(model: ModelProfile) -> int:
    """Attention tokens one Mamba state fills at TP=1 (bf16 KV, the release's float32 SSM state)."""
    per_token = 2 * model.num_kv_heads * model.head_dim * 2
    return -(-mamba_state_bytes(model, 1, mamba_ssm_dtype_bytes(model, "float32")) // per_token)


def test_published_qwen3_next_start_had_prefix_caching_turned_off():
    """Held out (tests/fixtures/published_logs/hybrid.yaml, aether_qwen3_next_w4a16_tp2_l40s; nothing fitted on it):
    vLLM 0.13.0, TP=2 on L40S, fp8 KV, 32,768 tokens, --enable-prefix-caching; the log says "Hybrid or mamba-based
    model detected without support for prefix caching: disabling." and sets the block to 1,072. Its checkpoint (an
    unnamed W4A16 quantization) is not servetune's, so the weights are not planned; from the logged 17.58 GiB the
    layout of the rule (one Mamba block a request, 4 groups of 12 layers) gives the logged tokens and concurrency."""
    q = load_model("qwen3-next-80b-a3b")
    flags = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.92, "max_model_len": 32768, "kv_cache_dtype": "fp8",
             "enable_prefix_caching": True, "max_num_batched_tokens": 8192, "max_num_seqs": 8}
    c = resolve_engine_config(flags, q, get_gpu("L40S"), "0.13.0")
    assert (c.enable_prefix_caching, c.mamba_cache_mode, c.block_size) == (False, "none", 1072)
    log = (ROOT / "tests/fixtures/published_logs/logs/aether_qwen3_next_w4a16_tp2_l40s.log").read_text()
    assert "without support for prefix caching: disabling" in log and "block size to 1072 tokens" in log
    lay = kv_layout(q, 2, 0, 1, c.block_size, 1, c.mamba_block_size, c.mamba_cache_mode)
    # the blocks a budget logged as 17.58 GiB (17.575 to 17.585) can hold
    low, high = math.ceil(17.575 * 2**30 / lay.block_bytes), math.floor(17.585 * 2**30 / lay.block_bytes)
    assert low == high
    blocks = low
    assert lay.tokens(blocks, c.block_size) == 767_552
    assert round(blocks / lay.blocks_per_request(32768, c.block_size, c.max_in_flight_tokens), 2) == 84.29


def test_flags_of_later_releases_only():
    """--mamba-cache-mode exists from 0.15.0 (config/cache.py line 127); --mamba-block-size is refused as unmodelled."""
    m = load_model("granite-4.0-h-tiny")
    with pytest.raises(SpecError) as err:
        resolve_engine_config({**PC, "mamba_cache_mode": "align"}, m, H100, "0.14.1")
    assert err.value.field == "mamba_cache_mode"
    with pytest.raises(SpecError) as err:
        resolve_engine_config({**PC, "mamba_block_size": 256}, m, H100, "0.26.0")
    assert "not modelled" in err.value.message
