"""Where real vLLM's time to first token goes, window by window, beside the simulator's TTFT.

vLLM 0.26 keeps per-request histograms in ``/metrics``; every real window in
``tests/fixtures/real_h200/scale`` has the dump before and after it, so their deltas split the
mean TTFT the client saw into:

* the API server and client (client TTFT less ``vllm:time_to_first_token_seconds``, the engine's);
* ``vllm:request_queue_time_seconds``: waiting in the engine's queue (admission);
* ``vllm:request_prefill_time_seconds``: from the first scheduled step to the first token;

plus the engine's steps and tokens per step (``vllm:iteration_tokens_total``). The last column is
the committed calibration's simulated mean TTFT at the host's API-server factor
(``_fidelity.fidelity_rows``). This is the evidence for which part of TTFT the simulator misses,
read off the real side only; nothing here is fitted (it located the API server's queueing, now
modelled as vLLM's loop in ``servetune.sim.frontend``).

Usage::

    PYTHONPATH=platform:benchmarks .venv/bin/python benchmarks/ttft_split.py [--hosts 2026-12-03a 2026-12-03b]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT / "platform", ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _fidelity import SCALE_HOSTS, fidelity_rows, host_factor, host_of, load_unseen_runs, scale_host  # noqa: E402
from servetune.engines.vllm.metrics import counter, parse_prometheus  # noqa: E402

SCALE = ROOT / "tests" / "fixtures" / "real_h200" / "scale"
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prefill_time_seconds", "vllm:iteration_tokens_total")


def engine_split(window: Path) -> dict[str, float]:
    """The histograms' sums and counts over one window (after less before)."""
    def read(dump: str) -> dict[str, float]:
        metrics = parse_prometheus(gzip.decompress((window / f"{dump}.txt.gz").read_bytes()).decode())
        return {f"{h}_{part}": counter(metrics, f"{h}_{part}") or 0.0 for h in HISTOGRAMS for part in ("sum", "count")}

    after, before = read("metrics_after"), read("metrics_before")
    return {k: after[k] - before[k] for k in after}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", nargs="*", default=["2026-12-03a", "2026-12-03b"],
                        help="the hosts' keys (_fidelity.SCALE_HOSTS: 2026-12-02a .. 2026-12-04h) or their first tags (h4 .. h16)")
    args = parser.parse_args(argv)
    by_tag = {tag: host for host, tag in SCALE_HOSTS.items()}
    hosts = [by_tag.get(h, h) for h in args.hosts]
    runs = {r.name: r for r in load_unseen_runs()}
    shown = {name: run for name, run in runs.items() if scale_host(name) in hosts}
    factors = {h: host_factor(h, runs) for h in {host_of(name) for name in shown} if h is not None}
    print("| window | client TTFT ms | API server + client | engine queue | prefill | steps | tokens/step "
          "| simulated TTFT ms |")
    print("|---|---|---|---|---|---|---|---|")
    for host in hosts:
        for name, run in sorted(shown.items()):
            if scale_host(name) != host:
                continue
            d = engine_split(SCALE / name.removeprefix("scale/"))
            n = d["vllm:request_queue_time_seconds_count"] or 1.0
            engine_ttft = 1e3 * d["vllm:time_to_first_token_seconds_sum"] / n
            steps = d["vllm:iteration_tokens_total_count"]
            sim = fidelity_rows(None, [run], host_factors=factors)[0].sim_ttft_mean_ms
            print(f"| {name.removeprefix('scale/')} | {run.ttft_mean_ms:,.0f} | {run.ttft_mean_ms - engine_ttft:,.0f} | "
                  f"{1e3 * d['vllm:request_queue_time_seconds_sum'] / n:,.0f} | "
                  f"{1e3 * d['vllm:request_prefill_time_seconds_sum'] / n:,.0f} | {steps:,.0f} | "
                  f"{d['vllm:iteration_tokens_total_sum'] / max(1.0, steps):,.0f} | {sim:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
