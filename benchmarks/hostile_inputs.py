"""Hostile inputs, each run as a ``servetune`` CLI process under a memory limit and a timeout.

Every case writes its files into a fresh folder and runs the real CLI (``python -m servetune ...``) with
``RLIMIT_AS`` set in the child and a wall-clock timeout. The product's rule for each: one line on
stderr (``error: FIELD: ... (fix: ...)``), exit code 2, no traceback, within the limits.
tests/test_hostile_input.py asserts that rule on every case in :data:`CASES`; this script times them
and prints the figures, for one source tree or two (before and after a change)::

    python benchmarks/hostile_inputs.py                         # this checkout's platform/
    python benchmarks/hostile_inputs.py --platform OLD/platform --platform platform --timeout 60

A case that the code under test does not bound ends killed by the timeout or by the memory limit
(a ``MemoryError`` traceback): the table shows that as its status.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLATFORM = REPO / "platform"
MEM_BYTES = 1 << 30  # 1 GiB of address space: a CLI refusal needs about half of it
TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile input: ``build`` writes its files into a folder and returns the CLI's argv (after
    ``servetune``); ``expect`` is a phrase the one-line refusal must hold."""

    id: str
    build: Callable[[Path], list[str]]
    expect: str
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Run:
    """What one CLI process did."""

    code: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    wall_s: float
    max_rss_mib: float

    @property
    def status(self) -> str:
        if self.code is None:
            return "timeout"
        if "Traceback" in self.stderr:
            last = self.stderr.strip().splitlines()[-1] if self.stderr.strip() else ""
            return f"traceback ({last.split(':')[0][:30]})"
        lines = self.stderr.strip().splitlines()
        return f"exit {self.code}, {len(lines)} line{'s' if len(lines) != 1 else ''}"


# ------------------------------------------------------------------------------------------- files
def _quickstart(folder: Path, **changes: object) -> dict:
    import yaml

    spec = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())
    spec["search_space"] = str(REPO / "search_spaces" / "memory-pair.yaml")
    spec["output"] = {"runs_dir": str(folder / "runs")}
    spec.update(changes)
    return spec


def _write_spec(folder: Path, spec: dict, name: str = "spec.yaml") -> Path:
    import yaml

    path = folder / name
    path.write_text(yaml.safe_dump(spec))
    return path


def _alias_bomb(folder: Path, levels: int = 9) -> str:
    """The quickstart with billion laughs as its ``description``: 9 levels of 9 aliases each, 9**9 (387M)
    strings once expanded (description wants text: the wrong-type message printed the whole mapping)."""
    import yaml

    spec = _quickstart(folder)
    spec.pop("description", None)
    lines = ["description:", '  a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return yaml.safe_dump(spec) + "\n".join(lines) + "\n"


def _flow_alias_bomb() -> str:
    """The same bomb on one line, as a ``--set`` value: 9 levels, 9**9 strings once expanded."""
    parts = ["a: &a [x,x,x,x,x,x,x,x,x]"]
    names = "abcdefghi"
    parts += [f"{n}: &{n} [" + ",".join([f"*{p}"] * 9) + "]" for p, n in zip(names, names[1:])]
    return "{" + ", ".join(parts) + "}"


def _model_dir(folder: Path, key: str, raw: str) -> Path:
    """A copy of a shipped config.json with ``key`` set to the raw JSON text ``raw``."""
    cfg = json.loads((PLATFORM / "servetune" / "data" / "models" / "llama-3.1-8b" / "config.json").read_text())
    cfg[key] = "__RAW__"
    model = folder / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg).replace('"__RAW__"', raw))
    return model


def _trace(folder: Path, lines: list[str]) -> list[str]:
    (folder / "trace.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "w.yaml").write_text("trace_file: trace.jsonl\n")
    return ["simulate", "--model", "llama-3.1-8b", "--gpu", "H200", "--workload", str(folder / "w.yaml")]


def _workload(folder: Path, text: str) -> list[str]:
    (folder / "w.yaml").write_text(text)
    return ["simulate", "--model", "llama-3.1-8b", "--gpu", "H200", "--workload", str(folder / "w.yaml")]


def _gpu_file(folder: Path, value: str) -> list[str]:
    (folder / "gpus.yaml").write_text("gpus:\n  - {name: X1, memory_gib: %s, hbm_gbps: 1000, bf16_tflops: 100, "
                                      "fp8_tflops: 200, interconnect_gbps: 100}\n" % value)
    return ["plan", "--model", "llama-3.1-8b", "--gpu", "X1", "--gpu-file", str(folder / "gpus.yaml")]


def _fifo(folder: Path, name: str) -> Path:
    path = folder / name
    os.mkfifo(path)
    return path


def _served_log() -> str:
    return (REPO / "tests" / "fixtures" / "real_h200" / "a1_u05_s64" / "server.log").read_text()


def _log(folder: Path, text: str) -> list[str]:
    (folder / "server.log").write_text(text)
    return ["diagnose", str(folder / "server.log")]


def _rules_bomb(folder: Path, n: int) -> list[str]:
    space = {"params": {"max_num_seqs": {"type": "int", "low": 1, "high": 200},
                        "max_num_batched_tokens": {"type": "categorical",
                                                   "choices": list(range(2048, 2048 + 100 * 16, 16))}},
             "rules": [f"max_num_batched_tokens >= max_num_seqs + {i}" for i in range(n)]}
    return ["tune", str(_write_spec(folder, _quickstart(folder, search_space=space)))]


PLAN = ["plan", "--model", "llama-3.1-8b", "--gpu", "H200"]

CASES: list[Case] = [
    # memory and time
    Case("spec: YAML alias bomb", lambda d: ["tune", str(_write(d / "spec.yaml", _alias_bomb(d)))],
         "more than 50,000 values with its aliases expanded"),
    Case("plan --set: YAML alias bomb", lambda d: [*PLAN, "--set", "max_num_seqs=" + _flow_alias_bomb()],
         "more than 50,000 values"),
    Case("spec: /dev/zero", lambda d: ["tune", "/dev/zero"], "/dev/zero is a device, not a regular file"),
    Case("spec: a FIFO", lambda d: ["tune", str(_fifo(d, "spec.yaml"))], "is a FIFO (named pipe), not a regular file"),
    Case("spec: 2 MiB of YAML", lambda d: ["tune", str(_write(d / "spec.yaml", "# " + "x" * (2 << 20) + "\n"))],
         "over the 1 MiB limit of a YAML document"),
    Case("diagnose: /dev/zero", lambda d: ["diagnose", "/dev/zero"], "LOG: /dev/zero is a device"),
    Case("diagnose: a FIFO", lambda d: ["diagnose", str(_fifo(d, "server.log"))], "is a FIFO (named pipe)"),
    Case("diagnose: a log over the cap (SERVETUNE_MAX_LOG_BYTES=65536)", lambda d: _log(d, _served_log() * 20),
         "limit of a log", {"SERVETUNE_MAX_LOG_BYTES": "65536"}),
    Case("trace: lines over the cap (SERVETUNE_MAX_JSONL_LINES=1000)",
         lambda d: _trace(d, ['{"timestamp": 0, "input_length": 5, "output_length": 3}'] * 1001),
         "more than 1,000 lines", {"SERVETUNE_MAX_JSONL_LINES": "1000"}),
    Case("spec: 2,000 rules", lambda d: _rules_bomb(d, 2000), "2,000 rules, above the limit of 256"),
    Case("simulate: 1M requests x 8,192 tokens",
         lambda d: _workload(d, "input_len: 8192\noutput_len: 8192\nnum_requests: 1000000\nconcurrency: 256\n"),
         "above the simulation limit"),
    # tracebacks and silent wrong answers
    Case("spec: YAML nested 1,000 deep", lambda d: ["tune", str(_write(d / "spec.yaml", "[" * 1000 + "]" * 1000))],
         "nested deeper than 64 levels"),
    Case("config.json: 1e999", lambda d: [*PLAN[:2], str(_model_dir(d, "hidden_size", "1e999")), *PLAN[3:]],
         "1e999 is beyond a float's range"),
    Case("config.json: Infinity", lambda d: [*PLAN[:2], str(_model_dir(d, "hidden_size", "Infinity")), *PLAN[3:]],
         "Infinity is not a number JSON allows"),
    Case("config.json: a string for a number",
         lambda d: [*PLAN[:2], str(_model_dir(d, "num_local_experts", '"eight"')), *PLAN[3:]],
         "num_local_experts: expected a positive integer, got 'eight'"),
    Case("trace: timestamp NaN", lambda d: _trace(d, ['{"timestamp": NaN, "input_length": 5, "output_length": 3}']),
         "NaN is not a number JSON allows"),
    Case("trace: input_length -5", lambda d: _trace(d, ['{"timestamp": 0, "input_length": -5, "output_length": 3}']),
         "input_length: must be >= 1, got -5"),
    Case("trace: output_length 0", lambda d: _trace(d, ['{"timestamp": 0, "input_length": 5, "output_length": 0}']),
         "output_length: must be >= 1, got 0"),
    Case("diagnose: a 400-digit figure",
         lambda d: _log(d, _served_log().replace("Model loading took 1.59 GiB", f"Model loading took {'9' * 400} GiB")),
         "a figure beyond 1e18"),
    Case("plan --set max_num_seqs=\"[1,\"", lambda d: [*PLAN, "--set", 'max_num_seqs="[1,"'],
         "--set max_num_seqs: cannot read"),
    Case("GPU file: .inf", lambda d: _gpu_file(d, ".inf"), "memory_gib: expected a positive finite number, got inf"),
    Case("GPU file: .nan", lambda d: _gpu_file(d, ".nan"), "memory_gib: expected a positive finite number, got nan"),
    Case("simulate: request_rate .nan",
         lambda d: _workload(d, "input_len: 512\noutput_len: 128\nnum_requests: 10\nrequest_rate: .nan\n"),
         "request_rate: must be a positive finite number, got nan"),
    Case("spec: request_rate .nan", lambda d: ["tune", str(_write_spec(d, _quickstart(d, workload={
        "input_len": 512, "output_len": 128, "num_requests": 10, "request_rate": float("nan")})))],
         "request_rate: must be a positive finite number, got nan"),
]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _limit(mem_bytes: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        os.setsid()  # its own process group, so a timeout ends every process it started
    return apply


def run_case(case: Case, folder: Path, platform: Path = PLATFORM, mem_bytes: int = MEM_BYTES,
             timeout_s: float = TIMEOUT_S) -> Run:
    """Build the case's files in ``folder`` and run the CLI from ``platform`` under the limits."""
    argv = case.build(folder)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(platform), "HOME": str(folder), **case.env}
    out_path, err_path = folder / ".stdout", folder / ".stderr"
    start = time.perf_counter()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "servetune", *argv], stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, cwd=folder, env=env, preexec_fn=_limit(mem_bytes))
    code: int | None = None
    rss_kib = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            code, rss_kib = os.waitstatus_to_exitcode(status), usage.ru_maxrss
            break
        if time.perf_counter() - start > timeout_s:
            os.killpg(proc.pid, signal.SIGKILL)
            _, _, usage = os.wait4(proc.pid, 0)
            rss_kib = usage.ru_maxrss
            break
        time.sleep(0.02)
    proc.returncode = code if code is not None else -9  # reaped here; keep Popen from waiting again
    wall = time.perf_counter() - start
    return Run(code, out_path.read_text(errors="replace"), err_path.read_text(errors="replace"), wall, rss_kib / 1024)


_REDACTION_CODE = """
import sys, time
from servetune.redact import redact_text
size = int(sys.argv[1])
text = ("a" * size)  # one long word: the shape the quadratic credential regex scanned from every letter
start = time.perf_counter()
redact_text(text, environ={})
print(f"{time.perf_counter() - start:.3f}")
"""


def redaction_seconds(platform: Path, size: int, timeout_s: float) -> str:
    """Seconds ``redact_text`` takes on ``size`` characters of one word, in a child importing ``platform``."""
    try:
        proc = subprocess.run([sys.executable, "-c", _REDACTION_CODE, str(size)], capture_output=True, text=True,
                              timeout=timeout_s, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(platform)})
    except subprocess.TimeoutExpired:
        return f"> {timeout_s:.0f}"
    return proc.stdout.strip() or f"failed: {proc.stderr.strip().splitlines()[-1:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", action="append", type=Path,
                        help="a platform/ folder to import servetune from (repeat: before, after)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per case")
    parser.add_argument("--mem-mib", type=int, default=MEM_BYTES >> 20, help="address-space limit per case")
    parser.add_argument("-k", default="", help="only the cases whose id holds this text")
    parser.add_argument("--redaction", action="store_true", help="time redact_text on 10 kB, 80 kB and 1 MB instead")
    args = parser.parse_args(argv)
    platforms = args.platform or [PLATFORM]
    if args.redaction:
        print("| characters | " + " | ".join(f"{p}: s" for p in platforms) + " |")
        for size in (10_000, 80_000, 1_000_000):
            cells = [redaction_seconds(p.resolve(), size, args.timeout) for p in platforms]
            print(f"| {size:,} | {' | '.join(cells)} |", flush=True)
        return 0
    print(f"# {len(platforms)} source tree(s); limits: {args.mem_mib} MiB address space, {args.timeout:.0f} s")
    header = " | ".join(f"{label}: status, wall s, max RSS MiB" for label in
                        (str(p) if len(platforms) == 1 else ("before", "after")[i] if len(platforms) == 2 else str(p)
                         for i, p in enumerate(platforms)))
    print(f"| case | {header} |")
    for case in CASES:
        if args.k not in case.id:
            continue
        cells = []
        for platform in platforms:
            with tempfile.TemporaryDirectory() as tmp:
                run = run_case(case, Path(tmp), platform.resolve(), args.mem_mib << 20, args.timeout)
            cells.append(f"{run.status}, {run.wall_s:.1f}, {run.max_rss_mib:.0f}")
        print(f"| {case.id} | {' | '.join(cells)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
