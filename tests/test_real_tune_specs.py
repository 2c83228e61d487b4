"""The real-GPU tune specs of benchmarks/real_vllm/ load, and their first trials are planned to start.

Each names the GPU host's folder its model was built in (a shipped config and a covering tokenizer); here it is read as the shipped config it was copied from. A spec that no longer loads, or
whose informed start the planner no longer expects to start, is found here rather than on a lent GPU
host, where a refused spec costs the device time of the commands that carried the payload.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.search.informed import informed_starts

from _real_tune import shipped_spec

FOLDER = Path(__file__).parents[1] / "benchmarks" / "real_vllm"
#: The shipped config each host folder was made from (benchmarks/real_vllm/classes_host.sh keep1).
HOST_MODELS = {"/root/m8b": "llama-3.1-8b", "/root/l8": "llama-3.1-8b", "/root/q3": "qwen3-30b-a3b",
               "/root/mx": "mixtral-8x7b", "/root/g2": "gemma-2-27b",
               # The Mixtral config cut to 16 layers, as the 2026-12-05 collection that first ran it kept it.
               "/root/mx16": str(Path(__file__).parent / "fixtures" / "real_h100_classes" / "2026-12-05_h100_host_c"
                                 / "mx16")}
SPECS = sorted(FOLDER.glob("*_tune.yaml"))


def test_every_tune_spec_is_checked() -> None:
    assert len(SPECS) >= 7
    assert {yaml.safe_load(p.read_text())["model"] for p in SPECS} <= set(HOST_MODELS)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_the_spec_loads_and_its_informed_start_is_planned_to_start(path: Path) -> None:
    shipped = HOST_MODELS[yaml.safe_load(path.read_text())["model"]]
    spec = shipped_spec(path, shipped)
    model, gpu = load_model(shipped), spec.gpu_spec()
    (first, *_) = informed_starts(spec.search_space, spec.fixed_flags, model, gpu, spec.workload, spec.vllm_version)
    plan = plan_memory(model, gpu, resolve_engine_config({**spec.fixed_flags, **first}, model, gpu, spec.vllm_version))
    assert plan.fits and plan.kv_cache_tokens > 0, plan.verdict
