"""The HTTP side: a Starlette application over the engine thread, and uvicorn to run it.

    GET  /health                  200 {"status": "ok"} (no key needed: for load balancers and probes)
    GET  /v1/models               the one model served
    POST /v1/completions          text completion; "stream": true for server-sent events
    POST /v1/chat/completions     chat completion (the chat template lays the messages out); "stream": true too

A request body is checked (and a chat's template rendered, in a worker process with a deadline) on a thread of the
server's `parsers` pool, never on the event loop: /health and streaming keep answering while a slow template runs,
and SIGTERM is honoured (closing the server stops the template workers). Each request becomes one Job in the
continuous engine. Its tokens come back through an asyncio queue; a client that
goes away (its connection closes) cancels the job, which frees its slot before the next step. Errors are OpenAI
error objects; an unexpected exception is logged here and answered with a bare 500 object, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..batching import ContinuousEngine
from ..chat.worker import close_workers
from ..errors import GenerationError, NpllmError
from .engine import EngineThread, Job
from .protocol import (ApiError, Context, Output, chat_body, chat_chunk, completion_body, completion_chunk, new_id,
                       parse_chat, parse_completion)

log = logging.getLogger("npllm.serve")
PARSE_THREADS = 4  # requests checked (tokenized, their chat template rendered) at once, off the event loop


@dataclass
class Limits:
    """The server's bounds: how many requests run together, wait, how long they may be, how big a body is."""

    max_slots: int = 8
    max_queue: int = 64  # requests waiting beyond the running ones; one more is answered 429
    max_tokens_limit: int = 4096
    max_body_bytes: int = 1 << 20


class Server:
    """The state every route shares: the model's context for parsing, the engine thread, the count of jobs."""

    def __init__(self, llm, model_name: str, limits: Limits, chat_template: str | None = None,
                 template_problem: str = "", api_key: str | None = None, template_name: str = ""):
        if llm.tokenizer is None:
            raise GenerationError("the model has no tokenizer: serving text needs one")
        self.llm, self.limits, self.api_key = llm, limits, api_key
        self.context = Context(model_name, llm.tokenizer, llm.config, limits.max_tokens_limit, chat_template,
                               template_problem, template_name)
        self.engine = EngineThread(ContinuousEngine(llm.model, slots=limits.max_slots))
        self.parsers = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="npllm-parse")
        self.active = 0  # jobs admitted and not finished (touched only on the event loop)

    def start(self) -> None:
        self.engine.start()

    def close(self) -> None:
        self.engine.close()
        close_workers()  # a render still running (past the grace period) ends now, and its thread with it
        self.parsers.shutdown(wait=False, cancel_futures=True)

    async def parse(self, parse, body):
        """parse(body, context) on a thread of `parsers`: tokenizing a prompt, rendering a chat template."""
        return await asyncio.get_running_loop().run_in_executor(self.parsers, parse, body, self.context)

    def check_key(self, request: HttpRequest) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # compare_digest: the time taken does not tell how much of a guessed key was right
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "invalid API key: send it as 'Authorization: Bearer KEY'", None, "invalid_api_key")

    async def read_json(self, request: HttpRequest):
        """The body as JSON, refused (413) past the size limit whether or not Content-Length says so."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body is {declared} bytes; the limit is {limit}")
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise ApiError(413, f"the request body is over the limit of {limit} bytes")
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None

    def submit(self, spec, loop: asyncio.AbstractEventLoop) -> tuple[Job, asyncio.Queue]:
        if self.active >= self.limits.max_slots + self.limits.max_queue:
            raise ApiError(429, f"the server is busy ({self.active} requests running or waiting); retry later",
                           None, "rate_limit_exceeded")
        events: asyncio.Queue = asyncio.Queue()

        def deliver(event) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop has closed (shutdown): nobody is waiting for the event
                pass

        job = Job(spec.request, deliver)
        self.active += 1
        self.engine.submit(job)
        return job, events


def create_app(server: Server, cors_origins: list[str] | None = None) -> Starlette:
    """The ASGI application. CORS headers only for the origins given (none by default: browsers refuse)."""
    async def health(request):
        return JSONResponse({"status": "ok"})

    async def models(request):
        server.check_key(request)
        return JSONResponse({"object": "list", "data": [{"id": server.context.model_name, "object": "model",
                                                         "created": 0, "owned_by": "npllm"}]})

    async def completions(request):
        return await generation(request, parse_completion)

    async def chat_completions(request):
        return await generation(request, parse_chat)

    async def generation(request, parse):
        server.check_key(request)
        body = await server.read_json(request)
        try:
            spec = await server.parse(parse, body)
        except NpllmError as e:  # a check below the API's own (the tokenizer, the sampler): still the request's fault
            raise ApiError(400, str(e)) from None
        job, events = server.submit(spec, asyncio.get_running_loop())
        return GenerationResponse(server, spec, job, events)

    middleware = []
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    routes = [Route("/health", health), Route("/v1/models", models),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    handlers = {ApiError: api_error, HTTPException: http_error, Exception: unexpected_error}
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


async def api_error(request, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status)


async def http_error(request, e: HTTPException):
    messages = {404: f"no such endpoint: {request.method} {request.url.path}",
                405: f"method {request.method} is not allowed on {request.url.path}"}
    return await api_error(request, ApiError(e.status_code, messages.get(e.status_code, str(e.detail))))


async def unexpected_error(request, e: Exception):
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=e)
    return await api_error(request, ApiError(500, "internal server error"))


class GenerationResponse:
    """An ASGI response that runs one job: its JSON body once done, or its chunks as server-sent events.

    While it runs it watches the connection: a disconnect (or the server cancelling this task at shutdown) cancels
    the job in the engine, so its slot is free for the next request.
    """

    def __init__(self, server: Server, spec, job: Job, events: asyncio.Queue):
        self.server, self.spec, self.job, self.events = server, spec, job, events
        self.output = Output(spec, server.context.tokenizer)
        self.id = new_id("chatcmpl" if spec.chat else "cmpl")
        self.model = server.context.model_name

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            if self.spec.stream:
                await self._stream(send)
            else:
                await self._whole(send)
        except OSError:  # the client went away mid-send
            pass
        finally:
            watcher.cancel()
            if not self.job.finished:
                self.server.engine.cancel(self.job)
            self.server.active -= 1

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.server.engine.cancel(self.job)

    async def _pieces(self):
        """(piece, None) for each token, then (tail piece, finish_reason) once; ApiError(500) if the engine failed."""
        while True:
            kind, value = await self.events.get()
            if kind == "token":
                piece = self.output.feed(value)
                if self.output.stopped:  # a stop string ended the text: the engine need not go on
                    self.server.engine.cancel(self.job)
                    yield piece, None
                    yield self.output.finish("stop"), self.output.finish_reason
                    return
                yield piece, None
            elif kind == "done":
                yield self.output.finish(value), self.output.finish_reason
                return
            else:
                raise ApiError(500, value)

    async def _whole(self, send) -> None:
        pieces = []
        try:
            async for piece, _ in self._pieces():
                pieces.append(piece)
        except ApiError as e:
            await _send_json(send, e.status, e.body())
            return
        pieces = [p for p in pieces if p.token or p.logprob is not None]  # token entries, not the tail
        build = chat_body if self.spec.chat else completion_body
        await _send_json(send, 200, build(self.id, self.model, self.output, pieces))

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        if self.spec.chat:
            await _send_event(send, chat_chunk(self.id, self.model, {"role": "assistant", "content": ""}, None))
        wants_lp = self.spec.logprobs is not None
        try:
            async for piece, finish in self._pieces():
                if piece.text or (wants_lp and piece.token) or finish is not None:
                    await _send_event(send, self._chunk(piece, finish, wants_lp))
        except ApiError as e:
            await _send_event(send, e.body())
        else:
            if self.spec.include_usage:
                usage = self.output.usage()
                chunk = (chat_chunk(self.id, self.model, {}, None, usage=usage) if self.spec.chat
                         else completion_chunk(self.id, self.model, None, None, False, usage=usage))
                await _send_event(send, chunk)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    def _chunk(self, piece, finish, wants_lp) -> dict:
        if not self.spec.chat:
            return completion_chunk(self.id, self.model, piece, finish, wants_lp)
        if finish is not None and not piece.text:
            return chat_chunk(self.id, self.model, {}, finish)
        return chat_chunk(self.id, self.model, {"content": piece.text}, finish, piece, wants_lp)


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _send_event(send, data: dict) -> None:
    await send({"type": "http.response.body", "body": f"data: {json.dumps(data)}\n\n".encode(), "more_body": True})


# ----------------------------------------------------------------------------------------------------------------
# Running it
# ----------------------------------------------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: one the system picks, read back from the socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # connections accepted from it inherit TCP_NODELAY: a response's head and body, or two streamed chunks, written
    # back to back must not wait for the client's delayed ACK (about 40 ms on Linux) of the one before
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_uvicorn(app, grace: float, log_level: str = "warning", on_started=None):
    """A uvicorn server that, on SIGTERM or Ctrl-C, stops accepting, gives in-flight requests `grace` seconds, then
    cancels them, and returns normally (uvicorn itself re-raises the signal afterwards, which would end the process
    with the signal's status instead of 0). on_started() is called once it accepts connections, its signal handlers
    in place, so whoever reads that announcement may send SIGTERM at once."""
    import uvicorn

    class Quiet(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_started is not None and not self.should_exit:
                on_started()

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace, lifespan="off",
                            access_log=False)
    return Quiet(config)


def run(server: Server, host: str, port: int, grace: float, cors_origins=None, announce=sys.stderr) -> int:
    """Serve until SIGTERM / Ctrl-C; exit status 0 after a clean shutdown."""
    sock = listen(host, port)
    bound = sock.getsockname()[1]

    def started():
        print(f"[npllm] serving {server.context.model_name} on http://{host}:{bound}/v1 "
              f"({server.limits.max_slots} slots)", file=announce, flush=True)

    uv = make_uvicorn(create_app(server, cors_origins), grace, on_started=started)
    server.start()
    try:
        uv.run(sockets=[sock])
    finally:
        server.close()
        sock.close()
    print("[npllm] server stopped", file=announce, flush=True)
    return 0
