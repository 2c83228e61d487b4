"""Time to a confirmed answer on one H200, from the recorded real runs.

The measured side: `servetune tune benchmarks/real_vllm/h200_l8b_tune.yaml`, run three times, each
on a fresh host: the 8B model, the memory pair, README's GPU defaults (pre-screen with its informed
start, the vLLM-defaults baseline, the simulator screen, early stopping), two trials and one
confirmation repeat.

* ``study_l8b_tune`` (2026-12-02): the driver read ``vllm serve --help=all`` before
  starting Ray and sent the warm-up requests one after another. Its wall clock: the study's own
  (its log) and the host script's, to the process's exit.
* ``study_l8b_tune_b`` (2026-12-02, the ``2026-12-02b`` host): the first start reads the help beside its launch and the
  warm-ups go out together. ``study_times.log`` stamps every output line with the seconds since
  `servetune tune` started, so its figure is the time to the line naming the confirmed winner.
* ``study_l8b_tune_c`` (2026-12-03, the ``2026-12-03c`` host): ``budget.confirm_on: same-start`` (the default since
  2026-12-03): a trial whose window led when it ended measured its repeat on its own server.

Its GPU time is the sum of the starts' dispatch-to-result times (vLLM start, warm-up, window, the
same-start repeats' windows, stop).

The computed side: the 16-cell gpu_memory_utilization x max_num_seqs sweep a user runs instead
(4 utilizations x max_num_seqs {64, 128, 256, 512}, the same workload, every window to the end),
each cell at the dispatch-to-result time measured for its kind of start on the same host as the
tune it is set against (full windows only, less any same-start repeat the start carried): a start
whose graphs the host has not compiled yet (vLLM's compile cache, keyed as
``servetune.planner.memory.compile_key`` says: {256, 512} share their graphs, so 3 of the 16
compile) or one that loads them. The first tune's host figures pool the 8B grid (``study_l8b``)
with it, as before; the other hosts ran only their tune (one or two starts of each kind: thin).
Hosts differ (the second started vLLM 10-30% slower than the first, the third 5-25% faster), which
is why each tune is priced at its own host's starts. What each answer is worth comes from the same
records: the confirmed winner against every cell the 8B grid measured. The first two tunes
restarted vLLM for their repeat; for them the script also computes what same-start confirmation
would have taken off (a projection; the third tune measured it).

Usage::

    PYTHONPATH=platform .venv/bin/python benchmarks/time_to_answer.py
"""

from __future__ import annotations

import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "platform") not in sys.path:
    sys.path.insert(0, str(ROOT / "platform"))

from servetune.planner.gpus import get_gpu  # noqa: E402
from servetune.planner.memory import compile_key, resolve_engine_config  # noqa: E402
from servetune.planner.modelinfo import load_model  # noqa: E402
from servetune.records import dataset  # noqa: E402
from servetune.search.confirm import Confirmed, choose, confirm  # noqa: E402

REAL = ROOT / "tests" / "fixtures" / "real_h200"
SWEEP_SEQS = (64, 128, 256, 512)
SWEEP_UTILS = 4


#: Each tune, with the studies whose starts price its sweep (the same host).
TUNES = {"study_l8b_tune": ("study_l8b", "study_l8b_tune"), "study_l8b_tune_b": ("study_l8b_tune_b",),
         "study_l8b_tune_c": ("study_l8b_tune_c",)}


def _rows(study: str) -> list[dict]:
    return dataset.read_trials(REAL / study / "dataset").to_dict("records")


def _is_start(row: dict) -> bool:
    """A row that started vLLM: every trial, and a repeat that restarted it (a same-start repeat has
    no dispatch time of its own: it ran on its trial's server)."""
    return row.get("dispatch_s") is not None and math.isfinite(row["dispatch_s"])


def _is_repeat(row: dict) -> bool:
    repeat = row.get("repeat")
    return repeat is not None and math.isfinite(repeat)


def _cell_s(row: dict, rows: list[dict]) -> float:
    """What the start would cost as one sweep cell: its dispatch-to-result time without the
    same-start repeats it measured after its window (their warm-up and window, ``wall_s``)."""
    same_start = [r["wall_s"] for r in rows if r["trial_number"] == row["trial_number"]
                  and _is_repeat(r) and not _is_start(r)]
    return row["dispatch_s"] - sum(same_start)


def _sweep_starts() -> tuple[int, int]:
    """(compiling, loading) starts of the 16-cell sweep."""
    model, gpu = load_model("llama-3.1-8b"), get_gpu("H200")
    keys = {compile_key(resolve_engine_config({"max_num_seqs": s, "max_model_len": 2048}, model, gpu))
            for s in SWEEP_SEQS}
    return len(keys), SWEEP_UTILS * len(SWEEP_SEQS) - len(keys)


def _time_to_winner(folder: Path) -> tuple[str, float, int]:
    """What the tune's record says about its wall clock (to the confirmed winner where its output
    was time-stamped, else to the host script's end) and the winner it named."""
    log = (folder / "study.log").read_text()
    winner = int(re.search(r"winner on confirmed figures: trial #(\d+)", log).group(1))
    timed = folder / "study_times.log"
    if timed.is_file():
        line = next(ln for ln in timed.read_text().splitlines() if "winner on confirmed figures" in ln)
        return "to the confirmed winner", float(line.split()[0]), winner
    return "the process, to its exit", float(re.search(r"exited with \d+ after (\d+) s", log).group(1)), winner


def _confirmed(rows: list[dict]) -> list[Confirmed]:
    """Every configuration the tune measured more than once, confirmed as today's driver compares
    them (servetune.search.confirm), best first."""
    by_trial: dict[int, list[dict]] = {}
    for r in rows:
        by_trial.setdefault(int(r["trial_number"]), []).append(r)
    return list(choose([confirm(n, dataset.row_flags(runs[0]), [r["output_throughput"] for r in runs],
                                [r["preemptions"] == 0 for r in runs])
                        for n, runs in by_trial.items() if len(runs) > 1]).ranked)


def main() -> int:
    n_cold, n_warm = _sweep_starts()
    grid = _rows("study_l8b")
    best_cell = max((r for r in grid if r["preemptions"] == 0), key=lambda r: r["output_throughput"])
    for name, host_studies in TUNES.items():
        tune = _rows(name)
        full = [(r, _cell_s(r, rows)) for study in host_studies for rows in [_rows(study)] for r in rows
                if _is_start(r) and r["completed"] == 512]
        cold = [s for r, s in full if r["compile_cache_hit"] == 0]
        warm = [s for r, s in full if r["compile_cache_hit"] == 1]
        sweep = n_cold * statistics.mean(cold) + n_warm * statistics.mean(warm)
        starts = [r for r in tune if _is_start(r)]
        tune_gpu = sum(r["dispatch_s"] for r in starts)
        what, wall, winner = _time_to_winner(REAL / name)
        print(f"{name}: per start on its host (8B, full windows): compiling {statistics.mean(cold):.0f} s "
              f"(n={len(cold)}, {min(cold):.0f}-{max(cold):.0f}), loading compiled graphs "
              f"{statistics.mean(warm):.0f} s (n={len(warm)}, {min(warm):.0f}-{max(warm):.0f})")
        print(f"  16-cell sweep, computed: {n_cold} compiling + {n_warm} loading starts = {sweep:,.0f} s "
              f"({sweep / 60:.1f} min); a fifth of it is {sweep / 5:,.0f} s")
        print(f"  tune, measured: {len(starts)} starts, {tune_gpu:,.0f} s of dispatch-to-result time; {what} "
              f"{wall:,.0f} s = {wall / sweep:.1%} of the sweep (GPU time alone {tune_gpu / sweep:.1%})")
        restarted = [r for r in tune if _is_repeat(r) and _is_start(r)]
        if restarted:
            # budget.confirm_on: same-start (2026-12-03, after the first two tunes): the winner led
            # when its window ended, so its repeat runs on its own server right then. Computed from
            # the same records, not measured: the repeat's dispatch-to-result time (start, warm-up,
            # window, stop) becomes its window alone.
            repeat = restarted[0]
            saved = repeat["dispatch_s"] - repeat["duration_s"]
            print(f"  with confirm_on: same-start, computed from these records (not measured): the repeat's "
                  f"{repeat['dispatch_s']:.0f} s become its {repeat['duration_s']:.0f} s window: {wall - saved:,.0f} s "
                  f"= {(wall - saved) / sweep:.1%} of the sweep, {len(starts) - 1} starts")
        else:
            print(f"  confirm_on: same-start, measured: {len(tune) - len(starts)} repeat(s) on the trials' own "
                  f"starts, {sum(r['wall_s'] for r in tune if not _is_start(r)):.0f} s of windows")
        winner_rows = [r for r in tune if r["trial_number"] == winner]
        runs = ", ".join(f"{r['output_throughput']:,.0f}" for r in winner_rows)
        print(f"  confirmed winner #{winner} (util {winner_rows[0]['flag_gpu_memory_utilization']} x max_num_seqs "
              f"{int(winner_rows[0]['flag_max_num_seqs'])}): {statistics.mean(r['output_throughput'] for r in winner_rows):,.0f}"
              f" tok/s over {len(winner_rows)} runs ({runs})")
        ranked = _confirmed(tune)
        if len(ranked) > 1:
            print("  every configuration measured twice or more, as today's driver compares them: "
                  + "; ".join(f"#{c.trial_number} {c.mean:,.0f} +- {c.half_width:,.0f}" for c in ranked))
    print(f"the 8B grid's best measured cell (util {best_cell['flag_gpu_memory_utilization']} x "
          f"{int(best_cell['flag_max_num_seqs'])} x {int(best_cell['flag_max_num_batched_tokens'])}, the first "
          f"tune's host): {best_cell['output_throughput']:,.0f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
