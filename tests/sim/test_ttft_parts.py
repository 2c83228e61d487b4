"""benchmarks/ttft_parts.py: the simulated mean TTFT of a published run, split into the API server's
intake, the engine queue, the prefill and the stream, adds up to the simulated mean TTFT and leaves
the simulation's figures as they are."""

from __future__ import annotations

import published_runs
import pytest
import ttft_parts
from servetune.sim import engine as sim_engine
from servetune.sim.scheduler import SimScheduler

RUNS = {r.id: r for r in published_runs.load_runs()}


@pytest.mark.parametrize("run_id", ["l4-qwen2.5-0.5b-tp1-rand256x128-c4",
                                    "h100-gpt-oss-120b-bf16-tp8-rand1024x128-c100"])
def test_the_parts_add_up_to_the_simulated_mean_ttft(run_id: str) -> None:
    row = ttft_parts.ttft_parts(RUNS[run_id])
    total = sum(row[p] for p in ttft_parts.PARTS)
    assert row["ttft_sim"] is not None and total == pytest.approx(row["ttft_sim"], rel=1e-3)
    assert all(row[p] >= 0.0 for p in ttft_parts.PARTS) and row["chunks"] >= 1.0
    assert row["ttft_sim"] == pytest.approx(published_runs.judge(RUNS[run_id]).sim_ttft_ms, rel=1e-9)
    assert sim_engine.SimScheduler is SimScheduler  # the recording scheduler is not left behind



def test_a_burst_waits_in_the_engine_and_its_first_use_stall_is_counted() -> None:
    row = ttft_parts.ttft_parts(RUNS["h100-gpt-oss-120b-bf16-tp8-rand1024x128-c100"])
    # 100 prompts of 1,024 tokens at an 8,192-token budget: most wait several steps for the budget,
    # and the fused-MoE kernel's first-use compiles (sim.moe_jit) land before most first tokens
    assert row["queue"] > row["prefill"] > 0.0
    assert row["stall"] > 300.0
