"""The cluster: Ray actors that own a trial's GPUs, and the local Ray a driver starts.

:class:`TrialPool` runs tasks on actors holding ``TP x PP`` (logical) GPUs each, re-runs an
infrastructure failure on another slot, quarantines a slot that keeps failing and reports a lost
node; it knows engine tasks and results, never the spec, the search or the records.
"""

from servetune.cluster.pool import MAX_INFRA_ATTEMPTS, TrialActor, TrialPool, accelerator_resource, ray_accelerator_type

__all__ = ["TrialPool", "TrialActor", "accelerator_resource", "ray_accelerator_type", "MAX_INFRA_ATTEMPTS"]
