"""The simulator's GPU-kernel knobs measured on kernels, not fitted to whole windows.

A window's throughput is the sum of everything a step does; fitted to windows alone, a knob that
is wrong one way (GEMMs priced fast) is paid for by another that is wrong the other way (decode
attention priced slow), and the pair breaks at a size where their shares differ (the 2026-12-03
calibration ran 24B prefill-heavy loads 7.5% fast). Here each GPU knob is read off the kernels that do that work:

* **GEMMs** (``compute_efficiency``, ``gemm_blend_exponent``, with ``gemm_token_tile`` held at 8)
  off the isolated cuBLAS probes (``tests/fixtures/real_h200/gemm/gemm_probe_h200.json``: the four
  layer GEMMs of the 8B, 14B and 24B shapes at 64-8,192 tokens; ``gemm_probe_small_m_h200.json``:
  the same at 30 counts from 16 to 8,192; benchmarks/real_vllm/gemm_probe.py), each GEMM of at least
  :data:`MIN_PROBE_S` against its element of ``PerfModel.layer_gemm_seconds`` (the product's own
  formula), and the GEMM time of vLLM's traced steps (against ``PerfModel.gpu_cost``), over a grid,
  mean |log error| of each source. The 0.85B shape's GEMMs are left out: at 64-256 tokens they last
  a few microseconds and measure cuBLAS's launch and split-K overheads, not a rate (users run 7B-70B).
* **Attention and the KV-cache write** (``attn_layer_s``, ``kv_read_efficiency``,
  ``attn_efficiency``, ``kv_write_efficiency``) off vLLM's own profiler traces of 560 engine steps
  (their reduction, each window's ``steps.json.gz``; ``steps_vs_sim.profiled_windows``: 8B, 14B, 24B on four hosts). Decode-only steps give the
  attention kernels' cost per layer and the KV read rate (least squares in layers and KV bytes
  read); mixed steps, less that decode part, the prefill attention rate; every step's
  ``reshape_and_cache`` time over the KV bytes it wrote, the write rate.

``mem_efficiency`` is not refitted: the weight-streaming decode steps (4 sequences) took 4.00 ms
(8B) and 11.67 ms (24B) of GEMM time where the committed value prices 3.97 and 12.11.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

from _fidelity import FIXTURES, HOST_MODELS, serving_flags
from real_vllm.trace_steps import window_steps
from steps_vs_sim import profiled_windows, step_batch

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.sim import PerfModel, calibration_for

__all__ = ["GEMM_MODELS", "MIN_PROBE_S", "PROBE", "PROBES", "fit_gemm", "fit_attention", "gemm_step_groups",
           "kernel_knobs", "traced_steps"]

PROBE = FIXTURES / "gemm" / "gemm_probe_h200.json"
#: The GEMM probes fit_gemm reads: 64-8,192 tokens, then 16-8,192 in 30 counts (2026-12-04, two
#: hosts), then 1-2,048 in 20 counts replayed from CUDA graphs over L2-cold weights (a third host).
PROBES: tuple[Path, ...] = (PROBE, FIXTURES / "gemm" / "gemm_probe_small_m_h200.json",
                            FIXTURES / "gemm" / "gemm_probe_graph_h200.json")
#: Probed GEMMs shorter than this are left out: the probe launches each from Python, and the 8B
#: qkv and o GEMMs sat at 26-35 us from 16 to 384 tokens (their weights stream in 7-10 us at the
#: memory rate), a dispatch floor vLLM's CUDA graphs do not pay (its traced 128-sequence decode
#: steps ran the 8B layer's four GEMMs in 138 us, the probe in 167).
MIN_PROBE_S = 40e-6
#: The probe's shapes the GEMM knobs are fitted on (see the module docstring for the 0.85B one).
GEMM_MODELS: tuple[str, ...] = ("llama-3.1-8b", "qwen2.5-14b", "mistral-small-24b")
_GPU = "H200"


def gemm_step_groups(steps: list[tuple[PerfModel, dict]]) -> list[list[dict]]:
    """The traced steps by window and step class (mixed or decode only): one group per row of
    ``steps_vs_sim``'s table, each a point of the GEMM fit whatever its number of steps."""
    groups: dict[tuple[int, bool], list[dict]] = {}
    for perf, step in steps:
        groups.setdefault((id(perf), step["ctx_tokens"] > 0), []).append(step)
    return list(groups.values())


def fit_gemm(probes: Iterable[Path] = PROBES, models: Iterable[str] = GEMM_MODELS,
             step_groups: list[list[dict]] | None = None, token_tile: int = 8) -> dict[str, float]:
    """``compute_efficiency`` and ``gemm_blend_exponent`` that best price every GEMM measured: each
    probed GEMM that lasted at least :data:`MIN_PROBE_S` (against its element of
    ``PerfModel.layer_gemm_seconds``) and the traced steps' GEMM time (``step_groups``:
    :func:`gemm_step_groups`): the mean |log error| over the probed GEMMs plus the same over the
    traced step groups (each group's mean log error), the two sources weighed alike.

    Both are needed. The first probe timed nothing under 64 tokens; fitted on it alone
    (2026-12-04) the blend came out at 2, which priced 4-256-sequence decode steps' GEMMs 4-13%
    slow and ran the 24B decode windows of 2026-12-04b and 2026-12-04c 4-11% slow. The traces timed nothing
    between 256 and 2,048 tokens; the second probe (16-8,192 tokens, 30 counts) covers the ridge,
    where the blend decides. ``token_tile``: ``gemm_token_tile``, held (8: the tile widths vLLM's
    cuBLAS kernels were named with in the traces).
    """
    step_groups = step_groups if step_groups is not None else gemm_step_groups(traced_steps())
    gpu = get_gpu(_GPU)
    labels = ("qkv", "o", "gate_up", "down")
    probed: list[tuple[str, int, int, float]] = []  # (model, tokens, index in layer_gemm_seconds, seconds)
    for probe in probes:
        data = json.loads(probe.read_text())
        # A probe replayed from a CUDA graph launched nothing from Python: every GEMM of it counts.
        floor = 0.0 if data.get("mode") == "cuda_graph" else MIN_PROBE_S
        for row in data["gemms"]:
            if row["model"] in models and row["seconds"] >= floor:
                probed.append((row["model"], row["m"], labels.index(row["gemm"]), row["seconds"]))
    profiles = {name: load_model(name) for name in {m for m, _, _, _ in probed}}
    configs = {name: resolve_engine_config({}, p, gpu) for name, p in profiles.items()}
    base = calibration_for(gpu).with_overrides({"gemm_token_tile": token_tile})
    best: tuple[float, float, float] | None = None
    for ce_step in range(120, 181):  # compute_efficiency 0.600 .. 0.900
        ce = ce_step / 200
        for p in (0.0, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0):
            cal = base.with_overrides({"compute_efficiency": ce, "gemm_blend_exponent": p})
            perfs = {name: PerfModel(prof, gpu, configs[name], cal) for name, prof in profiles.items()}
            seconds: dict[tuple[str, int], tuple[float, ...]] = {}
            loss = 0.0
            for name, tokens, index, real in probed:
                layer = seconds.get((name, tokens)) or seconds.setdefault(
                    (name, tokens), perfs[name].layer_gemm_seconds(tokens))
                # |log|, not its square: a shape where cuBLAS's heuristic picks a poor kernel (the
                # 14B and 24B down GEMMs at 1,024 tokens ran 40% slower than at 768 or 2,048)
                # should not steer the rate of every other GEMM.
                loss += abs(math.log(layer[index] / profiles[name].num_layers / real)) / len(probed)
            for group in step_groups:
                perf = PerfModel(group[0]["_model"], gpu, group[0]["_config"], cal)
                logs = [math.log(perf.gpu_cost(**step_batch(step)).gemm / (step["by_kind_us"]["gemm"] / 1e6))
                        for step in group]
                loss += abs(sum(logs) / len(logs)) / len(step_groups)
            if best is None or loss < best[0]:
                best = (loss, ce, p)
    assert best is not None
    return {"compute_efficiency": best[1], "gemm_blend_exponent": best[2], "gemm_token_tile": float(token_tile)}


def traced_steps(windows: Iterable[Path] | None = None) -> list[tuple[PerfModel, dict]]:
    """Each traced engine step with a PerfModel of its start (committed calibration); the step
    carries its start's model profile and engine config (``_model``, ``_config``)."""
    gpu = get_gpu(_GPU)
    out = []
    for window in windows if windows is not None else profiled_windows():
        summary = json.loads((window / "summary.json").read_text())
        model = load_model(HOST_MODELS[summary["model"]])
        config = resolve_engine_config(serving_flags(summary["flags"]), model, gpu)
        perf = PerfModel(model, gpu, config)
        for step in window_steps(window)["steps"]:
            out.append((perf, {**step, "_model": model, "_config": config}))
    return out


def _lsq2(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares y = a x1 + b x2 (no intercept) over (x1, x2, y)."""
    s11 = sum(x1 * x1 for x1, _, _ in rows)
    s12 = sum(x1 * x2 for x1, x2, _ in rows)
    s22 = sum(x2 * x2 for _, x2, _ in rows)
    s1y = sum(x1 * y for x1, _, y in rows)
    s2y = sum(x2 * y for _, x2, y in rows)
    det = s11 * s22 - s12 * s12
    if det <= 0:
        raise ValueError("the steps do not separate the two terms")
    return (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det


def fit_attention(steps: list[tuple[PerfModel, dict]] | None = None) -> dict[str, float]:
    """``attn_layer_s``, ``kv_read_efficiency``, ``attn_efficiency`` and ``kv_write_efficiency``
    off the traced steps' attention and KV-write kernels (bf16 KV caches only)."""
    steps = steps if steps is not None else traced_steps()
    gpu = get_gpu(_GPU)
    bw = gpu.hbm_gbps * 1e9
    decode, mixed, writes = [], [], []
    for perf, step in steps:
        model = step["_model"]
        layers = perf.layers_per_stage
        kv_token = model.kv_bytes_per_token(1, 1, "auto")
        attention = step["by_kind_us"].get("attention", 0.0) / 1e6
        if step["ctx_tokens"] == 0:
            decode.append((float(layers), kv_token * step["gen_sk"], attention))
        else:
            batch = step_batch(step)
            flops = 4.0 * model.num_attention_heads * model.head_dim * layers * batch["prefill_attn_work"]
            mixed.append((layers, kv_token * step["gen_sk"], flops, attention))
        writes.append((kv_token * step["tokens"], step["by_kind_us"].get("kv_write", 0.0) / 1e6))
    if not mixed:
        raise ValueError("no traced step with a prefill chunk: the prefill attention rate needs one")
    per_layer, per_byte = _lsq2(decode)
    prefill_s = sum(a - per_layer * layers - per_byte * read for layers, read, _, a in mixed)
    prefill_flops = sum(f for _, _, f, _ in mixed)
    return {"attn_layer_s": per_layer, "kv_read_efficiency": 1.0 / (per_byte * bw),
            "attn_efficiency": prefill_flops / (gpu.bf16_tflops * 1e12 * prefill_s),
            "kv_write_efficiency": sum(b for b, _ in writes) / (bw * sum(t for _, t in writes))}


def kernel_knobs() -> dict[str, float]:
    """Every knob this module measures, 4 significant figures, and ``mem_efficiency`` as committed
    (the kernels confirm it): what ``sim_fidelity.py --fit N --kernels`` holds fixed."""
    steps = traced_steps()
    knobs: Mapping[str, float] = {**fit_gemm(step_groups=gemm_step_groups(steps)), **fit_attention(steps),
                                  "mem_efficiency": calibration_for(get_gpu(_GPU)).mem_efficiency}
    return {k: float(f"{v:.4g}") for k, v in knobs.items()}
