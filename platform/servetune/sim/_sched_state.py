"""The engine core's state, declared once: what ``SimScheduler.__init__`` makes and its parts share.

Contract: :class:`SchedulerState` is the base of the parts of
:class:`servetune.sim.scheduler.SimScheduler` (the admission policy, the bulk-decode fast path, the
step timeline): it declares, for the type checker, the attributes the engine core holds and the
methods one part calls on another, and defines nothing at run time; each part declares beside its
code the objects it calls (the block pool, a hybrid's blocks, the API server, the step-time model).
The face's ``__init__`` sets the attributes; each method is defined by the part that owns it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import array
    import collections
    from collections.abc import Callable

    from servetune.sim._sched_output import SchedulerOutput, Tally
    from servetune.sim.blocks import KVGroups
    from servetune.sim.request import SimRequest

__all__ = ["SchedulerState"]


class SchedulerState:
    """The engine core's attributes and the parts' shared methods, declared (no values, no code)."""

    # The configuration's limits.
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_threshold: int
    chunked_prefill: bool
    reserve_full_isl: bool
    count_preempted_hits: bool
    count_lookup_retries: bool
    # The KV blocks: a hybrid's groups, the step's tokens in flight, resumed requests' own blocks.
    groups: KVGroups | None
    _sliding: bool
    _in_flight: bool
    _resume_hits: bool
    # The queues.
    _running: list[SimRequest]
    _waiting: collections.deque[SimRequest]
    _requests: dict[str, SimRequest]
    # The virtual clock and the step timeline.
    now_s: float
    _step_start: float
    _schedule_ahead: bool
    _form_lag: float
    step_end_s: array.array[float]
    deliver_s: array.array[float]
    _on_finish: Callable[[str, float], None] | None
    # The counters.
    num_steps: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    lookups: list[list[int]]
    counted_lookups: list[tuple[int, int]]
    prompt_tokens_computed: int
    generation_tokens: int
    kv_usage_peak: float
    _kv_area: float
    _kv_time: float
    forward_bound_s: float
    _forward_priced: bool
    # The bulk decoders.
    bulk_decode: bool
    num_bulk_steps: int
    _dec_n: int
    _dec_off: int
    _dec_need: list[int]
    _dec_prompts: int
    _dec_fin: dict[int, list[SimRequest]]

    if TYPE_CHECKING:  # defined by the part that owns each (_admission, _bulk_decode, _timeline)
        def schedule(self) -> SchedulerOutput: ...
        def _batch(self, tally: Tally, start: int,
                   preempted: list[SimRequest]) -> tuple[list[tuple[SimRequest, int]], list[SimRequest]]: ...
        def _preempt_for(self, req: SimRequest, need: int, preempted: list[SimRequest]) -> bool: ...
        def _step_decoding(self) -> bool: ...
        def _join_decoding(self, k0: int) -> None: ...
        def _leave_decoding(self, req: SimRequest, upto: int) -> None: ...
        def _dissolve(self) -> None: ...
        def _duration(self, out: SchedulerOutput | Tally) -> float: ...
        def _update(self, step_no: int, sampled: list[SimRequest], prefill_tokens: int, usage: float, duration: float,
                    decoding: int) -> list[SimRequest]: ...
