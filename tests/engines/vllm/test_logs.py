"""vllm_logs: figures parsed from the 8 real H200 runs and the 3 example logs (vLLM 0.26.0), from logs
constructed from vLLM's source strings for the formats we have no real log of, and the classification
of every ending: ok, startup_oom, kv_too_small, cudagraph_oom, runtime_oom, crashed, timeout, invalid_config."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest

from servetune.result import TrialStatus
from servetune.engines.vllm.logs import LOG_LINE_RE, classify, parse_log, parse_number

FIXTURES = Path(__file__).parents[2] / "fixtures"
REAL = FIXTURES / "real_h200"
LOGS = FIXTURES / "logs"


def _read(path: Path) -> str:
    # newline="" keeps tqdm's "\r", as the CLI reads it, so line numbers match `grep -n`.
    with open(path, encoding="utf-8", newline="") as fh:
        return fh.read()


# Expected figures, copied from `grep` on each real log (vLLM 0.26.0, one H200 unless TP=2):
# (run, kv_tokens, concurrency, max_model_len, available_kv, weights, act_peak, non_torch, cudagraph,
#  torch_compile_s, engine_init_s, graph_capture_s, weights_load_s, num_gpu_blocks, override)
REAL_RUNS = [
    ("a1_u05_s64/server.log", 2216528, 270.57, 8192, 67.64, 1.59, 0.44, 0.22, 0.15, 13.89, 31.01, 1.0, 0.25, 138533, None),
    ("a2_u05_s256/server.log", 2216528, 270.57, 8192, 67.64, 1.59, 0.44, 0.22, 0.36, 12.28, 29.70, 2.0, 0.23, 138533, None),
    ("a3_preempt_blocks4096_s128/server.log", 65536, 32.0, 2048, 67.64, 1.59, 0.44, 0.22, 0.21, 18.95, 39.71, 2.0, 0.29,
     4096, 4096),
    ("b1_eager_s64/server.log", 2218448, 270.81, 8192, 67.7, 1.59, 0.38, 0.22, 0.0, None, 17.01, None, 0.31, 138653, None),
    ("b2_s256_mbt2048/server.log", 2225168, 271.63, 8192, 67.91, 1.59, 0.18, 0.22, 0.36, 14.09, 34.93, 3.0, 0.23, 139073,
     None),
    ("b3_preempt_blocks1024_s64/server.log", 16384, 8.0, 2048, 67.64, 1.59, 0.44, 0.22, 0.15, 15.51, 34.11, 1.0, 0.29,
     1024, 1024),
    ("b4_rate_s128/server.log", 2216528, 270.57, 8192, 67.64, 1.59, 0.44, 0.22, 0.21, 14.68, 35.42, 2.0, 0.23, 138533, None),
    ("examples/server1.log", 2216528, 270.57, 8192, 67.64, 1.59, 0.44, 0.22, 0.15, 14.36, 32.38, 1.0, 0.30, 138533, None),
    ("examples/server2.log", 2048, 1.0, 2048, 67.64, 1.59, 0.44, 0.22, 0.15, 14.25, 31.46, 1.0, 0.27, 128, 128),
    ("examples/server_tp2.log", 4503984, 549.80, 8192, 68.73, 0.81, 0.30, 0.06, 0.16, 24.00, 49.76, 2.0, 0.25, 281499,
     None),
]


@pytest.mark.parametrize("row", REAL_RUNS, ids=[r[0].split("/")[0] for r in REAL_RUNS])
def test_real_healthy_logs_parse_to_the_grepped_figures(row):
    (name, tokens, conc, max_len, avail, weights, act, non_torch, cg, compile_s, init_s, capture_s, load_s, blocks,
     override) = row
    text = _read(REAL / name)
    p = parse_log(text)
    assert p.vllm_version == "0.26.0"
    assert (p.kv_cache_tokens, p.max_concurrency, p.max_concurrency_tokens) == (tokens, conc, max_len)
    assert p.max_model_len == max_len
    assert (p.available_kv_gib, p.weights_gib, p.activation_peak_gib, p.non_torch_gib, p.cudagraph_gib) == (
        avail, weights, act, non_torch, cg)
    assert (p.torch_compile_s, p.engine_init_s, p.graph_capture_s, p.weights_load_s) == (compile_s, init_s, capture_s,
                                                                                          load_s)
    assert p.num_gpu_blocks == blocks and p.num_gpu_blocks_override == override
    # Printed by the override line, else derived from the KV tokens (block 16); 138,533 is what vLLM
    # printed as "Overriding num_gpu_blocks=138533" for the same budget.
    assert p.num_gpu_blocks_derived is (override is None)
    assert p.server_ready and p.requested_gib == 69.9 and p.total_gpu_gib == 139.8 and p.gpu_memory_utilization == 0.5
    assert p.non_default_args is not None and p.non_default_args["gpu_memory_utilization"] == 0.5
    c = classify(text, healthy=True)
    assert (c.status, c.cause, c.infrastructure) == (TrialStatus.OK, None, False)


def test_override_keeps_the_computed_block_count():
    p = parse_log(_read(REAL / "a3_preempt_blocks4096_s128/server.log"))
    assert (p.num_gpu_blocks, p.computed_gpu_blocks, p.num_gpu_blocks_override) == (4096, 138533, 4096)
    assert p.stats_kv_usage_peak == pytest.approx(0.989) and p.stats_waiting_peak == 75


def test_the_cuda_graph_profilers_own_override_is_not_the_users():
    """vLLM 0.19+ profiles CUDA-graph memory on a minimal KV cache and says so with an override line
    of its own ("Overriding num_gpu_blocks=0 with num_gpu_blocks_override=512", a published 0.19.1
    start, tests/fixtures/published_logs): the start had no override and 8,810 blocks (140,960 tokens)."""
    text = _read(FIXTURES / "published_logs" / "logs" / "tokenkaki_qwen3_8b_tp1_a100_40gb.log")
    p = parse_log(text)
    assert (p.num_gpu_blocks_override, p.computed_gpu_blocks) == (None, None)
    assert (p.num_gpu_blocks, p.num_gpu_blocks_derived, p.kv_cache_tokens) == (8810, True, 140960)
    # The user's override, with the profiler's line before it: the user's (computed > 0) is the one.
    user = "INFO 06-25 17:21:58 [kv_cache_utils.py:829] Overriding num_gpu_blocks=8810 with num_gpu_blocks_override=64\n"
    asked = text.replace("'served_model_name': ['Qwen/Qwen3-8B']}", "'served_model_name': ['Qwen/Qwen3-8B'], "
                         "'num_gpu_blocks_override': 64}") + user
    q = parse_log(asked)
    assert (q.num_gpu_blocks, q.computed_gpu_blocks, q.num_gpu_blocks_override) == (64, 8810, 64)
    # Without the args line, a computed 0 alone is still the profiler's.
    bare = "\n".join(line for line in text.splitlines() if "non-default args" not in line)
    assert parse_log(bare).num_gpu_blocks_override is None


def test_chunked_prefill_line_absent_falls_back_to_the_given_flag():
    p = parse_log(_read(REAL / "b2_s256_mbt2048/server.log"))  # vLLM prints the line only for its own default
    assert p.max_num_batched_tokens == 2048 and p.max_cudagraph_capture_size == 512
    assert p.num_cudagraph_capture_sizes == 51


def test_tp2_keeps_one_entry_per_worker():
    p = parse_log(_read(REAL / "examples/server_tp2.log"))
    assert set(p.workers) == {"Worker_TP0", "Worker_TP1"}
    tp0, tp1 = p.workers["Worker_TP0"], p.workers["Worker_TP1"]
    assert (tp0.model_load_s, tp1.model_load_s) == (2.392703, 2.324487)
    assert tp0.available_kv_gib == 68.73 and tp1.available_kv_gib is None  # only rank 0 prints it
    assert tp1.cudagraph_gib == 0.16 and tp1.activation_peak_gib == 0.3 and tp1.free_at_start_gib == 138.34
    assert p.tensor_parallel_size == 2 and p.free_at_start_gib == 138.34
    assert p.model_load_s == 2.392703  # the slower worker


def test_enforce_eager_run_has_no_compile_or_capture():
    p = parse_log(_read(REAL / "b1_eager_s64/server.log"))
    assert p.enforce_eager is True and p.torch_compile_s is None and p.graph_capture_s is None
    assert p.engine_compile_s is None and p.cudagraph_gib == 0.0


def test_engine_dead_error_after_our_sigterm_is_not_a_crash():
    # b1 ends in "EngineDeadError: EngineCore encountered an issue" printed after "[shutdown] ... SIGTERM".
    text = _read(REAL / "b1_eager_s64/server.log")
    assert "EngineDeadError" in text
    assert classify(text, healthy=True).status is TrialStatus.OK
    assert classify(text, healthy=False, exit_code=0).status is TrialStatus.OK


def test_real_startup_failure_util_0012():
    text = _read(REAL / "b5_fail_u0012/server.log")
    p = parse_log(text)
    assert p.available_kv_gib == -0.52 and p.weights_gib == 1.59 and not p.server_ready
    assert p.kv_cache_tokens is None and p.gpu_memory_utilization == 0.012 and p.enforce_eager is True
    c = classify(text, exit_code=1)
    assert c.status is TrialStatus.STARTUP_OOM and not c.infrastructure
    assert c.cause is not None and c.cause.startswith("No available memory for the cache blocks")
    assert c.evidence[0] == "35: Available KV cache memory: -0.52 GiB"
    assert c.evidence[-1].startswith("53: ValueError: No available memory for the cache blocks")
    assert any("in _check_enough_kv_cache_memory" in e for e in c.evidence)
    assert all(len(e) <= 310 for e in c.evidence)


# ------------------------------------------------------------- constructed logs (vLLM's source strings)
def test_v0_format():
    p = parse_log(_read(LOGS / "v0_6_healthy.log"))
    assert p.vllm_version == "0.6.6" and p.max_model_len == 8192
    assert (p.weights_gib, p.non_torch_gib, p.activation_peak_gib, p.available_kv_gib) == (14.9888, 0.26, 1.23, 54.82)
    assert (p.total_gpu_gib, p.gpu_memory_utilization, p.requested_gib) == (79.22, 0.9, 71.3)
    assert p.memory_profiling_s == 3.87 and (p.num_gpu_blocks, p.num_cpu_blocks) == (28067, 2048)
    assert not p.num_gpu_blocks_derived and p.kv_cache_tokens is None  # V0 prints blocks, not tokens
    assert (p.max_concurrency, p.max_concurrency_tokens) == (54.82, 8192)
    assert (p.graph_capture_s, p.graph_capture_gib) == (12.0, 0.35) and p.stats_preemptions == 1
    assert p.server_ready and classify(_read(LOGS / "v0_6_healthy.log"), healthy=True).status is TrialStatus.OK


def test_v0_old_gpu_blocks_wording():
    p = parse_log("INFO 05-01 10:00:00 gpu_executor.py:122] # GPU blocks: 2048, # CPU blocks: 512")
    assert (p.num_gpu_blocks, p.num_cpu_blocks) == (2048, 512)


def test_v0_11_two_line_kv_format():
    p = parse_log(_read(LOGS / "v0_11_healthy.log"))
    assert p.vllm_version == "0.11.0" and p.max_model_len == 16384 and p.max_num_batched_tokens == 2048
    assert (p.kv_cache_tokens, p.max_concurrency, p.max_concurrency_tokens) == (373904, 22.82, 16384)
    assert p.num_gpu_blocks == 23369 and p.num_gpu_blocks_derived  # 373,904 / 16 (≤0.20: tokens = blocks x 16)
    assert (p.weights_gib, p.model_load_s, p.weights_load_s) == (15.2683, 4.018554, 3.12)
    assert (p.torch_compile_s, p.engine_init_s, p.engine_compile_s) == (28.11, 38.2, None)  # "takes", "seconds"
    assert p.max_cudagraph_capture_size == 512 and p.num_cudagraph_capture_sizes == 67  # JSON compilation_config
    assert set(p.workers) == {"EngineCore_DP0"}
    assert p.stats_kv_usage_peak == pytest.approx(0.123) and p.stats_running_peak == 48


def test_v0_29_merged_kv_line_and_consumed_wording_tp2():
    p = parse_log(_read(LOGS / "v0_29_tp2_healthy.log"))
    assert p.vllm_version == "0.29.0" and p.tensor_parallel_size == 2
    assert (p.kv_cache_tokens, p.max_concurrency, p.max_concurrency_tokens) == (997776, 30.45, 32768)
    assert p.num_gpu_blocks == 62361  # 30.45x of cdiv(32768, 16) = 2048 blocks per request
    # "8.1 GiB for consumed memory (weights + non-torch)" minus the 7.52 GiB of weights
    assert (p.weights_gib, p.non_torch_gib, p.activation_peak_gib, p.cudagraph_gib) == (7.52, 0.58, 1.42, 0.84)
    assert (p.cudagraph_estimate_gib, p.graph_capture_gib, p.graph_capture_s) == (0.84, 0.81, 6.0)
    assert (p.engine_init_s, p.engine_compile_s, p.torch_compile_s) == (58.31, 31.5, 31.5)
    assert set(p.workers) == {"Worker_TP0", "Worker_TP1"} and p.workers["Worker_TP1"].graph_capture_s == 5.0
    assert p.stats_preemptions == 5 and p.stats_waiting_peak == 40 and p.stats_kv_usage_peak == pytest.approx(0.99)


def test_v0_33_device_named_kv_line_and_kv_cache_memory_bytes():
    text = _read(LOGS / "v0_33_kvbytes_healthy.log")
    p = parse_log(text)
    assert p.vllm_version == "0.33.0" and p.max_model_len == 40960
    assert p.available_kv_gib == 40.0  # "reserved 40.0 GiB memory for KV Cache as specified by kv_cache_memory_bytes"
    assert (p.kv_cache_tokens, p.max_concurrency, p.num_gpu_blocks) == (291264, 7.11, 18204)
    assert p.non_default_args is not None and p.non_default_args["kv_cache_memory_bytes"] == 42949672960
    # 0.33 may name another device than "GPU" in front of "KV cache size".
    q = parse_log("(EngineCore pid=9) INFO 04-10 08:00:41 [kv_cache_planning.py:900] GPU + host KV cache size: "
                  "1,234,560 tokens, Maximum concurrency for 40,960 tokens per request: 30.14x")
    assert (q.kv_cache_tokens, q.max_concurrency) == (1234560, 30.14)


@pytest.mark.parametrize(("name", "exit_code", "status", "cause_part", "infra"), [
    ("oom_load.log", 1, TrialStatus.STARTUP_OOM, "while loading the weights: CUDA out of memory. Tried to allocate 1.75 GiB",
     False),
    ("oom_profile.log", 1, TrialStatus.STARTUP_OOM, "during the memory profiling run: CUDA out of memory. Tried to "
     "allocate 7.00 GiB", False),
    ("oom_capture.log", 1, TrialStatus.CUDAGRAPH_OOM, "during CUDA graph capture: CUDA out of memory", False),
    ("kv_too_small_v1.log", 1, TrialStatus.KV_TOO_SMALL, "the estimated maximum model length is 28672", False),
    ("kv_too_small_v0.log", 1, TrialStatus.KV_TOO_SMALL, "The model's max seq len (131072) is larger than the maximum "
     "number of tokens that can be stored in KV cache (28672)", False),
    ("free_memory_below_util.log", 1, TrialStatus.STARTUP_OOM, "infrastructure failure: another process holds GPU "
     "memory: Free memory on device cuda:0 (30.12/79.18 GiB)", True),
    ("crash_missing_module.log", 1, TrialStatus.CRASHED, "ModuleNotFoundError: No module named 'flashinfer'", False),
    ("unrecognized_arg.log", 2, TrialStatus.INVALID_CONFIG, "unrecognized arguments: --swap-space 4", False),
])
def test_constructed_failures(name, exit_code, status, cause_part, infra):
    text = _read(LOGS / name)
    assert text.startswith("# CONSTRUCTED, not captured")
    c = classify(text, exit_code=exit_code)
    assert c.status is status
    assert c.cause is not None and cause_part in c.cause
    assert c.infrastructure is infra
    assert c.evidence and all(len(e) <= 310 for e in c.evidence)
    assert not any("CONSTRUCTED" in e for e in c.evidence)  # comment lines are not evidence
    assert not parse_log(text).server_ready


def test_evidence_has_the_error_line_and_the_last_frames():
    c = classify(_read(LOGS / "oom_capture.log"), exit_code=1)
    assert c.evidence[0].startswith("14: Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  37%")
    assert "in capture_model" in c.evidence[1] and "in _capture_cudagraphs" in c.evidence[2]
    assert c.evidence[3].startswith("23: torch.OutOfMemoryError: CUDA out of memory")
    crash = classify(_read(LOGS / "crash_missing_module.log"), exit_code=1)
    assert "flashinfer.py\", line 12, in <module>" in crash.evidence[0]
    assert crash.evidence[-1].startswith("21: RuntimeError: Engine core initialization failed")


def test_kv_too_small_figures_are_parsed():
    p = parse_log(_read(LOGS / "kv_too_small_v1.log"))
    assert (p.max_model_len, p.kv_needed_gib, p.available_kv_gib, p.estimated_max_model_len) == (131072, 16.0, 3.5, 28672)
    old = ("(EngineCore_DP0 pid=5) ERROR 10-20 09:00:47 [core.py:708] ValueError: To serve at least one request with "
           "the models's max seq len (32768), (4.50 GiB KV cache is needed, which is larger than the available KV cache "
           "memory (2.25 GiB). Based on the available memory, the estimated maximum model length is 16384. Try "
           "increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
    c = classify(old, exit_code=1)  # 0.11's "models's" typo
    assert c.status is TrialStatus.KV_TOO_SMALL and parse_log(old).estimated_max_model_len == 16384


# ---------------------------------------------------------------------------- runtime and edge cases
_RUNTIME_OOM = """(EngineCore pid=657) ERROR 11-30 01:23:40 [core.py:1010] EngineCore encountered a fatal error.
(EngineCore pid=657) ERROR 11-30 01:23:40 [core.py:1010] Traceback (most recent call last):
(EngineCore pid=657) ERROR 11-30 01:23:40 [core.py:1010]   File "/tmp/site/vllm/v1/worker/gpu/model_runner.py", line 1040, in execute_model
(EngineCore pid=657) ERROR 11-30 01:23:40 [core.py:1010]     hidden_states = self.model(input_ids, positions)
(EngineCore pid=657) ERROR 11-30 01:23:40 [core.py:1010] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 1.10 GiB is free.
(APIServer pid=535) ERROR 11-30 01:23:40 [async_llm.py:704] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
"""


def _insert_after_ready(text: str, block: str) -> str:
    head, sep, tail = text.partition("INFO:     Application startup complete.\n")
    assert sep
    return head + sep + block + tail


def test_oom_after_the_server_was_healthy_is_runtime_oom():
    text = _insert_after_ready(_read(REAL / "a1_u05_s64/server.log"), _RUNTIME_OOM)
    c = classify(text, healthy=True)
    assert c.status is TrialStatus.RUNTIME_OOM and "while serving" in (c.cause or "")
    assert any("in execute_model" in e for e in c.evidence)


def test_other_engine_death_while_serving_is_a_crash_with_the_root_exception():
    block = _RUNTIME_OOM.replace("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                                 "total capacity of 139.80 GiB of which 1.10 GiB is free.",
                                 "torch.AcceleratorError: CUDA error: an illegal memory access was encountered")
    c = classify(_insert_after_ready(_read(REAL / "a1_u05_s64/server.log"), block), healthy=True)
    assert c.status is TrialStatus.CRASHED
    assert c.cause == "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"


def test_sampler_warmup_oom_is_cudagraph_oom():
    line = ("(EngineCore pid=3) ERROR 11-30 01:33:51 [core.py:1330] RuntimeError: CUDA out of memory occurred when "
            "warming up sampler with 1024 dummy requests. Please try lowering `max_num_seqs` or "
            "`gpu_memory_utilization` when initializing the engine.")
    c = classify(line, exit_code=1)
    assert c.status is TrialStatus.CUDAGRAPH_OOM
    assert c.cause == "CUDA out of memory occurred when warming up sampler with 1024 dummy requests."


@pytest.mark.parametrize(("message", "cause_part"), [
    ("ValueError: Total number of attention heads (32) must be divisible by tensor parallel size (3).", "(3)"),
    ("ValueError: max_num_batched_tokens (32) must be greater than or equal to max_num_seqs (64).", "max_num_seqs (64)"),
    ("ValueError: User-specified max_model_len (16384) is greater than the derived max_model_len "
     "(max_position_embeddings=8192 or model_max_length=None in model's config.json).", "(16384)"),
    ("pydantic_core._pydantic_core.ValidationError: 1 validation error for CacheConfig", "1 validation error"),
    ("vllm serve: error: argument --max-num-seqs: invalid int value: 'many'", "invalid int value"),
])
def test_invalid_config_messages(message, cause_part):
    text = ("(APIServer pid=1) INFO 11-30 01:21:48 [model.py:1788] Using max model len 8192\n"
            f"(APIServer pid=1) {message}\n(APIServer pid=1) gpu_memory_utilization\n"
            "(APIServer pid=1)   Input should be less than or equal to 1 [type=less_than_equal, input_value=1.5]\n")
    c = classify(text, exit_code=1)
    assert c.status is TrialStatus.INVALID_CONFIG and cause_part in (c.cause or "")
    if "validation error" in message:  # pydantic: the field and the reason are evidence too
        assert any("Input should be less than or equal to 1" in e for e in c.evidence)


def test_timeouts():
    text = _read(REAL / "a1_u05_s64/server.log")
    cut = text[: text.index("Available KV cache memory")]  # the log of a start that hung after loading
    c = classify(cut, timed_out=True)
    assert c.status is TrialStatus.TIMEOUT and "during the memory profiling run" in (c.cause or "") and c.evidence
    stalled = classify(text, healthy=True, timed_out=True)
    assert stalled.status is TrialStatus.TIMEOUT and (stalled.cause or "").startswith("stalled")
    # A fatal error in the log beats the timeout: it is why /health never answered.
    assert classify(_read(REAL / "b5_fail_u0012/server.log"), timed_out=True).status is TrialStatus.STARTUP_OOM


def test_deaths_without_an_exception():
    text = _read(REAL / "a1_u05_s64/server.log")
    cut = text[: text.index("Available KV cache memory")]
    killed = classify(cut, exit_code=-9)
    assert killed.status is TrialStatus.CRASHED and "SIGKILL" in (killed.cause or "")
    assert classify(cut, exit_code=1).cause == "the server exited with code 1 and printed no exception"
    # A log alone that stops with no error is not a crash: it may be cut short or still starting.
    unknown = classify(cut)
    assert unknown.status is TrialStatus.INCOMPLETE
    assert "log ends during the memory profiling run, before the server was ready" in (unknown.cause or "")
    assert classify(cut, exit_code=0).status is TrialStatus.CRASHED  # exited 0 without serving


def test_infrastructure_crashes():
    c = classify("(APIServer pid=1) OSError: [Errno 98] Address already in use", exit_code=1)
    assert c.status is TrialStatus.CRASHED and c.infrastructure and "port in use" in (c.cause or "")
    race = ("(EngineCore pid=2) AssertionError: Error in memory profiling. Initial free memory 70.1 GiB, current free "
            "memory 72.3 GiB. This happens when other processes sharing the same container release GPU memory while "
            "vLLM is profiling during initialization.")
    r = classify(race, exit_code=1)
    assert r.infrastructure and r.status is TrialStatus.CRASHED


def test_line_format_numbers_and_args():
    m = LOG_LINE_RE.match("(EngineCore pid=657) INFO 11-30 01:22:41 [gpu_worker.py:560] Available KV cache memory: 1 GiB")
    assert m and m.group("proc") == "EngineCore" and m.group("src") == "gpu_worker.py:560"
    assert LOG_LINE_RE.match("INFO 11-30 01:22:41 [gpu_worker.py:560] x").group("proc") is None
    assert (parse_number("2,216,528"), parse_number("-0.52"), parse_number("12.5")) == (2216528.0, -0.52, 12.5)
    p = parse_log("(APIServer pid=1) INFO 11-30 01:21:48 [api_utils.py:273] non-default args: {'model': 'm', "
                  "'compilation_config': CompilationConfig(mode=3)}")
    assert p.non_default_args is None  # not a literal: refused, never eval'd
    empty = parse_log("")
    assert empty.vllm_version is None and empty.workers == {} and not empty.server_ready


def test_metrics_dump_in_the_log_gives_the_block_count():
    text = _read(REAL / "examples/metrics2.txt")
    p = parse_log(text)
    assert p.num_gpu_blocks == 128 and p.block_size == 16 and not p.num_gpu_blocks_derived


def test_compile_cache_hit_and_miss_in_real_study_logs():
    """The real study's first start of a configuration compiled its graphs; the next start with the
    same compile key (same max_num_seqs, other gpu_memory_utilization) loaded them from the cache."""
    study = REAL / "study_memory_pair"
    cold = parse_log((study / "trial_0000.server.log").read_text())
    warm = parse_log((study / "trial_0001.server.log").read_text())
    assert cold.compile_cache_hit is False and warm.compile_cache_hit is True
    assert cold.torch_compile_s == pytest.approx(12.64) and warm.torch_compile_s == pytest.approx(3.47)
    eager = parse_log((REAL / "b1_eager_s64" / "server.log").read_text())
    assert eager.compile_cache_hit is None  # enforce_eager compiles nothing


def test_worker_memory_of_a_real_tp2_start_has_both_ranks():
    from servetune.engines.vllm.engine import worker_memory

    per_gpu = worker_memory(parse_log((REAL / "examples" / "server_tp2.log").read_text()))
    assert sorted(per_gpu) == ["TP0", "TP1"]
    for rank in ("TP0", "TP1"):
        assert per_gpu[rank]["weights"] == pytest.approx(0.81)
        assert per_gpu[rank]["activation_peak"] == pytest.approx(0.3)
    assert per_gpu["TP0"]["kv_cache"] == pytest.approx(68.73)


# A Mamba hybrid's GPU block count: the count vLLM printed, never one derived from its tokens.
def _hybrid_log(folder: str) -> str:
    return gzip.decompress((FIXTURES / "real_h100_classes" / folder / "server.log.gz").read_bytes()).decode()


@pytest.mark.parametrize(("folder", "blocks"), [("2026-12-06_ghtiny_pc_u09_s256_mbt8192", 14574),
                                                ("2026-12-06_nemh8b_u09_s256_mbt8192", 3426)])
def test_a_hybrids_block_count_is_the_one_vllm_printed(folder: str, blocks: int) -> None:
    # granite-4.0-h-tiny with prefix caching: 746,188 tokens span 160 blocks a request (16 attention + 9
    # Mamba groups x 16), so tokens / 16 would say 46,636; the API server's DEBUG line says 14,574.
    text = _hybrid_log(folder)
    assert f"num_gpu_blocks is: {blocks}" in text
    parsed = parse_log(text)
    assert parsed.num_gpu_blocks == blocks and not parsed.num_gpu_blocks_derived


def test_a_hybrids_block_count_is_never_derived_from_its_tokens() -> None:
    text = "\n".join(line for line in _hybrid_log("2026-12-06_ghtiny_pc_u09_s256_mbt8192").splitlines()
                     if "num_gpu_blocks is:" not in line)
    parsed = parse_log(text)
    assert parsed.kv_cache_tokens == 746188
    assert parsed.num_gpu_blocks is None and not parsed.num_gpu_blocks_derived


# ---------------------------------------------------------------- the GPU block count behind the logged tokens
# vLLM logs "GPU KV cache size: N tokens" as blocks // groups x block size up to 0.20.0 (kv_cache_utils.py:1080@0.11.0,
# :1302-1306@0.19.0) and as int(blocks / blocks-per-request x max_model_len) from 0.20.1 (:1699-1708@0.20.1,
# get_kv_cache_capacity :1819-1829@0.26.0, :1848-1858@0.28.0), blocks-per-request summed over every KV-cache
# group (get_max_concurrency_for_kv_cache_config :917-939@0.28.0). Only one full-attention group gives the count back.
CLASSES = FIXTURES / "real_h100_classes"
PUBLISHED = FIXTURES / "published_logs" / "logs"


def _gz(path: Path) -> str:
    return gzip.decompress(path.read_bytes()).decode()


def _cache_info_blocks(folder: str) -> int:
    """vLLM's own block count: the cache_config_info gauge of the start's first window."""
    metrics = _gz(sorted((CLASSES / folder).glob("*/metrics_before.txt.gz"))[0])
    return int(re.search(r'num_gpu_blocks="(\d+)"', metrics).group(1))


@pytest.mark.parametrize(("folder", "tokens", "per_request", "single_group_count"), [
    # gemma-2 (even layers slide, window 4,096): 2 groups of 512 + 513 blocks a request.
    ("2026-12-05_g2_u09_s128_mbt8192", 51182, 512 + 513, 3199),
    ("2026-12-05_g2_kvfp8_u09_s128_mbt8192", 102196, 512 + 513, 6387),
    # gemma-3 text (52 sliding layers of 1,024, 10 full): 1 full + 6 sliding groups, 512 + 6 x 513.
    ("2026-12-06_g3t_u09_s256_mbt8192", 32717, 512 + 6 * 513, 2045),
])
def test_a_sliding_window_models_block_count_is_not_derived_from_its_tokens(
        folder: str, tokens: int, per_request: int, single_group_count: int) -> None:
    """Real 0.26.0 starts on one H100 (2026-12-05/06, `--load-format dummy`): the count the parser used to
    derive (tokens x 512 / 8,192) was half or a seventh of vLLM's; it now says nothing, and /metrics tells."""
    parsed = parse_log(_gz(CLASSES / folder / "server.log.gz"))
    real = _cache_info_blocks(folder)
    assert parsed.kv_cache_tokens == tokens == int(real / per_request * 8192)  # vLLM's own figure, every group
    assert round(tokens * 512 / 8192) == single_group_count != real
    assert parsed.num_gpu_blocks is None and not parsed.num_gpu_blocks_derived
    assert parsed.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def test_gpt_oss_block_count_comes_from_the_printed_line_or_not_at_all() -> None:
    """gpt-oss-20b, 0.26.0 on one H100 (2026-12-06): 12 sliding (window 128) and 12 full layers, 2 groups."""
    printed = _gz(CLASSES / "2026-12-06_gptoss20_u097_nopc_default" / "server.log.gz")
    p = parse_log(printed)
    assert (p.num_gpu_blocks, p.num_gpu_blocks_derived, p.kv_cache_tokens) == (164094, False, 1311471)
    assert int(164094 / (512 + 513) * 8192) == 1311471  # tokens span both groups: not 164,094 x 16 / 2
    bare = parse_log("\n".join(line for line in printed.splitlines() if "num_gpu_blocks is:" not in line))
    assert bare.num_gpu_blocks is None and bare.kv_cache_tokens == 1311471
    # The start at 0.985, whose log prints no count: the parser derived 83,587 (tokens x 512 / 8,192).
    q = parse_log(_gz(CLASSES / "2026-12-06_gptoss20_u0985_nopc_default" / "server.log.gz"))
    assert q.kv_cache_tokens == 1337389 and round(1337389 * 512 / 8192) == 83587
    assert q.num_gpu_blocks is None and q.architecture == "GptOssForCausalLM"


@pytest.mark.parametrize("name", ["llmdplanner_gpt_oss_20b_tp2_h100.log", "llmdplanner_gemma2_9b_tp1_h100.log",
                                  "llmdplanner_gemma3_4b_tp1_h100.log", "llmdplanner_llama4_scout_tp4_h100.log",
                                  "dennislee22_gpt_oss_120b_tp4_a100.log", "parallelworks_gpt_oss_120b_tp2_h200.log"])
def test_published_sliding_and_chunked_starts_before_0_20_1_give_no_derived_count(name: str) -> None:
    """Up to 0.20.0 the tokens are blocks // groups x 16, and the concurrency blocks / (every group's blocks a
    request): the single-group count misses the logged concurrency, with or without the architecture line."""
    text = (PUBLISHED / name).read_text(encoding="utf-8")
    p = parse_log(text)
    assert p.kv_cache_tokens is not None and p.max_concurrency is not None and p.max_concurrency_tokens is not None
    one_group = p.kv_cache_tokens // 16
    assert f"{one_group / -(-p.max_concurrency_tokens // 16):.2f}" != f"{p.max_concurrency:.2f}"
    assert p.num_gpu_blocks is None and not p.num_gpu_blocks_derived
    nameless = parse_log("\n".join(line for line in text.splitlines() if "Resolved architecture" not in line))
    assert nameless.num_gpu_blocks is None


def test_gpt_oss_0_19_block_count_arithmetic() -> None:
    """llm-d's gpt-oss-20b at TP=2 on H100 (0.19.0): 2,591,776 tokens = 161,986 x 16 is half the pool; the
    concurrency 316.07 = blocks / (512 + 513) holds for 323,972 blocks, whose half is 161,986."""
    p = parse_log((PUBLISHED / "llmdplanner_gpt_oss_20b_tp2_h100.log").read_text(encoding="utf-8"))
    assert (p.kv_cache_tokens, p.max_concurrency) == (2591776, 316.07)
    assert 323972 // 2 * 16 == 2591776 and f"{323972 / 1025:.2f}" == "316.07"
    assert f"{161986 / 512:.2f}" == "316.38"  # what one group of 161,986 blocks would have printed


@pytest.mark.parametrize(("path", "blocks"), [
    (REAL / "a1_u05_s64/server.log", 138533),  # 0.26.0 H200, "Overriding num_gpu_blocks=138533" elsewhere
    (PUBLISHED / "llmdplanner_llama31_8b_tp1_h100.log", 29751),  # 0.19.0: 476,016 / 16
    (PUBLISHED / "llmdplanner_qwen25_7b_tp4_h100.log", 315205),
    (PUBLISHED / "llmlab_qwen25_15b_tp1_t4.log", 20294),  # 0.30.0
    (CLASSES / "2026-12-06_q3moe_u099_nopc_default/server.log.gz", 12252),
])
def test_dense_starts_keep_their_derived_count(path: Path, blocks: int) -> None:
    text = _gz(path) if path.suffix == ".gz" else path.read_text(encoding="utf-8")
    p = parse_log(text)
    assert (p.num_gpu_blocks, p.num_gpu_blocks_derived) == (blocks, True)


@pytest.mark.parametrize("folder", ["2026-12-06_q3moe_u098_nopc_default", "2026-12-06_q3moe_u0985_nopc_default"])
def test_the_derived_count_is_the_one_vllm_printed_for_a_dense_start(folder: str) -> None:
    """Qwen3-30B-A3B, 0.26.0 on one H100: the log prints its count; without that line, the parser's inversion
    of the tokens gives the same number."""
    text = _gz(CLASSES / folder / "server.log.gz")
    printed = parse_log(text)
    derived = parse_log("\n".join(line for line in text.splitlines() if "num_gpu_blocks is:" not in line))
    assert not printed.num_gpu_blocks_derived and derived.num_gpu_blocks_derived
    assert derived.num_gpu_blocks == printed.num_gpu_blocks is not None


_KV = "(EngineCore pid=7) INFO 05-01 10:00:00 [kv_cache_utils.py:1] "


def _kv_log(version: str, tokens: int, max_len: int, concurrency: float, *lines: str) -> str:
    return "\n".join([f"{_KV}Initializing a V1 LLM engine (v{version}) with config: model='m'", *lines,
                      f"{_KV}GPU KV cache size: {tokens:,} tokens",
                      f"{_KV}Maximum concurrency for {max_len:,} tokens per request: {concurrency:.2f}x"])


def test_from_0_20_1_the_tokens_are_concurrency_times_max_model_len() -> None:
    # 5,000 blocks, max_model_len 1,000 (cdiv(1000, 16) = 63 blocks a request): int(5000 / 63 * 1000) = 79,365.
    tokens = int(5000 / 63 * 1000)
    for version in ("0.20.1", "0.21.0", "0.24.0", "0.26.0"):
        assert parse_log(_kv_log(version, tokens, 1000, 5000 / 63)).num_gpu_blocks == 5000, version
    # 0.20.0 logs blocks x 16; 79,365 is no such figure, so no count.
    assert parse_log(_kv_log("0.20.0", tokens, 1000, 5000 / 63)).num_gpu_blocks is None
    assert parse_log(_kv_log("0.20.0", 80000, 1000, 5000 / 63)).num_gpu_blocks == 5000


def test_the_block_size_the_log_names_is_used() -> None:
    # A backend's own block (0.26.0 platforms/interface.py:636), the --block-size flag, a hybrid's raised block.
    backend = f"{_KV}Setting kv cache block size to 64 for FLASHMLA backend."
    p = parse_log(_kv_log("0.26.0", int(1000 / 128 * 8192), 8192, 1000 / 128, backend))
    assert (p.block_size, p.num_gpu_blocks, p.num_gpu_blocks_derived) == (64, 1000, True)
    old = f"{_KV}Forcing kv cache block size to 64 for FlashMLA backend."  # 0.11.0 platforms/cuda.py:167
    assert parse_log(_kv_log("0.11.0", 64000, 8192, 1000 / 128, old)).num_gpu_blocks == 1000
    flag = "(APIServer pid=1) INFO 05-01 10:00:00 [api_utils.py:1] non-default args: {'block_size': 32}"
    q = parse_log(_kv_log("0.26.0", int(1000 / 256 * 8192), 8192, 1000 / 256, flag))
    assert (q.block_size, q.num_gpu_blocks) == (32, 1000)
    assert parse_log(_kv_log("0.26.0", 32000, 8192, 2000 / 512)).num_gpu_blocks == 2000  # 16 by default
    assert parse_log(_kv_log("0.26.0", 32000, 8192, 1000 / 512)).num_gpu_blocks is None  # the figures disagree


def test_a_unified_hybrid_is_one_group_and_context_parallelism_is_not() -> None:
    gemma = "(EngineCore pid=7) INFO 05-01 10:00:00 [model.py:623] Resolved architecture: Gemma2ForCausalLM"
    tokens = int(3000 / 512 * 8192)
    assert parse_log(_kv_log("0.26.0", tokens, 8192, 3000 / 512, gemma)).num_gpu_blocks is None
    # --disable-hybrid-kv-cache-manager: vLLM turns every sliding layer into full attention, one group
    # (unify_hybrid_kv_cache_specs, kv_cache_utils.py:1445@0.26.0).
    unified = f"{_KV}Hybrid KV cache manager is disabled for this hybrid model, This means we do not enable any"
    assert parse_log(_kv_log("0.26.0", tokens, 8192, 3000 / 512, gemma, unified)).num_gpu_blocks == 3000
    dcp = "(APIServer pid=1) INFO 05-01 10:00:00 [api_utils.py:1] non-default args: {'decode_context_parallel_size': 2}"
    assert parse_log(_kv_log("0.26.0", tokens, 8192, 3000 / 512, dcp)).num_gpu_blocks is None
    multiplied = f"{_KV}Multiplying the GPU KV cache size by the dcp_world_size 2."  # kv_cache_utils.py:1084@0.11.0
    assert parse_log(_kv_log("0.11.0", 96000, 8192, 6000 / 512, multiplied)).num_gpu_blocks is None


def test_the_users_override_is_the_block_count_without_its_line() -> None:
    args = "(APIServer pid=1) INFO 05-01 10:00:00 [api_utils.py:1] non-default args: {'num_gpu_blocks_override': 64}"
    gpt = "(EngineCore pid=7) INFO 05-01 10:00:00 [model.py:623] Resolved architecture: GptOssForCausalLM"
    p = parse_log(_kv_log("0.26.0", int(64 / 1025 * 8192), 8192, 64 / 1025, args, gpt))
    assert (p.num_gpu_blocks, p.num_gpu_blocks_derived, p.num_gpu_blocks_override) == (64, False, 64)


def test_a_hybrids_raised_block_is_its_block_size() -> None:
    assert parse_log(_hybrid_log("2026-12-06_ghtiny_u09_s256_mbt8192")).block_size == 400
    assert parse_log(_hybrid_log("2026-12-06_nemh8b_u042_default")).block_size == 1040


def test_torch_compile_time_without_aot_compilation() -> None:
    """Without AOT compilation vLLM times compile and the first profiling run together
    (compilation/decorators.py:674@0.26.0); that is the compile time it reports on the init line."""
    log = ("(EngineCore pid=7) INFO 05-01 10:00:00 [monitor.py:53] torch.compile and initial profiling/warmup run "
           "together took 21.37 s in total\n"
           "(EngineCore pid=7) INFO 05-01 10:00:09 [core.py:341] init engine (profile, create kv cache, warmup model) "
           "took 40.12 s (compilation: 21.37 s)")
    p = parse_log(log)
    assert (p.torch_compile_s, p.engine_compile_s, p.engine_init_s) == (21.37, 21.37, 40.12)
    assert parse_log("INFO 05-01 10:00:00 [monitor.py:34] torch.compile takes 28.11 s in total").torch_compile_s == 28.11


def test_0_11_0_prints_each_workers_kv_size_and_the_smallest_binds() -> None:
    """0.11.0 logs the KV size of each worker before it takes the smallest block count over them
    (kv_cache_utils.py:1087-1092 and :1286@0.11.0): PP=2 with stages of unequal memory."""
    line = "(EngineCore_DP0 pid=9) INFO 10-15 12:00:05 [kv_cache_utils.py:{}] {}"
    log = "\n".join([
        "(EngineCore_DP0 pid=9) INFO 10-15 12:00:00 [core.py:77] Initializing a V1 LLM engine (v0.11.0) with config: x",
        line.format(1087, "GPU KV cache size: 480,000 tokens"),
        line.format(1091, "Maximum concurrency for 8,192 tokens per request: 58.59x"),
        line.format(1087, "GPU KV cache size: 400,000 tokens"),
        line.format(1091, "Maximum concurrency for 8,192 tokens per request: 48.83x")])
    p = parse_log(log)
    assert (p.kv_cache_tokens, p.max_concurrency, p.num_gpu_blocks) == (400000, 48.83, 25000)
