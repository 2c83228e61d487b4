"""Prometheus text parsing for vLLM's ``/metrics``: counters, gauges, deltas. Pure.

Names are accepted with and without the ``_total`` suffix, and across vLLM's renames
(``gpu_cache_usage_perc`` became ``kv_cache_usage_perc`` in 0.9.2). Samples with several label
sets (one per engine, one per finish reason) are summed.

Example:
    >>> text = 'vllm:num_preemptions_total{engine="0"} 31.0\\nvllm:kv_cache_usage_perc{engine="0"} 0.25\\n'
    >>> m = parse_prometheus(text)
    >>> counter(m, "vllm:num_preemptions"), gauge(m, "vllm:kv_cache_usage_perc")
    (31.0, 0.25)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

__all__ = ["Sample", "parse_prometheus", "counter", "gauge", "labels_of", "ALIASES"]

Sample = tuple[str, dict[str, str], float]

_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

#: Each canonical name, then the older names vLLM used for the same series.
ALIASES: dict[str, tuple[str, ...]] = {
    "vllm:kv_cache_usage_perc": ("vllm:gpu_cache_usage_perc",),
    "vllm:inter_token_latency_seconds": ("vllm:time_per_output_token_seconds",),
    "vllm:prefix_cache_queries": ("vllm:gpu_prefix_cache_queries",),
    "vllm:prefix_cache_hits": ("vllm:gpu_prefix_cache_hits",),
}


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Name -> list of (labels, value). Comments and malformed lines are skipped."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group("labels") or ""))
        out.setdefault(m.group("name"), []).append((labels, value))
    return out


def _candidates(name: str) -> list[str]:
    base = name[: -len("_total")] if name.endswith("_total") else name
    names = [base, *ALIASES.get(base, ())]
    return [n for b in names for n in (b + "_total", b)]


def counter(metrics: Mapping[str, list[tuple[dict[str, str], float]]], name: str,
            where: Mapping[str, str] | None = None) -> float | None:
    """Sum of a counter's samples (optionally only those whose labels match ``where``)."""
    for cand in _candidates(name):
        if cand in metrics:
            vals = [v for labels, v in metrics[cand]
                    if not math.isnan(v) and all(labels.get(k) == w for k, w in (where or {}).items())]
            return sum(vals)
    return None


def gauge(metrics: Mapping[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    """Sum of a gauge's samples over engines (one engine is the usual case)."""
    return counter(metrics, name)


def labels_of(metrics: Mapping[str, list[tuple[dict[str, str], float]]], name: str) -> dict[str, str] | None:
    """The labels of an info-style gauge such as ``vllm:cache_config_info``."""
    samples = metrics.get(name)
    return dict(samples[0][0]) if samples else None
