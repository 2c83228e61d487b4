"""Ray job entrypoint: run one servetune study on an existing Ray cluster.

Submit it from the repository root (the working dir is the repo, so ``platform/`` travels with it)::

    ray job submit --working-dir . --runtime-env-json '{"py_modules": ["platform/servetune"]}' \\
        -- python jobs/tune.py jobs/quickstart.yaml --runs-dir "$PWD/servetune-runs" --trials 20 [--resume]

The job's Python must have servetune's core installed (checked first: a missing package is one
line naming it and the fix, exit 2). A job runs in Ray's temporary copy of the working dir, so a
store there (a relative ``output.runs_dir``) is refused: ``--runs-dir`` takes an absolute path the
submitting machine reaches, or the spec points at PostgreSQL and an ``mlflow server``. The job's
last lines are the ``servetune best`` / ``report`` / ``mlflow ui`` commands that reach its stores.

or run it as a plain driver next to a cluster: ``RAY_ADDRESS=10.0.0.1:6379 python jobs/tune.py S.yaml``.
It joins the running cluster (``RAY_ADDRESS``, the job's own cluster, or one started on this host
with ``ray start``; a fresh local Ray with logical GPUs when there is none), runs the study with
:func:`servetune.study.run_study`, and prints one progress line at a time (``ray job logs`` shows
them). Trials run only on the nodes of the spec's GPU type (``accelerator_type:<TYPE>``).

Exit codes, as ``servetune tune``: 0 a best configuration was found, 1 none met the constraints
(or the study was interrupted with none), 2 a bad spec or option (the message names the field).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

# The working dir is the repository root; py_modules may already provide servetune, but a plain
# `python jobs/tune.py` (or a job without py_modules) needs platform/ on the path.
_PLATFORM = Path(__file__).resolve().parent.parent / "platform"
if _PLATFORM.is_dir() and str(_PLATFORM) not in sys.path:
    sys.path.insert(0, str(_PLATFORM))

__all__ = ["main", "connect", "check_environment"]


def check_environment() -> str | None:
    """One line naming what this Python lacks of servetune's core (None: all there). Standard
    library only, so it runs before anything imports pandas, Ray or Optuna."""
    from servetune.requirements import check_core

    return check_core(Path(__file__).resolve().parent.parent / "pyproject.toml")


def _cluster_running() -> bool:
    """True when a Ray cluster seems to run on this host (``ray start`` leaves its address file in
    Ray's default temp dir; the file may be stale, so the caller still handles a failed connect)."""
    import tempfile

    return Path(tempfile.gettempdir() if os.name == "nt" else "/tmp", "ray", "ray_current_cluster").is_file()


def connect() -> str:
    """Join the existing cluster when there is one; returns how (for the log).

    ``RAY_ADDRESS`` (set by ``ray job submit`` for the job's driver) wins; else a cluster started on
    this host; else nothing is started here and :func:`run_study` starts a local Ray itself.
    """
    import ray

    if ray.is_initialized():
        return "already connected"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(_PLATFORM), os.environ.get("PYTHONPATH")) if p)}
    kwargs: dict[str, Any] = {"log_to_driver": False, "runtime_env": {"env_vars": env}, "configure_logging": False}
    if os.environ.get("RAY_ADDRESS") or _cluster_running():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], **kwargs)
        else:
            try:
                ray.init(address="auto", **kwargs)
            except ConnectionError:  # a stale address file: nothing is running after all
                return "no running cluster (stale address file): a local Ray with logical GPUs"
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        return f"joined the Ray cluster at {os.environ.get('RAY_ADDRESS') or 'auto'} ({len(nodes)} nodes, " \
               f"{int(ray.cluster_resources().get('GPU', 0))} GPUs)"
    return "no running cluster: a local Ray with logical GPUs"


def main(argv: list[str] | None = None) -> int:
    """Parse the options, join the cluster, run the study; returns the exit code.

    Example:
        >>> main(["jobs/quickstart.yaml", "--trials", "4"])   # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="jobs/tune.py", description="Run a servetune study as a Ray job.")
    parser.add_argument("spec", help="the study spec (YAML)")
    parser.add_argument("--trials", type=int, default=None, help="override budget.trials")
    parser.add_argument("--parallel", type=int, default=None, help="override budget.parallel")
    parser.add_argument("--backend", choices=("auto", "vllm", "sim", "replay"), default=None)
    parser.add_argument("--resume", action="store_true", help="continue the study of the same name")
    parser.add_argument("--runs-dir", default=None, metavar="ABS_PATH",
                        help="override output.runs_dir: an absolute path the submitting machine reaches")
    args = parser.parse_args(argv)
    problem = check_environment()
    if problem:
        print(problem, file=sys.stderr, flush=True)
        return 2

    from servetune.cluster import job_output_problem, sqlite_path, store_commands
    from servetune.errors import SpecError
    from servetune.spec.schema import load_spec
    from servetune.study import run_study

    try:
        if args.runs_dir is not None and not Path(args.runs_dir).is_absolute():
            raise SpecError("--runs-dir", f"expected an absolute path, got {args.runs_dir!r}",
                            'e.g. --runs-dir "$PWD/servetune-runs" (a path the submitting machine reaches)')
        spec = load_spec(args.spec).with_overrides(backend=args.backend, trials=args.trials, parallel=args.parallel,
                                                   runs_dir=args.runs_dir)
        cwd = Path.cwd()
        bad = job_output_problem({
            "output.runs_dir": (str((spec.source.get("output") or {}).get("runs_dir", "servetune-runs")),
                                spec.output.runs_dir),
            "output.dataset_dir": (str(spec.output.dataset_dir), spec.output.dataset_dir),
            "storage.optuna_url": (str(spec.storage.optuna_url), sqlite_path(spec.storage.optuna_url, cwd)),
            "tracking.mlflow_uri": (spec.tracking.mlflow_uri, sqlite_path(spec.tracking.mlflow_uri, cwd))}, cwd)
        if bad is not None:
            raise bad
        print(f"servetune job: {connect()}", flush=True)
        # Which code runs: the job's py_modules / working dir, or an installed package.
        print(f"servetune job: servetune from {Path(sys.modules['servetune'].__file__ or '?').parent}", flush=True)
        outcome = run_study(spec, resume=args.resume, out=sys.stdout)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    finish = [f"servetune job: results: {line}" for line in store_commands(
        spec.name, spec.storage.optuna_url, spec.output.dataset_dir, spec.output.runs_dir / "report.md",
        spec.tracking.mlflow_uri)]
    ran = (f"no trial ran; the study holds {outcome.trials_done} told trials" if outcome.trials_run == 0
           else f"{outcome.trials_done} trials in {outcome.wall_s:.1f} s")
    print(f"servetune job: {ran}: {outcome.ok} served, "
          f"{outcome.startup_failed} failed at startup, {outcome.pruned} pruned, {outcome.other_failed} other failures"
          + (f", {outcome.infra_failed} infrastructure failures" if outcome.infra_failed else "")
          + (f"; {outcome.infra_retried} re-run after an infrastructure failure" if outcome.infra_retried else ""),
          flush=True)
    if outcome.best_flags is None:
        print("servetune job: no trial met the constraints", flush=True)
        print("\n".join(finish), flush=True)
        return 1
    m = outcome.best_metrics or {}
    print(f"servetune job: best trial #{outcome.best_number}: {m.get('output_throughput', 0):,.0f} output tok/s",
          flush=True)
    print(f"servetune job: run it with:\n  {outcome.best_command}", flush=True)
    print("\n".join(finish), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
