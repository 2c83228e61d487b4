"""Simulator fidelity against real vLLM 0.26.0 on one H200 (private: the benchmark and a test use it).

For each healthy run in ``tests/fixtures/real_h200/`` (flags, workload and measured figures in
``summary.json``; preemptions from ``vllm:num_preemptions_total`` in ``metrics_after.txt`` minus
``metrics_before.txt``), resolve the same flags for ``servetune-test-850m`` on the H200, simulate
the same workload, and compare output tok/s, mean TTFT, mean TPOT and preemptions. :func:`fit`
searches the H200 calibration knobs (a handful of constants shared by every run, never per-run
fudge); the result goes into :data:`servetune.sim.perf.GPU_CALIBRATION`.

Example:
    >>> rows = fidelity_rows()                       # doctest: +SKIP
    >>> error_summary(rows)["throughput_mae"] < 0.1   # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servetune.planner.gpus import GpuSpec, get_gpu
from servetune.engines.vllm.metrics import counter, parse_prometheus
from servetune.planner.modelinfo import load_model
from servetune.sim.perf import calibration_for
from servetune.workload import Workload

__all__ = ["FIXTURES", "FIT_SPACE", "RealRun", "FidelityRow", "load_real_runs", "fidelity_rows", "error_summary",
           "format_table", "fit"]

#: The real-run evidence, in the repository's tests (not shipped with the package).
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "real_h200"
MODEL = "servetune-test-850m"
GPU = "H200"


@dataclasses.dataclass(frozen=True)
class RealRun:
    name: str
    flags: dict[str, Any]
    workload: Workload
    output_throughput: float
    ttft_mean_ms: float
    tpot_mean_ms: float
    preemptions: int


@dataclasses.dataclass(frozen=True)
class FidelityRow:
    name: str
    real: RealRun
    sim_output_throughput: float
    sim_ttft_mean_ms: float
    sim_tpot_mean_ms: float
    sim_preemptions: int

    @property
    def throughput_error(self) -> float:
        return self.sim_output_throughput / self.real.output_throughput - 1.0

    @property
    def ttft_error(self) -> float:
        return self.sim_ttft_mean_ms / self.real.ttft_mean_ms - 1.0

    @property
    def tpot_error(self) -> float:
        return self.sim_tpot_mean_ms / self.real.tpot_mean_ms - 1.0


def _preemptions(run_dir: Path) -> int:
    def read(name: str) -> float:
        path = run_dir / name
        # Later runs keep their /metrics dumps gzipped (d1_loadgen_vs_bench).
        text = path.read_text() if path.exists() else gzip.decompress((run_dir / f"{name}.gz").read_bytes()).decode()
        return counter(parse_prometheus(text), "vllm:num_preemptions_total") or 0.0

    return int(round(read("metrics_after.txt") - read("metrics_before.txt")))


def load_real_runs(fixtures: Path = FIXTURES) -> list[RealRun]:
    """The healthy runs (a server that started and served the workload), sorted by name."""
    runs = []
    for summary_path in sorted(fixtures.glob("*/summary.json")):
        s = json.loads(summary_path.read_text())
        if not s.get("healthy") or s.get("output_throughput") is None:
            continue
        runs.append(RealRun(
            name=s["name"], flags=dict(s["flags"]), workload=Workload.from_dict(s["workload"]),
            output_throughput=float(s["output_throughput"]), ttft_mean_ms=float(s["ttft_ms"]["mean"]),
            tpot_mean_ms=float(s["tpot_ms"]["mean"]), preemptions=_preemptions(summary_path.parent)))
    return runs


def _gpu_with(calibration: Mapping[str, float] | None) -> GpuSpec:
    gpu = get_gpu(GPU)
    if calibration is None:
        return gpu
    knobs = dataclasses.asdict(calibration_for(gpu).with_overrides(calibration))
    return dataclasses.replace(gpu, calibration=knobs)


def fidelity_rows(calibration: Mapping[str, float] | None = None,
                  runs: list[RealRun] | None = None) -> list[FidelityRow]:
    """Simulate every real run; ``calibration`` overrides the H200 knobs (for fitting)."""
    from servetune.planner.memory import plan_memory, resolve_engine_config
    from servetune.sim.engine import simulate

    model = load_model(MODEL)
    gpu = _gpu_with(calibration)
    rows = []
    for run in runs if runs is not None else load_real_runs():
        config = resolve_engine_config(run.flags, model, gpu)
        result = simulate(model, gpu, config, run.workload, plan=plan_memory(model, gpu, config))
        rows.append(FidelityRow(
            run.name, run, result.output_throughput or 0.0,
            result.ttft_ms.mean if result.ttft_ms else math.nan,
            result.tpot_ms.mean if result.tpot_ms else math.nan, result.preemptions or 0))
    return rows


def error_summary(rows: list[FidelityRow]) -> dict[str, float]:
    """Mean absolute relative errors, and whether preempting runs were predicted as preempting."""
    n = len(rows)
    return {
        "throughput_mae": sum(abs(r.throughput_error) for r in rows) / n,
        "throughput_max": max(abs(r.throughput_error) for r in rows),
        "ttft_mae": sum(abs(r.ttft_error) for r in rows) / n,
        "tpot_mae": sum(abs(r.tpot_error) for r in rows) / n,
        "preemption_class_agree": float(sum((r.real.preemptions > 0) == (r.sim_preemptions > 0) for r in rows)) / n,
    }


def format_table(rows: list[FidelityRow]) -> str:
    head = (f"{'run':<28} {'out tok/s real':>14} {'sim':>8} {'err':>6}  {'TTFT ms real':>12} {'sim':>7} {'err':>6}"
            f"  {'TPOT ms real':>12} {'sim':>6} {'err':>6}  {'preempt real':>12} {'sim':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.name:<28} {r.real.output_throughput:>14,.0f} {r.sim_output_throughput:>8,.0f} "
            f"{100 * r.throughput_error:>+5.1f}%  {r.real.ttft_mean_ms:>12,.1f} {r.sim_ttft_mean_ms:>7,.1f} "
            f"{100 * r.ttft_error:>+5.1f}%  {r.real.tpot_mean_ms:>12.2f} {r.sim_tpot_mean_ms:>6.2f} "
            f"{100 * r.tpot_error:>+5.1f}%  {r.real.preemptions:>12} {r.sim_preemptions:>5}")
    e = error_summary(rows)
    lines.append(f"mean |error|: output throughput {100 * e['throughput_mae']:.1f}% (max "
                 f"{100 * e['throughput_max']:.1f}%), TTFT {100 * e['ttft_mae']:.1f}%, "
                 f"TPOT {100 * e['tpot_mae']:.1f}%; "
                 f"preempting-or-not agrees on {e['preemption_class_agree'] * len(rows):.0f}/{len(rows)} runs")
    return "\n".join(lines)


#: The knobs --fit searches, with their ranges (log-uniform for the positive time constants).
FIT_SPACE: dict[str, tuple[float, float]] = {
    "mem_efficiency": (0.5, 0.95),
    "kv_read_efficiency": (0.1, 1.0),
    "compute_efficiency": (0.3, 0.8),
    "step_overhead_s": (0.3e-3, 3e-3),
    "seq_overhead_s": (1e-6, 40e-6),
    "token_overhead_s": (10e-6, 80e-6),
    "request_overhead_s": (0.2e-3, 10e-3),
    "eager_layer_overhead_s": (100e-6, 1000e-6),
    "compiled_layer_overhead_s": (20e-6, 700e-6),
}


def _loss(rows: list[FidelityRow]) -> float:
    # Throughput matters most (the tuning objective); latencies keep the shape honest.
    t = sum(math.log(1 + abs(r.throughput_error)) ** 2 for r in rows)
    f = sum(math.log(r.sim_ttft_mean_ms / r.real.ttft_mean_ms) ** 2 for r in rows)
    p = sum(math.log(r.sim_tpot_mean_ms / r.real.tpot_mean_ms) ** 2 for r in rows)
    return 4 * t + 0.5 * f + p


def fit(trials: int, seed: int = 0, runs: list[RealRun] | None = None,
        starts: list[Mapping[str, float]] | None = None) -> dict[str, float]:
    """Optuna TPE over FIT_SPACE minimising the loss over all runs; returns the best knobs."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    runs = runs if runs is not None else load_real_runs()

    def objective(trial: optuna.Trial) -> float:
        knobs = {k: trial.suggest_float(k, lo, hi, log=lo > 0 and k.endswith("_s"))
                 for k, (lo, hi) in FIT_SPACE.items()}
        return _loss(fidelity_rows(knobs, runs))

    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed))
    for start in (dataclasses.asdict(calibration_for(get_gpu(GPU))), *(starts or ())):
        study.enqueue_trial({k: min(max(float(start[k]), lo), hi) for k, (lo, hi) in FIT_SPACE.items() if k in start})
    study.optimize(objective, n_trials=trials)
    return dict(study.best_params)


