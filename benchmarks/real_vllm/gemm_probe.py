"""Time the layer GEMMs of each model shape servetune has real vLLM runs of (GPU host only).

The simulator prices a layer's four GEMMs (qkv, o, gate_up, down) as rooflines at
``compute_efficiency`` of the dense peak times the tile grid's fill (``servetune.sim.perf``), a
constant fitted on 0.85B-14B windows. This measures what cuBLAS reaches on the host's GPU for the
same (M tokens, N, K) shapes in bf16 (``x @ W.T``, as vLLM's linear layers call it), including the
24B shape's 32,768-wide MLP, and whether a sustained large GEMM loses clock (power): one GEMM run
back to back for 8 s, its rate and the SM clock, power and temperature each second.

Usage on the host (torch only, no vLLM): ``python3 benchmarks/real_vllm/gemm_probe.py OUT.json``;
``--tokens 16,32,...`` times those token counts instead of :data:`TOKENS` and ``--no-sustained``
skips the 8-second power run (the 2026-12-04 decode-range probe: which tile heights cuBLAS picks
between 16 and 8,192 tokens, where the simulator's tile grid has only 64- and 128-row tiles).
``--graph`` replays the GEMMs from a CUDA graph, as vLLM's decode steps run them, instead of one
Python call each: below about 40 us a GEMM launched from Python measures the launch, not the GEMM.
In that mode each shape cycles through enough weight copies (256 MiB together, or 16) that no
GEMM finds its weights still in the 50 MiB L2 cache, as in a model whose other layers ran between.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

# (name, hidden, q_size, kv_size, intermediate) of the shipped configs with real runs, written out
# because the host runs this without servetune; benchmarks/gemm_vs_sim.py refuses a probe whose
# shapes are not the ones sim.perf prices.
SHAPES = [("servetune-test-850m", 2048, 2048, 512, 5632), ("llama-3.1-8b", 4096, 4096, 1024, 14336),
          ("qwen2.5-14b", 5120, 5120, 1024, 13824), ("mistral-small-24b", 5120, 4096, 1024, 32768)]
# The dense shapes of the published multi-GPU runs, timed at one TP rank's share with ``--tp``.
TP_SHAPES = [("qwen3-32b", 5120, 8192, 1024, 25600), ("llama-3.3-70b", 8192, 8192, 1024, 28672)]
TOKENS = (64, 256, 1024, 2048, 4096, 8192)


def _clock() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip()


def time_gemm(m: int, n: int, k: int, iters: int = 30) -> float:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        x @ w.T
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        x @ w.T
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def time_gemm_graph(m: int, n: int, k: int, iters: int = 24, replays: int = 5) -> float:
    """One GEMM's seconds when ``iters`` of them replay from a CUDA graph (no launch from Python)."""
    copies = max(1, min(16, -(-(256 << 20) // (n * k * 2))))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # cuBLAS picks its kernel and workspace before the capture
        for w in ws:
            torch.matmul(x, w.T, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            torch.matmul(x, ws[i % copies].T, out=out)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / (replays * iters)
    del graph, ws
    return seconds


def token_counts(text: str) -> list[int]:
    """``--tokens``: a bad list is argparse's one-line error (exit 2) before the GPU is touched."""
    counts = [int(t) for t in text.split(",")]
    if not counts or min(counts) < 1:
        raise ValueError(text)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--tokens", type=token_counts, default=TOKENS,
                        help="comma-separated token counts (M), each 1 or more")
    parser.add_argument("--no-sustained", action="store_true", help="skip the 8-second sustained GEMM")
    parser.add_argument("--graph", action="store_true",
                        help="replay each GEMM from a CUDA graph over L2-cold weight copies")
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2, 4, 8),
                        help="time one tensor-parallel rank's share of each GEMM (column-parallel qkv and gate_up "
                             "split N, row-parallel o and down split K), over the multi-GPU runs' shapes too")
    args = parser.parse_args()
    tokens = args.tokens
    timer = time_gemm_graph if args.graph else time_gemm
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "clock_start": _clock(),
                 "mode": "cuda_graph" if args.graph else "eager", "tp": args.tp, "gemms": []}
    tp = args.tp
    for name, d, q, kv, inter in SHAPES + (TP_SHAPES if tp > 1 else []):
        for label, n, k in (("qkv", (q + 2 * kv) // tp, d), ("o", d, q // tp), ("gate_up", 2 * inter // tp, d),
                            ("down", d, inter // tp)):
            for m in tokens:
                s = timer(m, n, k)
                out["gemms"].append({"model": name, "gemm": label, "m": m, "n": n, "k": k, "seconds": s,
                                     "tflops": 2.0 * m * n * k / s / 1e12})
        print(name, "done", flush=True)
        json.dump(out, open(args.out, "w"), indent=1)  # what finished survives a cut-off run
    if args.no_sustained:  # the last shape's dump above is the whole result
        return
    # Sustained: the 24B gate_up at 8192 tokens back to back for 8 s, its rate each second.
    x = torch.randn(8192, 5120, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(65536, 5120, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * 8192 * 65536 * 5120
    rates, t_end = [], time.time() + 8
    out["clock_before_sustained"] = _clock()
    while time.time() < t_end:
        torch.cuda.synchronize()
        t0, n = time.time(), 0
        while time.time() - t0 < 1.0:
            x @ w.T
            n += 1
            if n % 20 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        rates.append(n * flops / (time.time() - t0) / 1e12)
        out.setdefault("clock_during_sustained", []).append(_clock())
    out["sustained_tflops_per_second"] = rates
    json.dump(out, open(args.out, "w"), indent=1)
    print(json.dumps({"sustained": [round(r) for r in rates], "clocks": out["clock_during_sustained"]}))


if __name__ == "__main__":
    main()
