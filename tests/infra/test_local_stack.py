"""``infra/local/stack.sh`` for real: up, use every service, down, nothing left behind.

PostgreSQL (Debian's binaries; CI installs them), an MLflow server on it, a Ray head and two
worker nodes with logical GPUs (num-cpus 1 each). MLflow must be PostgreSQL-backed: an experiment
created through the server is read back from PostgreSQL itself. Optuna's URL from the env file
must store a study. Ray must show each worker with servetune's accelerator resource. After
``down`` no process of the stack may remain.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from servetune.cluster.pool import accelerator_resource

REPO = Path(__file__).resolve().parents[2]
STACK = REPO / "infra" / "local" / "stack.sh"
WORKERS = {"H200": 2, "A100-40GB": 1}


def _pg_bin() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[4]))
    if not found:
        pytest.fail("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/postgres): the local stack needs it; "
                    "install Debian's postgresql package (.ci/run does)")
    return str(Path(found[-1]).parent)


def _env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            out[key] = value.split()[0]
    return out


def _stack_processes(*markers: str) -> list[str]:
    """Command lines of live processes that mention any marker (the stack's dirs)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in cmdline for m in markers):
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


@pytest.fixture
def stack_env() -> Iterator[dict[str, str]]:
    # Under /tmp and traversable: as root, PostgreSQL runs as the postgres user and must reach its data.
    root = Path(tempfile.mkdtemp(prefix="st-stack-", dir="/tmp"))
    root.chmod(0o755)
    env = {**os.environ, "SERVETUNE_STACK_DIR": str(root), "SERVETUNE_STACK_DASHBOARD": "0",
           "SERVETUNE_STACK_WORKERS": " ".join(f"{t}:{n}" for t, n in WORKERS.items()),
           "PYTHON": sys.executable, "PG_BIN": _pg_bin(), "MLFLOW_DISABLE_TELEMETRY": "true"}
    try:
        yield env
    finally:  # whatever the test did, stop the stack (a no-op once the test's own `down` ran)
        subprocess.run(["bash", str(STACK), "down"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_stack_up_serves_mlflow_on_postgres_optuna_and_a_labelled_ray_then_down_leaves_nothing(
        stack_env: dict[str, str]) -> None:
    root = Path(stack_env["SERVETUNE_STACK_DIR"])
    up = subprocess.run(["bash", str(STACK), "up"], env=stack_env, capture_output=True, text=True, timeout=240)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((root / "logs").glob("*.log"))) \
        if (root / "logs").is_dir() else ""
    assert up.returncode == 0, f"stack.sh up failed:\n{up.stdout}\n{up.stderr}\n{logs}"
    env = _env_file(root / "stack.env")
    ray_temp = (root / "ray_temp_dir").read_text().strip()
    pgids = [int(line.split()[1]) for line in (root / "stack.state").read_text().splitlines()]
    assert len(pgids) == 3 + len(WORKERS)  # postgres, mlflow, ray head, one per worker

    # MLflow answers, and what it stores lands in PostgreSQL.
    with urllib.request.urlopen(env["MLFLOW_TRACKING_URI"] + "/health", timeout=10) as response:
        assert response.status == 200
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment_id = client.create_experiment("stack-check")
    assert client.get_experiment_by_name("stack-check").experiment_id == experiment_id
    pg_port = env["OPTUNA_STORAGE"].rsplit(":", 1)[1].split("/")[0]
    rows = subprocess.run([str(Path(stack_env["PG_BIN"]) / "psql"), "-h", "127.0.0.1", "-p", pg_port, "-U", "servetune",
                           "-d", "mlflow", "-tAc", "SELECT experiment_id FROM experiments WHERE name = 'stack-check'"],
                          capture_output=True, text=True, timeout=30)
    assert rows.stdout.strip() == experiment_id, rows.stderr

    # Optuna stores a study at the env file's PostgreSQL URL; Ray (RAY_ADDRESS from the env file)
    # has the head without GPUs and one node per GPU type with its accelerator resource. One
    # interpreter for both: each import costs seconds on this machine.
    check = ("import json, sys, optuna, ray; optuna.logging.set_verbosity(optuna.logging.WARNING); "
             "s = optuna.create_study(study_name='stack-check', storage=sys.argv[1]); "
             "s.optimize(lambda t: t.suggest_float('x', 0, 1), n_trials=2); "
             "n = len(optuna.load_study(study_name='stack-check', storage=sys.argv[1]).trials); "
             "ray.init(log_to_driver=False); "
             "print(json.dumps({'trials': n, 'nodes': [n['Resources'] for n in ray.nodes() if n['Alive']]}))")
    out = subprocess.run([sys.executable, "-c", check, env["OPTUNA_STORAGE"]], env={**stack_env, **env},
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["trials"] == 2
    nodes = seen["nodes"]
    labelled = sorted((k, int(n.get("GPU", 0))) for n in nodes for k in n if k.startswith("accelerator_type:"))
    assert labelled == sorted((accelerator_resource(t), n) for t, n in WORKERS.items())
    assert len(nodes) == 1 + len(WORKERS) and sum(n.get("GPU", 0) for n in nodes) == sum(WORKERS.values())

    down = subprocess.run(["bash", str(STACK), "down"], env=stack_env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    for pgid in pgids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
    assert not _stack_processes(str(root), ray_temp), "left behind after down"
    assert not Path(ray_temp).exists() and not (root / "stack.state").exists()
    assert (root / "pgdata" / "PG_VERSION").is_file(), "down keeps the data"


def test_stack_refuses_a_malformed_worker_list_before_starting_anything(tmp_path: Path) -> None:
    env = {**os.environ, "SERVETUNE_STACK_DIR": str(tmp_path), "SERVETUNE_STACK_WORKERS": "H200",
           "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(STACK), "up"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "GPU_TYPE:COUNT" in out.stderr
    assert not (tmp_path / "stack.state").exists()
