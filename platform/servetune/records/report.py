"""Study report: matplotlib figures and a self-contained Markdown or HTML file, from the trials frame.

Contract: every ``plot_*`` function is pure (a DataFrame in, a new :class:`matplotlib.figure.Figure`
out, no global pyplot state, no files) and renders with the Agg backend, so it works on a headless
driver and inside Ray. ``df`` is :func:`servetune.records.dataset.read_trials` output: ``trial_number``,
``status``, ``flag_<name>`` columns and metric columns named as in :meth:`TrialResult.metrics`.
An empty frame, or one without the needed column values, gives a figure that says so instead
of raising. :func:`write_report` is the only function that writes files.

What happened to each trial (served clean or preempting, failed at startup, pruned, screened, ...)
comes from :func:`servetune.records.outcome.classify_frame`, the same classification the MLflow
tags and the dataset's ``outcome`` column carry; every plot draws each class with the same
colour, marker and legend text.

The objective defaults to ``output_throughput``; a trial that preempted still has a throughput
but does not count as a candidate for the best (servetune looks for preemption-free throughput).

Example:
    >>> import pandas as pd
    >>> df = pd.DataFrame({"trial_number": [0, 1, 2], "status": ["ok", "ok", "startup_oom"],
    ...                    "output_throughput": [900.0, 1200.0, None], "preemptions": [0.0, 3.0, None],
    ...                    "flag_max_num_seqs": [64, 256, 512]})
    >>> fig = plot_history(df)
    >>> [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    ['served, no preemption', 'served, preempted', 'failed at startup', 'best so far (no preemption)']
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import html
import io
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from servetune.errors import SpecError, did_you_mean
from servetune.planner.flags import to_command_line, to_config_yaml
from servetune.records.outcome import TrialOutcome, classify_frame
from servetune.records.trial_record import figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "MEMORY_PARTS",
    "plot_history",
    "plot_throughput_vs",
    "plot_pareto",
    "plot_memory_breakdown",
    "plot_slice",
    "plot_importance",
    "param_importances",
    "searched_flags",
    "top_trials",
    "study_plots",
    "plot_headroom",
    "winner",
    "Winner",
    "write_report",
]

#: Stacked memory parts, bottom to top, as vLLM allocates them at startup.
MEMORY_PARTS: tuple[tuple[str, str], ...] = (
    ("mem_weights_gib", "weights"),
    ("mem_activation_peak_gib", "activation peak"),
    ("mem_non_torch_gib", "non-torch"),
    ("mem_cudagraph_gib", "CUDA graphs"),
    ("mem_kv_cache_gib", "KV cache"),
)

def _figure(width: float = 7.5, height: float = 4.5) -> Figure:
    # Figure() directly, not pyplot: no global figure registry that would leak across a study, and
    # no GUI backend (it renders with Agg on a headless driver and in Ray). Imported here, not at
    # module level: matplotlib costs about half a second, which `import servetune.study` and
    # `servetune --help` need not pay.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _require(df: pd.DataFrame, column: str, field: str) -> None:
    if column not in df.columns:
        raise SpecError(field, f"no column {column!r}{did_you_mean(column, [str(c) for c in df.columns])}",
                        "use a flag_<name> or metric column of the trials frame")


def _column(df: pd.DataFrame, name: str, default: float = math.nan) -> pd.Series:
    if name in df.columns:
        return pd.to_numeric(df[name], errors="coerce").astype(float)
    return pd.Series(default, index=df.index, dtype=float)


def _empty_note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _legend(ax: Any) -> None:
    # Outside the axes: a legend of up to eight classes would hide points inside them.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)


def _scatter_classes(ax: Any, classes: pd.Series, xs: pd.Series, ys: pd.Series, floor: float) -> None:
    """One scatter per class present, in the classes' order, each in its own colour and marker: served
    trials at their value, the others (no measurement) on the floor of the axis."""
    for cls in TrialOutcome:
        mask = (classes == cls) & xs.notna()
        if cls.served:
            mask &= ys.notna()
        if not mask.any():
            continue
        y = ys[mask] if cls.served else pd.Series(floor, index=xs[mask].index)
        ax.scatter(xs[mask], y, color=cls.color, marker=cls.marker, s=36 if cls.served else 70,
                   edgecolors="k", linewidths=0.4, label=cls.label, zorder=3 if cls.served else 4)


def plot_history(df: pd.DataFrame, objective: str = "output_throughput", direction: str = "maximize") -> Figure:
    """Optimization history: objective per trial by what happened to it, and the best-so-far line.

    Every class of :mod:`servetune.records.outcome` has its own marker; trials without a
    measurement (failed, pruned, screened) sit on the x axis.

    Example:
        >>> import pandas as pd
        >>> fig = plot_history(pd.DataFrame({"trial_number": [0], "status": ["ok"], "output_throughput": [1.0]}))
        >>> fig.axes[0].get_ylabel()
        'output_throughput'
    """
    _check_direction(direction)
    fig = _figure()
    ax = fig.add_subplot()
    ax.set_title("Optimization history")
    ax.set_xlabel("trial")
    ax.set_ylabel(objective)
    if df.empty:
        _empty_note(ax, "no trials yet")
        return fig
    d = df.sort_values("trial_number")
    x = _column(d, "trial_number")
    y = _column(d, objective)
    classes = classify_frame(d)
    floor = float(np.nanmin(y)) if y.notna().any() and direction == "minimize" else 0.0
    _scatter_classes(ax, classes, x, y, floor)
    candidates = y.where(classes == TrialOutcome.SERVED_CLEAN)
    # cummax leaves NaN where a trial is not a candidate; the best so far carries over those.
    best = (candidates.cummax() if direction == "maximize" else candidates.cummin()).ffill()
    if best.notna().any():
        ax.step(x, best, where="post", color="tab:green", label="best so far (no preemption)")
    _legend(ax)
    ax.grid(alpha=0.3)
    return fig


def _check_direction(direction: str, field: str = "direction") -> None:
    if direction not in ("maximize", "minimize"):
        raise SpecError(field, f"expected maximize or minimize, got {direction!r}", "use maximize or minimize")


def plot_throughput_vs(df: pd.DataFrame, x: str = "flag_max_num_seqs", y: str = "output_throughput") -> Figure:
    """Scatter of ``y`` against a flag or metric, every trial by what happened to it.

    Served trials sit at their value; the others, which have no measurement, on the x axis, each
    class with its own marker. A ``flag_`` column is labelled with the flag's vLLM name.

    Example:
        >>> import pandas as pd
        >>> df = pd.DataFrame({"trial_number": [0, 1], "status": ["ok", "startup_oom"],
        ...                    "flag_max_num_seqs": [64, 1024], "output_throughput": [900.0, None],
        ...                    "preemptions": [2.0, None]})
        >>> fig = plot_throughput_vs(df)
        >>> fig.axes[0].get_xlabel(), [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        ('max_num_seqs', ['served, preempted', 'failed at startup'])
    """
    fig = _figure()
    ax = fig.add_subplot()
    ax.set_title(f"{y} vs {x.removeprefix('flag_')}")
    ax.set_xlabel(x.removeprefix("flag_"))
    ax.set_ylabel(y)
    if df.empty:
        _empty_note(ax, "no trials yet")
        return fig
    _require(df, x, "x")
    xs = _column(df, x)
    ys = _column(df, y)
    classes = classify_frame(df)
    if not xs.notna().any():
        _empty_note(ax, f"no trial has a value for {x}")
        return fig
    _scatter_classes(ax, classes, xs, ys, 0.0)
    _legend(ax)
    ax.grid(alpha=0.3)
    return fig


def _pareto_mask(xs: np.ndarray, ys: np.ndarray, x_max: bool, y_max: bool) -> np.ndarray:
    """Points no other point beats in both coordinates (ties do not dominate)."""
    sx = xs if x_max else -xs
    sy = ys if y_max else -ys
    keep = np.ones(len(xs), dtype=bool)
    for i in range(len(xs)):
        dominated = (sx >= sx[i]) & (sy >= sy[i]) & ((sx > sx[i]) | (sy > sy[i]))
        keep[i] = not dominated.any()
    return keep


def plot_pareto(df: pd.DataFrame, x_metric: str, y_metric: str, x_direction: str = "minimize",
                y_direction: str = "maximize") -> Figure:
    """Trade-off of two metrics: the Pareto front of the preemption-free trials, labelled by trial.

    Preempting trials are drawn (they did serve) but are not candidates, so they are never on the
    front; the legend says so. The default reads as "lower ``x_metric`` (a latency), higher
    ``y_metric`` (a throughput)".

    Example:
        >>> import pandas as pd
        >>> df = pd.DataFrame({"trial_number": [0, 1, 2], "status": ["ok"] * 3,
        ...                    "ttft_p99_ms": [50.0, 80.0, 90.0], "output_throughput": [900.0, 1500.0, 1000.0]})
        >>> fig = plot_pareto(df, "ttft_p99_ms", "output_throughput")
        >>> sorted(t.get_text() for t in fig.axes[0].texts)
        ['#0', '#1']
    """
    _check_direction(x_direction, "x_direction")
    _check_direction(y_direction, "y_direction")
    fig = _figure()
    ax = fig.add_subplot()
    ax.set_title(f"Pareto front: {y_metric} vs {x_metric}")
    ax.set_xlabel(f"{x_metric} ({'lower' if x_direction == 'minimize' else 'higher'} is better)")
    ax.set_ylabel(f"{y_metric} ({'lower' if y_direction == 'minimize' else 'higher'} is better)")
    if df.empty:
        _empty_note(ax, "no trials yet")
        return fig
    _require(df, x_metric, "x_metric")
    _require(df, y_metric, "y_metric")
    classes = classify_frame(df)
    has_both = _column(df, x_metric).notna() & _column(df, y_metric).notna()
    d = df[(classes == TrialOutcome.SERVED_CLEAN) & has_both]
    pre = df[(classes == TrialOutcome.SERVED_PREEMPTING) & has_both]
    if not pre.empty:
        style = TrialOutcome.SERVED_PREEMPTING
        ax.scatter(_column(pre, x_metric), _column(pre, y_metric), color=style.color, marker=style.marker,
                   edgecolors="k", linewidths=0.4, label=f"{style.label} (not a candidate)", zorder=2)
    if d.empty:
        _empty_note(ax, "no trial served without preemption")
        if not pre.empty:
            _legend(ax)
        return fig
    xs = _column(d, x_metric).to_numpy()
    ys = _column(d, y_metric).to_numpy()
    front = _pareto_mask(xs, ys, x_direction == "maximize", y_direction == "maximize")
    ax.scatter(xs[~front], ys[~front], color="0.6", label="no preemption, dominated", zorder=2)
    ax.scatter(xs[front], ys[front], color="tab:red", label="Pareto front (no preemption)", zorder=3)
    order = np.argsort(xs[front])
    ax.plot(xs[front][order], ys[front][order], color="tab:red", alpha=0.5, drawstyle="steps-post")
    numbers = _column(d, "trial_number").to_numpy()[front]
    for xv, yv, n in zip(xs[front], ys[front], numbers):
        ax.annotate(f"#{int(n)}" if not math.isnan(n) else "?", (xv, yv), textcoords="offset points",
                    xytext=(4, 4), fontsize="small")
    _legend(ax)
    ax.grid(alpha=0.3)
    return fig


def searched_flags(df: pd.DataFrame) -> list[str]:
    """The ``flag_*`` columns that took more than one value in the frame: the flags the study searched."""
    out = []
    for c in df.columns:
        if not str(c).startswith("flag_"):
            continue
        values = df[c].dropna()
        if values.map(lambda v: repr(_python(v))).nunique() > 1:
            out.append(str(c))
    return out


def param_importances(df: pd.DataFrame, objective: str = "output_throughput",
                      direction: str = "maximize") -> dict[str, float]:
    """How much each searched flag decides ``objective`` among the served trials, by Optuna's own
    PED-ANOVA evaluator (:class:`optuna.importance.PedAnovaImportanceEvaluator`: no scikit-learn,
    which fANOVA needs and servetune's core does not install); ``{}`` when fewer than three trials
    served or no flag varied among them. Keys are flag names, values sum to 1, largest first.

    The trials are rebuilt into an in-memory Optuna study from the dataset rows, so the figure is
    the same for a study read back from Parquet as for the live one.
    """
    _check_direction(direction)
    import optuna  # deferred: `servetune report` on a frame without searched flags needs no Optuna

    classes = classify_frame(df)
    served = df[classes.map(lambda c: c.served).astype(bool) & _column(df, objective).notna()] if not df.empty else df
    flags = searched_flags(served)
    if len(served) < 3 or not flags:
        return {}
    dists: dict[str, optuna.distributions.BaseDistribution] = {}
    for c in flags:
        values = [_python(v) for v in served[c].dropna()]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            lo, hi = min(values), max(values)
            dists[c] = (optuna.distributions.IntDistribution(int(lo), int(hi)) if all(isinstance(v, int) for v in values)
                        else optuna.distributions.FloatDistribution(float(lo), float(hi)))
        else:
            dists[c] = optuna.distributions.CategoricalDistribution(sorted({repr(v) for v in values}))
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created in memory" line
    try:
        study = optuna.create_study(direction="minimize" if direction == "minimize" else "maximize", storage=None)
    finally:
        optuna.logging.set_verbosity(verbosity)
    for _, row in served.iterrows():
        params = {}
        for c, dist in dists.items():
            if _is_missing(row[c]):
                break
            value = _python(row[c])
            params[c] = repr(value) if isinstance(dist, optuna.distributions.CategoricalDistribution) else value
        else:
            study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=float(row[objective])))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            importance = _optuna_importance()
            found = importance.get_param_importances(study, evaluator=importance.PedAnovaImportanceEvaluator())
    except (ValueError, RuntimeError, ZeroDivisionError):  # too few distinct values for the estimator
        return {}
    if any("same set of trials" in str(w.message) for w in caught):
        return {}  # PED-ANOVA's own verdict: too few trials to tell the flags apart (equal shares)
    return {k.removeprefix("flag_"): float(v) for k, v in found.items() if v == v}


def _optuna_importance() -> Any:
    """``optuna.importance`` without scikit-learn. Its package imports the fANOVA evaluator, which
    imports scikit-learn (and SciPy) where it is installed, for nothing here: PED-ANOVA needs
    neither, and that import was 1.3 of the 4-7 s a study's end took. While ``optuna.importance``
    loads, ``sklearn.ensemble`` reads as absent (Optuna's ``try_import`` then defers fANOVA's
    error to its use); a scikit-learn some other code imported already is left as it is."""
    import importlib
    import sys

    if "optuna.importance" in sys.modules or "sklearn" in sys.modules:
        return importlib.import_module("optuna.importance")
    sys.modules["sklearn.ensemble"] = None  # type: ignore[assignment]  # the import system's "not found"
    try:
        return importlib.import_module("optuna.importance")
    finally:
        del sys.modules["sklearn.ensemble"]


def plot_importance(df: pd.DataFrame, objective: str = "output_throughput", direction: str = "maximize") -> Figure:
    """Horizontal bars of :func:`param_importances`, most important on top."""
    fig = _figure(7.5, 3.5)
    ax = fig.add_subplot()
    ax.set_title(f"Flag importance for {objective} (Optuna PED-ANOVA)")
    found = param_importances(df, objective, direction)
    if not found:
        _empty_note(ax, "needs three served trials and a searched flag")
        return fig
    names = list(found)[::-1]
    ax.barh(names, [found[n] for n in names], color="tab:blue")
    ax.set_xlabel(f"importance among the served trials (sums to 1)")
    ax.set_xlim(0, 1)
    ax.grid(axis="x", alpha=0.3)
    return fig


def plot_slice(df: pd.DataFrame, objective: str = "output_throughput", max_flags: int = 4) -> Figure:
    """Optuna's slice plot, servetune's way: ``objective`` against each searched flag, every trial by
    what happened to it (trials without a measurement on the floor), one panel per flag."""
    flags = searched_flags(df)[:max_flags] if not df.empty else []
    fig = _figure(3.2 * max(1, len(flags)) + 2.2, 3.6)
    if not flags:
        ax = fig.add_subplot()
        ax.set_title("Slice")
        _empty_note(ax, "no flag took more than one value")
        return fig
    classes = classify_frame(df)
    ys = _column(df, objective)
    axes = fig.subplots(1, len(flags), sharey=True, squeeze=False)[0]
    for ax, flag in zip(axes, flags):
        xs = _column(df, flag)
        if xs.isna().all():  # a categorical flag: its values in order of appearance
            order = {v: i for i, v in enumerate(sorted({repr(_python(v)) for v in df[flag].dropna()}))}
            xs = df[flag].map(lambda v: math.nan if _is_missing(v) else order[repr(_python(v))]).astype(float)
            ax.set_xticks(list(order.values()), list(order))
        _scatter_classes(ax, classes, xs, ys, 0.0)
        ax.set_xlabel(flag.removeprefix("flag_"))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(objective)
    fig.suptitle(f"{objective} against each searched flag")
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:  # a class may appear in one panel only
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="outside right upper", fontsize="small", frameon=False)
    return fig


def top_trials(df: pd.DataFrame, n: int = 5, objective: str = "output_throughput",
               direction: str = "maximize", preemption_free: bool = True) -> pd.DataFrame:
    """The best ``n`` served trials by ``objective`` (preemption-free ones only, by default).

    Example:
        >>> import pandas as pd
        >>> df = pd.DataFrame({"trial_number": [0, 1, 2], "status": ["ok", "ok", "ok"],
        ...                    "output_throughput": [1.0, 3.0, 2.0], "preemptions": [0.0, 5.0, 0.0]})
        >>> top_trials(df, 2)["trial_number"].tolist()
        [2, 0]
    """
    _check_direction(direction)
    if df.empty or objective not in df.columns:
        return df.iloc[0:0]
    classes = classify_frame(df)
    wanted = (classes == TrialOutcome.SERVED_CLEAN) if preemption_free else classes.map(lambda c: c.served).astype(bool)
    mask = wanted & _column(df, objective).notna()
    d = df[mask].assign(_objective=_column(df, objective)[mask])
    d = d.sort_values(["_objective", "trial_number"], ascending=[direction == "minimize", True], kind="stable")
    return d.drop(columns="_objective").head(n)


def plot_memory_breakdown(df: pd.DataFrame, top_n: int = 5, objective: str = "output_throughput") -> Figure:
    """Stacked per-GPU startup memory (GiB) of the top trials, the vLLM budget as a black tick.

    Each bar says what happened to its trial (``no preemption``, ``preempted``, ``startup failed``).
    When no served trial carries a breakdown (every trial failed to start), the first ``top_n``
    trials that have one are shown instead, which is what explains a startup OOM.

    Example:
        >>> import pandas as pd
        >>> df = pd.DataFrame({"trial_number": [0], "status": ["startup_oom"], "mem_weights_gib": [1.6],
        ...                    "mem_activation_peak_gib": [1.0], "mem_non_torch_gib": [0.5],
        ...                    "mem_cudagraph_gib": [0.0], "mem_kv_cache_gib": [0.0], "mem_budget_gib": [1.7]})
        >>> fig = plot_memory_breakdown(df)
        >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
        ['#0\\nstartup failed']
    """
    fig = _figure()
    ax = fig.add_subplot()
    ax.set_title("Startup memory per GPU")
    ax.set_ylabel("GiB")
    parts = [(c, label) for c, label in MEMORY_PARTS if c in df.columns]
    with_memory = df[df[[c for c, _ in parts]].notna().any(axis=1)] if parts and not df.empty else df.iloc[0:0]
    chosen = top_trials(with_memory, top_n, objective, preemption_free=False)
    if chosen.empty:
        chosen = with_memory.sort_values("trial_number").head(top_n) if not with_memory.empty else chosen
    if chosen.empty:
        _empty_note(ax, "no trial reported a memory breakdown")
        return fig
    positions = np.arange(len(chosen))
    bottom = np.zeros(len(chosen))
    for column, label in parts:
        values = _column(chosen, column).fillna(0.0).to_numpy()
        ax.bar(positions, values, bottom=bottom, label=label, width=0.6)
        bottom += values
    if "mem_budget_gib" in chosen.columns:
        budget = _column(chosen, "mem_budget_gib").to_numpy()
        ax.scatter(positions, budget, marker="_", s=900, color="k", linewidths=2, label="budget", zorder=4)
    labels = [f"#{int(n)}\n{c.short}" for n, c in zip(_column(chosen, "trial_number"), classify_frame(chosen))]
    ax.set_xticks(positions, labels)
    _legend(ax)
    ax.grid(axis="y", alpha=0.3)
    return fig


# ---------------------------------------------------------------------------------------------
# Report file
# ---------------------------------------------------------------------------------------------

_TABLE_METRICS = ("output_throughput", "preemptions", "ttft_p99_ms", "tpot_p99_ms", "kv_cache_usage_peak",
                  "mem_kv_cache_gib", "api_server_busy")
#: Shown only where some trial has them: studies recorded before servetune counted the API server's
#: CPU (and engines whose /metrics lack it) would otherwise carry an empty column.
_WHEN_RECORDED = frozenset({"api_server_busy"})


def _format_cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, (float, np.floating)):
        return f"{value:,.1f}" if abs(float(value)) >= 100 else f"{value:.3g}"
    if isinstance(value, (list, tuple, np.ndarray)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _table_rows(df: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    flags = [c for c in df.columns if str(c).startswith("flag_") and df[c].notna().any()]
    metrics = [c for c in _TABLE_METRICS if c in df.columns and (c not in _WHEN_RECORDED or df[c].notna().any())]
    columns = [c for c in ("trial_number",) if c in df.columns] + flags + metrics
    header = [c.removeprefix("flag_") for c in columns] + ["what happened"]
    classes = classify_frame(df)
    rows = [[*(_format_cell(v) for v in row), cls.label]
            for row, cls in zip(df[columns].itertuples(index=False, name=None), classes)]
    return header, rows


def _python(value: Any) -> Any:
    """A Parquet cell as the plain Python value a flag takes (numpy scalars and arrays are not YAML)."""
    if isinstance(value, np.ndarray):
        return [_python(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


@dataclasses.dataclass(frozen=True)
class Winner:
    """A study's best preemption-free trial as the report prints it: the command to run first."""

    trial_number: int
    flags: dict[str, Any]
    model: str  # what `vllm serve` gets
    metrics: dict[str, float]

    @property
    def command(self) -> str:
        return to_command_line(self.model, self.flags)

    @property
    def config_yaml(self) -> str:
        return to_config_yaml(self.model, self.flags)


def winner(df: pd.DataFrame, objective: str = "output_throughput", direction: str = "maximize") -> Winner | None:
    """The best preemption-free trial of one study's frame with its flags and `vllm serve` model, or None.

    The flags are the trial's non-null ``flag_*`` cells; the model is ``serve_model`` where the
    dataset has it (the Hugging Face id `vllm serve` gets), else ``model``.

    Example:
        >>> import pandas as pd
        >>> df = pd.DataFrame({"trial_number": [0, 1], "status": ["ok", "ok"], "model": ["m", "m"],
        ...                    "output_throughput": [900.0, 1200.0], "preemptions": [0.0, 4.0],
        ...                    "flag_max_num_seqs": [64, 256]})
        >>> winner(df).command
        'vllm serve m --max-num-seqs 64'
    """
    best = top_trials(df, 1, objective, direction)
    if best.empty:
        return None
    row = best.iloc[0]
    flags = {str(c).removeprefix("flag_"): _python(row[c]) for c in best.columns
             if str(c).startswith("flag_") and not _is_missing(row[c])}
    model = next((str(row[c]) for c in ("serve_model", "model") if c in best.columns and not _is_missing(row[c])),
                 "MODEL")
    metrics = {m: float(row[m]) for m in (*_TABLE_METRICS, "itl_p99_ms", "kv_cache_tokens")
               if m in best.columns and not _is_missing(row[m])}
    return Winner(int(row["trial_number"]), flags, model, metrics)


def _is_missing(value: Any) -> bool:
    if isinstance(value, (list, tuple, np.ndarray)):
        return False
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *(line(r) for r in rows)])


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_UNITS = {"output_throughput": "output tok/s", "total_token_throughput": "tok/s (prompt + output)",
          "request_throughput": "requests/s"}


def study_plots(df: pd.DataFrame, objective: str = "output_throughput",
                pareto: Sequence[tuple[str, str]] | None = None) -> dict[str, Figure]:
    """The figures of one study's search (the report's and the MLflow parent run's), by file stem.

    ``pareto``: the two ``(metric, direction)`` of a Pareto objective, the first drawn on the y
    axis; without it the front of p99 TTFT against the objective is drawn when both were measured.
    """
    figures: dict[str, Figure] = {"optimization_history": plot_history(df, objective)}
    if "flag_max_num_seqs" in df.columns and df["flag_max_num_seqs"].notna().any():
        figures["throughput_vs_max_num_seqs"] = plot_throughput_vs(df, "flag_max_num_seqs", y=objective)
    if pareto is not None:
        (y_metric, y_dir), (x_metric, x_dir) = pareto
        figures["pareto_front"] = plot_pareto(df, x_metric, y_metric, x_direction=x_dir, y_direction=y_dir)
    elif "ttft_p99_ms" in df.columns and objective in df.columns:
        figures["pareto_front"] = plot_pareto(df, "ttft_p99_ms", objective)
    figures["memory_breakdown"] = plot_memory_breakdown(df, objective=objective)
    if len(searched_flags(df)) > 0:
        figures["slice"] = plot_slice(df, objective)
        direction = pareto[0][1] if pareto is not None else "maximize"
        figures["param_importance"] = plot_importance(df, objective, direction)
    return figures


_HEADROOM_ROWS = {"output_throughput": "output tok/s", "preemptions": "preemptions"}
_LATENCY_ROWS = {"ttft_p99_ms": "p99 TTFT (ms)", "itl_p99_ms": "p99 ITL (ms)", "e2e_p99_ms": "p99 E2E (ms)",
                 "tpot_p99_ms": "p99 TPOT (ms)"}


def plot_headroom(data: Any) -> Figure:
    """The headroom curve of a study's end (``StudyHeadroom.to_dict()``: the winner's and the
    runner-up's simulations): output throughput, a p99 latency (the first target the study sets,
    else TPOT) and preemptions against the scale of the load and of the prompts, each flag set's
    first edge marked with a dashed line. Pure: plain data in, a figure out.

    Example:
        >>> pts = [{"axis": "base", "scale": 1.0, "broken": [], "metrics": {"output_throughput": 10.0}},
        ...        {"axis": "load", "scale": 2.0, "broken": ["preemptions"], "metrics": {"preemptions": 3.0}}]
        >>> head = {"points": pts, "edges": [], "load_axis": "concurrency", "trial_number": 4}
        >>> len(plot_headroom({"winner": head, "runner_up": None}).axes)
        6
    """
    heads = [(role, h) for role, h in (("winner", data.get("winner")), ("runner-up", data.get("runner_up"))) if h]
    edges = [e for _, h in heads for e in h.get("edges", [])]
    latency = next((e["criterion"] for e in edges if e["criterion"] in _LATENCY_ROWS), "tpot_p99_ms")
    rows = [("output_throughput", "output tok/s"), (latency, _LATENCY_ROWS[latency]), ("preemptions", "preemptions")]
    fig = _figure(7.0, 5.4)
    axes = fig.subplots(len(rows), 2, sharex="col", squeeze=False)
    load_name = (heads[0][1].get("load_axis", "load") if heads else "load").replace("_", " ")
    for col, (axis, title) in enumerate((("load", f"{load_name} x"), ("prompt_len", "prompt length x"))):
        for (role, h), colour in zip(heads, ("tab:blue", "tab:orange")):
            pts = sorted((p for p in h.get("points", []) if p["axis"] in ("base", axis)), key=lambda p: p["scale"])
            xs = [p["scale"] for p in pts]
            first = min((e["first_fail"] for e in h.get("edges", []) if e["axis"] == axis and e.get("first_fail")),
                        default=None)
            for row, (metric, _) in enumerate(rows):
                ax = axes[row][col]
                ax.plot(xs, [p["metrics"].get(metric, math.nan) for p in pts], marker="o", color=colour,
                        label=f"{role} #{h.get('trial_number')}")
                if first is not None:
                    ax.axvline(first, color=colour, linestyle="--", linewidth=1)
        for row, (metric, label) in enumerate(rows):
            limit = next((e["limit"] for e in edges if e["criterion"] == metric), None)
            if limit is not None and metric != "output_throughput":
                axes[row][col].axhline(limit, color="tab:red", linewidth=0.8)
            axes[row][0].set_ylabel(label, fontsize="small")
            if metric == "preemptions":
                axes[row][col].set_ylim(bottom=0)
        axes[-1][col].set_xlabel(title)
    axes[0][1].legend(fontsize="small", frameon=False)
    fig.suptitle("Headroom: simulated, dashed where each flag set first breaks a constraint", fontsize="medium")
    return fig


def _study_blocks(name: str, df: pd.DataFrame, objective: str, top_n: int, prefix: str,
                  headroom: Any = None) -> list[tuple[Any, ...]]:
    """One study's section: the winner's figures, command and config first, then what happened, then plots."""
    ident = {c: str(df[c].dropna().iloc[0]) for c in ("model", "gpu_type") if c in df.columns and df[c].notna().any()}
    blocks: list[tuple[Any, ...]] = [("h2", f"Study {name}: {ident.get('model', '?')} on {ident.get('gpu_type', '?')}")]
    best = winner(df, objective)
    if best is None:
        blocks.append(("p", "No trial served without preemption: nothing to recommend yet."))
    else:
        m = best.metrics
        blocks.append(("p", f"Winner: trial #{best.trial_number}, {figure(m.get(objective), ',.0f', _UNITS.get(objective, objective))}, "
                            f"p99 TTFT {figure(m.get('ttft_p99_ms'), ',.0f', 'ms')}, "
                            f"p99 ITL {figure(m.get('itl_p99_ms'), ',.1f', 'ms')}, "
                            f"KV cache {figure(m.get('kv_cache_tokens'), ',.0f', 'tokens')}, no preemption. Run it with:"))
        blocks.append(("code", "sh", best.command))
        blocks.append(("p", "or as a `vllm serve --config` file:"))
        blocks.append(("code", "yaml", best.config_yaml.rstrip()))
    classes = classify_frame(df)
    counts = classes.value_counts()
    blocks.append(("p", f"{len(df)} trials: " + ", ".join(f"{int(counts[c])} {c.label}" for c in TrialOutcome if c in counts)
                   + "."))
    header, rows = _table_rows(top_trials(df, top_n, objective))
    blocks.append(("h3", "Top trials (served, no preemption)"))
    blocks.append(("table", header, rows) if rows else ("p", "No successful preemption-free trial."))
    if headroom:
        blocks.append(("h3", "Headroom of the winner (simulated)"))
        blocks.append(("code", "text", "\n".join(headroom.get("text", []))))
        blocks.append(("img", f"{prefix}headroom", plot_headroom(headroom)))
    blocks.append(("h3", "Plots"))
    for stem, fig in study_plots(df, objective).items():
        blocks.append(("img", f"{prefix}{stem}", fig))
    return blocks


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def write_report(df: pd.DataFrame, out: Path, title: str, objective: str = "output_throughput",
                 top_n: int = 10, headroom: Any = None) -> Path:
    """Write the report, one section per study (winner, command and config at its top); returns its path.

    Several studies (several models or GPU types) are never mixed into one table: an overview
    table names each study's model, GPU and best figure, and each study has its own section.
    Confirmation repeats (``repeat`` rows) are left out of the tables and plots: they re-measure
    a trial, they are not more of the search.

    ``out`` ending in ``.html`` gives one self-contained HTML file (PNGs embedded as base64);
    anything else gives Markdown (``.md`` appended if missing) with PNGs in ``<stem>_files/``
    next to it, linked relatively so the folder can be moved or attached as one MLflow artifact.
    ``headroom`` (study name -> its end's headroom, ``StudyHeadroom.to_dict()``) adds each
    study's headroom block and curve.

    Example:
        >>> import pandas as pd, tempfile
        >>> df = pd.DataFrame({"trial_number": [0], "status": ["ok"], "output_throughput": [900.0],
        ...                    "flag_max_num_seqs": [64], "preemptions": [0.0]})
        >>> path = write_report(df, Path(tempfile.mkdtemp()) / "report.md", "demo")
        >>> path.name, "| 0 | 64 | 900.0 | 0 | served, no preemption |" in path.read_text()
        ('report.md', True)
    """
    out = Path(out)
    as_html = out.suffix.lower() in (".html", ".htm")
    if not as_html and out.suffix.lower() != ".md":
        out = out.with_name(out.name + ".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    if "repeat" in df.columns:
        df = df[df["repeat"].isna()]
    generated = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    blocks: list[tuple[Any, ...]] = [("h1", title), ("p", f"Objective: {objective}, from trials that served without "
                                                           f"preemption. Generated {generated}.")]
    studies = (sorted(df["study"].dropna().astype(str).unique()) if "study" in df.columns and not df.empty else [])
    if len(studies) > 1:
        header = ["study", "model", "GPU", "trials", "served, no preemption", f"best {objective}", "winner"]
        rows = []
        for name in studies:
            part = df[df["study"].astype(str) == name]
            best = winner(part, objective)
            first = part.iloc[0]
            rows.append([name, str(first.get("model", "")), str(first.get("gpu_type", "")), str(len(part)),
                         str(int((classify_frame(part) == TrialOutcome.SERVED_CLEAN).sum())),
                         "" if best is None else _format_cell(best.metrics.get(objective)),
                         "none" if best is None else f"#{best.trial_number}"])
        blocks += [("h2", "Studies"), ("table", header, rows)]
    present = set(classify_frame(df))
    legend = [[c.label, c.explanation] for c in TrialOutcome if c in present]
    blocks += [("h3", "What the markers mean"), ("table", ["trial", "what happened"], legend)]
    if not studies:
        blocks += _study_blocks("(unnamed)", df, objective, top_n, "")
    for name in studies:
        part = df[df["study"].astype(str) == name]
        blocks += _study_blocks(name, part, objective, top_n, "" if len(studies) == 1 else f"{_slug(name)}-",
                                (headroom or {}).get(name))
    if as_html:
        out.write_text(_render_html(title, blocks), encoding="utf-8")
    else:
        out.write_text(_render_markdown(out, blocks), encoding="utf-8")
    return out


def _render_markdown(out: Path, blocks: Sequence[tuple[Any, ...]]) -> str:
    assets = out.with_name(out.stem + "_files")
    lines: list[str] = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + block[1], ""]
        elif kind == "p":
            lines += [block[1], ""]
        elif kind == "code":
            lines += [f"```{block[1]}", block[2], "```", ""]
        elif kind == "table":
            lines += [_markdown_table(block[1], block[2]), ""]
        elif kind == "img":
            assets.mkdir(exist_ok=True)
            png = assets / f"{block[1]}.png"
            block[2].savefig(png, format="png", dpi=110)
            lines += [f"![{block[1]}]({assets.name}/{png.name})", ""]
    return "\n".join(lines)


def _render_html(title: str, blocks: Sequence[tuple[Any, ...]]) -> str:
    parts: list[str] = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{html.escape(block[1])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{html.escape(block[1])}</p>")
        elif kind == "code":
            parts.append(f"<pre><code>{html.escape(block[2])}</code></pre>")
        elif kind == "table":
            parts.append(_html_table(block[1], block[2]))
        elif kind == "img":
            buf = io.BytesIO()
            block[2].savefig(buf, format="png", dpi=110)
            data = base64.b64encode(buf.getvalue()).decode("ascii")
            parts.append(f'<img alt="{html.escape(block[1])}" src="data:image/png;base64,{data}">')
    return ("<!doctype html><html><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;max-width:70em;margin:auto}}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
            "pre{background:#f4f4f4;padding:6px;white-space:pre-wrap}img{max-width:100%}</style></head><body>"
            + "".join(parts) + "</body></html>\n")
