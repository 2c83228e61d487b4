"""StudyTracker against a real MLflow server: runs, params, metrics, tags, artifacts, resume.

The tracker writes what it is handed: secrets are redacted once, before it, by the study's
recorder (tests/test_secrets.py)."""

from __future__ import annotations

import json
import shlex
import socket
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from mlflow import MlflowClient

from servetune.records.dataset import METRIC_COLUMNS
from servetune.errors import SpecError
from servetune.planner.flags import FLAGS as FLAG_REGISTRY
from servetune.planner.flags import to_cli_args
from servetune.result import LatencySummary, MemoryBreakdown, RequestRecord, TrialResult, TrialStatus, summarize
from servetune.records.tracking import (
    MAX_TAG_VALUE, TAG_CAUSE, TAG_PARENT, TAG_ROLE, TAG_STATUS, TAG_STUDY, TAG_TRIAL_NUMBER, TAG_VLLM_VERSION,
    StudyTracker, TrackingError,
)
from servetune.redact import is_secret_key, redact, redact_text

pytestmark = pytest.mark.slow

#: Text redaction would change (a user name in a URL: free text loses the whole user info), handed
#: over as the recorder decided: the tracker must write it as it is, not redact it a second time.
NOTES = "connect as https://reader@hub.example/m"
MODEL = "org/llama-852m"


def _ok_result() -> TrialResult:
    records = [
        RequestRecord(i, 512, 64, arrival_s=0.1 * i, first_token_s=0.1 * i + 0.05, finish_s=0.1 * i + 0.05 + 63 * 0.01,
                      itl_s=tuple([0.01] * 63))
        for i in range(4)
    ]
    records.append(RequestRecord(4, 512, 0, 0.5, None, None, error="HTTP 500 while using ***"))
    s = summarize(records, duration_s=1.25)
    return TrialResult(
        status=TrialStatus.OK, backend="sim", vllm_version="0.26.0", preemptions=0, kv_cache_usage_peak=0.42,
        kv_cache_usage_mean=0.21, memory=MemoryBreakdown(139.8, 69.9, 1.59, 1.2, 0.4, 0.35, 66.36),
        kv_cache_tokens=2174688, num_gpu_blocks=135918, max_concurrency=265.5, startup_s=31.5, wall_s=48.25,
        requests=records, log_text="INFO engine started\nHF_TOKEN=*** pw=***\nINFO ready\n",
        evidence=["ray_accelerator_type=H200", "ray_gpu_ids=[0]"], **{k: v for k, v in s.items()},
    )


def _oom_result() -> TrialResult:
    cause = "ValueError: No available memory for the cache blocks. " + "x" * (MAX_TAG_VALUE + 500)
    return TrialResult(
        status=TrialStatus.STARTUP_OOM, cause=cause, backend="sim", vllm_version="0.26.0",
        memory=MemoryBreakdown(139.8, 1.68, 1.59, 1.2, 0.4, 0.0, 0.0), startup_s=12.0, wall_s=12.5,
        log_text="ERROR No available memory for the cache blocks\n",
    )


def _preempting_result() -> TrialResult:
    lat = LatencySummary(mean=120.0, p50=100.0, p90=250.0, p99=400.5)
    return TrialResult(
        status=TrialStatus.OK, backend="sim", vllm_version="0.26.0", duration_s=10.0, completed=256, failed=0,
        output_throughput=9876.5, total_token_throughput=50000.25, request_throughput=25.6, ttft_ms=lat,
        itl_ms=lat, tpot_ms=lat, e2e_ms=lat, preemptions=12, kv_cache_usage_peak=1.0, kv_cache_usage_mean=0.93,
        kv_cache_tokens=65536, num_gpu_blocks=4096, max_concurrency=8.0, startup_s=20.0, wall_s=35.0,
    )


FLAGS: list[dict[str, Any]] = [
    {"gpu_memory_utilization": 0.5, "max_num_seqs": 64, "enforce_eager": False, "kv_cache_dtype": "auto"},
    {"gpu_memory_utilization": 0.012, "max_num_seqs": 256, "enforce_eager": True,
     "cudagraph_capture_sizes": [1, 2, 4, 8]},
    {"gpu_memory_utilization": 0.5, "max_num_seqs": 128, "num_gpu_blocks_override": 4096},
]
RESULTS = [_ok_result(), _oom_result(), _preempting_result()]


@pytest.fixture(scope="module")
def logged_study(mlflow_server: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One study, three trials, finished: the state every test below reads back."""
    files = {"metrics_after.txt": b"vllm:num_preemptions_total 0\n# token ***\n",
             "deeper/blob.bin": b"\x00\xff\x10binary"}
    tracker = StudyTracker(mlflow_server, "servetune-test")
    parent = tracker.start_study(
        "study-a", params={"objective": "output_throughput", "budget": {"trials": 3}, "hf_token": "***", "notes": NOTES},
        tags={"gpu_type": "H200", "model": MODEL, "owner_token": "***"},
    )
    workload = {"input_len": 512, "output_len": 64, "num_requests": 5, "concurrency": 4,
                "dataset_url": "https://***@hub.example/data"}
    children = [
        tracker.log_trial(i, FLAGS[i], RESULTS[i], tags={"sampler": "tpe", "note": NOTES},
                          files=files if i == 0 else None, workload=workload)
        for i in range(3)
    ]
    from servetune.records.report import plot_history

    trials = pd.DataFrame({
        "trial_number": [0, 1, 2], "status": ["ok", "startup_oom", "ok"],
        "output_throughput": [RESULTS[0].output_throughput, None, 9876.5], "preemptions": [0.0, None, 12.0],
        "flag_max_num_seqs": [64, 256, 128], "cause": [None, "see ***", None],
    })
    tracker.finish_study(FLAGS[0], MODEL, trials, {"history": plot_history(trials), "again.png": plot_history(trials)},
                         {"best_output_throughput": float(RESULTS[0].output_throughput or 0), "best_trial": 0.0},
                         files={"headroom.json": json.dumps({"note": NOTES})})
    tracker.end("FINISHED")
    return {"uri": mlflow_server, "parent": parent, "children": children, "experiment_id": tracker.experiment_id}


def test_parent_and_nested_children(logged_study: dict[str, Any]) -> None:
    client = MlflowClient(logged_study["uri"])
    parent = client.get_run(logged_study["parent"])
    assert parent.info.status == "FINISHED"
    assert parent.info.run_name == "study-a"
    assert parent.data.tags[TAG_STUDY] == "study-a" and parent.data.tags[TAG_ROLE] == "study"
    assert parent.data.params["objective"] == "output_throughput"
    assert parent.data.params["budget.trials"] == "3"
    assert parent.data.metrics["best_trial"] == 0.0
    assert parent.data.tags["servetune.best_command"].startswith("vllm serve org/llama-852m ")

    runs = client.search_runs([logged_study["experiment_id"]],
                              filter_string=f"tags.`{TAG_PARENT}` = '{logged_study['parent']}'",
                              order_by=["tags.`servetune.trial_number` ASC"])
    assert [r.info.run_id for r in runs] == logged_study["children"]
    assert [r.info.run_name for r in runs] == ["trial-000", "trial-001", "trial-002"]
    assert [r.info.status for r in runs] == ["FINISHED", "FAILED", "FINISHED"]
    assert [r.data.tags[TAG_STATUS] for r in runs] == ["ok", "startup_oom", "ok"]
    for i, run in enumerate(runs):
        tags = run.data.tags
        assert tags[TAG_TRIAL_NUMBER] == str(i)
        assert tags[TAG_ROLE] == "trial" and tags[TAG_STUDY] == "study-a"
        assert tags["gpu_type"] == "H200" and tags["model"] == MODEL  # inherited from the study tags
        assert tags[TAG_VLLM_VERSION] == "0.26.0" and tags["servetune.backend"] == "sim"
        assert tags["sampler"] == "tpe"
    cause = runs[1].data.tags[TAG_CAUSE]
    assert len(cause) == MAX_TAG_VALUE and cause.startswith("ValueError: No available memory")
    assert cause.endswith("[truncated]")
    assert TAG_CAUSE not in runs[0].data.tags


def test_params_and_metrics_exact(logged_study: dict[str, Any]) -> None:
    client = MlflowClient(logged_study["uri"])
    for run_id, flags, result in zip(logged_study["children"], FLAGS, RESULTS):
        data = client.get_run(run_id).data
        flag_params = {k: v for k, v in data.params.items() if not k.startswith("workload.")}
        assert flag_params == {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in flags.items()}
        assert data.params["workload.input_len"] == "512"
        assert data.params["workload.concurrency"] == "4"
        assert data.metrics == result.metrics()  # exact floats, every metric, nothing else
    oom = client.get_run(logged_study["children"][1]).data
    assert oom.params["cudagraph_capture_sizes"] == "[1, 2, 4, 8]"
    assert oom.params["enforce_eager"] == "true"
    assert oom.metrics["mem_budget_gib"] == 1.68 and oom.metrics["mem_kv_cache_gib"] == 0.0
    assert "output_throughput" not in oom.metrics
    preempt = client.get_run(logged_study["children"][2]).data
    assert preempt.metrics["preemptions"] == 12.0
    assert preempt.metrics["ttft_p99_ms"] == 400.5 and preempt.metrics["kv_cache_usage_peak"] == 1.0
    ok = client.get_run(logged_study["children"][0]).data
    assert ok.metrics["completed"] == 4.0 and ok.metrics["failed"] == 1.0
    assert ok.metrics["mem_weights_gib"] == 1.59 and ok.metrics["kv_cache_tokens"] == 2174688.0


def test_trial_artifacts(logged_study: dict[str, Any], tmp_path: Path) -> None:
    client = MlflowClient(logged_study["uri"])
    ok_id = logged_study["children"][0]
    names = {f.path for f in client.list_artifacts(ok_id)}
    assert {"engine.log", "requests.parquet", "result.json", "files"} <= names
    local = Path(client.download_artifacts(ok_id, "", str(tmp_path)))
    log = (local / "engine.log").read_text()
    assert log.startswith("INFO engine started\n") and "INFO ready" in log
    requests = pq.read_table(local / "requests.parquet").to_pandas()
    assert requests["request_id"].tolist() == [0, 1, 2, 3, 4]
    assert requests["ttft_ms"].iloc[:4].round(6).tolist() == [50.0] * 4
    assert len(requests["itl_s"].iloc[0]) == 63 and requests["error"].iloc[4].startswith("HTTP 500")
    assert (local / "files" / "deeper" / "blob.bin").read_bytes() == b"\x00\xff\x10binary"
    assert (local / "files" / "metrics_after.txt").read_text() == "vllm:num_preemptions_total 0\n# token ***\n"
    summary = json.loads((local / "result.json").read_text())
    assert summary["status"] == "ok" and summary["output_throughput"] == RESULTS[0].output_throughput
    # where the trial ran (the cluster tests read the Ray node and GPU ids from it), as handed over
    assert summary["evidence"] == ["ray_accelerator_type=H200", "ray_gpu_ids=[0]"]
    oom_log = Path(client.download_artifacts(logged_study["children"][1], "engine.log", str(tmp_path / "oom")))
    assert oom_log.read_text() == "ERROR No available memory for the cache blocks\n"


def test_study_artifacts(logged_study: dict[str, Any], tmp_path: Path) -> None:
    client = MlflowClient(logged_study["uri"])
    local = Path(client.download_artifacts(logged_study["parent"], "", str(tmp_path)))
    config = yaml.safe_load((local / "best_config.yaml").read_text())
    assert config == {"model": MODEL, "gpu-memory-utilization": 0.5, "max-num-seqs": 64, "enforce-eager": False,
                      "kv-cache-dtype": "auto"}
    command = (local / "best_command.txt").read_text().strip()
    assert command.startswith("vllm serve ")
    assert shlex.split(command) == ["vllm", "serve", MODEL, *to_cli_args(FLAGS[0])]
    csv = pd.read_csv(local / "trials.csv")
    parquet = pd.read_parquet(local / "trials.parquet")
    assert csv["trial_number"].tolist() == [0, 1, 2] == parquet["trial_number"].tolist()
    assert list(parquet.columns) == ["trial_number", "status", "output_throughput", "preemptions",
                                     "flag_max_num_seqs", "cause"]  # the table as handed over
    assert parquet["cause"].iloc[1] == "see ***"
    assert json.loads((local / "headroom.json").read_text()) == {"note": NOTES}
    assert sorted(p.name for p in (local / "plots").iterdir()) == ["again.png", "history.png"]
    png = local / "plots" / "history.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_the_tracker_writes_what_it_is_handed(logged_study: dict[str, Any], tmp_path: Path) -> None:
    """No second redaction: masked text stays as the recorder made it, and the tracker's own error
    lines are the only place it redacts (they name the MLflow URI)."""
    client = MlflowClient(logged_study["uri"])
    parent = client.get_run(logged_study["parent"]).data
    assert parent.params["hf_token"] == "***" and parent.params["notes"] == NOTES
    assert parent.tags["owner_token"] == "***"
    child = client.get_run(logged_study["children"][0]).data
    assert child.params["workload.dataset_url"] == "https://***@hub.example/data"
    assert child.tags["note"] == NOTES and child.tags["owner_token"] == "***"
    local = Path(client.download_artifacts(logged_study["children"][0], "", str(tmp_path)))
    assert (local / "engine.log").read_text() == RESULTS[0].log_text
    requests = pq.read_table(local / "requests.parquet").to_pandas()
    assert requests["error"].iloc[4] == "HTTP 500 while using ***"


def test_resume_reuses_parent_and_kills_stale_children(mlflow_server: str) -> None:
    first = StudyTracker(mlflow_server, "servetune-resume")
    parent = first.start_study("study-r", {"objective": "output_throughput", "budget.trials": 4}, {"gpu_type": "H200"})
    done = first.log_trial(0, {"max_num_seqs": 64}, _preempting_result(), tags={})
    client = MlflowClient(mlflow_server)
    # What a driver that died mid-trial leaves behind: a child run that never ended.
    stale = client.create_run(first.experiment_id, run_name="trial-001",
                              tags={TAG_PARENT: parent, TAG_STUDY: "study-r", TAG_ROLE: "trial"}).info.run_id

    with pytest.raises(SpecError, match="study.name.*already has MLflow run"):
        StudyTracker(mlflow_server, "servetune-resume").start_study("study-r", {}, {})

    second = StudyTracker(mlflow_server, "servetune-resume")
    again = second.start_study("study-r", {"objective": "output_throughput", "budget.trials": 8, "seed": 1},
                               {"gpu_type": "H200"}, resume=True)
    assert again == parent
    assert client.get_run(parent).info.status == "RUNNING"
    assert client.get_run(stale).info.status == "KILLED"
    assert "servetune.swept" in client.get_run(stale).data.tags
    assert client.get_run(done).info.status == "FINISHED"
    params = client.get_run(parent).data.params
    assert params["budget.trials"] == "4" and params["seed"] == "1"  # first values kept, new keys added
    second.log_trial(1, {"max_num_seqs": 96}, _ok_result(), tags={})
    second.end("KILLED")
    assert client.get_run(parent).info.status == "KILLED"
    children = client.search_runs([first.experiment_id], filter_string=f"tags.`{TAG_PARENT}` = '{parent}'")
    assert sorted(r.info.run_name for r in children) == ["trial-000", "trial-001", "trial-001"]


def test_unreachable_server_is_a_clear_error() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(TrackingError, match=f"MLflow tracking server at {uri} is unreachable"):
        StudyTracker(uri, "x", connect_timeout_s=2)


def test_log_before_start_is_refused(mlflow_server: str) -> None:
    tracker = StudyTracker(mlflow_server, "servetune-test")
    with pytest.raises(RuntimeError, match="start_study"):
        tracker.log_trial(0, {}, _oom_result(), tags={})
    parent = tracker.start_study("study-end", {}, {})
    with pytest.raises(SpecError, match="status"):
        tracker.end("DONE")
    # No trial succeeded: the outcome has a table and metrics but no best config or command.
    tracker.finish_study(None, MODEL, pd.DataFrame({"trial_number": [0], "status": ["startup_oom"]}), {},
                         {"trials_failed": 1.0})
    tracker.end("FAILED")
    client = MlflowClient(mlflow_server)
    run = client.get_run(parent)
    assert run.info.status == "FAILED" and run.data.metrics == {"trials_failed": 1.0}
    assert sorted(f.path for f in client.list_artifacts(parent)) == ["trials.csv", "trials.parquet"]


def test_redact_rules() -> None:
    env = {"HF_TOKEN": "hf_abcdefgh1234", "DB_PASSWORD": "pa55word!", "PATH": "/usr/bin", "SHORT_KEY": "abc"}
    assert [is_secret_key(k) for k in ("HF_TOKEN", "token", "api_key", "client_secret_v2", "Password",
                                       "AWS_ACCESS_KEY_ID", "max_num_batched_tokens", "kv_cache_tokens",
                                       "block_size", "monkey")] == [True] * 6 + [False] * 4
    assert redact({"a": "uses pa55word! and hf_abcdefgh1234", "n": 3, "flag": True, "nested": {"x_token": "v"},
                   "urls": ["redis://:pw@h:6379/0"]}, environ=env) == {
        "a": "uses *** and ***", "n": 3, "flag": True, "nested": {"x_token": "***"}, "urls": ["redis://***@h:6379/0"]}
    assert redact_text("path /usr/bin and abc stay", environ=env) == "path /usr/bin and abc stay"
    assert redact_text("Authorization: Bearer eyJhbGciOi.abc", environ={}) == "Authorization: ***"
    # No vLLM flag or trial metric name may be mistaken for a secret (they would be masked).
    assert not [k for k in [*FLAG_REGISTRY, *METRIC_COLUMNS] if is_secret_key(k)]
