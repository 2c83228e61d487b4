"""``servetune plan``: human table, JSON keys, exit codes (0 fits, 1 predicted failure, 2 bad input)."""

from __future__ import annotations

import argparse
import json

import pytest

from servetune.cli import _plan as _cli_plan


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="servetune")
    sub = parser.add_subparsers(dest="command", required=True)
    _cli_plan.add_parser(sub)
    return _cli_plan.run(parser.parse_args(["plan", *argv]))


def test_human_output_of_the_real_run(capsys):
    rc = _run(["--model", "servetune-test-850m", "--gpu", "h200", "--set", "gpu_memory_utilization=0.5",
               "--set", "max_num_seqs=64"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "2,216,528 tokens" in out and "138,533 blocks of 16" in out and "270.57x" in out
    assert "19 PIECEWISE + 11 FULL" in out and "verdict     fits" in out
    assert "max_num_batched_tokens=8192" in out


def test_json_keys(capsys):
    rc = _run(["--model", "servetune-test-850m", "--gpu", "H200", "--set", "gpu_memory_utilization=0.5", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert {"fits", "failure", "kv_cache_tokens", "num_gpu_blocks", "max_concurrency", "memory_gib"} <= set(doc)
    assert set(doc["memory_gib"]) == {"total", "budget", "weights", "activation_peak", "non_torch", "cudagraph", "kv_cache"}
    assert doc["fits"] is True and doc["failure"] is None and doc["flags"]["max_num_seqs"] == 1024
    assert doc["gpu"] == "H200" and doc["vllm_version"] == "0.26.0"


def test_predicted_failure_exits_1_with_cause_and_fix(capsys):
    rc = _run(["--model", "llama-3.1-8b", "--gpu", "L4"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "verdict     kv_too_small: To serve at least one request" in out and "fix         lower max_model_len" in out
    rc = _run(["--model", "servetune-test-850m", "--gpu", "H200", "--set", "gpu_memory_utilization=0.012", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and doc["failure"] == "startup_oom" and doc["cause"].startswith("No available memory")


@pytest.mark.parametrize(("argv", "needle"), [
    (["--model", "llama-3.1-8b", "--gpu", "H300"], "unknown GPU 'H300'"),
    (["--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--set", "max_num_seq=8"], "unknown vLLM flag 'max_num_seq'"),
    (["--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--set", "gpu_memory_utilization=1.5"], "must be <= 1"),
    (["--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--set", "tensor_parallel_size=3"], "must be divisible"),
    (["--model", "no-such-model", "--gpu", "H100-80GB"], "no model config found"),
    (["--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--vllm-version", "0.9.2"], "vllm_version"),
    (["--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--set", "max_num_seqs"], "expected FLAG=VALUE"),
])
def test_bad_input_exits_2(capsys, argv, needle):
    rc = _run(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and needle in err


def test_unknown_gpu_lists_known_ones(capsys):
    assert _run(["--model", "llama-3.1-8b", "--gpu", "X9"]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in ("H100-80GB", "H200", "A100-80GB", "L40S", "L4", "B200"))


def test_gpu_file(tmp_path, capsys):
    path = tmp_path / "gpus.yaml"
    path.write_text("gpus:\n  - {name: Test-48G, memory_gib: 47.5, hbm_gbps: 960, bf16_tflops: 182, "
                    "fp8_tflops: 364, interconnect_gbps: 32}\n")
    rc = _run(["--model", "qwen2.5-7b", "--gpu", "test-48g", "--gpu-file", str(path), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["gpu"] == "Test-48G" and doc["memory_gib"]["total"] == pytest.approx(47.5, abs=1e-3)
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus:\n  - {name: Broken}\n")
    assert _run(["--model", "qwen2.5-7b", "--gpu", "H200", "--gpu-file", str(bad)]) == 2
    assert "memory_gib" in capsys.readouterr().err


def test_a_config_that_cannot_start_says_does_not_fit_not_a_negative_size(capsys):
    # The real util=0.012 start: vLLM logged "Available KV cache memory: -0.52 GiB".
    code = _run(["--model", "servetune-test-850m", "--gpu", "H200", "--set", "gpu_memory_utilization=0.012",
                 "--set", "max_num_seqs=64", "--set", "enforce_eager=true"])
    out = capsys.readouterr().out
    assert code == 1
    kv = next(line for line in out.splitlines() if line.strip().startswith("kv cache"))
    assert "does not fit: the budget is 0.52 GiB short" in kv and "-" not in kv


def test_plan_reads_the_callers_environment_and_says_what_the_other_gives(capsys, monkeypatch):
    """Default environment on an NVSwitch H100: multicast live, and the NVLS-off figure alongside."""
    for name in ("NCCL_NVLS_ENABLE", "NCCL_NVLS_CHUNKSIZE", "VLLM_ALLREDUCE_USE_SYMM_MEM",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        monkeypatch.delenv(name, raising=False)
    args = ["--model", "llama-3.1-70b", "--gpu", "H100-80GB", "--set", "tensor_parallel_size=4",
            "--set", "max_model_len=8192", "--vllm-version", "0.19.0", "--json"]
    assert _run(args) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["multicast"] is True and "NCCL_NVLS_ENABLE unset" in default["environment"]
    other = default["if_other_environment"]
    assert other["kv_cache_tokens"] > default["kv_cache_tokens"] and "NCCL_NVLS_ENABLE=0" in other["environment"]

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert _run(args) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["multicast"] is False and off["kv_cache_tokens"] == other["kv_cache_tokens"]
    assert "this shell's environment" in off["environment"]
    assert _run([*args, "--env", "NCCL_NVLS_ENABLE=1"]) == 0  # --env wins over the shell
    assert json.loads(capsys.readouterr().out)["kv_cache_tokens"] == default["kv_cache_tokens"]
    assert _run([*args[:-1], "--trial-env"]) == 0
    text = capsys.readouterr().out
    assert "servetune's launch environment" in text and "if instead" in text


def test_trial_env_plans_a_real_trial_as_a_study_does_before_its_probe(capsys):
    """``--trial-env`` at TP=2 on an H100 with vLLM 0.19: servetune's launch variables (multicast off) and vLLM's
    FlashInfer all-reduce fusion workspace, as a study's pre-screen charges it until a GPU worker says otherwise."""
    from servetune.planner.comm import FI_ALLREDUCE_FUSION_WORKSPACE_GIB, NON_TORCH_GIB_MULTI_V1, trial_env

    assert _cli_plan.comm_env_for([], True, {"NCCL_NVLS_ENABLE": "1"}) == trial_env(True)
    args = ["--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--set", "tensor_parallel_size=2",
            "--set", "max_model_len=8192", "--vllm-version", "0.19.0", "--json", "--trial-env"]
    assert _run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["multicast"] is False and "not probed" in doc["environment"]
    assert doc["fused_allreduce"] is True
    assert doc["memory_gib"]["non_torch"] == pytest.approx(NON_TORCH_GIB_MULTI_V1 + FI_ALLREDUCE_FUSION_WORKSPACE_GIB,
                                                           abs=1e-3)  # the V1 runner's rings and the workspace


def test_plan_says_where_no_published_log_backs_the_gpu(capsys):
    assert _run(["--model", "llama-3.1-8b", "--gpu", "RTX-4090", "--set", "max_model_len=4096"]) in (0, 1)
    out = capsys.readouterr().out
    assert "evidence    no vLLM >= 0.10 startup log of RTX-4090 was checked" in out
    assert _run(["--model", "servetune-test-850m", "--gpu", "H200", "--set", "gpu_memory_utilization=0.5"]) == 0
    assert "evidence    servetune's own vLLM 0.26.0 startup logs" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["--env", "NCCL_NVLS_ENABLE"], "--env: expected NAME=VALUE"),
    (["--env", "FOO=1"], "--env: FOO does not change"),
    (["--env", "NCCL_NVLS_ENABLE=7"], "NCCL_NVLS_ENABLE: expected 0, 1 or 2"),
    (["--env", "NCCL_NVLS_ENABLE=0", "--trial-env"], "--env or --trial-env"),
])
def test_bad_env_exits_2_naming_the_setting(capsys, argv, needle):
    assert _run(["--model", "llama-3.1-8b", "--gpu", "H100-80GB", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


@pytest.mark.parametrize("flag", ["speculative_config=ngram"])
def test_a_flag_servetune_does_not_model_is_refused_saying_so(capsys, flag):
    assert _run(["--model", "qwen3-30b-a3b", "--gpu", "H100-80GB", "--set", flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not modelled by the planner or the simulator" in err
    assert "unknown vLLM flag" not in err


def test_expert_parallelism_is_planned_and_refused_on_a_dense_model_as_vllm_refuses_it(capsys):
    """``--set enable_expert_parallel=true``: planned for a MoE model (its note names the experts a GPU holds), a
    one-line refusal with vLLM's own text for a dense one (``config/model.py:1177-1182@0.26.0``)."""
    assert _run(["--model", "qwen3-30b-a3b", "--gpu", "H100-80GB", "--set", "tensor_parallel_size=2",
                 "--set", "enable_expert_parallel=true"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "qwen3-30b-a3b on H100-80GB x2 (TP=2 PP=1 EP=2), vLLM 0.26.0"
    assert "enable_expert_parallel: ep_size = TP x DP = 2; each GPU holds 64 of the 128 routed experts" in out
    assert _run(["--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--set", "tensor_parallel_size=2",
                 "--set", "enable_expert_parallel=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Number of experts in the model must be greater than 0" in err


def test_data_parallel_size_on_a_moe_model_prints_per_gpu_figures_of_one_replica(capsys):
    """Qwen3-30B-A3B at TP=1 DP=2: the routed experts split over 2 GPUs (29.88 GiB of weights a GPU, not the
    56.88 GiB of one GPU alone), the KV pool one replica's, and the note that says what is and is not counted."""
    assert _run(["--model", "qwen3-30b-a3b", "--gpu", "H100-80GB", "--set", "data_parallel_size=2"]) == 0
    alone = capsys.readouterr().out
    assert _run(["--model", "qwen3-30b-a3b", "--gpu", "H100-80GB"]) == 0
    one = capsys.readouterr().out
    lines = alone.splitlines()
    assert lines[0] == "qwen3-30b-a3b on H100-80GB x2 (TP=1 PP=1 DP=2), vLLM 0.26.0"
    assert lines[1] == "memory per GPU (GiB) of one replica"
    weights = {out: float(next(x for x in out.splitlines() if x.startswith("  weights")).split()[1])
               for out in (alone, one)}
    assert (weights[alone], weights[one]) == (29.88, 56.88)
    assert "tokens per replica" in next(x for x in lines if x.startswith("KV cache"))
    assert any(x.startswith("note        data_parallel_size=2: 2 GPUs in all") and "TP x DP = 2 GPUs" in x
               for x in lines)


@pytest.mark.parametrize("value, words", [("0", "must be >= 1"), ("1.5", "expected an integer")])
def test_a_bad_data_parallel_size_exits_2_in_one_line(capsys, value, words):
    assert _run(["--model", "qwen3-30b-a3b", "--gpu", "H100-80GB", "--set", f"data_parallel_size={value}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data_parallel_size" in err and words in err and "fix:" in err


def test_a_copied_disable_custom_all_reduce_is_planned_and_its_caveats_printed(capsys):
    """``--disable-custom-all-reduce`` from a user's TP command: planned, shown among the flags, and the two
    lines say what is kept (the custom all-reduce buffers in the context figure) and what is not modelled."""
    rc = _run(["--model", "llama-3.1-8b", "--gpu", "L40S", "--set", "tensor_parallel_size=2",
               "--set", "max_model_len=8192", "--set", "disable-custom-all-reduce=true"])
    out = capsys.readouterr().out
    flags_line = next(line for line in out.splitlines() if line.startswith("flags       "))
    assert rc == 0 and "disable_custom_all_reduce=True" in flags_line
    notes = [line for line in out.splitlines() if line.startswith("note        disable_custom_all_reduce at TP=2")]
    assert len(notes) == 2 and "24 MiB" in notes[0] and "small-message latency is not modelled" in notes[1]


def test_a_sampler_warm_up_death_is_named_with_its_fix(capsys):
    """gpt-oss-20b at 0.99 on an H100 under vLLM 0.19.0: the KV cache and the graphs leave its sampler warm-up
    (2.78 GiB over 1,024 rows) 1.31 GiB short, so the start dies there after sizing its KV cache; the fix names
    the max_num_seqs that passes vLLM's count and the gpu_memory_utilization that also leaves the 1.89 GiB real
    starts have lacked. At 0.95 it is a fit, warned (the published 0.19.0 start with these flags died there)."""
    base = ["--model", "gpt-oss-20b", "--gpu", "H100-80GB", "--vllm-version", "0.19.0", "--set", "max_model_len=8192"]
    rc = _run([*base, "--set", "gpu_memory_utilization=0.99"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "verdict     cudagraph_oom: RuntimeError: CUDA out of memory occurred when warming up sampler with 1024" in out
    assert ("fix         fails in the sampler warm-up after CUDA-graph capture (1024 rows: 1.31 GiB short of its 2.78 "
            "GiB): lower max_num_seqs to <= 32 (it then fits by vLLM's count, inside the band: warned), or lower "
            "gpu_memory_utilization to <= 0.94") in out
    rc = _run([*base, "--set", "gpu_memory_utilization=0.95", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["warmup_at_risk"] is True and round(doc["warmup_margin_gib"], 2) == 1.85
