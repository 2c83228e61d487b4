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
* TP adds two all-reduces per layer: ``latency + 2 (tp-1)/tp * activation bytes / bandwidth``, both
  by the host's interconnect (:func:`servetune.planner.comm.allreduce_cost`: NVLink and PCIe with
  P2P at the calibrated knobs and the link's rate; without GPU P2P, NCCL's SHM path through host
  memory at its published figures, where the step's all-gather of the sampled rows' logits is
  priced too). ``disable_custom_all_reduce`` moves the path to NCCL where vLLM's custom all-reduce would
  run, at the same calibrated cost, and the trial says so
  (:func:`servetune.planner.comm.nccl_small_message_note`).
* The sampler beyond greedy (:mod:`servetune.sim.sampling`): a request that samples (a published
  ``vllm bench serve`` from 0.15.0 sends no temperature, so the model's generation config holds)
  moves its counted bytes per vocabulary entry over the whole vocabulary, each step, at the GPU
  table's bandwidth, and the step pays the sampler's extra eager launches. Every calibration window
  was greedy, so greedy requests pay nothing here; a version whose sampling path was not read
  pays nothing either (``PerfModel.sampler_path`` says so).
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

Example:
    >>> from servetune.sim.perf import Calibration
    >>> Calibration().with_overrides({"step_overhead_s": 0.001}).step_overhead_s
    0.001
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from servetune.errors import SpecError, did_you_mean
from servetune.planner.comm import allreduce_cost, sendrecv_cost
from servetune.planner.model_memory import effective_model
from servetune.planner.vllm_rules import memory_rules
from servetune.planner.hybrid import mamba_ssm_dtype_bytes
from servetune.sim import perf_classes, perf_hybrid
from servetune.sim.chat_templates import chat_template_parse_share
from servetune.sim.sampling import KERNELS_PER_LAYER, runs_v2_sampler, sampler_pass
from servetune.workload import GREEDY, Sampling

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.engine_config import EngineConfig
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["Calibration", "FA2_KNOBS", "GPU_CALIBRATION", "GPU_FAMILY_OVERRIDES", "PerfModel", "runs_flash_attention_2", "StepCost", "calibration_for", "moe_tile_share",
           "with_calibration", "wave_fill"]

#: Output tiles a Hopper bf16 GEMM can run with, and the share of the large tile's rate each
#: reaches (smaller tiles reuse less of what they load): the wave-quantisation model of wave_fill.
_TILES: tuple[tuple[int, int, float], ...] = ((128, 256, 1.0), (128, 128, 0.9), (64, 128, 0.75), (64, 64, 0.5))
#: Models whose chat vLLM renders with Harmony (``OpenAIServingChat.use_harmony``: model type
#: gpt_oss), never with a Jinja chat template.
HARMONY_ARCHITECTURES: frozenset[str] = frozenset({"GptOssForCausalLM"})
#: SMs when the GPU table has none: an H100 / H200 SXM.
DEFAULT_SMS = 132
#: Batch shapes PerfModel remembers the GEMM time of (a few MB at most).
_GEMM_MEMO_MAX = 1 << 16


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Simulator constants.

    The defaults are the values fitted on the real H200 (see :data:`GPU_CALIBRATION`): a GPU
    without its own measurements inherits them, so GPUs compare by their datasheet bandwidth and
    FLOP/s, and host-side costs (a property of vLLM's CPU path, not of the GPU) stay the same.
    """

    mem_efficiency: float = 0.7884  # fraction of HBM bandwidth reached streaming weights / activations
    kv_read_efficiency: float = 0.7716  # fraction reached by paged attention reading the KV context
    # The same for an fp8 KV cache (kv_cache_dtype fp8*), applied to its halved bytes: vLLM 0.26's
    # FlashAttention fp8 path quantizes the query and reads at a lower rate, so halving the bytes
    # buys far less than half the attention time (see GPU_CALIBRATION for the runs).
    fp8_kv_read_efficiency: float = 0.4973
    compute_efficiency: float = 0.775  # fraction of dense peak a full wave of GEMM tiles reaches
    # How a GEMM's memory and compute times combine: 0 takes the larger (a roofline, every
    # calibration before 2026-12-04's second); p > 0 takes
    # (mem^p + compute^p)^(1/p), which is slower near the ridge, where cuBLAS's GEMMs neither
    # stream weights at the memory rate nor compute at the full-wave rate (64-1024 tokens).
    gemm_blend_exponent: float = 2.5
    # Step of the token-side tile widths the GEMM library picks for up to 256 tokens; 0 (off): only
    # the 64- and 128-row tiles of _TILES. vLLM 0.26's cuBLAS (nvjet) kernels on the H200 covered 96
    # tokens with 96-wide tiles and 166 with 72-, 136- and 176-wide ones (the 2026-12-04 traces'
    # kernel names): 8, where the quantised grid priced 166-192 tokens 30-50% slow.
    gemm_token_tile: float = 8.0
    attn_layer_s: float = 1.453e-05  # per layer of a step with attention: the attention kernels' fixed cost
    # Fraction of HBM bandwidth the KV-cache write (reshape_and_cache) reaches; 0 (off): mem_efficiency.
    kv_write_efficiency: float = 0.1092
    attn_efficiency: float = 0.2681  # fraction of dense peak reached by prefill attention
    # FlashAttention-3 (compute capability 9.x) at long contexts: the share of the dense peak its
    # forward pass reaches on long sequences, and the mean context attn_efficiency was read at
    # (PerfModel._prefill_attention: the rate rises from attn_efficiency there towards this one).
    # 0.65: FlashAttention-3's paper (Shah et al. 2024, Fig. 5), BF16 forward with a causal mask,
    # head dim 128, 16K tokens on an H100 SXM5, about 640 of 989 TFLOP/s; 2,048: attn_efficiency
    # was read off the H200 traces of 1-2K-token prompts (GPU_CALIBRATION), at most 2,048 tokens of
    # context. 0 (off): every context at attn_efficiency (the rule before 2026-12-05's class change).
    attn_long_efficiency: float = 0.65
    attn_fit_context: float = 2048.0
    step_overhead_s: float = 0.0024  # engine-core CPU per step (scheduler, input prep, sampler)
    seq_overhead_s: float = 1.116e-05  # engine-core CPU per scheduled request per step
    request_overhead_s: float = 0.001633  # API server + client CPU per request, before the engine sees it
    # More API server CPU per chat request where vLLM parses the chat template every request
    # (VllmMemoryRules.chat_template_parsed_per_request: 0.11.0 only; Workload.chat; not gpt-oss's
    # Harmony chat); scaled by api_cpu_factor as the other API server costs. 0: not modelled (the
    # simulator before it). Fitted alone on the fit half of the published dense runs it touches
    # (tests/fixtures/published_runs/dense.yaml: gpustack's Qwen3-14B chat bursts on an H100 and an
    # A100 host, vLLM 0.11.0; published_runs.py --fit A100-80GB,H100-80GB chat_template_parse_s 0 0.06):
    # 16.0 ms, the two hosts alone 18.8 ms (H100) and ~11 ms (A100). Its order is the parse's own: a
    # fresh ImmutableSandboxedEnvironment's parse of vLLM 0.11.0's 5-6 KB Qwen tool templates
    # (examples/tool_chat_template_hermes.jinja, _qwen3coder.jinja) took 12-16 ms on a shared 2-core
    # machine, the 316-byte ChatML one 1.3 ms (a check, not the value). It is the cost of the fit
    # runs' template (Qwen3's); a model whose template is known pays it times that template's
    # parse time against Qwen3's (sim.chat_templates.CHAT_TEMPLATE_PARSE_SHARE), others as it is.
    chat_template_parse_s: float = 0.01599
    prompt_token_overhead_s: float = 3.305e-08  # API server CPU per prompt token, before the engine sees it
    token_overhead_s: float = 5.866e-05  # API server CPU per streamed output token (measured, _fidelity.api_token_cpu_s)
    stream_prompt_token_s: float = 8.012e-09  # API server CPU per streamed token per token of its request's prompt
    # The share of token_overhead_s the API server pays once per SSE chunk (a request's merged
    # tokens) rather than once per token (sim/frontend.py): equal while chunks carry one token.
    api_chunk_share: float = 0.2
    # Loop passes a request's intake takes (its awaits: parse, tokenize, send to the engine core),
    # each behind the output work that became ready before it (sim/frontend.py).
    api_intake_passes: float = 6.0
    # The load generator's time to read one SSE chunk (its own process, after the API server's).
    client_chunk_s: float = 60e-6
    # Requests per slice of a step's outputs, between which the API server's output handler yields
    # its loop to intake (vLLM's VLLM_V1_OUTPUT_PROC_CHUNK_SIZE, 128); 0: a drain runs whole, as
    # the calibrations before 2026-12-04's second were fitted (sim/frontend.py).
    api_output_slice: float = 128.0
    # The host's API-server CPU against the fitted one: multiplies the four API server costs above
    # and enforce_eager's launch floor (CPU work on the same host). Never fitted (1.0 in every fit);
    # measured per host (sim.host_cpu.host_api_cpu_factor).
    api_cpu_factor: float = 1.0
    graph_launch_s: float = 30e-6  # replaying one full CUDA graph
    full_graph_layer_s: float = 2.119e-06  # per layer of a decode batch replayed as one FULL CUDA graph
    piecewise_layer_s: float = 0.0001  # per layer of a mixed batch run as PIECEWISE graphs
    compiled_layer_overhead_s: float = 1.728e-05  # per layer of a batch above the largest capture size
    eager_layer_overhead_s: float = 0.0003786  # launch floor per layer, enforce_eager (Python launches)
    # 1: an enforce_eager step is CPU-bound (the rule since 2026-12-04's eager change: attention
    # adds to the launch floor, no engine CPU hides, the floor scales with api_cpu_factor); 0: the
    # step's whole GPU work hides the launches and the engine CPU hides as with CUDA graphs (the
    # rule before; the recorded held-out folds and older calibration files replay with 0).
    eager_cpu_bound: float = 1.0
    async_overlap: float = 0.8542  # share of the engine CPU hidden behind the GPU with async scheduling
    # 1: with async scheduling the scheduler forms a batch one step ahead, so a request the engine
    # receives mid-step joins the batch after next (vLLM's design, not fitted); 0: at the step's
    # start, the simulator before 2026-12-03 (the folds replay with 0).
    schedule_ahead: float = 1.0
    # 1 (vLLM's V1 engine, every version simulated): a preempted request resumes on its own full
    # blocks still cached. vLLM frees a victim's blocks tail first onto the free queue's tail with
    # their hashes kept (0.10.1.1 v1/core/sched/scheduler.py 263-265, single_type_kv_cache_manager.py
    # 162-166, block_pool.py 240-255); a hash goes only when get_new_blocks hands its block out again
    # (block_pool.py 176-181, _maybe_evict_cached_block); the resumed request (num_computed_tokens 0)
    # looks its own chain up again (scheduler.py 377-380, kv_cache_manager.py 150-153). The same in
    # 0.11.0, 0.11.1 and 0.26.0. 0: it recomputes from scratch (the simulator before 2026-12-06).
    resume_hits: float = 1.0
    sync_overlap: float = 0.3  # the same without async scheduling (output processing still overlaps)
    allreduce_latency_s: float = 10e-6  # one all-reduce, small message
    interconnect_efficiency: float = 0.7  # fraction of the link bandwidth reached by all-reduce
    # The fused-MoE kernel's compute and weight-streaming rates against the dense GEMMs' (MoE models
    # only; servetune.sim.perf_classes). 0: the per-architecture share fitted on published MoE runs.
    moe_compute_share: float = 0.0
    moe_mem_share: float = perf_classes.MOE_MEM_SHARE
    # The fused-MoE path's floor per MoE layer and step, GPU seconds: its small kernels (router
    # top-k, moe_align_block_size, two fused_moe launches, the activation, the weighted sum) take
    # this long however few rows they get, so a small batch's routed experts cost at least
    # layers x this (moe_seconds). Fitted alone (benchmarks/sim_fidelity.py --fit-moe-floor) on the
    # real H100 FP8 MoE start 2026-12-05_q3moe_fp8_u09_s256_mbt8192 (3 windows,
    # tests/fixtures/real_h100_classes); judged on the two bf16 MoE starts beside it (8 windows).
    moe_layer_floor_s: float = 6.07e-05
    # Share of the dense peak TRITON_ATTN's prefill reaches where vLLM runs it instead of
    # FlashAttention (attention sinks below compute capability 9.0; perf_classes); 0: the fitted one.
    triton_attn_efficiency: float = 0.0
    # 1: each grouped-MoE kernel pads an expert's rows to its own row block (perf_classes.moe_block_m:
    # fused_moe's tile, matmul_ogs's and Marlin's rules from vLLM's source), and the padding is
    # the expected one over the experts' binomial row counts (perf_classes.moe_row_fill); 0: every
    # kernel at vLLM 0.11's fused_moe rows, padded from the mean count (the rule before 2026-12-05's
    # refit of perf_classes.MOE_COMPUTE_SHARE, whose shares were fitted under it: 0.25, 0.25, 0.65).
    moe_row_blocks: float = 1.0
    # 1: the model-class rules of servetune.sim.perf_classes (MoE, quantized GEMMs, sliding windows,
    # since 2026-12-05); 0: every model priced as a dense one at its active experts' width and its
    # checkpoint's bytes, no window (the rule before; benchmarks/published_runs.py --classes replays it).
    class_rules: float = 1.0

    def with_overrides(self, overrides: Mapping[str, float]) -> Calibration:
        """A copy with the named knobs replaced; unknown names, and values the API-server loop
        the simulator cannot run (:data:`_CHECKED_KNOBS`), are a :class:`SpecError`."""
        names = {f.name for f in dataclasses.fields(self)}
        for key, value in overrides.items():
            if key not in names:
                raise SpecError(f"calibration.{key}", f"unknown simulator knob{did_you_mean(str(key), names)}",
                                f"use one of: {', '.join(sorted(names))}")
            if key in _CHECKED_KNOBS and not _CHECKED_KNOBS[key][0](float(value)):
                raise SpecError(f"calibration.{key}", f"got {value!r}", _CHECKED_KNOBS[key][1])
        return dataclasses.replace(self, **{k: float(v) for k, v in overrides.items()})


#: Knobs whose values the simulator cannot run outside a range: what a value must be, and the fix.
#: The API-server loop's (servetune.sim.frontend) and the kernel-level ones added 2026-12-04.
_CHECKED_KNOBS: dict[str, tuple[Callable[[float], bool], str]] = {
    "api_chunk_share": (lambda v: 0.0 <= v <= 1.0, "a share of the token cost: between 0 and 1"),
    "api_intake_passes": (lambda v: v >= 1 and v == int(v), "a whole number of loop passes, 1 or more"),
    "client_chunk_s": (lambda v: v >= 0.0, "seconds to read one chunk: 0 or more"),
    "api_output_slice": (lambda v: v >= 0 and v == int(v), "a whole number of requests, 0 (off) or more (vLLM: 128)"),
    "eager_cpu_bound": (lambda v: v in (0.0, 1.0), "1 (the eager rule since 2026-12-04) or 0 (the rule before)"),
    "gemm_blend_exponent": (lambda v: v >= 0.0, "0 for the roofline (the larger time), or an exponent above 0"),
    "attn_layer_s": (lambda v: v >= 0.0, "seconds per layer: 0 or more"),
    "gemm_token_tile": (lambda v: 0 <= v <= 256 and v == int(v), "a whole number of tokens, 0 (off) to 256"),
    "kv_write_efficiency": (lambda v: 0.0 <= v <= 1.0, "a share of HBM bandwidth between 0 and 1 (0: mem_efficiency)"),
    "moe_compute_share": (lambda v: 0.0 <= v <= 1.0, "a share of the dense GEMM rate, at most 1 (0: the fitted one)"),
    "moe_mem_share": (lambda v: 0.0 < v <= 1.0, "a share of the dense weight-streaming rate: above 0, at most 1"),
    "class_rules": (lambda v: v in (0.0, 1.0), "1 (the model-class rules) or 0 (the rule before them)"),
    "moe_layer_floor_s": (lambda v: 0.0 <= v <= 1e-3, "seconds per MoE layer and step, 0 to 0.001"),
    "triton_attn_efficiency": (lambda v: 0.0 <= v <= 1.0, "a share of the dense peak, at most 1 (0: the fitted one)"),
    "attn_long_efficiency": (lambda v: 0.0 <= v <= 1.0, "a share of the dense peak, at most 1 (0: off)"),
    "attn_fit_context": (lambda v: v > 0.0, "tokens of context: above 0"),
    "moe_row_blocks": (lambda v: v in (0.0, 1.0), "1 (each kernel's row block, binomial padding) or 0 (the rule before)"),
}


#: Fitted per-GPU knobs, keyed by GpuSpec.name (``benchmarks/sim_fidelity.py --fit``; the runs each
#: set was fitted on are named beside it, and the held-out errors are in README).
GPU_CALIBRATION: dict[str, dict[str, float]] = {
    # Fitted 2026-12-04 (the fourth calibration), in two parts.
    # The GPU kernels' knobs are measured on kernels, not on windows (benchmarks/_kernels.py,
    # kernel_knobs): the GEMMs' compute_efficiency, gemm_blend_exponent and gemm_token_tile on three
    # cuBLAS probes (tests/fixtures/real_h200/gemm/: 64-8,192 tokens; 16-8,192; 1-2,048 replayed
    # from CUDA graphs, three hosts) and the GEMM time of the 560 traced steps of the 14 profiled
    # windows (scale/2026-12-04d_* to 2026-12-04g_*, vLLM's own torch profiler); attn_layer_s,
    # kv_read_efficiency, attn_efficiency and kv_write_efficiency on those steps' attention and
    # reshape_and_cache kernels; mem_efficiency kept from the 2026-12-03 fit (the weight-streaming
    # 4-sequence steps confirm it). With those held, the CPU, launch and front-end knobs
    # (FIT_SPACE less the kernels') by sim_fidelity.py --fit 36 --kernels --start
    # benchmarks/results/sim_kernel_candidate_v2_h200.json, twice (Optuna TPE, seed 0). The first
    # run (piecewise_layer_s bounded at 400 us) ended at 0.1806 with 214 us a layer there, against
    # 0.1821 for the start's knobs (106 us) and 0.222 for the 2026-12-03 calibration; the traces
    # bound that cost at 80 us a layer (FIT_SPACE), so it ran again from its best, clipped to 100 us
    # (trial 0: 0.1805, the best of the second run; v2's knobs 0.1823). Both on the same 80 windows as
    # that fit (_fidelity.load_calibration_runs: 0.85B a1..d1, scale/*_fv_*, *_dec, 2026-12-02a, 2026-12-02b,
    # the 8B grid, the confirmed 8B tune, the 14B grid), each host at its API-server factor
    # (_fidelity.calibration_host_factors: 1.70, 1.36, 1.55 read under the 2026-12-03 calibration in
    # the first run, 1.72, 1.38, 1.57 under the first run's knobs in the second), with vLLM's
    # output slices on (api_output_slice 128, VLLM_V1_OUTPUT_PROC_CHUNK_SIZE: not fitted).
    # fp8_kv_read_efficiency refitted alone after the rest (sim_fidelity.py --fit-fp8: the 2026-12-03a
    # host's four fp8 windows, FP8_FIT_STARTS);
    # token_overhead_s measured (_fidelity.api_token_cpu_s); the API server loop's triple
    # (api_chunk_share, api_intake_passes, client_chunk_s) as chosen 2026-12-04 on the fitting
    # windows (_fidelity.fit_frontend; rechecked with the slices on: still the least, 0.1631).
    # eager_layer_overhead_s refitted alone under the eager rule of 2026-12-04's second change
    # (attention does not cover the launches, no engine CPU hides, the floor scales with the host's
    # CPU factor; 604 us under the rule before) by sim_fidelity.py --fit-eager on the fit's two
    # eager windows (b1_eager_s64, scale/q14b_fv_u09_s128_eager), judged on the eager windows of the
    # 2026-12-04g and 2026-12-04h hosts (in no fit). 4 significant figures. Held out: every window of
    # _fidelity.HELD_OUT_HOSTS (the hosts 2026-12-03a to 2026-12-04h, 8B, 14B and 24B: no window of theirs
    # in the CPU fit; the kernels of the 2026-12-04d to 2026-12-04g hosts were traced in other
    # windows of the same starts), judged by sim_fidelity.py --unseen, tests/sim/test_fidelity.py and README. The
    # 2026-12-03 calibration this replaces: benchmarks/results/sim_calibration_2026_12_03_h200.json.
    # The folds in benchmarks/results/sim_heldout_h200.json are the 2026-12-02 model's.
    "H200": {
        "mem_efficiency": 0.7884,
        "kv_read_efficiency": 0.7716,
        "compute_efficiency": 0.775,
        "gemm_blend_exponent": 2.5,
        "gemm_token_tile": 8.0,
        "attn_layer_s": 1.453e-05,
        "attn_efficiency": 0.2681,
        "kv_write_efficiency": 0.1092,
        "step_overhead_s": 0.0024,
        "seq_overhead_s": 1.116e-05,
        "token_overhead_s": 5.866e-05,
        "stream_prompt_token_s": 8.012e-09,
        "request_overhead_s": 0.001633,
        "prompt_token_overhead_s": 3.305e-08,
        "piecewise_layer_s": 0.0001,
        "compiled_layer_overhead_s": 1.728e-05,
        "eager_layer_overhead_s": 0.0003786,
        "full_graph_layer_s": 2.119e-06,
        "async_overlap": 0.8542,
        "fp8_kv_read_efficiency": 0.4973,
        "api_output_slice": 128.0,
        # The API server loop's shape and the load generator's read (sim/frontend.py), chosen
        # alone, 2026-12-04 (_fidelity.fit_frontend; sim_fidelity.py --fit-frontend): the least
        # _fidelity.frontend_loss (mean |throughput| + |TPOT| + |TTFT| error) of the triples tried
        # on the fitting runs under the 2026-12-03 calibration (0.2 x 6 x 60 us: 0.2366; 0.25 x 7 x
        # 60: 0.2374; 0.35 x 6 x 60: 0.242; 0.1 x 6 x 60: 0.2420; 0 x 6 x 60: 0.2841; the old FIFO
        # 0.324; the full list is in git history, 2026-12-04).
        "api_chunk_share": 0.2,
        "api_intake_passes": 6.0,
        "client_chunk_s": 60e-6,
    },
}


#: Knobs a GPU family measured apart from the H200 replaces on top of the H200's fitted calibration
#: (``GPU_CALIBRATION["H200"]``), keyed by GpuSpec.name; every other knob stays the H200's. Each
#: value names its evidence and the windows it was fitted on; a GPU absent here runs the H200's
#: knobs at its own datasheet rates.
GPU_FAMILY_OVERRIDES: dict[str, dict[str, float]] = {
    # H100 SXM5 (HBM3, 3,350 GB/s), real vLLM 0.26.0, 2026-12-05, Llama-3.1-8B shape
    # (tests/fixtures/real_h100, docs/evidence-h100.md). kv_read_efficiency fitted alone
    # (benchmarks/sim_fidelity.py --fit-h100: _fidelity.fit_h100_kv_read, golden-section on
    # throughput and TPOT at API-server factor 1) on the 8 CUDA-graph windows of
    # _fidelity.H100_FIT_STARTS (the anchor-flag start and the 2,048-token-budget start), bounded
    # by the same host's read-only HBM probe (hbm_h100.json: 3,010 GB/s, 0.8984 of the datasheet; a
    # paged-attention read does not outrun a plain read). The fit ends at that bound, 0.8981 (unbounded it
    # went to 0.94: part of what it corrects lies elsewhere in the decode step). The other 8
    # windows (_fidelity.H100_JUDGED_STARTS) judge it. GEMM and weight-streaming rates are the
    # H200's: the same cuBLAS probe and the 1-16-sequence decode windows confirm them on the H100.
    "H100-80GB": {"kv_read_efficiency": 0.8981},
    # A100 SXM4 80GB (GA100, FlashAttention-2: vLLM's FLASH_ATTN backend on compute capability 8.0,
    # not the H200's FlashAttention-3), from published real vLLM runs (tests/fixtures/published_runs,
    # benchmarks/published_runs.py). attn_efficiency fitted alone (published_runs.py --file
    # tests/fixtures/published_runs/dense.yaml --fit A100-80GB attn_efficiency 0.2681 0.73:
    # golden-section on mean |output tok/s error| + mean
    # |TTFT error|, every other knob the H200's) on the A100's fit runs, gpustack's vLLM 0.11.0
    # Qwen3-14B bursts (a100-qwen3-14b-tp1-rand32000x100-burst100, -rand4000x200-burst500,
    # -rand2000x100-burst500, -rand128x4-burst1000); bounded above by FlashAttention-2's own A100
    # forward figure (Dao 2023: up to 73% of the 312 TFLOP/s peak). The 32,000-token prompts set it:
    # their prefill attention ran at 0.48 of the dense peak where the H200's FA3 value (0.27, read
    # off 1-2k-token traces) made them 23% slow. The held-out A100 runs (dennislee22, Qwen2-7B,
    # 1-8k-token contexts) barely exercise it: docs/accuracy.md has them before and after.
    # Refitted 2026-12-06 on the same fit runs, one knob at a time, after the PCIe A100 card, the
    # logits' all-gather without P2P and vLLM 0.10.x's own KV pool had landed: kv_read_efficiency
    # (--fit A100-80GB kv_read_efficiency 0.4 0.8984, bounded by the H100's read-only HBM share):
    # 0.5752, the decode steps of 256 requests at 2-4k-token contexts ran 7-9% fast on TPOT at the
    # H200's FlashAttention-3 share (0.7716); attn_efficiency under it 0.5077 (from 0.4843); a
    # second round: kv_read_efficiency 0.5646, attn_efficiency 0.51 (within 0.003: kept 0.5077).
    # The KV-read share is the A100's own: not carried to the other 8.x parts (FA2_KNOBS).
    # Both were fitted while a preempted request recomputed whole (resume_hits 0); refitted with it
    # on (2026-12-06): kv_read_efficiency 0.402 (at its bound), attn_efficiency 0.546, not adopted
    # (docs/accuracy.md, "Resumed requests hit their own blocks").
    "A100-80GB": {"attn_efficiency": 0.5077, "kv_read_efficiency": 0.5646},
}

#: The FlashAttention generation vLLM's FLASH_ATTN backend runs on an NVIDIA GPU, by compute
#: capability (vLLM 0.26 ``v1/attention/backends/fa_utils.get_flash_attn_version``: FA3 on major 9,
#: FA4 on major 10 where it is built, FA2 otherwise; the backend needs 8.0 or above). Every Ampere
#: and Ada part (8.0-8.9: A100, A10, L4, L40S, the RTX 30 and 40 series) runs the FA2 kernels whose
#: prefill rate was fitted on the A100 (``GPU_FAMILY_OVERRIDES["A100-80GB"]``), so they take that
#: share of their own dense peak instead of the H200's FA3 one. Applied to the other 8.x parts on
#: 2026-12-05 after their held-out published runs had been seen (docs/accuracy.md says so).
FA2_COMPUTE_CAPABILITY = (8.0, 9.0)
FA2_KNOBS: dict[str, float] = {"attn_efficiency": GPU_FAMILY_OVERRIDES["A100-80GB"]["attn_efficiency"]}


def runs_flash_attention_2(gpu: GpuSpec) -> bool:
    """Whether vLLM runs FlashAttention-2 on ``gpu`` (an NVIDIA part of compute capability 8.x).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> [runs_flash_attention_2(get_gpu(n)) for n in ("A100-40GB", "L4", "RTX-3060", "H200", "T4")]
        [True, True, True, False, False]
    """
    low, high = FA2_COMPUTE_CAPABILITY
    return gpu.platform != "rocm" and low <= gpu.compute_capability < high


def calibration_for(gpu: GpuSpec) -> Calibration:
    """Defaults, then this module's fitted table (a GPU without a row of its own: the H200's, with
    :data:`FA2_KNOBS` where vLLM runs FlashAttention-2 and its family's :data:`GPU_FAMILY_OVERRIDES`),
    then ``gpu.calibration`` (the most specific wins)."""
    fitted = GPU_CALIBRATION.get(gpu.name)
    if fitted is None:
        attention = FA2_KNOBS if runs_flash_attention_2(gpu) else {}
        fitted = {**GPU_CALIBRATION["H200"], **attention, **GPU_FAMILY_OVERRIDES.get(gpu.name, {})}
    cal = Calibration().with_overrides(fitted)
    extra = getattr(gpu, "calibration", None) or {}
    return cal.with_overrides(extra) if extra else cal


def with_calibration(gpu: GpuSpec, overrides: Mapping[str, float]) -> GpuSpec:
    """``gpu`` whose simulator knobs are :func:`calibration_for`'s with ``overrides`` on top (a fit's
    candidate, a host's measured ``api_cpu_factor``); unknown knob names are a :class:`SpecError`.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> calibration_for(with_calibration(get_gpu("H200"), {"api_cpu_factor": 1.5})).api_cpu_factor
        1.5
    """
    if not overrides:
        return gpu
    knobs = dataclasses.asdict(calibration_for(gpu).with_overrides(overrides))
    return dataclasses.replace(gpu, calibration=knobs)


def moe_tile_share(block_m: int, block_n: int) -> float:
    """The rate of a fused-MoE ``block_m x block_n`` tile against the 64 x 64 tile vLLM 0.11's default
    ran (the one ``perf_classes.MOE_COMPUTE_SHARE`` was fitted on), by the dense GEMMs' tile model:
    :func:`_token_tile_efficiency` for the token rows, a 64-wide weight tile at ``_TILES``' 64 x 64
    over 64 x 128 (two thirds).

    Example:
        >>> moe_tile_share(128, 128), moe_tile_share(64, 128), round(moe_tile_share(16, 64), 6)
        (1.8, 1.5, 1.0)
    """
    narrow = 1.0 if block_n >= 128 else _TILES[3][2] / _TILES[2][2]
    return _token_tile_efficiency(block_m) * narrow / _TILES[3][2]


def _token_tile_efficiency(width: int) -> float:
    """Share of the large tile's rate a tile ``width`` tokens wide reaches: ``_TILES``' 0.75 at 64
    rows and 0.9 at 128, linear between them and on to 1.0 at 256 (less reuse of what it loads)."""
    if width <= 64:
        return 0.75
    if width <= 128:
        return 0.75 + 0.15 * (width - 64) / 64
    return min(1.0, 0.9 + 0.1 * (width - 128) / 128)


def wave_fill(m: int, n: int, sms: int, token_tile: int = 0) -> float:
    """Share of the dense peak a GEMM with an ``m x n`` output reaches from its tile grid alone.

    The GEMM library picks the tile that keeps the most SMs busy over its waves (partial tiles
    count as the rows and columns they compute): 128x256 tiles for large problems, smaller ones,
    which reach less of the peak each (``_TILES``), when few large tiles would leave SMs idle.
    ``token_tile`` > 0 (``Calibration.gemm_token_tile``): up to 256 tokens, one tile as wide as
    the tokens rounded up to that step, against 128 weight rows, is a choice too.

    Example:
        >>> round(wave_fill(8192, 4096, 132), 3), round(wave_fill(64, 4096, 132), 3)
        (0.97, 0.75)
    """
    tile_shapes = _TILES
    if 0 < token_tile and m <= 256:  # one tile as wide as the tokens, rounded up to the step
        width = -(-m // token_tile) * token_tile
        tile_shapes = (*_TILES, (width, 128, _token_tile_efficiency(width)))
    best = 0.0
    for tile_m, tile_n, eff in tile_shapes:
        tiles = -(-m // tile_m) * -(-n // tile_n)
        # Fewer tiles than SMs: the library splits K over the idle SMs (split-K), so only the
        # tiles' unused rows and columns are lost; otherwise the last wave's idle SMs are too.
        slots = tiles if tiles < sms else -(-tiles // sms) * sms
        fill = eff * (m * n) / (slots * tile_m * tile_n)
        if fill > best:
            best = fill
    return best


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


class PerfModel:
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
                 calibration: Calibration | None = None, sampling: Sampling | None = None) -> None:
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
        rules = cal.class_rules >= 0.5
        self._version = config.version
        if (rules and perf_classes.is_class_model(model)) or model.is_hybrid:
            self._init_classes(model, gpu, tp, layers, mem_rate, cal)
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
                        custom_all_reduce=not config.disable_custom_all_reduce)
        self._init_sampler(model, gpu, config, cal, sampling or GREEDY)
        self.enforce_eager = config.enforce_eager
        self.capture_sizes: tuple[int, ...] = tuple(sorted(config.cudagraph_capture_sizes or ()))
        self.max_capture = self.capture_sizes[-1] if self.capture_sizes and not config.enforce_eager else 0
        self._graph_s = cal.graph_launch_s + cal.full_graph_layer_s * layers
        self._piecewise_floor = cal.piecewise_layer_s * mixer_layers
        self._compiled_floor = cal.compiled_layer_overhead_s * layers
        self._eager_cpu_bound = cal.eager_cpu_bound >= 0.5
        # Launching is CPU work on the host, as the API server's is: the same factor.
        self._eager_floor = cal.eager_layer_overhead_s * layers * (cal.api_cpu_factor if self._eager_cpu_bound else 1.0)
        self._overlap = cal.async_overlap if config.async_scheduling else cal.sync_overlap
        self.schedule_ahead = bool(cal.schedule_ahead >= 0.5 and config.async_scheduling)
        self.resume_hits = cal.resume_hits >= 0.5
        self._step_cpu, self._seq_cpu = cal.step_overhead_s, cal.seq_overhead_s
        self._init_api_server(model, config, cal)
        # _gemm_time is a pure function of (tokens, rows) here, and a trial's steps repeat the same
        # few batch shapes thousands of times (decode steps of one batch size, full token budgets):
        # remembered, the tile-grid search runs once per shape instead of once per step.
        self._gemm_memo: dict[tuple[int, int], float] = {}

    def _init_api_server(self, model: ModelProfile, config: EngineConfig, cal: Calibration) -> None:
        """The API server's and the client's CPU costs (sim/frontend.py), at the host's ``api_cpu_factor``."""
        self.api_cpu_factor = host = cal.api_cpu_factor
        self.request_overhead_s = cal.request_overhead_s * host
        #: Loop CPU a chat request adds to :attr:`request_overhead_s` (0 where vLLM's chat endpoint
        #: does not parse the template per request, or the model chats through Harmony), scaled to
        #: the model's own template where it is known (sim.chat_templates).
        self.chat_request_overhead_s = (cal.chat_template_parse_s * host * chat_template_parse_share(model)
                                        if memory_rules(config.version).chat_template_parsed_per_request
                                        and model.architecture not in HARMONY_ARCHITECTURES else 0.0)
        self.prompt_token_overhead_s = cal.prompt_token_overhead_s * host
        self.token_overhead_s = cal.token_overhead_s * host
        self.stream_prompt_token_s = cal.stream_prompt_token_s * host
        self.api_chunk_share = cal.api_chunk_share
        self.api_intake_passes = int(cal.api_intake_passes)  # a whole number >= 1 (Calibration.with_overrides)
        self.client_chunk_s = cal.client_chunk_s * host
        self.api_output_slice = int(cal.api_output_slice)

    def _init_comm(self, model: ModelProfile, gpu: GpuSpec, tp: int, pp: int, layers: int,
                   cal: Calibration, allreduces: int = 0, custom_all_reduce: bool = True) -> None:
        """The per-step communication terms: TP all-reduces and PP sends, priced by the interconnect.

        ``allreduces``: the stage's all-reduces a step (0: two a layer; a hybrid's one per mixer and MLP,
        Nemotron-H's layers holding one of them). ``custom_all_reduce``: not ``disable_custom_all_reduce``
        (the path changes, the calibrated cost does not: :func:`servetune.planner.comm.nccl_small_message_note`).
        Sets :attr:`allreduce_path`, the implementation priced, in words ("" at TP=1)."""
        # Two all-reduces per layer of [tokens, hidden] activations (bf16) under TP, priced by the
        # host's interconnect (planner.comm.allreduce_cost: NVLink / PCIe P2P at the calibrated
        # knobs, no P2P at NCCL's published SHM figures, a fixed cost per step of NCCL's ring:
        # 2 (tp-1) an all-reduce, tp-1 the all-gather below).
        # Once a step, the LM head's vocab-parallel logits (one row per sampled request, the
        # model's dtype) are all-gathered to every rank: vLLM's LogitsProcessor._gather_logits takes
        # tensor_model_parallel_all_gather wherever Platform.use_all_gather() holds, every V1
        # engine (0.10-0.26); each rank receives (tp-1)/tp of the [rows, vocab] tensor. Priced
        # where the all-reduce is priced from NCCL's published SHM figures (no GPU P2P): there
        # it is 0.03 ms a request a step for a 152k vocabulary at TP=2, under 1 us over NVLink,
        # where it stays inside the calibrated all-reduce terms the NVLink windows judged (and the
        # recorded NVLink runs are not moved by it).
        self.allreduce_path = ""
        if tp > 1:
            ar = allreduce_cost(gpu, tp, latency_s=cal.allreduce_latency_s, efficiency=cal.interconnect_efficiency,
                                custom_all_reduce=custom_all_reduce)
            self.allreduce_path = ar.path
            n_ar = allreduces or 2 * layers
            self._t_ar_fixed = n_ar * ar.fixed_s(tp)
            self._t_ar_token = n_ar * (ar.seconds(tp, model.hidden_size * 2) - ar.fixed_s(tp))
        else:
            self._t_ar_fixed = self._t_ar_token = 0.0
        self._t_gather_fixed = self._t_gather_row = 0.0
        if tp > 1 and gpu.link == "pcie-no-p2p":
            self._t_gather_fixed = ar.gather_fixed_s(tp)
            self._t_gather_row = (tp - 1) / tp * model.vocab_size * model.dtype_bytes / ar.bus_bytes_per_s
        # A pipeline boundary: the stage's hidden states and residual (each rank its 1/TP slice)
        # sent to the next stage (planner.comm.sendrecv_cost), pp - 1 sends per micro-batch: a lone
        # request pays all of them (the bubble), a full pipeline the stages' average (the last
        # stage sends nothing), as every other term is spread over equal stages.
        if pp > 1:
            p2p = sendrecv_cost(gpu, latency_s=cal.allreduce_latency_s, efficiency=cal.interconnect_efficiency)
            share = (pp - 1) / pp  # scaled back up by the step's pp / micro (gpu_cost)
            self._t_pp_fixed = p2p.latency_s * share
            self._t_pp_token = (p2p.sendrecv_seconds(2.0 * model.hidden_size * model.dtype_bytes / tp)
                                - p2p.latency_s) * share
        else:
            self._t_pp_fixed = self._t_pp_token = 0.0

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

    def _init_classes(self, model: ModelProfile, gpu: GpuSpec, tp: int, layers: int, mem_rate: float,
                      cal: Calibration) -> None:
        """The GEMMs of a MoE, quantized or sliding-window model, from :mod:`servetune.sim.perf_classes`.

        Every GEMM carries its own weight bytes and FLOP rate (its FLOPs are stored in bf16-rate
        units); the LM head stays in the model dtype; the routed experts are :meth:`moe_seconds`'.
        """
        bf16_rate = gpu.bf16_tflops * 1e12 * cal.compute_efficiency
        self._flop_rate = bf16_rate
        specs = perf_classes.class_gemms(model, gpu, tp, layers)
        self._gemms = [(g.n, g.k, g.n * g.k * g.fmt.bytes_per_weight * g.layers / mem_rate,
                        2.0 * g.n * g.k * g.layers / g.fmt.rate_scale) for g in specs]
        act = sum(2.0 * (g.n + g.k) * g.layers for g in specs)
        vocab, d = self._head[0], self._head[1]
        self._head = (vocab, d, vocab * d * model.dtype_bytes / mem_rate, 2.0 * vocab * d)
        self._moe = perf_classes.moe_shape(model, gpu, tp, layers)
        if self._moe is not None:
            m = self._moe
            # Each routed row reads its token (H) and writes 2I, then reads I and writes H.
            act += 2.0 * m.top_k * (m.hidden + 2 * m.inter + m.inter + m.hidden) * m.layers
            self._moe_mem_rate = mem_rate * cal.moe_mem_share
            self._moe_flop_rate = bf16_rate * m.fmt.rate_scale * perf_classes.moe_compute_share(gpu, cal.moe_compute_share,
                                                                                                m.kernel)
            self._moe_floor_s = m.layers * cal.moe_layer_floor_s
            self._moe_row_blocks = cal.moe_row_blocks >= 0.5
        self._act_bytes_token = act / mem_rate

    def _init_hybrid(self, model: ModelProfile, gpu: GpuSpec, config: EngineConfig, tp: int, layers: int,
                     mem_rate: float, cal: Calibration) -> perf_hybrid.HybridShape | None:
        """A Mamba / gated-delta-net hybrid's recurrent terms (:mod:`servetune.sim.perf_hybrid`; None and
        zeros for other models): per decoding request its state read and written in every Mamba layer,
        per prefilling request its initial state read and final state written, per decode token the
        mixer's activations, per prefill token conv1d, the gated norm and the chunked scan's kernels,
        each a roofline of its bytes (``mem_efficiency``) and FLOPs (the dense rate, ``compute_efficiency``).
        The element-wise kernels are the dense rule's per layer, the MLP's share on the layers with one."""
        self._t_state = self._t_mamba_decode_token = self._t_mamba_prefill_token = 0.0
        hybrid = perf_hybrid.hybrid_shape(model, tp, layers, mamba_ssm_dtype_bytes(
            model, memory_rules(config.version).nemotron_h_ssm_default))
        if hybrid is None:
            return None
        n = hybrid.mamba_layers
        flop_rate = gpu.bf16_tflops * 1e12 * cal.compute_efficiency
        self._t_state = 2.0 * hybrid.state_bytes * n / mem_rate
        self._t_mamba_decode_token = hybrid.decode_token_bytes * n / mem_rate
        scan = sum(max(k.bytes / mem_rate, k.flops / flop_rate) for k in hybrid.scan)
        self._t_mamba_prefill_token = (hybrid.prefill_token_bytes / mem_rate + scan) * n
        if model.is_moe:
            inter = (model.num_experts_per_tok * model.expert_intermediate_size
                     + model.shared_expert_intermediate_size) // tp
        else:
            inter = model.intermediate_size // tp
        d = model.hidden_size
        self._elementwise_token = (10.5 * d * layers + (3.0 if model.ffn_gated else 2.0) * inter
                                   * hybrid.ffn_layers) * 2.0 / mem_rate
        return hybrid

    def recurrent_seconds(self, decode_reqs: int, prefill_reqs: int, prefill_tokens: int) -> float:
        """A hybrid's Mamba / gated-delta-net layers beyond their GEMMs for one step (0 for other models):
        ``decode_reqs`` requests decoding one token each, ``prefill_reqs`` requests prefilling
        ``prefill_tokens`` tokens together (:meth:`_init_hybrid`)."""
        if not self._t_state:
            return 0.0
        return (self._t_state * (decode_reqs + prefill_reqs) + self._t_mamba_decode_token * decode_reqs
                + self._t_mamba_prefill_token * prefill_tokens)

    def _init_mla(self, model: ModelProfile, heads: int, layers: int, attn_rate: float) -> None:
        """MLA attention (DeepSeek-V2/V3) from its own dimensions, not the dense rules' ``head_dim``.

        vLLM's MLA backends (``attention/backends/mla``; the ``MLACommonImpl`` both prefill and decode
        go through) cache one latent of ``kv_lora_rank + qk_rope_head_dim`` elements per token and
        layer, on every TP rank (``ModelProfile.kv_bytes_per_token``), and:

        * **prefill** up-projects the chunk's latents through ``kv_b_proj`` and runs ordinary
          attention, scores over ``qk_nope_head_dim + qk_rope_head_dim`` and values over
          ``v_head_dim``: ``2 (qk + v)`` FLOPs a head per (token, context) pair where the dense rule
          has ``4 head_dim``; a chunk whose request already has context up-projects that context's
          cached latents again (``_compute_prefill_context``): ``2 kv_lora_rank heads (nope + v)``
          FLOPs per context token and layer, at the GEMM rate.
        * **decode** runs absorbed (``W_UK_T``, ``W_UV``): every head scores the latent and its
          rope part (``kv_lora_rank + rope``) and sums latents (``kv_lora_rank``), reading each
          cached latent once for all heads, so a context token costs the larger of its bytes and
          ``2 heads (2 kv_lora_rank + rope)`` FLOPs at the attention rate.
        """
        lora, rope = model.mla_kv_lora_rank, model.mla_rope_dim
        qk, v = model.mla_nope_dim + rope, model.mla_v_dim
        self._t_attn = 2.0 * heads * (qk + v) * layers / attn_rate
        self._t_mla_context = 2.0 * lora * heads * (model.mla_nope_dim + v) * layers / self._flop_rate
        decode_flops = 2.0 * heads * (2 * lora + rope) * layers / attn_rate
        if decode_flops > self._t_kv_read:
            self._t_kv_read = decode_flops

    def moe_seconds(self, tokens: int) -> float:
        """The routed experts' grouped GEMMs for ``tokens`` rows over the stage's MoE layers.

        Weight bytes: the touched experts' (:func:`~servetune.sim.perf_classes.distinct_experts`);
        FLOPs: ``2 x tokens x top_k x 3 H I``, at the share of the tile rows the kernel's
        per-expert padding to ``BLOCK_SIZE_M`` leaves busy, and from vLLM 0.26 (whose default tile
        grows with the batch, :func:`~servetune.sim.perf_classes.moe_tile`) at that tile's rate
        against the 64 x 64 tile the compute share was fitted on (:func:`moe_tile_share`).
        """
        m = self._moe
        if m is None or tokens <= 0:
            return 0.0
        touched = perf_classes.distinct_experts(m.experts, m.top_k, tokens)
        if touched <= 0:
            return 0.0
        mem_s = touched * m.expert_bytes * m.layers / self._moe_mem_rate
        rows = tokens * m.top_k
        if self._moe_row_blocks:  # each kernel's own row block, padded per expert (perf_classes.moe_row_fill)
            block = perf_classes.moe_block_m(m.grouped_gemm, tokens, m.experts, m.top_k, self._version, m.block_quant,
                                             m.tuned_tiles)
            width = perf_classes.moe_tile(tokens, m.experts, self._version, m.block_quant, m.tuned_tiles)[1]
            fill = perf_classes.moe_row_fill(tokens, m.experts, m.top_k, block)
        else:  # the rule before: 0.11's fused_moe rows for every kernel, padding from the mean count
            if m.fused_moe:
                block, width = perf_classes.moe_tile(tokens, m.experts, self._version, m.block_quant, m.tuned_tiles)
            else:
                block, width = perf_classes.moe_tile(tokens, m.experts, perf_classes.MOE_TILE_FITTED_VERSION)
            per_expert = rows / touched
            fill = per_expert / (-(-per_expert // block) * block)
        new_tiles = perf_classes.prices_tile(m, self._version)
        tile = moe_tile_share(block, width) if new_tiles else 1.0
        comp_s = 2.0 * rows * 3.0 * m.hidden * m.inter * m.layers / (self._moe_flop_rate * fill * tile)
        return max(self._combine(mem_s, comp_s), self._moe_floor_s)

    def padded(self, num_tokens: int) -> int:
        """The CUDA graph size a batch of ``num_tokens`` runs as (itself above the largest size)."""
        if num_tokens > self.max_capture or not self.capture_sizes:
            return num_tokens
        return self.capture_sizes[bisect.bisect_left(self.capture_sizes, num_tokens)]

    def _gemm_time(self, tokens: int, rows: int) -> float:
        """The layer GEMMs for ``tokens`` rows plus the LM head for ``rows`` rows, each a roofline."""
        key = (tokens, rows)
        seconds = self._gemm_memo.get(key)
        if seconds is None:
            if len(self._gemm_memo) >= _GEMM_MEMO_MAX:
                self._gemm_memo.clear()  # bounded: a pathological trial cannot grow it without end
            seconds = self._gemm_memo[key] = self._gemm_roofline(tokens, rows)
        return seconds

    @property
    def layer_gemm_shapes(self) -> tuple[tuple[int, int], ...]:
        """The (N, K) of the layer's GEMMs on one TP rank, in :meth:`layer_gemm_seconds`' order."""
        return tuple((n, k) for n, k, _, _ in self._gemms)

    def layer_gemm_seconds(self, tokens: int) -> tuple[float, ...]:
        """Seconds of the layer's GEMMs (qkv, o, gate_up, down) for ``tokens`` rows, each over the
        stage's layers: the rooflines a step prices them at (``benchmarks/gemm_vs_sim.py`` holds
        them against cuBLAS timed on the GPU)."""
        sms, rate = self._sms, self._flop_rate
        return tuple(self._combine(mem_s, flops * tokens / (rate * wave_fill(tokens, n, sms, self._token_tile)))
                     for n, k, mem_s, flops in self._gemms)

    def _combine(self, mem_s: float, comp_s: float) -> float:
        """One GEMM's seconds from its memory and compute times (``gemm_blend_exponent``)."""
        big = mem_s if mem_s > comp_s else comp_s
        p = self._blend
        if p <= 0 or big <= 0:
            return big
        return big * ((mem_s / big) ** p + (comp_s / big) ** p) ** (1.0 / p)

    def _gemm_roofline(self, tokens: int, rows: int) -> float:
        sms, rate = self._sms, self._flop_rate
        total = self._act_bytes_token * tokens
        for seconds in self.layer_gemm_seconds(tokens):
            total += seconds
        n, k, mem_s, flops = self._head
        if self._moe is not None:
            total += self.moe_seconds(tokens)
        return total + self._combine(mem_s, flops * rows / (rate * wave_fill(rows, n, sms, self._token_tile)))

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
        comm = ((self._t_ar_fixed + self._t_pp_fixed + self._t_gather_fixed) * micro
                + (self._t_ar_token + self._t_pp_token) * tokens + self._t_gather_row * rows * micro)
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
        return StepCost(gemm * scale, elementwise * scale, attention * scale, kv_write * scale, comm * scale,
                        launch * scale, sampler * scale, recurrent * scale)

    def _prefill_attention(self, prefill_tokens: int, prefill_attn_work: int) -> float:
        """Prefill attention's seconds: ``prefill_attn_work`` (tokens x context) at ``attn_efficiency``
        of the peak, or on FlashAttention-3 (``_attn_long_k`` > 0) at the rate its query blocks
        reach over the batch's mean context ``c``: ``long x c / (c + k)``, ``long`` =
        ``Calibration.attn_long_efficiency`` and ``k`` tokens set so the rate is ``attn_efficiency``
        at ``attn_fit_context`` (where it was read), never below it. A query block's fixed work
        (loading it, the epilogue, its launch share) is paid once whatever the context it loops
        over, so a long context runs nearer the kernel's long-sequence rate."""
        seconds = self._t_attn * prefill_attn_work
        if not self._attn_long_k or prefill_tokens <= 0 or prefill_attn_work <= 0:
            return seconds
        context = prefill_attn_work / prefill_tokens
        share = (context + self._attn_long_k) / context * self._attn_long_ratio  # attn_eff / the rate reached
        return seconds * share if share < 1.0 else seconds

    def _sliding_attention(self, decode_reqs: int, decode_context: int, prefill_tokens: int, prefill_context: int,
                           prefill_attn_work: int) -> float:
        """Sliding-window layers' attention: each decode request reads at most the window (from the
        batch's mean context), and a prefill token attends to at most the window."""
        w = self._window
        seconds = 0.0
        if decode_reqs > 0 and decode_context > 0:
            mean = decode_context / decode_reqs
            seconds += self._t_kv_read_slide * decode_reqs * (mean if mean < w else w)
        if prefill_attn_work > 0 and prefill_tokens > 0:
            # tokens x context, with each token's context capped at the window (from the chunk's mean)
            mean = prefill_attn_work / prefill_tokens
            seconds += self._t_attn_slide * prefill_tokens * (mean if mean < w else w)
        return seconds

    def gpu_time(self, num_reqs: int, num_tokens: int, kv_context: int, attn_work: int,
                 decode_only: bool, prefill_tokens: int | None = None, prefill_context: int = 0,
                 prefill_attn_work: int | None = None) -> float:
        """GPU seconds of one batch: kernel rooflines + communication + launch costs (x pp).

        Arguments as :meth:`gpu_cost`, whose kinds this sums.
        """
        return self.gpu_cost(num_reqs, num_tokens, kv_context, attn_work, decode_only, prefill_tokens,
                             prefill_context, prefill_attn_work).seconds

    def step_time(self, num_reqs: int, num_tokens: int, kv_context: int, attn_work: int,
                  decode_only: bool, prefill_tokens: int | None = None, prefill_context: int = 0,
                  prefill_attn_work: int | None = None) -> float:
        """Seconds of one engine step: GPU time plus the engine CPU that async scheduling leaves visible.

        Arguments as :meth:`gpu_time`.
        """
        gpu = self.gpu_time(num_reqs, num_tokens, kv_context, attn_work, decode_only,
                            prefill_tokens, prefill_context, prefill_attn_work)
        cpu = self._step_cpu + self._seq_cpu * num_reqs
        # Under enforce_eager the thread that schedules and prepares the next step is the one
        # launching this step's kernels: none of it hides.
        hidden = 0.0 if self.enforce_eager and self._eager_cpu_bound else cpu * self._overlap
        if hidden > gpu:
            hidden = gpu
        return gpu + cpu - hidden
