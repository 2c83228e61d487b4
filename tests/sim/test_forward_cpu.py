"""The engine thread's CPU of a forward outside a FULL CUDA graph (``PerfModel.forward_cpu_s``), against the traced
steps it was read off (``tests/fixtures/real_h100_classes/2026-12-07_q35moe20tri_prof_u09_default``: the
Qwen3.5-35B-A3B shape at 20 layers on an H100 SXM, vLLM 0.26.0, 512 in flight) and the rule's scope."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from _fidelity import HOST_MODELS, serving_flags
from real_vllm.trace_steps import window_steps
from steps_vs_sim import step_batch

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.sim import FORWARD_BOUND_SHARE, PerfModel, SimScheduler, simulate, with_calibration
from servetune.sim.host_cpu import GDN_MIXERS
from servetune.sim.moe_jit import TritonCache
from servetune.workload import Workload

WINDOW = (Path(__file__).resolve().parents[1] / "fixtures" / "real_h100_classes"
          / "2026-12-07_q35moe20tri_prof_u09_default" / "p1024_o128_c512_prof")
SMALL = WINDOW.parents[1] / "2026-12-07_q35moe20tri_prof_small_u09_default"


def _traced(window: Path) -> tuple[PerfModel, list[dict]]:
    """A profiled window's simulator (its start's flags, on the H100 it ran on) and its traced steps."""
    summary = json.loads((window / "summary.json").read_text())
    model, gpu = load_model(HOST_MODELS[summary["model"]]), get_gpu("H100-80GB")
    return PerfModel(model, gpu, resolve_engine_config(serving_flags(summary["flags"]), model, gpu)), \
        window_steps(window)["steps"]


@pytest.fixture(scope="module")
def traced() -> tuple[PerfModel, list[dict]]:
    return _traced(WINDOW)


def _periods(steps: list[dict]) -> list[tuple[dict, float]]:
    """Each traced step with the seconds to the next step's start; the steps the profiler stalled writing its
    trace (over 130 ms) left out, as where the constants were read."""
    out = []
    for step, after in zip(steps, steps[1:]):
        period = (after["cpu_ts_us"] - step["cpu_ts_us"]) / 1e6
        if step["ctx_tokens"] and period < 0.13:
            out.append((step, period))
    return out


def test_the_traced_mixed_steps_wait_on_the_cpu_and_the_decodes_do_not(traced) -> None:
    """The 8,192-token mixed steps keep the GPU busy 77 ms of a ~108 ms period; the decodes of 512, one CUDA graph,
    fill their span. What the rule prices is that difference, not the kernels."""
    _, steps = traced
    mixed = _periods(steps)
    assert len(mixed) >= 25
    busy = statistics.median(s["gpu_busy_us"] / 1e6 for s, _ in mixed)
    period = statistics.median(p for _, p in mixed)
    assert 0.65 <= busy / period <= 0.8, (busy, period)
    decodes = [s for s in steps if not s["ctx_tokens"]]
    assert decodes and all(s["gpu_busy_us"] / (s["gpu_end_us"] - s["gpu_start_us"]) > 0.95 for s in decodes[1:])


def test_a_mixed_step_is_priced_near_its_traced_period_and_the_gpu_alone_is_not(traced) -> None:
    """Simulated 103 ms against a median period of 109 ms (the unprofiled seconds before the trace: 95-107 ms);
    the GPU work alone, what the step cost before the rule, 79 ms (the read-off constants are these steps', so
    this shows the rule reproduces them; the held-out judgement is the published pages, docs/accuracy.md)."""
    perf, steps = traced
    ratios, gpu_only = [], []
    for step, period in _periods(steps):
        batch = step_batch(step)
        ratios.append(perf.step_time(**batch) / period)
        gpu_only.append(perf.gpu_time(**batch) / period)
    assert 0.88 <= statistics.median(ratios) <= 1.05
    assert statistics.median(gpu_only) < 0.8


def test_the_rule_is_outside_full_graphs_and_scaled_by_what_the_step_carries() -> None:
    model, gpu = load_model("qwen3-next-80b-a3b"), get_gpu("H200")
    perf = PerfModel(model, gpu, resolve_engine_config({"max_num_batched_tokens": 8192}, model, gpu))
    assert perf.forward_cpu_s(256, 256, 0, True) == 0.0  # a decode batch replayed as one graph
    above = perf.forward_cpu_s(1024, 1024, 0, True)  # decodes above the largest capture size: mixers, MoE pieces
    piecewise = perf.forward_cpu_s(64, 512, 448, False)  # a mixed step inside the capture sizes: no MoE pieces
    full = perf.forward_cpu_s(300, 8192, 7892, False)
    assert 0.0 < piecewise < full and 0.0 < above < full
    # The prefill's share grows with its tokens and requests; the mixers' and MoE pieces' do not.
    assert perf.forward_cpu_s(301, 8192, 7892, False) > full
    assert perf.forward_cpu_s(300, 8192, 4000, False) < full
    eager = PerfModel(model, gpu, resolve_engine_config({"enforce_eager": True}, model, gpu))
    assert eager.forward_cpu_s(300, 8192, 7892, False) == 0.0  # enforce_eager has its own launch floor


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-30b-a3b", "gpt-oss-20b"])
def test_models_the_trace_did_not_time_get_nothing(name: str) -> None:
    """A dense model, and MoE blocks without a shared expert (another vLLM op, not timed): no term."""
    model, gpu = load_model(name), get_gpu("H100-80GB")
    perf = PerfModel(model, gpu, resolve_engine_config({"max_num_batched_tokens": 8192}, model, gpu))
    assert perf.forward_cpu_s(300, 8192, 7892, False) == 0.0


def test_one_gpu_adds_the_engine_cpu_and_several_do_not() -> None:
    """With one GPU vLLM's UniProcExecutor runs the forward on the engine core's thread, after scheduling; with
    several each worker launches in its own process, so the forward's CPU alone is the floor."""
    model, gpu = load_model("qwen3-next-80b-a3b"), get_gpu("H200")
    args = dict(num_reqs=300, num_tokens=8192, kv_context=300 * 2000, attn_work=8192 * 1024, decode_only=False,
                prefill_tokens=7892, prefill_context=8 * 1024, prefill_attn_work=7892 * 512)
    one = PerfModel(model, gpu, resolve_engine_config({"max_num_batched_tokens": 8192}, model, gpu))
    two = PerfModel(model, gpu, resolve_engine_config({"max_num_batched_tokens": 8192, "tensor_parallel_size": 2},
                                                      model, gpu))
    forward = one.forward_cpu_s(300, 8192, 7892, False)
    assert forward > two.gpu_time(**args)  # the forward's launches outlast the TP=2 GPU work
    assert one.step_time(**args) == pytest.approx(forward + one.engine_cpu_s(300))
    assert two.step_time(**args) == pytest.approx(two.forward_cpu_s(300, 8192, 7892, False))


def _prefill_heavy() -> Workload:
    return Workload.from_dict({"input_len": 1024, "output_len": 16, "num_requests": 256, "concurrency": 256})


def test_a_simulation_counts_the_steps_its_forward_cpu_paced_and_says_so() -> None:
    """Qwen3-Next at TP=2 on H200s, prefill-heavy: most of the engine's time goes to 8,192-token mixed steps whose
    launches outlast their kernels (``PerfModel.forward_floor_s``). The simulation counts those steps' time
    (``SimScheduler.forward_bound_s``) and its result carries one note saying the host's CPU moves the figure; with
    the forward's CPU priced at nothing, no step is counted and no note is printed."""
    model, gpu = load_model("qwen3-next-80b-a3b"), get_gpu("H200")
    config = resolve_engine_config({"tensor_parallel_size": 2, "max_num_batched_tokens": 8192}, model, gpu)
    result = simulate(model, gpu, config, _prefill_heavy())
    paced = [n for n in result.notes if n.startswith("The forward's CPU paced")]
    assert result.ok and len(paced) == 1, result.notes
    assert "gated-delta-net mixers eagerly" in paced[0] and "shared-expert MoE blocks" in paced[0]  # what Qwen3-Next has
    share = int(paced[0].split("paced ")[1].split("%")[0])
    assert 100 * FORWARD_BOUND_SHARE <= share <= 100
    free = with_calibration(gpu, {"gdn_mixer_cpu_s": 0.0, "gdn_prefill_request_cpu_s": 0.0,
                                  "gdn_prefill_token_cpu_s": 0.0, "shared_moe_piece_cpu_s": 0.0})
    unpaced = simulate(model, free, config, _prefill_heavy())
    assert not any(n.startswith("The forward's CPU paced") for n in unpaced.notes)
    assert unpaced.duration_s < result.duration_s  # the paced steps were longer than their GPU work


def test_the_tally_is_the_steps_that_last_exactly_their_forward_floor() -> None:
    """The scheduler's tally against the rule, step by step: a step counts where it lasts its forward's floor
    (no fused-MoE variant compiled on first use: a complete Triton cache), and the tally never exceeds the
    engine's step time. A dense model's forward needs no CPU beyond its launch floors: nothing is counted. The note
    names what the model's forward launches: granite-4.0-h-tiny's Mamba2 mixers are not priced, its shared-expert
    MoE pieces are, so its note speaks of those alone."""
    model, gpu = load_model("qwen3-next-80b-a3b"), get_gpu("H200")
    config = resolve_engine_config({"tensor_parallel_size": 2, "max_num_batched_tokens": 8192}, model, gpu)
    perf = PerfModel(model, gpu, config)
    sched = SimScheduler(model, gpu, config, 20_000, perf=perf, triton_cache=TritonCache(complete=True))
    for i in range(24):
        sched.add_request(f"r{i}", 1024, 16, 0.0)
    paced = total = 0.0
    while sched.has_work():
        step = sched.step()
        if not step.duration_s:
            continue
        floor = perf.forward_floor_s(len(step.new_tokens), step.prefill_tokens + step.decode_tokens,
                                     step.prefill_tokens, step.prefill_tokens == 0)
        total += step.duration_s
        paced += step.duration_s if floor and step.duration_s == floor else 0.0
    assert 0 < paced <= total
    assert sched.forward_bound_s == pytest.approx(paced)
    dense = load_model("qwen3-8b")
    result = simulate(dense, gpu, resolve_engine_config({}, dense, gpu), _prefill_heavy())
    assert result.ok and not any(n.startswith("The forward's CPU paced") for n in result.notes)
    granite = load_model("granite-4.0-h-tiny")  # Mamba2 mixers, not priced; shared experts, priced above the capture
    h100 = get_gpu("H100-80GB")
    notes = simulate(granite, h100, resolve_engine_config({}, granite, h100), _prefill_heavy()).notes
    paced = [n for n in notes if n.startswith("The forward's CPU paced")]
    assert len(paced) == 1 and "shared-expert MoE blocks" in paced[0] and "gated-delta-net" not in paced[0]




def test_small_mixed_steps_above_the_capture_size_pay_the_preparation_per_token_not_per_step() -> None:
    """The plan that asked it (benchmarks/real_vllm/plan_2026_12_07_q35_prof.json, its prices written before the run):
    the same shape's small mixed steps, traced on another H100 SXM. Two were caught above the largest capture size,
    1,537 tokens (4 prefills, 1 decode) and 4,229 (11 prefills, 5 decodes): 68.1 and 70.2 ms from start to start,
    22.1 and 40.8 ms of it kernels. Priced 79.2 and 84.5 ms (+16%, +20%: their mixers and MoE pieces ran 1.37-1.43 and
    1.73-1.83 ms of CPU where the full budgets' ran 1.766 and 2.364); a preparation charged per step (14.6 ms) instead
    of per prefill token would price them about 11 and 7 ms higher still, so the per-token charge stands."""
    perf, steps = _traced(SMALL / "p384_o64_c16_prof")
    caught = [(s, (after["cpu_ts_us"] - s["cpu_ts_us"]) / 1e3) for s, after in zip(steps, steps[1:])
              if s["ctx_tokens"] and s["tokens"] > perf.max_capture]
    assert [s["tokens"] for s, _ in caught] == [1537, 4229]
    for step, period_ms in caught:
        batch = step_batch(step)
        priced = 1e3 * perf.step_time(**batch)
        per_token = 1e3 * perf.calibration.gdn_prefill_token_cpu_s * batch["prefill_tokens"]
        per_step = priced - per_token + 14.6
        assert 1.1 < priced / period_ms < 1.25, (step["tokens"], priced, period_ms)
        assert per_step > priced + 5.0


def test_decodes_of_200_the_gdn_state_and_the_experts_against_their_kernels() -> None:
    """40 decode steps of 200 at ~1,000-1,250 tokens of context on the same H100 (the load of the H200's held-out
    Qwen3.5 burst of 200, whose decode step is priced 33.0 ms for the whole model): 18.45 ms of kernels in a ~18.8 ms
    period (GPU-bound), priced 19.63 ms of GPU (+6.4%; 19.08, +3.4%, since the state's share below). The gated-delta-net decode kernel ran 4.24 ms over the 15
    layers, 1.41 us a request and layer, as at 512 decodes in the full-budget window (10.85 ms), and the conv1d update
    0.14 ms; the simulator's state and activations 4.97 ms (+13%) at mem_efficiency, 4.42 ms (+1%) since the state
    takes the kernel's own share of HBM (``Calibration.gdn_decode_state_efficiency``, read off these two windows).
    The routed experts' kernels 10.93 ms, priced 12.11 (+10.8%)."""
    perf, steps = _traced(SMALL / "p1000_o256_c200_prof")
    decodes = [s for s in steps if s["tokens"] == 200 and not s["ctx_tokens"]]
    assert len(decodes) == 40
    names = window_steps(SMALL / "p1000_o256_c200_prof")["names"]
    def kernel_ms(prefix: str) -> float:
        return statistics.median(sum(k[2] for k in s["kernels"] if names[k[0]].startswith(prefix)) for s in decodes) / 1e3

    gdn = kernel_ms("fused_recurrent_gated_delta")
    assert gdn / (200 * 15) * 1e3 == pytest.approx(1.41, abs=0.02)
    busy = statistics.median(s["gpu_busy_us"] for s in decodes) / 1e3
    priced = 1e3 * statistics.median(perf.gpu_time(**step_batch(s)) for s in decodes)
    assert 1.01 < priced / busy < 1.06, (priced, busy)
    state = 1e3 * perf.recurrent_seconds(200, 0, 0)
    assert state / (gdn + kernel_ms("_causal_conv1d_update")) == pytest.approx(1.0, abs=0.03), (state, gdn)


def test_the_parts_named_are_the_ones_charged_even_with_the_mixers_cpu_at_zero() -> None:
    """``forward_cpu_parts`` names what ``forward_cpu_s`` charges: a calibration that prices a gated delta net's
    mixers at nothing but keeps its prefill's preparation still charges a prefilling step, so the step is still
    counted (``forward_priced``) and its note names the gated-delta-net part."""
    model, gpu = load_model("qwen3-next-80b-a3b"), get_gpu("H200")
    config = resolve_engine_config({"max_num_batched_tokens": 8192}, model, gpu)
    perf = PerfModel(model, with_calibration(gpu, {"gdn_mixer_cpu_s": 0.0, "shared_moe_piece_cpu_s": 0.0}), config)
    assert perf.forward_cpu_s(8, 8192, 8192, False) > 0.0
    assert perf.forward_priced and perf.forward_cpu_parts == (GDN_MIXERS,)
