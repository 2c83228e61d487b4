"""``servetune --help`` and every command's help: plain text for a terminal, one line per command.

The help's descriptions and examples come from the command modules' docstrings, which stay
reStructuredText (their ``>>>`` examples run in tests/test_doctests.py); no markup may reach a
terminal."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from servetune.cli._main import build_parser
from servetune.cli._text import plain

REPO = Path(__file__).resolve().parents[2]
#: reStructuredText a terminal would show as is: ``literals``, :roles:`x`, `interpreted text`,
#: a paragraph's ``::``, a directive.
MARKUP = re.compile(r"``|:[A-Za-z][\w.+-]*:`|`[^`\n]+`|\S::\s*$|^\s*\.\. \w", re.M)


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path the parser takes: (), ("tune",), ("workload", "from-trace"), ..."""
    found = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*path, name))
    return found


COMMANDS = _commands(build_parser())


def _help(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*path, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_command_is_found() -> None:
    assert {("tune",), ("best",), ("plan",), ("workload", "from-metrics"), ("workload", "from-trace")} <= set(COMMANDS)
    assert len(COMMANDS) == 11  # servetune, its 8 commands, workload's 2


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(("servetune", *p)))
def test_no_restructuredtext_reaches_a_commands_help(path: tuple[str, ...], capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    text = _help(path, capsys)
    assert text.startswith(f"usage: {' '.join(('servetune', *path))} ")
    assert MARKUP.findall(text) == [], text


def test_the_top_help_has_one_line_per_command_and_the_examples() -> None:
    """As a user runs it: the real entry point, an 80-column terminal."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform"), "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "servetune", "--help"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0 and MARKUP.findall(proc.stdout) == [], proc.stdout
    block = proc.stdout.split("\ncommands:\n  COMMAND\n", 1)[1].split("\n\n", 1)[0].splitlines()
    names = ["tune", "best", "report", "plan", "simulate", "capacity", "diagnose", "workload"]
    assert [line.split()[0] for line in block] == names  # no help wrapped onto a line of its own
    assert all(len(line) <= 80 and len(line.split()) > 2 for line in block)
    assert proc.stdout.splitlines()[2].startswith("servetune: tune vLLM's serving flags")
    assert "\nexamples:\n  servetune tune jobs/quickstart.yaml\n" in proc.stdout


def test_the_markup_pattern_and_plain_agree() -> None:
    """What the test calls markup is what plain() takes out (both ways, on the docstrings' forms)."""
    samples = ["``servetune plan``", ":func:`~servetune.cost.capacity_table`", ":mod:`servetune.inputs`",
               "see `servetune plan --help`", "Example::"]
    assert all(MARKUP.search(s) for s in samples)
    assert [plain(s) for s in samples] == ["servetune plan", "capacity_table", "servetune.inputs",
                                           "see servetune plan --help", "Example:"]
    assert not any(MARKUP.search(plain(s)) for s in samples)
