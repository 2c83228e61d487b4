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
import json
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
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
from servetune.sim.vllm_log import LogRecord

__all__ = ["build_parser", "parse_args", "given_flags", "SimServer", "main"]

_CHARS_PER_TOKEN = 4
_WORDS = (" the", " of", " and", " to", " in", " a", " is", " that", " for", " it", " as", " was", " with",
          " be", " by", " on", " not", " he", " this", " are")


# --------------------------------------------------------------------------------------------
# The server


class SimServer(EngineLoop):
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


    # -- HTTP -----------------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._access_log])
        app.router.add_get("/health", self._health)
        app.router.add_get("/ping", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/load", self._load)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        return app

    @web.middleware
    async def _access_log(self, request: web.Request, handler: Any) -> web.StreamResponse:
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            if not self.ns.disable_uvicorn_access_log:
                peer = request.transport.get_extra_info("peername") if request.transport else None
                where = f"{peer[0]}:{peer[1]}" if peer else "unknown"
                self.emit([vllm_log.access_record(0.0, where, request.method, request.path_qs, status)])

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.dead else 200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.config.vllm_version})

    async def _load(self, request: web.Request) -> web.Response:
        return web.json_response({"server_load": len(self.live)})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.served_name, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": self.model_ref, "parent": None, "max_model_len": self.config.max_model_len,
            "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                            "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}]}]})

    def render_metrics(self) -> str:
        """vLLM's ``/metrics`` in Prometheus text format (the V1 names, 0.26 help texts)."""
        return self.metrics.render(self.sched, self.config, self.plan, self.served_name, self.dead)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.render_metrics(), content_type="text/plain", charset="utf-8")

    def _error(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                                 status=status)

    def _prompts(self, prompt: Any) -> list[Sequence[Any]] | None:
        """Prompt(s) as token sequences: token-id lists exactly, strings as ~4-character tokens."""
        def one(p: Any) -> Sequence[Any] | None:
            if isinstance(p, str):
                return [p[i:i + _CHARS_PER_TOKEN] for i in range(0, len(p), _CHARS_PER_TOKEN)] or [""]
            if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                return p
            return None

        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            single = one(prompt)
            return None if single is None else [single]
        if isinstance(prompt, list) and prompt:
            many = [one(p) for p in prompt]
            return None if any(m is None for m in many) else many  # type: ignore[return-value]
        return None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if self.dead:
            return self._error(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                               "InternalServerError")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._error(400, "Invalid JSON body")
        if not isinstance(body, dict):
            return self._error(400, "Invalid request body")
        model = body.get("model")
        if model is not None and model != self.served_name:
            return self._error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        prompts = self._prompts(body.get("prompt"))
        if prompts is None:
            return self._error(400, "prompt must be a string, a list of token ids, or a list of either")
        mml = self.config.max_model_len
        max_tokens_raw = body.get("max_tokens")
        budgets: list[int] = []
        for p in prompts:
            n = len(p)
            if n >= mml:
                return self._error(400, f"This model's maximum context length is {mml} tokens. However, your prompt "
                                        f"contains {n} input tokens, which exceeds this limit even without any output "
                                        "tokens. Please reduce the length of the input prompt.")
            if max_tokens_raw is None:
                budgets.append(mml - n)
                continue
            if isinstance(max_tokens_raw, bool) or not isinstance(max_tokens_raw, int) or max_tokens_raw < 1:
                return self._error(400, f"max_tokens must be at least 1, got {max_tokens_raw}.", param="max_tokens")
            if n + max_tokens_raw > mml:
                return self._error(400, f"This model's maximum context length is {mml} tokens. However, you "
                                        f"requested {n + max_tokens_raw} tokens ({n} in the messages, "
                                        f"{max_tokens_raw} in the completion). Please reduce the length of the "
                                        "messages or completion.")
            budgets.append(max_tokens_raw)
        queue: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()
        lives: list[Live] = []
        try:
            for i, (p, mt) in enumerate(zip(prompts, budgets)):
                lives.append(self._request(i, p, mt, queue))
        except ValueError as exc:
            if not lives:
                return self._error(400, str(exc))
            raise
        cid = f"cmpl-{uuid.uuid4().hex}"
        stream = bool(body.get("stream", False))
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage", False)) if stream else True
        if stream:
            return await self._stream(request, cid, lives, queue, usage_wanted)
        return await self._unary(cid, lives, queue)

    def _text(self, start: int, n: int) -> str:
        return "".join(_WORDS[(start + k) % len(_WORDS)] for k in range(n))

    def _usage(self, lives: Sequence[Live]) -> dict[str, int]:
        p = sum(x.prompt_tokens for x in lives)
        c = sum(x.generated for x in lives)
        return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}

    async def _unary(self, cid: str, lives: list[Live], queue: asyncio.Queue[tuple[str, int, Any]]) -> web.Response:
        texts = [""] * len(lives)
        produced = [0] * len(lives)
        done = 0
        while done < len(lives):
            kind, idx, value = await queue.get()
            if kind != "tokens":
                return self._error(500, str(value), "InternalServerError")
            n, finish = value
            texts[idx] += self._text(produced[idx], n)
            produced[idx] += n
            if finish is not None:
                done += 1
        choices = [{"index": i, "text": texts[i], "logprobs": None, "finish_reason": "length", "stop_reason": None,
                    "prompt_logprobs": None} for i in range(len(lives))]
        return web.json_response({"id": cid, "object": "text_completion", "created": int(time.time()),
                                  "model": self.served_name, "choices": choices, "usage": self._usage(lives)})

    async def _stream(self, request: web.Request, cid: str, lives: list[Live],
                      queue: asyncio.Queue[tuple[str, int, Any]], usage_wanted: bool) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                       "Cache-Control": "no-cache"})
        created = int(time.time())

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
            data = {"id": cid, "object": "text_completion", "created": created, "model": self.served_name,
                    "choices": choices, "usage": usage}
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

        try:
            await resp.prepare(request)
            return await self._stream_chunks(request, resp, lives, queue, usage_wanted, chunk)
        except ConnectionResetError:
            # The client went away (an early-stopped load cancels its streams): vLLM aborts the
            # request without a traceback; the stand-in stops writing (its engine finishes the work).
            return resp

    async def _stream_chunks(self, request: web.Request, resp: web.StreamResponse, lives: list[Live],
                             queue: asyncio.Queue[tuple[str, int, Any]], usage_wanted: bool,
                             chunk: Callable[..., bytes]) -> web.StreamResponse:
        produced = [0] * len(lives)
        finished = [False] * len(lives)
        while not all(finished):
            kind, idx, value = await queue.get()
            if kind != "tokens":
                err = {"error": {"message": str(value), "type": "InternalServerError", "param": None, "code": 500}}
                await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                # The engine died mid-stream: drop the connection without the final chunk, as a
                # crashed server does, so clients see an incomplete response.
                if request.transport is not None:
                    request.transport.close()
                return resp
            n, finish = value
            await resp.write(chunk([self._choice(idx, self._text(produced[idx], n), finish)]))
            produced[idx] += n
            if finish is not None:
                finished[idx] = True
        if usage_wanted:
            await resp.write(chunk([], self._usage(lives)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _choice(index: int, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}


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
