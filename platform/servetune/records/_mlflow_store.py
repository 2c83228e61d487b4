"""A local MLflow store (``sqlite:///.../mlflow.db``) is created whole or not at all.

Contract:

* :func:`ensure_sqlite_store` runs before the tracker's first MLflow call on a ``sqlite:`` tracking
  URI. Under an exclusive lock on ``<db>.lock`` beside the database (``fcntl.flock``: released by
  the kernel when its holder dies), it creates a missing store in a temporary file beside it
  (``<db>.creating``), runs MLflow's own table creation and migrations there, checks the schema
  is at MLflow's head revision, and renames the file into place. A SIGKILL at any point leaves
  either no ``mlflow.db`` or a complete one (MLflow migrating the final file in place left
  "table webhooks already exists" for good when killed half-way). Two drivers starting together
  serialise on the lock: the second finds the store built.
* A store left half-built by such a kill (its tables incomplete, no schema revision stamped, or
  stamped at a revision short of the head with neither a run nor an experiment in it: MLflow
  creates its default experiment only after the last migration) is moved aside to
  ``<db>.incomplete-<UTC time>`` (nothing is deleted) and built again. One that holds runs is
  never touched: MLflow's own error says what to do.
* A store at another complete revision that holds experiments or runs (an older MLflow's) is
  MLflow's business (``mlflow db upgrade``), not rebuilt here.

Example:
    >>> ensure_sqlite_store("http://127.0.0.1:5000")  # not a local store: nothing to do
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["ensure_sqlite_store", "store_state", "sqlite_store_path"]

_log = logging.getLogger(__name__)


def sqlite_store_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:`` tracking URI (None: not a file-backed SQLite store).

    Example:
        >>> sqlite_store_path("sqlite:///runs/mlflow.db")
        PosixPath('runs/mlflow.db')
        >>> sqlite_store_path("sqlite:///:memory:") is None, sqlite_store_path("http://h:5000") is None
        (True, True)
    """
    if not uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(uri).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def _file_url(path: Path) -> Any:
    """The SQLAlchemy URL of a SQLite file, built (never pasted: a folder named ``x.db?y`` stays a path)."""
    from sqlalchemy.engine import URL
    return URL.create("sqlite", database=str(path.resolve()))


def store_state(path: Path) -> str:
    """``missing``, ``complete``, ``incomplete`` (half-built, no run in it) or ``in use`` (runs, or
    an older revision's experiments): what :func:`ensure_sqlite_store` does with the file."""
    if not path.exists():
        return "missing"
    if path.stat().st_size == 0:
        return "incomplete"
    import sqlalchemy as sa
    from mlflow.store.db.utils import _all_tables_exist, _get_latest_schema_revision

    engine = sa.create_engine(_file_url(path))
    try:
        tables = set(sa.inspect(engine).get_table_names())
        with engine.connect() as conn:
            revision = (conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
                        if "alembic_version" in tables else None)
            runs = conn.execute(sa.text("SELECT count(*) FROM runs")).scalar() if "runs" in tables else 0
            experiments = (conn.execute(sa.text("SELECT count(*) FROM experiments")).scalar()
                           if "experiments" in tables else 0)
        if _all_tables_exist(engine) and revision == _get_latest_schema_revision():
            return "complete"
        if revision is not None and _all_tables_exist(engine) and experiments:
            return "in use"  # an older MLflow's store: `mlflow db upgrade` is MLflow's business
        return "in use" if runs else "incomplete"
    except sa.exc.DatabaseError:  # not an SQLite file at all: MLflow's error names it
        return "in use"
    finally:
        engine.dispose()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _unsynced(dbapi_connection: Any, _record: Any) -> None:
    """A scratch file's connection: SQLite writes without waiting for the disk."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA synchronous=OFF")
    cursor.execute("PRAGMA journal_mode=MEMORY")
    cursor.close()


def _build(path: Path) -> None:
    """MLflow's tables and migrations in ``<db>.creating``, checked, then renamed onto ``path``."""
    import sqlalchemy as sa
    from mlflow.store.db.utils import _get_latest_schema_revision, _get_schema_version, _initialize_tables

    tmp = path.with_name(path.name + ".creating")
    for leftover in (tmp, tmp.with_name(tmp.name + "-journal")):
        leftover.unlink(missing_ok=True)  # a killed builder's; we hold the lock
    engine = sa.create_engine(_file_url(tmp))
    # No sync per migration step: the file is not the store until the fsync and rename below, and
    # a builder killed before them leaves only ``<db>.creating``. MLflow's 50-odd migrations each
    # committed with an fsync (2-8 s of a study's start on a busy disk).
    sa.event.listen(engine, "connect", _unsynced)
    try:
        _initialize_tables(engine)
        if _get_schema_version(engine) != _get_latest_schema_revision():
            raise RuntimeError(f"MLflow's migrations did not reach the head revision in {tmp}")
    finally:
        engine.dispose()
    fd = os.open(tmp, os.O_RDONLY)  # every page on disk before the rename makes it the store
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def ensure_sqlite_store(uri: str) -> None:
    """Make the ``sqlite:`` store of ``uri`` whole before MLflow opens it (see the module doc)."""
    path = sqlite_store_path(uri)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if store_state(path) == "complete":
        return  # the common case: no lock taken
    with _locked(path):
        state = store_state(path)
        if state in ("complete", "in use"):
            return
        if state == "incomplete":
            aside = path.with_name(f"{path.name}.incomplete-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S%f}")
            for suffix in ("", "-journal", "-wal", "-shm"):  # a hot journal must not meet the new file
                part = path.with_name(path.name + suffix)
                if part.exists():
                    os.replace(part, aside.with_name(aside.name + suffix))
            _log.warning("MLflow store %s was left half-built (no run in it); moved to %s and built again",
                         path, aside)
        _build(path)
