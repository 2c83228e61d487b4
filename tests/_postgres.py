"""A real PostgreSQL server for tests: ``initdb`` into a temp dir, ``postgres`` on 127.0.0.1.

Contract:

* :class:`PostgresServer` owns one data directory and one TCP port. :meth:`start` runs
  ``postgres`` in its own session (so the teardown signals exactly this server's process group)
  and returns once it accepts connections; :meth:`stop` is ``pg_ctl stop -m fast`` (what an
  operator or a failover does), then SIGKILL of the process group if it lingers. :meth:`start`
  after :meth:`stop` brings the same cluster back on the same port: the restart an outage test needs.
* Trust authentication, TCP on 127.0.0.1 only, no Unix socket outside the data directory, no
  fsync: a throwaway test cluster, never a template for production.
* PostgreSQL refuses to run as root: when the tests run as root (CI containers), every server
  command runs through ``runuser -u postgres --`` and the data directory is owned by the
  ``postgres`` user that the Debian package creates.
* Missing server binaries are a test failure naming ``.ci/run`` (which installs them), never a skip.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

__all__ = ["PostgresServer", "find_server_bin"]

_START_TIMEOUT_S = 60.0


def find_server_bin() -> Path:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres`` (PATH first, then Debian's
    ``/usr/lib/postgresql/<major>/bin``, newest major first); fails the test when there is none."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl") and shutil.which("postgres"):
        return Path(on_path).resolve().parent
    majors = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                    key=lambda p: int(re.sub(r"\D", "", Path(p).parent.parent.name) or 0), reverse=True)
    if majors:
        return Path(majors[0]).parent
    pytest.fail("PostgreSQL server binaries (initdb, pg_ctl, postgres) not found on PATH or under "
                "/usr/lib/postgresql/*/bin. `.ci/run` installs them (apt-get install postgresql); "
                "on a developer machine install the distribution's `postgresql` package.")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One throwaway PostgreSQL cluster: ``start``, ``stop``, ``create_database``, ``destroy``."""

    def __init__(self, prefix: str = "st-pg-") -> None:
        self.bin = find_server_bin()
        # Not under pytest's tmp dir: that is 0700 root-owned, and the server may run as `postgres`.
        self.root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._as: list[str] = []
        if os.geteuid() == 0:
            if shutil.which("runuser") is None:
                pytest.fail("running as root needs `runuser` (util-linux) to start PostgreSQL as `postgres`")
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                pytest.fail("running as root but there is no `postgres` user (the Debian `postgresql` "
                            "package creates it; `.ci/run` installs it)")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
                   "-E", "UTF8", "--locale=C", "--no-sync"])
        with open(self.data / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write(f"\n# servetune tests\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                       f"unix_socket_directories = '{self.data}'\nfsync = off\nsynchronous_commit = off\n"
                       "full_page_writes = off\nmax_connections = 100\nshared_buffers = 32MB\n")

    @property
    def admin_dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres connect_timeout=5"

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` on this server."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, argv: list[str], timeout: float = 120) -> None:
        proc = subprocess.run([*self._as, *argv], capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                               f"\n{proc.stderr[-2000:]}")

    def start(self) -> None:
        """Start the server (own session) and wait until it accepts connections."""
        import psycopg

        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*self._as, str(self.bin / "postgres"), "-D", str(self.data)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                psycopg.connect(self.admin_dsn).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"postgres not accepting connections after {_START_TIMEOUT_S:.0f} s:\n"
                                       f"{self.log.read_text()[-3000:]}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """``pg_ctl stop -m fast`` (sessions terminated, transactions rolled back), then make sure."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self._run([str(self.bin / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast", "-w", "-t", "30"],
                      timeout=40)
        except (RuntimeError, subprocess.TimeoutExpired):
            pass  # the process group is killed below
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:  # runuser, a postmaster that ignored the stop, or orphaned backends: same group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def create_database(self, name: str) -> str:
        """A fresh, empty database (dropped first if it exists); returns its SQLAlchemy URL."""
        import psycopg

        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
            raise ValueError(f"database name {name!r}: lowercase letters, digits and _ only")
        # autocommit: CREATE/DROP DATABASE cannot run inside a transaction block.
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name}")  # name checked above: an identifier
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def destroy(self) -> None:
        """Stop the server and remove its data directory."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
