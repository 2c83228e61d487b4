"""Step-time model of the simulated vLLM engine: a roofline per engine step, plus CPU overheads.

Contract: :class:`PerfModel` turns the shape of one scheduled batch (requests, tokens, the KV
context they read, the attention work) into the seconds one engine step takes on the given GPU
(vllm-internals.md §9). Pure arithmetic, no I/O, no randomness.

GPU time of a step is a roofline ``max(bytes / (hbm_gbps * efficiency), flops / (peak *
compute_efficiency))`` for each of the two kinds of kernels, added up: the GEMMs read the weights
of the most loaded rank and do ``2 * active params per GPU * tokens`` FLOPs; attention reads the KV
context of the batch (at ``kv_read_efficiency``: paged attention does not stream at the GEMM rate),
writes the new KV, and does ``4 * q_heads * head_dim * layers * sum(tokens * context)`` FLOPs. Then:

* TP adds two all-reduces per layer: ``latency + 2 (tp-1)/tp * activation bytes / interconnect``.
* PP splits the layers; up to ``pp`` micro-batches are in flight, so a step costs
  ``pp * stage_time(batch / microbatches)`` (a lone request still pays every stage: the bubble).
* CUDA graphs: a decode-only batch up to the largest capture size replays a FULL graph, padded to
  the next capture size, for ``graph_launch_s``; mixed batches run piecewise (attention launched
  between graph pieces) and batches above the largest size run compiled without graphs, both paying
  ``compiled_layer_overhead_s`` per layer; ``enforce_eager`` pays ``eager_layer_overhead_s`` per layer
  (Python kernel launches; on the real H200 eager mode took TPOT from 2.96 ms to 10.6 ms).
* CPU: the engine core spends ``step_overhead_s`` per step plus ``seq_overhead_s`` per scheduled
  request (schedule, prepare inputs, sample); async scheduling hides most of it behind the GPU.
* The API server (and the client) is one more serial stage, modelled by the engine as a FIFO:
  ``request_overhead_s`` per incoming request before it reaches the engine and ``token_overhead_s``
  per streamed output token (detokenize, SSE). The engine never waits for it, but clients see
  tokens when it gets to them: with hundreds of open streams it, not the GPU, sets the TPOT.

The knobs live in :class:`Calibration`; a :class:`~servetune.gpus.GpuSpec` may override any of them
through its ``calibration`` mapping, and :data:`GPU_CALIBRATION` holds the values fitted to the real
H200 runs in ``tests/fixtures/real_h200`` (``benchmarks/sim_fidelity.py`` prints the comparison).

Example:
    >>> from servetune.sim.perf import Calibration
    >>> Calibration().with_overrides({"step_overhead_s": 0.001}).step_overhead_s
    0.001
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from servetune.errors import SpecError, did_you_mean

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.memory import EngineConfig
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["Calibration", "GPU_CALIBRATION", "PerfModel", "calibration_for"]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Simulator constants.

    The defaults are the values fitted on the real H200 (see :data:`GPU_CALIBRATION`): a GPU
    without its own measurements inherits them, so GPUs compare by their datasheet bandwidth and
    FLOP/s, and host-side costs (a property of vLLM's CPU path, not of the GPU) stay the same.
    """

    mem_efficiency: float = 0.69  # fraction of HBM bandwidth reached streaming weights / writing KV
    kv_read_efficiency: float = 0.88  # fraction reached by paged attention reading the KV context
    compute_efficiency: float = 0.38  # fraction of dense peak reached by GEMMs (a small model's GEMMs)
    step_overhead_s: float = 2.0e-3  # engine-core CPU per step (scheduler, input prep, sampler)
    seq_overhead_s: float = 2.5e-6  # engine-core CPU per scheduled request per step
    request_overhead_s: float = 0.9e-3  # API server + client CPU per request, before the engine sees it
    token_overhead_s: float = 40e-6  # API server + client CPU per streamed output token
    graph_launch_s: float = 30e-6  # replaying one full CUDA graph
    compiled_layer_overhead_s: float = 690e-6  # per layer, piecewise graphs / compiled without graphs
    eager_layer_overhead_s: float = 500e-6  # per layer, enforce_eager (every kernel launched from Python)
    async_overlap: float = 0.9  # share of the engine CPU hidden behind the GPU with async scheduling
    sync_overlap: float = 0.3  # the same without async scheduling (output processing still overlaps)
    allreduce_latency_s: float = 10e-6  # one all-reduce, small message
    interconnect_efficiency: float = 0.7  # fraction of the link bandwidth reached by all-reduce

    def with_overrides(self, overrides: Mapping[str, float]) -> Calibration:
        """A copy with the named knobs replaced; unknown names are a :class:`SpecError`."""
        names = {f.name for f in dataclasses.fields(self)}
        for key in overrides:
            if key not in names:
                raise SpecError(f"calibration.{key}", f"unknown simulator knob{did_you_mean(str(key), names)}",
                                f"use one of: {', '.join(sorted(names))}")
        return dataclasses.replace(self, **{k: float(v) for k, v in overrides.items()})


#: Fitted per-GPU knobs, keyed by GpuSpec.name. Fitted with benchmarks/sim_fidelity.py --fit against
#: the seven healthy real vLLM 0.26.0 runs on one H200 (servetune-test-850m).
GPU_CALIBRATION: dict[str, dict[str, float]] = {
    # Fitted 400 Optuna TPE trials (seed 1) over the knobs of _fidelity.FIT_SPACE; rounded.
    "H200": {
        "mem_efficiency": 0.69, "kv_read_efficiency": 0.88, "compute_efficiency": 0.38,
        "step_overhead_s": 2.0e-3, "seq_overhead_s": 2.5e-6, "token_overhead_s": 40e-6,
        "request_overhead_s": 0.91e-3, "eager_layer_overhead_s": 500e-6, "compiled_layer_overhead_s": 690e-6,
    },
}


def calibration_for(gpu: GpuSpec) -> Calibration:
    """Defaults, then this module's fitted table, then ``gpu.calibration`` (the most specific wins)."""
    cal = Calibration().with_overrides(GPU_CALIBRATION.get(gpu.name, {}))
    extra = getattr(gpu, "calibration", None) or {}
    return cal.with_overrides(extra) if extra else cal


class PerfModel:
    """Seconds per engine step for one (model, GPU, engine config), with the constants precomputed.

    Example:
        >>> # perf = PerfModel(load_model("llama-3.1-8b"), get_gpu("H100"), config)
        >>> # perf.step_time(num_reqs=64, num_tokens=64, kv_context=64 * 1100, attn_work=64 * 1100,
        >>> #                decode_only=True)
    """

    def __init__(self, model: ModelProfile, gpu: GpuSpec, config: EngineConfig,
                 calibration: Calibration | None = None) -> None:
        cal = calibration if calibration is not None else calibration_for(gpu)
        self.calibration = cal
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.pp = pp
        layers = max(model.stage_layers(pp)) if pp > 1 else model.num_layers
        self.layers_per_stage = layers
        bw = gpu.hbm_gbps * 1e9
        weights = model.weight_bytes_per_gpu(tp, pp)
        kv_per_token = model.kv_bytes_per_token(tp, pp, config.kv_cache_dtype)
        # Seconds per unit, so a step is a handful of multiply-adds.
        self._t_weights = weights / (bw * cal.mem_efficiency)
        self._t_kv_read = kv_per_token / (bw * cal.kv_read_efficiency)
        self._t_kv_write = kv_per_token / (bw * cal.mem_efficiency)
        fp8 = (model.quantization or "").startswith("fp8") or "fp8" in (model.quantization or "")
        peak = (gpu.fp8_tflops if fp8 and gpu.fp8_tflops else gpu.bf16_tflops) * 1e12
        flops_rate = peak * cal.compute_efficiency
        active_per_gpu = model.active_param_count / (tp * pp)
        self._t_token_flops = 2.0 * active_per_gpu / flops_rate
        q_heads = max(1, model.num_attention_heads // tp)
        self._t_attn = 4.0 * q_heads * model.head_dim * layers / (gpu.bf16_tflops * 1e12 * cal.compute_efficiency)
        # Two all-reduces per layer of [tokens, hidden] activations (bf16) under TP.
        if tp > 1:
            link = gpu.interconnect_gbps * 1e9 * cal.interconnect_efficiency
            self._t_ar_fixed = 2 * layers * cal.allreduce_latency_s
            self._t_ar_token = 2 * layers * 2.0 * (tp - 1) / tp * model.hidden_size * 2 / link
        else:
            self._t_ar_fixed = self._t_ar_token = 0.0
        self.enforce_eager = config.enforce_eager
        self.capture_sizes: tuple[int, ...] = tuple(sorted(config.cudagraph_capture_sizes or ()))
        self.max_capture = self.capture_sizes[-1] if self.capture_sizes and not config.enforce_eager else 0
        self._graph_s = cal.graph_launch_s
        self._compiled_s = cal.compiled_layer_overhead_s * layers
        self._eager_s = cal.eager_layer_overhead_s * layers
        self._overlap = cal.async_overlap if config.async_scheduling else cal.sync_overlap
        self._step_cpu = cal.step_overhead_s
        self._seq_cpu = cal.seq_overhead_s
        self.request_overhead_s = cal.request_overhead_s
        self.token_overhead_s = cal.token_overhead_s

    def padded(self, num_tokens: int) -> int:
        """The CUDA graph size a batch of ``num_tokens`` runs as (itself above the largest size)."""
        if num_tokens > self.max_capture or not self.capture_sizes:
            return num_tokens
        return self.capture_sizes[bisect.bisect_left(self.capture_sizes, num_tokens)]

    def gpu_time(self, num_reqs: int, num_tokens: int, kv_context: int, attn_work: int,
                 decode_only: bool) -> float:
        """GPU seconds of one batch: roofline + communication + launch overhead (one stage x pp)."""
        micro = min(self.pp, max(1, num_reqs))
        # Per micro-batch on one stage; a stage holds 1/pp of the layers (its weights, KV, flops).
        if self.enforce_eager:
            launch = self._eager_s
            tokens = num_tokens
        elif num_tokens <= self.max_capture:
            tokens = self.padded(-(-num_tokens // micro)) * micro
            launch = self._graph_s if decode_only else self._compiled_s
        else:
            tokens = num_tokens
            launch = self._compiled_s
        # GEMMs and attention are different kernels: each is its own roofline, and they add up.
        gemm_mem = self._t_weights * micro
        gemm_comp = self._t_token_flops * tokens
        attn_mem = self._t_kv_read * kv_context + self._t_kv_write * num_tokens
        attn_comp = self._t_attn * attn_work
        stage_gpu = ((gemm_mem if gemm_mem > gemm_comp else gemm_comp)
                     + (attn_mem if attn_mem > attn_comp else attn_comp))
        comm = self._t_ar_fixed * micro + self._t_ar_token * tokens
        stage = stage_gpu + comm + launch * micro
        if self.pp == 1:
            return stage
        # ``micro`` micro-batches each cross pp stages; with fewer than pp of them the pipeline
        # never fills (the bubble): the step lasts pp stage-times of its micro-batches.
        return stage / micro * self.pp

    def step_time(self, num_reqs: int, num_tokens: int, kv_context: int, attn_work: int,
                  decode_only: bool) -> float:
        """Seconds of one engine step: GPU time plus the engine CPU that async scheduling leaves visible.

        ``kv_context``: sum over requests of the context the step attends to (KV read);
        ``attn_work``: sum over requests of tokens x context (causal attention FLOPs).
        """
        gpu = self.gpu_time(num_reqs, num_tokens, kv_context, attn_work, decode_only)
        cpu = self._step_cpu + self._seq_cpu * num_reqs
        hidden = cpu * self._overlap
        if hidden > gpu:
            hidden = gpu
        return gpu + cpu - hidden
