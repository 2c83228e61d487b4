"""Warm start from earlier studies, and a baseline trial with vLLM's defaults.

Warm start (``warm_start: true``). The Parquet dataset (:mod:`servetune.records.dataset`) holds every
earlier study's trials. For a new study, each earlier study on the **same GPU type** gets a
distance (:func:`study_distance`):

* 0 for the same model and the same vLLM ``major.minor``;
* + 0.5 when the vLLM ``major.minor`` differs (defaults and memory accounting move between
  releases; patch releases do not count);
* + 1 + ``|log2(params / earlier params)|`` + 0.5 for another architecture, when the model differs
  (an 8B Llama against a 7B Qwen2: 1 + 0.19 + 0.5 = 1.69);

studies on another GPU type, or farther than :data:`MAX_DISTANCE` (2.0: about 2.4x the parameter
count within an architecture), are not used. The best feasible trial of each remaining study (the
first objective; preemptions within the constraint: :func:`warm_start_flags`)
is a candidate; up to :data:`MAX_WARM_STARTS` of them, nearest first (then newest), are re-validated
against the current space (:func:`fit_to_space`: clipped into range, snapped to the step or the
nearest choice, a category the space lacks left to the sampler) and enqueued. The pre-screen still
judges them like any proposal. The workload is not part of the distance (the dataset does not
record it): a warm start is a starting point, not a verdict.

Baseline (``baseline_trial: true``). One trial with the flags vLLM would use when not given any of
the searched ones (:func:`servetune.planner.memory.resolve_engine_config` of the fixed flags, for the
study's vLLM version), fitted to the space the same way, so a study reports how far it got beyond
``vllm serve``'s defaults.

Enqueued trials carry the user attr ``origin`` (``warm_start`` / ``baseline``; the informed starts
``informed``; everything else the sampler's); the driver logs it as the MLflow tag
``servetune.origin`` and the dataset column ``origin`` (:func:`origin_of`).

Example:
    >>> from servetune.spec.space import SearchSpace
    >>> space = SearchSpace.from_dict({"params": {"gpu_memory_utilization": [0.3, 0.95],
    ...                                           "max_num_seqs": {"type": "categorical", "choices": [64, 128, 256]}}})
    >>> fit_to_space({"gpu_memory_utilization": 0.97, "max_num_seqs": 200, "enforce_eager": True}, space)
    {'gpu_memory_utilization': 0.95, 'max_num_seqs': 256}
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from servetune.errors import SpecError
from servetune.planner.engine_config import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.records import dataset
from servetune.vllm_version import minor

if TYPE_CHECKING:
    import optuna

    from servetune.spec.space import Param, SearchSpace
    from servetune.spec.schema import StudySpec

__all__ = ["WarmStart", "study_distance", "warm_start_flags", "fit_to_space", "warm_starts", "baseline_flags", "enqueue_warm_starts",
           "enqueue_baseline", "origin_of", "MAX_DISTANCE", "MAX_WARM_STARTS"]

MAX_DISTANCE = 2.0
MAX_WARM_STARTS = 2


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """One earlier study's best feasible flags, fitted to the current space."""

    study: str
    model: str
    vllm_version: str | None
    distance: float
    params: dict[str, Any]
    objective: float


# -- pure pieces -----------------------------------------------------------------------------------

def study_distance(model: str, version: str | None, earlier_model: str, earlier_version: str | None,
                   params: tuple[float, str] | None = None, earlier_params: tuple[float, str] | None = None
                   ) -> float | None:
    """The distance of an earlier study (same GPU type) to this one, or None when not comparable.

    ``params`` / ``earlier_params``: ``(parameter count, architecture)`` of the two models, needed
    only when the models differ.

    Example:
        >>> study_distance("llama-3.1-8b", "0.26.0", "llama-3.1-8b", "0.26.1")
        0.0
        >>> study_distance("llama-3.1-8b", "0.26.0", "llama-3.1-8b", "0.25.0")
        0.5
        >>> round(study_distance("a", "0.26.0", "b", "0.26.0", (8e9, "Llama"), (7e9, "Qwen2")), 2)
        1.69
        >>> study_distance("a", "0.26.0", "b", "0.26.0", (8e9, "Llama"), (70e9, "Llama")) is None
        True
    """
    d = 0.0 if minor(version) == minor(earlier_version) else 0.5
    if model != earlier_model:
        if params is None or earlier_params is None or params[0] <= 0 or earlier_params[0] <= 0:
            return None
        d += 1.0 + abs(math.log2(params[0] / earlier_params[0])) + (0.0 if params[1] == earlier_params[1] else 0.5)
    return d if d <= MAX_DISTANCE else None


def _snap(param: Param, value: Any) -> Any:
    """``value`` moved onto ``param``'s domain, or None when it has no place there."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if param.kind == "bool":
        return bool(value)
    values = param.values()
    if param.kind == "categorical":
        choices = list(values or ())
        if value in choices:
            return choices[choices.index(value)]
        numeric = [c for c in choices if isinstance(c, (int, float)) and not isinstance(c, bool)]
        if not numeric or not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        if value > 0 and all(c > 0 for c in numeric):  # choices like max_num_seqs ladders: log distance
            return min(numeric, key=lambda c: abs(math.log(c / value)))
        return min(numeric, key=lambda c: abs(c - value))
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    clipped = min(max(float(value), float(param.low)), float(param.high))  # type: ignore[arg-type]
    if param.kind == "int":
        step = int(param.step or 1)
        k = round((clipped - int(param.low)) / step)  # type: ignore[arg-type]
        return int(min(int(param.low) + k * step, int(param.high)))  # type: ignore[arg-type]
    if values is not None:
        return min(values, key=lambda v: abs(v - clipped))
    return clipped


def fit_to_space(flags: Mapping[str, Any], space: SearchSpace) -> dict[str, Any]:
    """The searched flags of ``flags`` moved into ``space`` (see the module docstring); flags the
    space does not search are dropped (the spec's fixed flags apply to every trial anyway)."""
    out: dict[str, Any] = {}
    for name in space.names:
        if name in flags:
            value = _snap(space[name], flags[name])
            if value is not None:
                out[name] = value
    return out


def _best_feasible_row(history: pd.DataFrame, names: Sequence[str], objective: str, direction: str,
                       max_preemptions: int) -> pd.Series | None:
    """The best served trial of ``history`` within the preemption allowance, or None: the one row both
    a warm start's flags and the figure shown next to them come from."""
    if history.empty or objective not in history.columns:
        return None
    ok = history[(history["status"] == "ok") & history[objective].notna()]
    if "preemptions" in ok.columns:
        ok = ok[ok["preemptions"].fillna(0) <= max_preemptions]
    if ok.empty or any(f"flag_{n}" not in ok.columns for n in names):
        return None
    return ok.sort_values(objective, ascending=direction != "maximize", kind="stable").iloc[0]


def _row_flags(row: pd.Series, names: Sequence[str]) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for name in names:
        value = row[f"flag_{name}"]
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        out[name] = value.item() if hasattr(value, "item") else value
    return out or None


def warm_start_flags(history: pd.DataFrame, names: Sequence[str], objective: str, direction: str,
                     max_preemptions: int = 0) -> dict[str, Any] | None:
    """The searched flags of the best feasible trial in ``history`` (dataset rows), or None.

    Example:
        >>> df = pd.DataFrame({"status": ["ok", "ok", "startup_oom"], "preemptions": [0, 3, None],
        ...     "output_throughput": [10.0, 50.0, None], "flag_max_num_seqs": [32, 256, 512]})
        >>> warm_start_flags(df, ["max_num_seqs"], "output_throughput", "maximize")
        {'max_num_seqs': 32}
    """
    row = _best_feasible_row(history, names, objective, direction, max_preemptions)
    return None if row is None else _row_flags(row, names)


def warm_starts(history: pd.DataFrame, spec: StudySpec) -> list[WarmStart]:
    """The warm starts for ``spec`` from dataset rows ``history`` (any studies), nearest first."""
    if history.empty or "study" not in history.columns:
        return []
    rows = history[(history["gpu_type"].astype(str) == spec.gpu.type) & (history["study"].astype(str) != spec.name)]
    objective, direction = spec.objective.metrics[0], spec.objective.directions[0]
    profile = spec.model_profile
    mine = None if profile is None else (float(profile.param_count), profile.architecture)
    found: list[tuple[float, Any, WarmStart]] = []
    for name, group in rows.groupby(rows["study"].astype(str)):
        model = str(group["model"].iloc[0])
        versions = group["vllm_version"].dropna() if "vllm_version" in group.columns else pd.Series(dtype=object)
        version = str(versions.iloc[-1]) if not versions.empty else None
        distance = study_distance(spec.model_ref, spec.vllm_version, model, version,
                                  mine, _profile_key(model) if model != spec.model_ref else None)
        if distance is None:
            continue
        names = [c[len("flag_"):] for c in group.columns if c.startswith("flag_")]
        row = _best_feasible_row(group, names, objective, direction, spec.constraints.max_preemptions)
        if row is None:
            continue
        flags = _row_flags(row, names)
        if not flags:
            continue
        params = fit_to_space(flags, spec.search_space)
        if not params:
            continue
        # The figure of the trial whose flags these are (not the study's fastest, which may preempt).
        best = float(row[objective])
        newest = group["timestamp"].max() if "timestamp" in group.columns else 0
        found.append((distance, newest, WarmStart(str(name), model, version, distance, params, best)))
    found.sort(key=lambda f: (f[0], -_stamp(f[1])))
    out: list[WarmStart] = []
    for _, _, ws in found:
        if ws.params not in [w.params for w in out]:
            out.append(ws)
        if len(out) == MAX_WARM_STARTS:
            break
    return out


def baseline_flags(spec: StudySpec) -> dict[str, Any] | None:
    """vLLM's defaults (this version, model and GPU) for the searched flags, fitted to the space;
    None without a model profile or when vLLM would refuse the fixed flags alone."""
    if spec.model_profile is None:
        return None
    try:
        config = resolve_engine_config(dict(spec.fixed_flags), spec.model_profile, spec.gpu_spec(), spec.vllm_version)
    except SpecError:
        return None
    defaults = {name: getattr(config, name) for name in spec.search_space.names if hasattr(config, name)}
    return fit_to_space(defaults, spec.search_space) or None


def origin_of(user_attrs: Mapping[str, Any]) -> str:
    """Where a trial's flags came from: warm_start, baseline, informed or sampler."""
    if user_attrs.get("origin"):
        return str(user_attrs["origin"])
    return "informed" if user_attrs.get("informed_start") else "sampler"


# -- enqueueing (Optuna, the dataset) ---------------------------------------------------------------

def _warn_damaged(path: Path, reason: str) -> None:
    """One line on stderr per part file a warm start skips (a damaged file must not stop a new study)."""
    print(f"servetune: warning: warm start skipped {path}, not a readable Parquet file ({reason}); "
          "move it out of the dataset folder", file=sys.stderr)


def enqueue_warm_starts(spec: StudySpec, study: optuna.Study) -> list[WarmStart]:
    """Read the dataset and enqueue the warm starts (``warm_start`` on); returns them."""
    root = Path(spec.output.dataset_dir)
    if not spec.warm_start or not root.exists():
        return []
    starts = warm_starts(dataset.read_trials(root, on_damaged=_warn_damaged, gpu_type=spec.gpu.type), spec)
    for ws in starts:
        study.enqueue_trial(ws.params, user_attrs={"origin": "warm_start", "warm_start_from": ws.study,
                                                   "warm_start_distance": ws.distance}, skip_if_exists=True)
    return starts


def enqueue_baseline(spec: StudySpec, study: optuna.Study) -> dict[str, Any] | None:
    """Enqueue the baseline trial (``baseline_trial`` on); returns its flags."""
    if not spec.baseline_trial:
        return None
    flags = baseline_flags(spec)
    if flags:
        study.enqueue_trial(flags, user_attrs={"origin": "baseline"}, skip_if_exists=True)
    return flags


def _profile_key(model: str) -> tuple[float, str] | None:
    try:
        profile = load_model(model)
    except Exception:  # noqa: BLE001 - a model no longer resolvable is simply not comparable
        return None
    return float(profile.param_count), profile.architecture


def _stamp(value: Any) -> float:
    try:
        return float(pd.Timestamp(value).timestamp())
    except (TypeError, ValueError):
        return 0.0
