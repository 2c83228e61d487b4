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
  :func:`runs_blackwell_triton_moe`). The router (``E x H``,
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
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from servetune.planner import moe_kernels
from servetune.planner.modelinfo import local_experts

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["ATTENTION_SINK_ARCHITECTURES", "BLACKWELL_TRITON_MOE_SHARE", "BLACKWELL_TRITON_MOE_UNTIL", "BLOCK_FP8_MOE_RATE_SCALE", "BLOCK_FP8_MOE_KERNEL_RATE", "B200_FUSED_MOE_DEFAULT_US", "DATASHEET_BF16_TFLOPS", "TRITON_BF16_MATMUL_TFLOPS", "ClassGemm", "MoeShape", "MOE_COMPUTE_SHARE", "MOE_MEM_SHARE", "MOE_UNFITTED_SHARE", "MOE_UNALIGNED_DOWN_SHARE", "moe_down_share", "unaligned_experts_note", "TRITON_ATTN_EFFICIENCY", "W4A16_COMPUTE_SHARE", "MXFP4_BYTES", "WeightFormat", "class_gemms", "distinct_experts",
           "expected_row_blocks", "is_class_model", "moe_block_m", "moe_parallel_size", "moe_row_fill", "moe_step_tokens", "MOE_TILE_BY_BATCH_SINCE", "MOE_BY_BATCH_WIDE_TILE_RATE", "MOE_BY_BATCH_WIDE_TILE_APPLIED", "by_batch_tile_rate", "MOE_TILE_FITTED_VERSION", "moe_compute_share", "moe_kernel", "moe_shape",
           "blackwell_moe_mem_share", "fused_moe_marginal_gbps", "moe_tile", "prices_tile", "runs_blackwell_triton_moe", "runs_triton_attention", "tuned_tile",
           "sliding_kv_share", "weight_format"]

#: Share of the dense GEMMs' compute rate (``Calibration.compute_efficiency`` x the GPU's peak) that
#: vLLM's grouped MoE kernels reach on their padded tiles, by kernel (:func:`moe_kernel`) and GPU
#: architecture. ``triton``: the Triton ``fused_moe_kernel`` (bf16 experts, fp8 experts on fp8
#: tensor cores) and, for MXFP4 on Hopper, ``triton_kernels``' ``matmul_ogs``; Triton's kernels reach
#: a smaller share of Hopper's (three times higher) peak than of Ampere's. ``marlin-mxfp4``: vLLM's
#: ``fused_marlin_moe`` on MXFP4 experts, the weight-only kernel it runs where the GPU has no fp4
#: tensor cores and no ``triton_kernels`` path (below compute capability 9.0), dequantizing e2m1
#: values and e8m0 scales in registers before Ampere-style ``mma.sync`` MMAs. ``marlin`` (fp8
#: experts below compute capability 8.9, 4-bit integer experts) has no fitted cell yet: a kernel
#: and architecture without one take :data:`MOE_UNFITTED_SHARE` (:func:`moe_compute_share`).
#: The share is the one reached on the rows the kernel computes, its padding included: each kernel's
#: own row block (:func:`moe_block_m`), the expected padding over the experts' binomial row counts
#: (:func:`moe_row_fill`); fused_moe's at vLLM 0.11's default 64 x 64 tile, from 0.26 scaled by
#: the larger default tile's rate (:func:`moe_tile`, ``perf.moe_tile_share``), and below 0.26 by the
#: tile of the tuned config vLLM 0.11.0 ships for the experts on the GPU where there is one.
#: **Fitted** on the fit half of the published MoE runs (``benchmarks/published_runs_classes.py
#: --fit-moe``: per cell, the least mean |headline error| on a 0.05 grid; the split of
#: ``benchmarks/published_runs.py``'s rule): ``triton``/Hopper on gpt-oss-120b MXFP4 on H100 at
#: TP=2 (and the decode-bound Qwen3-30B-A3B run), ``triton``/Ampere on Qwen3-235B-A22B bf16 on A100
#: at TP=8, ``marlin-mxfp4``/Ampere on gpt-oss-20b on one A100 (jointly with
#: :data:`TRITON_ATTN_EFFICIENCY`), vLLM 0.10.2-0.11.0. Refitted 2026-12-05 with the row-block
#: padding rule: 0.3, 0.3 and 0.7 (0.25, 0.25 and 0.65 under padding from the mean row count at
#: 0.11's fused_moe rows for every kernel, ``Calibration.moe_row_blocks`` 0). ``triton``/Ampere
#: refitted 2026-12-05 once vLLM 0.11.0's per-request chat-template parse was priced
#: (``Calibration.chat_template_parse_s``): 0.3 -> 0.35 (its fit runs went to the chat endpoint,
#: and 0.3 had absorbed the parse's queue in their burst of 1,000; the other two cells stay).
#: ``triton``/Ampere refitted 2026-12-06 once the tuned config vLLM 0.11.0 ships for the experts is
#: priced (:func:`moe_tile`'s ``tuned``; its A100 fit runs ran ``E=128,N=192,device_name=NVIDIA_A100-SXM4-80GB.json``,
#: 64 x 128 tiles at 2,048 tokens, which the share had absorbed as 0.11's default 64 x 64): 0.35 -> 0.2
#: (mean |error| on its four fit runs 8.3% -> 7.6%; the 0.05 grid's best with resumes hitting their
#: blocks and with them recomputed alike; off the grid 0.225 gives 7.8% and 6.7% respectively). ``triton``/Hopper's
#: fit runs run no tuned file (gpt-oss on ``matmul_ogs``; Qwen3-30B-A3B's ``E=128,N=768`` has no H100
#: file), so it stays; Marlin on Ampere keeps 0.35 (:data:`MOE_UNFITTED_SHARE`). The tuned-tile
#: rule was read after the held-out Qwen3-235B H100 TP 4/8 errors were seen (not blind).
#: ``Calibration.moe_compute_share`` > 0 replaces every one.
MOE_COMPUTE_SHARE: dict[str, dict[str, float]] = {"triton": {"hopper": 0.3, "ampere": 0.2},
                                                  "marlin-mxfp4": {"ampere": 0.7}}
#: The share a kernel without a fitted cell takes (``marlin``: fp8 experts below compute capability
#: 8.9, 4-bit integer experts), by architecture: the rate ``triton`` reached on its fit runs with their
#: tiles in it. Ampere: 0.35, ``triton``/Ampere as fitted while its A100 runs' tuned 64 x 128 tiles were
#: priced as 0.11's default 64 x 64 (Marlin has no tile of its own here, so it keeps that rate, not the
#: share per 64 x 64 tile it was refitted to). An architecture not listed takes ``triton``'s (Hopper: its
#: fit runs ran no tuned file, so its share already holds their tiles).
MOE_UNFITTED_SHARE: dict[str, float] = {"ampere": 0.35}
#: The same Triton matmul timed on an H100 SXM and a B200 by one author, bf16, TFLOP/s at
#: M = N = K = 4096 (tile-ai/tilelang#1787, https://github.com/tile-ai/tilelang/issues/1787,
#: 2026-02-04: "triton | 0.263 ms | 523.0 TFLOPS" on "NVIDIA H100 80GB HBM3", "0.155 ms | 885.9
#: TFLOPS" on "NVIDIA B200"; at 8192 the same pair is 526.5 and 1075.8). A pointer-loaded Triton
#: ``tl.dot`` kernel, as vLLM's ``fused_moe_kernel`` is; 4096 is the published size nearest a MoE
#: expert's GEMM (gpt-oss-120b at TP=8: ~256 rows an expert in an 8,192-token step, N 720, K 2,880).
TRITON_BF16_MATMUL_TFLOPS: dict[str, float] = {"H100-80GB": 523.0, "B200": 885.9}
#: The datasheet dense bf16 peaks those rates are held against (``planner.gpus``: NVIDIA H100 SXM5
#: 989 TFLOP/s, HGX B200 2,250 TFLOP/s; a test holds them equal to the GPU table).
DATASHEET_BF16_TFLOPS: dict[str, float] = {"H100-80GB": 989.0, "B200": 2250.0}
#: :data:`MOE_COMPUTE_SHARE`'s ``triton`` cell on data-center Blackwell (compute capability 10.x),
#: **derived from published kernel rates, not fitted**: Hopper's fitted share times the share of the
#: datasheet ratio Triton's matmul keeps from H100 to B200 (:data:`TRITON_BF16_MATMUL_TFLOPS` over
#: :data:`DATASHEET_BF16_TFLOPS`: 885.9 / 523.0 = 1.694 of 2,250 / 989 = 2.275, i.e. 0.745), so
#: 0.3 x 0.745 = 0.223 (0.269 at the 8,192 pair). The dense (cuBLAS) rate keeps the H200's share:
#: only the Triton kernel's rate is scaled. Applies where vLLM runs 16-bit experts on Triton's
#: ``fused_moe_kernel`` there (:func:`runs_blackwell_triton_moe`); the five held-out B200 gpt-oss-120b
#: bf16 runs (``tests/fixtures/published_runs/nvlink_moe.yaml``) were read before this rule was
#: written (they motivated looking) but no figure here was chosen on them.
BLACKWELL_TRITON_MOE_SHARE: float = (MOE_COMPUTE_SHARE["triton"]["hopper"]
                                     * (TRITON_BF16_MATMUL_TFLOPS["B200"] / TRITON_BF16_MATMUL_TFLOPS["H100-80GB"])
                                     / (DATASHEET_BF16_TFLOPS["B200"] / DATASHEET_BF16_TFLOPS["H100-80GB"]))
#: vLLM's ``benchmark_moe.py`` on one B200, bf16 Qwen3-30B-A3B experts (E=128, top-8, H=2,048,
#: I=768) at the default 16 x 32 x 64 tile, microseconds for 1, 2 and 4 tokens (vllm-project/vllm#31448,
#: https://github.com/vllm-project/vllm/pull/31448, 2025-12-28, "with default config": 39.61, 51.87,
#: 73.18 us); the rows beyond 8 tokens are not in the stored copy of the thread.
B200_FUSED_MOE_DEFAULT_US: tuple[tuple[int, float], ...] = ((1, 39.61), (2, 51.87), (4, 73.18))
#: The experts those timings read: E, top-k, hidden, intermediate (``Qwen/Qwen3-30B-A3B`` config.json).
_B200_BENCH_EXPERTS: tuple[int, int, int, int] = (128, 8, 2048, 768)


def fused_moe_marginal_gbps(timings: tuple[tuple[int, float], ...] = B200_FUSED_MOE_DEFAULT_US,
                            experts: tuple[int, int, int, int] = _B200_BENCH_EXPERTS) -> float:
    """GB/s the fused-MoE kernel streams the weights of the experts a larger batch adds (the first and
    last timings' difference over the difference of their expected touched experts' bf16 bytes,
    :func:`distinct_experts`): its weight-streaming rate with the fixed cost per call taken out.

    Example:
        >>> round(fused_moe_marginal_gbps())
        5938
    """
    e, k, h, i = experts
    (b0, t0), (b1, t1) = timings[0], timings[-1]
    added = (distinct_experts(e, k, b1) - distinct_experts(e, k, b0)) * 3 * h * i * 2.0
    return added / ((t1 - t0) * 1e-6) / 1e9


#: The first vLLM release whose unquantized MoE no longer defaults to Triton on SM100: 0.20, where the
#: default MoE backend became FlashInfer's (a vLLM maintainer, vllm-project/vllm#41306, 2026-05-01:
#: "moe backend changed from triton to flashinfer in 0.20"; #44220 then moved Hopper back to Triton,
#: "except for SM100"). Not read in 0.20's source: releases from it keep Hopper's share (the rule before).
#: In 0.14.1 the path is Triton: ``UnquantizedFusedMoEMethod`` builds ``TritonExperts`` unless
#: ``VLLM_USE_FLASHINFER_MOE_FP16`` (default 0, ``envs.py:1226-1227@v0.14.1``) and expert parallelism
#: are both on (``model_executor/layers/fused_moe/unquantized_fused_moe_method.py:68-74,281-287@v0.14.1``),
#: with no tuned B200 file for gpt-oss's ``E=128,N=360`` (``get_default_config``'s 64 x 64 x 32 tile above
#: E rows, ``fused_moe.py:1278-1285@v0.14.1``).
BLACKWELL_TRITON_MOE_UNTIL: tuple[int, int, int] = (0, 20, 0)
#: Share of the dense GEMMs' weight-streaming rate (``Calibration.mem_efficiency``) the fused-MoE
#: kernel reaches reading the touched experts at small batches. Not fitted: every published MoE run
#: collected is prefill-bound (bursts of long prompts), so none measures it; 1.0 (the dense rate).
MOE_MEM_SHARE: float = 1.0
#: Marlin's (AWQ / GPTQ / W4A16) compute rate against the bf16 GEMM's at large batches: its main
#: loop dequantizes every 4-bit weight before the tensor-core MMA. Not measured here: an
#: assumption from the Marlin paper (Frantar et al., "MARLIN: Mixed-Precision Auto-Regressive
#: Parallel Inference on Large Language Models", 2024), whose large-batch end runs close to, and
#: below, the fp16 GEMM; the AWQ / W4A16 runs judge it.
W4A16_COMPUTE_SHARE: float = 0.9
#: The rate of block-quantized fp8 experts (DeepSeek-V3 / R1's 128 x 128 blocks) in vLLM's Triton
#: ``fused_moe_kernel`` against the bf16 rate. Its block-scaled branch (``fused_moe.py``: ``group_k > 0
#: and group_n > 0``) computes ``accumulator += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]``
#: every BLOCK_K (128) step, where per-tensor fp8 accumulates in the MMA chain (``tl.dot(a, b,
#: acc=accumulator)``, "fp8_fast_accum"): each step's fp8 MMA result waits for an FP32 rescale of the
#: whole tile on the CUDA cores before the next. Priced at the bf16 rate (1.0, against 2.0 for
#: per-tensor fp8 on Hopper): an assumption, not fitted (no fit-half run has block-fp8 experts), chosen
#: 2026-12-05 after the held-out DeepSeek-R1-0528 bursts on 8 x H200 were seen (their 2K and 4K
#: prompts ran +32% and +24% fast at 2.0); those runs are no blind check of it. Kept 2026-12-06 when
#: block-fp8 experts below vLLM 0.26 came to be priced at the 64 x 128 tile they run (0.11's default,
#: and DeepSeek's tuned H200 file at most batch keys; :func:`moe_tile`), not bf16's 64 x 64: the four
#: DeepSeek bursts went -7.1 / -5.1 / -9.1 / +4.9% -> +4.9 / +2.8 / +3.6 / +10.4%. Where DeepGEMM is
#: installed vLLM 0.11.0 runs such experts on it instead (``VLLM_USE_DEEP_GEMM`` defaults to 1,
#: ``envs.py:1148@v0.11.0``; ``Fp8MoEMethod.allow_deep_gemm``): not modelled, the published pages not saying.
#: Measured since (2026-12-06, :data:`BLOCK_FP8_MOE_KERNEL_RATE`): 1.3 at the kernel; kept at 1.0 in the step.
BLOCK_FP8_MOE_RATE_SCALE: float = 1.0
#: The rate of block-fp8 experts in ``fused_moe_kernel`` against bf16 **measured** on an H100 SXM, not
#: applied to the step. vLLM 0.26.0's ``fused_experts`` under vLLM 0.11.0's block default (64 x 128 x 128,
#: ``GROUP_SIZE_M`` 32, 4 warps, 3 stages; ``tests/fixtures/real_h100/kernels/moe_probe_h100.json``), the
#: whole layer as a step prices it (``PerfModel.moe_seconds`` plus ``moe_activation_seconds``: the timed
#: kernels read and write those activations): read off DeepSeek-R1's TP=8 layer at 1,024-8,192 tokens
#: (``benchmarks/moe_vs_sim.py --block-fp8``; 0.82-0.89 of the price at 1.0, 0.98-1.01 at 1.3) and judged
#: on Qwen3-235B-A22B-FP8's TP=4 layer (0.76-0.87 -> 0.94-1.01). Looked for after the held-out
#: Qwen3-235B-FP8 H100 TP=4 errors were read. Applied (as :data:`BLOCK_FP8_MOE_RATE_SCALE`) it takes those
#: four published runs -11.8 / -28.4 / -21.7 / -55.6% -> -4.8 / -21.5 / -13.8 / -53.5% and the four held-out
#: DeepSeek-R1-0528 bursts on 8 x H200 (the same kernel and tile: their tuned H200 file holds 64 x 128 x 128
#: at 1,024-4,096) +9.2 / +7.2 / +8.4 / +12.1% -> +17.0 / +17.4 / +18.3 / +15.1%: 46 -> 43 of the 57
#: held-out class runs within 15%. Something else in those DeepSeek runs is priced fast (MLA, their shared
#: expert or dense layers, not measured), and the kernel's rate waits for it.
BLOCK_FP8_MOE_KERNEL_RATE: float = 1.3
#: The rate of ``fused_moe_kernel``'s down GEMM, whose K is one expert's intermediate width on the
#: rank, when that width is not a multiple of 16 elements, against the layer's rate at an aligned width.
#: Triton specializes each integer argument divisible by 16 (``tt.divisibility = 16``, Triton's
#: ``JITFunction`` specialization of ints and pointers) and vectorizes the loads it can prove aligned;
#: an expert width such as gpt-oss-120b's 2,880 / 8 = 360 gives the down GEMM's row strides (K
#: elements) none of it. **Measured**, not fitted on runs: vLLM 0.26.0's ``fused_experts`` on an H100
#: SXM (2026-12-06, ``tests/fixtures/real_h100/kernels/moe_probe_align_h100.json``), gpt-oss-120b's
#: TP=8 layer (K = 360) against the same layer at K = 352 and 368, 4,096 and 8,192 tokens, the
#: gate/up GEMM at the neighbours' rate (``benchmarks/moe_vs_sim.py --derive``): 0.398 under vLLM 0.11's
#: default 64 x 64 x 32 tile (``"v0.11_default"``: releases before :data:`MOE_TILE_BY_BATCH_SINCE`
#: without a tuned file), 0.178 under 0.26's by-batch tiles (``BLOCK_SIZE_K`` 64 past 64 tokens).
#: Judged on four other unaligned widths of the same probe (200, 1,000, 100 and 360 with 32 experts:
#: the layer within -11..+14% at 1,024-8,192 tokens, both tile sets). Per-tensor fp8 experts at an
#: unaligned width under 0.26's tiles ran 3x slower than this predicts (34 against ~107 TFLOP/s at
#: width 200), a miss the rule does not price; fp8 checkpoints' widths are multiples of their
#: 128-wide quantization blocks.
MOE_UNALIGNED_DOWN_SHARE: dict[str, float] = {"v0.11_default": 0.398, "by_batch": 0.178}
#: MXFP4: a 4-bit value plus one 8-bit (e8m0) scale per 32 values (OCP Microscaling spec v1.0).
MXFP4_BYTES: float = 0.5 + 1.0 / 32
#: fused_moe's BLOCK_SIZE_M when the batch has at most E tokens, and above (vLLM 0.11's fused_moe.py
#: get_default_config, bf16 / fp8 without a tuned config file: 16x32 and 64x64 tiles).
_MOE_BLOCK_M_SMALL, _MOE_BLOCK_M_LARGE = 16, 64
#: vLLM 0.11's default BLOCK_SIZE_N for block-quantized fp8 experts: the quantization block
#: (``get_default_config``: ``"BLOCK_SIZE_N": block_shape[0]``, 128 for every checkpoint read here).
_MOE_BLOCK_FP8_N_011 = 128
#: The first vLLM release whose default fused-MoE tile (:func:`moe_tile`) grows with the batch: 0.17.0.
#: ``get_default_config``'s "General defaults for bf16/fp16 and fp8 per-tensor" branch came with
#: vllm-project/vllm#34846 (merged 2026-02-18): ``model_executor/layers/fused_moe/fused_moe.py:1277-1322@v0.17.0``,
#: the same lines at ``:1309-1354@v0.26.0``; 0.16.0 still has 0.11's two tiles (``:1267-1282@v0.16.0``). Read
#: 2026-12-06 in the 0.16.0, 0.17.0 and 0.26.0 wheels (until then 0.26.0, the one release read). The kernel's 16-bit
#: path is the same from 0.17.0 to 0.26.0 but for ``SWAP_AB``, which 0.26.0 turns on for fp8 weights only
#: (``fused_moe.py:762-765@v0.26.0``). Releases before it are priced at 0.11's tiles, which
#: :data:`MOE_COMPUTE_SHARE` was fitted under; no published MoE run collected is at 0.17-0.25.
MOE_TILE_BY_BATCH_SINCE: tuple[int, int, int] = (0, 17, 0)
#: The rate of the by-batch default's widest tile (128 x 128 x 64, 8 warps, 3 stages: more than 512 tokens)
#: for 16-bit experts against vLLM 0.11's default 64 x 64 x 32 tile, the one :data:`MOE_COMPUTE_SHARE` was
#: fitted under; :func:`by_batch_tile_rate` puts it where the dense tile model (``perf.moe_tile_share``) gave
#: 1.8. **Fitted on kernel timings alone**: vLLM 0.26.0's ``fused_experts`` on an H100 SXM
#: (``tests/fixtures/real_h100/kernels/moe_probe_h100.json``), the whole layer a step prices
#: (``moe_seconds`` plus ``moe_activation_seconds``) at 1,024-8,192 tokens of two shapes, gpt-oss-120b bf16
#: at TP=4 (E=128, H=2,880, I=720) and Mixtral-8x7B at TP=1 (E=8, H=4,096, I=14,336): 8 rows, the 0.05 grid's
#: best mean |log(real / simulated)| (``benchmarks/moe_vs_sim.py --wide-tile``; at 1.8 those rows ran at
#: 0.79-0.96 of their price). Judged on the other 16-bit shapes' rows of that tile (the same command): Qwen3-30B-A3B
#: and DeepSeek-V2-Lite at TP=1, Qwen3-235B-A22B at TP=8 (a tuned file's 4-warp config) and gpt-oss-120b at
#: TP=8 (an unaligned width). Per-tensor fp8 keeps the tile model (its 128 x 128 x 128 rows ran at 1.03-1.07 of
#: their price), block-fp8 has no such tile. **Not applied to the step** (:data:`MOE_BY_BATCH_WIDE_TILE_APPLIED`):
#: on the 14 real vLLM 0.26 windows it moves (``real_h100_classes``' bf16 Qwen3-30B-A3B, Mixtral-16L and
#: DeepSeek-V2-Lite windows, ``real_h200_classes``' bf16 Qwen3-30B-A3B, granite-4.0-h-tiny; in no fit) output
#: throughput's mean |error| went 14.8% -> 14.2% (within 10%: 8 -> 9) but TTFT's 28.7% -> 31.4% (4 -> 3 within
#: 10%) and TPOT's within 10% 7 -> 6, and the two H200 windows it moves 7.2% -> 9.7% on throughput
#: (docs/accuracy.md, the kernel probes' section): the end-to-end judgement did not improve.
MOE_BY_BATCH_WIDE_TILE_RATE: float = 2.25
#: Whether the step prices the by-batch 128 x 128 tile at :data:`MOE_BY_BATCH_WIDE_TILE_RATE` (True) or by the dense
#: tile model (False, as before it was measured); ``benchmarks/moe_vs_sim.py --wide-tile`` turns it on to judge it.
MOE_BY_BATCH_WIDE_TILE_APPLIED: bool = False
#: The vLLM release whose default tiles :data:`MOE_COMPUTE_SHARE` was fitted under (the published
#: runs: 0.10.2-0.11.0); the kernels other than ``fused_moe`` keep its row padding.
MOE_TILE_FITTED_VERSION: tuple[int, int, int] = (0, 11, 0)
#: vLLM 0.17+'s default tile by batch (``get_default_config``, bf16 and per-tensor fp8): tokens up to
#: each bound -> (BLOCK_SIZE_M, BLOCK_SIZE_N); above the last, 128 x 128.
_MOE_TILES_BY_BATCH: tuple[tuple[int, int, int], ...] = ((32, 16, 64), (64, 32, 64), (96, 32, 128), (512, 64, 128))
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


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one kind of linear weight is read and computed: bytes a weight, FLOP rate against bf16."""

    bytes_per_weight: float
    rate_scale: float  # the GPU's rate for this format over its bf16 rate (fp8 on Hopper: 2)


@dataclasses.dataclass(frozen=True)
class ClassGemm:
    """One GEMM of a layer on one TP rank: output width ``n``, input ``k``, over ``layers`` layers."""

    n: int
    k: int
    layers: int
    fmt: WeightFormat


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """The routed experts of a MoE model on one TP rank."""

    experts: int  # the routed experts on this rank: all of them, or under expert parallelism the rank's own
    #: Routed rows per step token on this rank's experts: ``num_experts_per_tok``, or under expert parallelism
    #: ``num_experts_per_tok x experts / num_experts`` (uniform routing's expectation; :func:`moe_shape`).
    top_k: float
    hidden: int
    inter: int  # one expert's intermediate width on this rank (intermediate / tp)
    layers: int  # MoE layers on the stage
    fmt: WeightFormat
    kernel: str = "triton"  # moe_kernel's
    block_quant: bool = False  # block-quantized fp8 experts (moe_tile's other default)
    fused_moe: bool = False  # vLLM's Triton fused_moe_kernel with its default tiles (moe_tile)
    matrices: int = 3  # weight matrices per expert: gate, up, down; 2 (up, down) for a non-gated one (Nemotron-H)
    #: The tuned config vLLM ships for these experts on this GPU, ((M, BLOCK_SIZE_M, BLOCK_SIZE_N), ...)
    #: by batch key (``planner.moe_kernels.tuned_moe_tiles``; () where none): :func:`moe_tile` runs it
    #: below :data:`MOE_TILE_BY_BATCH_SINCE`.
    tuned_tiles: tuple[tuple[int, int, int], ...] = ()

    @property
    def grouped_gemm(self) -> str:
        """The grouped GEMM whose row blocks :func:`moe_block_m` reads: ``fused_moe`` (vLLM's Triton
        kernel at its default tiles), ``matmul_ogs`` (``triton_kernels``, MXFP4 on Hopper) or ``marlin``."""
        if self.fused_moe:
            return "fused_moe"
        return "marlin" if self.kernel.startswith("marlin") else "matmul_ogs"

    @property
    def expert_bytes(self) -> float:
        """Weight bytes of one expert on this rank (gate_up ``2I x H`` and down ``H x I``; non-gated: up ``I x H``)."""
        return float(self.matrices) * self.hidden * self.inter * self.fmt.bytes_per_weight


def distinct_experts(experts: int, top_k: float, tokens: int) -> float:
    """Expected distinct experts ``tokens`` tokens touch, each picking ``top_k`` of ``experts`` uniformly.

    Example:
        >>> distinct_experts(128, 8, 1), round(distinct_experts(128, 8, 16), 1), round(distinct_experts(128, 8, 256), 1)
        (8.0, 82.4, 128.0)
    """
    if tokens <= 0 or experts <= 0 or top_k <= 0:
        return 0.0
    share = min(1.0, top_k / experts)  # a config routing to more experts than it has reads them all
    return experts * (1.0 - (1.0 - share) ** tokens)


def tuned_tile(tiles: tuple[tuple[int, int, int], ...], tokens: int) -> tuple[int, int]:
    """The (BLOCK_SIZE_M, BLOCK_SIZE_N) of a tuned config's batch key nearest ``tokens``: vLLM 0.11.0
    ``fused_moe.py:946`` (``try_get_optimal_moe_config``: ``configs[min(configs.keys(), key=lambda x:
    abs(x - M))]``, the first of two equally near keys, the keys ascending as the file lists them), with
    ``M = min(tokens, VLLM_FUSED_MOE_CHUNK_SIZE)`` (32,768, ``fused_moe.py:1539``; never reached here).

    Example:
        >>> tiles = ((1024, 64, 128), (1536, 128, 256), (4096, 128, 128))
        >>> tuned_tile(tiles, 8192), tuned_tile(tiles, 1280), tuned_tile(tiles, 1300)
        ((128, 128), (64, 128), (128, 256))
    """
    _, block_m, block_n = min(tiles, key=lambda row: abs(row[0] - tokens))
    return block_m, block_n


def moe_tile(tokens: int, experts: int, version: tuple[int, int, int] = MOE_TILE_BY_BATCH_SINCE,
             block_quant: bool = False, tuned: tuple[tuple[int, int, int], ...] = ()) -> tuple[int, int]:
    """fused_moe's (BLOCK_SIZE_M, BLOCK_SIZE_N) for a batch of ``tokens`` under vLLM ``version``.

    vLLM 0.17+ (``get_default_config``; read at 0.17.0 and 0.26.0): 16 x 64 up to 32 tokens, 32 x 64 up to 64, 32 x 128 up to
    96, 64 x 128 up to 512 and 128 x 128 above (block-quantized fp8: 16 x 128 up to 64 tokens, 64 x
    128 above); before :data:`MOE_TILE_BY_BATCH_SINCE`, the ``tuned`` config's tile where vLLM ships one
    (:func:`tuned_tile`; vLLM 0.11.0's files, ``planner.moe_kernels.tuned_moe_tiles``), else 0.11's
    default (``fused_moe.py:868-919@v0.11.0``): block-quantized fp8 64 x 128 (``BLOCK_SIZE_N`` the
    quantization block) at every batch, otherwise 16 x 32 up to ``experts`` tokens and 64 x 64 above.
    From 0.26 a tuned file is not read here (its default tiles are priced, as before).

    Example:
        >>> moe_tile(8192, 8), moe_tile(64, 8), moe_tile(8192, 8, (0, 11, 0))
        ((128, 128), (32, 64), (64, 64))
        >>> moe_tile(8192, 128, (0, 11, 0), tuned=((4096, 128, 128),)), moe_tile(8, 128, (0, 11, 0), block_quant=True)
        ((128, 128), (64, 128))
    """
    if tuple(version) < MOE_TILE_BY_BATCH_SINCE:
        if tuned:
            return tuned_tile(tuned, tokens)
        if block_quant:
            return _MOE_BLOCK_M_LARGE, _MOE_BLOCK_FP8_N_011
        return (_MOE_BLOCK_M_SMALL, 32) if tokens <= experts else (_MOE_BLOCK_M_LARGE, 64)
    if block_quant:
        return (16, 128) if tokens <= 64 else (64, 128)
    for bound, block_m, block_n in _MOE_TILES_BY_BATCH:
        if tokens <= bound:
            return block_m, block_n
    return 128, 128


def by_batch_tile_rate(shape: MoeShape, version: tuple[int, int, int], block_m: int, block_n: int) -> float | None:
    """The measured rate of ``shape``'s fused_moe ``block_m x block_n`` tile against 0.11's default 64 x 64 one,
    where one is measured: :data:`MOE_BY_BATCH_WIDE_TILE_RATE` for 16-bit experts at the by-batch default's
    128 x 128 tile from :data:`MOE_TILE_BY_BATCH_SINCE`; None elsewhere (the dense tile model prices it).

    Example:
        >>> bf16 = MoeShape(128, 8, 2048, 768, 48, WeightFormat(2.0, 1.0), fused_moe=True)
        >>> by_batch_tile_rate(bf16, (0, 26, 0), 128, 128) == MOE_BY_BATCH_WIDE_TILE_RATE
        True
        >>> by_batch_tile_rate(bf16, (0, 16, 0), 128, 128), by_batch_tile_rate(bf16, (0, 26, 0), 64, 128)
        (None, None)
        >>> by_batch_tile_rate(dataclasses.replace(bf16, fmt=WeightFormat(1.0, 2.0)), (0, 26, 0), 128, 128) is None
        True
    """
    if not shape.fused_moe or shape.block_quant or shape.fmt.bytes_per_weight < 2.0:
        return None
    if tuple(version) < MOE_TILE_BY_BATCH_SINCE or (block_m, block_n) != (128, 128):
        return None
    return MOE_BY_BATCH_WIDE_TILE_RATE


def moe_down_share(shape: MoeShape, version: tuple[int, int, int]) -> float:
    """The down GEMM's rate against an aligned one (:data:`MOE_UNALIGNED_DOWN_SHARE`): 1.0 unless
    ``shape`` runs on ``fused_moe_kernel`` with an expert width on the rank that is not a multiple of 16.
    Below :data:`MOE_TILE_BY_BATCH_SINCE` a shape with a tuned file takes the by-batch figure (its tuned
    tiles, like 0.26's, are wider than 0.11's 64 x 64 x 32 default).

    Example:
        >>> oss_tp8 = MoeShape(128, 4, 2880, 360, 36, WeightFormat(2.0, 1.0), fused_moe=True)
        >>> moe_down_share(oss_tp8, (0, 14, 1)), moe_down_share(oss_tp8, (0, 26, 0))
        (0.398, 0.178)
        >>> moe_down_share(dataclasses.replace(oss_tp8, inter=720), (0, 14, 1))
        1.0
    """
    if not shape.fused_moe or shape.inter % 16 == 0:
        return 1.0
    if tuple(version) < MOE_TILE_BY_BATCH_SINCE and not shape.tuned_tiles:
        return MOE_UNALIGNED_DOWN_SHARE["v0.11_default"]
    return MOE_UNALIGNED_DOWN_SHARE["by_batch"]


def unaligned_experts_note(model: ModelProfile, gpu: GpuSpec, tp: int, version: tuple[int, int, int],
                           data_parallel_size: int = 1) -> str:
    """One line where a MoE's experts on each GPU are a width vLLM's fused-MoE kernel runs slowly
    (:func:`moe_down_share` below 1), naming the tensor-parallel sizes that keep it aligned; "" otherwise.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> mixtral, h100 = load_model("mixtral-8x7b"), get_gpu("H100-80GB")
        >>> unaligned_experts_note(mixtral, h100, 8, (0, 14, 1))
        ''
    """
    split = moe_parallel_size(tp, data_parallel_size)
    shape = moe_shape(model, gpu, split, model.num_layers)
    if shape is None:
        return ""
    share = moe_down_share(shape, version)
    if share >= 1.0:
        return ""
    width = model.expert_intermediate_size
    aligned: list[int] = []  # the tensor-parallel sizes that split the experts evenly to a width moe_down_share passes
    for t in (1, 2, 4, 8):
        split_t = moe_parallel_size(t, data_parallel_size)
        shape_t = moe_shape(model, gpu, split_t, model.num_layers) if width % split_t == 0 else None
        if shape_t is not None and moe_down_share(shape_t, version) >= 1.0:
            aligned.append(t)
    fix = f"tensor_parallel_size {', '.join(map(str, aligned))} keep{'s' if len(aligned) == 1 else ''} it aligned" \
        if aligned else "no tensor_parallel_size of 1-8 keeps it aligned"
    return (f"experts: each is {shape.inter} wide on a GPU (intermediate {width} / {split}), not a multiple of 16: "
            f"vLLM's fused-MoE kernel runs its down GEMM at {share:g}x an aligned width's rate (measured on an "
            f"H100, priced here); {fix}")


def prices_tile(shape: MoeShape, version: tuple[int, int, int]) -> bool:
    """Whether the step prices ``shape``'s fused_moe tile against 0.11's default 64 x 64 one
    (``perf.moe_tile_share``): from :data:`MOE_TILE_BY_BATCH_SINCE`, and before it where the tile is not
    that default: a tuned config vLLM ships, or block-quantized fp8's own default (:func:`moe_tile`).

    Example:
        >>> bf16 = MoeShape(128, 8, 4096, 192, 94, WeightFormat(2.0, 1.0), fused_moe=True)
        >>> prices_tile(bf16, (0, 11, 0)), prices_tile(bf16, (0, 26, 0))
        (False, True)
        >>> prices_tile(dataclasses.replace(bf16, block_quant=True), (0, 11, 0))
        True
    """
    if not shape.fused_moe:
        return False
    return tuple(version) >= MOE_TILE_BY_BATCH_SINCE or bool(shape.tuned_tiles) or shape.block_quant


def moe_block_m(grouped_gemm: str, tokens: int, experts: int, top_k: float,
                version: tuple[int, int, int] = MOE_TILE_BY_BATCH_SINCE, block_quant: bool = False,
                tuned: tuple[tuple[int, int, int], ...] = ()) -> int:
    """The rows per block the grouped GEMM pads each expert's tokens to, for a batch of ``tokens``.

    * ``fused_moe``: :func:`moe_tile`'s ``BLOCK_SIZE_M`` (vLLM's ``get_default_config``, or the
      ``tuned`` config's below 0.26).
    * ``matmul_ogs`` (``triton_kernels``' ``make_default_opt_flags_nvidia``, as vendored in vLLM 0.26,
      ``third_party/triton_kernels/matmul_ogs_details/opt_flags.py``): ``max(16, min(next_pow2(t), 128))``
      for ``t = tokens x top_k // experts`` rows an expert expects.
    * ``marlin`` (vLLM 0.26 ``fused_moe/experts/marlin_moe.py``): the first of 8, 16, 32, 48, 64 with
      ``t / block < 0.9``, else 64.

    Example:
        >>> moe_block_m("matmul_ogs", 8192, 128, 4), moe_block_m("marlin", 2048, 128, 4), moe_block_m("marlin", 64, 128, 4)
        (128, 64, 8)
    """
    if grouped_gemm == "fused_moe":
        return moe_tile(tokens, experts, version, block_quant, tuned)[0]
    per_expert = tokens * top_k / max(1, experts)
    if grouped_gemm == "matmul_ogs":
        want = max(1, int(per_expert))
        return max(16, min(1 << (want - 1).bit_length(), 128))
    for block in (8, 16, 32, 48, 64):
        if per_expert / block < 0.9:
            return block
    return 64


def expected_row_blocks(tokens: int, experts: int, top_k: float, block_m: int) -> float:
    """Expected row blocks of ``block_m`` over all experts, each expert's row count binomial
    (``tokens`` tokens, each routed to a given expert with probability ``top_k / experts``):
    ``experts x sum_j P(rows > j block_m)``. With ``block_m`` at or above every count this is
    :func:`distinct_experts`; where the mean count nears a block, the experts that draw a few rows
    over it pay a whole extra block (``moe_align_block_size`` pads each expert on its own).

    Example:
        >>> round(expected_row_blocks(2048, 128, 4, 64), 1), round(expected_row_blocks(64, 128, 4, 64), 1)
        (188.8, 111.2)
    """
    if tokens <= 0 or experts <= 0 or top_k <= 0 or block_m <= 0:
        return 0.0
    p = min(1.0, top_k / experts)
    if p >= 1.0:
        return experts * float(-(-tokens // block_m))
    mean, var = tokens * p, tokens * p * (1.0 - p)
    if var < 25.0 and p <= 0.5:  # exact tail from the binomial pmf (a few dozen terms; (1-p)^n does not underflow)
        pmf, cdf, total, j = (1.0 - p) ** tokens, 0.0, 0.0, 0
        ratio = p / (1.0 - p)
        top = int(mean + 12.0 * math.sqrt(var) + 12.0)
        for k in range(0, min(tokens, top) + 1):
            if k == j * block_m:  # P(rows > j block_m) = 1 - CDF(j block_m)
                total += 1.0 - (cdf + pmf)
                j += 1
            cdf += pmf
            pmf *= (tokens - k) / (k + 1) * ratio
        return experts * total
    sd, total, j = math.sqrt(var), 0.0, 0
    while j * block_m <= mean + 10.0 * sd:  # the normal tail, with continuity correction
        total += 0.5 * math.erfc((j * block_m + 0.5 - mean) / (sd * math.sqrt(2.0)))
        j += 1
    return experts * total


def moe_row_fill(tokens: int, experts: int, top_k: float, block_m: int) -> float:
    """Share of the padded row blocks' rows that carry a token: ``tokens x top_k`` over
    :func:`expected_row_blocks` x ``block_m``.

    Example:
        >>> round(moe_row_fill(2048, 128, 4, 64), 2), round(moe_row_fill(8192, 32, 4, 128), 2)
        (0.68, 0.94)
    """
    blocks = expected_row_blocks(tokens, experts, top_k, block_m)
    return tokens * min(top_k, experts) / (blocks * block_m) if blocks > 0 else 1.0


def runs_triton_attention(model: ModelProfile, gpu: GpuSpec) -> bool:
    """Whether vLLM serves this model's attention on ``TRITON_ATTN`` rather than FlashAttention:
    attention sinks (:data:`ATTENTION_SINK_ARCHITECTURES`) on a GPU below compute capability 9.0."""
    return model.architecture in ATTENTION_SINK_ARCHITECTURES and gpu.compute_capability < 9.0


def moe_kernel(model: ModelProfile, gpu: GpuSpec) -> str:
    """The grouped-GEMM kernel vLLM runs this model's routed experts with on ``gpu``, as
    :data:`MOE_COMPUTE_SHARE` keys it: ``marlin-mxfp4`` / ``marlin`` where the experts' format has
    no tensor cores of its own there, else ``triton``.

    vLLM 0.11.0: MXFP4 (``quantization/mxfp4.py``, ``get_mxfp4_backend``) takes Triton's
    ``matmul_ogs`` on SM90, FlashInfer on SM100 and Marlin below; fp8 (``Fp8MoEMethod``) takes
    Marlin below compute capability 8.9 (``use_marlin``); AWQ / GPTQ / W4A16 experts run
    ``fused_marlin_moe`` (or its WNA16 Triton cousin, priced alike); bf16 experts the Triton ``fused_moe``.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> oss = load_model("gpt-oss-20b")
        >>> moe_kernel(oss, get_gpu("H100-80GB")), moe_kernel(oss, get_gpu("A100-80GB"))
        ('triton', 'marlin-mxfp4')
    """
    method = (model.quantization or "").lower()
    if not method:
        return "triton"
    if model.quantized_experts_only:  # MXFP4
        return "triton" if gpu.compute_capability >= 9.0 else "marlin-mxfp4"
    if "fp8" in method or method == "modelopt" or model.weight_bytes_per_param >= 1.0:
        return "triton" if gpu.fp8_compute else "marlin"
    return "marlin"


def runs_blackwell_triton_moe(gpu: GpuSpec, shape: MoeShape, version: tuple[int, int, int]) -> bool:
    """Whether vLLM ``version`` runs ``shape``'s experts on Triton's ``fused_moe_kernel`` on a
    data-center Blackwell part (compute capability 10.x), the case :data:`BLACKWELL_TRITON_MOE_SHARE`
    prices: 16-bit experts (fp8 and MXFP4 take other kernels there) below :data:`BLACKWELL_TRITON_MOE_UNTIL`.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> bf16 = MoeShape(128, 4, 2880, 360, 36, WeightFormat(2.0, 1.0), fused_moe=True)
        >>> [runs_blackwell_triton_moe(get_gpu(g), bf16, (0, 14, 1)) for g in ("B200", "H200")]
        [True, False]
        >>> runs_blackwell_triton_moe(get_gpu("B200"), bf16, (0, 20, 0))
        False
    """
    return (gpu.platform == "cuda" and 10.0 <= gpu.compute_capability < 11.0 and shape.fused_moe
            and shape.fmt.bytes_per_weight >= 2.0 and tuple(version) < BLACKWELL_TRITON_MOE_UNTIL)


def blackwell_moe_mem_share(gpu: GpuSpec, mem_efficiency: float) -> float:
    """The fused-MoE kernel's weight-streaming rate on data-center Blackwell against the dense GEMMs'
    (``Calibration.mem_efficiency`` of ``gpu``'s datasheet bandwidth), at most 1: the B200's published
    marginal rate (:func:`fused_moe_marginal_gbps`, 5,938 GB/s, 0.742 of its 8,000) over that dense
    rate. **Derived from a published kernel benchmark, not fitted**; it multiplies
    ``Calibration.moe_mem_share`` where :func:`runs_blackwell_triton_moe` holds.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> round(blackwell_moe_mem_share(get_gpu("B200"), 0.7884), 3)
        0.941
    """
    return min(1.0, fused_moe_marginal_gbps() / (gpu.hbm_gbps * mem_efficiency))


def moe_compute_share(gpu: GpuSpec, override: float = 0.0, kernel: str = "triton", blackwell_triton: bool = False) -> float:
    """:data:`MOE_COMPUTE_SHARE` of ``kernel`` for ``gpu``'s architecture (compute capability 9.0 and
    up: Hopper's; a cell not fitted: :data:`MOE_UNFITTED_SHARE`, else ``triton``'s), or ``override``
    when it is above 0; ``blackwell_triton`` (:func:`runs_blackwell_triton_moe`): the sourced
    :data:`BLACKWELL_TRITON_MOE_SHARE` instead of a fitted cell.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> a100, h100 = get_gpu("A100-80GB"), get_gpu("H100-80GB")
        >>> moe_compute_share(a100, kernel="marlin-mxfp4"), moe_compute_share(a100, kernel="marlin")
        (0.7, 0.35)
        >>> moe_compute_share(a100), moe_compute_share(h100, kernel="marlin")
        (0.2, 0.3)
    """
    if override > 0:
        return override
    if blackwell_triton:
        return BLACKWELL_TRITON_MOE_SHARE
    arch = "hopper" if gpu.compute_capability >= 9.0 else "ampere"
    fitted = MOE_COMPUTE_SHARE.get(kernel, {}).get(arch)
    if fitted is not None:
        return fitted
    return MOE_UNFITTED_SHARE.get(arch, MOE_COMPUTE_SHARE["triton"][arch])


def weight_format(model: ModelProfile, gpu: GpuSpec, experts: bool = False) -> WeightFormat:
    """The :class:`WeightFormat` of the model's linear weights (``experts``: its routed experts).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> oss, h100 = load_model("gpt-oss-20b"), get_gpu("H100-80GB")
        >>> weight_format(oss, h100).bytes_per_weight, weight_format(oss, h100, experts=True).bytes_per_weight
        (2.0, 0.53125)
    """
    method = (model.quantization or "").lower()
    bf16 = WeightFormat(float(model.dtype_bytes), 1.0)
    if not method or (model.quantized_experts_only and not experts):
        return bf16
    if model.quantized_experts_only:  # MXFP4 experts: no fp4 tensor cores before Blackwell
        return WeightFormat(MXFP4_BYTES, 1.0)
    wbytes = model.weight_bytes_per_param
    fp8_rate = gpu.fp8_tflops / gpu.bf16_tflops if gpu.bf16_tflops else 1.0
    if "fp8" in method or method == "modelopt":
        if gpu.fp8_compute:
            return WeightFormat(wbytes, fp8_rate)
        return WeightFormat(wbytes, W4A16_COMPUTE_SHARE)  # weight-only through Marlin (as_loaded_on)
    if wbytes >= 1.0:  # W8A8 (compressed-tensors / bitsandbytes 8-bit): 8-bit tensor cores
        return WeightFormat(wbytes, fp8_rate if gpu.fp8_compute else 1.0)
    return WeightFormat(wbytes, W4A16_COMPUTE_SHARE)  # 4-bit weights, 16-bit activations (Marlin)


def is_class_model(model: ModelProfile) -> bool:
    """Whether any rule here applies (MoE, a quantized checkpoint, sliding-window layers)."""
    return bool(model.is_moe or model.quantization or model.layer_types)


def moe_parallel_size(tp: int, data_parallel_size: int = 1) -> int:
    """The tensor-parallel size a MoE layer's routed experts are split over: ``tp x data_parallel_size``.

    vLLM 0.14.1 without ``--enable-expert-parallel``: ``FusedMoEParallelConfig.make``
    (``model_executor/layers/fused_moe/config.py:893@0.14.1``) takes ``use_ep`` False (:973-976) and
    returns the size ``flatten_tp_across_dp_and_pcp`` gives (:882-891, ``dp_size * pcp_size * tp_size``)
    as the layer's ``tp_size`` (:986-998), so each GPU holds ``intermediate / (tp x D)`` of every
    expert; read the same at 0.26.0 (``flatten_tp_across_dp_and_pcp``). Attention and the dense layers
    keep ``tp``. With expert parallelism the experts are split whole instead, each at its full width
    (:func:`moe_shape`'s ``ep``; ``EngineConfig.expert_parallel_size``).

    Example:
        >>> moe_parallel_size(4, 2), moe_parallel_size(8)
        (8, 8)
    """
    return max(1, tp) * max(1, data_parallel_size)


def moe_step_tokens(tokens: int, data_parallel_size: int = 1) -> int:
    """The tokens one MoE layer of a DP replica runs in a step where the replica schedules ``tokens``:
    every replica's, ``tokens x data_parallel_size``.

    vLLM 0.14.1: with ``dp_size`` > 1 ``FusedMoE.forward_impl`` all-gathers the hidden states and
    router logits of the DP group before the experts and reduce-scatters the output after
    (``model_executor/layers/fused_moe/layer.py:1922-1925, 1957, 2024-2025@0.14.1``; the default
    ``all2all_backend`` ``allgather_reducescatter``, ``config/parallel.py:152@0.14.1``, is
    ``AgRsAll2AllManager``: ``all_gatherv`` / ``reduce_scatterv`` over ``get_dp_group()``,
    ``distributed/device_communicators/all2all.py:117-164@0.14.1``), and the replicas step together:
    each step's token counts are all-reduced over the DP group and, with CUDA graphs on, padded to the
    largest (``v1/worker/gpu_model_runner.py:3020-3040@0.14.1``, ``v1/worker/dp_utils.py:38-56,
    79-91@0.14.1``), an idle replica running a dummy batch. First
    order: the replicas carry the same load, so each step's MoE runs ``D`` times the replica's own
    (padded) tokens; the padding of a lighter replica up to a heavier one is not modelled.

    Example:
        >>> moe_step_tokens(100, 2), moe_step_tokens(100)
        (200, 100)
    """
    return tokens * max(1, data_parallel_size)


def moe_shape(model: ModelProfile, gpu: GpuSpec, tp: int, layers: int, ep: int = 1) -> MoeShape | None:
    """The routed experts on one TP rank of a stage of ``layers`` layers (None for a dense model).

    ``ep`` > 1 (``--enable-expert-parallel``, ``tp`` then 1): the rank holds
    :func:`~servetune.planner.modelinfo.local_experts` whole experts (rank 0's, the most), and of a step's
    ``tokens x top_k`` routed rows the share ``local / num_experts`` lands on them: uniform routing's
    expectation, not the busiest rank's load (vLLM's ``determine_expert_map``, linear placement). Every
    expert then gets ``tokens x top_k / num_experts`` rows, as without expert parallelism, at the whole width.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> m = moe_shape(load_model("qwen3-30b-a3b"), get_gpu("H100-80GB"), 1, 48, ep=4)
        >>> m.experts, m.top_k, m.inter
        (32, 2.0, 768)
    """
    if not model.is_moe:
        return None
    moe_layers = layers - min(model.first_k_dense_replace, layers)
    if "moe" in model.layer_types:  # Nemotron-H: only its E layers hold experts (hybrid.hybrid_kinds)
        moe_layers = model.layer_types[:layers].count("moe")
    kernel = moe_kernel(model, gpu)
    fmt = weight_format(model, gpu, experts=True)
    fused = kernel == "triton" and not model.quantized_experts_only
    if fused and model.quant_block_k and fmt.rate_scale > BLOCK_FP8_MOE_RATE_SCALE:
        fmt = WeightFormat(fmt.bytes_per_weight, BLOCK_FP8_MOE_RATE_SCALE)
    experts = local_experts(model.num_experts, ep)
    tuned = moe_kernels.tuned_moe_tiles(model, gpu.name, tp, experts=experts if ep > 1 else None) if fused else ()
    top_k = model.num_experts_per_tok * experts / model.num_experts if ep > 1 else model.num_experts_per_tok
    return MoeShape(experts, top_k, model.expert_hidden_size,
                    max(1, model.expert_intermediate_size // tp), moe_layers, fmt,
                    kernel, bool(model.quant_block_k), fused, 3 if model.ffn_gated else 2, tuned)


def class_gemms(model: ModelProfile, gpu: GpuSpec, tp: int, layers: int) -> list[ClassGemm]:
    """The ordinary (non-routed) GEMMs of one stage's layers on one TP rank.

    Attention's q/k/v and o (MLA: its projections as one GEMM of the same weight count), the dense
    MLP of a dense model or of DeepSeek's leading dense layers, a MoE model's shared experts and
    its router (bf16, replicated). The routed experts are :func:`moe_shape`'s.
    """
    if model.is_hybrid:
        return _hybrid_gemms(model, gpu, tp, layers)
    d = model.hidden_size
    fmt = weight_format(model, gpu)
    attn_fmt = fmt
    out: list[ClassGemm] = []
    if model.mla_kv_lora_rank:
        attn = model._attention_params(tp)
        out.append(ClassGemm(max(1, attn // d), d, layers, attn_fmt))
    else:
        q = model.q_size // tp
        kv = model.kv_heads_per_gpu(tp) * model.head_dim
        out += [ClassGemm(q + 2 * kv, d, layers, attn_fmt), ClassGemm(d, q, layers, attn_fmt)]
    dense_layers = layers if not model.is_moe else min(model.first_k_dense_replace, layers)
    if dense_layers:
        inter = max(1, model.intermediate_size // tp)
        out += [ClassGemm(2 * inter, d, dense_layers, fmt), ClassGemm(d, inter, dense_layers, fmt)]
    moe_layers = layers - dense_layers
    if moe_layers:
        bf16 = WeightFormat(float(model.dtype_bytes), 1.0)
        out.append(ClassGemm(model.num_experts, d, moe_layers, bf16))  # the router
        shared = model.shared_expert_intermediate_size // tp
        if shared:
            out += [ClassGemm(2 * shared, d, moe_layers, fmt), ClassGemm(d, shared, moe_layers, fmt)]
    return out


def _hybrid_gemms(model: ModelProfile, gpu: GpuSpec, tp: int, layers: int) -> list[ClassGemm]:
    """A Mamba / attention hybrid's ordinary GEMMs, each on the layers that hold it (``layer_types``):
    q/k/v and o on the attention layers (Qwen3-Next's gated q twice as wide), the mixer's ``in_proj``
    (``ModelProfile.mamba_in_proj_width``, the figure its weights count) and ``out_proj`` on the Mamba
    layers, and the MLP where there is one: every layer (granite-4.0-h, Bamba, Falcon-H1, Qwen3-Next) or
    the ``mlp`` layers (Nemotron-H's two-matrix ``up`` / ``down``); a MoE MLP's router and shared expert
    here, its routed experts :func:`moe_shape`'s."""
    d = model.hidden_size
    fmt = weight_format(model, gpu)
    kinds = model.layer_types[:layers]
    both = kinds.count("parallel")
    attn, mamba = kinds.count("full") + both, kinds.count("mamba") + both
    ffn = len(kinds) if model.ffn_gated else kinds.count("mlp") + kinds.count("moe")
    out: list[ClassGemm] = []
    if attn:
        q = model.q_size // tp * (2 if model.attn_output_gate else 1)
        kv = model.kv_heads_per_gpu(tp) * model.head_dim
        out += [ClassGemm(q + 2 * kv, d, attn, fmt), ClassGemm(d, model.q_size // tp, attn, fmt)]
    if mamba:
        out += [ClassGemm(model.mamba_in_proj_width(tp) // tp, d, mamba, fmt),
                ClassGemm(d, model.mamba_inner // tp, mamba, fmt)]
    if ffn and model.is_moe:
        out.append(ClassGemm(model.num_experts, d, ffn, WeightFormat(float(model.dtype_bytes), 1.0)))  # the router
        shared = model.shared_expert_intermediate_size // tp
        if shared:
            out += [ClassGemm((2 if model.ffn_gated else 1) * shared, d, ffn, fmt), ClassGemm(d, shared, ffn, fmt)]
    elif ffn:
        inter = max(1, model.intermediate_size // tp)
        out += [ClassGemm((2 if model.ffn_gated else 1) * inter, d, ffn, fmt), ClassGemm(d, inter, ffn, fmt)]
    return out


def sliding_kv_share(model: ModelProfile, layers: int) -> float:
    """Share of the stage's layers that slide (read at most ``model.sliding_window`` tokens)."""
    kinds = model.layer_types[:layers] if model.layer_types else ()
    if not kinds or not model.sliding_window:
        return 0.0
    return sum(1 for k in kinds if k == "sliding") / len(kinds)
