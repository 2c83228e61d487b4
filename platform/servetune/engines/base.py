"""The engine interface: what turns one flag set into a :class:`~servetune.result.TrialResult`.

An :class:`Engine` runs one :class:`TrialTask` on the GPUs its process was given. Three stand
behind this one interface (:func:`servetune.engines.get_engine`):

* ``sim`` (:class:`servetune.engines.SimEngine`): the simulated vLLM V1 engine
  (:mod:`servetune.sim`), the embedded default where no GPU is visible;
* ``vllm`` (:class:`servetune.engines.vllm.VllmEngine`): a real ``vllm serve`` subprocess, or the
  ``serve_command`` stand-in;
* ``replay`` (:class:`servetune.engines.ReplayEngine`): the row of a recorded landscape
  (the task's ``replay_file``).

The contract (the base class's docstring) is what a study relies on: whatever happens, a trial
ends as a result whose status says what happened, so one failing trial never stops a study.

Only plain data lives here (the task, the backend names); the engines import it, never the other
way round, and the study's spec is translated into a task before an engine sees it.

Example:
    >>> from servetune.engines import TrialTask, run_trial
    >>> from servetune.workload import Workload
    >>> task = TrialTask(model="servetune-test-850m", gpu="H200",
    ...                  flags={"gpu_memory_utilization": 0.5, "max_num_seqs": 64},
    ...                  workload=Workload.from_dict({"input_len": 256, "output_len": 64,
    ...                                               "num_requests": 32, "concurrency": 8}))
    >>> run_trial(task, backend="sim").status.value
    'ok'
"""

from __future__ import annotations

import abc
import dataclasses
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any, ClassVar

from servetune.engines.early_stop import EarlyStop
from servetune.backends import BACKENDS, Capabilities
from servetune.errors import SpecError
from servetune.planner.comm import CommEnv
from servetune.result import TrialResult, TrialStatus
from servetune.workload import Workload

__all__ = ["Engine", "TrialTask", "LeaderRepeats", "resolve_backend", "gpu_visible", "BACKENDS", "LOAD_GENERATORS"]

#: The load generators of the vllm backend: servetune's own streaming client
#: (:mod:`servetune.engines.vllm.loadgen`, per-request records), or ``vllm bench serve``.
LOAD_GENERATORS = ("servetune", "vllm-bench")


@dataclasses.dataclass(frozen=True)
class LeaderRepeats:
    """Confirmation repeats a trial measures on its own server start when its window leads the
    study (``budget.confirm_on: same-start``, vllm backend).

    A vLLM start of an 8B model costs 1-3 minutes and a window 20-40 s: a study confirming its
    winner with another start pays a start per repeat, and the first trial (the informed start)
    is usually the winner. So the driver hands every trial the repeats it would need if it won;
    the engine measures them right after the trial's window, on the same server, only when
    :meth:`due` (the window leads: nothing else pays an extra window). Repeat ``k`` is
    ``workloads[k - 1]`` (the study's workload with its seed + k, as a restarted repeat would
    send), its evidence in ``log_dirs[k - 1]``. Such a repeat samples the load and the host over
    another window, not the start (the KV capacity and graph capture are the trial's).

    Example:
        >>> from servetune.result import TrialResult, TrialStatus
        >>> rule = LeaderRepeats(workloads=(), log_dirs=(), best_throughput=1000.0, max_preemptions=0)
        >>> rule.due(TrialResult(TrialStatus.OK, output_throughput=1100.0, preemptions=0))
        True
        >>> rule.due(TrialResult(TrialStatus.OK, output_throughput=900.0, preemptions=0))
        False
    """

    workloads: tuple[Workload, ...]
    log_dirs: tuple[str | None, ...]
    best_throughput: float | None = None  # the study's best feasible output throughput when the trial was sent
    max_preemptions: int | None = None  # constraints.max_preemptions

    def due(self, result: TrialResult) -> bool:
        """Whether the trial's own window leads the study: it ran to its end (OK, not stopped
        early), kept to the preemption limit, and its output throughput reached the best so far
        (any, when there was none)."""
        if result.status is not TrialStatus.OK or result.early_stopped or not result.output_throughput:
            return False
        if self.max_preemptions is not None and (result.preemptions or 0) > self.max_preemptions:
            return False
        return self.best_throughput is None or result.output_throughput >= self.best_throughput


@dataclasses.dataclass(frozen=True)
class TrialTask:
    """Everything a trial needs, picklable so it can travel to a Ray actor."""

    model: str
    gpu: str
    flags: Mapping[str, Any]
    workload: Workload
    vllm_version: str | None = None
    seed: int = 0
    gpu_file: str | None = None  # a user GPU table (YAML) to register on the worker
    interconnect: str | None = None  # the host's GPU link (spec ``gpu.interconnect``); None: the type's usual one
    serve_model: str | None = None  # what `vllm serve` is given (vllm backend); default: ``model``
    serve_command: tuple[str, ...] = ("vllm", "serve")  # argv before MODEL; the sim stand-in in tests
    startup_timeout_s: float = 600.0
    log_dir: str | None = None
    replay_file: str | None = None  # the recorded landscape (backend "replay")
    load_generator: str = "servetune"  # vllm backend: servetune's client or "vllm-bench"
    stall_timeout_s: float = 180.0  # vllm backend: no token on any stream this long is a stall
    compile_cache_dir: str | None = None  # vllm backend: SERVETUNE_COMPILE_CACHE_DIR (envs.compile_cache_env)
    early_stop: EarlyStop | None = None  # end the window once the outcome is decided (vllm backend)
    repeat: int = 0  # a confirmation repeat's index (replay: the recorded repeat it reads)
    # vllm backend, budget.confirm_on same-start: the repeats to measure on this trial's own server
    # if its window leads (TrialResult.repeats); the other engines leave them to the driver.
    leader_repeats: LeaderRepeats | None = None
    # sim backend: simulator knobs over the GPU's calibration (sim.perf.Calibration), e.g. the
    # host's API-server CPU factor the multi-fidelity screen measured on the study's first trial.
    sim_calibration: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # sim backend: the environment the simulated server runs with, where the simulation is a real trial's twin
    # (the multi-fidelity screen: the study's planner.comm.trial_env, from its GPU workers' FlashInfer); None: the
    # measured hosts' (planner.comm.SERVETUNE_LAUNCH_ENV, plan_memory's default).
    comm_env: CommEnv | None = None


class Engine(abc.ABC):
    """One way of running a trial. The contract every implementation keeps:

    * :meth:`run` runs ``task`` (its flags, workload and seed) on the GPUs this process holds and
      returns a :class:`~servetune.result.TrialResult` with ``backend`` set to :attr:`name`.
      A startup that vLLM (or the planner, for the simulator) refuses is a result
      (``startup_oom``, ``kv_too_small``, ...), not an exception.
    * A flag set the engine cannot even try raises :class:`~servetune.errors.SpecError`; any other
      exception is a crash. Implementations do not catch either: :func:`servetune.engines.run_trial`
      turns them into ``invalid_config`` / ``crashed`` results with the evidence.
    * ``wall_s``: ``run_trial`` records the time :meth:`run` took, unless
      :attr:`reports_wall_s` (replay: the recorded GPU cost of the trial, not the lookup's time).
    * An engine holds no state between trials; one instance may run many tasks.
    """

    #: The backend name a spec uses (``BACKENDS``).
    name: ClassVar[str]
    #: Whether :meth:`run` sets ``wall_s`` itself.
    reports_wall_s: ClassVar[bool] = False
    #: What this engine's trials are (:data:`servetune.backends.CAPABILITIES`, its row): what the
    #: rest of servetune asks instead of comparing backend names.
    capabilities: ClassVar[Capabilities]

    @abc.abstractmethod
    def run(self, task: TrialTask) -> TrialResult:
        """Run one trial; see the class contract."""


def gpu_visible() -> bool:
    """True when an NVIDIA GPU is visible to this process (nvidia-smi present and listing one)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def resolve_backend(backend: str) -> str:
    """``auto`` means ``vllm`` where a GPU is visible and vLLM is installed, else ``sim``."""
    if backend not in BACKENDS:
        raise SpecError("backend", f"unknown backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    return "vllm" if gpu_visible() and shutil.which("vllm") else "sim"
