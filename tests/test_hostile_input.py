"""Hostile input: every case runs the real CLI as a process under a memory limit and a timeout.

The cases (benchmarks/hostile_inputs.py, shared with the benchmark that times them) are files and values
an attacker or an unlucky user hands over: YAML alias bombs and 1,000-deep nesting, /dev/zero and FIFOs
where a file is wanted, files over their size or line cap, 2,000 rules, a workload of 16 billion tokens,
NaN, infinities and strings where config.json, a trace, a GPU file or a workload wants a number, a
400-digit figure in a log. Each must end as one line on stderr naming what is wrong, exit code 2, no
traceback, within 1 GiB of address space (``RLIMIT_AS``) and 60 s.

Beside them: the bounded readers' own rules (servetune.inputs), redaction of a 1 MB text under a CPU
limit (the quadratic regex took minutes), and a 200-rule space against 20,000 combinations loading
under the same limits.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hostile_inputs import CASES, MEM_BYTES, PLATFORM, REPO, Case, run_case
from servetune.errors import SpecError
from servetune.inputs import LIMITS, iter_lines, limit, load_json, load_yaml, read_text, shown


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input_is_one_line_exit_2_within_limits(tmp_path: Path, case: Case) -> None:
    run = run_case(case, tmp_path)
    assert run.code is not None, f"still running after the timeout: {run.stderr[-500:]}"
    assert "Traceback" not in run.stderr and "MemoryError" not in run.stderr, run.stderr[-2000:]
    assert run.code == 2, (run.code, run.stderr[-2000:])
    assert run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr[-2000:]
    assert case.expect in lines[0]
    assert len(lines[0]) < 800  # the value is never printed whole
    assert not (tmp_path / "runs").exists()  # refused before a study folder was made


def _limited(code: str, cpu_s: int = 30) -> subprocess.CompletedProcess[str]:
    """Python ``code`` in a child with the CLI cases' address-space limit and a CPU-time limit."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEM_BYTES, MEM_BYTES))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=cpu_s * 4,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(PLATFORM)}, cwd=REPO, preexec_fn=apply)


def test_redaction_of_a_megabyte_finishes_under_a_cpu_limit() -> None:
    """A 1 MB description of letters, and of URL-like runs: the credential regex scans each run once."""
    proc = _limited("from servetune.redact import redact_text\n"
                    "for unit in ('a', 'x://', 'a:', '9http://u:p@h '):\n"
                    "    text = (unit * (1_000_000 // len(unit) + 1))[:1_000_000]\n"
                    "    out = redact_text(text, environ={})\n"
                    "    assert len(out) <= len(text)\n"
                    "print(redact_text('9http://u:p@h/x', environ={}))\n", cpu_s=20)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "9http://***@h/x"  # a scheme after digits is still masked


def test_200_rules_against_20000_combinations_load_within_limits(tmp_path: Path) -> None:
    """Under the rule cap, the rule x combination bound keeps loading short: the listing falls back
    to TP and PP instead of judging 4 million pairs."""
    spec = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())
    spec["search_space"] = {
        "params": {"max_num_seqs": {"type": "int", "low": 1, "high": 200},
                   "max_num_batched_tokens": {"type": "categorical", "choices": list(range(2048, 3648, 16))}},
        "rules": [f"max_num_batched_tokens >= max_num_seqs + {i}" for i in range(200)]}
    spec["output"] = {"runs_dir": str(tmp_path / "runs")}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = _limited(f"from servetune.spec.schema import load_spec\n"
                    f"s = load_spec({str(path)!r})\nprint(len(s.search_space.rules))\n", cpu_s=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "200"


# ------------------------------------------------------------------------- the readers' own rules
def test_caps_are_stated_and_overridable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("a: " + "x" * 5000 + "\n")
    monkeypatch.setenv("SERVETUNE_MAX_YAML_BYTES", "4096")
    with pytest.raises(SpecError, match=r"over the 4,096 bytes limit of a YAML document.*SERVETUNE_MAX_YAML_BYTES"):
        read_text(path, "yaml", "spec")
    monkeypatch.setenv("SERVETUNE_MAX_YAML_BYTES", "8192")
    assert read_text(path, "yaml", "spec").startswith("a: x")
    monkeypatch.setenv("SERVETUNE_MAX_YAML_BYTES", "lots")
    with pytest.raises(SpecError, match="SERVETUNE_MAX_YAML_BYTES: expected a positive whole number"):
        limit("yaml")
    assert LIMITS["log"].max_bytes == 16 << 20 and LIMITS["jsonl"].max_lines == 1_000_000


def test_line_files_stream_with_line_and_line_length_caps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("{}\n" * 5)
    assert [n for n, _ in iter_lines(path, "jsonl", "trace")] == [1, 2, 3, 4, 5]
    monkeypatch.setenv("SERVETUNE_MAX_JSONL_LINES", "4")
    seen = []
    with pytest.raises(SpecError, match="more than 4 lines"):
        for n, _ in iter_lines(path, "jsonl", "trace"):
            seen.append(n)
    assert seen == [1, 2, 3, 4]  # refused at the fifth line, not after reading everything


def test_yaml_depth_and_alias_bounds_hold_at_the_edge() -> None:
    assert load_yaml("[" * 63 + "]" * 63, "f") is not None  # 63 deep (plus the document) is fine
    with pytest.raises(SpecError, match="nested deeper than 64"):
        load_yaml("[" * 65 + "]" * 65, "f")
    def doc(aliases: int) -> str:  # an anchor of 100 values repeated: 100 x aliases values once expanded
        return "a: &a [" + ", ".join(["1"] * 99) + "]\nb: [" + ", ".join(["*a"] * aliases) + "]\n"
    assert len(load_yaml(doc(400), "f")["b"]) == 400  # ~40,000 values
    with pytest.raises(SpecError, match="more than 50,000 values"):
        load_yaml(doc(600), "f")


def test_json_numbers_are_finite_and_bounded() -> None:
    assert load_json('{"a": 1.5, "b": -3, "c": 1e18}', "f") == {"a": 1.5, "b": -3, "c": 1e18}
    for text, why in (("NaN", "NaN is not a number"), ("-Infinity", "-Infinity is not a number"),
                      ("1e999", "beyond a float's range"), ("1" * 400, "beyond 1e18"), ("[" * 100_000, "nested too deep")):
        with pytest.raises(SpecError, match=why):
            load_json(text, "f")


def test_shown_prints_at_most_100_characters_of_any_value() -> None:
    nested: list = []
    for _ in range(50):
        nested = [nested] * 9  # 9**50 leaves if walked: shown must not walk it
    for value in ("x" * 10**6, list(range(10**5)), {str(i): i for i in range(10**4)}, nested, 10**4000 // 7):
        assert len(shown(value)) <= 100


def test_nonregular_files_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(SpecError, match="FIFO"):
        read_text(fifo, "yaml", "spec")  # a blocking open would wait here for a writer forever
    with pytest.raises(SpecError, match="is a folder"):
        read_text(tmp_path, "yaml", "spec")
    with pytest.raises(SpecError, match="is a device"):
        read_text("/dev/zero", "log", "LOG")
