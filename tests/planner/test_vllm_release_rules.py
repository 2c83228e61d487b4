"""Each vLLM 0.20-0.26 release's model-runner and sampler rule, pinned to what its wheel's source says.

The expectations below are read from the released wheels (``pip download vllm==X --no-deps
--only-binary=:all:``), not from servetune's tables: every row names the file and line it comes
from. ``vllm/config/vllm.py`` decides the runner (``VllmConfig.use_v2_model_runner`` ->
``_is_default_v2_model_runner_model`` over ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES``); ``envs.py``
and ``v1/sample/ops/topk_topp_sampler.py`` decide the sampler.
"""

from __future__ import annotations

import dataclasses

import pytest

from servetune.planner.engine_config import resolve_engine_config
from servetune.planner.gpus import get_gpu
from servetune.planner.model_memory import SAMPLER_V1_FLASHINFER_FP32_COPIES, sampler_profile_bytes
from servetune.planner.modelinfo import load_model
from servetune.planner.vllm_rules import memory_rules, runs_v2_runner

# (version, architecture, MoE, checkpoint-quantized) -> starts on the V2 model runner by default
RUNNER_BY_RELEASE = [
    # 0.20.0 / 0.21.0: envs.py 1675 / 1711, VLLM_USE_V2_MODEL_RUNNER defaults to "0"; no per-model rule
    ("0.20.0", "Qwen3ForCausalLM", False, False, False),
    ("0.21.0", "Qwen3ForCausalLM", False, False, False),
    ("0.21.0", "LlamaForCausalLM", False, False, False),
    # 0.22.0: config/vllm.py 69 {"Qwen3ForCausalLM"}; 532 "not model_config.is_moe and not model_config.is_quantized"
    ("0.22.0", "Qwen3ForCausalLM", False, False, True),
    ("0.22.0", "Qwen3ForCausalLM", False, True, False),
    ("0.22.0", "LlamaForCausalLM", False, False, False),
    ("0.22.0", "MistralForCausalLM", False, False, False),
    ("0.22.0", "Qwen2ForCausalLM", False, False, False),
    # 0.23.0: config/vllm.py 69-75 {Llama, Mistral, Qwen3}; 558 the same dense / unquantized check
    ("0.23.0", "LlamaForCausalLM", False, False, True),
    ("0.23.0", "MistralForCausalLM", False, False, True),
    ("0.23.0", "Qwen3ForCausalLM", False, False, True),
    ("0.23.0", "LlamaForCausalLM", False, True, False),
    ("0.23.0", "Qwen2ForCausalLM", False, False, False),
    ("0.23.0", "Qwen2MoeForCausalLM", True, False, False),
    ("0.23.0", "DeepseekV2ForCausalLM", True, False, False),
    # 0.24.0: config/vllm.py 68-77 adds DeepseekV2 / Qwen2Moe / GraniteMoe; 559-561 membership only
    ("0.24.0", "LlamaForCausalLM", False, True, True),
    ("0.24.0", "DeepseekV2ForCausalLM", True, False, True),
    ("0.24.0", "Qwen2MoeForCausalLM", True, False, True),
    ("0.24.0", "Qwen2ForCausalLM", False, False, False),
    ("0.24.0", "MixtralForCausalLM", True, False, False),
    ("0.24.0", "Qwen3MoeForCausalLM", True, False, False),
    # 0.25.0: config/vllm.py 68-74 {DeepseekV2, Qwen2Moe, GraniteMoe}; 571-574 "... or not model_config.is_moe"
    ("0.25.0", "Qwen2ForCausalLM", False, False, True),
    ("0.25.0", "Gemma2ForCausalLM", False, True, True),
    ("0.25.0", "DeepseekV2ForCausalLM", True, False, True),
    ("0.25.0", "MixtralForCausalLM", True, False, False),
    ("0.25.0", "Qwen3MoeForCausalLM", True, False, False),
    # 0.26.0: config/vllm.py 68-77 (adds Inkling, LongcatFlashNgram); 619-622 as 0.25
    ("0.26.0", "Qwen2ForCausalLM", False, False, True),
    ("0.26.0", "Qwen3MoeForCausalLM", True, False, False),
    ("0.26.0", "LongcatFlashNgramForCausalLM", True, False, True),
]


@pytest.mark.parametrize("version, architecture, is_moe, is_quantized, v2", RUNNER_BY_RELEASE)
def test_default_runner_by_release(version: str, architecture: str, is_moe: bool, is_quantized: bool,
                                   v2: bool) -> None:
    rules = memory_rules(tuple(int(p) for p in version.split(".")))  # type: ignore[arg-type]
    assert runs_v2_runner(rules, architecture=architecture, is_moe=is_moe, is_hybrid=False,
                          is_quantized=is_quantized) is v2


@pytest.mark.parametrize("version", ["0.22.0", "0.23.0", "0.24.0", "0.25.0", "0.26.0"])
def test_hybrid_models_stay_on_v1(version: str) -> None:
    """0.25/0.26 check ``is_hybrid`` first (config/vllm.py 565 / 613); 0.22-0.24 list no hybrid architecture."""
    rules = memory_rules(tuple(int(p) for p in version.split(".")))  # type: ignore[arg-type]
    assert not runs_v2_runner(rules, architecture="Qwen3ForCausalLM", is_moe=False, is_hybrid=True)


def _config(model_name: str, version: str, **changes: object):
    model = load_model(model_name)
    if changes:
        model = dataclasses.replace(model, **changes)
    return model, resolve_engine_config({}, model, get_gpu("H100-80GB"), version)


@pytest.mark.parametrize("model_name, v1_through, v2_from", [
    ("llama-3.1-8b", "0.22.0", "0.23.0"),        # LlamaForCausalLM joins the list in 0.23.0
    ("mistral-small-24b", "0.22.0", "0.23.0"),   # MistralForCausalLM likewise
    ("deepseek-v2-lite", "0.23.0", "0.24.0"),    # the first listed MoE architecture, 0.24.0
    ("qwen2.5-7b", "0.24.0", "0.25.0"),          # unlisted dense: every dense model from 0.25.0
])
def test_plan_takes_the_release_runner(model_name: str, v1_through: str, v2_from: str) -> None:
    """The plan's accounting follows the runner: the V1 runner takes its CUDA-graph estimate off the
    KV budget and warms its sampler up after capture; the V2 runner's ``profile_cudagraph_memory``
    returns 0 (v1/worker/gpu/model_runner.py 620 / 660 / 684 / 680 of 0.22-0.25) and it warms up
    with ``warmup_kernels`` (gpu_worker.py 685 of 0.22.0)."""
    _, before = _config(model_name, v1_through)
    _, after = _config(model_name, v2_from)
    assert not before.rules.v2_runner and before.rules.subtracts_cudagraph_estimate
    assert before.rules.sampler_warmup_after_capture
    assert after.rules.v2_runner and not after.rules.subtracts_cudagraph_estimate
    assert not after.rules.sampler_warmup_after_capture and not after.rules.triton_topk_topp


def test_quantized_checkpoint_waits_for_024() -> None:
    """0.22/0.23 keep a checkpoint with a ``quantization_config`` on V1 (``ModelConfig.is_quantized``);
    0.24 drops the check. Online ``--quantization fp8`` leaves the checkpoint config unquantized."""
    quantized = {"quantization": "fp8", "quant_bytes_per_param": 1.0}
    assert _config("llama-3.1-8b", "0.23.0", **quantized)[1].v1_runner
    assert not _config("llama-3.1-8b", "0.24.0", **quantized)[1].v1_runner
    model = load_model("llama-3.1-8b")
    online = resolve_engine_config({"quantization": "fp8"}, model, get_gpu("H100-80GB"), "0.23.0")
    assert not online.v1_runner


def test_version_keyed_026_rules_do_not_move_with_the_runner() -> None:
    """Read or measured at 0.26 only, so still keyed to the version: a V2-runner start at 0.25 reserves
    one batch for a sliding window and keeps MXFP4's loaded scales."""
    rules = _config("llama-3.1-8b", "0.25.0")[1].rules
    assert rules.v2_runner and not rules.sliding_reserves_in_flight and rules.mxfp4_keeps_loaded_scales


def test_flashinfer_sampler_default_by_release() -> None:
    """``VLLM_USE_FLASHINFER_SAMPLER`` unset: None (opt-in) in 0.20.0's envs.py 716-720, True from
    0.21.0 (726-730; 0.22.0 818-822; 0.23.0 820-824; 0.24.0 796-800; 0.25.0 808-812; 0.26.0 841-845)."""
    assert [memory_rules((0, m, 0)).flashinfer_sampler_default for m in range(20, 27)] == \
        [False, True, True, True, True, True, True]


@pytest.mark.parametrize(("version", "name"), [("0.20.0", "qwen2.5-7b"), ("0.21.0", "qwen2.5-7b"),
                                             ("0.22.0", "qwen2.5-7b"), ("0.23.0", "qwen2.5-7b"),
                                             ("0.24.0", "qwen2.5-7b"), ("0.25.0", "qwen3-30b-a3b")])
def test_v1_profile_peak_is_the_native_call(version: str, name: str) -> None:
    """From 0.21.0 the dummy sampler runs FlashInfer's call, then the sampler again with a generator,
    which ``forward_cuda`` hands to ``forward_native`` (gpu_model_runner.py 5746 of 0.21.0, "Also warm
    forward_native"): the Triton path of 0.18-0.20, whose tensors outweigh FlashInfer's (dtype + 3 fp32
    copies a logit), is the profile's peak in every release, FlashInfer's default notwithstanding.
    Qwen2ForCausalLM runs the V1 runner through 0.24; at 0.25 every dense model is on the V2 runner, so
    an MoE model off 0.25's V2 list (Qwen3MoeForCausalLM) carries the check there."""
    model, config = _config(name, version)
    assert not config.rules.v2_runner
    rows = 256
    _, baseline = _config(name, "0.20.0")
    assert sampler_profile_bytes(model, config, rows) == sampler_profile_bytes(model, baseline, rows)
    flashinfer_call = rows * model.vocab_size * (model.dtype_bytes + 4 * SAMPLER_V1_FLASHINFER_FP32_COPIES)
    assert sampler_profile_bytes(model, config, rows) > flashinfer_call


# Mamba2 hybrids, read from the wheels (vllm/model_executor/models/config.py unless named):
# (version, align to max(16, block_size), Nemotron-H's SSM-state default, what prefix caching does to a hybrid)
HYBRID_BY_RELEASE = [
    # 0.11.0: 296 "cache_config.enable_prefix_caching = False"; 367 "attn_block_size = 16 * cdiv(...)"; no NemotronH config class
    ("0.11.0", False, "auto", "off"),
    # 0.13.0: 364 / 430 kernel_block_alignment_size = 16; 504 getattr(hf_config, "mamba_ssm_cache_dtype", "float16")
    ("0.13.0", False, "float16", "all_or_off"),
    # 0.16.0: 429 / 495; 576 "float16"
    ("0.16.0", False, "float16", "all_or_align"),
    # 0.19.0: 218 / 273; 494 "float16"; config/model.py 1785 hybrid -> prefix caching off by default
    ("0.19.0", False, "float16", "all_or_align"),
    # 0.20.0: platforms/interface.py 577-583 max(min kernel block, block_size); 410 DEFAULT_MAMBA_SSM_CACHE_DTYPE
    ("0.20.0", True, "float32", "all_or_align"),
    # 0.21.0: platforms/interface.py 616-622; 410 "float32"
    ("0.21.0", True, "float32", "all_or_align"),
    # 0.22.0: platforms/interface.py 620 max(min kernel block, block_size), 642; 398 DEFAULT_MAMBA_SSM_CACHE_DTYPE = "float32"
    ("0.22.0", True, "float32", "all_or_align"),
    # 0.24.0: interface.py 744 / 766; 465 "float32"
    ("0.24.0", True, "float32", "all_or_align"),
    # 0.25.0: interface.py 861 / 883; 606 "float32"
    ("0.25.0", True, "float32", "all_or_align"),
    # 0.26.0: interface.py 876 / 898; 606 "float32"; engine/arg_utils.py 2521 "... and not model_config.is_hybrid"
    ("0.26.0", True, "float32", "all_or_align"),
]


@pytest.mark.parametrize("version, align_to_block, nemotron_ssm, pc_family", HYBRID_BY_RELEASE)
def test_hybrid_rules_by_release(version: str, align_to_block: bool, nemotron_ssm: str, pc_family: str) -> None:
    r = memory_rules(tuple(int(x) for x in version.split(".")))  # type: ignore[arg-type]
    assert r.hybrid_align_to_block_size is align_to_block
    assert r.nemotron_h_ssm_default == nemotron_ssm
    assert r.hybrid_prefix_caching == pc_family
    m = load_model("granite-4.0-h-tiny")
    block = resolve_engine_config({"block_size": 32, "max_model_len": 8192}, m, get_gpu("H100-80GB"), version).block_size
    assert block == (32 * -(-806_400 // (32 * 2048)) if align_to_block else 400)


def test_mamba_block_check_by_release() -> None:
    """config/compilation.py: "exceeds available Mamba cache blocks" at 1436 of 0.20.0 and 0.21.0, 1453 of 0.22.0,
    1451 of 0.24.0, 1458 of 0.25.0, 1492 of 0.26.0, 1507 of 0.27.0, 1508 of 0.28.0; no such line in 0.19.0 (which caps
    the capture sizes instead, 1285-1322) or 0.11.0. The count it names is ``kv_cache_config.num_blocks``
    (1433@0.20.0, 1450@0.22.0, 1489@0.26.0, 1504@0.27.0, 1505@0.28.0): v1/core/kv_cache_utils.py
    ``get_num_blocks`` (``available_memory // page_size // num_layers``, 950@0.22.0, 1005@0.26.0, 1008@0.27.0,
    988@0.28.0) with ``num_layers`` the group size, for the one pool every group shares (no Mamba pool of its own
    through 0.28): the plan's ``num_gpu_blocks``."""
    versions = ((0, 11, 0), (0, 19, 0), (0, 20, 0), (0, 21, 0), (0, 22, 0), (0, 26, 0), (0, 27, 0), (0, 28, 0))
    on = {v: memory_rules(v).mamba_blocks_cover_max_num_seqs for v in versions}
    assert on == {(0, 11, 0): False, (0, 19, 0): False, (0, 20, 0): True, (0, 21, 0): True, (0, 22, 0): True,
                  (0, 26, 0): True, (0, 27, 0): True, (0, 28, 0): True}


def test_kv_tokens_are_logged_from_concurrency_from_0201() -> None:
    """v1/core/kv_cache_utils.py ``_report_kv_cache_config``: ``num_tokens = int(max_concurrency * max_model_len)`` at
    1699-1708 of 0.20.1, 1708 of 0.21.0 and 1731 of 0.22.0; 0.20.0 multiplies ``num_blocks // len(groups)`` by
    ``min_block_size`` (1689-1697). Placed at 0.25 before 2026-12-06."""
    on = {v: memory_rules(v).kv_tokens_from_concurrency for v in ((0, 19, 0), (0, 20, 0), (0, 20, 1), (0, 21, 0),
                                                                    (0, 22, 0), (0, 24, 0), (0, 28, 0))}
    assert on == {(0, 19, 0): False, (0, 20, 0): False, (0, 20, 1): True, (0, 21, 0): True, (0, 22, 0): True,
                  (0, 24, 0): True, (0, 28, 0): True}


def test_the_v1_runner_buffers_are_charged_from_027() -> None:
    """utils/mem_utils.py: ``total_consumed`` (free memory at the init snapshot less after profiling) plus the
    transient peak, lines 317-326 of 0.27.0 and 0.28.0 (0.26.0: weights + torch peak increase + non-torch growth);
    the V1 runner is built after the snapshot (v1/worker/gpu_worker.py 395 / 423 of 0.27.0, 406 / 438 of 0.28.0) and
    keeps ``inputs_embeds`` (v1/worker/gpu_model_runner.py 798 of 0.27.0); v1_runner_rules keeps the flag."""
    from servetune.planner.vllm_rules import v1_runner_rules
    on = {v: v1_runner_rules(memory_rules(v)).charges_v1_runner_buffers for v in ((0, 26, 0), (0, 27, 0), (0, 28, 0))}
    assert on == {(0, 26, 0): False, (0, 27, 0): True, (0, 28, 0): True}


def test_bamba_leaves_the_registry_after_023() -> None:
    """models/registry.py: 0.23.0 registers "BambaForCausalLM" (line 87); 0.24.0 lists it in
    _PREVIOUSLY_SUPPORTED_MODELS as "0.23.0" (line 731), as 0.26.0 does (line 743)."""
    gone = {v: dict(memory_rules(v).removed_architectures).get("BambaForCausalLM")
            for v in ((0, 19, 0), (0, 23, 0), (0, 24, 0), (0, 26, 0))}
    assert gone == {(0, 19, 0): None, (0, 23, 0): None, (0, 24, 0): "0.23.0", (0, 26, 0): "0.23.0"}



# (version, fusion on by default, single-stage check, Blackwell 10.x family): vLLM's FlashInfer all-reduce + RMSNorm
# fusion, read in each wheel's vllm/config/vllm.py (enable_allreduce_rms_fusion and the -O2 pass_config entry).
FUSION_BY_RELEASE = [
    ("0.12.0", False, False, False),  # config/vllm.py:139 "fuse_allreduce_rms": False at -O2 (pass added, off)
    ("0.16.0", False, False, False),  # config/vllm.py:162 "fuse_allreduce_rms": False at -O2
    ("0.17.0", True, True, False),    # config/vllm.py:204 -O2 -> enable_allreduce_rms_fusion (:113); PP check :131;
                                      # is_device_capability(100)
    ("0.19.0", True, True, True),     # config/vllm.py:208 -> :116; is_device_capability_family(100)
    ("0.20.0", True, True, True),     # config/vllm.py:220 -> :119; PP check :137
    ("0.21.0", True, False, True),    # config/vllm.py:222 -> :119; no PP / DP check
    ("0.23.0", True, True, True),     # config/vllm.py:248 -> :129; PP check back at :149
    ("0.24.0", True, False, True),    # config/vllm.py:243 -> :131; no PP check
    ("0.26.0", True, False, True),    # config/vllm.py:256 -> :131
    ("0.28.0", True, False, True),    # config/vllm.py:272 -> :147
]


@pytest.mark.parametrize("version, default, single_stage, family", FUSION_BY_RELEASE)
def test_allreduce_rms_fusion_rule_per_release(version, default, single_stage, family):
    from servetune.planner.vllm_rules import parse_vllm_version
    r = memory_rules(parse_vllm_version(version))
    assert (r.allreduce_rms_fusion_default, r.allreduce_rms_fusion_single_stage) == (default, single_stage)
    assert r.allreduce_rms_fusion_blackwell_family is family


@pytest.mark.parametrize("version, before", [
    ("0.10.1.1", False),  # v1/worker/gpu_worker.py:174 snapshot, :192 init_worker_distributed_environment
    ("0.10.2", False),    # :175 snapshot, :193 distributed init
    ("0.11.0", True),     # :169 distributed init ("BEFORE taking memory snapshot", :165), :182 snapshot
    ("0.12.0", True),     # :216, :232
    ("0.19.0", True),     # :263, :282
    ("0.26.0", True),     # :369, :388
    ("0.28.0", True),     # :387, :406
])
def test_communicators_built_before_the_init_snapshot_per_release(version, before):
    from servetune.planner.vllm_rules import parse_vllm_version
    assert memory_rules(parse_vllm_version(version)).communicators_before_snapshot is before
