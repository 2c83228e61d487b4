"""One driver per study: the lease in the study's own storage (SQLite and a real PostgreSQL),
and through the CLI a second ``servetune tune --resume`` refused while the first runs, then a
SIGKILLed first driver taken over."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
import yaml

from _kill import kill_all_started_by
from _study_procs import completed_trials, a100_sim_study

from servetune.records import lease

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgresql"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/optuna.db"
    else:
        yield request.getfixturevalue("postgres_server").create_database("lease_test")


def _set_holder(url: str, name: str, **values: Any) -> None:
    """Change the lease row as another driver's would look (another host, an old heartbeat, a dead pid)."""
    engine = sa.create_engine(url)
    table = sa.Table(lease.TABLE, sa.MetaData(), autoload_with=engine)
    with engine.begin() as conn:
        assert conn.execute(table.update().where(table.c.study_name == name).values(**values)).rowcount == 1
    engine.dispose()


def test_a_second_driver_is_refused_naming_the_holder(storage_url: str) -> None:
    first = lease.acquire(storage_url, "s1")
    try:
        with pytest.raises(lease.StudyBusy) as refused:
            lease.acquire(storage_url, "s1")
        text = str(refused.value)
        assert f"host {socket.gethostname()}" in text and f"pid {os.getpid()}" in text
        assert first.holder.started_at in text and "\n" not in text
        other = lease.acquire(storage_url, "s2")  # another study of the same storage is free
        other.release()
        assert first.renew()
    finally:
        first.release()
    lease.acquire(storage_url, "s1").release()  # released: free again


def test_a_stale_holder_is_taken_over_and_a_live_one_elsewhere_is_not(storage_url: str) -> None:
    first = lease.acquire(storage_url, "s1")
    try:
        # Another host's driver that beat 5 s ago is alive as far as anyone here can tell.
        _set_holder(storage_url, "s1", holder_host="other-host", heartbeat_at=time.time() - 5)
        with pytest.raises(lease.StudyBusy, match="host other-host"):
            lease.acquire(storage_url, "s1")
        # Silent for longer than the stale limit: taken over.
        _set_holder(storage_url, "s1", heartbeat_at=time.time() - lease.STALE_AFTER_S - 1)
        second = lease.acquire(storage_url, "s1")
        assert second.taken_over is not None and second.taken_over.host == "other-host"
        assert not first.renew()  # the first holder learns its lease is gone
        second.release()
    finally:
        first.release()


def test_a_dead_pid_on_this_host_is_taken_over_at_once(storage_url: str) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    first = lease.acquire(storage_url, "s1")
    first._stop.set()  # this holder stops beating, as a killed process would
    _set_holder(storage_url, "s1", holder_pid=gone.pid, heartbeat_at=time.time())
    second = lease.acquire(storage_url, "s1")
    assert second.taken_over is not None and second.taken_over.pid == gone.pid
    second.release()
    first.release()


def _spec(tmp: Path, name: str, trials: int) -> Path:
    data = a100_sim_study(name, trials, tmp / "runs", {"experiment": f"exp-{name}"})  # the runs dir's own mlflow.db
    path = tmp / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    return path



@pytest.mark.slow
def test_a_second_tune_is_refused_while_the_first_runs_and_takes_over_after_a_kill(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "lease-study", trials=500)
    env = {"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "servetune", "tune", str(spec)]
    db = tmp_path / "runs" / "optuna.db"
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                             start_new_session=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while completed_trials(db) < 2 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.5)
        assert completed_trials(db) >= 2 and first.poll() is None
        second = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
        assert second.returncode == 2, second.stderr[-2000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"pid {first.pid}" in lines[0] and f"host {socket.gethostname()}" in lines[0], lines
        assert first.poll() is None  # the first driver goes on, its trials untouched
        study = optuna.load_study(study_name="lease-study", storage=f"sqlite:///{db}")
        assert not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
        while completed_trials(db) < 4 and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        kill_all_started_by(first.pid)
    done = completed_trials(db)
    assert done >= 4
    resumed = subprocess.run([*cmd, "--resume", "--trials", str(done + 2)], capture_output=True, text=True,
                             env=env, timeout=600, cwd=tmp_path)
    assert resumed.returncode in (0, 1), resumed.stderr[-2000:]
    study = optuna.load_study(study_name="lease-study", storage=f"sqlite:///{db}")
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states.count(optuna.trial.TrialState.COMPLETE) == done + 2
    assert optuna.trial.TrialState.RUNNING not in states
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:  # released at the end
        assert conn.execute(sa.text(f"SELECT count(*) FROM {lease.TABLE}")).scalar() == 0
    engine.dispose()


_RACE = """
import sys, time
from servetune.records import lease
url, start = sys.argv[1], float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
try:
    held = lease.acquire(url, "raced")
except lease.StudyBusy:
    print("busy", flush=True)
else:
    print("won", flush=True)
    time.sleep(3)
    held.release()
"""


def test_drivers_starting_together_on_a_fresh_database_let_exactly_one_in(storage_url: str) -> None:
    """Four processes take the same study's lease at the same instant on a database without the
    table yet: the table is created once and one of them wins."""
    env = {"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"}
    start = time.time() + 4  # after the four interpreters have imported SQLAlchemy
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, storage_url, str(start)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    answers = [p.communicate(timeout=120) for p in procs]
    words = sorted(out.strip() for out, _ in answers)
    assert words == ["busy", "busy", "busy", "won"], answers
