"""The stand-in's command line: ``vllm serve``'s arguments that servetune uses, and ``--config``.

Contract: :func:`build_parser` is argparse over every flag of :data:`servetune.planner.flags.FLAGS`
(booleans as ``--x`` / ``--no-x``, vLLM's human-readable sizes for the byte and token counts) plus
the stand-in's ``--sim-*`` options, erring in argparse's own shape under vLLM's prog name (exit
2); :func:`parse_args` accepts underscores as dashes and expands ``--config file.yaml`` first, so the
command line wins over the file, as in vLLM; :func:`given_flags` is the engine flags that were
given, by vLLM name. Reads the ``--config`` file and ``SERVETUNE_SIM_GPU``; nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from servetune.planner.flags import FLAGS
from servetune.sim import vllm_log

__all__ = ["PROG", "build_parser", "parse_args", "given_flags"]

PROG = "vllm serve"


def _human_int(text: str) -> int:
    """vLLM's human-readable sizes: ``8G`` = 8*2**30, ``8g`` = 8*10**9, ``32k`` = 32000, plain ints."""
    text = text.strip()
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


_HUMAN_INT_FLAGS = ("kv_cache_memory_bytes", "max_model_len", "max_num_batched_tokens")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's own shape, with vLLM's prog name
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """``vllm serve``'s arguments that servetune uses, plus the stand-in's ``--sim-*`` options."""
    p = _Parser(prog=PROG, description="Simulated vLLM OpenAI-compatible server (servetune stand-in).")
    p.add_argument("model_tag", nargs="?", default=None, help="model: a shipped name, a directory or a config.json")
    p.add_argument("--model", dest="model_opt", default=None, help="the model, as an option")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--config", default=None, help="YAML file of flags (dashed keys); the command line wins")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--disable-log-stats", action="store_true")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    for spec in FLAGS.values():
        dest = spec.name
        if spec.kind is bool:
            p.add_argument(spec.cli, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=spec.help)
        elif spec.kind is list:
            p.add_argument(spec.cli, dest=dest, nargs="+", type=int, default=None, help=spec.help)
        elif spec.name in _HUMAN_INT_FLAGS:
            p.add_argument(spec.cli, dest=dest, type=_human_int, default=None, help=spec.help)
        else:
            p.add_argument(spec.cli, dest=dest, type=spec.kind, default=None, choices=spec.choices, help=spec.help)
    sim = p.add_argument_group("stand-in options")
    sim.add_argument("--sim-gpu", default=os.environ.get("SERVETUNE_SIM_GPU", "H200"), help="GPU to simulate")
    sim.add_argument("--sim-speedup", type=float, default=1.0, help="virtual seconds per wall second")
    sim.add_argument("--sim-vllm-version", default=None, help="vLLM version to imitate (default 0.26.0)")
    sim.add_argument("--sim-fail", choices=vllm_log.FAIL_MODES, default=None, help="inject a failure")
    sim.add_argument("--sim-fail-after-tokens", type=int, default=32,
                     help="generated tokens before runtime_crash/stall strike")
    sim.add_argument("--sim-ignore-sigterm", action="store_true", help="ignore SIGTERM/SIGINT (needs SIGKILL)")
    return p


def _config_argv(path: str, parser: argparse.ArgumentParser) -> tuple[list[str], str | None]:
    """vLLM's ``--config`` file as argv tokens (dashed keys; true -> --k, false -> --no-k) and its model."""
    ext = Path(path).suffix
    if ext not in (".yaml", ".yml"):
        parser.error(f"Config file must be of a yaml/yml type. {ext} supplied")
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"cannot read --config {path}: {exc}")
    if not isinstance(doc, Mapping):
        parser.error(f"--config {path}: expected a mapping of flags")
    argv: list[str] = []
    model: str | None = None
    for key, value in doc.items():
        name = str(key).replace("_", "-")
        if name == "model":
            model = str(value)
        elif value is True:
            argv.append(f"--{name}")
        elif value is False:
            argv.append(f"--no-{name}")
        elif isinstance(value, list):
            argv += [f"--{name}", *(str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [f"--{name}", json.dumps(value)]
        elif value is not None:
            argv += [f"--{name}", str(value)]
    return argv, model


def _dashed(argv: Sequence[str]) -> list[str]:
    """vLLM accepts ``--max_num_seqs`` as well as ``--max-num-seqs``."""
    out = []
    for tok in argv:
        if tok.startswith("--") and len(tok) > 2:
            name, eq, value = tok[2:].partition("=")
            tok = "--" + name.replace("_", "-") + eq + value
        out.append(tok)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a ``vllm serve`` command line (``--config`` expanded first, so the CLI wins)."""
    parser = build_parser()
    argv = _dashed(sys.argv[1:] if argv is None else argv)
    config_path, rest, i = None, [], 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--config" and i + 1 < len(argv):
            config_path, i = argv[i + 1], i + 2
            continue
        if tok.startswith("--config="):
            config_path = tok.split("=", 1)[1]
        else:
            rest.append(tok)
        i += 1
    config_model = None
    if config_path is not None:
        file_argv, config_model = _config_argv(config_path, parser)
        # argparse lets a later occurrence win, so the file's tokens go first (vLLM: CLI > file).
        rest = file_argv + rest
    ns = parser.parse_args(rest)
    ns.model = ns.model_tag or ns.model_opt or config_model
    if ns.model is None:
        parser.error("the following arguments are required: model_tag")
    if ns.sim_speedup <= 0:
        parser.error(f"argument --sim-speedup: must be > 0, got {ns.sim_speedup}")
    return ns


def given_flags(ns: argparse.Namespace) -> dict[str, Any]:
    """The servetune engine flags present on the command line (or in ``--config``), by vLLM name."""
    return {name: getattr(ns, name) for name in FLAGS if getattr(ns, name, None) is not None}
