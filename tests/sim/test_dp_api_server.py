"""Data-parallel replicas and vLLM's API server processes: one loop for every replica through 0.14.1, one per DP
rank from 0.15.0 (``VllmMemoryRules.api_server_per_dp_rank``, read in the released wheels; the lines are pinned
there). A replica simulated behind a shared loop pays its own API-server work once per replica that loop serves."""

from __future__ import annotations

import pytest

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.planner.vllm_rules import memory_rules, parse_vllm_version
from servetune.sim import simulate
from servetune.sim._perf_api_server import replicas_per_api_server
from servetune.sim.perf import PerfModel
from servetune.workload import Workload

MODEL, GPU = load_model("servetune-test-850m"), get_gpu("H100-80GB")


@pytest.mark.parametrize(("version", "per_rank"), [("0.11.0", False), ("0.14.1", False), ("0.15.0", True),
                                                    ("0.20.0", True), ("0.26.0", True)])
def test_one_api_server_per_dp_rank_from_0_15(version: str, per_rank: bool) -> None:
    assert memory_rules(parse_vllm_version(version)).api_server_per_dp_rank is per_rank


def test_a_shared_loop_charges_each_replica_its_work_once_per_replica_it_serves() -> None:
    costs = {}
    for version in ("0.14.1", "0.15.0"):
        for dp in (1, 2):
            config = resolve_engine_config({"data_parallel_size": dp}, MODEL, GPU, version)
            perf = PerfModel(MODEL, GPU, config)
            costs[version, dp] = (replicas_per_api_server(config), perf.request_overhead_s, perf.token_overhead_s,
                                  perf.client_chunk_s)
    assert costs["0.14.1", 2][0] == 2 and costs["0.15.0", 2][0] == 1 and costs["0.14.1", 1][0] == 1
    one = costs["0.14.1", 1]
    assert costs["0.14.1", 2][1:3] == pytest.approx((2 * one[1], 2 * one[2]))
    assert costs["0.15.0", 2][1:3] == pytest.approx(one[1:3])
    assert costs["0.14.1", 2][3] == pytest.approx(one[3])  # the load generator's own cost is not the API server's


def test_a_front_end_bound_dp2_load_serves_less_behind_one_api_server() -> None:
    """Short prompts, one output token a step, 256 in flight on a small model: the API server sets the pace, so
    two replicas behind one loop (0.14.1's default) serve fewer tokens a second than behind one loop each."""
    w = Workload.from_dict({"input_len": 64, "output_len": 256, "num_requests": 512, "concurrency": 256})
    got = {}
    for version in ("0.14.1", "0.15.0"):
        config = resolve_engine_config({"data_parallel_size": 2}, MODEL, GPU, version)
        result = simulate(MODEL, GPU, config, w)
        assert result.ok and result.completed == 512
        got[version] = result.output_throughput
    assert got["0.14.1"] < 0.9 * got["0.15.0"], got


def test_api_server_count_is_a_flag_that_reaches_vllm_serve_and_the_simulator() -> None:
    """``api_server_count`` (``vllm serve --api-server-count``), what the simulator's front-end note tells a
    front-end-bound user to try: validated as a flag, written to the command line, and on a front-end-bound load
    two API servers serve more than vLLM 0.14.1's one, for one replica and for two."""
    from servetune.errors import SpecError
    from servetune.planner.flags import to_command_line, validate_flag

    assert validate_flag("api_server_count", 2) == 2
    with pytest.raises(SpecError, match="api_server_count"):
        validate_flag("api_server_count", 0)
    assert "--api-server-count 2" in to_command_line("org/m", {"api_server_count": 2})
    w = Workload.from_dict({"input_len": 64, "output_len": 256, "num_requests": 512, "concurrency": 256})
    for dp in (1, 2):
        flags = {"data_parallel_size": dp}
        one = simulate(MODEL, GPU, resolve_engine_config(flags, MODEL, GPU, "0.14.1"), w)
        config = resolve_engine_config({**flags, "api_server_count": 2}, MODEL, GPU, "0.14.1")
        assert config.api_server_count == 2 and replicas_per_api_server(config) == dp / 2
        two = simulate(MODEL, GPU, config, w)
        assert one.ok and two.ok and two.output_throughput > 1.1 * one.output_throughput, (dp, one, two)
