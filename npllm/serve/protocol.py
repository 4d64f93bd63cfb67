"""OpenAI's HTTP API as plain data: request bodies checked into generation requests, results into response bodies.

Nothing here knows about HTTP servers, so it is tested (and importable) without the `serve` extra.

    parse_json(data) -> body                 a request's JSON text parsed (ApiError(400) for what no parser takes)
    parse_completion(body, ctx) -> Spec      POST /v1/completions
    parse_chat(body, ctx) -> Spec            POST /v1/chat/completions (messages laid out by the chat template)
                                             both with a structured-output constraint from response_format, or
                                             llama.cpp's json_schema / grammar (npllm.constraint)
    parse_embeddings(body, ctx)              POST /v1/embeddings (EmbeddingSpec; embeddings_body the answer)
    Output                                   a job's text as it arrives: detokenized, cut at stop strings,
                                             with log-probabilities and usage counts
    completion_body / chat_body              the whole response (stream: false)
    completion_chunk / chat_chunk            one server-sent event's data (stream: true)

Field rules follow OpenAI's reference: temperature in [0, 2] (0 greedy), top_p in (0, 1], presence and frequency
penalties in [-2, 2], logit_bias values in [-100, 100] keyed by token id, up to 4 stop strings, n in [1, 16] (each
choice a job of its own, seeded seed + i), completions' logprobs in [0, 5], chat's top_logprobs in [0, 20]; and the
engine's other stages as vLLM's and llama.cpp's servers name them (top_k, min_p, typical_p, repetition_penalty,
stop_token_ids, ignore_eos). A field other servers take that would change the answer and is not served (UNSERVED)
is refused, never dropped. Types are JSON's, strictly: a boolean field takes true or false (not "yes", not 0), an
integer field no boolean, a logit_bias key the decimal digits of a token id. A body nests at most MOST_NESTING levels (whatever its fields: an unknown key of a message reaches the
chat template, whose conversion recurses once per level). A bad field is an ApiError naming it: status 400 with an
OpenAI error body, as the `openai` client expects.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import time
import uuid
from dataclasses import dataclass

import numpy as np

from ..errors import ChatTemplateError, GenerationError
from ..constraint import Constraint
from ..errors import ChatTemplateError, ConstraintError, GenerationError
from ..context import encode_prompt
from ..embed import check_ids, resolve_pooling
from ..generate import Request, check_prompt
from ..sampling import Option, SamplingParams, options
from ..stop import StopStrings
from .tools import ToolError, Tools, parse_tools, tool_calls

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MOST_STOPS = 4
MOST_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs
MOST_CHOICES = 16  # n: each choice is a job in the engine, as a request of its own
MOST_STOP_TOKEN_IDS = 1024  # ends checked in a set: the bound only keeps a body's list from being the vocabulary
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
    n: int = 1  # choices: n jobs of the same request (requests())

    def requests(self) -> list[Request]:
        """The n choices' requests: the same request, the i-th seeded seed + i where a seed is given (so that
        choice i is what a one-choice request with seed + i answers, and the choices differ); without a seed each
        job draws from fresh entropy."""
        seed = self.request.params.seed
        if seed is None:
            return [self.request] * self.n
        return [dataclasses.replace(self.request, params=dataclasses.replace(self.request.params, seed=seed + i))
                for i in range(self.n)]
    tools: Tools | None = None  # a chat request's tools (npllm.serve.tools): the reply may be tool calls

    @property
    def calls_tools(self) -> bool:
        """The reply is read for tool calls (tools given, tool_choice not "none")."""
        return self.tools is not None and self.tools.choice != "none"


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
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) is not None:
            raise ApiError(400, f"{name}: tool calls are served on /v1/chat/completions, not /v1/completions", name)
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
    try:
        tools = parse_tools(body)
    except ToolError as e:
        raise ApiError(400, str(e), e.param) from None
    prompt_ids = _chat_prompt_ids(messages, ctx, tools)
    top = _integer(body, "top_logprobs", 0, MOST_TOP_LOGPROBS)
    wants = _boolean(body, "logprobs")
    if top is not None and not wants:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if wants else None
    max_tokens = _max_tokens(body, ctx, len(prompt_ids), ("max_completion_tokens", "max_tokens"), None)
    return _spec(body, ctx, prompt_ids, max_tokens, logprobs, chat=True, tools=tools)


@dataclass(frozen=True)
class EmbeddingSpec:
    """A checked /v1/embeddings request: each input's token ids, the pooling, and how the vectors are written."""

    inputs: list[list[int]]
    pooling: str
    normalize: bool
    base64: bool  # encoding_format "base64": each vector's little-endian float32 bytes, base64 text (OpenAI's)


def parse_embeddings(body, ctx: Context) -> EmbeddingSpec:
    """POST /v1/embeddings: `input` a text, a list of texts, token ids or a list of token id lists (each text
    encoded as a prompt is, and all checked before any runs); `encoding_format` float | base64; `dimensions` only
    the model's own width (no shortened vectors); the pooling the model's files say (npllm.embed)."""
    body = _object(body)
    _check_model(body, ctx)
    inputs = _embedding_inputs(body.get("input"), ctx)
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, f"encoding_format must be \"float\" or \"base64\", got {encoding!r}", "encoding_format")
    dimensions = _integer(body, "dimensions", 1, None)
    if dimensions is not None and dimensions != ctx.config.dim:
        raise ApiError(400, f"dimensions {dimensions}: this model's embeddings have {ctx.config.dim} (it was not "
                       "trained for shortened vectors)", "dimensions")
    pooling, normalize = _checked(resolve_pooling, "model", ctx.config, None, None)
    return EmbeddingSpec(inputs, pooling, normalize, encoding == "base64")


def _embedding_inputs(value, ctx: Context) -> list[list[int]]:
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_int(t) for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "input must be a text, a list of texts, token ids or a list of token id lists", "input")
    if len(value) > MOST_EMBEDDING_INPUTS:
        raise ApiError(400, f"at most {MOST_EMBEDDING_INPUTS} inputs, got {len(value)}", "input")
    out = []
    for item in value:
        if isinstance(item, str):
            if not item:
                raise ApiError(400, "input holds an empty text (OpenAI's rule: no empty strings)", "input")
            ids = _encode(_utf8(item, "input"), ctx, "input")
        elif isinstance(item, list) and all(_is_int(t) for t in item):
            ids = list(item)
        else:
            raise ApiError(400, "input must be a text, a list of texts, token ids or a list of token id lists",
                           "input")
        _checked(check_ids, "input", ctx.config, ids)
        out.append(ids)
    return out


def embeddings_body(model: str, spec: EmbeddingSpec, vectors) -> dict:
    """OpenAI's embeddings response: one {"object": "embedding", "index", "embedding"} per input, and the tokens
    read as usage."""
    def encoded(v):
        return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() if spec.base64 else [float(x) for x in v]

    tokens = sum(len(ids) for ids in spec.inputs)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


# Request fields other servers take that would change the answer and that npllm does not serve yet: refused with a
# 400 naming the field rather than dropped (a client that asked for JSON or a tool call must not get free text and
# no error). Each with the values that ask for nothing (accepted) and what to use instead where there is something.
UNSERVED = {
    "functions": ([[]], "OpenAI's older function calls are not served: give `tools`"),
    "function_call": (["none"], "OpenAI's older function calls are not served: give `tool_choice`"),
    "structured_outputs": ([], "give response_format, json_schema or grammar (docs/structured.md)"),
    "guided_json": ([], "give response_format or json_schema (docs/structured.md)"),
    "guided_regex": ([], "vLLM's guided fields are not served: give response_format, json_schema or grammar"),
    "guided_choice": ([], "vLLM's guided fields are not served: give response_format, json_schema or grammar"),
    "guided_grammar": ([], "give grammar (docs/structured.md)"),
    "structural_tag": ([], "vLLM's guided fields are not served: give response_format, json_schema or grammar"),
    "min_tokens": ([0], "min_tokens is not served"),
    "use_beam_search": ([False], "beam search is served by `npllm generate --num-beams`, not the server"),
    "length_penalty": ([1, 1.0], "beam search is served by `npllm generate --num-beams`, not the server"),
    "prompt_logprobs": ([0], "prompt_logprobs is not served (`npllm perplexity` scores a text)"),
    "mirostat": ([0], "mirostat sampling is not served"),
    "mirostat_tau": ([], "mirostat sampling is not served"),
    "mirostat_eta": ([], "mirostat sampling is not served"),
    "repeat_penalty": ([1, 1.0], "give repetition_penalty (the same penalty, vLLM's name)"),
    "n_predict": ([], "give max_tokens"),
    "tfs_z": ([1, 1.0], "tail-free sampling is not served"),
    "dynatemp_range": ([0, 0.0], "dynamic temperature is not served"),
    "dry_multiplier": ([0, 0.0], "DRY sampling is not served (no_repeat_ngram is `npllm generate --no-repeat-ngram`)"),
    "xtc_probability": ([0, 0.0], "XTC sampling is not served"),
    "top_a": ([0, 0.0], "top-a sampling is not served"),
    "penalty_last_n": ([-1], "penalties here see the whole context (penalty_last_n -1)"),
    "repeat_last_n": ([-1], "penalties here see the whole context (repeat_last_n -1)"),
    "samplers": ([], "the order of the sampling stages is fixed (docs/sampling.md)"),
    "n_probs": ([0], "use logprobs (completions) or logprobs with top_logprobs (chat)"),
    "reasoning_effort": ([], "this model does not reason before it answers"),
    "modalities": ([["text"]], "only text is served"),
    "audio": ([], "only text is served"),
}


def check_unserved(body: dict) -> None:
    """ApiError(400) naming the first field of UNSERVED that asks for something (null: absent)."""
    for name, (nothing, why) in UNSERVED.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in nothing):
            raise ApiError(400, f"{name} is not supported: {why}", name)


def _spec(body: dict, ctx: Context, prompt_ids: list[int], max_tokens: int, logprobs: int | None,
          chat: bool, tools: Tools | None = None) -> Spec:
    check_unserved(body)
    n = _integer(body, "n", 1, MOST_CHOICES) or 1
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    include_usage = _boolean(options or {}, "include_usage", "stream_options.include_usage") and stream
    params = _sampling(body, ctx, logprobs)
    request = Request(prompt_ids, max_tokens, params, stop_ids=_stop_token_ids(body.get("stop_token_ids"), ctx),
                      ignore_eos=_boolean(body, "ignore_eos"), constraint=_constraint(body, ctx, tools))
    return Spec(request, _stops(body.get("stop")), stream, include_usage, logprobs, chat, n=n, tools=tools)


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _constraint(body: dict, ctx: Context, tools: Tools | None = None):
    """The structured-output constraint a request asks for, bound to the model's tokenizer (None when none):
    OpenAI's response_format {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}, or llama.cpp's `json_schema` (a schema) or `grammar` (GBNF or Lark) fields; at most one. A schema
    keyword that would not be enforced is a 400 naming it (strict or not: every schema given is enforced)."""
    calls = tools.constraint if tools is not None and tools.choice != "none" else None
    asked = [(param, make) for param, make in (("response_format", _response_format(body.get("response_format"))),
                                               ("json_schema", _llama_field(body, "json_schema", dict)),
                                               ("grammar", _llama_field(body, "grammar", str)),
                                               ("tools", calls)) if make is not None]
    if not asked:
        return None
    if len(asked) > 1:
        raise ApiError(400, f"{' and '.join(p for p, _ in asked)} each constrain the output: give one of them",
                       asked[1][0])
    param, make = asked[0]
    try:
        return make().bind(ctx.tokenizer, ctx.config.vocab_size)
    except ConstraintError as e:
        raise ApiError(400, f"{param}: {e}", param) from None


def _response_format(value):
    """A maker of the Constraint that response_format asks for; None for text (or absent)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, f"response_format must be an object, got {type(value).__name__}", "response_format")
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ApiError(400, f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}",
                       "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return lambda: Constraint.json({"type": "object"})
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema must be an object {name, schema, strict}",
                       "response_format.json_schema")
    if not isinstance(spec.get("name"), str):
        raise ApiError(400, "response_format.json_schema.name must be a string", "response_format.json_schema.name")
    _boolean(spec, "strict", "response_format.json_schema.strict")
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, "response_format.json_schema.schema must be a JSON Schema (an object)",
                       "response_format.json_schema.schema")
    return lambda: Constraint.json(schema)


def _llama_field(body: dict, name: str, kind: type):
    """A maker of the Constraint of llama.cpp's json_schema (a schema object) or grammar (text) field."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind):
        raise ApiError(400, f"{name} must be {'a JSON Schema object' if kind is dict else 'a string'}", name)
    return (lambda: Constraint.json(value)) if kind is dict else (lambda: Constraint.grammar(value))


def _sampling(body: dict, ctx: Context, logprobs: int | None, params_type: type = SamplingParams) -> SamplingParams:
    """SamplingParams from the request's fields, one per field whose Option names one (npllm.sampling.options):
    a number in its range, an integer, or a token -> bias map; absent fields keep SamplingParams' defaults. The
    log-probabilities asked for (the endpoint's own fields) come as `logprobs`: the chosen token's log-probability
    comes with its alternatives, so at least one is asked for."""
    keywords = {}
    for f, option in options(params_type):
        if option.api is not None and body.get(option.api) is not None:
            value = _field(body, option, ctx)
            keywords[f.name] = f.default if value == option.api_off else value  # vLLM's top_k -1: off, our 0
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
    least, most = -math.inf if least is None else least, math.inf if most is None else most
    value = body[name]
    if option.api_open and _is_number(value) and value == least:
        raise ApiError(400, f"{name} must be a number in ({least:g}, {most:g}], got {value!r}", name)
    return _number(body, name, least, most, None)


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


def _chat_prompt_ids(messages: list[dict], ctx: Context, tools: Tools | None = None) -> list[int]:
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
                                    eos_token=eos, template_name=ctx.template_name or None,
                                    tools=None if tools is None else tools.for_template())
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


def _stop_token_ids(ids, ctx: Context) -> frozenset[int]:
    """vLLM's stop_token_ids: token ids in the vocabulary that end the generation (not returned), as the model's
    own end-of-sequence id does."""
    if ids is None:
        return frozenset()
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise ApiError(400, "stop_token_ids must be a list of token ids", "stop_token_ids")
    if len(ids) > MOST_STOP_TOKEN_IDS:
        raise ApiError(400, f"at most {MOST_STOP_TOKEN_IDS} stop_token_ids, got {len(ids)}", "stop_token_ids")
    outside = [t for t in ids if not 0 <= t < ctx.config.vocab_size]
    if outside:
        raise ApiError(400, f"stop_token_ids: {outside[0]} is outside the vocabulary [0, {ctx.config.vocab_size})",
                       "stop_token_ids")
    return frozenset(ids)


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
        return usage([self])

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


def usage(outputs: list[Output]) -> dict:
    """One request's counts: its prompt once (the choices share it; its tokens taken from the prefix cache as the
    first choice's job found them), the tokens of every choice."""
    prompt, completion = outputs[0].prompt_tokens, sum(o.completion_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": outputs[0].cached_tokens}}


def with_timings(outputs: list[Output]) -> dict:
    """{"timings": ...} (llama.cpp's field, the first choice's job's) where they are known, else nothing."""
    return {} if outputs[0].timings is None else {"timings": outputs[0].timings}


def completion_body(id_: str, model: str, outputs: list[Output], pieces: list[list[Piece]]) -> dict:
    """The whole answer: one choice per output, with its token pieces' log-probabilities where asked."""
    def choice(i: int, output: Output) -> dict:
        logprobs = completion_logprobs(pieces[i]) if output.spec.logprobs is not None else None
        return {"index": i, "text": output.text, "logprobs": logprobs, "finish_reason": output.finish_reason}

    return {"id": id_, "object": "text_completion", "created": now(), "model": model,
            "choices": [choice(i, o) for i, o in enumerate(outputs)], "usage": usage(outputs), **with_timings(outputs)}


def chat_body(id_: str, model: str, outputs: list[Output], pieces: list[list[Piece]]) -> dict:
    def choice(i: int, output: Output) -> dict:
        logprobs = chat_logprobs(pieces[i]) if output.spec.logprobs is not None else None
        message, finish = reply_message(output)
        return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}

    return {"id": id_, "object": "chat.completion", "created": now(), "model": model,
            "choices": [choice(i, o) for i, o in enumerate(outputs)], "usage": usage(outputs), **with_timings(outputs)}


def reply_message(output: Output) -> tuple[dict, str]:
    """A finished chat reply as OpenAI's message and finish_reason: its tool calls where it made some (a reply
    that ended, not one cut by the token limit), finish_reason "tool_calls"; else its text."""
    calls = tool_calls(output.text) if output.spec.calls_tools and output.finish_reason == "stop" else None
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": output.text}, output.finish_reason


def completion_chunk(id_: str, model: str, piece: Piece | None, finish_reason: str | None,
                     logprobs: bool, usage: dict | None = None, index: int = 0) -> dict:
    """One streamed chunk; with `usage` (stream_options.include_usage) the last one, with no choices."""
    chunk = {"id": id_, "object": "text_completion", "created": now(), "model": model}
    if usage is not None:
        return {**chunk, "choices": [], "usage": usage}
    lp = completion_logprobs([piece]) if logprobs and piece is not None and piece.token else None
    return {**chunk, "choices": [{"index": index, "text": piece.text if piece else "", "logprobs": lp,
                                  "finish_reason": finish_reason}]}


def chat_chunk(id_: str, model: str, delta: dict, finish_reason: str | None, piece: Piece | None = None,
               logprobs: bool = False, usage: dict | None = None, index: int = 0) -> dict:
    chunk = {"id": id_, "object": "chat.completion.chunk", "created": now(), "model": model}
    if usage is not None:
        return {**chunk, "choices": [], "usage": usage}
    lp = chat_logprobs([piece]) if logprobs and piece is not None and piece.token else None
    return {**chunk, "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]}
