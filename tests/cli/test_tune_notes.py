"""What ``servetune tune`` says under its recommended command about measure-only flags (cli._main, planner.flags)."""

from __future__ import annotations

from pathlib import Path

from servetune.cli import _main
from servetune.planner.flags import measure_only_notes
from servetune.planner.modelinfo import load_model


def test_an_moe_model_is_told_apart_from_a_dense_one_and_an_unreadable_one(tmp_path: Path) -> None:
    assert _main._is_moe(None, "qwen3-30b-a3b") and _main._is_moe(None, "mixtral-8x7b")
    assert not _main._is_moe(None, "llama-3.1-8b")
    assert _main._is_moe(load_model("qwen3-30b-a3b"), "llama-3.1-8b")  # the study's loaded profile first
    assert not _main._is_moe(None, str(tmp_path / "no-such-model"))  # a note left out, never a traceback


def test_random_weights_quantized_online_on_an_moe_model_get_the_few_experts_note() -> None:
    """vLLM's profiler on 2026-12-07: the FP8-quantized random-weight Qwen3-30B-A3B start routed to few experts, the
    bf16 one did not; so only the quantized MoE case carries the second note."""
    dummy_fp8 = {"load_format": "dummy", "quantization": "fp8", "max_num_seqs": 64}
    notes = measure_only_notes(dummy_fp8, moe=_main._is_moe(None, "qwen3-30b-a3b"))
    assert len(notes) == 2 and "few experts" in notes[1] and "real weights" in notes[1]
    assert len(measure_only_notes({"load_format": "dummy"}, moe=True)) == 1  # bf16 random weights route uniformly
    assert len(measure_only_notes(dummy_fp8, moe=_main._is_moe(None, "llama-3.1-8b"))) == 1
    assert measure_only_notes({"quantization": "fp8"}, moe=True) == []  # real weights: nothing to say
