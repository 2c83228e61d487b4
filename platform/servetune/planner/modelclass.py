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
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from servetune.errors import SpecError
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

#: Qwen3-VL wrappers (Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration): the same
#: ``Qwen3_VisionTransformer`` as Qwen3.5 with ``deepstack_visual_indexes`` (models/qwen3_vl.py lines 301-370 of
#: 0.12.0, the same class to 0.26.0), a Qwen3 / Qwen3-MoE language model from ``text_config``.
QWEN3_VL_TYPES: tuple[str, ...] = ("qwen3_vl", "qwen3_vl_moe")

#: ``Qwen3_5VisionConfig``'s defaults (qwen3_5.py lines 119-150 of 0.26.0; qwen3_5_moe.py lines 131-162):
#: the tower vLLM builds where ``vision_config`` is absent (``Qwen3_5Config``, lines 176-177).
QWEN3_5_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "in_channels": 3, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584, "num_position_embeddings": 2304,
}

#: Bytes per MoE layer the Triton MXFP4 backend holds beyond what :func:`mxfp4_expert_bytes` counts
#: from the source, on every TP rank (not split). Fitted on llm-d-planner's vLLM 0.19.0 gpt-oss-20b
#: start at TP=2 on H100 (classes.yaml, ``llmdplanner_gpt_oss_20b_tp2_h100``: "Model loading took
#: 7.01 GiB"); judged on gpt-oss-20b at TP=1 (13.64 GiB logged) and gpt-oss-120b at TP=1 (64.38).
MXFP4_LAYER_BYTES = 7_870_000

#: What the profile run of a model with a vision tower holds beyond its language model's peak, in
#: elements per batched token per text hidden unit (model dtype). vLLM's multimodal runner keeps an
#: ``inputs_embeds`` buffer ``[max_num_tokens, hidden]`` and the profiled encoder outputs (two of the
#: 3.78); the rest is not traced to a tensor. Fitted on llm-d-planner's vLLM 0.19.0 gemma-3-12b start
#: (classes.yaml, ``llmdplanner_gemma3_12b_tp1_h100``: torch peak 3.94 GiB against 3.72 for the text
#: model's sampler peak); judged on gemma-3-4b and gemma-3-27b.
MULTIMODAL_PROFILE_ELEMS_PER_TOKEN = 3.78

#: The largest image the Qwen3-VL / Qwen3.5 image processor allows, in pixels: ``size["longest_edge"]`` of the
#: checkpoints' ``preprocessor_config.json`` (16,777,216 = 4096 x 4096), which vLLM reads for the dummy image
#: (``Qwen2VLProcessingInfo.get_image_size_with_most_features``, models/qwen2_vl.py lines 960-1011 of 0.28.0).
#: With 16-pixel patches merged 2 x 2 that is 16,384 tokens, the "budget of 16384 tokens" every published
#: Qwen3.5 / Qwen3.6 / Qwen3.8 / Qwen3-VL start logs (gpu_model_runner.py, "Encoder cache will be initialized").
#: ``mm_processor_kwargs`` overrides (``max_pixels``) are not read by the planner.
QWEN3_VL_IMAGE_MAX_PIXELS = 16_777_216
#: The video processor's cap (``video_preprocessor_config.json`` ``size["longest_edge"]``, 25,165,824), over
#: two frames (``Qwen3VLProcessingInfo.get_max_video_tokens``, qwen3_vl.py lines 991-1015 of 0.28.0): 12,288
#: tokens, below the image's, so the profile run's dummy item is an image (``get_modality_with_max_tokens``).
QWEN3_VL_VIDEO_MAX_PIXELS = 25_165_824


@dataclasses.dataclass(frozen=True)
class Qwen3VLEncoder:
    """The shape of vLLM's ``Qwen3_VisionTransformer`` that its profile run's memory depends on.

    ``patch_elems`` is one flattened patch (``in_channels x temporal_patch x patch^2``, 1,536 for the
    shipped towers); ``deepstack`` the count of ``deepstack_visual_indexes`` (Qwen3-VL; 0 for Qwen3.5).
    """

    hidden: int
    intermediate: int
    patch: int
    patch_elems: int
    merge: int
    out_hidden: int
    deepstack: int = 0
    temporal: int = 2


@dataclasses.dataclass(frozen=True)
class EncoderProfile:
    """What the profile run's dummy multimodal batch takes on one GPU.

    ``items`` dummy images of ``tokens_per_item`` tokens (``patches`` patches in all) run through the tower
    before the language model's dummy forward; ``peak_bytes`` is the torch peak of that encoder pass above
    what was allocated before the profile run; ``held_bytes`` what stays allocated through the language
    model's forward and the sampler (the dummy batch's pixels and the encoder outputs in the encoder cache).
    """

    items: int
    tokens_per_item: int
    patches: int
    peak_bytes: int
    held_bytes: int


#: Sliding-window attention types vLLM keeps apart from full attention (``"full"`` and the hybrids' kinds:
#: :mod:`servetune.planner.hybrid`).
_SLIDING = "sliding"

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


def qwen3_vl_tower_params(vision: Mapping[str, Any], source: str) -> int:
    """Parameters of vLLM's ``Qwen3_VisionTransformer`` (Qwen3.5's vision tower), ``vision`` over
    :data:`QWEN3_5_VISION_DEFAULTS`.

    ``models/qwen3_vl.py`` of 0.26.0 (the same in 0.28.0): the patch embedding, a ``Conv3dLayer`` with bias
    (``in_channels x temporal_patch x patch^2 x h + h``, lines 347-367); ``pos_embed`` (``num_position_embeddings
    x h``, line 570); ``depth`` blocks of two LayerNorms, ``qkv`` and ``proj`` with biases (``Qwen2_5_VisionAttention``,
    qwen2_5_vl.py lines 370-387) and a biased two-matrix MLP (lines 413-445), so a block is SigLIP's
    (:func:`vision_tower_params`); the merger (lines 467-506): a LayerNorm over ``h``, then ``4h -> 4h -> out`` with
    biases (``4h`` = ``h x spatial_merge^2``); one more merger, normed over ``4h``, per ``deepstack_visual_indexes``
    entry (lines 597-608). The rotary table is a buffer.

    Example:
        >>> round(qwen3_vl_tower_params({"depth": 12, "hidden_size": 768, "intermediate_size": 3072,
        ...        "out_hidden_size": 1024}, "c") / 1e6, 1)
        100.6
    """
    v = {**QWEN3_5_VISION_DEFAULTS, **{k: val for k, val in vision.items() if val is not None}}
    try:
        h, inter, depth = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["depth"])
        patch, temporal, channels = int(v["patch_size"]), int(v["temporal_patch_size"]), int(v["in_channels"])
        merged = h * int(v["spatial_merge_size"]) ** 2
        out, positions = int(v["out_hidden_size"]), int(v["num_position_embeddings"])
        deepstack = len(v.get("deepstack_visual_indexes") or [])
    except (KeyError, TypeError, ValueError):
        raise SpecError(f"{source}: vision_config", "a Qwen3-VL vision tower (Qwen3-VL, Qwen3.5) whose sizes do not "
                        "read as counts is not modelled",
                        "fix vision_config (depth, hidden_size, intermediate_size, out_hidden_size)") from None
    block = 4 * h * h + 4 * h + 2 * h * inter + inter + h + 4 * h
    embed = channels * temporal * patch * patch * h + h + positions * h
    merger = merged * merged + merged + merged * out + out
    return depth * block + embed + 2 * h + merger + deepstack * (2 * merged + merger)


def qwen3_vl_encoder(vision: Mapping[str, Any]) -> Qwen3VLEncoder:
    """The profile-relevant shape of a Qwen3-VL vision tower (Qwen3-VL's, Qwen3.5's): ``vision`` over :data:`QWEN3_5_VISION_DEFAULTS`
    (a config :func:`qwen3_vl_tower_params` has already read, so its sizes are counts).

    Example:
        >>> qwen3_vl_encoder({"depth": 12, "hidden_size": 768, "intermediate_size": 3072, "out_hidden_size": 1024})
        Qwen3VLEncoder(hidden=768, intermediate=3072, patch=16, patch_elems=1536, merge=2, out_hidden=1024, deepstack=0, temporal=2)
    """
    v = {**QWEN3_5_VISION_DEFAULTS, **{k: val for k, val in vision.items() if val is not None}}
    patch = int(v["patch_size"])
    return Qwen3VLEncoder(hidden=int(v["hidden_size"]), intermediate=int(v["intermediate_size"]), patch=patch,
                          patch_elems=int(v["in_channels"]) * int(v["temporal_patch_size"]) * patch * patch,
                          merge=int(v["spatial_merge_size"]), out_hidden=int(v["out_hidden_size"]),
                          deepstack=len(v.get("deepstack_visual_indexes") or []), temporal=int(v["temporal_patch_size"]))


def _most_features(max_pixels: int, unit: int) -> int:
    """Merged tokens of the image vLLM builds for a pixel cap: ``get_image_size_with_most_features``
    (models/qwen2_vl.py lines 960-1011 of 0.28.0): the largest ``max_pixels // unit^2`` that factors into
    a height x width grid no wider than 200:1."""
    for tokens in range(max_pixels // (unit * unit), 0, -1):
        side = next(d for d in range(math.isqrt(tokens), 0, -1) if tokens % d == 0)
        if tokens // side / side <= 200:
            return tokens
    return 0


#: Frames a 0.11 / 0.12 Qwen3-VL dummy video may have (``_MAX_FRAMES_PER_VIDEO``, qwen3_vl.py line 91 of 0.11.0, 123 of
#: 0.12.0); its counted tokens are the frames' tokens x 12.5 for the timestamps (``get_max_video_tokens``, lines
#: 658-675 of 0.11.0, 693-709 of 0.12.0; 0.13.0 returns the frames' tokens, lines 710-722).
QWEN3_VL_012_MAX_FRAMES = 24_576
QWEN3_VL_012_VIDEO_TOKEN_FACTOR = 12.5


@functools.lru_cache(maxsize=64)
def _formatted_video(max_model_len: int, patch: int, merge: int, temporal: int) -> tuple[int, int]:
    """(encoder tokens, counted tokens) of the 0.11 / 0.12 Qwen3-VL profile's dummy video.

    ``get_num_frames_with_most_features`` (qwen2_vl.py lines 1000-1013 of 0.12.0, called with 24,576): the most
    frames, from 2, whose tokens fit ``max_model_len`` (``_get_max_video_frames``, lines 979-998), capped; each frame of
    the image's largest side resized so all frames hold at most :data:`QWEN3_VL_VIDEO_MAX_PIXELS`
    (transformers' ``video_processing_qwen3_vl.smart_resize``: ``beta = sqrt(frames x h x w / max)``, a side of at
    least one ``patch x merge`` unit), ``frames / temporal`` temporal patches (frames padded to even).
    """
    unit = patch * merge
    side = math.isqrt(QWEN3_VL_IMAGE_MAX_PIXELS) // unit * unit

    def tokens(frames: int) -> int:
        edge = side
        if round(frames / temporal) * temporal * side * side > QWEN3_VL_VIDEO_MAX_PIXELS:
            beta = math.sqrt(frames * side * side / QWEN3_VL_VIDEO_MAX_PIXELS)
            edge = max(unit, math.floor(side / beta / unit) * unit)
        return (frames + frames % temporal) // temporal * (edge // patch) ** 2 // (merge * merge)

    frames = 2
    while frames < QWEN3_VL_012_MAX_FRAMES and tokens(frames + 1) <= max_model_len:
        frames += 1
    soft = tokens(frames)
    return soft, int(soft * QWEN3_VL_012_VIDEO_TOKEN_FACTOR)


def qwen3_vl_encoder_profile(enc: Qwen3VLEncoder, dtype_bytes: int, tp: int, max_num_batched_tokens: int,
                             max_num_seqs: int, max_model_len: int, formatted_video: bool = False) -> EncoderProfile:
    """The encoder pass of vLLM's profile run for a Qwen3-VL-style tower, counted from the source.

    The dummy item (``MultiModalBudget``, multimodal/encoder_budget.py lines 140-180 of 0.19.0, 147-187 of
    0.28.0; ``compute_mm_encoder_budget``, v1/core/encoder_cache_manager.py line 309 / 322): the modality with
    the most tokens (an image of :data:`QWEN3_VL_IMAGE_MAX_PIXELS`, 16,384 tokens, over a two-frame video of
    :data:`QWEN3_VL_VIDEO_MAX_PIXELS`), ``max(1, min(budget // T, max_num_seqs x max(1, max_model_len // T)))``
    of them with ``budget = max(max_num_batched_tokens, T)``; ``merge^2`` patches a token.

    What is alive at the peak, per patch (gpu_model_runner.py ``profile_run``, lines 5721-5795 of 0.19.0,
    6558-6631 of 0.28.0; models/qwen3_vl.py and qwen2_5_vl.py of both): the dummy batch's pixels, one flattened
    patch each, already in the model dtype (multimodal/processing/context.py line 233 / 247, so the
    ``.type(visual.dtype)`` of ``_process_image_input`` copies nothing), held by ``profile_run`` until it returns;
    the interpolated position embeddings (``h``, kept in the encoder metadata for the whole pass); and the
    larger of a block's two halves, in ``h``-wide rows: attention = the residual, ``norm1``'s output (held by the
    module call), ``qkv`` (3/TP), the contiguous q/k copy (2/TP), the rotated q/k (2/TP), the FlashAttention
    output (1/TP; varlen, no [seq, seq] matrix) and ``proj``'s output: ``3 + 8/TP`` rows (11 at TP=1); the MLP
    = the residual, ``norm2``'s output, ``linear_fc1`` and its activation (``I/TP`` each). Deepstack features
    (``out_hidden`` per token each) accumulate on top. Not counted: the rotary cos/sin and FlashAttention's
    log-sum-exp (under 1% of the peak). Held through the language model's forward and the sampler: the pixels
    and the encoder outputs (``out_hidden x (1 + deepstack)`` a token, in ``encoder_cache`` until the end).

    ``formatted_video`` (Qwen3-VL at vLLM 0.11 / 0.12, ``VllmMemoryRules.qwen3_vl_formatted_video``): the video counts
    12.5 tokens a frame token (:func:`_formatted_video`: 153,600 from ``max_model_len`` 12,289 up), so the dummy item
    is one video (v1/worker/utils.py ``MultiModalBudget``, lines 21-118 of 0.12.0, the same item count; ``T`` the
    counted tokens) of 12,288 encoder tokens (24,576 frames of 32 x 32 pixels), and ``profile_run`` copies its
    outputs into zeros of ``T`` rows (gpu_model_runner.py lines 4336-4351 of 0.12.0, 3371-3382 of 0.11.0, gone in
    0.13.0), which stay held; both copies are alive during the copy.

    Example:
        >>> enc = qwen3_vl_encoder({"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": 4096})
        >>> p = qwen3_vl_encoder_profile(enc, 2, 1, 8192, 256, 262144)
        >>> p.items, p.tokens_per_item, p.patches, round(p.peak_bytes / 2**30, 3), round(p.held_bytes / 2**30, 3)
        (1, 16384, 65536, 1.875, 0.312)
    """
    unit = enc.patch * enc.merge
    if formatted_video:
        encoded, per_item = _formatted_video(max_model_len, enc.patch, enc.merge, enc.temporal)
    else:
        per_item = max(_most_features(QWEN3_VL_IMAGE_MAX_PIXELS, unit),
                       _most_features(QWEN3_VL_VIDEO_MAX_PIXELS // 2, unit))  # two frames, one temporal patch
        encoded = per_item
    budget = max(max_num_batched_tokens, per_item)
    items = max(1, min(budget // per_item, max_num_seqs * max(1, max_model_len // per_item)))
    tokens = items * encoded
    patches = tokens * enc.merge * enc.merge
    h, tp = enc.hidden, max(tp, 1)
    attention = 3 * h + 8 * h / tp
    mlp = 2 * h + 2 * enc.intermediate / tp
    pixels = patches * enc.patch_elems * dtype_bytes
    row = enc.out_hidden * (1 + enc.deepstack) * dtype_bytes
    outputs = items * per_item * row  # the expanded copy where the item counts more tokens than it encodes
    peak = pixels + patches * (h + max(attention, mlp)) * dtype_bytes + tokens * enc.out_hidden * enc.deepstack * dtype_bytes
    if formatted_video:
        peak = max(peak, pixels + tokens * row + outputs)
    return EncoderProfile(items=items, tokens_per_item=per_item, patches=patches, peak_bytes=int(peak),
                          held_bytes=pixels + outputs)


def deepstack_buffer_bytes(model: Any, max_num_batched_tokens: int) -> int:
    """The deepstack buffers a Qwen3-VL model allocates while it loads: one ``[max_num_batched_tokens, hidden]``
    tensor per ``deepstack_visual_indexes`` entry in the model dtype (``Qwen3VLForConditionalGeneration.__init__``,
    qwen3_vl.py lines 1267-1277 of 0.12.0, 1501-1509 of 0.19.0, 1756-1764 of 0.26.0; qwen3_vl_moe.py lines 455-463 of
    0.12.0), created under the loader's default device and so inside "Model loading took"; 0 without deepstack."""
    enc = model.vision_encoder
    if enc is None or not enc.deepstack:
        return 0
    return enc.deepstack * max_num_batched_tokens * model.hidden_size * model.dtype_bytes


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


def vision_tower_params(vision: Mapping[str, Any], text_hidden: int, source: str, llava_features: int = 0) -> int:
    """Parameters of a SigLIP / ViT-style vision tower plus a linear projector into ``text_hidden``.

    Per encoder layer: q, k, v, o (``4 h^2 + 4 h``), the MLP (``2 h i + i + h``), two layer norms
    (``4 h``); the patch embedding (``3 p^2 h + h``), position embeddings (``(image / patch)^2 h``),
    the post layer norm and the projector (``h x text_hidden``, gemma-3's ``mm_input_projection``).
    Pixtral (Mistral-Small-3.1): bias-free, a gated MLP, no position table, and Mistral3's projector.
    LLaVA wrappers (``llava_features`` > 0, the count of ``vision_feature_layer``): vLLM's
    ``LlavaMultiModalProjector``, ``h x features -> text -> text`` with biases, and LLaVA-Next's
    ``image_newline`` (``llava_next.py``).
    A tower without those fields is refused: its size is not known from the config.

    Example:
        >>> round(vision_tower_params({"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
        ...        "image_size": 896, "patch_size": 14}, 2560, "c") / 1e6, 1)
        419.8
    """
    try:
        h = int(vision["hidden_size"])
        inter = int(vision["intermediate_size"])
        layers = int(vision["num_hidden_layers"])
        patch = int(vision.get("patch_size") or 14)
        image = int(vision.get("image_size") or 224)
    except (KeyError, TypeError, ValueError):
        raise SpecError(f"{source}: vision_config", "a vision tower whose size the config does not give "
                        "(hidden_size, intermediate_size, num_hidden_layers) is not modelled",
                        "plan the language model alone: point --model at a config without vision_config") from None
    if str(vision.get("model_type") or "") == "pixtral":
        # vLLM's pixtral.py / mistral3.py: bias-free layers, a gated (3-matrix) MLP, 2-D rotary (no position
        # table); the projector merges 2x2 patches (4h -> h), then h -> text and text -> text.
        per_layer = 4 * h * h + 3 * h * inter + 2 * h
        merge = int(vision.get("spatial_merge_size") or 2) ** 2
        return (layers * per_layer + 3 * patch * patch * h + h + merge * h * h + h
                + h * text_hidden + text_hidden * text_hidden)
    per_layer = 4 * h * h + 4 * h + 2 * h * inter + inter + h + 4 * h
    embed = 3 * patch * patch * h + h + (image // patch) ** 2 * h
    if llava_features:
        projector = h * llava_features * text_hidden + text_hidden * text_hidden + 3 * text_hidden
        return layers * per_layer + embed + 2 * h + projector
    return layers * per_layer + embed + 2 * h + h * text_hidden + h


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


def group_size_for(counts: Sequence[int]) -> int:
    """vLLM's layers per KV-cache group for attention types with these layer counts (uniform page size).

    Example:
        >>> group_size_for([29, 5]), group_size_for([12, 12]), group_size_for([32])
        (5, 12, 32)
    """
    counts = [c for c in counts if c > 0]
    if len(counts) <= 1:
        return counts[0] if counts else 1
    low, high = min(counts), max(counts)
    return high if high < low * 1.25 else low


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """How one worker's KV cache is paged: the block's bytes and the groups that share each block.

    ``page_bytes`` is one block of one layer; a block index is used by every group, each group
    holding ``group_size`` layers, so a block costs ``page_bytes * group_size``. ``groups`` is the
    attention type of each group (``"full"`` / ``"sliding"``).
    """

    page_bytes: int
    group_size: int
    groups: tuple[str, ...]
    sliding_window: int = 0
    #: A Mamba group's block size: ``mamba_block_size``, the ``max_model_len`` without prefix caching
    #: (:func:`~servetune.planner.hybrid.mamba_group_block_size`); 0 without Mamba groups.
    mamba_block_size: int = 0
    #: The Mamba cache mode (``"none"`` / ``"align"`` / ``"all"``): how many blocks a Mamba group holds a request.
    mamba_cache_mode: str = "none"

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * self.group_size

    def bytes_per_token(self, block_size: int) -> int:
        """KV bytes per token as vLLM counts tokens: every group's page (padded groups included) per block slot.

        For a model without sliding layers, ``2 x kv_heads x head_dim x dtype x layers``.
        """
        return self.block_bytes * len(self.groups) // block_size

    def tokens(self, num_blocks: int, block_size: int) -> int:
        """The "GPU KV cache size" vLLM logs up to 0.20.0: ``num_blocks // len(groups) * min_block_size``.

        ``min_block_size`` is the smallest group's block size (``kv_cache_utils.py``: line 1077 of 0.11.0,
        ``_report_kv_cache_config`` lines 1297-1306 of 0.19.0): a Mamba group's is ``max_model_len``.
        """
        smallest = min(block_size, self.mamba_block_size) if self.mamba_block_size else block_size
        return num_blocks // len(self.groups) * smallest

    def blocks_per_request(self, max_model_len: int, block_size: int, max_in_flight_tokens: int) -> int:
        """Blocks one ``max_model_len`` request takes (vLLM's ``get_max_concurrency_for_kv_cache_config``)."""
        full = -(-max_model_len // block_size)
        window = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len) if self.sliding_window else 0
        sliding = -(-window // block_size) + 1
        per_group = {_SLIDING: sliding, _MAMBA: self._mamba_blocks(max_model_len)}
        return sum(per_group.get(g, full) for g in self.groups)

    def _mamba_blocks(self, max_model_len: int) -> int:
        """Blocks a Mamba group holds for one request (``MambaSpec.max_memory_usage_bytes`` over its page;
        ``v1/kv_cache_interface.py`` lines 709-718 of 0.26.0, 261-263 of 0.11.1, speculative blocks left out): one
        state without prefix caching; two in 'align' mode (the running state and the last one cached); in 'all'
        mode one a ``mamba_block_size`` of ``max_model_len`` (0.11.1-0.14: ``cdiv(max_model_len, block_size)``
        in every mode, ``mamba_block_size`` being ``max_model_len`` without prefix caching)."""
        if self.mamba_cache_mode == "align":
            return 2
        if self.mamba_cache_mode == "all":
            return -(-max_model_len // self.mamba_block_size)
        return 1

    def longest_fitting_len(self, avail_bytes: int, max_model_len: int, block_size: int,
                            max_in_flight_tokens: int) -> int:
        """The longest ``max_model_len`` whose one request fits ``avail_bytes`` (0: none).

        vLLM's ``estimate_max_model_len`` (``vllm/v1/core/kv_cache_utils.py``): a binary search
        over the length, every group's blocks counted, so a sliding-window / global hybrid
        (gemma-2) pays for its global layers and its window at once.

        Example:
            >>> KVLayout(page_bytes=1, group_size=1, groups=("full", "sliding"), sliding_window=4096
            ...          ).longest_fitting_len(911, 8192, 16, 8192)
            7280
        """
        left, right, best = 1, max_model_len, 0
        while left <= right:
            mid = (left + right) // 2
            if self.blocks_per_request(mid, block_size, max_in_flight_tokens) * self.block_bytes <= avail_bytes:
                best, left = mid, mid + 1
            else:
                right = mid - 1
        return best


def kv_layout(model: Any, tp: int, stage: int, pp: int, block_size: int, kv_dtype_bytes: int,
              mamba_block_size: int = 0, mamba_cache_mode: str = "none") -> KVLayout:
    """The :class:`KVLayout` of one pipeline stage's worker (``model``: a ModelProfile).

    For a Mamba2 hybrid ``block_size`` is the raised attention block
    (:func:`~servetune.planner.hybrid.hybrid_block_size`) and ``mamba_block_size`` the Mamba groups'
    (:func:`~servetune.planner.hybrid.mamba_group_block_size`; ``max_model_len`` without prefix caching),
    ``mamba_cache_mode`` how many of them a request holds (:meth:`KVLayout.blocks_per_request`). vLLM
    groups the Mamba
    layers like any other type (``_get_kv_cache_groups_uniform_page_size``: groups of the smallest type's
    layer count, ``max`` when the largest is under 1.5 times it in 0.19.0 / 0.26.0; the planner keeps its
    earlier 1.25, which no modelled hybrid comes near).

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> kv_layout(load_model("llama-3.1-8b"), 1, 0, 1, 16, 2).block_bytes   # 32 layers x 16 tokens x 4 KiB
        2097152
    """
    if model.mla_kv_lora_rank:
        page = block_size * (model.mla_kv_lora_rank + model.mla_rope_dim) * kv_dtype_bytes
    else:
        page = 2 * block_size * model.kv_heads_per_gpu(tp) * model.head_dim * kv_dtype_bytes
    layers = model.stage_layers(pp)
    start = sum(layers[:stage])
    n = layers[stage]
    kinds = list(model.layer_types[start:start + n]) if model.layer_types else [_FULL] * n
    # Mamba layers share the attention page (their state padded up to it: hybrid_block_size); "mlp" layers hold none
    both = kinds.count(_PARALLEL)  # Falcon-H1: one attention and one Mamba layer each
    counts = {k: kinds.count(k) + (both if k != _SLIDING else 0) for k in (_FULL, _SLIDING, _MAMBA)}
    counts = {k: c for k, c in counts.items() if c}
    size = group_size_for(list(counts.values()))
    groups: list[str] = []
    for kind, count in counts.items():
        groups += [kind] * math.ceil(count / size)
    return KVLayout(page_bytes=page, group_size=size, groups=tuple(groups),
                    sliding_window=model.sliding_window if _SLIDING in counts else 0,
                    mamba_block_size=mamba_block_size if _MAMBA in counts else 0,
                    mamba_cache_mode=mamba_cache_mode if _MAMBA in counts else "none")


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


def multimodal_profile_bytes(model: Any, tokens: int) -> int:
    """The profile run's extra peak for a model with a vision tower other than a Qwen3-VL-style one (0 without
    one, and 0 for a tower :func:`qwen3_vl_encoder_profile` counts): see :data:`MULTIMODAL_PROFILE_ELEMS_PER_TOKEN`."""
    if not model.vision_params or model.vision_encoder is not None:
        return 0
    return int(MULTIMODAL_PROFILE_ELEMS_PER_TOKEN * tokens * model.hidden_size * model.dtype_bytes)


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
