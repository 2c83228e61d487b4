"""Behaviour of the simulated V1 scheduler, in the style of vLLM's own scheduler tests: a tiny KV
cache (a few dozen blocks) so that preemption, admission and prefix caching are easy to provoke."""

from __future__ import annotations

import pytest

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import EngineConfig, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.planner.vllm_rules import memory_rules, parse_vllm_version
from servetune.sim import PerfModel, SimScheduler, simulate, with_calibration
from servetune.workload import Workload

MODEL = load_model("servetune-test-850m")
GPU = get_gpu("H200")


def make_config(**flags: object) -> EngineConfig:
    base: dict[str, object] = {"max_model_len": 2048, "max_num_seqs": 16, "max_num_batched_tokens": 512}
    base.update(flags)
    return resolve_engine_config(base, MODEL, GPU)


def make_scheduler(num_gpu_blocks: int, **flags: object) -> SimScheduler:
    return SimScheduler(MODEL, GPU, make_config(**flags), num_gpu_blocks=num_gpu_blocks)


def run_all(s: SimScheduler, limit: int = 100_000) -> list:
    steps = []
    while s.has_work():
        steps.append(s.step())
        assert len(steps) < limit, "scheduler did not finish"
    return steps


def add_same(s: SimScheduler, n: int, prompt: int, out: int) -> None:
    for i in range(n):
        s.add_request(f"r{i}", prompt, out, arrival_s=0.0)


def test_no_preemption_when_kv_cache_suffices() -> None:
    # 8 requests x (64 + 32 tokens) = 8 x 6 blocks = 48 blocks; 49 usable (plus the null block).
    s = make_scheduler(num_gpu_blocks=50)
    add_same(s, 8, prompt=64, out=32)
    steps = run_all(s)
    assert s.num_preemptions == 0
    assert all(not st.preempted for st in steps)
    assert sum(sum(st.new_tokens.values()) for st in steps) == 8 * 32
    assert s.kv_usage == 0.0  # everything freed (evictable cached blocks count as free)


def test_preemption_exactly_when_oversubscribed() -> None:
    # One block short of what 8 full-length requests need: the cache runs out during decode.
    s = make_scheduler(num_gpu_blocks=48)
    add_same(s, 8, prompt=64, out=32)
    steps = run_all(s)
    assert s.num_preemptions > 0
    assert s.num_preemptions == sum(len(st.preempted) for st in steps)
    # Every request still completes all its tokens (recompute preemption loses no output).
    for i in range(8):
        st = s.request_state(f"r{i}")
        assert st.status == "finished" and st.num_output_tokens == 32


def test_preempted_request_goes_to_front_of_waiting_with_progress_reset() -> None:
    s = make_scheduler(num_gpu_blocks=30)
    add_same(s, 8, prompt=64, out=64)
    while True:
        running_before = s.running_ids()
        step = s.step()
        if step.preempted:
            break
        assert s.has_work()
    victim = step.preempted[0]
    assert victim == running_before[-1]  # FCFS: the LAST running request is the victim
    assert s.waiting_ids()[0] == step.preempted[-1]  # prepended: the newest victim is first in line
    st = s.request_state(victim)
    assert st.status == "waiting"
    assert st.num_computed_tokens == 0 and st.num_blocks == 0
    assert st.num_output_tokens > 0  # its generated tokens stay; they are recomputed as prefill
    assert st.num_preemptions == 1
    # Nothing was admitted in the step that preempted.
    assert victim not in s.running_ids()
    # When it resumes, prompt + generated tokens are recomputed as one prefill.
    outputs_before = st.num_output_tokens
    while s.request_state(victim).status == "waiting":
        s.step()
    resumed = s.request_state(victim)
    assert resumed.num_computed_tokens >= min(64 + outputs_before, 512 - 1) or resumed.num_output_tokens > outputs_before


def test_token_budget_and_max_num_seqs_every_step() -> None:
    s = make_scheduler(num_gpu_blocks=400, max_num_seqs=5, max_num_batched_tokens=300)
    for i in range(12):
        s.add_request(f"r{i}", 100 + 37 * i, 20 + i, arrival_s=0.01 * i)
    for st in run_all(s):
        assert st.prefill_tokens + st.decode_tokens <= 300
        assert len(st.new_tokens) <= 5
        assert s.num_running <= 5


def test_chunked_prefill_splits_a_long_prompt_and_samples_at_the_last_chunk() -> None:
    s = make_scheduler(num_gpu_blocks=200, max_num_batched_tokens=256)
    s.add_request("long", 1000, 4, arrival_s=0.0)
    steps = run_all(s)
    assert [st.prefill_tokens for st in steps[:4]] == [256, 256, 256, 232]
    assert [st.new_tokens["long"] for st in steps[:4]] == [0, 0, 0, 1]  # first token with the last chunk
    assert s.request_state("long").first_token_s == pytest.approx(s.token_times("long")[0])
    assert len(steps) == 4 + 3


def test_long_prefill_threshold_caps_chunks() -> None:
    s = make_scheduler(num_gpu_blocks=200, max_num_batched_tokens=512, long_prefill_token_threshold=100)
    s.add_request("a", 350, 2, arrival_s=0.0)
    steps = run_all(s)
    assert [st.prefill_tokens for st in steps[:4]] == [100, 100, 100, 50]


@pytest.mark.parametrize("version, admitted", [("0.26.0", False), ("0.18.0", True)])
def test_reserve_full_isl_blocks_admission_until_the_whole_prompt_fits(version: str, admitted: bool) -> None:
    # 20 usable blocks. Once "a" (200 tokens, 13 blocks) is prefilled, 7 are free: "b"'s first
    # 64-token chunk needs 4 of them, its whole 200-token prompt 13. vLLM >= 0.19 reserves the
    # whole prompt (scheduler_reserve_full_isl), so "b" waits; 0.18 admits it chunk by chunk.
    cfg = resolve_engine_config({"max_model_len": 2048, "max_num_batched_tokens": 64, "max_num_seqs": 16},
                                MODEL, GPU, vllm_version=version)
    s = SimScheduler(MODEL, GPU, cfg, num_gpu_blocks=21)
    s.add_request("a", 200, 40, arrival_s=0.0)
    s.add_request("b", 200, 8, arrival_s=0.0)
    for _ in range(6):
        s.step()
    assert s.request_state("a").num_output_tokens > 0
    assert ("b" in s.running_ids()) is admitted
    assert ("b" in s.waiting_ids()) is not admitted


def test_prefix_caching_skips_shared_prefix_prefill() -> None:
    def total_prefill(caching: bool) -> tuple[int, int]:
        s = make_scheduler(num_gpu_blocks=400, enable_prefix_caching=caching, max_num_seqs=4)
        for i in range(8):
            s.add_request(f"r{i}", 600, 8, arrival_s=0.0, prefix_group=0, prefix_tokens=512)
        steps = run_all(s)
        return sum(st.prefill_tokens for st in steps), s.prefix_cache_hits

    with_cache, hits = total_prefill(True)
    without_cache, no_hits = total_prefill(False)
    assert no_hits == 0
    assert hits > 0
    # The first request computes the prefix; each later one reuses its 32 full blocks.
    assert without_cache - with_cache == hits == 7 * 512


def test_prefix_hit_leaves_the_last_token_to_recompute() -> None:
    s = make_scheduler(num_gpu_blocks=100)
    s.add_request("a", 512, 2, arrival_s=0.0, prefix_group=3, prefix_tokens=512)
    run_all(s)
    s.add_request("b", 512, 2, arrival_s=s.now_s, prefix_group=3, prefix_tokens=512)
    first = s.step()
    # 512 tokens are 32 full blocks, but at most 511 may hit: 31 blocks hit, 16 tokens recomputed.
    assert first.prefill_tokens == 16


def test_kv_usage_definition() -> None:
    s = make_scheduler(num_gpu_blocks=101, enable_prefix_caching=False)
    s.add_request("a", 160, 50, arrival_s=0.0)
    s.step()  # 160 prompt tokens -> 10 blocks of 100 usable
    assert s.kv_usage == pytest.approx(0.10)


def test_determinism() -> None:
    cfg = make_config(max_num_seqs=32, num_gpu_blocks_override=256)
    w = Workload.from_dict({"input_len": {"dist": "uniform", "min": 100, "max": 600},
                            "output_len": {"dist": "uniform", "min": 10, "max": 200},
                            "num_requests": 60, "request_rate": 50.0, "seed": 4})
    a = simulate(MODEL, GPU, cfg, w, seed=1)
    b = simulate(MODEL, GPU, cfg, w, seed=1)
    assert a.to_dict() == b.to_dict()
    assert a.requests == b.requests
    assert a.preemptions and a.preemptions > 0


def test_max_num_seqs_sweep_rises_then_stops_once_preemption_sets_in() -> None:
    """llama-3.1-8b on an H100 with a fixed KV cache of 4096 usable blocks (65,536 tokens) and
    1024-in / 1024-out requests (128 blocks each when done): 32 sequences fit. Output throughput
    rises with max_num_seqs while every sequence fits, and stops where the KV cache saturates:
    oversubscription forces recompute preemptions (every one recomputes up to 2048 tokens) and buys
    nothing for them, within 2% of the saturating setting (with the 2026-12-03 H200 constants, which
    an H100 inherits, 48 sequences gain 0.8% for 60 preemptions; with the 2026-12-02 ones they lost)."""
    model, gpu = load_model("llama-3.1-8b"), get_gpu("H100-80GB")
    w = Workload.from_dict({"input_len": 1024, "output_len": 1024, "num_requests": 128, "concurrency": 64})
    tput, pre, usage = {}, {}, {}
    for seqs in (8, 16, 32, 48, 64):
        cfg = resolve_engine_config({"max_model_len": 4096, "max_num_seqs": seqs, "num_gpu_blocks_override": 4097},
                                    model, gpu)
        r = simulate(model, gpu, cfg, w)
        tput[seqs], pre[seqs], usage[seqs] = r.output_throughput, r.preemptions, r.kv_cache_usage_peak
    assert pre[8] == pre[16] == pre[32] == 0, pre
    assert 0 < pre[48] < pre[64], pre
    assert usage[16] < 1.0 and usage[32] == pytest.approx(1.0)  # 32 x 128 blocks: exactly full
    assert tput[8] < tput[16] < tput[32], tput  # rises while the KV cache holds every sequence
    assert max(tput[48], tput[64]) < 1.02 * tput[32], tput  # preempting buys nothing
    assert tput[64] <= tput[48], tput  # and more of it costs


def test_a_figure_the_api_server_bounds_says_it_depends_on_the_host_cpu() -> None:
    """The simulated API server's busy share of the window decides the note: an 8B decode-heavy
    load at 256 in flight keeps it busy most of the window (the real one ran 97-100% busy there
    and served 30% below the simulated figure on a slow host); a prefill-heavy load does not."""
    import re

    from servetune.sim import FRONTEND_BOUND_SHARE

    model, gpu = load_model("llama-3.1-8b"), get_gpu("H200")
    config = resolve_engine_config({"gpu_memory_utilization": 0.9, "max_num_seqs": 256, "max_model_len": 4096},
                                   model, gpu)

    def notes(input_len: int, output_len: int) -> list[str]:
        w = Workload.from_dict({"input_len": input_len, "output_len": output_len, "num_requests": 512,
                                "concurrency": 256})
        return [e for e in simulate(model, gpu, config, w).notes if "API server" in e]

    decode = notes(256, 1024)
    assert len(decode) == 1 and "host's CPU" in decode[0]
    busy = int(re.search(r"busy (\d+)%", decode[0]).group(1))  # type: ignore[union-attr]
    assert 100 * FRONTEND_BOUND_SHARE <= busy <= 100
    assert notes(1024, 256) == []


def test_the_api_servers_cpu_is_its_per_request_per_token_and_per_chunk_costs_scaled_by_the_host_factor() -> None:
    """``api_server_cpu_s`` over the window is what the modelled API server charged: per measured
    request, per prompt token, per streamed token (its per-token share), per SSE chunk the client
    received (the per-chunk share: a chunk carries the tokens the loop merged) and per streamed
    token per prompt token (the warm-up's excluded); ``api_cpu_factor`` scales all of it, and on a
    load the API server bounds, a slower host's factor lowers the simulated throughput."""
    from servetune.sim import calibration_for, with_calibration

    model, gpu = load_model("llama-3.1-8b"), get_gpu("H200")
    config = resolve_engine_config({"gpu_memory_utilization": 0.9, "max_num_seqs": 256, "max_model_len": 4096},
                                   model, gpu)
    w = Workload.from_dict({"input_len": 256, "output_len": 1024, "num_requests": 384, "concurrency": 256,
                            "warmup_requests": 2})
    cal = calibration_for(gpu)

    def charged(result, factor: float) -> float:
        share = cal.api_chunk_share
        return factor * sum(cal.request_overhead_s + r.prompt_tokens * cal.prompt_token_overhead_s
                            + r.output_tokens * (cal.token_overhead_s * (1 - share)
                                                 + r.prompt_tokens * cal.stream_prompt_token_s)
                            + (len(r.itl_s) + 1) * cal.token_overhead_s * share
                            for r in result.requests)

    plain = simulate(model, gpu, config, w)
    assert plain.api_server_cpu_s == pytest.approx(charged(plain, 1.0), rel=1e-9)
    slow = simulate(model, with_calibration(gpu, {"api_cpu_factor": 1.5}), config, w)
    assert slow.api_server_cpu_s == pytest.approx(charged(slow, 1.5), rel=1e-9)
    # Behind, the loop merges tokens into fewer chunks: a slower host's clients get fewer, fuller ones.
    chunks = [sum(len(r.itl_s) + 1 for r in res.requests) for res in (plain, slow)]
    assert chunks[1] < chunks[0] < sum(r.output_tokens for r in plain.requests)
    # Busy past one core at 1.5x, the loop merges most tokens (0.71 -> 0.08 chunks a token here), so
    # only its per-token share and the client's reads bound the load: 9% lower, not the 1.5x of a FIFO.
    assert 0.8 * plain.output_throughput < slow.output_throughput < 0.95 * plain.output_throughput
    assert any("--api-cpu-factor 1.5" in e for e in slow.notes)


def _preempting_run(resume_hits: float, version: str | None = None) -> SimScheduler:
    # One block short of what 8 full-length requests need (test_preemption_exactly_when_oversubscribed).
    flags: dict[str, object] = {"max_model_len": 2048, "max_num_seqs": 16, "max_num_batched_tokens": 512}
    config = resolve_engine_config(flags, MODEL, GPU, version) if version else make_config()
    perf = PerfModel(MODEL, with_calibration(GPU, {"resume_hits": resume_hits}), config)
    s = SimScheduler(MODEL, GPU, config, num_gpu_blocks=48, perf=perf)
    add_same(s, 8, prompt=64, out=32)
    run_all(s)
    assert s.num_preemptions > 0
    assert all(s.request_state(f"r{i}").num_output_tokens == 32 for i in range(8))
    return s


def test_with_resume_hits_a_preempted_request_resumes_on_its_own_blocks_still_cached() -> None:
    # vLLM keeps a freed block's hash until the block is handed out again, so a resumed request
    # recomputes only what the running ones took meanwhile (Calibration.resume_hits 1); at 0 it
    # recomputes its whole sequence.
    on, off = _preempting_run(1.0), _preempting_run(0.0)
    assert on.prompt_tokens_computed < off.prompt_tokens_computed
    # vLLM's prefix-cache counters leave a resumed request's lookup out from 0.11.1 (pull request 25787),
    # so these runs count no hit though the resumed requests skipped part of their recompute.
    assert on.prefix_cache_hits == off.prefix_cache_hits == 0
    old = _preempting_run(1.0, "0.11.0")
    assert old.prefix_cache_hits > 0 and old.prefix_cache_hits % 16 == 0


def test_the_counters_take_a_blocked_lookup_at_every_retry_until_0_27() -> None:
    # vLLM up to 0.26.0 records a WAITING request's lookup in get_computed_blocks, before
    # allocate_slots, so a request blocked on KV space counts again each step; 0.27.0 records at
    # admission. Every lookup is in SimScheduler.lookups whatever the version counts.
    old, new = _preempting_run(1.0, "0.26.0"), _preempting_run(1.0, "0.27.0")
    assert old.lookups == new.lookups
    fresh, resumed, fresh_retry, resumed_retry = old.lookups
    assert fresh[0] == 8 and resumed[0] == old.num_preemptions and resumed_retry[0] > 0
    assert resumed_retry[2] > 0  # a blocked victim finds its own blocks still cached
    # Both leave the resumed lookups out (0.11.1 on), and 0.11.0 takes them, retries too.
    assert old.prefix_cache_queries == new.prefix_cache_queries == fresh[1] + fresh_retry[1]
    v0110 = _preempting_run(1.0, "0.11.0")
    assert v0110.prefix_cache_hits == sum(row[2] for row in v0110.lookups) > 0
    assert v0110.logged_hit_rate() == v0110.prefix_cache_hits / v0110.prefix_cache_queries
    assert v0110.logged_hit_rate(recent=1) == v0110.counted_lookups[-1][1] / v0110.counted_lookups[-1][0]


def test_the_prefix_cache_counters_leave_resumed_requests_out_from_0_11_1() -> None:
    assert memory_rules(parse_vllm_version("0.11.0")).prefix_stats_count_preempted
    assert not memory_rules(parse_vllm_version("0.11.1")).prefix_stats_count_preempted
    assert not memory_rules(parse_vllm_version("0.26.0")).prefix_stats_count_preempted
