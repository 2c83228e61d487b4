"""The simulator under ``--enable-expert-parallel``: each rank's own whole experts, and the dispatch / combine.

From vLLM's source (0.11.0 and 0.26.0): the rank holds ``determine_expert_map``'s experts whole
(``fused_moe/expert_map_manager.py:22-69@0.26.0``); at ``dp`` 1 no token moves (``use_all2all_kernels`` needs
``dp_size > 1``: ``fused_moe/config.py:603-604@0.11.0``, ``:1052-1055@0.26.0``) and the partial sums are all-reduced
over TP as without it; under DP the default all2all backend is ``allgather_reducescatter``
(``envs.py:1240-1246@0.11.0``, ``config/parallel.py:186@0.26.0``): an all-gather of every replica's hidden states
and router logits before the experts and a reduce-scatter after (``distributed/device_communicators/all2all.py``).
The load on a rank is uniform routing's expectation (stated in ``perf_classes.moe_shape``), not the busiest rank's.
"""

from __future__ import annotations

import pytest

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.sim import perf_classes
from servetune.sim.perf import PerfModel

H100 = get_gpu("H100-80GB")
EP = {"enable_expert_parallel": True}


@pytest.mark.parametrize("name, ep", [("qwen3-30b-a3b", 2), ("qwen3-30b-a3b", 8), ("mixtral-8x7b", 2),
                                      ("deepseek-v2-lite", 4)])
def test_a_ranks_whole_experts_carry_the_rows_and_bytes_the_sliced_split_does(name: str, ep: int) -> None:
    """Uniform routing: the rank's experts get ``local / E`` of the routed rows, so rows x width (the FLOPs) and
    the touched experts' bytes match the sliced split's wherever the experts divide evenly."""
    model = load_model(name)
    whole = perf_classes.moe_shape(model, H100, 1, model.num_layers, ep=ep)
    sliced = perf_classes.moe_shape(model, H100, ep, model.num_layers)
    assert whole is not None and sliced is not None
    assert (whole.experts, whole.inter) == (model.num_experts // ep, model.expert_intermediate_size)
    assert whole.top_k * whole.inter == pytest.approx(sliced.top_k * sliced.inter)
    for tokens in (1, 16, 512):
        touched_whole = perf_classes.distinct_experts(whole.experts, whole.top_k, tokens) * whole.inter
        touched_sliced = perf_classes.distinct_experts(sliced.experts, sliced.top_k, tokens) * sliced.inter
        assert touched_whole == pytest.approx(touched_sliced)


def test_uneven_experts_price_the_fuller_rank() -> None:
    model = load_model("qwen3-30b-a3b")
    shape = perf_classes.moe_shape(model, H100, 1, model.num_layers, ep=3)  # 128 = 43 + 43 + 42
    assert shape is not None and (shape.experts, shape.top_k) == (43, pytest.approx(8 * 43 / 128))


def test_at_dp_one_expert_parallelism_moves_no_tokens_and_keeps_the_tp_all_reduce() -> None:
    model = load_model("qwen3-30b-a3b")
    plain = PerfModel(model, H100, resolve_engine_config({"tensor_parallel_size": 2}, model, H100))
    ep = PerfModel(model, H100, resolve_engine_config({"tensor_parallel_size": 2, **EP}, model, H100))
    assert (ep._t_dp_fixed, ep._t_dp_token) == (0.0, 0.0)
    assert (ep._t_ar_fixed, ep._t_ar_token) == (plain._t_ar_fixed, plain._t_ar_token)
    for reqs, tokens in ((1, 1), (128, 128), (4, 4096)):
        a = plain.gpu_cost(reqs, tokens, reqs * 512, reqs * 512, reqs == tokens)
        b = ep.gpu_cost(reqs, tokens, reqs * 512, reqs * 512, reqs == tokens)
        assert b.comm == a.comm


def test_under_dp_the_allgather_reducescatter_dispatch_and_combine_are_charged() -> None:
    model = load_model("qwen3-30b-a3b")
    tp2 = PerfModel(model, H100, resolve_engine_config({"tensor_parallel_size": 2, **EP}, model, H100))
    dp2 = PerfModel(model, H100, resolve_engine_config({"data_parallel_size": 2, **EP}, model, H100))
    assert dp2._t_dp_fixed > 0 and dp2._t_dp_token > 0
    # TP=1 DP=2 has no TP all-reduce, so its step's communication is the dispatch and combine alone
    cost = dp2.gpu_cost(64, 64, 64 * 512, 64 * 512, True)
    assert cost.comm > 0 and tp2.gpu_cost(64, 64, 64 * 512, 64 * 512, True).comm > 0
    # the same all-gather and reduce-scatter vLLM runs under DP without expert parallelism, at the same price
    plain = PerfModel(model, H100, resolve_engine_config({"data_parallel_size": 2}, model, H100))
    assert (dp2._t_dp_fixed, dp2._t_dp_token) == (plain._t_dp_fixed, plain._t_dp_token)
    assert cost.comm == pytest.approx(plain.gpu_cost(64, 64, 64 * 512, 64 * 512, True).comm)


def test_the_first_use_compiles_are_the_ranks_own_experts_kernel() -> None:
    from servetune.sim.moe_jit import moe_jit_rule
    model = load_model("qwen3-30b-a3b")
    ep = moe_jit_rule(model, H100, resolve_engine_config({"tensor_parallel_size": 2, **EP}, model, H100))
    plain = moe_jit_rule(model, H100, resolve_engine_config({"tensor_parallel_size": 2}, model, H100))
    assert ep is not None and plain is not None
    assert (ep.num_experts, plain.num_experts) == (64, 128)
