"""The Numba model on weights kept in their GGUF types (models/numba.py: NumbaTransformer) against the NumPy
reference on the same weights dequantized, and the row-range workers it calls (kernels/quant) against
`x @ dequantize(w).T` for every type a GGUF file holds."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import npllm
from npllm import quant
from npllm.quant import oracle
from npllm.config import ModelConfig
from npllm.errors import ConfigError
from npllm.formats import read_checkpoint
from npllm.formats.gguf import read_gguf, read_gguf_quantized
from npllm.formats.gguf_write import TensorData, model_metadata, model_tensors, write_gguf, write_gguf_file
from npllm.formats.random import random_weights
from npllm.kernels import quant as kq
from npllm.models import make_model
from npllm.models.numba import NumbaTransformer
from npllm.models.numba_products import products_into
from npllm.models.reference import Transformer

# ------------------------------------------------------------------------------------------------ row workers

@st.composite
def matrix_bytes(draw, qtype):
    """Arbitrary bytes for N rows of `qtype`, every float field finite (F32/F16/BF16: finite values)."""
    t = quant.TYPES[qtype]
    N = draw(st.integers(1, 40), label="N")
    if t.block_size == 1:
        K = draw(st.integers(1, 70), label="K")
        values = draw(hnp.arrays(np.float32, (N, K), elements=st.floats(-4, 4, width=16)))
        raw = values.astype(np.float32 if qtype == "F32" else np.float16).view(np.uint8)
        if qtype == "BF16":
            raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return np.ascontiguousarray(raw).reshape(N, -1), K
    blocks = draw(st.integers(1, 2 if t.block_size == 256 else 4), label="blocks per row")
    raw = draw(hnp.arrays(np.uint8, (N * blocks, t.block_bytes)))
    for at in t.scale_fields:
        scale = draw(hnp.arrays(np.float16, N * blocks, elements=st.floats(-2, 2, width=16)))
        raw[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(N, -1), blocks * t.block_size


def near(got, w, x):
    """Within float32 rounding of the sums of |w x| (the workers regroup the sums)."""
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    return np.all(np.abs(got - exact) <= 2e-5 * scale + 1e-30)


@pytest.mark.parametrize("qtype", kq.ROW_TYPES)
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_row_workers_are_the_reference(qtype, data):
    """Rows of every type decode to the NumPy dequantizer's bits (embedding lookups); the float types' products on
    float32 activations (one token, and panels of several) are x W^T to float32 rounding."""
    raw, K = data.draw(matrix_bytes(qtype))
    raw.flags.writeable = False  # as a memory map gives them
    N, code = raw.shape[0], quant.TYPES[qtype].type_id
    w = quant.dequantize(raw, qtype, (N, K))
    T = data.draw(st.integers(1, 7), label="T")
    x = data.draw(hnp.arrays(np.float32, (T, K), elements=st.floats(-8, 8, width=32)))
    n0 = data.draw(st.integers(0, (N - 1) // 16), label="first panel") * 16  # matmul ranges start on a panel
    n1 = data.draw(st.integers(n0 + 1, N), label="end")

    row = np.empty(K, np.float32)
    kq.decode_row(code, raw, n1 - 1, row)
    np.testing.assert_array_equal(row, w[n1 - 1])
    if qtype not in kq.FLOAT_TYPES:  # the block types' products run interleaved (test_kernels_quant_int8.py)
        return
    out = np.full((T, N + 3), np.nan, np.float32)
    kq.matmul_rows(code, raw, x, T, out, 3, n0, n1)
    assert near(out[:, 3 + n0:3 + n1], w[n0:n1], x)
    sums = x[0, :K - K % 16].reshape(-1, 16).sum(axis=1).astype(np.float32)
    vec = np.full(N + 2, np.nan, np.float32)
    kq.matvec_rows(code, raw, x[0], sums, vec, 2, n0, n1)
    assert near(vec[2 + n0:2 + n1], w[n0:n1], x[0])


# ------------------------------------------------------------------------------------------------ the model

def tiny(rope_layout="interleaved", **changes) -> ModelConfig:
    """Rows of 256 (the K-quants' block), small everything else."""
    return ModelConfig(dim=256, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96,
                       max_seq_len=64, tied_embeddings=False, rope_layout=rope_layout).replace(**changes)


TOKENS = np.array([1, 5, 7, 9, 3, 2, 60, 11, 90])


def load(path, backend="numba"):
    """The model npllm.load builds (these files carry no tokenizer)."""
    return npllm.LLM(make_model(*read_checkpoint(path), backend), None)


def assert_follows_reference(path, tokens=TOKENS):
    """Prefill logits and token-by-token decode logits of the numba model (weights kept in their types) equal the
    reference model's on the file's weights: dequantized, with the products of the INT8_ACTIVATION_TYPES taken
    on 8-bit activations as the Numba model takes them (oracle.Int8ActivationMatrix)."""
    llm = load(path)
    assert isinstance(llm.model, NumbaTransformer) and set(llm.model.weight_types) != {"F32"}
    config, tensors = read_gguf_quantized(path)
    reference = Transformer(config, oracle.with_int8_activations(tensors)).logits(tokens)
    logits = llm.model.logits(tokens)
    if any(isinstance(m, oracle.Int8ActivationMatrix) for m in oracle.with_int8_activations(tensors).values()):
        # Rounding x to 8 bits is a step function: float32 sums taken in another order than NumPy's move an
        # activation across a rounding boundary now and then, one step of d = max|x| / 127 in one block, and the
        # layers after carry that on. A product in the wrong type, row or column would be off by O(1) of the scale.
        scale = np.abs(reference).max()
        np.testing.assert_allclose(logits, reference, rtol=0, atol=0.03 * scale)
        assert np.abs(logits - reference).mean() < 5e-3 * scale
    else:
        np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=2e-5)
    cache = llm.model.new_cache()
    steps = [llm.model.lm_head(llm.model.forward(tokens[i:i + 1], [i], cache))[0] for i in range(len(tokens))]
    np.testing.assert_allclose(np.array(steps), logits, rtol=1e-4, atol=2e-5)  # prefill = decode, token by token
    return llm


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                                   "IQ4_XS"])
def test_quantized_model_is_the_reference_on_each_type(tmp_path, qtype):
    """Every matrix of one type; a vocabulary of 99, so that the LM head's last interleaved group holds 3 rows."""
    config = tiny(vocab_size=99)
    path = tmp_path / "m.gguf"
    tensors = write_gguf(path, config, random_weights(config, 1), qtype)
    assert {t.type_name for t in tensors} == {qtype, "F32"}
    llm = assert_follows_reference(path)
    assert set(llm.model.weight_types) == {qtype}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_a_tied_lm_head_is_held_interleaved_once(tmp_path, qtype):
    """An LM head tied to the embedding table: the one copy is interleaved (the head's product is a decode step's
    largest), embedding lookups gather their rows back from it, and the model is the reference."""
    config = tiny(tied_embeddings=True)
    path = tmp_path / "tied.gguf"
    write_gguf(path, config, random_weights(config, 5), qtype)
    llm = assert_follows_reference(path)
    packed = llm.model.packed
    embed, head = packed.mats[-2], packed.mats[-1]
    assert embed[0] == head[0] and embed[1] == head[1]  # one matrix, read one way
    tensors = read_gguf_quantized(path)[1]
    table = tensors["tok_embeddings"]
    assert_pool_holds(packed, head, quant.interleave_rows(table.raw, qtype))
    file_bytes = sum(m.nbytes for m in tensors.values() if isinstance(m, quant.QuantizedMatrix))
    assert packed.pool.nbytes < file_bytes + table.nbytes  # a second copy of the table would take that much more


def assert_pool_holds(packed, mat, stored: np.ndarray):
    """The pool's bytes of matrix `mat` (a row of packed.mats: byte offset first) are `stored`: the NumPy layout
    (quant.interleave_rows) or the file's own rows."""
    np.testing.assert_array_equal(packed.pool[mat[0]:mat[0] + stored.nbytes], stored.reshape(-1))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_long_calls_take_8bit_activations_too(tmp_path, qtype):
    """A call of 20 tokens (five tiles of four) multiplies the K-quants by 8-bit activations as a one-token step
    does: the model follows the oracle, prefill and decode."""
    config = tiny()
    path = tmp_path / "m.gguf"
    write_gguf(path, config, random_weights(config, 3), qtype)
    assert_follows_reference(path, np.arange(20) * 7 % config.vocab_size)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K"])
def test_two_and_three_bit_k_quants_follow_the_reference(tmp_path, qtype):
    """Q2_K and Q3_K, which npllm reads but does not write: every matrix arbitrary blocks with small finite scales,
    held interleaved and multiplied on activations in two 8-bit parts (prefill in tiles of four, decode); the LM
    head tied to the embedding table, whose lookups gather their rows back from the one interleaved copy, of 99 rows
    (a last group of three). The head's product alone is the two-part oracle's to float32 rounding: one 8-bit
    part would be off by up to d / 2 a value (through the layers the logits are held only loosely)."""
    config = tiny(tied_embeddings=True, vocab_size=99)
    t, rng = quant.TYPES[qtype], np.random.default_rng(7)
    tensors = []
    for td in model_tensors(config, random_weights(config, 6), "F32"):
        if len(td.shape) == 2:
            blocks = rng.integers(0, 256, (td.shape[0] * td.shape[1] // 256, t.block_bytes), dtype=np.uint8)
            for at in quant.SCALE_FIELDS[qtype]:
                blocks[:, at:at + 2] = rng.uniform(0.5e-3, 2e-3, (len(blocks), 1)).astype(np.float16).view(np.uint8)
            td = TensorData(td.name, td.shape, qtype, blocks.reshape(td.shape[0], -1))
        tensors.append(td)
    path = tmp_path / "k.gguf"
    write_gguf_file(path, model_metadata(config, qtype), tensors)
    llm = assert_follows_reference(path, np.arange(20) * 7 % config.vocab_size)
    embed, head = llm.model.packed.mats[-2], llm.model.packed.mats[-1]
    table = read_gguf_quantized(path)[1]["tok_embeddings"]
    assert embed[0] == head[0] and embed[1] == head[1]  # one matrix, read one way
    assert_pool_holds(llm.model.packed, head, quant.interleave_rows(table.raw, qtype))
    W = np.abs(quant.dequantize(table.raw, qtype, table.shape).astype(np.float64))
    for T in (1, 6):  # a decode step's kernels, and tiles
        h = rng.standard_normal((T, config.dim)).astype(np.float32)
        expected = oracle.matmul_t_two_part_activations(table.raw, qtype, table.shape, h)
        assert np.all(np.abs(llm.model.lm_head(h) - expected) <= 1e-5 * (np.abs(h) @ W.T))


def write_mixed(path, config, seed: int, types: dict):
    """A GGUF of random weights whose matrices take types[kind] (kind: llama.cpp's name, e.g. "attn_q"), quantized
    by npllm; vectors F32."""
    mixed = []
    for t in model_tensors(config, random_weights(config, seed), "F32"):
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0]
        qtype = types.get(kind, "F32") if len(t.shape) == 2 else "F32"
        values = t.raw.view(np.float32).reshape(t.shape)
        mixed.append(TensorData(t.name, t.shape, qtype, quant.quantize(values, qtype)))
    write_gguf_file(path, model_metadata(config, "mixed"), mixed)
    return path


MIXED = {"token_embd": "Q6_K", "output": "Q8_0", "attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q5_0",
         "attn_output": "Q4_1", "ffn_gate": "F16", "ffn_up": "Q4_0", "ffn_down": "Q5_K"}


def test_mixed_types_rope_half_and_biases(tmp_path):
    """One file mixing types as llama.cpp's K-quant presets do (q, k and v of different types: no fused rows), in
    Qwen2's layout (half-split RoPE, q/k/v biases)."""
    config = tiny("half", arch="qwen2", attention_bias=True, tied_embeddings=False)
    path = write_mixed(tmp_path / "mixed.gguf", config, 2, MIXED)
    llm = assert_follows_reference(path)
    assert set(llm.model.weight_types) == set(MIXED.values())


TWO_PART_MIXED = {"token_embd": "Q3_K", "output": "Q2_K", "attn_q": "Q3_K", "attn_k": "Q8_0", "attn_v": "Q2_K",
                  "attn_output": "Q3_K", "ffn_gate": "Q4_K", "ffn_up": "Q3_K", "ffn_down": "Q2_K"}


def test_two_part_and_one_part_types_share_a_product(tmp_path):
    """Q2_K and Q3_K matrices beside one-part types in the products that read the same input (q, k, v; gate, up):
    each matrix meets the activations its type takes (written by npllm quantize's Q2_K/Q3_K), prefill and decode."""
    config = tiny(vocab_size=99)
    path = write_mixed(tmp_path / "two_part_mixed.gguf", config, 4, TWO_PART_MIXED)
    llm = assert_follows_reference(path, np.arange(20) * 7 % config.vocab_size)
    assert set(llm.model.weight_types) == set(TWO_PART_MIXED.values())
    config, tensors = read_gguf_quantized(path)
    layer = {name: m for name, m in tensors.items() if name.startswith("layers.0.")}
    h = np.random.default_rng(9).standard_normal((3, config.dim)).astype(np.float32)
    q = llm.model.packed  # the first layer's q, k, v products alone, against the oracle of each one's type
    out = np.empty((3, q.mats[0, 2] + q.mats[1, 2] + q.mats[2, 2]), np.float32)
    products_into(q.pool, q.mats, 0, np.int64(3), h, 3, out, 1)
    as_numba = oracle.with_int8_activations(layer)
    expected = np.concatenate([as_numba[f"layers.0.{n}"].matmul_t(h) for n in ("wq", "wk", "wv")], axis=1)
    W = np.concatenate([np.abs(layer[f"layers.0.{n}"].dequantize()) for n in ("wq", "wk", "wv")])
    assert np.all(np.abs(out - expected) <= 1e-5 * (np.abs(h) @ W.T))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "F16"])
def test_a_loaded_quantized_model_holds_no_float32_matrix(tmp_path, qtype):
    """Q4_0 and Q5_0 matrices are held as interleaved rows, in one copy of the file's bytes; the embedding table, only
    looked up, stays outside the pool as stored (a view of the file, no copy); a file with no matrix of
    quant.INTERLEAVED_TYPES (F16 here) is read from its memory map itself."""
    config = tiny()
    path = tmp_path / "q.gguf"
    write_gguf(path, config, random_weights(config, 3), qtype)
    model = load(path).model
    packed = model.packed
    tensors = read_gguf_quantized(path)[1]
    file_bytes = sum(m.nbytes for m in tensors.values() if isinstance(m, quant.QuantizedMatrix))
    interleaved = qtype in quant.INTERLEAVED_TYPES
    assert packed.pool.dtype == np.uint8
    table = tensors["tok_embeddings"].raw
    np.testing.assert_array_equal(packed.table, table)
    assert not packed.table.flags.owndata and packed.table.nbytes == table.nbytes
    if interleaved:  # a copy holding every other matrix once
        assert packed.pool.flags.owndata and packed.pool.nbytes == file_bytes - table.nbytes
    else:
        assert not packed.pool.flags.owndata and packed.pool.nbytes == path.stat().st_size  # the file's memory map
    raw = tensors["layers.0.wq"].raw
    assert_pool_holds(packed, packed.mats[0], quant.interleave_rows(raw, qtype) if interleaved else raw)
    if interleaved:
        wq = packed.mats[0]
        stored = packed.pool[wq[0]:wq[0] + wq[2] * wq[4]].reshape(wq[2] // 8, -1)
        for n in range(len(raw)):  # each row gathers back to the file's (an embedding lookup's gather)
            row = np.empty(raw.shape[1], np.uint8)
            kq.gather_interleaved_row(wq[1], stored, n, row)
            np.testing.assert_array_equal(row, raw[n])
    smallest_matrix = 4 * config.n_kv_heads * config.head_dim * config.dim  # wk as float32
    for name, array in packed._asdict().items():
        assert array.dtype != np.float32 or array.nbytes < smallest_matrix, name
    assert model.weight_types == {qtype: file_bytes}
    assert model.weight_bytes < file_bytes  # decode reads the LM head, not the embedding table


def test_float_checkpoints_and_other_backends_keep_float32(tmp_path):
    """An all-F32 GGUF runs on float32 panels; the numpy backend dequantizes at load."""
    config = tiny()
    path = tmp_path / "f32.gguf"
    write_gguf(path, config, random_weights(config, 4), "F32")
    assert set(load(path).model.weight_types) == {"F32"}
    q8 = tmp_path / "q8.gguf"
    write_gguf(q8, config, random_weights(config, 4), "Q8_0")
    numpy_model = load(q8, backend="numpy").model
    assert isinstance(numpy_model.weights.tok_embeddings, np.ndarray)
    # the numpy backend is the exact dequantized model; numba multiplies Q8_0 by 8-bit activations, which moves each
    # logit by a small fraction of the scale (the KL bar in tests/test_kernels_quant_int8.py measures it)
    exact, numba_logits = numpy_model.logits(TOKENS), load(q8).model.logits(TOKENS)
    np.testing.assert_allclose(numba_logits, exact, rtol=0, atol=0.05 * np.abs(exact).max())
    assert (numba_logits.argmax(-1) == exact.argmax(-1)).mean() >= 0.75


def test_weight_dtype_means_the_same_on_every_backend(tmp_path):
    """make_model's weight_dtype, not the reader or the backend, decides storage: "file" keeps a Q8_0 file's blocks on
    numba; "float32" decodes them on numba as numpy does (the same logits, float32 panels); "q8_0" rounds an F32
    checkpoint to the very blocks a Q8_0 file holds (the same model as the file's, bit for bit), on numba and numpy."""
    config = tiny()
    f32, q8 = tmp_path / "f32.gguf", tmp_path / "q8.gguf"
    write_gguf(f32, config, random_weights(config, 4), "F32")
    write_gguf(q8, config, random_weights(config, 4), "Q8_0")

    def model(path, backend, weight_dtype):
        return make_model(*read_checkpoint(path), backend, weight_dtype=weight_dtype)

    kept = model(q8, "numba", "file")
    assert set(kept.weight_types) == {"Q8_0"}
    decoded = model(q8, "numba", "float32")
    assert set(decoded.weight_types) == {"F32"}
    exact = model(q8, "numpy", "float32").logits(TOKENS)
    np.testing.assert_allclose(decoded.logits(TOKENS), exact, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(model(q8, "numpy", "file").logits(TOKENS), exact)
    rounded = model(f32, "numba", "q8_0")
    assert set(rounded.weight_types) == {"Q8_0"}
    np.testing.assert_array_equal(rounded.logits(TOKENS), kept.logits(TOKENS))
    np.testing.assert_array_equal(model(f32, "numpy", "q8_0").logits(TOKENS), exact)
    halves = model(f32, "numba", "float16")
    assert set(halves.weight_types) == {"F16"}
    with pytest.raises(ConfigError, match="weight_dtype"):
        model(f32, "numba", "q4")


def test_non_finite_scales_are_refused_at_load(tmp_path):
    config = tiny()
    tensors = model_tensors(config, random_weights(config, 5), "Q8_0")
    i = next(i for i, t in enumerate(tensors) if t.type_name == "Q8_0")
    broken = tensors[i].raw.copy()
    broken[34 + 0:34 + 2] = np.array([np.inf], np.float16).view(np.uint8)  # the second block's scale
    tensors[i] = TensorData(tensors[i].name, tensors[i].shape, "Q8_0", broken)
    path = tmp_path / "nan.gguf"
    write_gguf_file(path, model_metadata(config, "nan"), tensors)
    with pytest.raises(npllm.errors.FormatError, match="NaN or infinite"):
        read_checkpoint(path)


def test_info_shows_bytes_per_type_and_memory_as_stored(tmp_path, capsys):
    from npllm.cli import main

    config = tiny()
    path = tmp_path / "q4.gguf"
    tensors = write_gguf(path, config, random_weights(config, 6), "Q4_0")
    assert main(["info", str(path)]) == 0
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in capsys.readouterr().out.splitlines()
             if ":" in line}
    q4 = sum(t.raw.nbytes for t in tensors if t.type_name == "Q4_0")
    vectors = sum(t.raw.nbytes for t in tensors if t.type_name == "F32")
    assert lines["on disk"] == f"Q4_0 x{len(tensors) - 5} ({q4 / 2**20:.1f} MiB), F32 x5 ({vectors / 1024:.1f} KiB)"
    assert lines["memory"].startswith(f"{(q4 + vectors) / 2**20:.1f} MiB weights in their file types")


def test_bench_reports_bytes_in_the_files_types(tmp_path, capsys):
    import json

    from npllm.cli import main

    config = tiny()
    path = tmp_path / "q4.gguf"
    written = write_gguf(path, config, random_weights(config, 7), "Q4_0")
    assert main(["bench", "--model", str(path), "--batch", "1", "--prompt-len", "4", "--gen-len", "2", "--repeat",
                 "1", "--bandwidth-mib", "8", "--threads", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    q4 = sum(t.raw.nbytes for t in written if t.type_name == "Q4_0")  # the file's matrices, as written
    assert result["dtype"] == "Q4_0" and result["weight_bytes_by_type"] == {"Q4_0": q4}
    L, D, Dh = config.n_layers, config.dim, config.head_dim
    values = L * (D * (config.n_heads + 2 * config.n_kv_heads) * Dh + config.n_heads * Dh * D + 3 * D *
                  config.hidden_dim) + config.vocab_size * D + D  # layers, LM head, one embedding row
    assert result["weight_bytes_per_token"] == values // 32 * 18 + 4 * (2 * L * D + D)  # Q4_0 + F32 norms


def test_threads_change_no_bit_of_a_long_prefill(tmp_path, monkeypatch):
    """A prefill long enough to quantize its activations and take SwiGLU in parallel (models/numba_products.py
    QUANTIZE_IN_PARALLEL_FROM), on 2 threads, gives the same bits as on one: each token's integers, each output's
    sum and each gate, do not depend on the split."""
    import npllm.models.numba as numba_model
    from npllm.models.numba_products import QUANTIZE_IN_PARALLEL_FROM

    monkeypatch.setattr(numba_model, "PARALLEL_MIN_SECONDS", 0.0)  # a tiny model: run every region on the threads
    config = tiny()
    path = tmp_path / "q4.gguf"
    write_gguf(path, config, random_weights(config, 5), "Q4_0")
    config_, weights = read_checkpoint(path)
    tokens = np.arange(2 * QUANTIZE_IN_PARALLEL_FROM + 3) % config.vocab_size
    one = NumbaTransformer(config_, weights, threads=1).logits(tokens)
    two = NumbaTransformer(config_, weights, threads=2).logits(tokens)
    np.testing.assert_array_equal(one, two)
