"""A real tune of a sliding-window model on one H100 SXM (vLLM 0.26.0, 2026-12-07), kept as evidence and
rechecked in CI.

``real_h100_classes/2026-12-07_g2_tune`` (the folder's README): `servetune tune
benchmarks/real_vllm/h100_g2_tune.yaml`, the gemma-2-27b shape (46 layers alternating 4,096-token sliding
window and global attention, logit soft-capping) with random bf16 weights vLLM built at load
(``load_format: dummy``), the memory pair, 1,024-token prompts and 256 outputs at 64 in flight. Three trials:
the informed start (0.95, 48 sequences) served without preempting; the second informed start (0.95, 54)
preempted and was stopped at it; vLLM's defaults (0.9, 512) were pruned before launch by the simulator
screen (40 preemptions predicted). The planner's and the simulator's figures for the first trial and the
defaults were fixed in the spec before the run. Right after the tune the same host ran the two flag sets
the tune did not measure whole (``2026-12-07_g2_u09_s512``, ``2026-12-07_g2_u095_s54``), judged in
``tests/planner/test_real_h100_classes.py`` and ``tests/sim/test_h100_classes_sim.py``; here they check the
tune's two decisions that rest on a prediction: the preemption bound and the screen's pruning.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from servetune.engines import TrialTask, run_trial
from servetune.engines.vllm.logs import parse_log
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.records import dataset
from servetune.search.informed import informed_starts

from _real_tune import recommended_command, server_log, shipped_spec, tune_rows, tune_study

FIXTURES = Path(__file__).parent / "fixtures" / "real_h100_classes"
TUNE = FIXTURES / "2026-12-07_g2_tune"
SPEC = Path(__file__).parents[1] / "benchmarks" / "real_vllm" / "h100_g2_tune.yaml"
MODEL, GPU = load_model("gemma-2-27b"), get_gpu("H100-80GB")
#: The study's rows by trial number (the pruned trial, vLLM's defaults, was written first).
ROWS = {int(r["trial_number"]): r for r in tune_rows(TUNE)}

#: The spec that ran, with the host's model folder read as the shipped config it was copied from.
SPEC_RAN = shipped_spec(SPEC, "gemma-2-27b")


def _preemptions_in_window(start: str) -> float:
    """``vllm:num_preemptions_total`` over a collection start's window (its /metrics after less before)."""
    window = FIXTURES / start / "p1024_o256_c64"

    def counter(name: str) -> float:
        text = gzip.decompress((window / name).read_bytes()).decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_preemptions_total{"))
    return counter("metrics_after.txt.gz") - counter("metrics_before.txt.gz")


def test_the_study_served_the_informed_start_and_recommends_it() -> None:
    study = tune_study(TUNE, "h100-g2-tune")
    assert [t.user_attrs["status"] for t in study.trials] == ["ok", "ok", "pruned"]
    assert [(ROWS[n]["origin"], ROWS[n]["status"]) for n in range(3)] == [
        ("informed", "ok"), ("informed", "ok"), ("baseline", "pruned")]
    assert (ROWS[0]["completed"], ROWS[0]["preemptions"]) == (192, 0)
    # The second informed start preempted and was stopped there: infeasible under max_preemptions 0.
    assert ROWS[1]["preemptions"] > 0 and study.trials[1].constraints["preemptions"] > 0
    assert recommended_command(TUNE) == ("vllm serve /root/g2 --max-model-len 4096 --gpu-memory-utilization 0.95 "
                                         "--max-num-seqs 48")
    assert "ran on random weights (load_format: dummy)" in (TUNE / "study.log").read_text()


def test_the_informed_starts_sit_on_the_preemption_bound_and_the_real_starts_agree() -> None:
    """The planner's bound: 48 sequences of 1,280 tokens fit 62,326 planned KV tokens at 0.95 (each
    request holds two 16-token blocks per 16 tokens, one per KV group); 54 do not. Real: 48 served 192
    requests without a preemption; 54 preempted in the tune and 15 times in a whole window."""
    spec = SPEC_RAN
    starts = informed_starts(spec.search_space, spec.fixed_flags, MODEL, GPU, spec.workload, spec.vllm_version)
    assert starts[:2] == [{"gpu_memory_utilization": 0.95, "max_num_seqs": 48},
                          {"gpu_memory_utilization": 0.95, "max_num_seqs": 54}]
    for n, start in enumerate(starts[:2]):
        assert (ROWS[n]["flag_gpu_memory_utilization"], ROWS[n]["flag_max_num_seqs"]) == tuple(start.values())
    assert ROWS[0]["preemptions"] == 0 < ROWS[1]["preemptions"]
    assert _preemptions_in_window("2026-12-07_g2_u095_s54") == 15


@pytest.mark.parametrize("number", [0, 1])
def test_each_start_matches_its_log_and_the_planner_held_out(number: int) -> None:
    """The planner's KV, recorded by the study before each start (62,326 tokens), against vLLM's 62,390:
    -0.10% for both (both compiled cold: their CUDA-graph sizes differ); 50.72 GiB of weights logged."""
    row = ROWS[number]
    parsed = parse_log(server_log(TUNE, dataset.row_trial_dir_name(row)))
    assert parsed.kv_cache_tokens == row["kv_cache_tokens"] == 62390
    assert parsed.weights_gib == pytest.approx(50.72) and parsed.compile_cache_hit is False
    recorded = tune_study(TUNE, "h100-g2-tune").trials[number].user_attrs["predicted_kv_cache_tokens"]
    assert abs(recorded / row["kv_cache_tokens"] - 1) < 0.002
    cold = plan_memory(MODEL, GPU, resolve_engine_config(dataset.row_flags(row), MODEL, GPU, "0.26.0"))
    assert cold.kv_cache_tokens == recorded


def test_the_simulator_predicts_the_served_trial_out_of_sample() -> None:
    """Fixed in the spec before the run: 1,064 output tok/s, no preemption; real 1,124 (-5.3%), none."""
    row = ROWS[0]
    sim = run_trial(TrialTask("gemma-2-27b", "H100-80GB", dataset.row_flags(row), SPEC_RAN.workload,
                              vllm_version=SPEC_RAN.vllm_version), "sim")
    assert sim.ok and sim.preemptions == 0 and sim.output_throughput is not None
    assert abs(sim.output_throughput / row["output_throughput"] - 1) < 0.08


def test_the_screen_pruned_flags_that_preempt_when_run() -> None:
    """The screen pruned vLLM's defaults on 40 predicted preemptions (the spec's figures: 50,613 KV tokens at
    vLLM's 1,024 sequences, 51,068 at the space's 512). Run after the tune with the same workload, that start
    logged 51,132 KV tokens (-0.13%) and preempted 34 times: pruning it cost the study nothing it wanted."""
    study = tune_study(TUNE, "h100-g2-tune")
    predicted = study.trials[2].user_attrs["sim_prediction"]
    assert predicted["preemptions"] == 40 and study.trials[2].user_attrs["predicted_kv_cache_tokens"] == 51068
    start = FIXTURES / "2026-12-07_g2_u09_s512"
    parsed = parse_log(gzip.decompress((start / "server.log.gz").read_bytes()).decode())
    assert parsed.kv_cache_tokens == 51132
    assert _preemptions_in_window("2026-12-07_g2_u09_s512") == 34
