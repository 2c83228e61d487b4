"""HTTP load generator: sends a :class:`~servetune.workload.Workload` to an OpenAI-compatible server.

Requests go to streaming ``/v1/completions`` with ``ignore_eos`` and ``max_tokens``, prompts as
token-id lists (exact prompt lengths without a tokenizer; vLLM accepts them). Each request records
TTFT (send to first streamed token), every inter-chunk gap (ITL) and E2E, exactly as
``vllm bench serve`` measures them, so :func:`servetune.result.summarize` gives figures with the
same meaning. Warm-up requests run first and are excluded.

Example (against a running server)::

    records, duration = asyncio.run(run_workload("http://127.0.0.1:8000", "model", workload))
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp

from servetune.result import RequestRecord
from servetune.workload import RequestSpec, Workload

__all__ = ["run_workload", "prompt_token_ids"]

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


async def _one_request(
    session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec, index: int, seed: int,
    t0: float, timeout_s: float,
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
                    break
                data = json.loads(payload)
                usage = data.get("usage")
                if usage:
                    completion_tokens = usage.get("completion_tokens", completion_tokens)
                    prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
                choices = data.get("choices") or []
                if choices and choices[0].get("text") is not None:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        return RequestRecord(index, prompt_tokens, chunks, sent - t0, None if first is None else first - t0,
                             None, tuple(gaps), error=f"{type(exc).__name__}: {exc}"[:300])
    end = time.perf_counter()
    return RequestRecord(
        request_id=index, prompt_tokens=prompt_tokens,
        output_tokens=completion_tokens if completion_tokens is not None else chunks,
        arrival_s=sent - t0, first_token_s=None if first is None else first - t0, finish_s=end - t0,
        itl_s=tuple(gaps),
    )


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
    sampler hooks in here to read the KV-usage and queue gauges).
    """
    url = base_url.rstrip("/") + "/v1/completions"
    all_specs = workload.requests(include_warmup=True)
    warm, specs = all_specs[: workload.warmup_requests], all_specs[workload.warmup_requests:]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i, spec in enumerate(warm):
            await _one_request(session, url, model, spec, -1 - i, workload.seed, time.perf_counter(), request_timeout_s)
        t0 = time.perf_counter()
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set() and on_tick is not None:
                await on_tick()
                try:
                    await asyncio.wait_for(stop.wait(), tick_interval_s)
                except asyncio.TimeoutError:
                    pass

        tick_task = asyncio.create_task(ticker())
        records = await _dispatch(session, url, model, specs, workload, t0, request_timeout_s)
        duration = time.perf_counter() - t0
        stop.set()
        await tick_task
    records.sort(key=lambda r: r.request_id)
    return records, duration


async def _dispatch(
    session: aiohttp.ClientSession, url: str, model: str, specs: Sequence[RequestSpec], workload: Workload,
    t0: float, timeout_s: float,
) -> list[RequestRecord]:
    offset = workload.warmup_requests
    if specs and specs[0].arrival_s is not None:  # timed: Poisson rate or a trace
        limit = asyncio.Semaphore(workload.concurrency) if workload.concurrency else None

        async def timed(i: int, spec: RequestSpec) -> RequestRecord:
            delay = (spec.arrival_s or 0.0) - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                return await _one_request(session, url, model, spec, i, workload.seed, t0, timeout_s)
            async with limit:
                return await _one_request(session, url, model, spec, i, workload.seed, t0, timeout_s)

        return list(await asyncio.gather(*(timed(i + offset, s) for i, s in enumerate(specs))))
    # Closed loop: ``concurrency`` workers each take the next request as soon as one finishes.
    queue = list(enumerate(specs))
    queue.reverse()
    out: list[RequestRecord] = []

    async def worker() -> None:
        while queue:
            i, spec = queue.pop()
            out.append(await _one_request(session, url, model, spec, i + offset, workload.seed, t0, timeout_s))

    await asyncio.gather(*(worker() for _ in range(min(workload.concurrency or 1, len(specs)))))
    return out
