"""Nightly job: tune every cell of a models x GPU types x workloads matrix, flag regressions.

    python jobs/nightly.py jobs/nightly.yaml [--date YYYYMMDD] [--inject-regression CELL:FACTOR ...]
    ray job submit --working-dir . --runtime-env-json '{"py_modules": ["platform/servetune"]}' \\
        -- python jobs/nightly.py jobs/nightly.yaml

Joins the running Ray cluster like ``jobs/tune.py`` (else a local Ray with logical GPUs), runs
:func:`servetune.nightly.run_nightly` and prints one line per cell. ``--inject-regression``
plants a slowdown in one cell's simulated engine (a GPU calibration override), for tests and demos.

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
    args = parser.parse_args(argv)

    from servetune.errors import SpecError
    from servetune.nightly import run_nightly, today
    from tune import connect

    try:
        inject = parse_injection(args.inject_regression)
        print(f"servetune nightly: {connect()}", flush=True)
        outcome = run_nightly(args.matrix, args.date or today(), inject=inject, out=sys.stdout)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    for cell in outcome.cells:
        word = "REGRESSION" if cell.verdict.regressed else "ok"
        print(f"servetune nightly {outcome.date}: {cell.cell}: {word}: {cell.verdict.reason}", flush=True)
    print(f"servetune nightly: report {outcome.report}; history {outcome.history}; "
          f"MLflow run {outcome.mlflow_run_id}", flush=True)
    return 1 if outcome.regressions else 0


if __name__ == "__main__":
    sys.exit(main())
