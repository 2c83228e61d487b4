"""Report figures and files, from a trials frame that went through the real Parquet dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from servetune.records.dataset import append_trials, read_trials, trial_row
from servetune.errors import SpecError
from servetune.records.outcome import TrialOutcome, classify_frame
from servetune.records.report import (
    param_importances, plot_history, plot_importance, plot_memory_breakdown, plot_pareto, plot_slice,
    plot_throughput_vs, searched_flags, top_trials, winner, write_report,
)
from servetune.records.trial_record import Prediction, Screen, TrialRecord
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
    (TrialStatus.PRUNED, 2048, None, None, None, 0.0),  # 6: the planner predicted a startup OOM
    (TrialStatus.PRUNED, 32, None, None, None, 0.0),  # 7: the calibrated simulator screened it out
]


def _record(i: int, study: str = "s", gpu: str = "H200", scale: float = 1.0) -> TrialRecord:
    """A trial as the driver records it (TrialRecord -> dataset row), so the plots read what a study writes."""
    st, seqs, thr, pre, ttft, kv = TRIALS[i]
    result = _result(st, None if thr is None else thr * scale, pre, ttft, kv)
    prediction = Prediction("startup_oom", 30.0, "lower max_num_seqs") if i == 6 else None
    screen = Screen("sim_screen: throughput 400 tok/s predicted", 400.0, 0.0) if i == 7 else None
    if screen is not None:
        result.cause = screen.reason
    return TrialRecord(study, i, {"max_num_seqs": seqs}, result, -1.0 if thr is None else thr, gpu_type=gpu,
                       model="llama-3.1-8b", backend="sim", vllm_version="0.26.0",
                       prediction=prediction, screen=screen, serve_model="meta-llama/Llama-3.1-8B-Instruct")


@pytest.fixture
def trials_df(tmp_path: Path) -> pd.DataFrame:
    append_trials(tmp_path / "ds", [_record(i).dataset_row() for i in range(len(TRIALS))])
    return read_trials(tmp_path / "ds")


def _png(fig: Figure, path: Path) -> int:
    fig.savefig(path, format="png")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return len(data)


def _legend(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def _points(fig: Figure, label: str) -> list[list[float]]:
    """The points of the scatter whose legend entry is ``label``."""
    for coll in fig.axes[0].collections:
        if coll.get_label() == label:
            return np.asarray(coll.get_offsets()).tolist()
    raise AssertionError(f"no series {label!r} in {[c.get_label() for c in fig.axes[0].collections]}")


def test_every_trial_is_classified_by_what_happened(trials_df: pd.DataFrame) -> None:
    classes = dict(zip(trials_df["trial_number"], classify_frame(trials_df)))
    assert classes == {0: TrialOutcome.SERVED_CLEAN, 1: TrialOutcome.SERVED_PREEMPTING, 2: TrialOutcome.STARTUP_FAILED,
                       3: TrialOutcome.SERVED_CLEAN, 4: TrialOutcome.RUNTIME_FAILED, 5: TrialOutcome.SERVED_CLEAN,
                       6: TrialOutcome.PRUNED, 7: TrialOutcome.SCREENED}
    # The dataset column and the MLflow tag say the same as the frame's classification.
    assert dict(zip(trials_df["trial_number"], trials_df["outcome"])) == {n: c.value for n, c in classes.items()}
    assert [_record(i).mlflow_tags()["servetune.outcome"] for i in range(len(TRIALS))] == \
        [classes[i].value for i in range(len(TRIALS))]


def test_history_marks_each_class_and_best_so_far(trials_df: pd.DataFrame, tmp_path: Path) -> None:
    fig = plot_history(trials_df)
    assert _legend(fig) == ["served, no preemption", "served, preempted", "failed at startup", "pruned before launch",
                            "screened by the simulator", "failed while serving", "best so far (no preemption)"]
    assert [p[0] for p in _points(fig, "served, no preemption")] == [0, 3, 5]
    assert _points(fig, "served, preempted") == [[1, 1500]]
    assert _points(fig, "failed at startup") == [[2, 0]]
    assert _points(fig, "pruned before launch") == [[6, 0]]  # not drawn as a failure: it never launched
    assert _points(fig, "screened by the simulator") == [[7, 0]]
    best = fig.axes[0].lines[0].get_ydata()
    assert np.allclose(np.asarray(best, dtype=float), [900, 900, 900, 1200, 1200, 1200, 1200, 1200], equal_nan=True)
    assert _png(fig, tmp_path / "h.png") > 5000


def test_throughput_vs_flag(trials_df: pd.DataFrame, tmp_path: Path) -> None:
    fig = plot_throughput_vs(trials_df, x="flag_max_num_seqs")
    assert sorted(p[0] for p in _points(fig, "served, no preemption")) == [64, 96, 128]
    assert _points(fig, "served, preempted") == [[256, 1500]]
    assert _points(fig, "failed at startup") == [[1024, 0]]
    assert _points(fig, "failed while serving") == [[512, 0]]
    assert _points(fig, "pruned before launch") == [[2048, 0]]  # a prediction, not a runtime failure
    assert _points(fig, "screened by the simulator") == [[32, 0]]
    assert _png(fig, tmp_path / "t.png") > 5000
    with pytest.raises(SpecError, match="flag_max_num_seq.*did you mean"):
        plot_throughput_vs(trials_df, x="flag_max_num_seq")


def test_pareto_front_is_preemption_free(trials_df: pd.DataFrame, tmp_path: Path) -> None:
    fig = plot_pareto(trials_df, "ttft_p99_ms", "output_throughput")
    labels = sorted(t.get_text() for t in fig.axes[0].texts)
    # #1 is faster than every other trial but preempts: drawn, said so, never on the front.
    assert labels == ["#0", "#3"]  # #5 is dominated by #3; failures are not candidates
    assert "served, preempted (not a candidate)" in _legend(fig)
    assert _points(fig, "served, preempted (not a candidate)") == [[90, 1500]]
    assert _png(fig, tmp_path / "p.png") > 5000


def test_memory_breakdown_of_top_trials(trials_df: pd.DataFrame, tmp_path: Path) -> None:
    fig = plot_memory_breakdown(trials_df, top_n=2)
    ax = fig.axes[0]
    # The fastest served trial preempts: its bar says so instead of "ok".
    assert [t.get_text() for t in ax.get_xticklabels()] == ["#1\npreempted", "#3\nno preemption"]
    kv_bars = ax.containers[-1]
    assert [round(b.get_height(), 6) for b in kv_bars] == [66.0, 60.0]
    assert [round(b.get_y(), 6) for b in kv_bars] == [round(1.59 + 1.2 + 0.4 + 0.35, 6)] * 2
    assert _png(fig, tmp_path / "m.png") > 5000
    # Every trial failed to start: the breakdowns of the failures are what explain it.
    failed_only = trials_df[trials_df["status"] != "ok"]
    labels = [t.get_text() for t in plot_memory_breakdown(failed_only).axes[0].get_xticklabels()]
    assert labels[:2] == ["#2\nstartup failed", "#4\nfailed serving"]


def test_top_trials_skip_preempting(trials_df: pd.DataFrame) -> None:
    assert top_trials(trials_df, 3)["trial_number"].tolist() == [3, 5, 0]
    assert top_trials(trials_df, 1, preemption_free=False)["trial_number"].tolist() == [1]


def test_winner_is_the_best_clean_trial_with_its_serve_model(trials_df: pd.DataFrame) -> None:
    best = winner(trials_df)
    assert best is not None and best.trial_number == 3
    assert best.command == "vllm serve meta-llama/Llama-3.1-8B-Instruct --max-num-seqs 128"
    assert "max-num-seqs: 128" in best.config_yaml
    assert winner(trials_df[trials_df["status"] != "ok"]) is None


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
    # The winner's command is at the top of the study's section, before any table or plot.
    command = "vllm serve meta-llama/Llama-3.1-8B-Instruct --max-num-seqs 128"
    assert text.index(command) < text.index("### Top trials")
    assert "Winner: trial #3, 1,200 output tok/s" in text
    assert ("8 trials: 3 served, no preemption, 1 served, preempted, 1 failed at startup, 1 pruned before launch, "
            "1 screened by the simulator, 1 failed while serving.") in text
    table = [line for line in text.splitlines() if line.startswith("| ") and "max_num_seqs" in line]
    assert table[0].startswith("| trial_number | max_num_seqs | output_throughput | preemptions")
    rows = text.split("### Top trials")[1].split("### Plots")[0]
    assert [r.split(" | ")[0] for r in rows.splitlines() if r.startswith("| ") and "---" not in r][1:] == \
        ["| 3", "| 5", "| 0"]  # best first, no preempting
    pngs = sorted((tmp_path / "out" / "report_files").glob("*.png"))
    assert [p.name for p in pngs] == ["memory_breakdown.png", "optimization_history.png", "param_importance.png",
                                      "pareto_front.png", "slice.png", "throughput_vs_max_num_seqs.png"]
    for png in pngs:
        assert f"](report_files/{png.name})" in text and png.stat().st_size > 5000
    html = write_report(trials_df, tmp_path / "report.html", "H200 <study>")
    page = html.read_text()
    assert "<title>H200 &lt;study&gt;</title>" in page and command in page
    assert page.count("data:image/png;base64,") == 6 and html.stat().st_size > 40000


def test_the_api_servers_busy_share_is_a_column_where_it_was_recorded(trials_df: pd.DataFrame,
                                                                     tmp_path: Path) -> None:
    """A trial that counted its API server's CPU shows how busy it was (1.0: it set the pace); a
    study recorded before, with no such figure, gets no empty column."""
    assert "api_server_busy" not in write_report(trials_df, tmp_path / "old", "s").read_text()
    records = [_record(i) for i in range(len(TRIALS))]
    for record, cpu in zip(records, (9.0, 20.0, None, 19.0)):
        record.result.duration_s, record.result.api_server_cpu_s = 20.0, cpu
    append_trials(tmp_path / "ds2", [r.dataset_row() for r in records])
    text = write_report(read_trials(tmp_path / "ds2"), tmp_path / "new", "s").read_text()
    header = next(line for line in text.split("### Top trials")[1].splitlines() if line.startswith("| trial_number"))
    assert header.split(" | ")[-2] == "api_server_busy"
    best = next(line for line in text.split("### Top trials")[1].splitlines() if line.startswith("| 3 "))
    assert " | 0.95 | " in best  # 19 CPU-s over a 20 s window


def test_report_of_several_studies_keeps_them_apart(tmp_path: Path) -> None:
    # The same trials on two GPUs; the A100-80GB ones are faster, but belong to another study.
    rows = [_record(i, "small", "A100-40GB").dataset_row() for i in range(len(TRIALS))]
    rows += [_record(i, "big", "A100-80GB", scale=2.0).dataset_row() for i in range(len(TRIALS))]
    append_trials(tmp_path / "ds", rows)
    text = write_report(read_trials(tmp_path / "ds"), tmp_path / "r.md", "two GPUs").read_text()
    overview = text.split("## Studies")[1].split("###")[0]
    assert "| big | llama-3.1-8b | A100-80GB | 8 | 3 | 2,400.0 | #3 |" in overview
    assert "| small | llama-3.1-8b | A100-40GB | 8 | 3 | 1,200.0 | #3 |" in overview
    big, small = text.split("## Study big: llama-3.1-8b on A100-80GB")[1].split("## Study small: llama-3.1-8b on A100-40GB")
    assert "Winner: trial #3, 2,400 output tok/s" in big and "2,400" not in small
    assert "Winner: trial #3, 1,200 output tok/s" in small
    assert len(list((tmp_path / "r_files").glob("big-*.png"))) == 6
    assert len(list((tmp_path / "r_files").glob("small-*.png"))) == 6


def test_importance_and_slice_of_the_searched_flags(tmp_path: Path) -> None:
    # Throughput decided by gpu_memory_utilization alone; max_num_seqs varies at random; the
    # fixed max_model_len is not a searched flag. A pruned trial has no figure and is left out.
    import random

    rng = random.Random(3)
    rows = []
    for i in range(24):
        u = round(rng.uniform(0.5, 0.95), 2)
        flags = {"gpu_memory_utilization": u, "max_num_seqs": rng.choice([32, 64, 128, 256]), "max_model_len": 4096}
        rows.append(trial_row("s", i, flags, TrialResult(TrialStatus.OK, output_throughput=4000 * u, preemptions=0),
                              "H200", "m"))
    rows.append(trial_row("s", 24, {"gpu_memory_utilization": 0.3, "max_num_seqs": 32, "max_model_len": 4096},
                          TrialResult(TrialStatus.PRUNED, cause="predicted startup_oom"), "H200", "m"))
    append_trials(tmp_path / "ds", rows)
    df = read_trials(tmp_path / "ds")
    assert searched_flags(df) == ["flag_gpu_memory_utilization", "flag_max_num_seqs"]
    found = param_importances(df)
    assert list(found) == ["gpu_memory_utilization", "max_num_seqs"] and found["gpu_memory_utilization"] > 0.8
    assert abs(sum(found.values()) - 1.0) < 1e-6
    assert param_importances(df.head(2)) == {}  # too few served trials to say
    fig = plot_slice(df)
    assert [ax.get_xlabel() for ax in fig.axes] == ["gpu_memory_utilization", "max_num_seqs"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["served, no preemption", "pruned before launch"]
    assert _png(fig, tmp_path / "slice.png") > 5000
    bars = plot_importance(df).axes[0]
    assert [t.get_text() for t in bars.get_yticklabels()] == ["max_num_seqs", "gpu_memory_utilization"]
