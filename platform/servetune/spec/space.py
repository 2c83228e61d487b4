"""Search spaces: typed parameters over vLLM flags, Optuna define-by-run sampling, static rules.

A :class:`SearchSpace` is read from YAML (a file in ``search_spaces/`` or inline in a study spec)::

    params:                                   # order matters: a condition may only name earlier params
      gpu_memory_utilization: {type: float, low: 0.5, high: 0.95, step: 0.05}
      max_num_seqs: {type: int, low: 16, high: 512, log: true}
      max_num_batched_tokens: {type: categorical, choices: [2048, 4096, 8192]}
      enforce_eager: {type: bool}
      max_cudagraph_capture_size: {type: int, low: 64, high: 512, step: 64, when: {enforce_eager: false}}
      kv_cache_dtype: [auto, fp8]             # a bare list is a categorical
    rules:                                    # checked before a trial is launched
      - max_cudagraph_capture_size <= 2 * max_num_seqs
      - {rule: "max_num_batched_tokens <= 64 * max_num_seqs", message: "budget far above the batch"}

Parameter names are vLLM flag names from :data:`servetune.planner.flags.FLAGS`; every bound and choice is
validated with :func:`servetune.planner.flags.validate_flag`. A parameter with ``when`` exists in a trial
only while its condition holds (``when: {enforce_eager: false}``, a list of allowed values, or a
rule expression string). Each name always gets the same Optuna distribution, as Optuna requires.

Rules are expressions in a tiny language evaluated by walking the parsed AST: flag names, the
context names in :data:`CONTEXT_NAMES`, numbers, strings, ``true``/``false``, comparisons,
``+ - * / // %``, ``and``/``or``/``not`` and parentheses. Anything else (calls, attribute access,
indexing, ``**``, lambdas) is refused when the space is loaded; nothing is ever passed to ``eval``.
A spec may come from a shared repository or a nightly matrix, so a rule is untrusted input and the
language cannot allocate or loop beyond small bounds: arithmetic is on numbers only (a string is
only ever compared: ``'x' * 10**11`` and ``'%0999999999d' % max_num_seqs`` are refused when the
space is loaded, and a flag holding a string refuses arithmetic when the rule is judged); a
constant is at most ``1e12`` in size and 64 characters long; an expression has at most 500
characters, 100 nodes and 32 levels of nesting; and every value computed stays within ``1e18``
(beyond it the rule "cannot be evaluated", which is a violation, never a hang or a huge number).
A rule that names a flag the trial leaves unset (and that has no version-independent default) is
skipped rather than guessed. Built-in rules always apply (see :meth:`SearchSpace.check`).

Pure logic except :meth:`SearchSpace.load` (reads one file). Errors are :class:`SpecError`.

Example:
    >>> import optuna
    >>> space = SearchSpace.from_dict({"params": {
    ...     "gpu_memory_utilization": {"type": "float", "low": 0.5, "high": 0.9, "step": 0.1},
    ...     "enforce_eager": {"type": "bool"},
    ...     "max_cudagraph_capture_size": {"type": "categorical", "choices": [128, 256],
    ...                                    "when": {"enforce_eager": False}}}})
    >>> space.size()
    15
    >>> study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    >>> flags = space.suggest(study.ask())
    >>> ("max_cudagraph_capture_size" in flags) == (not flags["enforce_eager"])
    True
    >>> space.check({"max_num_seqs": 256, "max_num_batched_tokens": 128}, model=None, gpu_count=1)
    ['max_num_batched_tokens=128 is below max_num_seqs=256; vLLM refuses to start (max_num_batched_tokens must be >= max_num_seqs)']
"""

from __future__ import annotations

import ast
import dataclasses
import decimal
import functools
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servetune.errors import SpecError, did_you_mean
from servetune.inputs import load_yaml, missing, read_yaml_file, shown
from servetune.planner.flags import FLAGS, gpus_needed, validate_flag

if TYPE_CHECKING:  # imported for annotations only; optuna is imported lazily where it is used
    import optuna

    from servetune.planner.modelinfo import ModelProfile
    from servetune.workload import Workload

__all__ = ["Param", "Rule", "Expr", "SearchSpace", "Feasibility", "CONTEXT_NAMES", "STATIC_DEFAULTS", "PARAM_TYPES",
           "parse_yaml", "read_yaml"]

PARAM_TYPES = ("float", "int", "categorical", "bool")

#: vLLM defaults that hold on every version and GPU, used to evaluate conditions and rules when a
#: trial leaves the flag unset. Flags whose default depends on the GPU, model or vLLM version
#: (gpu_memory_utilization, max_num_seqs, max_num_batched_tokens) are deliberately absent.
STATIC_DEFAULTS: Mapping[str, Any] = {
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "enable_expert_parallel": False,
    "enforce_eager": False,
    "disable_custom_all_reduce": False,
    "kv_cache_dtype": "auto",
    "enable_chunked_prefill": True,
    "enable_prefix_caching": True,
    "long_prefill_token_threshold": 0,
    "scheduling_policy": "fcfs",
}

#: Names a rule may use besides flag names; :meth:`SearchSpace.check` fills them in.
CONTEXT_NAMES: Mapping[str, str] = {
    "gpu_count": "GPUs available to the study",
    "world_size": "the GPUs a trial takes: tensor_parallel_size * pipeline_parallel_size * data_parallel_size",
    "num_attention_heads": "the model's attention (query) heads",
    "num_kv_heads": "the model's KV heads",
    "num_layers": "the model's hidden layers",
    "max_position_embeddings": "the model's context length",
    "max_prompt_tokens": "the workload's longest prompt",
    "max_output_tokens": "the workload's longest output",
    "max_seq_tokens": "the workload's longest prompt + output",
}

_MAX_EXPR_CHARS = 500
_MAX_EXPR_NODES = 100  # "a <= 64 * b" is 10 nodes
_MAX_EXPR_DEPTH = 32
_MAX_CONST = 10**12  # the largest number a rule may write (|x|)
_MAX_STR_CONST = 64  # the longest string a rule may write
_MAX_VALUE = 10**18  # the largest magnitude a rule may compute
_MAX_GRID = 1_000_000
_MAX_RULES = 256  # rules of one space; each is judged on every proposed flag set
_MAX_RULE_WORK = 200_000  # (combinations listed) x (rules) that feasibility() judges before giving up listing
_PARAM_KEYS = ("type", "low", "high", "step", "log", "choices", "when")
_SPACE_KEYS = ("params", "rules", "description")

# ---------------------------------------------------------------------------------------------
# The rule language: parsed with ast, checked node by node, evaluated by our own interpreter.
# ---------------------------------------------------------------------------------------------

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_CMPOPS: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
}
_ALLOWED_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd,
                  ast.BinOp, ast.Compare, ast.Name, ast.Load, ast.Constant, *_BINOPS, *_CMPOPS)
# YAML users write true/false/null; Python users write True/False/None. Both are constants here.
_LITERALS: Mapping[str, Any] = {"true": True, "false": False, "True": True, "False": False,
                                "null": None, "None": None}
_REFUSED_WHY: Mapping[type, str] = {
    ast.Call: "function calls", ast.Attribute: "attribute access", ast.Subscript: "indexing",
    ast.Lambda: "lambdas", ast.Pow: "the ** operator", ast.IfExp: "conditional expressions",
    ast.NamedExpr: "assignment expressions", ast.ListComp: "comprehensions",
    ast.GeneratorExp: "comprehensions", ast.In: "the in operator", ast.NotIn: "the in operator",
    ast.Is: "the is operator", ast.IsNot: "the is operator", ast.List: "lists", ast.Tuple: "tuples",
    ast.Dict: "dicts", ast.Set: "sets", ast.JoinedStr: "f-strings", ast.Starred: "starred expressions",
    ast.BitAnd: "bitwise operators", ast.BitOr: "bitwise operators", ast.BitXor: "bitwise operators",
    ast.LShift: "bitwise operators", ast.RShift: "bitwise operators", ast.Invert: "bitwise operators",
    ast.MatMult: "the @ operator", ast.Await: "await",
}
_EXPR_FIX = "use flag names, numbers, comparisons, + - * / // %, and/or/not and parentheses"


class _EvalError(ArithmeticError):
    """A value the rule language does not compute (string arithmetic, a number out of bounds)."""


class _Unbound(Exception):
    """A name the environment does not define; the expression cannot be judged."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


@dataclasses.dataclass(frozen=True)
class Expr:
    """A parsed, vetted rule expression. Build with :meth:`parse`; evaluate with :meth:`evaluate`.

    Example:
        >>> Expr.parse("max_num_batched_tokens >= 2 * max_num_seqs", "rules[0]").evaluate(
        ...     {"max_num_batched_tokens": 1024, "max_num_seqs": 256})
        True
    """

    source: str
    names: frozenset[str]
    tree: ast.Expression = dataclasses.field(compare=False, repr=False)

    @classmethod
    def parse(cls, source: Any, field: str, known: Iterable[str] | None = None) -> Expr:
        """Parse and vet ``source``; names must be in ``known`` (default: flags and context names)."""
        if not isinstance(source, str) or not source.strip():
            raise SpecError(field, f"expected an expression string, got {shown(source)}",
                            "e.g. max_num_batched_tokens >= max_num_seqs")
        if len(source) > _MAX_EXPR_CHARS:
            raise SpecError(field, f"expression longer than {_MAX_EXPR_CHARS} characters", "split it into rules")
        try:
            tree = ast.parse(source.strip(), mode="eval")
        except SyntaxError as exc:
            raise SpecError(field, f"not a valid expression: {shown(source)} ({exc.msg})", _EXPR_FIX) from None
        except (ValueError, RecursionError, MemoryError) as exc:  # NUL bytes; nesting the parser refuses
            raise SpecError(field, f"not a valid expression: {shown(source)} ({type(exc).__name__})", _EXPR_FIX) from None
        _check_shape(tree, field, source)
        known_names = set(known) if known is not None else set(FLAGS) | set(CONTEXT_NAMES)
        names: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, _ALLOWED_NODES):
                why = _REFUSED_WHY.get(type(node), type(node).__name__)
                raise SpecError(field, f"{why} are not allowed in a rule: {shown(source)}", _EXPR_FIX)
            if isinstance(node, ast.Constant):
                _check_constant(node.value, field)
            if isinstance(node, ast.BinOp):
                for side in (node.left, node.right):
                    if isinstance(side, ast.Constant) and not _is_number(side.value):
                        raise SpecError(field, f"arithmetic on {shown(side.value)} in {shown(source)}: rules do arithmetic on "
                                        "numbers only (strings may only be compared)", _EXPR_FIX)
            if isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.Not) and \
                    isinstance(node.operand, ast.Constant) and not _is_number(node.operand.value):
                raise SpecError(field, f"sign on {shown(node.operand.value)} in {shown(source)}: only numbers take a sign",
                                _EXPR_FIX)
            if isinstance(node, ast.Name) and node.id not in _LITERALS:
                if node.id not in known_names:
                    raise SpecError(field, f"unknown name {shown(node.id)} in {shown(source)}{did_you_mean(node.id, known_names)}",
                                    "use vLLM flag names (servetune.planner.flags.FLAGS) or " + ", ".join(CONTEXT_NAMES))
                names.add(node.id)
        return cls(source.strip(), frozenset(names), tree)

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        """The expression's value; raises ``_Unbound`` when ``env`` lacks a name it uses."""
        return _eval(self.tree.body, env)


def _check_shape(tree: ast.AST, field: str, source: str) -> None:
    """At most _MAX_EXPR_NODES nodes and _MAX_EXPR_DEPTH levels (walked without recursion)."""
    count = 0
    stack: list[tuple[ast.AST, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > _MAX_EXPR_NODES:
            raise SpecError(field, f"expression has more than {_MAX_EXPR_NODES} parts", "split it into rules")
        if depth > _MAX_EXPR_DEPTH:
            raise SpecError(field, f"expression nested deeper than {_MAX_EXPR_DEPTH} levels", "split it into rules")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_constant(value: Any, field: str) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        if len(value) > _MAX_STR_CONST:
            raise SpecError(field, f"string constant longer than {_MAX_STR_CONST} characters", "compare with a flag value")
        return
    if isinstance(value, int) and abs(value) <= _MAX_CONST:
        return
    if isinstance(value, float) and math.isfinite(value) and abs(value) <= _MAX_CONST:
        return
    if _is_number(value):
        raise SpecError(field, f"constant beyond {_MAX_CONST:.0e} in size", "use a number of at most 1e12")
    raise SpecError(field, f"constant {shown(value)} is not allowed in a rule", _EXPR_FIX)


def _operand(value: Any) -> int | float:
    """An operand of arithmetic: a number within _MAX_VALUE, else _EvalError."""
    if not _is_number(value):
        raise _EvalError(f"arithmetic on {type(value).__name__} {_short(value)} (rules do arithmetic on numbers only)")
    return _bounded(value)


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise _EvalError(f"{value} is not a finite number")
    if abs(value) > _MAX_VALUE:
        raise _EvalError(f"a value beyond {_MAX_VALUE:.0e}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _eval(node: ast.AST, env: Mapping[str, Any]) -> Any:
    # Only the node types admitted by Expr.parse can reach here, at most _MAX_EXPR_DEPTH deep.
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in _LITERALS:
            return _LITERALS[node.id]
        if node.id not in env:
            raise _Unbound(node.id)
        return env[node.id]
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            return all(_eval(v, env) for v in node.values)
        return any(_eval(v, env) for v in node.values)
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, env)
        if isinstance(node.op, ast.Not):
            return not value
        value = _operand(value)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp):
        left, right = _operand(_eval(node.left, env)), _operand(_eval(node.right, env))
        return _bounded(_BINOPS[type(node.op)](left, right))
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = _eval(comparator, env)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    raise AssertionError(f"unvetted node {type(node).__name__}")  # pragma: no cover


@dataclasses.dataclass(frozen=True)
class Rule:
    """A static rule: a trial whose flags make ``expr`` false is not launched."""

    expr: Expr
    message: str | None = None

    def violation(self, env: Mapping[str, Any]) -> str | None:
        """A human-readable violation, or ``None`` when the rule holds or cannot be judged."""
        try:
            ok = self.expr.evaluate(env)
        except _Unbound:
            return None  # a flag the trial leaves to vLLM's default: nothing to judge
        except (TypeError, ArithmeticError, RecursionError) as exc:  # _EvalError and ZeroDivisionError included
            return f"rule {shown(self.expr.source)} cannot be evaluated: {exc}"
        if ok:
            return None
        values = ", ".join(f"{n}={shown(env[n])}" for n in sorted(self.expr.names) if n in env)
        text = f"rule {shown(self.expr.source)} is false ({values})"
        return f"{self.message}: {text}" if self.message else text

    def to_dict(self) -> str | dict[str, str]:
        return {"rule": self.expr.source, "message": self.message} if self.message else self.expr.source


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Param:
    """One searched flag. ``kind`` is float, int, categorical or bool."""

    name: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    step: float | int | None = None
    log: bool = False
    choices: tuple[Any, ...] | None = None
    when: Expr | None = None  # the condition under which the parameter exists
    when_source: Any = dataclasses.field(default=None, compare=False, repr=False)  # as written

    def distribution(self) -> optuna.distributions.BaseDistribution:
        """The one Optuna distribution this name always uses."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "float":
            return FloatDistribution(float(self.low), float(self.high), log=self.log,  # type: ignore[arg-type]
                                     step=None if self.step is None else float(self.step))
        if self.kind == "int":
            return IntDistribution(int(self.low), int(self.high), log=self.log, step=int(self.step or 1))  # type: ignore[arg-type]
        return CategoricalDistribution(list(self.values() or ()))

    def suggest(self, trial: optuna.Trial) -> Any:
        if self.kind == "float":
            value = trial.suggest_float(self.name, float(self.low), float(self.high),  # type: ignore[arg-type]
                                        step=None if self.step is None else float(self.step), log=self.log)
            # low + k*step in binary floating point gives 0.7000000000000001; vLLM logs and the
            # dataset should read 0.7.
            return round(value, 10) if self.step is not None else value
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high),  # type: ignore[arg-type]
                                     step=int(self.step or 1), log=self.log)
        return trial.suggest_categorical(self.name, list(self.values() or ()))

    def values(self) -> list[Any] | None:
        """Every value the parameter can take, or ``None`` for a continuous float range."""
        if self.kind == "bool":
            return [False, True]
        if self.kind == "categorical":
            return list(self.choices or ())
        if self.kind == "int":
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))  # type: ignore[arg-type]
        if self.step is None:
            return None
        low, step = decimal.Decimal(str(self.low)), decimal.Decimal(str(self.step))
        count = int((decimal.Decimal(str(self.high)) - low) / step) + 1
        return [float(low + k * step) for k in range(count)]

    @property
    def is_finite(self) -> bool:
        """Every kind but a float range without ``step`` has finitely many values."""
        return self.kind != "float" or self.step is not None

    def num_values(self) -> int | float:
        if self.kind == "int":
            return (int(self.high) - int(self.low)) // int(self.step or 1) + 1  # type: ignore[arg-type]
        values = self.values()
        return math.inf if values is None else len(values)

    def active(self, assigned: Mapping[str, Any], field: str = "search_space") -> bool:
        """Whether the parameter exists given the values assigned so far (plus static defaults)."""
        if self.when is None:
            return True
        env = {**STATIC_DEFAULTS, **assigned}
        try:
            return bool(self.when.evaluate(env))
        except _Unbound as exc:
            raise SpecError(f"{field}.params.{self.name}.when",
                            f"the condition names {shown(exc.name)}, which is neither searched before "
                            f"{shown(self.name)} nor pinned", f"pin {exc.name} in fixed_flags or search it above {self.name}") from None
        except (TypeError, ArithmeticError, RecursionError) as exc:  # string arithmetic, a bound, x % 0
            raise SpecError(f"{field}.params.{self.name}.when", f"the condition {shown(self.when.source)} cannot be "
                            f"evaluated: {exc}", "compare flags with values; do arithmetic on numbers only") from None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.kind}
        if self.kind in ("float", "int"):
            d.update(low=self.low, high=self.high)
            if self.step is not None:
                d["step"] = self.step
            if self.log:
                d["log"] = True
        if self.kind == "categorical":
            d["choices"] = list(self.choices or ())
        if self.when is not None:
            d["when"] = self.when_source
        return d


def _number(value: Any, field: str, integer: bool) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        raise SpecError(field, f"expected a {'whole number' if integer else 'number'}, got {shown(value)}", "write a plain number")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise SpecError(field, f"expected a whole number, got {shown(value)}", "write an integer")
        return int(value)
    return float(value)


def _condition(name: str, raw: Any, field: str) -> Expr:
    """``when:`` as a mapping ``{flag: value | [values]}`` or an expression string."""
    if isinstance(raw, str):
        expr = Expr.parse(raw, field, known=FLAGS)
    elif isinstance(raw, Mapping) and raw:
        terms = []
        for key, allowed in raw.items():
            key = str(key)
            if key not in FLAGS:
                raise SpecError(f"{field}.{key}", f"unknown vLLM flag{did_you_mean(key, FLAGS)}",
                                "conditions name vLLM flags, e.g. when: {enforce_eager: false}")
            options = allowed if isinstance(allowed, list) else [allowed]
            if not options:
                raise SpecError(f"{field}.{key}", "empty list of allowed values", "list at least one value")
            for option in options:
                validate_flag(key, option, f"{field}.{key}")
            terms.append("(" + " or ".join(f"{key} == {option!r}" for option in options) + ")")
        expr = Expr.parse(" and ".join(terms), field, known=FLAGS)
    else:
        raise SpecError(field, f"expected a mapping or an expression, got {shown(raw)}",
                        "e.g. when: {enforce_eager: false} or when: 'tensor_parallel_size > 1'")
    if name in expr.names:
        raise SpecError(field, f"{shown(name)} cannot depend on itself", "name other flags in the condition")
    return expr


def _parse_param(name: str, raw: Any, field: str) -> Param:
    if name not in FLAGS:
        raise SpecError(field, f"unknown vLLM flag {shown(name)}{did_you_mean(name, FLAGS)}",
                        "parameter names are vLLM flag names, see servetune.planner.flags.FLAGS")
    flag = FLAGS[name]
    if flag.kind is list:
        raise SpecError(field, f"{name} takes a list and cannot be searched",
                        "pin it in fixed_flags, or search max_cudagraph_capture_size instead")
    if isinstance(raw, list):  # shorthand: a bare list is a categorical
        raw = {"type": "categorical", "choices": raw}
    if not isinstance(raw, Mapping):
        raise SpecError(field, f"expected a parameter mapping or a list of choices, got {shown(raw)}",
                        f"e.g. {name}: {{type: categorical, choices: [...]}}; pin a single value in fixed_flags")
    for key in raw:
        if key not in _PARAM_KEYS:
            raise SpecError(f"{field}.{key}", f"unknown key{did_you_mean(str(key), _PARAM_KEYS)}",
                            f"allowed keys: {', '.join(_PARAM_KEYS)}")
    kind = raw.get("type", "categorical" if "choices" in raw else None)
    if kind is None:
        raise SpecError(f"{field}.type", "is required", f"add type: one of {', '.join(PARAM_TYPES)}")
    if kind not in PARAM_TYPES:
        raise SpecError(f"{field}.type", f"unknown parameter type {shown(kind)}{did_you_mean(str(kind), PARAM_TYPES)}",
                        f"use one of {', '.join(PARAM_TYPES)}")
    flag_type = flag.kind.__name__
    allowed_keys = {"float": {"low", "high", "step", "log"}, "int": {"low", "high", "step", "log"},
                    "categorical": {"choices"}, "bool": set()}[kind] | {"type", "when"}
    for key in raw:
        if key not in allowed_keys:
            raise SpecError(f"{field}.{key}", f"does not apply to type {kind}",
                            f"type {kind} takes: {', '.join(sorted(allowed_keys))}")
    when = _condition(name, raw["when"], f"{field}.when") if "when" in raw else None
    when_source = raw.get("when")
    if kind == "bool":
        if flag.kind is not bool:
            raise SpecError(f"{field}.type", f"{name} is a {flag_type} flag, not a boolean",
                            f"use type: {'int' if flag.kind is int else 'float' if flag.kind is float else 'categorical'}")
        return Param(name, "bool", when=when, when_source=when_source)
    if kind == "categorical":
        choices = raw.get("choices")
        if not isinstance(choices, list) or not choices:
            raise SpecError(f"{field}.choices", f"expected a non-empty list, got {shown(choices)}", "e.g. choices: [64, 128, 256]")
        values = [validate_flag(name, c, f"{field}.choices[{i}]") for i, c in enumerate(choices)]
        if len(set(map(repr, values))) != len(values):
            raise SpecError(f"{field}.choices", f"has duplicates: {shown(choices)}", "list each value once")
        return Param(name, "categorical", choices=tuple(values), when=when, when_source=when_source)
    # float / int ranges
    if flag.kind not in (int, float) or kind != flag.kind.__name__:
        better = {int: "int", float: "float", bool: "bool"}.get(flag.kind, "categorical")
        raise SpecError(f"{field}.type", f"{name} is a {flag_type} flag and cannot be a {kind} range",
                        f"use type: {better}")
    integer = kind == "int"
    for key in ("low", "high"):
        if key not in raw:
            raise SpecError(f"{field}.{key}", "is required", f"add {key}: <number> for a {kind} range")
    low = validate_flag(name, _number(raw["low"], f"{field}.low", integer), f"{field}.low")
    high = validate_flag(name, _number(raw["high"], f"{field}.high", integer), f"{field}.high")
    if not low < high:
        raise SpecError(field, f"needs low < high, got low={low} high={high}",
                        "swap the bounds, or pin a single value in fixed_flags")
    log = raw.get("log", False)
    if not isinstance(log, bool):
        raise SpecError(f"{field}.log", f"expected true or false, got {shown(log)}", "write log: true")
    step = raw.get("step")
    if step is not None:
        step = _number(step, f"{field}.step", integer)
        if step <= 0:
            raise SpecError(f"{field}.step", f"must be > 0, got {step}", "use a positive step")
        if log and not (integer and step == 1):
            raise SpecError(field, "step and log: true cannot be combined (Optuna samples a log range continuously)",
                            "drop step, or drop log")
        span = decimal.Decimal(str(high)) - decimal.Decimal(str(low))
        if span % decimal.Decimal(str(step)) != 0:
            last = decimal.Decimal(str(low)) + (span // decimal.Decimal(str(step))) * decimal.Decimal(str(step))
            raise SpecError(f"{field}.step", f"high - low = {span} is not a multiple of step {step}",
                            f"set high to {last} or change step")
    if log and low <= 0:
        raise SpecError(f"{field}.low", f"a log range needs low > 0, got {low}", "raise low or drop log")
    if integer and step is None:
        step = 1
    return Param(name, kind, low=low, high=high, step=step, log=log, when=when, when_source=when_source)


# ---------------------------------------------------------------------------------------------
# Built-in rules: vLLM's own refusals, stated as it states them
# ---------------------------------------------------------------------------------------------


def _builtin_violations(env: Mapping[str, Any], model: ModelProfile | None, gpu_count: int | None,
                        workload: Workload | None) -> list[str]:
    out: list[str] = []
    tp, pp, dp = int(env["tensor_parallel_size"]), int(env["pipeline_parallel_size"]), int(env["data_parallel_size"])
    if model is not None:
        heads, kv = int(model.num_attention_heads), int(model.num_kv_heads)
        if heads % tp:
            out.append(f"tensor_parallel_size={tp} does not divide the model's {heads} attention heads "
                       f"(vLLM: Total number of attention heads ({heads}) must be divisible by tensor parallel size ({tp}).)")
        if kv >= tp and kv % tp:
            out.append(f"tensor_parallel_size={tp} cannot split the model's {kv} KV heads evenly ({kv} is not divisible by {tp})")
        elif kv < tp and tp % kv:
            out.append(f"tensor_parallel_size={tp} cannot replicate the model's {kv} KV heads evenly ({tp} is not divisible by {kv})")
        if pp > int(model.num_layers):
            out.append(f"pipeline_parallel_size={pp} exceeds the model's {model.num_layers} layers")
        if env.get("enable_expert_parallel") is True and not model.is_moe:
            # ModelConfig._verify_with_expert_parallelism (config/model.py:1177-1182@0.26.0)
            out.append("enable_expert_parallel=True on a model without routed experts (vLLM: Number of experts in "
                       "the model must be greater than 0 when expert parallelism is enabled.)")
    if gpu_count is not None and tp * pp * dp > gpu_count:
        out.append(f"tensor_parallel_size * pipeline_parallel_size = {tp}*{pp} = {tp * pp} GPUs, "
                   f"but the study has gpu.count={gpu_count}" if dp == 1 else
                   f"tensor_parallel_size * pipeline_parallel_size * data_parallel_size = {tp}*{pp}*{dp} = "
                   f"{tp * pp * dp} GPUs, but the study has gpu.count={gpu_count}")
    mns, mbt = env.get("max_num_seqs"), env.get("max_num_batched_tokens")
    if mns is not None and mbt is not None and mbt < mns:
        out.append(f"max_num_batched_tokens={mbt} is below max_num_seqs={mns}; vLLM refuses to start "
                   "(max_num_batched_tokens must be >= max_num_seqs)")
    mml = env.get("max_model_len")
    if mml is not None:
        if model is not None and mml > _model_max_len(model):
            out.append(f"max_model_len={mml} is above the model's context of {_model_max_len(model)} tokens "
                       "(max_position_embeddings); vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
        if workload is not None:
            longest = _longest_sequence(workload)
            if mml < longest:
                out.append(f"max_model_len={mml} is below the workload's longest request ({longest} tokens, "
                           "prompt + output); vLLM would reject those requests")
        if env.get("enable_chunked_prefill") is False and mbt is not None and mbt < mml:
            out.append(f"max_num_batched_tokens={mbt} is below max_model_len={mml} with chunked prefill off; "
                       "vLLM refuses to start")
    return out


def _model_max_len(model: ModelProfile) -> int:
    """The longest max_model_len vLLM derives for the model (rope scaling applied where it stretches)."""
    return int(getattr(model, "max_model_len_limit", 0) or model.max_position_embeddings)


@functools.lru_cache(maxsize=64)
def _workload_extremes(workload: Workload) -> tuple[int, int, int]:
    reqs = workload.requests()
    return (max((r.prompt_tokens for r in reqs), default=workload.input_len.upper),
            max((r.output_tokens for r in reqs), default=workload.output_len.upper),
            max((r.prompt_tokens + r.output_tokens for r in reqs),
                default=workload.input_len.upper + workload.output_len.upper))


def _longest_sequence(workload: Workload) -> int:
    return _workload_extremes(workload)[2]


_BUILTIN_RULE_NAMES = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "max_num_seqs",
                       "max_num_batched_tokens", "max_model_len", "enable_chunked_prefill", "enable_expert_parallel")
#: The flags that set a trial's GPUs (:func:`~servetune.planner.flags.gpus_needed`), listed even where the space is too
#: large to list whole.
_LAYOUT_FLAGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


@dataclasses.dataclass(frozen=True)
class Feasibility:
    """What :meth:`SearchSpace.feasibility` found.

    ``never_ok`` maps a listed parameter to the values that fail in every combination;
    ``reasons`` maps the flag (or rule) that failed first to the violation texts, one per refused
    combination.
    """

    exhaustive: bool
    checked: int
    feasible: int
    min_world_size: int | None
    never_ok: Mapping[str, list[Any]]
    reasons: Mapping[str, list[str]]


# ---------------------------------------------------------------------------------------------
# The space
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """Ordered parameters (define-by-run order) and static rules. Build with :meth:`from_dict`."""

    params: tuple[Param, ...]
    rules: tuple[Rule, ...] = ()
    description: str | None = None
    #: Flags the study pins (its ``fixed_flags``). Conditions read them; they are never returned
    #: by :meth:`suggest`. :class:`servetune.spec.schema.StudySpec` fills this in.
    pinned: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def with_pinned(self, pinned: Mapping[str, Any]) -> SearchSpace:
        """A copy whose conditions see ``pinned`` (the study's fixed flags)."""
        return dataclasses.replace(self, pinned=dict(pinned))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def __getitem__(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, field: str = "search_space") -> SearchSpace:
        """Parse ``{params: {...}, rules: [...], description: ...}``; :class:`SpecError` on bad input.

        Example:
            >>> SearchSpace.from_dict({"params": {"max_num_seqs": [64, 128]}}).names
            ('max_num_seqs',)
        """
        if not isinstance(data, Mapping):
            raise SpecError(field, f"expected a mapping with params (and optional rules), got {type(data).__name__}",
                            "e.g. {params: {max_num_seqs: {type: int, low: 16, high: 512, log: true}}}")
        for key in data:
            if key not in _SPACE_KEYS:
                hint = did_you_mean(str(key), _SPACE_KEYS)
                fix = (f"put parameters under params: (params: {{{key}: ...}})" if str(key) in FLAGS
                       else f"allowed keys: {', '.join(_SPACE_KEYS)}")
                raise SpecError(f"{field}.{key}", f"unknown key{hint}", fix)
        raw_params = data.get("params")
        if not isinstance(raw_params, Mapping) or not raw_params:
            raise SpecError(f"{field}.params", "expected a non-empty mapping of vLLM flags to parameters",
                            "e.g. params: {max_num_seqs: {type: int, low: 16, high: 512, log: true}}")
        params: list[Param] = []
        for name, raw in raw_params.items():
            name = str(name)
            pfield = f"{field}.params.{name}"
            param = _parse_param(name, raw, pfield)
            if param.when is not None:
                later = sorted(n for n in param.when.names if n in raw_params and n not in [p.name for p in params])
                if later:
                    raise SpecError(f"{pfield}.when", f"the condition names {shown(later[0])}, which is searched after {shown(name)}",
                                    f"move {later[0]} above {name} in params (conditions only see earlier params)")
            params.append(param)
        raw_rules = data.get("rules", [])
        if raw_rules is None:
            raw_rules = []
        if not isinstance(raw_rules, list):
            raise SpecError(f"{field}.rules", f"expected a list of expressions, got {type(raw_rules).__name__}",
                            "e.g. rules: [max_num_batched_tokens >= max_num_seqs]")
        if len(raw_rules) > _MAX_RULES:
            raise SpecError(f"{field}.rules", f"{len(raw_rules):,} rules, above the limit of {_MAX_RULES}",
                            "merge rules with `and`, or drop the ones the search space cannot break")
        rules = []
        for i, raw in enumerate(raw_rules):
            rfield = f"{field}.rules[{i}]"
            message = None
            if isinstance(raw, Mapping):
                extra = set(raw) - {"rule", "message"}
                if extra or "rule" not in raw:
                    raise SpecError(rfield, f"expected {{rule: <expression>, message: <text>}}, got keys {sorted(map(str, raw))}",
                                    "write the rule as a string, or as {rule: ..., message: ...}")
                message = raw.get("message")
                if message is not None and not isinstance(message, str):
                    raise SpecError(f"{rfield}.message", f"expected text, got {shown(message)}", "quote the message")
                raw = raw["rule"]
            rules.append(Rule(Expr.parse(raw, rfield), message))
        description = data.get("description")
        if description is not None and not isinstance(description, str):
            raise SpecError(f"{field}.description", f"expected text, got {shown(description)}", "quote it")
        return cls(tuple(params), tuple(rules), description)

    @classmethod
    def load(cls, path: str | Path, field: str = "search_space") -> SearchSpace:
        """Read a search-space YAML file.

        Example:
            >>> SearchSpace.load("search_spaces/memory-pair.yaml").names  # doctest: +SKIP
            ('gpu_memory_utilization', 'max_num_seqs')
        """
        path = Path(path)
        data = read_yaml(path, field)
        try:
            return cls.from_dict(data, field)
        except SpecError as exc:
            raise SpecError(exc.field, f"{exc.message} [in {path}]", exc.fix) from None

    # -- sampling ------------------------------------------------------------------------------

    def suggest(self, trial: optuna.Trial, fixed: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Sample the flags of one trial, define-by-run; conditional params appear only when active.

        Conditions read :attr:`pinned` and ``fixed`` (neither is returned).
        """
        assigned: dict[str, Any] = {**self.pinned, **(fixed or {})}
        out: dict[str, Any] = {}
        for param in self.params:
            if not param.active(assigned):
                continue
            value = param.suggest(trial)
            out[param.name] = assigned[param.name] = value
        return out

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        """Name -> Optuna distribution, e.g. for ``optuna.trial.create_trial`` when warm-starting."""
        return {p.name: p.distribution() for p in self.params}

    # -- rules --------------------------------------------------------------------------------

    def check(self, flags: Mapping[str, Any], model: ModelProfile | None = None, gpu_count: int | None = None,
              workload: Workload | None = None) -> list[str]:
        """Rule violations of one full flag set (searched + pinned), empty when it may be launched.

        Built-in rules (vLLM's own refusals): TP divides the attention heads; the KV heads split or
        replicate evenly under TP; PP <= layers; TP*PP <= ``gpu_count``; max_num_batched_tokens >=
        max_num_seqs; max_model_len covers the workload's longest request and stays within the
        model's context; with chunked prefill off, max_num_batched_tokens >= max_model_len. Then the
        space's own rules. ``model`` and ``workload`` may be ``None`` (their rules are skipped).
        """
        return self._violations(self.rule_env(flags, model, gpu_count, workload), model, gpu_count, workload)

    def _violations(self, env: Mapping[str, Any], model: ModelProfile | None, gpu_count: int | None,
                    workload: Workload | None) -> list[str]:
        out = _builtin_violations(env, model, gpu_count, workload)
        for rule in self.rules:
            text = rule.violation(env)
            if text is not None:
                out.append(text)
        return out

    def _first_violation(self, env: Mapping[str, Any], model: ModelProfile | None, gpu_count: int | None,
                         workload: Workload | None) -> tuple[str, str | None]:
        """(subject, text) of the first violation: the flag a built-in rule is about, or ``rules[i]``."""
        builtin = _builtin_violations(env, model, gpu_count, workload)
        if builtin:
            match = re.match(r"[a-z_]+", builtin[0])
            return (match.group(0) if match else "", builtin[0])
        for i, rule in enumerate(self.rules):
            text = rule.violation(env)
            if text is not None:
                return (f"rules[{i}]", text)
        return ("", None)

    def feasibility(self, model: ModelProfile | None = None, gpu_count: int | None = None,
                    workload: Workload | None = None, limit: int = 20_000) -> Feasibility:
        """Which parts of the space can start at all, found by listing the rule-relevant params.

        Only the parameters that a rule or a condition reads are listed (gpu_memory_utilization,
        say, never changes whether a flag set passes the rules). When they have more than ``limit``
        combinations (or more than ``_MAX_RULE_WORK`` rule judgements: combinations x rules), or one of
        them is a continuous float, only TP, PP and DP are listed and the answer is marked ``exhaustive=False``.
        """
        relevant = set(_BUILTIN_RULE_NAMES).union(*(r.expr.names for r in self.rules),
                                                 *(p.when.names for p in self.params if p.when is not None))
        subset = [p for p in self.params if p.name in relevant]
        judged = len(self.rules) + 1  # judgements per listed combination: the space's rules and the built-in check
        exhaustive = all(p.is_finite for p in subset) and \
            SearchSpace(tuple(subset), pinned=self.pinned).size() <= min(limit, _MAX_RULE_WORK // max(judged, 1))
        if not exhaustive:
            subset = [p for p in self.params if p.name in _LAYOUT_FLAGS]
        listed = {p.name for p in subset}
        skipped = set(self.names) - listed  # searched but not listed: their defaults must not be judged
        rows: list[dict[str, Any]] = [{}]
        for p in subset:
            nxt: list[dict[str, Any]] = []
            for row in rows:
                try:
                    active = p.active({**self.pinned, **row})
                except SpecError:  # the condition reads an unlisted param: keep both possibilities
                    nxt.append(row)
                    active = True
                if active:
                    nxt.extend({**row, p.name: v} for v in p.values() or ())
                else:
                    nxt.append(row)
            rows = nxt
        feasible = 0
        min_world: int | None = None
        ok_values: dict[str, set[str]] = {p.name: set() for p in subset}
        reasons: dict[str, list[str]] = {}
        for row in rows:
            env = self.rule_env({**self.pinned, **row}, model, gpu_count, workload)
            for name in skipped:
                env.pop(name, None)
            subject, problem = self._first_violation(env, model, gpu_count, workload)
            if problem is not None:
                reasons.setdefault(subject, []).append(problem)
                continue
            feasible += 1
            world = int(env["world_size"])
            min_world = world if min_world is None else min(min_world, world)
            for name, value in row.items():
                ok_values[name].add(repr(value))
        never = {p.name: [v for v in p.values() or () if repr(v) not in ok_values[p.name]] for p in subset}
        return Feasibility(exhaustive=exhaustive, checked=len(rows), feasible=feasible, min_world_size=min_world,
                           never_ok={k: v for k, v in never.items() if v}, reasons=reasons)

    @staticmethod
    def rule_env(flags: Mapping[str, Any], model: ModelProfile | None = None, gpu_count: int | None = None,
                 workload: Workload | None = None) -> dict[str, Any]:
        """The names a rule sees: static defaults, the flags, and the context names that are known."""
        env: dict[str, Any] = {**STATIC_DEFAULTS, **{k: v for k, v in flags.items() if v is not None}}
        env["world_size"] = gpus_needed(env)
        if gpu_count is not None:
            env["gpu_count"] = gpu_count
        if model is not None:
            env.update(num_attention_heads=model.num_attention_heads, num_kv_heads=model.num_kv_heads,
                       num_layers=model.num_layers, max_position_embeddings=model.max_position_embeddings)
            # vLLM derives max_model_len from the model's config when it is not given.
            env.setdefault("max_model_len", _model_max_len(model))
        if workload is not None:
            env["max_prompt_tokens"], env["max_output_tokens"], env["max_seq_tokens"] = _workload_extremes(workload)
        return env

    # -- enumeration ---------------------------------------------------------------------------

    def is_finite(self) -> bool:
        return all(p.is_finite for p in self.params)

    def size(self, fixed: Mapping[str, Any] | None = None) -> int | float:
        """Number of distinct flag sets (conditional params counted only where active); ``math.inf``
        when a float parameter has no step. Computed without listing the grid."""
        if not self.is_finite():
            return math.inf
        relevant = set().union(*(p.when.names for p in self.params if p.when is not None)) if self.params else set()
        # state: values of the params that conditions read -> number of flag sets sharing them
        states: dict[tuple[tuple[str, Any], ...], int] = {(): 1}
        base = {**self.pinned, **(fixed or {})}
        for p in self.params:
            nxt: dict[tuple[tuple[str, Any], ...], int] = {}
            for state, count in states.items():
                if not p.active({**base, **dict(state)}):
                    nxt[state] = nxt.get(state, 0) + count
                elif p.name in relevant:
                    for v in p.values() or ():
                        key = (*state, (p.name, v))
                        nxt[key] = nxt.get(key, 0) + count
                else:
                    nxt[state] = nxt.get(state, 0) + count * int(p.num_values())
            states = nxt
        return sum(states.values())

    def grid(self, fixed: Mapping[str, Any] | None = None, limit: int = _MAX_GRID) -> list[dict[str, Any]]:
        """Every flag set of a finite space, in parameter order; conditional params only where active.

        Raises :class:`SpecError` when a float parameter has no ``step`` or the grid exceeds ``limit``.
        """
        for p in self.params:
            if not p.is_finite:
                raise SpecError(f"search_space.params.{p.name}", "a float range without step has no finite grid",
                                "add step: (e.g. step: 0.05), or use a sampler other than grid")
        size = self.size(fixed)
        if size > limit:
            raise SpecError("search_space", f"the grid has {size} points, above the limit of {limit}",
                            "coarsen steps or drop choices")
        rows: list[dict[str, Any]] = [{}]
        base = {**self.pinned, **(fixed or {})}
        for p in self.params:
            nxt: list[dict[str, Any]] = []
            for row in rows:
                if p.active({**base, **row}):
                    nxt.extend({**row, p.name: v} for v in p.values() or ())
                else:
                    nxt.append(row)
            rows = nxt
        return rows

    def grid_values(self) -> dict[str, list[Any]]:
        """Name -> values, the ``search_space`` argument of ``optuna.samplers.GridSampler``."""
        out = {}
        for p in self.params:
            values = p.values()
            if values is None:
                raise SpecError(f"search_space.params.{p.name}", "a float range without step has no finite grid",
                                "add step:, or use a sampler other than grid")
            out[p.name] = values
        return out

    def to_dict(self) -> dict[str, Any]:
        """The space as YAML-able data (round-trips through :meth:`from_dict`)."""
        d: dict[str, Any] = {"params": {p.name: p.to_dict() for p in self.params}}
        if self.rules:
            d["rules"] = [r.to_dict() for r in self.rules]
        if self.description:
            d["description"] = self.description
        return d


# ---------------------------------------------------------------------------------------------
# YAML reading with line numbers (shared with servetune.spec.schema)
# ---------------------------------------------------------------------------------------------


def parse_yaml(text: str, field: str, source: str = "<string>") -> Any:
    """YAML text -> data; a syntax error, a duplicate key, too deep a nesting or an alias bomb is a
    :class:`SpecError` with the line (:func:`servetune.inputs.load_yaml`)."""
    return load_yaml(text, field, source)


def read_yaml(path: Path, field: str) -> Any:
    """Read a YAML file (a regular file within the YAML size cap, :mod:`servetune.inputs`); a missing file or
    bad YAML is a :class:`SpecError` naming ``field``."""
    if missing(path):
        raise SpecError(field, f"file not found: {path}", "check the path (relative paths resolve from the spec file)")
    return read_yaml_file(path, field)
