"""MLflow child runs exactly once per trial across kills and resumes: the whole process group of
``servetune tune`` SIGKILLed mid-study twice, then ``--resume``; and the leftovers such kills make
(a child left RUNNING, a KILLED one, a duplicate, a missing one) reconciled from Optuna's record."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from mlflow import MlflowClient

from _kill import kill_all_started_by
from _study_procs import completed_trials, a100_sim_study

from servetune.records import dataset
from servetune.spec.schema import StudySpec
from servetune.study import run_study

REPO = Path(__file__).resolve().parent.parent


def _spec_dict(tmp: Path, mlflow_uri: str, name: str, trials: int) -> dict[str, Any]:
    data = a100_sim_study(name, trials, tmp, {"mlflow_uri": mlflow_uri, "experiment": f"exp-{name}"})
    data["storage"] = {"optuna_url": f"sqlite:///{tmp}/optuna.db"}
    return data


def _children(client: MlflowClient, experiment: str) -> list[Any]:
    exp = client.get_experiment_by_name(experiment)
    return [r for r in client.search_runs([exp.experiment_id], max_results=2000)
            if r.data.tags.get("servetune.role") == "trial"]


def _finished(storage: str, name: str) -> list[int]:
    study = optuna.load_study(study_name=name, storage=storage)
    return sorted(t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def _assert_once_per_trial(client: MlflowClient, experiment: str, done: list[int]) -> None:
    children = _children(client, experiment)
    assert sorted(int(c.data.tags["servetune.trial_number"]) for c in children) == done
    assert {c.info.status for c in children} <= {"FINISHED", "FAILED"}


def test_leftover_child_runs_are_reconciled_to_one_per_trial(tmp_path: Path, mlflow_server: str) -> None:
    spec = StudySpec.from_dict(_spec_dict(tmp_path, mlflow_server, "reconcile", trials=4))
    run_study(spec, out=io.StringIO())
    client = MlflowClient(mlflow_server)
    children = {int(c.data.tags["servetune.trial_number"]): c for c in _children(client, "exp-reconcile")}
    assert sorted(children) == [0, 1, 2, 3]
    # What kills leave: trial 0's run never written, trial 1's written again but left RUNNING (a
    # driver killed mid-delivery), trial 2's duplicated by an earlier resume and its copy KILLED,
    # trial 3's written twice.
    client.delete_run(children[0].info.run_id)
    for number, status in ((1, None), (2, "KILLED"), (3, "FINISHED")):
        copy = client.create_run(children[number].info.experiment_id, run_name=children[number].info.run_name,
                                 tags=children[number].data.tags)
        if status is not None:
            client.set_terminated(copy.info.run_id, status)
    resumed = run_study(spec.with_overrides(trials=5), resume=True, out=io.StringIO())
    assert resumed.trials_done == 5
    _assert_once_per_trial(client, "exp-reconcile", _finished(spec.storage.optuna_url, "reconcile"))



@pytest.mark.slow
def test_process_group_killed_twice_then_resumed_has_one_child_run_per_trial(tmp_path: Path,
                                                                              mlflow_server: str) -> None:
    spec_path = tmp_path / "study.yaml"
    spec_path.write_text(yaml.safe_dump(_spec_dict(tmp_path, mlflow_server, "killpg", trials=500)))
    env = {"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "servetune", "tune", str(spec_path)]
    db = tmp_path / "optuna.db"
    for round_, extra in enumerate(([], ["--resume"])):
        proc = subprocess.Popen([*cmd, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            target = completed_trials(db) + 3
            deadline = time.monotonic() + 240
            while completed_trials(db) < target and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)
            assert proc.poll() is None, f"round {round_}: the driver ended early ({proc.returncode})"
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            kill_all_started_by(proc.pid)
    done = completed_trials(db)
    resumed = subprocess.run([*cmd, "--resume", "--trials", str(done + 2)], capture_output=True, text=True, env=env,
                             timeout=600)
    assert resumed.returncode in (0, 1), resumed.stderr[-2000:]
    finished = _finished(f"sqlite:///{db}", "killpg")
    assert len(finished) == done + 2
    _assert_once_per_trial(MlflowClient(mlflow_server), "exp-killpg", finished)
    rows = dataset.read_trials(tmp_path / "dataset", study="killpg")
    assert sorted(rows["trial_number"]) == finished
