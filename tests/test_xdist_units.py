"""README's test command over a tree in which workers die: the run ends, with each dead worker's test failed once
and every other test run (``_xdist_units.FileOrGroupScheduling``; pytest-xdist 3.8.0's own file scheduling
hangs there for ever). A test stuck past pyproject.toml's ``faulthandler_timeout`` ends its worker the same way."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

_CONFTEST = '''
import pytest

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from _xdist_units import FileOrGroupScheduling
    return FileOrGroupScheduling(config, log)
'''

_FILES = {
    "test_a.py": "def test_1(): pass\ndef test_2(): pass\ndef test_3(): pass\ndef test_4(): pass\n",
    "test_b.py": ("import os\ndef test_before(): pass\ndef test_dies(): os._exit(3)\n"
                  "def test_after(): pass\ndef test_last(): pass\n"),
    "test_c.py": "def test_1(): pass\ndef test_2(): pass\ndef test_3(): pass\n",
    "test_d.py": "import os\ndef test_dies_alone(): os._exit(3)\n",
}


def test_a_dead_worker_costs_its_one_test_and_the_run_ends(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    for name, text in _FILES.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(TESTS)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
                           "-rf"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert re.search(r"\b2 failed, 10 passed\b", out), out[-3000:]
    crashed = sorted(set(re.findall(r"worker 'gw\d+' crashed while running '([^'\n]+)'", out)))
    assert crashed == ["test_b.py::test_dies", "test_d.py::test_dies_alone"], out[-3000:]


def test_a_test_stuck_past_the_faulthandler_timeout_ends_its_worker_and_the_run_goes_on(tmp_path: Path) -> None:
    """pyproject.toml's ``faulthandler_timeout`` with ``faulthandler_exit_on_timeout`` (900 s there, 3 s here): a test
    blocked in a call pytest-timeout's signal would not interrupt has its stacks dumped and its worker ended; the
    scheduler reports it failed and the other files run."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nfaulthandler_timeout = 3\nfaulthandler_exit_on_timeout = true\n")
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_a.py").write_text(_FILES["test_a.py"])
    (tmp_path / "test_c.py").write_text(_FILES["test_c.py"])
    (tmp_path / "test_stuck.py").write_text("import time\ndef test_stuck(): time.sleep(120)\ndef test_after(): pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(TESTS)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
                           "-p", "no:timeout"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert re.search(r"\b1 failed, 8 passed\b", out), out[-3000:]
    assert "crashed while running 'test_stuck.py::test_stuck'" in out and "Timeout" in out, out[-3000:]
