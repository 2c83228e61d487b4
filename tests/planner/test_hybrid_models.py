"""Mamba2 / attention hybrids in the planner (servetune.planner.modelclass): the rules read from vLLM's source.

Worked example, granite-4.0-h-tiny on one H100-80GB, vLLM 0.26.0, ``gpu_memory_utilization`` 0.9,
``max_model_len`` 8192, ``max_num_seqs`` 256, prefix caching off (config: 40 layers, attention at 5, 15,
25, 35; hidden 1536, 12 heads, 4 KV heads, head_dim 1536 / 12 = 128; Mamba2: 48 heads x 64, d_state 128,
1 group, d_conv 4, expand 2; 64 experts of 512, top-6, shared MLP 1024; vocab 100,352, tied; NoPE),
computed by hand:

- Mamba state per layer and request (``mamba2_state_shape``): conv ``(4 - 1) x (3072 + 2 x 1 x 128) = 3 x
  3328`` bf16 = 19,968 B; SSM ``48 x 64 x 128`` bf16 = 786,432 B; together 806,400 B.
- Attention per token and layer: ``2 x 4 x 128 x 2`` = 2,048 B; block raised to ``16 x cdiv(806,400, 16 x
  2,048) = 16 x 25 = 400`` tokens; page 400 x 2,048 = 819,200 B, the Mamba state padded to it.
- Groups: 4 attention, 36 Mamba layers: group size 4 (36 >= 1.5 x 4), 1 attention + 9 Mamba groups = 10;
  one block over the 4 layers of a group slot = 4 x 819,200 = 3,276,800 B.
- A 8,192-token request: ``cdiv(8192, 400) = 21`` attention blocks + 9 x 1 Mamba blocks = 30.
- Weights (elements): embedding 100,352 x 1,536 = 154,140,672 (tied: no LM head); every layer the experts
  64 x 3 x 1,536 x 512 = 150,994,944, shared MLP 3 x 1,536 x 1,024 = 4,718,592, router 98,304, two norms
  3,072 (155,814,912 x 40); Mamba layers in_proj 1,536 x (3,072 + 3,328 + 48) = 9,904,128, out_proj
  4,718,592, conv1d 3,328 x (4 + 1) = 16,640, D + dt_bias 96, gated norm 3,072, A 48 in fp32
  (14,642,576 x 36); attention q, k, v, o 1,536 x (1,536 + 1,024) + 1,536^2 = 6,291,456 x 4; final norm
  1,536: 6,939,037,248 parameters, 13,878,074,496 + 36 x 48 x 2 (A's extra bytes) = 13,878,077,952 B.
- vLLM 0.26 logs ``GPU KV cache size = int(num_blocks / 30 x 8192)`` and ``Maximum concurrency =
  num_blocks / 30``; num_blocks is what the budget leaves over 3,276,800 B a block.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from servetune.errors import SpecError
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.hybrid import hybrid_block_size, hybrid_kinds, mamba_ssm_dtype_bytes, mamba_state_bytes
from servetune.planner.modelclass import kv_layout
from servetune.planner.modelinfo import ModelProfile, load_model, profile_from_config
from servetune.planner.vllm_rules import memory_rules

ROOT = Path(__file__).resolve().parents[2]
H100 = get_gpu("H100-80GB")
FLAGS = {"gpu_memory_utilization": 0.9, "max_model_len": 8192, "enable_prefix_caching": False, "max_num_seqs": 256}

#: NVIDIA-Nemotron-Nano-9B-v2's shape, as public code quotes its config.json (56 layers: 27 Mamba, 4 attention,
#: 25 MLP); a test input, not a shipped config.
NEMOTRON_NANO_9B = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4480,
    "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 15680,
    "vocab_size": 131072, "max_position_embeddings": 131072, "num_hidden_layers": 56,
    "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "mamba_num_heads": 128, "mamba_head_dim": 80, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
    "use_conv_bias": True, "use_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def _nemotron(**extra: object) -> ModelProfile:
    return profile_from_config({**NEMOTRON_NANO_9B, **extra}, "nemotron-nano-9b-v2", source="n/config.json")


def test_granite_tiny_worked_example_at_026():
    """The module docstring's hand computation, step by step."""
    m = load_model("granite-4.0-h-tiny")
    assert m.is_hybrid and (m.layer_types.count("mamba"), m.layer_types.count("full")) == (36, 4)
    assert [i for i, k in enumerate(m.layer_types) if k == "full"] == [5, 15, 25, 35]
    assert mamba_state_bytes(m, 1, 2) == 3 * 3328 * 2 + 48 * 64 * 128 * 2 == 806_400
    assert m.param_count == 6_939_037_248
    assert m.stage_weight_bytes(1, 1) == [13_878_077_952]  # no rotary table: NoPE
    c = resolve_engine_config(FLAGS, m, H100, "0.26.0")
    assert (c.block_size, c.enable_prefix_caching, c.v1_runner) == (400, False, True)
    lay = kv_layout(m, 1, 0, 1, c.block_size, 2, c.max_model_len)
    assert (lay.page_bytes, lay.group_size, lay.groups) == (819_200, 4, ("full",) + ("mamba",) * 9)
    assert lay.block_bytes == 3_276_800 and lay.blocks_per_request(8192, 400, 8192) == 21 + 9
    p = plan_memory(m, H100, c)
    assert p.fits and p.block_size == 400
    assert p.num_gpu_blocks == int(p.memory.kv_cache * 2**30) // 3_276_800
    assert p.max_concurrency == pytest.approx(p.num_gpu_blocks / 30)
    assert p.kv_cache_tokens == int(p.num_gpu_blocks / 30 * 8192)
    assert any(n.startswith("Mamba2 hybrid: 36 of 40 layers") and "simulator" in n for n in p.notes)


def test_logged_tokens_before_025_take_the_smallest_block_of_every_group():
    """0.11.0 / 0.19.0: ``num_blocks // len(groups) * min_block_size``; a Mamba group's block is max_model_len."""
    m = load_model("granite-4.0-h-tiny")
    for version in ("0.11.0", "0.19.0"):
        p = plan_memory(m, H100, resolve_engine_config(FLAGS, m, H100, version))
        assert p.kv_cache_tokens == p.num_gpu_blocks // 10 * 400
    short = resolve_engine_config({**FLAGS, "max_model_len": 256}, m, H100, "0.19.0")
    p = plan_memory(m, H100, short)
    assert short.block_size == 400 and p.kv_cache_tokens == p.num_gpu_blocks // 10 * 256
    assert p.max_concurrency == pytest.approx(p.num_gpu_blocks / (1 + 9))


def test_block_alignment_follows_the_release():
    """A user block size of 32: 0.19 aligns to 16 (400), 0.22+ to max(16, block_size) (32 x cdiv(806400, 65536));
    of 128: 0.19 still 400, 0.26 128 x cdiv(806400, 262144)."""
    m = load_model("granite-4.0-h-tiny")
    assert resolve_engine_config({**FLAGS, "block_size": 32}, m, H100, "0.19.0").block_size == 400
    assert resolve_engine_config({**FLAGS, "block_size": 32}, m, H100, "0.26.0").block_size == 416
    assert resolve_engine_config({**FLAGS, "block_size": 128}, m, H100, "0.26.0").block_size == 512  # 128 x 4
    assert resolve_engine_config({**FLAGS, "block_size": 128}, m, H100, "0.19.0").block_size == 400
    assert hybrid_block_size(m, 1, 16, 1, 2, True) == 16 * -(-806_400 // (16 * 1024))  # fp8 KV: 1 byte


def test_tp_widens_a_single_group_and_splits_heads():
    """n_groups 1 at TP=2: the groups are widened to 2 (extra_groups_for_head_shards), then halved."""
    m = load_model("granite-4.0-h-tiny")
    assert mamba_state_bytes(m, 2, 2) == 3 * (3072 + 2 * 2 * 128) // 2 * 2 + 24 * 64 * 128 * 2
    assert hybrid_block_size(m, 2, 16, 2, 2, True) == 16 * -(-mamba_state_bytes(m, 2, 2) // (16 * 1024))


def test_nemotron_h_state_dtype_by_release():
    """float16 (0.13-0.19) and float32 (0.22+) defaults, the config's own field first; 0.11 the model dtype."""
    n = _nemotron()
    assert n.layer_types.count("mamba") == 27 and n.layer_types.count("full") == 4 and n.layer_types.count("mlp") == 25
    conv = 3 * (10240 + 2 * 8 * 128) * 2
    assert mamba_state_bytes(n, 1, 2) == conv + 128 * 80 * 128 * 2
    blocks = {v: resolve_engine_config({"max_model_len": 8192}, n, H100, v).block_size
              for v in ("0.11.0", "0.19.0", "0.26.0")}
    assert blocks == {"0.11.0": 16 * -(-(conv + 2_621_440) // 65536), "0.19.0": 672, "0.26.0": 1312}
    f32 = _nemotron(mamba_ssm_cache_dtype="float32")
    assert mamba_ssm_dtype_bytes(f32, memory_rules((0, 19, 0)).nemotron_h_ssm_default) == 4
    assert mamba_ssm_dtype_bytes(f32, memory_rules((0, 11, 0)).nemotron_h_ssm_default) == 2
    assert round(n.param_count / 1e9, 2) == 8.89 and n.no_rope and not n.ffn_gated


def test_nemotron_mlp_layers_hold_no_kv_and_two_matrices():
    n = _nemotron()
    lay = kv_layout(n, 1, 0, 1, 672, 2, 8192)
    assert lay.group_size == 4 and lay.groups == ("full",) + ("mamba",) * 7  # cdiv(27, 4) Mamba groups
    linear, plain, fp32 = n._hybrid_layer_elems("mlp", 1)
    assert (linear, plain, fp32) == (2 * 4480 * 15680, 4480, 0)


def test_granite_without_mamba_layers_is_a_plain_model():
    """granite-4.0-micro's shape: every layer attention, vLLM's is_hybrid false; the shared MLP is its FFN."""
    cfg = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "hidden_size": 2560,
           "num_hidden_layers": 4, "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 8192,
           "shared_intermediate_size": 8192, "num_local_experts": 0, "vocab_size": 100352,
           "max_position_embeddings": 131072, "layer_types": ["attention"] * 4}
    m = profile_from_config(cfg, "micro")
    assert not m.is_hybrid and m.layer_types == () and m.intermediate_size == 8192 and not m.is_moe
    assert resolve_engine_config({}, m, H100, "0.26.0").block_size == 16
    assert hybrid_kinds(cfg) == []


def test_prefix_caching_on_a_hybrid():
    """Off by default; 0.11.0 forces it off whatever the flag; from 0.11.1 it is honoured (the Mamba cache modes:
    tests/planner/test_hybrid_prefix_caching.py); past the releases read (0.29 on) it is refused."""
    m = load_model("granite-4.0-h-tiny")
    assert not resolve_engine_config({}, m, H100, "0.26.0").enable_prefix_caching
    assert not resolve_engine_config({"enable_prefix_caching": True}, m, H100, "0.11.0").enable_prefix_caching
    assert resolve_engine_config({"enable_prefix_caching": True}, m, H100, "0.19.0").enable_prefix_caching
    with pytest.raises(SpecError) as err:
        resolve_engine_config({"enable_prefix_caching": True}, m, H100, "0.29.0")
    assert err.value.field == "enable_prefix_caching" and "not modelled" in err.value.message
    assert resolve_engine_config({}, load_model("llama-3.1-8b"), H100, "0.26.0").enable_prefix_caching


@pytest.mark.parametrize("cfg, field", [
    ({"model_type": "qwen3_5", "layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
    ({**NEMOTRON_NANO_9B, "hybrid_override_pattern": "MOM*" * 14}, "hybrid_override_pattern"),
    ({**NEMOTRON_NANO_9B, "hybrid_override_pattern": "MEM*" * 14}, "n_routed_experts"),
    ({**NEMOTRON_NANO_9B, "hybrid_override_pattern": "MEM*" * 14, "n_routed_experts": 8, "num_experts_per_tok": 2,
      "moe_intermediate_size": 512, "block_configs": [{"block_type": "moe", "n_routed_experts": 8}]}, "block_configs"),
    ({**NEMOTRON_NANO_9B, "intermediate_size": [15680, 12000]}, "intermediate_size"),
    ({"model_type": "jamba", "architectures": ["JambaForCausalLM"]}, "model_type"),
])
def test_what_is_not_modelled_is_still_refused(cfg, field):
    with pytest.raises(SpecError) as err:
        profile_from_config(cfg, "m", source="m/config.json")
    assert err.value.field == f"m/config.json: {field}" and err.value.fix and "\n" not in str(err.value)


def test_plan_refuses_hybrid_prefix_caching_past_the_releases_read_in_one_line_with_exit_2():
    proc = subprocess.run([sys.executable, "-m", "servetune", "plan", "--model", "granite-4.0-h-tiny", "--gpu",
                           "H100-80GB", "--set", "enable_prefix_caching=true", "--vllm-version", "0.30.0"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT / "platform"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    assert len(lines) == 1 and "enable_prefix_caching" in lines[0] and "fix:" in lines[0]


def test_026_refuses_more_sequences_than_mamba_blocks():
    """0.20+ (config/compilation.py): FULL decode graphs need one Mamba block per sequence; eager starts do not."""
    m = load_model("granite-4.0-h-tiny")
    flags = {**FLAGS, "kv_cache_memory_bytes": 100 * 3_276_800, "max_num_seqs": 128, "max_model_len": 2048}
    p = plan_memory(m, H100, resolve_engine_config(flags, m, H100, "0.26.0"))
    assert p.failure is not None and p.failure.value == "kv_too_small"
    assert "max_num_seqs (128) exceeds available Mamba cache blocks (100)" in (p.cause or "")
    assert p.fix is not None and p.fix.startswith("lower max_num_seqs to <= 100")
    assert plan_memory(m, H100, resolve_engine_config(flags, m, H100, "0.19.0")).fits
    assert plan_memory(m, H100, resolve_engine_config({**flags, "enforce_eager": True}, m, H100, "0.26.0")).fits


def test_qwen3_next_gated_delta_net():
    """Qwen3-Next-80B-A3B: the gated delta net's state (gated_delta_net_state_shape) is conv 3 x (2 x 16 x 128 +
    32 x 128) bf16 = 49,152 B plus temporal 32 x 128 x 128 bf16 = 1,048,576 B; attention 2 x 2 x 256 x 2 = 2,048 B
    a token, so the block is 16 x cdiv(1,097,728, 32,768) = 544; 36 linear and 12 full layers: group size 12,
    1 full + 3 linear groups. The weights (MTP layers skipped, as vLLM's loader does) come to 79,674,391,296
    parameters, 3,874,929,408 active: the totals public code reads off the checkpoint (a test quoting
    Qwen3-Coder-Next, the same shape)."""
    m = load_model("qwen3-next-80b-a3b")
    assert m.layer_types[:4] == ("mamba", "mamba", "mamba", "full") and m.layer_types.count("full") == 12
    assert mamba_state_bytes(m, 1, 2) == 3 * (2 * 16 * 128 + 32 * 128) * 2 + 32 * 128 * 128 * 2 == 1_097_728
    assert (m.param_count, m.active_param_count) == (79_674_391_296, 3_874_929_408)
    assert m.rotary_dim == 64 and m.attn_output_gate
    c = resolve_engine_config({"tensor_parallel_size": 2, "max_model_len": 32768}, m, get_gpu("H200"), "0.26.0")
    assert c.block_size == 16 * -(-(1_097_728 // 2) // (16 * 1024)) == 544  # one KV head a rank at TP=2
    lay = kv_layout(m, 2, 0, 1, c.block_size, 2, c.max_model_len)
    assert lay.group_size == 12 and lay.groups == ("full", "mamba", "mamba", "mamba")
    p = plan_memory(m, get_gpu("H200"), c)
    assert p.fits and p.max_concurrency == pytest.approx(p.num_gpu_blocks / (-(-32768 // 544) + 3))
    assert resolve_engine_config({"tensor_parallel_size": 4}, m, get_gpu("H200"), "0.26.0").block_size == 272


#: Bamba-9B's shape as its model card describes it (32 layers, attention at 9, 18, 27); a test input.
BAMBA = {"architectures": ["BambaForCausalLM"], "model_type": "bamba", "hidden_size": 4096, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
         "max_position_embeddings": 4096, "attn_layer_indices": [9, 18, 27], "attn_rotary_emb": 64,
         "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
         "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False, "tie_word_embeddings": False}


def test_bamba_until_its_removal():
    """Bamba: granite's Mamba2 mixer, a gated MLP in every layer, a 64-wide rotary table; state 3 x (8192 + 256) x 2
    + 128 x 64 x 128 x 2 = 2,147,840 B, block 16 x cdiv(2,147,840, 16 x 4,096) = 528; 3 attention and 29 Mamba
    layers: 1 + cdiv(29, 3) = 11 groups. vLLM 0.24 dropped the architecture (models/registry.py)."""
    m = profile_from_config(BAMBA, "bamba-9b")
    assert [i for i, k in enumerate(m.layer_types) if k == "full"] == [9, 18, 27] and m.rotary_dim == 64
    assert mamba_state_bytes(m, 1, 2) == 2_147_840
    c = resolve_engine_config({"max_model_len": 4096}, m, H100, "0.19.0")
    assert c.block_size == 528 and kv_layout(m, 1, 0, 1, 528, 2, 4096).groups == ("full",) + ("mamba",) * 10
    p = plan_memory(m, H100, c)
    assert p.kv_cache_tokens == p.num_gpu_blocks // 11 * 528
    assert resolve_engine_config({}, m, H100, "0.23.0").block_size == 528
    with pytest.raises(SpecError, match="was supported in vLLM until v0.23.0"):
        resolve_engine_config({}, m, H100, "0.24.0")


def test_incomplete_or_attention_free_hybrids_are_refused():
    with pytest.raises(SpecError, match="without attention layers"):
        profile_from_config({**BAMBA, "attn_layer_indices": []}, "m")
    cfg = {k: v for k, v in NEMOTRON_NANO_9B.items() if k != "ssm_state_size"}
    with pytest.raises(SpecError) as err:
        profile_from_config(cfg, "m", source="m/config.json")
    assert err.value.field == "m/config.json: ssm_state_size"


#: Falcon-H1-7B's shape as public code quotes its config.json; a test input.
FALCON_H1_7B = {"architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "hidden_size": 3072,
                "num_hidden_layers": 44, "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
                "intermediate_size": 12288, "vocab_size": 130048, "tie_word_embeddings": False, "mamba_d_state": 256,
                "mamba_n_groups": 1, "mamba_n_heads": 24, "mamba_d_head": 128, "mamba_d_ssm": 3072, "mamba_expand": 2,
                "mamba_d_conv": 4, "mamba_chunk_size": 128, "max_position_embeddings": 262144}


def test_falcon_h1_runs_attention_and_mamba_in_every_layer():
    """FalconH1ParallelHybrid: 44 attention and 44 Mamba layers, so group size 44 and two groups; state 3 x (3072 +
    2 x 256) x 2 + 24 x 128 x 256 x 2 = 1,594,368 B, block 16 x cdiv(1,594,368, 16 x 1,024) = 1,568. At 0.26's
    default max_num_seqs (1024 on an H100) the blocks do not cover the sequences: vLLM's own refusal."""
    m = profile_from_config(FALCON_H1_7B, "falcon-h1-7b")
    assert m.is_hybrid and set(m.layer_types) == {"parallel"} and m.mamba_inner == 3072 and m.mamba_mup_vector
    assert mamba_state_bytes(m, 1, 2) == 1_594_368 and m.kv_bytes_per_token(1, 1) == 44 * 1024
    c = resolve_engine_config({"max_model_len": 32768, "max_num_seqs": 256}, m, H100, "0.26.0")
    lay = kv_layout(m, 1, 0, 1, c.block_size, 2, 32768)
    assert c.block_size == 1568 and (lay.group_size, lay.groups) == (44, ("full", "mamba"))
    p = plan_memory(m, H100, c)
    assert p.fits and p.max_concurrency == pytest.approx(p.num_gpu_blocks / (-(-32768 // 1568) + 1))
    linear, plain, _ = m._hybrid_layer_elems("parallel", 1)
    mup = 2 * 3072 + 2 * 256 + 24
    assert plain == 2 * 3072 + (3072 + 2 * 256) * 5 + 2 * 24 + mup  # norms, conv1d + bias, D + dt_bias, mup_vector
    refused = plan_memory(m, H100, resolve_engine_config({"max_model_len": 32768}, m, H100, "0.26.0"))
    assert refused.failure is not None and "max_num_seqs (1024) exceeds available Mamba cache blocks" in (refused.cause or "")


def test_tp_must_divide_the_mamba_heads_and_groups():
    """MambaMixer2's asserts: 48 granite Mamba heads do not split over 32 ranks (attention's 12 heads already refuse
    it); Nemotron-H's 8 groups do not split over 16 ranks; one group is widened instead."""
    n = _nemotron()
    with pytest.raises(SpecError, match="num_groups must equal 1"):
        resolve_engine_config({"tensor_parallel_size": 16}, _nemotron(num_attention_heads=64, num_key_value_heads=16), H100)
    assert resolve_engine_config({"tensor_parallel_size": 8}, n, H100).tensor_parallel_size == 8
    with pytest.raises(SpecError, match="must divide num heads"):
        resolve_engine_config({"tensor_parallel_size": 8}, _nemotron(mamba_num_heads=132), H100)
    assert resolve_engine_config({"tensor_parallel_size": 4}, load_model("granite-4.0-h-tiny"), H100).block_size > 16



FIXTURE_MODELS = ROOT / "tests" / "fixtures" / "published_logs" / "models"


def test_qwen3_5_dense_reads_its_text_config_as_a_gated_delta_net():
    """Qwen3.5-9B (the partial fixture config, every value sourced in its ``_source``): Qwen3_5ForConditionalGeneration's
    language model is Qwen3-Next's decoder with a dense gated MLP (qwen3_5.py lines 113-172 of 0.26.0). Its text
    config's mamba_ssm_dtype float32 (Qwen3_5ForConditionalGenerationConfig) makes the temporal state 32 x 128 x 128 x
    4 = 2,097,152 B; conv 3 x (2 x 16 x 128 + 32 x 128) bf16 = 49,152 B; attention 2 x 4 x 256 x 2 = 4,096 B a token,
    so the block is 16 x cdiv(2,146,304, 65,536) = 528 (the 0.19.0 L40S start logs 528; bf16 would give 272)."""
    m = load_model(FIXTURE_MODELS / "qwen3.5-9b")
    assert m.architecture == "Qwen3_5ForConditionalGeneration" and m.mamba_kind == "gdn" and not m.is_moe
    assert m.layer_types.count("mamba") == 24 and m.layer_types[3] == "full" and m.intermediate_size == 12288
    assert m.attn_output_gate and m.rotary_dim == 64 and m.max_position_embeddings == 262144
    assert mamba_ssm_dtype_bytes(m, "float32") == 4
    assert mamba_state_bytes(m, 1, 4) == 49_152 + 2_097_152
    assert resolve_engine_config({}, m, get_gpu("L40S"), "0.19.0").block_size == 528
    bf16 = dataclasses.replace(m, mamba_ssm_dtype="")
    assert resolve_engine_config({}, bf16, get_gpu("L40S"), "0.19.0").block_size == 272
    # No vision_config: vLLM builds Qwen3_5VisionConfig's default tower (27 blocks of 1152, MLP 4304, out 3584):
    # 27 x 15,239,504 + patch / position embeddings 4,424,832 + norm 2,304 + merger 37,756,928
    assert m.vision_params == 27 * 15_239_504 + 4_424_832 + 2_304 + 37_756_928 == 453_650_672


def test_qwen3_5_wrapper_sets_the_text_config_class_and_counts_the_tower_it_names():
    """The wrapper's text_config is a Qwen3_5TextConfig whatever its own model_type (the Qwen3.8-27B fixture has
    none); a vision_config is counted as Qwen3_VisionTransformer builds it (0.8B: 12 blocks of 768, MLP 3072,
    out 1024: 12 x 7,087,872 + 2,949,888 + 1,536 + 12,587,008)."""
    m = load_model(FIXTURE_MODELS / "qwen3.8-27b")
    assert m.num_layers == 64 and m.layer_types.count("full") == 16 and m.vocab_size == 248320
    assert (m.mamba_heads, m.mamba_groups, m.mamba_d_state) == (48, 16, 128)
    small = load_model(FIXTURE_MODELS / "qwen3.5-0.8b")
    assert small.tie_word_embeddings and small.vision_params == 12 * 7_087_872 + 2_949_888 + 1_536 + 12_587_008
    with pytest.raises(SpecError) as err:
        profile_from_config({"model_type": "qwen3_5", "vision_config": {"depth": "deep"},
                             "text_config": {"num_hidden_layers": 4}}, "m", source="m/config.json")
    assert err.value.field == "m/config.json: vision_config"


def test_an_all_moe_gated_delta_net_needs_no_dense_intermediate_size():
    """vLLM builds a dense MLP of intermediate_size only for layers that are not MoE (qwen3_next.py lines 421-466
    of 0.26.0): a Qwen3-Next config without it plans the same; mlp_only_layers still refuses. Qwen3_5MoeTextConfig
    has no intermediate_size at all."""
    import json
    cfg = json.loads((ROOT / "platform" / "servetune" / "data" / "models" / "qwen3-next-80b-a3b" / "config.json")
                     .read_text())
    bare = {k: v for k, v in cfg.items() if k != "intermediate_size"}
    assert profile_from_config(bare, "n").param_count == load_model("qwen3-next-80b-a3b").param_count
    with pytest.raises(SpecError) as err:
        profile_from_config({**bare, "mlp_only_layers": [0]}, "n", source="n/config.json")
    assert "mlp_only_layers" in err.value.field
    moe = profile_from_config({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                               "text_config": {"num_hidden_layers": 8}}, "m")
    assert moe.is_moe and moe.intermediate_size == 0 and (moe.num_experts, moe.num_experts_per_tok) == (256, 8)
    assert moe.layer_types.count("mamba") == 6 and moe.shared_expert_intermediate_size == 512


def test_028_turns_prefix_caching_on_for_hybrids_in_align_mode():
    """0.28.0 defaults prefix caching on for hybrids (arg_utils.py line 2650) with mamba_cache_mode 'align':
    each request holds two Mamba blocks a group (kv_cache_interface.py lines 687-696), so granite-4.0-h-tiny's
    8,192-token request takes cdiv(8192, 400) = 21 attention blocks + 9 x 2 Mamba blocks = 39, against 30 at
    0.27.0, where it stays opt-in (arg_utils.py lines 2604-2606)."""
    m = load_model("granite-4.0-h-tiny")
    flags = {k: v for k, v in FLAGS.items() if k != "enable_prefix_caching"}
    on = resolve_engine_config(flags, m, H100, "0.28.0")
    off = resolve_engine_config(flags, m, H100, "0.27.0")
    assert on.enable_prefix_caching and not off.enable_prefix_caching and on.block_size == off.block_size == 400
    p_on, p_off = plan_memory(m, H100, on), plan_memory(m, H100, off)
    assert p_on.max_concurrency == pytest.approx(p_on.num_gpu_blocks / 39)
    assert p_off.max_concurrency == pytest.approx(p_off.num_gpu_blocks / 30)
    assert not resolve_engine_config({**flags, "enable_prefix_caching": False}, m, H100, "0.28.0").enable_prefix_caching
    asked = resolve_engine_config({**flags, "enable_prefix_caching": True}, m, H100, "0.27.0")
    assert asked.mamba_cache_mode == "all" and on.mamba_cache_mode == "align"  # asked for at 0.27: granite's 'all'


def test_an_mrope_model_keeps_four_times_the_rotary_rows():
    """MRotaryEmbedding's cos/sin cache holds 4 x max_position rows (rotary_embedding/mrope.py line 238 of 0.26.0):
    Qwen3.5-9B's 262,144 positions x 64 rotary dims in bf16 are 4 x 33,554,432 B, where a plain rope keeps one."""
    m = load_model(FIXTURE_MODELS / "qwen3.5-9b")
    assert m.extra_rotary_positions == 3 * 262144
    plain = dataclasses.replace(m, extra_rotary_positions=0)
    assert m.stage_weight_bytes(1, 1)[0] - plain.stage_weight_bytes(1, 1)[0] == 3 * 262144 * 64 * 2
    assert load_model("qwen3-next-80b-a3b").extra_rotary_positions == 0


def test_the_fused_moe_workspace_outlives_the_forward_from_011(monkeypatch: pytest.MonkeyPatch):
    """0.10.2 allocates the Triton fused-MoE workspaces per call (freed after each layer); 0.11 keeps them in shared
    buffers, so the profile run's sampler runs beside them. Qwen3-Next at TP=2 on an H200, 8,192 tokens, FlashInfer
    absent (the sort-based sampler dominates the forward): the 0.11 rules add the workspace to the peak."""
    from servetune.planner.model_memory import activation_peak_bytes
    from servetune.planner.modelclass import moe_workspace_bytes
    assert not memory_rules((0, 10, 2)).moe_workspace_kept and memory_rules((0, 11, 0)).moe_workspace_kept
    m = load_model("qwen3-next-80b-a3b")
    c = dataclasses.replace(resolve_engine_config({"tensor_parallel_size": 2}, m, get_gpu("H200"), "0.10.2"),
                            flashinfer_available=False)
    freed = activation_peak_bytes(m, c)
    from servetune.planner import engine_config
    monkeypatch.setattr(engine_config, "memory_rules",
                        lambda v: dataclasses.replace(memory_rules(v), moe_workspace_kept=True))
    ws = moe_workspace_bytes(m, c.max_num_batched_tokens, 2)
    assert ws == 8192 * (10 * (2048 + 2048) + 2048) * 2
    assert activation_peak_bytes(m, c) - freed == ws


def test_the_qwen3_vl_encoder_profiles_one_image_of_the_processors_largest_size():
    """vLLM's profile run encodes the modality with the most tokens per item (MultiModalBudget, multimodal/
    encoder_budget.py lines 147-187 of 0.28.0, 140-180 of 0.19.0): an image of 16,777,216 pixels is 128 x 128 merged
    tokens of 32 x 32 pixels = 16,384 (the "budget of 16384 tokens" the published logs print), 65,536 patches, over a
    two-frame video of 25,165,824 / 2 pixels, 12,288; ``max(1, min(max(mbt, T) // T, max_num_seqs x max(1,
    max_model_len // T)))`` of them: one up to 16,384 batched tokens, two at 32,768, capped by max_num_seqs x items
    a prompt."""
    from servetune.planner.modelclass import qwen3_vl_encoder_profile
    enc = load_model(FIXTURE_MODELS / "qwen3.5-0.8b").vision_encoder
    assert enc is not None and (enc.hidden, enc.intermediate, enc.patch_elems, enc.out_hidden) == (768, 3072, 1536, 1024)
    for mbt, seqs, items in ((2048, 32, 1), (8192, 256, 1), (16384, 256, 1), (32768, 256, 2), (65536, 3, 4)):
        p = qwen3_vl_encoder_profile(enc, 2, 1, mbt, seqs, 262144)  # 16 items a prompt: 3 x 16 does not bind
        assert (p.items, p.tokens_per_item, p.patches) == (items, 16384, items * 65536), mbt
    assert qwen3_vl_encoder_profile(enc, 2, 1, 65536, 3, 16384).items == 3  # one a prompt: 3 sequences bind
    assert load_model(FIXTURE_MODELS / "qwen3.5-9b").vision_encoder.out_hidden == 3584  # Qwen3_5VisionConfig default


def test_the_encoder_pass_peak_is_counted_row_by_row():
    """Per patch, in the model dtype: the pixels (3 x 2 x 16 x 16 = 1,536, already bf16, held by profile_run), the
    position embeddings (h) and a block's larger half: attention 3 + 8/TP rows of h (residual, norm1 output, proj
    output; qkv 3, the q/k copy 2, the rotated q/k 2, the FlashAttention output 1, each split by TP), the MLP 2 rows
    + 2 x I/TP (fc1 and its activation). 0.8B tower at TP=1: 65,536 x (1,536 + 768 x 12) x 2 B; at TP=2 the attention
    (7 rows) still outweighs the MLP (2 + 4); held through the language model: the pixels and 16,384 x 1,024 outputs."""
    from servetune.planner.modelclass import qwen3_vl_encoder_profile
    enc = load_model(FIXTURE_MODELS / "qwen3.5-0.8b").vision_encoder
    one = qwen3_vl_encoder_profile(enc, 2, 1, 8192, 256, 262144)
    assert one.peak_bytes == 65536 * (1536 + 768 * 12) * 2
    assert one.held_bytes == 65536 * 1536 * 2 + 16384 * 1024 * 2
    assert qwen3_vl_encoder_profile(enc, 2, 2, 8192, 256, 262144).peak_bytes == 65536 * (1536 + 768 * 8) * 2
    wide = dataclasses.replace(enc, intermediate=8 * 768)  # an MLP of 8h outweighs attention's 11 rows: 2 + 16
    assert qwen3_vl_encoder_profile(wide, 2, 1, 8192, 256, 262144).peak_bytes == 65536 * (1536 + 768 * 19) * 2
    deep = dataclasses.replace(enc, deepstack=3)  # Qwen3-VL's deepstack features add to the peak and the outputs
    d = qwen3_vl_encoder_profile(deep, 2, 1, 8192, 256, 262144)
    assert d.peak_bytes - one.peak_bytes == 3 * 16384 * 1024 * 2 and d.held_bytes - one.held_bytes == 3 * 16384 * 1024 * 2


def test_the_profile_peak_is_the_encoder_pass_or_the_language_model_with_what_it_holds():
    """The encoder runs first; the language model then runs with the pixels and the outputs still allocated
    (gpu_model_runner.py profile_run, lines 6558-6631 of 0.28.0): the profiled peak is the larger of the two, on the
    first PP stage only. Qwen3.5-9B offline on an L40S at 0.19.0 (8,192 tokens, 256 rows): the encoder's 1.875 GiB;
    at 1,024 sequences the language model and sampler, 3.53 GiB, plus the 0.30 GiB held win; the gemma-3 constant no
    longer applies."""
    from servetune.planner.model_memory import activation_peak_bytes
    from servetune.planner.modelclass import multimodal_profile_bytes, qwen3_vl_encoder_profile
    m = load_model(FIXTURE_MODELS / "qwen3.5-9b")
    c = resolve_engine_config({"max_num_batched_tokens": 8192}, m, get_gpu("L40S"), "0.19.0")
    enc = qwen3_vl_encoder_profile(m.vision_encoder, 2, 1, 8192, c.max_num_seqs, c.max_model_len)
    text = activation_peak_bytes(m, c, first_stage=False)
    assert multimodal_profile_bytes(m, 8192) == 0 and text + enc.held_bytes < enc.peak_bytes
    assert activation_peak_bytes(m, c) == enc.peak_bytes == int(1.875 * 2**30)
    many = dataclasses.replace(c, max_num_seqs=1024)
    assert activation_peak_bytes(m, many) == activation_peak_bytes(m, many, first_stage=False) + enc.held_bytes
    bare = dataclasses.replace(m, vision_encoder=None, vision_params=0)
    assert activation_peak_bytes(bare, c) == text
