"""A study's fixed cost and the driver's cost per trial, on the quickstart (simulated, 30 trials).

Whole processes, as a user runs them (``python -m servetune tune jobs/quickstart.yaml`` in a fresh
folder): the quickstart, the same command again (refused: the study exists), and ``--resume`` of
the finished study (nothing left to run). Each figure is the wall time and the CPU seconds of the
command and of every process it started, its trial workers and a local Ray's servers included
(this script makes itself the subreaper of what the command leaves, and waits for all of it).

In process (``--driver``): the same study run by :func:`servetune.study.run_study`, with the
driver's CPU split into its phases: open (Optuna, MLflow store and runs), the dispatch loop
(propose, tell, MLflow, dataset, waiting for results), its share per trial, and the end (plots,
the study's MLflow run). The trial workers' CPU is what the local pool's processes used (a local
Ray's processes are still running then, so they are not in it). Each phase's CPU is the whole
process's (every thread: what the dispatch loop spent plus what MLflow's writer thread delivered
meanwhile); ``dispatch_thread_cpu_per_trial_ms`` is the dispatch loop's own thread only, the time
a trial's records keep the driver from its next trial.

Measured 2026-12-05 on a shared 2-core host (simulated backend, local pool, SQLite), ``--driver``
three times each, alternating with the tree before the change: the dispatch loop's own thread
50.5 ms per trial before (median; 46.0-55.8) and 35.0 ms after (34.5-38.9); the whole process
while the loop ran 89.0 ms before (81.0-97.8) and 69.8 ms after (66.4-78.4), the difference being
what MLflow's writer thread delivered meanwhile. The cut: one Optuna transaction for a trial's
attributes (its flags and prediction kept on the asked trial and written with its result), the
pre-screen's warm-compile view and the best trial kept as trials are told instead of every
finished trial read back per proposal and per feasible result. What is left on the thread is
mostly Optuna's ask and TPE sampling, its tell, and the Parquet append. Same 30 trials,
same winner (0.95 x 112, 3,257 tok/s).

Usage::

    PYTHONPATH=platform .venv/bin/python benchmarks/fixed_cost.py [--repeat 3] [--driver]
    SERVETUNE_POOL=ray PYTHONPATH=platform .venv/bin/python benchmarks/fixed_cost.py   # on a local Ray
"""

from __future__ import annotations

import argparse
import ctypes
import io
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "jobs" / "quickstart.yaml"
_PR_SET_CHILD_SUBREAPER = 36


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _reap_all() -> None:
    """Wait for every descendant this process became the subreaper of (a local Ray's servers)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def run_command(args: list[str], cwd: Path) -> tuple[float, float, int, str]:
    """(wall s, CPU s of the command and all it started, exit code, its last output line)."""
    cpu0, t0 = _children_cpu(), time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "servetune", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)
    wall = time.monotonic() - t0
    _reap_all()
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return wall, _children_cpu() - cpu0, proc.returncode, next((l for l in lines if "trial" in l and "servetune:" in l
                                                                and (" in " in l or "no trial ran" in l)),
                                                               lines[-1] if lines else "")


def whole_processes(repeat: int) -> dict[str, list[tuple[float, float]]]:
    figures: dict[str, list[tuple[float, float]]] = {"quickstart": [], "refused re-run": [], "no-op --resume": []}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="fixed-cost-") as tmp:
            folder = Path(tmp)
            for name, extra in (("quickstart", []), ("refused re-run", []), ("no-op --resume", ["--resume"])):
                wall, cpu, code, line = run_command(["tune", *extra, str(QUICKSTART)], folder)
                print(f"  {name}: {wall:.1f} s wall, {cpu:.1f} CPU-s, exit {code}: {line[:110]}", flush=True)
                figures[name].append((wall, cpu))
    return figures


def driver_phases() -> dict[str, Any]:
    """One in-process quickstart with the driver's CPU per phase (process_time) and the workers'."""
    from servetune.study import _driver as st
    from servetune.study import _recorder
    from servetune.spec.schema import load_spec

    spent: dict[str, float] = {"open": 0.0, "dispatch": 0.0, "end": 0.0}
    on_thread: dict[str, float] = dict.fromkeys(spent, 0.0)

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            c0, t0 = time.process_time(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.process_time() - c0
                on_thread[name] += time.thread_time() - t0
        return wrapper

    st._Driver.open = classmethod(timed("open", st._Driver.open.__func__))  # type: ignore[method-assign]
    st._Driver.dispatch_trials = timed("dispatch", st._Driver.dispatch_trials)  # type: ignore[method-assign]
    _recorder.Recorder.finish = timed("end", _recorder.Recorder.finish)  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory(prefix="fixed-cost-") as tmp:
        os.chdir(tmp)
        spec = load_spec(QUICKSTART)
        c0, w0, k0 = time.process_time(), time.monotonic(), _children_cpu()
        outcome = st.run_study(spec, out=io.StringIO())
        total, wall = time.process_time() - c0, time.monotonic() - w0
        workers = _children_cpu() - k0  # the pool's workers, reaped at its close (a local Ray's live on)
    return {"trials": outcome.trials_done, "wall_s": wall, "driver_cpu_s": total, "workers_cpu_s": workers,
            **{f"{k}_cpu_s": v for k, v in spent.items()},
            "dispatch_cpu_per_trial_ms": 1000 * spent["dispatch"] / max(1, outcome.trials_done),
            "dispatch_thread_cpu_per_trial_ms": 1000 * on_thread["dispatch"] / max(1, outcome.trials_done)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="whole-process rounds (medians reported)")
    parser.add_argument("--driver", action="store_true", help="the in-process driver split instead")
    args = parser.parse_args(argv)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    print(f"pool: SERVETUNE_POOL={os.environ.get('SERVETUNE_POOL', 'auto')}, {os.cpu_count()} CPUs", flush=True)
    if args.driver:
        for key, value in driver_phases().items():
            print(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
        return 0
    for name, runs in whole_processes(args.repeat).items():
        print(f"{name}: median {statistics.median(w for w, _ in runs):.1f} s wall, "
              f"{statistics.median(c for _, c in runs):.1f} CPU-s over {len(runs)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
