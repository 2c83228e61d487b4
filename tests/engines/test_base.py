"""The Engine contract: run_trial turns every failure into a result, and each backend has one engine."""

from __future__ import annotations

import pytest

from servetune.engines import BACKENDS, ENGINES, Engine, TrialTask, get_engine, run_trial
from servetune.errors import SpecError
from servetune.result import TrialResult, TrialStatus
from servetune.workload import Workload

TASK = TrialTask(model="servetune-test-850m", gpu="H200", flags={"max_num_seqs": 16},
                 workload=Workload.from_dict({"input_len": 64, "output_len": 16, "num_requests": 8, "concurrency": 4}))


class _Refuses(Engine):
    name = "refuses"

    def run(self, task: TrialTask) -> TrialResult:
        raise SpecError("max_num_seqs", "not this one", "pick another")


class _Crashes(Engine):
    name = "crashes"

    def run(self, task: TrialTask) -> TrialResult:
        raise RuntimeError("boom")


def test_every_backend_but_auto_has_one_engine() -> None:
    assert sorted(ENGINES) == sorted(b for b in BACKENDS if b != "auto")
    assert all(get_engine(name).name == name for name in ENGINES)
    with pytest.raises(SpecError):
        get_engine("auto")


def test_a_refusal_is_invalid_config_and_a_crash_is_crashed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ENGINES, "refuses", _Refuses())
    monkeypatch.setitem(ENGINES, "crashes", _Crashes())
    refused, crashed = run_trial(TASK, "refuses"), run_trial(TASK, "crashes")
    assert refused.status is TrialStatus.INVALID_CONFIG and "max_num_seqs" in (refused.cause or "")
    assert crashed.status is TrialStatus.CRASHED and crashed.cause == "RuntimeError: boom" and crashed.evidence
    assert refused.wall_s is not None and crashed.wall_s is not None
    assert run_trial(TASK, "no-such-backend").status is TrialStatus.INVALID_CONFIG


def test_the_sim_engine_serves_the_task() -> None:
    result = run_trial(TASK, "sim")
    assert result.status is TrialStatus.OK and result.backend == "sim" and result.completed == 8


def test_leader_repeats_are_due_only_when_the_window_leads_the_study() -> None:
    from servetune.engines import LeaderRepeats

    rule = LeaderRepeats(workloads=(TASK.workload,), log_dirs=(None,), best_throughput=1000.0, max_preemptions=0)
    leads = TrialResult(TrialStatus.OK, output_throughput=1000.0, preemptions=0)
    assert rule.due(leads)  # a tie with the best leads: it may win the confirmation
    assert not rule.due(TrialResult(TrialStatus.OK, output_throughput=999.0, preemptions=0))
    assert not rule.due(TrialResult(TrialStatus.OK, output_throughput=2000.0, preemptions=1))  # infeasible
    stopped = TrialResult(TrialStatus.OK, output_throughput=2000.0, preemptions=0, early_stopped="throughput: ...")
    assert not rule.due(stopped)
    assert not rule.due(TrialResult(TrialStatus.CRASHED, output_throughput=2000.0))
    first = LeaderRepeats(workloads=(TASK.workload,), log_dirs=(None,))  # nothing measured yet: any OK window leads
    assert first.due(TrialResult(TrialStatus.OK, output_throughput=1.0, preemptions=5))
