"""The example workloads in jobs/workloads/: each one is what its name says, runs through
`servetune simulate`, and `simulate --help` points at every one of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servetune import cli
from servetune.cli._simulate import EXAMPLE_WORKLOADS
from servetune.workload import Workload

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "jobs" / "workloads"
MODEL = ["--model", "llama-3.1-8b", "--gpu", "H100-80GB"]


def _load(name: str) -> Workload:
    import yaml

    path = FOLDER / name
    return Workload.from_dict(yaml.safe_load(path.read_text()), base_dir=path.parent)


def _simulate(capsys: pytest.CaptureFixture[str], name: str, *sets: str) -> dict:
    argv = ["simulate", *MODEL, "--workload", str(FOLDER / name), "--json"]
    for item in sets:
        argv += ["--set", item]
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_every_shipped_workload_is_listed_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(p.name for p in FOLDER.glob("*.yaml")) == sorted(EXAMPLE_WORKLOADS)
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--help"])
    help_text = capsys.readouterr().out
    for name in EXAMPLE_WORKLOADS:
        assert f"jobs/workloads/{name}" in help_text


@pytest.mark.parametrize("name", sorted(EXAMPLE_WORKLOADS))
def test_each_example_serves_every_request_on_the_simulator(capsys: pytest.CaptureFixture[str], name: str) -> None:
    result = _simulate(capsys, name)
    assert result["status"] == "ok"
    assert result["completed"] == len(_load(name).requests()) and result["failed"] == 0


def test_prefill_and_decode_heavy_are_what_they_say() -> None:
    prefill, decode = _load("prefill-heavy.yaml").requests(), _load("decode-heavy.yaml").requests()
    ratio = lambda reqs: sum(r.prompt_tokens for r in reqs) / sum(r.output_tokens for r in reqs)  # noqa: E731
    assert ratio(prefill) > 10 and ratio(decode) < 0.5


def test_poisson_workload_arrives_at_its_rate() -> None:
    w = _load("poisson-rate.yaml")
    arrivals = [r.arrival_s for r in w.requests()]
    assert all(a is not None for a in arrivals) and arrivals == sorted(arrivals)
    rate = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    assert w.request_rate == 6 and 0.8 * 6 < rate < 1.2 * 6


def test_shared_prefix_is_served_faster_with_prefix_caching(capsys: pytest.CaptureFixture[str]) -> None:
    reqs = _load("shared-prefix.yaml").requests()
    assert {r.prefix_group for r in reqs} == {0, 1, 2, 3} and all(r.prefix_tokens == 1024 for r in reqs)
    cached = _simulate(capsys, "shared-prefix.yaml", "enable_prefix_caching=true")
    uncached = _simulate(capsys, "shared-prefix.yaml", "enable_prefix_caching=false")
    assert cached["ttft_mean_ms"] < uncached["ttft_mean_ms"]
    assert cached["output_throughput"] > uncached["output_throughput"]


def test_trace_replays_its_recorded_arrivals(capsys: pytest.CaptureFixture[str]) -> None:
    lines = [json.loads(line) for line in (FOLDER / "trace.jsonl").read_text().splitlines() if line.strip()]
    reqs = _load("trace.yaml").requests()
    assert len(reqs) == len(lines)
    span = max(row["timestamp"] for row in lines) - min(row["timestamp"] for row in lines)
    assert reqs[-1].arrival_s == pytest.approx(span)
    result = _simulate(capsys, "trace.yaml")
    assert result["duration_s"] >= span  # replayed at the recorded times, not as fast as it can
