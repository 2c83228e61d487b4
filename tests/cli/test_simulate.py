"""``servetune simulate``: human and JSON output, startup failures, and bad input (exit code 2)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from servetune.cli import _simulate as _cli_simulate
from servetune.planner.gpus import get_gpu
from servetune.sim import calibration_for


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="servetune")
    _cli_simulate.add_parser(parser.add_subparsers(dest="command", required=True))
    return _cli_simulate.run(parser.parse_args(["simulate", *argv]))


@pytest.fixture
def workload_file(tmp_path: Path) -> Path:
    path = tmp_path / "w.yaml"
    path.write_text("input_len: 512\noutput_len: 64\nnum_requests: 48\nconcurrency: 16\n")
    return path


def test_human_summary(workload_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_cli(["--model", "servetune-test-850m", "--gpu", "H200", "--workload", str(workload_file),
                  "--set", "gpu_memory_utilization=0.5", "--set", "max_num_seqs=16"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "status: ok" in out and "48 completed, 0 failed" in out
    assert "output tok/s" in out and "TTFT ms:" in out and "preemptions: 0" in out and "KV cache:" in out


def test_json_output_is_the_trial_result(workload_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_cli(["--model", "servetune-test-850m", "--gpu", "H200", "--workload", str(workload_file),
                  "--set", "num_gpu_blocks_override=70", "--set", "max_model_len=1024", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert data["status"] == "ok" and data["backend"] == "sim" and data["vllm_version"] == "0.26.0"
    assert data["completed"] == 48 and data["num_gpu_blocks"] == 70
    assert data["preemptions"] > 0  # two 512-token prompts fit (64 of 69 blocks) but grow to 2 x 36
    assert 0 < data["kv_cache_usage_mean"] <= data["kv_cache_usage_peak"] <= 1


def test_startup_failure_exits_1_with_vllms_error(workload_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_cli(["--model", "servetune-test-850m", "--gpu", "H200", "--workload", str(workload_file),
                  "--set", "gpu_memory_utilization=0.012", "--set", "enforce_eager=true"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "status: startup_oom" in out and "No available memory for the cache blocks" in out


def test_the_hosts_api_cpu_factor_is_applied_and_reported(workload_file: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "servetune-test-850m", "--gpu", "H200", "--workload", str(workload_file), "--json"]
    assert run_cli(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert run_cli([*base, "--api-cpu-factor", "2"]) == 0
    slow = json.loads(capsys.readouterr().out)
    # Every API-server cost doubled, less what a loop further behind saves by merging tokens into
    # fewer chunks (at most the per-chunk share of the token cost; sim/frontend.py).
    share = calibration_for(get_gpu("H200")).api_chunk_share
    assert 2 * (1 - share) * plain["api_server_cpu_s"] < slow["api_server_cpu_s"]
    assert slow["api_server_cpu_s"] <= 2 * plain["api_server_cpu_s"] * (1 + 1e-9)
    assert run_cli(base[:-1]) == 0
    assert "API server:" in capsys.readouterr().out


@pytest.mark.parametrize("argv, field", [
    (["--api-cpu-factor", "0"], "--api-cpu-factor"),
    (["--api-cpu-factor", "nan"], "--api-cpu-factor"),
    (["--set", "max_num_seq=3"], "max_num_seq"),
    (["--set", "gpu_memory_utilization=2"], "gpu_memory_utilization"),
    (["--gpu", "H201"], "gpu"),
    (["--model", "no-such-model"], "model"),
    (["--env", "CUDA_VISIBLE_DEVICES=0"], "--env"),
    (["--env", "NCCL_NVLS_ENABLE"], "--env"),
])
def test_bad_input_exits_2(workload_file: Path, capsys: pytest.CaptureFixture[str], argv: list[str], field: str) -> None:
    base = {"--model": "servetune-test-850m", "--gpu": "H200", "--workload": str(workload_file)}
    args = [a for k, v in base.items() if k not in argv for a in (k, v)] + argv
    assert run_cli(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err


def test_bad_workload_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("input_len: 512\nnum_requests: 4\nconcurrency: 2\n")
    assert run_cli(["--model", "servetune-test-850m", "--gpu", "H200", "--workload", str(bad)]) == 2
    assert "workload.output_len" in capsys.readouterr().err
    assert run_cli(["--model", "servetune-test-850m", "--gpu", "H200", "--workload", str(tmp_path / "none.yaml")]) == 2
    assert "file not found" in capsys.readouterr().err


def test_a_gpu_files_impossible_api_server_knob_exits_2_with_the_field(
        tmp_path: Path, workload_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GPU file's calibration the API-server loop cannot run (a per-chunk share above 1) is a
    one-line error naming the knob, not a traceback from inside the simulated engine."""
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text("gpus:\n  - {name: MyH200, memory_gib: 141, hbm_gbps: 4800, bf16_tflops: 989, fp8_tflops: 1979,\n"
                    "     interconnect_gbps: 900, calibration: {api_chunk_share: 2}}\n")
    argv = ["--model", "servetune-test-850m", "--gpu", "MyH200", "--gpu-file", str(gpus), "--workload", str(workload_file)]
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "calibration.api_chunk_share" in err and "Traceback" not in err


def test_a_gpu_no_real_run_has_judged_says_so_in_one_line_and_a_judged_one_does_not(
        workload_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """planner.gpus.calibration_note is the rule: the A10G has no run judged (one note line), the L40S and
    the A100-80GB have published runs judged held out to the target (no note)."""
    base = ["--model", "servetune-test-850m", "--workload", str(workload_file)]
    assert not get_gpu("A10G").sim_evidence and get_gpu("A100-80GB").sim_evidence
    assert run_cli([*base, "--gpu", "A10G"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "no real vLLM run" in line]
    assert len(notes) == 1 and notes[0].startswith("note: A10G:")
    for judged in ("L40S", "A100-80GB"):
        assert run_cli([*base, "--gpu", judged]) == 0
        assert "no real vLLM run" not in capsys.readouterr().out


def test_a_mamba_hybrid_is_simulated_with_one_line_saying_its_step_time_is_judged_on_two_windows(
        workload_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Mamba / gated-delta-net hybrids were refused until 2026-12-06; now simulated, with one note
    (sim.perf_hybrid.hybrid_note), on a judged GPU too. A model without Mamba layers prints none."""
    assert run_cli(["--model", "granite-4.0-h-tiny", "--gpu", "H100-80GB", "--workload", str(workload_file)]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "unjudged beyond them" in line]
    assert "status: ok" in out and len(notes) == 1 and notes[0].startswith("note: granite-4.0-h-tiny:")
    assert run_cli(["--model", "servetune-test-850m", "--gpu", "H100-80GB", "--workload", str(workload_file)]) == 0
    assert "unjudged beyond them" not in capsys.readouterr().out


def test_a_mamba_hybrid_with_prefix_caching_says_its_mamba_blocks_are_counted_short(
        workload_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With prefix caching (vLLM 0.26: ``mamba_cache_mode`` 'all') the simulator counts one block per
    Mamba group per request where vLLM's pool holds more: one line says so
    (sim.scheduler.mamba_pool_note); without it (mode 'none', counted as vLLM does) no such line."""
    base = ["--model", "granite-4.0-h-tiny", "--gpu", "H100-80GB", "--workload", str(workload_file)]
    assert run_cli([*base, "--set", "enable_prefix_caching=true"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "one KV block per Mamba group" in line]
    assert "status: ok" in out and len(notes) == 1 and "mamba_cache_mode 'all'" in notes[0]
    assert run_cli(base) == 0
    assert "one KV block per Mamba group" not in capsys.readouterr().out


def test_json_carries_the_notes_the_text_prints_from_the_engines_result(
        workload_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every ``note:`` line of the text output is one of the engine's ``TrialResult.notes``, and
    ``--json`` carries the same list: a hybrid with prefix caching on an unjudged GPU (the A10G) says
    its three notes in the engine's order, a dense model on a judged GPU none."""
    argv = ["--model", "granite-4.0-h-tiny", "--gpu", "A10G", "--workload", str(workload_file),
            "--set", "enable_prefix_caching=true", "--set", "max_model_len=2048"]
    assert run_cli(argv) == 0
    text = [line[len("note: "):] for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert run_cli([*argv, "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert notes == text and len(notes) == 3
    assert notes[0].startswith("A10G: no real vLLM run") and "unjudged beyond them" in notes[1]
    assert "one KV block per Mamba group" in notes[2]
    assert run_cli(["--model", "servetune-test-850m", "--gpu", "L40S", "--workload", str(workload_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == []


def test_the_unjudged_gpu_note_comes_at_a_measured_token_cost_too(
        workload_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--api-cpu-us-per-token`` simulates twice; the second run's figures are printed with the
    engine's notes (the unjudged GPU's among them, which the command once dropped on this path) and
    the host CPU line the command adds."""
    argv = ["--model", "servetune-test-850m", "--gpu", "A10G", "--workload", str(workload_file),
            "--api-cpu-us-per-token", "95", "--json"]
    assert run_cli(argv) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert [n.split(":")[0] for n in notes] == ["A10G", "host CPU"]


def test_vllm_defaults_run_the_server_as_vllm_serve_alone_starts_it(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3-32B at TP=4 on H100s, 4,096-token prompts: servetune's launch environment (multicast off) by default;
    ``--vllm-defaults`` plans NCCL's NVLS buffers (a smaller KV pool) and prices the prefill steps' all-reduces through
    NCCL from published timings (a shorter run), and says which environment in one note; ``--env NCCL_NVLS_ENABLE=0``
    turns multicast off again, so the steps cost what they cost by default."""
    load = tmp_path / "long.yaml"
    load.write_text("input_len: 4096\noutput_len: 16\nnum_requests: 64\nconcurrency: 32\n")
    base = ["--model", "qwen3-32b", "--gpu", "H100-80GB", "--workload", str(load), "--set", "tensor_parallel_size=4",
            "--json"]
    results = []
    for extra in ([], ["--vllm-defaults"], ["--env", "NCCL_NVLS_ENABLE=0"]):
        assert run_cli(base + extra) == 0
        results.append(json.loads(capsys.readouterr().out))
    launch, defaults, nvls_off = results
    assert defaults["kv_cache_tokens"] < launch["kv_cache_tokens"]
    assert defaults["duration_s"] < launch["duration_s"]
    assert nvls_off["duration_s"] == pytest.approx(launch["duration_s"])
    assert not any(n.startswith("environment:") for n in launch["notes"])
    assert [n for n in defaults["notes"] if n.startswith("environment:")] == [
        "environment: NCCL_NVLS_ENABLE unset (NCCL default: on where supported), VLLM_ALLREDUCE_USE_SYMM_MEM=1 "
        "(vLLM's and NCCL's defaults: none of the settings is set here)"]
    assert any("NCCL_NVLS_ENABLE=0" in n for n in nvls_off["notes"])
