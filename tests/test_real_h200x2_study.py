"""Real servetune studies on the two-H200 host (vLLM 0.26.0), kept as evidence and rechecked in CI.

* ``study_h200x2/grid``: `servetune tune benchmarks/real_vllm/h200x2_grid.yaml`, every point of
  gpu_memory_utilization {0.012, 0.02, 0.03, 0.05} x max_num_seqs {32, 128}, two trials at a time
  (one per GPU), prescreen off: 6 served (3 preempting), 2 real startup failures.
* ``study_h200x2/parallel``: `servetune tune benchmarks/real_vllm/h200x2_parallel.yaml`, a TP=2 and
  a PP=2 trial, each owning both GPUs (the TP x PP = 1 and 4 points refused before launch).
* ``compile_cache``: the same flags started three times on one host: first start, fresh compile
  caches, filled compile caches (benchmarks/real_vllm/compile_cache.py).
* ``d1_loadgen_vs_bench``: servetune's load generator and `vllm bench serve` alternated four times
  on one server (benchmarks/real_vllm/collect.py plan_2026_11_30_h200_d.json; figures: benchmarks/loadgen_agreement.py).

Each trial folder holds the server log, the /metrics text before and after the measured window and
the gauges sampled during it, exactly as the vllm engine wrote them.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd
import pytest

from servetune.records import dataset
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.engines.vllm.metrics import counter, parse_prometheus
from servetune.planner.modelinfo import load_model
from servetune.result import TrialStatus
from servetune.engines.vllm.engine import worker_memory
from servetune.engines.vllm.logs import classify, parse_log

REAL = Path(__file__).parent / "fixtures" / "real_h200"
STUDY = REAL / "study_h200x2"
MODEL, GPU = load_model("servetune-test-850m"), get_gpu("H200")


def _rows(study: str) -> list[dict]:
    df = dataset.read_trials(STUDY / "dataset", study=study)
    return [r for r in df.sort_values("trial_number").to_dict("records")]


def _trial_dir(kind: str, number: int) -> Path:
    return STUDY / kind / f"{number:04d}"


def _metrics(path: Path) -> dict:
    return parse_prometheus(gzip.decompress(path.read_bytes()).decode())


GRID = _rows("h200x2-grid")
PARALLEL = _rows("h200x2-parallel")


def test_the_grid_study_covered_every_point_with_real_startup_failures():
    points = sorted((r["flag_gpu_memory_utilization"], int(r["flag_max_num_seqs"])) for r in GRID)
    assert points == [(u, s) for u in (0.012, 0.02, 0.03, 0.05) for s in (32, 128)]
    status = {(r["flag_gpu_memory_utilization"], int(r["flag_max_num_seqs"])): r["status"] for r in GRID}
    assert sorted(k for k, v in status.items() if v == "startup_oom") == [(0.012, 32), (0.012, 128)]
    assert all(v == "ok" for k, v in status.items() if k[0] != 0.012)


@pytest.mark.parametrize("row", GRID, ids=lambda r: f"trial{r['trial_number']}")
def test_every_grid_trial_log_classifies_and_parses_to_what_the_study_recorded(row):
    log = (_trial_dir("grid", row["trial_number"]) / "server.log").read_text()
    parsed = parse_log(log)
    verdict = classify(log, exit_code=None if row["status"] == "ok" else 1, healthy=row["status"] == "ok")
    assert verdict.status.value == row["status"]
    if row["status"] == "startup_oom":
        assert "No available memory for the cache blocks" in (verdict.cause or "")
        assert any("Available KV cache memory: -0." in e for e in verdict.evidence)
        return
    assert parsed.kv_cache_tokens == row["kv_cache_tokens"]
    assert parsed.compile_cache_hit == bool(row["compile_cache_hit"])


@pytest.mark.parametrize("row", [r for r in GRID if r["status"] == "ok"], ids=lambda r: f"trial{r['trial_number']}")
def test_preemptions_are_the_counter_delta_of_the_kept_metrics_dumps(row):
    folder = _trial_dir("grid", row["trial_number"])
    before, after = _metrics(folder / "metrics_before.txt.gz"), _metrics(folder / "metrics_after.txt.gz")
    delta = counter(after, "vllm:num_preemptions") - (counter(before, "vllm:num_preemptions") or 0)
    assert delta == row["preemptions"]
    # Preemption is where the KV cache holds fewer full sequences (1,280 tokens each) than run at once.
    running = min(int(row["flag_max_num_seqs"]), 64)
    assert (delta > 0) == (row["kv_cache_tokens"] < running * 1280)


def test_the_study_picked_the_fastest_preemption_free_point():
    clean = [r for r in GRID if r["status"] == "ok" and r["preemptions"] == 0]
    best = max(clean, key=lambda r: r["output_throughput"])
    assert (best["flag_gpu_memory_utilization"], int(best["flag_max_num_seqs"])) == (0.03, 32)
    assert "--gpu-memory-utilization 0.03 --max-num-seqs 32" in (STUDY / "study_grid.log").read_text()


def _planner(flags: dict, warm: bool) -> int:
    config = resolve_engine_config(flags, MODEL, GPU, "0.26.0")
    return plan_memory(MODEL, GPU, config, compile_cache_warm=warm).kv_cache_tokens


@pytest.mark.parametrize("row", [r for r in GRID + PARALLEL if r["status"] == "ok"],
                         ids=lambda r: f"{r['study']}-{r['trial_number']}")
def test_the_planner_predicts_every_real_kv_capacity_once_it_knows_the_compile_cache_state(row):
    """The profiled activation peak is 0.44 GiB on a configuration's first start on the node and
    0.38 GiB once its graphs are cached; with that known, every start is predicted within 0.1%."""
    parsed = parse_log((_trial_dir("grid" if row["study"] == "h200x2-grid" else "parallel",
                                   row["trial_number"]) / "server.log").read_text())
    warm = parsed.activation_peak_gib is not None and parsed.activation_peak_gib < 0.4 and \
        parsed.tensor_parallel_size in (None, 1)
    predicted = _planner(dataset.row_flags(row), warm)
    assert abs(predicted - row["kv_cache_tokens"]) / row["kv_cache_tokens"] < 0.001


def test_the_planner_predicted_both_real_startup_failures():
    for row in (r for r in GRID if r["status"] == "startup_oom"):
        config = resolve_engine_config(dataset.row_flags(row), MODEL, GPU, "0.26.0")
        plan = plan_memory(MODEL, GPU, config)
        assert plan.failure is TrialStatus.STARTUP_OOM and plan.cause.startswith("No available memory")


def test_compile_cache_pair_on_one_host_cold_then_warm():
    """Same flags, fresh caches then filled caches: the warm start loads its graphs (compile cache
    hit), profiles the smaller activation peak, and so gets 1,920 more KV tokens."""
    cold = parse_log((REAL / "compile_cache" / "cache_cold.server.log").read_text())
    warm = parse_log((REAL / "compile_cache" / "cache_warm.server.log").read_text())
    assert (cold.compile_cache_hit, warm.compile_cache_hit) == (False, True)
    assert (cold.activation_peak_gib, warm.activation_peak_gib) == (0.44, 0.38)
    assert warm.kv_cache_tokens - cold.kv_cache_tokens == 1_920
    flags = json.loads((REAL / "compile_cache" / "compile_cache.json").read_text())["flags"]
    assert _planner(flags, warm=False) == pytest.approx(cold.kv_cache_tokens, rel=1e-3)
    assert _planner(flags, warm=True) == pytest.approx(warm.kv_cache_tokens, rel=1e-3)


@pytest.mark.parametrize("layout, ranks", [((1, 2), {"PP0", "PP1"}), ((2, 1), {"TP0", "TP1"})])
def test_tp2_and_pp2_trials_recorded_each_gpu(layout, ranks):
    row = next(r for r in PARALLEL if (int(r["flag_tensor_parallel_size"]), int(r["flag_pipeline_parallel_size"])) == layout)
    assert row["status"] == "ok" and row["preemptions"] == 0
    parsed = parse_log((_trial_dir("parallel", row["trial_number"]) / "server.log").read_text())
    per_gpu = worker_memory(parsed)
    assert set(per_gpu) == ranks
    for rank in ranks:  # what the study wrote to MLflow and the dataset, per GPU
        assert row[f"worker_{rank}_weights_gib"] == per_gpu[rank]["weights"]
        assert 0.79 <= per_gpu[rank]["weights"] <= 0.82  # half of the 1.59 GiB model on each GPU
    assert row["gpu0_used_mib_peak"] > 70_000 and row["gpu1_used_mib_peak"] > 70_000  # util 0.5 of 143 GB each
    assert row["kv_cache_tokens"] > 2 * 2_216_528 * 0.99  # about twice TP=1's capacity at the same util


def test_refused_layouts_never_launched():
    refused = [r for r in PARALLEL if r["status"] == "invalid_config"]
    assert len(refused) == 2 and all(pd.isna(r["startup_s"]) for r in refused)  # no server was started


def test_load_generator_agrees_with_vllm_bench_serve_within_3_percent():
    """Four alternated windows each on one real server: the means of the figures users compare
    (output throughput, mean TTFT, TPOT and E2E) agree within 3% (measured: 0.4% each)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("loadgen_agreement", Path(__file__).resolve().parent.parent
                                                  / "benchmarks" / "loadgen_agreement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    figures = module.agreement()
    for name in ("output tok/s", "mean TTFT ms", "mean TPOT ms", "mean E2E ms"):
        assert abs(figures[name][2]) < 0.03, (name, figures[name])


@pytest.mark.parametrize("number, flags", [
    (1, {"gpu_memory_utilization": 0.02, "max_num_seqs": 128, "max_model_len": 2048}),
    (2, {"gpu_memory_utilization": 0.05, "max_num_seqs": 128, "max_model_len": 2048})])
def test_the_earlier_studys_warm_starts_are_predicted_once_warm_is_known(number, flags):
    """study_memory_pair's trials 1 and 2 reused trial 0's compile configuration (max_num_seqs 128):
    the cold model missed them by -9.7% and -1.2%, the warm one is within 0.1%."""
    log = parse_log((REAL / "study_memory_pair" / f"trial_{number:04d}.server.log").read_text())
    assert log.compile_cache_hit is True
    assert _planner(flags, warm=True) == pytest.approx(log.kv_cache_tokens, rel=1e-3)
    assert abs(_planner(flags, warm=False) - log.kv_cache_tokens) / log.kv_cache_tokens > 0.01


def test_the_pre_screens_compile_cache_rule_replayed_in_the_real_grids_order(tmp_path):
    """search.propose.compile_cache_warm, applied as the study applies it: at each trial's start,
    on the trials that had finished by then (from the study's own optuna.db), it says warm or
    cold; the planner with that verdict predicts every served start's KV capacity within 0.1%,
    and the verdict is the peak each log shows, but for trial 3: it started while trial 2 (the
    same configuration, a startup failure) was compiling on the other GPU, recompiled, and still
    profiled the warm peak (Inductor's cache filled under it); the rule, which counts finished
    trials only, says cold there and the planner is 1.2% low. The same rule holds on every start
    of the 8B grid (test_real_h200_l8b_study.py), where a kernel-level rule does not."""
    import shutil

    import optuna

    from servetune.search.propose import compile_cache_warm

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    shutil.copy(STUDY / "optuna.db", tmp_path / "optuna.db")
    real = optuna.load_study(study_name="h200x2-grid", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    trials = sorted(real.trials, key=lambda t: t.datetime_start)
    verdicts = {}
    for trial in trials:
        finished = [t for t in trials if t.datetime_complete < trial.datetime_start]
        replay = optuna.create_study(direction="maximize")
        replay.add_trials(finished)  # what the study knew when it proposed this trial
        verdicts[trial.number] = compile_cache_warm(replay, trial.user_attrs["flags"], MODEL, GPU, "0.26.0")
    assert verdicts == {0: False, 1: False, 2: False, 3: False, 4: True, 5: True, 6: True, 7: True}
    for row in (r for r in GRID if r["status"] == "ok"):
        n = int(row["trial_number"])
        parsed = parse_log((_trial_dir("grid", n) / "server.log").read_text())
        warm_log = parsed.activation_peak_gib < 0.4  # 0.38 warm, 0.44 cold
        error = abs(_planner(dataset.row_flags(row), verdicts[n]) - row["kv_cache_tokens"]) / row["kv_cache_tokens"]
        if n == 3:  # the concurrent same-configuration compile (docstring)
            assert warm_log and not verdicts[n] and 0.01 < error < 0.015
            continue
        assert warm_log == verdicts[n], n
        assert error < 0.001, n
