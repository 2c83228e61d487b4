"""The host's API-server CPU, measured by the user on a running server and given to ``simulate``.

``servetune workload from-metrics`` reads two ``/metrics`` readings and prints the API server's CPU
per generated token; ``servetune simulate --api-cpu-us-per-token`` turns it into the host's
``api_cpu_factor``. Checked on a real H100 window's readings (``tests/fixtures/real_h100``, 2026-12-05).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

import pytest

from servetune.cli import _simulate as _cli_simulate
from servetune.engines.vllm.workload_fit import metrics_window, workload_from_metrics

WINDOW = Path(__file__).resolve().parents[1] / "fixtures" / "real_h100" / "2026-12-05_l8b_u09_s256_mbt8192" / "p256_o1024_c128"
FLAGS = ["--set", "max_model_len=4096", "--set", "max_num_seqs=256", "--set", "max_num_batched_tokens=8192",
         "--set", "gpu_memory_utilization=0.9"]


def _dump(name: str) -> str:
    return gzip.decompress((WINDOW / f"{name}.txt.gz").read_bytes()).decode()


def _sample(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="servetune")
    _cli_simulate.add_parser(parser.add_subparsers(dest="command", required=True))
    return _cli_simulate.run(parser.parse_args(["simulate", *argv]))


def test_the_readings_give_the_api_servers_cpu_per_generated_token() -> None:
    before, after = _dump("metrics_before"), _dump("metrics_after")
    window = metrics_window(after, before, seconds=20.0)
    cpu = _sample(after, "process_cpu_seconds_total") - _sample(before, "process_cpu_seconds_total")
    tokens = _sample(after, "vllm:generation_tokens_total") - _sample(before, "vllm:generation_tokens_total")
    assert window.api_cpu_us_per_token == pytest.approx(1e6 * cpu / tokens)
    assert 30 < window.api_cpu_us_per_token < 300  # a Python API server streaming tokens
    text = workload_from_metrics(window, "the H100 window")
    assert f"--api-cpu-us-per-token {window.api_cpu_us_per_token:.0f}" in text
    # One reading alone: its CPU counter includes the server's startup, so no figure is claimed.
    assert metrics_window(after).api_cpu_us_per_token is None


def test_simulate_runs_at_the_measured_cost_per_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    us = metrics_window(_dump("metrics_after"), _dump("metrics_before"), seconds=20.0).api_cpu_us_per_token
    workload = tmp_path / "w.yaml"
    workload.write_text("input_len: 256\noutput_len: 1024\nnum_requests: 128\nconcurrency: 128\n")
    base = ["--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--workload", str(workload), *FLAGS, "--json"]
    assert run_cli(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert run_cli([*base, "--api-cpu-us-per-token", f"{us:.3f}"]) == 0
    host = json.loads(capsys.readouterr().out)

    def us_per_token(r: dict) -> float:
        return 1e6 * r["api_server_cpu_s"] / (r["output_throughput"] * r["duration_s"])

    # The rule's promise: the simulated API server now spends what the real one did a token
    # (within what a busier loop saves by merging tokens into fewer chunks).
    assert us_per_token(plain) < 0.8 * us
    assert us_per_token(host) == pytest.approx(us, rel=0.1)
    assert run_cli([*base[:-1], "--api-cpu-us-per-token", f"{us:.3f}"]) == 0
    assert re.search(r"^note: host CPU: [0-9.]+ us a generated token measured; simulated at --api-cpu-factor 1\.",
                     capsys.readouterr().out, re.M)


@pytest.mark.parametrize("argv", [["--api-cpu-us-per-token", "0"], ["--api-cpu-us-per-token", "nan"],
                                  ["--api-cpu-us-per-token", "90", "--api-cpu-factor", "1.2"]])
def test_bad_token_cost_exits_2_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                argv: list[str]) -> None:
    workload = tmp_path / "w.yaml"
    workload.write_text("input_len: 64\noutput_len: 16\nnum_requests: 8\nconcurrency: 4\n")
    assert run_cli(["--model", "servetune-test-850m", "--gpu", "H200", "--workload", str(workload), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --api-cpu-us-per-token") and err.count("\n") == 1
