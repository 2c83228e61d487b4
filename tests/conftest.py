"""Shared fixtures. Keep each fixture small and documented; real services only, no mocks.

* ``mlflow_server`` (session): a real ``mlflow server`` on 127.0.0.1, SQLite backend, proxied
  artifact store in a tmp dir; yields the tracking URI. About 5-6 s to start on 2 cores.
* ``postgres_server`` (session): a real PostgreSQL server (``tests/_postgres.py``) in a temp dir
  on 127.0.0.1 and a free port; ``postgres_server.create_database(name)`` gives a fresh database's
  SQLAlchemy URL. About 1 s to initdb and start.
* ``mlflow_server_pg`` (session): a second ``mlflow server``, backed by a database on
  ``postgres_server`` (PostgreSQL, the production backend); yields the tracking URI.
* ``tmp_runs_dir``: an empty directory for one test's trial run outputs.
* ``fresh_ray``: no local Ray in this process when the test starts and none when it ends, for a
  test whose trials must see environment variables it sets (Ray's workers keep the environment of
  the moment Ray started; a study reuses a Ray an earlier test left running).

Several workers (pytest-xdist, README's test command ``-n 3 --dist loadfile``): each test file runs
whole on one worker (its module fixtures start once, its tests keep their order), the files that
bring up multi-node ``ray start`` clusters run one after another on one worker
(:data:`_xdist_units.SERIAL_GROUPS`). Every worker starts its own servers (the fixtures above, once per process)
on free ports, in its own ``tmp_path`` tree; a local Ray is per process, so each worker's is its own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import pytest
from _postgres import PostgresServer

# Telemetry would try to reach the internet from every MlflowClient call; tests stay offline.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

_MLFLOW_START_TIMEOUT_S = 90.0

@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's; a plain `pytest` never calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with :data:`_xdist_units.SERIAL_GROUPS` merged: each file (or group) runs whole on
    one worker, and a crashed worker costs its one test (:class:`_xdist_units.FileOrGroupScheduling`).
    (xdist's ``--dist loadgroup`` marks do not group under pytest 9.2: xdist writes the group into
    ``item._nodeid``, which pytest 9.2's ``nodeid`` no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from _xdist_units import FileOrGroupScheduling

    return FileOrGroupScheduling(config, log)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (mlflow CLI + uvicorn worker), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _start_mlflow_server(root: Path, backend_store_uri: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``mlflow server`` on 127.0.0.1 with ``backend_store_uri``; returns it once ``/health`` answers.

    One uvicorn worker and no job runner (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``: it would
    otherwise fork seven huey consumers this machine cannot spare). Artifacts go through the
    server (``--serve-artifacts``, stored under ``root``), as they do for a remote study driver.
    """
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    log_path = root / "server.log"
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", backend_store_uri,
        "--serve-artifacts", "--artifacts-destination", str(root / "artifacts"),
    ]
    started = time.monotonic()
    with open(log_path, "wb") as log:
        # Own session: the teardown can signal the CLI and its uvicorn child as one group.
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(uri + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - started > _MLFLOW_START_TIMEOUT_S:
                raise RuntimeError(f"mlflow server not healthy after {_MLFLOW_START_TIMEOUT_S:.0f} s:\n"
                                   f"{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
    except BaseException:
        _stop_group(proc)
        raise
    print(f"\nmlflow server ({backend_store_uri.split(':', 1)[0]}) ready at {uri} in {time.monotonic() - started:.1f} s")
    return proc, uri


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server (SQLite backend); yields ``http://127.0.0.1:PORT``."""
    root = tmp_path_factory.mktemp("mlflow")
    proc, uri = _start_mlflow_server(root, f"sqlite:///{root / 'mlflow.db'}")
    try:
        yield uri
    finally:
        _stop_group(proc)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A real PostgreSQL server for the session, started by the tests themselves.

    ``.ci/run`` only installs the server binaries (the distribution's ``postgresql`` package);
    this fixture runs ``initdb`` into a temp dir and starts ``postgres`` on 127.0.0.1 and a free
    port (trust auth, test only), so ``pytest`` on a developer machine with PostgreSQL installed
    works the same way, and never touches a cluster the package may have started. Missing binaries
    fail the test, naming ``.ci/run``. Teardown: ``pg_ctl stop -m fast``, then SIGKILL of the
    server's process group, then the temp dir is removed.
    """
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def mlflow_server_pg(tmp_path_factory: pytest.TempPathFactory, postgres_server: PostgresServer) -> Iterator[str]:
    """A real MLflow tracking server backed by PostgreSQL (database ``mlflow`` on ``postgres_server``)."""
    root = tmp_path_factory.mktemp("mlflow-pg")
    proc, uri = _start_mlflow_server(root, postgres_server.create_database("mlflow"))
    try:
        yield uri
    finally:
        _stop_group(proc)


@pytest.fixture
def tmp_runs_dir(tmp_path: Path) -> Path:
    """An empty directory for the outputs of one test's trials (engine logs, per-trial files)."""
    path = tmp_path / "runs"
    path.mkdir()
    return path


@pytest.fixture
def fresh_ray() -> Iterator[None]:
    """No local Ray in this process when the test starts, and none left when it ends: the test's own
    study starts one after the test has set its environment. Ray's workers (the trials' actors and
    the servers they start) keep the environment of the moment Ray started, so with a Ray an earlier
    test left running, a variable set by ``monkeypatch.setenv`` never reaches them."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    try:
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
