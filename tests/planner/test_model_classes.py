"""Model classes beyond dense full attention (servetune.planner.modelclass): the rules read from vLLM's source.

The published starts these rules are judged on are in tests/planner/test_published_logs.py (classes.yaml).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from servetune.errors import SpecError
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelclass import group_size_for, kv_layout, moe_workspace_bytes
from servetune.planner.modelinfo import load_model, profile_from_config

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "fixtures" / "published_logs" / "models"
TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 8, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 2048}


@pytest.mark.parametrize("extra, field", [
    ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types"),
    ({"model_type": "qwen3_next", "mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"model_type": "minimax_m1"}, "model_type"),
    ({"model_type": "nemotron_h"}, "hybrid_override_pattern"),
    ({"model_type": "nemotron_h", "hybrid_override_pattern": "M*OM"}, "hybrid_override_pattern"),
    ({"model_type": "nemotron_h", "hybrid_override_pattern": "M*EM"}, "n_routed_experts"),
    ({"model_type": "granitemoehybrid", "layer_types": ["mamba", "attention", "mamba", "moe"]}, "layer_types"),
    ({"model_type": "falcon_h1"}, "mamba_n_heads"),
    ({"model_type": "zamba2"}, "model_type"),
    ({"model_type": "bamba"}, "model_type"),
    ({"architectures": ["JambaForCausalLM"]}, "model_type"),
    ({"layer_types": ["linear_attention", "full_attention"] * 2}, "layer_types"),
    ({"layers_block_type": ["mamba", "attention"] * 2}, "layer_types"),
    ({"text_config": {**TINY, "attention_chunk_size": 8192}}, "attention_chunk_size"),
    ({"num_kv_shared_layers": 10, "layer_types": ["sliding_attention", "full_attention"] * 2}, "num_kv_shared_layers"),
    ({"kv_lora_rank": 512, "index_topk": 2048}, "index_topk"),
])
def test_unmodelled_attention_is_refused_naming_what(extra, field):
    with pytest.raises(SpecError) as err:
        profile_from_config({**TINY, **extra}, "m", source="m/config.json")
    assert err.value.field == f"m/config.json: {field}" and err.value.fix and "\n" not in str(err.value)


def test_plan_refuses_llama4_scout_in_one_line_with_exit_2():
    """The CLI path: one line naming the field and the fix, exit 2, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "servetune", "plan", "--model",
                           str(MODELS / "llama-4-scout-17b-16e"), "--gpu", "H100-80GB", "--set", "tensor_parallel_size=4"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT / "platform"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    assert len(lines) == 1 and "attention_chunk_size" in lines[0] and "fix:" in lines[0]
    assert "Traceback" not in proc.stderr


def test_gemma3_text_config_takes_gemma3textconfig_defaults():
    """gemma-3-4b-it's config names five text fields; heads, KV heads, head_dim and vocab are the class's defaults."""
    m = load_model(MODELS / "gemma-3-4b-it")
    assert (m.num_attention_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (8, 4, 256, 262208)
    assert m.layer_types.count("full") == 5 and m.layer_types.count("sliding") == 29 and m.sliding_window == 1024
    assert m.vision_params > 4e8  # the SigLIP tower is loaded with the language model


def test_hybrid_groups_are_vllms():
    """gemma-3-4b: 29 sliding + 5 full layers -> groups of 5 (1 full, 6 sliding); gemma-2: 13 + 13 -> 2 groups of 13."""
    assert group_size_for([29, 5]) == 5 and group_size_for([13, 13]) == 13 and group_size_for([10, 9]) == 10
    g3 = kv_layout(load_model(MODELS / "gemma-3-4b-it"), 1, 0, 1, 16, 2)
    assert g3.group_size == 5 and g3.groups.count("full") == 1 and g3.groups.count("sliding") == 6
    assert g3.tokens(204_844, 16) == 204_844 // 7 * 16
    # one 8192-token request: 512 blocks in the full group, 513 in each sliding one (window 1024 + 8192 batched)
    assert g3.blocks_per_request(8192, 16, 8192) == 512 + 6 * 513
    assert g3.blocks_per_request(32768, 16, 2048) == 2048 + 6 * (-(-(1023 + 2048) // 16) + 1)
    g2 = kv_layout(load_model(MODELS / "gemma-2-9b-it"), 1, 0, 1, 16, 2)
    assert (g2.group_size, len(g2.groups)) == (21, 2)


def test_long_context_on_a_sliding_model_is_cheaper_than_on_full_attention():
    """The check can fail: a sliding layer holds only its window, so concurrency at 32k is over twice a full model's (2.3x: 7 groups of 10 layer pages, 577 blocks per sliding group)."""
    import dataclasses
    m = load_model(MODELS / "gemma-3-27b-it")
    gpu = get_gpu("H100-80GB")
    cfg = resolve_engine_config({"max_model_len": 32768}, m, gpu, "0.19.0")
    hybrid = plan_memory(m, gpu, cfg)
    full = plan_memory(dataclasses.replace(m, layer_types=(), sliding_window=0), gpu, cfg)
    assert hybrid.fits and full.fits and hybrid.max_concurrency > 2 * full.max_concurrency


def test_mla_weights_count_the_absorbed_copies_and_the_kv_is_the_latent():
    m = load_model(MODELS / "deepseek-v2-lite-chat")
    assert m.mla_kv_lora_rank == 512 and m.first_k_dense_replace == 1 and m.shared_expert_intermediate_size == 2816
    assert abs(m.weight_bytes_per_gpu(1, 1) / 2**30 - 29.43) < 0.1  # "Model loading took 29.43 GiB"
    assert m.kv_bytes_per_token(1, 1) == 576 * 2 * 27


def test_mxfp4_quantizes_only_the_experts():
    """gpt-oss: bf16 attention, embedding and LM head; the experts at the loaded MXFP4 size."""
    m = load_model(MODELS / "gpt-oss-20b")
    assert m.quantized_experts_only and m.layer_types.count("sliding") == 12
    gib = m.weight_bytes_per_gpu(1, 1) / 2**30
    assert 13.0 < gib < 14.5  # logged 13.64; all-linear MXFP4 (the old rule) gave 11.95


def test_moe_workspace_is_the_triton_experts_shapes():
    m = load_model(MODELS / "qwen3-30b-a3b")
    # M=8192, topk 8, N=1536, K=2048: 8 x (max(768, 2048) + max(1536, 2048)) + 2048 elements per token
    assert moe_workspace_bytes(m, 8192, 1) == 8192 * (8 * (2048 + 2048) + 2048) * 2
    assert moe_workspace_bytes(load_model(MODELS / "gpt-oss-20b"), 8192, 1) == 0  # monolithic MXFP4 kernel
    assert moe_workspace_bytes(load_model("llama-3.1-8b"), 8192, 1) == 0


def test_full_attention_layer_types_and_unused_sliding_windows_stay_full():
    """Qwen2.5's ``sliding_window`` with ``use_sliding_window: false`` and an all-full ``layer_types`` plan as before."""
    plain = profile_from_config(TINY, "m")
    for extra in ({"sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 4},
                  {"layer_types": ["full_attention"] * 4}):
        m = profile_from_config({**TINY, **extra}, "m")
        assert m.layer_types == () and m.kv_bytes_per_token(1, 1) == plain.kv_bytes_per_token(1, 1)
        assert kv_layout(m, 1, 0, 1, 16, 2) == kv_layout(plain, 1, 0, 1, 16, 2)


def test_a_vision_tower_the_config_does_not_size_is_refused():
    """Qwen2-VL-style ``depth`` instead of ``num_hidden_layers``: refused in one line, not planned without it."""
    for cfg in ({"architectures": ["X"], "text_config": TINY, "vision_config": {"depth": 32, "hidden_size": 1280}},
                {**TINY, "vision_config": {"depth": 32, "hidden_size": 1280}}):  # nested and flat wrappers
        with pytest.raises(SpecError) as err:
            profile_from_config(cfg, "m", source="m/config.json")
        assert err.value.field == "m/config.json: vision_config" and "not modelled" in err.value.message


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b", "gemma-2-27b", "gemma-3-27b",
                                  "deepseek-v2-lite"])
def test_shipped_class_configs_name_their_source_and_plan_on_one_h200(name):
    import json
    from servetune.planner.modelinfo import known_models
    assert name in known_models()
    cfg = json.loads((ROOT / "platform" / "servetune" / "data" / "models" / name / "config.json").read_text())
    assert cfg["_source"].startswith("https://huggingface.co/")
    m = load_model(name)
    gpu = get_gpu("H200")
    plan = plan_memory(m, gpu, resolve_engine_config({"max_model_len": 8192}, m, gpu, "0.19.0"))
    assert plan.fits and plan.notes, name  # every class model says how it is modelled


def test_a_sliding_group_reserves_every_in_flight_batch_from_vllm_0_26() -> None:
    """vLLM 0.26's ``SlidingWindowSpec.max_memory_usage_bytes`` reserves ``window - 1 +
    max_in_flight_tokens`` tokens of a request, the in-flight tokens being every concurrent batch's
    ``max_num_batched_tokens`` (async scheduling: two batches on gpt-oss's V1 runner); 0.19 reserves
    one batch's. gpt-oss-20b at 131,072 tokens and 8,192 batched tokens: a request takes 8,192 full
    blocks and cdiv(127 + 16,384, 16) + 1 = 1,033 sliding ones on 0.26, 8,192 + 521 on 0.19."""
    model, gpu = load_model("gpt-oss-20b"), get_gpu("H100-80GB")
    flags = {"max_model_len": 131072, "max_num_batched_tokens": 8192}
    for version, per_request in (("0.26.0", 8192 + 1033), ("0.19.0", 8192 + 521)):
        plan = plan_memory(model, gpu, resolve_engine_config(flags, model, gpu, version))
        assert plan.fits
        assert plan.max_concurrency == pytest.approx(plan.num_gpu_blocks / per_request, rel=1e-9), version


def test_gpt_oss_captures_cuda_graphs_up_to_1024_unless_the_user_sets_the_sizes() -> None:
    # vLLM's GptOssForCausalLMConfig raises the largest capture size from 512 to 1024; the published
    # 0.19.0 starts on an H100 log "Overriding max cuda graph capture size to 1024" and 83 sizes.
    oss, dense, h100 = load_model(str(MODELS / "gpt-oss-20b")), load_model("llama-3.1-8b"), get_gpu("H100-80GB")
    flags = {"max_model_len": 8192, "enable_prefix_caching": False}
    for version in ("0.11.0", "0.19.0"):
        sizes = resolve_engine_config(flags, oss, h100, version).cudagraph_capture_sizes
        assert (len(sizes), sizes[-1]) == (83, 1024), version
    assert resolve_engine_config(flags, dense, h100, "0.19.0").cudagraph_capture_sizes[-1] == 512
    own = resolve_engine_config({**flags, "max_cudagraph_capture_size": 256}, oss, h100, "0.19.0")
    assert own.cudagraph_capture_sizes[-1] == 256
    # The graphs' memory at 83 + 83 sizes comes near the 1.84 GiB (TP=1) and 1.55 GiB (TP=2) those
    # starts logged, where 51 + 51 sizes to 512 predicted 0.59 GiB.
    plan = plan_memory(oss, h100, resolve_engine_config({**flags, "gpu_memory_utilization": 0.95}, oss, h100, "0.19.0"))
    assert 1.5 < plan.memory.cudagraph < 1.9


@pytest.mark.parametrize("quant, group", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, 128),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": False}, 0),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, 0),
    ({"quant_method": "fp8"}, 0),
])
def test_only_awq_zero_points_grow_on_hopper(quant: dict, group: int) -> None:
    """Machete keeps AWQ's zero points in float16 on an H100 from vLLM 0.26 (two bytes a group where the
    checkpoint packs half a byte); no other checkpoint, GPU or version changes."""
    shipped = Path(__file__).resolve().parents[2] / "platform" / "servetune" / "data" / "models" / "llama-3.1-8b"
    base = {k: v for k, v in json.loads((shipped / "config.json").read_text()).items() if not k.startswith("_")}
    model = profile_from_config({**base, "quantization_config": quant}, "cfg")
    assert model.quant_zero_point_group == group
    weights = {}
    for gpu, version in (("H100-80GB", "0.26.0"), ("H100-80GB", "0.25.0"), ("A100-80GB", "0.26.0")):
        config = resolve_engine_config({"max_model_len": 4096}, model, get_gpu(gpu), version)
        weights[gpu, version] = plan_memory(model, get_gpu(gpu), config).memory.weights
    grown = weights["H100-80GB", "0.26.0"] - weights["H100-80GB", "0.25.0"]
    assert weights["A100-80GB", "0.26.0"] == pytest.approx(weights["H100-80GB", "0.25.0"], rel=1e-9)
    linear = 32 * (4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336)
    assert grown == pytest.approx(linear / group * 1.5 / 2**30 if group else 0.0, abs=1e-6)
