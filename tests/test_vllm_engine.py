"""The real-engine path end to end, against the `vllm serve` stand-in as a real subprocess.

Launch in its own process group, wait for /health, load over streaming HTTP, scrape /metrics,
parse and classify the log, stop the process group: for a healthy server, a preempting one, each
startup failure the stand-in reproduces with vLLM's texts, one that never becomes healthy, one
that dies mid-run and one that ignores SIGTERM.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from servetune.result import TrialStatus
from servetune.vllm_engine import VllmLaunch, run_vllm_trial
from servetune.workload import Workload

PLATFORM = str(Path(__file__).resolve().parent.parent / "platform")
STANDIN = (sys.executable, "-m", "servetune.sim.server")
ENV = {"PYTHONPATH": PLATFORM, "SERVETUNE_SIM_STARTUP_S": "0.2", "SERVETUNE_SIM_DEATH_LINGER_S": "0.2"}
WORKLOAD = Workload.from_dict({"input_len": 256, "output_len": 32, "num_requests": 24, "concurrency": 8,
                               "warmup_requests": 1})


def _launch(tmp_path: Path, flags: dict, *extra: str, timeout: float = 60.0) -> VllmLaunch:
    return VllmLaunch(model="servetune-test-850m", flags=flags, serve_command=STANDIN,
                      extra_args=("--sim-gpu", "H200", "--sim-speedup", "20", *extra), env=ENV,
                      startup_timeout_s=timeout, stop_grace_s=3.0, log_dir=tmp_path, sample_interval_s=0.05)


def test_healthy_trial_is_measured_and_parsed(tmp_path: Path) -> None:
    r = run_vllm_trial(_launch(tmp_path, {"gpu_memory_utilization": 0.5, "max_num_seqs": 64}), WORKLOAD)
    assert r.status is TrialStatus.OK, (r.cause, r.evidence)
    assert r.completed == 24 and r.failed == 0
    assert all(rec.output_tokens == 32 for rec in r.requests)
    assert r.output_throughput and r.output_throughput > 0
    assert r.ttft_ms is not None and r.itl_ms is not None
    assert r.preemptions == 0
    assert r.kv_cache_tokens == 2_216_528  # the stand-in prints what the planner predicts for the H200
    assert r.memory is not None and r.memory.weights == pytest.approx(1.59, abs=0.01)
    assert r.vllm_version == "0.26.0"
    assert "Application startup complete." in r.log_text
    assert (tmp_path / "server.log").exists()


def test_preemptions_come_from_the_metrics_counter_delta(tmp_path: Path) -> None:
    flags = {"max_num_seqs": 64, "max_model_len": 2048, "num_gpu_blocks_override": 64}
    r = run_vllm_trial(_launch(tmp_path, flags), Workload.from_dict(
        {"input_len": 256, "output_len": 256, "num_requests": 32, "concurrency": 32}))
    assert r.status is TrialStatus.OK, (r.cause, r.evidence)
    assert r.preemptions is not None and r.preemptions > 0
    assert r.kv_cache_usage_peak is not None and r.kv_cache_usage_peak > 0.5


@pytest.mark.parametrize(("flags", "extra", "status", "needle"), [
    ({"gpu_memory_utilization": 0.012}, (), TrialStatus.STARTUP_OOM, "No available memory for the cache blocks"),
    ({"max_num_seqs": 64}, ("--sim-fail", "kv_too_small"), TrialStatus.KV_TOO_SMALL, "max seq len"),
    ({"max_num_seqs": 64}, ("--sim-fail", "cudagraph_oom"), TrialStatus.CUDAGRAPH_OOM, "CUDA out of memory"),
    ({"max_num_seqs": 64}, ("--sim-fail", "crash"), TrialStatus.CRASHED, "flashinfer"),
])
def test_startup_failures_are_classified_with_evidence(tmp_path: Path, flags: dict, extra: tuple,
                                                       status: TrialStatus, needle: str) -> None:
    r = run_vllm_trial(_launch(tmp_path, flags, *extra), WORKLOAD)
    assert r.status is status, (r.cause, r.evidence[:5])
    assert needle in (r.cause or "") + "\n".join(r.evidence)
    assert r.output_throughput is None


def test_a_server_that_never_becomes_healthy_times_out_and_is_killed(tmp_path: Path) -> None:
    r = run_vllm_trial(_launch(tmp_path, {"max_num_seqs": 8}, "--sim-fail", "hang", timeout=3.0), WORKLOAD)
    assert r.status is TrialStatus.TIMEOUT
    assert r.startup_s is not None and r.startup_s >= 3.0
    _assert_group_gone(r.evidence)


def test_a_server_that_ignores_sigterm_is_killed_with_sigkill(tmp_path: Path) -> None:
    r = run_vllm_trial(_launch(tmp_path, {"max_num_seqs": 8}, "--sim-ignore-sigterm"), WORKLOAD)
    assert r.status is TrialStatus.OK
    assert any("ignored SIGTERM" in e for e in r.evidence)
    _assert_group_gone(r.evidence)


def test_an_engine_death_mid_run_is_a_crash(tmp_path: Path) -> None:
    r = run_vllm_trial(_launch(tmp_path, {"max_num_seqs": 8}, "--sim-fail", "runtime_crash"), WORKLOAD)
    assert r.status in (TrialStatus.CRASHED, TrialStatus.RUNTIME_OOM)
    assert "fatal" in ((r.cause or "") + "\n".join(r.evidence)).lower() or r.failed


def _assert_group_gone(evidence: list[str]) -> None:
    """The launched process group must be empty once the trial returns."""
    argv_line = next(e for e in evidence if e.startswith("argv="))
    port = argv_line.split("'--port', '")[1].split("'")[0]
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        assert not ("servetune.sim.server" in cmdline and f"--port {port}" in cmdline), \
            f"stand-in on port {port} still alive: pid {pid}"


def test_a_flag_the_installed_vllm_does_not_know_is_refused_before_launch(tmp_path: Path) -> None:
    help_text = (Path(__file__).parent / "fixtures" / "real_h200" / "examples" / "help_all.txt").read_text()
    launch = _launch(tmp_path, {"max_num_seqs": 8}, "--swap-space", "4")
    launch = type(launch)(**{**launch.__dict__, "serve_help": help_text})
    r = run_vllm_trial(launch, WORKLOAD)
    assert r.status is TrialStatus.INVALID_CONFIG and "--swap-space" in (r.cause or "")
    assert not (tmp_path / "server.log").exists()  # nothing was launched


def test_serve_help_is_read_once_and_cached_on_disk(tmp_path: Path) -> None:
    from servetune.vllm_engine import read_serve_help

    fake = tmp_path / "fake-vllm"
    counter = tmp_path / "calls"
    fake.write_text(f"#!/bin/sh\necho x >> {counter}\necho '  --max-num-seqs MAX_NUM_SEQS'\n")
    fake.chmod(0o755)
    first = read_serve_help((str(fake), "serve"), cache_dir=tmp_path / "cache")
    read_serve_help.cache_clear()  # a new Ray actor process: only the disk cache is left
    second = read_serve_help((str(fake), "serve"), cache_dir=tmp_path / "cache")
    assert first == second and first is not None and "--max-num-seqs" in first
    assert counter.read_text().count("x") == 1
