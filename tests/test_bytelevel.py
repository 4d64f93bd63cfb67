"""Byte-level BPE (tokenizer.json) against the `tokenizers` library, id for id: the committed fixture's stored
encodings, then tokenizers trained here with the pre-tokenizers of Llama 3, Qwen2 (NFC) and GPT-2/SmolLM on random
and real-looking text, chat special tokens included; decoding (whole and streamed) as well."""

import inspect
import json
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npllm.errors import TokenizerError
from npllm.tokenizer import load_tokenizer
from npllm.tokenizer.bytelevel import (GPT2_SPLIT, LLAMA3_SPLIT, QWEN2_SPLIT, ByteLevelBPE, bytes_to_unicode,
                                       unicode_to_bytes)

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def test_byte_table_is_a_bijection_onto_printable_characters():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in table.values())
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120" and table[ord("\n")] == "\u010a"
    assert unicode_to_bytes() == {c: b for b, c in table.items()}


def test_fixture_tokenizer_matches_stored_encodings():
    """Ids the tokenizers library produced when the fixture was made (no library needed here)."""
    tok = load_tokenizer(FIXTURES / "llama_gqa" / "tokenizer.json", vocab_size=320)
    cases = json.loads((FIXTURES / "tokenizer_cases.json").read_text())
    assert len(cases) > 5
    for case in cases:
        assert tok.encode(case["text"], bos=False) == case["ids"], case["text"]
        assert tok.encode(case["text"]) == case["ids_with_bos"], case["text"]
        assert tok.decode(case["ids"]) == "".join(
            part for part in _split_specials(case["text"]))  # specials vanish from decoded text


def _split_specials(text):
    import re

    return re.split(r"<\|(?:begin_of_text|end_of_text|start_header_id|end_header_id|eot_id)\|>", text)


def test_vocab_size_mismatch_is_refused():
    with pytest.raises(TokenizerError, match="320"):
        load_tokenizer(FIXTURES / "llama_gqa" / "tokenizer.json", vocab_size=512)


# --------------------------------------------------------------------------------------------------------------
# Against the tokenizers library

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,  # noqa: E402
                        pre_tokenizers, processors, trainers)


def corpus() -> list[str]:
    texts = []
    for module in (json, inspect, string, pytest):
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc:
                texts.append(doc)
    texts += ["Ünïcödé naïve café — “quotes” … 東京は日本の首都です。 😀👍 Привет, мир! 123456789 3.14159",
              "e\u0301 vs \u00e9, \uac00\ub098\ub2e4 \u0627\u0644\u0639\u0631\u0628\u064a\u0629\n\t  x = [1, 2, 3]"] * 20
    return texts


def train(pre, normalizer=None, specials=(), template=None, vocab_size=1200):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    if template:
        tok.post_processor = processors.TemplateProcessing(single=f"{template} $A", pair=f"{template} $A $B",
                                                           special_tokens=[(template, tok.token_to_id(template))])
    return tok


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def llama3_style():
    return train(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
                 specials=LLAMA3_SPECIALS, template="<|begin_of_text|>")


def qwen2_style():
    return train(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
                 normalizer=normalizers.NFC(), specials=QWEN2_SPECIALS)


def smollm_style():
    return train(pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
                 specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])


def gpt2_prefix_space():
    return train(pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True), specials=["<|endoftext|>"])


def llama3_ignore_merges():
    spec = json.loads(llama3_style().to_str())
    spec["model"]["ignore_merges"] = True
    return Tokenizer.from_str(json.dumps(spec))


def with_stripping_added_tokens():
    tok = llama3_style()
    tok.add_tokens([AddedToken("<mask>", lstrip=True, rstrip=True), AddedToken("[[tool]]", special=False),
                    AddedToken("cat", single_word=True)])
    tok.add_special_tokens([AddedToken("<|python_tag|>", rstrip=True)])
    return tok


STYLES = {"llama3": llama3_style, "qwen2": qwen2_style, "smollm": smollm_style, "gpt2_prefix": gpt2_prefix_space,
          "llama3_ignore_merges": llama3_ignore_merges, "added_tokens": with_stripping_added_tokens}


@pytest.fixture(scope="module", params=list(STYLES))
def pair(request, tmp_path_factory):
    reference = STYLES[request.param]()
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
    reference.save(str(path))
    return reference, ByteLevelBPE.from_file(path), request.param


REAL_LOOKING = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
    "  Leading spaces,\ttabs,\n\nblank lines\r\nand trailing   ",
    "I'M SURE you'll see they've said it's 'quoted' and DON'T\u2019T shout",
    "Numbers 1234567 and 3.14159, dates 2024-06-01, hex 0xDEADBEEF, 1,000,000.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # naïve\n",
    "東京は日本の首都です。 한국어 텍스트. Русский текст. العربية. हिन्दी",
    "Emoji 😀👍🏽 👨\u200d👩\u200d👧 flags 🇫🇷 and e\u0301 vs \u00e9 (NFC folds them)",
    "<|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|><|start_header_id|>user<|end_header_id|>"
    "\n\nHi!<|eot_id|>",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
    "masked <mask> word and  <mask>  again, [[tool]]call <|python_tag|>  code",
    "a cat, concatenate, cats, cat_1, écat and cat!",
    "", " ", "\n", "a", "'s", "   \n\n   ",
]


@pytest.mark.parametrize("text", REAL_LOOKING)
def test_real_looking_text_id_for_id(pair, text):
    reference, ours, _ = pair
    assert ours.encode(text, bos=False) == reference.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, bos=True) == reference.encode(text, add_special_tokens=True).ids


pieces = st.sampled_from(["<|eot_id|>", "<|im_start|>", "<|im_end|>", "<mask>", " <mask> ", "'s", "'LL", " ",
                          "  ", "\n", "\r\n", "\t", "123", "4567", "3.14", "東京", "😀", "\u0301", "e\u0301", "Ġ",
                          "hello", " world", "Hello", "cat", " cat ", "--", "...", "\u200b", "\u00a0"])
texts = st.one_of(
    st.text(max_size=60),
    st.lists(st.one_of(pieces, st.text(alphabet=string.printable, max_size=8), st.text(max_size=4)),
             max_size=15).map("".join),
)


@settings(max_examples=150)
@given(text=texts)
def test_random_text_id_for_id(pair, text):
    reference, ours, _ = pair
    expected = reference.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, bos=False) == expected
    assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=True)


@settings(max_examples=150)
@given(data=st.data())
def test_decoding_arbitrary_ids_whole_and_streamed(pair, data):
    """Any id sequence, including ones that split characters: U+FFFD exactly where the library puts it, and the
    streamed text equals the whole."""
    reference, ours, _ = pair
    ids = data.draw(st.lists(st.integers(0, ours.vocab_size - 1), max_size=20))
    text = ours.decode(ids)
    assert text == reference.decode(ids, skip_special_tokens=True)
    stream = ours.stream_decoder()
    assert "".join(stream.feed(i) for i in ids) + stream.flush() == text


def test_round_trip_without_normalizer(pair):
    reference, ours, style = pair
    if style in ("qwen2", "gpt2_prefix"):
        pytest.skip("NFC normalizing and prefix-space tokenizers do not round-trip exactly, by design")
    for text in REAL_LOOKING:
        if "<" not in text:
            assert ours.decode(ours.encode(text, bos=False)) == text


# --------------------------------------------------------------------------------------------------------------
# Files npllm cannot read are refused, not half-read


def fixture_spec():
    return json.loads((FIXTURES / "llama_gqa" / "tokenizer.json").read_text())


@pytest.mark.parametrize("edit, fragment", [
    (lambda s: s["model"].update(type="Unigram"), "not BPE"),
    (lambda s: s["model"].update(byte_fallback=True), "byte_fallback"),
    (lambda s: s["model"].update(continuing_subword_prefix="##"), "continuing_subword_prefix"),
    (lambda s: s.update(normalizer={"type": "Lowercase"}), "normalizer 'Lowercase'"),
    (lambda s: s.update(pre_tokenizer={"type": "Metaspace"}), "pre-tokenizer 'Metaspace'"),
    (lambda s: s.update(decoder={"type": "WordPiece"}), "decoder 'WordPiece'"),
    (lambda s: s.update(post_processor={"type": "BertProcessing"}), "post-processor"),
    (lambda s: s["model"]["merges"].append(["x", "zz"]), "missing from the vocab"),
    (lambda s: s["model"]["vocab"].pop("Ġ"), "byte characters"),
    (lambda s: s["pre_tokenizer"]["pretokenizers"][0].update(pattern={"Regex": "(unclosed"}), "does not compile"),
    (lambda s: s["pre_tokenizer"]["pretokenizers"][0].update(behavior="Sideways"), "behavior"),
    (lambda s: s.pop("model"), "no 'model'"),
])
def test_unsupported_or_broken_tokenizer_json(tmp_path, edit, fragment):
    spec = fixture_spec()
    edit(spec)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match=fragment):
        ByteLevelBPE.from_file(path)


def test_unreadable_files(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        ByteLevelBPE.from_file(tmp_path / "missing.json")
    (tmp_path / "t.json").write_text("{")
    with pytest.raises(TokenizerError, match="cannot read as JSON"):
        ByteLevelBPE.from_file(tmp_path / "t.json")


def test_split_patterns_are_the_published_ones():
    """The constants used for GGUF vocabularies are exactly the fixture's tokenizer.json pattern (Llama 3)."""
    spec = fixture_spec()
    assert spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == LLAMA3_SPLIT
    assert QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|", 1) == LLAMA3_SPLIT
    assert GPT2_SPLIT.startswith("'s|'t|'re")


@pytest.mark.parametrize("ignore_merges", [False, True])
def test_ignore_merges_takes_whole_words_from_the_vocab(ignore_merges):
    """'abc' is in the vocabulary but the merges alone make 'ab' + 'c': ignore_merges decides (Llama 3 sets it)."""
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    vocab |= {"ab": 256, "bc": 257, "abc": 258}
    spec = {
        "version": "1.0", "added_tokens": [], "normalizer": None, "post_processor": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": [["a", "b"], ["b", "c"]]},
    }
    reference = Tokenizer.from_str(json.dumps(spec))
    ours = ByteLevelBPE.from_spec(spec)
    for text in ["abc", "abcabc abc", "xabc", "bc abc"]:
        assert ours.encode(text) == reference.encode(text).ids
    assert ours.encode("abc") == ([258] if ignore_merges else [256, vocab["c"]])
