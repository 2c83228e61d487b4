"""The TrialPool contract, and the choice of its implementation for a study.

One interface, two implementations: :class:`servetune.cluster.pool.TrialPool` runs each trial in a
Ray actor holding its (logical) GPUs, on a local Ray or a cluster; :class:`servetune.cluster.local.LocalPool`
runs simulated and replayed trials in worker processes on the driver's machine, with no Ray to
start. Both keep the same promises (:class:`Pool`): a trial's own failure comes back as its result,
a worker that dies gives its trial a ``crashed`` result and loses no finished one, an
infrastructure failure is re-run up to :data:`MAX_INFRA_ATTEMPTS` attempts, and ``close`` /
``cancel_all`` leave no worker behind.

:func:`pool_kind` decides which runs a study (pure); :func:`~servetune.cluster.start.start_pool`
starts it. This module imports neither implementation, nor Ray: a study that never needs it (a refused re-run, a simulated study) never pays for it.

Example:
    >>> pool_kind("sim", ray_address=None, ray_running=False, asked=None)
    'local'
    >>> pool_kind("sim", ray_address="head:6379", ray_running=False, asked=None)
    'ray'
    >>> pool_kind("vllm", ray_address=None, ray_running=False, asked="local")
    'ray'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from servetune.backends import capabilities
from servetune.errors import SpecError

if TYPE_CHECKING:
    from servetune.engines.base import TrialTask
    from servetune.result import TrialResult

__all__ = ["Pool", "Runner", "NoGpusError", "MAX_INFRA_ATTEMPTS", "RAY_ACCELERATOR_TYPES", "ray_accelerator_type",
           "POOL_KINDS", "pool_kind", "start_pool"]

T = TypeVar("T")

#: What a worker calls to run a trial: ``engines.run_trial`` unless the pool is given another.
Runner = Callable[["TrialTask", str], "TrialResult"]

#: Attempts of one flag set that infrastructure may spoil (the first run and two re-runs).
MAX_INFRA_ATTEMPTS = 3

#: ``SERVETUNE_POOL``'s values: ``auto`` (the default: local worker processes for simulated and
#: replayed trials where no Ray cluster is asked for, else Ray), ``ray`` (always Ray, e.g. a
#: simulated study on a local Ray, as the Ray tests run it), ``local`` (worker processes for the
#: sim and replay backends even beside a Ray; the vllm backend always runs on Ray).
POOL_KINDS = ("auto", "ray", "local")

#: servetune GPU name -> Ray's accelerator type (``ray.util.accelerators``), where they differ in
#: spelling; a name not listed is used as it is (user GPUs: label the nodes with that name).
RAY_ACCELERATOR_TYPES: dict[str, str] = {
    "H200": "H200", "H100-80GB": "H100", "A100-80GB": "A100-80G", "A100-40GB": "A100-40G",
    "L40S": "L40S", "L4": "L4", "B200": "B200",
}


def ray_accelerator_type(gpu_type: str) -> str:
    """Ray's name for a servetune GPU type.

    Example:
        >>> ray_accelerator_type("A100-40GB"), ray_accelerator_type("H200"), ray_accelerator_type("MyGPU")
        ('A100-40G', 'H200', 'MyGPU')
    """
    return RAY_ACCELERATOR_TYPES.get(gpu_type, gpu_type)


class NoGpusError(RuntimeError):
    """A trial waited longer than allowed for Ray to place it: no live node offers its GPUs.

    ``trial_number``, ``gpus``, ``gpu_type`` and ``waited_s`` say which trial and what it asked
    for; ``inventory`` is what the cluster has (:func:`servetune.cluster.pool.cluster_inventory`).
    """

    def __init__(self, trial_number: int, gpus: int, gpu_type: str, waited_s: float, inventory: str) -> None:
        self.trial_number, self.gpus, self.gpu_type = trial_number, gpus, gpu_type
        self.waited_s, self.inventory = waited_s, inventory
        super().__init__(f"trial #{trial_number} waited {waited_s:.0f} s for {gpus} {gpu_type} GPU(s) and no "
                         f"live Ray node took it; the cluster has {inventory}")


class Pool(Protocol):
    """What the study driver uses of a pool (both implementations have it)."""

    total_gpus: int  # usable slots: the GPUs minus the quarantined ones
    quarantined: list[str]  # GPU ids held out of service
    quarantine_notes: list[str]  # one line per quarantined slot
    infra_notes: list[str]  # one line per infrastructure failure (re-run by the pool itself)
    started_local_ray: bool  # this pool's start launched a local Ray (the driver records it)
    beside_cluster: str | None  # a `ray start` cluster of this machine that local Ray runs beside (None: none)
    reuse_actors: bool  # keep a clean trial's worker for the next trial

    @property
    def free_gpus(self) -> int: ...

    @property
    def running(self) -> list[int]: ...

    def on_worker(self, fn: Callable[[], T], gpu_type: str) -> T | None:
        """``fn()`` where the trials of ``gpu_type`` run, before the first (None: no worker answered)."""

    def submit(self, trial_number: int, task: TrialTask, backend: str, gpus: int) -> None: ...

    def wait(self, timeout_s: float) -> list[tuple[int, TrialResult]]: ...

    def check_placement(self, limit_s: float, gpu_type: str) -> list[tuple[int, int, float]]: ...

    def cancel_all(self) -> list[int]: ...

    def close(self) -> None: ...


def pool_kind(backend: str, *, ray_address: str | None, ray_running: bool, asked: str | None) -> str:
    """``"local"`` or ``"ray"``: which pool runs a study's trials. Pure.

    Real trials (``vllm``) always run on Ray (it owns the GPUs). Simulated and replayed ones run
    in local worker processes unless Ray is asked for: ``asked == "ray"`` (``SERVETUNE_POOL``), a
    cluster address (``RAY_ADDRESS``), or a Ray this process already runs (the nightly job starts
    one for the night); ``asked == "local"`` keeps them local even then.
    """
    asked = (asked or "auto").strip().lower()
    if asked not in POOL_KINDS:
        raise SpecError("SERVETUNE_POOL", f"unknown pool {asked!r}", f"use one of {', '.join(POOL_KINDS)}")
    if capabilities(backend).real_gpus or asked == "ray":  # only trials without real GPUs run locally
        return "ray"
    if asked == "local":
        return "local"
    return "ray" if (ray_address or ray_running) else "local"
