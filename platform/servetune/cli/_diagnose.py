"""``servetune diagnose LOG [--metrics FILE] [--json]``: explain how a vLLM server run ended.

Reads a ``vllm serve`` log (and optionally a ``/metrics`` scrape taken after the run), classifies
the outcome (:func:`servetune.engines.vllm.logs.classify`) and prints the status and cause, the memory
breakdown vLLM logged, the timings, the KV capacity, the preemptions and numbered advice.
``--json`` prints :meth:`servetune.engines.vllm.diagnose.Diagnosis.to_json` instead.

Exit codes, for scripts: 0 the server served (status ``ok``); 1 it did not: a classified failure
(``startup_oom``, ``kv_too_small``, ``cudagraph_oom``, ``runtime_oom``, ``crashed``,
``invalid_config``, ``timeout``), or a log that ends with no error before the server was ready
(``incomplete``: cut short, still starting, or killed without a trace; not called a crash); 2 a
file is missing or unreadable, or the LOG is not a vLLM log (no line carries vLLM's logger header,
its CLI's usage/error line or a frame of the vllm package: a README, a YAML file, an empty file).

Example::

    servetune diagnose tests/fixtures/real_h200/b5_fail_u0012/server.log
    servetune diagnose run/server.log --metrics run/metrics_after.txt --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from servetune.engines.vllm.diagnose import Diagnosis, diagnose
from servetune.engines.vllm.logs import ParsedLog, classify, is_vllm_log, parse_log
from servetune.errors import SpecError
from servetune.inputs import read_text
from servetune.result import TrialStatus

__all__ = ["add_parser", "run", "format_diagnosis"]


def add_parser(subparsers: Any) -> None:
    """Register ``diagnose`` on the ``servetune`` subcommand parser."""
    p = subparsers.add_parser(
        "diagnose", help="classify a vLLM server log and say what to change",
        description="Classify how a vLLM server run ended (ok, startup_oom, kv_too_small, cudagraph_oom, "
                    "runtime_oom, crashed, timeout, invalid_config, incomplete) from its log, with the evidence, "
                    "the memory breakdown and advice. Exit code 0 served, 1 did not, 2 not a vLLM log or "
                    "unreadable.")
    p.add_argument("log", help="the vllm serve log (stdout and stderr)")
    p.add_argument("--metrics", metavar="FILE", help="a /metrics scrape taken after the run (for preemptions)")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")


def _read(path: str, what: str) -> str | None:
    """A log's text, read as a regular file within the log cap (:mod:`servetune.inputs`); bytes that are not
    UTF-8 replaced, carriage returns kept (tqdm's), so evidence line numbers match `grep -n`."""
    try:
        return read_text(path, "log", what, errors="replace")
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
    return None


def run(args: argparse.Namespace) -> int:
    """Run ``servetune diagnose``; 0 served, 1 did not (a failure, or a log cut before ready), 2 bad input."""
    text = _read(args.log, "LOG")
    if text is None:
        return 2
    if not is_vllm_log(text):
        what = "it is empty" if not text.strip() else "no line carries vLLM's logger header (LEVEL MM-DD HH:MM:SS " \
            "[file.py:N]), its CLI's usage or error line, or a frame of the vllm package"
        print(f"error: LOG: {args.log} is not a vLLM log: {what} (fix: give the output of `vllm serve`, stdout and "
              "stderr, e.g. `vllm serve MODEL ... 2>&1 | tee server.log`)", file=sys.stderr)
        return 2
    metrics_text = None
    if getattr(args, "metrics", None):
        metrics_text = _read(args.metrics, "--metrics")
        if metrics_text is None:
            return 2
    try:
        parsed = parse_log(text)
        # A log alone: the server was healthy if it said so; a failure shows in the log itself.
        result = diagnose(parsed, classify(text, healthy=parsed.server_ready), metrics_text)
    except (ValueError, OverflowError) as exc:  # LogFigureError, or a figure that breaks the arithmetic
        print(f"error: LOG: {args.log}: {str(exc)[:200]} (fix: give an unedited `vllm serve` log)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(format_diagnosis(Path(args.log).name, parsed, result))
    return 0 if result.status is TrialStatus.OK else 1


def _fmt(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}{unit}"


def format_diagnosis(name: str, parsed: ParsedLog, d: Diagnosis) -> str:
    """The human-readable diagnosis: status, evidence, memory table, timings, KV capacity, advice."""
    lines = [f"{name}: vLLM {d.vllm_version or '?'}"]
    status = d.status.value + (" (infrastructure)" if d.infrastructure else "")
    lines.append(f"status      {status}")
    if d.cause:
        lines.append(f"cause       {d.cause}")
    if d.evidence and d.status.value != "ok":
        lines.append("evidence")
        lines += [f"  {e}" for e in d.evidence]
    m = d.memory_gib
    lines.append("")
    lines.append("memory per GPU (GiB)")
    if parsed.total_gpu_gib is not None:
        lines.append(f"  {'GPU total':<18}{_fmt(parsed.total_gpu_gib):>10}")
    if parsed.requested_gib is not None:
        util = f"  (gpu_memory_utilization {parsed.gpu_memory_utilization})" if parsed.gpu_memory_utilization else ""
        lines.append(f"  {'budget':<18}{_fmt(parsed.requested_gib):>10}{util}")
    for label, key in (("weights", "weights"), ("activation peak", "activation_peak"), ("non-torch", "non_torch"),
                       ("CUDA graphs", "cudagraph"), ("KV cache", "kv_cache")):
        lines.append(f"  {label:<18}{_fmt(m[key]):>10}")
    if len(parsed.workers) > 1:
        lines.append(f"  ({len(parsed.workers)} workers: {', '.join(sorted(parsed.workers))}; the binding worker shown)")
    t = d.timings_s
    lines.append("")
    lines.append("timings (s)")
    for label, key in (("weights load", "weights_load"), ("torch.compile", "torch_compile"),
                       ("graph capture", "graph_capture"), ("engine init", "engine_init")):
        lines.append(f"  {label:<18}{_fmt(t[key]):>10}")
    lines.append("")
    kv = "-" if d.kv_cache_tokens is None else f"{d.kv_cache_tokens:,} tokens"
    if d.num_gpu_blocks is not None:
        kv += f", {d.num_gpu_blocks:,} blocks" + (" (derived)" if parsed.num_gpu_blocks_derived and
                                                   d.num_gpu_blocks == parsed.num_gpu_blocks else "")
    if d.max_concurrency is not None:
        kv += f", {d.max_concurrency:,.2f}x sequences of {(parsed.max_concurrency_tokens or d.max_model_len or 0):,}"
    lines.append(f"KV cache    {kv}")
    lines.append(f"max len     {'-' if d.max_model_len is None else f'{d.max_model_len:,}'}")
    lines.append(f"preemptions {'- (no --metrics)' if d.preemptions is None else f'{d.preemptions:,}'}")
    if d.advice:
        lines.append("")
        lines.append("advice")
        lines += [f"  {i}. {a}" for i, a in enumerate(d.advice, start=1)]
    return "\n".join(lines)
