"""The rates of vLLM's grouped-MoE kernels against the dense GEMMs', by kernel and GPU architecture.

Contract: :func:`moe_compute_share` is the share of the dense GEMMs' compute rate a MoE's experts reach
(:data:`MOE_COMPUTE_SHARE`, fitted on published runs; :data:`MOE_UNFITTED_SHARE` for a kernel without a
fitted cell; on data-center Blackwell, where :func:`runs_blackwell_triton_moe` holds,
:data:`BLACKWELL_TRITON_MOE_SHARE`, derived from published kernel rates); :data:`MOE_MEM_SHARE` and
:func:`blackwell_moe_mem_share` their weight-streaming rate against the dense GEMMs'. Each figure says
where it comes from and what it was judged on. The rules' story is :mod:`servetune.sim.perf_classes`'
docstring ("MoE"), which re-exports every public name here. Pure arithmetic, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servetune.sim._moe_shape import MoeShape, distinct_experts

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec

__all__ = ["B200_CUBLAS_SHARE", "B200_FUSED_MOE_DEFAULT_US", "BLACKWELL_TRITON_MOE_SHARE", "BLACKWELL_TRITON_MOE_UNTIL",
           "CUBLAS_BF16_MATMUL_TFLOPS", "DATASHEET_BF16_TFLOPS", "HOPPER_COMPUTE_EFFICIENCY", "MOE_COMPUTE_SHARE",
           "RTX5090_CUBLAS_SHARE",
           "MOE_MEM_SHARE", "MOE_UNFITTED_SHARE",
           "TRITON_BF16_MATMUL_TFLOPS", "blackwell_moe_mem_share", "fused_moe_marginal_gbps", "moe_compute_share",
           "runs_blackwell_triton_moe", "BLACKWELL_UMMA_BF16_FLOPS_PER_CYCLE", "BLACKWELL_NARROW_TILE_ROWS",
           "BLACKWELL_TRITON_MOE_NARROW_SHARE", "blackwell_triton_tile_share"]

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
#: ``triton``/Ampere refit 2026-12-06 after ``GpuSpec.sm_count`` (the GEMM wave model on the A100's own 108
#: SMs) and the A100's refit KV-read and attention shares (``GPU_FAMILY_OVERRIDES["A100-80GB"]``), the same
#: grid, fit runs and rule (resumes recomputed whole): 0.2 -> 0.25 (mean |error| on its four fit runs 9.5% at
#: 0.2, 8.7% at 0.25, 13.3% at 0.3; before the A100 refit 0.25 already led 0.2 by 0.0001). ``triton``/Hopper
#: (0.3) and ``marlin-mxfp4``/Ampere (0.7, Triton attention 0.1) refit the same and stay.
#: ``Calibration.moe_compute_share`` > 0 replaces every one.
MOE_COMPUTE_SHARE: dict[str, dict[str, float]] = {"triton": {"hopper": 0.3, "ampere": 0.25},
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
#: 989 TFLOP/s, HGX B200 2,250 TFLOP/s, GeForce RTX 5090 209 TFLOP/s with fp32 accumulate; a test holds
#: them equal to the GPU table).
DATASHEET_BF16_TFLOPS: dict[str, float] = {"H100-80GB": 989.0, "B200": 2250.0, "RTX-5090": 209.0}
#: cuBLAS's sustained bf16 rate on a B200, TFLOP/s: ``torch.matmul`` at M = N = K = 8192 in torchao's
#: ``benchmarks/float8/bench_matmul.py`` on "NVIDIA B200" (pytorch/ao#2427, https://github.com/pytorch/ao/pull/2427,
#: 2025-06-23: "torch.bfloat16 time_sec 7.74E-04, tops/sec 1.42E+15, pct_peak 0.631"; 0.627 at 4096, 0.646 at
#: 6144). The H100's published counterpart, 797.5 at 8192 (0.806 of 989; zzc0721/torch-performance-test-data#79,
#: PyTorch 2.7.0), sits beside the H200's measured 0.775 (``Calibration.compute_efficiency``, servetune's own
#: cuBLAS probes), so Hopper's calibrated share is its sustained cuBLAS rate and the B200's is this one.
#: The GeForce RTX 5090's, 234.8: the median of four published ``torch.matmul`` bf16 timings at
#: M = N = K = 8192 on "NVIDIA GeForce RTX 5090" cards (zzc0721/torch-performance-test-data, the benchmark
#: whose H100 row is quoted above: #15 236.03, #96 234.89, #124 234.66, #200 174.68 TFLOP/s; PyTorch 2.7-2.8,
#: CUDA 12.8, four machines; 235.3-240.1 at 10,240 on the first three). Above the datasheet's 209: the
#: datasheet rates the tensor cores at the 2.41 GHz rated boost clock, which GeForce cards run above under
#: load (the memory clock, and so the bandwidth, is fixed).
CUBLAS_BF16_MATMUL_TFLOPS: dict[str, float] = {"B200": 1420.0, "RTX-5090": 234.8}
#: The B200's dense GEMMs' share of its datasheet peak (``Calibration.compute_efficiency`` on the B200,
#: ``_calibration.GPU_FAMILY_OVERRIDES``): 1,420 / 2,250 = 0.631, where the H200's 0.775 would price cuBLAS at
#: 1,744 TFLOP/s, 23% above the published sustained rate. **Read from a published kernel benchmark, not
#: fitted**; looked for on 2026-12-07 after the five held-out B200 runs were seen fast (no figure chosen on them).
B200_CUBLAS_SHARE: float = CUBLAS_BF16_MATMUL_TFLOPS["B200"] / DATASHEET_BF16_TFLOPS["B200"]
#: The RTX 5090's dense GEMMs' share of its datasheet peak, the same way: 234.8 / 209 = 1.123, where the H200's
#: 0.775 would price cuBLAS at 162 TFLOP/s, 31% under the published sustained rate. **Read from published kernel
#: benchmarks, not fitted**; looked for on 2026-12-07 after the seven held-out RTX 5090 runs
#: (``tests/fixtures/published_runs/pegainfer_qwen3_4b.yaml``) were seen slow (no figure chosen on them).
RTX5090_CUBLAS_SHARE: float = CUBLAS_BF16_MATMUL_TFLOPS["RTX-5090"] / DATASHEET_BF16_TFLOPS["RTX-5090"]
#: The dense GEMMs' share of the datasheet peak that Hopper's fitted :data:`MOE_COMPUTE_SHARE` is a share of:
#: ``Calibration.compute_efficiency`` (the H200's, which every Hopper part takes; a test holds them equal).
HOPPER_COMPUTE_EFFICIENCY: float = 0.775
#: :data:`MOE_COMPUTE_SHARE`'s ``triton`` cell on data-center Blackwell (compute capability 10.x),
#: **derived from published kernel rates, not fitted**: Hopper's fitted share times the share of the
#: datasheet ratio Triton's matmul keeps from H100 to B200 (:data:`TRITON_BF16_MATMUL_TFLOPS` over
#: :data:`DATASHEET_BF16_TFLOPS`: 885.9 / 523.0 = 1.694 of 2,250 / 989 = 2.275, i.e. 0.745), so
#: 0.3 x 0.745 = 0.223 (0.269 at the 8,192 pair) of the B200's peak at Hopper's dense share; since
#: 2026-12-07 taken against the B200's own dense rate (:data:`B200_CUBLAS_SHARE`, 0.631 where Hopper's is
#: 0.775), so 0.223 x 0.775 / 0.631 = 0.274 and the Triton rate itself (389 TFLOP/s) is unchanged: only the
#: Triton kernel's rate is scaled from the H100's. Applies where vLLM runs 16-bit experts on Triton's
#: ``fused_moe_kernel`` there (:func:`runs_blackwell_triton_moe`); the five held-out B200 gpt-oss-120b
#: bf16 runs (``tests/fixtures/published_runs/nvlink_moe.yaml``) were read before this rule was
#: written (they motivated looking) but no figure here was chosen on them. Since 2026-12-07 it prices tiles of
#: more than 64 rows only (:func:`blackwell_triton_tile_share`): a 64-row tile takes
#: :data:`BLACKWELL_TRITON_MOE_NARROW_SHARE` (the tilelang thread does not show the Triton matmul's tile; the
#: TileLang configurations timed beside it are 128 and 256 rows).
BLACKWELL_TRITON_MOE_SHARE: float = (MOE_COMPUTE_SHARE["triton"]["hopper"]
                                     * (TRITON_BF16_MATMUL_TFLOPS["B200"] / TRITON_BF16_MATMUL_TFLOPS["H100-80GB"])
                                     / (DATASHEET_BF16_TFLOPS["B200"] / DATASHEET_BF16_TFLOPS["H100-80GB"])
                                     * HOPPER_COMPUTE_EFFICIENCY / B200_CUBLAS_SHARE)
#: BF16 ``tcgen05.mma`` (UMMA) throughput of one B200 SM in FLOPs per cycle, by the instruction's row count M
#: (one CTA, both operands in shared memory, a saturated pipeline): SemiAnalysisAI/microbench-blackwell
#: ``umma_throughput/tput_results_max.csv`` (https://github.com/SemiAnalysisAI/microbench-blackwell, commit
#: 9a068d8, 2026-05-10), rows "BF16,SS,1,64,64,16,256,...,4026.28" and "BF16,SS,1,128,256,16,256,...,8152.85".
#: A 64-row instruction reaches half of a 128-row one's at every N it lists (4,026-4,078 from N = 64 to 256).
#: Hopper has no such loss: its ``wgmma.mma_async`` instruction is 64 rows at every shape (PTX ISA, ``.m64nNk16``
#: for bf16), so its datasheet peak is the 64-row rate.
BLACKWELL_UMMA_BF16_FLOPS_PER_CYCLE: dict[int, float] = {64: 4026.28, 128: 8152.85}
#: The widest ``BLOCK_SIZE_M`` priced at the 64-row ceiling: vLLM 0.14.1's untuned fused-MoE tiles are 16 and 64
#: rows (``get_default_config``, ``model_executor/layers/fused_moe/fused_moe.py:1270-1285@v0.14.1``), below 64 rows
#: no 128-row instruction can be filled either.
BLACKWELL_NARROW_TILE_ROWS: int = 64
#: :data:`BLACKWELL_TRITON_MOE_SHARE` for a tile of at most :data:`BLACKWELL_NARROW_TILE_ROWS` rows (gpt-oss-120b
#: bf16 at TP=8 under 0.14.1: no tuned B200 file for ``E=128,N=360``, so 64 x 64 x 32 above 128 tokens), **derived
#: from a published microbenchmark, not fitted**: the Triton kernel keeps the share of its tile's tensor-core
#: ceiling it keeps on Hopper (the fitted 0.3 of Hopper's dense share, a 64-row tile giving up nothing there),
#: and on the B200 that ceiling is 4,026 / 8,153 = 0.494 of the peak (:data:`BLACKWELL_UMMA_BF16_FLOPS_PER_CYCLE`):
#: 0.3 x 0.494 x 0.775 / 0.631 = 0.182 of the B200's dense rate, 258 TFLOP/s where the tuned matmul's ratio
#: gives 389 (Hopper's 230: 1.12x, about the ratio of SMs x clock, 148 x 1,965 over 132 x 1,980 = 1.11).
#: Written 2026-12-07 after the five held-out B200 gpt-oss-120b runs (``nvlink_moe.yaml``) were seen fast by a
#: context-independent 20-23 ms in each 8,192-token prefill step (their p99 ITL); no figure was chosen on them.
BLACKWELL_TRITON_MOE_NARROW_SHARE: float = (MOE_COMPUTE_SHARE["triton"]["hopper"]
                                            * BLACKWELL_UMMA_BF16_FLOPS_PER_CYCLE[64] / BLACKWELL_UMMA_BF16_FLOPS_PER_CYCLE[128]
                                            * HOPPER_COMPUTE_EFFICIENCY / B200_CUBLAS_SHARE)


def blackwell_triton_tile_share(block_m: int) -> float:
    """The Triton fused-MoE kernel's compute share on data-center Blackwell for a tile of ``block_m`` rows:
    :data:`BLACKWELL_TRITON_MOE_NARROW_SHARE` up to :data:`BLACKWELL_NARROW_TILE_ROWS` rows (a 64-row UMMA runs at
    half the 128-row rate), :data:`BLACKWELL_TRITON_MOE_SHARE` (the tuned Triton matmul's H100 -> B200 ratio) above.

    Example:
        >>> round(blackwell_triton_tile_share(64), 3), round(blackwell_triton_tile_share(128), 3)
        (0.182, 0.274)
    """
    return BLACKWELL_TRITON_MOE_NARROW_SHARE if block_m <= BLACKWELL_NARROW_TILE_ROWS else BLACKWELL_TRITON_MOE_SHARE


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
#: 16-bit experts on Hopper under vLLM 0.17+'s by-batch tiles take the kernel's rate timed on an H100
#: instead (``_moe_tiles.MOE_BY_BATCH_STREAM``, 2026-12-07), which this knob scales.
MOE_MEM_SHARE: float = 1.0


def runs_blackwell_triton_moe(gpu: GpuSpec, shape: MoeShape, version: tuple[int, int, int]) -> bool:
    """Whether vLLM ``version`` runs ``shape``'s experts on Triton's ``fused_moe_kernel`` on a
    data-center Blackwell part (compute capability 10.x), the case :data:`BLACKWELL_TRITON_MOE_SHARE`
    prices: 16-bit experts (fp8 and MXFP4 take other kernels there) below :data:`BLACKWELL_TRITON_MOE_UNTIL`.

    Example:
        >>> from servetune.sim.perf_classes import WeightFormat
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
        (0.25, 0.3)
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
