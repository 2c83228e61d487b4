"""Every sub-command (tune, best, report, plan, simulate, diagnose, workload) walked through missing files,
missing databases, unreadable files and closed pipes: one line on stderr naming what is missing and
the fix, exit 2, never a traceback; a closed pipe drops the output, not the work or the exit code.

Bad input runs through ``servetune.cli.main`` in this process (an escaping exception fails the test
outright) and, for a sample, through a real ``python -m servetune`` process. Closed pipes need real
file descriptors: the command's stdout is the write end of a pipe whose read end is already closed,
so its first write meets EPIPE, deterministically; and the literal ``servetune diagnose LOG | head -1``
(a user's shell pipeline) runs through bash with ``pipefail``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from servetune import cli

REPO = Path(__file__).resolve().parents[2]
SERVED_LOG = REPO / "tests" / "fixtures" / "real_h200" / "a1_u05_s64" / "server.log"
FAILED_LOG = REPO / "tests" / "fixtures" / "real_h200" / "b5_fail_u0012" / "server.log"


@pytest.fixture()
def junk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder with the kinds of bad input a user hands over; the CLI runs from it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n\xff\xfe")
    (tmp_path / "garbage.db").write_bytes(b"this is not SQLite\n" * 4)
    (tmp_path / "nomodel").mkdir()
    part = tmp_path / "broken_ds" / "gpu_type=H200" / "model=m" / "date=20260101"
    part.mkdir(parents=True)
    (part / "part-0.parquet").write_bytes(b"PAR1 but not really")
    spec = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())
    spec["search_space"] = str(REPO / "search_spaces" / "memory-pair.yaml")
    (tmp_path / "runs_is_a_file.yaml").write_text(yaml.safe_dump({**spec, "output": {"runs_dir": "afile"}}))
    (tmp_path / "db_under_a_file.yaml").write_text(
        yaml.safe_dump({**spec, "storage": {"optuna_url": "sqlite:///afile/optuna.db"}}))
    (tmp_path / "db_in_missing_folder.yaml").write_text(
        yaml.safe_dump({**spec, "storage": {"optuna_url": "sqlite:///no/such/folder/optuna.db"}}))
    return tmp_path


QUICKSTART = str(REPO / "jobs" / "quickstart.yaml")
W = ["--model", "servetune-test-850m", "--gpu", "H200", "--workload"]

CASES = [
    # tune: the spec file, then the stores it writes
    (["tune", "missing.yaml"], "spec: file not found: missing.yaml"),
    (["tune", "folder"], "spec: folder is a folder, not a regular file"),
    (["tune", "latin1.yaml"], "cannot read latin1.yaml"),
    (["tune", "afile/spec.yaml"], "Not a directory"),
    (["tune", "runs_is_a_file.yaml"], "output.runs_dir: "),
    (["tune", "db_under_a_file.yaml"], "storage.optuna_url: afile is a file"),
    (["tune", "db_in_missing_folder.yaml"], "storage.optuna_url: the folder no/such/folder"),
    # best: the Optuna database (once a 119-line SQLAlchemy traceback, twice, exit 1)
    (["best", "quickstart"], "--storage: no Optuna database at servetune-runs/optuna.db"),
    (["best", QUICKSTART], "storage.optuna_url: no Optuna database at"),
    (["best", "missing.yaml"], "file not found: missing.yaml"),
    (["best", "x", "--storage", "sqlite:///garbage.db"], "garbage.db (relative to"),
    (["best", "x", "--storage", "sqlite:///folder"], "is a folder, not an Optuna database"),
    (["best", "x", "--storage", "sqlite:///no/such/x.db"], "no Optuna database at no/such/x.db"),
    (["best", "x", "--storage", "nosuchdialect://x"], "cannot open the Optuna storage nosuchdialect://x"),
    # report: the Parquet dataset
    (["report"], "--dataset: no dataset folder at servetune-runs/dataset"),
    (["report", "--dataset", "afile"], "--dataset: afile is a file"),
    (["report", "--dataset", "broken_ds"], "--dataset: cannot read the dataset at broken_ds"),
    # plan: the model and the GPU table
    (["plan", "--model", "missing-model", "--gpu", "H200"], "no model config found for 'missing-model'"),
    (["plan", "--model", "nomodel", "--gpu", "H200"], "config.json does not exist"),
    (["plan", "--model", "llama-3.1-8b", "--gpu", "A100"], "ambiguous GPU 'A100': it names A100-40GB, A100-80GB"),
    (["plan", "--model", "llama-3.1-8b", "--gpu", "H200", "--gpu-file", "missing.yaml"], "--gpu-file: file not found"),
    (["plan", "--model", "llama-3.1-8b", "--gpu", "H200", "--gpu-file", "latin1.yaml"], "not UTF-8 text"),
    # plan --set: the fix is written the way the value was typed, on the command line
    (["plan", "--model", "llama-3.1-8b", "--gpu", "H200", "--set", "enforce_eager=maybe"],
     "--set enforce_eager: expected true or false, got 'maybe' (fix: write --set enforce_eager=true or "
     "--set enforce_eager=false)"),
    (["plan", "--model", "llama-3.1-8b", "--gpu", "H200", "--set", "max_num_seqs=-5"],
     "--set max_num_seqs: must be >= 1, got -5 (fix: use a value in [1, 65536])"),
    (["plan", "--model", "llama-3.1-8b", "--gpu", "H200", "--set", "gpu_memory_utilization=0"],
     "must be > 0, got 0.0 (fix: use a value in (0, 1])"),
    # simulate: the workload file
    (["simulate", *W, "missing.yaml"], "--workload: file not found: missing.yaml"),
    (["simulate", *W, "folder"], "--workload: folder is a folder"),
    (["simulate", *W, "latin1.yaml"], "--workload: cannot read latin1.yaml: not UTF-8"),
    # diagnose: the log and the metrics file
    (["diagnose", "missing.log"], "LOG: file not found: missing.log"),
    (["diagnose", "folder"], "LOG: folder is a folder"),
    (["diagnose", "latin1.yaml"], "LOG: latin1.yaml is not a vLLM log"),
    (["diagnose", str(REPO / "README.md")], "README.md is not a vLLM log"),
    (["diagnose", str(SERVED_LOG), "--metrics", "missing.txt"], "--metrics: file not found: missing.txt"),
    # workload: the /metrics dumps and the request log
    (["workload", "from-metrics", "missing.txt"], "source: file not found: missing.txt"),
    (["workload", "from-metrics", "folder"], "source: folder is a folder, not a regular file"),
    (["workload", "from-metrics", "latin1.yaml"], "source: latin1.yaml is not text"),
    (["workload", "from-metrics", str(REPO / "README.md")], "source: not vLLM /metrics text"),
    (["workload", "from-metrics", str(SERVED_LOG), "--wait", "5"], "--wait: takes one URL"),
    (["workload", "from-metrics", "ftp://host/metrics"], "source: ftp://host/metrics: only http:// and https:// URLs are read"),
    (["workload", "from-trace", "folder"], "folder is a folder, not a regular file"),
    (["workload", "from-trace", str(REPO / "README.md")], "README.md:1: not valid JSON"),
    (["workload", "from-trace", "missing.jsonl", "--num-requests", "0"], "--num-requests: must be >= 1, got 0"),
]


@pytest.mark.parametrize("argv, expected", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(junk, capsys, argv, expected):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert expected in err
    assert "fix:" in err or argv[0] == "diagnose" and "no such file" in err or "cannot read" in err
    # Nothing was created by looking: best does not leave an empty database behind.
    assert not (junk / "servetune-runs" / "optuna.db").exists()


def _proc(argv: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    return subprocess.run([sys.executable, "-m", "servetune", *argv], cwd=cwd, env=env, text=True,
                          timeout=600, **kw)


@pytest.mark.parametrize("argv", [["best", QUICKSTART], ["report"], ["diagnose", str(REPO / "README.md")],
                                  ["best", "x", "--storage", "sqlite:///garbage.db"]])
def test_a_real_process_prints_one_line_and_exits_2(junk, argv):
    proc = _proc(argv, junk, capture_output=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------ closed pipes
def _closed_pipe(argv: list[str], cwd: Path, close_stderr: bool = False) -> subprocess.CompletedProcess[str]:
    """Run with stdout (and optionally stderr) on a pipe nobody reads: the first write gets EPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        return _proc(argv, cwd, stdout=write, stderr=write if close_stderr else subprocess.PIPE)
    finally:
        os.close(write)


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny simulated study run by `servetune tune` whose stdout is a closed pipe."""
    root = tmp_path_factory.mktemp("pipe")
    spec = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())
    spec.update(name="pipe", search_space=str(REPO / "search_spaces" / "memory-pair.yaml"),
                budget={**spec.get("budget", {}), "trials": 2, "parallel": 1})
    spec["workload"].update(num_requests=16, concurrency=8)
    (root / "tiny.yaml").write_text(yaml.safe_dump(spec))
    proc = _closed_pipe(["tune", "tiny.yaml"], root)
    (root / "tune.rc").write_text(f"{proc.returncode}\n{proc.stderr}")
    return root


def test_tune_into_a_closed_pipe_finishes_the_study(study_dir):
    rc, stderr = (study_dir / "tune.rc").read_text().split("\n", 1)
    assert rc == "0" and "Traceback" not in stderr and "BrokenPipeError" not in stderr
    best = _proc(["best", "tiny.yaml", "--format", "json"], study_dir, capture_output=True)
    assert best.returncode == 0 and "max_num_seqs" in json.loads(best.stdout)  # both trials were told


@pytest.mark.parametrize("argv, code", [
    (["best", "tiny.yaml"], 0),
    (["report", "--dataset", "servetune-runs/dataset", "--out", "r.md"], 0),
    (["plan", "--model", "servetune-test-850m", "--gpu", "H200"], 0),
    (["plan", "--model", "servetune-test-850m", "--gpu", "H200", "--json"], 0),
    (["simulate", "--model", "servetune-test-850m", "--gpu", "H200", "--workload", "tiny.yaml"], 0),
    (["diagnose", str(SERVED_LOG)], 0),
    (["diagnose", str(FAILED_LOG), "--json"], 1),
])
def test_a_closed_pipe_keeps_the_exit_code_and_prints_no_traceback(study_dir, argv, code):
    proc = _closed_pipe(argv, study_dir)
    assert proc.returncode == code
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr and "Exception ignored" not in proc.stderr


def test_report_into_a_closed_pipe_still_writes_the_report(study_dir):
    assert _closed_pipe(["report", "--dataset", "servetune-runs/dataset", "--out", "r2.md"], study_dir).returncode == 0
    text = (study_dir / "r2.md").read_text()
    assert "## Study pipe: llama-3.1-8b on A100-40GB" in text and "\n2 trials: " in text


def test_an_error_into_closed_stdout_and_stderr_still_exits_2(study_dir):
    proc = _closed_pipe(["diagnose", "missing.log"], study_dir, close_stderr=True)
    assert proc.returncode == 2 and proc.stdout is None and proc.stderr is None


def test_report_out_in_an_unwritable_place_is_one_line(study_dir):
    (study_dir / "afile").write_text("x")
    proc = _proc(["report", "--dataset", "servetune-runs/dataset", "--out", "afile/r.md"], study_dir,
                 capture_output=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --out: cannot write")
    assert proc.stderr.count("\n") == 1


@pytest.mark.parametrize("log, code", [(SERVED_LOG, 0), (FAILED_LOG, 1), (REPO / "README.md", 2)])
def test_diagnose_piped_into_head_as_in_the_issue(log, code):
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    proc = subprocess.run(["bash", "-c", f'set -o pipefail; "{sys.executable}" -m servetune diagnose "{log}" | head -1'],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == code
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr
    assert proc.stdout.count("\n") == (0 if code == 2 else 1)
