"""What each place servetune runs installs: the lean core, the extras, README's commands and CI's.

The core (a laptop, CI, a Ray driver or worker next to vLLM) is mlflow-skinny, no PostgreSQL
driver and matplotlib imported only when a plot is drawn; the full MLflow (`mlflow ui` /
`mlflow server`), psycopg 3 and vLLM are extras.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from servetune.records._storage import open_storage, postgres_url
from servetune.errors import SpecError

REPO = Path(__file__).resolve().parents[1]

#: Packages the full mlflow (the [ui]/[server] extras) brings and mlflow-skinny does not, and the
#: PostgreSQL drivers: a core driver process must never need them.
NOT_IN_CORE = ("flask", "gunicorn", "graphene", "sklearn", "scipy", "docker", "psycopg", "psycopg2")

_BLOCKER = f"""
import importlib.abc, sys
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_IN_CORE!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not in servetune's core install)", name=name)
        return None
sys.meta_path.insert(0, _NotInstalled())
"""


def _readme_commands() -> list[str]:
    return re.findall(r"^    (python3 -m venv \.venv && .+)$", (REPO / "README.md").read_text(), re.M)


def test_readme_test_command_is_what_ci_runs_and_the_first_one_installs_the_ui() -> None:
    first, test = _readme_commands()[:2]
    ci = (REPO / ".ci" / "run").read_text()
    steps = [part.strip() for part in test.split("&&")]
    assert steps[0] == "python3 -m venv .venv" and "python3 -m venv .venv" in ci
    for step in steps[1:]:
        assert re.search(rf"^{re.escape(step)}$", ci, re.M), f".ci/run does not run README's `{step}`"
    assert '-c constraints.txt -e ".[test]"' in test
    assert '-e ".[ui]"' in first and first.endswith("servetune tune jobs/quickstart.yaml")
    with open(REPO / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(r.startswith("mlflow>=") for r in extras["ui"]), "`mlflow ui` needs the full mlflow"


def test_import_servetune_study_pulls_no_plotting_or_server_stack() -> None:
    code = ("import sys, servetune.study, servetune.cli, servetune.records.tracking\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {(*NOT_IN_CORE, 'matplotlib')!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO / "platform")})
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.slow
def test_a_study_runs_on_the_core_alone_and_mlflow_holds_it(tmp_path: Path) -> None:
    """The quickstart study, shortened, with every package outside the core made uninstallable in
    the driver: it still tracks to MLflow (mlflow-skinny's client and SQLite store) and plots."""
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO / "platform")]),
           "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled", "MLFLOW_DISABLE_TELEMETRY": "true"}
    check = subprocess.run([sys.executable, "-c", "import flask"], capture_output=True, text=True, env=env)
    assert check.returncode == 1 and "not in servetune's core install" in check.stderr  # the blocker works
    proc = subprocess.run([sys.executable, "-m", "servetune", "tune", str(REPO / "jobs" / "quickstart.yaml"),
                           "--trials", "4", "--parallel", "2"],
                          capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vllm serve" in proc.stdout
    client = MlflowClient(f"sqlite:///{tmp_path}/servetune-runs/mlflow.db")
    (exp,) = [e for e in client.search_experiments() if e.name != "Default"]
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("servetune.role") != "trial"]
    trials = [r for r in runs if r.data.tags.get("servetune.role") == "trial"]
    assert len(parents) == 1 and len(trials) == 4
    artifacts = [a.path for a in client.list_artifacts(parents[0].info.run_id, "plots")]
    assert any(p.endswith(".png") for p in artifacts), artifacts


def test_a_psycopg2_url_is_kept_where_psycopg2_is_installed_else_one_line_naming_the_fix(tmp_path: Path) -> None:
    url = "postgresql+psycopg2://u@127.0.0.1:1/optuna"
    if importlib.util.find_spec("psycopg2") is not None:
        assert postgres_url(url) == url
        return
    with pytest.raises(SpecError) as err:
        postgres_url(url)
    assert "psycopg2" in str(err.value) and "postgresql+psycopg://" in str(err.value)
    # Through the CLI: exit 2, one line, no traceback, before anything connects.
    proc = subprocess.run([sys.executable, "-m", "servetune", "best", "quickstart", "--storage", url],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO / "platform")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: storage.optuna_url: ")
    assert "Traceback" not in proc.stderr


def test_without_any_postgres_driver_the_error_names_the_extra(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER)
    proc = subprocess.run([sys.executable, "-m", "servetune", "best", "quickstart", "--storage",
                           "postgresql+psycopg://u@127.0.0.1:1/optuna"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO / 'platform'}"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == ("error: storage.optuna_url: postgresql+psycopg:// needs psycopg 3, which is not "
                                   "installed (fix: pip install 'servetune[postgres]' (psycopg 3))")


@pytest.mark.slow
def test_a_bare_postgresql_url_opens_with_the_installed_driver(postgres_server) -> None:  # type: ignore[no-untyped-def]
    url = postgres_server.create_database("bare_url").replace("postgresql+psycopg://", "postgresql://")
    driver = "psycopg2" if importlib.util.find_spec("psycopg2") else "psycopg"
    assert postgres_url(url).startswith(f"postgresql+{driver}://")
    study = optuna.create_study(study_name="bare", storage=open_storage(url))
    study.tell(study.ask(), 1.0)
    assert [t.value for t in optuna.load_study(study_name="bare", storage=open_storage(url)).trials] == [1.0]
