"""A real servetune study on the H200 (vLLM 0.26.0, CUDA graphs on), kept as evidence.

`servetune tune benchmarks/real_vllm/h200_study.yaml` ran 4 trials to completion there (a 5th was
stopped by the command's time limit): two preempting, two clean. These tests recheck, in CI, what
that run showed: the log parser reads every real trial log, the planner's KV capacity matches vLLM's
(exactly where vLLM's profiled activation peak is the calibrated 0.44 GiB, and the whole gap is the
activation peak elsewhere), the stored study picks the clean best, and the simulator predicts the
study's trials out of sample.
"""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path

import optuna
import pytest

from servetune.cli import _main as cli
from servetune.engines import TrialTask, run_trial
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.result import TrialStatus
from servetune.engines.vllm.logs import classify, parse_log
from servetune.workload import Workload

STUDY = Path(__file__).parent / "fixtures" / "real_h200" / "study_memory_pair"
WORKLOAD = Workload.from_dict({"input_len": 1024, "output_len": 256, "num_requests": 256, "concurrency": 64,
                               "warmup_requests": 2})
#: Trial -> (gpu_memory_utilization, max_num_seqs, output tok/s, preemptions) from mlflow_runs.txt.
MEASURED = {0: (0.03, 128, 14219, 45), 1: (0.02, 128, 5739, 47), 2: (0.05, 128, 18137, 0), 3: (0.05, 64, 16790, 0)}


def _log(n: int) -> str:
    return (STUDY / f"trial_{n:04d}.server.log").read_text()


def _flags(text: str) -> dict:
    args = parse_log(text).non_default_args or {}
    return {k: args[k] for k in ("gpu_memory_utilization", "max_num_seqs", "max_model_len")}


@pytest.mark.parametrize("n", sorted(MEASURED))
def test_each_real_trial_log_parses_and_is_healthy(n: int) -> None:
    text = _log(n)
    parsed = parse_log(text)
    assert classify(text, exit_code=None, healthy=True).status is TrialStatus.OK
    u, seqs, _, _ = MEASURED[n]
    assert _flags(text) == {"gpu_memory_utilization": u, "max_num_seqs": seqs, "max_model_len": 2048}
    assert parsed.vllm_version == "0.26.0" and parsed.kv_cache_tokens and parsed.weights_gib == 1.59


@pytest.mark.parametrize("n", sorted(MEASURED))
def test_planner_matches_vllms_kv_capacity_up_to_the_profiled_activation_peak(n: int) -> None:
    text = _log(n)
    parsed = parse_log(text)
    model, gpu = load_model("servetune-test-850m"), get_gpu("H200")
    plan = plan_memory(model, gpu, resolve_engine_config(_flags(text), model, gpu))
    real = parsed.kv_cache_tokens
    assert real is not None and parsed.activation_peak_gib is not None
    # vLLM prints the activation peak rounded to 0.01 GiB; the rest of the accounting is exact.
    act_gap_gib = plan.memory.activation_peak - parsed.activation_peak_gib
    corrected_blocks = int((plan.memory.kv_cache + act_gap_gib) * 2**30 // plan.kv_bytes_per_token // 16)
    rounding_tokens = 0.01 * 2**30 / plan.kv_bytes_per_token + 16  # one printed 0.01 GiB unit, one block
    assert abs(corrected_blocks * 16 - real) <= rounding_tokens, (corrected_blocks * 16, real)
    if abs(act_gap_gib) < 0.005:  # the profiled peak was the calibrated one: the prediction is exact
        assert abs(plan.kv_cache_tokens - real) / real < 0.001


def test_the_same_flags_profile_different_activation_peaks_across_starts() -> None:
    """Evidence for the planner's one noise source: 0.38 vs 0.44 GiB for identical flags families."""
    peaks = {n: parse_log(_log(n)).activation_peak_gib for n in MEASURED}
    assert set(peaks.values()) == {0.38, 0.44}


def test_the_stored_study_picks_the_clean_best(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    (tmp_path / "optuna.db").write_bytes((STUDY / "optuna.db").read_bytes())
    study = optuna.load_study(study_name="h200-memory-pair", storage=storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 4
    for t in done:
        preempted = t.user_attrs["preemptions"] > 0
        assert (t.constraints["preemptions"] > 0) == preempted
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["best", "h200-memory-pair", "--storage", storage, "--format", "json"]) == 0
    assert json.loads(out.getvalue()) == {"gpu_memory_utilization": 0.05, "max_num_seqs": 128, "max_model_len": 2048}


def test_the_simulator_predicts_the_real_study_out_of_sample() -> None:
    errors = []
    for u, seqs, real_tps, real_pre in MEASURED.values():
        r = run_trial(TrialTask("servetune-test-850m", "H200",
                                {"gpu_memory_utilization": u, "max_num_seqs": seqs, "max_model_len": 2048}, WORKLOAD),
                      "sim")
        assert r.ok and r.output_throughput is not None and r.preemptions is not None
        assert (r.preemptions > 0) == (real_pre > 0)
        errors.append(abs(r.output_throughput - real_tps) / real_tps)
    # Out of sample for every calibration so far. The 0.85B-only one (before the 8B/14B runs): 5.0%,
    # 2.4%, 14.7%, 7.8%; the first fitted on 0.85B, 8B and 14B together: 4.8%, 25.2%, 16.2%, 9.5%
    # (mean 13.9%); the one with the API server's token cost measured from its CPU counter (54 us a
    # token, 2026-12-02): 9.0%, 28.9%, 24.2%, 18.1% (mean 20.1%), all low: this study's server
    # streamed up to 18,137 tok/s, faster than that cost allows (~18.4k at 100% of a core, and the
    # simulated front end queues before it is full). Worse here, better at 8B (README). Run-to-run
    # noise of one flag set on this host is ~7%.
    assert sum(errors) / len(errors) < 0.22 and max(errors) < 0.30


def test_the_study_log_shows_the_real_run() -> None:
    log = (STUDY / "study.log").read_text()
    assert "(vllm backend)" in log
    assert re.search(r"best trial #2: 18,137 output tok/s", log)
