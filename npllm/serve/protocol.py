"""OpenAI's HTTP API as plain data: request bodies checked into generation requests, results into response bodies.

Nothing here knows about HTTP servers, so it is tested (and importable) without the `serve` extra.

    parse_json(data) -> body                 a request's JSON text parsed (ApiError(400) for what no parser takes)
    parse_completion(body, ctx) -> Spec      POST /v1/completions
    parse_chat(body, ctx) -> Spec            POST /v1/chat/completions (messages laid out by the chat template)
    Output                                   a job's text as it arrives: detokenized, cut at stop strings,
                                             with log-probabilities and usage counts
    completion_body / chat_body              the whole response (stream: false)
    completion_chunk / chat_chunk            one server-sent event's data (stream: true)

Field rules follow OpenAI's reference: temperature in [0, 2] (0 greedy), top_p in (0, 1], presence and frequency
penalties in [-2, 2], logit_bias values in [-100, 100] keyed by token id, up to 4 stop strings, n = 1 (the only
value served), completions' logprobs in [0, 5], chat's top_logprobs in [0, 20]. Types are JSON's, strictly: a boolean
field takes true or false (not "yes", not 0), an integer field no boolean, a logit_bias key the decimal digits of a
token id. A body nests at most MOST_NESTING levels (whatever its fields: an unknown key of a message reaches the
chat template, whose conversion recurses once per level). A bad field is an ApiError naming it: status 400 with an
OpenAI error body, as the `openai` client expects.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import uuid
from dataclasses import dataclass

from ..errors import ChatTemplateError, GenerationError
from ..context import encode_prompt
from ..generate import Request, check_prompt
from ..sampling import Option, SamplingParams, options
from ..stop import StopStrings

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MOST_STOPS = 4
MOST_LOGPROBS = 5  # completions: logprobs
MOST_TOP_LOGPROBS = 20  # chat: top_logprobs
MOST_NESTING = 64  # lists and objects in one another; OpenAI's own requests need a handful
TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,11}")  # a logit_bias key: ASCII digits, no sign, no leading zero, no "_"


class ApiError(Exception):
    """An error the client gets as an OpenAI error object: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_exceeded",
             500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Context:
    """What parsing needs to know about the server: the model, its tokenizer, the limits, the chat template."""

    model_name: str
    tokenizer: object
    config: object
    max_tokens_limit: int
    chat_template: str | None = None  # None: /v1/chat/completions answers 400 naming --chat-template
    template_problem: str = ""
    template_name: str = ""  # how errors name the template (npllm.chat.chat_template_name)


@dataclass(frozen=True)
class Spec:
    """A checked request: the engine's Request plus what only the HTTP side uses."""

    request: Request
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: no log-probabilities; N: the chosen token's and N alternatives
    chat: bool


# ----------------------------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------------------------


def parse_json(data: bytes | str):
    """A request body (a POST body, a line of `npllm batch`'s input) as JSON, or ApiError(400) saying why not; never
    another exception. Its nesting is checked where it is read as a request (parse_completion, parse_chat)."""
    try:
        return json.loads(data)
    except RecursionError:  # the C parser recurses once per nested [ or {
        raise ApiError(400, "the request body is nested too deeply to parse") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON ({e})") from None
    except ValueError:  # int(): more digits than sys.get_int_max_str_digits()
        raise ApiError(400, "the request body holds a number with too many digits") from None


def check_nesting(body, most: int = MOST_NESTING) -> None:
    """ApiError(400) for a body with lists and objects nested more than `most` deep (the body itself is level 1).
    Level by level, without recursion: the point is to refuse what would blow a recursive converter's stack."""
    level, depth = [body], 0
    while True:
        containers = [v for v in level if isinstance(v, (dict, list, tuple))]
        if not containers:
            return
        depth += 1
        if depth > most:
            raise ApiError(400, f"the request body is nested more than {most} levels deep")
        level = [item for c in containers for item in (c.values() if isinstance(c, dict) else c)]


def parse_completion(body, ctx: Context) -> Spec:
    body = _object(body)
    _check_model(body, ctx)
    prompt_ids = _prompt_ids(body.get("prompt"), ctx)
    if _boolean(body, "echo"):
        raise ApiError(400, "echo is not supported", "echo")
    if body.get("suffix") is not None:
        raise ApiError(400, "suffix is not supported", "suffix")
    _check_best_of(body)
    logprobs = _integer(body, "logprobs", 0, MOST_LOGPROBS)
    max_tokens = _max_tokens(body, ctx, len(prompt_ids), ("max_tokens",), COMPLETIONS_DEFAULT_MAX_TOKENS)
    return _spec(body, ctx, prompt_ids, max_tokens, logprobs, chat=False)


def parse_chat(body, ctx: Context) -> Spec:
    body = _object(body)
    _check_model(body, ctx)
    messages = _messages(body.get("messages"))
    if ctx.chat_template is None:
        raise ApiError(400, ctx.template_problem or "this server has no chat template: start it with "
                       "--chat-template NAME|FILE", "messages", "no_chat_template")
    prompt_ids = _chat_prompt_ids(messages, ctx)
    top = _integer(body, "top_logprobs", 0, MOST_TOP_LOGPROBS)
    wants = _boolean(body, "logprobs")
    if top is not None and not wants:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if wants else None
    max_tokens = _max_tokens(body, ctx, len(prompt_ids), ("max_completion_tokens", "max_tokens"), None)
    return _spec(body, ctx, prompt_ids, max_tokens, logprobs, chat=True)


def _spec(body: dict, ctx: Context, prompt_ids: list[int], max_tokens: int, logprobs: int | None,
          chat: bool) -> Spec:
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise ApiError(400, f"n must be 1 (one choice per request is served), got {n!r}", "n")
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    include_usage = _boolean(options or {}, "include_usage", "stream_options.include_usage") and stream
    params = _sampling(body, ctx, logprobs)
    request = Request(prompt_ids, max_tokens, params)
    return Spec(request, _stops(body.get("stop")), stream, include_usage, logprobs, chat)


def _sampling(body: dict, ctx: Context, logprobs: int | None, params_type: type = SamplingParams) -> SamplingParams:
    """SamplingParams from the request's fields, one per field whose Option names one (npllm.sampling.options):
    a number in its range, an integer, or a token -> bias map; absent fields keep SamplingParams' defaults. The
    log-probabilities asked for (the endpoint's own fields) come as `logprobs`: the chosen token's log-probability
    comes with its alternatives, so at least one is asked for."""
    keywords = {f.name: _field(body, option, ctx) for f, option in options(params_type)
                if option.api is not None and body.get(option.api) is not None}
    try:
        return params_type(**keywords, logprobs=0 if logprobs is None else max(logprobs, 1))
    except GenerationError as e:
        raise ApiError(400, str(e)) from None


def _field(body: dict, option: Option, ctx: Context):
    """The value of the request field `option.api` (present), checked: "real" a number in option.api_range
    (its low end excluded when api_open), "integer" an integer in it, "bias" a token -> bias map."""
    name, (least, most) = option.api, option.api_range
    if option.kind == "bias":
        return _logit_bias(body[name], ctx, least, most)
    if option.kind == "integer":
        return _integer(body, name, least, most)
    value = _number(body, name, -math.inf if least is None else least, math.inf if most is None else most, None)
    if option.api_open and value == least:
        raise ApiError(400, f"{name} must be in ({least:g}, {most:g}], got {body[name]!r}", name)
    return value


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_nesting(body)
    return body


def _check_model(body: dict, ctx: Context) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {model!r}", "model")
    if model is not None and model != ctx.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {ctx.model_name!r}", "model",
                       "model_not_found")


def _check_best_of(body: dict) -> None:
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != 1):
        raise ApiError(400, f"best_of must be 1, got {best_of!r}", "best_of")


def _prompt_ids(prompt, ctx: Context) -> list[int]:
    """The prompt as token ids: a string (encoded with BOS), a list of one string, or token ids (as given)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _encode(_utf8(prompt, "prompt"), ctx, "prompt")
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        _checked(check_prompt, "prompt", ctx.config, prompt)
        return list(prompt)
    if prompt is None:
        raise ApiError(400, "prompt is required", "prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")


def _encode(text: str, ctx: Context, param: str) -> list[int]:
    """text's ids with BOS, checked against the context (a text far past it refused before it is encoded whole:
    npllm.context.encode_prompt)."""
    return _checked(encode_prompt, param, ctx.tokenizer, ctx.config, text)


def _checked(check, param: str, *args):
    """check(*args), its GenerationError the request's 400 (context_length_exceeded for a prompt too long)."""
    try:
        return check(*args)
    except GenerationError as e:
        raise ApiError(400, str(e), param, "context_length_exceeded" if "context" in str(e) else None) from None


def _messages(messages) -> list[dict]:
    """Messages as {"role", "content"} with text content (OpenAI's list of text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        plain.append({**m, "content": content})
    return plain


def _chat_prompt_ids(messages: list[dict], ctx: Context) -> list[int]:
    """The conversation laid out by the chat template (ending with the assistant's header), then encoded. A template
    that writes the BOS piece as text gets the BOS id instead (text "<s>" would be encoded as characters). The render
    runs in a worker process with a deadline (npllm/chat/worker.py); this waits for it, so the server calls parse_chat
    off its event loop. Any failure of the template is the request's 400, naming the template."""
    from ..chat import render_chat_template

    tok, config = ctx.tokenizer, ctx.config
    bos = tok.id_to_piece(config.bos_id) if config.bos_id is not None else None
    eos = tok.id_to_piece(config.eos_ids[0]) if config.eos_ids else None
    try:
        text = render_chat_template(ctx.chat_template, messages, add_generation_prompt=True, bos_token=bos,
                                    eos_token=eos, template_name=ctx.template_name or None)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), "messages") from None
    if bos and text.startswith(bos):
        text = text[len(bos):]
    return _encode(_utf8(text, "messages"), ctx, "messages")


def _max_tokens(body: dict, ctx: Context, prompt_len: int, names: tuple[str, ...], default: int | None) -> int:
    """The token limit: the field if given (>= 1, at most --max-tokens-limit), else `default`, else as many as the
    limit allows; never past the context (the generation ends there with finish_reason "length")."""
    room = ctx.config.max_seq_len - prompt_len + 1  # the last token drawn is never fed back
    for name in names:
        value = _integer(body, name, 1, None)
        if value is not None:
            if value > ctx.max_tokens_limit:
                raise ApiError(400, f"{name} is {value}, above this server's limit {ctx.max_tokens_limit}", name)
            return min(value, room)
    return min(default or ctx.max_tokens_limit, ctx.max_tokens_limit, room)


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MOST_STOPS:
        raise ApiError(400, f"at most {MOST_STOPS} stop strings, got {len(stops)}", "stop")
    return tuple(_utf8(s, "stop") for s in stops)


def _utf8(text: str, param: str) -> str:
    """text, if it is valid Unicode: JSON's \\ud800 escapes can carry lone surrogates, which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param} is not valid Unicode text (a lone surrogate at character {e.start})",
                       param) from None
    return text


def _logit_bias(bias, ctx: Context, least: float = -100.0, most: float = 100.0) -> dict[int, float] | None:
    """A token id -> bias map: ids in the vocabulary (JSON keys are strings), biases numbers in [least, most]."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ApiError(400, "logit_bias must map token ids to numbers", "logit_bias")
    out = {}
    for key, value in bias.items():
        token = _token_key(key)
        if token in out:
            raise ApiError(400, f"logit_bias names token {token} twice", "logit_bias")
        if not 0 <= token < ctx.config.vocab_size:
            raise ApiError(400, f"logit_bias token {token} is outside the vocabulary [0, {ctx.config.vocab_size})",
                           "logit_bias")
        if not _is_number(value) or not least <= value <= most:
            raise ApiError(400, f"logit_bias values must be numbers in [{least:g}, {most:g}], got {value!r}",
                           "logit_bias")
        out[token] = float(value)
    return out or None


def _token_key(key) -> int:
    """A logit_bias key as a token id: JSON's key text in decimal ASCII digits ("0", "42"; not " 1", "1_0", "01",
    "+1" or other scripts' digits, which int() would take, so that two keys could name one token), or an int (a
    Python caller's map)."""
    if _is_int(key) and key >= 0:
        return key
    if not isinstance(key, str) or not TOKEN_ID.fullmatch(key):
        raise ApiError(400, f"logit_bias key {key!r} is not a token id (decimal digits, no sign or leading zero)",
                       "logit_bias")
    return int(key)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A JSON number a float holds: finite, and an integer no larger than a float goes (10**400 is not one)."""
    if _is_int(x):
        return abs(x) <= 1 << 1000
    return isinstance(x, float) and math.isfinite(x)


def _integer(body: dict, name: str, least: int | None, most: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or (least is not None and value < least) or (most is not None and value > most):
        ends = [f"{sign} {end}" for sign, end in ((">=", least), ("<=", most)) if end is not None]
        bounds = f" in [{least}, {most}]" if len(ends) == 2 else "".join(" " + e for e in ends)
        raise ApiError(400, f"{name} must be an integer{bounds}, got {value!r}", name)
    return value


def _number(body: dict, name: str, least: float, most: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not least <= value <= most:
        raise ApiError(400, f"{name} must be a number in [{least:g}, {most:g}], got {value!r}", name)
    return float(value)


def _boolean(body: dict, name: str, param: str | None = None) -> bool:
    """The field as a JSON boolean (absent or null: false); anything else ("yes", 0, 1) is refused."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{param or name} must be true or false, got {value!r}", param or name)
    return value


# ----------------------------------------------------------------------------------------------------------------
# A job's output
# ----------------------------------------------------------------------------------------------------------------


FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


@dataclass
class Piece:
    """What one token released: text (may be empty while a stop string is possible) and its log-probabilities."""

    text: str
    token: str = ""
    logprob: float | None = None
    top: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    offset: int = 0  # where `token` starts in the completion's token strings (legacy logprobs' text_offset)


class Output:
    """A job's text as tokens arrive: each token decoded in the context of the prompt (as `npllm generate` decodes
    it), cut at the first stop string; the counts for `usage`.

        feed(sampled) -> Piece     a token arrived
        finish(reason) -> Piece    the engine ended the job: the held-back text, and the finish_reason to report
    """

    def __init__(self, spec: Spec, tokenizer):
        self.spec, self.tokenizer = spec, tokenizer
        self.decoder = tokenizer.stream_decoder()
        for t in spec.request.prompt:  # the decoder needs the prompt's context (a leading space, a split character)
            self.decoder.feed(t)
        self.stops = StopStrings(spec.stop)
        self.completion_tokens = 0
        self.token_chars = 0
        self.text = ""
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # prompt tokens the engine took from its prefix cache (set once the job is done)
        self.timings: dict | None = None  # llama.cpp's timings (batching.Handle.timings), set once the job is done

    @property
    def prompt_tokens(self) -> int:
        return len(self.spec.request.prompt)

    @property
    def stopped(self) -> bool:
        """A stop string was found: the job is over (the server cancels what the engine still runs)."""
        return self.stops.stopped

    def feed(self, sampled) -> Piece:
        token = int(sampled.token_ids)
        self.completion_tokens += 1
        piece = Piece(self.stops.feed(self.decoder.feed(token)))
        if self.spec.logprobs is not None:
            piece.token, piece.logprob = self._token_text(token), float(sampled.logprobs)
            piece.offset, self.token_chars = self.token_chars, self.token_chars + len(piece.token)
            piece.top = [(self._token_text(int(i)), float(lp))
                         for i, lp in zip(sampled.top_ids[:self.spec.logprobs], sampled.top_logprobs) if i >= 0]
        self.text += piece.text
        if self.stops.stopped:
            self.finish_reason = "stop"
        return piece

    def finish(self, reason: str) -> Piece:
        tail = "" if self.stops.stopped else self.stops.feed(self.decoder.flush()) + self.stops.flush()
        self.text += tail
        if self.finish_reason is None:
            self.finish_reason = "stop" if self.stops.stopped else FINISH_REASONS.get(reason, "stop")
        return Piece(tail)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def ended(self, handle) -> None:
        """Take the finished job's prefix-cache count and timings from its engine handle (batching.Handle)."""
        if handle is not None:
            self.cached_tokens, self.timings = handle.cached, handle.timings()

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], continuation=True)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def completion_logprobs(pieces: list[Piece]) -> dict:
    """Legacy completions' logprobs: parallel lists over the tokens."""
    return {"tokens": [p.token for p in pieces], "token_logprobs": [p.logprob for p in pieces],
            "top_logprobs": [dict(p.top) for p in pieces], "text_offset": [p.offset for p in pieces]}


def chat_logprobs(pieces: list[Piece]) -> dict:
    """Chat's logprobs: one entry per token with its bytes and alternatives."""
    def entry(token, logprob):
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(p.token, p.logprob), "top_logprobs": [entry(t, lp) for t, lp in p.top]}
                        for p in pieces]}


def completion_body(id_: str, model: str, output: Output, pieces: list[Piece]) -> dict:
    logprobs = completion_logprobs(pieces) if output.spec.logprobs is not None else None
    return {"id": id_, "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": 0, "text": output.text, "logprobs": logprobs,
                         "finish_reason": output.finish_reason}],
            "usage": output.usage(), **with_timings(output)}


def chat_body(id_: str, model: str, output: Output, pieces: list[Piece]) -> dict:
    logprobs = chat_logprobs(pieces) if output.spec.logprobs is not None else None
    return {"id": id_, "object": "chat.completion", "created": now(), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": output.text},
                         "logprobs": logprobs, "finish_reason": output.finish_reason}],
            "usage": output.usage(), **with_timings(output)}


def with_timings(output: Output) -> dict:
    """{"timings": ...} (llama.cpp's field) where the job's are known, else nothing."""
    return {} if output.timings is None else {"timings": output.timings}


def completion_chunk(id_: str, model: str, piece: Piece | None, finish_reason: str | None,
                     logprobs: bool, usage: dict | None = None) -> dict:
    """One streamed chunk; with `usage` (stream_options.include_usage) the last one, with no choices."""
    chunk = {"id": id_, "object": "text_completion", "created": now(), "model": model}
    if usage is not None:
        return {**chunk, "choices": [], "usage": usage}
    lp = completion_logprobs([piece]) if logprobs and piece is not None and piece.token else None
    return {**chunk, "choices": [{"index": 0, "text": piece.text if piece else "", "logprobs": lp,
                                  "finish_reason": finish_reason}]}


def chat_chunk(id_: str, model: str, delta: dict, finish_reason: str | None, piece: Piece | None = None,
               logprobs: bool = False, usage: dict | None = None) -> dict:
    chunk = {"id": id_, "object": "chat.completion.chunk", "created": now(), "model": model}
    if usage is not None:
        return {**chunk, "choices": [], "usage": usage}
    lp = chat_logprobs([piece]) if logprobs and piece is not None and piece.token else None
    return {**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]}
