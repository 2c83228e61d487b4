"""`servetune tune` then `servetune best --headroom` on a small simulated study (real local Ray,
Optuna SQLite, MLflow on SQLite): the study's end computes the winner's and the runner-up's
headroom, prints it, stores it, logs it on the MLflow parent run, `servetune report` draws it,
and `selection.min_headroom` makes the winner the best flag set that meets every constraint at
that scale (checked here by simulating the candidates directly)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from servetune.cli._main import main
from servetune.search import headroom as hr
from servetune.spec.schema import load_spec
from servetune.study import ranked_flag_sets

REPO = Path(__file__).resolve().parents[2]
MIN_HEADROOM = 1.5


def _spec(tmp: Path) -> dict[str, Any]:
    return {
        "name": "robust", "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB", "count": 2},
        "workload": {"input_len": 512, "output_len": 512, "num_requests": 64, "concurrency": 64},
        "constraints": {"max_preemptions": 0},
        "search_space": {"params": {"gpu_memory_utilization": [0.6, 0.65], "max_num_seqs": [32, 64]}},
        "fixed_flags": {"max_model_len": 4096}, "sampler": "grid", "backend": "sim",
        "budget": {"trials": 4, "parallel": 2}, "selection": {"min_headroom": MIN_HEADROOM},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "robust"},
        "output": {"runs_dir": str(tmp)},
    }


@pytest.mark.slow
def test_tune_then_best_headroom_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = tmp_path / "robust.yaml"
    spec_path.write_text(yaml.safe_dump(_spec(tmp_path)))
    env = {"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"}
    tune = subprocess.run([sys.executable, "-m", "servetune", "tune", str(spec_path)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=tmp_path)
    assert tune.returncode == 0, (tune.stdout + tune.stderr)[-3000:]
    assert f"servetune: selection.min_headroom x{MIN_HEADROOM:g}: trial #" in tune.stdout
    assert "servetune: winner (trial #" in tune.stdout and "servetune: error band: not checked" in tune.stdout

    # The selection rule, checked against the simulator directly: the winner meets every
    # constraint at the scale, every flag set ranked above it on the objective does not.
    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.load_study(study_name="robust", storage=storage)
    stored = study.user_attrs["headroom"]
    spec = load_spec(spec_path)
    ranked = ranked_flag_sets(study)
    chosen = stored["selected"]
    assert chosen is not None and chosen != ranked[0][0], "the selection chose the objective's best: nothing tested"
    limits = spec.constraints.limits()
    for number, flags in ranked:
        meets = hr.meets_at(hr.spec_simulator(spec, flags), spec.workload, limits, MIN_HEADROOM)
        assert meets == (number == chosen), (number, flags)
        if number == chosen:
            break
    assert stored["winner"]["trial_number"] == chosen and stored["runner_up"]["trial_number"] == ranked[0][0]
    winner = hr.StudyHeadroom.from_dict(stored).winner
    assert winner.headroom >= MIN_HEADROOM
    # A simulated study's own trial is the search's baseline (not simulated again): the same figures.
    direct = hr.spec_simulator(spec, dict(ranked)[chosen])(spec.workload)
    base = winner.baseline()
    assert base is not None and base.broken == hr.broken_criteria(direct, limits) == ()
    assert base.metrics["output_throughput"] == pytest.approx(direct.output_throughput)
    assert base.metrics["tpot_p99_ms"] == pytest.approx(direct.metrics()["tpot_p99_ms"])

    # `best` prints the chosen flag set and the stored headroom block.
    assert main(["best", "robust", "--storage", storage, "--headroom"]) == 0
    out = capsys.readouterr().out
    chosen_flags = dict(ranked)[chosen]
    assert out.startswith("vllm serve ") and f"--max-num-seqs {chosen_flags['max_num_seqs']}" in out.splitlines()[0]
    assert f"winner (trial #{chosen})" in out and "prompt length:" in out and "error band:" in out
    assert main(["best", str(spec_path), "--headroom", "--format", "json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["flags"] == chosen_flags and as_json["headroom"]["winner"]["edges"]

    # MLflow: the parent run holds the figures, the JSON and the curve.
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("robust")
    parent = next(r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags)
    assert parent.data.metrics["headroom.x"] == pytest.approx(hr.StudyHeadroom.from_dict(stored).winner.headroom)
    assert parent.data.metrics["headroom.min_headroom"] == MIN_HEADROOM
    assert "headroom.runner_up.prompt_len_x" in parent.data.metrics
    files = {a.path for a in client.list_artifacts(parent.info.run_id)}
    plots = {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    assert "headroom.json" in files and "plots/headroom.png" in plots

    # The report draws it.
    assert main(["report", "--dataset", str(tmp_path / "dataset"), "--out", str(tmp_path / "report.md")]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "Headroom of the winner (simulated)" in report and (tmp_path / "report_files" / "headroom.png").is_file()

    # A study without a stored headroom: by name, one line naming the fix (exit 2); with the spec
    # file, computed now for the current winner.
    study.set_user_attr("headroom", None)
    capsys.readouterr()
    assert main(["best", "robust", "--storage", storage, "--headroom"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --headroom: ") and "pass the spec file" in err[0]
    assert main(["best", str(spec_path), "--headroom"]) == 0
    fresh = capsys.readouterr().out
    assert f"winner (trial #{ranked[0][0]})" in fresh  # without the stored selection, the objective's best


def test_a_bad_selection_stops_tune_with_exit_2(tmp_path: Path) -> None:
    data = _spec(tmp_path)
    data["selection"] = {"min_headroom": "high"}
    spec_path = tmp_path / "bad.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    proc = subprocess.run([sys.executable, "-m", "servetune", "tune", str(spec_path)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: selection.min_headroom: ")
    assert len(proc.stderr.strip().splitlines()) == 1 and "(fix: " in proc.stderr
    assert not (tmp_path / "optuna.db").exists()
