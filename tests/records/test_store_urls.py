"""Store URLs are built with SQLAlchemy's URL builder, never pasted: a folder name cannot turn into
a URL query that points Optuna or MLflow at another file.

Before, ``output.runs_dir: "victim.db?x"`` beside an SQLite ``victim.db`` gave
``sqlite:///.../victim.db?x/optuna.db``, which SQLAlchemy reads as the database ``victim.db`` with a
query: Optuna's and MLflow's tables were written into ``victim.db`` (its bytes changed, 22 tables
added, and the study ended in an alembic traceback).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sqlalchemy.engine import make_url

from servetune.records._storage import postgres_url
from servetune.spec.schema import StudySpec, sqlite_url


REPO = Path(__file__).resolve().parents[2]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", ["victim.db?x", "a#b", "100%", "sp ace", "q?mode=memory&cache=shared"])
def test_the_default_store_urls_name_files_inside_runs_dir(tmp_path: Path, name: str) -> None:
    spec = StudySpec.from_dict({
        "name": "s", "model": "servetune-test-850m", "gpu": {"type": "H200", "count": 1},
        "workload": {"input_len": 128, "output_len": 32, "num_requests": 8, "concurrency": 2},
        "search_space": {"params": {"max_num_seqs": {"type": "categorical", "choices": [8, 16]}}},
        "backend": "sim", "output": {"runs_dir": name}}, cwd=tmp_path)
    for url, file in ((spec.storage.optuna_url, "optuna.db"), (spec.tracking.mlflow_uri, "mlflow.db")):
        parsed = make_url(url)
        assert parsed.get_backend_name() == "sqlite" and not parsed.query, url
        assert parsed.database == str(tmp_path / name / file)


def test_a_postgres_driver_is_named_without_re_pasting_the_url() -> None:
    url = "postgresql+psycopg://u:p%40ss%3Fw@db:5432/optuna?sslmode=require"
    assert postgres_url(url) == url  # the driver is installed: unchanged
    bare = postgres_url("postgresql://u:p%40ss%3Fw@db:5432/optuna?sslmode=require")
    parsed = make_url(bare)
    assert parsed.drivername in ("postgresql+psycopg", "postgresql+psycopg2")
    assert (parsed.password, parsed.host, parsed.database, dict(parsed.query)) == \
        ("p@ss?w", "db", "optuna", {"sslmode": "require"})


def test_sqlite_url_round_trips_through_sqlalchemy() -> None:
    for path in ("/r/victim.db?x/optuna.db", "rel/a#b/optuna.db", "/r/%3F/optuna.db", "/r/sp ace/m.db"):
        assert make_url(sqlite_url(path)).database == path


def test_tune_with_runs_dir_named_like_a_query_leaves_the_neighbour_untouched(tmp_path: Path) -> None:
    victim = tmp_path / "victim.db"
    with sqlite3.connect(victim) as db:
        db.execute("CREATE TABLE kept (x TEXT)")
        db.execute("INSERT INTO kept VALUES ('the user''s data')")
    db.close()
    before = _digest(victim)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({
        "name": "victim", "model": "servetune-test-850m", "gpu": {"type": "H200", "count": 1},
        "workload": {"input_len": 128, "output_len": 32, "num_requests": 16, "concurrency": 4, "seed": 1},
        "search_space": {"params": {"max_num_seqs": {"type": "categorical", "choices": [8, 16]}}},
        "budget": {"trials": 2, "parallel": 1}, "backend": "sim", "output": {"runs_dir": "victim.db?x"}}))
    env = {"PYTHONPATH": str(REPO / "platform"), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "RAY_AUTH_MODE": "disabled", "HOME": str(tmp_path), "MLFLOW_DISABLE_TELEMETRY": "true"}
    for argv in (["tune", "s.yaml"], ["best", "s.yaml"]):
        proc = subprocess.run([sys.executable, "-m", "servetune", *argv], cwd=tmp_path, env=env, text=True,
                              capture_output=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]
        assert _digest(victim) == before, f"`servetune {argv[0]}` changed victim.db"
    assert "vllm serve servetune-test-850m" in proc.stdout  # best read the study tune wrote
    assert {p.name for p in (tmp_path / "victim.db?x").glob("*.db")} == {"optuna.db", "mlflow.db"}
