"""Is servetune's core installed in this Python? Standard library only, so it runs before any import
that needs the core (a Ray job's ``python`` is whatever the node that runs it has on its PATH).

The core's requirements are read from ``pyproject.toml`` (``[project] dependencies``) where the
repository travels with the job (``ray job submit --working-dir .``), else from the installed
package's metadata. Each is checked by its distribution's installed version: missing, or older
than the requirement's lower bound (``>=``), is a problem named in one line with the fix.

Example:
    >>> parse_requirement("ray[default]>=2.60.0,<3  ")
    ('ray', (2, 60, 0), 'ray[default]>=2.60.0,<3')
    >>> missing_requirements(["pyyaml>=6.0"], installed=lambda name: None)
    ['pyyaml>=6.0 (not installed)']
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

try:
    import tomllib
except ImportError:  # pragma: no cover - Python < 3.11 is outside requires-python
    tomllib = None  # type: ignore[assignment]

__all__ = ["core_requirements", "parse_requirement", "missing_requirements", "check_core", "FIX"]

#: What to do about a missing core package (the README's cluster section says the same).
FIX = ("install servetune's core into the Python that runs the job on every Ray node "
       "(pip install -c constraints.txt -e . in the environment that runs `ray start`), "
       "or add a runtime_env that brings it")

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")


def parse_requirement(text: str) -> tuple[str, tuple[int, ...], str]:
    """``(distribution name, lower bound or (), the requirement as written)`` of a PEP 508 line
    (markers are cut off; only ``>=`` bounds are read)."""
    spec = text.split(";", 1)[0].strip()
    match = _NAME.match(spec)
    if match is None:
        return "", (), spec
    bound = re.search(r">=\s*([0-9][0-9.]*)", match.group(3) or "")
    low = tuple(int(p) for p in bound.group(1).strip(".").split(".")) if bound else ()
    return match.group(1), low, spec


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:
            break
    return tuple(parts)


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_requirements(requirements: Iterable[str],
                         installed: Callable[[str], str | None] = _installed) -> list[str]:
    """The requirements this Python does not meet, each with what it has instead."""
    out = []
    for line in requirements:
        name, low, spec = parse_requirement(line)
        if not name:
            continue
        version = installed(name)
        if version is None:
            out.append(f"{spec} (not installed)")
        elif low and _version_tuple(version) < low:
            out.append(f"{spec} (found {version})")
    return out


def core_requirements(pyproject: Path | None = None) -> list[str]:
    """The core's requirements: ``pyproject``'s ``[project] dependencies`` when that file exists,
    else the installed servetune's (extras left out), else none known."""
    if pyproject is not None and pyproject.is_file() and tomllib is not None:
        with pyproject.open("rb") as handle:
            return list(tomllib.load(handle).get("project", {}).get("dependencies", []))
    try:
        found = importlib.metadata.requires("servetune") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [r for r in found if not re.search(r"\bextra\s*==", r)]


def check_core(pyproject: Path | None = None) -> str | None:
    """One line naming what this Python lacks of servetune's core, and the fix; None when nothing."""
    missing = missing_requirements(core_requirements(pyproject))
    if not missing:
        return None
    return (f"error: python ({sys.executable}) lacks servetune's core: {', '.join(missing)} "
            f"(fix: {FIX})")
