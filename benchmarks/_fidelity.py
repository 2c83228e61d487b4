"""Simulator fidelity against real vLLM 0.26.0 on one H200, held out (the benchmark and a test use it).

The evidence is every healthy measured window in ``tests/fixtures/real_h200/``: the 0.85B test
model's runs (one folder each, ``summary.json`` at the top) and the user-scale runs in ``scale/``
(one folder per server start, one sub-folder per measured window: Llama-3.1-8B and Qwen2.5-14B
shaped models). For each, resolve the same flags for the same model on the H200, simulate the same
workload (warm-up included), and compare output tok/s, mean TTFT, mean TPOT and preemptions
(``vllm:num_preemptions_total`` after minus before the window).

:func:`fit` searches the step-time knobs of :class:`servetune.sim.perf.Calibration` (a handful of
constants shared by every run, never per-run fudge) on a set of runs; :func:`held_out` fits on
some runs and reports the error on the others: by model size (fit on two sizes, test on the
third) and by flag (fit without the eager / fp8 KV / small token budget runs, test on them). Only
held-out rows are fidelity figures; a row of a run the constants were fitted on is not.

Example:
    >>> runs = load_real_runs()                              # doctest: +SKIP
    >>> sorted({r.size for r in runs})                       # doctest: +SKIP
    ['0.85B', '14B', '8B']
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import math
import re
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna

from servetune.errors import SpecError
from servetune.planner.gpus import GpuSpec, get_gpu
from servetune.engines.vllm.metrics import counter, parse_prometheus
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.records import dataset
from servetune.result import TrialResult, TrialStatus
from servetune.sim import GPU_FAMILY_OVERRIDES, Calibration, calibration_for, host_api_cpu_factor, simulate, with_calibration
from servetune.workload import Sampling, Workload

__all__ = ["golden_section", "FIXTURES", "H100_CLASSES_FIXTURES", "H200_CLASSES_FIXTURES", "MOE_FLOOR_FIT_START", "fit_moe_floor", "DIAGNOSTIC_FLAGS", "serving_flags", "FIT_SPACE", "RealRun", "FidelityRow", "load_real_runs", "load_study_runs", "GRID_STUDIES",
           "UNSEEN_STUDIES", "UNSEEN_STARTS", "UNSEEN_HOSTS", "SCALE_HOSTS", "scale_start", "scale_host", "HostCheck", "host_checks", "host_of",
           "load_unseen_runs", "load_evidence", "HELD_OUT_HOSTS", "load_calibration_runs", "calibration_host_factors",
           "host_factor", "in_calibration_fit", "FP8_FIT_STARTS", "fit_fp8_kv_read", "fit_alone", "fit_eager_floor", "held_out_cells",
           "api_token_cpu_s", "MEASURED", "fidelity_rows", "error_summary", "read_knobs",
           "format_table", "fit", "held_out", "FOLDS", "H100_FIXTURES", "H100_GPU", "H100_CALIBRATING", "load_h100_runs",
           "window_api_cpu_factor", "h100_check",
           "H100_FIT_STARTS", "H100_JUDGED_STARTS", "in_h100_fit", "h100_hbm_read_share", "fit_h100_kv_read",
           "h200_knobs_on", "HYBRID_BENCH_STARTS", "argv_switches", "load_bench_serve_run", "load_hybrid_runs"]

#: The real-run evidence, in the repository's tests (not shipped with the package).
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "real_h200"
GPU = "H200"
#: The model path each collection used on the GPU host -> servetune's shipped config of that shape.
HOST_MODELS = {"/root/model": "servetune-test-850m", "/root/m8b": "llama-3.1-8b", "/root/m14b": "qwen2.5-14b",
               "/root/m24b": "mistral-small-24b", "/root/q3": "qwen3-30b-a3b", "/root/l8": "llama-3.1-8b",
               "/root/g2": "gemma-2-27b", "/root/go20": "gpt-oss-20b",
               # The 16-layer Mixtral-8x7B shape has no shipped config: its config.json is kept with its evidence.
               "/root/mx16": str(FIXTURES.parent / "real_h100_classes" / "2026-12-05_h100_host_c" / "mx16"),
               # gemma-3-27b's text model as a Gemma3ForCausalLM, DeepSeek-V2-Lite and an AWQ Llama-3.1-8B:
               # the configs vLLM was served are kept with their evidence.
               "/root/g3t": str(FIXTURES.parent / "real_h100_classes" / "2026-12-06_h100_host" / "g3t"),
               "/root/dsv2": str(FIXTURES.parent / "real_h100_classes" / "2026-12-06_h100_host" / "dsv2"),
               "/root/awq8": str(FIXTURES.parent / "real_h100_classes" / "2026-12-06_h100_host" / "awq8"),
               # Mamba2 / gated-delta-net hybrids: granite-4.0-h-tiny, Nemotron-H-8B-Base-8K and the
               # Qwen3-Next-80B-A3B shape at 12 of its 48 layers, as served (configs kept with the evidence).
               "/root/ghtiny": str(FIXTURES.parent / "real_h100_classes" / "2026-12-06_h100_host_e" / "ghtiny"),
               "/root/nemh8b": str(FIXTURES.parent / "real_h100_classes" / "2026-12-06_h100_host_e" / "nemh8b"),
               "/root/q3next12": str(FIXTURES.parent / "real_h100_classes" / "2026-12-06_h100_host_e" / "q3next12"),
               # the Qwen3.5-35B-A3B shape at 20 of its 40 layers, served with --language-model-only
               "/root/q35moe20": str(FIXTURES.parent / "real_h100_classes" / "2026-12-07_h100_host_d" / "q35moe20")}
#: Flags the collector passed for its own evidence that change nothing vLLM serves or allocates
#: (``--profiler-config``: the worker's profiler is built on the first /start_profile; ``--load-format
#: dummy``: random weights made on the GPU, as many bytes as the checkpoint's; ``--gdn-prefill-backend
#: triton``: the gated-delta-net prefill kernel where the host's vLLM lacks FlashInfer's, which the simulator
#: prices from counted bytes and FLOPs whatever the backend, ``sim.perf_hybrid``).
DIAGNOSTIC_FLAGS: tuple[str, ...] = ("profiler_config", "load_format", "gdn_prefill_backend")


def serving_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded start's flags less the :data:`DIAGNOSTIC_FLAGS`: what the planner and simulator take."""
    return {k: v for k, v in flags.items() if k not in DIAGNOSTIC_FLAGS}


SIZES = {"servetune-test-850m": "0.85B", "llama-3.1-8b": "8B", "qwen2.5-14b": "14B", "mistral-small-24b": "24B"}


@dataclasses.dataclass(frozen=True)
class RealRun:
    """One measured window of a real server: what was sent, with which flags, and what it served."""

    name: str
    model: str  # a shipped model name
    flags: dict[str, Any]
    workload: Workload
    output_throughput: float
    ttft_mean_ms: float
    tpot_mean_ms: float
    preemptions: int
    prefix_cache_hit_rate: float = 0.0  # vLLM's prefix-cache hits / queries over the window
    #: False where the model folder's tokenizer had fewer tokens than the model has ids (the
    #: 2026-12-01 8B/14B starts: make_model.py's 32,000-token BPE), so most sampled ids had no
    #: text: vLLM's API server then runs a path no real checkpoint takes (scale/tokenizers.json).
    tokenizer_covers_vocab: bool = True
    #: The folder holding the window's /metrics dumps (for what the fit reads off them).
    window_dir: Path | None = None
    #: vLLM's API server process CPU over the window (``process_cpu_seconds_total``), when dumped.
    api_server_cpu_s: float | None = None

    @property
    def size(self) -> str:
        return SIZES.get(self.model, self.model)

    @property
    def shape(self) -> str:
        """``prefill`` when prompts are at least as long as outputs, else ``decode``."""
        return "prefill" if self.workload.input_len.mean >= self.workload.output_len.mean else "decode"

    @property
    def tags(self) -> frozenset[str]:
        """The flags and load features the run exercises (for the by-flag folds)."""
        f, w = self.flags, self.workload
        tags = set()
        if f.get("enforce_eager"):
            tags.add("eager")
        if f.get("kv_cache_dtype", "auto") != "auto":
            tags.add("fp8_kv")
        if f.get("max_num_batched_tokens") and int(f["max_num_batched_tokens"]) < 8192:
            tags.add("small_token_budget")
        if f.get("max_num_batched_tokens") and int(f["max_num_batched_tokens"]) > 8192:
            tags.add("large_token_budget")
        if w.prefix_len:
            tags.add("shared_prefix" if w.num_prefix_groups > 1 else "cached_prompts")
        if w.request_rate is not None:
            tags.add("poisson")
        if self.preemptions:
            tags.add("preempting")
        if not self.tokenizer_covers_vocab:
            tags.add("tokenizer_short")
        return frozenset(tags)


@dataclasses.dataclass(frozen=True)
class FidelityRow:
    name: str
    real: RealRun
    sim_output_throughput: float
    sim_ttft_mean_ms: float
    sim_tpot_mean_ms: float
    sim_preemptions: int
    sim_api_server_cpu_s: float | None = None

    @property
    def throughput_error(self) -> float:
        return self.sim_output_throughput / self.real.output_throughput - 1.0

    @property
    def ttft_error(self) -> float:
        return self.sim_ttft_mean_ms / self.real.ttft_mean_ms - 1.0

    @property
    def tpot_error(self) -> float:
        return self.sim_tpot_mean_ms / self.real.tpot_mean_ms - 1.0


def _read(path: Path) -> str:
    # Later runs keep their /metrics dumps gzipped (d1_loadgen_vs_bench, scale/).
    return path.read_text() if path.exists() else gzip.decompress(Path(f"{path}.gz").read_bytes()).decode()


@functools.lru_cache(maxsize=4096)
def _parsed_dump(path: Path) -> Any:
    """One window's /metrics dump, parsed once: each window's counters are read many times (a
    fidelity test loads the same windows in several sets), and parsing is what that costs."""
    return parse_prometheus(_read(path))


def _counter_delta(window_dir: Path, name: str) -> float:
    def read(dump: str) -> float:
        return counter(_parsed_dump(window_dir / dump), name) or 0.0

    return read("metrics_after.txt") - read("metrics_before.txt")


def _run(name: str, s: Mapping[str, Any], window_dir: Path, tokenizer_covers_vocab: bool = True) -> RealRun:
    model = HOST_MODELS.get(str(s.get("model", "/root/model")), str(s.get("model")))
    workload = Workload.from_dict(s["workload"])
    queries = _counter_delta(window_dir, "vllm:prefix_cache_queries_total")
    hit_rate = _counter_delta(window_dir, "vllm:prefix_cache_hits_total") / queries if queries else 0.0
    if hit_rate > 0.05 and not workload.prefix_len:
        # servetune's load generator derives a prompt's token ids from (seed, request index), so a
        # window that follows another on the same server start re-sends the earlier window's
        # prompt prefixes, and vLLM's prefix cache serves them (up to 94-98% of the prompt tokens:
        # every block but the last). The simulator gets the same share of every prompt as one
        # cached prefix: the same prefill work skipped, the same context attended.
        workload = dataclasses.replace(workload, prefix_len=int(round(hit_rate * workload.input_len.mean)),
                                       num_prefix_groups=1)
    return RealRun(name=name, model=model, flags=serving_flags(s["flags"]), workload=workload,
                   output_throughput=float(s["output_throughput"]), ttft_mean_ms=float(s["ttft_ms"]["mean"]),
                   tpot_mean_ms=float(s["tpot_ms"]["mean"]),
                   preemptions=int(round(_counter_delta(window_dir, "vllm:num_preemptions_total"))),
                   prefix_cache_hit_rate=hit_rate, tokenizer_covers_vocab=tokenizer_covers_vocab,
                   window_dir=window_dir, api_server_cpu_s=_counter_delta(window_dir, "process_cpu_seconds_total"))


#: The H200 hosts of the host-keyed ``scale/`` starts (2026-12-02 to 2026-12-04), by key: the UTC date of
#: the host's first server start (its ``server.log.gz``), then a letter in start order among that date's
#: keyed hosts. Each key -> the tag its folders were first named with (``l8b_h7_u09_s256_mbt8192``, now
#: ``2026-12-03b_l8b_u09_s256_mbt8192``; collect and plan files ``2026-12-03b_collect_a.txt``,
#: ``2026-12-03b_plan_l8b.json``; plans in ``benchmarks/real_vllm/`` ``plan_2026_12_03b_l8b.json``), which
#: ``scale/README.md`` prints beside the key, the plans' run names and the summaries still carry, and
#: ``ttft_split.py --hosts`` takes.
SCALE_HOSTS: dict[str, str] = {
    "2026-12-02a": "h4", "2026-12-02b": "h5",
    "2026-12-03a": "h6", "2026-12-03b": "h7", "2026-12-03c": "h8",
    "2026-12-04a": "h9", "2026-12-04b": "h10", "2026-12-04c": "h11",
    "2026-12-04d": "h12", "2026-12-04e": "h13", "2026-12-04f": "h14",
    "2026-12-04g": "h15", "2026-12-04h": "h16",
}


def scale_start(host: str, start: str) -> str:
    """The ``scale/`` folder of ``start`` (model, then flags: ``l8b_u09_s256_mbt8192``; ``l8b_`` gives
    the prefix of the host's 8B starts) on ``host``, a :data:`SCALE_HOSTS` key: ``<host>_<start>``."""
    if host not in SCALE_HOSTS:
        raise KeyError(host)
    return f"{host}_{start}"


def scale_host(name: str) -> str | None:
    """The :data:`SCALE_HOSTS` key of a ``scale/`` start folder or window (``scale/<start>/<window>``);
    None for the starts of no keyed host (``*_fv_*``, ``*_dec``, the 2026-12-01 starts)."""
    start = name.removeprefix("scale/").split("/")[0]
    return next((host for host in SCALE_HOSTS if start.startswith(f"{host}_")), None)


def _starts(host: str, *starts: str) -> tuple[str, ...]:
    return tuple(scale_start(host, start) for start in starts)


#: Collected starts measured after the committed H200 calibration and the held-out folds were
#: fitted (2026-12-02, H200; plan ``scale/plan_l8b_dec.json``): in no fit, so
#: :func:`load_real_runs` leaves them out unless asked for them (``sim_fidelity.py --unseen``).
UNSEEN_STARTS: tuple[str, ...] = (
    "l8b_fv_u09_s256_mbt8192_dec",  # five decode-heavy 8B windows
    # 2026-12-02a, one fresh host (plans scale/2026-12-02a_plan_*.json): each start
    # measured first on the studies' prefill-heavy workload, then on decode-heavy loads; 15 windows.
    *_starts("2026-12-02a", "l8b_u09_s256_mbt8192", "q14b_u09_s256_mbt8192", "l8b_u09_s128_mbt2048", "q14b_u09_s128_mbt2048"),
    # 2026-12-02b, another fresh host (plans 2026-12-02b_plan_*.json), after a
    # confirmed tune there: the prefill-heavy anchor, then closed-loop decode at 32-128 in flight; 13 windows.
    *_starts("2026-12-02b", "l8b_u09_s256_mbt8192", "q14b_u09_s256_mbt8192"),
    # 2026-12-03a, another fresh host (plans 2026-12-03a_plan_*.json): the anchor, then
    # closed-loop decode at 32-192 in flight and 2,048-token outputs, fp8 KV at 8B, 128 x 2048 at 14B; 23 windows.
    *_starts("2026-12-03a", "l8b_u09_s256_mbt8192", "q14b_u09_s256_mbt8192", "l8b_u09_s256_fp8kv", "q14b_u09_s128_mbt2048"),
    # 2026-12-03b, another fresh host (plans 2026-12-03b_plan_*.json): the anchor, bf16 and
    # fp8 KV starts of the same flags at 8B and 14B (decode at 32-192 in flight), a Poisson window; 17 windows.
    *_starts("2026-12-03b", "l8b_u09_s256_mbt8192", "l8b_u09_s256_fp8kv", "q14b_u09_s256_fp8kv", "q14b_u09_s256_mbt8192",
             "l8b_u09_s256_mbt8192_b", "q14b_u09_s256_mbt8192_b"),
    # 2026-12-03c, another fresh host (plan 2026-12-03c_plan.json), after a confirmed
    # tune there: the anchor, then closed-loop decode-heavy windows at 32-160 in flight with 128-512
    # token prompts, bf16 KV, 8B and 14B; 8 windows, collected before any decode-TTFT change.
    *_starts("2026-12-03c", "l8b_u09_s256_mbt8192", "q14b_u09_s256_mbt8192"),
    # 2026-12-04a, the next fresh host (plan 2026-12-04a_plan.json): the anchor, then decode-heavy windows that
    # break the closed loop's lockstep waves (outputs uniform in 512-1536; a Poisson rate); 4 windows.
    *_starts("2026-12-04a", "l8b_u09_s256_mbt8192"),
    # 2026-12-04b and 2026-12-04c: a size no fit has seen, Mistral-Small-24B's shape (23,572M
    # parameters; plans benchmarks/real_vllm/plan_2026_12_04b_m24b.json, plan_2026_12_04c_m24b*.json).
    # 2026-12-04b: the anchor, closed-loop decode at 32-128 in flight, a Poisson rate; 2026-12-04c (a fresh host, the model rebuilt there):
    # 0.9 x 128 x 2048 on the anchor's workload, decode and 2,048-token prompts, fp8 KV decode, then
    # 2026-12-04b's flags on the anchor's workload; 11 windows.
    *_starts("2026-12-04b", "m24b_u09_s256_mbt8192"),
    *_starts("2026-12-04c", "m24b_u09_s128_mbt2048", "m24b_u09_s256_fp8kv", "m24b_u09_s256_mbt8192"),
    # 2026-12-04d and 2026-12-04e: vLLM's torch profiler inside real steps (plans
    # plan_2026_12_04d_m24b_prof.json, plan_2026_12_04e_*_prof*.json). Each start's first window is the
    # clean anchor; its profiled windows (summary "profiled") stall the engine while the trace is written and are
    # no fidelity windows (load_real_runs leaves them out). 2026-12-04d ran 24B; 2026-12-04e
    # 14B, 8B at budgets 8192 and 2048 and 8B eager: 4 clean windows, 9 traces.
    *_starts("2026-12-04d", "m24b_u09_s256_mbt8192"),
    *_starts("2026-12-04e", "q14b_u09_s256_mbt8192", "l8b_u09_s256_mbt8192", "l8b_u09_s256_mbt2048", "l8b_u09_s256_eager"),
    # 2026-12-04f and 2026-12-04g (plans plan_2026_12_04f_l8b.json, plan_2026_12_04g_m24b*.json), collected
    # before any change fitted that day on them. 2026-12-04f: 8B at a 2,048-token budget (the anchor,
    # a shared-prefix window; two profiled windows: the first wave's mixed steps, decode at 96 in flight),
    # then 160 sequences x a 4,096-token budget (the anchor's workload, a Poisson load with uneven outputs,
    # decode at 192 in flight). 2026-12-04g (a fresh host, the 24B model built there): 24B at a
    # 4,096-token budget (the anchor, decode at 192 in flight with uneven outputs, a shared-prefix window;
    # two profiled), then 24B eager (a prefill-heavy window at 128 in flight; one profiled); 9 clean
    # windows, 5 traces.
    *_starts("2026-12-04f", "l8b_u09_s256_mbt2048", "l8b_u09_s160_mbt4096"),
    *_starts("2026-12-04g", "m24b_u09_s256_mbt4096", "m24b_u09_s128_eager"),
    # 2026-12-04h, one fresh host (plans 2026-12-04h_plan_*.json), collected before any change
    # fitted on it: 24B eager (the 2026-12-04g host's eager window again, clean eager
    # decode at 128 in flight), then the 24B anchor flags (the anchor, a Poisson load with uneven outputs,
    # decode at 32 in flight); 8B eager under budgets 8192 and 2048 (the anchor's workload, decode at 128,
    # 64, 16 and 4 in flight), the 8B anchor flags (the anchor, the 2026-12-04f host's Poisson load, decode
    # at 32) and 64 sequences (flags no run has used); 16 clean windows, no trace.
    *_starts("2026-12-04h", "m24b_u09_s128_eager", "m24b_u09_s256_mbt8192", "l8b_u09_s256_eager", "l8b_u09_s256_mbt8192",
             "l8b_u09_s256_mbt2048_eager", "l8b_u09_s64_mbt8192"),
)


def _keyed_host(host: str, calibrating: str, *models: str) -> tuple[str, tuple[str, ...]]:
    """A :data:`SCALE_HOSTS` host's entry of :data:`UNSEEN_HOSTS`: its calibrating window
    (``<start>/<window>``, the start as :func:`scale_start` takes it) and one prefix per model it served."""
    start, _, window = calibrating.partition("/")
    return f"scale/{scale_start(host, start)}/{window}", tuple(f"scale/{scale_start(host, f'{m}_')}" for m in models)


#: The real hosts of the unseen windows: for each, the one window its API-server CPU factor is read
#: off (``servetune.sim.host_api_cpu_factor``; the host's first measurement of the studies'
#: prefill-heavy workload, as a study's first trial would be) and the windows judged with that
#: factor (name prefixes). A host is one machine, booted once: its process ids run on from start to start.
UNSEEN_HOSTS: dict[str, tuple[str, tuple[str, ...]]] = {
    # 2026-12-02 H200, a fresh host: the 14B grid's trials 6-8 (study_q14b), then the decode start (*_dec).
    "2026-12-02 H200, study_q14b": ("study_q14b/h200-q14b-grid/0008", ("scale/l8b_fv_u09_s256_mbt8192_dec/",)),
    **{host: _keyed_host(host, "l8b_u09_s256_mbt8192/p1024_o256_c256", "l8b", "q14b")
       for host in ("2026-12-02a", "2026-12-02b", "2026-12-03a", "2026-12-03b", "2026-12-03c")},
    "2026-12-04a": _keyed_host("2026-12-04a", "l8b_u09_s256_mbt8192/p1024_o256_c256", "l8b"),
    # The 24B hosts. 2026-12-04c's first window of the anchor's workload ran under 0.9 x 128 x 2048.
    "2026-12-04b": _keyed_host("2026-12-04b", "m24b_u09_s256_mbt8192/p1024_o256_c256", "m24b"),
    "2026-12-04c": _keyed_host("2026-12-04c", "m24b_u09_s128_mbt2048/p1024_o256_c256", "m24b"),
    # The profiling hosts: 2026-12-04d's one clean window is its factor's; 2026-12-04e's 14B anchor
    # sets its factor, its two 8B anchors (budgets 8192 and 2048) are judged.
    "2026-12-04d": _keyed_host("2026-12-04d", "m24b_u09_s256_mbt8192/p1024_o256_c256", "m24b"),
    "2026-12-04e": _keyed_host("2026-12-04e", "q14b_u09_s256_mbt8192/p1024_o256_c256", "q14b", "l8b"),
    # 2026-12-04f and 2026-12-04g: each start's first window is the anchor's workload; the first
    # start's sets the host's factor (2026-12-04f's ran under a 2,048-token budget).
    "2026-12-04f": _keyed_host("2026-12-04f", "l8b_u09_s256_mbt2048/p1024_o256_c256", "l8b"),
    "2026-12-04g": _keyed_host("2026-12-04g", "m24b_u09_s256_mbt4096/p1024_o256_c256", "m24b"),
    # 2026-12-04h: its first window of the anchor's workload at the anchor's flags is the
    # 24B one (the eager start before it served 128 in flight); the 8B starts after it are judged by it.
    "2026-12-04h": _keyed_host("2026-12-04h", "m24b_u09_s256_mbt8192/p1024_o256_c256", "m24b", "l8b"),
}


def load_real_runs(fixtures: Path = FIXTURES, include_tokenizer_short: bool = False,
                   starts: Collection[str] | None = None) -> list[RealRun]:
    """Every healthy window (a server that started and served the workload), sorted by name.

    0.85B runs are named by their folder (``a1_u05_s64``); user-scale windows by start and window
    (``scale/l8b_u09_s256_mbt8192/p1024_o256_c128``). Windows of a model whose tokenizer did not
    cover its vocabulary are left out unless ``include_tokenizer_short``: they measured an API
    server path that users of a real checkpoint never run (scale/tokenizers.json), so neither a
    fit nor a fidelity figure may rest on them. The :data:`UNSEEN_STARTS` are left out too, unless
    ``starts`` names the user-scale starts to read (then only those, and no 0.85B run).
    """
    def wanted(start: str) -> bool:
        return start in starts if starts is not None else start not in UNSEEN_STARTS

    vocab_file = fixtures / "scale" / "tokenizers.json"
    tokenizer_vocab = json.loads(vocab_file.read_text())["tokenizer_vocab"] if vocab_file.exists() else {}
    vocab_sizes: dict[str, int] = {}  # each model's config read once, not once per window
    runs = []
    for summary_path in sorted(fixtures.glob("*/summary.json")) if starts is None else []:
        s = json.loads(summary_path.read_text())
        if not s.get("healthy") or s.get("output_throughput") is None:
            continue
        runs.append(_run(s["name"], s, summary_path.parent))
    for summary_path in sorted(fixtures.glob("scale/*/*/summary.json")):
        s = json.loads(summary_path.read_text())
        if s.get("error") or s.get("output_throughput") is None or not s.get("completed") or s.get("profiled"):
            continue  # a profiled window stalled while its trace was written: not the workload's pace
        window = summary_path.parent
        start = window.parent.name
        if not wanted(start):
            continue
        name = HOST_MODELS.get(str(s.get("model")), str(s.get("model")))
        vocab = vocab_sizes.get(name) or vocab_sizes.setdefault(name, load_model(name).vocab_size)
        covers = int(tokenizer_vocab.get(start, vocab)) >= vocab
        if covers or include_tokenizer_short:
            runs.append(_run(f"scale/{start}/{window.name}", s, window, covers))
    return runs


#: Real servetune studies whose trials are measured windows too: (fixture folder, study name ->
#: trial folder, the workload every trial sent). In the fits and folds since 2026-12-02 (load_evidence).
GRID_STUDIES: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    # benchmarks/real_vllm/h200_l8b_grid.yaml (+ _b): Llama-3.1-8B shape, covering tokenizer.
    "study_l8b": ({"h200-l8b-grid": "grid", "h200-l8b-grid-b": "grid_b"},
                  {"input_len": 1024, "output_len": 256, "num_requests": 512, "concurrency": 256,
                   "warmup_requests": 4, "seed": 0}),
}

_L8B_WORKLOAD = GRID_STUDIES["study_l8b"][1]

#: Real studies measured after the committed H200 calibration and the held-out folds were fitted
#: (2026-12-02, H200): in no fit, so every figure on them is out of sample
#: for every calibration (``sim_fidelity.py --unseen``). Same workload as the 8B grid.
UNSEEN_STUDIES: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "study_l8b": ({"h200-l8b-grid-c": "grid_c"}, _L8B_WORKLOAD),  # the 8B grid's last cell
    "study_l8b_tune": ({"h200-l8b-tune": "trials"}, _L8B_WORKLOAD),  # the confirmed tune (memory pair)
    "study_q14b": ({"h200-q14b-grid": "grid"}, _L8B_WORKLOAD),  # h200_q14b_grid.yaml, Qwen2.5-14B shape
}


def load_study_runs(fixtures: Path = FIXTURES,
                    studies: Mapping[str, tuple[dict[str, str], dict[str, Any]]] = GRID_STUDIES) -> list[RealRun]:
    """Every served trial of ``studies`` (a fresh server each: no prefix hits across trials).

    Named ``<folder>/<study>/<trial>`` (``-repeat-1`` for a confirmation repeat), with the flags
    and figures the study's Parquet dataset recorded and the preemptions of the trial's /metrics.
    A fixture folder's other studies are not read (``study_l8b`` holds fitted and unseen ones).
    A trial that early stopping cut short is left out: its window is not the workload's.
    """
    runs = []
    for folder, (names, workload) in studies.items():
        rows = dataset.read_trials(fixtures / folder / "dataset").to_dict("records")
        for row in sorted(rows, key=lambda r: (r["study"], r["trial_number"], r["origin"])):
            if row["status"] != "ok" or row["study"] not in names or row["completed"] < workload["num_requests"]:
                continue
            flags = dataset.row_flags(row)
            trial = dataset.row_trial_dir_name(row)
            summary = {"model": row.get("serve_model"), "flags": flags, "workload": workload,
                       "output_throughput": row["output_throughput"], "ttft_ms": {"mean": row["ttft_mean_ms"]},
                       "tpot_ms": {"mean": row["tpot_mean_ms"]}}
            # _run maps the host's model folder (serve_model) to the shipped config, as for the windows.
            runs.append(_run(f"{folder}/{row['study']}/{trial}", summary, fixtures / folder / names[row["study"]] / trial))
    return runs


def load_unseen_runs(fixtures: Path = FIXTURES) -> list[RealRun]:
    """Every window measured after the committed calibration and the folds were fitted: the
    :data:`UNSEEN_STARTS`' windows and the :data:`UNSEEN_STUDIES`' trials. Out of sample for all."""
    return load_real_runs(fixtures, starts=UNSEEN_STARTS) + load_study_runs(fixtures, UNSEEN_STUDIES)


def load_evidence(fixtures: Path = FIXTURES) -> list[RealRun]:
    """The measured windows the held-out folds split (the runs of the 2026-12-02 fit): the collected
    windows and the study trials, none of the :data:`UNSEEN_STARTS` or :data:`UNSEEN_STUDIES`."""
    return load_real_runs(fixtures) + load_study_runs(fixtures)


#: Hosts no fit has seen: the committed calibration (2026-12-03) was fitted on every other host's
#: runs, and these hosts' windows, collected before that fit (2026-12-03c's after it, before any
#: change it judges), are its held-out judges. The hosts 2026-12-04b and 2026-12-04c ran a size no
#: fit has seen (24B), collected after every constant of the committed calibration was chosen;
#: 2026-12-04d and 2026-12-04e were profiled (their clean windows only).
HELD_OUT_HOSTS: tuple[str, ...] = ("2026-12-03a", "2026-12-03b", "2026-12-03c", "2026-12-04a", "2026-12-04b",
                                   "2026-12-04c", "2026-12-04d", "2026-12-04e", "2026-12-04f", "2026-12-04g",
                                   "2026-12-04h")


#: The starts of a held-out host that one knob was fitted on, the rest of the calibration never:
#: ``fp8_kv_read_efficiency`` (:func:`fit_fp8_kv_read`) on the 2026-12-03a host's fp8 KV start,
#: the only fp8 start with a covering tokenizer before the 2026-12-03b host, whose fp8 starts judge it.
FP8_FIT_STARTS: tuple[str, ...] = (scale_start("2026-12-03a", "l8b_u09_s256_fp8kv"),)


def in_calibration_fit(run_name: str) -> bool:
    """Whether the committed calibration was fitted on this run: every run but those of
    :data:`HELD_OUT_HOSTS`, less the :data:`FP8_FIT_STARTS` (the one rule
    :func:`load_calibration_runs`, ``sim_fidelity --unseen`` and the tests apply)."""
    return host_of(run_name) not in HELD_OUT_HOSTS or _in_fp8_fit(run_name)


def _in_fp8_fit(run_name: str) -> bool:
    return any(run_name.startswith(f"scale/{start}/") for start in FP8_FIT_STARTS)


def load_calibration_runs(fixtures: Path = FIXTURES) -> list[RealRun]:
    """What the committed calibration's joint fit (:func:`fit`) is fitted on: :func:`load_evidence`
    and every unseen run :func:`in_calibration_fit`, each simulated at its host's factor, but the
    :data:`FP8_FIT_STARTS` (fitted alone, :func:`fit_fp8_kv_read`)."""
    return load_evidence(fixtures) + [r for r in load_unseen_runs(fixtures)
                                      if in_calibration_fit(r.name) and not _in_fp8_fit(r.name)]


def calibration_host_factors(runs: Iterable[RealRun] | None = None) -> dict[str, float]:
    """The API-server CPU factor of each fitted host of :data:`UNSEEN_HOSTS` (:func:`host_factor`,
    the committed calibration): a fit's ``host_factors``."""
    by_name = {r.name: r for r in (runs if runs is not None else load_unseen_runs())}
    return {host: host_factor(host, by_name) for host in UNSEEN_HOSTS if host not in HELD_OUT_HOSTS}


#: Real vLLM 0.26.0 on one H100 SXM (2026-12-05, ``tests/fixtures/real_h100``): one folder per server
#: start, one sub-folder per measured window, as ``real_h200/scale``. The windows of
#: :data:`H100_FIT_STARTS` fitted the H100's one own knob (``servetune.sim.GPU_FAMILY_OVERRIDES``:
#: ``kv_read_efficiency``); those of :data:`H100_JUDGED_STARTS` are in no fit and judge it.
H100_FIXTURES = FIXTURES.parent / "real_h100"
#: Real H100 starts of other model classes (an MoE shape, FP8 weights, an FP8 KV cache), 2026-12-05:
#: in no fit; the simulator is judged on them (``sim_fidelity.py --h100-classes``).
H100_CLASSES_FIXTURES = FIXTURES.parent / "real_h100_classes"
#: The H200 MoE and MXFP4 starts of 2026-12-05 (their README), in no fit; read with :func:`load_h100_runs`.
H200_CLASSES_FIXTURES = FIXTURES.parent / "real_h200_classes"
#: Starts whose random weights, quantized online (``--quantization fp8``), routed every batch to few experts:
#: vLLM's profiler timed the same start's expert kernels at under a seventh of uniform routing's kernel time
#: (``real_h100_classes/2026-12-07_q3moe_fp8_prof_*``, ``tests/sim/test_steps_moe.py``). Their windows above one
#: sequence judge uniform routing against a server that did not route so: reported, left out of the accuracy.
FEW_EXPERTS_STARTS: tuple[str, ...] = ("2026-12-05_q3moe_fp8_u09_s256_mbt8192",
                                       "2026-12-05_q3moe_fp8_u09_s256_mbt8192_h200")


def routes_uniformly(name: str) -> bool:
    """Whether window ``name`` (``<start>/<window>``) is evidence for uniformly routed experts: not a window above one
    sequence of a :data:`FEW_EXPERTS_STARTS` start."""
    start, _, window = name.partition("/")
    return start not in FEW_EXPERTS_STARTS or window.endswith("_c1")
H100_GPU = "H100-80GB"
#: The H100's first measured window (the anchor's workload at the anchor's flags, a fresh server):
#: the one its API-server CPU factor is read off, as a study's first trial would be.
H100_CALIBRATING = "2026-12-05_l8b_u09_s256_mbt8192/p1024_o256_c256"


def load_h100_runs(fixtures: Path = H100_FIXTURES) -> list[RealRun]:
    """Every served, unprofiled window of the H100 starts, named ``<start>/<window>``, sorted by
    start folder and, within a start, in the order its windows ran."""
    runs = []
    for start_summary in sorted(fixtures.glob("*/summary.json")):
        start = json.loads(start_summary.read_text())
        for window in start.get("windows", {}):
            path = start_summary.parent / window / "summary.json"
            if not path.exists():
                continue  # skipped by the plan's deadline
            s = json.loads(path.read_text())
            if s.get("error") or s.get("output_throughput") is None or not s.get("completed") or s.get("profiled"):
                continue
            runs.append(_run(f"{start_summary.parent.name}/{window}", s, path.parent))
    return runs


def h100_check(runs: Sequence[RealRun] | None = None, calibration: Mapping[str, float] | None = None) -> HostCheck:
    """The H100 judged as the H200 hosts are (:func:`host_checks`): the API-server factor read off
    :data:`H100_CALIBRATING`, then every window simulated on :data:`H100_GPU` at factor 1
    (``plain``, the calibrating window included) and every other window at the factor
    (``with_factor``). ``calibration``: overrides of the committed knobs (:func:`h200_knobs_on`: the
    H100 before its own fit). Rows of :data:`H100_FIT_STARTS` are fitting data (:func:`in_h100_fit`)."""
    runs = list(runs if runs is not None else load_h100_runs())
    anchor = next(r for r in runs if r.name == H100_CALIBRATING)
    factor = window_api_cpu_factor(anchor, calibration, gpu=H100_GPU)
    judged = [r for r in runs if r is not anchor]
    with_factor = fidelity_rows({**(calibration or {}), "api_cpu_factor": factor}, judged, gpu=H100_GPU)
    return HostCheck("H100 2026-12-05", anchor.name, factor, fidelity_rows(calibration, runs, gpu=H100_GPU),
                     with_factor)


#: The H100 windows split before any fit: the H100's GPU_FAMILY_OVERRIDES are fitted on the starts
#: of H100_FIT_STARTS (8 windows) and judged on those of H100_JUDGED_STARTS (8). Whole starts stay
#: together (a start's windows share its compile and its server process). Stratified by flags and
#: load: the fit has the anchor flags (256 x 8192, cold) and a 2,048-token budget, each with its
#: prefill-heavy window at 256 in flight and decode at 4-128 in flight plus the Poisson load; the
#: judged half has the anchor flags again (kernels cached: decode at 1 and at 256 in flight, the
#: largest batch x context of all 16, prefill-heavy at 128), 64 sequences (prefill-heavy and decode)
#: and enforce_eager (every eager window, so the fit never sees the launch floor it does not set).
H100_FIT_STARTS: tuple[str, ...] = ("2026-12-05_l8b_u09_s256_mbt8192", "2026-12-05_l8b_u09_s256_mbt2048")
H100_JUDGED_STARTS: tuple[str, ...] = ("2026-12-05_l8b_u09_s256_mbt8192_b", "2026-12-05_l8b_u09_s64_mbt8192",
                                       "2026-12-05_l8b_u09_s256_eager")


def in_h100_fit(run_name: str) -> bool:
    """Whether an H100 window (``<start>/<window>``) is fitting data (:data:`H100_FIT_STARTS`)."""
    return run_name.split("/", 1)[0] in H100_FIT_STARTS


def h100_hbm_read_share(fixtures: Path = H100_FIXTURES) -> float:
    """The H100 host's read-only HBM probe (``hbm_h100.json``: a 4 GiB sum) over the GPU table's
    datasheet bandwidth: the ceiling of the H100's ``kv_read_efficiency`` fit."""
    probe = json.loads((fixtures / "2026-12-05_h100_host" / "hbm_h100.json").read_text())
    return float(probe["sum_read_gb_s"]) / get_gpu(H100_GPU).hbm_gbps


def fit_h100_kv_read(calibration: Mapping[str, float] | None = None, tolerance: float = 1e-3) -> float:
    """``kv_read_efficiency`` on the H100 fitted alone (:func:`fit_alone`) on the windows of
    :data:`H100_FIT_STARTS` at API-server factor 1, between 0.5 and :func:`h100_hbm_read_share`."""
    runs = [r for r in load_h100_runs() if in_h100_fit(r.name)]
    return fit_alone("kv_read_efficiency", runs, (0.5, h100_hbm_read_share()), calibration=calibration,
                     tolerance=tolerance, gpu=H100_GPU)


#: The real H100 model-class start the fused-MoE floor (``moe_layer_floor_s``) is fitted on; the
#: other MoE starts of :data:`H100_CLASSES_FIXTURES` judge it (the dense FP8 starts are in no fit).
MOE_FLOOR_FIT_START = "2026-12-05_q3moe_fp8_u09_s256_mbt8192"


def fit_moe_floor(tolerance: float = 2e-7) -> float:
    """``moe_layer_floor_s`` fitted alone (:func:`fit_alone`, 0 to 100 us) on the windows of
    :data:`MOE_FLOOR_FIT_START`, simulated on the H100 at API-server factor 1."""
    runs = [r for r in load_h100_runs(H100_CLASSES_FIXTURES) if r.name.startswith(MOE_FLOOR_FIT_START + "/")]
    return fit_alone("moe_layer_floor_s", runs, (0.0, 1e-4), tolerance=tolerance, gpu=H100_GPU)


def h200_knobs_on(gpu: str) -> dict[str, float]:
    """Overrides that put back the H200's value of every knob ``gpu``'s family replaces
    (``servetune.sim.GPU_FAMILY_OVERRIDES``): the GPU judged as it was before its own fit."""
    h200 = calibration_for(get_gpu(GPU))
    return {k: getattr(h200, k) for k in GPU_FAMILY_OVERRIDES.get(get_gpu(gpu).name, {})}


def read_knobs(option: str, path: Path) -> dict[str, float] | None:
    """A candidate calibration file's ``knobs`` (``sim_fidelity.py --knobs/--start``,
    ``gemm_vs_sim.py --knobs``), checked by the simulator's own rule for names and ranges
    (``Calibration.with_overrides``) before anything is simulated; None, after one line on stderr
    naming ``option``, the file and the fault, when it is not one."""
    try:
        knobs = {k: float(v) for k, v in json.loads(path.read_text())["knobs"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"{option} {path}: {exc}; expected a JSON object with a 'knobs' mapping of numbers", file=sys.stderr)
        return None
    try:
        Calibration().with_overrides(knobs)
    except SpecError as exc:
        print(f"{option} {path}: {exc}", file=sys.stderr)
        return None
    return knobs


#: The Mamba2 hybrid starts of 2026-12-06 (one H100 SXM, vLLM 0.26.0, random weights) measured by one
#: ``vllm bench serve`` window each (``bench.txt.gz``, /metrics before and after): granite-4.0-h-tiny and
#: Nemotron-H-8B-Base-8K. They judge the hybrid step time (``sim.perf_hybrid``), which is fitted on nothing.
HYBRID_BENCH_STARTS: tuple[str, ...] = ("2026-12-06_ghtiny_u09_s256_mbt8192", "2026-12-06_nemh8b_u09_s256_mbt8192",
                                         # the Qwen3-Next 12-layer shape (gated delta nets, 512 experts), served on
                                         # 2026-12-07 with vLLM 0.26's Triton gated-delta-net prefill
                                         "2026-12-07_q3next12tri_u09_s256_mbt8192",
                                         # the Qwen3.5-35B-A3B shape at 20 layers (256 experts), 512 in flight
                                         "2026-12-07_q35moe20tri_lmo_u09_default")


def _bench_field(text: str, pattern: str, where: Path) -> str:
    match = re.search(pattern, text)
    if match is None:
        raise SpecError(str(where), f"no {pattern!r} in the bench output", "keep vllm bench serve's full output")
    return match.group(1)


def load_bench_serve_run(start_dir: Path) -> RealRun:
    """One start's ``vllm bench serve`` window as a :class:`RealRun`: the flags of its ``summary.json``,
    the load of the bench's own argument line (random dataset: fixed input and output lengths, the
    prompt count, ``max_concurrency``, warm-ups), its output tok/s and mean TTFT and TPOT, the
    preemptions off /metrics. A bench that sent no ``temperature`` samples with vLLM's default
    (temperature 1.0: these model folders hold no ``generation_config.json``)."""
    s = json.loads((start_dir / "summary.json").read_text())
    text = _read(start_dir / "bench.txt")
    field = functools.partial(_bench_field, text, where=start_dir / "bench.txt.gz")
    if field(r"dataset_name='(\w+)'") != "random" or field(r"random_range_ratio='?([\d.]+)") not in ("0", "0.0"):
        raise SpecError(str(start_dir), "not a fixed-length random-dataset bench", "judge it by other means")
    temperature = field(r"temperature=([\w.]+)")
    workload = Workload.from_dict({"input_len": int(field(r"random_input_len=(\d+)")),
                                   "output_len": int(field(r"random_output_len=(\d+)")),
                                   "num_requests": int(field(r"num_prompts=(\d+)")),
                                   "concurrency": int(field(r"max_concurrency=(\d+)")),
                                   "warmup_requests": int(field(r"num_warmups=(\d+)")), "seed": int(field(r"seed=(\d+)"))})
    sampling = Sampling(temperature=1.0 if temperature == "None" else float(temperature))
    workload = dataclasses.replace(workload, sampling=sampling)
    return RealRun(name=start_dir.name, model=HOST_MODELS.get(str(s["model"]), str(s["model"])),
                   flags=serving_flags({**argv_switches(s.get("argv", [])), **s["flags"]}), workload=workload,
                   output_throughput=float(field(r"Output token throughput \(tok/s\):\s+([\d.]+)")),
                   ttft_mean_ms=float(field(r"Mean TTFT \(ms\):\s+([\d.]+)")),
                   tpot_mean_ms=float(field(r"Mean TPOT \(ms\):\s+([\d.]+)")),
                   preemptions=int(round(_counter_delta(start_dir, "vllm:num_preemptions_total"))),
                   window_dir=start_dir, api_server_cpu_s=_counter_delta(start_dir, "process_cpu_seconds_total"))


def argv_switches(argv: Iterable[str]) -> dict[str, bool]:
    """The valueless switches of a start's ``vllm serve`` line (``--language-model-only``: an option followed by
    another option or by nothing), as flags set to True; ``--no-...`` switches are left to the recorded flags.
    ``benchmarks/real_vllm/start_only.sh`` wrote its ``flags`` as option / value pairs, so a switch at the end of
    the line is in its ``argv`` only.

    Example:
        >>> argv_switches(["vllm", "serve", "/m", "--max-num-seqs", "8", "--language-model-only"])
        {'language_model_only': True}
    """
    args = list(argv)
    return {a[2:].replace("-", "_"): True for i, a in enumerate(args)
            if a.startswith("--") and not a.startswith("--no-") and (i + 1 == len(args) or args[i + 1].startswith("--"))}


def load_hybrid_runs(fixtures: Path | None = None) -> list[RealRun]:
    """The :data:`HYBRID_BENCH_STARTS` windows (:func:`load_bench_serve_run`)."""
    root = fixtures or H100_CLASSES_FIXTURES
    return [load_bench_serve_run(root / start) for start in HYBRID_BENCH_STARTS]


def _gpu_with(calibration: Mapping[str, float] | None, gpu: str = GPU) -> GpuSpec:
    return with_calibration(get_gpu(gpu), calibration or {})


def host_of(run_name: str) -> str | None:
    """The :data:`UNSEEN_HOSTS` host a run was measured on (its calibrating window, or a window
    under one of its prefixes); None for the runs of hosts with no factor of their own."""
    for host, (calibrating, prefixes) in UNSEEN_HOSTS.items():
        if run_name == calibrating or any(run_name.startswith(p) for p in prefixes):
            return host
    return None


def fidelity_rows(calibration: Mapping[str, float] | None = None,
                  runs: Iterable[RealRun] | None = None, max_requests: int | None = None,
                  host_factors: Mapping[str, float] | None = None, gpu: str = GPU) -> list[FidelityRow]:
    """Simulate every real run on ``gpu`` (the H200 unless named); ``calibration`` overrides its
    knobs (for fitting).

    ``max_requests`` simulates only the first requests of each window (the fit's inner loop: a
    closed-loop window reaches its steady state within a few rounds of its concurrency).
    ``host_factors`` (host of :data:`UNSEEN_HOSTS` -> API-server CPU factor) simulates each host's
    runs (:func:`host_of`) at its own factor and every other run at the calibration's: runs from
    several hosts judged, or fitted, together.
    """
    gpus = {None: _gpu_with(calibration, gpu)}
    for host, factor in (host_factors or {}).items():
        gpus[host] = _gpu_with({**(calibration or {}), "api_cpu_factor": factor}, gpu)
    rows = []
    models: dict[str, Any] = {}
    for run in runs if runs is not None else load_evidence():
        gpu = gpus.get(host_of(run.name), gpus[None])
        model = models.get(run.model) or models.setdefault(run.model, load_model(run.model))
        config = resolve_engine_config(run.flags, model, gpu)
        workload = run.workload
        # Two rounds of the closed loop at least: a window cut below its concurrency never queues.
        cap = max(max_requests, 2 * (workload.concurrency or 0)) if max_requests else None
        if cap and workload.num_requests > cap:
            workload = dataclasses.replace(workload, num_requests=cap)
        rows.append(FidelityRow(run.name, run, *_simulated(model, gpu, config, workload)))
    return rows


#: What a fidelity row takes from one simulation: output tok/s, mean TTFT and TPOT (ms), preemptions,
#: API-server CPU seconds.
_SimFigures = tuple[float, float, float, int, float | None]
#: Simulations already run in this process, by their inputs' ``repr`` (oldest dropped past 4,096).
_SIMULATED: dict[tuple[str, str, str, str], _SimFigures] = {}


def _simulated(model: Any, gpu: GpuSpec, config: Any, workload: Workload) -> _SimFigures:
    """One window's simulation, run once per process: the simulator is deterministic, and the tests
    judge the same windows under the same knobs in several sets. The key is the inputs' ``repr``,
    which tells every field's value and type apart (1 from 1.0, -0.0 from 0.0)."""
    key = (repr(model), repr(gpu), repr(config), repr(workload))
    if key not in _SIMULATED:
        if len(_SIMULATED) >= 4096:  # a long fit: keep the memory bounded
            del _SIMULATED[next(iter(_SIMULATED))]
        result = simulate(model, gpu, config, workload, plan=plan_memory(model, gpu, config))
        _SIMULATED[key] = (result.output_throughput or 0.0, result.ttft_ms.mean if result.ttft_ms else math.nan,
                           result.tpot_ms.mean if result.tpot_ms else math.nan, result.preemptions or 0,
                           result.api_server_cpu_s)
    return _SIMULATED[key]


@dataclasses.dataclass(frozen=True)
class HostCheck:
    """One real host of :data:`UNSEEN_HOSTS`: the factor read off its calibrating window, and its
    other windows simulated with the committed calibration (``plain``) and with the factor."""

    host: str
    calibrating_window: str
    api_cpu_factor: float
    plain: list[FidelityRow]
    with_factor: list[FidelityRow]


def host_factor(host: str, runs_by_name: Mapping[str, RealRun],
                calibration: Mapping[str, float] | None = None) -> float:
    """``host_api_cpu_factor`` of the host's calibrating window (:data:`UNSEEN_HOSTS`): its real
    API-server CPU against the simulation of the same window (``calibration``: overrides of the
    committed one, as :func:`fidelity_rows` takes them)."""
    return window_api_cpu_factor(runs_by_name[UNSEEN_HOSTS[host][0]], calibration)


def window_api_cpu_factor(anchor: RealRun, calibration: Mapping[str, float] | None = None, gpu: str = GPU) -> float:
    """``host_api_cpu_factor`` of one real window: its API-server CPU against the simulation of the
    same window on ``gpu`` (``calibration``: overrides of the committed knobs)."""
    sim = fidelity_rows(calibration, [anchor], gpu=gpu)[0]
    factor = host_api_cpu_factor(TrialResult(TrialStatus.OK, api_server_cpu_s=anchor.api_server_cpu_s),
                                 TrialResult(TrialStatus.OK, api_server_cpu_s=sim.sim_api_server_cpu_s))
    if factor is None:
        raise ValueError(f"{anchor.name}: no API-server CPU on one side")
    return factor


def host_checks(runs: Iterable[RealRun] | None = None,
                calibration: Mapping[str, float] | None = None) -> list[HostCheck]:
    """The host factor judged held out: per host of :data:`UNSEEN_HOSTS`, ``host_api_cpu_factor``
    of its calibrating window (real against simulated API-server CPU, committed calibration or
    ``calibration``'s overrides of it), then every other window of the host simulated with it.
    Nothing here is fitted to throughput. A host with no window besides its calibrating one (the
    twelfth: one clean window, the rest profiled) has nothing to judge and no check."""
    by_name = {r.name: r for r in (runs if runs is not None else load_unseen_runs())}
    out = []
    for host, (calibrating, _) in UNSEEN_HOSTS.items():
        judged = [r for name, r in sorted(by_name.items()) if name != calibrating and host_of(name) == host]
        if not judged:
            continue
        factor = host_factor(host, by_name, calibration)
        out.append(HostCheck(host, calibrating, factor, fidelity_rows(calibration, judged),
                             fidelity_rows(calibration, judged, host_factors={host: factor})))
    return out


def held_out_cells(checks: Iterable[HostCheck]) -> dict[str, list[FidelityRow]]:
    """The held-out hosts' never-fitted windows, each at its host's factor (``checks``:
    :func:`host_checks`), by model size and load shape, the fp8 KV windows apart: README's
    "held out, per size and load shape" table (``sim_fidelity.py --unseen`` prints it). Cells in
    the order sizes, then shapes, appear; the factor-reading windows are in no cell."""
    cells: dict[str, list[FidelityRow]] = {}
    rows = [r for c in checks if c.host in HELD_OUT_HOSTS for r in c.with_factor if not in_calibration_fit(r.name)]
    for r in sorted(rows, key=lambda r: (float(r.real.size.rstrip("B")), r.real.shape != "prefill")):
        fp8 = r.real.flags.get("kv_cache_dtype") == "fp8"
        key = "fp8 KV cache" if fp8 else f"{r.real.size} {r.real.shape}-heavy"
        cells.setdefault(key, []).append(r)
    if "fp8 KV cache" in cells:
        cells["fp8 KV cache"] = cells.pop("fp8 KV cache")  # last, as README lists it
    return cells


def error_summary(rows: list[FidelityRow]) -> dict[str, float]:
    """Mean absolute relative errors, and whether preempting runs were predicted as preempting."""
    n = len(rows)
    return {
        "runs": float(n),
        "throughput_mae": sum(abs(r.throughput_error) for r in rows) / n,
        "throughput_bias": sum(r.throughput_error for r in rows) / n,
        "throughput_max": max(abs(r.throughput_error) for r in rows),
        "ttft_mae": sum(abs(r.ttft_error) for r in rows) / n,
        "tpot_mae": sum(abs(r.tpot_error) for r in rows) / n,
        "preemption_class_agree": float(sum((r.real.preemptions > 0) == (r.sim_preemptions > 0) for r in rows)) / n,
    }


def format_table(rows: list[FidelityRow]) -> str:
    head = (f"{'run':<52} {'out tok/s real':>14} {'sim':>8} {'err':>6}  {'TTFT ms real':>12} {'sim':>7} {'err':>6}"
            f"  {'TPOT ms real':>12} {'sim':>6} {'err':>6}  {'preempt real':>12} {'sim':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.name:<52} {r.real.output_throughput:>14,.0f} {r.sim_output_throughput:>8,.0f} "
            f"{100 * r.throughput_error:>+5.1f}%  {r.real.ttft_mean_ms:>12,.1f} {r.sim_ttft_mean_ms:>7,.1f} "
            f"{100 * r.ttft_error:>+5.1f}%  {r.real.tpot_mean_ms:>12.2f} {r.sim_tpot_mean_ms:>6.2f} "
            f"{100 * r.tpot_error:>+5.1f}%  {r.real.preemptions:>12} {r.sim_preemptions:>5}")
    e = error_summary(rows)
    lines.append(f"mean |error|: output throughput {100 * e['throughput_mae']:.1f}% (bias "
                 f"{100 * e['throughput_bias']:+.1f}%, max {100 * e['throughput_max']:.1f}%), TTFT "
                 f"{100 * e['ttft_mae']:.1f}%, TPOT {100 * e['tpot_mae']:.1f}%; preempting-or-not agrees on "
                 f"{e['preemption_class_agree'] * len(rows):.0f}/{len(rows)} runs")
    return "\n".join(lines)


#: The knobs --fit searches, with their ranges (log-uniform for the time constants). The CPU-side
#: constants of the API server and engine core are shared by every size; what scales with the
#: model is derived from its shapes (servetune.sim.perf), not fitted per size.
FIT_SPACE: dict[str, tuple[float, float]] = {
    "mem_efficiency": (0.5, 0.95),
    "kv_read_efficiency": (0.2, 1.0),
    "compute_efficiency": (0.2, 0.9),
    "attn_efficiency": (0.1, 0.8),
    "step_overhead_s": (0.3e-3, 5e-3),
    "seq_overhead_s": (0.5e-6, 40e-6),
    "stream_prompt_token_s": (1e-10, 5e-7),
    "request_overhead_s": (0.1e-3, 10e-3),
    "prompt_token_overhead_s": (1e-8, 2e-5),
    # Per layer of a mixed batch run as PIECEWISE CUDA graphs, attention launched between the
    # pieces. Bounded at 100 us since 2026-12-04 (it was 400 us): in vLLM's own traces no class of
    # mixed steps ran longer than its kernels' busy time by more than 80 us a layer (8B at 2,048
    # tokens: 2.6 ms over 32 layers; 8B, 14B and 24B at 4,096-8,192 tokens: 30-58 us), and the
    # profiler only lengthens those gaps. A fit with the old bound put 214 us here (loss 0.1806
    # against 0.1821 at 106 us) and ran the held-out Poisson loads' TPOT 9-14% slow.
    "piecewise_layer_s": (5e-6, 100e-6),
    # Per layer of a batch above the largest capture size, run compiled without CUDA graphs: what
    # launching Inductor's ~10-15 kernels a layer adds beyond the GPU work they overlap. 100 us is
    # already 10 us a kernel, none of it hidden; the fit on every run puts it at 21 us. (The bound
    # was 800 us until 2026-12-02, when the 8B fold, fitted on 0.85B + 14B runs with no 2048-token
    # budget at 14B, put 668 us here and ran every 8B prefill step ~21 ms slow: a free fixed cost
    # per layer and step that the 14B windows alone could not tell from GEMM efficiency. The bound
    # was set after seeing that fold's miss; it comes from launch costs, not from the 8B runs.)
    "compiled_layer_overhead_s": (5e-6, 100e-6),
    "eager_layer_overhead_s": (50e-6, 1500e-6),
    # Searched since 2026-12-03 (before, fixed at 0 and 0.9): the decode path's fixed cost per step.
    # The real 8B/14B closed-loop decode windows of three hosts ran 9-17% below the simulator at 32-64
    # in flight and level with it at 128: a cost per step that grows with the layers (kernel ramps in
    # a FULL graph replay), and the engine CPU that async scheduling does not hide.
    "full_graph_layer_s": (0.5e-6, 100e-6),
    "async_overlap": (0.5, 0.98),
}


def api_token_cpu_s(runs: Iterable[RealRun]) -> float:
    """vLLM's API server CPU per streamed token, read off the windows' own /metrics.

    ``process_cpu_seconds_total`` is the API server process's CPU (the engine core is another
    process); over each window it is least-squares fitted as ``a * generated tokens + b * window
    seconds`` and ``a`` is returned: what ``token_overhead_s`` charges per token. Measured, not
    fitted to throughput: a size whose windows never saturate the front end (8B/14B prefill-heavy
    loads leave it 30-60% busy) cannot tell the throughput fit what it costs, and the 0.85B model,
    whose windows all ran it 90-97% busy, would otherwise push the cost into GPU-side knobs.
    """
    rows, cpu = [], []
    for run in runs:
        if run.window_dir is None or not run.output_throughput:
            continue
        generated = _counter_delta(run.window_dir, "vllm:generation_tokens_total")
        rows.append((generated, generated / run.output_throughput))
        cpu.append(_counter_delta(run.window_dir, "process_cpu_seconds_total"))
    # Normal equations of the two-column least squares (no numpy needed here).
    sgg = sum(g * g for g, _ in rows)
    sgd = sum(g * d for g, d in rows)
    sdd = sum(d * d for _, d in rows)
    sgc = sum(g * c for (g, _), c in zip(rows, cpu))
    sdc = sum(d * c for (_, d), c in zip(rows, cpu))
    det = sgg * sdd - sgd * sgd
    if len(rows) < 2 or det <= 0:
        raise ValueError("api_token_cpu_s needs two windows with /metrics of different shapes")
    return (sgc * sdd - sdc * sgd) / det


#: Knobs measured on the fitting runs instead of searched (name -> how).
MEASURED: dict[str, Callable[[list[RealRun]], float]] = {"token_overhead_s": api_token_cpu_s}


#: Requests per window simulated inside the fit (reports simulate every request).
FIT_MAX_REQUESTS = 192


def _loss(rows: list[FidelityRow]) -> float:
    # Throughput matters most (the tuning objective); latencies keep the shape honest. Each model
    # size weighs the same, so the many 8B windows do not decide the 0.85B constants.
    return _weighted_loss(rows, ttft_weight=0.5)


def _weighted_loss(rows: list[FidelityRow], ttft_weight: float) -> float:
    by_size: dict[str, list[FidelityRow]] = {}
    for r in rows:
        by_size.setdefault(r.real.size, []).append(r)
    total = 0.0
    for group in by_size.values():
        t = sum(math.log(r.sim_output_throughput / r.real.output_throughput) ** 2 for r in group)
        f = sum(math.log(r.sim_ttft_mean_ms / r.real.ttft_mean_ms) ** 2 for r in group) if ttft_weight else 0.0
        p = sum(math.log(r.sim_tpot_mean_ms / r.real.tpot_mean_ms) ** 2 for r in group)
        total += (4 * t + ttft_weight * f + p) / len(group)
    return total


def fit_alone(knob: str, runs: list[RealRun], bounds: tuple[float, float],
              host_factors: Mapping[str, float] | None = None, calibration: Mapping[str, float] | None = None,
              tolerance: float = 1e-3, gpu: str = GPU) -> float:
    """One knob fitted alone: the value in ``bounds`` that minimises the fit's loss on ``runs``
    (each host's runs at ``host_factors``, simulated on ``gpu``) with every other knob at
    ``calibration`` (default: the committed one), by golden-section search. The loss is the fit's without its TTFT term: a knob
    fitted alone sets a rate or a floor, and the TTFT misses (the simulator's closed-loop first
    tokens come early, whatever the knob) made the full loss multimodal (``fp8_kv_read_efficiency``
    had local minima at 0.35 and 0.45 on the 2026-12-03a host's windows); throughput and TPOT alone are
    smooth and unimodal, which the search needs."""
    base = dict(calibration or {})

    def loss(value: float) -> float:
        rows = fidelity_rows({**base, knob: value}, runs, host_factors=host_factors, gpu=gpu)
        return _weighted_loss(rows, ttft_weight=0.0)

    return golden_section(loss, bounds[0], bounds[1], tolerance, ties_go_low=False)


def golden_section(loss: Callable[[float], float], lo: float, hi: float, tolerance: float, *,
                   ties_go_low: bool = True) -> float:
    """The minimum of a one-dimensional ``loss`` on [lo, hi] (unimodal assumed), to an interval of
    ``tolerance``; on equal losses the search keeps the lower part (``ties_go_low``) or the upper
    one. The one search every fit here runs (``fit_alone``; ``published_runs.golden_section``).

    Example:
        >>> round(golden_section(lambda x: (x - 0.3) ** 2, 0.0, 1.0, 1e-4), 3)
        0.3
    """
    golden = (math.sqrt(5) - 1) / 2
    a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
    fa, fb = loss(a), loss(b)
    while hi - lo > tolerance:
        if fa <= fb if ties_go_low else fa < fb:
            hi, b, fb = b, a, fa
            a = hi - golden * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + golden * (hi - lo)
            fb = loss(b)
    return (lo + hi) / 2


def fit_fp8_kv_read(runs: list[RealRun] | None = None, host_factors: Mapping[str, float] | None = None,
                    calibration: Mapping[str, float] | None = None, bounds: tuple[float, float] = (0.1, 0.9),
                    tolerance: float = 1e-3) -> float:
    """``fp8_kv_read_efficiency`` fitted alone (:func:`fit_alone`) on ``runs``, by default the
    :data:`FP8_FIT_STARTS`' windows, each at its host's factor read by :func:`host_factor`."""
    if runs is None:
        by_name = {r.name: r for r in load_unseen_runs()}
        runs = [r for name, r in by_name.items() if _in_fp8_fit(name)]
        host_factors = {h: host_factor(h, by_name) for h in {host_of(r.name) for r in runs} if h is not None}
    return fit_alone("fp8_kv_read_efficiency", runs, bounds, host_factors, calibration, tolerance)


def fit_eager_floor(calibration: Mapping[str, float] | None = None,
                    bounds: tuple[float, float] = (100e-6, 1000e-6), tolerance: float = 1e-6) -> float:
    """``eager_layer_overhead_s`` fitted alone (:func:`fit_alone`) on the calibration's fitting
    windows that ran ``enforce_eager`` (:func:`load_calibration_runs`: the 0.85B ``b1_eager_s64``
    and the 14B ``scale/q14b_fv_u09_s128_eager``, both at factor 1), under the eager rule of
    2026-12-04 (``servetune.sim.perf``: attention does not cover the launches, no engine CPU
    hides, the floor scales with the host's CPU factor). The eager windows of the held-out hosts
    judge it (``sim_fidelity.py --unseen``)."""
    runs = [r for r in load_calibration_runs() if r.flags.get("enforce_eager")]
    return fit_alone("eager_layer_overhead_s", runs, bounds, calibration_host_factors(), calibration, tolerance)


#: The API server loop's shape searched by :func:`fit_frontend`: ``api_chunk_share`` x
#: ``api_intake_passes`` x ``client_chunk_s`` (the load generator's read of one chunk).
FRONTEND_GRID: tuple[tuple[float, int, float], ...] = tuple(
    (share, passes, client) for share in (0.2, 0.35, 0.5, 0.65) for passes in (5, 6, 7)
    for client in (0.0, 40e-6, 60e-6, 80e-6))


def frontend_loss(rows: list[FidelityRow]) -> float:
    """Mean over the windows of |throughput| + |TPOT| + |TTFT| relative error: the loop's shape
    moves first tokens most, and throughput and TPOT keep it from buying them with the rest."""
    return sum(abs(r.throughput_error) + abs(r.tpot_error) + abs(r.ttft_error) for r in rows) / len(rows)


def fit_frontend(grid: Iterable[tuple[float, int, float]] = FRONTEND_GRID,
                 calibration: Mapping[str, float] | None = None,
                 ) -> tuple[tuple[float, int, float], dict[tuple[float, int, float], float]]:
    """``api_chunk_share``, ``api_intake_passes`` and ``client_chunk_s`` (``servetune.sim.frontend``)
    chosen on a grid: the triple whose :func:`frontend_loss` is least over the calibration's fitting
    windows (:func:`load_evidence` at factor 1 and every window of the fitted hosts of
    :data:`UNSEEN_HOSTS` but their calibrating ones, each host at the factor read under that triple:
    the loop's shape changes the simulated CPU a factor is read against), every other knob at
    ``calibration`` (default: committed). Returns the triple and every triple's loss."""
    by_name = {r.name: r for r in load_unseen_runs()}
    hosts = [h for h in UNSEEN_HOSTS if h not in HELD_OUT_HOSTS]
    host_runs = [r for name, r in sorted(by_name.items())
                 if host_of(name) in hosts and name != UNSEEN_HOSTS[host_of(name)][0]]  # type: ignore[index]
    evidence = load_evidence()
    losses: dict[tuple[float, int, float], float] = {}
    for share, passes, client in grid:
        knobs = {**(calibration or {}), "api_chunk_share": share, "api_intake_passes": passes,
                 "client_chunk_s": client}
        factors = {host: host_factor(host, by_name, knobs) for host in hosts}
        losses[(share, passes, client)] = frontend_loss(fidelity_rows(knobs, evidence + host_runs,
                                                                      host_factors=factors))
    return min(losses, key=losses.__getitem__), losses


#: The frontend triples a recorded fold chooses among on its own training windows when it is
#: replayed under an engine whose API-server model it was not fitted with (:func:`replay_fold`).
FOLD_FRONTEND_GRID: tuple[tuple[float, int, float], ...] = tuple(
    (share, passes, client) for share in (0.2, 0.5) for passes in (1, 6) for client in (0.0, 60e-6))


def replay_fold(knobs: Mapping[str, float], train: list[RealRun], test: list[RealRun],
                grid: Iterable[tuple[float, int, float]] = FOLD_FRONTEND_GRID,
                ) -> tuple[dict[str, float], list[FidelityRow]]:
    """A recorded fold's knobs with the API-server loop's triple (``api_chunk_share``,
    ``api_intake_passes``, ``client_chunk_s``) chosen on the fold's ``train`` windows alone
    (least :func:`frontend_loss` over ``grid``), then ``test`` simulated with them: the fold stays
    held out although the committed triple was chosen on every fitting window, its test ones too.
    Returns the knobs and the test rows."""
    best: tuple[float, dict[str, float]] | None = None
    for share, passes, client in grid:
        candidate = {**knobs, "api_chunk_share": share, "api_intake_passes": float(passes), "client_chunk_s": client}
        loss = frontend_loss(fidelity_rows(candidate, train))
        if best is None or loss < best[0]:
            best = (loss, candidate)
    assert best is not None, "an empty grid"
    return best[1], fidelity_rows(best[1], test)


#: Where a held-out fold's search starts: datasheet-like efficiencies (HBM 80%, paged attention 70%,
#: GEMM 70%, prefill attention 50%) and the geometric middle of each time constant's range. Never
#: a fitted calibration: GPU_CALIBRATION is fitted on every run, the fold's test runs included,
#: and a search that starts there can return it (it did, once: the 8B fold of 2026-12-02).
NEUTRAL_START: dict[str, float] = {
    **{k: math.sqrt(lo * hi) for k, (lo, hi) in FIT_SPACE.items() if k.endswith("_s")},
    "mem_efficiency": 0.8, "kv_read_efficiency": 0.7, "compute_efficiency": 0.7, "attn_efficiency": 0.5,
    "async_overlap": 0.9,  # vLLM's design: async scheduling hides most of the engine CPU
}


def fit(trials: int, seed: int = 0, runs: list[RealRun] | None = None,
        starts: list[Mapping[str, float]] | None = None, from_committed: bool = True,
        host_factors: Mapping[str, float] | None = None,
        callbacks: Sequence[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]] = (),
        fixed: Mapping[str, float] | None = None) -> dict[str, float]:
    """Optuna TPE over FIT_SPACE minimising the loss over ``runs``; returns the best knobs.

    The search starts from the committed H200 calibration (``from_committed``, for refitting it)
    or from :data:`NEUTRAL_START` (held-out folds), then ``starts``. ``host_factors``: each host's
    runs simulated at its API-server CPU factor (:func:`fidelity_rows`), so that a fit over
    several hosts does not fold one host's slower CPU into the shared knobs. ``fixed``: knobs
    measured elsewhere (``_kernels.kernel_knobs``: the GPU kernels' own times), held at their
    values and left out of the search.
    """
    fixed = dict(fixed or {})
    space = {k: bounds for k, bounds in FIT_SPACE.items() if k not in fixed}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    runs = runs if runs is not None else load_evidence()
    # The measured API-server costs are read off the runs simulated at the calibration's own host
    # factor (1): a factored host's CPU is in its factor, and counting it here too would charge it twice.
    at_factor_one = [r for r in runs if host_of(r.name) not in (host_factors or {})]
    measured = {name: how(at_factor_one) for name, how in MEASURED.items()}

    def objective(trial: optuna.Trial) -> float:
        knobs = {k: trial.suggest_float(k, lo, hi, log=k.endswith("_s")) for k, (lo, hi) in space.items()}
        rows = fidelity_rows({**knobs, **fixed, **measured}, runs, max_requests=FIT_MAX_REQUESTS,
                             host_factors=host_factors)
        if any(not math.isfinite(r.sim_ttft_mean_ms) or r.sim_output_throughput <= 0 for r in rows):
            return float("inf")
        return _loss(rows)

    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed, multivariate=True))
    first = dataclasses.asdict(calibration_for(get_gpu(GPU))) if from_committed else NEUTRAL_START
    for start in (first, *(starts or ())):
        study.enqueue_trial({k: min(max(float(start[k]), lo), hi) for k, (lo, hi) in space.items() if k in start})
    study.optimize(objective, n_trials=trials, callbacks=list(callbacks))
    return {**study.best_params, **fixed, **measured}


#: Held-out folds: name -> the rule that picks the test runs (the rest is the fitting set).
FOLDS: dict[str, Callable[[RealRun], bool]] = {
    "size 0.85B": lambda r: r.size == "0.85B",
    "size 8B": lambda r: r.size == "8B",
    "size 14B": lambda r: r.size == "14B",
    "flags eager/fp8/token budget": lambda r: bool(r.tags & {"eager", "fp8_kv", "small_token_budget",
                                                             "large_token_budget"}),
}


def held_out(trials: int, seed: int = 0, runs: list[RealRun] | None = None,
             folds: Mapping[str, Callable[[RealRun], bool]] = FOLDS,
             starts: list[Mapping[str, float]] | None = None) -> dict[str, tuple[dict[str, float], list[FidelityRow]]]:
    """For each fold: fit on the runs it leaves in, simulate the runs it holds out with that fit."""
    runs = runs if runs is not None else load_evidence()
    out = {}
    for name, is_test in folds.items():
        train = [r for r in runs if not is_test(r)]
        test = [r for r in runs if is_test(r)]
        knobs = fit(trials, seed, train, starts, from_committed=False)
        out[name] = (knobs, fidelity_rows(knobs, test))
    return out
