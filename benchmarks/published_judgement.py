"""The simulator's judgement on each GPU type by the published runs held out: the table ``servetune`` ships.

Simulates every published run (``benchmarks/published_runs.py``: all of ``tests/fixtures/published_runs``,
the committed calibration, as ``sim_fidelity.py --published`` does), keeps the held-out ones, and counts
per GPU type how many put the headline figure (closed-loop output throughput, open-loop TPOT) within 10% of
the published one (the target: 80% of a GPU type's runs) and TTFT within 25%, with the median and the range
of the signed headline error. ``servetune.planner.gpus.calibration_note`` reads the table
(``platform/servetune/data/published_judgement.json``): a GPU type below 80% within 10% gets a line beside
every simulated figure and the simulator screen's wider margins.

``tests/planner/test_published_judgement.py`` checks the shipped table against the recorded comparisons in
``benchmarks/results`` (which ``tests/sim/test_published_runs*.py`` check against today's simulator). After
regenerating those, write the table again (about a minute)::

    .venv/bin/python benchmarks/published_judgement.py --write
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import published_runs

from servetune.errors import SpecError

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "platform" / "servetune" / "data" / "published_judgement.json"
HEADLINE_WITHIN = 0.10
TTFT_WITHIN = 0.25
TARGET_SHARE = 0.8


def model_class(run: published_runs.PublishedRun) -> str:
    """The run's model's judgement group (:attr:`~servetune.planner.modelinfo.ModelProfile.judgement_class`), as
    ``calibration_note`` classes the model it is given: by its profile."""
    return published_runs.resolve_model(run.model, published_runs.FIXTURES).judgement_class


def held_out_rows(judged: Sequence[published_runs.Judged]) -> list[dict[str, Any]]:
    """The held-out runs' GPU, layout, model class and unrounded headline and TTFT errors (fractions; None: not
    judged)."""
    return [{"id": j.run.id, "gpu": j.run.gpu, "layout": j.run.layout_label, "class": model_class(j.run),
             "error": j.headline_error, "ttft_error": j.ttft_error} for j in judged if j.run.split == "held_out"]


def _within(errors: Sequence[float | None], limit: float) -> int:
    return sum(1 for e in errors if e is not None and abs(e) <= limit)


def _counts(group: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    errors = [100 * r["error"] for r in group if r["error"] is not None]
    return {
        "runs": len(group),
        "headline_within_10pct": _within([r["error"] for r in group], HEADLINE_WITHIN),
        "ttft_within_25pct": _within([r["ttft_error"] for r in group], TTFT_WITHIN),
        "median_error_pct": round(statistics.median(errors), 1) if errors else None,
        "lowest_error_pct": round(min(errors), 1) if errors else None,
        "highest_error_pct": round(max(errors), 1) if errors else None,
        "layouts": sorted({r["layout"] for r in group}),
    }


def judgement_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per GPU type: runs, headline within 10%, TTFT within 25% (``published_runs``' rule: at most the limit),
    median / lowest / highest signed headline error (%), layouts; the same per model class under ``by_class``
    (:func:`model_class`). A run the simulator could not judge (no headline error) counts as a miss."""
    gpus: dict[str, dict[str, Any]] = {}
    for gpu in sorted({r["gpu"] for r in rows}):
        group = [r for r in rows if r["gpu"] == gpu]
        gpus[gpu] = {**_counts(group),
                     "by_class": {c: _counts([r for r in group if r["class"] == c])
                                  for c in sorted({r["class"] for r in group})}}
    return {
        "what": "the simulator's headline error on the published vLLM runs held out, per GPU type (closed loops: "
                "output throughput; open loops: TPOT), under the committed calibration",
        "made_by": "benchmarks/published_judgement.py --write (tests/fixtures/published_runs, held-out split)",
        "target": {"headline_within_pct": 100 * HEADLINE_WITHIN, "share": TARGET_SHARE,
                   "ttft_within_pct": 100 * TTFT_WITHIN},
        "gpus": gpus,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write the table to {TABLE.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    try:
        runs = published_runs.load_runs()
    except SpecError as exc:  # a malformed fixture: one line, as published_runs.py says it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = judgement_table(held_out_rows(published_runs.judge_all(runs)))
    text = json.dumps(table, indent=1) + "\n"
    if args.write:
        TABLE.write_text(text)
    for gpu, row in table["gpus"].items():
        errors = ("no run simulated" if row["median_error_pct"] is None else
                  f"median {row['median_error_pct']:+.1f}% ({row['lowest_error_pct']:+.1f}% to "
                  f"{row['highest_error_pct']:+.1f}%)")
        print(f"{gpu:<10} {row['headline_within_10pct']:3d} / {row['runs']:3d} within 10%, TTFT "
              f"{row['ttft_within_25pct']:3d} within 25%, {errors}", file=sys.stderr if args.write else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
