"""vLLM's startup, predicted: how a flag set resolves, where the GPU memory goes, how many KV blocks.

Two pure functions, no I/O:

* :func:`resolve_engine_config` turns the flags a trial sets into an :class:`EngineConfig` with
  every value vLLM would pick by itself for that version, model and GPU (usage-context batch
  defaults by GPU memory tier, ``gpu_memory_utilization`` 0.9 / 0.92, ``max_model_len`` from the
  config, the CUDA-graph capture sizes). Combinations vLLM refuses at startup raise
  :class:`~servetune.errors.SpecError` naming the flag, with vLLM's own message.
* :func:`plan_memory` replays the V1 worker's memory profiling (vLLM's ``determine_available_memory`` in
  ``vllm/v1/worker/gpu_worker.py``, per version):
  budget = ``total * gpu_memory_utilization`` (or ``kv_cache_memory_bytes``), minus weights, the
  profile run's activation peak, the non-torch growth and, where that version subtracts it, the
  CUDA-graph estimate; the rest becomes KV blocks (``vllm/v1/core/kv_cache_utils.py``, minimum over workers), KV tokens and the
  maximum concurrency, or a startup failure with vLLM's error text.

The calibrated constants (activation peak, non-torch memory, CUDA-graph memory, startup time) sit
together under "Calibration" with the real vLLM 0.26.0 / H200 evidence they were fitted on.

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
from collections.abc import Mapping
from typing import Any

from servetune.errors import SpecError
from servetune.planner.comm import SERVETUNE_LAUNCH_ENV, CommEnv, CommMemory, comm_memory
from servetune.planner.flags import validate_flags
from servetune.planner.gpus import GpuSpec
from servetune.planner.modelclass import (KVLayout, as_loaded_on, class_notes, kv_layout, moe_workspace_bytes,
                                          multimodal_profile_bytes)
from servetune.planner.modelinfo import ModelProfile
from servetune.result import MemoryBreakdown, TrialStatus
from servetune.vllm_version import DEFAULT_VLLM_VERSION, VERSION_RE, Version

__all__ = ["DEFAULT_VLLM_VERSION", "EngineConfig", "MemoryPlan", "resolve_engine_config", "plan_memory",
           "parse_vllm_version", "capture_sizes_for", "activation_peak_bytes", "cudagraph_memory_bytes",
           "batch_defaults", "compile_key", "sampler_profile_bytes", "persistent_runner_bytes"]

GiB = 1 << 30
MiB = 1 << 20


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
#: torch.compile's cold path materialises is not settled. Applied from the V2 runner (0.26) on: the
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
#: From vLLM 0.18 the V1 runner's top-k/top-p is a Triton kernel for batches of 8 rows or more
#: (``vllm/v1/sample/ops/topk_topp_sampler.py: apply_top_k_top_p`` -> ``apply_top_k_top_p_triton``
#: in ``topk_topp_triton.py``; first seen in the 0.18.0 wheel, absent from 0.11.2, 0.12-0.17 not
#: read), which masks the fp32 logits in place instead of sorting them. The dummy sampler run
#: (``gpu_model_runner.py: _dummy_sampler_run``, v0.19.1) then peaks in ``random_sample`` with four
#: [num_reqs, vocab] tensors alive, none of them a sort's workspace: the model-dtype logits that
#: ``_dummy_sampler_run`` holds, their fp32 copy (``sampler.py: logits.to(torch.float32)``), the
#: softmax probabilities and the exponential noise ``q`` (``probs.div_(q)`` is in place). Counted,
#: not fitted: dtype_bytes + 3 x 4 bytes per logit (14 in bf16), plus the kernel's cached fp32
#: buffer of min(next_pow2(min(SMs, rows)), SMs) rows x vocab; SMs is taken as 128 (A100 108,
#: H100 132, L40S 142: +-14 rows, under 9 MiB at a 152k vocab). Below 8 rows the PyTorch sort
#: path (SAMPLER_BYTES_PER_LOGIT_V1) still runs.
SAMPLER_V1_TRITON_FP32_COPIES = 3
SAMPLER_V1_TRITON_MIN_ROWS = 8
SAMPLER_V1_TRITON_BUFFER_ROWS = 128
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
_CUDAGRAPH_CALIBRATED_MAX_SIZE = 512
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

# ================================================================================ versions
_MIN_VERSION: Version = (0, 11, 0)
#: First version whose profiling these constants take from the V2 model runner (0.26, the real
#: H200 runs); before it, the V1 runner's profile run (the published 0.11 starts).
_V2_RUNNER: Version = (0, 26, 0)
#: First version whose V1 runner masks top-k/top-p with the Triton kernel (see SAMPLER_V1_TRITON_*).
_TRITON_TOPK_TOPP: Version = (0, 18, 0)
#: First version whose ``memory_profiling`` (``vllm/utils/mem_utils.py``) charges the KV budget with
#: ``total_consumed`` (the free-memory drop since the init snapshot, from mem_get_info) plus the
#: transient peak, instead of weights + torch peak increase + non-torch growth: first seen in the
#: 0.27.0 wheel (0.26.0 has the old sum). Everything torch allocated after the init snapshot and
#: still holds after profiling is now charged; see :func:`persistent_runner_bytes`.
_TOTAL_CONSUMED_ACCOUNTING: Version = (0, 27, 0)


def parse_vllm_version(version: str) -> Version:
    """``"0.26.0"`` / ``"v0.26"`` / ``"0.26.0rc1"`` -> ``(0, 26, 0)``; SpecError for V0-era or bad text.

    Example:
        >>> parse_vllm_version("v0.13.0rc2")
        (0, 13, 0)
    """
    m = VERSION_RE.fullmatch(str(version).strip())
    if not m:
        raise SpecError("vllm_version", f"cannot read {version!r} as a vLLM version", "write e.g. 0.26.0")
    v = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
    if v < _MIN_VERSION:
        raise SpecError("vllm_version", f"{version} predates the V1 engine's memory profiler (0.11.0)",
                        "use vLLM 0.11.0 or newer")
    return v


def _default_utilization(v: Version) -> float:
    return 0.92 if v >= (0, 20, 0) else 0.9  # 0.9 -> 0.92 in 0.20 (vllm/engine/arg_utils.py)


def _cudagraph_estimate_subtracted(v: Version) -> bool:
    """Whether that version takes the CUDA-graph estimate out of the KV budget.

    ≤0.16: no estimate at all; 0.18/0.19: only with VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1
    (default 0); 0.20-0.25: on by default (V1 model runner). 0.26: the real H200
    logs show it is NOT subtracted (69.9 - 1.59 - 0.44 - 0.22 = 67.65 ≈ the logged 67.64; no
    "Estimated CUDA graph memory" line): 0.26 runs the V2 model runner, which has no profiling pass.
    Later versions are assumed to keep the V2 runner's behaviour until logs say otherwise.
    """
    return (0, 20, 0) <= v < (0, 26, 0)


def batch_defaults(gpu: GpuSpec, v: Version) -> tuple[int, int]:
    """``vllm serve`` usage-context defaults ``(max_num_batched_tokens, max_num_seqs)`` for the GPU.

    ``EngineArgs.get_batch_defaults``: ≥160 GiB (0.29+) 16384/1024; ≥70 GiB and not A100/GB10
    8192/1024; otherwise 2048/256.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> batch_defaults(get_gpu("H200"), (0, 26, 0)), batch_defaults(get_gpu("A100-80GB"), (0, 26, 0))
        ((8192, 1024), (2048, 256))
    """
    name = gpu.name.lower()
    if v >= (0, 29, 0) and gpu.memory_gib >= 160:
        return 16384, 1024
    if gpu.memory_gib >= 70 and "a100" not in name and "gb10" not in name:
        return 8192, 1024
    return 2048, 256


# ============================================================================ EngineConfig
@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine flag resolved the way vLLM resolves it for one version, model and GPU.

    ``dtype`` and ``quantization`` (after ``vllm_version``) are servetune additions: the
    ``--dtype`` / ``--quantization`` flags, ``"auto"`` / ``None`` when not set.
    """

    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    num_gpu_blocks_override: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    enforce_eager: bool
    cudagraph_capture_sizes: tuple[int, ...]  # ascending; () under enforce_eager
    kv_cache_dtype: str
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    block_size: int
    long_prefill_token_threshold: int
    scheduling_policy: str
    async_scheduling: bool
    vllm_version: str
    dtype: str = "auto"
    quantization: str | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def version(self) -> Version:
        return parse_vllm_version(self.vllm_version)

    @property
    def max_cudagraph_capture_size(self) -> int:
        return self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0

    @property
    def full_cudagraph_sizes(self) -> tuple[int, ...]:
        """Sizes that also get a FULL decode graph (FULL_AND_PIECEWISE: 1 <= size <= max_num_seqs)."""
        return tuple(s for s in self.cudagraph_capture_sizes if s <= self.max_num_seqs)

    @property
    def num_cudagraphs(self) -> int:
        """PIECEWISE graphs (one per size) plus FULL decode graphs: the log's "19 + 11"."""
        return len(self.cudagraph_capture_sizes) + len(self.full_cudagraph_sizes)

    def as_flags(self) -> dict[str, Any]:
        """vLLM flag names -> values, what ``vllm serve`` would be given to start exactly this engine.

        Example:
            >>> from servetune.planner.gpus import get_gpu
            >>> from servetune.planner.modelinfo import load_model
            >>> c = resolve_engine_config({"enforce_eager": True}, load_model("llama-3.1-8b"), get_gpu("L40S"))
            >>> c.as_flags()["max_num_batched_tokens"], "cudagraph_capture_sizes" in c.as_flags()
            (2048, False)
        """
        out: dict[str, Any] = {
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "enforce_eager": self.enforce_eager,
            "kv_cache_dtype": self.kv_cache_dtype,
            "enable_prefix_caching": self.enable_prefix_caching,
            "enable_chunked_prefill": self.enable_chunked_prefill,
            "block_size": self.block_size,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "scheduling_policy": self.scheduling_policy,
            "async_scheduling": self.async_scheduling,
        }
        if self.kv_cache_memory_bytes is not None:
            out["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.num_gpu_blocks_override is not None:
            out["num_gpu_blocks_override"] = self.num_gpu_blocks_override
        if not self.enforce_eager:
            out["cudagraph_capture_sizes"] = list(self.cudagraph_capture_sizes)
        if self.dtype != "auto":
            out["dtype"] = self.dtype
        if self.quantization is not None:
            out["quantization"] = self.quantization
        return out


def capture_sizes_for(v: Version, *, max_num_seqs: int, max_num_batched_tokens: int,
                      user_sizes: list[int] | None = None, user_max: int | None = None,
                      blackwell: bool = False) -> tuple[int, ...]:
    """vLLM's CUDA-graph capture sizes (``config/vllm.py: _set_cudagraph_sizes``), ascending.

    0.11: ``[1, 2, 4] + range(8, N+1, 8)`` with ``N = min(2*max_num_seqs, 512)``. ≥0.13: step 8 to
    248, then step 16 from 256, capped at ``min(max_num_batched_tokens, max_cg)``; ≥0.25 appends
    ``max_num_batched_tokens`` when ≤ the cap; ≥0.33 appends ``max_num_seqs`` likewise. User lists
    are kept as given, filtered to ``≤ max_num_batched_tokens``.

    Example:
        >>> s = capture_sizes_for((0, 26, 0), max_num_seqs=64, max_num_batched_tokens=8192)
        >>> len(s), s[:5], s[-1]
        (19, (1, 2, 4, 8, 16), 128)
    """
    if user_sizes:
        sizes = sorted({s for s in user_sizes if s <= max_num_batched_tokens})
        if not sizes:
            raise SpecError("cudagraph_capture_sizes",
                            f"every size exceeds max_num_batched_tokens ({max_num_batched_tokens})",
                            "use capture sizes <= max_num_batched_tokens")
        if user_max is not None and user_max != sizes[-1]:
            raise SpecError("max_cudagraph_capture_size",
                            f"customized max_cudagraph_capture_size(={user_max}) should be consistent with "
                            f"the max value of cudagraph_capture_sizes(={sizes[-1]})",
                            "set only one of the two, or make them agree")
        return tuple(sizes)
    if v < (0, 13, 0):  # --cuda-graph-sizes: one value N -> step 8 all the way
        n = user_max if user_max is not None else min(max_num_seqs * 2, 512)
        sizes = [s for s in (1, 2, 4) if s <= n] + list(range(8, n + 1, 8))
        return tuple(s for s in sizes if s <= max_num_batched_tokens)
    cap = 1024 if (blackwell and v >= (0, 29, 0)) else 512
    max_cg = user_max if user_max is not None else min(max_num_seqs * 2, cap)  # decode_query_len = 1
    max_cg = min(max_num_batched_tokens, max_cg)
    sizes = [s for s in (1, 2, 4) if s <= max_cg]
    sizes += list(range(8, min(max_cg + 1, 256), 8)) + list(range(256, max_cg + 1, 16))
    if v >= (0, 25, 0) and max_num_batched_tokens <= max_cg and max_num_batched_tokens not in sizes:
        sizes.append(max_num_batched_tokens)
    if v >= (0, 33, 0) and max_num_seqs <= max_cg and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return tuple(sorted(sizes))


def _check_parallel(model: ModelProfile, tp: int, pp: int) -> None:
    if model.num_attention_heads % tp:
        raise SpecError("tensor_parallel_size",
                        f"Total number of attention heads ({model.num_attention_heads}) must be divisible by "
                        f"tensor parallel size ({tp}).",
                        f"use a tensor_parallel_size that divides {model.num_attention_heads}")
    kv = model.num_kv_heads
    if kv >= tp and kv % tp:
        raise SpecError("tensor_parallel_size", f"{kv} is not divisible by {tp} (KV heads vs tensor parallel size)",
                        f"use a tensor_parallel_size that divides the {kv} KV heads")
    if kv < tp and tp % kv:
        raise SpecError("tensor_parallel_size", f"{tp} is not divisible by {kv} (tensor parallel size vs KV heads)",
                        f"use a multiple of the {kv} KV heads")
    if pp > model.num_layers:
        raise SpecError("pipeline_parallel_size",
                        f"{pp} pipeline stages for {model.num_layers} layers leaves a stage without layers",
                        f"use pipeline_parallel_size <= {model.num_layers}")


def resolve_engine_config(flags: Mapping[str, Any], model: ModelProfile, gpu: GpuSpec,
                          vllm_version: str = DEFAULT_VLLM_VERSION) -> EngineConfig:
    """Resolve every engine flag as ``vllm serve`` would; SpecError (naming the flag) on what vLLM refuses.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> c = resolve_engine_config({}, load_model("llama-3.1-8b"), get_gpu("H100-80GB"))
        >>> c.gpu_memory_utilization, c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len
        (0.92, 1024, 8192, 131072)
        >>> resolve_engine_config({"tensor_parallel_size": 3}, load_model("llama-3.1-8b"), get_gpu("H100-80GB"))
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: tensor_parallel_size: Total number of attention heads (32) must be divisible by tensor parallel size (3). (fix: use a tensor_parallel_size that divides 32)
    """
    v = parse_vllm_version(vllm_version)
    # None means "not set" (vLLM's own default), as in a flag set with optional entries.
    f = validate_flags({k: val for k, val in flags.items() if val is not None})
    tp = int(f.get("tensor_parallel_size", 1))
    pp = int(f.get("pipeline_parallel_size", 1))
    _check_parallel(model, tp, pp)

    limit = model.max_model_len_limit
    max_model_len = int(f.get("max_model_len") or limit)
    if max_model_len > limit:
        raise SpecError("max_model_len",
                        f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
                        f"(max_position_embeddings={limit} in model's config.json). To allow overriding this "
                        "maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.",
                        f"use max_model_len <= {limit}")

    chunked = bool(f.get("enable_chunked_prefill", True))
    default_tokens, default_seqs = batch_defaults(gpu, v)
    user_tokens = f.get("max_num_batched_tokens")
    user_seqs = f.get("max_num_seqs")
    if user_tokens is not None:
        max_num_batched_tokens = int(user_tokens)
    else:
        max_num_batched_tokens = default_tokens if chunked else max(max_model_len, default_tokens)
        # vLLM caps the *default* at what max_num_seqs sequences of max_model_len could use.
        max_num_batched_tokens = min(max_num_batched_tokens, int(user_seqs or default_seqs) * max_model_len)
    max_num_seqs = int(user_seqs) if user_seqs is not None else min(default_seqs, max_num_batched_tokens)
    if max_num_batched_tokens < max_num_seqs:
        raise SpecError("max_num_batched_tokens",
                        f"max_num_batched_tokens ({max_num_batched_tokens}) must be greater than or equal to "
                        f"max_num_seqs ({max_num_seqs}).",
                        f"raise max_num_batched_tokens to >= {max_num_seqs} or lower max_num_seqs")
    if not chunked and max_num_batched_tokens < max_model_len:
        raise SpecError("max_num_batched_tokens",
                        f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than max_model_len "
                        f"({max_model_len}). This effectively limits the maximum sequence length to "
                        "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
                        "max_num_batched_tokens or decrease max_model_len.",
                        "enable chunked prefill, or set max_num_batched_tokens >= max_model_len")

    enforce_eager = bool(f.get("enforce_eager", False))
    if enforce_eager:
        sizes: tuple[int, ...] = ()
    else:
        sizes = capture_sizes_for(v, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  user_sizes=f.get("cudagraph_capture_sizes"),
                                  user_max=f.get("max_cudagraph_capture_size"),
                                  blackwell=10.0 <= gpu.compute_capability < 11.0)

    quantization = f.get("quantization")
    if quantization is not None and model.quantization is None and quantization != "fp8":
        raise SpecError("quantization", f"{quantization} needs a checkpoint quantized with {quantization}; "
                        f"{model.name} has plain {model.dtype} weights",
                        "use quantization=fp8 (online) or a pre-quantized checkpoint")
    dtype = str(f.get("dtype", "auto"))
    if dtype == "half":
        dtype = "float16"

    return EngineConfig(
        gpu_memory_utilization=float(f.get("gpu_memory_utilization", _default_utilization(v))),
        kv_cache_memory_bytes=f.get("kv_cache_memory_bytes"),
        num_gpu_blocks_override=f.get("num_gpu_blocks_override"),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        enforce_eager=enforce_eager,
        cudagraph_capture_sizes=sizes,
        kv_cache_dtype=str(f.get("kv_cache_dtype", "auto")),
        enable_prefix_caching=bool(f.get("enable_prefix_caching", True)),
        enable_chunked_prefill=chunked,
        block_size=int(f.get("block_size", 16)),
        long_prefill_token_threshold=int(f.get("long_prefill_token_threshold", 0)),
        scheduling_policy=str(f.get("scheduling_policy", "fcfs")),
        # Async scheduling is on by default from 0.16 where supported; vLLM turns it off with PP.
        async_scheduling=bool(f.get("async_scheduling", v >= (0, 16, 0) and pp == 1)),
        vllm_version=".".join(map(str, v)),
        dtype=dtype,
        quantization=quantization,
    )


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
        }


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _effective_model(model: ModelProfile, config: EngineConfig) -> ModelProfile:
    """The model as served: ``--dtype`` and online ``--quantization fp8`` change the weight bytes."""
    changes: dict[str, Any] = {}
    if config.dtype not in ("auto", model.dtype):
        changes["dtype"] = "bfloat16" if config.dtype == "bfloat16" else config.dtype
    if config.quantization == "fp8" and model.quantization is None:
        changes.update(quantization="fp8", quant_bytes_per_param=1.0)
    return dataclasses.replace(model, **changes) if changes else model


def activation_peak_bytes(model: ModelProfile, config: EngineConfig, *, last_stage: bool = True,
                          compile_cache_warm: bool = False) -> int:
    """Peak torch allocation of vLLM's profile run on one GPU (the "peak activation" it logs).

    The dummy batch is ``max_num_batched_tokens`` tokens over ``num_reqs = min(mbt, max_num_seqs)``
    requests; the last PP stage then runs the sampler over ``num_reqs`` rows. ``compile_cache_warm``:
    the node's compile cache already holds this configuration (see :func:`compile_key`), so
    the start profiles the smaller (eager-like) peak. Constants: see "Calibration" above.
    """
    tokens = config.max_num_batched_tokens
    compiling = not (config.enforce_eager or compile_cache_warm)
    # The floor is seen on vLLM 0.26's V2 runner only; a published 0.19.1 start logs less than it.
    cold_floor = compiling and config.version >= _V2_RUNNER
    hidden_elems = ACT_HIDDEN_ELEMS_PER_TOKEN_COMPILED if compiling else ACT_HIDDEN_ELEMS_PER_TOKEN_EAGER
    # Triton fused-MoE experts run in workspaces kept past the forward (modelclass.moe_workspace_bytes)
    workspace = moe_workspace_bytes(model, tokens, config.tensor_parallel_size)
    inter = model.expert_intermediate_size * model.num_experts_per_tok if model.is_moe and not workspace \
        else (0 if model.is_moe else model.intermediate_size)
    inter += model.shared_expert_intermediate_size
    per_token = model.dtype_bytes * (ACT_MLP_ELEMS_PER_TOKEN * inter / config.tensor_parallel_size
                                     + hidden_elems * model.hidden_size)
    forward = ACT_FIXED_GIB * GiB + tokens * per_token
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
    peak is how that version applies them: the V1 runner up to 0.17 sorts the fp32 logits
    (fitted: SAMPLER_BYTES_PER_LOGIT_V1), the V1 runner from 0.18 masks them in place with a Triton
    kernel (counted from the source: SAMPLER_V1_TRITON_*), the V2 runner (0.26+) skips top-k/top-p
    in its dummy run (SAMPLER_BYTES_PER_LOGIT, an estimate).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("llama-3.1-8b"), get_gpu("A100-40GB")
        >>> sort = sampler_profile_bytes(m, resolve_engine_config({}, m, g, "0.11.2"), 256)
        >>> triton = sampler_profile_bytes(m, resolve_engine_config({}, m, g, "0.19.1"), 256)
        >>> round(sort / 2**30, 3), round(triton / 2**30, 3)
        (1.16, 0.489)
    """
    v = config.version
    logits = num_reqs * model.vocab_size
    if v >= _V2_RUNNER:
        return int(logits * SAMPLER_BYTES_PER_LOGIT)
    if v >= _TRITON_TOPK_TOPP and num_reqs >= SAMPLER_V1_TRITON_MIN_ROWS:
        buffer_rows = min(1 << (min(num_reqs, SAMPLER_V1_TRITON_BUFFER_ROWS) - 1).bit_length(),
                          SAMPLER_V1_TRITON_BUFFER_ROWS)
        return int(logits * (model.dtype_bytes + 4 * SAMPLER_V1_TRITON_FP32_COPIES)
                   + buffer_rows * model.vocab_size * 4)
    return int(logits * SAMPLER_BYTES_PER_LOGIT_V1)


def persistent_runner_bytes(model: ModelProfile, config: EngineConfig) -> int:
    """Torch memory the V2 runner holds from load to serving that 0.27+ charges to the KV budget (0 before).

    The V2 runner's sampler is built after the weights are measured (``v1/worker/gpu/model_runner.py:
    load_model``) and keeps per-request penalty state (``v1/worker/gpu/sample/penalties.py``,
    v0.28.0: ``output_bin_counts`` int32 [max_num_seqs, vocab], "can be very large, taking up GBs
    of GPU memory", and ``prompt_bin_mask`` int32 [max_num_seqs, vocab/32]). 0.26's accounting
    (weights + torch peak increase + non-torch growth) never sees it; 0.27+'s ``total_consumed``
    does, and vLLM 0.28's own breakdown counts it under "consumed memory (weights + non-torch)".
    The runner's other persistent buffers (token ids, block tables, input buffers) are ignored here:
    tens of MiB at most for the default batch sizes.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("llama-3.1-8b"), get_gpu("L40S")
        >>> persistent_runner_bytes(m, resolve_engine_config({}, m, g, "0.26.0"))
        0
        >>> round(persistent_runner_bytes(m, resolve_engine_config({}, m, g, "0.28.0")) / 2**30, 3)
        0.126
    """
    if config.version < _TOTAL_CONSUMED_ACCOUNTING or config.kv_cache_memory_bytes is not None:
        return 0
    return config.max_num_seqs * (model.vocab_size + _cdiv(model.vocab_size, 32)) * 4


def cudagraph_memory_bytes(model: ModelProfile, config: EngineConfig) -> int:
    """Predicted CUDA-graph pool per GPU ("Graph capturing finished ..., took X GiB"); 0 under eager."""
    if config.enforce_eager or not config.cudagraph_capture_sizes:
        return 0
    captured_tokens = sum(config.cudagraph_capture_sizes) + sum(config.full_cudagraph_sizes)
    scale = model.hidden_size * model.dtype_bytes / _CUDAGRAPH_REF_HIDDEN_BYTES
    return int((CUDAGRAPH_FIXED_GIB + CUDAGRAPH_GIB_PER_CAPTURED_TOKEN * captured_tokens * scale) * GiB)


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


def _gib_text(nbytes: float, v: Version) -> str:
    """vLLM prints GiB with ``format_gib`` (round to 2, e.g. ``-0.52``) from 0.16, ``%.2f`` before."""
    return str(round(nbytes / GiB, 2)) if v >= (0, 16, 0) else f"{nbytes / GiB:.2f}"


def _no_memory_text(v: Version) -> str:
    # The long form is what vLLM 0.26 printed on the H200 (b5_fail_u0012) and 0.33's source has;
    # 0.11 has the short form. The switch is placed at 0.20 (between 0.11 and 0.26; not pinned).
    if v >= (0, 20, 0):
        return ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, "
                "despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for "
                "more details.")
    return ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            "initializing the engine.")


def _kv_too_small_text(v: Version, max_model_len: int, need: int, avail: int, est: int) -> str:
    if v >= (0, 20, 0):
        return (f"To serve at least one request with the model's max seq len ({max_model_len}), "
                f"({_gib_text(need, v)} GiB KV cache is needed, which is larger than the available KV cache "
                f"memory ({_gib_text(avail, v)} GiB). Based on the available memory, the estimated maximum "
                f"model length is {est}. Try increasing `gpu_memory_utilization` (which also controls CPU "
                "memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See "
                "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
    return (f"To serve at least one request with the models's max seq len ({max_model_len}), "
            f"({need / GiB:.2f} GiB KV cache is needed, which is larger than the available KV cache memory "
            f"({avail / GiB:.2f} GiB). Based on the available memory, the estimated maximum model length is "
            f"{est}. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing "
            "the engine.")


def _cuda_oom_text(need: int, total: int, free: int) -> str:
    return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {need / GiB:.2f} GiB. GPU 0 has a "
            f"total capacity of {total / GiB:.2f} GiB of which {max(free, 0) / MiB:.2f} MiB is free.")


#: Resolved fields that size the memory budget but not the compiled graphs: vLLM's compile cache
#: key ignores them (real H200 starts: gpu_memory_utilization 0.02 after 0.03, same max_num_seqs,
#: hit the cache). ``max_num_seqs`` enters the key only through the CUDA-graph capture sizes it
#: sets (which ``cudagraph_capture_sizes`` carries).
_NOT_IN_COMPILE_KEY = frozenset({"gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override",
                                 "max_num_seqs"})


def compile_key(config: EngineConfig) -> tuple[tuple[str, Any], ...]:
    """The part of a resolved configuration that decides whether vLLM can reuse compiled graphs on a node.

    Two configurations with the same key share the node's compile cache: the second start loads
    the graphs ("Directly load AOT compiled function"; faster, and the smaller warm activation
    peak, see :func:`activation_peak_bytes`). The batch shape is in the key as vLLM compiles it:
    the compile range ``(1, max_num_batched_tokens)`` and the CUDA-graph capture sizes, which
    ``max_num_seqs`` sets up to vLLM's cap (``min(2 x max_num_seqs, 512)`` on 0.26), not
    ``max_num_seqs`` itself. Evidence, real H200 starts on vLLM 0.26.0:

    * tests/fixtures/real_h200/study_l8b: every start whose capture sizes or token budget no
      earlier start on the host had compiled recompiled (23-27 s) and profiled the cold peak
      (1.10 GiB at 256 x 8192 after 128 x 8192; 1.01 at 128 x 2048 after 256 x 2048), and every
      start of a configuration compiled before loaded it and profiled the warm peak (0.88 / 0.24
      GiB);
    * tests/fixtures/real_h200/study_l8b_tune: max_num_seqs 512 after 256 (capture sizes up to
      512 both) loaded the first start's graphs, same cache hash, warm peak 0.88 GiB.

    A start that failed after compiling counts as compiled (the 2 x H200 grid's 0.05 x 128 after
    the failed 0.012 x 128 profiled warm).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("llama-3.1-8b"), get_gpu("H200")
        >>> key = lambda **f: compile_key(resolve_engine_config(f, m, g))
        >>> key(max_num_seqs=256) == key(max_num_seqs=512, gpu_memory_utilization=0.5)  # both capture up to 512
        True
        >>> key(max_num_seqs=128) == key(max_num_seqs=256)  # up to 256 against up to 512
        False
    """
    return tuple((f.name, getattr(config, f.name)) for f in dataclasses.fields(config)
                 if f.name not in _NOT_IN_COMPILE_KEY)


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
    v = config.version
    model = as_loaded_on(_effective_model(model, config), gpu)  # e.g. Marlin fp8 below compute capability 8.9
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    total = int(gpu.memory_gib * GiB)
    comm = comm_memory(gpu, tp=tp, pp=pp, env=env, version=v)
    # 0.27+ charges the V2 runner's persistent sampler state as consumed memory, with the
    # non-torch growth (vLLM's own "consumed memory (weights + non-torch)").
    context, non_torch = comm.context_bytes, comm.non_torch_bytes + persistent_runner_bytes(model, config)
    cg = cudagraph_memory_bytes(model, config)
    subtract_cg = _cudagraph_estimate_subtracted(v) and cg > 0
    if config.kv_cache_memory_bytes is not None:
        budget = int(config.kv_cache_memory_bytes)
    else:
        budget = math.ceil(total * config.gpu_memory_utilization) if v >= (0, 33, 0) \
            else int(total * config.gpu_memory_utilization)

    weights = model.stage_weight_bytes(tp, pp)
    # KV pages per stage: layers grouped as vLLM's KV cache manager groups them (modelclass.kv_layout)
    layouts = [kv_layout(model, tp, s, pp, config.block_size, model.kv_dtype_bytes(config.kv_cache_dtype))
               for s in range(pp)]
    bytes_per_block = [layout.block_bytes for layout in layouts]

    # One worker per stage (TP ranks of a stage are identical); vLLM takes the minimum num_blocks.
    stages = []
    for s in range(pp):
        act = activation_peak_bytes(model, config, last_stage=(s == pp - 1), compile_cache_warm=compile_cache_warm)
        if config.kv_cache_memory_bytes is not None:
            available = budget  # profiling skipped; the figure is used as given
        else:
            available = budget - weights[s] - act - non_torch - (cg if subtract_cg else 0)
        stages.append({"act": act, "available": available,
                       "blocks": max(available, 0) // bytes_per_block[s]})
    bind = min(range(pp), key=lambda s: (stages[s]["blocks"], stages[s]["available"]))
    st = stages[bind]
    available = int(st["available"])
    computed_blocks = int(st["blocks"])
    num_blocks = config.num_gpu_blocks_override or computed_blocks
    blocks_per_seq = layouts[bind].blocks_per_request(config.max_model_len, config.block_size,
                                                      config.max_num_batched_tokens)
    kv_tokens, concurrency = _kv_capacity(v, num_blocks, config, layouts[bind], blocks_per_seq)

    notes: list[str] = class_notes(model, config.max_num_batched_tokens)  # MoE / hybrid / MLA / vision
    if comm.multicast:
        notes.append(f"{comm.reason}: +{(comm.non_torch_bytes - comm_memory(gpu, tp=tp, pp=pp, env=env.with_nvls(False), version=v).non_torch_bytes) / GiB:.2f} "
                     "GiB non-torch per TP worker (NCCL's NVLS buffers and multicast); that figure is not yet "
                     "checked on held-out startup logs")
    if subtract_cg:
        notes.append(f"vLLM {config.vllm_version} subtracts the CUDA graph estimate from the KV budget")
    if config.max_cudagraph_capture_size > _CUDAGRAPH_CALIBRATED_MAX_SIZE:
        notes.append(f"CUDA graph memory is extrapolated: calibrated on capture sizes up to "
                     f"{_CUDAGRAPH_CALIBRATED_MAX_SIZE}, this config captures up to {config.max_cudagraph_capture_size}")
    headroom = total - context - budget
    if config.kv_cache_memory_bytes is None and headroom < 0:
        notes.append(f"gpu_memory_utilization {config.gpu_memory_utilization} asks for {budget / GiB:.2f} GiB but "
                     f"only ~{(total - context) / GiB:.2f} GiB is free at startup: vLLM will refuse to start "
                     "(\"Free memory on device ... is less than desired GPU memory utilization\")")

    failure: TrialStatus | None = None
    cause: str | None = None
    fix: str | None = None
    est_len: int | None = None
    fixed_need = weights[bind] + st["act"] + non_torch + (cg if subtract_cg else 0)
    one_seq = blocks_per_seq * bytes_per_block[bind]

    load_failed = max(weights) > total - context
    if load_failed:
        failure = TrialStatus.STARTUP_OOM
        cause = ("Failed to load model - not enough GPU memory. Try lowering --gpu-memory-utilization to free "
                 "memory for weights, increasing --tensor-parallel-size, or using --quantization. "
                 f"(original error: {_cuda_oom_text(max(weights), total, total - context)})")
        need_tp = tp
        while need_tp < 64 and max(model.stage_weight_bytes(need_tp, pp)) > (total - context) * 0.85:
            need_tp *= 2
        fix = (f"the weights take {max(weights) / GiB:.1f} GiB per GPU: shard them (tensor_parallel_size "
               f">= {need_tp} or pipeline stages), or use a quantized checkpoint")
    elif config.kv_cache_memory_bytes is not None and fixed_need + budget > total - context:
        failure = TrialStatus.STARTUP_OOM
        cause = _cuda_oom_text(budget, total, total - context - fixed_need)
        fix = f"lower kv_cache_memory_bytes to <= {int(total - context - fixed_need - 150 * MiB)}"
    elif available <= 0:
        failure = TrialStatus.STARTUP_OOM
        cause = _no_memory_text(v)
        util = (fixed_need + one_seq) / total
        fix = f"raise gpu_memory_utilization to >= {math.ceil(util * 100) / 100:.2f}, or shard the model over more GPUs"
    else:
        check_avail = available
        if config.num_gpu_blocks_override is not None and v >= (0, 33, 0):
            check_avail = config.num_gpu_blocks_override * bytes_per_block[bind]  # 0.33 fits the override
        fit_avail = check_avail - (bytes_per_block[bind] if v >= (0, 33, 0) else 0)  # 0.33: null block first
        if one_seq > fit_avail:
            failure = TrialStatus.KV_TOO_SMALL
            est_len = min(config.max_model_len, max(fit_avail, 0) // bytes_per_block[bind] * config.block_size)
            cause = _kv_too_small_text(v, config.max_model_len, one_seq, check_avail, est_len)
            util = (fixed_need + one_seq + bytes_per_block[bind]) / total
            fix = (f"lower max_model_len to <= {est_len}"
                   + (f" or raise gpu_memory_utilization to >= {math.ceil(util * 100) / 100:.2f}"
                      if config.kv_cache_memory_bytes is None and util <= 1 else ""))
        elif (config.num_gpu_blocks_override is not None
              and config.num_gpu_blocks_override * bytes_per_block[bind] > available + max(headroom, 0)):
            failure = TrialStatus.STARTUP_OOM  # ≤0.29 allocates the override blindly
            alloc = config.num_gpu_blocks_override * bytes_per_block[bind]
            cause = _cuda_oom_text(alloc, total, available + max(headroom, 0))
            fix = f"lower num_gpu_blocks_override to <= {computed_blocks}"
        elif cg and not subtract_cg and headroom >= 0:
            # Graphs are captured after the KV cache is allocated, out of what is left of the GPU.
            kv_alloc = num_blocks * bytes_per_block[bind]
            free_for_graphs = total - context - weights[bind] - non_torch - kv_alloc
            if cg > free_for_graphs:
                failure = TrialStatus.CUDAGRAPH_OOM
                cause = _cuda_oom_text(cg, total, free_for_graphs)
                util = (total - context - cg - (kv_alloc - available)) / total
                fix = (f"lower gpu_memory_utilization to <= {math.floor(util * 100) / 100:.2f}, lower "
                       "max_num_seqs / max_cudagraph_capture_size, or set enforce_eager")

    kv_cache_bytes = available
    if config.num_gpu_blocks_override is not None and v >= (0, 33, 0):
        kv_cache_bytes = config.num_gpu_blocks_override * bytes_per_block[bind]
    memory = MemoryBreakdown(
        total=total / GiB, budget=budget / GiB, weights=weights[bind] / GiB,
        activation_peak=st["act"] / GiB, non_torch=non_torch / GiB, cudagraph=cg / GiB,
        kv_cache=kv_cache_bytes / GiB)
    ok = failure is None
    return MemoryPlan(
        fits=ok, failure=failure, cause=cause, memory=memory,
        num_gpu_blocks=num_blocks if ok else 0,
        kv_cache_tokens=kv_tokens if ok else 0,
        max_concurrency=concurrency if ok else 0.0,
        block_size=config.block_size,
        kv_bytes_per_token=max(lay.bytes_per_token(config.block_size) for lay in layouts),  # as vLLM counts tokens
        startup_s=_startup_seconds(config, max(weights), cold_start, failure, load_failed),
        fix=fix, estimated_max_model_len=est_len, num_cudagraphs=config.num_cudagraphs,
        cudagraph_subtracted=subtract_cg, notes=tuple(notes), comm=comm,
    )


def _kv_capacity(v: Version, num_blocks: int, config: EngineConfig, layout: KVLayout,
                 blocks_per_seq: int) -> tuple[int, float]:
    """``(KV tokens, max concurrency)`` as vLLM logs them (``kv_cache_utils.py``).

    ≤0.20: tokens = num_blocks // KV groups * block_size; ≥0.25: ``int(max_concurrency * max_model_len)``.
    Concurrency: blocks over the blocks one ``max_model_len`` request takes in every group.
    """
    concurrency = num_blocks / blocks_per_seq
    if v >= (0, 25, 0):
        tokens = int(concurrency * config.max_model_len)
    else:
        tokens = layout.tokens(num_blocks, config.block_size)
    return tokens, concurrency
