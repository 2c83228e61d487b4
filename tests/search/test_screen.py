"""The simulator screen on a GPU type no real vLLM run has judged (``GpuSpec.sim_evidence`` empty):
wider margins, said once when the study starts; on a judged GPU type nothing changes.

Real components: the study spec, the simulated engine (``simulate_flags``), the screen's calibration
(``learn``) and a real simulated study through ``run_study``; the "real" trials are the simulated twins
scaled, as the screen tests in test_propose.py build them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from _study_procs import a100_sim_study

from servetune.planner.gpus import calibration_note, get_gpu
from servetune.planner.modelinfo import load_model
from servetune.result import TrialResult, TrialStatus
from servetune.search.screen import (UNJUDGED_CLEAR_PREEMPTION_SHARE, UNJUDGED_MIN_TOLERANCE, UNJUDGED_TIGHT_TOLERANCE,
                                     SimScreen, learn, screen_for, simulate_flags)
from servetune.spec.schema import StudySpec
from servetune.study import StudyProgress, run_study

FLAGS = {"gpu_memory_utilization": 0.9, "max_num_seqs": 32, "max_model_len": 2048}
OTHER = {"gpu_memory_utilization": 0.9, "max_num_seqs": 8, "max_model_len": 2048}


def _spec(gpu: str, backend: str = "vllm") -> StudySpec:
    return StudySpec.from_dict({
        "name": "screen", "model": "servetune-test-850m", "gpu": {"type": gpu}, "backend": backend,
        "workload": {"input_len": 512, "output_len": 128, "num_requests": 64, "concurrency": 32, "seed": 1},
        "search_space": {"params": {"max_num_seqs": [8, 32]}}, "fixed_flags": {"max_model_len": 2048},
        "storage": {"optuna_url": "memory"}, "constraints": {"max_preemptions": 0}}, cwd="/tmp")


def _twice(screen: SimScreen, sim: TrialResult, best: float | None) -> str | None:
    """The screen's verdict on a proposal seen twice: the first is always dispatched (at most half of
    the proposals seen are screened), the second says what the rule itself decides."""
    screen.verdict(sim, best)
    return screen.verdict(sim, best)


def _calibrated(gpu: str) -> tuple[SimScreen, TrialResult, float]:
    """A screen for a study on ``gpu`` that learnt one real trial (its simulated twin x 0.8), the
    simulated result of another proposal, and a best so far 1.4x that proposal's prediction: above
    what the judged margin (30%) allows it, within the unjudged one (50%)."""
    spec = _spec(gpu)
    screen = screen_for(spec, "vllm")
    assert screen is not None
    sim = simulate_flags(spec, FLAGS)
    assert sim.ok and sim.output_throughput
    real = TrialResult(TrialStatus.OK, output_throughput=0.8 * sim.output_throughput, preemptions=0,
                       completed=sim.completed, failed=0)
    learn(screen, spec, FLAGS, sim, real)
    assert screen.ratio == pytest.approx(0.8) and len(screen.ratios) == 1
    other = simulate_flags(spec, OTHER)
    assert other.ok and other.output_throughput
    return screen, other, 1.4 * 0.8 * other.output_throughput


def test_on_an_unjudged_gpu_type_a_proposal_the_judged_margin_prunes_is_kept() -> None:
    """The A10G: no real run judged its simulator. A proposal predicted 1/1.4 of the best so far is
    pruned on the L40S (at most 1.3x with the 30% margin) and dispatched on the A10G (1.5x with 50%)."""
    assert calibration_note(get_gpu("A10G")) is not None and calibration_note(get_gpu("L40S")) is None
    judged, proposal, best = _calibrated("L40S")
    reason = _twice(judged, proposal, best)
    assert reason is not None and reason.startswith("sim_screen: throughput") and "with the 30% margin" in reason
    unjudged, proposal, best = _calibrated("A10G")
    assert unjudged.tolerance == UNJUDGED_MIN_TOLERANCE == 0.5
    assert _twice(unjudged, proposal, best) is None and unjudged.screened == 0
    # A clear loser is still screened there: at 1/1.6 of the best, 1.5x does not reach it.
    reason = _twice(unjudged, proposal, 1.6 * 0.8 * (proposal.output_throughput or 0))
    assert reason is not None and "with the 50% margin" in reason


def test_on_an_unjudged_gpu_type_the_margin_floor_and_the_unconfirmed_preemption_share_are_higher() -> None:
    """After 3 agreeing real trials the margin's floor is 30% (the judged GPU's 15%); an unconfirmed
    preemption verdict needs half the requests preempted (the judged GPU's quarter), and once a real
    trial confirmed it the confirmed share applies as on any GPU."""
    screen = screen_for(_spec("A10G"), "vllm")
    judged = screen_for(_spec("L40S"), "vllm")
    assert screen is not None and judged is not None
    for s in (screen, judged):
        s.ratios = [0.8, 0.8, 0.81]
    assert screen.tolerance == UNJUDGED_TIGHT_TOLERANCE == 0.3 and judged.tolerance == 0.15
    assert screen.clear_preemption_share == UNJUDGED_CLEAR_PREEMPTION_SHARE == 0.5
    preempting = TrialResult(TrialStatus.OK, output_throughput=1000.0, preemptions=24)  # 24 of 64 requests
    assert _twice(judged, preempting, best=None) is not None
    assert _twice(screen, preempting, best=None) is None
    clear = TrialResult(TrialStatus.OK, output_throughput=1000.0, preemptions=40)
    reason = _twice(screen, clear, best=None)
    assert reason is not None and "screens above 32" in reason
    screen.observe(clear, TrialResult(TrialStatus.OK, output_throughput=900.0, preemptions=30))  # confirmed
    reason = _twice(screen, preempting, best=None)
    assert reason is not None and "confirmed on real trials" in reason


def test_a_judged_gpu_types_screen_keeps_the_default_margins_and_says_nothing() -> None:
    for gpu in ("A100-80GB", "L40S", "RTX-3060"):
        screen = screen_for(_spec(gpu), "vllm")
        assert screen is not None and screen.margin_note is None and screen.widened_for is None
        assert (screen.min_tolerance, screen.tight_tolerance, screen.clear_preemption_share) == (0.3, 0.15, 0.25)
    note = screen_for(_spec("A10G"), "vllm").margin_note  # type: ignore[union-attr]
    assert note is not None and note.startswith("the simulator screen runs with wider margins (throughput 50% until")
    assert note.endswith(calibration_note(get_gpu("A10G")) or "-")


def test_a_gpu_type_whose_published_runs_judged_it_below_the_target_gets_the_wider_margins() -> None:
    """The RTX 5090: judged on published runs held out, 3 of 7 within 10% (``data/published_judgement.json``). The
    B200 (1 of 5) was the example until 2026-12-07, when its 4 of 5 met the target (the 64-row UMMA rule)."""
    screen = screen_for(_spec("RTX-5090"), "vllm")
    assert screen is not None
    assert (screen.min_tolerance, screen.tight_tolerance) == (UNJUDGED_MIN_TOLERANCE, UNJUDGED_TIGHT_TOLERANCE)
    note = screen.margin_note
    assert note is not None and note.endswith(calibration_note(get_gpu("RTX-5090")) or "-") and "3 of 7" in note


class _Margins(StudyProgress):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def screen_margins(self, note: str) -> None:
        self.lines.append(note)


@pytest.mark.parametrize("gpu, said", [("A100-40GB", 1), ("A100-80GB", 0)])
def test_a_study_on_an_unjudged_gpu_type_says_once_that_its_screen_runs_with_wider_margins(
        gpu: str, said: int, tmp_path: Path) -> None:
    """A real simulated study with the screen on (``multi_fidelity: true``): the A100-40GB has startup
    logs judged (``log_evidence``) but no run judged its simulator, so the line comes once, naming it;
    the A100-80GB's published runs judged it for the study's dense model (45 of 48 dense runs within 10%;
    42 of 48 before the SHM all-reduce's measured step, 2026-12-07), so none. (Until gpustack's GLM-4.5-Air
    runs were added blind, 2026-12-07, the A100-80GB met the target over all its runs too, 49 of 61; then
    52 of 66, below it; 55 of 66 since that step; the check is the study's model's class.)"""
    assert (calibration_note(get_gpu(gpu), load_model("llama-3.1-8b")) is not None) == bool(said)
    data: dict[str, Any] = a100_sim_study(f"margins-{said}", 2, tmp_path, {"experiment": f"exp-margins-{said}"})
    data["gpu"] = {**data["gpu"], "type": gpu}
    data["workload"] = {**data["workload"], "num_requests": 16, "concurrency": 16}
    data["multi_fidelity"] = True
    progress = _Margins()
    outcome = run_study(StudySpec.from_dict(data, cwd=tmp_path), progress=progress)
    assert outcome.trials_done == 2
    assert len(progress.lines) == said
    if said:
        line = progress.lines[0]
        assert "wider margins" in line and line.endswith(calibration_note(get_gpu(gpu)) or "-")


def test_the_terminal_says_the_wider_margins_in_one_servetune_line() -> None:
    import io

    from servetune.study import TerminalProgress

    out = io.StringIO()
    note = screen_for(_spec("A10G"), "vllm").margin_note  # type: ignore[union-attr]
    assert note is not None
    TerminalProgress(out, total=3).screen_margins(note)
    assert out.getvalue() == f"servetune: {note}\n" and out.getvalue().count("\n") == 1


def test_a_real_trials_twin_starts_in_the_real_trials_environment() -> None:
    """TP=2 on an H100 with vLLM 0.19: where the GPU workers' FlashInfer is usable the real server allocates the
    FlashInfer all-reduce fusion workspace, so the screen's twin (and the headroom's simulations) must too."""
    from servetune.planner.comm import FI_ALLREDUCE_FUSION_WORKSPACE_GIB, trial_env
    from servetune.search.headroom import spec_simulator
    from servetune.search.screen import simulated

    spec = StudySpec.from_dict({
        "name": "twin", "model": "llama-3.1-8b", "gpu": {"type": "H100-80GB", "count": 2}, "backend": "vllm",
        "vllm_version": "0.19.0", "workload": {"input_len": 256, "output_len": 32, "num_requests": 16, "concurrency": 8},
        "search_space": {"params": {"max_num_seqs": [8, 32]}},
        "fixed_flags": {"tensor_parallel_size": 2, "max_model_len": 4096}, "storage": {"optuna_url": "memory"}},
        cwd="/tmp")
    flags = {"tensor_parallel_size": 2, "max_model_len": 4096, "max_num_seqs": 8}
    usable, unusable = trial_env(True, True), trial_env(True, False)
    screen = screen_for(spec, "vllm", usable)
    assert screen is not None and screen.comm_env == usable
    twin = simulated(screen, spec, flags)
    without = simulate_flags(spec, flags, comm_env=unusable)
    assert twin.ok and without.ok and twin.memory is not None and without.memory is not None
    assert without.memory.kv_cache - twin.memory.kv_cache == pytest.approx(FI_ALLREDUCE_FUSION_WORKSPACE_GIB, abs=1e-3)
    assert without.kv_cache_tokens > twin.kv_cache_tokens
    assert simulate_flags(spec, flags).kv_cache_tokens == without.kv_cache_tokens  # None: the measured hosts'
    assert spec_simulator(spec, flags, comm_env=usable)(spec.workload).kv_cache_tokens == twin.kv_cache_tokens
