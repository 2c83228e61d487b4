"""Read-only commands never write (``best`` on an empty database, a missing study, a real one, on
SQLite and PostgreSQL), and a double Ctrl-C on ``servetune tune`` exits 130 without a traceback, at
once even where it cut an Optuna write half-way."""

from __future__ import annotations

import gc
import hashlib
import io
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from sqlalchemy.engine import default

from _study_procs import completed_trials
from servetune.spec.schema import StudySpec
from servetune.study import run_study

REPO = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"}


def _best(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "servetune", "best", *args], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=120)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_best_on_an_empty_database_says_so_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "optuna.db").touch()
    proc = _best(tmp_path, "quickstart", "--storage", "sqlite:///optuna.db")
    assert proc.returncode == 2 and "holds no Optuna study" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    assert (tmp_path / "optuna.db").stat().st_size == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optuna.db"]  # no journal, no second file


def test_best_reads_a_real_database_without_changing_a_byte(tmp_path: Path) -> None:
    db = tmp_path / "optuna.db"
    study = optuna.create_study(study_name="real", storage=f"sqlite:///{db}", direction="maximize")
    trial = study.ask()
    trial.suggest_int("max_num_seqs", 16, 256)
    study.tell(trial, 100.0)
    before = _digest(db)
    missing = _best(tmp_path, "nope", "--storage", "sqlite:///optuna.db")
    assert missing.returncode == 2 and "no study named 'nope'" in missing.stderr and "known studies: real" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    found = _best(tmp_path, "real", "--storage", "sqlite:///optuna.db")
    assert found.returncode == 1 and "no trial that met its constraints" in found.stderr  # no constraints stored
    assert _digest(db) == before


def test_best_on_an_empty_postgresql_database_creates_no_table(postgres_server: Any, tmp_path: Path) -> None:
    import psycopg

    url = postgres_server.create_database("best_readonly")
    proc = _best(tmp_path, "quickstart", "--storage", url)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "holds no Optuna study" in proc.stderr
    with psycopg.connect(f"{postgres_server.admin_dsn.replace('dbname=postgres', 'dbname=best_readonly')}") as conn:
        (tables,) = conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'").fetchone()
    assert tables == 0



def test_a_double_ctrl_c_exits_130_without_a_traceback(tmp_path: Path) -> None:
    data: dict[str, Any] = {
        "name": "ctrl-c", "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB", "count": 1},
        "workload": {"input_len": 512, "output_len": 256, "num_requests": 32, "concurrency": 16, "seed": 1},
        "objective": {"metric": "output_throughput"},
        "search_space": {"params": {"gpu_memory_utilization": {"type": "float", "low": 0.5, "high": 0.95, "step": 0.01},
                                    "max_num_seqs": {"type": "int", "low": 8, "high": 512}}},
        "budget": {"trials": 500, "parallel": 1}, "backend": "sim", "seed": 1,
        "tracking": {"experiment": "ctrl-c"},
        "output": {"runs_dir": str(tmp_path / "runs"), "dataset_dir": str(tmp_path / "runs" / "dataset")},
    }
    spec = tmp_path / "study.yaml"
    spec.write_text(yaml.safe_dump(data))
    proc = subprocess.Popen([sys.executable, "-m", "servetune", "tune", str(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while completed_trials(tmp_path / "runs" / "optuna.db") < 1 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out[-2000:], err[-2000:])
    assert "Traceback" not in out + err


def test_a_second_signal_that_cuts_an_optuna_write_leaves_no_trial_running_and_no_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # The Ctrl-C lands between SQLite's write and SQLAlchemy's reading of its result: the cursor, in a reference
    # cycle, keeps the file's write lock. While the interrupt's traceback was alive (the driver failed the running
    # trials inside its except block) no collection could free it: every closing write waited out 60 s of retries.
    db = tmp_path / "optuna.db"
    spec = StudySpec.from_dict({
        "name": "cut", "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB", "count": 1},
        "workload": {"input_len": 256, "output_len": 64, "num_requests": 16, "concurrency": 8, "seed": 1},
        "objective": {"metric": "output_throughput"},
        "search_space": {"params": {"max_num_seqs": {"type": "int", "low": 8, "high": 256}}},
        "budget": {"trials": 40, "parallel": 1}, "backend": "sim", "prescreen": False, "seed": 1,
        "tracking": {"experiment": "cut"}, "storage": {"optuna_url": f"sqlite:///{db}"},
        "output": {"runs_dir": str(tmp_path / "runs"), "dataset_dir": str(tmp_path / "dataset")},
    })
    read_result = default.DefaultExecutionContext._setup_result_proxy
    armed: list[bool] = []

    def cut_once(self: default.DefaultExecutionContext) -> object:
        if armed == [True] and self.root_connection.engine.url.database == str(db):
            armed.append(False)
            raise KeyboardInterrupt  # where a second Ctrl-C lands inside an Optuna commit
        return read_result(self)

    monkeypatch.setattr(default.DefaultExecutionContext, "_setup_result_proxy", cut_once)
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection may free the cursor by chance
    try:
        with caplog.at_level(logging.WARNING, logger="servetune.records._retry"):
            outcome = run_study(spec, out=io.StringIO(), on_result=lambda *_: armed.append(True) if not armed else None)
    finally:
        if was_enabled:
            gc.enable()
    assert armed == [True, False] and outcome.interrupted
    retries = [r for r in caplog.records if r.name == "servetune.records._retry"]
    assert len(retries) <= 1, [r.getMessage() for r in retries]  # one wait for the lock, not 60 s of them
    states = {t.state for t in optuna.load_study(study_name="cut", storage=f"sqlite:///{db}").get_trials()}
    assert optuna.trial.TrialState.RUNNING not in states


def test_a_second_signal_a_library_turned_into_its_own_error_still_exits_130(monkeypatch, capsys) -> None:
    # The second Ctrl-C raises KeyboardInterrupt wherever the study is; inside an Optuna commit, Optuna rolls
    # back and raises StorageInternalError instead, which reached the user as exit 1 with Optuna's message.
    import threading

    from servetune.cli import _main
    from servetune.study import _dispatch, interrupted_at_once

    monkeypatch.setattr(_dispatch, "_STOPPED_AT_ONCE", threading.Event())
    stop = _dispatch.StopRequest()
    try:
        stop._handle(signal.SIGINT, None)
        assert not interrupted_at_once()
        try:
            stop._handle(signal.SIGINT, None)
        except KeyboardInterrupt:
            pass
        assert interrupted_at_once()

        def commit_cut(args: Any) -> int:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.")

        monkeypatch.setattr(_main, "_dispatch", commit_cut)
        assert _main.main(["tune", "study.yaml"]) == 130
        assert capsys.readouterr().err.strip().splitlines()[-1] == "servetune: interrupted"
        monkeypatch.setattr(_dispatch, "_STOPPED_AT_ONCE", threading.Event())
        with pytest.raises(optuna.exceptions.StorageInternalError):  # without the second signal it is an error
            _main.main(["tune", "study.yaml"])
    finally:
        stop.restore()
