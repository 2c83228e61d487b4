"""Trial figures computed as `vllm bench serve` computes them, checked on a real H200 run."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from servetune.metrics import counter, gauge, labels_of, parse_prometheus
from servetune.result import LatencySummary, RequestRecord, summarize

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
