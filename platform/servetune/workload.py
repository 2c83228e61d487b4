"""Workloads: which requests a trial sends, and when. Pure and seeded; no I/O but file reading.

A workload is a list of requests (prompt length, output length, optional arrival time) sent at a
fixed concurrency or at a Poisson rate, or replayed from a recorded trace. The same
:class:`Workload` drives the simulated engine and the HTTP load generator, so a simulated and a
real trial of one spec see the same requests.

Example:
    >>> w = Workload.from_dict({"input_len": 1024, "output_len": {"dist": "uniform", "min": 128, "max": 384},
    ...                         "num_requests": 4, "concurrency": 2, "seed": 1})
    >>> [r.prompt_tokens for r in w.requests()]
    [1024, 1024, 1024, 1024]
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servetune.errors import SpecError, did_you_mean
from servetune.inputs import finite, iter_lines, load_json, shown

__all__ = ["GREEDY", "LengthDist", "RequestSpec", "Sampling", "Workload", "read_jsonl"]

_DISTS = ("fixed", "uniform", "normal", "lognormal")
MAX_REQUESTS = 1_000_000
_MAX_TOKENS = 10_000_000  # one request's prompt or output: beyond any model's context


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, clipped to ``[min, max]``.

    YAML forms: ``1024`` (fixed), ``{dist: uniform, min: 512, max: 1536}``,
    ``{dist: normal, mean: 1024, std: 256}``, ``{dist: lognormal, mean: 1024, sigma: 0.6, max: 8192}``,
    and ``vllm bench serve``'s ``{mean: 1024, range_ratio: 0.5}`` (uniform in mean*(1 +/- r)).
    """

    dist: str
    mean: float
    min: int
    max: int
    spread: float = 0.0  # std for normal, sigma for lognormal

    def sample(self, rng: random.Random) -> int:
        if self.dist == "fixed":
            return int(self.mean)
        if self.dist == "uniform":
            return rng.randint(self.min, self.max)
        if self.dist == "normal":
            value = rng.gauss(self.mean, self.spread)
        else:  # lognormal with the given arithmetic mean
            mu = math.log(self.mean) - self.spread**2 / 2
            value = rng.lognormvariate(mu, self.spread)
        return int(min(self.max, max(self.min, round(value))))

    @property
    def upper(self) -> int:
        return int(self.mean) if self.dist == "fixed" else self.max

    @classmethod
    def parse(cls, value: Any, field: str) -> LengthDist:
        dist = cls._parse(value, field)
        if dist.upper > _MAX_TOKENS:
            raise SpecError(field, f"reaches {dist.upper:,} tokens, above the limit of {_MAX_TOKENS:,} per request",
                            "give token counts a model can hold")
        return dist

    @classmethod
    def _parse(cls, value: Any, field: str) -> LengthDist:
        if isinstance(value, bool):
            raise SpecError(field, f"expected a token count or a distribution, got {shown(value)}",
                            "write e.g. 1024 or {dist: uniform, min: 512, max: 1536}")
        if isinstance(value, int):
            if value < 1:
                raise SpecError(field, f"must be >= 1 token, got {value}", "use a positive token count")
            return cls("fixed", float(value), value, value)
        if not isinstance(value, Mapping):
            raise SpecError(field, f"expected a token count or a mapping, got {type(value).__name__}",
                            "write e.g. 1024 or {dist: uniform, min: 512, max: 1536}")
        data = dict(value)
        if "range_ratio" in data:
            mean, ratio = _num(data, "mean", field), _num(data, "range_ratio", field)
            if not 0 <= ratio < 1:
                raise SpecError(f"{field}.range_ratio", f"must be in [0, 1), got {ratio}", "use e.g. 0.5")
            lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
            return cls("uniform" if hi > lo else "fixed", mean, lo, hi)
        dist = data.get("dist", "fixed")
        if dist not in _DISTS:
            raise SpecError(f"{field}.dist", f"unknown distribution {shown(dist)}{did_you_mean(str(dist), _DISTS)}",
                            f"use one of {', '.join(_DISTS)}")
        allowed = {"fixed": {"dist", "mean", "value"}, "uniform": {"dist", "min", "max"},
                   "normal": {"dist", "mean", "std", "min", "max"},
                   "lognormal": {"dist", "mean", "sigma", "min", "max"}}[dist]
        for key in data:
            if key not in allowed:
                raise SpecError(f"{field}.{key}", f"unknown key for dist {dist}{did_you_mean(key, allowed)}",
                                f"allowed keys: {', '.join(sorted(allowed))}")
        if dist == "fixed":
            n = int(_num(data, "value" if "value" in data else "mean", field))
            return cls.parse(n, field)
        if dist == "uniform":
            lo, hi = int(_num(data, "min", field)), int(_num(data, "max", field))
            if not 1 <= lo <= hi:
                raise SpecError(field, f"needs 1 <= min <= max, got min={lo} max={hi}", "swap or fix the bounds")
            return cls("uniform", (lo + hi) / 2, lo, hi)
        mean = _num(data, "mean", field)
        spread = _num(data, "std" if dist == "normal" else "sigma", field)
        lo = int(_num(data, "min", field)) if "min" in data else 1
        hi = int(_num(data, "max", field)) if "max" in data else max(lo, int(min(mean * 8, _MAX_TOKENS)))
        if mean < 1 or spread < 0 or not 1 <= lo <= hi:
            raise SpecError(field, "needs mean >= 1, a non-negative spread and 1 <= min <= max",
                            "check mean, std/sigma, min and max")
        return cls(dist, mean, lo, hi, spread)


def _num(data: Mapping[str, Any], key: str, field: str) -> float:
    if key not in data:
        raise SpecError(f"{field}.{key}", "is required", f"add {key}: <number>")
    value = data[key]
    return finite(value, f"{field}.{key}", minimum=None if key == "mean" else 0)


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request: its lengths, and its arrival time in seconds when the workload is timed."""

    prompt_tokens: int
    output_tokens: int
    arrival_s: float | None = None
    prefix_group: int | None = None  # requests of one group share their first ``prefix_tokens``
    prefix_tokens: int = 0
    prompt: str | None = None  # text from a prompt file; the length is then an estimate


#: vLLM's ``_SAMPLING_EPS`` (``v1/sample/sampler.py``): a temperature below it is greedy.
SAMPLING_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The sampling parameters the requests reach the sampler with (the client's, else the model's
    ``generation_config.json``, else vLLM's neutral ones). Greedy by default.

    Example:
        >>> Sampling.from_dict({"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.1}).penalties
        True
        >>> GREEDY.greedy
        True
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    KEYS = ("temperature", "top_k", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], field: str = "generation_config") -> Sampling:
        """The sampler's parameters from a ``generation_config.json``-like mapping; a key left out
        is vLLM's neutral value (temperature 1.0 where a mapping is given: vLLM's default)."""
        unknown = sorted(set(map(str, data)) - set(cls.KEYS))
        if unknown:
            raise SpecError(f"{field}.{unknown[0]}", "unknown key", f"use: {', '.join(cls.KEYS)}")
        values: dict[str, Any] = {"temperature": 1.0}
        for key in cls.KEYS:
            if key in data:
                value = data[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise SpecError(f"{field}.{key}", f"expected a number, got {value!r}", "e.g. top_p: 0.8")
                values[key] = int(value) if key == "top_k" else float(value)
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0


#: What every servetune load sends (``temperature 0``), and ``vllm bench serve`` up to 0.14.1.
GREEDY = Sampling()


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a trial sends: lengths, count, and pacing (``concurrency`` or ``request_rate``)."""

    input_len: LengthDist
    output_len: LengthDist
    num_requests: int
    concurrency: int | None = None
    request_rate: float | None = None  # requests/s, Poisson arrivals
    warmup_requests: int = 0
    seed: int = 0
    prefix_len: int = 0  # shared prefix tokens per group (exercises prefix caching)
    num_prefix_groups: int = 1
    prompt_file: Path | None = None  # JSONL: {"prompt": str, "output_len": int?} or {"prompt_len": int, ...}
    trace_file: Path | None = None  # JSONL: {"timestamp": s, "input_length": n, "output_length": m}
    #: What-if scales, not spec keys (a headroom search sets them, :mod:`servetune.search.headroom`):
    #: every prompt's length times ``prompt_scale`` (the shared prefix kept), and arrivals
    #: ``rate_scale`` times as frequent (a Poisson rate or a trace's timestamps).
    prompt_scale: float = 1.0
    rate_scale: float = 1.0
    #: Re-sent prompts (simulator only, not a spec key): the server ran these same prompts before,
    #: so this fraction of each prompt's tokens (whole KV blocks of it) sits in its prefix cache
    #: when the measured window opens, as after a benchmark re-run with the same seed. Each
    #: request is its own prefix group; :class:`servetune.sim.client.LoadClient` primes the cache.
    #: Synthetic lengths without ``prefix_len`` only (a prompt or trace file's requests are as read).
    cached_fraction: float = 0.0
    #: Chat requests (simulator only, not a spec key: servetune's own client sends completions): the
    #: load went to ``/v1/chat/completions``, so vLLM's API server renders the model's chat template
    #: for each (:attr:`servetune.sim.perf.Calibration.chat_template_parse_s`).
    chat: bool = False
    #: What the requests sample with (simulator only, not a spec key: servetune's own clients send
    #: ``temperature 0``): greedy, or the parameters a published client's server applied (a
    #: ``vllm bench serve`` from 0.15.0 sends none, so the model's ``generation_config.json`` holds).
    #: Priced per step by :mod:`servetune.sim.sampling`.
    sampling: Sampling = GREEDY

    def __post_init__(self) -> None:
        if not 0.0 <= self.cached_fraction < 1.0:
            raise SpecError("workload.cached_fraction", f"must be in [0, 1), got {shown(self.cached_fraction)}",
                            "the share of each prompt the server cached before, e.g. 0.4")

    KEYS = ("input_len", "output_len", "num_requests", "concurrency", "request_rate", "warmup_requests",
            "seed", "prefix_len", "num_prefix_groups", "prompt_file", "trace_file")

    @classmethod
    def from_dict(cls, data: Any, field: str = "workload", base_dir: Path | None = None) -> Workload:
        if not isinstance(data, Mapping):
            raise SpecError(field, f"expected a mapping, got {type(data).__name__}",
                            "give input_len, output_len, num_requests and concurrency or request_rate")
        for key in data:
            if key not in cls.KEYS:
                raise SpecError(f"{field}.{key}", f"unknown key{did_you_mean(str(key), cls.KEYS)}",
                                f"allowed keys: {', '.join(cls.KEYS)}")

        def path(key: str) -> Path | None:
            if data.get(key) is None:
                return None
            p = Path(str(data[key]))
            p = p if p.is_absolute() or base_dir is None else base_dir / p
            if not p.is_file():
                raise SpecError(f"{field}.{key}", f"file not found: {p}", "paths resolve relative to the spec file")
            return p

        prompt_file, trace_file = path("prompt_file"), path("trace_file")
        if trace_file is None and prompt_file is None and "input_len" not in data:
            raise SpecError(f"{field}.input_len", "is required", "add input_len: 1024 (or a prompt_file/trace_file)")
        if trace_file is None and "output_len" not in data:
            raise SpecError(f"{field}.output_len", "is required", "add output_len: 256")
        input_len = LengthDist.parse(data.get("input_len", 1), f"{field}.input_len")
        output_len = LengthDist.parse(data.get("output_len", 1), f"{field}.output_len")
        num_requests = _int(data, "num_requests", field, 1, default=None if trace_file is None else 0)
        if num_requests > MAX_REQUESTS:
            raise SpecError(f"{field}.num_requests", f"must be <= {MAX_REQUESTS:,}, got {num_requests:,}",
                            "a trial measures a steady state; a few thousand requests are plenty")
        concurrency = data.get("concurrency")
        rate = data.get("request_rate")
        if trace_file is None:
            if (concurrency is None) == (rate is None):
                raise SpecError(field, "set exactly one of concurrency and request_rate",
                                "e.g. concurrency: 64 (closed loop) or request_rate: 10 (Poisson, req/s)")
        if concurrency is not None:
            concurrency = _int(data, "concurrency", field, 1)
        if rate is not None:
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 1e9:  # NaN fails too
                raise SpecError(f"{field}.request_rate", f"must be a positive finite number, got {shown(rate)}",
                                "requests per second, e.g. 10")
            rate = float(rate)
        w = cls(input_len=input_len, output_len=output_len, num_requests=num_requests,
                concurrency=concurrency, request_rate=rate,
                warmup_requests=_int(data, "warmup_requests", field, 0, default=0),
                seed=_int(data, "seed", field, 0, default=0),
                prefix_len=min(_int(data, "prefix_len", field, 0, default=0), _MAX_TOKENS + 1),
                num_prefix_groups=_int(data, "num_prefix_groups", field, 1, default=1),
                prompt_file=prompt_file, trace_file=trace_file)
        if trace_file is not None or prompt_file is not None:
            w.requests()  # read the files now, so a broken line is an error before any trial starts
        return w

    def token_bound(self) -> int:
        """An upper bound on the tokens (prompt + output) the workload sends, warm-up included, known
        before any request is drawn for a synthetic workload (a file's requests are read, within its caps).

        Example:
            >>> Workload.from_dict({"input_len": 1000, "output_len": 24, "num_requests": 10,
            ...                     "concurrency": 1, "warmup_requests": 2}).token_bound()
            12288
        """
        if self.trace_file is not None or self.prompt_file is not None:
            return sum(r.prompt_tokens + r.output_tokens for r in self.requests(include_warmup=True))
        per_request = max(math.ceil(self.input_len.upper * self.prompt_scale), self.prefix_len + 1) + self.output_len.upper
        return (self.num_requests + self.warmup_requests) * per_request

    @property
    def max_prompt_tokens(self) -> int:
        return max((r.prompt_tokens for r in self.requests()), default=self.input_len.upper)

    @property
    def max_output_tokens(self) -> int:
        return max((r.output_tokens for r in self.requests()), default=self.output_len.upper)

    def requests(self, include_warmup: bool = False) -> list[RequestSpec]:
        """The measured requests (after any warm-up ones), deterministic for the seed."""
        if self.trace_file is not None:
            reqs = _read_trace(self.trace_file)
        elif self.prompt_file is not None:
            reqs = _read_prompts(self.prompt_file, self.output_len, self.seed)
            if self.num_requests:
                reqs = [reqs[i % len(reqs)] for i in range(self.num_requests + self.warmup_requests)]
        else:
            rng = random.Random(self.seed)
            reqs = []
            for i in range(self.num_requests + self.warmup_requests):
                plen = max(self.input_len.sample(rng), self.prefix_len + 1)
                group = (i % self.num_prefix_groups) if self.prefix_len else None
                out = self.output_len.sample(rng)
                if self.cached_fraction and not self.prefix_len:  # a prompt of its own, seen before
                    reqs.append(RequestSpec(plen, out, None, i, int(self.cached_fraction * plen)))
                else:
                    reqs.append(RequestSpec(plen, out, None, group, self.prefix_len))
        if self.request_rate is not None and self.trace_file is None:
            rng = random.Random(self.seed + 7919)
            t = 0.0
            timed = []
            for r in reqs:
                timed.append(dataclasses.replace(r, arrival_s=t))
                t += rng.expovariate(self.request_rate)
            reqs = timed
        return self._scaled(reqs) if include_warmup else self._scaled(reqs)[self.warmup_requests:]

    def _scaled(self, reqs: list[RequestSpec]) -> list[RequestSpec]:
        """``reqs`` under the what-if scales (unchanged at 1.0)."""
        if self.prompt_scale != 1.0:
            reqs = [dataclasses.replace(r, prompt_tokens=max(r.prefix_tokens + 1, round(r.prompt_tokens * self.prompt_scale)))
                    for r in reqs]
        if self.rate_scale != 1.0:
            reqs = [r if r.arrival_s is None else dataclasses.replace(r, arrival_s=r.arrival_s / self.rate_scale)
                    for r in reqs]
        return reqs

    def to_dict(self) -> dict[str, Any]:
        """A flat description for MLflow params and the Parquet dataset."""
        return {
            "input_len_mean": self.input_len.mean, "input_len_max": self.input_len.upper,
            "output_len_mean": self.output_len.mean, "output_len_max": self.output_len.upper,
            "num_requests": self.num_requests, "concurrency": self.concurrency,
            "request_rate": self.request_rate, "seed": self.seed, "prefix_len": self.prefix_len,
            **{k: v for k, v in (("prompt_scale", self.prompt_scale), ("rate_scale", self.rate_scale)) if v != 1.0},
            **({"cached_fraction": self.cached_fraction} if self.cached_fraction else {}),
        }


def _int(data: Mapping[str, Any], key: str, field: str, minimum: int, default: int | None = None) -> int:
    if key not in data or data[key] is None:
        if default is None:
            raise SpecError(f"{field}.{key}", "is required", f"add {key}: <integer >= {minimum}>")
        return default
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{field}.{key}", f"expected an integer, got {shown(value)}", "write a whole number")
    if value < minimum:
        raise SpecError(f"{field}.{key}", f"must be >= {minimum}, got {value}", f"use a value >= {minimum}")
    return value


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one a line; a broken line is a :class:`SpecError` naming it."""
    return _jsonl(path)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for lineno, line in iter_lines(path, "jsonl", str(path)):
        if not line.strip():
            continue
        try:
            row = load_json(line, f"{path}:{lineno}", f"{path}:{lineno}")
        except SpecError as exc:
            raise SpecError(exc.field, f"{exc.message.replace('not valid JSON: ', 'not valid JSON (')})",
                            "one JSON object per line, with finite numbers") from None
        if not isinstance(row, dict):
            raise SpecError(f"{path}:{lineno}", "expected a JSON object", "one JSON object per line")
        rows.append(row)
    if not rows:
        raise SpecError(str(path), "holds no requests", "add at least one JSON line")
    return rows


def _read_trace(path: Path) -> list[RequestSpec]:
    reqs = []
    example = 'e.g. {"timestamp": 0.5, "input_length": 812, "output_length": 190}'
    for i, row in enumerate(_jsonl(path), start=1):
        missing = [k for k in ("timestamp", "input_length", "output_length") if k not in row]
        if missing:
            raise SpecError(f"{path}:{i}", f"needs numeric timestamp, input_length and output_length; no {missing[0]}",
                            example)
        when = finite(row["timestamp"], f"{path}:{i}: timestamp", minimum=0)
        lengths = [int(finite(row[k], f"{path}:{i}: {k}", minimum=1, integer=True)) for k in ("input_length", "output_length")]
        if max(lengths) > _MAX_TOKENS:
            raise SpecError(f"{path}:{i}", f"a length of {max(lengths):,} tokens, above {_MAX_TOKENS:,}", example)
        reqs.append(RequestSpec(lengths[0], lengths[1], when))
    t0 = min(r.arrival_s or 0.0 for r in reqs)
    return sorted((dataclasses.replace(r, arrival_s=(r.arrival_s or 0.0) - t0) for r in reqs),
                  key=lambda r: r.arrival_s or 0.0)


def _read_prompts(path: Path, output_len: LengthDist, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    reqs = []
    for i, row in enumerate(_jsonl(path), start=1):
        prompt = row.get("prompt")
        if not isinstance(prompt, str) and not isinstance(row.get("prompt_len"), int):
            raise SpecError(f"{path}:{i}", "needs a string 'prompt' or an integer 'prompt_len'",
                            'e.g. {"prompt": "Summarize ...", "output_len": 200}')
        out = row.get("output_len", output_len.sample(rng))
        if isinstance(out, bool) or not isinstance(out, int) or not 1 <= out <= _MAX_TOKENS:
            raise SpecError(f"{path}:{i}", f"output_len must be a whole number in [1, {_MAX_TOKENS:,}], got {shown(out)}",
                            "fix the line")
        if isinstance(row.get("prompt_len"), int) and not 1 <= row["prompt_len"] <= _MAX_TOKENS:
            raise SpecError(f"{path}:{i}", f"prompt_len must be in [1, {_MAX_TOKENS:,}], got {shown(row['prompt_len'])}",
                            "fix the line")
        # Without the model's tokenizer, about 4 characters per token (the usual BPE average).
        plen = row["prompt_len"] if isinstance(row.get("prompt_len"), int) or not isinstance(prompt, str) \
            else max(1, len(prompt) // 4)
        reqs.append(RequestSpec(plen, out, None, prompt=prompt if isinstance(prompt, str) else None))
    return reqs
