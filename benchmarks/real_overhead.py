"""servetune's own overhead per real trial, from the H200 studies kept in tests/fixtures/real_h200.

For every served or failed real trial: the seconds the driver waited for it (``dispatch_s``: handed
to Ray until its result was back), vLLM's launch-to-healthy (``startup_s``), the measured window
(``duration_s``), and what is left, servetune's overhead, split into the Ray part (``dispatch_s -
wall_s``: actor start, transfer) and the in-actor part (``wall_s - startup_s - duration_s``:
pre-launch checks, warm-up requests, stop and GPU-memory check, log parsing). Trials recorded
after 2026-11-30 also carry ``timing_actor_start_s`` (hand-over to the actor's first line), which
splits the Ray part into starting the actor and returning the result.
Run: ``.venv/bin/python benchmarks/real_overhead.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "platform"))

from servetune.records import dataset  # noqa: E402

STUDY = ROOT / "tests" / "fixtures" / "real_h200" / "study_h200x2" / "dataset"


def main() -> None:
    df = dataset.read_trials(STUDY)
    df = df[df["dispatch_s"].notna()].sort_values(["study", "trial_number"])
    print(f"{'study':<16}{'#':>3} {'status':<12}{'trial s':>9}{'startup':>9}{'window':>8}{'overhead':>10}"
          f"{'ray':>7}{'actor':>7}{'share':>8}")
    rows = []
    for r in df.to_dict("records"):
        window = r["duration_s"] if r["duration_s"] == r["duration_s"] else 0.0
        over = r["dispatch_s"] - r["startup_s"] - window
        ray_part, actor_part = r["dispatch_s"] - r["wall_s"], r["wall_s"] - r["startup_s"] - window
        rows.append((r, over))
        print(f"{r['study']:<16}{int(r['trial_number']):>3} {r['status']:<12}{r['dispatch_s']:>9.1f}{r['startup_s']:>9.1f}"
              f"{window:>8.1f}{over:>10.1f}{ray_part:>7.1f}{actor_part:>7.1f}{over / r['dispatch_s']:>8.1%}")
    total = sum(r["dispatch_s"] for r, _ in rows)
    over = sum(o for _, o in rows)
    # The first trial of each GPU slot also read `vllm serve --help=all` itself (20-30 s of vLLM
    # imports); the driver now reads it once before the first trial (servetune.study).
    first = [(r, o) for r, o in rows if r["study"] == "h200x2-grid" and r["trial_number"] in (0, 1)]
    rest = [(r, o) for r, o in rows if (r, o) not in first]
    print(f"\nall {len(rows)} trials: overhead {over:.1f} s of {total:.1f} s = {over / total:.1%}")
    rest_total = sum(r["dispatch_s"] for r, _ in rest)
    rest_over = sum(o for _, o in rest)
    print(f"without the first trial of each slot (which read `vllm serve --help=all`): "
          f"{rest_over:.1f} s of {rest_total:.1f} s = {rest_over / rest_total:.1%}, "
          f"{rest_over / len(rest):.1f} s per trial")


if __name__ == "__main__":
    main()
