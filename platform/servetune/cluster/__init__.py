"""The cluster: where a study's trials run, behind one contract (:class:`Pool`, :mod:`.base`).

:class:`TrialPool` runs tasks on Ray actors holding ``TP x PP x DP`` (logical) GPUs each, re-runs an
infrastructure failure on another slot, quarantines a slot that keeps failing and reports a lost
node; :class:`LocalPool` runs simulated and replayed trials in worker processes on the driver's
machine, with no Ray to start; :func:`start_pool` picks one (``SERVETUNE_POOL``, ``RAY_ADDRESS``).
Both know engine tasks and results, never the spec, the search or the records. A study run as a
Ray job keeps its stores out of Ray's temporary working dir (:func:`job_output_problem`) and ends
by printing the commands that reach them (:func:`store_commands`).

The names load on first use, so a driver whose trials run locally never imports Ray.
"""

from typing import TYPE_CHECKING

from servetune.lazy import lazy_face

if TYPE_CHECKING:
    from servetune.cluster._job import in_ray_working_dir, job_output_problem, sqlite_path, store_commands
    from servetune.cluster._ray_session import reap_leftovers, record_local_session, start_local_ray
    from servetune.cluster.base import MAX_INFRA_ATTEMPTS, NoGpusError, Pool, pool_kind, ray_accelerator_type
    from servetune.cluster.start import start_pool
    from servetune.cluster.local import LocalPool
    from servetune.cluster.pool import TrialActor, TrialPool, accelerator_resource, cluster_inventory

__all__ = ["TrialPool", "TrialActor", "LocalPool", "Pool", "start_pool", "pool_kind", "accelerator_resource",
           "ray_accelerator_type", "MAX_INFRA_ATTEMPTS", "NoGpusError", "cluster_inventory", "in_ray_working_dir",
           "job_output_problem", "sqlite_path", "store_commands", "reap_leftovers", "record_local_session",
           "start_local_ray"]

_DEFINED_IN = {
    "TrialPool": "servetune.cluster.pool",
    "TrialActor": "servetune.cluster.pool",
    "accelerator_resource": "servetune.cluster.pool",
    "cluster_inventory": "servetune.cluster.pool",
    "LocalPool": "servetune.cluster.local",
    "Pool": "servetune.cluster.base",
    "start_pool": "servetune.cluster.start",
    "pool_kind": "servetune.cluster.base",
    "ray_accelerator_type": "servetune.cluster.base",
    "MAX_INFRA_ATTEMPTS": "servetune.cluster.base",
    "NoGpusError": "servetune.cluster.base",
    "in_ray_working_dir": "servetune.cluster._job",
    "job_output_problem": "servetune.cluster._job",
    "sqlite_path": "servetune.cluster._job",
    "store_commands": "servetune.cluster._job",
    "reap_leftovers": "servetune.cluster._ray_session",
    "record_local_session": "servetune.cluster._ray_session",
    "start_local_ray": "servetune.cluster._ray_session",
}

__getattr__, __dir__ = lazy_face(__name__, _DEFINED_IN, __all__)
