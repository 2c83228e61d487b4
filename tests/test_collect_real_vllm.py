"""benchmarks/real_vllm/collect.py, the GPU host's evidence collector, run here against the stand-in.

The collector only ever runs on the GPU host, where nothing checks it before device time is spent.
Here ``vllm`` on PATH is a two-line wrapper around servetune's own `vllm serve` stand-in
(``python -m servetune.sim.server``), so the collector's whole path runs: launch in its own process
group, wait for /health, a window with /metrics before and after, repeats, several windows on one
start, stop, pack. What lands on disk is what the fixtures under tests/fixtures/real_h200 hold.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COLLECT = ROOT / "benchmarks" / "real_vllm" / "collect.py"


def _env(bin_dir: Path, out: Path) -> dict[str, str]:
    """The collector's environment: ``bin_dir`` first on PATH (its ``vllm``), results under ``out``."""
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(out),
            "SERVETUNE_REAL_MODEL": "servetune-test-850m",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), os.environ.get("PYTHONPATH", "")])}


def test_collect_keeps_every_window_and_repeat_and_stops_the_server(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "vllm"
    # `vllm serve MODEL ...` -> the stand-in with the same arguments, 20x faster than real time.
    wrapper.write_text(f'#!/bin/sh\nshift\nexec {sys.executable} -m servetune.sim.server "$@" --sim-speedup 20\n')
    wrapper.chmod(0o755)
    wl = {"input_len": 128, "output_len": 16, "num_requests": 16, "concurrency": 8, "seed": 0}
    plan = {"budget_s": 120, "runs": [
        {"name": "one", "flags": {"max_model_len": 2048, "gpu_memory_utilization": 0.5}, "repeats": 2, "workload": wl},
        {"name": "win", "model": "servetune-test-850m", "flags": {"max_model_len": 2048}, "windows": [
            {"name": "w1", "workload": wl, "est_s": 5},
            {"name": "w2", "workload": {**wl, "num_requests": 8}, "est_s": 5}]}]}
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    out = tmp_path / "out"
    env = _env(bin_dir, out)
    proc = subprocess.run([sys.executable, str(COLLECT), str(plan_path)], env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]

    one = json.loads((out / "real" / "one" / "summary.json").read_text())
    assert one["healthy"] and one["completed"] == 16 and len(one["ours"]) == 2
    for name in ("metrics_before.txt", "metrics_after.txt", "metrics_after_1.txt", "requests_1.json", "server.log"):
        assert (out / "real" / "one" / name).stat().st_size > 0, name
    win = json.loads((out / "real" / "win" / "summary.json").read_text())
    assert {k: v["completed"] for k, v in win["windows"].items()} == {"w1": 16, "w2": 8}
    # Each window after the first is seeded apart, so it never re-sends an earlier window's prompts.
    w2 = json.loads((out / "real" / "win" / "w2" / "summary.json").read_text())
    assert w2["workload"]["seed"] == 1000
    # The load generator's own CPU over the window (this process): spent, and at most the window's
    # wall time times the threads that could run it (the machine's cores).
    assert 0 < w2["client_cpu_s"] <= w2["window_wall_s"] * (os.cpu_count() or 1)
    assert w2["client_busy"] == pytest.approx(w2["client_cpu_s"] / w2["duration_s"])
    assert win["tokenizer_vocab"] is None  # a shipped model name has no tokenizer folder to read
    # The server was stopped: nothing answers on the collector's port any more.
    assert "gpu_used_mib_after_stop" in win and win["stop_s"] < 25
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", 8011)) != 0
    with tarfile.open(out / "real.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"real/one/summary.json", "real/win/w1/summary.json", "real/win/w2/requests.json"} <= names


def test_collect_refuses_a_port_that_already_serves_and_launches_nothing(tmp_path: Path) -> None:
    """A server left on the collector's port (8011) would be measured in place of the one launched, whose
    own start then fails to bind: the run is refused with that reason, and no server is started."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launched = tmp_path / "launched"
    (bin_dir / "vllm").write_text(f"#!/bin/sh\ntouch {launched}\n")
    (bin_dir / "vllm").chmod(0o755)
    plan = {"budget_s": 300, "runs": [
        {"name": "one", "flags": {"max_model_len": 2048}, "workload": {"input_len": 8, "output_len": 4,
                                                                       "num_requests": 2, "concurrency": 1}},
        {"name": "win", "flags": {}, "windows": [{"name": "w1", "workload": {"input_len": 8, "output_len": 4,
                                                                             "num_requests": 2, "concurrency": 1}}]}]}
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    out = tmp_path / "out"
    env = _env(bin_dir, out)
    server = http.server.HTTPServer(("127.0.0.1", 8011), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        subprocess.run([sys.executable, str(COLLECT), str(plan_path)], env=env, capture_output=True, text=True,
                       timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    for name in ("one", "win"):
        summary = json.loads((out / "real" / name / "summary.json").read_text())
        assert summary["healthy"] is False and "already answers /health" in summary["error"], summary
    assert not launched.exists()
