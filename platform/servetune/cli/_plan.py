"""``servetune plan``: predict vLLM's startup memory for a model, a GPU and a flag set, before launching.

Prints the per-GPU memory breakdown vLLM's profiler would arrive at, the KV cache it would get
(tokens, blocks, maximum concurrency), the resolved flags that matter, the predicted startup time
and a verdict: ``fits``, or the failure vLLM would raise (with its own text) and what to change.
``--json`` prints :meth:`servetune.planner.memory.MemoryPlan.to_json` plus the resolved flags.

Exit codes: 0 the plan fits, 1 vLLM would fail to start, 2 bad input (unknown flag, GPU or model;
a flag combination vLLM refuses).

Example::

    servetune plan --model servetune-test-850m --gpu H200 --set gpu_memory_utilization=0.5 --set max_num_seqs=64
    servetune plan --model llama-3.1-8b --gpu L40S --set max_model_len=32768 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from servetune.errors import SpecError
from servetune.planner.flags import parse_set_option
from servetune.planner.gpus import get_gpu, register_gpus_from_yaml
from servetune.planner.memory import DEFAULT_VLLM_VERSION, EngineConfig, MemoryPlan, plan_memory, resolve_engine_config
from servetune.planner.modelinfo import ModelProfile, load_model

__all__ = ["add_parser", "run", "format_plan"]


def add_parser(subparsers: Any) -> None:
    """Register ``plan`` on the ``servetune`` subcommand parser."""
    p = subparsers.add_parser(
        "plan", help="predict vLLM's startup memory, KV cache and verdict for a flag set",
        description="Predict vLLM's startup memory accounting (weights, activation peak, non-torch, CUDA "
                    "graphs, KV cache) for a model on a GPU, without a GPU.")
    p.add_argument("--model", required=True,
                   help="shipped name (e.g. llama-3.1-8b), model directory, config.json, or a Hugging Face id in the local cache")
    p.add_argument("--gpu", required=True, help="GPU name, e.g. H200, H100-80GB, L40S (case-insensitive)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="FLAG=VALUE",
                   help="a vLLM flag, e.g. --set gpu_memory_utilization=0.9 (repeatable)")
    p.add_argument("--vllm-version", default=DEFAULT_VLLM_VERSION, help=f"vLLM version to model (default {DEFAULT_VLLM_VERSION})")
    p.add_argument("--gpu-file", action="append", default=[], metavar="YAML", help="YAML file adding GPUs to the table")
    p.add_argument("--cold-start", action="store_true", help="predict startup time for a fresh host (cold compile cache)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    """Run ``servetune plan``; returns the exit code (0 fits, 1 predicted failure, 2 bad input)."""
    try:
        for path in args.gpu_file or ():
            register_gpus_from_yaml(path)
        flags: dict[str, Any] = {}
        for item in args.sets or ():
            name, value = parse_set_option(item)
            flags[name] = value
        gpu = get_gpu(args.gpu)
        model = load_model(args.model)
        config = resolve_engine_config(flags, model, gpu, args.vllm_version)
        plan = plan_memory(model, gpu, config, cold_start=bool(getattr(args, "cold_start", False)))
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = plan.to_json()
        doc.update(model=model.name, gpu=gpu.name, vllm_version=config.vllm_version, flags=config.as_flags())
        print(json.dumps(doc, indent=2))
    else:
        print(format_plan(model, gpu.name, config, plan))
    return 0 if plan.fits else 1


def format_plan(model: ModelProfile, gpu_name: str, config: EngineConfig, plan: MemoryPlan) -> str:
    """The human-readable plan: memory table, KV capacity, key flags, startup time, verdict."""
    m = plan.memory
    cg_note = ""
    if plan.num_cudagraphs:
        pw = len(config.cudagraph_capture_sizes)
        where = "taken from the KV budget" if plan.cudagraph_subtracted else "outside the budget"
        cg_note = f"{pw} PIECEWISE + {plan.num_cudagraphs - pw} FULL graphs, {where}"
    budget_note = (f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}" if config.kv_cache_memory_bytes is not None
                   else f"{config.gpu_memory_utilization:g} x total")
    rows = [
        ("total", m.total, ""),
        ("budget", m.budget, budget_note),
        ("weights", m.weights, f"{model.param_count / 1e9:.2f}B params, {model.dtype}"
                                + (f", {model.quantization}" if model.quantization else "")),
        ("activation peak", m.activation_peak,
         f"profile run: {config.max_num_batched_tokens} tokens, "
         f"{min(config.max_num_batched_tokens, config.max_num_seqs)} seqs"),
        ("non-torch", m.non_torch, ""),
        ("cudagraph", m.cudagraph, cg_note or ("enforce_eager: none" if config.enforce_eager else "")),
        ("kv cache", m.kv_cache, "available for KV blocks"),
    ]
    par = f"TP={config.tensor_parallel_size} PP={config.pipeline_parallel_size}"
    lines = [f"{model.name} on {gpu_name} x{config.world_size} ({par}), vLLM {config.vllm_version}",
             "memory per GPU (GiB)"]
    for label, value, note in rows:
        if label == "kv cache" and value < 0:
            # vLLM logs the negative figure; people read "does not fit" and by how much.
            lines.append(f"  {label:<16}{'none':>9}   does not fit: the budget is {-value:.2f} GiB short")
        else:
            lines.append(f"  {label:<16}{value:>9.2f}   {note}".rstrip())
    if plan.fits:
        lines.append(f"KV cache    {plan.kv_cache_tokens:,} tokens, {plan.num_gpu_blocks:,} blocks of "
                     f"{plan.block_size}, max concurrency {plan.max_concurrency:.2f}x at {config.max_model_len:,} "
                     f"tokens ({plan.kv_bytes_per_token:,} B/token/GPU)")
    key_flags = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "enforce_eager", "kv_cache_dtype", "enable_prefix_caching", "num_gpu_blocks_override")
    shown = config.as_flags()
    lines.append("flags       " + " ".join(f"{k}={shown[k]}" for k in key_flags if k in shown))
    if config.cudagraph_capture_sizes:
        sizes = config.cudagraph_capture_sizes
        lines.append(f"cudagraphs  {len(sizes)} sizes {sizes[0]}..{sizes[-1]}")
    lines.append(f"startup     ~{plan.startup_s:.0f} s launch to healthy")
    for note in plan.notes:
        lines.append(f"note        {note}")
    if plan.fits:
        lines.append("verdict     fits")
    else:
        assert plan.failure is not None
        lines.append(f"verdict     {plan.failure.value}: {plan.cause}")
        if plan.fix:
            lines.append(f"fix         {plan.fix}")
    return "\n".join(lines)
