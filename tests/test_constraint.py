"""Structured outputs (npllm.constraint): the bridge to llguidance (each id's bytes, specials, padded ids), the
schemas refused with the keyword and its path, and the laws of the constraint stage: a masked token is never drawn,
the draw among allowed tokens is the unconstrained pipeline's on the allowed sub-vocabulary, greedy is the argmax over
the allowed set, finished outputs are in the language, stop ids are allowed exactly where the language may end, and
a language that can only end finishes without another forward."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npllm
from npllm.constraint import Constraint, check_schema
from npllm.errors import ConstraintError, GenerationError
from npllm.sampling import SamplingParams, constrain, explain_steps, sample_step
from npllm.testing.constraint_laws import check_constraint
from npllm.tokenizer import load_tokenizer
from npllm.tokenizer.bytelevel import ByteLevelBPE

jsonschema = pytest.importorskip("jsonschema")

DATA = Path(npllm.__file__).parent / "data" / "stories260K"
QWEN = Path(__file__).parent / "fixtures" / "hf" / "qwen2_bias" / "tokenizer.json"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8, "pattern": "^[a-z ]+$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def end(tok) -> int:
    """The tokenizer's EOS (the byte-level fixture has none: its first special id stands in)."""
    return tok.eos_id if tok.eos_id is not None else min(tok.special_ids)


@pytest.fixture(scope="module")
def tokenizers():
    return {"bpe": load_tokenizer(DATA / "tok512.bin"), "sentencepiece": load_tokenizer(DATA / "tok512.model"),
            "bytelevel": ByteLevelBPE.from_file(QWEN)}


# ----------------------------------------------------------------------------------------------------------------
# The bridge: each id's bytes, the specials, the padded ids


def test_sentencepiece_pieces_are_their_bytes(tokenizers):
    tok = tokenizers["sentencepiece"]
    space = next(i for i in range(tok.vocab_size) if tok.id_to_piece(i).startswith("\u2581") and
                 len(tok.id_to_piece(i)) > 1)
    assert tok.token_bytes(space) == tok.id_to_piece(space).replace("\u2581", " ").encode()
    byte = next(i for i in range(tok.vocab_size) if tok.id_to_piece(i) == "<0x7B>")
    assert tok.token_bytes(byte) == b"{"
    assert tok.is_special(tok.eos_id) and tok.is_special(tok.bos_id) and not tok.is_special(byte)


def test_bytelevel_specials_are_never_text(tokenizers):
    tok = tokenizers["bytelevel"]
    assert tok.special_ids and all(tok.is_special(i) for i in tok.special_ids)
    bound = Constraint.json().bind(tok)
    allowed = bound.start().allowed()
    assert not allowed[sorted(tok.special_ids)].any()


@pytest.mark.parametrize("name", ["bpe", "sentencepiece", "bytelevel"])
def test_padded_ids_are_never_allowed(tokenizers, name):
    tok = tokenizers[name]
    state = Constraint.json().bind(tok, tok.vocab_size + 7).start()
    for _ in range(5):
        allowed = state.allowed([end(tok)])
        assert allowed.shape == (tok.vocab_size + 7,) and not allowed[tok.vocab_size:].any()
        state.advance(int(np.flatnonzero(allowed[:tok.vocab_size] & ~np.isin(np.arange(tok.vocab_size),
                                                                               [end(tok)]))[0]))


# ----------------------------------------------------------------------------------------------------------------
# Refused schemas: the keyword and its path, never dropped


@pytest.mark.parametrize("schema, said", [
    ({"properties": {"tags": {"type": "array", "uniqueItems": True}}}, "'uniqueItems' at /properties/tags"),
    ({"type": "string", "maxLenght": 3}, "'maxLenght' at /maxLenght"),
    ({"anyOf": [{"type": "object", "unevaluatedProperties": False}]}, "'unevaluatedProperties' at /anyOf/0"),
    ({"$defs": {"a/b": {"not": {}}}}, "'not' at /$defs/a~1b/not"),
    ({"type": "array", "contains": {"type": "integer"}}, "'contains' at /contains"),
    ({"if": {}, "then": {}}, "'if' at /if"),
    ({"type": "string", "format": "uri"}, "format 'uri' at /format"),
    ({"$ref": "https://example.com/schema.json"}, "only references inside the schema"),
    ({"items": [{"type": "integer"}]}, "at /items must be an object or a boolean"),
])
def test_a_schema_keyword_not_enforced_is_refused_by_name_and_path(schema, said):
    with pytest.raises(ConstraintError, match=re.escape(said)):
        Constraint.json(schema)


def test_deeply_nested_schemas_are_refused_not_a_traceback():
    with pytest.raises(ConstraintError, match="nested too deeply"):
        Constraint.json("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConstraintError, match="nested more than 256 levels"):
        Constraint.json('{"items":' * 300 + "{}" + "}" * 300)
    deep = {}
    for _ in range(5000):
        deep = {"items": deep}
    with pytest.raises(ConstraintError, match="nested"):
        Constraint.json(deep)


def test_what_llguidance_itself_refuses_is_a_constraint_error():
    with pytest.raises(ConstraintError, match="oneOf"):  # overlapping alternatives: oneOf is not anyOf there
        Constraint.json({"oneOf": [{"type": "integer"}, {"type": "number"}]})
    with pytest.raises(ConstraintError, match="regex"):
        Constraint.regex("(unclosed")
    with pytest.raises(ConstraintError, match="not valid JSON"):
        Constraint.json("{not json")


def test_annotations_and_enforced_keywords_pass():
    check_schema({"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "t", "description": "d",
                  "type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5, "default": 1}},
                  "patternProperties": {"^y": {"type": "string", "format": "date"}}, "minProperties": 1})


def test_gbnf_and_lark_grammars_are_both_read():
    gbnf = Constraint.grammar('root ::= "yes" | "no"')
    lark = Constraint.grammar('start: "yes" | "no"')
    tok = load_tokenizer(DATA / "tok512.bin")
    for constraint in (gbnf, lark):
        _, texts = _walks(constraint.bind(tok), tok, 20)
        assert set(texts) <= {"yes", "no"} and texts


# ----------------------------------------------------------------------------------------------------------------
# The laws of the sampling stage: constrain() then the unconstrained pipeline


def _cases():
    @st.composite
    def case(draw):
        V = draw(st.integers(2, 24))
        x = np.array(draw(st.lists(st.floats(-8, 8, allow_nan=False), min_size=V, max_size=V)))
        allowed = np.array(draw(st.lists(st.booleans(), min_size=V, max_size=V)))
        allowed[draw(st.integers(0, V - 1))] = True
        params = SamplingParams(temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 1.7])),
                                top_k=draw(st.integers(0, V)), top_p=draw(st.sampled_from([1.0, 0.9, 0.5])),
                                min_p=draw(st.sampled_from([0.0, 0.05, 0.3])))
        return x, allowed, params, draw(st.integers(0, 2**32 - 1))

    return case()


@settings(max_examples=200, deadline=None)
@given(_cases())
def test_a_masked_token_is_never_drawn(case):
    x, allowed, params, seed = case
    drawn = sample_step(params, constrain(x, allowed), np.random.default_rng(seed))
    assert allowed[drawn.token_ids]


@settings(max_examples=200, deadline=None)
@given(_cases())
def test_greedy_is_the_argmax_over_the_allowed_set(case):
    x, allowed, _, _ = case
    ids = np.flatnonzero(allowed)
    expected = ids[np.argmax(x[ids])]  # the first maximum: the lowest id among ties
    assert sample_step(SamplingParams(temperature=0), constrain(x, allowed), None).token_ids == expected


@settings(max_examples=200, deadline=None)
@given(_cases())
def test_the_draw_is_the_unconstrained_pipeline_on_the_allowed_sub_vocabulary(case):
    """Every stage after the mask sees the allowed tokens only: the final distribution equals the pipeline run on
    the vocabulary of allowed tokens alone (so, without filters, softmax renormalised over the allowed set)."""
    x, allowed, params, _ = case
    if params.is_greedy:
        params = SamplingParams(temperature=1.0, top_p=params.top_p, min_p=params.min_p)
    ids = np.flatnonzero(allowed)
    params = SamplingParams(temperature=params.temperature, top_k=min(params.top_k, len(ids)), top_p=params.top_p,
                            min_p=params.min_p)
    full = explain_steps(constrain(x, allowed), params)[-1][1]
    sub = explain_steps(x[ids], params)[-1][1]
    np.testing.assert_allclose(full[ids], sub, rtol=1e-9, atol=1e-12)
    assert (full[~allowed] == 0).all()


def test_renormalised_without_filters():
    x = np.log(np.array([0.1, 0.2, 0.3, 0.4]))
    allowed = np.array([True, False, True, False])
    p = explain_steps(constrain(x, allowed), SamplingParams())[-1][1]
    np.testing.assert_allclose(p, [0.25, 0, 0.75, 0])


def test_constrain_refuses_a_mask_of_the_wrong_shape_or_an_empty_row():
    with pytest.raises(GenerationError, match="shape"):
        constrain(np.zeros(4), np.ones(3, bool))
    with pytest.raises(GenerationError, match="allows no token"):
        constrain(np.zeros((2, 3)), np.array([[True, False, False], [False, False, False]]))


# ----------------------------------------------------------------------------------------------------------------
# The laws of the constraint state: random walks over the allowed tokens


def _walks(bound, tok, n, seed=0, most=60):
    """n walks drawing uniformly among the allowed tokens: (texts of every walk, texts of the finished ones)."""
    rng = np.random.default_rng(seed)
    every, finished = [], []
    for _ in range(n):
        state, data = bound.start(), b""
        for _ in range(most):
            allowed = state.allowed([end(tok)])
            token = int(rng.choice(np.flatnonzero(allowed)))
            if token == end(tok):
                finished.append(data.decode("utf-8"))
                break
            state.advance(token)
            data += tok.token_bytes(token)
            if state.finished:
                finished.append(data.decode("utf-8"))
                break
        every.append(data)
    return every, finished


def _in_schema(schema):
    def member(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return member


LANGUAGES = [
    (Constraint.json(PERSON), _in_schema(PERSON)),
    (Constraint.json({"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 3}),
     _in_schema({"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 3})),
    (Constraint.regex("(ab)+c?"), lambda t: re.fullmatch("(ab)+c?", t) is not None),
    (Constraint.regex("[0-9]{2,4}"), lambda t: re.fullmatch("[0-9]{2,4}", t) is not None),
    (Constraint.grammar('start: "(" start ")" | "x"'), lambda t: re.fullmatch(r"(\(*)x(\)*)", t) is not None
     and t.count("(") == t.count(")")),
]


@pytest.mark.parametrize("name", ["bpe", "sentencepiece", "bytelevel"])
@pytest.mark.parametrize("language", range(len(LANGUAGES)))
def test_the_constraint_laws_hold_on_every_tokenizer(tokenizers, name, language):
    constraint, member = LANGUAGES[language]
    tok = tokenizers[name]
    check_constraint(constraint.bind(tok, tok.vocab_size + 3), tok.token_bytes, member, stops=[end(tok)],
                     max_examples=25)


def test_the_checker_catches_a_constraint_that_lets_the_end_come_early(tokenizers):
    tok = tokenizers["bpe"]
    bound = Constraint.regex("(ab)+").bind(tok)

    class Early:  # a broken state: the end is always allowed
        def __init__(self):
            self.inner = bound.start()
            self.finished = False

        def allowed(self, stops):
            mask = self.inner.allowed(stops)
            mask[list(stops)] = True
            return mask

        def advance(self, token):
            self.inner.advance(token)

    class Broken:
        def start(self):
            return Early()

    with pytest.raises(AssertionError, match="may end"):
        check_constraint(Broken(), tok.token_bytes, lambda t: re.fullmatch("(ab)+", t) is not None,
                         stops=[tok.eos_id], max_examples=25)


# ----------------------------------------------------------------------------------------------------------------
# Through LLM: outputs in the language, the end without another forward


@pytest.fixture(scope="module")
def llm():
    return npllm.load("stories260K", backend="numpy")


def test_generate_outputs_are_in_the_language(llm):
    member = _in_schema(PERSON)
    constraint = Constraint.json(PERSON)
    stopped = 0
    for seed in range(6):
        steps = []
        text = llm.generate("Once upon a time", 60, constraint=constraint, seed=seed, on_step=steps.append)
        if len(steps) < 60:
            stopped += 1
            assert member(text), text
    assert stopped >= 3
    assert llm.generate(["Once", "The dog"], 60, constraint=constraint, seed=3) == [
        llm.generate(p, 60, constraint=constraint, seed=3) for p in ["Once", "The dog"]]


def test_a_language_that_can_only_end_finishes_without_another_forward(llm, monkeypatch):
    calls = []
    forward = llm.model.forward
    monkeypatch.setattr(llm.model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    steps = []
    text = llm.generate("Once upon a time", 50, constraint=Constraint.regex("one two"), temperature=0,
                        on_step=steps.append)
    assert text == "one two"
    assert len(calls) == len(steps)  # the prefill draws the first token; each later token one feed; no more


def test_a_cut_output_ends_by_length_and_logprobs_report_the_constrained_distribution(llm):
    steps = []
    llm.generate("Once", 3, constraint=Constraint.regex("[a-z]{10}"), seed=1, logprobs=5, on_step=steps.append)
    assert len(steps) == 3
    for step in steps:
        alternatives = step.top_ids[step.top_ids >= 0]
        texts = [llm.tokenizer.token_bytes(int(i)) for i in alternatives]
        assert all(re.fullmatch(rb"[a-z]+", t) for t in texts), texts  # only allowed tokens have mass
        assert np.isclose(np.exp(step.top_logprobs).sum(), 1.0) or len(alternatives) == 5


def test_a_constraint_must_be_a_constraint(llm):
    with pytest.raises(GenerationError, match="npllm.Constraint"):
        llm.generate("x", 3, constraint={"type": "object"})


def test_speculative_greedy_is_identical_with_the_draft_on_and_off(llm):
    """The draft's proposals are drawn and checked on the constraint's masks: greedy output is the same tokens."""
    member = _in_schema(PERSON)
    constraint = Constraint.json(PERSON)
    for prompt in ["Once upon a time", "The cat", "Lily and Ben"]:
        plain, drafted = [], []
        text = llm.generate(prompt, 60, constraint=constraint, temperature=0, on_step=plain.append)
        for num_draft in (1, 3, 6):
            drafted.clear()
            assert llm.generate(prompt, 60, constraint=constraint, temperature=0, draft_layers=2,
                                num_draft=num_draft, on_step=drafted.append) == text
            assert [s.token_ids for s in drafted] == [s.token_ids for s in plain]
        assert len(plain) == 60 or member(text)
    for seed in range(4):  # sampled: the accepted-or-resampled tokens stay in the language
        steps = []
        text = llm.generate("Once", 60, constraint=constraint, seed=seed, draft_layers=1, on_step=steps.append)
        assert len(steps) == 60 or member(text), text


# ----------------------------------------------------------------------------------------------------------------
# The command line: --json-schema FILE, --json-object, --regex RE, --grammar FILE


def test_cli_generate_and_chat_follow_the_constraint(tmp_path, capsys, monkeypatch):
    from npllm.cli import main

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                                         "maximum": 9}},
                                  "required": ["n"], "additionalProperties": False}))
    assert main(["generate", "Once", "--backend", "numpy", "--max-new-tokens", "30", "--seed", "1",
                 "--json-schema", str(schema)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Once") and re.fullmatch(r'\{"n":[1-9]\}', out[len("Once"):].strip())
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    assert main(["generate", "Q", "--backend", "numpy", "--grammar", str(grammar)]) == 0
    assert capsys.readouterr().out.strip() in ("Qyes", "Qno")
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hi\n"))
    assert main(["chat", "--backend", "numpy", "--chat-template", "llama2", "--regex", "(ab|cd){2}"]) == 0
    assert re.fullmatch("(ab|cd){2}", capsys.readouterr().out.strip())


@pytest.mark.parametrize("flags, said", [
    (["--json-schema", "{missing}"], "--json-schema {missing}: cannot read it"),
    (["--regex", "a", "--json-object"], "--json-object and --regex each constrain the output"),
    (["--regex", "(a"], "regex"),
])
def test_cli_refuses_bad_constraints_in_one_line(tmp_path, capsys, flags, said):
    from npllm.cli import main

    flags = [f.replace("{missing}", str(tmp_path / "none.json")) for f in flags]
    said = said.replace("{missing}", str(tmp_path / "none.json"))
    assert main(["generate", "x", "--backend", "numpy", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("npllm: error: ") and said in err and err.count("\n") == 1, err


def test_cli_refuses_a_schema_keyword_by_name_and_path(tmp_path, capsys):
    from npllm.cli import main

    schema = tmp_path / "bad.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}))
    assert main(["generate", "x", "--backend", "numpy", "--json-schema", str(schema)]) == 2
    err = capsys.readouterr().err
    assert f"--json-schema {schema}: JSON schema keyword 'uniqueItems' at /properties/t/uniqueItems" in err


# ----------------------------------------------------------------------------------------------------------------
# Batches: each row its own state, each row what it would be alone


def test_continuously_batched_rows_each_equal_their_solo_run(llm):
    from npllm.batching import continuous_generate, ragged_generate
    from npllm.generate import Request, decode

    bound = llm.bind_constraint(Constraint.json(PERSON))
    prompts = ["Once upon a time", "The cat", "Lily", "One day, a little bird", "Tom had"]
    requests = [Request(llm.tokenizer.encode(p), 50, SamplingParams(temperature=0.9, seed=i), constraint=bound)
                for i, p in enumerate(prompts)]
    requests.append(Request(llm.tokenizer.encode("Sam"), 50, SamplingParams(seed=9)))  # an unconstrained row beside
    solo = [[d.token_ids for d in decode(llm.model, r)] for r in requests]
    assert any(len(s) < 50 for s in solo[:-1])  # some rows finish their JSON before the limit
    for run in (continuous_generate(llm.model, requests, slots=2), ragged_generate(llm.model, requests)):
        assert [c.tokens for c in run] == solo


def test_beam_search_keeps_each_beam_in_the_language(llm):
    """Each beam its own state: every hypothesis that ends before the limit is in the language, the scores are the
    constrained distribution's, and one beam is greedy decoding under the constraint."""
    member = _in_schema(PERSON)
    prompt = llm.tokenizer.encode("Once upon a time")
    eos = sorted(npllm.generate.stop_ids(llm.config))
    found = llm.beam_search(prompt, 3, 60, constraint=Constraint.json(PERSON))
    assert found
    for h in found:
        tokens = [t for t in h.tokens if t not in eos]
        if len(h.tokens) < 60 or tokens != list(h.tokens):
            assert member(llm.completion_text(prompt, tokens)), h
    greedy = llm.generate("Once upon a time", 60, constraint=Constraint.json(PERSON), temperature=0)
    one = llm.beam_search(prompt, 1, 60, constraint=Constraint.json(PERSON))[0]
    assert llm.completion_text(prompt, [t for t in one.tokens if t not in eos]) == greedy
    regex = llm.beam_search(prompt, 4, 12, constraint=Constraint.regex("(cat|dog|bird)s?"))
    assert regex and all(re.fullmatch("(cat|dog|bird)s?", llm.completion_text(prompt, [t for t in h.tokens
                                                                                          if t not in eos]))
                         for h in regex)


# ----------------------------------------------------------------------------------------------------------------
# --explain: the mask as a stage, the tokens it removed


def test_explain_shows_the_mask_and_explains_the_same_tokens(llm):
    from npllm.explain import explain_ids, format_step, print_explained

    constraint = Constraint.regex("(cat|dog)s? ran")
    params = SamplingParams(seed=2)
    prompt = llm.tokenizer.encode("Once")
    steps = list(explain_ids(llm.model, llm.tokenizer, prompt, 10, params, constraint=llm.bind_constraint(constraint)))
    tokens = [s.token_id for s in steps if not s.stop]
    assert llm.tokenizer.decode(tokens) == llm.generate("Once", 10, params, constraint=constraint)
    first = steps[0]
    assert first.stages[:2] == ("logits", "constraint") and first.allowed >= 1
    assert any(first.fate(c) == "cut by constraint" for c in first.candidates)  # the top raw candidates were removed
    assert "the constraint allowed" in format_step(first)
    out = io.StringIO()
    print_explained(llm, prompt, 10, params, as_json=True, out=out, constraint=constraint)
    record = json.loads(out.getvalue().splitlines()[0])
    assert record["allowed"] == first.allowed and record["stages"][1] == "constraint"


def test_npllms_constraint_stage_passes_the_masked_sampler_laws_and_broken_ones_fail():
    from npllm.testing import check_masked_sampler

    params = SamplingParams()
    check_masked_sampler(lambda x, allowed, rng: sample_step(params, constrain(x, allowed), rng).token_ids)
    with pytest.raises(AssertionError, match="never_masked"):  # a sampler that forgets the mask
        check_masked_sampler(lambda x, allowed, rng: sample_step(params, x, rng).token_ids)

    def resamples(x, allowed, rng):  # redraws until allowed: the masked mass goes to the argmax's neighbours
        x = np.asarray(x, np.float64)
        token = int(np.argmax(np.where(allowed, x, -np.inf)))
        first = sample_step(params, x, rng).token_ids
        return first if allowed[first] else token

    with pytest.raises(AssertionError, match="renormalised"):
        check_masked_sampler(resamples)
