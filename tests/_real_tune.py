"""Reading a real-GPU `servetune tune` kept as a fixture (tests/fixtures/real_*/...): its dataset rows, a
start's server log, its Optuna study, and the spec that ran with its GPU-host model folder read as the
shipped config the folder was built from."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import optuna
import yaml

from servetune.records import dataset
from servetune.spec.schema import StudySpec


def tune_rows(tune: Path) -> list[dict[str, Any]]:
    """The study's Parquet rows, in the order the trials ran."""
    return dataset.read_trials(tune / "dataset").sort_values("timestamp").to_dict("records")


def server_log(tune: Path, trial_folder: str) -> str:
    """One start's vLLM server log (``trials/<folder>/server.log.gz``)."""
    return gzip.decompress((tune / "trials" / trial_folder / "server.log.gz").read_bytes()).decode()


def tune_study(tune: Path, name: str) -> optuna.Study:
    """The study's Optuna record (``optuna.db``)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tune / 'optuna.db'}")


def shipped_spec(spec: Path, model: str) -> StudySpec:
    """``spec`` as it ran, with the GPU host's model folder read as the shipped config ``model``."""
    data = yaml.safe_load(spec.read_text())
    data["model"] = model
    data.pop("serve_model", None)
    return StudySpec.from_dict(data, spec.parent)
