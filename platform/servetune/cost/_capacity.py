"""Capacity: per GPU type and layout, the replicas a request rate needs at the SLO, and the cost.

For one model, one workload's lengths, latency targets and a target rate ``R`` (requests/s):

1. **Layouts** (:func:`layouts`): per GPU type, the tensor-parallel sizes (1, 2, 4, 8) that divide
   the model's attention heads and that the memory planner says start, at
   ``gpu_memory_utilization`` 0.9 and a ``max_model_len`` covering the workload's longest request.
2. **Flag sets**: the planner's informed start (``max_num_seqs`` at the preemption bound of the
   planned KV cache, :func:`servetune.planner.prior.preemption_bound`) and half of it.
3. **A replica's rate at the SLO** (:func:`replica_capacity`): the simulator serves the workload
   closed-loop at the flag set's batch, then open-loop (Poisson) at that rate; while the targets
   hold, at 1.5 times more (at most :data:`_GROW_STEPS` times), else at rates bisected below it
   (to 1/2^:data:`BISECT_STEPS` of the bracket); the highest rate whose window meets every
   target (p99 latencies, no preemption beyond the limit) is the replica's capacity, and that
   window's goodput (:mod:`._goodput`) its tokens.
4. **The fleet**: ``replicas = ceil(R / capacity)``, GPUs, dollars per hour and per million good
   output tokens at ``R`` (a fleet rounded up to whole replicas pays for their idle share), and one
   replica's dollars per million good tokens at its capacity: the GPU type's cost at the SLO.

Each row says what it rests on (:func:`calibration_evidence`): whether the simulator was judged on
held-out real windows of that GPU. Pure of I/O but the simulator's own work.

Example:
    >>> from servetune.workload import Workload
    >>> w = Workload.from_dict({"input_len": 256, "output_len": 64, "num_requests": 60, "concurrency": 1})
    >>> rows = capacity_table("servetune-test-850m", w, 5.0, {"ttft_p99_ms": 2000.0, "preemptions": 0.0},
    ...                       ["L40S"], load_prices(), tp_sizes=(1,))
    >>> rows[0].gpu, rows[0].tp, rows[0].replicas >= 1, rows[0].judged
    ('L40S', 1, True, True)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from servetune.cost._goodput import cost_per_mtok, goodput
from servetune.cost._prices import GpuPrice, PriceTable, load_prices
from servetune.errors import SpecError
from servetune.planner.engine_config import resolve_engine_config
from servetune.planner.gpus import GpuSpec, calibration_note, get_gpu, sim_evidence_text
from servetune.planner.memory import plan_memory
from servetune.planner.modelinfo import ModelProfile, load_model
from servetune.planner.prior import preemption_bound
from servetune.result import TrialResult
from servetune.sim import simulate
from servetune.workload import Workload

__all__ = ["CapacityRow", "ReplicaCapacity", "capacity_table", "replica_capacity", "layouts", "calibration_evidence",
           "meets_limits", "BISECT_STEPS", "TP_SIZES"]

TP_SIZES = (1, 2, 4, 8)
BISECT_STEPS = 6  # the capacity is bracketed to 1/64 of the closed-loop rate
_GROW_STEPS = 3  # rates tried above the closed loop's while the targets hold
_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization


def calibration_evidence(gpu: GpuSpec, model: ModelProfile | None = None) -> tuple[bool, str]:
    """``(judged, what)``: whether real vLLM runs of this GPU type judged the simulator's step times to the
    target (:func:`~servetune.planner.gpus.calibration_note` has no line for it), and in words what judged them
    (the GPU table's ``sim_evidence`` and the published runs held out on it,
    :func:`~servetune.planner.gpus.sim_evidence_text`).

    Example:
        >>> [calibration_evidence(get_gpu(g))[0] for g in ("L40S", "RTX-5090", "T4")]
        [True, False, False]
        >>> calibration_evidence(get_gpu("RTX-5090"))[1][:64]
        'simulator judged below its target on the RTX-5090 (published vLL'
    """
    evidence = sim_evidence_text(gpu, model)
    if evidence and calibration_note(gpu, model) is None:
        return True, f"simulator judged on the {gpu.name}: {evidence}"
    if evidence:
        return False, f"simulator judged below its target on the {gpu.name} ({evidence}): an estimate"
    return False, (f"simulator not judged on the {gpu.name}: the H200's fitted constants at the {gpu.name}'s "
                   "datasheet rates; an estimate")


def meets_limits(metrics: Mapping[str, float], limits: Mapping[str, float]) -> bool:
    """Whether a served window's figures are within every limit (``Constraints.limits()`` keys).

    Example:
        >>> meets_limits({"ttft_p99_ms": 900.0, "preemptions": 0.0}, {"ttft_p99_ms": 1000.0, "preemptions": 0.0})
        True
    """
    for key, limit in limits.items():
        value = metrics.get(key, 0.0 if key == "preemptions" else None)
        if value is None or value > limit:
            return False
    return True


@dataclasses.dataclass(frozen=True)
class ReplicaCapacity:
    """One flag set's highest rate at the SLO on one replica, and the window that showed it."""

    flags: Mapping[str, Any]
    rate: float  # requests/s; 0 when even the lowest rate tried missed a target
    goodput_tok_s: float  # good output tokens/s at ``rate``
    good_share: float
    simulations: int


@dataclasses.dataclass(frozen=True)
class CapacityRow:
    """One GPU type and layout: a replica's capacity and the fleet for the target rate."""

    gpu: str
    tp: int
    flags: Mapping[str, Any]
    replica_rate: float  # requests/s one replica serves at the SLO
    replica_goodput_tok_s: float
    replicas: int | None  # None: no rate met the targets
    gpus: int | None
    usd_per_hour: float | None
    usd_per_mtok: float | None  # the fleet at the target rate, over its good output tokens
    replica_usd_per_mtok: float | None  # one replica at its capacity: the GPU type's cost at the SLO
    price: GpuPrice
    judged: bool
    evidence: str
    simulations: int
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["flags"] = dict(self.flags)
        d["price"] = dataclasses.asdict(self.price)
        return d


def _paced(workload: Workload, *, rate: float | None = None, concurrency: int | None = None) -> Workload:
    return dataclasses.replace(workload, request_rate=rate, concurrency=concurrency, trace_file=None)


def _max_model_len(workload: Workload) -> int:
    need = workload.max_prompt_tokens + workload.max_output_tokens
    return max(2048, 1 << max(need - 1, 1).bit_length())


def layouts(model: ModelProfile, gpu: GpuSpec, workload: Workload, fixed: Mapping[str, Any],
            vllm_version: str, tp_sizes: Sequence[int] = TP_SIZES, most: int = 2) -> list[tuple[int, dict[str, Any], int]]:
    """``(tp, flags, max_num_seqs bound)`` for the first ``most`` TP sizes of ``tp_sizes`` that divide
    the heads and start (by default the smallest that starts and the next)."""
    out: list[tuple[int, dict[str, Any], int]] = []
    for tp in tp_sizes:
        if len(out) >= most:
            break
        if model.num_attention_heads % tp:
            continue
        flags = {"gpu_memory_utilization": _UTILIZATION, "max_model_len": _max_model_len(workload),
                 **fixed, "tensor_parallel_size": tp}
        try:
            config = resolve_engine_config(flags, model, gpu, vllm_version)
        except SpecError:
            continue
        plan = plan_memory(model, gpu, config)
        if not plan.fits:
            continue
        reqs = workload.requests()
        mean_p = sum(r.prompt_tokens for r in reqs) / len(reqs)
        mean_o = sum(r.output_tokens for r in reqs) / len(reqs)
        bound = min(preemption_bound(plan.kv_cache_tokens, mean_p, mean_o, plan.block_size), 1024)
        if bound >= 1:
            out.append((tp, flags, bound))
    return out


def _window(model: ModelProfile, gpu: GpuSpec, flags: Mapping[str, Any], workload: Workload,
            vllm_version: str) -> TrialResult:
    config = resolve_engine_config(dict(flags), model, gpu, vllm_version)
    return simulate(model, gpu, config, workload)


def replica_capacity(model: ModelProfile, gpu: GpuSpec, flags: Mapping[str, Any], workload: Workload,
                     limits: Mapping[str, float], vllm_version: str) -> ReplicaCapacity:
    """The highest Poisson rate one replica with ``flags`` serves within ``limits`` (step 3 above)."""
    seqs = int(flags["max_num_seqs"])
    sat = _window(model, gpu, flags, _paced(workload, concurrency=seqs), vllm_version)
    runs = 1
    if not sat.ok or not sat.request_throughput:
        return ReplicaCapacity(flags, 0.0, 0.0, 0.0, runs)
    lo, hi = 0.0, float(sat.request_throughput)
    best: tuple[float, float, float] = (0.0, 0.0, 0.0)
    rate, grow = hi, True  # the closed loop's rate first; while met, 1.5x more (a short window's tail)
    for _ in range(BISECT_STEPS + _GROW_STEPS):
        r = _window(model, gpu, flags, _paced(workload, rate=rate), vllm_version)
        runs += 1
        if r.ok and r.duration_s and meets_limits(r.metrics(), limits):
            g = goodput(r.requests, r.duration_s, limits)
            best = max(best, (rate, g.output_tok_s, g.share))
            lo = rate
        else:
            hi, grow = rate, False
        if grow and runs - 1 > _GROW_STEPS:
            break  # met at 1.5^k x the closed loop's rate: that is the capacity said
        rate = lo * 1.5 if grow else (lo + hi) / 2
        if not grow and hi - lo <= hi / 2**BISECT_STEPS:
            break
    return ReplicaCapacity(flags, best[0], best[1], best[2], runs)


def _row(gpu: GpuSpec, model: ModelProfile, tp: int, cap: ReplicaCapacity, rate: float, price: GpuPrice,
         runs: int) -> CapacityRow:
    judged, evidence = calibration_evidence(gpu, model)
    if cap.rate <= 0 or cap.goodput_tok_s <= 0:
        return CapacityRow(gpu.name, tp, cap.flags, 0.0, 0.0, None, None, None, None, None, price, judged, evidence, runs,
                           note="no rate tried met the targets")
    replicas = math.ceil(rate / cap.rate - 1e-9)
    gpus = replicas * tp
    per_hour = gpus * price.usd_per_gpu_hour
    good_tok_per_request = cap.goodput_tok_s / cap.rate
    fleet = cost_per_mtok(price.usd_per_gpu_hour, gpus, rate * good_tok_per_request)
    replica = cost_per_mtok(price.usd_per_gpu_hour, tp, cap.goodput_tok_s)
    return CapacityRow(gpu.name, tp, cap.flags, cap.rate, cap.goodput_tok_s, replicas, gpus, per_hour, fleet, replica,
                       price, judged, evidence, runs)


def capacity_table(model: str | ModelProfile, workload: Workload, rate: float, limits: Mapping[str, float],
                   gpu_names: Sequence[str], prices: PriceTable | None = None, *, fixed: Mapping[str, Any] | None = None,
                   vllm_version: str = "0.26.0", tp_sizes: Sequence[int] = TP_SIZES,
                   most_layouts: int = 2) -> list[CapacityRow]:
    """One row per GPU type and layout that starts (at most ``most_layouts`` per GPU type, the smallest
    TP sizes of ``tp_sizes`` that start), cheapest per million good tokens first (rows with no rate at
    the SLO last). ``limits`` are ``Constraints.limits()``'s keys."""
    if not rate > 0 or not math.isfinite(rate):
        raise SpecError("--rate", f"must be a positive number of requests/s, got {rate}", "e.g. --rate 20")
    profile = model if isinstance(model, ModelProfile) else load_model(model)
    table = prices or load_prices()
    rows: list[CapacityRow] = []
    for name in gpu_names:
        gpu = get_gpu(name)
        price = table.price(gpu.name, "--gpu")
        for tp, flags, bound in layouts(profile, gpu, workload, fixed or {}, vllm_version, tp_sizes, most_layouts):
            candidates = sorted({bound, max(1, bound // 2)}, reverse=True)
            caps = [replica_capacity(profile, gpu, {**flags, "max_num_seqs": s}, workload, limits, vllm_version)
                    for s in candidates]
            best = max(caps, key=lambda c: (c.goodput_tok_s, c.rate))
            rows.append(_row(gpu, profile, tp, best, rate, price, sum(c.simulations for c in caps)))
    rows.sort(key=lambda r: (r.usd_per_mtok is None, r.usd_per_mtok or 0.0, r.replica_usd_per_mtok or 0.0, r.gpu, r.tp))
    return rows
