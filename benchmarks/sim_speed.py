"""How fast the simulated engine runs: simulated requests per CPU-second, and its memory.

Simulates 1000 requests of 1024 prompt / 256 output tokens of llama-3.1-8b on an H100 and an H200
(vLLM defaults, closed loop at a few concurrencies; ``--prefix-caching off`` too) and prints the
CPU time and requests per CPU-second of each run, then the peak memory one more run of it
allocates (Python's tracemalloc, per 1000 requests). The target is 0.1 CPU-second per
1000-request run and memory that grows with the requests, not their tokens, so a study of
hundreds of simulated trials takes seconds and a million-request trace fits a laptop.

Measured 2026-12-05 on this project's 2-core machines (shared), the same machine and hour for
both: 0.026-0.099 CPU-s per 1000-request trial (10,000-38,500 requests per CPU-second; the
64-sequence 2048-block case, 9,434 steps, is the slowest) and 1.2-2.6 MiB peak per 1000
requests, against 0.26-0.37 CPU-s and 22 MiB before bulk decode and step-pooled ITL;
``--num-requests 100000`` peaks at 132 MiB traced.

Usage::

    PYTHONPATH=platform .venv/bin/python benchmarks/sim_speed.py [--repeat 3] [--num-requests N]
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "platform") not in sys.path:
    sys.path.insert(0, str(ROOT / "platform"))

from servetune.planner.gpus import get_gpu  # noqa: E402
from servetune.planner.memory import plan_memory, resolve_engine_config  # noqa: E402
from servetune.planner.modelinfo import load_model  # noqa: E402
from servetune.sim import simulate  # noqa: E402
from servetune.workload import Workload  # noqa: E402

CASES = (
    ("H100-80GB", {}, 64), ("H100-80GB", {}, 256), ("H200", {}, 256), ("H200", {}, 1000),
    ("H200", {"enable_prefix_caching": False}, 256), ("H200", {"max_num_seqs": 64, "num_gpu_blocks_override": 2048}, 256),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the best CPU time is kept")
    parser.add_argument("--num-requests", type=int, default=1000)
    args = parser.parse_args(argv)
    model = load_model("llama-3.1-8b")
    print(f"{'GPU':<10} {'flags':<52} {'conc':>5} {'CPU s':>7} {'req/CPU-s':>10} {'sim out tok/s':>13} {'preempt':>7} "
          f"{'MiB/1k req':>10}")
    for gpu_name, flags, conc in CASES:
        gpu = get_gpu(gpu_name)
        config = resolve_engine_config(flags, model, gpu)
        plan = plan_memory(model, gpu, config)
        workload = Workload.from_dict({"input_len": 1024, "output_len": 256, "num_requests": args.num_requests,
                                       "concurrency": conc})
        best = float("inf")
        result = None
        for _ in range(args.repeat):
            t = time.process_time()
            result = simulate(model, gpu, config, workload, plan=plan)
            best = min(best, time.process_time() - t)
        assert result is not None
        tracemalloc.start()
        simulate(model, gpu, config, workload, plan=plan)
        peak = tracemalloc.get_traced_memory()[1] / 2**20 * 1000 / args.num_requests
        tracemalloc.stop()
        print(f"{gpu_name:<10} {str(flags or 'defaults'):<52} {conc:>5} {best:>7.3f} {args.num_requests / best:>10,.0f} "
              f"{result.output_throughput or 0:>13,.0f} {result.preemptions or 0:>7} {peak:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
