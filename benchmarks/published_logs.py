"""The planner on vLLM startups that people published: the held-out KV-capacity error, by GPU and layout.

Reads ``tests/fixtures/published_logs/index.yaml`` (see its SOURCES.md), plans every start with
the product's planner (:mod:`servetune.planner.evidence`), refits the constants named as fitted
on the ``fit`` starts, and prints the error on the ``held_out`` starts (never on the fit ones as
accuracy). ``--json`` prints the same as JSON; ``benchmarks/results/published_logs_heldout.json``
is that output (the tests re-derive it).

    .venv/bin/python benchmarks/published_logs.py
    .venv/bin/python benchmarks/published_logs.py --json > benchmarks/results/published_logs_heldout.json

``--classes`` does the same for ``classes.yaml`` (MoE, MXFP4, quantized checkpoints, fp8 KV,
sliding-window hybrids, MLA) and prints the held-out table by class, GPU and layout;
``benchmarks/results/published_logs_classes.json`` is its ``--json`` output.

    .venv/bin/python benchmarks/published_logs.py --classes

``--hybrid`` does the same for ``hybrid.yaml`` (Mamba2 and gated-delta-net hybrids, every start held out): the
same output shape as ``--classes``, and a start whose model or flags the planner refuses is counted and named
under ``held_out.refused`` with the planner's one line, never dropped;
``benchmarks/results/published_logs_hybrid.json`` is its ``--json`` output.

    .venv/bin/python benchmarks/published_logs.py --hybrid --json > benchmarks/results/published_logs_hybrid.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from servetune.errors import SpecError
from servetune.planner import comm, memory
from servetune.planner import modelclass
from servetune.planner.engine_config import resolve_engine_config
from servetune.planner.evidence import (Judgement, class_table, fit_class_constants, fit_constants, judge, load_index,
                                        parse_index, summarize)
from servetune.planner.gpus import get_gpu
from servetune.planner.modelinfo import load_model

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "tests" / "fixtures" / "published_logs" / "index.yaml"
CLASSES = ROOT / "tests" / "fixtures" / "published_logs" / "classes.yaml"
HYBRID = ROOT / "tests" / "fixtures" / "published_logs" / "hybrid.yaml"


def _start_row(j: Judgement) -> dict:
    """One judged start as the class and hybrid reports print it."""
    return {"id": j.start.id, "class": j.start.kind, "role": j.start.role, "gpu": j.start.gpu,
            "layout": j.start.layout, "vllm": j.start.vllm, "logged": j.start.logged.get("status"),
            "predicted": "fits" if j.fits else j.failure, "kv_tokens": j.kv_tokens,
            "logged_kv_tokens": j.logged_kv_tokens,
            "kv_error_pct": None if j.kv_error is None else round(100 * j.kv_error, 2)}


def hybrid_report(index: Path = HYBRID) -> dict:
    """The hybrid.yaml report: every start planned as ``plan`` would, the held-out table by class, GPU and layout.

    A start whose model config or flags the planner refuses (SpecError) is kept: counted in ``held_out.refused``
    with the planner's one line and listed in ``per_start`` as ``predicted: refused``. For a start vLLM refused,
    ``cause`` is the planner's failure text (vLLM's own words where it has them). Nothing is fitted: every
    hybrid start is held out.
    """
    starts = parse_index(yaml.safe_load(index.read_text(encoding="utf-8")), index.parent)
    judged: list[Judgement] = []
    rows: list[dict] = []
    refused: list[dict] = []
    for s in starts:
        try:
            model = load_model(s.model if "/" not in s.model else str(index.parent / s.model))
            resolve_engine_config(s.flags, model, get_gpu(s.gpu), s.vllm)  # the flags' refusal, as plan's
            j = judge(s, model)
        except SpecError as err:
            reason = f"{err.field}: {err.message}"
            refused.append({"id": s.id, "class": s.kind, "gpu": s.gpu, "vllm": s.vllm, "reason": reason})
            rows.append({"id": s.id, "class": s.kind, "role": s.role, "gpu": s.gpu, "layout": s.layout,
                         "vllm": s.vllm, "logged": s.logged.get("status"), "predicted": "refused",
                         "kv_tokens": None, "logged_kv_tokens": s.logged.get("kv_tokens"), "kv_error_pct": None,
                         "reason": reason})
            continue
        judged.append(j)
        row = _start_row(j)
        row["weights_gib"] = round(j.weights_gib, 3)
        row["logged_weights_gib"] = s.logged.get("weights")
        if j.start.failed:
            row["cause"] = j.cause
        rows.append(row)
    held = class_table(judged, "held_out")
    held["starts_in_file"] = len(starts)
    held["refused"] = refused
    return {"index": "tests/fixtures/published_logs/hybrid.yaml", "held_out": held, "per_start": rows}


def class_report() -> dict:
    """The classes.yaml report: constants in code and refit, the held-out table, every start."""
    starts, models = load_index(CLASSES)
    judgements = [judge(s, models[s.id]) for s in starts]
    constants = {"MXFP4_LAYER_BYTES": modelclass.MXFP4_LAYER_BYTES,
                 "MULTIMODAL_PROFILE_ELEMS_PER_TOKEN": modelclass.MULTIMODAL_PROFILE_ELEMS_PER_TOKEN}
    return {"constants_in_code": constants, "constants_refit": fit_class_constants(starts, models),
            "held_out": class_table(judgements, "held_out"),
            "per_start": [_start_row(j) for j in judgements]}


def print_class_report(report: dict) -> None:
    """The class or hybrid report as a table (the hybrid one has no constants and lists its refused starts)."""
    if "constants_in_code" in report:
        print(f"constants in code : {report['constants_in_code']}")
        print(f"refit on fit set  : {report['constants_refit']}")
    print(f"{'start':<42}{'class':<16}{'role':<10}{'gpu':<11}{'layout':<8}{'vllm':<8}{'logged':<8}"
          f"{'predicted':<14}{'kv tokens':>11}{'logged':>11}{'error':>9}")
    for row in report["per_start"]:
        err = "" if row["kv_error_pct"] is None else f"{row['kv_error_pct']:+.2f}%"
        logged = "" if row["logged_kv_tokens"] is None else f"{row['logged_kv_tokens']:,}"
        planned = "-" if row["kv_tokens"] is None else f"{row['kv_tokens']:,}"
        print(f"{row['id']:<42}{row['class']:<16}{row['role']:<10}{row['gpu']:<11}{row['layout']:<8}{row['vllm']:<8}"
              f"{row['logged']:<8}{row['predicted']:<14}{planned:>11}{logged:>11}{err:>9}")
    h = report["held_out"]
    for r in h.get("refused", []):
        print(f"refused (not planned): {r['id']}: {r['reason']}")
    if "starts_in_file" in h:
        print(f"in the file: {h['starts_in_file']} starts, {len(h['refused'])} refused by the planner, {h['starts']} planned")
    print(f"held out: {h['starts']} starts ({h['healthy']} healthy, {h['failed']} failed); KV within 3%: "
          f"{h['within_3pct']}/{h['judged']}; failed starts foreseen: {h['failed_foreseen']}/{h['failed']}")
    print(f"{'class':<16}{'gpu':<11}{'layout':<8}{'n':>3}  KV error (%)  failed foreseen")
    for r in h["rows"]:
        errs = ", ".join(f"{e:+.2f}" for e in r["kv_errors_pct"]) or "-"
        failed = f"{r['failed_foreseen']}/{r['failed']}" if r["failed"] else "-"
        print(f"{r['class']:<16}{r['gpu']:<11}{r['layout']:<8}{r['n']:>3}  {errs:<13} {failed}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--classes", action="store_true", help="classes.yaml: MoE, MXFP4, quantized, hybrid, MLA starts")
    ap.add_argument("--hybrid", action="store_true", help="hybrid.yaml: Mamba2 and gated-delta-net hybrid starts")
    args = ap.parse_args(argv)
    if args.classes or args.hybrid:
        report = hybrid_report() if args.hybrid else class_report()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print_class_report(report)
        return 0
    starts, models = load_index(INDEX)
    judgements = [judge(s, models[s.id]) for s in starts]
    constants = {"SAMPLER_BYTES_PER_LOGIT_V1": memory.SAMPLER_BYTES_PER_LOGIT_V1,
                 "NON_TORCH_GIB_SINGLE_V1": comm.NON_TORCH_GIB_SINGLE_V1,
                 "NON_TORCH_GIB_MULTI_V1": comm.NON_TORCH_GIB_MULTI_V1}
    report = {"constants_in_code": constants, "constants_refit": fit_constants(starts, models),
              "held_out": summarize(judgements, "held_out"),
              "per_start": [{"id": j.start.id, "role": j.start.role, "gpu": j.start.gpu, "layout": j.start.layout,
                             "vllm": j.start.vllm, "logged": j.start.logged.get("status"),
                             "predicted": "fits" if j.fits else j.failure,
                             "kv_tokens": j.kv_tokens, "logged_kv_tokens": j.logged_kv_tokens,
                             "kv_error_pct": None if j.kv_error is None else round(100 * j.kv_error, 2)}
                            for j in judgements]}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"constants in code : {constants}")
    print(f"refit on fit set  : {report['constants_refit']}")
    print(f"{'start':<28}{'role':<10}{'gpu':<11}{'layout':<8}{'logged':<8}{'predicted':<14}"
          f"{'kv tokens':>11}{'logged':>11}{'error':>9}")
    for row in report["per_start"]:
        err = "" if row["kv_error_pct"] is None else f"{row['kv_error_pct']:+.2f}%"
        logged = "" if row["logged_kv_tokens"] is None else f"{row['logged_kv_tokens']:,}"
        print(f"{row['id']:<28}{row['role']:<10}{row['gpu']:<11}{row['layout']:<8}{row['logged']:<8}"
              f"{row['predicted']:<14}{row['kv_tokens']:>11,}{logged:>11}{err:>9}")
    h = report["held_out"]
    print(f"held out: {h['starts']} starts ({h['healthy']} healthy, {h['failed']} failed); KV within 2%: "
          f"{h['within_2pct']}/{len(h['kv_errors_pct'])}; failed starts foreseen: {h['failed_foreseen']}/{h['failed']}; "
          f"refused starts called a fit: {h['refused_called_fit'] or 'none'}")
    for key in ("by_gpu", "by_layout", "by_vllm"):
        print(f"{key}: " + "; ".join(f"{k}: n={v['n']} errors {v['errors']}" for k, v in h[key].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
