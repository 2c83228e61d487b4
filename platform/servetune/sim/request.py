"""One request inside the simulated engine core: its mutable state, and the snapshot tests read.

:class:`SimRequest` is what the scheduler, the block pool and the API server loop hand each other;
:class:`RequestState` is the frozen view :meth:`servetune.sim.scheduler.SimScheduler.request_state`
gives out.
"""

from __future__ import annotations

import dataclasses

__all__ = ["SimRequest", "RequestState"]


@dataclasses.dataclass(frozen=True)
class RequestState:
    """A snapshot of one request inside the scheduler (for tests and debugging)."""

    request_id: str
    status: str  # "pending" (sent, in the API server) | "waiting" | "running" | "finished"
    num_computed_tokens: int
    num_output_tokens: int
    num_blocks: int
    num_preemptions: int
    first_token_s: float | None
    finish_s: float | None


class SimRequest:
    """Mutable per-request state; ``__slots__`` because the hot loop touches it every step."""

    __slots__ = ("rid", "prompt", "max_tokens", "arrival", "computed", "total", "output", "nblk",
                 "shared", "group", "npb", "last_step", "run_start", "runs", "preemptions", "finish_step",
                 "status", "order", "dec", "swskip", "lastk", "lastn")

    def __init__(self, rid: str, prompt: int, max_tokens: int, arrival: float, group: int | None,
                 prefix_blocks: int, order: int) -> None:
        self.rid = rid
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.computed = 0  # tokens whose KV is computed
        self.total = prompt  # prompt + generated tokens (vLLM's num_tokens)
        self.output = 0
        self.nblk = 0  # KV blocks held (shared + private)
        self.shared: list[tuple[int, int | None, int]] = []  # cache keys of the first len(shared) blocks
        self.group = group
        self.npb = prefix_blocks  # full blocks of the group's shared prefix
        # The steps that produced its output tokens, as runs of consecutive steps (a request in
        # decode gets one token a step, so one run unless it was preempted or starved): the run
        # being extended is run_start..last_step, the closed ones are in ``runs`` (start, end, ...).
        self.last_step = -2  # none yet (never step_no - 1)
        self.run_start = -1
        self.runs: list[int] | None = None
        self.preemptions = 0
        self.finish_step = -1
        self.status = "pending"
        self.order = order
        # The step from which the scheduler advances it in bulk with the other decoding requests
        # (its counts then hold their values before that step); -1 while its counts are its own.
        self.dec = -1
        # A sliding-window hybrid's (blocks.KVGroups): the leading block-table entries its sliding
        # groups freed, and the step that last scheduled it with its tokens (in flight while the
        # next batch forms, with async scheduling).
        self.swskip = 0
        self.lastk = -2
        self.lastn = 0

    def note_token(self, step_no: int) -> None:
        """Step ``step_no`` produced an output token for this request (steps come in order)."""
        if self.last_step != step_no - 1:
            if self.last_step >= 0:
                if self.runs is None:
                    self.runs = []
                self.runs += (self.run_start, self.last_step)
            self.run_start = step_no
        self.last_step = step_no

    def token_runs(self) -> list[tuple[int, int]]:
        """The steps that produced its output tokens: ``(first, last)`` of each run, in order."""
        runs = self.runs or []
        out = [(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
        if self.last_step >= 0:
            out.append((self.run_start, self.last_step))
        return out

    @property
    def token_steps(self) -> list[int]:
        """The step that produced each output token, one per token (built on demand)."""
        return [k for first, last in self.token_runs() for k in range(first, last + 1)]

    @property
    def first_step(self) -> int:
        """The step that produced its first output token (negative: none yet)."""
        return self.runs[0] if self.runs else self.run_start
