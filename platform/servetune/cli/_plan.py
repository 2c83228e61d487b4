"""``servetune plan``: predict vLLM's startup memory for a model, a GPU and a flag set, before launching.

Prints the per-GPU memory breakdown vLLM's profiler would arrive at, the KV cache it would get
(tokens, blocks, maximum concurrency), the resolved flags that matter, the predicted startup time
and a verdict: ``fits``, or the failure vLLM would raise (with its own text) and what to change.
``--json`` prints :meth:`servetune.planner.memory.MemoryPlan.to_json` plus the resolved flags.

The memory each TP worker takes outside torch depends on the environment ``vllm serve`` runs with
(NVLink multicast: ``NCCL_NVLS_ENABLE``, ``VLLM_ALLREDUCE_USE_SYMM_MEM``, ...). ``plan`` reads those
settings from the caller's environment (or ``--env NAME=VALUE``; ``--trial-env`` for a real servetune
trial's: :func:`servetune.planner.comm.trial_env`, its GPU workers' FlashInfer not probed, so vLLM 0.17+'s
FlashInfer all-reduce fusion workspace charged where it may run), says which it assumed, and what the KV cache
would be if the other held.
Where no vLLM >= 0.10 startup log of the GPU was checked, it says so.

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

from servetune import envs
from servetune.errors import SpecError
from servetune.planner.comm import CommEnv, trial_env
from servetune.planner.engine_config import EngineConfig, resolve_engine_config
from servetune.planner.flags import parse_set_option
from servetune.planner.gpus import GpuSpec, get_gpu, register_gpus_from_yaml
from servetune.planner.memory import MemoryPlan, plan_memory
from servetune.planner.modelinfo import ModelProfile, load_model
from servetune.vllm_version import DEFAULT_VLLM_VERSION

__all__ = ["add_parser", "run", "format_plan"]


def add_parser(subparsers: Any) -> None:
    """Register ``plan`` on the ``servetune`` subcommand parser."""
    p = subparsers.add_parser(
        "plan", help="predict a flag set's startup memory and KV cache",
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
    p.add_argument("--env", dest="env_sets", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment setting the server will run with, e.g. --env NCCL_NVLS_ENABLE=0 (repeatable; "
                        f"one of {', '.join(envs.COMM_ENV_VARS)}); default: this shell's environment")
    p.add_argument("--trial-env", action="store_true",
                   help="plan for a real servetune trial: servetune's launch environment (NVLink multicast off), "
                        "FlashInfer assumed usable on the GPU workers (a study probes them)")
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
        env = comm_env_for(list(getattr(args, "env_sets", None) or ()), bool(getattr(args, "trial_env", False)),
                           envs.comm_settings())
        cold = bool(getattr(args, "cold_start", False))
        plan = plan_memory(model, gpu, config, cold_start=cold, env=env)
        # The other environment: multicast off if this one has it live, on if this one does not.
        assert plan.comm is not None
        other_env = env.with_nvls(not plan.comm.multicast)
        other = plan_memory(model, gpu, config, cold_start=cold, env=other_env)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    alt = other if (other.comm is not None and other.comm.multicast != plan.comm.multicast) else None
    if args.json:
        doc = plan.to_json()
        doc.update(model=model.name, gpu=gpu.name, vllm_version=config.vllm_version, flags=config.as_flags(),
                   environment=env.describe(), evidence=gpu.log_evidence or None, gpu_source=gpu.source,
                   gpu_notes=list(gpu.vllm_notes()))
        doc["if_other_environment"] = None if alt is None else {
            "environment": other_env.describe(), "fits": alt.fits, "kv_cache_tokens": alt.kv_cache_tokens,
            "failure": alt.failure.value if alt.failure is not None else None,
            "non_torch_gib": round(alt.memory.non_torch, 4)}
        print(json.dumps(doc, indent=2))
    else:
        print(format_plan(model, gpu, config, plan, env=env, other=alt, other_env=other_env))
    return 0 if plan.fits else 1


def comm_env_for(env_sets: list[str], for_trial: bool, inherited: dict[str, str]) -> CommEnv:
    """The environment ``plan`` assumes: ``--trial-env`` (``for_trial``), else the caller's settings overlaid by
    ``--env``.

    Example:
        >>> comm_env_for(["NCCL_NVLS_ENABLE=0"], False, {}).nvls
        'off'
        >>> comm_env_for([], False, {"NCCL_NVLS_ENABLE": "1"}).source
        "this shell's environment"
        >>> comm_env_for(["CUDA_VISIBLE_DEVICES=0"], False, {})
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: --env: CUDA_VISIBLE_DEVICES does not change the planner's memory model (fix: use one of NCCL_NVLS_ENABLE, NCCL_NVLS_CHUNKSIZE, VLLM_ALLREDUCE_USE_SYMM_MEM, TORCH_SYMM_MEM_DISABLE_MULTICAST)
    """
    if for_trial:
        if env_sets:
            raise SpecError("--env", "--trial-env fixes servetune's launch environment", "give --env or --trial-env, not both")
        return trial_env(True)  # a real servetune trial whose GPU workers are not probed here: workspace charged
    given: dict[str, str] = {}
    for item in env_sets:
        name, sep, value = str(item).partition("=")
        name = name.strip()
        if not sep or not name:
            raise SpecError("--env", f"expected NAME=VALUE, got {item!r}", "write e.g. --env NCCL_NVLS_ENABLE=0")
        if name not in envs.COMM_ENV_VARS:
            raise SpecError("--env", f"{name} does not change the planner's memory model",
                            f"use one of {', '.join(envs.COMM_ENV_VARS)}")
        given[name] = value.strip()
    source = ("--env" if given else "this shell's environment" if inherited
              else "vLLM's and NCCL's defaults: none of the settings is set here")
    return CommEnv.from_mapping({**inherited, **given}, source)


def _non_torch_note(plan: MemoryPlan) -> str:
    """What the non-torch row holds beyond NCCL's rings: NVLS buffers, the FlashInfer all-reduce fusion workspace."""
    comm = plan.comm
    parts = [name for name, on in (("NCCL NVLS buffers", comm is not None and comm.multicast),
                                   ("FlashInfer all-reduce fusion workspace", comm is not None and comm.fused_allreduce))
             if on]
    return " and ".join(parts) + " included" if parts else ""


def format_plan(model: ModelProfile, gpu: GpuSpec | str, config: EngineConfig, plan: MemoryPlan, *,
                env: CommEnv | None = None, other: MemoryPlan | None = None, other_env: CommEnv | None = None) -> str:
    """The human-readable plan: memory table, KV capacity, key flags, startup time, environment, verdict.

    ``other`` is the same plan under ``other_env`` (multicast the other way), shown when it differs.
    """
    gpu_name = gpu if isinstance(gpu, str) else gpu.name
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
        ("non-torch", m.non_torch, _non_torch_note(plan)),
        ("cudagraph", m.cudagraph, cg_note or ("enforce_eager: none" if config.enforce_eager else "")),
        ("kv cache", m.kv_cache, "available for KV blocks"),
    ]
    par = f"TP={config.tensor_parallel_size} PP={config.pipeline_parallel_size}"
    if config.data_parallel_size > 1:
        par += f" DP={config.data_parallel_size}"
    if config.expert_parallel_size(model.is_moe) > 1:  # --enable-expert-parallel, vLLM's ep_size = TP x DP
        par += f" EP={config.expert_parallel_size(model.is_moe)}"
    lines = [f"{model.name} on {gpu_name} x{config.num_gpus} ({par}), vLLM {config.vllm_version}",
             "memory per GPU (GiB)" + (" of one replica" if config.data_parallel_size > 1 else "")]
    for label, value, note in rows:
        if label == "kv cache" and value < 0:
            # vLLM logs the negative figure; people read "does not fit" and by how much.
            lines.append(f"  {label:<16}{'none':>9}   does not fit: the budget is {-value:.2f} GiB short")
        else:
            lines.append(f"  {label:<16}{value:>9.2f}   {note}".rstrip())
    if plan.fits:
        per = " per replica" if config.data_parallel_size > 1 else ""
        lines.append(f"KV cache    {plan.kv_cache_tokens:,} tokens{per}, {plan.num_gpu_blocks:,} blocks of "
                     f"{plan.block_size}, max concurrency {plan.max_concurrency:.2f}x at {config.max_model_len:,} "
                     f"tokens ({plan.kv_bytes_per_token:,} B/token/GPU)")
    key_flags = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "enforce_eager", "kv_cache_dtype", "enable_prefix_caching", "mamba_cache_mode",
                 "disable_custom_all_reduce", "num_gpu_blocks_override")
    shown = config.as_flags()
    lines.append("flags       " + " ".join(f"{k}={shown[k]}" for k in key_flags if k in shown))
    if config.cudagraph_capture_sizes:
        sizes = config.cudagraph_capture_sizes
        lines.append(f"cudagraphs  {len(sizes)} sizes {sizes[0]}..{sizes[-1]}")
    lines.append(f"startup     ~{plan.startup_s:.0f} s launch to healthy")
    if env is not None and plan.comm is not None:
        lines.append(f"environment {env.describe()}; {plan.comm.reason}")
        if other is not None and other_env is not None:
            what = (f"{other.kv_cache_tokens:,} KV tokens" if other.fits
                    else f"{other.failure.value if other.failure else 'fails'}")
            lines.append(f"if instead  {other_env.describe()}: {what}, non-torch {other.memory.non_torch:.2f} GiB per GPU")
    if not isinstance(gpu, str):
        for note in gpu.vllm_notes():
            lines.append(f"gpu         {note}")
        if not gpu.log_evidence:
            lines.append(f"evidence    no vLLM >= 0.10 startup log of {gpu.name} was checked: its figures come from "
                         f"{gpu.source or 'a user GPU file'}; the memory constants from servetune's H200 runs")
        else:
            lines.append(f"evidence    {gpu.log_evidence}")
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
