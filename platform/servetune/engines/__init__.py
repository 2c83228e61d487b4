"""Engines: one :class:`Engine` interface, three implementations (sim, vllm, replay).

Import from here: ``from servetune.engines import TrialTask, run_trial``. The contract is on
:class:`Engine`; :func:`run_trial` is the only way a study runs one (it keeps the contract that a
trial's own failure is a result). The vLLM I/O helpers (log parser, ``/metrics``, load
generators, ``vllm serve --help`` check, infrastructure evidence, diagnosis) live beside the real
engine in :mod:`servetune.engines.vllm`.

The names load on first use, so importing a helper module under this package stays cheap.
"""

from typing import TYPE_CHECKING

from servetune.lazy import lazy_face

if TYPE_CHECKING:
    from servetune.engines._run import ENGINES, get_engine, run_trial
    from servetune.engines._sim import SimEngine
    from servetune.backends import BACKENDS
    from servetune.engines.base import (LOAD_GENERATORS, Engine, LeaderRepeats, TrialTask, gpu_visible,
                                       resolve_backend)
    from servetune.engines.early_stop import EarlyStop
    from servetune.engines.replay import Landscape, ReplayEngine
    from servetune.engines.vllm import VllmEngine

__all__ = ["Engine", "TrialTask", "LeaderRepeats", "run_trial", "get_engine", "resolve_backend", "gpu_visible", "ENGINES",
           "BACKENDS", "LOAD_GENERATORS", "EarlyStop", "SimEngine", "VllmEngine", "ReplayEngine", "Landscape"]


#: Where each public name is defined: imported on first use (PEP 562), so a command that needs
#: one helper does not pay for every engine's imports (pandas, aiohttp, the load generators).
_DEFINED_IN = {
    "ENGINES": "servetune.engines._run",
    "get_engine": "servetune.engines._run",
    "run_trial": "servetune.engines._run",
    "SimEngine": "servetune.engines._sim",
    "BACKENDS": "servetune.backends",
    "LOAD_GENERATORS": "servetune.engines.base",
    "Engine": "servetune.engines.base",
    "LeaderRepeats": "servetune.engines.base",
    "TrialTask": "servetune.engines.base",
    "gpu_visible": "servetune.engines.base",
    "resolve_backend": "servetune.engines.base",
    "EarlyStop": "servetune.engines.early_stop",
    "Landscape": "servetune.engines.replay",
    "ReplayEngine": "servetune.engines.replay",
    "VllmEngine": "servetune.engines.vllm",
}


__getattr__, __dir__ = lazy_face(__name__, _DEFINED_IN, __all__)
