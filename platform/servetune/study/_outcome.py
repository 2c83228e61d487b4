"""What a study's trials add up to: :class:`StudyOutcome` (counts, the best trial, where things are)
and the readers of the told trials (the best, the ranked flag sets, the infrastructure failures)."""

from __future__ import annotations

import dataclasses
from typing import Any

import optuna

from servetune.result import TrialStatus
from servetune.search.propose import StoredTrial

#: The study user attr holding its end's headroom (:class:`servetune.search.headroom.StudyHeadroom`).
HEADROOM_ATTR = "headroom"


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
    feasible = feasible_trials(study)
    if not feasible:
        return None
    sign = 1.0 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else -1.0
    return max(feasible, key=lambda t: sign * (t.values or [0.0])[0])


def feasible_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The completed trials that meet every constraint, in trial order."""
    return [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if t.constraints and all(c <= 0 for c in t.constraints.values()) and t.values]


def ranked_flag_sets(study: optuna.Study) -> list[tuple[int, dict[str, Any]]]:
    """The feasible flag sets, best first (the confirmed winner first), one trial per flag set."""
    sign = 1.0 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else -1.0
    feasible = feasible_trials(study)
    confirmed = (study.user_attrs.get("confirmation") or {}).get("winner")
    feasible.sort(key=lambda t: (t.number != confirmed, -sign * (t.values or [0.0])[0]))
    out: list[tuple[int, dict[str, Any]]] = []
    for t in feasible:
        flags = StoredTrial.of(t).flags
        if all(flags != f for _, f in out):
            out.append((t.number, flags))
    return out


def update_best(study: optuna.Study, outcome: StudyOutcome) -> None:
    best = best_trial(study)
    if best is not None:
        _set_best(outcome, best)


def _set_best(outcome: StudyOutcome, best: optuna.trial.FrozenTrial | optuna.trial.Trial) -> None:
    outcome.best_number = best.number
    stored = StoredTrial.of(best)
    outcome.best_flags, outcome.best_metrics = stored.flags, stored.metrics


class BestSoFar:
    """:func:`update_best` as one dispatch loop tells trials: the study is read at the first
    feasible trial (the best so far, and whether a confirmed or headroom winner fixes it), then each
    feasible trial is compared with the best so far as :func:`best_trial` compares them (the first
    objective; of equal values, the lowest trial number). The driver is the study's one writer,
    and the winners are set after the trials, so the study need not be read again for each trial."""

    def __init__(self) -> None:
        self._sign = 0.0  # 0: the study not read yet
        self._fixed = False  # a confirmed or headroom winner is the best whatever is told
        self._best: tuple[float, int] | None = None  # (sign x first objective, trial number)

    def told(self, study: optuna.Study, outcome: StudyOutcome, trial: optuna.trial.Trial, value: float) -> None:
        """``trial``, feasible, was told COMPLETE with ``value`` as its first objective."""
        if not self._sign or self._fixed:
            self._sign = 1.0 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else -1.0
            attrs = study.user_attrs
            self._fixed = (attrs.get(HEADROOM_ATTR) or {}).get("selected") is not None \
                or (attrs.get("confirmation") or {}).get("winner") is not None
            best = best_trial(study)  # this trial included
            if best is not None:
                _set_best(outcome, best)
                self._best = (self._sign * (best.values or [0.0])[0], best.number)
            return
        mine = (self._sign * value, trial.number)
        if self._best is None or mine[0] > self._best[0] or (mine[0] == self._best[0] and mine[1] < self._best[1]):
            self._best = mine
            _set_best(outcome, trial)


def count_existing(study: optuna.Study, outcome: StudyOutcome) -> None:
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        stored = StoredTrial.of(t)
        count(outcome, TrialStatus(stored.status), stored.preemptions)
    for t in infra_failed_trials(study):  # told FAIL, but finished and recorded: they count
        count(outcome, TrialStatus.INFRA_ERROR, 0)
    update_best(study, outcome)


def infra_failed_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials told FAIL because infrastructure spoiled every attempt (not the killed ones)."""
    return [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
            if StoredTrial.of(t).status == TrialStatus.INFRA_ERROR.value]


def count(outcome: StudyOutcome, status: TrialStatus, preemptions: int) -> None:
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


