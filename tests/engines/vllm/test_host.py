"""The GPU worker's install, read where the trial runs: the FlashInfer probe, the launched server's environment, and
the pre-screen's plan of a real trial agreeing with both."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from servetune.cluster.local import LocalPool
from servetune.engines.vllm.engine import VllmLaunch, serve_argv
from servetune.engines.vllm.host import probe_has_flashinfer, server_environ
from servetune.envs import LAUNCH_SAFE_ENV
from servetune.planner.comm import FI_ALLREDUCE_FUSION_WORKSPACE_GIB, SERVETUNE_LAUNCH_ENV, CommEnv, trial_env
from servetune.search.propose import prescreen
from servetune.spec.schema import StudySpec
from servetune.study._driver import probed_trial_env


def _package(root: Path, name: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("", encoding="utf-8")


def _nvcc(bin_dir: Path) -> str:
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return str(bin_dir)


@pytest.fixture
def no_flashinfer_here() -> None:
    import importlib.util
    assert importlib.util.find_spec("flashinfer") is None  # the test machine has none: each test installs its own


def test_the_probe_reads_the_install_as_vllm_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   no_flashinfer_here: None) -> None:
    with_nvcc = {"PATH": _nvcc(tmp_path / "cuda" / "bin")}
    without_nvcc = {"PATH": str(tmp_path / "empty")}
    assert not probe_has_flashinfer(with_nvcc)  # no flashinfer package: vLLM runs no fusion, whatever else
    _package(tmp_path / "site", "flashinfer")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert probe_has_flashinfer(with_nvcc)  # the package, and nvcc to build its kernels
    assert not probe_has_flashinfer(without_nvcc)  # the package alone: has_flashinfer() False
    assert probe_has_flashinfer({**without_nvcc, "VLLM_HAS_FLASHINFER_CUBIN": "1"})
    _package(tmp_path / "site", "flashinfer_cubin")
    assert probe_has_flashinfer(without_nvcc)


def test_the_server_gets_the_environment_the_probe_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # an operator's shell: servetune's launch variables win
    monkeypatch.setenv("VLLM_HAS_FLASHINFER_CUBIN", "1")
    env = server_environ({"VLLM_CACHE_ROOT": "/cache/vllm"})
    assert {k: env[k] for k in LAUNCH_SAFE_ENV} == LAUNCH_SAFE_ENV
    assert env["VLLM_HAS_FLASHINFER_CUBIN"] == "1" and env["VLLM_CACHE_ROOT"] == "/cache/vllm"
    assert env["PATH"] == os.environ["PATH"]
    launched = CommEnv.from_mapping(env, "launch")
    for flashinfer in (True, False, None):
        planned = trial_env(True, flashinfer)
        assert (planned.nvls, planned.symm_mem, planned.torch_multicast) == (
            launched.nvls, launched.symm_mem, launched.torch_multicast)


def _spec(backend: str) -> StudySpec:
    return StudySpec.from_dict({
        "name": "fusion", "model": "llama-3.1-8b", "gpu": {"type": "H100-80GB", "count": 2}, "vllm_version": "0.19.0",
        "workload": {"input_len": 512, "output_len": 256, "num_requests": 64, "concurrency": 64},
        "search_space": {"params": {"max_num_seqs": [64, 128]}},
        "fixed_flags": {"tensor_parallel_size": 2, "max_model_len": 8192, "gpu_memory_utilization": 0.9},
        "storage": {"optuna_url": "memory"}, "backend": backend}, cwd="/tmp")


def test_a_real_trial_at_tp2_on_h100_with_vllm_0_19_is_planned_as_launched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_flashinfer_here: None) -> None:
    """The driver probes a worker (here: the local pool, this process), and the pre-screen's plan charges the
    fusion workspace exactly where the probe says vLLM will allocate it; the argv leaves vLLM's default -O2 on."""
    flags = {"tensor_parallel_size": 2, "max_model_len": 8192, "gpu_memory_utilization": 0.9, "max_num_seqs": 64}
    argv = serve_argv(VllmLaunch(model="meta-llama/Llama-3.1-8B-Instruct", flags=flags), 8000)
    assert "--tensor-parallel-size" in argv and not {"-O", "-O0", "-O1", "--compilation-config",
                                                     "--enforce-eager"} & set(argv)
    real, pool = _spec("vllm"), LocalPool(2)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    absent = probed_trial_env(pool, "vllm", "H100-80GB")
    _package(tmp_path / "site", "flashinfer")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PATH", _nvcc(tmp_path / "cuda" / "bin"))
    present = probed_trial_env(pool, "vllm", "H100-80GB")
    assert (absent.flashinfer_fusion, present.flashinfer_fusion) == (False, True)
    assert probed_trial_env(pool, "sim", "H100-80GB") == SERVETUNE_LAUNCH_ENV  # the simulator's host: none

    plans = {name: prescreen(real, flags, env=env)[1] for name, env in
             (("present", present), ("absent", absent), ("unprobed", None))}
    assert all(p is not None and p.fits and p.comm is not None for p in plans.values())
    on, off, unprobed = plans["present"], plans["absent"], plans["unprobed"]
    assert on.comm.fused_allreduce and not off.comm.fused_allreduce and unprobed.comm.fused_allreduce
    assert off.memory.kv_cache - on.memory.kv_cache == pytest.approx(FI_ALLREDUCE_FUSION_WORKSPACE_GIB, abs=1e-6)
    assert off.kv_cache_tokens > on.kv_cache_tokens == unprobed.kv_cache_tokens
    # a simulated trial of the same flags keeps the measured host's plan (no workspace)
    assert prescreen(_spec("sim"), flags)[1] == off


def test_the_study_says_which_plan_its_real_trials_get() -> None:
    import io

    from servetune.study import TerminalProgress

    lines = []
    for env in (trial_env(True, True), trial_env(True, False), trial_env(True)):
        out = io.StringIO()
        TerminalProgress(out, 1).planned_with(env)
        lines.append(out.getvalue())
    assert "charges vLLM 0.17+'s FlashInfer all-reduce fusion workspace" in lines[0] and "probed" in lines[0]
    assert "charges no FlashInfer all-reduce fusion workspace" in lines[1]
    assert "not probed: assumed usable" in lines[2]
