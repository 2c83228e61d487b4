"""README's quickstart figures are what its commands print on a fresh checkout.

README's first command runs `servetune tune jobs/quickstart.yaml` and names the winner it ends with
(its output tok/s and its `vllm serve` line); "The CLI" then plans that winner (`servetune plan ...`,
its KV-cache tokens and verdict). The simulated engine and the planner are deterministic, so each
figure README states is the one the command prints: a change that moves them must move README too.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "platform"), "HOME": str(tmp_path),
            "RAY_AUTH_MODE": "disabled", "MLFLOW_DISABLE_TELEMETRY": "true"}


@pytest.mark.slow
def test_the_quickstart_ends_with_the_winner_readme_names(tmp_path: Path) -> None:
    stated = re.search(r"it ends with the winner, ([\d,]+) output tok/s, as\s+`(vllm serve [^`]+)`", README)
    assert stated, "README no longer states the quickstart's winner"
    proc = subprocess.run([sys.executable, "-m", "servetune", "tune", str(REPO / "jobs" / "quickstart.yaml")],
                          capture_output=True, text=True, env=_env(tmp_path), timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    best = re.search(r"best trial #\d+: ([\d,]+) output tok/s", proc.stdout)
    command = re.search(r"run it with:\n\s+(vllm serve .+)\n", proc.stdout)
    assert best and command, proc.stdout[-3000:]
    assert (best.group(1), command.group(1).strip()) == (stated.group(1), stated.group(2))


def test_the_plan_of_the_winner_prints_what_readme_says(tmp_path: Path) -> None:
    stated = re.search(r"the quickstart's winner gets ([\d,]+) KV-cache tokens and `verdict (\w+)`:\s+"
                       r"(servetune plan [^\n]+)", README)
    assert stated, "README no longer states the quickstart winner's plan"
    argv = shlex.split(stated.group(3))[1:]
    proc = subprocess.run([sys.executable, "-m", "servetune", *argv], capture_output=True, text=True,
                          env=_env(tmp_path), timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(rf"^KV cache\s+{stated.group(1)} tokens", proc.stdout, re.M), proc.stdout
    assert re.search(rf"^verdict\s+{stated.group(2)}$", proc.stdout, re.M), proc.stdout
    # The plan is of the flag set the quickstart's winner line names.
    winner = re.search(r"as\s+`vllm serve \S+ ([^`]+)`", README)
    assert winner
    flags = dict(zip(winner.group(1).split()[::2], winner.group(1).split()[1::2]))
    planned = {f"--{a.split('=')[0].replace('_', '-')}": a.split("=")[1] for a in argv if "=" in a}
    assert flags == planned
