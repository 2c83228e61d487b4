"""``servetune``: tune | best | report | plan | simulate | diagnose.

Every command validates its input before any trial starts; bad input prints ``error: FIELD: what
is wrong (fix: ...)`` on stderr and exits with code 2.

Example::

    servetune tune jobs/quickstart.yaml
    servetune best quickstart --format cmd
    servetune plan --model llama-3.1-8b --gpu L40S --set gpu_memory_utilization=0.9 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from servetune.errors import SpecError

__all__ = ["main", "build_parser"]

DEFAULT_RUNS_DIR = "servetune-runs"


def build_parser() -> argparse.ArgumentParser:
    from servetune.cli import _diagnose as _cli_diagnose
    from servetune.cli import _plan as _cli_plan
    from servetune.cli import _simulate as _cli_simulate

    parser = argparse.ArgumentParser(prog="servetune", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    tune = sub.add_parser("tune", help="run (or resume) a tuning study from a spec file")
    tune.add_argument("spec", help="the study spec (YAML), e.g. jobs/quickstart.yaml")
    tune.add_argument("--backend", choices=("auto", "sim", "vllm"), help="override the spec's backend")
    tune.add_argument("--trials", type=int, help="override budget.trials")
    tune.add_argument("--parallel", type=int, help="override budget.parallel")
    tune.add_argument("--resume", action="store_true", help="continue a study of the same name")

    best = sub.add_parser("best", help="print the best preemption-free configuration of a study")
    best.add_argument("study", help="the spec file or the study name")
    best.add_argument("--format", choices=("cmd", "yaml", "json"), default="cmd")
    best.add_argument("--storage", help=f"Optuna storage URL (default: sqlite:///{DEFAULT_RUNS_DIR}/optuna.db)")

    rep = sub.add_parser("report", help="write a report (Markdown + plots) from the Parquet dataset")
    rep.add_argument("--study", help="only this study")
    rep.add_argument("--out", default=f"{DEFAULT_RUNS_DIR}/report.md", help="the report file to write")
    rep.add_argument("--dataset", default=f"{DEFAULT_RUNS_DIR}/dataset", help="the Parquet dataset folder")

    _cli_plan.add_parser(sub)
    _cli_simulate.add_parser(sub)
    _cli_diagnose.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "tune":
            return _tune(args)
        if args.command == "best":
            return _best(args)
        if args.command == "report":
            return _report(args)
        if args.command == "plan":
            from servetune.cli import _plan as _cli_plan

            return _cli_plan.run(args)
        if args.command == "simulate":
            from servetune.cli import _simulate as _cli_simulate

            return _cli_simulate.run(args)
        if args.command == "diagnose":
            from servetune.cli import _diagnose as _cli_diagnose

            return _cli_diagnose.run(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 2


def _tune(args: argparse.Namespace) -> int:
    from servetune.spec.schema import load_spec
    from servetune.study import run_study

    spec = load_spec(args.spec)
    spec = spec.with_overrides(backend=args.backend, trials=args.trials, parallel=args.parallel)
    outcome = run_study(spec, resume=args.resume)
    print(f"\nservetune: {outcome.trials_done} trials in {outcome.wall_s:.1f} s: {outcome.ok} served "
          f"({outcome.preempting} of them preempted), {outcome.startup_failed} failed at startup, "
          f"{outcome.pruned} pruned before launch (predicted startup failures), "
          f"{outcome.other_failed} other failures"
          + (f", {outcome.infra_failed} infrastructure failures (told FAIL, not learnt)" if outcome.infra_failed else "")
          + (f"; {outcome.infra_retried} re-run after an infrastructure failure" if outcome.infra_retried else ""))
    if outcome.best_flags is None:
        print("servetune: no trial met the constraints; widen the search space or relax the constraints")
        return 1
    m = outcome.best_metrics or {}
    print(f"servetune: best trial #{outcome.best_number}: {m.get('output_throughput', 0):,.0f} output tok/s, "
          f"p99 TTFT {m.get('ttft_p99_ms', float('nan')):,.0f} ms, p99 ITL {m.get('itl_p99_ms', float('nan')):,.1f} ms, "
          f"{int(m.get('preemptions', 0))} preemptions")
    print(f"servetune: run it with:\n  {outcome.best_command}")
    print(f"servetune: compare trials in MLflow: mlflow ui --backend-store-uri {outcome.mlflow_uri}")
    return 0


def _best(args: argparse.Namespace) -> int:
    import optuna

    from servetune.records._storage import open_storage
    from servetune.planner.flags import to_command_line, to_config_yaml
    from servetune.study import best_trial

    name, storage, model = args.study, args.storage, None
    if Path(args.study).suffix in (".yaml", ".yml") or Path(args.study).is_file():
        from servetune.spec.schema import load_spec

        spec = load_spec(args.study)
        name, storage, model = spec.name, storage or spec.storage.optuna_url, spec.serve_model
    storage = storage or f"sqlite:///{DEFAULT_RUNS_DIR}/optuna.db"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=name, storage=open_storage(storage))
    except KeyError:
        known = optuna.get_all_study_names(storage) if storage else []
        raise SpecError("study", f"no study named {name!r} in {storage}",
                        f"known studies: {', '.join(known) or 'none'}; or pass the spec file") from None
    best = best_trial(study)
    if best is None:
        print(f"error: study {name!r} has no trial that met its constraints", file=sys.stderr)
        return 1
    flags: dict[str, Any] = dict(best.user_attrs.get("flags", best.params))
    model = model or str(study.user_attrs.get("serve_model") or study.user_attrs.get("model", "MODEL"))
    if args.format == "json":
        print(json.dumps(flags, indent=2, sort_keys=True))
    elif args.format == "yaml":
        print(to_config_yaml(model, flags), end="")
    else:
        print(to_command_line(model, flags))
    return 0


def _report(args: argparse.Namespace) -> int:
    from servetune.records import dataset
    from servetune.records import report

    filters = {"study": args.study} if args.study else {}
    df = dataset.read_trials(Path(args.dataset), **filters)
    if df.empty:
        raise SpecError("--dataset", f"no trials found in {args.dataset}" + (f" for study {args.study!r}" if args.study else ""),
                        "run `servetune tune` first, or point --dataset at the dataset folder")
    path = report.write_report(df, Path(args.out), title=f"servetune report: {args.study or 'all studies'}")
    print(f"servetune: wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

