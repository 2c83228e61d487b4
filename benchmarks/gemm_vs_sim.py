"""The simulator's GEMM rooflines against cuBLAS timed on the H200, per model shape and token count.

``benchmarks/real_vllm/gemm_probe.py`` timed each shipped model's four layer GEMMs (qkv, o,
gate_up, down; bf16 ``x @ W.T``) at 64-8,192 tokens on the GPU host, and one large GEMM back to
back for 8 s with the SM clock and power beside it (``tests/fixtures/real_h200/gemm/``). This
prints, for each model and token count, the measured time of the layer's GEMMs, the committed
calibration's (``PerfModel.layer_gemm_seconds``, per layer), and their ratio; then the sustained
rate against the simulator's full-wave rate (``bf16_tflops x compute_efficiency``). Nothing here is
fitted: it is evidence for the step-time model, read off the GPU alone.

``--knobs FILE`` prices the GEMMs under a candidate calibration (the file's ``knobs`` over the
committed ones, as ``sim_fidelity.py --knobs``). Each model's closing line sums the probe by token
range (mean log of sim/real: its sign says fast or slow; mean |log|: its spread). The CUDA-graph
probe (``gemm_probe_graph_h200.json``, a third host, 1-2,048 tokens) was timed after
``_kernels.fit_gemm``'s knobs were fitted on the other two probes: with ``--knobs
benchmarks/results/sim_kernel_candidate_v2_h200.json`` it is a held-out check of them.

Usage::

    PYTHONPATH=platform .venv/bin/python benchmarks/gemm_vs_sim.py [--probe FILE] [--knobs FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "platform") not in sys.path:
    sys.path.insert(0, str(ROOT / "platform"))

from servetune.planner.gpus import get_gpu  # noqa: E402
from servetune.planner.memory import resolve_engine_config  # noqa: E402
from servetune.planner.modelinfo import load_model  # noqa: E402
from servetune.sim import PerfModel, calibration_for  # noqa: E402
from _fidelity import read_knobs  # noqa: E402  (benchmarks/, this script's own folder)

PROBE = ROOT / "tests" / "fixtures" / "real_h200" / "gemm" / "gemm_probe_h200.json"
ORDER = ("qkv", "o", "gate_up", "down")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", type=Path, default=PROBE)
    parser.add_argument("--knobs", type=Path, metavar="FILE",
                        help="price under a candidate calibration: a JSON file's 'knobs' over the committed ones")
    args = parser.parse_args()
    probe = json.loads(args.probe.read_text())
    gpu = get_gpu("H200")
    calibration = calibration_for(gpu)
    if args.knobs:
        knobs = read_knobs("--knobs", args.knobs)
        if knobs is None:
            return 2
        calibration = calibration.with_overrides(knobs)
    measured: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for row in probe["gemms"]:
        measured[(row["model"], row["m"])][row["gemm"]] = row["seconds"]
    perfs: dict[str, PerfModel] = {}
    for name in {name for name, _ in measured}:
        model = load_model(name)
        perfs[name] = PerfModel(model, gpu, resolve_engine_config({}, model, gpu), calibration)
    # The probe writes its shapes out by hand (the GPU host runs it without servetune): a shape that
    # is not the one the simulator prices would compare two different GEMMs.
    for row in probe["gemms"]:
        priced = perfs[row["model"]].layer_gemm_shapes[ORDER.index(row["gemm"])]
        if (row["n"], row["k"]) != priced:
            print(f"error: {args.probe}: {row['model']} {row['gemm']} was timed as N x K {row['n']} x {row['k']}, "
                  f"the simulator prices {priced[0]} x {priced[1]}; fix SHAPES in gemm_probe.py and time it again",
                  file=sys.stderr)
            return 2
    mode = "replayed from CUDA graphs" if probe.get("mode") == "cuda_graph" else "launched from Python"
    print(f"{probe['gpu']}, torch {probe['torch']}: the layer's four GEMMs ({mode}), measured against the "
          f"simulator's rooflines ({'--knobs ' + str(args.knobs) if args.knobs else 'committed calibration'})")
    print(f"{'model':<22}{'tokens':>7}{'real ms':>10}{'sim ms':>10}{'real/sim':>10}   per GEMM real/sim (qkv, o, gate_up, down)")
    for (name, m), times in measured.items():
        perf = perfs[name]
        sim = [s / perf.layers_per_stage for s in perf.layer_gemm_seconds(m)]
        real = [times[g] for g in ORDER]
        ratios = ", ".join(f"{r / s:.2f}" for r, s in zip(real, sim))
        print(f"{name:<22}{m:>7}{sum(real) * 1e3:>10.3f}{sum(sim) * 1e3:>10.3f}{sum(real) / sum(sim):>10.2f}   {ratios}")
    print("\nsim/real per GEMM by token range: mean log (< 0: priced fast), mean |log|")
    for name in dict.fromkeys(name for name, _ in measured):
        cells = []
        for low, high in ((1, 128), (129, 512), (513, 8192)):
            logs = [math.log(sim / perfs[name].layers_per_stage / times[g])
                    for (model, m), times in measured.items() if model == name and low <= m <= high
                    for g, sim in zip(ORDER, perfs[name].layer_gemm_seconds(m))]
            if logs:
                cells.append(f"{low}-{high} tokens {sum(logs) / len(logs):+.3f} / {sum(map(abs, logs)) / len(logs):.3f}")
        print(f"{name:<22}" + "; ".join(cells))
    rates = probe.get("sustained_tflops_per_second")
    if not rates:  # --no-sustained
        return 0
    efficiency = calibration.compute_efficiency
    print(f"\nsustained 8192 x 65536 x 5120 GEMM: {min(rates):.0f}-{max(rates):.0f} TFLOP/s over {len(rates)} s "
          f"(SM clock, power, temperature: {', '.join(probe['clock_during_sustained'])}); "
          f"the simulator's full-wave rate {gpu.bf16_tflops * efficiency:.0f} TFLOP/s ({gpu.bf16_tflops:.0f} x "
          f"compute_efficiency {efficiency})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
