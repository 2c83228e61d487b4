"""Parse a ``vllm serve`` log into figures, and classify how the server ended. Pure: text in, data out.

Contract:

* :func:`parse_log` reads the startup figures vLLM prints (memory accounting, KV capacity, timings,
  the flags it resolved) from the logs of vLLM 0.11 to 0.33 (V1 engine), the early V1 engine of
  0.7-0.8 (``# GPU blocks: N`` alone) and the V0 engine of 0.5-0.8 ("Initializing an LLM engine
  (v0.6.4.post1)", "Initializing a V0 LLM engine (v0.7.3)"; "# GPU blocks: N, # CPU blocks: M",
  later "# CUDA blocks: N, ..." or "# cuda blocks: N, ..."; 0.6's "Memory profiling results: ..."),
  checked on real logs pasted in vLLM's issue threads (``tests/fixtures/vllm_issue_logs``).
  Every field is ``None`` when the log does not show it. Per-worker memory lines (TP/PP ranks,
  ``(Worker_TP0 pid=..)``) are kept in :attr:`ParsedLog.workers`; the top-level memory figures are
  those of the binding worker (the largest consumption, the smallest KV budget), which is what
  vLLM itself does when it takes the minimum block count over workers. The GPU block count is the one
  the log states, else derived from the logged KV tokens only where that is exact (one KV-cache group
  of full attention, :class:`ParsedLog`), else ``None``: a sliding-window, chunked-attention or Mamba
  hybrid's logged tokens span all its groups.
* :func:`classify` maps a log (plus the launcher's exit code, health and timeout facts) to a
  :class:`~servetune.result.TrialStatus`, the cause, and the few log lines that prove it.
  ``infrastructure=True`` marks failures caused by the machine, not the flags (another process
  holds GPU memory, the port is taken): the driver retries those elsewhere and does not feed them
  to the sampler.

The texts matched are vLLM's own (its worker's memory profiling, KV-cache sizing and engine-core
error messages), checked against the real 0.26.0 H200 logs in ``tests/fixtures/real_h200``. Numbers may print as
``12.5``, ``-0.52`` or ``2,216,528``; the line prefix ``(<proc> pid=<pid>)`` may be absent (0.11
API server, V0) or repeated on interleaved lines.

Example:
    >>> log = '''(EngineCore pid=7) INFO 11-30 01:22:41 [gpu_worker.py:560] Available KV cache memory: 67.64 GiB
    ... (EngineCore pid=7) INFO 11-30 01:22:41 [kv_cache_utils.py:2177] GPU KV cache size: 2,216,528 tokens
    ... (APIServer pid=5) INFO:     Application startup complete.'''
    >>> p = parse_log(log)
    >>> p.available_kv_gib, p.kv_cache_tokens, p.server_ready
    (67.64, 2216528, True)
    >>> classify(log, healthy=True).status.value
    'ok'
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

from servetune.result import TrialStatus
from servetune.vllm_version import version_tuple

__all__ = ["LOG_LINE_RE", "WorkerMemory", "ParsedLog", "Classification", "parse_log", "classify", "parse_number", "LogFigureError",
           "is_vllm_log"]

#: vLLM's log line (vllm-internals.md §1.5): optional ``(<proc> pid=<pid>) `` prefix, then the logger header.
LOG_LINE_RE = re.compile(
    r"^(?:\((?P<proc>\S+) pid=(?P<pid>\d+)\) )?(?P<lvl>[A-Z]+) (?P<ts>\d\d-\d\d \d\d:\d\d:\d\d) "
    r"\[(?P<src>[^\]]+)\] (?P<msg>.*)$")

_N = r"(-?\d[\d,]*(?:\.\d+)?)"  # 12.5, -0.52, 3, 2,216,528
# "(EngineCore_DP0 pid=7) ", "(Worker_TP1 pid=9) " (0.11+), and the worker names of the early V1 engine:
# "(VllmWorker rank=1 pid=12231) " (0.8-0.9), "(VllmWorker TP0 pid=19250) " (0.10).
_PREFIX_RE = re.compile(r"\((?P<proc>[A-Za-z][\w.:-]*(?: (?:rank=\d+|[TPD]P\d+))*) pid=(?P<pid>\d+)\) ")
# The logger header: "INFO 11-30 01:22:41 [file.py:560] " (V1), "INFO 10-15 12:00:05 file.py:237] " (V0 before
# the brackets), or uvicorn's "INFO:     ".
_HEADER_RE = re.compile(r"^(?:[A-Z]+ \d\d-\d\d \d\d:\d\d:\d\d (?:\[[^\]]+\]|[\w.]+:\d+\]) |[A-Z]+:\s+)")
#: The key of lines without a ``(proc pid=..)`` prefix (V0, the 0.11 API server, bare stderr).
MAIN_PROC = "main"
_EVIDENCE_CHARS = 300


def parse_number(text: str) -> float:
    """``"2,216,528"`` -> 2216528.0, ``"-0.52"`` -> -0.52.

    Example:
        >>> parse_number("1,234.5"), parse_number("-0.52")
        (1234.5, -0.52)
    """
    value = float(text.replace(",", ""))
    if not abs(value) <= _MAX_FIGURE:  # NaN fails too
        raise LogFigureError(f"a figure beyond 1e18 ({text[:40]}{'...' if len(text) > 40 else ''}, {len(text)} characters)")
    return value


class LogFigureError(ValueError):
    """A figure in a log no vLLM writes (hundreds of digits): the log was edited or is not a vLLM log."""


_MAX_FIGURE = 1e18


# ================================================================================= the data
@dataclasses.dataclass(frozen=True)
class WorkerMemory:
    """The memory and timing lines one worker process printed (GiB and seconds)."""

    weights_gib: float | None = None
    model_load_s: float | None = None
    weights_load_s: float | None = None
    available_kv_gib: float | None = None
    activation_peak_gib: float | None = None
    non_torch_gib: float | None = None
    cudagraph_gib: float | None = None
    cudagraph_estimate_gib: float | None = None
    graph_capture_s: float | None = None
    graph_capture_gib: float | None = None
    free_at_start_gib: float | None = None
    total_gib: float | None = None


@dataclasses.dataclass(frozen=True)
class ParsedLog:
    """What a vLLM server log shows; ``None`` where it does not show it. GiB, seconds, tokens.

    ``num_gpu_blocks`` is the count the log states (the user's override, V0's or the early V1 engine's
    block line, an appended ``/metrics`` dump, the API server's DEBUG ``num_gpu_blocks is:`` line); else,
    with ``num_gpu_blocks_derived``, the one count that gives the logged KV tokens and concurrency for one
    KV-cache group of full attention (:func:`_blocks_from_tokens`), where nothing in the log says the cache
    has more groups (:func:`_one_kv_group`): a sliding-window, chunked or Mamba hybrid's tokens span
    every group, so its count is ``None`` unless printed. ``block_size`` is the one the log names
    (cache info, a hybrid's raised block, ``--block-size``, the attention backend's line), else ``None``
    (vLLM's 16 on CUDA, which the derivation assumes).
    """

    vllm_version: str | None = None
    architecture: str | None = None  # "Resolved architecture: GptOssForCausalLM"
    non_default_args: dict[str, Any] | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    enforce_eager: bool | None = None
    kv_cache_dtype: str | None = None
    max_cudagraph_capture_size: int | None = None
    num_cudagraph_capture_sizes: int | None = None
    gpu_memory_utilization: float | None = None
    total_gpu_gib: float | None = None
    free_at_start_gib: float | None = None
    requested_gib: float | None = None  # util * total, the profiler's budget
    weights_gib: float | None = None
    weights_load_s: float | None = None
    model_load_s: float | None = None
    memory_profiling_s: float | None = None  # V0 (and V1 at DEBUG)
    activation_peak_gib: float | None = None
    non_torch_gib: float | None = None
    cudagraph_gib: float | None = None
    cudagraph_estimate_gib: float | None = None
    graph_capture_s: float | None = None
    graph_capture_gib: float | None = None
    available_kv_gib: float | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    max_concurrency_tokens: int | None = None  # the tokens-per-request max_concurrency refers to
    num_gpu_blocks: int | None = None
    num_gpu_blocks_derived: bool = False  # True: computed from the KV tokens, not printed
    computed_gpu_blocks: int | None = None  # what profiling gave before num_gpu_blocks_override
    num_gpu_blocks_override: int | None = None
    num_cpu_blocks: int | None = None  # V0
    block_size: int | None = None
    estimated_max_model_len: int | None = None  # from vLLM's kv_too_small error
    kv_needed_gib: float | None = None  # ditto: one max_model_len request
    torch_compile_s: float | None = None
    # True: every compiled graph came from vLLM's compile cache; False: at least one was compiled;
    # None: the log shows neither (enforce_eager, or a version that does not say).
    compile_cache_hit: bool | None = None
    engine_init_s: float | None = None
    engine_compile_s: float | None = None  # "(compilation: X s)" of the init line, 0.20+
    server_ready: bool = False
    stats_kv_usage_peak: float | None = None  # 0..1, the largest "GPU KV cache usage" of the stats lines
    stats_running_peak: int | None = None
    stats_waiting_peak: int | None = None
    stats_preemptions: int | None = None  # sum of "Preemptions: N" (0.13+) or V0's cumulative count
    workers: dict[str, WorkerMemory] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def timings_s(self) -> dict[str, float | None]:
        """The startup phases in seconds, named as ``diagnose --json``'s ``timings_s``; None where
        the log does not show one (weights load: the loader's line, else the model-loading line)."""
        return {"weights_load": self.weights_load_s if self.weights_load_s is not None else self.model_load_s,
                "torch_compile": self.torch_compile_s, "graph_capture": self.graph_capture_s,
                "engine_init": self.engine_init_s}


@dataclasses.dataclass(frozen=True)
class Classification:
    """How the server ended: the status, vLLM's cause, the lines proving it (``"LINE: text"``)."""

    status: TrialStatus
    cause: str | None
    evidence: list[str]
    infrastructure: bool = False  # the machine, not the flags: retry elsewhere, do not teach the sampler


# =============================================================================== line model
@dataclasses.dataclass(frozen=True)
class _Seg:
    """One segment of a physical line (tqdm's ``\\r`` splits a line into several)."""

    lineno: int  # 1-based physical line, as ``grep -n`` numbers it
    raw: str
    prefixes: tuple[tuple[int, str], ...]  # (end offset, proc) of each ``(proc pid=..)`` prefix

    def proc_at(self, pos: int) -> str:
        """The process that wrote the text at ``pos``: the nearest prefix before it."""
        proc = MAIN_PROC
        for end, name in self.prefixes:
            if end <= pos:
                proc = name
        return proc

    @property
    def proc(self) -> str:
        return self.prefixes[-1][1] if self.prefixes else MAIN_PROC

    @property
    def msg(self) -> str:
        """The text after the last prefix and the logger header, stripped."""
        start = max((end for end, _ in self.prefixes), default=0)
        rest = self.raw[start:]
        return _HEADER_RE.sub("", rest, count=1).strip()


def _proc_name(m: re.Match[str]) -> str:
    """The process a prefix names: V1 names each worker (``Worker_TP1``); V0's tensor-parallel workers
    all print ``(VllmWorkerProcess pid=N)``, so the pid tells them apart."""
    proc = m.group("proc")
    return f"{proc} pid={m.group('pid')}" if proc == "VllmWorkerProcess" else proc


def _segments(text: str) -> list[_Seg]:
    segs: list[_Seg] = []
    for i, line in enumerate(text.split("\n"), start=1):
        for part in line.split("\r"):
            # Blank lines, and "# ..." comment lines (annotated logs, Prometheus HELP/TYPE lines of an
            # appended /metrics dump); vLLM's own lines never start with "#".
            if not part.strip() or part.startswith("#"):
                continue
            prefixes = tuple((m.end(), _proc_name(m)) for m in _PREFIX_RE.finditer(part))
            segs.append(_Seg(i, part, prefixes))
    return segs


# ================================================================================= patterns
_VERSION_RES = (
    re.compile(r"Initializing an? (?:V[01] )?LLM engine \(v([^)\s]+)\)"),
    re.compile(r"vLLM (?:API )?server version ([^\s,]+)"),
    re.compile(r"[█▀▄]\s+version (\d+\.\d+[^\s]*)"),
)
_ARGS_RE = re.compile(r"non-default args: (\{.*\})\s*$")
_MAX_LEN_RE = re.compile(r"Using max model len (\d+)")
_MAX_SEQ_LEN_RE = re.compile(r"\bmax_seq_len=(\d+)")
_AUTO_FIT_RE = re.compile(r"Auto-fit max_model_len: reduced from \d+ to (\d+)")
_CHUNKED_RE = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)")
_TP_RE = re.compile(r"\btensor_parallel_size=(\d+)")
_PP_RE = re.compile(r"\bpipeline_parallel_size=(\d+)")
_EAGER_RE = re.compile(r"\benforce_eager=(True|False)")
_KV_DTYPE_RE = re.compile(r"\bkv_cache_dtype=([\w.]+)")
_MAX_CG_RE = re.compile(r"""['"]max_(?:cudagraph_)?capture_size['"]:\s*(\d+)""")  # dict repr (0.26) or JSON (0.11)
_CG_SIZES_RE = re.compile(r"""['"]cudagraph_capture_sizes['"]:\s*\[([^\]]*)\]""")
_LOAD_WEIGHTS_RE = re.compile(r"Loading weights took " + _N + r" seconds")
_MODEL_LOADING_RE = re.compile(r"Model loading took " + _N + r" ?GiB(?: memory)? and " + _N + r" seconds")
_V0_WEIGHTS_GB_RE = re.compile(r"Loading model weights took " + _N + r" ?GB")
_AVAILABLE_KV_RE = re.compile(r"Available KV cache memory: " + _N + r" ?GiB")
_KV_BYTES_RE = re.compile(r"reserved " + _N + r" ?GiB memory for KV Cache as specified by kv_cache_memory_bytes")
_KV_TOKENS_RE = re.compile(r"KV cache size: " + _N + r" tokens")
_CONCURRENCY_RE = re.compile(r"Maximum concurrency for " + _N + r" tokens per request: " + _N + r"x")
# The user's --num-gpu-blocks-override, or (0.19+, computed 0) the minimal KV cache vLLM itself sets
# up to profile CUDA-graph memory ("Overriding num_gpu_blocks=0 with num_gpu_blocks_override=512"
# right before "Profiling CUDA graph memory", dariustanrd/tokenkaki's 0.19.1 log): see parse_log.
_OVERRIDE_RE = re.compile(r"Overriding num_gpu_blocks=(\d+) with num_gpu_blocks_override=(\d+)")
# V0: "# GPU blocks: N, # CPU blocks: M" (<= 0.6), "# CUDA blocks: ..." / "# cuda blocks: ..." (0.7-0.8,
# the platform's name); early V1 (0.7-0.8): "# GPU blocks: N" alone.
_V0_BLOCKS_RE = re.compile(r"# (?!CPU )(\w+) blocks: (\d+), # CPU blocks: (\d+)")
_V1_EARLY_BLOCKS_RE = re.compile(r"# GPU blocks: (\d+)(?!\d|, # CPU)")
# V0 0.6.4-0.6.6 (worker.py): one line for the whole profile.
_V0_PROFILE_RE = re.compile(
    r"Memory profiling results: duration=" + _N + r" seconds, total_gpu_memory=" + _N + r" ?GiB, "
    r"initial_memory_usage=" + _N + r" ?GiB, peak_torch_memory=" + _N + r" ?GiB, memory_usage_post_profile="
    + _N + r" ?GiB, non_torch_memory=" + _N + r" ?GiB, kv_cache_size=" + _N + r" ?GiB, gpu_memory_utilization="
    + _N)
_CACHE_INFO_RE = re.compile(r"vllm:cache_config_info\{([^}]*)\}")
# The API server's DEBUG line once the engine has sized its cache (0.26: ``v1/metrics/loggers.py``):
# the block count itself, where a hybrid's logged tokens do not give it.
_CACHE_INFO_BLOCKS_RE = re.compile(r"cache_config_info with initialization after num_gpu_blocks is: (\d+)")
# A Mamba / linear-attention hybrid: vLLM raised the attention block to hold one recurrent state
# (``platforms/interface.py``); its logged tokens count every KV group's blocks per request.
_HYBRID_BLOCK_RE = re.compile(r"Setting attention block size to (\d+) tokens")
# The attention backend's own block size where it is not 16 (FlashMLA 64, CUTLASS MLA 128): "Forcing kv cache
# block size to 64 for FlashMLA backend." (platforms/cuda.py:167@0.11.0), "Setting kv cache block size to 64 for
# FLASHMLA backend." (platforms/interface.py:470@0.19.0, :636@0.26.0, :636@0.28.0).
_BACKEND_BLOCK_RE = re.compile(r"(?:Forcing|Setting) kv cache block size to (\d+)")
# The model class vLLM resolved (config/model.py:547@0.11.0, :549@0.19.0, :623@0.26.0, :672@0.28.0).
_ARCH_RE = re.compile(r"Resolved architecture: (\w+)")
# A hybrid's layers unified into one full-attention group, the hybrid KV-cache manager being off
# (``unify_hybrid_kv_cache_specs``: kv_cache_utils.py:1112@0.11.0, :1176@0.19.0, :1445@0.26.0, :1537@0.28.0).
_UNIFIED_RE = re.compile(r"Hybrid KV cache manager is disabled for this hybrid model")
# A layer with a sliding window (the attention selector's config in a DEBUG line, v1/attention/selector.py:53@0.26.0).
_SLIDING_RE = re.compile(r"has_sliding_window=True")
# Context parallelism multiplies the logged tokens (kv_cache_utils.py:1084@0.11.0, :1312@0.19.0, :1704@0.20.0).
_CP_TOKENS_RE = re.compile(r"Multiplying the GPU KV cache size by the d?cp_world_size")
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_ACTUAL_OLD_RE = re.compile(  # 0.11 .. 0.26 wording (INFO in 0.26, DEBUG before)
    r"Actual usage is " + _N + r" GiB for weight, " + _N + r" GiB for peak activation, " + _N
    + r" GiB for non-torch memory, and " + _N + r" GiB for CUDAGraph memory")
_ACTUAL_NEW_RE = re.compile(  # 0.28+ wording (v1/worker/gpu_worker.py:789@0.28.0)
    r"Actual usage is " + _N + r" GiB for consumed memory \(weights \+ non-torch\), " + _N
    + r" GiB for peak activation, and " + _N + r" GiB for CUDAGraph memory")
_FREE_START_RE = re.compile(
    r"Free memory on device(?: [^(]*?)? ?\(" + _N + r"/" + _N + r" GiB\) on startup.*?[Dd]esired GPU memory "
    r"utilization(?: is)? \(" + _N + r", " + _N + r" GiB\)")
_V0_TOTAL_RE = re.compile(r"total_gpu_memory \(" + _N + r" ?GiB\) x gpu_memory_utilization \(" + _N
                          + r"\) = " + _N + r" ?GiB")
_V0_BREAKDOWN_RE = re.compile(
    r"model weights take " + _N + r" ?GiB; non_torch_memory takes " + _N + r" ?GiB; PyTorch activation peak "
    r"memory takes " + _N + r" ?GiB; the rest of the memory reserved for KV Cache is " + _N + r" ?GiB")
_MEM_PROFILING_RE = re.compile(r"Memory profiling takes " + _N + r" seconds")
_DEBUG_PEAK_RE = re.compile(r"torch peak memory increase: " + _N + r" ?GiB")
_DEBUG_NON_TORCH_RE = re.compile(r"non-torch forward increase memory: " + _N + r" ?GiB")
_DEBUG_WEIGHTS_RE = re.compile(r"weights memory: " + _N + r" ?GiB")
_GRAPH_RE = re.compile(r"Graph capturing finished in " + _N + r" secs?, took " + _N + r" ?GiB")
_EST_CG_RE = re.compile(r"Estimated CUDA graph memory: " + _N + r" ?GiB total")
# "torch.compile takes 28.11 s in total" (0.11), "torch.compile took ..." (compilation/monitor.py:20@0.19.0); without
# AOT compilation (VLLM_USE_AOT_COMPILE=0, an eager backend) "torch.compile and initial profiling/warmup run together
# took ..." (compilation/decorators.py:607@0.19.0, :674@0.26.0, :674@0.28.0), the time vLLM counts as compilation.
_COMPILE_RE = re.compile(r"torch\.compile (?:and initial profiling/warmup run together )?(?:takes|took) " + _N
                         + r" s in total")
# vLLM's compile cache (VLLM_CACHE_ROOT/torch_compile_cache, keyed by the configuration): a warm
# start loads the graphs ("Directly load the compiled graph(s) ... from the cache, took 1.04 s"),
# a cold one compiles them ("Compiling a graph for compile range (1, 8192) takes 8.14 s", 0.20+;
# "Compiling a graph for dynamic shape takes ..." before).
_COMPILE_HIT_RE = re.compile(r"Directly load the compiled graph\(s\) for .*? from the cache, took " + _N + r" s")
_COMPILE_MISS_RE = re.compile(r"Compiling a graph for (?:compile range|dynamic shape|general shape).*? takes " + _N + r" s")
_INIT_RE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took " + _N
                      + r" (?:seconds|s)(?: \(compilation: " + _N + r" s)?")
_READY_RE = re.compile(r"Application startup complete\.")
_STATS_RE = re.compile(r"Avg prompt throughput: .*?Running: (\d+) reqs")
_STATS_WAITING_RE = re.compile(r"(?:Waiting|Pending): (\d+) reqs")
_STATS_PREEMPT_RE = re.compile(r"Preemptions: (\d+)")
_STATS_KV_RE = re.compile(r"GPU KV cache usage: " + _N + r"%")
_V0_PREEMPT_RE = re.compile(r"total_cumulative_preemption_cnt=(\d+)")
_KV_TOO_SMALL_V1_RE = re.compile(
    r"max seq len \((\d+)\), \(" + _N + r" ?GiB KV cache is needed, which is larger than the available KV cache "
    r"memory \(" + _N + r" ?GiB\)\. Based on the available memory, the estimated maximum model length is (\d+)")
_KV_TOO_SMALL_V0_RE = re.compile(
    r"The model's max seq len \((\d+)\) is larger than the maximum number of tokens that can be stored in KV "
    r"cache \((\d+)\)")


def _num(m: re.Match[str], group: int = 1) -> float:
    return parse_number(m.group(group))


def _int(m: re.Match[str], group: int = 1) -> int:
    return int(parse_number(m.group(group)))


def _literal_dict(text: str) -> dict[str, Any] | None:
    """The ``non-default args`` dict; None if it holds something ``ast.literal_eval`` refuses."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# ================================================================================== parsing
def parse_log(text: str) -> ParsedLog:
    """The figures a vLLM server log shows (see :class:`ParsedLog`).

    Example:
        >>> p = parse_log("INFO 05-01 10:00:00 [worker.py:1] # cuda blocks: 2048, # CPU blocks: 512")
        >>> p.num_gpu_blocks, p.num_cpu_blocks
        (2048, 512)
    """
    scan = _LogScan()
    for seg in _segments(text):
        scan.config(seg, seg.raw)
        scan.memory(seg, seg.raw)
        scan.startup(seg, seg.raw)
        scan.stats(seg, seg.raw)
    return _assemble(scan.f, scan.workers, scan.cache_info, scan.kv_peak, scan.running_peak, scan.waiting_peak,
                     scan.preempt_sum if scan.preempt_sum is not None else scan.v0_preempt)


class _LogScan:
    """What :func:`parse_log` has read so far: each line group's first (or peak) value per field.

    ``f`` holds the fields (``_``-prefixed ones are resolved in :func:`_assemble`), ``workers`` each
    worker process's memory lines; a field keeps its first value unless the rule says otherwise.
    """

    def __init__(self) -> None:
        self.f: dict[str, Any] = {}
        self.workers: dict[str, dict[str, float]] = {}
        self.kv_peak: float | None = None
        self.running_peak: int | None = None
        self.waiting_peak: int | None = None
        self.preempt_sum: int | None = None
        self.v0_preempt: int | None = None
        self.cache_info: dict[str, str] | None = None

    def first(self, key: str, value: Any) -> None:
        if self.f.get(key) is None:
            self.f[key] = value

    def lowest(self, key: str, value: Any) -> None:
        if self.f.get(key) is None or value < self.f[key]:
            self.f[key] = value

    def worker(self, seg: _Seg, m: re.Match[str], **values: float) -> None:
        slot = self.workers.setdefault(seg.proc_at(m.start()), {})
        for key, value in values.items():
            slot.setdefault(key, value)

    def config(self, seg: _Seg, raw: str) -> None:
        """The version, the non-default args and the engine's config line."""
        for i, rx in enumerate(_VERSION_RES):  # engine line > server line > banner, resolved in _assemble
            if self.f.get(f"_version{i}") is None and (m := rx.search(raw)):
                self.f[f"_version{i}"] = m.group(1)
        if (m := _ARGS_RE.search(raw)):
            self.first("non_default_args", _literal_dict(m.group(1)))
        if (m := _MAX_LEN_RE.search(raw)):
            self.first("_max_len_line", int(m.group(1)))
        if (m := _AUTO_FIT_RE.search(raw)):
            self.f["_auto_fit"] = int(m.group(1))
        if "LLM engine" in raw and "with config" in raw:
            if (m := _MAX_SEQ_LEN_RE.search(raw)):
                self.first("_max_seq_len", int(m.group(1)))
            if (m := _TP_RE.search(raw)):
                self.first("tensor_parallel_size", int(m.group(1)))
            if (m := _PP_RE.search(raw)):
                self.first("pipeline_parallel_size", int(m.group(1)))
            if (m := _EAGER_RE.search(raw)):
                self.first("enforce_eager", m.group(1) == "True")
            if (m := _KV_DTYPE_RE.search(raw)):
                self.first("kv_cache_dtype", m.group(1))
            if (m := _MAX_CG_RE.search(raw)):
                self.first("max_cudagraph_capture_size", int(m.group(1)))
            if (m := _CG_SIZES_RE.search(raw)):
                self.first("num_cudagraph_capture_sizes", len([s for s in m.group(1).split(",") if s.strip()]))
        if (m := _CHUNKED_RE.search(raw)):
            self.first("max_num_batched_tokens", int(m.group(1)))

    def memory(self, seg: _Seg, raw: str) -> None:
        """Weights, profiling and CUDA-graph memory, per worker."""
        if (m := _LOAD_WEIGHTS_RE.search(raw)):
            self.worker(seg, m, weights_load_s=_num(m))
        if (m := _MODEL_LOADING_RE.search(raw)):
            self.worker(seg, m, weights_gib=_num(m, 1), model_load_s=_num(m, 2))
        if (m := _V0_WEIGHTS_GB_RE.search(raw)):
            self.worker(seg, m, weights_gib=_num(m))
        if (m := _AVAILABLE_KV_RE.search(raw)):
            self.worker(seg, m, available_kv_gib=_num(m))
        if (m := _KV_BYTES_RE.search(raw)):
            self.worker(seg, m, available_kv_gib=_num(m))
        if (m := _ACTUAL_OLD_RE.search(raw)):
            self.worker(seg, m, weights_gib=_num(m, 1), activation_peak_gib=_num(m, 2), non_torch_gib=_num(m, 3),
                   cudagraph_gib=_num(m, 4))
        if (m := _ACTUAL_NEW_RE.search(raw)):
            self.worker(seg, m, _consumed_gib=_num(m, 1), activation_peak_gib=_num(m, 2), cudagraph_gib=_num(m, 3))
        if (m := _FREE_START_RE.search(raw)):
            self.worker(seg, m, free_at_start_gib=_num(m, 1), total_gib=_num(m, 2))
            self.first("gpu_memory_utilization", _num(m, 3))
            self.first("requested_gib", _num(m, 4))
        if (m := _V0_TOTAL_RE.search(raw)):
            self.worker(seg, m, total_gib=_num(m, 1))
            self.first("gpu_memory_utilization", _num(m, 2))
            self.first("requested_gib", _num(m, 3))
        if (m := _V0_BREAKDOWN_RE.search(raw)):
            self.worker(seg, m, weights_gib=_num(m, 1), non_torch_gib=_num(m, 2), activation_peak_gib=_num(m, 3),
                   available_kv_gib=_num(m, 4))
        if (m := _MEM_PROFILING_RE.search(raw)):
            self.first("memory_profiling_s", _num(m))
            if (d := _DEBUG_PEAK_RE.search(raw)):
                self.worker(seg, d, activation_peak_gib=_num(d))
            if (d := _DEBUG_NON_TORCH_RE.search(raw)):
                self.worker(seg, d, non_torch_gib=_num(d))
            if (d := _DEBUG_WEIGHTS_RE.search(raw)):
                self.worker(seg, d, weights_gib=_num(d))
        if (m := _GRAPH_RE.search(raw)):
            self.worker(seg, m, graph_capture_s=_num(m, 1), graph_capture_gib=_num(m, 2))
        if (m := _EST_CG_RE.search(raw)):
            self.worker(seg, m, cudagraph_estimate_gib=_num(m))

    def startup(self, seg: _Seg, raw: str) -> None:
        """Compile, engine init, KV capacity, overrides, failures and readiness."""
        if (m := _COMPILE_RE.search(raw)):
            self.first("torch_compile_s", _num(m))
        if _COMPILE_HIT_RE.search(raw):
            self.f["_compile_hit"] = True
        if _COMPILE_MISS_RE.search(raw):
            self.f["_compile_miss"] = True
        if (m := _INIT_RE.search(raw)):
            self.first("engine_init_s", _num(m, 1))
            if m.group(2) is not None:
                self.first("engine_compile_s", _num(m, 2))
        # 0.11.0 prints both lines for each worker before vLLM takes the smallest block count over them
        # (kv_cache_utils.py:1087-1092 inside get_kv_cache_config_from_groups, the minimum at :1286@0.11.0);
        # 0.11.1+ prints them once, after (:1229, :1338@0.11.1). The binding worker's are the smallest.
        if (m := _KV_TOKENS_RE.search(raw)):
            self.lowest("kv_cache_tokens", _int(m))
        if (m := _CONCURRENCY_RE.search(raw)):
            self.first("max_concurrency_tokens", _int(m, 1))
            self.lowest("max_concurrency", _num(m, 2))
        if (m := _OVERRIDE_RE.search(raw)):
            self.f.setdefault("_overrides", []).append((int(m.group(1)), int(m.group(2))))  # (computed, override)
        if (m := _V0_BLOCKS_RE.search(raw)):
            self.first("_v0_gpu_blocks", int(m.group(2)))
            self.first("num_cpu_blocks", int(m.group(3)))
        elif (m := _V1_EARLY_BLOCKS_RE.search(raw)):
            self.first("_v0_gpu_blocks", int(m.group(1)))
        if (m := _V0_PROFILE_RE.search(raw)):
            self.first("memory_profiling_s", _num(m, 1))
            self.worker(seg, m, total_gib=_num(m, 2), _peak_torch_gib=_num(m, 4), non_torch_gib=_num(m, 6),
                   available_kv_gib=_num(m, 7))
            self.first("gpu_memory_utilization", _num(m, 8))
            self.first("requested_gib", round(_num(m, 2) * _num(m, 8), 4))
        if (m := _CACHE_INFO_RE.search(raw)):
            self.cache_info = self.cache_info or dict(_LABEL_RE.findall(m.group(1)))
        if (m := _CACHE_INFO_BLOCKS_RE.search(raw)):
            self.first("_logged_gpu_blocks", int(m.group(1)))
        if (m := _HYBRID_BLOCK_RE.search(raw)):
            self.first("_hybrid_block_size", int(m.group(1)))
        if (m := _BACKEND_BLOCK_RE.search(raw)):
            self.first("_backend_block_size", int(m.group(1)))
        if (m := _ARCH_RE.search(raw)):
            self.first("architecture", m.group(1))
        if _UNIFIED_RE.search(raw):
            self.f["_unified"] = True
        if _SLIDING_RE.search(raw):
            self.f["_sliding"] = True
        if _CP_TOKENS_RE.search(raw):
            self.f["_cp_tokens"] = True
        if (m := _KV_TOO_SMALL_V1_RE.search(raw)):
            self.first("_err_max_len", int(m.group(1)))
            self.first("kv_needed_gib", _num(m, 2))
            self.worker(seg, m, available_kv_gib=_num(m, 3))
            self.first("estimated_max_model_len", int(m.group(4)))
        if (m := _KV_TOO_SMALL_V0_RE.search(raw)):
            self.first("_err_max_len", int(m.group(1)))
            self.first("_v0_kv_tokens", int(m.group(2)))
        if _READY_RE.search(raw):
            self.f["server_ready"] = True

    def stats(self, seg: _Seg, raw: str) -> None:
        """The periodic stats lines: peaks of running, waiting and KV usage; preemptions."""
        if (m := _STATS_RE.search(raw)):
            self.running_peak = max(self.running_peak or 0, int(m.group(1)))
            if (w := _STATS_WAITING_RE.search(raw)):
                self.waiting_peak = max(self.waiting_peak or 0, int(w.group(1)))
            if (k := _STATS_KV_RE.search(raw)):
                self.kv_peak = max(self.kv_peak or 0.0, _num(k) / 100.0)
            if (p := _STATS_PREEMPT_RE.search(raw)):
                self.preempt_sum = (self.preempt_sum or 0) + int(p.group(1))
        if (m := _V0_PREEMPT_RE.search(raw)):
            self.v0_preempt = max(self.v0_preempt or 0, int(m.group(1)))


def _from_args(f: dict[str, Any], args: Any) -> tuple[str | None, int | None, int | None, float | None]:
    """(version, max_model_len, max_num_batched_tokens, gpu_memory_utilization), each from its most
    trusted line, else from the non-default args."""
    version = f.get("_version0") or f.get("_version1") or f.get("_version2")
    max_len = f.get("_auto_fit") or f.get("_max_len_line") or f.get("_max_seq_len") or f.get("_err_max_len")
    if max_len is None and isinstance(args, dict) and isinstance(args.get("max_model_len"), int):
        max_len = args["max_model_len"]
    mbt = f.get("max_num_batched_tokens")
    if mbt is None and isinstance(args, dict) and isinstance(args.get("max_num_batched_tokens"), int):
        mbt = args["max_num_batched_tokens"]  # the chunked-prefill line is absent when the flag was given
    util = f.get("gpu_memory_utilization")
    if util is None and isinstance(args, dict) and isinstance(args.get("gpu_memory_utilization"), (int, float)):
        util = float(args["gpu_memory_utilization"])
    return version, max_len, mbt, util


def _freeze_workers(workers: dict[str, dict[str, float]]) -> dict[str, WorkerMemory]:
    """Each worker's memory lines as a :class:`WorkerMemory` (V0 0.6's and 0.29+'s sums split)."""
    # 0.29+ prints "consumed (weights + non-torch)"; split it with the weights of the same worker.
    frozen: dict[str, WorkerMemory] = {}
    for proc, vals in workers.items():
        peak_torch = vals.pop("_peak_torch_gib", None)  # V0 0.6: weights + activation peak
        if peak_torch is not None and "activation_peak_gib" not in vals and vals.get("weights_gib") is not None:
            vals["activation_peak_gib"] = round(peak_torch - vals["weights_gib"], 4)
        consumed = vals.pop("_consumed_gib", None)
        if consumed is not None and "non_torch_gib" not in vals and vals.get("weights_gib") is not None:
            vals["non_torch_gib"] = round(consumed - vals["weights_gib"], 4)
        frozen[proc] = WorkerMemory(**vals)
    return frozen


#: The model classes vLLM builds with more than one KV-cache group (hybrid KV-cache manager on, its default on
#: CUDA): sliding-window layers beside full ones (gpt_oss.py:157, gemma2.py:155, gemma3.py:154, commandr.py:188,
#: exaone4.py:169, olmo3.py:126 @0.26.0), chunked local attention beside full (llama4.py:253@0.26.0), and the
#: Mamba / linear-attention hybrids (``IsHybrid``); names from models/registry.py@0.28.0, Bamba from 0.23.0's.
#: Their logged tokens are not blocks x block size, so their block count is never derived from them.
SEVERAL_KV_GROUPS = frozenset({
    "GptOssForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
    "Gemma3nForCausalLM", "Gemma3nForConditionalGeneration", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
    "Cohere2ForCausalLM", "Cohere2MoeForCausalLM", "Exaone4ForCausalLM", "Olmo3ForCausalLM", "MiMoV2FlashForCausalLM",
    "MiMoV2ForCausalLM", "Step3p5ForCausalLM", "Llama4ForCausalLM", "Llama4ForConditionalGeneration",
    "BailingMoeV2_5ForCausalLM", "BambaForCausalLM", "FalconH1ForCausalLM", "GraniteMoeHybridForCausalLM",
    "JambaForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm2VlForConditionalGeneration",
    "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "OlmoHybridForCausalLM", "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration", "Zamba2ForCausalLM",
})
#: vLLM's block size on CUDA unless the user, the attention backend or a hybrid's alignment sets another
#: (config/cache.py:47@0.26.0, :48@0.28.0 ``DEFAULT_BLOCK_SIZE``; platforms/cuda.py:127@0.11.0).
DEFAULT_BLOCK_SIZE = 16
#: The first version that logs ``int(max_concurrency * max_model_len)`` tokens (``_report_kv_cache_config``,
#: kv_cache_utils.py:1699-1708@0.20.1); 0.20.0 and before log ``num_blocks // len(groups) * min_block_size``
#: (kv_cache_utils.py:1080@0.11.0, :1302-1306@0.19.0, :1694-1698@0.20.0).
TOKENS_FROM_CONCURRENCY = (0, 20, 1)


def _block_size(cache_info: dict[str, str] | None, args: Any, f: dict[str, Any]) -> int | None:
    """The attention block size: the metrics' cache info, a hybrid's raised block (it overrides the
    flag), the ``--block-size`` flag, the backend's own block line; None where the log shows none."""
    if cache_info and cache_info.get("block_size", "").isdigit():
        return int(cache_info["block_size"])
    if f.get("_hybrid_block_size") is not None:
        return int(f["_hybrid_block_size"])
    if isinstance(args, dict) and isinstance(args.get("block_size"), int):
        return int(args["block_size"])
    return f.get("_backend_block_size")


def _one_kv_group(f: dict[str, Any], args: Any) -> bool:
    """Whether nothing in the log says the KV cache has more than one group of full attention, or
    that its logged tokens are scaled: no hybrid's raised block, no sliding-window layer, no model
    class of :data:`SEVERAL_KV_GROUPS` (unless vLLM unified its layers into one group), no context
    parallelism."""
    if f.get("_hybrid_block_size") is not None or f.get("_cp_tokens"):
        return False
    if isinstance(args, dict) and any(isinstance(args.get(k), int) and args[k] > 1 for k in (
            "decode_context_parallel_size", "prefill_context_parallel_size")):
        return False
    if f.get("_unified"):
        return True
    return not f.get("_sliding") and f.get("architecture") not in SEVERAL_KV_GROUPS


def _kv_blocks(f: dict[str, Any], args: Any, cache_info: dict[str, str] | None, block_size: int | None,
               max_len: int | None, version: str | None) -> tuple[int | None, bool, int | None, int | None]:
    """(GPU blocks, whether derived from the token count, the override, KV tokens); sets the
    override's ``computed_gpu_blocks`` / ``num_gpu_blocks_override`` in ``f``."""
    # An override line is the user's where the start asked for one: not where the non-default args
    # are known and do not name it, and not a computed 0 (the CUDA-graph profiler's minimal cache)
    # while a line with a computed count is there or the args do not name the flag.
    overrides = f.get("_overrides", [])
    asked = isinstance(args, dict) and "num_gpu_blocks_override" in args
    users = [o for o in overrides if o[0] != 0] or (overrides if asked else [])
    if isinstance(args, dict) and not asked:
        users = []
    if users:
        f["computed_gpu_blocks"], f["num_gpu_blocks_override"] = users[0]
    kv_tokens = f.get("kv_cache_tokens")
    override = f.get("num_gpu_blocks_override")
    if override is None and isinstance(args, dict) and isinstance(args.get("num_gpu_blocks_override"), int):
        override = args["num_gpu_blocks_override"]
    blocks, derived = None, False
    if override is not None:  # vLLM takes the user's count as it is (may_override_num_blocks)
        blocks = override
    elif f.get("_v0_gpu_blocks") is not None:
        blocks = f["_v0_gpu_blocks"]
    elif cache_info and cache_info.get("num_gpu_blocks", "").isdigit():
        blocks = int(cache_info["num_gpu_blocks"])
    elif f.get("_logged_gpu_blocks") is not None:
        blocks = f["_logged_gpu_blocks"]
    elif kv_tokens is not None and _one_kv_group(f, args):
        blocks = _blocks_from_tokens(kv_tokens, block_size or DEFAULT_BLOCK_SIZE,
                                     f.get("max_concurrency_tokens") or max_len, f.get("max_concurrency"), version)
        derived = blocks is not None
    if kv_tokens is None and f.get("_v0_kv_tokens") is not None:
        kv_tokens = f["_v0_kv_tokens"]
    return blocks, derived, override, kv_tokens


def _assemble(f: dict[str, Any], workers: dict[str, dict[str, float]], cache_info: dict[str, str] | None,
              kv_peak: float | None, running_peak: int | None, waiting_peak: int | None,
              preemptions: int | None) -> ParsedLog:
    """Resolve the sources of each field in order of trust and build the frozen result."""
    args = f.get("non_default_args")
    version, max_len, mbt, util = _from_args(f, args)
    frozen = _freeze_workers(workers)

    def agg(key: str, pick: Callable[[Sequence[float]], float]) -> float | None:
        vals = [getattr(w, key) for w in frozen.values() if getattr(w, key) is not None]
        return pick(vals) if vals else None

    cudagraph = agg("cudagraph_gib", max)
    capture_gib = agg("graph_capture_gib", max)
    block_size = _block_size(cache_info, args, f)
    blocks, derived, override, kv_tokens = _kv_blocks(f, args, cache_info, block_size, max_len, version)

    return ParsedLog(
        vllm_version=version,
        architecture=f.get("architecture"),
        non_default_args=args,
        max_model_len=max_len,
        max_num_batched_tokens=mbt,
        tensor_parallel_size=f.get("tensor_parallel_size"),
        pipeline_parallel_size=f.get("pipeline_parallel_size"),
        enforce_eager=f.get("enforce_eager"),
        kv_cache_dtype=f.get("kv_cache_dtype"),
        max_cudagraph_capture_size=f.get("max_cudagraph_capture_size"),
        num_cudagraph_capture_sizes=f.get("num_cudagraph_capture_sizes"),
        gpu_memory_utilization=util,
        total_gpu_gib=agg("total_gib", max),
        free_at_start_gib=agg("free_at_start_gib", min),
        requested_gib=f.get("requested_gib"),
        weights_gib=agg("weights_gib", max),
        weights_load_s=agg("weights_load_s", max),
        model_load_s=agg("model_load_s", max),
        memory_profiling_s=f.get("memory_profiling_s"),
        activation_peak_gib=agg("activation_peak_gib", max),
        non_torch_gib=agg("non_torch_gib", max),
        cudagraph_gib=cudagraph if cudagraph is not None else capture_gib,
        cudagraph_estimate_gib=agg("cudagraph_estimate_gib", max),
        graph_capture_s=agg("graph_capture_s", max),
        graph_capture_gib=capture_gib,
        available_kv_gib=agg("available_kv_gib", min),
        kv_cache_tokens=kv_tokens,
        max_concurrency=f.get("max_concurrency"),
        max_concurrency_tokens=f.get("max_concurrency_tokens"),
        num_gpu_blocks=blocks,
        num_gpu_blocks_derived=derived,
        computed_gpu_blocks=f.get("computed_gpu_blocks"),
        num_gpu_blocks_override=override,
        num_cpu_blocks=f.get("num_cpu_blocks"),
        block_size=block_size,
        # V0 says how many tokens the KV cache holds: the longest sequence that fits.
        estimated_max_model_len=f.get("estimated_max_model_len") or f.get("_v0_kv_tokens"),
        kv_needed_gib=f.get("kv_needed_gib"),
        torch_compile_s=f.get("torch_compile_s"),
        compile_cache_hit=(False if f.get("_compile_miss") else True if f.get("_compile_hit") else None),
        engine_init_s=f.get("engine_init_s"),
        engine_compile_s=f.get("engine_compile_s"),
        server_ready=bool(f.get("server_ready")),
        stats_kv_usage_peak=kv_peak,
        stats_running_peak=running_peak,
        stats_waiting_peak=waiting_peak,
        stats_preemptions=preemptions,
        workers=frozen,
    )


def _blocks_from_tokens(tokens: int, block_size: int, max_len: int | None, concurrency: float | None,
                       version: str | None) -> int | None:
    """The block count behind vLLM's logged KV tokens, for one KV-cache group of full attention;
    None where no count gives both logged figures.

    A version before :data:`TOKENS_FROM_CONCURRENCY` logs ``blocks * block_size``; from it,
    ``int(blocks / cdiv(max_len, block_size) * max_len)``, inverted here with vLLM's own float
    arithmetic. Both print the concurrency ``blocks / cdiv(max_len, block_size)`` with ``%.2f``, and a
    count must give it too: a sliding-window or chunked group beside a full one (before 0.20.1,
    ``tokens = blocks // groups * block``) rarely does. An unknown version takes the count both
    formulas agree on.

    Example:
        >>> _blocks_from_tokens(2216528, 16, 8192, 270.57, "0.26.0"), _blocks_from_tokens(373904, 16, 16384, 22.82, "0.11.0")
        (138533, 23369)
        >>> _blocks_from_tokens(2591776, 16, 8192, 316.07, "0.19.0") is None  # gpt-oss: 2 groups of 323,972
        True
    """
    v = version_tuple(version)
    per_request = -(-max_len // block_size) if max_len else None
    found: set[int] = set()
    if (v is None or v < TOKENS_FROM_CONCURRENCY) and tokens % block_size == 0:
        found.add(tokens // block_size)
    if (v is None or v >= TOKENS_FROM_CONCURRENCY) and max_len and per_request:
        first = -(-tokens * per_request // max_len)
        found.update(b for b in (first - 1, first, first + 1) if b >= 0 and int(b / per_request * max_len) == tokens)
    if concurrency is not None and per_request:
        found = {b for b in found if f"{b / per_request:.2f}" == f"{concurrency:.2f}"}
    return found.pop() if len(found) == 1 else None


# ============================================================================ classification
_WRAPPER_RE = re.compile(r"Engine core initialization failed|EngineDeadError|WorkerProc initialization failed|"
                         r"^SystemExit\b|^KeyboardInterrupt\b")
_EXC_RE = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception|Exit|Interrupt)|AssertionError))"
                     r"(?:: (?P<text>.*))?$")
_DEATH_RE = re.compile(r"Engine core initialization failed|EngineCore failed to start|WorkerProc failed to start|"
                       r"EngineCore encountered a fatal error|EngineDeadError|died unexpectedly|"
                       r"Traceback \(most recent call last\)")
_SHUTDOWN_RE = re.compile(r"\[shutdown\]|^Shutting down$")
_SIGNAL_RE = re.compile(r"received signal=SIG|Received signal|Interrupted by signal")
_CUDA_OOM_RE = re.compile(r"CUDA out of memory|OutOfMemoryError")
_ARGPARSE_RE = re.compile(r"(?:^|: )error: (?:unrecognized arguments|argument |the following arguments are required"
                          r"|ambiguous option)")
_HINT_CUT_RE = re.compile(r" (?:Try increasing|Try lowering|Decrease GPU memory|Please try|See https|To allow "
                          r"overriding|If reserved but unallocated)")

# Stages of startup, in order; the OOM's stage decides startup_oom vs cudagraph_oom vs runtime_oom.
_STAGES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("load", re.compile(r"Starting to load model|Loading model from scratch|Loading safetensors|Loading weights")),
    ("profile", re.compile(r"Model loading took|Loading model weights took|Memory profiling|Dynamo bytecode")),
    ("kv", re.compile(r"Available KV cache memory|KV cache size:|# (?!CPU )\w+ blocks: \d")),
    ("capture", re.compile(r"Capturing CUDA graphs|Capturing cudagraphs|Capturing the model for CUDA graphs")),
    ("warmup", re.compile(r"Graph capturing finished")),
    ("ready", _READY_RE),
)
_STAGE_WORDS = {"start": "before loading the model", "load": "while loading the weights",
                "profile": "during the memory profiling run", "kv": "while allocating the KV cache",
                "capture": "during CUDA graph capture", "warmup": "during the warm-up after graph capture",
                "ready": "while serving"}
_CAPTURE_FRAME_RE = re.compile(r"in (?:capture_model|_capture_cudagraphs|capture)\b|cudagraph", re.I)
_LOAD_FRAME_RE = re.compile(r"in (?:load_model|load_weights)\b")
_V0_METHOD_RE = re.compile(r"Exception in worker \w+ while processing method (\w+)")
_PROFILE_FRAME_RE = re.compile(r"in (?:profile_run|determine_available_memory|determine_num_available_blocks)\b")

_Rule = tuple[re.Pattern[str], TrialStatus, bool, str]
#: (pattern, status, infrastructure, cause prefix), in priority order; an OOM rule handled apart.
_INVALID_RULES: tuple[_Rule, ...] = tuple((re.compile(p), TrialStatus.INVALID_CONFIG, False, "") for p in (
    r"must be divisible by tensor parallel size",
    r"must be greater than or equal to max_num_seqs",
    r"User-specified max_model_len .* is greater than the derived max_model_len",
    r"is smaller than max_model_len \(",
    r"\d+ validation errors? for \w+",
    r"GPU memory utilization must be less than 1\.0",
    r"Invalid kv_cache_dtype",
    r"should be consistent with the max value of cudagraph_capture_sizes",
    r"is larger than the number of available GPUs",
    r"Pipeline parallelism is not supported for this model",
    r"Config file must be of a yaml/yml type",
    r"^AssertionError: \d+ is not divisible by \d+",
))
_STARTUP_RULES: tuple[_Rule, ...] = (
    (re.compile(r"Free memory on device.*is less than desired GPU memory utilization"), TrialStatus.STARTUP_OOM, True,
     "infrastructure failure: another process holds GPU memory: "),
    (re.compile(r"Error in memory profiling\. Initial free memory"), TrialStatus.CRASHED, True,
     "infrastructure failure: another process changed GPU memory during profiling: "),
    (re.compile(r"To serve at least one request with the models?'s max seq len"), TrialStatus.KV_TOO_SMALL, False, ""),
    (_KV_TOO_SMALL_V0_RE, TrialStatus.KV_TOO_SMALL, False, ""),
    (re.compile(r"No available memory for the cache blocks"), TrialStatus.STARTUP_OOM, False, ""),
    # vLLM 0.26 (config/compilation.py): a Mamba hybrid's FULL decode graphs need a Mamba block per sequence
    (re.compile(r"max_num_seqs \(\d+\) exceeds available Mamba cache blocks"), TrialStatus.KV_TOO_SMALL, False, ""),
    # V0 prints the block counts, then raises "No available memory for the cache blocks" on 0 GPU
    # blocks (a paste often stops in between): 0 blocks is that failure already.
    (re.compile(r"# (?!CPU )\w+ blocks: 0(?:, # CPU blocks: \d+)?$"), TrialStatus.STARTUP_OOM, False,
     "no memory left for the KV cache blocks: "),
    (re.compile(r"Cannot auto-fit max_model_len: not enough GPU memory"), TrialStatus.STARTUP_OOM, False, ""),
    (re.compile(r"CUDA out of memory occurred when warming up (?:sampler|pooler)"), TrialStatus.CUDAGRAPH_OOM, False,
     ""),
)
_INFRA_RULES: tuple[_Rule, ...] = (
    (re.compile(r"Address already in use"), TrialStatus.CRASHED, True, "infrastructure failure: port in use: "),
    (re.compile(r"No CUDA GPUs are available|CUDA-capable device\(s\) is/are busy or unavailable|"
                r"CUDA driver initialization failed"), TrialStatus.CRASHED, True, "infrastructure failure: no usable GPU: "),
)


def _trim(text: str, limit: int = _EVIDENCE_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _evidence_line(seg: _Seg) -> str:
    return f"{seg.lineno}: {_trim(seg.msg)}"


def _cause_text(msg: str, prefix: str = "", keep_type: bool = False) -> str:
    """vLLM's message without the exception type (unless asked) and without its generic fix hints."""
    m = _EXC_RE.match(msg)
    if m and m.group("text") and not keep_type:
        msg = m.group("text")
    cut = _HINT_CUT_RE.search(msg)
    if cut and cut.start() > 20:
        msg = msg[: cut.start()]
    return _trim(prefix + msg.strip(), 400)


def _traceback_frames(segs: Sequence[_Seg], idx: int, proc: str, limit: int = 2) -> list[_Seg]:
    """The last ``limit`` ``File ...`` frames of the traceback that ends at ``segs[idx]`` (same process)."""
    frames: list[_Seg] = []
    for j in range(idx - 1, max(-1, idx - 400), -1):
        s = segs[j]
        if s.proc != proc:
            continue
        if s.msg.startswith("Traceback (most recent call last)"):
            break
        if s.msg.startswith('File "'):
            frames.append(s)
    frames.reverse()
    return frames[-limit:] if limit else frames


def _stage_before(segs: Sequence[_Seg], idx: int) -> str:
    """The furthest startup stage the log reached before ``segs[idx]``."""
    reached = -1
    for s in segs[:idx]:
        for k, (_, rx) in enumerate(_STAGES):
            if k > reached and rx.search(s.raw):
                reached = k
    return _STAGES[reached][0] if reached >= 0 else "start"


def _figure_lines(segs: Sequence[_Seg], end: int) -> list[str]:
    """Context figures for a memory failure: the KV budget line, if printed before the error."""
    for s in segs[:end]:
        if _AVAILABLE_KV_RE.search(s.raw) or _V0_BREAKDOWN_RE.search(s.raw):  # V1 / V0 KV budget
            return [_evidence_line(s)]
    return []


def _with_frames(segs: Sequence[_Seg], idx: int) -> list[str]:
    seg = segs[idx]
    return [_evidence_line(s) for s in _traceback_frames(segs, idx, seg.proc)] + [_evidence_line(seg)]


def classify(text: str, exit_code: int | None = None, healthy: bool = False,
             timed_out: bool = False) -> Classification:
    """How the server ended, from its log and what the launcher saw.

    Errors printed after our own shutdown (SIGTERM, ``[shutdown]`` lines) do not count. A fatal
    error in the log wins over ``timed_out`` (it is the reason the server never became healthy).

    Example:
        >>> log = "(EngineCore pid=9) ERROR 11-30 01:33:51 [core.py:1330] ValueError: No available memory for the cache blocks."
        >>> c = classify(log, exit_code=1)
        >>> c.status.value, c.cause, c.infrastructure
        ('startup_oom', 'No available memory for the cache blocks.', False)
    """
    segs = _segments(text)
    # Our own stop (SIGTERM at the end of a trial or on timeout) makes the engine print errors that
    # are not the trial's fault (b1_eager_s64 ends in an EngineDeadError after "[shutdown]").
    ready_at = next((i for i, s in enumerate(segs) if _READY_RE.search(s.raw)), None)
    end = len(segs)
    for i, s in enumerate(segs):
        if _SIGNAL_RE.search(s.raw) or (ready_at is not None and i > ready_at and _SHUTDOWN_RE.search(s.msg)):
            end = i
            break
    live = segs[:end]
    ready_idx = next((i for i, s in enumerate(live) if _READY_RE.search(s.raw)), None)

    # 1. argparse: the CLI refused a flag before anything started (exit code 2).
    for i, s in enumerate(live):
        if _ARGPARSE_RE.search(s.msg):
            ev = [_evidence_line(x) for x in live[max(0, i - 1):i] if x.msg.startswith("usage:")]
            return Classification(TrialStatus.INVALID_CONFIG, _trim(s.msg, 400), ev + [_evidence_line(s)])

    # 2. vLLM's own fit / configuration errors, most specific first.
    for rules in (_STARTUP_RULES, _INVALID_RULES):
        for rx, status, infra, prefix in rules:
            for i, s in enumerate(live):
                if rx.search(s.msg):
                    ev = _with_frames(live, i)
                    if status in (TrialStatus.STARTUP_OOM, TrialStatus.KV_TOO_SMALL):
                        ev = _figure_lines(live, i) + ev
                    if "validation error" in s.msg:  # pydantic: the field and the reason follow
                        ev += [_evidence_line(x) for x in live[i + 1:i + 3]]
                    return Classification(status, _cause_text(s.msg, prefix), _dedupe(ev), infra)

    # 3. CUDA OOM: the stage it happened in decides the status.
    for i, s in enumerate(live):
        if _CUDA_OOM_RE.search(s.msg):
            return _classify_oom(live, i, ready_idx)
    for rx, status, infra, prefix in _INFRA_RULES:
        for i, s in enumerate(live):
            if rx.search(s.msg):
                return Classification(status, _cause_text(s.msg, prefix, keep_type=True), _with_frames(live, i), infra)

    # 4. Any other engine death: the root exception above the wrapper.
    died = any(_DEATH_RE.search(s.raw) for s in live)
    ready = healthy or ready_idx is not None
    if died and (not ready or any(_DEATH_RE.search(s.raw) for s in live[(ready_idx or 0):])):
        return _classify_crash(live, exit_code)
    if timed_out:
        return _classify_timeout(live, ready)
    if ready and (exit_code in (None, 0) or end < len(segs)):
        ev = [_evidence_line(live[ready_idx])] if ready_idx is not None else []
        return Classification(TrialStatus.OK, None, ev)
    if exit_code is not None and exit_code != 0:
        return _classify_crash(live, exit_code)
    tail = [_evidence_line(s) for s in live[-3:]]
    stage = _STAGE_WORDS.get(_stage_before(live, len(live)), "")
    if exit_code is None:  # a log alone: nothing says the process died
        return Classification(TrialStatus.INCOMPLETE, f"the log ends {stage}, before the server was ready, and "
                              "shows no error: it was cut short, the server is still starting, or it was killed "
                              "without a trace", tail)
    return Classification(TrialStatus.CRASHED, f"the server exited with code 0 {stage}, before it was ready, and "
                          "the log shows no error", tail)


#: A vLLM logger header anywhere on a line ("INFO 11-30 01:22:41 [gpu_worker.py:560] ", V0's
#: "INFO 10-15 12:00:05 worker.py:237] "), behind any prefix a paste or a log shipper adds.
_VLLM_HEADER_RE = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d "
                             r"(?:\[[\w./<>-]+\.py:\d+\]|[\w./<>-]+\.py:\d+\]) ")
_VLLM_OTHER_RE = re.compile(r"^usage: vllm |vllm(?: serve)?: error: |File \"[^\"]*/vllm/[^\"]+\.py\"")


def is_vllm_log(text: str) -> bool:
    """Whether ``text`` holds at least one line vLLM wrote: its logger header, its CLI's usage or
    error line, or a traceback frame inside the vllm package. A README, a YAML file or an empty
    file is not a vLLM log.

    Example:
        >>> is_vllm_log("INFO 05-01 10:00:00 [core.py:58] Initializing a V1 LLM engine (v0.8.5)")
        True
        >>> is_vllm_log("# servetune\\n\\nFinds the vLLM flags with the highest throughput.")
        False
    """
    return any(_VLLM_HEADER_RE.search(line) or _VLLM_OTHER_RE.search(line) for line in text.splitlines())


def _dedupe(lines: list[str]) -> list[str]:
    return list(dict.fromkeys(lines))  # the first of each, in order


def _classify_oom(segs: Sequence[_Seg], idx: int, ready_idx: int | None) -> Classification:
    seg = segs[idx]
    # The exception line itself (the torch error may be logged once as ERROR text, then raised).
    exc_idx = idx
    for j in range(idx, min(len(segs), idx + 40)):
        if _EXC_RE.match(segs[j].msg) and _CUDA_OOM_RE.search(segs[j].msg):
            exc_idx = j
            break
    frames = _traceback_frames(segs, exc_idx, segs[exc_idx].proc, limit=0)
    frame_text = " ".join(f.msg for f in frames)
    # V0's multiproc workers name the method they were running ("Exception in worker VllmWorkerProcess
    # while processing method load_model."), often on another worker's lines than the OOM's.
    methods = [s for s in segs[max(0, idx - 40):idx + 40] if _V0_METHOD_RE.search(s.msg)]
    frame_text += "".join(f" in {_V0_METHOD_RE.search(s.msg).group(1)}" for s in methods)  # type: ignore[union-attr]
    stage = "ready" if ready_idx is not None and idx > ready_idx else _stage_before(segs, idx)
    if stage == "ready":
        status = TrialStatus.RUNTIME_OOM
    elif _CAPTURE_FRAME_RE.search(frame_text) or stage in ("capture", "warmup"):
        status, stage = TrialStatus.CUDAGRAPH_OOM, ("warmup" if stage == "warmup" else "capture")
    elif _LOAD_FRAME_RE.search(frame_text) and not _PROFILE_FRAME_RE.search(frame_text):
        status, stage = TrialStatus.STARTUP_OOM, "load"
    elif _PROFILE_FRAME_RE.search(frame_text):
        status, stage = TrialStatus.STARTUP_OOM, "profile"
    else:
        status = TrialStatus.STARTUP_OOM
    if "Failed to load model - not enough GPU memory" in seg.msg:
        status, stage = TrialStatus.STARTUP_OOM, "load"
    msg = segs[exc_idx].msg
    text = _EXC_RE.match(msg)
    body = text.group("text") if text and text.group("text") else msg
    short = body.split(" Including non-PyTorch memory")[0].split(" (original error")[0]
    cause = _trim(f"CUDA out of memory {_STAGE_WORDS.get(stage, '')}: {short}".replace("  ", " "), 400)
    ev = [_evidence_line(s) for s in frames[-2:]] + [_evidence_line(segs[exc_idx])]
    if exc_idx != idx:
        ev.insert(0, _evidence_line(seg))
    ev += [_evidence_line(s) for s in methods[:1]]
    if status is TrialStatus.CUDAGRAPH_OOM:  # how far the capture got
        capturing = [s for s in segs[:idx] if _STAGES[3][1].search(s.raw)]
        if capturing:
            ev.insert(0, _evidence_line(capturing[-1]))
    return Classification(status, cause, _dedupe(ev))


def _classify_crash(segs: Sequence[_Seg], exit_code: int | None) -> Classification:
    root_idx = wrapper_idx = None
    for i, s in enumerate(segs):
        if _EXC_RE.match(s.msg):
            if _WRAPPER_RE.search(s.msg):
                wrapper_idx = wrapper_idx if wrapper_idx is not None else i
            elif root_idx is None:
                root_idx = i
    idx = root_idx if root_idx is not None else wrapper_idx
    if idx is not None:
        ev = _with_frames(segs, idx)
        if wrapper_idx is not None and wrapper_idx != idx:
            ev.append(_evidence_line(segs[wrapper_idx]))
        return Classification(TrialStatus.CRASHED, _cause_text(segs[idx].msg, keep_type=True), ev)
    ev = [_evidence_line(s) for s in segs if _DEATH_RE.search(s.raw)][:3] or [_evidence_line(s) for s in segs[-3:]]
    started = next((s for s in segs if "Traceback (most recent call last)" in s.raw), None)
    if exit_code in (-9, 137):
        cause = "killed by SIGKILL (exit code %d): the host's out-of-memory killer, or an external kill" % exit_code
    elif exit_code is not None:
        cause = f"the server exited with code {exit_code} and printed no exception"
    elif started is not None and not any(_EXC_RE.match(s.msg) for s in segs[segs.index(started):]):
        cause = (f"a traceback starts at line {started.lineno} but the log ends before its exception line "
                 "(the log is cut short)")
    else:
        cause = "the engine died and printed no exception"
    return Classification(TrialStatus.CRASHED, cause, ev)


def _classify_timeout(segs: Sequence[_Seg], ready: bool) -> Classification:
    tail = [s for s in segs if LOG_LINE_RE.match(s.raw) or s.msg.startswith(("INFO", "Capturing"))][-2:] or segs[-2:]
    if ready:
        cause = "stalled: the server was healthy, but the run did not finish in time"
    else:
        stage = _stage_before(segs, len(segs))
        cause = f"no /health 200 within the startup timeout; the log stops {_STAGE_WORDS.get(stage, stage)}"
    return Classification(TrialStatus.TIMEOUT, cause, [_evidence_line(s) for s in tail])
