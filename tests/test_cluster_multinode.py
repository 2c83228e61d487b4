"""A real multi-node Ray cluster on this machine: GPU-type placement, TP=2 on one node, no double booking.

Three nodes started with ``ray start`` (own temp dir, own ports, token auth off): a head with no GPUs,
an "H200" node with 2 logical GPUs and an "A100-40G" node with 1. The study driver is
``jobs/tune.py`` run as a plain process with ``RAY_ADDRESS`` (``ray job submit`` needs the job
server of ``ray[default]``, which the venv lacks: no aiohttp_cors / opencensus / prometheus_client).
Every ``ray start`` runs with ``--block`` in its own session, so the teardown signals exactly this
cluster's process groups, never another Ray on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow.tracking import MlflowClient

from servetune import dataset

REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).parent / "ray")
_ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
        "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONPATH": str(REPO / "platform")}


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together, so the OS cannot hand one out twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _alive_nodes(address: str) -> list[dict[str, Any]]:
    code = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
            "print(json.dumps([n['Resources'] for n in ray.nodes() if n['Alive']]))" % address)
    out = subprocess.run([sys.executable, "-c", code], env=_ENV, capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else []


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """Head (0 GPUs) + H200 node (2 GPUs) + A100-40G node (1 GPU); yields the GCS address."""
    temp = Path(tempfile.mkdtemp(prefix="st-mn-", dir="/tmp"))  # short: Ray's socket paths have a limit
    free = iter(_free_ports(1 + 3 * 6))
    port = next(free)
    address = f"127.0.0.1:{port}"

    def common() -> list[str]:
        # Several nodes on one host: every port a node binds must be its own (the defaults collide,
        # e.g. the dashboard agent's 52365).
        ports = [(flag, str(next(free))) for flag in (
            "--node-manager-port", "--object-manager-port", "--metrics-export-port",
            "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")]
        return ["--num-cpus", "1", "--disable-usage-stats", "--block", *(x for pair in ports for x in pair)]

    nodes = [
        [RAY, "start", "--head", "--port", str(port), "--num-gpus", "0", "--temp-dir", str(temp),
         "--include-dashboard=false", *common()],
        [RAY, "start", "--address", address, "--num-gpus", "2", "--resources", '{"accelerator_type:H200": 1}',
         *common()],
        [RAY, "start", "--address", address, "--num-gpus", "1", "--resources", '{"accelerator_type:A100-40G": 1}',
         *common()],
    ]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, cmd in enumerate(nodes):
            with open(temp / f"node{i}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, env=_ENV, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
            deadline = time.monotonic() + 60  # one node at a time: 2 cores, and no start-up races
            while len(_alive_nodes(address)) < i + 1:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    logs = "\n".join((temp / f"node{j}.log").read_text()[-1500:] for j in range(len(procs)))
                    raise RuntimeError(f"the Ray cluster did not come up:\n{logs}")
                time.sleep(1)
        yield address
    finally:
        for proc in reversed(procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in reversed(procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            try:  # children that outlived their `ray start` (same process group)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)


def _spec(tmp: Path, mlflow_uri: str, name: str) -> Path:
    data = {
        "name": name, "model": "servetune-test-850m",
        "gpu": {"type": "H200", "count": 2},
        "workload": {"input_len": 256, "output_len": 64, "num_requests": 48, "concurrency": 16, "seed": 1},
        "search_space": {"params": {"tensor_parallel_size": [1, 2], "max_num_seqs": [16, 32, 64]}},
        "budget": {"trials": 6, "parallel": 2}, "backend": "sim", "seed": 5, "prescreen": False,
        "tracking": {"mlflow_uri": mlflow_uri, "experiment": f"exp-{name}"},
        "storage": {"optuna_url": f"sqlite:///{tmp}/optuna.db"},
        "output": {"runs_dir": str(tmp / "runs"), "dataset_dir": str(tmp / "dataset")},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _evidence(items: list[str]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in items if e.startswith("ray_"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_study_on_a_multinode_cluster_runs_only_on_its_gpu_type(
        ray_cluster: str, mlflow_server: str, tmp_path: Path) -> None:
    spec = _spec(tmp_path, mlflow_server, "multinode")
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "tune.py"), str(spec)], cwd=tmp_path,
                          env={**_ENV, "RAY_ADDRESS": ray_cluster}, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "joined the Ray cluster" in proc.stdout and "3 nodes, 3 GPUs" in proc.stdout
    assert "trials 6/6" in proc.stdout

    # The dataset holds every trial, on the H200.
    df = dataset.read_trials(tmp_path / "dataset", study="multinode")
    assert len(df) == 6 and set(df["gpu_type"]) == {"H200"} and set(df["status"]) == {"ok"}

    # MLflow: each trial's result.json carries where it ran and which GPUs it held, and when.
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("exp-multinode")
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("servetune.role") == "trial"]
    assert len(runs) == 6
    windows: list[tuple[float, float, str, int]] = []
    tp_seen = set()
    for run in runs:
        path = client.download_artifacts(run.info.run_id, "result.json", str(tmp_path))
        ev = _evidence(json.loads(Path(path).read_text())["evidence"])
        assert ev["ray_accelerator_type"] == "H200", ev
        gpu_ids = json.loads(ev["ray_gpu_ids"])
        tp = int(run.data.params["tensor_parallel_size"])
        tp_seen.add(tp)
        assert len(gpu_ids) == tp  # TP=2: two GPUs, both on the one H200 node
        start, end = (float(x) for x in ev["ray_window"].split("-"))
        windows.append((start, end, ev["ray_node_id"], tp))
    assert tp_seen == {1, 2}
    assert len({w[2] for w in windows}) == 1  # one node: the H200 one
    # No GPU double-booked: at any trial's start, the GPUs held by the trials running then <= 2.
    for start, _, _, _ in windows:
        held = sum(tp for s, e, _, tp in windows if s <= start < e)
        assert held <= 2, windows


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_trial_larger_than_any_node_of_its_type_is_refused_not_queued(ray_cluster: str) -> None:
    code = """
import json
from servetune.cluster import TrialPool
from servetune.engines import TrialTask
from servetune.workload import Workload
task = TrialTask(model="servetune-test-850m", gpu="A100-40GB", flags={"max_num_seqs": 16},
                 workload=Workload.from_dict({"input_len": 128, "output_len": 16, "num_requests": 8, "concurrency": 4}))
pool = TrialPool.start(num_gpus=1, gpu_type="A100-40GB")
out = {"total": pool.total_gpus, "max_node": pool.max_node_gpus}
pool.submit(0, task, "sim", gpus=2)   # the A100-40G node has one GPU: can never be placed
pool.submit(1, task, "sim", gpus=1)
done = {}
while len(done) < 2:
    for n, r in pool.wait(timeout_s=30):
        done[n] = {"status": r.status.value, "cause": r.cause, "evidence": r.evidence}
out["results"] = done
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], env={**_ENV, "RAY_ADDRESS": ray_cluster},
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["total"] == 1 and out["max_node"] == 1
    refused, ran = out["results"]["0"], out["results"]["1"]
    assert refused["status"] == "invalid_config" and "at most 1" in refused["cause"]
    assert ran["status"] == "ok" and _evidence(ran["evidence"])["ray_accelerator_type"] == "A100-40G"
