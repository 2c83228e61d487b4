"""Retry with capped exponential backoff for brief storage outages (SQLite locked, a DB restart).

Contract:

* :func:`retry_call` runs ``fn`` and, when it raises an error :func:`is_transient_storage_error`
  accepts, sleeps ``base_s * 2**k`` (capped at ``cap_s``) and tries again, until ``deadline_s``
  has passed; then the last error is raised unchanged. Any other error is raised at once.
* Transient: SQLAlchemy ``OperationalError`` / ``DisconnectionError`` / ``TimeoutError`` (pool),
  ``sqlite3.OperationalError`` ("database is locked", "unable to open database file"), and Optuna's
  ``StorageInternalError`` (its RDB storage wraps the SQLAlchemy error after rolling back), and
  the driver's own ``OperationalError`` / ``InterfaceError`` (psycopg 3, the ``[postgres]`` extra,
  and psycopg2 where a user still has it: both name them alike). For PostgreSQL that covers a
  server restart: "server closed the connection unexpectedly", "terminating connection due to
  administrator command", "the database system is shutting down / starting up", "Connection
  refused". An ``IntegrityError`` is a real conflict, never retried, and neither is a
  configuration mistake that waiting cannot fix (:data:`PERMANENT_MESSAGES`: a wrong password, a
  missing database or role, no ``pg_hba.conf`` entry), nor a full disk
  (:func:`servetune.records.diskspace.is_disk_full`): those fail at once, naming the cause.
* Every retry is logged at WARNING on ``servetune.records._retry`` with what was being done, so an outage
  shows up in the driver's log.
* Before each retry the garbage collector runs once: a statement that a Ctrl-C cut between SQLite's
  write and SQLAlchemy's result keeps its cursor in a reference cycle, and that cursor holds the
  database's write lock until it is collected (a full collection may not come for minutes), so every
  retry would find the file "locked" by this very process.

Example:
    >>> calls = []
    >>> def flaky():
    ...     calls.append(1)
    ...     if len(calls) < 3:
    ...         import sqlite3
    ...         raise sqlite3.OperationalError("database is locked")
    ...     return "ok"
    >>> retry_call(flaky, what="tell a trial", base_s=0.001)
    'ok'
    >>> len(calls)
    3
"""

from __future__ import annotations

import gc
import logging
import re
import sqlite3
import time
from collections.abc import Callable
from typing import TypeVar

from servetune.records.diskspace import is_disk_full

__all__ = ["retry_call", "is_transient_storage_error", "backoff_delays", "PERMANENT_MESSAGES"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Connection errors that are configuration mistakes, not outages (PostgreSQL's server messages).
PERMANENT_MESSAGES = re.compile(
    r"password authentication failed|authentication failed for user|no pg_hba\.conf entry"
    r"|database \"[^\"]*\" does not exist|role \"[^\"]*\" does not exist|invalid dsn|invalid connection option")


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every error it wraps (``__cause__``, else ``__context__``), outermost first."""
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in out):
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def is_transient_storage_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it wraps) is a storage outage worth waiting out."""
    chain = _chain(exc)
    if any(PERMANENT_MESSAGES.search(str(e)) for e in chain):
        return False  # waiting does not fix a wrong password or a missing database
    if is_disk_full(exc):
        return False  # nor a full disk: SQLite says "database or disk is full" as an OperationalError
    for current in chain:
        if isinstance(current, sqlite3.OperationalError):
            return True
        module = type(current).__module__
        name = type(current).__name__
        if module.startswith("sqlalchemy"):
            if name == "IntegrityError":
                return False
            if name in ("OperationalError", "DisconnectionError", "TimeoutError", "InterfaceError"):
                return True
        if module.startswith("optuna") and name == "StorageInternalError":
            return True
        # The drivers' own classes: psycopg 3 (psycopg.OperationalError, psycopg.errors.AdminShutdown,
        # ConnectionTimeout, ...) and psycopg2 (psycopg2.errors.AdminShutdown, ...) subclass
        # OperationalError or InterfaceError under the same names.
        if module.split(".")[0] in ("psycopg", "psycopg2") and any(
                base.__name__ in ("OperationalError", "InterfaceError") for base in type(current).__mro__):
            return True
    return False


def backoff_delays(base_s: float, cap_s: float, n: int) -> list[float]:
    """The first ``n`` sleeps of the schedule (pure).

    Example:
        >>> backoff_delays(0.1, 1.0, 6)
        [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    """
    return [min(cap_s, base_s * 2**k) for k in range(n)]


def retry_call(fn: Callable[[], _T], *, what: str, deadline_s: float = 60.0, base_s: float = 0.1,
               cap_s: float = 2.0, retry_on: Callable[[BaseException], bool] = is_transient_storage_error,
               on_retry: Callable[[BaseException], None] | None = None) -> _T:
    """``fn()``, retried on transient errors with capped exponential backoff for up to ``deadline_s``.

    ``on_retry`` (optional) runs after each failed attempt, before the sleep: the place to undo a
    half-done step (e.g. a trial asked before the error) so the retry does not duplicate it.

    Example:
        >>> retry_call(lambda: 42, what="nothing")
        42
    """
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - filtered by retry_on, re-raised otherwise
            if not retry_on(exc):
                raise
            delay = min(cap_s, base_s * 2**attempt)
            if time.monotonic() - started + delay > deadline_s:
                raise
            attempt += 1
            _log.warning("storage unavailable while trying to %s (attempt %d, retrying in %.2f s): %s",
                         what, attempt, delay, str(exc).splitlines()[0][:300])
            if on_retry is not None:
                on_retry(exc)
            gc.collect()  # a cursor an interrupt left in a cycle releases the lock it holds
            time.sleep(delay)
