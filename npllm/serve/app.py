"""The HTTP side: a Starlette application over the engine thread, and uvicorn to run it.

    GET  /health                  200 {"status": "ok"}, with "prefix_cache": its size and hit rate when it is on
                                  (no key needed: for load balancers and probes)
    GET  /metrics                 the same counts as Prometheus text (npllm_prefix_cache_*)
    GET  /v1/models               the one model served
    POST /v1/completions          text completion; "stream": true for server-sent events
    POST /v1/chat/completions     chat completion (the chat template lays the messages out); "stream": true too

A request body is checked (its prompt tokenized, a chat's template rendered in a worker process with a deadline) on
a thread of one of the server's two Lanes, never on the event loop: /health and streaming keep answering while a
slow template runs, and SIGTERM is honoured (closing the server stops the template workers). Plain completions and
chats have a lane each, so chats whose template runs to its deadline delay no completion; each lane admits a
bounded number of requests (running and waiting), and one more is answered 429 before any work is done on it. A
prompt far past the context is refused before it is tokenized whole (npllm.context.encode_prompt). Each request
becomes one Job in the continuous engine. Its tokens come back through an asyncio queue; a client that
goes away (its connection closes) cancels the job, which frees its slot before the next step. Errors are OpenAI
error objects; an unexpected exception is logged here and answered with a bare 500 object, never a traceback.

Clients that hold connections without finishing a request (slowloris) are bounded by `Limits`: a request's head must
arrive within `header_timeout` seconds (GuardedH11Protocol), its body within `body_timeout` (Server.read_body), an idle
keep-alive connection closes after `keep_alive_timeout`, and past `max_connections` open connections a new one is
answered 503 and closed at once, so the process never runs out of file descriptors and stops accepting. These
guards use uvicorn's internals, only with a uvicorn in TESTED_UVICORN (outside it: one notice, uvicorn's own h11).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from ..batching import ContinuousEngine
from ..chat.worker import MOST_WORKERS, close_workers
from ..embed import embed_ids
from ..errors import GenerationError, NpllmError
from ..versions import Fence
from .engine import EngineThread, Job, prefix_log
from .protocol import (ApiError, Context, Output, chat_body, chat_chunk, completion_body, completion_chunk,
                       embeddings_body, new_id, parse_chat, parse_completion, parse_embeddings, parse_json,
                       reply_message, usage, with_timings)
from .tools import call_chunks

log = logging.getLogger("npllm.serve")
PARSE_THREADS = 4  # completions checked (tokenized) at once, off the event loop
RENDER_THREADS = MOST_WORKERS  # chats checked at once: their templates render in that many worker processes
# The uvicorn versions whose internals the connection guards use (H11Protocol's hooks and its cycle, loop and
# transport; Server.server_state.connections) are known in: [first, first not), as (major, minor). Read side by side
# in 0.30.0 and 0.55.0; the suite runs on 0.55. pyproject.toml allows this range.
TESTED_UVICORN = ((0, 30), (0, 56))
UVICORN_FENCE = Fence("uvicorn", TESTED_UVICORN, "connection guards",
                      "the server runs on uvicorn's plain h11 protocol, without the deadline on a request's head, "
                      "and past --max-connections uvicorn answers 503 itself (its limit_concurrency)")


def guards_tested() -> bool:
    """Whether the installed uvicorn lies in TESTED_UVICORN (outside it, one notice on stderr: versions.Fence)."""
    import uvicorn

    return UVICORN_FENCE.holds(uvicorn.__version__)


@dataclass
class Limits:
    """The server's bounds: how many requests run together, wait, how long they may be, how big a body is, and how
    long and how many connections a client may hold."""

    max_slots: int = 8
    max_queue: int = 64  # requests waiting beyond the running ones; one more is answered 429
    max_tokens_limit: int = 4096
    max_body_bytes: int = 1 << 20
    max_connections: int = 256  # open connections; one more is answered 503 and closed at once
    header_timeout: float = 10.0  # seconds for a request's head, from the connection or the first byte after a response
    body_timeout: float = 30.0  # seconds for a request's whole body, from its head on; then 408
    keep_alive_timeout: float = 5.0  # seconds an idle connection stays open after a response
    max_parse_queue: int = 16  # per lane: requests waiting to be checked beyond those being checked; one more: 429


def check_api_key(key: str | None) -> None:
    """Refuse a key no client could send or that would accept an empty token: empty, blank at either end (HTTP
    strips header values), or outside printable ASCII (header values are bytes; the comparison is of ASCII text).
    None means no key."""
    if key is None:
        return
    if not key:
        raise GenerationError("the API key is empty (--api-key or $NPLLM_API_KEY): it would accept an empty "
                              "'Bearer' token; give a real key, or unset NPLLM_API_KEY to serve without one")
    if key != key.strip() or not (key.isascii() and key.isprintable()):
        raise GenerationError("the API key must be printable ASCII with no spaces at either end (clients send it "
                              "in an HTTP header)")


class Server:
    """The state every route shares: the model's context for parsing, the engine thread, the count of jobs."""

    def __init__(self, llm, model_name: str, limits: Limits, chat_template: str | None = None,
                 template_problem: str = "", api_key: str | None = None, template_name: str = ""):
        if llm.tokenizer is None:
            raise GenerationError("the model has no tokenizer: serving text needs one")
        check_api_key(api_key)
        self.llm, self.limits, self.api_key = llm, limits, api_key
        self.context = Context(model_name, llm.tokenizer, llm.config, limits.max_tokens_limit, chat_template,
                               template_problem, template_name)
        # the LLM's prefix cache (npllm.prefix_cache; --prefix-cache-mib): shared prompt beginnings computed once
        self.engine = EngineThread(ContinuousEngine(llm.model, slots=limits.max_slots,
                                                    prefix_cache=getattr(llm, "prefix_cache", None)))
        self.completions = Lane("completion", PARSE_THREADS, limits.max_parse_queue)
        self.renders = Lane("chat", RENDER_THREADS, limits.max_parse_queue)
        self.active = 0  # jobs admitted and not finished (touched only on the event loop)

    def start(self) -> None:
        self.engine.start()

    def close(self) -> None:
        self.engine.close()
        close_workers()  # a render still running (past the grace period) ends now, and its thread with it
        self.completions.close()
        self.renders.close()

    def check_key(self, request: HttpRequest) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # compare_digest: the time taken does not tell how much of a guessed key was right
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "invalid API key: send it as 'Authorization: Bearer KEY'", None, "invalid_api_key")

    async def read_body(self, request: HttpRequest) -> bytearray:
        """The body's bytes: 413 past the size limit whether or not Content-Length says so, 408 when it has not all
        arrived within the body timeout. (parse_json reads it, on a lane's thread.)"""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body is {declared} bytes; the limit is {limit}")

        async def gather() -> bytearray:
            data = bytearray()
            async for part in request.stream():
                data += part
                if len(data) > limit:
                    raise ApiError(413, f"the request body is over the limit of {limit} bytes")
            return data

        try:
            data = await asyncio.wait_for(gather(), self.limits.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout:g} s") from None
        return data

    def submit(self, spec, loop: asyncio.AbstractEventLoop) -> tuple[list[Job], asyncio.Queue]:
        """A job per choice (spec.requests()), their events on one queue as (choice index, event)."""
        if self.active + spec.n > self.limits.max_slots + self.limits.max_queue:
            raise ApiError(429, f"the server is busy ({self.active} jobs running or waiting); retry later",
                           None, "rate_limit_exceeded")
        events: asyncio.Queue = asyncio.Queue()

        def deliverer(index: int):
            def deliver(event) -> None:  # called on the engine thread
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
                except RuntimeError:  # the event loop has closed (shutdown): nobody is waiting for the event
                    pass

            return deliver

        jobs = [Job(request, deliverer(i)) for i, request in enumerate(spec.requests())]
        self.active += len(jobs)
        for job in jobs:
            self.engine.submit(job)
        return jobs, events


    async def embed(self, spec) -> list:
        """The vectors of an embeddings request, computed on the engine thread between two steps (the model is
        the engine's); counted as one job against the queue while it waits and runs."""
        if self.active + 1 > self.limits.max_slots + self.limits.max_queue:
            raise ApiError(429, f"the server is busy ({self.active} jobs running or waiting); retry later",
                           None, "rate_limit_exceeded")
        model = self.llm.model
        self.active += 1
        try:
            return await asyncio.wrap_future(self.engine.call(
                lambda: [embed_ids(model, ids, spec.pooling, spec.normalize) for ids in spec.inputs]))
        finally:
            self.active -= 1


class Lane:
    """Threads that check one kind of request (plain completions, chats), and how many requests it admits: `threads`
    checked at once, up to `waiting` more waiting for a thread; one more is answered 429 at once, before any work
    is done on it (the body is read: a client still sending would otherwise see its connection reset, not the
    answer). Each kind has its own, so chats whose template runs to its deadline hold no thread a completion needs."""

    def __init__(self, kind: str, threads: int, waiting: int):
        self.kind, self.most = kind, threads + waiting
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=f"npllm-{kind}")
        self.admitted = 0  # being checked or waiting to be (touched only on the event loop)

    async def run(self, parse, data: bytes, context):
        """parse(the body data as JSON, context) on one of the lane's threads; ApiError(429) when the lane is
        full."""
        if self.admitted >= self.most:
            raise ApiError(429, f"the server is busy ({self.admitted} {self.kind} requests being checked or "
                           "waiting to be); retry later", None, "rate_limit_exceeded")
        self.admitted += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, _parse, parse, data, context)
        finally:
            self.admitted -= 1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


async def _checked_spec(server: Server, lane: Lane, parse, data: bytes):
    """The request checked by `parse` on one of the lane's threads."""
    try:
        return await lane.run(parse, data, server.context)
    except NpllmError as e:  # a check below the API's own (the tokenizer, the sampler): still the request's fault
        raise ApiError(400, str(e)) from None


def _parse(parse, data: bytes, context):
    return parse(parse_json(data), context)


def create_app(server: Server, cors_origins: list[str] | None = None) -> Starlette:
    """The ASGI application. CORS headers only for the origins given (none by default: browsers refuse)."""
    async def health(request):
        report = server.engine.prefix_report()
        return JSONResponse({"status": "ok", **({"prefix_cache": report} if report is not None else {})})

    async def metrics(request):
        return PlainTextResponse(prometheus(server.engine.prefix_report()))

    async def models(request):
        server.check_key(request)
        return JSONResponse({"object": "list", "data": [{"id": server.context.model_name, "object": "model",
                                                         "created": 0, "owned_by": "npllm"}]})

    async def completions(request):
        return await generation(request, server.completions, parse_completion)

    async def chat_completions(request):
        return await generation(request, server.renders, parse_chat)

    async def embeddings(request):
        server.check_key(request)
        spec = await _checked_spec(server, server.completions, parse_embeddings, await server.read_body(request))
        return JSONResponse(embeddings_body(server.context.model_name, spec, await server.embed(spec)))

    async def generation(request, lane: Lane, parse):
        server.check_key(request)
        spec = await _checked_spec(server, lane, parse, await server.read_body(request))
        jobs, events = server.submit(spec, asyncio.get_running_loop())
        return GenerationResponse(server, spec, jobs, events)

    middleware = []
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    routes = [Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/embeddings", embeddings, methods=["POST"])]
    handlers = {ApiError: api_error, HTTPException: http_error, ClientDisconnect: client_gone,
                Exception: unexpected_error}
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


def prometheus(report: dict | None) -> str:
    """The prefix cache's counts (PrefixCache.report) as Prometheus text; nothing but a comment when it is off."""
    if report is None:
        return "# npllm: the prefix cache is off\n"
    lines = []
    for name in ("blocks", "bytes", "budget_bytes", "lookups", "hits", "prompt_tokens", "cached_tokens", "hit_rate",
                 "evicted_blocks"):
        kind = "gauge" if name in ("blocks", "bytes", "budget_bytes", "hit_rate") else "counter"
        lines += [f"# TYPE npllm_prefix_cache_{name} {kind}", f"npllm_prefix_cache_{name} {report[name]}"]
    return "\n".join(lines) + "\n"


async def api_error(request, e: ApiError):
    # 408: the client stopped sending its body half-way; the connection cannot carry another request
    headers = {"connection": "close"} if e.status == 408 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def client_gone(request, e: ClientDisconnect):
    """The client closed its connection before its body had all arrived: nobody to answer, nothing to log (a
    client's choice, not the server's fault; logging it would let clients flood the log)."""
    log.debug("client went away mid-body on %s %s", request.method, request.url.path)
    return JSONResponse({}, status_code=400)  # sent nowhere: the connection is gone


async def http_error(request, e: HTTPException):
    messages = {404: f"no such endpoint: {request.method} {request.url.path}",
                405: f"method {request.method} is not allowed on {request.url.path}"}
    return await api_error(request, ApiError(e.status_code, messages.get(e.status_code, str(e.detail))))


async def unexpected_error(request, e: Exception):
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=e)
    return await api_error(request, ApiError(500, "internal server error"))


class GenerationResponse:
    """An ASGI response that runs a request's jobs (one per choice): its JSON body once all are done, or their
    chunks as server-sent events, each choice's keyed by its index.

    While it runs it watches the connection: a disconnect (or the server cancelling this task at shutdown) cancels
    the jobs in the engine, so their slots are free for the next request, and a stream stops sending (quietly: a
    client that goes away is no event for the log).
    """

    def __init__(self, server: Server, spec, jobs: list[Job], events: asyncio.Queue):
        self.server, self.spec, self.jobs, self.events = server, spec, jobs, events
        self.outputs = [Output(spec, server.context.tokenizer) for _ in jobs]
        self.id = new_id("chatcmpl" if spec.chat else "cmpl")
        self.model = server.context.model_name
        self.gone = False  # the client disconnected: nothing more is sent

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
            self._cancel()
            self.server.active -= len(self.jobs)

    def _cancel(self) -> None:
        for job in self.jobs:
            if not job.finished:
                self.server.engine.cancel(job)

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self._cancel()

    async def _pieces(self):
        """(choice, piece, None) for each token, then (choice, tail piece, finish_reason) once per choice, in the
        order the engine gives them; ApiError(500) if the engine failed."""
        ended = [False] * len(self.jobs)
        while not all(ended):
            i, (kind, value) = await self.events.get()
            if ended[i]:  # a choice cut by its stop string: what the engine still sent before the cancel
                continue
            output = self.outputs[i]
            if kind == "token":
                piece = output.feed(value)
                yield i, piece, None
                if output.stopped:  # a stop string ended the text: the engine need not go on
                    self.server.engine.cancel(self.jobs[i])
                    ended[i] = True
                    output.ended(self.jobs[i].handle)
                    yield i, output.finish("stop"), output.finish_reason
            elif kind == "done":
                ended[i] = True
                output.ended(self.jobs[i].handle)
                yield i, output.finish(value), output.finish_reason
            else:
                raise ApiError(500, value)

    async def _whole(self, send) -> None:
        pieces = [[] for _ in self.jobs]
        try:
            async for i, piece, _ in self._pieces():
                if piece.token or piece.logprob is not None:  # token entries, not the tail
                    pieces[i].append(piece)
        except ApiError as e:
            await _send_json(send, e.status, e.body())
            return
        build = chat_body if self.spec.chat else completion_body
        await _send_json(send, 200, build(self.id, self.model, self.outputs, pieces))

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        if self.spec.chat:
            for i in range(len(self.jobs)):
                await _send_event(send, chat_chunk(self.id, self.model, {"role": "assistant", "content": ""}, None,
                                                   index=i))
        wants_lp = self.spec.logprobs is not None
        if self.spec.calls_tools:  # a reply that may be tool calls is read whole, then streamed as OpenAI does
            return await self._stream_reply(send)
        try:
            async for i, piece, finish in self._pieces():
                if piece.text or (wants_lp and piece.token) or finish is not None:
                    await self._send_event(send, self._chunk(i, piece, finish, wants_lp))
                if self.gone:
                    log.debug("a client went away mid-stream; its job is cancelled")
                    return
        except ApiError as e:
            await self._send_event(send, e.body())
        else:
            if self.spec.include_usage:
                totals = usage(self.outputs)
                chunk = (chat_chunk(self.id, self.model, {}, None, usage=totals) if self.spec.chat
                         else completion_chunk(self.id, self.model, None, None, False, usage=totals))
                await self._send_event(send, chunk)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _stream_reply(self, send) -> None:
        """A chat reply under tools: generated whole, then, choice by choice, its calls as index-keyed deltas whose
        argument fragments concatenate to each call's arguments (or its text as one delta) and its finish chunk;
        usage, [DONE]."""
        try:
            async for _ in self._pieces():
                if self.gone:
                    return
        except ApiError as e:
            await self._send_event(send, e.body())
        else:
            for i, output in enumerate(self.outputs):
                message, finish = reply_message(output)
                deltas = call_chunks(message["tool_calls"]) if "tool_calls" in message else [{"content": output.text}]
                for delta in deltas:
                    await self._send_event(send, chat_chunk(self.id, self.model, delta, None, index=i))
                await self._send_event(send, chat_chunk(self.id, self.model, {}, finish, index=i))
            if self.spec.include_usage:
                await self._send_event(send, chat_chunk(self.id, self.model, {}, None, usage=usage(self.outputs)))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _send_event(self, send, data: dict) -> None:
        """One server-sent event, then a turn of the event loop. A send does not wait while the socket takes the
        bytes, and the queue may hold many tokens (the loop was busy): without the turn, a stream whose client has
        gone would write them all before the loop notices the lost connection, and asyncio logs a warning for each
        write to it past the fifth. After the turn the transport knows, and the watcher has seen the disconnect."""
        await _send_event(send, data)
        await asyncio.sleep(0)

    def _chunk(self, i: int, piece, finish, wants_lp) -> dict:
        """One streamed chunk; a choice's last one (with its finish_reason) carries llama.cpp's `timings` too."""
        if not self.spec.chat:
            chunk = completion_chunk(self.id, self.model, piece, finish, wants_lp, index=i)
        elif finish is not None and not piece.text:
            chunk = chat_chunk(self.id, self.model, {}, finish, index=i)
        else:
            chunk = chat_chunk(self.id, self.model, {"content": piece.text}, finish, piece, wants_lp, index=i)
        return {**chunk, **with_timings([self.outputs[i]])} if finish is not None else chunk


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


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, not yet listening (port 0: one the system picks, read back from the socket).
    Bound before the model loads, so a port in use or a host that does not resolve is one clear error at once;
    connections are refused, not left waiting, until the server listens. GenerationError says what went wrong."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    try:
        address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)[0][4]
    except (socket.gaierror, UnicodeError) as e:
        raise GenerationError(f"cannot listen on {where}: the host {host!r} does not resolve to an address "
                              f"({getattr(e, 'strerror', None) or e})") from None
    sock = GuardedSocket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # connections accepted from it inherit TCP_NODELAY: a response's head and body, or two streamed chunks,
        # written back to back must not wait for the client's delayed ACK (about 40 ms on Linux) of the one before
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise GenerationError(f"cannot listen on {where}: {_bind_problem(e)}") from None
    sock.set_inheritable(True)
    return sock


def _bind_problem(e: OSError) -> str:
    """Why bind() failed, in words that say what to do."""
    import errno

    if e.errno == errno.EADDRINUSE:
        return "the port is in use (another server?); choose another --port, or 0 for any free one"
    if e.errno == errno.EADDRNOTAVAIL:
        return "that address is not one of this machine's (--host 127.0.0.1 or 0.0.0.0 are)"
    if e.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    return e.strerror or str(e)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket: bind(host, port), then listening."""
    sock = bind(host, port)
    sock.listen(2048)
    return sock


def connection_cap(wanted: int, reserve: int = 16) -> tuple[int, str]:
    """How many connections this process can hold open: `wanted`, unless the open-files limit (ulimit -n) cannot fit
    them beside the files already open plus `reserve`. The soft limit is first raised toward the hard one; if it
    still does not fit, fewer. Returns (cap, a warning to show, or ""); GenerationError if no connection fits.

    Past the open-files limit accept() fails (EMFILE): asyncio logs a traceback for each try and answers nobody
    while the connections are held. Under the cap, GuardedSocket answers the extra connections with 503 instead."""
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return wanted, ""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    used = _open_files() + reserve
    if soft != unlimited and soft < wanted + used:
        raised = wanted + used if hard == unlimited else min(wanted + used, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == unlimited or soft >= wanted + used:
        return wanted, ""
    cap = soft - used
    if cap < 1:
        raise GenerationError(f"the open-files limit ({soft}, ulimit -n) leaves no room for connections: "
                              f"{used - reserve} files are open; raise it")
    return cap, (f"--max-connections lowered from {wanted} to {cap}: this process may open {soft} files "
                 f"(ulimit -n) and {used - reserve} are open")


def _open_files() -> int:
    """How many file descriptors this process has open (Linux, macOS); 64 where it cannot be told."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 64


class Gate:
    """How many connections a server holds, and whether one more fits under `limit`: those uvicorn tracks (`live`,
    its set of open connections) plus those accepted and not yet handed to a protocol (`pending`)."""

    def __init__(self, limit: int, live=()):
        self.limit, self.live, self.pending = limit, live, 0

    def admit(self) -> bool:
        if len(self.live) + self.pending >= self.limit:
            return False
        self.pending += 1
        return True

    def made(self) -> None:
        """A connection admitted earlier has its protocol (it is in `live` now)."""
        self.pending = max(0, self.pending - 1)


class GuardedSocket(socket.socket):
    """A listening socket that turns away connections past its gate's limit as it accepts them: each is answered
    `refusal` (a 503) and closed at once, so the process never holds more descriptors than the limit allows.

    Refusing later, in the protocol, would be too late: asyncio accepts every waiting connection (up to the backlog)
    in one go before any protocol runs, and past the open-files limit accept() fails with EMFILE, which asyncio logs
    with a traceback per attempt, up to the backlog's count each time, and then answers nobody until it retries."""

    gate: Gate | None = None
    refusal: bytes = b""

    def accept(self):
        while True:
            conn, address = super().accept()  # BlockingIOError once none is waiting: asyncio stops there
            if self.gate is None or self.gate.admit():
                return conn, address
            _refuse(conn, self.refusal)


def _refuse(conn: socket.socket, response: bytes) -> None:
    """Answer a connection with `response` and close it, without waiting for anything."""
    try:
        conn.setblocking(False)
        conn.recv(1 << 16)  # what already arrived: closing with unread data would reset the connection at once
    except OSError:
        pass
    try:
        conn.send(response)
    except OSError:
        pass
    conn.close()


class HeadDeadline:
    """The head deadline of guarded_protocol's connections: a timer that closes the transport unless a new request
    head arrives within `header_timeout` seconds. Mixed into uvicorn's H11Protocol (self.loop, self.transport and
    self.cycle are its own)."""

    header_timeout = 10.0
    deadline = None  # the TimerHandle that closes the connection unless a new request head arrives
    waiting_after = None  # the last request cycle answered: while it is current, a new head is awaited

    def _arm(self) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expire(self) -> None:
        self.deadline = None
        if self.cycle is self.waiting_after and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(limits: Limits, gate: Gate):
    """uvicorn's h11 protocol with a deadline on each request's head (slowloris): it must arrive whole within
    limits.header_timeout seconds of the connection's start, or of the first byte after the last response, else the
    connection is closed. The deadline is for the whole head, however slowly it trickles; it also ends a client that
    trickles the rest of a body the server answered without reading (a 413, a GET with a body). Each connection
    made tells `gate` that it is no longer pending.

    uvicorn's keep-alive timeout closes a connection idle after a response; the body's deadline is the
    application's (Server.read_body); h11 bounds the head's size (400 once more than 16 KiB of it waits incomplete);
    GuardedSocket bounds the number of connections."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(HeadDeadline, H11Protocol):
        header_timeout = limits.header_timeout

        def connection_made(self, transport) -> None:
            gate.made()
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not self.waiting_after:  # a new request's head came (its body may follow)
                self._disarm()
            elif self.deadline is None and not self.transport.is_closing():  # the first bytes after a response
                self._arm()

        def _should_upgrade(self) -> bool:
            return False  # no WebSockets here: served as plain HTTP, without uvicorn's two warnings per request

        def on_response_complete(self) -> None:
            self.waiting_after = self.cycle
            super().on_response_complete()  # arms uvicorn's keep-alive timeout

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


def _raw_response(status: int, reason: str, body: bytes) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for a connection refused before h11 parsed anything."""
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n")
    return head.encode() + body


def make_uvicorn(app, grace: float, log_level: str = "warning", on_started=None, limits: Limits | None = None):
    """A uvicorn server that, on SIGTERM or Ctrl-C, stops accepting, gives in-flight requests `grace` seconds, then
    cancels them, and returns normally (uvicorn itself re-raises the signal afterwards, which would end the process
    with the signal's status instead of 0). on_started() is called once it accepts connections, its signal handlers
    in place, so whoever reads that announcement may send SIGTERM at once. Connections are bounded by `limits`
    (guarded_protocol: always h11, whether or not httptools is installed; with a uvicorn outside TESTED_UVICORN,
    uvicorn's plain h11 protocol and its own connection limit)."""
    import uvicorn

    limits = limits or Limits()
    gate = Gate(limits.max_connections) if guards_tested() else None
    busy = ApiError(503, f"the server holds its limit of {limits.max_connections} connections; retry later")
    refusal = _raw_response(503, "Service Unavailable", json.dumps(busy.body()).encode())

    class Quiet(uvicorn.Server):
        async def startup(self, sockets=None):
            for sock in sockets or ():
                if not isinstance(sock, GuardedSocket):
                    raise TypeError("serve on sockets made by npllm.serve.app.bind() or listen()")
                sock.gate, sock.refusal = gate, refusal
            if gate is not None:
                gate.live = self.server_state.connections
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

    return Quiet(uvicorn_config(uvicorn, app, grace, log_level, limits, gate))


def uvicorn_config(uvicorn, app, grace: float, log_level: str, limits: Limits, gate: Gate | None):
    """make_uvicorn's uvicorn.Config: asyncio's own loop (not uvloop, which accepts in C, past GuardedSocket.accept),
    h11 (not httptools, which guarded_protocol does not wrap), no WebSockets (an upgraded connection would leave the
    header deadline). Without a gate (a uvicorn outside TESTED_UVICORN) the protocol is uvicorn's own h11 and
    uvicorn answers 503 past max_connections itself."""
    http = "h11" if gate is None else guarded_protocol(limits, gate)
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace, lifespan="off",
                          access_log=False, loop="asyncio", http=http, ws="none",
                          timeout_keep_alive=limits.keep_alive_timeout,
                          limit_concurrency=limits.max_connections if gate is None else None)


def show_prefix_log(stream) -> None:
    """The prefix cache's hit rate lines (engine.prefix_log, info level, once a minute) on `stream`, as [npllm]
    lines: Python's default shows only warnings and above. Once per process."""
    if not any(getattr(h, "npllm_prefix", False) for h in prefix_log.handlers):
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("[npllm] %(message)s"))
        handler.npllm_prefix = True
        prefix_log.addHandler(handler)
    prefix_log.setLevel(logging.INFO)


def run(server: Server, host: str, port: int, grace: float, cors_origins=None, announce=sys.stderr,
        sock: socket.socket | None = None) -> int:
    """Serve until SIGTERM / Ctrl-C; exit status 0 after a clean shutdown. `sock`: already bound to host:port
    (bind()), else bound here."""
    sock = sock or bind(host, port)
    bound = sock.getsockname()[1]
    cap, warning = connection_cap(server.limits.max_connections)
    if warning:
        print(f"[npllm] {warning}", file=announce, flush=True)
        server.limits.max_connections = cap

    def started():
        print(f"[npllm] serving {server.context.model_name} on http://{host}:{bound}/v1 "
              f"({server.limits.max_slots} slots)", file=announce, flush=True)

    uv = make_uvicorn(create_app(server, cors_origins), grace, on_started=started, limits=server.limits)
    show_prefix_log(announce)
    server.start()
    try:
        uv.run(sockets=[sock])
    finally:
        server.close()
        sock.close()
    print("[npllm] server stopped", file=announce, flush=True)
    return 0
