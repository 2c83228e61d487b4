"""Install footprint of servetune: README's install commands timed in fresh venvs, venv size, start-up.

For a source tree (default: this repository; ``--src`` another checkout, e.g. an older commit's
``git archive``), this reads README's two fresh-machine commands (the lines starting with
``python3 -m venv .venv &&``), and for each distinct ``pip install`` in them:

1. copies the tree to a temp folder, creates a fresh venv there and times ``pip install`` exactly
   as README writes it (wall clock, pip's cache as it is: say whether it was warm),
2. measures the venv's size on disk (``du -sb``),
3. times ``servetune --help`` and ``python -c "import servetune.study"`` (median of ``--repeat``
   runs, each a fresh process),

and with ``--smoke`` runs a short quickstart study (``servetune tune jobs/quickstart.yaml --trials 4``)
in that venv, to show the install is enough for it; then deletes the temp folder and prints one
table. ``--also`` adds other installs (e.g. the core alone, ``.venv/bin/pip install -q -e .``). Nothing here is asserted: the figures depend on
the machine and on what else runs on it (report the load average with them; it is printed).

    python benchmarks/install_footprint.py --smoke --also '.venv/bin/pip install -q -c constraints.txt -e .'
    git archive fe0df70 | tar -x -C /tmp/before && python benchmarks/install_footprint.py --src /tmp/before

Measured 2026-12-01 on this project's machine class (2 cores, shared with three other engineers'
test runs: load average 5-8 throughout, so the seconds are noisy; pip keeps no cache here, so
every install downloaded its wheels from the registry, before and after alike):

| README command (pip install part)          | install s | venv MB | --help s | import servetune.study s | quickstart |
|--------------------------------------------|----------:|--------:|---------:|-------------------------:|-----------:|
| before (fe0df70): `-e ".[test]"` (both)     |     187.1 |    1237 |     0.36 |                     3.27 |          - |
| after: `-c constraints.txt -e ".[ui]"`      |     111.2 |    1139 |     0.31 |                     2.48 |         ok |
| after: `-c constraints.txt -e ".[test]"`    |     119.1 |    1238 |     0.16 |                     1.22 |         ok |
| after: the core alone, `-c constraints.txt -e .` | 66.3 |     888 |     0.15 |                     1.53 |         ok |

Before, both README commands installed the same `.[test]` set (full mlflow with scipy and
scikit-learn, psycopg2-binary, matplotlib imported by `import servetune.study`). After, the core
is mlflow-skinny without a PostgreSQL driver (a GPU node or Ray worker gets 888 MB, not 1237), and
`import servetune.study` no longer loads matplotlib: in one venv, old code against new, 5
interleaved runs each, medians 2.90 s before and 2.08 s after (load average 8). "quickstart ok":
a 4-trial `servetune tune jobs/quickstart.yaml` ran in that venv (the core alone included: the
skinny MLflow client and SQLite store, the plots).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_COMMAND = re.compile(r"^\s{4}python3 -m venv \.venv && (\.venv/bin/pip install [^&]+?)\s*(?:&&|$)", re.M)


def readme_installs(src: Path) -> list[str]:
    """The distinct ``.venv/bin/pip install ...`` commands of README's fresh-machine commands."""
    found = _COMMAND.findall((src / "README.md").read_text())
    return list(dict.fromkeys(c.strip() for c in found))


def _timed(cmd: list[str] | str, cwd: Path, *, shell: bool = False) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, shell=shell, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def _du(path: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(path)], check=True, capture_output=True, text=True).stdout.split()[0])


def measure(src: Path, install: str, repeat: int, smoke: bool = False) -> dict[str, float | str]:
    work = Path(tempfile.mkdtemp(prefix="servetune-footprint-"))
    try:
        tree = work / "src"
        shutil.copytree(src, tree, ignore=shutil.ignore_patterns(".venv", ".git", "servetune-runs", "__pycache__"))
        venv_s = _timed([sys.executable, "-m", "venv", ".venv"], tree)
        install_s = _timed(install, tree, shell=True)
        size = _du(tree / ".venv")
        help_s = statistics.median(_timed([str(tree / ".venv/bin/servetune"), "--help"], tree) for _ in range(repeat))
        import_s = statistics.median(
            _timed([str(tree / ".venv/bin/python"), "-c", "import servetune.study"], work) for _ in range(repeat))
        row: dict[str, float | str] = {"command": install, "venv_s": venv_s, "install_s": install_s,
                                       "venv_mb": size / 1e6, "help_s": help_s, "import_study_s": import_s,
                                       "smoke": "-"}
        if smoke:
            proc = subprocess.run([str(tree / ".venv/bin/servetune"), "tune", "jobs/quickstart.yaml", "--trials", "4"],
                                  cwd=tree, capture_output=True, text=True,
                                  env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true"})
            row["smoke"] = "ok" if proc.returncode == 0 and "vllm serve" in proc.stdout else f"rc={proc.returncode}"
            if row["smoke"] != "ok":
                print(proc.stdout[-2000:], proc.stderr[-3000:], file=sys.stderr)
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=REPO, help="source tree whose README commands are measured")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each start-up timing (median)")
    ap.add_argument("--also", action="append", default=[], metavar="PIP_INSTALL",
                    help='another install to measure, e.g. \'.venv/bin/pip install -q -e .\'')
    ap.add_argument("--smoke", action="store_true", help="run a 4-trial quickstart study in each venv")
    args = ap.parse_args(argv)
    installs = readme_installs(args.src) + args.also
    if not installs:
        print(f"no fresh-machine command in {args.src / 'README.md'}", file=sys.stderr)
        return 1
    cache = Path(os.environ.get("PIP_CACHE_DIR", Path.home() / ".cache" / "pip"))
    print(f"source: {args.src}  cores: {os.cpu_count()}  load average: {os.getloadavg()[0]:.2f}  "
          f"pip cache: {'warm' if cache.exists() and any(cache.iterdir()) else 'empty'} ({cache})")
    rows = [measure(args.src, install, args.repeat, args.smoke) for install in installs]
    print(f"{'pip install (README)':<64} {'venv s':>7} {'install s':>10} {'venv MB':>8} "
          f"{'--help s':>9} {'import study s':>15} {'quickstart':>10}")
    for r in rows:
        print(f"{r['command']:<64} {r['venv_s']:7.1f} {r['install_s']:10.1f} {r['venv_mb']:8.0f} "
              f"{r['help_s']:9.2f} {r['import_study_s']:15.2f} {r['smoke']:>10}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
