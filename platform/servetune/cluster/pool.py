"""Ray: one actor per running trial, owning ``tensor_parallel_size x pipeline_parallel_size x data_parallel_size`` GPUs.

The driver asks :class:`TrialPool` to start a trial; the pool creates a :class:`TrialActor` with
``num_gpus`` equal to the trial's world size (Ray's logical GPUs where there are no real ones, so
scheduling is the same everywhere), calls its ``run`` method and kills the actor once the result
is in, which releases its GPUs. A trial whose actor dies is reported as ``crashed`` with Ray's
error as the cause; the study goes on. A death that Ray does not blame on the node while it still
lists the node alive (a dying machine's worker can be reported before its missed health checks)
is told only once the node is marked dead (``node_lost``, below) or Ray's health-check window
has passed with it alive (:func:`~servetune.engines.vllm.infra.node_death_window_s`).

Quarantine: a trial whose GPU memory did not come back after its server stopped
(``TrialResult.quarantined_gpus``, leaked vLLM workers) would hand a later trial a GPU with less
memory than the planner assumes. The pool keeps that trial's actor alive, so Ray never places
another trial on its GPUs, lowers :attr:`TrialPool.total_gpus` (the usable count the driver plans
with) and lists the GPUs in :attr:`TrialPool.quarantined` for the driver to report.

Infrastructure failures (:mod:`servetune.engines.vllm.infra`): a trial that ends ``infra_error`` (a port taken,
GPU memory held by another process, its Ray node lost) is run again, same flag set, by the pool
itself, up to :data:`MAX_INFRA_ATTEMPTS` attempts in all. A slot-bound failure (GPU memory held,
GPU unusable) keeps the failed actor alive while the flag set is re-run, so Ray places the re-run
on other GPUs; a slot failing :data:`SLOT_QUARANTINE_AFTER` times is quarantined. A lost node's
GPUs leave the pool's count. The driver receives one result per trial: the re-run's, with the
earlier attempts in ``TrialResult.infra_attempts``; or, retries exhausted, the last ``infra_error``.

GPU types: trials run only on nodes of the study's GPU type. Ray advertises a node's GPU model as
the custom resource ``accelerator_type:<TYPE>`` (Ray's spelling, :data:`RAY_ACCELERATOR_TYPES` maps
servetune's names onto it); each trial's actor asks for a sliver of that resource next to its GPUs,
so Ray places it on such a node. A local logical-GPU cluster is started with that resource, so the
scheduling is the same there. A trial needing more GPUs than any single node of the type has could
never be placed: it is answered ``invalid_config`` at once instead of waiting forever. Each result's
evidence records the node id, the accelerator type, the GPU ids and the wall-clock start/end.

No GPUs of the type: where no live node offers a GPU of the study's type (a laptop, a CI runner, a
CPU head node), a simulated or replayed trial asks Ray for no GPU at all (the spec's GPU count
still bounds how many run at once); a real trial is launched and waits for Ray to place it (an
autoscaler may add nodes). :meth:`TrialPool.waiting_for_gpus` lists the trials Ray has not placed
yet, and :meth:`TrialPool.check_placement` raises :class:`NoGpusError` for one that waited longer
than the study allows, naming what the cluster has (:func:`cluster_inventory`).

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
from typing import Any, TypeVar

import ray

from servetune.backends import capabilities
from servetune.cluster import _ray_session
from servetune.cluster.base import MAX_INFRA_ATTEMPTS, RAY_ACCELERATOR_TYPES, NoGpusError, Runner, ray_accelerator_type
from servetune.engines import TrialTask, run_trial
from servetune.engines.vllm.infra import SLOT_KINDS, actor_death_unsettled, classify_actor_error, node_death_window_s
from servetune.result import TrialResult, TrialStatus

__all__ = ["TrialActor", "TrialPool", "Runner", "RAY_ACCELERATOR_TYPES", "ray_accelerator_type",
           "accelerator_resource", "node_gpu_capacity", "cluster_inventory", "NoGpusError",
           "MAX_INFRA_ATTEMPTS", "SLOT_QUARANTINE_AFTER", "PLACEMENT_GRACE_S", "PROBE_TIMEOUT_S"]

_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])

_ACCEL_PREFIX = "accelerator_type:"
# Each node advertises its accelerator resource with capacity 1; a trial asks for a sliver of it,
# so any number of trials fit on a node as far as this resource goes (the GPUs are what limit).
_ACCEL_SLIVER = 0.001
#: Slot-bound infrastructure failures of one GPU before the pool takes it out of service.
SLOT_QUARANTINE_AFTER = 2
#: How long a re-run after a node loss waits for Ray to declare the node dead (its health check)
#: before it is launched anyway.
NODE_DEATH_WAIT_S = 60.0
#: A trial's actor not placed and started after this long is "waiting for GPUs": starting its Ray
#: worker process (importing servetune) takes a few seconds (2.4-3.9 s per real H200 trial), which
#: is not waiting for a GPU. budget.wait_for_gpus_s is at least twice this.
PLACEMENT_GRACE_S = 5.0
#: How long :meth:`TrialPool.on_worker` waits for its answer: a Ray worker process starting and importing servetune
#: (2.4-3.9 s per real H200 trial, :data:`PLACEMENT_GRACE_S`), with a wide margin.
PROBE_TIMEOUT_S = 60.0

T = TypeVar("T")


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


def cluster_inventory(resources: dict[str, float], nodes: list[dict[str, Any]]) -> str:
    """What a Ray cluster offers, in words, from ``ray.cluster_resources()`` and ``ray.nodes()``. Pure.

    Example:
        >>> cluster_inventory({"CPU": 2.0, "memory": 8e9, "accelerator_type:H200": 1.0},
        ...                   [{"Alive": True}, {"Alive": False}])
        '1 live node, 2 CPUs, 0 GPUs, accelerator types: H200'
    """
    alive = sum(1 for n in nodes if n.get("Alive", True))
    types = sorted(k[len(_ACCEL_PREFIX):] for k in resources if k.startswith(_ACCEL_PREFIX))
    return (f"{alive} live node{'s' if alive != 1 else ''}, {int(resources.get('CPU', 0))} CPUs, "
            f"{int(resources.get('GPU', 0))} GPUs, accelerator types: {', '.join(types) or 'none'}")


def _node_accelerator(node_id: str) -> str | None:
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            types = [k[len(_ACCEL_PREFIX):] for k in node.get("Resources", {}) if k.startswith(_ACCEL_PREFIX)]
            return ",".join(sorted(types)) or None
    return None


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class _ProbeActor:
    """Runs one :meth:`TrialPool.on_worker` question on a GPU node, holding a sliver of its resources."""

    def run(self, fn: Callable[[], T]) -> T:
        return fn()


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class TrialActor:
    """Holds the GPUs of one trial for its lifetime and runs the engine there."""

    def run(self, task: TrialTask, backend: str, runner: Runner | None = None,
            handed_over_at: float | None = None) -> TrialResult:
        started = time.time()
        result = (runner or run_trial)(task, backend)
        ended = time.time()
        if handed_over_at is not None:
            # The driver's wall clock at the hand-over (same clock on one node; a cluster's clocks
            # may skew): the part of servetune's overhead that is Ray placing and starting the actor.
            result.timings_s["actor_start"] = max(0.0, started - handed_over_at)
        # Ray's GPU ids tell which (logical) devices this trial owned: the record, and the GPUs
        # the pool holds out of service if the trial's memory does not come back.
        ids = ray.get_gpu_ids()
        result.gpu_ids = [str(i) for i in ids]
        result.evidence.append(f"ray_gpu_ids={ids}")
        # Where and when it ran: which node (and its GPU type), and the wall-clock window in which
        # it held those GPUs, so a record can show no GPU was double-booked.
        node_id = ray.get_runtime_context().get_node_id()
        result.node_id = node_id
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
    task: TrialTask | None = None
    backend: str = "sim"
    attempts: list[str] = dataclasses.field(default_factory=list)  # infrastructure failures so far
    excluded: list[Any] = dataclasses.field(default_factory=list)  # failed actors held so Ray avoids their GPUs
    submitted: float = dataclasses.field(default_factory=time.monotonic)  # this attempt's hand-over to Ray
    ready: Any = None  # the actor's __ray_ready__ ref: set until Ray has placed and started the actor


class TrialPool:
    """Dispatches trials to Ray actors while free GPUs allow, and collects their results."""

    def __init__(self, total_gpus: int, runner: Runner | None = None, *, accelerator: str | None = None,
                 max_node_gpus: int | None = None) -> None:
        self.total_gpus = total_gpus  # usable: the cluster's GPUs (of the type) minus the quarantined slots
        self.cluster_gpus = total_gpus
        self.accelerator = accelerator  # the Ray resource every trial asks for (None: any node)
        self.max_node_gpus = total_gpus if max_node_gpus is None else max_node_gpus
        # GPUs the live nodes offer (of the type, once bound); 0: simulated trials ask for none.
        self.offered_gpus = total_gpus
        self.requested_gpus = total_gpus  # the spec's count: what the pool plans with where none are offered
        self.labelled = accelerator is not None  # the cluster's nodes advertise accelerator types
        self.quarantined: list[str] = []  # GPU ids held out of service, in the order they were lost
        self.quarantine_notes: list[str] = []  # one line per quarantined slot: which trial, why
        self._runner = runner
        self._running: dict[Any, _Running] = {}
        self._held: list[Any] = []  # actors kept alive so that Ray never reuses their GPUs
        self.started_local_ray = False  # set by start(): this pool's start launched a local Ray
        # set by start(): the address of a `ray start` cluster on this machine that its local Ray runs beside
        self.beside_cluster: str | None = None
        self.infra_notes: list[str] = []  # one line per infrastructure failure: trial, attempt, where, why
        self._deferred: list[tuple[_Running, str, float]] = []  # re-runs waiting for Ray to mark a node dead
        # Actor deaths Ray does not blame on the node yet, each until its health check could have (a deadline).
        self._settling: list[tuple[_Running, ray.exceptions.RayError, float]] = []
        self._gave_up: list[_Running] = []  # deferred re-runs that no live node can take
        self._slot_failures: dict[str, int] = {}  # GPU id -> slot-bound infrastructure failures seen there
        # Opt-in (the study driver turns it on and calls close() at its end): a clean trial's actor
        # is kept, with its GPUs, for the next trial of the same size. A fresh actor is a new Ray
        # worker process that imports servetune again: 2.4-3.9 s of every real H200 trial.
        self.reuse_actors = False
        self._idle: dict[int, list[Any]] = {}  # GPU count -> idle actors

    @classmethod
    def start(cls, num_gpus: int, address: str | None = None, num_cpus: int | None = None,
              runner: Runner | None = None, gpu_type: str | None = None) -> TrialPool:
        """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``), else start a local one.

        A local cluster declares ``num_gpus`` logical GPUs, the spec's GPU count, and (with
        ``gpu_type``) the node's accelerator resource; the package is put on the workers' path so
        they import the same servetune as the driver. ``runner`` replaces ``engines.run_trial`` in
        the actors (it must be picklable). With ``gpu_type`` on a cluster whose nodes advertise
        accelerator types, the pool plans with the GPUs of that type's nodes only; none there
        (or no GPUs at all) means it plans with ``num_gpus``: simulated trials ask Ray for no GPU,
        real ones wait to be placed (:meth:`check_placement` bounds the wait).
        """
        started_local = False  # this call started a local Ray (recorded by the driver; never a joined one)
        beside: str | None = None  # the `ray start` cluster of this machine it started beside
        if not ray.is_initialized():
            env = {"PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_PARENT, os.environ.get("PYTHONPATH")) if p)}
            kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}, "log_to_driver": False,
                                      "include_dashboard": False, "configure_logging": False}
            if address or os.environ.get("RAY_ADDRESS"):
                _ray_session.join_cluster(address or os.environ["RAY_ADDRESS"], **kwargs)
            else:
                if gpu_type:
                    kwargs["resources"] = {accelerator_resource(gpu_type): 1}
                beside = _ray_session.recorded_cluster()
                # Loopback only, dashboard off unless asked (servetune.cluster._ray_session).
                _ray_session.start_local_ray(num_gpus=num_gpus, num_cpus=num_cpus or max(2, os.cpu_count() or 2),
                                             **kwargs)
                started_local = True
        nodes = ray.nodes()
        labelled = any(k.startswith(_ACCEL_PREFIX) for n in nodes if n.get("Alive", True)
                       for k in n.get("Resources", {}))
        if gpu_type and labelled:
            resource = accelerator_resource(gpu_type)
            total, per_node = node_gpu_capacity(nodes, resource)
            pool = cls(total or num_gpus, runner=runner, accelerator=resource, max_node_gpus=per_node or num_gpus)
        else:
            total, per_node = node_gpu_capacity(nodes, None)
            pool = cls(total or num_gpus, runner=runner, max_node_gpus=per_node or num_gpus)
            pool.labelled = labelled  # the type is bound at the first submit (the task names it)
        pool.offered_gpus, pool.requested_gpus = total, num_gpus
        pool.started_local_ray = started_local
        pool.beside_cluster = beside
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
        self.offered_gpus = total
        if total == 0:  # none of the type: plan with the spec's count (see gpu_free)
            total = per_node = self.requested_gpus
        lost = self.cluster_gpus - self.total_gpus  # quarantined so far
        self.cluster_gpus, self.total_gpus, self.max_node_gpus = total, max(0, total - lost), per_node

    @property
    def busy_gpus(self) -> int:
        # A trial's GPUs, plus those of failed attempts held while it re-runs elsewhere, plus the
        # re-runs waiting for a lost node to be declared dead.
        return (sum(r.gpus * (1 + len(r.excluded)) for r in self._running.values())
                + sum(item.gpus for item, _, _ in (*self._deferred, *self._settling)))

    @property
    def free_gpus(self) -> int:
        return self.total_gpus - self.busy_gpus

    @property
    def running(self) -> list[int]:
        return ([r.trial_number for r in self._running.values()]
                + [item.trial_number for item, _, _ in (*self._deferred, *self._settling)])

    def gpu_free(self, backend: str) -> bool:
        """True when a trial of ``backend`` asks Ray for no GPU: a simulated or replayed trial on a
        cluster that offers no GPU of the type (it would otherwise wait forever for one)."""
        return not capabilities(backend).real_gpus and self.offered_gpus == 0

    def on_worker(self, fn: Callable[[], T], gpu_type: str, timeout_s: float = PROBE_TIMEOUT_S) -> T | None:
        """``fn()`` run in a Ray task on a node that offers a GPU of ``gpu_type`` (a sliver of one GPU and of the
        type's resource, as a trial's actor asks for whole ones), before any trial holds them: what the trials'
        install says (``servetune.engines.vllm.host.probe_has_flashinfer``). None where no such node answers within
        ``timeout_s`` (an autoscaler has none up yet) or the task fails: the caller plans without the answer."""
        self.bind_gpu_type(gpu_type)
        if self.offered_gpus == 0:  # no live node offers a GPU: nothing to ask before the first trial is placed
            return None
        options: dict[str, Any] = {"num_gpus": _ACCEL_SLIVER}
        if self.accelerator:
            options["resources"] = {self.accelerator: _ACCEL_SLIVER}
        # An actor, ended by ray.kill, not a task ended by ray.cancel: Ray 2.60's driver aborts (a failed
        # RAY_CHECK, "Tried to complete task that was not pending", task_manager.cc:1329) where a cancel
        # crosses the task's own reply (the race ray-project/ray#54738 names); a probe that timed out or
        # failed is exactly one that may be answering at that moment.
        actor = _ProbeActor.options(**options).remote()  # type: ignore[attr-defined]  # added by @ray.remote
        try:
            return ray.get(actor.run.remote(fn), timeout=timeout_s)  # type: ignore[no-any-return]
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            return None
        finally:
            ray.kill(actor, no_restart=True)

    def submit(self, trial_number: int, task: TrialTask, backend: str, gpus: int) -> None:
        self.bind_gpu_type(task.gpu)
        if gpus > self.max_node_gpus and self.offered_gpus > 0:
            # Ray would queue this actor forever: no single node of the type has that many GPUs.
            where = f"nodes with {self.accelerator}" if self.accelerator else "nodes"
            result = TrialResult(status=TrialStatus.INVALID_CONFIG, backend=backend,
                                 cause=f"needs {gpus} GPUs on one node; the cluster's {where} have at most "
                                       f"{self.max_node_gpus}",
                                 evidence=[f"ray_max_node_gpus={self.max_node_gpus}"])
            ref = ray.put(result)
            self._running[ref] = _Running(trial_number, 0, None, ref)
            return
        self._launch(_Running(trial_number, gpus, None, None, task, backend))

    def _launch(self, item: _Running) -> None:
        """Start (or start again) ``item``'s flag set in a fresh actor."""
        gpu_free = self.gpu_free(item.backend)
        options: dict[str, Any] = {"num_gpus": 0 if gpu_free else item.gpus, "name": None}
        if self.accelerator and not gpu_free:
            options["resources"] = {self.accelerator: _ACCEL_SLIVER}
        item.submitted = time.monotonic()
        idle = self._idle.get(item.gpus) if not item.attempts else None
        item.ready = None
        if idle:
            item.actor = idle.pop()
        else:
            self._drop_idle()  # another size, or a re-run: Ray gets their GPUs back for this actor
            item.actor = TrialActor.options(**options).remote()  # type: ignore[attr-defined]  # added by @ray.remote
            # Resolves once Ray placed and started it; a GPU-free actor waits for no GPU.
            item.ready = None if gpu_free else item.actor.__ray_ready__.remote()
        item.ref = item.actor.run.remote(item.task, item.backend, self._runner, time.time())
        self._running[item.ref] = item

    def waiting_for_gpus(self, grace_s: float = PLACEMENT_GRACE_S) -> list[tuple[int, int, float]]:
        """``(trial number, GPUs, seconds waited)`` of the trials whose actor Ray has not placed and
        started within ``grace_s`` of the hand-over."""
        pending = [r for r in self._running.values() if r.ready is not None]
        if pending:
            placed, _ = ray.wait([r.ready for r in pending], num_returns=len(pending), timeout=0)
            done = set(placed)
            for item in pending:
                if item.ready in done:
                    item.ready = None
        now = time.monotonic()
        return [(r.trial_number, r.gpus, now - r.submitted) for r in self._running.values()
                if r.ready is not None and now - r.submitted > grace_s]

    def check_placement(self, limit_s: float, gpu_type: str) -> list[tuple[int, int, float]]:
        """The trials waiting for Ray to place them (:meth:`waiting_for_gpus`); raises
        :class:`NoGpusError` for the first that waited longer than ``limit_s`` where no live node
        (of the type) has that many GPUs at all. A trial waiting for GPUs that other work holds
        waits on: they come back."""
        waiting = self.waiting_for_gpus()
        over = [w for w in waiting if w[2] > limit_s]
        if over:
            nodes = ray.nodes()
            _, per_node = node_gpu_capacity(nodes, self.accelerator)
            for number, gpus, waited in over:
                if gpus > per_node:
                    raise NoGpusError(number, gpus, gpu_type, waited, cluster_inventory(ray.cluster_resources(), nodes))
        return waiting

    def wait(self, timeout_s: float) -> list[tuple[int, TrialResult]]:
        """Results of the trials that finished within ``timeout_s`` (possibly none)."""
        # An idle actor lives for one turn of the driver's loop: the submits right after the
        # previous wait() could reuse it; one still idle now would only keep its GPUs from an actor
        # Ray is waiting to place (a re-run, another size).
        self._drop_idle()
        self._launch_deferred()
        if not self._running:
            if self._deferred or self._settling:  # only trials waiting for Ray to declare a node dead
                time.sleep(min(timeout_s, 0.5))
            return self._settled() + self._given_up()
        ready, _ = ray.wait(list(self._running), num_returns=1, timeout=timeout_s)
        if ready:  # collect everything else that is already done too
            ready, _ = ray.wait(list(self._running), num_returns=len(self._running), timeout=0)
        out = []
        for ref in ready:
            item = self._running.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayError as exc:  # the actor died: the trial crashed, the study goes on
                finished = self._actor_died(item, exc)
            else:
                finished = self._finish(item, result, died=False)
            if finished is not None:
                out.append(finished)
        return out + self._settled() + self._given_up()

    def _finish(self, item: _Running, result: TrialResult, died: bool) -> tuple[int, TrialResult] | None:
        """``item``'s result for the driver, its actor kept idle, held or killed; None while it re-runs."""
        if item.actor is not None and result.status is TrialStatus.INFRA_ERROR and self._retry(item, result):
            return None  # re-running elsewhere; the driver hears of it when the re-run ends
        if item.actor is not None:  # the driver's view of the trial: what servetune's overhead is measured on
            result.dispatch_s = time.monotonic() - item.submitted
        self._release_excluded(item)
        if item.attempts:
            result.infra_attempts = [*item.attempts, *result.infra_attempts]
            result.evidence.append(f"infrastructure: {len(item.attempts)} attempt(s) of this flag set failed "
                                   "for the machine's reasons: " + " | ".join(item.attempts))
        if item.actor is None:  # answered without an actor (could never be placed)
            pass
        elif result.status is TrialStatus.INFRA_ERROR and item.actor in self._held:
            pass  # its slot was quarantined with this very attempt
        elif result.quarantined_gpus:
            self._quarantine(item, result)
        elif self.reuse_actors and not died and result.status is not TrialStatus.INFRA_ERROR:
            self._idle.setdefault(item.gpus, []).append(item.actor)  # clean: its GPUs came back
        else:
            ray.kill(item.actor, no_restart=True)
        return item.trial_number, result

    def _actor_died(self, item: _Running, exc: ray.exceptions.RayError) -> tuple[int, TrialResult] | None:
        """``item``'s actor died: its result now, or (None) later where Ray may yet declare its node dead."""
        result, unsettled = _actor_death(exc, item.backend, item.actor)
        if unsettled:
            self._settling.append((item, exc, time.monotonic() + node_death_window_s(os.environ)))
            return None
        return self._finish(item, result, died=True)

    def _settled(self) -> list[tuple[int, TrialResult]]:
        """The actor deaths waiting on Ray's health check that are told now: their node marked dead
        (``node_lost``, re-run), or the window passed with the node alive (the trial's own crash)."""
        out, waiting = [], []
        now = time.monotonic()
        for item, exc, deadline in self._settling:
            result, unsettled = _actor_death(exc, item.backend, item.actor)
            if unsettled and now < deadline:
                waiting.append((item, exc, deadline))
            elif (finished := self._finish(item, result, died=True)) is not None:
                out.append(finished)
        self._settling = waiting
        return out

    def _given_up(self) -> list[tuple[int, TrialResult]]:
        out = []
        for item in self._gave_up:
            result = TrialResult(TrialStatus.INFRA_ERROR, backend=item.backend, infrastructure="node_lost",
                                 cause=f"infrastructure failure: no live node can take the re-run ({item.gpus} GPUs)",
                                 infra_attempts=list(item.attempts))
            out.append((item.trial_number, result))
        self._gave_up = []
        return out

    def _retry(self, item: _Running, result: TrialResult) -> bool:
        """Record an infrastructure failure of ``item``; run its flag set again when attempts and
        healthy GPUs allow (True), else leave the failure as the trial's result (False)."""
        kind = result.infrastructure or "unknown"
        where = (f"GPU(s) {', '.join(result.gpu_ids)}" if result.gpu_ids else "GPU(s) unknown") + \
            (f" on node {result.node_id[:12]}" if result.node_id else "")
        line = f"attempt {len(item.attempts) + 1} on {where}: {kind}: {(result.cause or '')[:300]}"
        item.attempts.append(line)
        self.infra_notes.append(f"trial #{item.trial_number}: {line}")
        slot_bound = kind in SLOT_KINDS and bool(result.gpu_ids)
        for gpu in result.gpu_ids if slot_bound else ():
            self._slot_failures[gpu] = self._slot_failures.get(gpu, 0) + 1
        if slot_bound and any(self._slot_failures[g] >= SLOT_QUARANTINE_AFTER for g in result.gpu_ids):
            self._held.append(item.actor)  # out of service for good
            self.total_gpus = max(0, self.total_gpus - item.gpus)
            self.quarantined += [g for g in result.gpu_ids if g not in self.quarantined]
            self.quarantine_notes.append(
                f"trial {item.trial_number}: GPU(s) {', '.join(result.gpu_ids)} out of service after "
                f"{SLOT_QUARANTINE_AFTER} infrastructure failures ({kind}) there ({self.total_gpus} of "
                f"{self.cluster_gpus} GPUs left)")
        elif slot_bound and self.total_gpus - item.gpus * (len(item.excluded) + 1) >= item.gpus:
            item.excluded.append(item.actor)  # Ray places the re-run on other GPUs while this one holds these
        else:
            ray.kill(item.actor, no_restart=True)
        if kind == "node_lost":
            self._refresh_capacity()
        if len(item.attempts) >= MAX_INFRA_ATTEMPTS or item.gpus > min(self.total_gpus, self.max_node_gpus):
            return False
        lost = result.node_id if kind == "node_lost" else None
        if lost:
            # Until Ray declares the node dead (its health check), it could place the re-run there.
            self._deferred.append((item, lost, time.monotonic() + NODE_DEATH_WAIT_S))
        else:
            self._launch(item)
        return True

    def _launch_deferred(self) -> None:
        """Launch the re-runs whose lost node Ray now reports dead (or that waited long enough)."""
        if not self._deferred:
            return
        alive = {n.get("NodeID") for n in ray.nodes() if n.get("Alive", True)}
        now = time.monotonic()
        waiting = []
        for item, node, deadline in self._deferred:
            if node in alive and now < deadline:
                waiting.append((item, node, deadline))
                continue
            self._refresh_capacity()
            if item.gpus > min(self.total_gpus, self.max_node_gpus):
                # No node left that could take it: give the driver its infrastructure failure now.
                self._gave_up.append(item)
            else:
                self._launch(item)
        self._deferred = waiting

    def _release_excluded(self, item: _Running) -> None:
        for actor in item.excluded:
            if actor not in self._held:
                ray.kill(actor, no_restart=True)
        item.excluded = []

    def _refresh_capacity(self) -> None:
        """After a node loss: plan with the GPUs of the nodes still alive (minus quarantined slots).
        A cluster that offered no GPUs of the type keeps planning with the spec's count."""
        if self.offered_gpus == 0:
            return
        total, per_node = node_gpu_capacity(ray.nodes(), self.accelerator)
        if total < self.cluster_gpus:
            lost = self.cluster_gpus - self.total_gpus
            self.cluster_gpus, self.max_node_gpus = total, per_node
            self.total_gpus = max(0, total - lost)

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

    def _drop_idle(self) -> None:
        for actors in self._idle.values():
            for actor in actors:
                ray.kill(actor, no_restart=True)
        self._idle.clear()

    def close(self) -> None:
        """Give the idle actors' GPUs back to Ray (the end of a study)."""
        self._drop_idle()

    def cancel_all(self) -> list[int]:
        """Kill every running trial's actor (driver shutdown); returns their trial numbers."""
        self._drop_idle()
        numbers = []
        for item in self._running.values():
            if item.actor is not None:
                ray.kill(item.actor, no_restart=True)
            self._release_excluded(item)
            numbers.append(item.trial_number)
        for item, _, _ in self._settling:
            self._release_excluded(item)
        numbers += [item.trial_number for item, _, _ in (*self._deferred, *self._settling)]
        self._running.clear()
        self._deferred, self._settling = [], []
        return numbers

    @staticmethod
    def shutdown() -> None:
        if ray.is_initialized():
            ray.shutdown()


def _actor_node(actor: Any) -> str | None:
    """The node a (dead) actor was placed on, from Ray's GCS actor table; None if unknown."""
    try:
        info = ray._private.state.actors(actor._actor_id.hex())
        return (info.get("Address") or {}).get("NodeID") or None
    except Exception:  # noqa: BLE001 - a private API: without it the verdict rests on the error text
        return None


def _actor_death(exc: ray.exceptions.RayError, backend: str, actor: Any = None) -> tuple[TrialResult, bool]:
    """The result of a trial whose actor died: ``infra_error`` (``node_lost``) when its node went
    with it (Ray's NodeDiedError / ActorUnavailableError, an ActorDiedError naming the node's
    death, or the actor's node no longer alive), else ``crashed`` with Ray's error as the cause;
    and whether that ``crashed`` may yet turn out a node's loss (``actor_death_unsettled``)."""
    text = str(exc)
    cause = f"{type(exc).__name__}: {text[:500]}"
    node = _actor_node(actor) if actor is not None else None
    nodes = ray.nodes()
    alive = None if node is None else any(n.get("NodeID") == node and n.get("Alive", True) for n in nodes)
    kind = classify_actor_error(type(exc).__name__, text, alive)
    if kind is None:
        return (TrialResult(status=TrialStatus.CRASHED, cause=cause, backend=backend),
                actor_death_unsettled(type(exc).__name__, text, alive))
    dead = [n.get("NodeID", "?")[:12] for n in nodes if not n.get("Alive", True)]
    evidence = [f"ray: {type(exc).__name__}", f"ray_dead_nodes={dead}"]
    if node:
        evidence.append(f"ray_lost_node={node}")
    return (TrialResult(status=TrialStatus.INFRA_ERROR, infrastructure=kind, backend=backend, node_id=node,
                        cause=f"infrastructure failure: Ray node lost: {cause}", evidence=evidence), False)
