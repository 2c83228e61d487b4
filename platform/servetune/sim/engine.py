"""The simulated vLLM V1 engine: the real scheduler's decisions, in virtual time.

Contract (shared with the real engine): :func:`simulate` takes a model, a GPU, a resolved
:class:`~servetune.planner.memory.EngineConfig` and a :class:`~servetune.workload.Workload` and returns a
:class:`~servetune.result.TrialResult` with ``backend="sim"``. A configuration that cannot start
returns the memory plan's failure status and vLLM's own error text, without running anything.

:class:`SimScheduler` is one engine core, stepping the way vLLM's V1 ``Scheduler.schedule()`` does
(vllm-internals.md §4; 0.26 behaviour):

* RUNNING requests first, in admission order, each taking ``total - computed`` tokens (1 for a
  decode, the rest of the prompt for a partial prefill), capped by ``long_prefill_token_threshold``
  and the step's token budget ``max_num_batched_tokens``.
* A running request that cannot get the KV blocks it needs preempts the LAST running request
  (recompute: its blocks are freed, its progress reset so prompt + generated tokens become the new
  prefill, and it goes to the FRONT of the waiting queue); if it is itself the last, it stops the
  running loop.
* With async scheduling (vLLM >= 0.16, one engine stage) the scheduler forms a batch while the
  step before it runs (``max_concurrent_batches`` 2): a request that reaches the engine core after
  that step began waits for the batch after it, so its first token comes one step later than a
  scheduler at the step's start would give it (``Calibration.schedule_ahead``; vLLM's own
  ``request_prefill_time`` histograms ran about twice the simulator's before it, on every closed
  loop of two held-out H200 hosts, ``benchmarks/ttft_split.py``).
* WAITING requests are admitted, in order, only when nothing was preempted this step, while the
  budget lasts and fewer than ``max_num_seqs`` run; with ``scheduler_reserve_full_isl`` (vLLM
  >= 0.19) a request is admitted only if blocks for its whole current sequence are free.
  Head-of-line blocking: the first one that does not fit stops admission.
* KV blocks of ``block_size`` tokens; block 0 is vLLM's null block, so ``num_gpu_blocks - 1`` are
  usable and KV usage is ``1 - free / (num_gpu_blocks - 1)``.
* Prefix caching: full blocks of a prefix group's shared prefix are cached by content; a new
  request hits the longest chain of cached full blocks, at
  most ``num_tokens - 1`` tokens (the last token is always recomputed). Hit blocks are shared and
  ref-counted; cached blocks no request holds stay evictable in a FIFO free queue and count as free.
* The step that computes the last prompt token samples the first output token (TTFT); every later
  step that schedules a request gives it one token; requests stop at ``max_tokens`` (ignore_eos).

Step durations come from :class:`servetune.sim.perf.PerfModel`. Requests reach the engine core, and
clients their tokens, through vLLM's API server loop (:class:`servetune.sim.frontend.ApiServer`):
a request enters WAITING once its intake is done, and a step's tokens count as received when the
loop has drained them and the load generator has read their chunks.

Example:
    >>> from servetune.planner.gpus import get_gpu
    >>> from servetune.planner.memory import resolve_engine_config
    >>> from servetune.planner.modelinfo import load_model
    >>> from servetune.workload import Workload
    >>> model, gpu = load_model("servetune-test-850m"), get_gpu("H200")
    >>> config = resolve_engine_config({"gpu_memory_utilization": 0.5, "max_num_seqs": 64}, model, gpu)
    >>> w = Workload.from_dict({"input_len": 1024, "output_len": 256, "num_requests": 128, "concurrency": 64})
    >>> r = simulate(model, gpu, config, w)
    >>> r.status.value, r.completed, r.preemptions
    ('ok', 128, 0)
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import math
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from servetune.planner.memory import plan_memory
from servetune.result import RequestRecord, TrialResult, TrialStatus, summarize
from servetune.sim import vllm_log
from servetune.sim.frontend import ApiServer
from servetune.sim.perf import PerfModel
from servetune.vllm_version import version_tuple

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.memory import EngineConfig, MemoryPlan
    from servetune.planner.modelinfo import ModelProfile
    from servetune.workload import Workload

__all__ = ["StepResult", "RequestState", "SimScheduler", "simulate", "FRONTEND_BOUND_SHARE", "frontend_bound_note",
           "host_api_cpu_factor"]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one engine step did."""

    start_s: float
    duration_s: float
    new_tokens: dict[str, int]  # request id -> output tokens produced in this step (0/1 without spec decoding)
    finished: list[str]
    preempted: list[str]
    prefill_tokens: int
    decode_tokens: int


@dataclasses.dataclass(frozen=True)
class RequestState:
    """A snapshot of one request inside the scheduler (for tests and debugging)."""

    request_id: str
    status: str  # "pending" (sent, in the API server) | "waiting" | "running" | "finished"
    num_computed_tokens: int
    num_output_tokens: int
    num_blocks: int
    num_preemptions: int
    first_token_s: float | None
    finish_s: float | None


class _Req:
    """Mutable per-request state; ``__slots__`` because the hot loop touches it every step."""

    __slots__ = ("rid", "prompt", "max_tokens", "arrival", "computed", "total", "output", "nblk",
                 "shared", "group", "npb", "token_steps", "preemptions", "finish_step", "status",
                 "order")

    def __init__(self, rid: str, prompt: int, max_tokens: int, arrival: float, group: int | None,
                 prefix_blocks: int, order: int) -> None:
        self.rid = rid
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.computed = 0  # tokens whose KV is computed
        self.total = prompt  # prompt + generated tokens (vLLM's num_tokens)
        self.output = 0
        self.nblk = 0  # KV blocks held (shared + private)
        self.shared: list[tuple[int, int, int]] = []  # cache keys of the first len(shared) blocks
        self.group = group
        self.npb = prefix_blocks  # full blocks of the group's shared prefix
        self.token_steps: list[int] = []  # index of the step that produced each output token
        self.preemptions = 0
        self.finish_step = -1
        self.status = "pending"
        self.order = order


class _BlockPool:
    """vLLM's BlockPool, by counts: a FIFO free queue whose entries are anonymous runs or cached blocks.

    Cache keys: ``(0, group, index)`` for a prefix group's shared blocks (other blocks hold random
    tokens nobody else asks for, so they are anonymous). ``cache[key] = [ref, gen]``;
    a queue entry ``(key, gen)`` is stale once the block was touched again (lazy deletion).
    """

    __slots__ = ("num_free", "usable", "fresh", "queue", "cache", "caching")

    def __init__(self, usable: int, caching: bool) -> None:
        self.usable = usable
        self.num_free = usable  # fresh + anonymous queued + evictable cached
        self.fresh = usable  # never-used blocks sit at the head of the free queue
        self.queue: collections.deque[Any] = collections.deque()
        self.cache: dict[tuple[int, int, int], list[int]] = {}
        self.caching = caching

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

    def release_key(self, key: tuple[int, int, int]) -> None:
        """Drop one reference to a cached block; at zero it becomes evictable (still a hit)."""
        state = self.cache[key]
        state[0] -= 1
        if state[0] == 0:
            state[1] += 1
            self.queue.append((key, state[1]))
            self.num_free += 1

    def offer_if_new(self, key: tuple[int, int, int]) -> bool:
        """Cache a block being freed under ``key`` (evictable); False if an equal one is cached."""
        if key in self.cache:
            return False
        self.cache[key] = [0, 0]
        self.queue.append((key, 0))
        self.num_free += 1
        return True

    def touch(self, key: tuple[int, int, int]) -> None:
        """Take a reference to a cached block (a prefix-cache hit)."""
        state = self.cache[key]
        if state[0] == 0:
            self.num_free -= 1
            state[1] += 1  # its queue entry is now stale
        state[0] += 1


class SimScheduler:
    """One vLLM V1 engine core in virtual time (see the module docstring for the rules).

    Example:
        >>> # s = SimScheduler(model, gpu, config, num_gpu_blocks=1024)
        >>> # s.add_request("r0", prompt_tokens=512, max_tokens=64, arrival_s=0.0)
        >>> # while s.has_work(): step = s.step()
    """

    def __init__(self, model: ModelProfile, gpu: GpuSpec, config: EngineConfig, num_gpu_blocks: int,
                 seed: int = 0, perf: PerfModel | None = None) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (one is vLLM's null block), got {num_gpu_blocks}")
        self.config = config
        self.seed = seed  # the simulator is deterministic; kept for the contract and the log
        self.perf = perf if perf is not None else PerfModel(model, gpu, config)
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.long_prefill_threshold = config.long_prefill_token_threshold or 0
        self.chunked_prefill = config.enable_chunked_prefill
        self.prefix_caching = config.enable_prefix_caching
        self.reserve_full_isl = (version_tuple(config.vllm_version) or (0, 0, 0)) >= (0, 19)
        self.pool = _BlockPool(num_gpu_blocks - 1, config.enable_prefix_caching)
        self.now_s = 0.0
        self.num_preemptions = 0
        self.num_steps = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self.kv_usage_peak = 0.0
        self._kv_area = 0.0  # integral of usage over time, for the time-weighted mean
        self._kv_time = 0.0
        self.step_end_s: list[float] = []  # end time of every step, by index
        # When clients receive each step's tokens (NaN until the API server has delivered them).
        self.deliver_s: list[float] = []
        perf = self.perf
        self.api = ApiServer(perf.request_overhead_s, perf.prompt_token_overhead_s, perf.token_overhead_s,
                             perf.stream_prompt_token_s, perf.api_chunk_share, perf.api_intake_passes,
                             perf.client_chunk_s, perf.api_output_slice)
        # run_until_idle's callback: a client that received its request's last token sends the next.
        self._on_finish: Callable[[str, float], None] | None = None
        self._running: list[_Req] = []
        self._waiting: collections.deque[_Req] = collections.deque()
        self._requests: dict[str, _Req] = {}
        self._next_key = 0
        # With async scheduling vLLM's scheduler forms the next batch while the current step runs
        # (max_concurrent_batches 2, vllm-internals.md §4.2): a request the engine core received
        # after the running step began waits for the batch after it (PerfModel.schedule_ahead).
        self._schedule_ahead = self.perf.schedule_ahead
        self._step_start = 0.0  # start of the step before the one being formed

    # -- public state -------------------------------------------------------------------------

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.usable

    @property
    def kv_usage_mean(self) -> float:
        return self._kv_area / self._kv_time if self._kv_time > 0 else 0.0

    @property
    def frontend_busy_s(self) -> float:
        """The API server's CPU seconds so far (requests in, tokens out)."""
        return self.api.busy_s

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def running_ids(self) -> list[str]:
        return [r.rid for r in self._running]

    def waiting_ids(self) -> list[str]:
        return [r.rid for r in self._waiting]

    def request_state(self, request_id: str) -> RequestState:
        r = self._requests[request_id]
        first = self._received(r.token_steps[0]) if r.token_steps else None
        finish = self._received(r.finish_step) if r.finish_step >= 0 else None
        return RequestState(r.rid, r.status, r.computed, r.output, r.nblk, r.preemptions, first, finish)

    def _received(self, step_no: int) -> float | None:
        """When clients received step ``step_no``'s tokens; None while the API server has not."""
        t = self.deliver_s[step_no]
        return None if math.isnan(t) else t

    def token_times(self, request_id: str) -> list[float]:
        """When the client receives each output token of the request (after the API server; NaN
        for tokens it has not delivered yet)."""
        ends = self.deliver_s
        return [ends[s] for s in self._requests[request_id].token_steps]

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self.api.has_work())

    # -- input --------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_tokens: int, max_tokens: int, arrival_s: float,
                    prefix_group: int | None = None, prefix_tokens: int = 0) -> None:
        """Queue a request; it joins WAITING at ``arrival_s`` (now, if that has passed).

        ``max_tokens`` is capped so prompt + output fits ``max_model_len`` (vLLM's "length" finish);
        a prompt of ``max_model_len`` tokens or more is refused with ``ValueError`` (vLLM's HTTP 400).
        """
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        if prompt_tokens >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                             f"your prompt contains {prompt_tokens} input tokens")
        max_tokens = min(max_tokens, self.max_model_len - prompt_tokens)
        bs = self.block_size
        if -(-(prompt_tokens + max_tokens) // bs) > self.pool.usable:
            raise ValueError(f"request needs {-(-(prompt_tokens + max_tokens) // bs)} KV blocks; the cache has "
                             f"{self.pool.usable}")
        prefix_blocks = min(prefix_tokens, prompt_tokens) // bs if prefix_group is not None else 0
        req = _Req(request_id, prompt_tokens, max_tokens, arrival_s, prefix_group, prefix_blocks, self._next_key)
        self._next_key += 1
        self._requests[request_id] = req
        self.api.submit(req, arrival_s, prompt_tokens)

    def _admit_arrivals(self, upto: float | None = None) -> None:
        """Run the API server as far as the engine's clock is known, then move the requests that
        reached the engine core by ``upto`` (default: now) to WAITING."""
        self.api.advance(self.now_s, self._delivered)
        for req in self.api.pop_entered(self.now_s if upto is None else upto):
            req.status = "waiting"  # type: ignore[attr-defined]
            self._waiting.append(req)  # type: ignore[arg-type]

    def _next_entry(self) -> float:
        """When the next request reaches the engine core, the engine being idle (inf: none will)."""
        nxt = self.api.next_entry_s()
        if nxt == math.inf and self.api.has_work():
            self.api.advance(self.now_s, self._delivered, until_entry=True)
            nxt = self.api.next_entry_s()
        return nxt

    def _delivered(self, step_no: int, delivered_s: float, finished: list[Hashable]) -> None:
        """The API server delivered step ``step_no``'s tokens; the clients of ``finished`` have their last."""
        self.deliver_s[step_no] = delivered_s
        if self._on_finish is not None:
            for req in finished:
                self._on_finish(req.rid, delivered_s)  # type: ignore[attr-defined]

    # -- block bookkeeping ----------------------------------------------------------------------

    def _free(self, req: _Req) -> None:
        """Return a request's blocks, tail first (vLLM's order: the tail is evicted first).

        Full blocks of a prefix group's shared prefix stay cached (evictable). A request's own
        blocks are freed uncached: the real vLLM 0.26 runs show no prefix-cache hits when
        preempted requests resume (496 hit tokens over 192 preemptions in b3), so the simulator
        does not let a resumed request skip its recompute.
        """
        pool = self.pool
        nshared = len(req.shared)
        if pool.caching:
            full = min(req.computed // self.block_size, req.npb)
            anon = 0
            for idx in range(req.nblk - 1, nshared - 1, -1):  # private blocks, tail first
                if idx < full and (0, req.group, idx) not in pool.cache:
                    pool.give_anonymous(anon)  # keep the queue order: what was freed before goes first
                    anon = 0
                    pool.offer_if_new((0, req.group, idx))  # type: ignore[arg-type]
                else:
                    anon += 1
            pool.give_anonymous(anon)
            for key in reversed(req.shared):
                pool.release_key(key)
            req.shared = []
        else:
            pool.num_free += req.nblk - nshared
        req.nblk = 0

    def _register_prefix(self, req: _Req) -> None:
        """Cache the prefix-group blocks this request just filled, so others of its group hit them."""
        full = min(req.computed // self.block_size, req.npb)
        pool = self.pool
        idx = len(req.shared)
        while idx < full:
            key = (0, req.group, idx)
            if key in pool.cache:  # an equal block was computed by someone else meanwhile
                return
            pool.cache[key] = [1, 0]
            req.shared.append(key)  # type: ignore[arg-type]
            idx += 1

    def _cache_hits(self, req: _Req) -> tuple[list[tuple[int, int, int]], int]:
        """Longest chain of cached full prefix blocks (at most total - 1 tokens), and how many are evictable."""
        cache = self.pool.cache
        limit = min((req.total - 1) // self.block_size, req.npb)
        hits: list[tuple[int, int, int]] = []
        evictable = 0
        for idx in range(limit):
            key = (0, req.group, idx)
            state = cache.get(key)  # type: ignore[arg-type]
            if state is None:
                break
            hits.append(key)  # type: ignore[arg-type]
            if state[0] == 0:
                evictable += 1
        return hits, evictable

    def _preempt(self, victim: _Req) -> None:
        self._free(victim)
        victim.computed = 0
        victim.status = "waiting"
        victim.preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(victim)

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Run one engine step (or jump the clock to the next arrival when idle) and report it."""
        start = self.now_s
        info = self._step(collect=True)
        if info is None:
            return StepResult(start, 0.0, {}, [], [], 0, 0)
        return info

    def _step(self, collect: bool) -> Any:
        """One step. Returns a StepResult (``collect``), else None (finished requests reach
        ``run_until_idle``'s callback once the API server delivers their last token)."""
        formed_at = self._step_start if self._schedule_ahead and self._running else None
        self._step_start = self.now_s
        self._admit_arrivals(formed_at)
        if not self._running and not self._waiting:
            nxt = self._next_entry()
            if nxt == math.inf:
                return None
            self.now_s = max(self.now_s, nxt)
            self._admit_arrivals()
        bs = self.block_size
        bsm1 = bs - 1
        pool = self.pool
        running = self._running
        step_no = len(self.step_end_s)
        budget = self.max_num_batched_tokens
        threshold = self.long_prefill_threshold
        num_reqs = num_tokens = kv_context = attn_work = prefill_tokens = 0
        prefill_context = prefill_attn = 0  # the share of kv_context / attn_work that is prefill chunks
        sampled_reqs: list[tuple[_Req, int]] = []  # (request, its prompt tokens) per token sampled this step
        finished: list[_Req] = []
        preempted: list[_Req] = []
        scheduled: list[tuple[_Req, int]] | None = [] if collect else None
        caching = pool.caching

        # 1) RUNNING requests, in admission order.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.computed
            n = req.total - computed
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            end = computed + n
            need = (end + bsm1) // bs - req.nblk
            if need > 0:
                if need > pool.num_free:
                    # Preempt from the back until the blocks fit or this request is the victim.
                    while need > pool.num_free:
                        victim = running.pop()
                        self._preempt(victim)
                        preempted.append(victim)
                        if victim is req:
                            break
                    if req.status == "waiting":
                        break
                pool.take(need)
                req.nblk += need
            budget -= n
            num_reqs += 1
            num_tokens += n
            kv_context += end
            work = n * computed + (n * (n + 1) >> 1)
            attn_work += work
            if computed < req.total - 1:
                prefill_tokens += n
                prefill_context += end
                prefill_attn += work
            req.computed = end
            if caching and req.group is not None and len(req.shared) < req.npb:
                self._register_prefix(req)
            if scheduled is not None:
                scheduled.append((req, n))
            if end == req.total:  # the whole sequence is computed: sample one token
                req.token_steps.append(step_no)
                req.total += 1
                req.output += 1
                sampled_reqs.append((req, req.prompt))
                if req.output >= req.max_tokens:
                    finished.append(req)
            i += 1

        # 2) WAITING requests, only when nothing was preempted this step.
        if not preempted:
            waiting = self._waiting
            max_seqs = self.max_num_seqs
            while waiting and budget > 0 and len(running) < max_seqs:
                req = waiting[0]
                hits: list[tuple[int, int, int]] = []
                evictable_hits = 0
                if caching and req.npb:
                    hits, evictable_hits = self._cache_hits(req)
                cached = len(hits) * bs
                n = req.total - cached
                if not self.chunked_prefill and n > budget:
                    break
                if threshold and n > threshold:
                    n = threshold
                if n > budget:
                    n = budget
                end = cached + n
                free_after_hits = pool.num_free - evictable_hits
                if self.reserve_full_isl:
                    if (req.total + bsm1) // bs - len(hits) > free_after_hits:
                        break
                need = (end + bsm1) // bs - len(hits)
                if need > free_after_hits:
                    break
                waiting.popleft()
                if caching:  # vLLM records the query once the request is admitted
                    self.prefix_cache_queries += req.total
                    self.prefix_cache_hits += cached
                for key in hits:
                    pool.touch(key)
                req.shared = hits
                req.nblk = len(hits)
                pool.take(need)
                req.nblk += need
                req.status = "running"
                running.append(req)
                computed = cached
                budget -= n
                num_reqs += 1
                num_tokens += n
                kv_context += end
                work = n * computed + (n * (n + 1) >> 1)
                attn_work += work
                prefill_tokens += n
                prefill_context += end
                prefill_attn += work
                req.computed = end
                if caching and req.group is not None and len(req.shared) < req.npb:
                    self._register_prefix(req)
                if scheduled is not None:
                    scheduled.append((req, n))
                if end == req.total:
                    req.token_steps.append(step_no)
                    req.total += 1
                    req.output += 1
                    sampled_reqs.append((req, req.prompt))
                    if req.output >= req.max_tokens:
                        finished.append(req)

        usage = 1.0 - pool.num_free / pool.usable
        if num_tokens == 0:
            # Nothing could be scheduled (every waiting request blocked on KV space that no running
            # request will free): vLLM would idle too. Jump to the next arrival, or stop.
            nxt = self._next_entry()
            if nxt != math.inf:
                self.now_s = max(self.now_s, nxt)
                return StepResult(self.now_s, 0.0, {}, [], [r.rid for r in preempted], 0, 0) if collect else None
            raise RuntimeError("simulated engine is stuck: waiting requests can never fit the KV cache")

        decode_tokens = num_tokens - prefill_tokens
        duration = self.perf.step_time(num_reqs, num_tokens, kv_context, attn_work,
                                       prefill_tokens == 0, prefill_tokens, prefill_context, prefill_attn)
        start = self.now_s
        self.now_s = end_s = start + duration
        self.step_end_s.append(end_s)
        # The API server streams this step's tokens when its loop gets to them (sim/frontend.py).
        self.deliver_s.append(math.nan if sampled_reqs else end_s)
        self.api.step_output(step_no, end_s, sampled_reqs, finished)
        self.num_steps += 1
        self.prompt_tokens_computed += prefill_tokens
        self.generation_tokens += len(sampled_reqs)
        if usage > self.kv_usage_peak:
            self.kv_usage_peak = usage
        self._kv_area += usage * duration
        self._kv_time += duration

        if finished:
            for req in finished:
                req.status = "finished"
                req.finish_step = step_no
                self._free(req)
            self._running = [r for r in running if r.status == "running"]
            if not self._running and not self._waiting:
                # Idle now: no step comes before a request enters, so the API server runs ahead
                # (delivering this step's tokens) until one does.
                self._next_entry()
        if not collect:
            return None
        finished_ids = [r.rid for r in finished]
        new_tokens = {r.rid: (1 if r.token_steps and r.token_steps[-1] == step_no else 0) for r, _ in scheduled or ()}
        return StepResult(start, duration, new_tokens, finished_ids, [r.rid for r in preempted],
                          prefill_tokens, decode_tokens)

    def run_until_idle(self, on_finish: Callable[[str, float], None] | None = None) -> None:
        """Step until no work is left (fast path: no per-step report).

        ``on_finish(request_id, finish_s)`` is called for every finished request once its client
        has the last token (``finish_s``) and may add new requests (a closed-loop client sends the
        next one when one completes).
        """
        self._on_finish = on_finish
        try:
            while self._running or self._waiting or self.api.has_work():
                self._step(collect=False)
        finally:
            self._on_finish = None


# -- one trial -----------------------------------------------------------------------------------


#: The modelled API server's busy share of the measured window from which a simulated figure is
#: flagged as hostage to the host's CPU. Real H200 hosts paid 1.0-2.1x the modelled CPU per streamed
#: token (56-116 us against 54; the 2.1x in five decode-heavy 8B windows of 2026-12-02, in no fit,
#: which ran the API server 97-100% busy), so from half busy here a slow host's API server bounds it.
FRONTEND_BOUND_SHARE = 0.5


def frontend_bound_note(busy: float, api_cpu_factor: float = 1.0) -> str:
    """What a simulated result whose API server is busy ``busy`` of the window says about itself
    (``api_cpu_factor``: the host factor it ran with, 1.0 for the calibration's hosts)."""
    head = f"vLLM's API server (one process) was busy {100 * busy:.0f}% of the window: this figure depends "
    if api_cpu_factor != 1.0:
        return (head + f"on the host's CPU as much as on the GPU; it was simulated at this host's measured "
                f"API CPU (--api-cpu-factor {api_cpu_factor:g}) and holds for hosts like it")
    return (head + "on the host's CPU as much as on the GPU. Measured H200 hosts paid 1.1-2.2x the API CPU "
            "modelled here over the same windows; on the slowest, decode-heavy 8B loads served up to 30% "
            "below the simulated figure. Measure yours on one real window (host_api_cpu_factor) and pass "
            "it as --api-cpu-factor")


def host_api_cpu_factor(real: TrialResult, simulated: TrialResult, base: float = 1.0) -> float | None:
    """The host's ``api_cpu_factor``: ``base`` x the real API server's CPU over the simulated one's.

    ``real`` and ``simulated`` are the same flags and workload on the real engine and on the
    simulator run with ``api_cpu_factor`` ``base``; both count ``api_server_cpu_s`` over their
    measured window. vLLM's API server does the same work per request and per streamed token
    whatever the host, so the ratio is what this host's CPU charges for it against the calibration:
    a slower core, another Python build, a busier machine. None when either side lacks the figure.
    A simulation with the factor then predicts the host's other loads (held out on the H200 hosts of
    ``benchmarks/sim_fidelity.py --unseen``: read off one prefill-heavy window, it took the other
    windows' throughput error from 12.5% to 8.3% on one host and from 6.1% to 5.5% on another). It
    carries the host's level, not every load's: one host's windows ranged 1.25-2.06 around 1.39.

    Example:
        >>> from servetune.result import TrialStatus
        >>> real = TrialResult(TrialStatus.OK, api_server_cpu_s=15.0)
        >>> host_api_cpu_factor(real, TrialResult(TrialStatus.OK, api_server_cpu_s=10.0))
        1.5
    """
    if not real.api_server_cpu_s or not simulated.api_server_cpu_s:
        return None
    return base * real.api_server_cpu_s / simulated.api_server_cpu_s


def simulate(model: ModelProfile, gpu: GpuSpec, config: EngineConfig, workload: Workload, *,
             plan: MemoryPlan | None = None, seed: int = 0) -> TrialResult:
    """Run ``workload`` on one simulated engine and measure it the way the load generator does.

    Warm-up requests run first, one at a time, and are excluded. Closed loop (``concurrency``):
    ``concurrency`` clients each send the next request as soon as theirs completes. Timed
    (``request_rate`` or a trace): requests arrive at their ``arrival_s``, at most ``concurrency``
    at once when that is set too. The measured window runs from the first measured send to the
    last completion. Deterministic: the same inputs give the same result.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.memory import resolve_engine_config
        >>> from servetune.planner.modelinfo import load_model
        >>> from servetune.workload import Workload
        >>> model, gpu = load_model("servetune-test-850m"), get_gpu("H200")
        >>> cfg = resolve_engine_config({"max_num_seqs": 32}, model, gpu)
        >>> w = Workload.from_dict({"input_len": 512, "output_len": 64, "num_requests": 64, "concurrency": 16})
        >>> simulate(model, gpu, cfg, w).completed
        64
    """
    if plan is None:
        plan = plan_memory(model, gpu, config)
    base = dict(backend="sim", vllm_version=config.vllm_version, memory=plan.memory,
                kv_cache_tokens=plan.kv_cache_tokens, num_gpu_blocks=plan.num_gpu_blocks,
                max_concurrency=plan.max_concurrency, startup_s=plan.startup_s)
    if not plan.fits:
        status = plan.failure or TrialStatus.STARTUP_OOM
        return TrialResult(status=status, cause=plan.cause, evidence=[plan.cause] if plan.cause else [],
                           log_text=_startup_log(model, gpu, config, plan), **base)  # type: ignore[arg-type]

    perf = PerfModel(model, gpu, config)
    sched = SimScheduler(model, gpu, config, plan.num_gpu_blocks, seed=seed, perf=perf)
    specs = workload.requests(include_warmup=True)
    n_warm = workload.warmup_requests if workload.trace_file is None else 0
    warm, measured = specs[:n_warm], specs[n_warm:]

    # Warm-up: up to the workload's concurrency at a time, excluded (the load generator sends them
    # so and opens the window once all are answered).
    waiting_warm = list(enumerate(warm))

    def warm_next(_rid: str = "", now: float | None = None) -> None:
        while waiting_warm:
            i, spec = waiting_warm.pop(0)
            try:
                sched.add_request(f"warmup-{i}", spec.prompt_tokens, spec.output_tokens,
                                  sched.now_s if now is None else now, spec.prefix_group, spec.prefix_tokens)
                return
            except ValueError:
                continue

    for _ in range(min(len(warm), max(1, workload.concurrency or len(warm)))):
        warm_next()
    sched.run_until_idle(warm_next)
    t0 = max(sched.now_s, sched.api.free_s, sched.api.client_free_s)  # the client has the warm-up's last token
    busy_at_t0 = sched.frontend_busy_s

    errors: dict[int, str] = {}
    index_of: dict[str, int] = {}
    arrival_of: dict[int, float] = {}

    def send(i: int, at: float) -> bool:
        spec = measured[i]
        rid = str(i)
        arrival_of[i] = at
        try:
            sched.add_request(rid, spec.prompt_tokens, spec.output_tokens, at,
                              spec.prefix_group, spec.prefix_tokens)
        except ValueError as exc:  # vLLM answers 400; the client records a failed request
            errors[i] = str(exc)
            return False
        index_of[rid] = i
        return True

    timed = bool(measured) and measured[0].arrival_s is not None
    limit = workload.concurrency if workload.concurrency else None
    next_i = 0
    if timed and limit is None:
        for i, spec in enumerate(measured):
            send(i, t0 + (spec.arrival_s or 0.0))
        sched.run_until_idle()
    else:
        slots = min(limit or 1, len(measured))

        def refill(now: float) -> None:
            nonlocal next_i
            while next_i < len(measured):
                i = next_i
                next_i += 1
                at = now if not timed else max(now, t0 + (measured[i].arrival_s or 0.0))
                if send(i, at):
                    return  # one slot taken; a refused request frees its slot at once

        for _ in range(slots):
            refill(t0)

        def on_finish(rid: str, now: float) -> None:
            if not rid.startswith("warmup-"):
                refill(now)

        sched.run_until_idle(on_finish)

    records = _records(sched, measured, index_of, arrival_of, errors, t0, n_warm)
    finish_times = [r.finish_s for r in records if r.finish_s is not None]
    duration = max(finish_times) if finish_times else 0.0
    fig = summarize(records, duration)
    result = TrialResult(
        status=TrialStatus.OK, **base,  # type: ignore[arg-type]
        duration_s=fig["duration_s"], completed=fig["completed"], failed=fig["failed"],
        output_throughput=fig["output_throughput"], total_token_throughput=fig["total_token_throughput"],
        request_throughput=fig["request_throughput"], ttft_ms=fig["ttft_ms"], itl_ms=fig["itl_ms"],
        tpot_ms=fig["tpot_ms"], e2e_ms=fig["e2e_ms"], preemptions=sched.num_preemptions,
        kv_cache_usage_peak=sched.kv_usage_peak, kv_cache_usage_mean=sched.kv_usage_mean,
        requests=records, api_server_cpu_s=sched.frontend_busy_s - busy_at_t0,
    )
    busy = result.api_server_busy or 0.0
    if busy >= FRONTEND_BOUND_SHARE:
        result.evidence.append(frontend_bound_note(busy, perf.api_cpu_factor))
    result.log_text = _startup_log(model, gpu, config, plan) + _run_log(sched, result, seed)
    return result


def _records(sched: SimScheduler, measured: list[Any], index_of: dict[str, int], arrival_of: dict[int, float],
             errors: dict[int, str], t0: float, offset: int) -> list[RequestRecord]:
    ends = sched.deliver_s
    out: list[RequestRecord] = []
    for i, spec in enumerate(measured):
        arrival = arrival_of.get(i, t0) - t0
        if i in errors:
            out.append(RequestRecord(i + offset, spec.prompt_tokens, 0, arrival, None, None, error=errors[i]))
            continue
        req = sched._requests[str(i)]
        times = [ends[s] - t0 for s in req.token_steps]
        # The client sees chunks: tokens the API server merged arrive together (one ITL gap, as
        # `vllm bench serve` records it).
        chunks = [t for j, t in enumerate(times) if j == 0 or t != times[j - 1]]
        gaps = tuple(b - a for a, b in zip(chunks, chunks[1:]))
        out.append(RequestRecord(
            request_id=i + offset, prompt_tokens=req.prompt, output_tokens=req.output, arrival_s=arrival,
            first_token_s=times[0] if times else None,
            finish_s=ends[req.finish_step] - t0 if req.finish_step >= 0 else None,
            itl_s=gaps, preemptions=req.preemptions))
    return out


def _startup_log(model: ModelProfile, gpu: GpuSpec, config: EngineConfig, plan: MemoryPlan) -> str:
    """vLLM's startup log for this engine, written by the one log writer the stand-in server uses
    (:func:`servetune.sim.vllm_log.startup_script`), so log parsers read sim trials like real ones."""
    script = vllm_log.startup_script(model, gpu, config, plan, model_ref=model.name, served_model_name=model.name,
                                     host="127.0.0.1", port=8000, given_flags={}, api_pid=0)
    pids = {"APIServer": 0, "EngineCore": 1}
    for i, proc in enumerate(vllm_log.worker_procs(config)):
        pids.setdefault(proc, 2 + i)
    when = datetime.datetime(2026, 1, 1)
    return "".join(vllm_log.format_record(r, pids, when) + "\n" for r in (*script.before_listen, *script.after_listen))


def _run_log(sched: SimScheduler, result: TrialResult, seed: int) -> str:
    """One vLLM-style stats line for the whole run, plus a simulator summary line."""
    dur = max(result.duration_s or 0.0, 1e-9)
    line = (f"(APIServer pid=0) INFO 01-01 00:00:10 [loggers.py:1] Engine 000: Avg prompt throughput: "
            f"{sched.prompt_tokens_computed / max(sched.now_s, 1e-9):.1f} tokens/s, Avg generation throughput: "
            f"{sched.generation_tokens / max(sched.now_s, 1e-9):.1f} tokens/s, Running: 0 reqs, Waiting: 0 reqs, ")
    if sched.num_preemptions:
        line += f"Preemptions: {sched.num_preemptions}, "
    hit_rate = 100.0 * sched.prefix_cache_hits / sched.prefix_cache_queries if sched.prefix_cache_queries else 0.0
    line += f"GPU KV cache usage: {100 * sched.kv_usage_peak:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
    summary = (f"servetune-sim: seed={seed} steps={sched.num_steps} completed={result.completed} "
               f"duration={dur:.3f}s output_throughput={result.output_throughput or 0:.1f} tok/s "
               f"preemptions={sched.num_preemptions}")
    return line + "\n" + summary + "\n"
