"""The package's examples run: every ``>>>`` in platform/servetune's docstrings is executed by
:mod:`doctest`, one case per module, so a wrong example fails CI and names its module.

Examples that need a GPU, a network, a running server or minutes of time carry
``# doctest: +SKIP`` in the source; everything else runs here."""

from __future__ import annotations

import doctest
import importlib
import io
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "servetune"
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _module_names() -> list[str]:
    """Every module of the package, by dotted name; ``__main__`` is left out (importing it runs the CLI)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _module_names()


@pytest.mark.parametrize("module", MODULES)
def test_module_doctests_pass(module: str) -> None:
    mod = importlib.import_module(module)
    tests = [t for t in doctest.DocTestFinder().find(mod) if t.examples]
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    for test in sorted(tests, key=lambda t: t.name):
        runner.run(test, out=report.write)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{module}: {results.failed} of {results.attempted} examples failed\n{report.getvalue()}"


def test_the_examples_are_found() -> None:
    """The walk sees the package: a broken finder (or a moved package) would pass every case above vacuously."""
    assert "servetune.sim.engine" in MODULES and "servetune.planner.memory" in MODULES
    mod = importlib.import_module("servetune.planner.memory")
    assert sum(len(t.examples) for t in doctest.DocTestFinder().find(mod)) > 0
