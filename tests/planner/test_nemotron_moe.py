"""Nemotron-H MoE (``E``) layers in the planner: the rules read from vLLM's ``NemotronHMoE`` (hybrid.nemotron_moe_fields).

Worked example, the shipped ``nemotron-3-nano-30b-a3b`` (NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json): 52 layers,
``MEMEM*EMEMEM*...`` = 23 Mamba2, 23 MoE, 6 attention; hidden 2688, vocab 131,072 (untied); Mamba2 64 heads x 64, 8 groups,
d_state 128, d_conv 4; attention 32 heads, 2 KV heads, head_dim 128, no rotary; 128 routed experts of 1856, top-6, one
shared expert of 3712, relu2 (non-gated); ``mamba_ssm_cache_dtype`` float32. Computed by hand, elements:

- embedding + LM head ``2 x 131,072 x 2,688`` = 704,643,072;
- a Mamba layer: in_proj ``2,688 x (4,096 + 6,144 + 64)`` = 27,697,152, out_proj ``4,096 x 2,688`` = 11,010,048, conv1d
  ``6,144 x (4 + 1)`` = 30,720, D + dt_bias 128, gated norm 4,096, RMSNorm 2,688, A 64 (fp32);
- an attention layer: q, o ``2 x 2,688 x 4,096`` + k, v ``2 x 2,688 x 256`` = 23,396,352, RMSNorm 2,688;
- a MoE layer: experts ``128 x 2 x 2,688 x 1,856`` = 1,277,165,568 (up + down: non-gated), shared expert
  ``2 x 2,688 x 3,712`` = 19,955,712, router ``2,688 x 128`` = 344,064 (fp32 before 0.17 and off Hopper / Blackwell),
  score-correction bias 128 (fp32), RMSNorm 2,688;
- final norm 2,688: 31,577,940,288 parameters (NVIDIA's model card: "31.6B total").
"""

from __future__ import annotations

import dataclasses

import pytest

from servetune.errors import SpecError
from servetune.planner.gpus import get_gpu
from servetune.planner.hybrid import mamba_state_bytes, nemotron_moe_fields
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelclass import as_loaded_on, class_notes, kv_layout, moe_workspace_bytes
from servetune.planner.modelinfo import load_model, profile_from_config
from servetune.planner.vllm_rules import memory_rules

H100 = get_gpu("H100-80GB")
NANO = "nemotron-3-nano-30b-a3b"
#: One MoE layer's router and score-correction bias, in fp32 where ``router_fp32``
ROUTER, BIAS = 2688 * 128, 128


def test_nano3_worked_example():
    """The module docstring's hand computation."""
    m = load_model(NANO)
    assert (m.layer_types.count("mamba"), m.layer_types.count("moe"), m.layer_types.count("full")) == (23, 23, 6)
    assert m.layer_types[:6] == ("mamba", "moe", "mamba", "moe", "mamba", "full")
    assert (m.num_experts, m.num_experts_per_tok, m.expert_intermediate_size) == (128, 6, 1856)
    assert m.shared_expert_intermediate_size == 3712 and not m.ffn_gated and m.router_fp32 and m.router_score_bias
    assert m.no_rope and m.moe_latent_size == 0 and m.expert_hidden_size == 2688
    mamba = 27_697_152 + 11_010_048 + 30_720 + 128 + 4_096 + 2_688 + 64
    attn = 23_396_352 + 2_688
    moe = 1_277_165_568 + 19_955_712 + ROUTER + BIAS + 2_688
    params = 704_643_072 + 23 * mamba + 6 * attn + 23 * moe + 2_688
    assert m.param_count == params == 31_577_940_288
    fp32 = 23 * (64 + ROUTER + BIAS)  # A, router, bias: 4 bytes where the rest take 2
    assert m.stage_weight_bytes(1, 1) == [2 * params + 2 * fp32] == [63_171_716_352]
    # active: 6 of 128 experts
    assert m.param_count - m.active_param_count == 23 * 122 * 2 * 2688 * 1856


def test_router_dtype_follows_release_and_gpu():
    """ReplicatedLinear(params_dtype=float32) to 0.16; GateLinear from 0.17 keeps the model dtype where a specialized
    router kernel runs (compute capability 9.0, 10.x), fp32 elsewhere."""
    m = load_model(NANO)
    saved = 23 * ROUTER * 2  # fp32 -> bf16
    fp32 = m.stage_weight_bytes(1, 1)[0]
    on = {(v, g): as_loaded_on(m, get_gpu(g), memory_rules(memory_rules_version(v))).stage_weight_bytes(1, 1)[0]
          for v in ("0.16.0", "0.17.0", "0.26.0") for g in ("H100-80GB", "A100-80GB", "L40S", "B200")}
    assert {k: fp32 - b for k, b in on.items()} == {
        ("0.16.0", "H100-80GB"): 0, ("0.16.0", "A100-80GB"): 0, ("0.16.0", "L40S"): 0, ("0.16.0", "B200"): 0,
        ("0.17.0", "H100-80GB"): saved, ("0.17.0", "A100-80GB"): 0, ("0.17.0", "L40S"): 0, ("0.17.0", "B200"): saved,
        ("0.26.0", "H100-80GB"): saved, ("0.26.0", "A100-80GB"): 0, ("0.26.0", "L40S"): 0, ("0.26.0", "B200"): saved}
    granite = load_model("granite-4.0-h-tiny")  # another hybrid MoE: its router stays in the model dtype
    assert not granite.router_fp32 and as_loaded_on(granite, H100, memory_rules((0, 26, 0))) is granite


def memory_rules_version(text: str) -> tuple[int, int, int]:
    major, minor, patch = (int(p) for p in text.split("."))
    return major, minor, patch


def test_non_gated_experts_take_two_matrices_and_a_narrower_workspace():
    """FusedMoE's w13 holds ``intermediate`` rows for a non-gated activation (``2 x intermediate`` gated): N = I / TP,
    and the activation's output is N wide (``adjust_N_for_activation``). At 8,192 tokens, TP=1: both workspaces
    ``max(1856, 2688)`` = K wide, so ``8192 x (6 x (2688 + 2688) + 2688)`` bf16 elements."""
    m = load_model(NANO)
    assert moe_workspace_bytes(m, 8192, 1) == 8192 * (6 * (2688 + 2688) + 2688) * 2
    wide = dataclasses.replace(m, moe_intermediate_size=8192)  # N > K: the activation is N wide, not N / 2
    assert moe_workspace_bytes(wide, 1, 1) == (6 * (8192 + 8192) + 2688) * 2
    gated = dataclasses.replace(wide, ffn_gated=True)  # the same sizes gated: N = 2 x 8192, activation N / 2
    assert moe_workspace_bytes(gated, 1, 1) == (6 * (8192 + 16384) + 2688) * 2
    assert m._expert_params(1) == 128 * 2 * 2688 * 1856 and gated._expert_params(1) == 128 * 3 * 2688 * 8192
    assert m._expert_params(2) == 128 * 2 * 2688 * 1856 // 2


def test_latent_moe_runs_the_experts_in_the_latent_width():
    """``moe_latent_size``: experts of ``latent x intermediate``, two replicated projections ``hidden <-> latent``
    (not split by TP), the workspace's K the latent width."""
    base = _nano_config()
    latent = profile_from_config({**base, "moe_latent_size": 1024}, "latent", source="l/config.json")
    plain = profile_from_config(base, "plain", source="p/config.json")
    assert latent.expert_hidden_size == 1024
    per_layer = 128 * 2 * (2688 - 1024) * 1856 - 2 * 2688 * 1024
    assert plain.param_count - latent.param_count == 23 * per_layer
    tp2 = (plain.stage_weight_bytes(2, 1)[0] - latent.stage_weight_bytes(2, 1)[0]) // 2  # bf16 elements
    assert tp2 == 23 * (128 * 2 * (2688 - 1024) * 1856 // 2 - 2 * 2688 * 1024)
    assert moe_workspace_bytes(latent, 1, 1) == (6 * (1856 + 1856) + 1024) * 2


def _nano_config() -> dict[str, object]:
    import json
    from servetune.planner.modelinfo import _DATA_DIR
    return {k: v for k, v in json.loads((_DATA_DIR / NANO / "config.json").read_text()).items() if k != "_source"}


def test_nano3_plans_on_one_h100():
    """bf16 KV: the attention block raised to ``16 x cdiv(2,134,016, 16 x 1,024)`` = 2,096 tokens (Mamba state: conv
    ``3 x 6,144`` bf16 + SSM ``64 x 64 x 128`` fp32); fp8 KV: ``16 x cdiv(2,134,016, 16 x 512)`` = 4,176."""
    m = load_model(NANO)
    assert mamba_state_bytes(m, 1, 4) == 3 * 6144 * 2 + 64 * 64 * 128 * 4 == 2_134_016
    flags = {"max_model_len": 32768, "enable_prefix_caching": False, "max_num_seqs": 256}
    c = resolve_engine_config(flags, m, H100, "0.26.0")
    assert c.block_size == 2096
    assert resolve_engine_config({**flags, "kv_cache_dtype": "fp8"}, m, H100, "0.26.0").block_size == 4176
    p = plan_memory(m, H100, c)
    assert p.fits and p.kv_cache_tokens > 100_000
    assert abs(p.memory.weights - 58.8185) < 0.001  # the router in bf16 on Hopper at 0.26
    notes = " ".join(class_notes(m, c.max_num_batched_tokens))
    assert "23 of 52 layers" in notes and "128 experts, top-6" in notes


def test_layout_matches_a_published_nemotron_h_moe_start():
    """Nemotron-Cascade-2-30B-A3B-NVFP4 (Nano-3's shape), vLLM 0.19.1, TP=1, fp8 KV, max_model_len 262,144 (a stored
    public copy of a SLURM job's log, id 59839511370, 2026-04-26; not in published_logs: its GPU is not named and its
    NVFP4 weights run through Marlin, which the planner does not model). Given its logged 68.97 GiB of KV memory, the
    layout read from the source before that log was seen gives its lines: "Setting attention block size to 4176
    tokens", "Padding mamba page size by 0.19%", "Add 1 padding layers" (4 Mamba groups of 6 for 23 layers), "GPU KV
    cache size: 4,819,104 tokens", "Maximum concurrency for 262,144 tokens per request: 86.16x"."""
    m = load_model(NANO)
    c = resolve_engine_config({"max_model_len": 262144, "kv_cache_dtype": "fp8", "max_num_batched_tokens": 8192,
                               "max_num_seqs": 40}, m, H100, "0.19.1")
    assert c.block_size == 4176 and round((4176 * 512 / 2_134_016 - 1) * 100, 2) == 0.19
    lay = kv_layout(m, 1, 0, 1, c.block_size, 1, c.max_model_len)
    assert lay.group_size == 6 and lay.groups == ("full",) + ("mamba",) * 4  # 24 Mamba slots for 23 layers
    blocks = int(68.975 * 2**30) // lay.block_bytes  # the logged 68.97 GiB, to its last shown digit
    per_request = lay.blocks_per_request(262144, c.block_size, c.max_in_flight_tokens)
    assert per_request == 63 + 4
    assert blocks // 5 * 4176 == 4_819_104 and round(blocks / per_request, 2) == 86.16


def test_moe_configs_the_planner_still_refuses():
    base = _nano_config()
    with pytest.raises(SpecError) as err:
        profile_from_config({**base, "block_configs": [{"block_type": "moe", "n_routed_experts": 64}]}, "p", "p/c.json")
    assert err.value.field == "p/c.json: block_configs"
    missing = {k: v for k, v in base.items() if k != "moe_intermediate_size"}
    with pytest.raises(SpecError) as err:
        profile_from_config(missing, "p", "p/c.json")
    assert err.value.field == "p/c.json: moe_intermediate_size"
    assert nemotron_moe_fields({})["shared_expert_intermediate_size"] == 0


def test_the_simulator_prices_only_the_moe_layers_experts():
    """The simulator reads the same profile: 23 of 52 layers route, two matrices an expert, the shared expert's up
    projection ``I`` wide (not ``2I``) on the router's layers."""
    from servetune.sim.perf_classes import class_gemms, moe_shape
    m = load_model(NANO)
    shape = moe_shape(m, H100, 1, 52)
    assert shape is not None and (shape.layers, shape.matrices, shape.hidden, shape.inter) == (23, 2, 2688, 1856)
    assert shape.expert_bytes == 2 * 2688 * 1856 * 2
    gemms = {(g.n, g.k): g.layers for g in class_gemms(m, H100, 1, 52)}
    assert gemms[(128, 2688)] == 23 and gemms[(3712, 2688)] == 23 and gemms[(2688, 3712)] == 23


def test_nano3_at_tp2_shards_the_experts_and_replicates_the_router():
    """TP=2, by hand (elements on one rank): vocab rows halved; a Mamba layer's in_proj / out_proj / conv halved (8
    groups divide 2), A per local head; attention q, o at 16 heads, one KV head; the routed and shared experts
    halved; the router, its bias and the norms whole."""
    m = load_model(NANO)
    embed = 2 * 65_536 * 2688
    mamba = 2688 * 10304 // 2 + 2048 * 2688 + 3072 * 5 + 2 * 32 + 2048 + 2688
    attn = 2 * 2688 * 2048 + 2 * 2688 * 128 + 2688
    moe = 128 * 2 * 2688 * 1856 // 2 + 2 * 2688 * 3712 // 2 + 2688
    fp32 = 23 * (32 + ROUTER + BIAS)
    bf16 = embed + 23 * mamba + 6 * attn + 23 * moe + 2688
    assert m.stage_weight_bytes(2, 1) == [2 * bf16 + 4 * fp32]


def test_releases_before_the_moe_layers_are_refused():
    """0.11.0 builds no E layer (ALL_DECODER_LAYER_TYPES), 0.12.0 no latent projection."""
    m = load_model(NANO)
    with pytest.raises(SpecError) as err:
        resolve_engine_config({"max_model_len": 8192}, m, H100, "0.11.0")
    assert err.value.field == "vllm_version" and "0.11.1" in err.value.message
    assert resolve_engine_config({"max_model_len": 8192}, m, H100, "0.11.1").block_size > 16
    latent = profile_from_config({**_nano_config(), "moe_latent_size": 1024}, "latent", source="l/config.json")
    with pytest.raises(SpecError) as err:
        resolve_engine_config({"max_model_len": 8192}, latent, H100, "0.12.0")
    assert "0.13.0" in err.value.message
    assert resolve_engine_config({"max_model_len": 8192}, latent, H100, "0.13.0").max_model_len == 8192
