"""A ``vllm serve`` stand-in over the simulated engine: the real-engine path, end to end, without a GPU.

Contract: ``python -m servetune.sim.server MODEL [vLLM serve flags]`` behaves like
``vllm serve`` as seen from outside the process, which is all a launcher sees:

* the command line is vLLM's (``--gpu-memory-utilization``, ``--no-enable-prefix-caching``,
  ``--cudagraph-capture-sizes 1 2 4``, ``--config file.yaml`` with CLI > file, underscores accepted)
  and an unknown argument ends in argparse's ``vllm serve: error: unrecognized arguments`` (exit 2);
* stdout carries vLLM 0.26's startup log (:mod:`servetune.sim.vllm_log`) with the planner's figures
  (:func:`servetune.planner.memory.plan_memory`), then the periodic ``Engine 000:`` stats line every 10 s
  of virtual time; a startup the planner predicts to fail prints vLLM's traceback and exits 1;
* the HTTP socket listens only once "startup" is done (``GET /health`` -> 200 means ready, as in
  vLLM); ``/v1/models``, ``/v1/completions`` (streaming SSE or not, token-id or text prompts),
  ``/metrics`` (vLLM's Prometheus names), ``/version``, ``/ping`` are served;
* one asyncio loop drives :class:`servetune.sim.scheduler.SimScheduler`: each step sleeps
  ``duration / speedup`` wall seconds, then its tokens go to the waiting HTTP streams;
* SIGTERM/SIGINT stop it within a second and it leaves no process or file behind.

Stand-in-only options: ``--sim-gpu`` (env ``SERVETUNE_SIM_GPU``, default H200), ``--sim-speedup``
(virtual seconds per wall second), ``--sim-vllm-version``, ``--sim-fail MODE`` (fault injection,
see :data:`servetune.sim.vllm_log.FAIL_MODES`), ``--sim-fail-after-tokens`` (when the runtime
faults strike) and ``--sim-ignore-sigterm``. Env ``SERVETUNE_SIM_STARTUP_S`` replaces the predicted
startup (virtual seconds, still divided by the speedup); ``SERVETUNE_SIM_DEATH_LINGER_S`` is how
long a server whose engine died keeps answering 503 before it exits. Env
``SERVETUNE_SIM_GPU_MEMORY_DIR`` is the simulated device memory other processes hold
(:mod:`servetune.sim.devices`): not free at startup on the GPUs of ``CUDA_VISIBLE_DEVICES``.

Text prompts count ~4 characters per token; token-id prompts count exactly. Requests always run
to ``max_tokens`` (the simulated model never emits EOS), so ``finish_reason`` is ``length``.

This module is the face: :func:`main`, and :class:`SimServer`'s state, startup (the log vLLM prints
before and after it listens, the port bound early) and shutdown. Its parts, each a private module:
the command line (``_server_cli``: :func:`build_parser`, :func:`parse_args`, :func:`given_flags`),
the HTTP endpoints (``_server_http``), the engine loop (``_server_engine``) and ``/metrics``
(``_server_metrics``).

Example::

    PYTHONPATH=platform python -m servetune.sim.server servetune-test-850m --port 8011 \\
        --gpu-memory-utilization 0.5 --max-num-seqs 64 --sim-speedup 20
    curl -s localhost:8011/v1/completions -d '{"prompt": [1, 2, 3], "max_tokens": 4}' \\
        -H 'content-type: application/json'
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aiohttp import web

from servetune.errors import SpecError
from servetune.planner.flags import validate_flag
from servetune.planner.gpus import get_gpu
from servetune.planner.memory import plan_memory
from servetune.planner.modelinfo import load_model
from servetune.planner.target import resolve_target
from servetune.sim import devices, vllm_log
from servetune.sim._server_cli import build_parser, given_flags, parse_args
from servetune.sim._server_engine import EngineLoop, Live
from servetune.sim._server_http import OpenAIApi
from servetune.sim.vllm_log import LogRecord

__all__ = ["build_parser", "parse_args", "given_flags", "SimServer", "main"]


class SimServer(OpenAIApi, EngineLoop):
    """The stand-in's state: the simulated engine, live requests, counters, and the HTTP app.

    Example (inside a running event loop; :func:`main` is the usual entry point)::

        server = SimServer(ns)          # ns from parse_args([...])
        code = await server.run()       # returns the process exit code
    """

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.host: str = ns.host or "127.0.0.1"
        self.port: int = ns.port
        self.speedup: float = ns.sim_speedup
        self.model_ref: str = ns.model
        self.served_name: str = (ns.served_model_name or [ns.model])[0]
        self.fail: str | None = ns.sim_fail
        self.pid = os.getpid()
        self.pids = {"APIServer": self.pid, "EngineCore": self.pid + 1}
        self.stop_event = asyncio.Event()
        self.stop_signal = "SIGTERM"
        self.wake = asyncio.Event()
        self.ready = False
        self.dead = False
        self.stalled = False
        self.warned_behind = False
        self.exit_code = 0
        self.live: dict[str, Live] = {}
        self.sched: Any = None
        self.created = int(time.time())
        # Virtual clock: virt = virt_anchor + (monotonic - wall_anchor) * speedup.
        self.wall_anchor = time.monotonic()
        self.virt_anchor = 0.0

    # -- output ---------------------------------------------------------------------------------

    def emit(self, records: Iterable[LogRecord]) -> None:
        now = datetime.datetime.now()
        for rec in records:
            print(vllm_log.format_record(rec, self.pids, now), flush=False)
        sys.stdout.flush()

    async def _sleep_or_stop(self, wall_s: float) -> bool:
        """Sleep ``wall_s``; True if a stop was requested meanwhile."""
        if wall_s <= 0:
            return self.stop_event.is_set()
        try:
            await asyncio.wait_for(self.stop_event.wait(), wall_s)
        except asyncio.TimeoutError:
            return False
        return True

    def vnow(self) -> float:
        return self.virt_anchor + (time.monotonic() - self.wall_anchor) * self.speedup

    # -- setup ----------------------------------------------------------------------------------

    def _resolve(self) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        model = load_model(self.model_ref)
        gpu = get_gpu(self.ns.sim_gpu)
        flags = given_flags(self.ns)
        checked = {name: validate_flag(name, value, f"--{name.replace('_', '-')}") for name, value in flags.items()}
        target = resolve_target(model, gpu, checked, self.ns.sim_vllm_version)
        plan = plan_memory(target.model, target.gpu, target.config)
        return target.model, target.gpu, target.config, plan, flags

    def _bind(self) -> socket.socket:
        """Reserve the port early, as vLLM does (bind now, listen once the engine is up)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        return sock

    async def run(self) -> int:
        """Start up (printing vLLM's log), serve until stopped or dead; the process exit code."""
        loop = asyncio.get_running_loop()
        if self.ns.sim_ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            model, gpu, config, plan, flags = self._resolve()
        except (SpecError, ValueError, OSError) as exc:
            self.emit(vllm_log.config_error_records(0.0, "ValueError", str(exc)))
            return 1
        try:
            sock = self._bind()
        except OSError as exc:
            self.emit(vllm_log.config_error_records(0.0, "OSError", f"[Errno {exc.errno}] {exc.strerror}"))
            return 1
        self.model, self.gpu, self.config, self.plan = model, gpu, config, plan
        for i, proc in enumerate(vllm_log.worker_procs(config)):
            self.pids.setdefault(proc, self.pid + 2 + i)
        try:
            return await self._run_bound(sock, flags)
        finally:
            sock.close()

    async def _run_bound(self, sock: socket.socket, flags: Mapping[str, Any]) -> int:
        script = vllm_log.startup_script(
            self.model, self.gpu, self.config, self.plan, model_ref=self.model_ref,
            served_model_name=self.served_name, host=self.host, port=self.port, given_flags=flags,
            api_pid=self.pid, fail=self.fail,
            # Memory other processes hold on this process's (logical) GPUs is not free at startup.
            held_gib=devices.held_mib(os.environ.get(devices.LEDGER_ENV), devices.visible_gpus()) / 1024)
        override = os.environ.get("SERVETUNE_SIM_STARTUP_S")
        scale = 1.0 / self.speedup
        if override is not None and script.startup_s > 0:
            scale = float(override) / script.startup_s / self.speedup
        at = 0.0
        for rec in script.before_listen:
            if await self._sleep_or_stop((rec.at_s - at) * scale):
                return 0
            at = rec.at_s
            self.emit([rec])
        if script.exit_code is not None:
            return script.exit_code
        if not script.healthy:  # hang: alive, silent, never listening
            await self.stop_event.wait()
            return 0
        app = self._app()
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=0.2)
        await runner.setup()
        site = web.SockSite(runner, sock, shutdown_timeout=0.2)
        await site.start()
        self.emit(script.after_listen)
        self.ready = True
        self.wall_anchor, self.virt_anchor = time.monotonic(), 0.0
        self._init_engine()
        tasks = [asyncio.create_task(self._engine_loop())]
        if not self.ns.disable_log_stats:
            tasks.append(asyncio.create_task(self._stats_loop()))
        await self.stop_event.wait()
        if not self.dead:
            self.emit(vllm_log.shutdown_records(self.vnow(), self.stop_signal))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_all("server shutting down")
        await asyncio.wait_for(runner.cleanup(), 1.0)
        return self.exit_code

    def _on_signal(self, sig: signal.Signals) -> None:
        self.stop_signal = signal.Signals(sig).name
        self.stop_event.set()

    # -- metrics --------------------------------------------------------------------------------

    def render_metrics(self) -> str:
        """vLLM's ``/metrics`` in Prometheus text format (the V1 names, 0.26 help texts)."""
        return self.metrics.render(self.sched, self.config, self.plan, self.served_name, self.dead)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m servetune.sim.server``; returns the exit code.

    Example::

        python -m servetune.sim.server servetune-test-850m --port 8011 --sim-speedup 50
    """
    ns = parse_args(argv)
    try:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        pass
    return asyncio.run(SimServer(ns).run())


if __name__ == "__main__":
    sys.exit(main())
