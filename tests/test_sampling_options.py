"""SamplingParams' fields are offered outside Python by their Option alone: the command line's sampling flags and
the server's sampling request fields are built from the fields' metadata (npllm.sampling.options), so a field
declared with an Option is parsed by both with nothing else to change. Proved here with fields the code has never
seen, declared on a subclass."""

import argparse
import dataclasses
import math
import re
from types import SimpleNamespace

import pytest

from npllm import cli
from npllm.sampling import Option, SamplingParams, options
from npllm.serve.protocol import ApiError, Context, _sampling


@dataclasses.dataclass(frozen=True)
class Extended(SamplingParams):
    """Two stages nobody wrote code for: a real and a bounded integer, both on the command line and the server."""

    top_a: float = dataclasses.field(default=0.0, metadata={"option": Option(
        "real", flag="--top-a", help="a new filter's strength (0: off)", api="top_a", api_range=(0.0, 1.0))})
    window: int = dataclasses.field(default=0, metadata={"option": Option(
        "integer", flag="--window", least=0, most=64, metavar="W", help="a new penalty's reach",
        api="window", api_range=(0, 64))})


CTX = Context("m", tokenizer=None, config=SimpleNamespace(vocab_size=32), max_tokens_limit=16)


def sampling_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's actions by dest, help aside."""
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def command_parser(command: str) -> argparse.ArgumentParser:
    return cli.build_parser()._subparsers._group_actions[0].choices[command]


def test_every_field_has_one_option_and_every_flag_one_field():
    """Each SamplingParams field declares how it is asked for; a flag or a request field names one field only."""
    declared = options()
    assert [f.name for f, _ in declared] == [f.name for f in dataclasses.fields(SamplingParams)]
    flags = [o.flag for _, o in declared if o.flag]
    apis = [o.api for _, o in declared if o.api]
    assert len(flags) == len(set(flags)) and len(apis) == len(set(apis))


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_sampling_flags_are_the_options(command):
    """Every flagged field is one argparse argument of generate and chat: its flag, its dest (the field's name), its
    default (the field's, or the Option's cli_default), its help; nothing else there is named after a field."""
    actions = sampling_actions(command_parser(command))
    for f, option in options():
        if option.flag is None:
            assert f.name not in actions
            continue
        action = actions[f.name]
        assert action.option_strings == [option.flag] and action.help == option.help
        default = f.default if option.cli_default is None else option.cli_default
        assert action.default == ([] if option.kind == "text" else default)


def test_flags_of_new_fields_are_parsed_into_the_object():
    parser = argparse.ArgumentParser()
    cli.add_sampling_arguments(parser, Extended)
    args = parser.parse_args(["--top-a", "0.25", "--window", "8", "--top-k", "3", "--stop", "x", "--stop", "y"])
    params = cli.sampling_params(args, Extended)
    assert isinstance(params, Extended)
    assert (params.top_a, params.window, params.top_k, params.stop) == (0.25, 8, 3, ("x", "y"))
    defaults = cli.sampling_params(parser.parse_args([]), Extended)
    assert (defaults.top_a, defaults.window, defaults.top_p) == (0.0, 0, 0.9)  # top_p: the command line's default
    assert "W" in parser.format_help() and "a new filter's strength" in parser.format_help()


@pytest.mark.parametrize("argv", [["--window", "65"], ["--window", "-1"], ["--window", "x"], ["--top-a", "x"]])
def test_a_new_flag_is_checked_by_the_parser(argv, capsys):
    """An integer flag's range and a value of the wrong type are refused by argparse (exit 2, one error line)."""
    parser = argparse.ArgumentParser(prog="npllm")
    cli.add_sampling_arguments(parser, Extended)
    with pytest.raises(SystemExit) as exit:
        parser.parse_args(argv)
    assert exit.value.code == 2 and f"argument {argv[0]}" in capsys.readouterr().err


def test_request_fields_of_new_fields_are_parsed_into_the_object():
    params = _sampling({"top_a": 0.5, "window": 3, "temperature": 0.7, "no_repeat_ngram": 5}, CTX, None, Extended)
    assert isinstance(params, Extended)
    assert (params.top_a, params.window, params.temperature) == (0.5, 3, 0.7)
    assert params.no_repeat_ngram == 0  # a field with no request field is not read from the body
    assert _sampling({}, CTX, None, Extended).top_a == 0.0


@pytest.mark.parametrize("body,param", [({"top_a": 1.5}, "top_a"), ({"top_a": "x"}, "top_a"),
                                        ({"window": 65}, "window"), ({"window": 2.5}, "window")])
def test_a_new_request_field_is_checked_against_its_range(body, param):
    with pytest.raises(ApiError) as error:
        _sampling(body, CTX, None, Extended)
    assert error.value.status == 400 and error.value.param == param


def served():
    return [(f, o) for f, o in options() if o.api is not None]


@pytest.mark.parametrize("field,option", served(), ids=[f.name for f, _ in served()])
def test_every_served_field_takes_its_range_and_refuses_past_it(field, option):
    """Each request field named by an Option: a value inside its range reaches SamplingParams, one past either end
    is a 400 naming it."""
    least, most = option.api_range
    value = least + 1 if most is None else least + (most - least) / 4  # not the field's default
    if option.kind == "integer":
        value = int(value)
    inside, outside, expected = value, least - 1, value
    if option.kind == "bias":  # a token id -> bias map
        inside, outside, expected = {"3": value}, {"3": most + 1}, {3: value}
    params = _sampling({option.api: inside}, CTX, None)
    assert getattr(params, field.name) == expected
    with pytest.raises(ApiError) as error:
        _sampling({option.api: outside}, CTX, None)
    assert error.value.param == option.api
    if option.api_open:  # the excluded end
        with pytest.raises(ApiError, match=r"\(") as error:
            _sampling({option.api: least}, CTX, None)
        assert error.value.param == option.api


def test_logprobs_come_from_the_endpoint_not_a_field():
    assert _sampling({}, CTX, None).logprobs == 0
    assert _sampling({}, CTX, 0).logprobs == 1  # the chosen token's log-probability comes with one alternative
    assert _sampling({}, CTX, 5).logprobs == 5
    assert math.isclose(_sampling({"temperature": 0}, CTX, None).temperature, 0.0)


def test_the_api_takes_the_object_and_keywords_replace_its_fields(stories260k):
    """LLM.generate / stream / generate_ids / chat take params=SamplingParams; keywords beside it replace fields."""
    import npllm
    from npllm.errors import GenerationError

    llm = npllm.load(stories260k)
    params = SamplingParams(temperature=0.8, top_k=20, seed=3)
    sampled = llm.generate("Once", 12, params=params)
    assert sampled == llm.generate("Once", 12, temperature=0.8, top_k=20, seed=3)
    assert llm.generate("Once", 12, params=params, seed=4) == llm.generate("Once", 12, temperature=0.8, top_k=20,
                                                                          seed=4) != sampled
    assert llm.generate(["Once", "Lily"], 12, params=params)[0] == sampled  # a batch: each prompt as alone
    ids = llm.tokenizer.encode("Once", bos=True)
    assert list(llm.generate_ids(ids, 12, params=params)) == list(llm.generate_ids(ids, 12, **dataclasses.asdict(
        params)))
    messages = [{"role": "user", "content": "Hi"}]
    assert llm.chat(messages, 8, chat_template="chatml", params=params) == llm.chat(
        messages, 8, chat_template="chatml", temperature=0.8, top_k=20, seed=3)
    with pytest.raises(GenerationError, match="params must be a SamplingParams"):
        llm.generate("Once", 3, params={"temperature": 0})


def test_an_unknown_keyword_is_refused_by_the_call_naming_it(stories260k):
    """The sampling keywords are SamplingParams' fields, built into one SamplingParams at the call: any other keyword
    is a TypeError from the call itself, naming the keyword (not one from deep inside, nor silently dropped)."""
    import npllm
    from npllm.chat.session import ChatSession

    llm = npllm.load(stories260k, backend="numpy")
    messages = [{"role": "user", "content": "Hi"}]
    session = ChatSession(llm, "chatml")
    calls = {"LLM.generate()": lambda **kw: llm.generate("Once", 3, **kw),
             "LLM.stream()": lambda **kw: list(llm.stream("Once", 3, **kw)),
             "LLM.generate_ids()": lambda **kw: llm.generate_ids([1], 3, **kw),
             "LLM.chat()": lambda **kw: llm.chat(messages, 3, chat_template="chatml", **kw),
             "LLM.chat_stream()": lambda **kw: llm.chat_stream(messages, 3, chat_template="chatml", **kw),
             "ChatSession.stream()": lambda **kw: list(session.stream(messages, 3, **kw)),
             "ChatSession.send()": lambda **kw: list(session.send("Hi", 3, **kw))}
    for caller, call in calls.items():
        for params in (None, SamplingParams(temperature=0)):
            with pytest.raises(TypeError, match=re.escape(f"{caller} got unexpected keyword argument 'temprature' "
                                                          "(its sampling keywords are SamplingParams' fields: ")):
                call(params=params, temprature=0)
    with pytest.raises(TypeError, match=r"LLM.generate\(\) got unexpected keyword arguments 'echo', 'beams'"):
        llm.generate(["Once", "Lily"], 3, echo=True, beams=2)
    assert session.messages == []  # a turn refused at the call is not kept


def test_params_given_explicitly_equal_the_keyword_form(stories260k):
    """generate(prompt, n, SamplingParams(...)) (positional or params=) draws exactly what the same fields given as
    keywords draw; the same for a Speculative record and its fields as keywords."""
    import npllm
    from npllm.speculative import Speculative

    llm = npllm.load(stories260k, backend="numpy")
    params = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=5)
    keywords = llm.generate("Once", 16, temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=5)
    assert llm.generate("Once", 16, params) == llm.generate("Once", 16, params=params) == keywords
    assert "".join(llm.stream("Once", 16, params)) == keywords
    greedy = llm.generate("Once", 16, temperature=0)
    assert llm.generate("Once", 16, temperature=0, speculative=Speculative(draft_layers=2, num_draft=3)) == greedy
    assert llm.generate("Once", 16, temperature=0, speculative=Speculative(draft_layers=1), draft_layers=2,
                        num_draft=3) == greedy  # the keywords replace the record's fields
