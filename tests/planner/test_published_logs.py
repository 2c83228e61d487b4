"""The planner on vLLM starts people published (tests/fixtures/published_logs): constants refit, held-out targets.

The constants fitted on the ``fit`` starts are recomputed here from those starts' logged figures
and must equal what the code holds; the targets are judged on the ``held_out`` starts only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from servetune.errors import SpecError
from servetune.planner import comm, memory
from servetune.planner.engine_config import EngineConfig, resolve_engine_config
from servetune.planner.evidence import _env, fit_constants, judge, load_index, parse_index, summarize
from servetune.planner.gpus import get_gpu

GIB = 1 << 30
INDEX = Path(__file__).resolve().parents[1] / "fixtures" / "published_logs" / "index.yaml"
STARTS, MODELS = load_index(INDEX)
JUDGED = [judge(s, MODELS[s.id]) for s in STARTS]


def test_every_start_names_a_known_source_model_and_role():
    assert {s.role for s in STARTS} == {"fit", "held_out"}
    assert all(memory.parse_vllm_version(s.vllm) >= (0, 10, 0) for s in STARTS)
    assert sum(memory.parse_vllm_version(s.vllm) < (0, 11, 0) for s in STARTS) >= 6  # the 0.10.x starts
    assert all(s.logged.get("status") in ("ok", "failed") for s in STARTS)


#: Starts whose logged "Model loading took" the config's parameter bytes do not give within 0.5%:
#: id -> the band (percent) the weights error is held in. Kept as published, not explained away.
WEIGHT_GAPS = {
    # vLLM 0.30.0 (V2 model runner) prints 2.98 GiB for Qwen2.5-1.5B-Instruct in fp16 on a T4; the
    # checkpoint's parameters are 2.88 GiB, what earlier builds printed for this shape (a vLLM 0.9.2 log
    # of a 28-layer Qwen 1.5B: "Model loading took 2.8871 GiB"; 0.11.0 for Qwen2.5-Math-1.5B: 2.8798 GiB).
    # The 0.10 GiB more is not explained by the log; both starts' KV figures are within 0.1%.
    "llmlab_qwen25_15b_tp1_t4": (-4.0, -2.5),
    "llmlab_qwen25_15b_tp1_t4_prefix": (-4.0, -2.5),
    # vLLM 0.10.2 prints 7.5552 GiB for Qwen3-4B (tied embeddings) where its parameters are 7.50 GiB;
    # the 0.05 GiB more is not explained by the log (its own split says "7.56 GiB for weight"); KV exact.
    "benyucong_qwen3_4b_tp1_h100": (-1.0, -0.5),
}


def test_weights_derived_from_each_config_match_the_logged_model_loading():
    """The config fixtures are the models that ran: weights per GPU within 0.5% of "Model loading took"."""
    checked = [j for j in JUDGED if "weights" in j.start.logged]
    assert len(checked) >= 8
    for j in checked:
        error = 100 * (j.weights_gib / float(j.start.logged["weights"]) - 1)
        low, high = WEIGHT_GAPS.get(j.start.id, (-0.5, 0.5))
        assert low <= error <= high, (j.start.id, error)
    assert set(WEIGHT_GAPS) <= {j.start.id for j in checked}


def test_fitted_constants_are_what_the_fit_starts_give():
    refit = fit_constants(STARTS, MODELS)
    assert refit == {"SAMPLER_BYTES_PER_LOGIT_V1": memory.SAMPLER_BYTES_PER_LOGIT_V1,
                     "NON_TORCH_GIB_SINGLE_V1": comm.NON_TORCH_GIB_SINGLE_V1,
                     "NON_TORCH_GIB_MULTI_V1": comm.NON_TORCH_GIB_MULTI_V1}


#: Held-out starts the planner misses, kept as misses (no constant refitted on them): id -> the
#: band (percent) the error is held in, so a change that moves them is seen. See README.
KNOWN_MISSES = {
    # vLLM 0.19.0, Qwen2.5-72B at TP=4 on 4 x L40S over PCIe (custom all-reduce off beyond two PCIe
    # GPUs): 5.11 GiB left for KV, so the 0.28 GiB by which the planner's non-KV memory is low
    # (weights 0.11 GiB under "Model loading took", the rest in activation / non-torch) is +5.4%.
    "gnosia93_qwen25_72b_tp4_l40s": (4.0, 7.0),
    # vLLM 0.11.0, Llama-3.1-8B on a Colab L4 at gpu_memory_utilization 0.92, max_model_len 32000,
    # max_num_seqs 128: 4.75 GiB left for KV; the planner's non-KV memory is 0.26 GiB high (weights
    # exact), so -5.5%. The L4's total is not the cause: 22.05 GiB is what vLLM itself printed on L4s
    # ("Free memory on device cuda:0 (1.53/22.05 GiB)", vLLM CI, issue #33297; "(0.92, 20.28 GiB)" in
    # a service note). What is left is activation + non-torch: the 0.11 PyTorch-native (sort) sampler
    # over 128 rows, whose per-logit figure was fitted at 1,024 rows (38 B); the held-out 0.11 starts
    # imply ~34 B at 256 rows (T4, A100-40GB, L40S: -0.8% to -1.3%) and ~21 B here, so that peak is
    # not proportional to the rows. Not settled from the source; no constant refitted on it.
    "demoenvl4_llama31_8b_tp1_l4": (-7.0, -4.0),
    # vLLM 0.19.0, Qwen2.5-72B at TP=2 on 2 x H100 SXM (llm-d-planner's campaign, multicast live):
    # 3.04 GiB left for KV, so the 0.17 GiB by which the planner's non-KV memory is low is +5.6%.
    # The log's own split ("Total non KV cache memory: 72.19GiB"): weights 67.80 (planned 67.72, the
    # same 0.1% under as the TP=4 L40S start of this config), torch peak 2.29 (planned 2.20; the
    # hidden-8192 models of this campaign peak at 1.96-2.29, the planner gives 1.87-2.20), non-torch
    # 2.09 (planned 2.10). Not explained by the log; no constant refitted on it.
    "llmdplanner_qwen25_72b_tp2_h100": (4.0, 7.5),
}


def test_held_out_kv_capacity_and_every_failed_start_foreseen():
    """Every refused start foreseen, no refused start called a fit; KV error lines held out.

    The issue's target is within 2% on 90% of held-out starts; on this set 36 of 40 healthy starts
    are within 2% (90%; the seven vLLM 0.10.x starts are judged on the 3% target: all within it, six within 2%). The three misses (KNOWN_MISSES) are Qwen2.5-72B at TP=4 on 4 x L40S
    (vLLM 0.19.0), +5.4%, Llama-3.1-8B on a Colab L4 (0.11.0), -5.5%, and Qwen2.5-72B at TP=2 on
    2 x H100 SXM (0.19.0, 3.04 GiB of KV), +5.6%: kept as misses, held in their bands. The 0.19.1 and 2 x L40S (PCIe) 0.11.2
    starts were 4.0% and 2.0-2.5% low before the rules taken from vLLM's and NCCL's source
    (Triton top-k/top-p from 0.18, NCCL's PCIe rings); they informed which rules to look for, no
    constant was fitted on them. The lines held here are regression lines, not the target: starts
    before 0.20 within 2% (except the known misses), later ones within 10% (what the planner
    claims for 0.26+ on servetune's own H200 runs).
    """
    h = summarize(JUDGED, "held_out")
    assert h["healthy"] >= 20 and h["failed"] >= 2
    assert h["healthy_called_fit"] == h["healthy"]  # no healthy start called a failure
    for j in JUDGED:
        if j.start.role != "held_out" or j.kv_error is None:
            continue
        if j.start.id in KNOWN_MISSES:
            low, high = KNOWN_MISSES[j.start.id]
            assert low <= 100 * j.kv_error <= high, (j.start.id, j.kv_error)
            continue
        version = memory.parse_vllm_version(j.start.vllm)
        # 0.10.x: the project's 3% KV target (its sampler rule is counted from the source, not fitted)
        line = 3.0 if version < (0, 11, 0) else 2.0 if version < (0, 20, 0) else 10.0
        assert abs(100 * j.kv_error) <= line, (j.start.id, j.kv_error)
    assert set(KNOWN_MISSES) <= {j.start.id for j in JUDGED if j.start.role == "held_out"}
    assert all(abs(100 * j.kv_error) <= 2.0 for j in JUDGED if j.start.gpu == "H100-80GB"
               and j.start.role == "held_out" and j.kv_error is not None and j.start.id not in KNOWN_MISSES)
    assert h["failed_foreseen"] == h["failed"] and h["refused_called_fit"] == []


def test_the_gpu_and_environment_rules_read_off_two_former_misses():
    """Two misses explained by the logs themselves, not by a refit (both starts judged first without them).

    emocat17/GraphRAG (vLLM 0.13.0, TP=4, compute capability 8.0) logs vLLM's serve default of 8192
    batched tokens, which vLLM gives a >= 70 GiB device only when its name lacks "a100": an A800.
    As an A100-80GB (2048 tokens / 256 sequences) the plan was +5.2%; as an A800, within 2%.
    sridhar1804/local-ai (RTX 3090 under WSL 2): WDDM reports the whole 24.00 GiB; with Linux's
    23.69 the plan was -3.0%; with the WSL total, within 2%.
    """
    import dataclasses
    from servetune.planner.gpus import get_gpu, under_wddm
    assert memory.batch_defaults(get_gpu("A800-80GB"), (0, 13, 0)) == (8192, 1024)
    assert memory.batch_defaults(get_gpu("A100-80GB"), (0, 13, 0)) == (2048, 256)
    assert under_wddm(get_gpu("RTX-3090")).memory_gib == 24.0 and get_gpu("RTX-3090").memory_gib == 23.69
    assert under_wddm(get_gpu("L40S")) == get_gpu("L40S")  # no WDDM figure known: unchanged
    by_id = {j.start.id: j for j in JUDGED}
    for sid, before in (("graphrag_llama3_8b_tp4_a800", dict(gpu="A100-80GB")),
                        ("localai_phi3_mini_tp1_rtx3090", dict(environment="default"))):
        assert abs(by_id[sid].kv_error) <= 0.02, sid
        old = judge(dataclasses.replace(by_id[sid].start, **before), MODELS[sid])
        assert abs(old.kv_error) > 0.025, sid  # what the rule changed


def test_the_h100_start_of_unstated_form_plans_the_same_as_either_80gb_part():
    """qBraid's vLLM 0.19.1 log shows a Hopper of ~80 GiB but not whether SXM or PCIe: at TP=1 both plan alike.

    Indexed as H100-80GB; the H100-PCIe (same torch total, compute capability 9.0 and 8192-token default)
    gives the same KV capacity, so the check does not depend on the guess.
    """
    import dataclasses
    j = next(j for j in JUDGED if j.start.id == "qbraid_qwen25coder_14b_tp1_h100")
    pcie = judge(dataclasses.replace(j.start, gpu="H100-PCIe"), MODELS[j.start.id])
    assert pcie.kv_tokens == j.kv_tokens and abs(j.kv_error) <= 0.02


def test_the_pipeline_and_multicast_live_starts():
    """llm-d-planner's vLLM 0.19.0 starts on H100 SXM boards (NCCL's defaults, so NVLS live at TP >= 2).

    PP=2 and PP=4 of Llama-3.1-8B: vLLM sizes the KV cache by the smallest stage, the last (the LM
    head and the sampler's peak); the planner binds the same stage and is within 2%. TP=2 and TP=4
    (Llama-3.1-8B, Qwen2.5-7B, Llama-3.3-70B FP8-dynamic, Qwen2.5-72B): the planner, given the
    stated environment, takes NVLS as live and 0.19's FlashInfer all-reduce fusion as run (the logs'
    ``'fuse_allreduce_rms': True``), and its non-torch growth per worker is within 0.1 GiB of the logged
    one (2.06-2.21 GiB); planned in servetune's launch environment (NVLS off, no FlashInfer fusion: 0.54
    GiB) the same starts come out 2.4-4.5% high, so the check can fail. Not blind for two rules:
    FI_ALLREDUCE_FUSION_WORKSPACE_GIB (until 2026-12-06 one 2.04 GiB "multicast" term) and "PP-only layouts
    make no lazy ring connections" were read off this campaign's figures (2.0-2.2 GiB at TP 2-4, 0.07 at
    PP=2) before its logs were fixtures; the rest of each plan (per-rank and per-stage weights,
    activation, NVLS buffers by TP, KV pages) is.
    """
    import dataclasses
    from servetune.planner.comm import comm_memory, VLLM_DEFAULT_ENV
    from servetune.planner.gpus import get_gpu
    by_id = {j.start.id: j for j in JUDGED}
    pp = [by_id[f"llmdplanner_llama31_8b_pp{n}_h100"] for n in (2, 4)]
    assert [j.start.layout for j in pp] == ["TP=1 PP=2", "TP=1 PP=4"]
    for j in pp:
        assert abs(j.kv_error) <= 0.02, j.start.id
        # the binding stage is the last: its peak is the sampler's, above the first stage's 1.1 GiB
        assert j.activation_gib == pytest.approx(float(j.start.logged["activation_peak"]), abs=0.2)
    tp = [j for j in JUDGED if j.start.source == "llmd_planner_h100" and "tensor_parallel_size" in j.start.flags]
    assert len(tp) == 7 and {int(j.start.flags["tensor_parallel_size"]) for j in tp} == {2, 4}
    for j in tp:
        size = int(j.start.flags["tensor_parallel_size"])
        comm = comm_memory(get_gpu(j.start.gpu), tp=size, pp=1, env=VLLM_DEFAULT_ENV, version=(0, 19, 0))
        assert comm.multicast and comm.fused_allreduce
        assert abs(j.non_torch_gib - float(j.start.logged["non_torch"])) <= 0.1, j.start.id
        off = judge(dataclasses.replace(j.start, environment="multicast_off"), MODELS[j.start.id])
        assert off.kv_error - j.kv_error > 0.02, j.start.id


def test_every_published_excerpt_reads_as_its_logged_figures():
    """Where a start keeps the published lines, the product's own log parser reads ``logged`` from them.

    The excerpt is untrusted text: read with a size cap, parsed by ``engines.vllm.logs.parse_log``.
    """
    from servetune.engines.vllm.logs import parse_log
    fields = {"weights": "weights_gib", "activation_peak": "activation_peak_gib", "non_torch": "non_torch_gib",
              "kv_cache": "available_kv_gib", "kv_tokens": "kv_cache_tokens", "max_concurrency": "max_concurrency"}
    kept = [s for s in STARTS if s.log is not None]
    assert kept, "no start keeps its published lines"
    for s in kept:
        with open(INDEX.parent / s.log, "rb") as fh:
            data = fh.read(1 << 20)
        assert len(data) < 1 << 20, s.log
        parsed = parse_log(data.decode("utf-8", errors="replace"))
        read = {k: getattr(parsed, a) for k, a in fields.items() if getattr(parsed, a) is not None}
        assert {"kv_cache", "kv_tokens"} <= read.keys(), (s.id, read)
        for key, value in read.items():
            assert key in s.logged and float(s.logged[key]) == pytest.approx(float(value)), (s.id, key)


def test_the_failure_kind_is_the_one_vllm_raised():
    for j in JUDGED:
        if j.start.failed:
            assert j.failure == j.start.logged["failure"], j.start.id


def test_the_old_constants_would_miss_the_v1_starts():
    """The check can fail: with the 0.26 (V2 runner) sampler figure the V1 starts are >5% high."""
    j = next(j for j in JUDGED if j.start.id == "llmd_llama31_8b_tp1")
    model = MODELS[j.start.id]
    from servetune.planner.gpus import get_gpu
    cfg = memory.resolve_engine_config(j.start.flags, model, get_gpu(j.start.gpu), "0.26.0")
    v2 = memory.plan_memory(model, get_gpu(j.start.gpu), cfg)
    assert v2.kv_cache_tokens > 1.05 * j.logged_kv_tokens


@pytest.mark.parametrize("doc, field", [
    ({"sources": {}, "starts": [{"id": "a"}]}, "starts[0].source"),
    ({"sources": {"s": {}}, "starts": [{"id": "a", "source": "s", "model": "m", "gpu": "H200", "vllm": "0.11.0",
                                        "flags": {}, "logged": {}, "role": "train"}]}, "starts[0].role"),
    ({"sources": {"s": {}}, "starts": [{"id": "a", "source": "s", "model": "m", "gpu": "H200", "vllm": "0.11.0",
                                        "flags": {}, "logged": {}, "role": "fit", "log": "../../etc/passwd"}]},
     "starts[0].log"),
])
def test_a_malformed_index_names_the_entry(doc, field):
    with pytest.raises(SpecError) as err:
        parse_index(doc)
    assert err.value.field == field


def test_plan_claims_log_evidence_exactly_for_the_gpus_the_fixtures_cover():
    from servetune.planner.gpus import get_gpu, known_gpus
    covered = {get_gpu(s.gpu).name for s in STARTS}
    for name in known_gpus():
        claims = "published vLLM" in get_gpu(name).log_evidence  # the wording of every published-log line
        assert claims == (name in covered), name


def test_the_committed_report_is_what_the_planner_gives_now():
    """benchmarks/results/published_logs_heldout.json (README's figures) is re-derived, not copied."""
    import json
    committed = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results"
                            / "published_logs_heldout.json").read_text())
    assert committed["held_out"] == summarize(JUDGED, "held_out")


# --------------------------------------------------------------------------- model classes (classes.yaml)
CLASS_INDEX = INDEX.parent / "classes.yaml"
CLASS_STARTS, CLASS_MODELS = load_index(CLASS_INDEX)
CLASS_JUDGED = {s.id: judge(s, CLASS_MODELS[s.id]) for s in CLASS_STARTS}

#: Every held-out healthy start of classes.yaml: id -> the band (percent) its KV-token error is held in
#: (the error when the class rules were committed, +-0.3 points), so a change that moves one shows.
CLASS_KV_BANDS = {
    "llmdplanner_qwen15_moe_a27b_tp1_h100": 0.17,     # before the class rules: +0.9%
    "llmdplanner_mixtral_8x7b_tp2_h100": -0.24,       # +0.9%
    "telco_qwen3_30b_a3b_2507_tp1_h200": 0.04,        # +8.0% (vLLM 0.15.0 on an H200: the kept MoE workspace)
    "llmdplanner_deepseek_v2_lite_tp1_h100": 0.28,    # refused (MLA)
    "llmdplanner_gemma2_2b_tp1_h100": 0.19,           # +0.2%
    "llmdplanner_gemma2_9b_tp1_h100": 0.25,           # +0.2%
    "llmdplanner_gemma2_27b_tp1_h100": 0.76,          # +0.8%
    "llmdplanner_gemma3_4b_tp1_h100": 0.25,           # refused (text_config without num_attention_heads)
    "llmdplanner_gemma3_27b_tp1_h100": 0.83,          # refused (text_config without vocab_size)
    "llmdplanner_llama31_8b_qfp8_tp1_h100": 0.21,     # +0.2%
    "llmdplanner_qwen25_7b_fp8dyn_tp1_h100": 0.24,    # +0.2%
    "llmdplanner_llama31_8b_w8a8_tp1_h100": 0.22,     # +0.2%
    "llmdplanner_qwen25_7b_w8a8_tp1_h100": 0.24,      # +0.2%
    "llmdplanner_llama33_70b_w8a8_tp2_h100": 0.31,    # +0.3%
    "llmdplanner_llama31_8b_w4a16_tp1_h100": 0.23,    # +0.2%
    "llmdplanner_llama31_8b_kvfp8_tp1_h100": 0.24,    # +0.2%
    "llmdplanner_qwen25_7b_kvfp8_tp1_h100": 0.31,     # +0.3%
    "parallelworks_gpt_oss_120b_tp2_h200": -0.17,     # +4.2% (MXFP4 on every linear layer, 29.72 GiB of 32.98)
    "llmd_gpt_oss_20b_tp1_h100_011": -0.20,           # +3.1%
    "llmdplanner_mistral_small31_w8a8_tp1_h100": 0.24,  # +2.5% (the Pixtral tower not counted)
    "llmdplanner_mistral_small31_w8a8_tp2_h100": -0.23,  # +1.0%
    "llmd_gpt_oss_120b_tp1_h100_011": -3.97,          # +150.5%; a miss, see CLASS_KNOWN_MISSES
    "durango_qwen3_coder_30b_fp8_tp1_a100_40gb": -0.73,  # +10.6% (block-fp8 scales as Marlin holds them on an A100)
    "llmdplanner_granite_vision33_2b_tp1_h100": 0.05,  # +1.4% (the SigLIP tower not counted)
    "llmdplanner_kimi_vl_a3b_tp1_h100": 0.50,         # refused (MLA)
    "llmdplanner_kimi_vl_a3b_tp2_h100": 0.22,         # refused (MLA)
    # Added with the AWQ class and judged once, nothing changed for them (no "before": the rules were in place)
    "natoscott_qwen3_32b_awq_tp2_l40s": -0.28,        # vLLM 0.11.2, 2 x L40S
    "jinwoong_qwen3_14b_awq_tp1_l40s": -0.11,         # stated 0.28.0 (V2 runner), one L40S
    "jinwoong_qwen3_14b_awq_tuned_tp1_l40s": 0.19,    # the same at 0.95 x 8 sequences x 1,024 tokens
    "jinwoong_qwen3_14b_awq_tp2_l4": 1.77,            # 2 x L4 over PCIe
    "jinwoong_qwen3_14b_awq_pp2_l4": -1.30,           # the same two L4s at PP=2
    "pageindex_qwen3_32b_awq_tp2_rtx5090": -5.23,     # a miss, see CLASS_KNOWN_MISSES
    "llmd_mistral_small32_tp1_h100": -10.66,          # a miss, see CLASS_KNOWN_MISSES
    # Added with the 0.10.x rules and judged once (FlashInfer's sampler, GPUs without P2P across nodes)
    "dennislee22_gpt_oss_120b_tp4_a100": -0.28,       # vLLM 0.10.1.1, 4 x A100 80GB over Ray
    # Added 2026-12-06 and judged once with the planner unchanged (other projects' logs and a blog post)
    "soundwave_llama3_70b_awq_tp2_l40s": -0.02,       # vLLM 0.16.0, 2 x L40S, Llama-3-70B AWQ at the defaults
    "mlopsassign_qwen3_30b_a3b_2507_qfp8_tp1_h100": 0.37,  # vLLM 0.22.1, H100, MoE with online FP8
    # vLLM 0.12.0, 2 x H100 SXM: -4.64% when judged (the ~2 GiB term read off 0.19 logs, charged at every version);
    # -1.04% since that term was found to be 0.17+'s FlashInfer all-reduce fusion (comm.fused_allreduce_runs), a
    # version rule looked for after this start's error was read, so no longer a blind check of it
    "videocut_qwen3_30b_a3b_tp2_h100": -1.04,
    "myoceane_gpt_oss_20b_tp1_a100": 1.02,            # vLLM 0.19.0, A100 80GB, the post's 36.56 GiB (no token line)
    # Qwen3-VL, refused (excluded) before 2026-12-06; judged once after the Qwen3-VL rules were committed from source
    "videocut_qwen3_vl_30b_a3b_tp2_h100": -0.59,      # -4.52 as first judged, before the fusion term was gated to 0.17+
    "sipeed_qwen3_vl_30b_a3b_tp4_rtx3090": 6.53,      # a miss, see CLASS_KNOWN_MISSES (image profile: +95.3)
    # Expert parallelism (vLLM 0.10.2, 8 x L40S, TP=8 with --enable-expert-parallel): judged once after the
    # expert-parallel rules were committed from vLLM's source; nothing changed for it
    "l40s8_qwen3_235b_a22b_2507_fp8_tp8_ep_l40s": 1.09,
}

#: Held-out class starts outside the 3% target, kept as misses (nothing refitted on them).
CLASS_KNOWN_MISSES = {
    # gpt-oss-120b on one H100 at vLLM 0.11.0 (llm-d's table): 3.33 GiB of KV left, so the 0.15 GiB by which
    # the MXFP4 weights are planned high (64.53 against 64.38; MXFP4_LAYER_BYTES was fitted on 0.19.0's 20b)
    # is -4.0%. The table's gpu_memory_utilization (0.9) contradicts its own figures (they add up to 0.95).
    "llmd_gpt_oss_120b_tp1_h100_011",
    # Qwen3-32B-AWQ at TP=2 on two RTX 5090s, vLLM 0.11.0 at 256 rows: the plan's 1.47 GiB activation peak (0.11's
    # sort-based sampler, SAMPLER_BYTES_PER_LOGIT_V1 fitted at 1,024 rows) against ~0.6 GiB the logged 126,112
    # tokens leave for peak + non-torch; the same small-row overestimate as the dense L4 miss (index.yaml).
    "pageindex_qwen3_32b_awq_tp2_rtx5090",
    # Mistral-Small-3.2 stated as vLLM 0.11.0: its logged 2.12 GiB peak is the 0.18+ Triton sampler's at 1,024 rows
    # (the plan at 0.19.0's rules is -0.28%), and its 79.19 GiB total is printed as the 0.19 logs print it, not as
    # the 0.11.0 rows of the same table (79.18); judged at the version the source states.
    "llmd_mistral_small32_tp1_h100",
    # Qwen3-VL-30B-A3B at TP=4 on four RTX 3090s, vLLM 0.11.0 (judged once): 2.46 GiB of KV planned against the logged
    # 2.31; the 0.15 GiB over is 6.5% of so small a cache. The plan's 4.08 GiB peak holds the 0.11 dummy video's
    # outputs at 153,600 tokens (the log's "budget of 153600 tokens ... 1 video items"); with an image profile instead
    # the plan is +95%. Non-torch memory at TP=4 without custom all-reduce is planned at 0.02 GiB. Not refitted.
    "sipeed_qwen3_vl_30b_a3b_tp4_rtx3090",
}


def test_class_starts_fit_on_at_most_half_and_name_their_class():
    roles = [s.role for s in CLASS_STARTS]
    assert len(CLASS_STARTS) >= 40 and roles.count("fit") <= len(roles) // 2
    assert {s.kind for s in CLASS_STARTS} >= {"moe", "mxfp4", "fp8", "w8a8", "w4a16", "awq", "fp8_kv", "sliding_window", "mla",
                                              "vision"}
    assert all(s.kind != "dense" for s in CLASS_STARTS)
    assert all(memory.parse_vllm_version(s.vllm) >= (0, 10, 0) for s in CLASS_STARTS)


def test_class_constants_are_what_the_fit_starts_give():
    from servetune.planner import modelclass
    from servetune.planner.evidence import fit_class_constants
    assert fit_class_constants(CLASS_STARTS, CLASS_MODELS) == {
        "MXFP4_LAYER_BYTES": modelclass.MXFP4_LAYER_BYTES,
        "MULTIMODAL_PROFILE_ELEMS_PER_TOKEN": modelclass.MULTIMODAL_PROFILE_ELEMS_PER_TOKEN}


def test_held_out_class_starts_kv_within_their_bands_and_3pct():
    """The target on held-out starts is KV within 3% on 90%: 31 of 34 met it; with the four starts added on
    2026-12-06 (judged once, nothing changed for them) it was 34 of 38 (89.5%), below the target; 35 of 38 (92.1%)
    since the fusion workspace is charged from vLLM 0.17 only (a rule looked for after the 0.12.0 TP=2 start's -4.6%
    was read, so that start is no longer blind). With the two Qwen3-VL-30B-A3B starts (refused before 2026-12-06,
    judged once after their rules) 36 of 40 (90%): the H100 one, -4.5% as first judged without the fusion rule (written
    on another line of work that never read it), is -0.6% with it; the RTX 3090 one misses (+6.5%). Blind throughout:
    35 of 40. With the one expert-parallel start (vLLM 0.10.2, 8 x L40S at TP=8, judged once after the expert-parallel
    rules were committed: +1.09%) 37 of 41, blind throughout 36 of 41. Pinned as counted, not loosened to pass: a rule
    change that moves a start shows here and in the bands."""
    held = [j for j in CLASS_JUDGED.values() if j.start.role == "held_out" and not j.start.failed]
    assert {j.start.id for j in held} == set(CLASS_KV_BANDS)
    for j in held:
        assert j.fits, j.start.id  # no served start called impossible
        error = 100 * j.kv_error
        assert CLASS_KV_BANDS[j.start.id] - 0.3 <= error <= CLASS_KV_BANDS[j.start.id] + 0.3, (j.start.id, error)
        assert abs(error) <= 3.0 or j.start.id in CLASS_KNOWN_MISSES, j.start.id
    within = sum(abs(100 * j.kv_error) <= 3.0 for j in held)
    assert (within, len(held)) == (37, 41)
    assert {j.start.id for j in held if abs(100 * j.kv_error) > 3.0} == CLASS_KNOWN_MISSES


def test_class_weights_match_model_loading():
    """The configs are the models that ran, and the class rules load them as vLLM does: within 0.6%, except
    gpt-oss-20b at TP=1 on vLLM 0.11.0, 0.9% over (0.11.0 logged 13.47 GiB, 0.19.0 13.64 for the same
    checkpoint; MXFP4_LAYER_BYTES was fitted on a 0.19.0 start), and Kimi-VL at TP=2, 1.2% under (the
    MoonViT tower is counted as split by TP like the language model; how vLLM shards it is not checked)."""
    gaps = {"llmd_gpt_oss_20b_tp1_h100_011": (0.6, 1.2), "llmdplanner_kimi_vl_a3b_tp2_h100": (-1.5, -0.9),
            # Qwen3-14B-AWQ: 9.30 GiB planned (4 bits + an fp16 scale and a 4-bit zero per 128) against the post's
            # 9.44; what the AWQ-Marlin repacking holds beyond the checkpoint is not traced
            "jinwoong_qwen3_14b_awq_tp1_l40s": (-1.8, -1.2),
            # gpt-oss-120b at TP=4 on vLLM 0.10.1.1: 17.42 GiB planned (0.19's two copies of the MXFP4 scales)
            # against the logged 17.22; what 0.10.1's Triton MXFP4 path keeps is not traced (KV within 0.3%)
            "dennislee22_gpt_oss_120b_tp4_a100": (0.9, 1.5),
            # gpt-oss-20b on an A100 at vLLM 0.19.0 (added 2026-12-06): 13.59 GiB planned against the post's 13.72 (0.19.0
            # on an H100 logs 13.64): the A100 serves MXFP4 through another kernel than the Hopper Triton path
            # MXFP4_LAYER_BYTES was fitted on; what it holds is not traced (KV +1.0%)
            "myoceane_gpt_oss_20b_tp1_a100": (-1.3, -0.6)}
    checked = [j for j in CLASS_JUDGED.values() if "weights" in j.start.logged]
    assert len(checked) >= 20
    for j in checked:
        error = 100 * (j.weights_gib / float(j.start.logged["weights"]) - 1)
        low, high = gaps.get(j.start.id, (-0.6, 0.6))
        assert low <= error <= high, (j.start.id, error)


def test_class_failures_foreseen_and_the_open_one_kept_visible():
    """gpt-oss-120b at the default 131,072 tokens on one H100 (vLLM issue #27508): refused for KV, as vLLM did.

    The two gpt-oss-20b starts at gpu_memory_utilization 0.95 (vLLM 0.19.0) died after the KV cache was sized,
    warming up the sampler over 1,024 rows (cudagraph_oom in the product's words): called fits, and no rule of
    vLLM's arithmetic calls them (the tests below hold why). The planner checks that warm-up
    (memory._warmup_verdict, vLLM's own allocation: ``v1/worker/gpu_worker.py`` lines 666-686 of 0.19.0, after
    ``capture_model`` at line 588): its 2.78 GiB of logits and fp32 sampler tensors against what the weights,
    the KV cache and the graphs leave, 4.63 GiB (TP=1) and 3.62 (TP=2) as planned, 4.48 and 3.27 by vLLM's own
    DEBUG line ("Free memory on device ... Actual usage is ..."). Held here as called fits so a change shows.
    Since 2026-12-07 both are warned ("may fail in the sampler warm-up"): their margins, 1.85 and 0.84 GiB, are
    under the top of the shortfall band measured on vLLM 0.26.0 (1.89, read off other starts; before, the
    warning was kept to releases that take the graph estimate off the KV budget, and neither was warned).
    """
    assert CLASS_JUDGED["vllm27508_gpt_oss_120b_tp1_h100_failed"].failure == "kv_too_small"
    assert CLASS_JUDGED["llmd_deepseek_r1_fp8_tp1_h100_failed"].failure == "startup_oom"  # 671B in FP8 on one GPU
    keeps = ("max_num_seqs <= 1007 or gpu_memory_utilization <= 0.94", "max_num_seqs <= 32 or gpu_memory_utilization <= 0.93")
    for sid, margin, keep in zip(WARMUP_DEATHS, (1.85, 0.84), keeps):
        assert CLASS_JUDGED[sid].fits and CLASS_JUDGED[sid].start.logged["failure"] == "cudagraph_oom"
        plan = _class_plan(sid)
        assert plan.warmup_at_risk and round(plan.warmup_margin, 2) == margin
        note = next(n for n in plan.notes if n.startswith("sampler warm-up after CUDA-graph capture"))
        assert "may fail in the sampler warm-up" in note and note.endswith(f"{keep} leaves that much")


def _warm_up_plans() -> dict[str, tuple[bool, memory.MemoryPlan]]:
    """Every published start whose plan has a sampler warm-up after graph capture: id -> (failed, plan)."""
    out = {}
    for index in sorted(INDEX.parent.glob("*.yaml")):
        starts, models = load_index(index)
        for s in starts:
            if s.id not in models:
                continue
            gpu = get_gpu(s.gpu)
            try:
                config = resolve_engine_config(s.flags, models[s.id], gpu, s.vllm)
            except SpecError:  # refused flags (a quantization the stored config does not carry): no plan
                continue
            plan = memory.plan_memory(models[s.id], gpu, dataclasses.replace(config, flashinfer_available=s.flashinfer),
                                      env=_env(s.environment))
            if plan.warmup_margin is not None:
                out[s.id] = (s.failed, plan)
    return out


def test_the_warm_up_warning_judged_on_the_published_starts():
    """The warning's threshold (``WARMUP_SHORTFALL_GIB[1]``, 1.89 GiB, read off three vLLM 0.26.0 starts of
    servetune's own) on every published start with a sampler warm-up after graph capture (0.10-0.19 all models,
    later ones on the V1 runner): both warm-up deaths warned, no served start refused by it, 15 served starts
    warned (every one at 0.11-0.19 with graphs and a margin under 1.89 GiB: Llama-3.3-70B FP8 at TP=2 1.08,
    Qwen2.5-0.5B on a T4 0.77, ...). A warning, not a verdict: served margins from 0.77 to 1.87 GiB surround
    the deaths' 0.84 and 1.85. 17 warned until 2026-12-07, when GPUs linked by PCIe took their own context
    (``comm.CONTEXT_GIB_PCIE_EXTRA`` in place of the NVLink figure): the Qwen3-14B and Qwen3-32B-AWQ starts at
    TP=2 on two L40S (natoscott, served) went from 1.64 to 2.57 GiB past the warm-up's need."""
    plans = _warm_up_plans()
    served = {sid: p for sid, (failed, p) in plans.items() if not failed}
    assert len(served) >= 80
    assert not [sid for sid, p in served.items() if p.failure is memory.TrialStatus.CUDAGRAPH_OOM]
    warned = sorted(round(p.warmup_margin, 2) for p in served.values() if p.warmup_at_risk)
    assert len(warned) == 15 and warned[0] == 0.77 and warned[-1] == 1.87
    assert all(plans[sid][1].warmup_at_risk for sid in WARMUP_DEATHS)


#: The two held-out vLLM 0.19.0 starts that died in the sampler warm-up after graph capture.
WARMUP_DEATHS = ("llmdplanner_gpt_oss_20b_tp1_h100_failed", "llmdplanner_gpt_oss_20b_tp2_h100_failed")


def _plan_start(start, model) -> memory.MemoryPlan:
    """The planner's full plan of one published start, as ``judge`` plans it (for starts that set no interconnect)."""
    assert not start.interconnect and start.environment != "wsl", start.id
    gpu = get_gpu(start.gpu)
    config = resolve_engine_config(start.flags, model, gpu, start.vllm)
    return memory.plan_memory(model, gpu, dataclasses.replace(config, flashinfer_available=start.flashinfer),
                              env=_env(start.environment))


def _class_plan(sid: str) -> memory.MemoryPlan:
    """The planner's full plan of one classes.yaml start."""
    return _plan_start(next(s for s in CLASS_STARTS if s.id == sid), CLASS_MODELS[sid])


def oom_figures(line: str) -> dict[str, float]:
    """GiB figures of PyTorch's CUDA out-of-memory message: asked, free, allocated, in private pools, stranded.

    ``stranded`` is "reserved by PyTorch but unallocated": blocks the caching allocator holds and could not
    give the request, after it released every wholly free segment and retried.

    Example:
        >>> oom_figures("Tried to allocate 786.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which 552.50 MiB "
        ...             "is free. Of the allocated memory 74.91 GiB is allocated by PyTorch, with 626.00 MiB allocated "
        ...             "in private pools (e.g., CUDA Graphs), and 1.78 GiB is reserved by PyTorch but unallocated.")
        {'asked': 0.767578125, 'free': 0.539550781, 'allocated': 74.91, 'pools': 0.611328125, 'stranded': 1.78}
    """
    import re

    def gib(pattern: str) -> float:
        match = re.search(pattern + r" ([0-9.]+) (MiB|GiB)", line) or re.search(r"([0-9.]+) (MiB|GiB) " + pattern, line)
        assert match, pattern
        return round(float(match.group(1)) / (1024 if match.group(2) == "MiB" else 1), 9)

    return {"asked": gib("Tried to allocate"), "free": gib(r"of which"), "allocated": gib("Of the allocated memory"),
            "pools": gib(r"allocated by PyTorch, with"), "stranded": gib(r"and")}


def test_oom_figures_reads_both_deaths_and_refuses_a_line_without_them():
    text = (CLASS_INDEX.parent / "logs" / "llmdplanner_gpt_oss_20b_tp2_h100_failed.log").read_text()
    line = next(ln for ln in text.splitlines() if "OutOfMemoryError" in ln)
    assert oom_figures(line) == {"asked": 786 / 1024, "free": round(298.5 / 1024, 9), "allocated": 72.02,
                                 "pools": round(318 / 1024, 9), "stranded": 1.62}
    with pytest.raises(AssertionError):
        oom_figures("RuntimeError: CUDA out of memory occurred when warming up sampler with 1024 dummy requests.")


@pytest.mark.parametrize("sid", WARMUP_DEATHS)
def test_the_warm_up_deaths_had_room_but_for_the_allocators_stranded_blocks(sid: str):
    """What killed them, read off each OOM line: the memory the warm-up had (free, plus what it had allocated past
    the logged weights, the logged KV cache and the graphs' private pool) is 2.73 GiB (TP=1) and 1.71 (TP=2),
    1.91 GiB below the planner's free memory at the warm-up in both; 1.78 and 1.62 GiB of it is "reserved by
    PyTorch but unallocated". With those blocks the sampler's 2.78 GiB would have fit; without them the 786 MiB
    fp32 [1,024 x 201,088] tensor (``sampler.py`` line 90 / ``topk_topp_sampler.py`` lines 112 and 334 of
    0.19.0) did not. The cold-cache gpt-oss-20b starts on vLLM 0.26 measured 1.88-1.89 GiB short
    (tests/fixtures/real_h100_classes, "Fourth set"): the same stranding, not in vLLM's arithmetic, which is why
    no verdict rule was added after these held-out errors were read."""
    start = next(s for s in CLASS_STARTS if s.id == sid)
    text = (CLASS_INDEX.parent / start.log).read_text()
    oom = oom_figures(next(ln for ln in text.splitlines() if "OutOfMemoryError" in ln))
    plan = _class_plan(sid)
    assert plan.fits and plan.warmup_margin is not None and plan.warmup_margin > 0
    need = memory.sampler_warmup_bytes(CLASS_MODELS[sid], _config(sid))[1] / GIB
    had = oom["free"] + oom["allocated"] - oom["pools"] - float(start.logged["weights"]) - float(start.logged["kv_cache"])
    short = plan.warmup_margin + need - had
    assert oom["asked"] == pytest.approx(1024 * CLASS_MODELS[sid].vocab_size * 4 / GIB, abs=2 / 1024)
    assert 1.88 <= short <= 1.94, short
    assert oom["stranded"] >= 0.8 * short and had < need < had + oom["stranded"]


def _config(sid: str) -> EngineConfig:
    start = next(s for s in CLASS_STARTS if s.id == sid)
    return resolve_engine_config(start.flags, CLASS_MODELS[sid], get_gpu(start.gpu), start.vllm)


def test_no_warm_up_margin_separates_the_deaths_from_served_starts_of_their_campaign():
    """Why no margin rule was added: llm-d's vLLM 0.19.0 H100 campaign (index.yaml and classes.yaml) has served
    starts whose planned warm-up margin is above and below the TP=1 death's 1.85 GiB (1.83 and 1.86 among them),
    so a threshold that fails it fails served starts. The TP=2 death's 0.84 GiB is below every served start's
    (1.08 and up), but a threshold set between them would be fitted on that one death."""
    served = []
    for index in (INDEX, CLASS_INDEX):
        starts, models = load_index(index)
        for s in starts:
            if s.source.startswith("llmd_planner_h100") and not s.failed and s.vllm == "0.19.0":
                plan = _plan_start(s, models[s.id])
                if plan.warmup_margin is not None:
                    served.append(plan.warmup_margin)
    tp1, tp2 = (_class_plan(sid).warmup_margin for sid in WARMUP_DEATHS)
    assert len(served) >= 20
    assert min(m for m in served if m > tp1) - tp1 < 0.05 and tp1 - max(m for m in served if m < tp1) < 0.05
    assert tp2 < min(served) < 1.1


def test_class_excerpts_read_as_their_logged_figures():
    from servetune.engines.vllm.logs import parse_log
    fields = {"weights": "weights_gib", "activation_peak": "activation_peak_gib", "non_torch": "non_torch_gib",
              "kv_cache": "available_kv_gib", "kv_tokens": "kv_cache_tokens", "max_concurrency": "max_concurrency"}
    kept = [s for s in CLASS_STARTS if s.log is not None]
    # Sources that publish figures, not log lines: llm-d's tables, natoscott's table, a blog's and a report's figures
    figures_only = {"llmd_empirical_classes", "llmd_empirical_mistral", "natoscott_l40s_classes", "jinwoong_awq",
                    "pageindex_rtx5090", "myoceane_a100"}
    assert {s.source for s in CLASS_STARTS if s.log is None} <= figures_only
    for s in kept:
        with open(CLASS_INDEX.parent / s.log, "rb") as fh:
            data = fh.read(1 << 20)
        parsed = parse_log(data.decode("utf-8", errors="replace"))
        read = {k: getattr(parsed, a) for k, a in fields.items() if getattr(parsed, a) is not None}
        assert "kv_cache" in read, s.id
        for key, value in read.items():
            assert key in s.logged and float(s.logged[key]) == pytest.approx(float(value)), (s.id, key)


def test_the_refused_class_starts_are_refused():
    import yaml
    from servetune.planner.modelinfo import load_model
    refused = yaml.safe_load(CLASS_INDEX.read_text())["refused"]
    assert refused
    for entry in refused:
        with pytest.raises(SpecError) as err:
            load_model(CLASS_INDEX.parent / entry["model"])
        assert "not modelled" in err.value.message and err.value.fix
        assert (CLASS_INDEX.parent / entry["log"]).is_file()


def test_the_committed_class_report_is_what_the_planner_gives_now():
    """benchmarks/results/published_logs_classes.json (docs/model-classes.md's figures) is re-derived, not copied."""
    import importlib.util
    import json
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("published_logs_bench", root / "benchmarks" / "published_logs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    committed = json.loads((root / "benchmarks" / "results" / "published_logs_classes.json").read_text())
    assert committed == json.loads(json.dumps(bench.class_report()))


def test_the_010_starts_profile_flashinfer_where_their_log_says_it_imports():
    """vLLM 0.10.x's dummy sampler: FlashInfer's top-k/top-p where it imports, PyTorch's sort where not.

    The 0.10.1.1 A100 starts that log "Using FlashInfer for top-p & top-k sampling" are within 3% with
    the FlashInfer rule (counted: 14 B a logit in bf16) and 3-26% low with the sort path's fitted
    37.95 B (0.87 GiB more at 256 rows of a 152,064 vocabulary); the two 0.10.x starts that log
    "FlashInfer is not available" are within 1% with the sort path, and off without it. Nothing
    fitted on them: every 0.10.x start is held out.
    """
    from servetune.planner.vllm_rules import memory_rules
    assert memory_rules((0, 10, 0)).flashinfer_topk_topp and memory_rules((0, 10, 2)).flashinfer_topk_topp
    v010 = [j for j in JUDGED if memory.parse_vllm_version(j.start.vllm) < (0, 11, 0)]
    assert len(v010) >= 6 and all(j.start.role == "held_out" for j in v010)
    assert {j.start.flashinfer for j in v010} >= {True, False}
    for j in v010:
        said = j.start.flashinfer is not False  # not stated: 0.10.x is planned with FlashInfer
        assert abs(j.kv_error) <= (0.03 if said else 0.01), (j.start.id, j.kv_error)
        other = judge(dataclasses.replace(j.start, flashinfer=not said), MODELS[j.start.id])
        assert abs(other.kv_error) > abs(j.kv_error) + 0.005, (j.start.id, other.kv_error)


def test_vllm_010_is_accepted_and_the_v0_engine_refused():
    with pytest.raises(SpecError, match="0.10.0"):
        memory.parse_vllm_version("0.9.2")
    assert memory.parse_vllm_version("0.10.0") == (0, 10, 0)
    assert memory.parse_vllm_version("0.10.1.1") == (0, 10, 1) and memory.parse_vllm_version("v0.10.2") == (0, 10, 2)


def test_the_010_starts_capture_piecewise_graphs_only():
    """vLLM 0.10.x defaults to PIECEWISE CUDA graphs (0.11.0: FULL_AND_PIECEWISE): 67 graphs at the default
    capture sizes, and the graph pools the 0.10.x logs print at TP=1 lie within 0.15 GiB of the
    piecewise-only estimate, where the estimate with 0.11.0's FULL decode graphs is 0.2 GiB or more over."""
    from servetune.engines.vllm.logs import parse_log
    from servetune.planner.engine_config import resolve_engine_config
    from servetune.planner.gpus import get_gpu
    from servetune.planner.model_memory import cudagraph_memory_bytes
    from servetune.planner.vllm_rules import memory_rules
    assert not memory_rules((0, 10, 2)).full_decode_graphs and memory_rules((0, 11, 0)).full_decode_graphs
    checked = 0
    for s in STARTS:
        if memory.parse_vllm_version(s.vllm) >= (0, 11, 0) or s.layout != "TP=1":
            continue
        logged = parse_log((INDEX.parent / s.log).read_text(encoding="utf-8")).graph_capture_gib
        config = resolve_engine_config(s.flags, MODELS[s.id], get_gpu(s.gpu), s.vllm)
        as_011 = resolve_engine_config(s.flags, MODELS[s.id], get_gpu(s.gpu), "0.11.0")
        assert config.full_cudagraph_sizes == () and config.num_cudagraphs == 67, s.id
        assert abs(cudagraph_memory_bytes(MODELS[s.id], config) / GIB - logged) <= 0.15, s.id
        assert cudagraph_memory_bytes(MODELS[s.id], as_011) / GIB - logged >= 0.2, s.id
        checked += 1
    assert checked >= 4


#: Each release's V1 sampler, read in its wheel (``v1/sample/ops/topk_topp_sampler.py``, ``envs.py``): True where it
#: takes FlashInfer's top-k/top-p by default whenever ``flashinfer.sampling`` imports (``topk_topp_sampler.py:39-57@0.11.0``:
#: ``envs.VLLM_USE_FLASHINFER_SAMPLER is not False``, unset None at ``envs.py:618-620@0.11.0``), False where it is
#: opt-in (``topk_topp_sampler.py:34@0.11.1``, ``:35@0.12.0``-``0.16.0``, ``:39@0.17.0``-``0.20.0``:
#: ``if envs.VLLM_USE_FLASHINFER_SAMPLER:``; unset None up to ``envs.py:716-720@0.20.0``). 0.21+ turns it on but the
#: profile run still peaks in the native call (``flashinfer_sampler_default``). Read on 2026-12-06, after the held-out
#: errors of gpustack's Qwen3-235B runs were seen.
SAMPLER_TAKES_FLASHINFER = {(0, 10, 0): True, (0, 10, 1): True, (0, 10, 2): True, (0, 11, 0): True,
                            (0, 11, 1): False, (0, 11, 2): False, (0, 12, 0): False, (0, 13, 0): False,
                            (0, 14, 0): False, (0, 14, 1): False, (0, 15, 0): False, (0, 15, 1): False,
                            (0, 16, 0): False, (0, 17, 0): False, (0, 17, 1): False, (0, 18, 0): False,
                            (0, 19, 0): False, (0, 19, 1): False, (0, 20, 0): False}


@pytest.mark.parametrize("version", sorted(SAMPLER_TAKES_FLASHINFER))
def test_the_profile_runs_sampler_takes_flashinfer_by_default_exactly_where_the_release_does(version):
    """The pure rule per release: FlashInfer's top-k/top-p in the profile run where the release takes it by default
    and it imports (stated True); the sort, or from 0.18 the Triton kernel, where it is opt-in or does not import. Where
    the environment is not stated, 0.10.x is planned with FlashInfer and 0.11.0 with the sort (its published starts)."""
    from servetune.planner.modelinfo import load_model
    from servetune.planner.vllm_rules import memory_rules
    from servetune.planner.model_memory import sampler_profile_bytes
    assert memory_rules(version).flashinfer_topk_topp is SAMPLER_TAKES_FLASHINFER[version]
    model, gpu = load_model("qwen3-8b"), get_gpu("H100-80GB")
    text = ".".join(map(str, version))
    base = resolve_engine_config({}, model, gpu, text)
    took = {fi: dataclasses.replace(base, flashinfer_available=fi).rules.flashinfer_topk_topp for fi in (True, False, None)}
    assert took[True] is SAMPLER_TAKES_FLASHINFER[version] and took[False] is False
    assert took[None] is (version < (0, 11, 0))
    on, off = (sampler_profile_bytes(model, dataclasses.replace(base, flashinfer_available=fi), 1024) for fi in (True, False))
    assert (on < off) is SAMPLER_TAKES_FLASHINFER[version]  # FlashInfer's 14 B a bf16 logit under the sort's 37.95


def test_a_starts_own_sampler_line_decides_whether_flashinfer_imports(tmp_path):
    """A published start's log decides: "FlashInfer is not available" is False, "Using FlashInfer for top-p & top-k
    sampling" True, whatever the entry or its source says; without the line the entry's ``flashinfer``, then the
    source's (a publisher's image), then None."""
    from servetune.planner.evidence import parse_index, sampler_line_flashinfer
    (tmp_path / "no.log").write_text("WARNING FlashInfer is not available. Falling back to the PyTorch-native\n")
    (tmp_path / "yes.log").write_text("INFO Using FlashInfer for top-p & top-k sampling.\n")
    (tmp_path / "none.log").write_text("INFO Available KV cache memory: 10.00 GiB\n")
    entry = {"source": "img", "model": "qwen3-8b", "gpu": "H100-80GB", "vllm": "0.11.0", "flags": {},
             "logged": {"kv_cache": 10.0}, "role": "held_out"}
    doc = {"sources": {"img": {"flashinfer": True}, "bare": {}},
           "starts": [{**entry, "id": "a", "log": "no.log"}, {**entry, "id": "b", "log": "yes.log", "flashinfer": False},
                      {**entry, "id": "c", "log": "none.log"}, {**entry, "id": "d", "log": "none.log", "flashinfer": False},
                      {**entry, "id": "e", "source": "bare"}]}
    said = {s.id: s.flashinfer for s in parse_index(doc, tmp_path)}
    assert said == {"a": False, "b": True, "c": True, "d": False, "e": None}
    assert parse_index(doc)[0].flashinfer is True  # no folder: the logs are not read, the source's image answers
    assert sampler_line_flashinfer("") is None
    # The collections: every 0.11.0 log with the line says FlashInfer does not import
    with_line = [s for s in STARTS + CLASS_STARTS if s.vllm == "0.11.0" and s.flashinfer is not None]
    assert with_line and {s.flashinfer for s in with_line} == {False}


def test_the_gpustack_qwen3_235b_start_fits_at_0110_only_with_flashinfer_stated():
    """GPUStack's performance lab served Qwen3-235B-A22B-Instruct-2507 with ``vllm serve ... -tp 8`` on 8 x H100
    at vLLM 0.11.0 (262,144 tokens by default). 0.11.0's sampler takes FlashInfer's top-k/top-p wherever it imports
    (``v1/sample/ops/topk_topp_sampler.py:17-21,39-57@0.11.0``): stated so, the peak is 3.47 GiB lower and the start
    fits, as it served. Not stated, the planner keeps the sort (every 0.11.0 log in the collections) and calls it
    impossible, as vLLM 0.11.0's own check would then (``v1/core/kv_cache_utils.py`` lines 678-723 of 0.11.0 raise).
    The FP8 checkpoint at TP=4 moves the same way. gpustack's runs do not state it: GPUStack's vLLM 0.11.0 runner
    image installs FlashInfer 0.3.1 (gpustack/runner ``pack/cuda/Dockerfile`` at 01961f4), but so does the official
    vllm/vllm-openai:v0.11.0 image, whose llm-d starts profile at the sort's size (docs/accuracy.md).
    GPUStack's Qwen3-32B at 32,768 tokens on one H100 stays impossible by 0.01 GiB (7.99 of 8.00 GiB). Read after
    the refusals were seen."""
    from servetune.planner.modelinfo import load_model
    gpu = get_gpu("H100-80GB")

    def plan(name: str, flags: dict, fi: bool | None) -> memory.MemoryPlan:
        model = load_model(name)
        config = resolve_engine_config(flags, model, gpu, "0.11.0")
        return memory.plan_memory(model, gpu, dataclasses.replace(config, flashinfer_available=fi), env=_env("default"))

    sort, flashinfer = (plan("qwen3-235b-a22b-2507", {"tensor_parallel_size": 8}, fi) for fi in (None, True))
    assert sort.failure is not None and sort.failure.value == "kv_too_small"
    assert round(sort.memory.activation_peak, 2) == 6.65
    assert flashinfer.fits and flashinfer.kv_cache_tokens == 274960
    assert round(sort.memory.activation_peak - flashinfer.memory.activation_peak, 2) == 3.47
    assert plan("qwen3-235b-a22b-2507-fp8", {"tensor_parallel_size": 4}, True).fits
    assert not plan("qwen3-235b-a22b-2507-fp8", {"tensor_parallel_size": 4}, None).fits
    dense = plan("qwen3-32b", {"max_model_len": 32768}, True)
    assert dense.failure is not None and dense.failure.value == "kv_too_small"
    assert 7.98 < dense.memory.kv_cache < 8.0
