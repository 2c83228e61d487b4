"""How a flag set resolves: every engine flag vLLM would pick by itself, for one version, model and GPU.

:func:`resolve_engine_config` turns the flags a trial sets into an :class:`EngineConfig` with
every value vLLM would pick by itself for that version, model and GPU (usage-context batch
defaults by GPU memory tier, ``gpu_memory_utilization`` 0.9 / 0.92, ``max_model_len`` from the
config, the CUDA-graph capture sizes). Combinations vLLM refuses at startup raise
:class:`~servetune.errors.SpecError` naming the flag, with vLLM's own message. Pure, no I/O.
:func:`compile_key` says which resolved configurations share a node's compile cache. What differs
between vLLM versions comes from :func:`servetune.planner.vllm_rules.memory_rules`.

Example:
    >>> from servetune.planner.gpus import get_gpu
    >>> from servetune.planner.modelinfo import load_model
    >>> cfg = resolve_engine_config({"gpu_memory_utilization": 0.5, "max_num_seqs": 64},
    ...                             load_model("servetune-test-850m"), get_gpu("H200"))
    >>> cfg.max_num_batched_tokens, cfg.cudagraph_capture_sizes[-3:]
    (8192, (112, 120, 128))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from servetune.errors import NotModelled, SpecError
from servetune.planner.flags import validate_flags
from servetune.planner import hybrid
from servetune.planner.gpus import GpuSpec
from servetune.planner.modelinfo import ModelProfile
from servetune.planner.vllm_rules import (LANGUAGE_MODEL_ONLY_FLAG, MAMBA_CACHE_MODE_FLAG, SORT_TOPK_TOPP_PROFILED, VllmMemoryRules, hybrid_prefix_caching_mode,
                                          memory_rules, parse_vllm_version, runs_v2_runner, v1_runner_rules)
from servetune.vllm_version import DEFAULT_VLLM_VERSION, Version

__all__ = ["EngineConfig", "resolve_engine_config", "batch_defaults", "capture_sizes_for", "compile_key", "MODEL_CAPTURE_MAX"]


def batch_defaults(gpu: GpuSpec, v: Version) -> tuple[int, int]:
    """``vllm serve`` usage-context defaults ``(max_num_batched_tokens, max_num_seqs)`` for the GPU.

    ``EngineArgs.get_batch_defaults``: ≥160 GiB (0.29+) 16384/1024; ≥70 GiB and not A100/GB10
    8192/1024; otherwise 2048/256.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> batch_defaults(get_gpu("H200"), (0, 26, 0)), batch_defaults(get_gpu("A100-80GB"), (0, 26, 0))
        ((8192, 1024), (2048, 256))
    """
    name = gpu.name.lower()
    if memory_rules(v).large_gpu_batch_tier and gpu.memory_gib >= 160:
        return 16384, 1024
    if gpu.memory_gib >= 70 and "a100" not in name and "gb10" not in name:
        return 8192, 1024
    return 2048, 256


# ============================================================================ EngineConfig
@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine flag resolved the way vLLM resolves it for one version, model and GPU.

    ``dtype`` and ``quantization`` (after ``vllm_version``) are servetune additions: the
    ``--dtype`` / ``--quantization`` flags, ``"auto"`` / ``None`` when not set.
    """

    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    num_gpu_blocks_override: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    enforce_eager: bool
    cudagraph_capture_sizes: tuple[int, ...]  # ascending; () under enforce_eager
    kv_cache_dtype: str
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    block_size: int
    long_prefill_token_threshold: int
    scheduling_policy: str
    async_scheduling: bool
    vllm_version: str
    dtype: str = "auto"
    quantization: str | None = None
    #: The model runs on vLLM's V1 model runner although this version's default is the V2 runner
    #: (:func:`~servetune.planner.vllm_rules.runs_v2_runner`: per release from 0.22, e.g. every model but
    #: dense Qwen3 on 0.22, most MoE and hybrid models on 0.25+).
    v1_runner: bool = False
    #: FlashInfer imports in the vLLM install, as the caller knows it: True or False where it is stated (a published
    #: start's own sampler line, a publisher's image, servetune's probe of a GPU worker: ``plan_memory`` takes a probed
    #: :class:`~servetune.planner.comm.CommEnv`'s answer), None where it is not. It moves the profile run's sampler of
    #: 0.10.0-0.11.0 (:attr:`~servetune.planner.vllm_rules.VllmMemoryRules.flashinfer_topk_topp`: FlashInfer's
    #: top-k/top-p wherever it imports; opt-in from 0.11.1) and vLLM's FlashInfer all-reduce fusion (0.17+, where
    #: anything but False lets it run). None plans 0.10.x with FlashInfer (vLLM's images ship it) and 0.11.0 with the
    #: sort (:data:`~servetune.planner.vllm_rules.SORT_TOPK_TOPP_PROFILED`: every 0.11.0 start in the collections
    #: profiles so). From 0.21 vLLM needs it to start at all, unless ``VLLM_USE_FLASHINFER_SAMPLER=0``
    #: (:attr:`~servetune.planner.vllm_rules.VllmMemoryRules.flashinfer_sampler_default`); the planner
    #: does not foresee that failure.
    flashinfer_available: bool | None = None
    #: A Mamba hybrid's Mamba cache mode: ``"none"`` without prefix caching (and for every other model), ``"align"`` or
    #: ``"all"`` with it (:func:`~servetune.planner.vllm_rules.hybrid_prefix_caching_mode`).
    mamba_cache_mode: str = "none"
    #: ``--disable-custom-all-reduce``: every TP all-reduce goes to NCCL (and, where it is on, torch's symmetric
    #: memory), never vLLM's custom all-reduce kernel (``ParallelConfig.disable_custom_all_reduce``, 0.10-0.26;
    #: :func:`~servetune.planner.comm.custom_all_reduce_runs` says where it would run otherwise).
    disable_custom_all_reduce: bool = False
    #: ``--language-model-only`` (vLLM 0.17+): a multimodal checkpoint served without its vision tower, which is then
    #: neither loaded nor run in the profile (:func:`~servetune.planner.model_memory.effective_model`).
    language_model_only: bool = False
    #: A Mamba hybrid's Mamba-group block in tokens (:func:`~servetune.planner.hybrid.mamba_group_block_size`;
    #: ``max_model_len`` without prefix caching); 0 for other models.
    mamba_block_size: int = 0
    #: Replicas of this engine behind one API server (``--data-parallel-size``), without expert parallelism.
    #: Every figure of the config is one replica's (its ``world_size`` GPUs); a dense model's replicas are
    #: independent engines (``vllm/v1/engine/core.py:1071-1079@0.11.0``, ``:1288-1296@0.26.0``: "Non-MoE DP ranks
    #: are completely independent, so treat like DP=1"), a MoE model's share their routed experts, split over
    #: ``tp x dp`` GPUs, and each MoE layer runs every replica's tokens (:meth:`expert_data_parallel`).
    data_parallel_size: int = 1
    #: ``--api-server-count``: API server processes in front of the replicas; None leaves vLLM's default (one
    #: through 0.14.1, one per DP replica from 0.15.0: ``VllmMemoryRules.api_server_per_dp_rank``).
    api_server_count: int | None = None
    #: ``--enable-expert-parallel``: a MoE model's routed experts split whole over ``tp x dp`` ranks
    #: (:meth:`expert_parallel_size`) instead of each expert sliced over them; refused for a dense model, as vLLM
    #: refuses it (:func:`resolve_engine_config`).
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        """One replica's GPUs: ``tensor_parallel_size x pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def num_gpus(self) -> int:
        """Every GPU the server takes: ``world_size x data_parallel_size``."""
        return self.world_size * self.data_parallel_size

    def expert_data_parallel(self, is_moe: bool) -> int:
        """The replicas a MoE layer spans: ``data_parallel_size`` for a MoE model, 1 for a dense one.

        Without ``--enable-expert-parallel`` ``FusedMoEParallelConfig.make`` flattens TP across DP: the routed
        experts are split over ``tp x dp`` ranks (``model_executor/layers/fused_moe/config.py:882-998@0.14.1``;
        ``flatten_tp_across_dp_and_pcp`` at ``:1113-1215@0.26.0``, the same rule with a context-parallel size of 1),
        and the layer all-gathers every replica's tokens before its experts ("Falling back to
        AllGather+ReduceScatter dispatch/combine", ``fused_moe/all2all_utils.py:144-155@0.26.0``).

        Example:
            >>> from servetune.planner.gpus import get_gpu
            >>> from servetune.planner.modelinfo import load_model
            >>> m = load_model("qwen3-30b-a3b")
            >>> c = resolve_engine_config({"data_parallel_size": 2}, m, get_gpu("H100-80GB"))
            >>> c.world_size, c.num_gpus, c.expert_data_parallel(True), c.expert_data_parallel(False)
            (1, 2, 2, 1)
        """
        return max(1, self.data_parallel_size) if is_moe else 1

    def expert_parallel_size(self, is_moe: bool) -> int:
        """The ranks a MoE layer's experts are split over whole (vLLM's ``ep_size``): ``tp x dp`` under
        ``--enable-expert-parallel``, 1 without it, for a dense model, or where ``tp x dp`` is 1.

        ``FusedMoEParallelConfig.make``: ``use_ep = dp x tp > 1 and enable_expert_parallel``, then ``ep_size`` is the
        flattened ``tp x dp`` and the layer's own ``tp_size`` 1 ("In EP, each device owns a set of experts fully";
        ``model_executor/layers/fused_moe/config.py:703-731@0.11.0``, ``:1204-1250@0.26.0``).

        Example:
            >>> from servetune.planner.gpus import get_gpu
            >>> from servetune.planner.modelinfo import load_model
            >>> m = load_model("qwen3-30b-a3b")
            >>> c = resolve_engine_config({"tensor_parallel_size": 2, "data_parallel_size": 2,
            ...                            "enable_expert_parallel": True}, m, get_gpu("H100-80GB"))
            >>> c.expert_parallel_size(True), c.expert_tensor_parallel_size(True), c.expert_tensor_parallel_size(False)
            (4, 1, 2)
        """
        if not (self.enable_expert_parallel and is_moe):
            return 1
        return self.tensor_parallel_size * self.expert_data_parallel(is_moe)

    def expert_tensor_parallel_size(self, is_moe: bool) -> int:
        """The ranks each routed expert's intermediate width is sliced over: 1 under expert parallelism, else
        ``tp x dp`` for a MoE model (:meth:`expert_data_parallel`) and ``tp`` for a dense one."""
        if self.expert_parallel_size(is_moe) > 1:
            return 1
        return self.tensor_parallel_size * self.expert_data_parallel(is_moe)

    @property
    def version(self) -> Version:
        return parse_vllm_version(self.vllm_version)

    @property
    def rules(self) -> VllmMemoryRules:
        """What this config's vLLM version does at startup (:func:`~servetune.planner.vllm_rules.memory_rules`),
        on the model runner this model gets (:func:`~servetune.planner.vllm_rules.v1_runner_rules`)."""
        rules = memory_rules(self.version)
        imports = self.flashinfer_available
        if imports is None:  # not stated: the collections' evidence per version (SORT_TOPK_TOPP_PROFILED)
            imports = self.version < SORT_TOPK_TOPP_PROFILED
        if not imports and rules.flashinfer_topk_topp:
            rules = dataclasses.replace(rules, flashinfer_topk_topp=False)
        return v1_runner_rules(rules) if self.v1_runner else rules

    @property
    def max_in_flight_tokens(self) -> int:
        """Tokens scheduled but not yet settled, which a sliding-window KV group reserves room for
        (:attr:`~servetune.planner.vllm_rules.VllmMemoryRules.sliding_reserves_in_flight`; before
        0.26 one batch's ``max_num_batched_tokens``).

        Example:
            >>> import dataclasses
            >>> from servetune.planner import get_gpu, load_model, resolve_engine_config
            >>> c = resolve_engine_config({"max_num_batched_tokens": 8192}, load_model("gemma-2-27b"),
            ...                           get_gpu("H100-80GB"), "0.26.0")
            >>> c.async_scheduling, c.max_in_flight_tokens, dataclasses.replace(c, vllm_version="0.19.0").max_in_flight_tokens
            (True, 16384, 8192)
        """
        rules, pp = self.rules, self.pipeline_parallel_size
        if not rules.sliding_reserves_in_flight:
            return self.max_num_batched_tokens
        if not self.async_scheduling:
            batches = pp
        elif rules.v2_runner:
            batches = pp + 1
        else:
            batches = 2 if pp <= 1 else pp
        return batches * self.max_num_batched_tokens

    @property
    def max_cudagraph_capture_size(self) -> int:
        return self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0

    @property
    def full_cudagraph_sizes(self) -> tuple[int, ...]:
        """Sizes that also get a FULL decode graph (FULL_AND_PIECEWISE: 1 <= size <= max_num_seqs; none
        before 0.11.0, whose default is PIECEWISE: ``VllmMemoryRules.full_decode_graphs``)."""
        if not memory_rules(self.version).full_decode_graphs:
            return ()
        return tuple(s for s in self.cudagraph_capture_sizes if s <= self.max_num_seqs)

    @property
    def num_cudagraphs(self) -> int:
        """PIECEWISE graphs (one per size) plus FULL decode graphs: the log's "19 + 11"."""
        return len(self.cudagraph_capture_sizes) + len(self.full_cudagraph_sizes)

    def as_flags(self) -> dict[str, Any]:
        """vLLM flag names -> values, what ``vllm serve`` would be given to start exactly this engine.

        Example:
            >>> from servetune.planner.gpus import get_gpu
            >>> from servetune.planner.modelinfo import load_model
            >>> c = resolve_engine_config({"enforce_eager": True}, load_model("llama-3.1-8b"), get_gpu("L40S"))
            >>> c.as_flags()["max_num_batched_tokens"], "cudagraph_capture_sizes" in c.as_flags()
            (2048, False)
        """
        out: dict[str, Any] = {
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "enforce_eager": self.enforce_eager,
            "kv_cache_dtype": self.kv_cache_dtype,
            "enable_prefix_caching": self.enable_prefix_caching,
            "enable_chunked_prefill": self.enable_chunked_prefill,
            "block_size": self.block_size,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "scheduling_policy": self.scheduling_policy,
            "async_scheduling": self.async_scheduling,
        }
        if self.kv_cache_memory_bytes is not None:
            out["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.num_gpu_blocks_override is not None:
            out["num_gpu_blocks_override"] = self.num_gpu_blocks_override
        if not self.enforce_eager:
            out["cudagraph_capture_sizes"] = list(self.cudagraph_capture_sizes)
        if self.dtype != "auto":
            out["dtype"] = self.dtype
        if self.quantization is not None:
            out["quantization"] = self.quantization
        if self.disable_custom_all_reduce:
            out["disable_custom_all_reduce"] = True  # vLLM's default (False) is not written out
        if self.data_parallel_size > 1:
            out["data_parallel_size"] = self.data_parallel_size
        if self.api_server_count is not None:
            out["api_server_count"] = self.api_server_count
        if self.enable_expert_parallel:
            out["enable_expert_parallel"] = True  # vLLM's default (False) is not written out
        if self.mamba_cache_mode != "none" and self.version >= MAMBA_CACHE_MODE_FLAG:
            out["mamba_cache_mode"] = self.mamba_cache_mode  # vLLM's own default for the model, written out
        if self.language_model_only:
            out["language_model_only"] = True  # vLLM's default (False) is not written out
        return out


#: A model's own largest CUDA-graph capture size, set where the user gave neither capture sizes nor
#: a largest size: vLLM's ``GptOssForCausalLMConfig.verify_and_update_config``
#: (``model_executor/models/config.py``, in the 0.10-era source and in 0.26's: "Increase the max capture size from
#: 512 to 1024 for performance"; the published vLLM 0.19.0 gpt-oss-20b starts on an H100 log
#: "Overriding max cuda graph capture size to 1024 for performance" and capture 83 sizes).
MODEL_CAPTURE_MAX: dict[str, int] = {"GptOssForCausalLM": 1024}


def capture_sizes_for(v: Version, *, max_num_seqs: int, max_num_batched_tokens: int,
                      user_sizes: list[int] | None = None, user_max: int | None = None,
                      blackwell: bool = False, model_max: int | None = None) -> tuple[int, ...]:
    """vLLM's CUDA-graph capture sizes (``config/vllm.py: _set_cudagraph_sizes``), ascending.

    0.11: ``[1, 2, 4] + range(8, N+1, 8)`` with ``N = min(2*max_num_seqs, 512)``. ≥0.13: step 8 to
    248, then step 16 from 256, capped at ``min(max_num_batched_tokens, max_cg)``; ≥0.25 appends
    ``max_num_batched_tokens`` when ≤ the cap; ≥0.33 appends ``max_num_seqs`` likewise. User lists
    are kept as given, filtered to ``≤ max_num_batched_tokens``. ``model_max``: a model's own
    largest size where the user set none (:data:`MODEL_CAPTURE_MAX`); before 0.13 it comes as
    vLLM 0.10-0.11's list for it, step 8 to 248 then step 16 to ``model_max``.

    Example:
        >>> s = capture_sizes_for((0, 26, 0), max_num_seqs=64, max_num_batched_tokens=8192)
        >>> len(s), s[:5], s[-1]
        (19, (1, 2, 4, 8, 16), 128)
    """
    if user_sizes:
        sizes = sorted({s for s in user_sizes if s <= max_num_batched_tokens})
        if not sizes:
            raise SpecError("cudagraph_capture_sizes",
                            f"every size exceeds max_num_batched_tokens ({max_num_batched_tokens})",
                            "use capture sizes <= max_num_batched_tokens")
        if user_max is not None and user_max != sizes[-1]:
            raise SpecError("max_cudagraph_capture_size",
                            f"customized max_cudagraph_capture_size(={user_max}) should be consistent with "
                            f"the max value of cudagraph_capture_sizes(={sizes[-1]})",
                            "set only one of the two, or make them agree")
        return tuple(sizes)
    rules = memory_rules(v)
    if model_max is not None and user_max is None:
        if rules.capture_step8_only:  # the model's list replaces the default one (vLLM 0.10.2-0.11.0)
            sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, model_max + 1, 16))
            return tuple(s for s in sizes if s <= max_num_batched_tokens)
        user_max = model_max
    if rules.capture_step8_only:  # --cuda-graph-sizes: one value N -> step 8 all the way
        n = user_max if user_max is not None else min(max_num_seqs * 2, 512)
        sizes = [s for s in (1, 2, 4) if s <= n] + list(range(8, n + 1, 8))
        return tuple(s for s in sizes if s <= max_num_batched_tokens)
    cap = rules.blackwell_capture_cap if blackwell else 512
    max_cg = user_max if user_max is not None else min(max_num_seqs * 2, cap)  # decode_query_len = 1
    max_cg = min(max_num_batched_tokens, max_cg)
    sizes = [s for s in (1, 2, 4) if s <= max_cg]
    sizes += list(range(8, min(max_cg + 1, 256), 8)) + list(range(256, max_cg + 1, 16))
    if rules.capture_adds_token_budget and max_num_batched_tokens <= max_cg and max_num_batched_tokens not in sizes:
        sizes.append(max_num_batched_tokens)
    if rules.capture_adds_max_num_seqs and max_num_seqs <= max_cg and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return tuple(sorted(sizes))


def _check_parallel(model: ModelProfile, tp: int, pp: int) -> None:
    if model.num_attention_heads % tp:
        raise SpecError("tensor_parallel_size",
                        f"Total number of attention heads ({model.num_attention_heads}) must be divisible by "
                        f"tensor parallel size ({tp}).",
                        f"use a tensor_parallel_size that divides {model.num_attention_heads}")
    kv = model.num_kv_heads
    if kv >= tp and kv % tp:
        raise SpecError("tensor_parallel_size", f"{kv} is not divisible by {tp} (KV heads vs tensor parallel size)",
                        f"use a tensor_parallel_size that divides the {kv} KV heads")
    if kv < tp and tp % kv:
        raise SpecError("tensor_parallel_size", f"{tp} is not divisible by {kv} (tensor parallel size vs KV heads)",
                        f"use a multiple of the {kv} KV heads")
    if pp > model.num_layers:
        raise SpecError("pipeline_parallel_size",
                        f"{pp} pipeline stages for {model.num_layers} layers leaves a stage without layers",
                        f"use pipeline_parallel_size <= {model.num_layers}")
    if model.is_hybrid:
        _check_mamba_parallel(model, tp)


def _check_mamba_parallel(model: ModelProfile, tp: int) -> None:
    """``MambaMixer2``'s asserts (``layers/mamba/mamba_mixer2.py`` lines 285-292 of 0.26.0): TP divides the Mamba
    heads, and the groups unless there is one; the gated delta net divides its heads and groups by TP outright."""
    if model.mamba_heads % tp:
        raise SpecError("tensor_parallel_size", "Tensor parallel world size must divide num heads. "
                        f"({model.mamba_heads} Mamba heads, tensor_parallel_size {tp})",
                        f"use a tensor_parallel_size that divides {model.mamba_heads}")
    if model.mamba_groups % tp and (model.mamba_groups != 1 or model.mamba_kind == "gdn"):
        raise SpecError("tensor_parallel_size", "If tensor parallel world size does not divide num_groups, then "
                        f"num_groups must equal 1. ({model.mamba_groups} groups, tensor_parallel_size {tp})",
                        f"use a tensor_parallel_size that divides {model.mamba_groups}")


def resolve_engine_config(flags: Mapping[str, Any], model: ModelProfile, gpu: GpuSpec,
                          vllm_version: str = DEFAULT_VLLM_VERSION) -> EngineConfig:
    """Resolve every engine flag as ``vllm serve`` would; SpecError (naming the flag) on what vLLM refuses.

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> c = resolve_engine_config({}, load_model("llama-3.1-8b"), get_gpu("H100-80GB"))
        >>> c.gpu_memory_utilization, c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len
        (0.92, 1024, 8192, 131072)
        >>> resolve_engine_config({"tensor_parallel_size": 3}, load_model("llama-3.1-8b"), get_gpu("H100-80GB"))
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: tensor_parallel_size: Total number of attention heads (32) must be divisible by tensor parallel size (3). (fix: use a tensor_parallel_size that divides 32)
    """
    v = parse_vllm_version(vllm_version)
    rules = memory_rules(v)
    # None means "not set" (vLLM's own default), as in a flag set with optional entries.
    f = validate_flags({k: val for k, val in flags.items() if val is not None})
    _check_served(model, rules)
    tp = int(f.get("tensor_parallel_size", 1))
    pp = int(f.get("pipeline_parallel_size", 1))
    _check_parallel(model, tp, pp)

    limit = model.max_model_len_limit
    max_model_len = int(f.get("max_model_len") or limit)
    if max_model_len > limit:
        raise SpecError("max_model_len",
                        f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
                        f"(max_position_embeddings={limit} in model's config.json). To allow overriding this "
                        "maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.",
                        f"use max_model_len <= {limit}")

    chunked = bool(f.get("enable_chunked_prefill", True))
    default_tokens, default_seqs = batch_defaults(gpu, v)
    user_tokens = f.get("max_num_batched_tokens")
    user_seqs = f.get("max_num_seqs")
    if user_tokens is not None:
        max_num_batched_tokens = int(user_tokens)
    else:
        max_num_batched_tokens = default_tokens if chunked else max(max_model_len, default_tokens)
        # vLLM caps the *default* at what max_num_seqs sequences of max_model_len could use.
        max_num_batched_tokens = min(max_num_batched_tokens, int(user_seqs or default_seqs) * max_model_len)
    max_num_seqs = int(user_seqs) if user_seqs is not None else min(default_seqs, max_num_batched_tokens)
    if max_num_batched_tokens < max_num_seqs:
        raise SpecError("max_num_batched_tokens",
                        f"max_num_batched_tokens ({max_num_batched_tokens}) must be greater than or equal to "
                        f"max_num_seqs ({max_num_seqs}).",
                        f"raise max_num_batched_tokens to >= {max_num_seqs} or lower max_num_seqs")
    if not chunked and max_num_batched_tokens < max_model_len:
        raise SpecError("max_num_batched_tokens",
                        f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than max_model_len "
                        f"({max_model_len}). This effectively limits the maximum sequence length to "
                        "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
                        "max_num_batched_tokens or decrease max_model_len.",
                        "enable chunked prefill, or set max_num_batched_tokens >= max_model_len")

    enforce_eager = bool(f.get("enforce_eager", False))
    sizes: tuple[int, ...] = () if enforce_eager else capture_sizes_for(
        v, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        user_sizes=f.get("cudagraph_capture_sizes"), user_max=f.get("max_cudagraph_capture_size"),
        blackwell=10.0 <= gpu.compute_capability < 11.0, model_max=MODEL_CAPTURE_MAX.get(model.architecture))

    dtype, quantization = _weight_format(f, model)
    prefix_caching, mamba_mode, block_size, mamba_block = _paging(f, model, tp, rules, chunked, max_model_len,
                                                                  max_num_batched_tokens)
    return EngineConfig(
        gpu_memory_utilization=float(f.get("gpu_memory_utilization", rules.default_gpu_memory_utilization)),
        kv_cache_memory_bytes=f.get("kv_cache_memory_bytes"),
        num_gpu_blocks_override=f.get("num_gpu_blocks_override"),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        enforce_eager=enforce_eager,
        cudagraph_capture_sizes=sizes,
        kv_cache_dtype=str(f.get("kv_cache_dtype", "auto")),
        enable_prefix_caching=prefix_caching,
        enable_chunked_prefill=chunked,
        block_size=block_size,
        long_prefill_token_threshold=int(f.get("long_prefill_token_threshold", 0)),
        scheduling_policy=str(f.get("scheduling_policy", "fcfs")),
        # Async scheduling is on by default from 0.14 where supported; vLLM turns it off with PP.
        async_scheduling=bool(f.get("async_scheduling", rules.async_scheduling_default and pp == 1)),
        vllm_version=".".join(map(str, v)),
        dtype=dtype,
        quantization=quantization,
        v1_runner=rules.v2_runner and not runs_v2_runner(rules, architecture=model.architecture,
                                                         is_moe=model.is_moe, is_hybrid=model.is_hybrid,
                                                         is_quantized=model.quantization is not None),
        mamba_cache_mode=mamba_mode,
        mamba_block_size=mamba_block,
        disable_custom_all_reduce=bool(f.get("disable_custom_all_reduce", False)),
        data_parallel_size=int(f.get("data_parallel_size", 1)),
        api_server_count=int(f["api_server_count"]) if f.get("api_server_count") is not None else None,
        enable_expert_parallel=_expert_parallel(f, model), language_model_only=_language_model_only(f, v),
    )


def _language_model_only(flags: Mapping[str, Any], version: Version) -> bool:
    """``--language-model-only`` as given; SpecError below vLLM 0.17.0, which has no such flag
    (:data:`~servetune.planner.vllm_rules.LANGUAGE_MODEL_ONLY_FLAG`)."""
    wanted = bool(flags.get("language_model_only", False))
    if wanted:
        _refuse_before(LANGUAGE_MODEL_ONLY_FLAG, "language_model_only", version)
    return wanted


def _refuse_before(since: Version, name: str, version: Version) -> None:
    """SpecError naming ``name`` where vLLM ``version`` predates ``since``, the release whose ``vllm serve`` first
    takes the flag: vLLM's own argparse line, the release it came in, and to leave it out.

    Example:
        >>> _refuse_before((0, 15, 0), "mamba_cache_mode", (0, 14, 1))
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: mamba_cache_mode: unrecognized arguments: --mamba-cache-mode (vLLM 0.14.1 has no such flag; it came in 0.15.0) (fix: leave mamba_cache_mode out below vLLM 0.15)
    """
    if version < since:
        raise SpecError(name, f"unrecognized arguments: --{name.replace('_', '-')} (vLLM "
                        f"{'.'.join(map(str, version))} has no such flag; it came in {'.'.join(map(str, since))})",
                        f"leave {name} out below vLLM {since[0]}.{since[1]}")


def _expert_parallel(flags: Mapping[str, Any], model: ModelProfile) -> bool:
    """``enable_expert_parallel`` as vLLM takes it: refused for a model without routed experts, with vLLM's own
    text (``ModelConfig._verify_with_expert_parallelism``, ``config/model.py:1001-1016@0.11.0``, called at
    ``:1054-1055``; ``:1177-1182@0.26.0``, called at ``:1237-1238``: ``ValueError`` at startup).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> resolve_engine_config({"enable_expert_parallel": True}, load_model("llama-3.1-8b"), get_gpu("H100-80GB"))
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: enable_expert_parallel: Number of experts in the model must be greater than 0 when expert parallelism is enabled. (fix: leave enable_expert_parallel out for llama-3.1-8b, which has no routed experts)
    """
    on = bool(flags.get("enable_expert_parallel", False))
    if on and not model.is_moe:
        raise SpecError("enable_expert_parallel", "Number of experts in the model must be greater than 0 when expert "
                        "parallelism is enabled.", f"leave enable_expert_parallel out for {model.name}, which has no "
                        "routed experts")
    return on


def _weight_format(flags: Mapping[str, Any], model: ModelProfile) -> tuple[str, str | None]:
    """``(dtype, quantization)`` as the flags ask them (``half`` read as ``float16``); SpecError where a
    quantization other than online fp8 is asked of a checkpoint with plain weights."""
    quantization = flags.get("quantization")
    if quantization is not None and model.quantization is None and quantization != "fp8":
        raise SpecError("quantization", f"{quantization} needs a checkpoint quantized with {quantization}; "
                        f"{model.name} has plain {model.dtype} weights",
                        "use quantization=fp8 (online) or a pre-quantized checkpoint")
    dtype = str(flags.get("dtype", "auto"))
    return ("float16" if dtype == "half" else dtype), quantization


def _check_served(model: ModelProfile, rules: VllmMemoryRules) -> None:
    """SpecError, with vLLM's own text, where this release no longer serves the model's architecture."""
    last = dict(rules.removed_architectures).get(model.architecture)
    if last is not None:
        raise SpecError("vllm_version", f"Model architecture {model.architecture} was supported in vLLM until "
                        f"v{last}, and is not supported anymore.", f"plan it at vLLM {last} or older")
    if "moe" in model.layer_types:  # Nemotron-H's E layers (VllmMemoryRules.nemotron_h_moe_layers)
        latent = bool(model.moe_latent_size)
        if not (rules.nemotron_h_latent_moe if latent else rules.nemotron_h_moe_layers):
            what, first = ("latent MoE layers (moe_latent_size)", "0.13.0") if latent else ("MoE ('E') layers", "0.11.1")
            raise SpecError("vllm_version", f"vLLM {'.'.join(str(p) for p in rules.version)} does not build Nemotron-H "
                            f"{what}; {first} is the first release that does", f"plan it at vLLM {first} or newer")


def _paging(flags: Mapping[str, Any], model: ModelProfile, tp: int, rules: VllmMemoryRules, chunked: bool,
            max_model_len: int, max_num_batched_tokens: int) -> tuple[bool, str, int, int]:
    """``(enable_prefix_caching, mamba_cache_mode, block_size, mamba_block_size)``: :func:`_prefix_caching`, then
    :func:`_block_sizes` in that mode, checked against 'align' mode's asserts (:func:`_check_align_mode`)."""
    prefix_caching, mode = _prefix_caching(flags, model, rules, chunked)
    block_size, mamba_block = _block_sizes(flags, model, tp, rules, mode, max_model_len)
    _check_align_mode(mode, block_size, rules, max_num_batched_tokens,
                      int(flags.get("long_prefill_token_threshold", 0)))
    return prefix_caching, mode, block_size, mamba_block


def _block_sizes(flags: Mapping[str, Any], model: ModelProfile, tp: int, rules: VllmMemoryRules, mamba_mode: str,
                 max_model_len: int) -> tuple[int, int]:
    """``(block_size, mamba_block_size)`` as vLLM sets them: the flag (16 unset), raised for a Mamba hybrid
    (:func:`~servetune.planner.hybrid.hybrid_block_size`) until an attention page holds one Mamba state, aligned
    to the Mamba2 chunk in 'all' mode; the Mamba groups' block
    (:func:`~servetune.planner.hybrid.mamba_group_block_size`), 0 for a model without Mamba layers."""
    block_size = int(flags.get("block_size", 16))
    if not model.is_hybrid:
        return block_size, 0
    kv = model.kv_dtype_bytes(str(flags.get("kv_cache_dtype", "auto")))
    ssm = hybrid.mamba_ssm_dtype_bytes(model, rules.nemotron_h_ssm_default)
    chunk = model.mamba_chunk_size if mamba_mode == "all" else 0
    align = rules.hybrid_align_to_block_size
    return (hybrid.hybrid_block_size(model, tp, block_size, kv, ssm, align, chunk),
            hybrid.mamba_group_block_size(model, tp, block_size, kv, ssm, align, mamba_mode, chunk, max_model_len))


def _prefix_caching(flags: Mapping[str, Any], model: ModelProfile, rules: VllmMemoryRules,
                    chunked: bool) -> tuple[bool, str]:
    """``(enable_prefix_caching, mamba_cache_mode)`` as vLLM resolves them; SpecError where vLLM refuses the pair or
    the planner does not model it.

    A plain model: the flag, on by default. A Mamba hybrid: off by default up to 0.27 (``is_prefix_caching_supported``
    is false for ``attn_type == "hybrid"``: ``config/model.py`` line 1785 of 0.19.0; ``arg_utils.py`` line 2521 of
    0.26.0, "keep it opt-in"), on by default from 0.28
    (:attr:`~servetune.planner.vllm_rules.VllmMemoryRules.hybrid_prefix_caching_default_on`); on, the release's Mamba cache mode
    (:func:`~servetune.planner.vllm_rules.hybrid_prefix_caching_mode`; ``"none"``: vLLM turns it off). 'all' mode
    needs the model's Mamba2 chunk (refused where the config names none and the class default was not read);
    'align' asserts chunked prefill (``models/config.py`` lines 353-356 of 0.15.0, 579-581 of 0.26.0).
    ``mamba_cache_mode`` is a flag from 0.15.0 (:data:`~servetune.planner.vllm_rules.MAMBA_CACHE_MODE_FLAG`).
    """
    flag = flags.get("enable_prefix_caching")
    requested = flags.get("mamba_cache_mode")
    if requested is not None:
        _refuse_before(MAMBA_CACHE_MODE_FLAG, "mamba_cache_mode", rules.version)
    if not model.is_hybrid:
        return bool(True if flag is None else flag), "none"
    if flag is None and rules.hybrid_prefix_caching_default_on:  # 0.28+: on unless turned off
        flag = True
    if not flag:
        return False, "none"
    mode = hybrid_prefix_caching_mode(rules, supports_all=hybrid.supports_mamba_prefix_caching(model),
                                      requested=requested, name=model.name)
    if mode == "all" and not model.mamba_chunk_size:
        raise NotModelled("enable_prefix_caching", f"prefix caching's 'all' Mamba cache mode aligns {model.name}'s "
                        "blocks to its Mamba2 chunk, which its config does not name (mamba_chunk_size / chunk_size) "
                        "and whose class default the planner has not read",
                        "add chunk_size to the model config, or plan mamba_cache_mode=align (vLLM 0.15+)")
    if mode == "align" and not chunked:
        raise SpecError("enable_chunked_prefill", "AssertionError: Chunked prefill is required for mamba cache "
                        "mode 'align'.", "leave enable_chunked_prefill on, or prefix caching off")
    return mode != "none", mode


def _check_align_mode(mode: str, block_size: int, rules: VllmMemoryRules, max_num_batched_tokens: int,
                      long_prefill_token_threshold: int) -> None:
    """'align' mode's asserts on the batch (``VllmConfig``, ``config/vllm.py``; see
    :attr:`~servetune.planner.vllm_rules.VllmMemoryRules.mamba_align_block_within_batch` and
    :attr:`~servetune.planner.vllm_rules.VllmMemoryRules.mamba_align_block_within_long_prefill`)."""
    if mode != "align":
        return
    if rules.mamba_align_block_within_batch and block_size > max_num_batched_tokens:
        raise SpecError("max_num_batched_tokens", f"AssertionError: In Mamba cache align mode, block_size "
                        f"({block_size}) must be <= max_num_batched_tokens ({max_num_batched_tokens}).",
                        f"raise max_num_batched_tokens to >= {block_size}")
    if rules.mamba_align_block_within_long_prefill and 0 < long_prefill_token_threshold < block_size:
        raise SpecError("long_prefill_token_threshold", "AssertionError: in Mamba cache align mode "
                        f"long_prefill_token_threshold ({long_prefill_token_threshold}) must be >= block_size "
                        f"({block_size})", f"set long_prefill_token_threshold to 0 or >= {block_size}")


#: Resolved fields that size the memory budget but not the compiled graphs: vLLM's compile cache
#: key ignores them (real H200 starts: gpu_memory_utilization 0.02 after 0.03, same max_num_seqs,
#: hit the cache). ``max_num_seqs`` enters the key only through the CUDA-graph capture sizes it
#: sets (which ``cudagraph_capture_sizes`` carries).
_NOT_IN_COMPILE_KEY = frozenset({"gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override",
                                 "max_num_seqs"})


def compile_key(config: EngineConfig) -> tuple[tuple[str, Any], ...]:
    """The part of a resolved configuration that decides whether vLLM can reuse compiled graphs on a node.

    Two configurations with the same key share the node's compile cache: the second start loads
    the graphs ("Directly load AOT compiled function"; faster, and the smaller warm activation
    peak, see :func:`activation_peak_bytes`). The batch shape is in the key as vLLM compiles it:
    the compile range ``(1, max_num_batched_tokens)`` and the CUDA-graph capture sizes, which
    ``max_num_seqs`` sets up to vLLM's cap (``min(2 x max_num_seqs, 512)`` on 0.26), not
    ``max_num_seqs`` itself. Evidence, real H200 starts on vLLM 0.26.0:

    * tests/fixtures/real_h200/study_l8b: every start whose capture sizes or token budget no
      earlier start on the host had compiled recompiled (23-27 s) and profiled the cold peak
      (1.10 GiB at 256 x 8192 after 128 x 8192; 1.01 at 128 x 2048 after 256 x 2048), and every
      start of a configuration compiled before loaded it and profiled the warm peak (0.88 / 0.24
      GiB);
    * tests/fixtures/real_h200/study_l8b_tune: max_num_seqs 512 after 256 (capture sizes up to
      512 both) loaded the first start's graphs, same cache hash, warm peak 0.88 GiB.

    A start that failed after compiling counts as compiled (the 2 x H200 grid's 0.05 x 128 after
    the failed 0.012 x 128 profiled warm).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("llama-3.1-8b"), get_gpu("H200")
        >>> key = lambda **f: compile_key(resolve_engine_config(f, m, g))
        >>> key(max_num_seqs=256) == key(max_num_seqs=512, gpu_memory_utilization=0.5)  # both capture up to 512
        True
        >>> key(max_num_seqs=128) == key(max_num_seqs=256)  # up to 256 against up to 512
        False
    """
    return tuple((f.name, getattr(config, f.name)) for f in dataclasses.fields(config)
                 if f.name not in _NOT_IN_COMPILE_KEY)
