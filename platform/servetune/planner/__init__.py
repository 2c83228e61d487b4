"""The planner: what a flag set means for one model on one GPU type, before anything runs.

Pure logic over tables: the vLLM flags servetune sets (:mod:`.flags`), the GPU table
(:mod:`.gpus`), a model's profile from its ``config.json`` (:mod:`.modelinfo`), vLLM's defaults
(:mod:`.engine_config`) and startup memory accounting (:mod:`.memory`, summing what a model class takes in the profile run,
:mod:`.model_memory`, under one rules object per vLLM version, :mod:`.vllm_rules`), the
preemption prior (:mod:`.prior`), whether vLLM ships a tuned fused-MoE kernel for a model's experts
(:mod:`.moe_kernels`), and
the one entry point that resolves names into all three (:func:`resolve_target`). It imports
nothing of the rest of servetune but the vocabulary modules, so the spec, the search, the
simulator and the engines can all lean on it.
"""

from servetune.planner.engine_config import EngineConfig, resolve_engine_config
from servetune.planner.flags import FLAGS, argv_value, gpus_needed, parse_set_option, to_cli_args, to_command_line, to_config_yaml, validate_flags
from servetune.planner.gpus import GpuSpec, get_gpu, known_gpus, register_gpus_from_yaml
from servetune.planner.memory import MemoryPlan, plan_memory
from servetune.planner.modelinfo import ModelProfile, known_models, load_model
from servetune.planner.moe_kernels import MoeKernelConfig, moe_kernel_config
from servetune.planner.prior import optimistic_bound, preemption_bound
from servetune.planner.target import Target, resolve_target
from servetune.planner.vllm_rules import VllmMemoryRules, memory_rules, parse_vllm_version
from servetune.vllm_version import DEFAULT_VLLM_VERSION

__all__ = ["FLAGS", "argv_value", "validate_flags", "gpus_needed", "parse_set_option", "to_cli_args", "to_command_line",
           "to_config_yaml", "GpuSpec", "get_gpu", "known_gpus", "register_gpus_from_yaml", "DEFAULT_VLLM_VERSION",
           "EngineConfig", "MemoryPlan", "parse_vllm_version", "plan_memory", "resolve_engine_config", "ModelProfile",
           "known_models", "load_model", "preemption_bound", "optimistic_bound", "Target", "resolve_target",
           "VllmMemoryRules", "memory_rules", "MoeKernelConfig", "moe_kernel_config"]
