"""The search: what the study asks for next and what it tells Optuna, without Ray or MLflow.

* :mod:`.propose`: ask, the static rules and the memory-planner pre-screen; tell (objective and
  constraints, the same keys on every trial); the early-stop rule of the next trial;
* :mod:`.informed`, :mod:`.warmstart`: the trials a fresh study enqueues first (informed starts
  from the preemption prior, warm starts from earlier studies, the baseline);
* :mod:`.screen`: multi-fidelity, the calibrated simulator screening clear losers;
* :mod:`.confirm`: the confirmation statistics of the top configurations;
* :mod:`.headroom`: how much more load or longer prompts a flag set takes before it preempts or
  breaks a latency target (the winner's headroom at a study's end, ``selection.min_headroom``).

The driver (:mod:`servetune.study`) and the search-efficiency benchmark share these pieces.
"""

from servetune.search.confirm import Choice, Confirmed
from servetune.search.headroom import Edge, ErrorBand, Headroom, StudyHeadroom, error_band, find_edges, study_headroom
from servetune.search.informed import informed_starts
from servetune.search.propose import FEASIBLE, INFEASIBLE, Proposal, StoredTrial, early_stop_rule, prescreen, run_local, tell
from servetune.search.screen import SimScreen, screen_for
from servetune.search.warmstart import WarmStart, baseline_flags, fit_to_space, warm_start_flags, warm_starts

# ``propose`` and ``confirm`` are modules here; their functions of the same name are reached through
# them (servetune.search.propose.propose), so that the package attribute stays the module.
__all__ = ["Proposal", "StoredTrial", "prescreen", "tell", "early_stop_rule", "run_local", "FEASIBLE", "INFEASIBLE",
           "informed_starts", "WarmStart", "warm_starts", "warm_start_flags", "baseline_flags", "fit_to_space",
           "SimScreen", "screen_for", "Confirmed", "Choice", "Headroom", "StudyHeadroom", "Edge", "ErrorBand",
           "find_edges", "study_headroom", "error_band"]
