"""Headroom: how much more load, or how much longer prompts, a flag set takes before it fails.

A study's winner is the best flag set at the workload as written; real traffic drifts. For one
flag set this module searches, on the simulated engine, the scale of each axis at which the flag
set FIRST preempts (more than ``constraints.max_preemptions``) and FIRST breaks each latency
target of the study (``constraints.p99_ttft_ms`` / ``p99_itl_ms`` / ``p99_e2e_ms``), and when its
requests start failing (a prompt no longer fits ``max_model_len``):

* ``load``: the workload's own pacing made heavier: its concurrency times the scale for a closed
  loop (``num_requests`` raised to the concurrency where it would fall below it), its Poisson rate
  (or a trace's arrivals) times the scale for an open loop;
* ``prompt_len``: every prompt times the scale (a shared prefix kept as it is).

The search (:func:`find_edges`) is bracketing then bisection on the scale, in log space: from
the measured load (1.0) it doubles until the criterion breaks (at most ``max_scale``), then halves
the bracket until its two ends are within ``tolerance`` of each other (or, for an integer
concurrency, adjacent). Each simulation serves every criterion at once (a cache by scale), and at
most ``max_simulations`` run per flag set: where the bound cuts a bisection, the edge keeps its
wider bracket. The simulator is deterministic, so the same inputs give the same edges.

Each edge is a bracket: ``last_ok`` (the highest scale simulated below the edge that met the
criterion) and ``first_fail`` (the lowest that broke it). ``first_fail`` None: it held up to
``max_scale``; ``last_ok`` None: it already breaks at the measured load in the simulator. The
headroom of a flag set is the smallest ``last_ok`` over every edge (``max_scale`` when nothing
broke): the scale of both axes up to which the simulator saw every constraint met.

How far to trust the figures is :class:`ErrorBand`: the held-out errors docs/accuracy.md
reports for the simulator (its row-by-row table; README's groups them), for the GPU families where real runs
judged it, and "not checked" elsewhere.

Example:
    >>> from servetune.workload import Workload
    >>> w = Workload.from_dict({"input_len": 512, "output_len": 64, "num_requests": 8, "concurrency": 4})
    >>> scaled_workload(w, "load", 2.0).concurrency, scaled_workload(w, "prompt_len", 1.5).requests()[0].prompt_tokens
    (8, 768)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from servetune.errors import SpecError
from servetune.planner.flags import gpus_needed
from servetune.planner.gpus import get_gpu, sim_evidence_text
from servetune.result import TrialResult
from servetune.workload import Workload

if TYPE_CHECKING:
    from servetune.planner.comm import CommEnv
    from servetune.spec.schema import StudySpec

__all__ = ["AXES", "ErrorBand", "Edge", "Point", "Headroom", "find_edges", "scaled_workload", "load_axis_name",
           "error_band", "criteria", "broken_criteria", "meets_at", "SERVING", "for_spec", "spec_simulator",
           "StudyHeadroom", "study_headroom", "first_edge", "edge_window"]

#: The axes searched: the workload's pacing, and the prompts' length.
AXES = ("load", "prompt_len")
#: The criterion every flag set has: its requests are served (none fails, the engine starts).
SERVING = "serving"
_LATENCY_WORDS = {"ttft_p99_ms": "p99 TTFT", "itl_p99_ms": "p99 ITL", "e2e_p99_ms": "p99 E2E", "tpot_p99_ms": "p99 TPOT"}
_SHOWN = ("output_throughput", "request_throughput", "ttft_p99_ms", "itl_p99_ms", "tpot_p99_ms", "e2e_p99_ms",
          "kv_cache_usage_peak")


def load_axis_name(workload: Workload) -> str:
    """What the ``load`` axis scales for ``workload``: ``concurrency`` (closed loop) or ``request_rate``."""
    return "concurrency" if workload.concurrency is not None and workload.trace_file is None else "request_rate"


def scaled_workload(workload: Workload, axis: str, scale: float) -> Workload:
    """``workload`` with ``axis`` made ``scale`` times larger (same seed, so the same request mix)."""
    if axis == "prompt_len":
        return dataclasses.replace(workload, prompt_scale=workload.prompt_scale * scale)
    if axis != "load":
        raise ValueError(f"unknown headroom axis {axis!r}")
    if load_axis_name(workload) == "concurrency":
        assert workload.concurrency is not None
        conc = max(1, round(workload.concurrency * scale))
        return dataclasses.replace(workload, concurrency=conc, num_requests=max(workload.num_requests, conc))
    return dataclasses.replace(workload, rate_scale=workload.rate_scale * scale)


def _effective(workload: Workload, axis: str, scale: float) -> float:
    """The scale a workload can take (an integer concurrency rounds it)."""
    if axis == "load" and load_axis_name(workload) == "concurrency":
        assert workload.concurrency is not None
        return max(1, round(workload.concurrency * scale)) / workload.concurrency
    return round(scale, 4)


def criteria(limits: Mapping[str, float]) -> dict[str, float]:
    """The criteria of a search from a study's limits (``Constraints.limits()``: ``preemptions`` and
    the latency keys): those, and :data:`SERVING` (no failed request)."""
    out = {SERVING: 0.0, "preemptions": float(limits.get("preemptions", 0.0))}
    out.update({k: float(v) for k, v in limits.items() if k != "preemptions"})
    return out


def broken_criteria(result: TrialResult, limits: Mapping[str, float]) -> tuple[str, ...]:
    """The criteria ``result`` breaks: the study's own rule per limit
    (:func:`servetune.search.propose.constraint_values`: every one when it did not serve, a
    latency not measured counts as broken), and :data:`SERVING` also when a request failed."""
    crit = criteria(limits)
    if not result.ok or (result.failed or 0) > 0:
        return tuple(crit)
    m = result.metrics()
    broken = []
    for name, limit in crit.items():
        if name == SERVING:
            continue
        value = m.get(name, 0.0 if name == "preemptions" else math.inf)
        if value > limit:
            broken.append(name)
    return tuple(broken)


@dataclasses.dataclass(frozen=True)
class Point:
    """One simulation of a search: the axis, the scale and what the simulator measured there."""

    axis: str
    scale: float
    broken: tuple[str, ...]
    metrics: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"axis": self.axis, "scale": self.scale, "broken": list(self.broken), "metrics": dict(self.metrics)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Point:
        return cls(str(d["axis"]), float(d["scale"]), tuple(d.get("broken", ())), dict(d.get("metrics", {})))


@dataclasses.dataclass(frozen=True)
class Edge:
    """Where one criterion first breaks along one axis: the bracket ``(last_ok, first_fail]``."""

    axis: str
    criterion: str
    limit: float
    first_fail: float | None  # None: no simulation broke it (up to last_ok: max_scale, or where the bound cut)
    last_ok: float | None  # None: it breaks at the measured load already

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Edge:
        return cls(str(d["axis"]), str(d["criterion"]), float(d["limit"]),
                   None if d.get("first_fail") is None else float(d["first_fail"]),
                   None if d.get("last_ok") is None else float(d["last_ok"]))


@dataclasses.dataclass(frozen=True)
class ErrorBand:
    """How far the simulator's figures are to be trusted here, as docs/accuracy.md measured them:
    mean |error| held out, by figure, or ``checked`` False where no real run judged it."""

    checked: bool
    where: str  # the runs that judged it
    throughput: str = ""
    tpot: str = ""
    ttft: str = ""
    preemption: str = ""
    source: str = "docs/accuracy.md"

    def text(self) -> str:
        if not self.checked:
            return f"not checked against real runs ({self.where}): treat the edges as estimates ({self.source})"
        if not self.throughput:
            return f"judged on {self.where} ({self.source})"
        return (f"held-out mean |error| {self.where}: throughput {self.throughput}, TPOT {self.tpot}, "
                f"TTFT {self.ttft}; preemption verdict {self.preemption} ({self.source})")


def error_band(gpu_type: str, gpus_per_engine: int = 1, moe: bool = False) -> ErrorBand:
    """The band that applies to a flag set on ``gpu_type``: docs/accuracy.md's held-out table (the
    simulator's rows; README's accuracy table groups them). Pure.

    Example:
        >>> error_band("H200").checked, error_band("A100-40GB").checked
        (True, False)
    """
    if gpus_per_engine > 1:
        return ErrorBand(False, f"{gpus_per_engine} GPUs per server (TP x PP x DP > 1)")
    if moe:
        if gpu_type == "H100-80GB":
            return ErrorBand(True, "MoE on H100 SXM, vLLM 0.26.0, TP=1, a Qwen3-30B-A3B shape in bf16 (8 windows, "
                             "docs/model-classes.md)", throughput="3.4%", tpot="4.1%", ttft="23.5%",
                             preemption="right on all 8 windows", source="docs/model-classes.md")
        if gpu_type == "H200":
            return ErrorBand(True, "MoE on H200, vLLM 0.26.0, TP=1, a Qwen3-30B-A3B shape in bf16 and FP8 and "
                             "gpt-oss-20b (7 windows, docs/model-classes.md)", throughput="9.2%", tpot="6.6%",
                             ttft="26.9%", preemption="right on all 9 windows", source="docs/model-classes.md")
        return ErrorBand(False, f"MoE models on the {gpu_type}")
    if gpu_type == "H200":
        return ErrorBand(True, "on H200, vLLM 0.26.0, TP=1, dense 8B/14B/24B (66 windows)", throughput="1.6-5.5%",
                         tpot="1.5-7.0%", ttft="4.1-13.9%", preemption="right on all 77 windows")
    if gpu_type == "H100-80GB":
        return ErrorBand(True, "on H100 SXM, vLLM 0.26.0, TP=1, 8B (8 windows, docs/evidence-h100.md)",
                         throughput="8.6%", tpot="9.2%", ttft="8.8%", preemption="not judged on the H100")
    evidence = _sim_evidence(gpu_type)
    if evidence:  # the GPU table's note and the published runs held out on this GPU type
        return ErrorBand(True, evidence)
    return ErrorBand(False, f"{gpu_type}: no real run of this GPU type judged the simulator")


def _sim_evidence(gpu_type: str) -> str:
    try:
        return sim_evidence_text(get_gpu(gpu_type))
    except SpecError:
        return ""


@dataclasses.dataclass(frozen=True)
class Headroom:
    """The headroom of one flag set: its edges on each axis, every simulation behind them, and
    the error band and calibration they rest on."""

    flags: dict[str, Any]
    load_axis: str  # "concurrency" or "request_rate"
    baseline_load: float | None  # the workload's concurrency or request rate (None: a trace's own pacing)
    baseline_prompt_tokens: float  # the mean prompt length at scale 1
    max_scale: dict[str, float]
    tolerance: float
    edges: tuple[Edge, ...]
    points: tuple[Point, ...]
    band: ErrorBand
    calibration: dict[str, Any]  # api_cpu_factor (host), the real/sim throughput ratio where measured
    simulations: int
    trial_number: int | None = None

    @property
    def headroom(self) -> float:
        """The smallest scale up to which every criterion was seen to hold on every axis (each
        edge's ``last_ok``: ``max_scale`` where none broke, less where the simulation bound cut the
        search); 0.0 when one already breaks at the measured load."""
        return min((e.last_ok or 0.0 for e in self.edges), default=min(self.max_scale.values()))

    def axis_headroom(self, axis: str) -> float:
        """:attr:`headroom` along one axis."""
        return min((e.last_ok or 0.0 for e in self.edges if e.axis == axis), default=self.max_scale[axis])

    def first_edge(self, axis: str) -> Edge | None:
        """The criterion that breaks first along ``axis`` (None: none broke up to ``max_scale``)."""
        failing = [e for e in self.edges if e.axis == axis and e.first_fail is not None]
        return min(failing, key=lambda e: e.first_fail or 0.0, default=None)

    def baseline(self) -> Point | None:
        return next((p for p in self.points if p.scale == 1.0), None)

    def absolute(self, axis: str, scale: float) -> str:
        """``scale`` on ``axis`` in the workload's own units (``230 in flight``, ``4.1 req/s``, ``640 tokens``)."""
        if axis == "prompt_len":
            return f"{self.baseline_prompt_tokens * scale:,.0f}-token prompts"
        if self.baseline_load is None:
            return f"the trace's arrivals x{scale:.2f}"
        if self.load_axis == "concurrency":
            return f"{round(self.baseline_load * scale):,} in flight"
        return f"{self.baseline_load * scale:,.2f} req/s"

    def metrics(self, prefix: str = "headroom.") -> dict[str, float]:
        """Flat figures for MLflow: ``headroom.x`` (:attr:`headroom`), per axis ``headroom.rate_x``
        or ``headroom.concurrency_x`` and ``headroom.prompt_len_x`` (:meth:`axis_headroom`), the
        scales searched up to (``headroom.max_<axis>_scale``), and for each criterion that broke
        the scale where it first did (``headroom.prompt_len.preemptions_first_fail_x``)."""
        out = {f"{prefix}x": self.headroom, f"{prefix}simulations": float(self.simulations)}
        axis_words = {"load": "rate" if self.load_axis == "request_rate" else "concurrency", "prompt_len": "prompt_len"}
        for axis in AXES:
            out[f"{prefix}{axis_words[axis]}_x"] = self.axis_headroom(axis)
            out[f"{prefix}max_{axis_words[axis]}_scale"] = self.max_scale[axis]
        for e in self.edges:
            if e.first_fail is not None:
                out[f"{prefix}{axis_words[e.axis]}.{e.criterion}_first_fail_x"] = e.first_fail
        return out

    def lines(self, label: str = "", band: bool = True) -> list[str]:
        """A compact block of text: the headroom, then per axis where each criterion first breaks."""
        top = min(self.max_scale.values())
        if self.headroom == 0.0:
            head = f"{label}no headroom: a constraint breaks at the measured load already (in the simulator)"
        else:
            head = (f"{label}headroom x{self.headroom:.2f}" if self.headroom < top else f"{label}headroom x{top:g} or more")
            head += " (every constraint met up to there on both axes"
        out = [head + f"{'; ' if self.headroom else ' ('}{self.simulations} simulations)"]
        for axis in AXES:
            edges = sorted((e for e in self.edges if e.axis == axis), key=lambda e: e.first_fail or math.inf)
            parts = [_edge_text(self, e) for e in edges if e.first_fail is not None]
            held = [e for e in edges if e.first_fail is None and e.criterion != SERVING]
            reach = min((e.last_ok or 0.0 for e in edges if e.first_fail is None), default=self.max_scale[axis])
            top_text = (f" up to x{reach:g} ({self.absolute(axis, reach)})"
                        + ("" if reach >= self.max_scale[axis] else ", searched no further (max_simulations)"))
            if len(parts) == 0:
                parts.append("every constraint met" + top_text)
            elif held:
                parts.append(", ".join(_what(e, never=True) for e in held) + top_text)
            name = self.load_axis.replace("_", " ") if axis == "load" else "prompt length"
            out.append(f"  {name}: " + "; ".join(parts))
        if band:
            out.append(f"  error band: {self.band.text()}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"flags": dict(self.flags), "load_axis": self.load_axis, "baseline_load": self.baseline_load,
                "baseline_prompt_tokens": self.baseline_prompt_tokens, "max_scale": dict(self.max_scale),
                "tolerance": self.tolerance, "edges": [e.to_dict() for e in self.edges],
                "points": [p.to_dict() for p in self.points], "band": dataclasses.asdict(self.band),
                "calibration": dict(self.calibration), "simulations": self.simulations,
                "trial_number": self.trial_number, "headroom": self.headroom}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Headroom:
        return cls(flags=dict(d["flags"]), load_axis=str(d["load_axis"]), baseline_load=d.get("baseline_load"),
                   baseline_prompt_tokens=float(d["baseline_prompt_tokens"]),
                   max_scale={k: float(v) for k, v in d["max_scale"].items()}, tolerance=float(d["tolerance"]),
                   edges=tuple(Edge.from_dict(e) for e in d["edges"]),
                   points=tuple(Point.from_dict(p) for p in d["points"]), band=ErrorBand(**d["band"]),
                   calibration=dict(d.get("calibration") or {}), simulations=int(d["simulations"]),
                   trial_number=d.get("trial_number"))


def _what(edge: Edge, never: bool = False) -> str:
    if edge.criterion == "preemptions":
        return "never preempts" if never else "preempts"
    if edge.criterion == SERVING:
        return "serves" if never else "requests fail"
    word = _LATENCY_WORDS.get(edge.criterion, edge.criterion)
    return f"{word} within {edge.limit:g} ms" if never else f"{word} above {edge.limit:g} ms"


def _edge_text(h: Headroom, edge: Edge) -> str:
    if edge.last_ok is None:
        return f"{_what(edge)} at the measured load already (in the simulator)"
    assert edge.first_fail is not None
    return f"{_what(edge)} at x{edge.first_fail:.2f} ({h.absolute(edge.axis, edge.first_fail)}; met at x{edge.last_ok:.2f})"


Simulate = Callable[[Workload], TrialResult]


class _Prober:
    """Simulations of one flag set, cached by (axis, effective scale), bounded in number."""

    def __init__(self, simulate: Simulate, workload: Workload, limits: Mapping[str, float], budget: int) -> None:
        self.simulate, self.workload, self.limits, self.budget = simulate, workload, limits, budget
        self.points: dict[tuple[str, float], Point] = {}
        self.runs = 0

    def can(self, axis: str, scale: float) -> bool:
        return self.key(axis, scale) in self.points or self.runs < self.budget

    def key(self, axis: str, scale: float) -> tuple[str, float]:
        return ("base", 1.0) if scale == 1.0 else (axis, _effective(self.workload, axis, scale))

    def probe(self, axis: str, scale: float) -> Point:
        key = self.key(axis, scale)
        point = self.points.get(key)
        if point is None:
            self.runs += 1
            result = self.simulate(scaled_workload(self.workload, axis, key[1]) if scale != 1.0 else self.workload)
            point = self.points[key] = self.point(axis if scale != 1.0 else "base", key[1], result)
        return point

    def point(self, axis: str, scale: float, result: TrialResult) -> Point:
        m = result.metrics()
        return Point(axis, scale, broken_criteria(result, self.limits),
                     {k: m[k] for k in _SHOWN if k in m} | {"preemptions": m.get("preemptions", 0.0)})


def _bracket(prober: _Prober, axis: str, criterion: str, max_scale: float, tolerance: float
             ) -> tuple[float | None, float | None]:
    """``(last_ok, first_fail)`` of ``criterion`` along ``axis``; see the module docstring."""
    if criterion in prober.probe(axis, 1.0).broken:
        return None, 1.0
    lo, hi, s = 1.0, None, 1.0
    while hi is None:
        s = min(s * 2.0, max_scale)
        if not prober.can(axis, s):
            return lo, None
        if criterion in prober.probe(axis, s).broken:
            hi = prober.key(axis, s)[1]
        else:
            lo = prober.key(axis, s)[1]
            if s >= max_scale:
                return lo, None
    while hi / lo > 1.0 + tolerance:
        mid = math.sqrt(lo * hi)
        eff = prober.key(axis, mid)[1]
        if eff <= lo or eff >= hi or not prober.can(axis, mid):  # adjacent integers, or out of simulations
            break
        if criterion in prober.probe(axis, mid).broken:
            hi = eff
        else:
            lo = eff
    return lo, hi


def find_edges(simulate: Simulate, workload: Workload, limits: Mapping[str, float], *, flags: Mapping[str, Any],
               max_scale: Mapping[str, float] | None = None, tolerance: float = 0.1, max_simulations: int = 12,
               band: ErrorBand | None = None, calibration: Mapping[str, Any] | None = None,
               trial_number: int | None = None, baseline: TrialResult | None = None) -> Headroom:
    """The headroom of ``flags``: ``simulate`` (the flag set's simulated engine, a workload in,
    its result out) run on scaled copies of ``workload``, each axis and criterion bracketed.
    ``limits``: the study's ``Constraints.limits()``. At most ``max_simulations`` calls.
    ``baseline``: ``simulate(workload)`` already known (a simulated study's own trial), not run again."""
    scales = {"load": 2.0, "prompt_len": 2.0, **(max_scale or {})}
    prober = _Prober(simulate, workload, limits, max_simulations)
    if baseline is not None:
        prober.points[("base", 1.0)] = prober.point("base", 1.0, baseline)
    edges = []
    for axis in AXES:
        for name, limit in criteria(limits).items():
            last_ok, first_fail = _bracket(prober, axis, name, scales[axis], tolerance)
            edges.append(Edge(axis, name, limit, first_fail, last_ok))
    base_prompt = sum(r.prompt_tokens for r in workload.requests()) / max(1, len(workload.requests()))
    pacing = workload.concurrency if load_axis_name(workload) == "concurrency" else workload.request_rate
    points = sorted(prober.points.values(), key=lambda p: (p.axis, p.scale))
    return Headroom(flags=dict(flags), load_axis=load_axis_name(workload),
                    baseline_load=None if pacing is None else float(pacing), baseline_prompt_tokens=base_prompt,
                    max_scale=dict(scales), tolerance=tolerance, edges=tuple(edges), points=tuple(points),
                    band=band or ErrorBand(False, "no band given"), calibration=dict(calibration or {}),
                    simulations=prober.runs, trial_number=trial_number)


def meets_at(simulate: Simulate, workload: Workload, limits: Mapping[str, float], scale: float,
             axes: Sequence[str] = AXES) -> bool:
    """Whether the flag set meets every criterion at ``scale`` on each of ``axes`` (one simulation
    per axis): the rule of ``selection.min_headroom``."""
    return all(not broken_criteria(simulate(scaled_workload(workload, axis, scale)), limits) for axis in axes)


def spec_simulator(spec: StudySpec, flags: Mapping[str, Any], api_cpu_factor: float | None = None,
                   comm_env: CommEnv | None = None) -> Simulate:
    """The simulated engine of ``flags`` under the spec's model and GPU, at the host's API-server
    CPU factor where the study measured one (the calibration its simulator screen runs with,
    :func:`servetune.search.screen.learn`), in the environment its real trials run with (``comm_env``:
    :func:`servetune.planner.comm.trial_env`; None: the measured hosts'), with the study's seed: a workload in,
    its result out."""
    from servetune.search.screen import simulate_flags

    def run(workload: Workload) -> TrialResult:
        return simulate_flags(dataclasses.replace(spec, workload=workload), flags, api_cpu_factor=api_cpu_factor,
                              comm_env=comm_env)

    return run


def for_spec(spec: StudySpec, flags: Mapping[str, Any], *, api_cpu_factor: float | None = None,
             calibration: Mapping[str, Any] | None = None, trial_number: int | None = None,
             baseline: TrialResult | None = None, comm_env: CommEnv | None = None) -> Headroom:
    """:func:`find_edges` for one flag set of a study: its workload, constraints, GPU and the
    spec's ``headroom`` settings, with the error band of its GPU, TP size and model class; ``comm_env``:
    :func:`spec_simulator`'s."""
    settings = spec.headroom
    profile = spec.model_profile
    band = error_band(spec.gpu.type, gpus_needed(flags), moe=bool(profile is not None and profile.is_moe))
    calib = {"api_cpu_factor": api_cpu_factor, **(calibration or {})}
    return find_edges(spec_simulator(spec, flags, api_cpu_factor, comm_env), spec.workload, spec.constraints.limits(),
                      flags=flags,
                      max_scale={"load": settings.max_load_scale, "prompt_len": settings.max_prompt_scale},
                      tolerance=settings.tolerance, max_simulations=settings.max_simulations, band=band,
                      calibration=calib, trial_number=trial_number, baseline=baseline)


@dataclasses.dataclass(frozen=True)
class StudyHeadroom:
    """The end of a study's headroom: the winner's and the runner-up's, and, with
    ``selection.min_headroom``, which flag sets were checked at that scale and which was chosen."""

    winner: Headroom
    runner_up: Headroom | None
    min_headroom: float | None = None
    selected: int | None = None  # the trial chosen for its headroom (None: no selection, or none met it)
    checked: tuple[tuple[int, bool], ...] = ()  # (trial number, met every constraint at min_headroom)
    #: On real GPUs, the one window measured at the winner's first predicted edge (:func:`edge_window`).
    edge_window: dict[str, Any] | None = None

    def lines(self) -> list[str]:
        out = []
        if self.min_headroom is not None:
            seen = ", ".join(f"#{n} {'meets' if ok else 'fails'}" for n, ok in self.checked)
            out.append(f"selection.min_headroom x{self.min_headroom:g}: "
                       + (f"trial #{self.selected} is the best flag set that meets every constraint there ({seen})"
                          if self.selected is not None else
                          f"no flag set checked meets it ({seen}); the winner stays the best on the objective"))
        out += self.winner.lines(f"winner (trial #{self.winner.trial_number}): ", band=False)
        if self.runner_up is not None:
            other = {k: v for k, v in self.runner_up.flags.items() if self.winner.flags.get(k) != v}
            shown = ", ".join(f"{k} {v}" for k, v in sorted(other.items()))
            out += self.runner_up.lines(f"runner-up (trial #{self.runner_up.trial_number}, {shown}): ", band=False)
        out.append(f"error band: {self.winner.band.text()}")
        calib = self.winner.calibration
        if calib.get("api_cpu_factor") is not None or calib.get("real_over_sim_throughput") is not None:
            factor, ratio = calib.get("api_cpu_factor"), calib.get("real_over_sim_throughput")
            out.append("calibration on the study's real trials: "
                       + ("host API-server CPU not measured" if factor is None else f"host API-server CPU x{factor:.2f}")
                       + ("" if ratio is None else f"; real/simulated throughput {ratio:.2f} over "
                          f"{calib.get('real_trials', 0)} trials (the edges are the simulator's)"))
        window = self.edge_window
        if window is not None:
            where = f"{'prompt length' if window['axis'] == 'prompt_len' else self.winner.load_axis.replace('_', ' ')} x{window['scale']:.2f}"
            measured = ", ".join(window["measured_broken"]) or "nothing"
            out.append(f"edge window on the real engine at {where} (predicted to break {window['criterion']}): "
                       + ("not measured, the machine failed" if window["confirmed"] is None else
                          f"confirmed, it broke {measured}" if window["confirmed"] else
                          f"not confirmed, it broke {measured}: the edge lies further out than predicted"))
        return out

    def metrics(self) -> dict[str, float]:
        """``headroom.*`` for the winner, ``headroom.runner_up.*`` for the runner-up (MLflow)."""
        out = self.winner.metrics()
        if self.runner_up is not None:
            out.update(self.runner_up.metrics("headroom.runner_up."))
        if self.min_headroom is not None:
            out["headroom.min_headroom"] = self.min_headroom
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"winner": self.winner.to_dict(), "runner_up": None if self.runner_up is None else self.runner_up.to_dict(),
                "min_headroom": self.min_headroom, "selected": self.selected, "checked": [list(c) for c in self.checked],
                "edge_window": self.edge_window, "text": self.lines()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StudyHeadroom:
        return cls(Headroom.from_dict(d["winner"]), None if d.get("runner_up") is None else Headroom.from_dict(d["runner_up"]),
                   d.get("min_headroom"), d.get("selected"), tuple((int(n), bool(ok)) for n, ok in d.get("checked", ())),
                   d.get("edge_window"))


#: At most this many flag sets are checked at ``selection.min_headroom`` (two simulations each).
MAX_SELECTION_CANDIDATES = 8


def study_headroom(spec: StudySpec, ranked: Sequence[tuple[int, Mapping[str, Any]]], *,
                   api_cpu_factor: float | None = None, calibration: Mapping[str, Any] | None = None,
                   measured: Mapping[int, TrialResult] | None = None,
                   comm_env: CommEnv | None = None) -> StudyHeadroom | None:
    """The headroom a study ends with. ``ranked``: its feasible flag sets, best first, one per flag
    set (``(trial number, flags)``). With ``selection.min_headroom`` X, the first of them (at most
    :data:`MAX_SELECTION_CANDIDATES`) that meets every constraint at X times the load and X times
    the prompts becomes the winner; the runner-up is the best other flag set. None when nothing
    is feasible. ``measured``: trial number -> its result where that is the simulator's own at
    scale 1 (a simulated study), used as the baseline instead of simulating it again. ``comm_env``: the
    environment the study's real trials run with (:func:`spec_simulator`)."""
    if not ranked:
        return None
    limits = spec.constraints.limits()
    x = spec.selection.min_headroom
    checked: list[tuple[int, bool]] = []
    selected = None
    if x is not None:
        for number, flags in ranked[:MAX_SELECTION_CANDIDATES]:
            ok = meets_at(spec_simulator(spec, flags, api_cpu_factor, comm_env), spec.workload, limits, x)
            checked.append((number, ok))
            if ok:
                selected = number
                break
    win = next((i for i, (n, _) in enumerate(ranked) if n == selected), 0)
    rest = [r for i, r in enumerate(ranked) if i != win]
    heads = [for_spec(spec, flags, api_cpu_factor=api_cpu_factor, calibration=calibration, trial_number=number,
                      baseline=(measured or {}).get(number), comm_env=comm_env)
             for number, flags in [ranked[win], *rest[:1]]]
    return StudyHeadroom(heads[0], heads[1] if len(heads) > 1 else None, x, selected, tuple(checked))


def first_edge(h: Headroom, axes: Sequence[str] = AXES) -> Edge | None:
    """The edge a confirmation window checks: the lowest ``first_fail`` over ``axes`` among the
    edges with a bracket (one already broken at the measured load has nothing to confirm)."""
    return min((e for e in h.edges if e.axis in axes and e.first_fail is not None and e.last_ok is not None),
               key=lambda e: e.first_fail or 0.0, default=None)


def edge_window(edge: Edge, trial_number: int | None, measured: TrialResult, limits: Mapping[str, float]) -> dict[str, Any]:
    """What one real window at ``edge`` says: the criteria it broke, and whether it confirms the
    predicted edge (None where the machine failed, not the flags)."""
    broken = broken_criteria(measured, limits)
    m = measured.metrics()
    return {"trial_number": trial_number, "axis": edge.axis, "scale": edge.first_fail, "criterion": edge.criterion,
            "status": measured.status.value, "measured_broken": list(broken),
            "confirmed": None if measured.status.is_infrastructure else edge.criterion in broken,
            "metrics": {k: m[k] for k in (*_SHOWN, "preemptions") if k in m}}
