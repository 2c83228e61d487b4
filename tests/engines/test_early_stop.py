"""The early-stop rule (servetune.engines.early_stop) replayed on every recorded real vLLM window.

``benchmarks/early_stopping.py --real`` rebuilds, from each window's ``requests.json``, what the
decider saw every 0.5 s (output tokens received, requests answered, elapsed window) and asks the
shipped rule for its verdict. A throughput verdict is only safe if its bound never falls below the
rate the window ends at: a trial that would tie the best must never be cut.
"""

from __future__ import annotations

import dataclasses

import pytest
from early_stopping import RealWindow, margin_needed, real_windows, replay

from servetune.engines.early_stop import EarlyStop


@pytest.fixture(scope="module")
def windows() -> list[RealWindow]:
    """The recorded windows, read once for the module (not at collection: ~8 CPU-s of JSON)."""
    return real_windows()


def test_every_real_window_with_recorded_requests_is_replayed(windows: list[RealWindow]) -> None:
    # The 0.85B model's windows and the user-scale starts' (163 of them: 8B, 14B and the 21 of a 24B
    # model, 2026-12-04b to 2026-12-04h; the profiled windows are left out), all recorded.
    assert len(windows) == 171
    # The smallest: the 2026-12-04h host's 8B eager window at 4 in flight, 8 requests.
    assert all(w.final_throughput > 0 and len(w.finishes) >= 8 for w in windows)


def test_the_rule_never_cuts_a_real_window_that_would_tie_the_best(windows: list[RealWindow]) -> None:
    """With the best so far equal to the window's own final rate, the shipped rule lets every
    real window run to its end (under margin 1.5, ten of them were cut, by up to 3%). The margin
    was chosen on the H200 windows of 2026-12-01 and 2026-12-02 before 2026-12-02a; the 80 windows of
    2026-12-02a to 2026-12-04a, measured after, needed at most 1.523 (1.5 cuts 2026-12-02b's 14B prefill-heavy
    window, two of 2026-12-03a's prefill-heavy ones and 2026-12-03b's 14B fp8 prefill-heavy one; none of
    2026-12-03c's and 2026-12-04a's, which needed 1.499 and 1.398). The 24B windows of 2026-12-04b and 2026-12-04c
    needed up to 1.587 (both prefill-heavy anchors, which 1.5 cuts): inside 1.6, with little room.
    The four clean anchors of the profiled hosts 2026-12-04d and 2026-12-04e needed 1.580 (24B again), 1.518
    (14B; both cut by 1.5), 1.492 and 1.281 (8B at budgets 8192 and 2048). The nine of 2026-12-04f and
    2026-12-04g (in no choice of the rule) needed at most 1.506 (the 24B anchor under a 4,096-token
    budget, which 1.5 cuts), the 24B eager anchor 1.491, 8B 1.412 at most. The sixteen of 2026-12-04h
    (in no choice of the rule) needed at most 1.582 (the 24B anchor) and 1.503 (the 8B anchor; both
    cut by 1.5); its eager windows at most 1.456."""
    rule = EarlyStop(max_preemptions=0)
    for w in windows:
        assert replay(dataclasses.replace(rule, best_throughput=w.final_throughput), w) is None, w.name
    assert max(margin_needed(w) for w in windows) < rule.margin
    assert sum(replay(dataclasses.replace(rule, margin=1.5, best_throughput=w.final_throughput), w) is not None
               for w in windows) == 18


def test_the_rule_still_cuts_clear_losers_early(windows: list[RealWindow]) -> None:
    """40% below the best, nearly every real window is decided before its end, and the verdict
    says what it saw."""
    rule = EarlyStop(max_preemptions=0)
    cut = [replay(dataclasses.replace(rule, best_throughput=w.final_throughput / 0.6), w) for w in windows]
    decided = [v for v in cut if v is not None]
    assert len(decided) > 0.85 * len(windows)
    assert all(reason.startswith("throughput: at most") for reason, _ in decided)
