"""The stand-in's engine loop: the simulated engine core stepping in scaled wall time, its tokens to the streams.

Contract: :class:`EngineLoop` is the part of :class:`servetune.sim.server.SimServer` that owns the
engine: one asyncio task steps :class:`servetune.sim.scheduler.SimScheduler`, each step sleeping
``duration / speedup`` wall seconds (a host that falls too far behind stops owing time, once
warned), then hands its tokens to the waiting HTTP streams (:class:`Live`, one per prompt) and
counts them in the server's metrics; another logs vLLM's ``Engine 000:`` stats line every 10 s of
virtual time. Prompts reach the engine through :meth:`EngineLoop._request` (ValueError: vLLM would
refuse it), their prefix-cache groups found by :class:`PrefixIndex`. Injected runtime faults
(``--sim-fail runtime_crash`` / ``stall``) strike after ``--sim-fail-after-tokens``; an engine that
dies logs vLLM's crash, fails every live request and exits after a linger.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from servetune.sim import vllm_log
from servetune.sim._server_metrics import ServerMetrics
from servetune.sim.scheduler import SimScheduler
from servetune.sim.vllm_log import LogRecord

__all__ = ["Live", "PrefixIndex", "EngineLoop"]

_STATS_INTERVAL_S = 10.0  # VLLM_LOG_STATS_INTERVAL, virtual seconds
_RESYNC_SLACK_S = 0.02  # wall seconds the engine may fall behind before it stops trying to catch up


@dataclasses.dataclass
class Live:
    """One engine request (one prompt of one HTTP request) while the server tracks it."""

    rid: str
    index: int  # choice index inside its HTTP request
    prompt_tokens: int
    max_tokens: int
    arrival_v: float
    queue: asyncio.Queue[tuple[str, int, Any]]
    first_scheduled_v: float | None = None
    first_token_v: float | None = None
    last_token_v: float | None = None
    generated: int = 0


class PrefixIndex:
    """Maps prompts to simulator prefix groups: prompts sharing leading full KV blocks share a group.

    The first prompt seen with a given first block becomes the group's reference; a later prompt's
    shared prefix is its common prefix with that reference, in whole blocks. Bounded (LRU).
    """

    def __init__(self, block_size: int, capacity: int = 2048, keep_tokens: int = 8192) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.keep_tokens = keep_tokens
        self.groups: OrderedDict[tuple[Any, ...], tuple[int, tuple[Any, ...]]] = OrderedDict()
        self.next_group = 0

    def lookup(self, tokens: Sequence[Any]) -> tuple[int | None, int]:
        bs = self.block_size
        if len(tokens) < bs:
            return None, 0
        head = tuple(tokens[:bs])
        entry = self.groups.get(head)
        if entry is None:
            gid = self.next_group
            self.next_group += 1
            self.groups[head] = (gid, tuple(tokens[: self.keep_tokens]))
            if len(self.groups) > self.capacity:
                self.groups.popitem(last=False)
            return gid, len(tokens)  # all of its full blocks may serve later prompts of the group
        self.groups.move_to_end(head)
        gid, ref = entry
        n = 0
        for a, b in zip(ref, tokens):
            if a != b:
                break
            n += 1
        return gid, (n // bs) * bs


class EngineLoop:
    """The engine core's task, the stats task, and the live requests between the engine and the
    HTTP streams (a mixin of :class:`servetune.sim.server.SimServer`)."""

    # The server's state this part reads and sets (``SimServer.__init__`` and ``SimServer.run`` make it).
    ns: argparse.Namespace
    model: Any
    gpu: Any
    config: Any
    plan: Any
    sched: Any
    speedup: float
    fail: str | None
    stop_event: asyncio.Event
    wake: asyncio.Event
    dead: bool
    stalled: bool
    warned_behind: bool
    exit_code: int
    live: dict[str, Live]
    wall_anchor: float
    virt_anchor: float

    if TYPE_CHECKING:  # the server's own output and clock
        def emit(self, records: Iterable[LogRecord]) -> None: ...
        def vnow(self) -> float: ...

    def _init_engine(self) -> None:
        self.sched = SimScheduler(self.model, self.gpu, self.config, self.plan.num_gpu_blocks,
                                  seed=self.ns.seed or 0)
        self.prefix_index = PrefixIndex(self.config.block_size)
        self.metrics = ServerMetrics(self.config.max_model_len)

    def _request(self, index: int, prompt: Sequence[Any], max_tokens: int,
                 queue: asyncio.Queue[tuple[str, int, Any]]) -> Live:
        """Hand one prompt to the engine (ValueError: vLLM would refuse it)."""
        sched = self.sched
        # A busy engine's own clock is "now" (the wall-derived clock may run ahead of it when the
        # host cannot keep up with the speedup); an idle engine catches up with the wall clock.
        if sched.has_work():
            arrival = sched.now_s
        else:
            arrival = sched.now_s = max(sched.now_s, self.vnow())
        group, prefix = (None, 0)
        if self.config.enable_prefix_caching:
            group, prefix = self.prefix_index.lookup(prompt)
        rid = f"cmpl-{uuid.uuid4().hex}-{index}"
        sched.add_request(rid, len(prompt), max_tokens, arrival, prefix_group=group, prefix_tokens=prefix)
        live = Live(rid, index, len(prompt), max_tokens, arrival, queue)
        self.live[rid] = live
        self.metrics.h["vllm:request_params_max_tokens"].observe(max_tokens)
        self.metrics.h["vllm:request_max_num_generation_tokens"].observe(max_tokens)
        self.metrics.h["vllm:request_params_n"].observe(1)
        self.wake.set()
        return live

    async def _engine_loop(self) -> None:
        sched = self.sched
        after = max(1, self.ns.sim_fail_after_tokens)
        while True:
            if self.stalled or self.dead:
                await asyncio.Event().wait()  # parked for good; cancelled at shutdown
            if not sched.has_work():
                self.wake.clear()
                await self.wake.wait()
                continue
            try:
                step = sched.step()
            except Exception as exc:  # noqa: BLE001 - the simulated engine core dying is a result
                self._die(f"{type(exc).__name__}: {exc}")
                continue
            end_v = step.start_s + step.duration_s
            target = self.wall_anchor + (end_v - self.virt_anchor) / self.speedup
            delay = target - time.monotonic()
            if delay < -_RESYNC_SLACK_S:  # too far behind: stop owing time rather than burst
                self.wall_anchor, self.virt_anchor = time.monotonic(), end_v
                if not self.warned_behind:
                    self.warned_behind = True
                    self.emit([LogRecord(end_v, "APIServer", "WARNING", "sim_server.py:1",
                                         f"[servetune sim] the host cannot keep up with --sim-speedup "
                                         f"{self.speedup:g}; client-side latencies are stretched from here on")])
            elif delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
            self._deliver(step, end_v)
            if self.fail in ("runtime_crash", "stall") and sched.generation_tokens >= after:
                if self.fail == "stall":
                    self.stalled = True
                else:
                    self._die("CUDA error: an illegal memory access was encountered")

    def _deliver(self, step: Any, end_v: float) -> None:
        h = self.metrics.h
        if step.prefill_tokens + step.decode_tokens:
            h["vllm:iteration_tokens_total"].observe(step.prefill_tokens + step.decode_tokens)
        finishing = set(step.finished)
        for rid, n in step.new_tokens.items():
            live = self.live.get(rid)
            if live is None:
                continue
            if live.first_scheduled_v is None:
                live.first_scheduled_v = step.start_s
                h["vllm:request_queue_time_seconds"].observe(max(0.0, step.start_s - live.arrival_v))
            if n <= 0:
                continue
            if live.first_token_v is None:
                live.first_token_v = end_v
                h["vllm:time_to_first_token_seconds"].observe(max(0.0, end_v - live.arrival_v))
                self.metrics.c_prompt_tokens += live.prompt_tokens
            else:
                h["vllm:inter_token_latency_seconds"].observe(max(0.0, end_v - (live.last_token_v or end_v)))
            live.last_token_v = end_v
            live.generated += n
            self.metrics.c_generation_tokens += n
            # The last token travels with its finish_reason, in the same chunk, as in vLLM.
            live.queue.put_nowait(("tokens", live.index, (n, "length" if rid in finishing else None)))
            if rid in finishing:
                finishing.discard(rid)
                self.live.pop(rid, None)
                self._observe_finished(live, end_v)
        for rid in finishing:  # finished without a token this step (not expected; kept for safety)
            live = self.live.pop(rid, None)
            if live is not None:
                self._observe_finished(live, end_v)
                live.queue.put_nowait(("tokens", live.index, (0, "length")))

    def _observe_finished(self, live: Live, end_v: float) -> None:
        h = self.metrics.h
        first = live.first_token_v if live.first_token_v is not None else end_v
        sched_v = live.first_scheduled_v if live.first_scheduled_v is not None else live.arrival_v
        h["vllm:e2e_request_latency_seconds"].observe(max(0.0, end_v - live.arrival_v))
        h["vllm:request_inference_time_seconds"].observe(max(0.0, end_v - sched_v))
        h["vllm:request_prefill_time_seconds"].observe(max(0.0, first - sched_v))
        h["vllm:request_decode_time_seconds"].observe(max(0.0, end_v - first))
        if live.generated > 1:
            h["vllm:request_time_per_output_token_seconds"].observe((end_v - first) / (live.generated - 1))
        h["vllm:request_prompt_tokens"].observe(live.prompt_tokens)
        h["vllm:request_generation_tokens"].observe(live.generated)
        self.metrics.c_success["length"] += 1

    def _die(self, reason: str) -> None:
        """The engine core died: log it, fail every live request, answer 503, exit after a linger."""
        if self.dead:
            return
        self.dead = True
        self.emit(vllm_log.runtime_crash_records(self.vnow()))
        self._fail_all("EngineCore encountered an issue. See stack trace (above) for the root cause.")
        linger = float(os.environ.get("SERVETUNE_SIM_DEATH_LINGER_S", "1.0"))
        self.exit_code = 1
        asyncio.get_running_loop().call_later(linger, self.stop_event.set)

    def _fail_all(self, message: str) -> None:
        for live in list(self.live.values()):
            live.queue.put_nowait(("error", live.index, message))
        self.live.clear()

    async def _stats_loop(self) -> None:
        sched = self.sched
        last_prompt, last_gen, was_active = 0, 0, False
        while True:
            await asyncio.sleep(_STATS_INTERVAL_S / self.speedup)
            prompt, gen = sched.prompt_tokens_computed, sched.generation_tokens
            active = prompt != last_prompt or gen != last_gen or sched.num_running or sched.num_waiting
            if active or was_active:
                # vLLM logs the rate over its most recent 1,000 lookups, not since the start.
                hit_rate = sched.logged_hit_rate() or 0.0
                msg = vllm_log.stats_message((prompt - last_prompt) / _STATS_INTERVAL_S,
                                             (gen - last_gen) / _STATS_INTERVAL_S, sched.num_running,
                                             sched.num_waiting, sched.kv_usage, hit_rate)
                self.emit([LogRecord(self.vnow(), "APIServer", "INFO", "loggers.py:310", msg)])
            last_prompt, last_gen, was_active = prompt, gen, bool(active)
