"""A local MLflow store is created whole or not at all: the creation really killed at several
points, half-built stores of the kind MLflow's in-place creation left, then a tune there."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from mlflow import MlflowClient

from servetune.records import StudyTracker
from servetune.records._mlflow_store import ensure_sqlite_store, store_state
from servetune.spec.schema import StudySpec
from servetune.study import run_study

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "platform"), "MLFLOW_DISABLE_TELEMETRY": "true"}

_OPEN = "import sys; from servetune.records import StudyTracker; StudyTracker(sys.argv[1], 'exp'); print('opened')"
# What servetune did before: MLflow creates and migrates the final file in place.
_IN_PLACE = "import sys; from mlflow import MlflowClient; MlflowClient(sys.argv[1]).search_experiments()"


def _kill_when(code: str, db: Path, appears: Path, after_s: float) -> bool:
    """Run ``code`` on ``db``'s store in a process; SIGKILL it ``after_s`` after ``appears`` exists.
    Returns whether the process was still running when killed."""
    proc = subprocess.Popen([sys.executable, "-c", code, f"sqlite:///{db}"], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not appears.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(after_s)
        running = proc.poll() is None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    return running


def _usable(db: Path) -> None:
    """servetune opens the store and writes a run into it."""
    tracker = StudyTracker(f"sqlite:///{db}", "exp")
    run = tracker.start_study("s", {"a": 1}, {"gpu_type": "H200"})
    tracker.end("FINISHED")
    assert MlflowClient(f"sqlite:///{db}").get_run(run).info.status == "FINISHED"


@pytest.mark.slow
def test_a_creation_killed_at_any_point_leaves_no_store_or_a_whole_one(tmp_path: Path) -> None:
    seen = set()
    for i, after_s in enumerate((0.0, 2.0)):
        db = tmp_path / f"k{i}" / "mlflow.db"
        db.parent.mkdir()
        assert _kill_when(_OPEN, db, db.with_name("mlflow.db.creating"), after_s) or after_s > 0
        state = store_state(db)
        seen.add(state)
        assert state in ("missing", "complete"), (after_s, state, os.listdir(db.parent))
        _usable(db)
    assert "missing" in seen  # at least one kill landed mid-creation


def test_half_built_stores_without_runs_are_set_aside_and_built_again(tmp_path: Path) -> None:
    from mlflow.store.db.base_sql_model import Base
    from mlflow.store.tracking.dbmodels import models  # noqa: F401 - registers the tables on Base

    empty = tmp_path / "empty" / "mlflow.db"  # killed right after SQLite created the file
    empty.parent.mkdir()
    empty.touch()
    unstamped = tmp_path / "unstamped" / "mlflow.db"  # tables, no migration recorded
    unstamped.parent.mkdir()
    engine = sa.create_engine(f"sqlite:///{unstamped}")
    Base.metadata.tables["experiments"].create(engine)
    engine.dispose()
    for db in (empty, unstamped):
        assert store_state(db) == "incomplete"
        ensure_sqlite_store(f"sqlite:///{db}")
        assert store_state(db) == "complete"
        assert [p.name for p in db.parent.glob("mlflow.db.incomplete-*")]  # set aside, not deleted
        _usable(db)


def _stamp(db: Path, revision: str) -> None:
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    engine.dispose()


def test_a_store_killed_mid_migration_is_set_aside_and_an_older_one_with_experiments_kept(tmp_path: Path) -> None:
    """MLflow migrating in place, killed between two migrations: every table there, a revision short
    of the head stamped, nothing in it (MLflow adds its default experiment after the last step).
    Seen when a loaded machine delayed the kill's point. An older MLflow's store with an experiment
    in it is left to ``mlflow db upgrade``."""
    older = "75868b020152"  # one of MLflow's intermediate revisions (the one such a kill left)
    killed = tmp_path / "killed" / "mlflow.db"
    killed.parent.mkdir()
    ensure_sqlite_store(f"sqlite:///{killed}")
    _stamp(killed, older)
    assert store_state(killed) == "incomplete"
    ensure_sqlite_store(f"sqlite:///{killed}")
    assert store_state(killed) == "complete" and [p.name for p in killed.parent.glob("mlflow.db.incomplete-*")]
    _usable(killed)
    kept = tmp_path / "kept" / "mlflow.db"
    kept.parent.mkdir()
    _usable(kept)  # a store with its default experiment and a run ...
    engine = sa.create_engine(f"sqlite:///{kept}")
    with engine.begin() as conn:
        for table in ("tags", "params", "latest_metrics", "metrics", "runs"):  # ... now experiments only,
            conn.execute(sa.text(f"DELETE FROM {table}"))                      # at an older revision
    engine.dispose()
    _stamp(kept, older)
    assert store_state(kept) == "in use"
    ensure_sqlite_store(f"sqlite:///{kept}")
    assert not list(kept.parent.glob("mlflow.db.incomplete-*"))


@pytest.mark.slow
def test_in_place_creations_killed_then_a_tune_runs_there(tmp_path: Path) -> None:
    """MLflow's own in-place creation (what servetune did before) killed at several points: some
    leave a store MLflow cannot open again ("index ... already exists"); servetune opens each, and
    a study runs in one of them."""
    dbs = []
    for i, after_s in enumerate((0.5, 2.0)):
        db = tmp_path / f"p{i}" / "mlflow.db"
        db.parent.mkdir()
        _kill_when(_IN_PLACE, db, db, after_s)
        dbs.append(db)
    for db in dbs[1:]:
        _usable(db)
    runs = dbs[0].parent
    spec = StudySpec.from_dict({
        "name": "after-kill", "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB", "count": 1},
        "workload": {"input_len": 512, "output_len": 256, "num_requests": 32, "concurrency": 16, "seed": 1},
        "objective": {"metric": "output_throughput"},
        "search_space": {"params": {"max_num_seqs": {"type": "categorical", "choices": [16, 64]}}},
        "budget": {"trials": 2, "parallel": 1}, "backend": "sim", "seed": 1,
        "tracking": {"mlflow_uri": f"sqlite:///{dbs[0]}", "experiment": "after-kill"},
        "output": {"runs_dir": str(runs), "dataset_dir": str(runs / "dataset")},
    })
    outcome = run_study(spec, out=io.StringIO())
    assert outcome.trials_done == 2
    client = MlflowClient(f"sqlite:///{dbs[0]}")
    exp = client.get_experiment_by_name("after-kill")
    children = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("servetune.role") == "trial"]
    assert len(children) == 2
