"""What a GPU worker's install decides about a launched server, read where the trial runs (the I/O edge).

* :func:`server_environ`: the environment every ``vllm serve`` servetune launches gets (this process's, servetune's
  launch variables, the launch's own): the one definition the engine launches with and the probe reads.
* :func:`probe_has_flashinfer`: vLLM's ``has_flashinfer()`` on this install, through the pure rule
  :func:`servetune.planner.comm.has_flashinfer`. The study's pool runs it on a GPU worker before the first trial
  (:meth:`servetune.cluster.pool.TrialPool.on_worker`) and plans its trials with the answer
  (:func:`servetune.planner.comm.trial_env`): vLLM 0.17+ allocates its FlashInfer all-reduce fusion workspace
  (1.5 GiB per TP worker, out of the KV budget) at TP 2, 4 or 8 on compute capability 9.0 / 10.x exactly where it
  holds.

The probe looks at the Python it runs in: the worker's, where servetune runs beside vLLM (``vllm serve`` from the
same environment, as in vLLM's images). A ``serve_command`` that runs another Python's vLLM is not looked into.

Example:
    >>> env = server_environ({"VLLM_HAS_FLASHINFER_CUBIN": "1"})
    >>> env["NCCL_NVLS_ENABLE"], env["VLLM_HAS_FLASHINFER_CUBIN"]
    ('0', '1')
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Mapping

from servetune.envs import LAUNCH_SAFE_ENV
from servetune.planner.comm import has_flashinfer

__all__ = ["server_environ", "probe_has_flashinfer"]


def server_environ(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a launched server (and ``vllm bench serve``) gets: this process's, overlaid by servetune's
    launch variables (:data:`servetune.envs.LAUNCH_SAFE_ENV`), overlaid by ``extra`` (the launch's own)."""
    return {**os.environ, **LAUNCH_SAFE_ENV, **(extra or {})}


def probe_has_flashinfer(env: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM's ``has_flashinfer()`` holds for a server launched here with ``env`` (default
    :func:`server_environ`): the ``flashinfer`` and ``flashinfer_cubin`` packages looked up without importing them
    (``importlib.util.find_spec``, as vLLM does), ``nvcc`` on that environment's ``PATH``
    (``vllm/utils/flashinfer.py`` lines 35-62 of 0.19.0). Raises :class:`~servetune.errors.SpecError` for a
    ``VLLM_HAS_FLASHINFER_CUBIN`` vLLM would not start with."""
    env = server_environ() if env is None else env
    return has_flashinfer(package=importlib.util.find_spec("flashinfer") is not None,
                          cubin_package=importlib.util.find_spec("flashinfer_cubin") is not None,
                          nvcc=shutil.which("nvcc", path=env.get("PATH")) is not None, env=env)
