"""The vLLM serve flags servetune knows: one registry, vLLM's own names, validation, rendering.

Every flag a study may set is a :class:`FlagSpec` in :data:`FLAGS`, named exactly as vLLM names
the engine argument (``gpu_memory_utilization``, not an alias). :func:`validate_flags` checks a
flag set before any trial starts (types, ranges, choices; values such as ``"0.9; rm -rf /"`` are
refused), and :func:`to_cli_args` / :func:`to_config_yaml` render it for ``vllm serve`` as an argv
list (never a shell string) or as a ``vllm serve --config`` file. :func:`argv_value` is the one rule
for a free-text value that becomes an argv element of a command servetune starts (the model of
``vllm serve``, of its simulator stand-in and of ``vllm bench serve``): no text from a spec is ever
read as an option by the command that receives it.

Example:
    >>> to_cli_args({"gpu_memory_utilization": 0.9, "enforce_eager": True, "enable_prefix_caching": False})
    ['--gpu-memory-utilization', '0.9', '--enforce-eager', '--no-enable-prefix-caching']
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from collections.abc import Mapping
from typing import Any

import yaml

from servetune.errors import SpecError, did_you_mean
from servetune.inputs import load_json, load_yaml, shown

__all__ = ["FlagSpec", "FLAGS", "NOT_MODELLED", "validate_flags", "validate_flag", "gpus_needed", "to_cli_args", "to_config_yaml",
           "to_command_line", "serving_flags", "measure_only_notes", "parse_set_option", "flags_key", "argv_value", "MAX_ARGV_VALUE"]


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One engine flag: its type, bounds or choices, and what it means."""

    name: str
    kind: type  # float, int, bool, str or list
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    min_exclusive: bool = False

    @property
    def cli(self) -> str:
        return "--" + self.name.replace("_", "-")


_F = FlagSpec
#: The flags servetune can tune or pin. Defaults are vLLM's and depend on version and GPU; see
#: :mod:`servetune.planner.memory` (``resolve_engine_config``) for how an unset flag is resolved.
FLAGS: dict[str, FlagSpec] = {f.name: f for f in (
    _F("gpu_memory_utilization", float, "fraction of total GPU memory vLLM may use", 0.0, 1.0, min_exclusive=True),
    _F("kv_cache_memory_bytes", int, "KV cache bytes per GPU; ignores gpu_memory_utilization", 1),
    _F("num_gpu_blocks_override", int, "fixed number of KV blocks (testing preemption)", 1),
    _F("max_num_seqs", int, "most sequences in one engine step", 1, 65536),
    _F("max_num_batched_tokens", int, "token budget of one engine step", 1, 1 << 22),
    _F("max_model_len", int, "longest sequence (prompt + output) in tokens", 16, 1 << 22),
    _F("tensor_parallel_size", int, "GPUs per tensor-parallel group", 1, 64),
    _F("pipeline_parallel_size", int, "pipeline stages", 1, 64),
    _F("data_parallel_size", int, "replicas of the TP x PP engine behind one API server (a MoE model's experts split "
       "over TP x DP GPUs)", 1, 64),
    _F("api_server_count", int, "API server processes in front of the engine(s) (vLLM's default: one through 0.14.1, "
       "one per DP replica from 0.15.0); several share a front end that one core cannot keep up with", 1, 64),
    _F("enable_expert_parallel", bool, "a MoE model's routed experts split whole over the TP x DP ranks (expert "
       "parallelism) instead of each expert sliced over them"),
    _F("disable_custom_all_reduce", bool, "TP all-reduces through NCCL only, without vLLM's custom all-reduce kernel"),
    _F("enforce_eager", bool, "no torch.compile and no CUDA graphs"),
    _F("max_cudagraph_capture_size", int, "largest batch captured as a CUDA graph", 1, 8192),
    _F("cudagraph_capture_sizes", list, "explicit CUDA graph capture sizes"),
    _F("kv_cache_dtype", str, "KV cache element type", choices=("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")),
    _F("enable_prefix_caching", bool, "reuse KV blocks of shared prompt prefixes"),
    _F("enable_chunked_prefill", bool, "split long prefills across steps"),
    _F("mamba_cache_mode", str, "a Mamba hybrid's state caching under prefix caching (vLLM 0.15+)",
       choices=("none", "align", "all")),
    _F("block_size", int, "tokens per KV block", choices=None, minimum=1, maximum=256),
    _F("long_prefill_token_threshold", int, "cap on one request's prefill tokens per step", 0),
    _F("scheduling_policy", str, "queue order", choices=("fcfs", "priority")),
    _F("async_scheduling", bool, "schedule one step ahead"),
    _F("enable_logging_iteration_details", bool, "log every engine step's batch (observability only: no memory or speed model)"),
    _F("load_format", str, "how vLLM loads the weights; dummy: random weights built from config.json on the GPU, "
       "nothing read from disk (the same memory and speed as the checkpoint: capacity and speed tests before "
       "the checkpoint is downloaded; the text is meaningless, so the workload ignores EOS)",
       choices=("auto", "safetensors", "pt", "dummy")),
    _F("dtype", str, "model dtype", choices=("auto", "bfloat16", "float16", "half", "float32")),
    _F("quantization", str, "weight quantization method", choices=("fp8", "awq", "gptq", "compressed-tensors", "bitsandbytes", "mxfp4", "nvfp4")),
    _F("language_model_only", bool, "a multimodal checkpoint's language model alone: its vision tower neither loaded "
       "nor profiled, text requests only (vLLM 0.17+)"),
)}

_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
#: The longest model id or path :func:`argv_value` accepts (PATH_MAX on Linux).
MAX_ARGV_VALUE = 4096


def argv_value(value: Any, field: str, what: str = "a model id or path") -> str:
    """``value`` when it may be one argv element of a command servetune starts; else SpecError naming ``field``.

    The rule, the same wherever text becomes argv: a non-empty string of at most
    :data:`MAX_ARGV_VALUE` characters, no control character (a newline or NUL would forge log lines or
    cut the argument), and no leading ``-``: the receiving command (``vllm serve``, its stand-in,
    ``vllm bench serve``) would read it as an option, e.g. ``--tool-parser-plugin=plugin.py``, which
    makes vLLM import that file. A path that starts with ``-`` is written ``./-name``.

    Example:
        >>> argv_value("org/name", "serve_model"), argv_value("./-odd", "serve_model")
        ('org/name', './-odd')
        >>> argv_value("--tool-parser-plugin=plugin.py", "serve_model")
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: serve_model: '--tool-parser-plugin=plugin.py' starts with '-', so the command it is given to would read it as an option (fix: give a model id such as org/name or a path; write a path that starts with '-' as ./-name)
    """
    if not isinstance(value, str) or not value:
        raise SpecError(field, f"expected {what} as non-empty text, got {_shown(value)}",
                        "give a model id such as org/name, or a path")
    if len(value) > MAX_ARGV_VALUE:
        raise SpecError(field, f"{len(value):,} characters, more than the {MAX_ARGV_VALUE:,} {what} may have",
                        "give a shorter model id or path")
    bad = next((c for c in value if ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029"), None)
    if bad is not None:
        raise SpecError(field, f"{_shown(value)} holds the control character {bad!r}",
                        f"give {what} on one line, without control characters")
    if value.startswith("-"):
        raise SpecError(field, f"{_shown(value)} starts with '-', so the command it is given to would read it as "
                        "an option", "give a model id such as org/name or a path; write a path that starts with "
                        "'-' as ./-name")
    return value


def _shown(value: Any, limit: int = 100) -> str:
    """``repr(value)`` cut to about ``limit`` characters: an error line never echoes a whole input."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"


def _as_typed(field: str, name: str, text: str) -> str:
    """``text`` as the user writes a flag's value where ``field`` was given: ``--set name=text`` on
    the command line, ``--flag-name text`` to the `vllm serve` stand-in, ``name: text`` in YAML, the
    bare value in a list of choices or a range bound."""
    if field.startswith("--set "):
        return f"--set {name}={text}"
    if field.startswith("--"):
        return f"{field} {text}"
    if field.endswith(("]", ".low", ".high")):
        return text
    return f"{name}: {text}"


#: vLLM flags servetune knows but does not model yet: each is refused in one line that says so (not
#: as an unknown flag), with what to plan instead.
NOT_MODELLED: dict[str, str] = {
    "mamba_block_size": "a user Mamba block size (prefix caching's block for Mamba layers) is not modelled by the "
                        "planner: plan the model's own (the Mamba2 chunk in 'all' mode, the attention block in "
                        "'align')",
    "speculative_config": "speculative decoding is not modelled by the planner or the simulator: plan the model "
                          "without a draft",
}


def validate_flag(name: str, value: Any, field: str | None = None) -> Any:
    """Check one flag value and return it normalised; raise :class:`SpecError` naming ``field``.

    Example:
        >>> validate_flag("enable_expert_parallel", True)
        True
        >>> validate_flag("speculative_config", "ngram")
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: speculative_config: speculative decoding is not modelled by the planner or the simulator: plan the model without a draft (fix: leave speculative_config out)
    """
    field = field or name
    spec = FLAGS.get(name)
    if spec is None and name in NOT_MODELLED:
        raise SpecError(field, NOT_MODELLED[name], f"leave {name} out")
    if spec is None:
        raise SpecError(field, f"unknown vLLM flag {shown(name)}{did_you_mean(name, FLAGS)}",
                        f"use one of: {', '.join(sorted(FLAGS))}")
    if spec.kind is bool:
        if not isinstance(value, bool):
            raise SpecError(field, f"expected true or false, got {shown(value)}",
                            f"write {_as_typed(field, name, 'true')} or {_as_typed(field, name, 'false')}")
        return value
    if spec.kind is list:
        if not isinstance(value, list) or not value or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):
            raise SpecError(field, f"expected a non-empty list of positive integers, got {shown(value)}", "e.g. [1, 2, 4, 8, 16]")
        return sorted(set(value))
    if spec.kind is str:
        if not isinstance(value, str) or (spec.choices is not None and value not in spec.choices):
            choices = ", ".join(spec.choices or ())
            raise SpecError(field, f"invalid value {shown(value)}{did_you_mean(str(value), spec.choices or ())}",
                            f"use one of: {choices}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(field, f"expected a {'finite ' if isinstance(value, float) else ''}number, got {shown(value)}",
                        f"write a plain {spec.kind.__name__}")
    if spec.kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise SpecError(field, f"expected an integer, got {shown(value)}", "write a whole number")
        value = int(value)
    else:
        value = float(value)
    lo, hi = spec.minimum, spec.maximum
    if lo is not None and (value <= lo if spec.min_exclusive else value < lo):
        raise SpecError(field, f"must be {'>' if spec.min_exclusive else '>='} {lo:g}, got {value}",
                        f"use a value in {'(' if spec.min_exclusive else '['}{lo:g}, {hi:g}]" if hi is not None
                        else f"use a value {'>' if spec.min_exclusive else '>='} {lo:g}")
    if hi is not None and value > hi:
        raise SpecError(field, f"must be <= {hi:g}, got {value}", f"use a value <= {hi:g}")
    if name == "block_size" and value not in _BLOCK_SIZES:
        raise SpecError(field, f"vLLM accepts block sizes {list(_BLOCK_SIZES)}, got {value}", "use 16 (the default)")
    return value


def validate_flags(flags: Mapping[str, Any], field: str = "flags") -> dict[str, Any]:
    """Validate a whole flag set; returns a normalised copy."""
    if not isinstance(flags, Mapping):
        raise SpecError(field, f"expected a mapping of vLLM flags, got {type(flags).__name__}", "e.g. {max_num_seqs: 64}")
    return {str(k): validate_flag(str(k), v, f"{field}.{k}") for k, v in flags.items()}


def gpus_needed(flags: Mapping[str, Any]) -> int:
    """GPUs one server with these flags occupies: tensor_parallel_size x pipeline_parallel_size x data_parallel_size.

    ``vllm serve --data-parallel-size D`` starts D engines of ``TP x PP`` workers on one node; local DP rank ``r``
    takes the visible devices ``[r x TP x PP, (r + 1) x TP x PP)`` (``get_physical_gpu_ids_for_local_dp_rank``,
    vllm/v1/engine/utils.py:310-354@0.26.0), so a trial's actor owns all ``TP x PP x D`` of them.

    Example:
        >>> gpus_needed({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}), gpus_needed({})
        (4, 1)
        >>> gpus_needed({"tensor_parallel_size": 2, "data_parallel_size": 4})
        8
    """
    return (int(flags.get("tensor_parallel_size", 1) or 1) * int(flags.get("pipeline_parallel_size", 1) or 1)
            * int(flags.get("data_parallel_size", 1) or 1))


def to_cli_args(flags: Mapping[str, Any]) -> list[str]:
    """``vllm serve`` arguments for a flag set, as an argv list (booleans as ``--x`` / ``--no-x``).

    Only flags of :data:`FLAGS`, each value checked again by :func:`validate_flag` (a SpecError
    otherwise): whatever reaches this point, an option's name comes from the table and its value is
    a number, a boolean, a list of integers or one of the flag's choices, never free text.
    """
    argv: list[str] = []
    for name, value in flags.items():
        if value is None:
            continue
        value = validate_flag(str(name), value, f"flags.{name}")
        cli = FLAGS[name].cli
        if isinstance(value, bool):
            argv.append(cli if value else "--no-" + cli[2:])
        elif isinstance(value, list):
            argv += [cli, *(str(v) for v in value)]
        else:
            argv += [cli, str(value)]
    return argv


#: Flags set only to measure, never to serve: name -> (value, what the study's output says of them).
#: ``load_format: dummy`` builds random weights, with the checkpoint's memory and speed, so a study may run
#: on them; the command it recommends loads the checkpoint.
_MEASURE_ONLY: Mapping[str, tuple[Any, str]] = {
    "load_format": ("dummy", "the trials ran on random weights (load_format: dummy), with the checkpoint's memory "
                             "and speed; the command above loads the checkpoint"),
}


def _measure_only(name: str, value: Any) -> bool:
    entry = _MEASURE_ONLY.get(name)
    return entry is not None and entry[0] == value


def serving_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """``flags`` as the recommended ``vllm serve`` gets them: without the measure-only ones.

    Example:
        >>> serving_flags({"load_format": "dummy", "max_num_seqs": 64})
        {'max_num_seqs': 64}
    """
    return {k: v for k, v in flags.items() if not _measure_only(str(k), v)}


#: What random weights do to an MoE model quantized online: vLLM's profiler inside a real vLLM 0.26.0 start on an
#: H100 SXM (the Qwen3-30B-A3B shape, ``--load-format dummy --quantization fp8``, 2026-12-07;
#: ``tests/fixtures/real_h100_classes/2026-12-07_q3moe_fp8_prof_*``) timed its expert kernels at under a seventh of
#: what uniform routing costs: its batches went to few experts. The same shape's bf16 random weights routed as
#: uniform routing does.
_FEW_EXPERTS_NOTE = ("random weights quantized online route an MoE model's batches to few experts (vLLM's profiler, "
                     "2026-12-07): above one sequence these trials ran faster than the checkpoint will; measure "
                     "the winner on the real weights before relying on its throughput")


def measure_only_notes(flags: Mapping[str, Any], moe: bool = False) -> list[str]:
    """What to tell the user of each measure-only flag in ``flags`` (:func:`serving_flags` leaves them out), and
    for an MoE model (``moe``) quantized online on random weights, that its trials' speed is not the checkpoint's.

    Example:
        >>> measure_only_notes({"load_format": "dummy"})[0][:38]
        'the trials ran on random weights (load'
        >>> measure_only_notes({"load_format": "safetensors"})
        []
        >>> [n[:31] for n in measure_only_notes({"load_format": "dummy", "quantization": "fp8"}, moe=True)][1:]
        ['random weights quantized online']
        >>> len(measure_only_notes({"load_format": "dummy", "quantization": "fp8"}))  # a dense model routes nothing
        1
    """
    notes = [_MEASURE_ONLY[str(k)][1] for k, v in flags.items() if _measure_only(str(k), v)]
    if moe and _measure_only("load_format", flags.get("load_format")) and flags.get("quantization"):
        notes.append(_FEW_EXPERTS_NOTE)
    return notes


def to_config_yaml(model: str, flags: Mapping[str, Any]) -> str:
    """A ``vllm serve --config`` file to serve with: keys are flag names with dashes, ``model``
    included, the measure-only flags (:func:`serving_flags`) left out.

    vLLM turns the file's keys and values into command-line arguments, so the model passes
    :func:`argv_value` and the flags :func:`validate_flag`, as on the command line (SpecError).
    """
    doc: dict[str, Any] = {"model": argv_value(model, "serve_model")}
    doc.update({k.replace("_", "-"): validate_flag(str(k), v, f"flags.{k}")
                for k, v in serving_flags(flags).items() if v is not None})
    return yaml.safe_dump(doc, sort_keys=False)


def to_command_line(model: str, flags: Mapping[str, Any]) -> str:
    """The ``vllm serve`` command line to serve with, shell-quoted for copy and paste: the measure-only
    flags (:func:`serving_flags`) left out (display only: servetune itself launches a trial with the
    argv list of :func:`to_cli_args`, every flag included).

    Example:
        >>> to_command_line("a b/m", {"max_model_len": 4096, "load_format": "dummy"})
        "vllm serve 'a b/m' --max-model-len 4096"
    """
    return shlex.join(["vllm", "serve", argv_value(model, "serve_model"), *to_cli_args(serving_flags(flags))])


def flags_key(flags: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """A hashable key of a flag set (or of a trial's params), the same for the same names and
    values in any order: what caches of simulated trials and the re-queue on resume match on.

    Example:
        >>> flags_key({"max_num_seqs": 64, "gpu_memory_utilization": 0.9}) == flags_key(
        ...     {"gpu_memory_utilization": 0.9, "max_num_seqs": 64})
        True
    """
    return tuple(sorted((str(k), repr(v)) for k, v in flags.items()))


_MAX_SET_CHARS = 4096  # one flag's value on the command line


def parse_set_option(item: str) -> tuple[str, Any]:
    """``FLAG=VALUE`` from ``--set``; the value is read as a YAML scalar, the flag validated."""
    if "=" not in item:
        raise SpecError("--set", f"expected FLAG=VALUE, got {shown(item)}", "e.g. --set gpu_memory_utilization=0.5")
    name, raw = item.split("=", 1)
    name = name.strip().lstrip("-").replace("-", "_")
    if len(raw) > _MAX_SET_CHARS:
        raise SpecError(f"--set {name}", f"a value of {len(raw):,} characters, above the limit of {_MAX_SET_CHARS:,}",
                        "give a flag's value, e.g. --set max_num_seqs=64")
    try:
        value = load_yaml(raw, f"--set {name}", "the value") if raw.strip() else None
        if isinstance(value, str) and value.startswith("["):
            value = load_json(value, f"--set {name}", "the value")
    except SpecError as exc:
        raise SpecError(f"--set {name}", f"cannot read {shown(raw)} as a value ({exc.message})",
                        "quote plain values; a list as JSON, e.g. --set 'cuda_graph_sizes=[1, 2, 4]'") from None
    return name, validate_flag(name, value, f"--set {name}")
