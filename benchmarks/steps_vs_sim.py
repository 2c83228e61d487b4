"""Real vLLM engine steps, kernel by kind, against the simulator's step-time model.

Each profiled window under ``tests/fixtures/real_h200/scale`` (dense 8B-24B on H200 hosts) and
``tests/fixtures/real_h100_classes`` (MoE shapes on an H100 SXM, ``--classes``) (``collect.py`` with
``profile_after_s``; ``summary.json`` says ``"profiled": true``) keeps the 40 engine steps of vLLM's
worker trace, reduced to ``steps.json.gz`` (``trace_steps.py --window``): each step's batch (context
and generation tokens, the KV they attend to) and its GPU kernels. :func:`compare` prices the same
batch with ``PerfModel.gpu_cost`` and returns both, kind by kind: GEMMs, attention, KV-cache writes
and the element-wise rest (Inductor's fused kernels, the sampler, copies). The GPU's busy time of the
step is set against the simulated GPU time. For an MoE model the routed experts' kernels
(:data:`EXPERT_KERNELS`, what vLLM's ``fused_experts`` launches) are set apart against ``PerfModel.moe_seconds`` plus
``moe_activation_seconds``, the layer ``benchmarks/moe_vs_sim.py --layer`` holds against the kernel probe.
The CPU gaps between steps are not compared: the profiler slows the CPU side.

    PYTHONPATH=platform:benchmarks .venv/bin/python benchmarks/steps_vs_sim.py [--classes] [--knob NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path

from _fidelity import FIXTURES, HOST_MODELS, serving_flags
from real_vllm.trace_steps import STEPS, TRACE, window_steps

from servetune.errors import SpecError
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.sim import PerfModel, StepCost, calibration_for

__all__ = ["EXPERT_KERNELS", "KINDS", "StepRow", "class_windows", "compare", "expert_seconds", "profiled_windows",
           "step_batch", "window_gpu"]

#: The simulator's kinds, and the trace's kernel kinds each is held against.
KINDS: dict[str, tuple[str, ...]] = {"gemm": ("gemm",), "attention": ("attention",), "kv_write": ("kv_write",),
                                     "elementwise": ("triton", "other", "copy")}


#: The kernels of vLLM's ``fused_experts`` (0.26.0, Triton path) that ``moe_seconds`` prices: both grouped GEMMs,
#: the routed rows' alignment to the tile and the top-k sum. The gated activation between the GEMMs
#: (``act_and_mul_kernel``) stays with the element-wise kind, where the step prices it (SiLU-and-mul of the active
#: experts' width).
EXPERT_KERNELS = re.compile(r"fused_moe_kernel|moe_align_block_size|moe_sum")
#: The collections whose windows were profiled, by folder, and the GPU each ran on.
COLLECTION_GPUS: dict[str, str] = {"real_h200": "H200", "real_h100_classes": "H100-80GB"}
CLASSES = FIXTURES.parent / "real_h100_classes"


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One real engine step and the simulator's price of the same batch (seconds)."""

    window: str
    mixed: bool  # a prefill chunk in the batch (else decode only)
    tokens: int
    real: dict[str, float]  # by KINDS, plus "busy": the union of the step's kernel intervals
    sim: StepCost
    experts: tuple[float, float] = (0.0, 0.0)  # the routed experts' kernels: real, simulated (0, 0: dense)


def step_batch(step: Mapping[str, int]) -> dict[str, int | bool]:
    """``PerfModel.gpu_cost``'s arguments for one traced step (trace_steps' detailed annotation).

    vLLM's ``sqsk`` sums query x (computed + query) tokens per prefill chunk; the simulator's
    prefill attention work is causal, query x computed + query (query + 1) / 2, so it is
    ``sqsk - (sqsq - query) / 2``. A decode request attends to its whole sequence (``sk``).
    """
    prefill_work = step["ctx_sqsk"] - (step["ctx_sqsq"] - step["ctx_tokens"]) // 2
    return {"num_reqs": step["ctx_reqs"] + step["gen_reqs"], "num_tokens": step["tokens"],
            "kv_context": step["ctx_sk"] + step["gen_sk"], "attn_work": prefill_work + step["gen_sqsk"],
            "decode_only": step["ctx_tokens"] == 0, "prefill_tokens": step["ctx_tokens"],
            "prefill_context": step["ctx_sk"], "prefill_attn_work": prefill_work}


def profiled_windows(fixtures: Path = FIXTURES) -> list[Path]:
    """Every window folder whose engine steps were kept (reduced, or a raw trace), sorted."""
    return sorted({p.parent for name in (STEPS, TRACE) for p in fixtures.glob(f"scale/*/*/{name}")})


def class_windows(fixtures: Path = CLASSES) -> list[Path]:
    """Every profiled window of the model-class starts (``real_h100_classes/<start>/<window>``), sorted."""
    return sorted({p.parent for name in (STEPS, TRACE) for p in fixtures.glob(f"*/*/{name}")})


def window_gpu(window: Path) -> str:
    """The GPU a profiled window ran on: its collection's (:data:`COLLECTION_GPUS`)."""
    for folder in window.parents:
        if folder.name in COLLECTION_GPUS:
            return COLLECTION_GPUS[folder.name]
    raise ValueError(f"{window}: not under a collection of {sorted(COLLECTION_GPUS)}")


def expert_seconds(step: Mapping, names: list[str]) -> float:
    """Seconds of one traced step's routed-expert kernels (:data:`EXPERT_KERNELS`)."""
    return sum(k[2] for k in step["kernels"] if EXPERT_KERNELS.search(names[k[0]])) / 1e6


def compare(window: Path, knobs: Mapping[str, float] | None = None) -> list[StepRow]:
    """Each traced step of ``window`` with the simulator's price of its batch under ``knobs``
    (the committed calibration's otherwise), on the GPU the window ran on (:func:`window_gpu`)."""
    summary = json.loads((window / "summary.json").read_text())
    model, gpu = load_model(HOST_MODELS[summary["model"]]), get_gpu(window_gpu(window))
    config = resolve_engine_config(serving_flags(summary["flags"]), model, gpu)
    perf = PerfModel(model, gpu, config, calibration_for(gpu).with_overrides(knobs or {}))
    trace = window_steps(window)
    name = f"{window.parent.name}/{window.name}"
    rows = []
    for step in trace["steps"]:
        if "gpu_busy_us" not in step:
            continue
        by_kind = step["by_kind_us"]
        real = {kind: sum(by_kind.get(k, 0.0) for k in traced) / 1e6 for kind, traced in KINDS.items()}
        real["busy"] = step["gpu_busy_us"] / 1e6
        experts = (0.0, 0.0)
        if perf.moe_shape is not None:
            experts = (expert_seconds(step, trace["names"]),
                       perf.moe_seconds(step["tokens"]) + perf.moe_activation_seconds(step["tokens"]))
        rows.append(StepRow(name, step["ctx_tokens"] > 0, step["tokens"], real, perf.gpu_cost(**step_batch(step)),
                            experts))
    return rows


def _kind_seconds(row: StepRow, kind: str) -> tuple[float, float]:
    """Real and simulated seconds of one kind in ``row``, the routed experts set apart: the trace counts their
    kernels as element-wise (not cuBLAS), the simulator in its GEMMs."""
    real, sim = row.real[kind], getattr(row.sim, kind)
    if kind == "elementwise":
        real -= row.experts[0]
    elif kind == "gemm":
        sim -= row.experts[1]
    return real, sim


def table(rows: list[StepRow]) -> str:
    """Median real and simulated milliseconds per kind, by window and step class; an MoE window's routed
    experts (real / simulated) beside them."""
    groups: dict[tuple[str, bool], list[StepRow]] = {}
    for r in rows:
        groups.setdefault((r.window, r.mixed), []).append(r)
    moe = any(r.experts[1] for r in rows)
    lines = ["| window | steps | tokens | " + " | ".join(f"{k} real / sim ms" for k in KINDS)
             + (" | experts real / sim ms" if moe else "") + " | busy / sim GPU ms |",
             "|---|---|---|" + "---|" * (len(KINDS) + 1 + moe)]
    for (window, mixed), group in groups.items():
        cells = []
        for kind in KINDS:
            real = statistics.median(_kind_seconds(r, kind)[0] for r in group) * 1e3
            sim = statistics.median(_kind_seconds(r, kind)[1] for r in group) * 1e3
            cells.append(f"{real:.2f} / {sim:.2f}")
        if moe:
            cells.append(" / ".join(f"{statistics.median(r.experts[i] for r in group) * 1e3:.2f}" for i in (0, 1)))
        busy = statistics.median(r.real["busy"] for r in group) * 1e3
        sim_gpu = statistics.median(r.sim.seconds for r in group) * 1e3
        tokens = statistics.median(r.tokens for r in group)
        lines.append(f"| {window} ({'mixed' if mixed else 'decode'}) | {len(group)} | {tokens:.0f} | "
                     + " | ".join(cells) + f" | {busy:.2f} / {sim_gpu:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", action="store_true",
                        help="the model-class starts' windows (MoE on an H100) instead of the H200 dense ones")
    parser.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                        help="a simulator knob over the committed calibration (repeatable)")
    args = parser.parse_args(argv)
    knobs = {}
    for item in args.knob:
        name, _, value = item.partition("=")
        try:
            knobs[name] = float(value)
        except ValueError:
            print(f"--knob {item}: expected NAME=NUMBER", file=sys.stderr)
            return 2
    try:
        windows = class_windows() if args.classes else profiled_windows()
        rows = [row for window in windows for row in compare(window, knobs)]
    except SpecError as exc:
        print(f"--knob: {exc}", file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
