"""The local Ray a study starts listens on loopback only, and the socket reader would see it if not.

A real `servetune tune` (sim backend, logical GPUs, a tiny workload) runs in its own process group;
while its trials run, the listening TCP sockets of the driver's process tree and of the local Ray it
recorded (GCS server, raylet, dashboard and runtime-env agents, Ray's minimal dashboard head,
workers, trial actors, the driver's core worker) are read from /proc as ``ss -ltnp`` reads them,
and every one must be bound to 127.0.0.1 / ::1. Measured when this was written: 12 listening
sockets, 11 of them on ``::``, ``0.0.0.0`` or the host's address before the local Ray was bound to
loopback; 12, none beyond loopback, after.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml
from _study_procs import completed_trials
from _sockets import is_loopback, listening_sockets, process_tree

from servetune.cluster._ray_session import reap_leftovers, record_path, session_processes

REPO = Path(__file__).resolve().parents[2]
NAME = "loopback"


def _spec(tmp: Path) -> dict:
    return {
        "name": NAME, "model": "servetune-test-850m", "gpu": {"type": "H200", "count": 1},
        "workload": {"input_len": 128, "output_len": 32, "num_requests": 16, "concurrency": 4, "seed": 1},
        "objective": {"metric": "output_throughput"},
        "search_space": {"params": {"max_num_seqs": {"type": "categorical", "choices": [8, 16, 32, 64]},
                                    "gpu_memory_utilization": {"type": "float", "low": 0.3, "high": 0.9,
                                                               "step": 0.05}}},
        "budget": {"trials": 400, "parallel": 1}, "backend": "sim", "seed": 3,
        "output": {"runs_dir": str(tmp), "dataset_dir": str(tmp / "dataset")},
    }



def test_the_socket_reader_sees_an_all_interfaces_bind() -> None:
    """The check below can fail: a socket on 0.0.0.0 in this process is listed, and not as loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as exposed, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as local:
        exposed.bind(("0.0.0.0", 0))
        exposed.listen()
        local.bind(("127.0.0.1", 0))
        local.listen()
        found = {port: addr for _, _, addr, port in listening_sockets({os.getpid()})}
        assert found[exposed.getsockname()[1]] == "0.0.0.0" and not is_loopback("0.0.0.0")
        assert is_loopback(found[local.getsockname()[1]])
    assert not is_loopback("::") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")


def test_a_running_study_listens_on_loopback_only(tmp_path: Path) -> None:
    spec_path = tmp_path / "study.yaml"
    spec_path.write_text(yaml.safe_dump(_spec(tmp_path)))
    env = {"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin", "RAY_AUTH_MODE": "disabled",
           "SERVETUNE_POOL": "ray", "HOME": str(tmp_path), "MLFLOW_DISABLE_TELEMETRY": "true"}
    driver = subprocess.Popen([sys.executable, "-m", "servetune", "tune", str(spec_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    seen: dict[tuple[str, str, int], int] = {}  # (command, address, port) -> pid, over the whole run
    record: dict = {}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and driver.poll() is None:
            if not record and record_path(tmp_path, NAME).is_file():
                record = json.loads(record_path(tmp_path, NAME).read_text())
            pids = process_tree(driver.pid) | set(session_processes(record) if record else ())
            for pid, comm, addr, port in listening_sockets(pids):
                seen[(comm, addr, port)] = pid
            if record and completed_trials(tmp_path / "optuna.db") >= 1:
                break
            time.sleep(0.5)
        assert driver.poll() is None, "the study ended before its sockets were read"
        assert record and completed_trials(tmp_path / "optuna.db") >= 1, "the study finished no trial within 180 s"
        commands = {comm for comm, _, _ in seen}
        assert {"gcs_server", "raylet"} <= commands, f"Ray's own servers were not seen: {sorted(seen)}"
        # Ray's dashboard (its web UI, default port 8265) is off unless SERVETUNE_RAY_DASHBOARD asks for it.
        assert not [key for key in seen if key[2] == 8265], f"Ray's dashboard listens: {sorted(seen)}"
        exposed = sorted(key for key in seen if not is_loopback(key[1]))
        print(f"{len(seen)} listening sockets, {len(exposed)} beyond loopback")
        assert not exposed, f"listening beyond loopback (command, address, port): {exposed}"
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        reap_leftovers(tmp_path, NAME, grace_s=2.0)
