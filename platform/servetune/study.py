"""The Optuna ask-and-tell driver: proposes flag sets, runs them on Ray, tells the results.

One driver process owns the Optuna storage, the MLflow runs and the Parquet dataset (it is their
only writer, which keeps SQLite safe). Trials run in Ray actors, as many at once as free GPUs and
``budget.parallel`` allow. Every result is told with the same constraint keys on every trial, as
Optuna 5 requires (``trial.set_constraint``; a value <= 0 is feasible):

- ``preemptions``: preemptions minus the allowed count;
- ``startup``: 1 when the engine did not serve (startup OOM, KV cache too small, crash, invalid
  flags), else -1. A failed startup is told as COMPLETE with this constraint violated, so the
  sampler learns where the OOM region is (a FAIL trial would be ignored by the samplers);
- ``p99_ttft_ms`` / ``p99_itl_ms``: the measured p99 minus the limit, when the spec sets one.

With ``prescreen`` on (the default), each proposal first goes through the memory planner
(:func:`servetune.search.propose.prescreen`): a predicted startup failure is told as a ``pruned`` trial
(infeasible, the prediction in MLflow and the dataset) without being dispatched to Ray, and a
fresh study starts from the preemption prior's informed points. The ask / pre-screen / tell logic
lives in :mod:`servetune.search.propose`, shared with the search-efficiency benchmark.

Example::

    from servetune.spec import load_spec
    from servetune.study import run_study
    outcome = run_study(load_spec("jobs/quickstart.yaml"))
    print(outcome.best_command)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import optuna

from servetune import envs
from servetune.backends import capabilities
from servetune.cluster import reap_leftovers, record_local_session
from servetune.cluster.base import NoGpusError, Pool, ray_accelerator_type
from servetune.cluster.start import start_pool
from servetune.engines import LeaderRepeats, TrialTask, resolve_backend
from servetune.errors import SpecError
from servetune.planner.flags import flags_key, gpus_needed, to_command_line
from servetune.records import dataset, diskspace, lease, report
from servetune.records import open_storage, retry_call
from servetune.records.tracking import StudyTracker
from servetune.records.trial_record import Prediction, Screen, TrialRecord
from servetune.redact import redact_text
from servetune.result import TrialResult, TrialStatus
from servetune.search import confirm, headroom, warmstart
from servetune.search import screen as fidelity
from servetune.search.propose import (FEASIBLE, INFEASIBLE, Proposal, StoredTrial, constraint_values, early_stop_rule,
                                      enqueue_informed_starts, maximises_output_throughput, meets_constraints,
                                      objective_values, propose, sim_screen, tell, with_slo_figures)
from servetune.spec.schema import StudySpec
from servetune.workload import Workload

if TYPE_CHECKING:
    from servetune.engines.early_stop import EarlyStop
    from servetune.search.screen import SimScreen
    from servetune.search.warmstart import WarmStart

__all__ = ["StudyOutcome", "run_study", "remeasure", "make_sampler", "constraint_values", "objective_values", "best_trial",
           "INFEASIBLE", "FEASIBLE", "ranked_flag_sets", "HEADROOM_ATTR"]


@dataclasses.dataclass
class StudyOutcome:
    """What a finished (or interrupted) study leaves: counts, the best trial, where things are."""

    study_name: str
    trials_done: int = 0
    ok: int = 0
    preempting: int = 0
    startup_failed: int = 0
    other_failed: int = 0
    pruned: int = 0  # predicted startup failures, told without a launch
    infra_failed: int = 0  # infrastructure failures whose re-runs were exhausted (told FAIL, not infeasible)
    infra_retried: int = 0  # trials re-run after an infrastructure failure (port, GPU memory, node)
    best_number: int | None = None
    best_flags: dict[str, Any] | None = None
    best_metrics: dict[str, float] | None = None
    best_command: str | None = None
    wall_s: float = 0.0
    mlflow_uri: str | None = None
    parent_run_id: str | None = None
    experiment_id: str | None = None  # the MLflow experiment (its UI page: records.tracking.ui_url)
    confirmation: dict[str, Any] | None = None  # budget.confirm_top: servetune.search.confirm.Choice.to_dict()
    interrupted: bool = False  # stopped by SIGTERM / Ctrl-C before its budget: resume with --resume
    stopped_by: int | None = None  # the signal that interrupted it (SIGINT for Ctrl-C, SIGTERM)
    headroom: dict[str, Any] | None = None  # servetune.search.headroom.StudyHeadroom.to_dict(), the study's end
    trials_run: int | None = None  # trials this run launched or told; 0: a --resume with nothing left to do


# -- pure pieces: what Optuna is told --------------------------------------------------------------

class _AskTellGridSampler(optuna.samplers.GridSampler):
    """Optuna's GridSampler for an ask-and-tell driver.

    Its ``after_trial`` calls ``study.stop()`` once the grid is covered, which raises outside
    ``study.optimize``; the driver stops on its own budget instead (the spec caps ``budget.trials``
    at the grid size with a warning).
    """

    def after_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial,
                    state: optuna.trial.TrialState, values: Sequence[float] | None) -> None:
        return None


def make_sampler(name: str, seed: int, n_objectives: int,
                 grid: Mapping[str, Sequence[Any]] | None = None) -> optuna.samplers.BaseSampler:
    """TPE (default), NSGA-II, GP, random or grid; all read constraints from ``trial.set_constraint``.

    ``grid`` (name -> values, :meth:`SearchSpace.grid_values`) is required by ``grid``, which
    visits every point once, in Optuna's order (trial *n* takes grid point *n*), skipping points
    other running trials hold.
    """
    if name == "grid":
        if grid is None:
            raise ValueError("sampler grid needs the grid values")
        return _AskTellGridSampler({k: list(v) for k, v in grid.items()}, seed=seed)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=6)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=8)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=6)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"unknown sampler {name!r}")


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The best feasible completed trial (first objective), or None when none is feasible.

    After a confirmation (``budget.confirm_top``), the winner on confirmed figures (the study's
    user attr ``confirmation``) instead of the best single measurement; with
    ``selection.min_headroom``, the flag set the study's end chose for its headroom (user attr
    ``headroom``, :func:`servetune.search.headroom.study_headroom`).
    """
    winner = (study.user_attrs.get(HEADROOM_ATTR) or {}).get("selected")
    if winner is None:
        winner = (study.user_attrs.get("confirmation") or {}).get("winner")
    if winner is not None:
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if t.number == winner:
                return t
    feasible = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                if t.constraints and all(c <= 0 for c in t.constraints.values())]
    if not feasible:
        return None
    sign = 1.0 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else -1.0
    return max(feasible, key=lambda t: sign * (t.values or [0.0])[0])


# -- the driver -----------------------------------------------------------------------------------

class _Progress:
    """One status line: trials done, running, failed, preempting; best so far."""

    def __init__(self, out: TextIO, total: int) -> None:
        self.out, self.total, self.tty = out, total, out.isatty()
        self._last = 0.0

    def show(self, o: StudyOutcome, running: int, force: bool = False, waiting: int = 0) -> None:
        """``waiting``: of the ``running`` trials, those Ray has not placed on GPUs yet."""
        now = time.monotonic()
        if not force and not self.tty and now - self._last < 5:
            return
        self._last = now
        best = "-" if o.best_metrics is None else f"{o.best_metrics.get('output_throughput', 0):,.0f} tok/s (#{o.best_number})"
        line = (f"trials {o.trials_done}/{self.total} | running {running - waiting}"
                + (f" | waiting for GPUs {waiting}" if waiting else "")
                + f" | ok {o.ok} | preempting {o.preempting}"
                f" | startup failed {o.startup_failed} | pruned {o.pruned} | other failed {o.other_failed}"
                + (f" | infra failed {o.infra_failed}" if o.infra_failed else "")
                + f" | best {best}")
        self.out.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.out.flush()

    def note(self, text: str) -> None:
        self.out.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.out.flush()


def _recover_interrupted(study: optuna.Study) -> int:
    """Enqueue again the params of every trial a stopped driver never finished; returns how many.

    Those are the trials a killed driver left RUNNING (told FAIL here) and the ones an interrupted
    driver told FAIL itself (SIGTERM / Ctrl-C): FAIL with no servetune status stored, unlike an
    infrastructure failure, which was measured and recorded. A params set is enqueued once, and not
    at all if a waiting, running or finished trial already holds it. Optuna's own ``skip_if_exists``
    cannot say this: it counts the killed trial itself, so nothing was ever re-queued, and a grid
    study lost the point (the H200 14B grid's trial 2, cut at the command deadline).
    """
    fail = optuna.trial.TrialState.FAIL
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(t.number, state=fail, skip_if_finished=True)
    held = {flags_key(t.system_attrs.get("fixed_params", t.params))
            for t in study.get_trials(deepcopy=False, states=(
                optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE))}
    n = 0
    for t in study.get_trials(deepcopy=False, states=(fail,)):
        key = flags_key(t.params)
        if "status" in t.user_attrs or not t.params or key in held:
            continue
        study.enqueue_trial(dict(t.params), user_attrs={"requeued_from": t.number})
        held.add(key)
        n += 1
    return n


def _open_study(spec: StudySpec, resume: bool) -> tuple[optuna.Study, list[optuna.trial.FrozenTrial]]:
    """The Optuna study of the spec (created or loaded) and its finished trials; a study that
    already has trials is refused without ``resume`` (SpecError), before anything else starts."""
    runs_dir = Path(spec.output.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    storage = spec.storage.optuna_url
    n_obj = len(spec.objective.metrics)
    grid = spec.search_space.grid_values() if spec.sampler == "grid" else None
    # Storage calls are retried with backoff (servetune.records._retry): a briefly locked SQLite file or a
    # restarting database delays the driver instead of ending the study. open_storage retries every
    # call of the storage itself (servetune.records._storage), so reads between the retried steps below
    # (best trial, counts) ride out an outage too.
    study = retry_call(lambda: optuna.create_study(
        study_name=spec.name, storage=open_storage(storage), load_if_exists=True,
        directions=list(spec.objective.directions), sampler=make_sampler(spec.sampler, spec.seed, n_obj, grid),
    ), what="open the Optuna study")
    existing = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished()]
    if existing and spec.sampler != "grid":
        # Sampler state is not stored: reseeded with the spec's seed, a resumed study would draw
        # the pairs it has already measured again. Offset the seed by the trials already told.
        # Not the grid's: GridSampler shuffles its points with the seed and stores only each
        # trial's index into that order (system attr grid_id), so another seed maps the visited
        # indices to other points and re-measures visited ones (the real H200 8B grid's resume
        # did, twice); with the same seed the storage alone says what is left.
        study.sampler = make_sampler(spec.sampler, spec.seed + len(existing), n_obj, grid)
    if existing and not resume:
        raise SpecError("name", f"study {spec.name!r} already has {len(existing)} trials in {storage}",
                        "pass --resume to continue it, or give the study a new name")
    return study, existing


#: The study user attr the driver sets last, once every told trial is in MLflow and the dataset:
#: ``{"at": UTC time, "finished": trials in a finished state then, "experiment_id", "parent_run_id"}``.
FINISHED = "finished"


def resume_is_noop(attrs: Mapping[str, Any], finished_now: int, unfinished: int, requeue: int, told: int,
                   budget: int, confirm_top: int, feasible: bool, buffered: bool) -> bool:
    """True when a ``--resume`` would run nothing and write nothing: the last driver finished after
    the last told trial (``finished_now`` trials then and now), no trial is left running or waiting,
    none to re-queue, the budget is told, the confirmation (if asked for and possible) stored, and
    no MLflow write is waiting in the buffer. Pure.

    Example:
        >>> done = {FINISHED: {"finished": 30}}
        >>> resume_is_noop(done, 30, 0, 0, 30, 30, 0, True, False)
        True
        >>> resume_is_noop(done, 31, 0, 0, 31, 40, 0, True, False)  # a trial told since: the resume runs
        False
    """
    record = attrs.get(FINISHED) or {}
    confirmed = confirm_top <= 0 or not feasible or "confirmation" in attrs
    return (record.get("finished") == finished_now and unfinished == 0 and requeue == 0 and told >= budget
            and confirmed and not buffered)


def _nothing_to_do(spec: StudySpec, study: optuna.Study) -> StudyOutcome | None:
    """The outcome of a ``--resume`` that would run nothing (:func:`resume_is_noop`), read from
    Optuna alone (no MLflow, no pool); None when the resume has work to do."""
    trials = study.get_trials(deepcopy=False)
    finished = sum(t.state.is_finished() for t in trials)
    unfinished = sum(t.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING) for t in trials)
    requeue = sum(t.state == optuna.trial.TrialState.FAIL and "status" not in t.user_attrs and bool(t.params)
                  for t in trials)
    outcome = StudyOutcome(spec.name, mlflow_uri=spec.tracking.mlflow_uri)
    _count_existing(study, outcome)
    buffer = Path(spec.output.runs_dir) / "mlflow-buffer"
    buffered = buffer.is_dir() and any((p / "op.json").is_file() for p in buffer.iterdir())
    attrs = study.user_attrs
    if not resume_is_noop(attrs, finished, unfinished, requeue, outcome.trials_done, spec.budget.trials,
                          spec.budget.confirm_top, outcome.best_number is not None, buffered):
        return None
    record = attrs[FINISHED]
    outcome.experiment_id, outcome.parent_run_id = record.get("experiment_id"), record.get("parent_run_id")
    outcome.confirmation = attrs.get("confirmation")
    outcome.trials_run = 0
    if outcome.best_flags is not None:
        outcome.best_command = to_command_line(spec.serve_model, outcome.best_flags)
    return outcome


def run_study(
    spec: StudySpec,
    *,
    resume: bool = False,
    out: TextIO | None = None,
    on_result: Callable[[int, dict[str, Any], TrialResult], None] | None = None,
) -> StudyOutcome:
    """Run (or resume) the study the spec describes; returns its outcome.

    1. Open the Optuna study (``--resume`` continues one of the same name) and its MLflow parent run.
    2. On resume: re-queue the trials a killed driver left running, and write the told trials it
       never recorded to MLflow and the dataset.
    3. A fresh study enqueues its starting points: informed starts, warm starts, the baseline.
    4. Dispatch: propose (pre-screen, simulator screen), run on the Ray pool while
       ``budget.parallel`` and free GPUs allow, tell each result (Optuna, then MLflow, then the
       dataset), until ``budget.trials`` are told or ``budget.time_limit_s`` is spent.
    5. Confirm the top configurations (``budget.confirm_top``).
    6. Close: the pool, the parent run's summary and plots, the outcome.

    Only one driver runs a study at a time (:mod:`servetune.records.lease`): a second one is refused
    with :class:`servetune.records.lease.StudyBusy` before it reads or writes anything.

    SIGTERM or Ctrl-C stops at the next safe point: running trials are killed and told FAIL, their
    MLflow runs end KILLED, every finished trial is kept.
    """
    # One driver per study: its lease, in the study's own storage, before anything of the study is
    # read or written (a live holder: StudyBusy, one line; a dead one's is taken over).
    Path(spec.output.runs_dir).mkdir(parents=True, exist_ok=True)
    held = None if spec.storage.optuna_url is None else lease.acquire(spec.storage.optuna_url, spec.name)
    try:
        started = time.monotonic()
        study, existing = _open_study(spec, resume)
        done = _nothing_to_do(spec, study) if resume else None
        if done is not None:  # decided before MLflow, the pool or any worker starts
            done.wall_s = time.monotonic() - started
            (out or sys.stdout).write(f"servetune: study {spec.name!r} already holds its {done.trials_done} told trials "
                                      f"(budget.trials {spec.budget.trials}) and their records; no trial ran "
                                      "(raise --trials to run more)\n")
            return done
        driver = _Driver.open(spec, study, existing, resume=resume, out=out or sys.stdout, on_result=on_result,
                              started=started)  # 1
        driver.recover()  # 2
        driver.enqueue_starts()  # 3
        driver.run()  # 4-6
    finally:
        if held is not None:
            held.release()
    return driver.outcome


class _Driver:
    """One run of the driver over one study: the state the steps of :func:`run_study` share."""

    def __init__(self, spec: StudySpec, study: optuna.Study, existing: list[optuna.trial.FrozenTrial],
                 tracker: StudyTracker, backend: str, resume: bool, out: TextIO,
                 on_result: Callable[[int, dict[str, Any], TrialResult], None] | None, started: float) -> None:
        self.spec, self.study, self.existing, self.tracker = spec, study, existing, tracker
        self.backend, self.resume, self.out, self.on_result, self.started = backend, resume, out, on_result, started
        self.runs_dir = Path(spec.output.runs_dir)
        self.outcome = StudyOutcome(spec.name, mlflow_uri=spec.tracking.mlflow_uri, parent_run_id=tracker.parent_run_id,
                                    experiment_id=tracker.experiment_id)
        _count_existing(study, self.outcome)
        self.told_before = self.outcome.trials_done  # trials_run counts from here
        self.progress = _Progress(out, spec.budget.trials)

    # -- 1. open -------------------------------------------------------------------------------

    @classmethod
    def open(cls, spec: StudySpec, study: optuna.Study, existing: list[optuna.trial.FrozenTrial], *, resume: bool,
             out: TextIO, on_result: Callable[[int, dict[str, Any], TrialResult], None] | None,
             started: float) -> _Driver:
        backend = resolve_backend(spec.backend)
        runs_dir = Path(spec.output.runs_dir)
        # Optuna's storage is a file anyone with the runs dir can read: no credentials in it.
        study.set_user_attr("model", redact_text(spec.model_ref))
        study.set_user_attr("gpu_type", spec.gpu.type)
        study.set_user_attr("serve_model", redact_text(spec.serve_model))

        local_store = not spec.tracking.mlflow_uri.startswith(("http://", "https://"))
        # An unreachable server at the start fails fast (TrackingError, nothing run yet); one that goes
        # away later has its writes buffered under <runs_dir>/mlflow-buffer/ and delivered on return.
        tracker = StudyTracker(spec.tracking.mlflow_uri, spec.tracking.experiment,
                               artifact_location=(runs_dir / "mlartifacts").resolve().as_uri() if local_store else None,
                               buffer_dir=runs_dir / "mlflow-buffer")
        tracker.start_study(spec.name, spec.to_dict(), {
            "model": spec.model_ref, "gpu_type": spec.gpu.type, "backend": backend,
            "vllm_version": spec.vllm_version, "sampler": spec.sampler}, resume=resume)
        return cls(spec, study, existing, tracker, backend, resume, out, on_result, started)

    # -- 2. recover, 3. starting points ---------------------------------------------------------

    def recover(self) -> None:
        self.recovered = _recover_interrupted(self.study) if self.resume else 0
        self.reconciled = self._reconcile() if self.resume else 0

    def enqueue_starts(self) -> None:
        spec, study = self.spec, self.study
        # A grid is the baseline every point of which is measured: informed starts would only reorder it.
        # Warm starts and the baseline, like the informed starts, only go into a study nobody has
        # enqueued anything in yet (the nightly job enqueues its own warm start).
        fresh = not self.existing and spec.sampler != "grid" and not study.get_trials(deepcopy=False)
        starts = enqueue_informed_starts(spec, study) if not self.existing and spec.sampler != "grid" else []
        warm, baseline = _enqueue_warm_and_baseline(spec, study) if fresh else ([], None)
        note = self.progress.note
        note(f"servetune: study {spec.name!r}: {spec.model_ref} on {spec.gpu.count} x {spec.gpu.type} "
             f"({self.backend} backend), {spec.budget.trials} trials, {spec.budget.parallel} at a time"
             + (f"; resumed, {self.recovered} interrupted trials re-queued" if self.recovered else "")
             + (f", {self.reconciled} told trials written to MLflow/dataset" if self.reconciled else ""))
        if starts:
            note("servetune: informed starts (highest utilization that starts, max_num_seqs under the "
                 f"preemption bound): {', '.join(str(p) for p in starts)}")
        for ws in warm:
            note(f"servetune: warm start from study {ws.study!r} ({ws.model}, vLLM {ws.vllm_version}, "
                 f"distance {ws.distance:.2f}, best {ws.objective:,.0f}): {ws.params}")
        if baseline:
            note(f"servetune: baseline trial (vLLM's defaults for the searched flags): {baseline}")
        note(f"servetune: MLflow {spec.tracking.mlflow_uri} (experiment {spec.tracking.experiment!r}), "
             f"Optuna {spec.storage.optuna_url}")

    # -- 4-6. dispatch, confirm, close ------------------------------------------------------------

    def run(self) -> None:
        spec = self.spec
        # The GPU type binds at the first submit, and only on a cluster whose nodes advertise types: a
        # local logical-GPU Ray (possibly shared by several studies in one process) stays untyped.
        # A local Ray left by an earlier, killed driver of this study is stopped first; the local Ray
        # this driver starts is recorded so that the next start can do the same (servetune.cluster._ray_session).
        reaped = reap_leftovers(self.runs_dir, spec.name)
        if reaped:
            self.progress.note(f"servetune: stopped {len(reaped)} processes left by the earlier driver's local Ray")
        # Simulated trials run in local worker processes unless a Ray is asked for (servetune.cluster.base).
        pool: Pool = start_pool(self.backend, num_gpus=spec.gpu.count, num_cpus=max(2, spec.budget.parallel))
        self.pool = pool
        pool.reuse_actors = True  # closed in the finally below
        if pool.started_local_ray:
            record_local_session(self.runs_dir, spec.name)
        self.queued: list[tuple[optuna.trial.Trial, dict[str, Any], int]] = []  # asked, waiting for free GPUs
        self.inflight: dict[int, tuple[optuna.trial.Trial, dict[str, Any]]] = {}
        # Multi-fidelity: a fresh calibration per driver run (a resumed study recalibrates from its
        # next real trials); ``sims`` holds the simulated twin of each dispatched trial.
        self.screen = fidelity.screen_for(spec, self.backend)
        if self.screen is not None and self.existing:
            _recalibrate(spec, self.screen, self.existing, self.backend)
        self.sims: dict[int, TrialResult] = {}
        self.infra_seen = self.quarantine_seen = 0  # pool.infra_notes / pool.quarantine_notes already shown
        self.gpu_wait_noted = False  # a trial waiting for Ray to place it was announced
        self.stop = _StopRequest()
        status = "FINISHED"
        no_gpus: NoGpusError | None = None
        reserve = diskspace.Reserve(self.runs_dir, spec.name)  # room to close the records if the disk fills
        full: BaseException | None = None
        try:
            self._dispatch_until_done()
            if spec.budget.confirm_top > 0 and pool.total_gpus > 0:
                if self._out_of_time():
                    # A repeat is a vLLM start like a trial: the time limit bounds the GPU time, so a
                    # study that spent it leaves its winner unconfirmed (the H200 14B grid's
                    # confirmation start, begun after the limit, was cut by the host's deadline).
                    self.progress.note(f"servetune: budget.time_limit_s ({spec.budget.time_limit_s:g} s) spent: "
                                       "the top configurations are not confirmed (resume with --resume and a "
                                       "larger time_limit_s to confirm them)")
                else:
                    self._confirm_top()
            self._headroom()
        except KeyboardInterrupt:
            status = "KILLED"
            self.outcome.interrupted = True
            killed = self._fail_running()
            self.outcome.stopped_by = int(self.stop.signum or signal.SIGINT)
            self.progress.note(f"\nservetune: interrupted; {len(killed)} running trials stopped, "
                               f"{self.outcome.trials_done} finished trials kept (resume with --resume)")
        except NoGpusError as exc:  # no live node takes a trial: stop, keeping what finished
            status, no_gpus = "FAILED", exc
            self.outcome.interrupted = True
            killed = self._fail_running()
            self.progress.note(f"servetune: no GPUs for the study; {len(killed)} running trials stopped, "
                               f"{self.outcome.trials_done} finished trials kept")
        except Exception as exc:
            if not diskspace.is_disk_full(exc):
                raise
            full, status = exc, "FAILED"  # stop at once: every write from here on may fail the same way
            pool.cancel_all()
        finally:
            pool.close()
            self.stop.restore()
            self.outcome.wall_s = time.monotonic() - self.started
            self.outcome.trials_run = self.outcome.trials_done - self.told_before
            self.progress.show(self.outcome, 0, force=True)
            if self.out.isatty():
                self.out.write("\n")
            if full is None:
                reserve.release()
                _finish_study(spec, self.study, self.tracker, self.outcome, status)
        if full is not None:
            self._stop_on_full_disk(full, reserve)
        if no_gpus is not None:
            raise SpecError("gpu.type", f"{no_gpus} (budget.wait_for_gpus_s: {spec.budget.wait_for_gpus_s:g} s)",
                            f"start Ray nodes with {spec.gpu.type} GPUs labelled by type (ray start --num-gpus N "
                            f"--resources '{{\"accelerator_type:{ray_accelerator_type(spec.gpu.type)}\": 1}}'), "
                            "raise budget.wait_for_gpus_s while an autoscaler adds them, or run backend: sim")

    def _headroom(self) -> None:
        """The winner's and the runner-up's headroom on the simulator, calibrated as the study's
        screen is (:mod:`servetune.search.headroom`); with ``selection.min_headroom``, the winner
        chosen for it. Kept as the study's user attr ``headroom`` (``servetune best --headroom``)."""
        spec, study = self.spec, self.study
        if not spec.headroom.enabled and study.user_attrs.get(HEADROOM_ATTR):
            # Turned off on a resume: an earlier run's selection must not choose the winner any more.
            retry_call(lambda: study.set_user_attr(HEADROOM_ATTR, None), what="clear the headroom")
            _update_best(study, self.outcome)
        if not spec.headroom.enabled or spec.model_profile is None or self.stop.requested:
            return
        started = time.monotonic()
        screen = self.screen
        calibration = {} if screen is None else {"real_over_sim_throughput": screen.ratio, "real_trials": len(screen.ratios)}
        ranked = ranked_flag_sets(study)
        # A simulated study's trial is the simulator's own figure at scale 1: not simulated again.
        told = {t.number: t for t in study.get_trials(deepcopy=False)}
        measured = ({n: StoredTrial.of(told[n]).result(self.backend, spec.vllm_version) for n, _ in ranked}
                    if capabilities(self.backend).virtual_time else None)
        result = headroom.study_headroom(spec, ranked, calibration=calibration, measured=measured,
                                         api_cpu_factor=None if screen is None else screen.api_cpu_factor)
        if result is None:
            return
        self.progress.note(f"servetune: headroom of the winner and the runner-up: {result.winner.simulations} + "
                           f"{0 if result.runner_up is None else result.runner_up.simulations} simulations"
                           + (f", {len(result.checked)} flag sets checked at x{result.min_headroom:g}"
                              if result.min_headroom is not None else "")
                           + f" in {time.monotonic() - started:.1f} s")
        self._store_headroom(result)
        # A prompt file's texts are sent as written: only its load can be scaled on a real server.
        edge = headroom.first_edge(result.winner, ("load",) if spec.workload.prompt_file else headroom.AXES)
        if capabilities(self.backend).real_gpus and edge is not None and gpus_needed(result.winner.flags) <= self.pool.total_gpus:
            self._store_headroom(dataclasses.replace(result, edge_window=self._edge_window(result.winner, edge)))

    def _store_headroom(self, result: headroom.StudyHeadroom) -> None:
        summary = result.to_dict()
        retry_call(lambda: self.study.set_user_attr(HEADROOM_ATTR, summary), what="store the headroom")
        self.outcome.headroom = summary
        _update_best(self.study, self.outcome)

    def _edge_window(self, winner: headroom.Headroom, edge: headroom.Edge) -> dict[str, Any]:
        """One window of the winner on the real engine at its first predicted edge (a start of its
        own, the full window: no early stop), not an Optuna trial; bounded by the trial's own
        startup and stall timeouts."""
        spec, number = self.spec, winner.trial_number
        assert edge.first_fail is not None
        self.progress.note(f"servetune: measuring the winner at its predicted edge ({edge.axis} x{edge.first_fail:.2f}, "
                           f"{edge.criterion}) on the real engine")
        name = f"{dataset.trial_dir_name(number or 0)}-edge"
        task = _trial_task(spec, dict(winner.flags), self.runs_dir / "trials" / spec.name / name,
                           workload=headroom.scaled_workload(spec.workload, edge.axis, edge.first_fail))
        key = 2_000_000  # pool keys of edge windows, apart from trials and repeats
        self.pool.submit(key, task, self.backend, gpus=gpus_needed(winner.flags))
        measured: TrialResult | None = None
        while measured is None:
            self.stop.check()
            measured = next((r for k, r in self.pool.wait(timeout_s=0.5) if k == key), None)
        return headroom.edge_window(edge, number, measured, spec.constraints.limits())

    def _fail_running(self) -> list[int]:
        """Stop every running trial and tell it FAIL; returns the pool's trial numbers it stopped."""
        killed = self.pool.cancel_all()
        # Every RUNNING trial is this driver's (it is the only writer), including one asked a
        # moment before the signal and not yet tracked in ``inflight``: fail them all.
        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            self.study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        return killed

    def _stop_on_full_disk(self, full: BaseException, reserve: diskspace.Reserve) -> None:
        """The disk filled: free the reserve, end the MLflow runs (FAILED, no child left RUNNING) and
        the Optuna trials still running (FAIL: the resume measures them again), raise DiskFull."""
        reserve.release()
        self.tracker.close_after_failure()
        try:
            for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                self.study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        except Exception:  # noqa: BLE001 - left RUNNING, the resume re-queues them the same way
            pass
        raise diskspace.DiskFull(f"the disk holding {self.runs_dir} is full ({diskspace.full_disk_reason(full)}); "
                                 f"the study stopped, its {self.outcome.trials_done} finished trials kept") from None

    def _dispatch_until_done(self) -> None:
        while True:
            self.stop.check()
            spec, outcome = self.spec, self.outcome
            out_of_time = self._out_of_time()
            if not out_of_time:
                self._propose_while_room()
            self._submit_what_fits()
            self._fail_what_no_longer_fits()
            if not self.inflight and not self.queued:
                if self.pool.total_gpus == 0:
                    self.progress.note("servetune: every GPU slot is quarantined; stopping the study")
                    return
                if outcome.trials_done >= spec.budget.trials or out_of_time:
                    return
                continue
            self._collect()

    def _out_of_time(self) -> bool:
        limit = self.spec.budget.time_limit_s
        return limit is not None and time.monotonic() - self.started > limit

    def _propose_while_room(self) -> None:
        """Ask for trials while the budget and ``budget.parallel`` leave room; a refused or
        screened proposal is told at once (no GPU time spent), the others wait for GPUs."""
        spec, outcome, queued, inflight = self.spec, self.outcome, self.queued, self.inflight
        while (outcome.trials_done + len(inflight) + len(queued) < spec.budget.trials
               and len(inflight) + len(queued) < spec.budget.parallel):
            proposal = _propose_with_retry(spec, self.study, self.pool.total_gpus, self.backend,
                                           {*inflight, *(t.number for t, _, _ in queued)})
            trial, flags, need = proposal.trial, proposal.flags, proposal.gpus
            if proposal.refused is not None:  # invalid or predicted to fail: no GPU time spent
                self.tell_and_record(trial, flags, proposal.refused,
                                     prediction=None if proposal.plan is None else Prediction.from_plan(proposal.plan))
                continue
            screened = self._screen_on_sim(proposal)
            if screened is not None:  # the calibrated simulator rules it out: no GPU time spent
                self.tell_and_record(trial, flags, screened[0], screen=screened[1])
                continue
            queued.append((trial, flags, need))

    def _submit_what_fits(self) -> None:
        while self.queued and self.queued[0][2] <= self.pool.free_gpus:  # first come, first served
            trial, flags, need = self.queued.pop(0)
            task = _trial_task(self.spec, flags, self.runs_dir / "trials" / self.spec.name / dataset.trial_dir_name(trial.number),
                               early_stop=_early_stop_rule(self.spec, self.outcome, self.backend),
                               leader_repeats=_leader_repeats(self.spec, self.outcome, self.backend, self.runs_dir,
                                                              trial.number))
            self.pool.submit(trial.number, task, self.backend, gpus=need)
            self.inflight[trial.number] = (trial, flags)

    def _fail_what_no_longer_fits(self) -> None:
        # A quarantined slot shrinks the pool: a queued trial that can no longer fit ends as an
        # infrastructure failure (told FAIL, not a bad configuration) instead of waiting forever.
        pool = self.pool
        while self.queued and self.queued[0][2] > pool.total_gpus:
            trial, flags, need = self.queued.pop(0)
            # The machine's fault, not the flags': told FAIL (never learnt as infeasible).
            result = TrialResult(status=TrialStatus.INFRA_ERROR, infrastructure="gpu_unusable", backend=self.backend,
                                 cause=f"infrastructure failure: needs {need} GPUs; {pool.total_gpus} healthy "
                                       f"GPUs left after quarantine of {', '.join(pool.quarantined) or 'none'}")
            self.tell_and_record(trial, flags, result)

    def _collect(self) -> None:
        """Wait briefly for finished trials and tell each; show the pool's infrastructure notes."""
        pool, progress = self.pool, self.progress
        waiting = pool.check_placement(self.spec.budget.wait_for_gpus_s, self.spec.gpu.type)
        if waiting and not self.gpu_wait_noted:
            self.gpu_wait_noted = True
            progress.note(f"servetune: trial #{waiting[0][0]} waits for {waiting[0][1]} {self.spec.gpu.type} GPU(s) that "
                          f"no live Ray node has free; where no node has them at all, the study stops after "
                          f"budget.wait_for_gpus_s ({self.spec.budget.wait_for_gpus_s:g} s) unless one comes "
                          "(an autoscaler adding it)")
            progress.show(self.outcome, len(self.inflight), force=True, waiting=len(waiting))
        progress.show(self.outcome, len(self.inflight), waiting=len(waiting))
        results = pool.wait(timeout_s=0.5)
        for line in pool.infra_notes[self.infra_seen:]:  # the pool re-runs these itself (bounded)
            progress.note(f"servetune: infrastructure failure, re-run elsewhere when possible: trial #{line}")
        self.infra_seen = len(pool.infra_notes)
        for note in pool.quarantine_notes[self.quarantine_seen:]:
            if "infrastructure failures" in note:  # (memory left behind is reported with its trial below)
                progress.note(f"servetune: slot quarantined: {note}")
        self.quarantine_seen = len(pool.quarantine_notes)
        # Each result is told to Optuna at once; its MLflow run and dataset row are written after the
        # next trials are on their way (a worker does not wait for the driver's records), and always.
        deferred: list[Callable[[], None]] = []
        told = False
        try:
            self._tell_results(results, deferred)
            if results and not self.stop.requested and not self._out_of_time():
                self._propose_while_room()
                self._submit_what_fits()
            told = True
        finally:
            for write in deferred:
                if told:
                    write()
                else:  # already failing: write what can be written (a --resume writes the rest from Optuna)
                    with contextlib.suppress(Exception):
                        write()
        if results:
            progress.show(self.outcome, len(self.inflight), force=True)
        self.stop.check()

    def _tell_results(self, results: list[tuple[int, TrialResult]], deferred: list[Callable[[], None]]) -> None:
        """Tell each finished trial (Optuna, the counts, the best); its records go to ``deferred``."""
        progress = self.progress
        for number, result in results:
            trial, flags = self.inflight.pop(number)
            with_slo_figures(self.spec, flags, result)  # goodput and cost at the targets (servetune.cost)
            if self.screen is not None and number in self.sims:  # recalibrate on the real measurement
                factor = self.screen.api_cpu_factor
                fidelity.learn(self.screen, self.spec, flags, self.sims.pop(number), result)
                if factor is None and self.screen.api_cpu_factor is not None:
                    progress.note(f"servetune: this host's vLLM API server costs {self.screen.api_cpu_factor:.2f}x "
                                  f"the simulator's calibration (trial #{number}: {result.api_server_cpu_s:.1f} "
                                  "CPU-s over the window); the simulator screen runs with it")
            # Repeats measured on the trial's own start (budget.confirm_on: same-start); as after the
            # budget, one the machine lost is not a sample.
            repeats = [(k, r) for k, r in enumerate(result.repeats, start=1) if not r.status.is_infrastructure]
            summary = [{"repeat": k, "value": objective_values(self.spec, r)[0],
                        "feasible": meets_constraints(self.spec, r)} for k, r in repeats]
            if summary:  # kept on the trial before it is told: a told trial's attrs are fixed
                retry_call(lambda: trial.set_user_attr(SAME_START_REPEATS, summary),
                           what=f"store trial #{number}'s repeats")
            self.tell_and_record(trial, flags, result, deferred=deferred)
            for (k, repeat), kept in zip(repeats, summary):
                record = self._record(number, flags, repeat, kept["value"], origin="repeat", repeat=k)
                deferred.append(lambda record=record, k=k: self._write(record, workload=_repeat_workload(self.spec, k)))
            if repeats:
                progress.note(f"servetune: trial #{number} led the study: {len(repeats)} confirmation "
                              "repeat(s) measured on its own server start")
            if result.quarantined_gpus:
                progress.note(f"servetune: GPU memory did not come back after trial #{number}: "
                              f"GPUs {', '.join(result.quarantined_gpus)} quarantined")

    def _screen_on_sim(self, proposal: Proposal) -> tuple[TrialResult, Screen] | None:
        """Multi-fidelity (:mod:`servetune.search.screen`): ``(pruned result, the screen's verdict)``
        when the calibrated simulator rules the proposal out, else None (its simulated twin kept in
        ``sims`` to recalibrate on the real result)."""
        best = (self.outcome.best_metrics or {}).get("output_throughput")
        screened = sim_screen(self.spec, self.screen, proposal, best, self.backend)
        if screened is None:
            return None
        refusal, sim = screened
        if refusal is None:
            self.sims[proposal.trial.number] = sim
            return None
        figures = fidelity.prediction_attrs(sim)
        return refusal, Screen(refusal.cause or "", figures["output_throughput"], figures["preemptions"])

    # -- telling and recording ----------------------------------------------------------------

    def tell_and_record(self, trial: optuna.trial.Trial, flags: dict[str, Any], result: TrialResult, *,
                        prediction: Prediction | None = None, screen: Screen | None = None,
                        deferred: list[Callable[[], None]] | None = None) -> None:
        """Tell Optuna, then MLflow, then the dataset: in that order, so a crash loses at most the
        record (the next ``--resume`` writes it from Optuna's). With ``deferred``, the records are
        appended to it for the caller to write instead of written now."""
        objective = retry_call(lambda: tell(self.spec, self.study, trial, result), what=f"tell trial #{trial.number}")
        record = self._record(trial.number, flags, result, objective[0], origin=warmstart.origin_of(trial.user_attrs),
                              prediction=prediction, screen=screen)
        _count(self.outcome, result.status, result.preemptions or 0)
        self.outcome.infra_retried += bool(result.infra_attempts) and not result.status.is_infrastructure
        if not result.status.is_infrastructure and all(v <= 0 for v in constraint_values(self.spec, result).values()):
            _update_best(self.study, self.outcome)  # only a feasible trial can become the best (best_trial)

        def write() -> None:
            self._write(record)
            if self.on_result is not None:
                self.tracker.settle()  # the callback sees the trial's MLflow run written (or buffered)
                self.on_result(trial.number, flags, result)

        if deferred is None:
            write()
        else:
            deferred.append(write)

    def _record(self, number: int, flags: Mapping[str, Any], result: TrialResult, objective: float,
                **kind: Any) -> TrialRecord:
        spec = self.spec
        return TrialRecord(spec.name, number, dict(flags), result, objective, gpu_type=spec.gpu.type,
                           model=spec.model_ref, backend=self.backend, vllm_version=spec.vllm_version,
                           serve_model=spec.serve_model, **kind)

    def _write(self, record: TrialRecord, *, workload: Workload | None = None, mlflow: bool = True,
               rows: bool = True) -> None:
        """One told trial to MLflow (a child run) and the Parquet dataset."""
        spec = self.spec
        if mlflow:
            # A real trial's folder (its /metrics dumps, gauges, `vllm bench serve` output) goes along
            # under files/; the server log is already the run's engine.log.
            trial_dir = Path(spec.output.runs_dir) / "trials" / spec.name / record.trial_dir_name
            repeat = record.repeat
            self.tracker.log_trial(
                record.number, record.flags, record.result, record.mlflow_tags(),
                workload=(workload or spec.workload).to_dict(),
                artifacts_dir=trial_dir if capabilities(record.run_backend).real_gpus and trial_dir.is_dir() else None,
                role="trial" if repeat is None else "repeat",
                run_name=None if repeat is None else f"trial-{record.number:03d}-repeat-{repeat}")
        if rows:
            dataset.append_trials(Path(spec.output.dataset_dir), [record.dataset_row()])

    def _reconcile(self) -> int:
        """Trials told to Optuna whose MLflow run or dataset row a killed driver never wrote.

        Optuna is told first (see :meth:`tell_and_record`), so after a SIGKILL it may hold a trial
        that MLflow or the dataset lack; they are written now from what Optuna stored (status,
        cause, flags, metrics), tagged ``servetune.reconciled``, so the three agree. Returns how
        many were written.
        """
        spec, study = self.spec, self.study
        told = [*study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)),
                *_infra_failed_trials(study)]
        if not told:
            return 0
        in_mlflow = self.tracker.reconcile_trial_runs()  # one run per trial: unfinished and duplicate runs go
        df = dataset.read_trials(Path(spec.output.dataset_dir), study=spec.name)
        in_rows = {int(n) for n in df["trial_number"]} if not df.empty else set()
        written = 0
        for t in told:
            if t.number in in_mlflow and t.number in in_rows:
                continue
            stored = StoredTrial.of(t)
            record = self._record(t.number, stored.flags, stored.result(self.backend, spec.vllm_version),
                                  (t.values or [0.0])[0], reconciled=True)
            self._write(record, mlflow=t.number not in in_mlflow, rows=t.number not in in_rows)
            written += 1
        return written

    def _confirm_top(self) -> None:
        """Re-run the top ``budget.confirm_top`` feasible configurations ``budget.confirm_repeats``
        times each (another workload and engine seed per repeat; :mod:`servetune.search.confirm`), record
        each repeat (MLflow ``servetune.role=repeat``, a dataset row with ``repeat``), and choose the
        winner on the confirmed means, among them and any other feasible trial that already holds its
        repeats (measured on its own start). The repeats are not Optuna trials: the choice is stored
        as the study's user attr ``confirmation``, which :func:`best_trial` honours."""
        spec, study, pool, outcome, progress = self.spec, self.study, self.pool, self.outcome, self.progress
        sign = 1.0 if spec.objective.directions[0] == "maximize" else -1.0
        feasible = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                    if t.constraints and all(c <= 0 for c in t.constraints.values()) and t.values]
        feasible.sort(key=lambda t: -sign * t.values[0])
        top: list[optuna.trial.FrozenTrial] = []
        for t in feasible:
            if all(StoredTrial.of(t).flags != StoredTrial.of(o).flags for o in top):
                top.append(t)
            if len(top) == spec.budget.confirm_top:
                break
        if not top:
            return
        # A trial below the top that led when its window ended already holds its repeats, measured
        # on its own start (budget.confirm_on: same-start): it is compared too, at no cost. Its
        # first window may have lost to the top's by less than the noise its repeats show.
        held: list[optuna.trial.FrozenTrial] = []
        for t in feasible:
            if (len(t.user_attrs.get(SAME_START_REPEATS, [])) >= spec.budget.confirm_repeats
                    and all(StoredTrial.of(t).flags != StoredTrial.of(o).flags for o in top + held)):
                held.append(t)
        # Repeats a leading trial measured on its own start count; only the missing ones are started.
        runs: dict[int, list[tuple[float, bool]]] = {
            t.number: [(t.values[0], True)] + [(r["value"], r["feasible"]) for r in t.user_attrs.get(SAME_START_REPEATS, [])]
            for t in top + held}
        todo = [(t, k) for k in range(1, spec.budget.confirm_repeats + 1) for t in top if k >= len(runs[t.number])]
        measured = sum(len(v) - 1 for v in runs.values())
        progress.note(f"servetune: confirming the top {len(top)} configurations (trials "
                      f"{', '.join(f'#{t.number}' for t in top)}), {spec.budget.confirm_repeats} repeats each"
                      + (f" ({measured} measured on the trials' own starts)" if measured else "")
                      + (f"; compared with {', '.join(f'#{t.number}' for t in held)}, whose repeats "
                         "their own starts measured" if held else ""))
        inflight: dict[int, tuple[optuna.trial.FrozenTrial, int, Workload]] = {}
        key = 1_000_000  # pool keys of repeats, apart from trial numbers
        while todo or inflight:
            self.stop.check()
            while todo:
                t, k = todo[0]
                flags = StoredTrial.of(t).flags
                need = gpus_needed(flags)
                if need > pool.free_gpus:
                    break
                todo.pop(0)
                workload = _repeat_workload(spec, k)
                task = _trial_task(spec, flags, self.runs_dir / "trials" / spec.name / dataset.trial_dir_name(t.number, k),
                                   workload=workload, seed=spec.seed + k, repeat=k)
                key += 1
                pool.submit(key, task, self.backend, gpus=need)
                inflight[key] = (t, k, workload)
            if not inflight:  # nothing fits any more (quarantined GPUs): confirm on what was measured
                break
            for done_key, result in pool.wait(timeout_s=0.5):
                t, k, workload = inflight.pop(done_key)
                if result.status.is_infrastructure:  # the machine failed, not the flags: not a sample
                    progress.note(f"servetune: repeat {k} of trial #{t.number} lost to an infrastructure failure: "
                                  f"{result.cause}")
                    continue
                value = objective_values(spec, with_slo_figures(spec, StoredTrial.of(t).flags, result))[0]
                ok = meets_constraints(spec, result)
                runs[t.number].append((value, ok))
                self._write(self._record(t.number, StoredTrial.of(t).flags, result, value,
                                         origin="repeat", repeat=k), workload=workload)
        choice = confirm.choose([confirm.confirm(t.number, StoredTrial.of(t).flags,
                                                 [v for v, _ in runs[t.number]], [f for _, f in runs[t.number]])
                                 for t in top + held], spec.objective.directions[0])
        summary = choice.to_dict()
        retry_call(lambda: study.set_user_attr("confirmation", summary), what="store the confirmation")
        outcome.confirmation = summary
        _update_best(study, outcome)
        for c in choice.ranked:
            ci = "" if not math.isfinite(c.half_width) else f" +- {c.half_width:,.0f} (95% CI)"
            progress.note(f"servetune: confirmed trial #{c.trial_number}: {c.mean:,.0f}{ci} over {c.n} runs, "
                          f"feasible in {sum(c.feasible)}/{c.n}")
        if choice.winner is not None:
            progress.note(f"servetune: winner on confirmed figures: trial #{choice.winner.trial_number}"
                          + ("" if choice.overlap is None else
                             "; the top two intervals overlap (the data do not separate them)" if choice.overlap
                             else "; the top two intervals do not overlap"))


def remeasure(spec: StudySpec, flags: Mapping[str, Any], seeds: Sequence[int],
              backend: str | None = None) -> list[TrialResult]:
    """``flags`` measured again once per engine seed (the workload keeps its own seed), on the
    Ray pool with the same task settings as the study's trials (:func:`_trial_task`); the
    results in seed order, an infrastructure failure or a flag set no slot fits left out.
    Not Optuna trials and not recorded: the nightly job's noise estimate."""
    backend = backend or resolve_backend(spec.backend)
    runs_dir = Path(spec.output.runs_dir)
    need = gpus_needed(flags)
    pool = start_pool(backend, num_gpus=spec.gpu.count, num_cpus=max(2, spec.budget.parallel))
    todo = list(enumerate(seeds, start=1))
    inflight: set[int] = set()
    done: dict[int, TrialResult] = {}
    try:
        while todo or inflight:
            while todo and need <= pool.free_gpus:
                k, seed = todo.pop(0)
                pool.submit(k, _trial_task(spec, dict(flags), runs_dir / "trials" / spec.name / f"remeasure-{k}",
                                           seed=seed), backend, gpus=need)
                inflight.add(k)
            if not inflight:  # nothing fits any more (quarantined GPUs)
                break
            for k, result in pool.wait(timeout_s=0.5):
                inflight.discard(k)
                if not result.status.is_infrastructure:
                    done[k] = with_slo_figures(spec, flags, result)
    finally:
        pool.close()
    return [done[k] for k in sorted(done)]


def _enqueue_warm_and_baseline(spec: StudySpec, study: optuna.Study
                               ) -> tuple[list[WarmStart], dict[str, Any] | None]:
    """Warm starts from earlier studies in the dataset, then the baseline trial
    (:mod:`servetune.search.warmstart`); enqueued after the informed starts, so those run first."""
    return warmstart.enqueue_warm_starts(spec, study), warmstart.enqueue_baseline(spec, study)


def _recalibrate(spec: StudySpec, screen: SimScreen, told: list[optuna.trial.FrozenTrial], backend: str) -> None:
    """A resumed study's screen starts from the trials it already measured (not the refused ones)."""
    measured = []
    for t in told:
        stored = StoredTrial.of(t)
        if t.state != optuna.trial.TrialState.COMPLETE or stored.status in (TrialStatus.PRUNED.value,
                                                                            TrialStatus.INVALID_CONFIG.value):
            continue
        measured.append((stored.flags, stored.result(backend, spec.vllm_version)))
    fidelity.recalibrate(screen, spec, measured)


def _early_stop_rule(spec: StudySpec, outcome: StudyOutcome, backend: str) -> EarlyStop | None:
    """The early-stop rule handed to the next real trial: the preemption constraint and the best
    feasible throughput so far (:mod:`servetune.engines.early_stop`). Only the vllm backend measures over
    time; the sim and replay backends answer at once."""
    if not capabilities(backend).real_gpus:
        return None
    best = (outcome.best_metrics or {}).get("output_throughput")
    return early_stop_rule(spec, best)


#: The trial user attr holding the confirmation repeats measured on the trial's own server start
#: (``[{"repeat": k, "value": objective, "feasible": bool}]``): read by ``_confirm_top``, so a
#: resumed study does not start them again.
SAME_START_REPEATS = "same_start_repeats"


def _repeat_workload(spec: StudySpec, k: int) -> Workload:
    """Confirmation repeat ``k``'s workload: the study's, with its seed + k (another request mix)."""
    return dataclasses.replace(spec.workload, seed=spec.workload.seed + k)


def _leader_repeats(spec: StudySpec, outcome: StudyOutcome, backend: str, runs_dir: Path,
                    number: int) -> LeaderRepeats | None:
    """The repeats the next real trial measures on its own start if its window leads
    (``budget.confirm_on: same-start``): only for the vllm backend (a start is what they save),
    with confirmation on and output throughput the first objective, maximised (what the engine
    can compare against the best so far)."""
    budget = spec.budget
    if (not capabilities(backend).real_gpus or budget.confirm_top <= 0 or budget.confirm_on != "same-start"
            or not maximises_output_throughput(spec)):
        return None
    ks = range(1, budget.confirm_repeats + 1)
    folder = runs_dir / "trials" / spec.name
    max_pre = spec.constraints.max_preemptions
    return LeaderRepeats(workloads=tuple(_repeat_workload(spec, k) for k in ks),
                         log_dirs=tuple(str(folder / dataset.trial_dir_name(number, k)) for k in ks),
                         best_throughput=(outcome.best_metrics or {}).get("output_throughput"),
                         max_preemptions=None if max_pre is None else int(max_pre))


def _trial_task(spec: StudySpec, flags: dict[str, Any], log_dir: Path, **varies: Any) -> TrialTask:
    """One launch's task: the model, GPU, measurement and environment settings from the spec and
    ``servetune.envs``; ``varies`` sets what differs per launch (``early_stop``, or a repeat's
    ``workload``, ``seed`` and ``repeat``)."""
    fields: dict[str, Any] = {"workload": spec.workload, "seed": spec.seed, **varies}
    return TrialTask(model=spec.model_ref, gpu=spec.gpu.type, flags=flags, vllm_version=spec.vllm_version,
                     gpu_file=spec.gpu.file, serve_model=spec.serve_model, serve_command=envs.serve_command(),
                     startup_timeout_s=spec.measurement.startup_timeout_s or envs.startup_timeout_s(),
                     load_generator=spec.measurement.load_generator, stall_timeout_s=spec.measurement.stall_timeout_s,
                     compile_cache_dir=envs.compile_cache_dir(), log_dir=str(log_dir),
                     replay_file=None if spec.replay_file is None else str(spec.replay_file), **fields)


def _propose_with_retry(spec: StudySpec, study: optuna.Study, total_gpus: int, backend: str,
                        known_running: set[int]) -> Proposal:
    """``propose`` retried on storage outages. An attempt that failed after ``study.ask`` leaves an
    asked trial nobody owns: before the next attempt it is told FAIL (samplers ignore FAIL trials
    and the budget counts told results only), so a retry never leaves a RUNNING orphan behind."""
    failed = False

    def attempt() -> Proposal:
        if failed:
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                if t.number not in known_running:
                    study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        return propose(spec, study, total_gpus, backend)

    def mark(_: BaseException) -> None:
        nonlocal failed
        failed = True

    return retry_call(attempt, what="ask Optuna for a trial", on_retry=mark)


class _StopRequest:
    """SIGTERM (``ray job stop``, a scheduler) and Ctrl-C end a study at the next safe point: the
    trial being told finishes its Optuna/MLflow/dataset writes, running trials are stopped,
    finished ones kept. A second signal interrupts at once. Only the main thread may install
    handlers; elsewhere the study simply runs to its budget."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None  # the first signal received
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _count_existing(study: optuna.Study, outcome: StudyOutcome) -> None:
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        stored = StoredTrial.of(t)
        _count(outcome, TrialStatus(stored.status), stored.preemptions)
    for t in _infra_failed_trials(study):  # told FAIL, but finished and recorded: they count
        _count(outcome, TrialStatus.INFRA_ERROR, 0)
    _update_best(study, outcome)


def _infra_failed_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials told FAIL because infrastructure spoiled every attempt (not the killed ones)."""
    return [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
            if StoredTrial.of(t).status == TrialStatus.INFRA_ERROR.value]


def _count(outcome: StudyOutcome, status: TrialStatus, preemptions: int) -> None:
    outcome.trials_done += 1
    if status is TrialStatus.INFRA_ERROR:
        outcome.infra_failed += 1
        return
    if status is TrialStatus.OK:
        outcome.ok += 1
        if preemptions > 0:
            outcome.preempting += 1
    elif status.is_startup_failure:
        outcome.startup_failed += 1
    elif status is TrialStatus.PRUNED:
        outcome.pruned += 1
    else:
        outcome.other_failed += 1


#: The study user attr holding its end's headroom (:class:`servetune.search.headroom.StudyHeadroom`).
HEADROOM_ATTR = "headroom"


def ranked_flag_sets(study: optuna.Study) -> list[tuple[int, dict[str, Any]]]:
    """The feasible flag sets, best first (the confirmed winner first), one trial per flag set."""
    sign = 1.0 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else -1.0
    feasible = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                if t.constraints and all(c <= 0 for c in t.constraints.values()) and t.values]
    confirmed = (study.user_attrs.get("confirmation") or {}).get("winner")
    feasible.sort(key=lambda t: (t.number != confirmed, -sign * t.values[0]))
    out: list[tuple[int, dict[str, Any]]] = []
    for t in feasible:
        flags = StoredTrial.of(t).flags
        if all(flags != f for _, f in out):
            out.append((t.number, flags))
    return out


def _update_best(study: optuna.Study, outcome: StudyOutcome) -> None:
    best = best_trial(study)
    if best is not None:
        outcome.best_number = best.number
        stored = StoredTrial.of(best)
        outcome.best_flags, outcome.best_metrics = stored.flags, stored.metrics


def _finish_study(spec: StudySpec, study: optuna.Study, tracker: StudyTracker, outcome: StudyOutcome,
                  status: str) -> None:
    df = dataset.read_trials(Path(spec.output.dataset_dir), study=spec.name)
    plots: dict[str, Any] = {}
    everything = df
    if "repeat" in df.columns:  # the plots show the search; confirmation repeats stay in the table
        df = df[df["repeat"].isna()]
    if not df.empty:
        pareto = (list(zip(spec.objective.metrics, spec.objective.directions))
                  if len(spec.objective.metrics) > 1 else None)
        figures = report.study_plots(df, spec.objective.metrics[0], pareto=pareto)
        plots = {f"{stem}.png": fig for stem, fig in figures.items()}
    if outcome.best_flags is not None:
        outcome.best_command = to_command_line(spec.serve_model, outcome.best_flags)
    summary = dict(outcome.best_metrics or {})
    files: dict[str, str] = {}
    if outcome.headroom is not None:  # the winner's headroom: its curve, figures and JSON on the parent run
        plots["headroom.png"] = report.plot_headroom(outcome.headroom)
        summary.update(headroom.StudyHeadroom.from_dict(outcome.headroom).metrics())
        files["headroom.json"] = json.dumps(outcome.headroom, indent=2, sort_keys=True)
        folder = Path(spec.output.dataset_dir).parent / "headroom"  # beside the dataset, for `servetune report`
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{spec.name}.json").write_text(files["headroom.json"], encoding="utf-8")
    tracker.finish_study(outcome.best_flags, spec.serve_model, everything, plots, summary, files=files)
    tracker.end(status)
    left = tracker.flush(wait_s=tracker.flush_wait_s)  # bounded wait for a server that went away
    if left:
        print(f"servetune: MLflow unreachable; {left} buffered operations kept in {tracker.buffer_dir} "
              "(delivered by the next run of this study, e.g. --resume)", file=sys.stderr)
    finished = sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))
    record = {"at": dt.datetime.now(dt.timezone.utc).isoformat(), "finished": finished,
              "experiment_id": outcome.experiment_id, "parent_run_id": outcome.parent_run_id}
    retry_call(lambda: study.set_user_attr("finished_at", record["at"]), what="mark the study finished")
    if not left:  # a write still buffered for MLflow: the next --resume delivers it, so it is no no-op
        retry_call(lambda: study.set_user_attr(FINISHED, record), what="mark the study finished")
