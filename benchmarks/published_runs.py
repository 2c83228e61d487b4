"""The simulator on real vLLM benchmark runs that people published: held-out error by GPU, layout and load.

Fixtures: ``tests/fixtures/published_runs/*.yaml``, each a list of runs. One run is one published
``vllm bench serve`` / ``benchmark_serving.py`` (or other client) result with its full configuration::

    - id: h100-llama3.1-8b-tp1-rand1024x128-c64   # descriptive: gpu, model, layout, load
      source: https://github.com/vllm-project/vllm/issues/NNNN#issuecomment-MMMM (2025-06-01)
      vllm_version: "0.11.0"         # as stated (a bound, e.g. "released before 0.12", goes in `assumed`)
      sim_vllm_version: "0.11.0"     # only where the stated version predates 0.11 (the simulator's oldest step rules; the KV pool is planned at the stated version from 0.10.0)
      gpu: H100-80GB                 # a name of servetune's GPU table (planner/gpus.py), exact
      num_gpus: 1                    # tp x pp x dp
      model: llama-3.1-8b            # a shipped model, or a folder under models/ beside the fixture
                                     # (or tests/fixtures/published_logs/models/) holding config.json
      dtype: bfloat16                # optional
      quantization: null             # optional (awq, gptq, fp8, ...)
      layout: {tp: 1, pp: 1, dp: 1, ep: 1}
      interconnect: pcie-no-p2p      # optional: how the GPUs reach each other where the source shows it
                                     # (nvlink | pcie | pcie-no-p2p; default: the part's usual host)
      flags: {max_num_seqs: 256}     # every non-default vLLM flag stated (servetune's flag names)
      other_flags: [--disable-log-stats]   # stated flags that change nothing simulated (optional)
      workload: {dataset: random, input_len: 1024, output_len: 128, num_prompts: 1000,
                 request_rate: inf, max_concurrency: 64, range_ratio: 0.0,
                 prefix_cache_hit_rate: 0.43}   # optional: see below
      client: {tool: vllm bench serve, endpoint: /v1/completions,
               seed: 42, special_tokens: 0}   # optional: a stated --seed (random dataset: with the tokenizer's
                                              # num_special_tokens_to_add()); the requests it drew are replayed
                                              # an endpoint of /v1/chat/completions: chat requests
                                              # (Workload.chat: vLLM 0.11.0 parses the template each);
                                              # template_tokens: the tokens its chat template adds to
                                              # each prompt (template_tokens(); stated where counted)
                                              # sampling: greedy | default (required for vllm bench serve
                                              # from 0.15.0, which sends no temperature unless told);
                                              # default: generation_config: {temperature: 0.7, top_k: 20,
                                              # top_p: 0.8, repetition_penalty: 1.1}, the model's, which
                                              # the server applied (Workload.sampling, sim.sampling)
                                              # output_rate: duration (default) | token_span (guidellm:
                                              # judged on measured.generated_tokens / duration_s;
                                              # OUTPUT_RATES)
      measured: {output_throughput: 9876.5, request_throughput: 12.3,
                 ttft_ms: {mean: 1, median: 1, p99: 1}, tpot_ms: {mean: 1, median: 1, p99: 1},
                 itl_ms: {mean: 1, median: 1, p99: 1}}
      assumed: ["what was not stated and what was taken for it"]   # optional
      split: held_out                # fit | held_out, by the rule below (the loader checks it)
      raw: |                         # the verbatim published excerpt (short), or raw_file: a file beside
        ...

The load shape: ``request_rate`` ``inf`` (or absent) is a closed loop at ``max_concurrency`` (a
burst of every prompt when there is none); a finite rate is an open (Poisson) loop, unless
``loop: closed`` says the run's ``max_concurrency`` bound it (requests arrived faster than that
many finished). The headline
``prefix_cache_hit_rate`` is for a run that re-sent prompts the server had already seen (one server,
one seed, a sweep of runs): the "Prefix cache hit rate" the server logged during the run (vLLM's
rate over its most recent 1000 requests), as a fraction. That share of each prompt is simulated as
cached from the earlier run (``Workload.cached_fraction``), never fitted; the rate the simulated
server logs, counted as the run's vLLM version counts (resumed requests' lookups up to 0.11.0, a
blocked request's at every retry up to 0.26.0), is reported beside it (``hit_rate_sim``).
``after_input_len`` is for a ``vllm bench serve`` random-dataset run that the same server got right
after the same client's run of ``after_input_len``-token prompts with the same seed (a sweep of
prompt lengths, one server start): the dataset gives prompt i the tokens ``(offset_i + i + j) %
vocab`` with offsets drawn from the seed's own generator after the lengths (which draw nothing at
``range_ratio`` 0), so each prompt begins with the earlier run's prompt i, and that prefix is
simulated as cached (:func:`bench_serve_requests`; under DP an expected 1 / dp of the prompts find
theirs: the balancer sends each request where the burst's arrival order puts it). Such a run also
starts with the fused-MoE kernel variants its server compiled on first use in the runs before it
(``servetune.sim.moe_jit``: the server's Triton cache is carried from run to run, replayed in the
file's order; a run without ``after_input_len`` starts a server). ``resent_prompts`` (with
``resent_len`` where the earlier prompts were shorter) is for a random-dataset burst whose server's
earlier runs of the same seed its log lines show: its first that many prompts were held whole (the
client's test request holds prompt 0 in every run) and are simulated so, the rest new, in place of
the logged rate spread over every prompt (:func:`resent_requests`; in a seeded ``vllm bench serve`` replay, its
leading prompts: :func:`bench_serve_requests`). The headline
figure is the output throughput for a closed loop and the mean TPOT (the median where no mean was
published) for an open one; TTFT is judged too. A ``vllm bench serve`` run of the random dataset that
states its ``seed`` is simulated with the very requests that seed drew, their lengths and, at a
finite rate, their arrival times (:func:`bench_serve_requests`); a ``dataset: sharegpt`` run with ShareGPT's
own per-request lengths as vLLM's benchmark samples them, rescaled to its stated means (:func:`sharegpt_requests`);
other runs draw servetune's own. DP replicas are simulated as ``dp`` independent
engines, each with its share of the prompts and of the load, their throughputs added; a MoE model's
routed experts are priced as vLLM runs them under DP (:func:`engine_config`: split over ``tp x dp``
GPUs, each MoE layer running every replica's tokens).

The split rule (:func:`split_of`): within one fixture file and one GPU, runs are grouped into
sweeps (same source page and model: one publisher's runs of one model share a host, a client
and usually a server start, so they fit or judge together and a held-out run never has a
near-twin in the fit half); sweeps are taken in the order of the SHA-256 of their key into the
fit half while the fit half stays within half the GPU's runs (rounded down); every other run is
held out.
At most half of every GPU's runs are fit, a GPU with one run has it held out, and adding a run can
move others: the loader checks every run's ``split`` against the rule and names the ones to change.

    .venv/bin/python benchmarks/published_runs.py                 # as committed, held out and fit apart
    .venv/bin/python benchmarks/published_runs.py --before        # before the fits on published runs
    .venv/bin/python benchmarks/published_runs.py --breakdown a100-qwen2-7b-tp2-u025-rand1024x1024-burst1
    .venv/bin/python benchmarks/published_runs.py --file tests/fixtures/published_runs/dense.yaml \
        --fit A100-80GB kv_read_efficiency 0.4 0.8984    # then attn_efficiency 0.2681 0.73 under it
    .venv/bin/python benchmarks/published_runs.py --file tests/fixtures/published_runs/dense.yaml \
        --compare --json > benchmarks/results/published_runs_heldout_pcie_card.json   # the recorded results
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import re
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "platform", ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from servetune.errors import SpecError  # noqa: E402
from servetune.planner.comm import VLLM_DEFAULT_ENV  # noqa: E402
from servetune.planner.engine_config import EngineConfig  # noqa: E402
from servetune.planner.gpus import get_gpu, with_interconnect  # noqa: E402
from servetune.planner.memory import plan_memory  # noqa: E402
from servetune.planner.modelinfo import ModelProfile, load_model  # noqa: E402
from servetune.planner.target import resolve_target  # noqa: E402
from servetune.planner.vllm_rules import parse_vllm_version  # noqa: E402
from servetune.sim import (FA2_KNOBS, GPU_CALIBRATION, Calibration, PerfModel, runs_flash_attention_2,  # noqa: E402
                           simulate, with_calibration)
from servetune.sim.moe_jit import TritonCache  # noqa: E402
from servetune.workload import GREEDY, RequestSpec, Sampling, Workload  # noqa: E402

import _fidelity  # noqa: E402

__all__ = ["FIXTURES", "PublishedRun", "Judged", "ReplayedLoad", "load_runs", "split_of", "sweep_key", "workload_of",
           "bench_serve_lengths", "bench_serve_arrivals", "bench_serve_requests", "template_tokens",
           "SHAREGPT_LENGTHS", "sharegpt_rows",
           "rescaled", "sharegpt_lengths", "sharegpt_requests", "step_breakdown", "engine_config", "judge",
           "judge_all", "cells", "rankings", "ratio_spread", "format_cells", "format_comparison", "FITTED_HERE", "h200_knobs_for", "fit_loss", "golden_section", "fit_knob", "main"]

FIXTURES = ROOT / "tests" / "fixtures" / "published_runs"
#: ShareGPT's per-request lengths as ``vllm bench serve`` samples them (:func:`sharegpt_rows`).
SHAREGPT_LENGTHS = FIXTURES / "sharegpt_lengths.json"
#: Model configs people published beside startup logs (their sources in that folder's SOURCES.md).
LOG_MODELS = ROOT / "tests" / "fixtures" / "published_logs" / "models"
REQUIRED = ("id", "source", "vllm_version", "gpu", "num_gpus", "model", "layout", "flags", "workload", "client",
            "measured", "split")
OPTIONAL = ("dtype", "quantization", "assumed", "raw", "raw_file", "notes", "sim_vllm_version", "other_flags",
            "interconnect", "flashinfer")
LAYOUT_KEYS = ("tp", "pp", "dp", "ep")
WORKLOAD_KEYS = ("dataset", "input_len", "output_len", "num_prompts", "request_rate", "max_concurrency",
                 "range_ratio", "prefix_len", "num_prefix_groups", "loop", "prefix_cache_hit_rate", "after_input_len",
                 "resent_prompts", "resent_len")
MEASURED_KEYS = ("output_throughput", "request_throughput", "total_token_throughput", "ttft_ms", "tpot_ms",
                 "itl_ms", "e2el_ms", "duration_s", "completed", "generated_tokens")
#: What a client's published "Output token throughput" divides (``client.output_rate``). ``duration``
#: (the default; ``vllm bench serve``): generated tokens / benchmark duration, as the simulator reports it.
#: ``token_span``: guidellm's ``output_tokens_per_second``, the duration-weighted mean of rates between
#: successive token timestamps of the successful requests with no window passed, i.e. their tokens over
#: the first to the last token timestamp (guidellm 0.5.3, ``benchmark/schemas/generative/metrics.py`` lines
#: 886-891 against ``requests_per_second``'s measure window at 804-811; ``schemas/statistics.py`` lines
#: 313-388; a response with one token iteration is one stamp at its end, ``schemas/request_stats.py``
#: lines 290-310; the same code at 0.7.1), while its "Benchmark duration" is the measure window, first
#: request sent to last finished (``benchmark.py`` lines 88-94, ``accumulator.py`` lines 185 and 211: GPUStack
#: passes no --warmup / --cooldown, ``gpustack/worker/benchmark/runner.py`` ``_build_command_args`` at
#: gpustack 6ceec5b). GPUStack's pages print both (``hack/perf/perf_doc_common.py``
#: ``render_benchmark_result_block`` at 6ceec5b, lines 247-291), so such a run is judged on its printed
#: ``generated_tokens`` / ``duration_s``, the simulator's own definition. Read after seeing the errors.
OUTPUT_RATES = ("duration", "token_span")
STAT_KEYS = ("mean", "median", "p90", "p99", "std")
_STATED_VERSION = re.compile(r"v?\d+\.\d+(\.\d+){0,2}((rc|\.post|\.dev)\d+)?")


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One published benchmark run, validated (see the module docstring for the fields)."""

    id: str
    file: str
    source: str
    vllm_version: str
    gpu: str
    num_gpus: int
    model: str
    layout: Mapping[str, int]
    flags: Mapping[str, Any]
    workload: Mapping[str, Any]
    client: Mapping[str, Any]
    measured: Mapping[str, Any]
    split: str
    assumed: tuple[str, ...] = ()
    quantization: str | None = None
    #: The vLLM version simulated: ``vllm_version``, or ``sim_vllm_version`` where that predates 0.11.
    sim_vllm_version: str = ""
    #: The vLLM version whose startup memory the planner applies (the KV pool, a refused start): the
    #: stated one wherever the planner accepts it (0.10.0 on), else ``sim_vllm_version``.
    plan_vllm_version: str = ""
    #: The host's interconnect where the source shows it (servetune.planner.gpus.INTERCONNECTS), else "".
    interconnect: str = ""
    #: Whether FlashInfer imports in the server's install (``EngineConfig.flashinfer_available``), where the
    #: publisher's image is known (the fixture's ``flashinfer: {available: ..., source: ...}``); None: not stated.
    flashinfer: bool | None = None

    @property
    def closed_loop(self) -> bool:
        return _closed(self.workload)

    @property
    def shape(self) -> str:
        """``closed`` or ``open``, then ``prefill`` (prompts at least as long as outputs) or ``decode``."""
        heavy = "prefill" if self.workload["input_len"] >= self.workload["output_len"] else "decode"
        return f"{'closed' if self.closed_loop else 'open'} {heavy}"

    @property
    def chat(self) -> bool:
        """Whether the client sent chat requests (its ``endpoint`` is ``/v1/chat/completions``)."""
        return str(self.client.get("endpoint", "")).rstrip("/").endswith("/chat/completions")

    @property
    def sampling(self) -> Sampling:
        """What the run's requests sampled with: greedy, or (``client.sampling: default``) the model's
        ``generation_config.json`` the server applied (``client.generation_config``), less what the
        client sent itself: ``vllm bench serve``'s completions requests carry ``repetition_penalty`` 1.0
        (:data:`BENCH_SERVE_COMPLETIONS_SENDS`), which overrides the model's default."""
        if self.client.get("sampling", "greedy") == "greedy":
            return GREEDY
        sampling = Sampling.from_dict(self.client["generation_config"], f"{self.id}: client.generation_config")
        if self.client.get("tool") == "vllm bench serve" and not self.chat:
            sampling = dataclasses.replace(sampling, **BENCH_SERVE_COMPLETIONS_SENDS)
        return sampling

    @property
    def layout_label(self) -> str:
        """``TP2 PP2`` and, where a TP group's host link was stated, the link (``TP2 pcie-no-p2p``)."""
        label = " ".join(f"{k.upper()}{self.layout[k]}" for k in LAYOUT_KEYS if k == "tp" or self.layout[k] > 1)
        return f"{label} {self.interconnect}" if self.interconnect and self.layout["tp"] > 1 else label

    def stat(self, name: str) -> float | None:
        """The published mean of ``ttft_ms`` / ``tpot_ms`` / ``itl_ms``, else its median; None if neither."""
        figure = self.measured.get(name)
        if not isinstance(figure, Mapping):
            return None
        value = figure.get("mean", figure.get("median"))
        return None if value is None else float(value)

    @property
    def output_rate(self) -> float:
        """The published output tok/s as the simulator defines it (generated tokens / duration): the
        printed figure, or for a ``client.output_rate: token_span`` client (:data:`OUTPUT_RATES`) the
        page's generated tokens over its duration."""
        if self.client.get("output_rate") == "token_span":
            return float(self.measured["generated_tokens"]) / float(self.measured["duration_s"])
        return float(self.measured["output_throughput"])

    @property
    def headline(self) -> tuple[str, float]:
        """The figure a run is judged on: closed-loop output tok/s (:attr:`output_rate`), open-loop TPOT ms."""
        if self.closed_loop:
            return "output_throughput", self.output_rate
        value = self.stat("tpot_ms")
        assert value is not None  # the loader requires it
        return "tpot_ms", value


def _fail(where: str, field: str, message: str, fix: str) -> SpecError:
    return SpecError(f"{where}: {field}", message, fix)


def _positive_int(where: str, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(where, field, f"expected a whole number >= 1, got {value!r}", "write e.g. 1")
    return value


def _rate(where: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "inf":
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value:
        raise _fail(where, "workload.request_rate", f"expected a positive number or inf, got {value!r}",
                    "write the published --request-rate, e.g. 4 or inf")
    return float(value)


def _closed(w: Mapping[str, Any]) -> bool:
    """A closed loop: no finite request rate, or ``loop: closed`` (a finite rate the concurrency cap
    binds: requests arrive faster than ``max_concurrency`` of them finish)."""
    if w.get("loop") is not None:
        return bool(w["loop"] == "closed")
    rate = w.get("request_rate")
    return rate is None or math.isinf(rate)


def _workload(where: str, w: Any) -> dict[str, Any]:
    if not isinstance(w, Mapping):
        raise _fail(where, "workload", "expected a mapping", "write input_len, output_len, num_prompts, ...")
    unknown = sorted(set(map(str, w)) - set(WORKLOAD_KEYS))
    if unknown:
        raise _fail(where, f"workload.{unknown[0]}", "unknown key", f"use: {', '.join(WORKLOAD_KEYS)}")
    out = dict(w)
    for key in ("input_len", "output_len", "num_prompts"):
        out[key] = _positive_int(where, f"workload.{key}", w.get(key))
    out["request_rate"] = _rate(where, w.get("request_rate"))
    if w.get("max_concurrency") is not None:
        out["max_concurrency"] = _positive_int(where, "workload.max_concurrency", w["max_concurrency"])
    ratio = w.get("range_ratio", 0.0)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise _fail(where, "workload.range_ratio", f"expected a number in [0, 1), got {ratio!r}", "write e.g. 0.0")
    out["range_ratio"] = float(ratio)
    hit = w.get("prefix_cache_hit_rate")
    if hit is not None and (isinstance(hit, bool) or not isinstance(hit, (int, float)) or not 0 <= hit < 1
                            or w.get("prefix_len")):
        raise _fail(where, "workload.prefix_cache_hit_rate", f"expected a fraction in [0, 1), got {hit!r}",
                    "write the logged 'Prefix cache hit rate' as a fraction, e.g. 0.43 (not with prefix_len)")
    after = w.get("after_input_len")
    if after is not None and (isinstance(after, bool) or not isinstance(after, int) or not 0 < after < out["input_len"]
                              or out["range_ratio"] or hit is not None or w.get("prefix_len")):
        raise _fail(where, "workload.after_input_len", f"expected a prompt length below input_len, got {after!r}",
                    "write the earlier run's --random-input-len (only at range_ratio 0, without a hit rate or prefix)")
    _resent_keys(where, w, out)
    if w.get("loop") is not None and (w["loop"] not in ("closed", "open") or out["request_rate"] is None
                                      or math.isinf(out["request_rate"]) or w.get("max_concurrency") is None):
        raise _fail(where, "workload.loop", f"got {w['loop']!r}",
                    "only with a finite request_rate and a max_concurrency: closed (the cap binds) or open")
    return out


def _resent_keys(where: str, w: Mapping[str, Any], out: Mapping[str, Any]) -> None:
    """Check ``resent_prompts`` (a count from 1 to ``num_prompts``) and ``resent_len`` (a prompt length up
    to ``input_len``, only with ``resent_prompts``): the re-sent leading prompts of :func:`resent_requests`."""
    k, length = w.get("resent_prompts"), w.get("resent_len")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= out["num_prompts"]
                          or out["range_ratio"] or w.get("prefix_len") or w.get("after_input_len")):
        raise _fail(where, "workload.resent_prompts", f"expected a count in [1, num_prompts], got {k!r}",
                    "write how many leading prompts the server held (the warm-up's prompt 0 counts; range_ratio 0)")
    if length is not None and (k is None or isinstance(length, bool) or not isinstance(length, int)
                               or not 0 < length <= out["input_len"]):
        raise _fail(where, "workload.resent_len", f"expected a prompt length up to input_len, got {length!r}",
                    "write the earlier run's --random-input-len, with resent_prompts")


def _measured(where: str, m: Any, closed: bool) -> dict[str, Any]:
    if not isinstance(m, Mapping):
        raise _fail(where, "measured", "expected a mapping", "write output_throughput, ttft_ms, tpot_ms, ...")
    unknown = sorted(set(map(str, m)) - set(MEASURED_KEYS))
    if unknown:
        raise _fail(where, f"measured.{unknown[0]}", "unknown key", f"use: {', '.join(MEASURED_KEYS)}")
    for key, value in m.items():
        if key.endswith("_ms"):
            if not isinstance(value, Mapping) or not value or set(map(str, value)) - set(STAT_KEYS) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in value.values()):
                raise _fail(where, f"measured.{key}", f"expected {{mean/median/p90/p99/std: ms}}, got {value!r}",
                            "write e.g. {mean: 12.3, median: 11.9, p99: 30.1}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise _fail(where, f"measured.{key}", f"expected a positive number, got {value!r}",
                        "write the published figure")
    if closed and "output_throughput" not in m:
        raise _fail(where, "measured.output_throughput", "missing: a closed loop is judged on it",
                    "write the published 'Output token throughput (tok/s)'")
    if not closed and not (isinstance(m.get("tpot_ms"), Mapping) and ({"mean", "median"} & set(m["tpot_ms"]))):
        raise _fail(where, "measured.tpot_ms", "missing mean and median: an open loop is judged on TPOT",
                    "write the published 'Mean TPOT (ms)' as tpot_ms: {mean: ...}")
    return dict(m)


def _layout(where: str, layout: Any, num_gpus: int) -> dict[str, int]:
    if not isinstance(layout, Mapping) or set(map(str, layout)) - set(LAYOUT_KEYS):
        raise _fail(where, "layout", f"expected a mapping of {', '.join(LAYOUT_KEYS)}, got {layout!r}",
                    "write layout: {tp: 1, pp: 1, dp: 1, ep: 1}")
    out = {k: _positive_int(where, f"layout.{k}", layout.get(k, 1)) for k in LAYOUT_KEYS}
    if out["tp"] * out["pp"] * out["dp"] != num_gpus:
        raise _fail(where, "num_gpus", f"{num_gpus} is not tp x pp x dp = {out['tp'] * out['pp'] * out['dp']}",
                    "write the GPUs the run used and the layout that used them")
    return out


#: The oldest version whose step-time rules the simulator has (the planner's memory rules start at
#: 0.10.0, see :data:`servetune.planner.vllm_rules.MIN_VERSION`).
SIM_OLDEST_VERSION = (0, 11, 0)


def _sim_version(where: str, entry: Mapping[str, Any]) -> tuple[str, str]:
    """``(simulated, planned)``: the version a run is simulated at, its own or, where that predates
    the simulator's oldest step rules (0.11.0), the ``sim_vllm_version`` it names (and says so in
    ``assumed``); and the version its startup memory is planned at, its own. A run older than the planner's
    rules (0.10.0) is refused: vLLM's V0 engine (0.4-0.9 by default) is not what servetune models, so such a
    run would judge a server the product never plans."""
    stated = str(entry["vllm_version"])
    # Releases with a fourth part (0.10.1.1) are read by their first three.
    if not _STATED_VERSION.fullmatch(stated.strip()):
        raise _fail(where, "vllm_version", f"cannot read {stated!r} as a vLLM version", "write e.g. 0.11.0")
    three = ".".join(stated.strip().split(".")[:3])
    try:
        version = parse_vllm_version(three)
    except SpecError:  # older than the planner's rules (0.10.0): vLLM's V0 engine, which servetune does not model
        raise _fail(where, "vllm_version", f"{stated} predates the oldest version servetune plans (0.10.0), whose "
                    "engine the planner and the simulator model", "leave the run out") from None
    if version < SIM_OLDEST_VERSION:
        if "sim_vllm_version" not in entry:
            raise _fail(where, "vllm_version", f"{stated} predates the oldest version servetune simulates (0.11.0)",
                        "add sim_vllm_version: 0.11.0 and say so in assumed, or leave the run out") from None
        sim = str(entry["sim_vllm_version"])
        parse_vllm_version(sim)
        return sim, three
    if "sim_vllm_version" in entry:
        raise _fail(where, "sim_vllm_version", "only for a run whose vllm_version predates 0.11.0",
                    "remove it: the run is simulated at its own version")
    return stated, stated


def _client_seed(where: str, client: Mapping[str, Any], workload: Mapping[str, Any]) -> None:
    """A stated ``client.seed`` is a whole number, and for ``vllm bench serve``'s random dataset it
    comes with ``client.special_tokens`` (the tokenizer's ``num_special_tokens_to_add()``), which
    its drawn prompt lengths depend on (:func:`bench_serve_lengths`)."""
    seed = client.get("seed")
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise _fail(where, "client.seed", f"expected a whole number >= 0, got {seed!r}", "write the --seed the run used")
    special = client.get("special_tokens")
    if client["tool"] == "vllm bench serve" and workload.get("dataset") == "random" and (
            isinstance(special, bool) or not isinstance(special, int) or special < 0):
        raise _fail(where, "client.special_tokens", f"expected a whole number >= 0 beside a seed, got {special!r}",
                    "write the tokenizer's num_special_tokens_to_add(): 0 for Qwen's, 1 for Llama's (BOS)")


#: The first ``vllm bench serve`` that sends no ``temperature`` unless told (vLLM pull request 32723,
#: merged 2026-01-20; ``benchmarks/serve.py`` of the 0.15.0 wheel, where 0.14.1's still set 0.0).
BENCH_SERVE_UNSET_TEMPERATURE = (0, 15, 0)
#: The sampling fields ``vllm bench serve`` writes into every ``/v1/completions`` request itself
#: (``async_request_openai_completions``' payload: ``vllm/benchmarks/lib/endpoint_request_func.py``
#: line 163 of 0.15.1, 176 of 0.23.0, 180 of 0.28.0). A field the request sets is not taken from the
#: model's generation config (``CompletionRequest.to_sampling_params``: ``if (repetition_penalty :=
#: self.repetition_penalty) is None`` falls back to it, ``entrypoints/openai/completion/protocol.py``
#: lines 555-558 of 0.23.0), so those runs sampled without a repetition penalty. The chat request
#: sends none. Read after the L4 runs (0.23.0, Qwen2.5's 1.1) had been judged; it moved them away
#: from the real figures (docs/accuracy.md).
BENCH_SERVE_COMPLETIONS_SENDS: dict[str, float] = {"repetition_penalty": 1.0}


def _client_sampling(where: str, client: Mapping[str, Any], version: str) -> None:
    """``client.sampling`` is ``greedy`` or ``default`` (the server's: the model's generation config,
    given in ``client.generation_config``), and a ``vllm bench serve`` of 0.15.0 or later states it
    (from that release it sends no temperature unless told; which applies is a per-run judgement
    written in ``assumed``)."""
    mode = client.get("sampling")
    if mode is None:
        if client["tool"] == "vllm bench serve" and parse_vllm_version(version) >= BENCH_SERVE_UNSET_TEMPERATURE:
            raise _fail(where, "client.sampling", "missing: vllm bench serve from 0.15.0 sends no temperature unless told",
                        "write sampling: default (and generation_config) or greedy (a stated --temperature 0)")
        return
    if mode not in ("greedy", "default"):
        raise _fail(where, "client.sampling", f"expected greedy or default, got {mode!r}",
                    "greedy: temperature 0 sent; default: the model's generation_config.json")
    config = client.get("generation_config")
    if mode == "default" and not isinstance(config, Mapping):
        raise _fail(where, "client.generation_config", "missing beside sampling: default",
                    "write the model's generation_config.json values: {temperature: 0.7, top_k: 20, top_p: 0.8, ...}")
    if mode == "default":
        Sampling.from_dict(config, f"{where}: client.generation_config")


def _client_template(where: str, client: Mapping[str, Any]) -> None:
    """A stated ``client.template_tokens`` (:func:`template_tokens`) is a whole number, for a chat run only."""
    extra = client.get("template_tokens")
    if extra is None:
        return
    chat = str(client.get("endpoint", "")).rstrip("/").endswith("/chat/completions")
    if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0 or not chat:
        raise _fail(where, "client.template_tokens", f"expected a whole number >= 0 for a chat run, got {extra!r}",
                    "write the tokens the model's chat template adds around one user message (endpoint /v1/chat/completions)")


def _client_output_rate(where: str, client: Mapping[str, Any], measured: Mapping[str, Any]) -> None:
    """``client.output_rate`` is one of :data:`OUTPUT_RATES`; a guidellm client states it (its rate is
    not tokens / duration), and ``token_span`` comes with the printed ``generated_tokens`` and ``duration_s``."""
    rate = client.get("output_rate", "duration")
    if rate not in OUTPUT_RATES:
        raise _fail(where, "client.output_rate", f"expected one of {', '.join(OUTPUT_RATES)}, got {rate!r}",
                    "duration: tokens / benchmark duration; token_span: guidellm's first-to-last token stamp")
    if "guidellm" in str(client["tool"]) and "output_rate" not in client:
        raise _fail(where, "client.output_rate", "missing: guidellm's output tok/s is over its token stamps' span",
                    "write output_rate: token_span with measured.generated_tokens and duration_s")
    if rate == "token_span" and not {"generated_tokens", "duration_s"} <= set(measured):
        raise _fail(where, "measured.generated_tokens", "missing beside output_rate: token_span",
                    "write the page's 'Total generated tokens' and 'Benchmark duration (s)'")


def resolve_model(name: str, fixture_dir: Path = FIXTURES) -> ModelProfile:
    """A run's ``model``: servetune's shipped model of that name, else the config.json in
    ``models/<name>/`` beside the fixture file, else in :data:`LOG_MODELS`."""
    for folder in (fixture_dir / "models" / name, LOG_MODELS / name):
        if (folder / "config.json").is_file():
            return load_model(str(folder))
    return load_model(name)


def _run(where: str, entry: Any, file: str, fixture_dir: Path) -> PublishedRun:
    if not isinstance(entry, Mapping):
        raise _fail(where, "run", "expected a mapping", "write one mapping per run (see benchmarks/published_runs.py)")
    missing = [k for k in REQUIRED if k not in entry]
    if missing:
        raise _fail(where, missing[0], "missing", "every run states: " + ", ".join(REQUIRED))
    unknown = sorted(set(map(str, entry)) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise _fail(where, unknown[0], "unknown key", f"use: {', '.join(REQUIRED + OPTIONAL)}")
    if not entry.get("raw") and not entry.get("raw_file"):
        raise _fail(where, "raw", "missing", "keep the verbatim published excerpt in raw, or a file in raw_file")
    if entry.get("raw_file") and not (fixture_dir / str(entry["raw_file"])).is_file():
        raise _fail(where, "raw_file", f"{entry['raw_file']} is not beside the fixture", "add the file or fix its name")
    gpu = get_gpu(str(entry["gpu"]))
    link = with_interconnect(gpu, entry.get("interconnect"), f"{where}: interconnect").interconnect
    if gpu.name != entry["gpu"]:
        raise _fail(where, "gpu", f"{entry['gpu']!r} is an alias", f"write the table's name: {gpu.name}")
    sim_version, plan_version = _sim_version(where, entry)
    num_gpus = _positive_int(where, "num_gpus", entry["num_gpus"])
    workload = _workload(where, entry["workload"])
    closed = _closed(workload)
    flags = entry["flags"] if entry["flags"] is not None else {}
    if not isinstance(flags, Mapping) or {"tensor_parallel_size", "pipeline_parallel_size"} & set(flags):
        raise _fail(where, "flags", "expected a mapping of vLLM flags without the parallel sizes",
                    "write the parallel sizes in layout, the other non-default flags here")
    if entry["split"] not in ("fit", "held_out"):
        raise _fail(where, "split", f"expected fit or held_out, got {entry['split']!r}", "see split_of's rule")
    if not isinstance(entry["client"], Mapping) or "tool" not in entry["client"]:
        raise _fail(where, "client", "expected {tool: ..., endpoint: ...}", "write the client that measured it")
    _client_seed(where, entry["client"], workload)
    if workload.get("after_input_len") and (entry["client"].get("tool") != "vllm bench serve"
                                            or entry["client"].get("seed") is None or workload.get("dataset") != "random"):
        raise _fail(where, "workload.after_input_len", "needs a seeded vllm bench serve run of the random dataset",
                    "state client.seed and dataset: random, or drop after_input_len")
    _client_sampling(where, entry["client"], str(entry["vllm_version"]))
    _client_template(where, entry["client"])
    _client_output_rate(where, entry["client"], entry["measured"] if isinstance(entry["measured"], Mapping) else {})
    resolve_model(str(entry["model"]), fixture_dir)
    flashinfer = _flashinfer(where, entry.get("flashinfer"))
    return PublishedRun(
        id=str(entry["id"]), file=file, source=str(entry["source"]), vllm_version=str(entry["vllm_version"]),
        gpu=gpu.name, num_gpus=num_gpus, model=str(entry["model"]), layout=_layout(where, entry["layout"], num_gpus),
        flags=dict(flags), workload=workload, client=dict(entry["client"]),
        measured=_measured(where, entry["measured"], closed), split=str(entry["split"]),
        assumed=tuple(map(str, entry.get("assumed") or ())), quantization=entry.get("quantization"),
        sim_vllm_version=sim_version, plan_vllm_version=plan_version, interconnect=link, flashinfer=flashinfer)


def _flashinfer(where: str, raw: Any) -> bool | None:
    """A run's ``flashinfer: {available: true|false, source: <where the image's install is read>}``, or None."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("available"), bool) or not raw.get("source"):
        raise _fail(where, "flashinfer", f"expected {{available: true|false, source: ...}}, got {raw!r}",
                    "state whether FlashInfer imports in the publisher's image and where that is read")
    return bool(raw["available"])


def sweep_key(run: PublishedRun) -> str:
    """What a sweep's runs share: the source page (its address less any #fragment) and the model."""
    return json.dumps([run.source.split("#")[0].split(" ")[0], run.model])


def split_of(runs: Sequence[PublishedRun]) -> dict[str, str]:
    """The split rule (module docstring) over one file's runs: run id -> ``fit`` or ``held_out``."""
    out: dict[str, str] = {}
    for gpu in sorted({r.gpu for r in runs}):
        mine = [r for r in runs if r.gpu == gpu]
        sweeps: dict[str, list[PublishedRun]] = {}
        for r in mine:
            sweeps.setdefault(sweep_key(r), []).append(r)
        budget, fit = len(mine) // 2, 0
        for key in sorted(sweeps, key=lambda k: hashlib.sha256(k.encode()).hexdigest()):
            take = fit + len(sweeps[key]) <= budget
            fit += len(sweeps[key]) if take else 0
            for r in sweeps[key]:
                out[r.id] = "fit" if take else "held_out"
    return out


def recorded_runs(path: Path) -> dict[str, dict[str, Any]]:
    """The committed runs of a recorded comparison, by id: ``--compare --json``'s ``committed`` report, or
    ``published_runs_classes.py --json``'s runs (which it writes at the top level)."""
    data = json.loads(path.read_text())
    return {r["id"]: r for r in (data["committed"] if "committed" in data else data)["runs"]}


def load_runs(paths: Iterable[Path] | None = None) -> list[PublishedRun]:
    """Every run of the fixture files (all of :data:`FIXTURES` by default), validated: a
    :class:`SpecError` names the file, the run and the field at the first fault, and a ``split``
    that is not :func:`split_of`'s."""
    runs: list[PublishedRun] = []
    seen: set[str] = set()
    for path in sorted(paths if paths is not None else FIXTURES.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if not isinstance(doc, list) or not doc:
            raise SpecError(str(path.name), "expected a non-empty list of runs", "write - id: ... per run")
        mine = [_run(f"{path.name}[{i}] {e.get('id') if isinstance(e, Mapping) else ''}", e, path.name, path.parent)
                for i, e in enumerate(doc)]
        rule = split_of(mine)
        wrong = [r.id for r in mine if rule[r.id] != r.split]
        if wrong:
            raise SpecError(f"{path.name}: split", f"{len(wrong)} run(s) not split by the rule, first {wrong[0]}",
                            f"set split: {rule[wrong[0]]} there (benchmarks/published_runs.py --splits prints all)")
        for r in mine:
            if r.id in seen:
                raise SpecError(f"{path.name}: {r.id}", "id used twice", "give every run its own id")
            seen.add(r.id)
        runs.extend(mine)
    return runs


@dataclasses.dataclass(frozen=True)
class ReplayedLoad(Workload):
    """A :class:`Workload` whose requests are given (a published client's own draws, in order) rather
    than drawn from its lengths and rate: :meth:`requests` returns ``replayed``."""

    replayed: tuple[RequestSpec, ...] = ()

    def requests(self, include_warmup: bool = False) -> list[RequestSpec]:
        return list(self.replayed)


def bench_serve_lengths(seed: int, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                        special_tokens: int) -> tuple[list[int], list[int]]:
    """The prompt and output lengths ``vllm bench serve --dataset-name random --seed SEED`` sends.

    vLLM 0.11+ ``benchmarks/datasets.py`` ``RandomDataset``: its own ``np.random.default_rng(seed)``
    draws every input length (uniform integers in ``[floor(n (1 - r)), ceil(n (1 + r))]``, ``n`` the
    input length less the tokenizer's ``num_special_tokens_to_add()``), then every output length
    (at least 1), then the vocabulary offsets. The decode / re-encode round trip keeps the drawn
    lengths for the tokenizers here (the published JSONs' ``input_lens`` are the drawn ones).

    Example:
        >>> bench_serve_lengths(42, 3, 4096, 512, 0.3334, 0)
        ([2973, 4845, 4518], [491, 489, 635])
    """
    rng = np.random.default_rng(seed)
    real = max(0, input_len - special_tokens)
    low, high = math.floor(real * (1 - range_ratio)), math.ceil(real * (1 + range_ratio))
    out_low = max(1, math.floor(output_len * (1 - range_ratio)))
    out_high = max(1, math.ceil(output_len * (1 + range_ratio)))
    inputs = rng.integers(low, high + 1, size=num_prompts)
    outputs = rng.integers(out_low, out_high + 1, size=num_prompts)
    return [int(x) for x in inputs], [int(x) for x in outputs]


def bench_serve_arrivals(seed: int, num_prompts: int, request_rate: float, burstiness: float = 1.0) -> list[float]:
    """When ``vllm bench serve --request-rate R --burstiness B --seed SEED`` sends each request, in
    seconds from the start.

    vLLM 0.10+ ``benchmarks/serve.py``: ``np.random.seed(seed)`` at the start (the random dataset
    draws from its own generator, so nothing else takes from this one), then ``get_request`` draws
    each gap from ``np.random.gamma(shape=B, scale=1 / (R B))`` (B = 1: a Poisson process), adds
    them up, and scales them so that the last request goes out at ``num_prompts / R`` ("to close
    the gap for stabilizing the throughput data from different random seeds"). The first request
    waits its own gap too.

    Example:
        >>> [round(t, 3) for t in bench_serve_arrivals(42, 3, 1.0)]
        [0.294, 2.176, 3.0]
    """
    state = np.random.RandomState(seed)  # the legacy global generator np.random.seed(seed) sets
    gaps = [float(state.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness))) for _ in range(num_prompts)]
    times, total = [], 0.0
    for gap in gaps:
        total += gap
        times.append(total)
    scale = num_prompts / request_rate / times[-1] if times and times[-1] > 0 else 1.0
    return [t * scale for t in times]


def bench_serve_requests(run: PublishedRun) -> list[RequestSpec] | None:
    """The requests a seeded ``vllm bench serve`` run of the random dataset sent (its lengths and, at
    a finite rate, its arrival times: :func:`bench_serve_lengths`, :func:`bench_serve_arrivals`),
    for a run whose ``client`` states its ``seed`` and the tokenizer's ``special_tokens``; None
    otherwise (other clients, datasets, shared prefixes, DP replicas: drawn as before)."""
    c, w = run.client, run.workload
    if (c.get("tool") != "vllm bench serve" or c.get("seed") is None or w.get("dataset") != "random"
            or w.get("prefix_len") or run.layout["dp"] != 1):
        return None
    inputs, outputs = bench_serve_lengths(int(c["seed"]), w["num_prompts"], w["input_len"], w["output_len"],
                                          w["range_ratio"], int(c["special_tokens"]))
    rate = w.get("request_rate")
    times: list[float | None] = [None] * len(inputs)
    if rate is not None and not math.isinf(rate):
        times = list(bench_serve_arrivals(int(c["seed"]), w["num_prompts"], rate, float(c.get("burstiness", 1.0))))
    extra = template_tokens(run)
    inputs = [i + extra for i in inputs]
    cached = _after_prefix(w, int(c["special_tokens"]))
    if cached:  # each prompt its own group: its first tokens are the earlier run's prompt of the same index
        return [RequestSpec(i, o, t, prefix_group=k, prefix_tokens=min(cached + extra, i))
                for k, (i, o, t) in enumerate(zip(inputs, outputs, times))]
    held, k = _resent_held(w, int(c["special_tokens"]), extra), int(w.get("resent_prompts") or 0)
    return [RequestSpec(i, o, t, p, min(held, i)) if p < k else RequestSpec(i, o, t)
            for p, (i, o, t) in enumerate(zip(inputs, outputs, times))]


def template_tokens(run: PublishedRun) -> int:
    """The tokens the server's chat template adds to each prompt of a chat run (``client.template_tokens``,
    read from the model's template and tokenizer: the turn markers and any default system turn around the
    client's text), 0 where none is stated or the run sent completions. ``vllm bench serve`` counts the
    drawn prompt's tokens; the server prefills these too."""
    return int(run.client.get("template_tokens") or 0) if run.chat else 0


def _resent_held(w: Mapping[str, Any], special_tokens: int = 0, template: int = 0) -> int:
    """How many tokens of each re-sent prompt the server holds (``resent_len`` less the tokenizer's
    special tokens, plus the chat template's, or the whole prompt)."""
    if w.get("resent_len"):
        return max(0, int(w["resent_len"]) - special_tokens) + template
    return int(w["input_len"]) + template


def resent_requests(w: Mapping[str, Any]) -> list[RequestSpec] | None:
    """The requests of a ``benchmark_serving.py`` / ``vllm bench serve`` random-dataset burst whose first
    ``resent_prompts`` prompts the server already held (None without ``resent_prompts``): those each
    cached for their first ``resent_len`` tokens (default: the whole prompt; the scheduler's lookup
    keeps vLLM's last token to compute), the others new.

    Why whole prompts, not a share of each: the random dataset gives prompt i the tokens ``(offset_i +
    i + j) % vocab``, the offsets drawn after the lengths, which draw nothing at ``range_ratio`` 0, so
    prompt i is the same in every run of one seed whatever ``--num-prompts``; and the client's
    "initial single prompt test run" sends ``input_requests[0]`` to completion before the timed
    requests (``benchmarks/benchmark_serving.py`` ``benchmark()``, vLLM 0.10; ``vllm bench serve``
    the same), so prompt 0 is always held. A run after a run of N prompts on the same server then
    finds prompts 0..N-1 cached whole and the rest new: its logged hit rate is that count over the
    last 1000 requests' lookups (checked on dennislee22's logs: a fresh server's 50-prompt burst logs
    1008 / (51 x 1024) = 1.9%, the 30-prompt burst after it 38.5%). The count per run is read from the
    server logs' pids and times (the fixture's ``assumed``), not fitted. Chosen after the held-out
    errors of these runs were read (the logged rate spread as a share of every prompt put the TTFT
    of a burst whose early prompts were all cached 60-230% long).

    Example:
        >>> [(r.prefix_group, r.prefix_tokens) for r in resent_requests(
        ...     {"resent_prompts": 2, "num_prompts": 3, "input_len": 64, "output_len": 8})]
        [(0, 64), (1, 64), (None, 0)]
    """
    k = w.get("resent_prompts")
    if not k:
        return None
    held = _resent_held(w)
    n, i, o = int(w["num_prompts"]), int(w["input_len"]), int(w["output_len"])
    return [RequestSpec(i, o, None, p, min(held, i)) if p < k else RequestSpec(i, o) for p in range(n)]


@functools.lru_cache(maxsize=1)
def sharegpt_rows() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """ShareGPT's per-request prompt and output token counts as ``vllm bench serve --dataset-name
    sharegpt`` samples them, in the order it sends them at its default seed 0 (:data:`SHAREGPT_LENGTHS`:
    16,384 rows, the Llama-3.1-8B tokenizer; its source, sampler and filters are written in the file)."""
    doc = json.loads(SHAREGPT_LENGTHS.read_text())
    return tuple(int(x) for x in doc["prompt_tokens"]), tuple(int(x) for x in doc["output_tokens"])


def rescaled(lengths: Sequence[int], total: int) -> list[int]:
    """``lengths`` times one factor, rounded to whole tokens that add up to ``total`` (the largest
    remainders rounded up, each length at least 1): a sample's shape at a run's stated total.

    Example:
        >>> rescaled([10, 20, 70], 50)
        [5, 10, 35]
        >>> sum(rescaled([13, 25, 27, 10, 329], 700)), rescaled([1, 1, 998], 500)
        (700, [1, 1, 498])
    """
    scale = total / sum(lengths)
    exact = [x * scale for x in lengths]
    out = [max(1, math.floor(x)) for x in exact]
    gap = total - sum(out)
    by_remainder = sorted(range(len(out)), key=lambda i: (out[i] - exact[i], i))  # largest remainder first
    for i in by_remainder[:gap] if gap >= 0 else [i for i in reversed(by_remainder) if out[i] > 1][:-gap]:
        out[i] += 1 if gap >= 0 else -1
    return out


def sharegpt_lengths(num_prompts: int, input_len: int, output_len: int,
                     seed: int | None = 0) -> tuple[list[int], list[int]]:
    """The prompt and output lengths of ``num_prompts`` ShareGPT requests, rescaled so they add up to
    ``num_prompts`` times the stated means (:func:`rescaled`: the stated totals are the run's own
    tokenizer's, the rows the Llama-3.1-8B tokenizer's). ``seed`` 0: :func:`sharegpt_rows` in order,
    the requests ``vllm bench serve`` sends at its default ``--seed 0`` (vLLM 0.10+
    ``vllm/benchmarks/datasets.py`` ``ShareGPTDataset``: ``random.seed(seed)`` then ``random.shuffle``
    of the conversations of two turns or more, then each in turn kept unless ``is_valid_sequence``
    drops it: prompt or output under 4 tokens, prompt over 1024, prompt plus output over 2048; the
    rows' sampler is vLLM's older copy of the same, so the same order); any other seed, or None for
    another client, a draw without replacement from ``np.random.default_rng(seed or 0)``.

    Example:
        >>> ins, outs = sharegpt_lengths(1000, 217, 202)
        >>> sum(ins), sum(outs), max(outs) > 4 * 202
        (217000, 202000, True)
    """
    prompts, outputs = sharegpt_rows()
    if seed == 0:
        picks = [i % len(prompts) for i in range(num_prompts)]
    else:
        rng = np.random.default_rng(seed or 0)
        picks = [int(i) for i in rng.choice(len(prompts), size=num_prompts, replace=num_prompts > len(prompts))]
    return (rescaled([prompts[i] for i in picks], num_prompts * input_len),
            rescaled([outputs[i] for i in picks], num_prompts * output_len))


def sharegpt_requests(run: PublishedRun, load: Workload) -> list[RequestSpec] | None:
    """``load``'s requests (their pacing) with the lengths of a ShareGPT run's requests
    (:func:`sharegpt_lengths`: a ``vllm bench serve`` run's at its seed, its default 0 where none is
    stated; another client's a seeded draw from the same rows), for a ``dataset: sharegpt`` run of one
    engine with no shared or re-sent prefix; None otherwise. Every length is drawn from the rows, the
    output too: ``vllm bench serve`` sends each request's ShareGPT reply length as its ``max_tokens``,
    GPUStack's benchmark-runner forces it (the same 281,412 output tokens in every run of its pages);
    none of these runs sets a fixed output length (``--sharegpt-output-len``).
    Chosen after the fixed mean lengths put the 1,000-request ShareGPT bursts' throughput 25-86% high."""
    w = run.workload
    if (w.get("dataset") != "sharegpt" or run.layout["dp"] != 1
            or any(w.get(k) for k in ("prefix_len", "prefix_cache_hit_rate", "after_input_len", "resent_prompts"))):
        return None
    seed = int(run.client.get("seed", 0)) if run.client.get("tool") == "vllm bench serve" else None
    inputs, outputs = sharegpt_lengths(int(w["num_prompts"]), int(w["input_len"]), int(w["output_len"]), seed)
    return [dataclasses.replace(r, prompt_tokens=i, output_tokens=o)
            for r, i, o in zip(load.requests(), inputs, outputs)]


def _after_prefix(w: Mapping[str, Any], special_tokens: int) -> int:
    """The tokens of each prompt the server holds from the run it served just before (``after_input_len``:
    that run's prompt i, the same seed's, less the tokenizer's special tokens), or 0."""
    return max(0, int(w["after_input_len"]) - special_tokens) if w.get("after_input_len") else 0


def workload_of(run: PublishedRun, dp_share: bool = True, as_sent: bool = True) -> Workload:
    """The run's load as servetune's :class:`Workload` for one engine (one DP replica's share).
    ``as_sent`` False: a capped finite-rate run (``loop: closed``) as the closed loop from t=0 it was
    simulated as before arrivals were kept, and re-sent prompts as new ones (``--before``)."""
    w, dp = run.workload, run.layout["dp"] if dp_share else 1
    def length(mean: int) -> Any:
        return {"mean": mean, "range_ratio": w["range_ratio"]} if w["range_ratio"] > 0 else mean
    spec: dict[str, Any] = {"input_len": length(w["input_len"] + template_tokens(run)),
                            "output_len": length(w["output_len"]),
                            "num_requests": max(1, w["num_prompts"] // dp), "seed": 0}
    if w.get("prefix_len"):
        spec.update(prefix_len=w["prefix_len"], num_prefix_groups=w.get("num_prefix_groups", 1))
    load = dataclasses.replace(_resent(_paced(spec, w, run, dp, as_sent), w, as_sent, dp), chat=run.chat,
                               sampling=run.sampling if as_sent else GREEDY)
    sent = bench_serve_requests(run) if as_sent else None
    sent = resent_requests(w) if as_sent and sent is None and run.layout["dp"] == 1 else sent
    sent = sharegpt_requests(run, load) if as_sent and sent is None else sent
    if sent is None:
        return load
    return ReplayedLoad(**{f.name: getattr(load, f.name) for f in dataclasses.fields(Workload)}, replayed=tuple(sent))


def _resent(load: Workload, w: Mapping[str, Any], as_sent: bool, dp: int = 1) -> Workload:
    """``load`` with the logged prefix-cache hit rate as the share of each prompt cached before (or, after
    a shorter run of the same seed, the earlier prompts' share; an engine's expected share under DP)."""
    hit = w.get("prefix_cache_hit_rate")
    if as_sent and w.get("resent_prompts"):  # whole leading prompts (resent_requests): their share, primed
        held = min(w.get("resent_len") or w["input_len"], w["input_len"] - 1)  # vLLM computes the last token
        hit = w["resent_prompts"] * held / (w["num_prompts"] * w["input_len"])
    if as_sent and w.get("after_input_len"):  # one engine's share of the earlier run's prefixes (1 / dp of them)
        hit = w["after_input_len"] / w["input_len"] / dp
    return dataclasses.replace(load, cached_fraction=float(hit)) if as_sent and hit else load


def _paced(spec: dict[str, Any], w: Mapping[str, Any], run: PublishedRun, dp: int, as_sent: bool) -> Workload:
    """The pacing half of :func:`workload_of`: a closed loop at the cap, or timed arrivals."""
    rate = w.get("request_rate")
    cap = max(1, min(w.get("max_concurrency") or w["num_prompts"], w["num_prompts"]) // dp)
    if rate is None or math.isinf(rate) or (not as_sent and run.closed_loop):
        spec["concurrency"] = cap
        return Workload.from_dict(spec)
    # A finite rate: vllm bench serve draws Poisson arrivals at it and holds at most max_concurrency
    # in flight (its semaphore), so a capped run's requests start staggered by their arrivals, even
    # where the cap binds (loop: closed); the simulated client does the same (sim.client: timed
    # requests, at most ``concurrency`` at once).
    spec["request_rate"] = rate / dp
    load = Workload.from_dict(spec)
    return dataclasses.replace(load, concurrency=cap) if w.get("max_concurrency") is not None else load


@dataclasses.dataclass(frozen=True)
class Judged:
    """One run against its simulation: each figure's simulated value (None where nothing ran)."""

    run: PublishedRun
    sim_output_throughput: float | None
    sim_ttft_ms: float | None
    sim_tpot_ms: float | None
    failure: str | None = None
    #: The "Prefix cache hit rate" the simulated server logged at the run's end, counted as the run's
    #: vLLM version counts (resumed requests' lookups up to 0.11.0, a blocked lookup at every retry
    #: up to 0.26.0, over the most recent 1000), as a fraction: beside ``workload.prefix_cache_hit_rate``.
    sim_hit_rate: float | None = None
    #: Where the run states no ``max_model_len`` and the plan refuses the model's default as too long
    #: for the KV pool (vLLM's one-sequence check) although the published run served: the length the
    #: run was simulated at instead (:func:`assumed_max_model_len`), and the plan's refusal at the default.
    assumed_max_model_len: int | None = None
    default_refused: str | None = None
    #: The simulated latency percentiles (ms) the load generator would print, by figure ("ttft_ms",
    #: "itl_ms", "tpot_ms": {"mean", "median", "p99"}), beside ``run.measured``'s (:func:`latency_pairs`).
    sim_latency: Mapping[str, Mapping[str, float]] | None = dataclasses.field(default=None, compare=False)

    @property
    def headline_error(self) -> float | None:
        name, real = self.run.headline
        sim = self.sim_output_throughput if name == "output_throughput" else self.sim_tpot_ms
        return None if sim is None else sim / real - 1.0

    @property
    def ttft_error(self) -> float | None:
        real = self.run.stat("ttft_ms")
        return None if real is None or self.sim_ttft_ms is None or real <= 0 else self.sim_ttft_ms / real - 1.0


#: The knobs of ``servetune.sim.GPU_FAMILY_OVERRIDES`` fitted on these fixtures' fit runs
#: (:func:`fit_knob`), by GPU; the other overrides come from elsewhere (the H100's from its own host).
FITTED_HERE: dict[str, tuple[str, ...]] = {"A100-80GB": ("kv_read_efficiency", "attn_efficiency")}


def h200_knobs_for(gpu_name: str) -> dict[str, float]:
    """Overrides that put the H200's fitted value back on every knob of ``gpu_name`` that
    :data:`FITTED_HERE` names, and on the FlashAttention-2 parts' knobs (``servetune.sim.FA2_KNOBS``,
    the A100's fit carried to every compute capability 8.x part): the GPU as it was judged before
    the fits on published runs.

    Example:
        >>> h200_knobs_for("L4"), h200_knobs_for("H100-80GB")
        ({'attn_efficiency': 0.2681}, {})
    """
    h200 = dataclasses.asdict(Calibration().with_overrides(GPU_CALIBRATION["H200"]))
    names = set(FITTED_HERE.get(gpu_name, ())) | (set(FA2_KNOBS) if runs_flash_attention_2(get_gpu(gpu_name)) else set())
    return {k: h200[k] for k in sorted(names)}


def assumed_max_model_len(run: PublishedRun) -> int:
    """The ``max_model_len`` a run that states none is simulated at where the plan refuses the model's
    default: the longest request its load can send (prompt plus output, at the top of a random range),
    rounded up to a power of two. The simulated figures do not depend on it (it moves no KV block and
    no step); only vLLM's startup check does.

    Example:
        >>> run = next(r for r in load_runs() if r.id == "h100-qwen3-235b-a22b-2507-tp8-rand32000x100-burst100")
        >>> assumed_max_model_len(run)
        32768
    """
    w = run.workload
    top = (w["input_len"] + w["output_len"]) * (1.0 + w["range_ratio"])
    if w.get("dataset") == "sharegpt":  # its longest request as sent (sharegpt_requests), not its means
        top = max(top, max(r.prompt_tokens + r.output_tokens for r in workload_of(run).requests()))
    return 1 << max(0, math.ceil(math.log2(top)))


def judge(run: PublishedRun, calibration: Mapping[str, float] | None = None, as_sent: bool = True,
          triton_cache: TritonCache | None = None) -> Judged:
    """Simulate ``run`` (its model, GPU, layout, flags, vLLM version and load) and pair the figures
    (``as_sent``: :func:`workload_of`'s). ``triton_cache``: its server's fused-MoE kernel variants,
    updated in place (None: :func:`server_cache`'s replay of the runs before it; ``as_sent`` False:
    none are compiled on first use, the simulator before it priced them). A run that states no ``max_model_len``, served, and whose
    default the plan refuses (``kv_too_small``: the planner calls it impossible) is simulated at
    :func:`assumed_max_model_len` and carries the refusal in ``default_refused``: the report counts it
    apart, so a served start called impossible stays in view."""
    if triton_cache is None:
        triton_cache = server_cache(run, calibration) if as_sent else TritonCache(complete=True)
    before = TritonCache(set(triton_cache.variants), triton_cache.complete)
    judged = _judge_flags(run, run.flags, calibration, as_sent, triton_cache)
    if (judged.failure or "").startswith("kv_too_small") and "max_model_len" not in run.flags:
        length = assumed_max_model_len(run)
        triton_cache.variants = before.variants  # the refused start ran nothing
        again = _judge_flags(run, {**run.flags, "max_model_len": length}, calibration, as_sent, triton_cache)
        if again.failure is None:
            return dataclasses.replace(again, assumed_max_model_len=length, default_refused=judged.failure)
    return judged


def _judge_flags(run: PublishedRun, run_flags: Mapping[str, Any], calibration: Mapping[str, float] | None,
                 as_sent: bool, triton_cache: TritonCache | None = None) -> Judged:
    """:func:`judge` with the run's flags replaced by ``run_flags``."""
    flags = {**run_flags, "tensor_parallel_size": run.layout["tp"], "pipeline_parallel_size": run.layout["pp"]}
    try:
        target = resolve_target(resolve_model(run.model, FIXTURES), run.gpu, flags, run.sim_vllm_version)
        # The startup memory (KV pool, refusal) at the run's own version where the planner has its rules
        planned = target if run.plan_vllm_version in ("", run.sim_vllm_version) else \
            resolve_target(target.model, target.gpu, flags, run.plan_vllm_version)
    except SpecError as exc:
        return Judged(run, None, None, None, failure=str(exc))
    gpu = with_calibration(with_interconnect(target.gpu, run.interconnect or None), calibration or {})
    # A published run ran vLLM's and NCCL's defaults (multicast live where the board has it): the TP all-reduce's
    # backends by size (planner.comm.allreduce_table). ``as_sent`` False, the simulator before that rule too.
    # One replica's plan per GPU with the run's dp (a MoE model's experts split over tp x dp, as servetune plan
    # does); on the 20 TP=4 DP=2 runs the KV pool binds none, so their figures are those of the dp=1 plan.
    result = simulate(target.model, gpu, engine_config(run, target.config), workload_of(run, as_sent=as_sent),
                      plan=plan_memory(planned.model, gpu, engine_config(run, planned.config)),
                      triton_cache=triton_cache, comm_env=VLLM_DEFAULT_ENV if as_sent else None,
                      one_replica=True)  # workload_of already gives one engine's share of a DP run
    if not result.ok:
        return Judged(run, None, None, None, failure=f"{result.status.value}: {result.cause}")
    logged = _HIT_RATE.findall(result.log_text or "")
    latency = {name: {"mean": s.mean, "median": s.p50, "p99": s.p99}
               for name, s in (("ttft_ms", result.ttft_ms), ("itl_ms", result.itl_ms), ("tpot_ms", result.tpot_ms))
               if s is not None}
    return Judged(run, (result.output_throughput or 0.0) * run.layout["dp"],
                  result.ttft_ms.mean if result.ttft_ms else None, result.tpot_ms.mean if result.tpot_ms else None,
                  sim_hit_rate=float(logged[-1]) / 100 if logged else None, sim_latency=latency)


def engine_config(run: PublishedRun, config: EngineConfig) -> EngineConfig:
    """The config one of ``run``'s engines is simulated with: ``config`` (one replica's flags, as planned)
    with the run's ``dp`` as ``data_parallel_size``, which the simulator reads for a MoE model's routed
    experts only (``servetune.sim.perf_classes.moe_parallel_size`` and ``moe_step_tokens``: split over
    ``tp x dp`` GPUs, every replica's tokens) and the planner for their weights and workspace per GPU; and the
    run's stated FlashInfer (:attr:`PublishedRun.flashinfer`: the profile run's sampler of vLLM 0.10.0-0.11.0).

    Example:
        >>> run = next(r for r in load_runs([FIXTURES / "nvlink_moe.yaml"]) if r.layout["dp"] == 2)
        >>> target = resolve_target(resolve_model(run.model, FIXTURES), run.gpu, {"tensor_parallel_size": 4})
        >>> engine_config(run, target.config).data_parallel_size
        2
    """
    return dataclasses.replace(config, data_parallel_size=run.layout["dp"], flashinfer_available=run.flashinfer)


#: The simulated run log's hit rate (``servetune.sim.vllm_log.run_log_text``: vLLM's stats line).
_HIT_RATE = re.compile(r"Prefix cache hit rate: ([\d.]+)%")


def server_key(run: PublishedRun) -> str:
    """What one server's runs share: the sweep (:func:`sweep_key`), the GPU, the layout and the host."""
    return json.dumps([sweep_key(run), run.gpu, dict(run.layout), run.interconnect])


def server_cache(run: PublishedRun, calibration: Mapping[str, float] | None = None) -> TritonCache:
    """The fused-MoE kernel variants ``run``'s server holds when it starts: none beyond startup's for
    a run that starts its server; after ``after_input_len``, those its runs before this one compiled,
    replayed in the fixture file's order from the server's start (each simulated as :func:`judge` does).

    Example:
        >>> runs = load_runs([FIXTURES / "nvlink_moe.yaml"])
        >>> cold, warm = server_cache(runs[0]), server_cache(runs[1])
        >>> len(warm.variants - cold.variants) > 0 and not cold.variants
        True
    """
    cache = TritonCache()
    if not run.workload.get("after_input_len"):
        return cache
    path = FIXTURES / run.file
    mine = [r for r in load_runs([path]) if server_key(r) == server_key(run)] if path.exists() else []
    ids = [r.id for r in mine]
    earlier = mine[:ids.index(run.id)] if run.id in ids else []
    starts = [i for i, r in enumerate(earlier) if not r.workload.get("after_input_len")]
    for r in earlier[starts[-1]:] if starts else []:
        judge(r, calibration, triton_cache=cache)
    return cache


def step_breakdown(run: PublishedRun) -> dict[str, dict[str, float]]:
    """Where the simulator puts a run's time: one engine step's GPU milliseconds by kind of kernel
    (``PerfModel.gpu_cost``: gemm, elementwise, attention, kv_write, comm, launch, sampler) and the whole step
    with the engine CPU it leaves visible (``step_ms``), for a decode step of 1, 8, the run's
    concurrency (one replica's share under DP) and 256 requests at the run's mean context (prompt plus half the
    output), for one prompt's prefill within the token budget (``prefill``) and for a whole budget of the run's
    prompts (``budget``, :func:`budget_step`: the step a burst's prefill runs). ``moe`` is the routed experts' share
    of ``gemm`` (``PerfModel.moe_seconds`` plus ``moe_activation_seconds``; 0 for a dense model). Which term
    dominates a miss, in one call (``published_runs.py --breakdown ID``).

    Example:
        >>> run = next(r for r in load_runs() if r.id == "a100-qwen2-7b-tp2-u025-rand1024x1024-burst1")
        >>> b = step_breakdown(run)
        >>> b["decode 1"]["comm"] > 0 and b["decode 1"]["gemm"] > b["decode 1"]["attention"]
        True
    """
    flags = {**run.flags, "tensor_parallel_size": run.layout["tp"], "pipeline_parallel_size": run.layout["pp"]}
    target = resolve_target(resolve_model(run.model, FIXTURES), run.gpu, flags, run.sim_vllm_version)
    perf = PerfModel(target.model, with_interconnect(target.gpu, run.interconnect or None),
                     engine_config(run, target.config), sampling=run.sampling, comm_env=VLLM_DEFAULT_ENV)
    w = run.workload
    context = w["input_len"] + w["output_len"] // 2
    # One engine's share under DP, as the run is judged (_paced): the replicas split the clients.
    cap = max(1, min(w.get("max_concurrency") or w["num_prompts"], w["num_prompts"]) // run.layout["dp"])
    n = min(w["input_len"], target.config.max_num_batched_tokens)
    steps: dict[str, tuple[int, int, int, int, bool]] = {
        **{f"decode {b}": (b, b, b * context, b * context, True) for b in sorted({1, 8, cap, 256})},
        "prefill": (1, n, n, n * n // 2, False),
        "budget": budget_step(w["input_len"], target.config.max_num_batched_tokens)}
    out: dict[str, dict[str, float]] = {}
    for name, args in steps.items():
        tokens = args[1]
        out[name] = {**{k: 1e3 * v for k, v in dataclasses.asdict(perf.gpu_cost(*args)).items()},
                     "step_ms": 1e3 * perf.step_time(*args),
                     # The routed experts (grouped GEMMs and their activation traffic), a part of "gemm".
                     "moe": 1e3 * (perf.moe_seconds(tokens) + perf.moe_activation_seconds(tokens))}
    return out


def budget_step(input_len: int, budget: int) -> tuple[int, int, int, int, bool]:
    """``PerfModel.gpu_cost``'s arguments (requests, tokens, KV context, attention work, decode only) for one
    step of a burst's prefill: ``budget`` tokens of ``input_len``-token prompts, the step vLLM's chunked prefill
    runs while a burst's prompts wait. Shorter prompts fill it whole, the last one cut (each from its first
    token); a longer prompt gives it one chunk from the prompt's middle (the mean chunk).

    Example:
        >>> budget_step(128, 16384), budget_step(32000, 8192)
        ((128, 16384, 16384, 1048576, False), (1, 8192, 20096, 131072000, False))
    """
    if input_len >= budget:
        start = (input_len - budget) // 2
        return 1, budget, start + budget, budget * start + budget * budget // 2, False
    whole, cut = divmod(budget, input_len)
    work = whole * (input_len * input_len // 2) + cut * cut // 2
    return whole + (1 if cut else 0), budget, budget, work, False


def judge_all(runs: Sequence[PublishedRun], before: bool = False) -> list[Judged]:
    """Every run simulated as committed, or with ``before``: the knobs :data:`FITTED_HERE` names at
    the H200's values, every run on its GPU type's usual host (the stated ``interconnect``
    ignored: the simulator before it took the interconnect as an input), capped finite-rate
    runs as closed loops from t=0 (before their arrivals were kept), re-sent prompts as new
    ones (before the logged prefix-cache hit rate was an input) and no chat-template parse per
    chat request (``chat_template_parse_s`` 0, before vLLM 0.11.0's was priced), no fused-MoE kernel
    compiled on first use (before ``sim.moe_jit``) and every TP all-reduce at the calibrated price (before
    ``planner.comm.allreduce_table``). As committed, one server's runs share its Triton
    cache in the order given (:func:`server_cache`)."""
    if before:
        return [dataclasses.replace(judge(dataclasses.replace(r, interconnect=""),
                                          {**h200_knobs_for(r.gpu), "chat_template_parse_s": 0.0},
                                          as_sent=False), run=r) for r in runs]
    caches: dict[str, TritonCache] = {}
    out: list[Judged] = []
    for r in runs:  # one server's runs in order: its Triton cache carried, not replayed again
        key = server_key(r)
        cache = caches[key] if r.workload.get("after_input_len") and key in caches else None
        cache = cache if cache is not None else server_cache(r)
        out.append(judge(r, triton_cache=cache))
        caches[key] = cache
    return out


def fit_loss(judged: Sequence[Judged]) -> float:
    """What a per-GPU fit minimises: mean |headline error| plus mean |TTFT error| (runs the
    simulator could not start count 1 each, so a knob cannot win by refusing them)."""
    head = [1.0 if j.headline_error is None else abs(j.headline_error) for j in judged]
    ttft = [abs(j.ttft_error) for j in judged if j.ttft_error is not None]
    return sum(head) / len(head) + (sum(ttft) / len(ttft) if ttft else 0.0)


def golden_section(loss: Any, lo: float, hi: float, tolerance: float = 0.01) -> float:
    """The minimum of a one-dimensional ``loss`` on [lo, hi] (unimodal assumed), to ``tolerance``
    of the interval; equal losses keep the lower part (``_fidelity.golden_section``'s search).

    Example:
        >>> round(golden_section(lambda x: (x - 0.3) ** 2, 0.0, 1.0, 1e-4), 3)
        0.3
    """
    return _fidelity.golden_section(loss, lo, hi, tolerance * (hi - lo), ties_go_low=True)


def fit_knob(runs: Sequence[PublishedRun], gpu: str, knob: str, bounds: tuple[float, float],
             tolerance: float = 0.01) -> float:
    """One simulator knob for ``gpu`` (or several, comma-separated: ``A100-80GB,H100-80GB``) fitted
    alone (:func:`golden_section` on :func:`fit_loss`) on those GPUs' ``fit`` runs, every other knob as
    committed. Never reads a held-out run."""
    names = set(gpu.split(","))
    mine = [r for r in runs if r.gpu in names and r.split == "fit"]
    if not mine:
        raise SpecError(f"--fit {gpu}", "no fit run on that GPU", "fit only GPUs whose fixtures have fit runs")
    return golden_section(lambda v: fit_loss([judge(r, {knob: v}) for r in mine]), bounds[0], bounds[1], tolerance)


def _summary(rows: Sequence[Judged]) -> dict[str, Any]:
    head = [abs(j.headline_error) for j in rows if j.headline_error is not None]
    ttft = [abs(j.ttft_error) for j in rows if j.ttft_error is not None]
    return {"runs": len(rows), "judged": len(head), "failed": len(rows) - len(head),
            "headline_mae_pct": round(100 * sum(head) / len(head), 1) if head else None,
            "headline_within_10pct": sum(e <= 0.10 for e in head),
            "headline_bias_pct": round(100 * sum(j.headline_error for j in rows if j.headline_error is not None)
                                       / len(head), 1) if head else None,
            "ttft_mae_pct": round(100 * sum(ttft) / len(ttft), 1) if ttft else None,
            "ttft_within_25pct": sum(e <= 0.25 for e in ttft), "ttft_judged": len(ttft),
            "default_refused": sum(j.default_refused is not None for j in rows)}


def cells(judged: Sequence[Judged], split: str) -> dict[str, dict[str, Any]]:
    """``split``'s runs by GPU x layout x load shape: each cell's :func:`_summary`, then per GPU."""
    out: dict[str, dict[str, Any]] = {}
    mine = [j for j in judged if j.run.split == split]
    for j in sorted(mine, key=lambda j: (j.run.gpu, j.run.layout_label, j.run.shape)):
        key = f"{j.run.gpu} | {j.run.layout_label} | {j.run.shape}"
        out.setdefault(key, {})
    for key in list(out):
        gpu, layout, shape = key.split(" | ")
        out[key] = _summary([j for j in mine if (j.run.gpu, j.run.layout_label, j.run.shape) == (gpu, layout, shape)])
    for gpu in sorted({j.run.gpu for j in mine}):
        out[f"{gpu} | all | all"] = _summary([j for j in mine if j.run.gpu == gpu])
    if mine:
        out["all | all | all"] = _summary(mine)
    return out


def format_cells(table: Mapping[str, Mapping[str, Any]]) -> str:
    head = f"{'GPU | layout | load':<40}{'runs':>5}{'headline |err|':>16}{'<=10%':>7}{'bias':>8}{'TTFT |err|':>12}{'<=25%':>7}"
    lines = [head, "-" * len(head)]
    for key, s in table.items():
        mae = "-" if s["headline_mae_pct"] is None else f"{s['headline_mae_pct']:.1f}%"
        bias = "-" if s["headline_bias_pct"] is None else f"{s['headline_bias_pct']:+.1f}%"
        ttft = "-" if s["ttft_mae_pct"] is None else f"{s['ttft_mae_pct']:.1f}%"
        failed = f" ({s['failed']} not simulated)" if s["failed"] else ""
        if s.get("default_refused"):
            failed += f" ({s['default_refused']} at an assumed max_model_len: the default called impossible)"
        lines.append(f"{key:<40}{s['runs']:>5}{mae:>16}{s['headline_within_10pct']:>4}/{s['judged']:<2}{bias:>8}"
                     f"{ttft:>12}{s['ttft_within_25pct']:>4}/{s['ttft_judged']:<2}{failed}")
    return "\n".join(lines)


def _per_run(judged: Sequence[Judged]) -> list[dict[str, Any]]:
    rows = []
    for j in judged:
        name, real = j.run.headline
        sim = j.sim_output_throughput if name == "output_throughput" else j.sim_tpot_ms
        rows.append({"id": j.run.id, "split": j.run.split, "gpu": j.run.gpu, "layout": j.run.layout_label,
                     "shape": j.run.shape, "headline": name, "real": round(real, 2), "sim": None if sim is None else round(sim, 2),
                     "error_pct": None if j.headline_error is None else round(100 * j.headline_error, 1),
                     "ttft_real": j.run.stat("ttft_ms"), "ttft_sim": None if j.sim_ttft_ms is None else round(j.sim_ttft_ms, 1),
                     "ttft_error_pct": None if j.ttft_error is None else round(100 * j.ttft_error, 1),
                     "failure": j.failure,
                     **({"assumed_max_model_len": j.assumed_max_model_len, "default_refused": j.default_refused}
                        if j.default_refused else {}),
                     **({"hit_rate_logged": j.run.workload["prefix_cache_hit_rate"],
                         "hit_rate_sim": None if j.sim_hit_rate is None else round(j.sim_hit_rate, 3)}
                        if j.run.workload.get("prefix_cache_hit_rate") else {})})
    return rows


def rankings(judged: Sequence[Judged]) -> list[dict[str, Any]]:
    """Each published comparison of configurations: runs of one source page and model under the same
    load (lengths, prompts, rate or concurrency; not the logged prefix-cache hit rate nor the re-sent
    prompts, which are the server's) with two or more layouts or flag sets. Per
    comparison, the configuration the real runs put first (highest output tok/s for a closed loop,
    lowest TPOT for an open one) and the one the simulator does, and whether they agree: the
    simulator agrees where it puts the real best within 1% of its own best (it cannot tell them
    apart). Runs the simulator could not start rank last."""
    groups: dict[str, list[Judged]] = {}
    for j in judged:
        w = {k: j.run.workload[k] for k in sorted(j.run.workload)  # not what the server held: log figures
             if k not in ("prefix_cache_hit_rate", "resent_prompts", "resent_len")}
        groups.setdefault(json.dumps([j.run.source.split("#")[0].split(" ")[0], j.run.model, w], default=str),
                          []).append(j)
    out = []
    for group in groups.values():
        if len({(json.dumps(dict(j.run.layout)), json.dumps(dict(j.run.flags), sort_keys=True)) for j in group}) < 2:
            continue
        closed = group[0].run.closed_loop
        real = {j.run.id: j.run.headline[1] for j in group}
        sim = {j.run.id: (j.sim_output_throughput if closed else j.sim_tpot_ms) for j in group}
        pick = max if closed else min
        real_best = pick(real, key=lambda i: real[i])
        worst = -math.inf if closed else math.inf
        sim_best = pick(sim, key=lambda i: worst if sim[i] is None else sim[i])
        best, mine = sim[sim_best], sim[real_best]
        agree = best is not None and mine is not None and abs(mine / best - 1.0) <= 0.01
        out.append({"runs": sorted(real), "real_best": real_best, "sim_best": sim_best, "agree": agree})
    return out


def ratio_spread(judged: Sequence[Judged]) -> list[dict[str, Any]]:
    """How far each run's real/simulated headline ratio sits from its sweep's median ratio (one publisher's
    runs of one model at one layout, :func:`sweep_key`): what a study's simulator screen meets once it has
    learnt the median ratio on its own real trials (``servetune.search.screen``, whose margins on a GPU no
    real run judged are read off this with ``--before``). One row a sweep of 2 or more simulated runs,
    both splits (``--before``: nothing on these runs fitted yet): the largest and second largest
    deviation in percent.

    Example:
        >>> ratio_spread([])
        []
    """
    sweeps: dict[tuple[str, str, str], list[float]] = {}
    for j in judged:
        if j.headline_error is not None:
            key = (j.run.gpu, j.run.layout_label, sweep_key(j.run))
            sweeps.setdefault(key, []).append(1.0 / (1.0 + j.headline_error))  # real / sim
    rows = []
    for (gpu, layout, key), ratios in sorted(sweeps.items()):
        if len(ratios) < 2:
            continue
        mid = statistics.median(ratios)
        dev = sorted((abs(r / mid - 1.0) for r in ratios), reverse=True)
        rows.append({"gpu": gpu, "layout": layout, "sweep": key, "runs": len(ratios),
                     "max_pct": round(100 * dev[0], 1), "second_pct": round(100 * dev[1], 1)})
    return rows


def _report(runs: Sequence[PublishedRun], before: bool) -> dict[str, Any]:
    judged = judge_all(runs, before=before)
    return {"calibration": "before the fits, stated interconnects, kept arrivals and cached re-sent prompts of published runs" if before else "committed",
            "held_out": cells(judged, "held_out"), "fit": cells(judged, "fit"), "runs": _per_run(judged),
            "rankings": rankings(judged), "ratio_spread": ratio_spread(judged)}


def format_comparison(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """Each cell's headline and TTFT error before what the published runs taught (--before) and as committed,
    held out first, then the fit half (labelled: fitting data, not evidence)."""
    lines = []
    agree = [r for r in after["rankings"] if r["agree"]]
    lines.append(f"published comparisons of configurations: the simulator puts the real best first in "
                 f"{len(agree)} of {len(after['rankings'])}")
    lines.extend(f"  {'agree   ' if r['agree'] else 'DIFFERENT'} real best {r['real_best']}, simulated best "
                 f"{r['sim_best']}" for r in after["rankings"])
    for split, title in (("held_out", "HELD OUT (the evidence)"), ("fit", "FIT (fitting data, not evidence)")):
        lines.append(f"{title}\n{'GPU | layout | load':<40}{'runs':>5}  headline |err| before -> after"
                     f"   within 10%   TTFT |err| before -> after")
        for key, a in after[split].items():
            b = before[split][key]
            lines.append(f"{key:<40}{a['runs']:>5}  {b['headline_mae_pct']!s:>8}% -> {a['headline_mae_pct']!s:>6}%"
                         f"   {b['headline_within_10pct']:>3} -> {a['headline_within_10pct']:>2}/{a['judged']:<3}"
                         f"   {b['ttft_mae_pct']!s:>8}% -> {a['ttft_mae_pct']!s:>6}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", action="store_true",
                    help="the H200's value on every knob FITTED_HERE names, every run on its GPU type's usual "
                         "host, capped finite-rate runs as closed loops and re-sent prompts as new (before the "
                         "published runs taught them)")
    ap.add_argument("--file", action="append", type=Path, help="only these fixture files (repeatable)")
    ap.add_argument("--gpu", action="append", help="only these GPUs (repeatable)")
    ap.add_argument("--splits", action="store_true", help="print every run's split by the rule and stop")
    ap.add_argument("--runs", action="store_true", help="print every run's figures too")
    ap.add_argument("--compare", action="store_true",
                    help="before the fits on published runs and as committed, cell by cell (--json: both reports)")
    ap.add_argument("--fit", nargs=4, metavar=("GPU", "KNOB", "LOW", "HIGH"),
                    help="fit one knob for one GPU on its fit runs and print it")
    ap.add_argument("--breakdown", metavar="ID", help="one run's simulated step time by kind of kernel, and stop")
    ap.add_argument("--latency", metavar="PART",
                    help="real and simulated ITL, TPOT and TTFT percentiles of the runs whose id holds PART, and stop")
    ap.add_argument("--spread", action="store_true",
                    help="each sweep's real/simulated ratio around its median (the simulator screen's margin), and stop")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        runs = load_runs(args.file)
    except SpecError as exc:
        if args.splits:  # the one fault --splits is there to fix
            return _print_splits(args.file)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.splits:
        return _print_splits(args.file)
    runs = [r for r in runs if not args.gpu or r.gpu in args.gpu]
    if args.breakdown:
        return _print_breakdown(runs, args.breakdown)
    if args.latency:
        return _print_latency(runs, args.latency)
    if args.fit:
        gpu, knob, low, high = args.fit
        value = fit_knob(runs, gpu, knob, (float(low), float(high)))
        print(json.dumps({"gpu": gpu, knob: float(f"{value:.4g}"),
                          "fit_on": [r.id for r in runs if r.gpu == gpu and r.split == "fit"]}, indent=1))
        return 0
    if args.compare:
        both = {"before": _report(runs, before=True), "committed": _report(runs, before=False)}
        if args.json:
            print(json.dumps(both, indent=1))
        else:
            print(format_comparison(both["before"], both["committed"]))
        return 0
    report = _report(runs, before=args.before)
    if args.spread:
        print(f"calibration: {report['calibration']}\n{'GPU | layout':<28}{'runs':>5}{'max':>8}{'2nd':>8}  sweep")
        for row in report["ratio_spread"]:
            print(f"{row['gpu'] + ' | ' + row['layout']:<28}{row['runs']:>5}{row['max_pct']:>7.1f}%"
                  f"{row['second_pct']:>7.1f}%  {row['sweep']}")
        return 0
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    if args.runs:
        for row in report["runs"]:
            print(json.dumps(row))
    print(f"calibration: {report['calibration']}\n\nHELD OUT (the evidence):")
    print(format_cells(report["held_out"]))
    print("\nFIT (fitting data, not evidence):")
    print(format_cells(report["fit"]))
    return 0


def _print_breakdown(runs: Sequence[PublishedRun], run_id: str) -> int:
    """``--breakdown``: :func:`step_breakdown` of one run, a line per step, in milliseconds."""
    run = next((r for r in runs if r.id == run_id), None)
    if run is None:
        print(f"error: --breakdown: no run {run_id!r} (fix: use an id from --runs)", file=sys.stderr)
        return 2
    print(f"{run.id} ({run.gpu}, {run.layout_label}, vLLM {run.sim_vllm_version} rules): ms per step")
    for step, kinds in step_breakdown(run).items():
        print(f"  {step:<12}" + "  ".join(f"{k} {v:.3f}" for k, v in kinds.items()))
    return 0


#: The latency figures :func:`latency_pairs` pairs, each as ``vllm bench serve`` prints it.
LATENCY_FIGURES: tuple[tuple[str, str], ...] = (("itl_ms", "median"), ("itl_ms", "p99"), ("tpot_ms", "median"),
                                                 ("ttft_ms", "median"), ("ttft_ms", "p99"))


def latency_pairs(judged: Judged) -> dict[str, tuple[float | None, float | None]]:
    """(real, simulated) milliseconds of each of :data:`LATENCY_FIGURES` the run published, keyed
    ``"itl_ms median"`` and so on. In a burst the median inter-token gap is a decode step's and the p99 one a step
    that carries prefill chunks: the step times a run's own streams show, beside the throughput a KV pool or a
    front end can set (``published_runs.py --latency ID``).

    Example:
        >>> run = next(r for r in load_runs() if r.id == "h100-qwen3-235b-a22b-2507-tp8-rand128x4-burst1000")
        >>> real, sim = latency_pairs(judge(run))["itl_ms median"]
        >>> real, 0.8 < sim / real < 1.2
        (235.21, True)
    """
    out: dict[str, tuple[float | None, float | None]] = {}
    for figure, stat in LATENCY_FIGURES:
        real = (judged.run.measured.get(figure) or {}).get(stat)
        if real is None:
            continue
        sim = (judged.sim_latency or {}).get(figure, {}).get(stat)
        out[f"{figure} {stat}"] = (float(real), sim)
    return out


def _print_latency(runs: Sequence[PublishedRun], pattern: str) -> int:
    """``--latency``: :func:`latency_pairs` of every run whose id holds ``pattern``, a line each."""
    mine = [r for r in runs if pattern in r.id]
    if not mine:
        print(f"error: --latency: no run id holds {pattern!r} (fix: use part of an id from --runs)", file=sys.stderr)
        return 2
    for run in mine:
        pairs = latency_pairs(judge(run))
        cells = "  ".join(f"{k} {real:.1f}/{'-' if sim is None else f'{sim:.1f}'}" for k, (real, sim) in pairs.items())
        print(f"{run.id} ({run.split}): real/simulated ms  {cells}")
    return 0


def _print_splits(files: Sequence[Path] | None) -> int:
    """Each file's runs with the split the rule gives, read without the split check."""
    for path in sorted(files or FIXTURES.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        for i, e in enumerate(doc):
            e = {**e, "split": "fit"}
            doc[i] = _run(f"{path.name}[{i}]", e, path.name, path.parent)
        rule = split_of(doc)
        for r in doc:
            print(f"{path.name}\t{r.gpu}\t{r.id}\t{rule[r.id]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
