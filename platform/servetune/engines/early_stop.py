"""Early stopping inside a real trial: end the measured window once its outcome is decided.

A trial's told outcome is decided before its workload is finished when

* ``preemptions``: the server's preemption counter has already moved past
  ``constraints.max_preemptions`` (the trial is infeasible whatever happens next), or
* ``throughput``: after ``min_fraction`` of the measured requests were answered, a generous upper
  bound of the trial's output throughput (``margin`` x the output tokens so far / the elapsed
  window) is still below the best feasible throughput of the study so far.

Why the bound holds: a closed-loop or Poisson load reaches its steady rate after the first batch
of prefills and ends with a drain at a lower rate, so the mean rate so far is at most a little
below the final figure. How little is measured, not assumed: replayed on the recorded requests of
every real vLLM window in ``tests/fixtures/real_h200`` (``benchmarks/early_stopping.py --real``),
the mean rate so far, once a quarter of the requests were answered, fell to 1/1.546 of the
window's final rate on the 51 H200 windows of 2026-12-01 and 2026-12-02 before ``2026-12-02a`` (a 14B closed loop of
2048-token prompts, four waves of 64: the rate dips at each wave's prefills). ``margin`` 1.6 is the
first step of 0.05 above that; the 15 windows of the ``2026-12-02a`` host, which that choice did
not use (though they were measured by then), needed at most 1.519. It was 1.5 until then, under
which 7 of the 66 windows would have been stopped below their final rate, by up to 3%: a trial
tying the best could be cut and told a lower figure. The price: 30% below the best, the rule now
saves 20-27% of a window instead of about 37%.

The rule is pure and picklable (it travels in the :class:`~servetune.engines.base.TrialTask` to the Ray
actor); the driver builds it from the spec and the best-so-far (:func:`servetune.search.propose.early_stop_rule`). A stopped trial
keeps honest figures: a preempting one is told its counted preemptions (infeasible), a
throughput-stopped one its measured throughput over the shortened window; both carry
``TrialResult.early_stopped`` (the reason), logged as the MLflow tag ``servetune.early_stopped`` and
the dataset column ``early_stopped``.

Example:
    >>> rule = EarlyStop(max_preemptions=0, best_throughput=1000.0)
    >>> rule.verdict(preemptions=3, output_tokens=0, elapsed_s=1.0, answered=0, total=100)
    'preemptions: 3 counted, 0 allowed'
    >>> rule.verdict(preemptions=0, output_tokens=3000, elapsed_s=10.0, answered=30, total=100)
    'throughput: at most 480 tok/s (1.6 x 300 so far after 30/100 requests), best so far 1000 tok/s'
    >>> rule.verdict(preemptions=0, output_tokens=3000, elapsed_s=10.0, answered=10, total=100) is None
    True
"""

from __future__ import annotations

import dataclasses

__all__ = ["EarlyStop"]


@dataclasses.dataclass(frozen=True)
class EarlyStop:
    """When a running trial's outcome is decided. ``None`` limits are not checked."""

    max_preemptions: int | None = None  # constraints.max_preemptions
    best_throughput: float | None = None  # best feasible output throughput so far (tokens/s)
    min_fraction: float = 0.25  # of the measured requests answered before a throughput verdict
    margin: float = 1.6  # upper bound = margin x the mean output rate so far (see the module docstring)

    def verdict(self, *, preemptions: int | None, output_tokens: float, elapsed_s: float, answered: int,
                total: int) -> str | None:
        """The reason the outcome is decided, or None to go on measuring."""
        if self.max_preemptions is not None and preemptions is not None and preemptions > self.max_preemptions:
            return f"preemptions: {preemptions} counted, {self.max_preemptions} allowed"
        if (self.best_throughput and total > 0 and elapsed_s > 0 and answered < total
                and answered >= self.min_fraction * total):
            rate = output_tokens / elapsed_s
            bound = self.margin * rate
            if bound < self.best_throughput:
                return (f"throughput: at most {bound:.0f} tok/s ({self.margin:g} x {rate:.0f} so far after "
                        f"{answered}/{total} requests), best so far {self.best_throughput:.0f} tok/s")
        return None
