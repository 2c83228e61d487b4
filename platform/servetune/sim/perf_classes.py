"""Step-time rules of the model classes beyond dense bf16: MoE, quantized GEMMs, sliding-window attention.

:class:`~servetune.sim.perf.PerfModel` stays the one step-time model; this module gives it, per
class, what a layer's GEMMs read and compute on one TP rank. A dense bf16 (or fp16) model without
sliding layers never reaches these rules (``PerfModel`` keeps its own arithmetic for it, byte for
byte), so the dense fidelity figures do not move.

* **MoE (routed experts).** A batch of ``B`` tokens, each routed to ``k`` of ``E`` experts
  uniformly at random, touches ``E (1 - (1 - k/E)^B)`` distinct experts per layer in expectation
  (:func:`distinct_experts`): one token reads ``k`` experts' weights, a large batch all ``E``.
  vLLM's fused-MoE kernel (Triton ``fused_moe_kernel``; MXFP4's ``matmul_ogs`` on Hopper) streams
  only the experts that have tokens (``moe_align_block_size`` sorts tokens by expert and pads each
  expert's rows to ``BLOCK_SIZE_M``), so the weight bytes of a step are the touched experts'. Its
  FLOPs are ``2 B k x 3 H I / tp``, at the tile rows the padding leaves: ``BLOCK_SIZE_M`` is 16 while
  the batch has at most ``E`` tokens and 64 above in vLLM 0.11 (``fused_moe.py`` ``get_default_config``);
  0.26's default tile grows with the batch (:func:`moe_tile`, up to 128 x 128), and from 0.26 the
  step prices it at the dense GEMMs' tile model's rate over 0.11's 64 x 64 tile
  (``perf.moe_tile_share``); below 0.26, where vLLM ships a tuned config for the experts on the GPU
  (``E=..,N=..,device_name=...json``), it runs that file's tile at the batch key nearest the batch
  (:func:`tuned_tile`), priced the same way, as is block-quantized fp8's own default (64 x 128). Each
  kernel pads to its own row block (:func:`moe_block_m`: fused_moe's
  tile, ``matmul_ogs``' and Marlin's rules), the padding expected over the experts' binomial row
  counts (:func:`moe_row_fill`); block-fp8 experts in ``fused_moe`` compute at the bf16 rate
  (:data:`BLOCK_FP8_MOE_RATE_SCALE`).
  The grouped GEMM's rate against cuBLAS's dense rate (``MOE_COMPUTE_SHARE``) depends on the kernel
  vLLM picks for the experts' format on the GPU (:func:`moe_kernel`: Triton, or Marlin where the
  format has no tensor cores there) and on the GPU architecture; it is fitted on published runs,
  as is the prefill rate of the Triton attention vLLM runs attention sinks on below Hopper
  (``TRITON_ATTN_EFFICIENCY``, :func:`runs_triton_attention`). Its weight streaming rate
  (``MOE_MEM_SHARE``) is the dense GEMMs' until a decode-bound MoE run measures it. On data-center
  Blackwell (10.x) Triton's fused-MoE kernel on 16-bit experts takes both rates from published kernel
  benchmarks instead, nothing fitted (:data:`BLACKWELL_TRITON_MOE_SHARE`, :func:`blackwell_moe_mem_share`,
  :func:`runs_blackwell_triton_moe`; a tile of at most 64 rows at the 64-row UMMA ceiling,
  :data:`BLACKWELL_TRITON_MOE_NARROW_SHARE`, :func:`blackwell_triton_tile_share`). The router (``E x H``,
  bf16, replicated) and shared experts (dense, every token) are ordinary GEMMs; DeepSeek's leading
  dense layers (``first_k_dense_replace``) run the dense MLP.
  Under data parallelism without expert parallelism (``--data-parallel-size D``, ``--tensor-parallel-size
  T``) the routed experts are one tensor-parallel layer over all ``T x D`` GPUs and each MoE layer runs
  every replica's tokens (:func:`moe_parallel_size`, :func:`moe_step_tokens`); attention and the dense
  parts stay per replica at TP=T. Under ``--enable-expert-parallel`` each of the ``T x D`` GPUs holds its own
  whole experts instead and runs uniform routing's share of the rows (:func:`moe_shape` with ``ep``); the
  unquantized path stays Triton (FlashInfer's CUTLASS MoE for EP needs ``VLLM_USE_FLASHINFER_MOE_FP16=1``).
* **Quantized weights** (:func:`weight_format`): fp8 checkpoints and ``--quantization fp8`` read 1 byte
  a weight and run on the fp8 tensor cores where the GPU has them (``GpuSpec.fp8_tflops``, compute
  capability >= 8.9); below that vLLM serves fp8 weight-only through Marlin (1 byte plus one bf16
  scale per 128 weights, ``modelclass.as_loaded_on``) at the bf16 rate. 8-bit compressed-tensors
  (W8A8) read 1 byte at the GPU's 8-bit rate (Hopper's int8 and fp8 rates are equal). 4-bit
  integer formats (AWQ, GPTQ, compressed-tensors W4A16) read ``0.5 + scale / group`` bytes and run
  through Marlin at the bf16 rate times ``W4A16_COMPUTE_SHARE`` (its dequantization in the main
  loop). MXFP4 (gpt-oss) quantizes only the experts: 4.25 bits a weight (4-bit values plus one
  e8m0 scale per 32), attention, router and LM head in bf16; Hopper has no fp4 tensor cores, so the
  experts compute at the bf16 rate.
* **Sliding-window layers** read at most ``window`` tokens of a decode request's context
  (:func:`sliding_kv_share`), and a prefill chunk's attention on them spans at most ``window``
  tokens of context.
* **MLA attention** (DeepSeek-V2/V3) is priced from its own dimensions by ``PerfModel._init_mla``:
  the compressed latent read once per context token, prefill at ``qk + v`` head dims, and the
  earlier context's latents up-projected again for each chunk.

The rules live in private modules and this one is their public face (every name in ``__all__``): the
routed experts' shape, kernel and tokens in ``_moe_shape``, the fused-MoE tiles, row padding and
unaligned widths in ``_moe_tiles``, the grouped-MoE kernels' rates in ``_moe_rates``, the weight formats
and the ordinary GEMMs in ``_class_gemms``; the attention-kernel choice and the sliding-window share here.
A script that sets one of their constants for a run sets it on the module that holds it, where it is
read (``benchmarks/moe_vs_sim.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servetune.sim._class_gemms import (MXFP4_BYTES, W4A16_COMPUTE_SHARE, ClassGemm, WeightFormat, class_gemms,
                                        weight_format)
from servetune.sim._moe_rates import (B200_CUBLAS_SHARE, B200_FUSED_MOE_DEFAULT_US, BLACKWELL_NARROW_TILE_ROWS,
                                      BLACKWELL_TRITON_MOE_NARROW_SHARE, BLACKWELL_TRITON_MOE_SHARE,
                                      BLACKWELL_UMMA_BF16_FLOPS_PER_CYCLE, blackwell_triton_tile_share,
                                      BLACKWELL_TRITON_MOE_UNTIL, CUBLAS_BF16_MATMUL_TFLOPS, DATASHEET_BF16_TFLOPS,
                                      HOPPER_COMPUTE_EFFICIENCY, MOE_COMPUTE_SHARE, MOE_MEM_SHARE, MOE_UNFITTED_SHARE,
                                      TRITON_BF16_MATMUL_TFLOPS, blackwell_moe_mem_share, fused_moe_marginal_gbps,
                                      moe_compute_share, runs_blackwell_triton_moe)
from servetune.sim._moe_shape import (BLOCK_FP8_MOE_KERNEL_RATE, BLOCK_FP8_MOE_RATE_SCALE, MoeShape, distinct_experts,
                                      moe_kernel, moe_parallel_size, moe_shape, moe_step_tokens)
from servetune.sim._moe_tiles import (MOE_BY_BATCH_STREAM, MOE_BY_BATCH_STREAM_APPLIED,
                                      MOE_BY_BATCH_WIDE_TILE_APPLIED, MOE_BY_BATCH_WIDE_TILE_RATE,
                                      MOE_TILE_BY_BATCH_SINCE, MOE_TILE_FITTED_VERSION, MOE_UNALIGNED_DOWN_SHARE,
                                      by_batch_stream, by_batch_tile_rate, expected_row_blocks, moe_block_m,
                                      moe_down_share, moe_row_fill, moe_tile, prices_tile, tuned_tile,
                                      unaligned_experts_note)

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["ATTENTION_SINK_ARCHITECTURES", "B200_CUBLAS_SHARE", "BLACKWELL_NARROW_TILE_ROWS",
           "BLACKWELL_TRITON_MOE_NARROW_SHARE", "BLACKWELL_UMMA_BF16_FLOPS_PER_CYCLE", "blackwell_triton_tile_share", "CUBLAS_BF16_MATMUL_TFLOPS", "HOPPER_COMPUTE_EFFICIENCY",
           "BLACKWELL_TRITON_MOE_SHARE", "BLACKWELL_TRITON_MOE_UNTIL", "BLOCK_FP8_MOE_RATE_SCALE", "BLOCK_FP8_MOE_KERNEL_RATE", "B200_FUSED_MOE_DEFAULT_US", "DATASHEET_BF16_TFLOPS", "TRITON_BF16_MATMUL_TFLOPS", "ClassGemm", "MoeShape", "MOE_COMPUTE_SHARE", "MOE_MEM_SHARE", "MOE_UNFITTED_SHARE", "MOE_UNALIGNED_DOWN_SHARE", "moe_down_share", "unaligned_experts_note", "TRITON_ATTN_EFFICIENCY", "W4A16_COMPUTE_SHARE", "MXFP4_BYTES", "WeightFormat", "class_gemms", "distinct_experts",
           "expected_row_blocks", "is_class_model", "moe_block_m", "moe_parallel_size", "moe_row_fill", "moe_step_tokens", "MOE_TILE_BY_BATCH_SINCE", "MOE_BY_BATCH_WIDE_TILE_RATE", "MOE_BY_BATCH_WIDE_TILE_APPLIED", "by_batch_tile_rate",
           "MOE_BY_BATCH_STREAM", "MOE_BY_BATCH_STREAM_APPLIED", "by_batch_stream", "MOE_TILE_FITTED_VERSION",
           "moe_compute_share", "moe_kernel", "moe_shape",
           "blackwell_moe_mem_share", "fused_moe_marginal_gbps", "moe_tile", "prices_tile", "runs_blackwell_triton_moe", "runs_triton_attention", "tuned_tile",
           "sliding_kv_share", "weight_format"]

#: Architectures whose attention carries learned sinks (vLLM passes ``sinks=`` to ``Attention``:
#: ``model_executor/models/gpt_oss.py``). FlashAttention serves sinks only in its version 3 (Hopper)
#: and 4 (``fa_utils.flash_attn_supports_sinks``), FlashInfer only on SM100's trtllm path
#: (``FlashInferBackend.supports_sink``), so below compute capability 9.0 vLLM runs them on
#: ``TRITON_ATTN`` (the next backend of ``platforms/cuda.py``'s priority list that supports sinks).
ATTENTION_SINK_ARCHITECTURES: frozenset[str] = frozenset({"GptOssForCausalLM"})
#: Share of the dense peak vLLM's Triton attention (``TRITON_ATTN``'s ``unified_attention``) reaches
#: on prefill, where it replaces FlashAttention (:func:`runs_triton_attention`). **Fitted** on the fit
#: half's A100 gpt-oss runs (``published_runs_classes.py --fit-moe``); ``Calibration.triton_attn_efficiency``
#: > 0 replaces it.
TRITON_ATTN_EFFICIENCY: float = 0.1


def runs_triton_attention(model: ModelProfile, gpu: GpuSpec) -> bool:
    """Whether vLLM serves this model's attention on ``TRITON_ATTN`` rather than FlashAttention:
    attention sinks (:data:`ATTENTION_SINK_ARCHITECTURES`) on a GPU below compute capability 9.0."""
    return model.architecture in ATTENTION_SINK_ARCHITECTURES and gpu.compute_capability < 9.0


def is_class_model(model: ModelProfile) -> bool:
    """Whether any rule here applies (MoE, a quantized checkpoint, sliding-window layers)."""
    return bool(model.is_moe or model.quantization or model.layer_types)


def sliding_kv_share(model: ModelProfile, layers: int) -> float:
    """Share of the stage's layers that slide (read at most ``model.sliding_window`` tokens)."""
    kinds = model.layer_types[:layers] if model.layer_types else ()
    if not kinds or not model.sliding_window:
        return 0.0
    return sum(1 for k in kinds if k == "sliding") / len(kinds)
