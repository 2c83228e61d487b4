"""TrialRecord: built once, its codecs give the MLflow tags and the Parquet row."""

from __future__ import annotations

from servetune.records import Prediction, Screen, TrialRecord
from servetune.result import LatencySummary, TrialResult, TrialStatus


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


def test_the_run_description_leads_with_what_happened_and_the_deciding_figures() -> None:
    pruned = _record(TrialResult(TrialStatus.PRUNED, cause="predicted startup_oom: weights do not fit"),
                     prediction=Prediction("startup_oom", 61.2, "raise gpu_memory_utilization to 0.6"))
    note = pruned.mlflow_tags()["mlflow.note.content"]
    assert note.splitlines()[0] == "**Trial #7: pruned before launch**: predicted startup_oom: weights do not fit"
    assert "Fix: raise gpu_memory_utilization to 0.6" in note and "no GPU time spent" in note
    # A served trial with no ITL measured (one output token) says so instead of printing nan.
    served = _record(TrialResult(TrialStatus.OK, output_throughput=2238.6, preemptions=3, kv_cache_tokens=179440,
                                 ttft_ms=LatencySummary(1.0, 1.0, 1.0, 53318.0), completed=10, failed=0))
    first = served.headline().splitlines()[0]
    assert first == ("**Trial #7: served, preempted**: 2,239 output tok/s, 3 preemptions, p99 TTFT 53,318 ms, "
                     "p99 ITL not measured, KV cache 179,440 tokens")
    assert "nan" not in served.headline()
