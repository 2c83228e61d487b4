"""Simulated GPU memory shared between processes, and an ``nvidia-smi`` stand-in that reads it.

On a machine without GPUs, "another process holds memory on GPU 0" is a file in a ledger
directory (``SERVETUNE_SIM_GPU_MEMORY_DIR``): ``<gpu index>-<holder>.mib`` holding the MiB that
holder keeps on that (logical) GPU. Everything that looks at GPU memory reads the same ledger, as
everything on a real host reads the same device:

- the ``vllm serve`` stand-in (:mod:`servetune.sim.server`) finds that memory not free at startup
  on the GPUs of its ``CUDA_VISIBLE_DEVICES`` and, when its budget no longer fits, fails with vLLM's
  own "Free memory on device ... is less than desired GPU memory utilization";
- ``python -m servetune.sim.devices --query-gpu=index,memory.used --format=csv,noheader,nounits``
  answers as ``nvidia-smi`` does (a test puts a ``nvidia-smi`` shim running it on ``PATH``), so
  the launcher's pre-launch reading (:func:`servetune.engines.vllm.engine.gpu_memory_used_mib`) sees it.

Nothing here says "this is an infrastructure failure": servetune has to infer it from the log
and the reading, as it must on a real host.

Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> hold(d, "0", 102400, holder="other")
    >>> held_mib(d, ["0"]), held_mib(d, ["1"])
    (102400, 0)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LEDGER_ENV", "COUNT_ENV", "hold", "held_mib", "visible_gpus", "main"]

LEDGER_ENV = "SERVETUNE_SIM_GPU_MEMORY_DIR"
COUNT_ENV = "SERVETUNE_SIM_GPU_COUNT"


def hold(ledger: str | os.PathLike[str], gpu: str, mib: int, holder: str) -> None:
    """Record that ``holder`` keeps ``mib`` MiB on ``gpu`` (until the file is removed)."""
    path = Path(ledger)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{gpu}-{holder}.mib").write_text(str(int(mib)))


def held_mib(ledger: str | os.PathLike[str] | None, gpus: Sequence[str]) -> int:
    """MiB held on the most loaded of ``gpus`` (a TP worker fails on its fullest GPU)."""
    if not ledger or not Path(ledger).is_dir():
        return 0
    per_gpu = _ledger(Path(ledger))
    return max((per_gpu.get(str(g), 0) for g in gpus), default=0)


def _ledger(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in path.glob("*.mib"):
        gpu = f.name.split("-", 1)[0]
        try:
            out[gpu] = out.get(gpu, 0) + int(f.read_text().strip() or 0)
        except (OSError, ValueError):
            continue
    return out


def visible_gpus() -> list[str]:
    """The logical GPUs this process sees (``CUDA_VISIBLE_DEVICES``; "0" when unset)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [v.strip() for v in raw.split(",") if v.strip()]
    return ids or ["0"]


def main(argv: Sequence[str] | None = None) -> int:
    """``nvidia-smi`` for the simulated GPUs: ``-L`` and ``--query-gpu=index,memory.used``."""
    p = argparse.ArgumentParser(prog="nvidia-smi (servetune stand-in)")
    p.add_argument("-L", action="store_true", dest="list_gpus")
    p.add_argument("--query-gpu", default="index,memory.used")
    p.add_argument("--format", default="csv,noheader,nounits")
    ns = p.parse_args(argv)
    ledger = os.environ.get(LEDGER_ENV)
    used = _ledger(Path(ledger)) if ledger and Path(ledger).is_dir() else {}
    count = int(os.environ.get(COUNT_ENV, "0") or 0) or (max((int(g) for g in used if g.isdigit()), default=0) + 1)
    for i in range(count):
        if ns.list_gpus:
            print(f"GPU {i}: servetune simulated GPU (UUID: GPU-sim-{i})")
            continue
        fields = {"index": str(i), "memory.used": str(used.get(str(i), 0))}
        print(", ".join(fields.get(q.strip(), "[N/A]") for q in ns.query_gpu.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
