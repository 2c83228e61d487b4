"""A real tune on one H100 SXM (vLLM 0.26.0, 2026-12-05), kept as evidence and rechecked in CI.

``real_h100_study/study_l8b_tune`` (its README): `servetune tune benchmarks/real_vllm/h100_l8b_tune.yaml`,
the Llama-3.1-8B shape with random bf16 weights on a fresh host, the memory pair, four trials: the
informed start, vLLM's defaults, one proposal served and one the simulator screen pruned; the
winner confirmed on its own start, then measured at its predicted headroom edge on the real engine
before the command's time limit interrupted the study. What the study decided is checked here
against its records; servetune's overhead per trial is printed by ``benchmarks/real_overhead.py``.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import optuna
import pytest
import yaml

from real_overhead import STUDIES, trial_overheads
from servetune.engines.vllm.logs import classify, parse_log
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.records import dataset
from servetune.result import TrialResult, TrialStatus
from servetune.search.confirm import choose, confirm
from servetune.search.informed import informed_starts
from servetune.search.screen import SimScreen
from servetune.spec.schema import StudySpec

TUNE = Path(__file__).parent / "fixtures" / "real_h100_study" / "study_l8b_tune"
SPEC = Path(__file__).parents[1] / "benchmarks" / "real_vllm" / "h100_l8b_tune.yaml"
MODEL, GPU = load_model("llama-3.1-8b"), get_gpu("H100-80GB")
ROWS = dataset.read_trials(TUNE / "dataset").sort_values("timestamp").to_dict("records")


def _started(row: dict) -> bool:
    """The row started vLLM (a same-start repeat and a screened proposal have no dispatch of their own)."""
    return row["dispatch_s"] == row["dispatch_s"] and row["dispatch_s"] is not None  # not NaN


STARTS = [r for r in ROWS if _started(r)]


def _log(folder: str) -> str:
    return gzip.decompress((TUNE / "trials" / folder / "server.log.gz").read_bytes()).decode()


def _study() -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name="h100-l8b-tune", storage=f"sqlite:///{TUNE / 'optuna.db'}")


def _spec() -> StudySpec:
    """The spec that ran, with the host's model folder read as the shipped config of its shape."""
    data = yaml.safe_load(SPEC.read_text())
    data["model"] = "llama-3.1-8b"
    del data["serve_model"]
    return StudySpec.from_dict(data, SPEC.parent)


def test_the_study_recorded_four_trials_three_served_one_screened() -> None:
    study = _study()
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 4
    assert [t.user_attrs["status"] for t in study.trials] == ["ok", "ok", "ok", "pruned"]
    assert [r["origin"] for r in ROWS] == ["informed", "repeat", "baseline", "sampler", "sampler"]
    assert [(r["trial_number"], r["status"]) for r in STARTS] == [(0, "ok"), (1, "ok"), (2, "ok")]
    assert all(r["preemptions"] == 0 and r["completed"] == 512 for r in ROWS if r["status"] == "ok")
    # Every started trial left its server log; the screened one started nothing.
    assert sorted(p.name for p in (TUNE / "trials").iterdir()) == ["0000", "0000-edge", "0000-repeat-1", "0001", "0002"]
    for folder in ("0000", "0001", "0002", "0000-edge"):
        assert classify(_log(folder), exit_code=None, healthy=True).status is TrialStatus.OK
    log = (TUNE / "study.log").read_text()
    assert "(vllm backend)" in log and "servetune: interrupted" in log
    runs = (TUNE / "mlflow_runs.txt").read_text()
    assert runs.count("status=FINISHED  servetune.status=ok") == 4  # three trials and the repeat
    assert runs.count("status=FAILED  servetune.status=pruned") == 1 and "6 MLflow runs" in runs


def test_the_first_trial_is_the_informed_start_and_the_second_vllms_defaults() -> None:
    spec = _spec()
    starts = informed_starts(spec.search_space, spec.fixed_flags, MODEL, GPU, spec.workload, spec.vllm_version)
    first, baseline = STARTS[0], STARTS[1]
    assert first["origin"] == "informed" and baseline["origin"] == "baseline"
    assert starts[0] == {"gpu_memory_utilization": first["flag_gpu_memory_utilization"],
                         "max_num_seqs": int(first["flag_max_num_seqs"])} == {"gpu_memory_utilization": 0.95,
                                                                               "max_num_seqs": 256}
    assert (baseline["flag_gpu_memory_utilization"], baseline["flag_max_num_seqs"]) == (0.9, 512)


def test_the_pruned_trial_is_the_screen_rule_on_the_recorded_prediction() -> None:
    """Trial 3 (0.7 x 104) was screened, not started: the simulator said 4,536 tok/s, the calibration
    of the three served trials (median real / sim 1.05, which the winner's headroom records) made it
    4,767, at most 5,482 with the 15% margin the three agreeing points allow, below the best 5,642."""
    study = _study()
    pruned = study.trials[3]
    row = next(r for r in ROWS if r["trial_number"] == 3)
    assert row["outcome"] == "screened" and not _started(row) and row["cause"] == row["sim_screen"]
    predicted = pruned.user_attrs["sim_prediction"]["output_throughput"]
    calibration = json.loads((TUNE / "headroom.json").read_text())["winner"]["calibration"]
    assert calibration["real_trials"] == 3
    # The sampler's proposal before it (trial 2) passed the screen: with it seen, the share bound
    # (SimScreen.max_share) allows this one to be screened.
    screen = SimScreen(max_preemptions=0, num_requests=512, throughput_objective=True, seen=1,
                       ratios=[calibration["real_over_sim_throughput"]] * calibration["real_trials"])
    best = max(r["output_throughput"] for r in STARTS)
    verdict = screen.verdict(TrialResult(TrialStatus.OK, output_throughput=predicted, preemptions=0), best=best)
    assert verdict == row["cause"]
    assert verdict.startswith("sim_screen: throughput 4767 tok/s predicted (sim 4536 x 1.05), at most 5482")


def test_the_winner_was_confirmed_on_its_own_start_and_measured_at_its_edge() -> None:
    runs = [r for r in ROWS if r["trial_number"] == 0]
    assert [r["origin"] for r in runs] == ["informed", "repeat"]
    c = confirm(0, dataset.row_flags(runs[0]), [r["output_throughput"] for r in runs],
                [r["preemptions"] == 0 for r in runs])
    log = (TUNE / "study.log").read_text()
    assert f"servetune: confirmed trial #0: {c.mean:,.0f} +- {c.half_width:,.0f} (95% CI) over 2 runs" in log
    others = [confirm(r["trial_number"], dataset.row_flags(r), [r["output_throughput"]], [True]) for r in STARTS[1:]]
    assert choose([c, *others]).winner.trial_number == 0 and "winner on confirmed figures: trial #0" in log
    # The headroom search put the winner's preemption edge at 1.68x the prompt length (1.54x the
    # last clean point); the real engine, started again at the winner's flags, preempted there.
    edge = json.loads((TUNE / "headroom.json").read_text())["edge_window"]
    assert (edge["axis"], edge["scale"], edge["criterion"], edge["confirmed"]) == ("prompt_len", 1.6818,
                                                                                   "preemptions", True)
    assert edge["metrics"]["preemptions"] > 0
    # That start loaded trial 0's compiled graphs: a smaller profiled peak, 484,272 KV tokens against
    # 482,400; the planner, told the cache was warm, 484,944 (+0.14%).
    parsed = parse_log(_log("0000-edge"))
    assert parsed.compile_cache_hit and parsed.kv_cache_tokens > runs[0]["kv_cache_tokens"]
    plan = plan_memory(MODEL, GPU, resolve_engine_config(dataset.row_flags(runs[0]), MODEL, GPU, "0.26.0"),
                       compile_cache_warm=True)
    assert abs(plan.kv_cache_tokens - parsed.kv_cache_tokens) / parsed.kv_cache_tokens < 0.003


@pytest.mark.parametrize("row", STARTS, ids=lambda r: f"{r['trial_number']}-{r['origin']}")
def test_each_start_matches_its_log_and_the_planner_held_out(row: dict) -> None:
    """KV capacity from the log, and the planner (never fitted on these starts) within 0.3%: at the
    time of the run it said 483,008, 452,512 and 288,384 against vLLM's 482,400, 451,840, 287,808."""
    parsed = parse_log(_log(dataset.row_trial_dir_name(row)))
    assert parsed.kv_cache_tokens == row["kv_cache_tokens"]
    assert bool(parsed.compile_cache_hit) == bool(row["compile_cache_hit"])
    flags = dataset.row_flags(row)
    plan = plan_memory(MODEL, GPU, resolve_engine_config(flags, MODEL, GPU, "0.26.0"),
                       compile_cache_warm=bool(row["compile_cache_hit"]))
    assert abs(plan.kv_cache_tokens - row["kv_cache_tokens"]) / row["kv_cache_tokens"] < 0.003
    recorded = _study().trials[int(row["trial_number"])].user_attrs["predicted_kv_cache_tokens"]
    assert abs(recorded - row["kv_cache_tokens"]) / row["kv_cache_tokens"] < 0.003


def test_the_overhead_benchmark_reads_the_drivers_own_overhead() -> None:
    """benchmarks/real_overhead.py's overhead per trial (dispatch - startup - window - the repeat
    measured on the trial's own start) is the driver's recorded ``overhead_s`` of each trial."""
    assert STUDIES["h100"].path == TUNE / "dataset"
    trials = trial_overheads(ROWS)
    assert [t.trial for t in trials] == [0, 1, 2]
    assert [t.repeats_s > 0 for t in trials] == [True, False, False]
    for t, row in zip(trials, STARTS):
        assert t.overhead_s == pytest.approx(row["overhead_s"], abs=0.01)
