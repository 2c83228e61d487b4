"""Informed starts: grid snapping and the starts just under the preemption bound."""

from __future__ import annotations

import pytest

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.planner.prior import preemption_bound
from servetune.search.informed import informed_starts, snap_down, snap_nearest
from servetune.spec.space import SearchSpace
from servetune.workload import Workload


def test_snap_down_follows_the_parameter_grid() -> None:
    space = SearchSpace.from_dict({"params": {
        "max_num_seqs": {"type": "categorical", "choices": [16, 64, 256]},
        "gpu_memory_utilization": {"type": "float", "low": 0.5, "high": 0.9, "step": 0.1},
        "max_num_batched_tokens": {"type": "int", "low": 1024, "high": 8192, "log": True}}})
    assert snap_down(space["max_num_seqs"], 200) == 64
    assert snap_down(space["max_num_seqs"], 10) is None
    assert snap_down(space["gpu_memory_utilization"], 0.75) == pytest.approx(0.7)
    assert snap_down(space["max_num_batched_tokens"], 3000.7) == 3000


def test_informed_start_sits_just_under_the_bound_at_the_highest_utilization_that_starts() -> None:
    model, gpu = load_model("llama-3.1-8b"), get_gpu("A100-40GB")
    space = SearchSpace.from_dict({"params": {
        "gpu_memory_utilization": {"type": "float", "low": 0.3, "high": 0.95, "step": 0.05},
        "max_num_seqs": {"type": "int", "low": 16, "high": 512, "log": True}}})
    w = Workload.from_dict({"input_len": 512, "output_len": 1024, "num_requests": 384, "concurrency": 192})
    starts = informed_starts(space, {"max_model_len": 4096}, model, gpu, w, "0.26.0")
    assert [s["gpu_memory_utilization"] for s in starts] == [0.95, 0.95]
    first, second = starts[0]["max_num_seqs"], starts[1]["max_num_seqs"]
    plan = plan_memory(model, gpu, resolve_engine_config(
        {"gpu_memory_utilization": 0.95, "max_num_seqs": first, "max_model_len": 4096}, model, gpu))
    assert first == preemption_bound(plan.kv_cache_tokens, 512, 1024)  # an int space: exactly the bound
    assert first < second <= 192  # the optimistic bound, capped by the requests in flight


def test_informed_starts_skip_utilizations_that_cannot_start_and_spaces_without_max_num_seqs() -> None:
    model, gpu = load_model("llama-3.1-8b"), get_gpu("A100-40GB")
    w = Workload.from_dict({"input_len": 512, "output_len": 256, "num_requests": 64, "concurrency": 32})
    space = SearchSpace.from_dict({"params": {"gpu_memory_utilization": [0.3, 0.35, 0.6],
                                              "max_num_seqs": [8, 16, 32, 64]}})
    starts = informed_starts(space, {"max_model_len": 4096}, model, gpu, w, "0.26.0")
    assert starts and all(s["gpu_memory_utilization"] == 0.6 for s in starts)
    assert starts[0]["max_num_seqs"] == 32  # the bound is far above: capped by concurrency 32
    only_util = SearchSpace.from_dict({"params": {"gpu_memory_utilization": [0.5, 0.9]}})
    assert informed_starts(only_util, {}, model, gpu, w, "0.26.0") == []


def test_a_start_carries_the_token_budget_its_plan_assumed_vllms_default_for_the_gpu() -> None:
    """Where the space searches max_num_batched_tokens, the start carries vLLM's default for the GPU
    (8192 on a >= 70 GiB H200, 2048 on an A100-40GB, 0.26), snapped onto the space: the KV capacity
    behind its max_num_seqs was planned with that budget. On both real H200 grids (8B, 14B) the
    best cell is 0.9 x 256 x 8192, where a start without a budget left 8192 or 2048 to chance."""
    model = load_model("llama-3.1-8b")
    space = SearchSpace.from_dict({"params": {
        "gpu_memory_utilization": [0.3, 0.9], "max_num_seqs": [128, 256],
        "max_num_batched_tokens": [2048, 8192]}})
    w = Workload.from_dict({"input_len": 1024, "output_len": 256, "num_requests": 512, "concurrency": 256})
    h200 = informed_starts(space, {"max_model_len": 2048}, model, get_gpu("H200"), w, "0.26.0")
    assert h200[0] == {"gpu_memory_utilization": 0.9, "max_num_seqs": 256, "max_num_batched_tokens": 8192}
    a100 = informed_starts(space, {"max_model_len": 2048}, model, get_gpu("A100-40GB"), w, "0.26.0")
    assert a100 and all(s["max_num_batched_tokens"] == 2048 for s in a100)
    # Off the space's grid: the nearest value (the lower on a tie); a fixed budget is not searched.
    wide = SearchSpace.from_dict({"params": {"max_num_seqs": [128, 256],
                                             "max_num_batched_tokens": [4096, 16384]}})
    assert informed_starts(wide, {"max_model_len": 2048}, model, get_gpu("H200"), w, "0.26.0")[0][
        "max_num_batched_tokens"] == 4096
    assert snap_nearest(wide["max_num_batched_tokens"], 10240) == 4096 and snap_nearest(
        wide["max_num_batched_tokens"], 10241) == 16384
    pair = SearchSpace.from_dict({"params": {"max_num_seqs": [128, 256]}})
    assert "max_num_batched_tokens" not in informed_starts(pair, {"max_model_len": 2048}, model, get_gpu("H200"),
                                                           w, "0.26.0")[0]
    # A start the space's own rules would refuse with the default budget leaves it to the sampler.
    ruled = SearchSpace.from_dict({"params": {"max_num_seqs": [16, 32], "max_num_batched_tokens": [2048, 8192]},
                                   "rules": ["max_num_batched_tokens <= 64 * max_num_seqs"]})
    narrow = Workload.from_dict({"input_len": 1024, "output_len": 256, "num_requests": 64, "concurrency": 32})
    starts = informed_starts(ruled, {"max_model_len": 2048}, model, get_gpu("H200"), narrow, "0.26.0")
    assert starts and starts[0]["max_num_seqs"] == 32 and "max_num_batched_tokens" not in starts[0]


def test_the_start_steps_down_from_utilizations_whose_sampler_warm_up_is_warned() -> None:
    """gpt-oss-20b on an H100 at vLLM 0.26 (V1 runner, 1,024 x 201,088 logits in the warm-up after graph
    capture): the planner says 0.98 and 0.99 start, but their warm-up margins sit inside the shortfall
    real starts showed, and real starts died there at 0.98 and 0.985 (tests/fixtures/real_h100_classes,
    "Fourth set"); the start takes 0.97, where real starts served on a warm and a cold compile cache.
    A model on the V2 runner (no such warm-up) keeps the highest utilization, and a space whose every
    utilization is warned keeps its highest that starts."""
    model, gpu = load_model("gpt-oss-20b"), get_gpu("H100-80GB")
    space = SearchSpace.from_dict({"params": {"gpu_memory_utilization": [0.9, 0.95, 0.97, 0.98, 0.99],
                                              "max_num_seqs": [256, 512, 1024]}})
    w = Workload.from_dict({"input_len": 512, "output_len": 512, "num_requests": 2048, "concurrency": 1024})

    def warned(util: float, seqs: int) -> bool:
        plan = plan_memory(model, gpu, resolve_engine_config(
            {"gpu_memory_utilization": util, "max_num_seqs": seqs, "max_model_len": 8192}, model, gpu))
        assert plan.fits
        return plan.warmup_at_risk

    assert warned(0.99, 1024) and warned(0.98, 1024) and not warned(0.97, 1024)
    starts = informed_starts(space, {"max_model_len": 8192}, model, gpu, w, "0.26.0")
    assert starts and {s["gpu_memory_utilization"] for s in starts} == {0.97}
    assert not any(warned(0.97, s["max_num_seqs"]) for s in starts)
    dense = informed_starts(space, {"max_model_len": 8192}, load_model("llama-3.1-8b"), gpu, w, "0.26.0")
    assert dense and dense[0]["gpu_memory_utilization"] == 0.99
    edge_only = SearchSpace.from_dict({"params": {"gpu_memory_utilization": [0.98, 0.99],
                                                  "max_num_seqs": [1024]}})
    assert informed_starts(edge_only, {"max_model_len": 8192}, model, gpu, w, "0.26.0")[0]["gpu_memory_utilization"] == 0.99
