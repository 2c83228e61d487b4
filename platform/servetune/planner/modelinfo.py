"""A model's shape, read from its Hugging Face ``config.json``, and the sizes vLLM derives from it.

:class:`ModelProfile` holds the numbers the memory planner and the simulator need (layers, hidden
size, heads, KV heads, head dim, vocab, MoE, dtype, quantization) and derives, the way vLLM shards
the model: the parameter count, the weight bytes on the most loaded GPU under tensor / pipeline
parallelism, the pipeline-stage split (vLLM's ``get_pp_indices``) and the KV-cache bytes per token.

:func:`load_model` accepts a shipped name (``llama-3.1-8b``, see :func:`known_models`), a model
directory, a ``config.json`` path, or a Hugging Face id already in the local HF cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``). It never downloads.
Only ``config.json`` is read: no weights, no tokenizer. A config missing a needed key raises
:class:`~servetune.errors.SpecError` naming the key and the file.

Example:
    >>> m = load_model("servetune-test-850m")
    >>> round(m.param_count / 1e6, 1), m.kv_bytes_per_token(tp=1, pp=1)
    (852.6, 32768)
    >>> m.stage_layers(3), m.kv_heads_per_gpu(16)
    ([5, 6, 5], 1)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servetune.errors import SpecError, did_you_mean
from servetune.inputs import MAX_JSON_INT, finite, read_json_file, shown
from servetune.planner import _moe_experts, _vision_towers, modelclass

__all__ = ["ModelProfile", "load_model", "known_models", "profile_from_config", "hf_cache_dir", "local_experts"]

_DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "models"

#: Bytes per element of the dtypes a config may name (vLLM serves float32 checkpoints in bf16,
#: see :func:`profile_from_config`).
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32",
                  "fp32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16",
                  "torch.float32": "float32"}

#: vLLM pads the vocab-parallel embedding and LM head to a multiple of 64 rows
#: (``DEFAULT_VOCAB_PADDING_SIZE`` in ``vocab_parallel_embedding.py``).
_VOCAB_PADDING = 64

#: Hugging Face ids of the shipped configs, so ``load_model("meta-llama/Llama-3.1-8B-Instruct")``
#: works without the HF cache.
_HF_ALIASES = {
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "mistralai/mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mistralai/mistral-small-24b-instruct-2501": "mistral-small-24b",
    "mistralai/mistral-small-24b-base-2501": "mistral-small-24b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
    "openai/gpt-oss-20b": "gpt-oss-20b",
    "openai/gpt-oss-120b": "gpt-oss-120b",
    "google/gemma-3-27b-it": "gemma-3-27b",
    "google/gemma-2-27b-it": "gemma-2-27b",
    "deepseek-ai/deepseek-v2-lite-chat": "deepseek-v2-lite",
    "deepseek-ai/deepseek-v2-lite": "deepseek-v2-lite",
    "ibm-granite/granite-4.0-h-tiny": "granite-4.0-h-tiny",
    "qwen/qwen3-next-80b-a3b-instruct": "qwen3-next-80b-a3b",
    "qwen/qwen3-next-80b-a3b-thinking": "qwen3-next-80b-a3b",
    "nvidia/nvidia-nemotron-3-nano-30b-a3b-bf16": "nemotron-3-nano-30b-a3b",
    "qwen/qwen3-32b": "qwen3-32b",
    "qwen/qwen3-8b": "qwen3-8b",
    "meta-llama/llama-3.3-70b-instruct": "llama-3.3-70b",
    "deepseek-ai/deepseek-r1": "deepseek-r1",
}


def local_experts(num_experts: int, ep_size: int, ep_rank: int = 0) -> int:
    """The routed experts one rank holds under expert parallelism: vLLM's ``determine_expert_map`` (the default
    "linear" placement) gives every rank ``num_experts // ep_size`` and one more to each of the first
    ``num_experts % ep_size`` ranks (``model_executor/layers/fused_moe/layer.py:786-824@0.11.0``,
    ``fused_moe/expert_map_manager.py:22-69@0.26.0``), so rank 0 holds the most. ``ep_size`` 1: every expert.

    Example:
        >>> local_experts(128, 4), local_experts(60, 8), local_experts(60, 8, ep_rank=7), local_experts(8, 1)
        (32, 8, 7, 8)
    """
    if ep_size <= 1:
        return num_experts
    base, remainder = divmod(num_experts, ep_size)
    return base + 1 if ep_rank < remainder else base


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """The shape of a decoder-only transformer, as vLLM sees it.

    Sizes are whole-model values; the ``*_per_gpu`` methods shard them. The trailing fields after
    ``moe_intermediate_size`` are servetune additions (defaults keep the shared contract intact).

    Example:
        >>> m = load_model("llama-3.1-8b")
        >>> round(m.param_count / 1e9, 2), m.weight_bytes_per_gpu(tp=2, pp=1) < m.weight_bytes_per_gpu(1, 1)
        (8.03, True)
    """

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: str  # "bfloat16" | "float16" | "float32"
    quantization: str | None  # e.g. "fp8", "awq"; None for plain weights
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # --- servetune additions ---
    shared_expert_intermediate_size: int = 0  # Qwen-MoE style always-on expert (0: none)
    qkv_bias: bool = False  # Qwen2 and ``attention_bias: true`` models
    quant_bytes_per_param: float = 0.0  # bytes of a quantized linear weight element (0: unquantized)
    derived_max_model_len: int = 0  # vLLM's derived max_model_len (rope scaling applied); 0: max_position_embeddings
    source: str = ""  # the config.json the profile came from
    # --- model classes (servetune.planner.modelclass) ---
    layer_types: tuple[str, ...] = ()  # "full" / "sliding" per layer; () when every layer is full attention
    sliding_window: int = 0  # tokens a sliding layer attends to (0: none)
    vision_params: int = 0  # a vision tower's parameters, loaded on the first stage in the model dtype
    vision_encoder: _vision_towers.Qwen3VLEncoder | None = None  # a Qwen3-VL-style tower's shape (its profile pass)
    first_k_dense_replace: int = 0  # leading dense layers of a MoE model (DeepSeek), intermediate_size wide
    quantized_experts_only: bool = False  # MXFP4 (gpt-oss): only the experts quantized, the rest in dtype
    extra_rotary_positions: int = 0  # a second rotary table (gemma-3's local layers)
    mla_kv_lora_rank: int = 0  # MLA latent rank (0: not MLA)
    mla_rope_dim: int = 0
    mla_nope_dim: int = 0
    mla_v_dim: int = 0
    mla_q_lora_rank: int = 0
    quant_block_k: int = 0  # block-quantized fp8 (``weight_block_size``): the block's input width (0: none)
    quant_zero_point_group: int = 0  # AWQ's packed 4-bit zero points: the group size (0: no zero points)
    # --- Mamba2 hybrids (hybrid.hybrid_kinds: layer_types holds "mamba" / "full" / "mlp") ---
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_d_state: int = 0
    mamba_groups: int = 0
    mamba_d_conv: int = 0
    mamba_inner: int = 0  # the mixer's intermediate size (granite: mamba_expand x hidden; Nemotron-H: heads x head_dim)
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_ssm_dtype: str = ""  # the config's mamba_ssm_cache_dtype (Nemotron-H), "" when it names none
    no_rope: bool = False  # attention without a rotary table (NoPE: granite-4.0-h, Nemotron-H)
    ffn_gated: bool = True  # False: a two-matrix MLP (Nemotron-H's up / relu2 / down)
    mamba_kind: str = "mamba2"  # "gdn": Qwen3-Next's gated delta net (the mamba_* fields hold its state in Mamba2 terms)
    attn_output_gate: bool = False  # Qwen3-Next's gated attention: q_proj twice as wide
    rotary_dim: int = 0  # the rotary table's width where it is not head_dim (partial_rotary_factor); 0: head_dim
    mamba_norm_weight: bool = True  # MambaMixer2's gated-norm weight (Falcon-H1: only with mamba_rms_norm)
    mamba_mup_vector: bool = False  # Falcon-H1's mup_vector buffer beside each mixer
    # The Mamba2 SSD kernel's chunk (vLLM's ``ModelConfig.get_mamba_chunk_size``: ``mamba_chunk_size``, else
    # ``chunk_size``, else the config class's default; 0: unknown): prefix caching's 'all' mode aligns blocks to
    # it, the simulator's chunked scan runs on it; a gated delta net's is FLA's fixed 64 (hybrid._mamba_fields).
    mamba_chunk_size: int = 0
    # --- Nemotron-H MoE layers (hybrid.nemotron_moe_fields) ---
    router_fp32: bool = False  # the router's weight held in fp32 (Nemotron-H; modelclass.as_loaded_on clears it per GPU)
    router_score_bias: bool = False  # an fp32 ``e_score_correction_bias`` per routed expert beside the router
    moe_latent_size: int = 0  # latent MoE: the experts' hidden width behind two replicated projections (0: hidden)
    # Qwen2-MoE's shared_expert_gate (hidden x 1) beside the shared expert; DeepSeek's and GLM-4.5's have none
    # (_moe_experts._moe_fields sets it from the config's naming)
    shared_expert_gate: bool = True

    # ----------------------------------------------------------------- sizes
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_hybrid(self) -> bool:
        """A Mamba2 / attention hybrid (vLLM's ``ModelConfig.is_hybrid``): some layer is a Mamba layer."""
        return "mamba" in self.layer_types or "parallel" in self.layer_types

    @property
    def judgement_class(self) -> str:
        """The group of models the simulator's published judgement counts this one in (``data/published_judgement.json``,
        :func:`servetune.planner.gpus.published_judgement`): ``dense`` for a plain dense transformer in 16-bit
        weights with full attention on every layer, ``model classes`` for the rest (MoE, quantized, sliding-window
        or hybrid layers, MLA, a vision tower), whose step times rest on rules of their own.

        Example:
            >>> load_model("llama-3.1-8b").judgement_class, load_model("qwen3-30b-a3b").judgement_class
            ('dense', 'model classes')
        """
        plain = (not self.is_moe and not self.quantization and not self.layer_types and not self.mla_kv_lora_rank
                 and not self.vision_params)
        return "dense" if plain else "model classes"

    def _hybrid_layer_elems(self, kind: str, tp: int = 1, active_only: bool = False,
                            moe_tp: int = 0, moe_ep: int = 1) -> tuple[int, int, int]:
        """``(linear, plain, fp32)`` elements of one hybrid layer on one TP rank, as vLLM builds it (routed experts
        split over ``moe_tp`` ranks, ``tp`` when 0, and whole over ``moe_ep`` ranks: :meth:`_expert_params`).

        A Mamba layer's ``MambaMixer2`` (``layers/mamba/mamba_mixer2.py`` of 0.26.0, lines 313-480): ``in_proj``
        ``hidden -> inner + conv_dim + heads`` and ``out_proj`` ``inner -> hidden`` (quantizable), ``conv1d``
        ``conv_dim x d_conv`` (+ bias; ``quant_config=None``), ``D`` and ``dt_bias`` per head, the gated norm
        (``inner``), ``A`` per head in fp32; ``conv_dim = inner + 2 x groups x d_state``, the groups widened to
        ``tp`` where they do not divide it. An attention layer: q, k, v, o. Granite-4.0-H layers also hold the
        routed experts and router (with ``num_local_experts``) and the shared MLP, two RMSNorms; Nemotron-H
        layers hold one mixer, one MLP (``-``: up, down) or one MoE (``E``: two-matrix routed and shared experts, the
        router, in fp32 where ``router_fp32``, its fp32 score-correction bias, a latent MoE's two replicated
        projections; :func:`~servetune.planner.hybrid.nemotron_moe_fields`) and one RMSNorm; Bamba's a mixer or attention, a gated
        MLP and two RMSNorms; Falcon-H1's (``"parallel"``) attention and a mixer side by side (its gated-norm weight
        only with ``mamba_rms_norm``, plus the ``mup_vector`` buffer), a gated MLP and two RMSNorms. Rotary tables
        are counted by :meth:`stage_weight_bytes`.
        """
        h = self.hidden_size
        every_layer_ffn = self.ffn_gated  # granite: mixer + FFN in every layer; Nemotron-H: one or the other
        plain, fp32 = (2 if every_layer_ffn else 1) * h, 0
        linear = 0
        if kind == "mamba" and self.mamba_kind == "gdn":
            # QwenGatedDeltaNetAttention (layers/mamba/gdn/qwen_gdn_linear_attn.py of 0.26.0, lines 389-475):
            # in_proj_qkvz (2 key_dim + 2 value_dim), in_proj_ba (2 v_heads), conv1d without bias, dt_bias,
            # A_log (fp32), RMSNormGated(head_v_dim), out_proj
            conv_dim = self.mamba_conv_dim(tp)
            linear += h * self.mamba_in_proj_width(tp) // tp + self.mamba_inner // tp * h
            plain += conv_dim // tp * self.mamba_d_conv + self.mamba_heads // tp + self.mamba_head_dim
            fp32 += self.mamba_heads // tp
        elif kind in ("mamba", "parallel"):
            groups, conv_dim = self.mamba_groups_on(tp), self.mamba_conv_dim(tp)
            proj_out = self.mamba_in_proj_width(tp)
            linear += h * proj_out // tp + self.mamba_inner // tp * h
            plain += conv_dim // tp * (self.mamba_d_conv + (1 if self.mamba_conv_bias else 0))
            plain += 2 * (self.mamba_heads // tp) + (self.mamba_inner // tp if self.mamba_norm_weight else 0)
            plain += proj_out // tp + h if self.mamba_proj_bias else 0
            # Falcon-H1's mup_vector: (2 d_ssm + 2 G S + heads) / tp, G the mixer's (widened) groups
            plain += (2 * self.mamba_inner + 2 * groups * self.mamba_d_state + self.mamba_heads) // tp \
                if self.mamba_mup_vector else 0
            fp32 += self.mamba_heads // tp  # A
        if kind in ("full", "parallel"):
            linear += self._attention_params(tp) + (h * self.q_size // tp if self.attn_output_gate else 0)
            if self.qkv_bias:
                plain += self.q_size // tp + 2 * self.kv_heads_per_gpu(tp) * self.head_dim + h
            if self.mamba_kind == "gdn":
                plain += 2 * self.head_dim  # Qwen3NextAttention's q_norm, k_norm
        matrices = 3 if self.ffn_gated else 2
        if (every_layer_ffn and self.is_moe) or kind == "moe":
            linear += self._expert_params(moe_tp or tp, active_only, moe_ep) \
                + matrices * h * self.shared_expert_intermediate_size // tp
            linear += 2 * h * self.moe_latent_size  # latent MoE's fc1 / fc2 projections (replicated)
            router = h * self.num_experts  # replicated
            plain += 0 if self.router_fp32 else router
            fp32 += (router if self.router_fp32 else 0) + (self.num_experts if self.router_score_bias else 0)
            if self.mamba_kind == "gdn" and self.shared_expert_intermediate_size:
                plain += h  # Qwen3-Next's shared_expert_gate (granite's shared MLP has none)
        elif every_layer_ffn or kind == "mlp":
            linear += matrices * h * self.intermediate_size // tp
        return linear, plain, fp32

    def mamba_in_proj_width(self, tp: int = 1) -> int:
        """The output width of one Mamba mixer's ``in_proj`` over all TP ranks (each rank holds ``1 / tp``).

        ``MambaMixer2`` (``layers/mamba/mamba_mixer2.py`` of 0.26.0, lines 313-480): ``inner`` (the gate z)
        ``+ conv_dim`` (x, B, C) ``+ heads`` (dt), ``conv_dim = inner + 2 x groups x d_state`` with the groups
        widened to ``tp`` where they do not divide it; a gated delta net's ``in_proj_qkvz`` and ``in_proj_ba``
        (``qwen_gdn_linear_attn.py`` of 0.26.0, lines 389-475): ``2 key_dim + 2 value_dim + 2 v_heads``. The one
        figure the weights (:meth:`_hybrid_layer_elems`) and the simulator's GEMMs read.

        Example:
            >>> load_model("granite-4.0-h-tiny").mamba_in_proj_width()   # 3072 + 3328 + 48
            6448
        """
        if self.mamba_kind == "gdn":
            return self.mamba_conv_dim(tp) + self.mamba_inner + 2 * self.mamba_heads
        return self.mamba_inner + self.mamba_conv_dim(tp) + self.mamba_heads

    def mamba_groups_on(self, tp: int = 1) -> int:
        """The Mamba2 groups as vLLM shards them over ``tp`` ranks: widened to ``tp`` where they do not divide
        it (``MambaMixer2``, ``extra_groups_for_head_shards``, ``layers/mamba/mamba_utils.py`` of 0.26.0); a gated
        delta net's are divided outright (``tensor_parallel_size`` must divide them: ``engine_config``).

        Example:
            >>> m = load_model("granite-4.0-h-tiny")   # one group
            >>> m.mamba_groups_on(1), m.mamba_groups_on(2)
            (1, 2)
        """
        if self.mamba_kind == "gdn" or self.mamba_groups % tp == 0:
            return self.mamba_groups
        return tp

    def mamba_conv_dim(self, tp: int = 1) -> int:
        """The mixer's conv channels over all TP ranks, ``inner + 2 x groups x d_state`` with the groups as
        :meth:`mamba_groups_on` shards them (x, B and C; a gated delta net's q, k and v); each rank holds
        ``1 / tp``. The one figure the weights, the state (:func:`~servetune.planner.hybrid.mamba_state_bytes`)
        and the simulator's mixer traffic read.

        Example:
            >>> load_model("granite-4.0-h-tiny").mamba_conv_dim()   # 3072 + 2 x 1 x 128
            3328
        """
        return self.mamba_inner + 2 * self.mamba_groups_on(tp) * self.mamba_d_state

    def _hybrid_layer_bytes(self, kind: str, tp: int, moe_tp: int = 0, moe_ep: int = 1) -> float:
        linear, plain, fp32 = self._hybrid_layer_elems(kind, tp, moe_tp=moe_tp, moe_ep=moe_ep)
        return linear * self.weight_bytes_per_param + plain * self.dtype_bytes + 4 * fp32

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one activation / unquantized weight element."""
        return _DTYPE_BYTES[self.dtype]

    @property
    def weight_bytes_per_param(self) -> float:
        """Bytes per element of the linear-layer weights (quantized where the checkpoint is).

        Embeddings, the LM head and the norms stay in :attr:`dtype` (vLLM does not quantize them).
        """
        return self.quant_bytes_per_param or float(self.dtype_bytes)

    @property
    def max_model_len_limit(self) -> int:
        """The longest ``max_model_len`` vLLM accepts without ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``."""
        return self.derived_max_model_len or self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def _attention_params(self, tp: int = 1) -> int:
        """Attention weight elements of one layer on one TP rank (MLA: its projections, see modelclass)."""
        if self.mla_kv_lora_rank:
            heads = self.num_attention_heads // tp
            qk = self.mla_nope_dim + self.mla_rope_dim
            q = (self.hidden_size * self.mla_q_lora_rank + self.mla_q_lora_rank * heads * qk
                 if self.mla_q_lora_rank else self.hidden_size * heads * qk)
            kv_a = self.hidden_size * (self.mla_kv_lora_rank + self.mla_rope_dim)  # replicated
            kv_b = self.mla_kv_lora_rank * heads * (self.mla_nope_dim + self.mla_v_dim)
            return q + kv_a + kv_b + heads * self.mla_v_dim * self.hidden_size
        kv_heads = self.kv_heads_per_gpu(tp)
        q = self.q_size // tp
        return self.hidden_size * (2 * q + 2 * kv_heads * self.head_dim)  # q, o  +  k, v

    @property
    def expert_hidden_size(self) -> int:
        """The routed experts' hidden width: ``moe_latent_size`` for a latent MoE, else ``hidden_size``."""
        return self.moe_latent_size or self.hidden_size

    def _expert_params(self, tp: int = 1, active_only: bool = False, ep: int = 1) -> int:
        """Routed-expert weight elements of one MoE layer on one TP rank (0 for a dense model): gate, up and down
        per expert, or up and down where the FFN is not gated (``ffn_gated`` False: Nemotron-H's relu2 experts).
        ``tp`` is the split of each expert's width, which under data parallelism is ``tp x dp``
        (:meth:`stage_weight_bytes`); ``ep`` > 1 (expert parallelism, ``tp`` 1) holds :func:`local_experts` whole
        experts, rank 0's."""
        if not self.is_moe:
            return 0
        experts = self.num_experts_per_tok if active_only else local_experts(self.num_experts, ep)
        matrices = 3 if self.ffn_gated else 2
        return experts * matrices * self.expert_hidden_size * self.expert_intermediate_size // tp

    def _layer_linear_params(self, tp: int = 1, active_only: bool = False, dense: bool = False,
                             moe_tp: int = 0, moe_ep: int = 1) -> int:
        """Linear-layer weight elements of one decoder layer on one TP rank (``dense``: a MoE model's dense layer;
        routed experts split over ``moe_tp`` ranks, ``tp`` when 0, and whole over ``moe_ep`` ranks)."""
        attn = self._attention_params(tp)
        if self.is_moe and not dense:
            mlp = self._expert_params(moe_tp or tp, active_only, moe_ep)
            mlp += 3 * self.hidden_size * self.shared_expert_intermediate_size // tp
        else:
            mlp = 3 * self.hidden_size * self.intermediate_size // tp  # gate, up, down
        return attn + mlp

    def _layer_plain_params(self, tp: int = 1, dense: bool = False) -> int:
        """Unquantized elements of one decoder layer on one TP rank: norms, router, biases."""
        n = 2 * self.hidden_size  # input_layernorm + post_attention_layernorm (replicated)
        if self.mla_kv_lora_rank:
            n += self.mla_kv_lora_rank + self.mla_q_lora_rank  # kv_a_layernorm (+ q_a_layernorm)
        if self.is_moe and not dense:
            n += self.hidden_size * self.num_experts  # router gate (replicated)
            n += self.num_experts if self.router_score_bias else 0  # its e_score_correction_bias
            if self.shared_expert_intermediate_size and self.shared_expert_gate:
                n += self.hidden_size  # shared-expert gate
        if self.qkv_bias:
            n += self.q_size // tp + 2 * self.kv_heads_per_gpu(tp) * self.head_dim
        return n

    def _vocab_rows(self, tp: int) -> int:
        padded = math.ceil(self.vocab_size / _VOCAB_PADDING) * _VOCAB_PADDING
        return math.ceil(padded / tp)

    def _dense_layers(self) -> int:
        """Layers with a dense MLP in a MoE model (DeepSeek's ``first_k_dense_replace``); all for a dense model."""
        return min(self.first_k_dense_replace, self.num_layers) if self.is_moe else self.num_layers

    def _all_layer_params(self, active_only: bool = False) -> int:
        if self.is_hybrid:
            return sum(sum(self._hybrid_layer_elems(k, 1, active_only)) for k in self.layer_types)
        dense = self._dense_layers()
        d = self._layer_linear_params(dense=True) + self._layer_plain_params(dense=True)
        m = self._layer_linear_params(active_only=active_only) + self._layer_plain_params()
        return dense * d + (self.num_layers - dense) * m

    @property
    def param_count(self) -> int:
        """Total parameters (tied embeddings counted once), unpadded, as ``sum(p.numel())`` reports."""
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        return embed + lm_head + self._all_layer_params() + self.hidden_size + self.vision_params  # + final norm

    @property
    def active_param_count(self) -> int:
        """Parameters touched per token: for MoE only the top-k experts (router included)."""
        if not self.is_moe:
            return self.param_count
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        return embed + lm_head + self._all_layer_params(active_only=True) + self.hidden_size

    # ------------------------------------------------------------ sharding
    def stage_layers(self, pp: int) -> list[int]:
        """Decoder layers per pipeline stage, split exactly as vLLM's ``get_pp_indices``.

        Each stage gets ``L // pp``; the remainder goes one layer each to stages ``[-2], [-3], ...``
        (never the last stage, which also runs the LM head and the sampler).

        Example:
            >>> load_model("servetune-test-850m").stage_layers(5)   # 16 = 3*5 + 1
            [3, 3, 3, 4, 3]
        """
        if pp < 1:
            raise SpecError("pipeline_parallel_size", f"must be >= 1, got {pp}", "use 1 or more stages")
        if pp > self.num_layers:
            raise SpecError("pipeline_parallel_size",
                            f"{pp} stages for {self.num_layers} layers leaves a stage without layers",
                            f"use pipeline_parallel_size <= {self.num_layers}")
        partitions = [self.num_layers // pp] * pp
        for i in range(2, self.num_layers % pp + 2):
            partitions[-i] += 1
        return partitions

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads on each TP rank: ``max(1, kv_heads // tp)`` (replicated when TP > KV heads)."""
        return max(1, self.num_kv_heads // tp)

    def stage_weight_bytes(self, tp: int, pp: int, mxfp4_scale_copies: int = 2, dp: int = 1,
                           expert_parallel: bool = False) -> list[int]:
        """Weight bytes on one TP rank of each pipeline stage (of one data-parallel replica).

        Sharded matrices and the vocab-parallel embedding / LM head are divided by ``tp``; norms and
        the MoE router are replicated. Under data parallelism (``dp`` replicas, no expert parallelism) a MoE
        layer's routed experts are split over ``tp x dp`` ranks (``FusedMoEParallelConfig.make`` with
        ``flatten_tp_across_dp``: vllm/model_executor/layers/fused_moe/config.py:882-998@0.14.1,
        ``flatten_tp_across_dp_and_pcp`` at :1113-1215@0.26.0, the same rule with a context-parallel size of 1);
        everything else, shared experts included, is one replica's ``tp`` shard, so a dense model's
        weights do not change with ``dp``. The first stage holds the embedding, the last the final norm
        and the LM head (a tied LM head is a second copy there when ``pp > 1``, as in vLLM). Every
        stage also holds the rotary ``cos_sin_cache`` buffer (``max_position * head_dim`` in the
        model dtype), which vLLM's "Model loading took" figure includes: with it Llama-3.1-8B comes
        to the 14.99 GiB that vLLM reports for it, without it 14.96.

        ``expert_parallel`` (``--enable-expert-parallel``): the routed experts are not sliced but split whole over
        the ``tp x dp`` ranks (``ep_size``, ``FusedMoEParallelConfig.make``: config.py:703-731@0.11.0,
        :1204-1250@0.26.0), rank 0 holding :func:`local_experts` of them at their full width; attention, shared
        experts, the router and everything else stay one replica's ``tp`` shard.
        """
        layers = self.stage_layers(pp)
        act = self.dtype_bytes
        moe_tp, moe_ep = tp * max(1, dp), 1
        if expert_parallel and self.is_moe and moe_tp > 1:
            moe_tp, moe_ep = 1, moe_tp
        layer_bytes = [self._layer_bytes(tp, dense=True),
                       self._layer_bytes(tp, scale_copies=mxfp4_scale_copies, moe_tp=moe_tp, moe_ep=moe_ep)]
        vocab = self._vocab_rows(tp) * self.hidden_size * act
        rotary_dim = self.mla_rope_dim or self.rotary_dim or self.head_dim
        rotary = 0 if self.no_rope else (self.max_model_len_limit + self.extra_rotary_positions) * rotary_dim * act
        out: list[int] = []
        first = 0
        for stage, n in enumerate(layers):
            dense = max(0, min(self._dense_layers() - first, n))
            if self.is_hybrid:
                b = sum(self._hybrid_layer_bytes(k, tp, moe_tp, moe_ep) for k in self.layer_types[first:first + n]) \
                    + rotary
            else:
                b = dense * layer_bytes[0] + (n - dense) * layer_bytes[1] + rotary
            first += n
            if stage == 0:
                b += vocab + -(-self.vision_params // tp) * act
            if stage == pp - 1:
                b += self.hidden_size * act  # final norm
                if not self.tie_word_embeddings or pp > 1:
                    b += vocab
            out.append(int(b))
        return out

    def _layer_bytes(self, tp: int, dense: bool = False, scale_copies: int = 2, moe_tp: int = 0,
                     moe_ep: int = 1) -> float:
        """Bytes of one decoder layer on one TP rank as vLLM loads it (see :mod:`modelclass` for MLA, MXFP4;
        routed experts split over ``moe_tp`` ranks, ``tp`` when 0, and whole over ``moe_ep`` ranks)."""
        act = self.dtype_bytes
        moe_tp = moe_tp or tp
        plain = self._layer_plain_params(tp, dense) * act
        linear = self._layer_linear_params(tp, dense=dense, moe_tp=moe_tp, moe_ep=moe_ep)
        if self.quantized_experts_only and self.is_moe and not dense:
            return (plain + (linear - self._expert_params(moe_tp, ep=moe_ep)) * act
                    + _moe_experts.mxfp4_expert_bytes(self, moe_tp, scale_copies,
                                                    experts=local_experts(self.num_experts, moe_ep)))
        b = plain + linear * self.weight_bytes_per_param
        if self.is_moe and not dense:  # fp32 router weight (GLM-4.5) and score-correction bias: 4 bytes, not act
            b += (4 - act) * ((self.hidden_size * self.num_experts if self.router_fp32 else 0)
                              + (self.num_experts if self.router_score_bias else 0))
        if self.mla_kv_lora_rank:
            # vLLM's MLA keeps W_UK_T and W_UV, the absorbed halves of kv_b_proj, beside it (model dtype)
            b += self.mla_kv_lora_rank * (self.num_attention_heads // tp) * (self.mla_nope_dim + self.mla_v_dim) * act
        return b

    def weight_bytes_per_gpu(self, tp: int, pp: int, dp: int = 1, expert_parallel: bool = False) -> int:
        """Weight bytes on the most loaded GPU (vLLM's "Model loading took ... GiB" on that rank; ``dp`` and
        ``expert_parallel``: :meth:`stage_weight_bytes`)."""
        return max(self.stage_weight_bytes(tp, pp, dp=dp, expert_parallel=expert_parallel))

    def kv_bytes_per_token(self, tp: int, pp: int, kv_cache_dtype: str = "auto") -> int:
        """KV-cache bytes one token takes on one GPU of the stage with the most layers.

        ``2 (K and V) * kv_heads_per_gpu * head_dim * dtype_bytes * layers_on_stage``; fp8 KV
        dtypes take 1 byte, ``auto`` the model dtype.

        Example:
            >>> load_model("llama-3.1-8b").kv_bytes_per_token(tp=2, pp=1)   # 64 KiB: 2 x kv_heads x head_dim x layers x 2 bytes
            65536
        """
        if self.mla_kv_lora_rank:  # one latent per token and layer, on every TP rank
            return ((self.mla_kv_lora_rank + self.mla_rope_dim) * self.kv_dtype_bytes(kv_cache_dtype)
                    * max(self.stage_layers(pp)))
        layers = max(self.stage_layers(pp))
        if self.is_hybrid:  # only the attention layers hold per-token KV (the Mamba state is per request)
            bounds = [0, *itertools.accumulate(self.stage_layers(pp))]
            layers = max(self.layer_types[a:b].count("full") + self.layer_types[a:b].count("parallel")
                         for a, b in zip(bounds, bounds[1:]))
        return 2 * self.kv_heads_per_gpu(tp) * self.head_dim * self.kv_dtype_bytes(kv_cache_dtype) * layers

    def kv_dtype_bytes(self, kv_cache_dtype: str = "auto") -> int:
        """Bytes of one KV-cache element for vLLM's ``--kv-cache-dtype``."""
        if kv_cache_dtype in ("auto", None):
            return self.dtype_bytes
        if kv_cache_dtype.startswith("fp8"):
            return 1
        if kv_cache_dtype in ("bfloat16", "float16", "half"):
            return 2
        if kv_cache_dtype == "float32":
            return 4
        raise SpecError("kv_cache_dtype", f"unknown KV cache dtype {kv_cache_dtype!r}",
                        "use auto, bfloat16, float16, fp8, fp8_e4m3 or fp8_e5m2")


# --------------------------------------------------------------------------- config parsing
def _get(cfg: Mapping[str, Any], keys: tuple[str, ...], source: str, *, required: bool = True) -> Any:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            return value
    if required:
        raise SpecError(f"{source}: {keys[0]}", f"config.json has no {' / '.join(repr(k) for k in keys)}",
                        "use a complete Hugging Face config.json for a decoder-only model")
    return None


def _as_int(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or int(value) != value or value <= 0 or value > MAX_JSON_INT:
        raise SpecError(f"{source}: {key}", f"expected a positive integer, got {shown(value)}",
                        "fix the config.json value")
    return int(value)


#: config.json counts the model-class rules (``modelclass``) read: each a whole number >= 0 where set.
_CLASS_COUNTS = ("first_k_dense_replace", "kv_lora_rank", "moe_intermediate_size", "n_shared_experts",
                 "num_local_experts", "n_routed_experts", "num_experts", "q_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "shared_expert_intermediate_size", "sliding_window", "sliding_window_pattern",
                 "v_head_dim", "num_experts_per_tok")


def _opt_count(cfg: Mapping[str, Any], keys: tuple[str, ...], source: str) -> int:
    """The first of ``keys`` that is set, as a count >= 0 (0 when none is set): MoE sizes, expert counts."""
    value = next((cfg[k] for k in keys if cfg.get(k)), 0)
    return 0 if value == 0 and not isinstance(value, bool) else _as_int(value, keys[0], source)


def _quantization(cfg: Mapping[str, Any], source: str) -> tuple[str | None, float]:
    """``(method, bytes per quantized linear weight)`` from ``quantization_config``.

    fp8-family: 1 byte. 4-bit integer formats (awq, gptq, compressed-tensors w4): half a byte plus
    the per-group fp16 scale and packed 4-bit zero point, ``(2 + 0.5) / group_size`` bytes per
    weight (vLLM's perf model uses a flat 0.5; the group overhead is what the checkpoint holds).
    """
    q = cfg.get("quantization_config")
    if not q:
        return None, 0.0
    if not isinstance(q, Mapping):
        raise SpecError(f"{source}: quantization_config", f"expected a mapping, got {shown(q)}", "fix config.json")
    method = str(q.get("quant_method") or q.get("quantization") or "").lower()
    if not method:
        raise SpecError(f"{source}: quantization_config.quant_method", "missing", "name the quantization method")
    if method in ("fp8", "fbgemm_fp8", "ptpc_fp8", "modelopt") and "fp4" not in str(q.get("quant_algo", "")).lower():
        return ("fp8" if method != "modelopt" else "modelopt"), 1.0
    if method in ("modelopt_fp4", "nvfp4") or "fp4" in str(q.get("quant_algo", "")).lower():
        return "nvfp4", 0.5 + 1.0 / 16  # fp4 + one fp8 scale per 16 elements
    if method == "mxfp4":
        return "mxfp4", 0.5 + 1.0 / 32  # fp4 + one e8m0 scale per 32 elements
    if method == "bitsandbytes":
        return method, 0.5 if q.get("load_in_4bit") else 1.0
    if method == "compressed-tensors":
        bits = 8
        for group in (q.get("config_groups") or {}).values():
            weights = (group or {}).get("weights") or {}
            bits = int(finite(weights.get("num_bits", bits), f"{source}: num_bits", minimum=1, integer=True))
        if bits >= 8:
            return method, bits / 8
        gs = 128
        return method, bits / 8 + (2 + bits / 8) / gs
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin", "marlin"):
        bits = int(finite(q.get("bits", q.get("w_bit", 4)), f"{source}: quantization_config.bits", minimum=1, integer=True))
        gs = int(finite(q.get("group_size", q.get("q_group_size", 128)) or 128, f"{source}: quantization_config.group_size",
                        integer=True))
        gs = gs if gs > 0 else 4096  # group_size -1: one group per column
        return method, bits / 8 + (2 + bits / 8) / gs
    raise SpecError(f"{source}: quantization_config.quant_method", f"unsupported method {shown(method)}",
                    "use fp8, awq, gptq, compressed-tensors, bitsandbytes, mxfp4 or nvfp4")


def _derived_max_len(cfg: Mapping[str, Any], max_pos: int) -> int:
    """vLLM's ``_get_and_verify_max_len``: rope scaling stretches the limit except for llama3/su/longrope."""
    rope = cfg.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        return max_pos
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type in (None, "default", "su", "longrope", "llama3", "mrope"):
        return max_pos
    factor = finite(rope.get("factor", 1.0), "config.json: rope_scaling.factor", minimum=0)
    if rope_type == "yarn":
        original = finite(rope.get("original_max_position_embeddings", max_pos),
                          "config.json: rope_scaling.original_max_position_embeddings", minimum=1)
        return int(min(original * factor, MAX_JSON_INT))
    return int(min(max_pos * factor, MAX_JSON_INT))


def profile_from_config(cfg: Mapping[str, Any], name: str, source: str = "config.json") -> ModelProfile:
    """A :class:`ModelProfile` from a parsed ``config.json`` (pure; :func:`load_model` does the I/O).

    Example:
        >>> p = profile_from_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        ...     "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        ...     "vocab_size": 100, "max_position_embeddings": 256}, "tiny")
        >>> p.head_dim, p.num_kv_heads, p.dtype
        (16, 4, 'bfloat16')
    """
    if not isinstance(cfg, Mapping):
        raise SpecError(source, f"expected a JSON object, got {type(cfg).__name__}", "use a Hugging Face config.json")
    for part in (cfg, cfg.get("text_config")):  # the counts the model-class rules read, checked first
        if isinstance(part, Mapping):
            for key in _CLASS_COUNTS:
                _opt_count(part, (key,), source)
    modelclass.refuse_unmodelled(cfg, source)
    cfg = modelclass.normalize_config(cfg, source)  # text_config (with its class defaults), layer types
    archs = cfg.get("architectures") or [str(cfg.get("model_type", "unknown"))]
    if not isinstance(archs, list) or not isinstance(archs[0], str):
        raise SpecError(f"{source}: architectures", f"expected a list of class names, got {shown(archs)}",
                        'e.g. "architectures": ["LlamaForCausalLM"]')
    architecture = str(archs[0])
    hidden = _as_int(_get(cfg, ("hidden_size", "n_embd", "d_model"), source), "hidden_size", source)
    layers = _as_int(_get(cfg, ("num_hidden_layers", "n_layer", "num_layers"), source), "num_hidden_layers", source)
    heads = _as_int(_get(cfg, ("num_attention_heads", "n_head"), source), "num_attention_heads", source)
    kv_heads = _as_int(_get(cfg, ("num_key_value_heads",), source, required=False) or heads,
                       "num_key_value_heads", source)
    head_dim_raw = cfg.get("head_dim")
    if head_dim_raw is None:
        if hidden % heads:
            raise SpecError(f"{source}: head_dim", f"absent and hidden_size {hidden} is not divisible by "
                            f"num_attention_heads {heads}", "add head_dim to config.json")
        head_dim = hidden // heads
    else:
        head_dim = _as_int(head_dim_raw, "head_dim", source)
    # A model whose every layer is MoE never builds a dense MLP, so vLLM never reads intermediate_size there
    # (modelclass.dense_ffn_unused): the config may leave it out
    raw_inter = _get(cfg, ("intermediate_size", "ffn_dim", "n_inner"), source,
                     required=not modelclass.dense_ffn_unused(cfg))
    intermediate = 0 if raw_inter is None else _as_int(raw_inter, "intermediate_size", source)
    vocab = _as_int(_get(cfg, ("vocab_size",), source), "vocab_size", source)
    max_pos = _as_int(_get(cfg, ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                                 "max_sequence_length", "model_max_length"), source),
                      "max_position_embeddings", source)
    raw_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower()
    dtype = _DTYPE_ALIASES.get(raw_dtype, raw_dtype)
    if dtype not in _DTYPE_BYTES:
        raise SpecError(f"{source}: torch_dtype", f"unsupported dtype {shown(raw_dtype)}",
                        "use bfloat16, float16 or float32")
    if dtype == "float32":
        # vLLM's dtype="auto" serves float32 checkpoints in bfloat16 on GPUs that support it.
        dtype = "bfloat16"
    num_experts = _opt_count(cfg, ("num_local_experts", "num_experts", "n_routed_experts"), source)
    top_k = _opt_count(cfg, ("num_experts_per_tok", "moe_topk"), source)
    if num_experts and not top_k:
        raise SpecError(f"{source}: num_experts_per_tok", "an MoE config needs num_experts_per_tok",
                        "add num_experts_per_tok to config.json")
    moe_inter = _opt_count(cfg, ("moe_intermediate_size",), source) if num_experts else 0
    classes = modelclass.class_fields(cfg)
    quant, quant_bytes = _quantization(cfg, source)
    block = (cfg.get("quantization_config") or {}).get("weight_block_size") if quant else None
    if isinstance(block, (list, tuple)) and len(block) == 2:
        classes["quant_block_k"] = int(block[1])
    awq = (cfg.get("quantization_config") or {}) if quant == "awq" else {}
    if awq and awq.get("zero_point", True) and int(awq.get("bits", awq.get("w_bit", 4)) or 4) == 4:
        classes["quant_zero_point_group"] = int(awq.get("group_size", awq.get("q_group_size", 128)) or 0)
    qkv_bias = (bool(cfg.get("attention_bias")) or architecture.startswith("Qwen2")) and not classes.get("mla_kv_lora_rank")
    return ModelProfile(
        name=name, architecture=architecture, num_layers=layers, hidden_size=hidden,
        num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=intermediate, vocab_size=vocab,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=max_pos, dtype=dtype, quantization=quant,
        num_experts=num_experts, num_experts_per_tok=top_k if num_experts else 0,
        moe_intermediate_size=moe_inter, qkv_bias=qkv_bias,
        quant_bytes_per_param=quant_bytes, derived_max_model_len=_derived_max_len(cfg, max_pos),
        source=source, **classes,
    )


# --------------------------------------------------------------------------- I/O
def known_models() -> list[str]:
    """Names of the shipped configs (``servetune/data/models/<name>/config.json``)."""
    if not _DATA_DIR.is_dir():
        return []
    return sorted(p.name for p in _DATA_DIR.iterdir() if (p / "config.json").is_file())


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def _hf_cached_config(repo_id: str) -> Path | None:
    repo = hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text().strip() / "config.json"
        if pinned.is_file():
            return pinned
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


def _resolve_config_path(ref: str | os.PathLike[str]) -> tuple[Path, str]:
    text = os.fspath(ref)
    path = Path(text).expanduser()
    if path.is_dir():
        return path / "config.json", path.name
    if path.is_file():
        return path, path.parent.name if path.name == "config.json" else path.stem
    lowered = text.lower()
    if lowered in known_models():
        return _DATA_DIR / lowered / "config.json", lowered
    if "/" in text and not text.startswith((".", "/", "~")):
        cached = _hf_cached_config(text)
        if cached is not None:
            return cached, text
        if lowered in _HF_ALIASES:
            name = _HF_ALIASES[lowered]
            return _DATA_DIR / name / "config.json", name
    known = known_models()
    raise SpecError("model", f"no model config found for {text!r}{did_you_mean(lowered, known)}",
                    f"use a shipped name ({', '.join(known)}), a directory or config.json path, "
                    f"or a Hugging Face id already in {hf_cache_dir()}")


def load_model(ref: str | os.PathLike[str]) -> ModelProfile:
    """Read a model's ``config.json`` into a :class:`ModelProfile`.

    ``ref`` is a shipped name, a model directory, a ``config.json`` path, or a Hugging Face id
    found in the local HF cache (never downloaded).

    Example:
        >>> m = load_model("mixtral-8x7b")
        >>> m.num_experts, round(m.param_count / 1e9, 1), round(m.active_param_count / 1e9, 1)
        (8, 46.7, 12.9)
    """
    path, name = _resolve_config_path(ref)
    if not path.is_file():
        raise SpecError("model", f"{path} does not exist", "point --model at a directory holding config.json")
    cfg = read_json_file(path, str(path))
    try:
        return profile_from_config(cfg, name=name, source=str(path))
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError, ZeroDivisionError) as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError(str(path), f"a value in config.json is not what a Hugging Face config holds "
                        f"({type(exc).__name__}: {shown(str(exc))})", "fix config.json") from None
