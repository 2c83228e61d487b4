"""Trial figures computed as `vllm bench serve` computes them, checked on a real H200 run."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from servetune.engines.vllm.metrics import counter, gauge, labels_of, parse_prometheus
from servetune.result import LatencySummary, RequestRecord, TrialResult, TrialStatus, summarize

RUN = Path(__file__).parent / "fixtures" / "real_h200" / "a1_u05_s64"


def test_percentiles_interpolate_like_numpy() -> None:
    s = LatencySummary.of([1.0, 2.0, 3.0, 4.0])
    assert s is not None and (s.mean, s.p50, s.p90, s.p99) == (2.5, 2.5, pytest.approx(3.7), pytest.approx(3.97))


def test_tpot_and_itl_follow_vllm_bench_definitions() -> None:
    r = RequestRecord(0, 10, 5, arrival_s=0.0, first_token_s=0.1, finish_s=0.5, itl_s=(0.1, 0.1, 0.1, 0.1))
    assert r.ttft_ms == pytest.approx(100.0) and r.tpot_ms == pytest.approx(100.0) and r.e2e_ms == pytest.approx(500.0)
    failed = RequestRecord(1, 10, 0, 0.0, None, None, error="HTTP 500")
    fig = summarize([r, failed], duration_s=1.0)
    assert fig["completed"] == 1 and fig["failed"] == 1 and fig["output_throughput"] == 5.0


def test_summary_of_the_real_run_recomputes_from_its_requests() -> None:
    rows = json.loads(gzip.open(RUN / "requests.json.gz", "rt").read())
    records = [RequestRecord(**{**r, "itl_s": tuple(r["itl_s"])}) for r in rows]
    saved = json.loads((RUN / "summary.json").read_text())
    fig = summarize(records, saved["duration_s"])
    assert fig["completed"] == 384
    assert fig["output_throughput"] == pytest.approx(saved["output_throughput"], rel=1e-9)
    assert fig["ttft_ms"].mean == pytest.approx(saved["ttft_ms"]["mean"], rel=1e-6)


def test_real_metrics_dump_counters_gauges_and_cache_config() -> None:
    before = parse_prometheus((RUN.parent / "a3_preempt_blocks4096_s128" / "metrics_before.txt").read_text())
    after = parse_prometheus((RUN.parent / "a3_preempt_blocks4096_s128" / "metrics_after.txt").read_text())
    assert counter(after, "vllm:num_preemptions") - (counter(before, "vllm:num_preemptions") or 0) == 106
    assert counter(after, "vllm:request_success", {"finished_reason": "length"}) >= 512
    assert gauge(after, "vllm:kv_cache_usage_perc") is not None
    info = labels_of(after, "vllm:cache_config_info")
    assert info is not None and info["num_gpu_blocks"] == "4096" and info["block_size"] == "16"
    # The pre-0.9.2 name is accepted as an alias of the new one.
    old = parse_prometheus('vllm:gpu_cache_usage_perc{engine="0"} 0.75\n')
    assert gauge(old, "vllm:kv_cache_usage_perc") == 0.75


def test_per_gpu_memory_timings_and_overhead_round_trip_through_metrics():
    r = TrialResult(TrialStatus.OK, backend="vllm", startup_s=80.0, duration_s=15.0, dispatch_s=99.5,
                    worker_memory={"TP0": {"weights": 0.81, "kv_cache": 68.73}, "PP1_TP0": {"activation_peak": 0.3}},
                    gpu_used_mib_peak={"0": 72000, "1": 71800}, timings_s={"torch_compile": 12.6, "stop": 2.1},
                    compile_cache_hit=False)
    m = r.metrics()
    assert m["worker_TP0_kv_cache_gib"] == 68.73 and m["worker_PP1_TP0_activation_peak_gib"] == 0.3
    assert m["gpu1_used_mib_peak"] == 71800 and m["timing_torch_compile_s"] == 12.6
    assert m["compile_cache_hit"] == 0.0
    assert m["overhead_s"] == pytest.approx(4.5)  # 99.5 s in the driver's hands - 80 s startup - 15 s window
    back = TrialResult.from_metrics("ok", None, m, backend="vllm")
    assert back.worker_memory == r.worker_memory and back.gpu_used_mib_peak == r.gpu_used_mib_peak
    assert back.timings_s == r.timings_s and back.compile_cache_hit is False and back.metrics() == m


def test_same_start_repeats_are_load_not_overhead():
    """A leading trial measures its confirmation repeats on its own server before it returns, so its
    dispatch time holds them (the 2026-12-03 real tune, study_l8b_tune_c: 29.5 s "overhead" of which 23.2 s was the repeat)."""
    repeat = TrialResult(TrialStatus.OK, backend="vllm", duration_s=21.7, wall_s=23.2)
    r = TrialResult(TrialStatus.OK, backend="vllm", startup_s=120.2, duration_s=21.7, dispatch_s=171.3,
                    repeats=[repeat])
    assert r.overhead_s == pytest.approx(171.3 - 120.2 - 21.7 - 23.2)
    assert TrialResult(TrialStatus.OK, backend="vllm", startup_s=120.2, duration_s=21.7,
                       dispatch_s=171.3).overhead_s == pytest.approx(29.4)


def test_simulated_trials_report_no_overhead():
    """The simulator's startup and window are virtual seconds: subtracting them from wall time means nothing."""
    r = TrialResult(TrialStatus.OK, backend="sim", startup_s=80.0, duration_s=15.0, dispatch_s=1.2)
    assert "overhead_s" not in r.metrics() and r.metrics()["dispatch_s"] == 1.2


def test_the_api_server_note_on_real_windows() -> None:
    """A trial says its API server set the pace when it was at least 90% busy: the real 8B
    decode-heavy window at 256 in flight (100%, bound by it), not the prefill-heavy window of the
    same start (56%). The figure is the API server's CPU over the window, as the engine records it,
    and it survives the round trip through the stored metrics."""
    import gzip
    import json

    from servetune.engines.vllm.metrics import counter, parse_prometheus
    from servetune.result import api_server_note

    start = Path(__file__).parent / "fixtures" / "real_h200" / "scale" / "2026-12-02a_l8b_u09_s256_mbt8192"

    def window(name: str) -> TrialResult:
        d = start / name
        cpu = [counter(parse_prometheus(gzip.decompress((d / f"metrics_{w}.txt.gz").read_bytes()).decode()),
                       "process_cpu_seconds_total") for w in ("before", "after")]
        summary = json.loads((d / "summary.json").read_text())
        return TrialResult(TrialStatus.OK, duration_s=summary["duration_s"], api_server_cpu_s=cpu[1] - cpu[0])

    decode, prefill = window("p256_o1024_c256"), window("p1024_o256_c256")
    assert api_server_note(decode.metrics()) is not None and "100% busy" in api_server_note(decode.metrics())
    assert api_server_note(prefill.metrics()) is None
    assert 0.5 < prefill.metrics()["api_server_busy"] < 0.6
    back = TrialResult.from_metrics("ok", None, decode.metrics())
    assert back.api_server_cpu_s == decode.api_server_cpu_s and back.metrics() == decode.metrics()
