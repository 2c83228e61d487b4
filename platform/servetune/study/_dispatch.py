"""The one dispatch loop: queue launches, submit them to the pool as its free GPUs allow (first come,
first served), wait, hand back what finished, stop on a signal. Ordinary trials, confirmation repeats,
the winner's edge window and the nightly's remeasure all run through :meth:`Dispatcher.run`; what
differs between them is their :class:`Work` (what to add, how to tell a result, when to end).

The loop's promises:

* nothing waits forever: each wait is bounded (``wait_s``), a queued launch that no slot can ever
  take (quarantined GPUs shrank the pool below it) leaves the queue through :meth:`Work.unfit`, and
  the stop request (:class:`StopRequest`) is checked every turn;
* a finished batch is told (:meth:`Work.tell`) before anything is written down: its writes (MLflow,
  dataset, ``on_result``) run after the next launches are on their way, and always, even when the
  telling failed (then each write that can be done is done; a ``--resume`` writes the rest).

Example:
    >>> class Pool:  # a pool of one GPU whose launches finish at once
    ...     total_gpus, free_gpus, done = 1, 1, []
    ...     def submit(self, key, task, backend, gpus): self.done.append((key, task))
    ...     def wait(self, timeout_s): out, self.done = self.done, []; return out
    >>> work = Collect()
    >>> dispatcher = Dispatcher(Pool(), "sim")  # type: ignore[arg-type]
    >>> for key in (1, 2):
    ...     dispatcher.add(Job(key, gpus=1, payload=None, task=lambda key=key: f"task {key}"))  # type: ignore
    >>> dispatcher.add(Job(3, gpus=2, payload=None, task=lambda: "too big"))  # type: ignore[arg-type]
    >>> dispatcher.run(work)
    >>> sorted(work.results.items()), work.unfit_keys
    ([(1, 'task 1'), (2, 'task 2')], [3])
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from servetune.cluster.base import Pool
from servetune.engines import TrialTask
from servetune.result import TrialResult

P = TypeVar("P")

#: A write that follows a told batch (a record, a callback): run after the next launches are submitted.
Write = Callable[[], None]


@dataclasses.dataclass
class Job(Generic[P]):
    """One launch: the pool's key, the GPUs it takes, the caller's ``payload`` (what the result
    belongs to), and its task, built when it is submitted (a trial's early-stop rule reads the best
    result so far then)."""

    key: int
    gpus: int
    payload: P
    task: Callable[[], TrialTask]


class Work(Generic[P]):
    """What one use of the loop adds to the queue and does with each result; every hook but
    :meth:`tell` has a default that adds nothing and ends when the queue is empty."""

    def refill(self, dispatcher: Dispatcher[P]) -> None:
        """Add launches (called every turn, and after a told batch when :meth:`more` allows)."""

    def unfit(self, job: Job[P]) -> None:
        """A queued launch no slot can take any more (the pool shrank below its GPUs): dropped."""

    def done(self) -> bool:
        """Nothing queued and nothing in flight: end the loop (True) or refill again (False)."""
        return True

    def before_wait(self, dispatcher: Dispatcher[P]) -> None:
        """Before each bounded wait (placement checks, the status line)."""

    def after_wait(self, dispatcher: Dispatcher[P]) -> None:
        """After each wait, before its results are told (the pool's notes)."""

    def tell(self, batch: list[tuple[Job[P], TrialResult]], writes: list[Write]) -> None:
        """Tell a finished batch; append what is to be written down after it to ``writes``."""
        raise NotImplementedError

    def more(self) -> bool:
        """After a told batch: add and submit the next launches before its writes?"""
        return True

    def after_batch(self, dispatcher: Dispatcher[P]) -> None:
        """After a batch was told and written (the status line)."""


class Collect(Work[Any]):
    """Work that keeps every result by its key (and the keys of the launches that never fit)."""

    def __init__(self) -> None:
        self.results: dict[int, TrialResult] = {}
        self.unfit_keys: list[int] = []

    def unfit(self, job: Job[Any]) -> None:
        self.unfit_keys.append(job.key)

    def tell(self, batch: list[tuple[Job[Any], TrialResult]], writes: list[Write]) -> None:
        for job, result in batch:
            self.results[job.key] = result


#: Set once a second signal stopped a study at once (:meth:`StopRequest._handle`): a library that caught the
#: KeyboardInterrupt raised there and raised its own error instead (Optuna's ``StorageInternalError`` from a
#: commit the interrupt cut) still ends the command as interrupted (:func:`interrupted_at_once`).
_STOPPED_AT_ONCE = threading.Event()


def interrupted_at_once() -> bool:
    """Whether a second SIGTERM / Ctrl-C interrupted a study of this process at once."""
    return _STOPPED_AT_ONCE.is_set()


class StopRequest:
    """SIGTERM (``ray job stop``, a scheduler) and Ctrl-C end a study at the next safe point: the
    trial being told finishes its Optuna/MLflow/dataset writes, running trials are stopped,
    finished ones kept. A second signal interrupts at once. Only the main thread may install
    handlers; elsewhere the study simply runs to its budget."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None  # the first signal received
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            _STOPPED_AT_ONCE.set()
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Dispatcher(Generic[P]):
    """The queue and the launches in flight on one pool, and the loop that runs them."""

    def __init__(self, pool: Pool, backend: str, stop: StopRequest | None = None, wait_s: float = 0.5) -> None:
        self.pool, self.backend, self.stop, self.wait_s = pool, backend, stop, wait_s
        self.queue: deque[Job[P]] = deque()
        self.inflight: dict[int, Job[P]] = {}

    def add(self, job: Job[P]) -> None:
        self.queue.append(job)

    @property
    def busy(self) -> int:
        """Launches queued or in flight."""
        return len(self.queue) + len(self.inflight)

    def keys(self) -> set[int]:
        """The keys of the launches queued or in flight."""
        return {*self.inflight, *(job.key for job in self.queue)}

    def submit_what_fits(self) -> None:
        while self.queue and self.queue[0].gpus <= self.pool.free_gpus:  # first come, first served
            job = self.queue.popleft()
            self.pool.submit(job.key, job.task(), self.backend, gpus=job.gpus)
            self.inflight[job.key] = job

    def _check(self) -> None:
        if self.stop is not None:
            self.stop.check()

    def run(self, work: Work[P]) -> None:
        """Refill, submit, wait and tell until the queue and the pool are empty and ``work`` is done."""
        while True:
            self._check()
            work.refill(self)
            self.submit_what_fits()
            while self.queue and self.queue[0].gpus > self.pool.total_gpus:
                work.unfit(self.queue.popleft())
            if not self.inflight and not self.queue:
                if work.done():
                    return
                continue
            self._collect(work)

    def _collect(self, work: Work[P]) -> None:
        """One bounded wait; the batch that finished is told, the next launches submitted, then its
        writes run (all of them, even when the telling failed)."""
        work.before_wait(self)
        finished = self.pool.wait(timeout_s=self.wait_s)
        work.after_wait(self)
        batch = [(self.inflight.pop(key), result) for key, result in finished]
        writes: list[Write] = []
        told = False
        try:
            work.tell(batch, writes)
            if batch and work.more():
                work.refill(self)
                self.submit_what_fits()
            told = True
        finally:
            for write in writes:
                if told:
                    write()
                else:  # already failing: write what can be written (a --resume writes the rest from Optuna)
                    with contextlib.suppress(Exception):
                        write()
        if batch:
            work.after_batch(self)
        self._check()
