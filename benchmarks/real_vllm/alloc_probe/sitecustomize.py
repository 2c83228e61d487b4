"""Memory probe for vLLM's V1 worker (GPU host only): logs the CUDA caching allocator's state after
CUDA-graph capture and around each ``_dummy_sampler_run`` as one ``ST_PROBE {json}`` line each.
Loaded by Python at start (sitecustomize) where ST_PROBE=1; patches the runner class when vLLM imports it."""
import importlib.abc
import importlib.util
import os
import sys

TARGET = "vllm.v1.worker.gpu_model_runner"


def _state(tag):
    try:
        _state_inner(tag)
    except Exception as e:  # the probe never stops vLLM
        print(f"ST_PROBE state failed: {e!r}", file=sys.stderr, flush=True)


def _state_inner(tag):
    import json
    import time
    import torch
    free, total = torch.cuda.mem_get_info()
    inactive = []
    seg_sizes = []
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0):
            continue
        seg_sizes.append(seg["total_size"])
        for b in seg["blocks"]:
            if b["state"] == "inactive":
                inactive.append(b["size"])
    inactive.sort(reverse=True)
    big = sorted(seg_sizes, reverse=True)
    rec = {"tag": tag, "t": time.time(), "free": free, "total": total,
           "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
           "inactive_main_pool": sum(inactive), "largest_inactive": inactive[:8],
           "n_inactive": len(inactive), "main_segments": len(seg_sizes), "largest_segments": big[:8]}
    print("ST_PROBE " + json.dumps(rec), file=sys.stderr, flush=True)


def _patch(mod):
    cls = mod.GPUModelRunner
    orig_s, orig_c = cls._dummy_sampler_run, cls.capture_model

    def _dummy_sampler_run(self, *a, **k):
        _state("sampler_before")
        try:
            out = orig_s(self, *a, **k)
        except BaseException:
            _state("sampler_failed")
            raise
        _state("sampler_after")
        return out

    def capture_model(self, *a, **k):
        _state("capture_before")
        out = orig_c(self, *a, **k)
        _state("capture_after")
        return out

    cls._dummy_sampler_run, cls.capture_model = _dummy_sampler_run, capture_model


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        loader = spec.loader
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            try:
                _patch(module)
            except Exception as e:  # the probe never stops vLLM
                print(f"ST_PROBE patch failed: {e!r}", file=sys.stderr, flush=True)
        loader.exec_module = exec_module
        return spec


if os.environ.get("ST_PROBE") == "1":
    sys.meta_path.insert(0, _Finder())
