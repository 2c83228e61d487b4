"""The simulated vLLM V1 engine core: the real scheduler's decisions, in virtual time.

:class:`SimScheduler` is one engine core, stepping the way vLLM's V1 core does (vllm-internals.md
§4; 0.26 behaviour), in the same three moves: ``schedule()`` decides the batch and returns a
frozen :class:`SchedulerOutput`; the step's duration comes from
:class:`servetune.sim.perf.PerfModel`; ``update_from_output()`` samples the tokens, finishes
requests and frees their blocks.

* RUNNING requests first, in admission order, each taking ``total - computed`` tokens (1 for a
  decode, the rest of the prompt for a partial prefill), capped by ``long_prefill_token_threshold``
  and the step's token budget ``max_num_batched_tokens``.
* A running request that cannot get the KV blocks it needs preempts the LAST running request
  (recompute: its blocks are freed, its progress reset so prompt + generated tokens become the new
  prefill, and it goes to the FRONT of the waiting queue); if it is itself the last, it stops the
  running loop.
* With async scheduling (vLLM >= 0.14 by default, one engine stage) the scheduler forms a batch while the
  step before it runs (``max_concurrent_batches`` 2): a request that reaches the engine core after
  that step began waits for the batch after it, so its first token comes one step later than a
  scheduler at the step's start would give it (``Calibration.schedule_ahead``; vLLM's own
  ``request_prefill_time`` histograms ran about twice the simulator's before it, on every closed
  loop of two held-out H200 hosts, ``benchmarks/ttft_split.py``).
* WAITING requests are admitted, in order, only when nothing was preempted this step, while the
  budget lasts and fewer than ``max_num_seqs`` run; with ``scheduler_reserve_full_isl`` (vLLM
  >= 0.19) a request is admitted only if blocks for its whole current sequence are free.
  Head-of-line blocking: the first one that does not fit stops admission.
* KV blocks and the prefix cache: :class:`servetune.sim.blocks.BlockPool`; KV usage is
  ``1 - free / (num_gpu_blocks - 1)``. A sliding-window / full-attention hybrid (gemma-2/3,
  gpt-oss) holds a block per ``block_size`` tokens in each of its KV groups, its sliding groups
  freeing what slid out of the window before the request's allocation; a Mamba hybrid's Mamba
  groups hold one block each per running request, from admission to finish or preemption
  (:class:`servetune.sim.blocks.KVGroups`, :func:`kv_groups`).
* The step that computes the last prompt token samples the first output token (TTFT); every later
  step that schedules a request gives it one token; requests stop at ``max_tokens`` (ignore_eos).

In :meth:`SimScheduler.run_until_idle` (a trial) the running requests that only decode, from the
first in running order, are advanced together by counters (their KV context and attention sums,
how many cross a block boundary at each step, which step samples each one's last token), so a
step costs the same whatever its batch; everything else is decided request by request, with the
same figures, to the bit, as stepping every request (``bulk_decode=False``).

Requests reach the engine core, and clients their tokens, through vLLM's API server loop
(:class:`servetune.sim.frontend.ApiServer`): a request enters WAITING once its intake is done, and
a step's tokens count as received when the loop has drained them and the load generator has read
their chunks.

This module is the face: :class:`SimScheduler` holds the engine core's state, its public reads and
``add_request``; its parts, each a private module, are the admission and preemption policy
(``_admission``: ``schedule()``), the bulk-decode fast path (``_bulk_decode``), the step timeline
(``_timeline``: ``step()``, ``run_until_idle()``, ``update_from_output()``), a hybrid's KV groups and
their blocks (``_hybrid_kv``) and the output and record types (``_sched_output``); the state the
first three share is declared once in ``_sched_state``.
"""

from __future__ import annotations

import array
import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

from servetune.sim._admission import Admission
from servetune.sim._bulk_decode import BulkDecode
from servetune.sim._hybrid_kv import HybridBlocks, kv_groups, mamba_pool_note
from servetune.sim._sched_output import SchedulerOutput, StepResult
from servetune.sim._timeline import StepTimeline
from servetune.sim.blocks import BlockPool
from servetune.sim.frontend import ApiServer
from servetune.sim.moe_jit import TritonCache, moe_jit_rule
from servetune.sim.perf import PerfModel
from servetune.sim.request import RequestState, SimRequest
from servetune.sim.tokenizer_batch import MICROBATCH_MAX_PROMPTS, tokenizer_batch_wait_s
from servetune.vllm_version import version_tuple

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.engine_config import EngineConfig
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["SchedulerOutput", "StepResult", "SimScheduler", "kv_groups", "mamba_pool_note", "LOOKUP_RETRIES_UNTIL"]

#: The first vLLM release whose prefix-cache counters take a WAITING request's lookup once, when it
#: is admitted: 0.27.0 (``v1/core/sched/scheduler.py`` calls ``KVCacheManager.record_prefix_cache_stats``
#: after ``allocate_slots``, "Record at admission so unscheduled lookups are not counted"; vLLM pull
#: request #48860, vLLM issue #43736). Up to 0.26.0 ``get_computed_blocks`` records every lookup (0.10.1.1
#: ``v1/core/kv_cache_manager.py`` lines 155-159, 0.11.0 lines 185-189, 0.26.0 lines 272-278), so a
#: request blocked on KV space is counted again at every step the scheduler retries it.
LOOKUP_RETRIES_UNTIL = (0, 27, 0)


class SimScheduler(StepTimeline, BulkDecode, Admission):
    """One vLLM V1 engine core in virtual time (see the module docstring for the rules).

    Example:
        >>> # s = SimScheduler(model, gpu, config, num_gpu_blocks=1024)
        >>> # s.add_request("r0", prompt_tokens=512, max_tokens=64, arrival_s=0.0)
        >>> # while s.has_work(): step = s.step()
    """

    def __init__(self, model: ModelProfile, gpu: GpuSpec, config: EngineConfig, num_gpu_blocks: int,
                 seed: int = 0, perf: PerfModel | None = None, bulk_decode: bool = True,
                 triton_cache: TritonCache | None = None) -> None:
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
        #: Whether vLLM's prefix-cache counters take a resumed request's hits (VllmMemoryRules).
        self.count_preempted_hits = config.rules.prefix_stats_count_preempted
        #: Whether they take a lookup whose request then was not admitted, again at every retry
        #: (``get_computed_blocks`` records before ``allocate_slots``; :data:`LOOKUP_RETRIES_UNTIL`).
        self.count_lookup_retries = (version_tuple(config.vllm_version) or (0, 0, 0)) < LOOKUP_RETRIES_UNTIL
        #: Prefix-cache lookups of WAITING requests by kind: fresh admitted, resumed admitted,
        #: fresh not admitted (a retry follows), resumed not admitted; each [lookups, tokens queried,
        #: tokens hit], whatever the version logs (vLLM 0.11.1's ``PrefixCacheStats`` splits the first two).
        self.lookups = [[0, 0, 0] for _ in range(4)]
        #: Every lookup the version's counters take, in order: (tokens queried, tokens hit), for the
        #: logged rate over the most recent requests (:meth:`logged_hit_rate`).
        self.counted_lookups: list[tuple[int, int]] = []
        self.reserve_full_isl = (version_tuple(config.vllm_version) or (0, 0, 0)) >= (0, 19)
        #: A hybrid's KV groups (None: one group); whether some slide (a sliding-window hybrid's).
        self.groups = kv_groups(model, config)
        self._sliding = self.groups is not None and self.groups.sliding > 0
        self._in_flight = config.async_scheduling  # a step's tokens are unprocessed while the next forms
        self.pool = BlockPool(num_gpu_blocks - 1, config.enable_prefix_caching, config.block_size, self.groups,
                              unhashed_first=(version_tuple(config.vllm_version) or (0, 0, 0)) >= (0, 23))
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
        #: Seconds of steps whose forward's CPU, not the GPU, set their length (PerfModel.forward_floor_s).
        self.forward_bound_s = 0.0
        self._forward_priced = self.perf.forward_priced
        self.step_end_s = array.array("d")  # end time of every step, by index
        # When clients receive each step's tokens (NaN until the API server has delivered them).
        self.deliver_s = array.array("d")
        perf = self.perf
        self.api = ApiServer(perf.request_overhead_s, perf.prompt_token_overhead_s, perf.token_overhead_s,
                             perf.stream_prompt_token_s, perf.api_chunk_share, perf.api_intake_passes,
                             perf.client_chunk_s, perf.api_output_slice,
                             tokenize_wait_s=tokenizer_batch_wait_s(config.version),
                             tokenize_batch=MICROBATCH_MAX_PROMPTS)
        # run_until_idle's callback: a client that received its request's last token sends the next.
        self._on_finish: Callable[[str, float], None] | None = None
        self._running: list[SimRequest] = []
        self._waiting: collections.deque[SimRequest] = collections.deque()
        self._requests: dict[str, SimRequest] = {}
        self._next_key = 0
        # With async scheduling vLLM's scheduler forms the next batch while the current step runs
        # (max_concurrent_batches 2, vllm-internals.md §4.2): a request the engine core received
        # after the running step began waits for the batch after it (PerfModel.schedule_ahead).
        self._schedule_ahead = self.perf.schedule_ahead
        # A preempted request resumes on its own blocks still cached (Calibration.resume_hits).
        self._resume_hits = self.perf.resume_hits
        self._step_start = 0.0  # start of the step before the one being formed
        # After an idle engine's first step: how long after its start the next batch is drained
        # (the step's engine CPU to schedule and submit it; _timeline._enter_step).
        self._form_lag = 0.0
        # run_until_idle's bulk decode: the first _dec_n running requests each decode one token a
        # step (SimRequest.dec), counted together: sum of (computed - dec), how many need a new
        # block at a step k (by (dec - computed) % block_size == k % block_size), their prompt
        # tokens, and who of them samples its last token at step k.
        #: Whether run_until_idle decodes in bulk (False: every step request by request, the
        #: reference the bulk steps equal); how many steps it ran so.
        self.bulk_decode = bulk_decode
        #: The fused-MoE kernel variants the server compiles on first use (``sim.moe_jit``): the rule,
        #: and the server's Triton cache (a caller's, carried from its earlier runs, or a cold one),
        #: which startup's runs fill first.
        self.moe_jit = moe_jit_rule(model, gpu, config)
        self.triton_cache = triton_cache if triton_cache is not None else TritonCache()
        if self.moe_jit is not None:
            self.triton_cache.variants |= self.moe_jit.warm()
        self.num_bulk_steps = 0
        self._dec_n = 0
        self._dec_off = 0
        self._dec_need = [0] * self.block_size
        self._dec_prompts = 0
        self._dec_fin: dict[int, list[SimRequest]] = {}
        # A hybrid's groups' blocks, request by request and for the bulk decoders.
        self._hybrid = HybridBlocks(self.groups, self.pool, self.block_size, self._in_flight)

    # -- public state -------------------------------------------------------------------------

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.usable

    @property
    def kv_usage_mean(self) -> float:
        return self._kv_area / self._kv_time if self._kv_time > 0 else 0.0

    @property
    def forward_bound_share(self) -> float:
        """The share of the engine's step time spent in steps its forward's CPU paced (:attr:`forward_bound_s`)."""
        return self.forward_bound_s / self._kv_time if self._kv_time > 0 else 0.0

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

    def request(self, request_id: str) -> SimRequest:
        """The live state of one request (the client reads its token steps when it records it)."""
        return self._requests[request_id]

    def request_state(self, request_id: str) -> RequestState:
        r = self._requests[request_id]
        first = self._received(r.first_step) if r.last_step >= 0 else None
        finish = self._received(r.finish_step) if r.finish_step >= 0 else None
        return RequestState(r.rid, r.status, r.computed, r.output, r.nblk, r.preemptions, first, finish)

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
        blocks = -(-(prompt_tokens + max_tokens) // bs)
        if self.groups is not None:
            blocks = self.groups.admission_blocks(blocks)
        if blocks > self.pool.usable:
            raise ValueError(f"request needs {blocks} KV blocks; the cache has {self.pool.usable}")
        prefix_blocks = min(prefix_tokens, prompt_tokens) // bs if prefix_group is not None else 0
        req = SimRequest(request_id, prompt_tokens, max_tokens, arrival_s, prefix_group, prefix_blocks,
                         self._next_key)
        self._next_key += 1
        self._requests[request_id] = req
        self.api.submit(req, arrival_s, prompt_tokens)
