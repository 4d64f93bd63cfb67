"""The server's sampling fields beyond OpenAI's (those vLLM's and llama.cpp's servers take and the engine has), and
the fields that would change the answer but are not served: each refused with a 400 naming it, never dropped."""

from __future__ import annotations

import dataclasses

import openai
import pytest

import npllm
from npllm.chat import BUILTIN_TEMPLATES
from npllm.generate import generate_ids
from npllm.sampling import SamplingParams, options
from npllm.serve.app import Limits, Server
from npllm.serve.protocol import UNSERVED, ApiError, Context, parse_chat, parse_completion
from test_serve import KEY, MODEL, running


@pytest.fixture(scope="module")
def llm(stories260k):
    return npllm.load(stories260k)


@pytest.fixture(scope="module")
def client(llm):
    server = Server(llm, MODEL, Limits(max_slots=4, max_queue=32, max_tokens_limit=400), BUILTIN_TEMPLATES["chatml"],
                    api_key=KEY)
    with running(server) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ctx(llm):
    return Context(MODEL, llm.tokenizer, llm.config, 400)


@pytest.mark.parametrize("field, value, expected", [
    ("top_k", 40, 40), ("top_k", 0, 0), ("top_k", -1, 0), ("min_p", 0.05, 0.05), ("typical_p", 0.9, 0.9),
    ("repetition_penalty", 1.3, 1.3), ("presence_penalty", 0.5, 0.5), ("frequency_penalty", -0.5, -0.5),
])
def test_the_engines_sampling_fields_are_served(ctx, field, value, expected):
    """vLLM's top_k -1 is off, as npllm's 0."""
    spec = parse_completion({"prompt": "The cat", field: value}, ctx)
    assert getattr(spec.request.params, field) == expected


@pytest.mark.parametrize("fields, param", [
    (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"), (dict(top_k=True), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(typical_p=0), "typical_p"), (dict(typical_p=1.01), "typical_p"), (dict(repetition_penalty=0),
                                                                           "repetition_penalty"),
    (dict(repetition_penalty=-1), "repetition_penalty"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids"), (dict(stop_token_ids=[100000]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(2000))), "stop_token_ids"), (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_bad_values_of_the_added_fields_are_400_naming_them(ctx, fields, param):
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": "The cat", **fields}, ctx)
    assert e.value.status == 400 and e.value.param == param


def test_every_served_option_is_an_engine_field():
    """The server's sampling fields come from SamplingParams' Options, so a field served is one the engine draws
    with; the ones other servers use are all there."""
    served = {option.api for _, option in options(SamplingParams) if option.api}
    assert {"top_k", "min_p", "typical_p", "repetition_penalty", "temperature", "top_p", "seed"} <= served


ASKING = {"structured_outputs": {"json": {}}, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "repeat_penalty": 1.3,
          "n_predict": 5, "functions": [{"name": "f"}], "function_call": "auto", "guided_json": {}, "guided_regex": "a+",
          "guided_choice": ["a", "b"], "guided_grammar": "x", "structural_tag": "{}", "min_tokens": 5,
          "use_beam_search": True, "length_penalty": 0.5, "prompt_logprobs": 1, "mirostat": 2, "tfs_z": 0.9,
          "dynatemp_range": 0.5, "dry_multiplier": 0.8, "xtc_probability": 0.5, "top_a": 0.1, "penalty_last_n": 64,
          "repeat_last_n": 64, "samplers": ["top_k"], "n_probs": 3, "reasoning_effort": "low",
          "modalities": ["text", "audio"], "audio": {"voice": "x"}}


def test_the_table_of_unserved_fields_is_tested_whole():
    assert set(ASKING) == set(UNSERVED)


@pytest.mark.parametrize("field", sorted(ASKING))
def test_an_unserved_field_that_asks_for_something_is_400_naming_it(ctx, field):
    for parse, body in ((parse_completion, {"prompt": "The cat"}),
                        (parse_chat, {"messages": [{"role": "user", "content": "Hi"}]})):
        with pytest.raises(ApiError) as e:
            parse(body | {field: ASKING[field]}, dataclasses.replace(ctx, chat_template=BUILTIN_TEMPLATES["chatml"]))
        assert e.value.status == 400 and e.value.param == field and field in e.value.message


@pytest.mark.parametrize("field", sorted(name for name, (nothing, _) in UNSERVED.items() if nothing))
def test_an_unserved_field_that_asks_for_nothing_is_taken(ctx, field):
    """What clients send by default (tools: [], tool_choice: "none", response_format text, ...) is no request."""
    for value in UNSERVED[field][0]:
        parse_completion({"prompt": "The cat", field: value}, ctx)


def test_top_k_1_at_temperature_1_is_greedy_through_the_server(client, llm):
    """top_k reaches the draw: keeping one token leaves nothing to chance."""
    prompt = "Lily and Ben went to the park"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=1.0, seed=3,
                                       extra_body={"top_k": 1})
    assert answer.choices[0].text == llm.generate(prompt, 40, temperature=0)
    sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=1.0, seed=3)
    assert sampled.choices[0].text != answer.choices[0].text  # without it, seed 3 draws another text


def test_repetition_penalty_min_p_and_typical_p_change_the_answer_as_the_engine_does(client, llm):
    prompt = "Lily and Ben went to the park"
    for fields in ({"repetition_penalty": 1.5}, {"min_p": 0.2, "typical_p": 0.5}):
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0.8, seed=5,
                                           extra_body=fields)
        assert answer.choices[0].text == llm.generate(prompt, 60, temperature=0.8, seed=5, **fields)
    greedy = llm.generate(prompt, 60, temperature=0)  # ends "It is not a boy. It is not a boy. ..."
    assert llm.generate(prompt, 60, temperature=0, repetition_penalty=1.5) != greedy


def test_stop_token_ids_end_the_answer_before_that_token(client, llm):
    prompt = "Once upon a time"
    ids = llm.tokenizer.encode(prompt, bos=True)
    greedy = list(generate_ids(llm.model, ids, 30, SamplingParams(temperature=0)))
    stop = greedy[12]
    first = greedy.index(stop)
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                       extra_body={"stop_token_ids": [stop]})
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == first
    assert answer.choices[0].text == llm.tokenizer.decode(greedy[:first])


def test_ignore_eos_goes_on_past_the_models_end(client, llm):
    prompt = "The cat"  # greedy ends at the model's end of text after ~210 tokens
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=300, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 300
    on = client.completions.create(model=MODEL, prompt=prompt, max_tokens=300, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert on.choices[0].finish_reason == "length" and on.usage.completion_tokens == 300
    assert on.choices[0].text.startswith(plain.choices[0].text)


def test_an_unserved_field_through_the_official_client_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       functions=[{"name": "f", "parameters": {}}])
    assert e.value.body["param"] == "functions"


def test_n_choices_are_each_a_solo_run_seeded_seed_plus_their_index(client, llm):
    """n > 1: choice i is what a one-choice request seeded seed + i answers; usage counts the prompt once and
    every choice's tokens; streamed, each choice's chunks (keyed by index) concatenate to its text."""
    prompt = "Once upon a time"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=1.0, seed=11, n=3)
    texts = [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert texts == [llm.generate(prompt, 30, temperature=1.0, seed=11 + i) for i in range(3)]
    assert len(set(texts)) == 3
    assert answer.usage.prompt_tokens == len(llm.tokenizer.encode(prompt, bos=True))
    assert answer.usage.completion_tokens == 90
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=1.0, seed=11, n=3,
                                       stream=True, stream_options={"include_usage": True})
    streamed, finishes, usage = ["", "", ""], [None] * 3, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert streamed == texts and finishes == ["length"] * 3 and usage.completion_tokens == 90


def test_n_chat_choices_and_a_stop_string_that_cuts_one_choice(client, llm):
    messages = [{"role": "user", "content": "A story, please."}]
    many = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=1.0, seed=4,
                                          n=4, stop=["."])
    solo = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=1.0,
                                           seed=4 + i, stop=["."]).choices[0] for i in range(4)]
    assert [(c.message.content, c.finish_reason) for c in many.choices] == [(c.message.content, c.finish_reason)
                                                                            for c in solo]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=1.0, seed=4,
                                            n=4, stop=["."], stream=True)
    streamed = [""] * 4
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [c.message.content for c in solo]


@pytest.mark.parametrize("n", [0, 17, 1.5, True, "2"])
def test_a_bad_n_is_400(ctx, n):
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": "The cat", "n": n}, ctx)
    assert e.value.status == 400 and e.value.param == "n"


def test_n_choices_count_against_the_queue(llm):
    """Each choice is a job: a request of n choices where fewer places are free is a 429, not a queue overrun."""
    import asyncio

    server = Server(llm, MODEL, Limits(max_slots=1, max_queue=2, max_tokens_limit=50))
    spec = parse_completion({"prompt": "The cat", "n": 4}, server.context)
    with pytest.raises(ApiError) as e:
        server.submit(spec, asyncio.new_event_loop())
    assert e.value.status == 429 and server.active == 0
