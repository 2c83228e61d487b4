"""The preemption prior: the certain-preemption bound."""

from __future__ import annotations

import pytest

from servetune.errors import SpecError
from servetune.planner.prior import optimistic_bound, preemption_bound


def test_bound_counts_whole_blocks_and_the_null_block() -> None:
    # 1,600 tokens = 100 blocks, one is the null block: 99 usable; a 200-token sequence takes 13
    # blocks (208 tokens, rounded up), so 7 sequences fit (91 blocks) and the 8th cannot.
    assert preemption_bound(1_600, mean_prompt=100, mean_output=100, block_size=16) == 7
    # Exactly 12.5 blocks per sequence rounds up to 13 as well; 192 tokens is exactly 12.
    assert preemption_bound(1_600, 96, 96, 16) == 8
    assert preemption_bound(100, 1_000, 1_000) == 0
    # Half the output held on average (staggered lifetimes) fits more.
    assert optimistic_bound(1_600, 100, 100, 16) == 99 // 10


def test_bound_rejects_nonsense() -> None:
    with pytest.raises(SpecError):
        preemption_bound(1_000, 0, 0)
    with pytest.raises(SpecError):
        preemption_bound(1_000, 10, 10, block_size=0)
