"""A package face whose names load on first use (PEP 562): the one implementation both engine faces use.

Example:
    >>> __getattr__, __dir__ = lazy_face("servetune.result", {"TrialStatus": "servetune.result"}, ["TrialStatus"])
    >>> __getattr__("TrialStatus").OK.value
    'ok'
    >>> __getattr__("nothing")
    Traceback (most recent call last):
    ...
    AttributeError: module 'servetune.result' has no attribute 'nothing'
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_face"]


def lazy_face(module: str, defined_in: Mapping[str, str],
              public: Sequence[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package ``module``: each name in ``defined_in`` is imported from
    the module named there the first time it is asked for, then kept in the package's namespace."""

    def getattr_(name: str) -> Any:
        if name not in defined_in:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(defined_in[name]), name)
        if module in sys.modules:
            setattr(sys.modules[module], name, value)
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[module])) | set(public))

    return getattr_, dir_
