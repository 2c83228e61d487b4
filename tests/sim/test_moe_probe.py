"""The simulator's routed-expert price against vLLM's fused-MoE kernel timed on an H100 SXM
(``tests/fixtures/real_h100/kernels/moe_probe_h100.json``, ``benchmarks/moe_vs_sim.py``)."""

from __future__ import annotations

import dataclasses
import json

import moe_vs_sim
import pytest

from servetune.sim import perf_classes

PROBE = json.loads(moe_vs_sim.PROBE.read_text())


def test_the_unaligned_down_share_is_the_probes_derivation() -> None:
    """MOE_UNALIGNED_DOWN_SHARE is read off the probe, not chosen: the code's figures are the derivation's."""
    derived = moe_vs_sim.derive_unaligned(PROBE)
    assert perf_classes.MOE_UNALIGNED_DOWN_SHARE == {"v0.11_default": derived["v0.11_default"],
                                                     "by_batch": derived["vllm"]}


def test_the_probe_timed_every_shape_the_benchmark_prices_with_the_host_it_names() -> None:
    shapes = {row["shape"] for row in PROBE["rows"]}
    assert shapes == set(moe_vs_sim.SHAPES)
    assert "H100 80GB HBM3" in PROBE["gpu"] and PROBE["vllm"] == "0.26.0"
    assert all(row["us"] and row["us"] > 0 and row["error"] is None for row in PROBE["rows"])


@pytest.mark.parametrize("mode", ["vllm", "v0.11_default"])
def test_the_unaligned_expert_width_is_what_slows_gpt_oss_at_tp8(mode: str) -> None:
    """K = 360 (not a multiple of 16) at TP=8 against K = 720 at TP=4: half the FLOPs took longer at
    4,096+ tokens, on the probe; the simulator's TP=8 layer is priced within 25% there, which it was
    not without the rule (the down GEMM at the aligned rate: 1.7-2.6x fast)."""
    rows = {(r["shape"], r["tokens"]): r["us"] for r in PROBE["rows"] if r["mode"] == mode}
    for tokens in (4096, 8192):
        assert rows[("gpt-oss-120b_tp8", tokens)] > 0.75 * rows[("gpt-oss-120b_tp4", tokens)]
    compared, _ = moe_vs_sim.compare(PROBE)
    big = [r for r in compared if r["shape"] == "gpt-oss-120b_tp8" and r["mode"] == mode and r["tokens"] >= 4096]
    assert big and all(0.8 <= r["ratio"] <= 1.25 for r in big)
    perf = moe_vs_sim._perf("gpt-oss-120b_tp8", mode)
    moe = perf.moe_shape
    assert moe is not None and moe.inter == 360
    aligned = dataclasses.replace(moe, inter=368)
    assert perf_classes.moe_down_share(aligned, perf._version) == 1.0
    assert perf_classes.moe_down_share(moe, perf._version) < 0.5


def test_held_out_shapes_are_mostly_within_15_percent_at_prefill_sizes() -> None:
    """Every shape but the fit one is evidence: at 2,048-8,192 tokens the bf16 and block-fp8 layers the
    simulator prices are within 15% on most rows (per-tensor fp8 under 0.11's default tile is the known miss)."""
    compared, left = moe_vs_sim.compare(PROBE)
    held = [r for r in compared if r["split"] == "held_out" and r["tokens"] >= 2048
            and r["shape"] != "qwen3-30b-a3b_tp1_fp8"]
    within = sum(abs(r["ratio"] - 1.0) <= 0.15 for r in held)
    assert len(held) >= 30 and within / len(held) >= 0.75
    assert left["unknown shape"] == 0 and left["tuned file not priced"] > 0
