"""A hybrid model's KV cache groups in the engine core: which groups, and the blocks they take and free.

Contract: :func:`kv_groups` is the grouping vLLM's hybrid KV cache manager gives a model with
sliding-window or Mamba layers beside full-attention ones (None: one group), and
:func:`mamba_pool_note` the one line ``servetune simulate`` prints where a Mamba hybrid's blocks are
counted short of vLLM's. :class:`HybridBlocks` is the block accounting of those groups that
:class:`servetune.sim.scheduler.SimScheduler` asks for: what a WAITING request's admission asks
and takes (:meth:`HybridBlocks.admit`), what a RUNNING request's sliding groups free before it
allocates (:meth:`HybridBlocks.slide`), and, for ``run_until_idle``'s bulk decoders, the same frees
counted together (:meth:`HybridBlocks.join_bulk`, :meth:`HybridBlocks.leave_bulk`,
:meth:`HybridBlocks.bulk_step`). Pure arithmetic over the pool's counters, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servetune.planner.modelclass import kv_layout
from servetune.sim.blocks import BlockPool, KVGroups

if TYPE_CHECKING:
    from servetune.planner.engine_config import EngineConfig
    from servetune.planner.modelinfo import ModelProfile
    from servetune.sim.request import SimRequest

__all__ = ["kv_groups", "mamba_pool_note", "HybridBlocks"]


def kv_groups(model: ModelProfile, config: EngineConfig) -> KVGroups | None:
    """The KV cache groups vLLM's hybrid KV cache manager gives ``model`` (None: one group, or
    neither sliding-window nor Mamba layers beside full-attention ones): the model's layers grouped
    as :func:`servetune.planner.modelclass.kv_layout` groups them (``kv_cache_utils.py``).

    The admission cap takes the config's ``max_in_flight_tokens`` (the planner's, by vLLM version).
    A Mamba hybrid's Mamba groups hold one block per running request (:class:`KVGroups`), as vLLM's
    ``MambaManager`` does in ``mamba_cache_mode`` 'none'; in 'align' / 'all' (prefix caching) the
    simulator counts them so too (:func:`mamba_pool_note`).
    """
    groups = kv_layout(model, 1, 0, 1, config.block_size, 2).groups
    full, sliding, mamba = groups.count("full"), groups.count("sliding"), groups.count("mamba")
    if not full or not (sliding or mamba):
        return None
    window = model.sliding_window if sliding else 0
    cap = (-(-min(window - 1 + config.max_in_flight_tokens, config.max_model_len) // config.block_size) + 1
           if sliding else 0)
    return KVGroups(full, sliding, window, config.block_size, cap, mamba)


def mamba_pool_note(model: ModelProfile, config: EngineConfig) -> str | None:
    """The one line ``servetune simulate`` prints where a Mamba hybrid's blocks are counted short of
    vLLM's (None elsewhere): with prefix caching (``mamba_cache_mode`` 'align' / 'all') vLLM's
    ``MambaManager`` holds a request up to 2 blocks a Mamba group ('align') or one per
    ``mamba_block_size`` tokens of its sequence in its admission gate ('all'), and caches their
    states; the simulator counts one block a Mamba group and caches the attention blocks only.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.memory import resolve_engine_config
        >>> from servetune.planner.modelinfo import load_model
        >>> m, gpu = load_model("granite-4.0-h-tiny"), get_gpu("H100-80GB")
        >>> mamba_pool_note(m, resolve_engine_config({}, m, gpu)) is None
        True
        >>> mamba_pool_note(m, resolve_engine_config({"enable_prefix_caching": True}, m, gpu))[:40]
        "granite-4.0-h-tiny: mamba_cache_mode 'al"
    """
    groups = kv_groups(model, config)
    mode = config.mamba_cache_mode
    if groups is None or not groups.mamba or mode == "none":
        return None
    more = ("up to 2 a Mamba group" if mode == "align"
            else "in its admission gate one a Mamba group per mamba_block_size tokens of the sequence")
    return (f"{model.name}: mamba_cache_mode '{mode}' (prefix caching) is simulated with one KV block per Mamba "
            f"group per request and no Mamba-state prefix cache; vLLM's pool holds a request {more}")


class HybridBlocks:
    """The blocks a hybrid's KV groups take and free, request by request and for the bulk decoders.

    Holds the bulk decoders past the window's edge, by the phase of the steps at which their
    sliding groups free a block (k % block_size), and those that reach the edge at a step. Every
    method but :meth:`end_bulk` needs ``groups`` (a hybrid's).
    """

    __slots__ = ("groups", "pool", "block_size", "_in_flight", "_dec_slide", "_dec_edge")

    def __init__(self, groups: KVGroups | None, pool: BlockPool, block_size: int, in_flight: bool) -> None:
        self.groups = groups
        self.pool = pool
        self.block_size = block_size
        self._in_flight = in_flight  # a step's tokens are unprocessed while the next forms
        self._dec_slide = [0] * block_size
        self._dec_edge: dict[int, list[SimRequest]] = {}

    def slide(self, req: SimRequest, pos: int, n: int, k: int) -> int:
        """A hybrid's running request about to get ``n`` tokens at step ``k`` (``pos`` new block-table
        entries): its sliding groups free the blocks out of the window first, on the processed-token
        basis (the tokens of the step before still in flight with async scheduling: vLLM's
        ``allocate_slots``, ``remove_skipped_blocks``). Returns the blocks it takes from the pool."""
        groups = self.groups
        assert groups is not None
        processed = req.computed - (req.lastn if self._in_flight and req.lastk == k - 1 else 0)
        skip = min(groups.skipped_blocks(processed), req.nblk)
        if skip > req.swskip:
            self.pool.give_anonymous((skip - req.swskip) * groups.sliding)
            req.swskip = skip
        req.lastk, req.lastn = k, n
        return pos * groups.total if pos > 0 else 0

    # -- a hybrid's bulk decoders: their sliding groups' frees, counted -----------------------------
    # A bulk decoder that joined at step k0 with c computed tokens has x = c - lag - window + 1
    # (lag: its one token in flight) at k0 and x + k - k0 at step k; its sliding groups free a block
    # at each step whose x is a positive multiple of the block size (what :meth:`slide` gives it).

    def join_bulk(self, req: SimRequest, k0: int) -> bool:
        """Whether ``req`` can decode in bulk from step ``k0``: its sliding groups freed what the
        step before left (one token in flight, no chunk), so each later step frees by the rule
        above. Registers it if so."""
        groups = self.groups
        assert groups is not None
        lag = int(self._in_flight)
        c = req.computed
        if (lag and req.lastn != 1) or req.swskip != groups.skipped_blocks(c - 1 - lag):
            return False
        x0 = c - lag - groups.window + 1
        if x0 > 0:
            self._dec_slide[(k0 - x0) % self.block_size] += 1
        else:  # reaches the window's edge (x = 1) later
            self._dec_edge.setdefault(k0 + 1 - x0, []).append(req)
        return True

    def leave_bulk(self, req: SimRequest, upto: int) -> None:
        """Undo :meth:`join_bulk` for a decoder leaving before step ``upto``."""
        groups = self.groups
        assert groups is not None
        k0 = req.dec
        x0 = req.computed - int(self._in_flight) - groups.window + 1
        if x0 > 0 or k0 + 1 - x0 < upto:  # past the edge (reached at a bulk step that ran)
            self._dec_slide[(k0 - x0) % self.block_size] -= 1
        else:
            self._dec_edge[k0 + 1 - x0].remove(req)

    def bulk_step(self, k: int, positions: int) -> tuple[int, int]:
        """The bulk decoders' blocks at step ``k``: (taken for ``positions`` new block-table entries,
        freed by their sliding groups)."""
        groups = self.groups
        assert groups is not None
        bs = self.block_size
        for req in self._dec_edge.pop(k, ()):
            x0 = req.computed - int(self._in_flight) - groups.window + 1
            self._dec_slide[(req.dec - x0) % bs] += 1
        return positions * groups.total, self._dec_slide[k % bs] * groups.sliding

    def admit(self, req: SimRequest, hits: int, cached: int, end: int) -> tuple[int, int]:
        """A hybrid's waiting request with ``hits`` prefix-cache blocks (``cached`` tokens) admitted
        up to ``end`` tokens: (the blocks vLLM's full-sequence admission gate asks for, the blocks
        it takes now). The prefix cache holds the first full group's blocks; the hit's entries of
        the other groups are taken as new blocks (a sliding group's only those inside the window),
        and each Mamba group's one block (:class:`KVGroups`) in both."""
        groups = self.groups
        assert groups is not None
        bs = self.block_size
        skip = min(groups.skipped_blocks(cached), hits) if groups.sliding else 0
        whole = -(-req.total // bs)
        other = (groups.full - 1) * hits + groups.sliding * (hits - skip) + groups.mamba
        gate = groups.full * (whole - hits) + groups.sliding * max(min(whole, groups.admission_cap) - hits, 0) + other
        take = groups.full * (-(-end // bs) - hits) + groups.sliding * (-(-end // bs) - hits) + other
        return gate, take

    def end_bulk(self) -> None:
        """Forget the bulk decoders still short of the window's edge (the bulk ended)."""
        self._dec_edge.clear()
