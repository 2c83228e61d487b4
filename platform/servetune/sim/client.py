"""The load generator's side of a simulated trial: warm-up, then the measured requests, then their records.

:class:`LoadClient` drives one :class:`~servetune.sim.scheduler.SimScheduler` the way ``vllm bench
serve`` drives a server. Warm-up requests go first, up to the workload's concurrency at a time,
and are excluded (the window opens once every one is answered). Re-sent prompts
(``Workload.cached_fraction``) are primed among them: one request per measured prompt, its cached
part plus one token and one output token, last prompt first, so the blocks the server holds from
the earlier run are evictable cached blocks when the window opens, the first prompts' the newest.
Closed loop (``concurrency``): that many clients each send the next request as soon as theirs
completes. Timed (``request_rate`` or a trace): requests arrive at their ``arrival_s``, at most ``concurrency`` at
once when that is set too. A request the engine refuses (vLLM's HTTP 400) is recorded as failed
and frees its slot at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from servetune.result import RequestRecord
from servetune.sim.scheduler import SimScheduler
from servetune.workload import RequestSpec, Workload

if TYPE_CHECKING:
    import numpy as np

__all__ = ["LoadClient", "ChunkGaps"]


def _primes(measured: Sequence[RequestSpec]) -> list[RequestSpec]:
    """The requests that leave each re-sent prompt's cached part in the prefix cache (last first)."""
    return [RequestSpec(s.prefix_tokens + 1, 1, None, s.prefix_group, s.prefix_tokens)
            for s in reversed(measured) if s.prefix_group is not None and s.prefix_tokens]


class LoadClient:
    """One trial's clients against one simulated engine core.

    Example:
        >>> # client = LoadClient(sched, workload)
        >>> # client.warm_up(); client.send_measured(); records = client.records()
    """

    def __init__(self, sched: SimScheduler, workload: Workload) -> None:
        self.sched = sched
        if workload.chat:  # vLLM's chat endpoint: the template work on the API server's loop
            sched.api.add_request_cost(sched.perf.chat_request_overhead_s)
        specs = workload.requests(include_warmup=True)
        #: Warm-up requests come first in the workload's list (a trace has none).
        self.num_warmup = workload.warmup_requests if workload.trace_file is None else 0
        self.measured: list[RequestSpec] = specs[self.num_warmup:]
        self.warm: list[RequestSpec] = specs[:self.num_warmup] + (_primes(self.measured)
                                                                  if workload.cached_fraction else [])
        self.concurrency = workload.concurrency
        #: When the measured window opens: the client has the warm-up's last token.
        self.t0 = 0.0
        #: The API server's CPU seconds spent before the window opened.
        self.busy_at_t0 = 0.0
        #: The prefix-cache lookups vLLM's counters took before the window opened (the warm-up's).
        self.lookups_at_t0 = 0
        self._warm_queue = list(enumerate(self.warm))
        self._errors: dict[int, str] = {}
        self._arrival_of: dict[int, float] = {}
        self._timed = bool(self.measured) and self.measured[0].arrival_s is not None
        self._next_i = 0

    def run(self) -> list[RequestRecord]:
        """Warm up, send every measured request, and return their records (window-relative times)."""
        self.warm_up()
        self.send_measured()
        return self.records()

    # -- warm-up --------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Send the warm-up requests, up to the concurrency at a time, and run them to the end."""
        sched = self.sched
        for _ in range(min(len(self.warm), max(1, self.concurrency or len(self.warm)))):
            self._warm_next()
        sched.run_until_idle(self._warm_next)
        self.t0 = max(sched.now_s, sched.api.free_s, sched.api.client_free_s)
        self.busy_at_t0 = sched.frontend_busy_s
        self.lookups_at_t0 = len(sched.counted_lookups)

    def _warm_next(self, _rid: str = "", now: float | None = None) -> None:
        """Send the next warm-up request the engine accepts (at ``now``, default the engine's clock)."""
        sched = self.sched
        while self._warm_queue:
            i, spec = self._warm_queue.pop(0)
            try:
                sched.add_request(f"warmup-{i}", spec.prompt_tokens, spec.output_tokens,
                                  sched.now_s if now is None else now, spec.prefix_group, spec.prefix_tokens)
                return
            except ValueError:
                continue

    # -- the measured window --------------------------------------------------------------------

    def send_measured(self) -> None:
        """Send the measured requests: all at their arrival times (timed, no limit), else through
        ``concurrency`` slots, each freed slot taking the next request; run to the end."""
        limit = self.concurrency if self.concurrency else None
        if self._timed and limit is None:
            for i, spec in enumerate(self.measured):
                self._send(i, self.t0 + (spec.arrival_s or 0.0))
            self.sched.run_until_idle()
            return
        for _ in range(min(limit or 1, len(self.measured))):
            self._refill(self.t0)
        self.sched.run_until_idle(self._on_finish)

    def _send(self, i: int, at: float) -> bool:
        spec = self.measured[i]
        rid = str(i)
        self._arrival_of[i] = at
        try:
            self.sched.add_request(rid, spec.prompt_tokens, spec.output_tokens, at,
                                   spec.prefix_group, spec.prefix_tokens)
        except ValueError as exc:  # vLLM answers 400; the client records a failed request
            self._errors[i] = str(exc)
            return False
        return True

    def _refill(self, now: float) -> None:
        """A slot is free at ``now``: send the next request (at its arrival time, when timed)."""
        measured = self.measured
        while self._next_i < len(measured):
            i = self._next_i
            self._next_i += 1
            at = now if not self._timed else max(now, self.t0 + (measured[i].arrival_s or 0.0))
            if self._send(i, at):
                return  # one slot taken; a refused request frees its slot at once

    def _on_finish(self, rid: str, now: float) -> None:
        if not rid.startswith("warmup-"):
            self._refill(now)

    # -- records --------------------------------------------------------------------------------

    def records(self) -> list[RequestRecord]:
        """Each measured request as the load generator records it, times from the window's start."""
        import numpy as np

        sched, t0, offset = self.sched, self.t0, self.num_warmup
        times = np.asarray(sched.deliver_s, dtype=float) - t0  # when the client got each step's tokens
        out: list[RequestRecord] = []
        for i, spec in enumerate(self.measured):
            arrival = self._arrival_of.get(i, t0) - t0
            if i in self._errors:
                out.append(RequestRecord(i + offset, spec.prompt_tokens, 0, arrival, None, None,
                                         error=self._errors[i]))
                continue
            req = sched.request(str(i))
            runs = tuple(req.token_runs())
            out.append(RequestRecord(
                request_id=i + offset, prompt_tokens=req.prompt, output_tokens=req.output, arrival_s=arrival,
                first_token_s=float(times[runs[0][0]]) if runs else None,
                finish_s=float(times[req.finish_step]) if req.finish_step >= 0 else None,
                itl_s=ChunkGaps(times, runs), preemptions=req.preemptions))
        return out

    def pooled_itl_s(self) -> tuple[list[float], list[int]]:
        """Every inter-chunk gap of the completed measured requests, pooled: distinct gaps (s) and
        how often each occurs (what :func:`servetune.result.summarize` takes as ``pooled_itl_s``).

        The client sees chunks: tokens the API server delivered together arrive as one (one ITL gap,
        as ``vllm bench serve`` records it). Within a run of consecutive steps a request's gap at
        step ``j`` is the step timeline's ``times[j] - times[j-1]`` when that is not 0, so the pool
        is each step's gap weighted by how many runs span it, plus one gap where a run resumes.
        """
        import numpy as np

        sched, t0 = self.sched, self.t0
        times = np.asarray(sched.deliver_s, dtype=float) - t0
        firsts: list[int] = []
        lasts: list[int] = []
        resumed: list[float] = []
        for i in range(len(self.measured)):
            if i in self._errors:
                continue
            req = sched.request(str(i))
            if req.finish_step < 0:
                continue
            prev = -1
            for first, last in req.token_runs():
                firsts.append(first)
                lasts.append(last)
                if prev >= 0 and times[first] != times[prev]:
                    resumed.append(float(times[first] - times[prev]))
                prev = last
        span = np.zeros(len(times) + 1, dtype=np.int64)
        np.add.at(span, np.asarray(firsts, dtype=np.int64) + 1, 1)
        np.add.at(span, np.asarray(lasts, dtype=np.int64) + 1, -1)
        counts = np.cumsum(span)[1:len(times)]  # runs holding steps j-1 and j, for j >= 1
        gaps = times[1:] - times[:-1]
        keep = (counts > 0) & (gaps != 0)
        return (gaps[keep].tolist() + resumed, counts[keep].tolist() + [1] * len(resumed))


class ChunkGaps(Sequence[float]):
    """One request's inter-chunk gaps (s), computed on demand from the step timeline it shares
    with the other requests of its trial and the runs of steps that produced its tokens: a
    record keeps no per-token list. Equal to the tuple of the same gaps."""

    __slots__ = ("_times", "_runs")

    def __init__(self, times: np.ndarray, runs: tuple[tuple[int, int], ...]) -> None:
        self._times = times
        self._runs = runs

    def _token_times(self) -> np.ndarray:
        import numpy as np

        runs = self._runs
        if len(runs) == 1:
            return self._times[runs[0][0]:runs[0][1] + 1]
        return np.concatenate([self._times[first:last + 1] for first, last in runs])

    def as_array(self) -> np.ndarray:
        """The gaps as a float64 array (what the tuple holds, without a Python float per gap)."""
        import numpy as np

        if not self._runs:
            return np.empty(0, dtype=np.float64)
        # A token whose time differs from the one before starts a chunk; the gap to it is the
        # difference of the two chunks' times (every token of a chunk has the chunk's time).
        t = self._token_times()
        gaps = t[1:] - t[:-1]
        return np.asarray(gaps[gaps != 0], dtype=np.float64)

    def _gaps(self) -> tuple[float, ...]:
        return tuple(self.as_array().tolist())

    def __len__(self) -> int:
        if not self._runs:
            return 0
        t = self._token_times()
        return int((t[1:] != t[:-1]).sum())

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        return self._gaps()[index]

    def __iter__(self) -> Iterator[float]:
        return iter(self._gaps())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkGaps | tuple | list):
            return self._gaps() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._gaps())

    def __repr__(self) -> str:
        return repr(self._gaps())

    def __reduce__(self) -> tuple[Any, ...]:
        return (ChunkGaps, (self._times, self._runs))
