"""A SIGKILLed driver's local Ray is stopped by the next start of the same study (``--resume``).

Real processes only: `servetune tune` in its own session starts its own local Ray (sim backend,
logical GPUs, a local MLflow file store), is SIGKILLed mid-study, and leaves Ray processes behind;
`servetune tune --resume` must stop exactly those (found from the record in the runs dir) and,
once it ends, leave no Ray process of its own session either.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import yaml
from _study_procs import completed_trials

from servetune.cluster._ray_session import record_path, session_processes

REPO = Path(__file__).resolve().parents[2]


def _spec(tmp: Path, trials: int) -> dict:
    return {
        "name": "leftovers", "model": "servetune-test-850m", "gpu": {"type": "H200", "count": 2},
        "workload": {"input_len": 128, "output_len": 64, "num_requests": 32, "concurrency": 8, "seed": 1},
        "objective": {"metric": "output_throughput"},
        "search_space": {"params": {"max_num_seqs": {"type": "categorical", "choices": [8, 16, 32, 64]},
                                    "gpu_memory_utilization": {"type": "float", "low": 0.3, "high": 0.9,
                                                               "step": 0.05}}},
        "budget": {"trials": trials, "parallel": 2}, "backend": "sim", "seed": 5,
        "tracking": {"mlflow_uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "leftovers"},
        "storage": {"optuna_url": f"sqlite:///{tmp}/optuna.db"},
        "output": {"runs_dir": str(tmp), "dataset_dir": str(tmp / "dataset")},
    }


def _kill_session(sid: int) -> None:
    """Test cleanup only: SIGKILL whatever is still in the killed driver's session."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue



def test_resume_stops_the_killed_drivers_ray_and_leaves_none_of_its_own(tmp_path: Path) -> None:
    spec_path = tmp_path / "study.yaml"
    spec_path.write_text(yaml.safe_dump(_spec(tmp_path, trials=500)))
    env = {"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin", "RAY_AUTH_MODE": "disabled",
           "SERVETUNE_POOL": "ray", "HOME": str(tmp_path), "MLFLOW_DISABLE_TELEMETRY": "true"}
    cmd = [sys.executable, "-m", "servetune", "tune", str(spec_path)]
    storage = f"sqlite:///{tmp_path}/optuna.db"
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                             start_new_session=True)
    record_file = record_path(tmp_path, "leftovers")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and completed_trials(tmp_path / "optuna.db") < 2:
            time.sleep(0.5)
        assert completed_trials(tmp_path / "optuna.db") >= 2, "the first driver told no trials"
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        record = json.loads(record_file.read_text())
        assert record["driver_pid"] == first.pid and "session_" in record["session_dir"]
        time.sleep(2)  # what survives the driver's death survives for good
        left = session_processes(record)
        assert left, "the SIGKILLed driver left no Ray process behind (nothing to test)"
        print(f"left by the SIGKILLed driver: {len(left)} processes of {record['session_dir']}")

        resumed = subprocess.run([*cmd, "--resume", "--trials", str(completed_trials(tmp_path / "optuna.db") + 2)], capture_output=True,
                                 text=True, env=env, timeout=300)
        assert resumed.returncode in (0, 1), resumed.stderr[-2000:]
        assert "stopped" in resumed.stdout and "left by the earlier driver's local Ray" in resumed.stdout, \
            resumed.stdout[-2000:]
        assert session_processes(record) == [], "the earlier session's Ray processes survived the resume"
        print(next(line for line in resumed.stdout.splitlines() if "left by the earlier driver" in line))
        # The resumed driver recorded its own session; once it has ended, nothing of it remains.
        own = json.loads(record_file.read_text())
        assert own["session_dir"] != record["session_dir"]
        deadline = time.monotonic() + 30
        while session_processes(own) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert session_processes(own) == [], "the resumed driver's Ray outlived it"
        study = optuna.load_study(study_name="leftovers", storage=storage)
        assert optuna.trial.TrialState.RUNNING not in {t.state for t in study.get_trials(deepcopy=False)}
    finally:
        if first.poll() is None:
            first.kill()
        _kill_session(first.pid)
