"""HTTP load generator: sends a :class:`~servetune.workload.Workload` to an OpenAI-compatible server.

Requests go to streaming ``/v1/completions`` with ``ignore_eos`` and ``max_tokens``, prompts as
token-id lists (exact prompt lengths without a tokenizer; vLLM accepts them). Each request records
TTFT (send to first streamed token), every inter-chunk gap (ITL) and E2E, exactly as
``vllm bench serve`` measures them, so :func:`servetune.result.summarize` gives figures with the
same meaning. Warm-up requests run first and are excluded.

A request fails (its record carries ``error``) on an HTTP error, a dropped connection, an error
chunk in the stream (vLLM's answer when the engine dies mid-stream) or a stream that ends without
``[DONE]``. The load stops early, and :class:`LoadRun` says why, when no token arrives on any
in-flight stream for ``stall_timeout_s`` (a stalled engine: the requests left are recorded as
failed) or when ``should_stop`` gives a reason (the server process exited).

Example (against a running server)::

    records, duration = asyncio.run(run_workload("http://127.0.0.1:8000", "model", workload))
    run = asyncio.run(run_load("http://127.0.0.1:8000", "model", workload, stall_timeout_s=60))
    run.stalled, run.duration_s
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp

from servetune.result import RequestRecord
from servetune.workload import RequestSpec, Workload

__all__ = ["LoadRun", "LoadProgress", "run_load", "run_workload", "prompt_token_ids"]

# Token ids drawn from the middle of the vocabulary: clear of special tokens at either end.
_TOKEN_LO, _TOKEN_HI = 100, 30000


def prompt_token_ids(spec: RequestSpec, index: int, seed: int) -> list[int]:
    """Deterministic prompt ids; requests of one prefix group share their first ``prefix_tokens``."""
    rng = random.Random(seed * 1_000_003 + index)
    ids = [rng.randint(_TOKEN_LO, _TOKEN_HI) for _ in range(spec.prompt_tokens)]
    if spec.prefix_group is not None and spec.prefix_tokens:
        prefix_rng = random.Random(seed * 7_777 + spec.prefix_group)
        n = min(spec.prefix_tokens, spec.prompt_tokens)
        ids[:n] = [prefix_rng.randint(_TOKEN_LO, _TOKEN_HI) for _ in range(n)]
    return ids


class _Activity:
    """When the server last showed progress, and how many requests are in flight (stall detection).

    Progress is a streamed chunk or a request's end. The clock also restarts when a request goes
    out while none was in flight (an idle gap between Poisson arrivals is not a stall), but not on
    every send: arrivals into a stalled server must not hide the stall.
    """

    def __init__(self) -> None:
        self.inflight = 0
        self.last_progress = time.perf_counter()
        self.sent_total = 0  # requests sent (warm-up included)
        self.chunks = 0  # streamed text chunks (about one token each), warm-up included

    def sent(self) -> None:
        if self.inflight == 0:
            self.last_progress = time.perf_counter()
        self.inflight += 1
        self.sent_total += 1

    def progressed(self) -> None:
        self.last_progress = time.perf_counter()

    def ended(self) -> None:
        self.inflight -= 1
        self.last_progress = time.perf_counter()


async def _one_request(
    session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec, index: int, seed: int,
    t0: float, timeout_s: float, activity: _Activity | None = None,
) -> RequestRecord:
    activity = activity or _Activity()
    activity.sent()
    try:
        return await _stream_request(session, url, model, spec, index, seed, t0, timeout_s, activity)
    finally:
        activity.ended()


async def _stream_request(
    session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec, index: int, seed: int,
    t0: float, timeout_s: float, activity: _Activity,
) -> RequestRecord:
    body = {
        "model": model,
        "prompt": spec.prompt if spec.prompt is not None else prompt_token_ids(spec, index, seed),
        "max_tokens": spec.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    sent = time.perf_counter()
    first: float | None = None
    last = sent
    gaps: list[float] = []
    chunks = 0
    completion_tokens: int | None = None
    prompt_tokens = spec.prompt_tokens
    done = False

    def failed(error: str) -> RequestRecord:
        return RequestRecord(index, prompt_tokens, chunks, sent - t0, None if first is None else first - t0,
                             None, tuple(gaps), error=error[:300])

    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                return RequestRecord(index, prompt_tokens, 0, sent - t0, None, None, error=f"HTTP {resp.status}: {text}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                data = json.loads(payload)
                activity.progressed()
                if isinstance(data, dict) and data.get("error"):
                    # vLLM streams the engine's failure as an error chunk (then [DONE]).
                    err = data["error"]
                    message = err.get("message", err) if isinstance(err, dict) else err
                    return failed(f"stream error: {message}")
                usage = data.get("usage")
                if usage:
                    completion_tokens = usage.get("completion_tokens", completion_tokens)
                    prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
                choices = data.get("choices") or []
                if choices and choices[0].get("text") is not None:
                    activity.chunks += 1
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        return failed(f"{type(exc).__name__}: {exc}")
    if not done:
        return failed("the stream ended without [DONE] (the server closed the connection)")
    end = time.perf_counter()
    return RequestRecord(
        request_id=index, prompt_tokens=prompt_tokens,
        output_tokens=completion_tokens if completion_tokens is not None else chunks,
        arrival_s=sent - t0, first_token_s=None if first is None else first - t0, finish_s=end - t0,
        itl_s=tuple(gaps),
    )


@dataclasses.dataclass
class LoadRun:
    """The measured requests (sorted by id), the measured window, and why the load stopped early."""

    records: list[RequestRecord]
    duration_s: float
    stopped: str | None = None  # None: every request was sent and answered (or the outcome was decided)
    stalled: bool = False  # stopped because no token arrived on any in-flight stream for the stall timeout
    #: ``decide``'s reason when the outcome was decided early: the load stopped sending, the
    #: requests in flight were cancelled and ``records`` holds the answered ones only.
    early_stopped: str | None = None
    sent: int = 0  # measured requests sent (fewer than the workload's after an early stop)


@dataclasses.dataclass(frozen=True)
class LoadProgress:
    """What the load has seen so far of the measured window (the input of ``decide``)."""

    answered: int  # measured requests answered (successfully or not)
    total: int  # measured requests in the workload
    elapsed_s: float  # since the measured window began
    streamed_chunks: int  # text chunks streamed in the window (about one output token each)


async def _warm_up(session: aiohttp.ClientSession, url: str, model: str, warm: Sequence[RequestSpec],
                   workload: Workload, request_timeout_s: float, activity: _Activity) -> None:
    """Send the warm-up requests, at most ``workload.concurrency`` at a time (all at once for a
    rate-driven workload), and wait for every answer. Their records are not kept."""
    limit = asyncio.Semaphore(max(1, workload.concurrency or len(warm) or 1))

    async def one(i: int, spec: RequestSpec) -> None:
        async with limit:
            await _one_request(session, url, model, spec, -1 - i, workload.seed, time.perf_counter(),
                               request_timeout_s, activity)

    await asyncio.gather(*(one(i, spec) for i, spec in enumerate(warm)))


async def run_workload(
    base_url: str,
    model: str,
    workload: Workload,
    *,
    request_timeout_s: float = 600.0,
    on_tick: Callable[[], Awaitable[None]] | None = None,
    tick_interval_s: float = 0.5,
) -> tuple[list[RequestRecord], float]:
    """Send the workload; return the measured records and the measured window in seconds.

    ``on_tick`` is awaited every ``tick_interval_s`` during the measured window (the metrics
    sampler hooks in here to read the KV-usage and queue gauges). :func:`run_load` is the same with
    stall detection and an early stop.
    """
    run = await run_load(base_url, model, workload, request_timeout_s=request_timeout_s, on_tick=on_tick,
                         tick_interval_s=tick_interval_s)
    return run.records, run.duration_s


async def run_load(
    base_url: str,
    model: str,
    workload: Workload,
    *,
    request_timeout_s: float = 600.0,
    stall_timeout_s: float | None = None,
    should_stop: Callable[[], str | None] | None = None,
    on_tick: Callable[[], Awaitable[None]] | None = None,
    tick_interval_s: float = 0.5,
    decide: Callable[[LoadProgress], str | None] | None = None,
) -> LoadRun:
    """Send the workload (warm-up first); stop early on a stall or when ``should_stop`` says why.

    ``decide`` is asked during the measured window (with the watchdog's period) whether the
    trial's outcome is already decided (:mod:`servetune.engines.early_stop`); a reason ends the window
    like ``should_stop`` does, but it is not a failure: the load stops sending, the requests in
    flight are cancelled, and the run reports ``early_stopped`` with the answered records only.

    The stall is server-wide, not per request: a request may legitimately wait in vLLM's queue far
    longer than ``stall_timeout_s`` while others stream, but a healthy engine that has work emits a
    token every step. Requests not answered when the load stops are recorded as failed with the
    reason. Example::

        run = asyncio.run(run_load(url, "model", workload, stall_timeout_s=60))
    """
    url = base_url.rstrip("/") + "/v1/completions"
    all_specs = workload.requests(include_warmup=True)
    warm, specs = all_specs[: workload.warmup_requests], all_specs[workload.warmup_requests:]
    activity = _Activity()
    out: list[RequestRecord] = []
    t0 = time.perf_counter()
    measuring = False
    window_start = {"sent": 0, "chunks": 0}  # the counters when the measured window began
    ticked: list[bool] = []  # on_tick ran at least once in the window
    early: dict[str, Any] = {}  # why the load stopped early ("reason"), and whether it was a stall
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def send_all() -> None:
            nonlocal t0, measuring
            # The warm-up requests go out together, up to the workload's concurrency (one after
            # another they cost an 8B trial on the H200 about 4 s more, every trial), and the window
            # opens once all are answered: its first request meets an idle, warmed server either way.
            await _warm_up(session, url, model, warm, workload, request_timeout_s, activity)
            t0, measuring = time.perf_counter(), True
            window_start.update(sent=activity.sent_total, chunks=activity.chunks)
            opened.set()
            await _dispatch(session, url, model, specs, workload, t0, request_timeout_s, activity, out)

        opened = asyncio.Event()  # the measured window began
        load = asyncio.create_task(send_all())
        stop = asyncio.Event()

        async def watchdog() -> None:
            check_s = min(0.5, stall_timeout_s / 4) if stall_timeout_s else 0.5
            if decide is not None:  # decide on the sampler's clock: it reads the counters it needs
                check_s = min(check_s, tick_interval_s)
            while not load.done():
                await asyncio.sleep(check_s)
                why, stalled = _stop_reason(activity, stall_timeout_s, should_stop)
                if why is not None:
                    early.update(reason=why, stalled=stalled)
                    load.cancel()
                    return
                decided = decide(LoadProgress(
                    answered=len(out), total=len(specs), elapsed_s=time.perf_counter() - t0,
                    streamed_chunks=activity.chunks - window_start["chunks"])) if decide and measuring else None
                if decided is not None:
                    early.update(decided=decided)
                    load.cancel()
                    return

        tick_task = asyncio.create_task(_ticker(on_tick, opened, stop, lambda: measuring, ticked, tick_interval_s))
        dog = asyncio.create_task(watchdog()) if (stall_timeout_s or should_stop or decide) else None
        try:
            await load
        except asyncio.CancelledError:
            if not early:  # cancelled from outside, not by the watchdog
                raise
        finally:
            duration = time.perf_counter() - t0 if measuring else 0.0
            stop.set()
            await tick_task
            if dog is not None:
                dog.cancel()
                await asyncio.gather(dog, return_exceptions=True)
    sent = activity.sent_total - window_start["sent"] if measuring else 0
    return _load_run(out, specs, workload, early, duration, sent)


async def _ticker(on_tick: Callable[[], Awaitable[None]] | None, opened: asyncio.Event, stop: asyncio.Event,
                  measuring: Callable[[], bool], ticked: list[bool], tick_interval_s: float) -> None:
    """Call ``on_tick`` every ``tick_interval_s`` through the measured window, at least once."""
    if on_tick is None:
        return
    # The first sample is taken as the window opens: a window shorter than one tick
    # interval still gets one (the gauges are only ever read here).
    waits = [asyncio.ensure_future(opened.wait()), asyncio.ensure_future(stop.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    while not stop.is_set() or (measuring() and not ticked):
        if measuring():
            await on_tick()
            ticked.append(True)
        try:
            await asyncio.wait_for(stop.wait(), tick_interval_s)
        except asyncio.TimeoutError:
            pass


def _stop_reason(activity: _Activity, stall_timeout_s: float | None,
                 should_stop: Callable[[], str | None] | None) -> tuple[str | None, bool]:
    """Why the load must stop now (the caller's reason, or a server-wide stall), and whether it stalled."""
    idle = time.perf_counter() - activity.last_progress
    why = should_stop() if should_stop is not None else None
    stalled = (why is None and stall_timeout_s is not None and stall_timeout_s != 0 and activity.inflight > 0
               and idle > stall_timeout_s)
    if stalled:
        why = (f"stalled: no token on any of {activity.inflight} in-flight streams for "
               f"{idle:.1f} s (stall timeout {stall_timeout_s:g} s)")
    return why, stalled


def _load_run(out: list[RequestRecord], specs: Sequence[RequestSpec], workload: Workload, early: Mapping[str, Any],
              duration: float, sent: int) -> LoadRun:
    """The run's result: an early decision keeps the answered records only; any other early stop
    records every unanswered request as failed with the reason, so each request has a record."""
    if early.get("decided"):  # not a failure: the unsent and cancelled requests are simply not measured
        out.sort(key=lambda r: r.request_id)
        return LoadRun(out, duration, early_stopped=early["decided"], sent=sent)
    if early:
        seen = {r.request_id for r in out}
        offset = workload.warmup_requests
        out += [RequestRecord(i + offset, spec.prompt_tokens, 0, spec.arrival_s or 0.0, None, None,
                              error=f"not answered: {early['reason']}"[:300])
                for i, spec in enumerate(specs) if i + offset not in seen]
    out.sort(key=lambda r: r.request_id)
    return LoadRun(out, duration, early.get("reason"), stalled=bool(early.get("stalled")), sent=sent)


async def _dispatch(
    session: aiohttp.ClientSession, url: str, model: str, specs: Sequence[RequestSpec], workload: Workload,
    t0: float, timeout_s: float, activity: _Activity, out: list[RequestRecord],
) -> None:
    """Send ``specs``; each record is appended to ``out`` as it ends (an early stop keeps them)."""
    offset = workload.warmup_requests
    if specs and specs[0].arrival_s is not None:  # timed: Poisson rate or a trace
        limit = asyncio.Semaphore(workload.concurrency) if workload.concurrency else None

        async def timed(i: int, spec: RequestSpec) -> None:
            delay = (spec.arrival_s or 0.0) - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                out.append(await _one_request(session, url, model, spec, i, workload.seed, t0, timeout_s, activity))
                return
            async with limit:
                out.append(await _one_request(session, url, model, spec, i, workload.seed, t0, timeout_s, activity))

        await asyncio.gather(*(timed(i + offset, s) for i, s in enumerate(specs)))
        return
    # Closed loop: ``concurrency`` workers each take the next request as soon as one finishes.
    queue = list(enumerate(specs))
    queue.reverse()

    async def worker() -> None:
        while queue:
            i, spec = queue.pop()
            out.append(await _one_request(session, url, model, spec, i + offset, workload.seed, t0, timeout_s,
                                          activity))

    await asyncio.gather(*(worker() for _ in range(min(workload.concurrency or 1, len(specs)))))
