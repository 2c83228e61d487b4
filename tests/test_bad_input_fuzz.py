"""Bad-input fuzz: broken variants of jobs/quickstart.yaml are refused with SpecError only.

A seeded generator derives broken specs from the valid quickstart: dropped required keys, wrong
types, unknown keys, out-of-range numbers, impossible combinations, broken YAML, a model directory
without config.json, a search space with no valid point, workload files with broken lines, and
random pairs of those. Every case must raise :class:`SpecError` on ``load_spec`` (never another
exception, never acceptance); a sample goes through the real CLI, which must exit 2, name the field
on stderr and create no runs dir.

Beside it, a property-based fuzz (hypothesis, derandomized, 50 examples per reader) of the spec, the
workload, the trace and the config.json readers: any value anywhere (NaN, infinities, 30-digit
integers, strings, nested lists and mappings) and any text, where each reader must either parse or
raise :class:`SpecError`: never another exception.
"""

from __future__ import annotations

import copy
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from servetune.errors import SpecError
from servetune.spec.schema import load_spec

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())
SEED = 20261130
MIN_CASES = 300

Mutation = Callable[[dict[str, Any], Path], None]  # edits the spec data in place; may write files


def _set(path: str, value: Any) -> Mutation:
    def apply(data: dict[str, Any], _: Path) -> None:
        node = data
        *parents, leaf = path.split(".")
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[leaf] = value
    apply.__name__ = f"set {path}={value!r}"
    return apply


def _drop(path: str) -> Mutation:
    def apply(data: dict[str, Any], _: Path) -> None:
        node = data
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        node.pop(leaf, None)
    apply.__name__ = f"drop {path}"
    return apply


def _model_dir_without_config(data: dict[str, Any], tmp: Path) -> None:
    model = tmp / "my-model"
    model.mkdir(exist_ok=True)
    (model / "tokenizer.json").write_text("{}")
    data["model"] = str(model)


def _broken_jsonl(lines: list[str], key: str) -> Mutation:
    def apply(data: dict[str, Any], tmp: Path) -> None:
        path = tmp / f"{key}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        workload = data["workload"]
        for k in ("input_len", "num_requests", "concurrency"):
            if key == "trace_file":
                workload.pop(k, None)
        if key == "trace_file":
            workload.pop("output_len", None)
            workload["request_rate"] = None
            workload.pop("request_rate")
        workload[key] = str(path)
    apply.__name__ = f"broken {key}: {lines!r}"[:80]
    return apply


_WRONG_TYPES: list[Any] = ["many", [1, 2], {"a": 1}, None, True, -1, 0, 1.5, 10**12, float("nan")]

# (dotted field, bad values): each value is invalid for that field whatever else the spec says.
_BAD_VALUES: dict[str, list[Any]] = {
    "name": [123, "", "has space", "a/b", "x" * 200, ["list"], "quote'name"],
    "description": [5, ["a"], {"k": "v"}],
    "model": [42, "", "/no/such/dir/model", ["llama"], "no-such-model-xyz"],
    "gpu": ["A100", 3, ["A100-40GB"]],
    "gpu.type": ["A100-41GB", 40, "", None, ["H200"]],
    "gpu.count": [0, -1, "two", 1.5, [2], 100000],
    "workload": ["lots", 7, [1, 2]],
    "workload.input_len": [0, -5, "long", [1], {"dist": "zipf"}, {"dist": "uniform", "min": 9, "max": 3}],
    "workload.output_len": [0, -1, "x", {"dist": "normal"}, float("inf")],
    "workload.num_requests": [0, -3, "all", 1.5, 10**12],
    "workload.concurrency": [0, -2, "full", [4]],
    "workload.request_rate": [5.0, -1.0],  # with concurrency also set: exactly one of the two
    "workload.seed": ["s", -1, [0]],
    "objective": ["fast", 3],
    "objective.metric": ["speed", 5, "", "p99_ttft_msec"],
    "objective.pareto": [["output_throughput"], "output_throughput", ["output_throughput", "output_throughput"]],
    "objective.direction": ["up", 1],
    "constraints": ["none", 5],
    "constraints.max_preemptions": [-1, "none", 1.5, [0]],
    "constraints.p99_ttft_ms": [-5, 0, "fast"],
    "constraints.p99_itl_ms": [-1, "x"],
    "search_space": [5, "no-such-space", ["memory-pair"], {"params": "x"}, {"params": {}}],
    "fixed_flags": ["x", [1, 2], 5],
    "fixed_flags.max_model_len": [-1, 0, "big", 1.5, 10**9],
    "fixed_flags.gpu_memory_utilization": [1.5, 0, -0.1, "0.9; rm -rf /", "lots"],
    "fixed_flags.kv_cache_dtype": ["fp7", "auto; rm -rf /", 8],
    "fixed_flags.max_num_seq": [64],  # unknown flag (typo)
    "fixed_flags.tensor_parallel_size": [0, -2, "two", 3, 64],
    "fixed_flags.enforce_eager": ["sometimes", 2],
    "fixed_flags.block_size": [7, 0, "big"],
    "budget": ["all", 5],
    "budget.trials": [0, -1, "many", 1.5],
    "budget.parallel": [0, -1, 3, 99, "two"],
    "budget.time_limit_s": [0, -10, "an hour"],
    "backend": ["gpu", 5, "", "SIM"],
    "sampler": ["bayes", 3, ""],
    "prescreen": ["yes", 1, "no"],
    "seed": [-1, "s", 2**40, 1.5],
    "vllm_version": [0.26, "latest", 26, "v0.26"],
    "tracking": ["mlflow", 5],
    "tracking.experiment": [5, "", ["e"]],
    "tracking.mlflow_uri": [5, ""],
    "storage": ["db", 3],
    "storage.optuna_url": ["optuna.db", 5, ""],
    "output": ["out", 3],
    "replay_file": ["grid.csv"],  # with backend auto: applies to replay only
}

_UNKNOWN_KEYS = ["study", "nme", "models", "gpus", "work_load", "objectives", "constraint", "searchspace",
                 "fixed_flag", "budgets", "backends", "samplr", "trackng", "store", "outputs", "extra"]
_NESTED_UNKNOWN = ["gpu.typ", "workload.input_length", "workload.prompt_len", "budget.trial",
                   "constraints.max_preemption", "objective.metrics", "tracking.experiments",
                   "storage.url", "output.run_dir", "gpu.counts"]

_BROKEN_YAML = [
    "name: [unclosed\nmodel: llama-3.1-8b\n",
    "name: a\n\tmodel: b\n",
    "name: a\nmodel: llama-3.1-8b\n  gpu: x\n",
    "{name: a, model: b",
    "name: a\nname: b\n: c\n",
    "- just\n- a\n- list\n",
    "just a string\n",
    "42\n",
    "name: 'unterminated\n",
    "key: value: other\n",
    "name: a\nworkload: {input_len: 512, output_len\n",
    "!!python/object/apply:os.system ['echo pwned']\n",
    "",
    "# only a comment\n",
    "name: a\n%invalid directive\n",
]

_IMPOSSIBLE: list[list[Mutation]] = [
    # TP larger than the GPUs the study has
    [_set("fixed_flags.tensor_parallel_size", 4)],
    # a flag pinned and searched at once
    [_set("fixed_flags.gpu_memory_utilization", 0.9)],
    # max_model_len shorter than the workload's prompt + output
    [_set("fixed_flags.max_model_len", 256)],
    # max_model_len beyond the model's context
    [_set("fixed_flags.max_model_len", 10_000_000)],
    # both concurrency and request_rate
    [_set("workload.request_rate", 4.0)],
    # 3 trials at once on 2 GPUs
    [_set("budget.parallel", 3)],
    # search spaces with no valid point (by the rules: heads, GPU count, bounds, a rule nothing meets).
    # Not here: utilization choices all below the weights ([0.01, 0.02]) load, by design: memory is
    # the planner's verdict at run time (every trial `pruned`), not a static rule.
    [_set("search_space", {"params": {"tensor_parallel_size": {"type": "categorical", "choices": [3, 5]}}})],
    [_set("search_space", {"params": {"max_num_seqs": {"type": "int", "low": 64, "high": 16}}})],
    [_set("search_space", {"params": {"max_num_seqs": [16, 32]}, "rules": ["max_num_seqs > 1000"]})],
    # a model directory without config.json
    [_model_dir_without_config],
    # broken workload files
    [_broken_jsonl(['{"prompt": "hi"}', "{not json"], "prompt_file")],
    [_broken_jsonl(['["a list"]'], "prompt_file")],
    [_broken_jsonl([""], "prompt_file")],
    [_broken_jsonl(['{"timestamp": 0, "input_length": 5, "output_length": 3}', "garbage"], "trace_file")],
    [_broken_jsonl(['{"timestamp": "x", "input_length": -5}'], "trace_file")],
]


def _single_mutations() -> Iterator[tuple[str, list[Mutation]]]:
    for key in ("name", "model", "gpu", "workload", "search_space", "gpu.type", "workload.output_len"):
        yield f"drop {key}", [_drop(key)]
    for field, values in _BAD_VALUES.items():
        for value in values:
            yield f"{field}={value!r}"[:90], [_set(field, value)]
    for key in _UNKNOWN_KEYS:
        yield f"unknown {key}", [_set(key, 1)]
    for key in _NESTED_UNKNOWN:
        yield f"unknown {key}", [_set(key, 1)]
    for i, mutations in enumerate(_IMPOSSIBLE):
        yield f"impossible #{i}: {mutations[0].__name__}"[:90], mutations
    for field in ("gpu.count", "budget.trials", "workload.input_len", "seed", "constraints.max_preemptions"):
        for value in _WRONG_TYPES:
            if field == "seed" and value in (0, True):  # seed 0 / True are valid-ish ints
                continue
            if field == "constraints.max_preemptions" and (value == 0 or value is None or value is True
                                                           or value == 10**12):
                continue
            if field in ("gpu.count",) and value is True:
                continue
            yield f"{field}={value!r} (type)"[:90], [_set(field, value)]


def _cases() -> list[tuple[str, list[Mutation] | str]]:
    """Every single mutation, the broken YAML texts, and seeded random pairs up to MIN_CASES + 50."""
    singles = list(_single_mutations())
    cases: list[tuple[str, list[Mutation] | str]] = [*singles]
    cases += [(f"yaml #{i}", text) for i, text in enumerate(_BROKEN_YAML)]
    rng = random.Random(SEED)
    while len(cases) < MIN_CASES + 50:
        (a_id, a), (b_id, b) = rng.sample(singles, 2)
        cases.append((f"{a_id} + {b_id}"[:120], [*a, *b]))
    return cases


CASES = _cases()


def _write_case(case: list[Mutation] | str, tmp: Path) -> Path:
    spec_path = tmp / "spec.yaml"
    if isinstance(case, str):
        spec_path.write_text(case)
        return spec_path
    data = copy.deepcopy(QUICKSTART)
    data["output"] = {"runs_dir": str(tmp / "runs")}
    for mutation in case:
        mutation(data, tmp)
    spec_path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return spec_path


def test_the_unbroken_quickstart_loads(tmp_path: Path) -> None:
    spec = load_spec(_write_case([], tmp_path))  # the generator's base is valid: refusals are the mutations'
    assert spec.name == "quickstart"


def test_every_broken_spec_is_refused_with_a_spec_error(tmp_path: Path) -> None:
    tried, refused, wrong = 0, 0, []
    for i, (case_id, case) in enumerate(CASES):
        case_dir = tmp_path / f"c{i:04d}"
        case_dir.mkdir()
        tried += 1
        try:
            load_spec(_write_case(case, case_dir))
        except SpecError as exc:
            refused += 1
            assert exc.field, f"{case_id}: SpecError without a field"
            continue
        except Exception as exc:  # noqa: BLE001 - the point: anything else is a bug
            wrong.append(f"{case_id}: {type(exc).__name__}: {exc}"[:300])
            continue
        wrong.append(f"{case_id}: ACCEPTED")
    print(f"\nbad-input fuzz: {tried} cases tried, {refused} refused with SpecError")
    assert tried >= MIN_CASES
    assert not wrong, "\n".join(wrong)
    assert refused == tried


# A sample through the real CLI: (case id, the field stderr must name).
_CLI_SAMPLE = [
    ("drop model", "model"),
    ("gpu.count=0", "gpu.count"),
    ("budget.trials=0", "budget.trials"),
    ("fixed_flags.gpu_memory_utilization='0.9; rm -rf /'", "fixed_flags"),
    ("backend='gpu'", "backend"),
    ("vllm_version=0.26", "vllm_version"),
    ("unknown nme", "nme"),
    ("workload.input_len=0", "workload.input_len"),
    ("sampler='bayes'", "sampler"),
    ("storage.optuna_url='optuna.db'", "storage.optuna_url"),
]


@pytest.mark.parametrize(("case_id", "field"), _CLI_SAMPLE)
def test_cli_refuses_with_exit_2_naming_the_field(tmp_path: Path, case_id: str, field: str) -> None:
    case = dict(CASES)[case_id]
    spec_path = _write_case(case, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "servetune", "tune", str(spec_path)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120,
                          env={"PYTHONPATH": str(REPO / "platform"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert field in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "servetune-runs").exists()


# ------------------------------------------------------------------------------------ property-based fuzz
import json  # noqa: E402 - the property-based part's own imports
import math  # noqa: E402
import tempfile  # noqa: E402

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from servetune.planner.modelinfo import load_model  # noqa: E402
from servetune.workload import Workload  # noqa: E402

FUZZ = settings(max_examples=50, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

_NUMBERS = st.one_of(st.integers(-10**30, 10**30), st.floats(allow_nan=True, allow_infinity=True),
                     st.sampled_from([0, -1, 1, 2, 64, 2**31, 2**63, 1e308, 0.5, -0.0]))
_SCALARS = st.one_of(st.none(), st.booleans(), _NUMBERS, st.text(max_size=12))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                       max_leaves=8)
_YAML_TEXT = st.text(alphabet="[]{}:&*!|>-#'\"\n ,.0123456789aeinx_", max_size=300)

# Where a value can go: every key of the quickstart, and the workload's keys.
_SPEC_PATHS = sorted({f"{k}.{sub}" if sub else k for k, v in QUICKSTART.items()
                      for sub in (list(v) if isinstance(v, dict) else [""])}
                     | {f"workload.{k}" for k in Workload.KEYS if k not in ("prompt_file", "trace_file")}
                     | {"workload.input_len.dist", "workload.input_len.mean", "workload.input_len.max",
                        "budget.time_limit_s", "constraints.p99_ttft_ms", "fixed_flags.gpu_memory_utilization"})


def _refused_or_parsed(read: Callable[[], Any]) -> None:
    """The property: ``read()`` returns, or raises SpecError with a field, or the one-line message."""
    try:
        read()
    except SpecError as exc:
        assert str(exc) and "\n" not in str(exc)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_SPEC_PATHS), _VALUES), min_size=1, max_size=3))
def test_fuzz_spec_values_parse_or_raise_spec_error(changes: list[tuple[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_case([_set(where, value) for where, value in changes], Path(tmp))
        _refused_or_parsed(lambda: load_spec(path))


@FUZZ
@given(_YAML_TEXT)
def test_fuzz_spec_text_parses_or_raises_spec_error(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.yaml"
        path.write_text(text)
        _refused_or_parsed(lambda: load_spec(path))


@FUZZ
@given(st.dictionaries(st.sampled_from([k for k in Workload.KEYS if k not in ("prompt_file", "trace_file")]),
                       _VALUES, max_size=6))
@example({"input_len": 512, "output_len": 128, "num_requests": 10, "request_rate": math.nan})  # was accepted
@example({"input_len": {"dist": "normal", "mean": 100, "std": 1, "max": math.inf}, "output_len": 1, "num_requests": 1,
          "concurrency": 1})
def test_fuzz_workload_parses_or_raises_spec_error(data: dict[str, Any]) -> None:
    def read() -> None:
        w = Workload.from_dict(data)
        assert w.token_bound() >= 0
        if w.request_rate is not None:
            assert math.isfinite(w.request_rate) and w.request_rate > 0
    _refused_or_parsed(read)


_TRACE_NUMBER = st.one_of(st.integers(-10, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                          st.sampled_from([0, -5, 1, 0.5, 10**30]), _SCALARS)
_TRACE_LINE = st.one_of(
    st.fixed_dictionaries({"timestamp": _TRACE_NUMBER, "input_length": _TRACE_NUMBER, "output_length": _TRACE_NUMBER})
    .map(lambda row: json.dumps(row, allow_nan=True)),
    st.fixed_dictionaries({"timestamp": st.floats(allow_nan=True, allow_infinity=True),
                           "input_length": st.integers(-3, 3), "output_length": st.integers(-3, 3)})
    .map(lambda row: json.dumps(row, allow_nan=True)),
    st.text(alphabet='{}[]":,0123456789.-eNaInfity ', max_size=60))


@FUZZ
@given(st.lists(_TRACE_LINE, min_size=1, max_size=5))
@example(['{"timestamp": NaN, "input_length": 5, "output_length": 3}'])  # the cases found by hand
@example(['{"timestamp": 0, "input_length": -5, "output_length": 3}'])
@example(['{"timestamp": 0, "input_length": 5, "output_length": 0}'])
def test_fuzz_trace_parses_or_raises_spec_error(lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "trace.jsonl").write_text("\n".join(lines) + "\n")

        def read() -> None:
            w = Workload.from_dict({"trace_file": "trace.jsonl"}, base_dir=Path(tmp))
            for r in w.requests():  # what a parsed trace holds: finite times, positive lengths
                assert r.prompt_tokens >= 1 and r.output_tokens >= 1
                assert r.arrival_s is not None and math.isfinite(r.arrival_s) and r.arrival_s >= 0
        _refused_or_parsed(read)


_CONFIG = json.loads((REPO / "platform" / "servetune" / "data" / "models" / "mixtral-8x7b" / "config.json").read_text())
# The keys the planner reads, and the nested ones it reads values from.
_CONFIG_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "vocab_size", "max_position_embeddings", "num_local_experts", "num_experts_per_tok", "head_dim",
                "moe_intermediate_size", "torch_dtype", "architectures", "quantization_config", "rope_scaling",
                "text_config"]
_CONFIG_VALUES = st.one_of(_NUMBERS, _VALUES, st.fixed_dictionaries(
    {"quant_method": st.sampled_from(["awq", "gptq", "compressed-tensors", "fp8"]), "bits": _NUMBERS,
     "group_size": _NUMBERS, "config_groups": _VALUES}), st.fixed_dictionaries(
    {"rope_type": st.sampled_from(["yarn", "linear", "dynamic"]), "factor": _NUMBERS,
     "original_max_position_embeddings": _NUMBERS}))


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_CONFIG_KEYS), _CONFIG_VALUES), min_size=1, max_size=3),
       st.sampled_from(["", "NaN", "Infinity", "-Infinity", "1e999", "1" * 400, '"64"']))
def test_fuzz_config_json_parses_or_raises_spec_error(changes: list[tuple[str, Any]], raw: str) -> None:
    cfg = dict(_CONFIG)
    for key, value in changes:
        cfg[key] = value
    text = json.dumps(cfg, allow_nan=True)
    if raw:  # a raw token json.dumps would not write, in place of the first change's value
        cfg[changes[0][0]] = "__RAW__"
        text = json.dumps(cfg, allow_nan=True).replace('"__RAW__"', raw)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(text)
        _refused_or_parsed(lambda: load_model(tmp))
