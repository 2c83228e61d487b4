"""Bounded reading of every file a user hands over: specs, workloads, traces, GPU files, config.json, logs.

A file named in a spec or on the command line is untrusted: it may be a FIFO that never ends, a
device (``/dev/zero``), a 1 GB log or a YAML alias bomb. Every reader here

* opens the path non-blocking and accepts a regular file only (a FIFO, a device or a folder is a
  one-line :class:`~servetune.errors.SpecError`, never a wait);
* reads at most the cap of its kind (:data:`LIMITS`), stated in the refusal and raised by an
  environment variable (``SERVETUNE_MAX_YAML_BYTES=8388608``);
* parses YAML with its nesting depth and its alias expansion bounded (:data:`MAX_YAML_DEPTH`,
  :data:`MAX_YAML_VALUES` values counted while composing, before anything is expanded), and JSON
  with finite numbers only (``NaN``, ``Infinity``, ``1e999`` and integers beyond 1e18 are refused);
* streams line files (JSONL prompt sets and traces) with a cap on lines and on each line.

:func:`shown` is how an error message prints a value: at most ~100 characters, whatever its size.

Example:
    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "w.yaml"
    >>> _ = p.write_text("input_len: 512\\n")
    >>> load_yaml(read_text(p, "yaml", "--workload"), "--workload", str(p))
    {'input_len': 512}
    >>> shown("x" * 1000)[:20], len(shown("x" * 1000)) <= 100
    ("'xxxxxxxxxxxxxxxxxxx", True)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import reprlib
import stat
from collections.abc import Iterator
from typing import Any, BinaryIO

import yaml

from servetune.errors import SpecError

__all__ = ["LIMITS", "Limit", "MAX_YAML_DEPTH", "MAX_YAML_VALUES", "MAX_JSON_INT", "BoundedLoader", "limit",
           "missing", "open_regular", "open_capped", "read_bytes", "read_text", "iter_lines", "load_yaml", "load_json", "read_yaml_file",
           "read_json_file", "shown", "finite"]

_MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Limit:
    """The cap of one kind of file: bytes (and lines, for line files), each overridable by ``env``."""

    what: str
    max_bytes: int
    env: str
    max_lines: int | None = None
    lines_env: str | None = None
    max_line_bytes: int = 16 * _MiB


LIMITS: dict[str, Limit] = {
    "yaml": Limit("a YAML document", 1 * _MiB, "SERVETUNE_MAX_YAML_BYTES"),
    "json": Limit("a JSON document", 1 * _MiB, "SERVETUNE_MAX_JSON_BYTES"),
    "log": Limit("a log", 16 * _MiB, "SERVETUNE_MAX_LOG_BYTES"),
    "table": Limit("a landscape table", 256 * _MiB, "SERVETUNE_MAX_TABLE_BYTES"),
    "jsonl": Limit("a JSONL file", 256 * _MiB, "SERVETUNE_MAX_JSONL_BYTES", 1_000_000, "SERVETUNE_MAX_JSONL_LINES",
                   max_line_bytes=4 * _MiB),
}
MAX_YAML_DEPTH = 64
MAX_YAML_VALUES = 50_000  # values of a document with every alias expanded
MAX_JSON_INT = 10**18

_SHORT = reprlib.Repr()
for _name, _value in (("maxlevel", 2), ("maxtuple", 4), ("maxlist", 4), ("maxarray", 4), ("maxdict", 3),
                      ("maxset", 4), ("maxfrozenset", 4), ("maxdeque", 4), ("maxstring", 60), ("maxlong", 40),
                      ("maxother", 60)):
    setattr(_SHORT, _name, _value)


def shown(value: Any, width: int = 100) -> str:
    """``repr(value)`` in at most ``width`` characters, in time bounded whatever the value's size.

    Example:
        >>> shown(float("nan")), shown([1] * 10**6)
        ('nan', '[1, 1, 1, 1, ...]')
    """
    text = _SHORT.repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _clip(text: str, width: int = 200) -> str:
    """A path or a name as it is, cut to ``width`` characters."""
    return text if len(text) <= width else text[: width - 3] + "..."


def finite(value: Any, field: str, *, minimum: float | None = None, integer: bool = False) -> float:
    """A number read from a file or the command line: finite, not a bool, and at least ``minimum``.

    Example:
        >>> finite(2, "x", minimum=0)
        2.0
        >>> finite(float("nan"), "x")
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: x: expected a finite number, got nan (fix: write a plain number)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(field, f"expected a number, got {shown(value)}", "write a plain number")
    if isinstance(value, int) and abs(value) > MAX_JSON_INT:
        raise SpecError(field, f"{shown(value)} is beyond 1e18", "write a number of at most 1e18")
    if not math.isfinite(value):
        raise SpecError(field, f"expected a finite number, got {shown(value)}", "write a plain number")
    if integer and value != int(value):
        raise SpecError(field, f"expected a whole number, got {shown(value)}", "write an integer")
    if minimum is not None and value < minimum:
        raise SpecError(field, f"must be >= {minimum:g}, got {shown(value)}", f"use a value >= {minimum:g}")
    return float(value)


def limit(kind: str) -> Limit:
    """The cap of ``kind`` with any environment override applied (a bad override is a SpecError)."""
    base = LIMITS[kind]

    def env_int(name: str | None, default: int | None) -> int | None:
        raw = os.environ.get(name or "", "").strip()
        if not name or not raw:
            return default
        if not raw.isdigit() or int(raw) < 1:
            raise SpecError(name, f"expected a positive whole number, got {shown(raw)}", f"unset {name} or give e.g. {default}")
        return int(raw)

    return dataclasses.replace(base, max_bytes=env_int(base.env, base.max_bytes) or base.max_bytes,
                               max_lines=env_int(base.lines_env, base.max_lines))


def _size_text(n: int) -> str:
    return f"{n / _MiB:g} MiB" if n >= _MiB and n % (_MiB // 4) == 0 else f"{n:,} bytes"


def missing(path: str | os.PathLike[str]) -> bool:
    """Whether nothing is at ``path`` (a path through a file is not "missing": opening it says why)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def open_regular(path: str | os.PathLike[str], field: str) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file; a FIFO, a device, a socket or a folder is refused
    at once (the open does not block on a FIFO without a writer)."""
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise SpecError(field, f"file not found: {_clip(name)}", "check the path") from None
    except OSError as exc:
        raise SpecError(field, f"cannot read {_clip(name)}: {exc.strerror or exc}", "give a readable file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise SpecError(field, f"{_clip(name)} is {what}, not a regular file", "give the path of a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _too_big(name: str, kind: str, cap: Limit, field: str, size: int | None = None) -> SpecError:
    over = f"{size:,} bytes, " if size is not None else ""
    return SpecError(field, f"{_clip(name)} is {over}over the {_size_text(cap.max_bytes)} limit of {cap.what}",
                     f"give a smaller file, or raise the limit with {cap.env}=BYTES")


def open_capped(path: str | os.PathLike[str], kind: str, field: str) -> BinaryIO:
    """:func:`open_regular`, refused when the file is over the cap of ``kind`` (for a reader that takes a file
    object: pandas, pyarrow)."""
    cap, name = limit(kind), os.fspath(path)
    fh = open_regular(name, field)
    size = os.fstat(fh.fileno()).st_size
    if size > cap.max_bytes:
        fh.close()
        raise _too_big(name, kind, cap, field, size)
    return fh


def read_bytes(path: str | os.PathLike[str], kind: str, field: str) -> bytes:
    """The bytes of a regular file of at most :func:`limit` ``(kind).max_bytes``."""
    cap, name = limit(kind), os.fspath(path)
    with open_capped(name, kind, field) as fh:
        data = fh.read(cap.max_bytes + 1)
    if len(data) > cap.max_bytes:  # grew while being read
        raise _too_big(name, kind, cap, field)
    return data


def _decode(data: bytes, name: str, field: str, errors: str) -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise SpecError(field, f"cannot read {_clip(name)}: not UTF-8 text ({exc.reason} at byte {exc.start})",
                        "give a UTF-8 text file") from None


def read_text(path: str | os.PathLike[str], kind: str, field: str, errors: str = "strict") -> str:
    """The UTF-8 text of a regular file of at most the cap of ``kind`` (``errors="replace"`` for logs)."""
    return _decode(read_bytes(path, kind, field), os.fspath(path), field, errors)


def iter_lines(path: str | os.PathLike[str], kind: str, field: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a line file, streamed; the byte, line and line-length caps are checked
    as it goes, so a refusal comes before the whole file is held."""
    cap, name = limit(kind), os.fspath(path)
    with open_regular(name, field) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > cap.max_bytes:
            raise _too_big(name, kind, cap, field, size)
        total = 0
        for lineno in itertools.count(1):
            raw = fh.readline(cap.max_line_bytes + 1)
            if not raw:
                return
            total += len(raw)
            if total > cap.max_bytes:
                raise _too_big(name, kind, cap, field)
            if cap.max_lines is not None and lineno > cap.max_lines:
                raise SpecError(field, f"{_clip(name)} has more than {cap.max_lines:,} lines, the limit of {cap.what}",
                                f"give a shorter file, or raise the limit with {cap.lines_env}=LINES")
            if len(raw) > cap.max_line_bytes:
                raise SpecError(f"{name}:{lineno}", f"a line over {_size_text(cap.max_line_bytes)}",
                                "one JSON object per line, each of a reasonable size")
            yield lineno, _decode(raw, f"{name}:{lineno}", field, "strict").rstrip("\r\n")


# ---------------------------------------------------------------------------------------------
# YAML: duplicate keys refused, depth and alias expansion bounded while composing
# ---------------------------------------------------------------------------------------------


class _LimitError(yaml.YAMLError):
    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, nesting deeper than :data:`MAX_YAML_DEPTH` and documents
    of more than :data:`MAX_YAML_VALUES` values once every alias is expanded (counted on the composed
    nodes, so a billion-laughs document is refused before anything is built)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._values = 0
        self._sizes: dict[int, int] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:  # noqa: D102 - PyYAML hook
        if self.check_event(yaml.AliasEvent):  # type: ignore[no-untyped-call]
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            node = super().compose_node(parent, index)  # type: ignore[no-untyped-call]
            self._count(self._sizes.get(id(node), 1), mark)
            return node
        mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise _LimitError(f"nested deeper than {MAX_YAML_DEPTH} levels", mark)
        try:
            node = super().compose_node(parent, index)  # type: ignore[no-untyped-call]
        finally:
            self._depth -= 1
        if isinstance(node, yaml.MappingNode):
            size = 1 + sum(self._sizes.get(id(k), 1) + self._sizes.get(id(v), 1) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            size = 1 + sum(self._sizes.get(id(v), 1) for v in node.value)
        else:
            size = 1
            self._count(1, mark)
        self._sizes[id(node)] = size
        return node

    def _count(self, n: int, mark: Any) -> None:
        self._values += n
        if self._values > MAX_YAML_VALUES:
            raise _LimitError(f"more than {MAX_YAML_VALUES:,} values with its aliases expanded", mark)


def _construct_mapping(loader: BoundedLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        if isinstance(key, (str, int, float, bool)) and key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {shown(key)}", key_node.start_mark)
        seen.add(key) if isinstance(key, (str, int, float, bool)) else None
    return loader.construct_mapping(node, deep=deep)


BoundedLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)  # type: ignore[arg-type]


def load_yaml(text: str, field: str, source: str = "<string>") -> Any:
    """YAML text -> data; bad syntax, a duplicate key, too deep a nesting or too many values is a
    :class:`SpecError` with the line."""
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else source
        problem = str(getattr(exc, "problem", None) or exc)[:200]
        context, cmark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and cmark is not None and (mark is None or cmark.line != mark.line):
            problem += f" ({context} at line {cmark.line + 1})"  # e.g. where an unclosed [ was opened
        if isinstance(exc, _LimitError):
            fix = "flatten the document, or write the values out instead of repeating an anchor"
        elif "duplicate key" in problem:
            fix = "keep one of the two entries"
        else:
            fix = "fix the YAML syntax (indentation, colons, quotes, brackets) on that line"
        what = "YAML over a limit" if isinstance(exc, _LimitError) else "malformed YAML"
        raise SpecError(field, f"{what} at {where}: {problem}", fix) from None
    except RecursionError:  # PyYAML's constructor on a deep key; the depth bound makes this unreachable
        raise SpecError(field, f"malformed YAML in {source}: nested too deep", "flatten the document") from None


class _JsonLimit(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise _JsonLimit(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _JsonLimit(f"{text[:40]} is beyond a float's range")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 18:
        raise _JsonLimit(f"{text[:40]}{'...' if len(text) > 40 else ''} is beyond 1e18")
    return int(text)


def load_json(text: str, field: str, source: str = "<string>") -> Any:
    """JSON text -> data with finite numbers only: ``NaN``, ``Infinity``, ``1e999`` and integers beyond
    1e18 are a :class:`SpecError`, as are bad syntax and nesting deeper than Python's stack.

    Example:
        >>> load_json('{"a": 1.5}', "f")
        {'a': 1.5}
        >>> load_json('{"a": 1e999}', "f")
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: f: not valid JSON in <string>: 1e999 is beyond a float's range (fix: write finite numbers)
    """
    where = "" if source == field else f" in {_clip(source)}"
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except _JsonLimit as exc:
        raise SpecError(field, f"not valid JSON{where}: {exc}", "write finite numbers") from None
    except json.JSONDecodeError as exc:
        raise SpecError(field, f"not valid JSON{where}: {exc.msg} at line {exc.lineno}, "
                        f"column {exc.colno}", "fix the JSON syntax") from None
    except RecursionError:
        raise SpecError(field, f"not valid JSON{where}: nested too deep", "flatten the document") from None
    except ValueError as exc:  # e.g. an integer beyond Python's digit limit
        raise SpecError(field, f"not valid JSON{where}: {str(exc)[:100]}", "fix the value") from None


def read_yaml_file(path: str | os.PathLike[str], field: str) -> Any:
    """A YAML file read with the ``yaml`` cap and parsed with :func:`load_yaml`."""
    return load_yaml(read_text(path, "yaml", field), field, os.fspath(path))


def read_json_file(path: str | os.PathLike[str], field: str) -> Any:
    """A JSON file read with the ``json`` cap and parsed with :func:`load_json`."""
    return load_json(read_text(path, "json", field), field, os.fspath(path))

