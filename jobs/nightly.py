"""Nightly job: tune every cell of a models x GPU types x workloads matrix, flag regressions.

    python jobs/nightly.py jobs/nightly.yaml [--date YYYYMMDD] [--inject-regression CELL:FACTOR ...]
    ray job submit --working-dir . --runtime-env-json '{"py_modules": ["platform/servetune"]}' \\
        -- python jobs/nightly.py jobs/nightly.yaml --output-dir "$PWD/servetune-nightly"

Joins the running Ray cluster like ``jobs/tune.py`` (else a local Ray with logical GPUs), runs
:func:`servetune.nightly.run_nightly` and prints one line per cell. ``--inject-regression``
plants a slowdown in one cell's simulated engine (a GPU calibration override), for tests and demos.
As ``jobs/tune.py``: the job's Python is checked for servetune's core first, and inside a Ray job
an output dir in Ray's temporary working dir is refused (``--output-dir`` takes an absolute path,
where the next night finds this night's history); the last lines are the commands that reach the
night's stores.

Exit codes: 0 no regression, 1 a regression (or a cell with no feasible configuration where there
was one before), 2 a bad matrix or option (the message names the field).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_PLATFORM = Path(__file__).resolve().parent.parent / "platform"
if _PLATFORM.is_dir() and str(_PLATFORM) not in sys.path:
    sys.path.insert(0, str(_PLATFORM))
sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["main", "parse_injection"]


def parse_injection(values: list[str]) -> dict[str, float]:
    """``["cell:0.7"]`` -> ``{"cell": 0.7}``; a malformed value is a SpecError naming the option.

    Example:
        >>> parse_injection(["m.H200.chat:0.5"])
        {'m.H200.chat': 0.5}
    """
    from servetune.errors import SpecError

    out = {}
    for value in values:
        cell, _, factor = value.rpartition(":")
        try:
            out[cell] = float(factor)
        except ValueError:
            cell = ""
        if not cell or out.get(cell, 0) <= 0:
            raise SpecError("--inject-regression", f"expected CELL:FACTOR with FACTOR > 0, got {value!r}",
                            "e.g. --inject-regression servetune-test-850m.H200.chat:0.7")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one night; returns the exit code.

    Example:
        >>> main(["jobs/nightly.yaml", "--date", "20260101"])   # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="jobs/nightly.py", description="Run the nightly tuning matrix.")
    parser.add_argument("matrix", help="the nightly matrix (YAML)")
    parser.add_argument("--date", default=None, help="the night, YYYYMMDD (default: today, UTC)")
    parser.add_argument("--inject-regression", action="append", default=[], metavar="CELL:FACTOR",
                        help="run CELL's simulated engine at FACTOR x its speed (e.g. 0.7)")
    parser.add_argument("--output-dir", default=None, metavar="ABS_PATH",
                        help="override the matrix's output.dir: an absolute path the next night reads too")
    args = parser.parse_args(argv)
    from tune import check_environment, connect

    problem = check_environment()
    if problem:
        print(problem, file=sys.stderr, flush=True)
        return 2

    from servetune.cluster import job_output_problem, sqlite_path, store_commands
    from servetune.errors import SpecError
    from servetune.nightly import expand_matrix, load_matrix, nightly_stores, output_root, run_nightly, today

    try:
        inject = parse_injection(args.inject_regression)
        if args.output_dir is not None and not Path(args.output_dir).is_absolute():
            raise SpecError("--output-dir", f"expected an absolute path, got {args.output_dir!r}",
                            'e.g. --output-dir "$PWD/servetune-nightly" (a path the next night reads too)')
        matrix, cwd = load_matrix(args.matrix), Path.cwd()
        root = output_root(matrix, cwd, args.output_dir)
        optuna_url, mlflow_uri = nightly_stores(matrix, root)
        bad = job_output_problem({
            "output.dir": (str(args.output_dir or (matrix.get("output") or {}).get("dir", "servetune-nightly")), root),
            "tracking.mlflow_uri": (mlflow_uri, sqlite_path(mlflow_uri, cwd))}, cwd)
        if bad is not None:
            raise bad
        print(f"servetune nightly: {connect()}", flush=True)
        date = args.date or today()
        outcome = run_nightly(args.matrix, date, inject=inject, out=sys.stdout, output_dir=root)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    for cell in outcome.cells:
        word = "REGRESSION" if cell.verdict.regressed else "ok"
        print(f"servetune nightly {outcome.date}: {cell.cell}: {word}: {cell.verdict.reason}", flush=True)
    print(f"servetune nightly: report {outcome.report}; history {outcome.history}; "
          f"MLflow run {outcome.mlflow_run_id}", flush=True)
    for cell in expand_matrix(matrix):
        best = store_commands(cell.study_name(date), optuna_url, root / "dataset", root / "report.md", mlflow_uri)[0]
        print(f"servetune nightly: results: {best}", flush=True)
    for line in store_commands(None, None, root / "dataset", root / "reports" / date / "studies.md", mlflow_uri):
        print(f"servetune nightly: results: {line}", flush=True)
    return 1 if outcome.regressions else 0


if __name__ == "__main__":
    sys.exit(main())
