"""`npllm serve` through the official openai client: the same text as `npllm generate`, every concurrent request its
solo answer, OpenAI error objects for bad requests, cancel on disconnect, a clean exit on SIGTERM."""

import concurrent.futures
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest

import npllm
from npllm.chat import BUILTIN_TEMPLATES, render_chat_template
from npllm.cli import main
from npllm.sampling import log_softmax
from npllm.errors import GenerationError
from npllm.serve.app import Limits, Server, create_app, listen, make_uvicorn
from npllm.serve.protocol import ApiError, Context, parse_chat, parse_completion
from tests_support import template_worker_of, wait_gone

KEY = "sk-test-key"
MODEL = "stories260K"
PROMPTS = ["Once upon a time", "The cat", "Lily and Ben went to the park", "One day, a little bird",
           "Tom had a red ball", "The sun was", "Sam wanted to", "There was a big tree"]


@contextlib.contextmanager
def running(server: Server, grace: float = 2.0, control: list | None = None):
    """The server on 127.0.0.1 at a free port, run by uvicorn in a thread; yields its base URL. `control` receives
    the uvicorn server and its thread (setting should_exit is what SIGTERM does)."""
    sock = listen("127.0.0.1", 0)
    uv = make_uvicorn(create_app(server), grace=grace, limits=server.limits)
    server.start()
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    if control is not None:
        control += [uv, thread]
    deadline = time.monotonic() + 10
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(10)
        server.close()
        sock.close()


class SlowModel:
    """A model whose every forward call takes `delay` seconds longer: a generation that lasts long enough to be
    interrupted. Everything else is the wrapped model's."""

    def __init__(self, model, delay: float):
        self.model, self.delay = model, delay

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.model.forward(*args, **kwargs)


def wait_until(condition, seconds: float = 5.0) -> bool:
    """Whether condition() holds within `seconds` (the engine thread applies a cancel between two steps)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture(scope="module")
def llm(stories260k):
    return npllm.load(stories260k)


@pytest.fixture(scope="module")
def served(llm):
    server = Server(llm, MODEL, Limits(max_slots=4, max_queue=32, max_tokens_limit=400),
                    BUILTIN_TEMPLATES["chatml"], api_key=KEY)
    with running(server) as url:
        yield server, url


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=30)


def streamed_text(stream) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish


# ----------------------------------------------------------------------------------------------------------------
# The same text as npllm generate
# ----------------------------------------------------------------------------------------------------------------


def test_greedy_completion_equals_generate(client, llm, capsys):
    prompt = "Once upon a time"
    expected = llm.generate(prompt, 60, temperature=0)
    assert main(["generate", prompt, "--max-new-tokens", "60", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == prompt + expected + "\n"  # the CLI and LLM.generate agree

    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0)
    assert plain.choices[0].text == expected
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.prompt_tokens == len(llm.tokenizer.encode(prompt, bos=True))
    assert plain.usage.completion_tokens == 60

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stream=True)
    assert streamed_text(stream) == (expected, "length")


def test_chat_completion_is_the_rendered_conversation_continued(client, llm):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A story, please."}]
    rendered = render_chat_template(BUILTIN_TEMPLATES["chatml"], messages, add_generation_prompt=True)
    expected = llm.generate(rendered, 30, temperature=0)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(llm.tokenizer.encode(rendered, bos=True))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_stop_strings_and_logprobs(client, llm):
    prompt = "Once upon a time"
    full = llm.generate(prompt, 40, temperature=0)
    stop = full[20:24]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    assert got.choices[0].text == full[:full.index(stop)]
    assert got.choices[0].finish_reason == "stop"

    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    ids = llm.tokenizer.encode(prompt, bos=True)
    new = list(llm.generate_ids(ids, 8, temperature=0))
    expected = log_softmax(llm.logits(ids + new).astype(np.float64))[len(ids) - 1 + np.arange(8), new]
    np.testing.assert_allclose(lp.token_logprobs, expected, atol=1e-4)
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(chosen)  # greedy: the chosen is the best
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))


# ----------------------------------------------------------------------------------------------------------------
# Concurrency: every request its solo answer
# ----------------------------------------------------------------------------------------------------------------


def test_sixteen_concurrent_requests_get_their_solo_answers(client, llm):
    settings = [dict(temperature=0), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7),
                dict(temperature=1.2, top_p=0.8, presence_penalty=0.5)]
    requests = [dict(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=20 + 3 * i, seed=100 + i,
                     **settings[i % len(settings)]) for i in range(16)]
    requests[5]["stop"] = [" the"]
    solo = [llm.generate(r["prompt"], r["max_tokens"], **{k: v for k, v in r.items()
                                                            if k not in ("prompt", "max_tokens")}) for r in requests]
    for r in requests[::5]:  # log-probabilities make every step report its draws: the texts stay the same
        r["logprobs"] = 2

    def ask(r):
        return client.completions.create(model=MODEL, **r).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, requests))
    assert answers == solo


# ----------------------------------------------------------------------------------------------------------------
# Bad requests: a 4xx with an OpenAI error body, and the server keeps serving
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, param", [(dict(max_tokens=-5), "max_tokens"), (dict(temperature=-0.5), "temperature"),
                                          (dict(top_p=1.5), "top_p"), (dict(n=20), "n"),
                                          (dict(logit_bias={"99999": 5}), "logit_bias"), (dict(seed=-5), "seed")])
def test_bad_fields_are_400_with_an_openai_error(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="The cat", **fields)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="The cat", max_tokens=3).choices[0].text


def test_wrong_key_unknown_model_malformed_json_and_size(served, client):
    url = served[1]
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=MODEL, prompt="The cat", max_tokens=3)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="The cat", max_tokens=3)
    assert e.value.body["code"] == "model_not_found"
    auth = {"Authorization": f"Bearer {KEY}"}
    for body, status in [(b'{"prompt": "The cat", ', 400), (b"[1, 2]", 400), (b"\xff\xfe", 400),
                         (b'{"prompt": "a \\ud800"}', 400), (b'{"prompt": "a", "stop": "\\udc00"}', 400),
                         (b'{"prompt": "a", "stream": "yes"}', 400),
                         (json.dumps({"prompt": "x" * (2 << 20)}).encode(), 413)]:
        r = httpx.post(url + "/v1/completions", content=body, headers=auth)
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "Traceback" not in r.text
    r = httpx.get(url + "/v1/nothing", headers=auth)
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list()] == [MODEL]


def test_full_queue_is_429(llm):
    """One slot, two places in the queue: three real requests fill them, the fourth is refused at once, and once
    they end the server serves again."""
    server = Server(npllm.LLM(SlowModel(llm.model, 0.01), llm.tokenizer), MODEL, Limits(max_slots=1, max_queue=2))
    engine = server.engine.engine
    body = {"prompt": "Once upon a time", "max_tokens": 300, "stream": True, "logit_bias": {"1": -100, "2": -100}}
    with running(server) as url, contextlib.ExitStack() as streams:
        for _ in range(3):  # a stream's head comes at once, whether it runs or waits
            streams.enter_context(httpx.stream("POST", url + "/v1/completions", json=body, timeout=10))
        assert wait_until(lambda: server.active == 3 and len(engine.running) == 1 and len(engine.waiting) == 2)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "The cat", "max_tokens": 3}, timeout=10)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_exceeded"
        streams.close()  # the three clients go away: their jobs are cancelled
        assert wait_until(lambda: not server.active and not engine.running)
        assert httpx.post(url + "/v1/completions", json={"prompt": "The cat", "max_tokens": 3}).status_code == 200


def test_no_cors_headers_unless_an_origin_is_given(llm):
    from starlette.testclient import TestClient

    server = Server(llm, MODEL, Limits(max_slots=1))
    asked = {"Origin": "http://page.example"}
    assert "access-control-allow-origin" not in TestClient(create_app(server)).get("/health", headers=asked).headers
    allowed = TestClient(create_app(server, ["http://page.example"])).get("/health", headers=asked)
    assert allowed.headers["access-control-allow-origin"] == "http://page.example"


def test_chat_without_a_template_is_400(llm):
    ctx = Context(MODEL, llm.tokenizer, llm.config, 100, None, "this model ships no chat template")
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}]}, ctx)
    assert e.value.status == 400 and "chat template" in e.value.message


# ----------------------------------------------------------------------------------------------------------------
# Disconnects and shutdown
# ----------------------------------------------------------------------------------------------------------------


def test_a_disconnected_stream_frees_its_slot(llm):
    server = Server(npllm.LLM(SlowModel(llm.model, 0.01), llm.tokenizer), MODEL, Limits(max_slots=1, max_queue=0))
    engine = server.engine.engine
    with running(server) as url:
        body = {"prompt": "Once upon a time", "max_tokens": 300, "stream": True, "logit_bias": {"1": -100, "2": -100}}
        with httpx.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert engine.running  # the request holds the only slot ...
            busy = httpx.post(url + "/v1/completions", json={"prompt": "The cat", "max_tokens": 3})
            assert busy.status_code == 429  # ... and no queue is allowed
        # the client closed the connection: the request is cancelled
        assert wait_until(lambda: not engine.running and not server.active and list(engine.free) == [0])
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up on a whole (unstreamed) answer
            httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
        assert wait_until(lambda: not engine.running and not server.active and list(engine.free) == [0])
        assert httpx.post(url + "/v1/completions", json={"prompt": "The cat", "max_tokens": 3}).status_code == 200


def test_past_the_grace_period_shutdown_cancels_what_still_runs(llm):
    server = Server(npllm.LLM(SlowModel(llm.model, 0.02), llm.tokenizer), MODEL, Limits(max_slots=2))
    engine, control = server.engine.engine, []
    with running(server, grace=0.3, control=control) as url:
        uv, thread = control
        body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "logit_bias": {"1": -100, "2": -100}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            started = time.monotonic()
            uv.should_exit = True  # what SIGTERM does
            with pytest.raises(httpx.HTTPError):  # the stream is cut: 400 tokens take 8 s, the grace 0.3 s
                for line in lines:
                    assert line != "data: [DONE]"
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - started < 6
        assert wait_until(lambda: not engine.running and sorted(engine.free) == [0, 1])  # cancelled, slot freed


def start_subprocess_server(stories260k, *options, files: int | None = None,
                            env: dict | None = None) -> tuple[subprocess.Popen, str, list[str]]:
    """`npllm serve` in a child process (with at most `files` open files, when given); returns it, its port once it
    says it is serving, and the lines it wrote on stderr up to then."""
    command = [sys.executable, "-m", "npllm", "serve", "--model", str(stories260k), "--port", "0",
               "--backend", "numpy", "--grace", "20", *options]
    if files is not None:  # a launcher that lowers the limit, then becomes the server (no preexec_fn: threads here)
        limit = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({files}, {files})); "
                 f"os.execv(sys.executable, sys.argv[1:])")
        command = [sys.executable, "-c", limit, *command]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    lines = []
    while True:  # the first lines may say that /v1/chat/completions is off (no template)
        line = proc.stderr.readline()
        lines.append(line)
        if not line:
            proc.kill()
            raise AssertionError(f"the server ended before it listened (status {proc.wait()}): {''.join(lines)}")
        found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if found:
            return proc, found.group(1), lines


def test_sigterm_right_after_the_announcement_exits_0(stories260k):
    proc, _, _ = start_subprocess_server(stories260k)
    proc.send_signal(signal.SIGTERM)  # the announcement comes once the handlers are in place
    try:
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_lets_the_running_request_finish_and_exits_0(stories260k):
    proc, port, _ = start_subprocess_server(stories260k)
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 150, "temperature": 0, "stream": True,
                "logit_bias": {"1": -100, "2": -100}}  # no stop token: it runs its 150 tokens
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)  # in flight: it finishes within the grace period
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=15) == 0
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------------------------------------------
# Clients that hold connections (slowloris), bodies that break the parser, an empty key, a port in use
# ----------------------------------------------------------------------------------------------------------------

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def connect(url: str, data: bytes = b"", timeout: float = 6.0) -> socket.socket:
    """A raw loopback connection to the server at `url` that has sent `data` (half a request, say)."""
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=timeout)
    sock.sendall(data)
    return sock


def read_to_end(sock: socket.socket) -> tuple[bytes, float]:
    """What the server sends until it closes (or resets) the connection, and time.monotonic() then; socket.timeout
    if it holds the connection open past the socket's timeout."""
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return data, time.monotonic()


def trickle(sock: socket.socket, piece: bytes, times: int, pause: float) -> threading.Thread:
    """A thread that sends `piece` every `pause` seconds, `times` times, until the server closes the connection."""
    def send():
        for _ in range(times):
            try:
                sock.sendall(piece)
            except OSError:
                return
            time.sleep(pause)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_half_sent_requests_are_dropped_at_their_deadlines_and_others_are_served_meanwhile(llm):
    server = Server(llm, MODEL, Limits(max_slots=2, header_timeout=1.0, body_timeout=1.0, keep_alive_timeout=0.5))
    with running(server) as url:
        start = time.monotonic()
        idle = connect(url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # answered, then idle
        answered = connect(url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n")
        trickle(answered, b"x", 25, 0.2)  # the body nobody reads, after the answer: its bytes must not hold it
        silent = [connect(url) for _ in range(4)]  # connected, nothing sent
        half_head = [connect(url, HEAD) for _ in range(8)]  # the blank line that ends the head never comes
        slow_head = connect(url, HEAD)  # a header line every 0.2 s for 5 s: the deadline is for the whole head
        trickle(slow_head, b"X-Slow: 1\r\n", 25, 0.2)
        half_body = [connect(url, HEAD + b'Content-Length: 100\r\n\r\n{"prompt": ') for _ in range(4)]
        slow_body = connect(url, HEAD + b"Content-Length: 100\r\n\r\n")
        trickle(slow_body, b" ", 25, 0.2)

        # while they hold their connections, other clients are served
        assert httpx.get(url + "/health", timeout=2).json() == {"status": "ok"}
        done = httpx.post(url + "/v1/completions", json={"prompt": "The cat", "max_tokens": 3}, timeout=5)
        assert done.status_code == 200 and done.json()["choices"][0]["text"]

        data, end = read_to_end(idle)
        assert data.startswith(b"HTTP/1.1 200 ") and 0.4 < end - start < 3  # the keep-alive timeout
        data, end = read_to_end(answered)
        assert data.startswith(b"HTTP/1.1 200 ") and 0.9 < end - start < 4  # the next head's deadline
        for sock in silent + half_head + [slow_head]:
            data, end = read_to_end(sock)
            assert data == b"" and 0.9 < end - start < 4  # closed at the head's deadline, nothing sent
        for sock in half_body + [slow_body]:
            data, end = read_to_end(sock)
            assert data.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1 s" in data
            assert b"connection: close" in data.lower() and end - start < 4
        assert httpx.get(url + "/health", timeout=2).json() == {"status": "ok"}


def test_connections_past_the_limit_are_answered_503_at_once(llm):
    server, control = Server(llm, MODEL, Limits(max_slots=1, max_connections=6, header_timeout=3.0)), []
    with running(server, control=control) as url:
        connections = control[0].server_state.connections
        held = [connect(url, HEAD) for _ in range(6)]
        assert wait_until(lambda: len(connections) == 6)
        start = time.monotonic()
        for _ in range(10):
            data, _ = read_to_end(connect(url))
            assert data.startswith(b"HTTP/1.1 503 ") and b"limit of 6 connections" in data
            assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["type"] == "server_error"
        assert time.monotonic() - start < 2  # at once, not at the held connections' deadline
        assert len(connections) == 6
        # once the held connections reach their deadline, clients are served again
        assert wait_until(lambda: not connections, 6)
        assert httpx.get(url + "/health", timeout=2).json() == {"status": "ok"}
        for sock in held:
            sock.close()


def test_outside_the_tested_uvicorn_the_server_runs_on_its_plain_protocol_with_one_notice(llm, monkeypatch, capsys):
    """The connection guards use uvicorn's internals only with a uvicorn in TESTED_UVICORN: with another, one notice
    on stderr (however many servers are made), and the server runs on uvicorn's own h11 protocol (no head deadline)
    with uvicorn's own connection limit, and serves as before."""
    import uvicorn

    import npllm.serve.app as app

    control = []
    with running(Server(llm, MODEL, Limits(max_slots=1)), control=control):
        assert issubclass(control[0].config.http, app.HeadDeadline)  # the installed uvicorn: guarded
    assert "[npllm]" not in capsys.readouterr().err

    def forbidden(*args):
        raise AssertionError("uvicorn's internals were used outside the tested range")

    monkeypatch.setattr(uvicorn, "__version__", "0.99.0")
    monkeypatch.setattr(app.UVICORN_FENCE, "noticed", False)
    monkeypatch.setattr(app, "guarded_protocol", forbidden)
    for _ in range(2):
        control = []
        with running(Server(llm, MODEL, Limits(max_slots=1, max_connections=8)), control=control) as url:
            assert control[0].config.http == "h11" and control[0].config.limit_concurrency == 8
            done = httpx.post(url + "/v1/completions", json={"prompt": "The cat", "max_tokens": 3}, timeout=10)
            assert done.status_code == 200 and done.json()["choices"][0]["text"]
    notices = [line for line in capsys.readouterr().err.splitlines() if "[npllm]" in line]
    assert len(notices) == 1 and "uvicorn 0.99.0 is outside the versions npllm's connection guards" in notices[0]


def healthy(url: str) -> bool:
    """Whether /health answers 200 now (not 503, not a reset connection)."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="sets the child's open-files limit (RLIMIT_NOFILE)")
def test_under_a_64_file_limit_held_connections_do_not_stop_the_server(stories260k):
    proc, port, lines = start_subprocess_server(stories260k, "--header-timeout", "1", files=64)
    url = f"http://127.0.0.1:{port}"
    try:
        assert any("--max-connections lowered from 256" in line for line in lines)
        held = [connect(url, HEAD) for _ in range(50)]  # more than 64 files leave room for
        data, _ = read_to_end(connect(url))  # answered at once: not left waiting for a descriptor
        assert data.startswith(b"HTTP/1.1 503 ")
        assert read_to_end(held[0])[0] == b""  # the first were let in, and are dropped at the deadline
        assert wait_until(lambda: healthy(url), 5)
        for sock in held:
            sock.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        log = proc.stderr.read()
        assert "Traceback" not in log and "out of system resource" not in log
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def server_log():
    """The records the server's loggers (npllm's, uvicorn's, asyncio's) emit meanwhile, at the levels they log."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("npllm.serve", "uvicorn.error", "asyncio")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def test_bodies_that_break_the_parser_are_400_and_a_mid_body_disconnect_is_not_logged(served):
    url = served[1]
    auth = {"Authorization": f"Bearer {KEY}"}
    with server_log() as records:
        for body, says in [(b"[" * 100_000, "nested too deeply"),
                           (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
                           (b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", "too many digits")]:
            r = httpx.post(url + "/v1/completions", content=body, headers=auth)
            assert r.status_code == 400 and says in r.json()["error"]["message"]
            assert r.json()["error"]["type"] == "invalid_request_error"
        for _ in range(5):  # a client that goes away half-way through its body
            sock = connect(url, HEAD + f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n".encode()
                           + b'{"prompt": "Once')
            time.sleep(0.05)
            sock.close()
        time.sleep(0.3)
        assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert [record.getMessage() for record in records] == []


def deep_message(depth: int) -> bytes:
    """A chat body whose message carries an unknown field nested `depth` objects deep."""
    extra = '{"a": ' * depth + "1" + "}" * depth
    return b'{"max_tokens": 2, "messages": [{"role": "user", "content": "Hi", "extra": %s}]}' % extra.encode()


def test_a_message_field_nested_deep_is_400_and_nothing_is_logged(served, llm):
    """An unknown key of a message reaches the chat template's value conversion, which recursed once per level:
    500 and a logged traceback from ~500 levels until the JSON parser's own limit (~980). Every depth past 64 is
    refused before it, the same through the protocol alone (what npllm batch calls)."""
    url = served[1]
    auth = {"Authorization": f"Bearer {KEY}"}
    with server_log() as records:
        for depth in (65, 500, 700, 979, 980, 5000):
            r = httpx.post(url + "/v1/chat/completions", content=deep_message(depth), headers=auth, timeout=30)
            assert r.status_code == 400 and "nested" in r.json()["error"]["message"], (depth, r.text)
        assert httpx.post(url + "/v1/chat/completions", content=deep_message(60), headers=auth,
                          timeout=30).status_code == 200
    assert [record.getMessage() for record in records] == []
    ctx = Context(MODEL, llm.tokenizer, llm.config, 100, BUILTIN_TEMPLATES["chatml"])
    for depth in (500, 700):
        with pytest.raises(ApiError, match="nested more than 64 levels"):
            parse_chat(json.loads(deep_message(depth)), ctx)


@pytest.mark.parametrize("fields, param", [
    *[(dict(logit_bias={key: 5}), "logit_bias") for key in (" 1", "1 ", "1_0", "+1", "-1", "01", "00001", "1.0",
                                                           "\u0661", "\uff11", "", "1e2", "9" * 5000)],
    (dict(logit_bias={"1": 5, 1: 6}), "logit_bias"),
    (dict(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (dict(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage"),
    (dict(stream_options={"include_usage": "no"}), "stream_options.include_usage"),
    (dict(stream="yes"), "stream"), (dict(stream=1), "stream"), (dict(echo=0), "echo"), (dict(echo="no"), "echo"),
    (dict(logprobs=True), "logprobs"), (dict(max_tokens=True), "max_tokens"), (dict(seed=False), "seed"),
    (dict(temperature=True), "temperature"), (dict(temperature=10 ** 400), "temperature"),
    (dict(logit_bias={"1": 10 ** 400}), "logit_bias"), (dict(model=5), "model"), (dict(n=True), "n"),
])
def test_lenient_field_values_are_400(llm, fields, param):
    """JSON's types, strictly: a logit_bias key is a token id's decimal ASCII digits (int() would take " 1", "1_0"
    and other scripts' digits, and "01" and "1" would name one token, the last one winning), a boolean is true or
    false, an integer no boolean, a number one a float holds (10**400 was an OverflowError: a 500)."""
    ctx = Context(MODEL, llm.tokenizer, llm.config, 100)
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": "The cat", **fields}, ctx)
    assert e.value.status == 400 and e.value.param == param


def test_strict_fields_still_take_what_they_should(llm):
    ctx = Context(MODEL, llm.tokenizer, llm.config, 100)
    spec = parse_completion({"prompt": "The cat", "logit_bias": {"0": 1, "42": -100, 7: 2.5}, "stream": True,
                             "stream_options": {"include_usage": True}, "echo": False}, ctx)
    assert dict(spec.request.params.logit_bias) == {0: 1.0, 42: -100.0, 7: 2.5} and spec.include_usage
    spec = parse_completion({"prompt": "The cat", "stream_options": {"include_usage": True}}, ctx)
    assert not spec.stream and not spec.include_usage  # usage chunks come with a stream only


def test_an_empty_api_key_is_refused_before_the_model_loads(llm, tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "missing.bin")  # were the model loaded first, its absence would be the error
    assert main(["serve", "--model", missing, "--port", "0", "--api-key", ""]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("npllm: error: the API key is empty")
    monkeypatch.setenv("NPLLM_API_KEY", "")
    assert main(["serve", "--model", missing, "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith("npllm: error: the API key is empty")
    for key in ["", " sk-padded", "sk-\u00e9"]:  # none of these can be sent and compared as a header value
        with pytest.raises(GenerationError, match="API key"):
            Server(llm, MODEL, Limits(max_slots=1), api_key=key)


def test_a_port_in_use_or_a_host_that_does_not_resolve_is_one_line_before_the_model_loads(tmp_path, capsys):
    missing = str(tmp_path / "missing.bin")
    with listen("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--model", missing, "--port", str(port)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"npllm: error: cannot listen on 127.0.0.1:{port}: the port is in use")
    assert main(["serve", "--model", missing, "--host", "no-such-host.invalid", "--port", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("npllm: error: cannot listen on no-such-host.invalid:0: the host 'no-such-host.invalid' "
                          "does not resolve")


@pytest.mark.parametrize("option, value", [("--header-timeout", "0"), ("--body-timeout", "nan"),
                                           ("--keep-alive-timeout", "-1"), ("--grace", "inf"),
                                           ("--grace", "nan"), ("--max-connections", "0")])
def test_bad_limits_are_refused_before_anything_loads(option, value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", option, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {option}: {value}" in err and ("is not" in err or "maximum" in err
                                                                          or "below" in err)


def test_serve_without_the_extra_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    assert main(["serve"]) == 2
    assert "pip install -e '.[serve]'" in capsys.readouterr().err


def test_the_core_package_does_not_import_the_server_stack():
    code = ("import sys, npllm, npllm.cli, npllm.serve.protocol, npllm.serve.engine; "
            "print(sorted(m for m in ('starlette', 'uvicorn', 'openai') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_template_that_writes_bos_as_text_gets_the_bos_id(llm):
    ctx = Context(MODEL, llm.tokenizer, llm.config, 100, BUILTIN_TEMPLATES["llama2"])
    messages = [{"role": "user", "content": "Tell me a story."}]
    spec = parse_chat({"messages": messages, "max_tokens": 5}, ctx)
    bos = llm.tokenizer.id_to_piece(llm.config.bos_id)
    rendered = render_chat_template(BUILTIN_TEMPLATES["llama2"], messages, add_generation_prompt=True,
                                    bos_token=bos, eos_token="</s>")
    assert rendered.startswith(bos)
    assert list(spec.request.prompt) == llm.tokenizer.encode(rendered[len(bos):], bos=True)
    assert list(spec.request.prompt).count(llm.config.bos_id) == 1 and spec.request.max_new_tokens == 5


# ----------------------------------------------------------------------------------------------------------------
# The chat template comes from the model file: its failures are 400s, and a slow one stalls nothing
# ----------------------------------------------------------------------------------------------------------------

HANG = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
FAILING = ("{% set c = messages[0]['content'] %}{% if c == 'zero' %}{{ 1/0 }}{% elif c == 'include' %}"
           "{% include 'x.jinja' %}{% elif c == 'big' %}{{ 'a' * 10**9 }}{% elif c == 'hang' %}" + HANG +
           "{% else %}{{ c + 1 }}{% endif %}")


def chat_request(url: str, content: str, timeout: float = 30) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                           "max_tokens": 3}, timeout=timeout)


def test_a_failing_template_is_a_400_naming_it_and_nothing_is_logged(llm, caplog, monkeypatch):
    monkeypatch.setenv("NPLLM_TEMPLATE_TIMEOUT", "1")
    server = Server(llm, MODEL, Limits(max_slots=1), FAILING, template_name="the chat template bad.jinja")
    with caplog.at_level(logging.INFO), running(server) as url:
        for content, says in (("zero", "division by zero"), ("include", "cannot include"),
                              ("big", "went over a limit"), ("text", "concatenate"), ("hang", "within 1 s")):
            answer = chat_request(url, content)
            message = answer.json()["error"]["message"]
            assert answer.status_code == 400 and message.startswith("the chat template bad.jinja ") and says in message
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "a template's failure is the client's"


def test_a_runaway_template_stalls_no_other_request(llm, monkeypatch):
    monkeypatch.setenv("NPLLM_TEMPLATE_TIMEOUT", "4")
    server = Server(llm, MODEL, Limits(max_slots=2), HANG, template_name="the chat template hang.jinja")
    with running(server) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        stalled = pool.submit(chat_request, url, "hi")
        time.sleep(0.5)  # the render runs
        started = time.monotonic()
        assert httpx.get(url + "/health", timeout=2).status_code == 200
        done = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 3}, timeout=3)
        assert done.status_code == 200 and time.monotonic() - started < 3
        answer = stalled.result(timeout=30)
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == ("the chat template hang.jinja did not finish within 4 s "
                                                     "(NPLLM_TEMPLATE_TIMEOUT; the render was stopped)")


def test_sigterm_is_honoured_while_a_template_renders(stories260k, tmp_path):
    template = tmp_path / "hang.jinja"
    template.write_text(HANG)
    proc, port, _ = start_subprocess_server(stories260k, "--chat-template", str(template), "--grace", "1",
                                            env={"NPLLM_TEMPLATE_TIMEOUT": "120"})
    url = f"http://127.0.0.1:{port}"
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stalled = pool.submit(chat_request, url, "hi", 60)
            worker = template_worker_of(proc.pid, 30)
            time.sleep(0.3)  # rendering
            assert httpx.get(url + "/health", timeout=2).status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
            assert wait_gone(worker, 10)
            with contextlib.suppress(httpx.HTTPError):
                assert stalled.result(timeout=30).status_code != 200
    finally:
        proc.kill()
        proc.wait()
