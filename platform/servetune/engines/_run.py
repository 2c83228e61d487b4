"""Dispatch: the backend name to its :class:`~servetune.engines.base.Engine`, and the one wrapper
that keeps the contract "a trial's own failure is a result, never an exception"."""

from __future__ import annotations

import time
import traceback

from servetune.engines._sim import SimEngine
from servetune.backends import BACKENDS
from servetune.engines.base import Engine, TrialTask
from servetune.engines.replay import ReplayEngine
from servetune.engines.vllm.engine import VllmEngine
from servetune.errors import SpecError
from servetune.result import TrialResult, TrialStatus

__all__ = ["ENGINES", "get_engine", "run_trial"]

#: Every engine, by backend name (``auto`` is resolved before: :func:`resolve_backend`).
ENGINES: dict[str, Engine] = {engine.name: engine for engine in (SimEngine(), VllmEngine(), ReplayEngine())}


def get_engine(backend: str) -> Engine:
    """The engine of a resolved backend name; SpecError for an unknown one."""
    try:
        return ENGINES[backend]
    except KeyError:
        raise SpecError("backend", f"unknown backend {backend!r}", f"use one of {', '.join(BACKENDS)}") from None


def run_trial(task: TrialTask, backend: str = "sim") -> TrialResult:
    """Run one trial on ``backend``; never raises for the trial's own failure (the Engine contract):
    a SpecError is ``invalid_config``, any other exception ``crashed`` with its traceback's tail."""
    started = time.perf_counter()
    reports_wall_s = False
    try:
        engine = get_engine(backend)
        reports_wall_s = engine.reports_wall_s
        result = engine.run(task)
    except SpecError as exc:
        result = TrialResult(status=TrialStatus.INVALID_CONFIG, cause=str(exc), backend=backend)
    except Exception as exc:  # noqa: BLE001 - a trial's crash is a result, not a study failure
        result = TrialResult(status=TrialStatus.CRASHED, cause=f"{type(exc).__name__}: {exc}",
                             evidence=traceback.format_exc().splitlines()[-8:], backend=backend)
    if not reports_wall_s or result.wall_s is None:  # a replayed trial keeps its recorded GPU cost
        result.wall_s = time.perf_counter() - started
    return result
