"""A workload spec recovered from what a vLLM server saw: its ``/metrics`` or a request log. Pure.

vLLM's ``/metrics`` keeps, per finished request, histograms of prompt and generated tokens
(``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``) with 1-2-5 buckets up to
``max_model_len`` (1, 2, 5, 10, 20, 50, 100, ...), and each histogram's exact ``_sum`` and
``_count``. So the mean length is known exactly and the shape only to the bucket: a length
distribution is fitted to both (a log-normal clipped to the occupied buckets or a uniform, its mean
held to the exact one, its spread chosen by the buckets' likelihood; a fixed length when one bucket
holds them all). Two dumps some seconds apart give the request rate (finished requests over the seconds
between them) and the share of prompt tokens served from the prefix cache, written as a shared
prefix. A request log (JSONL) goes through the same fit, with fine buckets.

The text written is a workload YAML (the study spec's ``workload:`` section, or ``servetune
simulate --workload``), headed by comments saying what was measured, how coarse, and what was not
known; :func:`render_workload` checks it loads as a :class:`~servetune.workload.Workload`.

Example:
    >>> text = "\\n".join(
    ...     [f'vllm:request_prompt_tokens_bucket{{le="{le}"}} {n}' for le, n in (("500.0", 0), ("1000.0", 8), ("+Inf", 8))]
    ...     + ["vllm:request_prompt_tokens_sum 4096", "vllm:request_prompt_tokens_count 8"])
    >>> h = histogram(parse_prometheus(text), "vllm:request_prompt_tokens")
    >>> fit = fit_lengths(h, "prompt")
    >>> fit.dist.dist, fit.dist.mean
    ('fixed', 512.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from servetune.engines.vllm.metrics import counter, labels_of, parse_prometheus
from servetune.errors import SpecError
from servetune.workload import LengthDist, Workload

__all__ = ["Histogram", "LengthFit", "MetricsWindow", "histogram", "histogram_of", "log_buckets", "fit_lengths",
           "metrics_window", "workload_from_metrics", "workload_from_trace", "render_workload"]

PROMPT = "vllm:request_prompt_tokens"
OUTPUT = "vllm:request_generation_tokens"
MetricsMap = Mapping[str, list[tuple[dict[str, str], float]]]

#: Below this share of prompt tokens served from the prefix cache, no shared prefix is written
#: (a preempted request's recomputation and warm-up repeats hit the cache too).
MIN_PREFIX_SHARE = 0.02


@dataclasses.dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: ``counts[i]`` requests in ``(bounds[i-1], bounds[i]]``, the last above ``bounds[-1]``."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float

    @property
    def count(self) -> float:
        return float(sum(self.counts))

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def minus(self, earlier: Histogram, field: str) -> Histogram:
        """The requests observed after ``earlier`` (the same series, read some time before)."""
        if earlier.bounds != self.bounds:
            raise SpecError(field, "the two dumps have different buckets", "give two dumps of one server")
        counts = tuple(a - b for a, b in zip(self.counts, earlier.counts))
        if min(counts, default=0) < 0 or self.sum < earlier.sum:
            raise SpecError(field, "counts went down between the dumps: the server restarted in between, "
                                   "or the dumps are in the wrong order",
                            "give the earlier dump first, both from one server run")
        return Histogram(self.bounds, counts, self.sum - earlier.sum)

    def bucket_text(self) -> str:
        edges = ",".join(f"{b:g}" for b in self.bounds)
        return edges if len(self.bounds) <= 20 else f"{len(self.bounds)} buckets from {self.bounds[0]:g} to {self.bounds[-1]:g}"


def histogram(metrics: MetricsMap, name: str) -> Histogram | None:
    """The histogram ``name`` from parsed ``/metrics``, summed over label sets (engines); None if absent."""
    buckets = metrics.get(name + "_bucket")
    total = counter(metrics, name + "_sum")
    if not buckets or total is None:
        return None
    cumulative: dict[float, float] = {}
    for labels, value in buckets:
        le = float(labels.get("le", "nan"))
        if not math.isnan(le) and not math.isnan(value):
            cumulative[le] = cumulative.get(le, 0.0) + value
    edges = sorted(cumulative)
    if not edges or edges[-1] != math.inf:
        return None
    counts, before = [], 0.0
    for le in edges:
        counts.append(max(0.0, cumulative[le] - before))
        before = cumulative[le]
    return Histogram(tuple(edges[:-1]), tuple(counts), float(total))


def log_buckets(limit: float, per_decade: int = 10) -> tuple[float, ...]:
    """Integer bucket edges about evenly spaced in log (``per_decade`` a decade) up to ``limit``."""
    edges: list[float] = []
    k = 0
    while not edges or edges[-1] < limit:
        edge = float(max(1, round(10 ** (k / per_decade))))
        if not edges or edge > edges[-1]:
            edges.append(edge)
        k += 1
    return tuple(edges)


def histogram_of(values: Sequence[int], bounds: Sequence[float]) -> Histogram:
    """The histogram vLLM would have kept of these lengths, with these bucket edges."""
    counts = [0.0] * (len(bounds) + 1)
    for v in values:
        i = next((j for j, b in enumerate(bounds) if v <= b), len(bounds))
        counts[i] += 1
    return Histogram(tuple(float(b) for b in bounds), tuple(counts), float(sum(values)))


@dataclasses.dataclass(frozen=True)
class LengthFit:
    """A fitted length distribution, the exact mean it was held to, and what the buckets allowed."""

    dist: LengthDist
    observed_mean: float
    count: float
    max_share_error: float  # largest |fitted - observed| bucket share, 0..1
    note: str

    def yaml_value(self) -> str:
        d = self.dist
        if d.dist == "fixed":
            return str(int(d.mean))
        if d.dist == "uniform":
            return f"{{dist: uniform, min: {d.min}, max: {d.max}}}"
        return f"{{dist: lognormal, mean: {d.mean:.1f}, sigma: {d.spread:.3f}, min: {d.min}, max: {d.max}}}"


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def _clipped_mean(m: float, s: float, lo: float, hi: float) -> float:
    """Mean of a log-normal with arithmetic mean ``m`` and log-sd ``s``, clipped to ``[lo, hi]``."""
    mu = math.log(m) - s * s / 2
    za, zb = (math.log(lo) - mu) / s, (math.log(hi) - mu) / s
    return lo * _phi(za) + hi * (1 - _phi(zb)) + m * (_phi(zb - s) - _phi(za - s))


def _solve_mean(target: float, s: float, lo: float, hi: float) -> float:
    """The unclipped mean whose clipped mean is ``target`` (the clipped mean grows with it)."""
    a, b = 1e-3, hi * 1e3
    for _ in range(80):
        mid = math.sqrt(a * b)
        if _clipped_mean(mid, s, lo, hi) < target:
            a = mid
        else:
            b = mid
    return math.sqrt(a * b)


def _shares(m: float, s: float, lo: float, hi: float, bounds: Sequence[float]) -> list[float]:
    """Bucket shares of the clipped, rounded log-normal (an integer v counts in the bucket with v <= le)."""
    mu = math.log(m) - s * s / 2

    def cdf(le: float) -> float:
        if le >= hi:
            return 1.0
        if le < lo:
            return 0.0
        return _phi((math.log(le + 0.5) - mu) / s)

    cum = [cdf(b) for b in bounds] + [1.0]
    return [c - p for c, p in zip(cum, [0.0, *cum[:-1]])]


def fit_lengths(h: Histogram, what: str, field: str = "metrics", support: tuple[int, int] | None = None) -> LengthFit:
    """Fit a length distribution to a histogram: the exact mean, the shape to the buckets.

    The support is the occupied buckets' span; within it a log-normal whose clipped mean is the
    exact mean, with the log-sd of highest multinomial likelihood, or a uniform centred on the
    exact mean with the likeliest width, whichever is likelier (ties to the narrower). All in one
    bucket gives a fixed length: nothing inside a bucket is known. ``support``: the exact shortest
    and longest, where known (a request log), instead of the occupied buckets' edges.
    """
    if h.count <= 0:
        raise SpecError(field, f"no finished requests in the {what} histogram",
                        "read the server after it has served requests (or two dumps with requests between them)")
    occupied = [i for i, c in enumerate(h.counts) if c > 0]
    first, last = occupied[0], occupied[-1]
    lo = math.floor(h.bounds[first - 1]) + 1 if first > 0 else 1
    open_top = last >= len(h.bounds)
    hi = int(2 * h.bounds[-1]) if open_top else int(h.bounds[last])
    if support is not None:
        (lo, hi), open_top = support, False
        first, last = (0, 0) if lo == hi else (first, max(last, first + 1))
    mean = min(max(h.mean, lo), hi)
    top = " (above the last bucket: max set to twice it, a guess)" if open_top else ""
    if first == last or hi - lo < 2:
        dist = LengthDist("fixed", float(round(mean)), round(mean), round(mean))
        return LengthFit(dist, h.mean, h.count, 0.0,
                         f"all {h.count:.0f} in ({lo - 1}, {hi}]{top}: written as the exact mean; "
                         "the spread inside that bucket is not known")
    observed = [c / h.count for c in h.counts]
    lognormal, uniform = _best_lognormal(h, mean, lo, hi), _best_uniform(h, mean, lo, hi)
    _, dist, shares = max(lognormal, uniform, key=lambda c: c[0])
    err = max(abs(a - b) for a, b in zip(shares, observed))
    shape = (f"a log-normal (sigma {dist.spread:.2f})" if dist.dist == "lognormal"
             else f"a uniform {dist.min}..{dist.max}")
    return LengthFit(dist, h.mean, h.count, err,
                     f"{h.count:.0f} requests in ({lo - 1}, {hi}]{top}: fitted {shape} holding the exact mean "
                     f"(of a log-normal and a uniform, the likelier); its bucket shares are within "
                     f"{100 * err:.1f} points of the observed")


def _loglik(h: Histogram, shares: Sequence[float]) -> float:
    return sum(c * math.log(max(p, 1e-300)) for c, p in zip(h.counts, shares) if c > 0)


def _best_lognormal(h: Histogram, mean: float, lo: int, hi: int) -> tuple[float, LengthDist, list[float]]:
    """The clipped log-normal with this mean and the likeliest log-sd (ties to the narrower)."""
    best: tuple[float, LengthDist, list[float]] | None = None
    for k in range(90):
        s = 0.02 * (2.5 / 0.02) ** (k / 89)
        m = _solve_mean(mean, s, lo, hi)
        shares = _shares(m, s, lo, hi, h.bounds)
        ll = _loglik(h, shares)
        if best is None or ll > best[0] + 1e-9 * abs(best[0]):
            best = (ll, LengthDist("lognormal", round(m, 1), lo, hi, round(s, 3)), shares)
    assert best is not None
    return best


def _best_uniform(h: Histogram, mean: float, lo: int, hi: int) -> tuple[float, LengthDist, list[float]]:
    """The uniform ``[mean - w, mean + w]`` inside ``[lo, hi]`` with the likeliest half-width (ties to the narrower)."""
    centre = round(mean)
    widest = max(1, min(centre - lo, hi - centre))
    best: tuple[float, LengthDist, list[float]] | None = None
    for k in range(1, 201):
        w = max(1, round(widest * k / 200))
        a, b = centre - w, centre + w
        cum = [min(max(le, a - 1), b) - (a - 1) for le in h.bounds] + [b - a + 1]
        shares = [(c - p) / (b - a + 1) for c, p in zip(cum, [0, *cum[:-1]])]
        ll = _loglik(h, shares)
        if best is None or ll > best[0] + 1e-9 * abs(best[0]):
            best = (ll, LengthDist("uniform", (a + b) / 2, a, b), shares)
    assert best is not None
    return best


@dataclasses.dataclass(frozen=True)
class MetricsWindow:
    """What a server saw between two dumps (or since it started, for one dump)."""

    prompt: Histogram
    output: Histogram
    cached_share: float | None  # share of prompt tokens served from the prefix cache
    cached_source: str
    seconds: float | None
    seconds_source: str
    block_size: int | None
    max_model_len: float
    in_flight_change: float = 0.0  # running + waiting, after minus before: arrivals not yet finished
    #: The API server process's CPU seconds between two dumps (``process_cpu_seconds_total``) and the
    #: tokens generated meanwhile (``vllm:generation_tokens_total``); None from one dump (its
    #: lifetime CPU includes the startup's imports) or where the server does not expose them.
    api_server_cpu_s: float | None = None
    generated_tokens: float | None = None

    @property
    def api_cpu_us_per_token(self) -> float | None:
        """The API server's CPU per generated token, in microseconds (what ``servetune simulate
        --api-cpu-us-per-token`` takes), or None where the window does not give it."""
        if self.api_server_cpu_s is None or not self.generated_tokens or self.api_server_cpu_s <= 0:
            return None
        return 1e6 * self.api_server_cpu_s / self.generated_tokens


def _read(text: str, field: str) -> MetricsMap:
    metrics = parse_prometheus(text)
    if histogram(metrics, PROMPT) is None or histogram(metrics, OUTPUT) is None:
        raise SpecError(field, f"not vLLM /metrics text: no {PROMPT} and {OUTPUT} histograms",
                        "point at a vLLM server's /metrics (e.g. http://HOST:8000/metrics) or a saved copy of it")
    return metrics


def _delta(after: MetricsMap, before: MetricsMap | None, name: str) -> float | None:
    a = counter(after, name)
    b = counter(before, name) if before is not None else 0.0
    return None if a is None or b is None else a - b


def metrics_window(text: str, earlier: str | None = None, seconds: float | None = None,
                   seconds_source: str = "", field: str = "metrics", read_at: float | None = None) -> MetricsWindow:
    """Parse one dump (``text``) or two (``earlier`` then ``text``) into the window between them.

    One dump read at a known time (``read_at``, Unix seconds) with no ``seconds`` spans the server
    process's life: ``process_start_time_seconds`` to ``read_at``, idle time and startup included.
    """
    after = _read(text, field)
    before = _read(earlier, field) if earlier is not None else None
    prompt, output = histogram(after, PROMPT), histogram(after, OUTPUT)
    assert prompt is not None and output is not None
    if before is not None:
        p0, o0 = histogram(before, PROMPT), histogram(before, OUTPUT)
        assert p0 is not None and o0 is not None
        prompt, output = prompt.minus(p0, field), output.minus(o0, field)
    cached, source = _delta(after, before, "vllm:prompt_tokens_cached"), "vllm:prompt_tokens_cached_total"
    share = cached / prompt.sum if cached is not None and prompt.sum > 0 else None
    if share is None:
        hits, queries = _delta(after, before, "vllm:prefix_cache_hits"), _delta(after, before, "vllm:prefix_cache_queries")
        source = "vllm:prefix_cache_hits / queries"
        share = hits / queries if hits is not None and queries else None
    in_flight = [sum(counter(m, g) or 0.0 for g in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
                 if m is not None else 0.0 for m in (after, before)]
    info = labels_of(after, "vllm:cache_config_info") or {}
    block = info.get("block_size", "")
    started = counter(after, "process_start_time_seconds")
    if before is None and seconds is None and read_at is not None and started and read_at > started:
        seconds = read_at - started
        seconds_source = "since the server process started, startup and idle time included: a lifetime average"
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise SpecError(field, f"the time between the dumps must be > 0 s, got {seconds:g}",
                        "give the earlier dump first, or the seconds between them with --seconds")
    cpu = _delta(after, before, "process_cpu_seconds") if before is not None else None
    generated = _delta(after, before, "vllm:generation_tokens") if before is not None else None
    return MetricsWindow(prompt, output, share, source if share is not None else "not exposed", seconds,
                         seconds_source, int(block) if block.isdigit() else None,
                         prompt.bounds[-1] if prompt.bounds else 0.0, in_flight[0] - in_flight[1],
                         api_server_cpu_s=cpu, generated_tokens=generated)


def _pacing(rate: float | None, concurrency: int | None) -> str:
    if rate is not None:
        return f"request_rate: {rate:.3g}"
    return f"concurrency: {concurrency or 32}"


def render_workload(header: Sequence[str], prompt: LengthFit, output: LengthFit, *, num_requests: int,
                    rate: float | None, concurrency: int | None, prefix: tuple[int, int] | None = None,
                    seed: int = 0) -> str:
    """The workload YAML with its comment header; checked to load as a :class:`Workload`."""
    lines = [f"# {h}" if h else "#" for h in header]
    lines += [f"input_len: {prompt.yaml_value()}", f"output_len: {output.yaml_value()}"]
    if prefix is not None:
        lines += [f"prefix_len: {prefix[0]}", f"num_prefix_groups: {prefix[1]}"]
    lines += [f"num_requests: {num_requests}", _pacing(rate, concurrency), f"seed: {seed}"]
    text = "\n".join(lines) + "\n"
    Workload.from_dict(yaml.safe_load(text), "workload")  # a spec the study accepts, or a SpecError here
    return text


def _num_requests(observed: float, given: int | None) -> int:
    return given if given is not None else int(min(2000, max(100, round(observed))))


def workload_from_metrics(window: MetricsWindow, source: str, *, num_requests: int | None = None,
                          concurrency: int | None = None, seed: int = 0) -> str:
    """The workload YAML for what the server saw in ``window``; ``source`` names the dumps in the header."""
    pf, of = fit_lengths(window.prompt, "prompt"), fit_lengths(window.output, "output")
    n = window.prompt.count
    arrived = max(n, n + window.in_flight_change)
    rate = arrived / window.seconds if window.seconds else None
    header = [f"Workload recovered from vLLM /metrics: {source}.",
              f"{n:.0f} requests finished in the window"
              + (f" of {window.seconds:.1f} s ({window.seconds_source})." if window.seconds else "."),
              f"Buckets (tokens): {window.prompt.bucket_text()}; each histogram's exact sum gives the exact mean.",
              f"Prompt: mean {pf.observed_mean:.1f} tokens. {pf.note}.",
              f"Output: mean {of.observed_mean:.1f} tokens. {of.note}."]
    if rate is not None:
        queue = (f" + {window.in_flight_change:.0f} more running or waiting at the end than at the start"
                 if window.in_flight_change >= 1 else "")
        header.append(f"Rate: {rate:.3g} requests/s = ({n:.0f} finished{queue}) / seconds (Poisson arrivals "
                      "assumed; bursts and the hour-to-hour shape are not in /metrics).")
    else:
        header.append(f"Rate: not known (no time span between the dumps): concurrency {concurrency or 32} is a placeholder; "
                      "give two dumps, --wait or --seconds for a rate.")
    prefix = None
    share = window.cached_share
    if share is not None and share >= MIN_PREFIX_SHARE:
        plen = max(1, min(int(round(share * pf.observed_mean)), pf.dist.min - 1 if pf.dist.min > 1 else 1))
        prefix = (plen, 1)
        header.append(f"Prefix cache: {100 * share:.1f}% of prompt tokens were cached ({window.cached_source}): "
                      f"written as one shared {plen}-token prefix; how many distinct prefixes, and a hit "
                      f"rounded to whole {window.block_size or 16}-token blocks, are not known.")
    elif share is not None:
        header.append(f"Prefix cache: {100 * share:.1f}% of prompt tokens cached ({window.cached_source}): "
                      "below 2%, no shared prefix written.")
    else:
        header.append("Prefix cache: not exposed by this server; no shared prefix written.")
    us = window.api_cpu_us_per_token
    if us is not None:
        header.append(f"Host CPU: vLLM's API server spent {window.api_server_cpu_s:.2f} CPU-s on {window.generated_tokens:,.0f} "
                      f"generated tokens, {us:.0f} us a token (process_cpu_seconds_total): simulate this host with "
                      f"`servetune simulate ... --api-cpu-us-per-token {us:.0f}`.")
    header.append("Not in /metrics: per-request pairing of prompt and output lengths (drawn independently "
                  "here), arrival times, and requests still running at the dump.")
    return render_workload(header, pf, of, num_requests=_num_requests(n, num_requests), rate=rate,
                           concurrency=concurrency, prefix=prefix, seed=seed)


_PROMPT_KEYS = ("input_length", "prompt_tokens", "prompt_len", "num_prompt_tokens")
_OUTPUT_KEYS = ("output_length", "output_tokens", "completion_tokens", "output_len", "num_generation_tokens")
_TIME_KEYS = ("timestamp", "arrival_s", "arrival_time", "time")


def _field(row: Mapping[str, Any], keys: Sequence[str], where: str, kind: str) -> float:
    for key in keys:
        value = row.get(key)
        if value is not None and not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
    raise SpecError(where, f"needs a numeric {kind} ({' or '.join(keys)})",
                    'e.g. {"timestamp": 0.5, "input_length": 812, "output_length": 190}')


def workload_from_trace(rows: Sequence[Mapping[str, Any]], source: str, *, num_requests: int | None = None,
                        concurrency: int | None = None, seed: int = 0) -> str:
    """The workload YAML for a request log: one row per request, its token counts and arrival time."""
    prompts, outputs, times = [], [], []
    for i, row in enumerate(rows, start=1):
        prompts.append(int(_field(row, _PROMPT_KEYS, f"{source}:{i}", "prompt token count")))
        outputs.append(int(_field(row, _OUTPUT_KEYS, f"{source}:{i}", "output token count")))
        if any(k in row for k in _TIME_KEYS):
            times.append(_field(row, _TIME_KEYS, f"{source}:{i}", "arrival time"))
    if min(prompts + outputs, default=0) < 1:
        raise SpecError(source, "token counts must be >= 1", "drop requests with empty prompts or outputs")
    bounds = log_buckets(max(prompts + outputs))
    pf = fit_lengths(histogram_of(prompts, bounds), "prompt", source, (min(prompts), max(prompts)))
    of = fit_lengths(histogram_of(outputs, bounds), "output", source, (min(outputs), max(outputs)))
    span = max(times) - min(times) if len(times) == len(rows) and len(times) > 1 else 0.0
    rate = (len(times) - 1) / span if span > 0 else None
    header = [f"Workload fitted to the request log {source}: {len(rows)} requests.",
              "Lengths are exact (shortest and longest kept); the shape fitted through 10-a-decade buckets, as for /metrics.",
              f"Prompt: mean {pf.observed_mean:.1f} tokens. {pf.note}.",
              f"Output: mean {of.observed_mean:.1f} tokens. {of.note}."]
    if rate is not None:
        header.append(f"Rate: {rate:.3g} requests/s over {span:.1f} s, written as Poisson arrivals "
                      "(to replay the log's own timing, use trace_file: instead).")
    else:
        header.append(f"Rate: no arrival times in the log: concurrency {concurrency or 32} is a placeholder.")
    header.append("Not kept: the pairing of each prompt with its output length, and shared prefixes.")
    return render_workload(header, pf, of, num_requests=_num_requests(len(rows), num_requests), rate=rate,
                           concurrency=concurrency, seed=seed)
