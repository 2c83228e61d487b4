"""What one launch is given: the trial task built from the spec, a confirmation repeat's workload,
the early-stop rule and the same-start repeats handed to the next real trial."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servetune import envs
from servetune.backends import capabilities
from servetune.engines import LeaderRepeats, TrialTask
from servetune.records import dataset
from servetune.search.propose import early_stop_rule, maximises_output_throughput
from servetune.spec.schema import StudySpec
from servetune.study._outcome import StudyOutcome
from servetune.workload import Workload

if TYPE_CHECKING:
    from servetune.engines.early_stop import EarlyStop


def trial_early_stop(spec: StudySpec, outcome: StudyOutcome, backend: str) -> EarlyStop | None:
    """The early-stop rule handed to the next real trial: the preemption constraint and the best
    feasible throughput so far (:mod:`servetune.engines.early_stop`). Only the vllm backend measures over
    time; the sim and replay backends answer at once."""
    if not capabilities(backend).real_gpus:
        return None
    best = (outcome.best_metrics or {}).get("output_throughput")
    return early_stop_rule(spec, best)


#: The trial user attr holding the confirmation repeats measured on the trial's own server start
#: (``[{"repeat": k, "value": objective, "feasible": bool}]``): read by the confirmation (``_confirm``), so a
#: resumed study does not start them again.
SAME_START_REPEATS = "same_start_repeats"


def repeat_workload(spec: StudySpec, k: int) -> Workload:
    """Confirmation repeat ``k``'s workload: the study's, with its seed + k (another request mix)."""
    return dataclasses.replace(spec.workload, seed=spec.workload.seed + k)


def leader_repeats(spec: StudySpec, outcome: StudyOutcome, backend: str, runs_dir: Path,
                   number: int) -> LeaderRepeats | None:
    """The repeats the next real trial measures on its own start if its window leads
    (``budget.confirm_on: same-start``): only for the vllm backend (a start is what they save),
    with confirmation on and output throughput the first objective, maximised (what the engine
    can compare against the best so far)."""
    budget = spec.budget
    if (not capabilities(backend).real_gpus or budget.confirm_top <= 0 or budget.confirm_on != "same-start"
            or not maximises_output_throughput(spec)):
        return None
    ks = range(1, budget.confirm_repeats + 1)
    folder = runs_dir / "trials" / spec.name
    max_pre = spec.constraints.max_preemptions
    return LeaderRepeats(workloads=tuple(repeat_workload(spec, k) for k in ks),
                         log_dirs=tuple(str(folder / dataset.trial_dir_name(number, k)) for k in ks),
                         best_throughput=(outcome.best_metrics or {}).get("output_throughput"),
                         max_preemptions=None if max_pre is None else int(max_pre))


def trial_task(spec: StudySpec, flags: dict[str, Any], log_dir: Path, **varies: Any) -> TrialTask:
    """One launch's task: the model, GPU, measurement and environment settings from the spec and
    ``servetune.envs``; ``varies`` sets what differs per launch (``early_stop``, or a repeat's
    ``workload``, ``seed`` and ``repeat``)."""
    fields: dict[str, Any] = {"workload": spec.workload, "seed": spec.seed, **varies}
    return TrialTask(model=spec.model_ref, gpu=spec.gpu.type, flags=flags, vllm_version=spec.vllm_version,
                     gpu_file=spec.gpu.file, interconnect=spec.gpu.interconnect, serve_model=spec.serve_model, serve_command=envs.serve_command(),
                     startup_timeout_s=spec.measurement.startup_timeout_s or envs.startup_timeout_s(),
                     load_generator=spec.measurement.load_generator, stall_timeout_s=spec.measurement.stall_timeout_s,
                     compile_cache_dir=envs.compile_cache_dir(), log_dir=str(log_dir),
                     replay_file=None if spec.replay_file is None else str(spec.replay_file), **fields)

