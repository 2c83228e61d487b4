"""The GPU table: memory as torch reports it, bandwidth, dense FLOP/s and the link between GPUs.

The memory planner uses :attr:`GpuSpec.memory_gib` (``torch.cuda.mem_get_info()[1]`` in GiB, which
is what vLLM multiplies by ``gpu_memory_utilization``); the simulator's roofline uses the HBM
bandwidth, the dense bf16 / fp8 tensor-core rates and the per-direction interconnect bandwidth.
Names are case-insensitive and resolve strictly: an exact name, or an alias that means one GPU
only (``h100-sxm``, ``a100-40g``). A name that several GPUs answer to (``A100``: the 40 GB and the
80 GB card; ``H100``: SXM, PCIe and NVL parts with different memory and bandwidth) is refused with
the candidates, never guessed: an A100-40GB owner given 80 GB predictions would plan trials that
cannot start. :func:`get_gpu` raises :class:`~servetune.errors.SpecError` listing the known names
for an unknown one. Users add GPUs from YAML with :func:`register_gpus_from_yaml`::

    gpus:
      - name: RTX-6000-Ada
        memory_gib: 47.5          # torch's total, in GiB
        hbm_gbps: 960
        bf16_tflops: 182
        fp8_tflops: 364
        interconnect_gbps: 32     # PCIe 4.0 x16, one direction
        compute_capability: 8.9   # optional
        calibration: {decode_overhead_ms: 0.3}   # optional simulator knobs

Example:
    >>> g = get_gpu("h200")
    >>> g.name, g.memory_gib, g.hbm_gbps
    ('H200', 139.8, 4800.0)
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Mapping
from typing import Any

import yaml

from servetune.errors import SpecError, did_you_mean

__all__ = ["GpuSpec", "get_gpu", "known_gpus", "register_gpus_from_yaml", "register_gpu"]


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU model. Rates are per GPU; ``interconnect_gbps`` is one direction between two GPUs.

    ``compute_capability`` is a servetune addition after the shared-contract fields (vLLM 0.29+
    raises the CUDA-graph capture cap to 1024 on data-center Blackwell, compute capability 10.x).
    """

    name: str
    memory_gib: float  # total memory as torch reports it (H200: 139.8)
    hbm_gbps: float  # HBM bandwidth GB/s
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense (GPUs without fp8 tensor cores: the bf16 rate)
    interconnect_gbps: float  # per-direction NVLink / PCIe GB/s between GPUs of a node
    calibration: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}), hash=False)
    compute_capability: float = 0.0

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)


#: Built-in GPUs. memory_gib is torch's total (``mem_get_info``), not the marketing GB: H200
#: 139.8 is read from real vLLM 0.26 logs ("Free memory on device (139.29/139.8 GiB)"); the others
#: are the totals torch prints on those cards. Bandwidth and FLOP/s are NVIDIA datasheet figures
#: (SXM parts, dense, no sparsity); NVLink is per direction (H100/H200 900 GB/s total = 450 each
#: way, A100 600 = 300, B200 1800 = 900); L40S and L4 have no NVLink: PCIe 4.0 x16, 32 GB/s.
_BUILTIN: tuple[GpuSpec, ...] = (
    GpuSpec("H100-80GB", 79.19, 3350.0, 989.0, 1979.0, 450.0, compute_capability=9.0),
    GpuSpec("H200", 139.8, 4800.0, 989.0, 1979.0, 450.0, compute_capability=9.0),
    GpuSpec("A100-80GB", 79.25, 2039.0, 312.0, 312.0, 300.0, compute_capability=8.0),
    GpuSpec("A100-40GB", 39.39, 1555.0, 312.0, 312.0, 300.0, compute_capability=8.0),
    GpuSpec("L40S", 44.39, 864.0, 362.0, 733.0, 32.0, compute_capability=8.9),
    GpuSpec("L4", 22.05, 300.0, 121.0, 242.0, 32.0, compute_capability=8.9),
    GpuSpec("B200", 178.4, 8000.0, 2250.0, 4500.0, 900.0, compute_capability=10.0),
)

#: Other spellings people use for the built-in names (lower case).
_ALIASES = {"h100-sxm": "H100-80GB", "h100-80g": "H100-80GB", "h100_80gb": "H100-80GB",
            "h100-sxm-80gb": "H100-80GB", "a100-80g": "A100-80GB", "a100_80gb": "A100-80GB",
            "a100-40g": "A100-40GB", "a100_40gb": "A100-40GB", "h200-141gb": "H200"}

#: Names several GPUs answer to (lower case) -> (the table's candidates, what else the name covers).
_AMBIGUOUS: dict[str, tuple[tuple[str, ...], str]] = {
    "a100": (("A100-40GB", "A100-80GB"), ""),
    "h100": (("H100-80GB",), "H100-80GB is the SXM part; H100 PCIe (2.0 TB/s) and H100 NVL (94 GB) are not in the "
             "table"),
}

_REGISTRY: dict[str, GpuSpec] = {g.name.lower(): g for g in _BUILTIN}


def known_gpus() -> list[str]:
    """Names of every GPU in the table (built-in and registered)."""
    return sorted(g.name for g in _REGISTRY.values())


def get_gpu(name: str) -> GpuSpec:
    """The :class:`GpuSpec` for ``name`` (case-insensitive).

    Example:
        >>> get_gpu("l40s").interconnect_gbps
        32.0
    """
    if not isinstance(name, str) or not name.strip():
        raise SpecError("gpu", f"expected a GPU name, got {name!r}", f"use one of: {', '.join(known_gpus())}")
    key = name.strip().lower()
    if key in _REGISTRY:  # an exact name (built-in or registered) always wins
        return _REGISTRY[key]
    if key in _ALIASES and _ALIASES[key].lower() in _REGISTRY:
        return _REGISTRY[_ALIASES[key].lower()]
    if key in _AMBIGUOUS:
        candidates, note = _AMBIGUOUS[key]
        raise SpecError("gpu", f"ambiguous GPU {name!r}: it names {', '.join(candidates)}"
                        + (f" ({note})" if note else ""),
                        f"write the exact type, one of: {', '.join(candidates)}"
                        + ("; or add your part with a GPU YAML file (--gpu-file)" if note else ""))
    raise SpecError("gpu", f"unknown GPU {name!r}{did_you_mean(name, known_gpus())}",
                    f"use one of: {', '.join(known_gpus())}, or add it with a GPU YAML file (--gpu-file)")


_NUMERIC_FIELDS = ("memory_gib", "hbm_gbps", "bf16_tflops", "fp8_tflops", "interconnect_gbps")


def _spec_from_mapping(entry: Any, field: str) -> GpuSpec:
    if not isinstance(entry, Mapping):
        raise SpecError(field, f"expected a mapping, got {entry!r}", "write name: ..., memory_gib: ...")
    unknown = set(entry) - {"name", "compute_capability", "calibration", *_NUMERIC_FIELDS}
    if unknown:
        bad = sorted(map(str, unknown))[0]
        raise SpecError(f"{field}.{bad}", f"unknown GPU field{did_you_mean(bad, _NUMERIC_FIELDS)}",
                        f"use: name, {', '.join(_NUMERIC_FIELDS)}, compute_capability, calibration")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise SpecError(f"{field}.name", f"expected a non-empty string, got {name!r}", "e.g. name: RTX-6000-Ada")
    values: dict[str, float] = {}
    for key in _NUMERIC_FIELDS:
        value = entry.get(key)
        if value is None:
            raise SpecError(f"{field}.{key}", "missing", f"add {key} (a positive number) for GPU {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise SpecError(f"{field}.{key}", f"expected a positive number, got {value!r}", "write a plain number")
        values[key] = float(value)
    cc = entry.get("compute_capability", 0.0)
    if isinstance(cc, bool) or not isinstance(cc, (int, float)) or cc < 0:
        raise SpecError(f"{field}.compute_capability", f"expected a number such as 9.0, got {cc!r}", "e.g. 8.9")
    calib = entry.get("calibration") or {}
    if not isinstance(calib, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in calib.items()):
        raise SpecError(f"{field}.calibration", f"expected a mapping of names to numbers, got {calib!r}",
                        "e.g. calibration: {decode_overhead_ms: 0.3}")
    return GpuSpec(name=name.strip(), calibration=types.MappingProxyType({k: float(v) for k, v in calib.items()}),
                   compute_capability=float(cc), **values)


def register_gpu(spec: GpuSpec) -> None:
    """Add (or replace) one GPU in the table."""
    _REGISTRY[spec.name.lower()] = spec


def register_gpus_from_yaml(path: str | os.PathLike[str]) -> list[str]:
    """Add the GPUs of a YAML file (a ``gpus:`` list, or a bare list) and return their names.

    Every entry is validated before any is registered; errors name the field
    (``gpus[0].hbm_gbps``) and the file.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "g.yaml"
        >>> _ = p.write_text("gpus:\\n  - {name: X1, memory_gib: 10, hbm_gbps: 1, bf16_tflops: 1, "
        ...                  "fp8_tflops: 1, interconnect_gbps: 1}\\n")
        >>> register_gpus_from_yaml(p), get_gpu("x1").memory_gib
        (['X1'], 10.0)
    """
    text_path = os.fspath(path)
    try:
        with open(text_path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except OSError as exc:
        raise SpecError("--gpu-file", f"cannot read {text_path}: {exc.strerror}", "give an existing YAML file") from None
    except UnicodeDecodeError as exc:
        raise SpecError("--gpu-file", f"cannot read {text_path}: not UTF-8 text ({exc.reason})",
                        "give a UTF-8 YAML file") from None
    except yaml.YAMLError as exc:
        raise SpecError(text_path, f"not valid YAML: {exc}", "fix the YAML syntax") from None
    entries = doc.get("gpus") if isinstance(doc, Mapping) else doc
    if not isinstance(entries, list) or not entries:
        raise SpecError(f"{text_path}: gpus", "expected a non-empty list of GPUs", "write gpus: [{name: ..., ...}]")
    specs = [_spec_from_mapping(e, f"{text_path}: gpus[{i}]") for i, e in enumerate(entries)]
    for spec in specs:
        register_gpu(spec)
    return [s.name for s in specs]
