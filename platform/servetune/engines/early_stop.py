"""Early stopping inside a real trial: end the measured window once its outcome is decided.

A trial's told outcome is decided before its workload is finished when

* ``preemptions``: the server's preemption counter has already moved past
  ``constraints.max_preemptions`` (the trial is infeasible whatever happens next), or
* ``throughput``: after ``min_fraction`` of the measured requests were answered, a generous upper
  bound of the trial's output throughput (``margin`` x the output tokens so far / the elapsed
  window) is still below the best feasible throughput of the study so far.

Why the bound holds: a closed-loop or Poisson load reaches its steady rate after the first batch
of prefills and ends with a drain at a lower rate, so the mean rate so far is at most a little
below the final figure; ``margin`` 1.5 covers a ramp-up of a third of the window.

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
    'throughput: at most 450 tok/s (1.5 x 300 so far after 30/100 requests), best so far 1000 tok/s'
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
    margin: float = 1.5  # upper bound = margin x the mean output rate so far

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
