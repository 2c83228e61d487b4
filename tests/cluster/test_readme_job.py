"""README's ``ray job submit`` block, run as a user types it, against a real ``ray start --head``.

The block is read from README.md, its placeholders filled (``HEAD:8265`` -> this head's dashboard,
``STUDY.yaml`` -> a small simulated study), and run with bash from a copy of the repository (so
``$PWD/servetune-runs`` lands in the test's folder, never in the checkout). The head is Ray as it
ships (the version constraints.txt pins): one CPU-only node on loopback ports, its own HOME and temp
dir, started after a local Ray left ``~/.ray/auth_token`` behind (the quickstart does), so ``ray
start`` turns token authentication on, as it does on a user's machine. The job follows to its end
through ``ray job submit`` itself; then the ``servetune best`` line the job printed is run.
The nightly is submitted the same way (README's ``jobs/nightly.py`` form of the block): night 1,
then night 2, which reads night 1's history. Teardown signals only this head's process group.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import yaml
from _ray_helpers import free_ports, start_ray_node

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")
# What a job needs of the repository (the rest is left out of the copy: it is big or irrelevant).
_COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "tests", "benchmarks", "docs", "infra", "servetune-runs",
                                      "servetune-nightly", "__pycache__", "*.egg-info", ".pytest_cache")
# Ray 2.60's job server gives the head's job agent 10 s to answer and otherwise refuses the
# submission before any job exists; an operator submits again (see test_multinode.py).
_AGENT_BUSY = "No available agent to submit job"


def _user_env(home: Path) -> dict[str, str]:
    """A user's shell: this venv first on PATH (as after `source .venv/bin/activate`), an own HOME,
    no Ray or servetune settings inherited from the test runner."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "SERVETUNE_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=str(home), PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
               RAY_USAGE_STATS_ENABLED="0", MLFLOW_DISABLE_TELEMETRY="true")
    return env


@dataclass(frozen=True)
class Head:
    dashboard: str  # host:port of the dashboard / job server
    gcs: str  # host:port of its GCS (RAY_ADDRESS for a driver)
    home: Path
    temp: Path
    log: Path


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the head's process group, SIGKILL it if it lingers, then whatever outlived ``ray start``."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    try:  # children that outlived `ray start` (same process group)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    """``ray start --head`` with 2 CPUs and no GPU, token auth as Ray turns it on by default."""
    home = Path(tempfile.mkdtemp(prefix="st-rj-home-"))
    temp = Path(tempfile.mkdtemp(prefix="st-rj-", dir="/tmp"))  # short: Ray's socket paths have a limit
    env = _user_env(home)
    # Any local Ray (the README's quickstart) leaves a token here; `ray start` then enables auth.
    subprocess.run([RAY, "get-auth-token", "--generate"], env=env, capture_output=True, check=True, timeout=60)
    port, dash = free_ports(2)

    def command() -> list[str]:
        ports = iter(free_ports(7, avoid=(port, dash)))
        flags = [(f, str(next(ports))) for f in (
            "--ray-client-server-port", "--node-manager-port", "--object-manager-port", "--metrics-export-port",
            "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")]
        return [RAY, "start", "--head", "--port", str(port), "--num-cpus", "2", "--num-gpus", "0",
                "--temp-dir", str(temp), "--include-dashboard=true", "--dashboard-host", "127.0.0.1",
                "--dashboard-port", str(dash), "--disable-usage-stats", "--block", *(x for pair in flags for x in pair)]

    log = home / "head.log"
    # Nothing to drain at teardown: stop at once (Ray 2.60 drains a SIGTERMed node up to 30 s).
    node_env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = start_ray_node(command, node_env, log, lambda: "Ray runtime started" in log.read_text(errors="replace"),
                              timeout_s=90)
        yield Head(f"127.0.0.1:{dash}", f"127.0.0.1:{port}", home, temp, log)
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def readme_block() -> str:
    """The README's indented code block that runs ``ray job submit``, as its lines."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"(?:^ {4}\S.*\n(?:^ {4}.*\n)*)", text, flags=re.M)
    found = [b for b in blocks if "ray job submit" in b]
    assert len(found) == 1, f"README has {len(found)} code blocks with `ray job submit`"
    return "\n".join(line[4:] for line in found[0].splitlines())


def readme_nightly_entrypoint() -> str:
    """README's entrypoint for the nightly as a Ray job (the same block, another entrypoint)."""
    text = " ".join((REPO / "README.md").read_text().split())
    match = re.search(r"`-- (python jobs/nightly\.py [^`]+)`", text)
    assert match, "README does not say how the nightly is submitted as a Ray job"
    return match.group(1)


def _repo_copy(dst: Path) -> Path:
    shutil.copytree(REPO, dst, ignore=_COPY_IGNORE)
    return dst


def _run_block(script: str, cwd: Path, head: Head, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    for attempt in range(4):
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=_user_env(head.home),
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or _AGENT_BUSY not in proc.stdout + proc.stderr:
            return proc
        time.sleep(5 * (attempt + 1))
    return proc


def _printed(lines: str, prefix: str) -> list[str]:
    return [line.split(prefix, 1)[1].strip() for line in lines.splitlines() if prefix in line]


def _servetune(command: str, cwd: Path, head: Head) -> subprocess.CompletedProcess[str]:
    """Run a printed ``servetune ...`` command with bash, this checkout's servetune first."""
    env = {**_user_env(head.home), "PYTHONPATH": str(REPO / "platform")}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


_STUDY = {
    "name": "readme-job", "model": "servetune-test-850m", "gpu": {"type": "H200", "count": 2},
    "workload": {"input_len": 128, "output_len": 32, "num_requests": 16, "concurrency": 8, "seed": 1},
    "search_space": {"params": {"max_num_seqs": [8, 16, 32]}},
    "budget": {"trials": 3, "parallel": 2}, "backend": "auto", "seed": 3, "baseline_trial": False,
}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_readme_ray_job_block_runs_verbatim_and_its_best_line_finds_the_study(head: Head, tmp_path: Path) -> None:
    assert "Token authentication is enabled" in head.log.read_text(errors="replace")  # Ray's default here
    repo = _repo_copy(tmp_path / "repo")
    (repo / "study.yaml").write_text(yaml.safe_dump(_STUDY))
    block = readme_block()
    assert "HEAD:8265" in block and "STUDY.yaml" in block
    script = block.replace("HEAD:8265", head.dashboard).replace("STUDY.yaml", "study.yaml")
    started = time.monotonic()
    proc = _run_block(script, repo, head)
    out = proc.stdout + proc.stderr
    print(f"\nREADME's ray job block: rc {proc.returncode} after {time.monotonic() - started:.1f} s")
    assert proc.returncode == 0 and "succeeded" in out, out[-5000:]
    # A head with no GPU, backend auto: the simulated trials asked Ray for none and all finished.
    assert "trials 3/3" in out and "waiting for GPUs" not in out, out[-3000:]
    # The stores are where the block said, not in Ray's temporary copy of the working dir.
    assert (repo / "servetune-runs" / "optuna.db").is_file()
    assert not list(head.temp.rglob("optuna.db")), "a store was written inside Ray's temp dir"
    best_lines = [c for c in _printed(out, "servetune job: results:") if c.startswith("servetune best")]
    assert len(best_lines) == 1, out[-3000:]
    best = _servetune(best_lines[0], tmp_path, head)  # from another folder: the line carries its store
    assert best.returncode == 0 and best.stdout.startswith("vllm serve servetune-test-850m"), best.stdout + best.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_writing_into_rays_working_dir_is_refused_in_one_line(head: Head, tmp_path: Path) -> None:
    repo = _repo_copy(tmp_path / "repo")
    (repo / "study.yaml").write_text(yaml.safe_dump({**_STUDY, "name": "readme-job-relative"}))
    block = readme_block()
    # The user's own variant: the README's block without --runs-dir (the spec's relative default).
    script = re.sub(r' --runs-dir "[^"]*"', "", block.replace("HEAD:8265", head.dashboard)
                    .replace("STUDY.yaml", "study.yaml"))
    assert "--runs-dir" not in script
    proc = _run_block(script, repo, head)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "failed" in out, out[-3000:]
    # The CLI shows the job's log, then repeats it in the job's status message: one distinct line.
    errors = sorted({line for line in out.splitlines() if line.startswith("error: ")})
    assert len(errors) == 1 and errors[0].startswith("error: output.runs_dir: 'servetune-runs' resolves into Ray's "
                                                     "temporary copy"), out[-3000:]
    assert "failed with exit code 2" in out
    assert "fix: give an absolute path" in errors[0] and "Traceback" not in out
    assert not list(head.temp.rglob("optuna.db"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_driver_without_the_clusters_token_is_refused_in_one_line(head: Head, tmp_path: Path) -> None:
    """`servetune tune` on a machine that lacks the cluster's token: Ray refuses the connection
    (ConnectionError "Failed to connect to Ray cluster", after its InvalidAuthToken lines); the study says
    so in one line naming RAY_ADDRESS and the token, exit 2, not a file error nor a traceback."""
    (tmp_path / "study.yaml").write_text(yaml.safe_dump({**_STUDY, "name": "no-token"}))
    env = {**_user_env(tmp_path), "RAY_ADDRESS": head.gcs, "SERVETUNE_RAY_CONNECT_WAIT_S": "20"}
    proc = subprocess.run([sys.executable, "-m", "servetune", "tune", "study.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: RAY_ADDRESS: cannot join the Ray cluster at {head.gcs} (")
    assert "RAY_AUTH_TOKEN or ~/.ray/auth_token" in errors[0] and "Traceback" not in proc.stderr


_MATRIX = {
    "name": "readme-nightly",
    "template": {"objective": {"metric": "output_throughput"}, "constraints": {"max_preemptions": 0},
                 "search_space": {"params": {"max_num_seqs": [8, 16, 32]}}, "budget": {"trials": 3, "parallel": 1},
                 "backend": "auto", "seed": 0, "baseline_trial": False},
    "models": ["servetune-test-850m"], "gpus": [{"type": "H200", "count": 1}],
    "workloads": {"chat": {"input_len": 128, "output_len": 32, "num_requests": 16, "concurrency": 8, "seed": 0}},
    "noise": {"repeats": 2, "sigmas": 3, "min_relative": 0.03},
}


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_readme_nightly_job_runs_two_nights_and_the_second_reads_the_first(head: Head, tmp_path: Path) -> None:
    repo = _repo_copy(tmp_path / "repo")
    (repo / "matrix.yaml").write_text(yaml.safe_dump(_MATRIX))
    entry = readme_nightly_entrypoint()
    assert entry.startswith("python jobs/nightly.py jobs/nightly.yaml --output-dir ")
    block = readme_block().replace("HEAD:8265", head.dashboard)
    block = re.sub(r"-- python jobs/tune\.py .*$", "-- " + entry.replace("jobs/nightly.yaml", "matrix.yaml"), block)
    outs = []
    for date in ("20260101", "20260102"):
        proc = _run_block(block + f" --date {date}", repo, head)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "succeeded" in out, out[-5000:]
        outs.append(out)
    cell = "servetune-test-850m.H200.chat"
    assert f"{cell}: ok: first night" in outs[0], outs[0][-3000:]
    second = next(line for line in outs[1].splitlines() if f"servetune nightly 20260102: {cell}:" in line)
    assert "first night" not in second, second  # night 2 compared with night 1's history
    history = pd.read_parquet(repo / "servetune-nightly" / "nightly_history.parquet")
    assert sorted(set(history["date"])) == ["20260101", "20260102"]
    best_lines = [c for c in _printed(outs[1], "servetune nightly: results:") if c.startswith("servetune best")]
    assert best_lines == [f"servetune best {cell}-20260102 --storage sqlite:///{repo}/servetune-nightly/optuna.db"]
    best = _servetune(best_lines[0], tmp_path, head)
    assert best.returncode == 0 and best.stdout.startswith("vllm serve servetune-test-850m"), best.stdout + best.stderr
