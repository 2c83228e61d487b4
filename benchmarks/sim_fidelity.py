"""Simulator fidelity against real vLLM 0.26.0 on one H200: a side-by-side table.

For each of the 7 healthy runs in ``tests/fixtures/real_h200/``: real vs simulated output tok/s,
mean TTFT, mean TPOT and preemptions, with the relative errors (logic in
``benchmarks/_fidelity.py``). ``--fit N`` first searches the H200 calibration knobs with N
Optuna trials and prints the best set (to paste into ``servetune/sim/perf.py``'s
``GPU_CALIBRATION``).

Usage::

    .venv/bin/python benchmarks/sim_fidelity.py [--fit 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "platform") not in sys.path:
    sys.path.insert(0, str(ROOT / "platform"))

from _fidelity import error_summary, fidelity_rows, fit, format_table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", type=int, metavar="TRIALS", help="search the calibration knobs first")
    parser.add_argument("--json", action="store_true", help="print rows and errors as JSON")
    args = parser.parse_args(argv)
    knobs = None
    if args.fit:
        knobs = fit(args.fit)
        print("fitted knobs:", json.dumps({k: float(f"{v:.4g}") for k, v in knobs.items()}, indent=1))
    rows = fidelity_rows(knobs)
    if args.json:
        print(json.dumps({"rows": [{"run": r.name, "real_output_throughput": r.real.output_throughput,
                                    "sim_output_throughput": r.sim_output_throughput,
                                    "real_ttft_mean_ms": r.real.ttft_mean_ms, "sim_ttft_mean_ms": r.sim_ttft_mean_ms,
                                    "real_tpot_mean_ms": r.real.tpot_mean_ms, "sim_tpot_mean_ms": r.sim_tpot_mean_ms,
                                    "real_preemptions": r.real.preemptions, "sim_preemptions": r.sim_preemptions}
                                   for r in rows], "errors": error_summary(rows)}, indent=1))
    else:
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
