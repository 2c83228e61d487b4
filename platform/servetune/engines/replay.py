"""The ``replay`` backend: answer trials from a recorded landscape instead of running them.

A landscape is a table of trial results (CSV or Parquet) with one ``flag_<vLLM name>`` column per
flag, a ``status`` column and metric columns named as in :meth:`TrialResult.metrics` — exactly
what servetune's Parquet dataset holds (``servetune.records.dataset.read_trials``), e.g. for a grid study.
Replaying it lets a search strategy be compared on real (or simulated) measurements at no GPU cost.

Contract:

* :meth:`Landscape.lookup` finds the row for a flag set. Every flag the trial sets must have a
  column. An exact match (floats equal to 1e-9) wins; the first recorded row of repeats is used.
  When there is none and every requested value is one the landscape records for its flag (the
  point lies on the recorded grid, only the combination is missing), that is an error
  (:class:`LookupError`): the landscape is incomplete for this space. Otherwise the nearest row is
  used: per flag, the distance between values scaled by the recorded range (on a log scale when
  the values are positive and span 4x or more), 1 for unequal categories.
* :func:`result_from_row` rebuilds the :class:`TrialResult` (status, cause, metrics, latency
  summaries, memory breakdown) with ``backend="replay"``; its ``wall_s`` is the recorded GPU cost
  of the trial, :func:`gpu_seconds`: a ``gpu_seconds`` column when present, the ``wall_s`` of a
  real (``backend == "vllm"``) trial, else ``startup_s + duration_s + TRIAL_OVERHEAD_S``. A trial
  refused before launch (``pruned``, ``invalid_config``) costs 0.

Example:
    >>> import pandas as pd
    >>> frame = pd.DataFrame({"flag_max_num_seqs": [64, 128], "status": ["ok", "ok"],
    ...                       "output_throughput": [900.0, 1200.0], "preemptions": [0.0, 3.0],
    ...                       "startup_s": [75.0, 75.0], "duration_s": [30.0, 25.0]})
    >>> land = Landscape(frame, "inline")
    >>> r = land.result({"max_num_seqs": 128})
    >>> r.status.value, r.output_throughput, r.preemptions, r.wall_s
    ('ok', 1200.0, 3, 122.0)
    >>> land.lookup({"max_num_seqs": 100})[1]     # not on the grid: the nearest row, not exact
    False
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from servetune.backends import CAPABILITIES
from servetune.engines.base import Engine, TrialTask
from servetune.errors import SpecError
from servetune.inputs import open_capped
from servetune.records.dataset import read_trials
from servetune.result import LatencySummary, MemoryBreakdown, TrialResult, TrialStatus

__all__ = ["Landscape", "result_from_row", "gpu_seconds", "read_landscape", "missing_columns",
           "TRIAL_OVERHEAD_S", "FLAG_PREFIX"]

FLAG_PREFIX = "flag_"
#: GPU seconds a trial holds its GPUs besides vLLM's startup and the measured window: actor start,
#: warm-up requests, /metrics reads, SIGTERM and teardown. The real H200 study
#: (tests/fixtures/real_h200/study_memory_pair) logged wall_s - startup_s - duration_s = 20.9,
#: 23.2, 22.6 and 21.2 s for its four trials.
TRIAL_OVERHEAD_S = 22.0
_REFUSED = {TrialStatus.PRUNED.value, TrialStatus.INVALID_CONFIG.value}
_INT_FIELDS = ("completed", "failed", "preemptions", "kv_cache_tokens", "num_gpu_blocks")
# api_server_cpu_s: a recorded real study's own API-server CPU, so a replay's simulator screen measures
# the host the study ran on, as the study did (absent from older datasets and simulated landscapes).
_FLOAT_FIELDS = ("output_throughput", "total_token_throughput", "request_throughput", "duration_s",
                 "kv_cache_usage_peak", "kv_cache_usage_mean", "max_concurrency", "startup_s", "api_server_cpu_s")
_MEMORY_FIELDS = ("total", "budget", "weights", "activation_peak", "non_torch", "cudagraph", "kv_cache")


def read_landscape(path: str | Path) -> pd.DataFrame:
    """Read a landscape file (``.csv``, ``.parquet``/``.pq``, or a Parquet dataset directory)."""
    p = Path(path)
    if p.is_dir():
        return read_trials(p)
    if p.suffix.lower() == ".csv":
        with open_capped(p, "table", "replay_file") as fh:
            return pd.read_csv(fh)
    if p.suffix.lower() in (".parquet", ".pq"):
        with open_capped(p, "table", "replay_file") as fh:
            return pd.read_parquet(fh)
    raise SpecError("replay_file", f"cannot read {p}: expected a .csv or .parquet file or a dataset directory",
                    "export the landscape with pandas to_csv/to_parquet, or point at a servetune dataset_dir")


def missing_columns(frame: pd.DataFrame, flags: Sequence[str], metrics: Sequence[str]) -> list[str]:
    """Columns a study needs that the landscape lacks: ``status``, ``flag_<f>`` and each metric."""
    need = ["status", *(FLAG_PREFIX + f for f in flags), *metrics]
    return [c for c in need if c not in frame.columns]


def _present(value: Any) -> bool:
    if value is None:
        return False
    try:
        return not pd.isna(value)
    except (TypeError, ValueError):  # a list value (cudagraph_capture_sizes)
        return True


def _number(row: Mapping[str, Any], key: str) -> float | None:
    value: Any = row.get(key)
    return float(value) if _present(value) else None


def gpu_seconds(row: Mapping[str, Any]) -> float:
    """The GPU seconds one recorded trial cost (see the module contract)."""
    explicit = _number(row, "gpu_seconds")
    if explicit is not None:
        return explicit
    if str(row.get("status")) in _REFUSED:
        return 0.0
    wall = _number(row, "wall_s")
    if wall is not None and row.get("backend") == "vllm":
        return wall
    return (_number(row, "startup_s") or 0.0) + (_number(row, "duration_s") or 0.0) + TRIAL_OVERHEAD_S


def result_from_row(row: Mapping[str, Any]) -> TrialResult:
    """The :class:`TrialResult` a recorded row stands for; ``wall_s`` is its GPU cost."""
    status = TrialStatus(str(row.get("status")))
    cause = row.get("cause")
    result = TrialResult(status=status, cause=str(cause) if _present(cause) and cause else None, backend="replay",
                         vllm_version=str(row["vllm_version"]) if _present(row.get("vllm_version")) else None)
    for name in _FLOAT_FIELDS:
        setattr(result, name, _number(row, name))
    for name in _INT_FIELDS:
        value = _number(row, name)
        setattr(result, name, None if value is None else int(round(value)))
    for stem in ("ttft", "itl", "tpot", "e2e"):
        stats = [_number(row, f"{stem}_{s}_ms") for s in ("mean", "p50", "p90", "p99")]
        if all(v is not None for v in stats):
            setattr(result, f"{stem}_ms", LatencySummary(*stats))  # type: ignore[arg-type]
    memory = [_number(row, f"mem_{k}_gib") for k in _MEMORY_FIELDS]
    if all(v is not None for v in memory):
        result.memory = MemoryBreakdown(*memory)  # type: ignore[arg-type]
    result.wall_s = gpu_seconds(row)
    return result


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b) if isinstance(a, (bool, int)) and isinstance(b, (bool, int)) else a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return str(a) == str(b)


class Landscape:
    """A recorded table of trials, answering flag sets (see the module contract)."""

    _cache: dict[tuple[str, int], Landscape] = {}
    _lock = threading.Lock()

    def __init__(self, frame: pd.DataFrame, source: str = "<frame>") -> None:
        if "status" not in frame.columns:
            raise SpecError("replay_file", f"{source} has no status column", "record the landscape from a servetune dataset")
        self.frame = frame.reset_index(drop=True)
        self.source = source
        self.flag_names = tuple(c[len(FLAG_PREFIX):] for c in frame.columns if c.startswith(FLAG_PREFIX))
        self._rows: list[dict[str, Any]] = self.frame.to_dict("records")

    @classmethod
    def load(cls, path: str | Path) -> Landscape:
        """Read (once per file version, per process) a landscape file."""
        p = Path(path).resolve()
        if not p.exists():
            raise SpecError("replay_file", f"file not found: {p}", "record a landscape first")
        key = (str(p), p.stat().st_mtime_ns)
        with cls._lock:
            if key not in cls._cache:
                cls._cache[key] = cls(read_landscape(p), str(p))
            return cls._cache[key]

    def values(self, flag: str) -> list[Any]:
        """Distinct recorded values of one flag."""
        out: list[Any] = []
        for row in self._rows:
            v = row.get(FLAG_PREFIX + flag)
            if _present(v) and not any(_equal(v, w) for w in out):
                out.append(v)
        return out

    def lookup(self, flags: Mapping[str, Any], repeat: int = 0) -> tuple[dict[str, Any], bool]:
        """``(row, exact)`` for a flag set; LookupError when an on-grid point is missing.

        ``repeat`` picks among recorded repeats of the exact point (the ``repeat % count``-th row,
        in recorded order): a confirmation run's ``r``-th repeat reads the ``r``-th measurement.
        """
        wanted = {k: v for k, v in flags.items() if v is not None}
        unknown = [k for k in wanted if k not in self.flag_names]
        if unknown:
            raise LookupError(f"{self.source} records no column for {', '.join(FLAG_PREFIX + k for k in unknown)}")
        exact = [row for row in self._rows
                 if all(_present(row.get(FLAG_PREFIX + k)) and _equal(row[FLAG_PREFIX + k], v) for k, v in wanted.items())]
        if exact:
            return exact[repeat % len(exact)], True
        if all(any(_equal(v, w) for w in self.values(k)) for k, v in wanted.items()):
            raise LookupError(f"{self.source} has no row for {dict(wanted)} although every value is on its grid: "
                              "the landscape does not cover this search space")
        scales = {k: self._scale(k) for k in wanted}
        best, best_d = self._rows[0], math.inf
        for row in self._rows:
            d = sum(self._distance(k, row.get(FLAG_PREFIX + k), v, scales[k]) for k, v in wanted.items())
            if d < best_d:
                best, best_d = row, d
        return best, False

    def result(self, flags: Mapping[str, Any], repeat: int = 0) -> TrialResult:
        """The recorded result for a flag set, its evidence saying which row answered."""
        row, exact = self.lookup(flags, repeat)
        result = result_from_row(row)
        shown = {k: row.get(FLAG_PREFIX + k) for k in flags}
        result.evidence.append(f"replay: {'exact' if exact else 'nearest'} row {shown} of {self.source}")
        result.evidence.append(f"gpu_seconds={result.wall_s:.1f}")
        return result

    # -- nearest-point distance ----------------------------------------------------------------

    def _scale(self, flag: str) -> tuple[bool, float, float] | None:
        """(log scale?, low, high) of a numeric flag's recorded values; None for categories."""
        nums = [float(v) for v in self.values(flag) if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not nums:
            return None
        lo, hi = min(nums), max(nums)
        log = lo > 0 and hi / lo >= 4
        return (log, math.log(lo) if log else lo, math.log(hi) if log else hi)

    @staticmethod
    def _distance(flag: str, have: Any, want: Any, scale: tuple[bool, float, float] | None) -> float:
        if not _present(have):
            return 1.0
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (have, want))
        if scale is None or not numeric:
            return 0.0 if _equal(have, want) else 1.0
        log, lo, hi = scale
        a, b = float(have), float(want)
        if log:
            if a <= 0 or b <= 0:
                return 1.0
            a, b = math.log(a), math.log(b)
        return abs(a - b) / (hi - lo) if hi > lo else float(a != b)


class ReplayEngine(Engine):
    """``backend: replay``: the task answered from its recorded landscape (``task.replay_file``,
    the row for ``task.repeat``); the result's ``wall_s`` is the recorded GPU cost."""

    name = "replay"
    capabilities = CAPABILITIES["replay"]
    reports_wall_s = True

    def run(self, task: TrialTask) -> TrialResult:
        if not task.replay_file:
            raise SpecError("replay_file", "backend replay needs a recorded landscape", "set replay_file: in the spec")
        return Landscape.load(task.replay_file).result(task.flags, repeat=task.repeat)
