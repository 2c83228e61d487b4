"""The 14B recorded landscape on one H200 (vLLM 0.26.0), kept as evidence and rechecked in CI.

``study_q14b``: `servetune tune benchmarks/real_vllm/h200_q14b_grid.yaml` (then ``--resume``) on
two hosts (both 2026-12-02): a random-weight Qwen2.5-14B-shaped model with a tokenizer
covering its vocabulary, the 8B grid's workload (1024-token prompts, 256-token outputs, 512
requests at 256 in flight) over gpu_memory_utilization {0.5, 0.9} x max_num_seqs {128, 256} x
max_num_batched_tokens {2048, 8192}, every cell launched. The first host measured trials 0-5
(trial 2 was cut by a command's deadline: told FAIL, no figures); the second host's ``--resume``
measured trial 2's cell again (trial 6, re-queued) and the last two cells (7, 8). Neither the
planner nor the simulator was fitted on any of these starts (the planner's
COLD_COMPILE_FLOOR_TENSORS was read off the earlier 14B scale runs' cold peaks).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import optuna
import pytest

from servetune.engines.vllm.logs import parse_log
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.records import dataset
from servetune.search.propose import compile_cache_warm

STUDY = Path(__file__).parent / "fixtures" / "real_h200" / "study_q14b"
MODEL, GPU = load_model("qwen2.5-14b"), get_gpu("H200")
ROWS = dataset.read_trials(STUDY / "dataset").sort_values("timestamp").to_dict("records")
#: The host each trial ran on (a compile cache is the host's): a fresh host (the one of
#: scale/l8b_fv_u09_s256_mbt8192_dec) from trial 6 on.
HOST_OF = {n: 1 if n <= 5 else 2 for n in range(9)}


def _cell(row: dict) -> tuple[float, int, int]:
    return (row["flag_gpu_memory_utilization"], int(row["flag_max_num_seqs"]), int(row["flag_max_num_batched_tokens"]))


def test_every_cell_was_measured_and_only_util_05_with_256_seqs_preempts():
    grid = {(u, s, m) for u in (0.5, 0.9) for s in (128, 256) for m in (2048, 8192)}
    assert {_cell(r) for r in ROWS} == grid and len(ROWS) == 8  # each cell once
    assert all(r["status"] == "ok" and r["completed"] == 512 and r["origin"] != "repeat" for r in ROWS)
    assert {_cell(r) for r in ROWS if r["preemptions"] > 0} == {(0.5, 256, 2048), (0.5, 256, 8192)}
    best = max((r for r in ROWS if r["preemptions"] == 0), key=lambda r: r["output_throughput"])
    assert _cell(best) == (0.9, 256, 8192)


def test_the_cell_an_interrupt_cut_was_measured_on_resume(tmp_path):
    """Trial 2 was cut when the collecting command reached its time limit (FAIL, no status stored);
    `--resume`, on a fresh H200 machine, re-queued its params (study._open.recover_interrupted), and
    trial 6 measured them."""
    shutil.copy(STUDY / "optuna.db", tmp_path / "optuna.db")
    study = optuna.load_study(study_name="h200-q14b-grid", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    cut = study.trials[2]
    assert cut.state is optuna.trial.TrialState.FAIL and "status" not in cut.user_attrs
    again = study.trials[6]
    assert again.user_attrs["requeued_from"] == 2 and again.params == cut.params
    assert again.state is optuna.trial.TrialState.COMPLETE


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"trial-{r['trial_number']}")
def test_each_trial_log_gives_what_the_study_recorded(row):
    parsed = parse_log((STUDY / "grid" / dataset.row_trial_dir_name(row) / "server.log").read_text())
    assert parsed.kv_cache_tokens == row["kv_cache_tokens"]
    assert parsed.activation_peak_gib == pytest.approx(row["mem_activation_peak_gib"])


def test_the_planner_with_the_pre_screens_compile_cache_rule_on_starts_it_never_saw(tmp_path):
    """search.propose.compile_cache_warm replayed in the real order (the trials finished before
    each start on the same host) says which starts compiled, as each log's compile-cache line and
    peak show (1.49-1.61 GiB cold, 0.25-0.90 warm), and the planner with that verdict is within
    0.4% of every KV capacity vLLM logged: held out, 8 of 8. Trial 7 (0.9, 128, 2048) is trial 5's
    compile key, but trial 5 ran on the other host: cold, as its log says."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    shutil.copy(STUDY / "optuna.db", tmp_path / "optuna.db")
    study = optuna.load_study(study_name="h200-q14b-grid", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    trials = sorted(study.trials, key=lambda t: t.datetime_start)
    by_number = {int(r["trial_number"]): r for r in ROWS}
    verdicts = {}
    for trial in trials:
        if trial.number not in by_number:  # trial 2: cut off by the command's deadline while starting
            assert trial.state is optuna.trial.TrialState.FAIL
            continue
        replay = optuna.create_study(direction="maximize")
        replay.add_trials([t for t in trials if HOST_OF[t.number] == HOST_OF[trial.number]
                           and t.datetime_complete and t.datetime_complete < trial.datetime_start])
        warm = compile_cache_warm(replay, trial.user_attrs["flags"], MODEL, GPU, "0.26.0")
        row = by_number[trial.number]
        assert (row["compile_cache_hit"] == 1) == warm, trial.number
        assert (row["mem_activation_peak_gib"] > 1.2) == (not warm), trial.number
        plan = plan_memory(MODEL, GPU, resolve_engine_config(trial.user_attrs["flags"], MODEL, GPU),
                           compile_cache_warm=warm)
        assert abs(plan.kv_cache_tokens - row["kv_cache_tokens"]) / row["kv_cache_tokens"] < 0.004, trial.number
        verdicts[trial.number] = warm
    assert len(verdicts) == 8 and sorted(n for n, w in verdicts.items() if not w) == [0, 3, 5, 6, 7]
