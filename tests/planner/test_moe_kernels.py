"""The fused-MoE tuned-config lookup against vLLM's own log lines and its release's file list."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.planner.moe_kernels import TORCH_DEVICE_NAMES, moe_kernel_config, tuned_config_files

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real_h100_classes"
MISSING = re.compile(r"Config file not found at \S*/configs/(\S+\.json)")


@pytest.mark.parametrize("start, quantization", [("2026-12-05_q3moe_u09_s256_mbt8192", None),
                                                 ("2026-12-05_q3moe_fp8_u09_s256_mbt8192", "fp8")])
def test_the_file_name_is_the_one_vllm_looked_for(start: str, quantization: str | None) -> None:
    text = gzip.decompress((FIXTURES / start / "server.log.gz").read_bytes()).decode()
    logged = MISSING.search(text).group(1)
    k = moe_kernel_config(load_model("qwen3-30b-a3b"), "H100-80GB", tp=1, quantization=quantization)
    assert k is not None and k.file_name == logged and not k.tuned


def test_the_file_list_is_vllms_and_names_known_devices() -> None:
    version, files = tuned_config_files()
    assert version == "0.26.0" and len(files) > 300
    assert all(f.startswith("E=") and f.endswith(".json") and ",N=" in f and "device_name=" in f for f in files)
    devices = {re.search(r"device_name=([^,]+?)(?:,|\.json)", f).group(1) for f in files}
    # Every H100/H200/A100 name servetune maps to is one vLLM's files use.
    for gpu in ("H100-80GB", "H200", "A100-80GB", "A100-40GB", "L40S", "B200", "MI300X"):
        assert TORCH_DEVICE_NAMES[gpu] in devices, gpu
    for gpu in TORCH_DEVICE_NAMES:
        get_gpu(gpu)  # every key is a GPU of the table


def test_rank_shapes_follow_tensor_parallelism() -> None:
    m = load_model("qwen3-30b-a3b")
    assert moe_kernel_config(m, "H100-80GB", tp=2).file_name == "E=128,N=384,device_name=NVIDIA_H100_80GB_HBM3.json"
    assert moe_kernel_config(m, "H100-80GB", tp=2).tuned
    assert moe_kernel_config(m, "H200", tp=1).tuned
    assert moe_kernel_config(load_model("llama-3.1-8b"), "H100-80GB", tp=1) is None  # no experts
    assert moe_kernel_config(m, "T4", tp=1) is None  # torch name not known: no claim


def test_plan_says_so_only_where_the_file_is_missing() -> None:
    m = load_model("qwen3-30b-a3b")
    flags = {"max_model_len": 4096}

    def notes(gpu: str, **extra) -> list[str]:
        g = get_gpu(gpu)
        return [n for n in plan_memory(m, g, resolve_engine_config({**flags, **extra}, m, g)).notes
                if n.startswith("fused-MoE kernel")]

    assert len(notes("H100-80GB")) == 1 and "E=128,N=768" in notes("H100-80GB")[0]
    assert notes("H200") == []
    assert notes("H100-80GB", tensor_parallel_size=2) == []


def test_a_release_before_0_17_is_checked_against_vllm_0_11s_files_where_they_are_kept() -> None:
    """Asked about vLLM 0.11-0.16, the note checks vLLM 0.11.0's tuned files (the ones the simulator prices there);
    from 0.17, and for per-tensor fp8 experts the 0.11 table does not keep, vLLM 0.26.0's list. GLM-4.5-Air's experts
    at TP=4 on A100s (E=128, N=352) have no tuned A100 file in either; Qwen3-30B-A3B's at TP=1 on an H100 (N=768)
    have none in 0.11.0 either; at TP=2 on an H200 (N=384) 0.11.0 ships one."""
    from servetune.planner.moe_kernels import TILE_TABLE_UNTIL
    from servetune.sim._moe_tiles import MOE_TILE_BY_BATCH_SINCE

    assert TILE_TABLE_UNTIL == MOE_TILE_BY_BATCH_SINCE
    m = load_model("qwen3-30b-a3b")
    old, new = (0, 11, 0), (0, 26, 0)
    k = moe_kernel_config(m, "H100-80GB", tp=1, version=old)
    assert (k.vllm_version, k.tuned) == ("0.11.0", False)
    assert moe_kernel_config(m, "H200", tp=2, version=old).tuned
    assert moe_kernel_config(m, "H100-80GB", tp=1, version=(0, 17, 0)).vllm_version == "0.26.0"
    assert moe_kernel_config(m, "H100-80GB", tp=1, quantization="fp8", version=old).vllm_version == "0.26.0"
    a100 = get_gpu("A100-80GB")
    glm = load_model(str(FIXTURES.parent / "published_runs" / "models" / "glm-4.5-air"))
    for version, release in ((old, "0.11.0"), (new, "0.26.0")):
        config = resolve_engine_config({"tensor_parallel_size": 4, "max_model_len": 4096}, glm, a100,
                                       ".".join(map(str, version)))
        said = [n for n in plan_memory(glm, a100, config).notes if n.startswith("fused-MoE kernel")]
        assert len(said) == 1 and said[0].startswith(f"fused-MoE kernel: vLLM {release} ships no tuned config "
                                                     "E=128,N=352,device_name=NVIDIA_A100-SXM4-80GB.json"), said
