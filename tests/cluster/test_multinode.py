"""A real multi-node Ray cluster on this machine: GPU-type placement, TP=2 on one node, no double booking.

Three nodes started with ``ray start`` (own temp dir, own ports, token auth off): a head with no GPUs
and the dashboard (whose job server takes ``ray job submit``), an "H200" node with 2 logical GPUs
and an "A100-40G" node with 1. A study is submitted the production way, ``ray job submit
--working-dir <repo> --runtime-env-json '{"py_modules": ["platform/servetune"], ...}' -- python
jobs/tune.py STUDY.yaml``, against a PostgreSQL-backed Optuna storage and ``mlflow server``; the
plain-driver path (``RAY_ADDRESS=... python jobs/tune.py``) is tested too. The nodes run without
``platform/`` on their PYTHONPATH, so a job's workers import servetune from what the job shipped.
Every ``ray start`` runs with ``--block`` in its own session, so the teardown signals exactly this
cluster's process groups, never another Ray on the machine.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
import optuna
from _postgres import PostgresServer
from _ray_helpers import alive_nodes, free_ports, start_ray_node
from mlflow.tracking import MlflowClient

from servetune.records import dataset

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
_ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
        "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONPATH": str(REPO / "platform")}
# The nodes: no servetune on their path (a job must ship it), and this venv's `python` first on
# PATH, as in a cluster image, so a job's `python jobs/tune.py` entrypoint is the venv's Python.
# Ray 2.60 drains a SIGTERMed node for up to 30 s before stopping; a test cluster has nothing to
# drain at teardown, so stop at once (3 s instead of 30 s per node).
_NODE_ENV = {**{k: v for k, v in _ENV.items() if k != "PYTHONPATH"},
             "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
             "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}



@dataclass(frozen=True)
class Cluster:
    address: str  # the GCS address (RAY_ADDRESS for a driver)
    dashboard: str  # the dashboard / job server URL (``ray job submit --address``)
    temp: Path  # the cluster's --temp-dir (its session logs)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Head (0 GPUs, dashboard + job server) + H200 node (2 GPUs) + A100-40G node (1 GPU)."""
    temp = Path(tempfile.mkdtemp(prefix="st-mn-", dir="/tmp"))  # short: Ray's socket paths have a limit
    port, dashboard_port, client_port = free_ports(3)
    address = f"127.0.0.1:{port}"

    def common() -> list[str]:
        # Several nodes on one host: every port a node binds must be its own (the defaults collide,
        # e.g. the dashboard agent's 52365).
        flags = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
                 "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")
        picked = free_ports(len(flags), avoid=(port, dashboard_port, client_port))
        ports = [(flag, str(p)) for flag, p in zip(flags, picked)]
        return ["--num-cpus", "1", "--disable-usage-stats", "--block", *(x for pair in ports for x in pair)]

    nodes: list[Callable[[], list[str]]] = [  # each call: fresh ports for a node's own services
        lambda: [RAY, "start", "--head", "--port", str(port), "--num-gpus", "0", "--temp-dir", str(temp),
         "--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
         "--ray-client-server-port", str(client_port), *common()],
        lambda: [RAY, "start", "--address", address, "--num-gpus", "2", "--resources", '{"accelerator_type:H200": 1}',
         *common()],
        lambda: [RAY, "start", "--address", address, "--num-gpus", "1", "--resources", '{"accelerator_type:A100-40G": 1}',
         *common()],
    ]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, command in enumerate(nodes):  # one node at a time: 2 cores, and no start-up races
            procs.append(start_ray_node(
                command, _NODE_ENV, temp / f"node{i}.log", timeout_s=60,
                up=lambda i=i: len(alive_nodes(address, _ENV, want=i + 1, wait_s=5)) >= i + 1))
        yield Cluster(address, f"http://127.0.0.1:{dashboard_port}", temp)
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


@pytest.fixture(scope="module")
def ray_cluster(cluster: Cluster) -> str:
    """The cluster's GCS address."""
    return cluster.address


def _spec(tmp: Path, mlflow_uri: str, name: str, optuna_url: str | None = None) -> Path:
    data = {
        "name": name, "model": "servetune-test-850m",
        "gpu": {"type": "H200", "count": 2},
        "workload": {"input_len": 256, "output_len": 64, "num_requests": 48, "concurrency": 16, "seed": 1},
        "search_space": {"params": {"tensor_parallel_size": [1, 2], "max_num_seqs": [16, 32, 64]}},
        "budget": {"trials": 6, "parallel": 2}, "backend": "sim", "seed": 5, "prescreen": False,
        "tracking": {"mlflow_uri": mlflow_uri, "experiment": f"exp-{name}"},
        "storage": {"optuna_url": optuna_url or f"sqlite:///{tmp}/optuna.db"},
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
import itertools
import json
from servetune.cluster.pool import TrialPool
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


def _ray_job(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RAY, "job", *args], env=_ENV, cwd=REPO, capture_output=True, text=True, timeout=timeout)


# Ray 2.60's job server gives the head node's job agent 10 s to answer (WAIT_AVAILABLE_AGENT_TIMEOUT)
# and otherwise refuses the submission with HTTP 500 "No available agent to submit job, please try
# again later." before any job exists. On a loaded 2-core machine the agent can miss that window
# (CI, 2026-12-04), so submit the way an operator would: again, a few times, while Ray says exactly
# that; any other failure ends at once.
_AGENT_BUSY = "No available agent to submit job"


def _submit_job(cluster: Cluster, *args: str, attempts: int = 4) -> subprocess.CompletedProcess[str]:
    for attempt in range(attempts):
        submit = _ray_job("submit", "--address", cluster.dashboard, *args, timeout=120)
        if submit.returncode == 0 or _AGENT_BUSY not in submit.stderr + submit.stdout:
            return submit
        time.sleep(5 * (attempt + 1))
    agent_logs = "\n".join(f"{log}:\n{log.read_text(errors='replace')[-1500:]}"
                           for log in sorted(cluster.temp.glob("session_*/logs/dashboard_agent*.log")))
    return subprocess.CompletedProcess(submit.args, submit.returncode, submit.stdout,
                                       submit.stderr + "\nthe job agents' logs:\n" + agent_logs)


# What the job ships: the repo root as the working dir (jobs/, search_spaces/), minus what a job
# never needs; servetune travels as a py_module, so platform/ itself is left out of the working dir.
_JOB_EXCLUDES = [".git", ".venv", "tests", "benchmarks", "docs", "infra", "platform", "**/__pycache__",
                 "*.egg-info", "servetune-runs"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_job_submit_runs_a_study_on_the_named_gpu_type_with_postgresql(
        cluster: Cluster, postgres_server: PostgresServer, mlflow_server_pg: str, tmp_path: Path) -> None:
    optuna_url = postgres_server.create_database("job_submit")
    spec = _spec(tmp_path, mlflow_server_pg, "jobsubmit", optuna_url)
    runtime_env = {"py_modules": [str(REPO / "platform" / "servetune")], "excludes": _JOB_EXCLUDES}
    submission = f"servetune-test-{os.getpid()}"
    started = time.monotonic()
    submit = _submit_job(cluster, "--submission-id", submission, "--working-dir", str(REPO),
                         "--runtime-env-json", json.dumps(runtime_env), "--no-wait",
                         "--", "python", "jobs/tune.py", str(spec))
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    status = ""
    while time.monotonic() - started < 240:
        out = _ray_job("status", "--address", cluster.dashboard, submission)
        # The CLI logs "Job '<id>' succeeded|failed|stopped" once the job ended ("Status for job
        # '<id>': RUNNING" before), through its logger: read both streams.
        text = out.stdout + out.stderr
        status = next((s for s in ("SUCCEEDED", "FAILED", "STOPPED") if f"' {s.lower()}" in text), "")
        if status:
            break
        time.sleep(2)
    logs = _ray_job("logs", "--address", cluster.dashboard, submission).stdout
    print(f"\nray job {submission}: {status or 'still running'} after {time.monotonic() - started:.1f} s")
    assert status == "SUCCEEDED", text[-1000:] + logs[-4000:]
    # `ray job logs` shows servetune's progress: the driver joined this cluster and told every trial.
    assert "servetune job: joined the Ray cluster" in logs and "3 nodes, 3 GPUs" in logs, logs[-3000:]
    assert "trials 6/6" in logs and "servetune job: best trial #" in logs, logs[-3000:]
    # The driver imported servetune from the py_module the job shipped (Ray's runtime resources),
    # not from the repo checkout or an installed copy.
    origin = next(line for line in logs.splitlines() if "servetune job: servetune from" in line)
    assert "runtime_resources" in origin and str(REPO) not in origin, origin

    # Optuna (PostgreSQL): every trial told once, none left running.
    trials = optuna.load_study(study_name="jobsubmit", storage=optuna_url).get_trials()
    told = sorted(t.number for t in trials if t.state == optuna.trial.TrialState.COMPLETE)
    assert len(told) == 6 and len(trials) == 6

    # The Parquet history: each told trial once, all on the H200.
    df = dataset.read_trials(tmp_path / "dataset", study="jobsubmit")
    assert sorted(int(n) for n in df["trial_number"]) == told and set(df["gpu_type"]) == {"H200"}

    # MLflow (PostgreSQL-backed): each told trial once; its result.json says where it ran, on which
    # GPUs and when.
    client = MlflowClient(mlflow_server_pg)
    exp = client.get_experiment_by_name("exp-jobsubmit")
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=1000)
            if r.data.tags.get("servetune.role") == "trial"]
    assert sorted(int(r.data.tags["servetune.trial_number"]) for r in runs) == told
    held: list[tuple[str, str, float, float, int]] = []  # (node, gpu id, start, end, trial)
    tp_seen = set()
    for run in runs:
        path = client.download_artifacts(run.info.run_id, "result.json", str(tmp_path / run.info.run_id))
        ev = _evidence(json.loads(Path(path).read_text())["evidence"])
        assert ev["ray_accelerator_type"] == "H200", ev  # never the A100-40G node
        tp = int(run.data.params["tensor_parallel_size"])
        tp_seen.add(tp)
        gpu_ids = [str(g) for g in json.loads(ev["ray_gpu_ids"])]
        assert len(gpu_ids) == len(set(gpu_ids)) == tp, ev  # TP=2: two distinct GPUs of one node (one actor)
        start, end = (float(x) for x in ev["ray_window"].split("-"))
        held += [(ev["ray_node_id"], g, start, end, int(run.data.tags["servetune.trial_number"])) for g in gpu_ids]
    assert tp_seen == {1, 2}
    # No (node, GPU) held by two trials at overlapping times.
    for (node_a, gpu_a, s_a, e_a, n_a), (node_b, gpu_b, s_b, e_b, n_b) in itertools.combinations(held, 2):
        if (node_a, gpu_a) == (node_b, gpu_b) and n_a != n_b:
            assert e_a <= s_b or e_b <= s_a, f"GPU {gpu_a} of node {node_a[:8]} double-booked by #{n_a} and #{n_b}"
