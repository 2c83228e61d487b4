"""The driver says what happens only through its progress callbacks (``run_study(progress=...)``):
a real simulated study (local trial pool, Optuna SQLite, the local MLflow store) with a confirmation
repeat and the headroom, run with callbacks that record the events, writes nothing to the terminal."""

from __future__ import annotations

import os
import tty
from pathlib import Path
from typing import Any

import pytest

from _study_procs import a100_sim_study

from servetune.search.confirm import Choice
from servetune.search.headroom import StudyHeadroom
from servetune.spec.schema import StudySpec
from servetune.study import StudyOutcome, StudyProgress, TerminalProgress, run_study


class Events(StudyProgress):
    """Keeps the name of each event (and the last counts shown)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.last: StudyOutcome | None = None

    def started(self, *args: Any) -> None:
        self.names.append("started")

    def status(self, outcome: StudyOutcome, running: int, force: bool = False, waiting: int = 0) -> None:
        self.names.append("status")
        self.last = outcome

    def confirming(self, top: Any, held: Any, repeats: int, measured: int) -> None:
        self.names.append("confirming")

    def confirmed(self, choice: Choice) -> None:
        self.names.append("confirmed")

    def headroom(self, result: StudyHeadroom, seconds: float) -> None:
        self.names.append("headroom")

    def closed(self, outcome: StudyOutcome) -> None:
        self.names.append("closed")
        self.last = outcome


def test_a_study_speaks_only_through_its_progress_callbacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data: dict[str, Any] = a100_sim_study("progress", 3, tmp_path, {"experiment": "exp-progress"})
    data["workload"] = {**data["workload"], "num_requests": 24, "concurrency": 24}
    data["budget"] = {**data["budget"], "confirm_top": 1, "confirm_repeats": 1}
    events = Events()
    outcome = run_study(StudySpec.from_dict(data, cwd=tmp_path), progress=events)
    assert capsys.readouterr().out == ""  # nothing printed beside the callbacks
    assert outcome.trials_done == 3 and outcome.confirmation is not None
    names = events.names
    assert names[0] == "started" and names[-1] == "closed" and names.count("closed") == 1
    assert names.count("confirming") == 1 and names.count("confirmed") == 1 and "headroom" in names
    assert names.index("confirming") > max(i for i, n in enumerate(names[:-1]) if n == "status")
    assert events.last is outcome


def test_the_terminal_lines_rewrite_one_status_line_on_a_terminal() -> None:
    master, slave = os.openpty()  # a real terminal, raw: what is written is what is read
    tty.setraw(slave)
    try:
        with os.fdopen(slave, "w", closefd=True) as out:
            progress = TerminalProgress(out, total=5)
            progress.status(StudyOutcome("s", trials_done=2, ok=2), running=1)
            progress.repeat_lost(1, 4, "node lost")
            progress.closed(StudyOutcome("s", trials_done=5, ok=5))
        chunks = []
        while True:  # a pty hands back what was written in pieces; the closed side ends it (EIO)
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        text = b"".join(chunks).decode()
    finally:
        os.close(master)
    assert text == ("\rtrials 2/5 | running 1 | ok 2 | preempting 0 | startup failed 0 | pruned 0 | other failed 0"
                    " | best -\033[K"
                    "\r\033[Kservetune: repeat 1 of trial #4 lost to an infrastructure failure: node lost\n"
                    "\rtrials 5/5 | running 0 | ok 5 | preempting 0 | startup failed 0 | pruned 0 | other failed 0"
                    " | best -\033[K\n")
