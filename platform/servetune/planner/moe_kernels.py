"""Whether vLLM ships a tuned Triton fused-MoE kernel config for a model's experts on a GPU.

vLLM's Triton fused-MoE kernel (the backend it picks for bf16 experts on Hopper and Ampere, and for
per-tensor FP8 experts where FlashInfer is absent) reads its tile sizes from a JSON file named
``E=<experts>,N=<intermediate per rank>,device_name=<torch device name>[,dtype=...][,block_shape=...].json``
(``vllm/model_executor/layers/fused_moe/fused_moe.py``: ``get_config_file_name``, ``get_moe_configs``).
Where the file is missing it logs "Using default MoE config. Performance might be sub-optimal!" and
runs a generic tile. On the real 2026-12-05 H100 runs of a Qwen3-30B-A3B shape (vLLM 0.26.0,
``tests/fixtures/real_h100_classes``: no ``E=128,N=768`` file for the H100, one for the H200) the
bf16 experts on the default tile served 2.5-3x fewer output tokens per second than the same model's
FP8 experts (also on a default tile: no ``dtype=fp8_w8a8`` file either) at 128-256 clients, and about
as many at one client.

The list of files is vLLM 0.26.0's (``data/vllm_moe_configs.json``, with its source); for a release before
:data:`TILE_TABLE_UNTIL` asked about by version, vLLM 0.11.0's (``data/vllm_moe_tiles.json``: its unquantized and
block-quantized fp8 files, the ones the simulator prices there), the nearer of the two lists kept. A tuned file
of one's own (``VLLM_TUNED_CONFIG_FOLDER``, vLLM's ``benchmarks/kernels/benchmark_moe.py --tune``)
is not seen here.

Example:
    >>> from servetune.planner.modelinfo import load_model
    >>> k = moe_kernel_config(load_model("qwen3-30b-a3b"), "H100-80GB", tp=1)
    >>> k.file_name, k.tuned
    ('E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3.json', False)
    >>> moe_kernel_config(load_model("qwen3-30b-a3b"), "H200", tp=1).tuned
    True
    >>> moe_kernel_config(load_model("qwen3-30b-a3b"), "H100-80GB", tp=2).tuned  # N = 768 / 2
    True
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from typing import Any

__all__ = ["MoeKernelConfig", "TILE_TABLE_UNTIL", "TORCH_DEVICE_NAMES", "moe_kernel_config", "moe_kernel_note", "tuned_config_files",
           "tuned_moe_tiles", "tuned_tile_table"]

#: servetune GPU name -> ``torch.cuda.get_device_name()`` with spaces as underscores (what vLLM's
#: ``get_device_name_as_file_name`` gives; vLLM maps every H200 variant to ``NVIDIA_H200``).
#: Only GPUs whose torch name is known from published logs or vLLM's own config files.
TORCH_DEVICE_NAMES: dict[str, str] = {
    "H100-80GB": "NVIDIA_H100_80GB_HBM3", "H100-PCIe": "NVIDIA_H100_PCIe", "H100-NVL": "NVIDIA_H100_NVL",
    "H800": "NVIDIA_H800", "H20": "NVIDIA_H20", "H200": "NVIDIA_H200", "H200-NVL": "NVIDIA_H200",
    "A100-80GB": "NVIDIA_A100-SXM4-80GB", "A800-80GB": "NVIDIA_A800-SXM4-80GB", "A100-40GB": "NVIDIA_A100-SXM4-40GB",
    "L40S": "NVIDIA_L40S", "L4": "NVIDIA_L4", "RTX-4090": "NVIDIA_GeForce_RTX_4090", "B200": "NVIDIA_B200",
    "MI300X": "AMD_Instinct_MI300X",
}


#: Releases before this one are checked against vLLM 0.11.0's tuned files (``data/vllm_moe_tiles.json``) where that
#: table keeps the experts' format, later ones against 0.26.0's list: the release from which the simulator prices
#: the by-batch default tiles instead of 0.11's tuned ones (``sim._moe_tiles.MOE_TILE_BY_BATCH_SINCE``; a test
#: holds the two equal).
TILE_TABLE_UNTIL: tuple[int, int, int] = (0, 17, 0)


@dataclasses.dataclass(frozen=True)
class MoeKernelConfig:
    """The tuned-config file vLLM looks for, and whether its release ships it."""

    file_name: str
    tuned: bool
    vllm_version: str  # the release whose file list was checked


@functools.lru_cache(maxsize=1)
def tuned_config_files() -> tuple[str, frozenset[str]]:
    """(vLLM version, the file names it ships) from ``data/vllm_moe_configs.json``."""
    data = json.loads(resources.files("servetune").joinpath("data/vllm_moe_configs.json").read_text())
    return str(data["vllm_version"]), frozenset(data["files"])


@functools.lru_cache(maxsize=1)
def tuned_tile_table() -> tuple[str, dict[str, tuple[tuple[int, int, int], ...]]]:
    """(vLLM version, file stem -> ((M, BLOCK_SIZE_M, BLOCK_SIZE_N), ...) ascending in M) from
    ``data/vllm_moe_tiles.json``: vLLM 0.11.0's tuned configs on NVIDIA GPUs for unquantized and for
    block-quantized fp8 (128 x 128) experts."""
    data = json.loads(resources.files("servetune").joinpath("data/vllm_moe_tiles.json").read_text())
    tiles = {name: tuple((int(m), int(bm), int(bn)) for m, bm, bn in rows) for name, rows in data["tiles"].items()}
    return str(data["vllm_version"]), tiles


def tuned_moe_tiles(model: Any, gpu_name: str, tp: int, experts: int | None = None) -> tuple[tuple[int, int, int], ...]:
    """The tiles of the tuned fused-MoE config vLLM 0.11.0 ships for this model's experts on ``gpu_name``
    at ``tp`` (no expert parallelism): ``((M, BLOCK_SIZE_M, BLOCK_SIZE_N), ...)`` by batch key, or ``()``
    where it ships none, the experts are neither unquantized nor block-quantized fp8 (the formats whose
    files are kept) or the GPU's torch name is not known.

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> tiles = tuned_moe_tiles(load_model("qwen3-30b-a3b"), "H100-80GB", tp=4)  # E=128,N=192
        >>> tiles[-1], tuned_moe_tiles(load_model("qwen3-30b-a3b"), "H100-80GB", tp=1)  # N=768: none
        ((4096, 128, 128), ())
    """
    config = moe_kernel_config(model, gpu_name, tp, experts=experts)
    if config is None or not _tile_table_keeps(model):
        return ()
    return tuned_tile_table()[1].get(config.file_name.removesuffix(".json"), ())


def _tile_table_keeps(model: Any) -> bool:
    """Whether ``data/vllm_moe_tiles.json`` keeps the files of this model's expert format: unquantized and
    block-quantized fp8 experts only."""
    return not model.quantization or bool(model.quant_block_k)


def _dtype_selector(model: Any, quantization: str | None) -> str | None:
    """vLLM's ``_get_config_dtype_str`` for the experts, or None where the Triton kernel is not the one."""
    method = quantization or model.quantization
    if method is None:
        return ""
    if method == "fp8":
        block = model.quant_block_k
        # Block-quantized FP8 checkpoints use square blocks (``weight_block_size`` [128, 128]).
        return ",dtype=fp8_w8a8" + (f",block_shape=[{block},{block}]" if block else "")
    return None  # MXFP4 (triton_kernels), w4a16 (Marlin), ...: other kernels, other tuning


def moe_kernel_config(model: Any, gpu_name: str, tp: int, quantization: str | None = None,
                      experts: int | None = None, version: tuple[int, int, int] | None = None) -> MoeKernelConfig | None:
    """The fused-MoE tuned config vLLM would look for at ``tp``, or None where the model has no routed experts,
    its experts run another kernel, or the GPU's torch name is not known. ``experts``: the experts a rank holds
    under expert parallelism (``tp`` 1): vLLM names the file by the layer's local ``E = w1.size(0)``; None: all.
    ``version``: the vLLM release asked about; before :data:`TILE_TABLE_UNTIL`, 0.11.0's files where they are kept
    for the experts' format (None: 0.26.0's list).

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> [(k.vllm_version, k.tuned) for k in (moe_kernel_config(load_model("qwen3-30b-a3b"), "H100-80GB", 4, version=v)
        ...                                      for v in ((0, 11, 0), (0, 26, 0)))]  # E=128,N=192
        [('0.11.0', True), ('0.26.0', True)]
    """
    device = TORCH_DEVICE_NAMES.get(gpu_name)
    selector = _dtype_selector(model, quantization) if model.is_moe else None
    if device is None or selector is None or model.quantized_experts_only:
        return None
    n = model.expert_intermediate_size // tp
    e = model.num_experts if experts is None else experts
    name = f"E={e},N={n},device_name={device}{selector}.json"
    if version is not None and tuple(version) < TILE_TABLE_UNTIL and _tile_table_keeps(model) and not quantization:
        release, tiles = tuned_tile_table()
        return MoeKernelConfig(name, name.removesuffix(".json") in tiles, release)
    release, files = tuned_config_files()
    return MoeKernelConfig(name, name in files, release)


def moe_kernel_note(model: Any, gpu_name: str, tp: int, quantization: str | None = None,
                    experts: int | None = None, version: tuple[int, int, int] | None = None) -> str | None:
    """``plan``'s line when vLLM will run this model's experts on its default (untuned) tile, else None
    (``version``: as :func:`moe_kernel_config` takes it).

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> print(moe_kernel_note(load_model("qwen3-30b-a3b"), "H100-80GB", 1))  # doctest: +ELLIPSIS
        fused-MoE kernel: vLLM 0.26.0 ships no tuned config E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3.json...
    """
    k = moe_kernel_config(model, gpu_name, tp, quantization, experts=experts, version=version)
    if k is None or k.tuned:
        return None
    return (f"fused-MoE kernel: vLLM {k.vllm_version} ships no tuned config {k.file_name}, so it runs the default "
            "tile (\"Using default MoE config\"); on a real H100 (Qwen3-30B-A3B shape) bf16 experts on that tile "
            "served 2.5-3x fewer tokens/s at 128-256 sequences than the same model's FP8 experts: tune one with "
            "vLLM's benchmarks/kernels/benchmark_moe.py --tune and point VLLM_TUNED_CONFIG_FOLDER at it, or try "
            "another tensor_parallel_size / quantization")
