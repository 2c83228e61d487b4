"""Report figures and files, from a trials frame that went through the real Parquet dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from servetune.records.dataset import append_trials, read_trials, trial_row
from servetune.errors import SpecError
from servetune.records.report import (
    plot_history, plot_memory_breakdown, plot_pareto, plot_throughput_vs, top_trials, write_report,
)
from servetune.result import LatencySummary, MemoryBreakdown, TrialResult, TrialStatus

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result(status: TrialStatus, throughput: float | None, preemptions: int | None, ttft_p99: float | None,
            kv_gib: float) -> TrialResult:
    lat = None if ttft_p99 is None else LatencySummary(ttft_p99 / 2, ttft_p99 / 2, ttft_p99 * 0.8, ttft_p99)
    return TrialResult(status=status, output_throughput=throughput, preemptions=preemptions, ttft_ms=lat,
                       memory=MemoryBreakdown(139.8, 69.9, 1.59, 1.2, 0.4, 0.35, kv_gib),
                       cause=None if status is TrialStatus.OK else "failed")


# trial: (status, max_num_seqs, throughput, preemptions, ttft_p99, kv_gib)
TRIALS = [
    (TrialStatus.OK, 64, 900.0, 0, 40.0, 66.0),
    (TrialStatus.OK, 256, 1500.0, 7, 90.0, 66.0),  # fastest, but preempts: never "best"
    (TrialStatus.STARTUP_OOM, 1024, None, None, None, 0.0),
    (TrialStatus.OK, 128, 1200.0, 0, 60.0, 60.0),
    (TrialStatus.RUNTIME_OOM, 512, None, None, None, 30.0),
    (TrialStatus.OK, 96, 1000.0, 0, 80.0, 62.0),  # dominated by trial 3 (slower and higher TTFT)
]


@pytest.fixture
def trials_df(tmp_path: Path) -> pd.DataFrame:
    rows = [trial_row("s", i, {"max_num_seqs": seqs}, _result(st, thr, pre, ttft, kv), "H200", "org/m")
            for i, (st, seqs, thr, pre, ttft, kv) in enumerate(TRIALS)]
    append_trials(tmp_path / "ds", rows)
    return read_trials(tmp_path / "ds")


def _png(fig: Figure, path: Path) -> int:
    fig.savefig(path, format="png")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return len(data)


def test_history_marks_failures_and_best_so_far(trials_df: pd.DataFrame, tmp_path: Path) -> None:
    fig = plot_history(trials_df)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["ok, no preemption", "ok, preempted", "failed", "best so far (no preemption)"]
    free, preempted, failed = (c.get_offsets() for c in ax.collections[:3])
    assert free[:, 0].tolist() == [0, 3, 5] and preempted[:, 0].tolist() == [1]
    assert failed[:, 0].tolist() == [2, 4] and failed[:, 1].tolist() == [0, 0]
    best = ax.lines[0].get_ydata()
    assert np.allclose(np.asarray(best, dtype=float), [900, 900, 900, 1200, 1200, 1200], equal_nan=True)
    assert _png(fig, tmp_path / "h.png") > 5000


def test_throughput_vs_flag(trials_df: pd.DataFrame, tmp_path: Path) -> None:
    fig = plot_throughput_vs(trials_df, x="flag_max_num_seqs", color="preemptions")
    ax = fig.axes[0]
    ok, startup = ax.collections[0].get_offsets(), ax.collections[1].get_offsets()
    assert sorted(ok[:, 0].tolist()) == [64, 96, 128, 256]
    assert startup.tolist() == [[1024, 0]]
    assert ax.collections[2].get_offsets().tolist() == [[512, 0]]  # runtime failure, its own marker
    assert fig.axes[1].get_ylabel() == "preemptions"  # the colour bar
    assert _png(fig, tmp_path / "t.png") > 5000
    with pytest.raises(SpecError, match="flag_max_num_seq.*did you mean"):
        plot_throughput_vs(trials_df, x="flag_max_num_seq")


def test_pareto_front(trials_df: pd.DataFrame, tmp_path: Path) -> None:
    fig = plot_pareto(trials_df, "ttft_p99_ms", "output_throughput")
    labels = sorted(t.get_text() for t in fig.axes[0].texts)
    assert labels == ["#0", "#1", "#3"]  # #5 is dominated by #3; failures are not candidates
    assert _png(fig, tmp_path / "p.png") > 5000


def test_memory_breakdown_of_top_trials(trials_df: pd.DataFrame, tmp_path: Path) -> None:
    fig = plot_memory_breakdown(trials_df, top_n=2)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["#1\nok", "#3\nok"]
    kv_bars = ax.containers[-1]
    assert [round(b.get_height(), 6) for b in kv_bars] == [66.0, 60.0]
    assert [round(b.get_y(), 6) for b in kv_bars] == [round(1.59 + 1.2 + 0.4 + 0.35, 6)] * 2
    assert _png(fig, tmp_path / "m.png") > 5000
    # Every trial failed to start: the breakdowns of the failures are what explain it.
    failed_only = trials_df[trials_df["status"] != "ok"]
    labels = [t.get_text() for t in plot_memory_breakdown(failed_only).axes[0].get_xticklabels()]
    assert labels == ["#2\nstartup_oom", "#4\nruntime_oom"]


def test_top_trials_skip_preempting(trials_df: pd.DataFrame) -> None:
    assert top_trials(trials_df, 3)["trial_number"].tolist() == [3, 5, 0]
    assert top_trials(trials_df, 1, preemption_free=False)["trial_number"].tolist() == [1]


def test_empty_frame_renders(tmp_path: Path) -> None:
    empty = read_trials(tmp_path / "none")
    for i, fig in enumerate([plot_history(empty), plot_throughput_vs(empty), plot_memory_breakdown(empty),
                             plot_pareto(empty, "ttft_p99_ms", "output_throughput")]):
        assert _png(fig, tmp_path / f"e{i}.png") > 1000
    path = write_report(empty, tmp_path / "empty.md", "nothing yet")
    assert "No successful preemption-free trial." in path.read_text()


def test_write_markdown_and_html_reports(trials_df: pd.DataFrame, tmp_path: Path) -> None:
    md = write_report(trials_df, tmp_path / "out" / "report", "H200 study")
    assert md == tmp_path / "out" / "report.md"
    text = md.read_text()
    assert text.startswith("# H200 study\n")
    assert "6 trials (ok: 4, runtime_oom: 1, startup_oom: 1)" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| trial_number | status | max_num_seqs | output_throughput | preemptions")
    assert [row.split(" | ")[0] for row in table[2:]] == ["| 3", "| 5", "| 0"]  # best first, no preempting
    pngs = sorted((tmp_path / "out" / "report_files").glob("*.png"))
    assert [p.name for p in pngs] == ["history.png", "memory_breakdown.png", "pareto_ttft_p99.png",
                                      "throughput_vs_max_num_seqs.png"]
    for png in pngs:
        assert f"](report_files/{png.name})" in text and png.stat().st_size > 5000
    html = write_report(trials_df, tmp_path / "report.html", "H200 <study>")
    page = html.read_text()
    assert "<title>H200 &lt;study&gt;</title>" in page
    assert page.count("data:image/png;base64,") == 4 and html.stat().st_size > 40000
