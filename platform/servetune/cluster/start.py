"""Start the pool a study's trials run on (:func:`~servetune.cluster.base.pool_kind` on this process's
environment): worker processes on this machine (:class:`~servetune.cluster.local.LocalPool`), or Ray
(:class:`~servetune.cluster.pool.TrialPool`, imported only here and only then). Apart from the
contract (:mod:`.base`) so that the contract imports neither implementation.
"""

from __future__ import annotations

import os
import sys

from servetune import envs
from servetune.cluster.base import Pool, Runner, pool_kind

__all__ = ["start_pool"]


def start_pool(backend: str, num_gpus: int, num_cpus: int | None = None, runner: Runner | None = None) -> Pool:
    """The pool for a study of ``backend`` with ``num_gpus`` GPUs (:func:`pool_kind` on this
    process's environment), started: worker processes on this machine, or Ray (joined at
    ``RAY_ADDRESS``, else a local one; imported here, so a study that runs locally never loads it)."""
    ray = sys.modules.get("ray")
    running = bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())
    kind = pool_kind(backend, ray_address=os.environ.get("RAY_ADDRESS"), ray_running=running,
                     asked=envs.pool())
    if kind == "local":
        from servetune.cluster.local import LocalPool

        return LocalPool.start(num_gpus, runner=runner)
    from servetune.cluster.pool import TrialPool  # imports Ray

    return TrialPool.start(num_gpus=num_gpus, num_cpus=num_cpus, runner=runner)
