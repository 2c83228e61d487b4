"""GLM-4.5 / GLM-4.5-Air (``Glm4MoeForCausalLM``) planned on the MoE rules, with what vLLM's source adds.

vLLM ``model_executor/models/glm4_moe.py`` (0.11.0, 0.19.0, 0.26.0 wheels), ``Glm4MoE.__init__``: the router is
``nn.Linear(hidden, n_routed_experts, dtype=torch.float32)`` with an fp32 ``e_score_correction_bias``
(glm4_moe.py:124-131@0.11.0, 143-150@0.19.0, 141-148@0.26.0); the shared experts one ``Glm4MoeMLP`` of
``moe_intermediate_size x n_shared_experts`` with no gate (glm4_moe.py:149-158@0.11.0, 169-170@0.19.0,
176-177@0.26.0); dense MLPs below ``first_k_dense_replace`` (glm4_moe.py:364@0.11.0, 362@0.19.0, 358@0.26.0);
``qkv_bias=config.attention_bias`` (glm4_moe.py:356@0.11.0, 349@0.26.0; the q/k norms of ``use_qk_norm``, 2 x
head_dim a layer, are not counted); a rotary
table of ``partial_rotary_factor`` (0.5 by default) of ``head_dim`` (glm4_moe.py:283@0.11.0, 287@0.19.0,
283@0.26.0); the MTP layer skipped on load (glm4_moe.py:522@0.11.0, ``skip_spec_layers`` 492@0.26.0).

The shape below is GLM-4.5-Air's as transformers' Glm4MoeConfig printed it in a public fine-tuning log
(stored copy 48221590695) and as Megatron-Bridge's model page states it (46 layers, the first dense, 128
experts of 1,408, one shared expert, 96 heads, 8 KV heads, hidden 4,096, vocab 151,552); no whole
config.json of it was found, so it is not shipped (docs/model-classes.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelclass import as_loaded_on
from servetune.planner.modelinfo import ModelProfile, profile_from_config
from servetune.planner.vllm_rules import memory_rules

GiB = 1 << 30
AIR: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 10944, "max_position_embeddings": 131072, "moe_intermediate_size": 1408,
    "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46, "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1,
    "torch_dtype": "bfloat16", "use_qk_norm": False, "vocab_size": 151552,
}


def _air() -> ModelProfile:
    return profile_from_config(AIR, "glm-4.5-air")


def _counted(c: dict[str, Any]) -> int:
    """GLM-4.5-Air's parameters as vLLM builds its main model: per layer q/k/v (with bias), o, two norms; one
    dense MLP layer; then 128 routed experts, the shared expert, the router and its bias; embedding, LM head,
    final norm. No MTP layer, no shared-expert gate."""
    h, hd, heads, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    attn = h * (heads + 2 * kv) * hd + (heads + 2 * kv) * hd + heads * hd * h + 2 * h
    dense = 3 * h * c["intermediate_size"]
    experts = c["n_routed_experts"]
    moe = (experts + c["n_shared_experts"]) * 3 * h * c["moe_intermediate_size"] + h * experts + experts
    layers, first = c["num_hidden_layers"], c["first_k_dense_replace"]
    return 2 * c["vocab_size"] * h + layers * attn + first * dense + (layers - first) * moe + h


def test_glm_45_air_is_planned_as_vllm_builds_it() -> None:
    m = _air()
    assert m.param_count == _counted(AIR)  # 106,852,251,264: no gate, the score bias, no MTP layer
    assert round(m.param_count / 1e9, 1) == 106.9  # "106 billion total parameters" (GLM-4.5's model card)
    assert (m.shared_expert_intermediate_size, m.shared_expert_gate, m.first_k_dense_replace) == (1408, False, 1)
    assert m.qkv_bias and m.router_fp32 and m.router_score_bias and m.rotary_dim == 64


def test_the_fp32_router_is_counted_at_4_bytes_and_kept_on_hopper() -> None:
    """The router weighs 45 x 128 x 4,096 x 2 bytes more than in bf16 on every rank (replicated); unlike
    Nemotron-H's GateLinear it stays fp32 on an H100 at 0.26.0."""
    m = _air()
    bf16_router = dataclasses.replace(m, router_fp32=False)
    extra = m.weight_bytes_per_gpu(4, 1) - bf16_router.weight_bytes_per_gpu(4, 1)
    assert extra == 45 * 128 * 4096 * 2
    assert as_loaded_on(m, get_gpu("H100-80GB"), memory_rules((0, 26, 0))).router_fp32


def test_glm_45_air_bf16_needs_4_h100_not_2() -> None:
    """106.9B parameters in bf16: ~99.5 GiB a GPU at TP=2 (more than an H100 holds), ~49.8 GiB at TP=4."""
    m = _air()
    h100 = get_gpu("H100-80GB")
    tp4 = plan_memory(m, h100, resolve_engine_config({"tensor_parallel_size": 4}, m, h100, "0.26.0"))
    assert tp4.fits and abs(tp4.memory.weights * GiB / (m.param_count * 2 / 4) - 1) < 0.02
    assert tp4.kv_cache_tokens > 131072
    tp2 = plan_memory(m, h100, resolve_engine_config({"tensor_parallel_size": 2}, m, h100, "0.26.0"))
    assert not tp2.fits and tp2.failure is not None and tp2.failure.value == "startup_oom"
