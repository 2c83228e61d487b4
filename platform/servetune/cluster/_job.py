"""A study run as a Ray job: where its results may go, and the commands that reach them afterwards.

``ray job submit --working-dir .`` runs the entrypoint inside Ray's temporary copy of the working
dir (``<ray temp>/.../runtime_resources/working_dir_files/_ray_pkg_<hash>/``). A store there
(a relative ``output.runs_dir``, a relative SQLite URL) is out of the submitting machine's reach
and vanishes with Ray's temp dir, so a job refuses it before any trial runs: one
:class:`~servetune.errors.SpecError` naming the field and the fix (an absolute shared path, or the
PostgreSQL / ``mlflow server`` stores). At its end a job prints the exact ``servetune best`` /
``servetune report`` / ``mlflow ui`` commands that reach its stores (:func:`store_commands`).

Example:
    >>> in_ray_working_dir(Path("/tmp/ray/s1/runtime_resources/working_dir_files/_ray_pkg_ab/runs"))
    True
    >>> in_ray_working_dir(Path.home() / "servetune-runs")
    False
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path

from servetune.errors import SpecError
from servetune.redact import redact_url

__all__ = ["in_ray_working_dir", "sqlite_path", "job_output_problem", "store_commands", "JOB_OUTPUT_FIX"]

#: What to do about a store inside Ray's temporary working dir (README's cluster section says the same).
JOB_OUTPUT_FIX = ("give an absolute path on storage the submitting machine reaches (output.runs_dir: "
                  "RUNS_DIR, or --runs-dir RUNS_DIR, with RUNS_DIR an absolute path), or use the PostgreSQL "
                  "(storage.optuna_url) and `mlflow server` (tracking.mlflow_uri) stores")


def in_ray_working_dir(path: Path) -> bool:
    """True for a path inside a Ray job's temporary working dir (or any of Ray's runtime resources)."""
    return any(part == "runtime_resources" or part.startswith("_ray_pkg_") for part in path.parts)


def sqlite_path(url: str | None, cwd: Path) -> Path | None:
    """The file of a ``sqlite:///`` URL, resolved from ``cwd`` when relative; None for other URLs.

    Example:
        >>> sqlite_path("sqlite:///runs/optuna.db", Path("/w")), sqlite_path("postgresql://h/db", Path("/w"))
        (PosixPath('/w/runs/optuna.db'), None)
    """
    if not url or not url.startswith("sqlite:///"):
        return None
    path = Path(url[len("sqlite:///"):])
    return path if path.is_absolute() else cwd / path


def job_output_problem(stores: Mapping[str, tuple[str, Path | None]], cwd: Path) -> SpecError | None:
    """The first store (field -> (as configured, resolved path or None)) that lies in Ray's
    temporary working dir, as the error to raise; None when every store is reachable.

    Example:
        >>> pkg = Path("/tmp/ray/s1/runtime_resources/working_dir_files/_ray_pkg_ab")
        >>> job_output_problem({"output.runs_dir": ("servetune-runs", pkg / "servetune-runs")}, pkg).field
        'output.runs_dir'
    """
    for field, (configured, path) in stores.items():
        if path is not None and in_ray_working_dir(path.resolve() if path.is_absolute() else cwd / path):
            return SpecError(field, f"{configured!r} resolves into Ray's temporary copy of the job's working dir "
                                    f"({path}): the submitting machine never sees it and it vanishes with Ray's "
                                    "temp dir", JOB_OUTPUT_FIX)
    return None


def store_commands(study: str | None, optuna_url: str | None, dataset_dir: Path, report: Path,
                   mlflow_uri: str) -> list[str]:
    """The commands that read a study's stores from another shell (credentials masked); with
    ``study`` None, the report covers every study in the dataset and no ``best`` line is given.

    Example:
        >>> for line in store_commands("q", "sqlite:////s/optuna.db", Path("/s/dataset"), Path("/s/report.md"),
        ...                            "sqlite:////s/mlflow.db"):
        ...     print(line)
        servetune best q --storage sqlite:////s/optuna.db
        servetune report --study q --dataset /s/dataset --out /s/report.md
        mlflow ui --backend-store-uri sqlite:////s/mlflow.db
    """
    q = shlex.quote
    out = []
    if optuna_url and study is not None:
        out.append(f"servetune best {q(study)} --storage {q(redact_url(optuna_url))}")
    only = f"--study {q(study)} " if study is not None else ""
    out.append(f"servetune report {only}--dataset {q(str(dataset_dir))} --out {q(str(report))}")
    if mlflow_uri.startswith(("http://", "https://")):
        out.append(f"open {redact_url(mlflow_uri)} (MLflow server)")
    else:
        out.append(f"mlflow ui --backend-store-uri {q(redact_url(mlflow_uri))}")
    return out
