"""servetune.engines.vllm.metrics: Prometheus text read as prometheus_client reads it, on every real vLLM dump we have."""

from __future__ import annotations

import gzip
import math
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from servetune.engines.vllm.metrics import counter, gauge, labels_of, parse_prometheus

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _real_dumps() -> list[Path]:
    """Every real vLLM ``/metrics`` dump under tests/fixtures, plain or gzipped."""
    out = []
    for path in sorted(FIXTURES.rglob("*")):
        if path.is_file() and path.name.endswith((".txt", ".txt.gz")) and "# TYPE vllm:" in _text(path):
            out.append(path)
    return out


def _text(path: Path) -> str:
    raw = path.read_bytes()
    if path.name.endswith(".gz"):
        raw = gzip.decompress(raw)
    return raw.decode(errors="replace")


DUMPS = _real_dumps()


def test_the_fixtures_hold_the_real_dumps_plain_and_gzipped() -> None:
    assert len(DUMPS) >= 80
    assert sum(p.name.endswith(".gz") for p in DUMPS) >= 60
    assert any(not p.name.endswith(".gz") for p in DUMPS)


def test_escaped_label_values_are_unescaped() -> None:
    text = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{engine="0",path="C:\\\\models\\\\llama",note="say \\"hi\\"",'
            'lines="a\\nb",comma="x,y}z"} 1.0\n'
            'vllm:num_preemptions_total{engine="0",reason="a \\"quoted\\" } brace"} 7.0\n')
    m = parse_prometheus(text)
    assert labels_of(m, "vllm:cache_config_info") == {
        "engine": "0", "path": "C:\\models\\llama", "note": 'say "hi"', "lines": "a\nb", "comma": "x,y}z"}
    assert counter(m, "vllm:num_preemptions", where={"reason": 'a "quoted" } brace'}) == 7.0


def test_exemplars_keep_the_sample_value_and_bad_lines_do_not_lose_the_rest() -> None:
    text = ('# TYPE vllm:e2e_request_latency_seconds histogram\n'
            'vllm:e2e_request_latency_seconds_bucket{le="1.0"} 3 # {trace_id="abc def"} 0.42 1700000000.0\n'
            'vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 5 # {trace_id="x"} 9.5\n'
            'vllm:e2e_request_latency_seconds_count 5\n'
            'vllm:e2e_request_latency_seconds_sum 12.5\n'
            'vllm:num_requests_running{engine="0"} 4 1700000000000\n'
            'this is { not a sample\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.5\n')
    m = parse_prometheus(text)
    assert [v for _, v in m["vllm:e2e_request_latency_seconds_bucket"]] == [3.0, 5.0]
    assert counter(m, "vllm:e2e_request_latency_seconds_count") == 5.0
    assert gauge(m, "vllm:num_requests_running") == 4.0  # a timestamp is not the value
    assert gauge(m, "vllm:kv_cache_usage_perc") == 0.5  # read past the malformed line
    assert "this" not in m


def test_vllm_renames_and_counters_without_total_still_read() -> None:
    old = parse_prometheus('# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{engine="0"} 0.75\n'
                           'vllm:gpu_prefix_cache_hits_total 10\nvllm:time_per_output_token_seconds 2\n')
    assert gauge(old, "vllm:kv_cache_usage_perc") == 0.75
    assert counter(old, "vllm:prefix_cache_hits") == 10.0
    assert gauge(old, "vllm:inter_token_latency_seconds") == 2.0
    bare = parse_prometheus("# TYPE vllm:num_preemptions counter\nvllm:num_preemptions{engine=\"0\"} 2\n"
                            "vllm:num_preemptions{engine=\"1\"} 3\n")
    assert counter(bare, "vllm:num_preemptions_total") == counter(bare, "vllm:num_preemptions") == 5.0
    assert counter(parse_prometheus(""), "vllm:num_preemptions") is None
    assert math.isnan(parse_prometheus("x NaN\n")["x"][0][1])


@pytest.mark.parametrize("path", DUMPS, ids=[str(p.relative_to(FIXTURES)) for p in DUMPS])
def test_every_real_dump_reads_whole_and_consistent(path: Path) -> None:
    text = _text(path)
    m = parse_prometheus(text)
    # Every sample line of the dump is read, none dropped or doubled.
    sample_lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert sum(len(v) for v in m.values()) == len(sample_lines)
    # As prometheus_client itself reads it (the whole dump parses: no fallback was needed).
    direct = [(s.name, s.labels, float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]
    ours = [(name, labels, value) for name, samples in m.items() for labels, value in samples]
    assert sorted(ours, key=repr) == sorted(direct, key=repr)
    # The series servetune reads are there, under today's names or the older ones.
    for name in ("vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens"):
        assert counter(m, name) is not None and counter(m, name) >= 0, name
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert gauge(m, name) is not None, name
    assert 0.0 <= gauge(m, "vllm:kv_cache_usage_perc") <= 1.0
    info = labels_of(m, "vllm:cache_config_info")
    assert info is not None and re.fullmatch(r"\d+", info["block_size"])
    # Histograms agree with themselves: the +Inf bucket is the count, per label set.
    for name, samples in m.items():
        if not name.endswith("_bucket"):
            continue
        base = name[: -len("_bucket")]
        counts = {tuple(sorted(lbl.items())): v for lbl, v in m[base + "_count"]}
        for labels, value in samples:
            if labels["le"] == "+Inf":
                rest = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
                assert counts[rest] == value, (name, labels)
