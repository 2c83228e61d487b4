"""The published-run fixtures (tests/fixtures/published_runs) and their loader, benchmarks/published_runs.py.

Every fixture file must load: each run names a GPU of the table by its exact name, a model the
planner reads, a vLLM version, a layout whose GPUs add up, the load and the published figure it
is judged on, and the split the rule gives (at most half of a GPU's runs in a file are fit).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from published_runs import FIXTURES, judge, load_runs, split_of, workload_of

from servetune.errors import SpecError

RUNS = load_runs()


def test_every_fixture_loads_and_is_split_by_the_rule_with_at_most_half_fit_per_gpu_and_file() -> None:
    assert RUNS, "no published run loaded"
    for file in {r.file for r in RUNS}:
        mine = [r for r in RUNS if r.file == file]
        assert split_of(mine) == {r.id: r.split for r in mine}
        for gpu in {r.gpu for r in mine}:
            on_gpu = [r for r in mine if r.gpu == gpu]
            assert sum(r.split == "fit" for r in on_gpu) <= len(on_gpu) // 2, (file, gpu)
    assert len({r.id for r in RUNS}) == len(RUNS)


def _write(tmp_path: Path, edit: dict) -> Path:
    """The first committed run with ``edit`` applied (a value None removes the key), alone in a file."""
    entry = yaml.safe_load((FIXTURES / "dense.yaml").read_text())[0]
    for key, value in edit.items():
        node, *path = key.split(".")
        target = entry
        for part in [node, *path][:-1]:
            target = target[part]
        if value is None:
            target.pop([node, *path][-1])
        else:
            target[[node, *path][-1]] = value
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump([entry]))
    return path


@pytest.mark.parametrize(("edit", "field"), [
    ({"gpu": "H100"}, "gpu"),                                   # ambiguous: SXM, PCIe or NVL
    ({"gpu": "h100-sxm"}, "gpu"),                               # an alias, not the table's name
    ({"layout": {"tp": 2, "pp": 1, "dp": 1, "ep": 1}}, "num_gpus"),
    ({"measured.output_throughput": None}, "measured.output_throughput"),   # a closed loop's headline
    ({"workload.request_rate": 4, "measured.tpot_ms": None}, "measured.tpot_ms"),  # an open loop's
    ({"workload.input_len": 0}, "workload.input_len"),
    ({"workload.burst": 1}, "workload.burst"),
    ({"vllm_version": "0.6.3"}, "vllm_version"),                # before the V1 engine's profiler
    ({"split": "fit"}, "split"),                                # one run alone on its GPU is held out
    ({"raw": None}, "raw"),
    ({"flags": {"tensor_parallel_size": 2}}, "flags"),
])
def test_a_bad_run_is_refused_naming_its_field(tmp_path: Path, edit: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        load_runs([_write(tmp_path, edit)])
    assert field in err.value.field or field in str(err.value)


def test_the_load_shape_becomes_servetunes_workload_per_dp_replica() -> None:
    run = next(r for r in RUNS if r.closed_loop)
    w = workload_of(run)
    assert w.concurrency == min(run.workload.get("max_concurrency") or run.workload["num_prompts"],
                                run.workload["num_prompts"])
    assert w.num_requests == run.workload["num_prompts"] and w.request_rate is None
    open_runs = [r for r in RUNS if not r.closed_loop]
    if open_runs:
        assert workload_of(open_runs[0]).request_rate == pytest.approx(
            open_runs[0].workload["request_rate"] / open_runs[0].layout["dp"])


def test_a_run_simulates_to_finite_figures_paired_with_the_published_ones() -> None:
    run = min((r for r in RUNS if r.split == "held_out"),
              key=lambda r: r.workload["num_prompts"] * (r.workload["input_len"] + r.workload["output_len"]))
    judged = judge(run)
    assert judged.failure is None
    assert judged.headline_error is not None and math.isfinite(judged.headline_error)
    assert judged.sim_ttft_ms is not None and judged.sim_ttft_ms > 0
