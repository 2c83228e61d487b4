"""The simulator on the real H200 MoE and MXFP4 windows (tests/fixtures/real_h200_classes, 2026-12-05).

In no fit: the Qwen3-30B-A3B shape at bf16 and online FP8, and gpt-oss-20b (MXFP4 experts on vLLM's
Triton backend, FlashAttention 3 with sinks), three windows each, on the GPU whose dense calibration
is the simulator's own. Measured when they arrived (``benchmarks/sim_fidelity.py --h200-classes``):

- bf16 MoE: +4.5% (256 clients of 1,024-token prompts), -8.6% (64 clients, 1,024-token outputs),
  -13.4% (one client);
- FP8 MoE: +19.2%, **-43.2%**, -5.5%; gpt-oss-20b: -10.2%, **-46.7%**, +4.9%.

The two misses are the quantized models' decode at 64 clients: real TPOT 6.4 ms (FP8) and 6.0 ms
(MXFP4), where reading every expert's weights once a step at the H200's 4.8 TB/s takes about 6.0 and
2.2 ms; the simulator prices 11.6 and 15.1 ms. A change that moves these figures is to update the
figures and docs/model-classes.md together.
"""

from __future__ import annotations

import pytest
from _fidelity import H200_CLASSES_FIXTURES, fidelity_rows, load_h100_runs


@pytest.fixture(scope="module")
def rows():
    return {r.name: r for r in fidelity_rows(None, load_h100_runs(H200_CLASSES_FIXTURES), gpu="H200")}


def test_every_window_is_judged(rows) -> None:
    assert len(rows) == 9
    assert all(r.real.preemptions == r.sim_preemptions == 0 for r in rows.values())


def test_the_bf16_moe_windows_held_out(rows) -> None:
    bf16 = {n: r for n, r in rows.items() if n.startswith("2026-12-05_q3moe_u09_")}
    assert len(bf16) == 3
    assert all(abs(r.throughput_error) < 0.15 for r in bf16.values()), \
        [(n, round(r.throughput_error, 3)) for n, r in bf16.items()]


def test_one_client_and_prefill_bound_windows_of_the_quantized_models(rows) -> None:
    for start in ("2026-12-05_q3moe_fp8_u09_s256_mbt8192_h200", "2026-12-05_gptoss20_u09_s256_mbt8192_h200"):
        one = rows[f"{start}/p256_o256_c1"]
        assert abs(one.throughput_error) < 0.10 and abs(one.tpot_error) < 0.10, (start, one.tpot_error)
        assert -0.15 < rows[f"{start}/p1024_o256_c256"].throughput_error < 0.25


def test_the_quantized_decode_at_64_clients_is_the_open_miss(rows) -> None:
    """Both simulated 35-55% slow: the simulator's FP8 and MXFP4 expert GEMMs at 64 rows read far less
    than the H200's bandwidth allows (see the module docstring)."""
    for start in ("2026-12-05_q3moe_fp8_u09_s256_mbt8192_h200", "2026-12-05_gptoss20_u09_s256_mbt8192_h200"):
        r = rows[f"{start}/p256_o1024_c64"]
        assert -0.55 < r.throughput_error < -0.35 and r.tpot_error > 0.5, (start, r.throughput_error, r.tpot_error)
