"""Step-time rules of Mamba2 and gated-delta-net layers (Mamba / attention hybrids), from vLLM's kernels.

:class:`~servetune.sim.perf.PerfModel` stays the one step-time model; this module gives it what a
hybrid's recurrent layers add to a step beyond their GEMMs, on one TP rank, counted from the kernels
vLLM 0.26.0 runs for them. No constant here is fitted: every figure is a shape of the model, a
kernel's arithmetic, or a knob the GPU already has (``Calibration.mem_efficiency`` for bytes, the
GEMMs' ``compute_efficiency`` of the dense peak for FLOPs).

* **GEMMs.** A Mamba2 mixer's ``in_proj`` (``hidden -> inner + conv_dim + heads``) and ``out_proj``
  (``inner -> hidden``); a gated delta net's ``in_proj_qkvz`` + ``in_proj_ba`` and ``out_proj``: the
  widths the planner's weights count (``ModelProfile.mamba_in_proj_width``), priced as every other
  GEMM by ``perf_classes.class_gemms``. Attention GEMMs, KV reads, KV writes and prefill attention run
  on the attention layers only (``ModelProfile.kv_bytes_per_token`` counts only theirs).
* **Decode.** Each decoding request reads and writes its whole recurrent state once a step in every
  Mamba layer: ``causal_conv1d_update`` its conv state and ``selective_state_update`` (Mamba2) or
  ``fused_recurrent_gated_delta_rule`` (gated delta net) its SSM state, both in place. The bytes are
  the planner's state shapes (``hybrid.mamba_state_bytes``: vLLM's ``MambaSpec`` shapes, the SSM
  state in ``mamba_ssm_dtype_bytes``), twice (read and write), at ``mem_efficiency`` of the HBM
  bandwidth. Padded CUDA-graph rows carry ``PAD_SLOT_ID`` and touch no state.
* **Prefill.** A chunk's tokens go through ``causal_conv1d_fn`` and the chunked scan:
  Mamba2's ``mamba_chunk_scan_combined`` (``layers/mamba/ops/ssd_combined.py``,
  ``_mamba_chunk_scan_combined_fwd``: chunk cumsum, ``_chunk_state_fwd``, ``_state_passing_fwd``,
  ``_bmm_chunk_fwd``, ``_chunk_scan_fwd``) on ``chunk_size`` chunks (:func:`ssd_scan_kernels`), or
  FLA's ``chunk_gated_delta_rule`` on 64-token chunks (:func:`gdn_scan_kernels`). Each kernel is a
  roofline of its HBM bytes and its FLOPs; the prefilling request reads its initial state and writes
  its final one. A gated delta net's chunked path also copies each of its requests' SSM state twice:
  gathered into a new tensor before the kernel (``ssm_state[indices]``) and scattered back after it
  (``ssm_state[indices] = ...``), ``models/qwen3_next.py`` lines 774-793 of 0.17.1,
  ``layers/mamba/gdn/qwen_gdn_linear_attn.py`` lines 1433-1452 of 0.26.0. Before vLLM 0.23.0 every
  decoding request of a step that holds a prefill takes that path too
  (``VllmMemoryRules.gdn_mixed_batch_chunked``).
* **Fixed costs.** One mixer's kernels pay ``Calibration.attn_layer_s`` a step, as an attention
  layer's do (an assumption: the Mamba kernels' own fixed cost is not measured); a mixed batch's
  PIECEWISE graph is split at every mixer (vLLM's ``splitting_ops`` hold ``vllm::mamba_mixer2`` and
  ``vllm::qwen_gdn_attention_core`` beside attention; the 2026-12-06 H100 server logs print them), so
  ``piecewise_layer_s`` is paid per mixer layer, not per decoder layer.

Judged (never fitted) on two real H100 SXM windows of vLLM 0.26.0, 2026-12-06
(``tests/sim/test_hybrid_sim.py``).

Example:
    >>> k = ssd_scan_kernels(heads=48, head_dim=64, d_state=128, groups=1, chunk=256, act_bytes=2)
    >>> [x.name for x in k]
    ['chunk_cumsum', 'chunk_state', 'state_passing', 'bmm_chunk', 'chunk_scan']
    >>> round(sum(x.flops for x in k) / 1e6, 2)   # FLOPs per token and layer: 2QNG + 4NPH + QPH (+ cumsum)
    2.43
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from servetune.planner.hybrid import mamba_ssm_state_bytes, mamba_state_bytes

if TYPE_CHECKING:
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["FLA_CHUNK", "HybridShape", "ScanKernel", "SSD_STATE_BYTES", "gdn_partial_chunk_bytes",
           "gdn_scan_kernels", "hybrid_note", "hybrid_shape", "ssd_scan_kernels"]

#: Bytes of one element of the SSD scan's chunk states and of ``CB``: fp32. ``_chunk_state_fwd(...,
#: states_in_fp32=True)`` and ``_bmm_chunk_fwd(..., output_dtype=torch.float32)`` in
#: ``layers/mamba/ops/ssd_combined.py`` (``_mamba_chunk_scan_combined_fwd``); the passed states are
#: written in the activations' dtype (``_state_passing_fwd(..., out_dtype=C.dtype)``).
SSD_STATE_BYTES: int = 4
#: FLA's chunk length in ``chunk_gated_delta_rule`` (``layers/fla/ops/chunk.py``: every kernel's ``BT``, 64).
FLA_CHUNK: int = 64
#: Bytes of one fp32 element (dA cumsum, dt, beta, g, the A matrix of the delta rule).
_FP32 = 4


@dataclasses.dataclass(frozen=True)
class ScanKernel:
    """One kernel of a chunked scan: HBM bytes and FLOPs per prefill token, one layer, one TP rank."""

    name: str
    bytes: float
    flops: float


@dataclasses.dataclass(frozen=True)
class HybridShape:
    """A hybrid's recurrent layers on one TP rank of a stage (the figures :class:`PerfModel` reads)."""

    kind: str  # "mamba2" or "gdn"
    mamba_layers: int  # layers with a Mamba / gated-delta-net mixer (Falcon-H1's parallel ones included)
    attention_layers: int  # layers with attention (full or parallel)
    ffn_layers: int  # layers with an MLP or MoE block
    state_bytes: int  # one request's state in one Mamba layer (conv + SSM): hybrid.mamba_state_bytes
    ssm_state_bytes: int  # its SSM part alone (heads x head_dim x d_state in the SSM dtype)
    decode_token_bytes: float  # per decode token and layer: the mixer's activations outside its GEMMs
    prefill_token_bytes: float  # per prefill token and layer: conv1d and the gated norm
    scan: tuple[ScanKernel, ...]  # the chunked scan's kernels, per prefill token and layer
    # a gated delta net's per-chunk state tile (heads x K x V in the activations' dtype; 0 for Mamba2),
    # which ``fwd_h`` stores and ``fwd_o`` reads once per chunk of every sequence (:func:`gdn_partial_chunk_bytes`)
    chunk_state_bytes: int = 0
    chunk: int = FLA_CHUNK  # the chunked scan's chunk, tokens (``scan`` is priced on it)

    @property
    def partial_chunk_bytes(self) -> float:
        """HBM bytes one prefilling sequence adds in one layer for its last, partial chunk's state tile
        (:func:`gdn_partial_chunk_bytes` on :attr:`chunk`; 0 for Mamba2)."""
        return gdn_partial_chunk_bytes(self.chunk_state_bytes, self.chunk)

    @property
    def mixer_layers(self) -> int:
        """Layers whose mixer splits a PIECEWISE graph and pays a mixer's fixed cost (Falcon-H1's count twice)."""
        return self.mamba_layers + self.attention_layers


def ssd_scan_kernels(heads: int, head_dim: int, d_state: int, groups: int, chunk: int,
                     act_bytes: int) -> tuple[ScanKernel, ...]:
    """The Mamba2 SSD scan's five kernels per token and layer (``H`` heads of ``P``, state ``N``,
    ``G`` groups on the rank, chunk ``Q``, activations of ``a`` bytes; Dao & Gu 2024, the SSD algorithm):

    * ``chunk_cumsum``: reads dt (``H a``), writes dt and dA's cumsum (``2 H`` fp32).
    * ``chunk_state``: each chunk's state ``B^T (x dt decay)``: ``2 N P H`` FLOPs; reads x (``H P a``), B
      (``G N a``), dt and dA (``2 H`` fp32), writes one ``H P N`` fp32 state per chunk.
    * ``state_passing``: the recurrence over chunks: reads those states, writes them in ``a``; ``2 H P N / Q``.
    * ``bmm_chunk``: ``C B^T`` in each chunk, every ``Q x Q`` pair (the kernel is not causal):
      ``2 Q N G`` FLOPs; reads B and C, writes ``Q G`` fp32.
    * ``chunk_scan``: the diagonal block's causal half, ``(CB * decay) x``: ``Q P H`` FLOPs, and the
      passed state's share ``C state``: ``2 N P H``; reads CB, x, C, dt, dA and the chunk's state, writes y.
    """
    h, p, n, g, q, a = heads, head_dim, d_state, groups, chunk, act_bytes
    state = h * p * n
    return (ScanKernel("chunk_cumsum", h * a + 2 * h * _FP32, 0.0),
            ScanKernel("chunk_state", h * p * a + g * n * a + 2 * h * _FP32 + state * SSD_STATE_BYTES / q,
                       2.0 * n * p * h),
            ScanKernel("state_passing", state * (SSD_STATE_BYTES + a) / q, 2.0 * state / q),
            ScanKernel("bmm_chunk", 2 * g * n * a + q * g * _FP32, 2.0 * q * n * g),
            ScanKernel("chunk_scan", q * g * _FP32 + 2 * h * p * a + g * n * a + 2 * h * _FP32 + state * a / q,
                       float(q * p * h) + 2.0 * n * p * h))


def gdn_scan_kernels(heads: int, head_v: int, head_k: int, act_bytes: int,
                     chunk: int = FLA_CHUNK) -> tuple[ScanKernel, ...]:
    """FLA's ``chunk_gated_delta_rule`` forward per token and layer (``H`` value heads of ``V``, keys of
    ``K`` per value head, chunk ``T``; the WY form of Yang et al. 2024, "Gated Delta Networks"):

    * ``kkt``: ``A = beta K K^T`` per chunk, ``2 T K`` FLOPs; reads k, writes ``T`` fp32.
    * ``solve_tril``: ``(I + A)^-1``, ``T^3 / 3`` multiply-adds a chunk: ``2 T^2 / 3`` FLOPs a token.
    * ``w_u``: ``w = A k``, ``u = A v``: ``2 T (K + V)``; reads k, v, A, writes w, u.
    * ``fwd_h``: the state over chunks, ``v_new = u - w h`` and ``h += k^T v_new``: ``4 K V``; reads k,
      w, u, writes v_new and one ``K V`` state per chunk.
    * ``fwd_o``: ``o = q h + (q k^T * mask) v_new``: ``2 K V + 2 T K + 2 T V``; reads q, k, v_new, h, writes o.
    """
    h, v, k, t, a = heads, head_v, head_k, chunk, act_bytes
    return (ScanKernel("kkt", h * (k * a + t * _FP32 + 2 * _FP32), h * 2.0 * t * k),
            ScanKernel("solve_tril", h * (t * _FP32 + t * a), h * 2.0 * t * t / 3.0),
            ScanKernel("w_u", h * (2 * (k + v) * a + t * a), h * 2.0 * t * (k + v)),
            ScanKernel("fwd_h", h * ((2 * k + 2 * v) * a + k * v * a / t), h * 4.0 * k * v),
            ScanKernel("fwd_o", h * ((2 * k + 2 * v) * a + k * v * a / t), h * (2.0 * k * v + 2.0 * t * (k + v))))


def gdn_partial_chunk_bytes(chunk_state_bytes: int, chunk: int = FLA_CHUNK) -> float:
    """HBM bytes one prefilling sequence adds in one gated-delta-net layer beyond :func:`gdn_scan_kernels`'
    per-token share: its last, partial chunk's state tile, written by ``fwd_h`` and read by ``fwd_o``.

    FLA's ``chunk_gated_delta_rule_fwd_h`` allocates ``h = k.new_empty(B, NT, H, V, K)`` with ``NT`` the
    chunks of all sequences, ``cdiv(T_i, 64)`` each (``prepare_chunk_indices``), and stores one tile per
    chunk that ``chunk_fwd_o`` reads back (``layers/fla/ops/chunk_delta_h.py`` lines 297-320 and
    ``chunk.py`` lines 35-64 of vLLM 0.17.1). :func:`gdn_scan_kernels` spreads that tile over the
    chunk's ``T`` tokens (``K V a / T`` a token), which is exact for full chunks and misses
    ``(T - 1) / T`` of a tile for a one-token sequence: a decode that a mixed batch sends through the
    chunked path (vLLM before 0.23.0, ``VllmMemoryRules.gdn_mixed_batch_chunked``). Counted once per
    prefilling sequence, it is exact for those and at most that much over for a longer prefill.
    Read from vLLM's source after the held-out Qwen3.5-35B-A3B H200 runs were seen fast; nothing fitted.

    Example (Qwen3.5-35B-A3B at TP=1: 32 value heads of 128 x 128, bf16): about 2 MB a sequence and layer.
        >>> round(gdn_partial_chunk_bytes(32 * 128 * 128 * 2) / 2**20, 3)
        1.969
    """
    return 2.0 * chunk_state_bytes * (chunk - 1) / chunk


def hybrid_shape(model: ModelProfile, tp: int, layers: int, ssm_dtype_bytes: int) -> HybridShape | None:
    """The recurrent layers among the first ``layers`` of ``model`` on one TP rank (None: not a hybrid).

    ``ssm_dtype_bytes``: the SSM state's element (``hybrid.mamba_ssm_dtype_bytes`` under the
    version's rules), as the planner sizes the state.
    """
    if not model.is_hybrid:
        return None
    kinds = model.layer_types[:layers]
    both = kinds.count("parallel")
    mamba = kinds.count("mamba") + both
    attention = kinds.count("full") + both
    ffn = len(kinds) if model.ffn_gated else kinds.count("mlp") + kinds.count("moe")
    a = model.dtype_bytes
    groups = model.mamba_groups_on(tp)
    conv_dim = model.mamba_conv_dim(tp) // tp
    inner = model.mamba_inner // tp
    heads = model.mamba_heads // tp
    if model.mamba_kind == "gdn":
        chunk = model.mamba_chunk_size
        scan = gdn_scan_kernels(heads, model.mamba_head_dim, model.mamba_d_state, a, chunk)
    else:
        # A Nemotron-H config without chunk_size: vLLM's own NemotronHConfig default, 256
        # (transformers_utils/configs/nemotron_h.py line 189 of 0.26.0), the planner's 0 meaning "not named".
        chunk = model.mamba_chunk_size or 256
        scan = ssd_scan_kernels(heads, model.mamba_head_dim, model.mamba_d_state, max(1, groups // tp), chunk, a)
    return HybridShape(
        kind=model.mamba_kind, mamba_layers=mamba, attention_layers=attention, ffn_layers=ffn,
        state_bytes=mamba_state_bytes(model, tp, ssm_dtype_bytes),
        ssm_state_bytes=mamba_ssm_state_bytes(model, tp, ssm_dtype_bytes),
        # conv update (reads x B C, writes them), the state update (reads x B C, writes y), gated norm (y, z -> out)
        decode_token_bytes=float((3 * conv_dim + 4 * inner) * a),
        # causal_conv1d_fn (reads x B C, writes them) and the gated norm; the scan's own traffic is in ``scan``
        prefill_token_bytes=float((2 * conv_dim + 3 * inner) * a),
        scan=scan,
        chunk_state_bytes=heads * model.mamba_head_dim * model.mamba_d_state * a if model.mamba_kind == "gdn" else 0,
        chunk=chunk)


def hybrid_note(model: ModelProfile) -> str | None:
    """The one line ``servetune simulate`` prints beside a hybrid's figures (None for other models): its
    recurrent layers' step time is counted from vLLM's kernels, fitted on nothing, and judged on two real
    windows only.

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> hybrid_note(load_model("llama-3.1-8b")) is None, hybrid_note(load_model("granite-4.0-h-tiny"))[:30]
        (True, 'granite-4.0-h-tiny: the step t')
    """
    if not model.is_hybrid:
        return None
    layers = "gated-delta-net" if model.mamba_kind == "gdn" else "Mamba2"
    return (f"{model.name}: the step time of its {layers} layers is counted from vLLM's kernels, fitted on nothing, "
            "and judged only on two H100 SXM windows of vLLM 0.26.0 (granite-4.0-h-tiny, Nemotron-H-8B: "
            "docs/model-classes.md); unjudged beyond them")
