"""The driver's one writer: a told result goes to Optuna (its user attributes, through
:func:`servetune.search.propose.tell`), then to MLflow (a child run) and the Parquet dataset, in that
order, so a crash loses at most the records (the next ``--resume`` writes them from Optuna's).

Secrets are redacted once, here, before any sink sees a text (with :mod:`servetune.redact`'s
rules); the sinks (:class:`~servetune.records.tracking.StudyTracker`, the dataset, Optuna) write
what they are handed. Redacted here: a result's cause, evidence, notes, server log, infrastructure
attempts, early-stop reason and requests' errors (:func:`redacted`); the model names, the spec's
params and tags, the workload, the simulator screen's reason and the planner's fix every record
carries; a real trial's files (:func:`redacted_files`); the headroom JSON; and the nightly's
records: its history table, report and MLflow run (:func:`record_night`). The flags need no
pass: every flag value is a number, a boolean, a list of integers or one of a fixed set of words
(:func:`servetune.planner.flags.validate_flag` refuses anything else). Optuna's storage is a
file anyone with the runs dir can read, like the dataset.

Example:
    >>> from servetune.result import TrialResult, TrialStatus
    >>> safe = redacted(TrialResult(TrialStatus.CRASHED, cause="pull https://u:pw@hub.example/m failed",
    ...                             evidence=["token hf_abcdefgh12345"]), environ={})
    >>> safe.cause, safe.evidence
    ('pull https://***@hub.example/m failed', ['token ***'])
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
import pandas as pd

from servetune.backends import capabilities
from servetune.records import dataset, report, retry_call
from servetune.records.tracking import StudyTracker
from servetune.records.trial_record import Prediction, Screen, TrialRecord
from servetune.redact import is_secret_key, redact, redact_text
from servetune.result import TrialResult
from servetune.search import headroom, warmstart
from servetune.search.propose import StoredTrial, WarmCompiles, tell, warm_compiles
from servetune.spec.schema import StudySpec
from servetune.study._open import FINISHED
from servetune.study._outcome import StudyOutcome, infra_failed_trials
from servetune.study._tasks import repeat_workload
from servetune.workload import Workload

if TYPE_CHECKING:
    from servetune.study._progress import StudyProgress


def redacted(result: TrialResult, environ: Mapping[str, str] | None = None) -> TrialResult:
    """A copy of ``result`` whose texts are safe to write down (the figures are the same objects)."""
    env = dict(os.environ if environ is None else environ)  # read once for all of its texts

    def safe(text: str) -> str:
        return redact_text(text, env)

    requests = [r if r.error is None else dataclasses.replace(r, error=safe(r.error)) for r in result.requests]
    return dataclasses.replace(
        result, cause=None if result.cause is None else safe(result.cause),
        evidence=[safe(e) for e in result.evidence], notes=[safe(n) for n in result.notes],
        log_text=safe(result.log_text),
        infra_attempts=[safe(a) for a in result.infra_attempts], requests=requests,
        early_stopped=None if result.early_stopped is None else safe(result.early_stopped))


def redacted_files(folder: Path, skip: frozenset[str] = frozenset()) -> dict[str, bytes]:
    """The files under ``folder`` (relative path -> bytes) safe to write down: UTF-8 text redacted,
    binary files as they are (a PNG, a Parquet file); names in ``skip`` and links left out."""
    files: dict[str, bytes] = {}
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.is_symlink() or path.name in skip:
            continue
        data = path.read_bytes()
        try:
            data = redact_text(data.decode("utf-8")).encode("utf-8")
        except UnicodeDecodeError:
            pass
        files[path.relative_to(folder).as_posix()] = data
    return files


def redacted_frame(df: pd.DataFrame) -> pd.DataFrame:
    """A table safe to write down: secret-named columns dropped, secrets masked in text cells."""
    out = df[[c for c in df.columns if not is_secret_key(str(c))]].copy()
    for column in out.columns:
        if out[column].dtype == object or pd.api.types.is_string_dtype(out[column]):
            out[column] = out[column].map(lambda v: redact_text(v) if isinstance(v, str) else v)
    return out


class Recorder:
    """Writes one study down: its trials to Optuna, MLflow and the dataset, and its end."""

    def __init__(self, spec: StudySpec, study: optuna.Study, tracker: StudyTracker, backend: str) -> None:
        self.spec, self.study, self.tracker, self.backend = spec, study, tracker, backend
        self.model, self.serve_model = redact_text(spec.model_ref), redact_text(spec.serve_model)
        self._compiles: WarmCompiles | None = None

    @classmethod
    def open(cls, spec: StudySpec, study: optuna.Study, backend: str, resume: bool) -> Recorder:
        """The study's attributes in Optuna and its MLflow parent run (an unreachable server fails
        fast here, TrackingError, nothing run yet; one that goes away later has its writes buffered
        under ``<runs_dir>/mlflow-buffer/`` and delivered on return)."""
        runs_dir = Path(spec.output.runs_dir)
        # Optuna's storage is a file anyone with the runs dir can read: no credentials in it.
        study.set_user_attr("model", redact_text(spec.model_ref))
        study.set_user_attr("gpu_type", spec.gpu.type)
        study.set_user_attr("serve_model", redact_text(spec.serve_model))
        local_store = not spec.tracking.mlflow_uri.startswith(("http://", "https://"))
        tracker = StudyTracker(spec.tracking.mlflow_uri, spec.tracking.experiment,
                               artifact_location=(runs_dir / "mlartifacts").resolve().as_uri() if local_store else None,
                               buffer_dir=runs_dir / "mlflow-buffer")
        tracker.start_study(spec.name, redact(spec.to_dict()), redact({
            "model": spec.model_ref, "gpu_type": spec.gpu.type, "backend": backend,
            "vllm_version": spec.vllm_version, "sampler": spec.sampler}), resume=resume)
        return cls(spec, study, tracker, backend)

    # -- one trial ------------------------------------------------------------------------------

    def compiles(self) -> WarmCompiles | None:
        """What the study's finished trials compiled (the pre-screen's warm cache), read from Optuna
        once, then kept up to date by :meth:`tell` (the driver is the study's one writer)."""
        if self._compiles is None:
            self._compiles = warm_compiles(self.spec, self.study)
        return self._compiles

    def tell(self, trial: optuna.trial.Trial, flags: Mapping[str, Any], result: TrialResult, *,
             prediction: Prediction | None = None, screen: Screen | None = None) -> TrialRecord:
        """Tell Optuna the result (redacted) and return its record, for :meth:`write` to write down."""
        safe = redacted(result)
        objective = retry_call(lambda: tell(self.spec, self.study, trial, safe, warm=self._compiles),
                               what=f"tell trial #{trial.number}")
        return self._record(trial.number, flags, safe, objective[0], origin=warmstart.origin_of(trial.user_attrs),
                            prediction=prediction, screen=screen)

    def repeat(self, number: int, flags: Mapping[str, Any], result: TrialResult, value: float,
               repeat: int) -> TrialRecord:
        """The record of confirmation repeat ``repeat`` of trial ``number`` (not an Optuna trial)."""
        return self._record(number, flags, redacted(result), value, origin="repeat", repeat=repeat)

    def _record(self, number: int, flags: Mapping[str, Any], safe: TrialResult, objective: float, *,
                prediction: Prediction | None = None, screen: Screen | None = None, **kind: Any) -> TrialRecord:
        """The record of a redacted result, its other texts redacted here (the flags need none)."""
        spec = self.spec
        if prediction is not None and prediction.fix:
            prediction = dataclasses.replace(prediction, fix=redact_text(prediction.fix))
        if screen is not None:
            screen = dataclasses.replace(screen, reason=redact_text(screen.reason))
        return TrialRecord(spec.name, number, dict(flags), safe, objective, gpu_type=spec.gpu.type,
                           model=self.model, backend=self.backend, vllm_version=spec.vllm_version,
                           serve_model=self.serve_model, prediction=prediction, screen=screen, **kind)

    def write(self, record: TrialRecord, *, workload: Workload | None = None, mlflow: bool = True,
              rows: bool = True) -> None:
        """One record to MLflow (a child run, with the workload it ran) and the Parquet dataset."""
        spec = self.spec
        if workload is None and record.repeat is not None:  # a confirmation repeat ran its own request mix
            workload = repeat_workload(spec, record.repeat)
        if mlflow:
            # A real trial's folder (its /metrics dumps, gauges, `vllm bench serve` output) goes along
            # under files/; the server log is already the run's engine.log.
            trial_dir = Path(spec.output.runs_dir) / "trials" / spec.name / record.trial_dir_name
            repeat = record.repeat
            real = capabilities(record.run_backend).real_gpus and trial_dir.is_dir()
            self.tracker.log_trial(
                record.number, record.flags, record.result, record.mlflow_tags(),
                workload=redact((workload or spec.workload).to_dict()),
                files=redacted_files(trial_dir, skip=frozenset({"server.log"})) if real else None,
                role="trial" if repeat is None else "repeat",
                run_name=None if repeat is None else f"trial-{record.number:03d}-repeat-{repeat}")
        if rows:
            dataset.append_trials(Path(spec.output.dataset_dir), [record.dataset_row()])

    def reconcile(self) -> int:
        """Trials told to Optuna whose MLflow run or dataset row a killed driver never wrote.

        Optuna is told first (:meth:`tell`), so after a SIGKILL it may hold a trial that MLflow or
        the dataset lack; they are written now from what Optuna stored (status, cause, flags,
        metrics), tagged ``servetune.reconciled``, so the three agree. Returns how many were written.
        """
        spec, study = self.spec, self.study
        told = [*study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)),
                *infra_failed_trials(study)]
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
            record = self._record(t.number, stored.flags, redacted(stored.result(self.backend, spec.vllm_version)),
                                  (t.values or [0.0])[0], reconciled=True)
            self.write(record, mlflow=t.number not in in_mlflow, rows=t.number not in in_rows)
            written += 1
        return written

    # -- the study's end ------------------------------------------------------------------------

    def finish(self, outcome: StudyOutcome, status: str, progress: StudyProgress) -> None:
        """The parent run's plots, summary and files, its end; then the study user attr ``finished``
        (only once MLflow holds every write, so that a ``--resume`` delivers what is still buffered)."""
        spec, tracker = self.spec, self.tracker
        everything = dataset.read_trials(Path(spec.output.dataset_dir), study=spec.name)
        plots, summary, files = self._summary(everything, outcome)
        # The trials table is the dataset's, written from redacted records only: no second pass.
        tracker.finish_study(outcome.best_flags, self.serve_model, everything, plots, summary, files=files)
        tracker.end(status)
        left = tracker.flush(wait_s=tracker.flush_wait_s)  # bounded wait for a server that went away
        if left:
            progress.mlflow_buffered(left, tracker.buffer_dir)
        finished = sum(t.state.is_finished() for t in self.study.get_trials(deepcopy=False))
        record = {"at": dt.datetime.now(dt.timezone.utc).isoformat(), "finished": finished,
                  "experiment_id": outcome.experiment_id, "parent_run_id": outcome.parent_run_id}
        retry_call(lambda: self.study.set_user_attr("finished_at", record["at"]), what="mark the study finished")
        if not left:  # a write still buffered for MLflow: the next --resume delivers it, so it is no no-op
            retry_call(lambda: self.study.set_user_attr(FINISHED, record), what="mark the study finished")

    def _summary(self, everything: Any, outcome: StudyOutcome) -> tuple[dict[str, Any], dict[str, float], dict[str, str]]:
        """The parent run's plots, summary figures and files (the headroom's JSON also beside the dataset)."""
        spec = self.spec
        plots: dict[str, Any] = {}
        df = everything
        if "repeat" in df.columns:  # the plots show the search; confirmation repeats stay in the table
            df = df[df["repeat"].isna()]
        if not df.empty:
            pareto = (list(zip(spec.objective.metrics, spec.objective.directions))
                      if len(spec.objective.metrics) > 1 else None)
            figures = report.study_plots(df, spec.objective.metrics[0], pareto=pareto)
            plots = {f"{stem}.png": fig for stem, fig in figures.items()}
        summary = dict(outcome.best_metrics or {})
        files: dict[str, str] = {}
        if outcome.headroom is not None:  # the winner's headroom: its curve, figures and JSON on the parent run
            plots["headroom.png"] = report.plot_headroom(outcome.headroom)
            summary.update(headroom.StudyHeadroom.from_dict(outcome.headroom).metrics())
            files["headroom.json"] = redact_text(json.dumps(outcome.headroom, indent=2, sort_keys=True))
            folder = Path(spec.output.dataset_dir).parent / "headroom"  # beside the dataset, for `servetune report`
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{spec.name}.json").write_text(files["headroom.json"], encoding="utf-8")
        return plots, summary, files

    def close_after_failure(self) -> None:
        """End the MLflow runs after a failure that stops every write (FAILED, no child left RUNNING)."""
        self.tracker.close_after_failure()


@dataclasses.dataclass(frozen=True)
class NightRecords:
    """What one night of the nightly matrix writes down, before redaction: every night's rows
    (tonight's included; the table is written whole each night), the Markdown report, and the
    MLflow run ``run_name``'s tags and metrics; the report's folder (its plots) goes along as the
    run's ``report/`` files."""

    run_name: str
    tags: Mapping[str, str]
    metrics: Mapping[str, float]
    history: pd.DataFrame
    report: str


def record_night(night: NightRecords, *, history_path: Path, report_dir: Path, mlflow_uri: str,
                 experiment: str, artifact_location: str | None = None) -> str:
    """Write a night down, redacted here like a study's trials: the history table (Parquet), the
    report (``report_dir/report.md``), then one MLflow run with the report's folder. Returns the run id."""
    redacted_frame(night.history).to_parquet(history_path, index=False)
    report = redact_text(night.report).encode("utf-8")
    (report_dir / "report.md").write_bytes(report)
    files = {**redacted_files(report_dir, skip=frozenset({"report.md"})), "report.md": report}
    tracker = StudyTracker(mlflow_uri, experiment, artifact_location=artifact_location)
    return tracker.log_run(night.run_name, redact(night.tags), night.metrics, files=files, artifact_path="report")
