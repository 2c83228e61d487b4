"""MLflow tracking of a study: one parent run per study, one nested child run per trial.

Contract:

* The study driver process is the ONLY writer. :class:`StudyTracker` talks to the server through
  :class:`mlflow.MlflowClient` with explicit run ids; it never touches MLflow's global active-run
  state, so it is safe next to Ray workers and other threads.
* Parent run (``servetune.role=study``, tagged ``servetune.study=<name>``): the study params and
  tags; at the end ``best_config.yaml`` (a ``vllm serve --config`` file), ``best_command.txt``
  (``vllm serve MODEL --flag value ...``), ``trials.csv`` / ``trials.parquet``, ``plots/*.png``
  and the summary metrics. Resuming reopens the newest parent run with the same study tag and
  marks child runs an earlier submission left ``RUNNING`` as ``KILLED``.
* Child run ``trial-NNN`` (``mlflow.parentRunId`` = the parent, so the UI nests it): params are
  the flags under their vLLM names plus ``workload.*``; metrics are exactly
  :meth:`TrialResult.metrics`; tags are the study tags, ``servetune.status``,
  ``servetune.cause``, ``servetune.trial_number``, ``servetune.backend``,
  ``servetune.vllm_version``; artifacts ``engine.log``, ``requests.parquet``, ``result.json``.
* Run status: ``FINISHED`` for an ``ok`` trial, ``FAILED`` for any other trial status (the
  ``servetune.status`` tag says which: startup_oom, kv_too_small, ...), ``KILLED`` for a trial
  whose driver died mid-trial (set by the resume sweep). A failed trial is a measured outcome,
  but the red icon in the runs table is the fastest way to see which configurations did not
  serve, and its metrics (the memory breakdown of a startup OOM) are still logged and plotted.
* Secrets never leave the process: :func:`redact` masks keys that name secrets (``HF_TOKEN``,
  ``*_TOKEN``, ``*_KEY``, ``*SECRET*``, ``*PASSWORD*``...) and, in every value, URL credentials,
  token-shaped strings and the values of secret-named environment variables. It is applied to
  params, tags, text artifacts, per-request errors and the trials table.
* An unreachable server raises :class:`TrackingError` naming the URI (no buffering yet).

Example:
    >>> tracker = StudyTracker("http://127.0.0.1:5000", "servetune")  # doctest: +SKIP
    >>> parent = tracker.start_study("llama-h200", {"objective": "output_throughput"},
    ...                              {"gpu_type": "H200", "model": "org/model"})  # doctest: +SKIP
    >>> tracker.log_trial(0, {"max_num_seqs": 64}, result, tags={})  # doctest: +SKIP
    >>> tracker.finish_study({"max_num_seqs": 64}, "org/model", trials_df, plots, {"best_output_throughput": 1e4})  # doctest: +SKIP
    >>> tracker.end("FINISHED")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
import pyarrow.parquet as pq

from servetune.dataset import requests_table
from servetune.errors import SpecError
from servetune.flags import to_cli_args, to_config_yaml
from servetune.result import TrialResult, TrialStatus

__all__ = [
    "StudyTracker",
    "TrackingError",
    "redact",
    "redact_text",
    "is_secret_key",
    "render_command",
    "TAG_STUDY",
    "TAG_ROLE",
    "TAG_STATUS",
    "TAG_CAUSE",
    "TAG_TRIAL_NUMBER",
    "TAG_BACKEND",
    "TAG_VLLM_VERSION",
    "TAG_PARENT",
]

_log = logging.getLogger(__name__)

TAG_STUDY = "servetune.study"
TAG_ROLE = "servetune.role"  # "study" on the parent, "trial" on children
TAG_STATUS = "servetune.status"  # a TrialStatus word
TAG_CAUSE = "servetune.cause"
TAG_TRIAL_NUMBER = "servetune.trial_number"  # the Optuna trial number
TAG_BACKEND = "servetune.backend"
TAG_VLLM_VERSION = "servetune.vllm_version"
TAG_PARENT = "mlflow.parentRunId"  # MLflow's own nesting tag: the UI groups children under it
_TAG_RUN_NAME = "mlflow.runName"

# MLflow's server-side limits (mlflow.utils.validation); fixed here so a server upgrade that
# lowers them shows up as a failing test, not as silently different truncation.
MAX_TAG_VALUE = 8000
MAX_PARAM_VALUE = 6000
_MAX_PARAMS_TAGS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000

MASK = "***"

# ---------------------------------------------------------------------------------------------
# Redaction (pure)
# ---------------------------------------------------------------------------------------------

# TOKEN may end a compound word (ACCESSTOKEN); KEY must be its own word, or "monkey" would match.
_SECRET_KEY_END = re.compile(r"TOKEN$|(?:^|[^A-Z0-9])KEY(?:_ID)?$")
_SECRET_KEY_WORDS = ("SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "APIKEY", "PRIVATE_KEY", "AUTHORIZATION")
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@:]*(?::[^/\s@]*)?@")
# Token shapes of the services a vLLM deployment talks to: Hugging Face, OpenAI-style, GitHub,
# AWS access keys, bearer headers.
_TOKEN_SHAPES = re.compile(
    r"\bhf_[A-Za-z0-9]{8,}|\bsk-[A-Za-z0-9_\-]{16,}|\bgh[pousr]_[A-Za-z0-9]{20,}|\bAKIA[0-9A-Z]{16}\b"
    r"|(?i:bearer)\s+[A-Za-z0-9._\-~+/]{8,}=*"
)


def is_secret_key(key: str) -> bool:
    """Whether a param/tag/env name names a secret (``HF_TOKEN``, ``api_key``, ``db.password``).

    ``max_num_batched_tokens`` and ``kv_cache_tokens`` are counts, not secrets: only a name that
    *ends* in TOKEN, or in KEY as a word of its own, counts.

    Example:
        >>> [is_secret_key(k) for k in ("HF_TOKEN", "hf.token", "openai_api_key", "DB_PASSWORD", "max_num_batched_tokens")]
        [True, True, True, True, False]
    """
    upper = key.upper()
    return bool(_SECRET_KEY_END.search(upper)) or any(word in upper for word in _SECRET_KEY_WORDS)


def _env_secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of secret-named environment variables, longest first (so no partial masking)."""
    env = os.environ if environ is None else environ
    values = {v for k, v in env.items() if is_secret_key(k) and len(v) >= 6}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, environ: Mapping[str, str] | None = None) -> str:
    """Mask URL credentials, token-shaped strings and secret env values inside free text.

    Example:
        >>> redact_text("pull https://user:pw@hub.example/m with hf_abcdefgh12345", environ={})
        'pull https://***@hub.example/m with ***'
    """
    for secret in _env_secret_values(environ):
        text = text.replace(secret, MASK)
    text = _URL_CREDENTIALS.sub(lambda m: m.group("scheme") + MASK + "@", text)
    return _TOKEN_SHAPES.sub(MASK, text)


def redact(mapping: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A copy of ``mapping`` safe to log: secret-named keys masked, secrets inside values masked.

    Non-string values are kept as they are (numbers and booleans cannot hold a token); nested
    mappings and lists are redacted recursively.

    Example:
        >>> redact({"HF_TOKEN": "hf_x", "max_num_seqs": 64, "url": "s3://k:s@bucket/x"}, environ={})
        {'HF_TOKEN': '***', 'max_num_seqs': 64, 'url': 's3://***@bucket/x'}
    """
    return {str(k): (MASK if is_secret_key(str(k)) else _redact_value(v, environ)) for k, v in mapping.items()}


def _redact_value(value: Any, environ: Mapping[str, str] | None) -> Any:
    if isinstance(value, str):
        return redact_text(value, environ)
    if isinstance(value, Mapping):
        return redact(value, environ)
    if isinstance(value, (list, tuple)):
        return type(value)(_redact_value(v, environ) for v in value)
    return value


# ---------------------------------------------------------------------------------------------
# Rendering (pure)
# ---------------------------------------------------------------------------------------------


def render_command(model: str, flags: Mapping[str, Any]) -> str:
    """The ``vllm serve`` command line of a flag set, shell-quoted for copy and paste (display only).

    Example:
        >>> render_command("org/m", {"max_num_seqs": 64, "enforce_eager": True, "kv_cache_dtype": "fp8"})
        'vllm serve org/m --max-num-seqs 64 --enforce-eager --kv-cache-dtype fp8'
    """
    return shlex.join(["vllm", "serve", model, *to_cli_args(flags)])


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
                 artifact_location: str | None = None) -> None:
        # ``artifact_location``: where a NEW experiment keeps its artifacts. For a local store
        # (sqlite:) the driver passes a folder beside the database, so `mlflow ui` finds them
        # whatever directory it is started from (MLflow's default is ./mlruns of the cwd).
        self.artifact_location = artifact_location
        if not experiment:
            raise SpecError("tracking.experiment", "empty experiment name", "name the MLflow experiment")
        self.tracking_uri = tracking_uri.rstrip("/")
        self.experiment = experiment
        self._check_reachable(connect_timeout_s)
        from mlflow import MlflowClient  # deferred: importing mlflow costs about a second

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

    @property
    def _safe_uri(self) -> str:
        return redact_text(self.tracking_uri)

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run one MLflow operation; turn transport and server errors into :class:`TrackingError`."""
        from mlflow.exceptions import MlflowException

        try:
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
            return str(exp.experiment_id)
        try:
            return str(self._client.create_experiment(self.experiment, artifact_location=self.artifact_location))
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

    def start_study(self, study_name: str, params: Mapping[str, Any], tags: Mapping[str, str],
                    resume: bool = False) -> str:
        """Open the study's parent run (new, or the earlier one when ``resume``); returns its id.

        ``tags`` (e.g. ``{"gpu_type": "H200", "model": "org/m"}``) go on the parent and are
        copied onto every trial run, so trials can be searched by them.

        Example:
            >>> tracker.start_study("s1", {"objective": "output_throughput"}, {"gpu_type": "H200"})  # doctest: +SKIP
            '3f2a...'
        """
        existing = self.find_study_run(study_name)
        safe_params = redact(_flatten(params))
        self._study_tags = {k: str(v) for k, v in redact(tags).items()}
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

    # -- trials ------------------------------------------------------------------------------

    def log_trial(self, trial_number: int, flags: Mapping[str, Any], result: TrialResult,
                  tags: Mapping[str, str], artifacts_dir: Path | None = None, *,
                  workload: Mapping[str, Any] | None = None) -> str:
        """Record one finished trial as a nested child run; returns the child run id.

        ``workload`` (the workload description) is logged as ``workload.*`` params; files in
        ``artifacts_dir`` are uploaded under ``files/`` (text files redacted).

        Example:
            >>> tracker.log_trial(7, {"max_num_seqs": 64}, result, {"sampler": "tpe"})  # doctest: +SKIP
            'c0ffee...'
        """
        parent = self._require_study()
        status = TrialStatus(result.status)
        params = redact({**{str(k): v for k, v in flags.items() if v is not None},
                         **_flatten(workload or {}, "workload.")})
        run_tags: dict[str, Any] = {
            **self._study_tags,
            **redact(tags),
            TAG_PARENT: parent,
            TAG_STUDY: self.study_name,
            TAG_ROLE: "trial",
            TAG_TRIAL_NUMBER: str(trial_number),
            TAG_STATUS: status.value,
            TAG_BACKEND: result.backend,
        }
        if result.vllm_version:
            run_tags[TAG_VLLM_VERSION] = result.vllm_version
        if result.cause:
            run_tags[TAG_CAUSE] = redact_text(result.cause)
        run_tags = {k: _tag_value(v) for k, v in run_tags.items()}
        run = self._call("create the trial run", lambda: self._client.create_run(
            self.experiment_id, tags=run_tags, run_name=f"trial-{trial_number:03d}"))
        run_id = run.info.run_id
        try:
            self._call("log the trial", lambda: self._log_trial_body(run_id, params, result, artifacts_dir))
            self._call("close the trial run", lambda: self._client.set_terminated(run_id, _child_status(status)))
        except TrackingError:
            try:  # leave no RUNNING child behind if the server is still there
                self._client.set_terminated(run_id, "FAILED")
            except Exception:  # noqa: BLE001 - best effort; the first error is the one to report
                pass
            raise
        return run_id

    def _log_trial_body(self, run_id: str, params: Mapping[str, Any], result: TrialResult,
                        artifacts_dir: Path | None) -> None:
        self._log(run_id, params=params, metrics=result.metrics())
        self._client.log_text(run_id, redact_text(result.log_text), "engine.log")
        summary = {**result.to_dict(), "cause": redact_text(result.cause or "") or None,
                   "evidence": [redact_text(e) for e in result.evidence]}
        self._client.log_text(run_id, json.dumps(summary, indent=2, sort_keys=True), "result.json")
        with tempfile.TemporaryDirectory(prefix="servetune-trial-") as tmp:
            path = Path(tmp) / "requests.parquet"
            pq.write_table(requests_table(result.requests, redact=redact_text), path)
            self._client.log_artifact(run_id, str(path))
            if artifacts_dir is not None:
                staged = Path(tmp) / "files"
                _stage_redacted(Path(artifacts_dir), staged)
                self._client.log_artifacts(run_id, str(staged), artifact_path="files")

    # -- end of study ------------------------------------------------------------------------

    def finish_study(self, best_flags: Mapping[str, Any] | None, model: str, trials: pd.DataFrame,
                     plots: Mapping[str, Any], summary_metrics: Mapping[str, float]) -> None:
        """Log the outcome on the parent run: best config and command, trials table, plots, metrics.

        ``plots`` maps a name (``history`` or ``history.png``) to a matplotlib Figure or a PNG
        path; each becomes ``plots/<name>.png``.
        ``best_flags`` is ``None`` when no trial succeeded (then no config or command is written).

        Example:
            >>> tracker.finish_study({"max_num_seqs": 64}, "org/m", df, {"history": fig},
            ...                      {"best_output_throughput": 10500.0})  # doctest: +SKIP
        """
        parent = self._require_study()
        self._call("log the study outcome",
                   lambda: self._finish_body(parent, best_flags, model, trials, plots, summary_metrics))

    def _finish_body(self, parent: str, best_flags: Mapping[str, Any] | None, model: str,
                     trials: pd.DataFrame, plots: Mapping[str, Any], summary_metrics: Mapping[str, float]) -> None:
        model = redact_text(model)
        tags: dict[str, Any] = {}
        if best_flags is not None:
            flags = redact(best_flags)
            command = render_command(model, flags)
            self._client.log_text(parent, to_config_yaml(model, flags), "best_config.yaml")
            self._client.log_text(parent, command + "\n", "best_command.txt")
            tags["servetune.best_command"] = command
        metrics = {k: float(v) for k, v in summary_metrics.items() if v is not None}
        self._log(parent, metrics=metrics, tags=tags)
        with tempfile.TemporaryDirectory(prefix="servetune-study-") as tmp:
            table = _redact_frame(trials)
            csv_path, parquet_path = Path(tmp) / "trials.csv", Path(tmp) / "trials.parquet"
            table.to_csv(csv_path, index=False)
            table.to_parquet(parquet_path, index=False)
            self._client.log_artifact(parent, str(csv_path))
            self._client.log_artifact(parent, str(parquet_path))
            plot_dir = Path(tmp) / "plots"
            plot_dir.mkdir()
            for name, plot in plots.items():
                target = plot_dir / (name if name.lower().endswith(".png") else f"{name}.png")
                if hasattr(plot, "savefig"):
                    plot.savefig(target, format="png", dpi=110, bbox_inches="tight")
                else:
                    target.write_bytes(Path(plot).read_bytes())
            if plots:
                self._client.log_artifacts(parent, str(plot_dir), artifact_path="plots")

    def end(self, status: str = "FINISHED") -> None:
        """Close the parent run: ``FINISHED``, ``FAILED`` or ``KILLED``.

        Example:
            >>> tracker.end("FINISHED")  # doctest: +SKIP
        """
        parent = self._require_study()
        word = status.upper()
        if word not in ("FINISHED", "FAILED", "KILLED"):
            raise SpecError("status", f"unknown run status {status!r}", "use FINISHED, FAILED or KILLED")
        self._call("close the study run", lambda: self._client.set_terminated(parent, status=word))


def _redact_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The trials table without secret-named columns and with secrets masked in text cells."""
    keep = [c for c in df.columns if not is_secret_key(str(c))]
    out = df[keep].copy()
    for column in out.columns:
        if out[column].dtype == object or pd.api.types.is_string_dtype(out[column]):
            out[column] = out[column].map(lambda v: redact_text(v) if isinstance(v, str) else v)
    return out


def _stage_redacted(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target``: UTF-8 text files redacted, binary files as they are."""
    for path in sorted(source.rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        dest = target / path.relative_to(source)
        dest.parent.mkdir(parents=True, exist_ok=True)
        data = path.read_bytes()
        try:
            dest.write_text(redact_text(data.decode("utf-8")), encoding="utf-8")
        except UnicodeDecodeError:
            dest.write_bytes(data)
