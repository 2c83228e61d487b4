"""The Mamba2 / gated-delta-net hybrids: what vLLM keeps for their recurrent layers and how it pages it.

Pure functions over a parsed ``config.json`` and over :class:`~servetune.planner.modelinfo.ModelProfile`
(no I/O). :mod:`servetune.planner.modelclass` calls them while it refuses, normalizes and reads a hybrid's config
and lays out its KV cache; :mod:`servetune.planner.engine_config` sizes the blocks with :func:`hybrid_block_size`
and :func:`mamba_group_block_size`; the simulator prices the state with :func:`mamba_state_bytes`. Each rule names
the vLLM source it follows:

- **Mamba2 / attention hybrids** (Granite-4.0-H ``granitemoehybrid``, Nemotron-H ``nemotron_h``'s ``M`` /
  ``*`` / ``-`` / ``E`` layers (``E``: a MoE, :func:`nemotron_moe_fields`), Bamba up to vLLM 0.23, Falcon-H1's attention and Mamba2 side by side in every layer;
  :func:`hybrid_kinds`), and Qwen3-Next's gated delta net, whose state vLLM sizes
  the same way (``MambaSpec``; its conv and temporal shapes are a Mamba2 state's with ``linear_num_key_heads``
  groups of ``linear_key_head_dim``): each Mamba layer keeps one recurrent state per request
  (:func:`mamba_state_bytes`); vLLM raises the attention block until one attention page holds it and pads
  the state to that page (:func:`hybrid_block_size`), so Mamba layers join the KV groups like another
  attention type and hold one block of a request (``MambaSpec.max_memory_usage_bytes``, no prefix
  caching). With prefix caching (0.11.1 on; :func:`~servetune.planner.vllm_rules.hybrid_prefix_caching_mode`)
  the state is paged per block: 'align' mode holds two blocks a request, 'all' mode one a Mamba block
  of ``max_model_len``, its block aligned to the Mamba2 kernel's chunk (:func:`mamba_group_block_size`,
  :meth:`~servetune.planner.modelclass.KVLayout.blocks_per_request`). The weights are ``MambaMixer2``'s
  (``ModelProfile._hybrid_layer_elems``).
  Read in vLLM 0.26.0, 0.19.0 and 0.11.0 (and 0.13, 0.16, 0.22, 0.24, 0.25 for the version thresholds; 0.10.2 to
  0.29.0 for prefix caching); prefix caching's 'all' mode matches one real vLLM 0.26.0 granite-4.0-h-tiny start
  (read before the rule was written). From 0.28 prefix caching is on by default for hybrids
  (:attr:`~servetune.planner.vllm_rules.VllmMemoryRules.hybrid_prefix_caching_default_on`), in the 'align' mode.
- **Qwen3.5**'s language model (``qwen3_5_text`` / ``qwen3_5_moe_text``): Qwen3-Next's gated delta net, the SSM
  state in the text config's ``mamba_ssm_dtype`` (:func:`mamba_ssm_dtype_bytes`); the wrapper, its vision tower
  and its MTP layers are :mod:`servetune.planner.modelclass`'s. Read in vLLM 0.19.0, 0.26.0 and 0.28.0.

Refused with one line and exit 2 (through :func:`~servetune.planner.modelclass.refuse_unmodelled`): Nemotron-H layer
codes other than ``M`` / ``*`` / ``-`` / ``E``, Nemotron-H layers with their own sizes (``block_configs``), Qwen3-Next with dense MLP layers, other layer kinds
of a modelled hybrid, hybrids with chunked or shared KV layers, hybrids without attention layers, and a config
without the fields that size the recurrent state.

Example:
    >>> hybrid_kinds({"model_type": "granitemoehybrid", "layer_types": ["mamba", "attention", "mamba"]})
    ['mamba', 'full', 'mamba']
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from servetune.errors import SpecError

__all__ = ["hybrid_kinds", "mamba_state_bytes", "mamba_ssm_state_bytes", "hybrid_block_size", "mamba_ssm_dtype_bytes",
           "supports_mamba_prefix_caching", "mamba_group_block_size", "nemotron_moe_fields"]

#: The layer kinds of ``ModelProfile.layer_types`` (and the KV groups' names) a hybrid's layers take; the
#: sliding-window kind stays in :mod:`servetune.planner.modelclass`.
_FULL = "full"
_MAMBA = "mamba"
_PARALLEL = "parallel"  # a Falcon-H1 layer: attention and a Mamba2 mixer side by side (one KV page of each)
_MLP = "mlp"  # a Nemotron-H ``-`` layer: a norm and an MLP, no mixer
_MOE = "moe"  # a Nemotron-H ``E`` layer: a norm and a MoE (NemotronHMoE), no mixer
#: Recurrent / attention hybrids the planner models (:func:`hybrid_kinds`): vLLM's Mamba2
#: ``GraniteMoeHybridForCausalLM`` and ``NemotronHForCausalLM`` (its ``M`` / ``*`` / ``-`` layers and
#: MoE ``E`` layers), ``BambaForCausalLM`` (gone from vLLM's registry after 0.23), and the gated-delta-net
#: ``Qwen3NextForCausalLM`` (every layer MoE), and ``FalconH1ForCausalLM`` (attention and Mamba2 in every layer).
_MAMBA2_HYBRIDS = ("granitemoehybrid", "nemotron_h", "qwen3_next", "bamba", "falcon_h1", "qwen3_5_text",
                   "qwen3_5_moe_text")
#: The gated-delta-net hybrids: Qwen3-Next, and Qwen3.5's language model (``Qwen3_5DecoderLayer`` subclasses
#: ``Qwen3NextDecoderLayer``: the same ``QwenGatedDeltaNetAttention`` and ``Qwen3NextAttention``; qwen3_5.py lines
#: 113-156 of 0.26.0). Its dense FFN (``qwen3_5_text``) or MoE (``qwen3_5_moe_text``) is the only other difference.
_GDN_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def _refuse_unmodelled_hybrid(cfg: Mapping[str, Any], model_type: str, source: str, fix: str) -> None:
    """One line for what a modelled Mamba2 hybrid (:data:`_MAMBA2_HYBRIDS`) holds that the planner does not."""
    if model_type == "nemotron_h":
        pattern = _nemotron_pattern(cfg)
        odd = sorted(set(pattern) - set("M*-E"))
        if odd or not pattern:
            raise SpecError(f"{source}: hybrid_override_pattern", f"layer codes {odd or 'none'} are not modelled "
                            "by the planner (M, *, -, E are)", fix)
        if "E" in pattern:
            _refuse_unmodelled_nemotron_moe(cfg, source, fix)
    elif model_type in _GDN_TYPES:
        kinds = [str(t).lower() for t in (cfg.get("layer_types") or [])]
        odd = sorted(set(kinds) - {"linear_attention", "full_attention"})
        if odd:
            raise SpecError(f"{source}: layer_types", f"{', '.join(odd)} layers of {model_type} are not modelled by "
                            "the planner (linear_attention and full_attention are)", fix)
        # Qwen3_5DecoderLayer picks the FFN by model_type alone (qwen3_5.py lines 157-172 of 0.26.0): mlp_only_layers
        # and decoder_sparse_step are Qwen3-Next's only
        if model_type == "qwen3_next" and cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
            raise SpecError(f"{source}: mlp_only_layers", "qwen3_next layers with a dense MLP (mlp_only_layers, "
                            "decoder_sparse_step) are not modelled by the planner", fix)
    else:
        kinds = [str(t).lower() for t in (cfg.get("layer_types") or cfg.get("layers_block_type") or [])]
        odd = sorted(set(kinds) - {"mamba", "attention"})
        if odd:
            raise SpecError(f"{source}: layer_types", f"{', '.join(odd)} layers of {model_type} are not modelled by "
                            "the planner (mamba and attention are)", fix)
    if cfg.get("attention_chunk_size") or cfg.get("num_kv_shared_layers"):
        raise SpecError(f"{source}: model_type", f"{model_type} with chunked or shared KV layers is not modelled "
                        "by the planner", fix)
    kinds = hybrid_kinds(cfg)
    if kinds and _FULL not in kinds and _PARALLEL not in kinds:
        raise SpecError(f"{source}: model_type", f"{model_type} without attention layers (vLLM pages no attention "
                        "KV beside the recurrent state) is not modelled by the planner", fix)
    missing = [k for k in _STATE_KEYS[model_type] if kinds and cfg.get(k) is None]
    if missing:
        raise SpecError(f"{source}: {missing[0]}", f"config.json has no {' / '.join(repr(k) for k in missing)}, "
                        f"which size a {model_type} layer's recurrent state", "use the model's complete config.json")


def _refuse_unmodelled_nemotron_moe(cfg: Mapping[str, Any], source: str, fix: str) -> None:
    """One line for a Nemotron-H MoE (``E``) config the planner does not model: heterogeneous "puzzle" layers
    (``block_configs``: each layer's own sizes through ``get_nemotron_h_config_for_layer``, nemotron_h.py lines
    272-276 and 330-332 of 0.26.0) and a config without the fields that size the experts."""
    if cfg.get("block_configs"):
        raise SpecError(f"{source}: block_configs", "Nemotron-H layers with their own sizes (block_configs) are not "
                        "modelled by the planner", fix)
    missing = [k for k in _NEMOTRON_MOE_KEYS if cfg.get(k) is None]
    if missing:
        raise SpecError(f"{source}: {missing[0]}", f"config.json has no {' / '.join(repr(k) for k in missing)}, "
                        "which size a Nemotron-H MoE layer", "use the model's complete config.json")


#: What sizes a Nemotron-H MoE layer (``NemotronHMoE``): vLLM's config class has defaults for them
#: (``transformers_utils/configs/nemotron_h.py`` lines 191-196 of 0.26.0: 8 experts of 7688, top-2), which no
#: published checkpoint uses, so a config that leaves one out is refused rather than planned on them.
_NEMOTRON_MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


#: The config fields each modelled hybrid's recurrent state is sized from (:func:`_mamba_fields`).
_STATE_KEYS = {
    "granitemoehybrid": ("mamba_n_heads", "mamba_d_head", "mamba_d_state"),
    "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_d_state"),
    "falcon_h1": ("mamba_n_heads", "mamba_d_head", "mamba_d_state"),
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size"),
    "qwen3_next": ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"),
    "qwen3_5_text": ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"),
    "qwen3_5_moe_text": ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim"),
}


def _nemotron_pattern(cfg: Mapping[str, Any]) -> str:
    """Nemotron-H's layer codes: ``hybrid_override_pattern``, or ``layers_block_type`` spelled out."""
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, (list, tuple)):
        return "".join(str(c) for c in pattern)
    if pattern:
        return str(pattern)
    codes = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}
    return "".join(codes.get(str(t).lower(), "?") for t in (cfg.get("layers_block_type") or []))


def hybrid_kinds(cfg: Mapping[str, Any]) -> list[str]:
    """Per layer ``"mamba"`` / ``"full"`` / ``"mlp"`` for a modelled Mamba2 hybrid; ``[]`` for any other model
    and for a hybrid config without a Mamba layer (vLLM's ``ModelConfig.is_hybrid`` is false for granite-4.0-micro,
    whose ``layer_types`` are all ``attention``: ``config/model.py`` lines 1673-1683 of 0.26.0).

    Granite-4.0-H: ``layer_types`` (``mamba`` / ``attention``), each layer also holding the MoE and
    shared MLP (``granitemoehybrid.py``: ``ALL_DECODER_LAYER_TYPES[config.layer_types[layer_idx]]``).
    Nemotron-H: one character of ``hybrid_override_pattern`` per layer, ``M`` Mamba2, ``*``
    attention, ``-`` an MLP alone, ``E`` a MoE alone (``nemotron_h.py``: ``config.hybrid_override_pattern[layer_idx]``;
    ``ALL_DECODER_LAYER_TYPES``, lines 530-535 of 0.26.0, 525-530 of 0.28.0).

    Example:
        >>> hybrid_kinds({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*E"})
        ['mamba', 'mlp', 'mamba', 'full', 'moe']
        >>> hybrid_kinds({"model_type": "granitemoehybrid", "layer_types": ["attention", "attention"]})
        []
    """
    model_type = str(cfg.get("model_type") or "").lower()
    if model_type == "nemotron_h":
        kinds = [{"M": _MAMBA, "*": _FULL, "-": _MLP, "E": _MOE}[c] for c in _nemotron_pattern(cfg)]
    elif model_type == "granitemoehybrid":
        declared = cfg.get("layer_types") or cfg.get("layers_block_type") or []
        kinds = [_MAMBA if str(t).lower() == "mamba" else _FULL for t in declared]
    elif model_type == "falcon_h1":
        # FalconH1ParallelHybrid: every layer runs attention and a Mamba2 mixer (falcon_h1.py, lines 315-370 of 0.26.0)
        kinds = [_PARALLEL] * int(cfg.get("num_hidden_layers") or 0)
    elif model_type == "bamba":
        # transformers' BambaConfig.layers_block_type: attention at attn_layer_indices, Mamba elsewhere
        declared = cfg.get("layers_block_type") or []
        attn = set(cfg.get("attn_layer_indices") or [])
        kinds = ([_MAMBA if str(t).lower() == "mamba" else _FULL for t in declared] if declared else
                 [_FULL if i in attn else _MAMBA for i in range(int(cfg.get("num_hidden_layers") or 0))])
    elif model_type in _GDN_TYPES:
        # transformers' Qwen3NextConfig (and vLLM's Qwen3_5TextConfig, qwen3_5.py lines 88-95 of 0.26.0): layer_types, else full attention every full_attention_interval-th layer
        declared = cfg.get("layer_types") or []
        if declared:
            kinds = [_MAMBA if str(t).lower() == "linear_attention" else _FULL for t in declared]
        else:
            interval = int(cfg.get("full_attention_interval") or 4)
            kinds = [_FULL if (i + 1) % interval == 0 else _MAMBA for i in range(int(cfg.get("num_hidden_layers") or 0))]
    else:
        return []
    return kinds if _MAMBA in kinds or _PARALLEL in kinds else []


def _mamba_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The Mamba2 mixer's sizes, under each family's names (the ``get_mamba_state_shape_from_config`` of
    ``granitemoehybrid.py`` lines 612-638 and ``nemotron_h.py`` lines 753-780 of 0.26.0, the same in 0.19.0 and
    0.11.0): heads, head dim, state size, groups, conv kernel and the mixer's intermediate size
    (granite: ``mamba_expand x hidden_size``; Nemotron-H: ``mamba_num_heads x mamba_head_dim``)."""
    hidden = int(cfg.get("hidden_size") or 0)
    model_type = str(cfg.get("model_type") or "").lower()
    if model_type in _GDN_TYPES:
        # the gated delta net's state in Mamba2 terms (gated_delta_net_state_shape, mamba_utils.py lines 212-234 of
        # 0.26.0): conv (kernel - 1) x (2 x key_dim + value_dim) / tp = a Mamba2 conv with num_k_heads groups of
        # head_k_dim; temporal (v_heads / tp, head_v_dim, head_k_dim) = heads x head_dim x d_state
        k_heads, v_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        k_dim, v_dim = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
        return {"mamba_heads": v_heads, "mamba_head_dim": v_dim, "mamba_d_state": k_dim, "mamba_groups": k_heads,
                "mamba_d_conv": int(cfg.get("linear_conv_kernel_dim") or 4), "mamba_inner": v_heads * v_dim,
                "mamba_conv_bias": False, "mamba_proj_bias": False, "mamba_kind": "gdn",
                # Qwen3.5: the text config's mamba_ssm_dtype (mamba_ssm_dtype_bytes); Qwen3-Next has no such rule
                "mamba_ssm_dtype": str(cfg.get("mamba_ssm_dtype") or "") if model_type != "qwen3_next" else "",
                "mamba_chunk_size": 64}  # FLA's chunk_gated_delta_rule: chunk_size 64 (ops/chunk.py)
    if model_type == "nemotron_h":
        heads, head_dim = int(cfg["mamba_num_heads"]), int(cfg["mamba_head_dim"])
        return {"mamba_heads": heads, "mamba_head_dim": head_dim, "mamba_d_state": int(cfg["ssm_state_size"]),
                "mamba_groups": int(cfg.get("n_groups") or 1), "mamba_d_conv": int(cfg.get("conv_kernel") or 4),
                "mamba_inner": heads * head_dim, "mamba_conv_bias": bool(cfg.get("use_conv_bias", True)),
                "mamba_proj_bias": bool(cfg.get("use_bias", False)),
                "mamba_ssm_dtype": str(cfg.get("mamba_ssm_cache_dtype") or ""),
                "mamba_chunk_size": _chunk_size(cfg)}
    falcon = model_type == "falcon_h1"
    # Falcon-H1: mamba_d_ssm when set, else int(mamba_expand x hidden); its RMSNormGated weight only with
    # mamba_rms_norm; a mup_vector buffer (falcon_h1.py, FalconH1SSMDecoderLayer, lines 113-196 of 0.26.0)
    inner = int(cfg.get("mamba_d_ssm") or int(float(cfg.get("mamba_expand") or 2) * hidden)) if falcon \
        else int(cfg.get("mamba_expand") or 2) * hidden
    return {"mamba_heads": int(cfg["mamba_n_heads"]), "mamba_head_dim": int(cfg["mamba_d_head"]),
            "mamba_d_state": int(cfg["mamba_d_state"]), "mamba_groups": int(cfg.get("mamba_n_groups") or 1),
            "mamba_d_conv": int(cfg.get("mamba_d_conv") or 4), "mamba_inner": inner,
            "mamba_conv_bias": bool(cfg.get("mamba_conv_bias", True)),
            "mamba_proj_bias": bool(cfg.get("mamba_proj_bias", False)), "mamba_ssm_dtype": "",
            "mamba_norm_weight": bool(cfg.get("mamba_rms_norm", False)) if falcon else True,
            "mamba_mup_vector": falcon, "mamba_chunk_size": _chunk_size(cfg)}


#: The Mamba2 SSD kernel's chunk where a config names none: the config classes' defaults (transformers 5.23.0:
#: ``mamba_chunk_size = 256`` in ``configuration_granitemoehybrid.py`` line 102, ``configuration_bamba.py`` line 73,
#: ``configuration_falcon_h1.py`` line 84). Nemotron-H is left out: transformers' ``NemotronHConfig`` says 128
#: (line 130), vLLM's own (``transformers_utils/configs/nemotron_h.py`` line 189 of 0.26.0) 256, and which one
#: loads was not read, so a Nemotron-H config without ``chunk_size`` has no chunk (0).
_CHUNK_DEFAULTS = {"granitemoehybrid": 256, "bamba": 256, "falcon_h1": 256}


def _chunk_size(cfg: Mapping[str, Any]) -> int:
    """vLLM's ``ModelConfig.get_mamba_chunk_size`` (``config/model.py`` lines 1440-1455 of 0.26.0): the config's
    ``mamba_chunk_size``, else its ``chunk_size``, else the config class's default (:data:`_CHUNK_DEFAULTS`); 0 where
    none is known."""
    chunk = cfg.get("mamba_chunk_size") or cfg.get("chunk_size")
    return int(chunk) if chunk else _CHUNK_DEFAULTS.get(str(cfg.get("model_type") or "").lower(), 0)


#: Model classes that implement ``SupportsMambaPrefixCaching`` (so default to 'all' mode): ``granitemoehybrid.py``
#: lines 585-592 of 0.11.1, 576-583 of 0.26.0; ``nemotron_h.py`` 689-697 / 699-709; ``falcon_h1.py`` 500-506 /
#: 496-502; ``bamba.py`` 404-411 of 0.11.1, 396-403 of 0.23.0. ``Qwen3NextForCausalLM`` does not (lines 1171 of
#: 0.11.1, 769-777 of 0.26.0); the same from 0.11.1 to 0.32.0.
_MAMBA_PREFIX_CACHING = ("GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "FalconH1ForCausalLM",
                         "BambaForCausalLM")


def supports_mamba_prefix_caching(model: Any) -> bool:
    """Whether vLLM's class for ``model`` pages its Mamba state per block under prefix caching ('all' mode).

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> supports_mamba_prefix_caching(load_model("granite-4.0-h-tiny")), \\
        ...     supports_mamba_prefix_caching(load_model("qwen3-next-80b-a3b"))
        (True, False)
    """
    return model.architecture in _MAMBA_PREFIX_CACHING


def mamba_state_bytes(model: Any, tp: int, ssm_dtype_bytes: int) -> int:
    """One Mamba2 layer's state for one request on one TP rank: vLLM's ``MambaSpec.page_size_bytes`` unpadded.

    ``MambaStateShapeCalculator.mamba2_state_shape`` (``layers/mamba/mamba_utils.py`` lines 161-187 of
    0.26.0; 115-140 of 0.11.0): the groups are widened to ``tp`` where ``n_groups % tp`` (``extra_groups_for_head_shards``),
    the conv state is ``(d_conv - 1) x (inner + 2 x groups x d_state) / tp`` in the model dtype
    (``mamba_cache_dtype`` auto), the SSM state ``heads / tp x head_dim x d_state`` in ``ssm_dtype_bytes``
    (``kv_cache_interface.py``: ``MambaSpec.page_size_bytes``, the sum of the shapes' bytes).

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> mamba_state_bytes(load_model("granite-4.0-h-tiny"), 1, 2)   # 3 x 3328 x 2 + 48 x 64 x 128 x 2
        806400
    """
    conv = (model.mamba_d_conv - 1) * (model.mamba_conv_dim(tp) // tp) * model.dtype_bytes
    return conv + mamba_ssm_state_bytes(model, tp, ssm_dtype_bytes)


def mamba_ssm_state_bytes(model: Any, tp: int, ssm_dtype_bytes: int) -> int:
    """The SSM part of :func:`mamba_state_bytes`: ``heads / tp x head_dim x d_state`` in ``ssm_dtype_bytes``.

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> mamba_ssm_state_bytes(load_model("granite-4.0-h-tiny"), 1, 2)   # 48 x 64 x 128 x 2
        786432
    """
    return (model.mamba_heads // tp) * model.mamba_head_dim * model.mamba_d_state * ssm_dtype_bytes


_STATE_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def mamba_ssm_dtype_bytes(model: Any, nemotron_default: str) -> int:
    """Bytes of one SSM-state element: the model dtype (``mamba_ssm_cache_dtype`` auto,
    ``MambaStateDtypeCalculator._mamba_state_dtype``), except Qwen3.5 (its text config's ``mamba_ssm_dtype``)
    and Nemotron-H, whose config class sets the config's ``mamba_ssm_cache_dtype`` or ``nemotron_default``
    (:attr:`~servetune.planner.vllm_rules.VllmMemoryRules.nemotron_h_ssm_default`; ``"auto"``: the model dtype).

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> mamba_ssm_dtype_bytes(load_model("granite-4.0-h-tiny"), "float32")
        2
    """
    if model.architecture.startswith("Qwen3_5"):
        # Qwen3_5ForConditionalGenerationConfig.verify_and_update_config: mamba_ssm_cache_dtype 'auto' takes the
        # text config's mamba_ssm_dtype (models/config.py lines 663-690 and 746-747 of 0.19.0, 744-770 and 863-864
        # of 0.26.0, 781-807 and 942-944 of 0.28.0, where the text-only Qwen3_5ForCausalLM joins; before 0.28 that
        # text-only architecture kept the model dtype, which is not told apart here)
        return _STATE_DTYPE_BYTES.get(model.mamba_ssm_dtype, model.dtype_bytes)
    if not model.architecture.startswith("NemotronH") or nemotron_default == "auto":
        return model.dtype_bytes
    return _STATE_DTYPE_BYTES.get(model.mamba_ssm_dtype or nemotron_default, model.dtype_bytes)


def hybrid_block_size(model: Any, tp: int, block_size: int, kv_dtype_bytes: int, ssm_dtype_bytes: int,
                      align_to_block_size: bool, chunk_size: int = 0) -> int:
    """The attention block size vLLM raises a Mamba2 hybrid's to, so one attention page holds a Mamba state.

    ``align x cdiv(mamba_page, align x attention_page_per_token)``, kept when ``block_size`` is larger;
    the Mamba page is then padded up to the attention page (``mamba_page_size_padded``). ``align`` is 16
    in 0.11.0 and 0.19.0 (``HybridAttentionMambaModelConfig.verify_and_update_config``, ``models/config.py``
    lines 367-375 of 0.11.0, 218 and 273-285 of 0.19.0: "FlashAttention (FA) requires block size to be
    multiple of 16"); from 0.20.0 the platform aligns to ``max(16, block_size)`` (``platforms/interface.py``,
    ``_align_hybrid_block_size``, lines 577-583 of 0.20.0, 616-622 of 0.21.0, 620-626 and 642 of 0.22.0, 876-882
    and 898-901 of 0.26.0: the backend's smallest kernel block, FlashAttention's ``MultipleOf(16)``, or the block
    size if larger). With prefix caching in 'all' mode (``chunk_size``, the Mamba2 kernel's chunk, > 0) the block is
    a multiple of ``lcm(chunk_size, align)`` instead: ``chunk x cdiv(cdiv(mamba_page, attention_page_per_token),
    chunk)`` (lines 394-415 of 0.11.1, 466-487 of 0.15.0, 884-894 of 0.26.0: "align to mamba chunk size for kernel
    perf"); see :func:`mamba_group_block_size`.

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> hybrid_block_size(load_model("granite-4.0-h-tiny"), 1, 16, 2, 2, True)   # 16 x cdiv(806400, 16 x 2048)
        400
        >>> hybrid_block_size(load_model("granite-4.0-h-tiny"), 1, 16, 2, 2, True, 256)  # 256 x cdiv(394, 256)
        512
    """
    if not model.is_hybrid:
        return block_size
    return max(block_size, _raised_block(model, tp, block_size, kv_dtype_bytes, ssm_dtype_bytes, align_to_block_size,
                                         chunk_size))


def _raised_block(model: Any, tp: int, block_size: int, kv_dtype_bytes: int, ssm_dtype_bytes: int,
                  align_to_block_size: bool, chunk_size: int) -> int:
    """The attention block one Mamba state asks for (:func:`hybrid_block_size` before the user's block is kept)."""
    per_token = 2 * model.kv_heads_per_gpu(tp) * model.head_dim * kv_dtype_bytes
    align = max(16, block_size) if align_to_block_size else 16
    state = mamba_state_bytes(model, tp, ssm_dtype_bytes)
    if chunk_size:
        chunk = math.lcm(chunk_size, align)
        return chunk * -(-(-(-state // per_token)) // chunk)
    return align * -(-state // (align * per_token))


def mamba_group_block_size(model: Any, tp: int, block_size: int, kv_dtype_bytes: int, ssm_dtype_bytes: int,
                           align_to_block_size: bool, mamba_cache_mode: str, chunk_size: int,
                           max_model_len: int) -> int:
    """The Mamba groups' block size in tokens (``cache_config.mamba_block_size``, ``MambaSpec.block_size``), given the
    user's ``block_size`` (16 unset) and the Mamba cache mode.

    ``"none"`` (no prefix caching): ``max_model_len`` (``MambaModelConfig``, ``models/config.py`` line 291 of 0.11.1,
    601-602 of 0.26.0), so a request holds one state. ``"align"``: the attention block (``platforms/interface.py`` lines
    911-912 of 0.26.0, ``models/config.py`` 514-515 of 0.15.0). ``"all"``: the chunk-aligned block
    :func:`hybrid_block_size` computes, even where the user's larger ``block_size`` is kept for attention
    (line 894 of 0.26.0: ``cache_config.mamba_block_size = attn_block_size``).

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> m = load_model("granite-4.0-h-tiny")
        >>> [mamba_group_block_size(m, 1, 16, 2, 2, True, mode, 256, 8192) for mode in ("none", "align", "all")]
        [8192, 400, 512]
    """
    if mamba_cache_mode == "none":
        return max_model_len
    if mamba_cache_mode == "align":
        return hybrid_block_size(model, tp, block_size, kv_dtype_bytes, ssm_dtype_bytes, align_to_block_size)
    return _raised_block(model, tp, block_size, kv_dtype_bytes, ssm_dtype_bytes, align_to_block_size, chunk_size)


def _normalize_granite_ffn(flat: dict[str, Any]) -> None:
    """Granite-4.0's FFN under the profile's names (in place): ``GraniteMoeSharedMLP`` of
    ``shared_intermediate_size`` in every layer, beside ``num_local_experts`` routed experts of ``intermediate_size``."""
    shared = int(flat.get("shared_intermediate_size") or 0)
    if flat.get("num_local_experts"):
        flat["moe_intermediate_size"] = flat.get("intermediate_size")
        flat["shared_expert_intermediate_size"] = shared
    else:
        flat["intermediate_size"] = shared or flat.get("intermediate_size")


def _normalize_hybrid(flat: dict[str, Any], source: str) -> None:
    """A Mamba2 hybrid's FFN and attention sizes under the names the profile reads (in place).

    Granite-4.0-H: every layer holds ``GraniteMoeSharedMLP`` (gate-up ``2 x shared_intermediate_size``,
    down) and, with ``num_local_experts``, the routed experts of ``intermediate_size`` each
    (``granitemoehybrid.py``, the decoder layers' ``block_sparse_moe`` / ``shared_mlp``); head_dim is
    ``hidden_size // num_attention_heads`` (``GraniteMoeHybridAttention``). Nemotron-H: ``head_dim`` (or
    ``attention_head_dim``), one ``intermediate_size`` for every ``-`` layer (a per-layer list is refused), and
    its ``E`` layers' shared expert (:func:`nemotron_moe_fields`).
    """
    kinds = flat["layer_types"]
    flat["num_hidden_layers"] = len(kinds)
    model_type = str(flat.get("model_type")).lower()
    if model_type in _GDN_TYPES:
        return  # head_dim, num_experts, moe_intermediate_size and shared_expert_intermediate_size are its own names
    if model_type == "bamba":
        flat["head_dim"] = int(flat["hidden_size"]) // int(flat["num_attention_heads"])  # BambaAttentionDecoderLayer
        return
    if model_type == "falcon_h1":
        flat["head_dim"] = flat.get("head_dim") or int(flat["hidden_size"]) // int(flat["num_attention_heads"])
        return
    if model_type == "granitemoehybrid":
        flat["head_dim"] = int(flat["hidden_size"]) // int(flat["num_attention_heads"])
        _normalize_granite_ffn(flat)
        return
    flat["head_dim"] = flat.get("head_dim") or flat.get("attention_head_dim")
    if _MOE in kinds:
        flat.update(nemotron_moe_fields(flat))
    inter = flat.get("intermediate_size")
    if isinstance(inter, (list, tuple)):
        if len(set(inter)) != 1:
            raise SpecError(f"{source}: intermediate_size", "a per-layer list of MLP sizes is not modelled by the "
                            "planner", "plan a Nemotron-H config with one intermediate_size")
        flat["intermediate_size"] = inter[0]


def nemotron_moe_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`~servetune.planner.modelinfo.ModelProfile` fields of Nemotron-H's ``E`` layers (``NemotronHMoE``).

    Read in ``models/nemotron_h.py`` of 0.11.1 (the first release with the class, 0.11.0 has none: lines 121-242),
    0.26.0 (125-257) and 0.28.0 (126-252):

    - routed experts: ``FusedMoE(num_experts=n_routed_experts, top_k=num_experts_per_tok, intermediate_size=
      moe_intermediate_size, activation=activation_without_mul(mlp_hidden_act))``, non-gated (``is_act_and_mul=False``
      at line 198 of 0.11.1; ``is_non_gated_moe``, line 712 of 0.26.0, 708 of 0.28.0): each expert holds ``up`` and ``down`` only
      (``w13`` of ``intermediate`` rows, not ``2 x intermediate``: ``unquantized_fused_moe_method.py`` lines 97-100
      of 0.26.0), which ``ffn_gated`` False already says for the dense ``-`` MLP;
    - shared experts: one ``NemotronHMLP`` (up, relu2, down) of ``moe_shared_expert_intermediate_size x
      n_shared_experts`` (lines 166-180 of 0.11.1, 173-188 of 0.26.0, 168-183 of 0.28.0);
    - the router: a replicated ``hidden x n_routed_experts`` gate, never quantized, its weight in fp32 (``ReplicatedLinear
      (params_dtype=torch.float32)``, lines 141-148 of 0.11.1; ``router_logits_dtype`` float32 in 0.13-0.16); from 0.17
      ``GateLinear(force_fp32_compute=True)`` keeps it in the model dtype on Hopper and Blackwell and in fp32 elsewhere
      (nemotron_h.py lines 149-155 of 0.26.0 and 0.28.0; ``router/gate_linear.py`` lines 38-48 of 0.17.0, 59-68 of
      0.26.0 and 0.28.0; the GPU's part is :func:`~servetune.planner.modelclass.as_loaded_on`'s); plus the fp32
      ``e_score_correction_bias`` per expert (lines 150-152 of 0.11.1, 157-159 of 0.26.0 and 0.28.0);
    - latent MoE (``moe_latent_size``, from 0.13): the experts run in the latent width behind two replicated,
      quantizable projections ``hidden -> latent`` and ``latent -> hidden`` (``fc1_latent_proj`` / ``fc2_latent_proj``,
      lines 190-209 of 0.26.0, 185-204 of 0.28.0; absent from 0.11.1 and 0.12.0), so the experts' and their workspace's hidden size is the latent one.

    Example:
        >>> f = nemotron_moe_fields({"moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1})
        >>> f["shared_expert_intermediate_size"], f["router_fp32"], f["moe_latent_size"]
        (3712, True, 0)
    """
    shared = int(cfg.get("moe_shared_expert_intermediate_size") or 0) * int(cfg.get("n_shared_experts") or 0)
    return {"shared_expert_intermediate_size": shared, "router_fp32": True, "router_score_bias": True,
            "moe_latent_size": int(cfg.get("moe_latent_size") or 0)}


def _hybrid_note(model: Any) -> str:
    """What ``plan`` says about a Mamba2 / gated-delta-net hybrid (``model.is_hybrid``): how it is modelled and
    what it was checked on (one of :func:`~servetune.planner.modelclass.class_notes`)."""
    mamba = model.layer_types.count(_MAMBA) + model.layer_types.count(_PARALLEL)
    kind = "gated-delta-net" if model.mamba_kind == "gdn" else "Mamba2"
    return (f"Mamba2 hybrid: {mamba} of {len(model.layer_types)} layers keep one {kind} recurrent state per "
            "request, paged beside the attention KV as vLLM pads it (attention block raised to hold one "
            "state); derived from vLLM's source, checked held out on real H100 starts and on published "
            "starts (benchmarks/results/published_logs_hybrid.json). Not modelled: the Mamba "
            "layers' share of the profile run's activation peak and of the CUDA-graph pools (the simulator "
            "prices the Mamba layers from vLLM's kernels, judged on two H100 windows only)"
            + (f"; its {model.layer_types.count(_MOE)} MoE layers (non-gated experts, the router in fp32 off Hopper and "
               "Blackwell) are read from vLLM's NemotronHMoE and no published bf16 or fp8 start of one was found to "
               "judge them" if _MOE in model.layer_types else ""))
