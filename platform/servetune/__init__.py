"""servetune: which vLLM flags should this model run with on this GPU?

An Optuna study proposes vLLM flag sets, Ray actors run them (real ``vllm serve`` where a GPU is
visible, the simulated vLLM V1 engine elsewhere), MLflow and a Parquet dataset record every
trial, and the best preemption-free configuration comes out as a ready ``vllm serve`` command.
Start with ``servetune tune jobs/quickstart.yaml``; docs/architecture.md has the map.

Scripting against servetune::

    import servetune
    spec = servetune.load_spec("jobs/quickstart.yaml")
    outcome = servetune.run_study(spec)
    print(outcome.best_command)

What is public: the names in ``__all__`` here and in each package's ``__init__`` (``servetune.
planner``, ``.spec``, ``.search``, ``.engines``, ``.cluster``, ``.records``). Modules whose name
starts with ``_`` are private to their package; the other modules are importable (the tests and
benchmarks do) but their names outside ``__all__`` may change without notice.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Where each public name lives. They are imported on first use (PEP 562), deliberately: every
# ``import servetune.<anything>`` runs this file first, and ``servetune plan``, the ``vllm serve``
# stand-in and each Ray worker must not pay for Ray, Optuna and MLflow to read one submodule.
_PUBLIC = {
    "load_spec": "servetune.spec", "StudySpec": "servetune.spec", "SearchSpace": "servetune.spec",
    "run_study": "servetune.study", "StudyOutcome": "servetune.study", "best_trial": "servetune.study",
    "run_nightly": "servetune.nightly",
    "TrialTask": "servetune.engines", "Engine": "servetune.engines", "run_trial": "servetune.engines",
    "TrialResult": "servetune.result", "TrialStatus": "servetune.result",
    "Workload": "servetune.workload",
    "SpecError": "servetune.errors",
    "resolve_target": "servetune.planner", "plan_memory": "servetune.planner",
}

__all__ = ["__version__", *_PUBLIC]

if TYPE_CHECKING:
    from servetune.engines import Engine, TrialTask, run_trial
    from servetune.errors import SpecError
    from servetune.nightly import run_nightly
    from servetune.planner import plan_memory, resolve_target
    from servetune.result import TrialResult, TrialStatus
    from servetune.spec import SearchSpace, StudySpec, load_spec
    from servetune.study import StudyOutcome, best_trial, run_study
    from servetune.workload import Workload


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # resolved once
        return value
    raise AttributeError(f"module 'servetune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
