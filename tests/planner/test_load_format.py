"""``load_format``: pinned to ``dummy``, a study's trials run on random weights built from config.json
(the checkpoint's memory and speed, nothing on disk), and the command the study recommends loads the
checkpoint: every trial's argv carries the flag, the winning command and config file never do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from servetune.errors import SpecError
from servetune.planner.flags import (FLAGS, parse_set_option, serving_flags, to_cli_args, to_command_line,
                                     to_config_yaml, validate_flags)
from servetune.records.dataset import read_trials

REPO = Path(__file__).resolve().parents[2]


def test_the_flag_takes_vllms_spelling_and_its_formats() -> None:
    assert FLAGS["load_format"].cli == "--load-format"
    assert parse_set_option("load-format=dummy") == ("load_format", "dummy")
    with pytest.raises(SpecError) as err:
        validate_flags({"load_format": "dummy; rm -rf /"})
    assert err.value.field == "flags.load_format" and "dummy" in err.value.fix


def test_a_trial_is_launched_with_it_and_the_recommendation_is_not() -> None:
    flags = {"load_format": "dummy", "max_num_seqs": 64}
    assert to_cli_args(flags) == ["--load-format", "dummy", "--max-num-seqs", "64"]
    assert to_command_line("org/m", flags) == "vllm serve org/m --max-num-seqs 64"
    assert yaml.safe_load(to_config_yaml("org/m", flags)) == {"model": "org/m", "max-num-seqs": 64}
    # a format the user serves with stays in the recommendation
    kept = {"load_format": "safetensors", "max_num_seqs": 64}
    assert serving_flags(kept) == kept
    assert to_command_line("org/m", kept) == "vllm serve org/m --load-format safetensors --max-num-seqs 64"


@pytest.mark.slow
@pytest.mark.parametrize(("model", "extra", "few_experts"), [("llama-3.1-8b", {}, False),
                                                          ("qwen3-30b-a3b", {"quantization": "fp8"}, True)],
                         ids=["dense", "moe-fp8"])
def test_a_study_on_random_weights_records_them_and_recommends_the_checkpoint(
        tmp_path: Path, model: str, extra: dict, few_experts: bool) -> None:
    """The quickstart study, shortened, with ``load_format: dummy`` pinned: the dataset keeps the flag on
    every trial, the printed command, best_command.txt and best_config.yaml leave it out, and the output
    says why; for an MoE model quantized online it adds that random weights route to few experts (vLLM's
    profiler, 2026-12-07), for a dense one it does not."""
    spec = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())
    spec["fixed_flags"] = {**(spec.get("fixed_flags") or {}), "load_format": "dummy", **extra}
    spec["model"] = model
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform"), "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled",
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.run([sys.executable, "-m", "servetune", "tune", str(path), "--trials", "3", "--parallel", "1"],
                          capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    command = proc.stdout.split("run it with:\n", 1)[1].splitlines()[0]
    assert command.strip().startswith("vllm serve ") and "--load-format" not in command
    assert "ran on random weights (load_format: dummy)" in proc.stdout
    assert ("route an MoE model's batches to few experts" in proc.stdout) is few_experts
    trials = read_trials(tmp_path / "servetune-runs" / "dataset")
    assert len(trials) == 3 and set(trials["flag_load_format"]) == {"dummy"}
    files = {p.name: p.read_text() for p in (tmp_path / "servetune-runs").rglob("best_*")}
    assert set(files) == {"best_command.txt", "best_config.yaml"}
    assert all("load" not in text for text in files.values()), files
