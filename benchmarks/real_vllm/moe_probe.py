"""Time vLLM's fused-MoE Triton kernel at the expert shapes of published MoE runs (GPU host only).

The simulator prices a MoE layer's routed experts (``PerfModel.moe_seconds``) from the touched
experts' weight bytes and the grouped GEMMs' FLOPs at ``moe_compute_share`` of the dense peak, with
the fused_moe tile's rate (``sim.perf_classes.moe_tile``). This measures what vLLM's own kernel
(``fused_experts``: the two grouped GEMMs, the activation and the top-k sum) takes on the host's GPU
for one layer, at 1-8,192 tokens, with uniform random routing (a trained router's top-k spread,
which random-weight served models do not give), for two kernel configurations:

* ``vllm``: what the installed vLLM picks (its tuned file for this GPU where it ships one, else its
  default; ``try_get_optimal_moe_config``), recorded per row;
* ``default``: the installed vLLM's own default, the config it runs where it ships no tuned file for the
  GPU (``get_default_config``, called as ``try_get_optimal_moe_config`` calls it; the by-batch tiles
  from 0.17.0): what a GPU without a tuned file runs, timed on one that has one;
* ``v0.11_default``: vLLM 0.11.0's default (``fused_moe.py get_default_config@v0.11.0``: 16 x 32 x 64
  tiles, group 1, up to E tokens, else 64 x 64 x 32, group 8; block-quantized fp8 64 x 128 x 128,
  group 32, 4 warps, 3 stages), as the published 0.11-0.14 runs ran without a tuned file. The installed
  kernel is newer (its swap-AB path for small tiles), so this is 0.11's tiles on today's kernel.

Each timing replays a CUDA graph of ``CALLS`` calls, each with its own routing and, where one
layer's experts are under ``COPY_BYTES``, its own copy of the weights, so no call finds its experts
in the 50 MiB L2 cache (as in a model whose other layers ran between).

Usage on the host (vLLM installed): ``python3 benchmarks/real_vllm/moe_probe.py OUT.json``;
``--shapes a,b`` only those shapes, ``--deadline-s`` stops cleanly (every row so far kept).
``benchmarks/moe_vs_sim.py`` holds the result against the simulator.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch
from gemm_probe import token_counts  # this folder: the scripts run as files on the GPU host

#: (name, experts, hidden, intermediate per TP rank, top_k, weights) of the published runs' layers.
#: ``fp8_block``: 128 x 128 block-quantized fp8 weights and activations (DeepSeek-V3/R1, Qwen3 -FP8
#: checkpoints); ``fp8``: per-tensor fp8 (vLLM's online ``--quantization fp8``).
SHAPES = [
    ("qwen3-30b-a3b_tp1", 128, 2048, 768, 8, "bf16"),
    ("qwen3-30b-a3b_tp1_fp8", 128, 2048, 768, 8, "fp8"),
    ("qwen3-235b-a22b_tp8", 128, 4096, 192, 8, "bf16"),
    ("qwen3-235b-a22b-fp8_tp4", 128, 4096, 384, 8, "fp8_block"),
    ("gpt-oss-120b_tp8", 128, 2880, 360, 4, "bf16"),
    ("gpt-oss-120b_tp4", 128, 2880, 720, 4, "bf16"),
    ("deepseek-r1_tp8", 256, 7168, 256, 8, "fp8_block"),
    ("deepseek-v2-lite_tp1", 64, 2048, 1408, 6, "bf16"),
    ("mixtral-8x7b_tp1", 8, 4096, 14336, 2, "bf16"),
    ("mixtral-8x7b_tp2", 8, 4096, 7168, 2, "bf16"),
]
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: The kernel configurations a row may be timed under (the module docstring says what each is).
MODES = ("vllm", "default", "v0.11_default")
CALLS = 8
COPY_BYTES = 512 << 20
BLOCK = [128, 128]


def _v011_default(m: int, experts: int, weights: str) -> dict[str, int]:
    """vLLM 0.11.0's ``get_default_config`` (no tuned file)."""
    if weights == "fp8_block":
        return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": BLOCK[0], "BLOCK_SIZE_K": BLOCK[1], "GROUP_SIZE_M": 32,
                "num_warps": 4, "num_stages": 3}
    if m <= experts:
        return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8}


def _layer(experts: int, hidden: int, inter: int, weights: str):  # type: ignore[no-untyped-def]
    """One layer's expert weights (and quant config) in the format vLLM's kernel takes."""
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    w1 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / 32
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / 32
    if weights == "bf16":
        return w1, w2, None
    fp8 = torch.float8_e4m3fn
    w1q, w2q = w1.to(fp8), w2.to(fp8)
    del w1, w2
    if weights == "fp8":
        s1 = torch.ones(experts, device="cuda", dtype=torch.float32)
        s2 = torch.ones(experts, device="cuda", dtype=torch.float32)
        return w1q, w2q, fp8_w8a8_moe_quant_config(s1, s2)
    s1 = torch.ones(experts, -(-2 * inter // BLOCK[0]), -(-hidden // BLOCK[1]), device="cuda", dtype=torch.float32)
    s2 = torch.ones(experts, -(-hidden // BLOCK[0]), -(-inter // BLOCK[1]), device="cuda", dtype=torch.float32)
    return w1q, w2q, fp8_w8a8_moe_quant_config(s1, s2, block_shape=BLOCK)


def _routing(m: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random top-k routing: distinct experts per token, softmax weights."""
    ids = torch.rand(m, experts, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(m, top_k, device="cuda"), dim=1)
    return weights, ids


def time_layer(copies: list, m: int, experts: int, hidden: int, top_k: int,  # type: ignore[type-arg]
               config: dict | None) -> float:  # type: ignore[type-arg]
    """Microseconds one ``fused_experts`` call takes, from a replayed CUDA graph of ``CALLS`` calls."""
    from vllm.model_executor.layers.fused_moe import override_config
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    inputs = [(torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16), *_routing(m, experts, top_k))
              for _ in range(CALLS)]

    def run() -> None:
        for i, (x, w, ids) in enumerate(inputs):
            w1, w2, quant = copies[i % len(copies)]
            fused_experts(x, w1, w2, w, ids, quant_config=quant)

    ctx = override_config(config) if config is not None else override_config(None)
    with ctx:
        run()  # compile the Triton kernels for this configuration outside the graph
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / CALLS)
    del graph
    return sorted(times)[len(times) // 2]


def _installed_default(w1: torch.Tensor, w2: torch.Tensor, top_k: int, weights: str, m: int) -> dict:  # type: ignore[type-arg]
    """The installed vLLM's ``get_default_config`` for this layer at ``m`` tokens (no tuned file)."""
    from vllm.model_executor.layers.fused_moe.fused_moe import get_default_config

    dtype = {"bf16": None, "fp8": "fp8_w8a8", "fp8_block": "fp8_w8a8"}[weights]
    block = BLOCK if weights == "fp8_block" else None
    return dict(get_default_config(m, w2.shape[0], w2.shape[2], w1.shape[2], top_k, dtype, block))


def _picked(w1: torch.Tensor, w2: torch.Tensor, top_k: int, weights: str, m: int) -> dict:  # type: ignore[type-arg]
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    dtype = {"bf16": None, "fp8": "fp8_w8a8", "fp8_block": "fp8_w8a8"}[weights]
    block = BLOCK if weights == "fp8_block" else None
    return dict(try_get_optimal_moe_config(tuple(w1.shape), tuple(w2.shape), top_k, dtype, m, block_shape=block))


def _mode_config(mode: str, layer: tuple, m: int, experts: int, top_k: int, weights: str) -> dict | None:  # type: ignore[type-arg]
    """The config ``mode`` forces at ``m`` tokens (None: ``vllm``, whatever the installed vLLM picks)."""
    if mode == "vllm":
        return None
    if mode == "v0.11_default":
        return _v011_default(m, experts, weights)
    return _installed_default(layer[0], layer[1], top_k, weights, m)


def probe_shape(shape: tuple, tokens: tuple[int, ...], deadline: float, rows: list,  # type: ignore[type-arg]
                modes: tuple[str, ...] = ("vllm", "v0.11_default")) -> None:
    """Append one row per (mode, tokens) of ``shape`` to ``rows`` until ``deadline``."""
    name, experts, hidden, inter, top_k, weights = shape
    first = _layer(experts, hidden, inter, weights)
    layer_bytes = first[0].numel() * first[0].element_size() + first[1].numel() * first[1].element_size()
    copies = [first] + [_layer(experts, hidden, inter, weights) for _ in range(max(0, -(-COPY_BYTES // layer_bytes) - 1))]
    copies = copies[:CALLS]
    for m in tokens:
        for mode in modes:
            if time.monotonic() > deadline:
                return
            config = _mode_config(mode, first, m, experts, top_k, weights)
            shown = _picked(first[0], first[1], top_k, weights, m) if config is None else config
            try:
                us = time_layer(copies, m, experts, hidden, top_k, config)
                error = None
            except Exception as exc:  # a configuration the kernel refuses is a row, not the end of the probe
                us, error = None, f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append({"shape": name, "experts": experts, "hidden": hidden, "intermediate": inter, "top_k": top_k,
                         "weights": weights, "tokens": m, "mode": mode, "config": shown, "us": us, "error": error,
                         "weight_copies": len(copies)})
            print(json.dumps(rows[-1]), flush=True)
    del copies, first
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    parser.add_argument("--deadline-s", type=float, default=420.0)
    parser.add_argument("--custom", default="", help="extra shapes NAME:E:HIDDEN:INTER:TOPK:WEIGHTS,... (then only "
                                                      "those and --shapes' are timed)")
    parser.add_argument("--modes", default="vllm,v0.11_default",
                        help=f"comma-separated kernel configurations: {', '.join(MODES)}")
    parser.add_argument("--tokens", type=token_counts, default=TOKENS,
                        help="comma-separated token counts, each 1 or more (default: 1-8,192)")
    args = parser.parse_args()
    wanted = [s for s in args.shapes.split(",") if s]
    custom = []
    for text in filter(None, args.custom.split(",")):
        parts = text.split(":")
        if len(parts) != 6 or parts[5] not in ("bf16", "fp8", "fp8_block") or not all(p.isdigit() for p in parts[1:5]):
            parser.error(f"--custom: {text!r} is not NAME:E:HIDDEN:INTER:TOPK:bf16|fp8|fp8_block")
        custom.append((parts[0], *(int(p) for p in parts[1:5]), parts[5]))
    tokens = tuple(args.tokens)
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes: {args.modes!r}: name one or more of {', '.join(MODES)}")
    unknown = sorted(set(wanted) - {s[0] for s in SHAPES})
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; known: {[s[0] for s in SHAPES]}")
    import vllm

    deadline = time.monotonic() + args.deadline_s
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,driver_version",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    rows: list[dict] = []  # type: ignore[type-arg]
    report = {"gpu": gpu, "torch": torch.__version__, "vllm": vllm.__version__, "calls_per_graph": CALLS,
              "routing": "uniform random top-k", "rows": rows}
    for shape in [*SHAPES, *custom]:
        if (wanted or custom) and shape[0] not in wanted and shape not in custom:
            continue
        try:
            probe_shape(shape, tokens, deadline, rows, modes)
        except Exception as exc:  # one shape that cannot be built or run leaves the others standing
            rows.append({"shape": shape[0], "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
