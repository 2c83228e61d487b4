"""The step-time rules of the model classes (servetune.sim.perf_classes): MoE, quantized GEMMs, sliding windows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from servetune.errors import SpecError
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner import moe_kernels
from servetune.planner.modelinfo import ModelProfile, load_model
from servetune.sim import _moe_tiles, perf_classes
from servetune.sim.perf import Calibration, PerfModel, calibration_for

H100 = get_gpu("H100-80GB")
A100 = get_gpu("A100-80GB")
QWEN_MOE = load_model("qwen3-30b-a3b")
LLAMA8B = load_model("llama-3.1-8b")
GPT_OSS = load_model("gpt-oss-20b")
GEMMA2 = load_model("gemma-2-27b")


def perf(model: ModelProfile, gpu=H100, **flags: object) -> PerfModel:
    return PerfModel(model, gpu, resolve_engine_config(flags, model, gpu))


def weight_rate(p: PerfModel, gpu=H100) -> float:
    return gpu.hbm_gbps * 1e9 * p.calibration.mem_efficiency


def test_distinct_experts_runs_from_top_k_to_all() -> None:
    e, k = QWEN_MOE.num_experts, QWEN_MOE.num_experts_per_tok
    counts = [perf_classes.distinct_experts(e, k, b) for b in (1, 2, 8, 32, 128, 1024)]
    assert counts[0] == pytest.approx(k)
    assert counts == sorted(counts)
    assert counts[-1] == pytest.approx(e, rel=1e-6)


def test_moe_decode_reads_the_active_experts_at_batch_one_and_all_of_them_at_a_large_batch() -> None:
    config = resolve_engine_config({}, QWEN_MOE, H100)
    p = PerfModel(QWEN_MOE, H100, config,
                  Calibration().with_overrides({"moe_layer_floor_s": 0.0}))  # the bytes alone, no kernel floor
    shape = perf_classes.moe_shape(QWEN_MOE, H100, 1, QWEN_MOE.num_layers)
    assert shape is not None
    # 16-bit experts on an H100 at vLLM 0.17+: the fused-MoE kernel's measured streaming rate and its fixed cost a
    # layer (perf_classes.by_batch_stream, 2026-12-07); the dense streaming rate and no fixed cost before 0.17.
    stream = perf_classes.by_batch_stream(shape, config.version, H100)
    assert stream is not None
    rate, call = stream[0] * p.calibration.moe_mem_share, stream[1] * shape.layers
    active = QWEN_MOE.num_experts_per_tok * shape.expert_bytes * shape.layers / rate + call
    every = QWEN_MOE.num_experts * shape.expert_bytes * shape.layers / rate + call
    assert p.moe_seconds(1) == pytest.approx(active, rel=0.02)
    # At 256 tokens every expert is touched: at least all the experts' bytes, and the step is not
    # priced at the active experts' (the rule before, which read top-k experts at any batch).
    assert p.moe_seconds(256) >= every
    assert p.moe_seconds(256) > 10 * p.moe_seconds(1)


def test_16_bit_experts_on_hopper_stream_at_the_kernels_measured_rate_from_vllm_0_17() -> None:
    """vLLM 0.26.0's fused_experts timed on an H100 (tests/fixtures/real_h100/kernels/moe_probe_h100.json): 16-bit
    experts at 16-128 tokens stream at 0.896 of the datasheet bandwidth plus 18.8 us a layer (read off four shapes,
    ``benchmarks/moe_vs_sim.py --stream``); Mixtral's layer, judged, at 0.96-1.00 of that. Before 0.17 (0.11's
    64 x 64 x 32 tile), fp8 experts and GPUs other than Hopper keep the dense rate."""
    shape = perf_classes.moe_shape(load_model("mixtral-8x7b"), H100, 1, 32)
    assert shape is not None
    rate, call = perf_classes.by_batch_stream(shape, (0, 26, 0), H100)
    assert round(rate / 1e9) == 3002 and call == pytest.approx(18.8e-6)
    h200_rate = perf_classes.by_batch_stream(shape, (0, 26, 0), get_gpu("H200"))[0]
    assert h200_rate == pytest.approx(0.896 * 4800e9, rel=0.01)
    assert perf_classes.by_batch_stream(shape, (0, 16, 0), H100) is None
    assert perf_classes.by_batch_stream(shape, (0, 26, 0), A100) is None
    fp8 = dataclasses.replace(shape, fmt=perf_classes.WeightFormat(1.0, 2.0))
    assert perf_classes.by_batch_stream(fp8, (0, 26, 0), H100) is None
    # The step's layer at 64 tokens against the kernel's 935 us (1,101 us at the dense rate before this rule).
    mixtral = perf(load_model("mixtral-8x7b"), max_model_len=4096)
    layer_us = mixtral.moe_seconds(64) / mixtral.moe_shape.layers * 1e6
    assert 950 < layer_us < 1010, layer_us


def test_a_small_batchs_experts_cost_at_least_the_fused_moe_floor_where_no_kernel_rate_prices_them() -> None:
    # Real H100 Qwen3-30B-A3B shape (2026-12-05): one client decoded at 4.7-4.8 ms a token with bf16
    # and with FP8 experts alike, where the active experts' bytes take well under 1 ms: the fused-MoE
    # path's small kernels set a floor per MoE layer (Calibration.moe_layer_floor_s), fitted on the FP8 start.
    fp8 = perf(QWEN_MOE, quantization="fp8")
    floor = QWEN_MOE.num_layers * fp8.calibration.moe_layer_floor_s
    assert fp8.calibration.moe_layer_floor_s > 0
    assert fp8.moe_seconds(1) == pytest.approx(floor)  # fp8 experts keep the dense streaming rate, and the floor
    assert perf_at(QWEN_MOE, "0.11.0").moe_seconds(1) == pytest.approx(floor)  # 0.11's tiles: no measured rate
    assert fp8.moe_seconds(256) > floor  # a large batch is priced by its work
    assert perf(LLAMA8B).moe_seconds(1) == 0.0  # no experts, no floor


def test_where_the_kernels_rate_prices_the_experts_the_routers_kernels_replace_the_floor() -> None:
    # bf16 experts under vLLM 0.17+'s by-batch tiles on Hopper stream at the kernel's measured rate plus its fixed
    # cost a layer (_moe_tiles.MOE_BY_BATCH_STREAM); the profiler traces of 2026-12-07 time the experts' kernels
    # at 1.64 ms a one-sequence step (34.2 us a layer) and the router's GEMM and top-k at 8.3 us a layer.
    p = perf(QWEN_MOE)
    layers = QWEN_MOE.num_layers
    stream_share, call_s = _moe_tiles.MOE_BY_BATCH_STREAM["hbm_share"], _moe_tiles.MOE_BY_BATCH_STREAM["call_s"]
    experts_bytes = QWEN_MOE.num_experts_per_tok * 3 * QWEN_MOE.hidden_size * QWEN_MOE.moe_intermediate_size * 2
    one = experts_bytes / (stream_share * H100.hbm_gbps * 1e9 * p.calibration.moe_mem_share) + call_s
    assert p.moe_seconds(1) == pytest.approx(layers * one, rel=0.01)  # no floor: 44 us a layer (its FLOPs blended in)
    assert p.moe_seconds(1) < layers * p.calibration.moe_layer_floor_s
    # The router's kernels ride on every step's GEMMs: a one-token step costs them beside the experts.
    assert p._gemm_roofline(1, 1) - p.moe_seconds(1) >= layers * _moe_tiles.MOE_ROUTER_KERNELS_S


def perf_at(model: ModelProfile, version: str, gpu=H100) -> PerfModel:
    return PerfModel(model, gpu, resolve_engine_config({}, model, gpu, vllm_version=version))


def test_moe_prefill_is_compute_bound_at_the_fitted_share_of_the_dense_rate() -> None:
    tokens = 8192
    flops = 2.0 * tokens * QWEN_MOE.num_experts_per_tok * 3 * QWEN_MOE.hidden_size * QWEN_MOE.moe_intermediate_size
    old = perf_at(QWEN_MOE, "0.11.0")
    dense_rate = H100.bf16_tflops * 1e12 * old.calibration.compute_efficiency
    at_share = flops * QWEN_MOE.num_layers / (dense_rate * perf_classes.MOE_COMPUTE_SHARE["triton"]["hopper"])
    # vLLM 0.11's default tile (64 x 64 above E tokens), the one the share was fitted under; 512 rows
    # an expert on average, binomially spread, so about half the experts pay a ninth 64-row block.
    fill_64 = perf_classes.moe_row_fill(tokens, 128, 8, 64)
    assert 0.90 < fill_64 < 0.97
    assert old.moe_seconds(tokens) == pytest.approx(at_share / fill_64, rel=0.05)
    # vLLM 0.26's default grows to 128 x 128 above 512 tokens: the dense tile model prices it at
    # 0.9 of the large tile's rate against the 64 x 64 tile's 0.5, 1.8 times as fast, on 128-row
    # blocks that pad more.
    fill_128 = perf_classes.moe_row_fill(tokens, 128, 8, 128)
    assert fill_128 < fill_64
    assert perf_at(QWEN_MOE, "0.26.0").moe_seconds(tokens) == pytest.approx(at_share / 1.8 / fill_128, rel=0.05)
    # A100 (Ampere) runs the same kernel at its own fitted share.
    assert perf_classes.moe_compute_share(A100) == perf_classes.MOE_COMPUTE_SHARE["triton"]["ampere"]
    assert perf_classes.moe_compute_share(A100, override=0.7) == 0.7


def test_the_default_fused_moe_tile_follows_the_vllm_release() -> None:
    # vLLM 0.26 get_default_config: by batch; 0.11: 16 rows up to E tokens, 64 x 64 above.
    assert [perf_classes.moe_tile(t, 8) for t in (1, 32, 64, 96, 512, 513)] == \
        [(16, 64), (16, 64), (32, 64), (32, 128), (64, 128), (128, 128)]
    assert perf_classes.moe_tile(64, 8, (0, 11, 0)) == (64, 64)
    assert perf_classes.moe_tile(64, 128, (0, 11, 0)) == (16, 32)
    assert perf_classes.moe_tile(64, 8, block_quant=True) == (16, 128)
    # A Mixtral-shaped decode of 64 tokens (16 rows an expert): 0.26 pads them to 32 rows, 0.11 to
    # 64, so the same batch's experts compute faster under 0.26.
    mixtral = load_model("mixtral-8x7b")
    new, old = perf_at(mixtral, "0.26.0"), perf_at(mixtral, "0.11.0")
    assert new.moe_seconds(64) < old.moe_seconds(64)


def test_the_moe_kernel_is_the_one_vllm_picks_for_the_experts_format_on_the_gpu() -> None:
    qwen_fp8 = dataclasses.replace(QWEN_MOE, quantization="fp8", quant_bytes_per_param=1.0)
    qwen_awq = dataclasses.replace(QWEN_MOE, quantization="awq", quant_bytes_per_param=0.5 + 2.5 / 128)
    assert perf_classes.moe_kernel(QWEN_MOE, A100) == perf_classes.moe_kernel(QWEN_MOE, H100) == "triton"
    assert perf_classes.moe_kernel(GPT_OSS, H100) == "triton"  # triton_kernels' matmul_ogs on SM90
    assert perf_classes.moe_kernel(GPT_OSS, A100) == "marlin-mxfp4"
    assert perf_classes.moe_kernel(qwen_fp8, H100) == "triton"  # fp8 tensor cores
    assert perf_classes.moe_kernel(qwen_fp8, A100) == "marlin"  # fp8 weight-only below 8.9
    assert perf_classes.moe_kernel(qwen_awq, H100) == "marlin"
    # A kernel without a fitted cell prices at the unfitted share of the architecture (Ampere: the rate
    # Triton reached on its fit runs with their tuned tiles in it), else Triton's; MXFP4 Marlin at its own.
    assert perf_classes.moe_compute_share(A100, kernel="marlin") == perf_classes.MOE_UNFITTED_SHARE["ampere"]
    assert perf_classes.moe_compute_share(H100, kernel="marlin") == perf_classes.MOE_COMPUTE_SHARE["triton"]["hopper"]
    assert perf_classes.moe_compute_share(A100, kernel="marlin-mxfp4") == perf_classes.MOE_COMPUTE_SHARE["marlin-mxfp4"]["ampere"]


def test_gpt_oss_experts_on_an_a100_compute_at_marlins_share() -> None:
    tokens = 8192
    a100 = perf(GPT_OSS, A100)
    shape = perf_classes.moe_shape(GPT_OSS, A100, 1, GPT_OSS.num_layers)
    assert shape is not None and shape.kernel == "marlin-mxfp4"
    flops = 2.0 * tokens * shape.top_k * 3 * shape.hidden * shape.inter * shape.layers
    rate = A100.bf16_tflops * 1e12 * a100.calibration.compute_efficiency * perf_classes.MOE_COMPUTE_SHARE["marlin-mxfp4"]["ampere"]
    fill = perf_classes.moe_row_fill(tokens, shape.experts, shape.top_k, 64)  # Marlin's 64-row blocks
    assert a100.moe_seconds(tokens) == pytest.approx(flops / rate / fill, rel=0.05)


def test_each_grouped_moe_kernel_pads_to_its_own_row_block() -> None:
    # triton_kernels' matmul_ogs (MXFP4 on Hopper): next power of two of the rows an expert expects, 16 to 128.
    assert [perf_classes.moe_block_m("matmul_ogs", t, 128, 4) for t in (1, 64, 1024, 2048, 8192)] == [16, 16, 32, 64, 128]
    # Marlin: the first of 8, 16, 32, 48, 64 the expected rows fill less than 0.9 of, else 64.
    assert [perf_classes.moe_block_m("marlin", t, 128, 4) for t in (16, 64, 512, 1024, 2048)] == [8, 8, 32, 48, 64]
    # fused_moe: its default tile's rows (moe_tile).
    assert perf_classes.moe_block_m("fused_moe", 8192, 128, 8, (0, 11, 0)) == 64
    assert perf_classes.moe_block_m("fused_moe", 8192, 128, 8) == 128


def test_padding_follows_the_experts_binomial_row_counts() -> None:
    rng = np.random.default_rng(0)
    for tokens, experts, top_k, block in ((2048, 128, 4, 64), (300, 64, 2, 16), (8192, 32, 4, 128), (700, 128, 4, 16),
                                          (1000, 8, 7, 64)):
        # routing picks top_k distinct experts a token; each expert's row count is binomial(tokens,
        # top_k / experts), and the expected blocks add up over the experts whatever their correlation
        counts = rng.binomial(tokens, top_k / experts, size=(4000, experts))
        blocks = float(np.ceil(counts / block).sum(axis=1).mean())
        assert perf_classes.expected_row_blocks(tokens, experts, top_k, block) == pytest.approx(blocks, rel=0.01)
    # a mean of 64 rows on 64-row blocks: about half the experts pay a second block (the mean alone: none)
    assert perf_classes.moe_row_fill(2048, 128, 4, 64) == pytest.approx(0.68, abs=0.02)
    # far below one block, padding is one block per touched expert, as distinct_experts counts them
    assert perf_classes.expected_row_blocks(16, 128, 8, 64) == pytest.approx(perf_classes.distinct_experts(128, 8, 16))


def test_attention_sinks_below_hopper_run_on_triton_attention() -> None:
    # gpt-oss's sinks: FlashAttention 2 (the A100's) has none, so vLLM serves them on TRITON_ATTN,
    # whose prefill rate is perf_classes.TRITON_ATTN_EFFICIENCY of the peak; Hopper's FA3 has sinks.
    assert perf_classes.runs_triton_attention(GPT_OSS, A100)
    assert not perf_classes.runs_triton_attention(GPT_OSS, H100)
    assert not perf_classes.runs_triton_attention(QWEN_MOE, A100)

    def prefill_attention(cal: Calibration) -> float:
        p = PerfModel(GPT_OSS, A100, resolve_engine_config({}, GPT_OSS, A100), cal)
        return p.gpu_cost(1, 2048, 2048, 2048 * 2049 // 2, decode_only=False).attention

    base = Calibration().with_overrides({"attn_efficiency": 0.5, "attn_layer_s": 0.0})  # the FLOPs alone
    triton = prefill_attention(base)
    as_flash = prefill_attention(base.with_overrides({"triton_attn_efficiency": 0.5}))
    assert triton / as_flash == pytest.approx(0.5 / perf_classes.TRITON_ATTN_EFFICIENCY, rel=1e-6)


def test_mla_attention_reads_the_latent_and_computes_at_its_own_head_dims() -> None:
    ds = load_model("deepseek-v2-lite")
    # one prefill rate whatever the context (FA3's long-context rise is test_perf's)
    p = PerfModel(ds, H100, resolve_engine_config({}, ds, H100),
                  calibration_for(H100).with_overrides({"attn_long_efficiency": 0.0}))
    layers, heads = ds.num_layers, ds.num_attention_heads
    latent = ds.mla_kv_lora_rank + ds.mla_rope_dim
    assert ds.kv_bytes_per_token(1, 1) == latent * 2 * layers  # compressed: 576 elements a token and layer
    # Decode: the latent's bytes (memory-bound on an H100 at 16 heads), not 2 x heads x head_dim.
    kv_rate = H100.hbm_gbps * 1e9 * p.calibration.kv_read_efficiency
    assert p._t_kv_read == pytest.approx(latent * 2 * layers / kv_rate)
    # Prefill: 2 (qk + v) FLOPs a head per (token, context) pair, qk = nope + rope = 192, v = 128.
    attn_rate = H100.bf16_tflops * 1e12 * p.calibration.attn_efficiency
    qk, v = ds.mla_nope_dim + ds.mla_rope_dim, ds.mla_v_dim
    assert p._t_attn == pytest.approx(2 * heads * (qk + v) * layers / attn_rate)
    # A chunk whose request has earlier context up-projects those latents through kv_b again.
    fresh = p.gpu_cost(1, 2048, 2048, 2048 * 2049 // 2, decode_only=False).attention
    later = p.gpu_cost(1, 2048, 6144, 2048 * 4096 + 2048 * 2049 // 2, decode_only=False).attention
    up = 2 * ds.mla_kv_lora_rank * heads * (ds.mla_nope_dim + v) * layers * 4096
    gemm_rate = H100.bf16_tflops * 1e12 * p.calibration.compute_efficiency
    assert later - fresh == pytest.approx(up / gemm_rate + p._t_attn * 2048 * 4096, rel=1e-6)


def test_fp8_checkpoint_halves_the_memory_bound_step_and_the_compute_bound_one() -> None:
    fp8 = dataclasses.replace(LLAMA8B, quantization="fp8", quant_bytes_per_param=1.0)
    bf16, q = perf(LLAMA8B), perf(fp8)
    small = sum(q.layer_gemm_seconds(1)) / sum(bf16.layer_gemm_seconds(1))
    large = sum(q.layer_gemm_seconds(8192)) / sum(bf16.layer_gemm_seconds(8192))
    assert 0.45 < small < 0.55  # 1 byte a weight instead of 2
    assert 0.45 < large < 0.55  # the fp8 tensor cores' rate, twice bf16's on Hopper
    # On an A100 (no fp8 tensor cores) vLLM runs fp8 weight-only through Marlin: the bytes halve, the rate does not.
    a_bf16, a_fp8 = perf(LLAMA8B, A100), perf(fp8, A100)
    assert sum(a_fp8.layer_gemm_seconds(8192)) > sum(a_bf16.layer_gemm_seconds(8192))


def test_w4a16_reads_a_quarter_of_the_bytes_and_pays_marlins_dequantization_at_large_batches() -> None:
    w4 = dataclasses.replace(LLAMA8B, quantization="awq", quant_bytes_per_param=0.5 + 2.5 / 128)
    bf16, q = perf(LLAMA8B), perf(w4)
    small = sum(q.layer_gemm_seconds(1)) / sum(bf16.layer_gemm_seconds(1))
    large = sum(q.layer_gemm_seconds(8192)) / sum(bf16.layer_gemm_seconds(8192))
    assert 0.24 < small < 0.30
    assert large == pytest.approx(1 / perf_classes.W4A16_COMPUTE_SHARE, rel=0.05)


def test_mxfp4_quantizes_only_the_experts() -> None:
    attn = perf_classes.weight_format(GPT_OSS, H100)
    experts = perf_classes.weight_format(GPT_OSS, H100, experts=True)
    assert attn.bytes_per_weight == 2.0
    assert experts.bytes_per_weight == pytest.approx(4.25 / 8)
    assert experts.rate_scale == 1.0  # Hopper has no fp4 tensor cores


def test_sliding_layers_read_at_most_the_window() -> None:
    window = GEMMA2.sliding_window
    full = dataclasses.replace(GEMMA2, layer_types=(), sliding_window=0)
    slid, plain = perf(GEMMA2), perf(full)

    def attention(p: PerfModel, context: int) -> float:
        return p.gpu_cost(64, 64, 64 * context, 64 * context, decode_only=True).attention

    # Below the window both read the whole context; past it only the full layers' read grows.
    assert attention(slid, window // 2) == pytest.approx(attention(plain, window // 2), rel=1e-9)
    share = perf_classes.sliding_kv_share(GEMMA2, GEMMA2.num_layers)
    assert share == pytest.approx(0.5)
    grow_slid = attention(slid, 4 * window) - attention(slid, 2 * window)
    grow_plain = attention(plain, 4 * window) - attention(plain, 2 * window)
    assert grow_slid == pytest.approx(grow_plain * (1 - share), rel=1e-6)


def test_dense_bf16_models_take_none_of_the_class_rules() -> None:
    assert not perf_classes.is_class_model(LLAMA8B)
    assert perf(LLAMA8B).moe_seconds(64) == 0.0


def test_moe_knobs_out_of_range_are_refused() -> None:
    with pytest.raises(SpecError, match="moe_compute_share"):
        Calibration().with_overrides({"moe_compute_share": 1.5})
    with pytest.raises(SpecError, match="moe_mem_share"):
        Calibration().with_overrides({"moe_mem_share": 0.0})


def test_block_fp8_experts_in_triton_fused_moe_compute_at_the_bf16_rate() -> None:
    # fused_moe_kernel's block-scaled branch rescales every BLOCK_K step's dot outside the fp8
    # accumulation chain (perf_classes.BLOCK_FP8_MOE_RATE_SCALE); per-tensor fp8 keeps Hopper's fp8 rate.
    h200 = get_gpu("H200")
    r1 = load_model(str(Path(__file__).resolve().parents[1] / "fixtures" / "published_logs" / "models" / "deepseek-r1"))
    assert r1.quant_block_k and "fp8" in (r1.quantization or "")
    block = perf_classes.moe_shape(r1, h200, 8, r1.num_layers)
    assert block is not None and block.fused_moe and block.block_quant
    assert block.fmt.rate_scale == perf_classes.BLOCK_FP8_MOE_RATE_SCALE == 1.0
    assert block.fmt.bytes_per_weight == pytest.approx(1.0)  # still one byte a weight
    per_tensor = dataclasses.replace(QWEN_MOE, quantization="fp8", quant_bytes_per_param=1.0)
    shape = perf_classes.moe_shape(per_tensor, h200, 1, per_tensor.num_layers)
    assert shape is not None and not shape.block_quant
    assert shape.fmt.rate_scale == pytest.approx(h200.fp8_tflops / h200.bf16_tflops)
    # the dense block-fp8 GEMMs (attention projections, shared experts) keep the fp8 rate
    assert all(g.fmt.rate_scale > 1.0 for g in perf_classes.class_gemms(r1, h200, 8, r1.num_layers) if g.fmt.bytes_per_weight == 1.0)


def test_below_0_26_the_tuned_config_vllm_ships_sets_the_fused_moe_tile() -> None:
    # vLLM 0.11.0 ships E=128,N=192 configs (Qwen3-235B-A22B's experts at TP=8) for the H100 and the A100,
    # none for N=768 (the 30B at TP=1) on the H100; an FP8 checkpoint's experts read another file.
    qwen235 = load_model("qwen3-235b-a22b-2507")
    h100_tiles = moe_kernels.tuned_moe_tiles(qwen235, "H100-80GB", 8)
    assert dict((m, (bm, bn)) for m, bm, bn in h100_tiles)[4096] == (128, 128)
    assert dict((m, (bm, bn)) for m, bm, bn in moe_kernels.tuned_moe_tiles(qwen235, "A100-80GB", 8))[2048] == (64, 128)
    assert moe_kernels.tuned_moe_tiles(QWEN_MOE, "H100-80GB", 1) == ()
    assert moe_kernels.tuned_moe_tiles(load_model("qwen3-235b-a22b-2507-fp8"), "H100-80GB", 4) == ()
    # try_get_optimal_moe_config: the key nearest the batch, the lower of two equally near.
    assert perf_classes.tuned_tile(h100_tiles, 8192) == (128, 128)
    assert perf_classes.tuned_tile(((1024, 64, 128), (2048, 128, 256)), 1536) == (64, 128)
    shape = perf_classes.moe_shape(qwen235, H100, 8, qwen235.num_layers)
    assert shape is not None and shape.fused_moe and shape.tuned_tiles == h100_tiles
    assert perf_classes.moe_block_m("fused_moe", 8192, 128, 8, (0, 11, 0), tuned=h100_tiles) == 128
    # Priced by the dense tile model against 0.11's default 64 x 64 tile: 128 x 128 is 1.8 times its rate,
    # on 128-row blocks that pad more than 64-row ones.
    config = resolve_engine_config({"tensor_parallel_size": 8, "max_model_len": 8192}, qwen235, H100, vllm_version="0.11.0")
    tuned = PerfModel(qwen235, H100, config)
    default = PerfModel(qwen235, H100, config)
    assert default._moe is not None
    default._moe = dataclasses.replace(default._moe, tuned_tiles=())
    tokens = 8192
    fill_64 = perf_classes.moe_row_fill(tokens, 128, 8, 64)
    fill_128 = perf_classes.moe_row_fill(tokens, 128, 8, 128)
    assert tuned.moe_seconds(tokens) == pytest.approx(default.moe_seconds(tokens) / 1.8 * fill_64 / fill_128, rel=0.02)
    assert tuned.moe_seconds(tokens) < 0.7 * default.moe_seconds(tokens)
    # From 0.26 the default tiles are priced whether or not a file is shipped (the rule is 0.11.0's files).
    new = resolve_engine_config({"tensor_parallel_size": 8, "max_model_len": 8192}, qwen235, H100, vllm_version="0.26.0")
    at_026 = PerfModel(qwen235, H100, new)
    assert at_026._moe is not None
    stripped = PerfModel(qwen235, H100, new)
    stripped._moe = dataclasses.replace(at_026._moe, tuned_tiles=())
    assert at_026.moe_seconds(tokens) == stripped.moe_seconds(tokens)


def test_block_fp8_experts_below_0_26_run_a_64_x_128_tile() -> None:
    # vLLM 0.11.0 get_default_config (fused_moe.py:877-889): block-quantized fp8 takes BLOCK_SIZE_M 64 and
    # BLOCK_SIZE_N the quantization block (128) at every batch, where bf16's default is 64 x 64.
    assert perf_classes.moe_tile(8, 128, (0, 11, 0), block_quant=True) == (64, 128)
    assert perf_classes.moe_tile(8192, 128, (0, 11, 0), block_quant=True) == (64, 128)
    assert perf_classes.moe_tile(8192, 128, (0, 11, 0)) == (64, 64)
    # Its tuned files: E=128,N=768 block fp8 ships for the H200, not the H100; per-tensor fp8 files are not read.
    block_fp8 = dataclasses.replace(QWEN_MOE, quantization="fp8", quant_bytes_per_param=1.0, quant_block_k=128)
    h200_tiles = moe_kernels.tuned_moe_tiles(block_fp8, "H200", 1)
    assert h200_tiles and all(bn % 128 == 0 for _, _, bn in h200_tiles[4:])
    assert moe_kernels.tuned_moe_tiles(block_fp8, "H100-80GB", 1) == ()
    assert moe_kernels.tuned_moe_tiles(dataclasses.replace(block_fp8, quant_block_k=0), "H200", 1) == ()
    # Qwen3-235B-A22B-FP8 at TP=4 on the H100 (N=384: no file): the default 64 x 128 tile, 1.5 times the
    # 64 x 64 tile's rate by the dense tile model, on the same 64-row blocks.
    fp8 = load_model("qwen3-235b-a22b-2507-fp8")
    config = resolve_engine_config({"tensor_parallel_size": 4, "max_model_len": 8192}, fp8, H100, vllm_version="0.11.0")
    priced = PerfModel(fp8, H100, config)
    assert priced._moe is not None and priced._moe.block_quant and priced._moe.tuned_tiles == ()
    assert perf_classes.prices_tile(priced._moe, (0, 11, 0))
    as_64 = PerfModel(fp8, H100, config)
    as_64._moe = dataclasses.replace(priced._moe, block_quant=False)
    assert not perf_classes.prices_tile(as_64._moe, (0, 11, 0))
    assert priced.moe_seconds(16384) == pytest.approx(as_64.moe_seconds(16384) / 1.5, rel=0.01)
