"""Step-time model of the simulated vLLM engine: per-kernel rooflines that scale with the model.

Contract: :class:`PerfModel` turns the shape of one scheduled batch (requests, tokens, the KV
context the decode requests read, the attention work of the prefill chunks) into the seconds one
engine step takes on the given GPU (vllm-internals.md §9). Pure arithmetic, no I/O, no randomness.

Why per kernel, not one efficiency: a constant fitted on one small model absorbs that model's
overheads, and a model ten times its size then runs on the wrong mix (the first H200 fit, on
0.85B runs, under-predicted 8B prefill throughput by 15-23%). Every term below is derived from the model's
shapes, so the same handful of constants serve 0.85B to 14B and beyond. One stage of one step is:

* **GEMMs**, four per layer on one TP rank (qkv, o, gate_up, down) plus the LM head on one row
  per scheduled request. Each is its own roofline, ``max(bytes / (hbm * mem_efficiency), flops /
  (peak * compute_efficiency * wave_fill))``: bytes are the weights plus the activations in and
  out, and ``wave_fill`` is the share of the GPU's SMs a grid of 128x256 output tiles keeps busy
  over its last wave. A 0.85B model's 2048-wide GEMMs waste more of the last wave than a 14B's
  5120-wide ones, and a 64-token decode batch fills one tile row in two: the efficiency depends on
  the GEMM's size through the tile grid, with no fitted curve.
* **Element-wise kernels** (fused add + RMSNorm twice, rotary embedding, SiLU-and-mul, residual):
  ``(10.5 * hidden + 3 * intermediate / tp) * 2 bytes`` per token per layer at ``mem_efficiency``.
  They are why a small model reaches a smaller share of its GEMM peak.
* **Attention**: decode requests stream their KV context (``kv_read_efficiency`` of HBM; an fp8
  cache its halved bytes at ``fp8_kv_read_efficiency``: vLLM 0.26's FlashAttention fp8 path served
  8B and 14B decode only 1-10% faster than bf16 on two H200 hosts, where halving the bytes at the
  bf16 rate predicted 13-22%); prefill chunks do ``4 * q_heads * head_dim * sum(tokens x
  context)`` FLOPs (causal) at ``attn_efficiency`` of the dense peak (FlashAttention-3 does not
  reach the GEMM rate; on Hopper its rate rises with the context towards ``attn_long_efficiency``,
  ``PerfModel._prefill_attention``), and write their new KV.
* **Launch costs**: a decode-only batch up to the largest capture size replays one FULL CUDA graph
  (``graph_launch_s``), padded to the next capture size, and pays ``full_graph_layer_s`` per layer:
  inside a graph nothing is launched, but each of a layer's ~10 kernels still fills and drains the
  GPU. The H200 host ``2026-12-02b``'s closed-loop decode steps (8B and 14B at 32-128 in flight, TPOT against
  batch) sat 0.85 ms (8B) and 1.38 ms (14B) above the 2026-12-02 model's bytes: 27-29 us a layer,
  or 0.05 ms per GB of weights, so layers and weight bytes tell it apart poorly. The 2026-12-03
  fit put it in the weights' HBM efficiency (0.79, from 0.92) and left this term near zero. A
  mixed batch runs PIECEWISE graphs with attention launched between the pieces
  (``piecewise_layer_s`` per layer), and a batch above the largest capture size runs compiled
  without graphs (``compiled_layer_overhead_s`` per layer); both add to the batch's GPU work. (A
  per-token-per-layer cost of batches outside a FULL graph stood here until 2026-12-02: fitted
  where the 8B/14B windows were API-server bound by a short tokenizer and the 0.85B windows by the
  API server itself, it slowed every 8B/14B prefill step for what the front end did; see the API
  server below.) ``enforce_eager`` launches every kernel from Python, one thread doing the
  launches, the scheduling and the input preparation: the GEMMs and element-wise kernels hide the
  launches (``layers * eager_layer_overhead_s``, times the host's CPU factor) only as far as their
  GPU time reaches, the attention kernels add to it, and none of the engine CPU hides. Read off the
  H200 host ``2026-12-04h`` (``tests/fixtures/real_h200/scale/2026-12-04h_l8b_*``, 8B, the median
  gap between streamed tokens): 14.8 ms a decode step at 4 in flight, 16.9 ms at 128 with
  256-1,280-token contexts, 31.5 ms at 256 with ~1,150-token ones, where CUDA graphs took 18.7 ms
  and the GPU's own work is 16.4 ms, 10.3 of it attention (the ``2026-12-04e`` host's profiled eager
  steps of that batch); a 24B decode step at 128 in flight with short contexts, GEMM-bound,
  22.6 ms against 16.6 ms of GPU work (the ``2026-12-04g`` host's trace of that load). The whole step's work
  hiding the launches (the rule until then) ran that host's prefill-heavy eager windows 12-28% fast.
  Outside a FULL graph the engine thread also launches what no graph holds, and a gated-delta-net
  hybrid's or a shared-expert MoE's forward can outlast its kernels: a step lasts at least
  :meth:`PerfModel.forward_cpu_s` (its mixers run eagerly, its MoE pieces above the largest capture
  size, a hybrid prefill's preparation; read off a profiler trace of the Qwen3.5-35B-A3B shape on an
  H100, whose 8,192-token mixed steps ran 77 ms of kernels in a ~109 ms period), plus the engine CPU
  where one GPU runs the forward on the engine core's thread.
* TP adds two all-reduces per layer: ``latency + 2 (tp-1)/tp * activation bytes / bandwidth``, both
  by the host's interconnect (:func:`servetune.planner.comm.allreduce_cost`: NVLink and PCIe with
  P2P at the calibrated knobs and the link's rate; without GPU P2P, NCCL's SHM path through host
  memory at its published figures, where the step's all-gather of the sampled rows' logits is
  priced too). ``disable_custom_all_reduce`` moves the path to NCCL where vLLM's custom all-reduce would
  run, at the same calibrated cost, and the trial says so
  (:func:`servetune.planner.comm.nccl_small_message_note`). At TP=8 on Hopper, where the server runs with
  vLLM's symmetric memory and multicast live (vLLM's defaults, ``comm_env``; not servetune's launches), each
  micro-batch's all-reduces are priced by their message from published timings instead
  (:func:`servetune.planner.comm.allreduce_table`: the custom all-reduce below 256 KiB, multimem below 64 MiB,
  NCCL above); at TP=2 and TP=4 there only the messages vLLM sends through NCCL (from 64 and 32 MiB), at the
  TP=8 timings' bus bandwidth.
* The sampler beyond greedy (:mod:`servetune.sim.sampling`): a request that samples (a published
  ``vllm bench serve`` from 0.15.0 sends no temperature, so the model's generation config holds)
  moves its counted bytes per vocabulary entry over the whole vocabulary, each step, at the GPU
  table's bandwidth, and the step pays the sampler's extra eager launches. Every calibration window
  was greedy, so greedy requests pay nothing here; a version whose sampling path was not read
  pays nothing either (``PerfModel.sampler_path`` says so).
* Under ``--enable-expert-parallel`` (``EngineConfig.expert_parallel_size``: ``tp x dp``) each GPU runs its own
  whole experts for uniform routing's share of the routed rows (:func:`servetune.sim.perf_classes.moe_shape`);
  at DP=1 no token moves, under DP the same all-gather and reduce-scatter as below (vLLM's default all2all
  backend, ``allgather_reducescatter``).
* DP replicas of a MoE model (``EngineConfig.data_parallel_size``, without expert parallelism) share
  their routed experts: vLLM splits each expert over all ``tp x dp`` GPUs and each MoE layer runs every
  replica's tokens (:func:`servetune.sim.perf_classes.moe_parallel_size`,
  :func:`~servetune.sim.perf_classes.moe_step_tokens`: first order, the replicas under the same load, so
  a step's MoE runs ``dp`` times the replica's tokens), between an all-gather of the hidden states and
  router logits over the DP group and a reduce-scatter of the output, priced by the interconnect
  (``_perf_comm``). Attention and the dense GEMMs stay per replica; a dense model's replicas are
  independent engines.
* PP splits the layers; up to ``pp`` micro-batches are in flight, so a step costs
  ``pp * stage_time(batch / microbatches)`` (a lone request still pays every stage: the bubble),
  and each micro-batch's hidden states and residual cross ``pp - 1`` boundaries by NCCL
  send/recv, priced by the interconnect as the all-reduce is
  (:func:`servetune.planner.comm.sendrecv_cost`).
* CPU: the engine core spends ``step_overhead_s`` per step plus ``seq_overhead_s`` per scheduled
  request (schedule, prepare inputs, sample); async scheduling hides most of it behind the GPU.
* The API server (and the client) is one more serial stage: one asyncio loop on one core,
  modelled by :mod:`servetune.sim.frontend`. ``request_overhead_s`` plus ``prompt_token_overhead_s``
  per prompt token for each incoming request before it reaches the engine, spread over
  ``api_intake_passes`` passes of the loop (its awaits), each behind the output work that became
  ready meanwhile; ``token_overhead_s`` per streamed output token (detokenize, SSE), of which
  ``api_chunk_share`` is paid once per SSE chunk: a loop that fell behind drains every queued
  step at once and each request's chunk carries all its merged tokens (vLLM's
  RequestOutputCollector), so the backlog stays about one drain deep. The real H200 windows
  measure the CPU directly: vLLM's API server process (``process_cpu_seconds_total`` over the
  window) was 90-97% busy on one core in every 0.85B window at 64-256 in flight, which all served
  14.7-16.9k tok/s whatever their batch (55-60 CPU-us per streamed token), and in the 8B
  decode-heavy window (12.8k tok/s); 8B/14B prefill-heavy windows left it 30-60% busy. The engine
  never waits for it, but clients see tokens when it gets to them: with hundreds of open streams
  it, not the GPU, sets the TPOT and the throughput. The clients also show its merging: the 8B
  windows at 128 in flight received 0.52-0.87 SSE chunks per token.
  That CPU is the host's as much as the load's: the 8B/14B windows of four H200 hosts paid 1.1-2.2x
  the modelled API CPU over the same windows, and within one host 1.25-2.06 (decode-heavy loads
  with few tokens per engine step paying the most: the model has no per-step term).
  ``api_cpu_factor`` scales all four costs, and ``enforce_eager``'s launch floor (the engine's
  Python launching kernels on the same host's CPU); measured on one real window of a host
  (:func:`servetune.sim.host_cpu.host_api_cpu_factor`), it carries the host's level to its other loads.

The knobs live in :class:`Calibration`; a :class:`~servetune.gpus.GpuSpec` may override any of them
through its ``calibration`` mapping, and :data:`GPU_CALIBRATION` holds the values fitted to real
runs (``benchmarks/sim_fidelity.py`` fits them and prints the held-out comparison).

This module is the face of the model: :class:`PerfModel` computes every term once (``__init__``,
through its parts' ``_init_*`` methods) and sums a step (:meth:`PerfModel.gpu_cost`: launches, PP,
the sampler; :meth:`PerfModel.step_time`: the engine CPU), and the other names are imported from
here. The terms are priced in the package's private modules, each a mixin class of ``PerfModel``
(declaring the terms it reads and does not set): the GEMMs and their tile grid in ``_perf_gemm``,
attention in ``_perf_attention``, TP and PP communication in ``_perf_comm``, a hybrid's recurrent
layers in ``_perf_recurrent``, the API server's and the client's CPU in ``_perf_api_server``; the
knobs and the fitted tables in ``_calibration``.

Example:
    >>> from servetune.sim.perf import Calibration
    >>> Calibration().with_overrides({"step_overhead_s": 0.001}).step_overhead_s
    0.001
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import TYPE_CHECKING

from servetune.planner.model_memory import effective_model
from servetune.sim import perf_classes
from servetune.sim._calibration import (FA2_KNOBS, GPU_CALIBRATION, GPU_FAMILY_OVERRIDES, Calibration, calibration_for,
                                        runs_flash_attention_2, with_calibration)
from servetune.sim._moe_tiles import BOOST_CLOCK_MHZ
from servetune.sim._perf_api_server import ApiServerCosts
from servetune.sim._perf_attention import AttentionTerms
from servetune.sim._perf_comm import CommTerms
from servetune.sim._perf_gemm import DEFAULT_SMS, GemmTerms, moe_tile_share, wave_fill
from servetune.sim._perf_recurrent import RecurrentTerms
from servetune.sim.host_cpu import GDN_MIXERS, SHARED_MOE_PIECES
from servetune.sim.sampling import KERNELS_PER_LAYER, runs_v2_sampler, sampler_pass, triton_mask_seconds
from servetune.workload import GREEDY, Sampling

if TYPE_CHECKING:
    from servetune.planner.comm import CommEnv
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.engine_config import EngineConfig
    from servetune.planner.modelinfo import ModelProfile
    from servetune.sim import perf_hybrid

__all__ = ["Calibration", "FA2_KNOBS", "GPU_CALIBRATION", "GPU_FAMILY_OVERRIDES", "PerfModel", "runs_flash_attention_2", "StepCost", "calibration_for", "moe_tile_share",
           "with_calibration", "wave_fill"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepCost:
    """GPU seconds of one engine step by kind of kernel, as a profiler trace separates them.

    ``gemm``: the layers' four GEMMs and the LM head (with their activations' traffic);
    ``elementwise``: norms, rotary, SiLU-and-mul, residual adds (Inductor's fused Triton kernels);
    ``attention``: decode KV reads and prefill attention; ``kv_write``: the new tokens' KV;
    ``comm``: TP all-reduces and PP sends; ``launch``: what launching costs beyond the kernels (CUDA-graph
    replay, piecewise and compiled-layer floors, an eager step's launch-bound excess); ``sampler``: what
    sampling beyond greedy adds (:mod:`servetune.sim.sampling`; 0 for greedy requests); ``recurrent``: a
    hybrid's Mamba / gated-delta-net layers beyond their GEMMs (:mod:`servetune.sim.perf_hybrid`: state
    reads and writes, conv1d, the chunked scan; 0 for other models).
    """

    gemm: float
    elementwise: float
    attention: float
    kv_write: float
    comm: float
    launch: float
    sampler: float = 0.0
    recurrent: float = 0.0

    @property
    def seconds(self) -> float:
        return (self.gemm + self.elementwise + self.attention + self.kv_write + self.comm + self.launch + self.sampler
                + self.recurrent)


class PerfModel(GemmTerms, AttentionTerms, CommTerms, RecurrentTerms, ApiServerCosts):
    """Seconds per engine step for one (model, GPU, engine config), with the constants precomputed.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.memory import resolve_engine_config
        >>> from servetune.planner.modelinfo import load_model
        >>> model, gpu = load_model("llama-3.1-8b"), get_gpu("H200")
        >>> perf = PerfModel(model, gpu, resolve_engine_config({}, model, gpu))
        >>> decode = perf.step_time(num_reqs=64, num_tokens=64, kv_context=64 * 1100, attn_work=64 * 1100,
        ...                         decode_only=True)
        >>> 0.004 < decode < 0.012
        True
    """

    def __init__(self, model: ModelProfile, gpu: GpuSpec, config: EngineConfig,
                 calibration: Calibration | None = None, sampling: Sampling | None = None,
                 comm_env: CommEnv | None = None) -> None:
        cal = calibration if calibration is not None else calibration_for(gpu)
        self.calibration = cal
        model = effective_model(model, config)  # the model as served: --dtype, online --quantization fp8
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.pp = pp
        layers = max(model.stage_layers(pp)) if pp > 1 else model.num_layers
        self.layers_per_stage = layers
        bw = gpu.hbm_gbps * 1e9
        mem_rate = bw * cal.mem_efficiency
        fp8 = "fp8" in (model.quantization or "")
        peak = (gpu.fp8_tflops if fp8 and gpu.fp8_tflops else gpu.bf16_tflops) * 1e12
        self._sms = int(getattr(gpu, "sm_count", 0) or DEFAULT_SMS)
        self._flop_rate = peak * cal.compute_efficiency
        wbytes = model.weight_bytes_per_param
        # The layer's GEMMs on one TP rank as (N, K, weight bytes): the output width sets the tile grid.
        d, hd = model.hidden_size, model.head_dim
        q = model.q_size // tp
        kv = model.kv_heads_per_gpu(tp) * hd
        per_layer_active = model._layer_linear_params(tp, active_only=True)
        dense_mlp = per_layer_active - d * (2 * q + 2 * kv)
        inter = max(1, dense_mlp // (3 * d))  # dense FFN width per rank (MoE: the active experts')
        gemms = [(q + 2 * kv, d), (d, q), (2 * inter, d), (d, inter)]
        self._gemms = [(n, k, n * k * wbytes * layers / mem_rate, 2.0 * n * k * layers) for n, k in gemms]
        self._act_bytes_token = sum(2.0 * (n + k) for n, k in gemms) * layers / mem_rate
        self._elementwise_token = (10.5 * d + 3.0 * inter) * 2.0 * layers / mem_rate
        # The LM head: last stage, one row per scheduled request (logits only where vLLM samples), vocab split over TP.
        vocab = -(-model.vocab_size // tp)
        self._head = (vocab, d, vocab * d * wbytes / mem_rate, 2.0 * vocab * d)
        self._moe: perf_classes.MoeShape | None = None
        self._moe_dp = dp = max(1, config.data_parallel_size)
        rules = cal.class_rules >= 0.5
        self._version = config.version
        if (rules and perf_classes.is_class_model(model)) or model.is_hybrid:
            self._init_classes(model, gpu, tp, layers, mem_rate, cal, dp, config.expert_parallel_size(model.is_moe))
        # A hybrid's recurrent layers (perf_hybrid): attention, its fixed cost and the graph pieces by mixer.
        hybrid = self._init_hybrid(model, gpu, config, tp, layers, mem_rate, cal)
        attn_layers = hybrid.attention_layers if hybrid else layers
        mixer_layers = hybrid.mixer_layers if hybrid else layers
        kv_per_token = model.kv_bytes_per_token(tp, pp, config.kv_cache_dtype)
        fp8_kv = str(config.kv_cache_dtype or "").startswith("fp8")
        self._t_kv_read = kv_per_token / (bw * (cal.fp8_kv_read_efficiency if fp8_kv else cal.kv_read_efficiency))
        # Sliding-window layers read at most ``window`` tokens of a request (perf_classes): their share
        # of the KV read moves to a per-request term capped at the window.
        slide = perf_classes.sliding_kv_share(model, layers) if cal.class_rules >= 0.5 else 0.0
        self._window = model.sliding_window if slide else 0
        self._t_kv_read_slide = self._t_kv_read * slide
        self._t_kv_read -= self._t_kv_read_slide
        self._t_kv_write = kv_per_token / (bw * cal.kv_write_efficiency if cal.kv_write_efficiency > 0 else mem_rate)
        self._t_attn_layer = cal.attn_layer_s * mixer_layers
        self._blend = cal.gemm_blend_exponent
        self._token_tile = int(cal.gemm_token_tile)
        q_heads = max(1, model.num_attention_heads // tp)
        attn_eff = cal.attn_efficiency
        if rules and perf_classes.runs_triton_attention(model, gpu):
            attn_eff = cal.triton_attn_efficiency or perf_classes.TRITON_ATTN_EFFICIENCY or attn_eff
        self._t_attn = 4.0 * q_heads * hd * attn_layers / (gpu.bf16_tflops * 1e12 * attn_eff)
        # FlashAttention-3's rate rises with the context a query block loops over (_prefill_attention):
        # vLLM runs FA3 on compute capability 9.x only (fa_utils.get_flash_attn_version), and only
        # where attention is not on TRITON_ATTN.
        long_eff = cal.attn_long_efficiency
        self._attn_long_k, self._attn_long_ratio = 0.0, 1.0
        if long_eff > attn_eff and 9.0 <= gpu.compute_capability < 10.0 and attn_eff == cal.attn_efficiency:
            self._attn_long_k = cal.attn_fit_context * (long_eff / attn_eff - 1.0)
            self._attn_long_ratio = attn_eff / long_eff
        self._t_mla_context = 0.0
        if rules and model.mla_kv_lora_rank:
            self._init_mla(model, q_heads, layers, gpu.bf16_tflops * 1e12 * attn_eff)
        self._t_attn_slide = self._t_attn * slide
        self._t_attn -= self._t_attn_slide
        self._init_comm(model, gpu, tp, pp, layers, cal,
                        allreduces=hybrid.mixer_layers + hybrid.ffn_layers if hybrid else 2 * layers,
                        custom_all_reduce=not config.disable_custom_all_reduce,
                        dp=dp, moe_layers=self._moe.layers if self._moe is not None else 0,
                        comm_env=comm_env, version=config.version)
        self._init_sampler(model, gpu, config, cal, sampling or GREEDY)
        self.enforce_eager = config.enforce_eager
        self.capture_sizes: tuple[int, ...] = tuple(sorted(config.cudagraph_capture_sizes or ()))
        self.max_capture = self.capture_sizes[-1] if self.capture_sizes and not config.enforce_eager else 0
        self._graph_s = cal.graph_launch_s + cal.full_graph_layer_s * layers
        self._piecewise_floor = cal.piecewise_layer_s * mixer_layers
        self._compiled_floor = cal.compiled_layer_overhead_s * layers
        self._init_forward_cpu(model, hybrid, cal, tp * pp)
        self._eager_cpu_bound = cal.eager_cpu_bound >= 0.5
        # Launching is CPU work on the host, as the API server's is: the same factor.
        self._eager_floor = cal.eager_layer_overhead_s * layers * (cal.api_cpu_factor if self._eager_cpu_bound else 1.0)
        self._overlap = cal.async_overlap if config.async_scheduling else cal.sync_overlap
        self.schedule_ahead = bool(cal.schedule_ahead >= 0.5 and config.async_scheduling)
        # Under async scheduling a step after an idle GPU has nothing to hide its CPU behind
        # (Calibration.idle_step_cpu); without it every step's CPU is serial alike.
        self.idle_step_cpu = bool(cal.idle_step_cpu >= 0.5 and config.async_scheduling)
        self.resume_hits = cal.resume_hits >= 0.5
        self._step_cpu, self._seq_cpu = cal.step_overhead_s, cal.seq_overhead_s
        self._init_api_server(model, config, cal)
        # _gemm_time is a pure function of (tokens, rows) here, and a trial's steps repeat the same
        # few batch shapes thousands of times (decode steps of one batch size, full token budgets):
        # remembered, the tile-grid search runs once per shape instead of once per step.
        self._gemm_memo: dict[tuple[int, int], float] = {}

    def _init_sampler(self, model: ModelProfile, gpu: GpuSpec, config: EngineConfig, cal: Calibration,
                      sampling: Sampling) -> None:
        """The sampler's cost beyond greedy (:mod:`servetune.sim.sampling`): ``sampler_row_s`` per sampled
        row (its counted bytes per vocabulary entry over the whole vocabulary, which every TP rank samples
        after the logits' all-gather, at the GPU table's memory bandwidth: no fitted efficiency) and
        ``sampler_step_s`` per step (its extra launches, run eagerly after the forward's CUDA graph, each
        a compiled layer's launch cost, ``compiled_layer_overhead_s``, over its ~10 kernels). Both 0 for
        greedy requests and where the version's sampling path was not counted
        (:attr:`sampler_path` says which)."""
        version = config.version
        v2 = runs_v2_sampler(version, model.architecture, v1_runner=config.v1_runner,
                             dense=not model.is_moe and not model.quantization)
        spass = sampler_pass(sampling, version, gpu.compute_capability, v2_runner=v2)
        #: The sampling path priced ("greedy", a V1 path), or why none is ("... not counted").
        self.sampler_path = spass.path if spass is not None else (
            f"{'V2' if v2 else 'V1'} runner at vLLM {config.vllm_version}: not counted, not priced")
        self.sampler_row_s = spass.bytes_per_logit * model.vocab_size / (gpu.hbm_gbps * 1e9) if spass else 0.0
        self.sampler_step_s = spass.kernels * cal.compiled_layer_overhead_s / KERNELS_PER_LAYER if spass else 0.0
        self._sampler_triton = bool(spass and spass.triton_mask)
        self._sampler_gpu = (model.vocab_size, gpu.sm_count or DEFAULT_SMS, BOOST_CLOCK_MHZ.get(gpu.name))

    def _init_forward_cpu(self, model: ModelProfile, hybrid: perf_hybrid.HybridShape | None, cal: Calibration,
                          workers: int) -> None:
        """The terms of :meth:`forward_cpu_s` (all 0 but for gated-delta-net hybrids and MoE blocks with a
        shared expert)."""
        gdn = hybrid if hybrid is not None and hybrid.kind == "gdn" else None
        self._gdn_mixer_cpu = cal.gdn_mixer_cpu_s * gdn.mamba_layers if gdn else 0.0
        self._prefill_request_cpu = cal.gdn_prefill_request_cpu_s if gdn else 0.0
        self._prefill_token_cpu = cal.gdn_prefill_token_cpu_s if gdn else 0.0
        shared = self._moe if self._moe is not None and model.shared_expert_intermediate_size > 0 else None
        self._moe_piece_cpu = cal.shared_moe_piece_cpu_s * shared.layers if shared else 0.0
        # One GPU: vLLM's UniProcExecutor runs the forward on the engine core's own thread, after its
        # scheduling (Calibration.idle_step_cpu); with several, each worker launches in its own process.
        self._forward_on_core = workers == 1

    def forward_cpu_s(self, num_reqs: int, num_tokens: int, prefill_tokens: int, decode_only: bool) -> float:
        """The engine thread's CPU that a step's own forward needs outside a FULL CUDA graph, beyond the
        launch floors the step's GPU time holds: a gated delta net's mixers run eagerly (graph-splitting ops),
        a step above the largest capture size launches its MoE pieces from Python, and a hybrid's step with
        ``prefill_tokens`` of prefill prepares more around its forward than the engine CPU charges
        (``Calibration.gdn_mixer_cpu_s`` and the terms beside it). 0 for a decode batch replayed as one
        graph, under ``enforce_eager`` (its own launch floor) and for the models none of these concern.
        :meth:`step_time` lasts at least this, plus the engine CPU where one GPU runs the forward on the
        engine core's thread.

        Example (Qwen3-Next on one H200: 512 decodes in a graph, then 8 prefills filling an 8,192-token budget):
            >>> from servetune.planner.gpus import get_gpu
            >>> from servetune.planner.memory import resolve_engine_config
            >>> from servetune.planner.modelinfo import load_model
            >>> m, g = load_model("qwen3-next-80b-a3b"), get_gpu("H200")
            >>> perf = PerfModel(m, g, resolve_engine_config({"max_num_batched_tokens": 8192}, m, g))
            >>> round(1e3 * perf.forward_cpu_s(512, 512, 0, True), 1), round(1e3 * perf.forward_cpu_s(8, 8192, 8192, False), 1)
            (0.0, 192.5)
        """
        if self.enforce_eager or (decode_only and num_tokens <= self.max_capture):
            return 0.0
        cpu = self._gdn_mixer_cpu + (self._moe_piece_cpu if num_tokens > self.max_capture else 0.0)
        if prefill_tokens:
            cpu += self._prefill_request_cpu * num_reqs + self._prefill_token_cpu * prefill_tokens
        return cpu

    def padded(self, num_tokens: int) -> int:
        """The CUDA graph size a batch of ``num_tokens`` runs as (itself above the largest size)."""
        if num_tokens > self.max_capture or not self.capture_sizes:
            return num_tokens
        return self.capture_sizes[bisect.bisect_left(self.capture_sizes, num_tokens)]

    def gpu_cost(self, num_reqs: int, num_tokens: int, kv_context: int, attn_work: int,
                 decode_only: bool, prefill_tokens: int | None = None, prefill_context: int = 0,
                 prefill_attn_work: int | None = None) -> StepCost:
        """GPU seconds of one batch by kind of kernel (one stage, one micro-batch's share summed).

        ``kv_context``: sum over requests of the context the step attends to; ``attn_work``: sum
        of tokens x context. ``prefill_*`` say how much of each belongs to prefill chunks (the
        rest is decode, one token per request); left out, a decode-only batch is all decode and a
        mixed one all prefill. :meth:`gpu_time` is this record's ``seconds``; the kinds are what a
        profiler trace of a real step separates (``benchmarks/steps_vs_sim.py``).
        """
        if prefill_tokens is None:
            prefill_tokens = 0 if decode_only else num_tokens
            prefill_context = 0 if decode_only else kv_context
            prefill_attn_work = 0 if decode_only else attn_work
        elif prefill_attn_work is None:
            prefill_attn_work = attn_work
        micro = min(self.pp, max(1, num_reqs))
        # Per micro-batch on one stage; a stage holds 1/pp of the layers (its weights, KV, flops).
        if self.enforce_eager:
            floor = self._eager_floor
            tokens = num_tokens
            graph = 0.0
        elif num_tokens <= self.max_capture:
            tokens = self.padded(-(-num_tokens // micro)) * micro
            floor = 0.0 if decode_only else self._piecewise_floor
            graph = self._graph_s if decode_only else 0.0
        else:
            tokens = num_tokens
            floor = self._compiled_floor
            graph = 0.0
        per_micro = -(-tokens // micro)
        rows = -(-num_reqs // micro)
        gemm = self._gemm_time(per_micro, rows) * micro
        elementwise = self._elementwise_token * tokens
        decode_context = kv_context - prefill_context
        attention = (self._t_kv_read * (decode_context if decode_context > 0 else 0)
                     + self._prefill_attention(prefill_tokens, prefill_attn_work) + self._t_attn_layer * micro)
        if self._t_mla_context and prefill_context > prefill_tokens:
            attention += self._t_mla_context * (prefill_context - prefill_tokens)  # MLA: the chunks' earlier context
        if self._window:
            attention += self._sliding_attention(num_tokens - prefill_tokens, decode_context, prefill_tokens,
                                                 prefill_context, prefill_attn_work)
        kv_write = self._t_kv_write * num_tokens
        decode_reqs = num_tokens - prefill_tokens
        recurrent = self.recurrent_seconds(decode_reqs, num_reqs - decode_reqs, prefill_tokens)
        comm = ((self._t_ar_fixed + self._t_pp_fixed + self._t_gather_fixed + self._t_dp_fixed) * micro
                + (self._t_ar_token + self._t_pp_token + self._t_dp_token) * tokens + self._t_gather_row * rows * micro
                + self.allreduce_table_seconds(per_micro, micro))
        if self.enforce_eager:
            # Python launches every kernel: the GEMMs and the small kernels cover the launches as
            # far as their GPU time reaches; the attention kernels do not (module docstring).
            covering = gemm + elementwise + kv_write + comm + (0.0 if self._eager_cpu_bound else attention)
            launch = floor * micro - covering if floor * micro > covering else 0.0
        else:
            launch = (floor + graph) * micro
        # ``micro`` micro-batches each cross pp stages; with fewer than pp of them the pipeline
        # never fills (the bubble): the step lasts pp stage-times of its micro-batches.
        scale = 1.0 if self.pp == 1 else self.pp / micro
        # The sampler: every scheduled request's row (a partial prefill's too: V1 samples and discards it),
        # once per micro-batch on the last stage.
        sampler = self.sampler_row_s * rows * micro + self.sampler_step_s * micro if self.sampler_row_s else 0.0
        if self._sampler_triton:
            sampler += triton_mask_seconds(rows, *self._sampler_gpu) * micro
        return StepCost(gemm * scale, elementwise * scale, attention * scale, kv_write * scale, comm * scale,
                        launch * scale, sampler * scale, recurrent * scale)

    def gpu_time(self, num_reqs: int, num_tokens: int, kv_context: int, attn_work: int,
                 decode_only: bool, prefill_tokens: int | None = None, prefill_context: int = 0,
                 prefill_attn_work: int | None = None) -> float:
        """GPU seconds of one batch: kernel rooflines + communication + launch costs (x pp).

        Arguments as :meth:`gpu_cost`, whose kinds this sums.
        """
        return self.gpu_cost(num_reqs, num_tokens, kv_context, attn_work, decode_only, prefill_tokens,
                             prefill_context, prefill_attn_work).seconds

    def engine_cpu_s(self, num_reqs: int) -> float:
        """The engine core's CPU of one step of ``num_reqs`` requests (``step_overhead_s`` plus
        ``seq_overhead_s`` a request: scheduling, input preparation, the sampler's bookkeeping), the
        CPU :meth:`step_time` adds before hiding what async scheduling overlaps.

        Example:
            >>> from servetune.planner.gpus import get_gpu
            >>> from servetune.planner.memory import resolve_engine_config
            >>> from servetune.planner.modelinfo import load_model
            >>> model, gpu = load_model("servetune-test-850m"), get_gpu("H200")
            >>> perf = PerfModel(model, gpu, resolve_engine_config({}, model, gpu))
            >>> perf.engine_cpu_s(2) > perf.engine_cpu_s(1) > 0
            True
        """
        return self._step_cpu + self._seq_cpu * num_reqs

    def step_time(self, num_reqs: int, num_tokens: int, kv_context: int, attn_work: int,
                  decode_only: bool, prefill_tokens: int | None = None, prefill_context: int = 0,
                  prefill_attn_work: int | None = None, gpu_idle: bool = False) -> float:
        """Seconds of one engine step: GPU time plus the engine CPU that async scheduling leaves visible.

        Arguments as :meth:`gpu_time`; ``gpu_idle``: the GPU had no step of its own when this one
        was scheduled, so under async scheduling none of its CPU hides (``Calibration.idle_step_cpu``).
        """
        gpu = self.gpu_time(num_reqs, num_tokens, kv_context, attn_work, decode_only,
                            prefill_tokens, prefill_context, prefill_attn_work)
        cpu = self.engine_cpu_s(num_reqs)
        # Under enforce_eager the thread that schedules and prepares the next step is the one
        # launching this step's kernels: none of it hides. After an idle GPU there is no step
        # before whose kernels it could hide behind.
        exposed = (self.enforce_eager and self._eager_cpu_bound) or (gpu_idle and self.idle_step_cpu)
        hidden = 0.0 if exposed else cpu * self._overlap
        if hidden > gpu:
            hidden = gpu
        step = gpu + cpu - hidden
        # A forward whose launches outlast its GPU work sets the step (forward_cpu_s).
        floor = self.forward_floor_s(num_reqs, num_tokens, prefill_tokens, decode_only)
        return floor if floor > step else step

    def forward_floor_s(self, num_reqs: int, num_tokens: int, prefill_tokens: int | None, decode_only: bool) -> float:
        """The least a step lasts by its forward's CPU: :meth:`forward_cpu_s`, plus the engine CPU where one GPU
        runs the forward on the engine core's thread; 0 where the forward needs no CPU beyond its launch floors.
        :meth:`step_time` is the larger of this and the step's GPU time with its visible engine CPU, so a step
        lasting exactly this long was paced by the CPU (``SimScheduler.forward_bound_s`` counts those).
        ``prefill_tokens`` None: every token of a step that is not ``decode_only`` (as :meth:`gpu_cost`)."""
        if prefill_tokens is None:
            prefill_tokens = 0 if decode_only else num_tokens
        forward = self.forward_cpu_s(num_reqs, num_tokens, prefill_tokens, decode_only)
        if not forward:
            return 0.0
        return forward + self.engine_cpu_s(num_reqs) if self._forward_on_core else forward

    @property
    def forward_priced(self) -> bool:
        """Whether any step of this model can be paced by its forward's CPU (:meth:`forward_cpu_s` not always 0)."""
        return bool(self.forward_cpu_parts)

    @property
    def forward_cpu_parts(self) -> tuple[str, ...]:
        """What :meth:`forward_cpu_s` charges this model for (empty: nothing): ``host_cpu.GDN_MIXERS`` (launched
        eagerly in every step outside a FULL graph, with the prefill's preparation) and ``host_cpu.SHARED_MOE_PIECES``
        (launched from Python above the largest capture size)."""
        if self.enforce_eager:
            return ()
        gdn = self._gdn_mixer_cpu or self._prefill_request_cpu or self._prefill_token_cpu  # the prefill's preparation too
        return tuple(name for name, cpu in ((GDN_MIXERS, gdn), (SHARED_MOE_PIECES, self._moe_piece_cpu)) if cpu)
