"""What a model class takes in vLLM's profile run: activations, the sampler, CUDA graphs, the runner's state.

The per-model pieces of :func:`servetune.planner.memory.plan_memory`, apart from the accounting
that sums them: the profile run's activation peak (dense and MoE MLPs, the cold-compile floor),
the dummy sampler's peak by runner, the V2 runner's persistent sampler state, the CUDA-graph pool,
and the model as served (``--dtype``, online fp8). A new model class (sliding-window attention,
another MoE layout) adds its term here; what changes with the vLLM version comes from
:func:`servetune.planner.vllm_rules.memory_rules`.

The calibrated constants sit together under "Calibration" with the real vLLM 0.26.0 / H200
evidence they were fitted on.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from servetune.planner._moe_experts import moe_workspace_bytes
from servetune.planner._vision_towers import multimodal_profile_bytes, qwen3_vl_encoder_profile
from servetune.planner.modelinfo import ModelProfile
from servetune.planner.vllm_rules import GiB, memory_rules

if TYPE_CHECKING:
    from servetune.planner.engine_config import EngineConfig

__all__ = ["ACT_FIXED_GIB", "COLD_COMPILE_FLOOR_TENSORS", "ACT_MLP_ELEMS_PER_TOKEN", "ACT_HIDDEN_ELEMS_PER_TOKEN_COMPILED",
           "ACT_HIDDEN_ELEMS_PER_TOKEN_EAGER", "SAMPLER_BYTES_PER_LOGIT", "SAMPLER_BYTES_PER_LOGIT_V1",
           "SAMPLER_V1_TRITON_FP32_COPIES", "SAMPLER_V1_FLASHINFER_FP32_COPIES", "SAMPLER_V1_TRITON_MIN_ROWS", "SAMPLER_V1_TRITON_BUFFER_ROWS",
           "WARMUP_SHORTFALL_GIB",
           "CUDAGRAPH_FIXED_GIB", "CUDAGRAPH_GIB_PER_CAPTURED_TOKEN", "CUDAGRAPH_CALIBRATED_MAX_SIZE",
           "effective_model", "activation_peak_bytes", "sampler_profile_bytes", "sampler_warmup_bytes",
           "persistent_runner_bytes",
           "cudagraph_memory_bytes"]

# =============================================================================== Calibration
# Every fitted constant is here. Evidence: vLLM 0.26.0 (V2 model runner) on one H200 with the
# servetune test model (852.6M params, hidden 2048, 16 layers, intermediate 5632, vocab 32000,
# bf16), logs in tests/fixtures/real_h200/*/server.log. The worker's
# "Actual usage is W GiB for weight, P GiB for peak activation, N GiB for non-torch memory, and
# C GiB for CUDAGraph memory" line gives P, N, C; "Available KV cache memory" and the KV-token
# line pin the sum to ~0.0005 GiB (one 0.5 MiB block):
#   mbt 8192, compiled : P 0.44, N 0.22, available 67.64 (138,533 blocks)   a1, a2, a3, b3, b4
#   mbt 8192, eager    : P 0.38, N 0.22, available 67.70 (138,653 blocks)   b1
#   mbt 2048, compiled : P 0.18, N 0.22, available 67.91 (139,073 blocks)   b2
#   TP=2, mbt 8192     : P 0.30, N 0.06, W 0.81, available 68.73 (281,499 blocks)   server_tp2
#   PP=2 (README)      : 4,495,664 tokens
# Solved against the block counts (budget 69.9 GiB, weights 1.5890 GiB = 852.6M params in bf16
# plus the 1 MiB rotary cache):
#   P + N = 0.6677 (compiled), 0.6093 (eager), 0.4040 (mbt 2048)
#   -> N = 0.2235; P(T) = 0.0925 GiB + T * 2 B * (3*I/tp + k*H) with k = 3.00 compiled, 1.13 eager.
# The per-token term is the gated MLP (gate_up output 2*I plus the activation output I, sharded by
# TP) plus k hidden-size buffers (torch.compile keeps ~2 more piecewise-graph boundary buffers
# than eager). The fixed 0.0925 GiB does not move with max_num_seqs (64 and 256 both log 0.44),
# so the sampler's [num_reqs, vocab] logits peak after the forward peak: peak = max(forward, sampler).
#
# The compiled k = 3.00 is what a start pays when it compiles its graphs on the node (the first
# start of that compile configuration: max_num_seqs, max_num_batched_tokens, max_model_len,
# TP/PP, ...). A later start of the same configuration, whose graphs and Triton kernels come from
# the node's caches, profiles the eager peak (k = 1.13): 0.38 GiB instead of 0.44 at mbt 8192.
# The real H200 starts kept follow this (a configuration whose earlier start failed after
# compiling counts as cached: the grid's 0.05 x 128 after 0.012 x 128), and the controlled pair on one host
# (compile_cache/cache_cold vs cache_warm: same flags, fresh then filled VLLM_CACHE_ROOT /
# TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR) logs 155,088 then 157,008 KV tokens.
ACT_FIXED_GIB = 0.0925
#: A start that compiles its graphs (vLLM's compile cache misses, see compile_key) profiles at least
#: COLD_COMPILE_FLOOR_TENSORS x one [vocab / tp, hidden] tensor in the model dtype (the embedding's /
#: LM head's size), whatever its token budget. Real H200 cold starts (tests/fixtures/real_h200/scale
#: and study_l8b), logged peak against that tensor (E) and the per-token forward peak above (F):
#:   8B  mbt 2048 (4 starts): 1.01 GiB = 1.03 E;  F 0.30
#:   8B  mbt 8192 (6 starts): 1.10     = 1.12 E;  F 0.93
#:   8B  mbt 16384:           1.78;               F 1.78 (E 0.98)
#:   14B mbt 8192 (2 starts): 1.61     = 1.11 E;  F 0.96
#:   14B mbt 16384:           1.83;               F 1.83 (E 1.45)
#:   0.85B mbt 2048 / 8192:   0.18 / 0.44;        F 0.18 / 0.44 (E 0.12)
#: Warm starts of the same configurations (0.24 / 0.88 GiB at 8B) and eager ones (14B: 0.98) stay
#: below it, so it is a compile-time allocation, not the forward pass; which tensor vLLM's or
#: torch.compile's cold path materialises is not settled. Applied on the V2 runner (0.26, and assumed
#: for its 0.22-0.25 default models, whose V2 runner was not measured): the
#: published 0.19.1 start (Qwen3-8B, A100-40GB, its compile cache state unknown) logs less than it.
#: 1.08 centres the three binding rows (8B 2048 +0.05 GiB, 8B 8192 -0.04, 14B -0.04): read off
#: these starts, so no held-out figure.
COLD_COMPILE_FLOOR_TENSORS = 1.08
ACT_MLP_ELEMS_PER_TOKEN = 3.0  # times intermediate_size / tp
ACT_HIDDEN_ELEMS_PER_TOKEN_COMPILED = 3.0  # times hidden_size
ACT_HIDDEN_ELEMS_PER_TOKEN_EAGER = 1.13  # also a compiled start whose graphs come from a warm cache
#: Sampler warm-up over num_reqs rows: bf16 logits + fp32 logits + fp32 probabilities. Not
#: visible in the test-model logs (its vocab is small); an estimate, used only where it exceeds
#: the forward peak (large vocab, many sequences). vLLM 0.26's V2 model runner.
SAMPLER_BYTES_PER_LOGIT = 10
#: The same for the V1 model runner (vLLM 0.11-0.25), whose profile run ends with the dummy
#: sampler over min(max_num_batched_tokens, max_num_seqs) rows and keeps several fp32
#: [num_reqs, vocab] buffers alive at its peak. Fitted on the published starts
#: llmd_llama31_8b_tp1 and llmd_qwen3_06b_tp1_16k (tests/fixtures/published_logs/index.yaml;
#: vLLM 0.11.0, H100, 1024 rows: "torch peak memory increase" 4.76 GiB at vocab 128,256 and 5.56
#: at 151,936): (peak - ACT_FIXED_GIB) / (rows * vocab), mean 37.95 B per logit (~9.5 fp32
#: copies). Judged on the held-out starts of that file (benchmarks/published_logs.py). Reach:
#: the PyTorch-native top-k/top-p of the V1 runner up to 0.17, which sorts the fp32 logits
#: (``apply_top_k_top_p``: logits.sort, then a scatter; PyTorch's segmented sort adds its own
#: workspace): the published 0.11.0 starts' ~38 B a logit is that path's size (FlashInfer's
#: sampler, opt-in from vLLM PR #26859, keeps ~14), and the held-out 0.11.0 T4 start, whose log
#: says it fell back to the PyTorch-native path, is within 1.3%.
SAMPLER_BYTES_PER_LOGIT_V1 = 37.95
#: From vLLM 0.17 the V1 runner's top-k/top-p is a Triton kernel for batches of 8 rows or more
#: (``vllm/v1/sample/ops/topk_topp_sampler.py: apply_top_k_top_p`` -> ``apply_top_k_top_p_triton``
#: in ``topk_topp_triton.py``; in the 0.17.0, 0.17.1 and 0.18.0 wheels, absent from 0.11.2, 0.15.1 and
#: 0.16.0), which masks the fp32 logits in place instead of sorting them. The dummy sampler run
#: (``gpu_model_runner.py: _dummy_sampler_run``, v0.19.1) then peaks in ``random_sample`` with four
#: [num_reqs, vocab] tensors alive, none of them a sort's workspace: the model-dtype logits that
#: ``_dummy_sampler_run`` holds, their fp32 copy (``sampler.py: logits.to(torch.float32)``), the
#: softmax probabilities and the exponential noise ``q`` (``probs.div_(q)`` is in place). Counted,
#: not fitted: dtype_bytes + 3 x 4 bytes per logit (14 in bf16), plus the kernel's cached fp32
#: buffer of min(next_pow2(min(SMs, rows)), SMs) rows x vocab; SMs is taken as 128 (A100 108,
#: H100 132, L40S 142: +-14 rows, under 9 MiB at a 152k vocab). Below 8 rows the PyTorch sort
#: path (SAMPLER_BYTES_PER_LOGIT_V1) still runs.
SAMPLER_V1_TRITON_FP32_COPIES = 3
#: vLLM 0.10.x's dummy sampler through FlashInfer (``VllmMemoryRules.flashinfer_topk_topp``): the
#: model-dtype logits ``_dummy_sampler_run`` holds, their fp32 copy (``sampler.py``), then
#: FlashInfer 0.2.11's ``top_k_top_p_sampling_from_logits`` (its default ``top_k_first`` order):
#: ``top_k_mask_logits`` (a new fp32 tensor) and ``torch.softmax`` of it (another), no sort.
#: Counted, not fitted: dtype_bytes + 3 x 4 bytes a logit (14 in bf16).
SAMPLER_V1_FLASHINFER_FP32_COPIES = 3
SAMPLER_V1_TRITON_MIN_ROWS = 8
SAMPLER_V1_TRITON_BUFFER_ROWS = 128
#: What the V1 runner's sampler warm-up after graph capture found free on real vLLM 0.26.0 starts, below
#: the planner's figure for it (``memory._Accounting.warmup_free``), in GiB. Read off the allocator probe
#: (``benchmarks/real_vllm/alloc_probe``) of the eight 2026-12-06 H100 SXM starts in
#: ``tests/fixtures/real_h100_classes`` (README, "Fourth set"). The top, the only figure a rule uses (the
#: warning, ``memory.warmup_note``), is read off the first machine's three gpt-oss-20b starts (0.98 warm twice,
#: 1.89 cold); the other five, judged on it, lacked 0.41-1.89 (none more), and the published vLLM 0.19.0
#: gpt-oss-20b deaths 1.90 and 1.91 (their OOM lines). The bottom, 0.41 (the Qwen3-30B-A3B shape, warm), is
#: the least over all eight, a description only: read off the first three it would have been 0.98, which
#: three of the five others undercut, so no margin is called a failure on it. What it is: the graph pool
#: captured beyond vLLM's profiled estimate, which is what the KV budget takes off (0.16 / 0.46 GiB), blocks
#: the caching allocator keeps free that the sampler's ``[rows, vocab]`` fp32 tensors do not fit in (0.06-0.29
#: GiB warm; 0.19-1.21 cold: compilation leaves them), and the runner's buffers; at 0.19.0 (graphs outside
#: the budget) the 1.78 / 1.62 GiB "reserved by PyTorch but unallocated". ``capture_model`` empties the cache
#: before and after capture (``gpu_model_runner.py`` 6008 and 6036 of 0.19.0, 6804 and 6834 of 0.26.0), and
#: ``_dummy_sampler_run`` follows it (``gpu_worker.py`` 588 -> 686 of 0.19.0), so only blocks split
#: off a segment that still holds a live tensor stay reserved and free: which ones is the load's and the
#: compiler's history, not in vLLM's source. Measured, never a verdict.
WARMUP_SHORTFALL_GIB = (0.41, 1.89)
#: Non-torch growth and the memory in use before the init snapshot (CUDA context, NCCL and
#: all-reduce buffers) depend on the parallel layout and on the environment the server runs with
#: (NVLink multicast): servetune.planner.comm holds those constants and the one function.
#: CUDA-graph pool ("Graph capturing finished ... took C GiB"): 0.15 GiB for 19 PIECEWISE + 11
#: FULL graphs (max_num_seqs 64), 0.21 for 35 + 19 (128), 0.36 for 51 + 35 (256); TP=2 0.16.
#: Least squares through the 64-seq point: C = 0.128 GiB + 1.57e-5 GiB * sum(captured batch sizes),
#: i.e. ~4 hidden-size bf16 buffers (16.9 KB at hidden 2048) kept per captured token; the
#: per-token term is scaled by hidden_size * dtype_bytes for other models.
CUDAGRAPH_FIXED_GIB = 0.128
CUDAGRAPH_GIB_PER_CAPTURED_TOKEN = 1.57e-5
_CUDAGRAPH_REF_HIDDEN_BYTES = 2048 * 2
CUDAGRAPH_CALIBRATED_MAX_SIZE = 512


def effective_model(model: ModelProfile, config: EngineConfig) -> ModelProfile:
    """The model as served: ``--dtype`` and online ``--quantization fp8`` change the weight bytes;
    ``--language-model-only`` leaves a vision tower out (its weights and its pass in the profile run)."""
    changes: dict[str, Any] = {}
    if config.language_model_only and (model.vision_params or model.vision_encoder is not None):
        changes.update(vision_params=0, vision_encoder=None)
    if config.dtype not in ("auto", model.dtype):
        changes["dtype"] = "bfloat16" if config.dtype == "bfloat16" else config.dtype
    if config.quantization == "fp8" and model.quantization is None:
        changes.update(quantization="fp8", quant_bytes_per_param=1.0)
    return dataclasses.replace(model, **changes) if changes else model


def activation_peak_bytes(model: ModelProfile, config: EngineConfig, *, last_stage: bool = True,
                          compile_cache_warm: bool = False, first_stage: bool = True) -> int:
    """Peak torch allocation of vLLM's profile run on one GPU (the "peak activation" it logs).

    The dummy batch is ``max_num_batched_tokens`` tokens over ``num_reqs = min(mbt, max_num_seqs)``
    requests; the last PP stage then runs the sampler over ``num_reqs`` rows. ``compile_cache_warm``:
    the node's compile cache already holds this configuration (see :func:`servetune.planner.memory.compile_key`), so
    the start profiles the smaller (eager-like) peak. Constants: see "Calibration" above. A Qwen3-VL-style
    vision tower (``model.vision_encoder``, on the first stage) first runs the dummy image through the encoder:
    the peak is the larger of that pass and the language model's, which runs with the pixels and the encoder
    outputs still held (:func:`servetune.planner.modelclass.qwen3_vl_encoder_profile`).
    """
    text = _text_profile_peak(model, config, last_stage=last_stage, compile_cache_warm=compile_cache_warm)
    if model.vision_encoder is None or not first_stage:
        return text
    enc = qwen3_vl_encoder_profile(model.vision_encoder, model.dtype_bytes, config.tensor_parallel_size,
                                   config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len,
                                   formatted_video=config.rules.qwen3_vl_formatted_video)
    return max(text + enc.held_bytes, enc.peak_bytes)


def _text_profile_peak(model: ModelProfile, config: EngineConfig, *, last_stage: bool,
                       compile_cache_warm: bool) -> int:
    """The language model's part of :func:`activation_peak_bytes`: its dummy forward, then the sampler."""
    tokens = config.max_num_batched_tokens
    dp = config.expert_data_parallel(model.is_moe)
    compiling = not (config.enforce_eager or compile_cache_warm)
    # The floor is seen on vLLM 0.26's V2 runner only; a published 0.19.1 start logs less than it.
    cold_floor = compiling and config.rules.v2_runner
    hidden_elems = ACT_HIDDEN_ELEMS_PER_TOKEN_COMPILED if compiling else ACT_HIDDEN_ELEMS_PER_TOKEN_EAGER
    # Triton fused-MoE experts run in workspaces kept past the forward (modelclass.moe_workspace_bytes) from 0.11;
    # before, freed after each layer, they count in the forward only (VllmMemoryRules.moe_workspace_kept)
    # Under DP (a MoE model, no expert parallelism) each MoE layer all-gathers every replica's dummy batch, the
    # profile run's ranks padded alike (EngineConfig.expert_data_parallel), and runs it on experts split over tp x dp.
    # Under --enable-expert-parallel the kernel runs whole experts: N = 2 x intermediate, not sliced
    # (TritonExperts.workspace_shapes: fused_moe/experts/triton_moe.py:181-196@0.26.0, N from the local w13).
    workspace = moe_workspace_bytes(model, tokens * dp, config.expert_tensor_parallel_size(model.is_moe)) \
        if config.rules.moe_workspace_kept else 0
    inter = model.expert_intermediate_size * model.num_experts_per_tok if model.is_moe and not workspace \
        else (0 if model.is_moe else model.intermediate_size)
    inter += model.shared_expert_intermediate_size
    per_token = model.dtype_bytes * (ACT_MLP_ELEMS_PER_TOKEN * inter / config.tensor_parallel_size
                                     + hidden_elems * model.hidden_size)
    forward = ACT_FIXED_GIB * GiB + tokens * per_token
    # The other replicas' gathered hidden states and router logits (the per-token MLP term, tokens x inter / tp, is
    # unchanged: dp times the tokens on experts dp times narrower)
    forward += (dp - 1) * tokens * (model.hidden_size + model.num_experts) * model.dtype_bytes
    if cold_floor:
        # A start that compiles never profiles below one vocab-parallel embedding-sized tensor
        # (COLD_COMPILE_FLOOR_TENSORS' note): 8B and 14B cold starts at small token budgets.
        vocab_rows = -(-model.vocab_size // config.tensor_parallel_size)
        forward = max(forward, COLD_COMPILE_FLOOR_TENSORS * vocab_rows * model.hidden_size * model.dtype_bytes)
    held = workspace + multimodal_profile_bytes(model, tokens)  # kept through the sampler's run too
    if not last_stage:
        return int(forward + held)
    num_reqs = min(tokens, config.max_num_seqs)
    return int(max(forward, ACT_FIXED_GIB * GiB + sampler_profile_bytes(model, config, num_reqs)) + held)


def sampler_profile_bytes(model: ModelProfile, config: EngineConfig, num_reqs: int) -> int:
    """Peak torch memory of the profile run's dummy sampler over ``num_reqs`` rows, by runner and version.

    The dummy sampler asks for top-k (vocab - 1) and top-p (0.9) on every row, so what decides the
    peak is how that version applies them: the V1 runner up to 0.16 sorts the fp32 logits
    (fitted: SAMPLER_BYTES_PER_LOGIT_V1) where 0.10.x runs FlashInfer's (counted:
    SAMPLER_V1_FLASHINFER_FP32_COPIES), the V1 runner from 0.17 masks them in place with a Triton
    kernel (counted from the source: SAMPLER_V1_TRITON_*; from 0.21 FlashInfer's call runs first and
    the native call still peaks: ``VllmMemoryRules.flashinfer_sampler_default``), the V2 runner (the
    default for some models from 0.22) skips top-k/top-p in its dummy run (SAMPLER_BYTES_PER_LOGIT, an
    estimate).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.engine_config import resolve_engine_config
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("llama-3.1-8b"), get_gpu("A100-40GB")
        >>> sort = sampler_profile_bytes(m, resolve_engine_config({}, m, g, "0.11.2"), 256)
        >>> triton = sampler_profile_bytes(m, resolve_engine_config({}, m, g, "0.19.1"), 256)
        >>> round(sort / 2**30, 3), round(triton / 2**30, 3)
        (1.16, 0.489)
    """
    rules = config.rules
    logits = num_reqs * model.vocab_size
    if rules.v2_runner:
        return int(logits * SAMPLER_BYTES_PER_LOGIT)
    if rules.flashinfer_topk_topp:
        return int(logits * (model.dtype_bytes + 4 * SAMPLER_V1_FLASHINFER_FP32_COPIES))
    if rules.triton_topk_topp and num_reqs >= SAMPLER_V1_TRITON_MIN_ROWS:
        buffer_rows = min(1 << (min(num_reqs, SAMPLER_V1_TRITON_BUFFER_ROWS) - 1).bit_length(),
                          SAMPLER_V1_TRITON_BUFFER_ROWS)
        return int(logits * (model.dtype_bytes + 4 * SAMPLER_V1_TRITON_FP32_COPIES)
                   + buffer_rows * model.vocab_size * 4)
    return int(logits * SAMPLER_BYTES_PER_LOGIT_V1)


def sampler_warmup_bytes(model: ModelProfile, config: EngineConfig) -> tuple[int, int]:
    """``(rows, bytes)`` the V1 runner's sampler warm-up allocates after CUDA-graph capture; ``(rows, 0)`` where none runs.

    ``compile_or_warm_up_model`` (``v1/worker/gpu_worker.py``) runs, after ``capture_model``, a dummy
    forward of ``min(max_num_seqs, max_num_batched_tokens)`` tokens and ``_dummy_sampler_run`` over as many
    rows (:attr:`~servetune.planner.vllm_rules.VllmMemoryRules.sampler_warmup_after_capture`): the same
    sampler call as the profile run's, so the same tensors (:func:`sampler_profile_bytes`), now allocated
    in what the KV cache and the graphs left free rather than inside the profiled budget.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.engine_config import resolve_engine_config
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("gpt-oss-20b"), get_gpu("H100-80GB")
        >>> rows, need = sampler_warmup_bytes(m, resolve_engine_config({}, m, g, "0.19.0"))
        >>> rows, round(need / 2**30, 2)
        (1024, 2.78)
        >>> dense = load_model("llama-3.1-8b")  # on 0.26's V2 runner: no sampler warm-up of this kind
        >>> sampler_warmup_bytes(dense, resolve_engine_config({}, dense, g, "0.26.0"))[1]
        0
    """
    rows = min(config.max_num_seqs, config.max_num_batched_tokens)
    if not config.rules.sampler_warmup_after_capture:
        return rows, 0
    return rows, sampler_profile_bytes(model, config, rows)


def persistent_runner_bytes(model: ModelProfile, config: EngineConfig) -> int:
    """Torch memory the model runner holds from load to serving that 0.27+ charges to the KV budget (0 before).

    The V2 runner's sampler is built after the weights are measured (``v1/worker/gpu/model_runner.py:
    load_model``) and keeps per-request penalty state (``v1/worker/gpu/sample/penalties.py``,
    v0.28.0: ``output_bin_counts`` int32 [max_num_seqs, vocab], "can be very large, taking up GBs
    of GPU memory", and ``prompt_bin_mask`` int32 [max_num_seqs, vocab/32]). 0.26's accounting
    (weights + torch peak increase + non-torch growth) never sees it; 0.27+'s ``total_consumed``
    does, and vLLM 0.28's own breakdown counts it under "consumed memory (weights + non-torch)".
    The runner's other persistent buffers (token ids, block tables, input buffers) are ignored here:
    tens of MiB at most for the default batch sizes.

    The V1 runner (MoE and hybrid models, :func:`~servetune.planner.vllm_rules.runs_v2_runner`) holds no
    such sampler state, but is itself built after vLLM's init snapshot, so 0.27+ charges its
    ``inputs_embeds`` buffer: ``max_num_batched_tokens x hidden`` in the model dtype, allocated for every
    model (``VllmMemoryRules.charges_v1_runner_buffers``); its other buffers are under 1 MiB a thousand tokens.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.engine_config import resolve_engine_config
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("llama-3.1-8b"), get_gpu("L40S")
        >>> persistent_runner_bytes(m, resolve_engine_config({}, m, g, "0.26.0"))
        0
        >>> round(persistent_runner_bytes(m, resolve_engine_config({}, m, g, "0.28.0")) / 2**30, 3)
        0.126
        >>> moe = load_model("qwen3-30b-a3b")  # the V1 runner: 2,048 batched tokens x 2,048 hidden x 2 bytes
        >>> persistent_runner_bytes(moe, resolve_engine_config({}, moe, g, "0.28.0")) / 2**20
        8.0
    """
    if config.kv_cache_memory_bytes is not None:
        return 0
    if config.rules.charges_persistent_runner:
        return config.max_num_seqs * (model.vocab_size + -(-model.vocab_size // 32)) * 4
    if config.rules.charges_v1_runner_buffers and not config.rules.v2_runner:
        # the V1 runner's inputs_embeds [max_num_tokens, hidden] (VllmMemoryRules.charges_v1_runner_buffers)
        return config.max_num_batched_tokens * model.hidden_size * model.dtype_bytes
    return 0


def cudagraph_memory_bytes(model: ModelProfile, config: EngineConfig) -> int:
    """Predicted CUDA-graph pool per GPU ("Graph capturing finished ..., took X GiB"); 0 under eager."""
    if config.enforce_eager or not config.cudagraph_capture_sizes:
        return 0
    captured_tokens = sum(config.cudagraph_capture_sizes) + sum(config.full_cudagraph_sizes)
    scale = model.hidden_size * model.dtype_bytes / _CUDAGRAPH_REF_HIDDEN_BYTES
    return int((CUDAGRAPH_FIXED_GIB + CUDAGRAPH_GIB_PER_CAPTURED_TOKEN * captured_tokens * scale) * GiB)

