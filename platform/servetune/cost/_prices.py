"""The GPU price table: list prices per GPU-hour, each with its date and source.

The shipped table is ``servetune/data/gpu_prices.yaml``; a user's own file (a spec's ``prices:``,
``servetune capacity --prices``) replaces it whole. Nothing is fetched: a price is what the file
says, as of the date it says. The file is read with :mod:`servetune.inputs`' caps and every entry
is checked before any is used; a bad one is a :class:`~servetune.errors.SpecError` naming the
entry and the fix.

Example:
    >>> table = load_prices()
    >>> p = table.price("h100-80gb")
    >>> p.gpu, p.usd_per_gpu_hour > 0, len(p.as_of)
    ('H100-80GB', True, 10)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servetune.errors import SpecError, did_you_mean
from servetune.inputs import load_yaml, read_text, shown
from servetune.planner.gpus import get_gpu

__all__ = ["GpuPrice", "PriceTable", "load_prices", "SHIPPED_PRICES"]

#: The table shipped with servetune.
SHIPPED_PRICES = Path(__file__).resolve().parents[1] / "data" / "gpu_prices.yaml"
_ENTRY_KEYS = ("gpu", "usd_per_gpu_hour", "as_of", "source")
_MAX_PRICE = 1000.0  # per GPU-hour; more is a typo (a per-instance or per-month figure)


@dataclasses.dataclass(frozen=True)
class GpuPrice:
    """One GPU type's price: dollars per GPU-hour, as of a date, from a source."""

    gpu: str  # the GPU table's spelling (servetune.planner.gpus)
    usd_per_gpu_hour: float
    as_of: str  # YYYY-MM-DD
    source: str

    def describe(self) -> str:
        """``$3.78/GPU-h (2026-05-07, Lambda ...)``: the figure and what it rests on."""
        return f"${self.usd_per_gpu_hour:.2f}/GPU-h ({self.as_of}, {self.source})"


@dataclasses.dataclass(frozen=True)
class PriceTable:
    """The prices of one file, keyed by GPU type; ``path`` says which file."""

    prices: Mapping[str, GpuPrice]
    path: str

    def get(self, gpu: str) -> GpuPrice | None:
        """The price of ``gpu`` (any spelling the GPU table resolves), or None when the table has none."""
        try:
            name = get_gpu(gpu).name
        except SpecError:
            name = gpu
        return self.prices.get(name)

    def price(self, gpu: str, field: str = "prices") -> GpuPrice:
        """The price of ``gpu``, or a :class:`SpecError` naming the table and the fix."""
        found = self.get(gpu)
        if found is None:
            raise SpecError(field, f"no price for GPU {gpu!r} in {self.path} (it prices {', '.join(sorted(self.prices))})",
                            f"add an entry for {gpu} (gpu, usd_per_gpu_hour, as_of, source) to a copy of the table "
                            "and point prices: (or --prices) at it")
        return found


def _entry(raw: Any, field: str) -> GpuPrice:
    if not isinstance(raw, Mapping):
        raise SpecError(field, f"expected a mapping, got {shown(raw)}",
                        "write {gpu: H100-80GB, usd_per_gpu_hour: 3.78, as_of: '2026-05-07', source: '...'}")
    for key in raw:
        if key not in _ENTRY_KEYS:
            raise SpecError(f"{field}.{key}", f"unknown key{did_you_mean(str(key), _ENTRY_KEYS)}",
                            f"allowed keys: {', '.join(_ENTRY_KEYS)}")
    for key in _ENTRY_KEYS:
        if raw.get(key) is None:
            raise SpecError(f"{field}.{key}", "is required", f"add {key} to every price entry")
    try:
        gpu = get_gpu(str(raw["gpu"])).name
    except SpecError as exc:
        raise SpecError(f"{field}.gpu", exc.message, exc.fix) from None
    value = raw["usd_per_gpu_hour"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= _MAX_PRICE:
        raise SpecError(f"{field}.usd_per_gpu_hour", f"expected a price in dollars per GPU-hour above 0 and at most "
                        f"{_MAX_PRICE:g}, got {shown(value)}", "write the list price of one GPU for one hour, e.g. 3.78")
    as_of = raw["as_of"]
    text = as_of.isoformat() if isinstance(as_of, dt.date) else str(as_of)
    try:
        dt.date.fromisoformat(text)
    except ValueError:
        raise SpecError(f"{field}.as_of", f"expected a date YYYY-MM-DD, got {shown(as_of)}",
                        "write the day the price was listed, e.g. as_of: '2026-05-07'") from None
    source = raw["source"]
    if not isinstance(source, str) or not source.strip():
        raise SpecError(f"{field}.source", f"expected text, got {shown(source)}",
                        "say who lists the price and where, e.g. 'Lambda on-demand, lambda.ai/pricing'")
    return GpuPrice(gpu, float(value), text, source.strip())


def load_prices(path: str | os.PathLike[str] | None = None, field: str = "prices") -> PriceTable:
    """The price table of ``path`` (default: the shipped one), validated whole before use.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "p.yaml"
        >>> _ = p.write_text("prices:\\n  - {gpu: L4, usd_per_gpu_hour: -1, as_of: '2026-01-01', source: x}\\n")
        >>> load_prices(p)
        Traceback (most recent call last):
        ...
        servetune.errors.SpecError: prices[0].usd_per_gpu_hour: expected a price in dollars per GPU-hour above 0 and at most 1000, got -1 (fix: write the list price of one GPU for one hour, e.g. 3.78)
    """
    where = SHIPPED_PRICES if path is None else Path(path)
    doc = load_yaml(read_text(where, "yaml", field), field, str(where))
    if not isinstance(doc, Mapping):
        raise SpecError(field, f"{where} is not a mapping", "write currency: USD and a prices: list (see the shipped table)")
    unknown = sorted(str(k) for k in doc if k not in ("currency", "prices"))
    if unknown:
        raise SpecError(f"{field}.{unknown[0]}", f"unknown key{did_you_mean(unknown[0], ('currency', 'prices'))}",
                        "allowed keys: currency, prices")
    currency = doc.get("currency", "USD")
    if currency != "USD":
        raise SpecError(f"{field}.currency", f"only USD prices are read, got {shown(currency)}",
                        "convert the prices to US dollars and write currency: USD")
    entries = doc.get("prices")
    if not isinstance(entries, list) or not entries:
        raise SpecError(f"{field}.prices", f"expected a non-empty list of price entries, got {shown(entries)}",
                        "write prices: [{gpu: H100-80GB, usd_per_gpu_hour: 3.78, as_of: '2026-05-07', source: '...'}]")
    table: dict[str, GpuPrice] = {}
    for i, raw in enumerate(entries):
        price = _entry(raw, f"{field}[{i}]")
        if price.gpu in table:
            raise SpecError(f"{field}[{i}].gpu", f"{price.gpu} is priced twice", "keep one entry per GPU type")
        table[price.gpu] = price
    return PriceTable(table, str(where))
