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

    from servetune.spec.schema import load_spec
    from servetune.study import run_study
    outcome = run_study(load_spec("jobs/quickstart.yaml"))
    print(outcome.best_command)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
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
from servetune.cluster import _ray_session
from servetune.cluster.pool import TrialPool
from servetune.engines import TrialTask, resolve_backend
from servetune.engines.vllm.engine import read_serve_help
from servetune.errors import SpecError
from servetune.planner.flags import gpus_needed, to_command_line
from servetune.records import dataset, report
from servetune.records._retry import retry_call
from servetune.records._storage import open_storage
from servetune.records.tracking import StudyTracker
from servetune.redact import redact_text
from servetune.result import TrialResult, TrialStatus
from servetune.search import confirm, warmstart
from servetune.search import screen as fidelity
from servetune.search.propose import (FEASIBLE, INFEASIBLE, Proposal, constraint_values, early_stop_rule,
                                      enqueue_informed_starts, objective_values, prediction_tags, propose, sim_screen,
                                      tell)
from servetune.spec.schema import StudySpec
from servetune.workload import Workload

if TYPE_CHECKING:
    from servetune.engines.early_stop import EarlyStop
    from servetune.search.screen import SimScreen
    from servetune.search.warmstart import WarmStart
    from servetune.planner.memory import MemoryPlan

__all__ = ["StudyOutcome", "run_study", "remeasure", "make_sampler", "constraint_values", "objective_values", "best_trial",
           "INFEASIBLE", "FEASIBLE"]


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
    confirmation: dict[str, Any] | None = None  # budget.confirm_top: servetune.search.confirm.Choice.to_dict()


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
    user attr ``confirmation``) instead of the best single measurement.
    """
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

    def show(self, o: StudyOutcome, running: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and not self.tty and now - self._last < 5:
            return
        self._last = now
        best = "-" if o.best_metrics is None else f"{o.best_metrics.get('output_throughput', 0):,.0f} tok/s (#{o.best_number})"
        line = (f"trials {o.trials_done}/{self.total} | running {running} | ok {o.ok} | preempting {o.preempting}"
                f" | startup failed {o.startup_failed} | pruned {o.pruned} | other failed {o.other_failed}"
                + (f" | infra failed {o.infra_failed}" if o.infra_failed else "")
                + f" | best {best}")
        self.out.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.out.flush()

    def note(self, text: str) -> None:
        self.out.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.out.flush()


def _recover_interrupted(study: optuna.Study) -> int:
    """Trials left RUNNING by a killed driver: mark FAIL and enqueue their params again."""
    n = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        study.enqueue_trial(t.params, skip_if_exists=True)
        n += 1
    return n


def run_study(
    spec: StudySpec,
    *,
    resume: bool = False,
    out: TextIO | None = None,
    on_result: Callable[[int, dict[str, Any], TrialResult], None] | None = None,
) -> StudyOutcome:
    """Run (or resume) the study the spec describes; returns its outcome.

    Trials dispatch to Ray while ``budget.parallel`` and free GPUs allow; the loop ends when
    ``budget.trials`` are told or ``budget.time_limit_s`` is spent. Ctrl-C kills the running
    trials, ends their MLflow runs as KILLED and keeps every finished trial.
    """
    out = out or sys.stdout
    started = time.monotonic()
    backend = resolve_backend(spec.backend)
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
    if existing:
        # Sampler state is not stored: reseeded with the spec's seed, a resumed study would draw
        # the pairs it has already measured again. Offset the seed by the trials already told.
        study.sampler = make_sampler(spec.sampler, spec.seed + len(existing), n_obj, grid)
    if existing and not resume:
        raise SpecError("name", f"study {spec.name!r} already has {len(existing)} trials in {storage}",
                        "pass --resume to continue it, or give the study a new name")
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
    parent = tracker.start_study(spec.name, spec.to_dict(), {
        "model": spec.model_ref, "gpu_type": spec.gpu.type, "backend": backend,
        "vllm_version": spec.vllm_version, "sampler": spec.sampler}, resume=resume)
    recovered = _recover_interrupted(study) if resume else 0
    reconciled = _reconcile(spec, study, tracker, backend) if resume else 0
    # A grid is the baseline every point of which is measured: informed starts would only reorder it.
    # Warm starts and the baseline, like the informed starts, only go into a study nobody has
    # enqueued anything in yet (the nightly job enqueues its own warm start).
    fresh = not existing and spec.sampler != "grid" and not study.get_trials(deepcopy=False)
    starts = enqueue_informed_starts(spec, study) if not existing and spec.sampler != "grid" else []
    warm, baseline = _enqueue_warm_and_baseline(spec, study) if fresh else ([], None)

    outcome = StudyOutcome(spec.name, mlflow_uri=spec.tracking.mlflow_uri, parent_run_id=parent)
    _count_existing(study, outcome)
    progress = _Progress(out, spec.budget.trials)
    progress.note(f"servetune: study {spec.name!r}: {spec.model_ref} on {spec.gpu.count} x {spec.gpu.type} "
                  f"({backend} backend), {spec.budget.trials} trials, {spec.budget.parallel} at a time"
                  + (f"; resumed, {recovered} interrupted trials re-queued" if recovered else "")
                  + (f", {reconciled} told trials written to MLflow/dataset" if reconciled else ""))
    if starts:
        progress.note("servetune: informed starts (highest utilization that starts, max_num_seqs under the "
                      f"preemption bound): {', '.join(str(p) for p in starts)}")
    for ws in warm:
        progress.note(f"servetune: warm start from study {ws.study!r} ({ws.model}, vLLM {ws.vllm_version}, "
                      f"distance {ws.distance:.2f}, best {ws.objective:,.0f}): {ws.params}")
    if baseline:
        progress.note(f"servetune: baseline trial (vLLM's defaults for the searched flags): {baseline}")
    progress.note(f"servetune: MLflow {spec.tracking.mlflow_uri} (experiment {spec.tracking.experiment!r}), "
                  f"Optuna {storage}")

    # The GPU type binds at the first submit, and only on a cluster whose nodes advertise types: a
    # local logical-GPU Ray (possibly shared by several studies in one process) stays untyped.
    # A local Ray left by an earlier, killed driver of this study is stopped first; the local Ray
    # this driver starts is recorded so that the next start can do the same (servetune.cluster._ray_session).
    reaped = _ray_session.reap_leftovers(runs_dir, spec.name)
    if reaped:
        progress.note(f"servetune: stopped {len(reaped)} processes left by the earlier driver's local Ray")
    # Reading `vllm serve --help=all` imports vLLM (20-30 s on the H200 host). Read once here and
    # sent with every trial, instead of by the first trial of every GPU slot (measured: 36 s of
    # servetune overhead on each of the first two real trials, 4-6 s on the others).
    serve_help = None
    if backend == "vllm":
        serve_help = read_serve_help(envs.serve_command())
    pool = TrialPool.start(num_gpus=spec.gpu.count, num_cpus=max(2, spec.budget.parallel))
    pool.reuse_actors = True  # closed in the finally below
    if pool.started_local_ray:
        _ray_session.record_local_session(runs_dir, spec.name)
    queued: list[tuple[optuna.trial.Trial, dict[str, Any], int]] = []  # asked, waiting for free GPUs
    # Multi-fidelity: a fresh calibration per driver run (a resumed study recalibrates from its
    # next real trials); ``sims`` holds the simulated twin of each dispatched trial.
    screen = fidelity.screen_for(spec, backend)
    if screen is not None and existing:
        _recalibrate(spec, screen, existing, backend)
    sims: dict[int, TrialResult] = {}
    inflight: dict[int, tuple[optuna.trial.Trial, dict[str, Any]]] = {}
    status = "FINISHED"
    infra_seen = quarantine_seen = 0  # pool.infra_notes / pool.quarantine_notes already shown
    stop = _StopRequest()
    try:
        while True:
            stop.check()
            out_of_time = spec.budget.time_limit_s is not None and time.monotonic() - started > spec.budget.time_limit_s
            while (not out_of_time and outcome.trials_done + len(inflight) + len(queued) < spec.budget.trials
                   and len(inflight) + len(queued) < spec.budget.parallel):
                proposal = _propose_with_retry(spec, study, pool.total_gpus, backend,
                                               {*inflight, *(t.number for t, _, _ in queued)})
                trial, flags, need = proposal.trial, proposal.flags, proposal.gpus
                if proposal.refused is not None:  # invalid or predicted to fail: no GPU time spent
                    _finish(spec, study, trial, flags, proposal.refused, tracker, outcome, backend, on_result,
                            prediction=proposal.plan)
                    continue
                screened = _screen_on_sim(spec, screen, proposal, outcome, backend, sims)
                if screened is not None:  # the calibrated simulator rules it out: no GPU time spent
                    _finish(spec, study, trial, flags, screened[0], tracker, outcome, backend, on_result,
                            extra_tags=screened[1])
                    continue
                queued.append((trial, flags, need))
            while queued and queued[0][2] <= pool.free_gpus:  # first come, first served
                trial, flags, need = queued.pop(0)
                task = _trial_task(spec, flags, runs_dir / "trials" / spec.name / f"{trial.number:04d}", serve_help,
                                   early_stop=_early_stop_rule(spec, outcome, backend))
                pool.submit(trial.number, task, backend, gpus=need)
                inflight[trial.number] = (trial, flags)
            # A quarantined slot shrinks the pool: a queued trial that can no longer fit ends as an
            # infrastructure failure (told FAIL, not a bad configuration) instead of waiting forever.
            while queued and queued[0][2] > pool.total_gpus:
                trial, flags, need = queued.pop(0)
                # The machine's fault, not the flags': told FAIL (never learnt as infeasible).
                result = TrialResult(status=TrialStatus.INFRA_ERROR, infrastructure="gpu_unusable", backend=backend,
                                     cause=f"infrastructure failure: needs {need} GPUs; {pool.total_gpus} healthy "
                                           f"GPUs left after quarantine of {', '.join(pool.quarantined) or 'none'}")
                _finish(spec, study, trial, flags, result, tracker, outcome, backend, on_result)
            if not inflight and not queued:
                if pool.total_gpus == 0:
                    progress.note("servetune: every GPU slot is quarantined; stopping the study")
                    break
                if outcome.trials_done >= spec.budget.trials or out_of_time:
                    break
                continue
            progress.show(outcome, len(inflight))
            results = pool.wait(timeout_s=0.5)
            for line in pool.infra_notes[infra_seen:]:  # the pool re-runs these itself (bounded)
                progress.note(f"servetune: infrastructure failure, re-run elsewhere when possible: trial #{line}")
            infra_seen = len(pool.infra_notes)
            for note in pool.quarantine_notes[quarantine_seen:]:
                if "infrastructure failures" in note:  # (memory left behind is reported with its trial below)
                    progress.note(f"servetune: slot quarantined: {note}")
            quarantine_seen = len(pool.quarantine_notes)
            for number, result in results:
                trial, flags = inflight.pop(number)
                if screen is not None and number in sims:  # recalibrate on the real measurement
                    screen.observe(sims.pop(number), result)
                _finish(spec, study, trial, flags, result, tracker, outcome, backend, on_result)
                if result.quarantined_gpus:
                    progress.note(f"servetune: GPU memory did not come back after trial #{number}: "
                                  f"GPUs {', '.join(result.quarantined_gpus)} quarantined")
                progress.show(outcome, len(inflight), force=True)
                stop.check()
        if spec.budget.confirm_top > 0 and pool.total_gpus > 0:
            _confirm_top(spec, study, pool, tracker, outcome, backend, runs_dir, progress, stop, serve_help)
    except KeyboardInterrupt:
        status = "KILLED"
        killed = pool.cancel_all()
        # Every RUNNING trial is this driver's (it is the only writer), including one asked a
        # moment before the signal and not yet tracked in ``inflight``: fail them all.
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        progress.note(f"\nservetune: interrupted; {len(killed)} running trials stopped, "
                      f"{outcome.trials_done} finished trials kept (resume with --resume)")
    finally:
        pool.close()
        stop.restore()
        outcome.wall_s = time.monotonic() - started
        progress.show(outcome, 0, force=True)
        if out.isatty():
            out.write("\n")
        _finish_study(spec, study, tracker, outcome, status)
    return outcome


def remeasure(spec: StudySpec, flags: Mapping[str, Any], seeds: Sequence[int],
              backend: str | None = None) -> list[TrialResult]:
    """``flags`` measured again once per engine seed (the workload keeps its own seed), on the
    Ray pool with the same task settings as the study's trials (:func:`_trial_task`); the
    results in seed order, an infrastructure failure or a flag set no slot fits left out.
    Not Optuna trials and not recorded: the nightly job's noise estimate."""
    backend = backend or resolve_backend(spec.backend)
    runs_dir = Path(spec.output.runs_dir)
    serve_help = read_serve_help(envs.serve_command()) if backend == "vllm" else None
    need = gpus_needed(flags)
    pool = TrialPool.start(num_gpus=spec.gpu.count, num_cpus=max(2, spec.budget.parallel))
    todo = list(enumerate(seeds, start=1))
    inflight: set[int] = set()
    done: dict[int, TrialResult] = {}
    try:
        while todo or inflight:
            while todo and need <= pool.free_gpus:
                k, seed = todo.pop(0)
                pool.submit(k, _trial_task(spec, dict(flags), runs_dir / "trials" / spec.name / f"remeasure-{k}",
                                           serve_help, seed=seed), backend, gpus=need)
                inflight.add(k)
            if not inflight:  # nothing fits any more (quarantined GPUs)
                break
            for k, result in pool.wait(timeout_s=0.5):
                inflight.discard(k)
                if not result.status.is_infrastructure:
                    done[k] = result
    finally:
        pool.close()
    return [done[k] for k in sorted(done)]


def _confirm_top(spec: StudySpec, study: optuna.Study, pool: TrialPool, tracker: StudyTracker,
                 outcome: StudyOutcome, backend: str, runs_dir: Path, progress: _Progress, stop: _StopRequest,
                 serve_help: str | None = None) -> None:
    """Re-run the top ``budget.confirm_top`` feasible configurations ``budget.confirm_repeats``
    times each (another workload and engine seed per repeat; :mod:`servetune.search.confirm`), record
    each repeat (MLflow ``servetune.role=repeat``, a dataset row with ``repeat``), and choose the
    winner on the confirmed means. The repeats are not Optuna trials: the choice is stored as the
    study's user attr ``confirmation``, which :func:`best_trial` honours."""
    sign = 1.0 if spec.objective.directions[0] == "maximize" else -1.0
    feasible = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                if t.constraints and all(c <= 0 for c in t.constraints.values()) and t.values]
    feasible.sort(key=lambda t: -sign * t.values[0])
    top: list[optuna.trial.FrozenTrial] = []
    for t in feasible:
        if all(t.user_attrs.get("flags", t.params) != o.user_attrs.get("flags", o.params) for o in top):
            top.append(t)
        if len(top) == spec.budget.confirm_top:
            break
    if not top:
        return
    runs: dict[int, list[tuple[float, bool]]] = {t.number: [(t.values[0], True)] for t in top}
    todo = [(t, k) for k in range(1, spec.budget.confirm_repeats + 1) for t in top]
    progress.note(f"servetune: confirming the top {len(top)} configurations (trials "
                  f"{', '.join(f'#{t.number}' for t in top)}), {spec.budget.confirm_repeats} repeats each")
    inflight: dict[int, tuple[optuna.trial.FrozenTrial, int, Workload]] = {}
    key = 1_000_000  # pool keys of repeats, apart from trial numbers
    while todo or inflight:
        stop.check()
        while todo:
            t, k = todo[0]
            flags = dict(t.user_attrs.get("flags", t.params))
            need = gpus_needed(flags)
            if need > pool.free_gpus:
                break
            todo.pop(0)
            workload = dataclasses.replace(spec.workload, seed=spec.workload.seed + k)
            task = _trial_task(spec, flags, runs_dir / "trials" / spec.name / f"{t.number:04d}-repeat-{k}",
                               serve_help, workload=workload, seed=spec.seed + k, repeat=k)
            key += 1
            pool.submit(key, task, backend, gpus=need)
            inflight[key] = (t, k, workload)
        if not inflight:  # nothing fits any more (quarantined GPUs): confirm on what was measured
            break
        for done_key, result in pool.wait(timeout_s=0.5):
            t, k, workload = inflight.pop(done_key)
            if result.status.is_infrastructure:  # the machine failed, not the flags: not a sample
                progress.note(f"servetune: repeat {k} of trial #{t.number} lost to an infrastructure failure: "
                              f"{result.cause}")
                continue
            value = objective_values(spec, result)[0]
            ok = all(v <= 0 for v in constraint_values(spec, result).values())
            runs[t.number].append((value, ok))
            _record(spec, t.number, dict(t.user_attrs.get("flags", t.params)), result, value, tracker, backend,
                    extra_tags={"servetune.origin": "repeat", "servetune.repeat": str(k)}, repeat=k,
                    workload=workload)
    choice = confirm.choose([confirm.confirm(t.number, t.user_attrs.get("flags", t.params),
                                             [v for v, _ in runs[t.number]], [f for _, f in runs[t.number]])
                             for t in top], spec.objective.directions[0])
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


def _enqueue_warm_and_baseline(spec: StudySpec, study: optuna.Study
                               ) -> tuple[list[WarmStart], dict[str, Any] | None]:
    """Warm starts from earlier studies in the dataset, then the baseline trial
    (:mod:`servetune.search.warmstart`); enqueued after the informed starts, so those run first."""
    return warmstart.enqueue_warm_starts(spec, study), warmstart.enqueue_baseline(spec, study)


def _screen_on_sim(spec: StudySpec, screen: SimScreen | None, proposal: Proposal, outcome: StudyOutcome,
                   backend: str, sims: dict[int, TrialResult]) -> tuple[TrialResult, dict[str, str]] | None:
    """Multi-fidelity (:mod:`servetune.search.screen`): ``(pruned result, MLflow tags)`` when the
    calibrated simulator rules the proposal out, else None (its simulated twin kept in ``sims``
    to recalibrate on the real result)."""
    best = (outcome.best_metrics or {}).get("output_throughput")
    screened = sim_screen(spec, screen, proposal, best, backend)
    if screened is None:
        return None
    refusal, sim = screened
    if refusal is None:
        sims[proposal.trial.number] = sim
        return None
    return refusal, fidelity.prediction_tags(refusal, fidelity.prediction_attrs(sim))


def _recalibrate(spec: StudySpec, screen: SimScreen, told: list[optuna.trial.FrozenTrial], backend: str) -> None:
    """A resumed study's screen starts from the trials it already measured (not the refused ones)."""
    measured = []
    for t in told:
        status = t.user_attrs.get("status", "ok")
        if t.state != optuna.trial.TrialState.COMPLETE or status in (TrialStatus.PRUNED.value, TrialStatus.INVALID_CONFIG.value):
            continue
        result = TrialResult.from_metrics(status, t.user_attrs.get("cause") or None, t.user_attrs.get("metrics", {}),
                                          backend=backend, vllm_version=spec.vllm_version)
        result.early_stopped = t.user_attrs.get("early_stopped")
        measured.append((dict(t.user_attrs.get("flags", t.params)), result))
    fidelity.recalibrate(screen, spec, measured)


def _early_stop_rule(spec: StudySpec, outcome: StudyOutcome, backend: str) -> EarlyStop | None:
    """The early-stop rule handed to the next real trial: the preemption constraint and the best
    feasible throughput so far (:mod:`servetune.engines.early_stop`). Only the vllm backend measures over
    time; the sim and replay backends answer at once."""
    if backend != "vllm":
        return None
    best = (outcome.best_metrics or {}).get("output_throughput")
    return early_stop_rule(spec, best)


def _trial_task(spec: StudySpec, flags: dict[str, Any], log_dir: Path, serve_help: str | None,
                **varies: Any) -> TrialTask:
    """One launch's task: the model, GPU, measurement and environment settings from the spec and
    ``servetune.envs``; ``varies`` sets what differs per launch (``early_stop``, or a repeat's
    ``workload``, ``seed`` and ``repeat``)."""
    fields: dict[str, Any] = {"workload": spec.workload, "seed": spec.seed, **varies}
    return TrialTask(model=spec.model_ref, gpu=spec.gpu.type, flags=flags, vllm_version=spec.vllm_version,
                     gpu_file=spec.gpu.file, serve_model=spec.serve_model, serve_command=envs.serve_command(),
                     startup_timeout_s=spec.measurement.startup_timeout_s or envs.startup_timeout_s(),
                     load_generator=spec.measurement.load_generator, stall_timeout_s=spec.measurement.stall_timeout_s,
                     compile_cache_dir=envs.compile_cache_dir(), serve_help=serve_help, log_dir=str(log_dir),
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
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _count_existing(study: optuna.Study, outcome: StudyOutcome) -> None:
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        _count(outcome, TrialStatus(t.user_attrs.get("status", "ok")), int(t.user_attrs.get("preemptions", 0) or 0))
    for t in _infra_failed_trials(study):  # told FAIL, but finished and recorded: they count
        _count(outcome, TrialStatus.INFRA_ERROR, 0)
    _update_best(study, outcome)


def _infra_failed_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials told FAIL because infrastructure spoiled every attempt (not the killed ones)."""
    return [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
            if t.user_attrs.get("status") == TrialStatus.INFRA_ERROR.value]


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


def _update_best(study: optuna.Study, outcome: StudyOutcome) -> None:
    best = best_trial(study)
    if best is not None:
        outcome.best_number = best.number
        outcome.best_flags = dict(best.user_attrs.get("flags", best.params))
        outcome.best_metrics = dict(best.user_attrs.get("metrics", {}))


def _finish(
    spec: StudySpec, study: optuna.Study, trial: optuna.trial.Trial, flags: dict[str, Any], result: TrialResult,
    tracker: StudyTracker, outcome: StudyOutcome, backend: str,
    on_result: Callable[[int, dict[str, Any], TrialResult], None] | None, *,
    prediction: MemoryPlan | None = None, extra_tags: Mapping[str, str] | None = None,
) -> None:
    """Tell Optuna, then MLflow, then the dataset: in that order, so a crash loses at most the record.

    ``prediction`` is the planner's verdict of a pruned trial: its tags go to MLflow and its
    predicted failure to the dataset (``predicted_failure``).
    """
    objective = retry_call(lambda: tell(spec, study, trial, result), what=f"tell trial #{trial.number}")
    origin = warmstart.origin_of(trial.user_attrs)
    _record(spec, trial.number, flags, result, objective[0], tracker, backend, prediction=prediction,
            extra_tags={"servetune.origin": origin, **(extra_tags or {})})
    _count(outcome, result.status, result.preemptions or 0)
    outcome.infra_retried += bool(result.infra_attempts) and not result.status.is_infrastructure
    _update_best(study, outcome)
    if on_result is not None:
        on_result(trial.number, flags, result)


def _record(spec: StudySpec, number: int, flags: dict[str, Any], result: TrialResult, objective: float,
            tracker: StudyTracker, backend: str, *, prediction: MemoryPlan | None = None,
            mlflow: bool = True, rows: bool = True, extra_tags: Mapping[str, str] | None = None,
            repeat: int | None = None, workload: Workload | None = None) -> None:
    """Write one told trial to MLflow (a child run) and the Parquet dataset."""
    tags = {"gpu_type": spec.gpu.type, "model": spec.model_ref, "backend": result.backend or backend,
            "vllm_version": result.vllm_version or spec.vllm_version, "optuna.trial_number": str(number),
            "servetune.study": spec.name, **(extra_tags or {})}
    extra: dict[str, Any] = {"backend": result.backend or backend,
                             "vllm_version": result.vllm_version or spec.vllm_version, "objective": objective}
    if result.infra_attempts:  # the machine failed this flag set before (the lines are in the evidence)
        tags["servetune.infra_attempts"] = str(len(result.infra_attempts))
    if result.status is TrialStatus.PRUNED and prediction is not None:
        tags.update(prediction_tags(prediction))
        extra["predicted_failure"] = tags["servetune.predicted_failure"]
    if "servetune.origin" in tags:
        extra["origin"] = tags["servetune.origin"]
    if "servetune.sim_screen" in tags:  # a multi-fidelity screen: the simulated figures it rests on
        extra["sim_screen"] = tags["servetune.sim_screen"]
        extra["predicted_output_throughput"] = float(tags["servetune.predicted_output_throughput"])
        extra["predicted_preemptions"] = float(tags["servetune.predicted_preemptions"])
    if result.early_stopped:
        tags["servetune.early_stopped"] = result.early_stopped[:250]
        extra["early_stopped"] = result.early_stopped
    if repeat is not None:  # a confirmation re-run of trial ``number``'s flags
        extra["repeat"] = repeat
    if mlflow:
        # A real trial's folder (its /metrics dumps, gauges, `vllm bench serve` output) goes along
        # under files/; the server log is already the run's engine.log.
        trial_dir = Path(spec.output.runs_dir) / "trials" / spec.name / (
            f"{number:04d}" if repeat is None else f"{number:04d}-repeat-{repeat}")
        tracker.log_trial(number, flags, result, tags, workload=(workload or spec.workload).to_dict(),
                          artifacts_dir=trial_dir if (result.backend or backend) == "vllm" and trial_dir.is_dir() else None,
                          role="trial" if repeat is None else "repeat",
                          run_name=None if repeat is None else f"trial-{number:03d}-repeat-{repeat}")
    if rows:
        row = dataset.trial_row(spec.name, number, flags, result, spec.gpu.type, spec.model_ref, extra)
        dataset.append_trials(Path(spec.output.dataset_dir), [row])


def _reconcile(spec: StudySpec, study: optuna.Study, tracker: StudyTracker, backend: str) -> int:
    """Trials told to Optuna whose MLflow run or dataset row a killed driver never wrote.

    Optuna is told first (see :func:`_finish`), so after a SIGKILL it may hold a trial that MLflow
    or the dataset lack; they are written now from what Optuna stored (status, cause, flags,
    metrics), tagged ``servetune.reconciled``, so the three agree. Returns how many were written.
    """
    told = [*study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)),
            *_infra_failed_trials(study)]
    if not told:
        return 0
    in_mlflow = tracker.recorded_trial_numbers()
    df = dataset.read_trials(Path(spec.output.dataset_dir), study=spec.name)
    in_rows = {int(n) for n in df["trial_number"]} if not df.empty else set()
    written = 0
    for t in told:
        if t.number in in_mlflow and t.number in in_rows:
            continue
        result = TrialResult.from_metrics(t.user_attrs.get("status", "ok"), t.user_attrs.get("cause") or None,
                                          t.user_attrs.get("metrics", {}), backend=backend,
                                          vllm_version=spec.vllm_version)
        _record(spec, t.number, dict(t.user_attrs.get("flags", t.params)), result, (t.values or [0.0])[0],
                tracker, backend, mlflow=t.number not in in_mlflow, rows=t.number not in in_rows,
                extra_tags={"servetune.reconciled": "true"})
        written += 1
    return written


def _finish_study(spec: StudySpec, study: optuna.Study, tracker: StudyTracker, outcome: StudyOutcome,
                  status: str) -> None:
    df = dataset.read_trials(Path(spec.output.dataset_dir), study=spec.name)
    plots: dict[str, Any] = {}
    everything = df
    if "repeat" in df.columns:  # the plots show the search; confirmation repeats stay in the table
        df = df[df["repeat"].isna()]
    if not df.empty:
        plots["optimization_history.png"] = report.plot_history(df)
        if "flag_max_num_seqs" in df.columns:
            plots["throughput_vs_max_num_seqs.png"] = report.plot_throughput_vs(df, x="flag_max_num_seqs")
        if len(spec.objective.metrics) > 1:
            plots["pareto_front.png"] = report.plot_pareto(df, spec.objective.metrics[0], spec.objective.metrics[1])
        plots["memory_breakdown_top.png"] = report.plot_memory_breakdown(df, top_n=5)
    if outcome.best_flags is not None:
        outcome.best_command = to_command_line(spec.serve_model, outcome.best_flags)
    tracker.finish_study(outcome.best_flags, spec.serve_model, everything, plots, outcome.best_metrics or {})
    tracker.end(status)
    left = tracker.flush(wait_s=tracker.flush_wait_s)  # bounded wait for a server that went away
    if left:
        print(f"servetune: MLflow unreachable; {left} buffered operations kept in {tracker.buffer_dir} "
              "(delivered by the next run of this study, e.g. --resume)", file=sys.stderr)
    retry_call(lambda: study.set_user_attr("finished_at", dt.datetime.now(dt.timezone.utc).isoformat()),
               what="mark the study finished")
