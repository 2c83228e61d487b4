"""Simulator fidelity against the real vLLM 0.26.0 H200 runs in tests/fixtures/real_h200.

Recomputes, from the fixtures, the errors that ``benchmarks/sim_fidelity.py`` prints, with the
calibrated H200 constants (``servetune.sim.perf.GPU_CALIBRATION``), and holds them to the bounds
achieved when they were fitted, so a change to the scheduler or the step model that makes the
simulator less faithful fails here."""

from __future__ import annotations

import pytest

from _fidelity import error_summary, fidelity_rows, load_real_runs

# Achieved with the committed calibration (see the table in benchmarks/sim_fidelity.py's output):
THROUGHPUT_MAE = 0.05  # mean |error| of output tok/s over the 7 healthy runs (achieved 3.6%)
THROUGHPUT_MAX = 0.10  # worst single run (achieved 8.3%, a1)
TPOT_MAE = 0.10  # achieved 7.1%
TTFT_MAE = 0.30  # achieved 24.8%


@pytest.fixture(scope="module")
def rows():  # type: ignore[no-untyped-def]
    return fidelity_rows()


def test_fixtures_hold_nine_healthy_runs_with_their_preemption_counts() -> None:
    runs = {r.name: r for r in load_real_runs()}
    # c1 (a1 repeated) and d1 (the 4-window load-generator agreement run, its first window) were not
    # used in the fit: out-of-sample checks.
    assert len(runs) == 9 and "b5_fail_u0012" not in runs and "d1_loadgen_vs_bench" in runs
    assert runs["a3_preempt_blocks4096_s128"].preemptions == 106
    assert runs["b3_preempt_blocks1024_s64"].preemptions == 192
    assert sum(r.preemptions for r in runs.values()) == 106 + 192


def test_throughput_error_bound(rows) -> None:  # type: ignore[no-untyped-def]
    e = error_summary(rows)
    assert e["throughput_mae"] <= THROUGHPUT_MAE, e
    assert e["throughput_max"] <= THROUGHPUT_MAX, e


def test_latency_error_bounds(rows) -> None:  # type: ignore[no-untyped-def]
    e = error_summary(rows)
    assert e["tpot_mae"] <= TPOT_MAE, e
    assert e["ttft_mae"] <= TTFT_MAE, e


def test_preempting_runs_are_predicted_as_preempting(rows) -> None:  # type: ignore[no-untyped-def]
    for r in rows:
        assert (r.sim_preemptions > 0) == (r.real.preemptions > 0), r.name
        if r.real.preemptions:
            # The scheduler reproduces the count, not just the sign (within 15%).
            assert r.sim_preemptions == pytest.approx(r.real.preemptions, rel=0.15), r.name
