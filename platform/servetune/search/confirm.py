"""Confirmation: repeat the top candidates, report confidence intervals, choose on confirmed figures.

After a study's budget, with ``budget.confirm_top: k`` (> 0), the ``k`` best feasible distinct
configurations are measured ``budget.confirm_repeats`` more times each, every repeat with another
workload seed (and engine seed): the simulated engine is deterministic per seed, and a real
server's figures move with the request mix, so a new seed is what makes a repeat a new sample.
The replay backend answers repeat ``r`` with the ``r``-th recorded row of the same flags where the
landscape holds repeats (else the one row again: no noise). On the vllm backend a trial whose
window leads the study measures its repeats on its own server right after it
(``budget.confirm_on: same-start``, :class:`servetune.engines.LeaderRepeats`); only the repeats a
top configuration still lacks after the budget are started anew.

Per configuration (:func:`confirm`): the runs are the original trial plus its repeats; the mean of
the first objective over them, its 95% confidence interval (Student's t with n - 1 degrees of
freedom: ``mean +- t(0.975, n-1) x s / sqrt(n)``) and how many runs met every constraint. The
winner (:func:`choose`) is the best confirmed mean among configurations feasible in every run
(one that preempted in a repeat is not confirmed and ranks after them); the report says whether
the top two intervals overlap (then the ranking of those two is not settled by the data).

The repeats never enter the Optuna study as trials (its sampler would read the same flags told
twice); the driver stores the confirmation as the study's user attr ``confirmation`` and
:func:`servetune.study.best_trial` honours its winner. Each repeat is an MLflow child run tagged
``servetune.role=repeat`` and a dataset row with ``repeat`` = its index (the original trial's row
has none).

Example:
    >>> a = confirm(3, {"max_num_seqs": 64}, [100.0, 104.0, 96.0], [True, True, True])
    >>> round(a.mean, 1), round(a.low, 1), round(a.high, 1), a.confirmed
    (100.0, 90.1, 109.9, True)
    >>> b = confirm(5, {"max_num_seqs": 128}, [120.0, 90.0, 130.0], [True, False, True])
    >>> choose([a, b], "maximize").winner.trial_number, choose([a, b], "maximize").overlap
    (3, True)
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Confirmed", "Choice", "confirm", "choose", "t_quantile_975"]

# Student's t, 97.5th percentile, for 1..30 degrees of freedom (two-sided 95%); 1.96 beyond.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """t(0.975, df): the half-width factor of a two-sided 95% interval."""
    if df < 1:
        return math.inf
    return _T975[df - 1] if df <= len(_T975) else 1.96


@dataclasses.dataclass(frozen=True)
class Confirmed:
    """One configuration's runs (the original trial first) and their summary."""

    trial_number: int
    flags: Mapping[str, Any]
    values: tuple[float, ...]  # the first objective per run (0 / worst for a run that did not serve)
    feasible: tuple[bool, ...]  # whether each run met every constraint

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def half_width(self) -> float:
        if self.n < 2:
            return math.inf
        return t_quantile_975(self.n - 1) * statistics.stdev(self.values) / math.sqrt(self.n)

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    @property
    def confirmed(self) -> bool:
        """Feasible in every run."""
        return all(self.feasible)

    def to_dict(self) -> dict[str, Any]:
        finite = math.isfinite(self.half_width)
        return {"trial_number": self.trial_number, "flags": dict(self.flags), "values": list(self.values),
                "feasible_runs": sum(self.feasible), "runs": self.n, "mean": self.mean,
                "ci95": [self.low, self.high] if finite else None, "confirmed": self.confirmed}


@dataclasses.dataclass(frozen=True)
class Choice:
    """The ranking on confirmed figures, its winner, and whether the top two intervals overlap."""

    ranked: tuple[Confirmed, ...]
    overlap: bool | None  # None with fewer than two candidates

    @property
    def winner(self) -> Confirmed | None:
        return self.ranked[0] if self.ranked and self.ranked[0].confirmed else None

    def to_dict(self) -> dict[str, Any]:
        return {"winner": None if self.winner is None else self.winner.trial_number,
                "top_two_overlap": self.overlap, "configs": [c.to_dict() for c in self.ranked]}


def confirm(trial_number: int, flags: Mapping[str, Any], values: Sequence[float], feasible: Sequence[bool]
            ) -> Confirmed:
    """Summarise one configuration's runs (see the module docstring)."""
    if len(values) != len(feasible) or not values:
        raise ValueError("one feasibility verdict per value, at least one run")
    return Confirmed(trial_number, dict(flags), tuple(float(v) for v in values), tuple(bool(f) for f in feasible))


def choose(configs: Sequence[Confirmed], direction: str = "maximize") -> Choice:
    """Rank: configurations feasible in every run first, then by confirmed mean (best first)."""
    sign = 1.0 if direction == "maximize" else -1.0
    ranked = tuple(sorted(configs, key=lambda c: (not c.confirmed, -sign * c.mean)))
    overlap = None
    if len(ranked) >= 2:
        a, b = ranked[0], ranked[1]
        overlap = a.low <= b.high and b.low <= a.high
    return Choice(ranked, overlap)
