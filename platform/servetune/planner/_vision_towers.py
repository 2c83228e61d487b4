"""Vision towers beside a language model: their weights, and what vLLM's profile run holds for them.

Contract: :func:`vision_tower_params` counts a SigLIP / ViT-style tower (Pixtral's, LLaVA's projector) and
:func:`qwen3_vl_tower_params` a Qwen3-VL-style one (Qwen3-VL, Qwen3.5), from ``vision_config``;
:func:`qwen3_vl_encoder` is that tower's shape (:class:`Qwen3VLEncoder`) and
:func:`qwen3_vl_encoder_profile` its pass in the profile run (:class:`EncoderProfile`), counted from vLLM's
source; :func:`deepstack_buffer_bytes` the deepstack buffers a Qwen3-VL model allocates while it loads;
:func:`multimodal_profile_bytes` the profile run's extra peak for other towers
(:data:`MULTIMODAL_PROFILE_ELEMS_PER_TOKEN`, fitted). :mod:`servetune.planner.modelclass` reads a config
with these and re-exports every public name here; its docstring tells the model classes. Pure functions,
no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

from servetune.errors import SpecError

__all__ = ["EncoderProfile", "MULTIMODAL_PROFILE_ELEMS_PER_TOKEN", "QWEN3_5_VISION_DEFAULTS", "QWEN3_VL_IMAGE_MAX_PIXELS",
           "QWEN3_VL_TYPES", "QWEN3_VL_VIDEO_MAX_PIXELS", "Qwen3VLEncoder", "deepstack_buffer_bytes",
           "multimodal_profile_bytes", "qwen3_vl_encoder", "qwen3_vl_encoder_profile", "qwen3_vl_tower_params",
           "vision_tower_params"]

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


def multimodal_profile_bytes(model: Any, tokens: int) -> int:
    """The profile run's extra peak for a model with a vision tower other than a Qwen3-VL-style one (0 without
    one, and 0 for a tower :func:`qwen3_vl_encoder_profile` counts): see :data:`MULTIMODAL_PROFILE_ELEMS_PER_TOKEN`."""
    if not model.vision_params or model.vision_encoder is not None:
        return 0
    return int(MULTIMODAL_PROFILE_ELEMS_PER_TOKEN * tokens * model.hidden_size * model.dtype_bytes)
