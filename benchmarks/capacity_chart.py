"""Draw README's cost-per-GPU-type picture from ``servetune capacity --json`` output.

One bar per GPU type: the cheapest layout's dollars per million good output tokens at one replica's
capacity (its highest rate within the targets), labelled with the replicas and GPUs the target rate
needs; a hatched bar is a GPU type the simulator was not judged on (an estimate).

    servetune capacity --model llama-3.1-8b --workload jobs/workloads/poisson-rate.yaml --rate 20 \\
        --slo p99_ttft_ms=1000 --slo p99_itl_ms=100 --json > capacity.json
    python benchmarks/capacity_chart.py capacity.json docs/img/capacity-llama-3.1-8b.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure


def best_per_gpu(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each GPU type's row with the lowest cost at capacity, cheapest GPU type first."""
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        cost = r.get("replica_usd_per_mtok")
        if cost is None:
            continue
        if r["gpu"] not in best or cost < best[r["gpu"]]["replica_usd_per_mtok"]:
            best[r["gpu"]] = r
    return sorted(best.values(), key=lambda r: r["replica_usd_per_mtok"])


def draw(doc: dict[str, Any], out: Path) -> None:
    rows = best_per_gpu(doc["rows"])
    fig = Figure(figsize=(7.0, 3.6), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    names = [f"{r['gpu']}\nTP {r['tp']}" for r in rows]
    costs = [r["replica_usd_per_mtok"] for r in rows]
    bars = ax.bar(names, costs, color=["#2a6f97" if r["judged"] else "#a9c6d9" for r in rows],
                  hatch=None, edgecolor="#1d3d52")
    for bar, r in zip(bars, rows, strict=True):
        if not r["judged"]:
            bar.set_hatch("//")
        ax.annotate(f"${r['replica_usd_per_mtok']:.2f}\n{r['replicas']}x = {r['gpus']} GPU",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    targets = ", ".join(f"{k.replace('_p99_ms', '').upper()} p99 {v:g} ms" for k, v in doc["limits"].items()
                        if k != "preemptions")
    ax.set_ylabel("$ per million good output tokens")
    ax.set_title(f"{doc['model']}: cost at one replica's capacity ({targets}); labels: fleet for "
                 f"{doc['rate']:g} req/s", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylim(0, max(costs) * 1.3)
    ax.text(0.99, 0.97, "solid: simulator judged on this GPU; hatched: estimate", transform=ax.transAxes,
            ha="right", va="top", fontsize=7)
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capacity_json", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    draw(json.loads(args.capacity_json.read_text()), args.out)


if __name__ == "__main__":
    main()
