"""A ``--resume`` of a study that has nothing left to do runs nothing, starts nothing and writes
nothing (real Optuna SQLite, the local MLflow store, the local trial pool); one with trials left,
or with a trial told after the last finish, still runs."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow import MlflowClient

from _study_procs import a100_sim_study

from servetune.study import _driver as study_driver
from servetune.study import _recorder as study_recorder
from servetune.errors import SpecError
from servetune.spec.schema import StudySpec
from servetune.study import FINISHED, run_study


def _spec(tmp_path: Path, trials: int) -> StudySpec:
    data: dict[str, Any] = a100_sim_study("noop", trials, tmp_path, {"experiment": "exp-noop"})
    data["workload"] = {**data["workload"], "num_requests": 24, "concurrency": 24}
    return StudySpec.from_dict(data, cwd=tmp_path)


def _child_runs(spec: StudySpec) -> int:
    client = MlflowClient(spec.tracking.mlflow_uri)
    exp = client.get_experiment_by_name("exp-noop")
    return sum("mlflow.parentRunId" in r.data.tags for r in client.search_runs([exp.experiment_id], max_results=500))


def test_a_finished_study_resumed_runs_nothing_and_one_with_a_larger_budget_runs_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = run_study(_spec(tmp_path, 3), out=io.StringIO())
    assert (first.trials_done, first.trials_run) == (3, 3) and first.best_command
    stored = optuna.load_study(study_name="noop", storage=_spec(tmp_path, 3).storage.optuna_url).user_attrs[FINISHED]
    assert stored["finished"] == 3 and stored["parent_run_id"] == first.parent_run_id

    with pytest.raises(SpecError, match="already has 3 trials"):  # refused without --resume
        run_study(_spec(tmp_path, 3), out=io.StringIO())

    def no_pool(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a no-op resume started a trial pool")

    def no_tracker(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a no-op resume opened MLflow")

    with monkeypatch.context() as m:
        m.setattr(study_driver, "start_pool", no_pool)
        m.setattr(study_recorder, "StudyTracker", no_tracker)
        out = io.StringIO()
        again = run_study(_spec(tmp_path, 3), resume=True, out=out)
    assert again.trials_run == 0 and again.trials_done == 3 and "no trial ran" in out.getvalue()
    assert (again.best_number, again.best_command) == (first.best_number, first.best_command)
    assert (again.experiment_id, again.parent_run_id) == (first.experiment_id, first.parent_run_id)
    assert _child_runs(_spec(tmp_path, 3)) == 3

    more = run_study(_spec(tmp_path, 4), resume=True, out=io.StringIO())
    assert (more.trials_done, more.trials_run) == (4, 1)
    assert _child_runs(_spec(tmp_path, 4)) == 4


def test_a_trial_told_after_the_last_finish_makes_the_resume_run(tmp_path: Path) -> None:
    """A driver killed after telling a trial but before writing its records: the finish record
    counts fewer trials than Optuna holds, so the resume reconciles instead of doing nothing."""
    spec = _spec(tmp_path, 2)
    run_study(spec, out=io.StringIO())
    study = optuna.load_study(study_name="noop", storage=spec.storage.optuna_url)
    told = study.ask({"gpu_memory_utilization": optuna.distributions.FloatDistribution(0.2, 0.95, step=0.05)})
    told.set_user_attr("status", "ok")
    study.tell(told, state=optuna.trial.TrialState.FAIL)  # finished, not recorded by any driver
    run_study(spec, resume=True, out=io.StringIO())
    assert optuna.load_study(study_name="noop", storage=spec.storage.optuna_url).user_attrs[FINISHED]["finished"] == 3
