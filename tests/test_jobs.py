"""The Ray job entrypoints (jobs/tune.py, jobs/nightly.py) as processes: options, exit codes, messages.

The successful paths run in tests/cluster/test_multinode.py (tune.py on a real multi-node cluster)
and tests/test_nightly.py (nightly.py with a planted regression, exit code 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
# No PYTHONPATH: the scripts must find platform/ from their own location, as under `ray job submit`.
_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "jobs" / script), *args], cwd=cwd, env=_ENV,
                          capture_output=True, text=True, timeout=120)


def test_tune_job_exits_2_naming_the_field_of_a_bad_spec(tmp_path: Path) -> None:
    spec = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())
    spec["budget"] = {"trials": 4, "paralel": 2}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = _run("tune.py", str(path), cwd=tmp_path)
    assert proc.returncode == 2
    assert "budget.paralel" in proc.stderr and "parallel" in proc.stderr
    assert not (tmp_path / "servetune-runs").exists()  # refused before any study was created


def test_nightly_job_exits_2_on_a_bad_injection_or_matrix(tmp_path: Path) -> None:
    proc = _run("nightly.py", str(REPO / "jobs" / "nightly.yaml"), "--inject-regression", "nocolon", cwd=tmp_path)
    assert proc.returncode == 2 and "--inject-regression" in proc.stderr and "CELL:FACTOR" in proc.stderr
    proc = _run("nightly.py", str(REPO / "jobs" / "nightly.yaml"), "--date", "2026-01-01", cwd=tmp_path)
    assert proc.returncode == 2 and "--date" in proc.stderr and "YYYYMMDD" in proc.stderr
    proc = _run("nightly.py", str(REPO / "jobs" / "nightly.yaml"), "--inject-regression",
                "servetune-test-850m.H100.chat:0.5", cwd=tmp_path)
    assert proc.returncode == 2 and "servetune-test-850m.H200.chat" in proc.stderr  # did you mean


def test_shipped_nightly_matrix_expands_to_valid_specs(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "platform"))
    from servetune.nightly import expand_matrix, load_matrix
    from servetune.spec.schema import StudySpec

    from servetune.nightly import calibration_warning
    from servetune.planner.gpus import published_judgement

    cells = expand_matrix(load_matrix(REPO / "jobs" / "nightly.yaml"))
    assert [c.name for c in cells] == ["servetune-test-850m.H200.chat", "servetune-test-850m.A100-80GB.chat"]
    for cell in cells:
        spec = StudySpec.from_dict({**cell.spec_data, "name": cell.study_name("20260101")}, REPO / "jobs", cwd=tmp_path)
        assert spec.gpu.type == cell.gpu_type and spec.name.endswith("-20260101")
        # a cell carries the report's warning exactly where the published runs of its model's class held out
        # on its GPU type fall short of the target (platform/servetune/data/published_judgement.json): the
        # H200's runs as a whole since the Qwen3.5-35B-A3B page (21 of 28 within 10%), its dense ones not (9 of
        # 10), so the shipped matrix's dense model warns nowhere
        model = spec.model_profile
        judged = published_judgement(cell.gpu_type, model.judgement_class)
        assert judged is not None and model.judgement_class == "dense"
        assert (calibration_warning(spec.gpu_spec(), "sim", model) != "") == (not judged.meets_target), cell.name
        assert judged.meets_target, cell.name
    assert not published_judgement("H200").meets_target


def test_a_python_without_servetunes_core_is_one_line_naming_what_it_lacks(tmp_path: Path) -> None:
    """`python -S`: no site-packages, so none of the core's packages, as on a Ray node whose
    `python` is not the environment servetune was installed into."""
    for script, args in (("tune.py", [str(REPO / "jobs" / "quickstart.yaml")]),
                         ("nightly.py", [str(REPO / "jobs" / "nightly.yaml")])):
        proc = subprocess.run([sys.executable, "-S", str(REPO / "jobs" / script), *args], cwd=tmp_path, env=_ENV,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "pandas>=" in lines[0] and "(not installed)" in lines[0] and "optuna>=" in lines[0]
        assert "fix: install servetune's core" in lines[0]
        assert not (tmp_path / "servetune-runs").exists()


def test_runs_dir_and_output_dir_must_be_absolute(tmp_path: Path) -> None:
    proc = _run("tune.py", str(REPO / "jobs" / "quickstart.yaml"), "--runs-dir", "runs", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --runs-dir: expected an absolute path, got 'runs'")
    proc = _run("nightly.py", str(REPO / "jobs" / "nightly.yaml"), "--output-dir", "out", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --output-dir: expected an absolute path, got 'out'")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_inside_rays_working_dir_a_relative_store_is_refused(tmp_path: Path) -> None:
    """Run from a folder shaped like Ray's temporary copy of a job's working dir: the spec's
    relative runs_dir (the quickstart's) is refused naming output.runs_dir; an absolute
    --runs-dir is taken but a relative SQLite URL in the spec is still refused, by its own name."""
    pkg = tmp_path / "ray-temp" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    pkg.mkdir(parents=True)
    proc = _run("tune.py", str(REPO / "jobs" / "quickstart.yaml"), cwd=pkg)
    assert proc.returncode == 2 and proc.stderr.startswith("error: output.runs_dir: 'servetune-runs' resolves into "
                                                           "Ray's temporary copy"), proc.stderr
    assert "--runs-dir RUNS_DIR, with RUNS_DIR an absolute path" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    spec = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())
    spec["storage"] = {"optuna_url": "sqlite:///optuna.db"}
    spec["search_space"] = str(REPO / "search_spaces" / "memory-pair.yaml")
    (pkg / "s.yaml").write_text(yaml.safe_dump(spec))
    proc = _run("tune.py", "s.yaml", "--runs-dir", str(tmp_path / "runs"), cwd=pkg)
    assert proc.returncode == 2 and proc.stderr.startswith("error: storage.optuna_url: "), proc.stderr
    assert not list(pkg.rglob("*.db")) and not (tmp_path / "runs").exists()
    proc = _run("nightly.py", str(REPO / "jobs" / "nightly.yaml"), cwd=pkg)
    assert proc.returncode == 2 and proc.stderr.startswith("error: output.dir: 'servetune-nightly' resolves into "
                                                           "Ray's temporary copy"), proc.stderr
    assert not (pkg / "servetune-nightly").exists()


def test_the_printed_store_commands_mask_passwords_and_quote_paths() -> None:
    sys.path.insert(0, str(REPO / "platform"))
    from servetune.cluster import store_commands

    lines = store_commands("q 1", "postgresql+psycopg://tuner:s3cret-pw@db:5432/optuna", Path("/shared/my runs/dataset"),
                           Path("/shared/my runs/report.md"), "http://mlflow:5000")
    assert lines[0] == "servetune best 'q 1' --storage 'postgresql+psycopg://tuner:***@db:5432/optuna'"
    assert lines[1] == "servetune report --study 'q 1' --dataset '/shared/my runs/dataset' --out '/shared/my runs/report.md'"
    assert lines[2] == "open http://mlflow:5000 (MLflow server)"
    assert not any("s3cret" in line for line in lines)
