"""Study specs: the quickstart, every section's validation, and broken specs by the hundred."""

from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from servetune.errors import SpecError
from servetune.redact import redact_url
from servetune.spec.schema import StudySpec, load_spec

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "jobs" / "quickstart.yaml"

optuna.logging.set_verbosity(optuna.logging.WARNING)

BASE: dict[str, Any] = {
    "name": "unit",
    "model": "servetune-test-850m",
    "gpu": {"type": "H200", "count": 2},
    "workload": {"input_len": 256, "output_len": 128, "num_requests": 16, "concurrency": 4},
    "objective": {"metric": "output_throughput"},
    "constraints": {"max_preemptions": 0, "p99_ttft_ms": 2000},
    "search_space": {"params": {
        "gpu_memory_utilization": {"type": "float", "low": 0.5, "high": 0.9, "step": 0.1},
        "max_num_seqs": {"type": "categorical", "choices": [32, 64, 128]}},
        "rules": ["max_num_seqs <= 4 * max_num_batched_tokens"]},
    "fixed_flags": {"max_num_batched_tokens": 2048},
    "budget": {"trials": 6, "parallel": 2},
    "backend": "sim",
    "sampler": "tpe",
    "seed": 3,
}


def build(tmp_path: Path, **changes: Any) -> StudySpec:
    data = copy.deepcopy(BASE)
    data.update(changes)
    return StudySpec.from_dict(data, tmp_path, cwd=tmp_path)


# -- the shipped quickstart ----------------------------------------------------------------------

def test_quickstart_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)  # output paths are relative to where servetune runs
    spec = load_spec(QUICKSTART)
    assert spec.name == "quickstart"
    assert spec.model_ref == "llama-3.1-8b" and spec.serve_model == "meta-llama/Llama-3.1-8B-Instruct"
    assert spec.model_profile is not None and spec.model_profile.num_attention_heads == 32
    assert (spec.gpu.type, spec.gpu.count) == ("A100-40GB", 2)
    assert spec.backend == "auto" and spec.sampler == "tpe"
    assert spec.search_space.names == ("gpu_memory_utilization", "max_num_seqs")
    assert spec.search_space_file == REPO / "search_spaces" / "memory-pair.yaml"
    assert spec.constraints.max_preemptions == 0
    assert spec.objective.metrics == ("output_throughput",) and spec.objective.directions == ("maximize",)
    assert 24 <= spec.budget.trials <= 30 and spec.budget.parallel == 2
    assert spec.workload.output_len.mean >= 2 * spec.workload.input_len.mean  # long outputs
    assert 128 <= (spec.workload.concurrency or 0) <= 256 and 100 <= spec.workload.num_requests <= 1000
    assert spec.vllm_version == "0.26.0"
    assert spec.output.runs_dir == tmp_path / "servetune-runs"
    assert spec.storage.optuna_url == f"sqlite:///{tmp_path}/servetune-runs/optuna.db"
    assert spec.tracking.mlflow_uri == f"sqlite:///{tmp_path}/servetune-runs/mlflow.db"
    assert spec.warnings == ()
    assert spec.check({**spec.fixed_flags, "gpu_memory_utilization": 0.9, "max_num_seqs": 512}) == []
    json.dumps(spec.to_dict())  # loggable as plain data
    text = QUICKSTART.read_text()
    for section in ("name", "model", "gpu", "workload", "objective", "constraints", "search_space", "budget", "backend"):
        head = text.split(f"\n{section}:")[0].rstrip().splitlines()[-1]
        assert head.startswith("#"), f"section {section} has no comment above it"


@pytest.mark.parametrize("name", ["memory-pair", "joint", "latency"])
def test_shipped_spaces_by_bare_name(tmp_path: Path, name: str):
    gpu = {"type": "H200", "count": 8}
    spec = build(tmp_path, search_space=name, fixed_flags={}, gpu=gpu,
                 workload={"input_len": 512, "output_len": 256, "num_requests": 8, "concurrency": 4})
    assert spec.search_space_file == REPO / "search_spaces" / f"{name}.yaml"
    assert spec.search_space.pinned == {}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(5):
        flags = spec.trial_flags(study.ask())
        assert set(flags) <= set(spec.search_space.names)


def test_trial_flags_merge_fixed_and_conditions_read_pins(tmp_path: Path):
    spec = build(tmp_path, fixed_flags={"enforce_eager": True, "max_model_len": 1024},
                 search_space={"params": {"max_num_seqs": [8, 16], "max_cudagraph_capture_size": {
                     "type": "categorical", "choices": [16, 32], "when": {"enforce_eager": False}}}})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(5):
        flags = spec.trial_flags(study.ask())
        assert flags["enforce_eager"] is True and flags["max_model_len"] == 1024
        assert "max_cudagraph_capture_size" not in flags
    # the driver calls spec.search_space.suggest(trial) directly: pins still apply
    assert "max_cudagraph_capture_size" not in spec.search_space.suggest(study.ask())


# -- sections ------------------------------------------------------------------------------------

def test_defaults(tmp_path: Path):
    data = {k: copy.deepcopy(BASE[k]) for k in ("name", "model", "gpu", "workload", "search_space")}
    spec = StudySpec.from_dict(data, tmp_path, cwd=tmp_path)
    assert spec.objective.metrics == ("output_throughput",)
    assert spec.constraints.max_preemptions == 0 and spec.constraints.p99_ttft_ms is None
    assert (spec.budget.trials, spec.budget.parallel, spec.budget.time_limit_s) == (20, 1, None)
    assert (spec.backend, spec.sampler, spec.seed, spec.vllm_version) == ("auto", "tpe", 0, "0.26.0")
    assert spec.tracking.experiment == "unit"
    assert spec.output.dataset_dir == tmp_path / "servetune-runs" / "dataset"
    assert spec.fixed_flags == {}


def test_objectives(tmp_path: Path):
    spec = build(tmp_path, objective={"pareto": ["output_throughput", "p99_ttft_ms"]})
    assert spec.objective.metrics == ("output_throughput", "ttft_p99_ms")
    assert spec.objective.directions == ("maximize", "minimize") and spec.objective.is_pareto
    spec = build(tmp_path, objective="itl_p90_ms", sampler="nsga2")
    assert spec.objective.metrics == ("itl_p90_ms",) and spec.objective.directions == ("minimize",)
    spec = build(tmp_path, objective={"pareto": ["request_throughput", "e2e_p99_ms"], "directions": ["maximize", "minimize"]})
    assert spec.objective.directions == ("maximize", "minimize")
    assert build(tmp_path).constraints.limits() == {"preemptions": 0.0, "ttft_p99_ms": 2000.0}


def test_paths_resolve_relative_to_the_spec_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec_dir = tmp_path / "studies"
    (spec_dir / "models" / "tiny").mkdir(parents=True)
    shutil.copy(REPO / "platform/servetune/data/models/servetune-test-850m/config.json", spec_dir / "models/tiny")
    (spec_dir / "spaces").mkdir()
    (spec_dir / "spaces" / "mine.yaml").write_text("params:\n  max_num_seqs: [8, 16]\n")
    (spec_dir / "trace.jsonl").write_text('{"timestamp": 0, "input_length": 100, "output_length": 20}\n'
                                          '{"timestamp": 0.5, "input_length": 300, "output_length": 40}\n')
    (spec_dir / "gpus.yaml").write_text("gpus:\n  - {name: Unit-GPU-48G, memory_gib: 44.5, hbm_gbps: 900, "
                                        "bf16_tflops: 180, fp8_tflops: 360, interconnect_gbps: 32}\n")
    doc = {**copy.deepcopy(BASE), "model": "./models/tiny", "search_space": "spaces/mine.yaml", "fixed_flags": {},
           "workload": {"trace_file": "trace.jsonl"}, "gpu": {"type": "unit-gpu-48g", "count": 2, "file": "gpus.yaml"},
           "output": {"runs_dir": "out"}}
    (spec_dir / "study.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.chdir(tmp_path)
    spec = load_spec(spec_dir / "study.yaml")
    assert spec.model_ref == str((spec_dir / "models" / "tiny").resolve()) == spec.serve_model
    assert spec.search_space_file == (spec_dir / "spaces" / "mine.yaml").resolve()
    assert spec.workload.trace_file == spec_dir / "trace.jsonl"
    assert spec.gpu.type == "Unit-GPU-48G" and spec.gpu.file == str((spec_dir / "gpus.yaml").resolve())
    assert spec.output.runs_dir == tmp_path / "out"  # output: relative to the working directory
    # a max_model_len shorter than the trace's longest request (340 tokens) is refused
    with pytest.raises(SpecError) as err:
        StudySpec.from_dict({**doc, "fixed_flags": {"max_model_len": 256}}, spec_dir)
    assert err.value.field == "fixed_flags.max_model_len" and "340 tokens" in str(err.value)


def test_to_dict_masks_credentials(tmp_path: Path):
    spec = build(tmp_path, storage={"optuna_url": "postgresql://optuna:s3cr3t@db:5432/optuna"},
                 tracking={"mlflow_uri": "https://bob:hunter2@mlflow.example:443/?token=abc", "experiment": "e"})
    text = json.dumps(spec.to_dict())
    assert "s3cr3t" not in text and "hunter2" not in text and "abc" not in text
    assert spec.to_dict()["storage"]["optuna_url"] == "postgresql://optuna:***@db:5432/optuna"
    assert spec.storage.optuna_url == "postgresql://optuna:s3cr3t@db:5432/optuna"  # the real one stays usable
    assert redact_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    assert redact_url("http://user@host/x") == "http://user@host/x"
    assert build(tmp_path, storage={"optuna_url": "memory"}).storage.optuna_url is None


def test_with_overrides_revalidates(tmp_path: Path):
    spec = build(tmp_path)
    other = spec.with_overrides(backend="vllm", trials=3, parallel=1, seed=9)
    assert (other.backend, other.budget.trials, other.budget.parallel, other.seed) == ("vllm", 3, 1, 9)
    assert spec.budget.trials == 6  # the original is untouched
    with pytest.raises(SpecError) as err:
        spec.with_overrides(parallel=3)  # 3 one-GPU trials on gpu.count 2
    assert err.value.field == "budget.parallel" and "lower budget.parallel to 2" in str(err.value)
    with pytest.raises(SpecError) as err:
        spec.with_overrides(trials=0)
    assert err.value.field == "budget.trials"


def test_warnings_for_choices_that_never_start(tmp_path: Path):
    spec = build(tmp_path, model="qwen2.5-7b", gpu={"type": "H200", "count": 8},
                 search_space={"params": {"tensor_parallel_size": [1, 2, 4, 8]}})
    assert len(spec.warnings) == 1 and "tensor_parallel_size=8" in spec.warnings[0] and "28 attention heads" in spec.warnings[0]


# -- bad inputs: each names its field ------------------------------------------------------------

def _space(params: dict, **extra: Any) -> dict:
    return {"params": params, **extra}


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    # (id, changes to BASE, field, words in the message)
    ("unknown top key", {"budjet": {"trials": 3}}, "budjet", "did you mean 'budget'"),
    ("study section", {"study": {"name": "x"}}, "study", "name: my-study"),
    ("name type", {"name": 7}, "name", "non-empty string"),
    ("name chars", {"name": "my study/1"}, "name", "valid study name"),
    ("description type", {"description": ["x"]}, "description", "text"),
    ("model unknown", {"model": "llama-3.1-9b"}, "model", "did you mean 'llama-3.1-8b'"),
    ("model type", {"model": 8}, "model", "non-empty string"),
    ("model path missing", {"model": "./no/such/dir"}, "model", "path not found"),
    ("serve_model type", {"serve_model": 1}, "serve_model", "non-empty string"),
    ("gpu string", {"gpu": "H200"}, "gpu", "type:"),
    ("gpu type unknown", {"gpu": {"type": "H300", "count": 1}}, "gpu.type", "H200"),
    ("gpu type missing", {"gpu": {"count": 1}}, "gpu.type", "is required"),
    ("gpu interconnect unknown", {"gpu": {"type": "A100-80GB", "count": 2, "interconnect": "pcie-nop2p"}},
     "gpu.interconnect", "did you mean 'pcie-no-p2p'"),
    ("gpu count zero", {"gpu": {"type": "H200", "count": 0}}, "gpu.count", ">= 1"),
    ("gpu count text", {"gpu": {"type": "H200", "count": "two"}}, "gpu.count", "integer"),
    ("gpu unknown key", {"gpu": {"type": "H200", "cout": 2}}, "gpu.cout", "did you mean 'count'"),
    ("gpu file missing", {"gpu": {"type": "H200", "file": "nope.yaml"}}, "gpu.file", "file not found"),
    ("workload type", {"workload": [1, 2]}, "workload", "mapping"),
    ("workload unknown key", {"workload": {**BASE["workload"], "concurency": 3}}, "workload.concurency", "did you mean 'concurrency'"),
    ("workload pacing", {"workload": {"input_len": 10, "output_len": 10, "num_requests": 4}}, "workload", "concurrency"),
    ("objective metric", {"objective": {"metric": "throughput"}}, "objective.metric", "output_throughput"),
    ("objective both", {"objective": {"metric": "output_throughput", "pareto": ["a", "b"]}}, "objective", "exactly one"),
    ("objective pareto one", {"objective": {"pareto": ["output_throughput"]}}, "objective.pareto", "at least 2"),
    ("objective pareto dup", {"objective": {"pareto": ["p99_ttft_ms", "ttft_p99_ms"]}}, "objective.pareto", "twice"),
    ("objective pareto bad", {"objective": {"pareto": ["output_throughput", "p99_ttfb_ms"]}}, "objective.pareto[1]", "did you mean 'p99_ttft_ms'"),
    ("objective direction", {"objective": {"metric": "output_throughput", "direction": "minimize"}}, "objective.direction", "maximized"),
    ("objective directions len", {"objective": {"pareto": ["output_throughput", "p99_ttft_ms"], "directions": ["maximize"]}},
     "objective.directions", "2 directions"),
    ("objective directions word", {"objective": {"pareto": ["output_throughput", "p99_ttft_ms"], "directions": ["maximize", "down"]}},
     "objective.directions[1]", "minimize"),
    ("objective type", {"objective": 5}, "objective", "mapping"),
    ("constraints unknown", {"constraints": {"p99_ttft": 100}}, "constraints.p99_ttft", "did you mean 'p99_ttft_ms'"),
    ("constraints negative", {"constraints": {"max_preemptions": -1}}, "constraints.max_preemptions", ">= 0"),
    ("constraints null", {"constraints": {"max_preemptions": None}}, "constraints.max_preemptions", "max_preemptions: 0"),
    ("constraints latency", {"constraints": {"p99_itl_ms": 0}}, "constraints.p99_itl_ms", "positive"),
    ("constraints latency text", {"constraints": {"p99_e2e_ms": "fast"}}, "constraints.p99_e2e_ms", "positive"),
    ("space missing file", {"search_space": "memory-pairs"}, "search_space", "did you mean 'memory-pair'"),
    ("space type", {"search_space": 3}, "search_space", "file name or an inline mapping"),
    ("space flag name", {"search_space": _space({"gpu_mem_util": [0.5]})}, "search_space.params.gpu_mem_util", "unknown vLLM flag"),
    ("space bad rule", {"search_space": _space({"max_num_seqs": [8]}, rules=["os.system('x')"])}, "search_space.rules[0]", "function calls"),
    ("space cond unpinned", {"search_space": _space({"max_num_seqs": {"type": "categorical", "choices": [8, 16],
                                                                        "when": {"max_num_batched_tokens": 4096}}}),
                             "fixed_flags": {}}, "search_space.params.max_num_seqs.when", "pin max_num_batched_tokens"),
    ("fixed unknown flag", {"fixed_flags": {"max_num_seq": 8}}, "fixed_flags.max_num_seq", "did you mean 'max_num_seqs'"),
    ("fixed bad value", {"fixed_flags": {"gpu_memory_utilization": 1.5}}, "fixed_flags.gpu_memory_utilization", "<= 1"),
    ("fixed injection", {"fixed_flags": {"kv_cache_dtype": "fp8; rm -rf /"}}, "fixed_flags.kv_cache_dtype", "invalid value"),
    ("fixed type", {"fixed_flags": [1]}, "fixed_flags", "mapping"),
    ("fixed and searched", {"fixed_flags": {"max_num_seqs": 8}}, "fixed_flags.max_num_seqs", "also searched"),
    ("fixed tp over gpus", {"fixed_flags": {"tensor_parallel_size": 4}}, "fixed_flags.tensor_parallel_size", "gpu.count=2"),
    ("fixed tp heads", {"fixed_flags": {"tensor_parallel_size": 3}, "gpu": {"type": "H200", "count": 4}, "budget": {"parallel": 1}},
     "fixed_flags.tensor_parallel_size", "32 attention heads"),
    ("fixed mbt below seqs", {"fixed_flags": {"max_num_batched_tokens": 16}}, "fixed_flags.max_num_batched_tokens", "below max_num_seqs"),
    ("fixed max_model_len short", {"fixed_flags": {"max_model_len": 300}}, "fixed_flags.max_model_len", "384 tokens"),
    ("fixed max_model_len long", {"fixed_flags": {"max_model_len": 16384}}, "fixed_flags.max_model_len", "context of 8192"),
    ("space tp never divides", {"search_space": _space({"tensor_parallel_size": [3, 5]}), "gpu": {"type": "H200", "count": 8},
                                "budget": {"parallel": 1}}, "search_space.params.tensor_parallel_size", "attention heads"),
    ("space tp over gpus", {"search_space": _space({"tensor_parallel_size": [4, 8]})}, "search_space.params.tensor_parallel_size",
     "gpu.count=2"),
    ("space user rule never", {"search_space": _space({"max_num_seqs": [8, 16]}, rules=["max_num_seqs > gpu_count * 100"])},
     "search_space.rules[0]", "is false"),
    ("budget trials", {"budget": {"trials": 0}}, "budget.trials", ">= 1"),
    ("budget trials float", {"budget": {"trials": 2.5}}, "budget.trials", "integer"),
    ("budget parallel over gpus", {"budget": {"trials": 6, "parallel": 3}}, "budget.parallel", "gpu.count is 2"),
    ("budget parallel x tp", {"budget": {"parallel": 2}, "fixed_flags": {"tensor_parallel_size": 2}}, "budget.parallel", "2 per trial"),
    ("budget time", {"budget": {"time_limit_s": -5}}, "budget.time_limit_s", "positive"),
    ("budget unknown", {"budget": {"trails": 5}}, "budget.trails", "did you mean 'trials'"),
    ("backend", {"backend": "vlm"}, "backend", "did you mean 'vllm'"),
    ("sampler", {"sampler": "tpe2"}, "sampler", "did you mean 'tpe'"),
    ("sampler type", {"sampler": 1}, "sampler", "one of"),
    ("seed", {"seed": -1}, "seed", ">= 0"),
    ("seed text", {"seed": "abc"}, "seed", "integer"),
    ("version float", {"vllm_version": 0.26}, "vllm_version", "quote it"),
    ("version text", {"vllm_version": "latest"}, "vllm_version", "0.26.0"),
    ("tracking type", {"tracking": "http://x"}, "tracking", "mapping"),
    ("tracking unknown", {"tracking": {"mlflow_url": "http://x"}}, "tracking.mlflow_url", "did you mean 'mlflow_uri'"),
    ("tracking empty uri", {"tracking": {"mlflow_uri": ""}}, "tracking.mlflow_uri", "non-empty"),
    ("storage url", {"storage": {"optuna_url": "optuna.db"}}, "storage.optuna_url", "sqlite:///"),
    ("storage unknown", {"storage": {"url": "sqlite:///x.db"}}, "storage.url", "optuna_url"),
    ("output unknown", {"output": {"run_dir": "x"}}, "output.run_dir", "did you mean 'runs_dir'"),
    ("output type", {"output": {"runs_dir": 5}}, "output.runs_dir", "non-empty string"),
    ("grid conditional", {"sampler": "grid", "search_space": _space({
        "enforce_eager": {"type": "bool"},
        "max_cudagraph_capture_size": {"type": "categorical", "choices": [64, 128], "when": {"enforce_eager": False}}})},
     "sampler", "conditional parameter"),
    ("grid float no step", {"sampler": "grid", "search_space": _space({"gpu_memory_utilization": {"type": "float", "low": 0.5,
                                                                                                   "high": 0.9}})},
     "search_space.params.gpu_memory_utilization", "add step"),
    ("measurement generator", {"measurement": {"load_generator": "vllm_bench"}}, "measurement.load_generator",
     "did you mean 'vllm-bench'"),
    ("measurement stall", {"measurement": {"stall_timeout_s": 0}}, "measurement.stall_timeout_s", "positive"),
    ("measurement unknown", {"measurement": {"startup_timeout": 60}}, "measurement.startup_timeout",
     "did you mean 'startup_timeout_s'"),
]


def test_grid_sampler_caps_the_budget_at_the_grid_size(tmp_path: Path):
    data = {**copy.deepcopy(BASE), "sampler": "grid", "budget": {"trials": 50, "parallel": 1},
            "search_space": _space({"max_num_seqs": [16, 32, 64], "gpu_memory_utilization": [0.8, 0.9]})}
    spec = StudySpec.from_dict(data, cwd=tmp_path)
    assert spec.budget.trials == 6 and any("capped at 6" in w for w in spec.warnings)


def test_measurement_defaults_and_values(tmp_path: Path):
    spec = StudySpec.from_dict(copy.deepcopy(BASE), cwd=tmp_path)
    assert (spec.measurement.load_generator, spec.measurement.startup_timeout_s) == ("servetune", None)
    data = {**copy.deepcopy(BASE), "measurement": {"load_generator": "vllm-bench", "startup_timeout_s": 240}}
    spec = StudySpec.from_dict(data, cwd=tmp_path)
    assert spec.measurement.load_generator == "vllm-bench" and spec.to_dict()["measurement"]["startup_timeout_s"] == 240


@pytest.mark.parametrize("changes, field, words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_specs_name_the_field(tmp_path: Path, changes: dict, field: str, words: str):
    with pytest.raises(SpecError) as err:
        build(tmp_path, **changes)
    assert err.value.field == field, str(err.value)
    assert words in str(err.value), str(err.value)
    assert err.value.fix, "every error says how to fix it"


@pytest.mark.parametrize("text, words", [
    ("name: x\nmodel: [unclosed\n", "line 3"),
    ("name: x\n  model: y\n", "line 2"),
    ("name: x\nname: y\n", "duplicate key 'name'"),
    ("\t- broken", "line 1"),
    ("", "is empty"),
    ("- a\n- b\n", "expected a mapping"),
])
def test_malformed_yaml_files(tmp_path: Path, text: str, words: str):
    path = tmp_path / "study.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert err.value.field == "spec" and words in str(err.value), str(err.value)


def test_missing_spec_file(tmp_path: Path):
    with pytest.raises(SpecError, match="file not found"):
        load_spec(tmp_path / "nope.yaml")


# -- a generator of broken specs: each must be a SpecError, never a KeyError or TypeError ---------

JUNK: list[Any] = [None, 0, -1, 1.5, True, "", "zzz", [], [None], {}, {"zzz": 1}, [[1]], float("nan")]


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _drop(doc: Any, path: tuple) -> None:
    for key in path[:-1]:
        doc = doc[key]
    del doc[path[-1]]


def broken_specs() -> list[tuple[str, dict]]:
    """Definitely-invalid mutations of BASE: required keys dropped, wrong types, unknown keys."""
    out: list[tuple[str, dict]] = []
    required = [("name",), ("model",), ("gpu",), ("workload",), ("search_space",), ("gpu", "type"),
                ("workload", "output_len"), ("workload", "num_requests"), ("workload", "concurrency"),
                ("search_space", "params")]
    for path in required:
        doc = copy.deepcopy(BASE)
        _drop(doc, path)
        out.append(("drop " + ".".join(map(str, path)), doc))
    wrong_types = {("name",): [3, [], {}], ("model",): [3, [], {}], ("gpu",): [3, "H200", []],
                   ("gpu", "count"): ["2", [], 0.5], ("workload",): [3, "w", []], ("workload", "input_len"): ["x", [], True],
                   ("objective",): [3, [], True], ("constraints",): [3, "x", []], ("search_space",): [3, [], True],
                   ("search_space", "params"): [3, [], "x"], ("search_space", "rules"): [3, "x", [1]],
                   ("fixed_flags",): [3, "x", [1]], ("budget",): [3, "x", []], ("budget", "trials"): ["x", [], 0],
                   ("backend",): [3, [], "gpu"], ("sampler",): [3, [], "cma"], ("seed",): ["x", [], 1.5],
                   ("vllm_version",): [3, [], "v0"], ("tracking",): [3, "x", []], ("storage",): [3, "x", []],
                   ("output",): [3, "x", []]}
    for path, values in wrong_types.items():
        for value in values:
            doc = copy.deepcopy(BASE)
            _set(doc, path, value)
            out.append((f"{'.'.join(path)}={value!r}", doc))
    for section in (None, "gpu", "workload", "objective", "constraints", "search_space", "budget", "tracking",
                    "storage", "output", ("search_space", "params", "max_num_seqs")):
        doc = copy.deepcopy(BASE)
        node = doc
        for key in (() if section is None else (section,) if isinstance(section, str) else section):
            node = node.setdefault(key, {})
        node["zz_unknown"] = 1
        out.append((f"unknown key in {section}", doc))
    return out


@pytest.mark.parametrize("label, doc", broken_specs(), ids=[b[0] for b in broken_specs()])
def test_generated_broken_specs_raise_spec_error(tmp_path: Path, label: str, doc: dict):
    with pytest.raises(SpecError) as err:
        StudySpec.from_dict(doc, tmp_path, cwd=tmp_path)
    assert err.value.field and err.value.fix, label


def test_random_mutations_never_escape_as_other_errors(tmp_path: Path):
    rng = random.Random(20261130)
    paths = _paths(BASE)
    outcomes = {"ok": 0, "spec_error": 0}
    for _ in range(250):
        doc = copy.deepcopy(BASE)
        for _ in range(rng.randint(1, 2)):
            live = [p for p in _paths(doc)] or paths
            path = rng.choice(live)
            if rng.random() < 0.2 and isinstance(path[-1], str):
                _drop(doc, path)
            else:
                _set(doc, path, copy.deepcopy(rng.choice(JUNK)))
        try:
            StudySpec.from_dict(doc, tmp_path, cwd=tmp_path)
            outcomes["ok"] += 1
        except SpecError as exc:
            assert exc.field, doc
            outcomes["spec_error"] += 1
    assert outcomes["spec_error"] > 150  # most junk is rejected; the rest was harmless (e.g. description: null)


def test_workload_values_workload_does_not_vet_still_raise_spec_error(tmp_path: Path):
    nan_len = {"input_len": {"dist": "uniform", "min": 10, "max": float("nan")}, "output_len": 20,
               "num_requests": 4, "concurrency": 2}
    with pytest.raises(SpecError) as err:
        build(tmp_path, workload=nan_len)
    assert err.value.field.startswith("workload")
    with pytest.raises(SpecError) as err:  # refused before a billion requests are generated
        build(tmp_path, workload={**BASE["workload"], "num_requests": 10**9})
    assert err.value.field == "workload.num_requests"


def test_huge_int_ranges_load_without_listing_them(tmp_path: Path):
    spec = build(tmp_path, fixed_flags={}, search_space={"params": {
        "max_num_batched_tokens": {"type": "int", "low": 64, "high": 4194304, "log": True},
        "max_num_seqs": {"type": "int", "low": 1, "high": 65536, "log": True}}})
    assert spec.search_space.size() == (4194304 - 64 + 1) * 65536
    assert not spec.search_space.feasibility(spec.model_profile, 2, spec.workload).exhaustive
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    flags = spec.trial_flags(study.ask())
    assert 64 <= flags["max_num_batched_tokens"] <= 4194304


def test_confirm_on_defaults_to_same_start_and_refuses_other_words(tmp_path: Path) -> None:
    assert StudySpec.from_dict(copy.deepcopy(BASE), cwd=tmp_path).budget.confirm_on == "same-start"
    restart = copy.deepcopy(BASE)
    restart["budget"]["confirm_on"] = "restart"
    spec = StudySpec.from_dict(restart, cwd=tmp_path)
    assert spec.budget.confirm_on == "restart"
    assert spec.to_dict()["budget"]["confirm_on"] == "restart"  # recorded with the study
    bad = copy.deepcopy(BASE)
    bad["budget"]["confirm_on"] = "same-server"
    with pytest.raises(SpecError) as err:
        StudySpec.from_dict(bad, cwd=tmp_path)
    assert err.value.field == "budget.confirm_on" and "same-start" in str(err.value)


def test_wait_for_gpus_defaults_to_30_s_and_refuses_what_a_worker_start_would_exceed(tmp_path: Path) -> None:
    assert StudySpec.from_dict(copy.deepcopy(BASE), cwd=tmp_path).budget.wait_for_gpus_s == 30.0
    longer = copy.deepcopy(BASE)
    longer["budget"]["wait_for_gpus_s"] = 600
    assert StudySpec.from_dict(longer, cwd=tmp_path).budget.wait_for_gpus_s == 600.0
    for bad, words in ((5, "at least 10 s"), (0, "positive number"), ("soon", "positive number"),
                       (True, "positive number")):
        data = copy.deepcopy(BASE)
        data["budget"]["wait_for_gpus_s"] = bad
        with pytest.raises(SpecError) as err:
            StudySpec.from_dict(data, cwd=tmp_path)
        assert err.value.field == "budget.wait_for_gpus_s" and words in str(err.value) and err.value.fix


def test_gpu_interconnect_defaults_by_type_and_a_stated_one_reaches_the_gpu_spec(tmp_path: Path) -> None:
    """gpu.interconnect is optional: unset, the GPU type's usual host (an SXM part's NVLink); set, the
    study's GPU is priced on it (the simulator's TP all-reduce, planner.comm.allreduce_cost)."""
    assert build(tmp_path, gpu={"type": "A100-80GB", "count": 2}).gpu_spec().link == "nvlink"
    spec = build(tmp_path, gpu={"type": "A100-80GB", "count": 2, "interconnect": "PCIe-No-P2P"})
    assert spec.gpu.interconnect == "pcie-no-p2p" and spec.gpu_spec().link == "pcie-no-p2p"
    assert spec.gpu_spec().name == "A100-80GB"


def test_a_stated_interconnect_reaches_the_studys_simulated_trials_and_screen(tmp_path: Path) -> None:
    """The spec's gpu.interconnect travels with every trial's task (study._tasks.trial_task) and the
    screen's simulations (search.screen.simulate_flags): a TP=2 trial on a host without GPU P2P is
    simulated slower than on the part's usual NVLink, where the planner's memory is the same."""
    from servetune.search.screen import simulate_flags
    from servetune.study._tasks import trial_task

    gpu = {"type": "A100-80GB", "count": 2}
    nvlink = build(tmp_path, gpu=gpu)
    no_p2p = build(tmp_path, gpu={**gpu, "interconnect": "pcie-no-p2p"})
    assert trial_task(no_p2p, {}, tmp_path).interconnect == "pcie-no-p2p"
    assert trial_task(nvlink, {}, tmp_path).interconnect is None
    flags = {"tensor_parallel_size": 2, "max_num_seqs": 16}
    fast, slow = simulate_flags(nvlink, flags), simulate_flags(no_p2p, flags)
    assert fast.status.value == slow.status.value == "ok"
    assert fast.kv_cache_tokens == slow.kv_cache_tokens
    assert slow.output_throughput < 0.97 * fast.output_throughput
