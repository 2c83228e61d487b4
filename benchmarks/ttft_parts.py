"""What the simulator's mean TTFT is made of on a published run, part by part, beside the real one.

For each measured request of a run simulated as ``published_runs.judge`` simulates it, the time from
the client's send to the client reading its first token splits into four parts that add up to it:

* ``intake``: the send until the request reached the engine core (the API server's loop: the HTTP
  parse, the chat template, tokenization and its micro-batching window; ``sim/frontend.py``);
* ``queue``: entered the engine core until the first step that schedules it began (a burst waiting
  for the token budget or a free sequence slot, or a batch already formed);
* ``prefill``: that step's start until the step that samples its first token ended (its prefill
  chunks, and any first-use kernel compile of a step in between, ``stall`` apart);
* ``stream``: that step's end until the client has read the token (the API server's output drain
  and the client's read).

``stall`` is the part of ``queue`` and ``prefill`` spent in first-use fused-MoE compiles
(``sim.moe_jit``), and ``chunks`` the steps that prefilled the request. Each part is the mean over
the run's measured requests (one replica's under DP, as simulated), in milliseconds; their sum is
the simulated mean TTFT. Nothing here is fitted; it reads the simulation and changes nothing.

Usage::

    PYTHONPATH=platform .venv/bin/python benchmarks/ttft_parts.py [--all] [--id RUN ...] [--json]

With no ``--id``: every held-out run whose TTFT is simulated more than 25% off (``--all``: every
held-out run), one row each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "platform", ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import published_runs  # noqa: E402
from servetune.sim import engine as sim_engine  # noqa: E402
from servetune.sim.scheduler import SimScheduler  # noqa: E402

__all__ = ["PARTS", "RecordingScheduler", "ttft_parts", "main"]

#: The parts, in the order they follow one another (their means add up to the simulated mean TTFT).
PARTS = ("intake", "queue", "prefill", "stream")


class RecordingScheduler(SimScheduler):
    """A :class:`SimScheduler` that notes, per request, when it was sent, entered the engine core and
    was first scheduled, and per step its first-use compile stall. Figures as the plain scheduler's."""

    #: The schedulers built while :func:`_recording` is active, newest last.
    built: list[RecordingScheduler] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent_s: dict[str, float] = {}
        self.entered_s: dict[str, float] = {}
        self.first_scheduled_s: dict[str, float] = {}
        self.step_stall_s: list[tuple[float, float]] = []  # (start, stall) of each step with a compile
        RecordingScheduler.built.append(self)

    def add_request(self, request_id: str, prompt_tokens: int, max_tokens: int, arrival_s: float,
                    prefix_group: int | None = None, prefix_tokens: int = 0) -> None:
        super().add_request(request_id, prompt_tokens, max_tokens, arrival_s, prefix_group, prefix_tokens)
        self.sent_s[request_id] = arrival_s

    def _admit_arrivals(self, upto: float | None = None) -> None:
        self.api.advance(self.now_s, self._delivered)
        limit = self.now_s if upto is None else upto
        for entry_s, _order, req in self.api._entered:  # noqa: SLF001 - read only
            if entry_s <= limit:
                self.entered_s.setdefault(req.rid, entry_s)  # type: ignore[attr-defined]
        super()._admit_arrivals(upto)

    def _batch(self, tally: Any, start: int, preempted: list[Any]) -> tuple[list[Any], list[Any]]:
        scheduled, sampled = super()._batch(tally, start, preempted)
        for req, _tokens in scheduled:
            self.first_scheduled_s.setdefault(req.rid, self.now_s)
        return scheduled, sampled

    def _duration(self, out: Any, gpu_idle: bool = False) -> float:
        duration = super()._duration(out, gpu_idle)
        kernels = self.perf.step_time(out.num_reqs, out.num_tokens, out.kv_context, out.attn_work,
                                      out.prefill_tokens == 0, out.prefill_tokens, out.prefill_context,
                                      out.prefill_attn, gpu_idle)
        if duration - kernels > 1e-9:
            self.step_stall_s.append((self.now_s, duration - kernels))
        return duration


@contextlib.contextmanager
def _recording() -> Iterator[list[RecordingScheduler]]:
    """Within it, ``servetune.sim.engine.simulate`` builds :class:`RecordingScheduler`; yields the list
    of those built."""
    saved = sim_engine.SimScheduler
    RecordingScheduler.built = []
    sim_engine.SimScheduler = RecordingScheduler  # type: ignore[misc]
    try:
        yield RecordingScheduler.built
    finally:
        sim_engine.SimScheduler = saved  # type: ignore[misc]


def _parts_of(sched: RecordingScheduler) -> dict[str, float]:
    """The mean parts (ms) over ``sched``'s measured requests (those not named ``warmup-*``)."""
    rows: dict[str, list[float]] = {p: [] for p in (*PARTS, "stall", "chunks")}
    for rid, sent in sched.sent_s.items():
        if rid.startswith("warmup-") or rid not in sched.first_scheduled_s:
            continue
        req = sched.request(rid)
        step = req.first_step
        if step < 0:
            continue
        entered = sched.entered_s.get(rid, sent)
        begun = sched.first_scheduled_s[rid]
        ended = sched.step_end_s[step]
        read = sched.deliver_s[step]
        for name, value in zip(PARTS, (entered - sent, begun - entered, ended - begun, read - ended)):
            rows[name].append(1e3 * value)
        rows["stall"].append(1e3 * sum(s for start, s in sched.step_stall_s if entered <= start < ended))
        rows["chunks"].append(float(sum(1 for t in sched.step_end_s if begun < t <= ended)))
    return {name: statistics.fmean(values) if values else 0.0 for name, values in rows.items()}


def ttft_parts(run: published_runs.PublishedRun) -> dict[str, Any]:
    """``run`` simulated as :func:`published_runs.judge` does, its mean TTFT split into :data:`PARTS`
    (ms) plus ``stall`` and ``chunks``; with the real and simulated mean TTFT and the headline error.
    The last simulation :func:`judge` runs is the run's own (earlier ones replay its server's history)."""
    with _recording() as built:
        judged = published_runs.judge(run)
    parts = _parts_of(built[-1]) if built and judged.failure is None else {}
    return {"id": run.id, "gpu": run.gpu, "vllm": run.vllm_version, "ttft_real": run.stat("ttft_ms"),
            "ttft_sim": judged.sim_ttft_ms, "ttft_error_pct": None if judged.ttft_error is None
            else round(100 * judged.ttft_error, 1), "headline_error_pct": None if judged.headline_error is None
            else round(100 * judged.headline_error, 1), **{k: round(v, 2) for k, v in parts.items()}}


def _format(rows: Sequence[dict[str, Any]]) -> str:
    head = ("| run | vLLM | real TTFT ms | simulated | error | headline | intake | queue | prefill | stall "
            "| chunks | stream |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if "intake" not in r:
            lines.append(f"| {r['id']} | {r['vllm']} | {r['ttft_real']} | failed | | | | | | | | |")
            continue
        lines.append(f"| {r['id']} | {r['vllm']} | {r['ttft_real']:,.1f} | {r['ttft_sim']:,.1f} | "
                     f"{r['ttft_error_pct']:+.1f}% | {r['headline_error_pct']:+.1f}% | {r['intake']:,.1f} | "
                     f"{r['queue']:,.1f} | {r['prefill']:,.1f} | {r['stall']:,.1f} | {r['chunks']:.1f} | "
                     f"{r['stream']:,.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the parts of the chosen runs (default: the held-out runs more than 25% off on TTFT)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--id", nargs="*", default=[], help="these runs only (ids of published_runs.py --runs)")
    ap.add_argument("--all", action="store_true", help="every held-out run, not only the TTFT misses")
    ap.add_argument("--json", action="store_true", help="the rows as JSON")
    args = ap.parse_args(argv)
    runs = published_runs.load_runs()
    known = {r.id for r in runs}
    unknown = [i for i in args.id if i not in known]
    if unknown:
        print(f"error: --id: no run {unknown[0]!r} (fix: use an id from published_runs.py --runs)", file=sys.stderr)
        return 2
    chosen = [r for r in runs if r.id in args.id] if args.id else [r for r in runs if r.split == "held_out"]
    rows = [ttft_parts(r) for r in chosen]
    if not args.id and not args.all:
        rows = [r for r in rows if r["ttft_error_pct"] is None or abs(r["ttft_error_pct"]) > 25]
    print(json.dumps(rows, indent=1) if args.json else _format(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
