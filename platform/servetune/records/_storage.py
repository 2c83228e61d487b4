"""The Optuna storage the driver uses: one interface over SQLite and PostgreSQL, retried per call.

Contract:

* :func:`open_storage` turns ``storage.optuna_url`` into an Optuna storage: ``None`` stays
  ``None`` (Optuna's in-memory storage); any SQLAlchemy URL becomes Optuna's cached RDB storage
  wrapped in :class:`RetryingStorage`. Server databases (PostgreSQL, MySQL) get
  ``pool_pre_ping`` (a pooled connection that died with a server restart is replaced before use,
  instead of failing the next call) and, for PostgreSQL, a 10 s connect timeout unless the URL
  sets one (an unreachable host fails and is retried instead of hanging for the TCP timeout).
  Opening it connects and creates the tables, so call it inside :func:`servetune.records._retry.retry_call`;
  a driver that loses the race to stamp a new database's schema version to another one opening it at
  the same moment opens it again.
* :class:`RetryingStorage` runs every storage call through :func:`servetune.records._retry.retry_call`:
  a locked SQLite file or a PostgreSQL restart delays the call (capped exponential backoff, 60 s
  deadline) instead of ending the study. Each call is one transaction in Optuna's RDB storage,
  rolled back on error, so a retry never applies half a write. One case is made idempotent
  explicitly: finishing a trial (``set_trial_state_values``) whose earlier attempt committed but
  lost its answer with the connection returns success instead of "trial already finished".
* :func:`postgres_url` checks a PostgreSQL URL's driver before anything connects: psycopg 3
  (``postgresql+psycopg://``, the ``[postgres]`` extra) or psycopg2 (``postgresql+psycopg2://``,
  accepted where the user installed it); a bare ``postgresql://`` goes to whichever is installed
  (psycopg2 first, SQLAlchemy's own default). A driver that is missing is one line naming the
  extra, not SQLAlchemy's ``ModuleNotFoundError`` traceback.
* Errors that are not outages (a wrong password, a missing database, an ``IntegrityError``) are
  raised at once (:func:`servetune.records._retry.is_transient_storage_error`).

Example:
    >>> storage = open_storage("sqlite:///:memory:")
    >>> type(storage).__name__
    'RetryingStorage'
    >>> open_storage(None) is None
    True
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any, TypeVar, cast

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.study._frozen import FrozenStudy  # BaseStorage's own type; not re-exported
from optuna.trial import FrozenTrial, TrialState

from servetune.errors import SpecError
from servetune.records._retry import retry_call

__all__ = ["open_storage", "open_storage_read_only", "RetryingStorage", "engine_kwargs_for", "postgres_url"]

_T = TypeVar("_T")


def engine_kwargs_for(url: str) -> dict[str, Any]:
    """SQLAlchemy ``create_engine`` options for ``url`` (pure).

    Example:
        >>> engine_kwargs_for("sqlite:///optuna.db")
        {}
        >>> engine_kwargs_for("postgresql+psycopg://u@db:5432/optuna")
        {'pool_pre_ping': True, 'connect_args': {'connect_timeout': 10}}
        >>> engine_kwargs_for("postgresql://u@db/optuna?connect_timeout=3")
        {'pool_pre_ping': True}
    """
    if url.startswith("sqlite"):
        return {}  # Optuna's defaults: one file, one writer, nothing pooled across a restart
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("postgresql") and "connect_timeout=" not in url:
        kwargs["connect_args"] = {"connect_timeout": 10}
    return kwargs


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None  # found, not imported: no driver start-up cost
    except ImportError:  # a finder that refuses the name: not installed for this process either
        return False


def _with_driver(url: str, driver: str, field: str = "storage.optuna_url") -> str:
    """``url`` with its driver named, through SQLAlchemy's URL builder (user, password, host, database
    and query kept as SQLAlchemy reads them, never re-pasted as text).

    Example:
        >>> _with_driver("postgresql://u:p%40ss@db:5432/optuna?sslmode=require", "psycopg")
        'postgresql+psycopg://u:p%40ss@db:5432/optuna?sslmode=require'
    """
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        raise SpecError(field, "not a URL SQLAlchemy can read", "e.g. postgresql+psycopg://user:pass@host:5432/db") from None
    return parsed.set(drivername=f"postgresql+{driver}").render_as_string(hide_password=False)


def postgres_url(url: str, field: str = "storage.optuna_url") -> str:
    """``url`` with its PostgreSQL driver checked (any other URL unchanged); SpecError when missing.

    Example:
        >>> postgres_url("sqlite:///optuna.db")
        'sqlite:///optuna.db'
    """
    scheme, sep, _ = url.partition("://")
    dialect, _, driver = scheme.partition("+")
    if not sep or dialect != "postgresql" or driver not in ("", "psycopg", "psycopg2"):
        return url  # not PostgreSQL, or a driver servetune does not ship (asyncpg, pg8000): SQLAlchemy's call
    install = "pip install 'servetune[postgres]' (psycopg 3)"
    if driver == "":
        for module in ("psycopg2", "psycopg"):  # SQLAlchemy's default for a bare postgresql:// first
            if _installed(module):
                return _with_driver(url, module, field)
        raise SpecError(field, "a PostgreSQL URL, but no PostgreSQL driver is installed", install)
    if _installed(driver):
        return url
    if driver == "psycopg2":
        fix = ("psycopg 3 is installed: write postgresql+psycopg:// instead" if _installed("psycopg")
               else f"{install} and write postgresql+psycopg://, or pip install psycopg2-binary")
        raise SpecError(field, "postgresql+psycopg2:// needs psycopg2, which is not installed", fix)
    raise SpecError(field, "postgresql+psycopg:// needs psycopg 3, which is not installed", install)


def open_storage(url: str | None) -> RetryingStorage | None:
    """The study's storage for ``url`` (``None``: in memory). Connects: retry it as a whole."""
    if url is None:
        return None
    import sqlalchemy.exc

    url = postgres_url(url)
    try:
        rdb = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs_for(url))
    except sqlalchemy.exc.IntegrityError:
        # Two drivers creating the same new database at once both stamp its schema version (Optuna's
        # RDBStorage inserts the alembic_version row after create_all): one of them loses with "UNIQUE
        # constraint failed: alembic_version.version_num". The schema is there now; opening again finds it.
        rdb = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs_for(url))
    return RetryingStorage(optuna.storages._CachedStorage(rdb))


def open_storage_read_only(url: str) -> BaseStorage:
    """An existing study storage opened for reading only: no table created, no version stamped, no
    write possible (SQLite through ``mode=ro``, PostgreSQL sessions read-only). Not retried: a
    read-only command reports an outage at once. What ``servetune best`` reads through.

    Example:
        >>> import tempfile
        >>> url = f"sqlite:///{tempfile.mkdtemp()}/optuna.db"
        >>> _ = optuna.create_study(study_name="s", storage=url)
        >>> optuna.get_all_study_names(open_storage_read_only(url))
        ['s']
    """
    import sqlite3
    from pathlib import Path

    from sqlalchemy.engine import make_url

    url = postgres_url(url)
    kwargs = engine_kwargs_for(url)
    if url.startswith("sqlite"):
        database = make_url(url).database or ""
        target = Path(database).resolve().as_uri() + "?mode=ro"  # as_uri percent-encodes '?' and '#'
        kwargs["creator"] = lambda: sqlite3.connect(target, uri=True, check_same_thread=False)
    elif url.startswith("postgresql"):
        kwargs["connect_args"] = {**kwargs.get("connect_args", {}), "options": "-c default_transaction_read_only=on"}
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, skip_table_creation=True)


class RetryingStorage(BaseStorage):
    """Optuna storage that retries each call of ``inner`` through a brief outage (see module doc)."""

    def __init__(self, inner: BaseStorage) -> None:
        self.inner = inner

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        return retry_call(fn, what=f"{what} (Optuna storage)")

    # -- studies --------------------------------------------------------------------------------
    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        return self._call("create the study", lambda: self.inner.create_new_study(directions, study_name))

    def delete_study(self, study_id: int) -> None:
        self._call("delete the study", lambda: self.inner.delete_study(study_id))

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call(f"set study attribute {key}", lambda: self.inner.set_study_user_attr(study_id, key, value))

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call(f"set study attribute {key}", lambda: self.inner.set_study_system_attr(study_id, key, value))

    def get_study_id_from_name(self, study_name: str) -> int:
        return self._call("find the study", lambda: self.inner.get_study_id_from_name(study_name))

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._call("read the study", lambda: self.inner.get_study_name_from_id(study_id))

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self._call("read the study", lambda: self.inner.get_study_directions(study_id))

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call("read the study", lambda: self.inner.get_study_user_attrs(study_id))

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call("read the study", lambda: self.inner.get_study_system_attrs(study_id))

    def get_all_studies(self) -> list[FrozenStudy]:
        return self._call("list the studies", self.inner.get_all_studies)

    # -- trials ---------------------------------------------------------------------------------
    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        return self._call("create a trial", lambda: self.inner.create_new_trial(study_id, template_trial))

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: BaseDistribution) -> None:
        self._call(f"set a trial parameter ({param_name})", lambda: self.inner.set_trial_param(
            trial_id, param_name, param_value_internal, distribution))

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return self._call("find a trial", lambda: self.inner.get_trial_id_from_study_id_trial_number(
            study_id, trial_number))

    def get_trial_number_from_id(self, trial_id: int) -> int:
        return self._call("read a trial", lambda: self.inner.get_trial_number_from_id(trial_id))

    def get_trial_param(self, trial_id: int, param_name: str) -> float:
        return self._call("read a trial", lambda: self.inner.get_trial_param(trial_id, param_name))

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        failed = False

        def attempt() -> bool:
            if failed and state.is_finished():
                # The earlier attempt may have committed before the connection died: finishing
                # the trial again would raise "already finished". Same state and values: done.
                now = self.inner.get_trial(trial_id)
                if now.state == state and (values is None or list(now.values or []) == list(values)):
                    return True
            return self.inner.set_trial_state_values(trial_id, state, values)

        def mark(_: BaseException) -> None:
            nonlocal failed
            failed = True

        return retry_call(attempt, what=f"set a trial's state to {state.name} (Optuna storage)", on_retry=mark)

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        self._call("report an intermediate value", lambda: self.inner.set_trial_intermediate_value(
            trial_id, step, intermediate_value))

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call(f"set trial attribute {key}", lambda: self.inner.set_trial_user_attr(trial_id, key, value))

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call(f"set trial attribute {key}", lambda: self.inner.set_trial_system_attr(trial_id, key, value))

    def set_trial_attrs(self, trial_id: int, user: Mapping[str, Any], system: Mapping[str, Any]) -> None:
        """Several user and system attributes of a running trial in ONE transaction where the
        storage is Optuna's RDB storage (one commit, one fsync, instead of one per attribute:
        about half the storage time of a told trial); one call each elsewhere. Retried whole.

        In that transaction the trial is read and checked once, and the attributes it already
        holds are read in one query per kind (Optuna's own path for databases without an upsert),
        not once per attribute."""
        rdb = getattr(self.inner, "_backend", None)
        if not isinstance(rdb, optuna.storages.RDBStorage):
            for key, value in user.items():
                self.set_trial_user_attr(trial_id, key, value)
            for key, value in system.items():
                self.set_trial_system_attr(trial_id, key, value)
            return
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session

        kinds: tuple[tuple[Any, Mapping[str, Any]], ...] = (
            (models.TrialUserAttributeModel, user), (models.TrialSystemAttributeModel, system))

        def write() -> None:
            with _create_scoped_session(rdb.scoped_session, True) as transaction:
                trial = models.TrialModel.find_or_raise_by_id(trial_id, transaction)
                rdb.check_trial_is_updatable(trial_id, cast(TrialState, trial.state))
                for model, attrs in kinds:
                    if not attrs:
                        continue
                    held: dict[str, Any] = {a.key: a for a in transaction.query(model).filter(
                        model.trial_id == trial_id, model.key.in_(list(attrs)))}
                    for key, value in attrs.items():
                        text = json.dumps(value)
                        if key in held:
                            held[key].value_json = text
                        else:
                            transaction.add(model(trial_id=trial_id, key=key, value_json=text))

        self._call(f"set trial attributes {', '.join([*user, *system])}", write)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self._call("read a trial", lambda: self.inner.get_trial(trial_id))

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        return self._call("read the trials", lambda: self.inner.get_all_trials(study_id, deepcopy, states))

    def get_n_trials(self, study_id: int, state: tuple[TrialState, ...] | TrialState | None = None) -> int:
        return self._call("count the trials", lambda: self.inner.get_n_trials(study_id, state))

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        return self._call("read the best trial", lambda: self.inner.get_best_trial(study_id))

    def get_trial_params(self, trial_id: int) -> dict[str, Any]:
        return self._call("read a trial", lambda: self.inner.get_trial_params(trial_id))

    def get_trial_user_attrs(self, trial_id: int) -> dict[str, Any]:
        return self._call("read a trial", lambda: self.inner.get_trial_user_attrs(trial_id))

    def get_trial_system_attrs(self, trial_id: int) -> dict[str, Any]:
        return self._call("read a trial", lambda: self.inner.get_trial_system_attrs(trial_id))

    def remove_session(self) -> None:
        self.inner.remove_session()

    def check_trial_is_updatable(self, trial_id: int, trial_state: TrialState) -> None:
        self.inner.check_trial_is_updatable(trial_id, trial_state)

