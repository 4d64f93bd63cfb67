"""npllm's BPE encoder against SentencePiece, the reference, on both real vocabulary pairs; decoding against
sentencepiece's decode; loading errors.

The pairs (in $NPLLM_WEIGHTS): stories260K/tok512.{bin,model} and llama2-tokenizer/tokenizer.{bin,model}. The
.model is read by the sentencepiece package, the .bin by npllm's own BPE: they must give the same ids.
"""

import struct

import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from npllm.errors import TokenizerError
from tests_support import require
from npllm.tokenizer import (
    BPETokenizer,
    SentencePieceTokenizer,
    TokenType,
    check_vocab,
    load_tokenizer,
)

PAIRS = {
    "tok512": ("stories260K/tok512.model", "stories260K/tok512.bin"),
    "llama2": ("llama2-tokenizer/tokenizer.model", "llama2-tokenizer/tokenizer.bin"),
}

FIXED_TEXTS = [
    "The cat sat on the mat curiously.",
    "Lily and Ben",
    "  leading",
    "trailing   ",
    "a\tb\n\nc",
    "日本語テキスト 🙂",
    "",
    " ",
    "e\u0301 n\u0303 a\u0308\u0301",  # combining marks after their base letters
    "\u0301 starts with a combining mark",
    "👩‍👩‍👧 family, 🇫🇷 flag, 👍🏽 tone",
    "a\u2581b \u2581",  # U+2581 in the input reads as a space, as in SentencePiece
    "<s> </s> <unk> <0x41>",  # the spellings of control and byte pieces are plain text
    "\x00\x01\x7f\r\n\u3000\ufeff",
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine.",
]

# Arbitrary Unicode, plus text drawn from the characters where BPE tokenizers go wrong: CJK (mostly absent from the
# vocabularies, so byte fallback), emoji (4-byte UTF-8), combining marks, whitespace runs, and U+2581 itself.
TRICKY = (
    list("abcdefgh xyzTHE.,!?'\"0123456789")
    + list("日本語テキスト中文한국어")
    + ["🙂", "👍", "🏽", "\u200d", "\U0001f1eb", "\U0001f1f7"]
    + ["\u0301", "\u0303", "\u0308", "é", "ñ"]
    + [" ", "  ", "   ", "\t", "\n", "\r", "\u3000", "\u00a0", "\u2581"]
)
texts = st.one_of(
    st.text(max_size=60),
    st.lists(st.sampled_from(TRICKY), max_size=40).map("".join),
    st.lists(st.sampled_from(["the", " the", "and", " ", "  ", "ing", "Lily", "\n", "🙂", "é"]), max_size=20).map(
        "".join
    ),
)


def need(weights_dir, relative):
    """Path of a reference file, or skip the test when it is not there (fail under CI: tests_support.require)."""
    return require(relative)


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request, weights_dir):
    """(SentencePieceTokenizer over the .model, BPETokenizer over the .bin, the raw sentencepiece processor)."""
    model, binary = PAIRS[request.param]
    model_path, bin_path = need(weights_dir, model), need(weights_dir, binary)
    return (
        SentencePieceTokenizer(model_path),
        BPETokenizer.from_llama2c(bin_path),
        spm.SentencePieceProcessor(model_file=str(model_path)),
    )


# ---- encoding: npllm's BPE == SentencePiece -------------------------------------------------------------------------


@pytest.mark.parametrize("text", FIXED_TEXTS)
def test_bpe_matches_sentencepiece_on_fixed_texts(pair, text):
    sp_tok, bpe, sp = pair
    assert bpe.encode(text, bos=False) == sp.encode(text)
    assert sp_tok.encode(text, bos=False) == sp.encode(text)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_bpe_matches_sentencepiece_on_arbitrary_unicode(pair, text):
    sp_tok, bpe, sp = pair
    assert bpe.encode(text, bos=False) == sp.encode(text)


def test_bos_and_eos(pair):
    sp_tok, bpe, _ = pair
    for tok in (sp_tok, bpe):
        body = tok.encode("Lily and Ben", bos=False)
        assert tok.encode("Lily and Ben") == [tok.bos_id] + body
        assert tok.encode("Lily and Ben", bos=True, eos=True) == [tok.bos_id] + body + [tok.eos_id]
        assert tok.encode("", bos=False) == []
    assert (sp_tok.bos_id, sp_tok.eos_id) == (bpe.bos_id, bpe.eos_id) == (1, 2)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_text_never_becomes_control_or_unknown(pair, text):
    _, bpe, _ = pair
    for i in bpe.encode(text, bos=False):
        assert bpe.token_type(i) in (TokenType.NORMAL, TokenType.BYTE), (i, bpe.id_to_piece(i))


def test_same_vocabulary_as_sentencepiece(pair):
    """The .bin's pieces, converted to SentencePiece spelling, are the .model's, with the same types and scores
    (llama2.c writes BOS/EOS as "\\n<s>\\n" and "\\n</s>\\n": only their spelling differs)."""
    sp_tok, bpe, sp = pair
    assert bpe.vocab_size == sp_tok.vocab_size == sp.vocab_size()
    for i in range(bpe.vocab_size):
        assert bpe.token_type(i) == sp_tok.token_type(i), i
        assert bpe.score(i) == sp.get_score(i), i
        if i not in (bpe.bos_id, bpe.eos_id):
            assert bpe.id_to_piece(i) == sp_tok.id_to_piece(i), i


def test_encoding_a_long_text_stays_linear(pair):
    """A few KB in one go (merges across the whole text) still agree; the heap keeps this well under a second."""
    _, bpe, sp = pair
    text = " ".join(FIXED_TEXTS) * 30
    assert len(text) > 5000
    assert bpe.encode(text, bos=False) == sp.encode(text)


# ---- decoding -------------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
@example(text="日本語テキスト 🙂")
@example(text="  leading")
def test_round_trip(pair, text):
    sp_tok, bpe, sp = pair
    ids = sp.encode(text)
    # U+2581 in the input is read as a space, so such text comes back with spaces; everything else round trips.
    assert sp.decode(ids) == text.replace("\u2581", " ")
    assert sp_tok.decode(sp_tok.encode(text)) == sp.decode(ids)
    assert bpe.decode(bpe.encode(text)) == sp.decode(ids)


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


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_matches_sentencepiece_on_arbitrary_ids(pair, data):
    """Any id sequence, valid UTF-8 or not, decodes exactly as sentencepiece decodes it (stray bytes -> U+FFFD,
    <unk> -> ' \u2047 ', one leading space dropped)."""
    sp_tok, bpe, sp = pair
    ids = data.draw(id_sequences(bpe.vocab_size))
    assert bpe.decode(ids) == sp.decode(ids)
    assert sp_tok.decode(ids) == sp.decode(ids)


@pytest.mark.parametrize(
    "ids, text",
    [
        ([1, 365, 2354, 322, 4111], "Lily and Ben"),  # first piece "▁L" loses its dummy-prefix space
        ([365, 2354], "Lily"),  # ... with or without BOS, as SentencePiece does
        ([1, 1, 2, 365, 2354], "Lily"),  # control pieces before it do not count as text
        ([13, 263], "\n a"),  # only the very first piece loses a space
        ([232, 154, 168], "嗥"),  # bytes E5 97 A5 join into one character
        ([232, 154], "\ufffd\ufffd"),  # an unfinished character: one U+FFFD per byte
        ([232, 1, 154, 168], "\ufffd\ufffd\ufffd"),  # a control piece interrupts a character
        ([3 + 0xE0, 3 + 0x80, 3 + 0x80], "\ufffd" * 3),  # overlong encoding of U+0000
        ([3 + 0xE0, 3 + 0xA0, 3 + 0x80], "\u0800"),  # the smallest 3-byte character
        ([3 + 0xED, 3 + 0xA0, 3 + 0x80], "\ufffd" * 3),  # a UTF-16 surrogate
        ([3 + 0xF4, 3 + 0x90, 3 + 0x80, 3 + 0x80], "\ufffd" * 4),  # above U+10FFFF
        ([3 + 0xF0, 3 + 0x90, 3 + 0x80, 3 + 0x80], "\U00010000"),  # the smallest 4-byte character
    ],
)
def test_decode_examples_llama2(weights_dir, ids, text):
    sp_path = need(weights_dir, PAIRS["llama2"][0])
    bpe = BPETokenizer.from_llama2c(need(weights_dir, PAIRS["llama2"][1]))
    assert bpe.decode(ids) == text == spm.SentencePieceProcessor(model_file=str(sp_path)).decode(ids)


def test_decode_continuation_keeps_the_space(pair):
    """Decoding ids that continue a prompt keeps the first piece's space: "Lily and Ben" + " were"."""
    sp_tok, bpe, _ = pair
    for tok in (sp_tok, bpe):
        prompt = tok.encode("Lily and Ben")
        both = tok.encode("Lily and Ben were")
        rest = both[len(prompt) :]
        assert both[: len(prompt)] == prompt
        assert tok.decode(rest, continuation=True) == " were"
        assert tok.decode(rest) == "were"


def test_bad_ids_are_refused(pair):
    for tok in pair[:2]:
        with pytest.raises(TokenizerError, match="outside"):
            tok.decode([5, tok.vocab_size])
        with pytest.raises(TokenizerError, match="outside"):
            tok.id_to_piece(-1)


# ---- other spellings of the same vocabulary -------------------------------------------------------------------------


def read_bin(path):
    """(max_token_length, [(score, piece bytes)]) of a llama2.c tokenizer.bin: a second, independent reader."""
    data = path.read_bytes()
    (max_len,) = struct.unpack_from("<i", data)
    records, offset = [], 4
    while offset < len(data):
        score, n = struct.unpack_from("<fi", data, offset)
        records.append((score, data[offset + 8 : offset + 8 + n]))
        offset += 8 + n
    return max_len, records


def write_bin(path, max_len, records):
    with open(path, "wb") as f:
        f.write(struct.pack("<i", max_len))
        for score, piece in records:
            f.write(struct.pack("<fi", score, len(piece)) + piece)


@pytest.fixture(scope="module")
def raw_byte_bin(weights_dir, tmp_path_factory):
    """tok512.bin rewritten with its 256 byte pieces stored as raw single bytes instead of <0xXX> text."""
    max_len, records = read_bin(need(weights_dir, PAIRS["tok512"][1]))
    assert [p for _, p in records[3:259]] == [b"<0x%02X>" % b for b in range(256)]
    records[3:259] = [(score, bytes([b])) for b, (score, _) in enumerate(records[3:259])]
    path = tmp_path_factory.mktemp("rawbytes") / "tok512_raw.bin"
    write_bin(path, max_len, records)
    return path


@settings(max_examples=100, deadline=None)
@given(text=st.one_of(texts, st.sampled_from(FIXED_TEXTS)))
def test_raw_byte_pieces_encode_like_hex_pieces(weights_dir, raw_byte_bin, text):
    hex_bin = BPETokenizer.from_llama2c(weights_dir / PAIRS["tok512"][1])
    raw = BPETokenizer.from_llama2c(raw_byte_bin)
    assert raw.encode(text) == hex_bin.encode(text)
    assert raw.decode(raw.encode(text)) == hex_bin.decode(hex_bin.encode(text))


def test_raw_byte_pieces_read_as_byte_pieces(raw_byte_bin):
    raw = BPETokenizer.from_llama2c(raw_byte_bin)
    assert [raw.id_to_piece(3 + b) for b in (0x00, 0x41, 0xFF)] == ["<0x00>", "<0x41>", "<0xFF>"]
    assert all(raw.token_type(3 + b) == TokenType.BYTE for b in range(256))


def test_plain_lists_with_token_types_match_sentencepiece(pair):
    """The constructor the GGUF reader uses: pieces, scores and types as plain lists (GGUF's spelling)."""
    sp_tok, _, sp = pair
    n = sp.vocab_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    tok = BPETokenizer(
        pieces, [sp.get_score(i) for i in range(n)], [int(sp_tok.token_type(i)) for i in range(n)], name="lists"
    )
    for text in FIXED_TEXTS:
        assert tok.encode(text) == sp_tok.encode(text)
        assert tok.decode(tok.encode(text)) == sp_tok.decode(sp_tok.encode(text))


# ---- errors ---------------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    for name in ("absent.bin", "absent.model"):
        with pytest.raises(TokenizerError, match="absent"):
            load_tokenizer(tmp_path / name)


def test_unknown_suffix(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("hello")
    with pytest.raises(TokenizerError, match="vocab.txt"):
        load_tokenizer(path)


@pytest.mark.parametrize("keep", [0, 2, 4, 9, 100, 6000])
def test_truncated_bin(weights_dir, tmp_path, keep):
    """Cut anywhere inside a record (or the header), the file is refused, naming it."""
    data = need(weights_dir, PAIRS["tok512"][1]).read_bytes()
    path = tmp_path / "cut.bin"
    path.write_bytes(data[:keep])
    with pytest.raises(TokenizerError, match="cut.bin"):
        load_tokenizer(path)


def test_bin_cut_between_records_needs_the_vocab_size(weights_dir, tmp_path):
    """A cut at a record boundary leaves a shorter but well-formed file; the model's vocab size exposes it."""
    max_len, records = read_bin(need(weights_dir, PAIRS["tok512"][1]))
    path = tmp_path / "short.bin"
    write_bin(path, max_len, records[:300])
    assert load_tokenizer(path).vocab_size == 300
    with pytest.raises(TokenizerError, match="short.bin.*300 pieces.*512"):
        load_tokenizer(path, vocab_size=512)


def test_bin_longer_than_the_vocab(weights_dir, tmp_path):
    path = tmp_path / "long.bin"
    path.write_bytes(need(weights_dir, PAIRS["tok512"][1]).read_bytes())
    with pytest.raises(TokenizerError, match="long.bin.*after its 500 pieces"):
        load_tokenizer(path, vocab_size=500)


@pytest.mark.parametrize("suffix", [".bin", ".model"])
@pytest.mark.parametrize(
    "content",
    [b"", b"\x00" * 3, b"not a tokenizer at all, just some text\n" * 20, bytes(range(256)) * 8, b"\xff" * 64],
)
def test_garbage_file(tmp_path, suffix, content):
    path = tmp_path / f"garbage{suffix}"
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match="garbage"):
        load_tokenizer(path)


def test_truncated_model(weights_dir, tmp_path):
    data = need(weights_dir, PAIRS["tok512"][0]).read_bytes()
    path = tmp_path / "cut.model"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TokenizerError, match="cut.model"):
        load_tokenizer(path)


@pytest.mark.parametrize("name", ["dir.bin", "dir.model"])
def test_directory_is_not_a_tokenizer(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    with pytest.raises(TokenizerError, match=name):
        load_tokenizer(folder)


def test_check_vocab(pair, weights_dir):
    sp_tok, bpe, _ = pair
    for tok in (sp_tok, bpe):
        check_vocab(tok, tok.vocab_size, "t")
        with pytest.raises(TokenizerError, match=rf"tokenizer t has {tok.vocab_size} pieces but the model's vocabulary is 7"):
            check_vocab(tok, 7, "t")
    model_path = weights_dir / PAIRS["tok512"][0]
    with pytest.raises(TokenizerError, match="512 pieces but the model's vocabulary is 32000"):
        load_tokenizer(model_path, vocab_size=32000)


@pytest.mark.parametrize(
    "pieces, scores, types, message",
    [
        (["<unk>", "<s>", "</s>", "a"], [0.0, 0.0], None, "4 pieces, 2 scores"),
        (["<unk>", "<s>", "</s>", "a", "a"], [0.0] * 5, None, "'a' appears twice"),
        (["<unk>", "<s>", "</s>", "<0x00>", "a"], [0.0] * 5, None, "1 of the 256 byte pieces"),
        (["<unk>", "<s>", "</s>", "a"], [0.0] * 4, [2, 3, 3, 9], "token types"),
        (["<unk>", "<s>"], [0.0] * 2, None, "eos_id 2 is outside"),
    ],
)
def test_inconsistent_vocabulary(pieces, scores, types, message):
    with pytest.raises(TokenizerError, match=message):
        BPETokenizer(pieces, scores, types, name="vocab")


# ---- synthetic vocabularies: ties, user-defined, unused and unknown pieces, with and without byte fallback ----------


def _varint(n):
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number, value):
    """One protobuf field: ints and bools as varints, floats as fixed32, str/bytes length-delimited."""
    if isinstance(value, (bool, int)):
        return _varint(number << 3) + _varint(int(value))
    if isinstance(value, float):
        return _varint(number << 3 | 5) + struct.pack("<f", value)
    value = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def sentencepiece_bpe_proto(pieces, scores, types, byte_fallback):
    """A serialized SentencePiece ModelProto (field numbers of sentencepiece_model.proto): the pieces, a BPE
    trainer spec, and the identity normaliser with a dummy prefix, like the Llama tokenizers."""
    proto = b"".join(
        _field(1, _field(1, p) + _field(2, float(s)) + _field(3, int(t))) for p, s, t in zip(pieces, scores, types)
    )
    proto += _field(2, _field(3, 2) + _field(4, len(pieces)) + _field(35, byte_fallback))  # model_type 2 = BPE
    proto += _field(3, _field(1, "identity") + _field(3, True) + _field(4, False))
    return proto


ALPHABET = ["a", "b", "\u2581", "é"]  # few characters, so that pieces overlap and ties abound


@st.composite
def vocabularies(draw):
    """A random small BPE vocabulary: a random subset of the characters (the rest must fall back to bytes or
    <unk>), random multi-character pieces, scores from a handful of values (so ties are common), and now and then
    a USER_DEFINED or UNUSED piece."""
    byte_fallback = draw(st.booleans())
    pieces = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    if byte_fallback:
        pieces += [f"<0x{b:02X}>" for b in range(256)]
        types += [TokenType.BYTE] * 256
    chars = draw(st.lists(st.sampled_from(ALPHABET), unique=True))
    words = draw(st.lists(st.lists(st.sampled_from(ALPHABET), min_size=2, max_size=3).map("".join), unique=True, max_size=30))
    for piece in chars + [w for w in words if w not in chars]:
        pieces.append(piece)
        types.append(
            draw(st.sampled_from([TokenType.NORMAL] * 6 + [TokenType.USER_DEFINED, TokenType.UNUSED]))
            if len(piece) > 1
            else TokenType.NORMAL
        )
    scores = [0.0] * (len(pieces) - len(chars) - len([w for w in words if w not in chars]))
    scores += [float(draw(st.integers(-4, 0))) for _ in range(len(pieces) - len(scores))]
    return pieces, scores, [int(t) for t in types], byte_fallback


@settings(max_examples=500, deadline=None)
@given(vocab=vocabularies(), text=st.lists(st.sampled_from(ALPHABET + [" ", "日", "z"]), max_size=24).map("".join))
def test_bpe_matches_sentencepiece_on_random_vocabularies(vocab, text):
    pieces, scores, types, byte_fallback = vocab
    sp = spm.SentencePieceProcessor(model_proto=sentencepiece_bpe_proto(pieces, scores, types, byte_fallback))
    tok = BPETokenizer(pieces, scores, types, name="random")
    ids = tok.encode(text, bos=False)
    assert ids == sp.encode(text), [tok.id_to_piece(i) for i in ids]
    assert tok.decode(ids) == sp.decode(ids)


def test_text_cannot_spell_control_pieces():
    """Even when the plain pieces could be merged into "<s>" or "<unk>", those stay out of reach of text."""
    pieces = ["<unk>", "<s>", "</s>", "<", "s", ">", "/", "u", "n", "k", "<s", "</", "<u", "<un", "<unk", "s>"]
    tok = BPETokenizer(pieces, [0.0] * len(pieces), add_dummy_prefix=False, name="controls")
    ids = tok.encode("<s></s><unk>", bos=False)
    assert tok.bos_id not in ids and tok.eos_id not in ids and tok.unk_id not in ids
    assert tok.decode(ids) == "<s></s><unk>"
