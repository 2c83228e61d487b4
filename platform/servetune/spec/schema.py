"""The study spec: one YAML file that says what to tune, on what, against which workload.

:func:`load_spec` reads the file; :meth:`StudySpec.from_dict` validates the data. Every mistake is
a :class:`~servetune.errors.SpecError` naming the dotted field and the fix, raised before any GPU
time is spent: malformed YAML (with its line), unknown keys (with a did-you-mean), wrong types,
out-of-range values, and impossible combinations (TP x PP above ``gpu.count``, ``budget.parallel``
trials that cannot fit the GPUs, a search space of which no combination passes the rules, ...).

The shape (only ``name``, ``model``, ``gpu``, ``workload`` and ``search_space`` are required)::

    name: quickstart                 # the study's name (top level): Optuna study, MLflow run, paths
    description: optional text
    model: llama-3.1-8b              # shipped name, a path (relative to this file) or an HF id in the cache
    serve_model: meta-llama/Llama-3.1-8B-Instruct   # optional: what `vllm serve` gets (default: derived)
    gpu: {type: A100-40GB, count: 2, file: my-gpus.yaml}  # count: GPUs the study may use; file: optional table
                                     # interconnect: nvlink | pcie | pcie-no-p2p (optional; default by type)
    workload: {input_len: 512, output_len: 1024, num_requests: 384, concurrency: 192}
    objective: {metric: output_throughput}          # or {pareto: [output_throughput, p99_ttft_ms]}, or cost_per_mtok
    prices: my-prices.yaml           # optional: your GPU price table (default: servetune/data/gpu_prices.yaml)
    constraints: {max_preemptions: 0, p99_ttft_ms: 2000, p99_itl_ms: 50, p99_e2e_ms: 60000}
    search_space: memory-pair        # a file (relative to this file), a bare name in search_spaces/, or inline
    fixed_flags: {max_model_len: 4096}   # pinned for every trial
    budget: {trials: 24, parallel: 2, time_limit_s: 600, confirm_top: 0, confirm_repeats: 2, confirm_on: same-start,
             wait_for_gpus_s: 30}  # wait_for_gpus_s: how long a trial may wait for Ray to place it
    backend: auto                    # auto (vllm where a GPU is visible, else sim) | vllm | sim | replay
    replay_file: landscape.csv       # backend replay only: recorded trials (flag_* + metric columns)
    prescreen: true                  # memory planner: prune predicted startup failures, informed starts
    early_stopping: true             # end a real trial's window once preempting / certainly below the best
    multi_fidelity: auto             # screen proposals on the calibrated simulator (auto: on for vllm/replay)
    warm_start: true                 # enqueue earlier studies' best configs (same/nearest model x GPU x vLLM)
    baseline_trial: true             # one trial with vLLM's defaults for the searched flags
    headroom: {enabled: true, max_load_scale: 2, max_prompt_scale: 2, tolerance: 0.1, max_simulations: 12}
                                     # the winner's headroom at the end (or headroom: false)
    selection: {min_headroom: 1.3}   # optional: the best flag set still meeting the constraints at 1.3x load and prompts
    measurement: {load_generator: servetune, startup_timeout_s: 600, stall_timeout_s: 180}  # vllm backend
    sampler: tpe                     # tpe | nsga2 | gp | random | grid (every point of a finite space)
    seed: 0
    vllm_version: "0.26.0"           # quote it: YAML reads 0.26 as a number
    tracking: {mlflow_uri: "sqlite:///servetune-runs/mlflow.db", experiment: quickstart}
    storage: {optuna_url: "sqlite:///servetune-runs/optuna.db"}   # or "memory"
    output: {runs_dir: servetune-runs, dataset_dir: servetune-runs/dataset}

Paths inside the spec (model, gpu.file, workload files, search_space) resolve relative to the spec
file; ``output`` paths resolve relative to the working directory. Objective metric names are the
keys of :meth:`servetune.result.TrialResult.metrics` (``ttft_p99_ms``); the ``vllm bench serve``
spelling (``p99_ttft_ms``) is accepted and normalised.

Example:
    >>> spec = load_spec("jobs/quickstart.yaml")            # doctest: +SKIP
    >>> spec.name, spec.gpu.type, spec.search_space.names    # doctest: +SKIP
    ('quickstart', 'A100-40GB', ('gpu_memory_utilization', 'max_num_seqs'))
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servetune.backends import BACKENDS, capabilities
from servetune.engines.base import LOAD_GENERATORS
from servetune.engines.vllm.bench_client import bench_argv
from servetune.cost import GpuPrice, load_prices
from servetune.errors import SpecError, did_you_mean
from servetune.inputs import shown
from servetune.planner import gpus, modelinfo
from servetune.planner.flags import argv_value, validate_flags
from servetune.planner.gpus import GpuSpec
from servetune.planner.modelinfo import ModelProfile
from servetune.redact import redact_text, redact_url
from servetune.spec.space import STATIC_DEFAULTS, SearchSpace, read_yaml
from servetune.vllm_version import DEFAULT_VLLM_VERSION, VERSION_RE
from servetune.workload import Workload

if TYPE_CHECKING:
    import optuna

__all__ = ["StudySpec", "GpuPool", "Objective", "Constraints", "Budget", "Measurement", "Tracking", "Storage", "Output",
           "HeadroomSettings", "Selection",
           "load_spec", "find_search_space", "sqlite_url", "SPEC_KEYS", "BACKENDS", "SAMPLERS", "METRIC_DIRECTIONS"]

SPEC_KEYS = ("name", "description", "model", "serve_model", "gpu", "workload", "objective", "constraints",
             "search_space", "fixed_flags", "budget", "backend", "sampler", "seed", "vllm_version", "tracking",
             "storage", "output", "prescreen", "replay_file", "measurement", "early_stopping", "multi_fidelity",
             "warm_start", "baseline_trial", "prices", "headroom", "selection")
REQUIRED_KEYS = ("name", "model", "gpu", "workload", "search_space")
SAMPLERS = ("tpe", "nsga2", "gp", "random", "grid")
_THROUGHPUT = ("output_throughput", "total_token_throughput", "request_throughput")
_LATENCY = tuple(f"{stem}_{stat}_ms" for stem in ("ttft", "itl", "tpot", "e2e") for stat in ("mean", "p50", "p90", "p99"))
#: Objective metrics (TrialResult.metrics() keys) and the direction each is optimised in.
METRIC_DIRECTIONS: Mapping[str, str] = {**{m: "maximize" for m in _THROUGHPUT}, **{m: "minimize" for m in _LATENCY},
                                        # goodput and cost at the SLO (servetune.cost): only requests that met the
                                        # latency constraints count; cost is the GPU type's price x GPUs over them
                                        "goodput_output_throughput": "maximize", "cost_per_mtok": "minimize"}
# `vllm bench serve` writes p99_ttft_ms; TrialResult.metrics() writes ttft_p99_ms.
_METRIC_ALIASES = {f"{stat}_{stem}_ms": f"{stem}_{stat}_ms"
                   for stem in ("ttft", "itl", "tpot", "e2e") for stat in ("mean", "p50", "p90", "p99")}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_DEFAULT_RUNS_DIR = "servetune-runs"
#: The shortest budget.wait_for_gpus_s (a trial's Ray worker takes seconds to start; see
#: servetune.cluster.pool.PLACEMENT_GRACE_S).
MIN_WAIT_FOR_GPUS_S = 10.0
_FEASIBILITY_LIMIT = 20_000  # combinations listed at load time to prove the space can start at all


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GpuPool:
    """The GPUs the study may use: their type (a :mod:`servetune.planner.gpus` name) and how many."""

    type: str
    count: int = 1
    file: str | None = None  # a user GPU table (YAML), registered before ``type`` is looked up
    #: How the GPUs reach each other (servetune.planner.gpus.INTERCONNECTS); None: the type's usual host.
    interconnect: str | None = None


@dataclasses.dataclass(frozen=True)
class Objective:
    """What the study optimises: one metric, or several for a Pareto front."""

    metrics: tuple[str, ...] = ("output_throughput",)
    directions: tuple[str, ...] = ("maximize",)

    @property
    def metric(self) -> str:
        return self.metrics[0]

    @property
    def is_pareto(self) -> bool:
        return len(self.metrics) > 1


@dataclasses.dataclass(frozen=True)
class Constraints:
    """Limits a trial must meet to count: preemptions and optional p99 latencies (ms)."""

    max_preemptions: int = 0
    p99_ttft_ms: float | None = None
    p99_itl_ms: float | None = None
    p99_e2e_ms: float | None = None

    def limits(self) -> dict[str, float]:
        """TrialResult.metrics() key -> the largest allowed value."""
        out = {"preemptions": float(self.max_preemptions)}
        for key in ("p99_ttft_ms", "p99_itl_ms", "p99_e2e_ms"):
            value = getattr(self, key)
            if value is not None:
                out[_METRIC_ALIASES[key]] = float(value)
        return out


#: Where confirmation repeats are measured (``budget.confirm_on``).
CONFIRM_ON = ("same-start", "restart")


@dataclasses.dataclass(frozen=True)
class Budget:
    trials: int = 20
    parallel: int = 1  # trials at once
    #: No new trial, and no confirmation repeat, starts after this many seconds of the study
    #: (running ones finish); ``--resume`` goes on from there.
    time_limit_s: float | None = None
    #: After the budget: re-run the top ``confirm_top`` feasible configs ``confirm_repeats`` times
    #: each (another workload seed per repeat) and choose the winner on the confirmed means.
    confirm_top: int = 0
    confirm_repeats: int = 2
    #: Where a repeat is measured (vllm backend): ``same-start``: a trial whose own window leads
    #: the study (ran to its end, feasible, at or above the best so far) measures its repeats on
    #: the server it started, right after that window, so a winner found that way is confirmed
    #: without another vLLM start (:class:`servetune.engines.LeaderRepeats`); only a top
    #: configuration left unconfirmed is started again after the budget. ``restart``: every
    #: repeat is a start of its own (it then also samples the start: graph capture, the host).
    confirm_on: str = "same-start"
    #: How long a trial may wait for Ray to place it on GPUs of the spec's type (a cluster with
    #: none of them, or an autoscaler still adding nodes) before the study stops, naming what the
    #: cluster has; a placed trial's own run is not bounded by it.
    wait_for_gpus_s: float = 30.0


@dataclasses.dataclass(frozen=True)
class Measurement:
    """How the vllm backend measures a trial (the simulated engine ignores it)."""

    load_generator: str = "servetune"  # or "vllm-bench": `vllm bench serve` drives the load
    startup_timeout_s: float | None = None  # None: SERVETUNE_STARTUP_TIMEOUT_S (600 s by default)
    stall_timeout_s: float = 180.0  # no token on any stream for this long: the engine stalled, a timeout


@dataclasses.dataclass(frozen=True)
class Tracking:
    mlflow_uri: str
    experiment: str


@dataclasses.dataclass(frozen=True)
class Storage:
    optuna_url: str | None  # None: Optuna's in-memory storage (``optuna_url: memory``)


@dataclasses.dataclass(frozen=True)
class Output:
    runs_dir: Path
    dataset_dir: Path


@dataclasses.dataclass(frozen=True)
class HeadroomSettings:
    """The winner's headroom at the end of a study (:mod:`servetune.search.headroom`): how far
    each axis is searched, how fine, and at most how many simulations per flag set."""

    enabled: bool = True
    max_load_scale: float = 2.0
    max_prompt_scale: float = 2.0
    tolerance: float = 0.1
    max_simulations: int = 12


@dataclasses.dataclass(frozen=True)
class Selection:
    """How the winner is chosen beyond the objective: ``min_headroom`` X picks the best flag set
    that still meets every constraint with load and prompts X times the workload's."""

    min_headroom: float | None = None


# ---------------------------------------------------------------------------------------------
# Small validators
# ---------------------------------------------------------------------------------------------


def _section(data: Any, field: str, keys: tuple[str, ...], example: str) -> Mapping[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise SpecError(field, f"expected a mapping, got {type(data).__name__} {shown(data)}", f"write {field}: {example}")
    for key in data:
        if key not in keys:
            raise SpecError(f"{field}.{key}", f"unknown key{did_you_mean(str(key), keys)}", f"allowed keys: {', '.join(keys)}")
    return data


def _int(value: Any, field: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise SpecError(field, f"expected an integer, got {shown(value)}", "write a whole number")
    if value < minimum:
        raise SpecError(field, f"must be >= {minimum}, got {value}", f"use a value >= {minimum}")
    if maximum is not None and value > maximum:
        raise SpecError(field, f"must be <= {maximum}, got {value}", f"use a value <= {maximum}")
    return value


def _positive(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SpecError(field, f"expected a positive number, got {shown(value)}", "write a number > 0, or leave it out")
    return float(value)


def _text(value: Any, field: str, example: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SpecError(field, f"expected a non-empty string, got {shown(value)}", f"write {field}: {example}")
    return value.strip()


def _choice(value: Any, field: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise SpecError(field, f"invalid value {shown(value)}{did_you_mean(str(value), choices)}", f"use one of: {', '.join(choices)}")
    return value


def _relative(base_dir: Path | None, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() or base_dir is None else base_dir / p


def _repo_search_spaces() -> Path:
    # platform/servetune/spec/schema.py -> the repository root holds search_spaces/
    return Path(__file__).resolve().parents[3] / "search_spaces"


def find_search_space(ref: str, base_dir: Path | None = None, cwd: Path | None = None) -> Path:
    """Resolve ``search_space: <ref>``: relative to the spec file, then a bare name in the repo's
    ``search_spaces/``, then in ``./search_spaces/``; ``.yaml`` may be left off."""
    names = [ref] if ref.endswith((".yaml", ".yml")) else [ref, ref + ".yaml", ref + ".yml"]
    dirs: list[Path] = [base_dir or Path.cwd()]
    if "/" not in ref and "\\" not in ref:
        dirs += [_repo_search_spaces(), (cwd or Path.cwd()) / "search_spaces"]
    tried = []
    for d in dirs:
        for n in names:
            p = _relative(d, n)
            tried.append(str(p))
            if p.is_file():
                return p
    shipped = sorted(p.stem for p in _repo_search_spaces().glob("*.yaml"))
    raise SpecError("search_space", f"no search space file {shown(ref)}{did_you_mean(ref, shipped)} (tried {', '.join(tried)})",
                    f"give a path relative to the spec file, or a shipped name: {', '.join(shipped) or 'none found'}")


# ---------------------------------------------------------------------------------------------
# Section parsers
# ---------------------------------------------------------------------------------------------


def _parse_model(raw: Any, serve_raw: Any, base_dir: Path | None) -> tuple[str, str, ModelProfile | None]:
    text = argv_value(_text(raw, "model", "llama-3.1-8b (a shipped name), ./my-model (a directory) or org/name (HF id)"),
                      "model")
    given = None if serve_raw is None else argv_value(  # given to `vllm serve` as is: checked before anything is read
        _text(serve_raw, "serve_model", "meta-llama/Llama-3.1-8B-Instruct"), "serve_model")
    candidate = _relative(base_dir, text)
    is_path = text.startswith((".", "/", "~")) or text.endswith(".json") or candidate.exists()
    if is_path:
        if not candidate.exists():
            raise SpecError("model", f"path not found: {candidate}",
                            "paths resolve relative to the spec file; point at a directory holding config.json")
        ref = str(candidate.resolve())
    else:
        ref = text
    profile = None
    shipped_name_or_path: str | None = None
    try:
        profile = modelinfo.load_model(ref)
    except SpecError as exc:
        message = exc.message if exc.field in ("model", "") else f"{exc.field}: {exc.message}"
        raise SpecError("model", message, exc.fix) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SpecError("model", f"cannot read the model config of {text!r}: {exc}",
                        "give a shipped name, a directory holding config.json, or an HF id in the local cache") from None
    if not is_path and text.lower() in modelinfo.known_models():
        try:  # a shipped config names the Hugging Face repo vLLM should load
            shipped_name_or_path = json.loads(Path(profile.source).read_text()).get("_name_or_path")
        except (OSError, ValueError, AttributeError):
            shipped_name_or_path = None
    if given is not None:
        serve = given
    elif is_path:
        serve = str(Path(ref).parent) if ref.endswith(".json") else ref
    else:
        serve = shipped_name_or_path if isinstance(shipped_name_or_path, str) and shipped_name_or_path else text
    return ref, argv_value(serve, "model"), profile


_MAX_REQUESTS = 1_000_000  # per trial; more is a typo, and would take minutes just to generate


def _parse_workload(raw: Any, base_dir: Path | None) -> Workload:
    if isinstance(raw, Mapping):
        for key in ("num_requests", "warmup_requests"):
            value = raw.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > _MAX_REQUESTS:
                raise SpecError(f"workload.{key}", f"must be <= {_MAX_REQUESTS:,}, got {value:,}",
                                "a few hundred to a few thousand requests measure a configuration well")
    try:
        return Workload.from_dict(raw, "workload", base_dir)
    except SpecError:
        raise
    except (ValueError, TypeError, OverflowError, KeyError) as exc:  # a value Workload did not vet (e.g. NaN)
        raise SpecError("workload", f"invalid workload: {exc}", "use finite numbers for lengths, counts and rates") from None


def _parse_gpu(raw: Any, base_dir: Path | None) -> GpuPool:
    if raw is None or not isinstance(raw, Mapping):
        raise SpecError("gpu", f"expected a mapping, got {shown(raw)}", "write gpu: {type: A100-40GB, count: 1}")
    data = _section(raw, "gpu", ("type", "count", "file", "interconnect"), "{type: A100-40GB, count: 1}")
    if "type" not in data:
        raise SpecError("gpu.type", "is required", "add type: e.g. H200, A100-40GB, L40S")
    gpu_type = _text(data["type"], "gpu.type", "A100-40GB")
    count = _int(data.get("count", 1), "gpu.count", 1, 4096)
    file = None
    if data.get("file") is not None:
        path = _relative(base_dir, _text(data["file"], "gpu.file", "my-gpus.yaml"))
        if not path.is_file():
            raise SpecError("gpu.file", f"file not found: {path}", "paths resolve relative to the spec file")
        file = str(path.resolve())
    if file is not None:
        try:
            gpus.register_gpus_from_yaml(file)
        except SpecError as exc:
            raise SpecError("gpu.file", f"{exc.field}: {exc.message}" if exc.field else exc.message, exc.fix) from None
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise SpecError("gpu.file", f"cannot read {file}: {exc}", "see servetune.planner.gpus for the table format") from None
    try:
        gpu = gpus.get_gpu(gpu_type)
        gpu_type = gpu.name  # canonical spelling ("a100-40gb" -> "A100-40GB")
    except SpecError as exc:
        raise SpecError("gpu.type", exc.message, exc.fix) from None
    link = gpus.with_interconnect(gpu, data.get("interconnect"), "gpu.interconnect").interconnect
    return GpuPool(gpu_type, count, file, link or None)


def _metric(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise SpecError(field, f"expected a metric name, got {shown(value)}", f"use one of: {', '.join(METRIC_DIRECTIONS)}")
    name = _METRIC_ALIASES.get(value, value)
    if name not in METRIC_DIRECTIONS:
        known = [*METRIC_DIRECTIONS, *_METRIC_ALIASES]
        raise SpecError(field, f"unknown metric {shown(value)}{did_you_mean(value, known)}",
                        f"use one of: {', '.join(METRIC_DIRECTIONS)}")
    return name


def _parse_objective(raw: Any) -> Objective:
    if raw is None:
        return Objective()
    if isinstance(raw, str):
        raw = {"metric": raw}
    data = _section(raw, "objective", ("metric", "direction", "pareto", "directions"), "{metric: output_throughput}")
    if ("metric" in data) == ("pareto" in data):
        raise SpecError("objective", "set exactly one of metric and pareto",
                        "objective: {metric: output_throughput} or objective: {pareto: [output_throughput, p99_ttft_ms]}")
    if "metric" in data:
        if "directions" in data:
            raise SpecError("objective.directions", "applies to pareto only", "use direction: for a single metric")
        metrics = [_metric(data["metric"], "objective.metric")]
        given = [data["direction"]] if "direction" in data else None
        dfield = "objective.direction"
    else:
        if "direction" in data:
            raise SpecError("objective.direction", "applies to metric only", "use directions: [...] with pareto")
        raw_list = data["pareto"]
        if not isinstance(raw_list, list) or len(raw_list) < 2:
            raise SpecError("objective.pareto", f"expected a list of at least 2 metrics, got {shown(raw_list)}",
                            "e.g. pareto: [output_throughput, p99_ttft_ms]; for one metric use metric:")
        metrics = [_metric(m, f"objective.pareto[{i}]") for i, m in enumerate(raw_list)]
        if len(set(metrics)) != len(metrics):
            raise SpecError("objective.pareto", f"names a metric twice: {shown(raw_list)}", "list each metric once")
        given = data.get("directions")
        if given is not None and (not isinstance(given, list) or len(given) != len(metrics)):
            raise SpecError("objective.directions", f"expected a list of {len(metrics)} directions, got {shown(given)}",
                            "one of maximize/minimize per pareto metric, or leave directions out")
        dfield = "objective.directions"
    natural = [METRIC_DIRECTIONS[m] for m in metrics]
    if given is not None:
        for i, (d, want, m) in enumerate(zip(given, natural, metrics, strict=True)):
            sub = dfield if len(metrics) == 1 and dfield.endswith("direction") else f"{dfield}[{i}]"
            _choice(d, sub, ("maximize", "minimize"))
            if d != want:
                raise SpecError(sub, f"{m} can only be {want}d, got {d}",
                                f"write {want} (throughputs are maximized, latencies minimized), or leave it out")
    return Objective(tuple(metrics), tuple(natural))


def _parse_prices(raw: Any, base_dir: Path | None, gpu: GpuPool, objective: Objective) -> tuple[GpuPrice | None, Path | None]:
    """``prices``: the spec's own price table (relative to the spec file) or the shipped one; the
    study's GPU type must be priced when an objective is ``cost_per_mtok``."""
    path = None
    if raw is not None:
        path = _relative(base_dir, _text(raw, "prices", "my-prices.yaml"))
        if not path.is_file():
            raise SpecError("prices", f"file not found: {path}", "paths resolve relative to the spec file")
        path = path.resolve()
    table = load_prices(path, "prices")
    price = table.get(gpu.type)
    if price is None and "cost_per_mtok" in objective.metrics:
        table.price(gpu.type, "prices")  # raises: the table, the GPU, the fix
    return price, path


def _parse_constraints(raw: Any) -> Constraints:
    keys = ("max_preemptions", "p99_ttft_ms", "p99_itl_ms", "p99_e2e_ms")
    data = _section(raw, "constraints", keys, "{max_preemptions: 0, p99_ttft_ms: 2000}")
    max_pre = data.get("max_preemptions", 0)
    if max_pre is None:
        raise SpecError("constraints.max_preemptions", "must be a count, got null",
                        "write max_preemptions: 0 (no preemption), or a larger tolerated count")
    return Constraints(
        max_preemptions=_int(max_pre, "constraints.max_preemptions", 0),
        **{k: (None if data.get(k) is None else _positive(data[k], f"constraints.{k}")) for k in keys[1:]},
    )


def _parse_budget(raw: Any) -> Budget:
    data = _section(raw, "budget", ("trials", "parallel", "time_limit_s", "confirm_top", "confirm_repeats",
                                    "confirm_on", "wait_for_gpus_s"), "{trials: 24, parallel: 2}")
    time_limit = data.get("time_limit_s")
    return Budget(
        trials=_int(data.get("trials", Budget.trials), "budget.trials", 1, 1_000_000),
        parallel=_int(data.get("parallel", Budget.parallel), "budget.parallel", 1, 4096),
        time_limit_s=None if time_limit is None else _positive(time_limit, "budget.time_limit_s"),
        confirm_top=_int(data.get("confirm_top", Budget.confirm_top), "budget.confirm_top", 0, 100),
        confirm_repeats=_int(data.get("confirm_repeats", Budget.confirm_repeats), "budget.confirm_repeats", 1, 100),
        confirm_on=_choice(data.get("confirm_on", Budget.confirm_on), "budget.confirm_on", CONFIRM_ON),
        wait_for_gpus_s=_wait_for_gpus(data.get("wait_for_gpus_s", Budget.wait_for_gpus_s)),
    )


def _wait_for_gpus(value: Any) -> float:
    seconds = _positive(value, "budget.wait_for_gpus_s")
    if seconds < MIN_WAIT_FOR_GPUS_S:
        raise SpecError("budget.wait_for_gpus_s", f"must be at least {MIN_WAIT_FOR_GPUS_S:g} s, got {value!r}: "
                        "starting a trial's Ray worker alone takes seconds",
                        "write budget.wait_for_gpus_s: 30 (or more where an autoscaler adds GPU nodes)")
    return seconds


def _parse_measurement(raw: Any) -> Measurement:
    data = _section(raw, "measurement", ("load_generator", "startup_timeout_s", "stall_timeout_s"),
                    "{load_generator: servetune, startup_timeout_s: 600}")
    startup = data.get("startup_timeout_s")
    return Measurement(
        load_generator=_choice(data.get("load_generator", Measurement.load_generator), "measurement.load_generator",
                               LOAD_GENERATORS),
        startup_timeout_s=None if startup is None else _positive(startup, "measurement.startup_timeout_s"),
        stall_timeout_s=_positive(data.get("stall_timeout_s", Measurement.stall_timeout_s),
                                  "measurement.stall_timeout_s"),
    )


def _check_load_generator(measurement: Measurement, workload: Workload, serve_model: str, objective: Objective) -> None:
    """``vllm bench serve`` must be able to send the workload, and it records no per-request latencies,
    which goodput and cost count request by request."""
    if measurement.load_generator != "vllm-bench":
        return
    bench_argv(workload, base_url="http://127.0.0.1:1", model=serve_model, result_dir=".")  # SpecError if it cannot
    per_request = sorted({"goodput_output_throughput", "cost_per_mtok"} & set(objective.metrics))
    if per_request:
        raise SpecError("objective", f"{per_request[0]} needs each request's latencies, which servetune's "
                        "own load generator records and measurement.load_generator: vllm-bench does not",
                        "use measurement: {load_generator: servetune}, or another objective")


def _scale(value: Any, field: str, limit: float = 64.0) -> float:
    number = _positive(value, field)
    if not 1.0 < number <= limit:
        raise SpecError(field, f"must be above 1 and at most {limit:g}, got {shown(value)}",
                        "write a scale of the workload, e.g. 2 (twice the load or the prompt length)")
    return number


def _parse_headroom(raw: Any) -> HeadroomSettings:
    if raw is None or isinstance(raw, bool):
        return HeadroomSettings(enabled=True if raw is None else raw)
    keys = ("enabled", "max_load_scale", "max_prompt_scale", "tolerance", "max_simulations")
    data = _section(raw, "headroom", keys, "{enabled: true, max_load_scale: 4}  (or headroom: false)")
    enabled = data.get("enabled", True)
    if not isinstance(enabled, bool):
        raise SpecError("headroom.enabled", f"expected true or false, got {shown(enabled)}",
                        "write headroom: {enabled: false} (or headroom: false) to skip it")
    tolerance = _positive(data.get("tolerance", HeadroomSettings.tolerance), "headroom.tolerance")
    if tolerance >= 1.0:
        raise SpecError("headroom.tolerance", f"must be below 1, got {shown(data.get('tolerance'))}",
                        "write the bracket's relative width, e.g. 0.1 (edges within 10%)")
    return HeadroomSettings(
        enabled=enabled,
        max_load_scale=_scale(data.get("max_load_scale", HeadroomSettings.max_load_scale), "headroom.max_load_scale"),
        max_prompt_scale=_scale(data.get("max_prompt_scale", HeadroomSettings.max_prompt_scale),
                                "headroom.max_prompt_scale"),
        tolerance=tolerance,
        max_simulations=_int(data.get("max_simulations", HeadroomSettings.max_simulations), "headroom.max_simulations",
                             2, 500))


def _parse_selection(raw: Any, headroom: HeadroomSettings) -> Selection:
    data = _section(raw, "selection", ("min_headroom",), "{min_headroom: 1.3}")
    if data.get("min_headroom") is None:
        return Selection()
    top = min(headroom.max_load_scale, headroom.max_prompt_scale)
    value = _scale(data["min_headroom"], "selection.min_headroom", top)
    if not headroom.enabled:
        raise SpecError("selection.min_headroom", "selects on the headroom, which headroom: false turns off",
                        "turn headroom on (remove headroom: false), or drop selection")
    return Selection(min_headroom=value)


def _check_grid(space: SearchSpace, fixed: Mapping[str, Any], budget: Budget) -> tuple[Budget, list[str]]:
    """``sampler: grid`` needs a finite space without conditional parameters (Optuna's GridSampler
    fixes every parameter of every trial). A budget above the grid's size is capped at it, with a
    warning: a grid visits each point once."""
    for p in space.params:
        if p.when is not None:
            raise SpecError("sampler", f"grid cannot search the conditional parameter {shown(p.name)}",
                            "use sampler: random (or tpe), or make the parameter unconditional")
    size = space.size(fixed)
    if size == math.inf:
        space.grid(fixed)  # raises the SpecError naming the float parameter without a step
    if budget.trials > size:
        return (dataclasses.replace(budget, trials=int(size)),
                [f"sampler grid: the grid has {int(size)} points; budget.trials {budget.trials} capped at {int(size)}"])
    return budget, []


def _switch(data: Mapping[str, Any], key: str, default: bool, what: str) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(key, f"expected true or false, got {shown(value)}", f"write {key}: true ({what}) or {key}: false")
    return value


def _parse_version(raw: Any) -> str:
    if raw is None:
        return DEFAULT_VLLM_VERSION
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        raise SpecError("vllm_version", f"YAML read {shown(raw)} as a number", f'quote it: vllm_version: "{raw}"')
    # A plain release number, as pip and the image tags write it ("0.26.0"); the planner's reader
    # would also take "v0.26", which a spec refuses so that one study is always named one way.
    if not isinstance(raw, str) or raw.strip().startswith("v") or not VERSION_RE.fullmatch(raw.strip()):
        raise SpecError("vllm_version", f"expected a version like \"0.26.0\", got {shown(raw)}", 'write vllm_version: "0.26.0"')
    return raw.strip()


def _parse_search_space(raw: Any, base_dir: Path | None, cwd: Path) -> tuple[SearchSpace, Path | None]:
    if isinstance(raw, str):
        path = find_search_space(raw.strip(), base_dir, cwd)
        return SearchSpace.load(path, "search_space"), path.resolve()
    if isinstance(raw, Mapping):
        return SearchSpace.from_dict(raw, "search_space"), None
    raise SpecError("search_space", f"expected a file name or an inline mapping, got {shown(raw)}",
                    "write search_space: memory-pair, a path, or {params: {...}, rules: [...]}")


def _parse_replay_file(raw: Any, backend: str, base_dir: Path | None, space: SearchSpace, fixed: Mapping[str, Any],
                       objective: Objective, constraints: Constraints) -> Path | None:
    """``replay_file``: required by ``backend: replay``; the file must exist and hold the columns
    the study reads (status, ``flag_<name>`` for every searched and pinned flag, the objective and
    constraint metrics)."""
    if raw is None:
        if capabilities(backend).reads_landscape:
            raise SpecError("replay_file", "backend replay needs a recorded landscape",
                            "add replay_file: landscape.csv (a CSV/Parquet of trials, e.g. a servetune dataset export)")
        return None
    path = _relative(base_dir, _text(raw, "replay_file", "landscape.csv"))
    if not path.exists():
        raise SpecError("replay_file", f"file not found: {path}", "paths resolve relative to the spec file")
    if not capabilities(backend).reads_landscape:
        raise SpecError("replay_file", f"applies to backend: replay only (backend is {backend})",
                        "set backend: replay, or remove replay_file")
    # pandas and the dataset reader only for a replay spec: every other spec loads without them.
    from servetune.engines.replay import missing_columns, read_landscape

    try:
        frame = read_landscape(path)
    except SpecError:
        raise
    except (OSError, ValueError) as exc:
        raise SpecError("replay_file", f"cannot read {path}: {exc}", "give a CSV or Parquet file of trials") from None
    metrics = list(dict.fromkeys([*objective.metrics, *constraints.limits()]))
    missing = missing_columns(frame, [*space.names, *fixed], metrics)
    if missing:
        raise SpecError("replay_file", f"{path} lacks the column(s) {', '.join(missing)}",
                        "record a landscape over the same flags and metrics (servetune's dataset has them all)")
    return path.resolve()


def sqlite_url(path: str | Path) -> str:
    """The SQLAlchemy URL of the SQLite file at ``path``, built with SQLAlchemy's URL builder (never
    pasted together): a ``?`` or ``#`` in a folder name stays part of the path instead of starting a
    query that would point Optuna or MLflow at another file.

    Example:
        >>> sqlite_url("/runs/victim.db?x/optuna.db")
        'sqlite:////runs/victim.db%3Fx/optuna.db'
        >>> from sqlalchemy.engine import make_url
        >>> make_url(sqlite_url("/runs/victim.db?x/optuna.db")).database
        '/runs/victim.db?x/optuna.db'
    """
    from sqlalchemy.engine import URL  # Optuna's and MLflow's own dependency

    return URL.create("sqlite", database=str(path)).render_as_string(hide_password=False)


def _parse_output(raw: Any, cwd: Path) -> Output:
    data = _section(raw, "output", ("runs_dir", "dataset_dir"), "{runs_dir: servetune-runs}")
    runs = _relative(cwd, _text(data.get("runs_dir", _DEFAULT_RUNS_DIR), "output.runs_dir", _DEFAULT_RUNS_DIR))
    dataset = (runs / "dataset" if data.get("dataset_dir") is None
               else _relative(cwd, _text(data["dataset_dir"], "output.dataset_dir", "servetune-runs/dataset")))
    return Output(runs, dataset)


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------


def _parse_name(value: Any) -> str:
    """The study's name: Optuna's key, MLflow's run name and the runs folder's, written as it is.

    It is never redacted, so a name holding a token (or a secret environment variable's value) is
    refused here.
    """
    name = _text(value, "name", "my-study")
    if not _NAME_RE.match(name):
        raise SpecError("name", f"{shown(name)} is not a valid study name",
                        "use letters, digits, '.', '_' and '-' (it names files and MLflow runs), at most 128")
    if redact_text(name) != name:
        raise SpecError("name", "holds a token or a secret environment variable's value",
                        "name the study without credentials: the name is written to MLflow, Optuna and the "
                        "runs folder as it is")
    return name


@dataclasses.dataclass(frozen=True)
class StudySpec:
    """A validated study. Build it with :func:`load_spec` or :meth:`from_dict`, never by hand."""

    name: str
    model_ref: str  # what servetune.planner.modelinfo.load_model reads: a shipped name, an absolute path or an HF id
    serve_model: str  # what `vllm serve` is given
    gpu: GpuPool
    workload: Workload
    objective: Objective
    constraints: Constraints
    search_space: SearchSpace  # its ``pinned`` holds fixed_flags, so conditions see them
    fixed_flags: dict[str, Any]
    budget: Budget
    backend: str
    sampler: str
    seed: int
    vllm_version: str
    tracking: Tracking
    storage: Storage
    output: Output
    description: str | None = None
    search_space_file: Path | None = None
    warnings: tuple[str, ...] = ()  # non-fatal findings, e.g. choices that can never start
    model_profile: ModelProfile | None = dataclasses.field(default=None, compare=False, repr=False)
    base_dir: Path | None = dataclasses.field(default=None, compare=False, repr=False)
    cwd: Path | None = dataclasses.field(default=None, compare=False, repr=False)
    source: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    #: Run the memory planner before each launch: a predicted startup failure is told as ``pruned``
    #: without using a GPU, and a fresh study starts from the preemption prior's informed points.
    prescreen: bool = True
    replay_file: Path | None = None  # backend replay: the recorded landscape
    measurement: Measurement = Measurement()
    #: End a real trial's measured window once its outcome is decided (:mod:`servetune.engines.early_stop`).
    early_stopping: bool = True
    #: Screen proposals on the simulator calibrated on the study's real trials (:mod:`servetune.search.screen`);
    #: None: on for the vllm and replay backends, off for sim (the simulator would screen itself).
    multi_fidelity: bool | None = None
    warm_start: bool = True  # enqueue earlier studies' best configs (:mod:`servetune.search.warmstart`)
    baseline_trial: bool = True  # enqueue one trial with vLLM's defaults for the searched flags
    #: The GPU type's list price (``prices:``, else the shipped table; None where the table has no
    #: entry): what ``cost_per_mtok`` multiplies (:mod:`servetune.cost`).
    gpu_price: GpuPrice | None = None
    prices_file: Path | None = None  # the spec's own price table, when it names one
    headroom: HeadroomSettings = HeadroomSettings()  # the winner's headroom at the end of the study
    selection: Selection = Selection()  # robustness: the best flag set with headroom >= min_headroom

    def multi_fidelity_on(self, backend: str) -> bool:
        """Whether proposals are screened on the simulator for trials run on ``backend``."""
        return capabilities(backend).costly if self.multi_fidelity is None else self.multi_fidelity

    @classmethod
    def from_dict(cls, data: Any, base_dir: str | Path | None = None, *, cwd: str | Path | None = None) -> StudySpec:
        """Validate spec data. ``base_dir`` anchors the spec's relative paths (the spec file's folder);
        ``cwd`` anchors the output paths (default: the working directory).

        Example:
            >>> spec = StudySpec.from_dict({
            ...     "name": "demo", "model": "servetune-test-850m", "gpu": {"type": "H200"},
            ...     "workload": {"input_len": 256, "output_len": 64, "num_requests": 32, "concurrency": 8},
            ...     "search_space": {"params": {"max_num_seqs": [32, 64]}}}, cwd="/tmp")
            >>> spec.objective.metrics, spec.budget.trials, spec.storage.optuna_url
            (('output_throughput',), 20, 'sqlite:////tmp/servetune-runs/optuna.db')
        """
        if not isinstance(data, Mapping):
            raise SpecError("spec", f"expected a mapping of sections, got {type(data).__name__}",
                            "start from jobs/quickstart.yaml")
        base = Path(base_dir) if base_dir is not None else None
        here = Path(cwd) if cwd is not None else Path.cwd()
        for key in data:
            if key not in SPEC_KEYS:
                if key == "study":
                    raise SpecError("study", "unknown key", "write the study's name at the top level: name: my-study")
                raise SpecError(str(key), f"unknown key{did_you_mean(str(key), SPEC_KEYS)}",
                                f"allowed keys: {', '.join(SPEC_KEYS)}")
        for key in REQUIRED_KEYS:
            if data.get(key) is None:
                raise SpecError(key, "is required", {
                    "name": "add name: my-study", "model": "add model: llama-3.1-8b",
                    "gpu": "add gpu: {type: A100-40GB, count: 1}",
                    "workload": "add workload: {input_len: 512, output_len: 256, num_requests: 200, concurrency: 64}",
                    "search_space": "add search_space: memory-pair"}[key])

        name = _parse_name(data["name"])
        description = data.get("description")
        if description is not None and not isinstance(description, str):
            raise SpecError("description", f"expected text, got {shown(description)}", "quote it")
        model_ref, serve_model, profile = _parse_model(data["model"], data.get("serve_model"), base)
        gpu = _parse_gpu(data["gpu"], base)
        workload = _parse_workload(data["workload"], base)
        objective = _parse_objective(data.get("objective"))
        constraints = _parse_constraints(data.get("constraints"))
        space, space_file = _parse_search_space(data["search_space"], base, here)
        fixed = validate_flags(data.get("fixed_flags") or {}, "fixed_flags")
        budget = _parse_budget(data.get("budget"))
        backend = _choice(data.get("backend", "auto"), "backend", BACKENDS)
        sampler = _choice(data.get("sampler", "tpe"), "sampler", SAMPLERS)
        seed = _int(data.get("seed", 0), "seed", 0, 2**32 - 1)
        vllm_version = _parse_version(data.get("vllm_version"))
        output = _parse_output(data.get("output"), here)
        tdata = _section(data.get("tracking"), "tracking", ("mlflow_uri", "experiment"), "{experiment: my-study}")
        tracking = Tracking(
            mlflow_uri=(sqlite_url(output.runs_dir / "mlflow.db") if tdata.get("mlflow_uri") is None
                        else _text(tdata["mlflow_uri"], "tracking.mlflow_uri", "http://mlflow:5000")),
            experiment=name if tdata.get("experiment") is None else _text(tdata["experiment"], "tracking.experiment", name))
        sdata = _section(data.get("storage"), "storage", ("optuna_url",), '{optuna_url: "sqlite:///optuna.db"}')
        url = sdata.get("optuna_url")
        if url is None:
            optuna_url: str | None = sqlite_url(output.runs_dir / "optuna.db")
        else:
            url = _text(url, "storage.optuna_url", '"sqlite:///servetune-runs/optuna.db"')
            if url != "memory" and "://" not in url:
                raise SpecError("storage.optuna_url", f"expected an SQLAlchemy URL or 'memory', got {shown(url)}",
                                'e.g. "sqlite:///servetune-runs/optuna.db" or "postgresql://user:pass@host/db"')
            optuna_url = None if url == "memory" else url

        prescreen = data.get("prescreen", True)
        if not isinstance(prescreen, bool):
            raise SpecError("prescreen", f"expected true or false, got {shown(prescreen)}",
                            "write prescreen: true (skip predicted startup failures) or prescreen: false")
        switches = {key: _switch(data, key, default, what) for key, default, what in (
            ("early_stopping", True, "end a trial once it is certainly preempting or below the best"),
            ("warm_start", True, "start from earlier studies' best configs"),
            ("baseline_trial", True, "measure vLLM's defaults once"))}
        multi_fidelity = data.get("multi_fidelity", "auto")
        if multi_fidelity == "auto" or multi_fidelity is None:
            multi_fidelity = None
        elif not isinstance(multi_fidelity, bool):
            raise SpecError("multi_fidelity", f"expected true, false or auto, got {shown(multi_fidelity)}",
                            "write multi_fidelity: auto (on for the vllm and replay backends), true or false")
        space, warnings = _combine(space, fixed, profile, gpu, workload, budget)
        if sampler == "grid":
            budget, grid_warnings = _check_grid(space, fixed, budget)
            warnings = [*warnings, *grid_warnings]
        measurement = _parse_measurement(data.get("measurement"))
        _check_load_generator(measurement, workload, serve_model, objective)
        replay_file = _parse_replay_file(data.get("replay_file"), backend, base, space, fixed, objective, constraints)
        gpu_price, prices_file = _parse_prices(data.get("prices"), base, gpu, objective)
        headroom = _parse_headroom(data.get("headroom"))
        selection = _parse_selection(data.get("selection"), headroom)
        return cls(name=name, model_ref=model_ref, serve_model=serve_model, gpu=gpu, workload=workload,
                   objective=objective, constraints=constraints, search_space=space, fixed_flags=fixed,
                   budget=budget, backend=backend, sampler=sampler, seed=seed, vllm_version=vllm_version,
                   tracking=tracking, storage=Storage(optuna_url), output=output, description=description,
                   search_space_file=space_file, warnings=tuple(warnings), model_profile=profile, base_dir=base,
                   cwd=here, source=copy.deepcopy(dict(data)), prescreen=prescreen, replay_file=replay_file,
                   measurement=measurement, multi_fidelity=multi_fidelity, gpu_price=gpu_price,
                   prices_file=prices_file, headroom=headroom, selection=selection, **switches)

    # -- use ----------------------------------------------------------------------------------

    def trial_flags(self, trial: optuna.Trial) -> dict[str, Any]:
        """The full flag set of one trial: fixed flags plus the suggested ones."""
        return {**self.fixed_flags, **self.search_space.suggest(trial)}

    def check(self, flags: Mapping[str, Any]) -> list[str]:
        """Rule violations of a full flag set for this study's model, GPUs and workload."""
        return self.search_space.check(flags, self.model_profile, self.gpu.count, self.workload)

    def gpu_spec(self) -> GpuSpec:
        """The study's GPU type, on the host ``gpu.interconnect`` names (the type's usual one if unset)."""
        return gpus.with_interconnect(gpus.get_gpu(self.gpu.type), self.gpu.interconnect)

    def with_overrides(self, *, backend: str | None = None, trials: int | None = None, parallel: int | None = None,
                       seed: int | None = None, runs_dir: str | None = None) -> StudySpec:
        """A re-validated copy with CLI overrides applied (``None`` keeps the spec's value).

        ``runs_dir`` replaces ``output.runs_dir`` (the default stores and dataset follow it)."""
        data = copy.deepcopy(dict(self.source))
        if runs_dir is not None:
            data["output"] = {**dict(data.get("output") or {}), "runs_dir": runs_dir}
        if backend is not None:
            data["backend"] = backend
            if not capabilities(backend).reads_landscape:  # a landscape means nothing to the other backends
                data.pop("replay_file", None)
        if seed is not None:
            data["seed"] = seed
        if trials is not None or parallel is not None:
            budget = dict(data.get("budget") or {})
            if trials is not None:
                budget["trials"] = trials
            if parallel is not None:
                budget["parallel"] = parallel
            data["budget"] = budget
        return StudySpec.from_dict(data, self.base_dir, cwd=self.cwd)

    def to_dict(self) -> dict[str, Any]:
        """The validated spec as plain data, for logging (credentials in URLs are masked)."""
        workload = self.workload.to_dict()
        for key in ("prompt_file", "trace_file"):
            value = getattr(self.workload, key)
            if value is not None:
                workload[key] = str(value)
        space = self.search_space.to_dict()
        if self.search_space_file is not None:
            space["file"] = str(self.search_space_file)
        return {
            "name": self.name, "description": self.description, "model": self.model_ref,
            "serve_model": self.serve_model, "gpu": dataclasses.asdict(self.gpu), "workload": workload,
            "objective": {"metrics": list(self.objective.metrics), "directions": list(self.objective.directions)},
            "constraints": dataclasses.asdict(self.constraints), "search_space": space,
            "fixed_flags": dict(self.fixed_flags), "budget": dataclasses.asdict(self.budget),
            "backend": self.backend, "sampler": self.sampler, "seed": self.seed, "vllm_version": self.vllm_version,
            "prescreen": self.prescreen, "replay_file": None if self.replay_file is None else str(self.replay_file),
            "measurement": dataclasses.asdict(self.measurement),
            "early_stopping": self.early_stopping,
            "multi_fidelity": "auto" if self.multi_fidelity is None else self.multi_fidelity,
            "warm_start": self.warm_start, "baseline_trial": self.baseline_trial,
            "prices": None if self.prices_file is None else str(self.prices_file),
            "headroom": dataclasses.asdict(self.headroom), "selection": dataclasses.asdict(self.selection),
            "tracking": {"mlflow_uri": redact_url(self.tracking.mlflow_uri), "experiment": self.tracking.experiment},
            "storage": {"optuna_url": "memory" if self.storage.optuna_url is None else redact_url(self.storage.optuna_url)},
            "output": {"runs_dir": str(self.output.runs_dir), "dataset_dir": str(self.output.dataset_dir)},
        }


def _combine(space: SearchSpace, fixed: dict[str, Any], profile: ModelProfile | None, gpu: GpuPool,
             workload: Workload, budget: Budget) -> tuple[SearchSpace, list[str]]:
    """Cross-section checks: pinned vs searched flags, conditions, whether anything can start."""
    for name in fixed:
        if name in space:
            raise SpecError(f"fixed_flags.{name}", "is also searched in search_space",
                            f"remove {name} from fixed_flags or from the search space")
    for i, param in enumerate(space.params):
        if param.when is None:
            continue
        for dep in sorted(param.when.names):
            if dep not in space.names[:i] and dep not in fixed and dep not in STATIC_DEFAULTS:
                raise SpecError(f"search_space.params.{param.name}.when",
                                f"the condition reads {shown(dep)}, which is neither searched above it nor pinned, and "
                                "vLLM's default for it depends on the GPU or version",
                                f"pin {dep} in fixed_flags, or search it above {param.name}")
    space = space.with_pinned(fixed)
    feas = space.feasibility(profile, gpu.count, workload, limit=_FEASIBILITY_LIMIT)
    warnings: list[str] = []
    if feas.feasible == 0:
        subject, texts = max(feas.reasons.items(), key=lambda kv: len(kv[1]))
        if subject in space.names:
            field = f"search_space.params.{subject}"
        elif subject.startswith("rules["):
            field = f"search_space.{subject}"
        elif subject in fixed:
            field = f"fixed_flags.{subject}"
        else:
            field = "search_space" if space.names else "fixed_flags"
        if subject in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            heads = f" divide the model's {profile.num_attention_heads} attention heads and" if profile is not None else ""
            fix = (f"use tensor_parallel_size values that{heads} keep TP x PP x DP <= gpu.count ({gpu.count}), "
                   "or raise gpu.count")
        elif subject == "max_model_len":
            fix = "make max_model_len cover the workload's longest prompt + output and stay within the model's context"
        else:
            fix = "change the choices, fixed_flags, gpu.count or the workload so that at least one combination passes"
        if subject in fixed and subject not in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                                                "max_model_len"):
            fix = f"change fixed_flags.{subject}, or the search space choices it conflicts with"
        scope = ("" if feas.checked <= 1 or field.startswith("fixed_flags")
                 else f" ({len(texts)} of {feas.checked} combinations fail this way)")
        raise SpecError(field, f"no flag set can start: {texts[0]}{scope}", fix)
    for name, values in feas.never_ok.items():
        texts = [t for ts in feas.reasons.values() for t in ts]
        reason = next((t for t in texts if t.startswith(f"{name}={values[0]} ")), None) or \
            next((t for t in texts if t.startswith(f"{name}=")), None)
        listed = ", ".join(f"{name}={v!r}" for v in values)
        warnings.append(f"search_space.params.{name}: {listed} never passes the rules"
                        + (f" ({reason})" if reason else "") + "; such trials are refused before launch")
    min_world = feas.min_world_size or 1
    if budget.parallel * min_world > gpu.count:
        most = gpu.count // min_world
        raise SpecError("budget.parallel",
                        f"{budget.parallel} trials at once need at least {budget.parallel * min_world} GPUs "
                        f"({min_world} per trial), but gpu.count is {gpu.count}",
                        f"lower budget.parallel to {max(most, 1)} or raise gpu.count")
    return space, warnings


def load_spec(path: str | Path) -> StudySpec:
    """Read and validate a study spec YAML file.

    Example:
        >>> load_spec("jobs/quickstart.yaml").budget  # doctest: +SKIP
        Budget(trials=30, parallel=2, time_limit_s=None)
    """
    path = Path(path)
    data = read_yaml(path, "spec")
    if data is None:
        raise SpecError("spec", f"{path} is empty", "start from jobs/quickstart.yaml")
    return StudySpec.from_dict(data, path.resolve().parent)
