"""No code from a spec: no value a spec (or a stored study) carries reaches a command servetune
starts as an option.

One rule, :func:`servetune.planner.flags.argv_value`: a model id or path is non-empty text of at
most 4,096 characters, without control characters, that never starts with ``-`` (a path that does
is written ``./-name``). Flags are rendered only from the flag table with typed values
(:func:`servetune.planner.flags.to_cli_args`). Each path that builds an argv is driven through its
real entry and must refuse, with nothing launched:

* the spec loader, through ``servetune tune`` / ``best`` and ``jobs/tune.py`` (one line, exit 2,
  before Ray starts or any server is launched);
* the real engine's ``vllm serve`` argv (and with it the simulator stand-in's), through
  :class:`~servetune.engines.vllm.engine.VllmEngine` and :func:`run_vllm_trial` (``invalid_config``,
  the serve command never run);
* ``vllm bench serve``'s argv (:func:`bench_argv`);
* the printed ``vllm serve`` command of ``servetune best`` for a stored study.

Legitimate values (``./models/x``, ``org/name``, absolute paths, ``./-name``) still pass, and a
``./-name`` model reaches a real stand-in server as its model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from servetune.cli import _main as cli
from servetune.engines.base import TrialTask
from servetune.engines.vllm.bench_client import bench_argv
from servetune.engines.vllm.engine import VllmEngine, VllmLaunch, run_vllm_trial, serve_argv
from servetune.errors import SpecError
from servetune.planner.flags import to_cli_args
from servetune.result import TrialStatus
from servetune.spec.schema import StudySpec
from servetune.workload import Workload

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "platform" / "servetune" / "data" / "models" / "servetune-test-850m"
PLUGIN = "--tool-parser-plugin=plugin.py"
WORKLOAD = Workload.from_dict({"input_len": 128, "output_len": 16, "num_requests": 4, "concurrency": 2})


def _spec(tmp: Path, **over: object) -> dict:
    data = {"name": "argv", "model": "servetune-test-850m", "gpu": {"type": "H200", "count": 1},
            "workload": {"input_len": 128, "output_len": 32, "num_requests": 8, "concurrency": 2},
            "search_space": {"params": {"max_num_seqs": {"type": "categorical", "choices": [8, 16]}}},
            "budget": {"trials": 2}, "backend": "vllm", "output": {"runs_dir": str(tmp / "runs")}}
    data.update(over)
    return data


@pytest.fixture
def recorder(tmp_path: Path) -> tuple[tuple[str, ...], Path]:
    """A serve command that leaves a mark when anything runs it (so a test can tell nothing was launched)."""
    mark = tmp_path / "launched"
    script = tmp_path / "serve.py"
    script.write_text(f"import sys\nopen({str(mark)!r}, 'a').write(repr(sys.argv) + '\\n')\n")
    return (sys.executable, str(script)), mark


def _env(tmp: Path, command: tuple[str, ...]) -> dict[str, str]:
    return {"PYTHONPATH": str(REPO / "platform"), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp),
            "RAY_AUTH_MODE": "disabled", "MLFLOW_DISABLE_TELEMETRY": "true",
            "SERVETUNE_SERVE_COMMAND": " ".join(command)}


# -- the spec loader, through the real entries -------------------------------------------------------

@pytest.mark.parametrize("entry", [["-m", "servetune", "tune"], ["jobs/tune.py"]], ids=["servetune-tune", "jobs-tune"])
def test_an_option_as_serve_model_is_one_line_exit_2_and_nothing_starts(tmp_path: Path, recorder, entry) -> None:
    command, mark = recorder
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(_spec(tmp_path, serve_model=PLUGIN)))
    proc = subprocess.run([sys.executable, *entry, str(spec)], cwd=REPO, env=_env(tmp_path, command), text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: serve_model: ") and "starts with '-'" in lines[0] and "./-name" in lines[0]
    assert "joined" not in proc.stdout and "local Ray" not in proc.stdout  # jobs/tune.py: refused before connect()
    assert not mark.exists(), "a server was launched"
    assert not (tmp_path / "runs").exists(), "the study started: its runs dir was created"


@pytest.mark.parametrize(("field", "value", "said"), [
    ("serve_model", PLUGIN, "starts with '-'"),
    ("serve_model", "-m", "starts with '-'"),
    ("serve_model", "org/name\n--trust-remote-code", "control character"),
    ("serve_model", "org/na\x00me", "control character"),
    ("serve_model", "x" * 4097, "4,097 characters"),
    ("serve_model", "", "non-empty"),
    ("model", "--config=evil.yaml", "starts with '-'"),
])
def test_the_loader_refuses_what_would_not_be_a_model(tmp_path: Path, capsys, recorder, field, value, said) -> None:
    command, mark = recorder
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(_spec(tmp_path, **{field: value})))
    for argv in (["tune", str(spec)], ["best", str(spec)]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {field}: ") and said in err and "\n" not in err, err
        assert len(err) < 400, "the message echoes the whole value"
    assert not mark.exists() and not (tmp_path / "runs").exists()


def test_flags_of_a_spec_are_typed_and_from_the_table(tmp_path: Path) -> None:
    for fixed, said in (({"tool_parser_plugin": "plugin.py"}, "unknown vLLM flag"),
                        ({"kv_cache_dtype": "--trust-remote-code"}, "invalid value"),
                        ({"max_num_seqs": "8 --trust-remote-code"}, "expected a number")):
        with pytest.raises(SpecError, match=said):
            StudySpec.from_dict(_spec(tmp_path, fixed_flags=fixed), cwd=tmp_path)


@pytest.mark.parametrize("serve_model", ["org/name", "./models/x", "ABS", "./-odd-model"])
def test_legitimate_models_pass_the_loader_and_the_argv_builders(tmp_path: Path, serve_model: str) -> None:
    for folder in ("models/x", "-odd-model"):
        (tmp_path / folder).mkdir(parents=True)
        shutil.copy(SHIPPED / "config.json", tmp_path / folder / "config.json")
    serve_model = str(tmp_path / "models" / "x") if serve_model == "ABS" else serve_model
    # As serve_model any of them; as model the paths (an HF id as model needs it in the local cache).
    variants = [_spec(tmp_path, serve_model=serve_model)] + ([] if serve_model == "org/name" else [_spec(tmp_path, model=serve_model)])
    for data in variants:
        spec = StudySpec.from_dict(data, tmp_path, cwd=tmp_path)
        argv = serve_argv(VllmLaunch(model=spec.serve_model, flags={"max_num_seqs": 8}), 8011)
        assert argv[2] in (serve_model, str((tmp_path / serve_model).resolve())) and argv[3] == "--host"
        bench = bench_argv(WORKLOAD, base_url="http://127.0.0.1:8011", model=spec.serve_model, result_dir=tmp_path)
        assert bench[bench.index("--model") + 1] == spec.serve_model


# -- the argv builders themselves (defence in depth) ---------------------------------------------------

@pytest.mark.parametrize(("model", "flags", "said"), [
    (PLUGIN, {"max_num_seqs": 8}, "serve_model: "),
    ("org/name\r\nINFO forged", {}, "control character"),
    ("org/name", {"tool_parser_plugin": "plugin.py"}, "unknown vLLM flag"),
    ("org/name", {"kv_cache_dtype": "--trust-remote-code"}, "invalid value"),
    ("org/name", {"cudagraph_capture_sizes": ["--x"]}, "positive integers"),
])
def test_the_engine_refuses_before_launch(tmp_path: Path, recorder, model, flags, said) -> None:
    command, mark = recorder
    task = TrialTask(model="servetune-test-850m", serve_model=model, gpu="H200", flags=flags, workload=WORKLOAD,
                     serve_command=command, log_dir=str(tmp_path / "trial"), startup_timeout_s=10)
    result = VllmEngine().run(task)
    assert result.status is TrialStatus.INVALID_CONFIG and said in (result.cause or ""), (result.status, result.cause)
    assert not mark.exists(), "the serve command ran"
    bench = run_vllm_trial(VllmLaunch(model=model, flags=flags, serve_command=command, load_generator="vllm-bench",
                                      log_dir=tmp_path / "bench"), WORKLOAD)
    assert bench.status is TrialStatus.INVALID_CONFIG and not mark.exists()


def test_bench_argv_refuses_option_like_values(tmp_path: Path) -> None:
    for kwargs, field in (({"model": PLUGIN}, "serve_model"), ({"served_model_name": "--x"}, "served_model_name"),
                          ({"result_dir": "-r"}, "output.runs_dir")):
        args = {"model": "org/name", "result_dir": tmp_path, **kwargs}
        with pytest.raises(SpecError, match=f"^{field}: "):
            bench_argv(WORKLOAD, base_url="http://127.0.0.1:1", **args)


def test_to_cli_args_renders_only_table_flags_with_typed_values() -> None:
    assert to_cli_args({"max_num_seqs": 8.0, "enforce_eager": True}) == ["--max-num-seqs", "8", "--enforce-eager"]
    for flags in ({"tool_parser_plugin": "x.py"}, {"max_num_seqs": "8"}, {"enforce_eager": "yes"}):
        with pytest.raises(SpecError):
            to_cli_args(flags)


def test_a_dash_model_written_as_a_path_reaches_the_stand_in_as_its_model(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "-odd-model").mkdir()
    shutil.copy(SHIPPED / "config.json", tmp_path / "-odd-model" / "config.json")
    monkeypatch.chdir(tmp_path)
    env = {"PYTHONPATH": str(REPO / "platform"), "SERVETUNE_SIM_STARTUP_S": "0.2"}
    launch = VllmLaunch(model="./-odd-model", flags={"max_num_seqs": 8}, env=env, startup_timeout_s=60,
                        serve_command=(sys.executable, "-m", "servetune.sim.server"), stop_grace_s=3.0,
                        extra_args=("--sim-gpu", "H200", "--sim-speedup", "20"), log_dir=tmp_path / "trial")
    result = run_vllm_trial(launch, WORKLOAD)
    assert result.status is TrialStatus.OK and result.completed == 4, (result.status, result.cause)


# -- the printed command of a stored study -------------------------------------------------------------

def test_best_refuses_a_stored_option_as_the_model(tmp_path: Path, capsys) -> None:
    url = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="old", storage=url, direction="maximize")
    study.set_user_attr("serve_model", PLUGIN)
    trial = study.ask()
    trial.suggest_categorical("max_num_seqs", [8])
    trial.set_constraint("max_preemptions", 0.0)  # feasible, as the driver records it
    study.tell(trial, 1.0)
    for fmt in ("cmd", "yaml"):  # vLLM turns a --config file's keys into arguments too
        assert cli.main(["best", "old", "--storage", url, "--format", fmt]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: serve_model: ") and "starts with '-'" in err and "\n" not in err
