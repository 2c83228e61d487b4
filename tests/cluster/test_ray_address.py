"""A study whose ``RAY_ADDRESS`` names a cluster that is not there says so within a minute and stops.

Ray 2.60's ``ray.init(address=...)`` retries an absent GCS without end ("Failed to get cluster ID from
GCS server: TimedOut", every half minute: reproduced for five minutes with `servetune tune` and
``RAY_ADDRESS=127.0.0.1:6399``). The pool now waits for the address to answer
(``SERVETUNE_RAY_CONNECT_WAIT_S``, 60 s by default), then refuses with one line naming
``RAY_ADDRESS`` and the fix, exit 2, before any trial.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from _ray_helpers import free_ports

from servetune.cluster._ray_session import wait_for_cluster

REPO = Path(__file__).resolve().parents[2]


def test_an_address_that_accepts_is_waited_for_no_longer_and_one_that_refuses_is_given_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert wait_for_cluster(f"127.0.0.1:{port}", 30.0)
        assert wait_for_cluster(f"ray://127.0.0.1:{port}", 30.0)
    closed = free_ports(1)[0]
    assert not wait_for_cluster(f"127.0.0.1:{closed}", 1.0)
    assert wait_for_cluster("auto", 0.0)  # Ray's own word: Ray resolves it


def test_servetune_tune_with_ray_address_at_no_cluster_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    shutil.copy(REPO / "jobs" / "quickstart.yaml", tmp_path / "study.yaml")
    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_ADDRESS=f"127.0.0.1:{port}", SERVETUNE_RAY_CONNECT_WAIT_S="2", HOME=str(tmp_path),
               PYTHONPATH=str(REPO / "platform"))
    proc = subprocess.run([sys.executable, "-m", "servetune", "tune", "study.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == [f"error: RAY_ADDRESS: no Ray cluster answers at 127.0.0.1:{port} (waited 2 s) (fix: start the "
                      "cluster's head there (`ray start --head`), or unset RAY_ADDRESS to run the study on a local "
                      "Ray)"], proc.stderr[-3000:]
    assert "servetune: best trial" not in proc.stdout


def test_an_address_that_accepts_but_is_no_ray_cluster_is_given_up_after_one_try(tmp_path: Path) -> None:
    """Something listens at RAY_ADDRESS but never answers as a GCS: the wait passes at once, and Ray's own
    tries (``RAY_gcs_server_port_wait_time_s``, 20 by default, ~35 s each) are bounded to one for the join,
    which then fails as a one-line refusal naming RAY_ADDRESS."""
    shutil.copy(REPO / "jobs" / "quickstart.yaml", tmp_path / "study.yaml")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_ADDRESS=f"127.0.0.1:{port}", SERVETUNE_RAY_CONNECT_WAIT_S="5", HOME=str(tmp_path),
                   PYTHONPATH=str(REPO / "platform"))
        proc = subprocess.run([sys.executable, "-m", "servetune", "tune", "study.yaml"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=200)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: RAY_ADDRESS: cannot join the Ray cluster at 127.0.0.1:{port} (")
    assert "Traceback" not in proc.stderr


def test_a_bad_wait_or_timeout_setting_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """SERVETUNE_RAY_CONNECT_WAIT_S and SERVETUNE_STARTUP_TIMEOUT_S were read with a bare float(): 'soon'
    was a ValueError traceback at the pool's start or at the first trial, a negative wait no wait at all."""
    shutil.copy(REPO / "jobs" / "quickstart.yaml", tmp_path / "study.yaml")
    for name, value in (("SERVETUNE_RAY_CONNECT_WAIT_S", "soon"), ("SERVETUNE_STARTUP_TIMEOUT_S", "-5"),
                        ("SERVETUNE_STARTUP_TIMEOUT_S", "nan")):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SERVETUNE_"))}
        env.update({name: value, "HOME": str(tmp_path), "PYTHONPATH": str(REPO / "platform")})
        proc = subprocess.run([sys.executable, "-m", "servetune", "tune", "study.yaml"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stdout == "", (name, proc.stdout[-1000:], proc.stderr[-2000:])
        assert proc.stderr.strip().splitlines() == [
            f"error: {name}: expected a number of seconds, 0 or more, got {value!r} (fix: set it to a number such "
            f"as {60 if 'RAY' in name else 600}, or unset it for the default)"], proc.stderr[-2000:]
        assert not (tmp_path / "servetune-runs" / "optuna.db").exists()
