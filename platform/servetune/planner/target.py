"""One flag set resolved for one model on one GPU type: the planner's single entry point.

Every consumer that starts from names (a trial task, ``servetune simulate``, ``servetune plan``,
the ``vllm serve`` stand-in) needs the same three things: the model's profile, the GPU's row of
the table and the :class:`~servetune.planner.memory.EngineConfig` vLLM would run with. They come
from here, so a change to how a name or a default version is read happens in one place.

Example:
    >>> t = resolve_target("servetune-test-850m", "H200", {"max_num_seqs": 64})
    >>> t.gpu.name, t.config.max_num_seqs, t.config.vllm_version
    ('H200', 64, '0.26.0')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from servetune.planner.gpus import GpuSpec, get_gpu
from servetune.planner.engine_config import EngineConfig, resolve_engine_config
from servetune.planner.modelinfo import ModelProfile, load_model
from servetune.vllm_version import DEFAULT_VLLM_VERSION

__all__ = ["Target", "resolve_target"]


@dataclasses.dataclass(frozen=True)
class Target:
    """What a flag set runs on, resolved: the model, the GPU and vLLM's full engine config."""

    model: ModelProfile
    gpu: GpuSpec
    config: EngineConfig


def resolve_target(model: str | ModelProfile, gpu: str | GpuSpec, flags: Mapping[str, Any],
                   vllm_version: str | None = None) -> Target:
    """``model`` / ``gpu`` by name (or already loaded); ``vllm_version`` None is the default
    release. Raises :class:`~servetune.errors.SpecError` for an unknown name or a flag set vLLM
    would refuse. A user GPU table must be registered before (``register_gpus_from_yaml``)."""
    profile = model if isinstance(model, ModelProfile) else load_model(model)
    spec = gpu if isinstance(gpu, GpuSpec) else get_gpu(gpu)
    config = resolve_engine_config(flags, profile, spec, vllm_version or DEFAULT_VLLM_VERSION)
    return Target(profile, spec, config)
