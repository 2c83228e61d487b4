"""The sampler's cost beyond greedy (servetune.sim.sampling, PerfModel's ``sampler`` term)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from servetune.errors import SpecError
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.sim import PerfModel
from servetune.sim._calibration import Calibration
from servetune.sim.sampling import (FLASHINFER_TOPK_TOPP_BYTES, GREEDY_BYTES, PENALTY_BYTES, PLAIN_DRAW_BYTES,
                                    TEMPERATURE_BYTES, TRITON_MIN_ROWS, runs_v2_sampler, sampler_pass,
                                    triton_mask_seconds)
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
    """Greedy costs nothing; the V1 runner before 0.17.0 (PyTorch's sort, or FlashInfer where it imports),
    a GPU FlashInfer does not support, top-k or top-p alone and the V2 runner are not counted; 0.17.0-0.20.x
    take the Triton mask and the native draw, 0.21.0 on FlashInfer's sampler."""
    assert sampler_pass(GREEDY, (0, 15, 1), 8.6, v2_runner=False).bytes_per_logit == 0.0
    assert sampler_pass(QWEN25_INSTRUCT, (0, 16, 0), 8.9, v2_runner=False) is None
    triton = sampler_pass(QWEN25_INSTRUCT, (0, 20, 0), 8.9, v2_runner=False)
    assert triton is not None and triton.triton_mask and "Triton" in triton.path
    assert sampler_pass(QWEN3, (0, 17, 0), 9.0, v2_runner=False).triton_mask
    assert not sampler_pass(QWEN25_INSTRUCT, (0, 21, 0), 8.9, v2_runner=False).triton_mask
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


def test_the_triton_mask_runs_in_waves_of_one_row_an_sm() -> None:
    """vLLM's Triton top-k / top-p mask launches min(SMs, rows) programs, one row each: a full wave of
    132 rows on an H100 costs what one row does, a 133rd row a second wave; below 8 rows vLLM sorts
    (not priced); a longer vocabulary sweeps longer; a slower SM clock sweeps slower."""
    vocab = 151_936
    one = triton_mask_seconds(TRITON_MIN_ROWS, vocab, 132, 1980.0)
    assert one > 0.0 and triton_mask_seconds(TRITON_MIN_ROWS - 1, vocab, 132, 1980.0) == 0.0
    assert triton_mask_seconds(132, vocab, 132, 1980.0) == pytest.approx(one)
    assert triton_mask_seconds(133, vocab, 132, 1980.0) == pytest.approx(2 * one)
    assert triton_mask_seconds(512, vocab, 132, 1980.0) == pytest.approx(4 * one)
    assert triton_mask_seconds(512, 248_320, 132, 1980.0) > triton_mask_seconds(512, vocab, 132, 1980.0)
    assert triton_mask_seconds(512, vocab, 108, 1410.0) == pytest.approx(5 * one * 1980.0 / 1410.0)


def test_a_017_step_pays_the_draw_per_row_and_the_mask_per_wave() -> None:
    """Qwen3-8B on an H100 at vLLM 0.17.1 sampling as its generation config says: each row moves the
    draw's bytes (temperature 8 + softmax, noise, divide, argmax 36 + the fp32 cast 6, less greedy's 10)
    over the vocabulary at the table's bandwidth, and the step adds the mask's waves; at 4 rows only the
    draw is priced (vLLM sorts there)."""
    model, gpu = load_model("qwen3-8b"), get_gpu("H100-80GB")
    cfg = resolve_engine_config({"max_model_len": 4096}, model, gpu, "0.17.1")
    greedy, sampled = PerfModel(model, gpu, cfg), PerfModel(model, gpu, cfg, sampling=QWEN3)
    row = (TEMPERATURE_BYTES + PLAIN_DRAW_BYTES + 6 - GREEDY_BYTES) * model.vocab_size / (gpu.hbm_gbps * 1e9)
    assert sampled.sampler_row_s == pytest.approx(row)
    for rows in (4, 256):
        args = (rows, rows, rows * 512, rows * 512, True)
        mask = triton_mask_seconds(rows, model.vocab_size, 132, 1980.0)
        assert (mask == 0.0) == (rows < TRITON_MIN_ROWS)
        assert sampled.gpu_cost(*args).sampler == pytest.approx(rows * row + sampled.sampler_step_s + mask)
        assert greedy.gpu_cost(*args).sampler == 0.0


def test_the_priced_sampler_meets_the_timed_kernel_on_an_h100() -> None:
    """vLLM 0.17.1's own Triton top-k / top-p kernel and native draw, timed on an H100 SXM at 8-1,024 rows of
    32,000-248,320 logits (tests/fixtures/real_h100/kernels/sampler_probe_h100.json, whole sampler less
    greedy's): a 0.17.1 step's priced sampler (draw bytes, launches and mask waves, as ``PerfModel`` adds them)
    is within 15% of every timed row and within 6% from 256 rows; the sort below 8 rows is not priced."""
    probe = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "real_h100" / "kernels"
                        / "sampler_probe_h100.json").read_text())
    assert probe["gpu"] == "NVIDIA H100 80GB HBM3" and probe["sms"] == 132
    gpu = get_gpu("H100-80GB")
    spass = sampler_pass(QWEN3, (0, 17, 1), gpu.compute_capability, v2_runner=False)
    step_s = spass.kernels * Calibration().compiled_layer_overhead_s / 10
    timed = [c for c in probe["cases"] if "triton 0.17.1_ms" in c]
    assert len(timed) == 18
    for case in timed:
        rows, vocab = case["rows"], case["vocab"]
        measured = (case["triton 0.17.1_ms"] - case["greedy_ms"]) * 1e-3
        priced = (spass.bytes_per_logit * vocab / (gpu.hbm_gbps * 1e9) * rows + step_s
                  + triton_mask_seconds(rows, vocab, gpu.sm_count, 1980.0))
        assert priced == pytest.approx(measured, rel=0.15 if rows < 256 else 0.06), (rows, vocab)
    # The simulator's own step price for a model of Qwen3's 151,936-entry vocabulary is that sum.
    model = load_model("qwen3-8b")
    sampled = PerfModel(model, gpu, resolve_engine_config({"max_model_len": 4096}, model, gpu, "0.17.1"), sampling=QWEN3)
    for case in (c for c in timed if c["vocab"] == model.vocab_size):
        rows = case["rows"]
        measured = (case["triton 0.17.1_ms"] - case["greedy_ms"]) * 1e-3
        cost = sampled.gpu_cost(rows, rows, rows * 512, rows * 512, True).sampler
        assert cost == pytest.approx(measured, rel=0.15 if rows < 256 else 0.06), rows
