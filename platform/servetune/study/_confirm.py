"""After the budget: the top ``budget.confirm_top`` feasible configurations measured again
``budget.confirm_repeats`` times each (another workload and engine seed per repeat;
:mod:`servetune.search.confirm`) on the dispatch loop, each repeat recorded (MLflow
``servetune.role=repeat``, a dataset row with ``repeat``), and the winner chosen on the confirmed
means, among them and any other feasible trial that already holds its repeats (measured on its own
start). The repeats are not Optuna trials: the choice is stored as the study's user attr
``confirmation``, which :func:`servetune.study.best_trial` honours."""

from __future__ import annotations

import functools

import optuna

from servetune.planner.flags import gpus_needed
from servetune.records import dataset, retry_call
from servetune.result import TrialResult
from servetune.search import confirm
from servetune.search.propose import StoredTrial, meets_constraints, objective_values, with_slo_figures
from servetune.spec.schema import StudySpec
from servetune.study._dispatch import Dispatcher, Job, Work, Write
from servetune.study._outcome import feasible_trials, update_best
from servetune.study._state import StudyRun
from servetune.study._tasks import SAME_START_REPEATS, repeat_workload, trial_task

Trial = optuna.trial.FrozenTrial
#: A repeat in the loop: the trial it repeats and its index (1, 2, ...).
Repeat = tuple[Trial, int]
#: Pool keys of repeats start above this, apart from trial numbers.
REPEAT_KEYS = 1_000_000


def top_and_held(spec: StudySpec, study: optuna.Study) -> tuple[list[Trial], list[Trial]]:
    """The top ``budget.confirm_top`` feasible trials (one per flag set, best first), and the other
    feasible ones that already hold their repeats, measured on their own start
    (``budget.confirm_on: same-start``): compared too, at no cost (a first window may have lost to
    the top's by less than the noise its repeats show)."""
    sign = 1.0 if spec.objective.directions[0] == "maximize" else -1.0
    feasible = sorted(feasible_trials(study), key=lambda t: -sign * (t.values or [0.0])[0])
    top: list[Trial] = []
    for t in feasible:
        if all(StoredTrial.of(t).flags != StoredTrial.of(o).flags for o in top):
            top.append(t)
        if len(top) == spec.budget.confirm_top:
            break
    held: list[Trial] = []
    for t in feasible if top else []:
        if (len(t.user_attrs.get(SAME_START_REPEATS, [])) >= spec.budget.confirm_repeats
                and all(StoredTrial.of(t).flags != StoredTrial.of(o).flags for o in top + held)):
            held.append(t)
    return top, held


class RepeatWork(Work[Repeat]):
    """The confirmation repeats as the dispatch loop's work: each result a sample of its trial."""

    def __init__(self, run: StudyRun, runs: dict[int, list[tuple[float, bool]]]) -> None:
        self.run, self.runs = run, runs

    def more(self) -> bool:
        return not self.run.stop.requested

    def tell(self, batch: list[tuple[Job[Repeat], TrialResult]], writes: list[Write]) -> None:
        run = self.run
        spec = run.spec
        for job, result in batch:
            t, k = job.payload
            if result.status.is_infrastructure:  # the machine failed, not the flags: not a sample
                run.progress.repeat_lost(k, t.number, result.cause)
                continue
            flags = StoredTrial.of(t).flags
            value = objective_values(spec, with_slo_figures(spec, flags, result))[0]
            self.runs[t.number].append((value, meets_constraints(spec, result)))
            record = run.recorder.repeat(t.number, flags, result, value, k)
            writes.append(functools.partial(run.recorder.write, record))


def confirm_top(run: StudyRun, dispatcher: Dispatcher[Repeat]) -> None:
    """Measure the missing repeats of the top configurations, then choose and store the winner."""
    spec, study = run.spec, run.study
    top, held = top_and_held(spec, study)
    if not top:
        return
    # Repeats a leading trial measured on its own start count; only the missing ones are started.
    runs: dict[int, list[tuple[float, bool]]] = {
        t.number: [((t.values or [0.0])[0], True)]
        + [(r["value"], r["feasible"]) for r in t.user_attrs.get(SAME_START_REPEATS, [])]
        for t in top + held}
    todo = [(t, k) for k in range(1, spec.budget.confirm_repeats + 1) for t in top if k >= len(runs[t.number])]
    run.progress.confirming([t.number for t in top], [t.number for t in held], spec.budget.confirm_repeats,
                            sum(len(v) - 1 for v in runs.values()))
    for i, (t, k) in enumerate(todo, start=1):
        flags = StoredTrial.of(t).flags
        task = functools.partial(trial_task, spec, flags, run.trial_dir(dataset.trial_dir_name(t.number, k)),
                                 workload=repeat_workload(spec, k), seed=spec.seed + k, repeat=k)
        dispatcher.add(Job(REPEAT_KEYS + i, gpus_needed(flags), (t, k), task))
    dispatcher.run(RepeatWork(run, runs))  # a repeat no slot fits any more: confirmed on what was measured
    choice = confirm.choose([confirm.confirm(t.number, StoredTrial.of(t).flags,
                                             [v for v, _ in runs[t.number]], [f for _, f in runs[t.number]])
                             for t in top + held], spec.objective.directions[0])
    summary = choice.to_dict()
    retry_call(lambda: study.set_user_attr("confirmation", summary), what="store the confirmation")
    run.outcome.confirmation = summary
    update_best(study, run.outcome)
    run.progress.confirmed(choice)
