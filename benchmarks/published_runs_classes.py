"""The simulator's model-class rules on published runs of MoE, quantized and sliding-window models.

The runs are ``tests/fixtures/published_runs/classes.yaml`` and ``nvlink_moe.yaml`` (:data:`CLASS_FILES`) in
:mod:`published_runs`' schema, each file split by its rule (at most half of a GPU's runs fit); each run
is judged by :func:`published_runs.judge`. This
module adds what the classes need: each run's classes read off its model
(:func:`run_classes`), the fitted constants of :mod:`servetune.sim.perf_classes`
(``MOE_COMPUTE_SHARE`` per MoE kernel and GPU architecture, :func:`moe_cell`; ``TRITON_ATTN_EFFICIENCY``
with the cell whose runs serve attention sinks on Triton attention; :func:`fit_moe_share` on the fit
half only), and the held-out table by class, MoE kernel, GPU and layout, before (``class_rules`` 0: every model priced as dense at
its active experts and checkpoint bytes) and after, and what ``--async-scheduling`` alone gained on
each page's baseline / optimized pair, real and simulated (:func:`async_pairs`). The target: the
headline figure (output throughput, closed loop; mean TPOT, open loop) within 15% on 80% of the
held-out runs.

    .venv/bin/python benchmarks/published_runs_classes.py            # the table
    .venv/bin/python benchmarks/published_runs_classes.py --fit-moe  # refit MOE_COMPUTE_SHARE (and the Triton attention rate) on the fit half
    .venv/bin/python benchmarks/published_runs_classes.py --json > benchmarks/results/published_runs_classes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_runs import FIXTURES, Judged, PublishedRun, judge, load_runs, resolve_model  # noqa: E402

from servetune.planner.gpus import get_gpu  # noqa: E402
from servetune.planner.modelinfo import ModelProfile  # noqa: E402
from servetune.planner.vllm_rules import parse_vllm_version  # noqa: E402
from servetune.sim import perf_classes  # noqa: E402

__all__ = ["CLASS_FILE", "CLASS_FILES", "WITHIN", "run_classes", "architecture", "moe_cell", "fit_moe_share", "class_rows", "class_table",
           "async_pairs", "main"]

CLASS_FILE = FIXTURES / "classes.yaml"
#: Every file of class runs the table judges: classes.yaml, and nvlink_moe.yaml (gpt-oss-120b bf16 at
#: TP=4-8 over NVLink, all held out; a file of its own so that classes.yaml's splits stay as they were).
CLASS_FILES = (CLASS_FILE, FIXTURES / "nvlink_moe.yaml")
#: The held-out target's band on the headline figure.
WITHIN = 0.15
#: The shares :func:`fit_moe_share` tries: 0.20 to 1.00 in steps of 0.05.
SHARE_GRID = tuple(round(0.20 + 0.05 * i, 2) for i in range(17))
#: The Triton attention rates :func:`fit_moe_share` tries with a cell whose runs have attention sinks
#: below Hopper: 0.05 to 0.40 of the dense peak in steps of 0.025.
TRITON_ATTN_GRID = tuple(round(0.05 + 0.025 * i, 3) for i in range(15))


def run_classes(model: ModelProfile) -> tuple[str, ...]:
    """The model's classes as the report names them (``dense`` when none applies)."""
    out = []
    if model.is_moe:
        out.append("moe")
    method = (model.quantization or "").lower()
    if model.quantized_experts_only:
        out.append("mxfp4")
    elif "fp8" in method:
        out.append("fp8")
    elif method and model.weight_bytes_per_param >= 1.0:
        out.append("w8a8")
    elif method:
        out.append("w4a16")
    if model.layer_types:
        out.append("sliding_window")
    if model.mla_kv_lora_rank:
        out.append("mla")
    return tuple(out) or ("dense",)


def architecture(gpu_name: str) -> str:
    """``hopper`` or ``ampere``: the key of ``perf_classes.MOE_COMPUTE_SHARE`` a GPU takes (compute capability
    9.0 and up: Hopper's, the B200's included, as ``perf_classes.moe_compute_share`` takes it; a B200 run whose
    experts are priced by the sourced Blackwell share instead is told by :func:`moe_cell`)."""
    return "hopper" if get_gpu(gpu_name).compute_capability >= 9.0 else "ampere"


def _loss(judged: Sequence[Judged]) -> float:
    errs = [abs(j.headline_error) for j in judged if j.headline_error is not None]
    return sum(errs) / len(errs) if errs else float("inf")


def moe_cell(run: PublishedRun) -> str:
    """``kernel/architecture``: the :data:`perf_classes.MOE_COMPUTE_SHARE` entry a MoE run's experts take, or
    ``triton/blackwell`` where ``perf_classes.runs_blackwell_triton_moe`` holds (16-bit experts on Triton on a
    compute capability 10.x part below vLLM 0.20): those take the sourced ``BLACKWELL_TRITON_MOE_SHARE``, no
    fitted cell (the five gpt-oss-120b bf16 B200 runs of nvlink_moe.yaml were labelled ``triton/hopper`` before
    2026-12-06, a share they are not priced by).

    Example:
        >>> b200 = next(r for r in load_runs([FIXTURES / "nvlink_moe.yaml"]) if r.gpu == "B200")
        >>> moe_cell(b200)
        'triton/blackwell'
    """
    model, gpu = resolve_model(run.model, FIXTURES), get_gpu(run.gpu)
    kernel = perf_classes.moe_kernel(model, gpu)
    shape = perf_classes.moe_shape(model, gpu, run.layout["tp"], model.num_layers)
    version = parse_vllm_version(run.sim_vllm_version)
    if shape is not None and perf_classes.runs_blackwell_triton_moe(gpu, shape, version):
        return f"{kernel}/blackwell"
    return f"{kernel}/{architecture(run.gpu)}"


def _sinks_on_triton(run: PublishedRun) -> bool:
    return perf_classes.runs_triton_attention(resolve_model(run.model, FIXTURES), get_gpu(run.gpu))


def fit_moe_share(runs: Sequence[PublishedRun], grid: Sequence[float] = SHARE_GRID,
                  attn_grid: Sequence[float] = TRITON_ATTN_GRID) -> dict[str, dict[str, Any]]:
    """Per MoE kernel and architecture (:func:`moe_cell`), the share of ``grid`` with the least mean
    |headline error| on the *fit* runs of MoE models (held-out runs are never read), and that loss.
    A cell whose runs serve attention sinks on ``TRITON_ATTN`` fits
    ``perf_classes.TRITON_ATTN_EFFICIENCY`` with it, over ``attn_grid`` (the long prompts set one,
    the short ones the other)."""
    out: dict[str, dict[str, Any]] = {}
    fit = [r for r in runs if r.split == "fit" and resolve_model(r.model, FIXTURES).is_moe]
    for cell in sorted({moe_cell(r) for r in fit}):
        mine = [r for r in fit if moe_cell(r) == cell]
        attn = attn_grid if any(_sinks_on_triton(r) for r in mine) else (0.0,)
        losses = {(share, eff): _loss([judge(r, {"moe_compute_share": share, "triton_attn_efficiency": eff})
                                       for r in mine]) for share in grid for eff in attn}
        best = min(losses, key=lambda key: losses[key])
        out[cell] = {"share": best[0], "loss": round(losses[best], 4), "runs": [r.id for r in mine],
                     "losses": {f"{s:.2f}": round(min(v for (s2, _), v in losses.items() if s2 == s), 4) for s in grid}}
        if best[1]:
            out[cell]["triton_attn_efficiency"] = best[1]
    return out


def class_rows(runs: Sequence[PublishedRun]) -> list[dict[str, Any]]:
    """Every run judged with the class rules (after) and without them (before)."""
    rows = []
    for r in runs:
        after, before = judge(r), judge(r, {"class_rules": 0.0})
        name, real = r.headline
        rows.append({"id": r.id, "split": r.split, "gpu": r.gpu, "layout": r.layout_label, "shape": r.shape,
                     "classes": list(run_classes(resolve_model(r.model, FIXTURES))),
                     "moe_cell": moe_cell(r) if resolve_model(r.model, FIXTURES).is_moe else None,
                     "headline": name, "real": real,
                     "error_before_pct": _pct(before.headline_error), "error_after_pct": _pct(after.headline_error),
                     "ttft_error_after_pct": _pct(after.ttft_error), "failure": after.failure})
    return rows


def _pct(error: float | None) -> float | None:
    return None if error is None else round(100 * error, 1)


def _cell(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    judged = [r for r in rows if r["error_after_pct"] is not None]
    before = [abs(r["error_before_pct"]) for r in rows if r["error_before_pct"] is not None]
    after = [abs(r["error_after_pct"]) for r in judged]
    return {"runs": len(rows), "judged": len(judged),
            "within_15_before": sum(e <= 100 * WITHIN for e in before),
            "within_15_after": sum(e <= 100 * WITHIN for e in after),
            "median_abs_before_pct": round(statistics.median(before), 1) if before else None,
            "median_abs_after_pct": round(statistics.median(after), 1) if after else None}


def class_table(rows: Sequence[dict[str, Any]], split: str = "held_out") -> dict[str, dict[str, Any]]:
    """``split``'s rows by class, by GPU and by layout, then all together."""
    mine = [r for r in rows if r["split"] == split]
    out: dict[str, dict[str, Any]] = {}
    for cls in sorted({c for r in mine for c in r["classes"]}):
        out[f"class {cls}"] = _cell([r for r in mine if cls in r["classes"]])
    for cell in sorted({r["moe_cell"] for r in mine if r.get("moe_cell")}):
        out[f"moe {cell}"] = _cell([r for r in mine if r.get("moe_cell") == cell])
    for gpu in sorted({r["gpu"] for r in mine}):
        out[f"gpu {gpu}"] = _cell([r for r in mine if r["gpu"] == gpu])
    for layout in sorted({r["layout"] for r in mine}):
        out[f"layout {layout}"] = _cell([r for r in mine if r["layout"] == layout])
    out["all"] = _cell(mine)
    return out


def _same_but_async(base: PublishedRun, opt: PublishedRun) -> bool:
    """Whether ``opt`` is ``base`` with ``--async-scheduling`` added and nothing else changed (but
    the mean output length, which each run states as it measured it: no ``--ignore-eos``)."""
    def rest(run: PublishedRun) -> tuple[dict[str, Any], dict[str, Any]]:
        return ({k: v for k, v in run.flags.items() if k != "async_scheduling"},
                {k: v for k, v in run.workload.items() if k != "output_len"})
    return (bool(opt.flags.get("async_scheduling")) and not base.flags.get("async_scheduling")
            and rest(opt) == rest(base)
            and (opt.model, opt.gpu, opt.sim_vllm_version, dict(opt.layout))
            == (base.model, base.gpu, base.sim_vllm_version, dict(base.layout)))


def async_pairs(runs: Sequence[PublishedRun], rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What ``--async-scheduling`` alone gained on the headline, real and simulated: each page's
    baseline run ``ID`` and its optimized ``ID-opt`` whose flags differ by that flag only (the
    simulated gain from :func:`class_rows`' committed errors, to 0.1 point).

    Example:
        >>> runs = [r for r in load_runs([CLASS_FILE]) if "gpt-oss-20b-tp1-rand32000" in r.id and r.gpu == "H100-80GB"]
        >>> [(p["opt"], p["real_gain_pct"]) for p in async_pairs(runs, class_rows(runs))]
        [('h100-gpt-oss-20b-tp1-rand32000x100-burst100-opt', 0.5)]
    """
    by_id = {r.id: r for r in runs}
    err = {row["id"]: row["error_after_pct"] for row in rows}
    out = []
    for opt in runs:
        base = by_id.get(opt.id.removesuffix("-opt")) if opt.id.endswith("-opt") else None
        if base is None or not _same_but_async(base, opt):
            continue
        real = opt.headline[1] / base.headline[1]
        e_base, e_opt = err.get(base.id), err.get(opt.id)
        sim = None if e_base is None or e_opt is None else real * (1 + e_opt / 100) / (1 + e_base / 100)
        out.append({"base": base.id, "opt": opt.id, "split": opt.split, "headline": opt.headline[0],
                    "real_gain_pct": round(100 * (real - 1), 1),
                    "sim_gain_pct": None if sim is None else round(100 * (sim - 1), 1)})
    return out


def _format(table: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'cell':<26}{'runs':>5}{'judged':>7}{'<=15% before':>14}{'<=15% after':>13}{'median before':>15}"
             f"{'median after':>14}"]
    for key, c in table.items():
        med_b = "-" if c["median_abs_before_pct"] is None else f"{c['median_abs_before_pct']:.1f}%"
        med_a = "-" if c["median_abs_after_pct"] is None else f"{c['median_abs_after_pct']:.1f}%"
        lines.append(f"{key:<26}{c['runs']:>5}{c['judged']:>7}{c['within_15_before']:>14}{c['within_15_after']:>13}"
                     f"{med_b:>15}{med_a:>14}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit-moe", action="store_true",
                    help="refit MOE_COMPUTE_SHARE per kernel and architecture (and TRITON_ATTN_EFFICIENCY) on the fit half")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    runs = load_runs(CLASS_FILES)
    if args.fit_moe:
        fitted = fit_moe_share(runs)
        print(json.dumps({"fitted": fitted, "committed": perf_classes.MOE_COMPUTE_SHARE,
                          "committed_triton_attn_efficiency": perf_classes.TRITON_ATTN_EFFICIENCY}, indent=1))
        return 0
    rows = class_rows(runs)
    held, fit = class_table(rows, "held_out"), class_table(rows, "fit")
    report: dict[str, Any] = {"target": f"headline within {WITHIN:.0%} on 80% of held-out runs",
              "moe_compute_share": perf_classes.MOE_COMPUTE_SHARE,
              "triton_attn_efficiency": perf_classes.TRITON_ATTN_EFFICIENCY,
              "held_out": held, "fit": fit, "runs": rows, "async_pairs": async_pairs(runs, rows)}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print("HELD OUT (the evidence): headline error, before = class_rules 0, after = committed")
    print(_format(held))
    print("\nFIT (fitting data, not evidence)")
    print(_format(fit))
    for row in rows:
        print(f"{row['split']:<9}{row['id']:<62}{row['error_before_pct']!s:>8}{row['error_after_pct']!s:>8}"
              f"  {row['failure'] or ''}"[:160])
    print("\n--async-scheduling alone (baseline -> optimized, same page): headline gain, real and simulated")
    for pair in report["async_pairs"]:
        print(f"{pair['split']:<9}{pair['opt']:<62}{pair['real_gain_pct']:>+7.1f}%"
              f"{'-' if pair['sim_gain_pct'] is None else format(pair['sim_gain_pct'], '+.1f') + '%':>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
