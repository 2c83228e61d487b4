"""A real tune of FP8 weights on one H100 SXM (vLLM 0.26.0, 2026-12-07), kept as evidence and rechecked in CI.

``real_h100_classes/2026-12-07_l8b_fp8_tune`` (its README): `servetune tune
benchmarks/real_vllm/h100_l8b_fp8_tune.yaml`, the Llama-3.1-8B shape with its weights quantized to FP8
at load (``quantization: fp8``) from random bf16 weights vLLM built (``load_format: dummy``), the memory
pair, three trials (the informed start, vLLM's defaults, one TPE proposal). The planner and the simulator
were never fitted on these starts: their figures here were fixed before the run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from servetune.engines import TrialTask, run_trial
from servetune.engines.vllm.logs import parse_log
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.records import dataset

from _real_tune import informed_then_defaults, recommended_command, server_log, shipped_spec, tune_rows, tune_study

TUNE = Path(__file__).parent / "fixtures" / "real_h100_classes" / "2026-12-07_l8b_fp8_tune"
SPEC = Path(__file__).parents[1] / "benchmarks" / "real_vllm" / "h100_l8b_fp8_tune.yaml"
MODEL, GPU = load_model("llama-3.1-8b"), get_gpu("H100-80GB")
ROWS = tune_rows(TUNE)

#: The spec that ran, with the host's model folder read as the shipped config it was copied from.
SPEC_RAN = shipped_spec(SPEC, "llama-3.1-8b")


def test_the_study_served_three_fp8_trials_on_random_weights_and_recommends_the_checkpoint() -> None:
    assert [t.user_attrs["status"] for t in tune_study(TUNE, "h100-l8b-fp8-tune").trials] == ["ok", "ok", "ok"]
    assert [(r["origin"], r["completed"], r["preemptions"]) for r in ROWS] == [
        ("informed", 512, 0), ("baseline", 512, 0), ("sampler", 512, 0)]
    assert {(r["flag_quantization"], r["flag_load_format"]) for r in ROWS} == {("fp8", "dummy")}
    for row in ROWS:
        log = server_log(TUNE, dataset.row_trial_dir_name(row))
        assert "quantization=fp8" in log and "load_format=dummy" in log
        assert parse_log(log).weights_gib == pytest.approx(8.54)  # FP8 linear layers, bf16 embeddings and head
    log = (TUNE / "study.log").read_text()
    command = recommended_command(TUNE)
    assert command == ("vllm serve /root/l8 --max-model-len 4096 --quantization fp8 "
                       "--gpu-memory-utilization 0.9 --max-num-seqs 512")
    assert "ran on random weights (load_format: dummy)" in log


def test_the_first_trial_is_the_informed_start_and_the_second_vllms_defaults() -> None:
    planned, first, baseline = informed_then_defaults(SPEC_RAN, MODEL, GPU, ROWS)
    assert planned == first == {"gpu_memory_utilization": 0.95, "max_num_seqs": 256}
    assert baseline == {"gpu_memory_utilization": 0.9, "max_num_seqs": 512}


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['trial_number']}-{r['origin']}")
def test_each_start_matches_its_log_and_the_planner_held_out(row: dict) -> None:
    """The planner's KV, recorded by the study before each start (536,256, 505,760 and 341,632 tokens),
    against vLLM's 535,072, 505,920 and 340,480: +0.22%, -0.03%, +0.34%. The second start found the
    first's compile cache (its smaller activation peak, 0.73 GiB against 1.13, was planned); planned
    without that knowledge it is -0.42%."""
    parsed = parse_log(server_log(TUNE, dataset.row_trial_dir_name(row)))
    assert parsed.kv_cache_tokens == row["kv_cache_tokens"]
    trial = tune_study(TUNE, "h100-l8b-fp8-tune").trials[int(row["trial_number"])]
    recorded = trial.user_attrs["predicted_kv_cache_tokens"]
    assert abs(recorded / row["kv_cache_tokens"] - 1) < 0.004
    cold = plan_memory(MODEL, GPU, resolve_engine_config(dataset.row_flags(row), MODEL, GPU, "0.26.0"))
    assert abs(cold.kv_cache_tokens / row["kv_cache_tokens"] - 1) < 0.005
    assert parsed.compile_cache_hit == (row["origin"] == "baseline")


def test_the_simulator_predicts_each_trial_out_of_sample() -> None:
    """Simulated 7,368 output tok/s for the first two (256 clients fill neither 256 nor 512 sequences)
    and 7,035 for the third (189 sequences) against 7,334, 7,385 and 6,691 real: +0.5%, -0.2%, +5.1%,
    none preempting, as real. The real pair of the first two differ by 0.7%, within a window's noise;
    the simulator calls them equal, so the recommendation between them is a coin toss either way."""
    spec = SPEC_RAN
    workload = spec.workload
    simulated = []
    for row in ROWS:
        sim = run_trial(TrialTask("llama-3.1-8b", "H100-80GB", dataset.row_flags(row), workload,
                                  vllm_version=spec.vllm_version), "sim")
        assert sim.ok and sim.preemptions == 0 and sim.output_throughput is not None
        simulated.append(sim.output_throughput)
    real = [row["output_throughput"] for row in ROWS]
    assert max(abs(s / r - 1) for s, r in zip(simulated, real)) < 0.06
    # The TPE proposal, 189 sequences for 256 clients, is the slowest of the three, real and simulated.
    assert simulated[2] < min(simulated[:2]) and real[2] < min(real[:2])
