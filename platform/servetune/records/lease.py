"""One driver per study: a lease row in the study's own Optuna storage database.

Contract:

* :func:`acquire` takes the lease of study ``name`` in the database at ``url`` (any SQLAlchemy URL
  Optuna accepts: SQLite, PostgreSQL) before the driver opens the Optuna study: a row of the table
  ``servetune_study_lease`` holding the holder's host, pid, start time, a heartbeat and a random
  token. It returns a :class:`StudyLease` whose thread renews the heartbeat every
  :data:`HEARTBEAT_S` seconds; :meth:`StudyLease.release` stops it and deletes the row (only while
  the row is still this holder's).
* A live holder refuses the second driver: :class:`StudyBusy` (a :class:`~servetune.errors.SpecError`,
  so the CLI prints one line naming the holder's host, pid and start time, and exits 2). Nothing of
  the study is read or written before that.
* A stale holder is taken over (:func:`is_stale`, pure): a holder on this host whose pid is no longer
  alive, or any holder whose heartbeat is older than :data:`STALE_AFTER_S` (another host's driver
  that died or lost the database; also a reused pid on this host). Heartbeats are the writers' own
  clocks (``time.time()``): hosts sharing a database need clocks within a few seconds of each other.
* Every change is one conditional statement (insert; update or delete ``WHERE token = ...``), so
  two drivers racing for a free or stale lease cannot both win on either database: the loser's
  insert hits the primary key, or its update matches no row, and it reads the winner's row.
* A heartbeat that finds the row no longer this holder's (another driver judged it stale: this
  process was stopped for over a minute) sets :attr:`StudyLease.lost` and logs an error.

Example:
    >>> lease = acquire("sqlite:///:memory:", "s1")  # doctest: +SKIP
    >>> lease.release()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import sqlalchemy as sa

from servetune.errors import SpecError
from servetune.records._retry import retry_call

__all__ = ["acquire", "StudyLease", "StudyBusy", "Holder", "is_stale", "HEARTBEAT_S", "STALE_AFTER_S",
           "TABLE"]

_log = logging.getLogger(__name__)

#: How often a holder renews its heartbeat (seconds).
HEARTBEAT_S = 10.0
#: A heartbeat older than this (seconds) frees the lease, whatever host held it.
STALE_AFTER_S = 60.0
TABLE = "servetune_study_lease"

_meta = sa.MetaData()
_lease = sa.Table(
    TABLE, _meta,
    sa.Column("study_name", sa.String(512), primary_key=True),
    sa.Column("holder_host", sa.String(255), nullable=False),
    sa.Column("holder_pid", sa.Integer, nullable=False),
    sa.Column("started_at", sa.String(40), nullable=False),  # ISO 8601, UTC: what the refusal prints
    sa.Column("heartbeat_at", sa.Float, nullable=False),  # seconds since the epoch, the holder's clock
    sa.Column("token", sa.String(64), nullable=False),
)


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a study's lease (one row of the table)."""

    host: str
    pid: int
    started_at: str
    heartbeat_at: float
    token: str

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started_at}"


class StudyBusy(SpecError):
    """Another live driver holds the study's lease."""

    def __init__(self, study: str, holder: Holder) -> None:
        super().__init__("name", f"study {study!r} is already being run by another driver ({holder.describe()})",
                         "wait for it to end, or stop it first; a driver that died is taken over at the next "
                         f"start (at once on its own host, after {STALE_AFTER_S:.0f} s without a heartbeat elsewhere)")
        self.holder = holder


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def is_stale(holder: Holder, *, now: float, host: str, pid_alive: bool) -> bool:
    """Whether ``holder``'s lease may be taken over (pure; ``pid_alive``: whether its pid runs
    here, only read when it is this ``host``'s).

    Example:
        >>> h = Holder("a", 42, "2026-01-01T00:00:00+00:00", heartbeat_at=1000.0, token="t")
        >>> is_stale(h, now=1030.0, host="a", pid_alive=False), is_stale(h, now=1030.0, host="b", pid_alive=False)
        (True, False)
        >>> is_stale(h, now=1000.0 + STALE_AFTER_S + 1, host="b", pid_alive=True)
        True
    """
    if now - holder.heartbeat_at > STALE_AFTER_S:
        return True
    return holder.host == host and not pid_alive


def _engine(url: str) -> sa.engine.Engine:
    from servetune.records._storage import engine_kwargs_for, postgres_url

    url = postgres_url(url)
    return sa.create_engine(url, **engine_kwargs_for(url))


def _read(conn: sa.engine.Connection, name: str) -> Holder | None:
    row = conn.execute(sa.select(_lease).where(_lease.c.study_name == name)).mappings().first()
    if row is None:
        return None
    return Holder(row["holder_host"], int(row["holder_pid"]), row["started_at"], float(row["heartbeat_at"]),
                  row["token"])


class StudyLease:
    """The lease this process holds on one study; renewed by a daemon thread until released."""

    def __init__(self, engine: sa.engine.Engine, name: str, holder: Holder, taken_over: Holder | None) -> None:
        self.engine, self.name, self.holder, self.taken_over = engine, name, holder, taken_over
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"servetune-lease-{name}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self.renew():
                    self.lost = True
                    _log.error("study %r: another driver took over this driver's lease; stop this one", self.name)
                    return
            except Exception as exc:  # noqa: BLE001 - a missed beat is retried at the next one
                _log.warning("study %r: lease heartbeat failed (retried in %.0f s): %s", self.name, HEARTBEAT_S,
                             str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)

    def renew(self) -> bool:
        """Renew the heartbeat now; False when the row is no longer this holder's."""
        with self.engine.begin() as conn:
            done = conn.execute(_lease.update().where(_lease.c.study_name == self.name,
                                                      _lease.c.token == self.holder.token)
                                .values(heartbeat_at=time.time()))
        return bool(done.rowcount)

    def release(self) -> None:
        """Stop the heartbeat and give the lease back (a no-op if another driver took it)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=HEARTBEAT_S)
        try:
            retry_call(lambda: self._delete(), what=f"release study {self.name!r}'s lease", deadline_s=10.0)
        except Exception as exc:  # noqa: BLE001 - a row left behind is stale for the next start
            _log.warning("study %r: could not release the lease (taken over at the next start): %s", self.name,
                         str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
        finally:
            self.engine.dispose()

    def _delete(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(_lease.delete().where(_lease.c.study_name == self.name, _lease.c.token == self.holder.token))

    def __enter__(self) -> StudyLease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _try_take(conn: sa.engine.Connection, name: str, mine: Holder, host: str) -> tuple[bool, Holder | None]:
    """One attempt in one transaction: ``(won, the holder found)``; ``won`` False with a holder: refused."""
    found = _read(conn, name)
    values = dataclasses.asdict(mine)
    row = {"holder_host": values["host"], "holder_pid": values["pid"], "started_at": values["started_at"],
           "heartbeat_at": values["heartbeat_at"], "token": values["token"]}
    if found is None:
        conn.execute(_lease.insert().values(study_name=name, **row))  # a racing insert: IntegrityError
        return True, None
    if not is_stale(found, now=time.time(), host=host, pid_alive=found.host == host and _pid_alive(found.pid)):
        return False, found
    done = conn.execute(_lease.update().where(_lease.c.study_name == name, _lease.c.token == found.token).values(**row))
    return bool(done.rowcount), found


def _create_table(engine: sa.engine.Engine) -> None:
    """The lease table, once; two drivers creating it together: the loser finds it there."""
    try:
        _meta.create_all(engine)
    except sa.exc.DBAPIError:
        if not sa.inspect(engine).has_table(TABLE):
            raise


def acquire(url: str, name: str) -> StudyLease:
    """Take study ``name``'s lease in the database at ``url``; :class:`StudyBusy` if a live driver holds it."""
    engine = _engine(url)
    host = socket.gethostname()
    try:
        retry_call(lambda: _create_table(engine), what="create the study lease table")
        for _ in range(5):  # each lost race reads the winner's row the next time round
            mine = Holder(host, os.getpid(), dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                          time.time(), uuid.uuid4().hex)
            try:
                def attempt() -> tuple[bool, Holder | None]:
                    with engine.begin() as conn:
                        return _try_take(conn, name, mine, host)

                won, found = retry_call(attempt, what=f"take study {name!r}'s lease")
            except sa.exc.IntegrityError:
                continue  # another driver inserted first
            if won:
                if found is not None:
                    _log.warning("study %r: took over the lease of a driver that is gone (%s)", name, found.describe())
                return StudyLease(engine, name, mine, found)
            if found is not None and not is_stale(found, now=time.time(), host=host,
                                                  pid_alive=found.host == host and _pid_alive(found.pid)):
                raise StudyBusy(name, found)
        raise SpecError("name", f"study {name!r}: lost the race for its lease five times",
                        "start the study again")
    except BaseException:
        engine.dispose()
        raise
