"""Which requests the batch after an idle engine's first one holds, with async scheduling.

vLLM's engine core drains its input queue before every call of its step function
(``run_busy_loop``: ``vllm/v1/engine/core.py:954-956`` and the drain ``:980-983@v0.14.1``;
``:1362-1364``, ``:1394-1396@v0.26.0``), and with a free slot in the batch queue that call schedules a
batch, submits it without blocking and returns (``step_with_batch_queue``: the schedule at
``:438@v0.14.1`` / ``:645@v0.26.0``, the early return at ``:473@v0.14.1`` / ``:679@v0.26.0``). So
after an idle engine's first batch, the next is drained once that batch was scheduled and submitted,
the step's engine CPU later, not at the instant the first one formed (the simulator's rule before
2026-12-06): a request that reached the engine core meanwhile joins the second batch. In a busy loop
the next drain follows the wait for the step before's output, so a batch holds what entered by the
step before's start, as before. Read in vLLM's source after the held-out gpt-oss-120b first bursts'
TTFTs were seen (their real first-use compile stall came before the first tokens).
"""

from __future__ import annotations

import pytest

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.sim import SimScheduler, with_calibration

GPU = get_gpu("H200")
MODEL = load_model("servetune-test-850m")


def scheduler(async_scheduling: bool = True) -> SimScheduler:
    cfg = resolve_engine_config({"max_num_batched_tokens": 4096, "max_num_seqs": 16,
                                 "async_scheduling": async_scheduling}, MODEL, GPU)
    return SimScheduler(MODEL, GPU, cfg, num_gpu_blocks=4000)


def scheduled_in(s: SimScheduler, steps: int) -> list[set[str]]:
    return [set(s.step().new_tokens) for _ in range(steps)]


def test_a_request_entering_while_the_first_batch_is_scheduled_joins_the_second() -> None:
    s = scheduler()
    lag = s.perf.engine_cpu_s(1)
    assert 0.002 < lag < 0.003  # the H200 calibration's step CPU: 2.4 ms and 11 us a request
    s.add_request("a", 4000, 4, arrival_s=0.0)
    s.add_request("b", 64, 4, arrival_s=0.0)  # the API server enters it a pass after "a", well within the lag
    steps = scheduled_in(s, 3)
    assert steps[0] == {"a"} and "b" in steps[1], steps
    assert s.request("b").first_step == 1


def test_one_entering_after_that_waits_for_the_batch_after_as_before() -> None:
    s = scheduler()
    s.add_request("a", 4000, 4, arrival_s=0.0)
    first = s.step()
    assert first.duration_s > 2 * s.perf.engine_cpu_s(1)  # room for an entry past the lag, inside the step
    s2 = scheduler()
    s2.add_request("a", 4000, 4, arrival_s=0.0)
    late = first.start_s + s2.perf.engine_cpu_s(1) + 0.25 * (first.duration_s - s2.perf.engine_cpu_s(1))
    s2.add_request("b", 64, 4, arrival_s=late)
    steps = scheduled_in(s2, 3)
    assert steps[0] == {"a"} and "b" not in steps[1] and "b" in steps[2], steps


def test_without_async_scheduling_the_next_batch_takes_what_entered_by_its_own_start() -> None:
    s = scheduler(async_scheduling=False)
    s.add_request("a", 4000, 4, arrival_s=0.0)
    first = s.step()
    s2 = scheduler(async_scheduling=False)
    s2.add_request("a", 4000, 4, arrival_s=0.0)
    s2.add_request("b", 64, 4, arrival_s=first.start_s + 0.75 * first.duration_s)
    steps = scheduled_in(s2, 2)
    assert steps[0] == {"a"} and "b" in steps[1], steps


def test_an_idle_gpus_first_step_pays_its_whole_engine_cpu_with_async_scheduling() -> None:
    """The step scheduled while the GPU has none of its own hides none of its engine CPU: vLLM 0.26.0's
    ``step_with_batch_queue`` schedules and submits it on the core's thread before its kernels start
    (``v1/engine/core.py:644-679``; ``UniProcExecutor.collective_rpc`` runs ``execute_model`` inline,
    ``v1/executor/uniproc_executor.py:97-106``) and updates from its output after they end (``:688-705``).
    A step behind another keeps hiding ``async_overlap`` of it; without async scheduling nothing changes.
    Read after the one-request windows' TTFT misses (Calibration.idle_step_cpu); nothing fitted."""
    def two_steps(async_scheduling: bool, rule: float) -> list[float]:
        gpu = with_calibration(GPU, {"idle_step_cpu": rule})
        cfg = resolve_engine_config({"max_num_batched_tokens": 4096, "max_num_seqs": 16,
                                     "async_scheduling": async_scheduling}, MODEL, gpu)
        s = SimScheduler(MODEL, gpu, cfg, num_gpu_blocks=4000)
        s.add_request("a", 4000, 3, arrival_s=0.0)  # a prefill longer than the step's CPU
        return [s.step().duration_s, s.step().duration_s]

    perf = scheduler().perf
    hidden = perf.engine_cpu_s(1) * perf.calibration.async_overlap
    (idle, behind), (before, behind_before) = two_steps(True, 1.0), two_steps(True, 0.0)
    assert idle - before == pytest.approx(hidden, abs=1e-12) and 0.002 < hidden < 0.0021
    assert behind == behind_before  # a step behind another hides as before
    assert two_steps(False, 1.0) == two_steps(False, 0.0)
