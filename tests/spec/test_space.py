"""Search spaces: parsing, define-by-run sampling with a real Optuna study, rules, grids."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest

from servetune.errors import SpecError
from servetune.planner.modelinfo import load_model, profile_from_config
from servetune.spec.space import Expr, Rule, SearchSpace, parse_yaml
from servetune.workload import Workload

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "search_spaces").glob("*.yaml"))

optuna.logging.set_verbosity(optuna.logging.WARNING)


def space(params: dict, rules: list | None = None) -> SearchSpace:
    data: dict = {"params": params}
    if rules is not None:
        data["rules"] = rules
    return SearchSpace.from_dict(data)


CONDITIONAL = {
    "gpu_memory_utilization": {"type": "float", "low": 0.5, "high": 0.95, "step": 0.05},
    "max_num_seqs": {"type": "int", "low": 16, "high": 512, "log": True},
    "enforce_eager": {"type": "bool"},
    "max_cudagraph_capture_size": {"type": "int", "low": 64, "high": 512, "step": 64, "when": {"enforce_eager": False}},
    "kv_cache_dtype": ["auto", "fp8"],
}


# -- shipped files ------------------------------------------------------------------------------

def test_three_shipped_spaces_exist():
    assert {p.stem for p in SHIPPED} >= {"memory-pair", "joint", "latency"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_space_loads_has_header_and_round_trips(path: Path):
    s = SearchSpace.load(path)
    assert s.names and s.description
    assert path.read_text().startswith("# "), "each shipped space starts with a header comment"
    assert SearchSpace.from_dict(s.to_dict()) == s
    assert s.size() == len(s.grid())  # the shipped spaces are all finite and listable


def test_memory_pair_shape():
    s = SearchSpace.load(REPO / "search_spaces" / "memory-pair.yaml")
    assert s.names == ("gpu_memory_utilization", "max_num_seqs")
    gmu = s["gpu_memory_utilization"].values()
    assert gmu[0] == 0.3 and gmu[-1] == 0.95 and len(gmu) == 14
    assert s["max_num_seqs"].low == 16 and s["max_num_seqs"].high == 512 and s["max_num_seqs"].log
    assert s.size() == 14 * 497


def test_joint_has_conditional_cudagraph_and_rules():
    s = SearchSpace.load(REPO / "search_spaces" / "joint.yaml")
    for name in ("max_num_batched_tokens", "tensor_parallel_size", "pipeline_parallel_size", "enforce_eager",
                 "max_cudagraph_capture_size", "max_model_len", "kv_cache_dtype", "enable_prefix_caching"):
        assert name in s
    assert s["max_cudagraph_capture_size"].when is not None
    assert s.names.index("enforce_eager") < s.names.index("max_cudagraph_capture_size")
    assert s.rules
    # eager rows carry no capture size: (1 eager + 4 capture sizes) per combination of the rest
    assert s.size() == 4 * 2 * 8 * 7 * 5 * 4 * (1 + 4) * 2 * 2


# -- parameter kinds ------------------------------------------------------------------------------

def test_kinds_and_values():
    s = space(CONDITIONAL)
    assert [p.kind for p in s.params] == ["float", "int", "bool", "int", "categorical"]
    assert s["max_cudagraph_capture_size"].values() == [64, 128, 192, 256, 320, 384, 448, 512]
    assert s["kv_cache_dtype"].choices == ("auto", "fp8")
    assert s["enforce_eager"].values() == [False, True]
    assert space({"gpu_memory_utilization": {"type": "float", "low": 0.5, "high": 0.9}})["gpu_memory_utilization"].values() is None


@pytest.mark.parametrize("params, field, words", [
    ({"max_num_seq": {"type": "int", "low": 1, "high": 8}}, "search_space.params.max_num_seq", "did you mean 'max_num_seqs'"),
    ({"max_num_seqs": {"type": "bool"}}, "search_space.params.max_num_seqs.type", "not a boolean"),
    ({"max_num_seqs": {"type": "float", "low": 1, "high": 8}}, "search_space.params.max_num_seqs.type", "int"),
    ({"max_num_seqs": {"type": "integer", "low": 1, "high": 8}}, "search_space.params.max_num_seqs.type", "did you mean 'int'"),
    ({"max_num_seqs": {"low": 1, "high": 8}}, "search_space.params.max_num_seqs.type", "is required"),
    ({"max_num_seqs": {"type": "int", "low": 64, "high": 64}}, "search_space.params.max_num_seqs", "low < high"),
    ({"max_num_seqs": {"type": "int", "low": 16, "high": 100, "step": 16}}, "search_space.params.max_num_seqs.step", "multiple"),
    ({"max_num_seqs": {"type": "int", "low": 16, "high": 512, "step": 16, "log": True}}, "search_space.params.max_num_seqs", "cannot be combined"),
    ({"max_num_seqs": {"type": "int", "low": 0, "high": 8}}, "search_space.params.max_num_seqs.low", ">= 1"),
    ({"max_num_seqs": {"type": "int", "low": 1, "high": "8"}}, "search_space.params.max_num_seqs.high", "number"),
    ({"max_num_seqs": {"type": "int", "low": 1.5, "high": 8}}, "search_space.params.max_num_seqs.low", "whole number"),
    ({"max_num_seqs": {"type": "int", "low": 1, "high": 8, "stepp": 2}}, "search_space.params.max_num_seqs.stepp", "did you mean 'step'"),
    ({"max_num_seqs": {"type": "int", "low": 1, "high": 8, "choices": [1]}}, "search_space.params.max_num_seqs.choices", "does not apply"),
    ({"gpu_memory_utilization": {"type": "int", "low": 0, "high": 1}}, "search_space.params.gpu_memory_utilization.type", "type: float"),
    ({"enforce_eager": {"type": "int", "low": 0, "high": 1}}, "search_space.params.enforce_eager.type", "type: bool"),
    ({"gpu_memory_utilization": {"type": "float", "low": 0.5, "high": 1.2}}, "search_space.params.gpu_memory_utilization.high", "<= 1"),
    ({"gpu_memory_utilization": {"type": "float", "low": 0.0, "high": 0.9, "log": True}}, "search_space.params.gpu_memory_utilization.low", "> 0"),
    ({"gpu_memory_utilization": {"type": "float", "low": 0.5, "high": 0.9, "step": -0.1}}, "search_space.params.gpu_memory_utilization.step", "> 0"),
    ({"max_num_seqs": {"type": "categorical", "choices": []}}, "search_space.params.max_num_seqs.choices", "non-empty"),
    ({"max_num_seqs": {"type": "categorical", "choices": [64, 64]}}, "search_space.params.max_num_seqs.choices", "duplicates"),
    ({"max_num_seqs": [64, "many"]}, "search_space.params.max_num_seqs.choices[1]", "number"),
    ({"kv_cache_dtype": ["auto", "fp9"]}, "search_space.params.kv_cache_dtype.choices[1]", "fp8"),
    ({"enforce_eager": [True, "no"]}, "search_space.params.enforce_eager.choices[1]", "true or false"),
    ({"max_num_seqs": 64}, "search_space.params.max_num_seqs", "fixed_flags"),
    ({"cudagraph_capture_sizes": [[1, 2]]}, "search_space.params.cudagraph_capture_sizes", "cannot be searched"),
    ({"max_cudagraph_capture_size": {"type": "int", "low": 8, "high": 64, "when": {"enforce_eager": False}},
      "enforce_eager": {"type": "bool"}}, "search_space.params.max_cudagraph_capture_size.when", "move enforce_eager above"),
    ({"max_num_seqs": {"type": "int", "low": 8, "high": 64, "when": {"max_num_seqs": 8}}},
     "search_space.params.max_num_seqs.when", "itself"),
    ({"max_num_seqs": {"type": "int", "low": 8, "high": 64, "when": {"enforce_eagr": False}}},
     "search_space.params.max_num_seqs.when.enforce_eagr", "did you mean 'enforce_eager'"),
    ({"max_num_seqs": {"type": "int", "low": 8, "high": 64, "when": {"enforce_eager": "nope"}}},
     "search_space.params.max_num_seqs.when.enforce_eager", "true or false"),
    ({"max_num_seqs": {"type": "int", "low": 8, "high": 64, "when": 3}}, "search_space.params.max_num_seqs.when", "mapping"),
    ({"max_num_seqs": {"type": "int", "low": 8, "high": 64, "when": "open('x')"}}, "search_space.params.max_num_seqs.when", "function calls"),
])
def test_bad_params(params, field, words):
    with pytest.raises(SpecError) as err:
        space(params)
    assert err.value.field == field, str(err.value)
    assert words in str(err.value)


@pytest.mark.parametrize("data, field, words", [
    ("params: x", "search_space", "mapping"),
    ({"params": {}}, "search_space.params", "non-empty"),
    ({"max_num_seqs": [1, 2]}, "search_space.max_num_seqs", "put parameters under params"),
    ({"params": {"max_num_seqs": [1, 2]}, "rule": []}, "search_space.rule", "did you mean 'rules'"),
    ({"params": {"max_num_seqs": [1, 2]}, "rules": "max_num_seqs > 1"}, "search_space.rules", "list"),
    ({"params": {"max_num_seqs": [1, 2]}, "rules": [{"expr": "max_num_seqs > 1"}]}, "search_space.rules[0]", "rule:"),
    ({"params": {"max_num_seqs": [1, 2]}, "rules": [{"rule": "max_num_seqs > 1", "message": 3}]}, "search_space.rules[0].message", "text"),
    ({"params": {"max_num_seqs": [1, 2]}, "rules": [5]}, "search_space.rules[0]", "expression string"),
    ({"params": {"max_num_seqs": [1, 2]}, "description": ["x"]}, "search_space.description", "text"),
])
def test_bad_space_shapes(data, field, words):
    with pytest.raises(SpecError) as err:
        SearchSpace.from_dict(data)
    assert err.value.field == field, str(err.value)
    assert words in str(err.value)


def test_load_reports_file_and_yaml_line(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("params:\n  max_num_seqs: {type: int, low: 1, high: 8\n  x: 1\n")
    with pytest.raises(SpecError) as err:
        SearchSpace.load(bad)
    assert "line 3" in str(err.value) and str(bad) in str(err.value)
    dup = tmp_path / "dup.yaml"
    dup.write_text("params:\n  max_num_seqs: [1, 2]\n  max_num_seqs: [4]\n")
    with pytest.raises(SpecError, match="line 3.*duplicate key 'max_num_seqs'"):
        SearchSpace.load(dup)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("params:\n  max_num_seqs: {type: int, low: 8, high: 1}\n")
    with pytest.raises(SpecError) as err:
        SearchSpace.load(wrong)
    assert err.value.field == "search_space.params.max_num_seqs" and str(wrong) in str(err.value)
    with pytest.raises(SpecError, match="file not found"):
        SearchSpace.load(tmp_path / "missing.yaml")


# -- define-by-run sampling with a real Optuna study ---------------------------------------------

@pytest.mark.parametrize("sampler", [optuna.samplers.RandomSampler(seed=1), optuna.samplers.TPESampler(seed=1, n_startup_trials=5)],
                         ids=["random", "tpe"])
def test_suggest_respects_ranges_and_conditions(sampler):
    s = space(CONDITIONAL)
    study = optuna.create_study(sampler=sampler, direction="maximize")
    seen_eager = set()
    for _ in range(40):
        trial = study.ask()
        flags = s.suggest(trial)
        assert 0.5 <= flags["gpu_memory_utilization"] <= 0.95
        assert round(flags["gpu_memory_utilization"] * 20, 9) == round(flags["gpu_memory_utilization"] * 20)
        assert flags["gpu_memory_utilization"] in s["gpu_memory_utilization"].values()  # no 0.7000000000000001
        assert 16 <= flags["max_num_seqs"] <= 512 and isinstance(flags["max_num_seqs"], int)
        assert flags["kv_cache_dtype"] in ("auto", "fp8")
        assert ("max_cudagraph_capture_size" in flags) == (flags["enforce_eager"] is False)
        if "max_cudagraph_capture_size" in flags:
            assert flags["max_cudagraph_capture_size"] % 64 == 0
        seen_eager.add(flags["enforce_eager"])
        study.tell(trial, flags["max_num_seqs"] * flags["gpu_memory_utilization"])
    assert seen_eager == {False, True}
    # Optuna requires one distribution per name across the study: the same as distributions()
    dists = s.distributions()
    for t in study.trials:
        for name, dist in t.distributions.items():
            assert dist == dists[name]


def test_suggest_reads_pinned_flags():
    s = SearchSpace.from_dict({"params": {k: v for k, v in CONDITIONAL.items() if k != "enforce_eager"}}).with_pinned(
        {"enforce_eager": True})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(10):
        flags = s.suggest(study.ask())
        assert "max_cudagraph_capture_size" not in flags and "enforce_eager" not in flags
    assert s.size() == 10 * 497 * 2  # the conditional param never exists
    unpinned = SearchSpace.from_dict({"params": {"max_cudagraph_capture_size": {
        "type": "int", "low": 64, "high": 128, "step": 64, "when": {"enforce_eager": False}}}})
    assert unpinned.suggest(study.ask()).keys() == {"max_cudagraph_capture_size"}  # vLLM's default: not eager
    needs_pin = SearchSpace.from_dict({"params": {"max_num_seqs": {
        "type": "int", "low": 8, "high": 64, "when": {"gpu_memory_utilization": 0.9}}}})
    with pytest.raises(SpecError, match="pin gpu_memory_utilization"):
        needs_pin.suggest(study.ask())


def test_condition_forms():
    s = space({
        "tensor_parallel_size": [1, 2, 4],
        "kv_cache_dtype": {"type": "categorical", "choices": ["auto", "fp8"], "when": {"tensor_parallel_size": [2, 4]}},
        "enable_prefix_caching": {"type": "bool", "when": "tensor_parallel_size > 1 and kv_cache_dtype == 'fp8'"},
    })
    rows = s.grid()
    assert {"tensor_parallel_size": 1} in rows
    assert all(("kv_cache_dtype" in r) == (r["tensor_parallel_size"] > 1) for r in rows)
    assert all(("enable_prefix_caching" in r) == (r.get("kv_cache_dtype") == "fp8") for r in rows)
    assert len(rows) == s.size() == 1 + 2 * (1 + 2)


# -- grids ---------------------------------------------------------------------------------------

def test_grid_size_and_values():
    s = space({"gpu_memory_utilization": {"type": "float", "low": 0.5, "high": 0.9, "step": 0.1},
               "max_num_seqs": [64, 128, 256],
               "enforce_eager": {"type": "bool"},
               "max_cudagraph_capture_size": {"type": "categorical", "choices": [128, 256], "when": {"enforce_eager": False}}})
    rows = s.grid()
    assert s.size() == len(rows) == 5 * 3 * (1 + 2)
    assert len({tuple(sorted(r.items())) for r in rows}) == len(rows)
    assert {r["gpu_memory_utilization"] for r in rows} == {0.5, 0.6, 0.7, 0.8, 0.9}
    assert s.grid_values()["max_cudagraph_capture_size"] == [128, 256]


def test_grid_refuses_continuous_and_huge():
    s = space({"gpu_memory_utilization": {"type": "float", "low": 0.5, "high": 0.9}})
    assert s.size() == math.inf and not s.is_finite()
    with pytest.raises(SpecError, match="add step") as err:
        s.grid()
    assert err.value.field == "search_space.params.gpu_memory_utilization"
    with pytest.raises(SpecError, match="add step"):
        s.grid_values()
    big = space({"max_num_seqs": {"type": "int", "low": 1, "high": 4096},
                 "max_num_batched_tokens": {"type": "int", "low": 1, "high": 4096}})
    assert big.size() == 4096 * 4096
    with pytest.raises(SpecError, match="above the limit"):
        big.grid()


# -- the rule language -------------------------------------------------------------------------

@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('true')", "function calls"),
    ("max_num_seqs.__class__", "attribute access"),
    ("open('/etc/passwd')", "function calls"),
    ("max_num_seqs ** 2 > 4", "the ** operator"),
    ("max_num_seqs[0] > 1", "indexing"),
    ("(lambda: 1)() == 1", "function calls"),
    ("max_num_seqs if enforce_eager else 1", "conditional expressions"),
    ("(max_num_seqs := 3) > 1", "assignment expressions"),
    ("max_num_seqs in [1, 2]", "the in operator"),
    ("[x for x in (1, 2)]", "comprehensions"),
    ("max_num_seqs & 1", "bitwise operators"),
    ("import os", "not a valid expression"),
    ("max_num_seqs >", "not a valid expression"),
    ("__builtins__ == 1", "unknown name"),
    ("max_num_seq >= 1", "did you mean 'max_num_seqs'"),
    ("", "expression string"),
    ("max_num_seqs > " + "1 + " * 200 + "1", "longer than"),
])
def test_rules_refuse_unsafe_or_unknown(expr, why):
    with pytest.raises(SpecError) as err:
        space({"max_num_seqs": [1, 2]}, rules=[expr])
    assert err.value.field == "search_space.rules[0]"
    assert why in str(err.value)


@pytest.mark.parametrize("expr, env, expected", [
    ("max_num_batched_tokens >= 2 * max_num_seqs", {"max_num_batched_tokens": 512, "max_num_seqs": 256}, True),
    ("max_num_batched_tokens >= 2 * max_num_seqs", {"max_num_batched_tokens": 511, "max_num_seqs": 256}, False),
    ("16 <= max_num_seqs <= 512", {"max_num_seqs": 600}, False),
    ("num_attention_heads % tensor_parallel_size == 0", {"num_attention_heads": 28, "tensor_parallel_size": 4}, True),
    ("not enforce_eager or max_num_seqs <= 64", {"enforce_eager": True, "max_num_seqs": 65}, False),
    ("enforce_eager == false and kv_cache_dtype == 'fp8'", {"enforce_eager": False, "kv_cache_dtype": "fp8"}, True),
    ("gpu_memory_utilization * 10 // 1 - -1 == 10", {"gpu_memory_utilization": 0.95}, True),
    ("max_model_len / block_size >= 256", {"max_model_len": 4096, "block_size": 16}, True),
])
def test_rule_evaluator(expr, env, expected):
    assert Expr.parse(expr, "rules[0]").evaluate(env) is expected


def test_rule_violation_texts():
    rule = Rule(Expr.parse("max_num_batched_tokens <= 64 * max_num_seqs", "r"), "budget too big")
    assert rule.violation({"max_num_batched_tokens": 8192, "max_num_seqs": 16}) == (
        "budget too big: rule 'max_num_batched_tokens <= 64 * max_num_seqs' is false "
        "(max_num_batched_tokens=8192, max_num_seqs=16)")
    assert rule.violation({"max_num_batched_tokens": 8192}) is None  # unset flag: not judged
    div = Rule(Expr.parse("max_num_seqs / (tensor_parallel_size - 1) > 1", "r"))
    assert "cannot be evaluated" in div.violation({"max_num_seqs": 8, "tensor_parallel_size": 1})


# -- check(): built-in and user rules --------------------------------------------------------------

def _wl(inp: int, out: int) -> Workload:
    return Workload.from_dict({"input_len": inp, "output_len": out, "num_requests": 4, "concurrency": 2})


def test_check_builtin_rules():
    s = space({"max_num_seqs": [64]}, rules=["max_num_seqs <= gpu_count * 128"])
    llama = load_model("llama-3.1-8b")
    qwen = load_model("qwen2.5-7b")
    assert s.check({"max_num_seqs": 64}, llama, 1, _wl(512, 1024)) == []
    tp3 = s.check({"tensor_parallel_size": 3}, llama, 4)
    assert len(tp3) == 2 and "does not divide the model's 32 attention heads" in tp3[0] and "8 KV heads" in tp3[1]
    assert any("gpu.count=2" in v for v in s.check({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, llama, 2))
    assert any("exceeds the model's 32 layers" in v for v in s.check({"pipeline_parallel_size": 33}, llama, 64))
    assert any("below max_num_seqs" in v for v in s.check({"max_num_seqs": 256, "max_num_batched_tokens": 128}))
    assert any("longest request (1536 tokens" in v for v in s.check({"max_model_len": 1024}, llama, 1, _wl(512, 1024)))
    assert any("above the model's context of 32768" in v for v in s.check({"max_model_len": 65536}, qwen, 1))
    # the model's own context is the default max_model_len: a workload beyond it is refused
    assert any("longest request" in v for v in s.check({}, qwen, 1, _wl(30000, 4000)))
    assert any("chunked prefill off" in v for v in s.check(
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048, "max_model_len": 4096}))
    assert any("rule 'max_num_seqs <= gpu_count * 128' is false" in v for v in s.check({"max_num_seqs": 300}, None, 2))
    # KV heads that can be neither split nor replicated evenly (12 query heads, 3 KV heads, TP 2)
    odd = profile_from_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 768, "num_hidden_layers": 2,
                               "num_attention_heads": 12, "num_key_value_heads": 3, "intermediate_size": 1024,
                               "vocab_size": 1000, "max_position_embeddings": 2048}, "odd")
    assert s.check({"tensor_parallel_size": 2}, odd, 2) == [
        "tensor_parallel_size=2 cannot split the model's 3 KV heads evenly (3 is not divisible by 2)"]
    assert s.check({"tensor_parallel_size": 6}, odd, 8) == []  # 12 % 6 == 0 and 6 % 3 == 0: replicated


def test_feasibility_finds_never_ok_values():
    s = space({"tensor_parallel_size": [1, 2, 4, 8], "max_num_seqs": [64, 256],
               "max_num_batched_tokens": [128, 2048]}, rules=["max_num_batched_tokens <= 16 * max_num_seqs"])
    f = s.feasibility(load_model("qwen2.5-7b"), 8, _wl(100, 100))
    assert f.exhaustive and f.checked == 16
    assert f.never_ok == {"tensor_parallel_size": [8]}
    assert f.feasible == 3 * 2  # TP 1/2/4 x (64, 128 excluded; 64 with 2048 rule fails; 256 with both ok)
    assert f.min_world_size == 1
    assert set(f.reasons) == {"tensor_parallel_size", "max_num_batched_tokens", "rules[0]"}


def test_parse_yaml_line_numbers():
    with pytest.raises(SpecError, match=r"line 3, column 1: .*flow sequence at line 2") as err:
        parse_yaml("a: 1\nb: [1, 2\n", "spec")
    assert err.value.field == "spec"
    assert parse_yaml("a: [1, 2]\n", "spec") == {"a": [1, 2]}
