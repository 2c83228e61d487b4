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
                 "shared", "group", "npb", "token_steps", "preemptions", "finish_step", "status",
                 "order")

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
        self.token_steps: list[int] = []  # index of the step that produced each output token
        self.preemptions = 0
        self.finish_step = -1
        self.status = "pending"
        self.order = order
