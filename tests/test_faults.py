"""Fault matrix: a study keeps every result through an MLflow outage and a locked storage.

Real services only: a dedicated ``mlflow server`` (own port, own SQLite backend, so stopping it
does not disturb the session fixture), local Ray with logical GPUs, Optuna SQLite.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow.tracking import MlflowClient

from servetune.records import dataset
from servetune.records._retry import backoff_delays, is_transient_storage_error, retry_call
from servetune.result import TrialResult
from servetune.spec.schema import StudySpec
from servetune.study import run_study


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(uri + "/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class _MlflowServer:
    """A stoppable, restartable ``mlflow server`` (the conftest fixture's recipe, own port and DB)."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--serve-artifacts", "--artifacts-destination", str(self.root / "artifacts")]
        with open(self.root / "server.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 90
        while not _healthy(self.uri):
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not become healthy"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while _healthy(self.uri):  # the uvicorn worker may outlive the CLI for a moment
            assert time.monotonic() < deadline, "mlflow server still answering after SIGTERM"
            time.sleep(0.1)


def _spec(tmp: Path, mlflow_uri: str, name: str, trials: int, storage: str | None = None) -> StudySpec:
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
        "budget": {"trials": trials, "parallel": 2},
        "backend": "sim",
        "prescreen": False,
        "seed": 5,
        "tracking": {"mlflow_uri": mlflow_uri, "experiment": f"exp-{name}"},
        "storage": {"optuna_url": storage or f"sqlite:///{tmp}/optuna.db"},
        "output": {"runs_dir": str(tmp / "runs"), "dataset_dir": str(tmp / "dataset")},
    })


@pytest.mark.slow
def test_mlflow_outage_mid_study_buffers_then_delivers_every_trial_once(tmp_path: Path) -> None:
    server = _MlflowServer(tmp_path)
    server.start()
    n_trials = 6
    spec = _spec(tmp_path, server.uri, "outage", n_trials)
    seen: list[int] = []
    restarter: list[threading.Thread] = []
    buffered_while_down: list[int] = []
    buffer_dir = Path(spec.output.runs_dir) / "mlflow-buffer"

    def on_result(number: int, flags: dict[str, Any], result: TrialResult) -> None:
        seen.append(number)
        if len(seen) == 2:
            server.stop()  # trials 3.. are told while MLflow is gone
        elif len(seen) == n_trials:
            buffered_while_down.append(len([p for p in buffer_dir.iterdir() if (p / "op.json").is_file()]))
            # Back only once the driver is past its last trial: the end-of-study flush must wait for it.
            thread = threading.Thread(target=server.start, daemon=True)
            thread.start()
            restarter.append(thread)

    try:
        outcome = run_study(spec, out=io.StringIO(), on_result=on_result)
        restarter[0].join(timeout=120)
        assert outcome.trials_done == n_trials
        assert buffered_while_down == [n_trials - 2]  # trials 3..6 waited on disk, nothing was dropped
        assert [p for p in buffer_dir.iterdir() if p.name != ".staging"] == []
        assert list((buffer_dir / ".staging").iterdir()) == []

        client = MlflowClient(server.uri)
        exp = client.get_experiment_by_name("exp-outage")
        runs = client.search_runs([exp.experiment_id], max_results=1000)
        children = [r for r in runs if r.data.tags.get("servetune.role") == "trial"]
        numbers = sorted(int(r.data.tags["servetune.trial_number"]) for r in children)
        assert numbers == sorted(seen) == list(range(n_trials))  # every trial exactly once
        for child in children:
            assert child.info.status in ("FINISHED", "FAILED")
            assert "output_throughput" in child.data.metrics and "max_num_seqs" in child.data.params
            names = {a.path for a in client.list_artifacts(child.info.run_id)}
            assert {"engine.log", "result.json", "requests.parquet"} <= names
        parent = [r for r in runs if r.data.tags.get("servetune.role") == "study"]
        assert len(parent) == 1 and parent[0].info.status == "FINISHED"  # the buffered end() landed
        assert "output_throughput" in parent[0].data.metrics or outcome.best_flags is None  # the buffered finish landed
        assert {a.path for a in client.list_artifacts(parent[0].info.run_id)} >= {"trials.csv", "trials.parquet"}
        assert len(dataset.read_trials(Path(spec.output.dataset_dir), study="outage")) == n_trials
    finally:
        server.stop()


def test_mlflow_down_at_the_start_fails_fast_before_any_trial(tmp_path: Path) -> None:
    from servetune.records.tracking import TrackingError

    dead = f"http://127.0.0.1:{_free_port()}"
    spec = _spec(tmp_path, dead, "down-at-start", 2)
    with pytest.raises(TrackingError, match="unreachable"):
        run_study(spec, out=io.StringIO())
    study = optuna.load_study(study_name="down-at-start", storage=spec.storage.optuna_url)
    assert study.get_trials(deepcopy=False) == []  # no trial ran, none to lose


def test_retry_classifies_and_backs_off() -> None:
    assert backoff_delays(0.1, 1.0, 6) == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert is_transient_storage_error(sqlite3.OperationalError("database is locked"))
    assert not is_transient_storage_error(ValueError("bad value"))
    wrapped = optuna.exceptions.StorageInternalError("commit failed")
    wrapped.__cause__ = sqlite3.OperationalError("database is locked")
    assert is_transient_storage_error(wrapped)
    with pytest.raises(ValueError):  # a real error is never retried
        retry_call(lambda: (_ for _ in ()).throw(ValueError("no")), what="x", base_s=0.001)
    calls: list[int] = []

    def always_locked() -> None:
        calls.append(1)
        raise sqlite3.OperationalError("database is locked")

    with pytest.raises(sqlite3.OperationalError):  # gives up after the deadline with the last error
        retry_call(always_locked, what="x", deadline_s=0.05, base_s=0.01, cap_s=0.02)
    assert len(calls) >= 2


@pytest.mark.slow
def test_locked_optuna_storage_is_waited_out_without_losing_a_trial(
        tmp_path: Path, mlflow_server: str, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "optuna.db"
    # A short busy timeout makes SQLite report the lock instead of absorbing it (default 5 s).
    spec = _spec(tmp_path, mlflow_server, "locked", 6, storage=f"sqlite:///{db}?timeout=0.2")
    locker: list[threading.Thread] = []
    held = threading.Event()

    def hold_lock() -> None:
        conn = sqlite3.connect(db, timeout=30, isolation_level=None)
        try:
            conn.execute("BEGIN EXCLUSIVE")
            held.set()
            time.sleep(2.0)
            conn.execute("COMMIT")
        finally:
            conn.close()

    def on_result(number: int, flags: dict[str, Any], result: TrialResult) -> None:
        if not locker:  # lock the file right after the first tell: the next ask/tell hit it
            thread = threading.Thread(target=hold_lock, daemon=True)
            thread.start()
            held.wait(timeout=30)
            locker.append(thread)

    with caplog.at_level(logging.WARNING, logger="servetune.records._retry"):
        outcome = run_study(spec, out=io.StringIO(), on_result=on_result)
    locker[0].join(timeout=30)
    retries = [r for r in caplog.records if r.name == "servetune.records._retry"]
    assert retries, "the lock was never hit: the test did not exercise the retry"
    assert outcome.trials_done == 6
    study = optuna.load_study(study_name="locked", storage=f"sqlite:///{db}")
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 6
    assert optuna.trial.TrialState.RUNNING not in {t.state for t in trials}
    # An ask that failed half-way is told FAIL, never left RUNNING and never counted as a result.
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL) for t in trials)
    rows = dataset.read_trials(Path(spec.output.dataset_dir), study="locked")
    assert sorted(rows["trial_number"]) == sorted(t.number for t in complete)  # no duplicate, none missing
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("exp-locked")
    children = [r for r in client.search_runs([exp.experiment_id], max_results=1000)
                if r.data.tags.get("servetune.role") == "trial"]
    assert sorted(int(r.data.tags["servetune.trial_number"]) for r in children) == sorted(t.number for t in complete)


def test_retry_tells_a_postgresql_restart_from_a_configuration_mistake(postgres_server: Any) -> None:
    import psycopg
    import sqlalchemy.exc
    from _ray_helpers import free_ports

    # Real errors from psycopg 3 (the [postgres] extra): a port nothing listens on, and the test
    # server asked for a database and a role it does not have.
    (closed_port,) = free_ports(1)
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect(f"host=127.0.0.1 port={closed_port} user=postgres dbname=postgres connect_timeout=5")
    assert "refused" in str(refused.value).lower()
    assert is_transient_storage_error(refused.value)
    assert is_transient_storage_error(sqlalchemy.exc.OperationalError("SELECT 1", {}, refused.value))
    closed = optuna.exceptions.StorageInternalError("An exception is raised during the commit.")
    closed.__cause__ = sqlalchemy.exc.OperationalError(
        "COMMIT", {}, psycopg.OperationalError("server closed the connection unexpectedly"))
    assert is_transient_storage_error(closed)
    shutdown = psycopg.errors.AdminShutdown("terminating connection due to administrator command")
    assert type(shutdown).__module__.startswith("psycopg") and is_transient_storage_error(shutdown)
    for dsn in (f"host=127.0.0.1 port={postgres_server.port} user=postgres dbname=no_such_db connect_timeout=5",
                f"host=127.0.0.1 port={postgres_server.port} user=nobody dbname=postgres connect_timeout=5"):
        with pytest.raises(psycopg.OperationalError) as mistake:
            psycopg.connect(dsn)
        assert "does not exist" in str(mistake.value), str(mistake.value)
        assert not is_transient_storage_error(mistake.value)
        assert not is_transient_storage_error(sqlalchemy.exc.OperationalError("", {}, mistake.value))
    assert not is_transient_storage_error(sqlalchemy.exc.OperationalError(
        "", {}, psycopg.OperationalError('FATAL:  password authentication failed for user "x"')))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_postgresql_restart_mid_study_is_waited_out_without_losing_a_trial(
        tmp_path: Path, mlflow_server: str, caplog: pytest.LogCaptureFixture) -> None:
    """The Optuna storage's PostgreSQL server stops (``pg_ctl stop -m fast``) after the second told
    trial and comes back on the same port and data dir 3 s later; the study rides it out."""
    from _postgres import PostgresServer

    pg = PostgresServer(prefix="st-pg-outage-")  # its own server: the session one stays up
    n_trials = 6
    outage: dict[str, float] = {}
    restarter: list[threading.Thread] = []
    try:
        pg.start()
        url = pg.create_database("outage")
        spec = _spec(tmp_path, mlflow_server, "pg-outage", n_trials, storage=url)
        seen: list[int] = []

        def come_back() -> None:
            time.sleep(3.0)
            pg.start()
            outage["up"] = time.monotonic()

        def on_result(number: int, flags: dict[str, Any], result: TrialResult) -> None:
            seen.append(number)
            if len(seen) == 2:  # the next ask / tell / best-trial read hits a server that is gone
                outage["down"] = time.monotonic()
                pg.stop()
                thread = threading.Thread(target=come_back, daemon=True)
                thread.start()
                restarter.append(thread)

        with caplog.at_level(logging.WARNING, logger="servetune.records._retry"):
            outcome = run_study(spec, out=io.StringIO(), on_result=on_result)
        restarter[0].join(timeout=60)
        retries = [r for r in caplog.records if r.name == "servetune.records._retry"]
        assert retries, "the outage was never hit: the test did not exercise the retry"
        assert outcome.trials_done == n_trials
        print(f"\nPostgreSQL down for {outage['up'] - outage['down']:.1f} s; {len(retries)} retries: "
              + "; ".join(sorted({r.getMessage().split(' (attempt')[0] for r in retries})))

        study = optuna.load_study(study_name="pg-outage", storage=url)
        trials = study.get_trials(deepcopy=False)
        complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
        assert len(complete) == n_trials
        # Nothing left RUNNING; an ask cut off half-way (if any) is FAIL, never a counted result.
        assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL) for t in trials)
        assert all(set(t.constraints) == {"startup", "preemptions"} for t in complete)
        rows = dataset.read_trials(Path(spec.output.dataset_dir), study="pg-outage")
        assert sorted(rows["trial_number"]) == sorted(t.number for t in complete) == sorted(seen)  # each once
        client = MlflowClient(mlflow_server)
        exp = client.get_experiment_by_name("exp-pg-outage")
        children = [r for r in client.search_runs([exp.experiment_id], max_results=1000)
                    if r.data.tags.get("servetune.role") == "trial"]
        assert sorted(int(r.data.tags["servetune.trial_number"]) for r in children) == sorted(seen)
    finally:
        for thread in restarter:
            thread.join(timeout=60)
        pg.destroy()
