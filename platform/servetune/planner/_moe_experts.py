"""A MoE's routed experts as vLLM loads them: the config fields read for them, the Triton fused-MoE workspaces,
and MXFP4 experts' bytes.

Contract: :func:`_moe_fields` reads a config's MoE fields (shared experts, leading dense layers, MXFP4,
the router's fp32 weight and score bias) for :func:`~servetune.planner.modelclass.class_fields`;
:func:`moe_workspace_bytes` is the fused-MoE workspaces the profile run keeps; :func:`mxfp4_expert_bytes`
one layer's MXFP4 experts on a rank as the Triton backend holds them, with :data:`MXFP4_LAYER_BYTES`
(fitted). The rules are told in :mod:`servetune.planner.modelclass`' docstring ("MoE", "MXFP4"), which
re-exports every public name here. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MXFP4_LAYER_BYTES", "moe_workspace_bytes", "mxfp4_expert_bytes"]

#: Bytes per MoE layer the Triton MXFP4 backend holds beyond what :func:`mxfp4_expert_bytes` counts
#: from the source, on every TP rank (not split). Fitted on llm-d-planner's vLLM 0.19.0 gpt-oss-20b
#: start at TP=2 on H100 (classes.yaml, ``llmdplanner_gpt_oss_20b_tp2_h100``: "Model loading took
#: 7.01 GiB"); judged on gpt-oss-20b at TP=1 (13.64 GiB logged) and gpt-oss-120b at TP=1 (64.38).
MXFP4_LAYER_BYTES = 7_870_000


def _moe_fields(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of a config with routed experts; ``{}`` without.

    Shared experts are ``shared_expert_intermediate_size`` wide (Qwen2-MoE's naming, with a ``shared_expert_gate``
    of ``hidden x 1`` beside them: vLLM ``models/qwen2_moe.py`` line 142 of 0.11.0, 143 of 0.19.0, 147 of 0.26.0) or
    ``n_shared_experts x moe_intermediate_size`` (DeepSeek-V2/V3, GLM-4.5: no gate). DeepSeek-V3's ``noaux_tc``
    router keeps an fp32 ``e_score_correction_bias`` per routed expert (``models/deepseek_v2.py`` line 164 of 0.11.0,
    269 of 0.19.0, 315 of 0.26.0). GLM-4.5 / GLM-4.5-Air (``glm4_moe``; ``models/glm4_moe.py``, ``Glm4MoE``: lines
    124-131 of 0.11.0, 143-150 of 0.19.0, 141-148 of 0.26.0) hold the router as an fp32 ``nn.Linear`` with that
    bias on every GPU (not GateLinear, so :func:`as_loaded_on` leaves it), and a rotary table ``head_dim x
    partial_rotary_factor`` wide (0.5 where the config names none: ``Glm4MoeAttention``, line 283 of 0.11.0,
    ``rope_parameters.setdefault`` line 287 of 0.19.0, 283 of 0.26.0). The rest of GLM-4.5 is what the MoE rules
    already build: ``first_k_dense_replace`` dense layers (line 364 of 0.11.0, 358 of 0.26.0), ``attention_bias`` on
    q/k/v, and the MTP layer (``num_nextn_predict_layers``) skipped on load (line 522 of 0.11.0; ``skip_spec_layers``,
    line 492 of 0.26.0); the q/k norms of ``use_qk_norm`` (GLM-4.5) are not counted (2 x head_dim a layer).

    Example:
        >>> f = _moe_fields({"n_routed_experts": 128, "n_shared_experts": 1, "moe_intermediate_size": 1408,
        ...                  "head_dim": 128}, "glm4_moe")
        >>> f["shared_expert_intermediate_size"], f["shared_expert_gate"], f["router_fp32"], f["rotary_dim"]
        (1408, False, True, 64)
    """
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    if not experts:
        return {}
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    out: dict[str, Any] = {"shared_expert_gate": shared > 0}
    if not shared and cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * int(cfg.get("moe_intermediate_size") or 0)
    out["shared_expert_intermediate_size"] = shared
    out["first_k_dense_replace"] = int(cfg.get("first_k_dense_replace") or 0)
    q = cfg.get("quantization_config") or {}
    out["quantized_experts_only"] = isinstance(q, Mapping) and str(q.get("quant_method", "")).lower() == "mxfp4"
    if str(cfg.get("topk_method") or "") == "noaux_tc":
        out["router_score_bias"] = True
    if model_type == "glm4_moe":
        raw = cfg.get("rope_parameters")
        rope: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        factor = float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 0.5)
        out.update(router_fp32=True, router_score_bias=True, rotary_dim=int(int(cfg.get("head_dim") or 0) * factor))
    return out


def moe_workspace_bytes(model: Any, tokens: int, tp: int) -> int:
    """The Triton fused-MoE workspaces vLLM's workspace manager keeps after the profile run (0 without MoE).

    ``M x topk x (max(N // 2, K) + max(N, K))`` activations plus the ``M x K`` output, N = 2 x expert
    intermediate / TP, K = hidden, M = the profile's token count; 0 for MXFP4 (gpt-oss), whose
    monolithic kernel keeps no workspace. A non-gated expert (``ffn_gated`` False, Nemotron-H's relu2) has
    N = intermediate / TP and an activation as wide as N (``adjust_N_for_activation``: ``fused_moe/modular_kernel.py``
    lines 864-881 and ``experts/triton_moe.py`` lines 181-196 of 0.26.0, 202-217 of 0.28.0; 0.11.1's
    ``fused_moe.py`` lines 2009-2022 take N // 2 for every activation, the same figure where K >= N); K is a latent
    MoE's ``moe_latent_size``.

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> round(moe_workspace_bytes(load_model("mixtral-8x7b"), 8192, 2) / 2**30, 3)
        0.719
    """
    if not model.is_moe or model.quantized_experts_only:
        return 0
    n = (2 if model.ffn_gated else 1) * model.expert_intermediate_size // tp
    k = model.expert_hidden_size
    per_token = model.num_experts_per_tok * (max(n // 2 if model.ffn_gated else n, k) + max(n, k)) + k
    return tokens * per_token * model.dtype_bytes


def mxfp4_expert_bytes(model: Any, tp: int, scale_copies: int = 2, experts: int | None = None) -> int:
    """One MoE layer's MXFP4 experts on one TP rank as vLLM's Triton backend holds them after loading.

    ``I = round_up(intermediate / TP, 64)`` (``mxfp4_round_up_hidden_size_and_intermediate_size``); per
    expert ``3 x H x I`` 4-bit values (gate_up ``2I x H``, down ``H x I``), ``scale_copies`` copies of their
    e8m0 scales (one per 32 values: before vLLM 0.26 the loaded ``w13/w2_weight_scale`` stay on the layer
    beside the swizzled ones; 0.26 deletes them, see
    :attr:`~servetune.planner.vllm_rules.VllmMemoryRules.mxfp4_keeps_loaded_scales`), and the ``2I + H``
    biases in bf16 and again in fp32; plus :data:`MXFP4_LAYER_BYTES`. ``experts``: the experts the rank holds
    (under expert parallelism :func:`~servetune.planner.modelinfo.local_experts`, ``tp`` 1); None: all of them.

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> m = load_model("gpt-oss-20b")
        >>> round(mxfp4_expert_bytes(m, 1) / 2**20, 1), round(mxfp4_expert_bytes(m, 1, scale_copies=1) / 2**20, 1)
        (436.2, 412.5)
    """
    inter = -(-(model.expert_intermediate_size // tp) // 64) * 64
    values = 3 * model.hidden_size * inter
    biases = 2 * inter + model.hidden_size
    per_expert = values // 2 + scale_copies * (values // 32) + biases * (2 + 4)
    return (model.num_experts if experts is None else experts) * per_expert + MXFP4_LAYER_BYTES
