"""Study report: matplotlib figures and a self-contained Markdown or HTML file, from the trials frame.

Contract: every ``plot_*`` function is pure (a DataFrame in, a new :class:`matplotlib.figure.Figure`
out, no global pyplot state, no files) and renders with the Agg backend, so it works on a headless
driver and inside Ray. ``df`` is :func:`servetune.records.dataset.read_trials` output: ``trial_number``,
``status``, ``flag_<name>`` columns and metric columns named as in :meth:`TrialResult.metrics`.
An empty frame, or one without the needed column values, gives a figure that says so instead
of raising. :func:`write_report` is the only function that writes files.

The objective defaults to ``output_throughput``; a trial that preempted still has a throughput
but does not count as a candidate for the best (servetune looks for preemption-free throughput).

Example:
    >>> import pandas as pd
    >>> df = pd.DataFrame({"trial_number": [0, 1, 2], "status": ["ok", "ok", "startup_oom"],
    ...                    "output_throughput": [900.0, 1200.0, None], "preemptions": [0.0, 3.0, None],
    ...                    "flag_max_num_seqs": [64, 256, 512]})
    >>> fig = plot_history(df)
    >>> [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    ['ok, no preemption', 'ok, preempted', 'failed', 'best so far (no preemption)']
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from servetune.errors import SpecError, did_you_mean
from servetune.result import TrialStatus

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "MEMORY_PARTS",
    "plot_history",
    "plot_throughput_vs",
    "plot_pareto",
    "plot_memory_breakdown",
    "top_trials",
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

_STARTUP_FAILURES = {s.value for s in TrialStatus if s.is_startup_failure}
_OK = TrialStatus.OK.value


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


def _status(df: pd.DataFrame) -> pd.Series:
    return df["status"].astype(str) if "status" in df.columns else pd.Series(_OK, index=df.index)


def _empty_note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _is_preemption_free(df: pd.DataFrame) -> pd.Series:
    return (_status(df) == _OK) & (_column(df, "preemptions", 0.0).fillna(0.0) == 0)


def plot_history(df: pd.DataFrame, objective: str = "output_throughput", direction: str = "maximize") -> Figure:
    """Optimization history: objective per trial, best-so-far line, failed and preempting trials marked.

    Failed trials have no objective; they sit on the x axis as red crosses.

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
    status = _status(d)
    free = _is_preemption_free(d) & y.notna()
    preempted = (status == _OK) & ~_is_preemption_free(d) & y.notna()
    failed = (status != _OK) | y.isna()
    ax.scatter(x[free], y[free], color="tab:blue", label="ok, no preemption", zorder=3)
    ax.scatter(x[preempted], y[preempted], color="tab:orange", marker="D", label="ok, preempted", zorder=3)
    floor = float(np.nanmin(y)) if y.notna().any() and direction == "minimize" else 0.0
    ax.scatter(x[failed], np.full(int(failed.sum()), floor), color="tab:red", marker="x", label="failed", zorder=3)
    candidates = y.where(free)
    # cummax leaves NaN where a trial is not a candidate; the best so far carries over those.
    best = (candidates.cummax() if direction == "maximize" else candidates.cummin()).ffill()
    if best.notna().any():
        ax.step(x, best, where="post", color="tab:green", label="best so far (no preemption)")
    ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def _check_direction(direction: str, field: str = "direction") -> None:
    if direction not in ("maximize", "minimize"):
        raise SpecError(field, f"expected maximize or minimize, got {direction!r}", "use maximize or minimize")


def plot_throughput_vs(df: pd.DataFrame, x: str = "flag_max_num_seqs", color: str = "preemptions",
                       y: str = "output_throughput") -> Figure:
    """Scatter of ``y`` against a flag or metric, coloured by ``color``; startup failures as crosses.

    Example:
        >>> import pandas as pd
        >>> df = pd.DataFrame({"trial_number": [0, 1], "status": ["ok", "startup_oom"],
        ...                    "flag_max_num_seqs": [64, 1024], "output_throughput": [900.0, None],
        ...                    "preemptions": [2.0, None]})
        >>> fig = plot_throughput_vs(df)
        >>> fig.axes[0].get_xlabel(), len(fig.axes)  # the second axes is the colour bar
        ('flag_max_num_seqs', 2)
    """
    fig = _figure()
    ax = fig.add_subplot()
    ax.set_title(f"{y} vs {x}")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    if df.empty:
        _empty_note(ax, "no trials yet")
        return fig
    _require(df, x, "x")
    xs = _column(df, x)
    ys = _column(df, y)
    status = _status(df)
    measured = (status == _OK) & ys.notna() & xs.notna()
    if measured.any():
        colours = _column(df, color, 0.0).fillna(0.0)[measured]
        points = ax.scatter(xs[measured], ys[measured], c=colours, cmap="plasma", edgecolors="k",
                            linewidths=0.4, zorder=3, label="ok")
        fig.colorbar(points, ax=ax, label=color)
    startup = status.isin(_STARTUP_FAILURES) & xs.notna()
    ax.scatter(xs[startup], np.zeros(int(startup.sum())), marker="x", color="tab:red", s=60,
               label="startup failure", zorder=4)
    other = (status != _OK) & ~status.isin(_STARTUP_FAILURES) & xs.notna()
    if other.any():
        ax.scatter(xs[other], np.zeros(int(other.sum())), marker="v", color="0.5", label="failed at runtime", zorder=4)
    if not (measured.any() or startup.any() or other.any()):
        _empty_note(ax, f"no trial has a value for {x}")
    else:
        ax.legend(loc="best", fontsize="small")
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
    """Trade-off of two metrics of the ok trials, Pareto front highlighted and labelled by trial.

    The default reads as "lower ``x_metric`` (a latency), higher ``y_metric`` (a throughput)".

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
    d = df[(_status(df) == _OK) & _column(df, x_metric).notna() & _column(df, y_metric).notna()]
    if d.empty:
        _empty_note(ax, "no successful trial")
        return fig
    xs = _column(d, x_metric).to_numpy()
    ys = _column(d, y_metric).to_numpy()
    front = _pareto_mask(xs, ys, x_direction == "maximize", y_direction == "maximize")
    ax.scatter(xs[~front], ys[~front], color="0.6", label="dominated", zorder=2)
    ax.scatter(xs[front], ys[front], color="tab:red", label="Pareto front", zorder=3)
    order = np.argsort(xs[front])
    ax.plot(xs[front][order], ys[front][order], color="tab:red", alpha=0.5, drawstyle="steps-post")
    numbers = _column(d, "trial_number").to_numpy()[front]
    for xv, yv, n in zip(xs[front], ys[front], numbers):
        ax.annotate(f"#{int(n)}" if not math.isnan(n) else "?", (xv, yv), textcoords="offset points",
                    xytext=(4, 4), fontsize="small")
    ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def top_trials(df: pd.DataFrame, n: int = 5, objective: str = "output_throughput",
               direction: str = "maximize", preemption_free: bool = True) -> pd.DataFrame:
    """The best ``n`` ok trials by ``objective`` (preemption-free ones only, by default).

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
    mask = (_is_preemption_free(df) if preemption_free else _status(df) == _OK) & _column(df, objective).notna()
    d = df[mask].assign(_objective=_column(df, objective)[mask])
    d = d.sort_values(["_objective", "trial_number"], ascending=[direction == "minimize", True], kind="stable")
    return d.drop(columns="_objective").head(n)


def plot_memory_breakdown(df: pd.DataFrame, top_n: int = 5, objective: str = "output_throughput") -> Figure:
    """Stacked per-GPU startup memory (GiB) of the top trials, the vLLM budget as a black tick.

    When no ok trial carries a breakdown (every trial failed to start), the first ``top_n``
    trials that have one are shown instead, which is what explains a startup OOM.

    Example:
        >>> import pandas as pd
        >>> df = pd.DataFrame({"trial_number": [0], "status": ["startup_oom"], "mem_weights_gib": [1.6],
        ...                    "mem_activation_peak_gib": [1.0], "mem_non_torch_gib": [0.5],
        ...                    "mem_cudagraph_gib": [0.0], "mem_kv_cache_gib": [0.0], "mem_budget_gib": [1.7]})
        >>> fig = plot_memory_breakdown(df)
        >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
        ['#0\\nstartup_oom']
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
    labels = [f"#{int(n)}\n{s}" for n, s in zip(_column(chosen, "trial_number"), _status(chosen))]
    ax.set_xticks(positions, labels)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return fig


# ---------------------------------------------------------------------------------------------
# Report file
# ---------------------------------------------------------------------------------------------

_TABLE_METRICS = ("output_throughput", "preemptions", "ttft_p99_ms", "tpot_p99_ms", "kv_cache_usage_peak",
                  "mem_kv_cache_gib")


def _format_cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, (float, np.floating)):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"
    if isinstance(value, (list, tuple, np.ndarray)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _table_rows(df: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    flags = [c for c in df.columns if str(c).startswith("flag_") and df[c].notna().any()]
    metrics = [c for c in _TABLE_METRICS if c in df.columns]
    columns = [c for c in ("trial_number", "status") if c in df.columns] + flags + metrics
    header = [c.removeprefix("flag_") for c in columns]
    rows = [[_format_cell(v) for v in row] for row in df[columns].itertuples(index=False, name=None)]
    return header, rows


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *(line(r) for r in rows)])


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_report(df: pd.DataFrame, out: Path, title: str, objective: str = "output_throughput",
                 top_n: int = 10) -> Path:
    """Write the study report; returns its path.

    ``out`` ending in ``.html`` gives one self-contained HTML file (PNGs embedded as base64);
    anything else gives Markdown (``.md`` appended if missing) with PNGs in ``<stem>_files/``
    next to it, linked relatively so the folder can be moved or attached as one MLflow artifact.

    Example:
        >>> import pandas as pd, tempfile
        >>> df = pd.DataFrame({"trial_number": [0], "status": ["ok"], "output_throughput": [900.0],
        ...                    "flag_max_num_seqs": [64], "preemptions": [0.0]})
        >>> path = write_report(df, Path(tempfile.mkdtemp()) / "report.md", "demo")
        >>> path.name, "| 0 | ok | 64 | 900.0 | 0 |" in path.read_text()
        ('report.md', True)
    """
    out = Path(out)
    as_html = out.suffix.lower() in (".html", ".htm")
    if not as_html and out.suffix.lower() != ".md":
        out = out.with_name(out.name + ".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Figure] = {"history": plot_history(df, objective)}
    if "flag_max_num_seqs" in df.columns:
        figures["throughput_vs_max_num_seqs"] = plot_throughput_vs(df, "flag_max_num_seqs", y=objective)
    if "ttft_p99_ms" in df.columns and objective in df.columns:
        figures["pareto_ttft_p99"] = plot_pareto(df, "ttft_p99_ms", objective)
    figures["memory_breakdown"] = plot_memory_breakdown(df, objective=objective)

    header, rows = _table_rows(top_trials(df, top_n, objective))
    status_counts = _status(df).value_counts().to_dict() if not df.empty else {}
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(status_counts.items())) or "none"
    generated = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    intro = (f"{len(df)} trials ({counts}). Objective: {objective}, preemption-free trials only. "
             f"Generated {generated}.")

    if as_html:
        images = []
        for name, fig in figures.items():
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=110)
            data = base64.b64encode(buf.getvalue()).decode("ascii")
            images.append(f'<h3>{html.escape(name)}</h3><img alt="{html.escape(name)}" '
                          f'src="data:image/png;base64,{data}">')
        table = _html_table(header, rows) if rows else "<p>No successful preemption-free trial.</p>"
        out.write_text(
            "<!doctype html><html><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;max-width:70em;margin:auto}}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
            "img{max-width:100%}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p>{html.escape(intro)}</p><h2>Top trials</h2>{table}"
            f"<h2>Plots</h2>{''.join(images)}</body></html>\n",
            encoding="utf-8",
        )
        return out

    assets = out.with_name(out.stem + "_files")
    assets.mkdir(exist_ok=True)
    lines = [f"# {title}", "", intro, "", "## Top trials", ""]
    lines.append(_markdown_table(header, rows) if rows else "No successful preemption-free trial.")
    lines += ["", "## Plots", ""]
    for name, fig in figures.items():
        png = assets / f"{name}.png"
        fig.savefig(png, format="png", dpi=110)
        lines += [f"### {name}", "", f"![{name}]({assets.name}/{png.name})", ""]
    out.write_text("\n".join(lines), encoding="utf-8")
    return out
