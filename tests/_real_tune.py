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
from servetune.search.informed import informed_starts
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


def recommended_command(tune: Path) -> str:
    """The ``vllm serve`` command the study printed as its recommendation (``study.log``)."""
    log = (tune / "study.log").read_text()
    return log.split("servetune: run it with:\n", 1)[1].splitlines()[0].strip()


def memory_pair(row: dict[str, Any]) -> dict[str, float | int]:
    """A dataset row's memory-pair flags, named as :func:`servetune.search.informed.informed_starts` names them."""
    return {"gpu_memory_utilization": float(row["flag_gpu_memory_utilization"]),
            "max_num_seqs": int(row["flag_max_num_seqs"])}


#: A trial's memory-pair flags (:func:`memory_pair`).
MemoryPair = dict[str, float | int]


def informed_then_defaults(spec: StudySpec, model: Any, gpu: Any,
                           rows: list[dict[str, Any]]) -> tuple[dict[str, Any], MemoryPair, MemoryPair]:
    """The planner's first informed start for ``spec`` today, and the memory pairs of the study's first two
    trials (which ran the informed start, then vLLM's defaults)."""
    starts = informed_starts(spec.search_space, spec.fixed_flags, model, gpu, spec.workload, spec.vllm_version)
    return starts[0], memory_pair(rows[0]), memory_pair(rows[1])

