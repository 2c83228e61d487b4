"""Workload specs fitted to vLLM's /metrics histograms and to request logs (``workload_fit``).

The real dumps are the H200 runs under tests/fixtures/real_h200 (vLLM 0.26, Llama-3.1-8B): each
folder's summary.json says what its run sent and requests.json.gz what each request was.
"""

from __future__ import annotations

import bisect
import gzip
import json
import statistics
from pathlib import Path

import pytest
import yaml

from servetune.errors import SpecError
from servetune.spec.schema import StudySpec
from servetune.workload import Workload
from servetune.engines.vllm.workload_fit import (
    fit_lengths, histogram, histogram_of, metrics_window, parse_prometheus, workload_from_metrics, workload_from_trace,
)

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "real_h200"
JOBS = Path(__file__).resolve().parents[3] / "jobs" / "workloads"
#: Runs whose summary.json records a fixed input and output length (every request the same).
FIXED_RUNS = ("a1_u05_s64", "a2_u05_s256", "a3_preempt_blocks4096_s128", "b1_eager_s64", "b2_s256_mbt2048",
              "b3_preempt_blocks1024_s64", "c1_loadgen_vs_bench")


def _window(run: str, seconds: float | None = None):
    d = REAL / run
    return metrics_window((d / "metrics_after.txt").read_text(), (d / "metrics_before.txt").read_text(),
                          seconds, "the run's duration")


def _spec_workload(text: str) -> Workload:
    """The YAML as a study spec's workload section, through the spec's own validation."""
    spec = StudySpec.from_dict({"name": "from-metrics", "model": "servetune-test-850m", "gpu": {"type": "H200"},
                                "workload": yaml.safe_load(text),
                                "search_space": {"params": {"max_num_seqs": [32, 64]}}}, cwd="/tmp")
    return spec.workload


def _bucket(bounds: tuple[float, ...], value: float) -> int:
    return bisect.bisect_left(bounds, value)


@pytest.mark.parametrize("run", FIXED_RUNS)
def test_fixed_length_runs_come_back_exact(run: str) -> None:
    sent = json.loads((REAL / run / "summary.json").read_text())["workload"]
    text = workload_from_metrics(_window(run), run)
    w = _spec_workload(text)
    assert (w.input_len.dist, w.input_len.mean) == ("fixed", sent["input_len"])
    assert (w.output_len.dist, w.output_len.mean) == ("fixed", sent["output_len"])
    assert w.concurrency == 32 and w.request_rate is None  # no time between the dumps: a placeholder, said so
    assert "Rate: not known" in text and "the spread inside that bucket is not known" in text
    assert w.prefix_len == 0  # these runs sent random prompts: under 2% of prompt tokens were cached


def test_varied_lengths_and_rate_recovered_from_the_rate_run() -> None:
    # b4_rate_s128 sent uniform prompts 256..2048 and outputs 64..512 at 40 requests/s (Poisson), 600
    # measured + 4 warm-up requests; its buckets are 1-2-5 up to 5000.
    run = REAL / "b4_rate_s128"
    summary = json.loads((run / "summary.json").read_text())
    sent = json.loads(gzip.decompress((run / "requests.json.gz").read_bytes()))
    window = _window("b4_rate_s128", summary["duration_s"])
    bounds = window.prompt.bounds
    w = _spec_workload(workload_from_metrics(window, "b4"))
    drawn = Workload.from_dict({**yaml.safe_load(workload_from_metrics(window, "b4")), "num_requests": 20000}).requests()
    for key, dist, pick in (("prompt_tokens", w.input_len, lambda r: r.prompt_tokens),
                            ("output_tokens", w.output_len, lambda r: r.output_tokens)):
        sent_vals = [r[key] for r in sent]
        # The mean: the histogram's exact sum over 604 requests (4 warm-ups unrecorded) against the 600 sent: 1%.
        assert statistics.mean(pick(r) for r in drawn) == pytest.approx(statistics.mean(sent_vals), rel=0.01)
        # The range: known to the bucket, so the recovered bounds lie in the buckets of the sent ones.
        assert _bucket(bounds, dist.min) == _bucket(bounds, min(sent_vals))
        assert _bucket(bounds, dist.max) == _bucket(bounds, max(sent_vals))
    assert (w.input_len.dist, w.output_len.dist) == ("uniform", "uniform")  # the likelier shape, as sent
    assert w.request_rate == pytest.approx(604 / summary["duration_s"], rel=0.01)


def test_fit_holds_the_exact_mean_and_reports_its_bucket_error() -> None:
    bounds = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 4000.0)
    w = Workload.from_dict({"input_len": {"dist": "lognormal", "mean": 700, "sigma": 0.7, "min": 20, "max": 4000},
                            "output_len": 8, "num_requests": 5000, "concurrency": 1, "seed": 2})
    values = [r.prompt_tokens for r in w.requests()]
    fit = fit_lengths(histogram_of(values, bounds), "prompt")
    assert fit.dist.dist == "lognormal"
    assert fit.observed_mean == pytest.approx(statistics.mean(values))
    assert 0.5 < fit.dist.spread < 0.9  # the sent sigma 0.7, seen through 1-2-5 buckets
    assert fit.max_share_error < 0.05
    again = Workload.from_dict({"input_len": fit.yaml_value() if fit.dist.dist == "fixed" else yaml.safe_load(
        fit.yaml_value()), "output_len": 8, "num_requests": 20000, "concurrency": 1}).requests()
    assert statistics.mean(r.prompt_tokens for r in again) == pytest.approx(statistics.mean(values), rel=0.02)


def _dump(reqs: int, cached: float, running: int = 0, waiting: int = 0) -> str:
    """A /metrics text with ``reqs`` finished 800-token prompts and 150-token outputs."""
    lines = [f'vllm:request_prompt_tokens_bucket{{le="{le}"}} {n}' for le, n in
             (("500.0", 0), ("1000.0", reqs), ("+Inf", reqs))]
    lines += [f'vllm:request_generation_tokens_bucket{{le="{le}"}} {n}' for le, n in
              (("100.0", 0), ("200.0", reqs), ("+Inf", reqs))]
    lines += [f"vllm:request_prompt_tokens_sum {800 * reqs}", f"vllm:request_prompt_tokens_count {reqs}",
              f"vllm:request_generation_tokens_sum {150 * reqs}", f"vllm:request_generation_tokens_count {reqs}",
              f"vllm:prompt_tokens_cached_total {cached}", f"vllm:num_requests_running {running}",
              f"vllm:num_requests_waiting {waiting}"]
    return "\n".join(lines) + "\n"


def test_requests_left_in_flight_count_as_arrivals() -> None:
    # 200 finished in 10 s while the queue grew by 15: 215 arrived, an overloaded server's offered rate.
    text = workload_from_metrics(metrics_window(_dump(300, 0, running=5, waiting=12), _dump(100, 0, waiting=2),
                                                10.0, "given"), "test")
    assert _spec_workload(text).request_rate == pytest.approx(21.5)
    assert "200 finished + 15 more running or waiting at the end" in text


def test_shared_prefix_share_becomes_prefix_len() -> None:
    text = workload_from_metrics(metrics_window(_dump(300, 200 * 256), _dump(100, 0), 10.0, "given"), "test")
    w = _spec_workload(text)
    assert (w.prefix_len, w.num_prefix_groups) == (256, 1)  # 256 of each 800-token prompt cached
    assert w.request_rate == pytest.approx(20.0) and w.input_len.mean == 800 and w.output_len.mean == 150
    assert "how many distinct prefixes" in text


def test_not_vllm_metrics_and_restarts_are_spec_errors() -> None:
    with pytest.raises(SpecError, match="not vLLM /metrics text"):
        metrics_window("<html>hello</html>")
    with pytest.raises(SpecError, match="not vLLM /metrics text"):
        metrics_window("process_start_time_seconds 1.7e9\nhttp_requests_total 4\n")
    d = REAL / "b4_rate_s128"
    with pytest.raises(SpecError, match="counts went down"):
        metrics_window((d / "metrics_before.txt").read_text(), (d / "metrics_after.txt").read_text())
    with pytest.raises(SpecError, match="no finished requests"):
        workload_from_metrics(metrics_window((d / "metrics_before.txt").read_text()), "empty")
    with pytest.raises(SpecError, match="must be > 0 s"):
        metrics_window((d / "metrics_after.txt").read_text(), (d / "metrics_before.txt").read_text(), 0.0)


def test_histograms_of_several_engines_are_summed() -> None:
    text = "".join(f'h_bucket{{engine="{e}",le="{le}"}} {n}\n' for e in "01" for le, n in (("10", 1), ("+Inf", 3)))
    text += 'h_sum{engine="0"} 30\nh_sum{engine="1"} 30\n'
    h = histogram(parse_prometheus(text), "h")
    assert h is not None and h.counts == (2.0, 4.0) and h.sum == 60.0


def test_from_trace_shares_the_fit_and_gives_the_log_rate() -> None:
    rows = [json.loads(line) for line in (JOBS / "trace.jsonl").read_text().splitlines() if line.strip()]
    text = workload_from_trace(rows, "trace.jsonl")
    w = _spec_workload(text)
    prompts = [r["input_length"] for r in rows]
    times = [r["timestamp"] for r in rows]
    assert w.request_rate == pytest.approx((len(rows) - 1) / (max(times) - min(times)), rel=0.01)
    drawn = Workload.from_dict({**yaml.safe_load(text), "num_requests": 20000}).requests()
    assert statistics.mean(r.prompt_tokens for r in drawn) == pytest.approx(statistics.mean(prompts), rel=0.03)
    assert (w.input_len.min, w.input_len.max) == (min(prompts), max(prompts))  # a log knows its extremes
    with pytest.raises(SpecError, match="trace.jsonl:2: needs a numeric output token count"):
        workload_from_trace([rows[0], {"input_length": 5}], "trace.jsonl")
