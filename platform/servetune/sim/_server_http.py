"""The stand-in's HTTP surface: vLLM's OpenAI-compatible endpoints and its access log.

Contract: :class:`OpenAIApi` is the part of :class:`servetune.sim.server.SimServer` that answers
HTTP: ``GET /health`` and ``/ping`` (200, or 503 once the engine died), ``/version``, ``/load``,
``/metrics``, ``/v1/models``, and ``POST /v1/completions`` (token-id or text prompts, one or many;
streamed as SSE chunks with the finish reason on the last token and the usage chunk on request, or
one JSON body), with vLLM's error bodies for a bad request (400), an unknown model (404) and a dead
engine (500). Text prompts count ~4 characters per token; the simulated model never emits EOS, so
every choice finishes with ``length``. Each request writes vLLM's uvicorn access line unless
``--disable-uvicorn-access-log``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from servetune.sim import vllm_log

if TYPE_CHECKING:
    from servetune.sim._server_engine import Live
    from servetune.sim.vllm_log import LogRecord

__all__ = ["OpenAIApi"]

_CHARS_PER_TOKEN = 4
_WORDS = (" the", " of", " and", " to", " in", " a", " is", " that", " for", " it", " as", " was", " with",
          " be", " by", " on", " not", " he", " this", " are")


class OpenAIApi:
    """The HTTP app: routes, handlers, the completions' bodies and streams (a mixin of
    :class:`servetune.sim.server.SimServer`)."""

    # The server's state this part reads (``SimServer.__init__`` and ``SimServer.run`` make it).
    ns: argparse.Namespace
    config: Any
    model_ref: str
    served_name: str
    created: int
    dead: bool
    live: dict[str, Live]

    if TYPE_CHECKING:  # the server's output, its metrics and the engine's intake
        def emit(self, records: Iterable[LogRecord]) -> None: ...
        def render_metrics(self) -> str: ...
        def _request(self, index: int, prompt: Sequence[Any], max_tokens: int,
                     queue: asyncio.Queue[tuple[str, int, Any]]) -> Live: ...

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
