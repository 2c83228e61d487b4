"""Holding published runs' judgements today against their recorded comparison
(``benchmarks/results/published_runs_*.json``, ``published_runs.py --compare --json``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from published_runs import Judged, PublishedRun, judge, recorded_runs


def assert_as_recorded(judged: Judged, recorded: Mapping[str, Any], run_id: str) -> None:
    """``judged``'s headline and TTFT errors are the recorded run's (``error_pct``, ``ttft_error_pct``),
    within a point."""
    assert judged.headline_error is not None and judged.ttft_error is not None, run_id
    assert 100 * judged.headline_error == pytest.approx(recorded["error_pct"], abs=1.0), run_id
    assert 100 * judged.ttft_error == pytest.approx(recorded["ttft_error_pct"], abs=1.0), run_id


def all_as_recorded(runs: Sequence[PublishedRun], results: Path) -> dict[str, tuple[Judged, dict[str, Any]]]:
    """Every run of a fixture file judged today, none failing, each as ``results`` recorded it
    (:func:`assert_as_recorded`); ``results`` holds exactly these runs. By id: the judgement and the record."""
    recorded = recorded_runs(results)
    assert set(recorded) == {r.id for r in runs}
    out = {}
    for run in runs:
        judged, rec = judge(run), recorded[run.id]
        assert judged.failure is None and rec["error_pct"] is not None, run.id
        assert_as_recorded(judged, rec, run.id)
        out[run.id] = (judged, rec)
    return out
