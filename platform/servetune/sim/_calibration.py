"""The simulator's calibration: its knobs, the values fitted to real runs, and a GPU's set.

Contract: :class:`Calibration` holds every constant of the step-time model
(:class:`servetune.sim.perf.PerfModel`) and of the API server loop (:mod:`servetune.sim.frontend`),
each with its evidence; :data:`GPU_CALIBRATION` and :data:`GPU_FAMILY_OVERRIDES` are the fitted
values, and :func:`calibration_for` chooses a GPU's (defaults, the fitted table, then the GPU's own
``calibration`` mapping). Pure data and lookups, no I/O. :mod:`servetune.sim.perf` is the face these
names are imported from.

Example:
    >>> Calibration().with_overrides({"step_overhead_s": 0.001}).step_overhead_s
    0.001
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from servetune.errors import SpecError, did_you_mean
from servetune.sim import _moe_rates

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec

__all__ = ["B200_INTERCONNECT_EFFICIENCY", "Calibration", "FA2_COMPUTE_CAPABILITY", "FA2_KNOBS", "GPU_CALIBRATION", "GPU_FAMILY_OVERRIDES",
           "NCCL_ALLREDUCE_BUSBW_GBPS", "calibration_for", "runs_flash_attention_2", "with_calibration"]


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
    # The engine thread's CPU of a step's forward outside a FULL CUDA graph, where the GPU work does not
    # cover it (PerfModel.forward_cpu_s): vLLM launches a gated delta net's mixer (a graph-splitting op)
    # eagerly, and a step above the largest capture size launches every compiled piece from Python. Read
    # off vLLM's torch profiler on an H100 SXM, vLLM 0.26.0, the Qwen3.5-35B-A3B shape at 20 layers under
    # 512 clients of 1,024 / 128 tokens (tests/fixtures/real_h100_classes/2026-12-07_q35moe20tri_prof_u09_default,
    # 31 mixed steps of 8,192 tokens, medians; the unprofiled start of the same window ran such steps in
    # 95-107 ms, the profiled ones in 109 ms); nothing fitted. Judged on the published Qwen3.5 and GLM-4.5-Air
    # pages (docs/accuracy.md, "a hybrid's CPU-bound mixed steps").
    gdn_mixer_cpu_s: float = 1.766e-3  # one gated-delta-net mixer call (vllm::qwen_gdn_attention_core)
    # One compiled piece holding a MoE block with a shared expert (vllm::moe_forward_shared: routing,
    # moe_align_block_size, two Triton fused_moe launches, the shared expert and its gate) in a step above
    # the largest capture size; MoE blocks without a shared expert run another op, not timed: 0 for them.
    shared_moe_piece_cpu_s: float = 2.364e-3
    # A gated-delta-net hybrid's step with a prefill: its CPU before and after the forward (input and
    # metadata preparation, sampling, the scheduler) ran 17.0 ms + 31.4 us a request over the trace's 31
    # steps (239-512 requests), against engine_cpu_s's 2.4 ms + 11.2 us: the rest, per request, and the
    # fixed 14.6 ms spread over the steps' 7,827 prefill tokens (every traced step carried a full budget, so
    # a cost per step is not told apart from one per prefill token: this charges the prefill's tokens, which
    # leaves small steps as they were). The same shape's small steps above the capture size confirmed it
    # (2026-12-07_q35moe20tri_prof_small_u09_default: 6.5 and 8.2 ms around the forward at 1,537 and 4,229 tokens,
    # priced 5.5 and 10.8 with the engine CPU, where a per-step 14.6 ms would not be).
    # A gated delta net's decoding request: its SSM state read and written by vLLM's packed decode kernel
    # (fused_recurrent_gated_delta_rule_packed_decode_kernel, vLLM 0.26.0), as a share of the GPU's HBM bandwidth.
    # Timed on an H100 SXM in the 20-layer Qwen3.5-35B-A3B shape, 1.41 us a request and layer (2 MiB of fp32 state
    # each way: 2.97 TB/s) at 200 decodes and at 512 alike
    # (tests/fixtures/real_h100_classes/2026-12-07_q35moe20tri_prof_small_u09_default/p1000_o256_c200_prof and
    # 2026-12-07_q35moe20tri_prof_u09_default/p1024_o128_c512_prof, medians over 40 and 3 steps); nothing fitted on a
    # run. Other GPUs take the same share, not timed there. 0: mem_efficiency (the rule before 2026-12-07).
    gdn_decode_state_efficiency: float = 0.888
    gdn_prefill_request_cpu_s: float = 20.2e-6
    gdn_prefill_token_cpu_s: float = 1.865e-6
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
    # 1: with async scheduling, a step the engine core schedules while the GPU has no step of its
    # own (the engine was idle, or every running request had finished) pays its whole engine CPU
    # (step_overhead_s, seq_overhead_s): async_overlap hides a step's CPU behind the step before's
    # GPU work, and there is none. vLLM 0.26.0's step_with_batch_queue schedules and submits a
    # batch on the core's own thread (v1/engine/core.py:644-679; UniProcExecutor.collective_rpc runs
    # execute_model inline, v1/executor/uniproc_executor.py:97-106) before its kernels start, and
    # processes its output after they end (:688-705). Read after the low-load TTFT misses were seen,
    # nothing fitted. 0: every step hides async_overlap of its CPU (the rule before 2026-12-07).
    idle_step_cpu: float = 1.0
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
    moe_mem_share: float = _moe_rates.MOE_MEM_SHARE
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
    "gdn_decode_state_efficiency": (lambda v: 0.0 <= v <= 1.0, "a share of HBM bandwidth between 0 and 1 (0: mem_efficiency)"),
    "moe_compute_share": (lambda v: 0.0 <= v <= 1.0, "a share of the dense GEMM rate, at most 1 (0: the fitted one)"),
    "moe_mem_share": (lambda v: 0.0 < v <= 1.0, "a share of the dense weight-streaming rate: above 0, at most 1"),
    "class_rules": (lambda v: v in (0.0, 1.0), "1 (the model-class rules) or 0 (the rule before them)"),
    "moe_layer_floor_s": (lambda v: 0.0 <= v <= 1e-3, "seconds per MoE layer and step, 0 to 0.001"),
    "triton_attn_efficiency": (lambda v: 0.0 <= v <= 1.0, "a share of the dense peak, at most 1 (0: the fitted one)"),
    "attn_long_efficiency": (lambda v: 0.0 <= v <= 1.0, "a share of the dense peak, at most 1 (0: off)"),
    "attn_fit_context": (lambda v: v > 0.0, "tokens of context: above 0"),
    "moe_row_blocks": (lambda v: v in (0.0, 1.0), "1 (each kernel's row block, binomial padding) or 0 (the rule before)"),
    "idle_step_cpu": (lambda v: v in (0.0, 1.0), "1 (an idle GPU's first step pays its whole engine CPU) or 0 (the rule before)"),
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
    # Refit 2026-12-06 after GpuSpec.sm_count (the GEMM wave model on the A100's own 108 SMs, not an H100's
    # 132), the same fit runs and procedure (resume_hits 0, kv_read_efficiency first, then attn_efficiency
    # under it, until neither moves): kv_read_efficiency 0.5646 -> 0.4879, attn_efficiency 0.5077 -> 0.5063
    # (a second round moved neither; taken the other way round, attn_efficiency first, the rounds end at
    # 0.5002 and 0.4919).
    "A100-80GB": {"attn_efficiency": 0.5063, "kv_read_efficiency": 0.4879},
}

#: Published single-node ``all_reduce_perf`` bus bandwidths at large messages, GB/s, 8 GPUs over
#: NVLink with NVSwitch: the H200's 475 (NVIDIA/nccl-tests#272, https://github.com/NVIDIA/nccl-tests/issues/272,
#: 2024-11-27: "8x H200 connected via NVLINK4 ... peak bandwidth of 475 GB/s", NCCL 2.20.3) and the B200's
#: 830 (NVIDIA/nccl#1807, https://github.com/NVIDIA/nccl/issues/1807, 2025-08-13: "should the
#: all_reduce_perf performance of 8 B200s in a single machine reach 900+? Ours is 830+", NCCL 2.27.1),
#: against their links' datasheet rates each way (``planner.gpus``: 450 and 900 GB/s).
NCCL_ALLREDUCE_BUSBW_GBPS: dict[str, tuple[float, float]] = {"H200": (475.0, 450.0), "B200": (830.0, 900.0)}


def _busbw_share(gpu: str) -> float:
    """The share of its link's datasheet rate ``gpu``'s published all-reduce reaches (:data:`NCCL_ALLREDUCE_BUSBW_GBPS`)."""
    busbw, link = NCCL_ALLREDUCE_BUSBW_GBPS[gpu]
    return busbw / link


#: The B200's all-reduce share of its NVLink 5 rate: the H200's calibrated ``interconnect_efficiency``
#: (0.7) times the share the B200's published all-reduce keeps of the H200's (0.922 of its link against
#: 1.056: 0.874), 0.612. **Derived from published nccl-tests figures, not fitted**; added 2026-12-06
#: after the held-out B200 gpt-oss-120b runs (tests/fixtures/published_runs/nvlink_moe.yaml) had
#: been read, none of whose figures chose it.
B200_INTERCONNECT_EFFICIENCY: float = Calibration().interconnect_efficiency * _busbw_share("B200") / _busbw_share("H200")

#: B200 (HGX, NVLink 5): the all-reduce's share of its link from published nccl-tests figures; its dense
#: GEMMs at cuBLAS's published sustained rate (``_moe_rates.B200_CUBLAS_SHARE``, 0.631 of the peak, pytorch/ao#2427;
#: since 2026-12-07, the H200's 0.775 before); its MoE kernel's rates are :mod:`servetune.sim.perf_classes`'
#: Blackwell ones. Nothing fitted on a B200 run.
GPU_FAMILY_OVERRIDES["B200"] = {"interconnect_efficiency": B200_INTERCONNECT_EFFICIENCY,
                                "compute_efficiency": _moe_rates.B200_CUBLAS_SHARE}
#: GeForce RTX 5090 (GB202): its dense GEMMs at cuBLAS's published sustained rate (``_moe_rates.RTX5090_CUBLAS_SHARE``,
#: 1.123 of the datasheet peak, zzc0721/torch-performance-test-data; since 2026-12-07, the H200's 0.775 before).
#: Its memory-bound kernels keep the H200's ``mem_efficiency``: no published bandwidth figure was found. Nothing
#: fitted on an RTX 5090 run.
GPU_FAMILY_OVERRIDES["RTX-5090"] = {"compute_efficiency": _moe_rates.RTX5090_CUBLAS_SHARE}

#: The FlashAttention generation vLLM's FLASH_ATTN backend runs on an NVIDIA GPU, by compute
#: capability (vLLM 0.26 ``v1/attention/backends/fa_utils.get_flash_attn_version``: FA3 on major 9,
#: FA4 on major 10 where it is built, FA2 otherwise; the backend needs 8.0 or above). Every Ampere
#: and Ada part (8.0-8.9: A100, A10, L4, L40S, the RTX 30 and 40 series) runs the FA2 kernels whose
#: prefill rate was fitted on the A100 (``GPU_FAMILY_OVERRIDES["A100-80GB"]``), so they take that
#: share of their own dense peak instead of the H200's FA3 one. Applied to the other 8.x parts on
#: 2026-12-05 after their held-out published runs had been seen (docs/accuracy.md says so). The
#: GeForce and RTX PRO Blackwell parts (12.x: the RTX 5090) run FA2 too: FLASH_ATTN heads the
#: backend list of every major but 10 (``platforms/cuda.py`` ``_get_backend_priorities``, lines
#: 140-147 of 0.23.0, 157-164 of 0.28.0) and ``get_flash_attn_version`` falls back to FA2 off majors
#: 9 and 10 (lines 78-86 of 0.23.0, 92-100 of 0.28.0). Read 2026-12-07 after the held-out RTX 5090
#: runs' errors had been seen; nothing fitted.
FA2_COMPUTE_CAPABILITY: tuple[tuple[float, float], ...] = ((8.0, 9.0), (12.0, 13.0))
FA2_KNOBS: dict[str, float] = {"attn_efficiency": GPU_FAMILY_OVERRIDES["A100-80GB"]["attn_efficiency"]}


def runs_flash_attention_2(gpu: GpuSpec) -> bool:
    """Whether vLLM runs FlashAttention-2 on ``gpu`` (an NVIDIA part of compute capability 8.x or 12.x).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> [runs_flash_attention_2(get_gpu(n)) for n in ("A100-40GB", "L4", "RTX-3060", "RTX-5090", "H200", "B200", "T4")]
        [True, True, True, True, False, False, False]
    """
    return gpu.platform != "rocm" and any(low <= gpu.compute_capability < high for low, high in FA2_COMPUTE_CAPABILITY)


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
