"""`vllm bench serve` as a load generator: argv building, result parsing on real H200 results, the run.

The parser is checked on the result JSONs `vllm bench serve` (vLLM 0.26.0) wrote on the H200,
against the banner the same runs printed; the argv is checked against the option names in the
argparse Namespace those runs logged, so every option servetune passes exists in vLLM's bench.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

from servetune.engines.vllm.bench_client import (bench_argv, parse_bench_banner, parse_bench_result, random_dataset_args,
                                    run_bench)
from servetune.errors import SpecError
from servetune.result import LatencySummary
from servetune.workload import Workload

REAL = Path(__file__).parents[2] / "fixtures" / "real_h200"
RUNS = [("a1_u05_s64", "bench"), ("c1_loadgen_vs_bench", "bench"), ("c1_loadgen_vs_bench", "bench_1")]
# Banner label -> (figure, LatencySummary field or None).
BANNER = {
    "Successful requests": ("completed", None), "Failed requests": ("failed", None),
    "Benchmark duration (s)": ("duration_s", None), "Request throughput (req/s)": ("request_throughput", None),
    "Output token throughput (tok/s)": ("output_throughput", None),
    "Total token throughput (tok/s)": ("total_token_throughput", None),
    **{f"{stat} {label} (ms)": (field, attr)
       for label, field in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2EL", "e2e_ms"))
       for stat, attr in (("Mean", "mean"), ("Median", "p50"), ("P50", "p50"), ("P90", "p90"), ("P99", "p99"))},
}


@pytest.mark.parametrize(("run", "stem"), RUNS)
def test_real_results_parse_to_the_figures_bench_printed(run: str, stem: str) -> None:
    raw = json.loads((REAL / run / f"{stem}.json").read_text())
    figures = parse_bench_result(raw)
    banner = parse_bench_banner((REAL / run / f"{stem}.log").read_text())
    assert len(banner) >= len(BANNER)  # the whole banner was read (plus the peak figures)
    for label, (field, attr) in BANNER.items():
        value = figures[field] if attr is None else getattr(figures[field], attr)
        assert round(value, 2) == pytest.approx(banner[label], abs=0.006), label
    # The keys summarize() returns, with the JSON's unrounded values.
    assert set(figures) == {"duration_s", "completed", "failed", "output_throughput", "total_token_throughput",
                            "request_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}
    assert figures["ttft_ms"] == LatencySummary(raw["mean_ttft_ms"], raw["median_ttft_ms"], raw["p90_ttft_ms"],
                                                raw["p99_ttft_ms"])
    assert figures["e2e_ms"].p99 == raw["p99_e2el_ms"] and figures["completed"] == 384 and figures["failed"] == 0


def test_a_result_without_percentiles_or_failed_key_still_parses() -> None:
    raw = {"duration": 3.0, "completed": 7, "num_prompts": 10, "output_throughput": 1.0,
           "mean_ttft_ms": 5.0, "median_ttft_ms": 4.0, "p99_ttft_ms": 9.0}  # older bench: no 'failed', no p90
    f = parse_bench_result(raw)
    assert f["failed"] == 3 and f["ttft_ms"] is None and f["total_token_throughput"] == 0.0
    with pytest.raises(ValueError):
        parse_bench_result({"date": "x"})


def _options(argv: list[str]) -> dict[str, str | bool]:
    """--opt value / --flag -> {dest: value}."""
    out: dict[str, str | bool] = {}
    i = 3
    while i < len(argv):
        key = argv[i][2:].replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[key], i = argv[i + 1], i + 2
        else:
            out[key], i = True, i + 1
    return out


def test_argv_matches_the_options_of_the_real_c1_run() -> None:
    log = (REAL / "c1_loadgen_vs_bench" / "bench.log").read_text()
    namespace = re.search(r"^Namespace\((.*)\)$", log, re.MULTILINE).group(1)
    real = dict(re.findall(r"(\w+)=('[^']*'|True|False|None|[\w.]+)", namespace))
    summary = json.loads((REAL / "c1_loadgen_vs_bench" / "summary.json").read_text())
    workload = Workload.from_dict({**summary["workload"], "warmup_requests": 0})
    argv = bench_argv(workload, base_url="http://127.0.0.1:8011/", model="/root/model",
                      result_dir="/tmp/o/real/c1_loadgen_vs_bench")
    assert argv[:3] == ["vllm", "bench", "serve"]
    opts = _options(argv)
    for dest, value in opts.items():
        assert dest in real, f"--{dest} is not an option of vllm bench serve 0.26"
        expected = ast.literal_eval(real[dest]) if real[dest][0] in "'TFN" else real[dest]
        if dest == "temperature":
            assert expected is None and value == "0"  # the real run left it to the server; we ask greedy
        elif value is True:
            assert expected is True, dest
        else:
            assert str(expected) == value or float(expected) == float(value), (dest, expected, value)


def test_uniform_lengths_become_a_range_ratio_and_pacing_is_rate_or_concurrency() -> None:
    w = Workload.from_dict({"input_len": {"mean": 1024, "range_ratio": 0.25},
                            "output_len": {"dist": "uniform", "min": 192, "max": 320},
                            "num_requests": 50, "request_rate": 4.5, "warmup_requests": 2, "seed": 9})
    assert random_dataset_args(w) == ["--dataset-name", "random", "--random-input-len", "1024",
                                      "--random-output-len", "256", "--random-range-ratio", "0.25"]
    opts = _options(bench_argv(w, base_url="http://h:1", model="m", result_dir="/r", served_model_name="alias",
                               command=("python", "-m", "bench")))
    assert opts["request_rate"] == "4.5" and opts["burstiness"] == "1" and "max_concurrency" not in opts
    assert opts["num_warmups"] == "2" and opts["seed"] == "9" and opts["num_prompts"] == "50"
    assert opts["served_model_name"] == "alias" and opts["model"] == "m"
    # A shared prefix: bench's prompt is the prefix plus --random-input-len tokens.
    shared = Workload.from_dict({"input_len": 1024, "output_len": 64, "prefix_len": 24, "num_requests": 8,
                                 "concurrency": 4})
    assert random_dataset_args(shared)[2:] == ["--random-input-len", "1000", "--random-output-len", "64",
                                               "--random-range-ratio", "0", "--random-prefix-len", "24"]


@pytest.mark.parametrize(("workload", "field"), [
    ({"input_len": {"dist": "normal", "mean": 512, "std": 64}, "output_len": 64}, "workload.input_len"),
    ({"input_len": 512, "output_len": {"dist": "lognormal", "mean": 128, "sigma": 0.5}}, "workload.output_len"),
    ({"input_len": {"dist": "uniform", "min": 100, "max": 201}, "output_len": {"dist": "uniform", "min": 1, "max": 2}},
     "workload.input_len"),  # an odd min + max: bench's interval is centred on a whole count
    ({"input_len": {"mean": 1000, "range_ratio": 0.5}, "output_len": {"mean": 100, "range_ratio": 0.2}},
     "workload.output_len"),  # one --random-range-ratio for both lengths
    ({"input_len": {"mean": 1000, "range_ratio": 0.5}, "output_len": 100}, "workload.input_len"),
    ({"input_len": 512, "output_len": 64, "prefix_len": 32, "num_prefix_groups": 4}, "workload.num_prefix_groups"),
])
def test_workloads_bench_cannot_send_are_refused_naming_the_field(workload: dict, field: str) -> None:
    w = Workload.from_dict({**workload, "num_requests": 8, "concurrency": 4})
    with pytest.raises(SpecError) as info:
        bench_argv(w, base_url="http://h:1", model="m", result_dir="/r")
    assert info.value.field == field and info.value.fix


def test_a_prompt_file_is_refused(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there", "output_len": 8}\n')
    w = Workload.from_dict({"prompt_file": str(prompts), "output_len": 8, "num_requests": 2, "concurrency": 1})
    with pytest.raises(SpecError) as info:
        random_dataset_args(w)
    assert info.value.field == "workload.prompt_file"


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\nimport sys, json, time, pathlib\n{body}\n")
    path.chmod(0o755)
    return path


def test_run_bench_reads_the_result_and_stops_a_run_on_request(tmp_path: Path) -> None:
    fixture = REAL / "a1_u05_s64" / "bench.json"
    fake = _script(tmp_path / "fake-bench", f"""
a = sys.argv
out = pathlib.Path(a[a.index("--result-dir") + 1]) / a[a.index("--result-filename") + 1]
print("Starting main benchmark run...")
out.write_text(pathlib.Path({str(fixture)!r}).read_text())""")
    result = tmp_path / "res" / "bench.json"
    result.parent.mkdir()
    result.write_text("{}")  # a stale result from an earlier run must not be read
    w = Workload.from_dict({"input_len": 64, "output_len": 8, "num_requests": 4, "concurrency": 2})
    argv = bench_argv(w, base_url="http://127.0.0.1:1", model="m", result_dir=result.parent, command=(str(fake),))
    run = run_bench(argv, result, tmp_path / "bench.log")
    assert run.returncode == 0 and run.error is None and run.stopped is None
    assert run.figures == parse_bench_result(json.loads(fixture.read_text()))
    assert "Starting main benchmark run" in (tmp_path / "bench.log").read_text()

    hang = _script(tmp_path / "hang-bench", "time.sleep(60)")
    polls: list[int] = []
    run = run_bench([str(hang)], result, tmp_path / "hang.log", poll_interval_s=0.05,
                    on_poll=lambda: polls.append(1) or ("enough" if len(polls) >= 3 else None), stop_grace_s=1.0)
    assert run.stopped == "enough" and run.figures is None and len(polls) == 3
    assert run.returncode is not None  # it was stopped and reaped

    broken = _script(tmp_path / "broken-bench", "print('All requests failed.'); sys.exit(1)")
    run = run_bench([str(broken)], result, tmp_path / "broken.log")
    assert run.returncode == 1 and run.figures is None and "All requests failed" in (run.error or "")
    run = run_bench([str(tmp_path / "missing")], result, tmp_path / "missing.log")
    assert run.returncode is None and "cannot start" in (run.error or "")
