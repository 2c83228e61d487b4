"""Ask, pre-screen, evaluate, tell: the search logic of a study, without Ray, MLflow or files.

The study driver (:mod:`servetune.study`) and the search-efficiency benchmark
(``benchmarks/search_efficiency.py``) share these pieces, so the benchmark measures the logic the
driver runs:

* :func:`prescreen` (pure): resolve a flag set the way vLLM would and run the memory planner, in the
  environment the trial's server runs with (:func:`servetune.planner.comm.trial_env`: for a real trial, the GPU
  workers' FlashInfer as the study driver probed it, which decides vLLM 0.17+'s all-reduce fusion workspace).
  A predicted startup failure becomes a ``pruned`` :class:`TrialResult` (the predicted failure
  and vLLM's error text as the cause, the predicted memory breakdown); flags vLLM would refuse
  become ``invalid_config``. Neither uses a GPU.
* :func:`propose`: ``study.ask()``, the flags (fixed + suggested), the space's rules, the GPU count,
  then :func:`prescreen` when the spec's ``prescreen`` is on. A refused proposal carries its result.
* :func:`tell`: the Optuna half of finishing a trial: the constraint vector (the same keys for
  every trial, :func:`constraint_values`), the user attributes, the objective values.
* :func:`enqueue_informed_starts`: the preemption prior's starting points
  (:func:`servetune.search.informed.informed_starts`) enqueued in a fresh study (``skip_if_exists``).
* :func:`run_local`: the whole loop in process, one trial at a time, with a caller's ``evaluate``
  (the replay backend, in the benchmark).

A pruned trial is told COMPLETE with every constraint violated (like a real startup failure), so
TPE / NSGA-II / GP learn the infeasible region from it exactly as from a failed launch.

Example:
    >>> import optuna
    >>> from servetune.spec.schema import StudySpec
    >>> spec = StudySpec.from_dict({"name": "demo", "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB"},
    ...     "workload": {"input_len": 512, "output_len": 1024, "num_requests": 64, "concurrency": 64},
    ...     "search_space": {"params": {"gpu_memory_utilization": [0.3, 0.9], "max_num_seqs": [32, 64]}},
    ...     "fixed_flags": {"max_model_len": 4096}, "storage": {"optuna_url": "memory"}}, cwd="/tmp")
    >>> prescreen(spec, {"gpu_memory_utilization": 0.3, "max_num_seqs": 32, "max_model_len": 4096})[0].status.value
    'pruned'
    >>> study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    >>> evaluate = lambda flags: TrialResult(TrialStatus.OK, output_throughput=flags["max_num_seqs"], preemptions=0)
    >>> told = run_local(spec, study, evaluate, max_dispatched=2)
    >>> told[0].flags["gpu_memory_utilization"], sum(t.dispatched for t in told)   # the informed start first
    (0.9, 2)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import optuna

from servetune.backends import capabilities
from servetune.cost import slo_figures
from servetune.engines.early_stop import EarlyStop
from servetune.errors import NotModelled, SpecError
from servetune.planner.comm import CommEnv, trial_env
from servetune.planner.engine_config import compile_key, resolve_engine_config
from servetune.planner.flags import gpus_needed
from servetune.planner.memory import MemoryPlan, plan_memory
from servetune.records.outcome import classify, is_screen_cause
from servetune.records.trial_attrs import defer_trial_attrs, set_trial_attrs
from servetune.result import TrialResult, TrialStatus
from servetune.search.informed import informed_starts
from servetune.search.screen import SimScreen, learn, prediction_attrs, screened_result, simulated

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.modelinfo import ModelProfile
    from servetune.spec.schema import StudySpec

__all__ = ["INFEASIBLE", "FEASIBLE", "Proposal", "Told", "prescreen", "propose", "tell", "constraint_values",
           "objective_values", "StoredTrial", "early_stop_rule", "enqueue_informed_starts", "run_local", "sim_screen",
           "best_feasible", "meets_constraints", "maximises_output_throughput", "with_slo_figures",
           "WarmCompiles", "warm_compiles"]

INFEASIBLE = 1.0
FEASIBLE = -1.0


# -- what Optuna is told (pure) --------------------------------------------------------------------

def constraint_values(spec: StudySpec, result: TrialResult) -> dict[str, float]:
    """The constraint vector of one result; the same keys for every trial of a study.

    ``startup`` is violated when the engine did not serve; every limit of the spec
    (``constraints.limits()``: preemptions, p99 TTFT/ITL/E2E) is "measured minus allowed", and
    violated outright for a trial that did not serve.
    """
    served = result.ok
    metrics = result.metrics()
    out = {"startup": FEASIBLE if served else INFEASIBLE}
    for metric, limit in spec.constraints.limits().items():
        key = "preemptions" if metric == "preemptions" else metric.replace("_p99_ms", "").join(("p99_", "_ms"))
        value = metrics.get(metric, 0.0 if metric == "preemptions" else None)
        out[key] = (float(value) - limit) if served and value is not None else INFEASIBLE
    return out


def meets_constraints(spec: StudySpec, result: TrialResult) -> bool:
    """Whether ``result`` meets every constraint of the study (:func:`constraint_values`)."""
    return all(v <= 0 for v in constraint_values(spec, result).values())


def maximises_output_throughput(spec: StudySpec) -> bool:
    """Whether the study's first objective is output throughput, maximised: what a running trial
    can be compared on against the best so far (early stopping, same-start confirmation)."""
    return spec.objective.metrics[:1] == ("output_throughput",) and spec.objective.directions[0] == "maximize"


def with_slo_figures(spec: StudySpec, flags: Mapping[str, Any], result: TrialResult) -> TrialResult:
    """``result`` (and its same-start repeats) with the study's goodput and cost figures set
    (:attr:`TrialResult.slo`, :func:`servetune.cost.slo_figures`): the requests that met the
    spec's latency constraints, priced at its GPU type's price x the flags' GPUs. Returns ``result``."""
    price = None if spec.gpu_price is None else spec.gpu_price.usd_per_gpu_hour
    limits = spec.constraints.limits()
    for r in (result, *result.repeats):
        if r.requests:  # a replayed result keeps the figures its landscape recorded
            r.slo = slo_figures(r, limits, price, gpus_needed(flags))
    return result


def objective_values(spec: StudySpec, result: TrialResult) -> list[float]:
    """The objective(s): throughput, maximised; latency figures, minimised. Failures get the worst."""
    metrics = result.metrics()
    values = []
    for name, direction in zip(spec.objective.metrics, spec.objective.directions):
        v = metrics.get(name)
        if v is None or not result.ok or math.isnan(v):
            v = 0.0 if direction == "maximize" else 1e12
        values.append(float(v))
    return values


# -- the pre-screen ---------------------------------------------------------------------------------

def prescreen(spec: StudySpec, flags: Mapping[str, Any], backend: str | None = None, *,
              compile_cache_warm: bool = False, env: CommEnv | None = None) -> tuple[TrialResult | None, MemoryPlan | None]:
    """``(refusal, plan)``: a ``pruned`` / ``invalid_config`` result when the flags cannot start.

    ``refusal`` is None when the planner predicts a healthy start (``plan`` is then that
    prediction), or when the spec has no model profile to plan with (``plan`` None).
    ``compile_cache_warm``: an earlier trial of the study already compiled these
    configuration (:func:`servetune.planner.memory.compile_key`), so vLLM will profile the warm peak.
    ``env``: the environment the trial's server runs with (:func:`servetune.planner.comm.trial_env`: the study
    driver's, from the GPU workers' probed install); None: ``trial_env`` of the backend, unprobed (a real trial
    charged vLLM 0.17+'s FlashInfer all-reduce fusion workspace where the version, TP and GPU say it may run).
    """
    backend = backend or spec.backend
    env = _unprobed_env(backend) if env is None else env
    model = spec.model_profile
    if model is None:
        return None, None
    gpu = spec.gpu_spec()
    try:
        config = resolve_engine_config(flags, model, gpu, spec.vllm_version)
    except NotModelled as exc:  # vLLM starts these flags; the planner cannot say how they go
        if capabilities(backend).real_gpus:
            return None, None
        return TrialResult(status=TrialStatus.INVALID_CONFIG, cause=f"not simulated: {exc}", backend=backend,
                           vllm_version=spec.vllm_version), None
    except SpecError as exc:  # vLLM itself would refuse these flags
        return TrialResult(status=TrialStatus.INVALID_CONFIG, cause=str(exc), backend=backend,
                           vllm_version=spec.vllm_version), None
    plan = plan_memory(model, gpu, config, compile_cache_warm=compile_cache_warm, env=env)
    if plan.fits:
        return None, plan
    failure = (plan.failure or TrialStatus.STARTUP_OOM).value
    evidence = [f"prescreen: the memory planner predicts {failure}"]
    if plan.fix:
        evidence.append(f"fix: {plan.fix}")
    return TrialResult(status=TrialStatus.PRUNED, cause=f"predicted {failure}: {plan.cause}", evidence=evidence,
                       backend=backend, vllm_version=config.vllm_version, memory=plan.memory), plan


# -- ask and tell -----------------------------------------------------------------------------------

@dataclasses.dataclass
class Proposal:
    """One asked trial: its full flag set, the GPUs it needs, and a refusal when it must not launch."""

    trial: optuna.trial.Trial
    flags: dict[str, Any]
    gpus: int
    refused: TrialResult | None = None
    plan: MemoryPlan | None = None  # the planner's prediction (pruned or healthy); None without pre-screen


#: Statuses of trials that never reached vLLM's compile step (nothing cached by them).
_NOT_COMPILED = frozenset({"pruned", "invalid_config", "infra_error"})


def compile_cache_warm(study: optuna.Study, flags: Mapping[str, Any], model: ModelProfile, gpu: GpuSpec,
                       vllm_version: str) -> bool:
    """True when a finished trial of ``study`` compiled the configuration ``flags`` needs (its peak is warm).

    The rule is :func:`~servetune.planner.memory.compile_key`'s, on the configurations as vLLM
    resolves them for ``model``, ``gpu`` and ``vllm_version``: an earlier start that compiled the
    same graphs (a startup failure compiles before the KV cache is sized, so it counts), finished
    before this proposal. A trial running at the same time does not warm the cache (two first
    trials on two GPUs both compiled). On a cluster the caches are per node unless
    ``SERVETUNE_COMPILE_CACHE_DIR`` is shared: this is the study-wide approximation.
    """
    return WarmCompiles(study, model, gpu, vllm_version).warm(flags)


class WarmCompiles:
    """The compile keys the finished trials of a study compiled (:func:`compile_cache_warm`'s
    rule), read from the study once and kept up to date by :meth:`told` for each trial told
    COMPLETE: the driver's view, so that a proposal does not read every trial back from the storage."""

    def __init__(self, study: optuna.Study, model: ModelProfile, gpu: GpuSpec, vllm_version: str) -> None:
        self.model, self.gpu, self.vllm_version = model, gpu, vllm_version
        self.keys: set[tuple] = set()
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            self.told(t.user_attrs)

    def _key(self, flags: Mapping[str, Any]) -> tuple | None:
        try:
            return compile_key(resolve_engine_config(flags, self.model, self.gpu, self.vllm_version))
        except SpecError:  # a flag set vLLM refuses compiled nothing
            return None

    def told(self, user_attrs: Mapping[str, Any]) -> None:
        """A trial told COMPLETE with these user attributes (its flags and status)."""
        earlier = user_attrs.get("flags")
        if isinstance(earlier, dict) and user_attrs.get("status") not in _NOT_COMPILED \
                and not earlier.get("enforce_eager"):
            key = self._key(earlier)
            if key is not None:
                self.keys.add(key)

    def warm(self, flags: Mapping[str, Any]) -> bool:
        """Whether a finished trial compiled the configuration ``flags`` needs."""
        wanted = self._key(flags)
        return wanted is not None and wanted in self.keys


def warm_compiles(spec: StudySpec, study: optuna.Study) -> WarmCompiles | None:
    """The view :func:`propose` and :func:`tell` keep for ``study`` (None: no pre-screen reads it)."""
    if not spec.prescreen or spec.model_profile is None:
        return None
    return WarmCompiles(study, spec.model_profile, spec.gpu_spec(), spec.vllm_version)


def propose(spec: StudySpec, study: optuna.Study, total_gpus: int, backend: str | None = None,
            warm: WarmCompiles | None = None, env: CommEnv | None = None) -> Proposal:
    """Ask Optuna for a trial and decide whether it may launch (rules, GPU count, pre-screen).

    Its flags and the planner's prediction are kept on the trial (:func:`defer_trial_attrs`) and
    written when it is told (:func:`tell`), in the same transaction as its result. ``warm``: the
    study's :class:`WarmCompiles` (:func:`warm_compiles`), kept by the caller across proposals;
    without it the study's trials are read for each pre-screened proposal. ``env``: :func:`prescreen`'s.
    """
    backend = backend or spec.backend
    trial = study.ask()
    flags = {**spec.fixed_flags, **spec.search_space.suggest(trial)}
    attrs: dict[str, Any] = {"flags": flags}  # written with the result, when the trial is told
    need = gpus_needed(flags)
    problems = spec.search_space.check(flags, spec.model_profile, spec.gpu.count, spec.workload)
    if not problems and need > total_gpus:
        problems = [f"needs {need} GPUs, the cluster has {total_gpus}"]
    if problems:  # refused before launch: no GPU time spent, the sampler still learns
        defer_trial_attrs(trial, attrs)
        return Proposal(trial, flags, need, TrialResult(status=TrialStatus.INVALID_CONFIG, cause="; ".join(problems),
                                                        backend=backend))
    if not spec.prescreen:
        defer_trial_attrs(trial, attrs)
        return Proposal(trial, flags, need)
    if warm is None:
        warm = warm_compiles(spec, study)
    is_warm = warm is not None and warm.warm(flags)
    refused, plan = prescreen(spec, flags, backend, compile_cache_warm=is_warm, env=env)
    if plan is not None:
        attrs.update(predicted_kv_cache_tokens=plan.kv_cache_tokens, predicted_compile_cache_warm=is_warm)
    if refused is not None and plan is not None:
        attrs["predicted_failure"] = (plan.failure or TrialStatus.STARTUP_OOM).value
    defer_trial_attrs(trial, attrs)
    return Proposal(trial, flags, need, refused, plan)


def tell(spec: StudySpec, study: optuna.Study, trial: optuna.trial.Trial, result: TrialResult,
         warm: WarmCompiles | None = None) -> list[float]:
    """Tell Optuna one result: constraints, user attributes (with those :func:`propose` kept on the
    trial), objective values (returned); ``warm`` learns what the trial compiled.

    An ``infra_error`` (the machine failed, not the flags; the pool's re-runs exhausted) is told
    FAIL, which Optuna's samplers ignore: no constraint, so the flag set is never learnt as
    infeasible. The returned values are the worst, for the record only.
    """
    # What happened, in the words of every plot and MLflow (servetune.records.outcome), so that
    # optuna-dashboard's trials table shows it too.
    outcome = classify(result.status, result.preemptions, screened=is_screen_cause(result.cause)).value
    attrs: dict[str, Any] = {"status": result.status.value, "outcome": outcome, "cause": (result.cause or "")[:1000]}
    if result.status.is_infrastructure:
        attrs["infra_attempts"] = [a[:300] for a in result.infra_attempts][:10]
        set_trial_attrs(trial, attrs)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return objective_values(spec, result)
    attrs.update(metrics=result.metrics(), preemptions=result.preemptions or 0)
    if result.early_stopped:  # measured over a shortened window: the figures are marked as such
        attrs["early_stopped"] = result.early_stopped
    # One storage write for the constraints and attributes (set_trial_attrs), then the tell.
    set_trial_attrs(trial, attrs, constraint_values(spec, result))
    values = objective_values(spec, result)
    study.tell(trial, values)
    if warm is not None:
        warm.told(trial.user_attrs)
    return values


@dataclasses.dataclass(frozen=True)
class StoredTrial:
    """What :func:`propose` and :func:`tell` stored on an Optuna trial, read back typed: the one
    reader of servetune's trial user attributes. ``flags`` falls back to the trial's params (a trial
    asked before its flags were stored), ``status`` to ``ok``."""

    number: int
    flags: dict[str, Any]
    status: str
    cause: str | None
    metrics: dict[str, float]
    preemptions: int
    early_stopped: str | None

    @classmethod
    def of(cls, t: optuna.trial.FrozenTrial | optuna.trial.Trial) -> StoredTrial:
        a = t.user_attrs
        return cls(t.number, dict(a.get("flags", t.params)), str(a.get("status", "ok")), a.get("cause") or None,
                   dict(a.get("metrics", {})), int(a.get("preemptions", 0) or 0), a.get("early_stopped"))

    def result(self, backend: str, vllm_version: str) -> TrialResult:
        """The told result rebuilt from what was stored (figures, status, cause, early stop)."""
        result = TrialResult.from_metrics(self.status, self.cause, self.metrics, backend=backend,
                                          vllm_version=vllm_version)
        result.early_stopped = self.early_stopped
        return result


def _unprobed_env(backend: str) -> CommEnv:
    """The environment a trial of ``backend`` is planned with before any GPU worker was probed."""
    return trial_env(capabilities(backend).real_gpus)


def enqueue_informed_starts(spec: StudySpec, study: optuna.Study, env: CommEnv | None = None) -> list[dict[str, Any]]:
    """Enqueue the preemption prior's starting points in a study with no trials yet; returns them. ``env``: the
    environment the trials run with (None: :func:`~servetune.planner.comm.trial_env` of the spec's backend,
    unprobed)."""
    if not spec.prescreen or spec.model_profile is None or study.get_trials(deepcopy=False):
        return []
    env = _unprobed_env(spec.backend) if env is None else env
    starts = informed_starts(spec.search_space, spec.fixed_flags, spec.model_profile, spec.gpu_spec(),
                             spec.workload, spec.vllm_version, env=env)
    for params in starts:
        study.enqueue_trial(params, user_attrs={"informed_start": True}, skip_if_exists=True)
    return starts


# -- multi-fidelity ---------------------------------------------------------------------------------

def sim_screen(spec: StudySpec, screen: SimScreen | None, proposal: Proposal, best: float | None,
               backend: str | None = None) -> tuple[TrialResult | None, TrialResult] | None:
    """``(screened, sim)`` for a proposal that passed the pre-screen, or None without a screen.

    ``sim`` is the simulated engine's result (the caller feeds it back with the real result to
    :meth:`SimScreen.observe`); ``screened`` is the ``pruned`` result to tell instead of
    dispatching, or None to dispatch. A screened trial gets the user attr ``sim_prediction``.
    """
    if screen is None:
        return None
    sim = simulated(screen, spec, proposal.flags)
    reason = screen.verdict(sim, best)
    if reason is None:
        return None, sim
    defer_trial_attrs(proposal.trial, {"sim_prediction": prediction_attrs(sim)})
    return screened_result(sim, reason, backend or spec.backend), sim


def best_feasible(spec: StudySpec, told: list[Told]) -> float | None:
    """The best output throughput among told trials meeting every constraint (None: none yet)."""
    values = [float(t.result.output_throughput) for t in told
              if t.result.ok and t.result.output_throughput is not None
              and meets_constraints(spec, t.result)]
    return max(values) if values else None


# -- the loop in process ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Told:
    """One told trial of :func:`run_local`; ``dispatched`` is False for a refusal (no GPU used)."""

    number: int
    flags: dict[str, Any]
    result: TrialResult
    dispatched: bool


def run_local(spec: StudySpec, study: optuna.Study, evaluate: Callable[[dict[str, Any]], TrialResult], *,
              max_dispatched: int, max_told: int | None = None, total_gpus: int | None = None,
              stop: Callable[[list[Told]], bool] | None = None, informed: bool = True,
              screen: SimScreen | None = None) -> list[Told]:
    """Ask, pre-screen, (sim-screen,) evaluate and tell, one trial at a time, in this process.

    Ends after ``max_dispatched`` evaluated trials, ``max_told`` told ones (default 10x the
    former: a space the planner rejects almost everywhere must still end), or when ``stop``
    returns True. Informed starts are enqueued first in a fresh study (when ``spec.prescreen`` and
    ``informed``; the benchmark turns them off to measure the pre-screen alone). With a
    ``screen`` (:mod:`servetune.search.screen`), a proposal that passed the pre-screen is first run on
    the simulator and told ``pruned`` when the calibrated prediction rules it out; every evaluated
    trial recalibrates the screen.
    """
    if informed:
        enqueue_informed_starts(spec, study)
    limit = max_told if max_told is not None else 10 * max_dispatched
    gpus = total_gpus if total_gpus is not None else spec.gpu.count
    told: list[Told] = []
    dispatched = 0
    warm = warm_compiles(spec, study)
    while dispatched < max_dispatched and len(told) < limit:
        p = propose(spec, study, gpus, warm=warm)
        screened = None if p.refused is not None else sim_screen(spec, screen, p, best_feasible(spec, told))
        if p.refused is not None:
            result, ran = p.refused, False
        elif screened is not None and screened[0] is not None:
            result, ran = screened[0], False
        else:
            result, ran = with_slo_figures(spec, p.flags, evaluate(p.flags)), True
            dispatched += 1
            if screen is not None and screened is not None:
                learn(screen, spec, p.flags, screened[1], result)
        tell(spec, study, p.trial, result, warm=warm)
        told.append(Told(p.trial.number, p.flags, result, ran))
        if stop is not None and stop(told):
            break
    return told


def early_stop_rule(spec: StudySpec, best_throughput: float | None) -> EarlyStop | None:
    """The rule of a study's next trial, or None when early stopping is off or nothing can decide.

    The throughput verdict applies only when the first objective is output throughput, maximised
    (any other objective is not bounded by the token rate).
    """
    if not spec.early_stopping:
        return None
    best = (best_throughput if maximises_output_throughput(spec) and best_throughput and best_throughput > 0
            else None)
    max_pre = spec.constraints.max_preemptions
    if best is None and max_pre is None:
        return None
    return EarlyStop(max_preemptions=None if max_pre is None else int(max_pre), best_throughput=best)
