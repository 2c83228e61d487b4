"""Informed starts: the one or two flag sets a fresh study measures first.

The throughput of a memory-pair landscape rises with the batch until the KV cache
runs out, so the best preemption-free point sits at the most KV memory the space allows and the
largest ``max_num_seqs`` under the bound. Start 1 is the highest ``gpu_memory_utilization`` of
the space that the planner says starts (and, where one exists, whose sampler warm-up it does not warn
about), with the largest ``max_num_seqs`` of the space at or under
the certain bound (and no larger than the workload's in-flight requests need); start 2, when it
differs, the largest at or under the optimistic bound, which probes the band where preemption
depends on timing. The sampler then learns the edge from both sides.

They rest on the preemption prior (:mod:`servetune.planner.prior`) and the memory planner; this
module adds what depends on the search space (snapping a bound onto a parameter's grid).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from servetune.errors import SpecError
from servetune.planner.comm import SERVETUNE_LAUNCH_ENV, CommEnv
from servetune.planner.engine_config import resolve_engine_config
from servetune.planner.memory import plan_memory
from servetune.planner.prior import optimistic_bound, preemption_bound

if TYPE_CHECKING:
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.modelinfo import ModelProfile
    from servetune.spec.space import Param, SearchSpace
    from servetune.workload import Workload

__all__ = ["informed_starts", "snap_down", "snap_nearest"]


def snap_down(param: Param, value: float) -> Any | None:
    """The largest value of ``param`` at or below ``value`` (its grid, choices or bounds), or None."""
    values = param.values()
    if values is None:  # a continuous float range
        return None if value < float(param.low) else min(float(value), float(param.high))  # type: ignore[arg-type]
    numeric = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    below = [v for v in numeric if v <= value]
    return max(below) if below else None


def snap_nearest(param: Param, value: float) -> Any | None:
    """The value of ``param`` nearest ``value`` (the lower one on a tie), clamped into a continuous
    range; None for a parameter with no numeric value."""
    values = param.values()
    if values is None:
        return min(max(float(value), float(param.low)), float(param.high))  # type: ignore[arg-type]
    numeric = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return min(numeric, key=lambda v: (abs(v - value), v)) if numeric else None


def _default_token_budget(space: SearchSpace, fixed: Mapping[str, Any], model: ModelProfile, gpu: GpuSpec,
                          vllm_version: str, seqs: int) -> int | None:
    """vLLM's default ``max_num_batched_tokens`` for this GPU (and fixed flags), snapped onto the
    space, when the space searches it; None otherwise."""
    if "max_num_batched_tokens" not in space or "max_num_batched_tokens" in fixed:
        return None
    try:
        config = resolve_engine_config({**fixed, "max_num_seqs": int(seqs)}, model, gpu, vllm_version)
    except SpecError:
        return None
    snapped = snap_nearest(space["max_num_batched_tokens"], config.max_num_batched_tokens)
    return None if snapped is None else int(snapped)


def _descending(param: Param) -> Sequence[Any]:
    values = param.values()
    if values is None:
        return [float(param.high)]  # type: ignore[arg-type]
    return sorted((v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)), reverse=True)


def informed_starts(space: SearchSpace, fixed: Mapping[str, Any], model: ModelProfile, gpu: GpuSpec,
                    workload: Workload, vllm_version: str, *, max_starts: int = 2,
                    env: CommEnv = SERVETUNE_LAUNCH_ENV) -> list[dict[str, Any]]:
    """Up to ``max_starts`` partial flag sets (searched names only) to enqueue in a fresh study.

    Empty when the space does not search ``max_num_seqs`` or no value of it fits the plan. Only
    ``gpu_memory_utilization``, ``max_num_seqs`` and, where the space searches it,
    ``max_num_batched_tokens`` are set; the sampler draws the other params. The token budget is
    vLLM's own default for this GPU snapped onto the space (:func:`snap_nearest`): the plan behind
    the start (its KV capacity, so its ``max_num_seqs``) is computed with that budget, and a start
    that left it to the sampler ran with a budget the plan never assumed. ``env``: the environment the trials run
    with (:func:`servetune.planner.comm.trial_env`).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> from servetune.spec.space import SearchSpace
        >>> from servetune.workload import Workload
        >>> space = SearchSpace.from_dict({"params": {
        ...     "gpu_memory_utilization": {"type": "float", "low": 0.3, "high": 0.95, "step": 0.05},
        ...     "max_num_seqs": {"type": "categorical", "choices": [16, 32, 64, 128, 256, 512]}}})
        >>> w = Workload.from_dict({"input_len": 512, "output_len": 1024, "num_requests": 384, "concurrency": 192})
        >>> informed_starts(space, {"max_model_len": 4096}, load_model("llama-3.1-8b"), get_gpu("A100-40GB"), w, "0.26.0")
        [{'gpu_memory_utilization': 0.95, 'max_num_seqs': 64}, {'gpu_memory_utilization': 0.95, 'max_num_seqs': 128}]
    """
    if "max_num_seqs" not in space:
        return []
    seqs_param = space["max_num_seqs"]
    util_param = space["gpu_memory_utilization"] if "gpu_memory_utilization" in space else None
    utils: Sequence[Any] = _descending(util_param) if util_param is not None else [None]
    mean_prompt, mean_output = workload.input_len.mean, workload.output_len.mean
    if workload.trace_file is not None or workload.prompt_file is not None:
        reqs = workload.requests()
        mean_prompt = sum(r.prompt_tokens for r in reqs) / len(reqs)
        mean_output = sum(r.output_tokens for r in reqs) / len(reqs)
    # A batch larger than the requests in flight is never filled: cap the start there (an open-loop
    # rate may queue beyond any concurrency, so it is not capped).
    in_flight = workload.concurrency if workload.request_rate is None and workload.trace_file is None else None

    budget = _default_token_budget(space, fixed, model, gpu, vllm_version, min(_descending(seqs_param)))
    budget_flag = {} if budget is None else {"max_num_batched_tokens": budget}

    def plan(util: Any, seqs: int) -> Any:
        flags = {**fixed, **budget_flag, "max_num_seqs": int(seqs)}
        if util is not None:
            flags["gpu_memory_utilization"] = util
        try:
            config = resolve_engine_config(flags, model, gpu, vllm_version)
        except SpecError:
            return None
        return plan_memory(model, gpu, config, env=env)

    smallest = min(_descending(seqs_param))
    # The highest utilization that starts with no warm-up warning (memory.warmup_note: real starts died
    # in the sampler warm-up inside that band); where every one is warned, the highest that starts.
    fitting: list[tuple[Any, bool]] = []  # (utilization, warned), highest first, up to the first unwarned
    for util in utils:
        first = plan(util, smallest)
        if first is not None and first.fits:
            fitting.append((util, first.warmup_at_risk))
            if not first.warmup_at_risk:
                break
    if not fitting:
        return []
    avoid_risk = not fitting[-1][1]
    util = fitting[-1][0] if avoid_risk else fitting[0][0]
    starts: list[dict[str, Any]] = []
    for bound_fn in (preemption_bound, optimistic_bound):
        # KV capacity shrinks a little with max_num_seqs (CUDA graphs, sampler peak): settle it.
        seqs = smallest
        for _ in range(3):
            p = plan(util, seqs)
            if p is None or not p.fits:
                break
            bound = bound_fn(p.kv_cache_tokens, mean_prompt, mean_output, p.block_size)
            if in_flight is not None:
                bound = min(bound, in_flight)
            snapped = snap_down(seqs_param, bound)
            if snapped is None or snapped == seqs:
                break
            seqs = int(snapped)
        p = plan(util, seqs)
        if p is None or not p.fits or (avoid_risk and p.warmup_at_risk):
            continue
        start: dict[str, Any] = {"max_num_seqs": int(seqs), **budget_flag}
        if budget_flag and space.check({**fixed, **start}, model, workload=workload):
            # The space's own rules refuse the default budget with this batch (joint.yaml:
            # budget <= 64 x max_num_seqs): leave the budget to the sampler, as before.
            del start["max_num_batched_tokens"]
        if util is not None:
            start = {"gpu_memory_utilization": util, **start}
        if start not in starts:
            starts.append(start)
    return starts[:max_starts]
