"""The records: where a trial's outcome is written down, and read back.

* :mod:`.tracking`: MLflow, one parent run per study and one child per trial (written as handed
  over: the study's recorder redacted it; an offline buffer while the server is down);
* :mod:`.dataset`: the Parquet dataset of every trial, partitioned by GPU type, model and study;
* :mod:`.report`: plots and the Markdown report from the dataset;
* the Optuna storage for a URL with every call retried (``open_storage``).

Only the driver writes here (one writer: SQLite stays safe, PostgreSQL works the same way), and
one driver per study: :mod:`.lease` keeps a second one out. The
records know results and flags, not the spec or the search; the replay engine reads them back.
"""

from typing import TYPE_CHECKING

from servetune.lazy import lazy_face

if TYPE_CHECKING:
    from servetune.records._retry import retry_call
    from servetune.records._storage import RetryingStorage, open_storage, open_storage_read_only
    from servetune.records.dataset import METRIC_COLUMNS, append_trials, read_trials, trial_row
    from servetune.records.report import write_report
    from servetune.records.tracking import StudyTracker, TrackingError
    from servetune.records.trial_record import Prediction, Screen, TrialRecord

__all__ = ["TrialRecord", "Prediction", "Screen", "StudyTracker", "TrackingError", "read_trials", "append_trials",
           "trial_row", "METRIC_COLUMNS", "write_report", "open_storage", "open_storage_read_only", "RetryingStorage",
           "retry_call"]

#: Where each public name is defined, imported on first use (PEP 562): ``servetune best`` opens the
#: Optuna storage without importing MLflow, and the driver's own imports pay only for what it uses.
_DEFINED_IN = {
    "retry_call": "servetune.records._retry",
    "RetryingStorage": "servetune.records._storage",
    "open_storage": "servetune.records._storage",
    "open_storage_read_only": "servetune.records._storage",
    "METRIC_COLUMNS": "servetune.records.dataset",
    "append_trials": "servetune.records.dataset",
    "read_trials": "servetune.records.dataset",
    "trial_row": "servetune.records.dataset",
    "write_report": "servetune.records.report",
    "StudyTracker": "servetune.records.tracking",
    "TrackingError": "servetune.records.tracking",
    "Prediction": "servetune.records.trial_record",
    "Screen": "servetune.records.trial_record",
    "TrialRecord": "servetune.records.trial_record",
}

__getattr__, __dir__ = lazy_face(__name__, _DEFINED_IN, __all__)
