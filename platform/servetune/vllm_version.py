"""vLLM version strings: the one reader every module uses.

A version is read as ``(major, minor, patch)``: the leading ``v``, a pre-release or post-release
suffix (``rc2``, ``.post1``, ``.dev3``) and a local build tag (``+cu124``) do not count, so
``"0.19.1+cu124"`` is ``(0, 19, 1)`` wherever servetune compares versions (the planner's memory
accounting, the log parser, the simulator and its log writer, the warm-start distance).

:func:`version_tuple` is the lenient reader for text that came from somewhere else (a log line, a
dataset row); :func:`servetune.planner.memory.parse_vllm_version` is the strict one for a user's
``vllm_version`` (it also refuses the V0 era) and is built on the same pattern.

Example:
    >>> version_tuple("0.19.1+cu124"), version_tuple("v0.13.0rc2"), version_tuple("0.26")
    ((0, 19, 1), (0, 13, 0), (0, 26, 0))
    >>> version_tuple("main") is None, minor("0.26.1")
    (True, '0.26')
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_VLLM_VERSION", "Version", "VERSION_RE", "version_tuple", "minor"]

#: The vLLM release servetune models when a spec names none (the GPU worker image pins the same).
DEFAULT_VLLM_VERSION = "0.26.0"

Version = tuple[int, int, int]

#: A whole vLLM version string; groups: major, minor, patch (may be absent).
VERSION_RE = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+-]?(?:rc|post|dev|a|b)\w*)?(?:\+\S*)?")
_PREFIX_RE = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")


def version_tuple(text: str | None) -> Version | None:
    """``(major, minor, patch)`` of the version ``text`` starts with, or None when it has none."""
    m = _PREFIX_RE.match(str(text or "").strip())
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def minor(text: str | None) -> str | None:
    """``"major.minor"`` of a version (patch releases do not change defaults or memory accounting);
    text that is no version is returned as its first two dot-separated parts, so it still compares
    equal to itself."""
    if not text:
        return None
    v = version_tuple(text)
    if v is None:
        return ".".join(str(text).lstrip("v").split(".")[:2])
    return f"{v[0]}.{v[1]}"
