"""The driver's pre-screen end to end: the trial pool, real `mlflow server`, real Optuna SQLite.

A flag set the memory planner predicts to fail at startup must be told to Optuna as infeasible
without ever reaching the pool, and recorded in MLflow (a ``pruned`` child run with the prediction)
and in the dataset; a fresh study starts from the preemption prior's informed point.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from servetune.records import dataset
from servetune.result import TrialResult, TrialStatus
from servetune.spec.schema import StudySpec
from servetune.study import run_study


@pytest.mark.slow
def test_pruned_trials_never_reach_the_pool_and_are_recorded(tmp_path: Path, mlflow_server: str) -> None:
    spec = StudySpec.from_dict({
        "name": "prescreened", "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB", "count": 2},
        "workload": {"input_len": 512, "output_len": 256, "num_requests": 24, "concurrency": 24, "seed": 1},
        "objective": {"metric": "output_throughput"}, "constraints": {"max_preemptions": 0},
        # 0.2-0.35 cannot hold Llama-3.1-8B's 15 GiB of weights plus the KV cache on a 40 GB card.
        "search_space": {"params": {"gpu_memory_utilization": [0.2, 0.25, 0.3, 0.35, 0.9],
                                    "max_num_seqs": [16, 64]}},
        "fixed_flags": {"max_model_len": 4096}, "budget": {"trials": 5, "parallel": 2},
        "backend": "sim", "sampler": "tpe", "seed": 0,
        "tracking": {"mlflow_uri": mlflow_server, "experiment": "exp-prescreened"},
        "storage": {"optuna_url": f"sqlite:///{tmp_path}/optuna.db"},
        "output": {"runs_dir": str(tmp_path), "dataset_dir": str(tmp_path / "dataset")},
    }, cwd=tmp_path)
    seen: dict[int, TrialResult] = {}
    outcome = run_study(spec, out=io.StringIO(), on_result=lambda n, f, r: seen.__setitem__(n, r))

    study = optuna.load_study(study_name="prescreened", storage=spec.storage.optuna_url)
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 5 and outcome.trials_done == 5
    # The informed start comes first: the highest utilization that starts, max_num_seqs capped by
    # the 24 requests in flight and snapped down to the space's choices.
    assert trials[0].params == {"gpu_memory_utilization": 0.9, "max_num_seqs": 16}
    assert trials[0].user_attrs.get("informed_start") is True
    pruned = [t for t in trials if t.user_attrs["status"] == "pruned"]
    assert pruned and outcome.pruned == len(pruned) and outcome.startup_failed == 0
    for t in pruned:
        assert t.params["gpu_memory_utilization"] <= 0.35
        assert set(t.constraints) == {"startup", "preemptions"} and all(c > 0 for c in t.constraints.values())
        assert t.values == [0.0] and t.user_attrs["predicted_failure"] == "startup_oom"
        result = seen[t.number]
        # Never dispatched: the pool (Ray's actor or a local worker) gives every trial it ran its GPU ids.
        assert not result.gpu_ids and not any("gpu_ids=" in e for e in result.evidence)
        assert result.evidence[0].startswith("prescreen: the memory planner predicts startup_oom")
    launched = [t for t in trials if t.user_attrs["status"] != "pruned"]
    assert launched and all(seen[t.number].gpu_ids for t in launched)
    assert all(t.params["gpu_memory_utilization"] == 0.9 for t in launched)

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("exp-prescreened")
    children = client.search_runs([exp.experiment_id], filter_string="tags.`servetune.status` = 'pruned'")
    assert len(children) == len(pruned)
    for child in children:
        tags: dict[str, Any] = child.data.tags
        assert tags["servetune.prescreen"] == "pruned" and tags["servetune.predicted_failure"] == "startup_oom"
        assert tags["servetune.cause"].startswith("predicted startup_oom: No available memory for the cache blocks")
        assert "raise gpu_memory_utilization" in tags["servetune.predicted_fix"]
        assert child.data.metrics["mem_kv_cache_gib"] < 0 < child.data.metrics["mem_weights_gib"]
        assert "output_throughput" not in child.data.metrics

    df = dataset.read_trials(tmp_path / "dataset", study="prescreened")
    rows = df[df["status"] == TrialStatus.PRUNED.value]
    assert len(rows) == len(pruned) and set(rows["predicted_failure"]) == {"startup_oom"}


@pytest.mark.slow
def test_sim_screened_proposals_never_reach_the_pool_and_are_recorded(tmp_path: Path, mlflow_server: str) -> None:
    """Multi-fidelity in the driver (replay backend: on by default): a proposal the calibrated
    simulator rules out is told `pruned` with cause `sim_screen: ...`, never dispatched, and
    recorded with its predicted figures (MLflow tags, dataset columns, Optuna user attr)."""
    repo = Path(__file__).resolve().parent.parent
    landscape = repo / "benchmarks" / "landscapes" / "llama8b-a100-40gb-long-out.csv"
    spec = StudySpec.from_dict({
        "name": "screened", "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB", "count": 1},
        "workload": {"input_len": 512, "output_len": 1024, "num_requests": 384, "concurrency": 192, "seed": 0},
        "objective": {"metric": "output_throughput"}, "constraints": {"max_preemptions": 0},
        "search_space": {"params": {
            "gpu_memory_utilization": {"type": "float", "low": 0.3, "high": 0.95, "step": 0.05},
            "max_num_seqs": {"type": "categorical",
                             "choices": [8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]}}},
        "fixed_flags": {"max_model_len": 4096}, "budget": {"trials": 10, "parallel": 1},
        "backend": "replay", "replay_file": str(landscape), "sampler": "random", "seed": 3,
        "baseline_trial": False,
        "tracking": {"mlflow_uri": mlflow_server, "experiment": "exp-screened"},
        "storage": {"optuna_url": f"sqlite:///{tmp_path}/optuna.db"},
        "output": {"runs_dir": str(tmp_path), "dataset_dir": str(tmp_path / "dataset")},
    }, cwd=tmp_path)
    assert spec.multi_fidelity_on("replay")
    seen: dict[int, TrialResult] = {}
    outcome = run_study(spec, out=io.StringIO(), on_result=lambda n, f, r: seen.__setitem__(n, r))
    assert outcome.trials_done == 10
    study = optuna.load_study(study_name="screened", storage=spec.storage.optuna_url)
    screened = [t for t in study.get_trials(deepcopy=False) if t.user_attrs["cause"].startswith("sim_screen")]
    assert screened, [t.user_attrs["cause"] for t in study.get_trials(deepcopy=False)]
    for t in screened:
        assert t.user_attrs["status"] == "pruned" and all(c > 0 for c in t.constraints.values())
        assert set(t.user_attrs["sim_prediction"]) == {"output_throughput", "preemptions"}
        assert not seen[t.number].gpu_ids  # never dispatched
    assert len(screened) <= 5  # at most half of the proposals

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("exp-screened")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`servetune.prescreen` = 'sim_screen'")
    assert len(runs) == len(screened)
    assert all(float(r.data.tags["servetune.predicted_output_throughput"]) > 0 for r in runs)
    df = dataset.read_trials(tmp_path / "dataset", study="screened")
    rows = df[df["sim_screen"].notna()]
    assert len(rows) == len(screened) and (rows["predicted_output_throughput"] > 0).all()

    # Resumed with a larger budget: the screen recalibrates from the measured trials and goes on.
    more = dataclasses.replace(spec, budget=dataclasses.replace(spec.budget, trials=14))
    resumed = run_study(more, out=io.StringIO(), resume=True)
    assert resumed.trials_done == 14


def test_the_studys_first_real_trial_measures_the_host_for_the_screen(tmp_path: Path) -> None:
    """A replayed study whose recorded trials paid 1.5x the simulated API-server CPU (a slow host):
    the driver reads the factor off its first trial, says so, and the screen simulates with it."""
    from servetune.search.screen import simulate_flags

    base = {
        "name": "host", "model": "llama-3.1-8b", "gpu": {"type": "H200", "count": 1},
        "workload": {"input_len": 256, "output_len": 512, "num_requests": 96, "concurrency": 48, "seed": 0},
        "objective": {"metric": "output_throughput"}, "constraints": {"max_preemptions": 0},
        "search_space": {"params": {"max_num_seqs": {"type": "categorical", "choices": [16, 32, 48]}}},
        "fixed_flags": {"max_model_len": 2048}, "budget": {"trials": 3, "parallel": 1}, "sampler": "grid",
        "seed": 0, "baseline_trial": False, "prescreen": False, "warm_start": False,
        "storage": {"optuna_url": f"sqlite:///{tmp_path}/optuna.db"},
        "output": {"runs_dir": str(tmp_path), "dataset_dir": str(tmp_path / "dataset")},
    }
    sim_spec = StudySpec.from_dict({**base, "backend": "sim"}, cwd=tmp_path)
    rows = []
    for seqs in (16, 32, 48):  # the "real" host: the simulator's figures, its API server 1.5x slower
        flags = {"max_model_len": 2048, "max_num_seqs": seqs}
        r = simulate_flags(sim_spec, flags)
        r.api_server_cpu_s = 1.5 * (r.api_server_cpu_s or 0.0)
        rows.append(dataset.trial_row("recorded", seqs, flags, r, "H200", "llama-3.1-8b"))
    landscape = tmp_path / "landscape.parquet"
    pd.DataFrame(rows).to_parquet(landscape)
    spec = StudySpec.from_dict({**base, "backend": "replay", "replay_file": str(landscape), "multi_fidelity": True},
                               cwd=tmp_path)
    out = io.StringIO()
    run_study(spec, out=out)
    assert "this host's vLLM API server costs 1.50x the simulator's calibration (trial #0" in out.getvalue()
