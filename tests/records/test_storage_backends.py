"""One storage interface, one suite per backend: the study contract on SQLite and on PostgreSQL.

Each test runs once per backend: the Optuna storage is a SQLite file or a fresh database on the
session's real PostgreSQL server (``postgres_server``), and MLflow is the SQLite-backed or the
PostgreSQL-backed ``mlflow server``. Same study, same assertions: trials run and are told, an
interrupted study resumed with ``resume=True`` keeps its finished trials and adds the rest, the
best is the best feasible trial, and MLflow holds one parent and one child per told trial.
Real parts only: local Ray with logical GPUs, the simulated engine, real servers.
"""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import Any

import optuna
import pytest
from _postgres import PostgresServer
from mlflow.tracking import MlflowClient

from servetune.records import dataset
from servetune.records._storage import RetryingStorage, open_storage
from servetune.records.trial_attrs import defer_trial_attrs, set_trial_attrs
from servetune.result import TrialResult
from servetune.spec.schema import StudySpec
from servetune.study import run_study

BACKENDS = ("sqlite", "postgresql")
_db_names = (f"contract_{i}" for i in itertools.count())


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """``{"name", "optuna_url", "mlflow_uri"}`` for one backend."""
    if request.param == "sqlite":
        return {"name": "sqlite", "optuna_url": f"sqlite:///{tmp_path}/optuna.db",
                "mlflow_uri": request.getfixturevalue("mlflow_server")}
    pg: PostgresServer = request.getfixturevalue("postgres_server")
    return {"name": "postgresql", "optuna_url": pg.create_database(next(_db_names)),
            "mlflow_uri": request.getfixturevalue("mlflow_server_pg")}


def _spec(tmp: Path, backend: dict[str, str], name: str, trials: int, parallel: int = 2) -> StudySpec:
    return StudySpec.from_dict({
        "name": name,
        "model": "llama-3.1-8b",
        "gpu": {"type": "A100-40GB", "count": 2},
        "workload": {"input_len": 256, "output_len": 128, "num_requests": 32, "concurrency": 16, "seed": 1},
        "objective": {"metric": "output_throughput"},
        "constraints": {"max_preemptions": 0},
        "search_space": {"params": {
            "gpu_memory_utilization": {"type": "float", "low": 0.6, "high": 0.95, "step": 0.05},
            "max_num_seqs": {"type": "categorical", "choices": [16, 32, 64, 128]},
        }},
        "fixed_flags": {"max_model_len": 2048},
        "budget": {"trials": trials, "parallel": parallel},
        "backend": "sim",
        "prescreen": False,
        "seed": 7,
        "tracking": {"mlflow_uri": backend["mlflow_uri"], "experiment": f"exp-{name}"},
        "storage": {"optuna_url": backend["optuna_url"]},
        "output": {"runs_dir": str(tmp / "runs"), "dataset_dir": str(tmp / "dataset")},
    })


def test_the_storage_is_the_retrying_one_for_every_url(backend: dict[str, str]) -> None:
    storage = open_storage(backend["optuna_url"])
    assert isinstance(storage, RetryingStorage)
    study = optuna.create_study(study_name="probe", storage=storage, load_if_exists=True)
    trial = study.ask()
    study.tell(trial, 1.0)
    again = optuna.load_study(study_name="probe", storage=backend["optuna_url"])  # plain Optuna reads it
    assert [t.value for t in again.get_trials()] == [1.0]


def test_a_trials_attributes_are_written_in_one_call_with_those_kept_since_it_was_asked(
        backend: dict[str, str]) -> None:
    study = optuna.create_study(study_name="attrs", storage=open_storage(backend["optuna_url"]))
    trial = study.ask()
    defer_trial_attrs(trial, {"flags": {"max_num_seqs": 64}, "status": "asked"})
    assert trial.user_attrs["flags"] == {"max_num_seqs": 64} and study.get_trials()[0].user_attrs == {}
    set_trial_attrs(trial, {"status": "ok", "metrics": {"tok_s": 1.5}}, {"startup": -1.0, "preemptions": 2.0})
    set_trial_attrs(trial, {"status": "crashed"}, {"preemptions": 0.0})  # keys it holds are replaced
    study.tell(trial, 1.0)
    stored = optuna.load_study(study_name="attrs", storage=backend["optuna_url"]).trials[0]  # plain Optuna
    assert stored.user_attrs == {"flags": {"max_num_seqs": 64}, "status": "crashed", "metrics": {"tok_s": 1.5}}
    assert stored.constraints == {"startup": -1.0, "preemptions": 0.0}
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):  # a told trial's attributes are fixed
        set_trial_attrs(trial, {"status": "ok"})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_study_interrupted_then_resumed_keeps_finished_trials_and_picks_the_best(
        backend: dict[str, str], tmp_path: Path) -> None:
    name = f"contract-{backend['name']}"
    # One trial at a time until the interrupt: the driver tells every result of a batch before it
    # writes their records and calls on_result, so with two in flight a fourth trial finishing in
    # the same batch as the third would be told (and kept) before the callback interrupts.
    first = _spec(tmp_path, backend, name, trials=6, parallel=1)

    def stop_after_three(number: int, flags: dict[str, Any], result: TrialResult) -> None:
        told = [t for t in optuna.load_study(study_name=name, storage=backend["optuna_url"]).get_trials()
                if t.state == optuna.trial.TrialState.COMPLETE]
        if len(told) >= 3:
            raise KeyboardInterrupt  # what Ctrl-C / SIGTERM does at the next safe point

    interrupted = run_study(first, out=io.StringIO(), on_result=stop_after_three)
    study = optuna.load_study(study_name=name, storage=backend["optuna_url"])
    kept = {t.number: t.values for t in study.get_trials() if t.state == optuna.trial.TrialState.COMPLETE}
    assert interrupted.trials_done == len(kept) == 3
    assert optuna.trial.TrialState.RUNNING not in {t.state for t in study.get_trials()}

    resumed = run_study(_spec(tmp_path, backend, name, trials=5), resume=True, out=io.StringIO())
    study = optuna.load_study(study_name=name, storage=backend["optuna_url"])
    trials = study.get_trials()
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert resumed.trials_done == len(complete) == 5
    assert {t.number: t.values for t in complete if t.number in kept} == kept  # finished trials kept as told
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL) for t in trials)

    # The best is the best feasible trial, and the driver reports it.
    feasible = [t for t in complete if all(c <= 0 for c in t.constraints.values())]
    assert feasible, "no feasible trial: the landscape should have some"
    best = max(feasible, key=lambda t: t.values[0])
    assert resumed.best_number == best.number
    assert resumed.best_command and "--max-num-seqs" in resumed.best_command

    # MLflow (this backend's server): one parent for both runs, one child per told trial.
    client = MlflowClient(backend["mlflow_uri"])
    exp = client.get_experiment_by_name(f"exp-{name}")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("servetune.role") != "trial"]
    children = [r for r in runs if r.data.tags.get("servetune.role") == "trial"]
    assert len(parents) == 1 and resumed.parent_run_id == interrupted.parent_run_id == parents[0].info.run_id
    assert all(c.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for c in children)
    assert sorted(int(c.data.tags["servetune.trial_number"]) for c in children) == sorted(t.number for t in complete)
    assert all(c.info.status == "FINISHED" for c in children)

    # The Parquet dataset: one row per told trial.
    rows = dataset.read_trials(Path(first.output.dataset_dir), study=name)
    assert sorted(rows["trial_number"]) == sorted(t.number for t in complete)


class _AnswerLostOnce(optuna.storages.RDBStorage):
    """Fault injection on a real RDB storage: the first trial finish commits, then its answer is
    lost as when the connection dies between COMMIT and its reply."""

    lost = 0

    def set_trial_state_values(self, trial_id: int, state: optuna.trial.TrialState,
                               values: Any = None) -> bool:
        done = super().set_trial_state_values(trial_id, state, values)
        if state.is_finished() and not self.lost:
            self.lost += 1
            import sqlalchemy.exc

            raise sqlalchemy.exc.OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))
        return done


def test_a_finish_whose_answer_was_lost_is_not_repeated(backend: dict[str, str]) -> None:
    rdb = _AnswerLostOnce(backend["optuna_url"])
    study = optuna.create_study(study_name="lost-answer", storage=RetryingStorage(optuna.storages._CachedStorage(rdb)))
    trial = study.ask()
    study.tell(trial, 2.5)  # without the check the retry would raise "trial already finished"
    assert rdb.lost == 1
    trials = optuna.load_study(study_name="lost-answer", storage=backend["optuna_url"]).get_trials()
    assert [(t.state, t.value) for t in trials] == [(optuna.trial.TrialState.COMPLETE, 2.5)]
