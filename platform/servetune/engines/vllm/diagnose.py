"""From a parsed vLLM log (and optionally a ``/metrics`` dump) to a diagnosis: status, cause, advice. Pure.

Contract: :func:`diagnose` takes a :class:`~servetune.engines.vllm.logs.ParsedLog`, its
:class:`~servetune.engines.vllm.logs.Classification` and the text of a Prometheus scrape, and returns a
:class:`Diagnosis` whose :meth:`Diagnosis.to_json` keys are fixed (``servetune diagnose --json``):
``status``, ``cause``, ``advice``, ``vllm_version``, ``max_model_len``, ``kv_cache_tokens``,
``num_gpu_blocks``, ``max_concurrency``, ``memory_gib`` {``weights``, ``activation_peak``,
``non_torch``, ``cudagraph``, ``kv_cache``}, ``timings_s`` {``weights_load``, ``torch_compile``,
``graph_capture``, ``engine_init``}, ``preemptions``. A figure the log does not show is ``null``;
``preemptions`` is ``null`` without a metrics file.

The advice follows the symptom-to-fix table vLLM users know (docs ``configuration/optimization``,
``conserving_memory``), made concrete with the log's own numbers.

Example:
    >>> from servetune.engines.vllm.logs import classify, parse_log
    >>> log = '''(APIServer pid=1) INFO 11-30 00:23:07 [model.py:1788] Using max model len 2048
    ... (EngineCore pid=2) INFO 11-30 00:23:47 [kv_cache_utils.py:2177] GPU KV cache size: 16,384 tokens
    ... (EngineCore pid=2) INFO 11-30 00:23:47 [kv_cache_utils.py:2178] Maximum concurrency for 2,048 tokens per request: 8.00x
    ... (APIServer pid=1) INFO:     Application startup complete.'''
    >>> d = diagnose(parse_log(log), classify(log, healthy=True), 'vllm:num_preemptions_total{engine="0"} 192.0')
    >>> d.status.value, d.preemptions, d.advice[0]
    ('ok', 192, 'KV cache holds 16,384 tokens = 8.0 sequences of 2,048.')
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from servetune.engines.vllm.metrics import counter, labels_of, parse_prometheus
from servetune.result import TrialStatus
from servetune.engines.vllm.logs import Classification, ParsedLog

__all__ = ["Diagnosis", "diagnose", "LOW_KV_USAGE"]

#: Below this KV-usage peak (0..1) with no preemption, the KV budget could serve more sequences.
LOW_KV_USAGE = 0.5


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """The verdict on one vLLM server run. ``evidence`` and ``infrastructure`` are for humans and the
    driver; they are not part of the JSON contract."""

    status: TrialStatus
    cause: str | None
    advice: tuple[str, ...]
    vllm_version: str | None
    max_model_len: int | None
    kv_cache_tokens: int | None
    num_gpu_blocks: int | None
    max_concurrency: float | None
    memory_gib: dict[str, float | None]
    timings_s: dict[str, float | None]
    preemptions: int | None
    evidence: tuple[str, ...] = ()
    infrastructure: bool = False

    def to_json(self) -> dict[str, Any]:
        """The JSON document of ``servetune diagnose --json``; the keys are a contract.

        Example:
            >>> from servetune.engines.vllm.logs import classify, parse_log
            >>> sorted(diagnose(parse_log(""), classify("", timed_out=True)).to_json())  # doctest: +NORMALIZE_WHITESPACE
            ['advice', 'cause', 'kv_cache_tokens', 'max_concurrency', 'max_model_len', 'memory_gib',
             'num_gpu_blocks', 'preemptions', 'status', 'timings_s', 'vllm_version']
        """
        return {
            "status": self.status.value,
            "cause": self.cause,
            "advice": list(self.advice),
            "vllm_version": self.vllm_version,
            "max_model_len": self.max_model_len,
            "kv_cache_tokens": self.kv_cache_tokens,
            "num_gpu_blocks": self.num_gpu_blocks,
            "max_concurrency": self.max_concurrency,
            "memory_gib": dict(self.memory_gib),
            "timings_s": dict(self.timings_s),
            "preemptions": self.preemptions,
        }


@dataclasses.dataclass(frozen=True)
class _Facts:
    """Everything the advice rules read, from the log first and the metrics second."""

    p: ParsedLog
    c: Classification
    preemptions: int | None
    num_gpu_blocks: int | None
    util: float | None
    max_num_seqs: int | None
    kv_usage_peak: float | None

    def arg(self, name: str) -> Any:
        return (self.p.non_default_args or {}).get(name)


def diagnose(parsed: ParsedLog, classification: Classification, metrics_text: str | None = None) -> Diagnosis:
    """The diagnosis of one run: the classification, the figures, and what to change.

    Example:
        >>> from servetune.engines.vllm.logs import classify, parse_log
        >>> log = "(EngineCore pid=9) ERROR 11-30 01:33:51 [core.py:1330] ValueError: No available memory for the cache blocks."
        >>> d = diagnose(parse_log(log), classify(log, exit_code=1))
        >>> d.status.value, "gpu_memory_utilization" in d.advice[0], d.preemptions
        ('startup_oom', True, None)
    """
    metrics = parse_prometheus(metrics_text) if metrics_text else None
    preemptions = None
    blocks = parsed.num_gpu_blocks
    util = parsed.gpu_memory_utilization
    if metrics is not None:
        value = counter(metrics, "vllm:num_preemptions")
        preemptions = int(value) if value is not None else None
        info = labels_of(metrics, "vllm:cache_config_info") or {}
        if (blocks is None or parsed.num_gpu_blocks_derived) and info.get("num_gpu_blocks", "").isdigit():
            blocks = int(info["num_gpu_blocks"])  # printed by vLLM beats derived from the KV tokens
        if util is None and _is_float(info.get("gpu_memory_utilization")):
            util = float(info["gpu_memory_utilization"])
    seqs = (parsed.non_default_args or {}).get("max_num_seqs")
    facts = _Facts(parsed, classification, preemptions, blocks, util,
                   seqs if isinstance(seqs, int) else None, parsed.stats_kv_usage_peak)
    return Diagnosis(
        status=classification.status,
        cause=classification.cause,
        advice=tuple(_advice(facts)),
        vllm_version=parsed.vllm_version,
        max_model_len=parsed.max_model_len,
        kv_cache_tokens=parsed.kv_cache_tokens,
        num_gpu_blocks=blocks,
        max_concurrency=parsed.max_concurrency,
        memory_gib={"weights": parsed.weights_gib, "activation_peak": parsed.activation_peak_gib,
                    "non_torch": parsed.non_torch_gib, "cudagraph": parsed.cudagraph_gib,
                    "kv_cache": parsed.available_kv_gib},
        timings_s=parsed.timings_s(),
        preemptions=preemptions,
        evidence=tuple(classification.evidence),
        infrastructure=classification.infrastructure,
    )


def _is_float(text: str | None) -> bool:
    try:
        float(text or "")
    except ValueError:
        return False
    return True


def _g(x: float) -> str:
    """GiB as vLLM prints them: 0.52, 67.64."""
    return f"{x:,.2f}"


def _conc(x: float) -> str:
    """A concurrency as vLLM prints it (``%.2f``), one trailing zero dropped: 8.0, 30.45, 270.57."""
    text = f"{x:,.2f}"
    return text[:-1] if text.endswith("0") else text


def _capacity(p: ParsedLog) -> str | None:
    """"KV cache holds 16,384 tokens = 8.0 sequences of 2,048."""
    if p.kv_cache_tokens is None:
        return None
    text = f"KV cache holds {p.kv_cache_tokens:,} tokens"
    length = p.max_concurrency_tokens or p.max_model_len
    if p.max_concurrency is not None and length:
        text += f" = {_conc(p.max_concurrency)} sequences of {length:,}"
    return text + "."


# ================================================================================== advice
def _advice(f: _Facts) -> list[str]:
    status = f.c.status
    if f.c.infrastructure:
        return _infrastructure(f)
    rules = {
        TrialStatus.STARTUP_OOM: _startup_oom,
        TrialStatus.KV_TOO_SMALL: _kv_too_small,
        TrialStatus.CUDAGRAPH_OOM: _cudagraph_oom,
        TrialStatus.RUNTIME_OOM: _runtime_oom,
        TrialStatus.CRASHED: _crashed,
        TrialStatus.TIMEOUT: _timeout,
        TrialStatus.INVALID_CONFIG: _invalid_config,
        TrialStatus.INCOMPLETE: _incomplete,
        TrialStatus.OK: _serving,
    }
    return rules.get(status, lambda _: [])(f)


def _util_text(f: _Facts) -> str:
    return f" (now {f.util})" if f.util is not None else ""


def _weights_too_large(f: _Facts) -> str | None:
    p = f.p
    tp = p.tensor_parallel_size or 1
    if p.weights_gib is None or p.requested_gib is None or p.weights_gib < 0.8 * p.requested_gib:
        return None
    return (f"The weights take {_g(p.weights_gib)} GiB per GPU of a {_g(p.requested_gib)} GiB budget: shard them with "
            f"tensor_parallel_size={2 * tp} (or pipeline_parallel_size=2), or serve a quantized checkpoint "
            "(fp8 halves the weight bytes, AWQ/GPTQ int4 quarters them).")


def _startup_oom(f: _Facts) -> list[str]:
    p, cause = f.p, f.c.cause or ""
    out: list[str] = []
    if "loading the weights" in cause or "Failed to load model" in cause:
        tp = p.tensor_parallel_size or 1
        out.append(f"The weights do not fit on one GPU{f' at tensor_parallel_size={tp}' if tp > 1 else ''}: use "
                   f"tensor_parallel_size={2 * tp} or pipeline_parallel_size=2 to split them, or a quantized checkpoint "
                   "(fp8 halves the weight bytes, AWQ/GPTQ int4 quarters them).")
        out.append("Make sure no other process holds memory on the GPU (nvidia-smi) before the load.")
        return out
    non_kv = [x for x in (p.weights_gib, p.activation_peak_gib, p.non_torch_gib) if x is not None]
    used = f"the weights ({_g(p.weights_gib)} GiB)" if p.weights_gib is not None else "the model"
    if p.available_kv_gib is not None and p.available_kv_gib <= 0:
        short = -p.available_kv_gib
        text = (f"Raise gpu_memory_utilization{_util_text(f)}: after {used} and the profile run the KV cache budget came "
                f"out at {_g(p.available_kv_gib)} GiB, so the budget must grow by more than {_g(short)} GiB plus the "
                "KV cache you want")
        if p.total_gpu_gib:
            need = (p.requested_gib or (f.util or 0) * p.total_gpu_gib) + short
            text += (f"; on this {_g(p.total_gpu_gib)} GiB GPU that is gpu_memory_utilization > "
                     f"{math.ceil(need / p.total_gpu_gib * 100) / 100:.2f}")
        out.append(text + ".")
    else:
        out.append(f"Raise gpu_memory_utilization{_util_text(f)}: the profile run did not leave memory for the KV cache"
                   + (f" (weights + activations + non-torch = {_g(sum(non_kv))} GiB)." if non_kv else "."))
    if "profiling" in cause or p.activation_peak_gib is not None or p.max_num_batched_tokens is not None:
        mbt = f" (now {p.max_num_batched_tokens:,})" if p.max_num_batched_tokens else ""
        peak = f", {_g(p.activation_peak_gib)} GiB here" if p.activation_peak_gib is not None else ""
        out.append(f"Or lower max_num_batched_tokens{mbt}: the profile run's activation peak grows with it{peak}.")
    if p.max_model_len:
        out.append(f"Then size max_model_len (now {p.max_model_len:,}) to what the workload needs: every running "
                   "sequence may grow to it, so a smaller value needs less KV cache per sequence.")
    if (w := _weights_too_large(f)):
        out.append(w)
    return out


def _kv_too_small(f: _Facts) -> list[str]:
    p = f.p
    out: list[str] = []
    now = f" (now {p.max_model_len:,})" if p.max_model_len else ""
    if p.estimated_max_model_len is not None:
        out.append(f"Lower max_model_len{now} to at most {p.estimated_max_model_len:,}: vLLM estimated that the "
                   "longest sequence the KV cache can hold.")
    else:
        out.append(f"Lower max_model_len{now}: one sequence of that length does not fit the KV cache.")
    need = (f": one {p.max_model_len:,}-token sequence needs {_g(p.kv_needed_gib)} GiB of KV cache and "
            f"{_g(p.available_kv_gib)} GiB was left") if (p.kv_needed_gib is not None and p.available_kv_gib is not None
                                                          and p.max_model_len) else ""
    out.append(f"Or raise gpu_memory_utilization{_util_text(f)}{need}.")
    if (p.kv_cache_dtype or "auto") in ("auto", "bfloat16", "float16"):
        more = (f" (about {2 * p.estimated_max_model_len:,} tokens would fit)"
                if p.estimated_max_model_len is not None else "")
        out.append(f"Or set kv_cache_dtype=fp8: it halves the KV bytes per token{more}.")
    out.append("Or shard the KV heads over more GPUs with tensor_parallel_size (each GPU then stores fewer heads).")
    if (w := _weights_too_large(f)):
        out.append(w)
    return out


def _cudagraph_oom(f: _Facts) -> list[str]:
    p, cause = f.p, f.c.cause or ""
    out: list[str] = []
    if "warming up sampler" in cause or "warming up pooler" in cause:
        seqs = f" (now {f.max_num_seqs})" if f.max_num_seqs else ""
        out.append(f"Lower max_num_seqs{seqs}: the sampler warm-up after graph capture runs that many dummy requests.")
    largest = p.max_cudagraph_capture_size
    if largest:
        sizes = f", {p.num_cudagraph_capture_sizes} sizes" if p.num_cudagraph_capture_sizes else ""
        out.append(f"Shrink the CUDA graph capture sizes: max_cudagraph_capture_size={max(1, largest // 2)} (now "
                   f"{largest}{sizes}), or a shorter cudagraph_capture_sizes list; the default list goes up to "
                   "2 x max_num_seqs, so lowering max_num_seqs shrinks it too.")
    else:
        out.append("Shrink the CUDA graph capture sizes (max_cudagraph_capture_size, cudagraph_capture_sizes), or "
                   "lower max_num_seqs: the default list goes up to 2 x max_num_seqs.")
    out.append("Or set enforce_eager=true: no CUDA graphs (and no torch.compile); decode at small batch sizes gets slower.")
    out.append(f"Or lower gpu_memory_utilization{_util_text(f)}: the graphs are captured after the KV cache is "
               "allocated, in the memory the budget leaves free.")
    return out


def _runtime_oom(f: _Facts) -> list[str]:
    p = f.p
    mbt = f" (now {p.max_num_batched_tokens:,})" if p.max_num_batched_tokens else ""
    seqs = f" (now {f.max_num_seqs})" if f.max_num_seqs else ""
    return [f"Lower gpu_memory_utilization{_util_text(f)}: the server ran out of memory while serving, so leave more "
            "headroom outside vLLM's budget for allocations made during inference.",
            f"Or lower max_num_batched_tokens{mbt} and max_num_seqs{seqs}: larger batches allocate more at run time."]


_MISSING_MODULE_RE = re.compile(r"No module named '([\w.]+)'")


def _crashed(f: _Facts) -> list[str]:
    cause = f.c.cause or "unknown"
    out = [f"The engine died with: {cause}"]
    if (m := _MISSING_MODULE_RE.search(cause)):
        mod = m.group(1).split(".")[0]
        out.append(f"Install the missing package '{mod}' in the serving environment (pip install {mod}), or select "
                   "an attention backend / sampler that does not need it.")
    elif "illegal memory access" in cause or "CUDA error" in cause:
        out.append("A CUDA kernel fault: retry with enforce_eager=true to rule out CUDA graphs and torch.compile; if it "
                   "persists, report it to vLLM with the flags and the traceback.")
    elif "SIGKILL" in cause:
        out.append("Check the host's RAM (dmesg for the OOM killer): loading weights and compiling use CPU memory.")
    else:
        out.append("Read the traceback in the evidence (the root cause is above 'Engine core initialization failed');"
                   " if it names a flag, change that flag.")
    return out


def _timeout(f: _Facts) -> list[str]:
    p, cause = f.p, f.c.cause or ""
    if "stalled" in cause:
        return ["The server stopped making progress after it became healthy: check the engine process for a hang "
                "(py-spy dump), and lower max_num_seqs / max_num_batched_tokens if the steps had become very long."]
    spent = []
    if p.torch_compile_s is not None:
        spent.append(f"torch.compile took {p.torch_compile_s:.1f} s")
    if p.graph_capture_s is not None:
        spent.append(f"graph capture {p.graph_capture_s:.0f} s")
    extra = f" ({', '.join(spent)})" if spent else ""
    return [f"Raise the startup timeout: the first start of a configuration compiles and captures CUDA graphs{extra}, "
            "and a fresh host has a cold compile cache.",
            "If the log stops at the same stage every time, that stage hangs: look for NCCL or download waits there."]


def _incomplete(f: _Facts) -> list[str]:
    p = f.p
    out = ["The log stops before the server was ready and shows no error. If the server is still starting, "
           "diagnose the whole log once it prints 'Application startup complete.' (or an error)."]
    if p.graph_capture_s is None and (p.available_kv_gib is not None or p.num_gpu_blocks is not None):
        out.append("It got as far as sizing the KV cache"
                   + (f" ({p.num_gpu_blocks:,} blocks)" if p.num_gpu_blocks is not None else "")
                   + ": the next stages are CUDA graph capture and the API server's start.")
    out.append("If the process is gone, something outside vLLM ended it without a trace: check the host's RAM "
               "(dmesg for the OOM killer), your launcher's own timeout, or whether the log was cut when copied.")
    return out


def _invalid_config(f: _Facts) -> list[str]:
    cause = f.c.cause or ""
    out = [f"vLLM refused the configuration: {cause}"]
    version = f" {f.p.vllm_version}" if f.p.vllm_version else ""
    if "unrecognized arguments" in cause:
        flags = cause.split("unrecognized arguments:", 1)[1].strip()
        out.append(f"This vLLM{version} does not know {flags}: remove it or use the name this version uses "
                   "(`vllm serve --help=all`); --swap-space, for one, was removed by 0.18.")
    elif "divisible by tensor parallel size" in cause or "is not divisible by" in cause:
        out.append("Choose a tensor_parallel_size that divides the model's attention heads and KV heads.")
    elif "must be greater than or equal to max_num_seqs" in cause:
        out.append("Set max_num_batched_tokens >= max_num_seqs (or lower max_num_seqs).")
    elif "User-specified max_model_len" in cause:
        out.append("Lower max_model_len to the model's own limit (its config.json), or set "
                   "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 only if the model really handles longer sequences.")
    elif "validation error" in cause:
        out.append("A flag value is out of range: the evidence names the field and the allowed range.")
    else:
        out.append("Change the flag the message names; `servetune plan` checks a flag set before launching.")
    return out


def _infrastructure(f: _Facts) -> list[str]:
    p, cause = f.p, f.c.cause or ""
    out: list[str] = []
    if "Free memory on device" in cause:
        free, total = p.free_at_start_gib, p.total_gpu_gib
        if free is not None and total:
            out.append(f"Another process holds GPU memory: only {_g(free)} of {_g(total)} GiB was free at startup, "
                       f"less than the {_g(p.requested_gib or 0)} GiB gpu_memory_utilization={f.util} asks for. Find it "
                       "with nvidia-smi (often an earlier vLLM that did not exit) and free the GPU.")
            cap = math.floor((free - 0.5) / total * 100) / 100
            out.append(f"Or lower gpu_memory_utilization to at most {cap:.2f} to fit in what is free.")
        else:
            out.append("Another process holds GPU memory: find it with nvidia-smi and free the GPU, or lower "
                       "gpu_memory_utilization.")
    elif "port in use" in cause:
        out.append("Another server listens on the port: stop it or launch on a free port.")
    elif "profiling" in cause:
        out.append("Another process allocated or released GPU memory while vLLM profiled: run vLLM alone on its GPU.")
    else:
        out.append("The GPU is not usable from this process: check nvidia-smi, CUDA_VISIBLE_DEVICES and the driver.")
    out.append("This is an infrastructure failure, not the configuration's: retry the trial on another GPU and do not "
               "count it against the flags.")
    return out


def _serving(f: _Facts) -> list[str]:
    p = f.p
    out: list[str] = []
    if (cap := _capacity(p)):
        out.append(cap)
    seqs = f" (now {f.max_num_seqs})" if f.max_num_seqs else ""
    # The metrics counter, else the stats lines' "Preemptions: N" (0.13+; the interval counts summed).
    preemptions = f.preemptions if f.preemptions is not None else p.stats_preemptions
    if preemptions:
        source = "" if f.preemptions is not None else " logged"
        text = f"{preemptions:,} preemptions{source}: the KV cache ran out"
        if p.max_concurrency is not None and f.max_num_seqs:
            text += (f" (it holds {_conc(p.max_concurrency)} sequences of {p.max_concurrency_tokens or p.max_model_len:,}"
                     f" and max_num_seqs is {f.max_num_seqs})")
        out.append(text + f". Lower max_num_seqs{seqs}, then max_num_batched_tokens, or raise "
                   f"gpu_memory_utilization{_util_text(f)} for a larger KV cache.")
        if p.num_gpu_blocks_override is not None:
            computed = f" (profiling found room for {p.computed_gpu_blocks:,})" if p.computed_gpu_blocks else ""
            out.append(f"num_gpu_blocks_override={p.num_gpu_blocks_override:,} caps the KV cache{computed}: remove it.")
        if (p.kv_cache_dtype or "auto") in ("auto", "bfloat16", "float16"):
            out.append("kv_cache_dtype=fp8 halves the KV bytes per token, doubling the tokens the cache holds.")
    no_preempt = f.preemptions == 0 or (f.preemptions is None and not p.stats_preemptions)
    if no_preempt and f.kv_usage_peak is not None and f.kv_usage_peak < LOW_KV_USAGE:
        running = ""
        if p.stats_running_peak is not None:
            running = f" with at most {p.stats_running_peak} requests running"
        out.append(f"KV cache usage peaked at {f.kv_usage_peak * 100:.1f}%{running} and no preemption"
                   + ("" if f.preemptions == 0 else " was logged")
                   + f": the budget could serve more sequences: raise max_num_seqs{seqs}, or lower "
                   f"gpu_memory_utilization{_util_text(f)} to give the memory back.")
    if len(out) <= 1:
        out.append("No problem found in the log" + ("" if f.preemptions is not None else
                                                    " (pass --metrics to check preemptions)") + ".")
    return out
