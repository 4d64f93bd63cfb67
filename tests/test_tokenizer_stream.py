"""StreamDecoder: text printed token by token is exactly the decoded text, printed as early as possible, and never
shows a broken character while a multi-byte character arrives over several byte pieces."""

import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npllm.errors import TokenizerError
from tests_support import require
from npllm.tokenizer import BPETokenizer, SentencePieceTokenizer

PAIRS = {
    "tok512": ("stories260K/tok512.model", "stories260K/tok512.bin"),
    "llama2": ("llama2-tokenizer/tokenizer.model", "llama2-tokenizer/tokenizer.bin"),
}
# Text rich in what byte fallback spells over several pieces (CJK, emoji, combining marks), plus any Unicode.
MULTIBYTE = list("ab .,\n\t") + list("日本語テキスト한국어é") + ["🙂", "👍🏽", "\u0301", "\u200d", "\u3000", "\u2581", "  "]
texts = st.one_of(
    st.text(max_size=60),
    st.lists(st.sampled_from(MULTIBYTE), max_size=40).map("".join),
    st.sampled_from(["Lily and Ben", "  leading", "a\tb\n\nc", "日本語テキスト 🙂", "", " "]),
)


def need(weights_dir, relative):
    """Path of a reference file, or skip the test when it is not there (fail under CI: tests_support.require)."""
    return require(relative)


def id_sequences(vocab_size):
    """Arbitrary ids, weighted towards the interesting ones: control pieces (0..2) and byte pieces (3..258),
    especially bytes at the edges of UTF-8's well-formed ranges (leads C2 E0 ED F0 F4, continuations 80 8F 90 9F
    A0 BF, never-valid C0 F5 FF)."""
    edge_bytes = [0x41, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE1, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF]
    one = st.one_of(
        st.integers(0, 2),
        st.integers(3, 258),
        st.sampled_from(edge_bytes).map(lambda b: 3 + b),
        st.integers(0, vocab_size - 1),
    )
    return st.lists(one, max_size=24)


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request, weights_dir):
    model, binary = PAIRS[request.param]
    model_path = need(weights_dir, model)
    # (SentencePieceTokenizer over the .model, BPETokenizer over the .bin, the raw sentencepiece processor)
    return (
        SentencePieceTokenizer(model_path),
        BPETokenizer.from_llama2c(need(weights_dir, binary)),
        spm.SentencePieceProcessor(model_file=str(model_path)),
    )


def stream(tok, ids, continuation=False):
    """The chunks a StreamDecoder returns for `ids`, the flush last."""
    decoder = tok.stream_decoder(continuation)
    return [decoder.feed(i) for i in ids] + [decoder.flush()]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_streamed_text_is_the_text_and_never_broken(pair, text):
    """Valid text, encoded (with BOS) and streamed: the chunks join to the text and none holds U+FFFD, although
    CJK and emoji arrive as 2-4 separate byte pieces (tok512 has almost no non-ASCII pieces)."""
    _, bpe, sp = pair
    ids = bpe.encode(text)
    chunks = stream(bpe, ids)
    assert "".join(chunks) == sp.decode(ids) == text.replace("\u2581", " ")
    assert not any("\ufffd" in chunk for chunk in chunks)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_prints_all_that_is_settled(pair, data):
    """For any ids, after k feeds the text printed so far is sentencepiece's decode of the first k ids, less only
    the U+FFFD it gives for the (at most 3) bytes of a character that may still be completed; and all the chunks
    plus the flush are sentencepiece's decode of all the ids."""
    sp_tok, bpe, sp = pair
    ids = data.draw(id_sequences(bpe.vocab_size))
    for tok in (sp_tok, bpe):
        decoder = tok.stream_decoder()
        printed = ""
        for k, token_id in enumerate(ids, start=1):
            printed += decoder.feed(token_id)
            reference = sp.decode(ids[:k])
            assert reference.startswith(printed)
            held_back = reference[len(printed) :]
            assert set(held_back) <= {"\ufffd"} and len(held_back) <= 3
        printed += decoder.flush()
        assert printed == sp.decode(ids) == tok.decode(ids)


def test_multibyte_character_waits_for_its_last_byte(weights_dir):
    """🙂 is F0 9F 99 82: four byte pieces in tok512. Nothing prints until the fourth arrives."""
    tok = BPETokenizer.from_llama2c(need(weights_dir, PAIRS["tok512"][1]))
    ids = tok.encode("🙂", bos=False)
    assert [tok.id_to_piece(i) for i in ids] == ["▁", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert stream(tok, ids) == ["", "", "", "", "🙂", ""]


def test_space_after_bos_is_dropped_once(weights_dir):
    """BOS, then "▁Lily", "▁and": the dummy-prefix space goes, the next space stays (SentencePiece, run.c)."""
    tok = BPETokenizer.from_llama2c(need(weights_dir, PAIRS["llama2"][1]))
    ids = tok.encode("Lily and")
    assert tok.id_to_piece(ids[1]).startswith("▁")
    chunks = stream(tok, ids)
    assert chunks[0] == "" and chunks[1] == "L" and "".join(chunks) == "Lily and"
    assert "".join(stream(tok, ids[1:], continuation=True)) == " Lily and"


def test_flush_settles_an_unfinished_character(weights_dir):
    tok = BPETokenizer.from_llama2c(need(weights_dir, PAIRS["tok512"][1]))
    decoder = tok.stream_decoder()
    e5, x97 = 3 + 0xE5, 3 + 0x97
    assert decoder.feed(e5) == "" and decoder.feed(x97) == ""
    assert decoder.flush() == "\ufffd\ufffd"
    assert decoder.feed(tok.encode("a", bos=False)[0]) == " a"  # the stream goes on after a flush
    assert decoder.feed(3 + 0xFF) == "\ufffd"  # FF never starts a character: printed at once


def test_stream_refuses_foreign_ids(pair):
    decoder = pair[1].stream_decoder()
    with pytest.raises(TokenizerError, match="outside"):
        decoder.feed(pair[1].vocab_size)
