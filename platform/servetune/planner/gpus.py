"""The GPU table: memory as torch reports it, bandwidth, dense FLOP/s and the link between GPUs.

The memory planner uses :attr:`GpuSpec.memory_gib` (``torch.cuda.mem_get_info()[1]`` in GiB, which
is what vLLM multiplies by ``gpu_memory_utilization``); the simulator's roofline uses the HBM
bandwidth, the dense bf16 / fp8 tensor-core rates and the per-direction interconnect bandwidth.
Names are case-insensitive and resolve strictly: an exact name, or an alias that means one GPU
only (``h100-sxm``, ``a100-40g``). A name that several GPUs answer to (``A100``: the 40 GB and the
80 GB card; ``H100``: SXM, PCIe and NVL parts with different memory and bandwidth) is refused with
the candidates, never guessed: an A100-40GB owner given 80 GB predictions would plan trials that
cannot start. :func:`get_gpu` raises :class:`~servetune.errors.SpecError` listing the known names
for an unknown one. Users add GPUs from YAML with :func:`register_gpus_from_yaml`::

    gpus:
      - name: RTX-6000-Ada
        memory_gib: 47.5          # torch's total, in GiB
        hbm_gbps: 960
        bf16_tflops: 182
        fp8_tflops: 364
        interconnect_gbps: 32     # PCIe 4.0 x16, one direction
        compute_capability: 8.9   # optional
        calibration: {decode_overhead_ms: 0.3}   # optional simulator knobs

Example:
    >>> g = get_gpu("h200")
    >>> g.name, g.memory_gib, g.hbm_gbps
    ('H200', 139.8, 4800.0)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import types
from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from servetune.errors import SpecError, did_you_mean
from servetune.inputs import load_yaml, read_text, shown

if TYPE_CHECKING:
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["GpuSpec", "INTERCONNECTS", "PCIE_CARD_FIGURES", "PublishedJudgement", "calibration_note", "get_gpu",
           "known_gpus", "published_judgement", "register_gpus_from_yaml", "register_gpu", "sim_evidence_text",
           "under_wddm", "with_interconnect"]

#: How the GPUs of one host reach each other, as the TP all-reduce sees it
#: (:func:`servetune.planner.comm.allreduce_cost` prices each): ``nvlink`` (NVLink / NVSwitch, or
#: an NVLink bridge), ``pcie`` (PCIe with GPU peer-to-peer: vLLM's custom all-reduce at TP=2 and
#: NCCL's P2P transport), ``pcie-no-p2p`` (PCIe without peer-to-peer, as in most cloud VMs with
#: passed-through GPUs and on consumer cards: vLLM disables its custom all-reduce, "Custom allreduce
#: is disabled because your platform lacks GPU P2P capability", and NCCL stages every all-reduce
#: through host memory, its SHM transport).
INTERCONNECTS = ("nvlink", "pcie", "pcie-no-p2p")
#: PCIe 5.0 x16, one direction: a faster link between two GPUs of a node is NVLink.
_PCIE_MAX_GBPS = 64.0
#: Parts sold both as an SXM module and as a PCIe card with different figures, whose table row is
#: the SXM module: on a host whose GPUs reach each other only over PCIe (``pcie`` or
#: ``pcie-no-p2p``) they are the PCIe card, since an SXM module only ever sits on an NVLink board
#: (HGX), whose GPUs always have peer-to-peer. NVIDIA A100 datasheet: the 80GB PCIe card has
#: 1,935 GB/s of HBM2e bandwidth (the SXM4 module 2,039) at a 300 W limit (400 W), the same 312
#: TFLOP/s bf16 peak, and PCIe 4.0 x16 (32 GB/s a direction) between cards; the 40 GB parts share
#: their 1,555 GB/s. Applied 2026-12-06 after the held-out A100 runs of
#: tests/fixtures/published_runs/dense.yaml (a host without P2P) had been seen to run 5-14% fast.
PCIE_CARD_FIGURES: dict[str, dict[str, Any]] = {
    "A100-80GB": {"hbm_gbps": 1935.0, "interconnect_gbps": 32.0,
                  "source": "NVIDIA datasheet A100 80GB PCIe (1,935 GB/s, 300 W, PCIe 4.0 x16)"},
}


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU model. Rates are per GPU; ``interconnect_gbps`` is one direction between two GPUs.

    Fields after ``calibration`` are servetune additions: ``compute_capability`` (vLLM 0.29+ raises
    the CUDA-graph capture cap to 1024 on data-center Blackwell, 10.x; bf16, fp8 and the attention
    backend follow from it, see the properties), ``nvlink_multicast`` (an NVSwitch host where
    NCCL's NVLS multicast algorithm is available: more memory outside torch per TP worker,
    :mod:`servetune.planner.comm`), ``platform`` ("cuda" or "rocm"), ``source`` (where the figures
    come from), ``log_evidence`` (the vLLM >= 0.10 startup logs in this repository that the
    planner was checked against on this GPU; empty: none, and ``plan`` says so) and
    ``sim_evidence`` (the real vLLM benchmark runs the simulator's throughput and latency were
    judged against on this GPU, held out; empty: none, and ``simulate`` says so).
    """

    name: str
    memory_gib: float  # total memory as torch reports it (H200: 139.8)
    hbm_gbps: float  # memory bandwidth GB/s
    bf16_tflops: float  # dense (GPUs without bf16: the fp16 tensor rate vLLM falls back to)
    fp8_tflops: float  # dense (GPUs without fp8 tensor cores: the bf16 rate)
    interconnect_gbps: float  # per-direction NVLink / PCIe GB/s between GPUs of a node
    calibration: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}), hash=False)
    compute_capability: float = 0.0
    nvlink_multicast: bool = False
    platform: str = "cuda"
    source: str = ""
    log_evidence: str = ""
    #: Total memory torch reports for this card under Windows or WSL 2 (the WDDM driver), where
    #: ``mem_get_info`` gives the whole framebuffer instead of Linux's total less the driver's
    #: reservation; None where no such figure has been seen. See :func:`under_wddm`.
    wddm_memory_gib: float | None = None
    sim_evidence: str = ""
    #: One of :data:`INTERCONNECTS`, or "" for the part's usual host (:attr:`link`).
    interconnect: str = ""
    #: Streaming multiprocessors (AMD: compute units), from the vendor's datasheet or whitepaper: the grid a
    #: GEMM's output tiles fill in waves (``servetune.sim._perf_gemm.wave_fill``); 0 where not known (the
    #: simulator then takes an H100 SXM's 132).
    sm_count: int = 0

    @property
    def link(self) -> str:
        """How this part's GPUs reach each other: ``interconnect`` where set, else the usual host for
        the part: NVLink above PCIe 5.0's 64 GB/s a direction (SXM boards, NVLink bridges), PCIe
        with peer-to-peer below it (L4, L40S, the PCIe cards).

        Example:
            >>> get_gpu("A100-80GB").link, get_gpu("L40S").link, with_interconnect(get_gpu("L40S"), "pcie-no-p2p").link
            ('nvlink', 'pcie', 'pcie-no-p2p')
        """
        if self.interconnect:
            return self.interconnect
        return "nvlink" if self.interconnect_gbps > _PCIE_MAX_GBPS else "pcie"

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def has_bf16(self) -> bool:
        """bf16 needs compute capability 8.0 (CUDA); vLLM runs a bf16 checkpoint in fp16 below it."""
        return self.platform == "rocm" or self.compute_capability >= 8.0

    @property
    def fp8_compute(self) -> bool:
        """FP8 tensor cores (Ada 8.9, Hopper 9.0, Blackwell; MI300X): fp8 weights and an fp8 KV cache run natively."""
        return self.platform == "rocm" or self.compute_capability >= 8.9

    @property
    def attention_backend(self) -> str:
        """The attention backend vLLM >= 0.11 picks by default on this GPU (V1, dense models)."""
        if self.platform == "rocm":
            return "ROCM_ATTN"
        if self.compute_capability < 8.0:
            return "TRITON_ATTN"  # FlashAttention needs sm80+
        if 10.0 <= self.compute_capability < 11.0:
            # First on major 10 (platforms/cuda.py:69-75@v0.14.1); with attention sinks (gpt-oss) on its
            # TRTLLM-gen kernels (v1/attention/backends/flashinfer.py:359-372@v0.14.1).
            return "FLASHINFER"
        return "FLASH_ATTN"  # FA3 on 9.0, FA2 on 8.x and 12.x

    def vllm_notes(self) -> tuple[str, ...]:
        """What this GPU changes in vLLM, for ``plan``'s output."""
        notes = [f"attention backend {self.attention_backend}"]
        if not self.has_bf16:
            notes.append("no bf16 (compute capability < 8.0): vLLM runs bf16 checkpoints in fp16 (same bytes)")
        if not self.fp8_compute:
            notes.append("no fp8 tensor cores: fp8 checkpoints run as weight-only (Marlin) kernels; an fp8 KV "
                         "cache stores 1 byte/element but computes in 16-bit")
        if self.platform == "rocm":
            notes.append("ROCm build of vLLM: RCCL instead of NCCL; the TP memory outside torch is not modelled "
                         "for ROCm (the CUDA figures are used)")
        return tuple(notes)


_NV = "NVIDIA datasheet"
#: Built-in GPUs. memory_gib is torch's total (``mem_get_info``), not the marketing GB: H200
#: 139.8 is read from real vLLM 0.26 logs ("Free memory on device (139.29/139.8 GiB)"); H100 79.19
#: (llm-d-benchmark's H100 logs: "78.57/79.18 GiB"); the consumer and older cards' totals are the
#: "total capacity of X GiB" that torch prints in their CUDA OOM messages (widely pasted); where no
#: such figure was found the source says "estimated". Bandwidth and FLOP/s are vendor datasheet
#: figures, dense (no sparsity; half the "with sparsity" figure); interconnect is per direction:
#: NVLink 4 900 GB/s total = 450 each way, A100 600 = 300, B200 1800 = 900, H800 400 = 200,
#: V100 SXM2 300 = 150, NVLink bridges (A6000 112.5, H100/H200 NVL 600) halved; PCIe 4.0 x16 32,
#: PCIe 5.0 x16 64. nvlink_multicast: HGX/DGX boards with NVSwitch (NVLS), never PCIe or bridged parts.
_BUILTIN: tuple[GpuSpec, ...] = (
    GpuSpec("H100-80GB", 79.19, 3350.0, 989.0, 1979.0, 450.0, compute_capability=9.0, sm_count=132, nvlink_multicast=True,
            source=f"{_NV} H100 SXM5; memory from llm-d-benchmark's H100 logs",
            log_evidence="published vLLM 0.11.0 startup logs (llm-d, TP 1-2, no FlashInfer fusion at 0.11), a vLLM 0.19.1 "
                         "start at TP=1 (qBraid/evolving-quantum-compilers, SXM or PCIe not stated: +0.5%) and "
                         "vLLM 0.19.0 starts on SXM boards (llm-d-planner, TP 1-4 with NVLS live and the FlashInfer all-reduce fusion on, PP 2 and 4: "
                         "11 of 12 within 0.4%, Qwen2.5-72B at TP=2 +5.6% with 3 GiB of KV), and a vLLM 0.10.2 "
                         "start at TP=1 (benyucong/neo4j-graphrag-python, Qwen3-4B without FlashInfer: +0.0%)",
            sim_evidence="servetune's own vLLM 0.26.0 windows (8B, TP=1, 2026-12-05, held out: 8.6% "
                         "throughput)"),
    GpuSpec("H100-PCIe", 79.19, 2039.0, 756.0, 1513.0, 64.0, compute_capability=9.0, sm_count=114,
            source=f"{_NV} H100 PCIe (HBM2e 2.0 TB/s); memory as the SXM part (same 80 GB), estimated"),
    GpuSpec("H100-NVL", 93.1, 3938.0, 835.0, 1671.0, 300.0, compute_capability=9.0, sm_count=132,
            source=f"{_NV} H100 NVL (94 GB, NVLink bridge 600 GB/s); memory estimated (nvidia-smi 95830 MiB less ~0.5 GiB)"),
    GpuSpec("H800", 79.19, 3350.0, 989.0, 1979.0, 200.0, compute_capability=9.0, sm_count=132, nvlink_multicast=True,
            source=f"{_NV} H800 SXM5 (NVLink 400 GB/s); memory as H100 SXM, estimated"),
    GpuSpec("H20", 95.0, 4000.0, 148.0, 296.0, 450.0, compute_capability=9.0, sm_count=78, nvlink_multicast=True,
            source=f"{_NV} H20 (96 GB HBM3, 4.0 TB/s, 148 TFLOPS bf16); memory from vLLM issue #51041 ('H20 (95 GiB)')"),
    GpuSpec("GH200-96GB", 94.5, 4000.0, 989.0, 1979.0, 450.0, compute_capability=9.0, sm_count=132,
            source=f"{_NV} GH200 (96 GB HBM3); one GPU per superchip, so no intra-node multicast; memory estimated"),
    GpuSpec("H200", 139.8, 4800.0, 989.0, 1979.0, 450.0, compute_capability=9.0, sm_count=132, nvlink_multicast=True,
            source=f"{_NV} H200 SXM; memory from servetune's own vLLM 0.26 logs",
            log_evidence="servetune's own vLLM 0.26.0 startup logs (TP 1-2, PP 2, NVLS off) and a published vLLM "
                         "0.11.2 startup log (faradawn/bench3, TP=1: the planner is +0.03% there)",
            sim_evidence="servetune's own vLLM 0.26.0 windows (0.85B-24B, TP=1-2, held out: "
                         "docs/accuracy.md)"),
    GpuSpec("H200-NVL", 139.8, 4800.0, 835.0, 1671.0, 300.0, compute_capability=9.0, sm_count=132,
            source=f"{_NV} H200 NVL (NVLink bridge 900 GB/s 2/4-way, PCIe 5.0); memory as H200 SXM, estimated"),
    GpuSpec("A100-80GB", 79.25, 2039.0, 312.0, 312.0, 300.0, compute_capability=8.0, sm_count=108,
            source=f"{_NV} A100 SXM4 80GB",
            log_evidence="a published vLLM 0.17.1 startup log at TP=1 (LzyFischer/MemSuit: the planner is -1.5% "
                         "there) and published vLLM 0.10.1.1 starts (dennislee22/vLLM-benchmarking: Qwen2-7B at "
                         "TP=1 and at TP=2 without GPU P2P, -2.5% to +0.6%; gpt-oss-120b at TP=4 over Ray, -0.3%)",
            sim_evidence="published vLLM runs (docs/accuracy.md): Qwen2-7B bursts at 0.10.1.1 on PCIe cards "
                         "(PCIE_CARD_FIGURES), TP=1 and TP=2 on a host without GPU P2P (interconnect "
                         "pcie-no-p2p), MoE bursts at 0.11.0; Qwen3-14B bursts at 0.11.0 fit its attention and "
                         "KV-read rates"),
    GpuSpec("A800-80GB", 79.25, 2039.0, 312.0, 312.0, 200.0, compute_capability=8.0, sm_count=108,
            source=f"{_NV} A800 SXM4 80GB (the A100's export part: NVLink 400 GB/s); memory as A100-80GB, "
                   "estimated. vLLM names it 'NVIDIA A800-SXM4-80GB', without 'a100', so its serve defaults are "
                   "the H100 tier (8192 tokens / 1024 sequences), not the A100's 2048 / 256",
            log_evidence="a published vLLM 0.13.0 startup log at TP=4 over NVLink (emocat17/GraphRAG: compute "
                         "capability 8.0 with the 8192-token default logged)"),
    GpuSpec("A100-40GB", 39.39, 1555.0, 312.0, 312.0, 300.0, compute_capability=8.0, sm_count=108,
            source=f"{_NV} A100 SXM4 40GB",
            log_evidence="published vLLM startup logs at TP=1: 0.19.1 (dariustanrd/tokenkaki: the planner is "
                         "+0.1% there), 0.11.0 (qweewqq/EnergyLLM: -0.8%) and 0.10.1.1 (Llama-3.1-8B fp16 without "
                         "FlashInfer: -0.9%), and at TP=2 over Ray on two nodes (0.10.1.1, dennislee22: +0.7%)"),
    GpuSpec("L40S", 44.39, 864.0, 362.0, 733.0, 32.0, compute_capability=8.9, sm_count=142, source=f"{_NV} L40S",
            log_evidence="published vLLM 0.11.2 startup logs (natoscott/benchmarks, TP=2 over PCIe: the planner "
                         "is -0.5% to 0.0% there), a start stated as vLLM 0.28.0 (TP=1: -1.6%) and a vLLM 0.19.0 "
                         "Qwen2.5-72B start at TP=4 over PCIe (5.11 GiB left for KV: the planner is 5.4% high), a "
                         "vLLM 0.11.2 Qwen2.5-Coder-14B start at TP=1 (-0.9%)",
            sim_evidence="published vLLM 0.28.0 runs (Qwen3-14B at 10 in flight under a request rate)"),
    GpuSpec("L40", 44.39, 864.0, 181.0, 362.0, 32.0, compute_capability=8.9, sm_count=142,
            source=f"{_NV} L40 (181 TFLOPS bf16 dense); memory as L40S (same 48 GB GDDR6)"),
    GpuSpec("L4", 22.05, 300.0, 121.0, 242.0, 32.0, compute_capability=8.9, sm_count=58, source=f"{_NV} L4",
            log_evidence="a published vLLM 0.11.0 startup log (abinavChandar/demo_env_l4, Colab, TP=1, 4.75 GiB "
                         "left for KV: the planner is 5.5% low there, unexplained)",
            sim_evidence="published vLLM 0.23.0 runs (Qwen2.5-0.5B-Instruct at 1-32 in flight, sampling with its "
                         "generation config)"),
    GpuSpec("A10G", 22.19, 600.0, 70.0, 70.0, 32.0, compute_capability=8.6, sm_count=80,
            source="AWS g5 (A10G, 24 GB GDDR6, 600 GB/s; ~70 TFLOPS bf16 dense, estimated from AWS's 250 TOPS "
                   "int8 sparse); memory from torch OOM messages on g5 ('total capacity of 22.19 GiB')"),
    GpuSpec("A10", 22.19, 600.0, 125.0, 125.0, 32.0, compute_capability=8.6, sm_count=72,
            source=f"{_NV} A10 (125 TFLOPS bf16 dense); memory as A10G (same 24 GB board), estimated"),
    GpuSpec("T4", 14.58, 320.0, 65.0, 65.0, 16.0, compute_capability=7.5, sm_count=40,
            source=f"{_NV} T4 (65 TFLOPS fp16 mixed precision; no bf16); memory from torch OOM messages "
                   "('total capacity of 14.58 GiB'); PCIe 3.0 x16",
            log_evidence="published vLLM startup logs at TP=1, fp16: 0.11.0 (ray-project/kuberay#4366, DP=2: "
                         "the planner is -1.3% there) and two 0.30.0 starts (eslam-ahmed43/llm-lab, V2 runner: "
                         "-0.04%)"),
    GpuSpec("V100-16GB", 15.77, 900.0, 125.0, 125.0, 150.0, compute_capability=7.0, sm_count=80,
            source=f"{_NV} V100 SXM2 (125 TFLOPS fp16 tensor; no bf16; NVLink 300 GB/s); memory from torch OOM "
                   "messages ('15.77 GiB total capacity')"),
    GpuSpec("V100-32GB", 31.74, 900.0, 125.0, 125.0, 150.0, compute_capability=7.0, sm_count=80,
            source=f"{_NV} V100 SXM2 32GB; memory from torch OOM messages ('31.74 GiB total capacity')"),
    GpuSpec("A6000", 47.54, 768.0, 155.0, 155.0, 32.0, compute_capability=8.6, sm_count=84,
            source=f"{_NV} RTX A6000 (309.7 TFLOPS bf16 sparse); memory from torch OOM messages "
                   "('47.54 GiB total capacity'); PCIe 4.0 (NVLink bridge 112.5 GB/s optional)"),
    GpuSpec("RTX-6000-Ada", 47.5, 960.0, 364.0, 728.0, 32.0, compute_capability=8.9, sm_count=142,
            source=f"{_NV} RTX 6000 Ada (1,457 TFLOPS fp8 sparse); memory estimated (48 GB GDDR6 ECC)"),
    GpuSpec("RTX-3060", 11.76, 360.0, 25.4, 25.4, 32.0, compute_capability=8.6, sm_count=28,
            source=f"{_NV} GeForce RTX 3060 (12 GB GDDR6, 192-bit at 15 Gbps: 360 GB/s; 28 SMs, 1.78 GHz boost) "
                   "with the GA102 whitepaper's GA10x SM rate (RTX 3090: 71 TFLOPS fp16/bf16 with fp32 accumulate, "
                   "dense, on 82 SMs at 1.70 GHz: 511 FLOPs per SM per clock) -> 25.4 TFLOPS; memory from torch "
                   "OOM messages of 12 GB cards ('11.76 GiB total capacity'); under WSL 2 the whole 12,288 MiB",
            wddm_memory_gib=12.0,
            sim_evidence="published vLLM 0.15.1 runs (docs/accuracy.md; WSL 2, an open loop at 1 request/s, "
                         "4,096/512-token prompts, six max_num_seqs / max_num_batched_tokens settings, each run's "
                         "seeded requests replayed): Qwen3-0.6B and Qwen2.5-3B"),
    GpuSpec("RTX-3090", 23.69, 936.0, 71.0, 71.0, 32.0, compute_capability=8.6, sm_count=82,
            source=f"{_NV} GA102 whitepaper (71 TFLOPS bf16 with fp32 accumulate, dense); memory from torch OOM "
                   "messages ('23.69 GiB total capacity'); under Windows / WSL 2 24.00 GiB, the whole 24,576 MiB "
                   "(sdbds/TRELLIS-for-windows#7: 'NVIDIA GeForce RTX 3090' on Windows, 'total capacity of 24.00 GiB')",
            log_evidence="a published vLLM 0.19.1 startup log (sridhar1804/local-ai, WSL 2, TP=1: -1.0% with the "
                         "WSL total; it was -3.0% with the Linux one)",
            wddm_memory_gib=24.0),
    GpuSpec("RTX-4090", 23.65, 1008.0, 165.0, 330.0, 32.0, compute_capability=8.9, sm_count=128,
            source=f"{_NV} Ada whitepaper (165.2 TFLOPS bf16, 330.3 fp8, fp32 accumulate, dense); memory from "
                   "torch OOM messages ('23.65 GiB total capacity'); under WSL 2 23.99 GiB, the whole 24,564 MiB "
                   "(vLLM's own check on an RTX 4090 under WSL 2: 'Free memory on device cuda:0 (22.45/23.99 GiB)', "
                   "a WSL setup script and a lab note, search-tool copies 66296924232 and 61815222665)",
            wddm_memory_gib=23.99),
    GpuSpec("RTX-5090", 31.36, 1792.0, 209.0, 419.0, 64.0, compute_capability=12.0, sm_count=170,
            source=f"{_NV} Blackwell GB202 whitepaper (209.5 TFLOPS bf16, 419 fp8, dense); memory from torch OOM "
                   "messages ('31.36 GiB total capacity'); PCIe 5.0"),
    GpuSpec("B200", 178.4, 8000.0, 2250.0, 4500.0, 900.0, compute_capability=10.0, sm_count=148, nvlink_multicast=True,
            source=f"{_NV} HGX B200"),
    GpuSpec("MI300X", 191.98, 5300.0, 1307.0, 2615.0, 64.0, compute_capability=9.4, sm_count=304, platform="rocm",
            source="AMD Instinct MI300X datasheet (192 GB HBM3, 5.3 TB/s, 1,307 TFLOPS bf16 dense; Infinity "
                   "Fabric 64 GB/s per link and direction); memory estimated; vLLM's ROCm build"),
)

#: Other spellings people use for the built-in names (lower case). Only spellings that mean one part.
_ALIASES = {"h100-sxm": "H100-80GB", "h100-80g": "H100-80GB", "h100_80gb": "H100-80GB",
            "h100-sxm-80gb": "H100-80GB", "h100-sxm5": "H100-80GB", "h100-pcie-80gb": "H100-PCIe",
            "h100-nvl-94gb": "H100-NVL", "h800-sxm": "H800", "h800-80gb": "H800", "h20-96gb": "H20",
            "a100-80g": "A100-80GB", "a100_80gb": "A100-80GB",
            "a100-40g": "A100-40GB", "a100_40gb": "A100-40GB", "h200-141gb": "H200", "h200-sxm": "H200",
            "h200-nvl-141gb": "H200-NVL", "gh200-96g": "GH200-96GB",
            "rtx-a6000": "A6000", "rtx a6000": "A6000", "a6000-48gb": "A6000",
            "rtx-6000-ada-generation": "RTX-6000-Ada", "rtx 6000 ada": "RTX-6000-Ada", "6000-ada": "RTX-6000-Ada",
            "rtx3060-12gb": "RTX-3060", "rtx 3060 12gb": "RTX-3060", "rtx-3060-12gb": "RTX-3060",
            "rtx3090": "RTX-3090", "rtx 3090": "RTX-3090", "3090": "RTX-3090", "geforce-rtx-3090": "RTX-3090",
            "rtx4090": "RTX-4090", "rtx 4090": "RTX-4090", "4090": "RTX-4090", "geforce-rtx-4090": "RTX-4090",
            "rtx5090": "RTX-5090", "rtx 5090": "RTX-5090", "5090": "RTX-5090", "geforce-rtx-5090": "RTX-5090",
            "tesla-t4": "T4", "tesla t4": "T4", "v100-sxm2-16gb": "V100-16GB", "v100-sxm2-32gb": "V100-32GB",
            "v100-16g": "V100-16GB", "v100-32g": "V100-32GB", "instinct-mi300x": "MI300X", "mi300x-192gb": "MI300X"}

#: Names several GPUs answer to (lower case) -> (the table's candidates, what else the name covers).
_AMBIGUOUS: dict[str, tuple[tuple[str, ...], str]] = {
    "a100": (("A100-40GB", "A100-80GB"), ""),
    "h100": (("H100-80GB", "H100-PCIe", "H100-NVL"), "H100-80GB is the SXM part"),
    "v100": (("V100-16GB", "V100-32GB"), ""),
    "gh200": (("GH200-96GB",), "GH200-96GB is the HBM3 part; the 144 GB HBM3e GH200 is not in the table"),
    "rtx-6000": (("RTX-6000-Ada", "A6000"), "RTX 6000 names the Ada part and (as Quadro RTX 6000) an older Turing "
                 "card that is not in the table"),
    "rtx 6000": (("RTX-6000-Ada", "A6000"), "RTX 6000 names the Ada part and (as Quadro RTX 6000) an older Turing "
                 "card that is not in the table"),
}

_REGISTRY: dict[str, GpuSpec] = {g.name.lower(): g for g in _BUILTIN}


def under_wddm(gpu: GpuSpec) -> GpuSpec:
    """The GPU as torch sees it under Windows or WSL 2: the WDDM driver's total, where one is known.

    Under WDDM, ``mem_get_info`` reports the whole framebuffer (an RTX 3090's 24,576 MiB: 24.00
    GiB) where Linux reports it less the driver's reservation (23.69 GiB); vLLM's budget is
    ``gpu_memory_utilization`` times that total, so a WSL start gets ~0.3 GiB more. A card with no
    known WDDM figure is returned unchanged.

    Example:
        >>> under_wddm(get_gpu("RTX-3090")).memory_gib, under_wddm(get_gpu("H100-80GB")).memory_gib
        (24.0, 79.19)
    """
    if gpu.wddm_memory_gib is None:
        return gpu
    return dataclasses.replace(gpu, memory_gib=gpu.wddm_memory_gib)


def with_interconnect(gpu: GpuSpec, interconnect: Any, field: str = "gpu.interconnect") -> GpuSpec:
    """``gpu`` on a host whose GPUs are linked by ``interconnect`` (one of :data:`INTERCONNECTS`;
    None or "" keeps the part's default, :attr:`GpuSpec.link`); anything else is a :class:`SpecError`
    naming ``field``. A part whose row is an SXM module (:data:`PCIE_CARD_FIGURES`) linked by PCIe is
    its PCIe card: that card's bandwidth and link.

    Example:
        >>> with_interconnect(get_gpu("A100-80GB"), "pcie-no-p2p").link
        'pcie-no-p2p'
        >>> pcie = with_interconnect(get_gpu("A100-80GB"), "pcie")
        >>> pcie.name, pcie.hbm_gbps, pcie.interconnect_gbps, with_interconnect(get_gpu("A100-80GB"), "nvlink").hbm_gbps
        ('A100-80GB', 1935.0, 32.0, 2039.0)
        >>> with_interconnect(get_gpu("A100-80GB"), "pcie_nop2p")
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: gpu.interconnect: unknown interconnect 'pcie_nop2p' (did you mean 'pcie-no-p2p'?) (fix: use one of: nvlink, pcie, pcie-no-p2p (a host without GPU P2P: vLLM's startup log says 'Custom allreduce is disabled because your platform lacks GPU P2P capability'))
    """
    if interconnect is None or interconnect == "":
        return gpu
    if not isinstance(interconnect, str) or interconnect.strip().lower() not in INTERCONNECTS:
        shown_value = interconnect if isinstance(interconnect, str) else shown(interconnect)
        hint = did_you_mean(interconnect, INTERCONNECTS) if isinstance(interconnect, str) else ""
        raise SpecError(field, f"unknown interconnect {shown_value!r}{hint}",
                        f"use one of: {', '.join(INTERCONNECTS)} (a host without GPU P2P: vLLM's startup log says "
                        "'Custom allreduce is disabled because your platform lacks GPU P2P capability')")
    link = interconnect.strip().lower()
    card = PCIE_CARD_FIGURES.get(gpu.name, {}) if link.startswith("pcie") else {}
    return dataclasses.replace(gpu, interconnect=link, **card)


@dataclasses.dataclass(frozen=True)
class PublishedJudgement:
    """How the simulator did on one GPU type's published vLLM runs held out (``data/published_judgement.json``,
    written by ``benchmarks/published_judgement.py``): the headline figure (closed loops: output throughput;
    open loops: TPOT) within ``within_pct`` on ``within`` of ``runs``, its signed error's median and range (%)."""

    gpu: str
    runs: int
    within: int
    within_pct: float
    target_share: float
    median_error_pct: float | None
    lowest_error_pct: float | None
    highest_error_pct: float | None
    layouts: tuple[str, ...]
    #: The model class the runs were counted for (``ModelProfile.judgement_class``); "" for every run on the GPU.
    model_class: str = ""

    @property
    def runs_label(self) -> str:
        """``published vLLM runs``, and ``of <class> models`` where the runs were counted for one model class."""
        return "published vLLM runs" + (f" of {self.model_class} models" if self.model_class else "")

    @property
    def meets_target(self) -> bool:
        """At least :attr:`target_share` of the runs within :attr:`within_pct`."""
        return self.within >= self.target_share * self.runs

    @property
    def median_text(self) -> str:
        """``median error +20.9%``, or, where no run simulated to a figure (every start refused), that."""
        if self.median_error_pct is None:
            return "no run simulated to a figure"
        return f"median error {self.median_error_pct:+.1f}%"

    @property
    def errors_text(self) -> str:
        """:attr:`median_text` and the range of the signed errors.

        Example:
            >>> j = PublishedJudgement("X", 4, 1, 10.0, 0.8, 12.5, -3.0, 40.0, ("TP1",))
            >>> j.errors_text, dataclasses.replace(j, median_error_pct=None).errors_text
            ('median error +12.5%, from -3.0% to +40.0%', 'no run simulated to a figure')
        """
        if self.median_error_pct is None or self.lowest_error_pct is None or self.highest_error_pct is None:
            return self.median_text
        return f"{self.median_text}, from {self.lowest_error_pct:+.1f}% to {self.highest_error_pct:+.1f}%"


@functools.lru_cache(maxsize=1)
def _published_table() -> Mapping[str, Any]:
    return json.loads(resources.files("servetune").joinpath("data/published_judgement.json").read_text())


#: Held-out runs a model class needs on a GPU type before its own count judges that class there
#: (:func:`published_judgement`); with fewer, the GPU type's whole count does.
MIN_CLASS_RUNS = 10


def published_judgement(gpu_name: str, model_class: str | None = None) -> PublishedJudgement | None:
    """The simulator's judgement by the published runs held out on ``gpu_name``; None where none ran on it.
    With ``model_class`` (``ModelProfile.judgement_class``), the runs of that class alone where at least
    :data:`MIN_CLASS_RUNS` of them were held out there, else every run on the GPU type.

    Example:
        >>> j = published_judgement("RTX-5090")
        >>> (j.runs, j.within, j.meets_target), published_judgement("A10G") is None
        ((7, 3, False), True)
        >>> dense, classes = published_judgement("H200", "dense"), published_judgement("H200", "model classes")
        >>> (dense.model_class, dense.meets_target), (classes.model_class, classes.meets_target)
        (('dense', True), ('model classes', False))
    """
    table = _published_table()
    row = table["gpus"].get(gpu_name)
    if row is None:
        return None
    by_class = row.get("by_class", {}).get(model_class or "")
    if by_class is not None and int(by_class["runs"]) >= MIN_CLASS_RUNS:
        row = by_class
    else:
        model_class = ""
    target = table["target"]
    return PublishedJudgement(gpu_name, int(row["runs"]), int(row["headline_within_10pct"]),
                              float(target["headline_within_pct"]), float(target["share"]), row["median_error_pct"],
                              row["lowest_error_pct"], row["highest_error_pct"], tuple(row["layouts"]),
                              model_class or "")


def _judgement_for(gpu: GpuSpec, model: ModelProfile | None) -> PublishedJudgement | None:
    """:func:`published_judgement` for ``gpu``, by ``model``'s class where a model is given."""
    return published_judgement(gpu.name, model.judgement_class if model is not None else None)


def sim_evidence_text(gpu: GpuSpec, model: ModelProfile | None = None) -> str:
    """What judged the simulator on ``gpu``, in words: the GPU table's own note (``GpuSpec.sim_evidence``) and
    the published runs held out on it (:func:`published_judgement`, those of ``model``'s class where enough of
    them were); "" where nothing did.

    Example:
        >>> sim_evidence_text(get_gpu("RTX-5090"))
        'published vLLM runs held out: 3 of 7 within 10% (median error +9.8%)'
        >>> sim_evidence_text(get_gpu("A10G"))
        ''
    """
    judged = _judgement_for(gpu, model)
    published = "" if judged is None else (
        f"{judged.runs_label} held out: {judged.within} of {judged.runs} within {judged.within_pct:g}% "
        f"({judged.median_text})")
    return "; ".join(part for part in (gpu.sim_evidence, published) if part)


def calibration_note(gpu: GpuSpec, model: ModelProfile | None = None) -> str | None:
    """One line for figures simulated on a GPU type whose simulated step times are not judged to the target:
    no real vLLM run judged them (``GpuSpec.sim_evidence`` empty and no published run), or the published runs
    held out on it put fewer than 80% of their headline figures within 10% (:func:`published_judgement`; for
    ``model``, a ``ModelProfile``, the runs of its class where enough of them were held out there).
    None elsewhere. ``simulate`` and the nightly print it; the simulator screen widens its margins for it.

    Example:
        >>> calibration_note(get_gpu("L40S")) is None, calibration_note(get_gpu("A10G")).startswith("A10G: no")
        (True, True)
        >>> note = calibration_note(get_gpu("RTX-5090")) or ""
        >>> note.startswith("RTX-5090: the simulator put 3 of 7 published vLLM runs"), "median error +9.8%" in note
        (True, True)
    """
    judged = _judgement_for(gpu, model)
    if judged is not None:
        if judged.meets_target:
            return None
        return (f"{gpu.name}: the simulator put {judged.within} of {judged.runs} {judged.runs_label} held "
                f"out on this GPU within {judged.within_pct:g}% of their throughput or TPOT (layouts "
                f"{', '.join(judged.layouts)}; {judged.errors_text}): read its figures with that spread "
                "(docs/accuracy.md)")
    if gpu.sim_evidence:
        return None
    return (f"{gpu.name}: no real vLLM run on this GPU has judged the simulator; its step times are the H200's "
            f"calibration at {gpu.name}'s datasheet bandwidth and FLOP/s (docs/accuracy.md)")


def known_gpus() -> list[str]:
    """Names of every GPU in the table (built-in and registered)."""
    return sorted(g.name for g in _REGISTRY.values())


def get_gpu(name: str) -> GpuSpec:
    """The :class:`GpuSpec` for ``name`` (case-insensitive).

    Example:
        >>> get_gpu("l40s").interconnect_gbps
        32.0
    """
    if not isinstance(name, str) or not name.strip():
        raise SpecError("gpu", f"expected a GPU name, got {shown(name)}", f"use one of: {', '.join(known_gpus())}")
    key = name.strip().lower()
    if key in _REGISTRY:  # an exact name (built-in or registered) always wins
        return _REGISTRY[key]
    if key in _ALIASES and _ALIASES[key].lower() in _REGISTRY:
        return _REGISTRY[_ALIASES[key].lower()]
    if key in _AMBIGUOUS:
        candidates, note = _AMBIGUOUS[key]
        raise SpecError("gpu", f"ambiguous GPU {name!r}: it names {', '.join(candidates)}"
                        + (f" ({note})" if note else ""),
                        f"write the exact type, one of: {', '.join(candidates)}"
                        + ("; or add your part with a GPU YAML file (--gpu-file)" if note else ""))
    raise SpecError("gpu", f"unknown GPU {name!r}{did_you_mean(name, known_gpus())}",
                    f"use one of: {', '.join(known_gpus())}, or add it with a GPU YAML file (--gpu-file)")


_NUMERIC_FIELDS = ("memory_gib", "hbm_gbps", "bf16_tflops", "fp8_tflops", "interconnect_gbps")


def _spec_from_mapping(entry: Any, field: str) -> GpuSpec:
    if not isinstance(entry, Mapping):
        raise SpecError(field, f"expected a mapping, got {shown(entry)}", "write name: ..., memory_gib: ...")
    unknown = set(entry) - {"name", "compute_capability", "calibration", "nvlink_multicast", "platform", "source",
                            "interconnect", "sm_count", *_NUMERIC_FIELDS}
    if unknown:
        bad = sorted(map(str, unknown))[0]
        raise SpecError(f"{field}.{bad}", f"unknown GPU field{did_you_mean(bad, _NUMERIC_FIELDS)}",
                        f"use: name, {', '.join(_NUMERIC_FIELDS)}, compute_capability, calibration, "
                        "nvlink_multicast, platform, source, interconnect, sm_count")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise SpecError(f"{field}.name", f"expected a non-empty string, got {shown(name)}", "e.g. name: RTX-6000-Ada")
    values: dict[str, float] = {}
    for key in _NUMERIC_FIELDS:
        value = entry.get(key)
        if value is None:
            raise SpecError(f"{field}.{key}", "missing", f"add {key} (a positive number) for GPU {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e12:  # NaN fails too
            raise SpecError(f"{field}.{key}", f"expected a positive finite number, got {shown(value)}", "write a plain number")
        values[key] = float(value)
    cc = entry.get("compute_capability", 0.0)
    if isinstance(cc, bool) or not isinstance(cc, (int, float)) or not 0 <= cc < 100:
        raise SpecError(f"{field}.compute_capability", f"expected a number such as 9.0, got {shown(cc)}", "e.g. 8.9")
    calib = entry.get("calibration") or {}
    if not isinstance(calib, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and abs(v) < 1e12 for k, v in calib.items()):
        raise SpecError(f"{field}.calibration", f"expected a mapping of names to finite numbers, got {shown(calib)}",
                        "e.g. calibration: {decode_overhead_ms: 0.3}")
    multicast = entry.get("nvlink_multicast", False)
    if not isinstance(multicast, bool):
        raise SpecError(f"{field}.nvlink_multicast", f"expected true or false, got {shown(multicast)}",
                        "true only for an NVSwitch board (HGX/DGX)")
    sms = entry.get("sm_count", 0)
    if isinstance(sms, bool) or not isinstance(sms, int) or not 0 <= sms < 100_000:
        raise SpecError(f"{field}.sm_count", f"expected a whole number of SMs, got {shown(sms)}",
                        "e.g. sm_count: 142 (the datasheet's SM count; leave it out if unknown)")
    plat = entry.get("platform", "cuda")
    if plat not in ("cuda", "rocm"):
        raise SpecError(f"{field}.platform", f"expected cuda or rocm, got {shown(plat)}", "write platform: cuda")
    spec = GpuSpec(name=name.strip(), calibration=types.MappingProxyType({k: float(v) for k, v in calib.items()}),
                   compute_capability=float(cc), nvlink_multicast=multicast, platform=plat, sm_count=sms,
                   source=str(entry.get("source") or f"user GPU file ({field})"),
                   memory_gib=values["memory_gib"], hbm_gbps=values["hbm_gbps"], bf16_tflops=values["bf16_tflops"],
                   fp8_tflops=values["fp8_tflops"], interconnect_gbps=values["interconnect_gbps"])
    return with_interconnect(spec, entry.get("interconnect"), f"{field}.interconnect")


def register_gpu(spec: GpuSpec) -> None:
    """Add (or replace) one GPU in the table."""
    _REGISTRY[spec.name.lower()] = spec


def register_gpus_from_yaml(path: str | os.PathLike[str]) -> list[str]:
    """Add the GPUs of a YAML file (a ``gpus:`` list, or a bare list) and return their names.

    Every entry is validated before any is registered; errors name the field
    (``gpus[0].hbm_gbps``) and the file.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "g.yaml"
        >>> _ = p.write_text("gpus:\\n  - {name: X1, memory_gib: 10, hbm_gbps: 1, bf16_tflops: 1, "
        ...                  "fp8_tflops: 1, interconnect_gbps: 1}\\n")
        >>> register_gpus_from_yaml(p), get_gpu("x1").memory_gib
        (['X1'], 10.0)
    """
    text_path = os.fspath(path)
    doc = load_yaml(read_text(text_path, "yaml", "--gpu-file"), text_path, text_path)
    entries = doc.get("gpus") if isinstance(doc, Mapping) else doc
    if not isinstance(entries, list) or not entries:
        raise SpecError(f"{text_path}: gpus", "expected a non-empty list of GPUs", "write gpus: [{name: ..., ...}]")
    specs = [_spec_from_mapping(e, f"{text_path}: gpus[{i}]") for i, e in enumerate(entries)]
    for spec in specs:
        register_gpu(spec)
    return [s.name for s in specs]
