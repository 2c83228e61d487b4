"""The step-time model: roofline shape, CUDA graphs vs eager, TP/PP costs, calibration lookup."""

from __future__ import annotations

import dataclasses
import types

import pytest

from servetune.errors import SpecError
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.sim.perf import (FA2_KNOBS, GPU_CALIBRATION, GPU_FAMILY_OVERRIDES, Calibration, PerfModel, calibration_for,
                                runs_flash_attention_2, wave_fill)

LLAMA8B = load_model("llama-3.1-8b")
QWEN14B = load_model("qwen2.5-14b")
TINY = load_model("servetune-test-850m")
H100 = get_gpu("H100-80GB")
H200 = get_gpu("H200")


def perf(model=LLAMA8B, gpu=H100, **flags: object) -> PerfModel:
    return PerfModel(model, gpu, resolve_engine_config(flags, model, gpu))


def decode(p: PerfModel, batch: int, context: int) -> float:
    return p.step_time(batch, batch, batch * context, batch * context, decode_only=True)


def test_decode_is_memory_bound_and_grows_with_context() -> None:
    p = perf()
    cal = p.calibration
    one = p.gpu_time(1, 1, 100, 100, decode_only=True)
    # One token streams every weight but the embedding table (a gather of one row), plus the FULL
    # graph's fixed cost (its replay and each layer's kernel ramps) and the attention kernels' own.
    streamed = LLAMA8B.weight_bytes_per_gpu(1, 1) - LLAMA8B.vocab_size * LLAMA8B.hidden_size * 2
    fixed = cal.graph_launch_s + (cal.full_graph_layer_s + cal.attn_layer_s) * LLAMA8B.num_layers
    assert one - fixed == pytest.approx(streamed / (H100.hbm_gbps * 1e9 * cal.mem_efficiency), rel=0.05)
    assert decode(p, 64, 4000) > decode(p, 64, 1000) > decode(p, 64, 100)
    # Doubling a small batch costs far less than double: the weights are read once per step.
    assert decode(p, 16, 1000) < 1.3 * decode(p, 8, 1000)


def test_a_full_graph_decode_step_pays_each_layers_kernel_ramps_and_no_other_step_does() -> None:
    """full_graph_layer_s: a decode batch replayed as one FULL CUDA graph pays it once per layer of
    the model (the same constant at 32 and 48 layers); a mixed batch (PIECEWISE graphs), a batch
    above the largest capture size and an eager step have their own per-layer costs and none of it."""
    without = Calibration().with_overrides({"full_graph_layer_s": 0.0})
    with_it = without.with_overrides({"full_graph_layer_s": 20e-6})
    for model in (LLAMA8B, QWEN14B):
        for flags in ({"max_model_len": 4096}, {"max_model_len": 4096, "enforce_eager": True}):
            config = resolve_engine_config(flags, model, H200)
            p0, p1 = PerfModel(model, H200, config, without), PerfModel(model, H200, config, with_it)
            extra = p1.gpu_time(32, 32, 32_000, 32_000, True) - p0.gpu_time(32, 32, 32_000, 32_000, True)
            assert extra == pytest.approx(0.0 if flags.get("enforce_eager") else 20e-6 * model.num_layers, abs=1e-9)
            mixed = (40, 1024, 40_000, 600_000, False)
            assert p1.gpu_time(*mixed) == p0.gpu_time(*mixed)
            big = p0.max_capture + 8 if p0.max_capture else 600
            assert p1.gpu_time(big, big, big * 1000, big * 1000, True) == p0.gpu_time(big, big, big * 1000, big * 1000, True)


def test_prefill_is_compute_bound_and_scales_with_tokens() -> None:
    p = perf()
    t1 = p.gpu_time(1, 4096, 4096, 4096 * 4097 // 2, decode_only=False)
    t2 = p.gpu_time(2, 8192, 8192, 2 * 4096 * 4097 // 2, decode_only=False)
    flops = 2 * LLAMA8B.active_param_count * 4096
    assert t1 > flops / (H100.bf16_tflops * 1e12)  # never faster than the dense peak
    assert t2 == pytest.approx(2 * t1, rel=0.1)


def test_step_time_scales_with_the_model_from_its_shapes() -> None:
    # No constant is fitted per size: a 1024-token prefill chunk (attention a small share of its
    # FLOPs) costs per token what the active parameters say, and a one-token decode what the
    # streamed bytes say, from 0.85B to 14B.
    cal = Calibration()
    cost = {}
    for model in (TINY, LLAMA8B, QWEN14B):
        p = PerfModel(model, H200, resolve_engine_config({"max_model_len": 4096}, model, H200), cal)
        cost[model.name] = (p.gpu_time(1, 1024, 1024, 1024 * 1025 // 2, False) / 1024,
                            p.gpu_time(1, 1, 100, 100, True))
    for small, big in ((TINY, LLAMA8B), (LLAMA8B, QWEN14B)):
        prefill_ratio = cost[big.name][0] / cost[small.name][0]
        assert prefill_ratio == pytest.approx(big.active_param_count / small.active_param_count, rel=0.35)
        decode_ratio = cost[big.name][1] / cost[small.name][1]
        assert decode_ratio == pytest.approx(big.param_count / small.param_count, rel=0.35)


def test_gemm_efficiency_comes_from_the_tile_grid() -> None:
    assert wave_fill(8192, 14336, 132) > 0.95  # many full waves
    assert wave_fill(64, 4096, 132) <= 0.75  # 64 tokens: half-height tiles at most, a lower rate
    assert all(0 < wave_fill(m, n, 132) <= 1.0 for m in (1, 100, 513, 8192) for n in (256, 3000, 152064))
    # A few hundred tokens leave part of the last wave idle; thousands amortise it.
    assert wave_fill(8192, 4096, 132) > wave_fill(1536, 4096, 132) + 0.05


def test_the_wave_model_fills_the_gpus_own_sms_not_an_h100s() -> None:
    """GpuSpec.sm_count (2026-12-06; before it every GPU took an H100's 132): 1,024 tokens against a 4,096-wide
    output are 128 tiles of 128 x 256, one wave on 132 SMs but two on an A100's 108, where 128 x 128 tiles
    (three waves) do best at 0.71. A GPU with no SM count takes DEFAULT_SMS."""
    from servetune.sim._perf_gemm import DEFAULT_SMS

    assert DEFAULT_SMS == 132 and wave_fill(1024, 4096, 132) == 1.0
    assert wave_fill(1024, 4096, 108) == pytest.approx(0.9 * 256 / 324)
    a100 = get_gpu("A100-80GB")
    assert a100.sm_count == 108
    config = resolve_engine_config({}, LLAMA8B, a100)
    own, h100_grid = (PerfModel(LLAMA8B, g, config) for g in (a100, dataclasses.replace(a100, sm_count=0)))
    o_proj = 1  # qkv, o, gate_up, down: o is 4,096 wide on one GPU
    assert own.layer_gemm_shapes[o_proj][0] == 4096
    assert own.layer_gemm_seconds(1024)[o_proj] > 1.3 * h100_grid.layer_gemm_seconds(1024)[o_proj]


def test_token_side_tiles_cover_a_batch_off_the_128_row_grid() -> None:
    """gemm_token_tile (0 by default: the 64/128-row grid alone): vLLM's cuBLAS kernels covered 166
    tokens with tiles 72-176 wide, not two 128-row tiles, 35% of them idle."""
    for m in (300, 1024, 8192):  # past 256 tokens nothing changes
        assert wave_fill(m, 28672, 132, token_tile=8) == wave_fill(m, 28672, 132)
    for m in range(1, 257, 5):  # a choice more, never a worse one
        assert wave_fill(m, 28672, 132, token_tile=8) >= wave_fill(m, 28672, 132)
    assert wave_fill(166, 28672, 132, token_tile=8) > 1.25 * wave_fill(166, 28672, 132)
    assert wave_fill(192, 28672, 132, token_tile=8) > 1.2 * wave_fill(192, 28672, 132)
    assert all(0 < wave_fill(m, n, 132, token_tile=8) <= 1.0 for m in range(1, 257, 7) for n in (256, 3000, 152064))
    # The step model prices with the calibration's tiles: 0 turns them off (the grid alone).
    model = load_model("llama-3.1-8b")
    config = resolve_engine_config({}, model, H200)
    grid_only, tiled = (PerfModel(model, H200, config, calibration_for(H200).with_overrides({"gemm_token_tile": t}))
                        for t in (0, 8))
    assert sum(grid_only.layer_gemm_seconds(166)) > 1.1 * sum(tiled.layer_gemm_seconds(166))
    assert grid_only.layer_gemm_seconds(1024) == tiled.layer_gemm_seconds(1024)


def test_prefill_attention_and_decode_attention_cost_differently() -> None:
    p = perf(gpu=H200)
    # The same 64 x 2048 tokens of context: read by 64 decode requests (KV streamed) or attended
    # by one 64-token prefill chunk of a 2048-token prompt (FLOPs, the KV read once).
    as_decode = p.gpu_time(64, 64, 64 * 2048, 64 * 2048, False, 0, 0, 0)
    as_prefill = p.gpu_time(1, 64, 2048, 64 * 2048, False, 64, 2048, 64 * 2048)
    assert as_decode > as_prefill


def test_enforce_eager_launches_hide_behind_gemms_not_attention_and_no_engine_cpu_hides() -> None:
    """The eager rule (servetune.sim.perf): the layers' launch floor is covered by the GEMMs and
    small kernels as far as their GPU time reaches; attention adds to it; the engine CPU is paid
    whole (the launching thread is the scheduling one); the floor scales with the host's CPU
    factor. Read off the H200 host 2026-12-04h's 8B eager decode steps: 14.8 ms at 4 in flight,
    31.5 ms at 256 with ~1,150-token contexts, against 18.7 ms with CUDA graphs."""
    cal = Calibration(eager_layer_overhead_s=400e-6)

    def model_perf(model, calibration=cal, **flags):  # type: ignore[no-untyped-def]
        config = resolve_engine_config({"max_num_seqs": 256, **flags}, model, H200)
        return PerfModel(model, H200, config, calibration)

    eager, graphs = model_perf(LLAMA8B, enforce_eager=True), model_perf(LLAMA8B)
    floor = LLAMA8B.num_layers * cal.eager_layer_overhead_s
    # A small decode batch is launch-bound: the floor, plus its attention (tiny at 4 x 400 tokens).
    small = eager.gpu_cost(4, 4, 4 * 400, 4 * 400, True)
    assert small.gemm + small.elementwise + small.kv_write < floor
    assert small.seconds == pytest.approx(floor + small.attention)
    # A long-context batch: the attention adds on top of the floor rather than hiding it.
    long = eager.gpu_cost(256, 256, 256 * 1150, 256 * 1150, True)
    assert long.attention > 0.4 * floor
    assert long.seconds == pytest.approx(floor + long.attention)
    assert long.seconds > 1.3 * graphs.gpu_time(256, 256, 256 * 1150, 256 * 1150, True)
    # No engine CPU hides under eager; with CUDA graphs async scheduling hides most of it.
    cpu = cal.step_overhead_s + cal.seq_overhead_s * 256
    assert eager.step_time(256, 256, 256 * 1150, 256 * 1150, True) == pytest.approx(long.seconds + cpu)
    assert graphs.step_time(256, 256, 256 * 1150, 256 * 1150, True) < graphs.gpu_time(
        256, 256, 256 * 1150, 256 * 1150, True) + 0.5 * cpu
    # An 8,192-token prefill chunk's GEMMs outlast the launches: eager adds only its engine CPU.
    chunk = (1, 8192, 8192, 8192 * 8193 // 2, False)
    q_eager, q_compiled = model_perf(QWEN14B, enforce_eager=True), model_perf(QWEN14B)
    assert q_eager.gpu_cost(*chunk).launch == 0.0
    assert q_eager.gpu_time(*chunk) <= q_compiled.gpu_time(*chunk)
    # A host whose CPU is 1.5x the calibration's launches 1.5x slower.
    slow_host = model_perf(LLAMA8B, cal.with_overrides({"api_cpu_factor": 1.5}), enforce_eager=True)
    assert slow_host.gpu_time(4, 4, 1600, 1600, True) == pytest.approx(1.5 * floor + small.attention)
    # eager_cpu_bound 0 (what the recorded 2026-12-02 folds replay with): the rule before, the
    # step's whole GPU work hiding the launches, the floor unscaled.
    before = cal.with_overrides({"eager_cpu_bound": 0.0})
    old = model_perf(LLAMA8B, before, enforce_eager=True)
    work = sum(dataclasses.astuple(long)) - long.launch
    assert old.gpu_time(256, 256, 256 * 1150, 256 * 1150, True) == pytest.approx(max(work, floor))
    old_slow_host = model_perf(LLAMA8B, before.with_overrides({"api_cpu_factor": 1.5}), enforce_eager=True)
    assert old_slow_host.gpu_time(4, 4, 1600, 1600, True) == pytest.approx(old.gpu_time(4, 4, 1600, 1600, True))
    with pytest.raises(SpecError, match="eager_cpu_bound"):
        cal.with_overrides({"eager_cpu_bound": 0.5})
    # The tiny model's eager decode step is launch-bound where CUDA graphs make it GPU-bound.
    tiny_eager, tiny_graphs = model_perf(TINY, enforce_eager=True), model_perf(TINY)
    assert tiny_eager.gpu_time(64, 64, 64 * 1100, 64 * 1100, True) > 2 * tiny_graphs.gpu_time(
        64, 64, 64 * 1100, 64 * 1100, True)  # real H200: 10.6 vs 2.96 ms TPOT


def test_cuda_graph_padding_and_largest_capture_size() -> None:
    cal = Calibration(piecewise_layer_s=50e-6, compiled_layer_overhead_s=200e-6)
    p = PerfModel(TINY, H200, resolve_engine_config({"max_num_seqs": 64}, TINY, H200), cal)  # sizes 1..128
    assert p.padded(65) == 72 and p.padded(64) == 64 and p.padded(129) == 129
    assert p.max_capture == 128
    within = p.gpu_time(128, 128, 128 * 500, 128 * 500, decode_only=True)
    above = p.gpu_time(129, 129, 129 * 500, 129 * 500, decode_only=True)
    # Above the largest capture size the batch runs without a graph: a per-layer launch cost.
    assert above - within == pytest.approx(TINY.num_layers * (cal.compiled_layer_overhead_s) - cal.graph_launch_s,
                                           rel=0.25)
    # A mixed batch within the capture sizes runs piecewise: its own per-layer cost.
    mixed = p.gpu_time(2, 128, 128 * 500, 128 * 500, False, 64, 64, 64 * 65 // 2)
    assert mixed > within + 0.9 * TINY.num_layers * cal.piecewise_layer_s - cal.graph_launch_s


def test_tensor_parallel_adds_all_reduce_but_splits_the_work() -> None:
    tp1 = perf()
    tp2 = perf(tensor_parallel_size=2)
    # Decode: half the weights per GPU, plus 2 all-reduces per layer.
    assert decode(tp2, 32, 1000) < decode(tp1, 32, 1000)
    comm = tp2.gpu_time(32, 32, 32000, 32000, True) - PerfModel(
        LLAMA8B, H100, resolve_engine_config({"tensor_parallel_size": 2}, LLAMA8B, H100),
        dataclasses.replace(tp2.calibration, allreduce_latency_s=0.0, interconnect_efficiency=1e9),
    ).gpu_time(32, 32, 32000, 32000, True)
    cal = tp2.calibration
    act_bytes = 32 * LLAMA8B.hidden_size * 2  # 32 tokens of bf16 activations
    per_all_reduce = cal.allreduce_latency_s + 2 * (2 - 1) / 2 * act_bytes / (
        H100.interconnect_gbps * 1e9 * cal.interconnect_efficiency)
    assert comm == pytest.approx(2 * LLAMA8B.num_layers * per_all_reduce, rel=0.02)


def test_pipeline_parallel_bubble_for_a_lone_request() -> None:
    pp1 = perf()
    pp2 = perf(pipeline_parallel_size=2)
    # One request crosses both stages one after the other: no faster than one GPU.
    assert pp2.gpu_time(1, 1, 1000, 1000, True) >= 0.95 * pp1.gpu_time(1, 1, 1000, 1000, True)
    # A full pipeline of prefill work is split over two GPUs.
    big = (2, 8192, 8192, 2 * 4096 * 4097 // 2)
    assert pp2.gpu_time(*big, decode_only=False) < 0.7 * pp1.gpu_time(*big, decode_only=False)


def test_async_scheduling_hides_engine_cpu() -> None:
    on = perf(async_scheduling=True)
    off = perf(async_scheduling=False)
    # The GPU step (8B weights, ~6 ms) is longer than the engine CPU: async hides more of it.
    assert decode(off, 64, 1000) > decode(on, 64, 1000)
    assert decode(on, 64, 1000) - on.gpu_time(64, 64, 64000, 64000, True) < 0.5 * on.calibration.step_overhead_s


def test_calibration_lookup_and_overrides() -> None:
    h200 = calibration_for(H200)
    # A GPU without its own fitted row: the H200's, with its family's overrides on top.
    assert calibration_for(H100) == h200.with_overrides(GPU_FAMILY_OVERRIDES.get("H100-80GB", {}))
    for key, value in GPU_CALIBRATION["H200"].items():
        assert getattr(h200, key) == pytest.approx(value)
    custom = dataclasses.replace(H200, calibration=types.MappingProxyType({"step_overhead_s": 0.01}))
    assert calibration_for(custom).step_overhead_s == 0.01
    with pytest.raises(SpecError, match="calibration.step_overhead_ms"):
        Calibration().with_overrides({"step_overhead_ms": 1.0})


def test_every_flashattention_2_part_takes_the_a100s_fitted_prefill_rate_and_hopper_keeps_fa3s() -> None:
    """vLLM runs FlashAttention-2 on compute capability 8.x and 12.x (fa_utils.get_flash_attn_version:
    FA3 only on 9.x, FA4 on 10.x, whose backend list puts FlashInfer first): those parts price prefill
    attention at the A100's fitted FA2 share of their own peak; Hopper keeps the H200's FA3 value, and a
    part below 8.0 (no FLASH_ATTN backend) the default. The RTX 5090 (12.0) joined 2026-12-07."""
    fa2 = GPU_FAMILY_OVERRIDES["A100-80GB"]["attn_efficiency"]
    assert FA2_KNOBS == {"attn_efficiency": fa2} and fa2 > GPU_CALIBRATION["H200"]["attn_efficiency"]
    for name in ("A100-40GB", "A800-80GB", "A10", "L4", "L40S", "RTX-3060", "RTX-3090", "RTX-4090", "RTX-5090"):
        assert runs_flash_attention_2(get_gpu(name)), name
        assert calibration_for(get_gpu(name)).attn_efficiency == pytest.approx(fa2), name
    for name in ("H200", "H100-80GB", "H100-PCIe", "T4", "V100-16GB", "B200", "MI300X"):
        assert not runs_flash_attention_2(get_gpu(name)), name
        assert calibration_for(get_gpu(name)).attn_efficiency == pytest.approx(GPU_CALIBRATION["H200"]["attn_efficiency"])
    # A GPU file's own calibration still wins over the family rule.
    own = dataclasses.replace(get_gpu("L4"), calibration=types.MappingProxyType({"attn_efficiency": 0.3}))
    assert calibration_for(own).attn_efficiency == 0.3
    # The rule changes prefill, not decode: a 4,096-token prefill of the 8B on the A100-40GB.
    model, gpu = load_model("llama-3.1-8b"), get_gpu("A100-40GB")
    config = resolve_engine_config({}, model, gpu)
    fa2_perf = PerfModel(model, gpu, config)
    fa3_perf = PerfModel(model, gpu, config, calibration_for(gpu).with_overrides(GPU_CALIBRATION["H200"]))
    n = 4096
    fa2_cost, fa3_cost = (p.gpu_cost(1, n, n, n * n // 2, False) for p in (fa2_perf, fa3_perf))
    assert fa2_cost.attention < 0.6 * fa3_cost.attention and fa2_cost.gemm == pytest.approx(fa3_cost.gemm)
    assert fa2_perf.gpu_time(8, 8, 8 * n, 8 * n, True) == pytest.approx(fa3_perf.gpu_time(8, 8, 8 * n, 8 * n, True))


@pytest.mark.parametrize("key, value", [("api_chunk_share", 1.5), ("api_chunk_share", -0.1),
                                        ("api_chunk_share", float("nan")), ("api_intake_passes", 0),
                                        ("api_intake_passes", 2.5), ("client_chunk_s", -1e-6),
                                        ("api_output_slice", -1), ("api_output_slice", 64.5)])
def test_api_server_loop_knobs_the_loop_cannot_run_are_a_spec_error(key: str, value: float) -> None:
    """A GPU file's calibration (or a fit's candidate) with an impossible loop knob names the knob
    and what it must be, instead of failing inside a simulated trial."""
    with pytest.raises(SpecError, match=f"calibration.{key}") as err:
        Calibration().with_overrides({key: value})
    assert err.value.fix
    assert Calibration().with_overrides({"api_chunk_share": 1.0, "api_intake_passes": 3, "client_chunk_s": 0.0})


@pytest.mark.parametrize("key, value", [("gemm_blend_exponent", -1.0), ("attn_layer_s", -1e-6),
                                        ("kv_write_efficiency", 1.5), ("kv_write_efficiency", -0.1),
                                        ("attn_layer_s", float("nan")), ("gemm_token_tile", 4.5),
                                        ("gemm_token_tile", -8), ("gemm_token_tile", 512)])
def test_kernel_knobs_the_step_model_cannot_run_are_a_spec_error(key: str, value: float) -> None:
    """The kernel-level knobs (2026-12-04) from a GPU file or a candidate: a negative blend or
    per-layer cost, or a bandwidth share above 1, names the knob and the fix."""
    with pytest.raises(SpecError, match=f"calibration.{key}") as err:
        Calibration().with_overrides({key: value})
    assert err.value.fix
    assert Calibration().with_overrides({"gemm_blend_exponent": 0.0, "attn_layer_s": 0.0, "kv_write_efficiency": 1.0,
                                         "gemm_token_tile": 16})


def test_layer_gemms_read_their_weights_at_small_batches_and_compute_at_large_ones() -> None:
    """Each GEMM is its own roofline (gemm_blend_exponent 0): at 64 tokens the 24B shape's four
    GEMMs take the time their weights take to stream (the same at 32 tokens), at 8,192 their FLOPs
    at the full-wave rate (doubling the tokens doubles them); the 32,768-wide MLP (gate_up 65,536 x
    5,120) dominates. The H200's fitted blend (2.5) prices the same GEMMs a little slower near the
    ridge and not at all slower far from it."""
    model = load_model("mistral-small-24b")
    cal = calibration_for(H200).with_overrides({"gemm_blend_exponent": 0.0})
    p = PerfModel(model, H200, resolve_engine_config({}, model, H200), cal)
    blended = perf(model, H200)
    assert blended.calibration.gemm_blend_exponent > 0
    for tokens, most in ((1, 1.001), (64, 1.06), (8192, 1.001)):
        ratios = [b / r for b, r in zip(blended.layer_gemm_seconds(tokens), p.layer_gemm_seconds(tokens))]
        assert all(1.0 <= x <= most for x in ratios), (tokens, ratios)
    layers = model.num_layers
    weights = [n * k * 2 * layers / (H200.hbm_gbps * 1e9 * cal.mem_efficiency)
               for n, k in ((4096 + 2 * 1024, 5120), (5120, 4096), (2 * 32768, 5120), (5120, 32768))]
    assert p.layer_gemm_shapes == ((4096 + 2 * 1024, 5120), (5120, 4096), (2 * 32768, 5120), (5120, 32768))
    assert p.layer_gemm_seconds(64) == pytest.approx(weights, rel=1e-9)
    assert p.layer_gemm_seconds(32) == pytest.approx(weights, rel=1e-9)
    big, bigger = p.layer_gemm_seconds(8192), p.layer_gemm_seconds(16384)
    assert all(b > w for b, w in zip(big, weights))
    assert [y / x for x, y in zip(big, bigger)] == pytest.approx([2.0] * 4, rel=0.03)
    gate_up_flops = 2.0 * 8192 * 65536 * 5120 * layers
    assert big[2] >= gate_up_flops / (H200.bf16_tflops * 1e12 * cal.compute_efficiency)
    assert big[2] == max(big)


def test_the_gemms_timed_on_the_h200_are_the_ones_the_simulator_prices() -> None:
    """benchmarks/real_vllm/gemm_probe.py writes each shipped shape's GEMMs out by hand (the GPU host
    runs it without servetune); the committed probe's (N, K) must be what PerfModel prices, or
    benchmarks/gemm_vs_sim.py would hold two different GEMMs against each other."""
    import json
    from pathlib import Path

    probe = Path(__file__).resolve().parents[1] / "fixtures" / "real_h200" / "gemm" / "gemm_probe_h200.json"
    rows = json.loads(probe.read_text())["gemms"]
    order = ("qkv", "o", "gate_up", "down")
    models = {row["model"] for row in rows}
    assert models == {"servetune-test-850m", "llama-3.1-8b", "qwen2.5-14b", "mistral-small-24b"}
    priced = {name: perf(load_model(name), H200).layer_gemm_shapes for name in models}
    for row in rows:
        assert (row["n"], row["k"]) == priced[row["model"]][order.index(row["gemm"])], row


def _prefill_attention(p: PerfModel, chunk: int, context: int) -> float:
    """GPU seconds of the attention of one ``chunk``-token prefill chunk whose tokens see ``context`` on average."""
    work = chunk * context
    return p.gpu_cost(1, chunk, context, work, False, prefill_tokens=chunk, prefill_context=context,
                      prefill_attn_work=work).attention


def test_flash_attention_3_reaches_its_long_sequence_rate_at_long_contexts() -> None:
    cal = calibration_for(H200)
    off = Calibration().with_overrides({**GPU_CALIBRATION["H200"], "attn_long_efficiency": 0.0})
    on, flat = PerfModel(LLAMA8B, H200, resolve_engine_config({}, LLAMA8B, H200)), \
        PerfModel(LLAMA8B, H200, resolve_engine_config({}, LLAMA8B, H200), off)
    # Up to the context attn_efficiency was read at, nothing moves.
    for context in (256, 1024, 2048):
        assert _prefill_attention(on, 2048, context) == pytest.approx(_prefill_attention(flat, 2048, context))
    # Beyond it the rate rises as context / (context + k) towards attn_long_efficiency (FA3's
    # long-sequence figure), from attn_efficiency at attn_fit_context.
    k = cal.attn_fit_context * (cal.attn_long_efficiency / cal.attn_efficiency - 1.0)
    fixed = cal.attn_layer_s * LLAMA8B.num_layers
    for context in (4096, 16384, 32768):
        rate = cal.attn_long_efficiency * context / (context + k)
        got = (_prefill_attention(on, 8192, context) - fixed) / (_prefill_attention(flat, 8192, context) - fixed)
        assert got == pytest.approx(cal.attn_efficiency / rate, rel=1e-6)
    assert _prefill_attention(on, 8192, 32768) < 0.55 * _prefill_attention(flat, 8192, 32768)
    # FlashAttention-3 is vLLM's on compute capability 9.x only: the A100 (FA2, its attn_efficiency
    # fitted on 32K-token prompts) keeps one rate.
    a100 = get_gpu("A100-80GB")
    a_on = PerfModel(LLAMA8B, a100, resolve_engine_config({}, LLAMA8B, a100))
    a_off = PerfModel(LLAMA8B, a100, resolve_engine_config({}, LLAMA8B, a100),
                      calibration_for(a100).with_overrides({"attn_long_efficiency": 0.0}))
    assert _prefill_attention(a_on, 8192, 32768) == pytest.approx(_prefill_attention(a_off, 8192, 32768))


def test_a_mamba_hybrid_is_priced_with_its_recurrent_layers():
    """Mamba / gated-delta-net hybrids were refused until 2026-12-06; their recurrent layers now add
    their own term to a step (sim.perf_hybrid; tests/sim/test_hybrid_sim.py), and only theirs do."""
    g = get_gpu("H100-80GB")
    for name in ("granite-4.0-h-tiny", "qwen3-next-80b-a3b"):
        m = load_model(name)
        cfg = resolve_engine_config({"tensor_parallel_size": 1 if name.startswith("granite") else 4}, m, g)
        assert PerfModel(m, g, cfg).gpu_cost(8, 8, 8000, 8000, True).recurrent > 0
    assert PerfModel(LLAMA8B, g, resolve_engine_config({}, LLAMA8B, g)).gpu_cost(8, 8, 8000, 8000, True).recurrent == 0