"""planner.resolve_target: names (or loaded objects) to model, GPU and vLLM's engine config."""

from __future__ import annotations

import pytest

from servetune.errors import SpecError
from servetune.planner import get_gpu, load_model, resolve_engine_config, resolve_target
from servetune.vllm_version import DEFAULT_VLLM_VERSION


def test_names_and_loaded_objects_resolve_the_same() -> None:
    by_name = resolve_target("llama-3.1-8b", "A100-40GB", {"max_num_seqs": 64})
    model, gpu = load_model("llama-3.1-8b"), get_gpu("A100-40GB")
    assert resolve_target(model, gpu, {"max_num_seqs": 64}) == by_name
    assert by_name.config == resolve_engine_config({"max_num_seqs": 64}, model, gpu, DEFAULT_VLLM_VERSION)


def test_unknown_names_and_refused_flags_are_spec_errors() -> None:
    with pytest.raises(SpecError):
        resolve_target("no-such-model", "H200", {})
    with pytest.raises(SpecError):
        resolve_target("servetune-test-850m", "no-such-gpu", {})
