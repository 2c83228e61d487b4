"""Goodput and cost per million output tokens: the arithmetic, pure.

*Goodput* is the output tokens per second of the requests that met every latency target, over the
measured window: a request counts when its TTFT is within ``p99_ttft_ms``, its mean inter-token
gap (its TPOT, as ``vllm bench serve --goodput`` reads an ITL target per request) within
``p99_itl_ms`` and its end-to-end latency within ``p99_e2e_ms``; a failed request never counts.
With no latency target every completed request counts. The study's p99 constraints still decide
whether a trial is feasible at all; goodput says how many of its tokens a user would have
accepted.

*Cost per million output tokens* at the SLO is ``price per GPU-hour x GPUs / goodput``:
``usd_per_gpu_hour * gpus / (goodput_tok_s * 3600) * 1e6``; None where nothing was good.

Example:
    >>> from servetune.result import RequestRecord
    >>> fast = RequestRecord(0, 100, 50, 0.0, 0.1, 1.0)
    >>> slow = RequestRecord(1, 100, 50, 0.0, 3.0, 4.0)      # TTFT 3 s
    >>> g = goodput([fast, slow], 10.0, {"ttft_p99_ms": 2000.0})
    >>> g.good_requests, g.output_tok_s
    (1, 5.0)
    >>> round(cost_per_mtok(3.6, 1, g.output_tok_s), 2)
    200.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from servetune.result import SLO_METRICS, RequestRecord, TrialResult

__all__ = ["Goodput", "goodput", "cost_per_mtok", "request_meets", "slo_figures", "LATENCY_TARGETS"]

#: The study's latency limits (``Constraints.limits()`` keys) a single request is held to.
LATENCY_TARGETS = ("ttft_p99_ms", "itl_p99_ms", "e2e_p99_ms")


@dataclasses.dataclass(frozen=True)
class Goodput:
    """The requests that met the targets and their output tokens per second."""

    good_requests: int
    requests: int
    output_tok_s: float

    @property
    def share(self) -> float:
        return self.good_requests / self.requests if self.requests else 0.0


def request_meets(r: RequestRecord, limits: Mapping[str, float]) -> bool:
    """Whether one request completed within every latency target of ``limits``.

    Example:
        >>> from servetune.result import RequestRecord
        >>> r = RequestRecord(0, 10, 11, 0.0, 0.2, 1.2)     # TTFT 200 ms, TPOT 100 ms, E2E 1.2 s
        >>> request_meets(r, {"ttft_p99_ms": 250, "itl_p99_ms": 100}), request_meets(r, {"itl_p99_ms": 99})
        (True, False)
    """
    if r.error is not None or r.finish_s is None:
        return False
    checks = (("ttft_p99_ms", r.ttft_ms), ("itl_p99_ms", r.tpot_ms), ("e2e_p99_ms", r.e2e_ms))
    for key, value in checks:
        limit = limits.get(key)
        if limit is not None and value is not None and value > limit:
            return False
        if limit is not None and value is None and key == "ttft_p99_ms":
            return False  # finished without a first token: not a served request
    return True


def goodput(requests: Sequence[RequestRecord], duration_s: float, limits: Mapping[str, float]) -> Goodput:
    """The requests of a window that met ``limits`` and their output tokens per second of ``duration_s``."""
    good = [r for r in requests if request_meets(r, limits)]
    tokens = sum(r.output_tokens for r in good)
    return Goodput(len(good), len(requests), tokens / duration_s if duration_s > 0 else 0.0)


def cost_per_mtok(usd_per_gpu_hour: float, gpus: int, output_tok_s: float) -> float | None:
    """Dollars per million output tokens: ``usd_per_gpu_hour x gpus`` an hour over the tokens of that hour.

    Example:
        >>> round(cost_per_mtok(2.0, 2, 1000.0), 4), cost_per_mtok(2.0, 1, 0.0)
        (1.1111, None)
    """
    if output_tok_s <= 0:
        return None
    return usd_per_gpu_hour * gpus / (output_tok_s * 3600.0) * 1e6


def slo_figures(result: TrialResult, limits: Mapping[str, float], usd_per_gpu_hour: float | None,
                gpus: int) -> dict[str, float]:
    """A served result's goodput figures (and its cost where a price is known), keyed as
    :data:`servetune.result.SLO_METRICS`; empty for a result with no measured requests."""
    if not result.ok or not result.requests or not result.duration_s:
        return {}
    g = goodput(result.requests, result.duration_s, limits)
    out = {"goodput_output_throughput": g.output_tok_s, "good_request_share": g.share}
    if usd_per_gpu_hour is not None:
        cost = cost_per_mtok(usd_per_gpu_hour, gpus, g.output_tok_s)
        if cost is not None:
            out["cost_per_mtok"] = cost
    assert set(out) <= set(SLO_METRICS)
    return out
