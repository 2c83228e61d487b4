"""Workloads: seeded lengths, Poisson arrivals, traces and prompt files, and their bad-input errors."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from servetune.errors import SpecError
from servetune.workload import LengthDist, Workload


def test_lengths_are_deterministic_for_a_seed_and_respect_bounds() -> None:
    spec = {"input_len": {"dist": "lognormal", "mean": 800, "sigma": 0.6, "min": 16, "max": 4096},
            "output_len": {"dist": "uniform", "min": 64, "max": 512}, "num_requests": 500, "concurrency": 8, "seed": 4}
    a, b = Workload.from_dict(spec).requests(), Workload.from_dict(spec).requests()
    assert a == b
    assert all(16 <= r.prompt_tokens <= 4096 and 64 <= r.output_tokens <= 512 for r in a)
    assert 650 < statistics.mean(r.prompt_tokens for r in a) < 950  # the arithmetic mean is the one asked for
    other = Workload.from_dict({**spec, "seed": 5}).requests()
    assert other != a


def test_range_ratio_matches_vllm_bench_serve() -> None:
    d = LengthDist.parse({"mean": 1000, "range_ratio": 0.25}, "x")
    assert (d.dist, d.min, d.max) == ("uniform", 750, 1250)


def test_poisson_arrivals_have_the_requested_rate_and_warmups_are_excluded() -> None:
    w = Workload.from_dict({"input_len": 128, "output_len": 16, "num_requests": 4000, "request_rate": 20,
                            "warmup_requests": 3})
    reqs = w.requests()
    assert len(reqs) == 4000 and len(w.requests(include_warmup=True)) == 4003
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times)
    rate = (len(times) - 1) / (times[-1] - times[0])
    assert 18.5 < rate < 21.5


def test_trace_and_prompt_files(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 10.5, "input_length": 100, "output_length": 20}\n'
                     '{"timestamp": 10.0, "input_length": 50, "output_length": 10}\n')
    w = Workload.from_dict({"trace_file": "trace.jsonl"}, base_dir=tmp_path)
    assert [(r.arrival_s, r.prompt_tokens) for r in w.requests()] == [(0.0, 50), (0.5, 100)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "' + "word " * 100 + '", "output_len": 7}\n{"prompt_len": 33}\n')
    w = Workload.from_dict({"prompt_file": str(prompts), "output_len": 9, "num_requests": 4, "concurrency": 2})
    reqs = w.requests()
    assert [r.output_tokens for r in reqs] == [7, 9, 7, 9] and reqs[1].prompt_tokens == 33


@pytest.mark.parametrize(("data", "field"), [
    ({"output_len": 5, "num_requests": 1, "concurrency": 1}, "workload.input_len"),
    ({"input_len": 5, "output_len": 5, "num_requests": 1}, "workload"),
    ({"input_len": 5, "output_len": 5, "num_requests": 1, "concurrency": 1, "request_rate": 2}, "workload"),
    ({"input_len": 0, "output_len": 5, "num_requests": 1, "concurrency": 1}, "workload.input_len"),
    ({"input_len": {"dist": "gauss", "mean": 3}, "output_len": 5, "num_requests": 1, "concurrency": 1},
     "workload.input_len.dist"),
    ({"input_len": 5, "output_len": 5, "num_requests": 1, "concurrency": 1, "concurency": 2}, "workload.concurency"),
    ({"input_len": 5, "output_len": 5, "num_requests": "many", "concurrency": 1}, "workload.num_requests"),
    ({"input_len": 5, "output_len": 5, "num_requests": 2, "request_rate": -1}, "workload.request_rate"),
])
def test_bad_workloads_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        Workload.from_dict(data)
    assert err.value.field == field


def test_a_broken_line_in_a_trace_names_the_file_and_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1}\n{not json\n')
    with pytest.raises(SpecError) as err:
        Workload.from_dict({"trace_file": str(trace)})
    assert err.value.field.endswith("t.jsonl:2")


def test_what_if_scales_lengthen_prompts_and_compress_arrivals() -> None:
    """The headroom search's scales (servetune.search.headroom): prompts times prompt_scale with the
    shared prefix kept whole, arrivals rate_scale times as frequent, the token bound following."""
    import dataclasses

    base = Workload.from_dict({"input_len": {"dist": "uniform", "min": 100, "max": 400}, "output_len": 32,
                               "num_requests": 20, "request_rate": 5, "prefix_len": 90, "seed": 4})
    scaled = dataclasses.replace(base, prompt_scale=1.5, rate_scale=2.0)
    for a, b in zip(base.requests(), scaled.requests(), strict=True):
        assert b.prompt_tokens == max(91, round(a.prompt_tokens * 1.5)) and b.prefix_tokens == a.prefix_tokens
        assert b.arrival_s == pytest.approx((a.arrival_s or 0.0) / 2.0)
        assert b.output_tokens == a.output_tokens
    assert scaled.token_bound() >= sum(r.prompt_tokens + r.output_tokens for r in scaled.requests())
    assert scaled.to_dict()["prompt_scale"] == 1.5 and "prompt_scale" not in base.to_dict()
    shrunk = dataclasses.replace(base, prompt_scale=0.1)
    assert all(r.prompt_tokens == 91 for r in shrunk.requests())  # never below the shared prefix + 1
