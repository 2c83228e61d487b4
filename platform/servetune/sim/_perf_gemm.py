"""The GEMMs' prices for :class:`servetune.sim.perf.PerfModel`: the tile grid and each GEMM's roofline.

Contract: :func:`wave_fill` is the share of the dense peak a GEMM's output tile grid reaches
(``perf``'s docstring, "GEMMs"), :func:`moe_tile_share` a fused-MoE tile's rate against the one the
MoE share was fitted on; :class:`GemmTerms` is the part of ``PerfModel`` that prices a step's GEMMs
(the layers' four, the LM head and a MoE's routed experts, with the model classes' GEMMs of
:mod:`servetune.sim.perf_classes`), each a roofline of its bytes and FLOPs blended by
``Calibration.gemm_blend_exponent``. ``PerfModel.__init__`` sets the terms declared on the class.
Pure arithmetic, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servetune.sim import _class_gemms, _moe_rates, _moe_shape, _moe_tiles

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.modelinfo import ModelProfile
    from servetune.sim._calibration import Calibration
    from servetune.vllm_version import Version

__all__ = ["DEFAULT_SMS", "GemmTerms", "moe_tile_share", "wave_fill"]

#: Output tiles a Hopper bf16 GEMM can run with, and the share of the large tile's rate each
#: reaches (smaller tiles reuse less of what they load): the wave-quantisation model of wave_fill.
_TILES: tuple[tuple[int, int, float], ...] = ((128, 256, 1.0), (128, 128, 0.9), (64, 128, 0.75), (64, 64, 0.5))
#: SMs when the GPU table has none: an H100 / H200 SXM.
DEFAULT_SMS = 132
#: Batch shapes PerfModel remembers the GEMM time of (a few MB at most).
_GEMM_MEMO_MAX = 1 << 16


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


class GemmTerms:
    """The GEMMs of one step (a mixin of :class:`servetune.sim.perf.PerfModel`, which sets the terms below)."""

    #: (N, K, weight seconds, FLOPs per row) of each layer GEMM, over the stage's layers.
    _gemms: list[tuple[int, int, float, float]]
    #: The same for the LM head (one row per sampled request).
    _head: tuple[int, int, float, float]
    _act_bytes_token: float
    _sms: int
    _flop_rate: float
    _blend: float
    _token_tile: int
    _moe: _moe_shape.MoeShape | None
    #: DP replicas whose tokens each MoE layer runs (``EngineConfig.data_parallel_size``; 1 without DP;
    #: ``PerfModel.__init__`` sets it).
    _moe_dp: int
    #: The routed experts' matrices in aligned-FLOP units (:meth:`_init_classes`).
    _moe_matrices: float
    #: Seconds of the routed experts' activation traffic per step token, in ``_act_bytes_token`` too
    #: (:meth:`moe_activation_seconds`).
    _moe_act_token: float = 0.0
    #: Seconds a step's MoE layers pay beside their weights' streaming (``_moe_tiles.by_batch_stream``; 0 elsewhere).
    _moe_call_s: float = 0.0
    #: Seconds a step's MoE layers pay for their routers (``_moe_tiles.MOE_ROUTER_KERNELS_S``; 0 where the fitted
    #: floor stands in for them), in every step that runs the experts.
    _moe_router_s: float = 0.0
    #: Whether the experts run Triton's fused-MoE kernel on data-center Blackwell at the sourced share (no
    #: ``Calibration.moe_compute_share`` override): a tile of at most 64 rows then runs at the 64-row UMMA
    #: ceiling's share (``_moe_rates.blackwell_triton_tile_share``).
    _moe_blackwell_tiles: bool = False
    _version: Version
    _gemm_memo: dict[tuple[int, int], float]

    def _init_classes(self, model: ModelProfile, gpu: GpuSpec, tp: int, layers: int, mem_rate: float,
                      cal: Calibration, dp: int = 1, ep: int = 1) -> None:
        """The GEMMs of a MoE, quantized or sliding-window model, from :mod:`servetune.sim.perf_classes`.

        Every GEMM carries its own weight bytes and FLOP rate (its FLOPs are stored in bf16-rate
        units); the LM head stays in the model dtype; the routed experts are :meth:`moe_seconds`'.
        ``dp`` > 1 (DP replicas without expert parallelism): the routed experts split over ``tp x dp``
        GPUs (:func:`~servetune.sim.perf_classes.moe_parallel_size`), their activations moved for every
        replica's tokens (:func:`~servetune.sim.perf_classes.moe_step_tokens`); the other GEMMs stay at ``tp``.
        ``ep`` > 1 (``--enable-expert-parallel``, ``EngineConfig.expert_parallel_size``: ``tp x dp``): the rank's own
        whole experts instead, at the share of the routed rows uniform routing sends them
        (:func:`~servetune.sim.perf_classes.moe_shape`); the tokens are every replica's as under DP without it.
        """
        bf16_rate = gpu.bf16_tflops * 1e12 * cal.compute_efficiency
        self._flop_rate = bf16_rate
        specs = _class_gemms.class_gemms(model, gpu, tp, layers)
        self._gemms = [(g.n, g.k, g.n * g.k * g.fmt.bytes_per_weight * g.layers / mem_rate,
                        2.0 * g.n * g.k * g.layers / g.fmt.rate_scale) for g in specs]
        act = sum(2.0 * (g.n + g.k) * g.layers for g in specs)
        vocab, d = self._head[0], self._head[1]
        self._head = (vocab, d, vocab * d * model.dtype_bytes / mem_rate, 2.0 * vocab * d)
        split = 1 if ep > 1 else _moe_shape.moe_parallel_size(tp, dp)
        self._moe = _moe_shape.moe_shape(model, gpu, split, layers, ep=ep)
        if self._moe is not None:
            m = self._moe
            # Each routed row reads its token (H) and writes 2I (non-gated: I), then reads I and writes H,
            # for every replica's tokens under DP (a replica's token stands for dp gathered ones).
            moe_act = _moe_shape.moe_step_tokens(1, dp) * 2.0 * m.top_k * (
                m.hidden + (m.matrices - 1) * m.inter + m.inter + m.hidden) * m.layers
            act += moe_act
            self._moe_act_token = moe_act / mem_rate
            blackwell = _moe_rates.runs_blackwell_triton_moe(gpu, m, self._version)
            mem_share = cal.moe_mem_share
            if blackwell:  # the Triton kernel's own streaming rate on Blackwell, from a published benchmark
                mem_share *= _moe_rates.blackwell_moe_mem_share(gpu, cal.mem_efficiency)
            # 16-bit experts on Hopper under the by-batch tiles: the kernel's own measured streaming rate and
            # fixed cost a layer (_moe_tiles.by_batch_stream, None off Hopper; Calibration.moe_mem_share scales it).
            stream = _moe_tiles.by_batch_stream(m, self._version, gpu)
            self._moe_mem_rate = (mem_rate if stream is None else stream[0]) * mem_share
            self._moe_call_s = 0.0 if stream is None else stream[1] * m.layers
            self._moe_flop_rate = bf16_rate * m.fmt.rate_scale * _moe_rates.moe_compute_share(gpu, cal.moe_compute_share,
                                                                                                m.kernel, blackwell)
            self._moe_blackwell_tiles = blackwell and cal.moe_compute_share <= 0
            # The matrices' FLOPs in units of an aligned one's: the down GEMM at its own rate where its K is
            # unaligned (moe_down_share); fixed by the shape and the version, so set once here.
            self._moe_matrices = m.matrices - 1 + 1.0 / _moe_tiles.moe_down_share(m, self._version)
            # Seconds to stream one touched expert's weights: the down matrix at its own cap where its width is
            # unaligned (_moe_tiles.unaligned_down_bytes_per_s), the rest at the experts' rate.
            cap = _moe_tiles.unaligned_down_bytes_per_s(m, self._version, gpu)
            down = m.expert_bytes / m.matrices
            self._moe_expert_s = ((m.expert_bytes - down) / self._moe_mem_rate
                                  + down / (self._moe_mem_rate if cap is None else min(self._moe_mem_rate, cap)))
            # Where the kernel's measured stream prices the experts, the router's measured kernels replace the
            # end-to-end fitted floor (_moe_tiles.MOE_ROUTER_KERNELS_S); elsewhere the floor stands.
            measured = stream is not None and _moe_tiles.MOE_ROUTER_KERNELS_APPLIED
            self._moe_floor_s = 0.0 if measured else m.layers * cal.moe_layer_floor_s
            self._moe_router_s = m.layers * _moe_tiles.MOE_ROUTER_KERNELS_S if measured else 0.0
            self._moe_row_blocks = cal.moe_row_blocks >= 0.5
        self._act_bytes_token = act / mem_rate

    def moe_seconds(self, tokens: int) -> float:
        """The routed experts' grouped GEMMs for ``tokens`` rows over the stage's MoE layers.

        Weight bytes: the touched experts' (:func:`~servetune.sim.perf_classes.distinct_experts`), an
        unaligned width's down matrix at its per-SM cap (:func:`~servetune.sim._moe_tiles.unaligned_down_bytes_per_s`);
        16-bit experts on Hopper under the by-batch tiles at the kernel's measured rate plus its fixed cost a layer
        (:func:`~servetune.sim._moe_tiles.by_batch_stream`);
        FLOPs: ``2 x tokens x top_k x 3 H I``, at the share of the tile rows the kernel's
        per-expert padding to ``BLOCK_SIZE_M`` leaves busy, and from vLLM 0.17 (whose default tile
        grows with the batch, :func:`~servetune.sim.perf_classes.moe_tile`) at that tile's rate
        against the 64 x 64 tile the compute share was fitted on (:func:`moe_tile_share`); the down
        GEMM at :func:`~servetune.sim.perf_classes.moe_down_share` of that rate; on data-center Blackwell's Triton
        path a tile of at most 64 rows at its 64-row UMMA ceiling's share (:func:`~servetune.sim._moe_rates.blackwell_triton_tile_share`).
        """
        m = self._moe
        if m is None or tokens <= 0:
            return 0.0
        touched = _moe_shape.distinct_experts(m.experts, m.top_k, tokens)
        if touched <= 0:
            return 0.0
        mem_s = touched * m.layers * self._moe_expert_s + self._moe_call_s
        rows = tokens * m.top_k
        if self._moe_row_blocks:  # each kernel's own row block, padded per expert (perf_classes.moe_row_fill)
            block = _moe_tiles.moe_block_m(m.grouped_gemm, tokens, m.experts, m.top_k, self._version, m.block_quant,
                                             m.tuned_tiles)
            width = _moe_tiles.moe_tile(tokens, m.experts, self._version, m.block_quant, m.tuned_tiles)[1]
            fill = _moe_tiles.moe_row_fill(tokens, m.experts, m.top_k, block)
        else:  # the rule before: 0.11's fused_moe rows for every kernel, padding from the mean count
            if m.fused_moe:
                block, width = _moe_tiles.moe_tile(tokens, m.experts, self._version, m.block_quant, m.tuned_tiles)
            else:
                block, width = _moe_tiles.moe_tile(tokens, m.experts, _moe_tiles.MOE_TILE_FITTED_VERSION)
            per_expert = rows / touched
            fill = per_expert / (-(-per_expert // block) * block)
        new_tiles = _moe_tiles.prices_tile(m, self._version)
        tile = moe_tile_share(block, width) if new_tiles else 1.0
        if _moe_tiles.MOE_BY_BATCH_WIDE_TILE_APPLIED:  # the kernel's timed rate at that tile (off: not taken)
            measured = _moe_tiles.by_batch_tile_rate(m, self._version, block, width)
            tile = tile if measured is None else measured
        if self._moe_blackwell_tiles:  # the tile's own UMMA ceiling on Blackwell (64 rows: half the 128-row rate)
            tile *= _moe_rates.blackwell_triton_tile_share(block) / _moe_rates.BLACKWELL_TRITON_MOE_SHARE
        comp_s = 2.0 * rows * self._moe_matrices * m.hidden * m.inter * m.layers / (self._moe_flop_rate * fill * tile)
        return max(self._combine(mem_s, comp_s), self._moe_floor_s)

    def moe_activation_seconds(self, tokens: int) -> float:
        """The routed experts' activation traffic a step charges beside :meth:`moe_seconds` for ``tokens``
        rows (a replica's; under DP every replica's, as :meth:`moe_seconds` takes them) over the stage's MoE
        layers: each routed row reads its token and writes the gate/up output, the down GEMM reads it and writes
        the hidden row, at the dense weight-streaming rate (0 for a dense model). With :meth:`moe_seconds` it is
        what the step prices for the work vLLM's ``fused_experts`` does (``benchmarks/moe_vs_sim.py --layer``)."""
        return self._moe_act_token * tokens if self._moe is not None and tokens > 0 else 0.0

    @property
    def moe_shape(self) -> _moe_shape.MoeShape | None:
        """The routed experts :meth:`moe_seconds` prices (None for a dense model)."""
        return self._moe

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
        if self._moe is not None:  # every DP replica's tokens (moe_step_tokens; 1 replica without DP)
            total += self.moe_seconds(_moe_shape.moe_step_tokens(tokens, self._moe_dp)) + self._moe_router_s
        return total + self._combine(mem_s, flops * rows / (rate * wave_fill(rows, n, sms, self._token_tile)))
