"""`npllm serve` under load: a prompt far past the context refused before it is tokenized whole (by every caller:
the server, LLM.generate, npllm generate), a lane full of requests answered 429 before any parsing, chat templates
running to their deadline while a completion goes through, dropped streams that end without a word in the log; and
the bound that makes the early refusal sound (Tokenizer.fewest_tokens never above the real count)."""

import concurrent.futures
import dataclasses
import json
import logging
import re
import socket
import struct
import threading
import time
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import npllm
import npllm.serve.app as app
from npllm.chat import BUILTIN_TEMPLATES
from npllm.chat import worker as template_worker
from npllm.cli import main
from npllm.context import encode_prompt
from npllm.errors import GenerationError
from npllm.serve.app import Limits, Server
from npllm.serve.protocol import ApiError, Context, parse_chat, parse_completion
from npllm.tokenizer import BPETokenizer, load_tokenizer
from npllm.tokenizer.bytelevel import ByteLevelBPE
from test_serve import HANG, HEAD, MODEL, SlowModel, chat_request, connect, running, server_log, wait_until

LONG = "Once upon a time, there was a little girl named Lily. " * 20_000  # a megabyte: 1000 times the context


class Spy:
    """A tokenizer that records the length of every text it encodes (by either entry), and with a `gate` waits
    for it first; the rest is the wrapped tokenizer's."""

    def __init__(self, tokenizer, gate: threading.Event | None = None):
        self.tokenizer, self.gate, self.encoded = tokenizer, gate, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def _record(self, text: str) -> None:
        self.encoded.append(len(text))
        if self.gate is not None:
            self.gate.wait(20)

    def encode(self, text, *args, **kwargs):
        self._record(text)
        return self.tokenizer.encode(text, *args, **kwargs)

    def encode_at_most(self, text, *args, **kwargs):
        self._record(text)
        return self.tokenizer.encode_at_most(text, *args, **kwargs)


@pytest.fixture(scope="module")
def llm(stories260k):
    return npllm.load(stories260k, backend="numpy")


# ----------------------------------------------------------------------------------------------------------------
# A prompt far past the context is refused before it is encoded whole
# ----------------------------------------------------------------------------------------------------------------


def test_the_server_refuses_a_prompt_far_past_the_context_without_encoding_it(llm):
    spy = Spy(llm.tokenizer)
    ctx = Context(MODEL, spy, llm.config, 100, BUILTIN_TEMPLATES["chatml"])
    for parse, body in ((parse_completion, {"prompt": LONG}), (parse_completion, {"prompt": [LONG]}),
                        (parse_chat, {"messages": [{"role": "user", "content": LONG}]})):
        with pytest.raises(ApiError) as e:
            parse(body, ctx)
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"
        assert e.value.message.startswith("the prompt has at least ") and "context is 512 tokens" in e.value.message
    assert spy.encoded == []  # the rendered conversation too was refused by its length alone
    # a prompt within the bound but past the context: encoded, and refused by its real count
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": LONG[:4000]}, ctx)
    assert spy.encoded == [4000] and e.value.code == "context_length_exceeded"
    assert re.match(r"the prompt has \d+ tokens but the model's context is 512 tokens$", e.value.message)
    spec = parse_completion({"prompt": "Once upon a time", "max_tokens": 3}, ctx)
    assert list(spec.request.prompt) == llm.tokenizer.encode("Once upon a time", bos=True)


def test_the_library_and_the_cli_refuse_it_the_same_way(llm, monkeypatch, capsys):
    spy = Spy(llm.tokenizer)
    monkeypatch.setattr(llm, "tokenizer", spy)
    for prompt in (LONG, [LONG, "Once"]):
        with pytest.raises(GenerationError, match="^the prompt has at least .* context is 512 tokens"):
            llm.generate(prompt, 3)
    assert spy.encoded == []
    assert llm.generate("Once upon a time" * 3, 3, temperature=0)  # prompts that fit run as before
    assert main(["generate", LONG, "--backend", "numpy", "--max-new-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("npllm: error: the prompt has at least ") and err.count("\n") == 1


TEXTS = ["a", "Once upon a time, there was a girl.", " " * 300, "\n\n\t  x  " * 20, "caf\u00e9 cafe\u0301 " * 10,
         "\u4e2d\u6587\u5b57 " * 30, "\U0001F600" * 40, "\U000FFFFD" * 25, "\u1100\u1161\u11a8" * 30,
         "\U0001D414\u0308\u0304" * 20, "\u1fbe\u0308\u0341" * 20, "\U000107A5" * 30, "<|eot_id|>" * 10 + "x"]


QWEN_TOKENIZER = Path(__file__).parent / "fixtures" / "hf" / "qwen2_bias" / "tokenizer.json"


def bytelevel(**changes) -> ByteLevelBPE:
    """The qwen2_bias fixture's byte-level BPE, with top-level fields of its tokenizer.json replaced."""
    return ByteLevelBPE.from_spec({**json.loads(QWEN_TOKENIZER.read_text(encoding="utf-8")), **changes})


def tokenizers(stories260k) -> dict:
    folder = stories260k.parent
    return {"bpe": load_tokenizer(folder / "tok512.bin"), "sentencepiece": load_tokenizer(folder / "tok512.model"),
            "bytelevel": bytelevel(), "bytelevel NFC": bytelevel(normalizer={"type": "NFC"}),
            "bytelevel NFKC": bytelevel(normalizer={"type": "NFKC"})}


def test_fewest_tokens_is_never_above_the_real_count(stories260k):
    for name, tok in tokenizers(stories260k).items():
        assert tok.longest_piece_bytes, name
        for text in TEXTS:
            assert tok.fewest_tokens(text) <= len(tok.encode(text, bos=False)), (name, text[:20])
        assert tok.fewest_tokens(LONG) > 1000, name  # the bound is of use: a megabyte is far past any small context


def test_a_byte_level_encoder_stops_once_past_the_context(monkeypatch):
    tok = bytelevel()
    merged = []
    bpe = tok._bpe
    monkeypatch.setattr(tok, "_bpe", lambda word: merged.append(word) or bpe(word))
    words = "".join(f"w{i} " for i in range(3000))  # past the context, though too short for fewest_tokens to tell
    config = SimpleNamespace(max_seq_len=1000, vocab_size=tok.vocab_size)
    assert tok.fewest_tokens(words) < 1000
    with pytest.raises(GenerationError, match="^the prompt has more than 1000 tokens, the model's context$"):
        encode_prompt(tok, config, words)
    assert len(merged) <= 1001  # every word is at least one token: no word was merged past the context
    assert tok.encode_at_most(words[:600], 1000) == tok.encode(words[:600])  # within it, the same ids
    assert tok.encode_at_most("<|eot_id|>" * 5 + "hi", 3, bos=False) is None


def test_no_bound_where_one_token_can_stand_for_any_length_of_text():
    # without byte pieces a run of unknown characters, however long, is one <unk>
    plain = BPETokenizer(["<unk>", "<s>", "</s>", "\u2581", "a"], [0, 0, 0, -1, -2])
    assert plain.longest_piece_bytes is None and plain.fewest_tokens("\u4e2d" * 1000) == 0
    assert len(plain.encode("\u4e2d" * 1000, bos=False)) == 2
    added = json.loads(QWEN_TOKENIZER.read_text(encoding="utf-8"))["added_tokens"]
    stripping = bytelevel(added_tokens=[dict(added[0], lstrip=True)])
    assert stripping.longest_piece_bytes is None  # it swallows the whitespace before it
    dropping = bytelevel(pre_tokenizer={"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Removed"})
    assert dropping.longest_piece_bytes is None


def test_no_normalization_makes_a_character_more_than_the_shrink_factor_shorter():
    from npllm.tokenizer.bytelevel import NORMALIZED_SHRINK

    changed = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000 and unicodedata.decomposition(chr(c))]
    for form in ("NFC", "NFD", "NFKC", "NFKD"):
        worst = max(len(c.encode()) / len(unicodedata.normalize(form, c).encode()) for c in changed)
        assert 1 < worst <= NORMALIZED_SHRINK, form
    for composed in ("\U0001D414\u0308\u0304", "\u1fbe\u0308\u0341", "\u1100\u1161\u11a8"):  # the comment's cases
        shrink = len(composed.encode()) / len(unicodedata.normalize("NFKC", composed).encode())
        assert shrink <= NORMALIZED_SHRINK


# ----------------------------------------------------------------------------------------------------------------
# Admission: each lane bounded, 429 before any parsing; renders hold no thread a completion needs
# ----------------------------------------------------------------------------------------------------------------


def test_a_full_lane_is_429_before_any_parsing(llm):
    gate = threading.Event()
    server = Server(llm, MODEL, Limits(max_slots=2, max_parse_queue=1))
    spy = Spy(llm.tokenizer, gate)
    server.context = dataclasses.replace(server.context, tokenizer=spy)  # every completion waits in encode
    admitted = app.PARSE_THREADS + 1
    body = {"prompt": "Once upon a time", "max_tokens": 3}
    with running(server) as url, concurrent.futures.ThreadPoolExecutor(admitted) as pool:
        try:
            held = [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=30) for _ in range(admitted)]
            assert wait_until(lambda: len(spy.encoded) == app.PARSE_THREADS and server.completions.admitted == admitted)
            refused = httpx.post(url + "/v1/completions", json=body, timeout=10)
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_exceeded"
            assert len(spy.encoded) == app.PARSE_THREADS  # the refused one was never parsed
        finally:
            gate.set()
        assert [f.result().status_code for f in held] == [200] * admitted
        assert httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200
        assert server.completions.admitted == 0


def test_templates_running_to_their_deadline_hold_up_no_completion(llm, monkeypatch):
    monkeypatch.setenv("NPLLM_TEMPLATE_TIMEOUT", "60")
    server = Server(llm, MODEL, Limits(max_slots=2), HANG, template_name="the chat template hang.jinja")
    with concurrent.futures.ThreadPoolExecutor(6) as pool, running(server, grace=0.5) as url:
        chats = [pool.submit(chat_request, url, "hi", 90) for _ in range(6)]  # more than there are template workers
        assert wait_until(lambda: len(template_worker._POOL.busy) == template_worker.MOST_WORKERS, 60)
        done = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 3}, timeout=30)
        assert done.status_code == 200 and done.json()["choices"][0]["text"]
        assert not any(chat.done() for chat in chats)  # answered while every render still ran
    # leaving `running` closed the server: the renders were stopped


# ----------------------------------------------------------------------------------------------------------------
# A dropped stream ends quietly
# ----------------------------------------------------------------------------------------------------------------


def test_dropped_streams_end_quietly_and_free_their_slots(llm):
    server = Server(npllm.LLM(SlowModel(llm.model, 0.002), llm.tokenizer), MODEL, Limits(max_slots=2))
    engine, loops, submit = server.engine.engine, [], server.submit
    server.submit = lambda spec, loop: (loops.append(loop), submit(spec, loop))[1]
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                       "logit_bias": {"1": -100, "2": -100}}).encode()
    request = HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    with server_log() as records, running(server) as url:
        for _ in range(3):
            sock = connect(url, request)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
            # the server's loop busy for a while: the engine's tokens pile up in the stream's queue meanwhile
            loops[-1].call_soon_threadsafe(time.sleep, 0.5)
            time.sleep(0.1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset, as a client killed mid-stream sends
            assert wait_until(lambda: not server.active and not engine.running and len(engine.free) == 2, 10)
        assert httpx.post(url + "/v1/completions", json={"prompt": "The cat", "max_tokens": 3}).status_code == 200
    assert [record.getMessage() for record in records if record.levelno >= logging.INFO] == []
