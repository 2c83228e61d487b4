"""The package type-checks: mypy, with the settings pyproject.toml's ``[tool.mypy]`` names, passes on
platform/servetune. The modules that do not pass yet are listed there (``ignore_errors``); a listed
module that passes must leave the list, so it only shrinks."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "platform" / "servetune"
ERROR_LINE = re.compile(r"^(?P<path>[^:\n]+\.py):\d+: error:", re.MULTILINE)


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]


def _listed(config: dict) -> set[str]:
    """The modules ``[tool.mypy]`` excuses from its errors."""
    return {m for o in config.get("overrides", []) if o.get("ignore_errors") for m in o["module"]}


def _module(path: str) -> str:
    parts = Path(path).resolve().relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _ini(config: dict) -> str:
    """``config`` as a mypy.ini without the ``ignore_errors`` overrides, paths made absolute."""
    def value(v: object) -> str:
        return str(v) if not isinstance(v, list) else ",".join(map(str, v))
    top = {k: v for k, v in config.items() if k != "overrides"}
    top["files"] = [str(ROOT / f) for f in top["files"]]
    top["mypy_path"] = str(ROOT / top["mypy_path"])
    lines = ["[mypy]", *(f"{k} = {value(v)}" for k, v in top.items())]
    for o in config.get("overrides", []):
        if o.get("ignore_errors"):
            continue
        lines.append(f"[mypy-{','.join(o['module'])}]")
        lines += [f"{k} = {value(v)}" for k, v in o.items() if k != "module"]
    return "\n".join(lines) + "\n"


@pytest.mark.slow
def test_the_package_type_checks() -> None:
    done = _mypy()
    assert done.returncode == 0, f"mypy found errors (exit {done.returncode}):\n{done.stdout}{done.stderr}"
    assert "Success" in done.stdout, done.stdout


@pytest.mark.slow
def test_the_list_of_modules_that_fail_only_shrinks(tmp_path: Path) -> None:
    config = _config()
    listed = _listed(config)
    ini = tmp_path / "mypy.ini"
    ini.write_text(_ini(config), encoding="utf-8")
    done = _mypy("--config-file", str(ini))
    failing = {_module(m["path"]) for m in ERROR_LINE.finditer(done.stdout)}
    assert failing <= listed, f"errors outside the list: {sorted(failing - listed)}\n{done.stdout}"
    assert listed <= failing, (f"these listed modules pass mypy now: strike them from pyproject.toml's "
                               f"[tool.mypy] overrides: {sorted(listed - failing)}")
