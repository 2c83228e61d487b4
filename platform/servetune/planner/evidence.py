"""The planner judged on vLLM startups that people published: fit on some, report the error on the others.

Pure functions over the parsed fixture index (``tests/fixtures/published_logs/index.yaml``), and
one that reads it (:func:`load_index`, the only I/O here, as ``modelinfo.load_model`` is there):
:func:`parse_index` turns it into typed
:class:`PublishedStart` records, :func:`judge` runs the planner on one start exactly as ``plan``
would (same :func:`~servetune.planner.memory.resolve_engine_config` and
:func:`~servetune.planner.memory.plan_memory`), :func:`fit_constants` recomputes the constants
that were fitted on the ``fit`` starts, and :func:`summarize` reports the held-out error by GPU
and by parallel layout. ``benchmarks/published_logs.py`` prints the report; the planner tests
check the fitted constants and the held-out targets.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from servetune.errors import SpecError
from servetune.planner._kv_layout import kv_layout
from servetune.planner.comm import SERVETUNE_LAUNCH_ENV, VLLM_DEFAULT_ENV, CommEnv
from servetune.planner.engine_config import resolve_engine_config
from servetune.planner.gpus import get_gpu, under_wddm, with_interconnect
from servetune.planner.memory import plan_memory
from servetune.planner.model_memory import ACT_FIXED_GIB
from servetune.planner.modelinfo import ModelProfile, load_model

__all__ = ["PublishedStart", "Judgement", "parse_index", "load_index", "judge", "fit_constants", "summarize",
           "class_table", "fit_class_constants", "ROLES"]

GiB = 1 << 30
ROLES = ("fit", "held_out")


@dataclasses.dataclass(frozen=True)
class PublishedStart:
    """One published vLLM start: what it ran and what vLLM logged (GiB per GPU, as printed)."""

    id: str
    source: str
    model: str  # a shipped name or a path relative to the index
    gpu: str
    vllm: str
    flags: Mapping[str, Any]
    logged: Mapping[str, Any]
    role: str
    environment: str  # "multicast_off", "multicast_on", "default" (vLLM's and NCCL's defaults) or "wsl"
    log: str | None = None  # the published lines, verbatim, relative to the index (where the source has them)
    #: How the start's GPUs were linked where the source says so (gpus.INTERCONNECTS, e.g. "pcie-no-p2p"
    #: for "Custom allreduce is disabled because your platform lacks GPU P2P capability"); "" the part's own.
    interconnect: str = ""
    #: FlashInfer imports where the start ran (``EngineConfig.flashinfer_available``): the start's own sampler line
    #: decides (:func:`sampler_line_flashinfer`), else the entry's ``flashinfer:``, else its source's
    #: ``flashinfer:`` (a publisher's image whose install is known, with its ``flashinfer_source``); None where none
    #: says (the planner's per-version default).
    flashinfer: bool | None = None
    kind: str = "dense"  # the model class (classes.yaml's ``class:``): moe, mxfp4, fp8, sliding_window, mla, ...

    @property
    def layout(self) -> str:
        tp = int(self.flags.get("tensor_parallel_size", 1))
        pp = int(self.flags.get("pipeline_parallel_size", 1))
        dp = int(self.flags.get("data_parallel_size", 1))
        return f"TP={tp}" + (f" PP={pp}" if pp > 1 else "") + (f" DP={dp}" if dp > 1 else "")

    @property
    def failed(self) -> bool:
        return self.logged.get("status") == "failed"


@dataclasses.dataclass(frozen=True)
class Judgement:
    """The planner's prediction for one start next to what vLLM logged."""

    start: PublishedStart
    fits: bool
    failure: str | None
    kv_cache_gib: float  # predicted available KV memory per GPU
    kv_tokens: int  # predicted
    logged_kv_tokens: int | None  # from the logged available memory (blocks x block size); None for a failure
    weights_gib: float
    activation_gib: float
    non_torch_gib: float
    cause: str | None = None  # the planner's failure text (vLLM's own where it has one); None when it fits

    @property
    def kv_error(self) -> float | None:
        """Relative KV-capacity error (predicted / logged - 1); None where vLLM did not start."""
        if self.logged_kv_tokens in (None, 0) or not self.fits:
            return None
        return self.kv_tokens / self.logged_kv_tokens - 1

    @property
    def failure_foreseen(self) -> bool | None:
        """For a start vLLM refused: did the planner refuse it too? None for a healthy start."""
        return (not self.fits) if self.start.failed else None


#: vLLM's sampler lines, 0.10.0-0.11.0 (``v1/sample/ops/topk_topp_sampler.py:55-70@0.11.0``): FlashInfer's top-k/top-p
#: taken, or not importable. From 0.11.1 the second is gone and the first means ``VLLM_USE_FLASHINFER_SAMPLER=1``.
SAMPLER_LINE_FLASHINFER = "Using FlashInfer for top-p & top-k sampling"
SAMPLER_LINE_NO_FLASHINFER = "FlashInfer is not available"


def sampler_line_flashinfer(text: str) -> bool | None:
    """Whether a vLLM startup log says FlashInfer imports, by its sampler line: True for "Using FlashInfer for top-p &
    top-k sampling", False for "FlashInfer is not available", None where it prints neither.

    Example:
        >>> sampler_line_flashinfer("WARNING ... FlashInfer is not available. Falling back to the PyTorch-native ...")
        False
        >>> sampler_line_flashinfer("INFO ... Using FlashInfer for top-p & top-k sampling."), sampler_line_flashinfer("")
        (True, None)
    """
    if SAMPLER_LINE_NO_FLASHINFER in text:
        return False
    return True if SAMPLER_LINE_FLASHINFER in text else None


def _stated_flashinfer(raw: Mapping[str, Any], source: Mapping[str, Any], folder: Path | None,
                       log: str | None) -> bool | None:
    """:attr:`PublishedStart.flashinfer`: the log's sampler line (where ``folder`` is given and the log is there), else
    the entry's ``flashinfer``, else the source's, else None."""
    if folder is not None and log is not None and (folder / log).is_file():
        said = sampler_line_flashinfer((folder / log).read_text(encoding="utf-8", errors="replace"))
        if said is not None:
            return said
    for where in (raw, source):
        if where.get("flashinfer") is not None:
            return bool(where["flashinfer"])
    return None


def parse_index(doc: Mapping[str, Any], folder: Path | None = None) -> list[PublishedStart]:
    """Typed starts from the parsed ``index.yaml``; SpecError naming the entry for a malformed one. ``folder``: the
    index's folder, whose logs' sampler lines then decide :attr:`PublishedStart.flashinfer`."""
    sources = doc.get("sources") or {}
    out = []
    for i, raw in enumerate(doc.get("starts") or []):
        field = f"starts[{i}]"
        if not isinstance(raw, Mapping):
            raise SpecError(field, f"expected a mapping, got {raw!r}", "write id: ..., model: ...")
        for key in ("id", "source", "model", "gpu", "vllm", "flags", "logged", "role"):
            if key not in raw:
                raise SpecError(f"{field}.{key}", "missing", f"add {key}")
        if raw["source"] not in sources:
            raise SpecError(f"{field}.source", f"unknown source {raw['source']!r}", "add it under sources:")
        if raw["role"] not in ROLES:
            raise SpecError(f"{field}.role", f"expected one of {ROLES}, got {raw['role']!r}", "fit or held_out")
        env = str((sources[raw["source"]] or {}).get("planner_environment", "default"))
        if env not in ("default", "multicast_off", "multicast_on", "wsl"):
            raise SpecError(f"sources.{raw['source']}.planner_environment", f"unknown environment {env!r}",
                            "default, multicast_off, multicast_on or wsl")
        log = raw.get("log")
        if log is not None and (not isinstance(log, str) or Path(log).is_absolute() or ".." in Path(log).parts):
            raise SpecError(f"{field}.log", f"expected a path inside the fixture folder, got {log!r}",
                            "write e.g. logs/<id>.log")
        out.append(PublishedStart(id=str(raw["id"]), source=str(raw["source"]), model=str(raw["model"]),
                                  gpu=str(raw["gpu"]), vllm=str(raw["vllm"]), flags=dict(raw["flags"]),
                                  logged=dict(raw["logged"]), role=str(raw["role"]), environment=env,
                                  log=log, interconnect=str(raw.get("interconnect", "")),
                                  flashinfer=_stated_flashinfer(raw, sources[raw["source"]] or {}, folder, log),
                                  kind=str(raw.get("class", "dense"))))
    ids = [s.id for s in out]
    if len(set(ids)) != len(ids):
        raise SpecError("starts", "duplicate ids", "give every start its own id")
    return out


def load_index(path: str | os.PathLike[str]) -> tuple[list[PublishedStart], dict[str, ModelProfile]]:
    """``(starts, model profile by start id)`` from an index file; model paths are relative to it."""
    index = Path(path)
    starts = parse_index(yaml.safe_load(index.read_text(encoding="utf-8")), index.parent)
    models = {s.id: load_model(s.model if "/" not in s.model else str(index.parent / s.model)) for s in starts}
    return starts, models


def _env(name: str) -> CommEnv:
    return {"multicast_off": SERVETUNE_LAUNCH_ENV.with_nvls(False), "multicast_on": VLLM_DEFAULT_ENV,
            "default": VLLM_DEFAULT_ENV, "wsl": VLLM_DEFAULT_ENV}[name]


def judge(start: PublishedStart, model: ModelProfile) -> Judgement:
    """Plan one published start the way ``servetune plan`` would, and set it beside the log."""
    gpu = get_gpu(start.gpu)
    if start.environment == "wsl":  # Windows' WDDM driver: torch sees the whole framebuffer
        gpu = under_wddm(gpu)
    gpu = with_interconnect(gpu, start.interconnect or None, field=f"starts.{start.id}.interconnect")
    config = resolve_engine_config(start.flags, model, gpu, start.vllm)
    config = dataclasses.replace(config, flashinfer_available=start.flashinfer)
    plan = plan_memory(model, gpu, config, env=_env(start.environment))
    logged_tokens = None
    if not start.failed and "kv_tokens" in start.logged:  # the logged "GPU KV cache size" itself
        logged_tokens = int(start.logged["kv_tokens"])
    elif not start.failed and "kv_cache" in start.logged:
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        stage = max(range(pp), key=lambda s: model.stage_layers(pp)[s])
        layout = kv_layout(model, tp, stage, pp, config.block_size, model.kv_dtype_bytes(config.kv_cache_dtype))
        logged_tokens = layout.tokens(int(float(start.logged["kv_cache"]) * GiB // layout.block_bytes),
                                      config.block_size)
    return Judgement(start=start, fits=plan.fits, failure=plan.failure.value if plan.failure else None,
                     kv_cache_gib=plan.memory.kv_cache, kv_tokens=plan.kv_cache_tokens,
                     logged_kv_tokens=logged_tokens, weights_gib=plan.memory.weights,
                     activation_gib=plan.memory.activation_peak,
                     non_torch_gib=plan.memory.non_torch, cause=plan.cause or None)


def fit_constants(starts: list[PublishedStart], models: Mapping[str, ModelProfile]) -> dict[str, float]:
    """The constants fitted on the ``fit`` starts, computed afresh from their logged figures.

    ``SAMPLER_BYTES_PER_LOGIT_V1``: (logged peak - ACT_FIXED_GIB) / (rows x vocab) over the TP=1
    fit starts whose sampler peak exceeds their forward peak, mean. ``NON_TORCH_GIB_SINGLE_V1``:
    mean logged non-torch of the TP=1 fit starts. ``NON_TORCH_GIB_MULTI_V1``: mean of the TP >= 2
    fit starts.
    """
    fit = [s for s in starts if s.role == "fit" and not s.failed]
    per_logit, single, multi = [], [], []
    for s in fit:
        model = models[s.id]
        gpu = get_gpu(s.gpu)
        config = resolve_engine_config(s.flags, model, gpu, s.vllm)
        rows = min(config.max_num_batched_tokens, config.max_num_seqs)
        if config.tensor_parallel_size == 1:
            per_logit.append((float(s.logged["activation_peak"]) - ACT_FIXED_GIB) * GiB / (rows * model.vocab_size))
            single.append(float(s.logged["non_torch"]))
        else:
            multi.append(float(s.logged["non_torch"]))
    out: dict[str, float] = {}
    if per_logit:
        out["SAMPLER_BYTES_PER_LOGIT_V1"] = round(statistics.mean(per_logit), 2)
    if single:
        out["NON_TORCH_GIB_SINGLE_V1"] = round(statistics.mean(single), 2)
    if multi:
        out["NON_TORCH_GIB_MULTI_V1"] = round(statistics.mean(multi), 2)
    return out


def summarize(judgements: list[Judgement], role: str = "held_out") -> dict[str, Any]:
    """Error by GPU, by layout and by vLLM version over the starts of one role; the share within 2%; failures foreseen."""
    js = [j for j in judgements if j.start.role == role]
    healthy = [j for j in js if not j.start.failed]
    failed = [j for j in js if j.start.failed]

    def group(key: str) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for j in healthy:
            k = {"gpu": j.start.gpu, "layout": j.start.layout, "vllm": j.start.vllm}[key]
            errs = out.setdefault(k, {"n": 0, "errors": []})
            errs["n"] += 1
            if j.kv_error is not None:
                errs["errors"].append(round(100 * j.kv_error, 2))
        return out

    errors = [j.kv_error for j in healthy if j.kv_error is not None]
    return {
        "role": role,
        "starts": len(js),
        "healthy": len(healthy),
        "healthy_called_fit": sum(1 for j in healthy if j.fits),
        "within_2pct": sum(1 for e in errors if abs(e) <= 0.02),
        "kv_errors_pct": [round(100 * e, 2) for e in errors],
        "failed": len(failed),
        "failed_foreseen": sum(1 for j in failed if j.failure_foreseen),
        "refused_called_fit": [j.start.id for j in failed if j.fits],
        "by_gpu": group("gpu"),
        "by_layout": group("layout"),
        "by_vllm": group("vllm"),
    }


def class_table(judgements: list[Judgement], role: str = "held_out") -> dict[str, Any]:
    """The KV error by model class, GPU and layout over the starts of one role (classes.yaml's report).

    ``rows``: one per (class, GPU, layout) with the healthy starts' KV errors and the failed starts'
    verdicts; ``within_3pct``: healthy starts within 3% of the logged KV tokens; ``failed_foreseen``.
    """
    js = [j for j in judgements if j.start.role == role]
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for j in js:
        row = rows.setdefault((j.start.kind, j.start.gpu, j.start.layout),
                              {"class": j.start.kind, "gpu": j.start.gpu, "layout": j.start.layout, "n": 0,
                               "kv_errors_pct": [], "failed": 0, "failed_foreseen": 0})
        row["n"] += 1
        if j.start.failed:
            row["failed"] += 1
            row["failed_foreseen"] += int(bool(j.failure_foreseen))
        elif j.kv_error is not None:
            row["kv_errors_pct"].append(round(100 * j.kv_error, 2))
    errors = [e for r in rows.values() for e in r["kv_errors_pct"]]
    healthy = [j for j in js if not j.start.failed]
    return {"role": role, "starts": len(js), "healthy": len(healthy),
            "healthy_called_fit": sum(1 for j in healthy if j.fits),
            "within_3pct": sum(1 for e in errors if abs(e) <= 3.0), "judged": len(errors),
            "failed": sum(r["failed"] for r in rows.values()),
            "failed_foreseen": sum(r["failed_foreseen"] for r in rows.values()),
            "rows": [rows[k] for k in sorted(rows)]}


def fit_class_constants(starts: list[PublishedStart], models: Mapping[str, ModelProfile]) -> dict[str, float]:
    """The model-class constants fitted on classes.yaml's ``fit`` starts, computed afresh from their logs.

    ``MXFP4_LAYER_BYTES``: (logged weights - the planned weights without that term) / MoE layers on the
    stage, over the MXFP4 fit starts, mean, to 10 kB. ``MULTIMODAL_PROFILE_ELEMS_PER_TOKEN``: (logged
    torch peak - the planned peak without a vision tower) / (batched tokens x hidden x dtype bytes) over
    the fit starts of models with a vision tower, mean, to 0.01.
    """
    from servetune.planner import _moe_experts
    from servetune.planner.model_memory import activation_peak_bytes
    layer, mm = [], []
    for s in (s for s in starts if s.role == "fit"):
        model = models[s.id]
        config = resolve_engine_config(s.flags, model, get_gpu(s.gpu), s.vllm)
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if model.quantized_experts_only and "weights" in s.logged:
            layers = max(model.stage_layers(pp))
            bare = model.weight_bytes_per_gpu(tp, pp) - layers * _moe_experts.MXFP4_LAYER_BYTES
            layer.append((float(s.logged["weights"]) * GiB - bare) / layers)
        if model.vision_params and "activation_peak" in s.logged:
            bare = activation_peak_bytes(dataclasses.replace(model, vision_params=0), config)
            per = config.max_num_batched_tokens * model.hidden_size * model.dtype_bytes
            mm.append((float(s.logged["activation_peak"]) * GiB - bare) / per)
    out: dict[str, float] = {}
    if layer:
        out["MXFP4_LAYER_BYTES"] = round(statistics.mean(layer), -4)
    if mm:
        out["MULTIMODAL_PROFILE_ELEMS_PER_TOKEN"] = round(statistics.mean(mm), 2)
    return out
