"""Real MoE engine steps on an H100 SXM out of vLLM's own profiler, against the simulator's price of each batch.

``tests/fixtures/real_h100_classes/2026-12-07_q3moe_prof_*`` and ``2026-12-07_mx16_prof_*`` (plan
``benchmarks/real_vllm/plan_2026_12_07_moe_prof_h100.json``, written before it ran): vLLM 0.26.0's worker trace of 40
steps in each of three windows, the Qwen3-30B-A3B shape decoding 1 and 4 sequences and the Mixtral-8x7B shape cut to
16 layers at 256 in flight (8,192-token mixed steps and 256-sequence decodes), kept as their reduction
(``steps.json.gz``). ``benchmarks/steps_vs_sim.py --classes`` prints the comparison; nothing is fitted on it.
"""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest
from _fidelity import HOST_MODELS, serving_flags
from real_vllm.trace_steps import window_steps
from steps_vs_sim import EXPERT_KERNELS, StepRow, class_windows, compare, window_gpu

from servetune.engines.vllm.logs import parse_log
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model

CLASSES = Path(__file__).resolve().parents[1] / "fixtures" / "real_h100_classes"
PROFILED = sorted(p for p in class_windows(CLASSES) if p.parent.name.startswith("2026-12-07_"))
#: MoE layers of each shape: 48 (Qwen3-30B-A3B), 16 (the cut Mixtral).
LAYERS = {"q3moe": 48, "mx16": 16}


def _shape(window: Path) -> str:
    return window.parent.name.split("_")[1]  # 2026-12-07_<shape>_prof_<flags>/<window>


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, bool], list[StepRow]]:
    grouped: dict[tuple[str, bool], list[StepRow]] = {}
    for window in PROFILED:
        for row in compare(window):
            grouped.setdefault((window.name, row.mixed), []).append(row)
    return grouped


def _ratio(group: list[StepRow]) -> float:
    """Median simulated / real time of the routed experts' kernels over a group of steps."""
    return statistics.median(r.experts[1] for r in group) / statistics.median(r.experts[0] for r in group)


def test_the_three_profiled_windows_ran_on_an_h100_and_each_step_runs_two_expert_gemms_a_layer() -> None:
    assert [f"{_shape(w)}/{w.name}" for w in PROFILED] == [
        "mx16/p1024_o256_c256_prof", "q3moe/p256_o1024_c16_prof", "q3moe/p256_o256_c1_prof"]
    for window in PROFILED:
        assert window_gpu(window) == "H100-80GB"
        trace = window_steps(window)
        assert len(trace["steps"]) == 40 and trace["unassigned_gpu_events"] == 0
        names = trace["names"]
        for step in trace["steps"]:
            fused = sum(1 for k in step["kernels"] if names[k[0]] == "fused_moe_kernel")
            assert fused == 2 * LAYERS[_shape(window)], window  # w13 and w2 in every MoE layer
            assert any(EXPERT_KERNELS.search(names[k[0]]) and names[k[0]] != "fused_moe_kernel"
                       for k in step["kernels"])  # the alignment, activation and sum count with them


def test_the_windows_batches_are_the_ones_planned() -> None:
    """The 1-client window decodes one sequence a step; the 16-client one was traced while its four warm-up
    requests decoded (4 a step); the Mixtral window holds full 8,192-token mixed steps (and one of 7,140, the
last chunk of a wave) and 256-sequence decodes."""
    batches = {}
    for window in PROFILED:
        steps = window_steps(window)["steps"]
        batches[window.name] = sorted({(s["ctx_tokens"] > 0, s["tokens"]) for s in steps})
    assert batches["p256_o256_c1_prof"] == [(False, 1)]
    assert batches["p256_o1024_c16_prof"] == [(False, 4)]
    assert batches["p1024_o256_c256_prof"] == [(False, 256), (True, 7140), (True, 8192)]


def test_the_simulated_experts_against_their_kernels_in_real_steps(rows: dict) -> None:
    """Where the experts' price stands inside real steps (median simulated / real, held out):

    - 4 and 256 decoding sequences: 1.04 and 0.92, the streaming rule (``_moe_tiles.MOE_BY_BATCH_STREAM``) at work;
    - 1 sequence: 1.29 (2.12 ms priced against 1.64) since the router's measured kernels replace the fitted floor
      where that rule prices the experts (``_moe_tiles.MOE_ROUTER_KERNELS_S``, read off these traces); 1.78 before,
      when ``moe_layer_floor_s`` (60.7 us a layer) bound there and stood in for the step's small kernels;
    - 8,192-token mixed steps: 1.28 (240 ms against 188), as the kernel probe's 2,048-8,192-token rows of this layer
      (0.82-0.84 real / simulated): the wide tile's measured rate (``MOE_BY_BATCH_WIDE_TILE_RATE``) is not applied.
    """
    assert 0.9 <= _ratio(rows[("p256_o1024_c16_prof", False)]) <= 1.1
    assert 0.85 <= _ratio(rows[("p1024_o256_c256_prof", False)]) <= 1.0
    assert 1.1 <= _ratio(rows[("p256_o256_c1_prof", False)]) <= 1.35
    assert 1.15 <= _ratio(rows[("p1024_o256_c256_prof", True)]) <= 1.35


def test_a_step_is_priced_within_a_quarter_of_its_gpu_busy_time(rows: dict) -> None:
    """The simulated GPU time of a step against the union of its kernels: 4.29 / 4.38 ms (1 sequence), 7.60 / 8.07
    (4), 26.32 / 28.01 (256), 281.5 / 225.9 (8,192-token mixed steps: +24.6%, the experts above); before the router's
    kernels replaced the floor, 4.69 and 7.20 at 1 and 4 sequences."""
    for group in rows.values():
        sim = statistics.median(r.sim.seconds for r in group)
        busy = statistics.median(r.real["busy"] for r in group)
        assert 0.85 <= sim / busy <= 1.25


@pytest.mark.parametrize("start", sorted({w.parent for w in PROFILED}), ids=lambda p: p.name)
def test_the_planner_held_out_on_the_profiled_starts(start: Path) -> None:
    """137,664 KV tokens planned against 136,560 logged (Qwen3-30B-A3B, +0.81%) and 410,480 against 413,008
    (Mixtral-16L, -0.61%): the profiler's flag changes nothing vLLM allocates (``_fidelity.DIAGNOSTIC_FLAGS``)."""
    summary = json.loads((start / "summary.json").read_text())
    model, gpu = load_model(HOST_MODELS[summary["model"]]), get_gpu("H100-80GB")
    plan = plan_memory(model, gpu, resolve_engine_config(serving_flags(summary["flags"]), model, gpu))
    logged = parse_log(gzip.open(start / "server.log.gz", "rt").read()).kv_cache_tokens
    assert logged is not None and abs(plan.kv_cache_tokens / logged - 1) < 0.01
