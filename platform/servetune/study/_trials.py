"""The study's trials on the dispatch loop: propose while the budget and ``budget.parallel`` leave room
(a refused or screened proposal is told at once, no GPU time spent), launch the others as GPUs free
up, tell each result (Optuna, the counts, the best), then write it down (MLflow, the dataset,
``on_result``), until ``budget.trials`` are told or ``budget.time_limit_s`` is spent."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optuna

from servetune.cluster.base import Pool
from servetune.engines import TrialTask
from servetune.planner.comm import CommEnv
from servetune.records import dataset, retry_call
from servetune.records.trial_record import Prediction, Screen
from servetune.result import TrialResult, TrialStatus
from servetune.search import screen as fidelity
from servetune.search.propose import (Proposal, StoredTrial, WarmCompiles, constraint_values, meets_constraints,
                                      objective_values, propose, sim_screen, with_slo_figures)
from servetune.spec.schema import StudySpec
from servetune.study._dispatch import Dispatcher, Job, Work, Write
from servetune.study._outcome import BestSoFar, count
from servetune.study._state import StudyRun
from servetune.study._tasks import SAME_START_REPEATS, leader_repeats, trial_early_stop, trial_task

#: A trial in the loop: the asked Optuna trial and its flags.
Asked = tuple[optuna.trial.Trial, dict[str, Any]]
OnResult = Callable[[int, dict[str, Any], TrialResult], None]


def propose_with_retry(spec: StudySpec, study: optuna.Study, total_gpus: int, backend: str,
                       known_running: set[int], warm: WarmCompiles | None = None,
                       env: CommEnv | None = None) -> Proposal:
    """``propose`` retried on storage outages. An attempt that failed after ``study.ask`` leaves an
    asked trial nobody owns: before the next attempt it is told FAIL (samplers ignore FAIL trials
    and the budget counts told results only), so a retry never leaves a RUNNING orphan behind."""
    failed = False

    def attempt() -> Proposal:
        if failed:
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                if t.number not in known_running:
                    study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        return propose(spec, study, total_gpus, backend, warm=warm, env=env)

    def mark(_: BaseException) -> None:
        nonlocal failed
        failed = True

    return retry_call(attempt, what="ask Optuna for a trial", on_retry=mark)


def recalibrate(run: StudyRun, told: list[optuna.trial.FrozenTrial]) -> None:
    """A resumed study's screen starts from the trials it already measured (not the refused ones)."""
    if run.screen is None:
        return
    measured = []
    for t in told:
        stored = StoredTrial.of(t)
        if t.state != optuna.trial.TrialState.COMPLETE or stored.status in (TrialStatus.PRUNED.value,
                                                                            TrialStatus.INVALID_CONFIG.value):
            continue
        measured.append((stored.flags, stored.result(run.backend, run.spec.vllm_version)))
    fidelity.recalibrate(run.screen, run.spec, measured)


class TrialWork(Work[Asked]):
    """The trials of one driver run, as the dispatch loop's work."""

    def __init__(self, run: StudyRun, pool: Pool, on_result: OnResult | None) -> None:
        self.run, self._pool, self.on_result = run, pool, on_result
        self.sims: dict[int, TrialResult] = {}  # the simulated twin of each dispatched trial (multi-fidelity)
        self.infra_seen = self.quarantine_seen = 0  # pool.infra_notes / pool.quarantine_notes already shown
        self.gpu_wait_noted = False  # a trial waiting for Ray to place it was announced
        self.best = BestSoFar()  # the outcome's best, kept as trials are told

    # -- the loop's hooks -------------------------------------------------------------------------

    def refill(self, dispatcher: Dispatcher[Asked]) -> None:
        """Ask for trials while the budget and ``budget.parallel`` leave room; a refused or
        screened proposal is told at once (no GPU time spent), the others wait for GPUs."""
        run = self.run
        spec, outcome = run.spec, run.outcome
        if run.out_of_time():
            return
        while (outcome.trials_done + dispatcher.busy < spec.budget.trials
               and dispatcher.busy < spec.budget.parallel):
            proposal = propose_with_retry(spec, run.study, dispatcher.pool.total_gpus, run.backend, dispatcher.keys(),
                                          warm=run.recorder.compiles(), env=run.comm_env)
            trial, flags = proposal.trial, proposal.flags
            if proposal.refused is not None:  # invalid or predicted to fail: no GPU time spent
                self.tell_and_record(trial, flags, proposal.refused,
                                     prediction=None if proposal.plan is None else Prediction.from_plan(proposal.plan))
                continue
            screened = self._screen_on_sim(proposal)
            if screened is not None:  # the calibrated simulator rules it out: no GPU time spent
                self.tell_and_record(trial, flags, screened[0], screen=screened[1])
                continue
            dispatcher.add(Job(trial.number, proposal.gpus, (trial, flags), self._task(trial.number, flags)))

    def _task(self, number: int, flags: dict[str, Any]) -> Callable[[], TrialTask]:
        run = self.run

        def build() -> TrialTask:  # at submission: the early-stop rule and the leader's repeats read the best so far
            return trial_task(run.spec, flags, run.trial_dir(dataset.trial_dir_name(number)),
                              early_stop=trial_early_stop(run.spec, run.outcome, run.backend),
                              leader_repeats=leader_repeats(run.spec, run.outcome, run.backend, run.runs_dir, number))
        return build

    def unfit(self, job: Job[Asked]) -> None:
        # A quarantined slot shrinks the pool: a queued trial that can no longer fit ends as an
        # infrastructure failure (told FAIL, not a bad configuration) instead of waiting forever.
        trial, flags = job.payload
        pool = self._pool
        result = TrialResult(status=TrialStatus.INFRA_ERROR, infrastructure="gpu_unusable", backend=self.run.backend,
                             cause=f"infrastructure failure: needs {job.gpus} GPUs; {pool.total_gpus} healthy "
                                   f"GPUs left after quarantine of {', '.join(pool.quarantined) or 'none'}")
        self.tell_and_record(trial, flags, result)

    def done(self) -> bool:
        run = self.run
        if self._pool.total_gpus == 0:
            run.progress.all_quarantined()
            return True
        return run.outcome.trials_done >= run.spec.budget.trials or run.out_of_time()

    def before_wait(self, dispatcher: Dispatcher[Asked]) -> None:
        spec, progress, running = self.run.spec, self.run.progress, len(dispatcher.inflight)
        waiting = dispatcher.pool.check_placement(spec.budget.wait_for_gpus_s, spec.gpu.type)
        if waiting and not self.gpu_wait_noted:
            self.gpu_wait_noted = True
            progress.waits_for_gpus(waiting[0][0], waiting[0][1], spec.gpu.type, spec.budget.wait_for_gpus_s)
            progress.status(self.run.outcome, running, force=True, waiting=len(waiting))
        progress.status(self.run.outcome, running, waiting=len(waiting))

    def after_wait(self, dispatcher: Dispatcher[Asked]) -> None:
        pool, progress = dispatcher.pool, self.run.progress
        for line in pool.infra_notes[self.infra_seen:]:  # the pool re-runs these itself (bounded)
            progress.infra_rerun(line)
        self.infra_seen = len(pool.infra_notes)
        for note in pool.quarantine_notes[self.quarantine_seen:]:
            if "infrastructure failures" in note:  # (memory left behind is reported with its trial below)
                progress.slot_quarantined(note)
        self.quarantine_seen = len(pool.quarantine_notes)

    def more(self) -> bool:
        return not self.run.stop.requested and not self.run.out_of_time()

    def after_batch(self, dispatcher: Dispatcher[Asked]) -> None:
        self.run.progress.status(self.run.outcome, len(dispatcher.inflight), force=True)

    def tell(self, batch: list[tuple[Job[Asked], TrialResult]], writes: list[Write]) -> None:
        """Tell each finished trial (Optuna, the counts, the best); its records go to ``writes``."""
        run = self.run
        spec, progress = run.spec, run.progress
        for job, result in batch:
            (trial, flags), number = job.payload, job.key
            with_slo_figures(spec, flags, result)  # goodput and cost at the targets (servetune.cost)
            self._learn(number, flags, result)
            # Repeats measured on the trial's own start (budget.confirm_on: same-start); as after the
            # budget, one the machine lost is not a sample.
            repeats = [(k, r) for k, r in enumerate(result.repeats, start=1) if not r.status.is_infrastructure]
            summary = [{"repeat": k, "value": objective_values(spec, r)[0],
                        "feasible": meets_constraints(spec, r)} for k, r in repeats]
            if summary:  # kept on the trial before it is told: a told trial's attrs are fixed
                retry_call(lambda: trial.set_user_attr(SAME_START_REPEATS, summary),
                           what=f"store trial #{number}'s repeats")
            self.tell_and_record(trial, flags, result, writes=writes)
            for (k, repeat), kept in zip(repeats, summary):
                record = run.recorder.repeat(number, flags, repeat, kept["value"], k)
                writes.append(functools.partial(run.recorder.write, record))
            if repeats:
                progress.led(number, len(repeats))
            if result.quarantined_gpus:
                progress.gpus_quarantined(number, result.quarantined_gpus)

    # -- telling ----------------------------------------------------------------------------------

    def tell_and_record(self, trial: optuna.trial.Trial, flags: dict[str, Any], result: TrialResult, *,
                        prediction: Prediction | None = None, screen: Screen | None = None,
                        writes: list[Write] | None = None) -> None:
        """Tell Optuna, then MLflow, then the dataset: in that order, so a crash loses at most the
        record (the next ``--resume`` writes it from Optuna's). With ``writes``, the records (and
        ``on_result``) are appended to it for the loop to write instead of written now."""
        run = self.run
        record = run.recorder.tell(trial, flags, result, prediction=prediction, screen=screen)
        count(run.outcome, result.status, result.preemptions or 0)
        run.outcome.infra_retried += bool(result.infra_attempts) and not result.status.is_infrastructure
        if not result.status.is_infrastructure and all(v <= 0 for v in constraint_values(run.spec, result).values()):
            self.best.told(run.study, run.outcome, trial, record.objective)  # only a feasible trial can be the best

        def write() -> None:
            run.recorder.write(record)
            if self.on_result is not None:
                run.recorder.tracker.settle()  # the callback sees the trial's MLflow run written (or buffered)
                self.on_result(trial.number, flags, result)

        if writes is None:
            write()
        else:
            writes.append(write)

    def _learn(self, number: int, flags: dict[str, Any], result: TrialResult) -> None:
        """Recalibrate the simulator screen on a real measurement of a trial it simulated."""
        screen = self.run.screen
        if screen is None or number not in self.sims:
            return
        factor = screen.api_cpu_factor
        fidelity.learn(screen, self.run.spec, flags, self.sims.pop(number), result)
        if factor is None and screen.api_cpu_factor is not None:
            self.run.progress.api_cpu_factor(screen.api_cpu_factor, number, result.api_server_cpu_s)

    def _screen_on_sim(self, proposal: Proposal) -> tuple[TrialResult, Screen] | None:
        """Multi-fidelity (:mod:`servetune.search.screen`): ``(pruned result, the screen's verdict)``
        when the calibrated simulator rules the proposal out, else None (its simulated twin kept in
        ``sims`` to recalibrate on the real result)."""
        best = (self.run.outcome.best_metrics or {}).get("output_throughput")
        screened = sim_screen(self.run.spec, self.run.screen, proposal, best, self.run.backend)
        if screened is None:
            return None
        refusal, sim = screened
        if refusal is None:
            self.sims[proposal.trial.number] = sim
            return None
        figures = fidelity.prediction_attrs(sim)
        return refusal, Screen(refusal.cause or "", figures["output_throughput"], figures["preemptions"])
