"""Security: no shell, validated flag values, loopback binds, secrets never recorded.

The end-to-end check runs a real study (sim backend, real Ray, real ``mlflow server``) with a
planted Hugging Face token in the environment and in spec fields, then reads back EVERYTHING the
study left: every param, tag and artifact of every MLflow run (parent and children), the Parquet
dataset and every file under the runs dir (Optuna's SQLite included). The token must be nowhere.
The recorder's own check hands it a real trial's result and files holding secrets (the one place
that redacts); the nightly's is in tests/test_nightly.py.
"""

from __future__ import annotations

import io
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from servetune.errors import SpecError
from servetune.planner.flags import FLAGS, parse_set_option, validate_flag
from servetune.records import Screen, read_trials
from servetune.result import RequestRecord, TrialResult, TrialStatus
from servetune.spec.schema import StudySpec
from servetune.study import run_study
from servetune.study._recorder import Recorder
from servetune.engines.vllm.engine import VllmLaunch, run_vllm_trial
from servetune.workload import Workload

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "platform" / "servetune"
SECRET = "hf_plantedsecret123"
PLAIN_SECRET = "Zq9plainpw"  # not token-shaped: only the environment-value rule can catch it
INJECTION = "0.9; rm -rf /"


def test_no_subprocess_goes_through_a_shell() -> None:
    offenders = []
    pattern = re.compile(r"shell\s*=\s*True|os\.system\s*\(|os\.popen\s*\(|subprocess\.getoutput|subprocess\.getstatusoutput")
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20  # the package was found
    for path in files:
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert offenders == []


@pytest.mark.parametrize("flag", ["gpu_memory_utilization", "kv_cache_dtype", "max_num_seqs", "max_model_len"])
def test_shell_metacharacters_in_flag_values_are_refused(flag: str) -> None:
    with pytest.raises(SpecError) as exc:
        validate_flag(flag, INJECTION, f"fixed_flags.{flag}")
    assert exc.value.field == f"fixed_flags.{flag}"
    with pytest.raises(SpecError) as exc:
        parse_set_option(f"{flag}={INJECTION}")
    assert flag in exc.value.field


def test_plan_cli_refuses_an_injected_set_value() -> None:
    proc = subprocess.run([sys.executable, "-m", "servetune", "plan", "--model", "llama-3.1-8b", "--gpu", "A100-40GB",
                           "--set", f"gpu_memory_utilization={INJECTION}"], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "gpu_memory_utilization" in proc.stderr


def _listening_addresses(port: int) -> list[str]:
    """Local addresses LISTENing on ``port``, from /proc/net/tcp{,6} (hex, as the kernel writes them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.rsplit(":", 1)
            if int(hex_port, 16) == port and state == "0A":  # 0A: LISTEN
                found.append(addr)
    return found


def test_the_standin_server_binds_loopback_by_default(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "servetune.sim.server", "servetune-test-850m", "--port", str(port),
                             "--sim-speedup", "50"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"})
    try:
        deadline = time.monotonic() + 60
        while not _listening_addresses(port):
            assert proc.poll() is None and time.monotonic() < deadline, "stand-in did not start listening"
            time.sleep(0.1)
        assert _listening_addresses(port) == ["0100007F"]  # 127.0.0.1, nothing else
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_the_vllm_launch_argv_binds_loopback(tmp_path: Path) -> None:
    # A `vllm serve` stand-in that records its argv and exits: the launch fails at startup, quickly.
    recorder = tmp_path / "record.py"
    argv_file = tmp_path / "argv.txt"
    recorder.write_text(f"import sys\nopen({str(argv_file)!r}, 'w').write('\\n'.join(sys.argv[1:]))\nsys.exit(1)\n")
    assert VllmLaunch(model="m", flags={}).host == "127.0.0.1"
    launch = VllmLaunch(model="org/m", flags={"max_num_seqs": 8}, serve_command=(sys.executable, str(recorder)),
                        startup_timeout_s=30, log_dir=tmp_path / "logs", gpu_free_timeout_s=0.1)
    workload = Workload.from_dict({"input_len": 8, "output_len": 4, "num_requests": 1, "concurrency": 1})
    result = run_vllm_trial(launch, workload)
    assert result.status.value != "ok"
    argv = argv_file.read_text().splitlines()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "0.0.0.0" not in argv


@pytest.mark.slow
def test_a_planted_token_appears_nowhere_a_study_writes(tmp_path: Path, mlflow_server: str,
                                                        monkeypatch: pytest.MonkeyPatch, fresh_ray: None) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)  # in the trials' environment too: a Ray of its own (fresh_ray)
    runs = tmp_path / "runs"
    spec = StudySpec.from_dict({
        "name": "secret-study",
        "description": f"pulled with token {SECRET}",
        "model": "llama-3.1-8b",
        "serve_model": f"https://user:{SECRET}@hub.example/meta-llama/Llama-3.1-8B-Instruct",
        "gpu": {"type": "A100-40GB", "count": 2},
        "workload": {"input_len": 128, "output_len": 64, "num_requests": 16, "concurrency": 8, "seed": 1},
        "search_space": {"params": {"max_num_seqs": {"type": "categorical", "choices": [16, 32]}}},
        "fixed_flags": {"max_model_len": 1024, "gpu_memory_utilization": 0.9},
        "budget": {"trials": 3, "parallel": 2},
        "backend": "sim",
        "tracking": {"mlflow_uri": mlflow_server, "experiment": "exp-secret-study"},
        "storage": {"optuna_url": f"sqlite:///{runs}/optuna.db"},
        "output": {"runs_dir": str(runs), "dataset_dir": str(runs / "dataset")},
    })
    outcome = run_study(spec, out=io.StringIO())
    assert outcome.trials_done == 3

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("exp-secret-study")
    all_runs = client.search_runs([exp.experiment_id], max_results=1000)
    assert len(all_runs) == 4  # the parent and three trials
    seen_artifacts = 0
    for run in all_runs:
        for key, value in [*run.data.params.items(), *run.data.tags.items()]:
            assert SECRET not in key and SECRET not in value, (run.info.run_name, key)
        local = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "dl" / run.info.run_id)))
        for path in local.rglob("*"):
            if path.is_file():
                seen_artifacts += 1
                assert SECRET.encode() not in path.read_bytes(), path
    assert seen_artifacts >= 3 * 3 + 2  # engine.log, result.json, requests.parquet per trial; trials.* on the parent

    table = pq.read_table(runs / "dataset")
    assert table.num_rows == 3
    assert SECRET not in str(table.to_pylist())
    files = [p for p in runs.rglob("*") if p.is_file()]
    assert any(p.name == "optuna.db" for p in files)
    leaks = [str(p) for p in files if SECRET.encode() in p.read_bytes()]
    assert leaks == []


def test_no_flag_value_can_carry_a_secret() -> None:
    """The recorder gives flags no redaction pass: every string flag takes one of a fixed set of words."""
    for name, spec in FLAGS.items():
        if spec.kind is str:
            assert spec.choices, name
            with pytest.raises(SpecError):
                validate_flag(name, SECRET)


def _leaks(text: str) -> bool:
    return SECRET in text or PLAIN_SECRET in text


def test_the_recorder_redacts_a_real_trials_texts_and_files_once_for_every_sink(
        tmp_path: Path, mlflow_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("MY_SERVICE_PASSWORD", PLAIN_SECRET)
    runs = tmp_path / "runs"
    spec = StudySpec.from_dict({
        "name": "recorder-secret", "description": f"pulled with {PLAIN_SECRET}", "model": "llama-3.1-8b",
        "serve_model": f"https://user:{SECRET}@hub.example/meta-llama/Llama-3.1-8B-Instruct",
        "gpu": {"type": "H200", "count": 1},
        "workload": {"input_len": 128, "output_len": 64, "num_requests": 4, "concurrency": 2, "seed": 1},
        "search_space": {"params": {"max_num_seqs": {"type": "categorical", "choices": [16, 32]}}},
        "budget": {"trials": 1, "parallel": 1}, "backend": "sim",
        "tracking": {"mlflow_uri": mlflow_server, "experiment": "exp-recorder-secret"},
        "output": {"runs_dir": str(runs), "dataset_dir": str(runs / "dataset")},
    })
    study = optuna.create_study(directions=list(spec.objective.directions))
    recorder = Recorder.open(spec, study, "sim", resume=False)
    result = TrialResult(  # a real engine's trial that failed serving, every text holding a secret
        TrialStatus.CRASHED, backend="vllm", vllm_version="0.26.0", cause=f"pull https://u:{SECRET}@hub.example failed",
        evidence=[f"HF_TOKEN={SECRET}"], notes=[f"a note naming {SECRET}"], log_text=f"INFO start\npassword {PLAIN_SECRET}\n",
        infra_attempts=[f"slot 0: {PLAIN_SECRET}"], early_stopped=f"stopped near {SECRET}",
        requests=[RequestRecord(0, 128, 0, 0.0, None, None, error=f"HTTP 401 for {SECRET}")])
    trial = study.ask({"max_num_seqs": optuna.distributions.CategoricalDistribution([16, 32])})
    record = recorder.tell(trial, {"max_num_seqs": trial.params["max_num_seqs"]}, result,
                           screen=Screen(f"sim_screen: slower than {PLAIN_SECRET}", 812.0, 0.0))
    trial_dir = runs / "trials" / spec.name / record.trial_dir_name  # what a real trial leaves there
    (trial_dir / "nested").mkdir(parents=True)
    (trial_dir / "metrics_after.txt").write_text(f"vllm:num_preemptions_total 0\n# token {SECRET}\n")
    (trial_dir / "server.log").write_text(f"raw log {SECRET}\n")  # the run's engine.log is the redacted one
    (trial_dir / "nested" / "blob.bin").write_bytes(b"\x00\xff\x10binary")
    recorder.write(record)
    assert recorder.tracker.flush(wait_s=60) == 0

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("exp-recorder-secret")
    runs_found = client.search_runs([exp.experiment_id])
    assert len(runs_found) == 2  # the study's parent and the trial
    for run in runs_found:
        for key, value in [*run.data.params.items(), *run.data.tags.items()]:
            assert not _leaks(value), (run.info.run_name, key)
    child = next(r for r in runs_found if r.data.tags.get("servetune.role") == "trial")
    assert child.data.tags["servetune.cause"] == "pull https://***@hub.example failed"
    assert child.data.tags["servetune.sim_screen"] == "sim_screen: slower than ***"
    local = Path(client.download_artifacts(child.info.run_id, "", str(tmp_path / "dl")))
    assert (local / "files" / "metrics_after.txt").read_text() == "vllm:num_preemptions_total 0\n# token ***\n"
    assert (local / "files" / "nested" / "blob.bin").read_bytes() == b"\x00\xff\x10binary"
    assert not (local / "files" / "server.log").exists()
    assert (local / "engine.log").read_text() == "INFO start\npassword ***\n"
    for path in local.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes() and PLAIN_SECRET.encode() not in path.read_bytes(), path
    assert pq.read_table(local / "requests.parquet").column("error").to_pylist() == ["HTTP 401 for ***"]

    rows = read_trials(runs / "dataset", study=spec.name)
    assert len(rows) == 1 and not _leaks(str(rows.to_dict()))
    assert rows["serve_model"].iloc[0] == "https://***@hub.example/meta-llama/Llama-3.1-8B-Instruct"
    told = study.trials[0]
    assert not _leaks(str(told.user_attrs)) and not _leaks(str(study.user_attrs))
    assert told.user_attrs["cause"] == "pull https://***@hub.example failed"
