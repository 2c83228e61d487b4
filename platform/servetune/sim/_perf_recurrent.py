"""A hybrid's recurrent layers priced for :class:`servetune.sim.perf.PerfModel` (Mamba2, gated delta nets).

Contract: :class:`RecurrentTerms` is the part of ``PerfModel`` that turns a Mamba / gated-delta-net
hybrid's shapes (:mod:`servetune.sim.perf_hybrid`: the state, the mixer's traffic, the chunked scan's
kernels, counted from vLLM's) into seconds per decoding request, per prefilling request and per
prefill token (:meth:`RecurrentTerms.recurrent_seconds`, ``StepCost.recurrent``); every other model
pays 0. Pure arithmetic, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servetune.planner.hybrid import mamba_ssm_dtype_bytes
from servetune.planner.vllm_rules import memory_rules
from servetune.sim import perf_hybrid

if TYPE_CHECKING:
    from servetune.planner.engine_config import EngineConfig
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.modelinfo import ModelProfile
    from servetune.sim._calibration import Calibration

__all__ = ["RecurrentTerms"]


class RecurrentTerms:
    """A hybrid's recurrent layers in one step (a mixin of :class:`servetune.sim.perf.PerfModel`):
    :meth:`_init_hybrid` sets the terms and the dense rule's ``_elementwise_token`` for a hybrid."""

    def _init_hybrid(self, model: ModelProfile, gpu: GpuSpec, config: EngineConfig, tp: int, layers: int,
                     mem_rate: float, cal: Calibration) -> perf_hybrid.HybridShape | None:
        """A Mamba / gated-delta-net hybrid's recurrent terms (:mod:`servetune.sim.perf_hybrid`; None and
        zeros for other models): per decoding request its state read and written in every Mamba layer,
        per prefilling request its initial state read and final state written (a gated delta net's SSM state
        also gathered and scattered around its chunked kernel), per decode token the
        mixer's activations, per prefill token conv1d, the gated norm and the chunked scan's kernels,
        each a roofline of its bytes (``mem_efficiency``) and FLOPs (the dense rate, ``compute_efficiency``); a
        gated delta net's decoding request's state at ``gdn_decode_state_efficiency``, where that kernel was timed.
        The element-wise kernels are the dense rule's per layer, the MLP's share on the layers with one."""
        self._t_state = self._t_decode_state = self._t_mamba_decode_token = self._t_mamba_prefill_token = 0.0
        self._t_chunk_copies = 0.0
        self._t_partial_chunk = 0.0
        self._mixed_all_chunked = False
        rules = memory_rules(config.version)
        hybrid = perf_hybrid.hybrid_shape(model, tp, layers, mamba_ssm_dtype_bytes(model, rules.nemotron_h_ssm_default))
        if hybrid is None:
            return None
        n = hybrid.mamba_layers
        flop_rate = gpu.bf16_tflops * 1e12 * cal.compute_efficiency
        self._t_state = self._t_decode_state = 2.0 * hybrid.state_bytes * n / mem_rate
        if hybrid.kind == "gdn":
            # A decoding request's state through vLLM's packed decode kernel, at the share of HBM it was timed
            # streaming (Calibration.gdn_decode_state_efficiency; 0: mem_efficiency, as every other state).
            if cal.gdn_decode_state_efficiency:
                self._t_decode_state = 2.0 * hybrid.state_bytes * n / (gpu.hbm_gbps * 1e9 * cal.gdn_decode_state_efficiency)
            # The chunked path's copies of each request's SSM state: gathered into a new tensor and scattered
            # back (read and written twice more), around the kernel's own read and write (perf_hybrid).
            self._t_chunk_copies = 4.0 * hybrid.ssm_state_bytes * n / mem_rate
            # The last, partial chunk's state tile that fwd_h stores and fwd_o reads (perf_hybrid).
            self._t_partial_chunk = hybrid.partial_chunk_bytes * n / mem_rate
            self._mixed_all_chunked = rules.gdn_mixed_batch_chunked
        self._t_mamba_decode_token = hybrid.decode_token_bytes * n / mem_rate
        scan = sum(max(k.bytes / mem_rate, k.flops / flop_rate) for k in hybrid.scan)
        self._t_mamba_prefill_token = (hybrid.prefill_token_bytes / mem_rate + scan) * n
        if model.is_moe:
            inter = (model.num_experts_per_tok * model.expert_intermediate_size
                     + model.shared_expert_intermediate_size) // tp
        else:
            inter = model.intermediate_size // tp
        d = model.hidden_size
        self._elementwise_token = (10.5 * d * layers + (3.0 if model.ffn_gated else 2.0) * inter
                                   * hybrid.ffn_layers) * 2.0 / mem_rate
        return hybrid

    def recurrent_seconds(self, decode_reqs: int, prefill_reqs: int, prefill_tokens: int) -> float:
        """A hybrid's Mamba / gated-delta-net layers beyond their GEMMs for one step (0 for other models):
        ``decode_reqs`` requests decoding one token each, ``prefill_reqs`` requests prefilling
        ``prefill_tokens`` tokens together (:meth:`_init_hybrid`). A gated delta net's prefilling
        requests also pay their SSM state's gather and scatter and their last, partial chunk's state tile
        (``perf_hybrid.gdn_partial_chunk_bytes``); before vLLM 0.23.0 a step with a prefill
        runs its decoding requests through that chunked path too, as one-token prefills
        (``VllmMemoryRules.gdn_mixed_batch_chunked``).

        Example (Qwen3-Next at TP=4 on an H200: 256 decoding requests alone, then beside one 512-token prefill):
            >>> from servetune.planner.gpus import get_gpu
            >>> from servetune.planner.memory import resolve_engine_config
            >>> from servetune.planner.modelinfo import load_model
            >>> from servetune.sim.perf import PerfModel
            >>> m, g = load_model("qwen3-next-80b-a3b"), get_gpu("H200")
            >>> tp4 = {"tensor_parallel_size": 4}
            >>> perf = [PerfModel(m, g, resolve_engine_config(tp4, m, g, v)) for v in ("0.22.1", "0.23.0")]
            >>> [tuple(round(1e3 * p.recurrent_seconds(256, *pre), 2) for pre in ((0, 0), (1, 512))) for p in perf]
            [(1.24, 5.57), (1.24, 1.53)]
        """
        if not self._t_state:
            return 0.0
        if prefill_reqs and self._mixed_all_chunked:
            prefill_reqs, prefill_tokens, decode_reqs = prefill_reqs + decode_reqs, prefill_tokens + decode_reqs, 0
        return (self._t_decode_state * decode_reqs + self._t_state * prefill_reqs + self._t_mamba_decode_token * decode_reqs
                + self._t_mamba_prefill_token * prefill_tokens
                + (self._t_chunk_copies + self._t_partial_chunk) * prefill_reqs)
