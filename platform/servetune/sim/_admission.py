"""The engine core's admission and preemption policy: how ``SimScheduler.schedule()`` forms a batch.

Contract: :class:`Admission` is the part of :class:`servetune.sim.scheduler.SimScheduler` that
forms one step's batch as vLLM's V1 scheduler does (``scheduler``'s docstring gives the rules):
RUNNING requests first, in admission order, each one that lacks KV blocks preempting from the back
(:meth:`Admission._preempt_for`, the one rule of the step path and the bulk-decode path); then
WAITING requests, in order, only when nothing was preempted, while the token budget,
``max_num_seqs`` and the free blocks last (head-of-line blocking), each one's prefix-cache lookup
counted as the version's ``PrefixCacheStats`` counts it (:meth:`Admission._lookup`,
:meth:`Admission.logged_hit_rate`). It returns a frozen :class:`SchedulerOutput`; it runs nothing
and moves no clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servetune.sim._sched_output import SchedulerOutput, Tally
from servetune.sim._sched_state import SchedulerState

if TYPE_CHECKING:
    from servetune.sim._hybrid_kv import HybridBlocks
    from servetune.sim.blocks import BlockPool, CacheKey
    from servetune.sim.request import SimRequest

__all__ = ["Admission"]


class Admission(SchedulerState):
    """The batch of a step: RUNNING, then WAITING; preemption; the prefix-cache lookup counters (a
    mixin of :class:`servetune.sim.scheduler.SimScheduler`)."""

    # What this part calls (``SimScheduler.__init__`` makes them).
    pool: BlockPool
    _hybrid: HybridBlocks

    def schedule(self) -> SchedulerOutput:
        """Form the next batch: RUNNING first, then WAITING unless something was preempted."""
        return self._form(Tally(self.max_num_batched_tokens))

    def _form(self, tally: Tally) -> SchedulerOutput:
        preempted: list[SimRequest] = []
        scheduled, sampled = self._batch(tally, 0, preempted)
        return SchedulerOutput(len(self.step_end_s), scheduled, sampled, preempted, tally.num_reqs,
                               tally.num_tokens, tally.kv_context, tally.attn_work, tally.prefill_tokens,
                               tally.prefill_context, tally.prefill_attn, self.pool.usage)

    def _batch(self, tally: Tally, start: int,
               preempted: list[SimRequest]) -> tuple[list[tuple[SimRequest, int]], list[SimRequest]]:
        """Form the batch from the ``start``-th running request on (those before it are in ``tally``,
        whom they preempted in ``preempted``): (request, tokens) scheduled, and those that sample."""
        scheduled: list[tuple[SimRequest, int]] = []
        sampled: list[SimRequest] = []
        if start < len(self._running):
            self._schedule_running(tally, scheduled, sampled, preempted, start)
        if not preempted and self._waiting and len(self._running) < self.max_num_seqs and tally.budget > 0:
            self._schedule_waiting(tally, scheduled, sampled)
        return scheduled, sampled

    def _schedule_running(self, tally: Tally, scheduled: list[tuple[SimRequest, int]], sampled: list[SimRequest],
                          preempted: list[SimRequest], start: int = 0) -> None:
        """RUNNING requests from the ``start``-th, in admission order; one that lacks blocks
        preempts from the back."""
        bs = self.block_size
        bsm1 = bs - 1
        pool = self.pool
        running = self._running
        budget = tally.budget
        threshold = self.long_prefill_threshold
        caching = pool.caching
        hybrid = self._sliding
        per_pos = self.groups.total if self.groups is not None else 1  # blocks a new block-table entry takes
        k = len(self.step_end_s)
        num_reqs = num_tokens = kv_context = attn_work = prefill_tokens = prefill_context = prefill_attn = 0
        i = start
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.computed
            n = req.total - computed
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            end = computed + n
            pos = (end + bsm1) // bs - req.nblk  # new block-table entries (blocks of each KV group)
            need = self._hybrid.slide(req, pos, n, k) if hybrid else pos * per_pos
            if need > 0:
                if need > pool.num_free and self._preempt_for(req, need, preempted):
                    break
                pool.take(need)
                req.nblk += pos
            budget -= n
            num_reqs += 1
            num_tokens += n
            kv_context += end
            work = n * computed + (n * (n + 1) >> 1)
            attn_work += work
            if computed < req.total - 1:
                prefill_tokens += n
                prefill_context += end
                prefill_attn += work
            req.computed = end
            if caching and req.group is not None and len(req.shared) < req.npb:
                pool.register_prefix(req)
            scheduled.append((req, n))
            if end == req.total:  # the whole sequence is computed: sample one token
                sampled.append(req)
            i += 1
        tally.budget = budget
        tally.num_reqs += num_reqs
        tally.num_tokens += num_tokens
        tally.kv_context += kv_context
        tally.attn_work += attn_work
        tally.prefill_tokens += prefill_tokens
        tally.prefill_context += prefill_context
        tally.prefill_attn += prefill_attn

    def _schedule_waiting(self, tally: Tally, scheduled: list[tuple[SimRequest, int]],
                          sampled: list[SimRequest]) -> None:
        """WAITING requests, in order, while the budget, ``max_num_seqs`` and the free blocks last."""
        bs = self.block_size
        bsm1 = bs - 1
        pool = self.pool
        running = self._running
        waiting = self._waiting
        max_seqs = self.max_num_seqs
        budget = tally.budget
        threshold = self.long_prefill_threshold
        caching = pool.caching
        groups = self.groups
        num_reqs = num_tokens = kv_context = attn_work = 0
        while waiting and budget > 0 and len(running) < max_seqs:
            req = waiting[0]
            hits: list[CacheKey] = []
            evictable_hits = 0
            if caching and (req.npb or (self._resume_hits and req.preemptions)):
                hits, evictable_hits = pool.cache_hits(req)
            cached = len(hits) * bs
            n = req.total - cached
            if not self.chunked_prefill and n > budget:
                self._lookup(req, cached, False)
                break
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            end = cached + n
            free_after_hits = pool.num_free - evictable_hits
            pos = (end + bsm1) // bs - len(hits)
            if groups is None:
                whole = (req.total + bsm1) // bs - len(hits) if self.reserve_full_isl else 0
                need = pos
            else:
                whole, need = self._hybrid.admit(req, len(hits), cached, end)
                whole = whole if self.reserve_full_isl else 0
            if need > free_after_hits or whole > free_after_hits:
                self._lookup(req, cached, False)
                break
            waiting.popleft()
            self._lookup(req, cached, True)
            for key in hits:
                pool.touch(key)
            req.shared = hits
            req.nblk = len(hits)
            pool.take(need)
            req.nblk += pos
            if groups is not None:
                req.swskip = min(groups.skipped_blocks(cached), len(hits)) if groups.sliding else 0
                req.lastk, req.lastn = len(self.step_end_s), n
            req.status = "running"
            running.append(req)
            budget -= n
            num_reqs += 1
            num_tokens += n
            kv_context += end
            attn_work += n * cached + (n * (n + 1) >> 1)
            req.computed = end
            if caching and req.group is not None and len(req.shared) < req.npb:
                pool.register_prefix(req)
            scheduled.append((req, n))
            if end == req.total:
                sampled.append(req)
        tally.budget = budget
        tally.num_reqs += num_reqs
        tally.num_tokens += num_tokens
        tally.kv_context += kv_context
        tally.attn_work += attn_work
        # Every admitted request runs a prefill chunk.
        tally.prefill_tokens += num_tokens
        tally.prefill_context += kv_context
        tally.prefill_attn += attn_work

    def _lookup(self, req: SimRequest, cached: int, admitted: bool) -> None:
        """Count one prefix-cache lookup of a WAITING request (``cached`` tokens hit) as vLLM's
        ``PrefixCacheStats`` does (:attr:`lookups`), and in the counters the version logs."""
        if not self.pool.caching:
            return
        resumed = req.preemptions > 0
        row = self.lookups[(0 if admitted else 2) + resumed]
        row[0] += 1
        row[1] += req.total
        row[2] += cached
        if (admitted or self.count_lookup_retries) and (self.count_preempted_hits or not resumed):
            self.prefix_cache_queries += req.total
            self.prefix_cache_hits += cached
            self.counted_lookups.append((req.total, cached))

    def logged_hit_rate(self, since: int = 0, recent: int = 1000) -> float | None:
        """The "Prefix cache hit rate" vLLM logs now: hits over queries of the most recent ``recent``
        lookups its counters took (``PrefixCachingMetrics``, ``max_recent_requests`` 1000: 0.10.1.1
        ``v1/core/kv_cache_utils.py`` lines 76-134, kept by step where this keeps by lookup), of
        those counted from the ``since``-th on; None when none was."""
        window = self.counted_lookups[max(since, len(self.counted_lookups) - recent):]
        queries = sum(q for q, _ in window)
        return sum(h for _, h in window) / queries if queries else None

    def _preempt_for(self, req: SimRequest, need: int, preempted: list[SimRequest]) -> bool:
        """Preempt running requests from the back until ``need`` KV blocks are free or ``req`` is
        the victim (True: then it and every request behind it are WAITING). A bulk decoder among
        the victims has its counts brought up to date to the current step first. The one rule of
        the step path (:meth:`_schedule_running`) and the bulk-decode path (:meth:`_preempt_decoding`)."""
        running = self._running
        pool = self.pool
        while need > pool.num_free:
            victim = running.pop()
            if victim.dec >= 0:
                self._dec_fin[victim.dec + victim.max_tokens - victim.output - 1].remove(victim)
                self._leave_decoding(victim, len(self.step_end_s))
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return True
        return False

    def _preempt(self, victim: SimRequest) -> None:
        self.pool.free(victim, keep_own=self._resume_hits)
        victim.computed = 0
        victim.status = "waiting"
        victim.preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(victim)
