"""Ray: one actor per running trial, owning ``tensor_parallel_size x pipeline_parallel_size`` GPUs.

The driver asks :class:`TrialPool` to start a trial; the pool creates a :class:`TrialActor` with
``num_gpus`` equal to the trial's world size (Ray's logical GPUs where there are no real ones, so
scheduling is the same everywhere), calls its ``run`` method and kills the actor once the result
is in, which releases its GPUs. A trial whose actor dies is reported as ``crashed`` with Ray's
error as the cause; the study goes on.

Quarantine: a trial whose GPU memory did not come back after its server stopped
(``TrialResult.quarantined_gpus``, leaked vLLM workers) would hand a later trial a GPU with less
memory than the planner assumes. The pool keeps that trial's actor alive, so Ray never places
another trial on its GPUs, lowers :attr:`TrialPool.total_gpus` (the usable count the driver plans
with) and lists the GPUs in :attr:`TrialPool.quarantined` for the driver to report.

Example:
    >>> pool = TrialPool.start(num_gpus=2)                         # doctest: +SKIP
    >>> pool.submit(7, task, backend="sim", gpus=1)                # doctest: +SKIP
    >>> pool.wait(timeout_s=60)                                    # doctest: +SKIP
    [(7, TrialResult(status=<TrialStatus.OK: 'ok'>, ...))]
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from servetune.engines import TrialTask, run_trial
from servetune.result import TrialResult, TrialStatus

__all__ = ["TrialActor", "TrialPool", "Runner"]

#: What an actor calls to run a trial: ``engines.run_trial`` unless the pool is given another.
Runner = Callable[[TrialTask, str], TrialResult]

_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class TrialActor:
    """Holds the GPUs of one trial for its lifetime and runs the engine there."""

    def run(self, task: TrialTask, backend: str, runner: Runner | None = None) -> TrialResult:
        result = (runner or run_trial)(task, backend)
        # Ray's GPU ids tell which (logical) devices this trial owned: the record, and the GPUs
        # the pool holds out of service if the trial's memory does not come back.
        ids = ray.get_gpu_ids()
        result.gpu_ids = [str(i) for i in ids]
        result.evidence.append(f"ray_gpu_ids={ids}")
        return result


@dataclasses.dataclass
class _Running:
    trial_number: int
    gpus: int
    actor: Any
    ref: Any


class TrialPool:
    """Dispatches trials to Ray actors while free GPUs allow, and collects their results."""

    def __init__(self, total_gpus: int, runner: Runner | None = None) -> None:
        self.total_gpus = total_gpus  # usable: the cluster's GPUs minus the quarantined slots
        self.cluster_gpus = total_gpus
        self.quarantined: list[str] = []  # GPU ids held out of service, in the order they were lost
        self.quarantine_notes: list[str] = []  # one line per quarantined slot: which trial, why
        self._runner = runner
        self._running: dict[Any, _Running] = {}
        self._held: list[Any] = []  # actors kept alive so that Ray never reuses their GPUs

    @classmethod
    def start(cls, num_gpus: int, address: str | None = None, num_cpus: int | None = None,
              runner: Runner | None = None) -> TrialPool:
        """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``), else start a local one.

        A local cluster declares ``num_gpus`` logical GPUs, the spec's GPU count; the package is
        put on the workers' path so they import the same servetune as the driver. ``runner``
        replaces ``engines.run_trial`` in the actors (it must be picklable).
        """
        if not ray.is_initialized():
            env = {"PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_PARENT, os.environ.get("PYTHONPATH")) if p)}
            kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}, "log_to_driver": False,
                                      "include_dashboard": False, "configure_logging": False}
            if address or os.environ.get("RAY_ADDRESS"):
                ray.init(address=address or os.environ["RAY_ADDRESS"], **kwargs)
            else:
                ray.init(num_gpus=num_gpus, num_cpus=num_cpus or max(2, os.cpu_count() or 2), **kwargs)
        total = int(ray.cluster_resources().get("GPU", 0))
        return cls(total or num_gpus, runner=runner)

    @property
    def busy_gpus(self) -> int:
        return sum(r.gpus for r in self._running.values())

    @property
    def free_gpus(self) -> int:
        return self.total_gpus - self.busy_gpus

    @property
    def running(self) -> list[int]:
        return [r.trial_number for r in self._running.values()]

    def submit(self, trial_number: int, task: TrialTask, backend: str, gpus: int) -> None:
        actor = TrialActor.options(num_gpus=gpus, name=None).remote()
        ref = actor.run.remote(task, backend, self._runner)
        self._running[ref] = _Running(trial_number, gpus, actor, ref)

    def wait(self, timeout_s: float) -> list[tuple[int, TrialResult]]:
        """Results of the trials that finished within ``timeout_s`` (possibly none)."""
        if not self._running:
            return []
        ready, _ = ray.wait(list(self._running), num_returns=1, timeout=timeout_s)
        if ready:  # collect everything else that is already done too
            ready, _ = ray.wait(list(self._running), num_returns=len(self._running), timeout=0)
        out = []
        for ref in ready:
            item = self._running.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayError as exc:  # the actor died: the trial crashed, the study goes on
                result = TrialResult(status=TrialStatus.CRASHED, cause=f"{type(exc).__name__}: {str(exc)[:500]}")
            if result.quarantined_gpus:
                self._quarantine(item, result)
            else:
                ray.kill(item.actor, no_restart=True)
            out.append((item.trial_number, result))
        return out

    def _quarantine(self, item: _Running, result: TrialResult) -> None:
        """Keep the trial's actor (and so its GPUs) out of Ray's hands; plan with fewer GPUs."""
        self._held.append(item.actor)
        self.total_gpus = max(0, self.total_gpus - item.gpus)
        slot = result.gpu_ids or result.quarantined_gpus
        self.quarantined += [g for g in slot if g not in self.quarantined]
        self.quarantine_notes.append(
            f"trial {item.trial_number}: GPU(s) {', '.join(slot)} out of service; memory still held on "
            f"{', '.join(result.quarantined_gpus)} after the server stopped ({self.total_gpus} of "
            f"{self.cluster_gpus} GPUs left)")

    def release_quarantined(self) -> list[str]:
        """Give the quarantined slots back to Ray (once their memory is known to be free again).

        Returns the GPU ids released; the usable count is the cluster's again.
        """
        for actor in self._held:
            ray.kill(actor, no_restart=True)
        released, self._held, self.quarantined = self.quarantined, [], []
        self.total_gpus = self.cluster_gpus
        return released

    def cancel_all(self) -> list[int]:
        """Kill every running trial's actor (driver shutdown); returns their trial numbers."""
        numbers = []
        for item in self._running.values():
            ray.kill(item.actor, no_restart=True)
            numbers.append(item.trial_number)
        self._running.clear()
        return numbers

    @staticmethod
    def shutdown() -> None:
        if ray.is_initialized():
            ray.shutdown()
