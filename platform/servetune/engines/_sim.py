"""``backend: sim``: the trial on the simulated vLLM V1 engine (:mod:`servetune.sim`)."""

from __future__ import annotations

from servetune.backends import CAPABILITIES
from servetune.engines.base import Engine, TrialTask
from servetune.planner.gpus import get_gpu, register_gpus_from_yaml, with_interconnect
from servetune.planner.target import resolve_target
from servetune.result import TrialResult
from servetune.sim import simulate, with_calibration

__all__ = ["SimEngine"]


class SimEngine(Engine):
    """The task's flags resolved as vLLM would (:func:`~servetune.planner.target.resolve_target`)
    and run in virtual time; the startup accounting is the planner's, in the task's ``comm_env`` where it has one
    (a real trial's twin)."""

    name = "sim"
    capabilities = CAPABILITIES["sim"]

    def run(self, task: TrialTask) -> TrialResult:
        if task.gpu_file:  # a user GPU table travels with the task to the Ray worker
            register_gpus_from_yaml(task.gpu_file)
        # The host's link prices TP all-reduces and PP sends (planner.comm), as `simulate --interconnect`.
        host = with_interconnect(get_gpu(task.gpu), task.interconnect, "gpu.interconnect")
        target = resolve_target(task.model, host, task.flags, task.vllm_version)
        gpu = with_calibration(target.gpu, task.sim_calibration)
        # The trial's environment plans its memory and prices the TP all-reduce's backends (planner.comm).
        return simulate(target.model, gpu, target.config, task.workload, seed=task.seed, comm_env=task.comm_env)
