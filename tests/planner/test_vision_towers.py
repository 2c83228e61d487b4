"""Qwen3-VL (dense and MoE) towers, planned through the Qwen3.5 tower's code path; each rule pinned to vLLM's source.

Read in the vLLM 0.11.0, 0.12.0, 0.13.0, 0.19.0 and 0.26.0 wheels (models/qwen3_vl.py, qwen3_vl_moe.py,
qwen2_vl.py, v1/worker/utils.py, v1/worker/gpu_model_runner.py, multimodal/encoder_budget.py) before any
published Qwen3-VL start was judged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from servetune.errors import SpecError
from servetune.planner._vision_towers import _formatted_video
from servetune.planner.engine_config import resolve_engine_config
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory
from servetune.planner.modelclass import deepstack_buffer_bytes, qwen3_vl_encoder_profile
from servetune.planner.modelinfo import load_model
from servetune.planner.vllm_rules import memory_rules, parse_vllm_version

FIXTURE_MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "published_logs" / "models"
QWEN3_VL_MOE = FIXTURE_MODELS / "qwen3-vl-30b-a3b-instruct" / "config.json"


def test_qwen3_vl_moe_is_planned_from_its_text_config_with_the_qwen3_vl_tower():
    """Qwen3VLMoeForConditionalGeneration: the language model from text_config (48 layers, 128 experts top-8), the
    tower from vision_config by the Qwen3.5 tower's count (qwen3_vl.py lines 126-370 of 0.12.0: Conv3d patch embed
    with bias, 2304 position embeddings, 27 LayerNorm blocks, the merger and one merger per deepstack index), mrope's
    4 x max_position cos/sin rows (rotary_embedding/mrope.py line 237 of 0.12.0, 241 of 0.11.0)."""
    m = load_model(QWEN3_VL_MOE)
    assert (m.num_layers, m.hidden_size, m.num_experts, m.num_experts_per_tok) == (48, 2048, 128, 8)
    enc = m.vision_encoder
    assert enc is not None and (enc.hidden, enc.intermediate, enc.out_hidden, enc.deepstack, enc.temporal) == \
        (1152, 4304, 2048, 3, 2)
    h, i, merged, out = 1152, 4304, 4 * 1152, 2048
    block = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h
    merger = merged * merged + merged + merged * out + out
    assert m.vision_params == 27 * block + 1536 * h + h + 2304 * h + 2 * h + merger + 3 * (2 * merged + merger)
    assert m.extra_rotary_positions == 3 * 262144


def test_the_012_dummy_video_counts_12_5_tokens_a_frame_token():
    """0.11 / 0.12: ``get_max_video_tokens`` returns int(12.5 x the frames' tokens) (qwen3_vl.py lines 693-709 of
    0.12.0, 658-675 of 0.11.0). The frames: the most from 2 whose tokens fit max_model_len, capped at 24,576
    (``_MAX_FRAMES_PER_VIDEO``, line 123 of 0.12.0); all frames share 25,165,824 pixels, so 24,576 frames of 32 x 32
    are 12,288 tokens (153,600 counted); below 16,200 tokens of max_model_len the 2-frame start stays (3,520 x 3,520:
    12,100 tokens, 151,250 counted)."""
    assert _formatted_video(40960, 16, 2, 2) == (12288, 153600)
    assert _formatted_video(262144, 16, 2, 2) == (12288, 153600)
    assert _formatted_video(8192, 16, 2, 2) == (12100, 151250)


def test_at_012_the_profile_encodes_one_video_and_holds_its_outputs_at_the_counted_size():
    """The counted 153,600 tokens beat the image's 16,384, so the dummy item is one video (max(budget // T, ...) = 1,
    v1/worker/utils.py lines 79-118 of 0.12.0); it encodes 49,152 patches and profile_run copies the outputs into
    zeros of 153,600 rows (gpu_model_runner.py lines 4336-4351 of 0.12.0), held through the language model. From
    0.13.0 the video counts its frames' tokens (12,288, qwen3_vl.py lines 710-722) and the copy is gone: the image."""
    enc = load_model(QWEN3_VL_MOE).vision_encoder
    assert enc is not None
    old = qwen3_vl_encoder_profile(enc, 2, 1, 8192, 256, 40960, formatted_video=True)
    new = qwen3_vl_encoder_profile(enc, 2, 1, 8192, 256, 40960)
    row = 2048 * 4 * 2  # out_hidden x (1 + 3 deepstack) x bf16
    assert (old.items, old.tokens_per_item, old.patches) == (1, 153600, 49152)
    assert old.held_bytes == 49152 * 1536 * 2 + 153600 * row
    assert old.peak_bytes == 49152 * 1536 * 2 + (12288 + 153600) * row  # both copies at the copy
    assert (new.items, new.tokens_per_item, new.patches) == (1, 16384, 65536)
    assert new.held_bytes == 65536 * 1536 * 2 + 16384 * row
    assert memory_rules(parse_vllm_version("0.11.0")).qwen3_vl_formatted_video and memory_rules(parse_vllm_version("0.12.0")).qwen3_vl_formatted_video
    assert not memory_rules(parse_vllm_version("0.13.0")).qwen3_vl_formatted_video and not memory_rules(parse_vllm_version("0.26.0")).qwen3_vl_formatted_video


def test_the_deepstack_buffers_are_loaded_with_the_weights():
    """Qwen3VLForConditionalGeneration.__init__ allocates one [max_num_batched_tokens, text hidden] tensor per deepstack
    index under the loader's device (qwen3_vl.py lines 1267-1277 of 0.12.0, 1501-1509 of 0.19.0, 1756-1764 of 0.26.0;
    qwen3_vl_moe.py lines 455-463 of 0.12.0): 3 x 8,192 x 2,048 x 2 B on top of the weights at 8,192 batched tokens."""
    m = load_model(QWEN3_VL_MOE)
    assert deepstack_buffer_bytes(m, 8192) == 3 * 8192 * 2048 * 2
    assert deepstack_buffer_bytes(load_model(FIXTURE_MODELS / "qwen3.5-0.8b"), 8192) == 0
    g = get_gpu("H100-80GB")
    plan = plan_memory(m, g, resolve_engine_config({"tensor_parallel_size": 2, "max_model_len": 40960}, m, g, "0.13.0"))
    assert plan.fits
    bare = m.stage_weight_bytes(2, 1)[0] / 2**30
    assert plan.memory.weights == pytest.approx(bare + 3 * 8192 * 2048 * 2 / 2**30, abs=0.01)


def test_qwen2_5_vl_towers_stay_refused_in_one_line(tmp_path: Path):
    """Qwen2.5-VL (window attention, RMSNorm, a gated MLP, patch 14): its profile's dummy is a video of up to 14
    frames at the image's largest size (qwen2_vl.py ``_MAX_FRAMES_PER_VIDEO`` 14, line 118 of 0.12.0, 114 of 0.26.0),
    not counted here: the config is refused (a tower whose size the config does not give as a ViT's)."""
    cfg = tmp_path / "config.json"
    cfg.write_text('{"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", '
                   '"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, '
                   '"num_key_value_heads": 4, "vocab_size": 152064, "torch_dtype": "bfloat16", "vision_config": '
                   '{"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "out_hidden_size": 3584}}')
    with pytest.raises(SpecError) as err:
        load_model(cfg)
    assert "vision_config" in err.value.field


def test_a_dense_qwen3_vl_is_planned_too(tmp_path: Path):
    """Qwen3VLForConditionalGeneration (dense): the Qwen3 language model from text_config (qwen3_vl_text), the same
    tower and deepstack buffers; planned at 0.12.0 with the counted video and at 0.19.0 with the image."""
    cfg = tmp_path / "config.json"
    cfg.write_text('{"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", '
                   '"tie_word_embeddings": false, "text_config": {"model_type": "qwen3_vl_text", "dtype": "bfloat16", '
                   '"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, '
                   '"num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 262144, '
                   '"rope_scaling": {"mrope_interleaved": true, "mrope_section": [24, 20, 20], "rope_type": "default"}}, '
                   '"vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, '
                   '"out_hidden_size": 4096, "deepstack_visual_indexes": [8, 16, 24], "patch_size": 16, '
                   '"spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "num_position_embeddings": 2304}}')
    m = load_model(cfg)
    assert not m.is_moe and m.vision_encoder is not None and m.vision_encoder.deepstack == 3
    g = get_gpu("H100-80GB")
    old = plan_memory(m, g, resolve_engine_config({"max_model_len": 32768}, m, g, "0.12.0"))
    new = plan_memory(m, g, resolve_engine_config({"max_model_len": 32768}, m, g, "0.19.0"))
    assert old.fits and new.fits
    # 0.12's held copy of 153,600 x 4,096 x 4 outputs (4.69 GiB) against 0.19's 16,384 rows
    assert old.memory.activation_peak - new.memory.activation_peak > 3.0


def test_language_model_only_leaves_the_tower_out_and_plans_the_real_start_it_served() -> None:
    """``--language-model-only`` (vLLM 0.17+, ``EngineArgs.language_model_only``): the tower is neither loaded nor run
    in the profile, so its weights and its encoder pass leave the plan and its notes; below 0.17.0 vLLM has no such
    flag and the planner says so in one line. The real start it served (2026-12-07, the Qwen3.5-35B-A3B shape at 20
    layers with a two-block tower, one H100 SXM, vLLM 0.26.0: 2,448,663 KV tokens logged) is planned within 0.5% with
    the flag (+0.18%), -0.94% without it (the tower counted)."""
    import gzip
    import json
    import re

    start = Path(__file__).resolve().parents[1] / "fixtures" / "real_h100_classes"
    model = load_model(start / "2026-12-07_h100_host_d" / "q35moe20")
    gpu = get_gpu("H100-80GB")
    summary = json.loads((start / "2026-12-07_q35moe20tri_lmo_u09_default" / "summary.json").read_text())
    assert "--language-model-only" in summary["argv"]
    text = gzip.decompress((start / "2026-12-07_q35moe20tri_lmo_u09_default" / "server.log.gz").read_bytes()).decode()
    logged = int(re.search(r"GPU KV cache size: ([\d,]+) tokens", text).group(1).replace(",", ""))
    flags = {"max_model_len": 8192, "gpu_memory_utilization": 0.9, "enable_prefix_caching": False,
             "max_num_batched_tokens": 8192}
    plans = {}
    for only in (False, True):
        config = resolve_engine_config({**flags, "language_model_only": only}, model, gpu, "0.26.0")
        assert config.language_model_only is only and ("language_model_only" in config.as_flags()) is only
        plans[only] = plan_memory(model, gpu, config)
    assert plans[True].kv_cache_tokens / logged - 1 == pytest.approx(0.0018, abs=0.002)
    assert plans[False].kv_cache_tokens / logged - 1 == pytest.approx(-0.0094, abs=0.002)
    assert any("vision" in n for n in plans[False].notes) and not any("vision" in n for n in plans[True].notes)
    with pytest.raises(SpecError, match=r"^language_model_only: unrecognized arguments: --language-model-only "
                                        r"\(vLLM 0\.16\.0 has no such flag"):
        resolve_engine_config({"language_model_only": True}, model, gpu, "0.16.0")
