"""The Parquet dataset of every trial: one flat row per trial, appended file by file, read as a frame.

Contract:

* :func:`trial_row` (pure) flattens one trial into a row: identifiers (``study``,
  ``trial_number``, ``gpu_type``, ``model``), ``timestamp`` (UTC), ``status``, ``cause``,
  ``backend``, ``vllm_version``, each flag as ``flag_<vLLM name>``, every metric of
  :meth:`TrialResult.metrics` under its own name, and caller ``extra`` columns (which may fill
  a built-in column the result left null, never contradict one).
* :func:`append_trials` writes one new file per (gpu_type, model, study) group and call, in a
  hive layout ``gpu_type=<g>/model=<m>/study=<s>/part-<uuid>.parquet``. Partition values are
  percent-encoded (``meta-llama/Llama-3`` becomes ``meta-llama%2FLlama-3``), which is the
  encoding pyarrow and Spark decode for hive partitions. The partition columns live in the
  directory names only, as hive datasets expect. Files appear atomically (written under a
  hidden name, then renamed), so a reader never sees half a file and writers never collide.
* Every file carries every flag of :data:`servetune.planner.flags.FLAGS` and every known metric with a
  fixed Arrow type, so the schema is the same across appends; a flag a row does not set is null.
  New columns (a new ``extra`` key) are added by schema unification on read.
* :func:`read_trials` returns one :class:`pandas.DataFrame` (an empty frame with the expected
  columns when nothing was written yet), filtered by equality or membership.

Example:
    >>> import tempfile
    >>> from servetune.result import TrialResult, TrialStatus
    >>> root = Path(tempfile.mkdtemp())
    >>> row = trial_row("s1", 0, {"max_num_seqs": 64}, TrialResult(status=TrialStatus.OK, output_throughput=900.0),
    ...                 gpu_type="H200", model="org/m")
    >>> _ = append_trials(root, [row])
    >>> df = read_trials(root, model="org/m")
    >>> df.loc[0, "flag_max_num_seqs"], df.loc[0, "output_throughput"], df.loc[0, "study"]
    (np.int64(64), np.float64(900.0), 's1')
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import os
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from servetune.errors import SpecError, did_you_mean
from servetune.planner.flags import FLAGS
from servetune.result import SLO_METRICS, LatencySummary, MemoryBreakdown, RequestRecord, TrialResult, TrialStatus

__all__ = [
    "PARTITION_COLUMNS",
    "IDENTITY_COLUMNS",
    "METRIC_COLUMNS",
    "flag_column",
    "row_flags",
    "trial_dir_name",
    "row_trial_dir_name",
    "trial_row",
    "trials_schema",
    "append_trials",
    "read_trials",
    "partition_dir",
    "requests_table",
]

#: Directory levels, outermost first.
PARTITION_COLUMNS: tuple[str, ...] = ("gpu_type", "model", "study")

_IDENTITY_TYPES: dict[str, pa.DataType] = {
    "study": pa.string(),
    "trial_number": pa.int64(),
    "gpu_type": pa.string(),
    "model": pa.string(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "status": pa.string(),
    "cause": pa.string(),
    "backend": pa.string(),
    "vllm_version": pa.string(),
}
#: Columns every row has, besides flags and metrics.
IDENTITY_COLUMNS: tuple[str, ...] = tuple(_IDENTITY_TYPES)


def _known_metric_names() -> tuple[str, ...]:
    """Every name :meth:`TrialResult.metrics` can emit, taken from a fully filled result.

    Derived rather than listed so a metric added to ``result.py`` becomes a column here too.
    """
    lat = LatencySummary(1.0, 1.0, 1.0, 1.0)
    full = TrialResult(
        status=TrialStatus.OK, duration_s=1.0, completed=1, failed=0, output_throughput=1.0,
        total_token_throughput=1.0, request_throughput=1.0, ttft_ms=lat, itl_ms=lat, tpot_ms=lat,
        e2e_ms=lat, preemptions=0, kv_cache_usage_peak=1.0, kv_cache_usage_mean=1.0,
        memory=MemoryBreakdown(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0), kv_cache_tokens=1,
        num_gpu_blocks=1, max_concurrency=1.0, startup_s=1.0, wall_s=1.0, api_server_cpu_s=1.0,
        slo={k: 1.0 for k in SLO_METRICS},
    )
    return tuple(full.metrics())


#: Metric columns, float64, named as in :meth:`TrialResult.metrics` and in MLflow.
METRIC_COLUMNS: tuple[str, ...] = _known_metric_names()

_FLAG_ARROW_TYPES: dict[type, pa.DataType] = {
    float: pa.float64(), int: pa.int64(), bool: pa.bool_(), str: pa.string(), list: pa.list_(pa.int64()),
}


def flag_column(name: str) -> str:
    """The dataset column of a vLLM flag: ``flag_<name>``."""
    return f"flag_{name}"


def trial_dir_name(number: int, repeat: int | None = None) -> str:
    """A trial's folder under ``<runs_dir>/trials/<study>/``: its number, and the confirmation
    repeat it is, if one (the study writes there; a record and a dataset row point there).

    Example:
        >>> trial_dir_name(7), trial_dir_name(7, repeat=2)
        ('0007', '0007-repeat-2')
    """
    return f"{number:04d}" if repeat is None else f"{number:04d}-repeat-{repeat}"


def row_trial_dir_name(row: Mapping[str, Any]) -> str:
    """:func:`trial_dir_name` of one dataset row (its ``repeat`` column empty for a first run).

    Example:
        >>> first, repeat = {"trial_number": 3, "repeat": float("nan")}, {"trial_number": 3, "repeat": 1.0}
        >>> row_trial_dir_name(first), row_trial_dir_name(repeat)
        ('0003', '0003-repeat-1')
    """
    repeat = row.get("repeat")
    if repeat is None or (isinstance(repeat, float) and math.isnan(repeat)):
        return trial_dir_name(int(row["trial_number"]))
    return trial_dir_name(int(row["trial_number"]), int(repeat))


def row_flags(row: Mapping[str, Any]) -> dict[str, Any]:
    """The flags one dataset row ran with: its ``flag_*`` columns that hold a value, typed as the
    flag registry types them (Parquet's float64 columns give ``max_num_seqs`` 256.0 back as 256).

    Example:
        >>> row_flags({"flag_max_num_seqs": 256.0, "flag_gpu_memory_utilization": 0.9,
        ...            "flag_enforce_eager": None, "output_throughput": 1.0})
        {'max_num_seqs': 256, 'gpu_memory_utilization': 0.9}
    """
    flags: dict[str, Any] = {}
    for key, value in row.items():
        if not key.startswith("flag_") or value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        name = key[len("flag_"):]
        kind = FLAGS[name].kind if name in FLAGS else None
        flags[name] = [int(v) for v in value] if kind is list else kind(value) if kind in (int, float, bool) else value
    return flags


def trials_schema(extra: pa.Schema | None = None) -> pa.Schema:
    """The columns every file carries (partition columns excluded), plus ``extra`` fields."""
    schema = _base_schema()
    if extra is not None:
        for f in extra:
            if schema.get_field_index(f.name) < 0:
                schema = schema.append(f)
    return schema


@functools.lru_cache(maxsize=1)
def _base_schema() -> pa.Schema:
    """:func:`trials_schema` without extra fields (built once: the registries are fixed)."""
    fields = [pa.field(k, t) for k, t in _IDENTITY_TYPES.items() if k not in PARTITION_COLUMNS]
    fields += [pa.field(flag_column(n), _FLAG_ARROW_TYPES[s.kind]) for n, s in FLAGS.items()]
    fields += [pa.field(m, pa.float64()) for m in METRIC_COLUMNS]
    return pa.schema(fields)


def _full_schema() -> pa.Schema:
    """File schema plus the partition columns, in reading order (identity columns first)."""
    fields = [pa.field(k, t) for k, t in _IDENTITY_TYPES.items()]
    fields += [f for f in trials_schema() if f.name not in _IDENTITY_TYPES]
    return pa.schema(fields)


def _flag_value(name: str, value: Any) -> Any:
    """Flags the registry knows keep their type; unknown flags are stored as JSON text."""
    if value is None or name in FLAGS:
        return value
    return value if isinstance(value, str) else json.dumps(value)


def trial_row(
    study: str,
    trial_number: int,
    flags: Mapping[str, Any],
    result: TrialResult,
    gpu_type: str,
    model: str,
    extra: Mapping[str, Any] | None = None,
    *,
    timestamp: _dt.datetime | None = None,
) -> dict[str, Any]:
    """One flat dataset row for a trial. Pure.

    Example:
        >>> from servetune.result import TrialResult, TrialStatus
        >>> r = trial_row("s", 3, {"enforce_eager": True}, TrialResult(TrialStatus.STARTUP_OOM, cause="oom"),
        ...               gpu_type="H200", model="m", extra={"objective": None})
        >>> r["flag_enforce_eager"], r["status"], r["cause"], r["trial_number"], "output_throughput" in r
        (True, 'startup_oom', 'oom', 3, False)
    """
    for field, value in (("study", study), ("gpu_type", gpu_type), ("model", model)):
        if not isinstance(value, str) or not value:
            raise SpecError(field, f"expected a non-empty string, got {value!r}", f"pass the {field} of the trial")
    ts = timestamp or _dt.datetime.now(_dt.timezone.utc)
    if ts.tzinfo is None:
        raise SpecError("timestamp", "naive datetime", "pass an aware datetime in UTC")
    row: dict[str, Any] = {
        "study": study,
        "trial_number": int(trial_number),
        "gpu_type": gpu_type,
        "model": model,
        "timestamp": ts.astimezone(_dt.timezone.utc),
        "status": TrialStatus(result.status).value,
        "cause": result.cause,
        "backend": result.backend,
        "vllm_version": result.vllm_version,
    }
    for name, value in flags.items():
        row[flag_column(str(name))] = _flag_value(str(name), value)
    row.update(result.metrics())
    for key, value in (extra or {}).items():
        # extra may fill a built-in column the result left empty (vllm_version of a trial that
        # never started) or repeat its value; contradicting it would make two truths.
        if key in row and row[key] is not None and row[key] != value:
            raise SpecError(f"extra.{key}", f"{value!r} contradicts the trial's {key} {row[key]!r}",
                            "drop the key from extra or rename the extra column")
        if key not in row or row[key] is None:
            row[str(key)] = value
    return row


def partition_dir(root: Path, gpu_type: str, model: str, study: str) -> Path:
    """The directory of one (gpu_type, model, study) partition; values percent-encoded."""
    values = {"gpu_type": gpu_type, "model": model, "study": study}
    return Path(root).joinpath(*(f"{k}={_encode(values[k])}" for k in PARTITION_COLUMNS))


def _encode(value: str) -> str:
    # quote() with no safe characters: '/' and '=' can never split or fake a hive segment, and
    # '.'/'..' cannot occur alone because every segment is prefixed with 'key='.
    return urllib.parse.quote(value, safe="")


def _table_for(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows to an Arrow table with the fixed schema plus inferred types for unknown columns."""
    base = trials_schema()
    known = set(base.names) | set(PARTITION_COLUMNS)
    extra_names: list[str] = []
    for row in rows:
        for key in row:
            if key not in known and key not in extra_names:
                extra_names.append(key)
    extra_fields = []
    for name in extra_names:
        values = [row.get(name) for row in rows]
        if name.startswith("flag_"):  # a flag outside the registry: JSON text, as _flag_value stores it
            extra_fields.append(pa.field(name, pa.string()))
        else:
            extra_fields.append(pa.field(name, pa.array(values).type))
    schema = trials_schema(pa.schema(extra_fields))
    columns = {name: [row.get(name) for row in rows] for name in schema.names}
    return pa.Table.from_pydict(columns, schema=schema)


def append_trials(root: Path, rows: Iterable[Mapping[str, Any]]) -> list[Path]:
    """Write ``rows`` as new Parquet files, one per (gpu_type, model, study); returns the files.

    Example:
        >>> import tempfile
        >>> from servetune.result import TrialResult, TrialStatus
        >>> root = Path(tempfile.mkdtemp())
        >>> rows = [trial_row("s", i, {}, TrialResult(TrialStatus.OK), "H200", "org/m") for i in range(2)]
        >>> [p.relative_to(root).parent.as_posix() for p in append_trials(root, rows)]
        ['gpu_type=H200/model=org%2Fm/study=s']
    """
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for i, row in enumerate(rows):
        key = []
        for col in PARTITION_COLUMNS:
            value = row.get(col)
            if not isinstance(value, str) or not value:
                raise SpecError(f"rows[{i}].{col}", f"expected a non-empty string, got {value!r}",
                                "build rows with dataset.trial_row")
            key.append(value)
        groups.setdefault((key[0], key[1], key[2]), []).append(row)
    written: list[Path] = []
    for (gpu_type, model, study), group in groups.items():
        directory = partition_dir(Path(root), gpu_type, model, study)
        directory.mkdir(parents=True, exist_ok=True)
        name = f"part-{uuid.uuid4().hex}.parquet"
        # A leading dot hides the file from pyarrow/Spark discovery until the rename publishes it.
        tmp = directory / f".{name}.tmp"
        pq.write_table(_table_for(group), tmp)
        os.replace(tmp, directory / name)
        written.append(directory / name)
    return written


def _partitioning() -> pads.Partitioning:
    schema = pa.schema([pa.field(c, pa.string()) for c in PARTITION_COLUMNS])
    return pads.partitioning(schema, flavor="hive")  # hive segments are URI-decoded by default


def read_trials(root: Path, on_damaged: Callable[[Path, str], None] | None = None, **filters: Any) -> pd.DataFrame:
    """All trials under ``root`` as one frame; ``filters`` are ``column=value`` or ``column=[values]``.

    Filters on the partition columns skip whole directories before any file is opened. With
    ``on_damaged``, a part file that is not Parquet is skipped and reported as ``(path, reason)``;
    without it, reading it raises.

    Example:
        >>> import tempfile
        >>> df = read_trials(Path(tempfile.mkdtemp()) / "nothing-yet")
        >>> len(df), "flag_max_num_seqs" in df.columns, "output_throughput" in df.columns
        (0, True, True)
    """
    root = Path(root)
    files = sorted(_files(root, filters))
    if on_damaged is not None:
        files = [f for f in files if _readable(f, on_damaged)]
    if files:
        schemas = [pq.read_schema(f) for f in files]
        # Drop the pandas metadata of the first file so the unified schema carries none of it.
        try:
            schema = pa.unify_schemas([_full_schema(), *schemas], promote_options="permissive")
        except (pa.ArrowTypeError, pa.ArrowInvalid) as exc:
            raise SpecError(str(root), f"the dataset's files disagree on a column type: {exc}",
                            "write one type per extra column, or give the new type a new column name") from None
        schema = schema.remove_metadata()
        dataset = pads.dataset([str(f) for f in files], schema=schema, format="parquet",
                               partitioning=_partitioning(), partition_base_dir=str(root))
        table = dataset.to_table()
    else:
        table = _full_schema().empty_table()
    df = table.to_pandas()
    for column, wanted in filters.items():
        if column not in df.columns:
            raise SpecError(f"filter {column}", f"no such column{did_you_mean(column, df.columns)}",
                            f"filter on one of: {', '.join(df.columns)}")
        if isinstance(wanted, (list, tuple, set, frozenset)):
            df = df[df[column].isin(list(wanted))]
        else:
            df = df[df[column] == wanted]
    sort = [c for c in ("study", "trial_number", "timestamp") if c in df.columns]
    return df.sort_values(sort, kind="stable").reset_index(drop=True)


def _readable(path: Path, on_damaged: Callable[[Path, str], None]) -> bool:
    """Whether a part file's Parquet footer reads; if not, ``on_damaged(path, reason)``."""
    try:
        pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        on_damaged(path, (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200])
        return False
    return True


def _files(root: Path, filters: Mapping[str, Any]) -> Iterable[Path]:
    """Published part files, pruned by partition filters."""
    if not root.is_dir():
        return []
    allowed: dict[str, set[str]] = {}
    for col in PARTITION_COLUMNS:
        if col in filters:
            wanted = filters[col]
            values = wanted if isinstance(wanted, (list, tuple, set, frozenset)) else [wanted]
            allowed[col] = {f"{col}={_encode(str(v))}" for v in values}
    out = []
    for path in root.glob("*/*/*/part-*.parquet"):
        segments = path.relative_to(root).parts[:3]
        if all(segments[i] in allowed[c] for i, c in enumerate(PARTITION_COLUMNS) if c in allowed):
            out.append(path)
    return out


def _gap_array(gaps: Sequence[float]) -> np.ndarray:
    as_array = getattr(gaps, "as_array", None)  # servetune.sim.client.ChunkGaps
    return np.asarray(as_array() if as_array is not None else gaps, dtype=np.float64)


def requests_table(records: Sequence[RequestRecord]) -> pa.Table:
    """Per-request results as an Arrow table (seconds as recorded, latencies in ms as derived;
    the error texts as they are: the recorder redacted them).

    Example:
        >>> from servetune.result import RequestRecord
        >>> t = requests_table([RequestRecord(0, 100, 3, 0.0, 0.05, 0.15, itl_s=(0.05, 0.05))])
        >>> t.num_rows, round(t.column("ttft_ms")[0].as_py(), 6), t.column("itl_s")[0].as_py()
        (1, 50.0, [0.05, 0.05])
    """
    schema = pa.schema([
        ("request_id", pa.int64()), ("prompt_tokens", pa.int64()), ("output_tokens", pa.int64()),
        ("arrival_s", pa.float64()), ("first_token_s", pa.float64()), ("finish_s", pa.float64()),
        ("ttft_ms", pa.float64()), ("tpot_ms", pa.float64()), ("e2e_ms", pa.float64()),
        ("itl_s", pa.list_(pa.float64())), ("preemptions", pa.int64()), ("error", pa.string()),
    ])
    columns: dict[str, Any] = {name: [getattr(r, name) for r in records]
                               for name in schema.names if name != "itl_s"}
    # The inter-token gaps (most of the table: one float per output token) as one flat array and
    # offsets, not a Python list per request; a simulated request's gaps are an array already.
    parts = [_gap_array(r.itl_s) for r in records]
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    gaps = np.concatenate(parts) if parts else np.empty(0, dtype=np.float64)
    columns["itl_s"] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(gaps, pa.float64()))
    return pa.Table.from_pydict({name: columns[name] for name in schema.names}, schema=schema)
