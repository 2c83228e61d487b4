"""``servetune simulate``: one trial on the simulated vLLM engine, no GPU needed.

Contract: :func:`add_parser` registers the sub-command on the main parser's sub-parsers and
:func:`run` executes it, returning the exit code: 0 when the engine started and served the
workload, 1 when the configuration fails at startup (the planner's verdict and vLLM's own error
text are printed), 2 for bad input (``error: FIELD: what is wrong (fix: ...)`` on stderr).
``--json`` prints :meth:`TrialResult.to_dict` instead of the human summary; both carry the
engine's notes (:attr:`TrialResult.notes`: where the figures are least sure, one line each).

Example::

    servetune simulate --model servetune-test-850m --gpu H200 --workload w.yaml \\
        --set gpu_memory_utilization=0.5 --set max_num_seqs=64 --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from servetune.cli._plan import comm_env_for
from servetune.errors import SpecError
from servetune.inputs import load_yaml, missing, read_text
from servetune.planner.comm import CommEnv
from servetune.planner.flags import parse_set_option
from servetune.planner.gpus import get_gpu, register_gpus_from_yaml, with_interconnect
from servetune.planner.target import resolve_target
from servetune.result import TrialResult
from servetune.sim import api_cpu_factor_for_token_cost, simulate, with_calibration
from servetune.workload import Workload

__all__ = ["add_parser", "run", "check_work", "server_env", "EXAMPLE_WORKLOADS", "DEFAULT_MAX_TOKENS"]

#: The most tokens (prompt + output) ``simulate`` serves unless ``--max-tokens`` says more: about half a
#: minute of simulation (3,840 requests x 1,536 tokens, 5.9M tokens, took 8 s on one core).
DEFAULT_MAX_TOKENS = 20_000_000

#: The example workloads shipped next to the example studies (``jobs/workloads/``), one per kind
#: of traffic; each is run by the tests (tests/test_example_workloads.py).
EXAMPLE_WORKLOADS: dict[str, str] = {
    "prefill-heavy.yaml": "long prompts, short answers",
    "decode-heavy.yaml": "short prompts, long answers",
    "poisson-rate.yaml": "open loop at 6 requests/s",
    "shared-prefix.yaml": "4 shared 1,024-token system prompts",
    "trace.yaml": "a recorded trace, trace.jsonl",
}
EXAMPLES_HINT = "".join(f"\n  jobs/workloads/{name:<20} {what}" for name, what in EXAMPLE_WORKLOADS.items())


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` on ``parser.add_subparsers()``'s result."""
    p = subparsers.add_parser(
        "simulate", help="run one trial on the simulated vLLM engine",
        description="Simulate vLLM serving one workload with one flag set.",
        epilog=f"example workloads to start from (copy one and edit it):{EXAMPLES_HINT}\n"
               "a study spec works too (its workload: section is used).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="shipped model name, model dir, config.json or cached HF id")
    p.add_argument("--gpu", required=True, help="GPU name, e.g. H200 (as for servetune plan)")
    p.add_argument("--workload", required=True,
                   help="workload YAML: input_len, output_len (a token count or a distribution), "
                        "num_requests, and concurrency (closed loop) or request_rate (Poisson, req/s); "
                        "or prompt_file / trace_file (JSONL); prefix_len + num_prefix_groups for "
                        "shared prefixes. Examples: jobs/workloads/*.yaml")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="FLAG=VALUE",
                   help="a vLLM flag, e.g. --set max_num_seqs=64 (repeatable)")
    p.add_argument("--vllm-version", default=None, help="vLLM version to mimic (default: the project's)")
    p.add_argument("--gpu-file", default=None, help="YAML file with extra GPU definitions")
    p.add_argument("--interconnect", default=None, metavar="LINK",
                   help="how the GPUs reach each other: nvlink, pcie or pcie-no-p2p (a host without GPU P2P); "
                        "default: the GPU type's usual host (SXM parts NVLink, L4/L40S PCIe)")
    p.add_argument("--vllm-defaults", action="store_true",
                   help="simulate a server started as vllm serve alone starts it: vLLM's and NCCL's defaults, "
                        "NVLink multicast live where the board has it (its NVLS buffers in the plan, the TP "
                        "all-reduce priced by message size where published timings cover the layout); default: "
                        "servetune's launch environment, multicast off, as its trials run")
    p.add_argument("--env", dest="env_sets", action="append", default=[], metavar="NAME=VALUE",
                   help="one of those defaults changed, as for servetune plan (implies --vllm-defaults; "
                        "repeatable), e.g. --env NCCL_NVLS_ENABLE=0")
    p.add_argument("--api-cpu-factor", type=float, default=None, metavar="X",
                   help="this host's vLLM API-server CPU cost against the calibration's (default 1.0): "
                        "a real trial's api_server_cpu_s (MLflow / the dataset) divided by the "
                        "simulated one for the same flags and workload. Decode-heavy loads are bound "
                        "by it, and so are enforce_eager's kernel launches (the same host's CPU); "
                        "8B/14B windows on measured H200 hosts were 1.1-2.2")
    p.add_argument("--api-cpu-us-per-token", type=float, default=None, metavar="US",
                   help="this host's vLLM API-server CPU per generated token, in microseconds, as "
                        "servetune workload from-metrics reads it off two /metrics readings of a running "
                        "server; turned into --api-cpu-factor by simulating the workload once at 1.0")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help=f"refuse a workload that sends more than N tokens, prompt plus output, warm-up included "
                        f"(default {DEFAULT_MAX_TOKENS:,}: about half a minute of simulation on one core)")
    p.add_argument("--seed", type=int, default=0, help="simulator seed")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _load_workload(path_text: str) -> Any:
    path = Path(path_text)
    if path.is_dir():
        raise SpecError("--workload", f"{path} is a folder", "give the path of a workload YAML file")
    if missing(path):
        raise SpecError("--workload", f"file not found: {path}", "give the path of a workload YAML file")
    data = load_yaml(read_text(path, "yaml", "--workload"), "--workload", str(path))
    if isinstance(data, dict) and "workload" in data and isinstance(data["workload"], dict):
        data = data["workload"]  # a study spec's workload section works too
    return Workload.from_dict(data, field="workload", base_dir=path.parent)


def check_work(workload: Workload, max_tokens: int) -> int:
    """The workload's token bound (:meth:`Workload.token_bound`), or a :class:`SpecError` above ``max_tokens``:
    simulated time grows with the tokens served, so a 1M x 8,192-token workload is refused, not run for hours."""
    if max_tokens < 1:
        raise SpecError("--max-tokens", f"must be >= 1, got {max_tokens}", "give a token count, e.g. 20000000")
    bound = workload.token_bound()
    if bound > max_tokens:
        raise SpecError("workload", f"sends up to {bound:,} tokens (prompt + output, warm-up included), above "
                        f"the simulation limit of {max_tokens:,}",
                        "send fewer or shorter requests (a steady state needs a few thousand), or raise --max-tokens")
    return bound


def _simulate(args: argparse.Namespace) -> TrialResult:
    flags: dict[str, Any] = {}
    for item in args.sets:
        name, value = parse_set_option(item)
        flags[name] = value
    if args.gpu_file:
        register_gpus_from_yaml(args.gpu_file)
    factor = args.api_cpu_factor
    if factor is not None and not (math.isfinite(factor) and 0.05 <= factor <= 20.0):
        raise SpecError("--api-cpu-factor", f"{factor} is outside 0.05-20",
                        "give the real API server's CPU over the simulated one for one window, e.g. 1.4")
    us = getattr(args, "api_cpu_us_per_token", None)
    if us is not None and (factor is not None or not (math.isfinite(us) and 1.0 <= us <= 100_000.0)):
        raise SpecError("--api-cpu-us-per-token", f"{us:g} is outside 1-100,000 us" if factor is None
                        else "goes instead of --api-cpu-factor, not with it",
                        "give the us a token that `servetune workload from-metrics` printed (e.g. 95), alone")
    workload = _load_workload(args.workload)
    check_work(workload, args.max_tokens)  # before a request is drawn
    env = server_env(list(getattr(args, "env_sets", None) or ()), bool(getattr(args, "vllm_defaults", False)))
    link = with_interconnect(get_gpu(args.gpu), getattr(args, "interconnect", None), "--interconnect")
    target = resolve_target(args.model, link, flags, args.vllm_version)
    if us is not None:
        result = _simulate_at_token_cost(us, target, workload, args.seed, env)
    else:
        gpu = with_calibration(target.gpu, {"api_cpu_factor": factor} if factor is not None else {})
        result = simulate(target.model, gpu, target.config, workload, seed=args.seed, comm_env=env)
    if env is not None:
        result.notes.append(f"environment: {env.describe()}")
    return result  # its notes (an unjudged GPU, a hybrid, ...) are the engine's: TrialResult.notes


def server_env(env_sets: list[str], vllm_defaults: bool) -> CommEnv | None:
    """The environment the simulated server runs with: None (servetune's launch environment, multicast off)
    unless ``--vllm-defaults`` or ``--env`` asks for vLLM's and NCCL's defaults, overlaid by ``--env``.

    Example:
        >>> server_env([], False) is None, server_env([], True).nvls, server_env(["NCCL_NVLS_ENABLE=0"], False).nvls
        (True, 'auto', 'off')
    """
    if not (env_sets or vllm_defaults):
        return None
    return comm_env_for(env_sets, False, {})


def _simulate_at_token_cost(us: float, target: Any, workload: Workload, seed: int,
                            env: CommEnv | None = None) -> TrialResult:
    """Simulate at the API-CPU factor that makes the simulated API server spend ``us`` a generated token."""
    first = simulate(target.model, target.gpu, target.config, workload, seed=seed, comm_env=env)
    base = target.gpu.calibration.get("api_cpu_factor", 1.0) if target.gpu.calibration else 1.0
    factor = api_cpu_factor_for_token_cost(us, first, base)
    if factor is None:
        return first  # nothing served (a failed start, or no tokens): the factor changes nothing
    if not 0.05 <= factor <= 20.0:
        raise SpecError("--api-cpu-us-per-token", f"{us:g} us a token is {factor:.3g}x the simulated API server's "
                        "cost, outside 0.05-20", "check the readings were of this server under load")
    result = simulate(target.model, with_calibration(target.gpu, {"api_cpu_factor": factor}), target.config,
                      workload, seed=seed, comm_env=env)
    result.notes.append(f"host CPU: {us:g} us a generated token measured; simulated at --api-cpu-factor "
                           f"{factor:.3g} (the simulated API server spent {base * us / factor:.0f} us a token at {base:g})")
    return result


def format_result(result: TrialResult) -> str:
    """The human summary: status, throughput, latencies, preemptions, KV usage and memory."""
    lines = [f"status: {result.status.value} (simulated vLLM {result.vllm_version})"]
    if not result.ok:
        lines.append(f"cause: {result.cause}")
        if result.memory is not None:
            m = result.memory
            lines.append(f"memory (GiB/GPU): budget {m.budget:.2f}, weights {m.weights:.2f}, activations "
                         f"{m.activation_peak:.2f}, non-torch {m.non_torch:.2f}, CUDA graphs {m.cudagraph:.2f}")
        return "\n".join(lines)
    lines.append(f"requests: {result.completed} completed, {result.failed} failed in {result.duration_s:.2f} s")
    lines.append(f"throughput: {result.output_throughput:,.0f} output tok/s, {result.total_token_throughput:,.0f} "
                 f"total tok/s, {result.request_throughput:.2f} req/s")
    for label, summary in (("TTFT", result.ttft_ms), ("TPOT", result.tpot_ms), ("ITL", result.itl_ms),
                           ("E2E", result.e2e_ms)):
        if summary is not None:
            lines.append(f"{label + ' ms:':<9} mean {summary.mean:,.1f}  p50 {summary.p50:,.1f}  "
                         f"p90 {summary.p90:,.1f}  p99 {summary.p99:,.1f}")
    lines.append(f"preemptions: {result.preemptions}")
    lines.append(f"KV cache: {result.num_gpu_blocks:,} blocks = {result.kv_cache_tokens:,} tokens "
                 f"({result.max_concurrency:.2f}x max_model_len); usage peak {100 * (result.kv_cache_usage_peak or 0):.1f}%,"
                 f" mean {100 * (result.kv_cache_usage_mean or 0):.1f}%")
    busy = result.api_server_busy
    if busy is not None:
        lines.append(f"API server: {result.api_server_cpu_s:.2f} CPU-s over the window, busy "
                     f"{100 * busy:.0f}% of one core")
    lines.append(f"startup: {result.startup_s:.1f} s (predicted)")
    lines.extend(f"note: {note}" for note in result.notes)  # where the figure is least sure (the engine's)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Execute ``servetune simulate``; see the module docstring for the exit codes."""
    try:
        result = _simulate(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    else:
        print(format_result(result))
    return 0 if result.ok else 1
