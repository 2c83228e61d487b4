"""What the steps of one driver run share: the spec and its Optuna study, the backend, the writer,
the progress callbacks, the counts so far, the stop request and the simulator screen."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

import optuna

from servetune.planner.comm import SERVETUNE_LAUNCH_ENV, CommEnv
from servetune.spec.schema import StudySpec
from servetune.study._dispatch import StopRequest
from servetune.study._outcome import StudyOutcome
from servetune.study._progress import StudyProgress
from servetune.study._recorder import Recorder

if TYPE_CHECKING:
    from servetune.search.screen import SimScreen


@dataclasses.dataclass
class StudyRun:
    """One run of the driver over one study (see :func:`servetune.study.run_study`)."""

    spec: StudySpec
    study: optuna.Study
    backend: str
    recorder: Recorder
    progress: StudyProgress
    outcome: StudyOutcome
    started: float  # time.monotonic() when the run began: budget.time_limit_s counts from here
    stop: StopRequest
    screen: SimScreen | None = None  # multi-fidelity: the calibrated simulator screen, if on
    #: The environment the trials' servers run with, that the pre-screen plans them with
    #: (:func:`servetune.planner.comm.trial_env`: the GPU workers' FlashInfer, probed by the driver).
    comm_env: CommEnv = SERVETUNE_LAUNCH_ENV

    def out_of_time(self) -> bool:
        limit = self.spec.budget.time_limit_s
        return limit is not None and time.monotonic() - self.started > limit

    @property
    def runs_dir(self) -> Path:
        return Path(self.spec.output.runs_dir)

    def trial_dir(self, name: str) -> Path:
        """A launch's folder under ``<runs_dir>/trials/<study>/``."""
        return self.runs_dir / "trials" / self.spec.name / name
