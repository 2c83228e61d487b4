"""Ask / pre-screen / tell in process, and the search-efficiency benchmark's core on a tiny landscape."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import pytest

from servetune.engines.replay import Landscape
from servetune.result import TrialResult, TrialStatus
from servetune.search.propose import prescreen, propose, run_local, tell, warm_compiles
from servetune.spec.schema import StudySpec

REPO = Path(__file__).resolve().parents[2]


def _spec(**extra: Any) -> StudySpec:
    return StudySpec.from_dict({
        "name": "search", "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB"},
        "workload": {"input_len": 512, "output_len": 1024, "num_requests": 64, "concurrency": 192},
        "search_space": {"params": {"gpu_memory_utilization": [0.3, 0.35, 0.6, 0.95],
                                    "max_num_seqs": [16, 64, 256]}},
        "fixed_flags": {"max_model_len": 4096}, "storage": {"optuna_url": "memory"},
        "constraints": {"max_preemptions": 0, "p99_ttft_ms": 5000}, **extra}, cwd="/tmp")


def test_prescreen_prunes_predicted_failures_with_the_prediction() -> None:
    spec = _spec()
    refused, plan = prescreen(spec, {"gpu_memory_utilization": 0.3, "max_num_seqs": 16, "max_model_len": 4096})
    assert refused is not None and plan is not None and not plan.fits
    assert refused.status is TrialStatus.PRUNED and refused.cause.startswith("predicted startup_oom: ")
    assert refused.memory is not None and refused.memory.kv_cache < 0 and refused.metrics()["mem_weights_gib"] > 14
    ok, plan = prescreen(spec, {"gpu_memory_utilization": 0.95, "max_num_seqs": 16, "max_model_len": 4096})
    assert ok is None and plan is not None and plan.kv_cache_tokens > 100_000
    bad, _ = prescreen(spec, {"max_num_seqs": 512, "max_num_batched_tokens": 256, "max_model_len": 4096})
    assert bad is not None and bad.status is TrialStatus.INVALID_CONFIG


def test_prescreen_runs_flags_vllm_starts_but_the_planner_does_not_model_on_a_real_gpu() -> None:
    # Prefix caching on a Mamba hybrid: vLLM serves it (Mamba cache mode 'align' / 'all'), the planner
    # does not model every mode, so the trial is not called invalid where a real GPU can run it; the
    # simulated engine, which needs the plan, cannot.
    # (read up to vLLM 0.28; 0.29's 'align' mode holds prefill checkpoint blocks the planner does not count).
    flags = {"gpu_memory_utilization": 0.9, "max_num_seqs": 64, "max_model_len": 4096, "enable_prefix_caching": True}
    spec = _spec(model="granite-4.0-h-tiny", gpu={"type": "H100-80GB"}, backend="vllm", vllm_version="0.29.0")
    modelled = prescreen(_spec(model="granite-4.0-h-tiny", gpu={"type": "H100-80GB"}, backend="vllm"), flags)
    assert modelled[0] is None and modelled[1] is not None and modelled[1].fits  # 0.26: Mamba cache mode 'all'

    planned = prescreen(spec, {**flags, "enable_prefix_caching": False})
    assert planned[0] is None and planned[1] is not None and planned[1].fits
    assert prescreen(spec, flags) == (None, None)
    refused, _ = prescreen(spec, flags, backend="sim")
    assert refused is not None and refused.status is TrialStatus.INVALID_CONFIG
    assert refused.cause.startswith("not simulated: enable_prefix_caching: ")
    bad, _ = prescreen(spec, {**flags, "max_num_seqs": 512, "max_num_batched_tokens": 256})
    assert bad is not None and bad.status is TrialStatus.INVALID_CONFIG  # vLLM's own refusals stay refusals


def _evaluate(flags: dict[str, Any]) -> TrialResult:
    if flags["gpu_memory_utilization"] < 0.5:
        raise AssertionError(f"a doomed configuration reached the engine: {flags}")
    preempts = flags["max_num_seqs"] > 64
    return TrialResult(TrialStatus.OK, output_throughput=float(flags["max_num_seqs"]), preemptions=int(preempts) * 5,
                       ttft_ms=None, wall_s=100.0)


def test_run_local_prunes_without_evaluating_and_tells_the_same_constraints() -> None:
    spec = _spec()
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    told = run_local(spec, study, _evaluate, max_dispatched=8)
    assert sum(t.dispatched for t in told) == 8
    assert told[0].flags["gpu_memory_utilization"] == 0.95 and told[0].flags["max_num_seqs"] == 64  # informed start
    pruned = [t for t in told if t.result.status is TrialStatus.PRUNED]
    assert pruned and not any(t.dispatched for t in pruned)
    trials = study.get_trials(deepcopy=False)
    assert all(set(t.constraints) == {"startup", "preemptions", "p99_ttft_ms"} for t in trials)
    for t, r in zip(trials, told):
        assert t.user_attrs["status"] == r.result.status.value
        if r.result.status is TrialStatus.PRUNED:
            assert all(c > 0 for c in t.constraints.values()) and t.values == [0.0]
            assert t.user_attrs["predicted_failure"] == "startup_oom"


def test_the_warm_compile_view_kept_on_tell_is_the_one_read_from_the_study() -> None:
    spec = _spec()
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=2))
    warm = warm_compiles(spec, study)
    assert warm is not None and not warm.keys
    for _ in range(10):
        p = propose(spec, study, 1, warm=warm)
        tell(spec, study, p.trial, p.refused or _evaluate(p.flags), warm=warm)
        assert warm.keys == warm_compiles(spec, study).keys  # what a fresh read of the study finds
    assert warm.keys and any(t.user_attrs["predicted_compile_cache_warm"] for t in study.get_trials())
    assert all(t.user_attrs["flags"]["max_model_len"] == 4096 for t in study.get_trials())  # written at the tell


def test_prescreen_off_launches_everything() -> None:
    spec = _spec(prescreen=False)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    seen: list[dict[str, Any]] = []
    told = run_local(spec, study, lambda f: seen.append(f) or TrialResult(TrialStatus.STARTUP_OOM, wall_s=60.0),
                     max_dispatched=6)
    assert len(told) == len(seen) == 6 and all(t.dispatched for t in told)


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("search_efficiency", REPO / "benchmarks" / "search_efficiency.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["search_efficiency"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_benchmark_refreshes_the_pages_tables_and_keeps_its_prose(tmp_path: Path) -> None:
    """search_efficiency.py writes docs/search-efficiency.md from a template only when there is no
    page: a rerun puts its tables into the page in order and keeps the prose written since (the
    template's prose had gone stale, e.g. it said no calibration saw the 14B grid). Tables that do
    not pair up with the page's (another count or header) leave the page as it was."""
    bench = _bench()
    page = tmp_path / "page.md"
    generated = "# T\nTemplate prose.\n\n| cell | x |\n|---|---|\n| a | 2 |\n\nMore template.\n\n| k |\n|---|\n| 9 |\n"
    bench.write_doc_text(page, generated)  # no page yet: the template as it is
    assert page.read_text() == generated
    page.write_text("# T\nHand-written prose, true to the tables.\n\n| cell | x |\n|---|---|\n| a | 1 |\n"
                    "\nWhat it shows: a is 1.\n\n| k |\n|---|\n| 8 |\n")
    bench.write_doc_text(page, generated)
    assert page.read_text() == ("# T\nHand-written prose, true to the tables.\n\n| cell | x |\n|---|---|\n| a | 2 |\n"
                                "\nWhat it shows: a is 1.\n\n| k |\n|---|\n| 9 |\n")
    before = page.read_text()
    with pytest.raises(ValueError, match="do not pair up"):
        bench.write_doc_text(page, "| cell | x |\n|---|---|\n| a | 3 |\n")  # one table where the page has two
    with pytest.raises(ValueError, match="do not pair up"):
        bench.write_doc_text(page, "| cell | y |\n|---|---|\n| a | 3 |\n\n| k |\n|---|\n| 9 |\n")  # another header
    assert page.read_text() == before


def test_benchmark_core_loop_on_a_tiny_landscape() -> None:
    bench = _bench()
    cell = bench.CELLS[0]
    spec = bench.cell_spec(cell, prescreen=False)
    model_spec = _spec()
    rows = []
    for point in spec.search_space.grid():  # a synthetic landscape over the benchmark's grid
        u, s = point["gpu_memory_utilization"], point["max_num_seqs"]
        fits = prescreen(model_spec, {**point, "max_model_len": 4096})[0] is None
        rows.append({"flag_gpu_memory_utilization": u, "flag_max_num_seqs": s, "flag_max_model_len": 4096,
                     "status": "ok" if fits else "startup_oom", "output_throughput": float(s) if fits else None,
                     "preemptions": float(s > 64) if fits else None, "startup_s": 75.0 if fits else 60.0,
                     "duration_s": 25.0 if fits else None})
    land = Landscape(pd.DataFrame(rows), "tiny")
    assert bench.grid_best(land.frame) == 64.0
    grid = bench.search_grid(land, spec, seed=0)
    assert grid.launched == len(rows) and grid.best[-1] == 64.0 and grid.failure_share(len(rows)) > 0
    full_cost = grid.cost_s[-1]
    servetune = bench.search_optuna(land, bench.cell_spec(cell, seed=0), seed=0, max_trials=12, stop_at=64.0)
    tpe = bench.search_optuna(land, bench.cell_spec(cell, prescreen=False, seed=0), seed=0, max_trials=12,
                              informed=False)
    assert servetune.failed_s[-1] == 0.0 and servetune.pruned >= 0
    reach = servetune.cost_to_reach(64.0)
    assert reach is not None and reach < 0.25 * full_cost
    assert tpe.launched == 12 and tpe.pruned == 0


# -- early stopping: the rule the driver hands to a real trial ------------------------------------

def test_early_stop_rule_follows_the_spec_and_the_best_so_far() -> None:
    from servetune.engines.early_stop import EarlyStop
    from servetune.search.propose import early_stop_rule as rule_for

    spec = _spec()
    assert rule_for(spec, None) == EarlyStop(max_preemptions=0, best_throughput=None)
    assert rule_for(spec, 1234.0) == EarlyStop(max_preemptions=0, best_throughput=1234.0)
    assert rule_for(_spec(early_stopping=False), 1234.0) is None
    latency_first = _spec(objective={"pareto": ["ttft_p99_ms", "output_throughput"]})
    assert rule_for(latency_first, 1234.0) == EarlyStop(max_preemptions=0, best_throughput=None)


def test_early_stop_verdicts() -> None:
    from servetune.engines.early_stop import EarlyStop

    rule = EarlyStop(max_preemptions=2, best_throughput=1000.0)
    assert rule.verdict(preemptions=2, output_tokens=0, elapsed_s=1, answered=0, total=10) is None
    assert rule.verdict(preemptions=3, output_tokens=0, elapsed_s=1, answered=0, total=10).startswith("preemptions")
    # too early to judge the rate, then certainly below, then possibly above (margin 1.6)
    assert rule.verdict(preemptions=0, output_tokens=100, elapsed_s=1, answered=2, total=10) is None
    assert rule.verdict(preemptions=0, output_tokens=600, elapsed_s=1, answered=3, total=10).startswith("throughput")
    assert rule.verdict(preemptions=0, output_tokens=700, elapsed_s=1, answered=3, total=10) is None
    assert rule.verdict(preemptions=0, output_tokens=10, elapsed_s=1, answered=10, total=10) is None  # finished


def test_spec_switches_validate_with_a_fix() -> None:
    import pytest

    from servetune.errors import SpecError

    spec = _spec()
    assert (spec.early_stopping, spec.warm_start, spec.baseline_trial, spec.multi_fidelity) == (True, True, True, None)
    assert spec.multi_fidelity_on("vllm") and spec.multi_fidelity_on("replay") and not spec.multi_fidelity_on("sim")
    assert not _spec(multi_fidelity=False).multi_fidelity_on("vllm")
    assert _spec(multi_fidelity=True).multi_fidelity_on("sim")
    assert (spec.budget.confirm_top, spec.budget.confirm_repeats) == (0, 2)
    for key, bad in (("early_stopping", "yes"), ("warm_start", 1), ("baseline_trial", None), ("multi_fidelity", "on")):
        with pytest.raises(SpecError) as err:
            _spec(**{key: bad})
        assert err.value.field == key and key in err.value.fix
    with pytest.raises(SpecError) as err:
        _spec(budget={"trials": 4, "confirm_repeats": 0})
    assert err.value.field == "budget.confirm_repeats"
    shown = spec.to_dict()
    assert (shown["early_stopping"], shown["multi_fidelity"], shown["warm_start"], shown["baseline_trial"]) == \
        (True, "auto", True, True)


# -- multi-fidelity: the calibrated simulator screens proposals (servetune.search.screen) ---------------

def test_sim_screen_learns_the_real_to_sim_ratio_and_prunes_only_clear_losers() -> None:
    from servetune.search.screen import screen_for

    bench = _bench()
    cell = bench.CELLS[0]
    path = bench.landscape_path(cell)
    spec = bench.cell_spec(cell, sampler="random", seed=3, replay_file=path)
    land = Landscape.load(path)

    def real(flags: dict[str, Any]) -> TrialResult:  # "real" vLLM: 30% slower than the simulator says
        r = land.result(flags)
        if r.output_throughput is not None:
            r.output_throughput *= 0.7
        return r

    screen = screen_for(spec, "replay")
    assert screen is not None and screen_for(spec, "sim") is None
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=3))
    told = run_local(spec, study, real, max_dispatched=12, informed=False, screen=screen)
    screened = [t for t in told if (t.result.cause or "").startswith("sim_screen")]
    assert screened and not any(t.dispatched for t in screened)
    assert all(t.result.status is TrialStatus.PRUNED for t in screened)
    assert screen.ratio is not None and abs(screen.ratio - 0.7) < 0.02
    assert screen.screened <= 0.5 * screen.seen
    best = max(t.result.output_throughput or 0 for t in told if t.dispatched and not t.result.preemptions)
    for t in screened:  # what the landscape says each screened proposal would have measured
        truth = real(t.flags)
        assert (truth.preemptions or 0) > 0 or (truth.output_throughput or 0) < best, (t.flags, t.result.cause)
    attrs = {t.number: t.user_attrs for t in study.get_trials(deepcopy=False)}
    assert all("output_throughput" in attrs[t.number]["sim_prediction"] for t in screened)


def test_sim_screen_is_bounded_and_distrusts_a_contradicted_preemption_verdict() -> None:
    from servetune.search.screen import SimScreen

    screen = SimScreen(max_preemptions=0, num_requests=100, throughput_objective=True)
    preempting = TrialResult(TrialStatus.OK, output_throughput=1000.0, preemptions=40)
    assert screen.verdict(preempting, best=None) is None  # the bound: half of 1 proposal is 0
    assert screen.verdict(preempting, best=None).startswith("sim_screen: 40 preemptions")
    mild = TrialResult(TrialStatus.OK, output_throughput=1000.0, preemptions=10)
    assert screen.verdict(mild, best=None) is None  # 10% of the requests: not clear before confirmation
    screen.observe(preempting, TrialResult(TrialStatus.OK, output_throughput=900.0, preemptions=12))
    assert screen.verdict(mild, best=None) is None or screen.screened <= 0.5 * screen.seen
    screen.observe(mild, TrialResult(TrialStatus.OK, output_throughput=900.0, preemptions=0))  # contradicted
    for _ in range(4):
        assert screen.verdict(preempting, best=None) is None


def test_a_resumed_screen_recalibrates_from_the_measured_trials() -> None:
    from servetune.search.screen import recalibrate, screen_for, simulate_flags

    bench = _bench()
    cell = bench.CELLS[0]
    spec = bench.cell_spec(cell, replay_file=bench.landscape_path(cell))
    flags = {"gpu_memory_utilization": 0.9, "max_num_seqs": 64, "max_model_len": 4096}
    sim = simulate_flags(spec, flags)
    real = TrialResult(TrialStatus.OK, output_throughput=0.8 * (sim.output_throughput or 0), preemptions=0)
    screen = screen_for(spec, "replay")
    assert screen is not None and recalibrate(screen, spec, [(flags, real)]) == 1
    assert screen.ratio is not None and abs(screen.ratio - 0.8) < 1e-9


def test_the_screen_reads_the_hosts_api_cpu_factor_off_the_first_real_trial() -> None:
    """The first real trial that measured its API server's CPU sets the host factor (real over
    simulated ``api_server_cpu_s``); its ratio is taken against its twin simulated at that factor,
    every later simulation runs with it, and a resumed study's screen reads the same factor. A
    later trial does not move it; an implausible one, or several API servers, never set it."""
    from servetune.search.screen import learn, recalibrate, screen_for, simulate_flags, simulated

    bench = _bench()
    cell = bench.CELLS[0]
    spec = bench.cell_spec(cell, replay_file=bench.landscape_path(cell))
    first = {"gpu_memory_utilization": 0.9, "max_num_seqs": 64, "max_model_len": 4096}
    other = {"gpu_memory_utilization": 0.9, "max_num_seqs": 32, "max_model_len": 4096}
    sim = simulate_flags(spec, first)
    assert sim.api_server_cpu_s
    real = TrialResult(TrialStatus.OK, output_throughput=0.9 * (sim.output_throughput or 0), preemptions=0,
                       api_server_cpu_s=1.5 * sim.api_server_cpu_s, completed=sim.completed, failed=0)
    screen = screen_for(spec, "replay")
    assert screen is not None
    learn(screen, spec, first, sim, real)
    assert screen.api_cpu_factor == pytest.approx(1.5, abs=1e-4)
    at_host = simulate_flags(spec, first, api_cpu_factor=screen.api_cpu_factor)
    assert screen.ratios == [pytest.approx(real.output_throughput / at_host.output_throughput)]
    # Every later simulation runs at the factor: its API server's CPU scales with it, up to the
    # few SSE chunks a slower loop merges differently (under 1e-6 of it in this trial).
    assert simulated(screen, spec, other).api_server_cpu_s == pytest.approx(
        screen.api_cpu_factor * simulate_flags(spec, other).api_server_cpu_s, rel=1e-4)
    twice = TrialResult(TrialStatus.OK, output_throughput=real.output_throughput, preemptions=0,
                        api_server_cpu_s=3 * sim.api_server_cpu_s, completed=sim.completed, failed=0)
    learn(screen, spec, first, simulated(screen, spec, first), twice)
    assert screen.api_cpu_factor == pytest.approx(1.5, abs=1e-4) and len(screen.ratios) == 2

    resumed = screen_for(spec, "replay")
    assert resumed is not None and recalibrate(resumed, spec, [(first, real)]) == 1
    assert resumed.api_cpu_factor == screen.api_cpu_factor and resumed.ratios == screen.ratios[:1]

    cut = dataclasses.replace(real, early_stopped="throughput: at most ...", api_server_cpu_s=0.3 * sim.api_server_cpu_s)
    for flags, measured in ((first, dataclasses.replace(real, api_server_cpu_s=10 * sim.api_server_cpu_s)),
                            ({**first, "api_server_count": 2}, real), (first, cut),
                            (first, dataclasses.replace(real, completed=(sim.completed or 0) - 1, failed=1))):
        fresh = screen_for(spec, "replay")
        assert fresh is not None
        learn(fresh, spec, flags, sim, measured)
        assert fresh.api_cpu_factor is None, measured
