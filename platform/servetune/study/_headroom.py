"""The study's end: the winner's and the runner-up's headroom on the simulator, calibrated as the
study's screen is (:mod:`servetune.search.headroom`); with ``selection.min_headroom``, the winner
chosen for it; on real GPUs, one window of the winner at its first predicted edge. Kept as the
study's user attr ``headroom`` (``servetune best --headroom``)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from servetune.backends import capabilities
from servetune.planner.flags import gpus_needed
from servetune.records import dataset, retry_call
from servetune.search import headroom
from servetune.search.propose import StoredTrial
from servetune.study._dispatch import Collect, Dispatcher, Job
from servetune.study._outcome import HEADROOM_ATTR, ranked_flag_sets, update_best
from servetune.study._state import StudyRun
from servetune.study._tasks import trial_task

#: The pool key of an edge window, apart from trials and repeats.
EDGE_KEY = 2_000_000


def study_headroom(run: StudyRun, dispatcher: Dispatcher[Any]) -> None:
    """Compute, note and store the headroom (and, on real GPUs, measure the winner at its edge)."""
    spec, study = run.spec, run.study
    if not spec.headroom.enabled and study.user_attrs.get(HEADROOM_ATTR):
        # Turned off on a resume: an earlier run's selection must not choose the winner any more.
        retry_call(lambda: study.set_user_attr(HEADROOM_ATTR, None), what="clear the headroom")
        update_best(study, run.outcome)
    if not spec.headroom.enabled or spec.model_profile is None or run.stop.requested:
        return
    started = time.monotonic()
    screen = run.screen
    calibration = {} if screen is None else {"real_over_sim_throughput": screen.ratio, "real_trials": len(screen.ratios)}
    ranked = ranked_flag_sets(study)
    # A simulated study's trial is the simulator's own figure at scale 1: not simulated again.
    told = {t.number: t for t in study.get_trials(deepcopy=False)}
    measured = ({n: StoredTrial.of(told[n]).result(run.backend, spec.vllm_version) for n, _ in ranked}
                if capabilities(run.backend).virtual_time else None)
    result = headroom.study_headroom(spec, ranked, calibration=calibration, measured=measured,
                                     api_cpu_factor=None if screen is None else screen.api_cpu_factor,
                                     comm_env=run.comm_env)
    if result is None:
        return
    run.progress.headroom(result, time.monotonic() - started)
    _store(run, result)
    # A prompt file's texts are sent as written: only its load can be scaled on a real server.
    edge = headroom.first_edge(result.winner, ("load",) if spec.workload.prompt_file else headroom.AXES)
    if (capabilities(run.backend).real_gpus and edge is not None
            and gpus_needed(result.winner.flags) <= dispatcher.pool.total_gpus):
        window = _edge_window(run, dispatcher, result.winner, edge)
        if window is not None:
            _store(run, dataclasses.replace(result, edge_window=window))


def _store(run: StudyRun, result: headroom.StudyHeadroom) -> None:
    summary = result.to_dict()
    retry_call(lambda: run.study.set_user_attr(HEADROOM_ATTR, summary), what="store the headroom")
    run.outcome.headroom = summary
    update_best(run.study, run.outcome)


def _edge_window(run: StudyRun, dispatcher: Dispatcher[Any], winner: headroom.Headroom,
                 edge: headroom.Edge) -> dict[str, Any] | None:
    """One window of the winner on the real engine at its first predicted edge (a start of its
    own, the full window: no early stop), not an Optuna trial; bounded by the trial's own
    startup and stall timeouts. None when no slot could take it any more."""
    spec, number = run.spec, winner.trial_number
    assert edge.first_fail is not None
    run.progress.edge_window(edge)
    name = f"{dataset.trial_dir_name(number or 0)}-edge"
    workload = headroom.scaled_workload(spec.workload, edge.axis, edge.first_fail)
    dispatcher.add(Job(EDGE_KEY, gpus_needed(winner.flags), None,
                       lambda: trial_task(spec, dict(winner.flags), run.trial_dir(name), workload=workload)))
    work = Collect()
    dispatcher.run(work)
    measured = work.results.get(EDGE_KEY)
    return None if measured is None else headroom.edge_window(edge, number, measured, spec.constraints.limits())
