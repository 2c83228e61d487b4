"""The real-engine path end to end, against the `vllm serve` stand-in as a real subprocess.

Launch in its own process group, wait for /health, load over streaming HTTP, scrape /metrics,
parse and classify the log, stop the process group: for a healthy server, a preempting one, each
startup failure the stand-in reproduces with vLLM's texts, one that never becomes healthy, one
that dies mid-run, one whose engine stalls, and one that ignores SIGTERM. Also: `vllm bench serve`
selected as the load generator (a fake bench executable that writes a real H200 result), and a
GPU whose memory does not come back (a fake nvidia-smi) quarantined.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import pytest

from servetune.engines.vllm.bench_client import parse_bench_result
from servetune.engines.vllm.metrics import counter, parse_prometheus
from servetune.result import TrialStatus
from servetune.engines.vllm.engine import VllmLaunch, run_vllm_trial
from servetune.workload import Workload

PLATFORM = str(Path(__file__).resolve().parents[3] / "platform")
STANDIN = (sys.executable, "-m", "servetune.sim.server")
ENV = {"PYTHONPATH": PLATFORM, "SERVETUNE_SIM_STARTUP_S": "0.2", "SERVETUNE_SIM_DEATH_LINGER_S": "0.2"}
BENCH_JSON = Path(__file__).parents[2] / "fixtures" / "real_h200" / "a1_u05_s64" / "bench.json"
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
    # The raw evidence behind the counter deltas stays in the trial's folder (uploaded to MLflow).
    before, after = (tmp_path / "metrics_before.txt").read_text(), (tmp_path / "metrics_after.txt").read_text()
    assert "vllm:num_preemptions" in before and "vllm:generation_tokens" in after
    assert json.loads((tmp_path / "gauges.json").read_text())  # sampled during the window
    assert set(r.timings_s) >= {"stop", "gpu_free", "engine_init"}
    assert r.worker_memory["EngineCore"]["weights"] == pytest.approx(1.59, abs=0.01)
    # The API server's CPU over the window: process_cpu_seconds_total after minus before (the
    # stand-in counts its modelled API server there), and its busy share among the metrics.
    cpu = [counter(parse_prometheus(text), "process_cpu_seconds_total") for text in (before, after)]
    assert r.api_server_cpu_s == pytest.approx(cpu[1] - cpu[0]) and r.api_server_cpu_s > 0
    assert r.metrics()["api_server_busy"] == pytest.approx(r.api_server_cpu_s / r.duration_s)


def test_a_sliding_window_models_block_count_comes_from_the_metrics(tmp_path: Path) -> None:
    """gpt-oss: 2 KV-cache groups, so its logged tokens do not give its blocks (the parser says None);
    the API server's cache_config_info gauge does, and the result keeps it."""
    from servetune.engines.vllm.logs import parse_log

    launch = dataclasses.replace(_launch(tmp_path, {"max_num_seqs": 8, "max_model_len": 2048}), model="gpt-oss-20b")
    r = run_vllm_trial(launch, Workload.from_dict({"input_len": 128, "output_len": 16, "num_requests": 8,
                                                   "concurrency": 4}))
    assert r.status is TrialStatus.OK, (r.cause, r.evidence)
    parsed = parse_log(r.log_text)
    assert parsed.architecture == "GptOssForCausalLM" and parsed.num_gpu_blocks is None
    info = re.search(r'num_gpu_blocks="(\d+)"', (tmp_path / "metrics_before.txt").read_text())
    assert info is not None and r.num_gpu_blocks == int(info.group(1))
    # one group's count, what the parser used to derive, is about half of it
    assert r.kv_cache_tokens is not None and r.num_gpu_blocks > 1.9 * r.kv_cache_tokens * 128 / 2048


def test_preemptions_come_from_the_metrics_counter_delta(tmp_path: Path) -> None:
    flags = {"max_num_seqs": 64, "max_model_len": 2048, "num_gpu_blocks_override": 64}
    # The KV-usage gauge is sampled (every 0.05 s), not counted: at the stand-in's usual 20x speed
    # the whole window can pass between a few samples on a loaded machine (a CI run saw a peak of
    # 0.27), so this trial runs at 2x, long enough for the samples to find the full cache.
    r = run_vllm_trial(_launch(tmp_path, flags, "--sim-speedup", "2"), Workload.from_dict(
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


def test_an_engine_death_mid_run_is_a_crash_with_the_root_cause(tmp_path: Path) -> None:
    # 600 generated tokens: the warm-up and about 16 requests finish, then the engine dies with
    # streams in flight (they get vLLM's error chunk) and the server exits.
    r = run_vllm_trial(_launch(tmp_path, {"max_num_seqs": 8}, "--sim-fail", "runtime_crash",
                               "--sim-fail-after-tokens", "600"), WORKLOAD)
    assert r.status is TrialStatus.CRASHED, (r.cause, r.evidence[:6])
    assert "illegal memory access" in (r.cause or "")  # the root exception, not the client's view
    assert any("EngineDeadError" in e for e in r.evidence)
    assert r.completed and r.failed and r.completed + r.failed == 24
    errors = {rec.error.split(":")[0] for rec in r.requests if rec.error}
    assert errors & {"stream error", "not answered", "HTTP 500"}
    assert any(e.startswith("client side:") or "requests failed" in e for e in r.evidence)
    _assert_group_gone(r.evidence)


def test_a_stalled_engine_ends_as_a_timeout_within_the_stall_timeout(tmp_path: Path) -> None:
    launch = dataclasses.replace(_launch(tmp_path, {"max_num_seqs": 8}, "--sim-fail", "stall",
                                         "--sim-fail-after-tokens", "300"), stall_timeout_s=1.5)
    r = run_vllm_trial(launch, WORKLOAD)
    assert r.status is TrialStatus.TIMEOUT, (r.cause, r.evidence[:6])
    assert (r.cause or "").startswith("stalled: no token on any of 8 in-flight streams")
    assert r.completed is not None and r.completed >= 1 and r.failed == 24 - r.completed
    assert all("stalled" in (rec.error or "") for rec in r.requests if rec.error)
    _assert_group_gone(r.evidence)


def _fake_bench(tmp_path: Path) -> Path:
    """A `vllm bench serve` stand-in: records its argv, sends one request to --base-url, writes the
    result JSON of the real a1 run where --result-dir/--result-filename say."""
    fake = tmp_path / "fake-vllm-bench"
    fake.write_text(f"""#!{sys.executable}
import json, pathlib, sys, urllib.request
a = sys.argv
pathlib.Path({str(tmp_path / "bench_argv.json")!r}).write_text(json.dumps(a))
get = lambda k: a[a.index(k) + 1]
body = json.dumps({{"model": get("--model"), "prompt": [101, 102, 103], "max_tokens": 4}}).encode()
req = urllib.request.Request(get("--base-url") + "/v1/completions", body, {{"Content-Type": "application/json"}})
print(json.loads(urllib.request.urlopen(req, timeout=30).read())["usage"])
out = pathlib.Path(get("--result-dir")) / get("--result-filename")
out.write_text(pathlib.Path({str(BENCH_JSON)!r}).read_text())
""")
    fake.chmod(0o755)
    return fake


def test_vllm_bench_as_the_load_generator_flows_through_the_trial(tmp_path: Path) -> None:
    fake = _fake_bench(tmp_path)
    launch = dataclasses.replace(_launch(tmp_path / "trial", {"max_num_seqs": 64}), load_generator="vllm-bench",
                                 bench_command=(str(fake),))
    r = run_vllm_trial(launch, WORKLOAD)
    assert r.status is TrialStatus.OK, (r.cause, r.evidence)
    expected = parse_bench_result(json.loads(BENCH_JSON.read_text()))
    for key, value in expected.items():
        assert getattr(r, key) == value, key
    assert r.output_throughput == pytest.approx(16677.447171150136)
    argv = json.loads((tmp_path / "bench_argv.json").read_text())
    port = next(e for e in r.evidence if e.startswith("argv=")).split("'--port', '")[1].split("'")[0]
    assert argv[argv.index("--base-url") + 1] == f"http://127.0.0.1:{port}"
    assert argv[argv.index("--num-prompts") + 1] == "24" and argv[argv.index("--max-concurrency") + 1] == "8"
    assert argv[argv.index("--num-warmups") + 1] == "1"
    assert "'prompt_tokens': 3" in (tmp_path / "trial" / "bench.log").read_text()  # it reached the server
    assert r.preemptions == 0 and r.kv_cache_tokens and r.memory is not None  # /metrics deltas and the log
    assert r.requests == []  # bench keeps no per-request records without --save-detailed


def test_a_stall_under_vllm_bench_is_seen_in_the_server_counters(tmp_path: Path) -> None:
    # This bench sends one long request and waits on it forever; the engine stalls after 40 tokens.
    fake = tmp_path / "waiting-bench"
    fake.write_text(f"""#!{sys.executable}
import json, sys, urllib.request
a = sys.argv
body = json.dumps({{"model": a[a.index("--model") + 1], "prompt": [101, 102], "max_tokens": 500}}).encode()
urllib.request.urlopen(urllib.request.Request(a[a.index("--base-url") + 1] + "/v1/completions", body,
                                              {{"Content-Type": "application/json"}}), timeout=600).read()
""")
    fake.chmod(0o755)
    launch = dataclasses.replace(_launch(tmp_path, {"max_num_seqs": 8}, "--sim-fail", "stall",
                                         "--sim-fail-after-tokens", "40"),
                                 load_generator="vllm-bench", bench_command=(str(fake),), stall_timeout_s=1.5)
    r = run_vllm_trial(launch, WORKLOAD)
    assert r.status is TrialStatus.TIMEOUT, (r.cause, r.evidence[:4])
    assert (r.cause or "").startswith("stalled: requests on the server but no token counted")
    assert r.output_throughput is None and any("vllm bench serve" in e for e in r.evidence)
    _assert_group_gone(r.evidence)


def test_a_workload_bench_cannot_send_is_refused_before_launch(tmp_path: Path) -> None:
    launch = dataclasses.replace(_launch(tmp_path, {"max_num_seqs": 8}), load_generator="vllm-bench")
    w = Workload.from_dict({"input_len": {"dist": "normal", "mean": 256, "std": 32}, "output_len": 16,
                            "num_requests": 4, "concurrency": 2})
    r = run_vllm_trial(launch, w)
    assert r.status is TrialStatus.INVALID_CONFIG and "workload.input_len" in (r.cause or "")
    r = run_vllm_trial(dataclasses.replace(launch, load_generator="locust"), WORKLOAD)
    assert r.status is TrialStatus.INVALID_CONFIG and "load_generator" in (r.cause or "")
    assert not (tmp_path / "server.log").exists()


def test_gpu_memory_that_does_not_come_back_quarantines_the_slot(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # nvidia-smi as the trial sees it: GPU 0 idle before launch, then holding 30 GiB for good
    # (a leaked EngineCore); GPU 1 belongs to another trial and is busy throughout.
    calls = tmp_path / "smi_calls"
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f"""#!/bin/sh
echo x >> {calls}
if [ "$(wc -l < {calls})" -le 1 ]; then echo "0, 512"; else echo "0, 30720"; fi
echo "1, 70000"
""")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    launch = dataclasses.replace(_launch(tmp_path, {"max_num_seqs": 8}), gpu_ids=("0",), gpu_free_timeout_s=1.0)
    r = run_vllm_trial(launch, WORKLOAD)
    assert r.status is TrialStatus.OK  # the trial itself measured fine
    assert r.quarantined_gpus == ["0"]
    assert any("GPU 0 still holds 30720 MiB (512 MiB before launch): slot quarantined" in e for e in r.evidence)


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
    help_text = (Path(__file__).parents[2] / "fixtures" / "real_h200" / "examples" / "help_all.txt").read_text()
    launch = _launch(tmp_path, {"max_num_seqs": 8}, "--swap-space", "4")
    launch = type(launch)(**{**launch.__dict__, "serve_help": help_text})
    r = run_vllm_trial(launch, WORKLOAD)
    assert r.status is TrialStatus.INVALID_CONFIG and "--swap-space" in (r.cause or "")
    assert not (tmp_path / "server.log").exists()  # nothing was launched


def _standin_help_reader(tmp_path: Path, delay_s: float = 0.0):
    """What the engine runs beside a host's first start: the stand-in's own `--help=all`, read
    through ``read_serve_help`` (a fresh cache, so it really runs)."""
    import time

    from servetune.engines.vllm.engine import read_serve_help

    def reader() -> str | None:
        time.sleep(delay_s)
        return read_serve_help(STANDIN, cache_dir=tmp_path / "help-cache")
    return reader


def test_a_flag_refused_by_the_help_read_beside_the_start_stops_the_server(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A host's first start reads `--help=all` beside the launch (both import vLLM): a flag the
    help refuses still ends as invalid_config, and the server is stopped, never measured."""
    monkeypatch.setenv("PYTHONPATH", PLATFORM)
    launch = dataclasses.replace(_launch(tmp_path, {"max_num_seqs": 8}, "--swap-space", "4"),
                                 help_reader=_standin_help_reader(tmp_path, delay_s=0.5))
    r = run_vllm_trial(launch, WORKLOAD)
    assert r.status is TrialStatus.INVALID_CONFIG, (r.cause, r.evidence)
    assert r.cause == "--swap-space: unknown to this vLLM (vllm serve: error: unrecognized arguments)"
    assert any("while the server started" in e for e in r.evidence)
    assert r.completed is None and not r.requests  # no load was sent
    assert (tmp_path / "server.log").exists()  # it was launched, and stopped
    _assert_group_gone(r.evidence)


def test_flags_the_help_read_beside_the_start_accepts_are_measured(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", PLATFORM)
    launch = dataclasses.replace(_launch(tmp_path, {"max_num_seqs": 8}), help_reader=_standin_help_reader(tmp_path))
    r = run_vllm_trial(launch, WORKLOAD)
    assert r.status is TrialStatus.OK, (r.cause, r.evidence)
    assert r.completed == 24


def test_the_engine_checks_before_launch_once_the_host_has_read_the_help(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a host's first start reads the help beside the launch; later starts (any actor) find
    it cached and check before launching."""
    from servetune.engines.vllm import engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fake = tmp_path / "fake-vllm"
    fake.write_text("#!/bin/sh\necho '  --max-num-seqs MAX_NUM_SEQS'\n")
    fake.chmod(0o755)
    command = (str(fake), "serve")
    first = engine._serve_help_source(command)
    assert set(first) == {"help_reader"}  # nothing read yet: read beside the launch
    assert first["help_reader"]() is not None
    engine.read_serve_help.cache_clear()  # a new Ray actor process: only the disk cache is left
    assert engine._serve_help_source(command) == {"serve_help": "  --max-num-seqs MAX_NUM_SEQS\n"}


def test_serve_help_is_read_once_and_cached_on_disk(tmp_path: Path) -> None:
    from servetune.engines.vllm.engine import read_serve_help

    fake = tmp_path / "fake-vllm"
    counter = tmp_path / "calls"
    fake.write_text(f"#!/bin/sh\necho x >> {counter}\necho '  --max-num-seqs MAX_NUM_SEQS'\n")
    fake.chmod(0o755)
    first = read_serve_help((str(fake), "serve"), cache_dir=tmp_path / "cache")
    read_serve_help.cache_clear()  # a new Ray actor process: only the disk cache is left
    second = read_serve_help((str(fake), "serve"), cache_dir=tmp_path / "cache")
    assert first == second and first is not None and "--max-num-seqs" in first
    assert counter.read_text().count("x") == 1


# -- early stopping inside a trial (servetune.engines.early_stop) ------------------------------------------

PREEMPTING = {"max_num_seqs": 64, "max_model_len": 2048, "num_gpu_blocks_override": 64}
LONG_WORKLOAD = Workload.from_dict({"input_len": 256, "output_len": 256, "num_requests": 96, "concurrency": 32})


def test_a_preempting_trial_stops_early_and_stays_infeasible(tmp_path: Path) -> None:
    from servetune.engines.early_stop import EarlyStop
    from servetune.search.propose import constraint_values
    from servetune.spec.schema import StudySpec

    launch = dataclasses.replace(_launch(tmp_path, PREEMPTING), early_stop=EarlyStop(max_preemptions=0))
    r = run_vllm_trial(launch, LONG_WORKLOAD)
    assert r.status is TrialStatus.OK, (r.cause, r.evidence)
    assert r.early_stopped is not None and r.early_stopped.startswith("preemptions:"), r.early_stopped
    assert r.preemptions is not None and r.preemptions > 0
    assert r.completed is not None and r.completed < 96  # fewer requests answered than the workload
    note = next(e for e in r.evidence if e.startswith("early stop after"))
    sent = int(note.split()[3])
    assert sent < 96, note
    spec = StudySpec.from_dict({"name": "es", "model": "servetune-test-850m", "gpu": {"type": "H200"},
                                "workload": {"input_len": 256, "output_len": 256, "num_requests": 96, "concurrency": 32},
                                "search_space": {"params": {"max_num_seqs": [32, 64]}},
                                "storage": {"optuna_url": "memory"}}, cwd=str(tmp_path))
    assert constraint_values(spec, r)["preemptions"] > 0  # told infeasible


def test_a_trial_certainly_below_the_best_stops_early_with_its_measured_throughput(tmp_path: Path) -> None:
    from servetune.engines.early_stop import EarlyStop

    flags = {"gpu_memory_utilization": 0.5, "max_num_seqs": 64}
    launch = dataclasses.replace(_launch(tmp_path, flags), early_stop=EarlyStop(max_preemptions=0,
                                                                                 best_throughput=1e9))
    r = run_vllm_trial(launch, LONG_WORKLOAD)
    assert r.status is TrialStatus.OK, (r.cause, r.evidence)
    assert r.early_stopped is not None and r.early_stopped.startswith("throughput:"), r.early_stopped
    assert r.failed == 0 and r.completed is not None and 24 <= r.completed < 96
    assert r.output_throughput is not None and r.output_throughput > 0


def test_without_a_decided_outcome_the_whole_workload_runs(tmp_path: Path) -> None:
    from servetune.engines.early_stop import EarlyStop

    flags = {"gpu_memory_utilization": 0.5, "max_num_seqs": 64}
    launch = dataclasses.replace(_launch(tmp_path, flags), early_stop=EarlyStop(max_preemptions=0, best_throughput=1.0))
    r = run_vllm_trial(launch, WORKLOAD)
    assert r.status is TrialStatus.OK and r.early_stopped is None and r.completed == 24


def test_the_throughput_verdict_counts_the_servers_tokens_when_chunks_merge() -> None:
    """A chunk is one token only while vLLM's API server keeps up; when it lags it merges a
    request's pending outputs (real 8B H200 windows: 0.75-1.0 chunks per token). The verdict takes
    the server's generation-token counter since the window began, interpolated between the
    watch's samples, when it says more than the chunks did."""
    import time as _time

    from servetune.engines.early_stop import EarlyStop
    from servetune.engines.vllm.engine import _decider, _ServerWatch
    from servetune.engines.vllm.loadgen import LoadProgress

    watch = _ServerWatch("http://127.0.0.1:1", None)
    now = _time.monotonic()
    # The counter every 0.5 s: 1,000 tokens of warm-up before the window, then 1,000 tokens/s.
    watch.generated = [(now - 10.0 + 0.5 * k, 1000.0 + 500.0 * k) for k in range(21)]
    assert watch.generated_since(now - 10.0) == pytest.approx(10_000.0)
    assert watch.generated_since(now - 4.25) == pytest.approx(4_250.0)  # between two samples
    assert watch.generated_since(now - 11.0) is None  # before the first sample: not known
    rule = EarlyStop(best_throughput=1_400.0)  # 1.5 x the rate must stay above it to go on
    decide = _decider(rule, watch, None)
    assert decide is not None
    # 10 s into the window, 7,500 chunks streamed (merged), 10,000 tokens counted by the server:
    # 1.5 x 750 = 1,125 < 1,400 would stop; 1.5 x 1,000 = 1,500 goes on.
    progress = LoadProgress(answered=40, total=100, elapsed_s=_time.monotonic() - (now - 10.0), streamed_chunks=7_500)
    assert decide(progress) is None
    assert rule.verdict(preemptions=None, output_tokens=7_500, elapsed_s=10.0, answered=40, total=100) is not None
    # With no server sample yet the chunks are all there is.
    watch.generated = []
    assert decide(progress) is not None


def test_a_leading_window_measures_its_repeats_on_the_same_server(tmp_path: Path) -> None:
    """budget.confirm_on same-start: the repeats run after the trial's window on the server it
    started (one start, one server.log), each with its own workload seed and evidence folder; a
    window below the best so far pays no extra window."""
    from servetune.engines import LeaderRepeats

    repeats = tuple(dataclasses.replace(WORKLOAD, seed=WORKLOAD.seed + k) for k in (1, 2))
    dirs = (str(tmp_path / "0000-repeat-1"), str(tmp_path / "0000-repeat-2"))
    flags = {"gpu_memory_utilization": 0.5, "max_num_seqs": 64}
    lead = dataclasses.replace(_launch(tmp_path / "0000", flags), leader_repeats=LeaderRepeats(repeats, dirs))
    r = run_vllm_trial(lead, WORKLOAD)
    assert r.status is TrialStatus.OK and len(r.repeats) == 2, (r.cause, r.evidence)
    assert all(x.status is TrialStatus.OK and x.completed == 24 and x.output_throughput for x in r.repeats)
    assert [x.kv_cache_tokens for x in r.repeats] == [r.kv_cache_tokens] * 2  # the same server's capacity
    assert all("own server start" in x.evidence[-1] and x.startup_s is None for x in r.repeats)
    # Not the start's: its phase timings and compile-cache verdict stay with the trial (a repeat row
    # must not price as a start, benchmarks/time_to_answer.py).
    assert "engine_init" in r.timings_s and all("engine_init" not in x.timings_s for x in r.repeats)
    assert all(x.compile_cache_hit is None for x in r.repeats)
    assert r.log_text.count("Application startup complete.") == 1
    for d in dirs:
        assert (Path(d) / "metrics_after.txt").exists() and not (Path(d) / "server.log").exists()
    behind = LeaderRepeats(repeats, (str(tmp_path / "b-1"), str(tmp_path / "b-2")), best_throughput=1e12)
    r2 = run_vllm_trial(dataclasses.replace(_launch(tmp_path / "0001", flags), leader_repeats=behind), WORKLOAD)
    assert r2.status is TrialStatus.OK and r2.repeats == [] and not (tmp_path / "b-1").exists()
