"""Where the libraries' own log lines go while ``servetune tune`` runs: the study's log file.

Optuna ("A new study created in RDB"), MLflow ("Creating initial MLflow database tables", "🏃 View
run ...") and Ray (its token-authentication notice) each print to the terminal by default, between
servetune's progress lines. While a study runs, every record of theirs goes to
``<runs_dir>/logs/<study>.log`` (INFO and above, with the logger's name and a timestamp); the
terminal keeps servetune's own lines and the libraries' real warnings and errors (WARNING and
above), less :data:`NOTICES`: messages a library logs as a warning that say nothing is wrong.
On the terminal each record is one line (a traceback stays in the file, which the line names); a
record the file cannot take (a full disk) is dropped there without a "Logging error" traceback.

Example:
    >>> import logging, tempfile
    >>> from pathlib import Path
    >>> log = Path(tempfile.mkdtemp()) / "s.log"
    >>> with libraries_to_file(log):
    ...     logging.getLogger("optuna.storages").info("A new study created in RDB with name: s")
    >>> "A new study created" in log.read_text()
    True
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["libraries_to_file", "LIBRARY_LOGGERS", "NOTICES"]

#: The loggers of the libraries a study drives (each configures its own terminal handler).
LIBRARY_LOGGERS: tuple[str, ...] = ("optuna", "mlflow", "ray", "alembic", "sqlalchemy", "urllib3", "filelock")
_INFO_LOGGERS: tuple[str, ...] = ("optuna", "mlflow", "ray", "alembic")

#: Warnings that are notices, not problems: kept in the log file, not shown on the terminal.
NOTICES: tuple[re.Pattern[str], ...] = (
    # Ray 2.6x turns token authentication on for a local cluster and says so at every start.
    re.compile(r"^Token authentication is enabled for this Ray cluster"),
)

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _NotNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(p.search(text) for p in NOTICES)


class _LogFile(logging.FileHandler):
    """The study's log file; a record it cannot write (a full disk) is dropped, not printed to the
    terminal as a "--- Logging error ---" traceback: the terminal handler still shows the warnings."""

    def handleError(self, record: logging.LogRecord) -> None:
        return None


class _OneLine(logging.Formatter):
    """A record on the terminal is one line: a traceback or the rest of a multi-line message (a
    library's SQL and parameters) stays in the log file, which the line names."""

    def __init__(self, fmt: str, log_file: Path) -> None:
        super().__init__(fmt)
        self.log_file = log_file

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            text = super().format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
        first, _, rest = text.partition("\n")
        return first + (f" (details in {self.log_file})" if rest or any(saved) else "")


class _LoadedThen(importlib.abc.MetaPathFinder):
    """Runs ``then()`` right after one of ``names`` is first imported, whoever imports it.

    MLflow and Ray install their terminal handlers at import. They used to be imported up front so
    that ours came after; that cost every ``servetune tune`` 1-4 s, a refused re-run or a resume
    with nothing to do included, which need neither. Now ``then`` takes their handlers off when
    (and if) the study imports them."""

    def __init__(self, names: tuple[str, ...], then: Callable[[], None]) -> None:
        self.names, self.then, self._finding = names, then, False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """The module's own loader, and ``then()`` once the module has run."""

    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self._loader, self._then = loader, then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._then()

    def __getattr__(self, name: str) -> Any:  # resource readers and the rest: the real loader's
        return getattr(self._loader, name)


def _to_root(names: tuple[str, ...]) -> None:
    """The loggers' own handlers off, their records to the root's (ours)."""
    for name in names:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True


@contextlib.contextmanager
def libraries_to_file(path: Path) -> Iterator[Path]:
    """Send the libraries' log records to ``path`` for the duration; restore everything after.

    Records of Optuna, MLflow, Ray and alembic go to the file from INFO up; every logger's records
    from WARNING up go to the file and to stderr (less :data:`NOTICES`), servetune's own included.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = _LogFile(path, encoding="utf-8")
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter(_FORMAT))
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.setLevel(logging.WARNING)
    to_terminal.addFilter(_NotNotice())
    to_terminal.setFormatter(_OneLine("%(levelname)s %(name)s: %(message)s", path))

    # The handlers hang on the root only, and the libraries' loggers propagate to it: ray.init
    # clears the "ray" logger's handlers (configure_logging=False), which would leave its records to
    # Python's last-resort stderr handler if ours hung there.
    saved: list[tuple[logging.Logger, list[logging.Handler], bool, int]] = []
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, list(logger.handlers), logger.propagate, logger.level))
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True
    for name in _INFO_LOGGERS:  # their INFO lines are worth keeping in the file; the others' are noise
        logging.getLogger(name).setLevel(logging.INFO)
    # A library imported from here on (MLflow, Ray: not before the study needs them) loses the
    # handlers it installs at import too.
    hook = _LoadedThen(tuple(n for n in ("optuna", "mlflow", "ray") if n not in sys.modules),
                       lambda: _to_root(LIBRARY_LOGGERS))
    sys.meta_path.insert(0, hook)
    root = logging.getLogger()
    root.addHandler(to_file)
    root.addHandler(to_terminal)  # without it, a handler on the root silences Python's last-resort stderr
    # MLflow prints "🏃 View run ... / 🧪 View experiment ..." to stdout (not a log record) for each
    # run it ends on a tracking server; the end of the study prints the one `mlflow ui` line instead.
    previous_url_env = os.environ.get("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    try:
        yield path
    finally:
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)
        if previous_url_env is None:
            os.environ.pop("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", None)
        else:
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = previous_url_env
        root.removeHandler(to_file)
        root.removeHandler(to_terminal)
        for logger, handlers, propagate, level in saved:
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            for handler in handlers:
                logger.addHandler(handler)
            logger.propagate, logger.level = propagate, level
        to_file.close()
