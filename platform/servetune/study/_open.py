"""Opening a study: the sampler, the Optuna study (created, or loaded with ``--resume``), the trials a
stopped driver left unfinished, and the ``--resume`` that has nothing left to do (decided from Optuna
alone, before MLflow or a pool starts)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna

from servetune.errors import SpecError
from servetune.planner.flags import flags_key, to_command_line
from servetune.records import open_storage, retry_call
from servetune.spec.schema import StudySpec
from servetune.study._outcome import StudyOutcome, count_existing


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


def recover_interrupted(study: optuna.Study) -> int:
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


def open_study(spec: StudySpec, resume: bool) -> tuple[optuna.Study, list[optuna.trial.FrozenTrial]]:
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
        directions=[optuna.study.StudyDirection[d.upper()] for d in spec.objective.directions],
        sampler=make_sampler(spec.sampler, spec.seed, n_obj, grid),
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


def nothing_to_do(spec: StudySpec, study: optuna.Study) -> StudyOutcome | None:
    """The outcome of a ``--resume`` that would run nothing (:func:`resume_is_noop`), read from
    Optuna alone (no MLflow, no pool); None when the resume has work to do."""
    trials = study.get_trials(deepcopy=False)
    finished = sum(t.state.is_finished() for t in trials)
    unfinished = sum(t.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING) for t in trials)
    requeue = sum(t.state == optuna.trial.TrialState.FAIL and "status" not in t.user_attrs and bool(t.params)
                  for t in trials)
    outcome = StudyOutcome(spec.name, mlflow_uri=spec.tracking.mlflow_uri)
    count_existing(study, outcome)
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
