"""The cost_per_mtok objective in a small simulated study: real local Ray, real ``mlflow server``,
real Optuna SQLite. The winner is the cheapest feasible flag set per million good output tokens, and
Optuna, MLflow and the dataset carry the same figures."""

from __future__ import annotations

import io
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from servetune.records import dataset
from servetune.spec.schema import StudySpec
from servetune.study import best_trial, run_study

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "platform" / "servetune" / "data" / "gpu_prices.yaml"


@pytest.mark.timeout(240)
def test_cost_objective_picks_the_cheapest_feasible_trial(tmp_path: Path, mlflow_server: str, fresh_ray: None) -> None:
    # fresh_ray: a Ray another test left running would run these trials with its GPUs, not this
    # study's two (a TP=2 trial then waits for GPUs that never come and the study stops early).
    spec = StudySpec.from_dict({
        "name": "cost-objective", "model": "servetune-test-850m", "gpu": {"type": "H200", "count": 2},
        "workload": {"input_len": 256, "output_len": 64, "num_requests": 40, "concurrency": 16, "seed": 0},
        "objective": {"metric": "cost_per_mtok"},
        "constraints": {"max_preemptions": 0, "p99_ttft_ms": 300},
        "search_space": {"params": {"max_num_seqs": [4, 8, 16, 32], "tensor_parallel_size": [1, 2]}},
        "fixed_flags": {"gpu_memory_utilization": 0.5, "max_model_len": 1024},
        "budget": {"trials": 6, "parallel": 2}, "backend": "sim", "seed": 0,
        "tracking": {"mlflow_uri": mlflow_server, "experiment": "cost-objective"},
        "storage": {"optuna_url": f"sqlite:///{tmp_path}/optuna.db"},
        "output": {"runs_dir": str(tmp_path), "dataset_dir": str(tmp_path / "dataset")},
    }, cwd=tmp_path)
    outcome = run_study(spec, out=io.StringIO())
    price = {e["gpu"]: e["usd_per_gpu_hour"] for e in yaml.safe_load(SHIPPED.read_text())["prices"]}["H200"]

    df = dataset.read_trials(tmp_path / "dataset", study="cost-objective")
    served = df[df["status"] == "ok"]
    assert len(served) >= 4
    for _, row in served.iterrows():
        tp = int(row["flag_tensor_parallel_size"])
        # cost x good tokens of an hour = the GPUs' hour: the price of the study's GPU type x TP
        assert row["cost_per_mtok"] * row["goodput_output_throughput"] * 3600 / 1e6 == pytest.approx(price * tp)
        assert row["objective"] == pytest.approx(row["cost_per_mtok"])
        assert row["goodput_output_throughput"] <= row["output_throughput"] * (1 + 1e-9)
    # Goodput counts only requests within the TTFT target: a queueing trial keeps part of its tokens.
    assert (served["good_request_share"] < 1).any() and (served["good_request_share"] == 1).any()

    feasible = served[(served["preemptions"] == 0) & (served["ttft_p99_ms"] <= 300)]
    study = optuna.load_study(study_name="cost-objective", storage=spec.storage.optuna_url)
    best = best_trial(study)
    assert best is not None and outcome.best_number == best.number
    assert best.values[0] == pytest.approx(feasible["cost_per_mtok"].min())
    assert (outcome.best_metrics or {})["cost_per_mtok"] == pytest.approx(best.values[0])

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("cost-objective")
    runs = client.search_runs([exp.experiment_id], f"tags.`optuna.trial_number` = '{best.number}'")
    assert runs and runs[0].data.metrics["cost_per_mtok"] == pytest.approx(best.values[0])
