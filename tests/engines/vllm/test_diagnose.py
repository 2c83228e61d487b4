"""diagnose + ``servetune diagnose``: the JSON contract (keys, nulls), advice for every status made concrete
with the log's numbers, preemptions from a metrics file, and the CLI's output and exit codes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from servetune.cli import _diagnose as _cli_diagnose
from servetune.engines.vllm.diagnose import diagnose
from servetune.result import TrialStatus
from servetune.engines.vllm.logs import classify, parse_log

FIXTURES = Path(__file__).parents[2] / "fixtures"
REAL = FIXTURES / "real_h200"
LOGS = FIXTURES / "logs"

TOP_KEYS = {"status", "cause", "advice", "vllm_version", "max_model_len", "kv_cache_tokens", "num_gpu_blocks",
            "max_concurrency", "memory_gib", "timings_s", "preemptions"}
MEMORY_KEYS = {"weights", "activation_peak", "non_torch", "cudagraph", "kv_cache"}
TIMING_KEYS = {"weights_load", "torch_compile", "graph_capture", "engine_init"}


def _read(path: Path) -> str:
    with open(path, encoding="utf-8", newline="") as fh:
        return fh.read()


def _diag(log: Path, exit_code: int | None = None, metrics: Path | None = None, **kw):
    text = _read(log)
    parsed = parse_log(text)
    healthy = kw.pop("healthy", parsed.server_ready)
    return diagnose(parsed, classify(text, exit_code=exit_code, healthy=healthy, **kw),
                    _read(metrics) if metrics else None)


def _advice(d) -> str:
    return "\n".join(d.advice)


def test_json_contract_of_a_real_run_with_metrics():
    d = _diag(REAL / "a1_u05_s64/server.log", metrics=REAL / "a1_u05_s64/metrics_after.txt")
    doc = d.to_json()
    assert set(doc) == TOP_KEYS
    assert set(doc["memory_gib"]) == MEMORY_KEYS and set(doc["timings_s"]) == TIMING_KEYS
    assert doc == json.loads(json.dumps(doc))  # plain JSON types only
    assert doc["status"] == "ok" and doc["cause"] is None and doc["vllm_version"] == "0.26.0"
    assert (doc["max_model_len"], doc["kv_cache_tokens"], doc["num_gpu_blocks"], doc["max_concurrency"]) == (
        8192, 2216528, 138533, 270.57)
    assert doc["memory_gib"] == {"weights": 1.59, "activation_peak": 0.44, "non_torch": 0.22, "cudagraph": 0.15,
                                 "kv_cache": 67.64}
    assert doc["timings_s"] == {"weights_load": 0.25, "torch_compile": 13.89, "graph_capture": 1.0, "engine_init": 31.01}
    assert doc["preemptions"] == 0


def test_fields_the_log_does_not_show_are_null():
    doc = _diag(REAL / "b5_fail_u0012/server.log", exit_code=1).to_json()
    assert set(doc) == TOP_KEYS
    assert doc["status"] == "startup_oom" and doc["cause"].startswith("No available memory for the cache blocks")
    assert doc["kv_cache_tokens"] is None and doc["num_gpu_blocks"] is None and doc["max_concurrency"] is None
    assert doc["memory_gib"] == {"weights": 1.59, "activation_peak": None, "non_torch": None, "cudagraph": None,
                                 "kv_cache": -0.52}
    assert doc["timings_s"] == {"weights_load": 0.24, "torch_compile": None, "graph_capture": None, "engine_init": None}
    assert doc["preemptions"] is None  # no metrics file
    empty = diagnose(parse_log(""), classify("", timed_out=True)).to_json()
    assert empty["status"] == "timeout" and all(empty[k] is None for k in TOP_KEYS - {"status", "cause", "advice", "memory_gib", "timings_s"})
    assert all(v is None for v in empty["memory_gib"].values()) and all(v is None for v in empty["timings_s"].values())


def test_startup_oom_advice_quotes_the_budget():
    d = _diag(REAL / "b5_fail_u0012/server.log", exit_code=1)
    text = _advice(d)
    assert d.advice[0].startswith("Raise gpu_memory_utilization (now 0.012)")
    assert "-0.52 GiB" in text and "more than 0.52 GiB" in text and "weights (1.59 GiB)" in text
    assert "max_num_batched_tokens (now 8,192)" in text


def test_kv_too_small_advice_quotes_vllms_estimate():
    d = _diag(LOGS / "kv_too_small_v1.log", exit_code=1)
    assert d.status is TrialStatus.KV_TOO_SMALL
    assert d.advice[0].startswith("Lower max_model_len (now 131,072) to at most 28,672")
    text = _advice(d)
    assert "gpu_memory_utilization (now 0.9): one 131,072-token sequence needs 16.00 GiB" in text
    assert "kv_cache_dtype=fp8" in text and "about 57,344 tokens" in text
    v0 = _diag(LOGS / "kv_too_small_v0.log", exit_code=1)
    assert v0.status is TrialStatus.KV_TOO_SMALL and "max_model_len (now 131,072)" in _advice(v0)


def test_weight_load_oom_advises_parallelism_or_quantization():
    d = _diag(LOGS / "oom_load.log", exit_code=1)
    assert d.status is TrialStatus.STARTUP_OOM
    text = _advice(d)
    assert "tensor_parallel_size=2" in text and "pipeline_parallel_size" in text and "quantized" in text


def test_profile_oom_advises_a_smaller_token_budget():
    d = _diag(LOGS / "oom_profile.log", exit_code=1)
    assert d.status is TrialStatus.STARTUP_OOM and "max_num_batched_tokens (now 131,072)" in _advice(d)


def test_cudagraph_oom_advice_shrinks_the_capture_sizes():
    d = _diag(LOGS / "oom_capture.log", exit_code=1)
    text = _advice(d)
    assert d.status is TrialStatus.CUDAGRAPH_OOM
    assert "max_cudagraph_capture_size=256 (now 512, 51 sizes)" in text and "enforce_eager=true" in text
    assert "gpu_memory_utilization (now 0.99)" in text


def test_free_memory_below_utilization_is_infrastructure():
    d = _diag(LOGS / "free_memory_below_util.log", exit_code=1)
    assert d.status is TrialStatus.STARTUP_OOM and d.infrastructure
    text = _advice(d)
    assert "only 30.12 of 79.18 GiB was free" in text and "nvidia-smi" in text
    assert "gpu_memory_utilization to at most 0.37" in text  # (30.12 - 0.5) / 79.18, rounded down
    assert "infrastructure failure" in text


def test_crash_advice_names_the_root_exception():
    d = _diag(LOGS / "crash_missing_module.log", exit_code=1)
    assert d.status is TrialStatus.CRASHED
    assert d.advice[0] == "The engine died with: ModuleNotFoundError: No module named 'flashinfer'"
    assert "pip install flashinfer" in d.advice[1]


def test_invalid_config_and_timeout_advice():
    d = _diag(LOGS / "unrecognized_arg.log", exit_code=2)
    assert d.status is TrialStatus.INVALID_CONFIG and "--swap-space 4" in _advice(d)
    text = _read(REAL / "a1_u05_s64/server.log")
    cut = text[: text.index("Graph capturing finished")]
    t = diagnose(parse_log(cut), classify(cut, timed_out=True))
    assert t.status is TrialStatus.TIMEOUT and "torch.compile took 13.9 s" in _advice(t)


def test_runtime_oom_advice():
    line = ("(EngineCore pid=2) ERROR 11-30 01:23:40 [core.py:1010] torch.OutOfMemoryError: CUDA out of memory. Tried "
            "to allocate 2.00 GiB.")
    text = _read(REAL / "a1_u05_s64/server.log").replace(
        "INFO:     Application startup complete.\n", "INFO:     Application startup complete.\n" + line + "\n", 1)
    d = diagnose(parse_log(text), classify(text, healthy=True))
    assert d.status is TrialStatus.RUNTIME_OOM and "gpu_memory_utilization (now 0.5)" in d.advice[0]


def test_preemption_advice_with_metrics():
    d = _diag(REAL / "b3_preempt_blocks1024_s64/server.log", metrics=REAL / "b3_preempt_blocks1024_s64/metrics_after.txt")
    assert d.preemptions == 192 and d.status is TrialStatus.OK
    assert d.advice[0] == "KV cache holds 16,384 tokens = 8.0 sequences of 2,048."
    text = _advice(d)
    assert "192 preemptions" in text and "max_num_seqs is 64" in text and "Lower max_num_seqs (now 64)" in text
    assert text.index("max_num_seqs") < text.index("max_num_batched_tokens") < text.index("raise gpu_memory_utilization")
    assert "num_gpu_blocks_override=1,024 caps the KV cache (profiling found room for 138,533)" in text
    assert "kv_cache_dtype=fp8 halves" in text


def test_low_kv_usage_without_preemption_suggests_more_sequences():
    d = _diag(REAL / "a1_u05_s64/server.log", metrics=REAL / "a1_u05_s64/metrics_after.txt")
    text = _advice(d)
    assert "KV cache usage peaked at 3.6% with at most 63 requests running" in text
    assert "raise max_num_seqs (now 64)" in text and "preemptions:" not in text
    # With preemptions (a3: KV usage 98.9%) there is no such advice.
    a3 = _diag(REAL / "a3_preempt_blocks4096_s128/server.log", metrics=REAL / "a3_preempt_blocks4096_s128/metrics_after.txt")
    assert a3.preemptions == 106 and "peaked at" not in _advice(a3)


def test_metrics_fill_the_block_count_when_the_log_only_implies_it():
    d = _diag(REAL / "examples/server2.log", metrics=REAL / "examples/metrics2.txt")
    assert d.num_gpu_blocks == 128 and d.preemptions == 31 and d.max_concurrency == 1.0


def test_a_sliding_window_models_block_count_is_the_metrics_or_none():
    """gemma-2, 0.26.0 on one H100 (2026-12-05): two KV-cache groups, so the log's 51,182 tokens do not give the
    blocks (one group's count would be 3,199); its /metrics dump says 6,404, and without it there is none."""
    import gzip

    folder = FIXTURES / "real_h100_classes" / "2026-12-05_g2_u09_s128_mbt8192"
    text = gzip.decompress((folder / "server.log.gz").read_bytes()).decode()
    metrics = gzip.decompress((folder / "p256_o256_c1" / "metrics_before.txt.gz").read_bytes()).decode()
    parsed, verdict = parse_log(text), classify(text, healthy=True)
    with_metrics, bare = diagnose(parsed, verdict, metrics), diagnose(parsed, verdict)
    assert (with_metrics.num_gpu_blocks, bare.num_gpu_blocks, bare.kv_cache_tokens) == (6404, None, 51182)
    out = _cli_diagnose.format_diagnosis("g2", parsed, bare)
    assert "KV cache    51,182 tokens, 6.25x" in out and "blocks" not in out.split("KV cache    ")[1].split("\n")[0]


# ---------------------------------------------------------------------------------------------- CLI
def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="servetune")
    sub = parser.add_subparsers(dest="command", required=True)
    _cli_diagnose.add_parser(sub)
    return _cli_diagnose.run(parser.parse_args(["diagnose", *argv]))


def test_cli_human_output(capsys):
    rc = _cli([str(REAL / "b3_preempt_blocks1024_s64/server.log"), "--metrics",
               str(REAL / "b3_preempt_blocks1024_s64/metrics_after.txt")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "status      ok" in out and "KV cache    16,384 tokens, 1,024 blocks, 8.00x sequences of 2,048" in out
    assert "weights                 1.59" in out and "KV cache               67.64" in out
    assert "torch.compile          15.51" in out and "preemptions 192" in out
    assert "  1. KV cache holds 16,384 tokens" in out and "  2. 192 preemptions" in out


def test_cli_failure_output_shows_the_evidence(capsys):
    rc = _cli([str(REAL / "b5_fail_u0012/server.log")])
    out = capsys.readouterr().out
    assert rc == 1  # a classified failure (scripts can tell it from a served run)
    assert "status      startup_oom" in out and "cause       No available memory for the cache blocks" in out
    assert "  35: Available KV cache memory: -0.52 GiB" in out and "preemptions - (no --metrics)" in out
    rc = _cli([str(LOGS / "free_memory_below_util.log")])
    assert "status      startup_oom (infrastructure)" in capsys.readouterr().out


def test_cli_json(capsys):
    rc = _cli([str(REAL / "examples/server_tp2.log"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and set(doc) == TOP_KEYS
    assert doc["kv_cache_tokens"] == 4503984 and doc["memory_gib"]["weights"] == 0.81 and doc["preemptions"] is None


@pytest.mark.parametrize("which", ["log", "metrics"])
def test_cli_missing_file_exits_2(capsys, tmp_path, which):
    missing = str(tmp_path / "nope.txt")
    argv = [missing] if which == "log" else [str(REAL / "a1_u05_s64/server.log"), "--metrics", missing]
    assert _cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "file not found" in err and missing in err


def test_preemptions_from_the_stats_lines_when_there_is_no_metrics_file():
    d = _diag(LOGS / "v0_29_tp2_healthy.log")  # 0.29 stats lines: "Preemptions: 3", then "Preemptions: 2"
    assert d.preemptions is None  # the JSON field is the metrics counter only
    assert d.advice[0] == "KV cache holds 997,776 tokens = 30.45 sequences of 32,768."
    assert d.advice[1].startswith("5 preemptions logged: the KV cache ran out (it holds 30.45 sequences of 32,768 and "
                                  "max_num_seqs is 128)")


def test_too_few_mamba_blocks_for_max_num_seqs_is_kv_too_small():
    """vLLM 0.26's config/compilation.py text (line 1492), the way the engine core prints a ValueError."""
    log = ("(EngineCore pid=9) ERROR 12-06 01:33:51 [core.py:1330] ValueError: max_num_seqs (256) exceeds available "
           "Mamba cache blocks (100). Each decode sequence requires one Mamba cache block, so CUDA graph capture "
           "cannot proceed. Please lower max_num_seqs to at most 100 or increase gpu_memory_utilization.")
    c = classify(log, exit_code=1)
    assert c.status is TrialStatus.KV_TOO_SMALL and c.cause is not None and c.cause.startswith("max_num_seqs (256)")
