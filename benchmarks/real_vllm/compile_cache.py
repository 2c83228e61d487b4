"""Startup seconds a warm vLLM compile cache saves, measured through servetune's own engine (GPU host).

Three starts of the same flag set, one after the other, each through
:func:`servetune.engines.vllm.engine.run_vllm_trial` with a small load:

1. ``host_cold``: the host's first vLLM start (cold OS page cache, cold kernel caches);
2. ``cache_cold``: a fresh, empty compile cache (``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``,
   ``TRITON_CACHE_DIR``) on an otherwise warm host: what a trial pays when its configuration was
   never compiled on this node;
3. ``cache_warm``: the same caches as 2, now filled: what every later trial with the same compile
   key pays (vLLM keys the cache on the configuration: max_num_seqs changes the key,
   gpu_memory_utilization does not).

``cache_cold - cache_warm`` is the saving per trial that servetune gets by keeping the caches on the
node across trials. Prints one JSON line per start and writes ``OUT/compile_cache.json``.

    bash .carry/gpu/stage2.sh bash -c 'export PYTHONPATH=$PYTHONPATH:$PWD/platform:/tmp/studysite; \
        python3 benchmarks/real_vllm/compile_cache.py'
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from servetune.engines.vllm.engine import VllmLaunch, run_vllm_trial
from servetune.workload import Workload

MODEL = os.environ.get("SERVETUNE_REAL_MODEL", "/root/model")
FLAGS = {"gpu_memory_utilization": 0.05, "max_num_seqs": 64, "max_model_len": 2048}
WORKLOAD = Workload.from_dict({"input_len": 1024, "output_len": 64, "num_requests": 32, "concurrency": 16,
                               "warmup_requests": 1})


def start(name: str, cache: Path | None, out: Path) -> dict:
    env = {}
    if cache is not None:
        env = {"VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
               "TRITON_CACHE_DIR": str(cache / "triton")}
    log_dir = out / name
    t0 = time.monotonic()
    r = run_vllm_trial(VllmLaunch(model=MODEL, flags=FLAGS, env=env, log_dir=log_dir, startup_timeout_s=300), WORKLOAD)
    row = {"name": name, "status": r.status.value, "startup_s": r.startup_s, "wall_s": time.monotonic() - t0,
           "compile_cache_hit": r.compile_cache_hit, **{f"{k}_s": v for k, v in r.timings_s.items()},
           "output_throughput": r.output_throughput}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="servetune-compile-cache-"))
    rows = [start("host_cold", None, out), start("cache_cold", cache, out), start("cache_warm", cache, out)]
    cold, warm = rows[1], rows[2]
    summary = {"flags": FLAGS, "starts": rows,
               "startup_saved_s": (cold["startup_s"] or 0) - (warm["startup_s"] or 0),
               "torch_compile_saved_s": (cold.get("torch_compile_s") or 0) - (warm.get("torch_compile_s") or 0)}
    (out / "compile_cache.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "starts"}), flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    for name in ("host_cold", "cache_cold", "cache_warm"):  # keep the logs, flat: OUT allows 2 levels
        log = out / name / "server.log"
        if log.exists():
            shutil.copy(log, out / f"{name}.server.log")
        shutil.rmtree(out / name, ignore_errors=True)


if __name__ == "__main__":
    main()
