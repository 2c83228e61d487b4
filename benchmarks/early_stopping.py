"""How much of a decided trial's measured window early stopping saves, on the real-engine path.

Runs the vllm backend's trial path (:func:`servetune.engines.vllm.engine.run_vllm_trial`) against the
``vllm serve`` stand-in (``python -m servetune.sim.server``, a real subprocess and real HTTP) for
two trials whose outcome is decided early, each with and without early stopping
(:mod:`servetune.engines.early_stop`):

* ``preempting``: servetune-test-850m on an H200 with 64 KV blocks of 16 tokens and 64 sequences
  for 256 + 256-token requests, 32 in flight: it preempts from the first batch
  (``max_preemptions: 0``);
* ``below best``: ``max_num_seqs: 8`` against a best-so-far 3x its full-window throughput.

It prints, per trial, the measured window, the requests sent and answered, the throughput told
and the preemptions counted. The stand-in runs at ``--sim-speedup`` (virtual seconds per wall
second), so windows are short; the shares carry over, the seconds do not. Only the window is
saved: the server's startup (~75 s for an 8B model on vLLM 0.26) and servetune's per-trial
overhead (~22 s) are paid either way.

``--real`` replays the rule instead on the recorded requests of every real vLLM window in
``tests/fixtures/real_h200`` (:func:`real_windows`, :func:`replay`): the output tokens each request
had received by each 0.5 s tick (its streamed chunks, the request's tokens spread over them: what
the server's generation counter says, which the decider reads when chunks merge), the requests
answered, the elapsed window. It prints, by host, the margin each window needed (its final
rate over the lowest mean rate so far once a quarter was answered) and how much of the window the
rule saves on trials 15% and 30% below the best.

Usage::

    PYTHONPATH=platform .venv/bin/python benchmarks/early_stopping.py [--speedup 5] [--real]
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import gzip
import itertools
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "platform", ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from _fidelity import scale_host  # noqa: E402
from servetune.engines.early_stop import EarlyStop  # noqa: E402
from servetune.engines.vllm.engine import VllmLaunch, run_vllm_trial  # noqa: E402
from servetune.workload import Workload  # noqa: E402

WORKLOAD = {"input_len": 256, "output_len": 256, "num_requests": 192, "concurrency": 32}
PREEMPTING = {"max_num_seqs": 64, "max_model_len": 2048, "num_gpu_blocks_override": 64}
SMALL_BATCH = {"gpu_memory_utilization": 0.5, "max_num_seqs": 8}


def _run(flags: dict, rule: EarlyStop | None, speedup: float) -> tuple[object, int]:
    launch = VllmLaunch(model="servetune-test-850m", flags=flags,
                        serve_command=(sys.executable, "-m", "servetune.sim.server"),
                        extra_args=("--sim-gpu", "H200", "--sim-speedup", str(speedup)),
                        env={"PYTHONPATH": str(ROOT / "platform"), "SERVETUNE_SIM_STARTUP_S": "0.2"},
                        stop_grace_s=3.0, log_dir=Path(tempfile.mkdtemp(prefix="servetune-es-")),
                        sample_interval_s=0.1, early_stop=rule)
    result = run_vllm_trial(launch, Workload.from_dict(WORKLOAD))
    note = next((e for e in result.evidence if e.startswith("early stop after")), None)
    sent = int(note.split()[3]) if note else WORKLOAD["num_requests"]
    return result, sent


def table(speedup: float = 5.0) -> str:
    """The Markdown table of the four runs (see the module docstring)."""
    lines = ["| trial | early stopping | window (s) | sent / answered | throughput told (tok/s) | preemptions | "
             "early_stopped |", "|---|---|---|---|---|---|---|"]
    full_small = None
    for name, flags in (("preempting", PREEMPTING), ("below best", SMALL_BATCH)):
        for on in (False, True):
            if not on:
                rule = None
            elif name == "preempting":
                rule = EarlyStop(max_preemptions=0)
            else:
                rule = EarlyStop(max_preemptions=0, best_throughput=3 * (full_small or 0.0))
            r, sent = _run(flags, rule, speedup)
            if name == "below best" and not on:
                full_small = r.output_throughput
            lines.append(f"| {name} | {'on' if on else 'off'} | {r.duration_s or 0:.2f} | {sent} / {r.completed} | "
                         f"{r.output_throughput or 0:,.0f} | {r.preemptions} | {r.early_stopped or '-'} |")
    return "\n".join(lines)


# -- the rule on real windows ---------------------------------------------------------------------

FIXTURES = ROOT / "tests" / "fixtures" / "real_h200"


@dataclasses.dataclass(frozen=True)
class RealWindow:
    """One recorded real window: when its output tokens arrived and when its requests finished."""

    name: str
    token_times: np.ndarray  # seconds into the window, sorted (float64)
    tokens_by: np.ndarray  # output tokens received by token_times[i], cumulative (float64)
    finishes: tuple[float, ...]  # each measured request's finish, sorted

    @property
    def final_throughput(self) -> float:
        return float(self.tokens_by[-1]) / self.finishes[-1]

    def tokens_at(self, t: float) -> float:
        i = int(np.searchsorted(self.token_times, t, side="right"))
        return float(self.tokens_by[i - 1]) if i else 0.0


def _arrivals(records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Every streamed chunk's arrival, sorted by (time, tokens), and the output tokens received by
    then: a chunk carries its request's tokens spread evenly over the request's chunks. A chunk's
    time is the request's first token plus its gaps, added one by one (as the client saw them)."""
    times = np.fromiter(itertools.chain.from_iterable(
        itertools.accumulate(r["itl_s"], initial=r["first_token_s"]) for r in records), dtype=np.float64)
    chunks = np.fromiter((len(r["itl_s"]) + 1 for r in records), dtype=np.int64, count=len(records))
    per_chunk = np.repeat(np.fromiter((r["output_tokens"] for r in records), dtype=np.float64, count=len(records))
                          / chunks, chunks)
    order = np.lexsort((per_chunk, times))  # by time, then tokens: the order sorted() gives the pairs
    return times[order], np.cumsum(per_chunk[order])  # a running sum, added in that order


def real_windows(fixtures: Path = FIXTURES) -> list[RealWindow]:
    """Every real window with recorded requests (warm-up and failed requests left out)."""
    out = []
    for path in sorted([*fixtures.glob("*/requests.json*"), *fixtures.glob("scale/*/*/requests.json*")]):
        summary = path.parent / "summary.json"
        if summary.exists() and json.loads(summary.read_text()).get("profiled"):
            continue  # the engine stalled while the profiler wrote its trace
        raw = path.read_bytes()
        records = [r for r in json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
                   if r.get("request_id", 0) >= 0 and not r.get("error") and r.get("first_token_s") is not None]
        if not records:
            continue
        times, cumulative = _arrivals(records)
        out.append(RealWindow(str(path.parent.relative_to(fixtures)), times, cumulative,
                              tuple(sorted(r["finish_s"] for r in records))))
    return out


def _ticks(window: RealWindow, tick_s: float) -> Iterator[tuple[float, int, float]]:
    """What the decider saw every ``tick_s`` until the window ended: (seconds into the window,
    requests answered, output tokens received)."""
    t = tick_s
    while t < window.finishes[-1]:
        yield t, bisect.bisect_right(window.finishes, t), window.tokens_at(t)
        t += tick_s


def replay(rule: EarlyStop, window: RealWindow, tick_s: float = 0.5) -> tuple[str, float] | None:
    """The rule's first verdict on ``window`` as the decider would have seen it every ``tick_s``
    (``(reason, seconds into the window)``), or None: the window would have run to its end."""
    for t, answered, tokens in _ticks(window, tick_s):
        reason = rule.verdict(preemptions=0, output_tokens=tokens, elapsed_s=t, answered=answered,
                              total=len(window.finishes))
        if reason is not None:
            return reason, t
    return None


def margin_needed(window: RealWindow, min_fraction: float = EarlyStop.min_fraction, tick_s: float = 0.5) -> float:
    """The smallest margin whose bound never fell below the window's final rate: its final rate over
    the lowest mean rate so far while the throughput verdict was open."""
    total = len(window.finishes)
    open_rates = [tokens / t for t, answered, tokens in _ticks(window, tick_s)
                  if min_fraction * total <= answered < total]
    return window.final_throughput / min(open_rates) if open_rates else 0.0


#: The hosts measured after the margin was chosen on the 2026-12-01 and 2026-12-02 windows before them: the
#: key of each (``_fidelity.SCALE_HOSTS``, whichever name its folders carry) and its row label in :func:`real_table`.
LATER_HOSTS: dict[str, str] = {
    "2026-12-02a": "2026-12-02a H200 (not used to choose the margin)",
    "2026-12-02b": "2026-12-02b H200 (measured after the margin was chosen)",
    "2026-12-03a": "2026-12-03a H200 (measured after the margin was chosen)",
    "2026-12-03b": "2026-12-03b H200 (measured after the margin was chosen)",
    "2026-12-03c": "2026-12-03c H200 (measured after the margin was chosen)",
    "2026-12-04a": "2026-12-04a H200 (measured after the margin was chosen)",
    "2026-12-04b": "2026-12-04b H200, 24B (measured after the margin was chosen)",
    "2026-12-04c": "2026-12-04c H200, 24B (measured after the margin was chosen)",
    "2026-12-04d": "2026-12-04d H200, 24B (measured after the margin was chosen)",
    "2026-12-04e": "2026-12-04e H200, 8B and 14B (measured after the margin was chosen)",
    "2026-12-04f": "2026-12-04f H200, 8B (measured after the margin was chosen)",
    "2026-12-04g": "2026-12-04g H200, 24B (measured after the margin was chosen)",
    "2026-12-04h": "2026-12-04h H200, 8B and 24B (measured after the margin was chosen)",
}
#: The row label of the windows the margin was chosen on (every start of no keyed host).
EARLIER_HOSTS = "2026-12-01 and 2026-12-02 H200, before 2026-12-02a"


def real_table(windows: list[RealWindow]) -> str:
    """Per host: the margin its windows needed, and what the shipped rule saves below the best."""
    rule = EarlyStop()
    hosts: dict[str, list[RealWindow]] = {EARLIER_HOSTS: [], **{label: [] for label in LATER_HOSTS.values()}}
    for w in windows:
        host = scale_host(w.name)
        hosts.setdefault(LATER_HOSTS[host] if host else EARLIER_HOSTS, []).append(w)
    lines = [f"margin {rule.margin:g} after {rule.min_fraction:.0%} of the requests answered", "",
             "| windows | n | largest margin needed | windows the rule would cut at a tied best | "
             "window saved, 15% below the best | 30% below |", "|---|---|---|---|---|---|"]
    for label, group in hosts.items():
        if not group:
            continue
        needed = max(margin_needed(w) for w in group)
        cut = sum(replay(dataclasses.replace(rule, best_throughput=w.final_throughput), w) is not None for w in group)
        saved = []
        for below in (0.85, 0.70):
            shares = []
            for w in group:
                verdict = replay(dataclasses.replace(rule, best_throughput=w.final_throughput / below), w)
                shares.append(1.0 - verdict[1] / w.finishes[-1] if verdict else 0.0)
            saved.append(sum(shares) / len(shares))
        lines.append(f"| {label} | {len(group)} | {needed:.3f} | {cut} | {saved[0]:.0%} | {saved[1]:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speedup", type=float, default=5.0, help="the stand-in's virtual seconds per wall second")
    parser.add_argument("--real", action="store_true", help="replay the rule on the recorded real windows instead")
    args = parser.parse_args(argv)
    print(real_table(real_windows()) if args.real else table(args.speedup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
