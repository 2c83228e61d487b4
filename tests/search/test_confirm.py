"""Confirmation of the top candidates (servetune.search.confirm): the statistics, and the driver end to end
(real local Ray, a real `mlflow server`, Optuna SQLite, the Parquet dataset)."""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient

from servetune.records import dataset
from servetune.search.confirm import choose, confirm, t_quantile_975
from servetune.spec.schema import StudySpec
from servetune.study import best_trial, run_study


def test_interval_uses_students_t_and_ranking_needs_feasible_runs() -> None:
    assert t_quantile_975(1) == 12.706 and t_quantile_975(2) == 4.303 and t_quantile_975(100) == 1.96
    one = confirm(1, {}, [100.0], [True])
    assert math.isinf(one.half_width) and one.to_dict()["ci95"] is None
    a = confirm(1, {"s": 1}, [100.0, 102.0], [True, True])
    assert a.half_width == pytest.approx(12.706 * math.sqrt(2.0) / math.sqrt(2))
    fast_but_preempting = confirm(2, {"s": 2}, [150.0, 149.0], [True, False])
    slower = confirm(3, {"s": 3}, [90.0, 91.0], [True, True])
    choice = choose([slower, fast_but_preempting, a], "maximize")
    assert [c.trial_number for c in choice.ranked] == [1, 3, 2]
    assert choice.winner is a and choice.overlap is True  # a's interval (+-12.7) reaches 90.5
    tight = choose([confirm(1, {}, [100.0, 100.2, 99.8], [True] * 3), confirm(2, {}, [90.0, 90.1, 89.9], [True] * 3)])
    assert tight.overlap is False
    latency = choose([confirm(1, {}, [50.0, 52.0], [True] * 2), confirm(2, {}, [40.0, 41.0], [True] * 2)], "minimize")
    assert latency.winner is not None and latency.winner.trial_number == 2
    assert choose([fast_but_preempting]).winner is None


@pytest.mark.slow
def test_the_driver_repeats_the_top_configs_and_chooses_on_confirmed_means(tmp_path: Path, mlflow_server: str) -> None:
    spec = StudySpec.from_dict({
        "name": "confirmed", "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB", "count": 2},
        # Poisson arrivals: another workload seed is another arrival sequence, so repeats differ.
        "workload": {"input_len": 512, "output_len": 128, "num_requests": 48, "request_rate": 8, "seed": 1},
        "objective": {"metric": "output_throughput"}, "constraints": {"max_preemptions": 0},
        "search_space": {"params": {"gpu_memory_utilization": [0.8, 0.9], "max_num_seqs": [16, 32, 64]}},
        "fixed_flags": {"max_model_len": 4096}, "backend": "sim", "seed": 0, "baseline_trial": False,
        "budget": {"trials": 4, "parallel": 2, "confirm_top": 2, "confirm_repeats": 2},
        "tracking": {"mlflow_uri": mlflow_server, "experiment": "exp-confirm"},
        "storage": {"optuna_url": f"sqlite:///{tmp_path}/optuna.db"},
        "output": {"runs_dir": str(tmp_path), "dataset_dir": str(tmp_path / "dataset")},
    }, cwd=tmp_path)
    text = io.StringIO()
    outcome = run_study(spec, out=text)
    assert outcome.trials_done == 4 and outcome.confirmation is not None
    conf = outcome.confirmation
    assert len(conf["configs"]) == 2 and all(c["runs"] == 3 for c in conf["configs"])
    assert conf["top_two_overlap"] in (True, False) and "winner on confirmed figures" in text.getvalue()
    values = conf["configs"][0]["values"]
    assert len(set(values)) > 1  # another seed, another measurement
    lo, hi = conf["configs"][0]["ci95"]
    assert lo < conf["configs"][0]["mean"] < hi

    study = optuna.load_study(study_name="confirmed", storage=spec.storage.optuna_url)
    assert len(study.get_trials(deepcopy=False)) == 4  # the repeats are not Optuna trials
    assert study.user_attrs["confirmation"]["winner"] == conf["winner"]
    assert best_trial(study).number == conf["winner"] == outcome.best_number

    df = dataset.read_trials(tmp_path / "dataset", study="confirmed")
    repeats = df[df["repeat"].notna()]
    assert len(repeats) == 4 and set(repeats["repeat"].astype(int)) == {1, 2}
    assert len(df) - len(repeats) == 4
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("exp-confirm")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`servetune.role` = 'repeat'")
    assert len(runs) == 4 and all(r.data.tags["servetune.origin"] == "repeat" for r in runs)
    assert {r.info.run_name for r in runs} == {f"trial-{c['trial_number']:03d}-repeat-{k}"
                                               for c in conf["configs"] for k in (1, 2)}


@pytest.mark.slow
def test_no_repeat_starts_after_the_time_limit_and_resume_confirms(tmp_path: Path) -> None:
    """budget.time_limit_s bounds the GPU time: a study that spent it leaves its winner unconfirmed
    (and says how to go on); resumed with time left, it confirms."""
    def spec(time_limit_s: float | None) -> StudySpec:
        return StudySpec.from_dict({
            "name": "late", "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB", "count": 1},
            "workload": {"input_len": 256, "output_len": 64, "num_requests": 24, "concurrency": 8, "seed": 1},
            "objective": {"metric": "output_throughput"}, "constraints": {"max_preemptions": 0},
            "search_space": {"params": {"gpu_memory_utilization": [0.8, 0.9], "max_num_seqs": [16, 32]}},
            "fixed_flags": {"max_model_len": 2048}, "backend": "sim", "seed": 0, "baseline_trial": False,
            "budget": {"trials": 2, "parallel": 1, "confirm_top": 1, "confirm_repeats": 1,
                       **({} if time_limit_s is None else {"time_limit_s": time_limit_s})},
            "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "exp-late"},
            "storage": {"optuna_url": f"sqlite:///{tmp_path}/optuna.db"},
            "output": {"runs_dir": str(tmp_path), "dataset_dir": str(tmp_path / "dataset")},
        }, cwd=tmp_path)

    first = run_study(dataclasses.replace(spec(None), budget=dataclasses.replace(spec(None).budget, confirm_top=0)),
                      out=io.StringIO())
    assert first.trials_done == 2 and first.confirmation is None
    text = io.StringIO()
    late = run_study(spec(0.001), resume=True, out=text)  # the trials are done; the limit is spent
    assert late.confirmation is None and "not confirmed" in text.getvalue() and "--resume" in text.getvalue()
    rows = dataset.read_trials(tmp_path / "dataset", study="late")
    assert len(rows) == 2 and "repeat" not in rows.columns  # no repeat was started
    resumed = run_study(spec(None), resume=True, out=io.StringIO())
    assert resumed.confirmation is not None and resumed.confirmation["configs"][0]["runs"] == 2


@pytest.mark.slow
def test_a_leading_trial_is_confirmed_on_its_own_start_and_restart_pays_a_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_ray: None) -> None:
    """budget.confirm_on (vllm backend, the simulated vLLM server as `vllm serve`): with
    same-start, every trial whose window led the study when it ran measured its repeat on its own
    server, so the winner (the better of two, which led when it ran) needs no start after the
    budget; with restart, the winner's repeat is a third start. Both choose on confirmed means."""
    import sys

    # Real-time steps (no speedup) and 64-token outputs: the simulated steps, not the HTTP round trips of
    # a busy 2-core box, set each window, so 32 sequences beat 2 by ~3.5x every time (at speedup 20 and
    # 16 tokens the two were inside each other's noise and a cold first window could lead or not).
    monkeypatch.setenv("SERVETUNE_SERVE_COMMAND", f"{sys.executable} -m servetune.sim.server --sim-speedup 1")
    monkeypatch.setenv("SERVETUNE_SIM_STARTUP_S", "0.2")  # reaches the servers: a Ray of its own (fresh_ray)

    def run(confirm_on: str) -> tuple[dict, int, object]:
        root = tmp_path / confirm_on
        spec = StudySpec.from_dict({
            "name": f"lead-{confirm_on}", "model": "servetune-test-850m", "gpu": {"type": "H200", "count": 1},
            "workload": {"input_len": 128, "output_len": 64, "num_requests": 24, "concurrency": 8, "seed": 1},
            "objective": {"metric": "output_throughput"}, "constraints": {"max_preemptions": 0},
            # The grid keeps the listed order here (seed 0 visits index 1 first): 2 sequences, then 32.
            "search_space": {"params": {"max_num_seqs": [32, 2]}}, "backend": "vllm", "seed": 0,
            "baseline_trial": False, "sampler": "grid", "multi_fidelity": False,  # both trials run for real
            "budget": {"trials": 2, "parallel": 1, "confirm_top": 1, "confirm_repeats": 1, "confirm_on": confirm_on},
            "tracking": {"mlflow_uri": f"sqlite:///{root}/mlflow.db", "experiment": "exp-lead"},
            "storage": {"optuna_url": f"sqlite:///{root}/optuna.db"},
            "output": {"runs_dir": str(root), "dataset_dir": str(root / "dataset")},
        }, cwd=tmp_path)
        outcome = run_study(spec, out=io.StringIO())
        starts = len(list((root / "trials" / spec.name).glob("*/server.log")))
        return outcome.confirmation, starts, dataset.read_trials(root / "dataset", study=spec.name)

    same, same_starts, same_rows = run("same-start")
    restart, restart_starts, restart_rows = run("restart")
    for conf in (same, restart):
        assert conf is not None and conf["configs"][0]["runs"] == 2 and conf["winner"] is not None
    assert (same_starts, restart_starts) == (2, 3)
    # The same-start repeats are recorded as repeats like a restart's (dataset rows, repeat = 1), one per
    # trial that led when it ran: the first always does.
    same_repeats = same_rows[same_rows["repeat"].notna()]
    assert 1 <= len(same_repeats) <= 2 and set(same_repeats["repeat"].astype(int)) == {1}
    assert same["winner"] in set(same_repeats["trial_number"].astype(int))
    # Both trials led when they ran (2 sequences first, then 32, ~3.5x better), so both hold a repeat:
    # the confirmation compares both although confirm_top is 1, and starts nothing for either.
    assert len(same_repeats) == 2
    assert {c["trial_number"] for c in same["configs"]} == set(same_repeats["trial_number"].astype(int))
    assert len(restart_rows[restart_rows["repeat"].notna()]) == 1
    assert same["winner"] == restart["winner"] == 1  # 32 sequences, the second trial
