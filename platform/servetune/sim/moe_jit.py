"""First use of a Triton fused-MoE kernel variant: the JIT compile a step pays on vLLM's request path.

Contract: :func:`moe_jit_rule` says, for a model, GPU and resolved engine configuration, which
variants of vLLM's Triton ``fused_moe_kernel`` a step of ``num_tokens`` tokens launches
(:meth:`MoeJitRule.variants`) and which ones the server's startup already compiled
(:meth:`MoeJitRule.warm`); :func:`first_use_s` is the one place a step is charged for the variants
its server's :class:`TritonCache` lacks (:data:`COMPILE_S` each), and it adds them to that cache.
All pure but :func:`first_use_s`'s update of the cache it is handed. ``None`` from
:func:`moe_jit_rule`: the rule does not apply (no routed experts, or experts vLLM runs on another
kernel: quantized experts, whose backends differ by format and GPU, are left out).

What vLLM's source says (read at 0.11.0, 0.14.1, 0.19.0 and 0.26.0; ``file:line@version``):

* **Which kernel.** Unquantized (bf16 / fp16) experts run ``TritonExperts``
  (``layers/fused_moe/unquantized_fused_moe_method.py:285@0.14.1``; FlashInfer's CUTLASS MoE only
  with expert parallelism and ``VLLM_USE_FLASHINFER_MOE_FP16``, :66-74), whose two GEMMs (w13, then
  w2 with the router weights) launch ``fused_moe_kernel`` (``fused_moe.py:315@0.14.1``,
  ``:271@0.11.0``, ``:312@0.19.0``, ``:295@0.26.0``) with one config per step.
* **What a compiled kernel is keyed on.** The config's tiles are ``tl.constexpr``
  (``fused_moe.py:355-367@0.14.1``); ``EM`` and ``num_valid_tokens`` are plain ``int`` arguments
  (``:330-331@0.14.1``, no ``do_not_specialize`` at any of the four releases), which Triton keys on
  "equal to 1", "divisible by 16" or neither (vllm-project/vllm#11056, 2024-12-10, and #56580,
  2026-09-12, which proposes to stop it). ``num_valid_tokens`` is ``M * top_k`` and ``EM`` the
  length of ``moe_align_block_size``'s ``sorted_token_ids``: ``M * top_k + E * (BLOCK_SIZE_M - 1)``
  (``moe_align_block_size.py:74@0.14.1``), capped at ``M * top_k * BLOCK_SIZE_M`` where that is
  fewer than ``E`` rows (``:77-80@0.14.1``; absent at 0.11.0) or where ``A`` has fewer rows than
  ``BLOCK_SIZE_M`` (``fused_moe.py:769-777@0.14.1``). The w2 GEMM runs on ``M * top_k`` rows at
  ``top_k`` 1, so its variant is keyed the same way on the same two numbers.
* **Which config a step gets.** The tuned file's entry at the key nearest ``M``
  (``try_get_optimal_moe_config``, ``fused_moe.py:1289@0.14.1``), else ``get_default_config``: up to
  0.16 two tiles, one for ``M <= E`` and one above (``:1270@0.14.1``, ``:905@0.11.0``); from 0.17 a
  tile per batch band (``block_m`` 16 / 32 / 64 / 128 at 32 / 96 / 512, ``block_n``, ``block_k``,
  warps and stages by ``M``: ``:1277-1322@v0.17.0``, ``:1278-1310@0.19.0``, ``:1313-1345@0.26.0``).
* **What startup runs.** The memory profile at ``max_num_batched_tokens``
  (``v1/worker/gpu_model_runner.py:4743@0.14.1``), FlashInfer's autotune pass at the same count
  (``model_executor/warmup/kernel_warmup.py:93@0.14.1``), ``compile_sizes`` and each compile range's
  end (``v1/worker/gpu_worker.py:417-446@0.14.1``; the range ends at ``max_num_batched_tokens``), a
  run at every CUDA-graph capture size (``capture_model``, :455) and the sampler's warm-up at
  ``min(max_num_seqs, max_num_batched_tokens)`` (:519-528); the same at 0.11.0 (:320-407), 0.19.0
  (:550-679) and 0.26.0 (:746-877). A step of at most the largest capture size runs padded to a
  capture size; a larger one runs at its own count. So a step above the capture range whose
  ``M * top_k`` is not a multiple of 16 (``M`` not a multiple of 4 at ``top_k`` 4) launches a
  variant no startup run made: two compiles (w13 and w2), on the request path, once per server.
* **Per server.** vLLM points ``TRITON_CACHE_DIR`` into its torch.compile cache directory, one per
  hash of the configuration and one per rank (``compilation/compiler_interface.py:306-311@0.14.1``,
  ``compilation/backends.py:616-633@0.14.1``): a server of another layout starts with none of these
  variants; the same server keeps them from one run to the next (the caller carries its
  :class:`TritonCache`).
* **Under DP** (``EngineConfig.data_parallel_size``, no expert parallelism) the experts are split over
  ``tp x dp`` GPUs (their tuned file is looked up at that width) and the kernel's ``M`` is every replica's
  tokens, each replica's step padded alike (``sim.perf_classes.moe_parallel_size``, ``moe_step_tokens``).
  Under ``--enable-expert-parallel`` the rank's own experts, whole: vLLM looks the tuned file up by the local
  ``E`` and the whole ``N`` (a published vLLM 0.10.2 start at TP=8 logs ``E=16,N=1536`` for Qwen3-235B-A22B).

Example:
    >>> from servetune.planner.gpus import get_gpu
    >>> from servetune.planner.memory import resolve_engine_config
    >>> from servetune.planner.modelinfo import load_model
    >>> model, gpu = load_model("qwen3-30b-a3b"), get_gpu("H100-80GB")
    >>> config = resolve_engine_config({"max_num_batched_tokens": 8192}, model, gpu, "0.14.1")
    >>> rule = moe_jit_rule(model, gpu, config)
    >>> cache = TritonCache(set(rule.warm()))
    >>> first_use_s(rule, cache, 8192), first_use_s(rule, cache, 3697), first_use_s(rule, cache, 2049)
    (0.0, 0.6, 0.0)
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import TYPE_CHECKING

from servetune.planner.modelinfo import local_experts
from servetune.planner.moe_kernels import moe_kernel_config, tuned_moe_tiles
from servetune.sim._moe_shape import moe_parallel_size, moe_step_tokens
from servetune.vllm_version import version_tuple

if TYPE_CHECKING:
    from servetune.planner.engine_config import EngineConfig
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["COMPILE_S", "MoeJitRule", "MoeJitVariant", "TritonCache", "first_use_s", "moe_jit_rule"]

#: Seconds one Triton GEMM variant takes to compile on a cold cache: 0.30 s, from vllm-project/vllm#54503
#: (2026-09-02, Akiratakome: a fresh-cache warm-up of vLLM's batch-invariant Triton matmul compiled 68
#: variants in 20.35 s and 37 in 10.65 s, 0.30 and 0.29 s each). Within the 0.2-2 s per first-seen
#: Triton MoE specialization NVIDIA/TensorRT-LLM#15311 (2026-06-12) measured with gpt-oss-120b on an
#: H200. Not fitted: no published run set it.
COMPILE_S = 0.30

#: Batch bands of ``get_default_config`` from vLLM 0.17 (vllm-project/vllm#34846: ``fused_moe.py:1277-1322@v0.17.0``,
#: ``:1278-1310@0.19.0``; 0.16.0 still splits at ``M <= E``, ``:1267-1282@v0.16.0``); until 2026-12-06 (0, 19), the
#: first release read. The same bound as ``perf_classes.MOE_TILE_BY_BATCH_SINCE``.
_BANDED_FROM = (0, 17)
#: ``moe_align_block_size`` caps ``sorted_token_ids`` for batches of fewer rows than experts (absent at 0.11.0).
_SMALL_CAP_FROM = (0, 14)


@dataclasses.dataclass(frozen=True)
class MoeJitVariant:
    """One compiled ``fused_moe_kernel``: its GEMM, its tile config, and Triton's key on ``EM`` and
    ``num_valid_tokens`` (``"1"``, ``"D"``: divisible by 16, or ``""``)."""

    gemm: str
    tile: tuple[int, ...]
    em: str
    valid: str


@dataclasses.dataclass
class TritonCache:
    """The ``fused_moe_kernel`` variants one server's Triton cache holds; ``complete``: every variant
    (the rule switched off)."""

    variants: set[MoeJitVariant] = dataclasses.field(default_factory=set)
    complete: bool = False


def _key(n: int) -> str:
    """Triton's specialization of an ``int`` argument."""
    return "1" if n == 1 else ("D" if n % 16 == 0 else "")


@dataclasses.dataclass(frozen=True)
class MoeJitRule:
    """The fused-MoE kernel's variants for one server (see the module docstring for the sources)."""

    num_experts: int
    top_k: int
    version: tuple[int, ...]
    tuned: tuple[tuple[int, int, int], ...]  # (M key, BLOCK_SIZE_M, BLOCK_SIZE_N), ascending; () where none
    capture_sizes: tuple[int, ...]  # ascending; () under enforce_eager
    startup_tokens: tuple[int, ...]  # the token counts startup runs the model at
    #: DP replicas whose tokens each MoE layer gathers (``EngineConfig.data_parallel_size``): the kernel's
    #: ``M`` is ``perf_classes.moe_step_tokens`` of a replica's padded step, startup's runs included.
    data_parallel_size: int = 1

    def tile(self, m: int) -> tuple[int, ...]:
        """The config a batch of ``m`` tokens gets; its first entry is ``BLOCK_SIZE_M``."""
        if self.tuned:  # vLLM: min(configs.keys(), key=lambda x: abs(x - M)), ties to the smaller key
            row = min(self.tuned, key=lambda r: abs(r[0] - m))
            return row[1], row[2]
        if self.version < _BANDED_FROM:
            return (16, 32, 64, 1) if m <= self.num_experts else (64, 64, 32, 8)
        block_m = 16 if m <= 32 else 32 if m <= 96 else 64 if m <= 512 else 128
        group_m = 16 if m // max(self.num_experts, 1) > 128 else 1
        return (block_m, 64 if m <= 64 else 128, 128 if m <= 64 else 64, group_m,
                4 if m <= 128 else 8, 4 if m <= 32 else 3)

    def padded(self, num_tokens: int) -> int:
        """The token count a step runs at: the next capture size within the CUDA-graph range."""
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else num_tokens

    def variants(self, num_tokens: int) -> frozenset[MoeJitVariant]:
        """The two variants (w13, w2) a step of ``num_tokens`` scheduled tokens (a replica's under DP) launches."""
        m = moe_step_tokens(self.padded(num_tokens), self.data_parallel_size)
        tile = self.tile(m)
        block_m, rows = tile[0], m * self.top_k
        em = rows + self.num_experts * (block_m - 1)
        if rows < self.num_experts and self.version >= _SMALL_CAP_FROM:
            em = min(rows * block_m, em)
        w13_em = min(em, rows * block_m) if m < block_m else em
        w2_em = min(em, rows * block_m) if rows < block_m else em
        return frozenset({MoeJitVariant("w13", tile, _key(w13_em), _key(rows)),
                          MoeJitVariant("w2", tile, _key(w2_em), _key(rows))})

    def warm(self) -> frozenset[MoeJitVariant]:
        """The variants the server's startup compiled (profile, autotune, capture and sampler runs)."""
        out: set[MoeJitVariant] = set()
        for n in (*self.startup_tokens, *self.capture_sizes):
            out |= self.variants(n)
        return frozenset(out)


def moe_jit_rule(model: ModelProfile, gpu: GpuSpec, config: EngineConfig) -> MoeJitRule | None:
    """The rule for this server, or None where its experts do not run vLLM's Triton fused-MoE kernel
    unquantized (no routed experts, quantized experts, or a GPU whose torch name is not known)."""
    if not model.is_moe or model.quantization or model.num_experts_per_tok < 1:
        return None
    tp = moe_parallel_size(config.tensor_parallel_size, config.data_parallel_size)  # the experts' split under DP
    ep = config.expert_parallel_size(model.is_moe)  # or whole experts, the rank's own (vLLM names E = local experts)
    experts = local_experts(model.num_experts, ep) if ep > 1 else None
    tp = 1 if ep > 1 else tp
    if moe_kernel_config(model, gpu.name, tp, experts=experts) is None:
        return None
    mnbt = config.max_num_batched_tokens
    return MoeJitRule(num_experts=experts or model.num_experts, top_k=model.num_experts_per_tok,
                      version=version_tuple(config.vllm_version) or (0, 0, 0),
                      tuned=tuned_moe_tiles(model, gpu.name, tp, experts=experts),
                      capture_sizes=() if config.enforce_eager else tuple(config.cudagraph_capture_sizes),
                      startup_tokens=(mnbt, min(config.max_num_seqs, mnbt)),
                      data_parallel_size=max(1, config.data_parallel_size))


def first_use_s(rule: MoeJitRule | None, cache: TritonCache, num_tokens: int) -> float:
    """Seconds a step of ``num_tokens`` tokens waits for compiles: :data:`COMPILE_S` for each variant it
    launches that ``cache`` lacks (all TP ranks compile at once, so one rank's count is the stall);
    those variants join ``cache``. 0.0 where the rule does not apply or the cache is complete."""
    if rule is None or cache.complete or num_tokens <= 0:
        return 0.0
    new = rule.variants(num_tokens) - cache.variants
    cache.variants |= new
    return COMPILE_S * len(new)
