"""servetune's load generator against `vllm bench serve` on the same real server (H200, vLLM 0.26.0).

Reads tests/fixtures/real_h200/d1_loadgen_vs_bench (benchmarks/real_vllm/collect.py with
plan_2026_11_30_h200_d.json: one server, 1536 requests of 1024 in / 256 out at concurrency 64 per window, the two
clients alternated four times: servetune, bench, servetune, bench, ...) and prints each window and
the mean of each client. Run: ``.venv/bin/python benchmarks/loadgen_agreement.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

RUN = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "real_h200" / "d1_loadgen_vs_bench"

#: figure -> (our key path, bench key)
FIGURES = {
    "output tok/s": (("output_throughput",), "output_throughput"),
    "mean TTFT ms": (("ttft_ms", "mean"), "mean_ttft_ms"),
    "p99 TTFT ms": (("ttft_ms", "p99"), "p99_ttft_ms"),
    "mean TPOT ms": (("tpot_ms", "mean"), "mean_tpot_ms"),
    "mean ITL ms": (("itl_ms", "mean"), "mean_itl_ms"),
    "mean E2E ms": (("e2e_ms", "mean"), "mean_e2el_ms"),
}


def windows() -> tuple[list[dict], list[dict]]:
    ours = json.loads((RUN / "summary.json").read_text())["ours"]
    bench = [json.loads((RUN / ("bench.json" if i == 0 else f"bench_{i}.json")).read_text()) for i in range(len(ours))]
    return ours, bench


def _ours(window: dict, path: tuple[str, ...]) -> float:
    value: object = window
    for key in path:
        value = value[key]  # type: ignore[index]
    return float(value)  # type: ignore[arg-type]


def agreement() -> dict[str, tuple[float, float, float]]:
    """figure -> (servetune mean, bench mean, relative difference of the means)."""
    ours, bench = windows()
    out = {}
    for name, (path, key) in FIGURES.items():
        a = statistics.fmean(_ours(w, path) for w in ours)
        b = statistics.fmean(float(w[key]) for w in bench)
        out[name] = (a, b, (a - b) / b)
    return out


def main() -> None:
    ours, bench = windows()
    print(f"{len(ours)} windows per client, alternated on one server ({RUN.name})")
    print(f"{'window':<8}" + "".join(f"{n:>16}" for n in FIGURES))
    for i, (o, b) in enumerate(zip(ours, bench)):
        print(f"{'ours ' + str(i):<8}" + "".join(f"{_ours(o, p):>16,.1f}" for p, _ in FIGURES.values()))
        print(f"{'bench ' + str(i):<8}" + "".join(f"{float(b[k]):>16,.1f}" for _, k in FIGURES.values()))
    print("\nmeans: servetune vs vllm bench serve")
    for name, (a, b, rel) in agreement().items():
        print(f"  {name:<14} {a:>10,.1f} {b:>10,.1f}  {rel:+.1%}")
    thr = [float(b["output_throughput"]) for b in bench] + [float(o["output_throughput"]) for o in ours]
    print(f"\nwindow-to-window spread of the server itself (both clients): "
          f"{statistics.stdev(thr) / statistics.fmean(thr):.1%} of the mean output throughput")


if __name__ == "__main__":
    main()
