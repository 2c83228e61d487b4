"""``servetune capacity``: per GPU type and layout, the replicas a request rate needs at the SLO, and the cost.

Contract: :func:`add_parser` registers the sub-command and :func:`run` executes it, returning the
exit code: 0 with the table (or ``--json``), 2 for bad input as one line ``error: FIELD: what is
wrong (fix: ...)`` (an unknown GPU or one without a price, a bad price file, a missing target, a
workload above ``--max-tokens``). The figures are :func:`servetune.cost.capacity_table`'s; each row
says whether the simulator was judged on that GPU, and ``--dataset`` adds what real trials of the
model measured on each GPU type.

Example::

    servetune capacity --model llama-3.1-8b --workload jobs/workloads/poisson-rate.yaml --rate 20 \\
        --slo p99_ttft_ms=1000 --slo p99_itl_ms=100
    servetune capacity --model llama-3.1-8b --workload w.yaml --rate 5 --slo p99_ttft_ms=2000 \\
        --gpu H100-80GB --gpu L40S --tp 1,2,4 --prices my-prices.yaml --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from servetune.backends import capabilities
from servetune.cli._simulate import DEFAULT_MAX_TOKENS, _load_workload, check_work
from servetune.cost import TP_SIZES, CapacityRow, PriceTable, capacity_table, cost_per_mtok, load_prices
from servetune.errors import SpecError, did_you_mean
from servetune.planner.flags import parse_set_option
from servetune.planner.gpus import get_gpu, known_gpus, register_gpus_from_yaml
from servetune.planner.modelinfo import load_model
from servetune.vllm_version import DEFAULT_VLLM_VERSION

__all__ = ["add_parser", "run", "parse_slo", "format_table", "real_trials"]

#: ``--slo`` names: the study spec's constraint names.
SLO_KEYS = ("p99_ttft_ms", "p99_itl_ms", "p99_e2e_ms", "max_preemptions")


def add_parser(subparsers: Any) -> None:
    """Register ``capacity`` on the ``servetune`` subcommand parser."""
    p = subparsers.add_parser(
        "capacity", help="replicas and cost per GPU type at a rate and targets",
        description="Per GPU type and layout (TP size): a replica's highest request rate within the latency "
                    "targets on the simulated engine, the replicas a target rate needs, GPUs, dollars per hour "
                    "and per million good output tokens (only requests that met the targets count).")
    p.add_argument("--model", required=True, help="shipped model name, model dir, config.json or cached HF id")
    p.add_argument("--workload", required=True,
                   help="workload YAML (or a study spec): its lengths are used; its concurrency/request_rate are "
                        "replaced by the rates tried. Examples: jobs/workloads/*.yaml")
    p.add_argument("--rate", type=float, required=True, help="the request rate to serve, requests/s")
    p.add_argument("--slo", action="append", default=[], metavar="TARGET=VALUE",
                   help=f"a target, repeatable: {', '.join(SLO_KEYS)} (milliseconds; max_preemptions a count, "
                        "default 0), e.g. --slo p99_ttft_ms=1000 --slo p99_itl_ms=100")
    p.add_argument("--gpu", action="append", default=[], metavar="GPU",
                   help="a GPU type to size (repeatable; default: every GPU type the price table prices)")
    p.add_argument("--tp", default=None, metavar="1,2,...",
                   help="tensor-parallel sizes to try (default: the smallest of 1,2,4,8 that starts, and the next)")
    p.add_argument("--prices", default=None, metavar="YAML",
                   help="your own price table (default: the shipped one, servetune/data/gpu_prices.yaml)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="FLAG=VALUE",
                   help="a vLLM flag pinned for every layout, e.g. --set kv_cache_dtype=fp8")
    p.add_argument("--dataset", default=None, metavar="DIR",
                   help="a servetune Parquet dataset: its real (vllm backend) trials of this model are shown per GPU")
    p.add_argument("--dataset-model", default=None, metavar="MODEL",
                   help="the model as the dataset's model column names it (default: --model as given), e.g. the "
                        "path a study on a GPU host was given")
    p.add_argument("--gpu-file", default=None, help="YAML file with extra GPU definitions")
    p.add_argument("--vllm-version", default=DEFAULT_VLLM_VERSION, help="vLLM version to mimic")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help="refuse a workload that sends more than N tokens per simulated window")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


def parse_slo(items: Sequence[str]) -> dict[str, float]:
    """``--slo`` values as ``Constraints.limits()`` keys; at least one latency target.

    Example:
        >>> parse_slo(["p99_ttft_ms=1000", "p99_itl_ms=50"])
        {'preemptions': 0.0, 'ttft_p99_ms': 1000.0, 'itl_p99_ms': 50.0}
        >>> parse_slo(["max_preemptions=0"])
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: --slo: no latency target given (fix: add one, e.g. --slo p99_ttft_ms=1000 --slo p99_itl_ms=100)
    """
    from servetune.spec.schema import Constraints

    given: dict[str, float] = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        name = name.strip()
        if not sep or name not in SLO_KEYS:
            raise SpecError("--slo", f"expected TARGET=VALUE with TARGET one of {', '.join(SLO_KEYS)}, got {item!r}"
                            f"{did_you_mean(name, SLO_KEYS)}", "e.g. --slo p99_ttft_ms=1000")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < 0 or (number == 0 and name != "max_preemptions"):
            raise SpecError("--slo", f"{name} must be a positive number, got {value.strip()!r}",
                            f"e.g. --slo {name}={'0' if name == 'max_preemptions' else '1000'}")
        given[name] = number
    if not any(k != "max_preemptions" for k in given):
        raise SpecError("--slo", "no latency target given", "add one, e.g. --slo p99_ttft_ms=1000 --slo p99_itl_ms=100")
    pre = given.pop("max_preemptions", 0.0)
    if pre != int(pre):
        raise SpecError("--slo", f"max_preemptions must be a whole number, got {pre:g}", "e.g. --slo max_preemptions=0")
    return Constraints(max_preemptions=int(pre), **given).limits()


def _gpu_name(text: str) -> str:
    try:
        return get_gpu(text).name
    except SpecError as exc:
        raise SpecError("--gpu", exc.message, exc.fix) from None


def _tp_sizes(text: str | None) -> tuple[tuple[int, ...], int]:
    if text is None:
        return TP_SIZES, 2
    try:
        sizes = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or any(s not in (1, 2, 4, 8, 16) for s in sizes):
        raise SpecError("--tp", f"expected sizes among 1, 2, 4, 8, 16, got {text!r}", "e.g. --tp 1,2,4")
    return sizes, len(sizes)


def real_trials(dataset_dir: str, model: str, prices: PriceTable) -> dict[str, str]:
    """Per GPU type, what the dataset's real (vllm backend) served trials of ``model`` measured: how
    many, and the best one's good output tokens/s (all its output where no goodput was recorded)
    with the cost per million at it."""
    from servetune.records import dataset

    root = Path(dataset_dir)
    if not root.is_dir():
        raise SpecError("--dataset", f"no dataset folder at {root}", "point --dataset at a servetune dataset folder")
    df = dataset.read_trials(root, model=model)
    if df.empty:
        return {}
    df = df[df["backend"].map(lambda b: capabilities(b).real_gpus).astype(bool) & (df["status"] == "ok")]
    out: dict[str, str] = {}
    for gpu, rows in df.groupby("gpu_type"):
        has_good = "goodput_output_throughput" in rows and rows["goodput_output_throughput"].notna().any()
        col = "goodput_output_throughput" if has_good else "output_throughput"
        best = rows.loc[rows[col].astype(float).idxmax()]
        tp_raw = best.get("flag_tensor_parallel_size")
        tp = int(tp_raw) if tp_raw is not None and tp_raw == tp_raw else 1  # NaN: not recorded, vLLM's 1
        price = prices.get(str(gpu))
        cost = None if price is None else cost_per_mtok(price.usd_per_gpu_hour, tp, float(best[col]))
        out[str(gpu)] = (f"{len(rows)} real trial(s); best {float(best[col]):,.0f} "
                         f"{'good ' if has_good else ''}output tok/s (study {best['study']} #{int(best['trial_number'])}, "
                         f"TP {tp}, its own workload)" + ("" if cost is None else f", ${cost:,.3f}/Mtok at it"))
    return out


def format_table(rows: Sequence[CapacityRow], rate: float, limits: Mapping[str, float],
                 real: Mapping[str, str] | None = None) -> str:
    """The human table: one line per GPU type and layout, then what each figure rests on."""
    targets = ", ".join(f"{k.replace('_p99_ms', '')} p99 <= {v:,.0f} ms" for k, v in limits.items() if k != "preemptions")
    lines = [f"capacity for {rate:g} req/s at {targets}, {int(limits.get('preemptions', 0))} preemptions "
             "(simulated vLLM; cheapest per million good output tokens first; $/Mtok: the fleet at this rate, "
             "at capacity: one replica at its highest rate)",
             f"{'gpu':<11}{'tp':>3}{'max_num_seqs':>13}{'req/s/replica':>15}{'good tok/s':>12}{'replicas':>9}"
             f"{'gpus':>6}{'$/hour':>10}{'$/Mtok':>9}{'at capacity':>12}  calibration"]
    for r in rows:
        seqs = r.flags.get("max_num_seqs", "-")
        if r.replicas is None:
            lines.append(f"{r.gpu:<11}{r.tp:>3}{seqs!s:>13}{'-':>15}{'-':>12}{'-':>9}{'-':>6}{'-':>10}{'-':>9}{'-':>12}  "
                         f"{'judged' if r.judged else 'estimate'}: {r.note}")
            continue
        lines.append(f"{r.gpu:<11}{r.tp:>3}{seqs!s:>13}{r.replica_rate:>15,.2f}{r.replica_goodput_tok_s:>12,.0f}"
                     f"{r.replicas:>9,}{r.gpus or 0:>6,}{r.usd_per_hour or 0:>10,.2f}{r.usd_per_mtok or 0:>9,.3f}"
                     f"{r.replica_usd_per_mtok or 0:>12,.3f}  "
                     f"{'judged' if r.judged else 'estimate'}")
    lines.append("evidence:")
    seen: set[str] = set()
    for r in rows:
        if r.gpu in seen:
            continue
        seen.add(r.gpu)
        lines.append(f"  {r.gpu}: {r.evidence}; price {r.price.describe()}")
        if real and r.gpu in real:
            lines.append(f"  {r.gpu}: dataset: {real[r.gpu]}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Execute ``servetune capacity``; 0 with the table, 2 for bad input."""
    try:
        if args.gpu_file:
            register_gpus_from_yaml(args.gpu_file)
        limits = parse_slo(args.slo)
        if not (math.isfinite(args.rate) and args.rate > 0):
            raise SpecError("--rate", f"must be a positive number of requests/s, got {args.rate}", "e.g. --rate 20")
        prices = load_prices(args.prices, "--prices")
        sizes, most = _tp_sizes(args.tp)
        fixed: dict[str, Any] = {}
        for item in args.sets:
            name, value = parse_set_option(item)
            fixed[name] = value
        if "tensor_parallel_size" in fixed:
            raise SpecError("--set", "tensor_parallel_size is what capacity compares", "give --tp 1,2 instead")
        workload = _load_workload(args.workload)
        if workload.trace_file is not None:
            raise SpecError("--workload", "a trace replays its own arrival times, and capacity sets the rate itself",
                            f"turn it into length distributions: servetune workload from-trace {workload.trace_file}")
        check_work(workload, args.max_tokens)
        model = load_model(args.model)
        gpus = [_gpu_name(g) for g in args.gpu] or [g for g in sorted(prices.prices) if g in known_gpus()]
        for g in gpus:
            prices.price(g, "--gpu")  # every GPU priced, before any simulation
        real = real_trials(args.dataset, args.dataset_model or args.model, prices) if args.dataset else None
        rows = capacity_table(model, workload, args.rate, limits, gpus, prices, fixed=fixed,
                              vllm_version=args.vllm_version, tp_sizes=sizes, most_layouts=most)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": model.name, "rate": args.rate, "limits": limits, "prices": prices.path,
                          "rows": [r.to_dict() for r in rows], "real_trials": real or {}}, indent=2))
    else:
        print(format_table(rows, args.rate, limits, real))
    return 0
