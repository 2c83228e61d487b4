"""What the installed ``vllm serve`` accepts, read from its own ``--help=all``. Pure.

A flag the installed vLLM does not know (``--swap-space`` on >= 0.18) or a value outside its
choices is an ``invalid_config`` found before launch, not after a minute of startup. The help text
is read once per host (``vllm serve --help=all``, see :func:`servetune.engines.vllm.engine.read_serve_help`);
this module only parses it.

Example:
    >>> help_text = '''options:
    ...   --max-num-seqs MAX_NUM_SEQS
    ...                         Maximum number of sequences.
    ...   --kv-cache-dtype {auto,fp8}
    ...   --enforce-eager, --no-enforce-eager
    ... '''
    >>> opts = parse_serve_help(help_text)
    >>> check_argv(["--max-num-seqs", "64", "--kv-cache-dtype", "fp16", "--swap-space", "4"], opts)
    ["--kv-cache-dtype: 'fp16' is not one of auto, fp8", '--swap-space: unknown to this vLLM (vllm serve: error: unrecognized arguments)']
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = ["parse_serve_help", "check_argv"]

# An option line: two spaces, then one or more comma-separated spellings, each maybe with a
# metavar or a {choice,list}.
_OPTION_LINE = re.compile(r"^  (-{1,2}[A-Za-z0-9][\w.-]*)(.*)$")
_SPELLING = re.compile(r"(-{1,2}[A-Za-z0-9][\w.-]*)(?:\s+(\{[^}]*\}|[A-Z_][A-Z0-9_]*))?")


def parse_serve_help(text: str) -> dict[str, tuple[str, ...] | None]:
    """Option spelling -> its choices (``None`` when free-form or a switch)."""
    options: dict[str, tuple[str, ...] | None] = {}
    for line in text.splitlines():
        m = _OPTION_LINE.match(line)
        if not m:
            continue
        for spelling, arg in _SPELLING.findall(line.strip()):
            choices = tuple(c.strip() for c in arg[1:-1].split(",")) if arg.startswith("{") else None
            options[spelling] = choices
    return options


def check_argv(argv: Sequence[str], options: Mapping[str, tuple[str, ...] | None]) -> list[str]:
    """Problems of a ``vllm serve`` argument list against the parsed help; empty when fine."""
    problems = []
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0]
        if name not in options:
            problems.append(f"{name}: unknown to this vLLM (vllm serve: error: unrecognized arguments)")
            continue
        choices = options[name]
        if choices:
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if value not in choices:
                problems.append(f"{name}: {value!r} is not one of {', '.join(choices)}")
    return problems
