"""The stand-in's ``/metrics``: vLLM's Prometheus exposition, its histograms and counters.

Contract: :class:`ServerMetrics` holds what the server counts as requests come and go (vLLM's
V1 histograms with vLLM's buckets, the prompt and generation token counters, the finished requests
by reason) and :meth:`ServerMetrics.render` writes the whole exposition in Prometheus text format,
the engine core's gauges and counters read from the scheduler at that moment, with vLLM's names and
0.26 help texts. Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servetune.planner.engine_config import EngineConfig
    from servetune.planner.memory import MemoryPlan
    from servetune.sim.scheduler import SimScheduler

__all__ = ["Histogram", "ServerMetrics"]


_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)


def _buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``limit``."""
    out: list[int] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > limit:
                return tuple(float(x) for x in out)
            out.append(v)
        exp += 1


class Histogram:
    """One Prometheus histogram: cumulative bucket counts, their count and sum, as vLLM exposes them."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: Mapping[str, str]) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            total += count
            le = "+Inf" if bound == math.inf else repr(float(bound))
            out.append(f"{name}_bucket{_labels({**labels, 'le': le})} {float(total)!r}")
        out.append(f"{name}_count{_labels(labels)} {float(total)!r}")
        out.append(f"{name}_sum{_labels(labels)} {float(self.sum)!r}")
        return out


def _labels(labels: Mapping[str, str]) -> str:
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServerMetrics:
    """The server's histograms (``h``, by vLLM's metric name) and counters (``c_*``), and the
    exposition (:meth:`render`)."""

    def __init__(self, max_model_len: int) -> None:
        mml = max_model_len
        self.h = {
            "vllm:time_to_first_token_seconds": Histogram(_TTFT_BUCKETS),
            "vllm:inter_token_latency_seconds": Histogram(_ITL_BUCKETS),
            "vllm:request_time_per_output_token_seconds": Histogram(_ITL_BUCKETS),
            "vllm:e2e_request_latency_seconds": Histogram(_LATENCY_BUCKETS),
            "vllm:request_queue_time_seconds": Histogram(_LATENCY_BUCKETS),
            "vllm:request_inference_time_seconds": Histogram(_LATENCY_BUCKETS),
            "vllm:request_prefill_time_seconds": Histogram(_LATENCY_BUCKETS),
            "vllm:request_decode_time_seconds": Histogram(_LATENCY_BUCKETS),
            "vllm:request_prompt_tokens": Histogram(_buckets_1_2_5(mml)),
            "vllm:request_generation_tokens": Histogram(_buckets_1_2_5(mml)),
            "vllm:request_max_num_generation_tokens": Histogram(_buckets_1_2_5(mml)),
            "vllm:request_params_max_tokens": Histogram(_buckets_1_2_5(mml)),
            "vllm:request_params_n": Histogram((1.0, 2.0, 5.0, 10.0, 20.0)),
            "vllm:iteration_tokens_total": Histogram(_ITERATION_BUCKETS),
        }
        self.c_prompt_tokens = 0
        self.c_generation_tokens = 0
        self.c_success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0}

    def render(self, sched: SimScheduler, config: EngineConfig, plan: MemoryPlan, served_name: str, dead: bool) -> str:
        """vLLM's ``/metrics`` in Prometheus text format (the V1 names, 0.26 help texts): the engine
        core's gauges and counters read from ``sched`` now (the queues as empty once ``dead``), the
        server's counters and histograms, and the cache config's info line."""
        base = {"engine": "0", "model_name": served_name}
        out: list[str] = []

        def scalar(name: str, kind: str, help_text: str, value: float, extra: Mapping[str, str] | None = None) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            out.append(f"{name}{_labels({**base, **(extra or {})})} {float(value)!r}")

        # prometheus_client's process collector in real vLLM: the API server's CPU. Here the modelled
        # API server's busy seconds, which is what that counter measures on a real host.
        out += ["# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.",
                "# TYPE process_cpu_seconds_total counter",
                f"process_cpu_seconds_total {float(sched.frontend_busy_s)!r}"]
        scalar("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               0 if dead else sched.num_running)
        scalar("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               0 if dead else sched.num_waiting)
        scalar("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", sched.kv_usage)
        scalar("vllm:prefix_cache_queries_total", "counter",
               "Prefix cache queries, in terms of number of queried tokens.", sched.prefix_cache_queries)
        scalar("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
               sched.prefix_cache_hits)
        scalar("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
               sched.num_preemptions)
        scalar("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.c_prompt_tokens)
        scalar("vllm:prompt_tokens_cached_total", "counter", "Number of cached prompt tokens (local + external).",
               sched.prefix_cache_hits)
        scalar("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
               self.c_generation_tokens)
        out.append("# HELP vllm:request_success_total Count of successfully processed requests.")
        out.append("# TYPE vllm:request_success_total counter")
        for reason, count in self.c_success.items():
            out.append(f"vllm:request_success_total{_labels({**base, 'finished_reason': reason})} {float(count)!r}")
        helps = {
            "vllm:request_prompt_tokens": "Number of prefill tokens processed.",
            "vllm:request_generation_tokens": "Number of generation tokens processed.",
            "vllm:iteration_tokens_total": "Histogram of number of tokens per engine_step.",
            "vllm:request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
            "vllm:request_params_n": "Histogram of the n request parameter.",
            "vllm:request_params_max_tokens": "Histogram of the max_tokens request parameter.",
            "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
            "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
            "vllm:request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
            "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
            "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
            "vllm:request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
            "vllm:request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
            "vllm:request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
        }
        for name, hist in self.h.items():
            out.append(f"# HELP {name} {helps[name]}")
            out.append(f"# TYPE {name} histogram")
            out += hist.lines(name, base)
        info = {
            "block_size": str(config.block_size), "cache_dtype": config.kv_cache_dtype,
            "calculate_kv_scales": "False", "enable_prefix_caching": str(config.enable_prefix_caching),
            "engine": "0", "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "is_attention_free": "False", "kv_cache_max_concurrency": str(float(plan.max_concurrency)),
            "kv_cache_memory_bytes": str(config.kv_cache_memory_bytes),
            "kv_cache_size_tokens": str(plan.kv_cache_tokens), "num_cpu_blocks": "None",
            "num_gpu_blocks": str(plan.num_gpu_blocks), "num_gpu_blocks_override": str(config.num_gpu_blocks_override),
            "prefix_caching_hash_algo": "sha256", "sliding_window": "None",
        }
        out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        out.append("# TYPE vllm:cache_config_info gauge")
        out.append(f"vllm:cache_config_info{_labels(info)} 1.0")
        return "\n".join(out) + "\n"
