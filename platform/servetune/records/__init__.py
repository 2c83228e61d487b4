"""The records: where a trial's outcome is written down, and read back.

* :mod:`.tracking`: MLflow, one parent run per study and one child per trial (secrets redacted,
  an offline buffer while the server is down);
* :mod:`.dataset`: the Parquet dataset of every trial, partitioned by GPU type, model and study;
* :mod:`.report`: plots and the Markdown report from the dataset;
* the Optuna storage for a URL with every call retried (``open_storage``).

Only the driver writes here (one writer: SQLite stays safe, PostgreSQL works the same way), and
one driver per study: :mod:`.lease` keeps a second one out. The
records know results and flags, not the spec or the search; the replay engine reads them back.
"""

from servetune.records._retry import retry_call
from servetune.records._storage import RetryingStorage, open_storage
from servetune.records.dataset import METRIC_COLUMNS, append_trials, read_trials, trial_row
from servetune.records.report import write_report
from servetune.records.tracking import StudyTracker, TrackingError
from servetune.records.trial_record import Prediction, Screen, TrialRecord

__all__ = ["TrialRecord", "Prediction", "Screen", "StudyTracker", "TrackingError", "read_trials", "append_trials", "trial_row", "METRIC_COLUMNS",
           "write_report", "open_storage", "RetryingStorage", "retry_call"]
