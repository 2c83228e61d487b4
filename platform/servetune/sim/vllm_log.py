"""vLLM-format log lines for the simulated ``vllm serve`` (:mod:`servetune.sim.server`). Pure.

Contract: given the resolved :class:`~servetune.planner.memory.EngineConfig`, the
:class:`~servetune.planner.modelinfo.ModelProfile`, the :class:`~servetune.planner.gpus.GpuSpec` and the
:class:`~servetune.planner.memory.MemoryPlan`, :func:`startup_script` returns the log records a real
vLLM (default 0.26.0) prints from launch to "Application startup complete." (or to its failure
traceback), each stamped with the virtual second at which it appears. Every figure comes from the
plan, so a log parser run on these lines recovers exactly the planner's prediction (KV cache
tokens, max concurrency, memory breakdown). :func:`format_record` renders one record in vLLM's
line format ``(<proc> pid=<pid>) <LEVEL> <MM-DD HH:MM:SS> [<file>.py:<line>] <msg>``; the caller
supplies the wall-clock time and the pids, so this module does no I/O and reads no clock.

The texts are copied from real vLLM 0.26.0 logs (``tests/fixtures/real_h200/*/server.log``) and vLLM's sources (the startup lines of
``vllm/v1/worker/gpu_worker.py``, the stats line of ``vllm/v1/metrics/loggers.py``, the error texts). Version
differences that a parser must tolerate are rendered too: "torch.compile takes" before 0.18,
"init engine ... took %.2f seconds" before 0.20, one merged KV-size line from 0.29.

Example:
    >>> rec = LogRecord(0.0, "EngineCore", "INFO", "gpu_worker.py:560", "Available KV cache memory: 67.64 GiB")
    >>> import datetime
    >>> format_record(rec, {"APIServer": 1742, "EngineCore": 1918}, datetime.datetime(2025, 11, 30, 0, 22, 4))
    '(EngineCore pid=1918) INFO 11-30 00:22:04 [gpu_worker.py:560] Available KV cache memory: 67.64 GiB'
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from servetune.result import TrialStatus
from servetune.vllm_version import version_tuple

from servetune.planner.comm import CONTEXT_GIB_SINGLE, SERVETUNE_LAUNCH_ENV, comm_memory

if TYPE_CHECKING:  # the planner's types; only their attributes are read here
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.engine_config import EngineConfig
    from servetune.planner.memory import MemoryPlan
    from servetune.planner.modelinfo import ModelProfile

__all__ = [
    "LogRecord", "StartupScript", "FAIL_MODES",
    "format_gib", "format_record", "non_default_args", "startup_script", "stats_message",
    "runtime_crash_records", "shutdown_records", "access_record", "config_error_records",
    "worker_procs", "startup_log_text", "run_log_text",
]

#: The ``--sim-fail`` modes of the stand-in server.
FAIL_MODES = ("startup_oom", "kv_too_small", "cudagraph_oom", "crash", "hang", "runtime_crash", "stall")

_GIB = float(1 << 30)
_MIB = float(1 << 20)
_DOCS = "https://docs.vllm.ai/en/latest/configuration/conserving_memory/"
_SITE = "/usr/local/lib/python3.12/dist-packages/vllm"
_BANNER = (
    "",
    "       █     █     █▄   ▄█",
    " ▄▄ ▄█ █     █     █ ▀▄▀ █  version {version}",
    "  █▄█▀ █     █     █     █  model   {model}",
    "   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀",
    "",
)
# Where each startup stage sits, as a fraction of the logged span, read off the real H200 logs
# (server1.log: 54 s compiled; b1_eager: 38 s eager). Eager skips torch.compile and the capture.
# The span is the last 73% of launch-to-healthy: the first ~20 s of a ~75 s start (summary.json
# startup_s vs the log's timestamps) go to Python imports before the banner.
_PRE_LOG_FRACTION = 0.27
_PHASES_COMPILED = {"engine": 0.296, "device": 0.33, "load": 0.35, "loaded": 0.39, "dynamo": 0.465,
                    "compiled": 0.667, "kv": 0.704, "captured": 0.722, "done": 0.981, "ready": 1.0}
_PHASES_EAGER = {"engine": 0.42, "device": 0.47, "load": 0.50, "loaded": 0.53, "dynamo": 0.53,
                 "compiled": 0.53, "kv": 0.605, "captured": 0.605, "done": 0.974, "ready": 1.0}
# Logged durations as fractions of the startup (compile 14.36 s and init 32.38 s of 54 s compiled;
# init 17.01 s of 38 s eager) and the weight-load rate (1.59 GiB in 0.30 s from local NVMe).
_COMPILE_FRACTION = 0.266
_INIT_FRACTION_COMPILED, _INIT_FRACTION_EAGER = 0.60, 0.448
_LOAD_GIB_PER_S = 5.3
_LOAD_FIXED_S = 1.81


@dataclasses.dataclass(frozen=True)
class LogRecord:
    """One log line before it is stamped: the virtual second it appears at, who logs it, and what.

    ``level == ""`` marks a raw line (tqdm bars, tracebacks, uvicorn's ``INFO:     ...``) that has
    only the ``(<proc> pid=N)`` prefix; ``proc == ""`` marks a line with no prefix at all.
    """

    at_s: float
    proc: str
    level: str
    src: str
    msg: str


@dataclasses.dataclass(frozen=True)
class StartupScript:
    """What the server prints from launch on, and how the launch ends.

    ``before_listen`` is printed first; then the HTTP socket starts listening and ``after_listen``
    (uvicorn's lines) follows. ``exit_code`` is None for a server that comes up (or hangs, when
    ``healthy`` is False), else the code it exits with after printing everything.
    """

    before_listen: list[LogRecord]
    after_listen: list[LogRecord]
    healthy: bool
    exit_code: int | None
    startup_s: float  # virtual seconds from launch to the last record


def format_gib(gib: float) -> str:
    """vLLM's ``format_gib`` (0.16+): ``str(round(x, 2))``, so ``3.0`` and ``-0.52``, not ``%.2f``."""
    return str(round(gib, 2))


def format_record(record: LogRecord, pids: Mapping[str, int], when: datetime.datetime) -> str:
    """One vLLM log line. ``pids`` maps a process name (``APIServer``, ``EngineCore``...) to its pid."""
    if not record.proc:
        return record.msg
    prefix = f"({record.proc} pid={pids.get(record.proc, pids.get('EngineCore', 0))})"
    if not record.level:
        return f"{prefix} {record.msg}"
    return f"{prefix} {record.level} {when.strftime('%m-%d %H:%M:%S')} [{record.src}] {record.msg}"


# EngineArgs' argparse order (ModelConfig, ParallelConfig, CacheConfig, SchedulerConfig,
# CompilationConfig groups), which is the order of vLLM's "non-default args" dict.
_ARG_ORDER = (
    "served_model_name", "dtype", "seed", "max_model_len", "quantization", "enforce_eager",
    "pipeline_parallel_size", "tensor_parallel_size", "disable_custom_all_reduce", "block_size", "gpu_memory_utilization",
    "kv_cache_memory_bytes", "kv_cache_dtype", "num_gpu_blocks_override", "enable_prefix_caching",
    "max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold", "enable_chunked_prefill",
    "scheduling_policy", "async_scheduling", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
)


def non_default_args(model_ref: str, host: str | None, port: int, given: Mapping[str, Any]) -> dict[str, Any]:
    """The dict vLLM logs as "non-default args": the model twice, host, a non-8000 port, given flags."""
    out: dict[str, Any] = {"model_tag": model_ref}
    if host is not None:
        out["host"] = host
    if port != 8000:
        out["port"] = port
    out["model"] = model_ref
    rank = {name: i for i, name in enumerate(_ARG_ORDER)}
    for name in sorted(given, key=lambda n: rank.get(n, len(rank))):
        if given[name] is not None:
            out[name] = given[name]
    return out


def _thousands(n: int) -> str:
    return f"{n:,}"


def _dtype_name(dtype: str) -> str:
    return "torch." + {"half": "float16"}.get(dtype, dtype)


def _compilation_config(config: EngineConfig) -> str:
    """The ``compilation_config={...}`` part of the engine config line, as 0.26 prints it."""
    mbt = config.max_num_batched_tokens
    if config.enforce_eager:
        return ("{'mode': <CompilationMode.NONE: 0>, 'debug_dump_path': None, 'cache_dir': '', "
                "'compile_cache_save_format': 'binary', 'backend': 'inductor', 'custom_ops': ['all'], "
                "'ir_enable_torch_wrap': False, 'splitting_ops': [], 'compile_mm_encoder': False, "
                f"'compile_sizes': [], 'compile_ranges_endpoints': [{mbt}], 'inductor_passes': {{}}, "
                "'cudagraph_mode': <CUDAGraphMode.NONE: 0>, 'cudagraph_num_of_warmups': 0, "
                "'cudagraph_capture_sizes': [], 'cudagraph_copy_inputs': False, 'cudagraph_specialize_lora': True, "
                "'use_inductor_graph_partition': False, 'max_cudagraph_capture_size': 0, 'local_cache_dir': None}")
    sizes = list(config.cudagraph_capture_sizes)
    return ("{'mode': <CompilationMode.VLLM_COMPILE: 3>, 'debug_dump_path': None, 'cache_dir': '', "
            "'compile_cache_save_format': 'binary', 'backend': 'inductor', 'custom_ops': ['none'], "
            "'ir_enable_torch_wrap': True, 'splitting_ops': ['vllm::unified_attention_with_output', "
            "'vllm::unified_mla_attention_with_output', 'vllm::unified_kv_cache_update'], "
            f"'compile_mm_encoder': False, 'compile_sizes': [], 'compile_ranges_endpoints': [{mbt}], "
            "'inductor_passes': {}, 'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>, "
            f"'cudagraph_num_of_warmups': 1, 'cudagraph_capture_sizes': {sizes}, 'cudagraph_copy_inputs': False, "
            "'cudagraph_specialize_lora': True, 'use_inductor_graph_partition': False, "
            f"'max_cudagraph_capture_size': {max(sizes) if sizes else 0}, 'local_cache_dir': None}}")


def _engine_config_line(model_ref: str, served: str, model: ModelProfile, config: EngineConfig) -> str:
    quant = model.quantization
    return (
        f"Initializing a V1 LLM engine (v{config.vllm_version}) with config: model='{model_ref}', "
        f"speculative_config=None, tokenizer='{model_ref}', skip_tokenizer_init=False, tokenizer_mode=auto, "
        f"revision=None, tokenizer_revision=None, trust_remote_code=False, dtype={_dtype_name(model.dtype)}, "
        f"max_seq_len={config.max_model_len}, download_dir=None, load_format=auto, "
        f"tensor_parallel_size={config.tensor_parallel_size}, pipeline_parallel_size={config.pipeline_parallel_size}, "
        f"data_parallel_size={config.data_parallel_size}, decode_context_parallel_size=1, dcp_comm_backend=ag_rs, "
        f"disable_custom_all_reduce={config.disable_custom_all_reduce}, quantization={quant}, quantization_config=None, "
        f"enforce_eager={config.enforce_eager}, enable_return_routed_experts=False, "
        f"kv_cache_dtype={config.kv_cache_dtype}, device_config=cuda, seed=0, served_model_name={served}, "
        f"enable_prefix_caching={config.enable_prefix_caching}, "
        f"enable_chunked_prefill={config.enable_chunked_prefill}, pooler_config=None, "
        f"compilation_config={_compilation_config(config)}")


@dataclasses.dataclass(frozen=True)
class _Frame:
    file: str
    line: int
    func: str
    code: str


# Traceback frames of vLLM 0.26's engine-core start (copied from b5_fail_u0012/server.log).
_CORE_FRAMES = (
    _Frame("v1/engine/core.py", 1299, "run_engine_core",
           "engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)"),
    _Frame("v1/engine/core.py", 1065, "__init__", "super().__init__("),
)
_INIT_DEVICE_FRAMES = (
    _Frame("v1/engine/core.py", 112, "__init__", "self.model_executor = executor_class(vllm_config)"),
    _Frame("v1/executor/abstract.py", 103, "__init__", "self._init_executor()"),
    _Frame("v1/executor/uniproc_executor.py", 52, "_init_executor", 'self.driver_worker.init_device()'),
    _Frame("v1/worker/gpu_worker.py", 262, "init_device", "self.requested_memory = request_memory(init_snapshot, self.cache_config)"),
    _Frame("v1/worker/utils.py", 410, "request_memory", "raise ValueError("),
)
_LOAD_FRAMES = (
    _Frame("v1/engine/core.py", 112, "__init__", "self.model_executor = executor_class(vllm_config)"),
    _Frame("v1/executor/abstract.py", 103, "__init__", "self._init_executor()"),
    _Frame("v1/executor/uniproc_executor.py", 54, "_init_executor", "self.driver_worker.load_model()"),
    _Frame("v1/worker/gpu_worker.py", 391, "load_model", "self.model_runner.load_model(eep_scale_up=eep_scale_up)"),
    _Frame("v1/worker/gpu/model_runner.py", 290, "load_model", "self.model = model_loader.load_model("),
)
_FLASHINFER_FRAMES = _LOAD_FRAMES + (
    _Frame("v1/attention/backends/flashinfer.py", 14, "<module>", "from flashinfer import ("),
)
_KV_FRAMES = (
    _Frame("v1/engine/core.py", 136, "__init__", "kv_cache_config = self._initialize_kv_caches(vllm_config)"),
    _Frame("v1/engine/core.py", 297, "_initialize_kv_caches", "kv_cache_configs = get_kv_cache_configs("),
    _Frame("v1/core/kv_cache_utils.py", 2132, "get_kv_cache_configs", "_check_enough_kv_cache_memory("),
    _Frame("v1/core/kv_cache_utils.py", 758, "_check_enough_kv_cache_memory", "raise ValueError("),
)
_CAPTURE_FRAMES = (
    _Frame("v1/engine/core.py", 136, "__init__", "kv_cache_config = self._initialize_kv_caches(vllm_config)"),
    _Frame("v1/engine/core.py", 318, "_initialize_kv_caches", "self.model_executor.initialize_from_config(kv_cache_configs)"),
    _Frame("v1/executor/abstract.py", 117, "initialize_from_config", 'self.collective_rpc("compile_or_warm_up_model")'),
    _Frame("v1/worker/gpu_worker.py", 640, "compile_or_warm_up_model", "cuda_graph_memory_bytes = self.model_runner.capture_model()"),
    _Frame("v1/worker/gpu/model_runner.py", 742, "capture_model", "self.cudagraph_manager.capture("),
    _Frame("torch/cuda/graphs.py", 265, "__exit__", "self.cuda_graph.capture_end()"),
)
_API_FRAMES = (
    ("<frozen runpy>", 198, "_run_module_as_main", None),
    ("<frozen runpy>", 88, "_run_code", None),
    (f"{_SITE}/entrypoints/cli/main.py", 101, "<module>", "main()"),
    (f"{_SITE}/entrypoints/cli/main.py", 95, "main", "args.dispatch_function(args)"),
    (f"{_SITE}/entrypoints/cli/serve.py", 148, "cmd", "uvloop.run(run_server(args))"),
    (f"{_SITE}/entrypoints/openai/api_server.py", 759, "run_server",
     "await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)"),
    (f"{_SITE}/entrypoints/openai/api_server.py", 773, "run_server_worker", "async with build_async_engine_client("),
    (f"{_SITE}/entrypoints/openai/api_server.py", 175, "build_async_engine_client_from_engine_args",
     "async_llm = AsyncLLM.from_vllm_config("),
    (f"{_SITE}/v1/engine/async_llm.py", 146, "__init__", "self.engine_core = EngineCoreClient.make_async_mp_client("),
    (f"{_SITE}/v1/engine/core_client.py", 573, "__init__", "with launch_core_engines("),
    (f"{_SITE}/v1/engine/utils.py", 1213, "launch_core_engines", "wait_for_engine_startup("),
    (f"{_SITE}/v1/engine/utils.py", 1272, "wait_for_engine_startup", "raise RuntimeError("),
)


def _frame_lines(frames: Sequence[_Frame]) -> list[str]:
    out = []
    for f in frames:
        path = f.file if f.file.startswith(("/", "<")) else (
            f"/usr/local/lib/python3.12/dist-packages/{f.file}" if f.file.startswith("torch/") else f"{_SITE}/{f.file}")
        out.append(f'  File "{path}", line {f.line}, in {f.func}')
        out.append(f"    {f.code}")
    return out


def _engine_failure(at_s: float, proc: str, frames: Sequence[_Frame], exc_type: str, message: str) -> list[LogRecord]:
    """The EngineCore's ERROR block, its process traceback, then the API server's RuntimeError."""
    src = "core.py:1330"
    body = ["Traceback (most recent call last):", *_frame_lines(_CORE_FRAMES + tuple(frames)), f"{exc_type}: {message}"]
    recs = [LogRecord(at_s, proc, "ERROR", src, "EngineCore failed to start.")]
    recs += [LogRecord(at_s, proc, "ERROR", src, line) for line in body]
    process_tb = ["Process EngineCore:", "Traceback (most recent call last):",
                  '  File "/usr/lib/python3.12/multiprocessing/process.py", line 314, in _bootstrap',
                  "    self.run()",
                  '  File "/usr/lib/python3.12/multiprocessing/process.py", line 108, in run',
                  "    self._target(*self._args, **self._kwargs)",
                  f'  File "{_SITE}/v1/engine/core.py", line 1334, in run_engine_core',
                  "    raise e", *body[1:]]
    recs += [LogRecord(at_s, proc, "", "", line) for line in process_tb]
    return recs + _api_failure(at_s + 0.5, "RuntimeError",
                               "Engine core initialization failed. See root cause above. Failed core proc(s): {}")


def _api_failure(at_s: float, exc_type: str, message: str) -> list[LogRecord]:
    lines = ["Traceback (most recent call last):"]
    for path, line, func, code in _API_FRAMES:
        lines.append(f'  File "{path}", line {line}, in {func}')
        if code:
            lines.append(f"    {code}")
    lines.append(f"{exc_type}: {message}")
    return [LogRecord(at_s, "APIServer", "", "", line) for line in lines]


def config_error_records(at_s: float, exc_type: str, message: str) -> list[LogRecord]:
    """The API server failing before any engine starts (bad flag value, unknown model, port in use)."""
    return _api_failure(at_s, exc_type, message)


def _fail_stage(plan: MemoryPlan, fail: str | None) -> tuple[str, str, str] | None:
    """(stage, exception type, message) of the startup failure, or None when startup succeeds."""
    if fail in ("startup_oom", "kv_too_small", "cudagraph_oom", "crash", "hang"):
        return (fail, "", "")  # texts are made where the numbers are known
    if plan.failure is None or fail is not None:
        return None
    cause = plan.cause or ""
    oom = "CUDA out of memory" in cause
    exc = "torch.OutOfMemoryError" if oom else "ValueError"
    if plan.failure is TrialStatus.CUDAGRAPH_OOM:
        return ("cudagraph_oom", exc, cause)
    if plan.failure is TrialStatus.KV_TOO_SMALL:
        return ("kv", exc, cause)
    if plan.failure is TrialStatus.STARTUP_OOM:
        if cause.startswith("Free memory on device"):
            return ("device", exc, cause)
        if oom or "Failed to load model" in cause:
            return ("load", "torch.OutOfMemoryError", cause)
        return ("kv", exc, cause)
    if plan.failure is TrialStatus.INVALID_CONFIG:
        return ("config", exc, cause)
    return ("load", "RuntimeError", cause or f"engine failed: {plan.failure.value}")


def worker_procs(config: EngineConfig) -> list[str]:
    """Process names of the workers: the engine core itself at world size 1, else Worker_TP<r>."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if tp * pp == 1:
        return ["EngineCore"]
    if pp == 1:
        return [f"Worker_TP{r}" for r in range(tp)]
    return [f"Worker_PP{p}_TP{r}" for p in range(pp) for r in range(tp)]


def startup_script(
    model: ModelProfile,
    gpu: GpuSpec,
    config: EngineConfig,
    plan: MemoryPlan,
    *,
    model_ref: str,
    served_model_name: str,
    host: str,
    port: int,
    given_flags: Mapping[str, Any],
    api_pid: int,
    fail: str | None = None,
    startup_s: float | None = None,
    held_gib: float = 0.0,
) -> StartupScript:
    """vLLM's startup log for this engine config, from the banner to uvicorn's "startup complete".

    ``startup_s`` (virtual launch-to-healthy seconds) defaults to ``plan.startup_s``. ``fail``
    forces one of :data:`FAIL_MODES` (the runtime ones, ``runtime_crash`` and ``stall``, start
    normally). A plan with ``failure`` set ends in vLLM's own traceback with ``plan.cause``.
    ``held_gib`` is memory other processes hold on the device (:mod:`servetune.sim.devices`): it
    is not free at startup, and a budget above what is left fails as vLLM's worker does.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.memory import plan_memory, resolve_engine_config
        >>> from servetune.planner.modelinfo import load_model
        >>> model, gpu = load_model("servetune-test-850m"), get_gpu("H200")
        >>> config = resolve_engine_config({}, model, gpu, "0.26.0")
        >>> plan = plan_memory(model, gpu, config)
        >>> script = startup_script(model, gpu, config, plan, model_ref="servetune-test-850m",
        ...                         served_model_name="m", host="127.0.0.1", port=8000, given_flags={}, api_pid=1)
        >>> script.healthy, script.after_listen[-1].msg
        (True, 'INFO:     Application startup complete.')
    """
    w = _StartupWriter(model, gpu, config, plan, model_ref=model_ref, served_model_name=served_model_name,
                       host=host, port=port, given_flags=given_flags, fail=fail, startup_s=startup_s)
    for phase in (w.api_args, lambda: w.device(held_gib), w.weights, w.kv_cache, w.cuda_graphs):
        ended = phase()
        if ended is not None:
            return ended
    w.memory_summary()
    return w.ready(api_pid)


class _StartupWriter:
    """The startup log being written, phase by phase, in the order vLLM prints it. A phase that
    ends the startup (a failure, a hang) returns the finished :class:`StartupScript`."""

    def __init__(self, model: ModelProfile, gpu: GpuSpec, config: EngineConfig, plan: MemoryPlan, *,
                 model_ref: str, served_model_name: str, host: str, port: int, given_flags: Mapping[str, Any],
                 fail: str | None, startup_s: float | None) -> None:
        self.model, self.gpu, self.config, self.plan = model, gpu, config, plan
        self.model_ref, self.served, self.given = model_ref, served_model_name, given_flags
        self.host, self.port = host, port
        total = float(startup_s if startup_s is not None else plan.startup_s)
        total = max(total, 1e-3)
        self.eager = config.enforce_eager
        phases = _PHASES_EAGER if self.eager else _PHASES_COMPILED
        self.pre = _PRE_LOG_FRACTION * total
        self.span = total - self.pre
        self.t = {k: self.pre + v * self.span for k, v in phases.items()}
        self.mem = plan.memory
        self.world = config.tensor_parallel_size * config.pipeline_parallel_size
        self.version = config.vllm_version
        self.vt = version_tuple(self.version) or (0, 0, 0)
        self.stage = _fail_stage(plan, fail)
        self.workers = worker_procs(config)
        self.lead = self.workers[0]
        self.recs: list[LogRecord] = []
        self.free_gib = 0.0  # free device memory at startup, once the device phase knows it
        self.compile_s = _COMPILE_FRACTION * self.span

    def api(self, at: float, src: str, msg: str, level: str = "INFO") -> None:
        self.recs.append(LogRecord(at, "APIServer", level, src, msg))

    def core(self, at: float, src: str, msg: str, level: str = "INFO", proc: str = "EngineCore") -> None:
        self.recs.append(LogRecord(at, proc, level, src, msg))

    def fail_script(self, records: list[LogRecord]) -> StartupScript:
        return StartupScript(self.recs + records, [], False, 1, records[-1].at_s if records else 0.0)

    def _stage_is(self, *names: str) -> bool:
        return self.stage is not None and self.stage[0] in names

    def api_args(self) -> StartupScript | None:
        """The API server: banner, args, model config, the scheduler's and compiler's choices."""
        config, pre, api = self.config, self.pre, self.api
        for line in _BANNER:
            api(pre, "api_utils.py:345", line.format(version=self.version, model=self.model_ref))
        args = non_default_args(self.model_ref, self.host, self.port, self.given)
        api(pre, "api_utils.py:273", f"non-default args: {args}")
        api(pre, "model.py:623", f"Resolved architecture: {self.model.architecture}")
        api(pre, "model.py:1788", f"Using max model len {config.max_model_len}")
        if self.stage is not None and self.stage[0] == "config":
            return self.fail_script(_api_failure(pre + 0.5, self.stage[1], self.stage[2]))
        if config.kv_cache_dtype.startswith("fp8"):
            api(pre, "cache.py:226", f"Using {config.kv_cache_dtype} data type to store kv cache. It reduces the GPU "
                "memory footprint and boosts the performance. Meanwhile, it may cause accuracy drop without a proper "
                "scaling factor")
        if config.enable_chunked_prefill and self.given.get("max_num_batched_tokens") is None:
            # vLLM reports the budget it chose, so the line is absent when the flag was given (b2 log).
            api(pre, "scheduler.py:252",
                f"Chunked prefill is enabled with max_num_batched_tokens={config.max_num_batched_tokens}.")
        if config.async_scheduling:
            api(pre, "vllm.py:1109", "Asynchronous scheduling is enabled.")
        if self.eager:
            api(pre, "vllm.py:1163", "Enforce eager set, disabling torch.compile and CUDAGraphs. This is equivalent to "
                "setting -cc.mode=none -cc.cudagraph_mode=none", "WARNING")
            api(pre, "vllm.py:1392", "Cudagraph is disabled under eager mode")
        return None


    def device(self, held_gib: float) -> StartupScript | None:
        """The engine core and its workers take the devices; the free memory meets the budget."""
        config, gpu, mem, t, core, lead = self.config, self.gpu, self.mem, self.t, self.core, self.lead
        world = self.world
        core(t["engine"], "core.py:116", _engine_config_line(self.model_ref, self.served, self.model, config))
        for rank, proc in enumerate(self.workers):
            core(t["device"], "parallel_state.py:1615", f"world_size={world} rank={rank} local_rank={rank} "
                 f"distributed_init_method=tcp://127.0.0.1:{29500 + self.port % 1000} backend=nccl", proc=proc)
        core(t["device"], "parallel_state.py:1946", f"rank 0 in world size {world} is assigned as DP rank 0, PP rank 0, "
             "PCP rank 0, TP rank 0, EP rank N/A, EPLB rank N/A", proc=lead)
        # What is in use before vLLM's init snapshot: the planner's figure (planner.comm, one
        # implementation), unless the GPU's calibration overrides it.
        comm = self.plan.comm if self.plan.comm is not None else comm_memory(
            gpu, tp=config.tensor_parallel_size, pp=config.pipeline_parallel_size, env=SERVETUNE_LAUNCH_ENV)
        context_gib = comm.context_bytes / _GIB
        if "cuda_context_gib" in gpu.calibration or "nccl_buffers_gib" in gpu.calibration:
            context_gib = float(gpu.calibration.get("cuda_context_gib", CONTEXT_GIB_SINGLE))
            if world > 1:  # the communicators' share: the planner's multi-GPU context beyond the CUDA context
                context_gib += float(gpu.calibration.get("nccl_buffers_gib",
                                                         comm.context_bytes / _GIB - CONTEXT_GIB_SINGLE))
        free_gib = mem.total - context_gib - max(0.0, held_gib)
        util = config.gpu_memory_utilization
        if self.stage is None and free_gib < mem.budget:
            # vLLM's worker compares the free memory at startup with the budget (gpu_worker.py): memory
            # other processes hold, or a utilization above what an empty GPU has after the context.
            self.stage = ("device", "ValueError",
                          f"Free memory on device ({format_gib(free_gib)}/{format_gib(mem.total)} GiB) on startup is "
                          f"less than desired GPU memory utilization ({util}, {format_gib(mem.budget)} GiB). Decrease "
                          "GPU memory utilization or reduce GPU memory used by other processes.")
        self.free_gib = free_gib
        if self.stage is not None and self.stage[0] in ("device", "startup_oom"):
            if self.stage[0] == "device":
                message = self.stage[2]
            else:  # forced: another process holds part of the GPU, so the util budget is not free
                free_gib = min(free_gib, mem.budget * 0.5)
                message = (f"Free memory on device ({format_gib(free_gib)}/{format_gib(mem.total)} GiB) on startup "
                           f"is less than desired GPU memory utilization ({util}, {format_gib(mem.budget)} GiB). "
                           "Decrease GPU memory utilization or reduce GPU memory used by other processes.")
            return self.fail_script(_engine_failure(t["device"] + 0.5, lead, _INIT_DEVICE_FRAMES, "ValueError",
                                                    message))
        core(t["device"], "gpu_worker.py:378", "Using V2 Model Runner", proc=lead)
        return None

    def weights(self) -> StartupScript | None:
        """Every worker loads its share of the weights."""
        mem, t, core, lead, stage = self.mem, self.t, self.core, self.lead, self.stage
        for proc in self.workers:
            core(t["load"], "model_runner.py:284", "Loading model from scratch...", proc=proc)
        if stage is not None and stage[0] == "crash":
            return self.fail_script(_engine_failure(t["load"] + 0.3, lead, _FLASHINFER_FRAMES, "ModuleNotFoundError",
                                                    "No module named 'flashinfer'"))
        core(t["load"], "cuda.py:482", "Using FLASH_ATTN attention backend out of potential backends: "
             "['FLASH_ATTN', 'TRITON_ATTN', 'FLEX_ATTENTION'].", proc=lead)
        if stage is not None and stage[0] == "load":
            return self.fail_script(_engine_failure(t["loaded"], lead, _LOAD_FRAMES, stage[1], stage[2]))
        weights_s = max(0.05, mem.weights / _LOAD_GIB_PER_S)
        core(t["loaded"], "default_loader.py:430", f"Loading weights took {weights_s:.2f} seconds", proc=lead)
        for rank, proc in enumerate(self.workers):
            load_s = weights_s + _LOAD_FIXED_S + 0.07 * rank
            core(t["loaded"], "model_runner.py:305", f"Model loading took {format_gib(mem.weights)} GiB and "
                 f"{load_s:.6f} seconds", proc=proc)
        if stage is not None and stage[0] == "hang":
            return StartupScript(self.recs, [], False, None, t["loaded"])
        return None

    def kv_cache(self) -> StartupScript | None:
        """torch.compile (unless eager), the profile run, and the KV cache it leaves room for."""
        config, plan, mem, t, core, lead, stage = self.config, self.plan, self.mem, self.t, self.core, self.lead, self.stage
        compile_s = self.compile_s
        if not self.eager:
            core(t["dynamo"], "backends.py:1094", "Using cache directory: /root/.cache/vllm/torch_compile_cache/"
                 "0c5e1a7b3d/rank_0_0/backbone for vLLM's torch.compile", proc=lead)
            core(t["dynamo"], "backends.py:1155", f"Dynamo bytecode transform time: {0.285 * compile_s:.2f} s",
                 proc=lead)
            core(t["compiled"], "backends.py:393", f"Compiling a graph for compile range (1, "
                 f"{config.max_num_batched_tokens}) takes {0.597 * compile_s:.2f} s", proc=lead)
            verb = "took" if self.vt >= (0, 18) else "takes"
            core(t["compiled"], "monitor.py:53", f"torch.compile {verb} {compile_s:.2f} s in total", proc=lead)
            core(t["compiled"], "monitor.py:81", "Initial profiling/warmup run took 0.16 s", proc=lead)
        kv_gib = mem.kv_cache
        need_gib = math.ceil(config.max_model_len / plan.block_size) * plan.block_size * plan.kv_bytes_per_token / _GIB
        if stage is not None and stage[0] == "kv_too_small":  # forced: pretend half of one max-len request fits
            kv_gib = need_gib / 2
        if config.kv_cache_memory_bytes is not None:
            core(t["kv"], "gpu_worker.py:521", f"Initial free memory {format_gib(self.free_gib)} GiB, reserved "
                 f"{format_gib(config.kv_cache_memory_bytes / _GIB)} GiB memory for KV Cache as specified by "
                 "kv_cache_memory_bytes config and skipped memory profiling. This does not respect the "
                 "gpu_memory_utilization config. Only use kv_cache_memory_bytes config when you want manual control "
                 "of KV cache memory size. If OOM'ed, check the difference of initial free memory between the current "
                 "run and the previous run where kv_cache_memory_bytes is suggested and update it correspondingly.",
                 proc=lead)
        else:
            core(t["kv"], "gpu_worker.py:560", f"Available KV cache memory: {format_gib(kv_gib)} GiB", proc=lead)
        if stage is not None and stage[0] == "kv_too_small":
            est = int(kv_gib * _GIB // (plan.kv_bytes_per_token * plan.block_size)) * plan.block_size
            message = (f"To serve at least one request with the model's max seq len ({config.max_model_len}), "
                       f"({format_gib(need_gib)} GiB KV cache is needed, which is larger than the available KV cache "
                       f"memory ({format_gib(kv_gib)} GiB). Based on the available memory, the estimated maximum model "
                       f"length is {est}. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
                       f"initializing the engine. See {_DOCS} for more details.")
            return self.fail_script(_engine_failure(t["kv"], "EngineCore", _KV_FRAMES, "ValueError", message))
        if stage is not None and stage[0] == "kv":
            return self.fail_script(_engine_failure(t["kv"], "EngineCore", _KV_FRAMES, stage[1], stage[2]))
        if config.num_gpu_blocks_override is not None:
            computed = int(max(mem.kv_cache, 0.0) * _GIB // (plan.kv_bytes_per_token * plan.block_size))
            core(t["kv"], "kv_cache_utils.py:2115", f"Overriding num_gpu_blocks={computed} with "
                 f"num_gpu_blocks_override={config.num_gpu_blocks_override}")
        size = f"GPU KV cache size: {_thousands(plan.kv_cache_tokens)} tokens"
        conc = (f"Maximum concurrency for {_thousands(config.max_model_len)} tokens per request: "
                f"{plan.max_concurrency:.2f}x")
        if self.vt >= (0, 29):
            core(t["kv"], "kv_cache_utils.py:2177", f"{size}, {conc}")
        else:
            core(t["kv"], "kv_cache_utils.py:2177", size)
            core(t["kv"], "kv_cache_utils.py:2178", conc)
        return None

    def cuda_graphs(self) -> StartupScript | None:
        """CUDA-graph capture (none under eager), where a forced or planned graph OOM ends the start."""
        config, mem, t, lead, stage = self.config, self.mem, self.t, self.lead, self.stage
        sizes = list(config.cudagraph_capture_sizes)
        # the planner's sampler warm-up failure: the graphs are captured, the warm-up after them runs out
        warmup = stage is not None and stage[0] == "cudagraph_oom" and "warming up sampler" in stage[2]
        if not self.eager and sizes:
            full = [s for s in sizes if s <= config.max_num_seqs]
            n_pw, n_full = len(sizes), len(full)
            if stage is not None and stage[0] in ("cudagraph_oom",) and not warmup:
                self.recs.append(LogRecord(t["kv"] + 0.2, lead, "", "",
                                           f"Capturing CUDA graphs (PIECEWISE):  40%|████      | "
                                           f"{int(n_pw * 0.4)}/{n_pw} [00:00<00:00, 31.20it/s]"))
                message = stage[2] if stage[2] else _cuda_oom_text(mem, self.gpu, 20.0)
                return self.fail_script(_engine_failure(t["kv"] + 0.4, lead, _CAPTURE_FRAMES,
                                                        "torch.OutOfMemoryError", message))
            self.recs.append(LogRecord(t["captured"], lead, "", "", f"Capturing CUDA graphs (PIECEWISE): "
                                       f"100%|██████████| {n_pw}/{n_pw} [00:00<00:00, 37.46it/s]"))
            self.recs.append(LogRecord(t["captured"], lead, "", "", f"Capturing CUDA graphs (FULL): "
                                       f"100%|██████████| {n_full}/{n_full} [00:00<00:00, 56.05it/s]"))
            capture_s = max(1, round(0.02 * self.span))
            for proc in self.workers:
                self.core(t["captured"], "model_runner.py:747",
                          f"Graph capturing finished in {capture_s:.0f} secs, took {mem.cudagraph:.2f} GiB", proc=proc)
            if warmup and stage is not None:
                exc, _, message = stage[2].partition(": ")
                return self.fail_script(_engine_failure(t["captured"] + 0.2, lead, _CAPTURE_FRAMES[:4], exc, message))
        elif stage is not None and stage[0] == "cudagraph_oom":  # eager has no graphs: OOM in the sampler warm-up
            n = min(config.max_num_seqs, config.max_num_batched_tokens)
            return self.fail_script(_engine_failure(t["kv"] + 0.2, lead, _CAPTURE_FRAMES[:4], "RuntimeError",
                                                    f"CUDA out of memory occurred when warming up sampler with {n} "
                                                    "dummy requests. Please try lowering `max_num_seqs` or "
                                                    "`gpu_memory_utilization` when initializing the engine."))
        return None

    def memory_summary(self) -> None:
        """Each worker's memory summary (not with kv_cache_memory_bytes), then "init engine ... took"."""
        config, mem, t, free_gib = self.config, self.mem, self.t, self.free_gib
        util = config.gpu_memory_utilization
        if config.kv_cache_memory_bytes is None:
            used = mem.weights + mem.activation_peak + mem.non_torch + mem.cudagraph
            fit = int(mem.budget * _GIB - used * _GIB - 150 * _MIB)
            full_use = int(free_gib * _GIB - used * _GIB - 150 * _MIB)
            for proc in self.workers:
                self.core(t["captured"], "gpu_worker.py:857",
                          f"Free memory on device ({format_gib(free_gib)}/{format_gib(mem.total)} GiB) on startup. "
                          f"Desired GPU memory utilization is ({util}, {format_gib(mem.budget)} GiB). Actual usage is "
                          f"{format_gib(mem.weights)} GiB for weight, {format_gib(mem.activation_peak)} GiB for peak "
                          f"activation, {format_gib(mem.non_torch)} GiB for non-torch memory, and "
                          f"{format_gib(mem.cudagraph)} GiB for CUDAGraph memory. Replace gpu_memory_utilization config "
                          f"with `--kv-cache-memory={fit}` ({format_gib(fit / _GIB)} GiB) to fit into requested memory, "
                          f"or `--kv-cache-memory={full_use}` ({format_gib(full_use / _GIB)} GiB) to fully utilize gpu "
                          f"memory. Current kv cache memory in use is {format_gib(mem.kv_cache)} GiB.", proc=proc)
        init_s = (_INIT_FRACTION_EAGER if self.eager else _INIT_FRACTION_COMPILED) * self.span
        if self.vt < (0, 20):
            done = f"init engine (profile, create kv cache, warmup model) took {init_s:.2f} seconds"
        elif self.eager:
            done = f"init engine (profile, create kv cache, warmup model) took {init_s:.2f} s"
        else:
            done = (f"init engine (profile, create kv cache, warmup model) took {init_s:.2f} s "
                    f"(compilation: {self.compile_s:.2f} s)")
        self.core(t["done"], "core.py:347" if self.eager else "core.py:340", done)

    def ready(self, api_pid: int) -> StartupScript:
        """The API server comes up: routes, then uvicorn's lines once the socket listens."""
        ready = self.t["ready"]
        api = self.api
        api(ready, "api_server.py:673", "Supported tasks: ['generate']")
        api(ready, "api_server.py:677", f"Starting vLLM server on http://{_url_host(self.host)}:{self.port}")
        api(ready, "launcher.py:37", "Available routes are:")
        for route, methods in (("/health", "GET"), ("/load", "GET"), ("/version", "GET"), ("/metrics", "GET"),
                               ("/v1/models", "GET"), ("/ping", "GET"), ("/v1/completions", "POST")):
            api(ready, "launcher.py:46", f"Route: {route}, Methods: {methods}")
        after = [LogRecord(ready, "APIServer", "", "", f"INFO:     Started server process [{api_pid}]"),
                 LogRecord(ready, "APIServer", "", "", "INFO:     Waiting for application startup."),
                 LogRecord(ready, "APIServer", "", "", "INFO:     Application startup complete.")]
        return StartupScript(self.recs, after, True, None, ready)


def startup_log_text(model: ModelProfile, gpu: GpuSpec, config: EngineConfig, plan: MemoryPlan) -> str:
    """vLLM's startup log of a simulated trial, rendered (the stand-in server writes the same records),
    so log parsers read simulated trials like real ones."""
    script = startup_script(model, gpu, config, plan, model_ref=model.name, served_model_name=model.name,
                            host="127.0.0.1", port=8000, given_flags={}, api_pid=0)
    pids = {"APIServer": 0, "EngineCore": 1}
    for i, proc in enumerate(worker_procs(config)):
        pids.setdefault(proc, 2 + i)
    when = datetime.datetime(2026, 1, 1)
    return "".join(format_record(r, pids, when) + "\n" for r in (*script.before_listen, *script.after_listen))


def run_log_text(prompt_tokens: int, generation_tokens: int, elapsed_s: float, preemptions: int, kv_usage_peak: float,
                 hit_rate_pct: float, *, seed: int, steps: int, completed: int | None, duration_s: float,
                 output_throughput: float) -> str:
    """One vLLM-style stats line for a whole simulated run, plus a simulator summary line."""
    dur = max(duration_s, 1e-9)
    line = (f"(APIServer pid=0) INFO 01-01 00:00:10 [loggers.py:1] Engine 000: Avg prompt throughput: "
            f"{prompt_tokens / max(elapsed_s, 1e-9):.1f} tokens/s, Avg generation throughput: "
            f"{generation_tokens / max(elapsed_s, 1e-9):.1f} tokens/s, Running: 0 reqs, Waiting: 0 reqs, ")
    if preemptions:
        line += f"Preemptions: {preemptions}, "
    line += f"GPU KV cache usage: {100 * kv_usage_peak:.1f}%, Prefix cache hit rate: {hit_rate_pct:.1f}%"
    summary = (f"servetune-sim: seed={seed} steps={steps} completed={completed} "
               f"duration={dur:.3f}s output_throughput={output_throughput:.1f} tok/s "
               f"preemptions={preemptions}")
    return line + "\n" + summary + "\n"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _cuda_oom_text(mem: Any, gpu: GpuSpec, tried_mib: float) -> str:
    """PyTorch's CUDA OOM message for an allocation that did not fit on an almost full device."""
    in_use = mem.total - 0.02
    return (f"CUDA out of memory. Tried to allocate {tried_mib:.2f} MiB. GPU 0 has a total capacity of "
            f"{mem.total:.2f} GiB of which 17.75 MiB is free. Including non-PyTorch memory, this process has "
            f"{in_use:.2f} GiB memory in use. Of the allocated memory {in_use - 0.6:.2f} GiB is allocated by PyTorch, "
            "and 412.31 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
            "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def stats_message(prompt_tps: float, generation_tps: float, running: int, waiting: int, kv_usage: float,
                  prefix_hit_rate: float, engine: int = 0) -> str:
    """The periodic ``loggers.py`` stats line (0.26 shape); ``kv_usage`` and the hit rate are 0..1."""
    return (f"Engine {engine:03d}: Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: "
            f"{generation_tps:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, GPU KV cache usage: "
            f"{kv_usage * 100:.1f}%, Prefix cache hit rate: {prefix_hit_rate * 100:.1f}%")


def runtime_crash_records(at_s: float) -> list[LogRecord]:
    """An engine core dying while serving: its fatal error, then the API server's EngineDeadError."""
    frames = [
        _Frame("v1/engine/core.py", 1003, "run_busy_loop", "self._process_engine_step()"),
        _Frame("v1/engine/core.py", 1038, "_process_engine_step", "outputs, model_executed = self.step_fn()"),
        _Frame("v1/engine/core.py", 442, "step_with_batch_queue", "model_output = future.result()"),
        _Frame("v1/worker/gpu/model_runner.py", 1093, "sample_tokens", "sampled = self.sampler(logits, metadata)"),
    ]
    body = ["Traceback (most recent call last):", *_frame_lines(frames),
            "torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
            "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
            "might be incorrect.",
            "For debugging consider passing CUDA_LAUNCH_BLOCKING=1"]
    recs = [LogRecord(at_s, "EngineCore", "ERROR", "core.py:1010", "EngineCore encountered a fatal error.")]
    recs += [LogRecord(at_s, "EngineCore", "ERROR", "core.py:1010", line) for line in body]
    recs.append(LogRecord(at_s, "APIServer", "ERROR", "async_llm.py:693", "AsyncLLM output_handler failed."))
    recs.append(LogRecord(at_s, "APIServer", "ERROR", "async_llm.py:693", "vllm.v1.engine.exceptions."
                          "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause."))
    recs.append(LogRecord(at_s, "APIServer", "ERROR", "core_client.py:610",
                          "Engine core proc EngineCore died unexpectedly, shutting down client."))
    return recs


def shutdown_records(at_s: float, signal_name: str = "SIGTERM") -> list[LogRecord]:
    """The graceful-shutdown lines 0.26 prints on SIGTERM (server1.log)."""
    c, a = "EngineCore", "APIServer"
    rows = [
        (c, "core.py:1313", f"[shutdown] EngineCore: trigger received signal={signal_name}"),
        (a, "launcher.py:100", "[shutdown] API server: shutdown triggered"),
        (a, "launcher.py:116", "[shutdown] API server: stopping engine client mode=abort timeout=0s"),
        (c, "core.py:1432", "[shutdown] EngineCore: start mode=abort timeout=0s"),
        (c, "core.py:1463", "[shutdown] EngineCore: request processing complete; starting resource teardown"),
        (c, "core.py:1326", "[shutdown] EngineCore: exiting busy loop"),
        (a, "core_client.py:655", "[shutdown] MPClient: start timeout=0s"),
        (a, "core_client.py:662", "[shutdown] MPClient: complete"),
        (a, "launcher.py:125", "[shutdown] API server: engine client stopped"),
        (a, "launcher.py:149", "[shutdown] API server: shutting down FastAPI HTTP server"),
    ]
    recs = [LogRecord(at_s, p, "INFO", s, m) for p, s, m in rows]
    recs += [LogRecord(at_s, a, "", "", "INFO:     Shutting down"),
             LogRecord(at_s, a, "", "", "INFO:     Waiting for application shutdown."),
             LogRecord(at_s, a, "", "", "INFO:     Application shutdown complete.")]
    return recs


def access_record(at_s: float, peer: str, method: str, path: str, status: int) -> LogRecord:
    """uvicorn's access-log line: ``INFO:     127.0.0.1:60002 - "GET /health HTTP/1.1" 200 OK``."""
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error",
              503: "Service Unavailable"}.get(status, "")
    return LogRecord(at_s, "APIServer", "", "", f'INFO:     {peer} - "{method} {path} HTTP/1.1" {status} {reason}'.rstrip())
