"""vLLM's API server process in virtual time: one asyncio loop on one core.

Contract: the engine core model (:class:`servetune.sim.scheduler.SimScheduler`) hands it every client
send (:meth:`ApiServer.submit`) and every engine step's sampled tokens (:meth:`ApiServer.step_output`);
:meth:`ApiServer.advance` runs the loop's work in the order vLLM's loop runs it, as far as the
engine's clock makes that order known, and reports when each request reached the engine core
(:meth:`ApiServer.pop_entered`) and when the clients received each step's tokens (``on_delivered``).
Pure: no I/O, no wall clock.

Why it is shaped so (vLLM 0.26, ``v1/engine/async_llm.py`` and ``output_processor.py``):

* **Intake.** An HTTP request is parsed, its prompt tokenized and the request sent to the engine
  core: ``request_overhead_s`` plus ``prompt_token_overhead_s`` per prompt token of loop time
  before the engine can schedule it (a chat request on vLLM 0.11.0 adds its chat template's parse,
  :meth:`ApiServer.add_request_cost`). From vLLM 0.10.0 to 0.23.0 the prompt then waits for the
  micro-batching tokenizer's window after the intake's first pass (``tokenize_wait_s``,
  :mod:`servetune.sim.tokenizer_batch`): latency, not loop CPU; prompts that reach it within one
  window share it, at most ``tokenize_batch`` of them.
* **Output.** The engine core client's socket reader moves every step output that has arrived
  into a queue; AsyncLLM's output handler takes them one step at a time, and on a non-empty queue
  ``await queue.get()`` returns without yielding, so a loop that fell behind drains every step
  that had ended when it woke, in one go (detokenizing, building RequestOutputs: the per-token
  share of ``token_overhead_s``, plus ``stream_prompt_token_s`` per token per prompt token); steps
  that end meanwhile wait for the next pass. Each
  request's stream then writes one SSE chunk with whatever its ``RequestOutputCollector`` merged
  ("RequestOutputs are merged if the producer gets ahead of the consumer"): the per-chunk share
  (``Calibration.api_chunk_share`` of ``token_overhead_s``) once per request per drain.
* **Slices.** The handler processes one step's outputs in slices of at most
  ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` requests (128 by default) and ``await asyncio.sleep(0)``
  between them, so intake work that became ready before a slice boundary runs there, not after the
  whole drain (``output_slice``; 0 keeps a drain whole, as the committed calibration was fitted).
* **The client.** The load generator is one more process that reads each chunk
  (``client_chunk_s``, ``Calibration.client_chunk_s``); clients see tokens when it has read them.
  It, not the API server, bounded the 0.85B windows at 256 in flight: vLLM's engine produced a
  token per request every 7.3 ms, its loop kept up (0.98 chunks per token: nothing merged), and
  the clients received one every 13 ms.
* Work runs in the order it became ready (a step's outputs at the step's end, a request at its
  send), the chunks right after their drain. With one token per chunk (a loop that keeps up) the
  CPU is exactly the per-request and per-token costs; behind, chunks carry several tokens, the
  per-chunk share is paid once for them, and the backlog stays about one drain deep instead of
  growing as one FIFO of every token would (the real 8B windows at 128 in flight streamed 0.52-0.87
  chunks per token with the loop 70-90% busy, and vLLM's histograms put 64-162 ms of their first
  tokens' wait in the API server and client).

Example:
    >>> api = ApiServer(request_s=0.002, prompt_token_s=0.0, token_s=0.0001, stream_prompt_token_s=0.0,
    ...                 chunk_share=0.5)
    >>> api.submit("r0", send_s=0.0, prompt_tokens=16)
    >>> api.advance(horizon_s=1.0)
    >>> api.pop_entered(upto_s=1.0)
    ['r0']
    >>> api.step_output(0, end_s=0.010, sampled=[("r0", 16)])
    >>> delivered = []
    >>> api.advance(horizon_s=0.011, on_delivered=lambda step, t, finished: delivered.append((step, round(t, 6))))
    >>> delivered
    [(0, 0.0101)]
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable, Hashable, Sequence

from servetune.sim.tokenizer_batch import MICROBATCH_MAX_PROMPTS

__all__ = ["ApiServer"]

#: ``on_delivered(step_no, delivered_s, keys)``: the step's tokens reached their clients at
#: ``delivered_s``; ``keys`` are the requests whose last token was among them.
OnDelivered = Callable[[int, float, list[Hashable]], None]
#: One step's output waiting for the loop: (step_no, end_s, keys sampled, their prompt tokens, the
#: sum of those, the keys whose last token it carries).
_Output = tuple[int, float, Sequence[Hashable], Sequence[int], int, Sequence[Hashable]]


class ApiServer:
    """vLLM's API server loop (see the module docstring for the rules).

    Costs are in seconds of the loop's one core, already scaled by the host's ``api_cpu_factor``.
    ``busy_s`` is the CPU it has charged so far (vLLM's ``process_cpu_seconds_total``).
    """

    __slots__ = ("_request_s", "_prompt_token_s", "_token_s", "_chunk_s", "_stream_prompt_token_s", "_passes",
                 "_client_chunk_s", "free_s", "busy_s", "client_free_s", "_sends", "_outputs", "_entered",
                 "_order", "_slice", "_tok_wait", "_tok_cap", "_tok_deadline", "_tok_members")

    def __init__(self, request_s: float, prompt_token_s: float, token_s: float, stream_prompt_token_s: float,
                 chunk_share: float, intake_passes: int = 1, client_chunk_s: float = 0.0,
                 output_slice: int = 0, tokenize_wait_s: float = 0.0,
                 tokenize_batch: int = MICROBATCH_MAX_PROMPTS) -> None:
        if not 0.0 <= chunk_share <= 1.0:
            raise ValueError(f"chunk_share must be in [0, 1], got {chunk_share}")
        if intake_passes < 1:
            raise ValueError(f"intake_passes must be >= 1, got {intake_passes}")
        if output_slice < 0:
            raise ValueError(f"output_slice must be >= 0, got {output_slice}")
        if tokenize_wait_s < 0.0 or tokenize_batch < 1:
            raise ValueError(f"tokenize_wait_s must be >= 0 and tokenize_batch >= 1, got {tokenize_wait_s}, "
                             f"{tokenize_batch}")
        # The micro-batching tokenizer (sim.tokenizer_batch): its window (0: none), the most prompts
        # a batch takes, and the open batch's deadline and size.
        self._tok_wait = tokenize_wait_s
        self._tok_cap = tokenize_batch
        self._tok_deadline = -math.inf
        self._tok_members = 0
        self._passes = intake_passes
        self._slice = output_slice
        self._client_chunk_s = client_chunk_s
        self.client_free_s = 0.0  # when the load generator has read every chunk written so far
        self._request_s = request_s
        self._prompt_token_s = prompt_token_s
        self._token_s = token_s * (1.0 - chunk_share)
        self._chunk_s = token_s * chunk_share
        self._stream_prompt_token_s = stream_prompt_token_s
        self.free_s = 0.0  # when the loop next has nothing to do
        self.busy_s = 0.0
        # heap: (ready_s, order, key, prompt tokens, passes done): a send is ready at its send time,
        # then again after each pass of the loop its intake takes.
        self._sends: list[tuple[float, int, Hashable, int, int]] = []
        # Steps whose tokens no client has yet: (step_no, end_s, the keys sampled, their prompt
        # tokens (one each, in order), the sum of those, the keys whose last token they carry).
        self._outputs: collections.deque[_Output] = collections.deque()
        self._entered: list[tuple[float, int, Hashable]] = []  # heap: (entry_s, order, key)
        self._order = 0

    # -- input ---------------------------------------------------------------------------------

    def add_request_cost(self, seconds: float) -> None:
        """Every later request's intake takes ``seconds`` more loop CPU (a chat request's template work)."""
        if seconds < 0.0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self._request_s += seconds

    def submit(self, key: Hashable, send_s: float, prompt_tokens: int) -> None:
        """A client sends a request at ``send_s``."""
        heapq.heappush(self._sends, (send_s, self._order, key, prompt_tokens, 0))
        self._order += 1

    def step_output(self, step_no: int, end_s: float, sampled: Sequence[tuple[Hashable, int]],
                    finished: Sequence[Hashable] = ()) -> None:
        """The engine step ``step_no`` ended at ``end_s`` having sampled one token for each
        ``(key, prompt tokens)`` of ``sampled``; ``finished`` sampled their last one. Steps come in order."""
        if sampled:  # a step that sampled nothing streams nothing and finished nothing
            prompts = [p for _, p in sampled]
            self._outputs.append((step_no, end_s, [k for k, _ in sampled], prompts, sum(prompts), finished))

    def step_keys(self, step_no: int, end_s: float, keys: Sequence[Hashable], prompts: Sequence[int],
                  prompt_sum: int, finished: Sequence[Hashable] = ()) -> None:
        """:meth:`step_output` with the sampled requests given as ``keys`` and their ``prompts``
        (one each, in order; read only where an output slice needs them) and ``prompt_sum``, their sum."""
        if keys:
            self._outputs.append((step_no, end_s, keys, prompts, prompt_sum, finished))

    # -- state ---------------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Whether a send or a step's tokens wait for the loop, or an entered request for the engine."""
        return bool(self._sends or self._outputs or self._entered)

    def next_entry_s(self) -> float:
        """When the earliest request not yet taken by the engine entered it (inf: none)."""
        return self._entered[0][0] if self._entered else math.inf

    def pop_entered(self, upto_s: float) -> list[Hashable]:
        """The requests that reached the engine core by ``upto_s``, in the order they did."""
        out = []
        entered = self._entered
        while entered and entered[0][0] <= upto_s:
            out.append(heapq.heappop(entered)[2])
        return out

    # -- the loop ------------------------------------------------------------------------------

    def advance(self, horizon_s: float, on_delivered: OnDelivered | None = None, until_entry: bool = False) -> None:
        """Run the loop's work that the engine's clock makes known.

        Every engine step ending by ``horizon_s`` has been reported (:meth:`step_output`) and any
        later one ends after it, so work that became ready by then runs, in order; a drain that
        would still be absorbing steps past the horizon waits for the engine. ``until_entry``
        (the engine is idle: no step comes before a request enters it): run past the horizon and
        stop once a request has entered the engine core.
        """
        sends, outputs = self._sends, self._outputs
        while sends or outputs:
            out_ready = outputs[0][1] if outputs else math.inf
            send_ready = sends[0][0] if sends else math.inf
            if min(out_ready, send_ready) > horizon_s and not until_entry:
                return
            if out_ready <= send_ready:
                if not self._drain(horizon_s, until_entry, on_delivered):
                    return
            elif self._intake_pass() and until_entry:
                return

    def _intake_pass(self) -> bool:
        """Run the earliest ready send's next intake pass; True if that pass entered it into the engine."""
        ready_s, order, key, prompt, done = heapq.heappop(self._sends)
        cost = (self._request_s + prompt * self._prompt_token_s) / self._passes
        t = (ready_s if ready_s > self.free_s else self.free_s) + cost
        self.free_s = t
        self.busy_s += cost
        if done == 0 and self._tok_wait:  # the prompt waits for its tokenizer batch; the loop does not
            t = self._tokenizer_batch(t)
        if done + 1 < self._passes:  # awaits: back of the loop's queue, behind what became ready
            heapq.heappush(self._sends, (t, order, key, prompt, done + 1))
            return False
        heapq.heappush(self._entered, (t, order, key))
        return True

    def _tokenizer_batch(self, t: float) -> float:
        """When the prompt that reached the micro-batching tokenizer at ``t`` is tokenized: the open
        batch's deadline if it is still open at ``t`` and not full, else a new batch's (``t`` plus
        the window). A full batch is released at its deadline here, where vLLM releases it at its
        last prompt: up to one window late, and only when ``tokenize_batch`` first passes fit in one
        window (never at the calibrated costs: 32 passes of 0.27 ms)."""
        if t <= self._tok_deadline and self._tok_members < self._tok_cap:
            self._tok_members += 1
            return self._tok_deadline
        self._tok_deadline = t + self._tok_wait
        self._tok_members = 1
        return self._tok_deadline

    def _drain(self, horizon_s: float, until_entry: bool, on_delivered: OnDelivered | None) -> bool:
        """Drain the steps the loop has read, then write each request's chunk; False if which steps
        those are is not known yet (the drain starts past the horizon)."""
        outputs = self._outputs
        start = max(self.free_s, outputs[0][1])
        if start > horizon_s and not until_entry:
            return False  # a step the engine has not run yet may end before the drain starts
        # The socket reader put every step that had ended into the queue before the handler woke;
        # steps ending during the drain wait for the next pass (after the chunks).
        n = 0
        tokens = 0
        prompt_tokens = 0
        while n < len(outputs) and outputs[n][1] <= start:
            tokens += len(outputs[n][2])
            prompt_tokens += outputs[n][4]
            n += 1
        drained = [outputs.popleft() for _ in range(n)]
        chunks = len(drained[0][2]) if n == 1 else len(set().union(*[out[2] for out in drained]))
        cost = tokens * self._token_s + prompt_tokens * self._stream_prompt_token_s + chunks * self._chunk_s
        self.busy_s += cost
        self.free_s = start
        if self._slice and self._sends and any(len(out[2]) > self._slice for out in drained):
            self._yield_between_slices(drained)  # (no boundary, or nothing to run at one: nothing to do)
        t = self.free_s + cost
        self.free_s = t
        if self._client_chunk_s:  # the client reads the chunks after the loop wrote them, one at a time
            t = max(t, self.client_free_s) + chunks * self._client_chunk_s
            self.client_free_s = t
        if on_delivered is not None:
            for out in drained:
                on_delivered(out[0], t, list(out[5]))
        return True

    def _yield_between_slices(self, drained: Sequence[_Output]) -> None:
        """Run the intake passes that asyncio lets in at the drain's slice boundaries: at each, every
        send whose next pass was ready by then runs once, in order (the handler goes to the back of
        the ready queue; a pass that ends there is behind it). ``free_s`` moves by their cost only;
        the caller adds the drain's own. The slices' SSE chunks are still written after the drain."""
        start = self.free_s
        work = shift = 0.0  # the drain's own work so far, and the intake run inside it
        for out in drained:
            prompts = out[3]
            for i, prompt in enumerate(prompts):
                work += self._token_s + prompt * self._stream_prompt_token_s
                if (i + 1) % self._slice or i + 1 == len(prompts):
                    continue  # no boundary here: slices are cut within one step's outputs
                boundary = start + work + shift
                while self._sends and self._sends[0][0] <= boundary:
                    self.free_s = max(self.free_s, boundary)
                    before = self.free_s
                    self._intake_pass()
                    shift += self.free_s - before
        self.free_s = start + shift
