"""The MLflow pages a user opens after a study, in a real browser: `servetune tune` on the simulator,
`mlflow ui` on its store, headless Chromium on the link servetune printed.

What a newcomer must see without knowing MLflow: the experiment opens on its runs (not MLflow 3's
GenAI overview) and lists every trial; the study's run shows the best `vllm serve` command and its
plots; a trial's page starts with what happened and its headline figures.

``SERVETUNE_SCREENSHOTS=DIR`` also writes the pages as PNGs into DIR (how docs/img/ is made).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from _browser import Browser, chromium_binary, free_port

REPO = Path(__file__).resolve().parents[2]
# A short study; the README's screenshots (SERVETUNE_SCREENSHOTS) are of the whole quickstart.
TRIALS = 30 if os.environ.get("SERVETUNE_SCREENSHOTS") else 8


def _start_mlflow_ui(store: str, cwd: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(cwd / "mlflow-ui.log", "wb")  # noqa: SIM115 - closed with the process below
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store, "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], cwd=cwd, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow ui exited: {(cwd / 'mlflow-ui.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("mlflow ui did not answer /health in 120 s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


@pytest.mark.slow
def test_mlflow_pages_a_user_opens_after_a_study(tmp_path: Path) -> None:
    chromium_binary()  # fails here, naming the fix, before the study is run for nothing
    spec = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())
    spec.update(name="quickstart", search_space=str(REPO / "search_spaces" / "memory-pair.yaml"),
                budget={"trials": TRIALS, "parallel": 2}, output={"runs_dir": str(tmp_path / "runs")})
    spec_path = tmp_path / "study.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    tune = subprocess.run([sys.executable, "-m", "servetune", "tune", str(spec_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert tune.returncode == 0, tune.stdout[-2000:] + tune.stderr[-2000:]
    command = re.search(r"run it with:\n  (vllm serve .+)\n", tune.stdout).group(1)  # type: ignore[union-attr]
    printed = re.search(r"then open (http://127\.0\.0\.1:5000/\S+)", tune.stdout).group(1)  # type: ignore[union-attr]

    store = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("servetune-quickstart")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("servetune.role") == "study")
    best = next(r for r in runs if r.data.tags.get("mlflow.runName") == f"trial-{int(tune.stdout.split('best trial #')[1].split(':')[0]):03d}")

    ui, base = _start_mlflow_ui(store, tmp_path)
    browser = Browser(width=1300, height=900)
    shots = tmp_path / "shots"
    shots.mkdir()
    try:
        # 1. The link servetune printed opens the experiment on its runs, and every trial is listed.
        browser.goto(printed.replace("http://127.0.0.1:5000", base))
        text = browser.wait_for_text(f"{TRIALS + 1} matching runs", "quickstart")
        assert "Traces\n0" not in text and "No data available" not in text  # not the GenAI overview
        browser.click_css('button[data-component-id*="runnamecellrenderer"]')  # unfold the study's trials
        browser.wait_for_text(*(f"trial-{n:03d}" for n in range(TRIALS)))
        _close_assistant(browser)
        browser.screenshot(shots / "mlflow-quickstart-runs.png")

        # 2. The study's run: the best command first, then what happened, and the plots it lists.
        browser.goto(f"{base}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}?workflowType=machine_learning")
        text = browser.wait_for_text("Best configuration", "output tok/s", "optimization_history.png")
        assert command.split(" --")[0] in text and text.index("Best configuration") < text.index("Metrics (")
        flat = re.sub(r"\s+", " ", text)
        assert command in flat  # the whole command, as printed by `servetune tune`
        browser.screenshot(shots / "mlflow-quickstart-study.png")
        plot = "throughput_vs_max_num_seqs.png"
        browser.goto(f"{base}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}/artifacts/plots/{plot}"
                     "?workflowType=machine_learning")
        width = browser.wait_for_js("Math.max(0, ...[...document.images].map(i => i.naturalWidth))")
        assert width > 400  # the plot itself was served and decoded, not a broken image
        browser.screenshot(shots / "mlflow-quickstart-landscape.png")

        # 3. A trial's page starts with what happened and the figures that decide it.
        browser.goto(f"{base}/#/experiments/{exp.experiment_id}/runs/{best.info.run_id}?workflowType=machine_learning")
        text = browser.wait_for_text("served, no preemption", "output tok/s", "p99 TTFT", "KV cache")
        assert text.index("output tok/s") < text.index("Metrics (")
        assert "nan" not in text.split("Metrics (")[0]
        browser.screenshot(shots / "mlflow-quickstart-trial.png")
    finally:
        browser.close()
        _stop(ui)
    for png in shots.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    if os.environ.get("SERVETUNE_SCREENSHOTS"):
        target = Path(os.environ["SERVETUNE_SCREENSHOTS"])
        target.mkdir(parents=True, exist_ok=True)
        from PIL import Image  # matplotlib's own dependency

        for png in shots.glob("*.png"):  # 128 colours: a third of the bytes, the same to read
            Image.open(png).convert("RGB").quantize(colors=128).save(target / png.name, optimize=True)


def _close_assistant(browser: Browser) -> None:
    """MLflow 3.17 opens its chat assistant beside every page; a screenshot is clearer without it."""
    browser.eval("(() => { const b = [...document.querySelectorAll('button[aria-label=Close]')]"
                 ".find(e => e.offsetParent !== null); if (b) b.click(); return true; })()")
