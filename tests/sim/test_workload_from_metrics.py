"""``servetune workload from-metrics`` end to end: the stand-in ``vllm serve`` under a known workload.

servetune's own load generator sends a known workload to ``python -m servetune.sim.server`` on
127.0.0.1; its ``/metrics`` is read before and after (saved as files, as a user would with curl),
and the command, run as a subprocess, must give back the lengths, the rate and the shared prefix
that were sent, to the resolution the 1-2-5 buckets allow. The URL reader's timeout and size cap
are tested against real local HTTP servers.
"""

from __future__ import annotations

import asyncio
import bisect
import http.server
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from servetune import cli
from servetune.cli import _workload
from servetune.engines.vllm.loadgen import run_workload
from servetune.errors import SpecError
from servetune.workload import Workload
from test_server import MODEL, PLATFORM, Server

#: What is sent: prompts spread over three 1-2-5 buckets, each of 4 groups sharing a 256-token
#: prefix (16 whole blocks of 16), log-normal outputs, Poisson at 25 requests/s.
SENT = {"input_len": {"dist": "uniform", "min": 300, "max": 1800},
        "output_len": {"dist": "lognormal", "mean": 120, "sigma": 0.5, "min": 20, "max": 600},
        "prefix_len": 256, "num_prefix_groups": 4, "num_requests": 150, "request_rate": 25, "seed": 11}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path, ["--gpu-memory-utilization", "0.5", "--max-num-seqs", "64", "--max-model-len", "4096"])
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(PLATFORM)}
    return subprocess.run([sys.executable, "-m", "servetune", "workload", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_recovers_the_sent_workload_from_two_saved_readings(server: Server, tmp_path: Path) -> None:
    sent = Workload.from_dict(SENT)
    before, after = tmp_path / "metrics_before.txt", tmp_path / "metrics_after.txt"
    before.write_text(server.get("/metrics"))
    records, _ = asyncio.run(run_workload(server.url, MODEL, sent, request_timeout_s=30))
    after.write_text(server.get("/metrics"))
    assert [r.error for r in records] == [None] * len(records)
    out = tmp_path / "recovered.yaml"
    done = _cli("from-metrics", str(before), str(after), "-o", str(out))  # the time: the files' mtimes
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    got = Workload.from_dict(yaml.safe_load(text))
    bounds = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)  # --max-model-len 4096's buckets, below 5000
    reqs = sent.requests()
    for pick, dist in ((lambda r: r.prompt_tokens, got.input_len), (lambda r: r.output_tokens, got.output_len)):
        values = [pick(r) for r in reqs]
        # The exact mean is in /metrics (the histogram's sum); the fitted distribution keeps it to 2%
        # (draws of 20,000, clipping and rounding).
        redrawn = Workload.from_dict({**yaml.safe_load(text), "num_requests": 20000}).requests()
        assert statistics.mean(pick(r) for r in redrawn) == pytest.approx(statistics.mean(values), rel=0.02)
        # The range is known only to the bucket: the recovered bounds share the sent extremes' buckets.
        assert bisect.bisect_left(bounds, dist.min) == bisect.bisect_left(bounds, min(values))
        assert bisect.bisect_left(bounds, dist.max) == bisect.bisect_left(bounds, max(values))
    # The rate: 150 finished over the seconds between the two readings, which hold the whole load
    # (arrivals over ~6 s at 25/s) plus the last requests' service and the reads: 25/s sent, the
    # realized arrivals' rate within 35% (a Poisson draw of 150), the window never shorter.
    arrivals = [r.arrival_s or 0.0 for r in reqs]
    realized = (len(reqs) - 1) / (max(arrivals) - min(arrivals))
    assert got.request_rate is not None and 0.65 * realized <= got.request_rate <= realized * 1.05
    # The shared prefix: 4 groups of 256 tokens; all but each group's first request hit the cache.
    assert got.prefix_len == pytest.approx(256 * (150 - 4) / 150, abs=16)  # a block of 16 tokens either way
    assert "exact mean" in text and "Buckets (tokens): 1,2,5,10,20,50,100,200,500,1000,2000" in text


def test_url_reading_and_its_one_line_errors(server: Server, tmp_path: Path) -> None:
    records, _ = asyncio.run(run_workload(server.url, MODEL, Workload.from_dict(
        {**SENT, "num_requests": 20, "prefix_len": 0, "request_rate": None, "concurrency": 8}), request_timeout_s=30))
    assert len(records) == 20
    one = _cli("from-metrics", server.url + "/metrics")
    assert one.returncode == 0, one.stderr
    got = Workload.from_dict(yaml.safe_load(one.stdout))
    assert got.concurrency == 32 and "Rate: not known" in one.stdout  # one reading: no rate, and it says so
    idle = _cli("from-metrics", server.url + "/metrics", "--wait", "0.3")  # nothing finishes in the window
    assert idle.returncode == 2 and idle.stderr.count("\n") == 1 and "no finished requests" in idle.stderr
    wrong = _cli("from-metrics", server.url + "/v1/models")
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: source: not vLLM /metrics text")
    assert "Traceback" not in wrong.stderr and wrong.stderr.count("\n") == 1


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""
    stall = False

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body) + (10 if self.stall else 0)))
        self.end_headers()
        self.wfile.write(self.body)
        self.wfile.flush()
        if self.stall:
            time.sleep(20)

    def log_message(self, *args: object) -> None:
        pass


def _serve(body: bytes, stall: bool) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = type("H", (_Handler,), {"body": body, "stall": stall})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True  # a stalled handler does not hold up server_close
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/metrics"


def test_url_reads_are_size_capped_and_time_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_workload, "MAX_BYTES", 100_000)
    monkeypatch.setattr(_workload, "URL_TIMEOUT_S", 0.5)
    big, url = _serve(b"x" * 300_000, stall=False)
    try:
        with pytest.raises(SpecError, match="sent over"):
            _workload.read_source(url, "source")
    finally:
        big.shutdown()
        big.server_close()
    slow, url = _serve(b"# HELP partial\n", stall=True)  # headers and a line, then nothing
    try:
        start = time.monotonic()
        with pytest.raises(SpecError, match="cannot read"):
            _workload.read_source(url, "source")
        assert time.monotonic() - start < 10  # gave up at its own 0.5 s, not after the server's 20 s stall
    finally:
        slow.shutdown()
        slow.server_close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SpecError, match="cannot read"):
        _workload.read_source(f"http://127.0.0.1:{port}/metrics", "source")


def test_one_live_reading_averages_over_the_server_process_life(capsys: pytest.CaptureFixture[str]) -> None:
    # The H200 b3 run's reading (260 requests of 512 + 512 tokens), served as if its process had
    # started 100 s before: one URL reading spans process_start_time_seconds to the reading.
    dump = (Path(__file__).parents[1] / "fixtures" / "real_h200" / "b3_preempt_blocks1024_s64" / "metrics_after.txt")
    text = re.sub(r"^process_start_time_seconds .*$", f"process_start_time_seconds {time.time() - 100:.3f}",
                  dump.read_text(), flags=re.M)
    srv, url = _serve(text.encode(), stall=False)
    try:
        assert cli.main(["workload", "from-metrics", url]) == 0
    finally:
        srv.shutdown()
        srv.server_close()
    out = capsys.readouterr().out
    got = Workload.from_dict(yaml.safe_load(out))
    assert got.request_rate == pytest.approx(260 / 100, rel=0.05)
    assert "lifetime average" in out and (got.input_len.mean, got.output_len.mean) == (512, 512)
