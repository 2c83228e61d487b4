"""Warm start from earlier studies and the baseline trial (servetune.search.warmstart), pure and end to end.

End to end: real local Ray, a real `mlflow server`, Optuna SQLite, the Parquet dataset. A first
study fills the dataset; a second one on the same dataset starts from the first one's best
feasible flags, measures vLLM's defaults once, and tags every trial with its origin.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from servetune.records import dataset
from servetune.spec.space import SearchSpace
from servetune.spec.schema import StudySpec
from servetune.study import run_study
from servetune.search.warmstart import baseline_flags, fit_to_space, origin_of, study_distance, warm_starts

SPACE = {"params": {"gpu_memory_utilization": {"type": "float", "low": 0.5, "high": 0.95, "step": 0.05},
                    "max_num_seqs": {"type": "categorical", "choices": [16, 32, 64, 128, 256]}}}


def _spec(tmp_path: Path, name: str, mlflow_uri: str = "sqlite:///unused.db", **extra: Any) -> StudySpec:
    return StudySpec.from_dict({
        "name": name, "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB", "count": 2},
        "workload": {"input_len": 512, "output_len": 128, "num_requests": 24, "concurrency": 24, "seed": 1},
        "objective": {"metric": "output_throughput"}, "constraints": {"max_preemptions": 0},
        "search_space": SPACE, "fixed_flags": {"max_model_len": 4096}, "backend": "sim", "seed": 0,
        "tracking": {"mlflow_uri": mlflow_uri, "experiment": "exp-warm"},
        "storage": {"optuna_url": f"sqlite:///{tmp_path}/optuna.db"},
        "output": {"runs_dir": str(tmp_path), "dataset_dir": str(tmp_path / "dataset")}, **extra}, cwd=tmp_path)


def test_distance_and_fitting_to_the_space() -> None:
    assert study_distance("m", "0.26.0", "m", "0.26.3") == 0.0
    assert study_distance("m", "0.26.0", "m", None) == 0.5
    assert study_distance("m", "0.26.0", "other", "0.26.0") is None  # no profile: not comparable
    near = study_distance("a", "0.26.0", "b", "0.26.0", (8e9, "LlamaForCausalLM"), (7.6e9, "Qwen2ForCausalLM"))
    assert near is not None and 1.5 < near < 1.6
    space = SearchSpace.from_dict(SPACE)
    assert fit_to_space({"gpu_memory_utilization": 0.93, "max_num_seqs": 1024, "max_model_len": 8192}, space) == \
        {"gpu_memory_utilization": 0.95, "max_num_seqs": 256}
    assert fit_to_space({"gpu_memory_utilization": 0.2, "max_num_seqs": 20}, space) == \
        {"gpu_memory_utilization": 0.5, "max_num_seqs": 16}
    assert origin_of({}) == "sampler" and origin_of({"informed_start": True}) == "informed"
    assert origin_of({"origin": "baseline", "informed_start": True}) == "baseline"


def test_warm_starts_pick_the_nearest_studies_best_feasible_flags(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "now")
    ts = pd.Timestamp("2026-11-01", tz="UTC")
    rows = [  # (study, model, gpu, version, u, seqs, throughput, preemptions)
        ("same", "llama-3.1-8b", "A100-40GB", "0.26.0", 0.9, 64, 900.0, 0),
        ("same", "llama-3.1-8b", "A100-40GB", "0.26.0", 0.9, 256, 1500.0, 12),  # preempting: not a candidate
        ("oldvllm", "llama-3.1-8b", "A100-40GB", "0.24.0", 0.8, 128, 2000.0, 0),
        ("qwen", "qwen2.5-7b", "A100-40GB", "0.26.0", 0.7, 32, 3000.0, 0),
        ("othergpu", "llama-3.1-8b", "H100-80GB", "0.26.0", 0.95, 256, 5000.0, 0),
        ("now", "llama-3.1-8b", "A100-40GB", "0.26.0", 0.6, 16, 9000.0, 0),  # the study itself
    ]
    frame = pd.DataFrame([{"study": s, "model": m, "gpu_type": g, "vllm_version": v, "status": "ok",
                           "flag_gpu_memory_utilization": u, "flag_max_num_seqs": n, "flag_max_model_len": 4096,
                           "output_throughput": t, "preemptions": p, "timestamp": ts} for s, m, g, v, u, n, t, p in rows])
    starts = warm_starts(frame, spec)
    assert [w.study for w in starts] == ["same", "oldvllm"]
    assert starts[0].params == {"gpu_memory_utilization": 0.9, "max_num_seqs": 64} and starts[0].distance == 0.0
    # The figure shown next to the flags is that trial's, not the preempting trial's 1500.
    assert starts[0].objective == 900.0
    assert starts[1].distance == 0.5 and starts[1].objective == 2000.0
    assert warm_starts(frame[frame["study"].isin(["qwen", "othergpu"])], spec)[0].study == "qwen"


def test_baseline_is_vllms_defaults_fitted_to_the_space(tmp_path: Path) -> None:
    flags = baseline_flags(_spec(tmp_path, "b"))
    assert flags == {"gpu_memory_utilization": 0.9, "max_num_seqs": 256}
    assert baseline_flags(_spec(tmp_path, "b", baseline_trial=False)) == flags  # the switch only stops enqueueing


@pytest.mark.slow
def test_a_second_study_starts_from_the_first_ones_best_and_tags_origins(tmp_path: Path, mlflow_server: str) -> None:
    first = _spec(tmp_path, "first", mlflow_server, budget={"trials": 4, "parallel": 2}, baseline_trial=False)
    out1 = run_study(first, out=io.StringIO())
    assert out1.best_flags is not None
    best_params = {k: out1.best_flags[k] for k in ("gpu_memory_utilization", "max_num_seqs")}

    second = _spec(tmp_path, "second", mlflow_server, budget={"trials": 5, "parallel": 2})
    text = io.StringIO()
    run_study(second, out=text)
    assert "warm start from study 'first'" in text.getvalue() and "baseline trial" in text.getvalue()
    study = optuna.load_study(study_name="second", storage=second.storage.optuna_url)
    by_origin: dict[str, list[optuna.trial.FrozenTrial]] = {}
    for t in study.get_trials(deepcopy=False):
        by_origin.setdefault(origin_of(t.user_attrs), []).append(t)
    assert by_origin["informed"][0].number == 0  # the informed start first, then the warm start, the baseline
    warm = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("origin") == "warm_start"]
    assert warm and warm[0].user_attrs["warm_start_from"] == "first" and warm[0].params == best_params
    assert by_origin["baseline"][0].params == {"gpu_memory_utilization": 0.9, "max_num_seqs": 256}

    df = dataset.read_trials(tmp_path / "dataset", study="second")
    assert set(df["origin"]) >= {"informed", "baseline"} and df["origin"].notna().all()
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("exp-warm")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`servetune.study` = 'second'")
    origins = {r.data.tags.get("servetune.origin") for r in runs if "optuna.trial_number" in r.data.tags}
    assert {"informed", "baseline"} <= origins and None not in origins
    assert not math.isnan(float(df["objective"].max()))


def test_a_damaged_dataset_part_is_skipped_with_one_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A junk part-*.parquet beside good ones: warm start reads the good ones and says which file it skipped."""
    from servetune.result import TrialResult, TrialStatus
    from servetune.search.warmstart import enqueue_warm_starts

    spec = _spec(tmp_path, "now")
    good = TrialResult(status=TrialStatus.OK, backend="sim", vllm_version="0.26.0", output_throughput=900.0,
                       preemptions=0)
    files = dataset.append_trials(tmp_path / "dataset", [dataset.trial_row(
        "before", 0, {"gpu_memory_utilization": 0.9, "max_num_seqs": 64, "max_model_len": 4096}, good,
        "A100-40GB", "llama-3.1-8b")])
    junk = files[0].with_name("part-junk.parquet")
    junk.write_bytes(b"PAR1 but not really")
    study = optuna.create_study(direction="maximize")
    starts = enqueue_warm_starts(spec, study)
    assert [w.study for w in starts] == ["before"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning: warm start skipped" in err and "part-junk.parquet" in err
    assert "Traceback" not in err
    import pyarrow as pa

    with pytest.raises(pa.ArrowException):  # without on_damaged, the reader still refuses the folder
        dataset.read_trials(tmp_path / "dataset")
