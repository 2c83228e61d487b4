"""One told trial as servetune writes it down: built once by the driver, written three ways.

A :class:`TrialRecord` holds what the records of one trial say beyond its flags and
:class:`~servetune.result.TrialResult`: where the flags came from (``origin``), the planner's
verdict on a pruned trial (:class:`Prediction`), the calibrated simulator's on a screened one
(:class:`Screen`), a confirmation repeat's index, whether it was reconciled after a killed driver.
The codecs turn it into each store's shape, so no store's strings are read back into another's
numbers:

* :meth:`TrialRecord.mlflow_tags`: the child run's tags (the ``servetune.*`` names are part of
  the product: the UI, ``mlflow`` searches and the tests read them);
* :meth:`TrialRecord.dataset_row`: the Parquet row (:func:`servetune.records.dataset.trial_row`
  plus the record's own columns);
* the Optuna side is written by :func:`servetune.search.propose.tell` as user attributes.

Example:
    >>> from servetune.result import TrialResult, TrialStatus
    >>> rec = TrialRecord("s", 3, {"max_num_seqs": 64}, TrialResult(TrialStatus.PRUNED, cause="sim"), -1.0,
    ...                   gpu_type="H200", model="m", backend="vllm", vllm_version="0.26.0",
    ...                   screen=Screen("sim_screen: slower", 812.34, 0.0))
    >>> rec.mlflow_tags()["servetune.predicted_output_throughput"], rec.dataset_row()["predicted_output_throughput"]
    ('812.3', 812.3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from servetune.backends import capabilities
from servetune.planner.memory import MemoryPlan
from servetune.records.dataset import trial_dir_name, trial_row
from servetune.records.outcome import SCREEN_PREFIX, TrialOutcome, classify, is_screen_cause
from servetune.result import TrialResult, TrialStatus

__all__ = ["TrialRecord", "Prediction", "Screen", "SCREEN_PREFIX", "TAG_NOTE", "figure"]
_MAX_TAG_TEXT = 250
#: MLflow's own run-description tag: the UI renders it as Markdown at the top of the run's page.
TAG_NOTE = "mlflow.note.content"


def figure(value: float | None, fmt: str, unit: str) -> str:
    """A measured figure for people: "not measured" where there is none (never "nan").

    Example:
        >>> figure(1234.5, ",.0f", "tok/s"), figure(float("nan"), ".1f", "ms")
        ('1,234 tok/s', 'not measured')
    """
    if value is None or value != value:
        return "not measured"
    return f"{value:{fmt}} {unit}"  # a cause or reason in a tag: long enough to read, short of MLflow's limit


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The memory planner's verdict on a trial it pruned (predicted not to start)."""

    failure: str  # the TrialStatus it predicts, e.g. "startup_oom"
    startup_s: float
    fix: str | None = None

    @classmethod
    def from_plan(cls, plan: MemoryPlan) -> Prediction:
        return cls((plan.failure or TrialStatus.STARTUP_OOM).value, float(plan.startup_s), plan.fix or None)


@dataclasses.dataclass(frozen=True)
class Screen:
    """The calibrated simulator's verdict on a proposal it screened out, and the figures it rests on."""

    reason: str
    output_throughput: float
    preemptions: float


@dataclasses.dataclass(frozen=True)
class TrialRecord:
    """One told trial (or confirmation repeat) with everything its MLflow run and dataset row say.

    Its texts are written as they are: the driver's recorder builds it from a redacted result,
    model names, screen reason and planner fix (secrets are redacted there, once)."""

    study: str
    number: int  # the Optuna trial number (a repeat: the repeated trial's)
    flags: Mapping[str, Any]
    result: TrialResult
    objective: float  # the first objective as told to Optuna
    gpu_type: str
    model: str
    backend: str  # the study's backend; the result's own, when set, wins
    vllm_version: str  # the spec's; the result's own, when set, wins
    origin: str | None = None  # sampler / informed / warm_start / baseline / repeat; None: not known
    prediction: Prediction | None = None  # a pruned trial's planner verdict
    screen: Screen | None = None  # a screened trial's simulator verdict
    repeat: int | None = None  # a confirmation re-run of trial ``number``'s flags
    reconciled: bool = False  # written after a killed driver, from what Optuna stored
    serve_model: str | None = None  # what `vllm serve` gets (an HF id) when it differs from ``model``

    @property
    def run_backend(self) -> str:
        return self.result.backend or self.backend

    @property
    def run_vllm_version(self) -> str:
        return self.result.vllm_version or self.vllm_version

    @property
    def outcome(self) -> TrialOutcome:
        """What happened, in the words every plot, the report and MLflow use (:mod:`servetune.records.outcome`).

        A reconciled record (rebuilt from Optuna after a killed driver) has no :class:`Screen`;
        its cause still carries the screen's prefix.
        """
        screened = self.screen is not None or is_screen_cause(self.result.cause)
        return classify(self.result.status, self.result.preemptions, screened=screened)

    @property
    def trial_dir_name(self) -> str:
        """The trial's folder under ``<runs_dir>/trials/<study>/``."""
        return trial_dir_name(self.number, self.repeat)

    def headline(self) -> str:
        """The run's description (Markdown, first thing on its MLflow page): what happened and the
        figures that decide a trial, where MLflow's own metrics table lists 40 names alphabetically.
        The first line holds them all: MLflow shows only the first lines until "Show more"."""
        r, outcome = self.result, self.outcome
        title = f"**Trial #{self.number}: {outcome.label}**" + ("" if self.repeat is None else f" (repeat {self.repeat})")
        if outcome.served:
            p99 = lambda s: None if s is None else s.p99  # noqa: E731
            title += (f": {figure(r.output_throughput, ',.0f', 'output tok/s')}, "
                      f"{'not measured' if r.preemptions is None else r.preemptions} preemptions, "
                      f"p99 TTFT {figure(p99(r.ttft_ms), ',.0f', 'ms')}, p99 ITL {figure(p99(r.itl_ms), ',.1f', 'ms')}, "
                      f"KV cache {figure(None if r.kv_cache_tokens is None else float(r.kv_cache_tokens), ',.0f', 'tokens')}")
        elif r.cause:
            title += f": {r.cause[:_MAX_TAG_TEXT]}"
        lines = [title, "", outcome.explanation[0].upper() + outcome.explanation[1:] + "."]
        if self.prediction is not None and self.prediction.fix:
            lines += ["", f"Fix: {self.prediction.fix}"]
        if outcome.served:
            lines += ["", f"Requests: {r.completed or 0} completed, {r.failed or 0} failed."]
            if r.duration_s is not None:
                clock = "simulated " if capabilities(self.run_backend).virtual_time else ""
                lines.append(f"Measured window: {r.duration_s:,.1f} s {clock}after a startup of "
                             f"{figure(r.startup_s, ',.1f', 's')}.")
        if r.early_stopped:
            lines += ["", f"Measurement ended early: {r.early_stopped[:_MAX_TAG_TEXT]}"]
        return "\n".join(lines) + "\n"

    def mlflow_tags(self) -> dict[str, str]:
        """The child run's tags."""
        tags = {"gpu_type": self.gpu_type, "model": self.model, "backend": self.run_backend,
                "vllm_version": self.run_vllm_version, "optuna.trial_number": str(self.number),
                "servetune.study": self.study, "servetune.outcome": self.outcome.value,
                "servetune.outcome_label": self.outcome.label, TAG_NOTE: self.headline()}
        if self.origin is not None:
            tags["servetune.origin"] = self.origin
        if self.repeat is not None:
            tags["servetune.repeat"] = str(self.repeat)
        if self.reconciled:
            tags["servetune.reconciled"] = "true"
        if self.screen is not None:
            tags.update({"servetune.prescreen": SCREEN_PREFIX, "servetune.sim_screen": self.screen.reason[:_MAX_TAG_TEXT],
                         "servetune.predicted_output_throughput": f"{self.screen.output_throughput:.1f}",
                         "servetune.predicted_preemptions": f"{self.screen.preemptions:.0f}"})
        if self.result.infra_attempts:  # the machine failed this flag set before (the lines are in the evidence)
            tags["servetune.infra_attempts"] = str(len(self.result.infra_attempts))
        if self.result.status is TrialStatus.PRUNED and self.prediction is not None:
            tags.update({"servetune.prescreen": "pruned", "servetune.predicted_failure": self.prediction.failure,
                         "servetune.predicted_startup_s": f"{self.prediction.startup_s:.1f}"})
            if self.prediction.fix:
                tags["servetune.predicted_fix"] = self.prediction.fix
        if self.result.early_stopped:
            tags["servetune.early_stopped"] = self.result.early_stopped[:_MAX_TAG_TEXT]
        return tags

    def dataset_row(self) -> dict[str, Any]:
        """The Parquet row: the trial's flags and result, then the record's own columns."""
        extra: dict[str, Any] = {"backend": self.run_backend, "vllm_version": self.run_vllm_version,
                                 "objective": self.objective, "outcome": self.outcome.value}
        if self.result.status is TrialStatus.PRUNED and self.prediction is not None:
            extra["predicted_failure"] = self.prediction.failure
        if self.origin is not None:
            extra["origin"] = self.origin
        if self.serve_model is not None:  # the report prints the winner's `vllm serve` command with it
            extra["serve_model"] = self.serve_model
        if self.screen is not None:
            # The precision the MLflow tags show, so the two records of a screen agree.
            extra["sim_screen"] = self.screen.reason[:_MAX_TAG_TEXT]
            extra["predicted_output_throughput"] = round(self.screen.output_throughput, 1)
            extra["predicted_preemptions"] = float(round(self.screen.preemptions))
        if self.result.early_stopped:
            extra["early_stopped"] = self.result.early_stopped
        if self.repeat is not None:
            extra["repeat"] = self.repeat
        return trial_row(self.study, self.number, self.flags, self.result, self.gpu_type, self.model, extra)
