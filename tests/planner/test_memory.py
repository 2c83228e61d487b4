"""resolve_engine_config and plan_memory against vLLM's rules and the real vLLM 0.26 / H200 logs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from servetune.errors import SpecError
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import (
    DEFAULT_VLLM_VERSION, EngineConfig, batch_defaults, capture_sizes_for, parse_vllm_version, plan_memory,
    resolve_engine_config,
)
from servetune.planner.modelinfo import load_model, profile_from_config
from servetune.result import TrialStatus

REAL = Path(__file__).parents[1] / "fixtures" / "real_h200"
TEST_MODEL = load_model("servetune-test-850m")
H200 = get_gpu("H200")


def _plan(flags, model=TEST_MODEL, gpu=H200, version=DEFAULT_VLLM_VERSION):
    config = resolve_engine_config(flags, model, gpu, version)
    return config, plan_memory(model, gpu, config)


def _log_figures(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    if m := re.search(r"KV cache size: ([\d,]+) tokens", text):
        out["tokens"] = int(m.group(1).replace(",", ""))
    if m := re.search(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", text):
        out["concurrency"] = float(m.group(1))
    if m := re.search(r"Available KV cache memory: (-?[\d.]+) GiB", text):
        out["available"] = float(m.group(1))
    if m := re.search(r"Actual usage is ([\d.]+) GiB for weight, ([\d.]+) GiB for peak activation, ([\d.]+) GiB "
                      r"for non-torch memory, and ([\d.]+) GiB for CUDAGraph memory", text):
        out.update(weights=float(m.group(1)), activation=float(m.group(2)), non_torch=float(m.group(3)),
                   cudagraph=float(m.group(4)))
    return out


# ------------------------------------------------------------------------------ real logs
@pytest.mark.parametrize("run", ["a1_u05_s64", "a2_u05_s256", "a3_preempt_blocks4096_s128", "b1_eager_s64",
                                 "b2_s256_mbt2048", "b3_preempt_blocks1024_s64", "b4_rate_s128"])
def test_kv_tokens_of_the_real_runs_within_1pct(run):
    summary = json.loads((REAL / run / "summary.json").read_text())
    real = _log_figures((REAL / run / "server.log").read_text())
    _, plan = _plan(summary["flags"])
    assert plan.fits
    error = abs(plan.kv_cache_tokens - real["tokens"]) / real["tokens"]
    assert error < 0.01, f"{run}: predicted {plan.kv_cache_tokens}, vLLM logged {real['tokens']}"
    assert abs(plan.max_concurrency - real["concurrency"]) / real["concurrency"] < 0.01
    # The breakdown matches the worker's own accounting line to its printed precision.
    assert abs(plan.memory.kv_cache - real["available"]) < 0.02
    assert abs(plan.memory.weights - real["weights"]) < 0.01
    assert abs(plan.memory.activation_peak - real["activation"]) < 0.01
    assert abs(plan.memory.non_torch - real["non_torch"]) < 0.01
    assert abs(plan.memory.cudagraph - real["cudagraph"]) < 0.02
    # Startup: launch to healthy within 25 % (first start on its host, a1, ran 89 s).
    assert abs(plan.startup_s - summary["startup_s"]) / summary["startup_s"] < 0.25


def test_server_tp2_min_over_workers():
    # tests/fixtures/real_h200/examples/server_tp2.log (vLLM 0.26.0, --tensor-parallel-size 2 --gpu-memory-utilization 0.5
    # --max-num-seqs 64): "Model loading took 0.81 GiB", "Available KV cache memory: 68.73 GiB",
    # "GPU KV cache size: 4,503,984 tokens", "Maximum concurrency ... 549.80x", peak activation 0.3, non-torch 0.06.
    _, plan = _plan({"tensor_parallel_size": 2, "gpu_memory_utilization": 0.5, "max_num_seqs": 64})
    assert abs(plan.kv_cache_tokens - 4_503_984) / 4_503_984 < 0.01
    assert abs(plan.max_concurrency - 549.80) < 0.5
    assert abs(plan.memory.kv_cache - 68.73) < 0.02
    assert abs(plan.memory.activation_peak - 0.30) < 0.02 and abs(plan.memory.non_torch - 0.06) < 0.01


def test_pp2_from_the_gpu_readme():
    # The GPU host notes of the two-H200 host (vLLM 0.26.0): "At --gpu-memory-utilization 0.5: ... PP=2 4,495,664"
    # (held out of the fit)
    _, plan = _plan({"pipeline_parallel_size": 2, "gpu_memory_utilization": 0.5, "max_num_seqs": 64})
    assert abs(plan.kv_cache_tokens - 4_495_664) / 4_495_664 < 0.01


def test_override_128_blocks_at_2048():
    # server2.log: "Overriding num_gpu_blocks=138533 with num_gpu_blocks_override=128",
    # "GPU KV cache size: 2,048 tokens", "Maximum concurrency for 2,048 tokens per request: 1.00x"
    _, plan = _plan({"max_model_len": 2048, "gpu_memory_utilization": 0.5, "num_gpu_blocks_override": 128,
                     "max_num_seqs": 64})
    assert (plan.num_gpu_blocks, plan.kv_cache_tokens, plan.max_concurrency) == (128, 2048, 1.0)


def test_util_05_gives_the_logged_block_count():
    _, plan = _plan({"gpu_memory_utilization": 0.5, "max_num_seqs": 64})
    assert plan.num_gpu_blocks == 138533  # the number the override line prints
    assert plan.kv_cache_tokens == 2_216_528 and round(plan.max_concurrency, 2) == 270.57
    assert plan.num_cudagraphs == 30 and round(plan.memory.cudagraph, 2) == 0.15  # 19 PIECEWISE + 11 FULL
    assert not plan.cudagraph_subtracted


def test_b5_startup_failure_has_vllms_text():
    log = (REAL / "b5_fail_u0012" / "server.log").read_text()
    summary = json.loads((REAL / "b5_fail_u0012" / "summary.json").read_text())
    _, plan = _plan(summary["flags"])
    assert not plan.fits and plan.failure is TrialStatus.STARTUP_OOM
    assert f"ValueError: {plan.cause}" in log
    assert abs(plan.memory.kv_cache - _log_figures(log)["available"]) < 0.02  # -0.52 GiB
    assert plan.kv_cache_tokens == 0 and "gpu_memory_utilization" in plan.fix
    assert abs(plan.startup_s - summary["startup_s"]) / summary["startup_s"] < 0.15  # died 46 s after launch


# ------------------------------------------------------------------------------ defaults
def test_batch_defaults_by_gpu_tier_and_version():
    v26, v29 = (0, 26, 0), (0, 29, 0)
    assert batch_defaults(get_gpu("H200"), v26) == (8192, 1024)
    assert batch_defaults(get_gpu("H100-80GB"), v26) == (8192, 1024)
    assert batch_defaults(get_gpu("A100-80GB"), v26) == (2048, 256)  # >=70 GiB but an A100
    assert batch_defaults(get_gpu("L40S"), v26) == (2048, 256)
    assert batch_defaults(get_gpu("B200"), v26) == (8192, 1024)
    assert batch_defaults(get_gpu("B200"), v29) == (16384, 1024)


def test_resolved_defaults():
    llama = load_model("llama-3.1-8b")
    c = resolve_engine_config({}, llama, get_gpu("H100-80GB"))
    assert (c.gpu_memory_utilization, c.max_num_batched_tokens, c.max_num_seqs, c.max_model_len) == (0.92, 8192, 1024, 131072)
    assert (c.block_size, c.kv_cache_dtype, c.enable_prefix_caching, c.enable_chunked_prefill) == (16, "auto", True, True)
    assert c.async_scheduling and c.vllm_version == "0.26.0" and c.world_size == 1
    assert resolve_engine_config({}, llama, get_gpu("H100-80GB"), "0.19.0").gpu_memory_utilization == 0.9
    assert not resolve_engine_config({}, llama, get_gpu("H100-80GB"), "0.13.0").async_scheduling
    # 0.14.0 turns it on where the user set nothing (SchedulerConfig None -> True), not with PP
    assert resolve_engine_config({}, llama, get_gpu("H100-80GB"), "0.14.1").async_scheduling
    assert not resolve_engine_config({"pipeline_parallel_size": 2}, llama, get_gpu("H100-80GB"), "0.14.1").async_scheduling
    # max_num_seqs = min(default, max_num_batched_tokens)
    assert resolve_engine_config({"max_num_batched_tokens": 512}, llama, get_gpu("H200")).max_num_seqs == 512
    # chunked prefill off: the default token budget grows to max_model_len
    c = resolve_engine_config({"enable_chunked_prefill": False, "max_model_len": 16384}, llama, get_gpu("L40S"))
    assert c.max_num_batched_tokens == 16384


def test_none_means_unset():
    c = resolve_engine_config({"max_num_seqs": None, "kv_cache_memory_bytes": None}, TEST_MODEL, H200)
    assert c == resolve_engine_config({}, TEST_MODEL, H200)


def test_as_flags_round_trips():
    c = resolve_engine_config({"gpu_memory_utilization": 0.8, "max_num_seqs": 96, "tensor_parallel_size": 2,
                               "kv_cache_dtype": "fp8"}, load_model("llama-3.1-8b"), get_gpu("H100-80GB"))
    again = resolve_engine_config(c.as_flags(), load_model("llama-3.1-8b"), get_gpu("H100-80GB"))
    assert again == c and isinstance(c, EngineConfig)


def test_versions():
    assert parse_vllm_version("0.26.0") == (0, 26, 0) and parse_vllm_version("v0.33") == (0, 33, 0)
    assert parse_vllm_version("0.10.2") == (0, 10, 2)  # the V1 engine's profiler, modelled from 0.10.0
    with pytest.raises(SpecError, match="vllm_version"):
        parse_vllm_version("0.9.2")
    with pytest.raises(SpecError, match="vllm_version"):
        parse_vllm_version("latest")


# --------------------------------------------------------------------------- capture sizes
def test_capture_sizes_of_the_real_log():
    c, _ = _plan({"gpu_memory_utilization": 0.5, "max_num_seqs": 64})
    assert c.cudagraph_capture_sizes == (1, 2, 4, *range(8, 129, 8))
    assert len(c.cudagraph_capture_sizes) == 19 and len(c.full_cudagraph_sizes) == 11


@pytest.mark.parametrize(("version", "seqs", "mbt", "count", "largest"), [
    ("0.11.0", 256, 8192, 3 + 64, 512),  # step 8 all the way
    ("0.13.0", 256, 8192, 51, 512),  # step 16 above 256 (reference: 51 sizes)
    ("0.26.0", 256, 8192, 51, 512),
    ("0.26.0", 1024, 8192, 51, 512),  # capped at 512
    ("0.29.0", 1024, 8192, 51, 512),  # Hopper keeps 512
    ("0.26.0", 256, 300, 3 + 31 + 3 + 1, 300),  # ≥0.25 appends max_num_batched_tokens when under the cap
    ("0.20.0", 256, 300, 3 + 31 + 3, 288),  # before 0.25 it does not
])
def test_capture_sizes_by_version(version, seqs, mbt, count, largest):
    sizes = capture_sizes_for(parse_vllm_version(version), max_num_seqs=seqs, max_num_batched_tokens=mbt)
    assert len(sizes) == count and sizes[-1] == largest and list(sizes) == sorted(set(sizes))


def test_capture_sizes_033_appends_max_num_seqs():
    v33 = capture_sizes_for((0, 33, 0), max_num_seqs=100, max_num_batched_tokens=8192)
    v26 = capture_sizes_for((0, 26, 0), max_num_seqs=100, max_num_batched_tokens=8192)
    assert 100 in v33 and 100 not in v26 and len(v33) == len(v26) + 1


def test_blackwell_cap_from_029():
    llama, b200 = load_model("llama-3.1-8b"), get_gpu("B200")
    assert resolve_engine_config({}, llama, b200, "0.29.0").cudagraph_capture_sizes[-1] == 1024
    assert resolve_engine_config({}, llama, b200, "0.26.0").cudagraph_capture_sizes[-1] == 512


def test_user_capture_flags():
    c, _ = _plan({"max_cudagraph_capture_size": 1024, "max_num_seqs": 64})
    assert c.cudagraph_capture_sizes[-1] == 1024 and c.cudagraph_capture_sizes[-2] == 1008
    c, _ = _plan({"cudagraph_capture_sizes": [4, 1, 16, 99999], "max_num_batched_tokens": 4096})
    assert c.cudagraph_capture_sizes == (1, 4, 16)  # filtered to <= max_num_batched_tokens
    with pytest.raises(SpecError, match="should be consistent"):
        _plan({"cudagraph_capture_sizes": [1, 2, 8], "max_cudagraph_capture_size": 16})
    c, plan = _plan({"enforce_eager": True})
    assert c.cudagraph_capture_sizes == () and plan.memory.cudagraph == 0 and plan.num_cudagraphs == 0


# ---------------------------------------------------------------------- impossible combos
def test_tp_must_divide_attention_heads():
    with pytest.raises(SpecError) as err:
        resolve_engine_config({"tensor_parallel_size": 3}, TEST_MODEL, H200)
    assert err.value.field == "tensor_parallel_size"
    assert "Total number of attention heads (32) must be divisible by tensor parallel size (3)." in str(err.value)


def test_tp_vs_kv_heads():
    odd = profile_from_config({"hidden_size": 768, "num_hidden_layers": 2, "num_attention_heads": 48,
                               "num_key_value_heads": 6, "intermediate_size": 1024, "vocab_size": 100,
                               "max_position_embeddings": 512}, "odd")
    with pytest.raises(SpecError, match="8 is not divisible by 6"):
        resolve_engine_config({"tensor_parallel_size": 8}, odd, H200)
    with pytest.raises(SpecError, match="6 is not divisible by 4"):
        resolve_engine_config({"tensor_parallel_size": 4}, odd, H200)
    assert resolve_engine_config({"tensor_parallel_size": 12}, odd, H200).tensor_parallel_size == 12  # replicated


@pytest.mark.parametrize(("flags", "field", "text"), [
    ({"max_num_batched_tokens": 64, "max_num_seqs": 128}, "max_num_batched_tokens",
     "max_num_batched_tokens (64) must be greater than or equal to max_num_seqs (128)."),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}, "max_num_batched_tokens",
     "max_num_batched_tokens (4096) is smaller than max_model_len (8192)."),
    ({"pipeline_parallel_size": 17}, "pipeline_parallel_size", "17 pipeline stages for 16 layers"),
    ({"max_model_len": 16384}, "max_model_len",
     "User-specified max_model_len (16384) is greater than the derived max_model_len"),
    ({"max_num_seq": 4}, "flags.max_num_seq", "unknown vLLM flag"),
])
def test_impossible_combos_name_the_flag(flags, field, text):
    with pytest.raises(SpecError) as err:
        resolve_engine_config(flags, TEST_MODEL, H200)
    assert err.value.field == field and text in str(err.value)


# ------------------------------------------------------------------------------- planning
def test_page_size_and_blocks():
    _, plan = _plan({"kv_cache_memory_bytes": 1 << 30})
    # page = 2 * 16 tokens * 8 heads * 64 * 2 B = 32 KiB per layer; x16 layers = 512 KiB per block
    assert plan.num_gpu_blocks == (1 << 30) // (512 * 1024) == 2048 and plan.memory.budget == 1.0
    _, fp8 = _plan({"kv_cache_memory_bytes": 1 << 30, "kv_cache_dtype": "fp8"})
    assert fp8.num_gpu_blocks == 4096 and fp8.kv_bytes_per_token == 16384
    _, b32 = _plan({"kv_cache_memory_bytes": 1 << 30, "block_size": 32})
    assert b32.num_gpu_blocks == 1024 and b32.block_size == 32


def test_kv_tokens_formula_by_version():
    flags = {"gpu_memory_utilization": 0.5, "max_num_seqs": 64, "max_model_len": 1000}
    _, new = _plan(flags, version="0.26.0")
    _, old = _plan(flags, version="0.16.0")
    # (the block counts differ: 0.16 profiles with the V1 model runner's constants)
    assert old.kv_cache_tokens == old.num_gpu_blocks * 16  # ≤0.20.0: blocks x block size
    assert new.kv_cache_tokens == int(new.num_gpu_blocks / 63 * 1000)  # ≥0.20.1: concurrency x max_model_len
    # The switch is 0.20.1's (kv_cache_utils.py:1699-1708@0.20.1), not 0.25's: 0.20.0 and 0.20.1 plan the same
    # blocks and log them differently.
    _, v200 = _plan(flags, version="0.20.0")
    _, v201 = _plan(flags, version="0.20.1")
    assert v200.num_gpu_blocks == v201.num_gpu_blocks
    assert v200.kv_cache_tokens == v200.num_gpu_blocks * 16
    assert v201.kv_cache_tokens == int(v201.num_gpu_blocks / 63 * 1000) != v200.kv_cache_tokens


def test_cudagraph_estimate_subtracted_only_in_020_to_025():
    flags = {"gpu_memory_utilization": 0.5, "max_num_seqs": 64}
    _, v26 = _plan(flags, version="0.26.0")
    _, v22 = _plan(flags, version="0.22.0")
    _, v19 = _plan(flags, version="0.19.0")
    assert v22.cudagraph_subtracted and not v26.cudagraph_subtracted and not v19.cudagraph_subtracted
    # 0.19 and 0.22 share the V1 runner's profile: they differ by exactly the estimate.
    assert abs((v19.memory.kv_cache - v22.memory.kv_cache) - v22.memory.cudagraph) < 1e-6
    # 0.26 (V2 runner) differs from 0.19 only by the profiled non-torch growth (the test model's
    # small vocab keeps the sampler below the forward peak in both).
    assert v19.memory.activation_peak == v26.memory.activation_peak
    assert abs((v19.memory.kv_cache - v26.memory.kv_cache) - (v26.memory.non_torch - v19.memory.non_torch)) < 1e-6


def test_tp_more_than_doubles_per_gpu_kv():
    _, tp1 = _plan({"gpu_memory_utilization": 0.5})
    _, tp2 = _plan({"gpu_memory_utilization": 0.5, "tensor_parallel_size": 2})
    assert tp2.kv_cache_tokens > 2 * tp1.kv_cache_tokens  # half the KV heads and half the weights per GPU
    assert tp2.memory.weights < tp1.memory.weights / 1.9


def test_kv_too_small_reports_the_estimated_length():
    llama, l4 = load_model("llama-3.1-8b"), get_gpu("L4")
    _, plan = _plan({}, llama, l4)
    assert plan.failure is TrialStatus.KV_TOO_SMALL and not plan.fits
    assert plan.cause.startswith("To serve at least one request with the model's max seq len (131072)")
    est = plan.estimated_max_model_len
    assert f"the estimated maximum model length is {est}." in plan.cause and f"max_model_len to <= {est}" in plan.fix
    _, fits = _plan({"max_model_len": est}, llama, l4)
    _, too_long = _plan({"max_model_len": est + 16}, llama, l4)
    assert fits.fits and fits.max_concurrency >= 1.0 and too_long.failure is TrialStatus.KV_TOO_SMALL


def test_weights_that_do_not_fit_fail_to_load():
    _, plan = _plan({}, load_model("llama-3.1-70b"), get_gpu("H100-80GB"))
    assert plan.failure is TrialStatus.STARTUP_OOM and plan.cause.startswith("Failed to load model")
    assert "tensor_parallel_size" in plan.fix
    _, tp4 = _plan({"tensor_parallel_size": 4}, load_model("llama-3.1-70b"), get_gpu("H100-80GB"))
    assert tp4.fits and 30 < tp4.memory.weights < 34


def test_weights_above_budget_is_no_memory_for_cache_blocks():
    _, plan = _plan({"gpu_memory_utilization": 0.2}, load_model("llama-3.1-8b"), get_gpu("H100-80GB"))
    assert plan.failure is TrialStatus.STARTUP_OOM and plan.cause.startswith("No available memory for the cache blocks")
    assert plan.memory.kv_cache < 0


def test_cudagraph_oom_when_graphs_outgrow_the_headroom():
    flags = {"gpu_memory_utilization": 0.99, "max_cudagraph_capture_size": 2048}
    _, plan = _plan(flags)
    assert plan.failure is TrialStatus.CUDAGRAPH_OOM and "CUDA out of memory" in plan.cause
    assert "enforce_eager" in plan.fix and any("extrapolated" in n for n in plan.notes)
    _, budgeted = _plan(flags, version="0.22.0")  # the estimate comes out of the KV budget instead
    assert budgeted.fits
    _, roomy = _plan({**flags, "gpu_memory_utilization": 0.9})
    assert roomy.fits


def test_override_beyond_memory_is_an_oom():
    _, plan = _plan({"gpu_memory_utilization": 0.5, "num_gpu_blocks_override": 400_000})
    assert plan.failure is TrialStatus.STARTUP_OOM and "CUDA out of memory" in plan.cause


def test_kv_cache_memory_bytes_too_large():
    _, plan = _plan({"kv_cache_memory_bytes": 150 << 30})
    assert plan.failure is TrialStatus.STARTUP_OOM and "kv_cache_memory_bytes" in plan.fix


def test_util_above_free_memory_is_left_to_the_runtime():
    _, plan = _plan({"gpu_memory_utilization": 1.0})
    assert plan.fits and any("Free memory on device" in n for n in plan.notes)


def test_moe_and_quantized_plans():
    _, mixtral = _plan({"tensor_parallel_size": 2}, load_model("mixtral-8x7b"), get_gpu("H100-80GB"))
    assert mixtral.fits and 43 < mixtral.memory.weights < 44
    _, fp8 = _plan({"quantization": "fp8"}, load_model("llama-3.1-8b"), get_gpu("H100-80GB"))
    _, bf16 = _plan({}, load_model("llama-3.1-8b"), get_gpu("H100-80GB"))
    assert 8 < fp8.memory.weights < 9 < 14 < bf16.memory.weights and fp8.kv_cache_tokens > bf16.kv_cache_tokens
    with pytest.raises(SpecError, match="quantization"):
        resolve_engine_config({"quantization": "awq"}, load_model("llama-3.1-8b"), get_gpu("H100-80GB"))


def test_startup_time_shape():
    _, graphs = _plan({"max_num_seqs": 64})
    _, eager = _plan({"max_num_seqs": 64, "enforce_eager": True})
    _, tp2 = _plan({"max_num_seqs": 64, "tensor_parallel_size": 2})
    cold = plan_memory(TEST_MODEL, H200, resolve_engine_config({"max_num_seqs": 64}, TEST_MODEL, H200), cold_start=True)
    assert 55 < eager.startup_s < graphs.startup_s < tp2.startup_s
    assert 100 < cold.startup_s < 125  # README: 113 s on a fresh host


def test_to_json_keys():
    _, plan = _plan({"gpu_memory_utilization": 0.5})
    doc = plan.to_json()
    assert {"fits", "failure", "kv_cache_tokens", "num_gpu_blocks", "max_concurrency", "memory_gib"} <= set(doc)
    assert set(doc["memory_gib"]) == {"total", "budget", "weights", "activation_peak", "non_torch", "cudagraph", "kv_cache"}
    assert json.loads(json.dumps(doc)) == doc and doc["failure"] is None
    _, bad = _plan({"gpu_memory_utilization": 0.01})
    assert bad.to_json()["failure"] == "startup_oom"


def test_v1_sampler_profile_sorts_until_017_then_masks_in_place_with_triton():
    """The dummy sampler's peak by version (vllm/v1/sample/ops/topk_topp_sampler.py): the sort path's
    fitted 37.95 B/logit up to 0.16; from 0.17 (the 0.17.0 wheel calls the Triton kernel, 0.16.0's has none),
    for 8 rows or more, four [rows, vocab] tensors (model-dtype logits, fp32 copy, probabilities, noise) plus
    the Triton kernel's 128-row buffer."""
    from servetune.planner.memory import SAMPLER_BYTES_PER_LOGIT_V1, sampler_profile_bytes
    m, g = load_model("llama-3.1-8b"), get_gpu("A100-40GB")
    v = m.vocab_size
    old = resolve_engine_config({}, m, g, "0.16.0")
    new = resolve_engine_config({}, m, g, "0.17.0")
    assert sampler_profile_bytes(m, old, 256) == int(256 * v * SAMPLER_BYTES_PER_LOGIT_V1)
    assert sampler_profile_bytes(m, new, 256) == 256 * v * (2 + 3 * 4) + 128 * v * 4
    assert sampler_profile_bytes(m, new, 8) == 8 * v * 14 + 8 * v * 4  # buffer: next_pow2(min(SMs, rows)) rows
    assert sampler_profile_bytes(m, new, 7) == int(7 * v * SAMPLER_BYTES_PER_LOGIT_V1)  # < 8 rows: PyTorch sort
    # The V2 runner (0.26+) keeps its own estimate.
    assert sampler_profile_bytes(m, resolve_engine_config({}, m, g, "0.26.0"), 256) == 256 * v * 10


def test_the_sampler_rule_moves_the_019_kv_budget_by_what_it_saves():
    """Same flags on 0.16 and 0.19: 0.19's plan has exactly the sampler's saving more KV memory (A100-40GB
    defaults: 256 rows, where the sampler, not the 2048-token forward, sets the activation peak)."""
    from servetune.planner.memory import ACT_FIXED_GIB, sampler_profile_bytes
    m, g = load_model("llama-3.1-8b"), get_gpu("A100-40GB")
    flags = {"max_model_len": 8192}
    c17, c19 = (resolve_engine_config(flags, m, g, v) for v in ("0.16.0", "0.19.1"))
    p17, p19 = plan_memory(m, g, c17), plan_memory(m, g, c19)
    saved = sampler_profile_bytes(m, c17, 256) - sampler_profile_bytes(m, c19, 256)
    assert p19.memory.activation_peak * 2**30 == pytest.approx(ACT_FIXED_GIB * 2**30 + sampler_profile_bytes(m, c19, 256), abs=1)
    assert (p19.memory.kv_cache - p17.memory.kv_cache) * 2**30 == pytest.approx(saved, abs=2)
    assert saved / 2**30 > 0.6


def test_027_charges_the_v2_runners_penalty_state_to_the_kv_budget():
    """0.27+ ``memory_profiling`` charges total_consumed (vllm/utils/mem_utils.py), so the V2 runner's
    output_bin_counts [max_num_seqs, vocab] int32 and prompt_bin_mask [max_num_seqs, vocab/32] int32
    leave the KV budget; 0.26 never saw them."""
    from servetune.planner.memory import persistent_runner_bytes
    m, g = load_model("llama-3.1-8b"), get_gpu("L40S")
    flags = {"max_model_len": 8192, "max_num_seqs": 128}
    c26, c27 = (resolve_engine_config(flags, m, g, v) for v in ("0.26.0", "0.27.0"))
    want = 128 * (m.vocab_size + -(-m.vocab_size // 32)) * 4
    assert persistent_runner_bytes(m, c26) == 0 and persistent_runner_bytes(m, c27) == want
    p26, p27 = plan_memory(m, g, c26), plan_memory(m, g, c27)
    assert (p26.memory.kv_cache - p27.memory.kv_cache) * 2**30 == pytest.approx(want, abs=2)
    assert (p27.memory.non_torch - p26.memory.non_torch) * 2**30 == pytest.approx(want, abs=2)
    # kv_cache_memory_bytes skips profiling: nothing is charged.
    fixed = resolve_engine_config({**flags, "kv_cache_memory_bytes": 8 << 30}, m, g, "0.27.0")
    assert persistent_runner_bytes(m, fixed) == 0


def test_027_charges_the_v1_runners_inputs_embeds_to_the_kv_budget():
    """The V1 runner is built after the init snapshot (v1/worker/gpu_worker.py line 423 of 0.27.0, 438 of 0.28.0)
    and keeps inputs_embeds [max_num_batched_tokens, hidden] in the model dtype for every model
    (v1/worker/gpu_model_runner.py line 798 of 0.27.0): 0.27+'s total_consumed charges it, 0.26's sum does not,
    and the V2 runner (dense models) allocates no such buffer."""
    from servetune.planner.memory import persistent_runner_bytes
    m, g = load_model("qwen3-30b-a3b"), get_gpu("H100-80GB")  # MoE: the V1 runner at 0.26-0.28
    flags = {"max_model_len": 8192, "max_num_batched_tokens": 8192}
    c26, c27, c28 = (resolve_engine_config(flags, m, g, v) for v in ("0.26.0", "0.27.0", "0.28.0"))
    assert not c27.rules.v2_runner and not c28.rules.v2_runner
    want = 8192 * m.hidden_size * 2
    assert persistent_runner_bytes(m, c26) == 0
    assert persistent_runner_bytes(m, c27) == persistent_runner_bytes(m, c28) == want
    p26, p27 = plan_memory(m, g, c26), plan_memory(m, g, c27)
    assert (p27.memory.non_torch - p26.memory.non_torch) * 2**30 == pytest.approx(want, abs=2)
    dense = load_model("llama-3.1-8b")  # the V2 runner: its sampler state, not this buffer
    cd = resolve_engine_config({"max_model_len": 8192, "max_num_seqs": 128}, dense, g, "0.28.0")
    assert cd.rules.v2_runner
    assert persistent_runner_bytes(dense, cd) == 128 * (dense.vocab_size + -(-dense.vocab_size // 32)) * 4


def test_v1_sampler_warm_up_after_graph_capture_must_fit_what_is_left():
    """vLLM's V1 runner re-runs the dummy sampler after CUDA-graph capture (compile_or_warm_up_model), outside the
    profiled budget: at 0.99 on 0.19 the graphs eat the 1% headroom, so the sampler's fp32 tensors no longer fit.
    vLLM raises "CUDA out of memory occurred when warming up sampler with N dummy requests" (cudagraph_oom)."""
    model, h100 = load_model("llama-3.1-8b"), get_gpu("H100-80GB")
    config, plan = _plan({"gpu_memory_utilization": 0.99}, model, h100, "0.19.0")
    rows = min(config.max_num_seqs, config.max_num_batched_tokens)
    assert plan.failure is TrialStatus.CUDAGRAPH_OOM and plan.kv_cache_tokens == 0
    assert f"warming up sampler with {rows} dummy requests" in plan.cause and plan.cause.startswith("RuntimeError")
    # the fix it names starts, and so does eager (no graphs); fewer rows help once the forward, not the sampler,
    # sets the profiled peak (at 1,024 rows the KV budget grows by whatever the warm-up would save)
    assert plan.fix.startswith("fails in the sampler warm-up after CUDA-graph capture (1024 rows: 0.41 GiB short of "
                               "its 1.77 GiB): ")
    util = float(re.search(r"gpu_memory_utilization to <= ([\d.]+)", plan.fix).group(1))
    assert util == 0.96 and "enforce_eager" in plan.fix
    fixed = _plan({"gpu_memory_utilization": util}, model, h100, "0.19.0")[1]
    assert fixed.fits and not fixed.warmup_at_risk  # the fix leaves the measured band's 1.89 GiB too
    # no max_num_seqs keeps the band; the largest that passes vLLM's count is named, warned (re-planned here)
    seqs = int(re.search(r"lower max_num_seqs to <= (\d+) \(it then fits by vLLM's count", plan.fix).group(1))
    assert seqs == 319
    at, over = (_plan({"gpu_memory_utilization": 0.99, "max_num_seqs": n}, model, h100, "0.19.0")[1]
                for n in (seqs, seqs + 1))
    assert at.fits and at.warmup_at_risk and over.failure is TrialStatus.CUDAGRAPH_OOM
    assert _plan({"gpu_memory_utilization": 0.99, "max_num_seqs": 256}, model, h100, "0.19.0")[1].fits
    # 0.26 runs this dense model on the V2 runner, which warms up with real steps: not this failure
    assert _plan({"gpu_memory_utilization": 0.99}, model, h100, "0.26.0")[1].failure is not TrialStatus.CUDAGRAPH_OOM
    # eager: no graphs, the headroom holds the warm-up
    assert _plan({"gpu_memory_utilization": 0.99, "enforce_eager": True}, model, h100, "0.19.0")[1].fits
