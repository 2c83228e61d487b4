"""The result of one trial, the same type for the simulated and the real engine.

A :class:`TrialResult` is what every engine returns and what the study driver, MLflow tracking
and the Parquet dataset consume. Its ``status`` says how the trial ended; the figures that the
trial could not produce (a server that never started has no throughput) are ``None``.

Example:
    >>> from servetune.result import TrialResult, TrialStatus
    >>> r = TrialResult(status=TrialStatus.STARTUP_OOM, cause="No available memory for the cache blocks")
    >>> r.ok, r.preemptions
    (False, None)
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

from servetune.backends import capabilities

__all__ = ["TrialStatus", "MemoryBreakdown", "LatencySummary", "RequestRecord", "TrialResult", "summarize",
           "API_SERVER_SATURATED", "api_server_note", "SLO_METRICS"]

#: Figures a study derives from a result against its latency targets and GPU price
#: (:func:`servetune.cost.slo_figures`): output tokens/s of the requests that met every target, their
#: share of the requests, and dollars per million of those tokens. Kept in :attr:`TrialResult.slo`.
SLO_METRICS = ("goodput_output_throughput", "good_request_share", "cost_per_mtok")


class TrialStatus(str, enum.Enum):
    """How a trial ended. The words are a contract (MLflow tags, Parquet, ``diagnose --json``)."""

    OK = "ok"
    STARTUP_OOM = "startup_oom"  # weights do not fit, or no memory left for KV cache blocks
    KV_TOO_SMALL = "kv_too_small"  # one max_model_len sequence does not fit the KV cache
    CUDAGRAPH_OOM = "cudagraph_oom"
    RUNTIME_OOM = "runtime_oom"
    CRASHED = "crashed"
    TIMEOUT = "timeout"
    INVALID_CONFIG = "invalid_config"
    PRUNED = "pruned"  # skipped before launch because the planner predicted a startup failure
    # The machine, not the flags: a port taken, GPU memory held by another process, a lost Ray
    # node. Retried on another slot; never told to the sampler as infeasible (see servetune.engines.vllm.infra).
    INFRA_ERROR = "infra_error"
    # A log that stops with no error before the server was ready and nothing else is known (no exit
    # code, no timeout): cut short, still starting, or killed without a trace. ``servetune diagnose``
    # of a log alone; a trial always knows how its server ended, so never gets it.
    INCOMPLETE = "incomplete"

    @property
    def is_startup_failure(self) -> bool:
        return self in (TrialStatus.STARTUP_OOM, TrialStatus.KV_TOO_SMALL, TrialStatus.CUDAGRAPH_OOM)

    @property
    def is_infrastructure(self) -> bool:
        return self is TrialStatus.INFRA_ERROR


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU startup memory in GiB, as vLLM accounts it (see docs/architecture.md)."""

    total: float
    budget: float
    weights: float
    activation_peak: float
    non_torch: float
    cudagraph: float
    kv_cache: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class LatencySummary:
    """Mean and percentiles of one latency figure, in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> LatencySummary | None:
        vals = sorted(v for v in values_ms if not math.isnan(v))
        if not vals:
            return None
        return cls(
            mean=sum(vals) / len(vals),
            p50=_percentile(vals, 50),
            p90=_percentile(vals, 90),
            p99=_percentile(vals, 99),
        )

    @classmethod
    def of_counts(cls, values_ms: Sequence[float], counts: Sequence[int]) -> LatencySummary | None:
        """The summary of a multiset given as values and how often each occurs: the same
        percentiles as :meth:`of` over the values repeated (the mean to rounding), without the
        repeated list.

        Example:
            >>> LatencySummary.of_counts([2.0, 1.0], [1, 3]) == LatencySummary.of([1.0, 1.0, 1.0, 2.0])
            True
        """
        import numpy as np

        vals = np.asarray(values_ms, dtype=float)
        reps = np.asarray(counts, dtype=np.int64)
        keep = (reps > 0) & ~np.isnan(vals)
        vals, reps = vals[keep], reps[keep]
        if not len(vals):
            return None
        order = np.argsort(vals, kind="stable")
        vals, reps = vals[order], reps[order]
        ends = np.cumsum(reps)  # the rank after each value's last copy
        n = int(ends[-1])

        def at(rank: int) -> float:
            return float(vals[int(np.searchsorted(ends, rank, side="right"))])

        def pct(q: float) -> float:
            if n == 1:
                return at(0)
            pos = (n - 1) * q / 100.0
            lo = math.floor(pos)
            lo_v, hi_v = at(lo), at(min(lo + 1, n - 1))
            return float(lo_v + (hi_v - lo_v) * (pos - lo))

        return cls(mean=math.fsum((vals * reps).tolist()) / n, p50=pct(50), p90=pct(90), p99=pct(99))


def _percentile(sorted_vals: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, numpy's default method (the one ``vllm bench serve`` uses)."""
    if len(sorted_vals) == 1:
        return float(sorted_vals[0])
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return float(sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo))


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One measured request. Times in seconds from the start of the measured window."""

    request_id: int
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    #: The gaps between the chunks the client received (a tuple; the simulator's records compute
    #: theirs on demand from the step times, :class:`servetune.sim.client.ChunkGaps`).
    itl_s: Sequence[float] = ()
    preemptions: int = 0
    error: str | None = None

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_s is None else (self.first_token_s - self.arrival_s) * 1e3

    @property
    def e2e_ms(self) -> float | None:
        return None if self.finish_s is None else (self.finish_s - self.arrival_s) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        """(latency - ttft) / (output - 1), as ``vllm bench serve`` defines it."""
        if self.finish_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) * 1e3 / (self.output_tokens - 1)


@dataclasses.dataclass
class TrialResult:
    """Everything one trial measured. Engines fill it; nothing downstream recomputes it."""

    status: TrialStatus
    cause: str | None = None
    evidence: list[str] = dataclasses.field(default_factory=list)
    backend: str = "sim"
    vllm_version: str | None = None
    # Throughput over the measured window.
    duration_s: float | None = None
    completed: int | None = None
    failed: int | None = None
    output_throughput: float | None = None  # output tokens/s
    total_token_throughput: float | None = None  # (prompt + output) tokens/s
    request_throughput: float | None = None  # requests/s
    ttft_ms: LatencySummary | None = None
    itl_ms: LatencySummary | None = None
    tpot_ms: LatencySummary | None = None
    e2e_ms: LatencySummary | None = None
    preemptions: int | None = None
    kv_cache_usage_peak: float | None = None  # 0..1
    kv_cache_usage_mean: float | None = None
    memory: MemoryBreakdown | None = None
    kv_cache_tokens: int | None = None
    num_gpu_blocks: int | None = None
    max_concurrency: float | None = None
    startup_s: float | None = None
    wall_s: float | None = None
    # CPU seconds vLLM's API server process spent over the measured window: real vLLM's
    # ``process_cpu_seconds_total`` (the process serving /metrics; the engine core is another
    # process) after minus before; the simulator's modelled API server. Over ``duration_s`` it is the
    # server's busy share of one core (``api_server_busy``): near 1, the host's CPU, not the GPU, set
    # the pace (:func:`servetune.sim.host_cpu.host_api_cpu_factor` compares the two).
    api_server_cpu_s: float | None = None
    requests: list[RequestRecord] = dataclasses.field(default_factory=list)
    log_text: str = ""
    # The GPUs the trial ran on (Ray's ids, recorded by the actor) and those whose memory did not
    # come back after the server stopped: the pool takes a quarantined slot out of service.
    gpu_ids: list[str] = dataclasses.field(default_factory=list)
    # The Ray node the trial ran on (or, for a lost node, the node that went): set by the pool,
    # read by its re-run logic; the evidence lines say the same for a human.
    node_id: str | None = None
    quarantined_gpus: list[str] = dataclasses.field(default_factory=list)
    # Per-GPU memory of a multi-GPU trial: one breakdown per worker process (label as vLLM prints
    # it: ``Worker_TP0``, ``Worker_PP1_TP0``, or ``EngineCore`` for one GPU), GiB, from its log lines.
    worker_memory: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    # Peak used memory per GPU id (MiB) read through NVML while the server ran: what the GPU really held.
    gpu_used_mib_peak: dict[str, int] = dataclasses.field(default_factory=dict)
    # Where the trial's seconds went, beyond ``startup_s`` and ``duration_s``: vLLM's own phases
    # (``weights_load``, ``torch_compile``, ``graph_capture``, ``engine_init``) from its log and
    # servetune's (``stop``: SIGTERM until the process group is gone; ``gpu_free``: until NVML shows
    # the memory back). Seconds.
    timings_s: dict[str, float] = dataclasses.field(default_factory=dict)
    # True: vLLM loaded the compiled graphs from its cache (a warm start); False: it compiled them.
    compile_cache_hit: bool | None = None
    # Driver side: seconds from handing the trial to Ray until its result was back in the driver
    # (actor start, engine, cleanup, transfer). ``overhead_s`` in :meth:`metrics` is this minus the
    # server's startup and the measured window: what servetune itself cost the trial.
    dispatch_s: float | None = None
    # Confirmation repeats measured on this trial's own server start after its window (vllm
    # backend, ``budget.confirm_on: same-start``, when its window led: engines.LeaderRepeats), in
    # repeat order; each a result of its own, without the start's log or timings.
    repeats: list[TrialResult] = dataclasses.field(default_factory=list)

    @property
    def api_server_busy(self) -> float | None:
        """The API server's busy share of one core over the measured window (``api_server_cpu_s``
        over ``duration_s``); None without both."""
        if self.api_server_cpu_s is None or not self.duration_s:
            return None
        return self.api_server_cpu_s / self.duration_s

    @property
    def overhead_s(self) -> float | None:
        """Seconds of the trial that were neither vLLM starting nor the measured load (driver view).
        The same-start repeats' windows (each its warm-up and load, ``wall_s``) are measured load too:
        a leading trial's dispatch time holds them."""
        if self.dispatch_s is None or self.startup_s is None:
            return None
        repeats_s = sum(r.wall_s or r.duration_s or 0.0 for r in self.repeats)
        return max(0.0, self.dispatch_s - self.startup_s - (self.duration_s or 0.0) - repeats_s)
    #: Why the measured window ended before the workload did (:mod:`servetune.engines.early_stop`), e.g.
    #: ``"preemptions: 3 counted, 0 allowed"``; None for a full measurement.
    early_stopped: str | None = None

    # An ``infra_error``'s kind (:data:`servetune.engines.vllm.infra.KINDS`: ``port_in_use``, ``gpu_memory_held``,
    # ``gpu_unusable``, ``node_lost``), and the infrastructure failures of earlier attempts of this
    # same flag set (one line each: attempt, where, why) when the pool re-ran it elsewhere.
    infrastructure: str | None = None
    infra_attempts: list[str] = dataclasses.field(default_factory=list)
    #: The study's goodput and cost figures for this result (:data:`SLO_METRICS` keys), set by the
    #: driver, which knows the targets and the price; empty until then.
    slo: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Where the figures are least sure, one line each (``evidence`` says where the trial ran and what
    #: happened): the simulator's (:func:`servetune.sim.simulate`: a GPU no real run has judged, a
    #: hybrid's recurrent layers, a Mamba pool counted short, an all-reduce priced as the calibrated
    #: kernel, an API server that set the pace). ``servetune simulate`` prints them, ``--json`` too.
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK

    def metrics(self) -> dict[str, float]:
        """Flat numeric metrics, named as in MLflow and the Parquet dataset."""
        out: dict[str, float] = {}
        for name in (
            "output_throughput", "total_token_throughput", "request_throughput", "duration_s",
            "completed", "failed", "preemptions", "kv_cache_usage_peak", "kv_cache_usage_mean",
            "kv_cache_tokens", "num_gpu_blocks", "max_concurrency", "startup_s", "wall_s", "api_server_cpu_s",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = float(value)
        for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            summary: LatencySummary | None = getattr(self, name)
            if summary is not None:
                stem = name[: -len("_ms")]
                for stat in ("mean", "p50", "p90", "p99"):
                    out[f"{stem}_{stat}_ms"] = float(getattr(summary, stat))
        busy = self.api_server_busy
        if busy is not None:
            out["api_server_busy"] = float(busy)
        if self.memory is not None:
            for key, value in self.memory.as_dict().items():
                out[f"mem_{key}_gib"] = float(value)
        for label, parts in sorted(self.worker_memory.items()):
            for key, value in sorted(parts.items()):
                out[f"worker_{label}_{key}_gib"] = float(value)
        for gpu, mib in sorted(self.gpu_used_mib_peak.items()):
            out[f"gpu{gpu}_used_mib_peak"] = float(mib)
        for key, value in sorted(self.timings_s.items()):
            out[f"timing_{key}_s"] = float(value)
        if self.compile_cache_hit is not None:
            out["compile_cache_hit"] = 1.0 if self.compile_cache_hit else 0.0
        if self.dispatch_s is not None:
            out["dispatch_s"] = float(self.dispatch_s)
        overhead = self.overhead_s
        if overhead is not None and capabilities(self.backend).real_gpus:  # the simulator's seconds are virtual
            out["overhead_s"] = overhead
        out.update({k: float(v) for k, v in self.slo.items() if k in SLO_METRICS})
        return out

    @classmethod
    def from_metrics(cls, status: str | TrialStatus, cause: str | None, metrics: Mapping[str, float],
                     backend: str = "sim", vllm_version: str | None = None) -> TrialResult:
        """The inverse of :meth:`metrics`: a result rebuilt from its flat figures (what the study
        stored in Optuna), e.g. to record a trial in MLflow after the driver died before it could.

        Example:
            >>> r = TrialResult(TrialStatus.OK, output_throughput=10.0, ttft_ms=LatencySummary(1, 2, 3, 4))
            >>> TrialResult.from_metrics("ok", None, r.metrics()).metrics() == r.metrics()
            True
        """
        m = dict(metrics)
        out = cls(TrialStatus(status), cause=cause, backend=backend, vllm_version=vllm_version)
        ints = {"completed", "failed", "preemptions", "kv_cache_tokens", "num_gpu_blocks"}
        for name in ("output_throughput", "total_token_throughput", "request_throughput", "duration_s",
                     "completed", "failed", "preemptions", "kv_cache_usage_peak", "kv_cache_usage_mean",
                     "kv_cache_tokens", "num_gpu_blocks", "max_concurrency", "startup_s", "wall_s",
                     "api_server_cpu_s"):
            if name in m:
                setattr(out, name, int(m[name]) if name in ints else float(m[name]))
        for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            stem = name[: -len("_ms")]
            keys = [f"{stem}_{stat}_ms" for stat in ("mean", "p50", "p90", "p99")]
            if all(k in m for k in keys):
                setattr(out, name, LatencySummary(*(float(m[k]) for k in keys)))
        mem_keys = [f.name for f in dataclasses.fields(MemoryBreakdown)]
        if all(f"mem_{k}_gib" in m for k in mem_keys):
            out.memory = MemoryBreakdown(**{k: float(m[f"mem_{k}_gib"]) for k in mem_keys})
        for key, value in m.items():
            if key.startswith("worker_") and key.endswith("_gib"):
                stem = key[len("worker_"):-len("_gib")]
                # Part names hold underscores too (activation_peak, kv_cache): match the known ones.
                part = next((p for p in _WORKER_PARTS if stem.endswith("_" + p)), None)
                if part is not None:
                    out.worker_memory.setdefault(stem[: -len(part) - 1], {})[part] = float(value)
            elif key.startswith("gpu") and key.endswith("_used_mib_peak"):
                out.gpu_used_mib_peak[key[3:-len("_used_mib_peak")]] = int(value)
            elif key.startswith("timing_") and key.endswith("_s"):
                out.timings_s[key[len("timing_"):-2]] = float(value)
        if "compile_cache_hit" in m:
            out.compile_cache_hit = bool(m["compile_cache_hit"])
        if "dispatch_s" in m:
            out.dispatch_s = float(m["dispatch_s"])
        out.slo = {k: float(m[k]) for k in SLO_METRICS if k in m}
        return out

    def to_dict(self) -> dict[str, Any]:
        """The status, cause, backend, version and :attr:`notes` with the flat :meth:`metrics` (what
        ``servetune simulate --json`` prints and a trial's ``result.json`` holds, beside its evidence)."""
        d: dict[str, Any] = {"status": self.status.value, "cause": self.cause, "backend": self.backend,
             "vllm_version": self.vllm_version, "notes": list(self.notes)}
        d.update(self.metrics())
        return d


#: The measured API server's busy share of one core over the window from which it, not the GPU, set
#: a trial's pace. On the real H200 windows: every 0.85B window (90-96% busy) served 14.7-16.9k tok/s
#: whatever its batch, and the 8B closed-loop decode-heavy windows at 96-105% what the API server
#: could stream (the same flags ran 26% faster on a host whose API server was quicker); at 83% the
#: GPU still led (tests/fixtures/real_h200/scale/README.md).
API_SERVER_SATURATED = 0.9


def api_server_note(metrics: Mapping[str, float]) -> str | None:
    """What a trial whose API server was saturated says about its figure (None otherwise).

    Example:
        >>> api_server_note({"api_server_busy": 0.5}) is None
        True
        >>> api_server_note({"api_server_busy": 0.98})[:45]
        "vLLM's API server was 98% busy on one core in"
    """
    busy = metrics.get("api_server_busy")
    if busy is None or busy < API_SERVER_SATURATED:
        return None
    return (f"vLLM's API server was {100 * busy:.0f}% busy on one core in this trial: the host's CPU, not the "
            "GPU, set its pace. A host with faster cores, or several API server processes (the flag "
            "api_server_count, vllm serve --api-server-count), may serve more with the same flags")


#: The per-worker memory parts (GiB) kept in :attr:`TrialResult.worker_memory`.
_WORKER_PARTS = ("weights", "activation_peak", "non_torch", "cudagraph", "kv_cache", "total", "free_at_start")


def summarize(
    records: Sequence[RequestRecord], duration_s: float,
    pooled_itl_s: tuple[Sequence[float], Sequence[int]] | None = None,
) -> dict[str, Any]:
    """Throughput and latency figures from per-request records, as ``vllm bench serve`` computes them.

    Output throughput counts the output tokens of completed requests over the whole window;
    TPOT is per request, ITL pools every inter-token gap. ``pooled_itl_s``: those gaps of the
    completed requests already pooled, as distinct values (seconds) and how often each occurs
    (the simulator's, whose gaps repeat across the requests of a batch); the records' own
    ``itl_s`` are then not read.
    """
    done = [r for r in records if r.error is None and r.finish_s is not None]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    dur = max(duration_s, 1e-9)
    return {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (out_tokens + in_tokens) / dur,
        "request_throughput": len(done) / dur,
        "ttft_ms": LatencySummary.of([r.ttft_ms for r in done if r.ttft_ms is not None]),
        "tpot_ms": LatencySummary.of([r.tpot_ms for r in done if r.tpot_ms is not None]),
        "itl_ms": (LatencySummary.of([g * 1e3 for r in done for g in r.itl_s]) if pooled_itl_s is None else
                   LatencySummary.of_counts([g * 1e3 for g in pooled_itl_s[0]], pooled_itl_s[1])),
        "e2e_ms": LatencySummary.of([r.e2e_ms for r in done if r.e2e_ms is not None]),
    }
