"""servetune.sim.vllm_log: the rendered lines parse like vLLM's and reproduce the real H200 logs.

The real logs are vLLM 0.26.0 on an H200 with the test model (tests/fixtures/real_h200, its
examples/server1.log among them); the figures in them are compared line for line with what
the stand-in prints for the same flags, via the real planner (servetune.planner.memory.plan_memory).
"""

from __future__ import annotations

import ast
import datetime
import re
from pathlib import Path

import pytest

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.sim import vllm_log
from servetune.sim.vllm_log import LogRecord, format_record, startup_script

# The shapes of vLLM 0.26's own lines (tests/fixtures/real_h200 matches them): every
# line the stand-in renders is checked against them, and the product's parser (engines/vllm/logs) reads
# the same text. They live here, not in the package: the package has one set of log-line patterns.
LOG_LINE_RE = re.compile(
    r"^(?:\((?P<proc>\S+) pid=(?P<pid>\d+)\) )?(?P<lvl>[A-Z]+) (?P<ts>\d\d-\d\d \d\d:\d\d:\d\d) "
    r"\[(?P<src>[^\]]+)\] (?P<msg>.*)$")
KV_TOKENS_RE = re.compile(r"KV cache size: ([\d,]+) tokens")
MAX_CONCURRENCY_RE = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
AVAILABLE_KV_RE = re.compile(r"Available KV cache memory: (-?[\d.]+) GiB")
MODEL_LOADING_RE = re.compile(r"Model loading took (-?[\d.]+) GiB(?: memory)? and ([\d.]+) seconds")
INIT_ENGINE_RE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) (?:seconds|s)")
FREE_MEMORY_RE = re.compile(
    r"Free memory on device \((-?[\d.]+)/(-?[\d.]+) GiB\) on startup\. Desired GPU memory utilization is "
    r"\(([\d.]+), (-?[\d.]+) GiB\)\. Actual usage is (-?[\d.]+) GiB for weight, (-?[\d.]+) GiB for peak "
    r"activation, (-?[\d.]+) GiB for non-torch memory, and (-?[\d.]+) GiB for CUDAGraph memory\.")
STATS_RE = re.compile(
    r"Engine (\d+): Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
    r"Running: (\d+) reqs, Waiting: (\d+) reqs, GPU KV cache usage: ([\d.]+)%, Prefix cache hit rate: ([\d.]+)%")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real_h200"
SERVER1 = FIXTURES / "examples" / "server1.log"
WHEN = datetime.datetime(2025, 11, 30, 0, 22, 4)
PIDS = {"APIServer": 1742, "EngineCore": 1918}


def _script(flags: dict, **kw):
    model, gpu = load_model("servetune-test-850m"), get_gpu("H200")
    config = resolve_engine_config(flags, model, gpu, kw.pop("version", "0.26.0"))
    plan = plan_memory(model, gpu, config)
    args = dict(model_ref="/root/model", served_model_name="/root/model", host="127.0.0.1", port=8011,
                given_flags=flags, api_pid=1742)
    args.update(kw)
    return startup_script(model, gpu, config, plan, **args), plan, config


def _lines(script) -> list[str]:
    pids = {**PIDS, "Worker_TP0": 1346, "Worker_TP1": 1347}
    return [format_record(r, pids, WHEN) for r in script.before_listen + script.after_listen]


def _messages(lines: list[str]) -> list[str]:
    return [m.group("msg") for m in map(LOG_LINE_RE.match, lines) if m]


def _real_messages(path: Path) -> list[str]:
    return _messages(path.read_text(errors="replace").splitlines())


def _one(messages: list[str], needle: str) -> str:
    found = [m for m in messages if needle in m]
    assert found, f"no line containing {needle!r}"
    return found[0]


def test_format_record_matches_vllm_line_shape() -> None:
    rec = LogRecord(0.0, "EngineCore", "INFO", "kv_cache_utils.py:2177", "GPU KV cache size: 2,216,528 tokens")
    line = format_record(rec, PIDS, WHEN)
    assert line == "(EngineCore pid=1918) INFO 11-30 00:22:04 [kv_cache_utils.py:2177] GPU KV cache size: 2,216,528 tokens"
    m = LOG_LINE_RE.match(line)
    assert m and m.group("proc") == "EngineCore" and m.group("pid") == "1918" and m.group("lvl") == "INFO"
    raw = format_record(LogRecord(0.0, "APIServer", "", "", "INFO:     Application startup complete."), PIDS, WHEN)
    assert raw == "(APIServer pid=1742) INFO:     Application startup complete."
    assert vllm_log.format_gib(3.0) == "3.0" and vllm_log.format_gib(-0.5205) == "-0.52"
    assert vllm_log.format_gib(67.64344) == "67.64"


def test_every_line_has_vllm_shape_and_the_parsers_recover_the_plan() -> None:
    script, plan, config = _script({"gpu_memory_utilization": 0.5, "max_num_seqs": 64})
    lines = _lines(script)
    assert script.healthy and script.exit_code is None
    for line in lines:  # timestamped lines parse; raw ones (tqdm, uvicorn) carry the process prefix
        assert LOG_LINE_RE.match(line) or re.match(r"^\((APIServer|EngineCore) pid=\d+\) ", line), line
    text = "\n".join(lines)
    assert int(KV_TOKENS_RE.search(text).group(1).replace(",", "")) == plan.kv_cache_tokens
    conc = MAX_CONCURRENCY_RE.search(text)
    assert int(conc.group(1).replace(",", "")) == config.max_model_len
    assert float(conc.group(2)) == pytest.approx(plan.max_concurrency, abs=0.005)
    assert float(AVAILABLE_KV_RE.search(text).group(1)) == pytest.approx(plan.memory.kv_cache, abs=0.005)
    assert float(MODEL_LOADING_RE.search(text).group(1)) == pytest.approx(plan.memory.weights, abs=0.005)
    free = FREE_MEMORY_RE.search(text)
    assert [float(x) for x in free.groups()[4:]] == pytest.approx(
        [plan.memory.weights, plan.memory.activation_peak, plan.memory.non_torch, plan.memory.cudagraph], abs=0.005)
    assert INIT_ENGINE_RE.search(text)
    assert lines[-1].endswith("INFO:     Application startup complete.")
    assert "Starting vLLM server on http://127.0.0.1:8011" in text
    # The records are in time order and span the planner's launch-to-healthy time.
    times = [r.at_s for r in script.before_listen + script.after_listen]
    assert times == sorted(times) and times[-1] == pytest.approx(plan.startup_s)


@pytest.mark.parametrize("run, flags", [
    ("server1", {"gpu_memory_utilization": 0.5, "max_num_seqs": 64}),
    ("b1_eager_s64", {"enforce_eager": True, "gpu_memory_utilization": 0.5, "max_num_seqs": 64}),
    ("a3_preempt_blocks4096_s128", {"max_model_len": 2048, "gpu_memory_utilization": 0.5,
                                    "num_gpu_blocks_override": 4096, "max_num_seqs": 128}),
    ("b2_s256_mbt2048", {"gpu_memory_utilization": 0.5, "max_num_batched_tokens": 2048, "max_num_seqs": 256}),
])
def test_reproduces_the_real_h200_log_figures(run: str, flags: dict) -> None:
    path = SERVER1 if run == "server1" else FIXTURES / run / "server.log"
    real = _real_messages(path)
    port = 8000 if run == "server1" else 8011
    script, _, _ = _script(flags, port=port)
    ours = _messages(_lines(script))
    # Identical lines: what a parser reads for KV capacity, lengths and the memory breakdown.
    for needle in ("GPU KV cache size:", "Maximum concurrency for", "Available KV cache memory:",
                   "Using max model len", "Chunked prefill is enabled", "Resolved architecture",
                   "Overriding num_gpu_blocks"):
        if any(needle in m for m in real):
            assert _one(ours, needle) == _one(real, needle)
        else:
            assert not any(needle in m for m in ours), needle
    assert _one(ours, "Model loading took").split(" and ")[0] == _one(real, "Model loading took").split(" and ")[0]
    assert ast.literal_eval(_one(ours, "non-default args:").split(": ", 1)[1]) == \
        ast.literal_eval(_one(real, "non-default args:").split(": ", 1)[1])
    real_free, our_free = _one(real, "Free memory on device"), _one(ours, "Free memory on device")
    # The breakdown agrees to the printed digit (0.01 GiB: the planner's activation fit is within it).
    assert [float(x) for x in FREE_MEMORY_RE.search(our_free).groups()] == pytest.approx(
        [float(x) for x in FREE_MEMORY_RE.search(real_free).groups()], abs=0.011)
    # The --kv-cache-memory suggestions agree to the GiB figure's last digit (the inputs are rounded).
    gib = re.compile(r"\(([\d.]+) GiB\) to")
    assert [float(x) for x in gib.findall(our_free)] == pytest.approx([float(x) for x in gib.findall(real_free)],
                                                                      abs=0.02)
    cfg_re = re.compile(r"'cudagraph_capture_sizes': (\[[^\]]*\]).*'max_cudagraph_capture_size': (\d+)")
    assert cfg_re.search(_one(ours, "Initializing a V1 LLM engine")).groups() == \
        cfg_re.search(_one(real, "Initializing a V1 LLM engine")).groups()
    for key in ("max_seq_len=", "enforce_eager=", "kv_cache_dtype=", "enable_prefix_caching=", "tensor_parallel_size="):
        pattern = re.escape(key) + r"([^,]+)"
        assert re.search(pattern, _one(ours, "Initializing")).group(1) == \
            re.search(pattern, _one(real, "Initializing")).group(1), key
    if any("Graph capturing finished" in m for m in real):
        took = re.compile(r"took ([\d.]+) GiB")
        assert float(took.search(_one(ours, "Graph capturing finished")).group(1)) == pytest.approx(
            float(took.search(_one(real, "Graph capturing finished")).group(1)), abs=0.011)
    else:
        assert not any("Graph capturing finished" in m for m in ours)
    assert ("compilation:" in _one(ours, "init engine")) == ("compilation:" in _one(real, "init engine"))


def test_predicted_startup_failure_reproduces_b5_traceback() -> None:
    real = (FIXTURES / "b5_fail_u0012" / "server.log").read_text().splitlines()
    flags = {"enforce_eager": True, "gpu_memory_utilization": 0.012, "max_num_seqs": 64}
    script, plan, _ = _script(flags)
    assert plan.failure is not None and not script.healthy and script.exit_code == 1 and not script.after_listen
    lines = _lines(script)
    ours = _messages(lines)
    assert _one(ours, "Available KV cache memory") == "Available KV cache memory: -0.52 GiB"
    assert _one(ours, "EngineCore failed to start.") == "EngineCore failed to start."
    root = [m for m in _messages(real) if m.startswith("ValueError: ")]
    assert [m for m in ours if m.startswith("ValueError: ")] == root
    assert lines[-1].split(") ", 1)[1] == real[-1].split(") ", 1)[1] == \
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    # The ERROR block sits in the EngineCore process, the RuntimeError in the API server, as in vLLM.
    assert any(l.startswith("(EngineCore pid=1918) ERROR") and "ValueError: No available memory" in l for l in lines)
    assert not any("Starting vLLM server" in l for l in lines)


@pytest.mark.parametrize("mode, root", [
    ("startup_oom", "ValueError: Free memory on device ("),
    ("kv_too_small", "ValueError: To serve at least one request with the model's max seq len (8192)"),
    ("cudagraph_oom", "torch.OutOfMemoryError: CUDA out of memory."),
    ("crash", "ModuleNotFoundError: No module named 'flashinfer'"),
])
def test_forced_startup_failures_print_vllms_texts(mode: str, root: str) -> None:
    script, _, _ = _script({"gpu_memory_utilization": 0.5}, fail=mode)
    lines = _lines(script)
    assert script.exit_code == 1 and not script.healthy
    assert any(l.startswith("(EngineCore pid=1918) ERROR") and root in l for l in lines), mode
    assert lines[-1].endswith("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    if mode == "kv_too_small":
        m = re.search(r"max seq len \((\d+)\).*estimated maximum model length is (\d+)", "\n".join(lines))
        assert m and int(m.group(2)) < int(m.group(1))
    if mode == "cudagraph_oom":
        text = "\n".join(lines)
        assert text.index("Capturing CUDA graphs") < text.index("CUDA out of memory")


def test_hang_and_runtime_modes() -> None:
    hang, _, _ = _script({"gpu_memory_utilization": 0.5}, fail="hang")
    assert not hang.healthy and hang.exit_code is None and not hang.after_listen
    assert not any("init engine" in r.msg for r in hang.before_listen)
    for mode in ("runtime_crash", "stall"):  # these start normally and strike while serving
        script, _, _ = _script({"gpu_memory_utilization": 0.5}, fail=mode)
        assert script.healthy and script.exit_code is None
    crash = [format_record(r, PIDS, WHEN) for r in vllm_log.runtime_crash_records(5.0)]
    assert crash[0] == "(EngineCore pid=1918) ERROR 11-30 00:22:04 [core.py:1010] EngineCore encountered a fatal error."
    assert any("EngineDeadError" in l for l in crash)


def test_version_differences_still_match_the_parser_regexes() -> None:
    new, _, _ = _script({"gpu_memory_utilization": 0.5, "max_num_seqs": 64}, version="0.29.0")
    text = "\n".join(_lines(new))
    merged = [l for l in _lines(new) if "GPU KV cache size" in l]
    assert len(merged) == 1 and "Maximum concurrency for" in merged[0]
    assert KV_TOKENS_RE.search(text) and MAX_CONCURRENCY_RE.search(text)
    old, _, _ = _script({"gpu_memory_utilization": 0.5, "max_num_seqs": 64}, version="0.16.0")
    text = "\n".join(_lines(old))
    assert "torch.compile takes" in text and re.search(r"warmup model\) took [\d.]+ seconds", text)
    assert INIT_ENGINE_RE.search(text)


def test_tensor_parallel_workers_and_kv_bytes_override() -> None:
    tp, plan, _ = _script({"gpu_memory_utilization": 0.5, "max_num_seqs": 64, "tensor_parallel_size": 2})
    lines = _lines(tp)
    assert sum("Model loading took" in l for l in lines) == 2
    assert any(l.startswith("(Worker_TP1 pid=1347)") for l in lines)
    kv_line = [l for l in lines if "GPU KV cache size" in l][0]
    assert kv_line.startswith("(EngineCore pid=1918)")
    assert int(KV_TOKENS_RE.search(kv_line).group(1).replace(",", "")) == plan.kv_cache_tokens
    fixed, _, _ = _script({"kv_cache_memory_bytes": 8 << 30, "max_num_seqs": 64})
    text = "\n".join(_lines(fixed))
    assert "reserved 8.0 GiB memory for KV Cache as specified by kv_cache_memory_bytes config" in text
    assert "Free memory on device" not in text


def test_stats_message_matches_real_shape() -> None:
    msg = vllm_log.stats_message(36953.7, 8849.2, 53, 75, 0.989, 0.002)
    real = ("Engine 000: Avg prompt throughput: 36953.7 tokens/s, Avg generation throughput: 8849.2 tokens/s, "
            "Running: 53 reqs, Waiting: 75 reqs, GPU KV cache usage: 98.9%, Prefix cache hit rate: 0.2%")
    assert msg == real
    assert STATS_RE.match(msg).groups()[3:5] == ("53", "75")


def test_non_default_args_order_matches_vllm() -> None:
    args = vllm_log.non_default_args("/root/model", "127.0.0.1", 8011,
                                     {"num_gpu_blocks_override": 4096, "max_num_seqs": 128, "max_model_len": 2048,
                                      "gpu_memory_utilization": 0.5})
    real = _one(_real_messages(FIXTURES / "a3_preempt_blocks4096_s128" / "server.log"), "non-default args")
    assert f"non-default args: {args}" == real


def test_a_planned_sampler_warm_up_oom_fails_after_the_graphs_with_vllms_text() -> None:
    """The planner's sampler warm-up failure (V1 runner, after capture): the simulated log captures every graph,
    then dies with the warm-up's RuntimeError, which the product's log parser reads as cudagraph_oom."""
    from servetune.engines.vllm.logs import classify
    from servetune.result import TrialStatus
    model, gpu = load_model("llama-3.1-8b"), get_gpu("H100-80GB")
    flags = {"gpu_memory_utilization": 0.99}
    config = resolve_engine_config(flags, model, gpu, "0.19.0")
    plan = plan_memory(model, gpu, config)
    assert plan.failure is TrialStatus.CUDAGRAPH_OOM
    script = startup_script(model, gpu, config, plan, model_ref="/root/model", served_model_name="/root/model",
                            host="127.0.0.1", port=8011, given_flags=flags, api_pid=1742)
    text = "\n".join(_lines(script))
    assert script.exit_code == 1 and not script.healthy
    assert text.index("Graph capturing finished") < text.index("RuntimeError: CUDA out of memory occurred when "
                                                               "warming up sampler with 1024 dummy requests")
    assert classify(text, exit_code=1).status is TrialStatus.CUDAGRAPH_OOM


def test_the_engine_config_line_and_non_default_args_carry_disable_custom_all_reduce() -> None:
    """vLLM prints ``disable_custom_all_reduce=...`` in its engine config line and lists the flag among its
    non-default args after tensor_parallel_size (EngineArgs' ParallelConfig group) when it is given."""
    flags = {"tensor_parallel_size": 2, "disable_custom_all_reduce": True}
    msgs = _messages(_lines(_script(flags)[0]))
    assert "disable_custom_all_reduce=True," in _one(msgs, "Initializing a V1 LLM engine")
    args = ast.literal_eval(_one(msgs, "non-default args:").split(": ", 1)[1])
    keys = list(args)
    assert args["disable_custom_all_reduce"] is True
    assert keys.index("tensor_parallel_size") < keys.index("disable_custom_all_reduce")
    plain = _messages(_lines(_script({"tensor_parallel_size": 2})[0]))
    assert "disable_custom_all_reduce=False," in _one(plain, "Initializing a V1 LLM engine")
