"""The simulator on the real H100 MoE and FP8 windows (tests/fixtures/real_h100_classes, 2026-12-05).

The fused-MoE floor (``Calibration.moe_layer_floor_s``) is the only constant fitted on them, on the
FP8 MoE start (``_fidelity.MOE_FLOOR_FIT_START``); the two bf16 MoE starts and the dense FP8 starts
judge the simulator (``benchmarks/sim_fidelity.py --h100-classes``; docs/model-classes.md). A change
that moves these figures is to update the figures and the page together.

The second set of that host (the fixtures' README), in no fit: a Mixtral-8x7B shape cut to 16 layers
(bf16 and FP8 weights) and the gemma-2-27b shape (bf16 and fp8 KV cache), nine windows.
"""

from __future__ import annotations

import pytest
from _fidelity import H100_CLASSES_FIXTURES, H100_GPU, MOE_FLOOR_FIT_START, fidelity_rows, fit_moe_floor, load_h100_runs

from servetune.planner.gpus import get_gpu
from servetune.sim import Calibration


@pytest.fixture(scope="module")
def rows():
    return {r.name: r for r in fidelity_rows(None, load_h100_runs(H100_CLASSES_FIXTURES), gpu=H100_GPU)}


def test_the_floor_is_its_fit_on_the_fit_start_alone() -> None:
    assert fit_moe_floor() == pytest.approx(Calibration().moe_layer_floor_s, rel=0.01)


def test_the_held_out_moe_windows(rows) -> None:
    judged = {n: r for n, r in rows.items() if "q3moe" in n and not n.startswith(MOE_FLOOR_FIT_START)}
    assert len(judged) == 8
    errors = sorted(abs(r.throughput_error) for r in judged.values())
    # Measured: 7 of 8 within 10% (mean 6.0%; 5.6% before vLLM 0.26's tiles, moe_tile), +16.2% for
    # the 4-client decode; the one-client window -5.1% (+34.7% before the floor). At 8acadf3 -5.0, -2.3, -4.4,
    # -2.2, +7.6, -4.2, +1.1, +16.5% (7 of 8, mean 5.4%); since 16-bit experts stream at the kernel's timed
    # rate (_moe_tiles.MOE_BY_BATCH_STREAM, 2026-12-07) -4.9, +2.5, +0.7, +1.9, +12.8 (the Poisson window,
    # TPOT -13.9% -> -18.3%), +1.9, +6.4, +12.0% (4 clients): 6 of 8 within 10%, all within 13%, mean 5.4%.
    assert sum(e <= 0.10 for e in errors) >= 6 and errors[-1] < 0.15, errors
    one_client = rows["2026-12-05_q3moe_u09_s256_mbt8192/p256_o256_c1"]
    assert abs(one_client.tpot_error) < 0.10


def test_the_fp8_8b_windows_are_priced_at_fp8(rows) -> None:
    # Online --quantization fp8 reaches the step model (planner.model_memory.effective_model):
    # throughput +3.9% to +9.8% on the five windows (-9% to -34% when the flag was not read).
    fp8 = [r for n, r in rows.items() if n.startswith("2026-12-05_l8b_fp8_")]
    assert len(fp8) == 5
    assert all(abs(r.throughput_error) < 0.11 for r in fp8), [round(r.throughput_error, 3) for r in fp8]


def test_the_gemma2_windows_held_out(rows) -> None:
    """gemma-2-27b (sliding window 4,096 on every other layer, logit soft-capping): within 10% on
    throughput where vLLM did not preempt (-4.8%, -7.9%, fp8 KV -7.1%), TPOT within 10%.

    At 64 clients of 1,024-token prompts vLLM preempted 17 times. Its hybrid KV manager gives each
    KV group (global, sliding) its own blocks of the one pool, and a 1,280-token request never
    leaves the 4,096-token window, so it holds two blocks per 16 tokens (sim.blocks.KVGroups): the
    simulator preempts 20 times and reads -5.9% throughput, TTFT +0.3%, TPOT +11.3% (before the
    rule: one block per 16 tokens, no preemption, +18.9% and TTFT -50.7%).

    Two more preempting windows, 2026-12-07 (the gemma-2 tune's host, ``plan_2026_12_07_g2_h100.json``,
    judged as they came, nothing changed on seeing them): vLLM's defaults (0.9, 512 sequences), which the
    tune's simulator screen pruned, 34 preemptions real against 40 simulated, throughput -5.5%, TTFT -1.1%,
    TPOT +10.8%; the tune's second informed start (0.95, 54) run whole, 15 against 18, -6.0%, -3.1%, +11.3%.
    """
    g2 = [r for n, r in rows.items() if "_g2_" in n]
    assert len(g2) == 6
    preempting = [r for r in g2 if r.real.preemptions > 0]
    assert sorted(r.real.preemptions for r in preempting) == [15, 17, 34]
    for r in preempting:
        assert abs(r.sim_preemptions / r.real.preemptions - 1) < 0.25, (r.name, r.sim_preemptions)
        assert abs(r.throughput_error) < 0.10 and abs(r.ttft_error) < 0.10, (r.name, r.throughput_error, r.ttft_error)
        assert abs(r.tpot_error) < 0.15, (r.name, r.tpot_error)
    for r in (r for r in g2 if r not in preempting):
        assert r.real.preemptions == r.sim_preemptions == 0
        assert abs(r.throughput_error) < 0.10 and abs(r.tpot_error) < 0.10, (r.name, r.throughput_error, r.tpot_error)


def test_the_mixtral_windows_held_out(rows) -> None:
    """Mixtral-8x7B cut to 16 layers (8 experts of 14,336, top-2). Since 16-bit experts on Hopper stream at the
    fused-MoE kernel's rate timed on an H100 (_moe_tiles.MOE_BY_BATCH_STREAM, 2026-12-07; read off four other
    shapes' kernel rows, never these windows): one client -2.4% (TPOT +3.2%), bf16 -11.0% at 256 clients (TPOT
    +16.4%) and -9.7% at 64 (TPOT +7.3%); at 8acadf3, before it, -6.1% (+7.3%), -12.8% (+20.0%) and -16.6%
    (+16.8%). FP8 (the dense rate kept) +14.9% and +5.7% at both. The figures when first judged follow.
    One client: -6.3% (TPOT +7.5%).
    Batched, priced at vLLM 0.26's default fused-MoE tiles (perf_classes.moe_tile: 128 x 128 above
    512 tokens, 32 x 64 at 64) by the dense tile model (perf.moe_tile_share): bf16 -11.2% at 256
    clients and -14.3% at 64 (-42.0% and -28.5% at 0.11's 64 x 64 tile, TPOT +18% and +17%, from +72%
    and +38%); FP8 (vLLM shipped a tuned config, priced as the default) +18.3% and +11.1% (from
    -17.8% and -5.7%). With the Triton/Hopper share at 0.25 and padding from the mean row count (the
    rule before perf_classes.moe_row_fill): bf16 -16.5% and -15.8%, FP8 +12.5% and +9.2%."""
    mx = {n: r for n, r in rows.items() if "_mx16_" in n}
    assert len(mx) == 5 and all(r.real.preemptions == r.sim_preemptions == 0 for r in mx.values())
    one = rows["2026-12-05_mx16_u09_s256_mbt8192/p256_o256_c1"]
    assert abs(one.throughput_error) < 0.10 and abs(one.tpot_error) < 0.10
    bf16 = [r for n, r in mx.items() if n.startswith("2026-12-05_mx16_u09_") and r is not one]
    assert all(-0.15 < r.throughput_error < -0.05 and 0.0 < r.tpot_error < 0.20 for r in bf16), \
        [(r.name, r.throughput_error, r.tpot_error) for r in bf16]
    fp8 = [r for n, r in mx.items() if n.startswith("2026-12-05_mx16_fp8_")]
    assert all(0.05 < r.throughput_error < 0.20 for r in fp8), [(r.name, r.throughput_error) for r in fp8]


# -- the third set (2026-12-06), judged before anything was read off it ------------------------------

def _third(rows, start: str) -> dict:
    return {n.split("/")[1]: r for n, r in rows.items() if n.startswith(f"2026-12-06_{start}_")}


def test_the_gemma3_windows_held_out(rows) -> None:
    """gemma-3-27b's text model (5 sliding-window layers of 1,024 tokens to each global one): the
    hybrid KV groups as for gemma-2 (``sim/blocks.py`` ``KVGroups``). Measured: throughput +0.3% (64
    clients of 1,024-token prompts, 4 preemptions simulated where vLLM counted 4), +1.8%, -1.8%."""
    g3 = _third(rows, "g3t")
    assert len(g3) == 3
    assert all(abs(r.throughput_error) < 0.05 for r in g3.values()), {w: r.throughput_error for w, r in g3.items()}
    busy = g3["p1024_o256_c64"]
    assert busy.real.preemptions > 0 and busy.sim_preemptions > 0


def test_the_deepseek_v2_lite_windows_held_out(rows) -> None:
    """MLA + 64 experts top-6 (FlashAttention-3 MLA, Triton experts). Measured: -13.2% at 256 clients,
    +14.5% at one client, and -60.8% at 64 clients of 1,024-token outputs (TPOT 13.7 ms simulated
    against 5.25 real); -11.5%, +14.6% and -58.5% (TPOT +147%, from +162%) since 16-bit experts stream
    at the kernel's timed rate (_moe_tiles.MOE_BY_BATCH_STREAM, 2026-12-07). That real TPOT is below what
    reading every routed expert of the 26 MoE layers once a step
    takes at the H100's 3.35 TB/s (uniform routing of 64 x 6 picks touches ~64 of 64
    experts a layer): with vLLM's random weights (``--load-format dummy``) the router sends the batch
    to fewer experts than a trained model's would, so this window cannot judge the MoE decode."""
    ds = _third(rows, "dsv2")
    assert len(ds) == 3
    assert abs(ds["p1024_o256_c256"].throughput_error) < 0.15 and abs(ds["p256_o256_c1"].throughput_error) < 0.15
    decode = ds["p256_o1024_c64"]
    experts_bytes = 26 * 64 * 3 * 2048 * 1408 * 2
    assert decode.real.tpot_mean_ms / 1e3 < experts_bytes / (get_gpu(H100_GPU).hbm_gbps * 1e9)
    assert decode.throughput_error < -0.4


def test_the_awq_windows_held_out(rows) -> None:
    """AWQ 4-bit 8B through vLLM 0.26's Machete kernel on the H100. Measured: -11.0% at 256 clients,
    +22.6% at 64 and +49.7% at one client: the simulator reads the 4-bit weights at the GPU's
    bandwidth, where Machete's small-batch tiles take 4.07 ms a token at one client (a bf16 8B takes
    ~6.5); the open miss for AWQ on Hopper."""
    awq = _third(rows, "awq8")
    assert len(awq) == 3
    assert abs(awq["p1024_o256_c256"].throughput_error) < 0.15
    assert awq["p256_o256_c1"].throughput_error > 0.3
