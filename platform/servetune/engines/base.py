"""Engines: one interface, the thing that turns a flag set into a :class:`TrialResult`.

An engine runs one trial on the GPUs it was given and returns a ``TrialResult`` whatever happens:
bad flags are ``invalid_config``, a startup the planner or vLLM refuses is ``startup_oom`` /
``kv_too_small``, and an unexpected exception becomes ``crashed`` with its text as the cause.
Engines never raise for a trial's own failure, so one failing trial never stops a study.

``sim`` is the simulated vLLM V1 engine (:mod:`servetune.sim`), the embedded default where no GPU
is visible. ``vllm`` (real ``vllm serve`` subprocesses) is selected with ``backend: vllm``.
``replay`` answers a trial from a recorded landscape (:mod:`servetune.engines.replay`, the task's
``replay_file``); its ``wall_s`` is the recorded GPU cost of the trial, not the lookup's time.

Example:
    >>> from servetune.engines.base import TrialTask, run_trial
    >>> from servetune.workload import Workload
    >>> task = TrialTask(model="servetune-test-850m", gpu="H200",
    ...                  flags={"gpu_memory_utilization": 0.5, "max_num_seqs": 64},
    ...                  workload=Workload.from_dict({"input_len": 256, "output_len": 64,
    ...                                               "num_requests": 32, "concurrency": 8}))
    >>> run_trial(task, backend="sim").status.value
    'ok'
"""

from __future__ import annotations

import dataclasses
import shutil
import time
import traceback
from collections.abc import Mapping
from typing import Any

from servetune.engines.early_stop import EarlyStop
from servetune.errors import SpecError
from servetune.result import TrialResult, TrialStatus
from servetune.workload import Workload

__all__ = ["TrialTask", "run_trial", "resolve_backend", "gpu_visible", "BACKENDS"]

BACKENDS = ("auto", "sim", "vllm", "replay")


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
    serve_model: str | None = None  # what `vllm serve` is given (vllm backend); default: ``model``
    serve_command: tuple[str, ...] = ("vllm", "serve")  # argv before MODEL; the sim stand-in in tests
    startup_timeout_s: float = 600.0
    log_dir: str | None = None
    replay_file: str | None = None  # the recorded landscape (backend "replay")
    load_generator: str = "servetune"  # vllm backend: servetune's client or "vllm-bench"
    stall_timeout_s: float = 180.0  # vllm backend: no token on any stream this long is a stall
    compile_cache_dir: str | None = None  # vllm backend: SERVETUNE_COMPILE_CACHE_DIR (envs.compile_cache_env)
    # vllm backend: the installed vLLM's `vllm serve --help=all`, read once by the driver; None: the
    # trial reads it itself (a driver without vLLM, e.g. on a cluster's CPU head)
    serve_help: str | None = None
    early_stop: EarlyStop | None = None  # end the window once the outcome is decided (vllm backend)
    repeat: int = 0  # a confirmation repeat's index (replay: the recorded repeat it reads)


def gpu_visible() -> bool:
    """True when an NVIDIA GPU is visible to this process (nvidia-smi present and listing one)."""
    import subprocess

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


def run_trial(task: TrialTask, backend: str = "sim") -> TrialResult:
    """Run one trial; never raises for the trial's own failure (see module docstring)."""
    started = time.perf_counter()
    try:
        if backend == "sim":
            result = _run_sim(task)
        elif backend == "vllm":
            result = _run_vllm(task)
        elif backend == "replay":
            result = _run_replay(task)
        else:
            raise SpecError("backend", f"unknown backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    except SpecError as exc:
        result = TrialResult(status=TrialStatus.INVALID_CONFIG, cause=str(exc), backend=backend)
    except Exception as exc:  # noqa: BLE001 - a trial's crash is a result, not a study failure
        result = TrialResult(status=TrialStatus.CRASHED, cause=f"{type(exc).__name__}: {exc}",
                             evidence=traceback.format_exc().splitlines()[-8:], backend=backend)
    if backend != "replay" or result.wall_s is None:  # a replayed trial keeps its recorded GPU cost
        result.wall_s = time.perf_counter() - started
    return result


def _run_sim(task: TrialTask) -> TrialResult:
    from servetune.planner import gpus
    from servetune.planner import memory
    from servetune.planner import modelinfo
    from servetune.sim.engine import simulate

    if task.gpu_file:
        gpus.register_gpus_from_yaml(task.gpu_file)
    model = modelinfo.load_model(task.model)
    gpu = gpus.get_gpu(task.gpu)
    config = memory.resolve_engine_config(task.flags, model, gpu, task.vllm_version or memory.DEFAULT_VLLM_VERSION)
    return simulate(model, gpu, config, task.workload, seed=task.seed)


def _run_replay(task: TrialTask) -> TrialResult:
    from servetune.engines.replay import Landscape

    if not task.replay_file:
        raise SpecError("replay_file", "backend replay needs a recorded landscape", "set replay_file: in the spec")
    return Landscape.load(task.replay_file).result(task.flags, repeat=task.repeat)


def _run_vllm(task: TrialTask) -> TrialResult:
    from pathlib import Path

    from servetune.envs import compile_cache_env
    from servetune.engines.vllm.engine import VllmLaunch, read_serve_help, run_vllm_trial

    launch = VllmLaunch(model=task.serve_model or task.model, flags=dict(task.flags),
                        serve_command=task.serve_command, startup_timeout_s=task.startup_timeout_s,
                        log_dir=Path(task.log_dir) if task.log_dir else None,
                        load_generator=task.load_generator, stall_timeout_s=task.stall_timeout_s,
                        env=compile_cache_env(task.compile_cache_dir),
                        serve_help=task.serve_help or read_serve_help(tuple(task.serve_command)),
                        early_stop=task.early_stop)
    return run_vllm_trial(launch, task.workload)
