"""Nightly tuning: a matrix of models x GPU types x workloads, one study per cell and night.

The contract:

- A matrix file (``jobs/nightly.yaml``) holds a spec ``template`` (any study-spec section but
  ``name``), the axes ``models``, ``gpus`` and ``workloads`` (a name -> workload mapping), and
  optional per-cell ``overrides`` (cell name -> spec sections, deep-merged last). Each cell becomes
  one study spec named ``<cell>-<YYYYMMDD>``; cell names are ``<model>.<gpu>.<workload>``.
- Warm start: the best feasible flags found on earlier nights for the cell (read from the Parquet
  dataset) are enqueued as the night's first trial, so a night starts where the last one ended.
- Noise: tonight's best configuration is measured again ``noise.repeats`` times with other seeds;
  the spread (sample stdev) of those measurements, or of earlier nights' bests where larger, is
  the measurement noise. A regression is tonight's best below the previous night's best by more
  than ``max(noise.sigmas x noise, noise.min_relative x previous)`` (throughputs; the sign flips
  for latency objectives).
- Cost: each cell's cheapest feasible trial in dollars per million good output tokens (its GPU
  type's list price, :mod:`servetune.cost`); the report ranks the GPU types of each model and
  workload by it.
- Judged GPUs only: a cell simulated on a GPU type whose simulator calibration no real vLLM run has
  judged, or the published runs held out on it judged below the target (fewer than 80% within 10%:
  :func:`~servetune.planner.gpus.calibration_note`), still runs
  (its regressions still count), but the report says so beside it and leaves it out of the cost
  ranking across GPU types: comparing such a type's simulated cost with a judged one's would rest on
  the H200's constants at another GPU's datasheet rates. Cells measured on real GPUs (backend
  ``vllm``) are judged by being real.
- Outputs: ``<output.dir>/nightly_history.parquet`` (one row per cell and night), and beside it
  ``reports/<YYYYMMDD>/report.md`` with a table, the GPU types by cost, and one plot per cell; both the report and the
  plots are logged to MLflow as artifacts of a run named ``nightly-<YYYYMMDD>``
  (tag ``servetune.role=nightly``). The history, the report and the run are written through the
  study's recorder (:func:`servetune.study.record_night`), which redacts them once, as it does a
  study's trials (the cells' studies are recorded by :func:`~servetune.study.run_study` itself).
  :func:`run_nightly` returns the cells' verdicts; the job exits 1 when any cell regressed.

Pure pieces (no I/O): :func:`expand_matrix`, :func:`deep_merge`, :func:`noise_of`, :func:`compare`,
:func:`scaled_calibration`, :func:`calibration_warning`, :func:`rank_by_cost`, :func:`render_report`.
The rest does I/O.

Example:
    >>> from servetune.nightly import compare
    >>> compare(700.0, [1000.0], noise=5.0, direction="maximize").regressed
    True
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import io
import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import optuna
import pandas as pd
import yaml
from matplotlib.figure import Figure

from servetune.backends import capabilities
from servetune.cluster.pool import TrialPool
from servetune.errors import SpecError, did_you_mean
from servetune.planner import gpus
from servetune.planner.modelinfo import ModelProfile
from servetune.records import dataset
from servetune.records import open_storage, retry_call
from servetune.search.warmstart import warm_start_flags
from servetune.sim import calibration_for
from servetune.spec.schema import StudySpec, sqlite_url
from servetune.spec.space import read_yaml
from servetune.study import NightRecords, record_night, remeasure, run_study

__all__ = ["Cell", "NoiseSettings", "Verdict", "CellNight", "NightlyOutcome", "load_matrix", "expand_matrix",
           "deep_merge", "noise_of", "compare", "scaled_calibration", "render_report", "rank_by_cost",
           "run_nightly", "output_root", "nightly_stores", "today", "MATRIX_KEYS"]

MATRIX_KEYS = ("name", "template", "models", "gpus", "workloads", "overrides", "noise", "output", "tracking")
_DATE_RE = re.compile(r"^\d{8}$")
_EFFICIENCY_KNOBS = ("mem_efficiency", "kv_read_efficiency", "compute_efficiency", "interconnect_efficiency")
_TIME_KNOBS = ("step_overhead_s", "seq_overhead_s", "request_overhead_s", "token_overhead_s", "graph_launch_s",
               "compiled_layer_overhead_s", "eager_layer_overhead_s", "allreduce_latency_s")


# -- the matrix (pure) --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NoiseSettings:
    repeats: int = 3  # re-measurements of tonight's best, with other seeds
    sigmas: float = 3.0  # a regression is a drop beyond this many noise stdevs...
    min_relative: float = 0.03  # ...and beyond this share of the previous best (a floor for zero noise)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One model x GPU type x workload: its name and its full study spec data (without the date)."""

    name: str
    model: str
    gpu_type: str
    workload: str
    spec_data: Mapping[str, Any]

    def study_name(self, date: str) -> str:
        return f"{self.name}-{date}"


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, mappings merged key by key (lists and scalars replaced).

    Example:
        >>> deep_merge({"budget": {"trials": 4, "parallel": 1}}, {"budget": {"trials": 8}})
        {'budget': {'trials': 8, 'parallel': 1}}
    """
    out = copy.deepcopy(dict(base))
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")


def expand_matrix(matrix: Mapping[str, Any]) -> list[Cell]:
    """Every cell of the matrix with its spec data (template, axes, then the cell's overrides).

    Example:
        >>> cells = expand_matrix({"template": {"budget": {"trials": 4}}, "models": ["m"],
        ...     "gpus": [{"type": "H200"}, "L4"], "workloads": {"chat": {"input_len": 10}},
        ...     "overrides": {"m.L4.chat": {"budget": {"trials": 2}}}})
        >>> [(c.name, c.spec_data["gpu"], c.spec_data["budget"]) for c in cells]
        [('m.H200.chat', {'type': 'H200'}, {'trials': 4}), ('m.L4.chat', {'type': 'L4'}, {'trials': 2})]
    """
    if not isinstance(matrix, Mapping):
        raise SpecError("matrix", f"expected a mapping, got {type(matrix).__name__}", "start from jobs/nightly.yaml")
    for key in matrix:
        if key not in MATRIX_KEYS:
            raise SpecError(str(key), f"unknown key{did_you_mean(str(key), MATRIX_KEYS)}",
                            f"allowed keys: {', '.join(MATRIX_KEYS)}")
    template = matrix.get("template") or {}
    if not isinstance(template, Mapping) or "name" in template:
        raise SpecError("template", "expected a spec mapping without name", "the cell names its studies itself")
    models, gpu_list, workloads = matrix.get("models"), matrix.get("gpus"), matrix.get("workloads")
    if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
        raise SpecError("models", f"expected a non-empty list of model names, got {models!r}", "models: [llama-3.1-8b]")
    if not isinstance(gpu_list, list) or not gpu_list:
        raise SpecError("gpus", f"expected a non-empty list, got {gpu_list!r}", "gpus: [{type: H200, count: 1}]")
    if not isinstance(workloads, Mapping) or not workloads:
        raise SpecError("workloads", f"expected a mapping of names to workloads, got {workloads!r}",
                        "workloads: {chat: {input_len: 512, output_len: 256, num_requests: 200, concurrency: 64}}")
    gpus_norm: list[dict[str, Any]] = []
    for i, g in enumerate(gpu_list):
        entry = {"type": g} if isinstance(g, str) else g
        if not isinstance(entry, Mapping) or not isinstance(entry.get("type"), str):
            raise SpecError(f"gpus[{i}]", f"expected a GPU type or {{type: ..., count: ...}}, got {g!r}",
                            "gpus: [H200, {type: A100-40GB, count: 2}]")
        gpus_norm.append(dict(entry))
    overrides = matrix.get("overrides") or {}
    cells: list[Cell] = []
    for model in models:
        for gpu in gpus_norm:
            for wname, workload in workloads.items():
                name = f"{_slug(model)}.{_slug(gpu['type'])}.{_slug(str(wname))}"
                data = deep_merge(template, {"model": model, "gpu": gpu, "workload": workload})
                data = deep_merge(data, overrides.get(name) or {})
                cells.append(Cell(name, model, gpu["type"], str(wname), data))
    unknown = set(overrides) - {c.name for c in cells}
    if unknown:
        bad = sorted(unknown)[0]
        raise SpecError(f"overrides.{bad}", f"no such cell{did_you_mean(bad, [c.name for c in cells])}",
                        "cell names are <model>.<gpu type>.<workload>")
    return cells


def _noise_settings(raw: Any) -> NoiseSettings:
    if raw is None:
        return NoiseSettings()
    if not isinstance(raw, Mapping):
        raise SpecError("noise", f"expected a mapping, got {raw!r}", "noise: {repeats: 3, sigmas: 3, min_relative: 0.03}")
    try:
        settings = NoiseSettings(**{k: raw[k] for k in raw})
    except TypeError:
        bad = sorted(set(raw) - {f.name for f in dataclasses.fields(NoiseSettings)})[0]
        raise SpecError(f"noise.{bad}", "unknown key", "use repeats, sigmas, min_relative") from None
    if not isinstance(settings.repeats, int) or settings.repeats < 2:
        raise SpecError("noise.repeats", f"must be an integer >= 2, got {settings.repeats!r}", "noise: {repeats: 3}")
    return settings


# -- comparison (pure) --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Verdict:
    regressed: bool
    baseline: float | None  # the previous night's best (None: the first night)
    change: float | None  # relative change against the baseline, in the objective's good direction
    threshold: float  # the largest tolerated drop, in objective units
    reason: str


def noise_of(samples: Sequence[float]) -> float:
    """The sample standard deviation of repeated measurements (0 with fewer than two).

    Example:
        >>> round(noise_of([100.0, 102.0, 98.0]), 3)
        2.0
    """
    values = [float(v) for v in samples if v is not None and math.isfinite(v)]
    return statistics.stdev(values) if len(values) >= 2 else 0.0


def compare(tonight: float | None, earlier: Sequence[float], noise: float, direction: str = "maximize",
            settings: NoiseSettings | None = None) -> Verdict:
    """Tonight's best against the previous night's (the last of ``earlier``).

    A regression is a move in the bad direction larger than ``max(sigmas x noise, min_relative x
    baseline)``; ``noise`` is the larger of tonight's re-measurement spread and the spread of the
    earlier nights' bests (computed here from ``earlier``).

    Example:
        >>> compare(990.0, [1000.0], noise=5.0).regressed, compare(900.0, [1000.0], noise=5.0).regressed
        (False, True)
    """
    s = settings or NoiseSettings()
    if tonight is None:
        base = earlier[-1] if earlier else None
        return Verdict(base is not None, base, None, math.nan,
                       "no feasible configuration tonight" + ("" if base is None else f" (previous best {base:,.1f})"))
    if not earlier:
        return Verdict(False, None, None, math.nan, "first night: nothing to compare with")
    base = float(earlier[-1])
    spread = max(noise, noise_of(earlier))
    threshold = max(s.sigmas * spread, s.min_relative * abs(base))
    sign = 1.0 if direction == "maximize" else -1.0
    gain = sign * (tonight - base)
    change = gain / abs(base) if base else None
    if gain < -threshold:
        return Verdict(True, base, change, threshold,
                       f"{-gain:,.1f} worse than the previous best {base:,.1f} (tolerance {threshold:,.1f}: "
                       f"{s.sigmas:g} x noise {spread:,.1f} or {s.min_relative:.0%})")
    return Verdict(False, base, change, threshold, f"within the tolerance {threshold:,.1f} of the previous best {base:,.1f}")


def scaled_calibration(base: Mapping[str, float], factor: float) -> dict[str, float]:
    """Simulator knobs for an engine ``factor`` times as fast: efficiencies scaled by ``factor``,
    per-step/per-token overhead times by ``1/factor`` (so every step takes ``1/factor`` as long).

    Example:
        >>> scaled_calibration({"mem_efficiency": 0.6, "step_overhead_s": 0.002}, 0.5)
        {'mem_efficiency': 0.3, 'step_overhead_s': 0.004}
    """
    if not factor > 0:
        raise SpecError("--inject-regression", f"factor must be > 0, got {factor}", "e.g. CELL:0.7 (30% slower)")
    out = {}
    for key, value in base.items():
        if key in _EFFICIENCY_KNOBS:
            out[key] = value * factor
        elif key in _TIME_KNOBS:
            out[key] = value / factor
        else:
            out[key] = value
    return out


# -- one night ----------------------------------------------------------------------------------

@dataclasses.dataclass
class CellNight:
    """One cell's result tonight."""

    cell: str
    study: str
    date: str
    objective: str
    direction: str
    best: float | None
    repeats: list[float]
    noise: float
    flags: dict[str, Any] | None
    warm_start: dict[str, Any] | None
    verdict: Verdict
    injected: float | None = None  # the speed factor planted for a test, if any
    #: The cheapest feasible trial tonight: dollars per million good output tokens at the cell's
    #: constraints (servetune.cost), its good output tokens/s and GPUs; None where nothing was
    #: feasible or the GPU type has no price.
    cost_per_mtok: float | None = None
    goodput: float | None = None
    gpu_type: str = ""
    price: str = ""  # the price it rests on: $/GPU-h, date, source
    #: Why this cell's simulated figures rest on an unjudged calibration (calibration_warning); "" if judged.
    calibration_warning: str = ""


@dataclasses.dataclass
class NightlyOutcome:
    date: str
    cells: list[CellNight]
    report: Path
    history: Path
    mlflow_run_id: str | None = None

    @property
    def regressions(self) -> list[CellNight]:
        return [c for c in self.cells if c.verdict.regressed]


def calibration_warning(gpu: gpus.GpuSpec, backend: str, model: ModelProfile | None = None) -> str:
    """The report's warning for a cell on ``gpu`` run by ``backend``: "" where the simulator's
    calibration on that GPU type has been judged on real runs to the target, or where no simulator ran the trials
    (``vllm``, ``replay``); else :func:`~servetune.planner.gpus.calibration_note`'s line. Pure.

    Example:
        >>> calibration_warning(gpus.get_gpu("L40S"), "sim"), calibration_warning(gpus.get_gpu("A10G"), "vllm")
        ('', '')
        >>> calibration_warning(gpus.get_gpu("A10G"), "sim").startswith("A10G: no real vLLM run")
        True
    """
    can = capabilities(backend)
    if can.real_gpus or can.reads_landscape:  # measured on real GPUs, or a recorded landscape: no simulator
        return ""
    return gpus.calibration_note(gpu, model) or ""


def rank_by_cost(nights: Sequence[CellNight]) -> dict[str, list[CellNight]]:
    """Per model and workload (``<model>.*.<workload>``), the cells with a cost on a judged GPU type
    (no :attr:`CellNight.calibration_warning`), cheapest per million good output tokens first. Pure.

    Example:
        >>> v = Verdict(False, None, None, math.nan, "")
        >>> a = CellNight("m.H200.chat", "s", "d", "o", "maximize", 1.0, [], 0.0, None, None, v, cost_per_mtok=0.5)
        >>> b = CellNight("m.L4.chat", "s", "d", "o", "maximize", 1.0, [], 0.0, None, None, v, cost_per_mtok=0.2)
        >>> [n.cell for n in rank_by_cost([a, b])["m.*.chat"]]
        ['m.L4.chat', 'm.H200.chat']
    """
    groups: dict[str, list[CellNight]] = {}
    for n in nights:
        model, _, rest = n.cell.partition(".")
        workload = rest.partition(".")[2]
        groups.setdefault(f"{model}.*.{workload}", [])
        if n.cost_per_mtok is not None and not n.calibration_warning:
            groups[f"{model}.*.{workload}"].append(n)
    return {k: sorted(v, key=lambda n: (n.cost_per_mtok, n.cell)) for k, v in groups.items() if v}


def _cost_section(nights: Sequence[CellNight]) -> list[str]:
    """The report's ranking of GPU types by cost per million good output tokens (empty without costs)."""
    ranked = rank_by_cost(nights)
    unjudged = [n for n in nights if n.calibration_warning and n.cost_per_mtok is not None]
    if not ranked and not unjudged:
        return []
    lines = ["", "## GPU types by cost per million output tokens at the SLO", "",
             "The cheapest feasible trial of each cell: its GPU type's list price x its GPUs over the output tokens "
             "of the requests that met the cell's latency targets (servetune.cost). Only GPU types whose simulator "
             "calibration real runs have judged are ranked."]
    for group, cells in ranked.items():
        lines += ["", f"**{group}**", "", "| rank | GPU type | $/Mtok | good output tok/s | price |", "|---|---|---|---|---|"]
        for i, n in enumerate(cells, start=1):
            good = "-" if n.goodput is None else f"{n.goodput:,.0f}"
            lines.append(f"| {i} | {n.gpu_type or n.cell} | {n.cost_per_mtok:,.3f} | {good} | {n.price or '-'} |")
    if unjudged:
        lines += ["", "Not ranked (calibration not judged): "
                  + "; ".join(f"{n.cell} {n.cost_per_mtok:,.3f} $/Mtok" for n in unjudged) + "."]
    return lines


def render_report(date: str, nights: Sequence[CellNight], history: pd.DataFrame, plots: Mapping[str, str]) -> str:
    """The Markdown report: a summary table, then per cell its nights and its plot. Pure.

    Example:
        >>> v = Verdict(False, None, None, math.nan, "first night: nothing to compare with")
        >>> n = CellNight("m.H200.chat", "m.H200.chat-20260101", "20260101", "output_throughput", "maximize",
        ...               1000.0, [1000.0, 1001.0], 0.7, {"max_num_seqs": 64}, None, v)
        >>> "| m.H200.chat | 1,000.0 |" in render_report("20260101", [n], pd.DataFrame(), {})
        True
    """
    lines = [f"# servetune nightly {date}", ""]
    bad = [n for n in nights if n.verdict.regressed]
    lines.append(f"**{len(bad)} regression(s)** in {len(nights)} cell(s)." if bad else
                 f"No regression in {len(nights)} cell(s).")
    unjudged = sorted({n.gpu_type or n.cell for n in nights if n.calibration_warning})
    if unjudged:
        lines += ["", f"**Warning: calibration not judged** on {', '.join(unjudged)}: their cells ran on the "
                  "simulator without real vLLM runs on that GPU type behind it; their figures are shown, not "
                  "ranked against judged GPU types."]
    lines += ["", "| cell | best | previous | change | noise (stdev) | tolerance | verdict |",
              "|---|---|---|---|---|---|---|"]
    for n in nights:
        prev = "-" if n.verdict.baseline is None else f"{n.verdict.baseline:,.1f}"
        change = "-" if n.verdict.change is None else f"{n.verdict.change:+.1%}"
        tol = "-" if math.isnan(n.verdict.threshold) else f"{n.verdict.threshold:,.1f}"
        best = "-" if n.best is None else f"{n.best:,.1f}"
        word = "REGRESSION" if n.verdict.regressed else "ok"
        lines.append(f"| {n.cell} | {best} | {prev} | {change} | {n.noise:,.1f} | {tol} | {word} |")
    lines += _cost_section(nights)
    for n in nights:
        lines += ["", f"## {n.cell}", "",
                  f"Study `{n.study}`, objective `{n.objective}` ({n.direction}). {n.verdict.reason}."]
        if n.calibration_warning:
            lines.append(f"**Warning:** {n.calibration_warning}.")
        if n.injected is not None:
            lines.append(f"Planted regression: the simulated engine ran at {n.injected:g} x its speed.")
        if n.warm_start:
            lines.append(f"Warm start from earlier nights: `{json.dumps(n.warm_start, sort_keys=True)}`.")
        if n.flags:
            lines.append(f"Best flags: `{json.dumps(n.flags, sort_keys=True)}`; re-measured "
                         f"{', '.join(f'{r:,.1f}' for r in n.repeats)}.")
        rows = history[history["cell"] == n.cell] if not history.empty else history
        if not rows.empty:
            lines += ["", "| night | best | noise | verdict |", "|---|---|---|---|"]
            for _, r in rows.sort_values("date").iterrows():
                best = "-" if pd.isna(r["best"]) else f"{r['best']:,.1f}"
                lines.append(f"| {r['date']} | {best} | {r['noise']:,.1f} | "
                             f"{'REGRESSION' if r['regressed'] else 'ok'} |")
        if n.cell in plots:
            lines += ["", f"![{n.cell}]({plots[n.cell]})"]
    return "\n".join(lines) + "\n"


def _plot(rows: pd.DataFrame, cell: str, objective: str, path: Path) -> None:
    # Figure() directly, not pyplot: no global figure registry across cells.
    fig = Figure(figsize=(6.5, 3.8), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    rows = rows.sort_values("date")
    x = list(range(len(rows)))
    best = rows["best"].astype(float).to_numpy()
    noise = rows["noise"].astype(float).to_numpy()
    ax.errorbar(x, best, yerr=noise, marker="o", capsize=4, label="best (+/- noise)")
    flagged = rows["regressed"].to_numpy(dtype=bool)
    if flagged.any():
        ax.scatter([xi for xi, f in zip(x, flagged, strict=True) if f], best[flagged], color="red", zorder=3,
                   s=80, label="regression")
    ax.set_xticks(x, list(rows["date"]), rotation=30)
    ax.set_ylabel(objective)
    ax.set_title(cell)
    ax.legend(loc="best")
    fig.savefig(path, dpi=90)


def load_matrix(path: str | Path) -> dict[str, Any]:
    data = read_yaml(Path(path), "matrix")
    if not isinstance(data, dict):
        raise SpecError("matrix", f"{path} is empty or not a mapping", "start from jobs/nightly.yaml")
    return data


def _inject_gpu_file(gpu_type: str, factor: float, out_dir: Path) -> Path:
    """A GPU table re-declaring ``gpu_type`` with the simulator ``factor`` times as fast."""
    gpu = gpus.get_gpu(gpu_type)
    knobs = scaled_calibration(dataclasses.asdict(calibration_for(gpu)), factor)
    entry = {"name": gpu.name, "memory_gib": gpu.memory_gib, "hbm_gbps": gpu.hbm_gbps,
             "bf16_tflops": gpu.bf16_tflops, "fp8_tflops": gpu.fp8_tflops,
             "interconnect_gbps": gpu.interconnect_gbps, "compute_capability": gpu.compute_capability,
             "calibration": knobs}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu-{_slug(gpu.name)}-x{factor:g}.yaml"
    path.write_text(yaml.safe_dump({"gpus": [entry]}, sort_keys=False))
    return path


def output_root(matrix: Mapping[str, Any], cwd: Path, override: str | Path | None = None) -> Path:
    """Where a night's outputs go: ``override`` (``--output-dir``), else the matrix's ``output.dir``
    (default ``servetune-nightly``), resolved from ``cwd``.

    Example:
        >>> output_root({"output": {"dir": "n"}}, Path("/w")), output_root({}, Path("/w"), "/s/n")
        (PosixPath('/w/n'), PosixPath('/s/n'))
    """
    root = Path(override if override is not None else (matrix.get("output") or {}).get("dir", "servetune-nightly"))
    return root if root.is_absolute() else cwd / root


def nightly_stores(matrix: Mapping[str, Any], root: Path) -> tuple[str, str]:
    """The night's (Optuna storage URL, MLflow tracking URI): SQLite under ``root`` unless the
    matrix's ``tracking.mlflow_uri`` names a server."""
    tdata = matrix.get("tracking") or {}
    return sqlite_url(root / "optuna.db"), str(tdata.get("mlflow_uri", sqlite_url(root / "mlflow.db")))


def run_nightly(matrix_path: str | Path, date: str, *, inject: Mapping[str, float] | None = None,
                out: TextIO | None = None, cwd: str | Path | None = None,
                output_dir: str | Path | None = None) -> NightlyOutcome:
    """Run tonight's study for every cell, compare with earlier nights, write and log the report.

    ``inject`` maps cell names to a simulated-engine speed factor (a planted regression, for tests
    and demos). Output paths resolve from ``cwd`` (default: the working directory); ``output_dir``
    replaces the matrix's ``output.dir``.

    Example:
        >>> outcome = run_nightly("jobs/nightly.yaml", "20260101")    # doctest: +SKIP
        >>> [c.verdict.regressed for c in outcome.cells]              # doctest: +SKIP
        [False, False]
    """
    out = out or io.StringIO()
    if not _DATE_RE.match(date):
        raise SpecError("--date", f"expected YYYYMMDD, got {date!r}", "e.g. --date 20260101")
    matrix_file = Path(matrix_path).resolve()
    matrix = load_matrix(matrix_file)
    cells = expand_matrix(matrix)
    names = [c.name for c in cells]
    for cell_name in inject or {}:
        if cell_name not in names:
            raise SpecError("--inject-regression", f"no cell {cell_name!r}{did_you_mean(cell_name, names)}",
                            f"cells: {', '.join(names)}")
    here = Path(cwd) if cwd is not None else Path.cwd()
    root = output_root(matrix, here, output_dir)
    report_dir = root / "reports" / date
    report_dir.mkdir(parents=True, exist_ok=True)
    optuna_url, mlflow_uri = nightly_stores(matrix, root)
    history_path = root / "nightly_history.parquet"
    history = pd.read_parquet(history_path) if history_path.exists() else pd.DataFrame()
    if not history.empty:  # a night run again replaces its rows
        history = history[history["date"] != date]
    night = _Night(date=date, matrix_file=matrix_file, here=here, root=root, report_dir=report_dir,
                   optuna_url=optuna_url, mlflow_uri=mlflow_uri,
                   experiment=(matrix.get("tracking") or {}).get("experiment", str(matrix.get("name", "servetune-nightly"))),
                   settings=_noise_settings(matrix.get("noise")), history=history, inject=dict(inject or {}), out=out)

    # One Ray for the night, with the largest GPU count any cell asks for (logical GPUs locally).
    TrialPool.start(num_gpus=max(int(c.spec_data.get("gpu", {}).get("count", 1)) for c in cells))
    nights = [_run_cell(night, cell) for cell in cells]
    return _write_night(night, nights, history_path)


@dataclasses.dataclass(frozen=True)
class _Night:
    """What every cell of one night shares: where it writes, its stores, the earlier nights."""

    date: str
    matrix_file: Path
    here: Path
    root: Path
    report_dir: Path
    optuna_url: str
    mlflow_uri: str
    experiment: str
    settings: NoiseSettings
    history: pd.DataFrame  # the earlier nights (tonight's rows dropped)
    inject: Mapping[str, float]
    out: TextIO

    @property
    def dataset_dir(self) -> Path:
        return self.root / "dataset"


def _run_cell(night: _Night, cell: Any) -> CellNight:
    """One cell's study tonight (warm-started from its earlier nights), its best re-measured, and
    its verdict against the earlier nights."""
    date, out, history = night.date, night.out, night.history
    data = deep_merge(cell.spec_data, {
        "name": cell.study_name(date),
        "tracking": {"mlflow_uri": night.mlflow_uri, "experiment": night.experiment},
        "storage": {"optuna_url": night.optuna_url},
        "output": {"runs_dir": str(night.root / "runs"), "dataset_dir": str(night.dataset_dir)}})
    factor = night.inject.get(cell.name)
    original = gpus.get_gpu(cell.gpu_type) if factor is not None else None
    if factor is not None:
        data["gpu"] = {**data["gpu"], "file": str(_inject_gpu_file(cell.gpu_type, factor, night.report_dir))}
    try:
        spec = StudySpec.from_dict(data, night.matrix_file.parent, cwd=night.here)
        # Read before a planted table replaces the GPU (its sim_evidence is the real type's).
        judged_note = calibration_warning(original or spec.gpu_spec(), spec.backend, spec.model_profile)
        if judged_note:
            out.write(f"nightly {date}: cell {cell.name}: warning: {judged_note}\n")
        objective, direction = spec.objective.metrics[0], spec.objective.directions[0]
        earlier_rows = (dataset.read_trials(night.dataset_dir, gpu_type=spec.gpu.type) if night.dataset_dir.exists()
                        else pd.DataFrame())
        if not earlier_rows.empty:
            earlier_rows = earlier_rows[earlier_rows["study"].astype(str).str.startswith(f"{cell.name}-")
                                        & (earlier_rows["study"] != spec.name)]
        warm = warm_start_flags(earlier_rows, spec.search_space.names, objective, direction,
                                spec.constraints.max_preemptions)
        study = retry_call(lambda: optuna.create_study(  # the driver's storage: SQLite or PostgreSQL, retried
            study_name=spec.name, storage=open_storage(spec.storage.optuna_url), load_if_exists=True,
            directions=list(spec.objective.directions)),  # type: ignore[arg-type]  # spec: "minimize"|"maximize"
            what="open the Optuna study")
        if warm and not study.get_trials(deepcopy=False):
            study.enqueue_trial(warm, skip_if_exists=True)
        out.write(f"nightly {date}: cell {cell.name}: study {spec.name}"
                  + (f", warm start {warm}" if warm else "") + (f", planted speed x{factor:g}" if factor else "")
                  + "\n")
        outcome = run_study(spec, out=out)
        best = None if outcome.best_metrics is None else outcome.best_metrics.get(objective)
        repeats: list[float] = []
        if outcome.best_flags is not None:  # on the Ray pool, like the study's own trials
            seeds = [spec.seed + 1000 + k for k in range(1, night.settings.repeats + 1)]
            for r in remeasure(spec, outcome.best_flags, seeds):
                value = r.metrics().get(objective)
                if value is not None:
                    repeats.append(float(value))
    finally:
        if original is not None:  # the planted GPU table must not leak into the next cells
            gpus.register_gpu(original)
    noise = noise_of(repeats)
    cost, good = _cheapest(study)
    prev = history[history["cell"] == cell.name].sort_values("date") if not history.empty else history
    prev = prev[(prev["date"] < date) & prev["best"].notna()] if not prev.empty else prev
    earlier = [float(v) for v in prev["best"]] if not prev.empty else []
    earlier_noise = max([float(v) for v in prev["noise"]], default=0.0) if not prev.empty else 0.0
    verdict = compare(best, earlier, max(noise, earlier_noise), direction, night.settings)
    out.write(f"nightly {date}: cell {cell.name}: best {best}, noise {noise:.2f}: "
              f"{'REGRESSION' if verdict.regressed else 'ok'} ({verdict.reason})\n")
    return CellNight(cell.name, spec.name, date, objective, direction, best, repeats, noise,
                     outcome.best_flags, warm, verdict, factor, cost, good, spec.gpu.type,
                     "" if spec.gpu_price is None else spec.gpu_price.describe(), judged_note)


def _write_night(night: _Night, nights: list[CellNight], history_path: Path) -> NightlyOutcome:
    """Tonight's rows added to the history, the per-cell plots, then the history, the report and
    the MLflow run written down through the study's recorder (redacted there, once)."""
    rows = pd.DataFrame([{"date": n.date, "cell": n.cell, "study": n.study, "objective": n.objective,
                          "best": n.best, "noise": n.noise, "repeats": json.dumps(n.repeats),
                          "flags": json.dumps(n.flags, sort_keys=True), "regressed": n.verdict.regressed,
                          "baseline": n.verdict.baseline, "injected": n.injected,
                          "cost_per_mtok": n.cost_per_mtok} for n in nights])
    history = pd.concat([night.history, rows], ignore_index=True) if not night.history.empty else rows
    history = history.sort_values(["cell", "date"]).reset_index(drop=True)
    plots = {}
    for n in nights:
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", n.cell) + ".png"
        _plot(history[history["cell"] == n.cell], n.cell, n.objective, night.report_dir / name)
        plots[n.cell] = name
    local = not night.mlflow_uri.startswith(("http://", "https://"))
    records = NightRecords(f"nightly-{night.date}", _night_tags(night.date, nights), _night_metrics(nights),
                           history, render_report(night.date, nights, history, plots))
    run_id = record_night(records, history_path=history_path, report_dir=night.report_dir,
                          mlflow_uri=night.mlflow_uri, experiment=night.experiment,
                          artifact_location=(night.root / "mlartifacts").resolve().as_uri() if local else None)
    return NightlyOutcome(night.date, nights, night.report_dir / "report.md", history_path, mlflow_run_id=run_id)


def _night_tags(date: str, nights: Sequence[CellNight]) -> dict[str, str]:
    """The nightly run's tags (``servetune.role=nightly``): its date and how many cells regressed."""
    return {"servetune.role": "nightly", "servetune.nightly_date": date,
            "servetune.regressions": str(sum(n.verdict.regressed for n in nights))}


def _night_metrics(nights: Sequence[CellNight]) -> dict[str, float]:
    """The nightly run's metrics: per cell its best, noise, cost and whether it regressed."""
    metrics: dict[str, float] = {}
    for n in nights:
        key = re.sub(r"[^A-Za-z0-9_.-]", "_", n.cell)
        if n.best is not None:
            metrics[f"{key}.best"] = n.best
        metrics[f"{key}.noise"] = n.noise
        if n.cost_per_mtok is not None:
            metrics[f"{key}.cost_per_mtok"] = n.cost_per_mtok
        metrics[f"{key}.regressed"] = float(n.verdict.regressed)
    return metrics


def _cheapest(study: optuna.Study) -> tuple[float | None, float | None]:
    """``(cost per million good output tokens, good output tokens/s)`` of the study's cheapest trial
    that met every constraint; ``(None, None)`` where none did or none was priced."""
    best: tuple[float, float] | None = None
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        metrics = t.user_attrs.get("metrics") or {}
        cost = metrics.get("cost_per_mtok")
        if cost is None or not (t.constraints and all(c <= 0 for c in t.constraints.values())):
            continue
        if best is None or cost < best[0]:
            best = (float(cost), float(metrics.get("goodput_output_throughput") or 0.0))
    return (None, None) if best is None else best


def today() -> str:
    """Today's date (UTC) as YYYYMMDD."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")
