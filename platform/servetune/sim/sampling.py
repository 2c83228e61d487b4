"""What a step's sampler costs beyond greedy decoding, counted from vLLM's source.

Every calibration window servetune recorded was greedy: servetune's load generators send
``temperature 0`` (``engines/vllm/loadgen.py``; ``bench_client.py`` passes ``--temperature 0``), and
so did ``vllm bench serve`` up to 0.14.1 (``benchmarks/serve.py``: "Default to greedy decoding").
From 0.15.0 it sends no temperature unless told (vLLM pull request 32723, merged 2026-01-20; the
0.15.0, 0.15.1 and 0.23.0 wheels print "vllm bench serve no longer sets temperature==0"), so the
server samples with the model's ``generation_config.json`` (``--generation-config auto``, the
default: ``ModelConfig.get_diff_sampling_param``). A greedy step's sampler casts the logits to fp32
and takes their argmax; a random one runs penalties, temperature, top-k/top-p and a draw over the
whole vocabulary for every sampled row. :class:`~servetune.workload.Sampling` is what the requests asked for;
:func:`sampler_pass` gives the extra bytes per vocabulary entry of a row and the extra kernel
launches of a step, where the path that version takes was read.

Counted (the 0.23.0 wheel: ``v1/sample/sampler.py``, ``v1/sample/ops/penalties.py``,
``model_executor/layers/utils.py: apply_penalties``, ``_custom_ops.py: apply_repetition_penalties``,
``v1/sample/ops/topk_topp_sampler.py``; FlashInfer 0.6.12, the wheel's pin: ``sampling.py:
top_k_top_p_sampling_from_logits``, ``include/flashinfer/topk.cuh: RadixTopKMaskLogitsKernel_MultiCTA``,
``sampling.cuh: TopPSamplingFromProbKernel``; PyTorch's ``aten/src/ATen/native/cuda/SoftMax.cu``),
per vocabulary entry of one row, reads plus writes:

* greedy (what the calibration holds): ``logits.to(float32)`` 2 + 4, ``argmax`` 4: 10 bytes.
* penalties, where ``repetition_penalty`` is not 1 or a frequency / presence penalty is set
  (``apply_all_penalties``; all three run whenever one is on): the prompt's and the output's bin
  counts, each a ``zeros`` [rows, vocab + 1] int64 (8) and ``> 0`` into a bool mask (8 + 1); the
  repetition kernel reads both masks (2; it touches the logit only where a token repeats); the
  frequency term ``penalty * bin_counts`` (8 + 4) and ``logits -=`` it (8 + 4); the presence term
  ``penalty * mask`` (1 + 4) and ``logits -=`` it (8 + 4): 77 bytes, 16 launches (the output ids'
  copy, ``== -1`` and ``masked_fill_``, four per bin count, the repetition kernel, two per term).
* temperature, ``logits.div_`` in place: 8 bytes, 1 launch (``all_random``: no argmax).
* top-k and top-p together, through FlashInfer (``forward_cuda``, vLLM's default on CUDA from 0.21.0,
  ``VLLM_USE_FLASHINFER_SAMPLER`` unset, compute capability 7.5 to 12.1; ``top_k_first``): the top-k
  mask reads the row into shared memory and again to write the masked copy (4 + 4 + 4); PyTorch's
  softmax over a row too long for shared memory (``cunn_SoftMaxForward``: max, sum of exponentials,
  then the write) (12 + 4); the top-p rejection sampler at least one round of two reads (8): 36 bytes,
  3 launches, and the int32 ids' ``.long()`` where greedy's argmax was: 4 launches, less greedy's argmax.
* neither top-k nor top-p (temperature alone; ``forward_native``): softmax (16), the exponential
  noise (4), ``probs.div_(q)`` (8 + 4), ``argmax`` (4): 36 bytes, 4 launches.

So a Qwen2.5-Instruct request (top-k 20, top-p 0.8, repetition penalty 1.05-1.1) costs 127 bytes a
vocabulary entry where greedy cost 10: 117 more, 17.8 MB a row at 151,936 entries. The top-p
sampler may take more rounds (8 bytes each; data-dependent), and the softmax and top-p kernels run
one thread block per row, so a few rows may not reach the GPU's bandwidth: the count is a floor
in rounds and prices every byte at the weights' streaming rate (``PerfModel``).

* top-k and top-p together on the V1 runner from 0.17.0 to 0.20.x at 8 rows or more
  (``apply_top_k_top_p``: ``HAS_TRITON and logits.shape[0] >= 8``, in the 0.17.1 and 0.20.0 wheels,
  not in 0.16.0's): vLLM's Triton mask (``topk_topp_triton.py``), then the native draw (softmax,
  exponential noise, divide, argmax: the 36 bytes above). The mask runs one program per row on at
  most one program an SM, and each program sweeps its row's logits several times from its SM, so
  it is priced in waves, not bytes: ``ceil(rows / SMs)`` waves of :data:`TRITON_WAVE_S` plus
  :data:`TRITON_WAVE_LOGIT_S` a vocabulary entry (:func:`triton_mask_seconds`).

Not counted (``sampler_pass`` returns None and nothing is priced): the V1 runner before 0.17.0 (PyTorch's
sort of every row, or FlashInfer's sampler where it imports up to 0.11.0), and PyTorch's sort below 8 rows
from 0.17.0 (:attr:`SamplerPass.triton_mask` prices the steps of 8 rows or more only); the V2 model
runner (its own sampler,
``v1/worker/gpu/sample``; the default for Qwen3ForCausalLM from 0.22.0, for Llama and Mistral too
from 0.23.0, for every dense model from 0.25.0, by ``VllmConfig.use_v2_model_runner``: the planner's
``vllm_rules.V2_RUNNER_DEFAULTS``), and top-k or top-p alone.
"""

from __future__ import annotations

import dataclasses

from servetune.planner.model_memory import SAMPLER_V1_TRITON_MIN_ROWS
from servetune.planner.vllm_rules import FLASHINFER_SAMPLER_DEFAULT, TRITON_TOPK_TOPP, memory_rules, runs_v2_runner
from servetune.workload import GREEDY, Sampling

__all__ = ["SamplerPass", "sampler_pass", "runs_v2_sampler", "triton_mask_seconds", "GREEDY_BYTES",
           "PENALTY_BYTES", "TEMPERATURE_BYTES", "FLASHINFER_TOPK_TOPP_BYTES", "PLAIN_DRAW_BYTES",
           "FLASHINFER_SAMPLER_DEFAULT", "KERNELS_PER_LAYER", "TRITON_MIN_ROWS",
           "TRITON_WAVE_S", "TRITON_WAVE_LOGIT_S"]

#: Bytes per vocabulary entry of one row (module docstring): what greedy's sampler moves (in the
#: calibration), and what each stage of a random one moves.
GREEDY_BYTES = 10.0
FP32_CAST_BYTES = 6.0
PENALTY_BYTES = 77.0
TEMPERATURE_BYTES = 8.0
FLASHINFER_TOPK_TOPP_BYTES = 36.0
PLAIN_DRAW_BYTES = 36.0
#: Extra launches per step over greedy's (module docstring).
PENALTY_KERNELS = 16
TEMPERATURE_KERNELS = 1
FLASHINFER_TOPK_TOPP_KERNELS = 3  # top-k mask, softmax, top-p sampler; + .long() - argmax
PLAIN_DRAW_KERNELS = 3  # softmax, exponential, div; argmax as greedy's
TRITON_TOPK_TOPP_KERNELS = 1  # the mask's one kernel, before the native draw
#: The V1 sampler's paths by release are the planner's rules (one reading of vLLM's source for both):
#: FlashInfer's sampler on by default from :data:`FLASHINFER_SAMPLER_DEFAULT` (0.21.0), the Triton top-k /
#: top-p mask from :data:`~servetune.planner.vllm_rules.TRITON_TOPK_TOPP` (0.17.0) at
#: :data:`TRITON_MIN_ROWS` rows or more (``planner.model_memory.SAMPLER_V1_TRITON_MIN_ROWS``).
TRITON_MIN_ROWS = SAMPLER_V1_TRITON_MIN_ROWS
#: One wave of the Triton mask (top-k and top-p both on): seconds, and seconds a vocabulary entry, on a
#: GH100 die (132 SMs at 1,980 MHz); other GPUs by boost clock (:func:`triton_mask_seconds`). **Measured on the
#: kernel, nothing fitted on a run**: vLLM 0.17.1's own ``topk_topp_triton.py`` timed on an H100 SXM with top-k
#: 20, top-p 0.95 and temperature 0.6 over Gaussian logits (``tests/fixtures/real_h100/kernels/
#: sampler_probe_h100.json``, ``benchmarks/real_vllm/sampler_probe.py``, 2026-12-07): the whole sampler less
#: greedy's at 8-1,024 rows of 32,000, 151,936 and 248,320 logits, less the counted draw (40 B a logit at the
#: table's bandwidth) and the priced launches (``PerfModel.sampler_step_s``), least squares over ``ceil(rows /
#: 132)`` waves: the model is within -14% to +14% of the timed sampler, within 5% from 256 rows. The 0.20.0
#: wheel's kernel (a later top-p search, vLLM pull request 42191) timed within a few percent of it there. First
#: read off vLLM pull request 33538's published table (43.8 us, 1.091 ns: its own benchmark's logits and k / p),
#: which the probe's rows came out 1.5x above in whole-sampler time.
TRITON_WAVE_S = 32.8e-6
TRITON_WAVE_LOGIT_S = 2.663e-9
#: The die the wave constants were timed on, and its SM clock (``_moe_tiles.BOOST_CLOCK_MHZ``'s H100).
TRITON_REFERENCE_MHZ = 1980.0
#: ``FlashInferBackend.supports_compute_capability``: 7.5 to 12.1 in 0.21.0-0.23.0
#: (``v1/attention/backends/flashinfer.py`` 407-410 of 0.23.0); from 0.24.0 8.0 to 12.1 (426-434: SM75
#: "currently broken"), where a T4 keeps the PyTorch-native path (:data:`FLASHINFER_CAPABILITY_FROM_024`).
FLASHINFER_CAPABILITY = (7.5, 12.1)
FLASHINFER_CAPABILITY_FROM_024 = (8.0, 12.1)
#: Kernels a decoder layer launches, by which the per-layer launch costs of ``Calibration`` are
#: read as per-kernel ones (perf.py's docstring: "each of a layer's ~10 kernels").
KERNELS_PER_LAYER = 10
@dataclasses.dataclass(frozen=True)
class SamplerPass:
    """A step's sampler beyond greedy: bytes per vocabulary entry of each sampled row, launches per step."""

    bytes_per_logit: float
    kernels: int
    path: str
    #: The Triton top-k / top-p mask runs at :data:`TRITON_MIN_ROWS` rows or more, priced in waves
    #: (:func:`triton_mask_seconds`) on top of ``bytes_per_logit`` (the draw after it).
    triton_mask: bool = False


def triton_mask_seconds(rows: int, vocab: int, sm_count: int, sm_clock_mhz: float | None) -> float:
    """GPU seconds of vLLM's Triton top-k / top-p mask over ``rows`` rows of ``vocab`` logits: one program
    a row, at most one an SM, so ``ceil(rows / SMs)`` waves of one row sweep each (module docstring); 0
    below :data:`TRITON_MIN_ROWS` rows, where vLLM sorts instead (not priced). A GPU of unknown clock
    takes the reference die's.

    Example:
        >>> round(triton_mask_seconds(512, 151936, 132, 1980.0) / triton_mask_seconds(132, 151936, 132, 1980.0), 6)
        4.0
        >>> triton_mask_seconds(4, 151936, 132, 1980.0)
        0.0
    """
    if rows < TRITON_MIN_ROWS or vocab <= 0:
        return 0.0
    waves = -(-rows // max(1, sm_count or 1))
    clock = TRITON_REFERENCE_MHZ / sm_clock_mhz if sm_clock_mhz else 1.0
    return waves * (TRITON_WAVE_S + TRITON_WAVE_LOGIT_S * vocab) * clock


def runs_v2_sampler(version: tuple[int, int, int], architecture: str, *, v1_runner: bool, dense: bool) -> bool:
    """Whether vLLM samples this model on the V2 model runner: the planner's per-release rule
    (:func:`servetune.planner.vllm_rules.runs_v2_runner`, read in the 0.20.0-0.26.0 wheels'
    ``config/vllm.py``); ``dense`` False stands for MoE or checkpoint-quantized, ``v1_runner`` for
    servetune's ``EngineConfig.v1_runner``, which that rule set.

    Example:
        >>> runs_v2_sampler((0, 23, 0), "Qwen2ForCausalLM", v1_runner=False, dense=True)
        False
        >>> runs_v2_sampler((0, 23, 0), "Qwen3ForCausalLM", v1_runner=False, dense=True)
        True
        >>> runs_v2_sampler((0, 25, 0), "Qwen2ForCausalLM", v1_runner=False, dense=True)
        True
    """
    rules = memory_rules(version)
    if v1_runner or not rules.v2_runner:
        return False
    return runs_v2_runner(rules, architecture=architecture, is_moe=not dense, is_hybrid=False, is_quantized=not dense)


def sampler_pass(sampling: Sampling, version: tuple[int, int, int], compute_capability: float, *,
                 v2_runner: bool) -> SamplerPass | None:
    """The extra sampler work of a step for ``sampling`` on vLLM ``version`` (module docstring):
    zero for greedy, None where that version's path was not read (nothing is then priced).

    Example:
        >>> qwen = Sampling(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.1)
        >>> flashinfer = sampler_pass(qwen, (0, 23, 0), 8.9, v2_runner=False)
        >>> flashinfer.bytes_per_logit, flashinfer.kernels, flashinfer.path
        (117.0, 20, 'V1 runner, penalties, FlashInfer top-k/top-p')
        >>> sampler_pass(qwen, (0, 15, 1), 8.6, v2_runner=False) is None
        True
        >>> sampler_pass(qwen, (0, 17, 1), 9.0, v2_runner=False).triton_mask
        True
    """
    if sampling.greedy:
        return SamplerPass(0.0, 0, "greedy")
    if v2_runner:
        return None
    nbytes = FP32_CAST_BYTES + TEMPERATURE_BYTES - GREEDY_BYTES
    kernels = TEMPERATURE_KERNELS - 1  # no argmax
    parts = ["V1 runner"]
    if sampling.penalties:
        nbytes += PENALTY_BYTES
        kernels += PENALTY_KERNELS
        parts.append("penalties")
    triton = False
    if sampling.uses_top_k and sampling.uses_top_p:
        triton = TRITON_TOPK_TOPP <= version < FLASHINFER_SAMPLER_DEFAULT
        if not triton:
            low, high = FLASHINFER_CAPABILITY if version < (0, 24, 0) else FLASHINFER_CAPABILITY_FROM_024
            if version < FLASHINFER_SAMPLER_DEFAULT or not low <= compute_capability <= high:
                return None
            parts.append("FlashInfer top-k/top-p")
            return SamplerPass(nbytes + FLASHINFER_TOPK_TOPP_BYTES, kernels + FLASHINFER_TOPK_TOPP_KERNELS + 1,
                               ", ".join(parts))
        # The Triton mask (priced in waves, triton_mask_seconds), then the same native draw as temperature alone.
        kernels += TRITON_TOPK_TOPP_KERNELS
        parts.append("Triton top-k/top-p mask")
    elif sampling.uses_top_k or sampling.uses_top_p:
        return None
    nbytes += PLAIN_DRAW_BYTES
    kernels += PLAIN_DRAW_KERNELS + 1
    parts.append("softmax and exponential draw")
    return SamplerPass(nbytes, kernels, ", ".join(parts), triton_mask=triton)
