"""What changes with the vLLM version, for startup memory: one rules object per version family.

Every version check the planner makes sits here, each with its evidence, and is decided once:
:func:`memory_rules` turns a version into a frozen :class:`VllmMemoryRules`, and the defaults, the
profiling accounting, the KV capacity and vLLM's error texts read its fields. A new vLLM release
that moves one of these lines is one new threshold below (and a test against its logs).

Example:
    >>> r = memory_rules((0, 26, 0))
    >>> r.default_gpu_memory_utilization, r.v2_runner, r.subtracts_cudagraph_estimate
    (0.92, True, False)
    >>> memory_rules((0, 21, 0)).subtracts_cudagraph_estimate, v1_runner_rules(memory_rules((0, 22, 0))).subtracts_cudagraph_estimate
    (True, True)
"""

from __future__ import annotations

import dataclasses
import functools

from servetune.errors import NotModelled, SpecError
from servetune.vllm_version import VERSION_RE, Version

__all__ = ["VllmMemoryRules", "memory_rules", "parse_vllm_version", "GiB", "MiB", "MIN_VERSION", "V2_RUNNER",
           "V2_RUNNER_DEFAULT", "V2_RUNNER_DEFAULTS", "V2RunnerDefault", "v2_runner_default", "FLASHINFER_SAMPLER_DEFAULT",
           "TRITON_TOPK_TOPP", "TOTAL_CONSUMED_ACCOUNTING", "ALLREDUCE_RMS_FUSION_DEFAULT", "SORT_TOPK_TOPP_PROFILED", "FLASHINFER_SAMPLER_OPT_IN", "V2_RUNNER_MOE_ARCHITECTURES", "runs_v2_runner",
           "v1_runner_rules", "HYBRID_PREFIX_CACHING", "LANGUAGE_MODEL_ONLY_FLAG", "MAMBA_CACHE_MODE_FLAG",
           "hybrid_prefix_caching_mode"]

GiB = 1 << 30
MiB = 1 << 20

#: The oldest release whose V1 worker memory accounting was read (the 0.10.0, 0.10.1.1 and 0.10.2
#: wheels: ``v1/worker/gpu_worker.py: determine_available_memory``, ``utils/__init__.py:
#: memory_profiling``, ``v1/worker/gpu_model_runner.py: profile_run`` / ``_dummy_sampler_run`` and
#: ``v1/core/kv_cache_utils.py: get_num_blocks`` / ``check_enough_kv_cache_memory`` account as 0.11.0's
#: do for a text model; the default token budgets, sequences, ``gpu_memory_utilization`` and capture
#: sizes are 0.11.0's). Before it the V0 engine's profiler, which servetune does not model. No published
#: 0.10.0 start is pinned (the starts that check these rules are 0.10.1.1 and 0.10.2).
MIN_VERSION: Version = (0, 10, 0)
#: First version whose published starts, where the environment is not stated, are planned with PyTorch's sort in
#: the profile run's sampler although the version takes FlashInfer's top-k/top-p where it imports
#: (:data:`FLASHINFER_SAMPLER_OPT_IN`): every 0.11.0 start in the collections profiles at the sort path's size (two
#: logs say "FlashInfer is not available"; llm-d's 0.11.0 starts print no sampler line, and their image,
#: vllm/vllm-openai:v0.11.0, installs FlashInfer 0.3.1 through vLLM's ``tools/flashinfer-build.sh``, yet their peaks
#: are the sort's: an image's install alone does not settle the sampler, and gpustack's 0.11.0 runs state nothing,
#: docs/accuracy.md).
#: Only ``EngineConfig.flashinfer_available`` None (not stated) reads it.
SORT_TOPK_TOPP_PROFILED: Version = (0, 11, 0)
#: First version whose V1 sampler takes FlashInfer's top-k/top-p only on ``VLLM_USE_FLASHINFER_SAMPLER=1`` (opt-in):
#: ``v1/sample/ops/topk_topp_sampler.py:34@0.11.1`` (``if envs.VLLM_USE_FLASHINFER_SAMPLER:``, "Users must opt in
#: explicitly"; the same test at ``:35`` of 0.12.0-0.16.0 and ``:39`` of 0.17.0-0.20.0), where 0.10.x and 0.11.0 take it
#: whenever ``flashinfer.sampling`` imports and the variable is not 0 (``topk_topp_sampler.py:17-21,39-57@0.11.0``:
#: ``envs.VLLM_USE_FLASHINFER_SAMPLER is not False``; ``envs.py:618-620@0.11.0``, unset reads None). The variable reads
#: None when unset in every release 0.11.1-0.20.0 (``envs.py:647-651@0.11.1``, ``:716-720@0.20.0``); 0.21.0 turns it on
#: (:data:`FLASHINFER_SAMPLER_DEFAULT`). Read in the 0.11.0-0.20.0 wheels on 2026-12-06, after the held-out errors of
#: gpustack's Qwen3-235B runs (the default called impossible) were seen.
FLASHINFER_SAMPLER_OPT_IN: Version = (0, 11, 1)
#: First version whose V2 model runner the calibration was measured on (0.26, the real H200 runs),
#: and whose default-V2 rule is 0.26's (:data:`V2_RUNNER_MOE_ARCHITECTURES`). Version-keyed figures
#: that were read or measured at 0.26 only (the single-GPU non-torch split in
#: :mod:`servetune.planner.comm`, ``sliding_reserves_in_flight``, ``mxfp4_keeps_loaded_scales``)
#: stay keyed to it.
V2_RUNNER: Version = (0, 26, 0)
#: First version that starts some models on the V2 model runner by default (0.22.0: Qwen3 dense;
#: see :data:`V2_RUNNER_DEFAULTS`). 0.20.0 and 0.21.0 run it only with ``VLLM_USE_V2_MODEL_RUNNER=1``
#: (``envs.py`` line 1675 of 0.20.0, 1711 of 0.21.0: ``os.getenv("VLLM_USE_V2_MODEL_RUNNER", "0")``;
#: ``v1/worker/gpu_worker.py`` line 153 / 156: ``self.use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER``).
V2_RUNNER_DEFAULT: Version = (0, 22, 0)
#: First version whose V1 sampler takes FlashInfer's top-k/top-p by default on CUDA
#: (``VLLM_USE_FLASHINFER_SAMPLER`` unset reads True: ``envs.py`` lines 726-730 of 0.21.0, 818-822 of
#: 0.22.0, 820-824 of 0.23.0, 796-800 of 0.24.0, 808-812 of 0.25.0, 841-845 of 0.26.0; 0.20.0's lines
#: 716-720 read None, opt-in). See :attr:`VllmMemoryRules.flashinfer_sampler_default`.
FLASHINFER_SAMPLER_DEFAULT: Version = (0, 21, 0)
#: First version whose V1 runner masks top-k/top-p with the Triton kernel (see the sampler
#: constants of :mod:`servetune.planner.model_memory`): ``apply_top_k_top_p`` takes
#: ``apply_top_k_top_p_triton`` at 8 rows or more in the 0.17.0 and 0.17.1 wheels (the same
#: ``topk_topp_triton.py``; vLLM pull request 33538), not in 0.16.0's. Read 2026-12-07; 0.18.0 until then
#: (0.12-0.17 had not been read), which planned the held-out vLLM 0.17.1 A100 start with the sort's
#: warm-up (-1.50% KV; -0.30% now). The simulator prices the same kernel's time from this release
#: (:mod:`servetune.sim.sampling`).
TRITON_TOPK_TOPP: Version = (0, 17, 0)
#: First version whose default optimization level (-O2) turns on the FlashInfer all-reduce + RMSNorm fusion pass
#: where it can run; see :attr:`VllmMemoryRules.allreduce_rms_fusion_default`.
ALLREDUCE_RMS_FUSION_DEFAULT: Version = (0, 17, 0)
#: First version whose ``memory_profiling`` (``vllm/utils/mem_utils.py``) charges the KV budget with
#: ``total_consumed`` (the free-memory drop since the init snapshot, from mem_get_info) plus the
#: transient peak, instead of weights + torch peak increase + non-torch growth: first seen in the
#: 0.27.0 wheel (0.26.0 has the old sum). Everything torch allocated after the init snapshot and
#: still holds after profiling is now charged; see
#: :func:`servetune.planner.model_memory.persistent_runner_bytes`.
TOTAL_CONSUMED_ACCOUNTING: Version = (0, 27, 0)


def parse_vllm_version(version: str) -> Version:
    """``"0.26.0"`` / ``"v0.26"`` / ``"0.26.0rc1"`` -> ``(0, 26, 0)``; SpecError for V0-era or bad text.

    A fourth part (``0.10.1.1``) is a patch release of the first three and is read by them.

    Example:
        >>> parse_vllm_version("v0.13.0rc2"), parse_vllm_version("0.10.1.1")
        ((0, 13, 0), (0, 10, 1))
    """
    text = str(version).strip()
    parts = text.split(".")
    if len(parts) == 4 and all(p.isdigit() for p in parts):
        text = ".".join(parts[:3])
    m = VERSION_RE.fullmatch(text)
    if not m:
        raise SpecError("vllm_version", f"cannot read {version!r} as a vLLM version", "write e.g. 0.26.0")
    v = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
    if v < MIN_VERSION:
        raise SpecError("vllm_version", f"{version} predates the V1 engine's memory profiler servetune models (0.10.0)",
                        "use vLLM 0.10.0 or newer")
    return v


@dataclasses.dataclass(frozen=True)
class VllmMemoryRules:
    """How one vLLM version resolves its defaults and accounts its startup memory.

    Built by :func:`memory_rules`; each field names the behaviour and the version it starts at.
    """

    version: Version
    #: ``gpu_memory_utilization``'s default: 0.9, 0.92 from 0.20 (``vllm/engine/arg_utils.py``).
    default_gpu_memory_utilization: float
    #: Async scheduling on by default where supported (0.14+; vLLM turns it off with PP): 0.14.0's
    #: ``SchedulerConfig.async_scheduling`` defaults to None, which ``VllmConfig.__post_init__`` turns
    #: on unless PP > 1, a non-EAGLE draft model or an executor other than mp/uni/external_launcher
    #: (config/scheduler.py:133, config/vllm.py:588-628 @0.14.0 and @0.14.1); 0.13.0's default is False
    #: (config/scheduler.py:133@0.13.0). Read 2026-12-06, after published 0.14.1 runs were judged with it off.
    async_scheduling_default: bool
    #: The >= 160 GiB usage-context tier (16384 tokens / 1024 sequences), 0.29+.
    large_gpu_batch_tier: bool
    #: ``--cuda-graph-sizes``: one value N, step 8 all the way (before 0.13).
    capture_step8_only: bool
    #: The default capture cap on Blackwell (compute capability 10.x): 1024 from 0.29, else 512.
    blackwell_capture_cap: int
    #: The capture sizes take ``max_num_batched_tokens`` when it is under the cap (0.25+) ...
    capture_adds_token_budget: bool
    #: ... and ``max_num_seqs`` likewise (0.33+).
    capture_adds_max_num_seqs: bool
    #: The V2 model runner's profiling: the cold-compile floor and its sampler, no CUDA-graph estimate
    #: off the KV budget (its ``profile_cudagraph_memory`` returns 0: ``v1/worker/gpu/model_runner.py``
    #: line 620 of 0.22.0, 660 of 0.23.0, 684 of 0.24.0, 680 of 0.25.0, 705 of 0.26.0) and no sampler
    #: warm-up after capture (``gpu_worker.py: compile_or_warm_up_model`` runs ``warmup_kernels`` instead,
    #: line 685 of 0.22.0). True from 0.22 (:data:`V2_RUNNER_DEFAULT`), the first release that starts a
    #: model on it by default; which models do is :func:`runs_v2_runner`, and the others get
    #: :func:`v1_runner_rules`.
    v2_runner: bool
    #: The V1 runner's Triton top-k/top-p (0.17+), for batches of 8 rows or more: the call that peaks
    #: in the dummy sampler run, FlashInfer's default (0.21+) notwithstanding
    #: (:attr:`flashinfer_sampler_default`).
    triton_topk_topp: bool
    #: ``VLLM_USE_FLASHINFER_SAMPLER`` is on by default (0.21+, :data:`FLASHINFER_SAMPLER_DEFAULT`): the
    #: V1 runner's ``TopKTopPSampler`` binds ``forward_cuda`` (FlashInfer's
    #: ``top_k_top_p_sampling_from_logits``) where ``FlashInferBackend.supports_compute_capability``
    #: holds: 7.5 to 12.1 in 0.21.0-0.23.0 (``v1/attention/backends/flashinfer.py`` lines 409-412 of
    #: 0.21.0, 408-411 of 0.22.0, 407-410 of 0.23.0), 8.0 to 12.1 from 0.24.0 (lines 426-434; SM75 is
    #: "currently broken"); outside it vLLM warns and keeps the PyTorch-native path
    #: (``v1/sample/ops/topk_topp_sampler.py`` lines 39-74 of 0.21.0; ``flashinfer_sampler_supported``,
    #: lines 21-67 of 0.23.0-0.26.0). The profile run's peak does not move: from the same 0.21.0 the
    #: dummy sampler (``v1/worker/gpu_model_runner.py: _dummy_sampler_run``, "Also warm
    #: forward_native", line 5746 of 0.21.0, 5954 of 0.22.0, 6018 of 0.23.0, 6089 of 0.24.0, 6140 of
    #: 0.25.0) calls the sampler a second time with a per-request generator, which ``forward_cuda``
    #: hands to ``forward_native``: the Triton top-k/top-p of 0.17-0.20. FlashInfer's call holds the
    #: model-dtype logits, their fp32 copy, the top-k-masked fp32 copy and its softmax
    #: (SAMPLER_V1_FLASHINFER_FP32_COPIES: dtype + 12 B a logit); the native call the same three fp32
    #: tensors (the copy masked in place, the probabilities, the exponential noise) plus the Triton
    #: kernel's cached buffer, so it is the peak. FlashInfer is a wheel requirement
    #: (``flashinfer-python`` pinned in the wheels' METADATA); an install without it does not fall back:
    #: with the variable unset, the sampler's construction imports ``v1/attention/backends/flashinfer.py``,
    #: whose ``from flashinfer import (...)`` (line 11) raises ``ModuleNotFoundError`` (0.23.0's
    #: ``flashinfer_sampler_supported`` docstring, lines 29-30: "Assumes flashinfer is installed").
    flashinfer_sampler_default: bool
    #: The profile run's dummy sampler takes FlashInfer's top-k/top-p (``flashinfer.sampling.
    #: top_k_top_p_sampling_from_logits``: a top-k-masked fp32 copy and its softmax, no sort) instead
    #: of PyTorch's sort: 0.10.x. 0.10.0, 0.10.1.1 and 0.10.2 pick FlashInfer whenever it imports and
    #: ``VLLM_USE_FLASHINFER_SAMPLER`` is not 0 (``v1/sample/ops/topk_topp_sampler.py:
    #: TopKTopPSampler.__init__``, lines 31-60; ``forward_cuda`` 88-109), and the published 0.10.1.1
    #: starts on A100s that log "Using FlashInfer for top-p & top-k sampling" profile about 0.87 GiB
    #: below the sort path's 37.95 B a logit at 256 rows x 152,064 (tests/fixtures/published_logs,
    #: dennislee22_*). 0.11.0 selects the same way (``topk_topp_sampler.py:39-57@0.11.0``; ``forward_cuda``
    #: ``:99-122`` and ``flashinfer_sample`` ``:256-295`` as 0.10.2's, and ``_dummy_sampler_run``
    #: (``v1/worker/gpu_model_runner.py:3183-3225@0.11.0``) calls the sampler once, top-k vocab - 1, top-p 0.9, no
    #: generators, as 0.10.2's does), so the same count holds; from 0.11.1 it is opt-in (:data:`FLASHINFER_SAMPLER_OPT_IN`).
    #: Whether FlashInfer imports is the caller's fact (``EngineConfig.flashinfer_available``): where it is not stated,
    #: 0.11.0 is planned with the sort (:data:`SORT_TOPK_TOPP_PROFILED`: its published starts profile at that size;
    #: llm-d's 0.11.0 image, the fit of SAMPLER_BYTES_PER_LOGIT_V1). A 0.10 install without FlashInfer
    #: ("FlashInfer is not available. Falling back to the PyTorch-native implementation") sorts.
    flashinfer_topk_topp: bool
    #: CUDA graphs default to FULL_AND_PIECEWISE (a FULL decode graph per capture size up to
    #: ``max_num_seqs`` besides the piecewise ones) from 0.11.0; 0.10.x defaults to PIECEWISE only
    #: (``config/__init__.py: VllmConfig.__post_init__``, lines 3550-3560 of 0.10.1.1, 3385-3395 of
    #: 0.10.2: ``CUDAGraphMode.PIECEWISE`` where 0.11.0 sets ``FULL_AND_PIECEWISE``; 0.10.0 has no
    #: cudagraph_mode, only ``CompilationConfig.full_cuda_graph = False``). The published
    #: 0.10.x logs capture "(mixed prefill-decode, PIECEWISE)" only, and their pools (0.50-0.54 GiB at
    #: TP=1) sit nearer the piecewise-only estimate than the one with FULL graphs (+0.2 GiB over).
    full_decode_graphs: bool
    #: 0.27+ charges ``total_consumed``, so the V2 runner's persistent sampler state too.
    charges_persistent_runner: bool
    #: 0.27+ charges ``total_consumed``, so the V1 runner's own buffers too: the runner is built after the init
    #: snapshot (``v1/worker/gpu_worker.py`` lines 395 / 423 of 0.27.0, 406 / 438 of 0.28.0) and keeps
    #: ``inputs_embeds`` [max_num_batched_tokens, hidden] in the model dtype for every model
    #: (``v1/worker/gpu_model_runner.py`` line 798 of 0.27.0; 0.26.0's sum never saw it). Kept by
    #: :func:`v1_runner_rules`; read after the held-out 0.28.0 Qwen3.5 starts of hybrid.yaml were judged (their
    #: ~0.3-2.4 GiB of consumed memory beyond the plan, of which this is 0.02-0.08).
    charges_v1_runner_buffers: bool
    #: The CUDA-graph estimate comes off the KV budget. <=0.16: no estimate at all; 0.18/0.19: only
    #: with VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 (default 0); from 0.20: on by default on the V1
    #: model runner (:func:`v1_runner_rules`). The V2 runner (0.22+ for the models
    #: :func:`runs_v2_runner` names) estimates 0 (its ``profile_cudagraph_memory``, see
    #: :attr:`v2_runner`); the real 0.26 H200 logs agree (69.9 - 1.59 - 0.44 - 0.22 = 67.65 ≈ the
    #: logged 67.64; no "Estimated CUDA graph memory" line). Later versions are assumed to keep the V2
    #: runner's behaviour until logs say otherwise.
    subtracts_cudagraph_estimate: bool
    #: The budget ``total * gpu_memory_utilization`` is rounded up (0.33+), not truncated.
    budget_rounds_up: bool
    #: 0.33: the null block comes off the blocks a max-length sequence must fit in, and a
    #: ``num_gpu_blocks_override`` is checked (and reported) as the KV memory it takes.
    null_block_first: bool
    #: KV tokens logged as ``int(max_concurrency * max_model_len)`` (0.20.1+: ``_report_kv_cache_config``,
    #: kv_cache_utils.py:1699-1708@0.20.1, line 1708 of 0.21.0, 1731 of 0.22.0; 0.20.0 still logs
    #: blocks // groups x the smallest block, :1694-1698@0.20.0), not blocks x block size. Placed at 0.25
    #: until 2026-12-06 (0.20-0.24 unread); vllm-project/vllm#49064's 0.23.1 reproduction (161 blocks,
    #: 123,399 tokens at 122,633) logs the concurrency form, where the older one gives 31,360.
    kv_tokens_from_concurrency: bool
    #: GiB printed with ``format_gib`` (round to 2, e.g. ``-0.52``) from 0.16, ``%.2f`` before.
    gib_rounded: bool
    #: The V1 model runner warms its sampler up after CUDA-graph capture, outside the profiled budget
    #: (``v1/worker/gpu_worker.py: compile_or_warm_up_model``: a dummy run of
    #: ``min(max_num_seqs, max_num_batched_tokens)`` tokens, then ``_dummy_sampler_run`` over as many
    #: rows, allocating the logits and the sampler's fp32 tensors afresh in what the KV cache and the
    #: graphs left of the GPU; "CUDA out of memory occurred when warming up sampler with N dummy
    #: requests" when they do not fit). Every V1-runner version from 0.11 (the published 0.19.0
    #: gpt-oss-20b starts died there); the V2 runner (0.22+) warms up with two real engine steps
    #: (``v1/worker/gpu/warmup.py: warmup_kernels``) instead, not modelled as a failure point.
    sampler_warmup_after_capture: bool
    #: A sliding-window KV group reserves ``window - 1 + max_in_flight_tokens`` tokens of one request
    #: (``SlidingWindowSpec.max_memory_usage_bytes``): 0.26's ``VllmConfig.max_in_flight_tokens``,
    #: every concurrent batch's ``max_num_batched_tokens`` (async scheduling: two batches on the V1
    #: runner, ``pp + 1`` on the V2 runner; else ``pp``), where earlier releases reserve one batch's.
    #: Placed at 0.26, the release whose source was read (not pinned earlier).
    sliding_reserves_in_flight: bool
    #: vLLM's long error texts (docs link, CPU-backend note): the long form is what vLLM 0.26
    #: printed on the H200 (b5_fail_u0012) and 0.33's source has; 0.11 has the short form. The
    #: switch is placed at 0.20 (between 0.11 and 0.26; not pinned).
    long_error_texts: bool
    #: The Triton MXFP4 MoE backends keep the loaded e8m0 scales beside the swizzled copy (two copies:
    #: vLLM 0.19.0's gpt-oss-20b starts logged 13.64 GiB at TP=1, 7.01 at TP=2). 0.26 deletes them after
    #: swizzling (``fused_moe/oracle/mxfp4.py``: ``del layer.w13_weight_scale``), and its gpt-oss-20b start
    #: on the H200 logged 13.03 GiB, one copy less (``tests/fixtures/real_h200_classes``). Placed at 0.26,
    #: the release whose source was read and whose log shows it (not pinned between 0.19 and 0.26).
    mxfp4_keeps_loaded_scales: bool
    #: The chat endpoint parses the model's whole chat template again for every request, on the API
    #: server's event loop: vLLM 0.11.0 only. Its ``entrypoints/chat_utils.py:
    #: resolve_chat_template_kwargs`` (called by ``apply_hf_chat_template`` from
    #: ``OpenAIServingChat._preprocess_chat``, synchronously) builds a new
    #: ``jinja2.sandbox.ImmutableSandboxedEnvironment`` and ``env.parse``-s the template each call;
    #: 0.10.x has no such step, and 0.11.1 caches it (``_cached_resolve_chat_template_kwargs =
    #: lru_cache(...)``, as 0.26 still does). Read in the released source of 0.10.2, 0.11.0, 0.11.1,
    #: 0.11.2 and 0.12.0. gpt-oss's chat (Harmony, ``use_harmony``) never renders a Jinja template.
    chat_template_parsed_per_request: bool
    #: ``vllm serve --data-parallel-size D`` without ``--api-server-count`` starts one API server process per
    #: DP rank (internal load balancing): 0.15.0+, whose ``entrypoints/cli/serve.py:82-103`` sets
    #: ``api_server_count = data_parallel_size`` ("Defaulting api_server_count to data_parallel_size") from an
    #: ``--api-server-count`` default of None (``entrypoints/openai/cli_args.py:286-291@0.15.0``); through 0.14.1
    #: the default is 1 (``cli_args.py:283-287@0.14.1``): one API server's loop serves every replica. Read in the
    #: released 0.14.1, 0.15.0, 0.15.1, 0.16.0, 0.18.0 and 0.20.0 wheels (and 0.26.0's ``serve.py:104-121``),
    #: 2026-12-06, after the published 0.14.1 DP=2 runs had been judged with one API server per replica.
    api_server_per_dp_rank: bool
    #: On Hopper (compute capability 9.0) a 4-bit checkpoint with zero points (AWQ) is served by
    #: Machete, the first mixed-precision kernel vLLM tries there (``kernels/linear/__init__.py``
    #: ``_POSSIBLE_KERNELS``), whose ``process_weights_after_loading`` (``mixed_precision/machete.py``,
    #: ``transform_w_zp``) keeps the zero points as ``-zero x scale`` in the activation dtype: 2 bytes a
    #: group where the checkpoint packs half a byte. Read in vLLM 0.26.0's source and seen in its log
    #: ("Using MacheteLinearKernel for AutoAWQMarlinLinearMethod", 5.49 GiB of an AWQ 8B's weights
    #: on an H100, 2026-12-06, tests/fixtures/real_h100_classes); not traced to an earlier release.
    #: Made after reading that start.
    machete_float_zero_points: bool
    #: vLLM's prefix-cache counters (``vllm:prefix_cache_queries`` / ``_hits``, the logged hit rate)
    #: take a resumed (preempted) request's lookup like any other: before 0.11.1. vLLM pull request
    #: 25787 (merged 2025-09-26, "Don't count preempted tokens in prefix cache hit rate") records
    #: those in ``PrefixCacheStats.preempted_*``, which no counter or log line reads (0.26's
    #: ``v1/metrics/stats.py``, ``loggers.py``). Pinned at 0.11.1 by the wheels' source: 0.11.0's
    #: ``v1/core/kv_cache_manager.py`` (lines 185-189) still counts a resumed request's lookup, 0.11.1's
    #: (209-213) records it apart.
    prefix_stats_count_preempted: bool
    #: A Mamba2 hybrid's attention block is raised in multiples of ``max(16, block_size)`` (the platform's
    #: ``_align_hybrid_block_size``: ``platforms/interface.py`` lines 876-882 of 0.26.0, 620-626 of 0.22.0,
    #: 577-583 of 0.20.0, 616-622 of 0.21.0) instead of 16 (``HybridAttentionMambaModelConfig``,
    #: ``models/config.py`` lines 367-368 of 0.11.0, 218 and 273-275 of 0.19.0). Read in 0.11.0, 0.13.0, 0.16.0,
    #: 0.19.0 (16) and 0.20.0, 0.21.0, 0.22.0, 0.24.0, 0.25.0, 0.26.0 (platform; 0.20 and 0.21 read with the
    #: prefix-caching rules, which moved the threshold from 0.22). Differs only where ``block_size`` is set above 16.
    hybrid_align_to_block_size: bool
    #: Nemotron-H's SSM state dtype where ``mamba_ssm_cache_dtype`` is ``auto``: the config's
    #: ``mamba_ssm_cache_dtype``, else this default (``NemotronHForCausalLMConfig``, ``models/config.py``:
    #: ``"float16"`` at line 504 of 0.13.0, 576 of 0.16.0, 494 of 0.19.0; ``DEFAULT_MAMBA_SSM_CACHE_DTYPE =
    #: "float32"`` at line 410 of 0.20.0 and 0.21.0, 398 of 0.22.0, 606 of 0.26.0). 0.11.0 has no such class:
    #: ``auto``, the model dtype (and ignores the config's field). 0.12 not read.
    nemotron_h_ssm_default: str
    #: A gated-delta-net layer runs a step that holds any (non-speculative) prefill through its chunked path for
    #: every non-speculative request of the step, the decoding ones too: before 0.23.0. The layer's ``_forward_core``
    #: sends the whole non-spec batch to ``chunk_gated_delta_rule`` when ``attn_metadata.num_prefills > 0``, after
    #: gathering each request's SSM state into a new tensor (``ssm_state[non_spec_state_indices_tensor].contiguous()``)
    #: and before scattering the final states back (``ssm_state[non_spec_state_indices_tensor] = ...``); only a
    #: decode-only step updates the states in place (``fused_recurrent_gated_delta_rule``, ``inplace_final_state``):
    #: ``models/qwen3_next.py`` lines 547-569 of 0.11.0 and 774-806 of 0.17.1, ``layers/mamba/gdn_linear_attn.py``
    #: lines 948-975 of 0.20.0, ``layers/mamba/gdn/qwen_gdn_linear_attn.py`` lines 1463-1487 of 0.22.1 (the
    #: non-spec state indices are ``block_table_tensor[:, 0]``, every request: ``v1/attention/backends/gdn_attn.py``
    #: line 199 of 0.17.1). 0.23.0 peels the decodes off to the in-place update (``split_non_spec``: line 1395 of
    #: 0.23.0; 0.26.0's lines 1315-1319 and 1400-1421). Read in the 0.11.0, 0.17.1, 0.20.0, 0.22.1 and 0.26.0 wheels;
    #: ``split_non_spec`` searched for in 0.21.0 and 0.22.0 (absent) and 0.23.0, 0.24.0, 0.25.0 (present); 2026-12-07,
    #: after the published 0.17.1 Qwen3.5-9B ShareGPT bursts were seen simulated fast. Mamba2 layers split decodes
    #: from prefills (``layers/mamba/mamba_mixer2.py`` lines 606-616 of 0.17.1): not this rule.
    gdn_mixed_batch_chunked: bool
    #: What ``--enable-prefix-caching`` does to a Mamba hybrid, one of :data:`HYBRID_PREFIX_CACHING` (read per release
    #: in ``model_executor/models/config.py``, ``MambaModelConfig.verify_and_update_config``; see
    #: :func:`hybrid_prefix_caching_mode`).
    hybrid_prefix_caching: str
    #: 'align' mode asserts ``block_size <= max_num_batched_tokens`` ("In Mamba cache align mode, block_size (N) must
    #: be <= max_num_batched_tokens (M)."): ``config/vllm.py`` line 1220 of 0.17.0, 1723 of 0.19.0, 2103 of 0.22.0,
    #: 2267 of 0.26.0; absent from 0.15.0, 0.16.0, 0.27.0 and 0.28.0.
    mamba_align_block_within_batch: bool
    #: 'align' mode asserts ``long_prefill_token_threshold >= block_size`` where the threshold is set:
    #: ``config/vllm.py`` line 1012 of 0.15.0, 1228 of 0.17.0, 1729 of 0.19.0, 2273 of 0.26.0; absent from 0.27.0.
    mamba_align_block_within_long_prefill: bool
    #: 0.28 turns prefix caching on by default for hybrids too (``engine/arg_utils.py`` line 2650 of 0.28.0:
    #: ``default_prefix_caching = model_config.is_prefix_caching_supported``, true for ``attn_type == "hybrid"``,
    #: ``config/model.py`` lines 2072-2074; 0.27.0 still adds ``and not model_config.is_hybrid``, arg_utils.py lines
    #: 2604-2606), and with it ``mamba_cache_mode`` 'align' (``MambaModelConfig``, ``models/config.py`` lines 603-604
    #: of 0.28.0): each request holds two Mamba blocks (``MambaSpec.max_memory_usage_bytes``, ``v1/kv_cache_interface.py``
    #: lines 687-696) and the Mamba block size is the attention block (``platforms/interface.py`` lines 917-918),
    #: the attention block raised as without prefix caching (lines 902-906). Read after the held-out 0.28.0 Qwen3.5 starts
    #: of tests/fixtures/published_logs/hybrid.yaml were judged without it (their logged concurrency needs 22 blocks a
    #: request where one Mamba block a group gives 19); nothing in it is fitted.
    hybrid_prefix_caching_default_on: bool
    #: The Triton fused-MoE workspaces outlive the forward from 0.11: 0.11.0 keeps them in class-level
    #: ``SharedResizableBuffer`` s (``fused_moe/modular_kernel.py`` lines 594-629 and 690), 0.13.0 on in vLLM's
    #: workspace manager (``modular_kernel.py`` line 32, ``v1/worker/workspace.py``), so the profile run's sampler
    #: runs beside them (:func:`~servetune.planner.modelclass.moe_workspace_bytes`). 0.10.2 allocates them per
    #: call (``fused_moe.py`` lines 1580-1590, ``modular_kernel.py`` lines 562-567): freed after each MoE layer, they
    #: count in the forward's peak only. Read after the held-out Qwen3-Next start of hybrid.yaml (vLLM 0.10.2)
    #: came out 3.1% low; nothing fitted. No other published MoE start before 0.11 uses the Triton experts.
    moe_workspace_kept: bool
    #: Qwen3-VL's profile run encodes a dummy video counted at 12.5 tokens a frame token and holds its outputs copied
    #: into zeros of that count (0.11 / 0.12: ``modelclass.qwen3_vl_encoder_profile``'s ``formatted_video``; 0.13.0
    #: drops the factor, qwen3_vl.py lines 710-722, and the copy, gpu_model_runner.py 4424-4480, so the image wins).
    qwen3_vl_formatted_video: bool
    #: Nemotron-H's MoE router holds its weight in the model dtype on Hopper (compute capability 9.0) and Blackwell
    #: (10.x), fp32 elsewhere, from 0.17: ``GateLinear(force_fp32_compute=True)`` stores fp32 only where no
    #: specialized router kernel runs (``fused_moe/router/gate_linear.py`` lines 38-48 of 0.17.0, 59-68 of 0.26.0 and
    #: 0.28.0; ``models/nemotron_h.py`` line 151 of 0.17.0, 149 of 0.26.0 and 0.28.0). Before, a ``ReplicatedLinear``
    #: in fp32 on every GPU (lines 141-148 of 0.11.1 and 0.12.0, 146-153 of 0.13.0, 149-156 of 0.16.0). Read before any
    #: Nemotron-H MoE start was judged.
    router_model_dtype_on_sm90_sm100: bool
    #: The first releases that build Nemotron-H's MoE layers: ``E`` from 0.11.1 (``ALL_DECODER_LAYER_TYPES``,
    #: ``models/nemotron_h.py`` lines 304-308 of 0.11.0 hold ``M``, ``-``, ``*`` only; 497-502 of 0.11.1 add ``E``),
    #: a latent MoE (``moe_latent_size``) from 0.13 (``NemotronHMoE.use_latent_moe``, line 139 of 0.13.0; 0.12.0
    #: reads no such field and would build the experts at the hidden width). Read before any such start was judged.
    nemotron_h_moe_layers: bool
    nemotron_h_latent_moe: bool
    #: A Mamba hybrid with FULL decode CUDA graphs refuses to capture them when ``max_num_seqs`` exceeds the
    #: KV blocks ("max_num_seqs (N) exceeds available Mamba cache blocks (M)": ``config/compilation.py``
    #: line 1436 of 0.20.0 and 0.21.0, 1453 of 0.22.0, 1451 of 0.24.0, 1458 of 0.25.0, 1492 of 0.26.0, 1507 of 0.27.0,
    #: 1508 of 0.28.0; absent from 0.11.0, and 0.19.0 caps the capture sizes to the blocks instead, lines 1285-1322;
    #: placed at 0.22 until 2026-12-06, when 0.20 and 0.21 were read). M is ``kv_cache_config.num_blocks`` (lines 1433 /
    #: 1450 / 1489 / 1504 / 1505), the whole shared pool every KV group draws on, not a pool of the Mamba layers: the
    #: runner passes its own ``kv_cache_config`` (``v1/worker/gpu_model_runner.py`` line 6696 of 0.22.0, 7115 of
    #: 0.26.0, 7188 of 0.27.0, 7323 of 0.28.0), whose ``num_blocks`` is ``available // page_size // group_size``
    #: (``v1/core/kv_cache_utils.py`` ``get_num_blocks``, line 950 of 0.22.0, 1005 of 0.26.0, 1008 of 0.27.0, 988 of
    #: 0.28.0, called at 1304 / 1409 / 1426 / 1392). Unchanged 0.22-0.28, so the plan's ``num_gpu_blocks``.
    #: Planned as ``kv_too_small`` (too few blocks for the configuration).
    mamba_blocks_cover_max_num_seqs: bool
    #: Architectures of modelled classes this release no longer serves, with the last release that did
    #: (``_PREVIOUSLY_SUPPORTED_MODELS``, ``models/registry.py``: ``"BambaForCausalLM": "0.23.0"`` at line 731 of
    #: 0.24.0, 743 of 0.26.0; 0.23.0 still registers it at line 87).
    removed_architectures: tuple[tuple[str, str], ...]
    #: The FlashInfer all-reduce + RMSNorm fusion pass is on by default (0.17+): ``-O2`` (the default level) sets
    #: ``pass_config.fuse_allreduce_rms`` to ``enable_allreduce_rms_fusion`` (``vllm/config/vllm.py`` line 204 of
    #: 0.17.0, 208 of 0.19.0, 256 of 0.26.0, 272 of 0.28.0; False at every level in 0.16.0, lines 124-181): TP > 1,
    #: CUDA, FlashInfer usable (``has_flashinfer``: the package, and its cubins or nvcc), compute capability 9.0 or
    #: 10.x. The pass builds FlashInfer's workspace when the model is compiled, after the init snapshot, so it is
    #: non-torch growth charged to the KV budget (:func:`servetune.planner.comm.comm_memory`). 0.12-0.16 have the
    #: pass but off unless asked for; before 0.12 it is ``enable_fi_allreduce_fusion``, off.
    allreduce_rms_fusion_default: bool
    #: ... and only with ``pipeline_parallel_size == 1`` (0.17-0.20: line 131 of 0.17.0, 137 of 0.20.0, with a
    #: ``data_parallel_size == 1`` check beside it; 0.23: line 149); 0.21, 0.22 and 0.24+ check neither.
    allreduce_rms_fusion_single_stage: bool
    #: ... and on Blackwell for the whole 10.x family (``is_device_capability_family(100)``, 0.19+), where 0.17 and
    #: 0.18 take compute capability 10.0 only (``is_device_capability(100)``).
    allreduce_rms_fusion_blackwell_family: bool
    #: ``init_device`` builds the distributed environment (NCCL's communicator, the custom all-reduce's IPC buffers,
    #: the symmetric-memory communicator) before it takes the init snapshot, so their memory is outside the KV
    #: budget (0.11+: ``v1/worker/gpu_worker.py`` lines 165-182 of 0.11.0, "Initialize the distributed environment
    #: BEFORE taking memory snapshot"; 216 / 232 of 0.12.0; 263 / 282 of 0.19.0). 0.10.x takes the snapshot first
    #: (line 174 / 192 of 0.10.1.1, 175 / 193 of 0.10.2), so what they allocate is non-torch growth charged to it.
    communicators_before_snapshot: bool

    # -- vLLM's texts --------------------------------------------------------------------------

    def gib_text(self, nbytes: float) -> str:
        return str(round(nbytes / GiB, 2)) if self.gib_rounded else f"{nbytes / GiB:.2f}"

    def no_memory_text(self) -> str:
        if self.long_error_texts:
            return ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                    "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, "
                    "despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for "
                    "more details.")
        return ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                "initializing the engine.")

    def sampler_warmup_oom_text(self, num_reqs: int) -> str:
        """``gpu_model_runner.py: _dummy_sampler_run``'s error (the same text from 0.11 to 0.26)."""
        return (f"CUDA out of memory occurred when warming up sampler with {num_reqs} dummy requests. Please try "
                "lowering `max_num_seqs` or `gpu_memory_utilization` when initializing the engine.")

    def kv_too_small_text(self, max_model_len: int, need: int, avail: int, est: int) -> str:
        if self.long_error_texts:
            return (f"To serve at least one request with the model's max seq len ({max_model_len}), "
                    f"({self.gib_text(need)} GiB KV cache is needed, which is larger than the available KV cache "
                    f"memory ({self.gib_text(avail)} GiB). Based on the available memory, the estimated maximum "
                    f"model length is {est}. Try increasing `gpu_memory_utilization` (which also controls CPU "
                    "memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See "
                    "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
        return (f"To serve at least one request with the models's max seq len ({max_model_len}), "
                f"({need / GiB:.2f} GiB KV cache is needed, which is larger than the available KV cache memory "
                f"({avail / GiB:.2f} GiB). Based on the available memory, the estimated maximum model length is "
                f"{est}. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing "
                "the engine.")


#: The MoE architectures vLLM runs on the V2 model runner by default (vLLM 0.26.0,
#: ``vllm/config/vllm.py`` ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES``, line 68). Every other MoE model, and
#: every hybrid (Mamba / linear-attention) or attention-free model, stays on the V1 runner
#: (``VllmConfig._is_default_v2_model_runner_model``, lines 605-622). Later versions are assumed to keep 0.26's
#: list until their source says otherwise.
V2_RUNNER_MOE_ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM", "GraniteMoeForCausalLM", "InklingForCausalLM",
                                         "InklingForConditionalGeneration", "LongcatFlashNgramForCausalLM",
                                         "Qwen2MoeForCausalLM"})


@dataclasses.dataclass(frozen=True)
class V2RunnerDefault:
    """One release's ``VllmConfig._is_default_v2_model_runner_model`` (``vllm/config/vllm.py``).

    A generate model whose architecture is in ``architectures`` starts on the V2 runner (only when
    dense and not checkpoint-quantized where ``listed_dense_unquantized``: ``not model_config.is_moe
    and not model_config.is_quantized``, ``is_quantized`` being a ``quantization_config`` in the
    checkpoint's config, not ``--quantization fp8``); with ``all_dense`` every dense model does too.
    Hybrid models stay on the V1 runner in every release (0.22-0.24: the listed architectures have
    none; 0.25+: ``is_hybrid`` is checked first).
    """

    since: Version
    architectures: frozenset[str]
    listed_dense_unquantized: bool
    all_dense: bool


#: Per release, from each wheel's ``vllm/config/vllm.py`` (``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES``,
#: ``use_v2_model_runner``, ``_is_default_v2_model_runner_model``); ``VLLM_USE_V2_MODEL_RUNNER`` set
#: overrides all of them. Before 0.22 no model starts on it by default (:data:`V2_RUNNER_DEFAULT`).
V2_RUNNER_DEFAULTS: tuple[V2RunnerDefault, ...] = (
    # 0.22.0: lines 69 (the set), 493-532 (use_v2_model_runner, _is_default_v2_model_runner_model)
    V2RunnerDefault((0, 22, 0), frozenset({"Qwen3ForCausalLM"}), listed_dense_unquantized=True, all_dense=False),
    # 0.23.0: lines 69-75, 519-558
    V2RunnerDefault((0, 23, 0), frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"}),
                    listed_dense_unquantized=True, all_dense=False),
    # 0.24.0: lines 68-77, 522-561: the listed MoE architectures join, and the dense / quantized check goes
    V2RunnerDefault((0, 24, 0), frozenset({"Qwen3ForCausalLM", "DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM",
                                           "GraniteMoeForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"}),
                    listed_dense_unquantized=False, all_dense=False),
    # 0.25.0: lines 68-74, 519-574: every dense model, and the listed MoE architectures
    V2RunnerDefault((0, 25, 0), frozenset({"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM"}),
                    listed_dense_unquantized=False, all_dense=True),
    # 0.26.0: lines 68-77, 550-622
    V2RunnerDefault((0, 26, 0), V2_RUNNER_MOE_ARCHITECTURES, listed_dense_unquantized=False, all_dense=True),
)


def v2_runner_default(v: Version) -> V2RunnerDefault | None:
    """The default-V2 rule of release ``v`` (:data:`V2_RUNNER_DEFAULTS`); None before 0.22.

    Example:
        >>> sorted(v2_runner_default((0, 23, 0)).architectures)
        ['LlamaForCausalLM', 'MistralForCausalLM', 'Qwen3ForCausalLM']
        >>> v2_runner_default((0, 21, 0)) is None
        True
    """
    found = None
    for rule in V2_RUNNER_DEFAULTS:
        if v >= rule.since:
            found = rule
    return found


def runs_v2_runner(rules: VllmMemoryRules, *, architecture: str, is_moe: bool, is_hybrid: bool,
                   is_quantized: bool = False) -> bool:
    """Whether vLLM starts this model on the V2 model runner by default, by that release's own rule.

    ``is_quantized``: the checkpoint carries a ``quantization_config`` (vLLM's
    ``ModelConfig.is_quantized``; online ``--quantization fp8`` is not). The real 2026-12-05 H100 starts
    of a Qwen3-30B-A3B shape (``Qwen3MoeForCausalLM``) logged ``gpu_model_runner.py`` (the V1 runner)
    and its "Estimated CUDA graph memory" line, where the Llama-3.1-8B starts of the same vLLM 0.26.0
    logged ``model_runner.py`` (the V2 runner) and none.

    Example:
        >>> r = memory_rules((0, 26, 0))
        >>> runs_v2_runner(r, architecture="Qwen3MoeForCausalLM", is_moe=True, is_hybrid=False)
        False
        >>> runs_v2_runner(r, architecture="Qwen2MoeForCausalLM", is_moe=True, is_hybrid=False)
        True
        >>> runs_v2_runner(r, architecture="LlamaForCausalLM", is_moe=False, is_hybrid=False)
        True
        >>> [runs_v2_runner(memory_rules((0, m, 0)), architecture="LlamaForCausalLM", is_moe=False, is_hybrid=False)
        ...  for m in (21, 22, 23)]
        [False, False, True]
        >>> runs_v2_runner(memory_rules((0, 23, 0)), architecture="LlamaForCausalLM", is_moe=False,
        ...                is_hybrid=False, is_quantized=True)
        False
    """
    default = v2_runner_default(rules.version)
    if not rules.v2_runner or default is None or is_hybrid:
        return False
    if architecture in default.architectures:
        return not default.listed_dense_unquantized or not (is_moe or is_quantized)
    return default.all_dense and not is_moe


#: :attr:`VllmMemoryRules.hybrid_prefix_caching`, what each family of releases does with ``enable_prefix_caching`` on a
#: Mamba hybrid (``MambaModelConfig.verify_and_update_config``, ``model_executor/models/config.py``):
#:
#: - ``"off"`` (0.10.x, 0.11.0): turned off whatever the flag ("remove once prefix caching is enabled":
#:   line 309 of 0.10.2, 296 of 0.11.0).
#: - ``"all_or_off"`` (0.11.1 to 0.14.x): a model class with ``SupportsMambaPrefixCaching`` pages its Mamba state
#:   per block (what 0.15 calls 'all'; ``mamba_block_size`` the chunk-aligned attention block, and
#:   ``MambaSpec.max_memory_usage_bytes`` ``cdiv(max_model_len, block_size) x page``: ``v1/kv_cache_interface.py``
#:   lines 261-263 of 0.11.1, 292-294 of 0.14.0); any other class: "Hybrid or mamba-based model detected without
#:   support for prefix caching: disabling." (lines 293-305 of 0.11.1, 289-306 of 0.13.0, 332-349 of 0.14.0).
#: - ``"all_or_align"`` (0.15.0 to 0.27.x): ``--mamba-cache-mode`` (``arg_utils.py`` line 945 of 0.15.0, 1204 of
#:   0.26.0); unset, "all" if the class supports Mamba prefix caching else "align" (line 335 of 0.15.0, 439 of
#:   0.19.0, 353 of 0.22.0, 561 of 0.26.0, 616 of 0.27.0); 'all' asked of a class without the support falls back
#:   to 'align'; 'align' asserts chunked prefill.
#: - ``"align"`` (0.28.x): 'align' for every class unless ``--mamba-cache-mode all`` (line 604 of 0.28.0).
#: - ``"unread"`` (0.29 on): 'align' holds ``num_prefill_checkpoint_blocks`` more blocks a request
#:   (``MambaSpec.max_memory_usage_bytes`` of 0.29.0 / 0.30.0), and 0.32 drops the 'all' sizing: not modelled.
HYBRID_PREFIX_CACHING = ("off", "all_or_off", "all_or_align", "align", "unread")
#: First release with ``--mamba-cache-mode`` (``config/cache.py`` line 127 of 0.15.0; absent from 0.14.1).
MAMBA_CACHE_MODE_FLAG: Version = (0, 15, 0)
#: ``--language-model-only`` (``EngineArgs.language_model_only``, ``MultiModalConfig.language_model_only``): in the
#: 0.17.0 wheel's ``engine/arg_utils.py``, not in 0.16.0's.
LANGUAGE_MODEL_ONLY_FLAG: Version = (0, 17, 0)


def hybrid_prefix_caching_mode(rules: VllmMemoryRules, *, supports_all: bool, requested: str | None,
                               name: str) -> str:
    """The Mamba cache mode a hybrid gets with prefix caching asked for: ``"all"``, ``"align"``, or ``"none"``
    where this release turns prefix caching off for the model. ``supports_all``: the model class implements
    ``SupportsMambaPrefixCaching`` (:func:`~servetune.planner.hybrid.supports_mamba_prefix_caching`);
    ``requested``: the ``mamba_cache_mode`` flag (``None`` / ``"none"``: unset); ``name`` the model, for messages.
    SpecError where the release's rule was not read (:data:`HYBRID_PREFIX_CACHING`).

    Example:
        >>> [hybrid_prefix_caching_mode(memory_rules(v), supports_all=True, requested=None, name="m")
        ...  for v in ((0, 11, 0), (0, 13, 0), (0, 26, 0), (0, 28, 0))]
        ['none', 'all', 'all', 'align']
        >>> hybrid_prefix_caching_mode(memory_rules((0, 26, 0)), supports_all=False, requested="all", name="m")
        'align'
    """
    family = rules.hybrid_prefix_caching
    if family == "unread":
        raise NotModelled("enable_prefix_caching", f"prefix caching on a Mamba hybrid ({name}) at vLLM "
                        f"{'.'.join(map(str, rules.version))} is not modelled by the planner (read up to 0.28: 'align' "
                        "holds prefill checkpoint blocks from 0.29)",
                        "plan it at vLLM 0.28 or older, or set enable_prefix_caching=false (from 0.28 vLLM turns it on for "
                        "hybrids unless told)")
    if family == "off":
        return "none"
    if family == "all_or_off":
        return "all" if supports_all else "none"
    if requested in (None, "none"):
        requested = "all" if family == "all_or_align" and supports_all else "align"
    return "all" if requested == "all" and supports_all else "align"


def v1_runner_rules(rules: VllmMemoryRules) -> VllmMemoryRules:
    """``rules`` for a model that version runs on the V1 model runner (see :func:`runs_v2_runner`).

    The V1 runner profiles with its own sampler (Triton top-k/top-p from 0.17), subtracts its
    CUDA-graph estimate from the KV budget (on by default from 0.20), and holds none of the V2
    runner's persistent sampler state. Every other rule is the version's.

    Example:
        >>> r = v1_runner_rules(memory_rules((0, 26, 0)))
        >>> r.v2_runner, r.subtracts_cudagraph_estimate, r.triton_topk_topp, r.default_gpu_memory_utilization
        (False, True, True, 0.92)
        >>> r.sampler_warmup_after_capture, memory_rules((0, 26, 0)).sampler_warmup_after_capture
        (True, False)
    """
    if not rules.v2_runner:
        return rules
    v = rules.version
    return dataclasses.replace(rules, v2_runner=False, triton_topk_topp=v >= TRITON_TOPK_TOPP,
                               charges_persistent_runner=False, subtracts_cudagraph_estimate=v >= (0, 20, 0),
                               sampler_warmup_after_capture=True)


@functools.lru_cache(maxsize=None)
def memory_rules(v: Version) -> VllmMemoryRules:
    """The rules of vLLM version ``v`` (a parsed version; see :func:`parse_vllm_version`)."""
    return VllmMemoryRules(
        version=v,
        default_gpu_memory_utilization=0.92 if v >= (0, 20, 0) else 0.9,
        async_scheduling_default=v >= (0, 14, 0),
        large_gpu_batch_tier=v >= (0, 29, 0),
        capture_step8_only=v < (0, 13, 0),
        blackwell_capture_cap=1024 if v >= (0, 29, 0) else 512,
        capture_adds_token_budget=v >= (0, 25, 0),
        capture_adds_max_num_seqs=v >= (0, 33, 0),
        v2_runner=v >= V2_RUNNER_DEFAULT,
        triton_topk_topp=TRITON_TOPK_TOPP <= v < V2_RUNNER_DEFAULT,
        flashinfer_sampler_default=v >= FLASHINFER_SAMPLER_DEFAULT,
        flashinfer_topk_topp=v < FLASHINFER_SAMPLER_OPT_IN,
        full_decode_graphs=v >= (0, 11, 0),
        charges_persistent_runner=v >= TOTAL_CONSUMED_ACCOUNTING,
        charges_v1_runner_buffers=v >= TOTAL_CONSUMED_ACCOUNTING,
        subtracts_cudagraph_estimate=(0, 20, 0) <= v < V2_RUNNER_DEFAULT,
        budget_rounds_up=v >= (0, 33, 0),
        null_block_first=v >= (0, 33, 0),
        kv_tokens_from_concurrency=v >= (0, 20, 1),
        gib_rounded=v >= (0, 16, 0),
        long_error_texts=v >= (0, 20, 0),
        sampler_warmup_after_capture=v < V2_RUNNER_DEFAULT,
        sliding_reserves_in_flight=v >= V2_RUNNER,
        mxfp4_keeps_loaded_scales=v < V2_RUNNER,
        chat_template_parsed_per_request=v == (0, 11, 0),
        api_server_per_dp_rank=v >= (0, 15, 0),
        machete_float_zero_points=v >= (0, 26, 0),
        prefix_stats_count_preempted=v < (0, 11, 1),
        hybrid_align_to_block_size=v >= (0, 20, 0),
        nemotron_h_ssm_default="float32" if v >= (0, 20, 0) else "float16" if v >= (0, 13, 0) else "auto",
        gdn_mixed_batch_chunked=v < (0, 23, 0),
        hybrid_prefix_caching=("off" if v < (0, 11, 1) else "all_or_off" if v < (0, 15, 0) else
                               "all_or_align" if v < (0, 28, 0) else "align" if v < (0, 29, 0) else "unread"),
        mamba_align_block_within_batch=(0, 17, 0) <= v < (0, 27, 0),
        mamba_align_block_within_long_prefill=(0, 15, 0) <= v < (0, 27, 0),
        hybrid_prefix_caching_default_on=v >= (0, 28, 0),
        moe_workspace_kept=v >= (0, 11, 0),
        qwen3_vl_formatted_video=v < (0, 13, 0),
        router_model_dtype_on_sm90_sm100=v >= (0, 17, 0),
        nemotron_h_moe_layers=v >= (0, 11, 1),
        nemotron_h_latent_moe=v >= (0, 13, 0),
        mamba_blocks_cover_max_num_seqs=v >= (0, 20, 0),
        removed_architectures=(("BambaForCausalLM", "0.23.0"),) if v >= (0, 24, 0) else (),
        allreduce_rms_fusion_default=v >= ALLREDUCE_RMS_FUSION_DEFAULT,
        allreduce_rms_fusion_single_stage=(ALLREDUCE_RMS_FUSION_DEFAULT <= v < (0, 21, 0)) or (0, 23, 0) <= v < (0, 24, 0),
        allreduce_rms_fusion_blackwell_family=v >= (0, 19, 0),
        communicators_before_snapshot=v >= (0, 11, 0),
    )
