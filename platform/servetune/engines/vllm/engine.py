"""The real engine: one ``vllm serve`` per trial, measured, classified, and cleaned up.

A trial launches the server in its own process group on 127.0.0.1 with an explicit free port and
a distinct internal port base (``VLLM_PORT``), ``CUDA_VISIBLE_DEVICES`` set to the GPUs Ray gave
the trial, and the log streamed to a file. It waits for ``/health`` (startup timeout), scrapes
``/metrics``, sends the workload with :mod:`servetune.engines.vllm.loadgen` (or ``vllm bench serve``, with
``load_generator="vllm-bench"``, :mod:`servetune.engines.vllm.bench_client`) while sampling the KV-usage and
queue gauges, scrapes again (counter deltas: preemptions, tokens), then stops the process group
(SIGTERM, SIGKILL after a grace period) and checks that the GPU memory came back. Whatever goes
wrong becomes a status with its evidence (:func:`servetune.engines.vllm.logs.classify`), never an
exception:

- the server exits during the measured window: the load stops at once, and the log decides
  (``crashed`` with the engine's root exception, ``runtime_oom`` for a CUDA OOM after startup);
- no token on any in-flight stream for ``stall_timeout_s`` (a stalled engine): the load stops and
  the trial is a ``timeout`` (with ``vllm bench serve``, from the server's token counters);
- the outcome is decided before the workload ends (``early_stop``: the preemption counter past the
  constraint, or throughput certainly below the best so far, :mod:`servetune.engines.early_stop`): the load
  stops sending, the window ends, and the result is measured over what was answered, with
  ``early_stopped`` set (servetune load generator only; ``vllm bench serve`` runs to its end);
- the window leads the study and the task carries ``leader_repeats`` (``budget.confirm_on:
  same-start``): the confirmation repeats are measured on the same server right after it
  (``TrialResult.repeats``, :class:`servetune.engines.LeaderRepeats`), before the stop;
- a GPU whose memory does not come back after the stop is listed in
  ``TrialResult.quarantined_gpus``; the Ray pool then takes that slot out of service.

The server command is configurable (``serve_command``), so the same path runs against
``python -m servetune.sim.server`` on a machine without a GPU.

Example::

    result = run_vllm_trial(VllmLaunch(model="/models/llama", flags={"max_num_seqs": 64}), workload)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from servetune.backends import CAPABILITIES
from servetune.engines.vllm.bench_client import BENCH_COMMAND, bench_argv, run_bench
from servetune.engines.base import LOAD_GENERATORS, Engine, LeaderRepeats, TrialTask
from servetune.engines.early_stop import EarlyStop
from servetune.envs import LAUNCH_SAFE_ENV, compile_cache_env
from servetune.errors import SpecError, did_you_mean
from servetune.planner.flags import argv_value, gpus_needed, to_cli_args
from servetune.engines.vllm.host import server_environ
from servetune.engines.vllm.infra import confirm_launch_failure
from servetune.engines.vllm.loadgen import LoadProgress, run_load
from servetune.engines.vllm.metrics import counter, gauge, labels_of, parse_prometheus
from servetune.result import MemoryBreakdown, TrialResult, TrialStatus, summarize
from servetune.engines.vllm.logs import ParsedLog, classify, parse_log
from servetune.engines.vllm.serve_cli import check_argv, parse_serve_help
from servetune.workload import Workload

__all__ = ["VllmEngine", "VllmLaunch", "run_vllm_trial", "serve_argv", "read_serve_help", "cached_serve_help", "free_port",
           "gpu_memory_used_mib", "SAFE_ENV"]

#: Set in every vLLM environment (NVLink multicast off: the GPU hosts' operating rule); the one
#: definition lives in servetune.envs, where the memory planner reads it too.
SAFE_ENV = LAUNCH_SAFE_ENV
#: Environment settings a candidate may never turn on (they enable NVLink multicast).
FORBIDDEN_ENV = ("VLLM_ALLREDUCE_USE_FLASHINFER", "VLLM_USE_NCCL_SYMM_MEM")


@dataclasses.dataclass(frozen=True)
class VllmLaunch:
    """How to start one server. ``serve_command`` is the argv before MODEL (``vllm serve``)."""

    model: str
    flags: Mapping[str, Any]
    serve_command: Sequence[str] = ("vllm", "serve")
    extra_args: Sequence[str] = ()
    gpu_ids: Sequence[str] | None = None  # CUDA_VISIBLE_DEVICES; None keeps the inherited value
    host: str = "127.0.0.1"
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    stop_grace_s: float = 15.0
    sample_interval_s: float = 0.5  # how often the KV-usage / queue gauges are read during the load
    log_dir: Path | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    serve_help: str | None = None  # `vllm serve --help=all` of the installed vLLM: flags checked before launch
    # When ``serve_help`` is None: reads it (``read_serve_help``) beside the server's own start
    # instead of before it. Both import vLLM (20-30 s on the H200 host) and vLLM parses its
    # arguments before it touches a GPU, so a flag the help refuses stops the server before any GPU
    # time is spent, with the same invalid_config verdict as the check before launch.
    help_reader: Callable[[], str | None] | None = None
    load_generator: str = "servetune"  # one of LOAD_GENERATORS
    bench_command: Sequence[str] = BENCH_COMMAND  # argv before the options of `vllm bench serve`
    # No token on any in-flight stream for this long: the engine is stalled; stop and call it a
    # timeout. One engine step takes well under a second, so minutes leave a wide margin.
    stall_timeout_s: float | None = 180.0
    gpu_free_timeout_s: float = 30.0  # how long the GPU memory may take to come back after the stop
    # End the measured window once the outcome is decided (servetune loadgen only); None: never.
    early_stop: EarlyStop | None = None
    # Confirmation repeats to measure on this server after the window when it leads (TrialResult.repeats).
    leader_repeats: LeaderRepeats | None = None


def free_port(host: str = "127.0.0.1") -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def gpu_memory_used_mib(gpu_ids: Sequence[str] | None) -> dict[str, int]:
    """Used memory per GPU from NVML (pynvml) or nvidia-smi; {} where neither exists."""
    try:
        # Optional (nvidia-ml-py, GPU hosts only); nvidia-smi is the fallback below.
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            ids = [str(i) for i in range(count)] if gpu_ids is None else list(gpu_ids)
            return {i: int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(int(i))).used // 2**20)
                    for i in ids if i.isdigit() and int(i) < count}
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - fall back to nvidia-smi
        pass
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    out = subprocess.run([exe, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20, check=False).stdout
    used = {}
    for line in out.splitlines():
        idx, _, mib = line.partition(",")
        if idx.strip() and (gpu_ids is None or idx.strip() in gpu_ids):
            used[idx.strip()] = int(mib.strip() or 0)
    return used


def _get(url: str, timeout: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, ValueError):
        return 0, ""


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> list[str]:
    """SIGTERM the process group, SIGKILL after ``grace_s``; returns what happened."""
    notes: list[str] = []
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            notes.append(f"server ignored SIGTERM for {grace_s:.0f} s; sent SIGKILL to its process group")
    # Kill stragglers of the group too (vLLM's EngineCore and workers survive a parent's death).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    return notes


def _wait_gpu_free(gpu_ids: Sequence[str] | None, baseline: Mapping[str, int],
                   timeout_s: float = 30.0) -> tuple[list[str], list[str]]:
    """Wait until each GPU is back to its memory before launch (+256 MiB).

    Returns the notes and the ids of the GPUs that are not: those are quarantined (another
    trial there would start with less memory than the planner assumes, or fail outright).
    """
    if not baseline:
        return [], []
    deadline = time.monotonic() + timeout_s
    used = dict(baseline)
    while True:
        used = gpu_memory_used_mib(gpu_ids)
        held = [i for i in used if used[i] > baseline.get(i, 0) + 256]
        if not held or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    return ([f"GPU {i} still holds {used[i]} MiB ({baseline.get(i, 0)} MiB before launch): slot quarantined"
             for i in held], held)


def _trial_gpu_ids(launch: VllmLaunch) -> list[str] | None:
    """The GPUs this trial's server sees: the launch's, else the inherited CUDA_VISIBLE_DEVICES.

    Ray sets CUDA_VISIBLE_DEVICES in a trial's actor, so the memory check looks only at the
    trial's own GPUs, not at a neighbouring trial starting up on another one.
    """
    if launch.gpu_ids is not None:
        return [str(i) for i in launch.gpu_ids]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    return ids if ids and all(i.isdigit() for i in ids) else None


def serve_argv(launch: VllmLaunch, port: int) -> list[str]:
    """The server's argv (pure): ``serve_command``, the model, 127.0.0.1 and ``port``, the flags.

    Raises SpecError where a value is not what it claims to be: a model that would be read as an
    option (:func:`servetune.planner.flags.argv_value`), a flag outside the table or of the wrong type
    (:func:`servetune.planner.flags.to_cli_args`). ``serve_command`` (the operator's environment) and
    ``extra_args`` (set by code, never from a spec) are taken as given.

    Example:
        >>> serve_argv(VllmLaunch(model="org/m", flags={"max_num_seqs": 8}), 8011)
        ['vllm', 'serve', 'org/m', '--host', '127.0.0.1', '--port', '8011', '--max-num-seqs', '8']
    """
    argv = [*launch.serve_command, argv_value(launch.model, "serve_model"), "--host", launch.host,
            "--port", str(port), *to_cli_args(launch.flags), *launch.extra_args]
    # the executor of each engine: its TP x PP workers (a DP rank of one GPU runs in-process, as vLLM chooses)
    if gpus_needed({**launch.flags, "data_parallel_size": 1}) > 1 and "--distributed-executor-backend" not in argv:
        argv += ["--distributed-executor-backend", "mp"]
    return argv


def run_vllm_trial(launch: VllmLaunch, workload: Workload) -> TrialResult:
    """Run one real (or stand-in) server trial end to end; see the module docstring.

    Example::

        r = run_vllm_trial(VllmLaunch(model="/models/llama", flags={"max_num_seqs": 64},
                                      load_generator="vllm-bench"), workload)
        r.status, r.output_throughput, r.quarantined_gpus
    """
    for key in FORBIDDEN_ENV:
        if launch.env.get(key) not in (None, "", "0"):
            return TrialResult(TrialStatus.INVALID_CONFIG, cause=f"{key} would enable NVLink multicast; refused",
                               backend="vllm")
    port = free_port(launch.host)
    try:
        argv = serve_argv(launch, port)
    except SpecError as exc:
        return TrialResult(TrialStatus.INVALID_CONFIG, cause=str(exc), backend="vllm",
                           evidence=["refused before launch: a value that is not what it claims to be"])
    try:
        _check_load_generator(launch, workload)
    except SpecError as exc:
        return TrialResult(TrialStatus.INVALID_CONFIG, cause=str(exc), backend="vllm",
                           evidence=["refused before launch: the load generator cannot send this workload"])
    if launch.serve_help:
        problems = _help_problems(launch, launch.serve_help)
        if problems:
            return TrialResult(TrialStatus.INVALID_CONFIG, cause="; ".join(problems), backend="vllm",
                               evidence=["checked before launch against `vllm serve --help=all`"])
    help_check = _HelpCheck(launch) if launch.serve_help is None and launch.help_reader is not None else None
    log_dir = Path(launch.log_dir or tempfile.mkdtemp(prefix="servetune-trial-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "server.log"
    env = {**server_environ(launch.env), "VLLM_PORT": str(free_port(launch.host))}
    if launch.gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(launch.gpu_ids)
    gpu_ids = _trial_gpu_ids(launch)
    baseline = gpu_memory_used_mib(gpu_ids)
    base = f"http://{launch.host}:{port}"
    started = time.monotonic()
    result = TrialResult(TrialStatus.CRASHED, backend="vllm")
    healthy = False
    refused: list[str] | None = None
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as exc:
            return TrialResult(TrialStatus.CRASHED, cause=f"cannot start {argv[0]}: {exc}", backend="vllm")
        try:
            healthy, timed_out = _wait_healthy(proc, base, launch.startup_timeout_s,
                                               refused=help_check.refused if help_check else None)
            startup_s = time.monotonic() - started
            refused = help_check.problems(wait=not healthy) if help_check else None
            if refused:
                healthy = False  # not measured: the flags are the installed vLLM's to refuse
            # What the server really holds on each GPU (vLLM allocates its KV cache at startup, so
            # the reading after /health and the one after the load bound the trial's peak).
            used_peak = gpu_memory_used_mib(gpu_ids) if healthy else {}
            if healthy:
                result = _measure_or_crash(base, launch, workload, proc, log_dir)
                if launch.leader_repeats is not None and launch.leader_repeats.due(result):
                    result.repeats = _measure_repeats(base, launch, launch.leader_repeats, proc, log_dir)
                for gpu, mib in gpu_memory_used_mib(gpu_ids).items():
                    used_peak[gpu] = max(mib, used_peak.get(gpu, 0))
            elif refused:
                # What vLLM's own argument parser says a moment later, before its engine starts:
                # the flags' fault, not a crash or the infrastructure's.
                result = TrialResult(TrialStatus.INVALID_CONFIG, cause="; ".join(refused), backend="vllm",
                                     evidence=["checked against `vllm serve --help=all` while the server started; "
                                               "the server was stopped at once"])
            else:
                result = TrialResult(TrialStatus.TIMEOUT if timed_out else TrialStatus.CRASHED, backend="vllm")
            result.startup_s = startup_s
            result.gpu_used_mib_peak = {g: int(m) for g, m in used_peak.items()}
            result.evidence.append(f"argv={argv!r}")
            exit_code = proc.poll()
        finally:
            stop_started = time.monotonic()
            notes = _stop(proc, launch.stop_grace_s)
            stop_s = time.monotonic() - stop_started
    free_started = time.monotonic()
    gpu_notes, quarantined = _wait_gpu_free(gpu_ids, baseline, launch.gpu_free_timeout_s)
    result.timings_s.update(stop=stop_s, gpu_free=time.monotonic() - free_started)
    notes += gpu_notes
    result.quarantined_gpus = quarantined
    text = log_path.read_text(errors="replace")
    parsed = parse_log(text)
    if not refused:
        verdict = classify(text, exit_code=exit_code, healthy=result.status is TrialStatus.OK or healthy,
                           timed_out=result.status is TrialStatus.TIMEOUT)
        _merge_verdict(result, verdict)
        if verdict.infrastructure and verdict.status is not TrialStatus.OK:
            _confirm_infrastructure(result, baseline, parsed)
    result.evidence += notes
    _fill_from_log(result, parsed)
    for repeat in result.repeats:  # the same server: its version, memory and KV capacity, not its start
        _fill_server_from_log(repeat, parsed)
    result.log_text = text
    return result


def _measure_or_crash(base: str, launch: VllmLaunch, workload: Workload, proc: subprocess.Popen[bytes],
                      log_dir: Path) -> TrialResult:
    """:func:`_measure`, with a client-side failure turned into a crashed result (evidence, not a
    crash of the study)."""
    try:
        return _measure(base, launch, workload, proc, log_dir)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        return TrialResult(TrialStatus.CRASHED, backend="vllm",
                           cause=f"the load failed: {type(exc).__name__}: {exc}"[:500])


def _measure_repeats(base: str, launch: VllmLaunch, repeats: LeaderRepeats, proc: subprocess.Popen[bytes],
                     log_dir: Path) -> list[TrialResult]:
    """The confirmation repeats on the running server, one window each, never stopped early (a
    repeat is a sample of the leader's figure, not a race); after one that did not end OK (the
    server may be gone), the rest are left to a restart."""
    out: list[TrialResult] = []
    plain = dataclasses.replace(launch, early_stop=None)
    for k, (workload, folder) in enumerate(zip(repeats.workloads, repeats.log_dirs), start=1):
        where = Path(folder) if folder else log_dir / f"repeat-{k}"
        where.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        repeat = _measure_or_crash(base, plain, workload, proc, where)
        repeat.wall_s = time.monotonic() - started
        repeat.evidence.append(f"repeat {k}: measured on the trial's own server start, after its window")
        out.append(repeat)
        if repeat.status is not TrialStatus.OK:
            break
    return out


def _merge_verdict(result: TrialResult, verdict: Any) -> None:
    """What the log says overrides what the client saw, except where the client knows better.

    A death or OOM in the log is the root cause of failed requests or a stall, so it wins. A stall
    the client detected keeps its own cause (which stream went quiet, for how long): the log's
    timeout verdict only says the run did not finish.
    """
    if verdict.status is TrialStatus.OK:
        return
    if verdict.status is TrialStatus.INCOMPLETE:  # the log alone stops short; the launcher saw how it ended
        result.evidence = [*result.evidence, *verdict.evidence]
        return
    if result.status is TrialStatus.TIMEOUT and verdict.status is TrialStatus.TIMEOUT and result.cause:
        result.evidence = [*result.evidence, *verdict.evidence]
        return
    if result.cause and result.cause != verdict.cause:
        result.evidence = [*verdict.evidence, f"client side: {result.cause}", *result.evidence]
    else:
        result.evidence = [*verdict.evidence, *result.evidence]
    result.status, result.cause = verdict.status, verdict.cause or result.cause


def _confirm_infrastructure(result: TrialResult, baseline: Mapping[str, int], parsed: ParsedLog) -> None:
    """An ``infrastructure`` verdict of the log, confirmed with the pre-launch memory reading
    (:func:`servetune.engines.vllm.infra.confirm_launch_failure`): ``infra_error`` (the pool retries the flag
    set on another slot), or the flags' own failure when the reading refutes it."""
    v = confirm_launch_failure(result.cause or "", before_mib=baseline, free_gib=parsed.free_at_start_gib,
                               total_gib=parsed.total_gpu_gib, requested_gib=parsed.requested_gib,
                               status=result.status)
    result.status, result.cause, result.infrastructure = v.status, v.cause, v.kind
    result.evidence = [*result.evidence, *v.evidence]


def _check_load_generator(launch: VllmLaunch, workload: Workload) -> None:
    """SpecError before launch when the chosen load generator cannot send ``workload``."""
    if launch.load_generator not in LOAD_GENERATORS:
        raise SpecError("load_generator", f"unknown load generator {launch.load_generator!r}"
                        f"{did_you_mean(launch.load_generator, LOAD_GENERATORS)}",
                        f"use one of {', '.join(LOAD_GENERATORS)}")
    if launch.load_generator == "vllm-bench":
        bench_argv(workload, base_url="http://127.0.0.1:1", model=launch.model, result_dir=".")


def _serve_help_cache_file(serve_command: tuple[str, ...], cache_dir: Path | None) -> Path:
    """Where the help text of ``serve_command`` is cached: keyed by the command and the
    executable's path and mtime (a new vLLM install invalidates it) and ``PYTHONPATH``."""
    exe = shutil.which(serve_command[0]) or serve_command[0]
    try:
        stamp = os.stat(exe).st_mtime_ns
    except OSError:
        stamp = 0
    key = hashlib.sha256(json.dumps([list(serve_command), exe, stamp, os.environ.get("PYTHONPATH", "")]).encode())
    cache = (cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "servetune" / "serve-help")
    return cache / f"{key.hexdigest()[:24]}.txt"


def _read_cached(cached: Path) -> str | None:
    with contextlib.suppress(OSError):
        return cached.read_text() if cached.is_file() else None
    return None


def cached_serve_help(serve_command: tuple[str, ...], cache_dir: Path | None = None) -> str | None:
    """The help text :func:`read_serve_help` cached on this host for ``serve_command``; None when
    it has not been read here yet (nothing is run)."""
    return _read_cached(_serve_help_cache_file(serve_command, cache_dir))


@functools.lru_cache(maxsize=4)
def read_serve_help(serve_command: tuple[str, ...], timeout_s: float = 180.0,
                    cache_dir: Path | None = None) -> str | None:
    """``SERVE_COMMAND --help=all`` (vLLM >= 0.10), else ``--help``; None when neither answers.

    Reading it imports vLLM (~20 s on the H200 host), and every trial runs in a fresh Ray actor, so
    the text is cached on disk (:func:`cached_serve_help`) as well as in the process.
    """
    cached = _serve_help_cache_file(serve_command, cache_dir)
    known = _read_cached(cached)
    if known is not None:
        return known
    env = server_environ()
    for flag in ("--help=all", "--help"):
        try:
            out = subprocess.run([*serve_command, flag], capture_output=True, text=True, timeout=timeout_s,
                                 env=env, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode == 0 and "--max-num-seqs" in out.stdout:
            with contextlib.suppress(OSError):
                cached.parent.mkdir(parents=True, exist_ok=True)
                tmp = cached.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(out.stdout)
                tmp.replace(cached)
            return out.stdout
    return None


def _help_problems(launch: VllmLaunch, help_text: str) -> list[str]:
    """What ``help_text`` (the installed ``vllm serve --help=all``) refuses in the launch's arguments."""
    return check_argv([*to_cli_args(launch.flags), *launch.extra_args], parse_serve_help(help_text))


class _HelpCheck:
    """``launch.help_reader`` run on a thread beside the server's start, then checked.

    The reader is the only slow part (it imports vLLM); when it answers None (no help to read) or
    fails, nothing is refused, as when no help text is known at all.
    """

    def __init__(self, launch: VllmLaunch) -> None:
        self._launch, self._done = launch, threading.Event()
        self._problems: list[str] = []
        threading.Thread(target=self._read, name="servetune-serve-help", daemon=True).start()

    def _read(self) -> None:
        try:
            text = self._launch.help_reader() if self._launch.help_reader else None
            self._problems = _help_problems(self._launch, text) if text else []
        except Exception:  # noqa: BLE001 - an unreadable help refuses nothing; the server's own parser still runs
            self._problems = []
        finally:
            self._done.set()

    def problems(self, wait: bool) -> list[str] | None:
        """The problems found, [] for none; None while the help is still being read (``wait``:
        until it is read, which ``read_serve_help``'s own timeout bounds)."""
        if wait:
            self._done.wait()
        return list(self._problems) if self._done.is_set() else None

    def refused(self) -> bool:
        return bool(self.problems(wait=False))


def _wait_healthy(proc: subprocess.Popen[bytes], base: str, timeout_s: float,
                  refused: Callable[[], bool] | None = None) -> tuple[bool, bool]:
    """(healthy, timed out): polls ``/health`` until the server answers, exits, or ``refused()``
    says its flags were refused while it started (neither healthy nor timed out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False, False
        if refused is not None and refused():
            return False, False
        if _get(base + "/health", 2.0)[0] == 200:
            return True, False
        time.sleep(0.5)
    return False, True


class _ServerWatch:
    """Reads the server's gauges during the load, and notices a stall from its token counters.

    A stall is work on the server (running or waiting requests) with neither the prompt nor the
    generation token counter moving for ``stall_timeout_s``; an idle server never stalls.
    """

    def __init__(self, base: str, stall_timeout_s: float | None) -> None:
        self.base, self.stall_timeout_s = base, stall_timeout_s
        self.samples: list[tuple[float | None, float | None, float | None]] = []
        self.preemptions: float | None = None  # the preemption counter at the last sample
        #: (monotonic time, the server's generation-token counter) at every sample that read it.
        self.generated: list[tuple[float, float]] = []
        self._tokens: tuple[float | None, float | None] | None = None
        self._since = time.monotonic()

    def sample(self) -> str | None:
        status, text = _get(self.base + "/metrics", 2.0)
        now = time.monotonic()
        if status == 200:
            m = parse_prometheus(text)
            kv, running, waiting = (gauge(m, "vllm:kv_cache_usage_perc"), gauge(m, "vllm:num_requests_running"),
                                    gauge(m, "vllm:num_requests_waiting"))
            self.samples.append((kv, running, waiting))
            self.preemptions = counter(m, "vllm:num_preemptions")
            tokens = (counter(m, "vllm:prompt_tokens"), counter(m, "vllm:generation_tokens"))
            if tokens[1] is not None:
                self.generated.append((now, tokens[1]))
            if tokens != self._tokens or not (running or waiting):
                self._tokens, self._since = tokens, now
        idle = now - self._since
        if self.stall_timeout_s and idle > self.stall_timeout_s:
            return (f"stalled: requests on the server but no token counted for {idle:.1f} s "
                    f"(stall timeout {self.stall_timeout_s:g} s)")
        return None

    def generated_since(self, t0: float) -> float | None:
        """Output tokens the server counted from ``t0`` (monotonic) to the last sample, with the
        counter at ``t0`` interpolated between the samples around it; None before two samples
        bracket ``t0``. A lower bound up to one sampling interval behind."""
        points = self.generated
        if len(points) < 2 or points[0][0] > t0 or points[-1][0] <= t0:
            return None
        for (ta, ca), (tb, cb) in zip(points, points[1:]):
            if ta <= t0 <= tb:
                at_t0 = ca + (cb - ca) * ((t0 - ta) / (tb - ta) if tb > ta else 1.0)
                return max(0.0, points[-1][1] - at_t0)
        return None


def _server_exit(proc: subprocess.Popen[bytes]) -> str | None:
    code = proc.poll()
    return None if code is None else f"the server exited with code {code} during the measured window"


def _measure(base: str, launch: VllmLaunch, workload: Workload, proc: subprocess.Popen[bytes],
             log_dir: Path) -> TrialResult:
    # The raw /metrics text before and after the window and the gauges sampled during it stay in
    # the trial's folder (uploaded with the server log): the evidence behind every counter delta.
    before_text = _get(base + "/metrics", 10.0)[1]
    (log_dir / "metrics_before.txt").write_text(before_text)
    before = parse_prometheus(before_text)
    watch = _ServerWatch(base, launch.stall_timeout_s)
    if launch.load_generator == "vllm-bench":
        result = _load_with_bench(base, launch, workload, proc, log_dir, watch)
    else:
        result = _load_with_servetune(base, launch, workload, proc, watch, counter(before, "vllm:num_preemptions"))
    after_text = _get(base + "/metrics", 10.0)[1]
    (log_dir / "metrics_after.txt").write_text(after_text)
    (log_dir / "gauges.json").write_text(json.dumps(
        [{"kv_cache_usage": kv, "running": running, "waiting": waiting} for kv, running, waiting in watch.samples]))
    after = parse_prometheus(after_text)
    pre_before, pre_after = counter(before, "vllm:num_preemptions"), counter(after, "vllm:num_preemptions")
    result.preemptions = int(pre_after - (pre_before or 0)) if pre_after is not None else None
    # The API server's own CPU over the window (prometheus_client's process collector, on by default):
    # a decode-heavy load can be bound by this one process, and hosts differ in what it costs.
    cpu_before, cpu_after = counter(before, "process_cpu_seconds_total"), counter(after, "process_cpu_seconds_total")
    if cpu_before is not None and cpu_after is not None:
        result.api_server_cpu_s = max(0.0, cpu_after - cpu_before)
    kv = [s[0] for s in watch.samples if s[0] is not None]
    if kv:
        result.kv_cache_usage_peak, result.kv_cache_usage_mean = max(kv), sum(kv) / len(kv)
    # The engine's own block count (the API server's cache_config_info gauge): where the log states
    # none, a sliding-window or hybrid model's logged tokens do not give it.
    blocks = (labels_of(before, "vllm:cache_config_info") or {}).get("num_gpu_blocks", "")
    if blocks.isdigit():
        result.num_gpu_blocks = int(blocks)
    if result.failed and result.status is TrialStatus.OK:
        if result.completed == 0:
            result.status, result.cause = TrialStatus.CRASHED, "every request failed"
    return result


def _decider(rule: EarlyStop | None, watch: _ServerWatch, preemptions_before: float | None
             ) -> Callable[[LoadProgress], str | None] | None:
    """``run_load``'s ``decide`` for ``rule``: preemptions from the sampled counter's delta, the
    output tokens from the larger of two lower bounds: the chunks streamed to the client and the
    server's generation-token counter since the window began. A chunk is one token only while the
    API server keeps up: when it lags, vLLM merges a request's pending outputs into one chunk (real
    8B windows on an H200 streamed 0.75-1.0 chunks per token), and a rate counted in chunks would
    stop a trial that was on its way to the best."""
    if rule is None:
        return None

    def decide(progress: LoadProgress) -> str | None:
        pre = None if watch.preemptions is None else int(watch.preemptions - (preemptions_before or 0))
        counted = watch.generated_since(time.monotonic() - progress.elapsed_s)
        tokens = max(float(progress.streamed_chunks), counted or 0.0)
        return rule.verdict(preemptions=pre, output_tokens=tokens, elapsed_s=progress.elapsed_s,
                            answered=progress.answered, total=progress.total)

    return decide


def _load_with_servetune(base: str, launch: VllmLaunch, workload: Workload, proc: subprocess.Popen[bytes],
                         watch: _ServerWatch, preemptions_before: float | None = None) -> TrialResult:
    async def sample() -> None:
        await asyncio.get_running_loop().run_in_executor(None, watch.sample)

    # The client sees a stall first (and per stream); the server's counters are only sampled here.
    run = asyncio.run(run_load(base, _served_model_name(launch), workload, on_tick=sample,
                               tick_interval_s=launch.sample_interval_s, request_timeout_s=launch.request_timeout_s,
                               stall_timeout_s=launch.stall_timeout_s, should_stop=lambda: _server_exit(proc),
                               decide=_decider(launch.early_stop, watch, preemptions_before)))
    figures = summarize(run.records, run.duration_s)
    result = TrialResult(TrialStatus.OK, backend="vllm", requests=run.records, **figures)
    if run.early_stopped:
        result.early_stopped = run.early_stopped
        result.evidence.append(f"early stop after {run.sent} of {len(workload.requests())} requests sent, "
                               f"{len(run.records)} answered: {run.early_stopped}")
    if figures["failed"]:
        errors = {r.error for r in run.records if r.error}
        result.evidence.append(f"{figures['failed']} requests failed: {sorted(errors)[:3]}")
    if run.stalled:
        result.status, result.cause = TrialStatus.TIMEOUT, run.stopped
    elif run.stopped:
        result.status, result.cause = TrialStatus.CRASHED, run.stopped
    return result


def _load_with_bench(base: str, launch: VllmLaunch, workload: Workload, proc: subprocess.Popen[bytes],
                     log_dir: Path, watch: _ServerWatch) -> TrialResult:
    stall: list[str] = []

    def on_poll() -> str | None:
        exited = _server_exit(proc)
        if exited:
            return exited
        why = watch.sample()
        if why:
            stall.append(why)
        return why

    argv = bench_argv(workload, base_url=base, model=launch.model, result_dir=log_dir,
                      result_filename="bench.json", served_model_name=_served_model_name(launch),
                      command=launch.bench_command)
    run = run_bench(argv, log_dir / "bench.json", log_dir / "bench.log", on_poll=on_poll,
                    poll_interval_s=launch.sample_interval_s, env=server_environ(launch.env),
                    stop_grace_s=min(5.0, launch.stop_grace_s))
    evidence = [f"load generator: vllm bench serve, argv={argv!r}"]
    if run.stopped is not None:
        status = TrialStatus.TIMEOUT if stall else TrialStatus.CRASHED
        return TrialResult(status, cause=run.stopped, backend="vllm", evidence=[*evidence, *(
            [run.error] if run.error else [])])
    if run.figures is None:
        return TrialResult(TrialStatus.CRASHED, cause=run.error, backend="vllm", evidence=evidence)
    result = TrialResult(TrialStatus.OK, backend="vllm", evidence=evidence, **run.figures)
    if run.returncode not in (0, None):
        result.evidence.append(f"vllm bench serve exited with code {run.returncode}")
    if result.failed:
        result.evidence.append(f"{result.failed} requests failed (vllm bench serve; see bench.log)")
    return result


def _served_model_name(launch: VllmLaunch) -> str:
    args = list(launch.extra_args)
    if "--served-model-name" in args:
        return args[args.index("--served-model-name") + 1]
    return launch.model


def _fill_from_log(result: TrialResult, parsed: ParsedLog) -> None:
    """Copy what vLLM's startup log says (version, KV capacity, memory breakdown, the start's phase
    timings and compile-cache verdict) into the result."""
    _fill_server_from_log(result, parsed)
    result.timings_s.update({k: float(v) for k, v in parsed.timings_s().items() if v is not None})
    result.compile_cache_hit = parsed.compile_cache_hit


def _fill_server_from_log(result: TrialResult, parsed: ParsedLog) -> None:
    """What the log says about the running server (version, KV capacity, memory breakdown): all a
    repeat measured on it shares with the trial that started it. The GPU block count the server's
    ``/metrics`` gave (:func:`_measure`) stays unless the log prints one; a count the parser derived
    from the KV tokens fills it only where ``/metrics`` gave none."""
    result.vllm_version = parsed.vllm_version or result.vllm_version
    result.kv_cache_tokens = parsed.kv_cache_tokens
    if result.num_gpu_blocks is None or (parsed.num_gpu_blocks is not None and not parsed.num_gpu_blocks_derived):
        result.num_gpu_blocks = parsed.num_gpu_blocks  # /metrics' count stays where the log's is derived or absent
    result.max_concurrency = parsed.max_concurrency
    parts = (parsed.weights_gib, parsed.activation_peak_gib, parsed.non_torch_gib, parsed.cudagraph_gib,
             parsed.available_kv_gib)
    if any(v is not None for v in parts):
        result.memory = MemoryBreakdown(total=parsed.total_gpu_gib or 0.0, budget=parsed.requested_gib or 0.0,
                                        weights=parsed.weights_gib or 0.0,
                                        activation_peak=parsed.activation_peak_gib or 0.0,
                                        non_torch=parsed.non_torch_gib or 0.0, cudagraph=parsed.cudagraph_gib or 0.0,
                                        kv_cache=parsed.available_kv_gib or 0.0)
    result.worker_memory = worker_memory(parsed)


def worker_memory(parsed: ParsedLog) -> dict[str, dict[str, float]]:
    r"""Each GPU worker's memory breakdown (GiB) as its own log lines give it.

    A TP/PP trial has one entry per rank (``TP0``, ``TP1``, ``PP0``, ``PP1_TP0``: vLLM's
    ``Worker_`` prefix dropped); a one-GPU trial has one (``EngineCore``). Only the parts the log
    shows are present. These are what ``/metrics`` cannot give: it has no per-GPU series.

    Example:
        >>> from servetune.engines.vllm.logs import parse_log
        >>> log = ("(Worker_TP0 pid=1) INFO 11-30 00:41:36 [gpu_worker.py:560] Available KV cache memory: 33.1 GiB\n"
        ...        "(Worker_TP1 pid=2) INFO 11-30 00:41:36 [gpu_worker.py:560] Available KV cache memory: 33.4 GiB\n")
        >>> worker_memory(parse_log(log))
        {'TP0': {'kv_cache': 33.1}, 'TP1': {'kv_cache': 33.4}}
    """
    names = {"weights_gib": "weights", "activation_peak_gib": "activation_peak", "non_torch_gib": "non_torch",
             "cudagraph_gib": "cudagraph", "available_kv_gib": "kv_cache", "total_gib": "total",
             "free_at_start_gib": "free_at_start"}
    out: dict[str, dict[str, float]] = {}
    for proc, mem in sorted(parsed.workers.items()):
        parts = {short: float(getattr(mem, long)) for long, short in names.items() if getattr(mem, long) is not None}
        if parts:
            label = proc[len("Worker_"):] if proc.startswith("Worker_") else proc
            out[re.sub(r"[^A-Za-z0-9]+", "_", label)] = parts
    return out


class VllmEngine(Engine):
    """``backend: vllm``: the task as a :class:`VllmLaunch` of real ``vllm serve`` (or the
    ``serve_command`` stand-in), run by :func:`run_vllm_trial`."""

    name = "vllm"
    capabilities = CAPABILITIES["vllm"]

    def run(self, task: TrialTask) -> TrialResult:
        launch = VllmLaunch(model=task.serve_model or task.model, flags=dict(task.flags),
                            serve_command=task.serve_command, startup_timeout_s=task.startup_timeout_s,
                            log_dir=Path(task.log_dir) if task.log_dir else None,
                            load_generator=task.load_generator, stall_timeout_s=task.stall_timeout_s,
                            env=compile_cache_env(task.compile_cache_dir),
                            early_stop=task.early_stop, leader_repeats=task.leader_repeats,
                            **_serve_help_source(tuple(task.serve_command)))
        return run_vllm_trial(launch, task.workload)


def _serve_help_source(serve_command: tuple[str, ...]) -> dict[str, Any]:
    """The help text where this host has read it already (checked before launch), else its reader,
    run beside the first launch: reading it first would put a vLLM import (20-30 s on the H200
    host) in front of every study's first start."""
    text = cached_serve_help(serve_command)
    if text is not None:
        return {"serve_help": text}
    return {"help_reader": functools.partial(read_serve_help, serve_command)}
