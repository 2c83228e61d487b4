"""TrialRecord: built once, its codecs give the MLflow tags and the Parquet row."""

from __future__ import annotations

from servetune.records import Prediction, Screen, TrialRecord
from servetune.result import TrialResult, TrialStatus


def _record(result: TrialResult, **kind: object) -> TrialRecord:
    return TrialRecord("s", 7, {"max_num_seqs": 64}, result, -1.0, gpu_type="H200", model="m", backend="vllm",
                       vllm_version="0.26.0", **kind)  # type: ignore[arg-type]


def test_a_pruned_trial_carries_the_planners_prediction() -> None:
    rec = _record(TrialResult(TrialStatus.PRUNED, cause="oom"), origin="sampler",
                  prediction=Prediction("startup_oom", 61.23, "lower max_num_seqs"))
    tags, row = rec.mlflow_tags(), rec.dataset_row()
    assert tags["servetune.prescreen"] == "pruned" and tags["servetune.predicted_failure"] == "startup_oom"
    assert tags["servetune.predicted_startup_s"] == "61.2" and tags["servetune.predicted_fix"] == "lower max_num_seqs"
    assert tags["servetune.origin"] == "sampler" and tags["optuna.trial_number"] == "7"
    assert row["predicted_failure"] == "startup_oom" and row["origin"] == "sampler" and row["trial_number"] == 7


def test_a_screened_trial_keeps_the_simulated_figures_as_numbers() -> None:
    rec = _record(TrialResult(TrialStatus.PRUNED, cause="sim_screen: slower"),
                  screen=Screen("sim_screen: slower", 1234.56, 2.0))
    tags, row = rec.mlflow_tags(), rec.dataset_row()
    assert tags["servetune.prescreen"] == "sim_screen" and tags["servetune.predicted_output_throughput"] == "1234.6"
    assert row["predicted_output_throughput"] == 1234.6 and row["predicted_preemptions"] == 2.0
    assert "predicted_failure" not in row  # no planner prediction


def test_a_repeat_and_a_reconciled_trial_say_so() -> None:
    repeat = _record(TrialResult(TrialStatus.OK, backend="sim"), origin="repeat", repeat=2)
    assert repeat.mlflow_tags()["servetune.repeat"] == "2" and repeat.dataset_row()["repeat"] == 2
    assert repeat.trial_dir_name == "0007-repeat-2" and repeat.run_backend == "sim"
    reconciled = _record(TrialResult(TrialStatus.OK), reconciled=True)
    assert reconciled.mlflow_tags()["servetune.reconciled"] == "true" and "origin" not in reconciled.dataset_row()
