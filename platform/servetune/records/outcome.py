"""What happened to a trial, in words a newcomer reads at a glance: the one classification.

Every plot, the report, the MLflow tags and the dataset column ``outcome`` take a trial's class
from :func:`classify`, so a trial is never "ok" in one place and "failed" in another. The class is
decided by the trial's :class:`~servetune.result.TrialStatus` and what the record knows beyond it:

* ``served_clean``: the server started and served the workload without a preemption;
* ``served_preempting``: it served, but preempted requests (a throughput, never a candidate);
* ``startup_failed``: launched and did not start (startup OOM, KV cache too small, CUDA graph OOM);
* ``pruned``: never launched: the memory planner predicted a startup failure;
* ``screened``: never launched: the calibrated simulator predicted a clear loser;
* ``invalid``: never launched (or refused by vLLM at once): the flags are not a valid combination;
* ``runtime_failed``: started, then crashed, ran out of memory or timed out;
* ``infra_failed``: the machine failed (port, GPU memory held by another process, lost node),
  not the flags: told FAIL, never learnt.

Example:
    >>> from servetune.result import TrialStatus
    >>> classify(TrialStatus.OK, 3).label, classify(TrialStatus.PRUNED, None, screened=True).value
    ('served, preempted', 'screened')
"""

from __future__ import annotations

import enum
import math
from typing import Any

import pandas as pd

from servetune.result import TrialStatus

__all__ = ["TrialOutcome", "classify", "classify_frame", "is_screen_cause", "SCREEN_PREFIX"]

#: The ``cause`` prefix (and ``servetune.prescreen`` tag) of a trial the calibrated simulator screened out.
SCREEN_PREFIX = "sim_screen"


class TrialOutcome(str, enum.Enum):
    """A trial's class; the words are a contract (dataset column ``outcome``, tag ``servetune.outcome``)."""

    SERVED_CLEAN = "served_clean"
    SERVED_PREEMPTING = "served_preempting"
    STARTUP_FAILED = "startup_failed"
    PRUNED = "pruned"
    SCREENED = "screened"
    INVALID = "invalid"
    RUNTIME_FAILED = "runtime_failed"
    INFRA_FAILED = "infra_failed"

    @property
    def label(self) -> str:
        """The legend text: what happened, short."""
        return _STYLE[self][0]

    @property
    def short(self) -> str:
        """A word or two, for a bar's tick label or a table cell."""
        return _SHORT[self]

    @property
    def explanation(self) -> str:
        """One sentence for a report's legend: what the class means for the search."""
        return _STYLE[self][3]

    @property
    def served(self) -> bool:
        """The server ran the workload: the trial has measured figures."""
        return self in (TrialOutcome.SERVED_CLEAN, TrialOutcome.SERVED_PREEMPTING)

    @property
    def launched(self) -> bool:
        """GPU time was spent on it (a vLLM start was attempted)."""
        return self not in (TrialOutcome.PRUNED, TrialOutcome.SCREENED, TrialOutcome.INVALID)

    @property
    def color(self) -> str:
        return _STYLE[self][1]

    @property
    def marker(self) -> str:
        return _STYLE[self][2]


# label, matplotlib colour, marker, explanation. The ones that never served sit on the axis floor,
# each class with its own colour and shape, so a pruned trial (no GPU spent) never reads as a
# failure that cost a start.
_STYLE: dict[TrialOutcome, tuple[str, str, str, str]] = {
    TrialOutcome.SERVED_CLEAN: ("served, no preemption", "tab:blue", "o",
                                "started and served the workload with no preemption: a candidate for the best"),
    TrialOutcome.SERVED_PREEMPTING: ("served, preempted", "tab:orange", "D",
                                     "served, but preempted requests under load: its throughput is not a candidate"),
    TrialOutcome.STARTUP_FAILED: ("failed at startup", "tab:red", "X",
                                  "launched and did not start (out of memory, KV cache too small, CUDA graph OOM)"),
    TrialOutcome.PRUNED: ("pruned before launch", "tab:purple", "P",
                          "not launched: the memory planner predicted a startup failure (no GPU time spent)"),
    TrialOutcome.SCREENED: ("screened by the simulator", "tab:cyan", "p",
                            "not launched: the calibrated simulator predicted a clear loser (no GPU time spent)"),
    TrialOutcome.INVALID: ("invalid flags", "0.35", "s",
                           "refused: the flags are not a valid vLLM combination"),
    TrialOutcome.RUNTIME_FAILED: ("failed while serving", "tab:brown", "v",
                                  "started, then crashed, ran out of memory or timed out"),
    TrialOutcome.INFRA_FAILED: ("infrastructure failure", "0.6", "*",
                                "the machine failed (port, GPU held elsewhere, lost node), not the flags: not learnt"),
}


_SHORT: dict[TrialOutcome, str] = {
    TrialOutcome.SERVED_CLEAN: "no preemption", TrialOutcome.SERVED_PREEMPTING: "preempted",
    TrialOutcome.STARTUP_FAILED: "startup failed", TrialOutcome.PRUNED: "pruned",
    TrialOutcome.SCREENED: "screened", TrialOutcome.INVALID: "invalid",
    TrialOutcome.RUNTIME_FAILED: "failed serving", TrialOutcome.INFRA_FAILED: "infra failure",
}


def classify(status: TrialStatus | str, preemptions: float | None, *, screened: bool = False) -> TrialOutcome:
    """The class of one trial from its status, its preemption count and whether the simulator screened it.

    Example:
        >>> classify("startup_oom", None).label
        'failed at startup'
    """
    st = TrialStatus(status)
    if st is TrialStatus.OK:
        n = 0.0 if preemptions is None or (isinstance(preemptions, float) and math.isnan(preemptions)) else preemptions
        return TrialOutcome.SERVED_PREEMPTING if n > 0 else TrialOutcome.SERVED_CLEAN
    if st is TrialStatus.PRUNED:
        return TrialOutcome.SCREENED if screened else TrialOutcome.PRUNED
    if st.is_startup_failure:
        return TrialOutcome.STARTUP_FAILED
    if st is TrialStatus.INVALID_CONFIG:
        return TrialOutcome.INVALID
    if st.is_infrastructure:
        return TrialOutcome.INFRA_FAILED
    return TrialOutcome.RUNTIME_FAILED  # runtime_oom, crashed, timeout, incomplete


def is_screen_cause(cause: Any) -> bool:
    """Whether a pruned trial's cause is the simulator screen's (a record read back from Optuna or
    an older dataset has no ``sim_screen`` column, but its cause says it)."""
    return isinstance(cause, str) and cause.startswith(SCREEN_PREFIX)


def classify_frame(df: pd.DataFrame) -> pd.Series:
    """:func:`classify` of every row of a trials frame (:func:`servetune.records.dataset.read_trials`).

    Reads ``status``, ``preemptions`` and, for the screen, ``sim_screen`` or the ``cause`` prefix.
    A frame without ``status`` is taken as served (a hand-made frame of measurements).

    Example:
        >>> import pandas as pd
        >>> df = pd.DataFrame({"status": ["ok", "pruned"], "preemptions": [0.0, None],
        ...                    "cause": [None, "sim_screen: slower"]})
        >>> [o.value for o in classify_frame(df)]
        ['served_clean', 'screened']
    """
    if df.empty:
        return pd.Series([], index=df.index, dtype=object)
    status = df["status"].astype(str) if "status" in df.columns else pd.Series(TrialStatus.OK.value, index=df.index)
    pre = (pd.to_numeric(df["preemptions"], errors="coerce") if "preemptions" in df.columns
           else pd.Series(math.nan, index=df.index))
    sim = df["sim_screen"].notna() if "sim_screen" in df.columns else pd.Series(False, index=df.index)
    cause = df["cause"] if "cause" in df.columns else pd.Series(None, index=df.index, dtype=object)
    return pd.Series([classify(s, float(p), screened=bool(m) or is_screen_cause(c))
                      for s, p, m, c in zip(status, pre, sim, cause)], index=df.index, dtype=object)
