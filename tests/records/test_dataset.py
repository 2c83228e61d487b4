"""The Parquet trials dataset: rows, hive partitions, appends, filters, schema stability and evolution."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from servetune.records.dataset import (
    METRIC_COLUMNS, append_trials, flag_column, partition_dir, read_trials, requests_table, trial_row,
)
from servetune.errors import SpecError
from servetune.planner.flags import FLAGS
from servetune.result import LatencySummary, MemoryBreakdown, RequestRecord, TrialResult, TrialStatus

MODEL = "meta-llama/Llama 3=8B"  # a slash, a space and an equals sign: all must survive the path


def _ok(throughput: float, preemptions: int = 0) -> TrialResult:
    lat = LatencySummary(10.0, 9.0, 15.0, 20.0)
    return TrialResult(status=TrialStatus.OK, backend="sim", vllm_version="0.26.0", output_throughput=throughput,
                       ttft_ms=lat, preemptions=preemptions, memory=MemoryBreakdown(139.8, 69.9, 1.59, 1.2, 0.4, 0.35, 66.4))


def _oom() -> TrialResult:
    return TrialResult(status=TrialStatus.STARTUP_OOM, cause="No available memory for the cache blocks",
                       memory=MemoryBreakdown(139.8, 1.68, 1.59, 1.2, 0.4, 0.0, 0.0))


def test_trial_row_is_flat_and_complete() -> None:
    ts = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    row = trial_row("s1", 7, {"max_num_seqs": 64, "cudagraph_capture_sizes": [1, 2, 4], "my_new_flag": {"a": 1}},
                    _ok(1234.5, 2), gpu_type="H200", model=MODEL, extra={"objective": 1234.5}, timestamp=ts)
    assert row["timestamp"] == dt.datetime(2026, 1, 2, 1, 4, 5, tzinfo=dt.timezone.utc)
    assert (row["study"], row["trial_number"], row["gpu_type"], row["model"]) == ("s1", 7, "H200", MODEL)
    assert (row["status"], row["cause"], row["backend"], row["vllm_version"]) == ("ok", None, "sim", "0.26.0")
    assert row["flag_max_num_seqs"] == 64 and row["flag_cudagraph_capture_sizes"] == [1, 2, 4]
    assert row["flag_my_new_flag"] == '{"a": 1}'  # unknown flags are stored as JSON text
    assert row["output_throughput"] == 1234.5 and row["preemptions"] == 2.0 and row["ttft_p99_ms"] == 20.0
    assert row["mem_kv_cache_gib"] == 66.4 and row["objective"] == 1234.5
    with pytest.raises(SpecError, match="extra.status: 'x' contradicts the trial's status 'ok'"):
        trial_row("s1", 0, {}, _ok(1.0), "H200", MODEL, extra={"status": "x"})
    # extra may fill what the result left empty, or repeat it.
    filled = trial_row("s1", 0, {}, _oom(), "H200", MODEL, extra={"vllm_version": "0.26.0", "backend": "sim"})
    assert filled["vllm_version"] == "0.26.0" and filled["backend"] == "sim"
    with pytest.raises(SpecError, match="model"):
        trial_row("s1", 0, {}, _ok(1.0), "H200", "")
    with pytest.raises(SpecError, match="timestamp"):
        trial_row("s1", 0, {}, _ok(1.0), "H200", MODEL, timestamp=dt.datetime(2026, 1, 1))


def test_append_twice_partitions_filters_and_evolution(tmp_path: Path) -> None:
    first = [
        trial_row("s1", 0, {"max_num_seqs": 64, "gpu_memory_utilization": 0.5}, _ok(1000.0), "H200", MODEL),
        trial_row("s1", 1, {"max_num_seqs": 512, "enforce_eager": True}, _oom(), "H200", MODEL),
        trial_row("s2", 0, {"max_num_seqs": 128}, _ok(800.0, 5), "A100-80GB", "org/other"),
    ]
    files_1 = append_trials(tmp_path, first)
    assert len(files_1) == 2  # one file per (gpu_type, model, study) group
    # The second append adds a column the first files lack and a flag outside the registry.
    second = [trial_row("s1", 2, {"max_num_seqs": 96, "brand_new_flag": 3}, _ok(1100.0), "H200", MODEL,
                        extra={"objective": 1100.0, "sampler": "tpe"})]
    files_2 = append_trials(tmp_path, second)

    part = partition_dir(tmp_path, "H200", MODEL, "s1")
    assert part.relative_to(tmp_path).as_posix() == "gpu_type=H200/model=meta-llama%2FLlama%203%3D8B/study=s1"
    assert sorted(p.name for p in part.iterdir()) == sorted(p.name for p in files_1[:1] + files_2)
    assert all(p.name.startswith("part-") and p.suffix == ".parquet" for p in files_1 + files_2)
    assert not list(tmp_path.rglob(".*.tmp"))

    df = read_trials(tmp_path)
    assert list(zip(df["study"], df["trial_number"])) == [("s1", 0), ("s1", 1), ("s1", 2), ("s2", 0)]
    assert set(df["model"]) == {MODEL, "org/other"} and set(df["gpu_type"]) == {"H200", "A100-80GB"}
    assert df["timestamp"].dt.tz is not None
    # Flags a row did not set are null; the new columns are null in the older rows.
    assert df["flag_max_num_seqs"].tolist() == [64, 512, 96, 128]
    assert df["flag_enforce_eager"].isna().tolist() == [True, False, True, True]
    assert df["objective"].isna().tolist() == [True, True, False, True]
    assert df["flag_brand_new_flag"].tolist()[2] == "3" and pd.isna(df["flag_brand_new_flag"].iloc[0])
    assert df.loc[1, "status"] == "startup_oom" and pd.isna(df.loc[1, "output_throughput"])
    assert df.loc[1, "mem_budget_gib"] == 1.68 and df.loc[3, "preemptions"] == 5.0

    # Every file carries every registry flag and metric with the same types: stable schema.
    schemas = [pq.read_schema(p) for p in files_1 + files_2]
    for name in [flag_column(f) for f in FLAGS] + list(METRIC_COLUMNS):
        assert len({str(s.field(name).type) for s in schemas}) == 1, name

    assert read_trials(tmp_path, model=MODEL)["trial_number"].tolist() == [0, 1, 2]
    assert read_trials(tmp_path, gpu_type="A100-80GB", study="s2")["output_throughput"].tolist() == [800.0]
    assert len(read_trials(tmp_path, study=["s1", "s2"], status="ok")) == 3
    assert read_trials(tmp_path, flag_max_num_seqs=512)["status"].tolist() == ["startup_oom"]
    assert read_trials(tmp_path, model="nope").empty
    with pytest.raises(SpecError, match="filter flag_max_num_seq: no such column.*did you mean 'flag_max_num_seqs'"):
        read_trials(tmp_path, flag_max_num_seq=64)

    # Other hive readers see the same values: the directory encoding is the standard one.
    assert set(pq.read_table(tmp_path).column("model").to_pylist()) == {MODEL, "org/other"}

    # A later append that changes a column's type is named, not a bare Arrow error.
    append_trials(tmp_path, [trial_row("s1", 3, {}, _ok(1.0), "H200", MODEL, extra={"objective": "high"})])
    with pytest.raises(SpecError, match="disagree on a column type.*objective"):
        read_trials(tmp_path)
    assert len(read_trials(tmp_path, study="s2")) == 1  # other partitions stay readable


def test_read_empty_root_gives_expected_columns(tmp_path: Path) -> None:
    df = read_trials(tmp_path / "missing")
    assert df.empty
    for column in ("study", "trial_number", "gpu_type", "model", "timestamp", "status", "cause",
                   "flag_max_num_seqs", "flag_enforce_eager", "output_throughput", "mem_kv_cache_gib", "ttft_p99_ms"):
        assert column in df.columns
    assert str(df["output_throughput"].dtype) == "float64" and str(df["trial_number"].dtype) == "int64"
    assert read_trials(tmp_path).empty  # an existing but empty root, too


def test_append_refuses_rows_without_partition_values(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"rows\[0\].gpu_type"):
        append_trials(tmp_path, [{"study": "s", "model": "m", "trial_number": 0}])
    assert append_trials(tmp_path, []) == []


def test_requests_table_round_trip(tmp_path: Path) -> None:
    records = [RequestRecord(0, 100, 3, 0.0, 0.05, 0.15, itl_s=(0.05, 0.05), preemptions=1),
               RequestRecord(1, 100, 0, 0.1, None, None, error="timeout")]
    table = requests_table(records)
    pq.write_table(table, tmp_path / "r.parquet")
    df = pq.read_table(tmp_path / "r.parquet").to_pandas()
    assert df["tpot_ms"].round(6).tolist()[0] == 50.0 and pd.isna(df["ttft_ms"].iloc[1])
    assert pd.isna(df["error"].iloc[0]) and df["error"].iloc[1] == "timeout"
    assert df["preemptions"].tolist() == [1, 0]
