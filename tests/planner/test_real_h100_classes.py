"""Real vLLM 0.26.0 on one H100 SXM (2026-12-05): the planner on an MoE shape and FP8 starts it never saw.

``tests/fixtures/real_h100_classes`` (its README): a Qwen3-30B-A3B shape (bf16 at two flag sets, FP8
weights, and a start that vLLM refused at ``gpu_memory_utilization`` 0.74) and the Llama-3.1-8B
shape with FP8 weights and with an FP8 KV cache. No planner constant was fitted on them. What they
showed the planner: vLLM 0.26 starts MoE models on the V1 model runner, which takes its CUDA-graph
estimate off the KV budget (``vllm_rules.runs_v2_runner``). Before that rule the three served MoE
starts were planned +4.05% (256 sequences), +0.41% (64 sequences) and +1.24% (FP8) against vLLM's
KV tokens, and the refused start was foreseen for the wrong reason (a KV pool too small for one
sequence, where vLLM found no memory for KV at all).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from servetune.engines.vllm.logs import classify, parse_log
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.result import TrialStatus

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real_h100_classes"
#: The model folders on the GPU machine -> servetune's shipped configs of the same shape.
HOST_MODELS = {"/root/q3": "qwen3-30b-a3b", "/root/l8": "llama-3.1-8b"}
#: Flags of the collection that only say how the weights were made (random, on the GPU).
NOT_PLANNED = ("load_format",)
STARTS = sorted(p.parent.name for p in FIXTURES.glob("2026-*/server.log.gz"))
SERVED = [s for s in STARTS if "u074" not in s]


def _start(name: str) -> tuple[dict, str]:
    d = FIXTURES / name
    return json.loads((d / "summary.json").read_text()), gzip.decompress((d / "server.log.gz").read_bytes()).decode()


def _plan(summary: dict, text: str):
    model, gpu = load_model(HOST_MODELS[summary["model"]]), get_gpu("H100-80GB")
    flags = {k: v for k, v in summary["flags"].items() if k not in NOT_PLANNED}
    config = resolve_engine_config(flags, model, gpu, "0.26.0")
    return config, plan_memory(model, gpu, config, compile_cache_warm=bool(parse_log(text).compile_cache_hit))


def test_the_evidence_is_all_there() -> None:
    assert STARTS == ["2026-12-05_l8b_fp8_u09_s256_mbt8192", "2026-12-05_l8b_kvfp8_u09_s256_mbt8192",
                      "2026-12-05_q3moe_fp8_u09_s256_mbt8192", "2026-12-05_q3moe_u074_s256_mbt8192",
                      "2026-12-05_q3moe_u09_s256_mbt8192", "2026-12-05_q3moe_u09_s64_mbt2048"]
    windows = sorted(FIXTURES.glob("*/*/summary.json"))
    assert len(windows) == 18
    for w in windows:
        s = json.loads(w.read_text())
        assert s["completed"] == s["workload"]["num_requests"] and not s.get("error"), w
    size = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert size < 14 << 20, size


@pytest.mark.parametrize("name", STARTS)
def test_each_start_logs_which_model_runner_vllm_chose(name: str) -> None:
    summary, text = _start(name)
    config, _ = _plan(summary, text)
    v1_logged = "gpu_model_runner.py" in text and "Estimated CUDA graph memory" in text
    v2_logged = "[model_runner.py:" in text and "Estimated CUDA graph memory" not in text
    assert v1_logged != v2_logged
    # The planner's rule: on 0.26 an MoE model (Qwen3MoeForCausalLM) runs the V1 runner, a dense one the V2.
    assert config.v1_runner is v1_logged
    assert config.rules.subtracts_cudagraph_estimate is v1_logged


@pytest.mark.parametrize("name", SERVED)
def test_planner_kv_capacity_held_out(name: str) -> None:
    # Measured: MoE bf16 +0.81% (256 sequences) and +2.06% (64 sequences, 2,048-token budget),
    # MoE FP8 +0.24%, 8B FP8 weights +0.23%, 8B FP8 KV cache +0.19%. The bound is the 3%.
    summary, text = _start(name)
    parsed = parse_log(text)
    assert parsed.server_ready and classify(text).status.value == "ok"
    _, plan = _plan(summary, text)
    assert plan.fits
    assert plan.kv_cache_tokens == pytest.approx(parsed.kv_cache_tokens, rel=0.03), (plan.kv_cache_tokens,
                                                                                    parsed.kv_cache_tokens)


@pytest.mark.parametrize("name", SERVED)
def test_weights_as_vllm_loaded_them(name: str) -> None:
    # bf16 56.88 GiB (MoE) and 15.04 (8B); online FP8: 29.06 (MoE, experts and attention in fp8)
    # and 8.54 (8B): the planner within 0.6%.
    summary, text = _start(name)
    _, plan = _plan(summary, text)
    assert plan.memory.weights == pytest.approx(parse_log(text).weights_gib, rel=0.006)


def test_the_refused_moe_start_is_foreseen_with_vllms_reason() -> None:
    summary, text = _start("2026-12-05_q3moe_u074_s256_mbt8192")
    assert classify(text).status.value == "startup_oom"
    assert "No available memory for the cache blocks" in text
    _, plan = _plan(summary, text)
    assert not plan.fits and plan.failure is TrialStatus.STARTUP_OOM
    assert "No available memory for the cache blocks" in plan.cause
