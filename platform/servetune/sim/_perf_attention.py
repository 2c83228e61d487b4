"""Attention's prices for :class:`servetune.sim.perf.PerfModel`: prefill, MLA and sliding windows.

Contract: :class:`AttentionTerms` is the part of ``PerfModel`` that prices a step's attention beyond
the dense per-token terms ``PerfModel.__init__`` sets (``perf``'s docstring, "Attention"): MLA's own
dimensions (:meth:`AttentionTerms._init_mla`), prefill attention at a rate that rises with the
context on FlashAttention-3 (:meth:`AttentionTerms._prefill_attention`), and sliding-window layers
capped at their window (:meth:`AttentionTerms._sliding_attention`). Pure arithmetic, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["AttentionTerms"]


class AttentionTerms:
    """Attention of one step (a mixin of :class:`servetune.sim.perf.PerfModel`, which sets the terms below)."""

    #: Seconds per decode context token (KV read) and per prefill (token x context) pair, on full-attention layers.
    _t_kv_read: float
    _t_attn: float
    #: Sliding-window layers' share of the two, and their window in tokens (0: none).
    _t_kv_read_slide: float
    _t_attn_slide: float
    _window: int
    #: FlashAttention-3's long-context rate: ``k`` tokens and ``attn_efficiency / attn_long_efficiency`` (0, 1: off).
    _attn_long_k: float
    _attn_long_ratio: float
    #: MLA: seconds per earlier-context token a prefill chunk up-projects again (0: not MLA).
    _t_mla_context: float
    #: The GEMMs' FLOP rate (MLA's up-projection of earlier context runs at it).
    _flop_rate: float

    def _init_mla(self, model: ModelProfile, heads: int, layers: int, attn_rate: float) -> None:
        """MLA attention (DeepSeek-V2/V3) from its own dimensions, not the dense rules' ``head_dim``.

        vLLM's MLA backends (``attention/backends/mla``; the ``MLACommonImpl`` both prefill and decode
        go through) cache one latent of ``kv_lora_rank + qk_rope_head_dim`` elements per token and
        layer, on every TP rank (``ModelProfile.kv_bytes_per_token``), and:

        * **prefill** up-projects the chunk's latents through ``kv_b_proj`` and runs ordinary
          attention, scores over ``qk_nope_head_dim + qk_rope_head_dim`` and values over
          ``v_head_dim``: ``2 (qk + v)`` FLOPs a head per (token, context) pair where the dense rule
          has ``4 head_dim``; a chunk whose request already has context up-projects that context's
          cached latents again (``_compute_prefill_context``): ``2 kv_lora_rank heads (nope + v)``
          FLOPs per context token and layer, at the GEMM rate.
        * **decode** runs absorbed (``W_UK_T``, ``W_UV``): every head scores the latent and its
          rope part (``kv_lora_rank + rope``) and sums latents (``kv_lora_rank``), reading each
          cached latent once for all heads, so a context token costs the larger of its bytes and
          ``2 heads (2 kv_lora_rank + rope)`` FLOPs at the attention rate.
        """
        lora, rope = model.mla_kv_lora_rank, model.mla_rope_dim
        qk, v = model.mla_nope_dim + rope, model.mla_v_dim
        self._t_attn = 2.0 * heads * (qk + v) * layers / attn_rate
        self._t_mla_context = 2.0 * lora * heads * (model.mla_nope_dim + v) * layers / self._flop_rate
        decode_flops = 2.0 * heads * (2 * lora + rope) * layers / attn_rate
        if decode_flops > self._t_kv_read:
            self._t_kv_read = decode_flops

    def _prefill_attention(self, prefill_tokens: int, prefill_attn_work: int) -> float:
        """Prefill attention's seconds: ``prefill_attn_work`` (tokens x context) at ``attn_efficiency``
        of the peak, or on FlashAttention-3 (``_attn_long_k`` > 0) at the rate its query blocks
        reach over the batch's mean context ``c``: ``long x c / (c + k)``, ``long`` =
        ``Calibration.attn_long_efficiency`` and ``k`` tokens set so the rate is ``attn_efficiency``
        at ``attn_fit_context`` (where it was read), never below it. A query block's fixed work
        (loading it, the epilogue, its launch share) is paid once whatever the context it loops
        over, so a long context runs nearer the kernel's long-sequence rate."""
        seconds = self._t_attn * prefill_attn_work
        if not self._attn_long_k or prefill_tokens <= 0 or prefill_attn_work <= 0:
            return seconds
        context = prefill_attn_work / prefill_tokens
        share = (context + self._attn_long_k) / context * self._attn_long_ratio  # attn_eff / the rate reached
        return seconds * share if share < 1.0 else seconds

    def _sliding_attention(self, decode_reqs: int, decode_context: int, prefill_tokens: int, prefill_context: int,
                           prefill_attn_work: int) -> float:
        """Sliding-window layers' attention: each decode request reads at most the window (from the
        batch's mean context), and a prefill token attends to at most the window."""
        w = self._window
        seconds = 0.0
        if decode_reqs > 0 and decode_context > 0:
            mean = decode_context / decode_reqs
            seconds += self._t_kv_read_slide * decode_reqs * (mean if mean < w else w)
        if prefill_attn_work > 0 and prefill_tokens > 0:
            # tokens x context, with each token's context capped at the window (from the chunk's mean)
            mean = prefill_attn_work / prefill_tokens
            seconds += self._t_attn_slide * prefill_tokens * (mean if mean < w else w)
        return seconds
