"""The block pool's free queue against vLLM's order (``vllm/v1/core/block_pool.py``)."""

from __future__ import annotations

from servetune.sim.blocks import BlockPool
from servetune.sim.request import SimRequest


def _victim(pool: BlockPool, tokens: int, order: int = 1) -> SimRequest:
    """A request holding ``tokens`` computed tokens (the last block partly filled), preempted."""
    req = SimRequest(f"v{order}", tokens, 8, 0.0, None, 0, order=order)
    req.nblk = -(-tokens // pool.block_size)
    pool.take(req.nblk)
    req.computed = tokens
    req.total = tokens
    req.preemptions = 1
    return req


def test_a_preempted_request_loses_its_tail_first_and_keeps_its_head_longest() -> None:
    # vLLM frees a request's blocks in reverse order onto the free queue's tail (0.10.1.1
    # single_type_kv_cache_manager.py free, block_pool.py free_blocks) and hands out the head first:
    # taking blocks evicts the victim's tail, and its resume hits the head still cached.
    pool = BlockPool(usable=8, caching=True, block_size=16)
    req = _victim(pool, 16 * 6)  # six full blocks, all hashed; two blocks never used
    pool.free(req, keep_own=True)
    assert pool.num_free == 8
    pool.take(2 + 2)  # the two never used, then the victim's last two
    hits, evictable = pool.cache_hits(req)
    assert len(hits) == 4 and evictable == 4


def test_from_0_23_a_block_without_a_hash_is_handed_out_before_any_cached_one() -> None:
    # 0.23.0 on: free_blocks prepends the blocks without a hash (a partly filled last block) to the
    # queue's head; before, every freed block went to its tail, behind the cached ones.
    for unhashed_first, kept in ((False, 3), (True, 4)):
        pool = BlockPool(8, True, 16, unhashed_first=unhashed_first)
        a, b = _victim(pool, 16 * 4, 1), _victim(pool, 16 * 3 + 5, 2)  # b: three full blocks and one partial
        a.total += 8  # its next tokens not computed yet: its lookup may hit all four full blocks
        pool.free(a, keep_own=True)
        pool.free(b, keep_own=True)
        pool.take(1)  # before 0.23: a's tail (freed first); from 0.23: b's partial block
        assert len(pool.cache_hits(a)[0]) == kept and len(pool.cache_hits(b)[0]) == 3
