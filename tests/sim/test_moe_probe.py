"""The simulator's routed-expert price against vLLM's fused-MoE kernel timed on an H100 SXM
(``tests/fixtures/real_h100/kernels/moe_probe_h100.json``, ``benchmarks/moe_vs_sim.py``)."""

from __future__ import annotations

import dataclasses
import json

import moe_vs_sim
import pytest

from servetune.planner.gpus import get_gpu
from servetune.sim import _moe_tiles, perf_classes
from servetune.sim._moe_tiles import unaligned_down_bytes_per_s
from servetune.sim.perf_classes import MoeShape, WeightFormat

PROBE = json.loads(moe_vs_sim.PROBE.read_text())


ALIGN = tuple(json.loads(path.read_text()) for path in moe_vs_sim.ALIGN_PROBES)


def test_the_unaligned_down_share_is_the_probes_derivation() -> None:
    """MOE_UNALIGNED_DOWN_SHARE is read off the alignment probe, not chosen: the code's figures are the derivation's."""
    assert perf_classes.MOE_UNALIGNED_DOWN_SHARE == moe_vs_sim.derive_unaligned(ALIGN)


def test_the_by_batch_streaming_rate_is_the_probes_derivation() -> None:
    """MOE_BY_BATCH_STREAM is read off four shapes of the H100 probe (``moe_vs_sim.py --stream``), not chosen."""
    assert _moe_tiles.MOE_BY_BATCH_STREAM == pytest.approx(moe_vs_sim.derive_stream(PROBE))


def test_the_rule_holds_on_the_unaligned_widths_it_was_not_read_off() -> None:
    """Held out: four other unaligned widths (16-bit experts), both tile sets, 1,024-8,192 tokens."""
    judged = [r for r in moe_vs_sim.judge_unaligned(ALIGN, perf_classes.MOE_UNALIGNED_DOWN_SHARE)
              if r["split"] == "held_out" and not r["shape"].endswith("_fp8")]
    assert len(judged) == 32
    assert all(abs(r["error_pct"]) <= 15 for r in judged), judged
    assert sum(abs(r["error_pct"]) <= 10 for r in judged) >= 24
    fp8 = [r for r in moe_vs_sim.judge_unaligned(ALIGN, perf_classes.MOE_UNALIGNED_DOWN_SHARE)
           if r["shape"].endswith("_fp8") and r["mode"] == "vllm"]
    assert fp8 and all(r["error_pct"] < -50 for r in fp8)  # the documented miss: fp8 under 0.26's tiles


def test_the_probe_timed_every_shape_the_benchmark_prices_with_the_host_it_names() -> None:
    shapes = {row["shape"] for row in PROBE["rows"]}
    later = {row["shape"] for path in moe_vs_sim.UNSEEN_PROBES for row in json.loads(path.read_text())["rows"]}
    assert shapes | later == set(moe_vs_sim.SHAPES) and not shapes & later
    assert "H100 80GB HBM3" in PROBE["gpu"] and PROBE["vllm"] == "0.26.0"
    assert all(row["us"] and row["us"] > 0 and row["error"] is None for row in PROBE["rows"])


@pytest.mark.parametrize("mode", ["vllm", "v0.11_default"])
def test_the_unaligned_expert_width_is_what_slows_gpt_oss_at_tp8(mode: str) -> None:
    """K = 360 (not a multiple of 16) at TP=8 against K = 720 at TP=4: half the FLOPs took 77-87% of the
    time at 4,096+ tokens on the first probe. With the rule the simulator's TP=8 layer is off by what its
    aligned TP=4 layer is off by: within 12% under 0.11's tiles (the published runs' kernel); within 40%
    under 0.26's, whose aligned 352-368-wide layers themselves run ~18% below the 720-wide one, a width
    effect the simulator does not price. Without the rule the TP=8 layer was 1.5-2.8x fast."""
    rows = {(r["shape"], r["tokens"]): r["us"] for r in PROBE["rows"] if r["mode"] == mode}
    for tokens in (4096, 8192):
        assert rows[("gpt-oss-120b_tp8", tokens)] > 0.75 * rows[("gpt-oss-120b_tp4", tokens)]
    compared, _ = moe_vs_sim.compare(PROBE)
    ratio = {(r["shape"], r["tokens"]): r["ratio"] for r in compared if r["mode"] == mode}
    for tokens in (4096, 8192):
        off = ratio[("gpt-oss-120b_tp8", tokens)] / ratio[("gpt-oss-120b_tp4", tokens)] - 1.0
        assert abs(off) <= (0.12 if mode == "v0.11_default" else 0.40), off
    perf = moe_vs_sim._perf("gpt-oss-120b_tp8", mode)
    moe = perf.moe_shape
    assert moe is not None and moe.inter == 360
    assert perf_classes.moe_down_share(dataclasses.replace(moe, inter=368), perf._version) == 1.0
    assert perf_classes.moe_down_share(moe, perf._version) < 0.5


def test_held_out_shapes_are_mostly_within_15_percent_at_prefill_sizes() -> None:
    """Every shape but the fit one is evidence: at 2,048-8,192 tokens the bf16 and block-fp8 layers the
    simulator prices are within 15% on most rows (per-tensor fp8 under 0.11's default tile is the known miss)."""
    compared, left = moe_vs_sim.compare(PROBE)
    held = [r for r in compared if r["split"] == "held_out" and r["tokens"] >= 2048
            and r["shape"] != "qwen3-30b-a3b_tp1_fp8"]
    within = sum(abs(r["ratio"] - 1.0) <= 0.15 for r in held)
    assert len(held) >= 30 and within / len(held) >= 0.75
    assert left["unknown shape"] == 0 and left["tuned file not priced"] > 0


def test_simulate_names_an_unaligned_expert_width_and_the_sizes_that_avoid_it() -> None:
    """The rule reaches the user: a trial whose experts are 360 wide on a GPU says so, with the
    tensor-parallel sizes that keep them aligned; TP=4 (720 wide) and a dense model say nothing."""
    from servetune.planner.memory import resolve_engine_config
    from servetune.planner.modelinfo import load_model
    from servetune.sim.engine import figure_notes

    oss, h100 = load_model(moe_vs_sim.GPT_OSS_BF16), get_gpu("H100-80GB")

    def notes(tp: int, dp: int = 1) -> list[str]:
        config = dataclasses.replace(resolve_engine_config({"tensor_parallel_size": tp, "max_model_len": 8192}, oss,
                                                           h100, vllm_version="0.14.1"), data_parallel_size=dp)
        return [n for n in figure_notes(oss, h100, config, 0.1, 1.0) if n.startswith("experts:")]

    (tp8,) = notes(8)
    assert "360 wide" in tp8 and "0.398x" in tp8 and "tensor_parallel_size 1, 2, 4 keep it aligned" in tp8
    assert notes(4) == []
    (dp2,) = notes(4, dp=2)  # under DP the experts are split over TP x DP GPUs: 360 again
    assert "2880 / 8" in dp2 and "tensor_parallel_size 1, 2 keep it aligned" in dp2
    dense = load_model("llama-3.1-8b")
    assert perf_classes.unaligned_experts_note(dense, h100, 8, (0, 14, 1)) == ""


def test_moe_activation_seconds_is_the_routed_rows_traffic_the_step_charges() -> None:
    """Pure: per token and MoE layer, top_k routed rows each moving H + 2I + I + H bf16 elements at the dense
    streaming rate; 0 for no tokens; part of the step's activation term, not of moe_seconds."""
    perf = moe_vs_sim._perf("qwen3-235b-a22b-fp8_tp4", "v0.11_default")
    moe = perf.moe_shape
    assert moe is not None and (moe.top_k, moe.hidden, moe.inter, moe.matrices) == (8, 4096, 384, 3)
    rate = perf._moe_mem_rate / perf.calibration.moe_mem_share
    expected = 8 * 2.0 * (4096 + 2 * 384 + 384 + 4096) * moe.layers / rate
    assert perf.moe_activation_seconds(1) == pytest.approx(expected)
    assert perf.moe_activation_seconds(4096) == pytest.approx(4096 * expected)
    assert perf.moe_activation_seconds(0) == 0.0
    assert perf._act_bytes_token > perf.moe_activation_seconds(1)  # the dense GEMMs' activations beside it


def test_block_fp8_experts_run_faster_than_bf16_at_the_kernel_read_off_one_layer_judged_on_another() -> None:
    """The whole block-fp8 layer (GEMMs and activation traffic) at vLLM 0.11.0's block default is priced
    1.1-1.3x the kernel at the bf16 rate; 1.3x the bf16 rate, read off DeepSeek-R1's layer, puts the held-out
    Qwen3-235B-A22B-FP8 TP=4 layer within 7% at 1,024-8,192 tokens. The figure is recorded, not applied."""
    assert moe_vs_sim.derive_block_fp8(PROBE) == perf_classes.BLOCK_FP8_MOE_KERNEL_RATE == 1.3
    at_bf16 = moe_vs_sim.block_fp8_ratios(PROBE, 1.0, moe_vs_sim.BLOCK_FP8_JUDGED)
    assert len(at_bf16) == 4 and all(0.7 <= r <= 0.9 for _, r in at_bf16), at_bf16
    measured = moe_vs_sim.block_fp8_ratios(PROBE, perf_classes.BLOCK_FP8_MOE_KERNEL_RATE, moe_vs_sim.BLOCK_FP8_JUDGED)
    assert all(abs(r - 1.0) <= 0.07 for _, r in measured), measured
    assert perf_classes.BLOCK_FP8_MOE_RATE_SCALE == 1.0  # the step keeps the bf16 rate (perf_classes says why)


def test_qwen3_235b_bf16_tp8_layer_under_the_tuned_file_vllm_0_11_ships_is_priced_within_8_percent() -> None:
    """vLLM 0.11.0 ships ``E=128,N=192,device_name=NVIDIA_H100_80GB_HBM3.json`` (``data/vllm_moe_tiles.json``);
    the probe's 0.26 rows ran the same configs at every key (the tiles checked here). The whole layer the step
    prices at 0.11.0 is 0.93-1.05 of the kernel at 1,024-8,192 tokens: the bf16 TP=8 runs' misses are not the
    MoE price."""
    perf = moe_vs_sim._perf("qwen3-235b-a22b_tp8", "v0.11_default")
    moe = perf.moe_shape
    assert moe is not None and moe.tuned_tiles
    rows = [r for r in PROBE["rows"] if r["shape"] == "qwen3-235b-a22b_tp8" and r["mode"] == "vllm" and r["tokens"] >= 1024]
    assert len(rows) == 4
    for row in rows:
        tile = perf_classes.moe_tile(row["tokens"], moe.experts, perf._version, moe.block_quant, moe.tuned_tiles)
        assert (row["config"]["BLOCK_SIZE_M"], row["config"]["BLOCK_SIZE_N"]) == tile
        sim = (perf.moe_seconds(row["tokens"]) + perf.moe_activation_seconds(row["tokens"])) / moe.layers * 1e6
        assert 0.93 <= row["us"] / sim <= 1.05, (row["tokens"], row["us"], sim)


def test_the_by_batch_tile_is_vllm_0_17s_and_only_16_bit_experts_at_128x128_take_the_measured_rate() -> None:
    """vLLM 0.17.0 brought the by-batch default tiles (``fused_moe.py:1277-1322@v0.17.0``; 0.16.0 has 0.11's
    two tiles): 0.16 runs 64 x 64 above E tokens, 0.17 128 x 128 above 512. The measured rate is for 16-bit
    experts at 128 x 128 alone: not per-tensor fp8, not block fp8, not the 64 x 128 tile, not before 0.17."""
    assert perf_classes.MOE_TILE_BY_BATCH_SINCE == (0, 17, 0)
    assert perf_classes.moe_tile(8192, 128, (0, 16, 0)) == (64, 64)
    assert perf_classes.moe_tile(8192, 128, (0, 17, 0)) == (128, 128)
    bf16 = perf_classes.MoeShape(128, 8, 2048, 768, 48, perf_classes.WeightFormat(2.0, 1.0), fused_moe=True)
    rate = perf_classes.MOE_BY_BATCH_WIDE_TILE_RATE
    assert perf_classes.by_batch_tile_rate(bf16, (0, 17, 0), 128, 128) == rate == 2.25
    assert perf_classes.by_batch_tile_rate(bf16, (0, 16, 1), 128, 128) is None
    assert perf_classes.by_batch_tile_rate(bf16, (0, 26, 0), 64, 128) is None
    fp8 = dataclasses.replace(bf16, fmt=perf_classes.WeightFormat(1.0, 2.0))
    assert perf_classes.by_batch_tile_rate(fp8, (0, 26, 0), 128, 128) is None
    assert perf_classes.by_batch_tile_rate(dataclasses.replace(bf16, block_quant=True), (0, 26, 0), 128, 128) is None
    assert perf_classes.by_batch_tile_rate(dataclasses.replace(bf16, fused_moe=False), (0, 26, 0), 128, 128) is None


def test_the_wide_tile_rate_is_its_fit_and_holds_on_the_shapes_it_was_not_fitted_on() -> None:
    """MOE_BY_BATCH_WIDE_TILE_RATE is read off gpt-oss-120b TP=4's and Mixtral TP=1's vLLM 0.26 rows at the
    128 x 128 tile (8 rows), not chosen. Judged on Qwen3-30B-A3B's and DeepSeek-V2-Lite's (8 rows, 16-bit,
    aligned, the default config): 0.76-0.86 of their price at the tile model's 1.8, all within 15% at 2.25
    (measured 0.88-0.98). Qwen3-235B TP=8 (a tuned 4-warp config) goes 0.95-0.96 -> 1.09, and the unaligned
    gpt-oss-120b TP=8 0.99-1.17 -> 1.18-1.41: the rule's misses, recorded."""
    assert moe_vs_sim.derive_wide_tile(PROBE) == perf_classes.MOE_BY_BATCH_WIDE_TILE_RATE
    fit = moe_vs_sim.wide_tile_rows(PROBE, perf_classes.MOE_BY_BATCH_WIDE_TILE_RATE, moe_vs_sim.WIDE_TILE_FIT)
    judged_shapes = ("qwen3-30b-a3b_tp1", "deepseek-v2-lite_tp1")
    before = moe_vs_sim.wide_tile_rows(PROBE, 1.8, judged_shapes)
    after = moe_vs_sim.wide_tile_rows(PROBE, perf_classes.MOE_BY_BATCH_WIDE_TILE_RATE, judged_shapes)
    every = moe_vs_sim.wide_tile_rows(PROBE, 1.8, moe_vs_sim.WIDE_TILE_FIT + moe_vs_sim.WIDE_TILE_JUDGED)
    assert len(fit) == 8 and len(after) == 8 and len(every) == 22  # the fit: 8 of the tile's 22 16-bit rows
    assert sum(abs(r["ratio"] - 1) <= 0.15 for r in before) <= 2, [r["ratio"] for r in before]
    assert all(abs(r["ratio"] - 1) <= 0.15 for r in after), [r["ratio"] for r in after]
    oss_tp8 = moe_vs_sim.wide_tile_rows(PROBE, perf_classes.MOE_BY_BATCH_WIDE_TILE_RATE, ("gpt-oss-120b_tp8",))
    assert max(r["ratio"] for r in oss_tp8) > 1.3  # the unaligned layer's miss, priced faster still


def test_the_wide_tile_rate_is_not_applied_to_the_step() -> None:
    """Not taken (the real vLLM 0.26 windows did not improve end to end): the step keeps the tile model's 1.8."""
    assert _moe_tiles.MOE_BY_BATCH_WIDE_TILE_APPLIED is False and _moe_tiles.MOE_BY_BATCH_WIDE_TILE_RATE == 2.25
    rows = {r["tokens"]: r["ratio"] for r in moe_vs_sim.compare_layer(PROBE)
            if r["shape"] == "qwen3-30b-a3b_tp1" and r["mode"] == "vllm"}
    assert all(rows[t] < 0.85 for t in (2048, 4096, 8192)), rows


def test_the_wide_tile_rate_is_the_probes_fit_and_the_fit_reaches_the_step() -> None:
    """MOE_BY_BATCH_WIDE_TILE_RATE is ``moe_vs_sim --wide-tile``'s fit on its two shapes. The fit sets the rate and
    the switch on the module the step reads them from (``perf_classes`` re-exports them from ``_moe_tiles``): were it
    set where nothing reads it, every grid point would price alike and the fit would return the grid's first, 1.5.
    Both are restored after, and the step keeps the dense tile model (the switch off)."""
    assert moe_vs_sim.derive_wide_tile(PROBE) == perf_classes.MOE_BY_BATCH_WIDE_TILE_RATE == 2.25
    at_tile_model = moe_vs_sim.compare_layer({**PROBE, "rows": [r for r in PROBE["rows"]
                                                                if r.get("shape") == "mixtral-8x7b_tp1"]})
    wide = [r["ratio"] for r in at_tile_model if r["mode"] == "vllm" and r["tokens"] > 512]
    fitted = [r["ratio"] for r in moe_vs_sim.wide_tile_rows(PROBE, 2.25, ("mixtral-8x7b_tp1",))]
    assert len(wide) == len(fitted) == 4 and all(f > w * 1.1 for f, w in zip(fitted, wide)), (wide, fitted)
    assert _moe_tiles.MOE_BY_BATCH_WIDE_TILE_APPLIED is False and _moe_tiles.MOE_BY_BATCH_WIDE_TILE_RATE == 2.25


def test_the_unaligned_down_matrix_streams_at_the_per_sm_rate_on_the_h200_too() -> None:
    """The rule's cap (``_moe_tiles.MOE_UNALIGNED_DOWN_GBPS``) is read off the H100's rows (``moe_vs_sim --derive``);
    the H200's rows (the H100's SMs and clock, 1.43x its HBM) were measured after, and are judged here: its unaligned
    down matrix streams within 15% of the cap at 16-256 tokens under both tile sets, while its aligned layers stream
    well above it."""
    assert moe_vs_sim.derive_unaligned_cap(ALIGN) == _moe_tiles.MOE_UNALIGNED_DOWN_GBPS
    shape = MoeShape(128, 4, 2880, 360, 36, WeightFormat(2.0, 1.0), fused_moe=True)
    h200 = (json.loads(moe_vs_sim.ALIGN_PROBE_H200.read_text()),)
    for mode, version in (("v0.11_default", (0, 14, 1)), ("vllm", (0, 26, 0))):
        cap = unaligned_down_bytes_per_s(shape, version, get_gpu("H200"))
        assert cap is not None
        for tokens, (aligned, down) in moe_vs_sim.down_streaming_gbps(h200, mode).items():
            assert abs(down * 1e9 / cap - 1) < 0.15, (mode, tokens, down)
            assert aligned * 1e9 > 1.8 * cap


def test_the_unaligned_down_cap_scales_by_the_gpu_tables_sm_count() -> None:
    """One SM count, the GPU table's (``GpuSpec.sm_count``, 2026-12-06; the cap's own SM x clock table before):
    the B200's 148 SMs at 1,965 MHz over the H100's 132 at 1,980, half that on half the SMs, and no cap where the
    GPU's SM count (0) or clock is not known."""
    shape = MoeShape(128, 4, 2880, 360, 36, WeightFormat(2.0, 1.0), fused_moe=True)
    b200 = get_gpu("B200")
    cap = unaligned_down_bytes_per_s(shape, (0, 14, 1), b200)
    assert cap == pytest.approx(1250e9 * 148 * 1965 / (132 * 1980))
    assert unaligned_down_bytes_per_s(shape, (0, 14, 1), dataclasses.replace(b200, sm_count=74)) == pytest.approx(cap / 2)
    assert unaligned_down_bytes_per_s(shape, (0, 14, 1), dataclasses.replace(b200, sm_count=0)) is None


def test_the_expert_shapes_no_rule_was_read_off_are_priced_within_15_percent_at_the_default_tile() -> None:
    """The later probes (another H100 SXM, 2026-12-07): Qwen3.5-35B-A3B's layer (E=256, N=512), GLM-4.5-Air's at
    TP=4 (N=352) and Qwen3-Next-80B-A3B's at TP=4 (E=512, N=128), under vLLM 0.26's own no-tuned-file config. Against
    the whole layer a step prices, 31 of 35 rows are within 15% and all within 0.84-1.17: the routed experts of the
    Qwen3.5-35B-A3B page on an H200 (gpustack_qwen3_5_35b_a3b.yaml, simulated 32% fast at 512 in flight) are not
    priced fast at the kernel (0.86-0.95 there: the kernel ran a little faster than priced)."""
    rows = []
    for path in moe_vs_sim.UNSEEN_PROBES:
        probe = json.loads(path.read_text())
        assert "H100 80GB HBM3" in probe["gpu"] and probe["vllm"] == "0.26.0"
        assert all(row["us"] and row["error"] is None for row in probe["rows"])
        rows += [r for r in moe_vs_sim.compare_layer(probe) if r["mode"] == "default"]
    assert {r["shape"] for r in rows} == {"qwen3.5-35b-a3b_tp1", "glm-4.5-air_tp4", "qwen3-next-80b-a3b_tp4"}
    assert len(rows) >= 30
    assert sum(abs(r["ratio"] - 1.0) <= 0.15 for r in rows) / len(rows) >= 0.85
    assert all(0.8 <= r["ratio"] <= 1.2 for r in rows)
    q35 = [r["ratio"] for r in rows if r["shape"] == "qwen3.5-35b-a3b_tp1" and r["tokens"] >= 512]
    assert q35 and max(q35) < 1.0
