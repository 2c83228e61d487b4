"""The simulator's routed-expert price against vLLM's fused-MoE kernel timed on a GPU, per shape.

``benchmarks/real_vllm/moe_probe.py`` timed vLLM 0.26.0's ``fused_experts`` (one MoE layer: both
grouped GEMMs, the activation, the top-k sum) on an H100 SXM at the expert shapes of the published
MoE runs, 1-8,192 tokens, uniform routing, under the kernel configuration vLLM 0.26 picks and under
vLLM 0.11.0's default one (``tests/fixtures/real_h100/kernels/``). This prints, for each shape and
configuration, real/simulated time of one layer (``PerfModel.moe_seconds`` over the MoE layers) by
token range. Rows whose kernel configuration the simulator does not price are left out and counted:
a tuned file vLLM 0.26 ships (the simulator prices 0.26's default tiles), or a 0.11 shape for which
0.11 shipped a tuned file (the probe ran 0.11's default).

Nothing the step uses is fitted here. ``perf_classes.MOE_UNALIGNED_DOWN_SHARE`` is read off a second probe of the
same kernel on another H100 (``moe_probe_align_h100.json``, ``moe_probe_align2_h100.json``): unaligned
expert widths against their aligned neighbours; ``--derive`` prints its two figures, read off the
gpt-oss-120b TP=8 width, and judges them on the other widths; it prints too the same layer's down matrix's
streaming cap at 16-256 tokens (``_moe_tiles.MOE_UNALIGNED_DOWN_GBPS``) and the H200 probe's rates it is
judged on. In the first probe the gpt-oss-120b TP=8 rows are labelled ``fit`` (the same layer), every other
row is evidence.

``_moe_tiles.MOE_BY_BATCH_STREAM`` is read here (``--stream``): 16-bit experts' weight streaming rate and fixed
cost a layer under vLLM 0.26's by-batch tiles at 16-128 tokens, off four shapes of the first probe, judged on
Mixtral's layers and on the alignment probes' aligned layers (H100 and H200).

``perf_classes.MOE_BY_BATCH_WIDE_TILE_RATE`` is fitted here (``--wide-tile``): on the vLLM 0.26 rows of
:data:`WIDE_TILE_FIT` at the 128 x 128 default tile, judged on :data:`WIDE_TILE_JUDGED`'s.

Usage::

    PYTHONPATH=platform .venv/bin/python benchmarks/moe_vs_sim.py [--probe FILE] [--derive] [--layer] [--wide-tile] \
        [--stream] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "platform") not in sys.path:
    sys.path.insert(0, str(ROOT / "platform"))

from servetune.planner.gpus import get_gpu  # noqa: E402
from servetune.planner.memory import resolve_engine_config  # noqa: E402
from servetune.planner.modelinfo import load_model  # noqa: E402
from servetune.sim import PerfModel, calibration_for, perf_classes  # noqa: E402
# The modules that hold the constants the fits below set for a run: a constant is read where it is defined.
from servetune.sim import _moe_shape, _moe_tiles  # noqa: E402

PROBE = ROOT / "tests" / "fixtures" / "real_h100" / "kernels" / "moe_probe_h100.json"
#: The later probes of expert shapes no simulator rule was read off (2026-12-07, another H100 SXM, vLLM 0.26.0, modes
#: ``vllm`` and ``default``: the installed release's own no-tuned-file config): Qwen3.5-35B-A3B's layer (E=256,
#: N=512, top-8), GLM-4.5-Air's at TP=4 (E=128, H=4,096, N=352) and Qwen3-Next-80B-A3B's at TP=4 (E=512, N=128,
#: top-10); the first shape's plan, with the price written before it ran, is
#: ``benchmarks/real_vllm/plan_2026_12_07_q35moe_probe.json``.
UNSEEN_PROBES = tuple(ROOT / "tests" / "fixtures" / "real_h100" / "kernels" / name
                      for name in ("moe_probe_q35moe_h100.json", "moe_probe_glm_qnext_h100.json"))
GPT_OSS_BF16 = str(ROOT / "tests" / "fixtures" / "published_runs" / "models" / "gpt-oss-120b-bf16")
QWEN35_MOE = str(ROOT / "tests" / "fixtures" / "published_runs" / "models" / "qwen3.5-35b-a3b")
GLM45_AIR = str(ROOT / "tests" / "fixtures" / "published_runs" / "models" / "glm-4.5-air")
#: The probe's shape name -> (servetune model, TP, extra flags): the layer the probe timed is one TP rank's.
SHAPES: dict[str, tuple[str, int, dict[str, str]]] = {
    "qwen3-30b-a3b_tp1": ("qwen3-30b-a3b", 1, {}),
    "qwen3-30b-a3b_tp1_fp8": ("qwen3-30b-a3b", 1, {"quantization": "fp8"}),
    "qwen3-235b-a22b_tp8": ("qwen3-235b-a22b-2507", 8, {}),
    "qwen3-235b-a22b-fp8_tp4": ("qwen3-235b-a22b-2507-fp8", 4, {}),
    "gpt-oss-120b_tp8": (GPT_OSS_BF16, 8, {}),
    "gpt-oss-120b_tp4": (GPT_OSS_BF16, 4, {}),
    "deepseek-r1_tp8": ("deepseek-r1", 8, {}),
    "deepseek-v2-lite_tp1": ("deepseek-v2-lite", 1, {}),
    "mixtral-8x7b_tp1": ("mixtral-8x7b", 1, {}),
    "mixtral-8x7b_tp2": ("mixtral-8x7b", 2, {}),
    "qwen3.5-35b-a3b_tp1": (QWEN35_MOE, 1, {}),
    "glm-4.5-air_tp4": (GLM45_AIR, 4, {}),
    "qwen3-next-80b-a3b_tp4": ("qwen3-next-80b-a3b", 4, {}),
}
#: The vLLM release each probe configuration stands for.
MODE_VERSION = {"vllm": "0.26.0", "v0.11_default": "0.11.0", "default": "0.26.0"}
#: The shapes :data:`servetune.sim.perf_classes.MOE_UNALIGNED_DOWN_SHARE` was read off.
FIT_SHAPES = frozenset({"gpt-oss-120b_tp8"})
RANGES = ((1, 64), (128, 1024), (2048, 8192))


def _perf(shape: str, mode: str) -> PerfModel:
    name, tp, extra = SHAPES[shape]
    model = load_model(name)
    gpu = get_gpu("H100-80GB")
    config = resolve_engine_config({"tensor_parallel_size": tp, "max_model_len": 4096, **extra}, model, gpu,
                                   vllm_version=MODE_VERSION[mode])
    return PerfModel(model, gpu, config, calibration_for(gpu))


def _priced(perf: PerfModel, row: dict, mode: str) -> bool:
    """Whether the simulator prices the kernel configuration the probe ran for ``row``."""
    moe = perf.moe_shape
    assert moe is not None
    if mode == "v0.11_default":
        return not moe.tuned_tiles  # 0.11 ran its tuned file there, the probe 0.11's default
    tile = perf_classes.moe_tile(row["tokens"], moe.experts, (0, 26, 0), moe.block_quant)
    return (row["config"]["BLOCK_SIZE_M"], row["config"]["BLOCK_SIZE_N"]) == tile


def compare(probe: dict) -> tuple[list[dict], dict[str, int]]:
    """Per timed row: real and simulated microseconds of one layer; and the rows left out, by reason."""
    out: list[dict] = []
    left = {"tuned file not priced": 0, "unknown shape": 0}
    perfs: dict[tuple[str, str], PerfModel] = {}
    for row in probe["rows"]:
        shape, mode = row.get("shape"), row.get("mode")
        if shape not in SHAPES or row.get("us") is None:
            left["unknown shape"] += 1
            continue
        perf = perfs.setdefault((shape, mode), _perf(shape, mode))
        if not _priced(perf, row, mode):
            left["tuned file not priced"] += 1
            continue
        moe = perf.moe_shape
        assert moe is not None
        sim_us = perf.moe_seconds(row["tokens"]) / moe.layers * 1e6
        out.append({"shape": shape, "mode": mode, "tokens": row["tokens"], "real_us": row["us"],
                    "sim_us": round(sim_us, 2), "ratio": round(row["us"] / sim_us, 3),
                    "split": "fit" if shape in FIT_SHAPES else "held_out"})
    return out, left


def compare_layer(probe: dict) -> list[dict]:
    """:func:`compare` with the whole layer a step prices: ``moe_seconds`` plus the routed experts' activation
    traffic the step charges beside it (``PerfModel.moe_activation_seconds``), which the timed ``fused_experts``
    pays inside its kernels (each routed row's token read, gate/up output written and read, hidden row written)."""
    out, _ = compare(probe)
    perfs: dict[tuple[str, str], PerfModel] = {}
    for row in out:
        perf = perfs.setdefault((row["shape"], row["mode"]), _perf(row["shape"], row["mode"]))
        moe = perf.moe_shape
        assert moe is not None
        act_us = perf.moe_activation_seconds(row["tokens"]) / moe.layers * 1e6
        row["sim_us"] = round(row["sim_us"] + act_us, 2)
        row["ratio"] = round(row["real_us"] / row["sim_us"], 3)
    return out


#: The block-fp8 layer the kernel rate of block-quantized fp8 experts is read off (:func:`derive_block_fp8`),
#: and the one it is judged on: DeepSeek-R1's TP=8 layer (E=256, H=7,168, I=256) and Qwen3-235B-A22B-FP8's
#: TP=4 layer (E=128, H=4,096, I=384), both under vLLM 0.11.0's block default (64 x 128 x 128, no tuned
#: H100 file for either at 0.11.0).
BLOCK_FP8_FIT, BLOCK_FP8_JUDGED = "deepseek-r1_tp8", "qwen3-235b-a22b-fp8_tp4"
BLOCK_FP8_GRID = tuple(round(1.0 + 0.05 * i, 2) for i in range(21))


@contextlib.contextmanager
def _block_fp8_rate(scale: float) -> Iterator[None]:
    """``perf_classes.BLOCK_FP8_MOE_RATE_SCALE`` set to ``scale`` while the block, on ``_moe_shape``, where
    ``moe_shape`` reads it."""
    kept = _moe_shape.BLOCK_FP8_MOE_RATE_SCALE
    _moe_shape.BLOCK_FP8_MOE_RATE_SCALE = scale
    try:
        yield
    finally:
        _moe_shape.BLOCK_FP8_MOE_RATE_SCALE = kept


def block_fp8_ratios(probe: dict, scale: float, shape: str) -> list[tuple[int, float]]:
    """(tokens, real / simulated whole layer) of ``shape`` under vLLM 0.11.0's tiles at 1,024-8,192 tokens with
    block-fp8 experts at ``scale`` times the bf16 rate."""
    with _block_fp8_rate(scale):
        rows = [r for r in compare_layer({**probe, "rows": [r for r in probe["rows"] if r.get("shape") == shape]})
                if r["mode"] == "v0.11_default" and r["tokens"] >= 1024]
    return [(r["tokens"], r["ratio"]) for r in rows]


def derive_block_fp8(probe: dict) -> float:
    """The rate of block-fp8 experts against bf16 that best prices :data:`BLOCK_FP8_FIT`'s whole layer (mean
    |log(real / simulated)| over 1,024-8,192 tokens, on :data:`BLOCK_FP8_GRID`)."""
    def loss(scale: float) -> float:
        ratios = block_fp8_ratios(probe, scale, BLOCK_FP8_FIT)
        return sum(abs(math.log(r)) for _, r in ratios) / len(ratios)
    return min(BLOCK_FP8_GRID, key=loss)


#: The shapes :data:`~servetune.sim.perf_classes.MOE_BY_BATCH_WIDE_TILE_RATE` is fitted on (their vLLM 0.26 rows at
#: the by-batch default's 128 x 128 tile, 1,024-8,192 tokens: 8 rows), and the 16-bit shapes whose rows at that tile
#: judge it (14 rows). Chosen before the fit: two models with no real vLLM 0.26 window (gpt-oss-120b bf16) or whose
#: windows are a 16-layer cut (Mixtral), one many-expert and one eight-expert layer.
WIDE_TILE_FIT = ("gpt-oss-120b_tp4", "mixtral-8x7b_tp1")
WIDE_TILE_JUDGED = ("qwen3-30b-a3b_tp1", "deepseek-v2-lite_tp1", "qwen3-235b-a22b_tp8", "gpt-oss-120b_tp8")
WIDE_TILE_GRID = tuple(round(1.5 + 0.05 * i, 2) for i in range(27))


@contextlib.contextmanager
def _wide_tile_rate(rate: float) -> Iterator[None]:
    """``perf_classes.MOE_BY_BATCH_WIDE_TILE_RATE`` set to ``rate`` and applied to the step while the block, on
    ``_moe_tiles``, where ``by_batch_tile_rate`` and the step read them."""
    kept = _moe_tiles.MOE_BY_BATCH_WIDE_TILE_RATE, _moe_tiles.MOE_BY_BATCH_WIDE_TILE_APPLIED
    _moe_tiles.MOE_BY_BATCH_WIDE_TILE_RATE, _moe_tiles.MOE_BY_BATCH_WIDE_TILE_APPLIED = rate, True
    try:
        yield
    finally:
        _moe_tiles.MOE_BY_BATCH_WIDE_TILE_RATE, _moe_tiles.MOE_BY_BATCH_WIDE_TILE_APPLIED = kept


def wide_tile_rows(probe: dict, rate: float, shapes: tuple[str, ...]) -> list[dict]:
    """:func:`compare_layer`'s rows of ``shapes`` under vLLM 0.26's configuration at the 128 x 128 tile (more than 512
    tokens) with :data:`~servetune.sim.perf_classes.MOE_BY_BATCH_WIDE_TILE_RATE` at ``rate``."""
    with _wide_tile_rate(rate):
        rows = compare_layer({**probe, "rows": [r for r in probe["rows"] if r.get("shape") in shapes]})
    return [r for r in rows if r["mode"] == "vllm" and r["tokens"] > 512]


def derive_wide_tile(probe: dict) -> float:
    """The 128 x 128 tile's rate against 0.11's 64 x 64 that best prices :data:`WIDE_TILE_FIT`'s whole layers (mean
    |log(real / simulated)| over their rows at that tile, on :data:`WIDE_TILE_GRID`)."""
    def loss(rate: float) -> float:
        rows = wide_tile_rows(probe, rate, WIDE_TILE_FIT)
        return sum(abs(math.log(r["ratio"])) for r in rows) / len(rows)
    return min(WIDE_TILE_GRID, key=loss)


def _print_wide_tile(probe: dict) -> int:
    """``--wide-tile``: the fit and its judgement, per shape, at the tile model's 1.8 and at the fitted rate."""
    rate = derive_wide_tile(probe)
    print(f"16-bit experts at vLLM 0.17+'s 128 x 128 default tile against 0.11's 64 x 64, read off "
          f"{', '.join(WIDE_TILE_FIT)} (whole layer, 1,024-8,192 tokens): {rate}")
    for value in sorted({1.8, rate}):
        for role, shapes in (("fit", WIDE_TILE_FIT), ("judged", WIDE_TILE_JUDGED)):
            for shape in shapes:
                cells = " ".join(f"{r['tokens']}:{r['ratio']:.2f}" for r in wide_tile_rows(probe, value, (shape,)))
                print(f"  at {value}: {role:<7}{shape:<24} real/simulated {cells}")
    return 0


#: The 16-bit layers :data:`~servetune.sim._moe_tiles.MOE_BY_BATCH_STREAM` is read off (``--stream``), the token
#: counts where few rows reach each expert, and the rows that judge it: Mixtral-8x7B's layers (the shape whose real
#: windows were slow, never used by the fit), the H100 alignment probes' aligned layers and the H200's.
STREAM_FIT = ("qwen3-30b-a3b_tp1", "deepseek-v2-lite_tp1", "qwen3-235b-a22b_tp8", "gpt-oss-120b_tp4")
STREAM_JUDGED = ("mixtral-8x7b_tp1", "mixtral-8x7b_tp2")
STREAM_TOKENS = (16, 32, 64, 128)
#: The datasheet bandwidths the rate is a share of (the GPU table's): the probe's H100, and the H200 it is judged on.
H100_HBM_GBPS = get_gpu("H100-80GB").hbm_gbps
H200_HBM_GBPS = get_gpu("H200").hbm_gbps


def stream_points(probe: dict, shapes: tuple[str, ...] | None) -> list[tuple[str, int, float, float]]:
    """(shape, tokens, bytes, seconds) of ``probe``'s 16-bit rows under vLLM 0.26's configuration at
    :data:`STREAM_TOKENS` (``shapes``: those named; None: the aligned ``a_`` layers): the bytes of the experts
    uniform routing touches (``distinct_experts``)."""
    out = []
    for r in probe["rows"]:
        name = r.get("shape", "")
        wanted = name in shapes if shapes is not None else name.startswith("a_")
        if not wanted or r.get("us") is None or r.get("mode") != "vllm" or r["tokens"] not in STREAM_TOKENS \
                or r.get("weights", "bf16") != "bf16":
            continue
        touched = _moe_shape.distinct_experts(r["experts"], r["top_k"], r["tokens"])
        out.append((name, r["tokens"], touched * 3 * r["hidden"] * r["intermediate"] * 2.0, r["us"] * 1e-6))
    return out


def derive_stream(probe: dict) -> dict[str, float]:
    """Least squares of seconds = ``call_s`` + bytes / (``hbm_share`` x the H100's datasheet bandwidth) over
    :data:`STREAM_FIT`'s rows (:func:`stream_points`)."""
    pts = stream_points(probe, STREAM_FIT)
    n = len(pts)
    mean_b, mean_t = sum(p[2] for p in pts) / n, sum(p[3] for p in pts) / n
    slope = (sum((p[2] - mean_b) * (p[3] - mean_t) for p in pts) / sum((p[2] - mean_b) ** 2 for p in pts))
    return {"hbm_share": round(1.0 / slope / (H100_HBM_GBPS * 1e9), 3),
            "call_s": round((mean_t - slope * mean_b) * 1e6, 1) * 1e-6}


def _print_stream(probe: dict) -> int:
    """``--stream``: the fit, and real / predicted on the rows fitted and the rows judged (the H200's at its own
    bandwidth)."""
    fit = derive_stream(probe)
    print(f"16-bit experts under vLLM 0.26's by-batch tiles at {', '.join(map(str, STREAM_TOKENS))} tokens, read off "
          f"{', '.join(STREAM_FIT)}: {fit['hbm_share']} of the datasheet bandwidth "
          f"({fit['hbm_share'] * H100_HBM_GBPS:.0f} GB/s on the H100) + {fit['call_s'] * 1e6:.1f} us a layer")
    groups = [("fit", 1.0, stream_points(probe, STREAM_FIT)), ("judged", 1.0, stream_points(probe, STREAM_JUDGED))]
    groups += [("judged H100 aligned", 1.0, stream_points(json.loads(p.read_text()), None)) for p in ALIGN_PROBES]
    h200_aligned = stream_points(json.loads(ALIGN_PROBE_H200.read_text()), None)
    groups.append(("judged H200 aligned", H200_HBM_GBPS / H100_HBM_GBPS, h200_aligned))
    for role, scale, pts in groups:
        for name, tokens, nbytes, seconds in pts:
            predicted = fit["call_s"] + nbytes / (fit["hbm_share"] * H100_HBM_GBPS * 1e9 * scale)
            print(f"  {role:<20}{name:<24}{tokens:>5} tokens: real {seconds * 1e6:7.1f} us, predicted "
                  f"{predicted * 1e6:7.1f}, real/predicted {seconds / predicted:.3f}")
    return 0


ALIGN_PROBES = (ROOT / "tests" / "fixtures" / "real_h100" / "kernels" / "moe_probe_align_h100.json",
                ROOT / "tests" / "fixtures" / "real_h100" / "kernels" / "moe_probe_align2_h100.json")
#: The alignment probe's groups: an expert width that is not a multiple of 16 and its aligned neighbours
#: (same experts, hidden size and top-k). The first is gpt-oss-120b's TP=8 layer, which
#: ``MOE_UNALIGNED_DOWN_SHARE`` is read off; the others judge it.
ALIGN_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ua_h2880_i360", ("a_h2880_i352", "a_h2880_i368")),
    ("ua_h4096_i200", ("a_h4096_i192", "a_h4096_i208")),
    ("ua_h2048_i1000", ("a_h2048_i992", "a_h2048_i1008")),
    ("ua_e32_h2880_i360", ("a_e32_h2880_i352", "a_e32_h2880_i368")),
    ("ua_e128_h2048_i100", ("a_e128_h2048_i96", "a_e128_h2048_i112")),
    ("ua_h4096_i200_fp8", ("a_h4096_i192_fp8",)),
)
PROBE_MODES = {"vllm": "by_batch", "v0.11_default": "v0.11_default"}


def _align_rows(probes: tuple[dict, ...]) -> dict[tuple[str, str, int], dict]:
    return {(r["shape"], r["mode"], r["tokens"]): r for probe in probes for r in probe["rows"] if r.get("us")}


def _rate(row: dict) -> float:
    """FLOPs per microsecond of one timed layer (both GEMMs)."""
    return 2.0 * row["tokens"] * row["top_k"] * 3 * row["hidden"] * row["intermediate"] / row["us"]


def predicted_us(rows: dict[tuple[str, str, int], dict], group: tuple[str, tuple[str, ...]], mode: str,
                 tokens: int, share: float) -> float:
    """The unaligned layer's time by the rule: its gate/up GEMM (two thirds of the FLOPs) at the aligned
    neighbours' layer rate, its down GEMM at ``share`` of it."""
    unaligned, aligned = group
    row = rows[(unaligned, mode, tokens)]
    rate = sum(_rate(rows[(a, mode, tokens)]) for a in aligned) / len(aligned)
    flops = 2.0 * tokens * row["top_k"] * 3 * row["hidden"] * row["intermediate"]
    return flops * 2 / 3 / rate + flops / 3 / (share * rate)


def derive_unaligned(probes: tuple[dict, ...]) -> dict[str, float]:
    """The down GEMM's rate at an unaligned expert width against its aligned neighbours' layer rate, per
    kernel configuration, from the first group of :data:`ALIGN_GROUPS` (gpt-oss-120b's TP=8 layer,
    K = 360, against K = 352 and 368), mean over 4,096 and 8,192 tokens. The gate/up GEMM (K = hidden,
    aligned in all three) runs at the neighbours' rate; what the layer takes beyond it is the down GEMM."""
    rows = _align_rows(probes)
    unaligned, aligned = ALIGN_GROUPS[0]
    shares: dict[str, float] = {}
    for mode, key in PROBE_MODES.items():
        values = []
        for tokens in (4096, 8192):
            row = rows[(unaligned, mode, tokens)]
            rate = sum(_rate(rows[(a, mode, tokens)]) for a in aligned) / len(aligned)
            flops = 2.0 * tokens * row["top_k"] * 3 * row["hidden"] * row["intermediate"]
            values.append(flops / 3 / (row["us"] - flops * 2 / 3 / rate) / rate)
        shares[key] = round(sum(values) / len(values), 3)
    return shares


#: The token counts the unaligned down matrix's streaming cap is read at: few rows per expert, weight-bound.
CAP_TOKENS = (16, 64, 256)
#: The H200 probe the cap is judged on (the H100's SMs and clock, 1.43x its HBM), measured after it was read.
ALIGN_PROBE_H200 = ROOT / "tests" / "fixtures" / "real_h200_classes" / "kernels" / "moe_probe_align_h200.json"


def down_streaming_gbps(probes: tuple[dict, ...], mode: str,
                        tokens: tuple[int, ...] = CAP_TOKENS) -> dict[int, tuple[float, float]]:
    """Per token count: the aligned neighbours' weight streaming rate and the unaligned layer's down matrix's
    (GB/s), for the first group of :data:`ALIGN_GROUPS` (gpt-oss-120b's TP=8 layer, bf16 weights) with uniform
    routing's touched experts; the unaligned layer's gate/up GEMM streams at the neighbours' rate, the rest of
    its time is the down matrix's."""
    rows = _align_rows(probes)
    unaligned, aligned = ALIGN_GROUPS[0]
    out = {}
    for t in tokens:
        row = rows[(unaligned, mode, t)]
        touched = perf_classes.distinct_experts(row["experts"], row["top_k"], t)
        rate = sum(touched * 3 * rows[(a, mode, t)]["hidden"] * rows[(a, mode, t)]["intermediate"] * 2
                   / rows[(a, mode, t)]["us"] for a in aligned) / len(aligned)  # bytes per microsecond
        down = touched * row["hidden"] * row["intermediate"] * 2
        out[t] = (rate * 1e-3, down / (row["us"] - 2 * down / rate) * 1e-3)
    return out


def derive_unaligned_cap(probes: tuple[dict, ...]) -> dict[str, float]:
    """``_moe_tiles.MOE_UNALIGNED_DOWN_GBPS``: the mean of :func:`down_streaming_gbps`' down rates at
    :data:`CAP_TOKENS`, per kernel configuration, to 10 GB/s."""
    return {key: round(sum(down for _, down in down_streaming_gbps(probes, mode).values()) / len(CAP_TOKENS), -1)
            for mode, key in PROBE_MODES.items()}


def judge_unaligned(probes: tuple[dict, ...], shares: dict[str, float]) -> list[dict]:
    """Every group's unaligned layer at 1,024-8,192 tokens against the rule's prediction; the first
    group is the fit, the rest held out."""
    rows = _align_rows(probes)
    out = []
    for index, group in enumerate(ALIGN_GROUPS):
        for mode, key in PROBE_MODES.items():
            for tokens in (1024, 2048, 4096, 8192):
                if (group[0], mode, tokens) not in rows:
                    continue
                real = rows[(group[0], mode, tokens)]["us"]
                predicted = predicted_us(rows, group, mode, tokens, shares[key])
                out.append({"shape": group[0], "mode": mode, "tokens": tokens, "real_us": round(real, 1),
                            "rule_us": round(predicted, 1), "error_pct": round(100 * (predicted / real - 1), 1),
                            "split": "fit" if index == 0 else "held_out"})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", type=Path, default=PROBE)
    parser.add_argument("--derive", action="store_true",
                        help="print MOE_UNALIGNED_DOWN_SHARE's derivation from the probe and stop")
    parser.add_argument("--layer", action="store_true",
                        help="compare the whole layer a step prices (moe_seconds plus the experts' activation traffic)")
    parser.add_argument("--block-fp8", action="store_true",
                        help="print the block-fp8 experts' kernel rate read off DeepSeek-R1's layer, judged on "
                             "Qwen3-235B-A22B-FP8's, and stop")
    parser.add_argument("--wide-tile", action="store_true",
                        help="print the 16-bit experts' rate at vLLM 0.17+'s 128 x 128 default tile, fitted on two "
                             "shapes and judged on the others, and stop")
    parser.add_argument("--stream", action="store_true",
                        help="print the 16-bit experts' streaming rate and fixed cost under vLLM 0.26's tiles, fitted "
                             "on four shapes and judged on Mixtral's and the alignment probes' aligned layers, "
                             "and stop")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    probe = json.loads(args.probe.read_text())
    if args.stream:
        return _print_stream(probe)
    if args.wide_tile:
        return _print_wide_tile(probe)
    if args.block_fp8:
        return _print_block_fp8(probe)
    if args.derive:
        probes = tuple(json.loads(path.read_text()) for path in ALIGN_PROBES)
        shares = derive_unaligned(probes)
        print(json.dumps(shares))
        print(json.dumps({"down_gbps_cap": derive_unaligned_cap(probes)}))
        h200 = (json.loads(ALIGN_PROBE_H200.read_text()),)
        for mode in PROBE_MODES:
            print(json.dumps({"h200": mode, "aligned_and_down_gbps": down_streaming_gbps(h200, mode)}))
        for row in judge_unaligned(probes, shares):
            print(json.dumps(row))
        return 0
    rows, left = compare(probe)
    if args.layer:
        rows = compare_layer(probe)
    if args.json:
        print(json.dumps({"gpu": probe["gpu"], "vllm": probe["vllm"], "rows": rows, "left_out": left}, indent=1))
        return 0
    what = "moe_seconds + the experts' activation traffic" if args.layer else "moe_seconds"
    print(f"{probe['gpu']}, vLLM {probe['vllm']}: one MoE layer's fused_experts, real/simulated ({what}) by token "
          f"range (left out: {left})")
    print(f"{'shape':<26}{'config':<15}{'split':<10}" + "".join(f"{f'{lo}-{hi}':>12}" for lo, hi in RANGES))
    for shape in SHAPES:
        for mode in MODE_VERSION:
            cells = []
            for low, high in RANGES:
                ratios = [r["ratio"] for r in rows if r["shape"] == shape and r["mode"] == mode
                          and low <= r["tokens"] <= high]
                cells.append(f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):>12.2f}" if ratios else f"{'-':>12}")
            split = "fit" if shape in FIT_SHAPES else "held_out"
            print(f"{shape:<26}{mode:<15}{split:<10}" + "".join(cells))
    held = [r for r in rows if r["split"] == "held_out"]
    for low, high in RANGES:
        part = [r for r in held if low <= r["tokens"] <= high]
        within = sum(abs(r["ratio"] - 1) <= 0.15 for r in part)
        print(f"held out, {low}-{high} tokens: {within} of {len(part)} rows within 15%")
    return 0


def _print_block_fp8(probe: dict) -> int:
    """``--block-fp8``: the derivation and its judgement, one line per scale of interest."""
    scale = derive_block_fp8(probe)
    print(f"block-fp8 experts' rate against bf16, read off {BLOCK_FP8_FIT} (whole layer, 0.11.0 tiles, "
          f"1,024-8,192 tokens): {scale}")
    for value in sorted({perf_classes.BLOCK_FP8_MOE_RATE_SCALE, scale}):
        for shape in (BLOCK_FP8_FIT, BLOCK_FP8_JUDGED):
            cells = " ".join(f"{tokens}:{ratio:.2f}" for tokens, ratio in block_fp8_ratios(probe, value, shape))
            print(f"  at {value}: {shape:<26} real/simulated {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
