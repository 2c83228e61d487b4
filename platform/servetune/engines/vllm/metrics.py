"""Prometheus text parsing for vLLM's ``/metrics``: counters, gauges, deltas. Pure.

The text goes through ``prometheus_client``'s own parser (the library vLLM exposes its metrics
with), so label values are unescaped as the format says (``\\"``, ``\\\\``, ``\\n``) and a sample
line that carries an exemplar (``... 3 # {trace_id="abc"} 0.5``) keeps its value. A line that
parser refuses is skipped, with the rest of the text still read.

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
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Sample", "parse_prometheus", "counter", "gauge", "labels_of", "ALIASES"]

Sample = tuple[str, dict[str, str], float]

#: Each canonical name, then the older names vLLM used for the same series.
ALIASES: dict[str, tuple[str, ...]] = {
    "vllm:kv_cache_usage_perc": ("vllm:gpu_cache_usage_perc",),
    "vllm:inter_token_latency_seconds": ("vllm:time_per_output_token_seconds",),
    "vllm:prefix_cache_queries": ("vllm:gpu_prefix_cache_queries",),
    "vllm:prefix_cache_hits": ("vllm:gpu_prefix_cache_hits",),
}


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> list of (labels, value), in the text's order. Comments and malformed lines are skipped.

    Sample names are as exposed (``vllm:num_preemptions_total``, ``..._bucket``, ``..._created``);
    a counter exposed without ``_total`` gets it, as ``prometheus_client`` reads counters.

    Example:
        >>> parse_prometheus('m{path="C:\\\\tmp",q="say \\\\"hi\\\\""} 1\\nnot a sample\\nh_bucket{le="1"} 3 # {trace_id="a"} 0.5\\n')
        {'m': [({'path': 'C:\\\\tmp', 'q': 'say "hi"'}, 1.0)], 'h_bucket': [({'le': '1'}, 3.0)]}
    """
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        # One bad line makes the parser refuse the whole text: read it line by line instead (no
        # TYPE context then, which only decides whether a bare counter name gets ``_total``).
        families = []
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                try:
                    families.extend(text_string_to_metric_families(line))
                except ValueError:
                    continue
    for family in families:
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
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
