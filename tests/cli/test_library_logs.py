"""While a study runs, the libraries' INFO lines go to the study's log file; real warnings still show."""

from __future__ import annotations

import logging
from pathlib import Path

import optuna
import pytest

from servetune.cli._logs import libraries_to_file


def test_library_info_goes_to_the_file_and_warnings_to_the_terminal(tmp_path: Path,
                                                                    capfd: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "logs" / "s.log"
    optuna_handlers = list(logging.getLogger("optuna").handlers)
    with libraries_to_file(log):
        # Through Optuna's own logging call, as its storage does it.
        optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path}/o.db")
        logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
        logging.getLogger("ray._private.authentication.authentication_token_setup").warning(
            "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        logging.getLogger("mlflow.tracking").warning("the artifact store refused the upload")
        logging.getLogger("servetune.records.tracking").warning("MLflow at http://x is unreachable: trial buffered")
    out, err = capfd.readouterr()
    terminal = out + err
    text = log.read_text()
    for line in ("A new study created in RDB with name: s", "Creating initial MLflow database tables",
                 "Token authentication is enabled", "the artifact store refused", "MLflow at http://x is unreachable"):
        assert line in text
    assert "A new study created" not in terminal and "Creating initial MLflow" not in terminal
    assert "Token authentication" not in terminal  # a notice, not a problem
    assert "the artifact store refused the upload" in terminal  # a real warning of a library
    assert "MLflow at http://x is unreachable" in terminal  # servetune's own warning
    # Afterwards the libraries print as they did before.
    assert logging.getLogger("optuna").handlers == optuna_handlers
    assert not any(getattr(h, "baseFilename", None) == str(log) for h in logging.getLogger().handlers)


def test_a_library_imported_during_the_study_still_logs_to_the_file(tmp_path: Path) -> None:
    """MLflow installs its terminal handler at import; imported inside the study (as the driver now
    does, only when it needs it), its INFO lines still go to the file, not the terminal."""
    import subprocess
    import sys

    log = tmp_path / "s.log"
    code = ("import logging, sys; from pathlib import Path; from servetune.cli._logs import libraries_to_file\n"
            "assert 'mlflow' not in sys.modules\n"
            f"with libraries_to_file(Path({str(log)!r})):\n"
            "    import mlflow\n"
            "    logging.getLogger('mlflow.store.db.utils').info('Creating initial MLflow database tables...')\n"
            "    assert mlflow.__spec__.loader is not None\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Creating initial MLflow" in log.read_text()
    assert "Creating initial MLflow" not in proc.stdout + proc.stderr
