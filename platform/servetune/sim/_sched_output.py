"""What one step of the engine core decides and reports: the types :mod:`servetune.sim.scheduler` hands on.

Contract: :class:`SchedulerOutput` is ``SimScheduler.schedule()``'s frozen decision for one step,
before it runs; :class:`StepResult` is what ``SimScheduler.step()`` reports once it ran;
:class:`Tally` holds the running sums of a batch being formed (each scheduling phase adds its own
once), the inputs of :meth:`servetune.sim.perf.PerfModel.step_time`; :class:`Prompts` reads the
prompt lengths of a step's sampled requests for the API server. Data only, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servetune.sim.request import SimRequest

__all__ = ["SchedulerOutput", "StepResult", "Tally", "Prompts"]


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What ``schedule()`` decided for one step, before it runs (vLLM's ``SchedulerOutput``).

    ``scheduled``: (request, tokens computed this step) in batch order; ``sampled``: the requests
    whose whole sequence is computed by this step, so it samples one token for each;
    ``preempted``: the requests sent back to WAITING. The work figures are
    :meth:`servetune.sim.perf.PerfModel.step_time`'s inputs; ``prefill_*`` is the share of
    ``kv_context`` / ``attn_work`` that prefill chunks take. ``kv_usage`` is the pool's usage
    once the step's blocks are allocated.
    """

    step_no: int
    scheduled: list[tuple[SimRequest, int]]
    sampled: list[SimRequest]
    preempted: list[SimRequest]
    num_reqs: int
    num_tokens: int
    kv_context: int
    attn_work: int
    prefill_tokens: int
    prefill_context: int
    prefill_attn: int
    kv_usage: float


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one engine step did."""

    start_s: float
    duration_s: float
    new_tokens: dict[str, int]  # request id -> output tokens produced in this step (0/1 without spec decoding)
    finished: list[str]
    preempted: list[str]
    prefill_tokens: int
    decode_tokens: int


class Tally:
    """The running sums of a batch being formed (each scheduling phase adds its own once)."""

    __slots__ = ("budget", "num_reqs", "num_tokens", "kv_context", "attn_work", "prefill_tokens",
                 "prefill_context", "prefill_attn")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_reqs = self.num_tokens = self.kv_context = self.attn_work = 0
        self.prefill_tokens = self.prefill_context = self.prefill_attn = 0


class Prompts(Sequence[int]):
    """The prompt tokens of a step's sampled requests, read from them where needed."""

    __slots__ = ("_reqs",)

    def __init__(self, reqs: list[SimRequest]) -> None:
        self._reqs = reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._reqs[i].prompt

    def __iter__(self) -> Iterator[int]:
        return (r.prompt for r in self._reqs)
