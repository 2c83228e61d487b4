"""Simulated and replayed trials in worker processes on the driver's machine: the TrialPool contract
(:class:`servetune.cluster.base.Pool`) without a Ray to start.

A simulated trial needs no GPU and no node: what Ray gave it was a process to run in and a count of
logical GPUs that bounds how many run at once. Starting a local Ray for that cost a study 10-20 s
(its GCS, raylet and agents, then a worker process per actor importing servetune) on a 2-core
machine. :class:`LocalPool` keeps the same promises with the standard library:

- slots: ``num_gpus`` logical GPUs (ids ``"0"``, ``"1"``, ...); a trial takes ``gpus`` of them
  while it runs, and its result records which (``gpu_ids``, evidence ``local_gpu_ids=[...]``);
- workers: one process per running trial (``python -m servetune.cluster.local``, the driver's own
  interpreter and package path; never a fork of the driver's threads, and never a re-run of the
  driver's own script, as ``multiprocessing`` would do), kept for the next trial: each imports
  servetune once per study;
- a trial's own failure is its result (``engines.run_trial``); a worker that dies (killed, out of
  memory) gives its trial a ``crashed`` result naming the exit, the study goes on, and finished
  trials are never touched;
- an ``infra_error`` result is run again in a fresh worker, up to :data:`MAX_INFRA_ATTEMPTS` attempts;
- ``close`` and ``cancel_all`` stop every worker (a driver killed outright leaves none either: a
  worker waiting for its next task sees the driver's end of the pipe close and exits).

Example:
    >>> pool = LocalPool.start(num_gpus=2)                         # doctest: +SKIP
    >>> pool.submit(7, task, backend="sim", gpus=1)                # doctest: +SKIP
    >>> pool.wait(timeout_s=60)                                    # doctest: +SKIP
    [(7, TrialResult(status=<TrialStatus.OK: 'ok'>, ...))]
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

from servetune.cluster.base import MAX_INFRA_ATTEMPTS, Runner
from servetune.engines.base import TrialTask
from servetune.result import TrialResult, TrialStatus

__all__ = ["LocalPool", "exit_cause"]

_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
#: How long ``close`` waits for an idle worker to exit before it is killed.
_EXIT_WAIT_S = 2.0

T = TypeVar("T")


def exit_cause(exitcode: int | None) -> str:
    """Why a worker process ended, in words. Pure.

    Example:
        >>> print(exit_cause(-9)); print(exit_cause(3))
        the trial's worker process was killed by SIGKILL
        the trial's worker process exited with code 3
    """
    if exitcode is None:
        return "the trial's worker process ended"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the trial's worker process was killed by {name}"
    return f"the trial's worker process exited with code {exitcode}"


def _serve(tasks: Connection, results: Connection) -> None:
    """A worker's loop: run each ``(task, backend, runner)`` received, send its result back;
    ``None`` or the driver's end closing ends it. Ctrl-C is the driver's to handle (it stops the
    workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from servetune.engines import run_trial

    while True:
        try:
            message = tasks.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        task, backend, runner = message
        result = (runner or run_trial)(task, backend)
        try:
            results.send(result)
        except (BrokenPipeError, OSError):
            return


@dataclasses.dataclass
class _Worker:
    process: subprocess.Popen[bytes]
    tasks: Connection  # the driver's end of the task pipe
    results: Connection  # the driver's end of the result pipe

    @classmethod
    def start(cls) -> _Worker:
        """A worker process on the driver's interpreter and servetune, talking over two pipes."""
        task_r, task_w = os.pipe()
        result_r, result_w = os.pipe()
        # The driver's servetune first, then the driver's own path: a runner given to the pool is
        # unpickled by reference, from the module that defines it.
        path = os.pathsep.join(dict.fromkeys(p for p in (_PACKAGE_PARENT, *sys.path) if p))
        try:
            process = subprocess.Popen([sys.executable, "-m", "servetune.cluster.local", str(task_r), str(result_w)],
                                       pass_fds=(task_r, result_w), env={**os.environ, "PYTHONPATH": path},
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
        finally:
            os.close(task_r)
            os.close(result_w)
        return cls(process, Connection(task_w, readable=False), Connection(result_r, writable=False))

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, wait_s: float) -> None:
        """Ask it to end (an idle one does at once), then kill it if it is still there."""
        try:
            self.tasks.send(None)
        except (BrokenPipeError, OSError):
            pass
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(wait_s)
        self.tasks.close()
        self.results.close()


@dataclasses.dataclass
class _Running:
    trial_number: int
    task: TrialTask
    backend: str
    gpu_ids: list[str]
    worker: _Worker
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    attempts: list[str] = dataclasses.field(default_factory=list)


class LocalPool:
    """Runs trials in local worker processes while free (logical) GPU slots allow; collects results."""

    def __init__(self, total_gpus: int, runner: Runner | None = None) -> None:
        self.total_gpus = self.cluster_gpus = total_gpus
        self.quarantined: list[str] = []  # never filled: a simulated GPU keeps no memory behind
        self.quarantine_notes: list[str] = []
        self.infra_notes: list[str] = []
        self.started_local_ray = False
        self.beside_cluster: str | None = None
        self.reuse_actors = True  # a worker is a process, not GPUs: always kept for the next trial
        self._runner = runner  # replaces engines.run_trial in the workers (picklable: a module-level function)
        self._free_ids = [str(i) for i in range(total_gpus)]
        self._running: dict[int, _Running] = {}
        self._idle: list[_Worker] = []

    @classmethod
    def start(cls, num_gpus: int, runner: Runner | None = None) -> LocalPool:
        """A pool of ``num_gpus`` logical GPU slots; its workers start with the first trials."""
        return cls(num_gpus, runner=runner)

    @property
    def busy_gpus(self) -> int:
        return sum(len(r.gpu_ids) for r in self._running.values())

    @property
    def free_gpus(self) -> int:
        return self.total_gpus - self.busy_gpus

    @property
    def running(self) -> list[int]:
        return list(self._running)

    def gpu_free(self, backend: str) -> bool:
        """A local trial asks for no GPU (the slots only bound how many run at once)."""
        return True

    def on_worker(self, fn: Callable[[], T], gpu_type: str, timeout_s: float = 0.0) -> T | None:
        """``fn()`` in this process: the workers are this machine's, with this interpreter and environment
        (``gpu_type`` and ``timeout_s``, the Ray pool's, do not apply)."""
        return fn()

    def submit(self, trial_number: int, task: TrialTask, backend: str, gpus: int) -> None:
        if gpus > self.free_gpus:
            raise ValueError(f"trial #{trial_number} needs {gpus} slots; {self.free_gpus} are free")
        ids, self._free_ids = self._free_ids[:gpus], self._free_ids[gpus:]
        self._launch(_Running(trial_number, task, backend, ids, self._worker()))

    def _worker(self) -> _Worker:
        while self._idle:
            worker = self._idle.pop()
            if worker.alive():
                return worker
            worker.stop(0.0)
        return _Worker.start()

    def _launch(self, item: _Running) -> None:
        item.submitted = time.monotonic()
        try:
            item.worker.tasks.send((item.task, item.backend, self._runner))
        except (BrokenPipeError, OSError):
            pass  # the worker is gone: wait() sees its end and answers crashed
        self._running[item.trial_number] = item

    def waiting_for_gpus(self, grace_s: float = 0.0) -> list[tuple[int, int, float]]:
        """Never any: a local slot is taken at submit."""
        return []

    def check_placement(self, limit_s: float, gpu_type: str) -> list[tuple[int, int, float]]:
        return []

    def wait(self, timeout_s: float) -> list[tuple[int, TrialResult]]:
        """Results of the trials that finished within ``timeout_s`` (possibly none)."""
        if not self._running:
            return []
        # A worker that dies closes its end of the result pipe: the wait wakes for it too.
        multiprocessing.connection.wait([r.worker.results for r in self._running.values()], timeout=timeout_s)
        out = []
        for number, item in list(self._running.items()):
            result, died = self._receive(item)
            if result is None:
                continue
            del self._running[number]
            if result.status is TrialStatus.INFRA_ERROR and self._retry(item, result, died):
                continue
            out.append((number, self._finish(item, result, died)))
        return out

    def _receive(self, item: _Running) -> tuple[TrialResult | None, bool]:
        """``(result, worker died)`` of a finished trial, ``(None, False)`` while it runs."""
        results, process = item.worker.results, item.worker.process
        try:
            if results.poll():
                return results.recv(), False
        except (EOFError, OSError):
            pass
        else:
            if process.poll() is None:
                return None, False
        try:
            process.wait(_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:  # its pipe broke but it lingers: it is done for
            process.kill()
            process.wait(_EXIT_WAIT_S)
        return TrialResult(status=TrialStatus.CRASHED, backend=item.backend, cause=exit_cause(process.returncode),
                           evidence=[f"local_worker_exitcode={process.returncode}"]), True

    def _finish(self, item: _Running, result: TrialResult, died: bool) -> TrialResult:
        """Stamp the slots and the driver's view of the trial; give its slots and worker back."""
        result.dispatch_s = time.monotonic() - item.submitted
        result.gpu_ids = list(item.gpu_ids)
        result.evidence.append(f"local_gpu_ids={item.gpu_ids}")
        if item.attempts:
            result.infra_attempts = [*item.attempts, *result.infra_attempts]
            result.evidence.append(f"infrastructure: {len(item.attempts)} attempt(s) of this flag set failed "
                                   "for the machine's reasons: " + " | ".join(item.attempts))
        self._free_ids = sorted(self._free_ids + item.gpu_ids, key=int)
        self._release(item.worker, keep=not died and result.status is not TrialStatus.INFRA_ERROR)
        return result

    def _retry(self, item: _Running, result: TrialResult, died: bool) -> bool:
        """Record an infrastructure failure; run the flag set again in a fresh worker while attempts
        allow (True), else leave the failure as the trial's result (False)."""
        line = (f"attempt {len(item.attempts) + 1} on local slot(s) {', '.join(item.gpu_ids)}: "
                f"{result.infrastructure or 'unknown'}: {(result.cause or '')[:300]}")
        item.attempts.append(line)
        self.infra_notes.append(f"trial #{item.trial_number}: {line}")
        if len(item.attempts) >= MAX_INFRA_ATTEMPTS:
            return False
        self._release(item.worker, keep=False)
        item.worker = self._worker()
        self._launch(item)
        return True

    def _release(self, worker: _Worker, keep: bool) -> None:
        if keep and worker.alive():
            self._idle.append(worker)
        else:
            worker.stop(_EXIT_WAIT_S)

    def close(self) -> None:
        """Stop the idle workers (the end of a study)."""
        idle, self._idle = self._idle, []
        for worker in idle:
            worker.stop(_EXIT_WAIT_S)

    def cancel_all(self) -> list[int]:
        """Kill every running trial's worker (driver shutdown); returns their trial numbers."""
        numbers = list(self._running)
        for item in self._running.values():
            item.worker.process.kill()
            item.worker.stop(_EXIT_WAIT_S)
            self._free_ids.extend(item.gpu_ids)
        self._running.clear()
        self.close()
        return numbers


if __name__ == "__main__":  # a worker: python -m servetune.cluster.local TASK_FD RESULT_FD
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
