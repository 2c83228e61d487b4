"""``enable_expert_parallel`` end to end in the planner: the flag, the experts a GPU holds, the workspace, the launch.

Every rule is read from vLLM's source (0.11.0 and 0.26.0 wheels):

* ``FusedMoEParallelConfig.make``: ``use_ep = dp x tp > 1 and enable_expert_parallel``; then ``ep_size`` is the
  flattened ``tp x dp`` and the layer's ``tp_size`` 1 (``model_executor/layers/fused_moe/config.py:703-731@0.11.0``,
  ``:1204-1250@0.26.0``);
* ``determine_expert_map``: ``num_experts // ep_size`` experts a rank, one more on each of the first
  ``num_experts % ep_size`` ranks (``fused_moe/layer.py:786-824@0.11.0``,
  ``fused_moe/expert_map_manager.py:22-69@0.26.0``);
* ``TritonExperts.workspace_shapes``: ``(M, topk, max(N', K))``, ``(M, topk, max(N, K))``, ``(M, K)`` with N the
  local ``w13`` rows, whole under expert parallelism (``fused_moe/experts/triton_moe.py:181-196@0.26.0``);
* a model without routed experts: ``ValueError("Number of experts in the model must be greater than 0 when expert
  parallelism is enabled.")`` (``config/model.py:1001-1016@0.11.0``, ``:1177-1182@0.26.0``);
* ``--enable-expert-parallel`` / ``--no-enable-expert-parallel`` (a bool engine argument:
  ``engine/arg_utils.py:206-208, 697-699@0.11.0``).

Nothing here is fitted. One published start with the flag and its KV line was found (vLLM 0.10.2, 8 x L40S at TP=8,
``classes.yaml``), judged once after these rules were committed: +1.09%; there the flag changes no figure
(docs/model-classes.md, "Expert parallelism").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from servetune.engines.vllm.engine import VllmLaunch, serve_argv
from servetune.errors import SpecError
from servetune.planner.flags import FLAGS, NOT_MODELLED, to_cli_args, validate_flag
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelclass import moe_workspace_bytes, mxfp4_expert_bytes
from servetune.planner.modelinfo import load_model, local_experts
from servetune.spec.schema import StudySpec
from servetune.spec.space import STATIC_DEFAULTS, SearchSpace

H100 = get_gpu("H100-80GB")
EP = {"enable_expert_parallel": True}


# --------------------------------------------------------------------------- the flag
def test_expert_parallelism_is_a_bool_flag_and_no_longer_refused() -> None:
    assert "enable_expert_parallel" in FLAGS and "enable_expert_parallel" not in NOT_MODELLED
    assert validate_flag("enable_expert_parallel", True) is True
    with pytest.raises(SpecError, match="expected true or false"):
        validate_flag("enable_expert_parallel", "yes", "fixed_flags.enable_expert_parallel")
    assert STATIC_DEFAULTS["enable_expert_parallel"] is False


def test_the_flag_reaches_the_vllm_argv_and_round_trips_through_the_resolved_config() -> None:
    assert to_cli_args({"enable_expert_parallel": True}) == ["--enable-expert-parallel"]
    assert to_cli_args({"enable_expert_parallel": False}) == ["--no-enable-expert-parallel"]
    argv = serve_argv(VllmLaunch(model="org/m", flags={"tensor_parallel_size": 2, **EP}), 8011)
    assert "--enable-expert-parallel" in argv and argv[argv.index("--tensor-parallel-size") + 1] == "2"
    model = load_model("qwen3-30b-a3b")
    config = resolve_engine_config({"tensor_parallel_size": 2, **EP}, model, H100)
    assert config.enable_expert_parallel and config.as_flags()["enable_expert_parallel"] is True
    assert resolve_engine_config(config.as_flags(), model, H100) == config
    assert "enable_expert_parallel" not in resolve_engine_config({"tensor_parallel_size": 2}, model, H100).as_flags()


def _spec(tmp_path: Path, model: str, fixed: dict[str, Any], params: dict[str, Any]) -> StudySpec:
    data = {"name": "ep", "model": model, "gpu": {"type": "H100-80GB", "count": 2},
            "workload": {"input_len": 256, "output_len": 128, "num_requests": 16, "concurrency": 4},
            "objective": {"metric": "output_throughput"}, "search_space": {"params": params},
            "fixed_flags": fixed, "budget": {"trials": 4, "parallel": 1}, "backend": "sim"}
    return StudySpec.from_dict(data, tmp_path, cwd=tmp_path)


def test_a_study_may_search_the_flag_and_a_dense_model_with_it_is_refused_before_launch(tmp_path: Path) -> None:
    space = SearchSpace.from_dict({"params": {"enable_expert_parallel": {"type": "bool"}}})
    assert [p.name for p in space.params] == ["enable_expert_parallel"]
    moe = _spec(tmp_path, "qwen3-30b-a3b", {"tensor_parallel_size": 2}, {"enable_expert_parallel": {"type": "bool"}})
    assert [p.name for p in moe.search_space.params] == ["enable_expert_parallel"]
    with pytest.raises(SpecError) as fixed:
        _spec(tmp_path, "llama-3.1-8b", {"tensor_parallel_size": 2, **EP},
              {"max_num_seqs": {"type": "categorical", "choices": [32, 64]}})
    assert fixed.value.field == "fixed_flags.enable_expert_parallel"
    assert "Number of experts in the model must be greater than 0" in str(fixed.value)
    feas = space.feasibility(load_model("llama-3.1-8b"), 2)
    assert feas.never_ok == {"enable_expert_parallel": [True]} and feas.feasible == 1
    assert space.feasibility(load_model("qwen3-30b-a3b"), 2).feasible == 2


def test_a_dense_model_with_expert_parallelism_is_refused_as_vllm_refuses_it() -> None:
    with pytest.raises(SpecError) as caught:
        resolve_engine_config({"tensor_parallel_size": 2, **EP}, load_model("llama-3.1-8b"), H100)
    assert caught.value.field == "enable_expert_parallel"
    assert ("Number of experts in the model must be greater than 0 when expert parallelism is enabled."
            in str(caught.value))


# --------------------------------------------------------------------------- the experts a GPU holds
@pytest.mark.parametrize("experts, ep, counts", [(128, 4, [32] * 4), (60, 8, [8, 8, 8, 8, 7, 7, 7, 7]),
                                                 (8, 3, [3, 3, 2]), (8, 1, [8])])
def test_local_experts_is_determine_expert_maps_linear_split(experts: int, ep: int, counts: list[int]) -> None:
    assert [local_experts(experts, ep, r) for r in range(ep)] == counts
    assert sum(counts) == experts


def test_ep_and_dp_are_the_expert_group_and_tp_times_dp_of_one_is_no_expert_parallelism() -> None:
    model = load_model("qwen3-30b-a3b")
    for flags, ep, split in [({"tensor_parallel_size": 2}, 2, 1), ({"data_parallel_size": 4}, 4, 1),
                             ({"tensor_parallel_size": 2, "data_parallel_size": 2}, 4, 1), ({}, 1, 1)]:
        c = resolve_engine_config({**flags, **EP}, model, H100)
        assert (c.expert_parallel_size(True), c.expert_tensor_parallel_size(True)) == (ep, split)
    alone = resolve_engine_config(EP, model, H100)
    plain = plan_memory(model, H100, resolve_engine_config({}, model, H100))
    planned = plan_memory(model, H100, alone)
    assert planned.memory == plain.memory and planned.kv_cache_tokens == plain.kv_cache_tokens
    assert any("vLLM does not use expert parallelism" in n for n in planned.notes)


def test_whole_experts_where_they_divide_evenly_weigh_what_the_sliced_ones_do() -> None:
    model = load_model("qwen3-30b-a3b")  # 128 experts of 768, 768 / 2 and 768 / 4 exact
    for tp, dp in ((2, 1), (1, 2), (2, 2)):
        assert model.stage_weight_bytes(tp, 1, dp=dp, expert_parallel=True) == model.stage_weight_bytes(tp, 1, dp=dp)


def test_uneven_experts_put_the_remainder_on_the_first_ranks_which_the_plan_takes() -> None:
    """60 experts over 8 ranks: rank 0 holds 8 whole experts where the sliced split holds 60 x (768 // 8) rows."""
    base = load_model("qwen3-30b-a3b")
    model = dataclasses.replace(base, num_experts=60)
    h, i, layers, act = model.hidden_size, model.expert_intermediate_size, model.num_layers, model.dtype_bytes
    sliced = model.stage_weight_bytes(8, 1)[0]
    whole = model.stage_weight_bytes(8, 1, expert_parallel=True)[0]
    assert whole - sliced == layers * 3 * h * (8 * i - 60 * (i // 8)) * act


def test_mxfp4_experts_under_expert_parallelism_pad_the_whole_width() -> None:
    """gpt-oss-20b at TP=2: sliced, 32 experts of round_up(1440, 64) = 1472 rows; whole, 16 of 2880 (already a
    multiple of 64), so expert parallelism holds less padding."""
    model = load_model("gpt-oss-20b")
    assert mxfp4_expert_bytes(model, 1, experts=16) < mxfp4_expert_bytes(model, 2)
    sliced, whole = model.stage_weight_bytes(2, 1), model.stage_weight_bytes(2, 1, expert_parallel=True)
    per_layer = mxfp4_expert_bytes(model, 2) - mxfp4_expert_bytes(model, 1, experts=16)
    assert sliced[0] - whole[0] == model.num_layers * per_layer


def test_the_fused_moe_workspace_is_sized_for_whole_experts() -> None:
    """Mixtral at TP=2: N = 2 x 14336 under expert parallelism, 14336 without; the profiled peak and the KV
    cache move by the difference of the kept workspaces, nothing else does."""
    model = load_model("mixtral-8x7b")
    plain = resolve_engine_config({"tensor_parallel_size": 2}, model, H100)
    ep = resolve_engine_config({"tensor_parallel_size": 2, **EP}, model, H100)
    a, b = plan_memory(model, H100, plain), plan_memory(model, H100, ep)
    tokens = plain.max_num_batched_tokens
    grown = (moe_workspace_bytes(model, tokens, 1) - moe_workspace_bytes(model, tokens, 2)) / 2**30
    assert grown > 0.6
    assert b.memory.weights == a.memory.weights
    assert b.memory.activation_peak - a.memory.activation_peak == pytest.approx(grown, abs=1e-9)
    assert a.memory.kv_cache - b.memory.kv_cache == pytest.approx(grown, abs=1e-9)


def test_under_dp_the_workspace_keeps_every_replicas_tokens() -> None:
    model = load_model("mixtral-8x7b")
    dp = resolve_engine_config({"data_parallel_size": 2}, model, H100)
    ep = resolve_engine_config({"data_parallel_size": 2, **EP}, model, H100)
    a, b = plan_memory(model, H100, dp), plan_memory(model, H100, ep)
    tokens = 2 * dp.max_num_batched_tokens
    grown = (moe_workspace_bytes(model, tokens, 1) - moe_workspace_bytes(model, tokens, 2)) / 2**30
    assert b.memory.activation_peak - a.memory.activation_peak == pytest.approx(grown, abs=1e-9)


def test_the_plan_says_what_expert_parallelism_changes() -> None:
    model = load_model("qwen3-235b-a22b-2507")
    config = resolve_engine_config({"tensor_parallel_size": 4, "data_parallel_size": 2, **EP}, model, H100)
    notes = plan_memory(model, H100, config).notes
    ep = next(n for n in notes if n.startswith("enable_expert_parallel:"))
    assert "ep_size = TP x DP = 8; each GPU holds 16 of the 128 routed experts" in ep
    assert "allgather_reducescatter" in ep and "judged on one published start only" in ep
    uneven = dataclasses.replace(model, num_experts=60)
    note = plan_memory(uneven, H100, resolve_engine_config({"tensor_parallel_size": 8, **EP}, uneven, H100)).notes
    assert any("GPUs hold 8 or 7 of the 60 routed experts (the first 4 one more" in n for n in note)


def test_the_tuned_fused_moe_file_is_named_by_the_ranks_own_whole_experts() -> None:
    """vLLM names the file by the layer's local ``E`` and its whole ``N``: the published vLLM 0.10.2 start of
    Qwen3-235B-A22B-FP8 at TP=8 with expert parallelism looks for exactly this name
    (``logs/l40s8_qwen3_235b_a22b_2507_fp8_tp8_ep_l40s.log``); without the flag, 128 experts 192 wide."""
    from servetune.planner.moe_kernels import moe_kernel_config
    model = load_model("qwen3-235b-a22b-2507-fp8")
    ep = moe_kernel_config(model, "L40S", 1, experts=local_experts(model.num_experts, 8))
    sliced = moe_kernel_config(model, "L40S", 8)
    assert ep is not None and sliced is not None
    assert ep.file_name == "E=16,N=1536,device_name=NVIDIA_L40S,dtype=fp8_w8a8,block_shape=[128,128].json"
    assert sliced.file_name.startswith("E=128,N=192,")
    config = resolve_engine_config({"tensor_parallel_size": 8, **EP}, model, get_gpu("L40S"), "0.10.2")
    assert any("E=16,N=1536," in n for n in plan_memory(model, get_gpu("L40S"), config).notes)
