"""vLLM's startup, predicted: where the GPU memory goes, how many KV blocks, whether it starts.

A flag set resolves into an :class:`~servetune.planner.engine_config.EngineConfig` first
(:func:`~servetune.planner.engine_config.resolve_engine_config`, handed on from here). Then, pure,
no I/O, :func:`plan_memory` replays the V1 worker's memory profiling (vLLM's
``determine_available_memory`` in ``vllm/v1/worker/gpu_worker.py``, per version): budget =
``total * gpu_memory_utilization`` (or ``kv_cache_memory_bytes``), minus weights, the profile
run's activation peak, the non-torch growth and, where that version subtracts it, the CUDA-graph
estimate; the rest becomes KV blocks (``vllm/v1/core/kv_cache_utils.py``, minimum over workers),
KV tokens and the maximum concurrency, or a startup failure with vLLM's error text.

What changes with the vLLM version is one rules object (:mod:`.vllm_rules`, chosen once per
config); what a model class takes in the profile run (activation peak, sampler, CUDA graphs, with
their calibration) is :mod:`.model_memory`; this module sums them. The startup-time constants sit
under "Calibration" below.

Example:
    >>> from servetune.planner.gpus import get_gpu
    >>> from servetune.planner.modelinfo import load_model
    >>> model, gpu = load_model("servetune-test-850m"), get_gpu("H200")
    >>> cfg = resolve_engine_config({"gpu_memory_utilization": 0.5, "max_num_seqs": 64}, model, gpu)
    >>> cfg.max_num_batched_tokens, cfg.cudagraph_capture_sizes[-3:]
    (8192, (112, 120, 128))
    >>> plan = plan_memory(model, gpu, cfg)
    >>> plan.fits, plan.kv_cache_tokens, round(plan.max_concurrency, 2)   # the log: 2,216,528 and 270.57x
    (True, 2216528, 270.57)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

from servetune.planner._kv_layout import KVLayout, kv_layout
from servetune.planner._moe_experts import moe_workspace_bytes
from servetune.planner._vision_towers import deepstack_buffer_bytes
from servetune.planner.comm import (SERVETUNE_LAUNCH_ENV, CommEnv, CommMemory, comm_memory, fused_allreduce_note,
                                    custom_all_reduce_memory_note, nccl_small_message_note)
from servetune.planner.engine_config import (EngineConfig, batch_defaults, capture_sizes_for, compile_key,
                                             resolve_engine_config)
from servetune.planner.gpus import GpuSpec
from servetune.planner.model_memory import (ACT_FIXED_GIB, CUDAGRAPH_CALIBRATED_MAX_SIZE, SAMPLER_BYTES_PER_LOGIT_V1,
                                            WARMUP_SHORTFALL_GIB,
                                            activation_peak_bytes, cudagraph_memory_bytes, effective_model,
                                            persistent_runner_bytes, sampler_profile_bytes, sampler_warmup_bytes)
from servetune.planner.modelclass import as_loaded_on, class_notes
from servetune.planner.moe_kernels import moe_kernel_note
from servetune.planner.modelinfo import ModelProfile, local_experts
from servetune.planner.vllm_rules import GiB, MiB, VllmMemoryRules, memory_rules, parse_vllm_version
from servetune.result import MemoryBreakdown, TrialStatus
from servetune.vllm_version import DEFAULT_VLLM_VERSION

# The resolved config, parse_vllm_version, the model-class terms and the two calibration constants
# callers read are handed on from the modules that define them (this module's names before they moved).
__all__ = ["DEFAULT_VLLM_VERSION", "EngineConfig", "MemoryPlan", "resolve_engine_config", "plan_memory",
           "parse_vllm_version", "capture_sizes_for", "activation_peak_bytes", "cudagraph_memory_bytes",
           "batch_defaults", "compile_key", "sampler_profile_bytes", "persistent_runner_bytes", "ACT_FIXED_GIB",
           "SAMPLER_BYTES_PER_LOGIT_V1", "VllmMemoryRules", "memory_rules"]


# =============================================================================== Calibration
#: Launch to /health 200 (summary.json startup_s; README): ~41.6 s of each start is outside
#: "init engine" (imports of the API server and engine processes, tokenizer, weight load);
#: init engine = 17.0 s eager (b1), 29.7-39.7 s with graphs, of which "compilation" 12.3-19.0 s
#: (mean 14.6) and graph capture 1-3 s. Each extra worker process adds ~18 s (README: TP=2 90 s
#: warm vs 76-80 s at TP=1; 83 s eager vs 52-59 s). A fresh host (cold compile cache) adds ~35 s
#: (113 s vs 76-80 s). Measured: a2 70 s, a3 80, b2 75, b3 78, b4 78, a1 89 (first start), b1 59.
STARTUP_BASE_S = 39.7
STARTUP_LOAD_FIXED_S = 1.2
STARTUP_LOAD_GIB_PER_S = 4.0
STARTUP_WARMUP_S = 17.0
STARTUP_COMPILE_S = 14.6
STARTUP_CAPTURE_S_PER_GRAPH = 0.04
STARTUP_PER_EXTRA_WORKER_S = 18.0
STARTUP_COLD_CACHE_S = 35.0
STARTUP_PROFILE_S = 4.0  # b5 (util 0.012, eager) died 46 s after launch, right after the profile run


# ============================================================================== MemoryPlan
@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The predicted startup of one engine: memory per GPU (the binding worker), KV capacity, verdict.

    Fields after ``startup_s`` are servetune additions: ``fix`` says what to change when the
    plan fails, ``estimated_max_model_len`` is vLLM's estimate for ``kv_too_small``,
    ``num_cudagraphs`` counts PIECEWISE + FULL graphs, ``cudagraph_subtracted`` whether this
    version took the CUDA-graph estimate out of the KV budget, ``notes`` are caveats.
    """

    fits: bool
    failure: TrialStatus | None
    cause: str | None  # vLLM's own error text for the failure
    memory: MemoryBreakdown  # GiB per GPU
    num_gpu_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    block_size: int
    kv_bytes_per_token: int
    startup_s: float  # predicted launch-to-healthy seconds
    fix: str | None = None
    estimated_max_model_len: int | None = None
    num_cudagraphs: int = 0
    cudagraph_subtracted: bool = False
    notes: tuple[str, ...] = ()
    comm: CommMemory | None = None  # the memory outside torch, and why (multicast or not)
    #: GiB the V1 runner's sampler warm-up after graph capture finds free past its need, by this plan;
    #: ``None`` where no such warm-up runs (``VllmMemoryRules.sampler_warmup_after_capture``).
    warmup_margin: float | None = None
    #: The plan fits but its warm-up margin is inside the shortfall real starts showed
    #: (:func:`warmup_note`): the start may die in the sampler warm-up.
    warmup_at_risk: bool = False

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict; the keys are a contract (``servetune plan --json``).

        Example:
            >>> from servetune.planner.gpus import get_gpu
            >>> from servetune.planner.modelinfo import load_model
            >>> m, g = load_model("servetune-test-850m"), get_gpu("H200")
            >>> sorted(plan_memory(m, g, resolve_engine_config({}, m, g)).to_json()["memory_gib"])
            ['activation_peak', 'budget', 'cudagraph', 'kv_cache', 'non_torch', 'total', 'weights']
        """
        return {
            "fits": self.fits,
            "failure": self.failure.value if self.failure is not None else None,
            "cause": self.cause,
            "fix": self.fix,
            "kv_cache_tokens": self.kv_cache_tokens,
            "num_gpu_blocks": self.num_gpu_blocks,
            "max_concurrency": round(self.max_concurrency, 4),
            "block_size": self.block_size,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "estimated_max_model_len": self.estimated_max_model_len,
            "num_cudagraphs": self.num_cudagraphs,
            "cudagraph_subtracted": self.cudagraph_subtracted,
            "startup_s": round(self.startup_s, 1),
            "memory_gib": {k: round(v, 4) for k, v in self.memory.as_dict().items()},
            "notes": list(self.notes),
            "multicast": self.comm.multicast if self.comm is not None else False,
            "comm_reason": self.comm.reason if self.comm is not None else None,
            "fused_allreduce": self.comm.fused_allreduce if self.comm is not None else False,
            "warmup_margin_gib": round(self.warmup_margin, 4) if self.warmup_margin is not None else None,
            "warmup_at_risk": self.warmup_at_risk,
        }




def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _startup_seconds(config: EngineConfig, weight_bytes: int, cold: bool, failure: TrialStatus | None,
                     load_failed: bool) -> float:
    """Launch to healthy; for a startup failure, launch to the engine's death (when the trial ends)."""
    base = STARTUP_BASE_S + STARTUP_PER_EXTRA_WORKER_S * (config.world_size - 1)
    load = STARTUP_LOAD_FIXED_S + weight_bytes / GiB / STARTUP_LOAD_GIB_PER_S
    if load_failed:
        return base + load
    compile_s = 0.0 if config.enforce_eager else STARTUP_COMPILE_S + (STARTUP_COLD_CACHE_S if cold else 0.0)
    if failure in (TrialStatus.STARTUP_OOM, TrialStatus.KV_TOO_SMALL):
        # Dies right after the profile run (b5: 46 s, eager, the profile itself ~4 s).
        return base + load + compile_s + STARTUP_PROFILE_S
    capture = 0.0 if config.enforce_eager else STARTUP_CAPTURE_S_PER_GRAPH * config.num_cudagraphs
    return base + load + compile_s + capture + STARTUP_WARMUP_S



def _cuda_oom_text(need: int, total: int, free: int) -> str:
    return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {need / GiB:.2f} GiB. GPU 0 has a "
            f"total capacity of {total / GiB:.2f} GiB of which {max(free, 0) / MiB:.2f} MiB is free.")


@dataclasses.dataclass(frozen=True)
class _Accounting:
    """One engine's startup memory in bytes per GPU, for the binding worker (the pipeline stage
    with the fewest KV blocks; TP ranks of a stage are identical and vLLM takes the minimum)."""

    total: int
    context: int  # in use before vLLM's init snapshot (CUDA context, NCCL)
    budget: int  # total x gpu_memory_utilization, or kv_cache_memory_bytes
    non_torch: int  # non-torch growth, plus the persistent runner state 0.27+ charges
    cudagraph: int
    subtract_cg: bool  # this version takes the CUDA-graph estimate off the budget
    weights: list[int]  # per stage
    bind: int  # the binding stage
    act: int  # its profiled activation peak
    available: int  # what is left for KV blocks
    computed_blocks: int
    num_blocks: int  # computed_blocks, or num_gpu_blocks_override
    block_bytes: int  # one KV block over the binding stage's layers
    layout: KVLayout  # the binding stage's KV groups (modelclass.kv_layout)
    layouts: tuple[KVLayout, ...]  # every stage's
    blocks_per_seq: int  # the blocks one max_model_len request takes in every group
    one_seq: int  # the blocks of one max_model_len sequence, in bytes
    warmup_rows: int  # the V1 runner's sampler warm-up after graph capture (last stage) ...
    warmup_need: int  # ... the tensors it allocates (0: no such warm-up) ...
    warmup_free: int  # ... and what the weights, kept workspaces, KV cache and graphs leave it

    @property
    def headroom(self) -> int:
        """What the budget leaves of the GPU once the context is in use (negative: over-asked)."""
        return self.total - self.context - self.budget

    @property
    def fixed_need(self) -> int:
        """Weights, activation peak, non-torch (and CUDA graphs where subtracted): all but the KV cache."""
        return self.weights[self.bind] + self.act + self.non_torch + (self.cudagraph if self.subtract_cg else 0)


#: The largest ``max_num_seqs`` whose sampler warm-up margin is at least the given bytes (:func:`_warmup_seqs`).
SeqsFor = Callable[[float], "int | None"]


class _Verdict(NamedTuple):
    failure: TrialStatus | None
    cause: str | None
    fix: str | None
    estimated_max_model_len: int | None
    load_failed: bool


def plan_memory(model: ModelProfile, gpu: GpuSpec, config: EngineConfig, *, cold_start: bool = False,
                compile_cache_warm: bool = False, env: CommEnv = SERVETUNE_LAUNCH_ENV) -> MemoryPlan:
    """Predict vLLM's startup memory accounting, KV capacity and verdict for one engine.

    Per GPU of each pipeline stage: ``available = budget - weights - activation_peak - non_torch
    (- cudagraph where the version subtracts it)``; ``num_blocks = available // (page_bytes *
    layers_on_stage)``, minimum over workers (or ``num_gpu_blocks_override``). Failures:
    ``startup_oom`` (weights do not load, or no memory left for KV blocks), ``kv_too_small`` (one
    ``max_model_len`` sequence does not fit), ``cudagraph_oom`` (graph capture runs past the
    ``1 - gpu_memory_utilization`` headroom in versions that do not budget for it). Free memory
    below ``util * total`` at launch (other processes) is not predictable from flags; it is left to
    the runtime. ``cold_start`` adds the compile-cache miss of a fresh host to ``startup_s``;
    ``compile_cache_warm`` says the node has compiled this configuration before (a smaller
    profiled activation peak, see :func:`activation_peak_bytes`). ``env`` is the environment the
    server runs with (:class:`~servetune.planner.comm.CommEnv`): by default servetune's own launch
    environment (NVLink multicast off), which is what every servetune trial runs with;
    ``servetune plan`` passes the caller's environment instead.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("servetune-test-850m"), get_gpu("H200")
        >>> p = plan_memory(m, g, resolve_engine_config({"gpu_memory_utilization": 0.012, "max_num_seqs": 64,
        ...                                               "enforce_eager": True}, m, g))
        >>> p.failure.value, round(p.memory.kv_cache, 2)    # b5: "Available KV cache memory: -0.52 GiB"
        ('startup_oom', -0.52)
    """
    if env.flashinfer_probed:  # one probe answers the sampler (0.10.0-0.11.0) and the fusion workspace (0.17+)
        config = dataclasses.replace(config, flashinfer_available=env.flashinfer_fusion)
    rules = config.rules
    # e.g. Marlin fp8 below compute capability 8.9, Machete's float zero points on Hopper
    model = as_loaded_on(effective_model(model, config), gpu, config.rules)
    comm = comm_memory(gpu, tp=config.tensor_parallel_size, pp=config.pipeline_parallel_size, env=env,
                       version=config.version, compiled=not config.enforce_eager,
                       flashinfer=config.flashinfer_available is not False)
    acc = _account(model, gpu, config, rules, comm, compile_cache_warm)

    def seqs_for(margin: float) -> int | None:
        return _warmup_seqs(model, gpu, config, comm, compile_cache_warm, margin)

    verdict = _verdict(model, config, rules, acc, seqs_for)
    kv_tokens, concurrency = _kv_capacity(rules, acc.num_blocks, config, acc.layout, acc.blocks_per_seq)
    kv_cache_bytes = acc.available
    if config.num_gpu_blocks_override is not None and rules.null_block_first:
        kv_cache_bytes = config.num_gpu_blocks_override * acc.block_bytes
    memory = MemoryBreakdown(
        total=acc.total / GiB, budget=acc.budget / GiB, weights=acc.weights[acc.bind] / GiB,
        activation_peak=acc.act / GiB, non_torch=acc.non_torch / GiB, cudagraph=acc.cudagraph / GiB,
        kv_cache=kv_cache_bytes / GiB)
    ok = verdict.failure is None
    warmup_warning = warmup_note(config, acc, seqs_for) if ok else ()
    return MemoryPlan(
        fits=ok, failure=verdict.failure, cause=verdict.cause, memory=memory,
        num_gpu_blocks=acc.num_blocks if ok else 0,
        kv_cache_tokens=kv_tokens if ok else 0,
        max_concurrency=concurrency if ok else 0.0,
        block_size=config.block_size,
        kv_bytes_per_token=max(lay.bytes_per_token(config.block_size) for lay in acc.layouts),  # as vLLM counts
        startup_s=_startup_seconds(config, max(acc.weights), cold_start, verdict.failure, verdict.load_failed),
        fix=verdict.fix, estimated_max_model_len=verdict.estimated_max_model_len,
        num_cudagraphs=config.num_cudagraphs, cudagraph_subtracted=acc.subtract_cg,
        notes=(*class_notes(model, config.max_num_batched_tokens, config.max_in_flight_tokens),
               *_moe_kernel_notes(model, gpu, config), *_data_parallel_notes(model, config),
               *_expert_parallel_notes(model, config),
               *_notes(gpu, config, env, comm, acc), *warmup_warning), comm=comm,
        warmup_margin=(acc.warmup_free - acc.warmup_need) / GiB if acc.warmup_need else None,
        warmup_at_risk=bool(warmup_warning),
    )


def _data_parallel_notes(model: ModelProfile, config: EngineConfig) -> tuple[str, ...]:
    """What a plan with ``data_parallel_size`` > 1 says: the figures are per GPU of one replica, and for a MoE
    model what the planner counts from vLLM's source and what it leaves out (no MoE start under DP was found
    to judge it on).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("llama-3.1-8b"), get_gpu("H100-80GB")
        >>> _data_parallel_notes(m, resolve_engine_config({"data_parallel_size": 2}, m, g))[0][:60]
        'data_parallel_size=2: 2 GPUs in all; every figure is per GPU'
    """
    dp = config.data_parallel_size
    if dp <= 1:
        return ()
    head = (f"data_parallel_size={dp}: {config.num_gpus} GPUs in all; every figure is per GPU of one replica "
            f"(TP={config.tensor_parallel_size} PP={config.pipeline_parallel_size}), and vLLM logs its KV cache "
            "per engine")
    if not model.is_moe:
        return (head + ". A dense model's replicas are independent engines, each planned as DP=1; checked held "
                "out on one published start (Qwen2.5-0.5B, DP=2, T4, vLLM 0.11.0)",)
    if config.enable_expert_parallel:
        return (head + f". Each MoE layer's workspace sized for {dp} replicas' tokens (the AllGather+ReduceScatter "
                "dispatch); the experts' split: the expert-parallel note",)
    return (head + f". MoE without expert parallelism: the routed experts split over TP x DP = "
            f"{config.tensor_parallel_size * dp} GPUs, every other weight over TP; each MoE layer's workspace sized "
            f"for {dp} replicas' tokens; both counted from vLLM's source (FusedMoEParallelConfig.make, the "
            "AllGather+ReduceScatter dispatch) and judged on no published start. The DP and expert groups' NCCL "
            "communicators are not counted",)


def _expert_parallel_notes(model: ModelProfile, config: EngineConfig) -> tuple[str, ...]:
    """What ``--enable-expert-parallel`` changes in a plan, counted from vLLM's source (one published start with it
    is judged, where it changes no figure: docs/model-classes.md): whole experts per rank (:func:`~servetune.planner.modelinfo.local_experts`), the
    fused-MoE workspace at the experts' whole width, the rest as without it.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("qwen3-30b-a3b"), get_gpu("H100-80GB")
        >>> c = resolve_engine_config({"tensor_parallel_size": 2, "enable_expert_parallel": True}, m, g)
        >>> _expert_parallel_notes(m, c)[0][:85]
        'enable_expert_parallel: ep_size = TP x DP = 2; each GPU holds 64 of the 128 routed ex'
    """
    if not config.enable_expert_parallel:
        return ()
    ep = config.expert_parallel_size(model.is_moe)
    if ep <= 1:
        return ("enable_expert_parallel: TP x DP = 1, so vLLM does not use expert parallelism "
                "(FusedMoEParallelConfig.make: use_ep needs dp x tp > 1); planned as without it",)
    most, least = local_experts(model.num_experts, ep), local_experts(model.num_experts, ep, ep - 1)
    spread = (f"each GPU holds {most} of the {model.num_experts} routed experts" if most == least else
              f"GPUs hold {most} or {least} of the {model.num_experts} routed experts (the first "
              f"{model.num_experts % ep} one more: vLLM's determine_expert_map; planned on the fuller one)")
    return (f"enable_expert_parallel: ep_size = TP x DP = {ep}; {spread}, whole and at their full width, where "
            f"without it every GPU holds all {model.num_experts} at 1/{ep} of their width; attention, shared experts "
            "and the router as without it. The fused-MoE workspace is sized for whole experts (N = 2 x "
            f"{model.expert_intermediate_size}). Each GPU computes its own experts for the tokens routed to them; "
            + ("at DP=1 there is no dispatch (every rank holds the batch; the MoE output is all-reduced over TP as "
               "without it)" if config.data_parallel_size <= 1 else
               "the replicas' tokens are all-gathered before the experts and reduce-scattered after (vLLM's default "
               "all2all backend, allgather_reducescatter)")
            + ". Counted from vLLM's source; judged on one published start only, where the flag changes no figure "
              "(TP=8 on 8 x L40S, vLLM 0.10.2: KV +1.1%)",)


def _account(model: ModelProfile, gpu: GpuSpec, config: EngineConfig, rules: VllmMemoryRules, comm: CommMemory,
             compile_cache_warm: bool) -> _Accounting:
    """vLLM's profiling sum per pipeline stage, and the stage that binds (fewest blocks)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    total = int(gpu.memory_gib * GiB)
    # 0.27+ charges the V2 runner's persistent sampler state as consumed memory, with the
    # non-torch growth (vLLM's own "consumed memory (weights + non-torch)").
    non_torch = comm.non_torch_bytes + persistent_runner_bytes(model, config)
    cg = cudagraph_memory_bytes(model, config)
    subtract_cg = rules.subtracts_cudagraph_estimate and cg > 0
    if config.kv_cache_memory_bytes is not None:
        budget = int(config.kv_cache_memory_bytes)
    else:
        budget = math.ceil(total * config.gpu_memory_utilization) if rules.budget_rounds_up \
            else int(total * config.gpu_memory_utilization)

    # One replica's shard; under DP a MoE model's routed experts split over tp x dp GPUs (EngineConfig.expert_data_parallel)
    # (under --enable-expert-parallel whole experts over tp x dp ranks instead: EngineConfig.expert_parallel_size)
    dp = config.expert_data_parallel(model.is_moe)
    weights = model.stage_weight_bytes(tp, pp, mxfp4_scale_copies=2 if rules.mxfp4_keeps_loaded_scales else 1, dp=dp,
                                       expert_parallel=config.enable_expert_parallel)
    # Qwen3-VL's deepstack buffers, allocated while loading by the wrapper every stage builds
    weights = [w + deepstack_buffer_bytes(model, config.max_num_batched_tokens) for w in weights]
    # KV pages per stage: layers grouped as vLLM's KV cache manager groups them (modelclass.kv_layout)
    layouts = [kv_layout(model, tp, s, pp, config.block_size, model.kv_dtype_bytes(config.kv_cache_dtype),
                         config.mamba_block_size, config.mamba_cache_mode) for s in range(pp)]
    bytes_per_block = [layout.block_bytes for layout in layouts]
    # One worker per stage (TP ranks of a stage are identical); vLLM takes the minimum num_blocks.
    stages = []
    for s in range(pp):
        act = activation_peak_bytes(model, config, last_stage=(s == pp - 1), compile_cache_warm=compile_cache_warm,
                                   first_stage=(s == 0))
        if config.kv_cache_memory_bytes is not None:
            available = budget  # profiling skipped; the figure is used as given
        else:
            available = budget - weights[s] - act - non_torch - (cg if subtract_cg else 0)
        stages.append((act, available, max(available, 0) // bytes_per_block[s]))
    bind = min(range(pp), key=lambda s: (stages[s][2], stages[s][1]))
    act, available, blocks = stages[bind]
    computed_blocks = int(blocks)
    num_blocks = config.num_gpu_blocks_override or computed_blocks
    blocks_per_seq = layouts[bind].blocks_per_request(config.max_model_len, config.block_size,
                                                      config.max_in_flight_tokens)
    # The sampler warm-up runs on the last stage, every stage holding the same number of blocks.
    rows, need = sampler_warmup_bytes(model, config)
    kept = moe_workspace_bytes(model, config.max_num_batched_tokens * dp,  # held past the profile run
                               config.expert_tensor_parallel_size(model.is_moe))
    warmup_free = (total - comm.context_bytes - weights[-1] - kept - non_torch - num_blocks * bytes_per_block[-1]
                   - cg)
    return _Accounting(
        total=total, context=comm.context_bytes, budget=budget, non_torch=non_torch, cudagraph=cg,
        subtract_cg=subtract_cg, weights=weights, bind=bind, act=act, available=int(available),
        computed_blocks=computed_blocks, num_blocks=num_blocks,
        block_bytes=bytes_per_block[bind], layout=layouts[bind], layouts=tuple(layouts),
        blocks_per_seq=blocks_per_seq, one_seq=blocks_per_seq * bytes_per_block[bind],
        warmup_rows=rows, warmup_need=need, warmup_free=int(warmup_free))


def _verdict(model: ModelProfile, config: EngineConfig, rules: VllmMemoryRules, acc: _Accounting,
             seqs_for: SeqsFor | None = None) -> _Verdict:
    """Whether the engine starts, and if not: the failure, vLLM's own text, and the fix."""
    total, context, budget = acc.total, acc.context, acc.budget
    if max(acc.weights) > total - context:
        need_tp = config.tensor_parallel_size
        copies = 2 if rules.mxfp4_keeps_loaded_scales else 1
        while need_tp < 64 and max(model.stage_weight_bytes(need_tp, config.pipeline_parallel_size, copies,
                                                            dp=config.expert_data_parallel(model.is_moe),
                                                            expert_parallel=config.enable_expert_parallel)) > \
                (total - context) * 0.85:
            need_tp *= 2
        return _Verdict(
            TrialStatus.STARTUP_OOM,
            "Failed to load model - not enough GPU memory. Try lowering --gpu-memory-utilization to free "
            "memory for weights, increasing --tensor-parallel-size, or using --quantization. "
            f"(original error: {_cuda_oom_text(max(acc.weights), total, total - context)})",
            f"the weights take {max(acc.weights) / GiB:.1f} GiB per GPU: shard them (tensor_parallel_size "
            f">= {need_tp} or pipeline stages), or use a quantized checkpoint", None, True)
    fixed_need = acc.fixed_need
    if config.kv_cache_memory_bytes is not None and fixed_need + budget > total - context:
        return _Verdict(TrialStatus.STARTUP_OOM, _cuda_oom_text(budget, total, total - context - fixed_need),
                        f"lower kv_cache_memory_bytes to <= {int(total - context - fixed_need - 150 * MiB)}",
                        None, False)
    if acc.available <= 0:
        util = (fixed_need + acc.one_seq) / total
        return _Verdict(TrialStatus.STARTUP_OOM, rules.no_memory_text(),
                        f"raise gpu_memory_utilization to >= {math.ceil(util * 100) / 100:.2f}, or shard the model "
                        "over more GPUs", None, False)
    return _runtime_verdict(config, rules, acc, seqs_for)


def _runtime_verdict(config: EngineConfig, rules: VllmMemoryRules, acc: _Accounting,
                     seqs_for: SeqsFor | None = None) -> _Verdict:
    """The profile left memory for KV blocks: does one sequence fit, the override, the graphs?"""
    block_bytes, available, headroom = acc.block_bytes, acc.available, acc.headroom
    override = config.num_gpu_blocks_override
    check_avail = available
    if override is not None and rules.null_block_first:
        check_avail = override * block_bytes  # 0.33 fits the override
    fit_avail = check_avail - (block_bytes if rules.null_block_first else 0)  # 0.33: null block first
    if acc.one_seq > fit_avail:
        est_len = acc.layout.longest_fitting_len(max(fit_avail, 0), config.max_model_len, config.block_size,
                                                 config.max_in_flight_tokens)
        util = (acc.fixed_need + acc.one_seq + block_bytes) / acc.total
        fix = (f"lower max_model_len to <= {est_len}"
               + (f" or raise gpu_memory_utilization to >= {math.ceil(util * 100) / 100:.2f}"
                  if config.kv_cache_memory_bytes is None and util <= 1 else ""))
        return _Verdict(TrialStatus.KV_TOO_SMALL,
                        rules.kv_too_small_text(config.max_model_len, acc.one_seq, check_avail, est_len),
                        fix, est_len, False)
    if override is not None and override * block_bytes > available + max(headroom, 0):
        # ≤0.29 allocates the override blindly
        return _Verdict(TrialStatus.STARTUP_OOM,
                        _cuda_oom_text(override * block_bytes, acc.total, available + max(headroom, 0)),
                        f"lower num_gpu_blocks_override to <= {acc.computed_blocks}", None, False)
    if (rules.mamba_blocks_cover_max_num_seqs and "mamba" in acc.layout.groups and not config.enforce_eager
            and config.max_num_seqs > acc.num_blocks):
        # config/compilation.py (0.20+; 1476-1497 of 0.26.0): FULL decode graphs need one Mamba block a sequence
        util = (acc.fixed_need + config.max_num_seqs * block_bytes) / acc.total
        return _Verdict(TrialStatus.KV_TOO_SMALL,
                        f"ValueError: max_num_seqs ({config.max_num_seqs}) exceeds available Mamba cache blocks "
                        f"({acc.num_blocks}). Each decode sequence requires one Mamba cache block, so CUDA graph "
                        f"capture cannot proceed. Please lower max_num_seqs to at most {acc.num_blocks} or increase "
                        "gpu_memory_utilization.",
                        f"lower max_num_seqs to <= {acc.num_blocks}"
                        + (f" or raise gpu_memory_utilization to >= {math.ceil(util * 100) / 100:.2f}"
                           if config.kv_cache_memory_bytes is None and util <= 1 else ""), None, False)
    cg = acc.cudagraph
    if cg and not acc.subtract_cg and headroom >= 0:
        # Graphs are captured after the KV cache is allocated, out of what is left of the GPU.
        kv_alloc = acc.num_blocks * block_bytes
        free_for_graphs = acc.total - acc.context - acc.weights[acc.bind] - acc.non_torch - kv_alloc
        if cg > free_for_graphs:
            util = (acc.total - acc.context - cg - (kv_alloc - available)) / acc.total
            return _Verdict(TrialStatus.CUDAGRAPH_OOM, _cuda_oom_text(cg, acc.total, free_for_graphs),
                            f"lower gpu_memory_utilization to <= {math.floor(util * 100) / 100:.2f}, lower "
                            "max_num_seqs / max_cudagraph_capture_size, or set enforce_eager", None, False)
    return _warmup_verdict(config, rules, acc, seqs_for)


def _warmup_verdict(config: EngineConfig, rules: VllmMemoryRules, acc: _Accounting,
                    seqs_for: SeqsFor | None = None) -> _Verdict:
    """The V1 runner's sampler warm-up after graph capture: do its tensors fit in what is left?

    vLLM's own check, not a margin: ``_dummy_sampler_run`` raises its RuntimeError when the
    allocation fails (``rules.sampler_warmup_oom_text``); the product reports it as ``cudagraph_oom``
    (the engine dies after sizing its KV cache, in the warm-up that follows graph capture). The fix names
    the ``max_num_seqs`` and the ``gpu_memory_utilization`` that leave the warm-up the whole shortfall band
    real starts measured (:func:`_warmup_fixes`), so that the fixed start is not warned either.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("gpt-oss-20b"), get_gpu("H100-80GB")
        >>> p = plan_memory(m, g, resolve_engine_config({"gpu_memory_utilization": 0.99, "max_model_len": 8192},
        ...                                               m, g, "0.19.0"))
        >>> p.failure.value, p.fix[:97]
        ('cudagraph_oom', 'fails in the sampler warm-up after CUDA-graph capture (1024 rows: 1.31 GiB short of its 2.78 GiB)')
        >>> p.fix[99:].split(", or ")[:2]  # 1.31 + the band's 1.89 GiB off the budget
        ["lower max_num_seqs to <= 32 (it then fits by vLLM's count, inside the band: warned)", 'lower gpu_memory_utilization to <= 0.94']
        >>> p = plan_memory(m, g, resolve_engine_config({"gpu_memory_utilization": 0.97, "max_model_len": 8192,
        ...                                               "max_num_batched_tokens": 16384}, m, g, "0.19.0"))
        >>> p.fits, [n[n.index("); ") + 3:] for n in p.notes if n.startswith("sampler warm-up")]  # where the forward sets it
        (True, ['max_num_seqs <= 135 or gpu_memory_utilization <= 0.94 leaves that much'])
    """
    need, free = acc.warmup_need, acc.warmup_free
    if not need or free >= need or acc.headroom < 0:  # an over-asked budget is vLLM's free-memory check (a note)
        return _Verdict(None, None, None, None, False)
    fix = (f"fails in the sampler warm-up after CUDA-graph capture ({acc.warmup_rows} rows: "
           f"{(need - free) / GiB:.2f} GiB short of its {need / GiB:.2f} GiB): "
           + ", or ".join((*(f"lower {f.flag} to <= {f.bound}{f.why}" for f in _warmup_fixes(config, acc, seqs_for,
                                                                                              failing=True)),
                           "shrink the CUDA graphs captured before it (max_cudagraph_capture_size) or set enforce_eager")))
    return _Verdict(TrialStatus.CUDAGRAPH_OOM, "RuntimeError: " + rules.sampler_warmup_oom_text(acc.warmup_rows),
                    fix, None, False)


class _Fix(NamedTuple):
    """One flag the sampler warm-up's fix lowers: its name, the bound (as printed) and why, where it says more."""

    flag: str
    bound: str
    why: str = ""


def _warmup_fixes(config: EngineConfig, acc: _Accounting, seqs_for: SeqsFor | None,
                  failing: bool = False) -> tuple[_Fix, ...]:
    """The flags that leave the sampler warm-up its need plus the measured shortfall band's top
    (:data:`~servetune.planner.model_memory.WARMUP_SHORTFALL_GIB`; only where graphs are captured, the starts
    it was measured on): a lower ``max_num_seqs`` (found by re-planning, :func:`_warmup_seqs`; none where the
    sampler sets the profiled peak down to the rows where the forward does: there fewer rows shrink the KV
    budget's deduction as much as the warm-up's need) and a lower ``gpu_memory_utilization`` (the KV cache
    gives back what the budget loses). ``failing``: for a start vLLM's own count fails, the ``max_num_seqs``
    that passes that count is named where none keeps the band."""
    target = WARMUP_SHORTFALL_GIB[1] * GiB if acc.cudagraph else 0.0
    lack = target - (acc.warmup_free - acc.warmup_need)
    out: list[_Fix] = []
    seqs = seqs_for(target) if seqs_for is not None else None
    if seqs is not None:
        out.append(_Fix("max_num_seqs", str(seqs)))
    elif failing and target and seqs_for is not None and (seqs := seqs_for(0.0)) is not None:
        out.append(_Fix("max_num_seqs", str(seqs), " (it then fits by vLLM's count, inside the band: warned)"))
    if config.kv_cache_memory_bytes is None:
        util = math.floor((acc.budget - lack) / acc.total * 100) / 100
        if util > 0:
            out.append(_Fix("gpu_memory_utilization", f"{util:.2f}"))
    return tuple(out)


def _warmup_seqs(model: ModelProfile, gpu: GpuSpec, config: EngineConfig, comm: CommMemory,
                 compile_cache_warm: bool, margin: float) -> int | None:
    """The largest ``max_num_seqs`` below the plan's whose sampler warm-up leaves at least ``margin`` bytes past
    its need, other flags as planned; None where none does (or the rows are capped by the token budget).

    The capture sizes are kept as planned: vLLM's default would capture fewer graphs for fewer sequences, which
    leaves more. The margin does not grow with the rows (the sampler's need and its share of the profiled
    peak fall together, then only the need falls), so a bisection finds it.
    """
    rows = min(config.max_num_seqs, config.max_num_batched_tokens)

    def ok(n: int) -> bool:
        c = dataclasses.replace(config, max_num_seqs=n)
        a = _account(model, gpu, c, c.rules, comm, compile_cache_warm)
        return a.warmup_free - a.warmup_need >= margin

    if rows < config.max_num_seqs or rows <= 1 or not ok(1):
        return None
    lo, hi = 1, rows - 1  # ok(lo) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _moe_kernel_notes(model: ModelProfile, gpu: GpuSpec, config: EngineConfig) -> tuple[str, ...]:
    # the experts' split names the kernel's tuned config (N = 2 x intermediate / (tp x dp) under DP; under expert
    # parallelism the whole width and the rank's own experts)
    ep = config.expert_parallel_size(model.is_moe)
    note = moe_kernel_note(model, gpu.name, config.expert_tensor_parallel_size(model.is_moe), config.quantization,
                           experts=local_experts(model.num_experts, ep) if ep > 1 else None, version=config.version)
    return (note,) if note else ()


def _notes(gpu: GpuSpec, config: EngineConfig, env: CommEnv, comm: CommMemory, acc: _Accounting) -> tuple[str, ...]:
    """The plan's caveats: multicast's cost, a subtracted graph estimate, extrapolation, an over-ask, and
    what ``disable_custom_all_reduce`` leaves unmodelled."""
    notes: list[str] = []
    tp, no_custom_ar = config.tensor_parallel_size, config.disable_custom_all_reduce
    notes += [n for n in (custom_all_reduce_memory_note(gpu, tp, no_custom_ar),
                          nccl_small_message_note(gpu, tp, no_custom_ar)) if n]
    if comm.multicast:
        without = comm_memory(gpu, tp=config.tensor_parallel_size, pp=config.pipeline_parallel_size,
                              env=env.with_nvls(False), version=config.version, compiled=not config.enforce_eager,
                              flashinfer=config.flashinfer_available is not False)
        notes.append(f"{comm.reason}: +{(comm.non_torch_bytes - without.non_torch_bytes) / GiB:.2f} "
                     "GiB non-torch per TP worker (NCCL's NVLS buffers, counted from NCCL's source); not separated "
                     "in any startup log")
    if comm.fused_allreduce:
        notes.append(fused_allreduce_note(config.vllm_version, config.tensor_parallel_size))
    if acc.subtract_cg:
        runner = " runs this model on its V1 model runner, which" if config.v1_runner else ""
        notes.append(f"vLLM {config.vllm_version}{runner} subtracts the CUDA graph estimate from the KV budget")
    if config.max_cudagraph_capture_size > CUDAGRAPH_CALIBRATED_MAX_SIZE:
        notes.append(f"CUDA graph memory is extrapolated: calibrated on capture sizes up to "
                     f"{CUDAGRAPH_CALIBRATED_MAX_SIZE}, this config captures up to {config.max_cudagraph_capture_size}")
    if config.mamba_cache_mode != "none":
        held = acc.layout.blocks_per_request(config.max_model_len, config.block_size, config.max_in_flight_tokens)
        notes.append(f"prefix caching on a Mamba hybrid: Mamba cache mode '{config.mamba_cache_mode}', Mamba blocks of "
                     f"{config.mamba_block_size} tokens, {held} blocks a {config.max_model_len:,}-token request over "
                     f"{len(acc.layout.groups)} KV groups (vLLM's experimental Mamba prefix caching, read from its "
                     "source; 'all' mode matches one vLLM 0.26.0 granite-4.0-h-tiny start on an H100, read before the "
                     "rule was written)")
    if config.kv_cache_memory_bytes is None and acc.headroom < 0:
        notes.append(f"gpu_memory_utilization {config.gpu_memory_utilization} asks for {acc.budget / GiB:.2f} GiB but "
                     f"only ~{(acc.total - acc.context) / GiB:.2f} GiB is free at startup: vLLM will refuse to start "
                     "(\"Free memory on device ... is less than desired GPU memory utilization\")")
    return tuple(notes)


def warmup_note(config: EngineConfig, acc: _Accounting, seqs_for: SeqsFor | None = None) -> tuple[str, ...]:
    """A warning where the sampler warm-up after graph capture may fail though the plan leaves it room.

    Wherever the V1 runner warms its sampler up after capturing CUDA graphs (every release to 0.21; MoE and
    other V1-runner models after), real starts found less free there than the plan: up to
    :data:`~servetune.planner.model_memory.WARMUP_SHORTFALL_GIB`'s top, 1.89 GiB (read off the first three
    vLLM 0.26.0 starts measured; judged on the other five and on the published vLLM 0.19.0 starts, whose two
    gpt-oss-20b deaths lacked 1.90 and 1.91 GiB). A plan whose margin is under that top is warned, with the
    ``max_num_seqs`` and the ``gpu_memory_utilization`` that keep it. The verdict is not changed: a margin
    inside the band has gone both ways (0.77 and 1.17 GiB served for one model and died for another), and
    what decides it, the free allocator blocks compilation and loading strand and the graph pool's own size,
    is not in vLLM's source. Without graphs (``enforce_eager``) nothing was measured and nothing is warned.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("gpt-oss-20b"), get_gpu("H100-80GB")
        >>> p = plan_memory(m, g, resolve_engine_config({"gpu_memory_utilization": 0.985}, m, g, "0.26.0"))
        >>> p.fits, round(p.warmup_margin, 2), [n[:40] for n in p.notes if n.startswith("sampler warm-up")]
        (True, 0.77, ['sampler warm-up after CUDA-graph capture'])
        >>> p = plan_memory(m, g, resolve_engine_config({"gpu_memory_utilization": 0.95}, m, g, "0.26.0"))
        >>> [n for n in p.notes if n.startswith("sampler warm-up")]
        []
    """
    low, high = WARMUP_SHORTFALL_GIB
    margin = acc.warmup_free - acc.warmup_need
    if not acc.warmup_need or not acc.cudagraph or margin >= high * GiB or margin < 0:
        return ()
    fixes = _warmup_fixes(config, acc, seqs_for)
    keep = f"; {' or '.join(f'{f.flag} <= {f.bound}' for f in fixes)} leaves that much" if fixes else ""
    return (f"sampler warm-up after CUDA-graph capture: this plan leaves {margin / GiB:.2f} GiB past its "
            f"{acc.warmup_need / GiB:.2f} GiB, and real starts found {low:.2f}-{high:.2f} GiB less free there than "
            "planned (vLLM 0.26.0: the graph pool beyond vLLM's estimate, the runner's buffers, allocator blocks "
            "compilation leaves, most on a cold compile cache; the published vLLM 0.19.0 gpt-oss-20b deaths: 1.90 "
            "and 1.91): this start may fail in the sampler warm-up (\"CUDA out of memory occurred when warming up "
            f"sampler with {acc.warmup_rows} dummy requests\"){keep}",)


def _kv_capacity(rules: VllmMemoryRules, num_blocks: int, config: EngineConfig, layout: KVLayout,
                 blocks_per_seq: int) -> tuple[int, float]:
    """``(KV tokens, max concurrency)`` as vLLM logs them (``kv_cache_utils.py``).

    ≤0.20.0: tokens = num_blocks // KV groups * block_size; ≥0.20.1: ``int(max_concurrency * max_model_len)``.
    Concurrency: blocks over the blocks one ``max_model_len`` request takes in every group.
    """
    concurrency = num_blocks / blocks_per_seq
    if rules.kv_tokens_from_concurrency:
        tokens = int(concurrency * config.max_model_len)
    else:
        tokens = layout.tokens(num_blocks, config.block_size)
    return tokens, concurrency
