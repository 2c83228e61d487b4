"""An analytic preemption prior: where max_num_seqs starts to preempt for sure.

vLLM's V1 scheduler preempts (recomputes) a running sequence when the KV cache has no free block
for the next token. A batch of ``n`` sequences that each grow to ``prompt + output`` tokens needs
``n * ceil((prompt + output) / block_size)`` blocks at its fullest. In a closed-loop benchmark the
first wave of requests is admitted together and, with equal lengths, grows together, so when
``n`` exceeds what the KV cache holds the wave preempts: the bound below is the ``max_num_seqs``
beyond which preemption is certain (for a workload that keeps that many sequences in flight).

* :func:`preemption_bound` (pure): ``usable_blocks // blocks_per_sequence`` with vLLM's block
  rounding (block 0 is the null block; each sequence rounds up to whole blocks).
* :func:`optimistic_bound` (pure): the same with half the output held, the average footprint of
  sequences staggered over their lifetime; between the two bounds preemption depends on timing.

The informed starts a fresh study measures first are built on these bounds in
:mod:`servetune.search.informed`.

Example:
    >>> preemption_bound(kv_cache_tokens=160_000, mean_prompt=512, mean_output=1024, block_size=16)
    104
    >>> optimistic_bound(kv_cache_tokens=160_000, mean_prompt=512, mean_output=1024, block_size=16)
    156
"""

from __future__ import annotations

import math

from servetune.errors import SpecError

__all__ = ["preemption_bound", "optimistic_bound"]


def _blocks(tokens: float, block_size: int) -> int:
    return max(1, math.ceil(tokens / block_size))


def preemption_bound(kv_cache_tokens: int, mean_prompt: float, mean_output: float, block_size: int = 16) -> int:
    """The largest number of sequences whose full KV footprint fits at once; more preempt for sure.

    ``kv_cache_tokens`` is the planner's (or vLLM's logged) KV capacity. Returns 0 when not even
    one full sequence fits.

    Example:
        >>> preemption_bound(1_600, mean_prompt=100, mean_output=100, block_size=16)   # 100 blocks, 13 each
        7
    """
    if block_size < 1:
        raise SpecError("block_size", f"must be >= 1, got {block_size}", "use vLLM's block size (16)")
    if mean_prompt < 0 or mean_output < 0 or mean_prompt + mean_output <= 0:
        raise SpecError("workload", "needs positive mean prompt + output lengths", "check input_len and output_len")
    usable = max(int(kv_cache_tokens) // block_size - 1, 0)  # block 0 is vLLM's null block
    return usable // _blocks(mean_prompt + mean_output, block_size)


def optimistic_bound(kv_cache_tokens: int, mean_prompt: float, mean_output: float, block_size: int = 16) -> int:
    """Sequences that fit when each holds its prompt and half its output (staggered lifetimes)."""
    return preemption_bound(kv_cache_tokens, mean_prompt, mean_output / 2, block_size)
