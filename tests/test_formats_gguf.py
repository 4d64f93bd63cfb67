"""GGUF reader against files written by the `gguf` package (the llama.cpp project's writer and reference
dequantizers): metadata of every type, alignment, versions, bit-exact Q8_0/Q4_0, the same logits as the safetensors
path, stories260K's golden text through an embedded tokenizer, and a fuzzer that only ever sees npllm errors."""

import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npllm
from npllm.config import RopeScaling
from npllm.errors import ConfigError, FormatError, NpllmError, TokenizerError
from npllm.formats.gguf import llama3_scaling_from_freq_factors, read_gguf, read_gguf_file, read_vocab
from npllm.formats.hf import read_hf
from npllm.quant import dequantize_q4_0, dequantize_q8_0
from npllm.tokenizer.gguf import gguf_tokenizer

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "hf"

LAYER_NAMES = {"attention_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
               "ffn_norm": "ffn_norm", "w1": "ffn_gate", "w2": "ffn_down", "w3": "ffn_up",
               "bq": "attn_q", "bk": "attn_k", "bv": "attn_v"}
GLOBAL_NAMES = {"tok_embeddings": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight"}


def half_to_interleaved(w, n_head):
    """llama.cpp's converter reorders HF q/k rows so that RoPE pairs are adjacent again."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(s: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """rope_freqs as llama.cpp's converter computes them, one divisor per inverse frequency."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            factors.append(1.0)
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            factors.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            factors.append(1 / ((1 - smooth) / s.factor + smooth))
    return np.array(factors, dtype=np.float32)


def tensor_payload(array: np.ndarray, qtype) -> tuple[np.ndarray, object]:
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == Q.F32 or array.ndim == 1:  # llama.cpp keeps norms and biases in F32
        return array, None
    if qtype == Q.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array, qtype), qtype


def write_gguf(path, config, weights, qtype=Q.F32, vocab=None, alignment=None):
    """A GGUF file of an npllm model, as llama.cpp's converter lays it out (q/k interleaved for 'llama')."""
    arch = "qwen2" if config.arch == "qwen2" else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config.max_seq_len)
    w.add_embedding_length(config.dim)
    w.add_block_count(config.n_layers)
    w.add_feed_forward_length(config.hidden_dim)
    w.add_head_count(config.n_heads)
    w.add_head_count_kv(config.n_kv_heads)
    w.add_layer_norm_rms_eps(config.norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_rope_dimension_count(config.head_dim)
    if alignment:
        w.add_custom_alignment(alignment)
    if config.rope_scaling is not None and config.rope_scaling.kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(config.rope_scaling.factor)
    if config.rope_scaling is not None and config.rope_scaling.kind == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(config.rope_scaling, config.rope_theta,
                                                                config.head_dim))
    if vocab is not None:
        vocab(w)
    for name, array in weights.items():
        if name.startswith("layers."):
            _, layer, short = name.split(".")
            kind = "bias" if short.startswith("b") else "weight"
            gguf_name = f"blk.{layer}.{LAYER_NAMES[short]}.{kind}"
            if arch == "llama" and config.rope_layout == "half" and short in ("wq", "wk"):
                array = half_to_interleaved(array, config.n_heads if short == "wq" else config.n_kv_heads)
        else:
            gguf_name = GLOBAL_NAMES[name]
        data, raw_dtype = tensor_payload(array, qtype)
        if raw_dtype is None:
            w.add_tensor(gguf_name, data)
        else:
            w.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --------------------------------------------------------------------------------------------------------------
# Header, metadata, versions, alignment


def test_metadata_of_every_value_type(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁ 東京")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_array("t.arr_i", [1, -2, 3])
    w.add_array("t.arr_f", [0.5, 1.5])
    w.add_array("t.arr_s", ["a", "", "ü"])
    w.add_array("t.arr_b", [True, False])
    w.add_key_value("t.arr_nested", [[1, 2], [3]], gguf.GGUFValueType.ARRAY)
    w.add_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = read_gguf_file(path)
    m = g.metadata
    assert g.version == 3 and m["general.architecture"] == "llama"
    assert (m["t.u8"], m["t.i8"], m["t.u16"], m["t.i16"]) == (200, -100, 60000, -30000)
    assert (m["t.u32"], m["t.i32"], m["t.u64"], m["t.i64"]) == (4_000_000_000, -2_000_000_000, 2**63 + 5, -(2**62))
    assert m["t.f32"] == 0.1 and m["t.f64"] == 0.1 and m["t.bool"] is True and m["t.str"] == "héllo ▁ 東京"
    assert m["t.arr_i"].tolist() == [1, -2, 3] and m["t.arr_f"].tolist() == [0.5, 1.5]
    assert m["t.arr_s"] == ["a", "", "ü"] and m["t.arr_b"].tolist() == [True, False]
    assert [a.tolist() for a in m["t.arr_nested"]] == [[1, 2], [3]]
    np.testing.assert_array_equal(g.tensor("x"), np.arange(6, dtype=np.float32).reshape(2, 3))


@pytest.mark.parametrize("alignment", [8, 64, 256])
def test_custom_alignment(tmp_path, alignment):
    config, weights = read_hf(FIXTURES / "llama_gqa")
    path = write_gguf(tmp_path / "m.gguf", config, weights, alignment=alignment)
    g = read_gguf_file(path)
    assert g.alignment == alignment and g.data_start % alignment == 0
    assert all(t.offset % alignment == 0 for t in g.tensors.values())
    _, w = read_gguf(path)
    np.testing.assert_array_equal(w["tok_embeddings"], weights["tok_embeddings"])


def test_version_2_reads_like_3_and_others_are_refused(tmp_path):
    config, weights = read_hf(FIXTURES / "llama_gqa")
    v3 = write_gguf(tmp_path / "v3.gguf", config, weights).read_bytes()
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(v3[:4] + struct.pack("<I", 2) + v3[8:])  # v2 and v3 share the little-endian layout
    assert read_gguf_file(v2).version == 2
    np.testing.assert_array_equal(read_gguf(v2)[1]["norm"], weights["norm"])
    for version, message in ((1, "version 1"), (4, "version 4")):
        bad = tmp_path / f"v{version}.gguf"
        bad.write_bytes(v3[:4] + struct.pack("<I", version) + v3[8:])
        with pytest.raises(FormatError, match=message):
            read_gguf_file(bad)


def test_big_endian_is_refused(tmp_path):
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(FormatError, match="big-endian"):
        read_gguf_file(path)


# --------------------------------------------------------------------------------------------------------------
# Tensor types: bit-exact against the gguf package's reference dequantizers


def same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(np.asarray(a, np.float32).view(np.uint32),
                                                 np.asarray(b, np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0])
def test_tensor_types_match_reference_dequantizers(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((6, 64)) * rng.uniform(0.01, 10, size=(6, 1))).astype(np.float32)
    values[0, :32] = 0.0  # an all-zero block (scale 0)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    data = gguf.quants.quantize(values, qtype) if qtype not in (Q.F32, Q.F16) else values.astype(
        np.float16 if qtype == Q.F16 else np.float32)
    if qtype in (Q.F32, Q.F16):
        w.add_tensor("x", data)
    else:
        w.add_tensor("x", data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = read_gguf_file(path).tensor("x")
    reference = gguf.GGUFReader(str(path)).tensors[0]
    assert reference.tensor_type == qtype
    expected = gguf.quants.dequantize(reference.data, reference.tensor_type)
    assert ours.dtype == np.float32 and same_bits(ours, expected)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf or NaN scales times 0, in both
@given(blocks=st.binary(min_size=34 * 3, max_size=34 * 3))
def test_q8_0_bit_exact_on_arbitrary_blocks(blocks):
    raw = np.frombuffer(blocks, dtype=np.uint8)
    expected = gguf.quants.dequantize(raw.reshape(1, -1), Q.Q8_0).reshape(-1)
    assert same_bits(dequantize_q8_0(raw), expected)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@given(blocks=st.binary(min_size=18 * 3, max_size=18 * 3))
def test_q4_0_bit_exact_on_arbitrary_blocks(blocks):
    raw = np.frombuffer(blocks, dtype=np.uint8)
    expected = gguf.quants.dequantize(raw.reshape(1, -1), Q.Q4_0).reshape(-1)
    assert same_bits(dequantize_q4_0(raw), expected)


def test_unsupported_tensor_type_names_itself(tmp_path):
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    raw = np.zeros((2, 292), dtype=np.uint8)  # two Q8_K blocks of 256 values (llama.cpp's activation type)
    w.add_tensor("x", raw, raw_shape=raw.shape, raw_dtype=Q.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = read_gguf_file(path)
    assert g.tensors["x"].shape == (2, 256)
    with pytest.raises(FormatError, match="Q8_K"):
        g.tensor("x")


# --------------------------------------------------------------------------------------------------------------
# Models: same logits as the safetensors path


def logits(config, weights, tokens):
    from npllm.models.reference import Transformer

    return Transformer(config, weights).logits(tokens)


@pytest.mark.parametrize("name", ["llama_gqa", "llama3_tied", "qwen2_bias"])
def test_gguf_f32_gives_the_safetensors_logits(tmp_path, name):
    config, weights = read_hf(FIXTURES / name)
    ref = np.load(FIXTURES / name / "reference.npz")
    path = write_gguf(tmp_path / "m.gguf", config, weights, Q.F32)
    g_config, g_weights = read_gguf(path)
    assert g_config.rope_layout == ("half" if name == "qwen2_bias" else "interleaved")
    assert g_config.tied_embeddings == config.tied_embeddings
    if config.rope_scaling is None:
        assert g_config.rope_scaling is None
    else:  # stored as per-frequency divisors (rope_freqs): the recovered rule must give the same divisors
        assert g_config.rope_scaling.kind == config.rope_scaling.kind == "llama3"
        assert g_config.rope_scaling.factor == pytest.approx(config.rope_scaling.factor)
        np.testing.assert_allclose(llama3_rope_factors(g_config.rope_scaling, config.rope_theta, config.head_dim),
                                   llama3_rope_factors(config.rope_scaling, config.rope_theta, config.head_dim),
                                   rtol=1e-5)
    got = logits(g_config, g_weights, ref["tokens"])
    assert np.abs(got - logits(config, weights, ref["tokens"])).max() < 1e-4
    assert np.abs(got - ref["logits"]).max() < 1e-4


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias"])
def test_gguf_f16_gives_the_logits_of_f16_rounded_weights(tmp_path, name):
    config, weights = read_hf(FIXTURES / name)
    tokens = np.load(FIXTURES / name / "reference.npz")["tokens"]
    path = write_gguf(tmp_path / "m.gguf", config, weights, Q.F16)
    g_config, g_weights = read_gguf(path)
    rounded = {k: (v.astype(np.float16).astype(np.float32) if v.ndim == 2 else v) for k, v in weights.items()}
    got = logits(g_config, g_weights, tokens)
    assert np.abs(got - logits(config, rounded, tokens)).max() < 1e-4  # exactly the f16 model
    assert np.abs(got - logits(config, weights, tokens)).max() < 0.05  # and close to f32 within f16's precision


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.BF16])
def test_quantized_gguf_is_exactly_the_model_of_its_reference_dequantized_weights(tmp_path, qtype):
    config, weights = read_hf(FIXTURES / "llama_gqa")
    tokens = np.load(FIXTURES / "llama_gqa" / "reference.npz")["tokens"]
    g_config, g_weights = read_gguf(write_gguf(tmp_path / "m.gguf", config, weights, qtype))
    # Quantization blocks run along rows, so llama.cpp's q/k row permutation commutes with it.
    rounded = {k: gguf.quants.dequantize(gguf.quants.quantize(v, qtype), qtype) if v.ndim == 2 else v
               for k, v in weights.items()}
    got = logits(g_config, g_weights, tokens)
    assert np.abs(got - logits(config, rounded, tokens)).max() < 1e-4
    assert np.abs(got - logits(config, weights, tokens)).max() > 1e-3  # quantization did change the model


def test_npllm_load_reads_gguf(tmp_path):
    config, weights = read_hf(FIXTURES / "mistral_window")
    config = config.replace(sliding_window=None, arch="llama")  # GGUF 'llama' carries no window
    ref = np.load(FIXTURES / "llama_gqa" / "reference.npz")
    path = write_gguf(tmp_path / "m.gguf", config, weights)
    llm = npllm.load(path, tokenizer=FIXTURES / "mistral_window" / "tokenizer.json")
    assert np.abs(llm.logits(ref["tokens"]) - logits(config, weights, ref["tokens"])).max() < 1e-4


# --------------------------------------------------------------------------------------------------------------
# Llama 3 rope_freqs


@pytest.mark.parametrize("head_dim, theta, scaling", [
    (128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),  # Llama 3.1
    (64, 500000.0, RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),  # Llama 3.2 1B
    (16, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),  # the fixture: one blended frequency
    (16, 10000.0, RopeScaling("llama3", 4.0, 1.0, 2.0, 16)),
])
def test_llama3_scaling_is_recovered_from_rope_freqs(head_dim, theta, scaling):
    from npllm.ops import rope_inv_freq

    factors = llama3_rope_factors(scaling, theta, head_dim)
    recovered = llama3_scaling_from_freq_factors(factors, theta, head_dim, "m.gguf")
    np.testing.assert_allclose(rope_inv_freq(head_dim, theta, recovered), rope_inv_freq(head_dim, theta, scaling),
                               rtol=1e-6)


def test_rope_freqs_off_the_llama3_rule_are_refused():
    factors = llama3_rope_factors(RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), 500000.0, 128)
    factors[5] = 3.0
    with pytest.raises(ConfigError, match="rope_freqs"):
        llama3_scaling_from_freq_factors(factors, 500000.0, 128, "m.gguf")


# --------------------------------------------------------------------------------------------------------------
# Embedded tokenizer: stories260K with tok512's SentencePiece vocabulary reproduces the golden text


def sentencepiece_vocab(model_path):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                     else 6 if sp.is_byte(i) else 1)

    def add(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())

    return add, tokens, types


def test_stories260k_gguf_reproduces_golden_text(tmp_path, stories260k, golden_200):
    from npllm.formats.llama2c import read_llama2c

    config, weights = read_llama2c(stories260k)
    add_vocab, tokens, types = sentencepiece_vocab(stories260k.parent / "tok512.model")
    path = write_gguf(tmp_path / "stories260K.gguf", config, weights, Q.F32, vocab=add_vocab)
    vocab = read_vocab(read_gguf_file(path))
    assert vocab.model == "llama" and vocab.tokens == tokens and vocab.token_types.tolist() == types
    assert (vocab.bos_id, vocab.eos_id) == (1, 2)
    llm = npllm.load(path)  # tokenizer from the GGUF metadata
    assert type(llm.tokenizer).__name__ == "BPETokenizer"
    assert llm.generate("", max_new_tokens=200, temperature=0) == golden_200


def test_gguf_without_tokenizer_says_so(tmp_path):
    config, weights = read_hf(FIXTURES / "llama_gqa")
    path = write_gguf(tmp_path / "m.gguf", config, weights)
    assert read_vocab(read_gguf_file(path)) is None
    with pytest.raises(TokenizerError, match="carries no tokenizer"):
        gguf_tokenizer(path)


def test_gpt2_vocabulary_from_gguf_matches_tokenizer_json(tmp_path):
    """A byte-level vocabulary stored the llama.cpp way (tokens, merges, pre-tokenizer name) encodes as the
    tokenizer.json it came from."""
    import json

    from npllm.tokenizer.bytelevel import ByteLevelBPE

    spec = json.loads((FIXTURES / "llama_gqa" / "tokenizer.json").read_text())
    inverse = {i: t for t, i in spec["model"]["vocab"].items()} | {a["id"]: a["content"] for a in spec["added_tokens"]}
    tokens = [inverse[i] for i in range(len(inverse))]
    specials = {a["id"] for a in spec["added_tokens"]}
    config, weights = read_hf(FIXTURES / "llama_gqa")

    def add(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_list(tokens)
        w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
        w.add_token_merges([" ".join(m) for m in spec["model"]["merges"]])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_add_bos_token(True)

    path = write_gguf(tmp_path / "m.gguf", config, weights, vocab=add)
    ours, reference = gguf_tokenizer(path), ByteLevelBPE.from_file(FIXTURES / "llama_gqa" / "tokenizer.json")
    for text in ["Once upon a time, 12345 東京 😀", "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"]:
        assert ours.encode(text) == reference.encode(text)


# --------------------------------------------------------------------------------------------------------------
# Bad files and the fuzzer


def small_gguf(tmp_path) -> bytes:
    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0])
    w.add_string("tokenizer.ggml.model", "llama")
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((2, 32)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((32,)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((2, 32)).astype(np.float32), Q.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
    q = gguf.quants.quantize(rng.standard_normal((1, 64)).astype(np.float32), Q.Q4_0)
    w.add_tensor("q4", q, raw_shape=q.shape, raw_dtype=Q.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return small_gguf(tmp_path_factory.mktemp("small"))


def test_small_file_reads(small, tmp_path):
    path = tmp_path / "s.gguf"
    path.write_bytes(small)
    g = read_gguf_file(path)
    assert [g.tensor(n).shape for n in ("f32", "f16", "q8", "q4")] == [(2, 32), (32,), (2, 32), (1, 64)]
    assert read_vocab(g).tokens == ["a", "b", "c"]


def locate(blob: bytes, needle: bytes) -> int:
    i = blob.find(needle)
    assert i >= 0
    return i


def patched(blob: bytes, at: int, fmt: str, value) -> bytes:
    return blob[:at] + struct.pack(fmt, value) + blob[at + struct.calcsize(fmt):]


def test_header_lies(small, tmp_path):
    name_end = locate(small, b"q8") + 2  # tensor info of "q8": n_dims u32, ne u64 x2, type u32, offset u64
    cases = {
        "not a GGUF file": b"GGUX" + small[4:],
        "more than fit": patched(small, 8, "<Q", 2**40),  # tensor count
        "more than fit ": patched(small, 16, "<Q", 2**62),  # kv count
        "dimensions": patched(small, name_end, "<I", 9),
        "do not split": patched(small, name_end + 4, "<Q", 33),
        "unknown ggml type": patched(small, name_end + 20, "<I", 99),
        "not a multiple of the alignment": patched(small, name_end + 24, "<Q", 3),
        "holds": patched(small, name_end + 24, "<Q", 2**20),
        "overlap": patched(small, name_end + 24, "<Q", 0),
        "truncated": small[: len(small) - 40],  # the last 32 bytes are padding after q4's 36
    }
    for fragment, blob in cases.items():
        path = tmp_path / "bad.gguf"
        path.write_bytes(blob)
        with pytest.raises(FormatError, match=fragment.strip()) as err:
            read_gguf_file(path)
        assert str(path) in str(err.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FormatError, match="not found"):
        read_gguf_file(tmp_path / "nope.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(FormatError):
        read_gguf_file(tmp_path / "empty.gguf")


def test_model_level_problems(tmp_path):
    config, weights = read_hf(FIXTURES / "llama_gqa")
    dropped = {k: v for k, v in weights.items() if k != "layers.1.w2"}
    with pytest.raises(FormatError, match=r"missing weight 'layers\.1\.w2'"):
        read_gguf(write_gguf(tmp_path / "a.gguf", config, dropped))
    (tmp_path / "b.gguf").write_bytes(small_gguf(tmp_path))
    with pytest.raises(ConfigError, match="embedding_length' is missing"):
        read_gguf(tmp_path / "b.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "c.gguf"), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="architecture 'gemma'"):
        read_gguf(tmp_path / "c.gguf")


NUMBERS = [0, 1, 3, 32, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1]


@st.composite
def mutations(draw, blob):
    data = bytearray(blob)
    header_end = locate(blob, b"q4") + 2 + 4 + 16 + 4 + 8
    kind = draw(st.sampled_from(["truncate", "flip", "u64", "u32"]))
    if kind == "truncate":
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, header_end - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    at = draw(st.integers(0, header_end - (8 if kind == "u64" else 4)))
    value = draw(st.sampled_from(NUMBERS))
    return patched(bytes(data), at, "<Q" if kind == "u64" else "<I", value % (2**64 if kind == "u64" else 2**32))


@settings(max_examples=300, deadline=2000)
@given(data=st.data())
def test_fuzzed_headers_raise_only_npllm_errors(small, tmp_path_factory, data):
    blob = data.draw(mutations(small))
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    path.write_bytes(blob)
    tracemalloc.start()
    try:
        g = read_gguf_file(path)
        read_vocab(g)
        for name in g.tensors:
            g.tensor(name)
    except NpllmError as e:
        assert isinstance(e, (FormatError, ConfigError)) and str(path) in str(e)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 64 * len(blob) + 256 * 1024
