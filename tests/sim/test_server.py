"""servetune.sim.server as a real subprocess: the path a launcher takes with a real ``vllm serve``.

Each server runs as ``python -m servetune.sim.server`` in its own session on a free port, with a
high ``--sim-speedup`` and ``SERVETUNE_SIM_STARTUP_S=0.2`` so it is healthy in well under a second
of simulated startup; it is talked to over HTTP only, and its stdout is the log a launcher parses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from servetune.planner.gpus import get_gpu
from servetune.engines.vllm.loadgen import run_workload
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.engines.vllm.metrics import counter, gauge, labels_of, parse_prometheus
from servetune.planner.modelinfo import load_model
from servetune.engines.vllm.logs import LOG_LINE_RE, parse_log
from servetune.workload import Workload

PLATFORM = Path(__file__).resolve().parents[2] / "platform"
MODEL = "servetune-test-850m"
SPEEDUP = "50"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One stand-in server process: its argv, port, log file, and small HTTP helpers."""

    def __init__(self, tmp: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"server-{self.port}.log"
        full_env = {**os.environ, "PYTHONPATH": str(PLATFORM), "SERVETUNE_SIM_STARTUP_S": "0.2", **(env or {})}
        argv = [sys.executable, "-m", "servetune.sim.server", MODEL, "--host", "127.0.0.1",
                "--port", str(self.port), "--sim-speedup", SPEEDUP, *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                         start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.log[-3000:]}"
            if self.health() == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"not healthy after {timeout} s:\n{self.log[-3000:]}")

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            return None  # not listening

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return resp.read().decode()

    def post(self, body: dict[str, Any], timeout: float = 20.0) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def metrics(self) -> dict:
        return parse_prometheus(self.get("/metrics"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    """``start(*args, env=None, healthy=True)`` -> a running Server; every one is killed at teardown."""
    servers: list[Server] = []

    def _start(*args: str, env: dict[str, str] | None = None, healthy: bool = True) -> Server:
        server = Server(tmp_path, list(args), env)
        servers.append(server)
        if healthy:
            server.wait_healthy()
        return server

    yield _start
    for server in servers:
        server.stop()


def _sse(payload: bytes) -> list[Any]:
    events = []
    for block in payload.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _plan(flags: dict):
    model, gpu = load_model(MODEL), get_gpu("H200")
    return plan_memory(model, gpu, resolve_engine_config(flags, model, gpu))


def test_serves_health_models_and_exact_completions(start) -> None:
    s = start("--gpu-memory-utilization", "0.5", "--max-num-seqs", "16", "--max-model-len", "2048",
              "--served-model-name", "tiny")
    assert s.health() == 200
    models = json.loads(s.get("/v1/models"))
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 2048
    assert json.loads(s.get("/version"))["version"] == "0.26.0"

    status, body = s.post({"model": "tiny", "prompt": list(range(100, 137)), "max_tokens": 9})
    out = json.loads(body)
    assert status == 200 and out["usage"] == {"prompt_tokens": 37, "total_tokens": 46, "completion_tokens": 9}
    assert out["choices"][0]["finish_reason"] == "length" and len(out["choices"][0]["text"].split()) == 9

    # A batch of prompts: one choice each, token lists counted exactly, text ~4 characters per token.
    status, body = s.post({"prompt": [[1] * 20, "x" * 40], "max_tokens": 3})
    out = json.loads(body)
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"] == {"prompt_tokens": 30, "total_tokens": 36, "completion_tokens": 6}

    status, body = s.post({"prompt": list(range(64)), "max_tokens": 12, "stream": True, "ignore_eos": True,
                           "stream_options": {"include_usage": True}})
    events = _sse(body)
    assert status == 200 and events[-1] == "[DONE]"
    token_chunks = [e for e in events[:-1] if e["choices"]]
    assert len(token_chunks) == 12 and all(e["object"] == "text_completion" for e in token_chunks)
    assert [e["choices"][0]["finish_reason"] for e in token_chunks] == [None] * 11 + ["length"]
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 12
    assert events[-2]["usage"]["prompt_tokens"] == 64

    status, body = s.post({"prompt": [5] * 2000, "max_tokens": 100})
    assert status == 400
    assert json.loads(body)["error"]["message"].startswith("This model's maximum context length is 2048 tokens.")
    status, body = s.post({"prompt": [5] * 2048, "max_tokens": 1})
    assert status == 400 and "exceeds this limit even without any output tokens" in json.loads(body)["error"]["message"]
    status, _ = s.post({"model": "other", "prompt": [1, 2], "max_tokens": 1})
    assert status == 404
    status, body = s.post({"prompt": [1, 2, 3], "max_tokens": 4, "stream": True})  # no usage unless asked
    assert not any(e["usage"] for e in _sse(body)[:-1])


def test_metrics_and_log_lines_carry_the_plan(start) -> None:
    flags = {"gpu_memory_utilization": 0.5, "max_num_seqs": 32}
    s = start("--gpu-memory-utilization", "0.5", "--max-num-seqs", "32")
    plan = _plan(flags)
    before = s.metrics()
    for _ in range(3):
        assert s.post({"prompt": list(range(50)), "max_tokens": 7})[0] == 200
    after = s.metrics()
    assert counter(after, "vllm:generation_tokens") - counter(before, "vllm:generation_tokens") == 21
    assert counter(after, "vllm:prompt_tokens") - counter(before, "vllm:prompt_tokens") == 150
    assert counter(after, "vllm:request_success", {"finished_reason": "length"}) == 3
    assert gauge(after, "vllm:num_requests_running") == 0 and gauge(after, "vllm:kv_cache_usage_perc") == 0
    assert counter(after, "vllm:time_to_first_token_seconds_count") == 3
    assert counter(after, "vllm:inter_token_latency_seconds_count") == 18
    ttft_buckets = [lab["le"] for lab, _ in after["vllm:time_to_first_token_seconds_bucket"]]
    assert ttft_buckets[:3] == ["0.001", "0.005", "0.01"] and ttft_buckets[-1] == "+Inf"
    e2e_buckets = [lab["le"] for lab, _ in after["vllm:e2e_request_latency_seconds_bucket"]]
    assert e2e_buckets[0] == "0.3" and e2e_buckets[-2] == "7680.0"
    assert all(lab == {"engine": "0", "model_name": MODEL} for lab, _ in after["vllm:num_preemptions_total"])
    info = labels_of(after, "vllm:cache_config_info")
    assert info["num_gpu_blocks"] == str(plan.num_gpu_blocks) == "138533"
    assert info["kv_cache_size_tokens"] == str(plan.kv_cache_tokens)
    assert (info["block_size"], info["gpu_memory_utilization"], info["num_gpu_blocks_override"],
            info["cache_dtype"], info["enable_prefix_caching"]) == ("16", "0.5", "None", "auto", "True")

    log = s.log
    assert log.count("GPU KV cache size: ") == 1
    assert parse_log(log).kv_cache_tokens == plan.kv_cache_tokens  # the product's own parser reads it
    parsed = [LOG_LINE_RE.match(line) for line in log.splitlines()]
    assert sum(1 for m in parsed if m) > 30
    assert any(m and m.group("proc") == "EngineCore" and m.group("src") == "core.py:116" for m in parsed)
    assert "(APIServer pid=%d) INFO:     Application startup complete." % s.proc.pid in log
    assert f'"POST /v1/completions HTTP/1.1" 200 OK' in log


def test_logged_hit_rate_is_the_most_recent_thousand_lookups(start) -> None:
    # vLLM's "Prefix cache hit rate" covers its most recent 1,000 lookups (PrefixCachingMetrics), not the
    # server's lifetime: 100 fresh 64-token prompts, then 1,000 sends of one prompt, whose 3 full blocks
    # (48 tokens) hit from its second send on. The window: 999 x 48 / (1,000 x 64) = 74.9%; since the
    # start it would be 999 x 48 / (1,100 x 64) = 68.1%.
    s = start("--gpu-memory-utilization", "0.5", "--max-num-seqs", "64")
    prompts = [[1000 + 64 * i + j for j in range(64)] for i in range(100)] + [list(range(5, 69))] * 1000
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert set(pool.map(lambda p: s.post({"prompt": p, "max_tokens": 1})[0], prompts[:100])) == {200}
        assert set(pool.map(lambda p: s.post({"prompt": p, "max_tokens": 1})[0], prompts[100:])) == {200}
    m = s.metrics()
    assert counter(m, "vllm:prefix_cache_queries") == 1100 * 64 and counter(m, "vllm:prefix_cache_hits") == 999 * 48
    time.sleep(3 * 10.0 / float(SPEEDUP))  # the line after the last step (every 10 virtual seconds), then none
    rates = re.findall(r"Prefix cache hit rate: ([0-9.]+)%", s.log)
    assert rates and float(rates[-1]) == 74.9


def test_loadgen_workload_with_preemption(start) -> None:
    # 64 blocks of 16 tokens for 8 concurrent 160+96-token requests: the KV cache runs out, and the
    # scheduler preempts, as a3/b3 did on the H200 with --num-gpu-blocks-override.
    s = start("--gpu-memory-utilization", "0.5", "--max-num-seqs", "8", "--max-model-len", "1024",
              "--num-gpu-blocks-override", "64")
    workload = Workload.from_dict({"input_len": 160, "output_len": 96, "num_requests": 16, "concurrency": 8,
                                   "warmup_requests": 1, "seed": 3})
    records, duration = asyncio.run(run_workload(s.url, MODEL, workload, request_timeout_s=30))
    assert duration > 0 and len(records) == 16
    assert [r.error for r in records] == [None] * 16
    assert all(r.prompt_tokens == 160 and r.output_tokens == 96 and len(r.itl_s) == 95 for r in records)
    assert all(r.first_token_s is not None and r.arrival_s <= r.first_token_s <= r.finish_s for r in records)
    m = s.metrics()
    assert counter(m, "vllm:num_preemptions") > 0
    assert counter(m, "vllm:generation_tokens") == 17 * 96
    assert labels_of(m, "vllm:cache_config_info")["num_gpu_blocks_override"] == "64"
    assert "Overriding num_gpu_blocks=138533 with num_gpu_blocks_override=64" in s.log


def test_config_file_underscores_and_cli_precedence(start, tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-num-seqs: 8\ngpu-memory-utilization: 0.4\nenable-prefix-caching: false\n")
    s = start("--config", str(cfg), "--gpu_memory_utilization", "0.5", "--sim-fail", "crash", healthy=False)
    assert s.proc.wait(timeout=20) == 1
    args = [line for line in s.log.splitlines() if "non-default args" in line][0]
    assert "'gpu_memory_utilization': 0.5" in args and "'max_num_seqs': 8" in args
    assert "'enable_prefix_caching': False" in args
    assert "enable_prefix_caching=False" in s.log  # the engine config line shows the resolved flag


def test_unknown_argument_is_argparse_exit_2(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(PLATFORM)}
    out = subprocess.run([sys.executable, "-m", "servetune.sim.server", MODEL, "--swap-space", "4"],
                         capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 2
    assert "vllm serve: error: unrecognized arguments: --swap-space 4" in out.stderr


def test_disable_custom_all_reduce_is_a_vllm_serve_option_of_the_stand_in() -> None:
    """As copied from a user's ``vllm serve`` command: both spellings parse, and the engine sees the flag."""
    from servetune.sim.server import given_flags, parse_args
    on = given_flags(parse_args([MODEL, "--tensor-parallel-size", "2", "--disable-custom-all-reduce"]))
    assert on == {"tensor_parallel_size": 2, "disable_custom_all_reduce": True}
    off = given_flags(parse_args([MODEL, "--no-disable-custom-all-reduce"]))
    assert off == {"disable_custom_all_reduce": False}
    assert "disable_custom_all_reduce" not in given_flags(parse_args([MODEL]))


@pytest.mark.parametrize("args, root", [
    (["--sim-fail", "startup_oom"], "ValueError: Free memory on device ("),
    (["--sim-fail", "kv_too_small"], "ValueError: To serve at least one request with the model's max seq len"),
    (["--sim-fail", "cudagraph_oom"], "torch.OutOfMemoryError: CUDA out of memory."),
    (["--sim-fail", "crash"], "ModuleNotFoundError: No module named 'flashinfer'"),
    (["--gpu-memory-utilization", "0.012", "--enforce-eager"], "ValueError: No available memory for the cache blocks."),
])
def test_startup_failures_print_vllm_text_and_exit_1(start, args: list[str], root: str) -> None:
    s = start(*args, healthy=False)
    assert s.proc.wait(timeout=20) == 1
    log = s.log
    assert "EngineCore failed to start." in log and root in log
    assert log.rstrip().endswith("RuntimeError: Engine core initialization failed. See root cause above. "
                                 "Failed core proc(s): {}")
    assert "Application startup complete." not in log


def test_hang_never_listens_and_sigterm_stops_it(start) -> None:
    """The hang reaches model loading and stays there: a second after its loading line (which a loaded
    box may take seconds to print, Python's start and imports included) it still serves nothing."""
    s = start("--sim-fail", "hang", healthy=False)
    deadline = time.monotonic() + 30.0
    while "Loading model from scratch..." not in s.log and time.monotonic() < deadline and s.proc.poll() is None:
        time.sleep(0.05)
    assert "Loading model from scratch..." in s.log, s.log[-2000:]
    time.sleep(1.0)
    assert s.proc.poll() is None and s.health() is None
    assert "Starting vLLM server" not in s.log
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=5) == 0


def test_runtime_crash_kills_streams_then_health_503_then_exit(start) -> None:
    s = start("--sim-fail", "runtime_crash", "--sim-fail-after-tokens", "20",
              env={"SERVETUNE_SIM_DEATH_LINGER_S": "3"})
    req = urllib.request.Request(s.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": [1] * 32, "max_tokens": 200, "stream": True}).encode())
    with pytest.raises((http.client.IncompleteRead, ConnectionError, urllib.error.URLError)):
        with urllib.request.urlopen(req, timeout=20) as resp:
            resp.read()
    assert s.health() == 503
    assert s.proc.wait(timeout=10) == 1
    assert "EngineCore encountered a fatal error." in s.log and "EngineDeadError" in s.log


def test_stall_keeps_health_but_stops_tokens(start) -> None:
    s = start("--sim-fail", "stall", "--sim-fail-after-tokens", "10")
    with pytest.raises((TimeoutError, OSError)):
        s.post({"prompt": [1] * 8, "max_tokens": 500}, timeout=1.5)
    m = s.metrics()
    assert s.health() == 200 and s.proc.poll() is None
    assert 10 <= counter(m, "vllm:generation_tokens") < 500
    assert gauge(m, "vllm:num_requests_running") == 1


def test_sigterm_graceful_and_nothing_left_behind(start) -> None:
    s = start()
    assert s.post({"prompt": [3] * 10, "max_tokens": 2})[0] == 200
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=3) == 0
    assert "[shutdown] EngineCore: trigger received signal=SIGTERM" in s.log
    assert s.log.rstrip().endswith("INFO:     Application shutdown complete.")
    with pytest.raises(ProcessLookupError):  # the session has no process left in it
        os.killpg(s.proc.pid, 0)
    with pytest.raises(ConnectionRefusedError):  # and nothing listens on its port any more
        socket.create_connection(("127.0.0.1", s.port), timeout=2).close()


def test_ignore_sigterm_needs_sigkill(start) -> None:
    s = start("--sim-ignore-sigterm")
    s.proc.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        s.proc.wait(timeout=1.0)
    assert s.health() == 200
    os.killpg(s.proc.pid, signal.SIGKILL)
    assert s.proc.wait(timeout=5) == -signal.SIGKILL
