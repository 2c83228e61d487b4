"""vLLM engine steps out of a torch profiler trace: what each step ran on the GPU, kernel by kernel.

vLLM (0.13+) profiles its workers with the torch profiler between ``POST /start_profile`` and
``/stop_profile`` (``--profiler-config``; ``collect.py`` does both for a window that asks for it)
and wraps every ``execute_model`` in a record_function named after the step's batch; with
``detailed_trace_annotation`` the name carries the step's context and generation tokens and their
KV lengths: ``execute_8192_context_9(sq7936sk8704sqsq...sqsk...)_generation_256(sq256sk...)``.

:func:`steps_from_trace` is pure: a loaded Chrome-trace dict in, one record per engine step out.
Each GPU kernel is assigned to the step whose ``execute_`` range was the last to open before the
kernel's launch on the CPU (matched by the launch's correlation id), so the sampler's kernels that
``sample_tokens`` launches after ``execute_model`` returns count with their step. A step records its
batch, its CPU range, its kernels in launch order (name index, start and duration in us, relative to
the first step), the GPU time by kind (GEMM, attention, KV-cache write, Inductor's fused Triton
kernels, copies, other) and the GPU's busy time (the union of its kernels' intervals).

Kernel durations are the GPU's own (CUPTI); the gaps between kernels are not vLLM's unprofiled
gaps, since the profiler slows the CPU side.

A window's steps are all its readers use (``steps_vs_sim.py``, ``_kernels.py``,
``tests/sim/test_steps.py``), so the committed windows keep them reduced: ``steps.json.gz``
(:data:`STEPS`, this module's output, gzipped without a timestamp) beside ``summary.json``;
:func:`window_steps` reads it, or reduces the raw trace when a window still has one.

Usage (here or on the GPU host)::

    python3 benchmarks/real_vllm/trace_steps.py TRACE.pt.trace.json.gz > steps.json
    python3 benchmarks/real_vllm/trace_steps.py --window WINDOW_DIR ...  # writes WINDOW_DIR/steps.json.gz
"""

from __future__ import annotations

import bisect
import functools
import gzip
import json
import re
import sys
from pathlib import Path

# Order matters: FlashAttention-3's kernel names carry cutlass template arguments.
_KINDS = (
    ("kv_write", re.compile(r"reshape_and_cache", re.I)),
    ("attention", re.compile(r"flash|fmha|attn|attention", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|wgmma", re.I)),
    ("triton", re.compile(r"^triton_", re.I)),
)
_DETAILED = re.compile(
    r"^execute_(?P<tokens>\d+)_context_(?P<ctx_reqs>\d+)\(sq(?P<ctx_tokens>\d+)sk(?P<ctx_sk>\d+)"
    r"sqsq(?P<ctx_sqsq>\d+)sqsk(?P<ctx_sqsk>\d+)\)_generation_(?P<gen_reqs>\d+)\(sq(?P<gen_tokens>\d+)"
    r"sk(?P<gen_sk>\d+)sqsq(?P<gen_sqsq>\d+)sqsk(?P<gen_sqsk>\d+)\)$")
_SIMPLE = re.compile(r"^execute_context_(?P<ctx_reqs>\d+)\((?P<ctx_tokens>\d+)\)"
                     r"_generation_(?P<gen_reqs>\d+)\((?P<gen_tokens>\d+)\)$")
#: A window's reduced form, written by :func:`write_steps` and read by :func:`window_steps`.
STEPS = "steps.json.gz"
#: A window's raw worker trace, as ``collect.py`` keeps it.
TRACE = "trace.pt.trace.json.gz"
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_kind(name: str, cat: str = "kernel") -> str:
    """The kind a GPU event counts under: gemm, attention, kv_write, triton, copy or other."""
    if cat != "kernel":
        return "copy"
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "other"


def parse_step_label(name: str) -> dict[str, int] | None:
    """The batch an ``execute_...`` annotation names, or None for any other name."""
    m = _DETAILED.match(name) or _SIMPLE.match(name)
    if m is None:
        return None
    batch = {k: int(v) for k, v in m.groupdict().items()}
    batch.setdefault("tokens", batch["ctx_tokens"] + batch["gen_tokens"])
    return batch


def _busy(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def steps_from_trace(trace: dict) -> dict:
    """One record per ``execute_`` step of a torch profiler trace (see the module docstring)."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace: no traceEvents list")
    steps: list[dict] = []
    launches: dict[int, float] = {}
    gpu: list[dict] = []
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        cat, name = ev.get("cat"), str(ev.get("name", ""))
        if cat == "user_annotation":
            batch = parse_step_label(name)
            if batch is not None:
                steps.append({"label": name, **batch, "cpu_ts": float(ev["ts"]), "cpu_dur_us": float(ev.get("dur", 0))})
        elif cat in _LAUNCH_CATS:
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None:
                launches[int(corr)] = float(ev["ts"])
        elif cat in _GPU_CATS:
            gpu.append(ev)
    if not steps:
        raise ValueError("no execute_ step annotations: was the trace taken by vLLM's worker profiler?")
    steps.sort(key=lambda s: s["cpu_ts"])
    starts = [s["cpu_ts"] for s in steps]
    t0 = starts[0]
    names: list[str] = []
    name_index: dict[str, int] = {}
    per_step: list[list[tuple[float, float, str, str]]] = [[] for _ in steps]
    unassigned = 0
    for ev in gpu:
        corr = (ev.get("args") or {}).get("correlation")
        launched = launches.get(int(corr)) if corr is not None else None
        i = bisect.bisect_right(starts, launched) - 1 if launched is not None else -1
        if i < 0:
            unassigned += 1
            continue
        per_step[i].append((float(ev["ts"]), float(ev.get("dur", 0)), str(ev.get("name", "")), str(ev.get("cat"))))
    out_steps = []
    for step, kernels in zip(steps, per_step):
        kernels.sort()
        by_kind: dict[str, float] = {}
        rows = []
        for ts, dur, name, cat in kernels:
            kind = kernel_kind(name, cat)
            by_kind[kind] = by_kind.get(kind, 0.0) + dur
            if name not in name_index:
                name_index[name] = len(names)
                names.append(name)
            rows.append([name_index[name], round(ts - t0, 1), round(dur, 2)])
        rec = {k: v for k, v in step.items() if k != "cpu_ts"}
        rec["cpu_ts_us"] = round(step["cpu_ts"] - t0, 1)
        if kernels:
            rec["gpu_start_us"] = round(kernels[0][0] - t0, 1)
            rec["gpu_end_us"] = round(max(ts + dur for ts, dur, _, _ in kernels) - t0, 1)
            rec["gpu_busy_us"] = round(_busy([(ts, ts + dur) for ts, dur, _, _ in kernels]), 1)
        rec["by_kind_us"] = {k: round(v, 1) for k, v in sorted(by_kind.items())}
        rec["kernels"] = rows
        out_steps.append(rec)
    return {"names": names, "kinds": [kernel_kind(n) for n in names], "unassigned_gpu_events": unassigned,
            "steps": out_steps}


def load_trace(path: Path, max_bytes: int = 2 << 30) -> dict:
    """A trace file (``.json`` or ``.json.gz``), refusing one that would unpack past ``max_bytes``."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path}: more than {max_bytes} bytes unpacked; take fewer profiler iterations")
    return json.loads(data)


def write_steps(steps: dict, dest: Path) -> None:
    """``steps`` as gzipped JSON at ``dest``, byte for byte the same for the same steps (no
    timestamp or file name in the gzip header)."""
    data = json.dumps(steps, separators=(",", ":")).encode()
    with open(dest, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as fh:
        fh.write(data)


@functools.lru_cache(maxsize=64)
def window_steps(window: Path) -> dict:
    """The engine steps of a profiled window folder: its :data:`STEPS` when there is one, else
    ``steps_from_trace`` of its raw :data:`TRACE`; read once per process (several benchmarks and
    tests read them; a raw trace takes ~0.7 CPU-s). Shared: callers must not modify it."""
    reduced = window / STEPS
    if reduced.exists():
        with gzip.open(reduced, "rb") as fh:
            return json.loads(fh.read())
    return steps_from_trace(load_trace(window / TRACE))


def reduce_window(window: Path) -> Path:
    """Write ``window``'s :data:`STEPS` from its raw :data:`TRACE` (the raw trace is left in place)."""
    dest = window / STEPS
    write_steps(steps_from_trace(load_trace(window / TRACE)), dest)
    return dest


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--window"] and len(args) > 1:
        for window in args[1:]:
            print(reduce_window(Path(window)))
        return
    if len(args) != 1:
        print("usage: trace_steps.py TRACE.pt.trace.json[.gz] | --window WINDOW_DIR ...", file=sys.stderr)
        raise SystemExit(2)
    json.dump(steps_from_trace(load_trace(Path(args[0]))), sys.stdout)


if __name__ == "__main__":
    main()
