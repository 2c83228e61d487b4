"""The driver's one dispatch loop (``servetune.study._dispatch``) on a real local trial pool running
simulated trials: first come, first served as GPUs free up; a launch no slot can take leaves the
queue instead of waiting forever; a told batch is written down after the next launch is on its
way, and even when telling it failed; a stop request ends the loop."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from servetune.cluster import LocalPool
from servetune.engines import TrialTask
from servetune.result import TrialResult, TrialStatus
from servetune.study._dispatch import Collect, Dispatcher, Job, StopRequest, Write
from servetune.workload import Workload

TASK = TrialTask(model="servetune-test-850m", gpu="H200", flags={"gpu_memory_utilization": 0.5, "max_num_seqs": 16},
                 workload=Workload.from_dict({"input_len": 128, "output_len": 16, "num_requests": 8,
                                              "concurrency": 4}))


@pytest.fixture
def pool() -> Iterator[LocalPool]:
    pool = LocalPool.start(num_gpus=2)
    yield pool
    pool.close()


class Recorded(Collect):
    """Collects results and notes the order the tasks were built in (built at submission)."""

    def __init__(self, tmp: Path) -> None:
        super().__init__()
        self.tmp, self.submitted = tmp, []

    def job(self, key: int, gpus: int) -> Job[None]:
        def build() -> TrialTask:
            self.submitted.append(key)
            return TrialTask(**{**TASK.__dict__, "log_dir": str(self.tmp / str(key))})
        return Job(key, gpus, None, build)


def test_first_come_first_served_and_a_launch_no_slot_fits_is_dropped(pool: LocalPool, tmp_path: Path) -> None:
    work = Recorded(tmp_path)
    dispatcher: Dispatcher[None] = Dispatcher(pool, "sim", wait_s=0.2)
    for key, gpus in ((1, 1), (2, 2), (3, 3), (4, 1)):
        dispatcher.add(work.job(key, gpus))
    dispatcher.run(work)
    # 4 fits beside 1 but waits behind 2 (first come, first served); 3 asks for more GPUs than the pool has.
    assert work.submitted == [1, 2, 4]
    assert work.unfit_keys == [3]
    assert sorted(work.results) == [1, 2, 4]
    assert all(r.status is TrialStatus.OK and r.output_throughput for r in work.results.values())
    assert not dispatcher.queue and not dispatcher.inflight and pool.free_gpus == 2


class WritesLater(Recorded):
    """Each told result's write notes which launches were in flight when it ran; ``fail_at`` makes
    the telling of that key raise after its write was queued."""

    def __init__(self, tmp: Path, dispatcher: Dispatcher[None], fail_at: int | None = None) -> None:
        super().__init__(tmp)
        self.dispatcher, self.fail_at = dispatcher, fail_at
        self.written: list[tuple[int, list[int]]] = []

    def tell(self, batch: list[tuple[Job[None], TrialResult]], writes: list[Write]) -> None:
        for job, result in batch:
            self.results[job.key] = result
            writes.append(lambda key=job.key: self.written.append((key, sorted(self.dispatcher.inflight))))
            if job.key == self.fail_at:
                raise RuntimeError(f"telling {job.key} failed")


def test_a_told_batch_is_written_after_the_next_launch_is_submitted(pool: LocalPool, tmp_path: Path) -> None:
    dispatcher: Dispatcher[None] = Dispatcher(pool, "sim", wait_s=0.2)
    work = WritesLater(tmp_path, dispatcher)
    for key in (1, 2, 3):
        dispatcher.add(work.job(key, 2))  # one at a time on two GPUs
    dispatcher.run(work)
    assert work.written == [(1, [2]), (2, [3]), (3, [])]


def test_a_write_runs_even_when_telling_its_batch_failed(pool: LocalPool, tmp_path: Path) -> None:
    dispatcher: Dispatcher[None] = Dispatcher(pool, "sim", wait_s=0.2)
    work = WritesLater(tmp_path, dispatcher, fail_at=1)
    for key in (1, 2):
        dispatcher.add(work.job(key, 2))
    with pytest.raises(RuntimeError, match="telling 1 failed"):
        dispatcher.run(work)
    assert work.written == [(1, [])]  # written; the next launch was not submitted after the failure
    assert work.submitted == [1] and [job.key for job in dispatcher.queue] == [2]


def test_a_stop_request_ends_the_loop_before_anything_is_submitted(pool: LocalPool, tmp_path: Path) -> None:
    stop = StopRequest()
    try:
        signal.raise_signal(signal.SIGTERM)  # handled: a request, not the end of the test process
        assert stop.requested and stop.signum == signal.SIGTERM
        dispatcher: Dispatcher[None] = Dispatcher(pool, "sim", stop=stop, wait_s=0.2)
        work = Recorded(tmp_path)
        dispatcher.add(work.job(1, 1))
        with pytest.raises(KeyboardInterrupt):
            dispatcher.run(work)
        assert work.submitted == [] and pool.running == []
    finally:
        stop.restore()
