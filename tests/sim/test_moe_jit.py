"""The fused-MoE kernel's first-use compiles (servetune.sim.moe_jit), pinned to vLLM's source.

Sources (read 2026-12-06 at vLLM 0.11.0, 0.14.1, 0.19.0 and 0.26.0): ``fused_moe_kernel`` takes ``EM`` and
``num_valid_tokens`` as plain ints (``model_executor/layers/fused_moe/fused_moe.py:330-331@0.14.1``), which
Triton keys on 1 / divisible by 16 / neither; ``EM`` is ``moe_align_block_size``'s padded length
(``moe_align_block_size.py:74@0.14.1``); the default tile is one of two split at ``M <= E`` up to 0.14
(``fused_moe.py:1270@0.14.1``) and banded by ``M`` from 0.19 (``fused_moe.py:1278-1310@0.19.0``); startup
runs the model at ``max_num_batched_tokens`` (``v1/worker/gpu_model_runner.py:4743@0.14.1``,
``model_executor/warmup/kernel_warmup.py:93@0.14.1``), at every capture size and at
``min(max_num_seqs, max_num_batched_tokens)`` (``v1/worker/gpu_worker.py:417-528@0.14.1``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from published_runs import FIXTURES, judge, load_runs, resolve_model, server_cache

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.sim.moe_jit import COMPILE_S, MoeJitRule, TritonCache, first_use_s, moe_jit_rule

GPT_OSS = resolve_model("gpt-oss-120b-bf16", FIXTURES)
H100 = get_gpu("H100-80GB")
MOE_RUNS = load_runs([FIXTURES / "nvlink_moe.yaml"])


def _rule(version: str = "0.14.1", **flags: object) -> MoeJitRule:
    config = resolve_engine_config({"tensor_parallel_size": 8, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                                    **flags}, GPT_OSS, H100, version)
    rule = moe_jit_rule(GPT_OSS, H100, config)
    assert rule is not None
    return rule


def test_startup_compiles_the_aligned_variants_and_a_step_of_unaligned_size_above_the_capture_range_compiles_two() -> None:
    rule = _rule()
    assert (rule.num_experts, rule.top_k, rule.tuned, rule.startup_tokens) == (128, 4, (), (8192, 256))
    cache = TritonCache(set(rule.warm()))
    assert {v.tile for v in cache.variants} == {(16, 32, 64, 1), (64, 64, 32, 8)}
    assert first_use_s(rule, cache, 8192) == 0.0     # the memory profile's own size
    assert first_use_s(rule, cache, 5000) == 0.0     # 4 * 5000 divisible by 16: the same variant
    assert first_use_s(rule, cache, 511) == 0.0      # runs padded to the 512 capture size
    assert first_use_s(rule, cache, 3697) == pytest.approx(2 * COMPILE_S)  # w13 and w2, EM and M*top_k unaligned
    assert first_use_s(rule, cache, 1193) == 0.0     # once per server
    assert {(v.gemm, v.em, v.valid) for v in rule.variants(3697)} == {("w13", "", ""), ("w2", "", "")}


def test_a_complete_cache_and_models_off_the_triton_kernel_pay_nothing() -> None:
    rule = _rule()
    assert first_use_s(rule, TritonCache(complete=True), 3697) == 0.0
    assert first_use_s(None, TritonCache(), 3697) == 0.0
    config = resolve_engine_config({"tensor_parallel_size": 8}, load_model("gpt-oss-120b"), H100, "0.14.1")
    assert moe_jit_rule(load_model("gpt-oss-120b"), H100, config) is None      # MXFP4 experts: another kernel
    dense = load_model("llama-3.1-8b")
    assert moe_jit_rule(dense, H100, resolve_engine_config({}, dense, H100, "0.14.1")) is None


def test_the_default_tile_splits_at_e_up_to_0_16_and_by_batch_band_from_0_17() -> None:
    """vllm-project/vllm#34846 (``fused_moe.py:1277-1322@v0.17.0``; 0.16.0's ``:1267-1282`` split at ``M <= E``)."""
    old, new = _rule("0.14.1"), _rule("0.19.0")
    assert old.tile(128) != old.tile(129) == old.tile(8192)
    assert _rule("0.16.0").tile(8192) == old.tile(8192) and _rule("0.17.0").tile(8192) == new.tile(8192)
    assert new.tile(512) != new.tile(513) == new.tile(8192)
    assert new.tile(32)[0] == 16 and new.tile(96)[0] == 32 and new.tile(512)[0] == 64 and new.tile(513)[0] == 128


def test_without_cuda_graphs_a_decode_batch_of_odd_size_compiles_the_small_tile() -> None:
    rule = _rule(enforce_eager=True)
    assert rule.capture_sizes == ()
    cache = TritonCache(set(rule.warm()))
    assert first_use_s(rule, cache, 101) == pytest.approx(2 * COMPILE_S)
    assert first_use_s(_rule(), TritonCache(set(_rule().warm())), 101) == 0.0  # padded to 104, captured


def test_a_servers_later_runs_start_with_the_variants_its_first_run_compiled() -> None:
    first, second = MOE_RUNS[0], MOE_RUNS[1]
    assert not first.workload.get("after_input_len") and second.workload.get("after_input_len") == 1024
    assert not server_cache(first).variants
    carried = server_cache(second)
    assert any(v.valid == "" and v.tile[0] == 64 for v in carried.variants)
    cold, warm = judge(first), judge(first, triton_cache=carried)
    assert cold.sim_output_throughput is not None and warm.sim_output_throughput is not None
    assert warm.sim_output_throughput > 1.1 * cold.sim_output_throughput   # the stall is gone on a warm server
    other = next(r for r in MOE_RUNS if r.layout["dp"] == 2 and r.workload.get("after_input_len"))
    assert server_cache(other).variants  # its own server's first run, not the TP=8 server's


def test_on_the_gpt_oss_first_bursts_the_stall_lands_before_the_first_tokens() -> None:
    # Judged on held-out runs (none was fitted): the TP=8 first bursts were simulated 24% (H100) and 36% (H200)
    # fast with the rule off, 15% and 24% since the unaligned expert width is priced (perf_classes.moe_down_share);
    # since vLLM 0.14's async-scheduling default is applied to these 0.14.1 runs (vllm_rules.async_scheduling_default)
    # they are +6% and +13% with the rule, +28% and +40% without it. Until 2026-12-06 the simulated burst reached
    # the unaligned variant only at its last prefill step, so the stall moved the throughput and left the TTFT
    # -41.7% / -37.5% (the real stall came before the first tokens; the rule on or off moved it under 5 points).
    # Since the batch after an idle engine's first one is drained after that one was scheduled and submitted
    # (sim/_timeline.py, vLLM's engine-core loop; tests/sim/test_batch_formation.py), that second batch holds
    # the first request's decode token and the prompts that entered meanwhile, an unaligned count above 512
    # tokens: the compiles stall every later first token, TTFT -1.4% / +7.8% (off: -43.5% / -39.5%), the
    # throughput +6.2% / +13.0% (was +6.1% / +12.9%). Since the unaligned width's down matrix streams at its per-SM
    # cap (_moe_tiles.MOE_UNALIGNED_DOWN_GBPS, 2026-12-06): throughput -6.5% / -5.4% (off: +9.8% / +13.0%, was
    # above +25%), TTFT -0.9% / +8.3%.
    firsts = {r.id: r for r in MOE_RUNS if not r.workload.get("after_input_len") and r.layout["tp"] == 8}
    for run_id, low, high in (("h100-gpt-oss-120b-bf16-tp8-rand1024x128-c100", -0.09, 0.0),
                              ("h200-gpt-oss-120b-bf16-tp8-rand1024x128-c100", -0.09, 0.0)):
        on, off = judge(firsts[run_id]), judge(firsts[run_id], triton_cache=TritonCache(complete=True))
        assert off.headline_error is not None and off.headline_error > 0.08
        assert on.headline_error is not None and low < on.headline_error < high, on.headline_error
        assert on.ttft_error is not None and off.ttft_error is not None
        assert off.ttft_error < -0.3 and -0.1 < on.ttft_error < 0.15, (on.ttft_error, off.ttft_error)


def test_other_fixture_paths_fall_back_to_a_cold_server() -> None:
    run = dataclasses.replace(MOE_RUNS[1], file="not_a_fixture.yaml")
    assert not server_cache(run).variants
    assert Path(FIXTURES / MOE_RUNS[1].file).exists()
