"""The B200's kernel rates from published kernel benchmarks (no B200 in hand, nothing fitted on a B200 run).

Three constants, each next to its source in the code: the Triton fused-MoE kernel's compute share on
data-center Blackwell (``perf_classes.BLACKWELL_TRITON_MOE_SHARE``: a Triton matmul timed on an H100
and a B200, tile-ai/tilelang#1787), its weight-streaming share there (``perf_classes.blackwell_moe_mem_share``:
vLLM's ``benchmark_moe.py`` on a B200, vllm-project/vllm#31448) and the B200's all-reduce share of its
NVLink (``_calibration.B200_INTERCONNECT_EFFICIENCY``: nccl-tests on 8 x H200 and 8 x B200). Since 2026-12-07 a
fourth: the B200's dense GEMMs at cuBLAS's published sustained rate (``perf_classes.B200_CUBLAS_SHARE``: torch.matmul
at 8192^3 on a B200, pytorch/ao#2427), the Triton MoE share taken against it so that kernel's rate is unchanged. Since
2026-12-07 a fifth: a fused-MoE tile of at most 64 rows at the B200's 64-row UMMA ceiling, half its 128-row rate
(``perf_classes.BLACKWELL_TRITON_MOE_NARROW_SHARE``: SemiAnalysisAI/microbench-blackwell's UMMA throughput).
"""

from __future__ import annotations

import pytest

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import ModelProfile, load_model
from servetune.sim import _calibration, perf_classes
from servetune.sim.perf import Calibration, PerfModel, calibration_for

B200, H200, H100 = get_gpu("B200"), get_gpu("H200"), get_gpu("H100-80GB")
QWEN_MOE = load_model("qwen3-30b-a3b")  # bf16 experts: Triton's fused_moe_kernel
GPT_OSS = load_model("gpt-oss-20b")  # MXFP4 experts: FlashInfer's kernels on SM100
HOPPER = perf_classes.MOE_COMPUTE_SHARE["triton"]["hopper"]


def perf_at(model: ModelProfile, gpu: object, version: str, knobs: dict[str, float] | None = None) -> PerfModel:
    cal = calibration_for(gpu).with_overrides(knobs or {})  # type: ignore[arg-type]
    return PerfModel(model, gpu, resolve_engine_config({}, model, gpu, vllm_version=version), cal)  # type: ignore[arg-type]


def test_the_published_rates_behind_the_share_hold_the_gpu_tables_peaks() -> None:
    assert perf_classes.DATASHEET_BF16_TFLOPS == {name: get_gpu(name).bf16_tflops
                                                  for name in perf_classes.DATASHEET_BF16_TFLOPS}
    assert set(perf_classes.TRITON_BF16_MATMUL_TFLOPS) == {"H100-80GB", "B200"}
    triton = perf_classes.TRITON_BF16_MATMUL_TFLOPS
    # Triton's matmul keeps 0.745 of the datasheet ratio from H100 to B200 (1.694 of 2.275).
    kept = (triton["B200"] / triton["H100-80GB"]) / (B200.bf16_tflops / H100.bf16_tflops)
    assert kept == pytest.approx(0.7446, abs=1e-4)
    dense = perf_classes.HOPPER_COMPUTE_EFFICIENCY / perf_classes.B200_CUBLAS_SHARE  # against the B200's own cuBLAS rate
    assert perf_classes.BLACKWELL_TRITON_MOE_SHARE == pytest.approx(HOPPER * kept * dense, rel=1e-12)
    assert 0.27 < perf_classes.BLACKWELL_TRITON_MOE_SHARE < HOPPER
    # The Triton kernel's own rate: Hopper's fitted MoE rate times the Triton matmul's H100 -> B200 ratio, 389 TFLOP/s.
    b200_rate = B200.bf16_tflops * calibration_for(B200).compute_efficiency * perf_classes.BLACKWELL_TRITON_MOE_SHARE
    hopper_rate = H100.bf16_tflops * calibration_for(H100).compute_efficiency * HOPPER
    assert b200_rate == pytest.approx(hopper_rate * triton["B200"] / triton["H100-80GB"], rel=1e-9)
    assert b200_rate == pytest.approx(389.5, abs=0.5)
    # A sourced figure, not a fitted cell: the fit half's table has no Blackwell entry.
    assert all("blackwell" not in cells for cells in perf_classes.MOE_COMPUTE_SHARE.values())


def test_bf16_experts_on_a_b200_at_vllm_0_14_compute_at_the_sourced_share() -> None:
    """vLLM 0.14.1's untuned 64 x 64 tile (no B200 file for these experts in 0.11's table) runs at the 64-row
    UMMA ceiling's share, 0.182 (since 2026-12-07; the tuned matmul's 0.274 before)."""
    tokens = 8192
    b200 = perf_at(QWEN_MOE, B200, "0.14.1")
    narrow = perf_classes.BLACKWELL_TRITON_MOE_NARROW_SHARE
    at_sourced = perf_at(QWEN_MOE, B200, "0.14.1", {"moe_compute_share": narrow})
    at_hopper = perf_at(QWEN_MOE, B200, "0.14.1", {"moe_compute_share": HOPPER})
    assert b200.moe_seconds(tokens) == pytest.approx(at_sourced.moe_seconds(tokens), rel=1e-12)
    # 0.182 against Hopper's 0.3 of the B200's own (cuBLAS) dense rate (0.274 before 2026-12-07's 64-row rule).
    assert b200.moe_seconds(tokens) > 1.4 * at_hopper.moe_seconds(tokens)
    shape = perf_classes.moe_shape(QWEN_MOE, B200, 1, QWEN_MOE.num_layers)
    assert shape is not None and perf_classes.runs_blackwell_triton_moe(B200, shape, (0, 14, 1))
    # The Hopper parts keep their fitted share.
    h200 = perf_at(QWEN_MOE, H200, "0.14.1")
    assert h200.moe_seconds(tokens) == pytest.approx(perf_at(QWEN_MOE, H200, "0.14.1", {"moe_compute_share": HOPPER})
                                                     .moe_seconds(tokens), rel=1e-12)


def test_the_blackwell_rule_stops_where_vllm_leaves_triton_or_the_experts_are_not_16_bit() -> None:
    bf16 = perf_classes.moe_shape(QWEN_MOE, B200, 1, QWEN_MOE.num_layers)
    mxfp4 = perf_classes.moe_shape(GPT_OSS, B200, 1, GPT_OSS.num_layers)
    assert bf16 is not None and mxfp4 is not None
    assert not perf_classes.runs_blackwell_triton_moe(B200, bf16, perf_classes.BLACKWELL_TRITON_MOE_UNTIL)
    assert not perf_classes.runs_blackwell_triton_moe(B200, mxfp4, (0, 14, 1))
    assert not perf_classes.runs_blackwell_triton_moe(H200, bf16, (0, 14, 1))
    # From 0.20 (FlashInfer's MoE by default on SM100) the B200 is priced as before: Hopper's share, the dense streaming rate.
    tokens = 8192
    new = perf_at(QWEN_MOE, B200, "0.20.0")
    assert new.moe_seconds(tokens) == pytest.approx(perf_at(QWEN_MOE, B200, "0.20.0", {"moe_compute_share": HOPPER})
                                                    .moe_seconds(tokens), rel=1e-12)


def test_the_b200_fused_moe_streams_weights_at_its_published_marginal_rate() -> None:
    # vllm#31448's B200 timings at 1 and 4 tokens: 8 and 29.1 experts touched (E=128, top-8), 9.44 MB each.
    per_expert = 3 * 2048 * 768 * 2
    added = (perf_classes.distinct_experts(128, 8, 4) - perf_classes.distinct_experts(128, 8, 1)) * per_expert
    assert perf_classes.fused_moe_marginal_gbps() == pytest.approx(added / ((73.18 - 39.61) * 1e-6) / 1e9, rel=1e-9)
    assert 5900 < perf_classes.fused_moe_marginal_gbps() < 6000  # 0.742 of the B200's 8,000 GB/s
    cal = calibration_for(B200)
    share = perf_classes.blackwell_moe_mem_share(B200, cal.mem_efficiency)
    assert share == pytest.approx(perf_classes.fused_moe_marginal_gbps() / (B200.hbm_gbps * cal.mem_efficiency))
    assert 0.93 < share < 0.95
    # A decode of one token reads its top-k experts at that rate (no kernel floor here).
    no_floor = {"moe_layer_floor_s": 0.0}
    b200 = perf_at(QWEN_MOE, B200, "0.14.1", no_floor)
    shape = perf_classes.moe_shape(QWEN_MOE, B200, 1, QWEN_MOE.num_layers)
    assert shape is not None
    rate = B200.hbm_gbps * 1e9 * cal.mem_efficiency * cal.moe_mem_share * share
    # Within 4%: the 16-row tile's compute at the 64-row ceiling's share (2026-12-07) blends in 3.2% (1.2% before).
    assert b200.moe_seconds(1) == pytest.approx(8 * shape.expert_bytes * shape.layers / rate, rel=0.04)
    assert b200.moe_seconds(1) > 1.05 * perf_at(QWEN_MOE, B200, "0.20.0", no_floor).moe_seconds(1)


def test_the_b200_dense_gemms_run_at_cublas_published_sustained_rate() -> None:
    # pytorch/ao#2427: torch.matmul bf16 at 8192^3 on a B200, 1.42e15 FLOP/s (pct_peak 0.631).
    assert perf_classes.CUBLAS_BF16_MATMUL_TFLOPS["B200"] == 1420.0
    assert perf_classes.B200_CUBLAS_SHARE == pytest.approx(1420.0 / B200.bf16_tflops) == pytest.approx(0.6311, abs=1e-4)
    assert calibration_for(B200).compute_efficiency == perf_classes.B200_CUBLAS_SHARE
    # Hopper's calibrated share, which the fitted MoE share is a share of, is the one the module names.
    assert (calibration_for(H200).compute_efficiency == calibration_for(H100).compute_efficiency
            == Calibration().compute_efficiency == perf_classes.HOPPER_COMPUTE_EFFICIENCY)
    # A dense model's 8,192-token prefill GEMMs on a B200: compute-bound, so about 0.775 / 0.631 = 1.23x the H200's share.
    dense = load_model("qwen3-32b")
    at_h200_share = perf_at(dense, B200, "0.14.1", {"compute_efficiency": Calibration().compute_efficiency})
    ratio = sum(perf_at(dense, B200, "0.14.1").layer_gemm_seconds(8192)) / sum(at_h200_share.layer_gemm_seconds(8192))
    assert 1.15 < ratio < 1.23


def test_the_b200_all_reduce_share_comes_from_published_nccl_tests() -> None:
    table = _calibration.NCCL_ALLREDUCE_BUSBW_GBPS
    assert {g: link for g, (_, link) in table.items()} == {"H200": H200.interconnect_gbps, "B200": B200.interconnect_gbps}
    h200_share, b200_share = (busbw / link for busbw, link in (table["H200"], table["B200"]))
    assert h200_share == pytest.approx(475 / 450) and b200_share == pytest.approx(830 / 900)
    expected = Calibration().interconnect_efficiency * b200_share / h200_share
    assert _calibration.B200_INTERCONNECT_EFFICIENCY == pytest.approx(expected, rel=1e-12)
    assert calibration_for(B200).interconnect_efficiency == pytest.approx(0.6116, abs=1e-4)
    assert calibration_for(H200).interconnect_efficiency == calibration_for(H100).interconnect_efficiency == 0.7
    # Every other B200 knob stays the H200's.
    b200, h200 = calibration_for(B200), calibration_for(H200)
    assert {k for k in vars(b200) if getattr(b200, k) != getattr(h200, k)} == {"interconnect_efficiency", "compute_efficiency"}


def test_the_rtx_5090s_dense_gemms_run_at_cublas_published_sustained_rate_and_nothing_else_moves() -> None:
    """The GeForce RTX 5090 prices its dense GEMMs at the median of four published torch.matmul timings
    (234.8 TFLOP/s at 8192^3, 1.123 of the datasheet's 209: its cards run above the rated boost clock); its
    memory-bound kernels and FlashAttention-2 prefill keep their rates, and no other GPU's calibration moves."""
    rtx = get_gpu("RTX-5090")
    share = perf_classes.CUBLAS_BF16_MATMUL_TFLOPS["RTX-5090"] / perf_classes.DATASHEET_BF16_TFLOPS["RTX-5090"]
    assert _calibration.GPU_FAMILY_OVERRIDES["RTX-5090"] == {"compute_efficiency": pytest.approx(share)}
    cal = calibration_for(rtx)
    assert cal.compute_efficiency == pytest.approx(1.1234, abs=1e-4)
    assert rtx.bf16_tflops * cal.compute_efficiency == pytest.approx(234.8)
    base = calibration_for(get_gpu("RTX-4090"))  # another FlashAttention-2 GeForce part: the shared rule
    assert (cal.mem_efficiency, cal.attn_efficiency) == (base.mem_efficiency, base.attn_efficiency)
    assert base.compute_efficiency == Calibration().compute_efficiency
    # A 4,096-token prefill of an 8B: the GEMMs 1.45x faster than at the H200's share; one-token decode unmoved.
    model = load_model("llama-3.1-8b")
    config = resolve_engine_config({}, model, rtx, vllm_version="0.22.1")
    now = PerfModel(model, rtx, config, cal)
    before = PerfModel(model, rtx, config, cal.with_overrides({"compute_efficiency": Calibration().compute_efficiency}))
    n = 4096
    assert before.gpu_cost(1, n, n, n * n // 2, False).gemm / now.gpu_cost(1, n, n, n * n // 2, False).gemm \
        == pytest.approx(share / Calibration().compute_efficiency, rel=0.02)
    assert now.gpu_cost(1, 1, 0, 0, True).gemm == pytest.approx(before.gpu_cost(1, 1, 0, 0, True).gemm, rel=0.01)


def test_a_tile_of_64_rows_runs_at_half_the_b200s_umma_rate_and_keeps_hoppers_share_of_that_ceiling() -> None:
    """SemiAnalysisAI/microbench-blackwell (umma_throughput/tput_results_max.csv, commit 9a068d8): a 64-row BF16
    UMMA does 4,026 FLOPs a cycle on one SM, a 128 x 256 one 8,153; Hopper's wgmma is 64 rows at every shape. The
    fused-MoE kernel's untuned 64 x 64 tile keeps the fitted Hopper share of that ceiling: 0.182 of the B200's dense
    rate, 258 TFLOP/s, 1.12x the H100's 230 (the tuned Triton matmul's ratio, 1.69x, gave 389)."""
    umma = perf_classes.BLACKWELL_UMMA_BF16_FLOPS_PER_CYCLE
    assert umma == {64: 4026.28, 128: 8152.85} and umma[64] / umma[128] == pytest.approx(0.4939, abs=1e-4)
    narrow = perf_classes.BLACKWELL_TRITON_MOE_NARROW_SHARE
    dense = perf_classes.HOPPER_COMPUTE_EFFICIENCY / perf_classes.B200_CUBLAS_SHARE
    assert narrow == pytest.approx(HOPPER * umma[64] / umma[128] * dense, rel=1e-12)
    assert narrow == pytest.approx(0.1819, abs=1e-4)
    b200_rate = B200.bf16_tflops * calibration_for(B200).compute_efficiency * narrow
    hopper_rate = H100.bf16_tflops * calibration_for(H100).compute_efficiency * HOPPER
    assert b200_rate == pytest.approx(258.3, abs=0.5) and b200_rate / hopper_rate == pytest.approx(1.124, abs=0.002)
    # A tile of more than 64 rows keeps the tuned Triton matmul's share; 16- to 64-row tiles take the ceiling's.
    assert [perf_classes.blackwell_triton_tile_share(m) for m in (16, 64, 128, 256)] == [
        narrow, narrow, perf_classes.BLACKWELL_TRITON_MOE_SHARE, perf_classes.BLACKWELL_TRITON_MOE_SHARE]
    # vLLM 0.17's by-batch default runs 8,192 tokens on a 128-row tile: priced as before the rule, at the wide share.
    wide = perf_at(QWEN_MOE, B200, "0.17.0", {"moe_compute_share": perf_classes.BLACKWELL_TRITON_MOE_SHARE})
    assert perf_at(QWEN_MOE, B200, "0.17.0").moe_seconds(8192) == pytest.approx(wide.moe_seconds(8192), rel=1e-12)
    # The Hopper parts and a set moe_compute_share are untouched by the tile rule.
    assert perf_at(QWEN_MOE, H100, "0.14.1").moe_seconds(8192) == pytest.approx(
        perf_at(QWEN_MOE, H100, "0.14.1", {"moe_compute_share": HOPPER}).moe_seconds(8192), rel=1e-12)
