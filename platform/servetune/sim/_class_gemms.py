"""What a model class's ordinary (non-routed) GEMMs read and compute on one TP rank.

Contract: :func:`weight_format` is the :class:`WeightFormat` of a model's linear weights (or of its routed
experts) on a GPU: bytes a weight and the FLOP rate against bf16 (fp8 and 8-bit on their tensor cores
where the GPU has them, fp8 weight-only and 4-bit integer formats through Marlin, MXFP4 experts);
:func:`class_gemms` lists a stage's attention, dense-MLP, router and shared-expert GEMMs as
:class:`ClassGemm` (a Mamba / attention hybrid's by layer kind). The routed experts are
:mod:`servetune.sim._moe_shape`'s. The rules, with the vLLM sources they follow, are told in
:mod:`servetune.sim.perf_classes`' docstring ("Quantized weights"), which re-exports every public name
here. Pure arithmetic, no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["ClassGemm", "MXFP4_BYTES", "W4A16_COMPUTE_SHARE", "WeightFormat", "class_gemms", "weight_format"]

#: Marlin's (AWQ / GPTQ / W4A16) compute rate against the bf16 GEMM's at large batches: its main
#: loop dequantizes every 4-bit weight before the tensor-core MMA. Not measured here: an
#: assumption from the Marlin paper (Frantar et al., "MARLIN: Mixed-Precision Auto-Regressive
#: Parallel Inference on Large Language Models", 2024), whose large-batch end runs close to, and
#: below, the fp16 GEMM; the AWQ / W4A16 runs judge it.
W4A16_COMPUTE_SHARE: float = 0.9


#: MXFP4: a 4-bit value plus one 8-bit (e8m0) scale per 32 values (OCP Microscaling spec v1.0).
MXFP4_BYTES: float = 0.5 + 1.0 / 32


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one kind of linear weight is read and computed: bytes a weight, FLOP rate against bf16."""

    bytes_per_weight: float
    rate_scale: float  # the GPU's rate for this format over its bf16 rate (fp8 on Hopper: 2)


@dataclasses.dataclass(frozen=True)
class ClassGemm:
    """One GEMM of a layer on one TP rank: output width ``n``, input ``k``, over ``layers`` layers."""

    n: int
    k: int
    layers: int
    fmt: WeightFormat


def weight_format(model: ModelProfile, gpu: GpuSpec, experts: bool = False) -> WeightFormat:
    """The :class:`WeightFormat` of the model's linear weights (``experts``: its routed experts).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> oss, h100 = load_model("gpt-oss-20b"), get_gpu("H100-80GB")
        >>> weight_format(oss, h100).bytes_per_weight, weight_format(oss, h100, experts=True).bytes_per_weight
        (2.0, 0.53125)
    """
    method = (model.quantization or "").lower()
    bf16 = WeightFormat(float(model.dtype_bytes), 1.0)
    if not method or (model.quantized_experts_only and not experts):
        return bf16
    if model.quantized_experts_only:  # MXFP4 experts: no fp4 tensor cores before Blackwell
        return WeightFormat(MXFP4_BYTES, 1.0)
    wbytes = model.weight_bytes_per_param
    fp8_rate = gpu.fp8_tflops / gpu.bf16_tflops if gpu.bf16_tflops else 1.0
    if "fp8" in method or method == "modelopt":
        if gpu.fp8_compute:
            return WeightFormat(wbytes, fp8_rate)
        return WeightFormat(wbytes, W4A16_COMPUTE_SHARE)  # weight-only through Marlin (as_loaded_on)
    if wbytes >= 1.0:  # W8A8 (compressed-tensors / bitsandbytes 8-bit): 8-bit tensor cores
        return WeightFormat(wbytes, fp8_rate if gpu.fp8_compute else 1.0)
    return WeightFormat(wbytes, W4A16_COMPUTE_SHARE)  # 4-bit weights, 16-bit activations (Marlin)


def class_gemms(model: ModelProfile, gpu: GpuSpec, tp: int, layers: int) -> list[ClassGemm]:
    """The ordinary (non-routed) GEMMs of one stage's layers on one TP rank.

    Attention's q/k/v and o (MLA: its projections as one GEMM of the same weight count), the dense
    MLP of a dense model or of DeepSeek's leading dense layers, a MoE model's shared experts and
    its router (bf16, replicated). The routed experts are :func:`moe_shape`'s.
    """
    if model.is_hybrid:
        return _hybrid_gemms(model, gpu, tp, layers)
    d = model.hidden_size
    fmt = weight_format(model, gpu)
    attn_fmt = fmt
    out: list[ClassGemm] = []
    if model.mla_kv_lora_rank:
        attn = model._attention_params(tp)
        out.append(ClassGemm(max(1, attn // d), d, layers, attn_fmt))
    else:
        q = model.q_size // tp
        kv = model.kv_heads_per_gpu(tp) * model.head_dim
        out += [ClassGemm(q + 2 * kv, d, layers, attn_fmt), ClassGemm(d, q, layers, attn_fmt)]
    dense_layers = layers if not model.is_moe else min(model.first_k_dense_replace, layers)
    if dense_layers:
        inter = max(1, model.intermediate_size // tp)
        out += [ClassGemm(2 * inter, d, dense_layers, fmt), ClassGemm(d, inter, dense_layers, fmt)]
    moe_layers = layers - dense_layers
    if moe_layers:
        bf16 = WeightFormat(float(model.dtype_bytes), 1.0)
        out.append(ClassGemm(model.num_experts, d, moe_layers, bf16))  # the router
        shared = model.shared_expert_intermediate_size // tp
        if shared:
            out += [ClassGemm(2 * shared, d, moe_layers, fmt), ClassGemm(d, shared, moe_layers, fmt)]
    return out


def _hybrid_gemms(model: ModelProfile, gpu: GpuSpec, tp: int, layers: int) -> list[ClassGemm]:
    """A Mamba / attention hybrid's ordinary GEMMs, each on the layers that hold it (``layer_types``):
    q/k/v and o on the attention layers (Qwen3-Next's gated q twice as wide), the mixer's ``in_proj``
    (``ModelProfile.mamba_in_proj_width``, the figure its weights count) and ``out_proj`` on the Mamba
    layers, and the MLP where there is one: every layer (granite-4.0-h, Bamba, Falcon-H1, Qwen3-Next) or
    the ``mlp`` layers (Nemotron-H's two-matrix ``up`` / ``down``); a MoE MLP's router and shared expert
    here, its routed experts :func:`moe_shape`'s."""
    d = model.hidden_size
    fmt = weight_format(model, gpu)
    kinds = model.layer_types[:layers]
    both = kinds.count("parallel")
    attn, mamba = kinds.count("full") + both, kinds.count("mamba") + both
    ffn = len(kinds) if model.ffn_gated else kinds.count("mlp") + kinds.count("moe")
    out: list[ClassGemm] = []
    if attn:
        q = model.q_size // tp * (2 if model.attn_output_gate else 1)
        kv = model.kv_heads_per_gpu(tp) * model.head_dim
        out += [ClassGemm(q + 2 * kv, d, attn, fmt), ClassGemm(d, model.q_size // tp, attn, fmt)]
    if mamba:
        out += [ClassGemm(model.mamba_in_proj_width(tp) // tp, d, mamba, fmt),
                ClassGemm(d, model.mamba_inner // tp, mamba, fmt)]
    if ffn and model.is_moe:
        out.append(ClassGemm(model.num_experts, d, ffn, WeightFormat(float(model.dtype_bytes), 1.0)))  # the router
        shared = model.shared_expert_intermediate_size // tp
        if shared:
            out += [ClassGemm((2 if model.ffn_gated else 1) * shared, d, ffn, fmt), ClassGemm(d, shared, ffn, fmt)]
    elif ffn:
        inter = max(1, model.intermediate_size // tp)
        out += [ClassGemm((2 if model.ffn_gated else 1) * inter, d, ffn, fmt), ClassGemm(d, inter, ffn, fmt)]
    return out
