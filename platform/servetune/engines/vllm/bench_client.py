"""``vllm bench serve`` as a load generator: its argv from a :class:`~servetune.workload.Workload`,
the run as a subprocess, and its result JSON read into the figures :func:`servetune.result.summarize`
returns, so a trial measured by vLLM's own benchmark is recorded exactly like one measured by
:mod:`servetune.engines.vllm.loadgen`.

Only vLLM's ``random`` dataset can stand for a servetune workload: fixed lengths, or uniform ones
that ``--random-range-ratio`` expresses (``[floor(L*(1-r)), ceil(L*(1+r))]``, one ratio for input
and output), a shared prefix for every request (``--random-prefix-len``), a closed loop
(``--max-concurrency``) or Poisson arrivals (``--request-rate``, burstiness 1). Anything else is a
:class:`~servetune.errors.SpecError` naming the workload field. Requests are greedy
(``--temperature 0``) with ``--ignore-eos``, as servetune's own load generator sends them.

Pure pieces (:func:`bench_argv`, :func:`parse_bench_result`, :func:`parse_bench_banner`) are
separate from the one I/O function, :func:`run_bench`.

Example:
    >>> from servetune.workload import Workload
    >>> w = Workload.from_dict({"input_len": 1024, "output_len": 256, "num_requests": 384, "concurrency": 64})
    >>> argv = bench_argv(w, base_url="http://127.0.0.1:8011", model="/root/model", result_dir="/tmp/t")
    >>> argv[:3], argv[argv.index("--random-input-len") + 1], argv[argv.index("--max-concurrency") + 1]
    (['vllm', 'bench', 'serve'], '1024', '64')
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from servetune.errors import SpecError
from servetune.planner.flags import argv_value
from servetune.result import LatencySummary
from servetune.workload import LengthDist, Workload

__all__ = ["BENCH_COMMAND", "BENCH_PERCENTILES", "BenchRun", "bench_argv", "random_dataset_args",
           "parse_bench_result", "parse_bench_banner", "run_bench"]

#: The argv before the options; configurable like the serve command (a wrapper, a venv's python -m).
BENCH_COMMAND: tuple[str, ...] = ("vllm", "bench", "serve")
#: The percentiles asked of ``vllm bench serve``: the ones a :class:`LatencySummary` holds.
BENCH_PERCENTILES = (50, 90, 99)
# bench's metric names -> the TrialResult fields (``e2el`` is servetune's ``e2e``).
_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2el": "e2e_ms"}


# -- pure: the argv ------------------------------------------------------------------------------

def _length_args(dist: LengthDist, field: str, prefix: int) -> tuple[int, float]:
    """(``--random-*-len``, range ratio) whose sampled interval is exactly the distribution's."""
    if dist.dist == "fixed":
        length = int(dist.mean) - prefix
        if length < 1:
            raise SpecError(field, f"{int(dist.mean)} tokens leave none after the {prefix}-token shared prefix",
                            "make the input longer than workload.prefix_len")
        return length, 0.0
    if dist.dist != "uniform":
        raise SpecError(field, f"vllm bench serve's random dataset cannot draw a {dist.dist} distribution",
                        "use a fixed length or a uniform one ({dist: uniform, min: .., max: ..} or "
                        "{mean: .., range_ratio: ..}), or load_generator: servetune")
    lo, hi = dist.min - prefix, dist.max - prefix
    if lo < 1:
        raise SpecError(field, f"min {dist.min} leaves no tokens after the {prefix}-token shared prefix",
                        "raise min above workload.prefix_len")
    # bench samples integers in [floor(L*(1-r)), ceil(L*(1+r))]; L must be an integer, so the
    # interval is representable only when it is centred on one. Check with bench's own float maths.
    length, ratio = (lo + hi) // 2, (hi - lo) / (lo + hi)
    if (lo + hi) % 2 or math.floor(length * (1 - ratio)) != lo or math.ceil(length * (1 + ratio)) != hi:
        raise SpecError(field, f"vllm bench serve cannot draw uniformly from [{dist.min}, {dist.max}]: its "
                               "interval is centred on a whole token count",
                        "make min + max even, or use load_generator: servetune")
    return length, ratio


def random_dataset_args(workload: Workload) -> list[str]:
    """The ``--dataset-name random`` options for ``workload``; SpecError where bench cannot follow it.

    Example:
        >>> w = Workload.from_dict({"input_len": {"dist": "uniform", "min": 512, "max": 1536},
        ...                         "output_len": {"dist": "uniform", "min": 128, "max": 384},
        ...                         "num_requests": 8, "concurrency": 4})
        >>> random_dataset_args(w)
        ['--dataset-name', 'random', '--random-input-len', '1024', '--random-output-len', '256', '--random-range-ratio', '0.5']
    """
    if workload.prompt_file is not None or workload.trace_file is not None:
        field = "workload.prompt_file" if workload.prompt_file is not None else "workload.trace_file"
        raise SpecError(field, "vllm bench serve is driven with its random dataset; a prompt file or a trace "
                               "is not translated", "use load_generator: servetune for prompt files and traces")
    prefix = workload.prefix_len
    if prefix and workload.num_prefix_groups > 1:
        raise SpecError("workload.num_prefix_groups", "vllm bench serve's random dataset shares one prefix "
                        "between all requests", "set num_prefix_groups: 1, or use load_generator: servetune")
    in_len, in_ratio = _length_args(workload.input_len, "workload.input_len", prefix)
    out_len, out_ratio = _length_args(workload.output_len, "workload.output_len", 0)
    if workload.input_len.dist != "fixed" and workload.output_len.dist != "fixed" and \
            not math.isclose(in_ratio, out_ratio, rel_tol=1e-9):
        raise SpecError("workload.output_len", f"vllm bench serve has one --random-range-ratio for both lengths; "
                        f"input_len needs {in_ratio:g}, output_len {out_ratio:g}",
                        "give both the same range_ratio, or use load_generator: servetune")
    if (workload.input_len.dist == "fixed") != (workload.output_len.dist == "fixed"):
        varying = "workload.input_len" if workload.input_len.dist != "fixed" else "workload.output_len"
        raise SpecError(varying, "vllm bench serve has one --random-range-ratio for both lengths, so one "
                        "length cannot vary while the other is fixed",
                        "make both lengths uniform with the same range_ratio, or use load_generator: servetune")
    ratio = max(in_ratio, out_ratio)
    args = ["--dataset-name", "random", "--random-input-len", str(in_len), "--random-output-len", str(out_len),
            "--random-range-ratio", f"{ratio:.12g}"]
    if prefix:
        args += ["--random-prefix-len", str(prefix)]
    return args


def bench_argv(
    workload: Workload,
    *,
    base_url: str,
    model: str,
    result_dir: str | os.PathLike[str],
    result_filename: str = "bench.json",
    served_model_name: str | None = None,
    command: Sequence[str] = BENCH_COMMAND,
) -> list[str]:
    """The full ``vllm bench serve`` argv for ``workload`` against the server at ``base_url``.

    ``model`` is what the server was given (bench loads its tokenizer from it); a server started
    with ``--served-model-name`` needs that name too. The result JSON lands in
    ``result_dir/result_filename``.
    """
    # Each free-text value is checked by the one rule (SpecError): none may be read as an option.
    argv = [*command, "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url.rstrip("/"),
            "--model", argv_value(model, "serve_model")]
    if served_model_name and served_model_name != model:
        argv += ["--served-model-name", argv_value(served_model_name, "served_model_name", "a served model name")]
    argv += random_dataset_args(workload)
    argv += ["--num-prompts", str(workload.num_requests), "--seed", str(workload.seed)]
    if workload.concurrency is not None:
        argv += ["--max-concurrency", str(workload.concurrency)]
    if workload.request_rate is not None:
        argv += ["--request-rate", f"{workload.request_rate:g}", "--burstiness", "1"]
    if workload.warmup_requests:
        argv += ["--num-warmups", str(workload.warmup_requests)]
    argv += ["--ignore-eos", "--temperature", "0",
             "--percentile-metrics", ",".join(_METRICS),
             "--metric-percentiles", ",".join(str(p) for p in BENCH_PERCENTILES),
             "--save-result", "--result-dir", argv_value(str(result_dir), "output.runs_dir", "a folder"),
             "--result-filename", argv_value(result_filename, "result_filename", "a file name")]
    return argv


# -- pure: the result ----------------------------------------------------------------------------

def _latency(data: Mapping[str, Any], metric: str) -> LatencySummary | None:
    """``mean_*``, ``median_*`` (else ``p50_*``), ``p90_*``, ``p99_*`` of one metric; None if absent."""
    def num(key: str) -> float | None:
        v = data.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    mean = num(f"mean_{metric}_ms")
    p50 = num(f"median_{metric}_ms")
    p50 = p50 if p50 is not None else num(f"p50_{metric}_ms")
    p90, p99 = num(f"p90_{metric}_ms"), num(f"p99_{metric}_ms")
    if mean is None or p50 is None or p90 is None or p99 is None:
        return None
    return LatencySummary(mean=mean, p50=p50, p90=p90, p99=p99)


def parse_bench_result(data: Mapping[str, Any]) -> dict[str, Any]:
    """The :func:`~servetune.result.summarize` figures from a ``vllm bench serve`` result JSON.

    ``failed`` is read where bench writes it (0.26+), else ``num_prompts - completed``. A latency
    whose mean or percentiles are missing (not asked for, or no request completed) is None.

    Example:
        >>> f = parse_bench_result({"duration": 2.0, "completed": 10, "failed": 0, "output_throughput": 50.0,
        ...                         "total_token_throughput": 90.0, "request_throughput": 5.0,
        ...                         "mean_ttft_ms": 12.0, "median_ttft_ms": 11.0, "p90_ttft_ms": 15.0,
        ...                         "p99_ttft_ms": 19.0})
        >>> f["completed"], f["ttft_ms"], f["itl_ms"]
        (10, LatencySummary(mean=12.0, p50=11.0, p90=15.0, p99=19.0), None)
    """
    if "duration" not in data or "completed" not in data:
        raise ValueError("not a vllm bench serve result: no 'duration' / 'completed' keys")
    completed = int(data["completed"])
    failed = data.get("failed")
    if failed is None:
        failed = max(0, int(data.get("num_prompts", completed)) - completed)
    out: dict[str, Any] = {
        "duration_s": float(data["duration"]),
        "completed": completed,
        "failed": int(failed),
        "output_throughput": float(data.get("output_throughput") or 0.0),
        "total_token_throughput": float(data.get("total_token_throughput") or 0.0),
        "request_throughput": float(data.get("request_throughput") or 0.0),
    }
    for metric, field in _METRICS.items():
        out[field] = _latency(data, metric)
    return out


_BANNER_RE = re.compile(r"^(?P<key>[A-Z][^:\n]*?):\s+(?P<value>-?[0-9.]+(?:e[-+]?\d+)?)\s*$", re.MULTILINE)


def parse_bench_banner(text: str) -> dict[str, float]:
    """The ``Serving Benchmark Result`` banner of bench's output: label -> value (2 decimals as printed).

    Example:
        >>> parse_bench_banner("Successful requests:   384\\nMean TTFT (ms):   187.61\\n")
        {'Successful requests': 384.0, 'Mean TTFT (ms)': 187.61}
    """
    start = text.rfind("Serving Benchmark Result")
    body = text[start:] if start >= 0 else text
    return {m["key"].strip(): float(m["value"]) for m in _BANNER_RE.finditer(body)}


# -- I/O: running it -----------------------------------------------------------------------------

@dataclasses.dataclass
class BenchRun:
    """One ``vllm bench serve`` run: its figures (None when it produced no result) and how it ended."""

    argv: list[str]
    returncode: int | None
    figures: dict[str, Any] | None
    stopped: str | None = None  # why servetune stopped it early (stall, server death); None otherwise
    error: str | None = None  # why there are no figures
    raw: dict[str, Any] | None = None  # the result JSON as bench wrote it
    log_path: Path | None = None


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGINT)  # bench prints what it has on Ctrl-C; then it is stopped
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def run_bench(
    argv: Sequence[str],
    result_path: Path,
    log_path: Path,
    *,
    on_poll: Callable[[], str | None] | None = None,
    poll_interval_s: float = 0.5,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    stop_grace_s: float = 5.0,
) -> BenchRun:
    """Run ``argv`` (no shell) in its own process group, output to ``log_path``; read ``result_path``.

    ``on_poll`` is called every ``poll_interval_s`` while bench runs (the trial samples the
    server's gauges there); when it returns a reason, bench is stopped and the run is reported
    ``stopped`` with that reason. Never raises for bench's own failure.

    Example::

        run = run_bench(bench_argv(w, base_url=url, model=m, result_dir=d), Path(d) / "bench.json",
                        Path(d) / "bench.log")
        run.figures["output_throughput"]
    """
    argv = list(argv)
    with contextlib.suppress(FileNotFoundError):
        result_path.unlink()  # a stale result must not pass for this run's
    log_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.parent.mkdir(parents=True, exist_ok=True)
    stopped: str | None = None
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=None if env is None else dict(env))
        except OSError as exc:
            return BenchRun(argv, None, None, error=f"cannot start {argv[0]}: {exc}", log_path=log_path)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while proc.poll() is None:
                if on_poll is not None:
                    stopped = on_poll()
                if stopped is None and deadline is not None and time.monotonic() > deadline:
                    stopped = f"vllm bench serve did not finish within {timeout_s:.0f} s"
                if stopped is not None:
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=poll_interval_s)
        finally:
            if proc.poll() is None:
                _stop_group(proc, stop_grace_s)
    run = BenchRun(argv, proc.returncode, None, stopped=stopped, log_path=log_path)
    if not result_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        run.error = (f"vllm bench serve wrote no result (exit code {proc.returncode})"
                     + (f": {' | '.join(tail)}" if tail else ""))
        return run
    try:
        run.raw = json.loads(result_path.read_text())
        run.figures = parse_bench_result(run.raw)
    except (OSError, ValueError, TypeError) as exc:
        run.error = f"unreadable vllm bench serve result {result_path}: {exc}"
    return run
