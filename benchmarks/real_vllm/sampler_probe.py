"""The V1 sampler's cost beyond greedy on this GPU, as vLLM 0.11-0.20 runs it (torch and Triton only, no vLLM).

What a step's sampler does for requests that sample with top-k and top-p (every Qwen model's
``generation_config.json``), on the V1 model runner, read in the wheels (``v1/sample/sampler.py``,
``v1/sample/ops/topk_topp_sampler.py``): ``logits.to(float32)``, ``div_`` by the temperature,
``apply_top_k_top_p``, ``softmax`` in fp32, ``q.exponential_()``, ``probs.div_(q).argmax``. What
``apply_top_k_top_p`` runs depends on the release:

* ``sort``: PyTorch's sort of the whole row, top-k's gather and mask, top-p's softmax, cumsum and
  mask, the scatter back (``apply_top_k_top_p`` of 0.11.0-0.16.0 at every batch size, and
  ``apply_top_k_top_p_pytorch`` of 0.17+ below 8 rows); copied here from the 0.17.1 wheel.
* ``triton``: ``apply_top_k_top_p_triton`` (0.17.0+ at 8 rows or more): loaded from the wheel's own
  ``topk_topp_triton.py`` of each release given (``--kernel VERSION=PATH``), with the three vLLM helpers
  it imports shimmed (``next_power_of_2``, ``num_compute_units``, ``triton_utils``).

Greedy (what servetune's calibration windows ran) is ``logits.to(float32)`` and ``argmax``; the probe
times both and writes the difference, per rows x vocabulary, CUDA events, median of ``--iters``
after warm-up, fresh logits each time (the mask works in place). Logits are Gaussian (sigma 2): the
Triton kernel's pivot search is data-dependent, and a real model's rows are heavier-tailed.

Usage: python sampler_probe.py OUT.json --kernel 0.17.1=PATH/topk_topp_triton.py [--kernel 0.20.0=...]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import types

import torch

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
VOCABS = (32000, 128256, 151936, 201088, 248320)
#: The Triton kernel compiles once per (rows, vocabulary): ``BATCH_SIZE`` and ``VOCAB_SIZE`` are
#: constexpr. Timed on fewer shapes, and not past ``--triton-budget-s``.
TRITON_ROWS = (8, 32, 128, 256, 512, 1024)
TRITON_VOCABS = (32000, 151936, 248320)
TOP_K, TOP_P, TEMPERATURE = 20, 0.95, 0.6


def shim_vllm() -> None:
    """The three vLLM names ``topk_topp_triton.py`` imports, without vLLM."""
    import triton
    import triton.language as tl

    def next_power_of_2(n: int) -> int:
        return 1 if n < 1 else 1 << (n - 1).bit_length()

    def num_compute_units(device_id: int = 0) -> int:
        return torch.cuda.get_device_properties(device_id).multi_processor_count

    mods = {"vllm": types.ModuleType("vllm"), "vllm.triton_utils": types.ModuleType("vllm.triton_utils"),
            "vllm.utils": types.ModuleType("vllm.utils"),
            "vllm.utils.math_utils": types.ModuleType("vllm.utils.math_utils"),
            "vllm.utils.platform_utils": types.ModuleType("vllm.utils.platform_utils")}
    mods["vllm.triton_utils"].triton, mods["vllm.triton_utils"].tl = triton, tl
    mods["vllm.triton_utils"].HAS_TRITON = True
    mods["vllm.utils.math_utils"].next_power_of_2 = next_power_of_2
    mods["vllm.utils.platform_utils"].num_compute_units = num_compute_units
    sys.modules.update(mods)


def load_kernel(version: str, path: str):
    spec = importlib.util.spec_from_file_location(f"topk_topp_triton_{version.replace('.', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.apply_top_k_top_p_triton


def sort_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``apply_top_k_top_p_pytorch`` of the 0.17.1 wheel (``apply_top_k_top_p`` of 0.11.0-0.16.0), k and p set."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    top_k_mask = logits_sort.size(1) - k.to(torch.long)
    top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
    top_k_mask = logits_sort < top_k_mask
    logits_sort.masked_fill_(top_k_mask, -float("inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
    top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
    top_p_mask[:, -1] = False
    logits_sort.masked_fill_(top_p_mask, -float("inf"))
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)


def random_step(raw: torch.Tensor, mask, temp: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    logits = raw.to(torch.float32)
    logits.div_(temp.unsqueeze(dim=1))
    logits = mask(logits, k, p)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    q = torch.empty_like(probs)
    q.exponential_()
    return probs.div_(q).argmax(dim=-1).view(-1)


def greedy_step(raw: torch.Tensor) -> torch.Tensor:
    return raw.to(torch.float32).argmax(dim=-1).view(-1)


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--kernel", action="append", default=[], help="VERSION=PATH of a wheel's topk_topp_triton.py")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--triton-budget-s", type=float, default=400.0)
    args = ap.parse_args()
    shim_vllm()
    paths = {"sort": sort_top_k_top_p}
    for item in args.kernel:
        version, path = item.split("=", 1)
        paths[f"triton {version}"] = load_kernel(version, path)
    props = torch.cuda.get_device_properties(0)
    res = {"gpu": torch.cuda.get_device_name(), "sms": props.multi_processor_count, "torch": torch.__version__,
           "sampling": {"top_k": TOP_K, "top_p": TOP_P, "temperature": TEMPERATURE, "logits": "N(0, 2^2)"},
           "cases": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = time.monotonic()
    for vocab in VOCABS:
        for rows in ROWS:
            raw = (torch.randn(rows, vocab, device="cuda", generator=gen) * 2).to(torch.bfloat16)
            temp = torch.full((rows,), TEMPERATURE, device="cuda")
            k = torch.full((rows,), TOP_K, dtype=torch.int32, device="cuda")
            p = torch.full((rows,), TOP_P, device="cuda")
            case = {"rows": rows, "vocab": vocab, "greedy_ms": time_ms(lambda: greedy_step(raw), args.iters)}
            for name, mask in paths.items():
                if name != "sort" and (rows not in TRITON_ROWS or vocab not in TRITON_VOCABS
                                       or time.monotonic() - start > args.triton_budget_s):
                    continue  # vLLM runs the sort below 8 rows; each shape compiles anew
                try:
                    case[f"{name}_ms"] = time_ms(lambda: random_step(raw, mask, temp, k, p), args.iters)
                except Exception as exc:  # a kernel that does not build on this Triton: say so, keep going
                    case[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            res["cases"].append(case)
            print(json.dumps(case), flush=True)
            json.dump(res, open(args.out, "w"), indent=1)  # what a timeout leaves is kept
            del raw
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
