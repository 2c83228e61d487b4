"""A simulated trial's speed and memory do not change its figures.

``SimScheduler.run_until_idle`` advances the running requests that only decode by counters (bulk
decode) and the records keep no per-token list (each request's ITL gaps are computed from the
step timeline on demand; the trial pools them by step). Both are checked against the plain
path, step by step and gap by gap, on workloads that exercise what can break them: preemption,
prefix caching, chunked prefill off, a small token budget with a long-prefill cap, an API server
that falls behind (merged chunks), open and closed loops.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.result import summarize
from servetune.sim import LoadClient, SimScheduler, simulate, with_calibration
from servetune.workload import Workload

L8B = "llama-3.1-8b"
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # 400 in flight against a cache for about 160: decoders preempt from the back.
    "preempting_closed_loop": (L8B, {"num_gpu_blocks_override": 12000},
                               {"input_len": 1024, "output_len": 128, "num_requests": 600, "concurrency": 400}),
    # A small cache and 64 sequences (the a3/b3 fixture windows' shape): preemption all along.
    "small_cache": (L8B, {"max_num_seqs": 64, "num_gpu_blocks_override": 1024},
                    {"input_len": 1024, "output_len": {"dist": "uniform", "min": 1, "max": 400},
                     "num_requests": 300, "concurrency": 128}),
    "prefix_groups_with_evictions": (L8B, {"num_gpu_blocks_override": 1500},
                                     {"input_len": {"dist": "uniform", "min": 200, "max": 4000},
                                      "output_len": {"dist": "uniform", "min": 1, "max": 600}, "num_requests": 300,
                                      "concurrency": 96, "prefix_len": 800, "num_prefix_groups": 3,
                                      "warmup_requests": 8}),
    "open_loop_no_chunked_prefill": (L8B, {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192,
                                           "max_model_len": 8192},
                                     {"input_len": {"dist": "normal", "mean": 2000, "std": 800}, "output_len": 200,
                                      "num_requests": 200, "request_rate": 8.0}),
    "small_budget_long_prefill_cap": (L8B, {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 128},
                                      {"input_len": 1500, "output_len": 48, "num_requests": 150, "concurrency": 48,
                                       "prefix_len": 512, "num_prefix_groups": 2}),
    "open_loop_preempting_prefix": (L8B, {"max_num_seqs": 128, "num_gpu_blocks_override": 600},
                                    {"input_len": {"dist": "uniform", "min": 50, "max": 2000},
                                     "output_len": {"dist": "uniform", "min": 50, "max": 900}, "num_requests": 150,
                                     "request_rate": 50.0, "prefix_len": 600, "num_prefix_groups": 5}),
    # Sliding-window hybrids (sim.blocks.KVGroups): gpt-oss's 128-token window slides during
    # decode, freeing a block every 16 steps, under preemption; gemma-2's 4,096-token window with
    # prefix groups and prompts past it; gpt-oss without async scheduling (nothing in flight).
    "hybrid_window_preempting": ("gpt-oss-20b", {"max_num_seqs": 128, "num_gpu_blocks_override": 1500},
                                 {"input_len": {"dist": "uniform", "min": 50, "max": 1500},
                                  "output_len": {"dist": "uniform", "min": 1, "max": 600}, "num_requests": 300,
                                  "concurrency": 128}),
    "hybrid_prefix_groups_past_window": ("gemma-2-27b", {"max_model_len": 8192, "num_gpu_blocks_override": 1200},
                                         {"input_len": {"dist": "uniform", "min": 200, "max": 6000},
                                          "output_len": {"dist": "uniform", "min": 1, "max": 400},
                                          "num_requests": 120, "concurrency": 24, "prefix_len": 800,
                                          "num_prefix_groups": 3}),
    "hybrid_window_sync": ("gpt-oss-20b", {"async_scheduling": False, "num_gpu_blocks_override": 2000},
                           {"input_len": {"dist": "uniform", "min": 50, "max": 1000}, "output_len": 300,
                            "num_requests": 200, "concurrency": 96}),
    # A Mamba2 hybrid (granite-4.0-h-tiny: 400-token attention blocks, nine Mamba groups of one block
    # per request): its decoders preempt for their attention blocks, each victim freeing its Mamba ones.
    "mamba_hybrid_preempting": ("granite-4.0-h-tiny", {"max_num_seqs": 128, "max_model_len": 8192,
                                                       "num_gpu_blocks_override": 1200},
                                {"input_len": {"dist": "uniform", "min": 50, "max": 3000},
                                 "output_len": {"dist": "uniform", "min": 1, "max": 800}, "num_requests": 300,
                                 "concurrency": 128}),
    # The 0.85B model at 256 in flight: its API server falls behind and merges chunks.
    "api_server_behind": ("servetune-test-850m", {"gpu_memory_utilization": 0.5},
                          {"input_len": 512, "output_len": {"dist": "uniform", "min": 1, "max": 60},
                           "num_requests": 600, "concurrency": 256}),
}


def _trial(name: str, bulk: bool) -> tuple[SimScheduler, LoadClient, list]:
    model_name, flags, workload = CASES[name]
    model, gpu = load_model(model_name), get_gpu("H200")
    config = resolve_engine_config(flags, model, gpu)
    sched = SimScheduler(model, gpu, config, plan_memory(model, gpu, config).num_gpu_blocks, bulk_decode=bulk)
    client = LoadClient(sched, Workload.from_dict(workload))
    return sched, client, client.run()


def _engine_figures(s: SimScheduler) -> tuple:
    return (s.num_steps, s.num_preemptions, s.generation_tokens, s.prompt_tokens_computed, s.prefix_cache_hits,
            s.prefix_cache_queries, s.kv_usage_peak, s.kv_usage_mean, s.frontend_busy_s, s.now_s,
            list(s.step_end_s), list(s.deliver_s))


@pytest.mark.parametrize("name", sorted(CASES))
def test_bulk_decode_gives_the_step_by_step_figures_to_the_bit(name: str) -> None:
    (bulk, _, bulk_records), (plain, _, plain_records) = _trial(name, True), _trial(name, False)
    assert plain.num_bulk_steps == 0 and bulk.num_bulk_steps > bulk.num_steps // 2
    assert _engine_figures(bulk) == _engine_figures(plain)
    assert bulk_records == plain_records  # times, token counts, every ITL gap, preemptions
    if name.startswith(("preempting", "small_cache", "open_loop_preempting", "hybrid_window_preempting",
                        "mamba_hybrid_preempting")):
        assert bulk.num_preemptions > 0
    if "prefix" in name:
        assert bulk.prefix_cache_hits > 0


@pytest.mark.parametrize("name", ["small_cache", "api_server_behind", "prefix_groups_with_evictions"])
def test_the_pooled_itl_is_the_itl_of_every_gap(name: str) -> None:
    sched, client, records = _trial(name, True)
    gaps = [g for r in records for g in r.itl_s]
    values, counts = client.pooled_itl_s()
    assert sum(counts) == len(gaps) and sorted(gaps) == sorted(v for v, c in zip(values, counts) for _ in range(c))
    duration = max(r.finish_s for r in records if r.finish_s is not None)
    pooled, listed = summarize(records, duration, pooled_itl_s=(values, counts)), summarize(records, duration)
    assert (pooled["itl_ms"].p50, pooled["itl_ms"].p90, pooled["itl_ms"].p99) == (
        listed["itl_ms"].p50, listed["itl_ms"].p90, listed["itl_ms"].p99)
    assert pooled["itl_ms"].mean == pytest.approx(listed["itl_ms"].mean, rel=1e-12)
    if name == "api_server_behind":  # chunks merged: fewer gaps than tokens
        assert len(gaps) + len(records) < sum(r.output_tokens for r in records)
    if name == "small_cache":  # a preempted request's gap across its recompute is pooled too
        assert any(r.preemptions for r in records)


def test_a_trials_records_do_not_grow_with_the_output_length() -> None:
    """No per-token list is kept: 256 requests of 1024 output tokens pickle to about the size of
    256 of 64 (only the shared step timeline grows, 8 bytes a step: under 2% of one float per
    extra token); each record's gaps are still all there, computed when read."""
    model, gpu = load_model("servetune-test-850m"), get_gpu("H200")
    config = resolve_engine_config({"gpu_memory_utilization": 0.5, "max_num_seqs": 256}, model, gpu)
    sizes = {}
    for out in (64, 1024):
        w = Workload.from_dict({"input_len": 128, "output_len": out, "num_requests": 256, "concurrency": 256})
        result = simulate(model, gpu, config, w)
        assert result.completed == 256 and result.preemptions == 0
        sizes[out] = len(pickled := pickle.dumps(result.requests))
        assert pickle.loads(pickled) == result.requests  # what a trial's worker sends its driver
        for r in result.requests[:8]:
            gaps = list(r.itl_s)
            assert r.itl_s == tuple(gaps) and len(r.itl_s) == len(gaps)
            assert r.finish_s is not None and r.first_token_s is not None
            assert 0 < len(gaps) <= out - 1 and sum(gaps) == pytest.approx(r.finish_s - r.first_token_s, rel=1e-9)
    assert sizes[1024] - sizes[64] < 0.02 * 256 * (1024 - 64) * 8, sizes


@pytest.mark.parametrize("name", ["preempting_closed_loop", "hybrid_window_preempting", "prefix_groups_with_evictions"])
def test_bulk_decode_equals_the_step_path_when_preempted_requests_resume_on_their_cached_blocks(name: str) -> None:
    # Calibration.resume_hits 1: a victim's own blocks stay cached and its resume hits what is left.
    model_name, flags, workload = CASES[name]
    model, gpu = load_model(model_name), with_calibration(get_gpu("H200"), {"resume_hits": 1.0})
    config = resolve_engine_config(flags, model, gpu)
    runs = []
    for bulk in (True, False):
        sched = SimScheduler(model, gpu, config, plan_memory(model, gpu, config).num_gpu_blocks, bulk_decode=bulk)
        runs.append((sched, LoadClient(sched, Workload.from_dict(workload)).run()))
    (bulk_s, bulk_records), (plain_s, plain_records) = runs
    assert bulk_s.num_preemptions > 0
    assert _engine_figures(bulk_s) == _engine_figures(plain_s) and bulk_records == plain_records
