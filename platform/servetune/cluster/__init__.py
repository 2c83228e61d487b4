"""The cluster: Ray actors that own a trial's GPUs, and the local Ray a driver starts.

:class:`TrialPool` runs tasks on actors holding ``TP x PP`` (logical) GPUs each, re-runs an
infrastructure failure on another slot, quarantines a slot that keeps failing and reports a lost
node; it knows engine tasks and results, never the spec, the search or the records. A study run
as a Ray job keeps its stores out of Ray's temporary working dir (:func:`job_output_problem`) and
ends by printing the commands that reach them (:func:`store_commands`).
"""

from servetune.cluster._job import in_ray_working_dir, job_output_problem, sqlite_path, store_commands
from servetune.cluster.pool import (MAX_INFRA_ATTEMPTS, NoGpusError, TrialActor, TrialPool, accelerator_resource,
                                    cluster_inventory, ray_accelerator_type)

__all__ = ["TrialPool", "TrialActor", "accelerator_resource", "ray_accelerator_type", "MAX_INFRA_ATTEMPTS",
           "NoGpusError", "cluster_inventory", "in_ray_working_dir", "job_output_problem", "sqlite_path",
           "store_commands"]
