"""README's optuna-dashboard command, run as written against the storage of a finished study."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


@pytest.mark.slow
def test_readmes_optuna_dashboard_command_serves_the_study(tmp_path: Path) -> None:
    line = re.search(r"^    \.venv/bin/(optuna-dashboard .+)$", (REPO / "README.md").read_text(), re.M)
    assert line, "README shows no optuna-dashboard command"
    argv = shlex.split(line.group(1))
    assert argv[1] == "sqlite:///servetune-runs/optuna.db" and argv[argv.index("--host") + 1] == "127.0.0.1"

    spec = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())
    spec.update(search_space=str(REPO / "search_spaces" / "memory-pair.yaml"), budget={"trials": 4, "parallel": 2})
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    tune = subprocess.run([sys.executable, "-m", "servetune", "tune", "study.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert tune.returncode == 0, tune.stdout[-2000:] + tune.stderr[-2000:]

    port = _free_port()
    argv[argv.index("--port") + 1] = str(port)
    exe = Path(sys.executable).parent / argv[0]  # the venv's entry point, as README's .venv/bin/
    proc = subprocess.Popen([str(exe), *argv[1:]], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        studies = None
        while time.monotonic() < deadline and studies is None:
            assert proc.poll() is None, "optuna-dashboard exited"
            try:
                studies = _get(f"http://127.0.0.1:{port}/api/studies")["study_summaries"]
            except OSError:
                time.sleep(0.3)
        assert studies is not None, "optuna-dashboard did not answer in 60 s"
        (summary,) = [s for s in studies if s["study_name"] == "quickstart"]
        detail = _get(f"http://127.0.0.1:{port}/api/studies/{summary['study_id']}?after=0")
        stored = optuna.load_study(study_name="quickstart", storage=f"sqlite:///{tmp_path}/servetune-runs/optuna.db")
        assert len(detail["trials"]) == len(stored.trials) == 4
        # The dashboard shows the flags servetune searched, as Optuna stored them (it sends them as text).
        shown = {t["number"]: {p["name"]: p["param_external_value"] for p in t["params"]} for t in detail["trials"]}
        assert shown == {t.number: {k: str(v) for k, v in t.params.items()} for t in stored.trials}
        # And what happened to each trial, in the words of servetune's plots and MLflow pages.
        attrs = {t["number"]: {a["key"]: a["value"] for a in t["user_attrs"]} for t in detail["trials"]}
        assert {a["outcome"] for a in attrs.values()} <= {"served_clean", "served_preempting", "pruned"}
        assert all(a["outcome"] == t.user_attrs["outcome"] for t in stored.trials for a in [attrs[t.number]])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
