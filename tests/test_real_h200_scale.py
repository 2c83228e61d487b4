"""The user-scale real H200 runs (tests/fixtures/real_h200/scale): Llama-3.1-8B, Qwen2.5-14B, Mistral-Small-24B shapes.

vLLM 0.26.0, random weights, one H200 per host; 50 server starts, 177 measured windows (see the
folder's README): 5 starts of 2026-12-01 whose model folders carried a 32,000-token tokenizer, and
45 since (``*_fv_*``, ``*_dec``, ``2026-12-02a`` to ``2026-12-04h``, fourteen more hosts; the ``m24b_*`` starts
a Mistral-Small-24B shape; 14 windows of the ``2026-12-04d`` to ``2026-12-04g`` starts profiled by vLLM's torch
profiler) whose tokenizers cover the models' vocabularies; the simulator's fit and held-out hosts are ``benchmarks/_fidelity.py``'s.
None of these runs was used to fit the planner: its KV capacity here is held out.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from _fidelity import HOST_MODELS, SCALE_HOSTS, scale_host, scale_start, serving_flags  # the host's model folder -> the shipped config of that shape

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.engines.vllm.metrics import counter, parse_prometheus
from servetune.planner.modelinfo import load_model
from servetune.engines.vllm.logs import classify, parse_log

SCALE = Path(__file__).parent / "fixtures" / "real_h200" / "scale"
STARTS = sorted(p.parent.name for p in SCALE.glob("*/server.log.gz"))


def _start(name: str) -> tuple[dict, str]:
    d = SCALE / name
    return json.loads((d / "summary.json").read_text()), gzip.decompress((d / "server.log.gz").read_bytes()).decode()


def test_the_evidence_is_all_there() -> None:
    earlier_hosts = ["l8b_fv_u0185_s256_preempt", "l8b_fv_u09_s128_mbt16384", "l8b_fv_u09_s256_mbt8192",
                     "l8b_fv_u09_s256_mbt8192_dec", "l8b_u09_s256_fp8kv", "l8b_u09_s256_mbt2048", "l8b_u09_s256_mbt8192",
                     "q14b_fv_u09_s128_eager", "q14b_fv_u09_s256_mbt16384", "q14b_fv_u09_s256_mbt8192",
                     "q14b_u09_s128_eager", "q14b_u09_s256_mbt8192"]
    assert STARTS == sorted(earlier_hosts + ["2026-12-02a_l8b_u09_s128_mbt2048", "2026-12-02a_l8b_u09_s256_mbt8192",
                                      "2026-12-02a_q14b_u09_s128_mbt2048", "2026-12-02a_q14b_u09_s256_mbt8192",
                                      "2026-12-02b_l8b_u09_s256_mbt8192", "2026-12-02b_q14b_u09_s256_mbt8192",
                                      "2026-12-03a_l8b_u09_s256_mbt8192", "2026-12-03a_q14b_u09_s256_mbt8192",
                                      "2026-12-03a_l8b_u09_s256_fp8kv", "2026-12-03a_q14b_u09_s128_mbt2048",
                                      "2026-12-03b_l8b_u09_s256_mbt8192", "2026-12-03b_l8b_u09_s256_fp8kv", "2026-12-03b_l8b_u09_s256_mbt8192_b",
                                      "2026-12-03b_q14b_u09_s256_fp8kv", "2026-12-03b_q14b_u09_s256_mbt8192",
                                      "2026-12-03b_q14b_u09_s256_mbt8192_b",
                                      "2026-12-03c_l8b_u09_s256_mbt8192", "2026-12-03c_q14b_u09_s256_mbt8192",
                                      "2026-12-04a_l8b_u09_s256_mbt8192",
                                      "2026-12-04b_m24b_u09_s256_mbt8192", "2026-12-04c_m24b_u09_s128_mbt2048",
                                      "2026-12-04c_m24b_u09_s256_fp8kv", "2026-12-04c_m24b_u09_s256_mbt8192",
                                      "2026-12-04d_m24b_u09_s256_mbt8192", "2026-12-04e_q14b_u09_s256_mbt8192",
                                      "2026-12-04e_l8b_u09_s256_mbt8192", "2026-12-04e_l8b_u09_s256_mbt2048",
                                      "2026-12-04e_l8b_u09_s256_eager",
                                      "2026-12-04f_l8b_u09_s256_mbt2048", "2026-12-04f_l8b_u09_s160_mbt4096",
                                      "2026-12-04g_m24b_u09_s256_mbt4096", "2026-12-04g_m24b_u09_s128_eager",
                                      "2026-12-04h_m24b_u09_s128_eager", "2026-12-04h_m24b_u09_s256_mbt8192",
                                      "2026-12-04h_l8b_u09_s256_eager", "2026-12-04h_l8b_u09_s256_mbt8192",
                                      "2026-12-04h_l8b_u09_s256_mbt2048_eager", "2026-12-04h_l8b_u09_s64_mbt8192"])
    assert set(json.loads((SCALE / "tokenizers.json").read_text())["tokenizer_vocab"]) == set(STARTS)
    windows = sorted(SCALE.glob("*/*/summary.json"))
    assert len(windows) == 177
    for w in windows:
        s = json.loads(w.read_text())
        assert s["completed"] == s["workload"]["num_requests"] and not s.get("error"), w
        # A profiled window keeps its worker trace's engine steps beside its figures (steps.json.gz,
        # trace_steps.py --window reduced the raw trace to it).
        assert s.get("profiled", False) is (w.parent / "steps.json.gz").exists(), w
    assert sum(json.loads(w.read_text()).get("profiled", False) for w in windows) == 14


def _first_log_time(start: str) -> str:
    """The first ``MM-DD HH:MM:SS`` stamp of a start's server log (vLLM logs the host's clock, UTC)."""
    match = re.search(r"\b(\d\d-\d\d \d\d:\d\d:\d\d)\b", _start(start)[1])
    assert match, start
    return match.group(1)


def test_each_host_key_is_its_date_and_its_folders_carry_one_name() -> None:
    """_fidelity.SCALE_HOSTS: a host's key is the UTC date of its first server start and a letter in
    start order within that date; its folders lead with the key, none carries the old tag, and the
    folder README's table gives both."""
    readme = (SCALE / "README.md").read_text()
    firsts = {}
    for host, tag in SCALE_HOSTS.items():
        starts = [s for s in STARTS if scale_host(s) == host]
        assert starts and all(s.startswith(f"{host}_") for s in starts), (host, starts)
        # no folder, collect output or plan beside them carries the old tag (l8b_h7_*, collect_h7a.txt, plan_h7_l8b.json)
        assert not [p.name for p in SCALE.iterdir() if re.search(rf"(?<![0-9a-z]){tag}(?![0-9])", p.name)], (host, tag)
        assert scale_host(scale_start(host, "l8b_u09_s256_mbt8192")) == host
        firsts[host] = min(_first_log_time(s) for s in starts)
        assert firsts[host][:5] == host[5:10], (host, firsts[host])
        row = f"| `{tag}` | `{host}` | {host[:10]} {firsts[host][6:11]} |"
        assert row in readme and f"`{host}_*`" in readme.split(row)[1].split("\n")[0]
    for day in {h[:10] for h in SCALE_HOSTS}:
        keyed = sorted(h for h in SCALE_HOSTS if h.startswith(day))
        assert [h[-1] for h in keyed] == list("abcdefgh"[:len(keyed)])
        assert sorted(keyed, key=firsts.__getitem__) == keyed  # letters in start order
    assert [scale_host(s) for s in STARTS if scale_host(s) is None] == [None] * 12  # the untagged starts


@pytest.mark.parametrize("name", STARTS)
def test_logs_parse_and_classify_as_served(name: str) -> None:
    summary, text = _start(name)
    parsed = parse_log(text)
    assert parsed.vllm_version == "0.26.0" and parsed.server_ready
    assert parsed.kv_cache_tokens and parsed.kv_cache_tokens > (50_000 if "u0185" in name else 500_000)
    assert parsed.enforce_eager is bool(summary["flags"].get("enforce_eager", False))
    assert classify(text).status.value == "ok"


@pytest.mark.parametrize("name", STARTS)
def test_planner_kv_capacity_within_one_percent(name: str) -> None:
    summary, text = _start(name)
    logged = parse_log(text).kv_cache_tokens
    model, gpu = load_model(HOST_MODELS[summary["model"]]), get_gpu("H200")
    config = resolve_engine_config(serving_flags(summary["flags"]), model, gpu)
    # The log says whether the start found its kernels compiled (the kernel caches of the host):
    # the plan takes the same verdict, as the pre-screen does from the study's earlier trials.
    warm = bool(parse_log(text).compile_cache_hit)
    plan = plan_memory(model, gpu, config, compile_cache_warm=warm)
    assert plan.fits
    assert plan.kv_cache_tokens == pytest.approx(logged, rel=0.01), (plan.kv_cache_tokens, logged)


def test_fp8_kv_cache_doubles_the_tokens_at_the_same_budget() -> None:
    auto = parse_log(_start("l8b_u09_s256_mbt8192")[1]).kv_cache_tokens
    fp8 = parse_log(_start("l8b_u09_s256_fp8kv")[1]).kv_cache_tokens
    assert fp8 == pytest.approx(2 * auto, rel=0.005)


def test_the_covering_tokenizer_is_what_made_the_prefill_heavy_windows_fast() -> None:
    # The same flags, the same first window (seed 0, a fresh server, no prefix hits), on the same
    # GPU type: only the tokenizer in the model folder differs (tokenizers.json).
    def first(start: str) -> float:
        return json.loads((SCALE / start / "p1024_o256_c128" / "summary.json").read_text())["output_throughput"]

    assert first("l8b_fv_u09_s256_mbt8192") / first("l8b_u09_s256_mbt8192") > 1.6  # 5,622 vs 3,216 tok/s
    assert first("q14b_fv_u09_s256_mbt8192") / first("q14b_u09_s256_mbt8192") > 1.5  # 3,223 vs 1,986
    # With a covering tokenizer CUDA graphs beat eager at 14B, as they should (the short tokenizer
    # had eager ahead: the API server, not the GPU, set the pace).
    assert first("q14b_fv_u09_s256_mbt8192") > 1.2 * first("q14b_fv_u09_s128_eager")


def _window_delta(w: Path, metric: str) -> float:
    """A counter's growth over one window: its /metrics dump after, less the one before."""
    def read(dump: str) -> float:
        return counter(parse_prometheus(gzip.decompress((w / f"{dump}.txt.gz").read_bytes()).decode()), metric) or 0.0

    return read("metrics_after") - read("metrics_before")


def _measured(start: str) -> list[str]:
    """The start's windows in the order they ran, less those its plan's deadline skipped."""
    windows = json.loads((SCALE / start / "summary.json").read_text())["windows"]
    return [name for name, w in windows.items() if not w.get("skipped")]


def test_the_preempting_start_preempted_and_the_others_did_not() -> None:
    for start in STARTS:
        for name in _measured(start):
            preempted = _window_delta(SCALE / start / name, "vllm:num_preemptions_total")
            # gpu_memory_utilization 0.185 leaves 79,936 KV tokens for 128 sequences of 1,280.
            assert (preempted > 0) is ("u0185" in start), (start, name, preempted)


def test_no_window_preempted_and_the_prefix_cache_saw_what_was_sent() -> None:
    for start in STARTS:
        if "u0185" in start:
            continue  # the preempting start: the test above
        for k, name in enumerate(_measured(start)):
            w = SCALE / start / name
            assert _window_delta(w, "vllm:num_preemptions_total") == 0, w  # gpu_memory_utilization 0.9: all fit
            hit = (_window_delta(w, "vllm:prefix_cache_hits_total")
                   / _window_delta(w, "vllm:prefix_cache_queries_total"))
            if name.startswith("prefix768"):
                # 768 of 1024 prompt tokens shared within 8 groups: three quarters hit.
                assert 0.74 < hit < 0.76, (w, hit)
            elif k == 0 or "_fv_" in start or scale_host(start) == "2026-12-02a":
                # A fresh server has nothing to hit; the *_fv_* and 2026-12-02a plans seeded each window apart.
                assert hit < 0.01, (w, hit)
            else:
                # Later windows of a start re-sent earlier windows' prompts (same seed, see the
                # fixtures' README): at most every block but a prompt's last.
                assert hit < 0.985, (w, hit)
