"""``run_until_idle``'s fast path: the running requests that only decode, advanced together by counters.

Contract: :class:`BulkDecode` is the part of :class:`servetune.sim.scheduler.SimScheduler` that,
in ``run_until_idle`` (a trial), keeps the first running requests that only decode as counts
(their KV context and attention sums, how many cross a block boundary at each step, which step
samples each one's last token) so that a step costs the same whatever its batch, and forms the rest
of the batch as usual. The figures are the same, to the bit, as stepping every request
(``bulk_decode=False``): a decoder joins only while it is a plain decode, and it leaves with its
counts brought up to date before anything decides about it request by request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servetune.sim._sched_output import Tally
from servetune.sim._sched_state import SchedulerState

if TYPE_CHECKING:
    from servetune.sim._hybrid_kv import HybridBlocks
    from servetune.sim.blocks import BlockPool
    from servetune.sim.request import SimRequest

__all__ = ["BulkDecode"]


class BulkDecode(SchedulerState):
    """The bulk decoders: join, step, preempt, leave, dissolve (a mixin of
    :class:`servetune.sim.scheduler.SimScheduler`)."""

    # What this part calls (``SimScheduler.__init__`` makes them).
    pool: BlockPool
    _hybrid: HybridBlocks

    def _step_decoding(self) -> bool:
        """One step in which the first ``_dec_n`` running requests each decode one token, counted
        in bulk (the sums :meth:`_schedule_running` would form one by one: a decode of ``c``
        computed tokens adds ``c + 1`` to the KV context and the attention work, and takes a block
        when ``c`` is a multiple of the block size); the rest of the batch is formed as usual.
        False, with nothing changed, when they do not all fit the token budget."""
        n = self._dec_n
        if n > self.max_num_batched_tokens:
            return False
        k = len(self.step_end_s)
        need = self._dec_need[k % self.block_size]
        preempted: list[SimRequest] = []
        freed = 0
        groups = self.groups
        if groups is not None and groups.sliding:
            if need * groups.total > self.pool.num_free:
                return False  # request by request: each frees what left its window before it allocates
            need, freed = self._hybrid.bulk_step(k, need)
        elif groups is not None and groups.total > 1:
            need *= groups.total  # a block of each full group per new block-table entry
            if need > self.pool.num_free:
                return False  # request by request: each preempts for its own blocks
        if need > self.pool.num_free:
            self._preempt_decoding(k, preempted)
            n = self._dec_n
        elif need:
            self.pool.take(need)
        if freed:
            self.pool.give_anonymous(freed)
        tally = Tally(self.max_num_batched_tokens - n)
        tally.num_reqs = tally.num_tokens = n
        tally.kv_context = tally.attn_work = self._dec_off + n * (k + 1)
        sampled = self._batch(tally, n, preempted)[1]
        usage = self.pool.usage
        self._update(k, sampled, tally.prefill_tokens, usage, self._duration(tally), n)
        if self._dec_n < len(self._running):
            self._join_decoding(k + 1)
        self.num_bulk_steps += 1
        return True

    def _preempt_decoding(self, k: int, preempted: list[SimRequest]) -> None:
        """The bulk decoders' blocks at step ``k`` when not all are free, as :meth:`_schedule_running`
        gives them: in running order each that needs one takes it; one that finds none preempts
        from the back (a bulk decoder among the victims brought up to date first) until one is
        free or it is the victim itself, which ends the step's running requests."""
        running = self._running
        pool = self.pool
        bs = self.block_size
        needers = [r for r in running[:self._dec_n] if (r.dec - r.computed - k) % bs == 0]
        taken = 0  # blocks given out since the last preemption, taken together
        for req in needers:
            if req.dec < 0:
                break  # preempted already, as is every request behind it
            if pool.num_free - taken >= 1:
                taken += 1
                continue
            if taken:
                pool.take(taken)
                taken = 0
            if self._preempt_for(req, 1, preempted):
                break
            taken += 1
        if taken:
            pool.take(taken)

    def _join_decoding(self, k0: int) -> None:
        """Running requests after the bulk decoders, in order, join them from step ``k0`` while each
        is a plain decode: sampled at the step before, whole sequence computed, blocks for it and
        no more, no prefix blocks left to register."""
        running = self._running
        bs = self.block_size
        caching = self.pool.caching
        fin = self._dec_fin
        last = k0 - 1
        for i in range(self._dec_n, len(running)):
            req = running[i]
            c = req.computed
            if (req.last_step != last or c != req.total - 1 or req.nblk != (c + bs - 1) // bs
                    or (caching and req.group is not None and len(req.shared) < req.npb)
                    or (self._sliding and not self._hybrid.join_bulk(req, k0))):
                break
            req.dec = k0
            self._dec_n += 1
            self._dec_off += c - k0
            self._dec_need[(k0 - c) % bs] += 1
            self._dec_prompts += req.prompt
            end = k0 + req.max_tokens - req.output - 1  # the step that samples its last token
            bucket = fin.get(end)
            if bucket is None:
                fin[end] = [req]
            else:
                bucket.append(req)

    def _leave_decoding(self, req: SimRequest, upto: int) -> None:
        """Take ``req`` out of the bulk decoders, its counts brought to where steps up to ``upto``
        (excluded) left them."""
        bs = self.block_size
        k0 = req.dec
        self._dec_n -= 1
        self._dec_off -= req.computed - k0
        self._dec_need[(k0 - req.computed) % bs] -= 1
        self._dec_prompts -= req.prompt
        if self._sliding:
            self._hybrid.leave_bulk(req, upto)
        done = upto - k0
        if done > 0:
            req.computed += done
            req.total += done
            req.output += done
            req.nblk = (req.computed + bs - 1) // bs
            req.last_step = upto - 1
            if self.groups is not None and self.groups.sliding:  # the last bulk step's slide, one token in flight
                req.swskip = self.groups.skipped_blocks(req.computed - 1 - self._in_flight)
                req.lastk, req.lastn = upto - 1, 1
        req.dec = -1

    def _dissolve(self) -> None:
        """Bring every bulk decoder's counts up to date and end the bulk (before a step request by
        request, and when run_until_idle returns)."""
        if self._dec_n:
            upto = len(self.step_end_s)
            for req in self._running[:self._dec_n]:
                self._leave_decoding(req, upto)
            self._dec_fin.clear()
            self._hybrid.end_bulk()
