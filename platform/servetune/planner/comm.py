"""Memory a vLLM worker takes outside torch, as a function of the parallel layout, the environment and the version.

From 0.11 vLLM's V1 worker takes its init snapshot after NCCL and the all-reduce communicators are set up
(``v1/worker/gpu_worker.py: init_device``, "Initialize the distributed environment BEFORE taking memory
snapshot": lines 169 / 182 of 0.11.0, 216 / 232 of 0.12.0, 263 / 282 of 0.19.0, 369 / 388 of 0.26.0, 387 / 406
of 0.28.0), so what they allocate at creation (NCCL's communicator, the custom all-reduce's IPC buffers, the
symmetric-memory communicator's buffer, on by default from 0.11: ``VLLM_ALLREDUCE_USE_SYMM_MEM`` "1" at
``envs.py`` line 1411 of 0.11.0, 1445 of 0.12.0, 1480 of 0.19.0; "0" at line 1221 of 0.10.2) is *outside* the KV
budget (it only has to fit in ``total * (1 - gpu_memory_utilization)``: :attr:`CommMemory.context_bytes`).
What is allocated after it, during model loading, compilation and the profile run, is *inside* it: the
"non-torch" growth that vLLM subtracts from the budget (:attr:`CommMemory.non_torch_bytes`). 0.10.x takes the
snapshot first (line 175, then ``init_worker_distributed_environment`` at 193 of 0.10.2), so there the
communicators' own memory is charged too (:func:`_communicators_charged`: over NVLink; 0 over PCIe).

What grows after the snapshot, by version:

* NCCL's ring / tree connections, made lazily at the first collective that needs them (NCCL >= 2.22 connects
  at runtime; the logged NCCL is 2.26.2 with vLLM 0.10.1.1, 2.27.3 with 0.10.2, 2.27.5 with 0.12.0, 0.16.0 and
  0.19.0, 2.28.9 with 0.26.0): :data:`NON_TORCH_GIB_MULTI_V1` on NVLink, less over PCIe; the V2 runner of 0.26
  grows 0.06 GiB.
* NCCL's NVLink SHARP (NVLS, multicast) buffers, where NVLS is live (``NCCL_NVLS_ENABLE`` default 2 = "where
  the system supports it", ``src/transport/nvls.cc``: NVSwitch hosts of compute capability >= 9.0, HGX
  H100/H200/H800/H20, B200), set up at the first collective that uses NVLS: :func:`nvls_buffer_bytes`,
  counted from NCCL's source (64 MiB at TP=2), not separated in any log.
* vLLM's FlashInfer all-reduce + RMSNorm fusion workspace, from 0.17, where the default ``-O2`` runs that
  pass (:func:`fused_allreduce_runs`): :data:`FI_ALLREDUCE_FUSION_WORKSPACE_GIB`, 1.5 GiB per TP worker.
  This, not NVLS, is the ~2 GiB that the published vLLM 0.19 H100 logs charge at TP=2 and TP=4. No
  variable turns it off: servetune's launch environment (:data:`servetune.envs.LAUNCH_SAFE_ENV`:
  ``NCCL_NVLS_ENABLE=0``, ``VLLM_ALLREDUCE_USE_SYMM_MEM=0``) turns NVLS off, not the fusion; an install
  without a usable FlashInfer (``EngineConfig.flashinfer_available``; :attr:`CommEnv.flashinfer_fusion`, vLLM's
  ``has_flashinfer``: :func:`has_flashinfer`), ``enforce_eager`` or ``-O1`` runs without it. A real servetune trial
  is planned with :func:`trial_env`: the GPU workers' install, probed, decides; not probed, the workspace is
  charged. :data:`SERVETUNE_LAUNCH_ENV` (no usable FlashInfer) is the measured hosts', the simulator's.

:func:`comm_memory` is the one implementation: the planner (``plan_memory``), hence the
pre-screen, the simulator's memory and the study, all call it through ``plan_memory``.

Example:
    >>> from servetune.planner.gpus import get_gpu
    >>> h100 = get_gpu("H100-80GB")
    >>> off = comm_memory(h100, tp=2, pp=1, env=SERVETUNE_LAUNCH_ENV, version=(0, 12, 0))
    >>> on = comm_memory(h100, tp=2, pp=1, env=VLLM_DEFAULT_ENV, version=(0, 12, 0))
    >>> off.multicast, round(off.non_torch_bytes / 2**30, 2), on.multicast, round(on.non_torch_bytes / 2**30, 2)
    (False, 0.54, True, 0.6)
    >>> fused = comm_memory(h100, tp=2, pp=1, env=VLLM_DEFAULT_ENV, version=(0, 19, 0))
    >>> fused.fused_allreduce, round(fused.non_torch_bytes / 2**30, 2)
    (True, 2.1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from servetune.envs import LAUNCH_SAFE_ENV
from servetune.errors import SpecError
from servetune.planner.gpus import GpuSpec
from servetune.planner.vllm_rules import V2_RUNNER, memory_rules

__all__ = ["AllReduceCost", "CommEnv", "CommMemory", "allreduce_cost", "comm_memory", "nvls_buffer_bytes", "sendrecv_cost",
           "fused_allreduce_runs", "fused_allreduce_note", "FI_ALLREDUCE_FUSION_WORKSPACE_GIB",
           "symm_mem_buffer_bytes", "SERVETUNE_LAUNCH_ENV", "VLLM_DEFAULT_ENV", "has_flashinfer", "trial_env",
           "NO_P2P_BUS_GBPS", "NO_P2P_LATENCY_S", "CONTEXT_GIB_PCIE_EXTRA",
           "CUSTOM_ALL_REDUCE_BUFFER_BYTES", "custom_all_reduce_runs", "custom_all_reduce_memory_note",
           "nccl_small_message_note", "AllReduceTable", "allreduce_table", "HOPPER_TP8_ALLREDUCE_MS"]

GiB = 1 << 30
MiB = 1 << 20

# =============================================================================== Calibration
#: Non-torch growth during the profile run, one GPU: cuBLAS / attention workspaces. vLLM 0.26.0
#: on the H200 (tests/fixtures/real_h200/*/server.log, "Actual usage ... N GiB for non-torch").
NON_TORCH_GIB_SINGLE = 0.2235
#: The same with TP/PP > 1 and multicast off: most of it now happens before the init snapshot
#: (NCCL, custom all-reduce), so the logged growth is smaller. Real 2 x H200, NVLS off:
#: tests/fixtures/real_h200/study_h200x2 and server_tp2 (0.06 at TP=2 and PP=2).
NON_TORCH_GIB_MULTI = 0.06
#: vLLM 0.11-0.25 (V1 model runner), one GPU: fitted on the published starts llmd_llama31_8b_tp1
#: and llmd_qwen3_06b_tp1_16k (tests/fixtures/published_logs; vLLM 0.11.0, H100): 0.13 and 0.13.
NON_TORCH_GIB_SINGLE_V1 = 0.13
#: vLLM 0.11-0.25, TP >= 2 with NVLS not live: NCCL's ring/tree connections are made lazily
#: (NCCL >= 2.22 runtime connect) at the profile run's first large all-reduce, inside the
#: budget. Fitted on llmd_qwen3_32b_tp2 (0.54 GiB, vLLM 0.11.0, 2 x H100, environment not stated; whether
#: NVLS was live there is not known: 0.11 runs no FlashInfer fusion, see FI_ALLREDUCE_FUSION_WORKSPACE_GIB); judged on llmd_llama33_70b_fp8_tp2
#: (+0.43%). Over PCIe it is too high: the held-out 2 x L40S starts (vLLM 0.11.2) imply ~0.0 GiB,
#: as NCCL opens far fewer channels there, and come out 2.0-2.5% low (not refitted on them).
NON_TORCH_GIB_MULTI_V1 = 0.54
#: The same on GPUs linked only by PCIe (GpuSpec.link not NVLink: below PCIE_MAX_GBPS, or stated). What grows
#: lazily at the first all-reduce is NCCL's per-channel connection buffers, and where they live and
#: how many there are depends on the transport, not on vLLM: the P2P transport
#: (``src/transport/p2p.cc``) puts each channel's FIFOs in device memory (NCCL_BUFFSIZE's 4 MiB
#: for SIMPLE, ~4.7 MiB LL128, 0.5 MiB LL: ~9.2 MiB a channel), and NVLink rings open many
#: channels; a PCIe ring gets NCCL's minimum of 2 channels (~18 MiB), and GPUs without P2P (most
#: cloud VMs with passed-through GPUs) use the SHM transport (``src/transport/shm.cc``), whose
#: FIFOs are in pinned host memory (0 on the GPU). Taken: 2 channels x 9.2 MiB, 0.02 GiB; counted
#: from NCCL's defaults, not fitted. The held-out 2 x L40S starts (vLLM 0.11.2, PCIe) are what
#: showed the 0.54 GiB NVLink figure does not carry over (they came out 2.0-2.5% low with it), so
#: they informed which rule to look for; no figure was taken from them.
NON_TORCH_GIB_MULTI_V1_PCIE = 0.02
#: PCIe 5.0 x16, one direction: anything faster between two GPUs of a node is NVLink.
PCIE_MAX_GBPS = 64.0
#: Memory in use before the init snapshot: CUDA context (one GPU), plus NCCL's ring/tree buffers
#: and the custom all-reduce buffers (world_size > 1): "Free memory on device (139.29/139.8 GiB)"
#: at TP=1, (138.34/139.8) at TP=2 on the H200 (NVLS off).
CONTEXT_GIB_SINGLE = 0.51
CONTEXT_GIB_MULTI = 1.46
#: The same for GPUs linked only by PCIe (:attr:`GpuSpec.link` ``pcie`` or ``pcie-no-p2p``): the CUDA context and
#: what NCCL's PCIe transports put on the device, not :data:`CONTEXT_GIB_MULTI`'s NVLink figure. Counted from NCCL's
#: defaults as :data:`NON_TORCH_GIB_MULTI_V1_PCIE` is: the P2P transport's FIFOs, ~9.2 MiB a channel on a ring of
#: NCCL's minimum 2 channels, and none without P2P (the SHM transport keeps them in pinned host memory); vLLM's
#: custom all-reduce adds :data:`CUSTOM_ALL_REDUCE_BUFFER_BYTES` where it runs (:func:`custom_all_reduce_runs`:
#: two PCIe GPUs with P2P). 0.02 GiB. Agrees with the published starts that show it: vLLM 0.10.1.1's A100 TP=2
#: starts without P2P, whose communicators (built after that release's init snapshot) are within 1% of their KV
#: with nothing charged (:func:`_communicators_charged`), and vLLM 0.10.2's 8 x L40S start, whose non-torch
#: memory after its communicators were built was 0.21 GiB in all ("Free memory on device (43.93/44.42 GiB) on
#: startup ... 0.21 GiB for non-torch memory", ``tests/fixtures/published_logs/logs``); the 1.46 GiB NVLink figure
#: would have put either a GiB lower. Written 2026-12-07 after CloudRift's two RTX 4090 PP=2 starts (vLLM 0.11.0,
#: no P2P, ``tests/fixtures/published_runs/cloudrift_rtx4090_llama_3_3_70b_awq.yaml``) were planned to die in the
#: sampler warm-up 0.44 GiB short though they served: the NVLink context left that warm-up 0.95 GiB less.
CONTEXT_GIB_PCIE_EXTRA = 0.02
#: vLLM's custom all-reduce buffers per GPU, inside :data:`CONTEXT_GIB_MULTI` (its H200 TP=2 runs had the custom
#: all-reduce on). vLLM 0.26.0 ``custom_all_reduce.py`` (``CustomAllreduce.__init__``, set up in the TP group's
#: ``CudaCommunicator`` at init, before the snapshot): a meta buffer of ``meta_size() + max_size`` (the signal
#: block, a few KiB, plus a scratch of ``max_size``), an input buffer of ``max_size`` (both allocated on this GPU
#: and shared through CUDA IPC handles; the peers' buffers are opened, mapped not allocated) and ``rank_data`` of
#: 8 MiB; ``max_size`` is 8 MiB, less where the symmetric-memory communicator is on and
#: ``all_reduce_utils.CUSTOM_ALL_REDUCE_MAX_SIZES`` says less (512 KiB at TP=6, 256 KiB at TP=8 on Hopper).
#: ``--disable-custom-all-reduce`` skips all of it: 24 MiB (0.02 GiB, 1.6% of the context figure). No start with
#: the flag set has been measured, so the figure is kept, not lowered by a count, and ``plan`` says so
#: (:func:`custom_all_reduce_memory_note`): outside the KV budget, it moves only the free-memory check at startup.
CUSTOM_ALL_REDUCE_BUFFER_BYTES = 3 * 8 * MiB
#: vLLM's FlashInfer all-reduce + RMSNorm fusion workspace, per TP worker, where the fusion pass runs
#: (:func:`fused_allreduce_runs`: on by default from vLLM 0.17, TP of 2, 4 or 8 on compute capability 9.0 / 10.x,
#: FlashInfer usable, a device with CUDA multicast). The pass (``compilation/passes/fusion/allreduce_rms_fusion.py:
#: AllReduceFusionPass.__init__``, line 780 of 0.19.0) builds the workspace when the model is compiled, after the
#: init snapshot (``v1/worker/gpu_worker.py`` lines 263 / 282 of 0.19.0), so vLLM charges it to the KV budget as
#: non-torch growth. FlashInfer 0.6.4-0.6.6 (the pins of vLLM 0.17-0.19) allocate its three buffers (the
#: one-shot buffer ``tp x tokens x hidden x 2`` B, the barrier flags, three Lamport buffers ``3 x tp x tokens x hidden
#: x 2`` B; ``comm/trtllm_ar.py: trtllm_create_ipc_workspace_for_all_reduce_fusion``) each as its own
#: ``SymmDeviceMemory`` (``comm/mnnvl.py``): ``cuMemCreate`` of the size rounded up to the multicast granularity
#: (``CU_MULTICAST_GRANULARITY_RECOMMENDED``), and it refuses a device without multicast support. The token count
#: is capped by vLLM's ``FI_ALLREDUCE_FUSION_MAX_SIZE_MB`` (64 MB at TP=2, 2 MB at TP=4 on Hopper), so no buffer
#: reaches 512 MiB and the figure hardly moves with TP, model or token budget. The figure is read off the published
#: vLLM 0.19 H100 SXM logs (llm-d-planner's, tests/fixtures/published_logs, llmdplanner_*: 2.06-2.21 GiB non-torch
#: per worker at TP=2 and TP=4) less the multicast-off growth of the V1 runner (:data:`NON_TORCH_GIB_MULTI_V1`,
#: 0.54) and NCCL's NVLS buffers: 1.46-1.55 GiB, taken as 1.50 (three 512 MiB granules, if that is the granularity
#: on Hopper: not read from a driver). Those logs say ``'fuse_allreduce_rms': True`` in their config line; the 0.12.0
#: and 0.15.1 starts on H100 / H200 pairs say nothing of it or False, and vLLM 0.26's own H200 TP=2 runs (no
#: FlashInfer usable there) False, with 0.06 GiB. Until 2026-12-06 the whole 2.04 GiB was one "multicast" term,
#: keyed on ``NCCL_NVLS_ENABLE`` and charged at every version; the version rule was looked for after the held-out
#: 0.12.0 start (Qwen3-30B-A3B at TP=2 on 2 x H100 SXM) was read at -4.6% with it. The same figure is assumed for
#: 0.26+, where FlashInfer 0.6.14 allocates the workspace through torch's symmetric memory (not counted).
FI_ALLREDUCE_FUSION_WORKSPACE_GIB = 1.5

# ============================================================ TP all-reduce time, by interconnect
#: NCCL all-reduce bus bandwidth between GPUs without peer-to-peer (``NCCL_P2P_DISABLE=1``, or a
#: host whose GPUs cannot reach each other's memory): NCCL's SHM transport stages every chunk
#: through pinned host memory, each byte crossing PCIe twice. Published nccl-tests figure:
#: eugenesiow/LLM-Insights, infrastructure/hardware/README.md, ``all_reduce_perf -b 1G -e 10G -g 4``
#: on four GPUs of an 8-GPU NVLink node with ``NCCL_P2P_DISABLE=1`` (NCCL 2.16.2): 5.20 GB/s bus
#: bandwidth at 1-8 GiB, flat (222-235 GB/s with NVLink on the same GPUs). Bus bandwidth is NCCL's
#: rank-count-free figure (nccl-tests doc/PERFORMANCE.md: busbw = algbw x 2(n-1)/n for all-reduce),
#: so it is taken for TP=2 as well. Not fitted.
NO_P2P_BUS_GBPS = 5.2
#: The same path's fixed cost per send/recv step, from a measured TP=2 decode all-reduce through it:
#: sgl-project/sglang#39605 (2026-09-15), two RTX 5070 Ti without P2P (PCIe 4.0 x16, ``nvidia-smi topo``
#: ``SYS``, custom all-reduce off, NCCL's SHM transport with its default direct loads and stores,
#: ``NCCL_SHM_USE_CUDA_MEMCPY`` 0 as in NCCL 2.26.2's ``src/transport/shm.cc:66``, the release vLLM 0.10.1.1's
#: published A100 TP=2 starts load): "the 10 KB decode all-reduces (39 -> 81 us, 130 per token)", 39 us with
#: the default path (10 KB: one token of the model's 5,120-wide bf16 hidden state, its decode batches run
#: in CUDA graphs, which the PR leaves on NCCL's path). On that host a
#: 20 MB all-reduce ran at 1.9 GB/s ("10.9 ms, 1.9 GB/s, under NCCL_PROTO=LL, Simple and LL128 alike"), so
#: 10,240 B of the 39 us are 5.4 us of bytes there and 33.6 us fixed: two steps of NCCL's ring of 16.8 us
#: (:attr:`AllReduceCost.per_step`: an all-reduce is a reduce-scatter and an all-gather, 2 (n-1) steps one
#: after the other, NCCL ``src/device/all_reduce.h`` ``runRing``; NCCL's tuning model,
#: ``src/graph/tuning.cc``, takes ``nsteps`` 2 (n-1) for an all-reduce and n-1 for an all-gather; a
#: pipeline send is one). The fixed cost is split off at that host's own rate because the rate is the
#: host's (its GPUs' reads of host memory, 1.9 GB/s there, 5.2 GB/s on the server above: taken at 1.9 GB/s
#: the held-out A100 TP=2 runs of tests/fixtures/published_runs/dense.yaml come out about 50% slow), while
#: the fixed cost is NCCL's flag round trips through host memory. Read at the simulator's 5.2 GB/s instead,
#: the same 39 us gives 18.5 us a step (a sensitivity, not taken: docs/accuracy.md). Not fitted; looked for
#: after those held-out runs were seen to run 11-22% fast at 10-30 requests in flight (2026-12-07).
#: Until then 11.7 us a step: tinygrad/open-gpu-kernel-modules#17, nccl-tests ``alltoall_perf`` on two
#: RTX 4090s with P2P disabled, 8-64 B messages, 11.3-11.9 us (one send/recv step each way at once), a
#: message of no size, which prices a 10 KB TP=2 all-reduce at 25.4 us against the 39 measured. (Until
#: 2026-12-06 one such step priced a whole all-reduce, 11.7 us at TP=2.) NCCL's tuning constants (Ring/LL
#: base 6.6 us + 1.0 us per PCI step) give 8.6 us at TP=2, a P2P figure, not the SHM path's.
#: How far the host moves the bandwidth (a sensitivity, not a choice): noonghunna/club-3090,
#: docs/PCIE_P2P.md, p2pBandwidthLatencyTest on two RTX 3090s (PCIe 4.0 x16, P2P off): 11.28 GB/s
#: one way, 15.23 us a copy. Taken for the bandwidth (11.28 GB/s) with two 11.7 us steps per TP=2
#: all-reduce, the held-out A100 TP=2 runs of tests/fixtures/published_runs/dense.yaml came out
#: 31.5% off on throughput (+24.1% bias) and 80.2% on TTFT, against 19.3% (-1.8%) and 152.8% with
#: the 5.2 GB/s above (docs/accuracy.md, before the logits' all-gather and the PCIe card): the
#: bandwidth first taken stays.
NO_P2P_LATENCY_S = 16.8e-6

# ====================================================================== NCCL / vLLM source figures
#: ``src/transport/nvls.cc`` (NCCL 2.27-2.30): NVLS_NCHANNELS_SM90 16, NVLS_NCHANNELS_SM100_NVL 24
#: (one node), NCCL_NVLS_CHUNKSIZE default 128 KiB, NCCL_STEPS 8, buffers aligned to 2 MiB.
_NVLS_CHANNELS_SM90 = 16
_NVLS_CHANNELS_SM100_ONE_NODE = 24
_NVLS_CHUNK_DEFAULT = 128 * 1024
_NCCL_STEPS = 8
_NVLS_ALIGN = 2 * MiB
#: ``vllm/distributed/device_communicators/all_reduce_utils.py``: the symmetric-memory all-reduce
#: buffer per device capability and TP size (allocated at init, so outside the KV budget).
_SYMM_MEM_MAX_SIZES: dict[str, dict[int, int]] = {
    "9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 64 * MiB, 8: 64 * MiB},
    "10.0": {2: 8 * MiB, 4: 32 * MiB, 6: 128 * MiB, 8: 128 * MiB},
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclasses.dataclass(frozen=True)
class CommEnv:
    """The environment settings that decide a worker's memory outside torch.

    ``nvls``: ``NCCL_NVLS_ENABLE`` as NCCL reads it ("auto" when unset: NCCL's default 2, on where
    the system supports multicast; "on" for 1; "off" for 0). ``symm_mem``:
    ``VLLM_ALLREDUCE_USE_SYMM_MEM`` (vLLM's default 1). ``torch_multicast``: not
    ``TORCH_SYMM_MEM_DISABLE_MULTICAST``. ``nvls_chunk_bytes``: ``NCCL_NVLS_CHUNKSIZE``.
    ``source`` says where the settings came from, for ``plan``'s output. ``flashinfer_fusion``: whether the host
    can run vLLM's FlashInfer all-reduce fusion (a property of the install, not a variable).
    """

    nvls: str = "auto"
    symm_mem: bool = True
    torch_multicast: bool = True
    nvls_chunk_bytes: int = _NVLS_CHUNK_DEFAULT
    source: str = "vLLM's and NCCL's defaults"
    #: FlashInfer is usable by vLLM's all-reduce fusion where the server runs (vLLM's ``has_flashinfer``, the pure
    #: rule :func:`has_flashinfer`: the package, and its cubins or nvcc). A property of the install: True for a
    #: plain ``vllm serve`` (vLLM's images ship FlashInfer) and for a real servetune trial whose GPU workers were
    #: not probed (:func:`trial_env`); False in :data:`SERVETUNE_LAUNCH_ENV`, the measured hosts' (the real
    #: 2 x H200 vLLM 0.26 runs log no FLASHINFER attention backend and ``'fuse_allreduce_rms': False``).
    #: See :func:`fused_allreduce_runs`.
    flashinfer_fusion: bool = True
    #: ``flashinfer_fusion`` is a GPU worker's answer (:func:`trial_env` with a probe), not a default: the plan then
    #: takes it as the install's FlashInfer for the profile run's sampler too (``EngineConfig.flashinfer_available``,
    #: :func:`servetune.planner.memory.plan_memory`), so the sampler and the fusion workspace follow one probe.
    flashinfer_probed: bool = False

    @classmethod
    def from_mapping(cls, env: Mapping[str, str], source: str) -> CommEnv:
        """Read the settings from an environment mapping (pure: the caller passes ``os.environ``'s).

        Example:
            >>> CommEnv.from_mapping({"NCCL_NVLS_ENABLE": "0"}, "test").nvls
            'off'
            >>> CommEnv.from_mapping({"NCCL_NVLS_ENABLE": "maybe"}, "test")
            Traceback (most recent call last):
            ...
            servetune.errors.SpecError: NCCL_NVLS_ENABLE: expected 0, 1 or 2, got 'maybe' (fix: unset it, or write NCCL_NVLS_ENABLE=0 (off) / 1 (on))
        """
        raw = str(env.get("NCCL_NVLS_ENABLE", "")).strip()
        nvls = {"": "auto", "2": "auto", "1": "on", "0": "off"}.get(raw)
        if nvls is None:
            raise SpecError("NCCL_NVLS_ENABLE", f"expected 0, 1 or 2, got {raw!r}",
                            "unset it, or write NCCL_NVLS_ENABLE=0 (off) / 1 (on)")
        chunk_raw = str(env.get("NCCL_NVLS_CHUNKSIZE", "")).strip()
        if chunk_raw and (not chunk_raw.isdigit() or int(chunk_raw) <= 0):
            raise SpecError("NCCL_NVLS_CHUNKSIZE", f"expected a positive number of bytes, got {chunk_raw!r}",
                            "unset it (NCCL's default 131072), or write a byte count")
        return cls(nvls=nvls, symm_mem=_flag(env, "VLLM_ALLREDUCE_USE_SYMM_MEM", True),
                   torch_multicast=not _flag(env, "TORCH_SYMM_MEM_DISABLE_MULTICAST", False),
                   nvls_chunk_bytes=int(chunk_raw) if chunk_raw else _NVLS_CHUNK_DEFAULT, source=source)

    def with_nvls(self, on: bool) -> CommEnv:
        """The same environment with multicast switched on or off (``plan``'s "what if the other holds")."""
        if on:
            return dataclasses.replace(self, nvls="auto", symm_mem=True, torch_multicast=True,
                                       source="")
        return dataclasses.replace(self, nvls="off", symm_mem=False, torch_multicast=False,
                                   source="")

    def describe(self) -> str:
        """One line: the settings and where they came from."""
        nvls = {"auto": "NCCL_NVLS_ENABLE unset (NCCL default: on where supported)", "on": "NCCL_NVLS_ENABLE=1",
                "off": "NCCL_NVLS_ENABLE=0"}[self.nvls]
        text = f"{nvls}, VLLM_ALLREDUCE_USE_SYMM_MEM={int(self.symm_mem)}"
        if not self.flashinfer_fusion:
            text += ", no FlashInfer all-reduce fusion (no usable FlashInfer)"
        return f"{text} ({self.source})" if self.source else text


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SpecError(name, f"expected 0 or 1, got {raw!r}", f"write {name}=0 or {name}=1")


#: servetune's launch variables (engines.vllm.engine applies LAUNCH_SAFE_ENV to every launch) on the hosts its figures
#: were measured on, which have no usable FlashInfer (``flashinfer_fusion`` False): the simulator's host, and
#: ``plan_memory``'s default. A real trial is planned with :func:`trial_env` instead, which lets the GPU workers'
#: install decide the fusion workspace.
SERVETUNE_LAUNCH_ENV = dataclasses.replace(CommEnv.from_mapping(LAUNCH_SAFE_ENV, "servetune's launch environment"),
                                           flashinfer_fusion=False)
#: What a plain ``vllm serve`` runs with when nothing is set.
VLLM_DEFAULT_ENV = CommEnv.from_mapping({}, "vLLM's and NCCL's defaults")


def has_flashinfer(*, package: bool, cubin_package: bool, nvcc: bool, env: Mapping[str, str]) -> bool:
    """vLLM's ``has_flashinfer()``, the FlashInfer condition of its all-reduce + RMSNorm fusion pass, on facts of an
    install (pure: :func:`servetune.engines.vllm.host.probe_has_flashinfer` reads them where the trial runs).

    ``vllm/utils/flashinfer.py`` lines 47-62 of 0.19.0 (``has_flashinfer``): the ``flashinfer`` package is found
    (``importlib.util.find_spec``, not imported: ``package``), and FlashInfer can get its kernels: pre-built cubins
    (``has_flashinfer_cubin``, lines 35-43: ``VLLM_HAS_FLASHINFER_CUBIN`` read as ``bool(int(...))``, ``envs.py``
    line 1420 of 0.19.0, or the ``flashinfer_cubin`` package: ``cubin_package``) or ``nvcc`` on ``PATH`` to compile
    them (``nvcc``). ``env`` is the environment the server starts with. A ``VLLM_HAS_FLASHINFER_CUBIN`` that is no
    integer makes vLLM's ``int()`` raise at start-up: refused here the same way.

    Example:
        >>> has_flashinfer(package=True, cubin_package=False, nvcc=False, env={})
        False
        >>> has_flashinfer(package=True, cubin_package=False, nvcc=False, env={"VLLM_HAS_FLASHINFER_CUBIN": "1"})
        True
        >>> has_flashinfer(package=False, cubin_package=True, nvcc=True, env={})
        False
        >>> has_flashinfer(package=True, cubin_package=False, nvcc=True, env={"VLLM_HAS_FLASHINFER_CUBIN": "yes"})
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: VLLM_HAS_FLASHINFER_CUBIN: vLLM reads it with int(), got 'yes' (fix: write VLLM_HAS_FLASHINFER_CUBIN=1 (cubins pre-downloaded) or 0, or unset it)
    """
    raw = env.get("VLLM_HAS_FLASHINFER_CUBIN")
    try:
        cubin_env = bool(int(raw)) if raw is not None else False
    except ValueError:
        raise SpecError("VLLM_HAS_FLASHINFER_CUBIN", f"vLLM reads it with int(), got {raw!r}",
                        "write VLLM_HAS_FLASHINFER_CUBIN=1 (cubins pre-downloaded) or 0, or unset it") from None
    return package and (cubin_env or cubin_package or nvcc)


def trial_env(real_gpus: bool, flashinfer: bool | None = None) -> CommEnv:
    """The environment a servetune trial is planned with: the one rule behind the pre-screen, the informed starts and
    the simulator screen's plans of a study's trials.

    Simulated and replayed trials (``real_gpus`` False) run on the simulator's host: :data:`SERVETUNE_LAUNCH_ENV`.
    A real trial's server runs servetune's launch variables and whatever FlashInfer the GPU worker's install has:
    ``flashinfer`` is :func:`has_flashinfer` as probed there (:func:`servetune.engines.vllm.host.probe_has_flashinfer`,
    run on a worker by the pool). Not probed (None: the pool could not reach a worker of the GPU type in time), the
    plan charges the fusion workspace wherever vLLM's version, the TP size and the GPU say the pass may run
    (:func:`fused_allreduce_runs`): a plan that counts 1.5 GiB per worker too many prunes or shrinks a start that
    would have fitted, while one that counts it too few calls a start a fit that vLLM refuses, or sizes a KV cache
    vLLM does not build; vLLM's official images ship FlashInfer (and nvcc), so charging it is the likelier truth.
    A probed answer (``flashinfer_probed``) also decides the profile run's sampler of vLLM 0.10.0-0.11.0 (FlashInfer's
    top-k/top-p where it imports): vLLM's sampler needs only the import, but FlashInfer's sampling kernels need its
    cubins or nvcc when they first run, so the one probe stands for both.

    Example:
        >>> trial_env(False) == SERVETUNE_LAUNCH_ENV, trial_env(True).flashinfer_fusion, trial_env(True, False).flashinfer_fusion
        (True, True, False)
        >>> trial_env(True, False).describe().split(", ")[2][:54]
        'no FlashInfer all-reduce fusion (no usable FlashInfer)'
    """
    if not real_gpus:
        return SERVETUNE_LAUNCH_ENV
    if flashinfer is None:
        return dataclasses.replace(SERVETUNE_LAUNCH_ENV, flashinfer_fusion=True,
                                   source="servetune's launch environment; FlashInfer on the GPU workers not probed: "
                                          "assumed usable")
    return dataclasses.replace(SERVETUNE_LAUNCH_ENV, flashinfer_fusion=flashinfer, flashinfer_probed=True,
                               source="servetune's launch environment; FlashInfer probed on a GPU worker")
@dataclasses.dataclass(frozen=True)
class CommMemory:
    """One worker's memory outside torch: before the init snapshot, and grown during profiling."""

    context_bytes: int  # in use before vLLM's init snapshot: outside the budget
    non_torch_bytes: int  # non-torch growth during the profile run: subtracted from the budget
    multicast: bool  # NCCL's NVLS algorithm is live for the TP all-reduce
    reason: str  # why multicast is or is not live, in words
    validated: bool  # whether these figures were checked against real logs of this environment
    fused_allreduce: bool = False  # vLLM's FlashInfer all-reduce fusion workspace is in non_torch_bytes


def nvls_buffer_bytes(tp: int, compute_capability: float, chunk_bytes: int = _NVLS_CHUNK_DEFAULT) -> int:
    """NCCL's NVLS buffer per GPU for one single-node communicator of ``tp`` ranks (NCCL 2.27+).

    ``ncclNvlsBufferSetup``: ``buffSize = chunk * NCCL_STEPS``; ``nvlsPerRankSize = nChannels * 2 *
    buffSize``; ``nvlsTotalSize = nvlsPerRankSize * nHeads`` (nHeads = the node's ranks), aligned to
    the 2 MiB allocation granularity.

    Example:
        >>> nvls_buffer_bytes(2, 9.0) // 2**20, nvls_buffer_bytes(8, 10.0) // 2**20
        (64, 384)
    """
    channels = _NVLS_CHANNELS_SM100_ONE_NODE if compute_capability >= 10.0 else _NVLS_CHANNELS_SM90
    total = channels * 2 * chunk_bytes * _NCCL_STEPS * tp
    return -(-total // _NVLS_ALIGN) * _NVLS_ALIGN


def symm_mem_buffer_bytes(tp: int, compute_capability: float) -> int:
    """vLLM's symmetric-memory all-reduce buffer per GPU (0 where vLLM does not create one)."""
    key = "10.0" if 10.0 <= compute_capability < 10.3 else ("9.0" if 9.0 <= compute_capability < 10.0 else "")
    return _SYMM_MEM_MAX_SIZES.get(key, {}).get(tp, 0)


def _multicast_reason(gpu: GpuSpec, tp: int, env: CommEnv) -> tuple[bool, str]:
    if tp < 2:
        return False, "no TP all-reduce (TP=1): NVLS is never set up"
    if env.nvls == "off":
        return False, "NCCL_NVLS_ENABLE=0"
    if not gpu.nvlink_multicast:
        return False, f"{gpu.name} has no NVSwitch multicast fabric (NVLS unsupported)"
    if gpu.compute_capability < 9.0:
        return False, f"NVLS needs compute capability >= 9.0 ({gpu.name}: {gpu.compute_capability})"
    return True, f"NVLS live ({gpu.name} NVSwitch host, TP={tp}, multicast not disabled)"


def fused_allreduce_runs(gpu: GpuSpec, *, tp: int, pp: int, version: tuple[int, int, int], compiled: bool = True,
                         flashinfer: bool = True) -> bool:
    """Whether vLLM ``version`` runs its FlashInfer all-reduce + RMSNorm fusion by default for this layout, and so
    allocates :data:`FI_ALLREDUCE_FUSION_WORKSPACE_GIB` after its init snapshot.

    From 0.17 (:attr:`~servetune.planner.vllm_rules.VllmMemoryRules.allreduce_rms_fusion_default`): a compiled
    model (``compiled``: not ``enforce_eager``; the pass runs in vLLM's compile backend), FlashInfer usable
    (``flashinfer``: vLLM's ``has_flashinfer``), TP of 2, 4 or 8 (``PassConfig.flashinfer_max_size``:
    ``FI_SUPPORTED_WORLD_SIZES``), compute capability 9.0 or 10.0 (10.x from 0.19), one pipeline stage where the
    release asks for it, and a device with CUDA multicast (``gpu.nvlink_multicast``: FlashInfer's
    ``SymmDeviceMemory`` raises "Device does not support multicasting" elsewhere, and vLLM then logs and skips the
    pass). None of ``NCCL_NVLS_ENABLE``, ``VLLM_ALLREDUCE_USE_SYMM_MEM`` or ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` turns
    it off; ``-O1``, ``enforce_eager`` or ``pass_config.fuse_allreduce_rms=false`` does.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> h100 = get_gpu("H100-80GB")
        >>> [fused_allreduce_runs(h100, tp=2, pp=1, version=v) for v in ((0, 12, 0), (0, 16, 0), (0, 17, 0), (0, 19, 0))]
        [False, False, True, True]
        >>> fused_allreduce_runs(h100, tp=2, pp=2, version=(0, 19, 0)), fused_allreduce_runs(h100, tp=2, pp=2, version=(0, 22, 0))
        (False, True)
        >>> fused_allreduce_runs(get_gpu("L40S"), tp=2, pp=1, version=(0, 19, 0))
        False
    """
    rules = memory_rules(tuple(version))
    cc = gpu.compute_capability
    blackwell = 10.0 <= cc < 11.0 if rules.allreduce_rms_fusion_blackwell_family else cc == 10.0
    return (rules.allreduce_rms_fusion_default and compiled and flashinfer and tp in (2, 4, 8)
            and (pp == 1 or not rules.allreduce_rms_fusion_single_stage) and (cc == 9.0 or blackwell)
            and gpu.nvlink_multicast)


def fused_allreduce_note(vllm_version: str, tp: int) -> str:
    """``plan``'s line where :func:`fused_allreduce_runs` holds: what the term is, where its figure comes from, what
    turns it off.

    Example:
        >>> fused_allreduce_note("0.19.0", 2)[:72]
        "vLLM 0.19.0's FlashInfer all-reduce + RMSNorm fusion (on by default from"
    """
    return (f"vLLM {vllm_version}'s FlashInfer all-reduce + RMSNorm fusion (on by default from 0.17 at TP={tp} on "
            "this GPU, where FlashInfer is usable: the package, and nvcc or its cubins) allocates its workspace after "
            "the memory snapshot: "
            f"+{FI_ALLREDUCE_FUSION_WORKSPACE_GIB:.2f} GiB non-torch per TP worker, read off published vLLM 0.19 H100 "
            "logs (not checked blind); enforce_eager, -O1 or --compilation-config "
            "'{\"pass_config\": {\"fuse_allreduce_rms\": false}}' avoids it, NCCL_NVLS_ENABLE=0 does not")


def _communicators_charged(gpu: GpuSpec, version: tuple[int, int, int], context: int) -> int:
    """What the communicators allocate at creation that a release charges to the KV budget: 0 from 0.11, which builds
    them before its init snapshot; before (0.10.x) the whole multi-GPU context beyond the CUDA context over NVLink
    (NCCL's P2P setup and the custom all-reduce: :data:`CONTEXT_GIB_MULTI` less :data:`CONTEXT_GIB_SINGLE`, measured
    on the H200 with vLLM 0.26 and NVLS off), and 0 for GPUs linked by PCIe: without P2P NCCL's SHM transport keeps
    its FIFOs in host memory (the published 0.10.1.1 A100 starts without P2P are within 1% with none charged), and
    with it no figure was measured."""
    if memory_rules(tuple(version)).communicators_before_snapshot or gpu.link != "nvlink":
        return 0
    return context - int(CONTEXT_GIB_SINGLE * GiB)


def comm_memory(gpu: GpuSpec, *, tp: int, pp: int, env: CommEnv, version: tuple[int, int, int] = (0, 26, 0),
                compiled: bool = True, flashinfer: bool = True) -> CommMemory:
    """Memory one TP/PP worker takes outside torch, before the init snapshot and during profiling.

    One GPU: the CUDA context and the profile run's workspaces. Several: NCCL and custom
    all-reduce buffers join the context (plus vLLM's symmetric-memory buffer where it is on and
    the GPU has one); the profiled growth drops to 0.06 GiB (0.54 with the V1 model runner, before
    0.26, which profiles with NCCL's ring connections still unmade; 0.02 for that runner on GPUs
    linked only by PCIe, where NCCL makes 2 channels or keeps its FIFOs in host memory). Two terms join
    the growth: NCCL's lazily created NVLS buffers (:func:`nvls_buffer_bytes`) where NVLS is live for the TP
    all-reduce (:func:`_multicast_reason`, the environment's), and vLLM's FlashInfer all-reduce fusion workspace
    (:data:`FI_ALLREDUCE_FUSION_WORKSPACE_GIB`) where the release runs that pass by default
    (:func:`fused_allreduce_runs`: 0.17+; ``compiled`` and ``flashinfer`` say whether the start compiles its
    model and has FlashInfer, and :attr:`CommEnv.flashinfer_fusion` whether the host can run it). Pipeline stages exchange activations with send/recv, which never uses NVLS
    (0.07 GiB at PP=2 in the published logs).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> c = comm_memory(get_gpu("L40S"), tp=4, pp=1, env=VLLM_DEFAULT_ENV)
        >>> c.multicast, c.reason
        (False, 'L40S has no NVSwitch multicast fabric (NVLS unsupported)')
        >>> h100 = get_gpu("H100-80GB")
        >>> [round(comm_memory(h100, tp=2, pp=1, env=VLLM_DEFAULT_ENV, version=v).non_torch_bytes / 2**30, 2)
        ...  for v in ((0, 12, 0), (0, 19, 0))]
        [0.6, 2.1]
    """
    v2 = tuple(version) >= V2_RUNNER
    if tp * pp == 1:
        return CommMemory(int(CONTEXT_GIB_SINGLE * GiB),
                          int((NON_TORCH_GIB_SINGLE if v2 else NON_TORCH_GIB_SINGLE_V1) * GiB), False,
                          "one GPU: no communicator", True)
    context = int(CONTEXT_GIB_MULTI * GiB) if gpu.link == "nvlink" else int(
        (CONTEXT_GIB_SINGLE + CONTEXT_GIB_PCIE_EXTRA) * GiB)
    # VLLM_ALLREDUCE_USE_SYMM_MEM defaults to 1 from 0.11 (envs.py:1411@0.11.0), 0 in 0.10.2 (envs.py:1221), absent
    # before: a 0.10.x start is taken without the symmetric-memory communicator.
    symm_on = env.symm_mem and tp >= 2 and tuple(version) >= (0, 11, 0)
    if symm_on:
        context += symm_mem_buffer_bytes(tp, gpu.compute_capability)
    charged = _communicators_charged(gpu, version, context)
    context -= charged
    # PP-only layouts send activations point to point: the lazily connected ring buffers of a
    # TP all-reduce never appear (0.07 GiB at PP=2 in llm-d-planner's published 0.19 logs).
    if v2 or tp == 1:
        non_torch = int(NON_TORCH_GIB_MULTI * GiB)
    elif gpu.link != "nvlink":
        # NCCL's PCIe / SHM rings: few or no device buffers. By the link, not the part's rate: an SXM
        # part stated to sit without P2P (e.g. two A100 40GB over Ray on two nodes) gets no NVLink ring.
        non_torch = int(NON_TORCH_GIB_MULTI_V1_PCIE * GiB)
    else:
        non_torch = int(NON_TORCH_GIB_MULTI_V1 * GiB)
    live, reason = _multicast_reason(gpu, tp, env)
    if live:
        non_torch += nvls_buffer_bytes(tp, gpu.compute_capability, env.nvls_chunk_bytes)
    fused = fused_allreduce_runs(gpu, tp=tp, pp=pp, version=version, compiled=compiled,
                                 flashinfer=flashinfer and env.flashinfer_fusion)
    if fused:
        non_torch += int(FI_ALLREDUCE_FUSION_WORKSPACE_GIB * GiB)
    non_torch += charged
    # Validated: the multicast-off figures (the real 2 x H200 runs, the published 2 x H100 starts); not the NVLS
    # buffers (counted from NCCL), the fusion workspace (read off the starts it is judged on), nor a
    # symmetric-memory buffer in the context.
    symm = symm_mem_buffer_bytes(tp, gpu.compute_capability) if symm_on else 0
    return CommMemory(context, non_torch, live, reason, validated=not live and not fused and symm == 0 and not charged,
                      fused_allreduce=fused)


@dataclasses.dataclass(frozen=True)
class AllReduceCost:
    """What one TP all-reduce costs on a host: its fixed cost (:meth:`fixed_s`) plus ``2 (tp-1)/tp x
    bytes / bus_bytes_per_s`` (the ring's traffic at NCCL's bus bandwidth); ``path`` says which
    implementation vLLM takes there, in words. ``latency_s`` is one whole collective where it is a
    calibrated knob (NVLink, PCIe P2P), and one send/recv step of NCCL's ring where ``per_step``
    (the SHM path without P2P, measured as one step: :data:`NO_P2P_LATENCY_S`)."""

    path: str
    latency_s: float
    bus_bytes_per_s: float
    per_step: bool = False

    def fixed_s(self, tp: int) -> float:
        """One all-reduce's fixed cost over ``tp`` ranks: ``latency_s``, or per step 2 (tp-1) of them."""
        if tp < 2:
            return 0.0
        return self.latency_s * (2 * (tp - 1) if self.per_step else 1)

    def gather_fixed_s(self, tp: int) -> float:
        """One all-gather's fixed cost over ``tp`` ranks: ``latency_s``, or per step tp-1 of them."""
        if tp < 2:
            return 0.0
        return self.latency_s * ((tp - 1) if self.per_step else 1)

    def seconds(self, tp: int, message_bytes: float) -> float:
        """One all-reduce of ``message_bytes`` over ``tp`` ranks (0 at TP=1)."""
        if tp < 2:
            return 0.0
        return self.fixed_s(tp) + 2.0 * (tp - 1) / tp * message_bytes / self.bus_bytes_per_s

    def gather_seconds(self, ranks: int, message_bytes: float) -> float:
        """One all-gather, or one reduce-scatter, over ``ranks`` ranks whose whole (gathered) tensor is
        ``message_bytes``: :meth:`gather_fixed_s` plus ``(ranks-1)/ranks x message_bytes`` at the bus
        rate (each rank receives, or sends on, all but its own share: NCCL's ring, as its tests count
        both collectives' bus bandwidth). 0 on one rank.

        Example:
            >>> AllReduceCost("ring", 10e-6, 100e9).gather_seconds(2, 2e6) * 1e6
            20.0
        """
        if ranks < 2:
            return 0.0
        return self.gather_fixed_s(ranks) + (ranks - 1) / ranks * message_bytes / self.bus_bytes_per_s

    def sendrecv_seconds(self, message_bytes: float) -> float:
        """One point-to-point send of ``message_bytes`` to the next rank (a pipeline boundary): one step."""
        return self.latency_s + message_bytes / self.bus_bytes_per_s


def custom_all_reduce_runs(gpu: GpuSpec, tp: int) -> bool:
    """Whether vLLM (0.10-0.26) sets up its custom all-reduce for a TP group of ``tp`` on ``gpu``'s host when
    ``disable_custom_all_reduce`` is not set: TP of 2, 4, 6 or 8 (``_SUPPORTED_WORLD_SIZES``), every GPU able
    to read its peers' memory (not ``pcie-no-p2p``), and NVLink or exactly two PCIe GPUs ("not supported on
    more than two PCIe-only GPUs").

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> [custom_all_reduce_runs(get_gpu(g), tp) for g, tp in (("H100-80GB", 8), ("L40S", 2), ("L40S", 4))]
        [True, True, False]
    """
    if tp not in (2, 4, 6, 8) or gpu.link == "pcie-no-p2p":
        return False
    return gpu.link == "nvlink" or tp == 2


def custom_all_reduce_memory_note(gpu: GpuSpec, tp: int, disabled: bool) -> str | None:
    """``plan``'s line where ``disable_custom_all_reduce`` is set on a TP layout; None where it is not set or TP is 1.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> custom_all_reduce_memory_note(get_gpu("L40S"), 2, True)[:60]
        'disable_custom_all_reduce at TP=2: vLLM does not allocate it'
        >>> custom_all_reduce_memory_note(get_gpu("L40S"), 4, True)
        'disable_custom_all_reduce at TP=4 changes nothing on L40S: vLLM turns its custom all-reduce off there anyway'
    """
    if not disabled or tp < 2:
        return None
    if not custom_all_reduce_runs(gpu, tp):
        return (f"disable_custom_all_reduce at TP={tp} changes nothing on {gpu.name}: vLLM turns its custom "
                "all-reduce off there anyway")
    return (f"disable_custom_all_reduce at TP={tp}: vLLM does not allocate its custom all-reduce buffers "
            f"({CUSTOM_ALL_REDUCE_BUFFER_BYTES // MiB} MiB per GPU, outside the KV budget); the multi-GPU context "
            f"figure ({CONTEXT_GIB_MULTI} GiB, measured with them) is kept, so up to "
            f"{CUSTOM_ALL_REDUCE_BUFFER_BYTES / GiB:.2f} GiB a GPU is counted that this start does not use")


def nccl_small_message_note(gpu: GpuSpec, tp: int, disabled: bool) -> str | None:
    """The one line ``plan`` and ``simulate`` print where ``disable_custom_all_reduce`` moves the TP all-reduces
    to NCCL (where :func:`custom_all_reduce_runs`); None elsewhere.

    What is not modelled, and why no figure is taken: the all-reduce stays priced at the simulator's
    calibrated cost (``allreduce_latency_s``, ``interconnect_efficiency``), fitted on NVLink windows where the
    custom all-reduce carried every decode-size message. NCCL's own tuning model (``src/graph/tuning.cc``,
    NCCL 2.26-2.30: Ring/LL base 6.6 us plus 0.6 us a step over NVLink, 1.0 over PCIe, 2 (tp-1) steps) puts a
    TP=2 all-reduce at 7.8 us over NVLink and 8.6 over PCIe, under the calibrated 10 us: it is the tuner's
    floor for choosing an algorithm, without launch or synchronization, and would price NCCL faster than the
    custom kernel. vLLM's communicator benchmarks (``benchmark_device_communicators.py``, TP=4, bf16, a
    [32, 8192] tensor of 0.5 MB: vllm-project/vllm#24111, its H100 section, ca_1stage 0.010 ms and pynccl
    0.017; vllm-project/vllm#24532, the GPU not stated in the part read, 0.010 and 0.021) measure NCCL at
    1.7-2.1x the custom all-reduce, at one TP and one size: not enough to scale the calibrated cost for
    other GPUs, PCIe or TP=2. So the direction is said, not a figure.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> nccl_small_message_note(get_gpu("H100-80GB"), 2, True)[:78]
        "disable_custom_all_reduce at TP=2: every all-reduce takes NCCL's path (NVLink)"
        >>> nccl_small_message_note(get_gpu("L40S"), 4, True) is None
        True
    """
    if not disabled or not custom_all_reduce_runs(gpu, tp):
        return None
    link = "NVLink" if gpu.link == "nvlink" else "PCIe P2P"
    return (f"disable_custom_all_reduce at TP={tp}: every all-reduce takes NCCL's path ({link}), whose "
            "small-message latency is not modelled: priced as the calibrated custom all-reduce; vLLM's published "
            "communicator benchmarks (TP=4, 0.5 MB) measure NCCL at 1.7-2.1x its time, so decode steps may be "
            "slower than simulated")


def allreduce_cost(gpu: GpuSpec, tp: int, *, latency_s: float, efficiency: float,
                   custom_all_reduce: bool = True) -> AllReduceCost:
    """How a TP all-reduce is priced on ``gpu``'s host (:attr:`GpuSpec.link`).

    vLLM (0.10-0.26, ``custom_all_reduce.py``) all-reduces a message below its custom all-reduce's
    ``max_size`` (8 MiB; less on Hopper/Blackwell at some TP sizes where the symmetric-memory communicator is
    on, ``all_reduce_utils.CUSTOM_ALL_REDUCE_MAX_SIZES``) with its own
    one-shot/two-shot kernels where every GPU can read its peers' memory, and hands the rest to
    NCCL: that is every message over NVLink, at TP=2 over PCIe with peer-to-peer (above two PCIe
    GPUs the custom all-reduce is off: "not supported on more than two PCIe-only GPUs"), and none
    without peer-to-peer ("your platform lacks GPU P2P capability"), where NCCL falls back to its
    SHM transport through host memory. With P2P (NVLink, PCIe) both implementations are priced by
    the simulator's calibrated knobs, ``latency_s`` and ``efficiency`` of the link's datasheet
    rate (fitted on the H200 over NVLink; no run separates the two implementations). Without P2P the
    link's rate does not apply: the published SHM figures :data:`NO_P2P_LATENCY_S` (per step of
    NCCL's ring, 2 (tp-1) steps an all-reduce) and :data:`NO_P2P_BUS_GBPS` do, for every message size.
    ``custom_all_reduce`` False (``disable_custom_all_reduce``): every message goes to NCCL (or, where vLLM's
    symmetric-memory communicator is on, to it below its size; not told apart here); the path says so, and the
    cost stays the calibrated one (:func:`nccl_small_message_note` says why and which way it errs).

    Example:
        >>> from servetune.planner.gpus import get_gpu, with_interconnect
        >>> a100 = get_gpu("A100-80GB")
        >>> nv = allreduce_cost(a100, 2, latency_s=10e-6, efficiency=0.7)
        >>> shm = allreduce_cost(with_interconnect(a100, "pcie-no-p2p"), 2, latency_s=10e-6, efficiency=0.7)
        >>> round(nv.seconds(2, 7168 * 256) * 1e6, 1), round(shm.seconds(2, 7168 * 256) * 1e6, 1)
        (18.7, 386.5)
        >>> shm.path
        'NCCL SHM through host memory (no GPU P2P: custom all-reduce off)'
        >>> allreduce_cost(a100, 2, latency_s=10e-6, efficiency=0.7, custom_all_reduce=False).path
        'NCCL over NVLink (custom all-reduce disabled: small-message latency not modelled)'
    """
    link = gpu.link
    if link == "pcie-no-p2p":
        return AllReduceCost("NCCL SHM through host memory (no GPU P2P: custom all-reduce off)",
                             NO_P2P_LATENCY_S, NO_P2P_BUS_GBPS * 1e9, per_step=True)
    rate = gpu.interconnect_gbps * 1e9 * efficiency
    if not custom_all_reduce and custom_all_reduce_runs(gpu, tp):
        over = "NVLink" if link == "nvlink" else "PCIe P2P"
        return AllReduceCost(f"NCCL over {over} (custom all-reduce disabled: small-message latency not modelled)",
                             latency_s, rate)
    if link == "nvlink":
        return AllReduceCost("custom all-reduce / NCCL over NVLink", latency_s, rate)
    if tp == 2:
        return AllReduceCost("custom all-reduce over PCIe P2P (NCCL above its max size)", latency_s, rate)
    return AllReduceCost("NCCL P2P over PCIe (custom all-reduce off above two PCIe GPUs)", latency_s, rate)


#: vllm-project/vllm#42324 (2026-05-11), the communicator benchmark of its "SM 9.0 / H100, World Size = 8" table:
#: (message MiB, pynccl ms, symm_mem_multimem ms). Published timings, not fitted; the H200 shares the H100's
#: NVLink 4 / NVSwitch board and is priced by the same table.
HOPPER_TP8_ALLREDUCE_MS: tuple[tuple[float, float, float], ...] = (
    (0.5, 0.024, 0.011), (1.0, 0.025, 0.014), (1.5, 0.033, 0.016), (2.0, 0.037, 0.018), (3.0, 0.044, 0.023),
    (4.0, 0.050, 0.027), (8.0, 0.076, 0.046), (16.0, 0.121, 0.087), (32.0, 0.195, 0.165),
    (47.84, 0.267, 0.244), (64.0, 0.316, 0.320), (128.0, 0.561, 0.631),
)
#: vLLM 0.14.1 at TP=8 on compute capability 9.0 with the symmetric-memory communicator live: the custom
#: all-reduce below 256 KiB (``all_reduce_utils.py:38@0.14.1``, the min with its 8 MiB default at
#: ``custom_all_reduce.py:129-133@0.14.1``), torch's symmetric-memory multimem all-reduce below 64 MiB
#: (``all_reduce_utils.py:53@0.14.1``, ``symm_mem.py:28-31,117-125,143-150@0.14.1``), NCCL above
#: (``cuda_communicator.py:146-166@0.14.1``). The same sizes at 0.11.0, 0.19.0 and 0.26.0 (docs/accuracy.md).
_TP8_SM90_CUSTOM_MAX = 256 * 1024
_TP8_SM90_SYMM_MAX = 64 * MiB
#: The same rule at TP=2 and TP=4 (the same lines, 0.11.0-0.26.0): the custom all-reduce below 8 MiB (its default,
#: under the 64 and 32 MiB of ``CUSTOM_ALL_REDUCE_MAX_SIZES["9.0"]``), torch's symmetric-memory all-reduce below
#: ``SYMM_MEM_ALL_REDUCE_MAX_SIZES["9.0"]`` (two-shot at TP=2, multimem at TP=4: ``_WORLD_SIZES_MULTIMEM["9.0"]`` is
#: [4, 6, 8]), NCCL from there. Only NCCL's share is priced from published timings there (:func:`allreduce_table`).
_SM90_NCCL_FROM = {2: 64 * MiB, 4: 32 * MiB}


def _busbw_factor(tp: int) -> float:
    """What a ring all-reduce moves over each GPU's links per byte of message, ``2 (tp - 1) / tp``: nccl-tests'
    bus-bandwidth factor, by which NCCL's time at another rank count on the same NVSwitch board is scaled.

    Example:
        >>> round(_busbw_factor(4) / _busbw_factor(8), 4)
        0.8571
    """
    return 2.0 * (tp - 1) / tp


@dataclasses.dataclass(frozen=True)
class AllReduceTable:
    """One TP all-reduce priced by message size from published timings, where vLLM picks its backend by size
    (:func:`allreduce_table`). ``custom_max``: below it the all-reduces priced by the caller's calibrated
    :class:`AllReduceCost` (:meth:`seconds` returns None there): the custom all-reduce, and at TP 2-4 torch's
    symmetric memory too; ``symm_max``: below it (and from ``custom_max``) the symmetric-memory points, from it
    NCCL's. Between points the time is interpolated
    linearly, past the last point extended along the last segment, below the first held at it.

    Example:
        >>> t = AllReduceTable(256 * 1024, 64 * MiB, ((1.0, 14e-6), (8.0, 46e-6)), ((64.0, 316e-6), (128.0, 561e-6)))
        >>> t.seconds(100 * 1024) is None, round(t.seconds(8 * MiB) * 1e6, 1), round(t.seconds(96 * MiB) * 1e6, 1)
        (True, 46.0, 438.5)
    """

    custom_max: int
    symm_max: int
    symm_points: tuple[tuple[float, float], ...]  # (MiB, seconds)
    nccl_points: tuple[tuple[float, float], ...]  # (MiB, seconds)

    def seconds(self, message_bytes: float) -> float | None:
        """One all-reduce of ``message_bytes`` (None below :attr:`custom_max`: the custom all-reduce's)."""
        if message_bytes < self.custom_max:
            return None
        points = self.symm_points if message_bytes < self.symm_max else self.nccl_points
        return _interpolate(points, message_bytes / MiB)


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear ``y(x)`` through ``points`` (sorted by x): held at the first point below it, the last
    segment extended above the last."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def allreduce_table(gpu: GpuSpec, tp: int, *, env: CommEnv, version: tuple[int, int, int]) -> AllReduceTable | None:
    """The TP all-reduce priced by message size where vLLM's size rule and published timings cover the layout:
    TP=8 on compute capability 9.0 over NVSwitch (H100, H200, H800) with vLLM's symmetric-memory communicator
    live (``VLLM_ALLREDUCE_USE_SYMM_MEM`` on, its default from 0.11, ``envs.py:1488-1490@0.14.1``; CUDA multicast,
    without which it disables itself, ``symm_mem.py:106-111@0.14.1``; NVLS, which NCCL's large messages use in the
    published timings). At TP=2 and TP=4 on the same hosts only the messages vLLM sends through NCCL
    (:data:`_SM90_NCCL_FROM`: from 64 and 32 MiB) are priced so: at the TP=8 NCCL timings' bus bandwidth, their time
    scaled by :func:`_busbw_factor` (x0.857 at TP=4: an assumption; #24111's H100 tables time pynccl at TP=4 at 0.74
    of TP=8 at 4 MB, NVIDIA/nccl#1863 its symmetric-memory all-reduce slower on 4 GPUs than on 8 at 128 MB), below it
    the calibrated price (no published TP 2-4 table past 4 MiB found).
    None elsewhere: the calibrated :func:`allreduce_cost` prices every size, as it does in servetune's own launches
    (multicast off, :data:`SERVETUNE_LAUNCH_ENV`), and on other GPUs (the B200: vLLM 0.14.1's SM 10.0 sizes at TP=8
    are 1 MiB and 128 MiB, ``all_reduce_utils.py:40-45,55-60@0.14.1``, but no published B200 timings by size were
    found; ``tests/sim/test_b200_allreduce.py``). The sizes: :data:`_TP8_SM90_CUSTOM_MAX`, :data:`_TP8_SM90_SYMM_MAX`;
    the times: :data:`HOPPER_TP8_ALLREDUCE_MS`. The TP=8 rule was looked for after the held-out TP=8 NVLink runs'
    errors were read, the TP 2-4 one after the TP=4 runs' (docs/accuracy.md); nothing in either is fitted.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> h100 = get_gpu("H100-80GB")
        >>> allreduce_table(h100, 8, env=SERVETUNE_LAUNCH_ENV, version=(0, 14, 1)) is None
        True
        >>> t = allreduce_table(h100, 8, env=VLLM_DEFAULT_ENV, version=(0, 14, 1))
        >>> round(t.seconds(80 * MiB) * 1e6)  # an 8,192-token step of a 5,120-wide model: NCCL
        377
        >>> t4 = allreduce_table(h100, 4, env=VLLM_DEFAULT_ENV, version=(0, 14, 1))
        >>> t4.seconds(16 * MiB) is None, round(t4.seconds(80 * MiB) * 1e6)  # the calibrated price; NCCL
        (True, 323)
    """
    symm_live = env.symm_mem and env.torch_multicast and tuple(version) >= (0, 11, 0)
    live, _ = _multicast_reason(gpu, tp, env)
    if tp not in (2, 4, 8) or gpu.link != "nvlink" or not (9.0 <= gpu.compute_capability < 10.0) \
            or not (symm_live and live):
        return None
    rows = HOPPER_TP8_ALLREDUCE_MS
    if tp == 8:
        return AllReduceTable(_TP8_SM90_CUSTOM_MAX, _TP8_SM90_SYMM_MAX,
                              tuple((mib, multimem * 1e-3) for mib, _, multimem in rows),
                              tuple((mib, nccl * 1e-3) for mib, nccl, _ in rows if mib * MiB >= _TP8_SM90_SYMM_MAX))
    # TP 2 / 4: below NCCL's size the calibrated price (custom_max = symm_max: the symmetric-memory points are never
    # read, so NCCL's stand in); from it
    # the TP=8 NCCL timings at the same bus bandwidth, from 32 MiB on (the points that size interpolates between).
    nccl_from, scale = _SM90_NCCL_FROM[tp], _busbw_factor(tp) / _busbw_factor(8)
    nccl = tuple((mib, ms * 1e-3 * scale) for mib, ms, _ in rows if mib * MiB >= 32 * MiB)
    return AllReduceTable(nccl_from, nccl_from, nccl, nccl)


def sendrecv_cost(gpu: GpuSpec, *, latency_s: float, efficiency: float) -> AllReduceCost:
    """How a pipeline stage's send of its activations to the next stage is priced on ``gpu``'s host.

    vLLM sends a stage's ``IntermediateTensors`` (hidden states and residual, each ``[tokens,
    hidden]`` in the model's dtype; under TP each rank its 1/TP slice, gathered on arrival) with
    NCCL's point-to-point send/recv (``parallel_state.send_tensor_dict``), never with the custom
    all-reduce: over NVLink or PCIe P2P at the link's rate and the calibrated knobs (as the
    all-reduce), without P2P through NCCL's SHM transport at :data:`NO_P2P_LATENCY_S` (nccl-tests'
    one send/recv step) and :data:`NO_P2P_BUS_GBPS`. The metadata vLLM sends beside the tensors over
    the CPU group is not priced (no published figure). Not fitted: no PP run in the published sets.

    Example:
        >>> from servetune.planner.gpus import get_gpu, with_interconnect
        >>> l40s = get_gpu("L40S")
        >>> round(sendrecv_cost(l40s, latency_s=10e-6, efficiency=0.7).sendrecv_seconds(2**20) * 1e6, 1)
        56.8
        >>> sendrecv_cost(with_interconnect(l40s, "pcie-no-p2p"), latency_s=10e-6, efficiency=0.7).path
        'NCCL send/recv through host memory (SHM: no GPU P2P)'
    """
    link = gpu.link
    if link == "pcie-no-p2p":
        return AllReduceCost("NCCL send/recv through host memory (SHM: no GPU P2P)", NO_P2P_LATENCY_S,
                             NO_P2P_BUS_GBPS * 1e9, per_step=True)
    rate = gpu.interconnect_gbps * 1e9 * efficiency
    return AllReduceCost(f"NCCL send/recv over {'NVLink' if link == 'nvlink' else 'PCIe P2P'}", latency_s, rate)
