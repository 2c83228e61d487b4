"""The study driver end to end: real local Ray (logical GPUs), real `mlflow server`, real Optuna SQLite.

The landscape is Llama-3.1-8B on a simulated A100-40GB with long outputs, where low
gpu_memory_utilization fails at startup and high max_num_seqs preempts; the driver must tell both
to Optuna as infeasible, record every trial in MLflow and the dataset, and pick a feasible best.
"""

from __future__ import annotations

import io
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from _study_procs import completed_trials
from mlflow.tracking import MlflowClient

from servetune.records import dataset
from servetune.result import LatencySummary, TrialResult, TrialStatus
from servetune.spec.schema import StudySpec
from servetune.records.trial_attrs import set_trial_attrs
from servetune.study import constraint_values, objective_values, run_study
from servetune.study._outcome import BestSoFar, StudyOutcome, best_trial

REPO = Path(__file__).resolve().parent.parent


def _spec_dict(tmp: Path, mlflow_uri: str, name: str, trials: int = 8, **extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": name,
        "model": "llama-3.1-8b",
        "gpu": {"type": "A100-40GB", "count": 2},
        "workload": {"input_len": 512, "output_len": 1024, "num_requests": 96, "concurrency": 96, "seed": 1},
        "objective": {"metric": "output_throughput"},
        "constraints": {"max_preemptions": 0},
        "search_space": {"params": {
            "gpu_memory_utilization": {"type": "float", "low": 0.2, "high": 0.95, "step": 0.05},
            "max_num_seqs": {"type": "categorical", "choices": [16, 32, 64, 128, 256]},
        }},
        "fixed_flags": {"max_model_len": 4096},
        "budget": {"trials": trials, "parallel": 2},
        "backend": "sim",
        "sampler": "tpe",
        "seed": 3,
        "tracking": {"mlflow_uri": mlflow_uri, "experiment": f"exp-{name}"},
        "storage": {"optuna_url": f"sqlite:///{tmp}/optuna.db"},
        "output": {"runs_dir": str(tmp), "dataset_dir": str(tmp / "dataset")},
    }
    data.update(extra)
    return data


def test_constraints_have_the_same_keys_for_every_outcome(tmp_path: Path) -> None:
    spec = StudySpec.from_dict(_spec_dict(tmp_path, "http://127.0.0.1:1", "keys",
                                          constraints={"max_preemptions": 2, "p99_ttft_ms": 500}))
    ok = TrialResult(TrialStatus.OK, preemptions=5, output_throughput=100.0,
                     ttft_ms=LatencySummary(100, 100, 200, 400), itl_ms=LatencySummary(5, 5, 6, 9))
    oom = TrialResult(TrialStatus.STARTUP_OOM, cause="No available memory for the cache blocks")
    c_ok, c_oom = constraint_values(spec, ok), constraint_values(spec, oom)
    assert set(c_ok) == set(c_oom) == {"startup", "preemptions", "p99_ttft_ms"}
    assert c_ok == {"startup": -1.0, "preemptions": 3.0, "p99_ttft_ms": -100.0}
    assert all(v > 0 for v in c_oom.values())
    assert objective_values(spec, ok) == [100.0] and objective_values(spec, oom) == [0.0]


@pytest.mark.slow
def test_study_runs_trials_on_ray_and_records_everything(tmp_path: Path, mlflow_server: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVETUNE_POOL", "ray")  # simulated trials run locally unless Ray is asked for
    spec = StudySpec.from_dict(_spec_dict(tmp_path, mlflow_server, "landscape", trials=10))
    seen: list[tuple[int, dict[str, Any], TrialResult]] = []
    outcome = run_study(spec, out=io.StringIO(), on_result=lambda n, f, r: seen.append((n, f, r)))

    # Every trial told, the OOM region and the preempting region both visited and told infeasible.
    study = optuna.load_study(study_name="landscape", storage=spec.storage.optuna_url)
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 10 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert all(set(t.constraints) == {"startup", "preemptions"} for t in trials)
    statuses = [r.status for _, _, r in seen]
    assert outcome.trials_done == 10
    assert outcome.ok + outcome.startup_failed + outcome.pruned + outcome.other_failed == 10
    for t in trials:
        infeasible = any(c > 0 for c in t.constraints.values())
        status = t.user_attrs["status"]
        assert infeasible == (status != "ok" or t.user_attrs["preemptions"] > 0)
    # Each trial ran in its own Ray actor holding one (logical) GPU.
    # (refused and pruned trials are told before launch and never reach Ray)
    assert all("ray_gpu_ids=[" in " ".join(r.evidence) for _, _, r in seen
               if r.status not in (TrialStatus.INVALID_CONFIG, TrialStatus.PRUNED))

    # The best is feasible and is the best feasible value.
    if outcome.best_number is not None:
        best = study.trials[outcome.best_number]
        assert all(c <= 0 for c in best.constraints.values())
        feasible = [t.values[0] for t in trials if all(c <= 0 for c in t.constraints.values())]
        assert best.values[0] == max(feasible)
        assert outcome.best_command and outcome.best_command.startswith("vllm serve meta-llama/Llama-3.1-8B")

    # MLflow: one parent, one child per trial with flags as params and status tags.
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("exp-landscape")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == outcome.parent_run_id]
    assert len(parents) == 1 and parents[0].info.run_id == outcome.parent_run_id
    assert len(children) == 10
    for child in children:
        assert "gpu_memory_utilization" in child.data.params and "max_num_seqs" in child.data.params
        assert child.data.tags["gpu_type"] == "A100-40GB" and child.data.tags["backend"] == "sim"
        assert child.data.tags["servetune.status"] in {s.value for s in TrialStatus}
    served = [c for c in children if c.data.tags["servetune.status"] == "ok"]
    assert served, "no trial served at all"
    assert {"output_throughput", "ttft_p99_ms", "preemptions", "mem_kv_cache_gib"} <= set(served[0].data.metrics)
    parent_files = {a.path for a in client.list_artifacts(outcome.parent_run_id)}
    assert "trials.csv" in parent_files or any(p.startswith("trials") for p in parent_files)

    # Parquet: one row per trial, partitioned by GPU type / model / study.
    df = dataset.read_trials(tmp_path / "dataset", study="landscape")
    assert len(df) == 10 and set(df["status"]) == {s.value for s in statuses}


@pytest.mark.slow
def test_cli_tune_then_best_then_resume(tmp_path: Path, mlflow_server: str) -> None:
    spec_path = tmp_path / "study.yaml"
    spec_path.write_text(yaml.safe_dump(_spec_dict(tmp_path, mlflow_server, "cli-study", trials=4)))
    cmd = [sys.executable, "-m", "servetune"]
    env = {"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"}
    tune = subprocess.run([*cmd, "tune", str(spec_path)], capture_output=True, text=True, env=env, timeout=600)
    assert tune.returncode in (0, 1), tune.stderr[-2000:]
    assert "trials 4/4" in tune.stdout
    # The libraries' own lines go to the study's log file, not between servetune's lines.
    terminal = tune.stdout + tune.stderr
    for line in ("A new study created", "Creating initial MLflow database tables", "View run",
                 "Token authentication is enabled"):
        assert line not in terminal, terminal[-3000:]
    log_file = tmp_path / "logs" / "cli-study.log"
    assert f"messages are in {log_file}" in tune.stdout
    assert "A new study created in RDB with name: cli-study" in log_file.read_text()

    again = subprocess.run([*cmd, "tune", str(spec_path)], capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode != 0 and "--resume" in (again.stdout + again.stderr)

    resumed = subprocess.run([*cmd, "tune", str(spec_path), "--resume", "--trials", "6"],
                             capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode in (0, 1), resumed.stderr[-2000:]
    study = optuna.load_study(study_name="cli-study", storage=f"sqlite:///{tmp_path}/optuna.db")
    assert len(study.get_trials(deepcopy=False)) == 6
    children = MlflowClient(mlflow_server).search_runs(
        [MlflowClient(mlflow_server).get_experiment_by_name("exp-cli-study").experiment_id],
        filter_string="tags.`servetune.role` = 'trial'")
    assert len(children) == 6  # the resumed run added two trials under the same parent
    if tune.returncode == 0:
        best = subprocess.run([*cmd, "best", str(spec_path), "--format", "json"], capture_output=True, text=True,
                              env=env, timeout=120)
        assert best.returncode == 0, best.stderr
        flags = json.loads(best.stdout)
        assert {"gpu_memory_utilization", "max_num_seqs", "max_model_len"} <= set(flags)
        cmdline = subprocess.run([*cmd, "best", "cli-study", "--storage", f"sqlite:///{tmp_path}/optuna.db"],
                                 capture_output=True, text=True, env=env, timeout=120)
        assert cmdline.stdout.startswith("vllm serve ") and "--max-num-seqs" in cmdline.stdout


def test_cli_refuses_a_bad_spec_with_exit_code_2(tmp_path: Path) -> None:
    bad = _spec_dict(tmp_path, "http://127.0.0.1:1", "bad")
    bad["budget"] = {"trials": 0, "parallel": 2}
    spec_path = tmp_path / "bad.yaml"
    spec_path.write_text(yaml.safe_dump(bad))
    proc = subprocess.run([sys.executable, "-m", "servetune", "tune", str(spec_path)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 2
    assert "budget.trials" in proc.stderr
    assert not (tmp_path / "optuna.db").exists()


@pytest.mark.slow
def test_sigterm_ends_the_study_keeping_finished_trials(tmp_path: Path, mlflow_server: str) -> None:
    import signal
    import time

    spec_path = tmp_path / "study.yaml"
    spec_path.write_text(yaml.safe_dump(_spec_dict(tmp_path, mlflow_server, "term-study", trials=500)))
    env = {"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-m", "servetune", "tune", str(spec_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    study_db = f"sqlite:///{tmp_path}/optuna.db"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # wait until some trials are told
        time.sleep(1)
        # Read the database read-only: opening it through Optuna while the driver creates it races
        # the driver's own schema setup (two writers stamping alembic_version: IntegrityError).
        try:
            with sqlite3.connect(f"file:{tmp_path / 'optuna.db'}?mode=ro", uri=True) as db:
                (told,) = db.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()
        except sqlite3.Error:  # not created yet, or its tables not yet
            continue
        if told >= 3:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert "interrupted" in out, out[-2000:]
    # The summary says it was interrupted and how to go on, never "widen the search space", and no nan.
    assert f"servetune tune {spec_path} --resume" in out.splitlines()[-1], out[-2000:]
    assert "widen the search space" not in out and "nan ms" not in out and " nan " not in out
    study = optuna.load_study(study_name="term-study", storage=study_db)
    states = {t.state for t in study.get_trials(deepcopy=False)}
    assert optuna.trial.TrialState.RUNNING not in states
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert 3 <= len(done) < 500
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("exp-term-study")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parent = [r for r in runs if r.data.tags.get("servetune.role") == "study"]
    assert len(parent) == 1 and parent[0].info.status == "KILLED"
    children = [r for r in runs if r.data.tags.get("servetune.role") == "trial"]
    assert len(children) == len(done) and all(c.info.status != "RUNNING" for c in children)


def _kill_session(sid: int) -> int:
    """SIGKILL every process of a session (the killed driver's Ray processes); returns how many."""
    import os
    import signal

    killed = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


@pytest.mark.slow
def test_sigkilled_driver_then_resume_keeps_every_finished_trial_once(tmp_path: Path, mlflow_server: str) -> None:
    import signal
    import time

    spec_path = tmp_path / "study.yaml"
    spec_path.write_text(yaml.safe_dump(_spec_dict(tmp_path, mlflow_server, "kill-study", trials=500)))
    env = {"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "servetune", "tune", str(spec_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    storage = f"sqlite:///{tmp_path}/optuna.db"
    complete = optuna.trial.TrialState.COMPLETE
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            time.sleep(0.5)
            # read-only: a poll that opened the storage for writing could race the driver creating the
            # database (both stamping its schema version: "UNIQUE constraint failed: alembic_version")
            if completed_trials(tmp_path / "optuna.db") >= 4:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        _kill_session(proc.pid)  # Ray's agents and workers outlive a SIGKILLed driver (see docs/reliability.md)
    before = optuna.load_study(study_name="kill-study", storage=storage)
    done_before = {t.number for t in before.get_trials(deepcopy=False, states=(complete,))}
    assert len(done_before) >= 4

    resumed = subprocess.run([*cmd, "--resume", "--trials", str(len(done_before) + 3)], capture_output=True,
                             text=True, env=env, timeout=600)
    assert resumed.returncode in (0, 1), resumed.stderr[-2000:]
    study = optuna.load_study(study_name="kill-study", storage=storage)
    trials = study.get_trials(deepcopy=False)
    assert optuna.trial.TrialState.RUNNING not in {t.state for t in trials}
    done = {t.number for t in trials if t.state == complete}
    assert done_before <= done and len(done) == len(done_before) + 3  # nothing lost, the budget respected

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("exp-kill-study")
    runs = client.search_runs([exp.experiment_id], max_results=2000)
    assert len([r for r in runs if r.data.tags.get("servetune.role") == "study"]) == 1  # the same parent, resumed
    children = [r for r in runs if r.data.tags.get("servetune.role") == "trial"]
    assert all(c.info.status != "RUNNING" for c in children)
    recorded = [int(c.data.tags["servetune.trial_number"]) for c in children if c.info.status != "KILLED"]
    assert sorted(recorded) == sorted(done)  # every told trial exactly once
    rows = dataset.read_trials(tmp_path / "dataset", study="kill-study")
    assert sorted(rows["trial_number"]) == sorted(done)


@pytest.mark.slow
def test_resume_measures_the_points_an_interrupt_cut(tmp_path: Path) -> None:
    """An interrupted driver tells its running trials FAIL; ``--resume`` measures their points
    again, once. Before, Optuna's ``skip_if_exists`` counted the killed trial itself and nothing was
    re-queued: a grid study lost the point for good (the real H200 14B grid's trial 2)."""
    space = {"params": {"gpu_memory_utilization": [0.5, 0.9], "max_num_seqs": [16, 64, 256]}}
    spec = StudySpec.from_dict(_spec_dict(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", "grid-cut", trials=6,
                                          sampler="grid", search_space=space, prescreen=False))

    def interrupt(number: int, flags: dict[str, Any], result: TrialResult) -> None:
        raise KeyboardInterrupt  # what SIGTERM / Ctrl-C raise in the driver, with the second trial in flight

    first = run_study(spec, out=io.StringIO(), on_result=interrupt)
    assert first.interrupted and first.trials_done == 1
    study = optuna.load_study(study_name="grid-cut", storage=spec.storage.optuna_url)
    fail, complete = optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE
    cut = {(t.params["gpu_memory_utilization"], t.params["max_num_seqs"])
           for t in study.get_trials(deepcopy=False, states=(fail,))}
    assert cut  # parallel 2: the second trial was running when the first one's result came

    out = io.StringIO()
    resumed = run_study(spec, resume=True, out=out)
    assert f"{len(cut)} interrupted trials re-queued" in out.getvalue()
    assert resumed.trials_done == 6 and not resumed.interrupted
    study = optuna.load_study(study_name="grid-cut", storage=spec.storage.optuna_url)
    points = sorted((t.params["gpu_memory_utilization"], t.params["max_num_seqs"])
                    for t in study.get_trials(deepcopy=False, states=(complete,)))
    assert points == [(u, s) for u in (0.5, 0.9) for s in (16, 64, 256)]  # the cut ones too, each once
    # A second resume has nothing left to re-queue: the cut points were measured.
    out = io.StringIO()
    run_study(spec, resume=True, out=out)
    assert "re-queued" not in out.getvalue()
    assert len(optuna.load_study(study_name="grid-cut", storage=spec.storage.optuna_url).get_trials(
        deepcopy=False, states=(complete,))) == 6


@pytest.mark.slow
def test_grid_sampler_measures_every_point_once_two_at_a_time(tmp_path: Path) -> None:
    """The grid baseline: every point of a finite space exactly once, even with two trials in
    flight (Optuna's GridSampler skips the points running trials hold), then the study stops."""
    space = {"params": {"gpu_memory_utilization": [0.5, 0.9], "max_num_seqs": [16, 64, 256]}}
    spec = StudySpec.from_dict(_spec_dict(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", "grid", trials=40,
                                          sampler="grid", search_space=space, prescreen=False))
    outcome = run_study(spec, out=io.StringIO())
    assert outcome.trials_done == 6
    study = optuna.load_study(study_name="grid", storage=spec.storage.optuna_url)
    points = sorted((t.params["gpu_memory_utilization"], t.params["max_num_seqs"]) for t in study.trials)
    assert points == [(u, s) for u in (0.5, 0.9) for s in (16, 64, 256)]


@pytest.mark.slow
def test_resumed_grid_measures_only_the_points_left(tmp_path: Path) -> None:
    """A grid study stopped part way and resumed measures every point exactly once: the resumed
    sampler maps the stored grid indices to the same points (a reseeded one re-measured visited
    points on the real H200 8B grid)."""
    space = {"params": {"gpu_memory_utilization": [0.5, 0.9], "max_num_seqs": [16, 64, 256]}}
    first = StudySpec.from_dict(_spec_dict(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", "grid-resume", trials=3,
                                           sampler="grid", search_space=space, prescreen=False))
    assert run_study(first, out=io.StringIO()).trials_done == 3
    rest = StudySpec.from_dict(_spec_dict(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", "grid-resume", trials=6,
                                          sampler="grid", search_space=space, prescreen=False))
    run_study(rest, resume=True, out=io.StringIO())
    study = optuna.load_study(study_name="grid-resume", storage=rest.storage.optuna_url)
    points = sorted((t.params["gpu_memory_utilization"], t.params["max_num_seqs"]) for t in study.trials)
    assert points == [(u, s) for u in (0.5, 0.9) for s in (16, 64, 256)]


def test_the_best_kept_as_trials_are_told_is_the_one_best_trial_reads() -> None:
    """Told out of trial order, with ties: the best after each tell is best_trial's (the lowest number
    of equal values), and a confirmed winner fixes it whatever is told after."""
    study = optuna.create_study(direction="maximize")
    trials = [study.ask() for _ in range(7)]
    outcome, best = StudyOutcome("s"), BestSoFar()
    for k, value in ((3, 5.0), (1, 4.0), (5, 7.0), (4, 7.0), (0, 2.0), (2, 7.0)):
        trial = trials[k]
        set_trial_attrs(trial, {"flags": {"max_num_seqs": k}, "metrics": {"output_throughput": value}},
                        {"startup": -1.0})
        study.tell(trial, value)
        best.told(study, outcome, trial, value)
        expected = best_trial(study)
        assert expected is not None and outcome.best_number == expected.number
        assert outcome.best_flags == {"max_num_seqs": expected.number}
        assert outcome.best_metrics == {"output_throughput": expected.value}
    assert outcome.best_number == 2
    study.set_user_attr("confirmation", {"winner": 4})
    fixed = BestSoFar()
    set_trial_attrs(trials[6], {"flags": {"max_num_seqs": 6}, "metrics": {"output_throughput": 9.0}}, {"startup": -1.0})
    study.tell(trials[6], 9.0)
    for _ in range(2):
        fixed.told(study, outcome, trials[6], 9.0)
        assert outcome.best_number == 4
