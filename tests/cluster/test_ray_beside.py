"""A `ray start` cluster on the machine and no RAY_ADDRESS: a study's pool starts its own local Ray
(127.0.0.1) and says which cluster it runs beside.

A bare ``ray.init()`` joins the cluster the last ``ray start`` recorded (``ray_current_cluster`` in Ray's
temp dir) and, asked for GPUs, refused with a traceback. The head here is a real ``ray start --head``
with its own ``RAY_TMPDIR`` (so no other test's Ray sees its record), stopped with every process it
started (``ray stop`` would stop every Ray of the machine).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from servetune.study._progress import TerminalProgress
from _kill import kill_all_started_by
from _ray_helpers import free_ports, start_ray_node

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")

_PROBE = """
import json, ray
from servetune.cluster.start import start_pool
pool = start_pool("vllm", num_gpus=1, num_cpus=1)
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "beside": pool.beside_cluster,
                  "local": pool.started_local_ray}))
ray.shutdown()
"""


def test_a_real_trials_pool_starts_its_own_ray_beside_a_ray_start_cluster_and_says_so() -> None:
    # Short: Ray's socket paths under it must stay within the 107 bytes a Unix socket path may have.
    tmp_path = Path(tempfile.mkdtemp(prefix="st-rb-", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": str(REPO / "platform")}
    env.pop("RAY_ADDRESS", None)
    port = free_ports(1)[0]
    flags = ("--node-manager-port", "--object-manager-port", "--metrics-export-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port")

    def command() -> list[str]:
        others = free_ports(len(flags), avoid=(port,))
        return [RAY, "start", "--head", "--port", str(port), "--num-cpus", "1", "--num-gpus", "0",
                "--include-dashboard=false", "--disable-usage-stats", "--block",
                *(x for pair in zip(flags, map(str, others)) for x in pair)]

    record = tmp_path / "ray" / "ray_current_cluster"
    log = tmp_path / "head.log"
    head: subprocess.Popen[bytes] | None = None
    try:
        # `ray start` prints its banner before it writes the record (ray/scripts/scripts.py: "Ray runtime started."
        # at lines 1083 and 1249, write_ray_address at 1259): wait for both, or the read below races it.
        head = start_ray_node(command, env, log, lambda: "Ray runtime started" in log.read_text(errors="replace")
                              and record.exists(), timeout_s=60)
        recorded = record.read_text().strip()
        proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    finally:
        if head is not None:
            kill_all_started_by(head.pid)  # the head and every process it started
            head.wait(timeout=30)
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["local"] is True and got["gcs"].startswith("127.0.0.1:") and got["beside"] == recorded, (got, recorded)
    assert recorded.endswith(f":{port}")

    out = io.StringIO()
    TerminalProgress(out, total=1).ray_beside(recorded)
    assert f"beside the Ray cluster that `ray start` recorded on this machine ({recorded})" in out.getvalue()
    assert f"RAY_ADDRESS={recorded}" in out.getvalue()
