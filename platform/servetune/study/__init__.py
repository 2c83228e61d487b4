"""The Optuna ask-and-tell driver: proposes flag sets, runs them on the trial pool, tells the results.

One driver process owns the Optuna storage, the MLflow runs and the Parquet dataset (it is their
only writer, which keeps SQLite safe). Trials run in the pool's workers (Ray actors or local
processes), as many at once as free GPUs and ``budget.parallel`` allow. Every result is told with
the same constraint keys on every trial, as Optuna 5 requires (``trial.set_constraint``; a value
<= 0 is feasible):

- ``preemptions``: preemptions minus the allowed count;
- ``startup``: 1 when the engine did not serve (startup OOM, KV cache too small, crash, invalid
  flags), else -1. A failed startup is told as COMPLETE with this constraint violated, so the
  sampler learns where the OOM region is (a FAIL trial would be ignored by the samplers);
- ``p99_ttft_ms`` / ``p99_itl_ms``: the measured p99 minus the limit, when the spec sets one.

With ``prescreen`` on (the default), each proposal first goes through the memory planner
(:func:`servetune.search.propose.prescreen`): a predicted startup failure is told as a ``pruned`` trial
(infeasible, the prediction in MLflow and the dataset) without being dispatched, and a fresh study
starts from the preemption prior's informed points. The ask / pre-screen / tell logic lives in
:mod:`servetune.search.propose`, shared with the search-efficiency benchmark.

Example::

    from servetune.spec import load_spec
    from servetune.study import run_study
    outcome = run_study(load_spec("jobs/quickstart.yaml"))
    print(outcome.best_command)
"""

from __future__ import annotations

from servetune.search.propose import FEASIBLE, INFEASIBLE, constraint_values, objective_values
from servetune.study._dispatch import interrupted_at_once
from servetune.study._driver import run_study
from servetune.study._open import FINISHED, make_sampler, resume_is_noop
from servetune.study._outcome import HEADROOM_ATTR, StudyOutcome, best_trial, ranked_flag_sets
from servetune.study._progress import StudyProgress, TerminalProgress
from servetune.study._recorder import NightRecords, record_night
from servetune.study._remeasure import remeasure

__all__ = ["StudyOutcome", "interrupted_at_once", "run_study", "remeasure", "make_sampler", "constraint_values", "objective_values", "best_trial",
           "INFEASIBLE", "FEASIBLE", "ranked_flag_sets", "HEADROOM_ATTR", "FINISHED", "resume_is_noop",
           "StudyProgress", "TerminalProgress", "NightRecords", "record_night"]
