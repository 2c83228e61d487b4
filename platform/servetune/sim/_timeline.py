"""The engine core's step timeline: the loop that runs steps and the clock they move.

Contract: :class:`StepTimeline` is the part of :class:`servetune.sim.scheduler.SimScheduler` that
runs it: one step is schedule -> run -> update (``step()`` reports it, ``run_until_idle()`` runs
to the end without reports, its callback told when a client has a request's last token); a step
lasts what :meth:`servetune.sim.perf.PerfModel.step_time` says, and ``update_from_output()`` samples
its tokens, hands them to the API server (:class:`servetune.sim.frontend.ApiServer`), finishes the
requests that reached ``max_tokens`` and frees their blocks. Requests enter WAITING when the API
server's intake is done (with async scheduling, the batch forms when the step before began); an
idle engine jumps its clock to the next entry. It keeps when every step ended (``step_end_s``) and
when clients received its tokens (``deliver_s``, NaN until the API server has delivered them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from servetune.sim._sched_output import Prompts, SchedulerOutput, StepResult, Tally
from servetune.sim._sched_state import SchedulerState
from servetune.sim.moe_jit import first_use_s

if TYPE_CHECKING:
    from servetune.sim.blocks import BlockPool
    from servetune.sim.frontend import ApiServer
    from servetune.sim.moe_jit import MoeJitRule, TritonCache
    from servetune.sim.perf import PerfModel
    from servetune.sim.request import SimRequest

__all__ = ["StepTimeline"]


class StepTimeline(SchedulerState):
    """Steps and the virtual clock: the step loop, the update after a step, entries and deliveries
    (a mixin of :class:`servetune.sim.scheduler.SimScheduler`)."""

    # What this part calls (``SimScheduler.__init__`` makes them).
    api: ApiServer
    perf: PerfModel
    moe_jit: MoeJitRule | None
    triton_cache: TritonCache
    pool: BlockPool

    def step(self) -> StepResult:
        """Run one engine step (or jump the clock to the next arrival when idle) and report it."""
        start = self.now_s
        info = self._step(collect=True)
        if info is None:
            return StepResult(start, 0.0, {}, [], [], 0, 0)
        return info

    def run_until_idle(self, on_finish: Callable[[str, float], None] | None = None) -> None:
        """Step until no work is left (fast path: no per-step report; with ``bulk_decode`` the
        running requests that only decode advance together by counters, the same figures as
        step by step).

        ``on_finish(request_id, finish_s)`` is called for every finished request once its client
        has the last token (``finish_s``) and may add new requests (a closed-loop client sends the
        next one when one completes).
        """
        self._on_finish = on_finish
        try:
            while self._running or self._waiting or self.api.has_work():
                self._step(collect=False)
        finally:
            self._dissolve()
            self._on_finish = None

    def _step(self, collect: bool) -> StepResult | None:
        """One step. Returns a StepResult (``collect``), else None (finished requests reach
        ``run_until_idle``'s callback once the API server delivers their last token)."""
        if not self._enter_step():
            return None
        if not collect:
            if self._dec_n and self._step_decoding():
                return None
            self._dissolve()
        gpu_idle = not self._running  # no step of its own on the GPU while this one is scheduled
        out = self.schedule()
        if out.num_tokens == 0:
            return self._idle(out, collect)
        start = self.now_s
        duration = self._duration(out, gpu_idle)
        finished = self.update_from_output(out, duration)
        if not collect:
            if self.bulk_decode:
                self._join_decoding(out.step_no + 1)
            return None
        step_no = out.step_no
        new_tokens = {r.rid: (1 if r.last_step == step_no else 0) for r, _ in out.scheduled}
        return StepResult(start, duration, new_tokens, [r.rid for r in finished], [r.rid for r in out.preempted],
                          out.prefill_tokens, out.num_tokens - out.prefill_tokens)

    def _enter_step(self) -> bool:
        """Admit what reached the engine core (the batch forms when the step before began, with
        async scheduling; after an idle engine's first step, once that step was scheduled and
        submitted); when idle, jump the clock to the next entry. False: no work comes.

        vLLM's engine core drains its input queue before every call of its step function
        (``run_busy_loop``, ``vllm/v1/engine/core.py:954-956,980-983@v0.14.1``,
        ``:1362-1364,1394-1396@v0.26.0``), and with a free slot in the batch queue that call
        schedules a batch, submits it without blocking and returns (``step_with_batch_queue``,
        ``:438-473@v0.14.1``, ``:645-679@v0.26.0``). In a busy loop the next drain follows the
        wait for the step before's output, so a batch holds what entered by the step before's
        start; but the batch after an idle engine's first one is drained only after that first
        batch was scheduled and submitted: the step's engine CPU later
        (:meth:`PerfModel.engine_cpu_s`), not at the same instant.
        """
        lag, self._form_lag = self._form_lag, 0.0
        formed_at = min(self._step_start + lag, self.now_s) if self._schedule_ahead and self._running else None
        self._step_start = self.now_s
        self._admit_arrivals(formed_at)
        if not self._running and not self._waiting:
            nxt = self._next_entry()
            if nxt == math.inf:
                return False
            self.now_s = max(self.now_s, nxt)
            self._step_start = self.now_s  # the step begins after the jump
            self._admit_arrivals()
            if self._schedule_ahead:
                self._form_lag = self.perf.engine_cpu_s(len(self._waiting))
        return True

    def _idle(self, out: SchedulerOutput, collect: bool) -> StepResult | None:
        """Nothing could be scheduled (every waiting request blocked on KV space that no running
        request will free): vLLM would idle too. Jump to the next arrival, or stop."""
        nxt = self._next_entry()
        if nxt != math.inf:
            self.now_s = max(self.now_s, nxt)
            return StepResult(self.now_s, 0.0, {}, [], [r.rid for r in out.preempted], 0, 0) if collect else None
        raise RuntimeError("simulated engine is stuck: waiting requests can never fit the KV cache")

    def _duration(self, out: SchedulerOutput | Tally, gpu_idle: bool = False) -> float:
        """The step's time: its kernels and engine CPU (all of it visible after an idle GPU under
        async scheduling, ``PerfModel.step_time``), and any fused-MoE kernel variant it is the
        first to launch on this server (``sim.moe_jit.first_use_s``). A step its forward's CPU paced adds its
        time to ``forward_bound_s``."""
        decode_only = out.prefill_tokens == 0
        step = self.perf.step_time(out.num_reqs, out.num_tokens, out.kv_context, out.attn_work, decode_only,
                                   out.prefill_tokens, out.prefill_context, out.prefill_attn, gpu_idle)
        if self._forward_priced and step == self.perf.forward_floor_s(out.num_reqs, out.num_tokens, out.prefill_tokens,
                                                                       decode_only):
            self.forward_bound_s += step  # the forward's CPU set this step (PerfModel.forward_floor_s)
        return step + first_use_s(self.moe_jit, self.triton_cache, out.num_tokens)

    def update_from_output(self, out: SchedulerOutput, duration: float, decoding: int = 0) -> list[SimRequest]:
        """The step ran for ``duration``: sample its tokens, hand them to the API server, finish the
        requests that reached ``max_tokens`` and free their blocks. Returns the finished requests.
        ``decoding``: the first running requests that decoded in bulk (not in ``out``) before it."""
        return self._update(out.step_no, out.sampled, out.prefill_tokens, out.kv_usage, duration, decoding)

    def _update(self, step_no: int, sampled: list[SimRequest], prefill_tokens: int, usage: float, duration: float,
                decoding: int) -> list[SimRequest]:
        prev = step_no - 1
        finished: list[SimRequest] = []
        if decoding:  # the bulk decoders sampled first, in running order
            keys = self._running[:decoding]
            prompt_sum = self._dec_prompts
            for req in self._dec_fin.pop(step_no, ()):
                self._leave_decoding(req, step_no + 1)
                finished.append(req)
        else:
            keys = []
            prompt_sum = 0
        for req in sampled:
            if req.last_step == prev:
                req.last_step = step_no
            else:
                req.note_token(step_no)
            req.total += 1
            req.output += 1
            keys.append(req)
            prompt_sum += req.prompt
            if req.output >= req.max_tokens:
                finished.append(req)
        self.now_s = end_s = self.now_s + duration
        self.step_end_s.append(end_s)
        # The API server streams this step's tokens when its loop gets to them (sim/frontend.py).
        self.deliver_s.append(math.nan if keys else end_s)
        self.api.step_keys(step_no, end_s, keys, Prompts(keys), prompt_sum, finished)
        self.num_steps += 1
        self.prompt_tokens_computed += prefill_tokens
        self.generation_tokens += len(keys)
        if usage > self.kv_usage_peak:
            self.kv_usage_peak = usage
        self._kv_area += usage * duration
        self._kv_time += duration
        if finished:
            for req in finished:
                req.status = "finished"
                req.finish_step = step_no
                self.pool.free(req)
            self._running = [r for r in self._running if r.status == "running"]
            if not self._running and not self._waiting:
                # Idle now: no step comes before a request enters, so the API server runs ahead
                # (delivering this step's tokens) until one does.
                self._next_entry()
        return finished

    def _admit_arrivals(self, upto: float | None = None) -> None:
        """Run the API server as far as the engine's clock is known, then move the requests that
        reached the engine core by ``upto`` (default: now) to WAITING."""
        api = self.api
        api.advance(self.now_s, self._delivered)
        if api.next_entry_s() > (self.now_s if upto is None else upto):
            return
        for req in api.pop_entered(self.now_s if upto is None else upto):
            req.status = "waiting"  # type: ignore[attr-defined]
            self._waiting.append(req)  # type: ignore[arg-type]

    def _next_entry(self) -> float:
        """When the next request reaches the engine core, the engine being idle (inf: none will)."""
        nxt = self.api.next_entry_s()
        if nxt == math.inf and self.api.has_work():
            self.api.advance(self.now_s, self._delivered, until_entry=True)
            nxt = self.api.next_entry_s()
        return nxt

    def _delivered(self, step_no: int, delivered_s: float, finished: list[Hashable]) -> None:
        """The API server delivered step ``step_no``'s tokens; the clients of ``finished`` have their last."""
        self.deliver_s[step_no] = delivered_s
        if self._on_finish is not None:
            for req in finished:
                self._on_finish(req.rid, delivered_s)  # type: ignore[attr-defined]

    def _received(self, step_no: int) -> float | None:
        """When clients received step ``step_no``'s tokens; None while the API server has not."""
        t = self.deliver_s[step_no]
        return None if math.isnan(t) else t

    def token_times(self, request_id: str) -> list[float]:
        """When the client receives each output token of the request (after the API server; NaN
        for tokens it has not delivered yet)."""
        ends = self.deliver_s
        return [ends[s] for s in self._requests[request_id].token_steps]
