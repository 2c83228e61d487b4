"""A Ray worker node lost mid-trial: the trial is an infrastructure failure, re-run on the surviving node.

A real three-node Ray cluster on this machine (``ray start --block``, each in its own session, as
in ``test_multinode.py``): a head with no GPUs and two "H200" nodes with one logical GPU
each. The study runs the `vllm serve` stand-in (real time, a few seconds of startup) through
``jobs/tune.py`` as a driver joined with ``RAY_ADDRESS``. While a trial's server starts on node A,
the test kills node A as a machine dies: its ``ray start`` process group and the servers its
trials launched, all at once with SIGKILL. The trial must come back as an infrastructure failure
(``node_lost``, Ray's error as the cause), run again on node B, and the study must finish with
every trial told once and none told infeasible for it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from servetune.records import dataset
from _ray_helpers import alive_nodes, free_ports, start_ray_node

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
# Node deaths noticed within seconds, not Ray's default ~30 s; the stand-in starts in 4 s (real time).
_ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true",
        "PYTHONPATH": str(REPO / "platform"), "RAY_health_check_period_ms": "1000",
        "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3",
        "RAY_health_check_initial_delay_ms": "1000", "SERVETUNE_SIM_STARTUP_S": "4"}



def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every live process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            out[int(entry)] = (int(st[1]), int(st[2]))
    return out


def _machine(pgid: int) -> set[int]:
    """A node's processes as a machine holds them: its process group and everything they started."""
    procs = _processes()
    found = {p for p, (_, g) in procs.items() if g == pgid}
    grew = True
    while grew:
        more = {p for p, (pp, _) in procs.items() if pp in found and p not in found}
        found |= more
        grew = bool(more)
    return found


def _standin_under(pgid: int) -> bool:
    for pid in _machine(pgid):
        try:
            if b"servetune.sim.server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


@pytest.fixture
def cluster() -> Iterator[tuple[str, list[subprocess.Popen[bytes]], set[int]]]:
    """Head + node A + node B; yields (address, [head, A, B], pids to kill at the end)."""
    temp = Path(tempfile.mkdtemp(prefix="st-nl-", dir="/tmp"))
    port = free_ports(1)[0]
    address = f"127.0.0.1:{port}"

    def common() -> list[str]:
        flags = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
                 "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")
        ports = [(flag, str(p)) for flag, p in zip(flags, free_ports(len(flags), avoid=(port,)))]
        return ["--num-cpus", "1", "--disable-usage-stats", "--block", *(x for pair in ports for x in pair)]

    h200 = '{"accelerator_type:H200": 1}'
    nodes: list[Callable[[], list[str]]] = [  # each call: fresh ports for a node's own services
        lambda: [RAY, "start", "--head", "--port", str(port), "--num-gpus", "0", "--temp-dir", str(temp),
         "--include-dashboard=false", *common()],
        lambda: [RAY, "start", "--address", address, "--num-gpus", "1", "--resources", h200, *common()],
        lambda: [RAY, "start", "--address", address, "--num-gpus", "1", "--resources", h200, *common()],
    ]
    procs: list[subprocess.Popen[bytes]] = []
    leftovers: set[int] = set()
    try:
        for i, command in enumerate(nodes):  # one node at a time: 2 cores, and no start-up races
            procs.append(start_ray_node(
                command, _ENV, temp / f"node{i}.log", timeout_s=90,
                up=lambda i=i: len(alive_nodes(address, _ENV, want=i + 1, wait_s=5)) >= i + 1))
        yield address, procs, leftovers
    finally:
        for proc in reversed(procs):
            leftovers |= _machine(proc.pid)
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in reversed(procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_lost_node_is_an_infra_failure_rerun_on_the_surviving_node(
        cluster: tuple[str, list[subprocess.Popen[bytes]], set[int]], tmp_path: Path) -> None:
    address, procs, leftovers = cluster
    node_a = procs[1]
    spec = {
        "name": "node-loss", "model": "servetune-test-850m", "gpu": {"type": "H200", "count": 2},
        "workload": {"input_len": 128, "output_len": 16, "num_requests": 16, "concurrency": 8, "seed": 1},
        "search_space": {"params": {"max_num_seqs": [8, 16, 32, 64]}},
        "budget": {"trials": 4, "parallel": 2}, "backend": "vllm", "seed": 5,
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "node-loss"},
        "storage": {"optuna_url": f"sqlite:///{tmp_path}/optuna.db"},
        "output": {"runs_dir": str(tmp_path / "runs"), "dataset_dir": str(tmp_path / "dataset")},
    }
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    env = {**_ENV, "RAY_ADDRESS": address, "HOME": str(tmp_path),
           "SERVETUNE_SERVE_COMMAND": f"{sys.executable} -m servetune.sim.server"}
    driver = subprocess.Popen([sys.executable, str(REPO / "jobs" / "tune.py"), str(spec_path)], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Wait until a trial's server is starting on node A, then take the whole machine down.
        deadline = time.monotonic() + 180
        while not _standin_under(node_a.pid):
            assert driver.poll() is None, driver.stdout.read()[-3000:] if driver.stdout else ""
            assert time.monotonic() < deadline, "no trial ever ran on node A"
            time.sleep(0.2)
        machine = _machine(node_a.pid)
        leftovers |= machine
        for pid in machine:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, out[-4000:]
    assert "infrastructure failure" in out and "node_lost" in out, out[-4000:]

    # Optuna: every trial told once, COMPLETE, feasible at startup; nothing FAIL, nothing RUNNING.
    study = optuna.load_study(study_name="node-loss", storage=f"sqlite:///{tmp_path}/optuna.db")
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 4 and {t.state for t in trials} == {optuna.trial.TrialState.COMPLETE}, \
        [(t.number, t.state, t.user_attrs.get("status")) for t in trials]
    assert all(t.constraints["startup"] < 0 for t in trials)  # nobody learnt the flags as infeasible

    # MLflow: one child run per trial; the re-run one says so, with the node loss as the cause.
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("node-loss")
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("servetune.role") == "trial"]
    assert sorted(int(r.data.tags["servetune.trial_number"]) for r in runs) == [t.number for t in trials]
    rerun = [r for r in runs if r.data.tags.get("servetune.infra_attempts")]
    assert len(rerun) == 1 and rerun[0].data.tags["servetune.infra_attempts"] == "1", out[-3000:] + str(\
        [(r.data.tags.get("servetune.trial_number"), r.data.tags.get("servetune.infra_attempts")) for r in runs])
    path = client.download_artifacts(rerun[0].info.run_id, "result.json", str(tmp_path))
    evidence = "\n".join(json.loads(Path(path).read_text())["evidence"])
    assert "node_lost" in evidence and "Ray node lost" in evidence, evidence[-3000:]
    print("the lost trial's infrastructure attempt:", rerun[0].data.tags["servetune.trial_number"],
          next(line for line in evidence.splitlines() if "attempt(s) of this flag set" in line)[:600])
    assert any(name in evidence for name in ("ActorDiedError", "ActorUnavailableError", "NodeDiedError"))
    # The re-run ran on a node that is still alive: node B.
    survivor = next(line.split("=", 1)[1] for line in evidence.splitlines() if line.startswith("ray_node_id="))
    assert survivor and f"ray_dead_nodes=['{survivor[:12]}']" not in evidence

    # The dataset: every trial once, served.
    df = dataset.read_trials(tmp_path / "dataset", study="node-loss")
    assert sorted(df["trial_number"]) == [t.number for t in trials] and set(df["status"]) == {"ok"}
