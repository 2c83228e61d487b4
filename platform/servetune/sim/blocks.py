"""vLLM's KV block pool and prefix cache, by counts (``vllm/v1/core/block_pool.py``).

Blocks of ``block_size`` tokens; block 0 is vLLM's null block, so ``num_gpu_blocks - 1`` are
usable. Full blocks of a prefix group's shared prefix are cached by content; a new request hits
the longest chain of cached full blocks, at most ``num_tokens - 1`` tokens (the last token is
always recomputed). Hit blocks are shared and ref-counted; cached blocks no request holds stay
evictable in a FIFO free queue and count as free.
"""

from __future__ import annotations

import collections
from typing import Any

from servetune.sim.request import SimRequest

__all__ = ["BlockPool", "CacheKey"]

#: ``(0, prefix group, block index)``: a prefix group's shared block (other blocks hold random
#: tokens nobody else asks for, so they are anonymous and have no key).
CacheKey = tuple[int, int | None, int]


class BlockPool:
    """vLLM's BlockPool, by counts: a FIFO free queue whose entries are anonymous runs or cached blocks.

    ``cache[key] = [ref, gen]``; a queue entry ``(key, gen)`` is stale once the block was touched
    again (lazy deletion).
    """

    __slots__ = ("num_free", "usable", "fresh", "queue", "cache", "caching", "block_size")

    def __init__(self, usable: int, caching: bool, block_size: int) -> None:
        self.usable = usable
        self.num_free = usable  # fresh + anonymous queued + evictable cached
        self.fresh = usable  # never-used blocks sit at the head of the free queue
        self.queue: collections.deque[Any] = collections.deque()
        self.cache: dict[CacheKey, list[int]] = {}
        self.caching = caching
        self.block_size = block_size

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

    def free(self, req: SimRequest) -> None:
        """Return a request's blocks, tail first (vLLM's order: the tail is evicted first).

        Full blocks of a prefix group's shared prefix stay cached (evictable). A request's own
        blocks are freed uncached: the real vLLM 0.26 runs show no prefix-cache hits when
        preempted requests resume (496 hit tokens over 192 preemptions in b3), so the simulator
        does not let a resumed request skip its recompute.
        """
        nshared = len(req.shared)
        if self.caching:
            full = min(req.computed // self.block_size, req.npb)
            anon = 0
            for idx in range(req.nblk - 1, nshared - 1, -1):  # private blocks, tail first
                if idx < full and (0, req.group, idx) not in self.cache:
                    self.give_anonymous(anon)  # keep the queue order: what was freed before goes first
                    anon = 0
                    self.offer_if_new((0, req.group, idx))
                else:
                    anon += 1
            self.give_anonymous(anon)
            for key in reversed(req.shared):
                self.release_key(key)
            req.shared = []
        else:
            self.num_free += req.nblk - nshared
        req.nblk = 0

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
        """Longest chain of cached full prefix blocks (at most total - 1 tokens), and how many are evictable."""
        cache = self.cache
        limit = min((req.total - 1) // self.block_size, req.npb)
        hits: list[CacheKey] = []
        evictable = 0
        for idx in range(limit):
            key = (0, req.group, idx)
            state = cache.get(key)
            if state is None:
                break
            hits.append(key)
            if state[0] == 0:
                evictable += 1
        return hits, evictable
