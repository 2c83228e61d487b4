"""The retried Optuna storage after a Ctrl-C cut one of its statements (servetune.records._retry)."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from sqlalchemy.engine import default

from servetune.records._storage import open_storage


def test_a_statement_cut_by_ctrl_c_does_not_keep_the_sqlite_file_locked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A second Ctrl-C between SQLite's write and SQLAlchemy's reading of its result leaves the cursor in a
    # reference cycle that holds the write lock; until a full collection, every write of this process
    # found the file locked and the driver's closing steps waited out the retry's 60 s each.
    storage = open_storage(f"sqlite:///{tmp_path / 'optuna.db'}")
    assert storage is not None
    study_id = storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "cut")
    told, running = storage.create_new_trial(study_id), storage.create_new_trial(study_id)
    read_result = default.DefaultExecutionContext._setup_result_proxy
    cut: list[bool] = []

    def interrupted(self: default.DefaultExecutionContext) -> object:
        if not cut:
            cut.append(True)
            raise KeyboardInterrupt
        return read_result(self)

    monkeypatch.setattr(default.DefaultExecutionContext, "_setup_result_proxy", interrupted)
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection may free the cursor by chance
    try:
        with pytest.raises(KeyboardInterrupt):
            storage.set_trial_state_values(told, TrialState.COMPLETE, [1.0])
        assert cut
        with caplog.at_level(logging.WARNING, logger="servetune.records._retry"):
            assert storage.set_trial_state_values(running, TrialState.FAIL)
    finally:
        if was_enabled:
            gc.enable()
    retries = [r.getMessage() for r in caplog.records if r.name == "servetune.records._retry"]
    assert len(retries) == 1, retries  # one wait for SQLite's lock (Optuna words it as a failed commit), then written
    assert storage.get_trial(running).state == TrialState.FAIL
