"""The one vLLM version reader: every module compares versions the same way."""

from __future__ import annotations

import pytest

from servetune.errors import SpecError
from servetune.planner.memory import parse_vllm_version
from servetune.vllm_version import DEFAULT_VLLM_VERSION, minor, version_tuple


@pytest.mark.parametrize(("text", "expected"), [
    ("0.26.0", (0, 26, 0)), ("0.19.1+cu124", (0, 19, 1)), ("v0.13.0rc2", (0, 13, 0)), ("0.26", (0, 26, 0)),
    ("0.20.1.post1", (0, 20, 1)), ("main", None), ("", None), (None, None),
])
def test_version_tuple_reads_the_release_and_ignores_suffixes(text: str | None, expected: tuple[int, ...] | None) -> None:
    assert version_tuple(text) == expected


def test_the_strict_reader_agrees_with_the_lenient_one_and_refuses_v0() -> None:
    for text in ("0.26.0", "0.19.1+cu124", "v0.13.0rc2", "0.10.2", "0.10.1.1"):
        assert parse_vllm_version(text) == version_tuple(text)
    with pytest.raises(SpecError):  # the V0 engine's profiler (before 0.10.0)
        parse_vllm_version("0.9.2")
    assert version_tuple(DEFAULT_VLLM_VERSION) is not None


def test_minor_ignores_patch_releases() -> None:
    assert minor("0.26.1") == minor("0.26.0+cu124") == "0.26"
    assert minor("nightly") == "nightly" and minor(None) is None
