"""``servetune workload from-metrics | from-trace``: a workload spec from what a vLLM server saw.

Contract: :func:`add_parser` registers the sub-command on the main parser's sub-parsers and
:func:`run` executes it, returning the exit code: 0 with the workload YAML written (to ``--out`` or
stdout), 2 for bad input (a source that is not vLLM ``/metrics``, unreachable, too large, or two
dumps with no time between them) as one line ``error: FIELD: what is wrong (fix: ...)``. The
fitting is :mod:`servetune.engines.vllm.workload_fit`'s; this module only reads: a URL with a
timeout and a size cap, a file, the time of each reading.

Example::

    servetune workload from-metrics http://10.0.0.5:8000/metrics --wait 60 -o my-traffic.yaml
    servetune workload from-metrics before.txt after.txt --seconds 300
    servetune workload from-trace requests.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from servetune.errors import SpecError
from servetune.engines.vllm.workload_fit import metrics_window, workload_from_metrics, workload_from_trace

__all__ = ["add_parser", "run", "read_source", "URL_TIMEOUT_S", "MAX_BYTES"]

URL_TIMEOUT_S = 5.0
MAX_BYTES = 16 * 1024 * 1024  # a vLLM /metrics page is ~50 KB; a few engines and LoRAs stay far below this


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``workload`` (with ``from-metrics`` and ``from-trace``) on ``parser.add_subparsers()``'s result."""
    from servetune.cli._text import HelpFormatter, examples, summary

    p = subparsers.add_parser("workload", help="write a workload spec from /metrics or a request log",
                              description=summary(__doc__), epilog=examples(__doc__),
                              formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="workload_command", required=True, title="commands", metavar="COMMAND")
    m = sub.add_parser("from-metrics", help="fit a workload to vLLM's /metrics (a URL or saved dumps)",
                       description="Fit prompt and output length distributions to vLLM's per-request histograms, "
                                   "the request rate to the counters' growth between two readings, and the "
                                   "prefix-cache hit share as a shared prefix.")
    m.add_argument("source", help="http(s)://HOST:PORT/metrics or a saved /metrics text file")
    m.add_argument("later", nargs="?", help="a second reading some time later (URL or file): the window between")
    m.add_argument("--wait", type=float, metavar="S", help="read SOURCE twice, S seconds apart (the window)")
    m.add_argument("--seconds", type=float, metavar="S",
                   help="the seconds between the two readings (default: the files' modification times)")
    _common(m)
    t = sub.add_parser("from-trace", help="fit a workload to a request log (JSONL)",
                       description="One JSON object a line with the prompt and output token counts "
                                   "(input_length/prompt_tokens, output_length/output_tokens) and the "
                                   "arrival time in seconds (timestamp/arrival_s).")
    t.add_argument("trace", help="the request log, JSONL")
    _common(t)
    return p


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--out", help="write the YAML here (default: stdout)")
    p.add_argument("--num-requests", type=int, help="requests per trial (default: those observed, 100..2000)")
    p.add_argument("--concurrency", type=int, help="closed-loop concurrency when no rate is known (default 32)")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")


def _is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


def _fetch(url: str, field: str) -> bytes:
    """At most ``MAX_BYTES + 1`` bytes of ``url``, all within ``URL_TIMEOUT_S`` (a slow trickle included)."""
    deadline = time.monotonic() + URL_TIMEOUT_S
    req = urllib.request.Request(url, headers={"Accept": "text/plain"})
    chunks: list[bytes] = []
    size = 0
    try:
        with urllib.request.urlopen(req, timeout=URL_TIMEOUT_S) as resp:
            while size <= MAX_BYTES:
                if time.monotonic() > deadline:
                    raise TimeoutError("timed out")
                chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except urllib.error.HTTPError as exc:
        raise SpecError(field, f"{url} answered HTTP {exc.code}", "give the server's /metrics URL") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc) or type(exc).__name__
        raise SpecError(field, f"cannot read {url} (within {URL_TIMEOUT_S:g} s): {reason}",
                        "check the host, port and that the server is up (vllm serve exposes /metrics)") from None
    return b"".join(chunks)


def read_source(source: str, field: str) -> tuple[str, float]:
    """The text of a URL or a file, and when it was read (a file: its modification time)."""
    if _is_url(source):
        req = urllib.request.Request(source, headers={"Accept": "text/plain"})
        data, when = _fetch(source, field), time.time()
    else:
        if "://" in source:
            raise SpecError(field, f"{source}: only http:// and https:// URLs are read",
                            "give the server's http(s)://HOST:PORT/metrics, or a saved copy")
        from servetune.inputs import read_bytes  # the one bounded reader: regular files only, capped as a log
        path = Path(source)
        data, when = read_bytes(path, "log", field), path.stat().st_mtime
    if len(data) > MAX_BYTES:
        raise SpecError(field, f"{source} sent over {MAX_BYTES // 2**20} MiB: not a /metrics page",
                        "give the server's /metrics URL")
    try:
        return data.decode("utf-8"), when
    except UnicodeDecodeError:
        raise SpecError(field, f"{source} is not text", "give vLLM's /metrics text (Prometheus format)") from None


def _from_metrics(args: argparse.Namespace) -> str:
    if args.wait is not None and (args.later or not _is_url(args.source) or not 0 < args.wait <= 3600):
        raise SpecError("--wait", "takes one URL and 0 < S <= 3600", "e.g. from-metrics http://HOST:8000/metrics --wait 60")
    if args.seconds is not None and args.wait is not None:
        raise SpecError("--seconds", "goes with readings you give, not with --wait (which times its own)",
                        "drop --seconds")
    first, t0 = read_source(args.source, "source")
    earlier, text, seconds, how = None, first, args.seconds, "given with --seconds"
    if args.wait is not None:
        time.sleep(args.wait)
        text, t1 = read_source(args.source, "source")
        earlier, seconds, how = first, t1 - t0, f"read {args.wait:g} s apart"
    elif args.later:
        text, t1 = read_source(args.later, "later")
        earlier = first
        if seconds is None:
            seconds, how = t1 - t0, "between the readings' times (a file: its modification time)"
    elif seconds is not None:
        how = "the server's uptime, given with --seconds"
    # One live reading: its time is now, against the server's process_start_time_seconds.
    read_at = t0 if earlier is None and _is_url(args.source) else None
    window = metrics_window(text, earlier, seconds, how, "source" if earlier is None else "later", read_at)
    names = args.source if args.wait is not None or not args.later else f"{args.source} then {args.later}"
    return workload_from_metrics(window, names, num_requests=args.num_requests, concurrency=args.concurrency,
                                 seed=args.seed)


def _from_trace(args: argparse.Namespace) -> str:
    from servetune.workload import read_jsonl

    path = Path(args.trace)  # read_jsonl streams it through servetune.inputs' caps
    return workload_from_trace(read_jsonl(path), path.name, num_requests=args.num_requests,
                               concurrency=args.concurrency, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    for flag in ("num_requests", "concurrency"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise SpecError(f"--{flag.replace('_', '-')}", f"must be >= 1, got {value}", "give a positive integer")
    text = _from_metrics(args) if args.workload_command == "from-metrics" else _from_trace(args)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
