"""Real startup logs of V0 (0.5-0.8) and early V1 (0.7-0.8), pasted in vLLM's GitHub threads.

Each fixture in ``tests/fixtures/vllm_issue_logs`` carries its source (thread URL, author, date,
version) in its ``# SOURCE`` header and in ``SOURCES.md``; the lines are verbatim as the paste has
them, cut where the stored copy of the thread cuts them. The figures asserted below are read off
those lines by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from servetune.cli import _diagnose as _cli_diagnose
from servetune.result import TrialStatus
from servetune.engines.vllm.logs import classify, is_vllm_log, parse_log

LOGS = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_issue_logs"
REPO = Path(__file__).resolve().parents[3]


def _read(name: str) -> str:
    return (LOGS / name).read_text(encoding="utf-8")


def _diagnose_cli(path: Path, *extra: str) -> int:
    parser = argparse.ArgumentParser(prog="servetune")
    sub = parser.add_subparsers(dest="command", required=True)
    _cli_diagnose.add_parser(sub)
    return _cli_diagnose.run(parser.parse_args(["diagnose", str(path), *extra]))


def test_every_fixture_names_its_source():
    logs = sorted(LOGS.glob("*.log"))
    assert len(logs) == 12
    index = (LOGS / "SOURCES.md").read_text()
    for log in logs:
        text = log.read_text()
        assert "# SOURCE: https://github.com/vllm-project/vllm/" in text and log.name in index
        # every vLLM line of the file comes after a SOURCE comment
        first_source = text.index("# SOURCE:")
        assert all(not is_vllm_log(line) for line in text[:first_source].splitlines())


@pytest.mark.parametrize("line_no, version", [(0, "0.6.4.post2.dev395+g02222a02.d20241217"),
                                              (1, "0.7.4.dev390+gdebd6bbf"), (2, "0.6.4.post1"),
                                              (3, "0.8.0rc3.dev6+g53a0cf8b"), (4, "0.7.3"), (5, "0.7.0")])
def test_v0_engine_lines_give_the_version(line_no, version):
    lines = [x for x in _read("v0_engine_version_lines.log").splitlines() if not x.startswith("#")]
    assert len(lines) == 6
    p = parse_log(lines[line_no])
    assert p.vllm_version == version and p.tensor_parallel_size == 1 and p.max_model_len is not None


def test_v0_0_5_engine_line_and_a_cut_traceback():
    text = _read("v0_5_0_mistral_oom_cut.log")
    p = parse_log(text)
    assert p.vllm_version == "0.5.0.post1" and p.max_model_len == 32768 and p.weights_gib == 13.4966
    assert p.tensor_parallel_size == 1 and p.enforce_eager is False and p.kv_cache_dtype == "auto"
    c = classify(text)
    assert c.status is TrialStatus.CRASHED
    assert c.cause == ("a traceback starts at line 12 but the log ends before its exception line "
                       "(the log is cut short)")


def test_v0_0_5_tensor_parallel_gpu_blocks():
    p = parse_log(_read("v0_5_tp4_lora_gpu_blocks_cut.log"))
    assert p.num_gpu_blocks == 10039 and p.num_cpu_blocks == 1310 and not p.num_gpu_blocks_derived
    # V0's workers share one name, "VllmWorkerProcess": their pids tell them apart (the driver's own
    # weights line is before this excerpt).
    assert set(p.workers) == {f"VllmWorkerProcess pid={pid}" for pid in (6921, 6922, 6923)}
    assert {w.weights_gib for w in p.workers.values()} == {6.1138} and p.weights_gib == 6.1138
    c = classify(_read("v0_5_tp4_lora_gpu_blocks_cut.log"))
    assert c.status is TrialStatus.INCOMPLETE and "during CUDA graph capture" in (c.cause or "")


def test_v0_0_6_memory_profiling_results_line():
    p = parse_log(_read("v0_6_bamba_tp2_profiling_cut.log"))
    assert p.num_gpu_blocks == 189945 and p.num_cpu_blocks == 21845
    assert p.max_concurrency == 2967.89 and p.max_concurrency_tokens == 1024
    assert p.total_gpu_gib == 79.15 and p.gpu_memory_utilization == 0.9 and p.memory_profiling_s == 71.88
    # The binding worker: the smaller KV budget (the driver's 34.78 GiB, not the worker's 34.96).
    assert p.available_kv_gib == 34.78 and p.non_torch_gib == 1.96 and p.weights_gib == 18.4902
    # peak_torch_memory is weights + activations: 34.50 - 18.4902 on the driver.
    assert p.activation_peak_gib == pytest.approx(16.0098)
    assert set(p.workers) == {"main", "VllmWorkerProcess pid=1587462"}
    assert p.workers["VllmWorkerProcess pid=1587462"].available_kv_gib == 34.96


def test_v0_0_7_zero_cuda_blocks_is_a_startup_oom_with_the_budget_as_evidence():
    text = _read("v0_7_rtx4060_cuda_blocks_0.log")
    p = parse_log(text)
    assert p.num_gpu_blocks == 0 and p.num_cpu_blocks == 4681 and p.available_kv_gib == -1.05
    assert p.total_gpu_gib == 8.0 and p.requested_gib == 5.6 and p.weights_gib == 5.2032
    c = classify(text)
    assert c.status is TrialStatus.STARTUP_OOM and not c.infrastructure
    assert c.evidence[0].startswith("9: model weights take 5.20GiB") and c.evidence[-1].startswith("10: # cuda blocks: 0")


def test_the_block_line_is_read_whatever_the_platform_name():
    """0.7.x printed the platform's name: real 0.7 lines say "# cuda blocks"; "# CUDA blocks" is the same
    line with the name upper-cased (as 0.7.2 prints it), and "# GPU blocks" the 0.5/0.6 spelling."""
    real = next(x for x in _read("v0_7_rtx4060_cuda_blocks_0.log").splitlines()
                if "# cuda blocks" in x and not x.startswith("#"))
    for name in ("cuda", "CUDA", "GPU"):
        p = parse_log(real.replace("# cuda blocks: 0", f"# {name} blocks: 5519"))
        assert (p.num_gpu_blocks, p.num_cpu_blocks) == (5519, 4681)


def test_v0_0_7_tensor_parallel_kv_too_small():
    text = _read("v0_7_tp2_kv_too_small.log")
    p = parse_log(text)
    assert (p.max_model_len, p.kv_cache_tokens, p.estimated_max_model_len) == (131072, 81536, 81536)
    assert p.weights_gib == 13.9476 and set(p.workers) == {"VllmWorkerProcess pid=1786"}
    c = classify(text)
    assert c.status is TrialStatus.KV_TOO_SMALL and "max seq len (131072)" in (c.cause or "")
    d = _diagnose_json("v0_7_tp2_kv_too_small.log")
    assert d["advice"][0].startswith("Lower max_model_len (now 131,072) to at most 81,536")


def test_v0_0_8_bracketed_header_and_one_figure_set_per_worker_pid():
    p = parse_log(_read("v0_8_tp_workers_bracketed.log"))
    assert sorted(p.workers) == ["VllmWorkerProcess pid=507", "VllmWorkerProcess pid=521", "VllmWorkerProcess pid=577"]
    assert all((w.weights_gib, w.available_kv_gib, w.non_torch_gib, w.activation_peak_gib) == (21.21, 1.57, 0.2, 0.37)
               for w in p.workers.values())
    assert (p.total_gpu_gib, p.gpu_memory_utilization, p.requested_gib, p.memory_profiling_s) == (23.58, 0.99, 23.35, 17.59)
    assert classify(_read("v0_8_tp_workers_bracketed.log")).status is TrialStatus.INCOMPLETE


def test_v0_worker_oom_while_loading_is_a_startup_oom_at_load():
    """The OOM line and the worker's "while processing method load_model" come from two workers."""
    c = classify(_read("v0_8_tp_worker_oom_load_model.log"))
    assert c.status is TrialStatus.STARTUP_OOM
    assert (c.cause or "").startswith("CUDA out of memory while loading the weights: CUDA out of memory. Tried to "
                                      "allocate 20.00 MiB. GPU 2 has a total capacity of 14.62 GiB")
    assert c.evidence[-1] == "7: Exception in worker VllmWorkerProcess while processing method load_model."
    assert _diagnose_json("v0_8_tp_worker_oom_load_model.log")["advice"][0].startswith("The weights do not fit")


def test_early_v1_worker_prefix_with_a_rank_is_a_process_prefix():
    """0.8's "(VllmWorker rank=1 pid=12231) " is a process prefix: the evidence reads vLLM's own text."""
    c = classify(_read("v1_0_8_worker_rank_traceback_cut.log"))
    assert c.status is TrialStatus.CRASHED and "log ends before its exception line" in (c.cause or "")
    assert c.evidence == ["6: Traceback (most recent call last):"]


def test_the_0_10_worker_prefix_with_a_tp_rank():
    """0.10's "(VllmWorker TP0 pid=19250) ": lines from https://github.com/infiniflow/ragflow/issues/9856
    (Bob123Yang, 2025-09-01), a terminal paste wrapped in <font>/<b> tags, here with the tags removed."""
    text = ("(VllmWorker TP0 pid=19250) INFO 09-01 21:26:21 [gpu_worker.py:276] Available KV cache memory: 26.13 GiB\n"
            "(VllmWorker TP1 pid=19251) INFO 09-01 21:26:21 [gpu_worker.py:276] Available KV cache memory: 26.13 GiB\n"
            "(EngineCore_0 pid=19048) INFO 09-01 21:26:21 [kv_cache_utils.py:849] GPU KV cache size: 570,848 tokens\n")
    p = parse_log(text)
    assert set(p.workers) == {"VllmWorker TP0", "VllmWorker TP1"} and p.available_kv_gib == 26.13
    assert p.kv_cache_tokens == 570848


def _diagnose_json(name: str) -> dict:
    from servetune.engines.vllm.diagnose import diagnose

    text = _read(name)
    return diagnose(parse_log(text), classify(text)).to_json()


def test_early_v1_gpu_blocks_without_cpu_blocks():
    p = parse_log(_read("v1_0_7_early_gpu_blocks_cut.log"))
    assert p.num_gpu_blocks == 1381 and p.num_cpu_blocks is None and not p.num_gpu_blocks_derived
    assert p.weights_gib == 67.7229 and p.torch_compile_s == 54.73 and p.compile_cache_hit is False
    assert p.max_concurrency == 10.79 and p.max_concurrency_tokens == 2048


def test_v1_0_8_5_start_cut_before_the_model_loads():
    text = _read("v1_0_8_5_llava_cut.log")
    p = parse_log(text)
    assert p.vllm_version == "0.8.5.post1" and p.max_num_batched_tokens == 16384 and p.max_model_len == 4096
    c = classify(text)
    assert c.status is TrialStatus.INCOMPLETE and "before loading the model" in (c.cause or "")


def test_v0_0_7_api_server_that_served():
    text = _read("v0_7_api_server_served.log")
    assert parse_log(text).server_ready and classify(text).status is TrialStatus.OK


# ------------------------------------------------------------------------------ the CLI's exit codes
@pytest.mark.parametrize("name, code, status", [
    ("v0_7_api_server_served.log", 0, "ok"),
    ("v0_7_rtx4060_cuda_blocks_0.log", 1, "startup_oom"),
    ("v0_7_tp2_kv_too_small.log", 1, "kv_too_small"),
    ("v0_8_tp_worker_oom_load_model.log", 1, "startup_oom"),
    ("v0_5_0_mistral_oom_cut.log", 1, "crashed"),
    ("v0_6_bamba_tp2_profiling_cut.log", 1, "incomplete"),
    ("v1_0_7_early_gpu_blocks_cut.log", 1, "incomplete"),
])
def test_diagnose_exit_code_follows_the_status(capsys, name, code, status):
    assert _diagnose_cli(LOGS / name, "--json") == code
    assert json.loads(capsys.readouterr().out)["status"] == status


@pytest.mark.parametrize("path", [REPO / "README.md", REPO / "jobs" / "quickstart.yaml",
                                  REPO / "tests" / "fixtures" / "real_h200" / "study_memory_pair" / "study.log"])
def test_files_that_are_not_vllm_logs_exit_2(capsys, path):
    assert not is_vllm_log(path.read_text())
    assert _diagnose_cli(path) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "is not a vLLM log" in err and "fix:" in err


def test_an_empty_file_is_not_a_vllm_log(capsys, tmp_path):
    (tmp_path / "empty.log").write_text("")
    assert _diagnose_cli(tmp_path / "empty.log") == 2
    assert "it is empty" in capsys.readouterr().err


def test_every_log_fixture_of_the_repository_is_a_vllm_log():
    logs = [p for p in (REPO / "tests" / "fixtures").rglob("*.log") if not p.name.startswith("study")]
    assert len(logs) >= 30
    assert [p for p in logs if not is_vllm_log(p.read_text(errors="replace"))] == []
