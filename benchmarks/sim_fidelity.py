"""Simulator fidelity against real vLLM 0.26.0 on one H200, held out: side-by-side tables.

For every healthy measured window in ``tests/fixtures/real_h200/`` (0.85B, 8B and 14B models; logic
in ``benchmarks/_fidelity.py``): real vs simulated output tok/s, mean TTFT, mean TPOT and
preemptions, with the relative errors.

* no option: the committed calibration (``servetune.sim.perf.GPU_CALIBRATION``) on every run. The
  committed constants were fitted on all of these runs, so this table is a fit, not a fidelity
  figure.
* ``--held-out N``: for each fold (fit on two model sizes, test on the third; fit without the eager
  / fp8 KV / small token budget runs, test on them) search the knobs with N Optuna trials on the
  fitting runs and simulate the held-out runs with them. These are the fidelity figures. ``--fold``
  picks folds; ``--out FILE`` writes the knobs and rows as JSON.
* ``--fit N``: search the knobs on the committed calibration's runs (``_fidelity.load_calibration_runs``:
  every host but ``_fidelity.HELD_OUT_HOSTS``, each at its API-server factor) and print them (to
  paste into ``GPU_CALIBRATION``). ``--kernels`` holds the GPU-kernel knobs at what
  ``_kernels.kernel_knobs`` measures on the GEMM probes and vLLM's profiler traces and searches the
  rest (the CPU, launch and front-end knobs); ``--start FILE`` tries a candidate's knobs second,
  after the committed ones (the committed H200 calibration: ``--fit 36 --kernels --start
  benchmarks/results/sim_kernel_candidate_v2_h200.json``, 2026-12-04).
* ``--fit-fp8``: ``fp8_kv_read_efficiency`` alone (``_fidelity.fit_fp8_kv_read``) on
  ``_fidelity.FP8_FIT_STARTS`` (the ``2026-12-03a`` host's fp8 KV start), every other knob committed.
* ``--fit-eager``: ``eager_layer_overhead_s`` alone (``_fidelity.fit_eager_floor``) on the fitting
  runs that ran ``enforce_eager`` (0.85B and 14B), every other knob committed.
* ``--fit-frontend``: the API server loop's shape and the client's read (``api_chunk_share``,
  ``api_intake_passes``, ``client_chunk_s``; ``_fidelity.fit_frontend``) on a grid, on the fitting
  runs, every other knob committed (48 points: about an hour on two cores).
* ``--replay-folds [--out FILE]``: the recorded folds re-simulated under today's engine, each with
  its recorded knobs and the API-server loop's triple chosen on its own training windows
  (``_fidelity.replay_fold``): for an engine change no knob can undo (2026-12-04: sim/frontend.py).
* ``--grid``: the trials of the real servetune grid studies (``_fidelity.GRID_STUDIES``: the 8B
  grid of 2026-12-02) with the knobs of the fold fitted without any 8B run (recorded in
  ``benchmarks/results/sim_heldout_h200.json``): held-out errors, and whether the simulator ranks
  the grid's best preemption-free flag set first.
* ``--unseen``: the committed calibration on the real runs measured after the folds were fitted
  (``_fidelity.UNSEEN_STUDIES``: the 8B grid's last cell, the confirmed 8B tune, the 14B grid;
  ``_fidelity.UNSEEN_STARTS``: the later hosts' starts), by study or start, each study's ranking,
  and by load shape, split into the runs of ``_fidelity.HELD_OUT_HOSTS`` (never fitted: the
  fidelity figures) and those the committed calibration was fitted on since 2026-12-03 (a fit;
  ``_fidelity.in_calibration_fit``). ``--knobs FILE`` judges a candidate calibration (the file's
  ``knobs`` over the committed ones) the same way, each host at the factor read under it.
* ``--h100``: the real H100 windows (``tests/fixtures/real_h100``, ``_fidelity.h100_check``) on the
  GPU table's H100 row, at API-server factor 1 and at the factor read off the first
  window; the planner's KV capacity against each start's logged KV tokens. The windows split before
  the fit (``_fidelity.H100_FIT_STARTS`` / ``H100_JUDGED_STARTS``): the held-out half before the
  H100's own knob (``servetune.sim.GPU_FAMILY_OVERRIDES``; the H200's value, ``h200_knobs_on``) and
  after, then the fitting half apart (fitting data, not evidence). ``--fit-h100`` refits that knob
  (``_fidelity.fit_h100_kv_read``) and prints it.
* ``--published``: the real vLLM benchmark runs other people published, on GPUs besides the H200
  (``tests/fixtures/published_runs``, ``benchmarks/published_runs.py``): by GPU x layout x load
  shape, held out apart from the fit half, before the per-GPU fits on them and as committed.

Usage::

    .venv/bin/python benchmarks/sim_fidelity.py [--held-out 120 [--fold "size 14B"]] [--fit 120] [--fit-fp8] [--fit-eager] [--fit-frontend] [--fit-h100] [--h100] [--published] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "platform", ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from _fidelity import (FOLDS, H100_CLASSES_FIXTURES, H100_FIXTURES, H200_CLASSES_FIXTURES, fit_moe_floor, H100_GPU, HOST_MODELS, UNSEEN_STARTS, UNSEEN_STUDIES,  # noqa: E402
                       calibration_host_factors, error_summary, fidelity_rows, fit, fit_eager_floor, fit_fp8_kv_read,
                       fit_frontend, fit_h100_kv_read, format_table, h100_check, h200_knobs_on, in_h100_fit, held_out, held_out_cells, host_checks,
                       in_calibration_fit, replay_fold, routes_uniformly, serving_flags,
                       load_calibration_runs, load_evidence, load_h100_runs, load_hybrid_runs, load_study_runs, load_unseen_runs, read_knobs)


def _rows_json(rows):  # type: ignore[no-untyped-def]
    return [{"run": r.name, "size": r.real.size, "shape": r.real.shape, "tags": sorted(r.real.tags),
             "real_output_throughput": r.real.output_throughput, "sim_output_throughput": r.sim_output_throughput,
             "real_ttft_mean_ms": r.real.ttft_mean_ms, "sim_ttft_mean_ms": r.sim_ttft_mean_ms,
             "real_tpot_mean_ms": r.real.tpot_mean_ms, "sim_tpot_mean_ms": r.sim_tpot_mean_ms,
             "real_preemptions": r.real.preemptions, "sim_preemptions": r.sim_preemptions} for r in rows]


def _by_shape(rows):  # type: ignore[no-untyped-def]
    out = {}
    for shape in ("prefill", "decode"):
        group = [r for r in rows if r.real.shape == shape]
        if group:
            out[shape] = error_summary(group)
    return out


def grid_ranking(rows) -> str:  # type: ignore[no-untyped-def]
    """Which flag set each side calls best among the preemption-free ones (repeats averaged)."""
    def best(side: str) -> tuple[str, float]:
        cells: dict[str, list[float]] = {}
        for r in rows:
            clean = (r.real.preemptions if side == "real" else r.sim_preemptions) == 0
            if clean:
                key = json.dumps({k: r.real.flags[k] for k in sorted(r.real.flags)})
                cells.setdefault(key, []).append(r.real.output_throughput if side == "real"
                                                 else r.sim_output_throughput)
        key = max(cells, key=lambda k: sum(cells[k]) / len(cells[k]))
        return key, sum(cells[key]) / len(cells[key])
    (real_key, real_tps), (sim_key, sim_tps) = best("real"), best("sim")
    verdict = "the same flag set" if real_key == sim_key else "DIFFERENT flag sets"
    return (f"best preemption-free: real {real_key} ({real_tps:,.0f} tok/s); simulated {sim_key} "
            f"({sim_tps:,.0f} tok/s): {verdict}")


def _windows_report(rows: list[Any], as_json: bool) -> int:
    """Real windows against the simulator: the table and each start's errors, or (``as_json``) the same as JSON."""
    # A row is named <start>/<window>, or <start> alone where a start served one window (the hybrid benches).
    starts = {start: error_summary([r for r in rows if r.name.split("/")[0] == start])
              for start in sorted({r.name.split("/")[0] for r in rows})}
    if as_json:
        print(json.dumps({"rows": _rows_json(rows), "errors": error_summary(rows), "by_start": starts}, indent=1))
        return 0
    print(format_table(rows))
    for start, e in starts.items():
        print(f"  {start}: throughput {100 * e['throughput_mae']:.1f}%, TPOT {100 * e['tpot_mae']:.1f}%, "
              f"TTFT {100 * e['ttft_mae']:.1f}% ({e['runs']:.0f} windows)")
    uniform = [r for r in rows if routes_uniformly(r.name)]
    if 0 < len(uniform) < len(rows):
        e = error_summary(uniform)
        print(f"without the windows of random-weight FP8 experts routed to few experts (_fidelity.FEW_EXPERTS_STARTS): "
              f"throughput {100 * e['throughput_mae']:.1f}%, TPOT {100 * e['tpot_mae']:.1f}%, "
              f"TTFT {100 * e['ttft_mae']:.1f}% ({len(uniform)} windows)")
    return 0


def h100_report() -> None:
    """``--h100``: the planner's KV capacity per start, then the simulator at factor 1 and at the
    factor read off the first window, each half of the split apart, before the H100's own knob and after."""
    import gzip

    from servetune.engines.vllm.logs import parse_log
    from servetune.planner.gpus import get_gpu
    from servetune.planner.memory import plan_memory, resolve_engine_config
    from servetune.planner.modelinfo import load_model

    gpu = get_gpu(H100_GPU)
    print(f"planner KV capacity on {H100_GPU} against each start's log:")
    for start in sorted(H100_FIXTURES.glob("*/server.log.gz")):
        summary = json.loads((start.parent / "summary.json").read_text())
        log = parse_log(gzip.decompress(start.read_bytes()).decode())
        model = load_model(HOST_MODELS[summary["model"]])
        config = resolve_engine_config(serving_flags(summary["flags"]), model, gpu)
        plan = plan_memory(model, gpu, config, compile_cache_warm=bool(log.compile_cache_hit))
        print(f"  {start.parent.name}: logged {log.kv_cache_tokens:,} tokens, planned {plan.kv_cache_tokens:,} "
              f"({100 * (plan.kv_cache_tokens / log.kv_cache_tokens - 1):+.2f}%)")
    before, after = h100_check(calibration=h200_knobs_on(H100_GPU)), h100_check()
    for label, check in (("with the H200's knobs (before the H100's own)", before),
                         ("with the H100's own knobs (GPU_FAMILY_OVERRIDES)", after)):
        for half, fitted in (("held out", False), ("FITTING DATA, not evidence", True)):
            plain = [r for r in check.plain if in_h100_fit(r.name) is fitted]
            print(f"\n{label}, {half}, API-server factor 1:")
            print(format_table(plain))
            factored = [r for r in check.with_factor if in_h100_fit(r.name) is fitted]
            print(f"\n{label}, {half}, at the factor {check.api_cpu_factor:.2f} read off {check.calibrating_window}:")
            print(format_table(factored))


def _parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", type=int, metavar="TRIALS", help="search the knobs on every run first")
    parser.add_argument("--knobs", type=Path, metavar="FILE",
                        help="with --unseen: judge these knobs (a JSON file's 'knobs', over the committed "
                             "calibration) in place of the committed ones")
    parser.add_argument("--kernels", action="store_true",
                        help="with --fit: hold the GPU-kernel knobs at what _kernels.kernel_knobs measures "
                             "(the GEMM probe, vLLM's profiler traces) and search the rest")
    parser.add_argument("--start", type=Path, metavar="FILE",
                        help="with --fit: try this candidate's knobs (a JSON file's 'knobs') second, after the "
                             "committed ones")
    parser.add_argument("--fit-fp8", action="store_true", help="fit fp8_kv_read_efficiency alone and print it")
    parser.add_argument("--fit-eager", action="store_true", help="fit eager_layer_overhead_s alone and print it")
    parser.add_argument("--fit-h100", action="store_true",
                        help="fit the H100's kv_read_efficiency alone on its fitting starts and print it")
    parser.add_argument("--fit-frontend", action="store_true",
                        help="choose api_chunk_share, api_intake_passes and client_chunk_s on a grid")
    parser.add_argument("--held-out", type=int, metavar="TRIALS", help="fit per fold, report the held-out runs")
    parser.add_argument("--grid", action="store_true", help="the 8B fold's knobs on the real grid studies' trials")
    parser.add_argument("--unseen", action="store_true",
                        help="the committed calibration on the studies measured after it was fitted")
    parser.add_argument("--h100", action="store_true",
                        help="the real H100 windows on the GPU table's H100 row, and the planner's KV capacity there")
    parser.add_argument("--h100-classes", action="store_true",
                        help="the real H100 windows of the model-class starts (Qwen3-MoE, Mixtral-16L, gemma-2, FP8; "
                             "in no fit but the MoE floor's start), per start")
    parser.add_argument("--h200-classes", action="store_true",
                        help="the real H200 windows of the model-class starts (Qwen3-MoE bf16 and FP8, gpt-oss-20b; "
                             "in no fit), per start")
    parser.add_argument("--hybrid", action="store_true",
                        help="the real H100 vllm bench serve windows of the hybrid starts (granite-4.0-h-tiny, "
                             "Nemotron-H-8B, the Qwen3-Next 12-layer and Qwen3.5-35B-A3B 20-layer shapes; in no fit)")
    parser.add_argument("--fit-moe-floor", action="store_true",
                        help="fit moe_layer_floor_s alone on the real H100 FP8 MoE start and print it")
    parser.add_argument("--replay-folds", action="store_true",
                        help="re-simulate the recorded folds under today's engine (API-server loop per fold)")
    parser.add_argument("--published", action="store_true",
                        help="the published runs on other GPUs (benchmarks/published_runs.py --compare)")
    parser.add_argument("--fold", action="append", choices=sorted(FOLDS), help="only these folds (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the result as JSON to this file")
    parser.add_argument("--json", action="store_true", help="print rows and errors as JSON")
    return parser


def _held_out_report(args: argparse.Namespace, t0: float) -> int:
    """``--held-out TRIALS``: fit per fold, print the held-out runs, merge them into ``--out``."""
    folds = {k: v for k, v in FOLDS.items() if not args.fold or k in args.fold}
    result = {}
    for name, (knobs, rows) in held_out(args.held_out, args.seed, folds=folds).items():
        print(f"\n== held out: {name} (fitted on the other runs, {args.held_out} trials)")
        print("knobs:", json.dumps({k: float(f"{v:.4g}") for k, v in knobs.items()}))
        print(format_table(rows))
        for shape, e in _by_shape(rows).items():
            print(f"  {shape}-heavy: throughput {100 * e['throughput_mae']:.1f}%, TPOT {100 * e['tpot_mae']:.1f}%, "
                  f"TTFT {100 * e['ttft_mae']:.1f}% ({e['runs']:.0f} runs)")
        tested = {r.name for r in rows}
        result[name] = {"knobs": knobs, "fitted_on": [r.name for r in load_evidence() if r.name not in tested],
                        "rows": _rows_json(rows), "errors": error_summary(rows), "by_shape": _by_shape(rows)}
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if args.out:
        # Merge into an existing file: folds are fitted in separate processes (one per core).
        old = json.loads(args.out.read_text()) if args.out.exists() else {"folds": {}}
        old["folds"].update(result)
        old.update(trials=args.held_out, seed=args.seed)
        args.out.write_text(json.dumps(old, indent=1))
    return 0


def _replay_folds_report(args: argparse.Namespace, t0: float) -> int:
    """``--replay-folds``: the recorded folds re-simulated under today's engine."""
    # Re-simulate the recorded folds under today's engine: each fold's knobs as fitted, its
    # API-server loop triple chosen on its own training windows (_fidelity.replay_fold).
    path = ROOT / "benchmarks" / "results" / "sim_heldout_h200.json"
    recorded = json.loads(path.read_text())
    evidence = load_evidence()
    for name, fold in recorded["folds"].items():
        if args.fold and name not in args.fold:
            continue
        fitted_on = set(fold["fitted_on"])
        train = [r for r in evidence if r.name in fitted_on]
        test = [r for r in evidence if FOLDS[name](r)]
        knobs, rows = replay_fold(fold["knobs"], train, test)
        print(f"\n== replayed: {name}: api_chunk_share {knobs['api_chunk_share']}, "
              f"api_intake_passes {knobs['api_intake_passes']:g}, client_chunk_s {knobs['client_chunk_s']:g}")
        print(format_table(rows))
        fold.update(knobs=knobs, rows=_rows_json(rows), errors=error_summary(rows), by_shape=_by_shape(rows))
    if args.out:
        args.out.write_text(json.dumps(recorded, indent=1))
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


def _unseen_report(args: argparse.Namespace) -> int:
    """``--unseen``: the committed (or ``--knobs``) calibration on the studies measured after it was fitted."""
    candidate = None
    if args.knobs:
        candidate = read_knobs("--knobs", args.knobs)
        if candidate is None:
            return 2
    rows = fidelity_rows(candidate, load_unseen_runs())
    print(format_table(rows))
    for folder in (*UNSEEN_STUDIES, *(f"scale/{start}" for start in UNSEEN_STARTS)):
        group = [r for r in rows if r.real.name.startswith(folder + "/")]
        if not group:
            continue  # a start whose windows were all profiled (2026-12-04e_l8b_u09_s256_eager)
        e = error_summary(group)
        mark = "in the committed fit" if all(in_calibration_fit(r.name) for r in group) else "never fitted"
        print(f"  {folder} ({mark}): throughput {100 * e['throughput_mae']:.1f}%, TPOT {100 * e['tpot_mae']:.1f}%, "
              f"TTFT {100 * e['ttft_mae']:.1f}% ({e['runs']:.0f} runs)")
        if folder in UNSEEN_STUDIES and len(group) > 1:
            print("  " + grid_ranking(group))
    # Only the never-fitted rows are fidelity figures; the others are the fit's own.
    for label, group in (("never fitted (held-out hosts)", [r for r in rows if not in_calibration_fit(r.name)]),
                         ("in the committed fit (not a fidelity figure)",
                          [r for r in rows if in_calibration_fit(r.name)])):
        print(f"  {label}:")
        for shape, e in _by_shape(group).items():
            print(f"    {shape}-heavy: throughput {100 * e['throughput_mae']:.1f}%, TPOT {100 * e['tpot_mae']:.1f}%, "
                  f"TTFT {100 * e['ttft_mae']:.1f}% ({e['runs']:.0f} runs)")
    checks = host_checks(calibration=candidate)
    print("\nheld out, per size and load shape (each held-out host at its factor; never-fitted windows):")
    for cell, group in held_out_cells(checks).items():
        e = error_summary(group)
        print(f"  {cell:<22} {e['runs']:3.0f} windows: throughput {100 * e['throughput_mae']:.1f}% "
              f"(max {100 * e['throughput_max']:.1f}%), TPOT {100 * e['tpot_mae']:.1f}%, "
              f"TTFT {100 * e['ttft_mae']:.1f}%, preempting or not right on {e['preemption_class_agree']:.0%}")
    print("\nthe host's API-server CPU factor, read off one window per host, on the host's other windows:")
    for check in checks:
        print(f"  {check.host}: factor {check.api_cpu_factor:.2f} from {check.calibrating_window}")
        plain = "committed calibration" if candidate is None else "candidate calibration"
        for label, group in ((plain, check.plain), ("with the host factor", check.with_factor)):
            for shape, e in {"all": error_summary(group), **_by_shape(group)}.items():
                print(f"    {label:<22} {shape:>8}: throughput {100 * e['throughput_mae']:.1f}% "
                      f"(max {100 * e['throughput_max']:.1f}%), TPOT {100 * e['tpot_mae']:.1f}%, "
                      f"TTFT {100 * e['ttft_mae']:.1f}% ({e['runs']:.0f} runs)")
    return 0


def _fit_and_report(args: argparse.Namespace) -> int:
    """The default mode: the committed knobs (or, with ``--fit N``, knobs searched first) on every run."""
    knobs = None
    if args.fit:
        # The committed calibration's runs: every host but the held-out ones, each at its own factor.
        started = time.time()

        def progress(study, trial) -> None:  # a fit runs for tens of minutes: say where it is
            print(f"trial {trial.number}: loss {trial.value:.4f}, best {study.best_value:.4f} "
                  f"({time.time() - started:.0f} s)", file=sys.stderr, flush=True)

        starts = []
        if args.start:
            start = read_knobs("--start", args.start)
            if start is None:
                return 2
            starts.append(start)
        fixed = None
        if args.kernels:
            from _kernels import kernel_knobs

            fixed = kernel_knobs()
            print("kernel-measured knobs (held fixed):", json.dumps(fixed), file=sys.stderr, flush=True)
        knobs = fit(args.fit, args.seed, load_calibration_runs(), starts=starts,
                    host_factors=calibration_host_factors(), callbacks=[progress], fixed=fixed)
        print("fitted knobs:", json.dumps({k: float(f"{v:.4g}") for k, v in knobs.items()}, indent=1))
    rows = fidelity_rows(knobs)
    if args.json or args.out:
        doc = {"knobs": knobs, "rows": _rows_json(rows), "errors": error_summary(rows)}
        if args.out:
            args.out.write_text(json.dumps(doc, indent=1))
        if args.json:
            print(json.dumps(doc, indent=1))
    if not args.json:
        print(format_table(rows))
    return 0



def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name, given, needs, mode in (("--knobs", args.knobs, args.unseen, "--unseen"),
                                     ("--kernels", args.kernels, args.fit, "--fit N"),
                                     ("--start", args.start, args.fit, "--fit N")):
        if given and not needs:  # before any simulation: an option its mode would silently ignore
            print(f"{name} works with {mode} only: add {mode}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    if args.published:
        import published_runs

        return published_runs.main(["--compare", *(["--json"] if args.json else [])])
    if args.h100:
        if args.json:  # a report of several tables and the planner's lines: text only
            print("--json does not go with --h100 (a text report): leave --json out", file=sys.stderr)
            return 2
        h100_report()
        return 0
    if args.hybrid:
        return _windows_report(fidelity_rows(None, load_hybrid_runs(), gpu=H100_GPU), args.json)
    if args.h100_classes or args.h200_classes:
        rows = fidelity_rows(None, load_h100_runs(H100_CLASSES_FIXTURES), gpu=H100_GPU) if args.h100_classes \
            else fidelity_rows(None, load_h100_runs(H200_CLASSES_FIXTURES), gpu="H200")
        return _windows_report(rows, args.json)
    if args.fit_moe_floor:
        print(json.dumps({"moe_layer_floor_s": float(f"{fit_moe_floor():.3g}")}))
        return 0
    if args.fit_h100:
        print(json.dumps({"kv_read_efficiency": float(f"{fit_h100_kv_read():.4g}")}))
        return 0
    if args.held_out:
        return _held_out_report(args, t0)
    if args.replay_folds:
        return _replay_folds_report(args, t0)
    if args.grid:
        recorded = json.loads((ROOT / "benchmarks" / "results" / "sim_heldout_h200.json").read_text())
        rows = fidelity_rows(recorded["folds"]["size 8B"]["knobs"], load_study_runs())
        print(format_table(rows))
        print(grid_ranking(rows))
        return 0
    if args.unseen:
        return _unseen_report(args)
    if args.fit_fp8:
        print("fitted knobs:", json.dumps({"fp8_kv_read_efficiency": float(f"{fit_fp8_kv_read():.4g}")}))
        return 0
    if args.fit_eager:
        print("fitted knobs:", json.dumps({"eager_layer_overhead_s": float(f"{fit_eager_floor():.4g}")}))
        return 0
    if args.fit_frontend:
        best, losses = fit_frontend()
        for (share, passes, client), value in sorted(losses.items()):
            print(f"  api_chunk_share {share:.2f}  api_intake_passes {passes}  client_chunk_s {client:.0e}: "
                  f"loss {value:.4f}")
        print("fitted knobs:", json.dumps({"api_chunk_share": best[0], "api_intake_passes": best[1],
                                           "client_chunk_s": best[2]}))
        return 0
    return _fit_and_report(args)

if __name__ == "__main__":
    raise SystemExit(main())
