"""Errors that name the field at fault and the fix, raised before any GPU time is spent."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["NotModelled", "SpecError", "did_you_mean"]


class SpecError(ValueError):
    """A bad study spec, search space, workload, flag or CLI value.

    ``field`` is a dotted path into the input (``search_space.max_num_seqs.high``); ``fix`` says
    what to change. The CLI prints ``str(err)`` and exits with code 2.

    Example:
        >>> str(SpecError("budget.trials", "must be >= 1, got 0", "set budget.trials to a positive integer"))
        'budget.trials: must be >= 1, got 0 (fix: set budget.trials to a positive integer)'
    """

    def __init__(self, field: str, message: str, fix: str | None = None) -> None:
        field, message = _clip(_one_line(field), 300), _clip(_one_line(message), _MAX_MESSAGE)
        fix = _one_line(fix) if fix else fix
        self.field = field
        self.message = message
        self.fix = fix
        text = f"{field}: {message}" if field else message
        if fix:
            text += f" (fix: {fix})"
        super().__init__(text)


class NotModelled(SpecError):
    """Flags vLLM accepts that the planner does not model: any figure for them would be a guess.

    ``servetune plan`` prints it and exits 2 like any :class:`SpecError`. A study's prescreen tells it
    apart from flags vLLM itself refuses: on a real GPU the trial runs without a prediction (the start
    decides); on the simulated engine, which needs the plan, it stays an invalid flag set.

    Example:
        >>> err = NotModelled("enable_prefix_caching", "prefix caching on a Mamba hybrid is not modelled", "leave it off")
        >>> isinstance(err, SpecError), str(err)
        (True, 'enable_prefix_caching: prefix caching on a Mamba hybrid is not modelled (fix: leave it off)')
    """


_MAX_MESSAGE = 600  # a message that prints a whole value (a 1 MB description) keeps its start and end


def _one_line(text: str) -> str:
    """A line break inside a value (a key ``"a\\nb"`` in a spec) written as ``\\n``: the error stays one line."""
    return text.replace("\r", "\\r").replace("\n", "\\n") if "\n" in text or "\r" in text else text


def _clip(text: str, width: int) -> str:
    """``text``, or its start and end around a note of how much was left out: one readable line."""
    if len(text) <= width:
        return text
    head, tail = text[: width * 2 // 3], text[-(width // 4):]
    return f"{head}...[{len(text) - len(head) - len(tail):,} characters]...{tail}"


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest known word, or ``""``."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
