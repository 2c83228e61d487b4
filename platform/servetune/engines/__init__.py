"""Engines: one :class:`Engine` interface, three implementations (sim, vllm, replay).

Import from here: ``from servetune.engines import TrialTask, run_trial``. The contract is on
:class:`Engine`; :func:`run_trial` is the only way a study runs one (it keeps the contract that a
trial's own failure is a result). The vLLM I/O helpers (log parser, ``/metrics``, load
generators, ``vllm serve --help`` check, infrastructure evidence, diagnosis) live beside the real
engine in :mod:`servetune.engines.vllm`.
"""

from servetune.engines._run import ENGINES, get_engine, run_trial
from servetune.engines._sim import SimEngine
from servetune.engines.base import (BACKENDS, LOAD_GENERATORS, Engine, LeaderRepeats, TrialTask, gpu_visible,
                                   resolve_backend)
from servetune.engines.early_stop import EarlyStop
from servetune.engines.replay import Landscape, ReplayEngine
from servetune.engines.vllm import VllmEngine

__all__ = ["Engine", "TrialTask", "LeaderRepeats", "run_trial", "get_engine", "resolve_backend", "gpu_visible", "ENGINES",
           "BACKENDS", "LOAD_GENERATORS", "EarlyStop", "SimEngine", "VllmEngine", "ReplayEngine", "Landscape"]
