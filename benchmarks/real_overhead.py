"""servetune's own overhead per real trial, from the real studies kept in tests/fixtures.

For every served or failed real trial: the seconds the driver waited for it (``dispatch_s``: handed
to Ray until its result was back), vLLM's launch-to-healthy (``startup_s``), the measured window
(``duration_s``), the windows of confirmation repeats measured on the trial's own server start
(their ``wall_s``: a repeat row with no dispatch of its own), and what is left, servetune's
overhead, split into the Ray part (``dispatch_s - wall_s``: actor start, transfer) and the
in-actor part (``wall_s - startup_s - duration_s - repeats``: pre-launch checks, warm-up requests,
stop and GPU-memory check, log parsing). Trials recorded after 2026-11-30 also carry
``timing_actor_start_s`` (hand-over to the actor's first line), which splits the Ray part into
starting the actor and returning the result. A trial the simulator screen pruned started nothing
and is not counted. The share is the overhead over the trial's dispatch time; the standing goal
is at most 3%.

Studies (``--study``, repeatable; all by default):
- ``h200x2``: ``real_h200/study_h200x2`` (two one-GPU slots, a grid and a parallel study). The
  first trial of each slot also read `vllm serve --help=all` itself (20-30 s of vLLM imports);
  the driver now reads it once before the first trial (servetune.study).
- ``h100``: ``real_h100_study/study_l8b_tune`` (one H100 SXM, 2026-12-05, `servetune tune
  benchmarks/real_vllm/h100_l8b_tune.yaml`). Its first trial started the study's Ray worker
  (``timing_actor_start_s`` 3.1 s against 0.002 s after it) and held the winner's repeat.

Run: ``.venv/bin/python benchmarks/real_overhead.py [--study h100]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "platform"))

from servetune.records import dataset  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"


@dataclass(frozen=True)
class Study:
    """A real study's dataset and the trials that paid a once-per-slot cost (``(study, trial)``)."""

    path: Path
    first: frozenset[tuple[str, int]]
    first_note: str


STUDIES: dict[str, Study] = {
    "h200x2": Study(FIXTURES / "real_h200" / "study_h200x2" / "dataset",
                    frozenset({("h200x2-grid", 0), ("h200x2-grid", 1)}), "read `vllm serve --help=all`"),
    "h100": Study(FIXTURES / "real_h100_study" / "study_l8b_tune" / "dataset",
                  frozenset({("h100-l8b-tune", 0)}), "started the study's Ray worker"),
}


@dataclass(frozen=True)
class TrialOverhead:
    """One real trial's seconds, as the driver and the actor recorded them."""

    study: str
    trial: int
    status: str
    dispatch_s: float
    startup_s: float
    window_s: float
    repeats_s: float  # repeat windows measured on this trial's own server start

    @property
    def overhead_s(self) -> float:
        return self.dispatch_s - self.startup_s - self.window_s - self.repeats_s

    @property
    def share(self) -> float:
        return self.overhead_s / self.dispatch_s


def _num(value: Any) -> float:
    """A dataset float, 0.0 for a missing (NaN or None) one."""
    return float(value) if value is not None and value == value else 0.0


def trial_overheads(rows: Sequence[Mapping[str, Any]]) -> list[TrialOverhead]:
    """The dispatched trials of ``rows`` (dataset records), each with its same-start repeats' windows.

    Example:
        >>> rows = [{"study": "s", "trial_number": 0, "status": "ok", "dispatch_s": 100.0, "startup_s": 60.0,
        ...          "duration_s": 20.0}, {"study": "s", "trial_number": 0, "status": "ok",
        ...          "dispatch_s": float("nan"), "wall_s": 15.0}]
        >>> [round(t.overhead_s, 1) for t in trial_overheads(rows)]
        [5.0]
    """
    repeats: dict[tuple[str, int], float] = {}
    for r in rows:
        if not _num(r.get("dispatch_s")):
            key = (str(r["study"]), int(r["trial_number"]))
            repeats[key] = repeats.get(key, 0.0) + _num(r.get("wall_s"))
    out = []
    for r in rows:
        if _num(r.get("dispatch_s")):
            key = (str(r["study"]), int(r["trial_number"]))
            out.append(TrialOverhead(key[0], key[1], str(r["status"]), float(r["dispatch_s"]), _num(r["startup_s"]),
                                     _num(r.get("duration_s")), repeats.get(key, 0.0)))
    return sorted(out, key=lambda t: (t.study, t.trial))


def _line(label: str, trials: Sequence[TrialOverhead]) -> str:
    total = sum(t.dispatch_s for t in trials)
    over = sum(t.overhead_s for t in trials)
    return (f"{label}: {len(trials)} trials, overhead {over:.1f} s of {total:.1f} s = {over / total:.1%}, "
            f"{over / len(trials):.1f} s per trial")


def report(name: str, study: Study) -> list[TrialOverhead]:
    """Print one study's table and its totals with and without its first trials; return its rows."""
    df = dataset.read_trials(study.path)
    rows = df.to_dict("records")
    trials = trial_overheads(rows)
    walls = {(str(r["study"]), int(r["trial_number"])): _num(r.get("wall_s")) for r in rows if _num(r.get("dispatch_s"))}
    print(f"== {name} ({study.path.relative_to(ROOT)})")
    print(f"{'study':<16}{'#':>3} {'status':<12}{'trial s':>9}{'startup':>9}{'window':>8}{'repeats':>8}{'overhead':>10}"
          f"{'ray':>7}{'actor':>7}{'share':>8}")
    for t in trials:
        wall = walls[(t.study, t.trial)]
        ray_part, actor_part = t.dispatch_s - wall, wall - t.startup_s - t.window_s - t.repeats_s
        print(f"{t.study:<16}{t.trial:>3} {t.status:<12}{t.dispatch_s:>9.1f}{t.startup_s:>9.1f}{t.window_s:>8.1f}"
              f"{t.repeats_s:>8.1f}{t.overhead_s:>10.1f}{ray_part:>7.1f}{actor_part:>7.1f}{t.share:>8.1%}")
    print(_line("all", trials))
    rest = [t for t in trials if (t.study, t.trial) not in study.first]
    print(_line(f"without the first trial of each slot (which {study.first_note})", rest))
    print()
    return trials


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--study", action="append", choices=sorted(STUDIES), help="only these studies (repeatable)")
    args = parser.parse_args(argv)
    for name in args.study or list(STUDIES):
        report(name, STUDIES[name])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
