"""Structured outputs through `npllm serve` and the official openai client: response_format json_object and
json_schema on /v1/chat/completions and /v1/completions, llama.cpp's json_schema and grammar fields, on stories260K
(SentencePiece-style pieces) and a byte-level BPE model (the random qwen2_bias fixture). Every output that ends with
finish_reason "stop" validates with jsonschema against its schema; refused schemas and formats are 400s naming the
keyword or the field."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

import npllm
from npllm.batch import BadRequest, Runner
from npllm.chat import BUILTIN_TEMPLATES
from npllm.serve.app import Limits, Server
from test_serve import running

jsonschema = pytest.importorskip("jsonschema")

KEY = "sk-structured"
QWEN = Path(__file__).parent / "fixtures" / "hf" / "qwen2_bias"

# Schemas written for this test (none is a test case of llguidance's): nested objects, arrays with bounds, enums,
# anyOf, $ref, patterns, number bounds, additionalProperties false.
SCHEMAS = {
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
            "size": {"enum": ["s", "m", "l"]},
        },
        "required": ["id", "qty", "size"],
        "additionalProperties": False,
    },
    "point_list": {
        "type": "array",
        "items": {"$ref": "#/$defs/point"},
        "minItems": 1,
        "maxItems": 3,
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                                                              "y": {"type": "integer", "exclusiveMinimum": 0,
                                                                    "maximum": 50}},
                            "required": ["x", "y"], "additionalProperties": False}},
    },
    "either": {
        "anyOf": [{"type": "integer", "minimum": 100, "maximum": 999},
                  {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                    "who": {"type": "string", "maxLength": 5}},
                   "required": ["ok"], "additionalProperties": False}],
    },
    "nested": {
        "type": "object",
        "properties": {"user": {"type": "object",
                                "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                               "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                                        "maxItems": 2}},
                                "required": ["name", "tags"], "additionalProperties": False}},
        "required": ["user"],
        "additionalProperties": False,
    },
}


def _server(llm, name):
    return Server(llm, name, Limits(max_slots=4, max_queue=32, max_tokens_limit=400), BUILTIN_TEMPLATES["chatml"],
                  api_key=KEY)


@pytest.fixture(scope="module", params=["stories260K", "qwen2_bias"])
def client(request, stories260k):
    llm = npllm.load(stories260k if request.param == "stories260K" else QWEN, backend="numpy")
    with running(_server(llm, request.param)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60), request.param


def _valid(text: str, schema) -> bool:
    jsonschema.validate(json.loads(text), schema)  # raises with the reason on a broken promise
    return True


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_stopped_output_validates_against_its_schema(client, name):
    api, model = client
    schema, stopped = SCHEMAS[name], 0
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    for seed in range(4):
        chat = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Give me JSON."}],
                                           response_format=fmt, max_tokens=120, seed=seed, temperature=1.0)
        choice = chat.choices[0]
        if choice.finish_reason == "stop":
            stopped += _valid(choice.message.content, schema)
        else:
            assert choice.finish_reason == "length"
        done = api.completions.create(model=model, prompt="Once upon a time", max_tokens=120, seed=seed,
                                      extra_body={"response_format": fmt})
        if done.choices[0].finish_reason == "stop":
            stopped += _valid(done.choices[0].text, schema)
    assert stopped >= 2, f"only {stopped} of 8 outputs ended within 120 tokens"


def test_json_object_streamed_and_llama_cpp_fields(client):
    api, model = client
    stream = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "JSON please"}],
                                         response_format={"type": "json_object"}, max_tokens=150, seed=3,
                                         stream=True)
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads("".join(pieces)), dict)
    schema = SCHEMAS["order"]
    done = api.completions.create(model=model, prompt="The order:", max_tokens=60, seed=1,
                                  extra_body={"json_schema": schema})
    if done.choices[0].finish_reason == "stop":
        _valid(done.choices[0].text, schema)
    for grammar in ('root ::= "yes" | "no" | "maybe"', 'start: "yes" | "no" | "maybe"'):
        done = api.completions.create(model=model, prompt="Answer:", max_tokens=10, seed=2,
                                      extra_body={"grammar": grammar})
        assert done.choices[0].text in ("yes", "no", "maybe") and done.choices[0].finish_reason == "stop"


def test_a_cut_output_is_length_not_stop(client):
    api, model = client
    done = api.completions.create(model=model, prompt="x", max_tokens=3, seed=0,
                                  extra_body={"json_schema": {"type": "string", "pattern": "^[a-z]{30}$"}})
    assert done.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param, said", [
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name, schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array",
                                                                                       "uniqueItems": True}}}},
     "response_format", "'uniqueItems' at /uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", "true or false"),
    ({"json_schema": {"properties": {"when": {"type": "string", "format": "uri"}}}}, "json_schema", "format 'uri'"),
    ({"grammar": "root ::= undefined"}, "grammar", "undefined"),
    ({"grammar": 'start: "a"', "json_schema": {}}, "grammar", "give one of them"),
])
def test_refused_formats_and_schemas_are_400_naming_them(client, body, param, said):
    api, model = client
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=model, prompt="x", max_tokens=5, extra_body=body)
    error = e.value.body
    assert error["param"] == param and said in error["message"], error


def test_batch_lines_take_response_format(stories260k):
    llm = npllm.load(stories260k, backend="numpy")
    runner = Runner(llm, "stories260K", BUILTIN_TEMPLATES["chatml"], slots=2)
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMAS["order"]}}
    lines = [(i, {"prompt": "Once", "max_tokens": 100, "seed": i, "response_format": fmt}) for i in range(4)]
    results = [record for _, record in runner.run(lines)]
    finished = [r for r in results if r["finish_reason"] == "stop"]
    assert finished and all(_valid(r["text"], SCHEMAS["order"]) for r in finished)
    with pytest.raises(BadRequest, match="'not' at /not"):
        runner.spec({"prompt": "x", "json_schema": {"not": {}}})


def test_server_hygiene_fields_vllm_and_llama_cpp_take_are_served_or_refused(client):
    api, model = client
    base = dict(model=model, prompt="Once upon a time", max_tokens=12, seed=4)
    plain = api.completions.create(**base, temperature=2.0).choices[0].text
    top1 = api.completions.create(**base, temperature=2.0, extra_body={"top_k": 1}).choices[0].text
    greedy = api.completions.create(**base, temperature=0).choices[0].text
    assert top1 == greedy and plain != top1  # top_k is applied, not dropped
    for body in ({"min_p": 0.5}, {"typical_p": 0.5}, {"repetition_penalty": 1.3}):
        assert isinstance(api.completions.create(**base, extra_body=body).choices[0].text, str)
    for name, value in (("tools", [{"type": "function", "function": {"name": "f"}}]), ("guided_json", {}),
                        ("mirostat", 2), ("min_tokens", 3)):
        with pytest.raises(openai.BadRequestError) as e:
            api.completions.create(**base, extra_body={name: value})
        assert e.value.body["param"] == name
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(**base, extra_body={"stop_token_ids": [-1]})
    assert e.value.body["param"] == "stop_token_ids"


def test_stop_token_ids_and_ignore_eos_reach_the_request(stories260k):
    from npllm.serve.protocol import Context, parse_completion

    llm = npllm.load(stories260k, backend="numpy")
    ctx = Context("m", llm.tokenizer, llm.config, 400)
    request = parse_completion({"prompt": "x", "stop_token_ids": [5, 7], "ignore_eos": True}, ctx).request
    assert request.stop_ids == {5, 7} and request.ignore_eos
    greedy = llm.generate_ids(llm.tokenizer.encode("Once"), 8, temperature=0)
    second = list(greedy)[1]
    spec = parse_completion({"prompt": "Once", "stop_token_ids": [second], "temperature": 0, "max_tokens": 8}, ctx)
    from npllm.generate import decode

    assert len(list(decode(llm.model, spec.request))) == 1  # the second greedy token ends it, unreturned


# ----------------------------------------------------------------------------------------------------------------
# Tool calls (Hermes / Qwen format), through the openai client

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.arguments }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


@pytest.fixture(scope="module")
def tool_client(stories260k):
    llm = npllm.load(stories260k, backend="numpy")
    server = Server(llm, "stories260K", Limits(max_slots=2, max_queue=8, max_tokens_limit=400), TOOL_TEMPLATE,
                    api_key=KEY)
    with running(server) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _ask(api, **fields):
    return api.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Weather?"}],
                                       max_tokens=200, **fields)


def _check_calls(calls, names=("get_weather", "add")):
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_required_and_named_tool_choice_give_valid_calls(tool_client):
    made = 0
    for seed in range(3):
        reply = _ask(tool_client, tools=[WEATHER, ADD], tool_choice="required", seed=seed,
                     parallel_tool_calls=seed == 0)  # several calls in a row: this model rarely stops making them
        choice = reply.choices[0]
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None and choice.message.tool_calls
            _check_calls(choice.message.tool_calls)
            made += 1
        named = _ask(tool_client, tools=[WEATHER, ADD], seed=seed, parallel_tool_calls=False,
                     tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
        if named.finish_reason == "tool_calls":
            assert len(named.message.tool_calls) == 1
            _check_calls(named.message.tool_calls, ("add",))
            made += 1
    assert made >= 3


def test_streamed_calls_concatenate_to_the_whole(tool_client):
    whole = _ask(tool_client, tools=[ADD], tool_choice="required", seed=5, parallel_tool_calls=False).choices[0]
    assert whole.finish_reason == "tool_calls"
    stream = _ask(tool_client, tools=[ADD], tool_choice="required", seed=5, parallel_tool_calls=False, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": None, "arguments": ""})
            if part.function.name:
                entry["name"] = part.function.name
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "add"
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.message.tool_calls[0].function.arguments)


def test_auto_and_none_and_a_tool_reply_in_the_next_turn(tool_client):
    for seed in range(3):
        choice = _ask(tool_client, tools=[WEATHER], seed=seed).choices[0]  # auto: text, or calls
        if choice.finish_reason == "tool_calls":
            _check_calls(choice.message.tool_calls)
        else:
            assert not (choice.message.content or "").startswith("<")
    plain = _ask(tool_client, tools=[WEATHER], tool_choice="none", seed=1).choices[0]
    assert plain.message.tool_calls is None and isinstance(plain.message.content, str)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    follow = tool_client.chat.completions.create(
        model="stories260K", max_tokens=10, seed=1, tools=[ADD],
        messages=[{"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "3"}], tool_choice="none")
    assert isinstance(follow.choices[0].message.content, str)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]},
     "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
])
def test_bad_tools_are_400_naming_the_field(tool_client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(tool_client, **fields)
    assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        tool_client.completions.create(model="stories260K", prompt="x", max_tokens=3, extra_body={"tools": [WEATHER]})
    assert e.value.body["param"] == "tools"


def test_batch_chat_lines_with_tools_record_their_calls(stories260k):
    llm = npllm.load(stories260k, backend="numpy")
    runner = Runner(llm, "stories260K", TOOL_TEMPLATE, slots=2)
    line = {"messages": [{"role": "user", "content": "Add."}], "tools": [ADD], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 80, "seed": 3}
    [(_, record)] = list(runner.run([(0, line)]))
    assert record["finish_reason"] == "tool_calls", record
    (call,) = record["tool_calls"]
    assert call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS["add"])
