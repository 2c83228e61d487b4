"""ModelProfile: config parsing, parameter counts, TP/PP sharding, KV bytes, HF-cache lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servetune.errors import SpecError
from servetune.planner.modelinfo import ModelProfile, known_models, load_model, profile_from_config

GiB = 1 << 30

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 8, "intermediate_size": 512, "vocab_size": 1000,
        "max_position_embeddings": 2048}


def test_shipped_models_are_listed():
    assert {"llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "mixtral-8x7b", "servetune-test-850m"} <= set(known_models())


def test_test_model_matches_the_h200_logs():
    m = load_model("servetune-test-850m")
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.head_dim) == (16, 2048, 32, 8, 64)
    # make_model.py printed "model params=852.6M"
    assert m.param_count == 852_559_872
    # "Model loading took 1.59 GiB" (TP=1) and "0.81 GiB" per worker (TP=2)
    assert round(m.weight_bytes_per_gpu(1, 1) / GiB, 2) == 1.59
    assert abs(m.weight_bytes_per_gpu(2, 1) / GiB - 0.81) < 0.02


@pytest.mark.parametrize(("name", "params_b", "active_b"), [
    ("llama-3.1-8b", 8.03, 8.03), ("llama-3.1-70b", 70.55, 70.55), ("qwen2.5-7b", 7.62, 7.62),
    ("mixtral-8x7b", 46.70, 12.88), ("mistral-small-24b", 23.57, 23.57),
])
def test_parameter_counts(name, params_b, active_b):
    m = load_model(name)
    assert abs(m.param_count / 1e9 - params_b) / params_b < 0.002
    assert abs(m.active_param_count / 1e9 - active_b) / active_b < 0.002


def test_llama_8b_weights_and_kv_match_vllm():
    m = load_model("llama-3.1-8b")
    assert m.max_position_embeddings == 131072 and m.max_model_len_limit == 131072  # llama3 rope: no stretch
    assert abs(m.weight_bytes_per_gpu(1, 1) / GiB - 14.99) < 0.01  # vLLM: "Model loading took 14.99 GiB"
    assert m.kv_bytes_per_token(1, 1) == 128 * 1024  # reference §2.6 worked example
    assert m.kv_bytes_per_token(2, 1) == 64 * 1024


def test_mistral_small_24b_head_dim_is_its_own_and_weights_match_vllm():
    # Its config names head_dim 128 where hidden / heads is 160: q and o are 5120 x 4096, not square.
    m = load_model("mistralai/Mistral-Small-24B-Instruct-2501")
    assert m.name == "mistral-small-24b" and (m.head_dim, m.hidden_size // m.num_attention_heads) == (128, 160)
    # make_model.py printed "model params=23572.4M"; vLLM 0.26.0 on the H200: "Model loading took
    # 43.91 GiB" (tests/fixtures/real_h200/scale/m24b_*).
    assert m.param_count == 23_572_403_200
    assert round(m.weight_bytes_per_gpu(1, 1) / GiB, 2) == 43.91
    assert m.kv_bytes_per_token(1, 1) == 2 * 8 * 128 * 40 * 2  # 160 KiB


def test_mixtral_moe_fields():
    m = load_model("mixtral-8x7b")
    assert (m.num_experts, m.num_experts_per_tok, m.expert_intermediate_size) == (8, 2, 14336)
    assert m.is_moe and m.weight_bytes_per_gpu(2, 1) < m.weight_bytes_per_gpu(1, 1) * 0.51


@pytest.mark.parametrize(("layers", "pp", "split"), [
    (16, 1, [16]), (16, 2, [8, 8]), (16, 3, [5, 6, 5]), (16, 5, [3, 3, 3, 4, 3]),
    (80, 3, [27, 27, 26]), (30, 4, [7, 8, 8, 7]), (7, 4, [2, 2, 2, 1]), (4, 4, [1, 1, 1, 1]),
])
def test_stage_layers_follow_get_pp_indices(layers, pp, split):
    m = profile_from_config({**TINY, "num_hidden_layers": layers}, "t")
    assert m.stage_layers(pp) == split
    assert sum(split) == layers and split[-1] == layers // pp  # the last stage never gets the remainder


def test_pp_larger_than_layers_is_refused():
    with pytest.raises(SpecError, match="pipeline_parallel_size"):
        profile_from_config(TINY, "t").stage_layers(5)


def test_kv_heads_replicate_when_tp_exceeds_them():
    m = load_model("servetune-test-850m")
    assert [m.kv_heads_per_gpu(tp) for tp in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    # 2 * heads/GPU * head_dim 64 * 2 bytes * 16 layers
    assert m.kv_bytes_per_token(1, 1) == 32768
    assert m.kv_bytes_per_token(2, 1) == 16384
    assert m.kv_bytes_per_token(8, 1) == m.kv_bytes_per_token(16, 1) == 4096  # one head replicated
    assert m.kv_bytes_per_token(1, 2) == 16384  # 8 layers per stage
    assert m.kv_bytes_per_token(1, 3) == 2 * 8 * 64 * 2 * 6  # the stage with the most layers
    assert m.kv_bytes_per_token(1, 1, "fp8") == 16384
    assert m.kv_bytes_per_token(1, 1, "fp8_e5m2") == 16384


def test_tp_shards_matrices_but_replicates_replicated_kv():
    m = load_model("servetune-test-850m")
    w8, w16 = m.weight_bytes_per_gpu(8, 1), m.weight_bytes_per_gpu(16, 1)
    # beyond 8 KV heads the k/v projections stop shrinking: TP 16 is more than half of TP 8
    assert w16 > w8 / 2
    kv_proj = 2 * m.hidden_size * m.head_dim * 2 * m.num_layers  # one replicated head, k and v, bf16
    assert w16 > kv_proj


def test_pp_puts_embedding_first_and_lm_head_last():
    untied = profile_from_config({**TINY, "num_hidden_layers": 4, "vocab_size": 64000}, "u")
    s0, s1 = untied.stage_weight_bytes(1, 2)
    assert s1 - s0 == untied.hidden_size * 2  # embedding on stage 0; same-sized LM head + final norm on 1
    tied = profile_from_config({**TINY, "vocab_size": 64000, "tie_word_embeddings": True}, "t")
    (one,) = tied.stage_weight_bytes(1, 1)
    first, last = tied.stage_weight_bytes(1, 2)
    vocab_bytes = 64000 * 256 * 2
    rotary = 2048 * 32 * 2  # each stage keeps its own cos/sin cache
    assert first + last == one + vocab_bytes + rotary  # PP>1: the tied head is a second copy on the last stage
    assert last - first == 256 * 2  # ... the same size as the embedding, plus the final norm
    assert tied.param_count == untied.param_count - 64000 * 256


def test_absent_fields_take_their_defaults():
    p = profile_from_config(TINY, "tiny")
    assert p.head_dim == 32 and p.num_kv_heads == 8 and p.dtype == "bfloat16" and p.quantization is None
    assert profile_from_config({**TINY, "torch_dtype": "float16"}, "t").dtype == "float16"
    assert profile_from_config({**TINY, "dtype": "float16"}, "t").dtype == "float16"
    assert profile_from_config({**TINY, "torch_dtype": "float32"}, "t").dtype == "bfloat16"  # vLLM auto
    assert profile_from_config({**TINY, "head_dim": None}, "t").head_dim == 32


def test_quantized_checkpoints_shrink_weights():
    plain = profile_from_config(TINY, "p")
    fp8 = profile_from_config({**TINY, "quantization_config": {"quant_method": "fp8"}}, "f")
    awq = profile_from_config({**TINY, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}, "a")
    assert fp8.quantization == "fp8" and fp8.weight_bytes_per_param == 1.0
    assert awq.quantization == "awq" and 0.5 < awq.weight_bytes_per_param < 0.53
    assert plain.weight_bytes_per_gpu(1, 1) > fp8.weight_bytes_per_gpu(1, 1) > awq.weight_bytes_per_gpu(1, 1)
    with pytest.raises(SpecError, match="quant_method"):
        profile_from_config({**TINY, "quantization_config": {"quant_method": "magic"}}, "m")


def test_rope_scaling_stretches_the_limit_except_llama3():
    yarn = {**TINY, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}}
    assert profile_from_config(yarn, "y").max_model_len_limit == 8192
    llama3 = {**TINY, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert profile_from_config(llama3, "l").max_model_len_limit == 2048


def test_missing_key_names_the_key_and_the_file(tmp_path):
    cfg = dict(TINY)
    del cfg["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecError) as err:
        load_model(tmp_path)
    assert "vocab_size" in str(err.value) and str(tmp_path / "config.json") in str(err.value)


def test_load_from_directory_and_file(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    assert load_model(d).name == "my-model"
    assert load_model(d / "config.json").num_layers == 4
    assert load_model(str(d)).hidden_size == 256


def _fake_hf_cache(hub: Path, repo_id: str, cfg: dict) -> None:
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(cfg))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")


def test_hf_id_from_hf_hub_cache(tmp_path, monkeypatch):
    _fake_hf_cache(tmp_path / "hub", "acme/tiny-llm", {**TINY, "num_hidden_layers": 6})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    m = load_model("acme/tiny-llm")
    assert m.name == "acme/tiny-llm" and m.num_layers == 6


def test_hf_id_from_hf_home(tmp_path, monkeypatch):
    _fake_hf_cache(tmp_path / "hf" / "hub", "acme/other", TINY)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert load_model("acme/other").num_layers == 4


def test_hf_id_of_a_shipped_model_without_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert load_model("meta-llama/Llama-3.1-8B-Instruct").name == "llama-3.1-8b"


def test_unknown_model_lists_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SpecError) as err:
        load_model("llama-3.1-8")
    assert "did you mean 'llama-3.1-8b'" in str(err.value) and "qwen2.5-7b" in str(err.value)


def test_mla_is_planned_as_one_latent_per_token_and_layer():
    """MLA (DeepSeek-style) was refused; it is now planned: (kv_lora_rank + qk_rope_head_dim) x dtype per layer, any TP."""
    m = profile_from_config({**TINY, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
                             "v_head_dim": 32}, "deepseek")
    assert m.kv_bytes_per_token(tp=1, pp=1) == m.kv_bytes_per_token(tp=4, pp=1) == 576 * 2 * 4


def test_profile_is_hashable_and_frozen():
    m = load_model("servetune-test-850m")
    assert isinstance(m, ModelProfile) and hash(m) == hash(load_model("servetune-test-850m"))
