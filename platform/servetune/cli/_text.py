"""Help text for a terminal: the docstrings' reStructuredText markup taken out.

The command modules' docstrings stay reStructuredText (their ``>>>`` examples run in CI, and the
roles name what they link); what ``servetune --help`` shows from them goes through :func:`plain`,
and their ``Example::`` blocks through :func:`examples` (:class:`HelpFormatter` keeps those lines
as they are). Pure.
"""

from __future__ import annotations

import argparse
import re
import textwrap

__all__ = ["plain", "examples", "summary", "HelpFormatter"]

_ROLE = re.compile(r":[A-Za-z][\w.+-]*:`~?([^`<]*?)\s*(?:<[^`>]*>)?`")  # :func:`~a.b` -> b (its title)
_LITERAL = re.compile(r"``(.+?)``", re.S)
_INTERPRETED = re.compile(r"`([^`]+)`_{0,2}")


def plain(text: str) -> str:
    """``text`` without reStructuredText inline markup: literals, roles (a ``~`` keeps the last name)
    and interpreted text become their words; a paragraph's ``::`` becomes ``:``.

    Example:
        >>> plain("``servetune workload``: fitted by :mod:`servetune.engines.vllm.workload_fit` (:func:`~a.b.run`)")
        'servetune workload: fitted by servetune.engines.vllm.workload_fit (run)'
        >>> plain("Example::"), plain("see `the docs <https://x>`_ and `x`")
        ('Example:', 'see the docs and x')
    """
    def role(m: re.Match[str]) -> str:
        name = m.group(1)
        return name.rsplit(".", 1)[-1] if m.group(0).split("`", 1)[1].startswith("~") else name

    text = _LITERAL.sub(r"\1", text)
    text = _ROLE.sub(role, text)
    text = _INTERPRETED.sub(lambda m: re.sub(r"\s*<[^>]*>$", "", m.group(1)), text)
    return re.sub(r"(\S)::(\s*)$", r"\1:\2", text, flags=re.M)


def summary(doc: str, width: int = 79) -> str:
    """A docstring's first paragraph as plain text, filled to ``width``.

    Example:
        >>> summary('''``servetune plan``: predict vLLM's startup memory,
        ...     before launching.
        ...
        ... More.''')
        "servetune plan: predict vLLM's startup memory, before launching."
    """
    first = doc.strip().split("\n\n", 1)[0]
    return textwrap.fill(" ".join(plain(first).split()), width)


def examples(doc: str) -> str:
    """The command lines of a docstring's ``Example::`` block, for a help's epilog ("" if none).

    Example:
        >>> print(examples('''Runs.
        ...
        ... Example::
        ...
        ...     servetune tune jobs/quickstart.yaml
        ...     servetune best quickstart
        ... '''))
        examples:
          servetune tune jobs/quickstart.yaml
          servetune best quickstart
    """
    m = re.search(r"^Examples?::\s*\n\s*\n((?:[ \t]+\S.*\n?)+)", doc, re.M)
    if m is None:
        return ""
    lines = textwrap.dedent(m.group(1)).strip().splitlines()
    return "\n".join(["examples:", *("  " + line for line in lines)])


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description and epilog as written (:func:`summary` fills one, :func:`examples` lines up
    the other), and each sub-command's help on its name's line: argparse measures a sub-command
    without the two columns it indents it by, so a name as long as ``from-metrics`` wrapped."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if action.nargs == argparse.PARSER and action.help is not argparse.SUPPRESS:
            longest = max((len(name) for name in getattr(action, "choices", None) or {}), default=0)
            self._action_max_length = max(self._action_max_length, longest + self._current_indent + 2)
