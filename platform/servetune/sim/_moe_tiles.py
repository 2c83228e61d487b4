"""vLLM's fused-MoE kernel tiles and the padding of the experts' rows, by vLLM release and batch.

Contract: :func:`moe_tile` is the (BLOCK_SIZE_M, BLOCK_SIZE_N) ``fused_moe_kernel`` runs a batch with
(0.11's two defaults, a tuned config vLLM ships, or the by-batch default from
:data:`MOE_TILE_BY_BATCH_SINCE`); :func:`prices_tile` and :func:`by_batch_tile_rate` say whether and
at what rate a step prices that tile against 0.11's 64 x 64 one; :func:`moe_block_m` is the row block
each grouped GEMM pads an expert's tokens to and :func:`moe_row_fill` the share of the padded rows that
carry a token (:func:`expected_row_blocks`, over the experts' binomial row counts); :func:`moe_down_share`
the down GEMM's rate at an expert width that is not a multiple of 16, and :func:`unaligned_experts_note`
the line ``plan`` says about it. The rules' story is :mod:`servetune.sim.perf_classes`' docstring ("MoE"),
which re-exports every public name here.

:data:`MOE_BY_BATCH_WIDE_TILE_RATE` and :data:`MOE_BY_BATCH_WIDE_TILE_APPLIED` are read here at each call
(``_perf_gemm`` reads the latter through this module): ``benchmarks/moe_vs_sim.py --wide-tile`` sets both
on this module to judge the rate. Pure arithmetic, no I/O.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from servetune.sim._moe_shape import MoeShape, moe_parallel_size, moe_shape

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["MOE_BY_BATCH_WIDE_TILE_APPLIED", "MOE_BY_BATCH_WIDE_TILE_RATE", "MOE_TILE_BY_BATCH_SINCE",
           "MOE_TILE_FITTED_VERSION", "MOE_UNALIGNED_DOWN_GBPS", "MOE_UNALIGNED_DOWN_SHARE", "BOOST_CLOCK_MHZ",
           "MOE_BY_BATCH_STREAM", "MOE_BY_BATCH_STREAM_APPLIED", "MOE_ROUTER_KERNELS_APPLIED",
           "MOE_ROUTER_KERNELS_S", "by_batch_stream", "by_batch_tile_rate",
           "expected_row_blocks",
           "moe_block_m", "moe_down_share", "moe_row_fill", "moe_tile", "prices_tile", "tuned_tile",
           "unaligned_down_bytes_per_s", "unaligned_experts_note"]

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
#: The same down GEMM's weight streaming rate (GB/s) where few rows reach each expert (16-256 tokens),
#: on a GH100 die (132 SMs at 1,980 MHz: the H100 SXM and the H200). Its unvectorized loads are bound by
#: load instructions per SM, not by HBM: the H200, with the H100's SMs and clock and 1.43x its bandwidth,
#: streamed it at the H100's rate (1.43 / 1.37 / 1.08 TB/s at 16 / 64 / 256 tokens under 0.11's tiles,
#: against 1.31 / 1.37 / 1.07; 0.95 / 0.74 / 0.89 against 0.87 / 0.72 / 0.89 under 0.26's) while its aligned
#: neighbours streamed 1.28-1.35x faster (``tests/fixtures/real_h200_classes/kernels/moe_probe_align_h200.json``,
#: 2026-12-06, the outcome written down before its rows were read; its README). **Read off the H100's rows**
#: (``moe_probe_align_h100.json``, K = 360 at 16, 64 and 256 tokens, the gate/up GEMM at the neighbours' rate:
#: the mean of the three; ``benchmarks/moe_vs_sim.py --derive``), judged on the H200's. Scaled to other GPUs by
#: SMs (``GpuSpec.sm_count``) x boost clock (:data:`BOOST_CLOCK_MHZ`);
#: a GPU not listed there keeps HBM streaming (no cap). The mechanism was first suspected from the published
#: gpt-oss-120b TP=8 runs' H100 / H200 / B200 ratios (held out), so those are not blind to it.
MOE_UNALIGNED_DOWN_GBPS: dict[str, float] = {"v0.11_default": 1250.0, "by_batch": 830.0}
#: How vLLM's ``fused_experts`` streams 16-bit experts under the by-batch default tiles (from
#: :data:`MOE_TILE_BY_BATCH_SINCE`) on Hopper where few rows reach each expert: ``hbm_share`` of the datasheet
#: bandwidth for the touched experts' bytes, plus ``call_s`` a layer (the call's fixed cost: ``moe_align_block_size``,
#: two kernel launches and their tails, the activation and the top-k sum). **Measured on kernels, not fitted on
#: runs**: least squares of time = ``call_s`` + bytes / (``hbm_share`` x 3,350 GB/s) over vLLM 0.26.0's timings on
#: an H100 SXM (``tests/fixtures/real_h100/kernels/moe_probe_h100.json``, configuration ``vllm``) at 16-128 tokens,
#: bytes the expected touched experts' under uniform routing, of four 16-bit layers: Qwen3-30B-A3B and
#: DeepSeek-V2-Lite at TP=1, Qwen3-235B-A22B at TP=8, gpt-oss-120b at TP=4 (16 rows, within 0.97-1.05;
#: ``benchmarks/moe_vs_sim.py --stream``): 3,002 GB/s (0.896) and 18.8 us, where the step priced these experts at
#: the dense GEMMs' streaming rate (``Calibration.mem_efficiency`` 0.7884 of 3,350: 2,641 GB/s) and no fixed cost.
#: Judged on the rows not fitted (the same command): Mixtral-8x7B at TP=1 and TP=2 (E=8, I=14,336 and 7,168) 0.96-1.00
#: of the prediction, the H100 alignment probes' aligned layers above 100 us 0.97-1.12 (below it, where the step's
#: 60.7 us floor a layer takes over, 1.05-1.22), and the H200's aligned
#: layers (``moe_probe_align_h200.json``, the share of its 4,800 GB/s) 0.98-1.14. cuBLAS streams the dense layers'
#: large matrices at 2.5-3.0 TB/s at 1-64 tokens (``gemm_probe_graph_h100_tp1.json``), which the dense rate keeps.
#: Not for fp8 experts: per-tensor and block fp8 layers streamed 2.3-2.8 TB/s on the same probe (they keep the
#: dense rate), nor before 0.17 (0.11's 64 x 64 x 32 tile streamed Mixtral's experts at 2.1-2.3 TB/s).
MOE_BY_BATCH_STREAM: dict[str, float] = {"hbm_share": 0.896, "call_s": 18.8e-6}
#: Whether the step prices :data:`MOE_BY_BATCH_STREAM` (True, from 2026-12-07) or the dense streaming rate with no
#: fixed cost (False, the rule before); ``benchmarks/moe_vs_sim.py --stream`` judges both.
MOE_BY_BATCH_STREAM_APPLIED: bool = True
#: What an MoE layer's router costs a step beside its experts where :data:`MOE_BY_BATCH_STREAM` prices them: the gate
#: GEMM at its kernel floor (cuBLAS ``nvjet_sm90_tst_64x8`` on [tokens, hidden] x [hidden, experts]) and vLLM's
#: ``topkGating`` kernel. **Read off vLLM 0.26.0's own profiler inside real engine steps, not fitted on runs**:
#: the Qwen3-30B-A3B shape on an H100 SXM decoding 1 and 4 sequences
#: (``tests/fixtures/real_h100_classes/2026-12-07_q3moe_prof_*``, ``benchmarks/steps_vs_sim.py --classes``): 4.84
#: and 5.01 us for the GEMM, 3.47 and 3.64 us for the top-k, per layer and step (the step prices the GEMM by its
#: bytes, 0.2 us, and the top-k not at all). There the fitted ``Calibration.moe_layer_floor_s`` (60.7 us a layer,
#: fitted end to end on the 2026-12-05 FP8 start's windows) had stood in for these kernels and more at one
#: sequence, charging the experts 1.78x their kernels' 1.64 ms; the stream rule prices those kernels at 44 us a
#: layer (34.2 timed in the step), so where it applies the floor gives way to this measured cost
#: (:data:`MOE_ROUTER_KERNELS_APPLIED`). Elsewhere (fp8 experts, before 0.17, off Hopper) the floor, fitted with
#: these kernels inside it, stays. Judged on the held-out windows (docs/model-classes.md, "Inside the MoE step").
MOE_ROUTER_KERNELS_S: float = 8.3e-6
#: Whether experts priced by :data:`MOE_BY_BATCH_STREAM` pay :data:`MOE_ROUTER_KERNELS_S` a layer instead of the
#: fitted floor (True, from 2026-12-07) or the floor as before (False).
MOE_ROUTER_KERNELS_APPLIED: bool = True
#: Boost clock (MHz) of the GPUs the cap is scaled to, datasheets: the H100 SXM and the H200 1,980; the B200 1,965.
BOOST_CLOCK_MHZ: dict[str, float] = {"H100-80GB": 1980.0, "H200": 1980.0, "B200": 1965.0}
#: The GPU the cap was read on: an H100 SXM's 132 SMs at 1,980 MHz.
_CAP_SM_MHZ = 132 * 1980.0
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
        >>> import dataclasses
        >>> from servetune.sim.perf_classes import WeightFormat
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
        >>> import dataclasses
        >>> from servetune.sim.perf_classes import WeightFormat
        >>> oss_tp8 = MoeShape(128, 4, 2880, 360, 36, WeightFormat(2.0, 1.0), fused_moe=True)
        >>> moe_down_share(oss_tp8, (0, 14, 1)), moe_down_share(oss_tp8, (0, 26, 0))
        (0.398, 0.178)
        >>> moe_down_share(dataclasses.replace(oss_tp8, inter=720), (0, 14, 1))
        1.0
    """
    key = _unaligned_key(shape, version)
    return 1.0 if key is None else MOE_UNALIGNED_DOWN_SHARE[key]


def _unaligned_key(shape: MoeShape, version: tuple[int, int, int]) -> str | None:
    """Which tile set an unaligned down GEMM runs under; None where the width is aligned or not ``fused_moe``."""
    if not shape.fused_moe or shape.inter % 16 == 0:
        return None
    if tuple(version) < MOE_TILE_BY_BATCH_SINCE and not shape.tuned_tiles:
        return "v0.11_default"
    return "by_batch"


def unaligned_down_bytes_per_s(shape: MoeShape, version: tuple[int, int, int], gpu: GpuSpec) -> float | None:
    """The down GEMM's weight streaming cap (bytes/s) for an unaligned expert width on ``gpu``
    (:data:`MOE_UNALIGNED_DOWN_GBPS` x its SMs x clock over the GH100's); None where none applies (an aligned
    width, or a GPU whose clock or SM count is not known here).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.sim.perf_classes import WeightFormat
        >>> oss_tp8 = MoeShape(128, 4, 2880, 360, 36, WeightFormat(2.0, 1.0), fused_moe=True)
        >>> [round(unaligned_down_bytes_per_s(oss_tp8, (0, 14, 1), get_gpu(g)) / 1e9) for g in ("H100-80GB", "H200", "B200")]
        [1250, 1250, 1391]
        >>> unaligned_down_bytes_per_s(oss_tp8, (0, 14, 1), get_gpu("A100-80GB")) is None
        True
    """
    key = _unaligned_key(shape, version)
    clock = BOOST_CLOCK_MHZ.get(gpu.name)
    if key is None or clock is None or not gpu.sm_count:
        return None
    return MOE_UNALIGNED_DOWN_GBPS[key] * 1e9 * gpu.sm_count * clock / _CAP_SM_MHZ


def by_batch_stream(shape: MoeShape, version: tuple[int, int, int], gpu: GpuSpec) -> tuple[float, float] | None:
    """(bytes/s, seconds a layer) at which ``shape``'s touched experts stream under vLLM ``version`` on ``gpu``
    (:data:`MOE_BY_BATCH_STREAM`): 16-bit experts on ``fused_moe``'s by-batch default tiles on a Hopper part
    (compute capability 9.x) while :data:`MOE_BY_BATCH_STREAM_APPLIED`; None elsewhere (the dense GEMMs'
    streaming rate, no fixed cost).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.sim.perf_classes import WeightFormat
        >>> mixtral = MoeShape(8, 2, 4096, 14336, 32, WeightFormat(2.0, 1.0), fused_moe=True)
        >>> rate, call = by_batch_stream(mixtral, (0, 26, 0), get_gpu("H100-80GB"))
        >>> round(rate / 1e9), round(call * 1e6, 1)
        (3002, 18.8)
        >>> by_batch_stream(mixtral, (0, 11, 0), get_gpu("H100-80GB"))  # 0.11's 64 x 64 tile: the dense rate
        >>> by_batch_stream(mixtral, (0, 26, 0), get_gpu("A100-80GB"))  # not Hopper
    """
    if not MOE_BY_BATCH_STREAM_APPLIED or not shape.fused_moe or shape.block_quant or shape.fmt.bytes_per_weight < 2.0:
        return None
    if tuple(version) < MOE_TILE_BY_BATCH_SINCE or gpu.platform != "cuda" or not 9.0 <= gpu.compute_capability < 10.0:
        return None
    return MOE_BY_BATCH_STREAM["hbm_share"] * gpu.hbm_gbps * 1e9, MOE_BY_BATCH_STREAM["call_s"]


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
        >>> import dataclasses
        >>> from servetune.sim.perf_classes import WeightFormat
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
