"""MLflow tracking of a study: one parent run per study, one nested child run per trial.

Contract:

* The study driver process is the ONLY writer. :class:`StudyTracker` talks to the server through
  :class:`mlflow.MlflowClient` with explicit run ids; it never touches MLflow's global active-run
  state, so it is safe next to Ray workers and other threads.
* Parent run (``servetune.role=study``, tagged ``servetune.study=<name>``): the study params and
  tags; at the end ``best_config.yaml`` (a ``vllm serve --config`` file), ``best_command.txt``
  (``vllm serve MODEL --flag value ...``), ``trials.csv`` / ``trials.parquet``, ``plots/*.png``
  and the summary metrics. Resuming reopens the newest parent run with the same study tag and
  marks child runs an earlier submission left ``RUNNING`` as ``KILLED``; the driver's resume then
  keeps one complete child per trial number (:meth:`StudyTracker.reconcile_trial_runs`) and writes
  the missing ones again from Optuna's record, so after kills and resumes every trial has exactly
  one child run, none ``RUNNING`` or ``KILLED``.
* Child run ``trial-NNN`` (``mlflow.parentRunId`` = the parent, so the UI nests it): params are
  the flags under their vLLM names plus ``workload.*``; metrics are exactly
  :meth:`TrialResult.metrics`; tags are the study tags, ``servetune.status``,
  ``servetune.cause``, ``servetune.trial_number``, ``servetune.backend``,
  ``servetune.vllm_version``; artifacts ``engine.log``, ``requests.parquet``, ``result.json``.
* What a user sees first (MLflow 3's UI): the experiment carries ``mlflow.experimentKind =
  custom_model_development`` and :func:`ui_url` links name the runs layout, so the experiment opens
  on its runs, not on the GenAI overview; every run's description (``mlflow.note.content``) starts
  with its headline: the parent's best figures and `vllm serve` command (:func:`study_note`), a
  trial's class and figures (:meth:`TrialRecord.headline`); a child run spans the trial's own wall
  time (handed to Ray until its result was back), not the milliseconds its logging took.
* Run status: ``FINISHED`` for an ``ok`` trial, ``FAILED`` for any other trial status (the
  ``servetune.status`` tag says which: startup_oom, kv_too_small, ...), ``KILLED`` for a trial
  whose driver died mid-trial (set by the resume sweep). A failed trial is a measured outcome,
  but the red icon in the runs table is the fastest way to see which configurations did not
  serve, and its metrics (the memory breakdown of a startup OOM) are still logged and plotted.
* The tracker writes what it is handed, as it is: the driver's recorder (:mod:`servetune.study`,
  its ``_recorder``) has redacted every text once (:mod:`servetune.redact`'s rules) before Optuna,
  MLflow and the dataset see it, the nightly's run included; a trial's or a run's files come as
  ``files`` (a relative path -> the bytes to write), already redacted. Only the tracker's own
  error lines, which name the MLflow URI, are redacted here.
* An unreachable server at construction raises :class:`TrackingError` naming the URI: the study
  fails fast, before any trial runs. A server that goes away LATER loses nothing when the tracker
  has a ``buffer_dir``: a ``log_trial`` / ``finish_study`` / ``end`` that fails while ``/health``
  does not answer is written to ``buffer_dir`` as one folder per operation (``op.json`` with the
  already redacted params, metrics and tags, plus the artifact files), and the driver carries on.
  Before each later call, and in :meth:`StudyTracker.flush` (a bounded wait at the end of a
  study), buffered operations are delivered oldest first and removed. Each trial operation carries
  a ``servetune.delivery_id`` tag; a delivery first deletes any run a half-finished earlier attempt
  left with that id, so every trial appears exactly once. A write the server refuses while it is
  up is not a transport error: it raises :class:`TrackingError` (a buffered one is moved to
  ``<buffer_dir>/rejected/``).
* With a ``buffer_dir`` the driver does not wait for MLflow (``background``, the default there):
  ``log_trial`` / ``finish_study`` / ``end`` hand the operation to a writer thread (:mod:`._writer`),
  which stages it in the buffer (a trial's files and ``op.json``, in the order handed over) and
  delivers the buffer oldest first while the driver goes on; a refusal reaches the driver at its
  next call. :meth:`StudyTracker.settle` waits until what was handed over was tried;
  :meth:`StudyTracker.flush` (the end of a study) ends the thread and stages and delivers the rest
  itself, so a finished study has every trial in MLflow when it returns. A driver killed first
  leaves its staged trials in the buffer (delivered by ``--resume``); one it had not staged yet is
  told to Optuna and in the dataset, and ``--resume`` writes its run from Optuna's record.

Example:
    >>> tracker = StudyTracker("http://127.0.0.1:5000", "servetune")  # doctest: +SKIP
    >>> parent = tracker.start_study("llama-h200", {"objective": "output_throughput"},
    ...                              {"gpu_type": "H200", "model": "org/model"})  # doctest: +SKIP
    >>> tracker.log_trial(0, {"max_num_seqs": 64}, result, tags={})  # doctest: +SKIP
    >>> tracker.finish_study({"max_num_seqs": 64}, "org/model", trials_df, plots, {"best_output_throughput": 1e4})  # doctest: +SKIP
    >>> tracker.end("FINISHED")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
import pyarrow.parquet as pq

from servetune.records._writer import BackgroundWriter
from servetune.records.dataset import requests_table
from servetune.records.diskspace import is_disk_full
from servetune.records.outcome import TrialOutcome, classify_frame
from servetune.records.trial_record import figure
from servetune.errors import SpecError
from servetune.planner.flags import to_command_line, to_config_yaml
from servetune.redact import redact_text
from servetune.result import TrialResult, TrialStatus

__all__ = [
    "StudyTracker",
    "TrackingError",
    "TAG_STUDY",
    "TAG_ROLE",
    "TAG_STATUS",
    "TAG_CAUSE",
    "TAG_TRIAL_NUMBER",
    "TAG_BACKEND",
    "TAG_VLLM_VERSION",
    "TAG_PARENT",
    "TAG_DELIVERY",
    "TAG_EXPERIMENT_KIND",
    "EXPERIMENT_KIND",
    "ui_url",
    "study_note",
    "one_run_per_trial",
]

_log = logging.getLogger(__name__)

TAG_STUDY = "servetune.study"
TAG_ROLE = "servetune.role"  # "study" on the parent, "trial" on children ("repeat": a confirmation re-run)
TAG_STATUS = "servetune.status"  # a TrialStatus word
TAG_CAUSE = "servetune.cause"
TAG_TRIAL_NUMBER = "servetune.trial_number"  # the Optuna trial number
TAG_BACKEND = "servetune.backend"
TAG_VLLM_VERSION = "servetune.vllm_version"
TAG_PARENT = "mlflow.parentRunId"  # MLflow's own nesting tag: the UI groups children under it
TAG_DELIVERY = "servetune.delivery_id"  # one id per trial operation: redelivery replaces, never duplicates
_TAG_RUN_NAME = "mlflow.runName"
TAG_NOTE = "mlflow.note.content"  # MLflow's run description: Markdown at the top of the run's page
# MLflow 3's UI picks an experiment's landing page from this experiment tag; without it an
# experiment opens on the GenAI "Overview" (traces), where a study's runs are not shown. This value
# is the one MLflow's UI maps to its machine-learning layout, whose first page is the runs table.
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"

# MLflow's server-side limits (mlflow.utils.validation); fixed here so a server upgrade that
# lowers them shows up as a failing test, not as silently different truncation.
MAX_TAG_VALUE = 8000
MAX_PARAM_VALUE = 6000
_MAX_PARAMS_TAGS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000

# ---------------------------------------------------------------------------------------------
# Rendering (pure)
# ---------------------------------------------------------------------------------------------


def _param_value(value: Any) -> str:
    """MLflow params are strings: YAML-ish literals (true, [1, 2]) rather than Python reprs."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:MAX_PARAM_VALUE]


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings to dotted keys (``search_space.max_num_seqs.high``)."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _tag_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if len(text) > MAX_TAG_VALUE:
        suffix = "... [truncated]"
        text = text[: MAX_TAG_VALUE - len(suffix)] + suffix
    return text


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _child_status(status: TrialStatus) -> str:
    return "FINISHED" if status is TrialStatus.OK else "FAILED"


# ---------------------------------------------------------------------------------------------
# I/O
# ---------------------------------------------------------------------------------------------


class TrackingError(RuntimeError):
    """The MLflow server could not be reached or refused a write."""


_T = TypeVar("_T")


class StudyTracker:
    """Writes one study to MLflow: a parent run and one nested child run per trial.

    Example:
        >>> tracker = StudyTracker("http://127.0.0.1:5000", "servetune")  # doctest: +SKIP
        >>> run_id = tracker.start_study("s1", {"budget.trials": 20}, {"gpu_type": "H200"})  # doctest: +SKIP
    """

    def __init__(self, tracking_uri: str, experiment: str, *, connect_timeout_s: float = 10.0,
                 artifact_location: str | None = None, buffer_dir: str | Path | None = None,
                 flush_wait_s: float = 120.0, background: bool | None = None) -> None:
        # ``buffer_dir``: where writes wait while the server is unreachable (None: no buffering,
        # a failed write raises). ``flush_wait_s``: how long the end of a study waits for it.
        # ``background`` (the default with a buffer): writes are staged in the buffer and
        # delivered by a writer thread (see the module's docstring).
        self.buffer_dir = None if buffer_dir is None else Path(buffer_dir)
        self.flush_wait_s = flush_wait_s
        self._seq = 0
        if background and self.buffer_dir is None:
            raise ValueError("StudyTracker: background delivery needs a buffer_dir")
        self._writer = (BackgroundWriter(self._drain_pass, name="servetune-mlflow-writer")
                        if self.buffer_dir is not None and background is not False else None)
        self._queue: deque[tuple[Path, Callable[[Path], None] | None]] = deque()  # handed over, not staged yet
        self._queue_lock = threading.Lock()
        self._fresh: set[str] = set()  # operations handed to the writer, never tried yet
        self._warned: set[str] = set()  # operations already reported as waiting for the server
        self._client_lock = threading.RLock()  # one MLflow call at a time (the writer and the driver)
        if self.buffer_dir is not None:
            # MLflow's client retries a refused connection 7 times with exponential backoff (minutes)
            # before failing; with a buffer the driver should fail over in seconds instead. Only a
            # default: an explicit setting in the environment wins.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        # ``artifact_location``: where a NEW experiment keeps its artifacts. For a local store
        # (sqlite:) the driver passes a folder beside the database, so `mlflow ui` finds them
        # whatever directory it is started from (MLflow's default is ./mlruns of the cwd).
        self.artifact_location = artifact_location
        if not experiment:
            raise SpecError("tracking.experiment", "empty experiment name", "name the MLflow experiment")
        from servetune.records._storage import postgres_url  # a database URI: its driver must be installed

        self.tracking_uri = postgres_url(tracking_uri.rstrip("/"), "tracking.mlflow_uri")
        self.experiment = experiment
        self._check_reachable(connect_timeout_s)
        from servetune.records._mlflow_store import ensure_sqlite_store

        ensure_sqlite_store(self.tracking_uri)  # a local store is built whole, never half (a kill mid-creation)
        # Deferred: importing mlflow costs about a second. MlflowClient, entities and exceptions
        # are all in mlflow-skinny (the core dependency); the full mlflow is only for the UI/server.
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = self._call("get or create the experiment", self._experiment_id)
        self.parent_run_id: str | None = None
        self.study_name: str | None = None
        self._study_tags: dict[str, str] = {}

    # -- connection --------------------------------------------------------------------------

    def _check_reachable(self, timeout_s: float) -> None:
        """Fail in seconds, not after MLflow's minutes of HTTP retries, when the server is down."""
        if not self.tracking_uri.startswith(("http://", "https://")):
            return  # a local store (file:, sqlite:) has no server to reach
        url = self.tracking_uri + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                if response.status != 200:
                    raise TrackingError(f"MLflow server at {self._safe_uri} answered {response.status} on /health")
        except (urllib.error.URLError, OSError) as exc:
            raise TrackingError(
                f"MLflow tracking server at {self._safe_uri} is unreachable ({exc}); start it "
                f"(`mlflow server --host 127.0.0.1 --port PORT`) or point tracking.uri at a running one"
            ) from None

    def _server_up(self, timeout_s: float = 3.0) -> bool:
        """Whether the server answers ``/health`` now (a local store is always up)."""
        if not self.tracking_uri.startswith(("http://", "https://")):
            return True
        try:
            with urllib.request.urlopen(self.tracking_uri + "/health", timeout=timeout_s) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    @property
    def _safe_uri(self) -> str:
        return redact_text(self.tracking_uri)

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run one MLflow operation; turn transport and server errors into :class:`TrackingError`."""
        from mlflow.exceptions import MlflowException

        try:
            with self._client_lock:
                return fn()
        except (MlflowException, OSError) as exc:
            raise TrackingError(f"MLflow at {self._safe_uri}: could not {what}: {redact_text(str(exc))}") from exc
        except Exception as exc:  # requests' ConnectionError and friends are not OSErrors
            if type(exc).__module__.startswith(("requests", "urllib3")):
                raise TrackingError(f"MLflow at {self._safe_uri}: could not {what}: {redact_text(str(exc))}") from exc
            raise

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        exp = self._client.get_experiment_by_name(self.experiment)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self._client.restore_experiment(exp.experiment_id)
            if TAG_EXPERIMENT_KIND not in exp.tags:  # a kind someone chose is theirs; a missing one is ours to set
                self._client.set_experiment_tag(exp.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
            return str(exp.experiment_id)
        try:
            return str(self._client.create_experiment(self.experiment, artifact_location=self.artifact_location,
                                                      tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND}))
        except MlflowException:
            exp = self._client.get_experiment_by_name(self.experiment)  # lost a creation race
            if exp is None:
                raise
            return str(exp.experiment_id)

    # -- writing helpers ---------------------------------------------------------------------

    def _log(self, run_id: str, params: Mapping[str, Any] | None = None,
             metrics: Mapping[str, float] | None = None, tags: Mapping[str, Any] | None = None) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        param_list = [Param(k, _param_value(v)) for k, v in (params or {}).items()]
        tag_list = [RunTag(k, _tag_value(v)) for k, v in (tags or {}).items()]
        metric_list = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()]
        if len(param_list) + len(tag_list) <= _MAX_PARAMS_TAGS_PER_BATCH and len(metric_list) <= _MAX_METRICS_PER_BATCH:
            self._client.log_batch(run_id, params=param_list, tags=tag_list, metrics=metric_list)  # one write
            return
        for chunk in _chunks(param_list, _MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(run_id, params=chunk)
        for chunk in _chunks(tag_list, _MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(run_id, tags=chunk)
        for chunk in _chunks(metric_list, _MAX_METRICS_PER_BATCH):
            self._client.log_batch(run_id, metrics=chunk)

    def _search(self, filter_string: str) -> list[Any]:
        runs: list[Any] = []
        token = None
        while True:
            page = self._client.search_runs([self.experiment_id], filter_string=filter_string,
                                            order_by=["attributes.start_time DESC"], max_results=1000,
                                            page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def _require_study(self) -> str:
        if self.parent_run_id is None:
            raise RuntimeError("StudyTracker: call start_study() first")
        return self.parent_run_id

    # -- study -------------------------------------------------------------------------------

    def find_study_run(self, study_name: str) -> str | None:
        """The newest parent run of ``study_name`` in this experiment, or ``None``."""
        if "'" in study_name or "\\" in study_name:
            raise SpecError("study.name", f"{study_name!r} contains a quote or backslash",
                            "use letters, digits, '-', '_' and '.'")
        runs = self._call("search study runs", lambda: self._search(
            f"tags.`{TAG_STUDY}` = '{study_name}' AND tags.`{TAG_ROLE}` = 'study'"))
        return runs[0].info.run_id if runs else None

    def reconcile_trial_runs(self) -> set[int]:
        """One child run per trial under the current study's parent; returns the trial numbers that
        have one. Runs a killed driver left behind (``RUNNING``, swept to ``KILLED``) and any second
        complete run of a trial number are deleted (MLflow's soft delete: restorable, hidden from the
        runs table), so the driver writes the missing ones again from Optuna's record and every
        trial appears exactly once (:func:`one_run_per_trial`). Confirmation repeats are left alone."""
        parent = self._require_study()
        runs = self._call("search trial runs", lambda: self._search(
            f"tags.`{TAG_PARENT}` = '{parent}' AND tags.`{TAG_ROLE}` = 'trial'"))
        numbered = _numbered(runs)
        keep, drop = one_run_per_trial(numbered)
        for run_id in drop:
            self._call("delete a duplicate or unfinished trial run", lambda: self._client.delete_run(run_id))
        if drop:
            _log.warning("study %s: %d unfinished or duplicate trial runs deleted from MLflow (trials %s are "
                         "written again from Optuna's record where needed)", self.study_name, len(drop),
                         ", ".join(sorted({str(n) for n, _, _, rid in numbered if rid in set(drop)}, key=int)))
        return set(keep)

    def start_study(self, study_name: str, params: Mapping[str, Any], tags: Mapping[str, str],
                    resume: bool = False) -> str:
        """Open the study's parent run (new, or the earlier one when ``resume``); returns its id.

        ``tags`` (e.g. ``{"gpu_type": "H200", "model": "org/m"}``) go on the parent and are
        copied onto every trial run, so trials can be searched by them.

        Example:
            >>> tracker.start_study("s1", {"objective": "output_throughput"}, {"gpu_type": "H200"})  # doctest: +SKIP
            '3f2a...'
        """
        self.flush()  # an earlier submission's buffered writes go first
        existing = self.find_study_run(study_name)
        safe_params = _flatten(params)
        self._study_tags = {k: str(v) for k, v in tags.items()}
        run_tags = {**self._study_tags, TAG_STUDY: study_name, TAG_ROLE: "study"}
        if existing is not None and not resume:
            raise SpecError("study.name", f"study {study_name!r} already has MLflow run {existing} in "
                            f"experiment {self.experiment!r}", "resume it (--resume) or pick a new study name")
        if existing is None:
            run = self._call("create the study run", lambda: self._client.create_run(
                self.experiment_id, tags={k: _tag_value(v) for k, v in run_tags.items()}, run_name=study_name))
            run_id = run.info.run_id
            self._call("log study params", lambda: self._log(run_id, params=safe_params))
        else:
            run_id = existing
            self._call("reopen the study run", lambda: self._reopen(run_id, safe_params, run_tags))
        self.parent_run_id = run_id
        self.study_name = study_name
        return run_id

    def _reopen(self, run_id: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        self._client.update_run(run_id, status="RUNNING")
        # Params are immutable in MLflow: keep the first submission's values, add new keys only.
        old = self._client.get_run(run_id).data.params
        changed = sorted(k for k, v in params.items() if k in old and old[k] != _param_value(v))
        if changed:
            _log.warning("resumed study keeps its first params; changed on resume: %s", ", ".join(changed))
        self._log(run_id, params={k: v for k, v in params.items() if k not in old},
                  tags={**tags, "servetune.resumed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        for child in self._search(f"tags.`{TAG_PARENT}` = '{run_id}' AND attributes.status = 'RUNNING'"):
            self._client.set_tag(child.info.run_id, "servetune.swept",
                                 "left RUNNING by an earlier submission; marked KILLED on resume")
            self._client.set_terminated(child.info.run_id, status="KILLED")

    def close_after_failure(self) -> None:
        """End the study's run ``FAILED`` at once, deleting any child a failed write left ``RUNNING``
        (the resume writes it again from Optuna's record). Direct calls, nothing staged on disk:
        what a driver does when its disk is full. Best effort: a failure is logged, not raised."""
        parent = self._require_study()
        if self._writer is not None:
            self._writer.stop()  # its writes stay in the buffer for the resume
            with contextlib.suppress(Exception):  # a full disk may refuse them: the resume writes them from Optuna's record
                self._stage_queued()
            self._writer.take_error()
        try:
            for child in self._search(f"tags.`{TAG_PARENT}` = '{parent}' AND attributes.status = 'RUNNING'"):
                self._client.delete_run(child.info.run_id)
            self._client.set_terminated(parent, status="FAILED")
        except Exception as exc:  # noqa: BLE001 - the resume sweeps what is left
            _log.warning("MLflow at %s: could not close the study run after the failure (the next --resume "
                         "does): %s", self._safe_uri, redact_text(str(exc)).splitlines()[0][:300] if str(exc) else exc)

    # -- trials ------------------------------------------------------------------------------

    def log_trial(self, trial_number: int, flags: Mapping[str, Any], result: TrialResult,
                  tags: Mapping[str, str], files: Mapping[str, bytes] | None = None, *,
                  workload: Mapping[str, Any] | None = None, role: str = "trial", run_name: str | None = None) -> str:
        """Record one finished trial as a nested child run; returns the child run id.

        ``workload`` (the workload description) is logged as ``workload.*`` params; ``files`` (a
        relative path -> its bytes, e.g. a real trial's /metrics dumps) are uploaded under
        ``files/``. Everything is written as handed over (the recorder redacted it). While the server is
        unreachable the trial is buffered on disk and ``""`` is returned (no run id yet); with a
        writer thread it is handed to it and ``""`` is returned too.

        Example:
            >>> tracker.log_trial(7, {"max_num_seqs": 64}, result, {"sampler": "tpe"})  # doctest: +SKIP
            'c0ffee...'
        """
        parent = self._require_study()
        status = TrialStatus(result.status)
        params = {**{str(k): v for k, v in flags.items() if v is not None}, **_flatten(workload or {}, "workload.")}
        run_tags: dict[str, Any] = {
            **self._study_tags,
            **tags,
            TAG_PARENT: parent,
            TAG_STUDY: self.study_name,
            TAG_ROLE: role,  # "trial", or "repeat" for a confirmation re-run of a trial's flags
            TAG_TRIAL_NUMBER: str(trial_number),
            TAG_STATUS: status.value,
            TAG_BACKEND: result.backend,
        }
        if result.vllm_version:
            run_tags[TAG_VLLM_VERSION] = result.vllm_version
        if result.cause:
            run_tags[TAG_CAUSE] = result.cause
        run_tags[TAG_DELIVERY] = uuid.uuid4().hex
        run_tags = {k: _tag_value(v) for k, v in run_tags.items()}
        op = {"kind": "trial", "experiment_id": self.experiment_id, "run_name": run_name or f"trial-{trial_number:03d}",
              "tags": run_tags, "params": {k: _param_value(v) for k, v in params.items()},
              "metrics": {k: float(v) for k, v in result.metrics().items()},
              "status": _child_status(status), **_run_span(result)}

        def stage(op_dir: Path) -> None:
            _write_trial_files(op_dir / "artifacts", result, files or {})
            _write_op(op_dir, op)

        return self._hand_over(self._new_op_dir("trial"), stage) or ""

    # -- delivery and the on-disk buffer -----------------------------------------------------

    def _new_op_dir(self, kind: str) -> Path:
        """A fresh folder for one operation: staged inside the buffer (so enqueueing is a rename)."""
        self._seq += 1
        name = f"{time.time_ns():020d}-{self._seq:04d}-{kind}"
        if self.buffer_dir is None:
            return Path(tempfile.mkdtemp(prefix=f"servetune-{kind}-"))
        staging = self.buffer_dir / ".staging"
        staging.mkdir(parents=True, exist_ok=True)
        path = staging / name
        path.mkdir()
        return path

    def pending(self) -> list[Path]:
        """The buffered operations, oldest first (empty without a buffer)."""
        if self.buffer_dir is None or not self.buffer_dir.is_dir():
            return []
        return sorted(p for p in self.buffer_dir.iterdir() if p.is_dir() and (p / "op.json").is_file())

    def _hand_over(self, op_dir: Path, stage: Callable[[Path], None] | None) -> str | None:
        """One operation, its folder staged by ``stage`` (its files and ``op.json``; None: staged
        already): queued for the writer thread (None: no run id yet), or staged and submitted now."""
        if self._writer is not None:
            with self._queue_lock:
                self._queue.append((op_dir, stage))
            self._writer.wake()
            self._raise_writer_error()  # what the live server refused of an earlier write
            return None
        if stage is not None:
            _stage(op_dir, stage)
        return self._submit(op_dir)

    def _stage_queued(self) -> None:
        """Put the operations handed to the writer into the buffer, in the order they were handed
        over (their names sort the same way): from here on a crash leaves them for ``--resume``."""
        while True:
            with self._queue_lock:
                if not self._queue:
                    return
                op_dir, stage = self._queue.popleft()
            if stage is not None:
                _stage(op_dir, stage)
            self._fresh.add(op_dir.name)
            op_dir.rename(self._buffered(op_dir))

    def _submit(self, op_dir: Path) -> str | None:
        """Deliver one operation now, or buffer it when the server is unreachable; the run id or None."""
        try:
            if self.pending():
                self.flush()
            if self.pending():  # still down: queue behind the older operations, keeping the order
                self._enqueue(op_dir)
                return None
            try:
                return self._deliver(op_dir, first=True)
            except TrackingError:
                if self.buffer_dir is None or self._server_up():
                    raise  # refused by a live server (or no buffer): a real error
                self._enqueue(op_dir)
                return None
        finally:
            if op_dir.exists():  # delivered or refused; an enqueued folder has moved away
                shutil.rmtree(op_dir, ignore_errors=True)

    def _buffered(self, op_dir: Path) -> Path:
        if self.buffer_dir is None:
            raise RuntimeError("StudyTracker: no buffer_dir to queue an operation in")
        return self.buffer_dir / op_dir.name

    def _enqueue(self, op_dir: Path) -> None:
        target = self._buffered(op_dir)
        op_dir.rename(target)
        _log.warning("MLflow at %s is unreachable: %s buffered in %s (%d waiting)", self._safe_uri,
                     op_dir.name.split("-", 2)[-1], target, len(self.pending()))

    def flush(self, wait_s: float = 0.0) -> int:
        """Deliver buffered operations, oldest first; wait up to ``wait_s`` for the server to return.

        Returns how many are still buffered (0: all delivered).

        Example:
            >>> tracker.flush(wait_s=60)  # doctest: +SKIP
            0
        """
        if self._writer is not None:  # from here on this caller delivers: the writer thread ends first
            self._writer.stop()
            self._stage_queued()
            self._raise_writer_error()
        deadline = time.monotonic() + wait_s
        while True:
            entries = self.pending()
            if not entries:
                return 0
            if self._server_up():
                for entry in entries:
                    try:
                        self._deliver(entry)
                    except TrackingError as exc:
                        if self._server_up():  # refused, not unreachable: set it aside, do not block the queue
                            self._reject(entry, exc)
                            continue
                        break
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    continue
            if time.monotonic() >= deadline:
                return len(self.pending())
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _reject(self, entry: Path, exc: Exception) -> None:
        """A buffered operation the live server refused: moved to ``rejected/``, out of the queue."""
        rejected = self._buffered(entry).with_name("rejected")
        rejected.mkdir(exist_ok=True)
        entry.rename(rejected / entry.name)
        _log.error("MLflow refused buffered operation %s (kept in %s): %s", entry.name, rejected, exc)

    def settle(self, timeout_s: float = 300.0) -> None:
        """Wait until every write handed to the writer thread was tried: delivered, or kept in the
        buffer while the server is unreachable (bounded by ``timeout_s``); raise what it refused.
        Without a writer thread every write is tried before its call returns: nothing to wait for."""
        if self._writer is None:
            return
        if not self._writer.settle(timeout_s):
            _log.warning("MLflow at %s: writes still being delivered after %.0f s", self._safe_uri, timeout_s)
        self._raise_writer_error()

    def _raise_writer_error(self) -> None:
        error = self._writer.take_error() if self._writer is not None else None
        if error is not None:
            raise error

    def _drain_pass(self) -> bool:
        """The writer thread's pass: deliver the buffer oldest first; True when it is empty. Stops at
        the first operation the unreachable server could not take (kept, in order, for the next
        pass); a refused one is set aside in ``rejected/`` and its error raised for the driver, a
        full disk's left in the buffer for the next run of the study."""
        while True:
            self._stage_queued()
            entries = self.pending()
            if not entries:
                return True
            entry = entries[0]
            if entry.name in self._warned and not self._server_up():
                return False  # still down: no delivery attempt (MLflow's own retries take seconds)
            first = entry.name in self._fresh  # a half-written run can exist only after a first try
            self._fresh.discard(entry.name)
            try:
                self._deliver(entry, first=first)
            except TrackingError as exc:
                if not self._server_up():
                    if entry.name not in self._warned:
                        self._warned.add(entry.name)
                        _log.warning("MLflow at %s is unreachable: %s buffered in %s (%d waiting)", self._safe_uri,
                                     entry.name.split("-", 2)[-1], entry, len(self.pending()))
                    return False
                if not is_disk_full(exc):
                    self._reject(entry, exc)
                raise
            self._warned.discard(entry.name)
            shutil.rmtree(entry, ignore_errors=True)

    def _deliver(self, op_dir: Path, first: bool = False) -> str | None:
        """Write one operation to MLflow (idempotent: a redelivery replaces a half-written run).
        ``first``: its first attempt, straight from the driver (no half-written run can exist yet)."""
        op = json.loads((op_dir / "op.json").read_text(encoding="utf-8"))
        artifacts = op_dir / "artifacts"
        kind = op["kind"]
        if kind == "trial":
            return self._call("log the trial", lambda: self._deliver_trial(op, artifacts, first))
        if kind == "finish":
            self._call("log the study outcome", lambda: self._deliver_finish(op, artifacts))
        elif kind == "end":
            self._call("close the study run", lambda: self._client.set_terminated(op["parent"], status=op["status"]))
        else:
            raise TrackingError(f"unknown buffered operation {kind!r} in {op_dir}")
        return None

    def _deliver_trial(self, op: Mapping[str, Any], artifacts: Path, first: bool = False) -> str:
        delivery = op["tags"][TAG_DELIVERY]
        # An earlier attempt that died half-way left a run: replace it. The first attempt has none
        # to find (the search read every run's tags: a cost that grew with the study).
        page = [] if first else self._client.search_runs([op["experiment_id"]],
                                                         filter_string=f"tags.`{TAG_DELIVERY}` = '{delivery}'")
        for partial in page:
            self._client.delete_run(partial.info.run_id)
        run = self._client.create_run(op["experiment_id"], tags=op["tags"], run_name=op["run_name"],
                                      start_time=op.get("start_ms"))
        run_id = run.info.run_id
        try:
            self._log(run_id, params=op["params"], metrics=op["metrics"])
            if artifacts.is_dir():
                self._client.log_artifacts(run_id, str(artifacts))
            self._client.set_terminated(run_id, op["status"], end_time=op.get("end_ms"))
        except Exception:
            try:  # leave no RUNNING child behind if the server is still there (a redelivery deletes it)
                self._client.set_terminated(run_id, "FAILED")
            except Exception:  # noqa: BLE001 - best effort; the first error is the one to report
                pass
            raise
        return str(run_id)

    def _deliver_finish(self, op: Mapping[str, Any], artifacts: Path) -> None:
        self._log(op["parent"], metrics=op["metrics"], tags=op["tags"])
        if artifacts.is_dir() and any(artifacts.iterdir()):
            self._client.log_artifacts(op["parent"], str(artifacts))

    # -- end of study ------------------------------------------------------------------------

    def finish_study(self, best_flags: Mapping[str, Any] | None, model: str, trials: pd.DataFrame,
                     plots: Mapping[str, Any], summary_metrics: Mapping[str, float],
                     files: Mapping[str, str] | None = None) -> None:
        """Log the outcome on the parent run: best config and command, trials table, plots, metrics,
        and ``files`` (name -> text, e.g. ``headroom.json``), all as handed over (the recorder redacted them).

        ``plots`` maps a name (``history`` or ``history.png``) to a matplotlib Figure or a PNG
        path; each becomes ``plots/<name>.png``.
        ``best_flags`` is ``None`` when no trial succeeded (then no config or command is written).

        Example:
            >>> tracker.finish_study({"max_num_seqs": 64}, "org/m", df, {"history": fig},
            ...                      {"best_output_throughput": 10500.0})  # doctest: +SKIP
        """
        parent = self._require_study()
        op_dir = self._new_op_dir("finish")
        try:
            tags, metrics = _write_finish_files(op_dir / "artifacts", best_flags, model, trials, plots, summary_metrics)
            for name, text in (files or {}).items():
                (op_dir / "artifacts" / Path(name).name).write_text(text, encoding="utf-8")
        except BaseException:
            shutil.rmtree(op_dir, ignore_errors=True)
            raise
        _write_op(op_dir, {"kind": "finish", "parent": parent, "tags": tags, "metrics": metrics})
        self._hand_over(op_dir, None)

    def log_run(self, run_name: str, tags: Mapping[str, str], metrics: Mapping[str, float],
                files: Mapping[str, bytes] | None = None, artifact_path: str | None = None) -> str:
        """One finished run of its own (not a study's parent or child), e.g. the nightly job's
        ``nightly-<date>``: its tags, metrics and ``files`` (a relative path -> its bytes) under
        ``artifact_path``, as handed over (the recorder redacted them). Returns the run id.

        Written at once (no offline buffer): it is the last write of its job, which reports a
        failure instead of leaving it for a later delivery nobody would make.
        """
        run = self._call("create the run", lambda: self._client.create_run(
            self.experiment_id, run_name=run_name, tags={k: str(v) for k, v in tags.items()}))
        run_id = str(run.info.run_id)
        self._call("log the run's metrics", lambda: self._log(run_id, metrics=metrics))
        if files:
            with tempfile.TemporaryDirectory(prefix="servetune-run-") as staged:
                _write_files(Path(staged), files)
                self._call("upload the run's files",
                           lambda: self._client.log_artifacts(run_id, staged, artifact_path=artifact_path))
        self._call("finish the run", lambda: self._client.set_terminated(run_id, "FINISHED"))
        return run_id

    def end(self, status: str = "FINISHED") -> None:
        """Close the parent run: ``FINISHED``, ``FAILED`` or ``KILLED``.

        Example:
            >>> tracker.end("FINISHED")  # doctest: +SKIP
        """
        parent = self._require_study()
        word = status.upper()
        if word not in ("FINISHED", "FAILED", "KILLED"):
            raise SpecError("status", f"unknown run status {status!r}", "use FINISHED, FAILED or KILLED")
        op_dir = self._new_op_dir("end")
        _write_op(op_dir, {"kind": "end", "parent": parent, "status": word})
        self._hand_over(op_dir, None)


def one_run_per_trial(runs: Sequence[tuple[int, str, int, str]]) -> tuple[dict[int, str], list[str]]:
    """``(trial number, status, start ms, run id)`` of a study's trial runs -> the run kept per trial
    number (its newest complete one: ``FINISHED`` or ``FAILED``) and the run ids to delete (every
    other: unfinished ``RUNNING`` / ``KILLED`` ones and older duplicates). Pure.

    Example:
        >>> one_run_per_trial([(0, "FINISHED", 1, "a"), (0, "KILLED", 2, "b"), (1, "RUNNING", 3, "c"),
        ...                    (2, "FAILED", 4, "d"), (2, "FINISHED", 5, "e")])
        ({0: 'a', 2: 'e'}, ['b', 'c', 'd'])
    """
    keep: dict[int, tuple[int, str]] = {}
    for number, status, start, run_id in runs:
        if status in ("FINISHED", "FAILED") and (number not in keep or (start, run_id) > keep[number]):
            keep[number] = (start, run_id)
    kept = {number: run_id for number, (_, run_id) in keep.items()}
    return kept, sorted(run_id for _, _, _, run_id in runs if run_id not in set(kept.values()))


def _numbered(runs: Sequence[Any]) -> list[tuple[int, str, int, str]]:
    return [(int(r.data.tags[TAG_TRIAL_NUMBER]), r.info.status, r.info.start_time or 0, r.info.run_id)
            for r in runs if TAG_TRIAL_NUMBER in r.data.tags]


def ui_url(base: str, experiment_id: str, run_id: str | None = None) -> str:
    """The MLflow UI page of an experiment's runs (or of one run), opened in its runs layout.

    MLflow 3.17's UI chooses between its GenAI pages (traces, "Overview") and its model-training
    pages (the runs table) from a global ``workflowType`` (the "GenAI / Model training" switch,
    remembered by the browser; GenAI for a new browser), read from the URL first; the experiment's
    ``mlflow.experimentKind`` tag (set on servetune's experiments) decides it in MLflow versions
    without that switch. A link that names it opens on the runs whatever the browser remembers.

    Example:
        >>> ui_url("http://127.0.0.1:5000/", "3")
        'http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning'
    """
    page = f"runs/{run_id}" if run_id else "runs"
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/{page}?workflowType=machine_learning"


def _run_span(result: TrialResult) -> dict[str, int]:
    """The child run's start and end (ms): the trial's own wall time, from when it was handed to Ray
    until its result came back, so MLflow's Duration column shows what the trial took (a run is
    created only once the trial is over, which would read as a few milliseconds)."""
    end_ms = int(time.time() * 1000)
    took = result.dispatch_s if result.dispatch_s is not None else result.wall_s
    if took is None or took != took or took < 0:
        return {}
    return {"start_ms": end_ms - int(took * 1000), "end_ms": end_ms}


def _stage(op_dir: Path, stage: Callable[[Path], None]) -> None:
    """Run ``stage`` on ``op_dir``; a failure leaves no half-staged folder behind."""
    try:
        stage(op_dir)
    except BaseException:
        shutil.rmtree(op_dir, ignore_errors=True)
        raise


def _write_op(op_dir: Path, op: Mapping[str, Any]) -> None:
    """``op.json`` is written last, through a rename: a folder without it is not an operation yet."""
    tmp = op_dir / "op.json.tmp"
    tmp.write_text(json.dumps(op, sort_keys=True), encoding="utf-8")
    tmp.rename(op_dir / "op.json")


def _write_trial_files(target: Path, result: TrialResult, files: Mapping[str, bytes]) -> None:
    """A trial's artifacts, as handed over: engine.log, result.json, requests.parquet, files/..."""
    target.mkdir(parents=True, exist_ok=True)
    (target / "engine.log").write_text(result.log_text, encoding="utf-8")
    summary = {**result.to_dict(), "evidence": list(result.evidence)}  # where the trial ran, as handed over
    (target / "result.json").write_text(json.dumps(summary, indent=2, sort_keys=True), encoding="utf-8")
    # zstd at its fastest level, no dictionary (gaps are distinct floats): a tenth of the default's
    # bytes (snappy with dictionaries) in half its time.
    pq.write_table(requests_table(result.requests), target / "requests.parquet",
                   compression="zstd", compression_level=1, use_dictionary=False)
    _write_files(target / "files", files)


def _write_files(target: Path, files: Mapping[str, bytes]) -> None:
    """``files`` (a relative path -> its bytes) under ``target``; a path that climbs out is refused."""
    for name, data in files.items():
        dest = target / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise ValueError(f"artifact path {name!r} leaves its folder")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)


def _write_finish_files(target: Path, best_flags: Mapping[str, Any] | None, model: str, trials: pd.DataFrame,
                        plots: Mapping[str, Any], summary_metrics: Mapping[str, float]
                        ) -> tuple[dict[str, str], dict[str, float]]:
    """The study outcome's artifacts under ``target``; returns the parent's tags and metrics."""
    target.mkdir(parents=True, exist_ok=True)
    tags: dict[str, str] = {}
    if best_flags is not None:
        flags = dict(best_flags)
        command = to_command_line(model, flags)
        (target / "best_config.yaml").write_text(to_config_yaml(model, flags), encoding="utf-8")
        (target / "best_command.txt").write_text(command + "\n", encoding="utf-8")
        tags["servetune.best_command"] = _tag_value(command)
    else:
        command = None
    metrics = {k: float(v) for k, v in summary_metrics.items() if v is not None}
    table = trials
    table.to_csv(target / "trials.csv", index=False)
    table.to_parquet(target / "trials.parquet", index=False)
    if plots:
        plot_dir = target / "plots"
        plot_dir.mkdir()
        for name, plot in plots.items():
            dest = plot_dir / (name if name.lower().endswith(".png") else f"{name}.png")
            if hasattr(plot, "savefig"):
                plot.savefig(dest, format="png", dpi=110, bbox_inches="tight")
            else:
                dest.write_bytes(Path(plot).read_bytes())
    plot_names = sorted(p.name for p in (target / "plots").glob("*.png")) if plots else []
    tags[TAG_NOTE] = _tag_value(study_note(command, metrics, trials, plot_names))
    return tags, metrics


def study_note(command: str | None, best: Mapping[str, float], trials: pd.DataFrame, plots: list[str]) -> str:
    """The parent run's description (Markdown, the first thing on its MLflow page): the command to
    run, the winner's figures, what happened to the trials, and where the plots are. Pure.

    Example:
        >>> print(study_note("vllm serve m --max-num-seqs 64", {"output_throughput": 900.0, "preemptions": 0.0},
        ...                  pd.DataFrame({"status": ["ok", "pruned"], "preemptions": [0.0, None]}), []).splitlines()[2])
        vllm serve m --max-num-seqs 64
    """
    if command is None:
        lines = ["**No trial met the constraints**: nothing to recommend yet."]
    else:
        # The figures on the first line: MLflow shows a description's first lines until "Show more".
        lines = [f"**Best configuration**: {figure(best.get('output_throughput'), ',.0f', 'output tok/s')}, "
                 f"{figure(best.get('preemptions'), ',.0f', '').strip()} preemptions, "
                 f"p99 TTFT {figure(best.get('ttft_p99_ms'), ',.0f', 'ms')}, "
                 f"p99 ITL {figure(best.get('itl_p99_ms'), ',.1f', 'ms')}, "
                 f"KV cache {figure(best.get('kv_cache_tokens'), ',.0f', 'tokens')}. Run it with:",
                 "```", command, "```", "",
                 "`best_config.yaml` (Artifacts) is the same as a `vllm serve --config` file."]
    searched = trials[trials["repeat"].isna()] if "repeat" in trials.columns else trials
    counts = classify_frame(searched).value_counts() if not searched.empty else {}
    if len(counts):
        lines += ["", f"{len(searched)} trials: " + ", ".join(f"{int(counts[c])} {c.label}" for c in TrialOutcome
                                                             if c in counts) + "."]
    if plots:
        lines += ["", "Plots (Artifacts, `plots/`): " + ", ".join(f"`{p}`" for p in plots) + "."]
    return "\n".join(lines) + "\n"
