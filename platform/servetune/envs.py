"""Every environment setting servetune reads, in one registry (as vLLM's ``envs.py`` does).

Example:
    >>> import os; os.environ["SERVETUNE_SERVE_COMMAND"] = "python -m servetune.sim.server"
    >>> serve_command()
    ('python', '-m', 'servetune.sim.server')
"""

from __future__ import annotations

import os
import shlex

__all__ = ["serve_command", "pool", "startup_timeout_s", "ray_connect_wait_s", "compile_cache_dir", "compile_cache_env",
           "ENV_VARS", "LAUNCH_SAFE_ENV", "COMM_ENV_VARS", "comm_settings"]

#: name -> what it does. Read only through the functions below.
ENV_VARS = {
    "SERVETUNE_SERVE_COMMAND": "argv before MODEL that starts a server (default: 'vllm serve'); split like a "
                               "shell would split it, but never run through a shell",
    "SERVETUNE_RAY_DASHBOARD": "1 starts Ray's dashboard (on 127.0.0.1) with the local Ray a study starts (default: off); "
                               "a joined cluster keeps its own",
    "SERVETUNE_POOL": "where a study's trials run: auto (default: simulated and replayed trials in local worker "
                      "processes unless RAY_ADDRESS names a cluster or a Ray already runs in the process; real "
                      "trials on Ray), ray (always Ray: a local one with logical GPUs where no cluster is named), "
                      "local (sim and replay in local workers even beside a Ray)",
    "SERVETUNE_STARTUP_TIMEOUT_S": "seconds a server may take to answer /health (default 600)",
    "SERVETUNE_RAY_CONNECT_WAIT_S": "seconds a study waits for the Ray cluster RAY_ADDRESS names to accept a "
                                    "connection before it says so and stops (default 60)",
    "SERVETUNE_COMPILE_CACHE_DIR": "a directory for vLLM's compile caches, kept across trials and studies: every "
                                   "real trial gets VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR "
                                   "under it (default unset: vLLM's per-user defaults, which persist across the "
                                   "trials of one node but not a container restart; /tmp/torchinductor_* not a reboot)",
    # Read by `servetune plan` only (comm_settings), because the caller's own `vllm serve` runs with them:
    "NCCL_NVLS_ENABLE": "NCCL's NVLink SHARP (multicast): 0 off, 1 on, unset/2 where supported; plan models the "
                        "memory it takes per TP worker (servetune's own launches set 0)",
    "NCCL_NVLS_CHUNKSIZE": "NCCL's NVLS chunk (bytes, default 131072): sizes NCCL's NVLS buffers in plan's model",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "vLLM's symmetric-memory all-reduce (default 1; servetune's launches set 0): its "
                                   "buffer is in use before vLLM's budget is taken",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "torch symmetric memory without multicast (servetune's launches set 1)",
}


#: Set in every vLLM environment servetune launches: NVLink multicast can take a host's GPUs out of
#: service for everyone on the host (the GPU hosts' operating rule). The memory planner models a
#: servetune-launched trial with exactly these (planner.comm.trial_env; the GPU workers' FlashInfer, probed, decides
#: the rest), engines.vllm.host.server_environ applies them.
LAUNCH_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
}

#: NCCL / vLLM / torch settings that change how much memory a TP/PP worker takes outside torch
#: (planner.comm.CommEnv reads them). Not servetune's own settings: ``servetune plan`` reads them
#: from the caller's environment, because the caller's ``vllm serve`` will run with them.
COMM_ENV_VARS = ("NCCL_NVLS_ENABLE", "NCCL_NVLS_CHUNKSIZE", "VLLM_ALLREDUCE_USE_SYMM_MEM",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST")


def comm_settings() -> dict[str, str]:
    """The :data:`COMM_ENV_VARS` set in this process's environment (unset ones left out)."""
    return {k: os.environ[k] for k in COMM_ENV_VARS if k in os.environ}


def serve_command() -> tuple[str, ...]:
    raw = os.environ.get("SERVETUNE_SERVE_COMMAND", "").strip()
    return tuple(shlex.split(raw)) if raw else ("vllm", "serve")


def pool() -> str | None:
    """``SERVETUNE_POOL`` as set (None: unset; ``servetune.cluster.base.pool_kind`` checks the value)."""
    return os.environ.get("SERVETUNE_POOL") or None


def _seconds(name: str, default: float) -> float:
    """The setting ``name`` as a finite number of seconds, 0 or more (``default`` where unset or empty);
    anything else is a :class:`~servetune.errors.SpecError` naming it.

    >>> os.environ["SERVETUNE_RAY_CONNECT_WAIT_S"] = "soon"
    >>> ray_connect_wait_s()
    Traceback (most recent call last):
    ...
    servetune.errors.SpecError: SERVETUNE_RAY_CONNECT_WAIT_S: expected a number of seconds, 0 or more, got 'soon' (fix: set it to a number such as 60, or unset it for the default)
    >>> del os.environ["SERVETUNE_RAY_CONNECT_WAIT_S"]; ray_connect_wait_s()
    60.0
    """
    from servetune.errors import SpecError

    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise SpecError(name, f"expected a number of seconds, 0 or more, got {raw[:40]!r}",
                        f"set it to a number such as {default:g}, or unset it for the default")
    return value


def ray_connect_wait_s() -> float:
    """``SERVETUNE_RAY_CONNECT_WAIT_S``: how long a study waits for the Ray cluster ``RAY_ADDRESS`` names to
    answer before it says so and stops (default 60 s: a head that is still starting gets that long)."""
    return _seconds("SERVETUNE_RAY_CONNECT_WAIT_S", 60.0)


def startup_timeout_s() -> float:
    return _seconds("SERVETUNE_STARTUP_TIMEOUT_S", 600.0)


def compile_cache_dir() -> str | None:
    raw = os.environ.get("SERVETUNE_COMPILE_CACHE_DIR", "").strip()
    return os.path.abspath(os.path.expanduser(raw)) if raw else None


def compile_cache_env(root: str | None) -> dict[str, str]:
    """The environment that points vLLM, Inductor and Triton at the caches under ``root``.

    A warm cache saved 47.6 s of a 92.1 s start on the H200 (tests/fixtures/real_h200/compile_cache):
    the graphs load instead of compiling, and the engine's warm-up finds its Triton kernels.

    Example:
        >>> sorted(compile_cache_env("/cache"))
        ['TORCHINDUCTOR_CACHE_DIR', 'TRITON_CACHE_DIR', 'VLLM_CACHE_ROOT']
        >>> compile_cache_env(None)
        {}
    """
    if not root:
        return {}
    return {"VLLM_CACHE_ROOT": os.path.join(root, "vllm"), "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(root, "triton")}
