"""A flag set measured again on a pool of its own, once per engine seed: the nightly job's noise
estimate. Not Optuna trials and not recorded."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from servetune.cluster.start import start_pool
from servetune.engines import resolve_backend
from servetune.planner.flags import gpus_needed
from servetune.result import TrialResult
from servetune.search.propose import with_slo_figures
from servetune.spec.schema import StudySpec
from servetune.study._dispatch import Collect, Dispatcher, Job
from servetune.study._tasks import trial_task


def remeasure(spec: StudySpec, flags: Mapping[str, Any], seeds: Sequence[int],
              backend: str | None = None) -> list[TrialResult]:
    """``flags`` measured again once per engine seed (the workload keeps its own seed), on the
    trial pool with the same task settings as the study's trials; the results in seed order, an
    infrastructure failure or a flag set no slot fits left out. Not Optuna trials and not recorded:
    the nightly job's noise estimate."""
    backend = backend or resolve_backend(spec.backend)
    folder = Path(spec.output.runs_dir) / "trials" / spec.name
    need = gpus_needed(flags)
    pool = start_pool(backend, num_gpus=spec.gpu.count, num_cpus=max(2, spec.budget.parallel))
    work = Collect()
    try:
        dispatcher: Dispatcher[None] = Dispatcher(pool, backend)
        for k, seed in enumerate(seeds, start=1):
            dispatcher.add(Job(k, need, None, functools.partial(trial_task, spec, dict(flags), folder / f"remeasure-{k}",
                                                                seed=seed)))
        dispatcher.run(work)
    finally:
        pool.close()
    return [with_slo_figures(spec, flags, work.results[k]) for k in sorted(work.results)
            if not work.results[k].status.is_infrastructure]
