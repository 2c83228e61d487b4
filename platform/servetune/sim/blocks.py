"""vLLM's KV block pool and prefix cache, by counts (``vllm/v1/core/block_pool.py``).

Blocks of ``block_size`` tokens; block 0 is vLLM's null block, so ``num_gpu_blocks - 1`` are
usable. Full blocks of a prefix group's shared prefix are cached by content; a new request hits
the longest chain of cached full blocks, at most ``num_tokens - 1`` tokens (the last token is
always recomputed). Hit blocks are shared and ref-counted; cached blocks no request holds stay
evictable in a FIFO free queue and count as free.

Sliding-window / full-attention hybrids (gemma-2/3, gpt-oss): :class:`KVGroups`. vLLM's hybrid KV
cache manager (``vllm/v1/core/kv_cache_coordinator.py``, ``single_type_kv_cache_manager.py``) gives
every KV cache group its own blocks of the one pool, so a request holds one block per
``block_size`` tokens in each group, except that a sliding group frees the blocks that fell out of
its window (``SlidingWindowManager.remove_skipped_blocks``). The pool is the ``num_gpu_blocks`` vLLM
reports, each block spanning one group's layers.

Mamba2 / gated-delta-net hybrids (granite-4.0-h, Nemotron-H, Qwen3-Next): their Mamba groups take blocks of
the same pool (``MambaManager``), a Mamba block spanning ``max_model_len`` tokens without prefix caching, so a
running request holds one block in each Mamba group whatever its length: :attr:`KVGroups.mamba`.
"""

from __future__ import annotations

import collections
from typing import Any

from servetune.sim.request import SimRequest

__all__ = ["BlockPool", "CacheKey", "KVGroups"]

#: ``(0, prefix group, block index)``: a prefix group's shared block (other blocks hold random
#: tokens nobody else asks for, so they are anonymous and have no key).
CacheKey = tuple[int, int | None, int]


class KVGroups:
    """A hybrid model's KV cache groups, as vLLM's scheduler holds blocks for them (vLLM 0.26).

    ``full`` full-attention groups and ``sliding`` sliding-window groups of ``window`` tokens. A
    request's block table has the same length in every group (``SimRequest.nblk``: one entry per
    ``block_size`` tokens allocated); in a sliding group the first ``SimRequest.swskip`` entries are
    vLLM's null block, freed once the window left them: ``get_num_skipped_tokens`` =
    ``max(0, processed - window + 1)``, on the processed-token basis (``allocate_slots`` frees
    before it allocates, with the tokens of the step still in flight not yet processed).
    ``admission_cap``: a sliding group's per-request reservation in the full-sequence admission
    gate (``SlidingWindowSpec.max_admission_blocks_per_request``:
    ``cdiv(min(window - 1 + max_in_flight_tokens, max_model_len), block_size) + 1``).

    ``mamba`` Mamba groups (vLLM 0.26 ``MambaManager`` without prefix caching, ``mamba_cache_mode``
    'none'): each holds one block per running request, its block spanning ``max_model_len`` tokens
    (``cdiv(num_tokens, max_model_len)`` = 1, its skipped blocks never a whole one), taken at the
    request's first allocation (admission, its gate counting it too) and freed with the request's
    other blocks (finish or preemption). Not in :attr:`total`, which counts the groups holding a block
    per ``block_size`` tokens.

    Example:
        >>> g = KVGroups(full=1, sliding=1, window=4096, block_size=16, admission_cap=513)
        >>> g.skipped_blocks(4095), g.skipped_blocks(4111), g.held(80, 0)   # two blocks per 16 tokens
        (0, 1, 160)
        >>> m = KVGroups(full=1, sliding=0, window=0, block_size=400, admission_cap=0, mamba=9)
        >>> m.held(21, 0), m.admission_blocks(21), m.held(0, 0)   # granite-4.0-h-tiny, 8,192 tokens
        (30, 30, 0)
    """

    __slots__ = ("full", "sliding", "window", "block_size", "admission_cap", "total", "mamba")

    def __init__(self, full: int, sliding: int, window: int, block_size: int, admission_cap: int,
                 mamba: int = 0) -> None:
        self.full = full
        self.sliding = sliding
        self.window = window
        self.block_size = block_size
        self.admission_cap = admission_cap
        self.total = full + sliding
        self.mamba = mamba

    def skipped_blocks(self, processed: int) -> int:
        """Leading entries of a sliding group's block table out of the window once ``processed`` tokens are."""
        return max(0, processed - self.window + 1) // self.block_size

    def held(self, nblk: int, swskip: int) -> int:
        """Blocks of the pool a request with ``nblk`` table entries, ``swskip`` of them slid out, holds
        (its Mamba groups' one block each while it holds any: ``nblk > 0``)."""
        return self.total * nblk - self.sliding * swskip + (self.mamba if nblk > 0 else 0)

    def admission_blocks(self, positions: int) -> int:
        """The blocks vLLM's admission gate reserves for a whole sequence of ``positions`` (>= 1) blocks."""
        return self.full * positions + self.sliding * min(positions, self.admission_cap) + self.mamba


class BlockPool:
    """vLLM's BlockPool, by counts: a FIFO free queue whose entries are anonymous runs or cached blocks.

    ``cache[key] = [ref, gen]``; a queue entry ``(key, gen)`` is stale once the block was touched
    again (lazy deletion).
    """

    __slots__ = ("num_free", "usable", "fresh", "queue", "cache", "caching", "block_size", "groups", "unhashed_first")

    def __init__(self, usable: int, caching: bool, block_size: int, groups: KVGroups | None = None,
                 unhashed_first: bool = False) -> None:
        self.usable = usable
        self.num_free = usable  # fresh + anonymous queued + evictable cached
        self.fresh = usable  # never-used blocks sit at the head of the free queue
        self.queue: collections.deque[Any] = collections.deque()
        self.cache: dict[CacheKey, list[int]] = {}
        self.caching = caching
        self.block_size = block_size
        #: A hybrid's KV groups (None: one group). The prefix cache's keys are the first (full)
        #: group's; the other groups' blocks are held privately and freed anonymously.
        self.groups = groups
        #: vLLM 0.23.0 on: a freed block with no hash (a request's last, partly filled block) goes to
        #: the free queue's head, to be handed out before any cached block (``BlockPool.free_blocks``:
        #: ``prepend_n`` of the blocks without a hash, ``append_n`` of the rest; 0.26.0
        #: ``v1/core/block_pool.py`` lines 727-740); before, every freed block went to the tail
        #: (0.10.1.1 lines 240-255, 0.22.0 the same).
        self.unhashed_first = unhashed_first

    @property
    def usage(self) -> float:
        """vLLM's KV usage: ``1 - free / usable``."""
        return 1.0 - self.num_free / self.usable

    # -- counts ---------------------------------------------------------------------------------

    def take(self, n: int) -> None:
        """Allocate ``n`` blocks (caller checked ``n <= num_free``), evicting cached ones FIFO."""
        self.num_free -= n
        if not self.caching:
            return
        if self.fresh >= n:
            self.fresh -= n
            return
        n -= self.fresh
        self.fresh = 0
        queue, cache = self.queue, self.cache
        while n:
            entry = queue[0]
            if entry.__class__ is int:  # an anonymous run
                if entry <= n:
                    queue.popleft()
                    n -= entry
                else:
                    queue[0] = entry - n
                    n = 0
            else:
                queue.popleft()
                key, gen = entry
                state = cache.get(key)
                if state is not None and state[0] == 0 and state[1] == gen:
                    del cache[key]  # evicted
                    n -= 1

    def give_anonymous(self, n: int) -> None:
        if n <= 0:
            return
        self.num_free += n
        if self.caching:
            queue = self.queue
            if queue and queue[-1].__class__ is int:
                queue[-1] += n
            else:
                queue.append(n)

    def release_key(self, key: CacheKey) -> None:
        """Drop one reference to a cached block; at zero it becomes evictable (still a hit)."""
        state = self.cache[key]
        state[0] -= 1
        if state[0] == 0:
            state[1] += 1
            self.queue.append((key, state[1]))
            self.num_free += 1

    def offer_if_new(self, key: CacheKey) -> bool:
        """Cache a block being freed under ``key`` (evictable); False if an equal one is cached."""
        if key in self.cache:
            return False
        self.cache[key] = [0, 0]
        self.queue.append((key, 0))
        self.num_free += 1
        return True

    def touch(self, key: CacheKey) -> None:
        """Take a reference to a cached block (a prefix-cache hit)."""
        state = self.cache[key]
        if state[0] == 0:
            self.num_free -= 1
            state[1] += 1  # its queue entry is now stale
        state[0] += 1

    # -- a request's blocks ---------------------------------------------------------------------

    def free(self, req: SimRequest, keep_own: bool = False) -> None:
        """Return a request's blocks, tail first (vLLM's order: the tail is evicted first).

        Full blocks of a prefix group's shared prefix stay cached (evictable). With ``keep_own`` (a
        preemption) the request's own full computed blocks stay cached too, under keys only it
        looks up (:meth:`cache_hits`), until the free queue hands them out: vLLM caches every full
        block of every request and keeps a freed block's hash until it is evicted
        (``BlockPool.free_blocks`` appends hashed blocks to the free queue's tail), so a preempted
        request that resumes hits what is left of its own blocks (vLLM issue #25780: a random-prompt
        throughput run logged a 30% hit rate from them). A finished request's own blocks go back
        anonymous: no other request holds their content.

        A hybrid's other groups (:class:`KVGroups`) follow the first one's, as vLLM frees group by
        group: their blocks still held (a sliding group's less those slid out, a Mamba group's one) go
        back anonymous.
        With :attr:`unhashed_first` (vLLM 0.23.0 on) the blocks past the last full computed one go
        to the head instead, handed out before any cached block.
        """
        nshared = len(req.shared)
        groups = self.groups
        extra = groups.held(req.nblk, req.swskip) - req.nblk if groups is not None else 0
        if self.caching:
            computed = req.computed // self.block_size
            full = min(computed, req.npb)
            own = computed if keep_own else 0
            anon = 0
            top = req.nblk - 1
            if self.unhashed_first and top >= max(computed, nshared):  # blocks vLLM has not hashed
                self.fresh += top + 1 - max(computed, nshared)
                self.num_free += top + 1 - max(computed, nshared)
                top = max(computed, nshared) - 1
            for idx in range(top, nshared - 1, -1):  # private blocks, tail first
                key = (0, req.group, idx) if idx < full else (1, req.order, idx) if idx < own else None
                if key is not None and key not in self.cache:
                    self.give_anonymous(anon)  # keep the queue order: what was freed before goes first
                    anon = 0
                    self.offer_if_new(key)
                else:
                    anon += 1
            self.give_anonymous(anon)
            for key in reversed(req.shared):
                self.release_key(key)
            req.shared = []
            self.give_anonymous(extra)
        else:
            self.num_free += req.nblk - nshared + extra
        req.nblk = 0
        req.swskip = 0

    def register_prefix(self, req: SimRequest) -> None:
        """Cache the prefix-group blocks this request just filled, so others of its group hit them."""
        full = min(req.computed // self.block_size, req.npb)
        cache = self.cache
        idx = len(req.shared)
        while idx < full:
            key = (0, req.group, idx)
            if key in cache:  # an equal block was computed by someone else meanwhile
                return
            cache[key] = [1, 0]
            req.shared.append(key)
            idx += 1

    def cache_hits(self, req: SimRequest) -> tuple[list[CacheKey], int]:
        """Longest chain of cached full blocks (at most total - 1 tokens), and how many are evictable:
        the group's shared prefix, then (a preempted request) its own blocks still cached."""
        cache = self.cache
        npb = req.npb
        limit = (req.total - 1) // self.block_size if req.preemptions else min((req.total - 1) // self.block_size, npb)
        hits: list[CacheKey] = []
        evictable = 0
        for idx in range(limit):
            key = (0, req.group, idx) if idx < npb else (1, req.order, idx)
            state = cache.get(key)
            if state is None:
                break
            hits.append(key)
            if state[0] == 0:
                evictable += 1
        return hits, evictable
