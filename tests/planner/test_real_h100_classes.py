"""Real vLLM 0.26.0 on one H100 SXM (2026-12-05): the planner on an MoE shape and FP8 starts it never saw.

``tests/fixtures/real_h100_classes`` (its README): a Qwen3-30B-A3B shape (bf16 at two flag sets, FP8
weights, and a start that vLLM refused at ``gpu_memory_utilization`` 0.74) and the Llama-3.1-8B
shape with FP8 weights and with an FP8 KV cache. No planner constant was fitted on them. What they
showed the planner: vLLM 0.26 starts MoE models on the V1 model runner, which takes its CUDA-graph
estimate off the KV budget (``vllm_rules.runs_v2_runner``). Before that rule the three served MoE
starts were planned +4.05% (256 sequences), +0.41% (64 sequences) and +1.24% (FP8) against vLLM's
KV tokens, and the refused start was foreseen for the wrong reason (a KV pool too small for one
sequence, where vLLM found no memory for KV at all).

The same host's second set (README, "Second set"): a Mixtral-8x7B shape cut to 16 layers (bf16 and
online FP8 weights) and servetune's gemma-2-27b (a sliding-window / global hybrid, bf16 and fp8 KV
cache, and a start vLLM refused at ``gpu_memory_utilization`` 0.7), judged before any planner change:
KV tokens -0.61% (Mixtral bf16), -0.10% (FP8), -0.13% (gemma-2), +0.04% (fp8 KV); the refused start
foreseen with vLLM's reason and needed 2.88 GiB, but with "the estimated maximum model length is 8192"
(the length that failed) where vLLM said 7280: the estimate counted one KV group's blocks. Now
``KVLayout.longest_fitting_len``, vLLM's binary search over every group: 7488.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _fidelity import HOST_MODELS
from _real_starts import evidence_at_a_glance, plan_start, read_start

from servetune.engines.vllm.logs import classify, parse_log
from servetune.planner.model_memory import WARMUP_SHORTFALL_GIB, sampler_warmup_bytes
from servetune.planner.modelinfo import load_model
from servetune.result import TrialStatus

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real_h100_classes"
STARTS = sorted(p.parent.name for p in FIXTURES.glob("2026-*/server.log.gz"))
#: 2026-12-06 (README, "Fourth set"): starts only, no load, vLLM's default 1,024 sequences without prefix
#: caching, at utilizations near the sampler warm-up's edge; two died there.
WARMUP_FAILED = ("2026-12-06_gptoss20_u0985_nopc_default", "2026-12-06_gptoss20_u098_nopc_default",
                 "2026-12-06_q3moe_u099_nopc_default")
FOURTH_SET = sorted(p.parent.name for p in FIXTURES.glob("2026-12-06_*_nopc_default*/server.log.gz"))
#: The two starts of the third machine (``plan_2026_12_06_warmup_h100_b.json``), predicted from the band
#: read off the other six before they ran.
BAND_HELD_OUT = ("2026-12-06_gptoss20_u097_nopc_default_cold", "2026-12-06_q3moe_u099_nopc_default")
#: The band's top (``WARMUP_SHORTFALL_GIB[1]``, the warning's threshold) is read off the first machine's three
#: gpt-oss-20b starts only (``2026-12-06_h100_host_b``), under half of the eight; the other five judge it.
BAND_FIT = ("2026-12-06_gptoss20_u095_nopc_default", "2026-12-06_gptoss20_u0985_nopc_default",
            "2026-12-06_gptoss20_u097_nopc_default")
BAND_JUDGED = [s for s in FOURTH_SET if s not in BAND_FIT]
#: 2026-12-06 (README, "Fifth set"): Mamba2 / gated-delta-net hybrids, planned from vLLM's source before
#: any of them ran; the two Nemotron-H starts at vLLM's default 1,024 sequences were predicted in
#: ``plan_2026_12_06_hybrid_h100.json`` before they ran.
HYBRID = sorted(s for s in STARTS if any(f"_{m}_" in s for m in ("ghtiny", "nemh8b", "q3next12", "q3next12tri", "q35moe20tri")))
MAMBA_BLOCKS_REFUSED = "2026-12-06_nemh8b_u042_default"
#: Healthy and sized, then its first prefill died: the GDN kernel vLLM 0.26 calls at prefill imports
#: FlashInfer, which the GPU host's vLLM lacks (README, "Fifth set"); its window is not evidence.
LOAD_CRASHED = "2026-12-06_q3next12_u09_s256_mbt8192"
#: Served with prefix caching, vLLM's Mamba cache mode 'all': read before the planner's rule for that mode was
#: written (tests/planner/test_hybrid_prefix_caching.py checks it there), so not among the held-out starts here.
HYBRID_PREFIX_CACHING = "2026-12-06_ghtiny_pc_u09_s256_mbt8192"
REFUSED = ("2026-12-05_q3moe_u074_s256_mbt8192", "2026-12-05_g2_u07_s128_mbt8192", *WARMUP_FAILED,
           MAMBA_BLOCKS_REFUSED)
SERVED = [s for s in STARTS if s not in REFUSED and s != HYBRID_PREFIX_CACHING]
SECOND_SET = [s for s in SERVED if "_mx16_" in s or "_g2_" in s]
#: 2026-12-06 (README, "Third set"): gemma-3-27b's text model (5 sliding : 1 global), DeepSeek-V2-Lite
#: (MLA + MoE) and an AWQ Llama-3.1-8B, judged before anything was read off them.
THIRD_SET = [s for s in SERVED if s.startswith("2026-12-06_") and s not in FOURTH_SET and s not in HYBRID]
AWQ_START = "2026-12-06_awq8_u09_s256_mbt8192"


def _start(name: str) -> tuple[dict, str]:
    return read_start(FIXTURES / name)


def _plan(summary: dict, text: str):
    return plan_start(summary, text, "H100-80GB")


def test_the_evidence_is_all_there() -> None:
    assert STARTS == ["2026-12-05_g2_kvfp8_u09_s128_mbt8192", "2026-12-05_g2_u07_s128_mbt8192",
                      "2026-12-05_g2_u09_s128_mbt8192", "2026-12-05_l8b_fp8_u09_s256_mbt8192",
                      "2026-12-05_l8b_kvfp8_u09_s256_mbt8192", "2026-12-05_mx16_fp8_u09_s256_mbt8192",
                      "2026-12-05_mx16_u09_s256_mbt8192", "2026-12-05_q3moe_fp8_u09_s256_mbt8192",
                      "2026-12-05_q3moe_u074_s256_mbt8192", "2026-12-05_q3moe_u09_s256_mbt8192",
                      "2026-12-05_q3moe_u09_s64_mbt2048", "2026-12-06_awq8_u09_s256_mbt8192",
                      "2026-12-06_dsv2_u095_default", "2026-12-06_dsv2_u09_s256_mbt8192",
                      "2026-12-06_g3t_u09_s256_mbt8192", "2026-12-06_ghtiny_pc_u09_s256_mbt8192",
                      "2026-12-06_ghtiny_u09_s256_mbt8192", "2026-12-06_gptoss20_u095_nopc_default",
                      "2026-12-06_gptoss20_u097_nopc_default", "2026-12-06_gptoss20_u097_nopc_default_cold",
                      "2026-12-06_gptoss20_u0985_nopc_default", "2026-12-06_gptoss20_u098_nopc_default",
                      "2026-12-06_nemh8b_u042_default", "2026-12-06_nemh8b_u045_default",
                      "2026-12-06_nemh8b_u09_s256_mbt8192", "2026-12-06_q3moe_u0985_nopc_default",
                      "2026-12-06_q3moe_u098_nopc_default", "2026-12-06_q3moe_u099_nopc_default",
                      "2026-12-06_q3next12_u09_s256_mbt8192", "2026-12-07_g2_u095_s54", "2026-12-07_g2_u09_s512",
                      "2026-12-07_mx16_prof_u09_s256_mbt8192", "2026-12-07_q35moe20tri_lmo_u09_default",
                      "2026-12-07_q35moe20tri_prof_small_u09_default", "2026-12-07_q35moe20tri_prof_u09_default",
                      "2026-12-07_q3moe_fp8_prof_u09_s256_mbt8192", "2026-12-07_q3moe_prof_b_u09_s256_mbt8192",
                      "2026-12-07_q3moe_prof_c_u09_s256_mbt8192",
                      "2026-12-07_q3moe_prof_u09_s256_mbt8192", "2026-12-07_q3next12tri_u09_s256_mbt8192"]
    windows, not_whole, size = evidence_at_a_glance(FIXTURES)
    assert windows == 50  # 38 measured, 12 profiled (2026-12-07_*_prof: steps, not pace; tests/sim/test_steps_moe.py)
    assert not_whole == []
    assert size < 22 << 20, size


@pytest.mark.parametrize("name", STARTS)
def test_each_start_logs_which_model_runner_vllm_chose(name: str) -> None:
    summary, text = _start(name)
    config, _ = _plan(summary, text)
    v1_logged = "gpu_model_runner.py" in text and "Estimated CUDA graph memory" in text
    v2_logged = "[model_runner.py:" in text and "Estimated CUDA graph memory" not in text
    assert v1_logged != v2_logged
    # The planner's rule: on 0.26 an MoE model (Qwen3MoeForCausalLM, MixtralForCausalLM) runs the V1
    # runner, a dense one (gemma-2's hybrid attention included) the V2.
    assert config.v1_runner is v1_logged
    assert config.rules.subtracts_cudagraph_estimate is v1_logged


@pytest.mark.parametrize("name", SERVED)
def test_planner_kv_capacity_held_out(name: str) -> None:
    # Measured: MoE bf16 +0.81% (256 sequences) and +2.06% (64 sequences, 2,048-token budget),
    # MoE FP8 +0.24%, 8B FP8 weights +0.23%, 8B FP8 KV cache +0.19%; the second set, held out likewise:
    # Mixtral-16L bf16 -0.61%, FP8 -0.10%, gemma-2 bf16 KV -0.13%, fp8 KV +0.04%; the third set:
    # gemma-3 text +0.68%, DeepSeek-V2-Lite +0.41% (256 sequences) and -1.07% (1,024 at 0.95), AWQ 8B
    # +0.28% (+0.16% under the Machete rule read off it); the fourth set: gpt-oss-20b -1.87% (0.95) and
    # -1.82% (0.97: the planner's graph term, 1.69 GiB, over vLLM's profiled estimate, 0.58), the Qwen3
    # shape +0.94% (0.985) and +0.96% (0.98); the fifth set (hybrids, from vLLM's source alone):
    # granite-4.0-h-tiny +0.13%, Nemotron-H-8B -0.50% (256 sequences) and -1.07% (1,024 at 0.45), the
    # Qwen3-Next shape -0.20%. The bound is 3%.
    summary, text = _start(name)
    parsed = parse_log(text)
    verdict = classify(text)
    if name == LOAD_CRASHED:  # served, sized its KV cache, then died under load (the host's vLLM lacks FlashInfer)
        assert verdict.status is TrialStatus.CRASHED and "No module named 'flashinfer'" in verdict.cause
    else:
        assert verdict.status.value == "ok"
    assert parsed.server_ready
    _, plan = _plan(summary, text)
    assert plan.fits
    assert plan.kv_cache_tokens == pytest.approx(parsed.kv_cache_tokens, rel=0.03), (plan.kv_cache_tokens,
                                                                                    parsed.kv_cache_tokens)


@pytest.mark.parametrize("name", [s for s in SERVED if s != AWQ_START])
def test_weights_as_vllm_loaded_them(name: str) -> None:
    # bf16 56.88 GiB (MoE) and 15.04 (8B); online FP8: 29.06 (MoE, experts and attention in fp8)
    # and 8.54 (8B); Mixtral-16L 43.75 (bf16) and 22.15 (FP8), gemma-2 50.72, gemma-3 text 50.74,
    # DeepSeek-V2-Lite 29.34: the planner within 0.6%.
    summary, text = _start(name)
    _, plan = _plan(summary, text)
    assert plan.memory.weights == pytest.approx(parse_log(text).weights_gib, rel=0.006)


def test_awq_weights_on_hopper_count_machetes_float_zero_points() -> None:
    """The AWQ 8B shape: vLLM 0.26 serves AWQ on an H100 through Machete ("Using MacheteLinearKernel
    for AutoAWQMarlinLinearMethod"), whose ``process_weights_after_loading`` turns the packed 4-bit
    zero points into ``-zero x scale`` in the activation dtype (``kernels/linear/mixed_precision/
    machete.py``, ``transform_w_zp``): 2 bytes a group where the checkpoint has half a byte. Judged
    before the rule: 5.37 GiB planned against 5.49 logged (-2.3%), KV +0.28%; with
    ``VllmMemoryRules.machete_float_zero_points`` (made after reading this start): 5.44 (-0.9%),
    KV +0.16%. On an A100 (Marlin, packed zero points) and before 0.26 nothing changes."""
    summary, text = _start(AWQ_START)
    assert "Using MacheteLinearKernel for AutoAWQMarlinLinearMethod" in text
    _, plan = _plan(summary, text)
    logged = parse_log(text).weights_gib
    linear = 32 * (4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336)  # quantized weights of the 8B shape
    zero_points_as_fp16 = linear / 128 * (2 - 0.5) / 2**30
    assert plan.memory.weights == pytest.approx(logged, rel=0.01)
    _, before = plan_start(summary, text, "H100-80GB", "0.25.0")
    _, ampere = plan_start(summary, text, "A100-80GB")
    assert plan.memory.weights - before.memory.weights == pytest.approx(zero_points_as_fp16, rel=0.02)
    assert ampere.memory.weights == pytest.approx(before.memory.weights, rel=1e-6)


def test_the_refused_moe_start_is_foreseen_with_vllms_reason() -> None:
    summary, text = _start("2026-12-05_q3moe_u074_s256_mbt8192")
    assert classify(text).status.value == "startup_oom"
    assert "No available memory for the cache blocks" in text
    _, plan = _plan(summary, text)
    assert not plan.fits and plan.failure is TrialStatus.STARTUP_OOM
    assert "No available memory for the cache blocks" in plan.cause


@pytest.mark.parametrize("name", SECOND_SET)
def test_activation_and_graph_terms_of_the_second_set(name: str) -> None:
    """The profile run's peak and the CUDA-graph term against the log, term by term (held out).

    Activation: Mixtral-16L 1.65 GiB planned against 1.77 (bf16) and 1.91 (FP8: the online-FP8
    experts profile 0.14 GiB more, which the planner does not count), gemma-2 2.37 against 2.34.
    Graphs: on the V1 runner (Mixtral) vLLM takes its *estimate* off the KV budget, 0.31 / 0.24 GiB,
    where the planner's graph term (scaled by hidden size only) says 0.59: an over-count that costs
    the plan 0.3 GiB of KV, within the KV band above; on the V2 runner (gemma-2) nothing is taken
    off, and the pool vLLM captured (0.51 / 0.50 GiB) is above the planner's 0.32.
    """
    summary, text = _start(name)
    parsed = parse_log(text)
    config, plan = _plan(summary, text)
    assert parsed.activation_peak_gib is not None
    assert plan.memory.activation_peak == pytest.approx(parsed.activation_peak_gib, rel=0.15)
    if config.v1_runner:
        assert parsed.cudagraph_estimate_gib is not None and plan.memory.cudagraph > parsed.cudagraph_estimate_gib
    else:
        assert parsed.cudagraph_estimate_gib is None and parsed.graph_capture_gib is not None
        assert plan.memory.cudagraph < parsed.graph_capture_gib


def test_the_refused_gemma2_start_is_foreseen_with_vllms_reason_and_a_length_that_fits() -> None:
    """gemma-2-27b at gpu_memory_utilization 0.7: 50.72 GiB of weights leave 2.56 GiB for KV, one
    8,192-token request needs 2.88 (global and sliding layers alike, as the window plus a
    max_num_batched_tokens chunk covers the whole length). vLLM's own estimate: 7,280 tokens."""
    summary, text = _start("2026-12-05_g2_u07_s128_mbt8192")
    parsed = parse_log(text)
    assert classify(text).status is TrialStatus.KV_TOO_SMALL
    assert parsed.kv_needed_gib == 2.88 and parsed.estimated_max_model_len == 7280
    config, plan = _plan(summary, text)
    assert not plan.fits and plan.failure is TrialStatus.KV_TOO_SMALL
    assert "(2.88 GiB KV cache is needed" in plan.cause
    # Before KVLayout.longest_fitting_len the plan said 8192, the length that failed; now 7488
    # (+2.9%: the plan leaves 2.63 GiB for KV, vLLM 2.56).
    estimated = plan.estimated_max_model_len
    assert estimated is not None and estimated < config.max_model_len
    assert f"the estimated maximum model length is {estimated}." in plan.cause
    assert estimated == pytest.approx(parsed.estimated_max_model_len, rel=0.04)
    assert f"lower max_model_len to <= {estimated}" in plan.fix


def _probes(text: str) -> dict[str, dict]:
    """The allocator probe's last line of each tag (``benchmarks/real_vllm/alloc_probe``)."""
    lines = [json.loads(line.split("ST_PROBE ", 1)[1]) for line in text.splitlines() if "ST_PROBE {" in line]
    return {p["tag"]: p for p in lines}


@pytest.mark.parametrize("name", FOURTH_SET)
def test_the_fourth_sets_verdicts_and_warm_up_warnings(name: str) -> None:
    """The planner's verdict and warning on each start near the sampler warm-up's edge.

    gpt-oss-20b (201,088-token vocabulary, graphs to 1,024) served at 0.95 and 0.97 (warm and cold compile
    cache) and died in the warm-up at 0.98 (cold) and 0.985 (warm); the Qwen3-30B-A3B shape served at 0.98
    and 0.985 and died at 0.99 (cold). Before any of them ran the planner called all eight fits; the 0.98
    pair and the Qwen3 0.985 start were predicted under a 0.98 GiB reserve read off the first three
    (``benchmarks/real_vllm/plan_2026_12_06_warmup_h100.json``) and two of the three predictions were wrong,
    so the measured shortfall is a warning band, not a verdict: every start that died is warned, and the
    one served start whose margin is inside the band (the Qwen3 shape at 0.985) is warned, not refused.
    """
    summary, text = _start(name)
    _, plan = _plan(summary, text)
    died = name in WARMUP_FAILED
    assert (classify(text).status is TrialStatus.CUDAGRAPH_OOM) is died
    if died:
        assert "CUDA out of memory occurred when warming up sampler with 1024 dummy requests" in text
    assert plan.fits and plan.warmup_margin is not None
    warned = [n for n in plan.notes if n.startswith("sampler warm-up after CUDA-graph capture")]
    assert bool(warned) is (plan.warmup_margin < WARMUP_SHORTFALL_GIB[1])
    if died:
        assert warned and "dummy requests" in warned[0]


def test_the_warm_up_shortfall_band_is_what_the_probe_measured() -> None:
    """``WARMUP_SHORTFALL_GIB`` recomputed from the fixtures: the planner's free memory at the warm-up less what
    the allocator probe read (``torch.cuda.mem_get_info`` just before ``_dummy_sampler_run``). Its top is the
    most of the three it was read off (1.89, gpt-oss-20b on a cold compile cache; 0.98 twice warm); its bottom
    the least over all eight (a description, used by no rule)."""
    fitted = [_shortfall(*_start(name)) for name in BAND_FIT]
    everything = fitted + [_shortfall(*_start(name)) for name in BAND_JUDGED]
    assert [round(f, 2) for f in fitted] == [1.89, 0.98, 0.98]
    assert (round(min(everything), 2), round(max(fitted), 2)) == WARMUP_SHORTFALL_GIB


def test_the_band_top_judged_on_the_five_it_was_not_read_off() -> None:
    """Held out, the five starts of the second and third machines: none lacked more than the top (Qwen3 shape
    0.54, 0.41, 0.52; gpt-oss-20b cold 1.88 twice), every death among them is warned (margins 1.17 and 0.37)
    and the served ones are fits (two warned, margins 0.77 and 1.17; one not, 1.96). The three fitted
    starts' bottom, 0.98, is undercut by three of the five, so no margin is called a failure on it."""
    shortfalls, warned = {}, {}
    for name in BAND_JUDGED:
        summary, text = _start(name)
        _, plan = _plan(summary, text)
        shortfalls[name] = round(_shortfall(summary, text), 2)
        warned[name] = (plan.fits, plan.warmup_at_risk, round(plan.warmup_margin, 2))
    assert shortfalls == {"2026-12-06_gptoss20_u097_nopc_default_cold": 1.88, "2026-12-06_gptoss20_u098_nopc_default": 1.88,
                          "2026-12-06_q3moe_u0985_nopc_default": 0.54, "2026-12-06_q3moe_u098_nopc_default": 0.41,
                          "2026-12-06_q3moe_u099_nopc_default": 0.52}
    assert max(shortfalls.values()) <= WARMUP_SHORTFALL_GIB[1]
    assert sum(v < 0.98 for v in shortfalls.values()) == 3
    assert warned == {"2026-12-06_gptoss20_u097_nopc_default_cold": (True, False, 1.96),
                      "2026-12-06_gptoss20_u098_nopc_default": (True, True, 1.17),
                      "2026-12-06_q3moe_u0985_nopc_default": (True, True, 0.77),
                      "2026-12-06_q3moe_u098_nopc_default": (True, True, 1.17),
                      "2026-12-06_q3moe_u099_nopc_default": (True, True, 0.37)}
    assert {n for n in BAND_JUDGED if n in WARMUP_FAILED} == {"2026-12-06_gptoss20_u098_nopc_default",
                                                             "2026-12-06_q3moe_u099_nopc_default"}


def _need_gib(summary: dict, config) -> float:
    """The sampler warm-up's need in GiB, as the planner counts it."""
    return sampler_warmup_bytes(load_model(HOST_MODELS[summary["model"]]), config)[1] / 2**30


def _shortfall(summary: dict, text: str) -> float:
    """GiB the planner's free memory at the warm-up exceeds what the probe read just before it."""
    config, plan = _plan(summary, text)
    return plan.warmup_margin + _need_gib(summary, config) - _probes(text)["sampler_before"]["free"] / 2**30


@pytest.mark.parametrize("name", FOURTH_SET)
def test_the_warm_up_needs_what_the_planner_counts(name: str) -> None:
    """The sampler's tensors: the reserved memory the warm-up added where it finished (2.30 GiB on the cold
    gpt-oss start, which reused two freed 503 MiB blocks; 2.69 warm; the Qwen3 shape 2.03) against the
    planner's 2.78 and 2.10 GiB; where it died, it asked for its 786 MiB logits with less than that free."""
    summary, text = _start(name)
    probes = _probes(text)
    config, _ = _plan(summary, text)
    need = _need_gib(summary, config)
    if "sampler_after" in probes and probes["sampler_after"]["t"] > probes["capture_after"]["t"]:
        grew = (probes["sampler_after"]["reserved"] - probes["sampler_before"]["reserved"]) / 2**30
        assert grew <= need * 1.01 and grew >= need * 0.8, (grew, need)
    else:
        logits_fp32 = config.max_num_seqs * load_model(HOST_MODELS[summary["model"]]).vocab_size * 4
        assert probes["sampler_failed"]["free"] < logits_fp32  # 786 MiB (gpt-oss-20b), 594 MiB (Qwen3)


@pytest.mark.parametrize("name", BAND_HELD_OUT)
def test_the_band_held_out_on_a_third_machine(name: str) -> None:
    """Predicted from the band before they ran (``plan_2026_12_06_warmup_h100_b.json``): gpt-oss-20b at 0.97
    on a cold compile cache, the utilization the warning names for 0.98 and 0.985, serves (shortfall 1.88
    GiB, inside the band); the Qwen3 shape at 0.99, a margin of 0.37 GiB (under the band's bottom), dies in
    the warm-up (shortfall 0.52). Both as predicted, both shortfalls inside the band."""
    summary, text = _start(name)
    plan_b = json.loads((FIXTURES.parents[2] / "benchmarks" / "real_vllm" / "plan_2026_12_06_warmup_h100_b.json").read_text())
    predicted = {r["name"].removesuffix("_h100"): r["predict"] for r in plan_b["runs"]}
    assert classify(text).status.value == predicted[name]
    low, high = WARMUP_SHORTFALL_GIB
    shortfall = _shortfall(summary, text)
    assert low <= shortfall <= high, shortfall


@pytest.mark.parametrize("name", [s for s in HYBRID if s in SERVED])
def test_the_hybrids_attention_block_is_the_one_vllm_set(name: str) -> None:
    """vLLM raises a hybrid's attention block until one attention page holds a Mamba state and logs it
    ("Setting attention block size to N tokens"): granite-4.0-h-tiny 400, Nemotron-H-8B 1,040 (fp32 SSM
    state), the Qwen3-Next shape 544 (gated delta net); the planner's block is the logged one."""
    summary, text = _start(name)
    config, plan = _plan(summary, text)
    logged = re.search(r"Setting attention block size to (\d+) tokens", text)
    expected = 544 if "_q3next12" in name else int(logged.group(1))  # the GDN model logs nothing when 544 fits
    assert config.block_size == expected
    assert plan.fits and plan.num_gpu_blocks > config.max_num_seqs


def test_the_mamba_cache_block_refusal_is_foreseen_with_vllms_reason() -> None:
    """Nemotron-H-8B at 0.42 with vLLM's default 1,024 sequences on an H100: every decode sequence needs
    one Mamba block, and 973 are left (vLLM); the planner, before the start ran, 961, and the same
    ValueError. At 0.45 (1,110 planned, served) the same model started."""
    summary, text = _start(MAMBA_BLOCKS_REFUSED)
    assert classify(text).status is TrialStatus.KV_TOO_SMALL
    logged = re.search(r"exceeds available Mamba cache blocks \((\d+)\)", text)
    assert logged and int(logged.group(1)) == 973
    config, plan = _plan(summary, text)
    assert config.max_num_seqs == 1024 and not plan.fits and plan.failure is TrialStatus.KV_TOO_SMALL
    planned = re.search(r"exceeds available Mamba cache blocks \((\d+)\)", plan.cause)
    assert planned and int(planned.group(1)) == pytest.approx(973, rel=0.03)
    _, served = _plan(*_start("2026-12-06_nemh8b_u045_default"))
    assert served.fits and served.num_gpu_blocks >= 1024
