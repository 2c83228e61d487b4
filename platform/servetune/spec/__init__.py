"""The study spec: a user's YAML validated into a :class:`StudySpec`, and its search space.

Every bad input is a :class:`~servetune.errors.SpecError` naming the field and the fix, raised
before any trial starts. The spec is the user's language and sits above the engines: it checks a
study against the engines' contracts (backend names, a replay landscape's columns, what
``vllm bench serve`` can send) and the planner, and the driver translates it into engine tasks, so
nothing below this package knows a spec exists.
"""

from servetune.spec.schema import SPEC_KEYS, Budget, Constraints, GpuPool, Objective, StudySpec, find_search_space, load_spec
from servetune.spec.space import Param, Rule, SearchSpace

__all__ = ["StudySpec", "load_spec", "find_search_space", "SPEC_KEYS", "GpuPool", "Objective", "Constraints", "Budget",
           "SearchSpace", "Param", "Rule"]
