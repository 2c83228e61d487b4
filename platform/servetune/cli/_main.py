"""``servetune``: tune vLLM's serving flags for a model, a GPU type and a workload, and read what a
study found.

Every command validates its input before any trial starts; bad input prints ``error: FIELD: what
is wrong (fix: ...)`` on stderr and exits with code 2. That holds for a missing or unreadable file
(a folder given for a file, bytes that are not UTF-8, a path through a file), a missing or damaged
store (no Optuna database where ``best`` looks, a file that is not SQLite, a damaged Parquet part)
and a file-system refusal while running (``OSError``): one line naming what is missing and the fix,
never a traceback (``SERVETUNE_DEBUG=1`` re-raises for a developer). A reader that closes the pipe
(``servetune diagnose x | head -1``) stops the output, not the work: the rest of the output is
dropped and the command ends with its own exit code.

Example::

    servetune tune jobs/quickstart.yaml
    servetune best quickstart --format cmd
    servetune plan --model llama-3.1-8b --gpu L40S --set gpu_memory_utilization=0.9 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servetune import envs
from servetune.errors import SpecError

if TYPE_CHECKING:  # the planner's import stays out of the CLI's start-up
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["main", "build_parser"]

DEFAULT_RUNS_DIR = "servetune-runs"


def build_parser() -> argparse.ArgumentParser:
    from servetune.cli import _capacity as _cli_capacity
    from servetune.cli import _diagnose as _cli_diagnose
    from servetune.cli import _plan as _cli_plan
    from servetune.cli import _simulate as _cli_simulate
    from servetune.cli import _workload as _cli_workload

    from servetune.cli._text import HelpFormatter, examples, summary

    # The help shows the docstrings' words, not their markup (:mod:`servetune.cli._text`).
    parser = argparse.ArgumentParser(prog="servetune", description=summary(__doc__), epilog=examples(__doc__),
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    tune = sub.add_parser("tune", help="run (or resume) a tuning study from a spec file")
    tune.add_argument("spec", help="the study spec (YAML), e.g. jobs/quickstart.yaml")
    tune.add_argument("--backend", choices=("auto", "sim", "vllm"), help="override the spec's backend")
    tune.add_argument("--trials", type=int, help="override budget.trials")
    tune.add_argument("--parallel", type=int, help="override budget.parallel")
    tune.add_argument("--resume", action="store_true", help="continue a study of the same name")

    best = sub.add_parser("best", help="print a study's best preemption-free flags")
    best.add_argument("study", help="the spec file or the study name")
    best.add_argument("--format", choices=("cmd", "yaml", "json"), default="cmd")
    best.add_argument("--storage", help=f"Optuna storage URL (default: sqlite:///{DEFAULT_RUNS_DIR}/optuna.db)")
    best.add_argument("--headroom", action="store_true",
                      help="also the winner's and the runner-up's headroom: the load and prompt-length scale at which "
                           "each first preempts or breaks a latency target (simulated; the study's end stores it, "
                           "or give the spec file to compute it)")

    rep = sub.add_parser("report", help="write a Markdown report with plots from the dataset")
    rep.add_argument("--study", help="only this study")
    rep.add_argument("--out", default=f"{DEFAULT_RUNS_DIR}/report.md", help="the report file to write")
    rep.add_argument("--dataset", default=f"{DEFAULT_RUNS_DIR}/dataset", help="the Parquet dataset folder")

    _cli_plan.add_parser(sub)
    _cli_simulate.add_parser(sub)
    _cli_capacity.add_parser(sub)
    _cli_diagnose.add_parser(sub)
    _cli_workload.add_parser(sub)
    return parser


class _ClosedPipeSafe:
    """A text stream whose writes survive a reader that went away (``| head -1``).

    On the first ``BrokenPipeError`` the stream's file descriptor is pointed at ``/dev/null``, so
    this write, every later one and the interpreter's final flush succeed and print nothing.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.pipe_closed = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()
            try:
                self._stream.flush()  # the buffered rest now goes to /dev/null
            except (BrokenPipeError, ValueError):
                pass

    def _to_devnull(self) -> None:
        self.pipe_closed = True
        try:
            fd = self._stream.fileno()
        except (AttributeError, OSError, ValueError):
            return  # not a real file (captured in tests): nothing to redirect
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _os_error_text(exc: OSError | UnicodeError) -> str:
    """``cannot read x.yaml: Not a directory`` from an OSError; the file and the reason, one line. A
    connection that failed (an OSError too, with no file) is said as one.

    >>> _os_error_text(ConnectionRefusedError(111, "Connection refused"))
    'a connection failed: Connection refused (fix: check that the server it names is running and reachable from here)'
    >>> _os_error_text(FileNotFoundError(2, "No such file or directory", "x.yaml"))
    'x.yaml: No such file or directory (fix: check that path: it must be a readable file or a writable folder)'
    """
    if isinstance(exc, ConnectionError) and getattr(exc, "filename", None) is None:
        return (f"a connection failed: {exc.strerror or exc} (fix: check that the server it names is running and "
                "reachable from here)")
    if isinstance(exc, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({exc.reason} at byte {exc.start}) (fix: give a UTF-8 text file)"
    if isinstance(exc, UnicodeError):
        return f"{exc} (fix: give UTF-8 text)"
    where = exc.filename if getattr(exc, "filename", None) is not None else "a file"
    why = exc.strerror or str(exc)
    return f"{where}: {why} (fix: check that path: it must be a readable file or a writable folder)"


def _unraisable_but_interrupts(previous: Any) -> Any:
    """A ``sys.unraisablehook`` that keeps quiet about a Ctrl-C landing where Python cannot raise it
    (a weakref callback, a ``__del__``): the study is already stopping on the first one, and the
    command exits 130 all the same; anything else goes to ``previous``."""

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            return
        previous(unraisable)

    return hook


def _interrupted_at_once() -> bool:
    """A second signal stopped a study of this process at once (no study ran: the module is not loaded)."""
    if "servetune.study" not in sys.modules:
        return False
    from servetune.study import interrupted_at_once

    return interrupted_at_once()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    real_out, real_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _ClosedPipeSafe(real_out), _ClosedPipeSafe(real_err)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _unraisable_but_interrupts(previous_hook)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:  # a second Ctrl-C (the first one stops a study at its next safe point)
        print("servetune: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended
    except BrokenPipeError:  # a write that bypassed the guard (a library holding the raw stream)
        _ClosedPipeSafe(real_out)._to_devnull()
        return 141  # what a shell tool killed by SIGPIPE returns
    except (OSError, UnicodeError) as exc:
        if os.environ.get("SERVETUNE_DEBUG"):
            raise
        print(f"error: {_os_error_text(exc)}", file=sys.stderr)
        return 2
    except Exception:
        if not _interrupted_at_once():
            raise
        # The second Ctrl-C landed inside a library that turned it into its own error (an Optuna commit).
        print("servetune: interrupted", file=sys.stderr)
        return 130
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = real_out, real_err
        sys.unraisablehook = previous_hook


def _dispatch(args: argparse.Namespace) -> int:
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
        if args.command == "capacity":
            from servetune.cli import _capacity as _cli_capacity

            return _cli_capacity.run(args)
        if args.command == "diagnose":
            from servetune.cli import _diagnose as _cli_diagnose

            return _cli_diagnose.run(args)
        if args.command == "workload":
            from servetune.cli import _workload as _cli_workload

            return _cli_workload.run(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 2


def _sqlite_path(url: str) -> Path | None:
    """The database file of a ``sqlite:///PATH`` URL (``sqlite:////abs`` for an absolute path)."""
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)  # SQLAlchemy's own reading: a %3F in a folder name is a '?' of the path
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return None
    if parsed.get_backend_name() != "sqlite":
        return None
    path = parsed.database or ""
    return None if path in ("", ":memory:") else Path(path)


def _check_study_store(url: str, field: str) -> None:
    """``best`` reads an existing Optuna database: it must be there, and be SQLite, before Optuna opens it
    (Optuna would otherwise create an empty one, or print SQLAlchemy's traceback)."""
    path = _sqlite_path(url)
    if path is None:
        return
    where = path if path.is_absolute() else f"{path} (relative to {Path.cwd()})"
    if not path.exists():
        raise SpecError(field, f"no Optuna database at {where}",
                        "run `servetune tune SPEC` first (it creates it), run this where you ran tune "
                        "(output paths resolve from there), or pass --storage sqlite:///PATH")
    if path.is_dir():
        raise SpecError(field, f"{where} is a folder, not an Optuna database", "pass --storage sqlite:///PATH/optuna.db")
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError as exc:
        raise SpecError(field, f"cannot read {where}: {exc.strerror}", "give a readable SQLite file") from None
    if head and head != b"SQLite format 3\x00":
        raise SpecError(field, f"{where} is not an SQLite database", "point --storage at the optuna.db `servetune tune` wrote")
    if not _holds_studies(path):
        raise SpecError(field, f"{where} holds no Optuna study (an empty database)",
                        "run `servetune tune SPEC` first, or pass --storage with the database tune wrote")


def _holds_studies(path: Path) -> bool:
    """Whether the SQLite file has Optuna's ``studies`` table, read without writing a byte."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)) as db:
            return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'studies'").fetchone() is not None
    except sqlite3.Error:
        return False


def _check_run_store(spec: Any) -> None:
    """``tune`` writes its runs folder and its Optuna database: refuse paths it cannot create."""
    runs = Path(spec.output.runs_dir)
    if runs.exists() and not runs.is_dir():
        raise SpecError("output.runs_dir", f"{runs} is a file, not a folder", "name a folder (it is created if missing)")
    path = _sqlite_path(spec.storage.optuna_url or "")
    if path is None:
        return
    parent = path.parent.resolve()
    if path.exists() and path.is_dir():
        raise SpecError("storage.optuna_url", f"{path} is a folder, not a database file", "end the URL with a file name")
    if parent.exists() and not parent.is_dir():
        raise SpecError("storage.optuna_url", f"{path.parent} is a file, so {path} cannot be created",
                        "put the database in a folder")
    if not parent.exists() and parent != runs.resolve():
        raise SpecError("storage.optuna_url", f"the folder {path.parent} of the Optuna database does not exist",
                        f"create it, or drop storage: to use {runs}/optuna.db")


def _mlflow_hint(outcome: Any) -> str:
    """How to open the study in MLflow's UI: the server's page, or the `mlflow ui` command and then
    the page (on its runs, not MLflow 3's GenAI overview; see records.tracking.ui_url)."""
    from servetune.records.tracking import ui_url

    uri = str(outcome.mlflow_uri)
    if uri.startswith(("http://", "https://")):
        return ui_url(uri, str(outcome.experiment_id))
    return (f"mlflow ui --backend-store-uri {uri} --port 5000, then open "
            f"{ui_url('http://127.0.0.1:5000', str(outcome.experiment_id))}")


def _file_name(name: str) -> str:
    """A study name as one file name (a name may hold characters a path must not)."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "study"


def _tune(args: argparse.Namespace) -> int:
    from servetune.spec.schema import load_spec

    spec = load_spec(args.spec)
    spec = spec.with_overrides(backend=args.backend, trials=args.trials, parallel=args.parallel)
    _check_run_store(spec)
    envs.startup_timeout_s(), envs.ray_connect_wait_s()  # a bad setting refused before anything starts
    # The driver (Ray, MLflow, the dataset) only once the spec and its stores passed: a refusal
    # costs the spec's imports alone (0.7 CPU-s, against 1.7 with the driver's).
    from servetune.cli._logs import libraries_to_file
    from servetune.planner.flags import measure_only_notes
    from servetune.records.trial_record import figure as _figure
    from servetune.result import api_server_note
    from servetune.study import run_study

    # Optuna's, MLflow's and Ray's own INFO lines go to the study's log file, not between ours.
    log_file = Path(spec.output.runs_dir) / "logs" / f"{_file_name(spec.name)}.log"
    from servetune.records.diskspace import DiskFull, full_disk_reason, is_disk_full

    resume = f"servetune tune {args.spec} --resume"
    try:
        with libraries_to_file(log_file):
            outcome = run_study(spec, resume=args.resume)
    except Exception as exc:  # a full disk anywhere in the study: one line, exit 1, how to go on
        if not (isinstance(exc, DiskFull) or is_disk_full(exc)) or os.environ.get("SERVETUNE_DEBUG"):
            raise
        what = str(exc) if isinstance(exc, DiskFull) else f"the disk is full ({full_disk_reason(exc)})"
        print(f"error: {what}; free some space, then continue with: {resume}", file=sys.stderr)
        return 1
    ran = (f"no trial ran ({outcome.wall_s:.1f} s); the study holds {outcome.trials_done} told trials"
           if outcome.trials_run == 0 else f"{outcome.trials_done} trials in {outcome.wall_s:.1f} s")
    print(f"\nservetune: {ran}: {outcome.ok} served "
          f"({outcome.preempting} of them preempted), {outcome.startup_failed} failed at startup, "
          f"{outcome.pruned} pruned before launch (predicted startup failures), "
          f"{outcome.other_failed} other failures"
          + (f", {outcome.infra_failed} infrastructure failures (told FAIL, not learnt)" if outcome.infra_failed else "")
          + (f"; {outcome.infra_retried} re-run after an infrastructure failure" if outcome.infra_retried else ""))
    # Before the outcome, so that an interrupted study still ends with the command that resumes it.
    print(f"servetune: Optuna's, MLflow's and Ray's own messages are in {log_file}")
    # An interrupted study ends as the signal's 128 + N (130 for Ctrl-C, 143 for SIGTERM), so that
    # `servetune tune x && next-step` does not go on with half a study.
    stopped = 128 + outcome.stopped_by if outcome.interrupted and outcome.stopped_by else None
    if outcome.best_flags is None:
        if outcome.interrupted:
            print(f"servetune: interrupted before any trial met the constraints; continue with: {resume}")
        else:
            print("servetune: no trial met the constraints; widen the search space or relax the constraints")
        return stopped or 1
    m = outcome.best_metrics or {}
    print(f"servetune: best trial #{outcome.best_number}"
          + (" so far (the study was interrupted)" if outcome.interrupted else "")
          + f": {_figure(m.get('output_throughput'), ',.0f', 'output tok/s')}, "
          f"p99 TTFT {_figure(m.get('ttft_p99_ms'), ',.0f', 'ms')}, p99 ITL {_figure(m.get('itl_p99_ms'), ',.1f', 'ms')}, "
          f"{int(m.get('preemptions') or 0)} preemptions"
          + (f", ${m['cost_per_mtok']:,.3f} per million good output tokens" if m.get("cost_per_mtok") else ""))
    note = api_server_note(m)
    if note:
        print(f"servetune: note: {note}")
    print(f"servetune: run it with:\n  {outcome.best_command}")
    # Flags the command above leaves out (flags.serving_flags), and what random weights do to a quantized MoE.
    for line in measure_only_notes(outcome.best_flags or {}, moe=_is_moe(spec.model_profile, spec.model_ref)):
        print(f"servetune: note: {line}")
    for line in (outcome.headroom or {}).get("text", []):  # the winner's headroom (search.headroom)
        print(f"servetune: {line}")
    print(f"servetune: compare trials in MLflow: {_mlflow_hint(outcome)}")
    if outcome.interrupted:
        print(f"servetune: continue the study with: {resume}")
    return stopped or 0


def _is_moe(profile: ModelProfile | None, model_ref: str) -> bool:
    """Whether the study's model routes experts: its loaded ``profile``, else ``model_ref``'s config (False where
    that cannot be read here)."""
    from servetune.planner.modelinfo import load_model

    if profile is not None:
        return bool(profile.is_moe)
    try:
        return bool(load_model(model_ref).is_moe)
    except (SpecError, OSError, ValueError):
        return False


def _best(args: argparse.Namespace) -> int:
    import optuna

    from servetune.records import open_storage_read_only
    from servetune.planner.flags import to_command_line, to_config_yaml
    from servetune.spec.schema import sqlite_url
    from servetune.study import best_trial

    name, storage, model, spec = args.study, args.storage, None, None
    if Path(args.study).suffix in (".yaml", ".yml") or Path(args.study).is_file():
        from servetune.spec.schema import load_spec

        spec = load_spec(args.study)
        name, storage, model = spec.name, storage or spec.storage.optuna_url, spec.serve_model
    field = "--storage" if args.storage else ("storage.optuna_url" if storage else "--storage")
    storage = storage or sqlite_url(Path(DEFAULT_RUNS_DIR) / "optuna.db")
    _check_study_store(storage, field)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    import sqlalchemy.exc

    from servetune.redact import redact_url

    try:
        # Read-only: `best` never creates a table or stamps a version into the database it reads.
        readonly = open_storage_read_only(storage)
        study = optuna.load_study(study_name=name, storage=readonly)
    except KeyError:
        known = optuna.get_all_study_names(readonly)
        raise SpecError("study", f"no study named {name!r} in {redact_url(storage)}",
                        f"known studies: {', '.join(known) or 'none'}; or pass the spec file") from None
    except SpecError:
        raise  # already one line naming its field and fix (e.g. a PostgreSQL driver that is not installed)
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError, ImportError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        chain = " ".join(str(e) for e in (exc, exc.__cause__, exc.__context__) if e is not None)
        if "version_info" in chain and ("does not exist" in chain or "no such table" in chain):
            # Read-only, no table is created: a database without Optuna's tables says so.
            raise SpecError(field, f"{redact_url(storage)} holds no Optuna study (an empty database)",
                            "run `servetune tune SPEC` first, or pass --storage with the database tune wrote") from None
        raise SpecError(field, f"cannot open the Optuna storage {redact_url(storage)}: {first}",
                        "check the URL, that the database server runs, and that this is the database tune wrote") from None
    best = best_trial(study)
    if best is None:
        print(f"error: study {name!r} has no trial that met its constraints", file=sys.stderr)
        return 1
    flags: dict[str, Any] = dict(best.user_attrs.get("flags", best.params))
    model = model or str(study.user_attrs.get("serve_model") or study.user_attrs.get("model", "MODEL"))
    headroom = _best_headroom(study, best.number, spec) if args.headroom else None
    if args.format == "json":
        print(json.dumps(flags if headroom is None else {"flags": flags, "headroom": headroom}, indent=2, sort_keys=True))
    elif args.format == "yaml":
        print(to_config_yaml(model, flags), end="")
    else:
        print(to_command_line(model, flags))
    if headroom is not None and args.format != "json":
        print("\n".join(f"# {line}" if args.format == "yaml" else line for line in headroom["text"]))
    return 0


def _best_headroom(study: Any, number: int, spec: Any) -> dict[str, Any]:
    """The headroom ``best --headroom`` prints: the one the study's end stored for this winner, else
    computed now from the spec file (on the simulator, at the host factor the study stored)."""
    from servetune.study import HEADROOM_ATTR, ranked_flag_sets

    stored = study.user_attrs.get(HEADROOM_ATTR)
    if stored and (stored.get("winner") or {}).get("trial_number") == number:
        return dict(stored)
    if spec is None:
        raise SpecError("--headroom", f"study {study.study_name!r} holds no headroom for its winner #{number} "
                        "(its spec has headroom: false, or the study ended before it was computed)",
                        "pass the spec file instead of the name: servetune best STUDY.yaml --headroom")
    if spec.model_profile is None:
        raise SpecError("model", f"{spec.model_ref} has no model profile for the simulator",
                        "give a shipped model name or a folder holding config.json")
    import dataclasses

    from servetune.search.headroom import study_headroom
    from servetune.spec.schema import Selection

    factor = ((stored or {}).get("winner") or {}).get("calibration", {}).get("api_cpu_factor")
    ranked = ranked_flag_sets(study)
    ranked.sort(key=lambda r: r[0] != number)  # the winner first, whatever chose it
    result = study_headroom(dataclasses.replace(spec, selection=Selection()), ranked, api_cpu_factor=factor)
    assert result is not None  # the study has a feasible winner
    return result.to_dict()


def _report(args: argparse.Namespace) -> int:
    from servetune.records import dataset
    from servetune.records import report

    import pyarrow as pa

    filters = {"study": args.study} if args.study else {}
    root = Path(args.dataset)
    if not root.exists():
        raise SpecError("--dataset", f"no dataset folder at {root}",
                        "run `servetune tune` first (it writes one), or point --dataset at the dataset folder")
    if not root.is_dir():
        raise SpecError("--dataset", f"{root} is a file, not the dataset folder", "point --dataset at the folder")
    try:
        df = dataset.read_trials(root, **filters)
    except (pa.ArrowException, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise SpecError("--dataset", f"cannot read the dataset at {root}: {first}",
                        "move the damaged part-*.parquet file away (the other files stay readable)") from None
    if df.empty:
        raise SpecError("--dataset", f"no trials found in {args.dataset}" + (f" for study {args.study!r}" if args.study else ""),
                        "run `servetune tune` first, or point --dataset at the dataset folder")
    try:
        path = report.write_report(df, Path(args.out), title=f"servetune report: {args.study or 'all studies'}",
                                   headroom=_stored_headroom(root.parent / "headroom"))
    except OSError as exc:
        raise SpecError("--out", f"cannot write {exc.filename or args.out}: {exc.strerror or exc}",
                        "give a path in a writable folder") from None
    print(f"servetune: wrote {path}")
    return 0


def _stored_headroom(folder: Path) -> dict[str, Any]:
    """Each study's end headroom that ``servetune tune`` wrote beside the dataset folder
    (``headroom/<study>.json``), by study name; an unreadable file is left out."""
    out: dict[str, Any] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            out[path.stem] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return out


if __name__ == "__main__":
    raise SystemExit(main())

