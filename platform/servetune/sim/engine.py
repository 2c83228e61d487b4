"""One simulated trial: the memory plan, the engine core, the load generator, the result.

Contract (shared with the real engine): :func:`simulate` takes a model, a GPU, a resolved
:class:`~servetune.planner.memory.EngineConfig` and a :class:`~servetune.workload.Workload` and returns a
:class:`~servetune.result.TrialResult` with ``backend="sim"``. A configuration that cannot start
returns the memory plan's failure status and vLLM's own error text, without running anything.

The parts: the engine core (:mod:`servetune.sim.scheduler`), its step times
(:mod:`servetune.sim.perf`), vLLM's API server loop (:mod:`servetune.sim.frontend`), the clients
(:mod:`servetune.sim.client`), the log lines (:mod:`servetune.sim.vllm_log`) and what the API
server's load says about the host (:mod:`servetune.sim.host_cpu`).

Example:
    >>> from servetune.planner.gpus import get_gpu
    >>> from servetune.planner.memory import resolve_engine_config
    >>> from servetune.planner.modelinfo import load_model
    >>> from servetune.workload import Workload
    >>> model, gpu = load_model("servetune-test-850m"), get_gpu("H200")
    >>> config = resolve_engine_config({"gpu_memory_utilization": 0.5, "max_num_seqs": 64}, model, gpu)
    >>> w = Workload.from_dict({"input_len": 1024, "output_len": 256, "num_requests": 128, "concurrency": 64})
    >>> r = simulate(model, gpu, config, w)
    >>> r.status.value, r.completed, r.preemptions
    ('ok', 128, 0)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from servetune.planner.comm import SERVETUNE_LAUNCH_ENV, nccl_small_message_note
from servetune.planner.gpus import calibration_note
from servetune.planner.memory import plan_memory
from servetune.result import TrialResult, TrialStatus, summarize
from servetune.sim import vllm_log
from servetune.sim._moe_tiles import unaligned_experts_note
from servetune.sim.client import LoadClient
from servetune.sim.host_cpu import FORWARD_BOUND_SHARE, FRONTEND_BOUND_SHARE, forward_bound_note, frontend_bound_note
from servetune.sim.perf import PerfModel
from servetune.sim.perf_hybrid import hybrid_note
from servetune.sim.scheduler import SimScheduler, mamba_pool_note

if TYPE_CHECKING:
    from servetune.planner.comm import CommEnv
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.engine_config import EngineConfig
    from servetune.planner.memory import MemoryPlan
    from servetune.planner.modelinfo import ModelProfile
    from servetune.sim.moe_jit import TritonCache
    from servetune.workload import Workload

__all__ = ["simulate", "figure_notes"]


def simulate(model: ModelProfile, gpu: GpuSpec, config: EngineConfig, workload: Workload, *,
             plan: MemoryPlan | None = None, seed: int = 0, triton_cache: TritonCache | None = None,
             comm_env: CommEnv | None = None, one_replica: bool = False) -> TrialResult:
    """Run ``workload`` on one simulated engine and measure it the way the load generator does.

    With ``config.data_parallel_size`` D > 1 the server is D replicas: unless ``one_replica`` (the caller has
    already cut ``workload`` to one replica's share), one replica runs its share and the figures are the
    server's (:func:`simulate_data_parallel`).

    ``triton_cache``: the server's fused-MoE kernel variants (``sim.moe_jit``) where the caller runs
    several loads on one server and carries it from run to run (it is updated in place); None, a
    freshly started server. ``comm_env``: the environment the server runs with, which decides the TP
    all-reduce's backends (:func:`servetune.planner.comm.allreduce_table`); None, servetune's launch environment
    (multicast off). The memory plan is the caller's (``plan``) or planned in the same environment.

    Warm-up requests run first and are excluded; the measured window runs from the first measured
    send to the last completion (:class:`~servetune.sim.client.LoadClient`). Deterministic: the
    same inputs give the same result.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.memory import resolve_engine_config
        >>> from servetune.planner.modelinfo import load_model
        >>> from servetune.workload import Workload
        >>> model, gpu = load_model("servetune-test-850m"), get_gpu("H200")
        >>> cfg = resolve_engine_config({"max_num_seqs": 32}, model, gpu)
        >>> w = Workload.from_dict({"input_len": 512, "output_len": 64, "num_requests": 64, "concurrency": 16})
        >>> simulate(model, gpu, cfg, w).completed
        64
    """
    if config.data_parallel_size > 1 and not one_replica:
        return simulate_data_parallel(model, gpu, config, workload, plan=plan, seed=seed, triton_cache=triton_cache,
                                      comm_env=comm_env)
    if plan is None:
        plan = plan_memory(model, gpu, config, env=comm_env or SERVETUNE_LAUNCH_ENV)
    base: dict[str, Any] = dict(backend="sim", vllm_version=config.vllm_version, memory=plan.memory,
                                kv_cache_tokens=plan.kv_cache_tokens, num_gpu_blocks=plan.num_gpu_blocks,
                                max_concurrency=plan.max_concurrency, startup_s=plan.startup_s)
    startup_log = vllm_log.startup_log_text(model, gpu, config, plan)
    if not plan.fits:
        status = plan.failure or TrialStatus.STARTUP_OOM
        return TrialResult(status=status, cause=plan.cause, evidence=[plan.cause] if plan.cause else [],
                           log_text=startup_log, **base)

    perf = PerfModel(model, gpu, config, sampling=workload.sampling, comm_env=comm_env)
    sched = SimScheduler(model, gpu, config, plan.num_gpu_blocks, seed=seed, perf=perf, triton_cache=triton_cache)
    client = LoadClient(sched, workload)
    records = client.run()
    finish_times = [r.finish_s for r in records if r.finish_s is not None]
    fig = summarize(records, max(finish_times) if finish_times else 0.0, pooled_itl_s=client.pooled_itl_s())
    result = TrialResult(
        status=TrialStatus.OK, **base,
        duration_s=fig["duration_s"], completed=fig["completed"], failed=fig["failed"],
        output_throughput=fig["output_throughput"], total_token_throughput=fig["total_token_throughput"],
        request_throughput=fig["request_throughput"], ttft_ms=fig["ttft_ms"], itl_ms=fig["itl_ms"],
        tpot_ms=fig["tpot_ms"], e2e_ms=fig["e2e_ms"], preemptions=sched.num_preemptions,
        kv_cache_usage_peak=sched.kv_usage_peak, kv_cache_usage_mean=sched.kv_usage_mean,
        requests=records, api_server_cpu_s=sched.frontend_busy_s - client.busy_at_t0,
    )
    result.notes = figure_notes(model, gpu, config, result.api_server_busy or 0.0, perf.api_cpu_factor,
                                sched.forward_bound_share, perf.forward_cpu_parts)
    # The rate vLLM logs at the window's end: its most recent 1000 lookups, the warm-up's left out
    hit_rate = 100.0 * (sched.logged_hit_rate(client.lookups_at_t0) or 0.0)
    result.log_text = startup_log + vllm_log.run_log_text(
        sched.prompt_tokens_computed, sched.generation_tokens, sched.now_s, sched.num_preemptions,
        sched.kv_usage_peak, hit_rate, seed=seed, steps=sched.num_steps, completed=result.completed,
        duration_s=result.duration_s or 0.0, output_throughput=result.output_throughput or 0.0)
    return result


def replica_share(workload: Workload, replicas: int) -> Workload:
    """What one of ``replicas`` data-parallel engines receives of ``workload``: vLLM's API server spreads the
    requests over the engines by their load, so each takes ``1 / replicas`` of the requests, the warm-up,
    the concurrency and the arrival rate (a trace's arrivals ``replicas`` times as sparse). The published-run
    harness cuts a ``vllm bench serve`` run the same way (``benchmarks/published_runs.py``), judged on the
    published TP=4 DP=2 runs (docs/accuracy.md).

    Example:
        >>> from servetune.workload import Workload
        >>> w = Workload.from_dict({"input_len": 512, "output_len": 64, "num_requests": 64, "concurrency": 16})
        >>> s = replica_share(w, 2)
        >>> s.num_requests, s.concurrency, s.request_rate
        (32, 8, None)
    """
    if replicas <= 1:
        return workload
    return dataclasses.replace(
        workload, num_requests=max(1, workload.num_requests // replicas),
        warmup_requests=workload.warmup_requests // replicas,
        concurrency=None if workload.concurrency is None else max(1, workload.concurrency // replicas),
        request_rate=None if workload.request_rate is None else workload.request_rate / replicas,
        rate_scale=workload.rate_scale / replicas if workload.trace_file is not None else workload.rate_scale)


def simulate_data_parallel(model: ModelProfile, gpu: GpuSpec, config: EngineConfig, workload: Workload, *,
                           plan: MemoryPlan | None = None, seed: int = 0,
                           triton_cache: TritonCache | None = None, comm_env: CommEnv | None = None) -> TrialResult:
    """``config.data_parallel_size`` replicas as one server: one replica runs :func:`replica_share` of ``workload``
    and, the replicas being alike, the server's counts and throughputs are that replica's times D; its
    latencies, KV usage, request records and API-server CPU are the replica's. From 0.15.0 vLLM starts one API server
    per DP rank ("Defaulting api_server_count to data_parallel_size", ``entrypoints/cli/serve.py:104-121@0.26.0``);
    through 0.14.1 one API server serves every replica, and the replica's API-server work costs D times its own
    (``sim._perf_api_server.replicas_per_api_server``, ``VllmMemoryRules.api_server_per_dp_rank``). A MoE replica's layers already run every
    replica's tokens on experts split over ``tp x dp`` (:func:`~servetune.sim.perf_classes.moe_step_tokens`).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.memory import resolve_engine_config
        >>> from servetune.planner.modelinfo import load_model
        >>> from servetune.workload import Workload
        >>> model, gpu = load_model("servetune-test-850m"), get_gpu("H200")
        >>> w = Workload.from_dict({"input_len": 512, "output_len": 64, "num_requests": 64, "concurrency": 16})
        >>> simulate(model, gpu, resolve_engine_config({"data_parallel_size": 2}, model, gpu), w).completed
        64
    """
    dp = config.data_parallel_size
    result = simulate(model, gpu, config, replica_share(workload, dp), plan=plan, seed=seed,
                      triton_cache=triton_cache, comm_env=comm_env, one_replica=True)
    if result.status is not TrialStatus.OK:
        return result

    def times(value: float | int | None) -> Any:
        return None if value is None else value * dp

    out = dataclasses.replace(
        result, completed=times(result.completed), failed=times(result.failed),
        output_throughput=times(result.output_throughput),
        total_token_throughput=times(result.total_token_throughput),
        request_throughput=times(result.request_throughput), preemptions=times(result.preemptions))
    out.notes = [*result.notes, f"data_parallel_size={dp}: one replica simulated with 1/{dp} of the load; counts "
                 f"and throughputs are the {dp} replicas' together, latencies one replica's"]
    return out


def figure_notes(model: ModelProfile, gpu: GpuSpec, config: EngineConfig, api_server_busy: float,
                 api_cpu_factor: float, forward_bound: float = 0.0, forward_parts: tuple[str, ...] = ()) -> list[str]:
    """Where a served trial's simulated figures are least sure, one line each, in the order ``servetune
    simulate`` prints them (:attr:`TrialResult.notes`; the one place that produces them): an
    all-reduce priced as the calibrated custom kernel, an API server that set the pace, a forward whose
    CPU paced ``forward_bound`` of the steps' time (``SimScheduler.forward_bound_share``; ``forward_parts``: what it
    launches, ``PerfModel.forward_cpu_parts``), MoE experts
    of a width the fused-MoE kernel runs slowly, a GPU no real vLLM run has judged, a Mamba / gated-delta-net hybrid's recurrent layers, a Mamba pool
    counted short under prefix caching.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.memory import resolve_engine_config
        >>> from servetune.planner.modelinfo import load_model
        >>> model, a10g, l40s = load_model("servetune-test-850m"), get_gpu("A10G"), get_gpu("L40S")
        >>> [n[:5] for n in figure_notes(model, a10g, resolve_engine_config({}, model, a10g), 0.1, 1.0)]
        ['A10G:']
        >>> figure_notes(model, l40s, resolve_engine_config({}, model, l40s), 0.1, 1.0)
        []
    """
    notes = [nccl_small_message_note(gpu, config.tensor_parallel_size, config.disable_custom_all_reduce)]
    if api_server_busy >= FRONTEND_BOUND_SHARE:
        notes.append(frontend_bound_note(api_server_busy, api_cpu_factor))
    if forward_bound >= FORWARD_BOUND_SHARE:
        notes.append(forward_bound_note(forward_bound, forward_parts))
    notes.append(unaligned_experts_note(model, gpu, config.tensor_parallel_size, config.version,
                                        config.data_parallel_size))
    notes += [calibration_note(gpu, model), hybrid_note(model), mamba_pool_note(model, config)]
    return [n for n in notes if n]
