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

GPU types: trials run only on nodes of the study's GPU type. Ray advertises a node's GPU model as
the custom resource ``accelerator_type:<TYPE>`` (Ray's spelling, :data:`RAY_ACCELERATOR_TYPES` maps
servetune's names onto it); each trial's actor asks for a sliver of that resource next to its GPUs,
so Ray places it on such a node. A local logical-GPU cluster is started with that resource, so the
scheduling is the same there. A trial needing more GPUs than any single node of the type has could
never be placed: it is answered ``invalid_config`` at once instead of waiting forever. Each result's
evidence records the node id, the accelerator type, the GPU ids and the wall-clock start/end.

Example:
    >>> pool = TrialPool.start(num_gpus=2)                         # doctest: +SKIP
    >>> pool.submit(7, task, backend="sim", gpus=1)                # doctest: +SKIP
    >>> pool.wait(timeout_s=60)                                    # doctest: +SKIP
    [(7, TrialResult(status=<TrialStatus.OK: 'ok'>, ...))]
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from servetune.engines import TrialTask, run_trial
from servetune.result import TrialResult, TrialStatus

__all__ = ["TrialActor", "TrialPool", "Runner", "RAY_ACCELERATOR_TYPES", "ray_accelerator_type",
           "accelerator_resource", "node_gpu_capacity"]

#: What an actor calls to run a trial: ``engines.run_trial`` unless the pool is given another.
Runner = Callable[[TrialTask, str], TrialResult]

_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)

#: servetune GPU name -> Ray's accelerator type (``ray.util.accelerators``), where they differ in
#: spelling; a name not listed is used as it is (user GPUs: label the nodes with that name).
RAY_ACCELERATOR_TYPES: dict[str, str] = {
    "H200": "H200", "H100-80GB": "H100", "A100-80GB": "A100-80G", "A100-40GB": "A100-40G",
    "L40S": "L40S", "L4": "L4", "B200": "B200",
}
_ACCEL_PREFIX = "accelerator_type:"
# Each node advertises its accelerator resource with capacity 1; a trial asks for a sliver of it,
# so any number of trials fit on a node as far as this resource goes (the GPUs are what limit).
_ACCEL_SLIVER = 0.001


def ray_accelerator_type(gpu_type: str) -> str:
    """Ray's name for a servetune GPU type.

    Example:
        >>> ray_accelerator_type("A100-40GB"), ray_accelerator_type("H200"), ray_accelerator_type("MyGPU")
        ('A100-40G', 'H200', 'MyGPU')
    """
    return RAY_ACCELERATOR_TYPES.get(gpu_type, gpu_type)


def accelerator_resource(gpu_type: str) -> str:
    """The custom resource a Ray node of this GPU type advertises.

    Example:
        >>> accelerator_resource("A100-40GB")
        'accelerator_type:A100-40G'
    """
    return _ACCEL_PREFIX + ray_accelerator_type(gpu_type)


def node_gpu_capacity(nodes: list[dict[str, Any]], resource: str | None) -> tuple[int, int]:
    """(total GPUs, most GPUs on one node) over the alive nodes holding ``resource`` (every node
    when ``resource`` is None), from ``ray.nodes()`` records. Pure.

    Example:
        >>> nodes = [{"Alive": True, "Resources": {"GPU": 2.0, "accelerator_type:H200": 1.0}},
        ...          {"Alive": True, "Resources": {"GPU": 1.0, "accelerator_type:A100-40G": 1.0}}]
        >>> node_gpu_capacity(nodes, "accelerator_type:H200"), node_gpu_capacity(nodes, None)
        ((2, 2), (3, 2))
    """
    gpus = [int(n.get("Resources", {}).get("GPU", 0)) for n in nodes
            if n.get("Alive", True) and (resource is None or n.get("Resources", {}).get(resource, 0) > 0)]
    return sum(gpus), max(gpus, default=0)


def _node_accelerator(node_id: str) -> str | None:
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            types = [k[len(_ACCEL_PREFIX):] for k in node.get("Resources", {}) if k.startswith(_ACCEL_PREFIX)]
            return ",".join(sorted(types)) or None
    return None


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class TrialActor:
    """Holds the GPUs of one trial for its lifetime and runs the engine there."""

    def run(self, task: TrialTask, backend: str, runner: Runner | None = None) -> TrialResult:
        started = time.time()
        result = (runner or run_trial)(task, backend)
        ended = time.time()
        # Ray's GPU ids tell which (logical) devices this trial owned: the record, and the GPUs
        # the pool holds out of service if the trial's memory does not come back.
        ids = ray.get_gpu_ids()
        result.gpu_ids = [str(i) for i in ids]
        result.evidence.append(f"ray_gpu_ids={ids}")
        # Where and when it ran: which node (and its GPU type), and the wall-clock window in which
        # it held those GPUs, so a record can show no GPU was double-booked.
        node_id = ray.get_runtime_context().get_node_id()
        result.evidence.append(f"ray_node_id={node_id}")
        result.evidence.append(f"ray_accelerator_type={_node_accelerator(node_id)}")
        result.evidence.append(f"ray_window={started:.3f}-{ended:.3f}")
        return result


@dataclasses.dataclass
class _Running:
    trial_number: int
    gpus: int
    actor: Any
    ref: Any
    submitted: float = dataclasses.field(default_factory=time.monotonic)


class TrialPool:
    """Dispatches trials to Ray actors while free GPUs allow, and collects their results."""

    def __init__(self, total_gpus: int, runner: Runner | None = None, *, accelerator: str | None = None,
                 max_node_gpus: int | None = None) -> None:
        self.total_gpus = total_gpus  # usable: the cluster's GPUs (of the type) minus the quarantined slots
        self.cluster_gpus = total_gpus
        self.accelerator = accelerator  # the Ray resource every trial asks for (None: any node)
        self.max_node_gpus = total_gpus if max_node_gpus is None else max_node_gpus
        self.labelled = accelerator is not None  # the cluster's nodes advertise accelerator types
        self.quarantined: list[str] = []  # GPU ids held out of service, in the order they were lost
        self.quarantine_notes: list[str] = []  # one line per quarantined slot: which trial, why
        self._runner = runner
        self._running: dict[Any, _Running] = {}
        self._held: list[Any] = []  # actors kept alive so that Ray never reuses their GPUs

    @classmethod
    def start(cls, num_gpus: int, address: str | None = None, num_cpus: int | None = None,
              runner: Runner | None = None, gpu_type: str | None = None) -> TrialPool:
        """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``), else start a local one.

        A local cluster declares ``num_gpus`` logical GPUs, the spec's GPU count, and (with
        ``gpu_type``) the node's accelerator resource; the package is put on the workers' path so
        they import the same servetune as the driver. ``runner`` replaces ``engines.run_trial`` in
        the actors (it must be picklable). With ``gpu_type`` on a cluster whose nodes advertise
        accelerator types, the pool plans with the GPUs of that type's nodes only; none there
        means every trial is answered ``invalid_config``.
        """
        if not ray.is_initialized():
            env = {"PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_PARENT, os.environ.get("PYTHONPATH")) if p)}
            kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}, "log_to_driver": False,
                                      "include_dashboard": False, "configure_logging": False}
            if address or os.environ.get("RAY_ADDRESS"):
                ray.init(address=address or os.environ["RAY_ADDRESS"], **kwargs)
            else:
                if gpu_type:
                    kwargs["resources"] = {accelerator_resource(gpu_type): 1}
                ray.init(num_gpus=num_gpus, num_cpus=num_cpus or max(2, os.cpu_count() or 2), **kwargs)
        nodes = ray.nodes()
        labelled = any(k.startswith(_ACCEL_PREFIX) for n in nodes if n.get("Alive", True)
                       for k in n.get("Resources", {}))
        if gpu_type and labelled:
            resource = accelerator_resource(gpu_type)
            total, per_node = node_gpu_capacity(nodes, resource)
            return cls(total, runner=runner, accelerator=resource, max_node_gpus=per_node)
        total, per_node = node_gpu_capacity(nodes, None)
        pool = cls(total or num_gpus, runner=runner, max_node_gpus=per_node or num_gpus)
        pool.labelled = labelled  # the type is bound at the first submit (the task names it)
        return pool

    def bind_gpu_type(self, gpu_type: str) -> None:
        """Restrict trials to the nodes of ``gpu_type`` (a labelled cluster only; else a no-op).

        The pool's usable GPU count becomes those nodes' GPUs. Called by :meth:`start` with
        ``gpu_type`` (in effect), and by the first :meth:`submit` from the task's GPU type.
        """
        if not self.labelled or self.accelerator is not None:
            return
        self.accelerator = accelerator_resource(gpu_type)
        total, per_node = node_gpu_capacity(ray.nodes(), self.accelerator)
        lost = self.cluster_gpus - self.total_gpus  # quarantined so far
        self.cluster_gpus, self.total_gpus, self.max_node_gpus = total, max(0, total - lost), per_node

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
        self.bind_gpu_type(task.gpu)
        if gpus > self.max_node_gpus:
            # Ray would queue this actor forever: no single node of the type has that many GPUs.
            where = f"nodes with {self.accelerator}" if self.accelerator else "nodes"
            result = TrialResult(status=TrialStatus.INVALID_CONFIG, backend=backend,
                                 cause=f"needs {gpus} GPUs on one node; the cluster's {where} have at most "
                                       f"{self.max_node_gpus}",
                                 evidence=[f"ray_max_node_gpus={self.max_node_gpus}"])
            ref = ray.put(result)
            self._running[ref] = _Running(trial_number, 0, None, ref)
            return
        options: dict[str, Any] = {"num_gpus": gpus, "name": None}
        if self.accelerator:
            options["resources"] = {self.accelerator: _ACCEL_SLIVER}
        actor = TrialActor.options(**options).remote()
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
            if item.actor is not None:  # the driver's view of the trial: what servetune's overhead is measured on
                result.dispatch_s = time.monotonic() - item.submitted
            if item.actor is None:  # answered without an actor (could never be placed)
                pass
            elif result.quarantined_gpus:
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
            if item.actor is not None:
                ray.kill(item.actor, no_restart=True)
            numbers.append(item.trial_number)
        self._running.clear()
        return numbers

    @staticmethod
    def shutdown() -> None:
        if ray.is_initialized():
            ray.shutdown()
