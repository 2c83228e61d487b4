"""Real vLLM 0.26.0 on one H100 SXM (tests/fixtures/real_h100, 2026-12-05): the planner and the simulator.

Llama-3.1-8B shape, five server starts, 16 measured windows (the fixtures' README). The planner was
never fitted on them. The simulator's one H100 knob (``servetune.sim.GPU_FAMILY_OVERRIDES``:
``kv_read_efficiency``) was fitted on the starts of ``_fidelity.H100_FIT_STARTS`` (8 windows) and is
judged on the other 8 (``H100_JUDGED_STARTS``); every other knob is the H200's. The figures here
state the errors before that knob (the H200's value) and after, on each half apart
(``benchmarks/sim_fidelity.py --h100``, docs/evidence-h100.md): a change that moves them is to
update the figures and the page together.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from _fidelity import (H100_CALIBRATING, H100_FIT_STARTS, H100_FIXTURES, H100_GPU, H100_JUDGED_STARTS, HOST_MODELS,
                       FidelityRow, HostCheck, error_summary, fidelity_rows, h100_check, h100_hbm_read_share,
                       h200_knobs_on, in_h100_fit, load_h100_runs, serving_flags)
from _fidelity import _weighted_loss

from servetune.engines.vllm.logs import classify, parse_log
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.sim import GPU_CALIBRATION, GPU_FAMILY_OVERRIDES, Calibration, calibration_for

STARTS = sorted(p.parent.name for p in H100_FIXTURES.glob("*/server.log.gz"))
HOST = H100_FIXTURES / "2026-12-05_h100_host"


def _start(name: str) -> tuple[dict, str]:
    d = H100_FIXTURES / name
    return json.loads((d / "summary.json").read_text()), gzip.decompress((d / "server.log.gz").read_bytes()).decode()


@pytest.fixture(scope="module")
def check() -> HostCheck:
    """Every window with the H100's own knob (the committed calibration)."""
    return h100_check()


@pytest.fixture(scope="module")
def before() -> HostCheck:
    """Every window with the H200's value of each knob the H100 replaces: the H100 before its fit."""
    return h100_check(calibration=h200_knobs_on(H100_GPU))


def test_the_h100_evidence_is_all_there() -> None:
    assert STARTS == ["2026-12-05_l8b_u09_s256_eager", "2026-12-05_l8b_u09_s256_mbt2048",
                      "2026-12-05_l8b_u09_s256_mbt8192", "2026-12-05_l8b_u09_s256_mbt8192_b",
                      "2026-12-05_l8b_u09_s64_mbt8192"]
    windows = sorted(H100_FIXTURES.glob("*/*/summary.json"))
    assert len(windows) == 16 and len(load_h100_runs()) == 16
    for w in windows:
        s = json.loads(w.read_text())
        assert s["completed"] == s["workload"]["num_requests"] and not s.get("error"), w
        # No requests.json.gz: the per-request dumps were read by no test or benchmark and left the
        # tree on 2026-12-06 (the README says how to get them back from the history).
        assert {f.name for f in w.parent.iterdir()} == {"summary.json", "gauges.json",
                                                        "metrics_before.txt.gz", "metrics_after.txt.gz"}, w
    # Every window its own seed: no two windows sent the same prompts.
    seeds = [json.loads(w.read_text())["workload"]["seed"] for w in windows]
    assert len(set(seeds)) == len(seeds)
    size = sum(f.stat().st_size for f in H100_FIXTURES.rglob("*") if f.is_file())
    assert size < 15 << 20, size


def test_the_gpu_is_the_h100_sxm_the_table_names() -> None:
    text = (HOST / "host_gpu.txt").read_text()
    assert "NVIDIA H100 80GB HBM3" in text  # the SXM5 part (PCIe and NVL name themselves otherwise)
    torch_mib = int(re.search(r"total_memory=(\d+)MB", text).group(1))
    # The planner's total is torch's, which every KV figure below starts from.
    assert get_gpu(H100_GPU).memory_gib == pytest.approx(torch_mib / 1024, abs=0.02)


@pytest.mark.parametrize("name", STARTS)
def test_logs_parse_and_classify_as_served(name: str) -> None:
    summary, text = _start(name)
    parsed = parse_log(text)
    assert parsed.vllm_version == "0.26.0" and parsed.server_ready
    assert parsed.enforce_eager is bool(summary["flags"].get("enforce_eager", False))
    assert classify(text).status.value == "ok"


@pytest.mark.parametrize("name", STARTS)
def test_planner_kv_capacity_on_the_h100(name: str) -> None:
    # Held out: the planner was never fitted on an H100. Measured: +0.13% to +0.15% (cold and warm
    # kernel caches), -0.04% at a 2,048-token budget; the bound is twice the largest.
    summary, text = _start(name)
    logged = parse_log(text).kv_cache_tokens
    model, gpu = load_model(HOST_MODELS[summary["model"]]), get_gpu(H100_GPU)
    config = resolve_engine_config(serving_flags(summary["flags"]), model, gpu)
    plan = plan_memory(model, gpu, config, compile_cache_warm=bool(parse_log(text).compile_cache_hit))
    assert plan.fits
    assert plan.kv_cache_tokens == pytest.approx(logged, rel=0.003), (plan.kv_cache_tokens, logged)


def test_no_window_preempted_or_reused_cached_prompts() -> None:
    for run in load_h100_runs():
        assert run.preemptions == 0 and run.prefix_cache_hit_rate < 0.005, run.name


def _summary(rows: list[FidelityRow]) -> dict[str, float]:
    return {k: round(100 * v, 1) for k, v in error_summary(rows).items() if k != "runs"}


def test_the_simulator_before_the_h100s_own_knob(before: HostCheck) -> None:
    e = _summary(before.plain)
    # 2026-12-05, 16 windows, the H200's knobs at API-server factor 1: output throughput 7.0% (bias
    # -1.5%, max 24.6%: eager decode at 128 in flight), TTFT 13.6% (14.0% before the batch after an idle
    # engine's first one was drained after that one was scheduled, 2026-12-06, sim/_timeline.py), TPOT 9.4% (9.5%).
    assert e["throughput_mae"] == pytest.approx(7.0, abs=1.5), e
    assert e["throughput_bias"] == pytest.approx(-1.5, abs=1.5), e
    assert e["ttft_mae"] == pytest.approx(13.6, abs=2.0), e
    assert e["tpot_mae"] == pytest.approx(9.4, abs=1.5), e
    graphs = [r for r in before.plain if not r.real.flags.get("enforce_eager")]
    # With CUDA graphs every window was within 11% and none simulated faster than it ran.
    assert max(abs(r.throughput_error) for r in graphs) < 0.11
    assert all(r.throughput_error < 0.005 for r in graphs)
    # The other 15 windows at the factor read off the first: throughput 6.8% (bias -6.8%, max 18.3%),
    # TTFT 15.3% (17.8% before that rule), TPOT 9.1%.
    e = _summary(before.with_factor)
    assert e["throughput_mae"] == pytest.approx(6.8, abs=1.5), e
    assert e["ttft_mae"] == pytest.approx(15.3, abs=2.0), e
    assert e["tpot_mae"] == pytest.approx(9.1, abs=1.5), e


def test_the_split_was_fixed_before_the_fit() -> None:
    # Whole starts, at most half of the windows fitted, every eager window judged; each half has
    # prefill-heavy and decode-heavy loads.
    assert sorted(H100_FIT_STARTS + H100_JUDGED_STARTS) == STARTS
    runs = load_h100_runs()
    fitted = [r for r in runs if in_h100_fit(r.name)]
    judged = [r for r in runs if not in_h100_fit(r.name)]
    assert len(fitted) == len(judged) == 8
    assert not any(r.flags.get("enforce_eager") for r in fitted)
    for half in (fitted, judged):
        assert {r.shape for r in half} == {"prefill", "decode"}, [(r.name, r.shape) for r in half]
    assert H100_CALIBRATING.split("/")[0] in H100_FIT_STARTS  # the factor is read off fitting data


def _fit_loss(value: float) -> float:
    rows = fidelity_rows({"kv_read_efficiency": value}, [r for r in load_h100_runs() if in_h100_fit(r.name)],
                         gpu=H100_GPU)
    return _weighted_loss(rows, ttft_weight=0.0)


def test_the_h100s_kv_read_is_its_fit_capped_by_its_hbm_probe() -> None:
    # fit_h100_kv_read (sim_fidelity.py --fit-h100) ended at its ceiling, the host's read-only HBM
    # probe (3,010 of 3,350 GB/s): the committed value is that ceiling, and the fitting windows'
    # loss still falls towards it (unbounded, the fit went to 0.94).
    value = GPU_FAMILY_OVERRIDES[H100_GPU]["kv_read_efficiency"]
    assert value == pytest.approx(h100_hbm_read_share(), abs=0.001)
    assert _fit_loss(value) < _fit_loss(value - 0.03) < _fit_loss(calibration_for(get_gpu("H200")).kv_read_efficiency)


def test_the_override_replaces_only_its_knob_on_the_h100_only() -> None:
    h200 = calibration_for(get_gpu("H200"))
    # The H200's calibration is its fitted row, as before any family override existed.
    assert h200 == Calibration().with_overrides(GPU_CALIBRATION["H200"])
    h100 = calibration_for(get_gpu(H100_GPU))
    assert h100 == h200.with_overrides(GPU_FAMILY_OVERRIDES[H100_GPU]) != h200
    # Parts the H100 windows did not measure (PCIe's HBM2e, NVL, H800) keep the H200's knobs.
    for name in ("H100-PCIe", "H100-NVL", "H800"):
        assert calibration_for(get_gpu(name)) == h200, name


def test_the_held_out_half_before_and_after_the_h100s_knob(before: HostCheck, check: HostCheck) -> None:
    b1, a1 = ([r for r in c.plain if not in_h100_fit(r.name)] for c in (before, check))
    bf, af = ([r for r in c.with_factor if not in_h100_fit(r.name)] for c in (before, check))
    assert len(b1) == len(a1) == len(bf) == len(af) == 8
    # 8 held-out windows at factor 1, before -> after: throughput 10.5% -> 8.6%, TTFT 9.2% -> 8.8%,
    # TPOT 11.9% -> 9.2%. Before an idle GPU's first step paid its whole engine CPU under async scheduling
    # (Calibration.idle_step_cpu, 2026-12-07; the one-request window's TTFT -10.9% -> +2.0%): throughput
    # 10.4% -> 8.6%, TTFT 10.2% -> 9.8%; before the batch after an idle engine's first one was drained after
    # that one was scheduled, 2026-12-06, sim/_timeline.py: TTFT 9.6% -> 9.2%, TPOT 12.0% -> 9.2%.
    eb, ea = _summary(b1), _summary(a1)
    assert (eb["throughput_mae"], eb["ttft_mae"], eb["tpot_mae"]) == pytest.approx((10.5, 9.2, 11.9), abs=0.3), eb
    assert (ea["throughput_mae"], ea["ttft_mae"], ea["tpot_mae"]) == pytest.approx((8.6, 8.8, 9.2), abs=0.3), ea
    assert ea["throughput_mae"] < eb["throughput_mae"] and ea["tpot_mae"] < eb["tpot_mae"]
    # At the factor read off the first (fitting) window: throughput 8.9% -> 6.9%, TPOT 12.1% -> 9.4%;
    # TTFT 15.4% -> 16.1% (worse: the faster GPU step leaves the API server the bottleneck sooner; before
    # the idle GPU's first step paid its whole CPU, 14.6% -> 15.4%; before the drain rule TPOT 12.1% ->
    # 9.2%, TTFT 17.0% -> 18.3%).
    assert check.calibrating_window == H100_CALIBRATING
    assert before.api_cpu_factor == pytest.approx(1.55, abs=0.05)  # the H200 hosts read 1.36-1.72
    assert check.api_cpu_factor == pytest.approx(1.55, abs=0.05)
    eb, ea = _summary(bf), _summary(af)
    assert (eb["throughput_mae"], eb["ttft_mae"], eb["tpot_mae"]) == pytest.approx((8.9, 15.4, 12.1), abs=0.3), eb
    assert (ea["throughput_mae"], ea["ttft_mae"], ea["tpot_mae"]) == pytest.approx((6.9, 16.1, 9.4), abs=0.3), ea
    assert ea["throughput_mae"] < eb["throughput_mae"] and ea["tpot_mae"] < eb["tpot_mae"]
    # The CUDA-graph windows carry the gain (throughput within 5% at factor 1); the eager ones follow
    # the host's CPU, not this knob (decode at 128 in flight +24.6% -> +28.6%).
    graphs = [r for r in a1 if not r.real.flags.get("enforce_eager")]
    assert max(abs(r.throughput_error) for r in graphs) < 0.05


def test_the_fitting_half_is_fitting_data(check: HostCheck) -> None:
    # Not evidence: the knob was fitted on these 8 windows. Factor 1: throughput 1.6% (was 3.6%),
    # TTFT 16.8% (16.2%), TPOT 3.2% (7.0%); the knob refitted after an idle GPU's first step paid its whole
    # engine CPU (2026-12-07) is unchanged, 0.8981; before that rule TTFT 17.8% (17.1%); before the batch
    # after an idle engine's first one was drained after that one was scheduled (2026-12-06): TTFT 19.0%
    # (18.4%), TPOT 3.3% (7.1%).
    e = _summary([r for r in check.plain if in_h100_fit(r.name)])
    assert (e["throughput_mae"], e["ttft_mae"], e["tpot_mae"]) == pytest.approx((1.6, 16.8, 3.2), abs=0.3), e


def test_small_batch_decode_is_the_datasheet_bandwidth(check: HostCheck) -> None:
    # 1-16 sequences, CUDA graphs: the step streams the weights, so TPOT is the HBM rate. The H100
    # row's 3,350 GB/s with the H200's fitted efficiency gives 6.62-7.33 ms against 6.50-7.19 real.
    small = [r for r in check.plain if r.real.workload.concurrency in (1, 4, 16) and not r.real.flags.get("enforce_eager")]
    assert len(small) == 3
    assert all(0.0 < r.tpot_error < 0.03 for r in small), [(r.name, r.tpot_error) for r in small]


def _probe(path: Path) -> dict[tuple[str, int], float]:
    return {(g["gemm"], g["m"]): g["seconds"] for g in json.loads(path.read_text())["gemms"] if g["model"] == "llama-3.1-8b"}


def test_the_h100_gemms_scale_as_the_table_says() -> None:
    # The same cuBLAS probe (CUDA-graph replay, L2-cold weights) on the H100 and on an H200.
    h100 = _probe(HOST / "gemm_probe_graph_h100.json")
    h200 = _probe(H100_FIXTURES.parent / "real_h200" / "gemm" / "gemm_probe_graph_h200.json")
    bandwidth = get_gpu("H200").hbm_gbps / get_gpu(H100_GPU).hbm_gbps  # 1.43
    peak = get_gpu("H200").bf16_tflops / get_gpu(H100_GPU).bf16_tflops  # 1.0
    # Weight-streaming (the 8B MLP's two large GEMMs at 1-64 tokens): slower by the bandwidth ratio.
    streaming = [h100[k] / h200[k] for k in h100 if k[0] in ("gate_up", "down") and k[1] <= 64]
    assert sum(streaming) / len(streaming) == pytest.approx(bandwidth, rel=0.05)
    # Compute-bound (1,024 and 2,048 tokens): the same rate, as the table's equal dense peaks say.
    compute = [h100[k] / h200[k] for k in h100 if k[1] >= 1024]
    assert sum(compute) / len(compute) == pytest.approx(peak, rel=0.05)
