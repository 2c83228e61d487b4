"""Model classes beyond dense full attention: what vLLM loads and how it lays out the KV cache for them.

Pure functions over a parsed ``config.json`` and over :class:`~servetune.planner.modelinfo.ModelProfile`
(no I/O). :mod:`servetune.planner.modelinfo` calls :func:`refuse_unmodelled`, :func:`normalize_config` and
:func:`class_fields` while it reads a config; :mod:`servetune.planner.memory` calls :func:`kv_layout`
for the KV pages and :func:`moe_workspace_bytes` for the profile run. Each rule names the vLLM source
it follows (v0.19.0 unless said otherwise):

- **Nested configs** (``text_config``, multimodal wrappers): the language model is planned from
  ``text_config``; fields it leaves out take the defaults of its transformers config class
  (:data:`TEXT_CONFIG_DEFAULTS`: Gemma3TextConfig). A SigLIP-style vision tower named by
  ``vision_config`` is counted into the weights (:func:`vision_tower_params`); other towers are
  refused in one line.
- **Sliding-window / global hybrids** (gemma-2, gemma-3, gpt-oss ``layer_types``): vLLM's hybrid KV
  cache manager (``v1/core/kv_cache_utils.py``, ``_get_kv_cache_groups_uniform_page_size``) groups
  layers by attention type into groups of ``group_size`` layers (the smallest type's layer count,
  or the largest one when the two are within 25%); every group shares the same blocks, so one
  block costs ``page x group_size`` bytes and the logged token capacity is
  ``num_blocks // len(groups) x block_size``. A sliding group holds at most
  ``cdiv(min(window - 1 + max_in_flight_tokens, max_model_len), block) + 1`` blocks of a request
  (``SlidingWindowSpec.max_memory_usage_bytes``; ``EngineConfig.max_in_flight_tokens``: one batch's
  ``max_num_batched_tokens`` before 0.26, every concurrent batch's from 0.26).
- **MLA** (DeepSeek-V2/V3, Kimi): one latent of ``kv_lora_rank + qk_rope_head_dim`` elements per token
  and layer, not split by TP (``MLAAttentionSpec``, one KV head); after loading vLLM keeps two
  absorbed copies of ``kv_b_proj`` (``W_UK_T``, ``W_UV``, ``attention/backends/mla``), which the
  weights count.
- **MoE**: shared experts (``n_shared_experts x moe_intermediate_size`` or
  ``shared_expert_intermediate_size``), leading dense layers (``first_k_dense_replace``). The
  Triton fused-MoE experts take their buffers from vLLM's workspace manager, which keeps them for
  the life of the worker, so the profile run's peak carries them on top of the sampler's
  (``fused_moe.py``, ``TritonExperts.workspace_shapes``: ``(M, topk, max(N // 2, K))`` and
  ``(M, topk, max(N, K))`` plus the ``(M, K)`` output, N = 2 x intermediate / TP).
- **MXFP4** (gpt-oss): only the experts are MXFP4 (``modules_to_not_convert``: attention, router,
  embedding and LM head stay bf16; vLLM logs "MXFP4 linear layer is not implemented - falling back
  to UnquantizedLinearMethod"). The Triton MXFP4 backend (Hopper, ``fused_moe/oracle/mxfp4.py``) pads
  each rank's intermediate size to a multiple of 64, swizzles the 4-bit values and their e8m0 scales
  into new tensors and deletes the loaded values but not the loaded scales (two copies of the
  scales), and converts the biases to fp32 beside the bf16 ones (:func:`mxfp4_expert_bytes`); what
  it holds beyond that is :data:`MXFP4_LAYER_BYTES` per layer, fitted on one published start. The
  monolithic MXFP4 kernel keeps no workspace.
- **Mamba2 / attention hybrids** (Granite-4.0-H, Nemotron-H, Bamba, Falcon-H1) and the gated-delta-net ones
  (Qwen3-Next, Qwen3.5): their rules, with the vLLM sources they follow, are :mod:`servetune.planner.hybrid`'s
  (the layer kinds, the recurrent state, the raised attention block, the Mamba groups' block); the Mamba layers
  join the KV groups here (:func:`kv_layout`, :meth:`KVLayout.blocks_per_request`).
- **Qwen3.5** (``qwen3_5`` / ``qwen3_5_moe`` wrappers, Qwen3_5ForConditionalGeneration; Qwen3.8 checkpoints use the
  same architecture): the language model from ``text_config`` (:func:`nested_text_config`, Qwen3_5TextConfig's
  defaults), Qwen3-Next's gated delta net and gated attention with a dense MLP (``qwen3_5_text``) or MoE in every
  layer (``qwen3_5_moe_text``); the SSM state in the text config's ``mamba_ssm_dtype``
  (:func:`~servetune.planner.hybrid.mamba_ssm_dtype_bytes`);
  the MTP layers are not loaded (``skip_prefixes=["mtp."]``, qwen3_5.py lines 515-521 of 0.26.0); the vision tower,
  always built, counted from ``vision_config`` or Qwen3_5VisionConfig's defaults (:func:`qwen3_vl_tower_params`).
  Read in vLLM 0.19.0, 0.26.0 and 0.28.0.

The rules live here and in private modules, this one their public face (every name in ``__all__``):
the KV-cache groups and a request's blocks in ``_kv_layout``, the vision towers and their profile pass in
``_vision_towers``, a MoE's config fields, workspaces and MXFP4 experts in ``_moe_experts``; reading a config
(refusals, nested configs, layer kinds, the class fields), the notes ``plan`` prints and the model as loaded
on a GPU here.

Refused with one line and exit 2 (:func:`refuse_unmodelled`): other Mamba / SSM and linear-attention
layers (Jamba, Zamba, PLaMo2, LFM2, Nemotron-H puzzle layers, hybrids without attention layers, ...), chunked local
attention (Llama-4), KV shared across layers (gemma-3n / gemma-4), DeepSeek sparse attention (V3.2's indexer).

Example:
    >>> cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"hidden_size": 2560,
    ...        "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34}}
    >>> t = normalize_config(cfg, "config.json")
    >>> t["num_attention_heads"], t["head_dim"], t["vocab_size"], t["layer_types"][:6].count("sliding")
    (8, 256, 262208, 5)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from servetune.errors import SpecError
from servetune.planner._kv_layout import _SLIDING, KVLayout, group_size_for, kv_layout
from servetune.planner._moe_experts import MXFP4_LAYER_BYTES, _moe_fields, moe_workspace_bytes, mxfp4_expert_bytes
from servetune.planner._vision_towers import (MULTIMODAL_PROFILE_ELEMS_PER_TOKEN, QWEN3_5_VISION_DEFAULTS,
                                              QWEN3_VL_IMAGE_MAX_PIXELS, QWEN3_VL_TYPES, QWEN3_VL_VIDEO_MAX_PIXELS,
                                              EncoderProfile, Qwen3VLEncoder, deepstack_buffer_bytes,
                                              multimodal_profile_bytes, qwen3_vl_encoder, qwen3_vl_encoder_profile,
                                              qwen3_vl_tower_params, vision_tower_params)
from servetune.planner.hybrid import (_FULL, _GDN_TYPES, _MAMBA, _MAMBA2_HYBRIDS, _PARALLEL, _hybrid_note,
                                      _mamba_fields, _normalize_granite_ffn, _normalize_hybrid,
                                      _refuse_unmodelled_hybrid, hybrid_kinds)

__all__ = ["KVLayout", "TEXT_CONFIG_DEFAULTS", "MXFP4_LAYER_BYTES", "mxfp4_expert_bytes", "MULTIMODAL_PROFILE_ELEMS_PER_TOKEN",
           "multimodal_profile_bytes", "refuse_unmodelled",
           "normalize_config", "class_fields", "vision_tower_params", "kv_layout", "moe_workspace_bytes",
           "group_size_for", "class_notes", "as_loaded_on", "QWEN3_5_TEXT_TYPES",
           "QWEN3_5_VISION_DEFAULTS", "nested_text_config", "qwen3_vl_tower_params", "dense_ffn_unused",
           "QWEN3_VL_IMAGE_MAX_PIXELS", "QWEN3_VL_VIDEO_MAX_PIXELS", "Qwen3VLEncoder", "EncoderProfile",
           "qwen3_vl_encoder", "qwen3_vl_encoder_profile", "QWEN3_VL_TYPES", "deepstack_buffer_bytes"]

#: transformers' config-class defaults for the fields a nested ``text_config`` may leave out.
#: Gemma3TextConfig (transformers 4.50+, ``models/gemma3/configuration_gemma3.py``).
TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
        "sliding_window": 4096, "sliding_window_pattern": 6, "tie_word_embeddings": True,
        "rope_local_base_freq": 10000.0,
    },
    # Qwen3_5TextConfig (vLLM's transformers_utils/configs/qwen3_5.py lines 42-86 of 0.26.0, the same file in
    # 0.28.0): the 9B's sizes; partial_rotary_factor 0.25 (line 86), layer_types from full_attention_interval 4
    "qwen3_5_text": {
        "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "partial_rotary_factor": 0.25, "full_attention_interval": 4,
    },
    # Qwen3_5MoeTextConfig (transformers_utils/configs/qwen3_5_moe.py lines 44-92 of 0.26.0): no
    # intermediate_size at all (every layer is a Qwen3NextSparseMoeBlock)
    "qwen3_5_moe_text": {
        "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 32768, "tie_word_embeddings": False,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
        "partial_rotary_factor": 0.25, "full_attention_interval": 4,
    },
}

#: The text config each Qwen3.5 wrapper builds (``Qwen3_5Config.sub_configs``: ``text_config`` is a
#: ``Qwen3_5TextConfig`` whatever its ``model_type`` says; qwen3_5.py lines 155-182 of 0.26.0).
QWEN3_5_TEXT_TYPES: dict[str, str] = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}

_SSM_TYPES = ("mamba", "mamba2", "jamba", "falcon_h1", "nemotron_h", "granitemoehybrid", "zamba", "zamba2", "bamba",
              "plamo2", "lfm2", "qwen3_next", "minimax_m1", "minimax_text_01", "rwkv", "recurrent_gemma", "xlstm")
_SSM_LAYER_WORDS = ("mamba", "linear_attention", "linear", "conv", "ssm", "recurrent", "deltanet", "attention_linear")


def refuse_unmodelled(cfg: Mapping[str, Any], source: str) -> None:
    """Raise a one-line SpecError for a model whose memory the planner does not model.

    Mamba / SSM layers and linear attention other than the modelled hybrids (Jamba, Zamba,
    MiniMax, Nemotron-H puzzle layers, Qwen3-Next with dense MLP layers, hybrids without attention layers): vLLM keeps a per-request recurrent state
    beside (or instead of) the paged KV cache; chunked local attention (Llama-4's ``attention_chunk_size``): vLLM's chunked-local spec;
    KV shared across layers (gemma-3n / gemma-4 ``num_kv_shared_layers``) and DeepSeek sparse attention
    (``index_topk``: an indexer cache beside the MLA latent).

    Example:
        >>> try:
        ...     refuse_unmodelled({"model_type": "jamba"}, "config.json")
        ... except SpecError as err:
        ...     print(err.field, "|", err.message)
        config.json: model_type | Mamba / linear-attention layers (jamba) are not modelled by the planner
    """
    text: Mapping[str, Any] = nested_text_config(cfg) or {}
    fix = ("size it with one vLLM start of its own (its \"Available KV cache memory\" line), or plan a model "
           "whose attention is full, sliding-window or MLA")
    for c in (cfg, text):
        model_type = str(c.get("model_type") or "").lower()
        archs = " ".join(str(a) for a in (c.get("architectures") or [])).lower()
        if model_type in _MAMBA2_HYBRIDS and (c is cfg or model_type in QWEN3_5_TEXT_TYPES.values()):
            _refuse_unmodelled_hybrid(c, model_type, source, fix)
            continue
        for word in _SSM_TYPES:
            if model_type == word or model_type.startswith(word + "_") or word in archs.replace("forcausallm", ""):
                raise SpecError(f"{source}: model_type", f"Mamba / linear-attention layers ({model_type or archs}) "
                                "are not modelled by the planner", fix)
        kinds = [str(t).lower() for t in (c.get("layer_types") or c.get("layers_block_type") or [])]
        odd = sorted({t for t in kinds if any(w in t for w in _SSM_LAYER_WORDS)})
        if odd:
            raise SpecError(f"{source}: layer_types", f"{', '.join(odd)} layers (a recurrent state, not a paged KV "
                            "cache) are not modelled by the planner", fix)
        if c.get("attention_chunk_size"):
            raise SpecError(f"{source}: attention_chunk_size", "chunked local attention (Llama-4 style) is not "
                            "modelled by the planner", fix)
        if c.get("num_kv_shared_layers"):
            raise SpecError(f"{source}: num_kv_shared_layers", "layers that reuse another layer's KV cache "
                            "(gemma-3n / gemma-4 style) are not modelled by the planner", fix)
        if c.get("index_topk"):
            raise SpecError(f"{source}: index_topk", "DeepSeek sparse attention (an indexer with its own cache "
                            "beside MLA) is not modelled by the planner", fix)


def normalize_config(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The language model's flat config: ``text_config`` merged over its class defaults, layer types resolved.

    Adds ``layer_types`` (``"full"`` / ``"sliding"`` per layer) where the model has sliding-window
    layers; a vision tower's parameter count under ``_vision_params``.
    """
    flat: dict[str, Any]
    nested = nested_text_config(cfg)
    if nested is not None:
        flat = nested
        flat.setdefault("architectures", cfg.get("architectures"))
        for key in ("quantization_config", "torch_dtype", "dtype"):
            if cfg.get(key) is not None:
                flat.setdefault(key, cfg.get(key))
    else:
        flat = dict(cfg)
    vision = cfg.get("vision_config")  # nested wrappers and flat ones (Qwen2-VL keeps the LM at the top level)
    wrapper = str(cfg.get("model_type") or "").lower()
    if wrapper in QWEN3_5_TEXT_TYPES or wrapper in QWEN3_VL_TYPES:
        # Qwen3_5ForConditionalGeneration always builds its tower, from Qwen3_5VisionConfig's defaults where the
        # config has no vision_config (qwen3_5.py lines 176-177 of the configs, 422-428 of the model, 0.26.0);
        # Qwen3-VL builds it whenever an image or video is allowed (qwen3_vl.py lines 1233-1250 of 0.12.0)
        flat["_vision_params"] = qwen3_vl_tower_params(vision if isinstance(vision, Mapping) else {}, source)
        flat["_vision_encoder"] = qwen3_vl_encoder(vision if isinstance(vision, Mapping) else {})
    elif isinstance(vision, Mapping):
        layers = cfg.get("vision_feature_layer")
        llava = str(cfg.get("model_type") or "").startswith("llava")
        flat["_vision_params"] = vision_tower_params(
            vision, int(flat.get("hidden_size") or 0), source,
            llava_features=(len(layers) if isinstance(layers, (list, tuple)) else 1) if llava else 0)
    flat["layer_types"] = _layer_types(flat)
    if flat["layer_types"] and (_MAMBA in flat["layer_types"] or _PARALLEL in flat["layer_types"]):
        _normalize_hybrid(flat, source)
    elif str(flat.get("model_type") or "").lower() == "granitemoehybrid":
        # granite-4.0-micro: every layer attention, no Mamba; the FFN is the shared MLP (beside experts, if any)
        _normalize_granite_ffn(flat)
    return flat


def nested_text_config(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The language model's config of a wrapper: ``text_config`` over its config class's defaults
    (:data:`TEXT_CONFIG_DEFAULTS`); ``None`` for a flat config.

    A Qwen3.5 wrapper (``model_type`` qwen3_5 / qwen3_5_moe) builds its text config class whatever the
    nested ``model_type`` says (:data:`QWEN3_5_TEXT_TYPES`), so that class's type is set.

    Example:
        >>> t = nested_text_config({"model_type": "qwen3_5", "text_config": {"hidden_size": 1024}})
        >>> t["model_type"], t["hidden_size"], t["vocab_size"]
        ('qwen3_5_text', 1024, 248320)
    """
    nested = cfg.get("text_config")
    if not isinstance(nested, Mapping):
        return None
    model_type = QWEN3_5_TEXT_TYPES.get(str(cfg.get("model_type") or "").lower()) or str(nested.get("model_type") or "")
    flat = dict(TEXT_CONFIG_DEFAULTS.get(model_type, {}))
    flat.update({k: v for k, v in nested.items() if v is not None})
    if model_type:
        flat["model_type"] = model_type
    return flat


def dense_ffn_unused(cfg: Mapping[str, Any]) -> bool:
    """True where vLLM builds no dense MLP, so ``intermediate_size`` is never read (a normalized config).

    Qwen3-Next with experts, ``decoder_sparse_step`` 1 and no ``mlp_only_layers``: every
    ``Qwen3NextDecoderLayer`` takes a ``Qwen3NextSparseMoeBlock``, the ``Qwen3NextMLP`` of
    ``intermediate_size`` only for the others (qwen3_next.py lines 421-466 of 0.26.0); Qwen3.5-MoE, every layer
    sparse by ``model_type`` (qwen3_5.py lines 157-163), whose config class has no ``intermediate_size``.

    Example:
        >>> dense_ffn_unused({"model_type": "qwen3_next", "num_experts": 512}), dense_ffn_unused({"model_type": "llama"})
        (True, False)
    """
    model_type = str(cfg.get("model_type") or "").lower()
    if model_type == "qwen3_5_moe_text":
        return True
    return (model_type == "qwen3_next" and bool(cfg.get("num_experts")) and not cfg.get("mlp_only_layers")
            and int(cfg.get("decoder_sparse_step") or 1) == 1)


def _layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """Per layer ``"sliding"`` or ``"full"``; empty when every layer is full attention."""
    layers = int(cfg.get("num_hidden_layers") or 0)
    model_type = str(cfg.get("model_type") or "").lower()
    declared = cfg.get("layer_types")
    if model_type in _MAMBA2_HYBRIDS:
        return hybrid_kinds(cfg)
    if declared:
        kinds = [_SLIDING if "sliding" in str(t) else _FULL for t in declared]
    elif model_type == "gemma2" and cfg.get("sliding_window"):
        kinds = [_SLIDING if i % 2 == 0 else _FULL for i in range(layers)]  # vLLM gemma2.py: even layers slide
    elif model_type in ("gemma3_text", "gemma3") and cfg.get("sliding_window"):
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        kinds = [_SLIDING if (i + 1) % pattern else _FULL for i in range(layers)]
    else:
        return []
    return kinds if _SLIDING in kinds else []


def class_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`ModelProfile` fields of the classes above, read from a normalized config."""
    kinds = cfg.get("layer_types") or []
    out: dict[str, Any] = {
        "layer_types": tuple(kinds),
        "sliding_window": int(cfg.get("sliding_window") or 0) if _SLIDING in kinds else 0,
        "vision_params": int(cfg.get("_vision_params") or 0),
        "vision_encoder": cfg.get("_vision_encoder"),
    }
    if _MAMBA in kinds or _PARALLEL in kinds:
        out.update(_mamba_fields(cfg))
    model_type = str(cfg.get("model_type") or "").lower()
    if model_type == "nemotron_h" or (model_type == "granitemoehybrid"
                                      and str(cfg.get("position_embedding_type") or "rope") != "rope"):
        out["no_rope"] = True  # NemotronHAttention has no rotary; granite builds one only for "rope"
    if model_type == "nemotron_h":
        out["ffn_gated"] = False  # NemotronHMLP: up_proj, relu2, down_proj; its MoE's experts too (non-gated)
        out.update({k: cfg[k] for k in ("router_fp32", "router_score_bias", "moe_latent_size") if k in cfg})
    if model_type in ("bamba", "falcon_h1") and cfg.get("attn_rotary_emb"):
        out["rotary_dim"] = int(cfg["attn_rotary_emb"])  # their attention layers' partial rotary table
    if model_type in _GDN_TYPES and _MAMBA in kinds:
        out["attn_output_gate"] = bool(cfg.get("attn_output_gate", True))  # Qwen3NextAttention: q_proj x 2
        raw = cfg.get("rope_parameters")
        rope: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        factor = rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0  # Qwen3.5: in rope_parameters
        out["rotary_dim"] = int(int(cfg.get("head_dim") or 0) * float(factor))
    if cfg.get("kv_lora_rank"):
        out.update(mla_kv_lora_rank=int(cfg["kv_lora_rank"]), mla_rope_dim=int(cfg.get("qk_rope_head_dim") or 64),
                   mla_nope_dim=int(cfg.get("qk_nope_head_dim") or 128), mla_v_dim=int(cfg.get("v_head_dim") or 128),
                   mla_q_lora_rank=int(cfg.get("q_lora_rank") or 0))
    out.update(_moe_fields(cfg, model_type))
    rope = next((r for r in (cfg.get("rope_parameters"), cfg.get("rope_scaling")) if isinstance(r, Mapping)), {})
    if rope.get("mrope_section"):
        # MRotaryEmbedding keeps 4 x max_position rows in its cos_sin_cache ("We enlarge max_position_embeddings to
        # 4 times", rotary_embedding/mrope.py line 238 of 0.19.0 and 0.26.0, 276 of 0.28.0; get_rope picks it for an
        # mrope_section, rotary_embedding/__init__.py lines 102-112 of 0.28.0). Read after the held-out Qwen3.5
        # starts of hybrid.yaml showed the weights ~0.1 GiB under "Model loading took" (nothing fitted).
        out["extra_rotary_positions"] = 3 * int(cfg.get("max_position_embeddings") or 0)
    if str(cfg.get("model_type") or "") == "gemma3_text" and kinds:
        # gemma-3's sliding layers use a second, unscaled rotary table (rope_local_base_freq).
        out["extra_rotary_positions"] = int(cfg.get("max_position_embeddings") or 0)
    return out


#: What the Qwen3-VL note says it was checked on (held-out published starts, judged once; classes.yaml).
QWEN3_VL_CHECKED = ("Checked held out on two published Qwen3-VL-30B-A3B starts (rules written first): 2 x H100 at vLLM "
                    "0.12.0 -4.5% (-0.4% without the NVLink multicast term), 4 x RTX 3090 at 0.11.0 +6.5% (0.15 GiB "
                    "of a 2.3 GiB cache); weights within 0.1%")


def class_notes(model: Any, max_num_batched_tokens: int, in_flight_tokens: int | None = None) -> list[str]:
    """What ``plan`` says about a model's classes: how each is modelled and what it was checked on."""
    notes: list[str] = []
    if model.is_hybrid:
        notes.append(_hybrid_note(model))
    if model.vision_encoder is not None:
        enc = qwen3_vl_encoder_profile(model.vision_encoder, model.dtype_bytes, 1, max_num_batched_tokens,
                                       max(1, max_num_batched_tokens), model.max_position_embeddings)
        checked = ("On the published Qwen3.5 / Qwen3.8 starts, all seen while the rule was written: vLLM 0.19.0 +0.0%; "
                   "vLLM 0.28.0 +2.8% to +3.5% (0.5-2.3 GiB more consumed after profiling than planned, not traced)"
                   if model.is_hybrid else QWEN3_VL_CHECKED)
        notes.append(f"Qwen3-VL-style vision encoder: from vLLM 0.13 the profile encodes {enc.items} dummy image(s) of "
                     f"{enc.tokens_per_item:,} tokens ({enc.patches:,} patches), {enc.peak_bytes / 2**30:.2f} GiB at its "
                     "peak at TP=1 (Qwen3-VL at 0.11 / 0.12: a dummy video counted at 12.5 tokens a frame token, its "
                     "outputs held at that count), counted from vLLM's source. " + checked)
    if _SLIDING in model.layer_types:
        sliding = model.layer_types.count(_SLIDING)
        notes.append(f"sliding-window attention: {sliding} of {len(model.layer_types)} layers hold at most "
                     f"{model.sliding_window} + {in_flight_tokens or max_num_batched_tokens} tokens per request (vLLM's hybrid KV cache "
                     "groups, whose padding the B/token figure counts). Checked on published gemma-2/3 and "
                     "gpt-oss starts (docs/model-classes.md)")
    if model.mla_kv_lora_rank:
        notes.append(f"MLA: one {model.mla_kv_lora_rank + model.mla_rope_dim}-element latent per token and layer on "
                     "every TP rank. Checked on one published DeepSeek-V2-Lite start (vLLM 0.19.0, TP=1)")
    if model.is_moe and not model.quantized_experts_only:
        ws = moe_workspace_bytes(model, max_num_batched_tokens, 1) / 2**30
        notes.append(f"MoE: {model.num_experts} experts, top-{model.num_experts_per_tok}; the fused-MoE workspace "
                     f"({ws:.2f} GiB at TP=1) stays in the profiled peak. Checked on published Qwen3-30B-A3B, "
                     "Qwen1.5-MoE, Mixtral and DeepSeek-V2-Lite starts (H100, H200, A100-40GB)")
    if model.quantized_experts_only:
        notes.append("MXFP4 experts, bf16 attention / embedding / LM head, sized as vLLM's Triton MXFP4 backend "
                     "loads them (Hopper); other backends (Blackwell, Marlin) are not checked")
    if model.vision_params:
        peak = ("its encoder pass counted from vLLM's source" if model.vision_encoder is not None
                else "its profile-run peak is one constant fitted on gemma-3-12b")
        notes.append(f"vision tower: {model.vision_params / 1e9:.2f}B parameters loaded with the language model; {peak}")
    return notes


def as_loaded_on(model: Any, gpu: Any, rules: Any = None) -> Any:
    """The model as vLLM loads it on ``gpu``: block-quantized fp8 on a GPU without fp8 tensor cores,
    and (under ``rules`` that say so, :attr:`~servetune.planner.vllm_rules.VllmMemoryRules.
    machete_float_zero_points`) an AWQ checkpoint on Hopper, whose zero points Machete keeps in the
    activation dtype: ``(dtype bytes - 0.5) / group`` more bytes per weight.

    Below compute capability 8.9 vLLM serves fp8 checkpoints weight-only through Marlin ("Your GPU
    does not have native support for FP8 computation ... Weight-only FP8 compression will be used
    leveraging the Marlin kernel"); Marlin takes a block-quantized checkpoint's [N/128, K/128] scales as
    group scales along K for every output row, one bf16 per ``block_k`` weights (``marlin_utils_fp8``):
    ``1 + 2 / block_k`` bytes per weight. Per-channel and per-tensor fp8 scales stay negligible. A Nemotron-H MoE
    router (``router_fp32`` on a hybrid) is held in the model dtype on Hopper and Blackwell from 0.17 (``rules``'
    ``router_model_dtype_on_sm90_sm100``), in fp32 elsewhere; GLM-4.5's fp32 ``nn.Linear`` router stays fp32.

    Example:
        >>> import dataclasses
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> m = dataclasses.replace(load_model("qwen3-30b-a3b"), quantization="fp8", quant_bytes_per_param=1.0,
        ...                         quant_block_k=128)
        >>> as_loaded_on(m, get_gpu("A100-40GB")).quant_bytes_per_param, as_loaded_on(m, get_gpu("H100-80GB")) is m
        (1.015625, True)
    """
    if (model.router_fp32 and model.is_hybrid and rules is not None and rules.router_model_dtype_on_sm90_sm100
            and (gpu.compute_capability == 9.0 or 10.0 <= gpu.compute_capability < 11.0)):
        model = dataclasses.replace(model, router_fp32=False)  # GateLinear's specialized kernels (hybrid.nemotron_moe_fields)
    if model.quantization == "fp8" and model.quant_block_k and not gpu.fp8_compute:
        return dataclasses.replace(model, quant_bytes_per_param=1.0 + 2 / model.quant_block_k)
    if (rules is not None and rules.machete_float_zero_points and model.quant_zero_point_group > 0
            and gpu.compute_capability == 9.0):
        extra = (model.dtype_bytes - 0.5) / model.quant_zero_point_group
        return dataclasses.replace(model, quant_bytes_per_param=model.quant_bytes_per_param + extra)
    return model
