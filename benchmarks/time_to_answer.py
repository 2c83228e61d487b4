"""Time to a confirmed answer on one H200 (issue 12 item 6), from the recorded real runs.

The measured side: `servetune tune benchmarks/real_vllm/h200_l8b_tune.yaml` on a fresh host
(``tests/fixtures/real_h200/study_l8b_tune``): the 8B model, the memory pair, README's GPU
defaults (pre-screen with its informed start, the vLLM-defaults baseline, the simulator screen,
early stopping), two trials and one confirmation repeat. Its GPU time is the sum of the trials'
dispatch-to-result times (vLLM start, warm-up, window, stop); the study's own wall clock is in
its log.

The computed side: the 16-cell gpu_memory_utilization x max_num_seqs sweep a user runs instead
(4 utilizations x max_num_seqs {64, 128, 256, 512}, the same workload, every window to the end),
each cell at the dispatch-to-result time measured for its kind of start on this host class in the
8B grid and the tune (``study_l8b`` and ``study_l8b_tune``, full windows only): a start whose
graphs the host has not compiled yet (vLLM's compile cache, keyed as
``servetune.planner.memory.compile_key`` says: {256, 512} share their graphs, so 3 of the 16
compile) or one that loads them. What each answer is worth comes from the same records: the
tune's confirmed winner against every cell the 8B grid measured.

Usage::

    PYTHONPATH=platform .venv/bin/python benchmarks/time_to_answer.py
"""

from __future__ import annotations

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

REAL = ROOT / "tests" / "fixtures" / "real_h200"
SWEEP_SEQS = (64, 128, 256, 512)
SWEEP_UTILS = 4


def main() -> int:
    grid = dataset.read_trials(REAL / "study_l8b" / "dataset").to_dict("records")
    tune = dataset.read_trials(REAL / "study_l8b_tune" / "dataset").to_dict("records")
    full = [r for r in grid + tune if r["completed"] == 512]
    cold = [r["dispatch_s"] for r in full if r["compile_cache_hit"] == 0]
    warm = [r["dispatch_s"] for r in full if r["compile_cache_hit"] == 1]
    model, gpu = load_model("llama-3.1-8b"), get_gpu("H200")
    keys = {compile_key(resolve_engine_config({"max_num_seqs": s, "max_model_len": 2048}, model, gpu))
            for s in SWEEP_SEQS}
    n_cold = len(keys)
    n_warm = SWEEP_UTILS * len(SWEEP_SEQS) - n_cold
    sweep = n_cold * statistics.mean(cold) + n_warm * statistics.mean(warm)
    tune_gpu = sum(r["dispatch_s"] for r in tune)
    log = (REAL / "study_l8b_tune" / "study.log").read_text()
    study_s = float(re.search(r"trials in ([\d.]+) s", log).group(1))
    process_s = float(re.search(r"exited with \d+ after (\d+) s", log).group(1))
    print(f"per start on this host (8B, full windows): compiling {statistics.mean(cold):.0f} s "
          f"(n={len(cold)}, {min(cold):.0f}-{max(cold):.0f}), loading compiled graphs {statistics.mean(warm):.0f} s "
          f"(n={len(warm)}, {min(warm):.0f}-{max(warm):.0f})")
    print(f"16-cell sweep, computed: {n_cold} compiling + {n_warm} loading starts = {sweep:,.0f} s "
          f"({sweep / 60:.1f} min); a fifth of it is {sweep / 5:,.0f} s")
    print(f"tune, measured: {len(tune)} starts, {tune_gpu:,.0f} s of dispatch-to-result time; the study's own "
          f"clock {study_s:,.0f} s, the process {process_s:,.0f} s = {process_s / sweep:.1%} of the sweep "
          f"(GPU time alone {tune_gpu / sweep:.1%})")
    confirmed = [r["output_throughput"] for r in tune if r["trial_number"] == 0]
    best_cell = max((r for r in grid if r["preemptions"] == 0), key=lambda r: r["output_throughput"])
    print(f"tune's confirmed winner (util 0.95 x max_num_seqs 256): {statistics.mean(confirmed):,.0f} tok/s over "
          f"{len(confirmed)} runs ({', '.join(f'{v:,.0f}' for v in confirmed)}); the 8B grid's best measured cell "
          f"(util {best_cell['flag_gpu_memory_utilization']} x {int(best_cell['flag_max_num_seqs'])} x "
          f"{int(best_cell['flag_max_num_batched_tokens'])}): {best_cell['output_throughput']:,.0f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
