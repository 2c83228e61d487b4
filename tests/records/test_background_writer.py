"""The driver's MLflow writes delivered by a writer thread: in order, all of them by the end of the
study, a refusal raised to the driver, nothing left running (real MLflow store, real threads)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from servetune.records._writer import BackgroundWriter
from servetune.records.tracking import TAG_ROLE, TAG_TRIAL_NUMBER, StudyTracker, TrackingError
from servetune.result import RequestRecord, TrialResult, TrialStatus, summarize

WRITER = "servetune-mlflow-writer"


def _until(condition, what: str, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WRITER]


def _result(number: int) -> TrialResult:
    records = [RequestRecord(i, 256, 8, 0.1 * i, 0.1 * i + 0.02, 0.1 * i + 0.09, itl_s=tuple([0.01] * 7))
               for i in range(3)]
    return TrialResult(status=TrialStatus.OK if number % 2 == 0 else TrialStatus.STARTUP_OOM, backend="sim",
                       vllm_version="0.26.0", preemptions=0, requests=records, log_text=f"trial {number}\n",
                       wall_s=1.0, **dict(summarize(records, duration_s=1.0)))


def _tracker(tmp_path: Path, **kwargs: object) -> StudyTracker:
    return StudyTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "exp", buffer_dir=tmp_path / "buffer",
                        artifact_location=(tmp_path / "artifacts").as_uri(), **kwargs)  # type: ignore[arg-type]


def test_the_writer_runs_a_pass_per_hand_over_keeps_its_error_once_and_ends_when_idle() -> None:
    passes: list[int] = []
    outcomes = iter([True, False, True])  # the second pass leaves something: tried again unwoken

    def drain() -> bool:
        passes.append(len(passes))
        if len(passes) == 4:
            raise RuntimeError("refused")
        return next(outcomes, True)

    writer = BackgroundWriter(drain, name="test-writer", retry_s=0.05, idle_exit_s=0.5)
    writer.wake()
    assert writer.settle(timeout_s=10) and passes == [0]
    writer.wake()
    _until(lambda: len(passes) >= 3, "the pass that left something was not tried again")
    assert writer.settle(timeout_s=10) and writer.take_error() is None
    writer.wake()
    assert writer.settle(timeout_s=10)
    error = writer.take_error()
    assert isinstance(error, RuntimeError) and str(error) == "refused"
    assert writer.take_error() is None  # handed to the driver once
    _until(lambda: not [t for t in threading.enumerate() if t.name == "test-writer"], "an idle writer kept running")
    writer.wake()  # a later hand-over starts a new thread
    assert writer.settle(timeout_s=10) and len(passes) == 5
    assert writer.stop(timeout_s=10)
    assert not [t for t in threading.enumerate() if t.name == "test-writer"]


def test_trials_handed_to_the_writer_are_all_in_mlflow_once_after_flush(tmp_path: Path) -> None:
    tracker = _tracker(tmp_path)
    parent = tracker.start_study("bg", {"objective": "output_throughput"}, {"gpu_type": "H200"})
    assert [tracker.log_trial(n, {"max_num_seqs": 16 * (n + 1)}, _result(n), tags={}) for n in range(4)] == [""] * 4
    tracker.settle()  # tried: with a live store, delivered
    client = MlflowClient(tracker.tracking_uri)
    children = client.search_runs([tracker.experiment_id], filter_string=f"tags.`{TAG_ROLE}` = 'trial'")
    assert sorted(int(r.data.tags[TAG_TRIAL_NUMBER]) for r in children) == [0, 1, 2, 3]
    assert sorted(r.info.status for r in children) == ["FAILED", "FAILED", "FINISHED", "FINISHED"]
    for run in children:
        assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"engine.log", "requests.parquet",
                                                                           "result.json"}
        assert run.data.params["max_num_seqs"] == str(16 * (int(run.data.tags[TAG_TRIAL_NUMBER]) + 1))
    tracker.log_trial(4, {"max_num_seqs": 80}, _result(4), tags={})
    tracker.end("FINISHED")
    assert tracker.flush(wait_s=10) == 0  # the writer ended, what it had not delivered delivered here
    assert not _writers()
    assert client.get_run(parent).info.status == "FINISHED"
    children = client.search_runs([tracker.experiment_id], filter_string=f"tags.`{TAG_ROLE}` = 'trial'")
    assert sorted(int(r.data.tags[TAG_TRIAL_NUMBER]) for r in children) == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "buffer").iterdir()) == [".staging"]
    assert list((tmp_path / "buffer" / ".staging").iterdir()) == []


def test_a_write_the_store_refuses_reaches_the_driver_and_is_kept(tmp_path: Path) -> None:
    tracker = _tracker(tmp_path)
    tracker.start_study("refused", {}, {})
    MlflowClient(tracker.tracking_uri).delete_experiment(tracker.experiment_id)  # runs refused from here on
    tracker.log_trial(0, {"max_num_seqs": 16}, _result(0), tags={})
    with pytest.raises(TrackingError, match="log the trial"):
        tracker.settle()
    tracker.settle()  # raised once
    rejected = tmp_path / "buffer" / "rejected"
    assert [p.name.split("-", 2)[-1] for p in rejected.iterdir()] == ["trial"]
    assert (next(rejected.iterdir()) / "artifacts" / "requests.parquet").is_file()  # nothing of it lost
    assert tracker.flush() == 0 and not _writers()


def test_without_a_buffer_every_write_is_made_before_its_call_returns(tmp_path: Path) -> None:
    tracker = StudyTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "exp", artifact_location=(tmp_path / "a").as_uri())
    tracker.start_study("direct", {}, {})
    run_id = tracker.log_trial(0, {"max_num_seqs": 16}, _result(0), tags={})
    assert MlflowClient(tracker.tracking_uri).get_run(run_id).info.status == "FINISHED"
    assert not _writers()
    with pytest.raises(ValueError, match="buffer_dir"):
        StudyTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "exp", background=True)
