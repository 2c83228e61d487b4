"""Fuzz of search-space rule strings: each runs through the real loader under a memory and a time limit.

A rule is untrusted input (a spec from a shared repository, a nightly matrix). Every string here,
resource bombs included, must end as a ``SpecError`` naming the rule or as a valid rule whose every
judgement returns in bounded memory and time. The worker (``tests/spec/_rule_fuzz_worker.py``) runs under
``resource.setrlimit`` (address space 512 MiB, CPU 60 s) with a 5 s alarm per case; a control run
of plain Python bombs under the same limits shows the limits catch what they should.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from servetune.errors import SpecError
from servetune.planner.flags import FLAGS
from servetune.spec.space import CONTEXT_NAMES, SearchSpace

WORKER = Path(__file__).with_name("_rule_fuzz_worker.py")
MEM_BYTES = 512 * 2**20
CPU_S = 60
CASE_S = 5.0
ROOT = Path(__file__).resolve().parents[2]


def run_cases(cases: list[dict[str, str]], fork_each: bool = False) -> tuple[list[dict], int, str]:
    """Run cases in one limited worker (``fork_each``: each in a limited process of its own, forked
    by the worker after its imports); (results in order, exit code, stderr tail)."""
    proc = subprocess.run([sys.executable, str(WORKER), str(MEM_BYTES), str(CPU_S), str(CASE_S),
                           *(["--fork-each"] if fork_each else [])],
                          input="".join(json.dumps(c) + "\n" for c in cases), capture_output=True, text=True,
                          timeout=CPU_S * 3 + (CASE_S * len(cases) if fork_each else 0), cwd=ROOT)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"i"')]
    return results, proc.returncode, proc.stderr[-2000:]


def run_each(cases: list[dict[str, str]]) -> list[dict]:
    """Every case in its own limited process (forked by one worker, after the imports)."""
    results, code, err = run_cases(cases, fork_each=True)
    died = cases[len(results)]["src"][:80] if len(results) < len(cases) else None
    assert code == 0 and len(results) == len(cases), f"worker died (exit {code}) on {died!r}: {err}"
    assert [r["i"] for r in results] == list(range(len(cases)))
    return results


# ----------------------------------------------------------------------------- resource bombs
BOMBS = [
    "'x' * 100000000000 == max_num_seqs",                       # the first bomb: 100 GB string
    "'%0999999999d' % max_num_seqs != 'a'",                     # the second: 1 GB per evaluation
    "'{:>999999999}' != kv_cache_dtype",                        # a long constant is harmless, but bounded
    "max_num_seqs * 'ab' == 'abab'",
    "kv_cache_dtype * 999999999999 == 'auto'",                  # string flag times a number: judged, refused
    "kv_cache_dtype + kv_cache_dtype == 'autoauto'",
    "kv_cache_dtype % max_num_seqs == 'x'",
    "-kv_cache_dtype == 1",
    "-'x' == 1",
    "9 ** 9 ** 9 ** 9 > 0",
    "max_num_seqs ** 999999999 > 0",
    "max_num_seqs << 999999999 > 0",
    "[0] * 999999999 == max_num_seqs",
    "(max_num_seqs,) * 999999999 == 1",
    "f'{max_num_seqs:>999999999}' == 'a'",
    "'{:>999999999}'.format(max_num_seqs) == 'a'",
    "__import__('os').system('true') == 0",
    "(lambda: max_num_seqs)() == 1",
    "[x for x in range(10**12)] == 1",
    "max_num_seqs > " + "9" * 400,                              # a 400-digit constant
    "1e308 * 1e308 > max_num_seqs",
    "max_num_seqs * " + " * ".join(["999999999999"] * 30) + " > 0",   # a product past any bound
    "(" * 150 + "max_num_seqs" + ")" * 150 + " > 0",
    "-" * 450 + "max_num_seqs > 0",
    "not " * 120 + "enforce_eager",
    " < ".join(["max_num_seqs"] * 40),
    " + ".join(["max_num_seqs"] * 60) + " > 0",
    "max_num_seqs % 0 == 1",
    "max_num_seqs // 0.0 == 1",
    "max_num_seqs / (max_num_seqs - max_num_seqs) > 1",
    "max_num_seqs == 1\x00",
    "true + true > 1",
    "max_num_seqs > 1 " * 300,
]


def test_every_resource_bomb_is_refused_or_judged_within_the_limits():
    results = run_each([{"mode": "rule", "src": b} for b in BOMBS])
    errors = [(b, r["detail"]) for b, r in zip(BOMBS, results) if r["outcome"] == "error"]
    assert errors == []
    outcome = dict(zip(BOMBS, (r["outcome"] for r in results)))
    # Two of them (a huge string repetition, a huge format width) are refused when the space is loaded, never evaluated.
    assert outcome["'x' * 100000000000 == max_num_seqs"] == "refused"
    assert outcome["'%0999999999d' % max_num_seqs != 'a'"] == "refused"
    # Loaded as valid rules, and judged within bounds: a string flag in arithmetic (its type is known
    # only when judged), a division by zero, a bool in arithmetic: each a violation text, not a value.
    judged = {b for b in BOMBS if outcome[b] == "valid"}
    assert judged == {
        "'{:>999999999}' != kv_cache_dtype", "kv_cache_dtype * 999999999999 == 'auto'",
        "kv_cache_dtype + kv_cache_dtype == 'autoauto'", "kv_cache_dtype % max_num_seqs == 'x'",
        "-kv_cache_dtype == 1", "(" * 150 + "max_num_seqs" + ")" * 150 + " > 0", "max_num_seqs % 0 == 1",
        "max_num_seqs // 0.0 == 1", "max_num_seqs / (max_num_seqs - max_num_seqs) > 1", "true + true > 1"}
    detail = dict(zip(BOMBS, (r["detail"] for r in results)))
    assert "numbers only" in detail["kv_cache_dtype * 999999999999 == 'auto'"]
    assert "numbers only" in detail["true + true > 1"]
    assert "by zero" in detail["max_num_seqs % 0 == 1"]


def test_the_limits_are_real_a_plain_python_bomb_is_caught():
    """The same worker and limits catch what the old rule language allowed (and a loop)."""
    results = run_each([{"mode": "python", "src": "x = 'x' * 100000000000"},
                        {"mode": "python", "src": "x = '%0999999999d' % 8"},
                        {"mode": "python", "src": "while True: pass"},
                        {"mode": "python", "src": "x = 'ok' * 10"}])
    assert [r["outcome"] for r in results] == ["error", "error", "error", "valid"]
    assert results[0]["detail"] == results[1]["detail"] == "MemoryError"
    assert results[2]["detail"].startswith("timeout")


# ----------------------------------------------------------------------------- random rule strings
_NAMES = ["max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype", "enforce_eager", "gpu_memory_utilization",
          "tensor_parallel_size", "gpu_count", "world_size", "max_model_len", "num_attention_heads",
          "true", "false", "null", "True", "None", "max_num_seq", "os", "__import__", "__builtins__", "x"]
_NUMBERS = ["0", "1", "2", "8", "64", "0.5", "0.95", "1e12", "1e13", "999999999999", "1000000000000", "-1",
            "9" * 30, "1_000", "0x10", "1j", "1e308", "2.5e-3"]
_STRINGS = ["'auto'", "'fp8'", "'x'", "''", "'%0999999999d'", "'{:>9999}'", "\"fp8\"", "'" + "a" * 70 + "'",
            "b'x'", "f'{max_num_seqs}'", "'%s'"]
_OPS = ["+", "-", "*", "/", "//", "%", "**", "==", "!=", "<", "<=", ">", ">=", "and", "or", "not", "in",
        "not in", "is", "@", "<<", ">>", "&", "|", "^", "~", ":=", ","]
_PUNCT = ["(", ")", "[", "]", "{", "}", ".", ":", "lambda", "if", "else", "for", "\\", "#", ";", "\n"]


def _soup(rng: random.Random) -> str:
    """Random tokens: mostly not expressions at all."""
    pool = _NAMES + _NUMBERS + _STRINGS + _OPS + _PUNCT
    return " ".join(rng.choice(pool) for _ in range(rng.randint(1, 14)))


def _expr(rng: random.Random, depth: int) -> str:
    """A well-formed expression over numbers, names and strings: some valid rules, some refused."""
    if depth <= 0 or rng.random() < 0.25:
        return rng.choice(rng.choice([_NAMES[:10], _NUMBERS[:12], _STRINGS[:6]]))
    kind = rng.random()
    if kind < 0.45:
        op = rng.choice(["+", "-", "*", "/", "//", "%"])
        return f"{_expr(rng, depth - 1)} {op} {_expr(rng, depth - 1)}"
    if kind < 0.75:
        op = rng.choice(["==", "!=", "<", "<=", ">", ">="])
        return f"{_expr(rng, depth - 1)} {op} {_expr(rng, depth - 1)}"
    if kind < 0.85:
        return f"{rng.choice(['and', 'or'])}".join([f" ({_expr(rng, depth - 1)}) "] * 2).strip()
    if kind < 0.93:
        return f"{rng.choice(['not ', '-', '+'])}{_expr(rng, depth - 1)}"
    return f"({_expr(rng, depth - 1)})"


def _mutant(rng: random.Random) -> str:
    """A real rule of search_spaces/ with one token replaced, inserted or repeated."""
    base = rng.choice(["max_cudagraph_capture_size <= 2 * max_num_seqs", "max_num_batched_tokens <= 64 * max_num_seqs",
                       "long_prefill_token_threshold == 0 or long_prefill_token_threshold < max_num_batched_tokens",
                       "kv_cache_dtype == 'fp8' or max_num_seqs <= 128"]).split()
    i = rng.randrange(len(base))
    token = rng.choice(_NAMES + _NUMBERS + _STRINGS + _OPS + _PUNCT)
    how = rng.random()
    if how < 0.4:
        base[i] = token
    elif how < 0.8:
        base.insert(i, token)
    else:
        base[i:i] = [base[i]] * rng.randint(2, 60)
    return " ".join(base)


def fuzz_cases(n: int, seed: int = 14) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        pick = rng.random()
        out.append(_soup(rng) if pick < 0.35 else _mutant(rng) if pick < 0.55 else _expr(rng, rng.randint(1, 6)))
    return out


N_FUZZ = 3000


def test_random_rule_strings_end_as_spec_error_or_valid_rule_under_limits():
    cases = fuzz_cases(N_FUZZ)
    outcomes: dict[str, int] = {}
    errors: list[tuple[str, str]] = []
    for start in range(0, len(cases), 500):
        chunk = cases[start:start + 500]
        results, code, err = run_cases([{"mode": "rule", "src": c} for c in chunk])
        assert code == 0 and len(results) == len(chunk), f"worker died (exit {code}) in chunk {start}: {err}"
        for src, r in zip(chunk, results):
            outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
            if r["outcome"] == "error":
                errors.append((src, r["detail"]))
    assert errors == []
    # The generator reaches both ends: it is not only producing syntax errors.
    assert outcomes.get("refused", 0) > N_FUZZ // 4 and outcomes.get("valid", 0) > N_FUZZ // 10, outcomes


# ----------------------------------------------------------------------------- the language itself
def _load(rule: str) -> SearchSpace:
    return SearchSpace.from_dict({"params": {"max_num_seqs": [8, 256], "kv_cache_dtype": ["auto", "fp8"]},
                                  "rules": [rule]})


@pytest.mark.parametrize("rule, why", [
    ("'x' * 100000000000 == max_num_seqs", "numbers only"),
    ("'%0999999999d' % max_num_seqs != 'a'", "numbers only"),
    ("-'auto' == kv_cache_dtype", "only numbers take a sign"),
    ("max_num_seqs > 10000000000000", "constant beyond"),
    ("kv_cache_dtype == '" + "a" * 65 + "'", "longer than 64"),
    ("-" * 40 + "max_num_seqs > 0", "deeper than 32"),
    (" and ".join(["1<gpu_count"] * 30), "more than 100 parts"),
    ("max_num_seqs == 1\x00", "not a valid expression"),
])
def test_rule_language_bounds(rule, why):
    with pytest.raises(SpecError) as err:
        _load(rule)
    assert err.value.field == "search_space.rules[0]"
    assert why in str(err.value)


def test_strings_are_compared_and_arithmetic_stays_in_bounds():
    space = _load("kv_cache_dtype == 'fp8' or max_num_seqs <= 128")
    assert space.check({"kv_cache_dtype": "fp8", "max_num_seqs": 256}) == []
    assert space.check({"kv_cache_dtype": "auto", "max_num_seqs": 256}) != []
    over = _load("max_num_seqs * 999999999999 * 999999999999 > 0").rules[0]
    assert "beyond 1e+18" in over.violation({"max_num_seqs": 8})
    string_arith = _load("kv_cache_dtype * 3 == 'fpfpfp'").rules[0]
    assert "numbers only" in string_arith.violation({"kv_cache_dtype": "fp"})


def test_a_condition_doing_string_arithmetic_is_a_spec_error_not_a_traceback():
    space = SearchSpace.from_dict({"params": {
        "kv_cache_dtype": ["auto", "fp8"],
        "max_num_seqs": {"type": "int", "low": 8, "high": 64, "when": "kv_cache_dtype * 2 == 'fp8fp8'"}}})
    with pytest.raises(SpecError) as err:
        space.size()
    assert err.value.field == "search_space.params.max_num_seqs.when"
    assert "numbers only" in str(err.value)


def test_known_names_in_the_generator_are_real():
    """The fuzz vocabulary's first names are real flag or context names (so valid rules are generated)."""
    assert all(n in FLAGS or n in CONTEXT_NAMES for n in _NAMES[:10])
