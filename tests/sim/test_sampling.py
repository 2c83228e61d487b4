"""The sampler's cost beyond greedy (servetune.sim.sampling, PerfModel's ``sampler`` term)."""

from __future__ import annotations

import dataclasses

import pytest

from servetune.errors import SpecError
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.sim import PerfModel
from servetune.sim.sampling import (FLASHINFER_TOPK_TOPP_BYTES, GREEDY_BYTES, PENALTY_BYTES, TEMPERATURE_BYTES,
                                    runs_v2_sampler, sampler_pass)
from servetune.workload import GREEDY, Sampling, Workload

QWEN25_INSTRUCT = Sampling(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.1)
QWEN3 = Sampling(temperature=0.6, top_k=20, top_p=0.95)


def test_the_counted_bytes_add_up_stage_by_stage() -> None:
    """Cast 6 + penalties 77 + temperature 8 + FlashInfer's top-k mask, softmax and one top-p round 36,
    less greedy's cast and argmax (10): 117 bytes a vocabulary entry with penalties, 40 without."""
    assert PENALTY_BYTES == 8 + 9 + 8 + 9 + 2 + 12 + 12 + 5 + 12
    assert FLASHINFER_TOPK_TOPP_BYTES == 12 + 16 + 8 and TEMPERATURE_BYTES == 8 and GREEDY_BYTES == 6 + 4
    with_penalty = sampler_pass(QWEN25_INSTRUCT, (0, 23, 0), 8.9, v2_runner=False)
    without = sampler_pass(QWEN3, (0, 23, 0), 9.0, v2_runner=False)
    assert with_penalty is not None and without is not None
    assert (with_penalty.bytes_per_logit, with_penalty.kernels) == (117.0, 20)
    assert (without.bytes_per_logit, without.kernels) == (40.0, 4)
    plain = sampler_pass(Sampling(temperature=1.0), (0, 23, 0), 8.0, v2_runner=False)
    assert plain is not None and plain.bytes_per_logit == 40.0  # softmax, noise, divide, argmax


def test_only_the_paths_read_are_priced() -> None:
    """Greedy costs nothing; the V1 runner before 0.21.0 (FlashInfer's sampler off by default: sort or
    Triton), a GPU FlashInfer does not support, top-k or top-p alone and the V2 runner are not counted."""
    assert sampler_pass(GREEDY, (0, 15, 1), 8.6, v2_runner=False).bytes_per_logit == 0.0
    assert sampler_pass(QWEN25_INSTRUCT, (0, 20, 0), 8.9, v2_runner=False) is None
    assert sampler_pass(QWEN25_INSTRUCT, (0, 21, 0), 8.9, v2_runner=False) is not None
    assert sampler_pass(QWEN25_INSTRUCT, (0, 23, 0), 7.0, v2_runner=False) is None
    assert sampler_pass(Sampling(temperature=0.7, top_p=0.9), (0, 23, 0), 8.9, v2_runner=False) is None
    assert sampler_pass(QWEN3, (0, 28, 0), 8.9, v2_runner=True) is None
    assert not runs_v2_sampler((0, 21, 0), "Qwen3ForCausalLM", v1_runner=False, dense=True)
    assert runs_v2_sampler((0, 22, 0), "Qwen3ForCausalLM", v1_runner=False, dense=True)
    assert not runs_v2_sampler((0, 22, 0), "LlamaForCausalLM", v1_runner=False, dense=True)
    assert runs_v2_sampler((0, 23, 0), "LlamaForCausalLM", v1_runner=False, dense=True)
    assert not runs_v2_sampler((0, 23, 0), "Qwen3ForCausalLM", v1_runner=False, dense=False)  # MoE / quantized
    assert not runs_v2_sampler((0, 26, 0), "Qwen3MoeForCausalLM", v1_runner=True, dense=False)


def test_a_generation_config_reads_as_vllm_applies_it() -> None:
    s = Sampling.from_dict({"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05})
    assert s == dataclasses.replace(QWEN25_INSTRUCT, repetition_penalty=1.05) and not s.greedy and s.penalties
    assert Sampling.from_dict({}).temperature == 1.0  # vLLM's default where the file sets none
    assert Sampling.from_dict({"temperature": 0}).greedy
    with pytest.raises(SpecError):
        Sampling.from_dict({"top_p": "0.8"})
    with pytest.raises(SpecError):
        Sampling.from_dict({"min_tokens": 3})
    assert Workload.from_dict({"input_len": 8, "output_len": 8, "num_requests": 1, "concurrency": 1}).sampling == GREEDY


def test_the_sampler_is_priced_per_row_over_the_whole_vocabulary_at_the_tables_bandwidth() -> None:
    """Qwen2.5-0.5B on an L4 at vLLM 0.23.0: 117 bytes x 151,936 entries at 300 GB/s, 59 us a row,
    plus 20 launches; greedy requests and a version whose path was not read pay nothing."""
    model, gpu = load_model("qwen2.5-7b"), get_gpu("L4")
    cfg = resolve_engine_config({"max_model_len": 4096}, model, gpu, "0.23.0")
    greedy, sampled = PerfModel(model, gpu, cfg), PerfModel(model, gpu, cfg, sampling=QWEN25_INSTRUCT)
    row = 117.0 * model.vocab_size / 300e9
    assert sampled.sampler_row_s == pytest.approx(row) and greedy.sampler_row_s == 0.0
    args = (32, 32, 32 * 512, 32 * 512, True)
    assert greedy.gpu_cost(*args).sampler == 0.0
    cost = sampled.gpu_cost(*args)
    assert cost.sampler == pytest.approx(32 * row + sampled.sampler_step_s)
    assert sampled.gpu_time(*args) - greedy.gpu_time(*args) == pytest.approx(cost.sampler)
    assert "FlashInfer" in sampled.sampler_path
    old = resolve_engine_config({"max_model_len": 4096}, model, gpu, "0.15.1")
    unread = PerfModel(model, gpu, old, sampling=QWEN25_INSTRUCT)
    assert unread.sampler_row_s == 0.0 and "not counted" in unread.sampler_path
