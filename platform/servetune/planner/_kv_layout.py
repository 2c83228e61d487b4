"""How one worker's KV cache is paged for a model class: vLLM's KV-cache groups and the blocks a request takes.

Contract: :func:`kv_layout` is the :class:`KVLayout` of one pipeline stage's worker: the page of one block of
one layer (MLA's latent, or K and V), the layers per group (:func:`group_size_for`, vLLM's uniform page
size grouping) and each group's kind (full attention, sliding window, Mamba); :class:`KVLayout` answers the
bytes a token takes, the tokens vLLM logs, the blocks one request holds and the longest length that fits.
The sliding-window rule is told in :mod:`servetune.planner.modelclass`' docstring, which re-exports every
public name here; the Mamba groups' rules are :mod:`servetune.planner.hybrid`'s. Pure arithmetic, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from servetune.planner.hybrid import _FULL, _MAMBA, _PARALLEL

__all__ = ["KVLayout", "group_size_for", "kv_layout"]

#: Sliding-window attention types vLLM keeps apart from full attention (``"full"`` and the hybrids' kinds:
#: :mod:`servetune.planner.hybrid`).
_SLIDING = "sliding"


def group_size_for(counts: Sequence[int]) -> int:
    """vLLM's layers per KV-cache group for attention types with these layer counts (uniform page size).

    Example:
        >>> group_size_for([29, 5]), group_size_for([12, 12]), group_size_for([32])
        (5, 12, 32)
    """
    counts = [c for c in counts if c > 0]
    if len(counts) <= 1:
        return counts[0] if counts else 1
    low, high = min(counts), max(counts)
    return high if high < low * 1.25 else low


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """How one worker's KV cache is paged: the block's bytes and the groups that share each block.

    ``page_bytes`` is one block of one layer; a block index is used by every group, each group
    holding ``group_size`` layers, so a block costs ``page_bytes * group_size``. ``groups`` is the
    attention type of each group (``"full"`` / ``"sliding"``).
    """

    page_bytes: int
    group_size: int
    groups: tuple[str, ...]
    sliding_window: int = 0
    #: A Mamba group's block size: ``mamba_block_size``, the ``max_model_len`` without prefix caching
    #: (:func:`~servetune.planner.hybrid.mamba_group_block_size`); 0 without Mamba groups.
    mamba_block_size: int = 0
    #: The Mamba cache mode (``"none"`` / ``"align"`` / ``"all"``): how many blocks a Mamba group holds a request.
    mamba_cache_mode: str = "none"

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * self.group_size

    def bytes_per_token(self, block_size: int) -> int:
        """KV bytes per token as vLLM counts tokens: every group's page (padded groups included) per block slot.

        For a model without sliding layers, ``2 x kv_heads x head_dim x dtype x layers``.
        """
        return self.block_bytes * len(self.groups) // block_size

    def tokens(self, num_blocks: int, block_size: int) -> int:
        """The "GPU KV cache size" vLLM logs up to 0.20.0: ``num_blocks // len(groups) * min_block_size``.

        ``min_block_size`` is the smallest group's block size (``kv_cache_utils.py``: line 1077 of 0.11.0,
        ``_report_kv_cache_config`` lines 1297-1306 of 0.19.0): a Mamba group's is ``max_model_len``.
        """
        smallest = min(block_size, self.mamba_block_size) if self.mamba_block_size else block_size
        return num_blocks // len(self.groups) * smallest

    def blocks_per_request(self, max_model_len: int, block_size: int, max_in_flight_tokens: int) -> int:
        """Blocks one ``max_model_len`` request takes (vLLM's ``get_max_concurrency_for_kv_cache_config``)."""
        full = -(-max_model_len // block_size)
        window = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len) if self.sliding_window else 0
        sliding = -(-window // block_size) + 1
        per_group = {_SLIDING: sliding, _MAMBA: self._mamba_blocks(max_model_len)}
        return sum(per_group.get(g, full) for g in self.groups)

    def _mamba_blocks(self, max_model_len: int) -> int:
        """Blocks a Mamba group holds for one request (``MambaSpec.max_memory_usage_bytes`` over its page;
        ``v1/kv_cache_interface.py`` lines 709-718 of 0.26.0, 261-263 of 0.11.1, speculative blocks left out): one
        state without prefix caching; two in 'align' mode (the running state and the last one cached); in 'all'
        mode one a ``mamba_block_size`` of ``max_model_len`` (0.11.1-0.14: ``cdiv(max_model_len, block_size)``
        in every mode, ``mamba_block_size`` being ``max_model_len`` without prefix caching)."""
        if self.mamba_cache_mode == "align":
            return 2
        if self.mamba_cache_mode == "all":
            return -(-max_model_len // self.mamba_block_size)
        return 1

    def longest_fitting_len(self, avail_bytes: int, max_model_len: int, block_size: int,
                            max_in_flight_tokens: int) -> int:
        """The longest ``max_model_len`` whose one request fits ``avail_bytes`` (0: none).

        vLLM's ``estimate_max_model_len`` (``vllm/v1/core/kv_cache_utils.py``): a binary search
        over the length, every group's blocks counted, so a sliding-window / global hybrid
        (gemma-2) pays for its global layers and its window at once.

        Example:
            >>> KVLayout(page_bytes=1, group_size=1, groups=("full", "sliding"), sliding_window=4096
            ...          ).longest_fitting_len(911, 8192, 16, 8192)
            7280
        """
        left, right, best = 1, max_model_len, 0
        while left <= right:
            mid = (left + right) // 2
            if self.blocks_per_request(mid, block_size, max_in_flight_tokens) * self.block_bytes <= avail_bytes:
                best, left = mid, mid + 1
            else:
                right = mid - 1
        return best


def kv_layout(model: Any, tp: int, stage: int, pp: int, block_size: int, kv_dtype_bytes: int,
              mamba_block_size: int = 0, mamba_cache_mode: str = "none") -> KVLayout:
    """The :class:`KVLayout` of one pipeline stage's worker (``model``: a ModelProfile).

    For a Mamba2 hybrid ``block_size`` is the raised attention block
    (:func:`~servetune.planner.hybrid.hybrid_block_size`) and ``mamba_block_size`` the Mamba groups'
    (:func:`~servetune.planner.hybrid.mamba_group_block_size`; ``max_model_len`` without prefix caching),
    ``mamba_cache_mode`` how many of them a request holds (:meth:`KVLayout.blocks_per_request`). vLLM
    groups the Mamba
    layers like any other type (``_get_kv_cache_groups_uniform_page_size``: groups of the smallest type's
    layer count, ``max`` when the largest is under 1.5 times it in 0.19.0 / 0.26.0; the planner keeps its
    earlier 1.25, which no modelled hybrid comes near).

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> kv_layout(load_model("llama-3.1-8b"), 1, 0, 1, 16, 2).block_bytes   # 32 layers x 16 tokens x 4 KiB
        2097152
    """
    if model.mla_kv_lora_rank:
        page = block_size * (model.mla_kv_lora_rank + model.mla_rope_dim) * kv_dtype_bytes
    else:
        page = 2 * block_size * model.kv_heads_per_gpu(tp) * model.head_dim * kv_dtype_bytes
    layers = model.stage_layers(pp)
    start = sum(layers[:stage])
    n = layers[stage]
    kinds = list(model.layer_types[start:start + n]) if model.layer_types else [_FULL] * n
    # Mamba layers share the attention page (their state padded up to it: hybrid_block_size); "mlp" layers hold none
    both = kinds.count(_PARALLEL)  # Falcon-H1: one attention and one Mamba layer each
    counts = {k: kinds.count(k) + (both if k != _SLIDING else 0) for k in (_FULL, _SLIDING, _MAMBA)}
    counts = {k: c for k, c in counts.items() if c}
    size = group_size_for(list(counts.values()))
    groups: list[str] = []
    for kind, count in counts.items():
        groups += [kind] * math.ceil(count / size)
    return KVLayout(page_bytes=page, group_size=size, groups=tuple(groups),
                    sliding_window=model.sliding_window if _SLIDING in counts else 0,
                    mamba_block_size=mamba_block_size if _MAMBA in counts else 0,
                    mamba_cache_mode=mamba_cache_mode if _MAMBA in counts else "none")
