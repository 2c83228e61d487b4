"""Real ``vllm serve`` starts kept as fixtures, read and planned as the planner plans a flag set.

A start's folder holds ``summary.json`` (the model path on the GPU machine, the flags) and
``server.log.gz``. The model path maps to servetune's config of the same shape through
``_fidelity.HOST_MODELS``, and the collector's own flags (random weights made on the GPU) are left
out through ``_fidelity.serving_flags``: the simulator's fidelity checks read the same starts that way.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from _fidelity import HOST_MODELS, argv_switches, serving_flags

from servetune.engines.vllm.logs import parse_log
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model


def read_start(folder: Path) -> tuple[dict[str, Any], str]:
    """A start's ``summary.json`` and its server log's text."""
    return json.loads((folder / "summary.json").read_text()), gzip.decompress((folder / "server.log.gz").read_bytes()).decode()


def plan_start(summary: dict[str, Any], text: str, gpu: str, version: str = "0.26.0") -> tuple[Any, Any]:
    """The engine config and memory plan of a recorded start's flags on ``gpu`` at vLLM ``version``
    (the compile cache warm where the log says it was)."""
    model, spec = load_model(HOST_MODELS[summary["model"]]), get_gpu(gpu)
    flags = serving_flags({**argv_switches(summary.get("argv", [])), **summary["flags"]})
    config = resolve_engine_config(flags, model, spec, version)
    return config, plan_memory(model, spec, config, compile_cache_warm=bool(parse_log(text).compile_cache_hit))


def evidence_at_a_glance(fixtures: Path) -> tuple[int, list[Path], int]:
    """What a folder of real starts holds: how many windows, those not served whole (a request that did
    not complete, or an error), and the bytes of every file (what the evidence adds to a clone)."""
    windows = {w: json.loads(w.read_text()) for w in sorted(fixtures.glob("*/*/summary.json"))}
    broken = [w for w, s in windows.items()
              if s["completed"] != s["workload"]["num_requests"] or s.get("error")]
    return len(windows), broken, sum(f.stat().st_size for f in fixtures.rglob("*") if f.is_file())
