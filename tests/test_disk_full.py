"""A disk that fills mid-study, on a real 4 MiB tmpfs holding the runs folder (Optuna's and MLflow's
SQLite files, the dataset, the logs): one line, exit 1, naming ``--resume``; nothing left RUNNING in
MLflow or Optuna; the resume after space is freed finishes with every trial recorded once."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from mlflow import MlflowClient

from _study_procs import completed_trials

from servetune.records import dataset

REPO = Path(__file__).resolve().parent.parent
ENV = {"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin", "MLFLOW_DISABLE_TELEMETRY": "true"}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (needs root, as CI's containers run; refused otherwise, never skipped): room for the
    study's first trials (a fresh mlflow.db is ~0.9 MiB, each trial's artifacts ~0.6 MiB), filled by the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs here ({done.stderr.strip()}): this test needs root (CI runs as root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)



def _fill(folder: Path) -> Path:
    """Write zeros into ``folder`` until the disk refuses (ENOSPC)."""
    filler = folder / "filler"
    try:
        with open(filler, "wb") as fh:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
    except OSError as exc:  # ENOSPC: full (also when the open itself finds no room left)
        assert exc.errno == errno.ENOSPC, exc
    return filler


def test_a_disk_that_fills_mid_study_is_one_line_and_leaves_nothing_running(small_disk: Path, tmp_path: Path) -> None:
    runs = small_disk / "runs"
    data: dict[str, Any] = {
        "name": "full-disk", "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB", "count": 1},
        "workload": {"input_len": 512, "output_len": 256, "num_requests": 32, "concurrency": 16, "seed": 1},
        "objective": {"metric": "output_throughput"},
        "search_space": {"params": {"gpu_memory_utilization": {"type": "float", "low": 0.5, "high": 0.95, "step": 0.01},
                                    "max_num_seqs": {"type": "int", "low": 8, "high": 512}}},
        "budget": {"trials": 500, "parallel": 1}, "backend": "sim", "seed": 1,
        "tracking": {"experiment": "full-disk"},  # the runs folder's own mlflow.db, on the small disk
        "output": {"runs_dir": str(runs), "dataset_dir": str(runs / "dataset")},
    }
    spec = tmp_path / "study.yaml"
    spec.write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-m", "servetune", "tune", str(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while completed_trials(runs / "optuna.db") < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        filler = _fill(small_disk)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 1, (out[-3000:], err[-3000:])
    assert "Traceback" not in out + err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"servetune tune {spec} --resume" in errors[0] and "full" in errors[0], err[-3000:]
    filler.unlink(missing_ok=True)  # space again: read what the driver left

    storage = f"sqlite:///{runs / 'optuna.db'}"
    states = [t.state for t in optuna.load_study(study_name="full-disk", storage=storage).get_trials(deepcopy=False)]
    assert optuna.trial.TrialState.RUNNING not in states
    client = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
    exp = client.get_experiment_by_name("full-disk")
    left = client.search_runs([exp.experiment_id], max_results=1000)
    assert all(r.info.status != "RUNNING" for r in left), [(r.info.run_name, r.info.status) for r in left]

    told = states.count(optuna.trial.TrialState.COMPLETE)
    resumed = subprocess.run([*cmd, "--resume", "--trials", str(told + 1)], capture_output=True, text=True, env=ENV,
                             cwd=tmp_path, timeout=600)
    assert resumed.returncode in (0, 1), resumed.stderr[-3000:]
    study = optuna.load_study(study_name="full-disk", storage=storage)
    finished = sorted(t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
    assert len(finished) == told + 1
    children = [r for r in client.search_runs([exp.experiment_id], max_results=1000)
                if r.data.tags.get("servetune.role") == "trial"]
    assert sorted(int(c.data.tags["servetune.trial_number"]) for c in children) == finished
    assert all(c.info.status in ("FINISHED", "FAILED") for c in children)
    assert sorted(dataset.read_trials(runs / "dataset", study="full-disk")["trial_number"]) == finished
