"""Simulator fidelity against the real vLLM 0.26.0 H200 runs in tests/fixtures/real_h200, held out.

``benchmarks/sim_fidelity.py --held-out N --out benchmarks/results/sim_heldout_h200.json`` fits
the step-time knobs per fold on the runs the fold leaves in (by model size: two sizes fit, the
third is tested; by flag: the eager / fp8 KV / small token budget runs are tested) and records each
fold's knobs. These tests simulate each fold's held-out runs again with that fold's knobs, so a
change to the scheduler or the step-time model that makes the simulator less faithful on runs it
was not fitted on fails here, and hold the errors to what was achieved when the knobs were fitted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _fidelity import FOLDS, error_summary, fidelity_rows, load_evidence, load_real_runs, load_study_runs
from servetune.planner.gpus import get_gpu
from servetune.sim import calibration_for

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "sim_heldout_h200.json"
HELD_OUT = json.loads(RESULTS.read_text())["folds"]
RUNS = load_evidence()


def test_fixtures_hold_every_healthy_window_with_its_preemption_counts() -> None:
    runs = {r.name: r for r in RUNS}
    # 9 windows of the 0.85B model, 17 of the 8B/14B models with a covering tokenizer, and the 10
    # trials of the real 8B grid study (study_l8b).
    assert len(runs) == 36 and "b5_fail_u0012" not in runs
    assert sum(name.startswith("study_l8b/") for name in runs) == 10
    assert {r.size for r in RUNS} == {"0.85B", "8B", "14B"}
    assert runs["a3_preempt_blocks4096_s128"].preemptions == 106
    assert runs["b3_preempt_blocks1024_s64"].preemptions == 192
    assert runs["scale/l8b_fv_u0185_s256_preempt/p1024_o256_c128"].preemptions == 71
    assert sum(r.preemptions for r in runs.values()) == 106 + 192 + 71 + (50 + 71 + 49)


def test_windows_measured_after_the_folds_are_in_no_fold_and_the_held_out_hosts_in_no_fit() -> None:
    """The starts measured after the folds were fitted (_fidelity.UNSEEN_STARTS: the decode-heavy 8B
    start of 2026-12-02 (*_dec), the four starts of 2026-12-02a, the two of 2026-12-02b, the four of 2026-12-03a,
    the six of 2026-12-03b, the two of 2026-12-03c, one of 2026-12-04a, the four 24B starts of 2026-12-04b and 2026-12-04c,
    the five profiled starts of 2026-12-04d and 2026-12-04e, the four of 2026-12-04f and 2026-12-04g, the six of
    2026-12-04h; 2026-12-02 to 2026-12-04, H200) are left out of load_evidence,
    which every fold reads, and loaded by load_unseen_runs with the unseen studies' trials: 5 + 15 +
    13 + 23 + 17 + 8 + 4 + 11 + 4 + 9 + 16 windows (the clean ones; profiled windows are no fidelity
    windows) + 11 trials, 8B and 14B but for the 24B ones, a size no fit has seen. The committed
    calibration's joint fit (load_calibration_runs) takes all of them but the held-out hosts' 23 +
    17 + 8 + 4 + 5 + 6 + 1 + 3 + 9 + 16 windows; of those, the 2026-12-03a host's 4 fp8 KV windows fit
    fp8_kv_read_efficiency alone, and the other 84 nothing fitted has seen."""
    from _fidelity import (FP8_FIT_STARTS, HELD_OUT_HOSTS, UNSEEN_STARTS, host_of, in_calibration_fit,
                           load_calibration_runs, load_unseen_runs)

    fitted = {r.name for r in RUNS}
    unseen = {r.name: r for r in load_unseen_runs()}
    assert len(unseen) == 136 and not fitted & set(unseen)
    assert {r.size for r in unseen.values()} == {"8B", "14B", "24B"}
    assert {r.size for r in RUNS} <= {"0.85B", "8B", "14B"}  # 24B: in no fit, no fold
    assert sum(r.size == "24B" for r in unseen.values()) == 21
    assert not any(name.endswith("_prof") for name in unseen)
    dec = [r for name, r in unseen.items() if name.startswith(f"scale/{UNSEEN_STARTS[0]}/")]
    assert len(dec) == 5 and all(r.shape == "decode" and r.size == "8B" for r in dec)
    assert not any(name.startswith(f"scale/{UNSEEN_STARTS[0]}/") for name in fitted)
    assert {r.name for r in load_real_runs(starts=UNSEEN_STARTS[:1])} == {r.name for r in dec}
    calibration = {r.name for r in load_calibration_runs()}
    held_out = {name for name in unseen if not in_calibration_fit(name)}
    assert {host_of(name) for name in held_out} == set(HELD_OUT_HOSTS)
    assert len(held_out) == 88 and not calibration & held_out
    # The 2026-12-03a host's fp8 start is fitted alone (fp8_kv_read_efficiency), not in the joint fit.
    fp8_fit = {name for name in unseen if any(name.startswith(f"scale/{s}/") for s in FP8_FIT_STARTS)}
    assert len(fp8_fit) == 4 and all(in_calibration_fit(name) and host_of(name) in HELD_OUT_HOSTS for name in fp8_fit)
    assert calibration == fitted | (set(unseen) - held_out - fp8_fit)


def test_the_hosts_api_cpu_factor_read_off_one_window_carries_to_its_other_windows() -> None:
    """servetune.sim.host_api_cpu_factor on one real window per host (the real API server's
    process_cpu_seconds_total over the simulated API server's CPU, committed calibration), then the
    host's other windows simulated with it (_fidelity.host_checks; `sim_fidelity.py --unseen`).
    Nothing is fitted to throughput and no judged window is the calibrating one.

    Only the held-out hosts (_fidelity.HELD_OUT_HOSTS: 2026-12-03a to 2026-12-04h, 2026-12-03 and -04, in no
    fit but the one start fp8_kv_read_efficiency was fitted on, _fidelity.FP8_FIT_STARTS) judge the
    rule, on their never-fitted windows. Under the 2026-12-04 calibration (kernel-measured GPU
    knobs, vLLM's output slices, the eager rule of that day's second change, whose launch floor
    scales with the factor too) the factor moves throughput little on the hosts without eager
    windows (2026-12-03a 1.9% to 2.0%, 2026-12-03b 4.6% to 4.3%, 2026-12-03c 1.6% to 1.7%, 2026-12-04a 1.6% to
    1.2%, 2026-12-04b 4.5% to 4.7%, 2026-12-04c 1.6%, 2026-12-04e 5.3% to 2.4%, 2026-12-04f 2.2% to 3.3%)
    and much on the two with them (2026-12-04g 10.2% to 5.9%, 2026-12-04h 8.3% to 5.1%):
    9.5 points gained over the ten. First tokens move both ways: 2026-12-04e
    22.6% to 10.3% and 2026-12-03b 10.6% to 7.4%, but 2026-12-04b 8.8% to 16.2% (its 24B decode
    windows' first tokens late at 32 and 128 in flight) and 2026-12-04g 4.2% to 7.9%;
    over the ten, TTFT gains 0.5 points. (Under the 2026-12-03 calibration,
    benchmarks/results/sim_calibration_2026_12_03_h200.json, it gained TTFT on most hosts: 28.5% to
    22.2% on 2026-12-04a.) The three earlier hosts' runs (2026-12-02: study_q14b, 2026-12-02a, 2026-12-02b) are in the calibration's
    fit, each at its factor, so their rows are a fit. What every host must still show: a factor of
    its own, the preemption verdict right, and no window far off; the bounds hold the measured worst
    with room (the study_q14b host's 256-in-flight decode window (*_dec), 8.4%; 2026-12-02a's, 5.6%; 2026-12-02b's
    8B decode at 128, 5.1%; 2026-12-03a's 8B decode at 2,048-token outputs, 5.4%; 2026-12-03b's fp8
    KV decode at 192 in flight, 41.3%: vLLM 0.26's fp8 path served that load 20% slower than bf16
    on the same host, where it was 1-6% faster at 32-128 in flight, and the simulator has no term
    for it; 2026-12-03c's 14B decode at 128, 3.8%; 2026-12-04a's 8B decode at 32, 2.9%;
    2026-12-04b's 24B decode at 128, 6.5%, and 2026-12-04c's prefill-heavy anchor workload,
    3.7%; 2026-12-04e's, 3.2%; 2026-12-04f's 8B shared-prefix window, 8.9% slow, and
    2026-12-04g's 24B shared-prefix window, 8.0% slow; 2026-12-04h's 8B eager decode at 128 in
    flight, 21.9% slow (see the targets test). The 2026-12-03c
    host's API server was the cheapest yet (factor 1.08, where the others read 1.19-1.72), so the
    factor's bound is only that it exceeds 1: no real host's API server has been cheaper than the
    simulator's calibration. So each host may lose a little (1.5 points of throughput, 8 of TTFT at
    most), over the held-out hosts throughput must gain, and on one host at least TTFT must gain
    much (2026-12-04e, whose anchor sets a factor of 1.40)."""
    from _fidelity import HELD_OUT_HOSTS, host_checks, in_calibration_fit

    worst_allowed = {"2026-12-02 H200, study_q14b": 0.10, "2026-12-02a": 0.08, "2026-12-02b": 0.08,
                     "2026-12-03a": 0.08, "2026-12-03b": 0.45, "2026-12-03c": 0.06,
                     "2026-12-04a": 0.05, "2026-12-04b": 0.09, "2026-12-04c": 0.06,
                     "2026-12-04e": 0.06, "2026-12-04f": 0.11,
                     "2026-12-04g": 0.10, "2026-12-04h": 0.25}
    checks = host_checks()
    assert [c.host for c in checks] == list(worst_allowed)
    assert set(HELD_OUT_HOSTS) == {"2026-12-03a", "2026-12-03b", "2026-12-03c", "2026-12-04a",
                                   "2026-12-04b", "2026-12-04c", "2026-12-04d",
                                   "2026-12-04e", "2026-12-04f", "2026-12-04g",
                                   "2026-12-04h"}
    ttft_gains, throughput_gains = [], []
    for check in checks:
        assert 1.0 < check.api_cpu_factor < 2.0, check.host
        assert all(r.real.name != check.calibrating_window for r in check.with_factor)
        plain, host = error_summary(check.plain), error_summary(check.with_factor)
        assert host["throughput_max"] < worst_allowed[check.host] and host["preemption_class_agree"] == 1.0, check.host
        if check.host in HELD_OUT_HOSTS:
            plain = error_summary([r for r in check.plain if not in_calibration_fit(r.name)])
            host = error_summary([r for r in check.with_factor if not in_calibration_fit(r.name)])
            assert host["throughput_mae"] < plain["throughput_mae"] + 0.015, check.host
            assert host["ttft_mae"] < plain["ttft_mae"] + 0.08, check.host
            ttft_gains.append(plain["ttft_mae"] - host["ttft_mae"])
            throughput_gains.append(plain["throughput_mae"] - host["throughput_mae"])
    assert max(ttft_gains) > 0.10  # the 2026-12-04e host: 22.6% to 10.3%
    assert sum(throughput_gains) > 0.05  # over the held-out hosts: 9.5 points


def test_the_committed_calibration_meets_the_targets_on_the_held_out_hosts() -> None:
    """The simulator's accuracy targets on the runs no fit has seen (the held-out hosts, each at its factor read
    off its anchor window, as a study's screen applies it, less the 2026-12-03a host's fp8 start that
    fp8_kv_read_efficiency was fitted on): mean output-throughput error <= 5% and TPOT <= 7% per
    load shape, TTFT <= 20%, the preemption verdict right on every run. Measured under the
    2026-12-04 calibration (its GPU kernels' knobs read off three GEMM probes and the traced steps
    of the 2026-12-04d to 2026-12-04g hosts, in other windows of the same starts; its CPU knobs
    fitted on the hosts of 2026-12-01 and 2026-12-02) on the bf16 KV starts: 2026-12-03a prefill-heavy 1.6%,
    TPOT 1.1%, TTFT 8.1%, decode-heavy 2.1%, 2.2%, 9.9%; 2026-12-03b decode 1.4%, 1.4%, 8.2%, and
    its one non-anchor prefill-heavy window (Poisson 12 req/s, 1024 in / 256 out) 0.1%, TPOT 14.3%
    (10.0 ms simulated against 8.7), TTFT 7.6%; 2026-12-03c (decode only
    besides its anchor) 1.7%, 1.3%, 14.8%; 2026-12-04a (outputs uniform in 512-1536 at 32 and
    128 in flight, a Poisson rate) 1.2%, 1.3%, TTFT 26.2%, the TTFT miss left (22.2% under the
    2026-12-03 calibration; the simulated first tokens late at 128 in flight, early at 32 and on
    the Poisson load). The 24B shape (Mistral-Small-24B, in no fit; its kernels traced on the
    2026-12-04d to 2026-12-04g hosts): 2026-12-04b decode-heavy 4.7%, 6.1%, TTFT
    16.2%; 2026-12-04c decode 1.9%, 1.8%, 5.9%, prefill-heavy 2.6%, 3.1%, 2.4% (under the
    2026-12-03 calibration 7.5%, 6.6%: the 24B prefill-heavy miss the kernels explained, GEMMs
    priced 14-16% fast); 2026-12-04e (two 8B anchors) 2.4%, 5.1%, 10.3%.
    2026-12-04f and 2026-12-04g (collected before either calibration of that day): 8B
    decode-heavy 0.7%, 3.5%, 12.7%, prefill-heavy 5.9%, 6.2%, TTFT 18.6% (its shared-prefix window,
    768 of 1,024 prompt tokens cached, 8.9% slow; 14.3% under the 2026-12-03 calibration); 24B
    decode-heavy (one window, uneven outputs at 192 in flight) 5.7%, 5.5%, 10.2%, prefill-heavy
    6.1%, 7.2%, 6.8%: the eager anchor 4.1% fast (19.9% under the eager rule before, the whole
    step's work hiding the launches, and a floor not scaled with the host's CPU) and the
    shared-prefix window 8.0% slow. 2026-12-04h (collected before that rule, in no
    fit): prefill-heavy (8B and 24B, eager and CUDA graphs, 4 to 256 in flight) 3.6%, 5.4%, 4.1%;
    decode-heavy 6.2%, 8.1%, 23.9%: its CUDA-graph windows within 5.5% but its eager decode ones
    slow, 8B at 128 in flight 21.9% and 24B 15.5% (the attention of short contexts hides the
    launches more than the rule lets it), and first tokens late on the eager loads at 16 and 64 in
    flight (+76%, +45%). Misses held with little room: those, 2026-12-03b's Poisson TPOT and
    2026-12-04a's TTFT.
    On the fp8 KV windows, judged with the knob fitted on the 2026-12-03a host's four: the 2026-12-03b host's
    nine, eight within 8%, the other one (decode at 192 in flight) 41.3% fast (vLLM's fp8 path ran that
    load 20% slower than bf16 on the same host); the 24B host's two (64 and 128 in flight) within
    1%; all eleven 5.6%, TPOT 4.4%. The bounds are the measured figures with room, so a change that
    makes them worse fails."""
    from _fidelity import HELD_OUT_HOSTS, host_checks, in_calibration_fit, scale_host

    checks = [c for c in host_checks() if c.host in HELD_OUT_HOSTS]
    # 2026-12-04d has no check: its one clean window is its factor's.
    assert [c.host for c in checks] == ["2026-12-03a", "2026-12-03b", "2026-12-03c", "2026-12-04a",
                                        "2026-12-04b", "2026-12-04c", "2026-12-04e",
                                        "2026-12-04f", "2026-12-04g", "2026-12-04h"]
    fp8_judged, judged = [], set()
    for check in checks:
        def rows(shape: str, fp8: bool) -> list:
            return [r for r in check.with_factor if r.real.shape == shape and not in_calibration_fit(r.name)
                    and (r.real.flags.get("kv_cache_dtype") == "fp8") is fp8]

        # TTFT: the target, but 2026-12-04a's and 2026-12-04h's decode windows
        # (the misses left, with room; see the docstring).
        decode_ttft_bound = {"2026-12-04a": 0.30, "2026-12-04h": 0.26}.get(check.host, 0.20)
        for shape, ttft_bound in (("prefill", 0.20), ("decode", decode_ttft_bound)):
            if not rows(shape, fp8=False):
                continue  # 2026-12-03c and 2026-12-04a measured only their anchor prefill-heavy (asserted below)
            judged.add((check.host, shape))
            e = error_summary(rows(shape, fp8=False))
            # Throughput and TPOT: the targets, but the misses left (see the docstring).
            throughput_bound, tpot_bound = {("2026-12-03b", "prefill"): (0.05, 0.16),
                                            ("2026-12-04f", "prefill"): (0.07, 0.08),
                                            ("2026-12-04g", "prefill"): (0.07, 0.08),
                                            ("2026-12-04g", "decode"): (0.07, 0.07),
                                            ("2026-12-04h", "decode"): (0.07, 0.09),
                                            }.get((check.host, shape), (0.05, 0.07))
            assert e["throughput_mae"] <= throughput_bound and e["tpot_mae"] <= tpot_bound, (check.host, shape, e)
            assert e["ttft_mae"] < ttft_bound and e["preemption_class_agree"] == 1.0, (check.host, shape, e)
        fp8_judged += rows("prefill", fp8=True) + rows("decode", fp8=True)
    assert judged == ({(h, shape) for h in HELD_OUT_HOSTS for shape in ("prefill", "decode")}
                      - {("2026-12-03c", "prefill"), ("2026-12-04a", "prefill"),
                         ("2026-12-04b", "prefill"), ("2026-12-04d", "prefill"), ("2026-12-04d", "decode"),
                         ("2026-12-04e", "decode")})
    assert len(fp8_judged) == 11 and all(scale_host(r.name) in ("2026-12-03b", "2026-12-04c") for r in fp8_judged)
    e = error_summary(fp8_judged)
    assert e["throughput_mae"] < 0.07 and e["tpot_mae"] < 0.06 and e["preemption_class_agree"] == 1.0, e
    assert sorted(abs(r.throughput_error) for r in fp8_judged)[-2] < 0.08


def test_a_size_no_fit_has_seen_ranks_its_two_flag_sets_as_vllm_did() -> None:
    """The H200 host 2026-12-04c served the 24B shape (Mistral-Small-24B, in no fit) on the anchor's
    workload (1024 in / 256 out, 512 requests at 256 in flight) under two flag sets: 0.9 x 256 x
    8192 at 2,378 tok/s and 0.9 x 128 x 2048 at 2,219 (7% less). The committed calibration, at the
    host's factor read off the second of them, ranks them the same way (2,467 against 2,219: the
    gap 11% where vLLM's was 7%; the 2026-12-03 calibration ran both fast, 2,648 against 2,351),
    and neither preempts in either."""
    from _fidelity import host_factor, load_unseen_runs

    unseen = {r.name: r for r in load_unseen_runs()}
    big = unseen["scale/2026-12-04c_m24b_u09_s256_mbt8192/p1024_o256_c256"]
    small = unseen["scale/2026-12-04c_m24b_u09_s128_mbt2048/p1024_o256_c256"]
    assert big.size == small.size == "24B" and big.output_throughput > 1.05 * small.output_throughput
    factor = host_factor("2026-12-04c", unseen)
    rows = fidelity_rows(None, [big, small], host_factors={"2026-12-04c": factor})
    assert rows[0].sim_output_throughput > 1.05 * rows[1].sim_output_throughput
    assert all(r.sim_preemptions == r.real.preemptions == 0 for r in rows)


def test_each_hosts_runs_are_simulated_at_that_hosts_factor_and_no_other() -> None:
    """fidelity_rows(host_factors=...) (what a fit over several hosts needs): a run of a host in
    _fidelity.UNSEEN_HOSTS is simulated at that host's API-server factor, a run of any other host
    at the calibration's, and the host's factor moves only the API server's CPU it is applied to."""
    from _fidelity import host_of, load_unseen_runs

    unseen = {r.name: r for r in load_unseen_runs()}
    fifth = unseen["scale/2026-12-02b_l8b_u09_s256_mbt8192/p256_o1024_c64"]
    fourth = unseen["scale/2026-12-02a_l8b_u09_s256_mbt8192/p256_o1024_c64"]
    fitted = RUNS[0]
    assert [host_of(r.name) for r in (fifth, fourth, fitted)] == ["2026-12-02b", "2026-12-02a", None]
    plain = fidelity_rows(None, [fifth, fourth, fitted], max_requests=64)
    hosted = fidelity_rows(None, [fifth, fourth, fitted], max_requests=64, host_factors={"2026-12-02b": 2.0})
    # Every API-server cost doubled, less what a loop that falls further behind saves by merging
    # tokens into fewer chunks (at most api_chunk_share of the per-token cost).
    share = calibration_for(get_gpu("H200")).api_chunk_share
    assert 2.0 * (1 - share) * plain[0].sim_api_server_cpu_s < hosted[0].sim_api_server_cpu_s
    assert hosted[0].sim_api_server_cpu_s <= 2.0 * plain[0].sim_api_server_cpu_s * (1 + 1e-9)
    assert hosted[0].sim_ttft_mean_ms > plain[0].sim_ttft_mean_ms  # its API server is the slower
    assert hosted[1:] == plain[1:]  # the other host's run and the fitted run: untouched


def test_short_tokenizer_windows_are_left_out_unless_asked_for() -> None:
    # The 2026-12-01 8B/14B starts carried a 32,000-token tokenizer (scale/tokenizers.json):
    # 21 windows no fit or fidelity figure may rest on, still loadable for a look.
    every = {r.name: r for r in load_real_runs(include_tokenizer_short=True)}
    short = {name for name, r in every.items() if "tokenizer_short" in r.tags}
    assert len(short) == 21 and not short & {r.name for r in RUNS}
    # Windows that re-sent an earlier window's prompts are simulated with that share cached.
    rate = every["scale/l8b_u09_s256_mbt8192/p256_o1024_c128"]
    assert rate.prefix_cache_hit_rate == pytest.approx(240 / 256, abs=0.002) and rate.workload.prefix_len == 240
    assert every["scale/l8b_u09_s256_mbt8192/p1024_o256_c128"].workload.prefix_len == 0


def test_every_fold_was_fitted_without_its_test_runs() -> None:
    assert set(HELD_OUT) == set(FOLDS)
    for name, fold in HELD_OUT.items():
        tested = {row["run"] for row in fold["rows"]}
        assert tested == {r.name for r in RUNS if FOLDS[name](r)}, name
        assert tested.isdisjoint(fold["fitted_on"]), name


@pytest.mark.parametrize("fold", sorted(FOLDS))
def test_held_out_errors_are_what_the_fit_achieved(fold: str) -> None:
    recorded = HELD_OUT[fold]
    test_runs = [r for r in RUNS if FOLDS[fold](r)]
    rows = fidelity_rows(recorded["knobs"], test_runs)
    e = error_summary(rows)
    # The simulator is deterministic: the same knobs give the recorded errors (a change to the
    # engine model that moves them must re-run the benchmark and say so in README).
    assert e["throughput_mae"] == pytest.approx(recorded["errors"]["throughput_mae"], abs=0.01), e
    assert e["tpot_mae"] == pytest.approx(recorded["errors"]["tpot_mae"], abs=0.01), e
    assert e["ttft_mae"] == pytest.approx(recorded["errors"]["ttft_mae"], abs=0.02), e


@pytest.mark.parametrize("fold", sorted(FOLDS))
def test_preemption_verdict_held_out(fold: str) -> None:
    rows = fidelity_rows(HELD_OUT[fold]["knobs"], [r for r in RUNS if FOLDS[fold](r)])
    for r in rows:
        assert (r.sim_preemptions > 0) == (r.real.preemptions > 0), r.name
        if r.real.preemptions:
            # The scheduler reproduces the count, not just the sign (within 15%): 70 against 71 and
            # 48/72/48 against 50/71/49 at 8B, 95 against 106 on a 0.85B num_gpu_blocks_override
            # run. The 0.85B fold's b3 (1,024 blocks, 64 sequences) missed it until 2026-12-04 (87
            # against 192): the API server as one FIFO paced its closed loop slower than the real
            # server's ran; the asyncio loop (sim/frontend.py) gives 200.
            assert r.sim_preemptions == pytest.approx(r.real.preemptions, rel=0.15), r.name


def test_the_8b_fold_on_the_real_grid_ranks_its_best_flag_set_first() -> None:
    """The real servetune grid (tests/fixtures/real_h200/study_l8b: util x max_num_seqs x
    max_num_batched_tokens at 8B) with the knobs of the fold fitted without any 8B run: the
    simulator calls the grid's best preemption-free flag set best (the accuracy target "best flag set of
    each grid ranked first"), and every trial's preemption verdict right, its count within 5%."""
    from sim_fidelity import grid_ranking

    rows = fidelity_rows(HELD_OUT["size 8B"]["knobs"], load_study_runs())
    assert len(rows) == 10
    assert grid_ranking(rows).endswith(": the same flag set")
    for r in rows:
        assert (r.sim_preemptions > 0) == (r.real.preemptions > 0), r.name
        assert abs(r.sim_preemptions - r.real.preemptions) <= 0.05 * r.real.preemptions, r.name


def test_each_fold_measures_the_api_servers_token_cost_on_its_own_training_windows() -> None:
    """token_overhead_s is read off the fitting windows' process_cpu_seconds_total, never searched
    against throughput (a fold whose training sizes never saturate the front end cannot see it),
    and never off the fold's test windows."""
    from _fidelity import api_token_cpu_s

    for name, fold in HELD_OUT.items():
        train = [r for r in RUNS if not FOLDS[name](r)]
        assert fold["knobs"]["token_overhead_s"] == pytest.approx(api_token_cpu_s(train), rel=1e-9), name
    # The API server's CPU per streamed token on all the H200 windows: tens of microseconds.
    assert 30e-6 < api_token_cpu_s(RUNS) < 90e-6


def test_the_committed_calibration_on_real_studies_measured_after_it_was_fitted() -> None:
    """The H200 calibration shipped in servetune.sim.perf on the 11 trials of the real studies
    measured after the folds were fitted (_fidelity.UNSEEN_STUDIES: the 8B grid's last cell, the
    confirmed 8B tune, all 8 cells of the 14B grid; `sim_fidelity.py --unseen`). Out of sample for
    the 2026-12-02 calibration, which got them within 2.8% (max 6.5%), TPOT 7.3%, TTFT 7.8%; in the
    fit of the 2026-12-03 one and of the 2026-12-04 one (so a fit, not a fidelity figure): 3.1%
    (max 5.1%), TPOT 2.8%, TTFT 14.5%, and 1.1% (max 2.6%), TPOT 3.4%, TTFT 4.7% (the tune's
    repeat's first tokens 39% early). What must hold whatever the fit: the preemption verdict
    right on every trial, both preempting 14B cells' counts exact (74, 49), both studies' best flag
    set ranked first. The bounds hold those figures with a little room."""
    from _fidelity import UNSEEN_STUDIES
    from sim_fidelity import grid_ranking

    rows = fidelity_rows(None, load_study_runs(studies=UNSEEN_STUDIES))
    assert len(rows) == 11 and not {r.real.name for r in rows} & {r.name for r in RUNS}
    e = error_summary(rows)
    assert e["throughput_mae"] < 0.035 and e["throughput_max"] < 0.07 and e["tpot_mae"] < 0.05
    assert e["ttft_mae"] < 0.17 and e["preemption_class_agree"] == 1.0
    for r in rows:
        assert abs(r.sim_preemptions - r.real.preemptions) <= 0.05 * r.real.preemptions, r.real.name
    for folder in ("study_l8b_tune", "study_q14b"):
        group = [r for r in rows if r.real.name.startswith(folder + "/")]
        assert grid_ranking(group).endswith(": the same flag set"), folder


def test_the_load_generators_measured_cpu_per_chunk_bounds_the_client_stage() -> None:
    """The simulated load generator reads each SSE chunk in ``client_chunk_s`` times the host's
    factor (sim/frontend.py). That knob was chosen on the fitting windows' latency (60 us; 40 us
    scored within 1% of it), before any window measured the client. The 24B windows of 2026-12-04b
    and 2026-12-04c did (collect.py's ``client_cpu_s``: the collecting process, every thread, the gauge
    sampler's /metrics reads too): over each window's chunks and at its host's factor, 0.62-0.92
    of the knob; with the later hosts' 24B windows (to 2026-12-04h), 0.61-0.98, the top
    one the 2026-12-04h host's eager prefill-heavy window. So the knob sits at the top of what the
    client spends: a client stage that cost more than it, or under half of it, would contradict
    the one direct measurement."""
    import gzip

    from _fidelity import FIXTURES, UNSEEN_HOSTS, host_factor, host_of, load_unseen_runs

    unseen = {r.name: r for r in load_unseen_runs()}
    knob = calibration_for(get_gpu("H200")).client_chunk_s
    hosts = ("2026-12-04b", "2026-12-04c", "2026-12-04d", "2026-12-04g",
             "2026-12-04h")
    assert set(UNSEEN_HOSTS) >= set(hosts)
    factors = {host: host_factor(host, unseen) for host in hosts}  # one anchor simulation per host
    ratios = []
    for name, run in unseen.items():
        if run.size != "24B":
            continue
        folder = FIXTURES / name
        summary = json.loads((folder / "summary.json").read_text())
        requests = json.loads(gzip.decompress((folder / "requests.json.gz").read_bytes()))
        chunks = sum(len(r["itl_s"]) + 1 for r in requests)
        ratios.append(summary["client_cpu_s"] / chunks / factors[host_of(name)] / knob)
    assert len(ratios) == 21
    assert 0.5 < min(ratios) and max(ratios) < 1.0, sorted(round(r, 2) for r in ratios)


def test_a_candidate_calibration_file_that_is_not_one_is_refused_in_one_line(tmp_path, capsys) -> None:
    """`sim_fidelity.py --unseen --knobs FILE` judges a candidate calibration (the one
    benchmarks/results/sim_kernel_candidate_h200.json records); a file without a 'knobs' mapping of
    numbers is refused with exit 2 and one line naming the file, before anything is simulated."""
    from sim_fidelity import main

    bad = tmp_path / "knobs.json"
    bad.write_text(json.dumps({"knobs": {"compute_efficiency": "fast"}}))
    assert main(["--unseen", "--knobs", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and "'knobs' mapping of numbers" in err
    # A knob the simulator has no such name for, or cannot run with, is named the same way.
    for knobs, field in (({"compute_eficiency": 0.8}, "calibration.compute_eficiency"),
                         ({"gemm_token_tile": 4.5}, "calibration.gemm_token_tile")):
        bad.write_text(json.dumps({"knobs": knobs}))
        assert main(["--unseen", "--knobs", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(bad) in err and field in err, err
    bad.write_text(json.dumps({"knobs": {"compute_efficiency": "fast"}}))
    # An option its mode would ignore is refused too, before anything runs.
    assert main(["--knobs", str(bad)]) == 2 and capsys.readouterr().err.strip() == "--knobs works with --unseen only: add --unseen"
    assert main(["--kernels"]) == 2 and capsys.readouterr().err.strip() == "--kernels works with --fit N only: add --fit N"
    assert main(["--start", str(bad)]) == 2 and capsys.readouterr().err.strip() == "--start works with --fit N only: add --fit N"
    # A fit's second start is read by the same rule, before the first trial.
    assert main(["--fit", "1", "--start", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"--start {bad}:") and "'knobs' mapping of numbers" in err
    recorded = json.loads((RESULTS.parent / "sim_kernel_candidate_h200.json").read_text())
    assert all(isinstance(v, float) for v in recorded["knobs"].values())
    assert recorded["knobs"]["gemm_blend_exponent"] > 0  # the kernel-measured GEMM model, not the committed roofline


def test_the_real_windows_reports_print_json_when_asked_and_the_h100_report_refuses_it(capsys) -> None:
    """`--h200-classes --json` (and `--h100-classes`, `--hybrid`) printed the text table whatever `--json`
    said; the JSON holds every window, the errors over them and each start's, as the table does."""
    from sim_fidelity import main

    assert main(["--h200-classes", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    starts = {row["run"].split("/")[0] for row in doc["rows"]}
    assert len(doc["rows"]) == 9 and set(doc["by_start"]) == starts and len(starts) == 3
    assert doc["errors"]["runs"] == 9 and all(e["runs"] == 3 for e in doc["by_start"].values())
    assert main(["--h100", "--json"]) == 2
    assert capsys.readouterr().err.strip() == "--json does not go with --h100 (a text report): leave --json out"
