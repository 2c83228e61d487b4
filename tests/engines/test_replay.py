"""The replay backend: exact, nearest and missing points, GPU cost, spec validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from servetune.engines import TrialTask, run_trial
from servetune.errors import SpecError
from servetune.engines.replay import TRIAL_OVERHEAD_S, Landscape, gpu_seconds
from servetune.result import TrialStatus
from servetune.spec.schema import StudySpec
from servetune.workload import Workload

WORKLOAD = Workload.from_dict({"input_len": 128, "output_len": 64, "num_requests": 8, "concurrency": 4})


def _frame() -> pd.DataFrame:
    rows = []
    for u in (0.5, 0.9):
        for s in (16, 64, 256):
            ok = u == 0.9
            rows.append({"flag_gpu_memory_utilization": u, "flag_max_num_seqs": s, "flag_max_model_len": 4096,
                         "status": "ok" if ok else "startup_oom", "cause": None if ok else "No available memory",
                         "output_throughput": 10.0 * s if ok else None, "preemptions": (3.0 if s == 256 else 0.0) if ok else None,
                         "startup_s": 75.0 if ok else 45.0, "duration_s": 30.0 if ok else None,
                         "ttft_mean_ms": 1.0, "ttft_p50_ms": 2.0, "ttft_p90_ms": 3.0, "ttft_p99_ms": 4.0})
    rows = [r for r in rows if not (r["flag_gpu_memory_utilization"] == 0.9 and r["flag_max_num_seqs"] == 64)]
    return pd.DataFrame(rows)


def test_exact_match_rebuilds_the_result_with_its_gpu_cost() -> None:
    land = Landscape(_frame())
    r = land.result({"gpu_memory_utilization": 0.9, "max_num_seqs": 256, "max_model_len": 4096})
    assert r.status is TrialStatus.OK and r.backend == "replay"
    assert r.output_throughput == 2560.0 and r.preemptions == 3
    assert r.ttft_ms is not None and r.ttft_ms.p99 == 4.0 and r.metrics()["ttft_p99_ms"] == 4.0
    assert r.wall_s == 75.0 + 30.0 + TRIAL_OVERHEAD_S and "replay: exact" in r.evidence[0]
    failed = land.result({"gpu_memory_utilization": 0.5, "max_num_seqs": 16, "max_model_len": 4096})
    assert failed.status is TrialStatus.STARTUP_OOM and failed.cause == "No available memory"
    assert failed.wall_s == 45.0 + TRIAL_OVERHEAD_S and failed.output_throughput is None


def test_off_grid_point_gets_the_nearest_row_and_a_missing_grid_point_is_an_error() -> None:
    land = Landscape(_frame())
    row, exact = land.lookup({"gpu_memory_utilization": 0.85, "max_num_seqs": 200, "max_model_len": 4096})
    assert not exact and (row["flag_gpu_memory_utilization"], row["flag_max_num_seqs"]) == (0.9, 256)
    with pytest.raises(LookupError, match="on its grid"):
        land.lookup({"gpu_memory_utilization": 0.9, "max_num_seqs": 64, "max_model_len": 4096})
    with pytest.raises(LookupError, match="flag_enforce_eager"):
        land.lookup({"gpu_memory_utilization": 0.9, "enforce_eager": True})


def test_gpu_seconds_prefers_an_explicit_column_then_real_wall_time() -> None:
    assert gpu_seconds({"status": "ok", "gpu_seconds": 12.0, "startup_s": 75.0}) == 12.0
    assert gpu_seconds({"status": "ok", "backend": "vllm", "wall_s": 92.6, "startup_s": 67.1}) == 92.6
    assert gpu_seconds({"status": "ok", "backend": "sim", "wall_s": 0.2, "startup_s": 70.0, "duration_s": 5.0}) \
        == 75.0 + TRIAL_OVERHEAD_S  # a simulated trial's wall time is CPU time, not a GPU cost
    assert gpu_seconds({"status": "pruned", "startup_s": 60.0}) == 0.0


def _spec(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"name": "replayed", "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB"},
            "workload": {"input_len": 128, "output_len": 64, "num_requests": 8, "concurrency": 4},
            "search_space": {"params": {"gpu_memory_utilization": [0.5, 0.9], "max_num_seqs": [16, 256]}},
            "fixed_flags": {"max_model_len": 4096}, "storage": {"optuna_url": "memory"}, **extra}


def test_spec_and_run_trial_replay(tmp_path: Path) -> None:
    path = tmp_path / "land.parquet"
    _frame().to_parquet(path)
    spec = StudySpec.from_dict(_spec(tmp_path, backend="replay", replay_file="land.parquet"), tmp_path, cwd=tmp_path)
    assert spec.replay_file == path.resolve() and spec.to_dict()["replay_file"] == str(path.resolve())
    task = TrialTask(model=spec.model_ref, gpu=spec.gpu.type, workload=WORKLOAD, replay_file=str(spec.replay_file),
                     flags={"gpu_memory_utilization": 0.9, "max_num_seqs": 16, "max_model_len": 4096})
    r = run_trial(task, "replay")
    assert r.status is TrialStatus.OK and r.output_throughput == 160.0 and r.wall_s == 105.0 + TRIAL_OVERHEAD_S
    missing = run_trial(TrialTask(**{**task.__dict__, "flags": {**task.flags, "max_num_seqs": 64}}), "replay")
    assert missing.status is TrialStatus.CRASHED and "on its grid" in (missing.cause or "")
    assert spec.with_overrides(backend="sim").replay_file is None


@pytest.mark.parametrize("extra, field, text", [
    ({"backend": "replay"}, "replay_file", "needs a recorded landscape"),
    ({"backend": "replay", "replay_file": "nope.csv"}, "replay_file", "file not found"),
    ({"backend": "sim", "replay_file": "land.csv"}, "replay_file", "backend: replay only"),
    ({"backend": "replay", "replay_file": "thin.csv"}, "replay_file", "flag_max_model_len"),
    ({"prescreen": "yes"}, "prescreen", "true or false"),
])
def test_spec_validation(tmp_path: Path, extra: dict[str, Any], field: str, text: str) -> None:
    _frame().to_csv(tmp_path / "land.csv", index=False)
    _frame().drop(columns=["flag_max_model_len"]).to_csv(tmp_path / "thin.csv", index=False)
    with pytest.raises(SpecError) as err:
        StudySpec.from_dict(_spec(tmp_path, **extra), tmp_path, cwd=tmp_path)
    assert err.value.field == field and text in str(err.value)


def test_a_repeat_reads_the_recorded_repeats_in_order() -> None:
    import pandas as pd

    from servetune.engines.replay import Landscape

    frame = pd.DataFrame({"flag_max_num_seqs": [64, 64, 64, 128], "status": ["ok"] * 4,
                          "output_throughput": [900.0, 910.0, 890.0, 1200.0], "preemptions": [0.0] * 4,
                          "startup_s": [75.0] * 4, "duration_s": [30.0] * 4})
    land = Landscape(frame, "inline")
    assert [land.result({"max_num_seqs": 64}, repeat=k).output_throughput for k in range(4)] == \
        [900.0, 910.0, 890.0, 900.0]
    assert land.result({"max_num_seqs": 128}, repeat=2).output_throughput == 1200.0  # one row: the same again
