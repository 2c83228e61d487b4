"""The driver: :func:`run_study` and the steps of one run over one study (open, recover, starting
points, dispatch, confirm, headroom, close). Each step's work lives in its own module: the dispatch
loop (``_dispatch``) runs the trials (``_trials``), the confirmation repeats (``_confirm``) and the
edge window (``_headroom``); the recorder (``_recorder``) writes everything down; the progress
callbacks (``_progress``) say what happens."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import optuna

from servetune.cluster import reap_leftovers, record_local_session
from servetune.cluster.base import NoGpusError, Pool, ray_accelerator_type
from servetune.cluster.start import start_pool
from servetune.backends import capabilities
from servetune.engines import resolve_backend
from servetune.engines.vllm.host import probe_has_flashinfer
from servetune.errors import SpecError
from servetune.planner.comm import CommEnv, trial_env
from servetune.planner.flags import to_command_line
from servetune.records import diskspace, lease
from servetune.result import TrialResult
from servetune.search import screen as fidelity
from servetune.search import warmstart
from servetune.search.propose import enqueue_informed_starts
from servetune.spec.schema import StudySpec
from servetune.study._confirm import confirm_top
from servetune.study._dispatch import Dispatcher, StopRequest
from servetune.study._headroom import study_headroom
from servetune.study._open import nothing_to_do, open_study, recover_interrupted
from servetune.study._outcome import StudyOutcome, count_existing
from servetune.study._progress import StudyProgress, TerminalProgress
from servetune.study._recorder import Recorder
from servetune.study._state import StudyRun
from servetune.study._trials import TrialWork, recalibrate


def run_study(
    spec: StudySpec,
    *,
    resume: bool = False,
    out: TextIO | None = None,
    on_result: Callable[[int, dict[str, Any], TrialResult], None] | None = None,
    progress: StudyProgress | None = None,
) -> StudyOutcome:
    """Run (or resume) the study the spec describes; returns its outcome.

    ``on_result`` is called with each told trial once it is written down; ``progress`` gets the
    driver's events (default: :class:`~servetune.study.TerminalProgress`, servetune's lines on
    ``out``, standard output unless given).

    1. Open the Optuna study (``--resume`` continues one of the same name) and its MLflow parent run.
    2. On resume: re-queue the trials a killed driver left running, and write the told trials it
       never recorded to MLflow and the dataset.
    3. A fresh study enqueues its starting points: informed starts, warm starts, the baseline.
    4. Dispatch: propose (pre-screen, simulator screen), run on the trial pool while
       ``budget.parallel`` and free GPUs allow, tell each result (Optuna, then MLflow, then the
       dataset), until ``budget.trials`` are told or ``budget.time_limit_s`` is spent.
    5. Confirm the top configurations (``budget.confirm_top``); the winner's headroom.
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
    progress = progress or TerminalProgress(out or sys.stdout, spec.budget.trials)
    try:
        started = time.monotonic()
        study, existing = open_study(spec, resume)
        done = nothing_to_do(spec, study) if resume else None
        if done is not None:  # decided before MLflow, the pool or any worker starts
            done.wall_s = time.monotonic() - started
            progress.already_done(spec, done.trials_done)
            return done
        driver = _Driver.open(spec, study, existing, resume=resume, progress=progress, on_result=on_result,
                              started=started)  # 1
        driver.recover()  # 2
        driver.enqueue_starts()  # 3
        driver.run()  # 4-6
    finally:
        if held is not None:
            held.release()
    return driver.outcome


def probed_trial_env(pool: Pool, backend: str, gpu_type: str) -> CommEnv:
    """The environment a study's trials are planned with (:func:`servetune.planner.comm.trial_env`): for real
    trials, vLLM's ``has_flashinfer()`` as a GPU worker of ``gpu_type`` answers it
    (:func:`servetune.engines.vllm.host.probe_has_flashinfer`, through :meth:`Pool.on_worker`), so that the
    pre-screen charges vLLM 0.17+'s FlashInfer all-reduce fusion workspace exactly where the launched servers
    allocate it; no answer: charged where the version, TP and GPU say it may run."""
    if not capabilities(backend).real_gpus:
        return trial_env(False)
    return trial_env(True, pool.on_worker(probe_has_flashinfer, gpu_type))


def _cut_short(step: Callable[[], None]) -> bool:
    """Run ``step``; True when a second signal cut it (``KeyboardInterrupt``).

    The interrupt ends here, so the frames it cut become garbage before the driver marks the running
    trials failed. One of them may hold a SQLite cursor, in a reference cycle, that keeps the
    database's write lock (the statement ran, its result was never read): garbage, the storage's
    retry collects it (:func:`servetune.records._retry.retry_call`); reachable from a live
    traceback, it kept every write of the closing steps waiting out the retry's 60 s.
    """
    try:
        step()
    except KeyboardInterrupt:
        return True
    return False


class _Driver:
    """One run of the driver over one study: the state the steps of :func:`run_study` share."""

    def __init__(self, spec: StudySpec, study: optuna.Study, existing: list[optuna.trial.FrozenTrial],
                 recorder: Recorder, backend: str, resume: bool, progress: StudyProgress,
                 on_result: Callable[[int, dict[str, Any], TrialResult], None] | None, started: float) -> None:
        self.spec, self.study, self.existing, self.recorder = spec, study, existing, recorder
        self.backend, self.resume, self.progress, self.on_result, self.started = backend, resume, progress, on_result, started
        self.runs_dir = Path(spec.output.runs_dir)
        tracker = recorder.tracker
        self.outcome = StudyOutcome(spec.name, mlflow_uri=spec.tracking.mlflow_uri, parent_run_id=tracker.parent_run_id,
                                    experiment_id=tracker.experiment_id)
        count_existing(study, self.outcome)
        self.told_before = self.outcome.trials_done  # trials_run counts from here
        self.recovered = self.reconciled = 0

    # -- 1. open -------------------------------------------------------------------------------

    @classmethod
    def open(cls, spec: StudySpec, study: optuna.Study, existing: list[optuna.trial.FrozenTrial], *, resume: bool,
             progress: StudyProgress, on_result: Callable[[int, dict[str, Any], TrialResult], None] | None,
             started: float) -> _Driver:
        backend = resolve_backend(spec.backend)
        recorder = Recorder.open(spec, study, backend, resume)
        return cls(spec, study, existing, recorder, backend, resume, progress, on_result, started)

    # -- 2. recover, 3. starting points ---------------------------------------------------------

    def recover(self) -> None:
        self.recovered = recover_interrupted(self.study) if self.resume else 0
        self.reconciled = self.recorder.reconcile() if self.resume else 0

    def enqueue_starts(self) -> None:
        spec, study = self.spec, self.study
        # A grid is the baseline every point of which is measured: informed starts would only reorder it.
        # Warm starts and the baseline, like the informed starts, only go into a study nobody has
        # enqueued anything in yet (the nightly job enqueues its own warm start); they are enqueued
        # after the informed starts, so those run first (servetune.search.warmstart).
        fresh = not self.existing and spec.sampler != "grid" and not study.get_trials(deepcopy=False)
        # Planned before the pool starts, so before any GPU worker is probed: trial_env's unprobed environment.
        starts = enqueue_informed_starts(spec, study) if not self.existing and spec.sampler != "grid" else []
        warm = warmstart.enqueue_warm_starts(spec, study) if fresh else []
        baseline = warmstart.enqueue_baseline(spec, study) if fresh else None
        self.progress.started(spec, self.backend, self.recovered, self.reconciled, starts, warm, baseline)

    # -- 4-6. dispatch, confirm, close ------------------------------------------------------------

    def run(self) -> None:
        spec = self.spec
        # The GPU type binds at the FlashInfer probe of a real study (probed_trial_env) or the first submit, and
        # only on a cluster whose nodes advertise types: a local logical-GPU Ray (possibly shared by several
        # studies in one process) stays untyped.
        # A local Ray left by an earlier, killed driver of this study is stopped first; the local Ray
        # this driver starts is recorded so that the next start can do the same (servetune.cluster._ray_session).
        reaped = reap_leftovers(self.runs_dir, spec.name)
        if reaped:
            self.progress.reaped(len(reaped))
        # Simulated trials run in local worker processes unless a Ray is asked for (servetune.cluster.base).
        pool: Pool = start_pool(self.backend, num_gpus=spec.gpu.count, num_cpus=max(2, spec.budget.parallel))
        self.pool = pool
        pool.reuse_actors = True  # closed in the finally below
        if pool.started_local_ray:
            record_local_session(self.runs_dir, spec.name)
        if pool.beside_cluster:
            self.progress.ray_beside(pool.beside_cluster)
        self.stop = StopRequest()
        status = "FINISHED"
        no_gpus: NoGpusError | None = None
        reserve = diskspace.Reserve(self.runs_dir, spec.name)  # room to close the records if the disk fills
        full: BaseException | None = None
        try:
            # Inside the try: the FlashInfer probe may wait for a GPU node, and a Ctrl-C then closes the pool too.
            if _cut_short(lambda: self._steps(self._open_run(pool), Dispatcher(pool, self.backend, self.stop))):
                raise KeyboardInterrupt  # a fresh one, with no frame of the cut step behind it
        except KeyboardInterrupt:
            status = "KILLED"
            self.outcome.interrupted = True
            killed = self._fail_running()
            self.outcome.stopped_by = int(self.stop.signum or signal.SIGINT)
            self.progress.interrupted(len(killed), self.outcome.trials_done)
        except NoGpusError as exc:  # no live node takes a trial: stop, keeping what finished
            status, no_gpus = "FAILED", exc
            self.outcome.interrupted = True
            killed = self._fail_running()
            self.progress.no_gpus(len(killed), self.outcome.trials_done)
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
            self.progress.closed(self.outcome)
            if full is None:
                reserve.release()
                self._close(status)
        if full is not None:
            self._stop_on_full_disk(full, reserve)
        if no_gpus is not None:
            raise SpecError("gpu.type", f"{no_gpus} (budget.wait_for_gpus_s: {spec.budget.wait_for_gpus_s:g} s)",
                            f"start Ray nodes with {spec.gpu.type} GPUs labelled by type (ray start --num-gpus N "
                            f"--resources '{{\"accelerator_type:{ray_accelerator_type(spec.gpu.type)}\": 1}}'), "
                            "raise budget.wait_for_gpus_s while an autoscaler adds them, or run backend: sim")

    def _open_run(self, pool: Pool) -> StudyRun:
        """The state of this driver run: the trials' environment (a real study's GPU workers probed for FlashInfer,
        :func:`probed_trial_env`) and, with multi-fidelity, a fresh simulator screen in it (a resumed study
        recalibrates it from the trials it measured)."""
        spec = self.spec
        comm_env = probed_trial_env(pool, self.backend, spec.gpu.type)
        run = StudyRun(spec, self.study, self.backend, self.recorder, self.progress, self.outcome, self.started,
                       self.stop, screen=fidelity.screen_for(spec, self.backend, comm_env), comm_env=comm_env)
        if capabilities(self.backend).real_gpus:
            self.progress.planned_with(run.comm_env)
        if run.screen is not None and run.screen.margin_note:  # an unjudged GPU type: said once, here
            self.progress.screen_margins(run.screen.margin_note)
        if self.existing:
            recalibrate(run, self.existing)
        return run

    def _steps(self, run: StudyRun, dispatcher: Dispatcher[Any]) -> None:
        """4. the trials, 5. the confirmation and the headroom: all on the one dispatch loop."""
        spec = self.spec
        self.dispatch_trials(run, dispatcher)
        if spec.budget.confirm_top > 0 and dispatcher.pool.total_gpus > 0:
            if run.out_of_time():
                # A repeat is a vLLM start like a trial: the time limit bounds the GPU time, so a
                # study that spent it leaves its winner unconfirmed (the H200 14B grid's
                # confirmation start, begun after the limit, was cut by the host's deadline).
                self.progress.unconfirmed(spec.budget.time_limit_s or 0.0)
            else:
                confirm_top(run, dispatcher)
        study_headroom(run, dispatcher)

    def dispatch_trials(self, run: StudyRun, dispatcher: Dispatcher[Any]) -> None:
        """4. Propose, launch, tell and record trials until the budget or the time limit is spent."""
        dispatcher.run(TrialWork(run, dispatcher.pool, self.on_result))

    def _close(self, status: str) -> None:
        """6. The parent run's summary, plots and end; the study marked finished."""
        if self.outcome.best_flags is not None:
            self.outcome.best_command = to_command_line(self.spec.serve_model, self.outcome.best_flags)
        self.recorder.finish(self.outcome, status, self.progress)

    def _fail_running(self) -> list[int]:
        """Stop every running trial and tell it FAIL; returns the pool's trial numbers it stopped."""
        killed = self.pool.cancel_all()
        # Every RUNNING trial is this driver's (it is the only writer), including one asked a
        # moment before the signal and not yet in the dispatch loop: fail them all.
        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            self.study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        return killed

    def _stop_on_full_disk(self, full: BaseException, reserve: diskspace.Reserve) -> None:
        """The disk filled: free the reserve, end the MLflow runs (FAILED, no child left RUNNING) and
        the Optuna trials still running (FAIL: the resume measures them again), raise DiskFull."""
        reserve.release()
        self.recorder.close_after_failure()
        try:
            for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                self.study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        except Exception:  # noqa: BLE001 - left RUNNING, the resume re-queues them the same way
            pass
        raise diskspace.DiskFull(f"the disk holding {self.runs_dir} is full ({diskspace.full_disk_reason(full)}); "
                                 f"the study stopped, its {self.outcome.trials_done} finished trials kept") from None
