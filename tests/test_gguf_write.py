"""npllm's GGUF writer and `npllm quantize`: files the `gguf` package (llama.cpp's reader) reads back tensor for
tensor, mixtures of every type read by npllm as the reference dequantizes them, and stories260K in Q8_0 generating
the golden text for as long as its dequantized float model does."""

from pathlib import Path

import numpy as np
import pytest

import npllm
from npllm import quant
from npllm.cli import main
from npllm.errors import ConfigError
from npllm.config import ModelConfig
from npllm.formats.gguf import read_gguf, read_gguf_file, read_vocab
from npllm.formats.gguf_write import TensorData, more_bits, tensor_type_for, write_gguf, write_gguf_file
from npllm.formats.random import random_weights
from npllm.formats.hf import read_hf

from tests_support import bench_script

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
WRITABLE = list(quant.QUANTIZE)  # every type npllm writes (F32 .. Q6_K, IQ4_NL, IQ4_XS)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_every_type_written_reads_back_in_the_reference_reader_and_in_npllm(tmp_path):
    rng = np.random.default_rng(0)
    values = {name: rng.standard_normal((3, 512)).astype(np.float32) for name in WRITABLE}
    tensors = [TensorData(f"t.{name}", v.shape, name, quant.quantize(v, name)) for name, v in values.items()]
    meta = {"general.architecture": "llama", "t.u32": 7, "t.i64": -(2**40), "t.f32": np.float32(0.5), "t.flag": True,
            "t.words": ["a", "bé", ""], "t.scores": np.arange(3, dtype=np.float32), "t.ids": np.arange(4, dtype=np.int32)}
    path = tmp_path / "all.gguf"
    write_gguf_file(path, meta, tensors)
    reference = gguf.GGUFReader(str(path))
    assert reference.fields["t.u32"].parts[-1][0] == 7 and reference.fields["t.i64"].parts[-1][0] == -(2**40)
    ours = read_gguf_file(path)
    assert {k: ours.metadata[k] for k in ("t.u32", "t.i64", "t.f32", "t.flag", "t.words")} == {
        "t.u32": 7, "t.i64": -(2**40), "t.f32": 0.5, "t.flag": True, "t.words": ["a", "bé", ""]}
    assert ours.metadata["t.ids"].dtype == np.int32 and ours.metadata["t.ids"].tolist() == [0, 1, 2, 3]
    for t in reference.tensors:
        name = t.name.split(".")[1]
        assert t.tensor_type == Q[name] and tuple(int(n) for n in t.shape) == (512, 3)
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(3, 512)
        assert same_bits(ours.tensor(t.name), expected)
        assert same_bits(expected, quant.dequantize(quant.quantize(values[name], name), name, (3, 512)))
        assert np.array_equal(ours.raw(t.name), quant.quantize(values[name], name))  # the bytes, unchanged


def test_npllm_reads_every_type_llama_cpp_writes_bit_exactly(tmp_path):
    """A mixture, as llama.cpp's Q4_K_M is: each tensor in its own type, arbitrary blocks (finite scales)."""
    rng = np.random.default_rng(1)
    path = tmp_path / "mix.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for name in quant.INTERLEAVED_TYPES:  # every block type
        t = quant.TYPES[name]
        raw = rng.integers(0, 256, size=(2, 2 * t.block_bytes), dtype=np.uint8)
        halves = np.array([quant.quantize(np.float32([s]), "F16") for s in rng.uniform(-2, 2, size=raw.size)])
        for at in t.scale_fields:
            blocks = raw.reshape(-1, t.block_bytes)  # a view: write finite float16 scales into every block
            blocks[:, at : at + 2] = halves[: blocks.shape[0]]
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=Q[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = read_gguf_file(path)
    for t in gguf.GGUFReader(str(path)).tensors:
        assert ours.tensors[t.name].type.name == t.name
        assert same_bits(ours.tensor(t.name), gguf.quants.dequantize(t.data, t.tensor_type))


def test_fallback_types():
    assert tensor_type_for((64,), "Q4_K") == "F32"
    assert tensor_type_for((8, 512), "Q4_K") == "Q4_K"
    assert tensor_type_for((8, 64), "Q4_K") == "Q8_0"  # rows of 64 do not fill a 256-value super-block
    assert tensor_type_for((8, 172), "Q8_0") == "F16"
    assert tensor_type_for((8, 172), "F16") == "F16"


def test_mixture_layers_with_more_bits():
    """The first and last eighth of the layers and every third layer between them (32 layers: 0-3, 28-31 and
    6, 9, ..., 27); fewer than 8 layers: every third from layer 2, and the last."""
    assert [i for i in range(32) if more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(5) if more_bits(i, 5)] == [2, 4]


@pytest.mark.parametrize("mixture,base", [("Q4_K_M", "Q4_K"), ("Q5_K_M", "Q5_K")])
@pytest.mark.parametrize("tied", [False, True])
def test_mixture_files_give_the_lm_head_and_some_projections_q6_k(tmp_path, mixture, base, tied):
    config = ModelConfig(dim=256, hidden_dim=256, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32,
                         tied_embeddings=tied)
    weights = random_weights(config, seed=3)
    write_gguf(tmp_path / "m.gguf", config, weights, mixture)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    head = "token_embd.weight" if tied else "output.weight"
    expected = {head: "Q6_K"} | ({} if tied else {"token_embd.weight": base})
    for i in range(8):  # 8 layers: 0 and 7 (the first and last eighth), and 3 and 6 (1 + 2, 1 + 5)
        more = "Q6_K" if i in (0, 3, 6, 7) else base
        expected |= {f"blk.{i}.attn_v.weight": more, f"blk.{i}.ffn_down.weight": more,
                     f"blk.{i}.attn_q.weight": base, f"blk.{i}.ffn_gate.weight": base,
                     f"blk.{i}.attn_norm.weight": "F32"}
    assert {name: types[name] for name in expected} == expected
    _, read = read_gguf(tmp_path / "m.gguf")
    assert np.abs(np.asarray(read["layers.3.wv"]) - weights["layers.3.wv"]).max() < 0.1  # Q6_K is close


def logits(config, weights, tokens):
    from npllm.models.reference import Transformer

    return Transformer(config, weights).logits(tokens)


@pytest.mark.parametrize("name", ["llama_gqa", "llama3_tied", "qwen2_bias"])
def test_written_f32_gguf_gives_the_checkpoints_logits(tmp_path, name):
    """HF's half-split q/k rows are permuted to llama.cpp's interleaved layout (not for qwen2), Llama 3 scaling
    becomes rope_freqs, a tied head writes no output.weight: the model read back computes the same logits."""
    config, weights = read_hf(FIXTURES / name)
    ref = np.load(FIXTURES / name / "reference.npz")
    path = tmp_path / "m.gguf"
    write_gguf(path, config, weights, "F32")
    assert {t.name for t in gguf.GGUFReader(str(path)).tensors} >= {"token_embd.weight", "blk.0.attn_q.weight"}
    g_config, g_weights = read_gguf(path)
    assert g_config.rope_scaling == config.rope_scaling or config.rope_scaling.kind == "llama3"
    assert g_config.tied_embeddings == config.tied_embeddings
    assert np.abs(logits(g_config, g_weights, ref["tokens"]) - ref["logits"]).max() < 1e-4


def test_writer_refuses_what_gguf_cannot_say(tmp_path):
    config, weights = read_hf(FIXTURES / "mistral_window")
    with pytest.raises(ConfigError, match="sliding window"):
        write_gguf(tmp_path / "m.gguf", config, weights)
    assert not (tmp_path / "m.gguf").exists()


# --------------------------------------------------------------------------------------------------------------
# stories260K, FFN zero-padded to 192 (hidden_dim 172 is not a multiple of 32), in Q8_0


def greedy_ids(llm, n: int) -> list[int]:
    return list(llm.generate_ids([llm.config.bos_id], n, temperature=0))


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_stories260k_q8_0_matches_golden_as_long_as_its_dequantized_model(tmp_path, stories260k, golden_200):
    from npllm.models import make_model
    from npllm.formats.llama2c import read_llama2c
    from npllm.tokenizer import load_tokenizer

    config, weights = read_llama2c(stories260k)
    tokenizer = load_tokenizer(stories260k.parent / "tok512.bin")
    config, weights = bench_script("int8_quality").pad_ffn(config, weights, 192)
    float_llm = npllm.LLM(make_model(config, weights, "numba", None), tokenizer)
    golden_ids = greedy_ids(float_llm, 200)
    assert tokenizer.decode(golden_ids) == golden_200  # padding kept the function

    path = tmp_path / "stories260K-q8_0.gguf"
    tensors = write_gguf(path, config, weights, "Q8_0", tokenizer)
    assert {t.type_name for t in tensors} == {"Q8_0", "F32"}  # every matrix quantized, no fallback
    assert gguf.GGUFReader(str(path)).tensors[0].tensor_type == Q.Q8_0
    quantized = npllm.load(path)  # tokenizer from the file's own vocabulary
    assert quantized.model.weight_types == {"Q8_0": sum(t.raw.nbytes for t in tensors if t.type_name == "Q8_0")}
    assert read_vocab(read_gguf_file(path)).tokens == [tokenizer.id_to_piece(i) for i in range(config.vocab_size)]

    rounded = {k: quant.dequantize(quant.quantize(v, "Q8_0"), "Q8_0", v.shape) if v.ndim == 2 else v
               for k, v in weights.items()}
    dequantized = npllm.LLM(make_model(config, rounded, "numba", None), tokenizer)
    expected = agreement(greedy_ids(dequantized, 200), golden_ids)
    got = agreement(greedy_ids(quantized, 200), golden_ids)
    print(f"stories260K Q8_0 (FFN padded to 192): {got} of 200 greedy tokens match greedy_200.txt "
          f"(dequantized float model: {expected})")
    # At least as long as the dequantized model: the two part from the golden text where two logits nearly tie, so
    # float rounding decides which one leaves it first (one-row kernels: both at 114; interleaved rows: 185 vs 114)
    assert got >= expected
    assert got >= 10  # and Q8_0 is close enough to follow the golden text for a while


def test_cli_quantize_writes_a_file_both_readers_load(tmp_path, stories260k, capsys):
    out = tmp_path / "s.gguf"
    assert main(["quantize", str(stories260k), str(out), "--type", "q4_0"]) == 0
    err = capsys.readouterr().err
    assert "Q4_0 x" in err and "Q4_0 needs rows that split into blocks of 32" in err
    assert "rows of 64" not in err  # the rows of 64 took Q4_0 itself: no fallback to tell of
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    assert types["token_embd.weight"] == Q.Q4_0 and types["blk.0.ffn_down.weight"] == Q.F16  # rows of 172
    assert types["output_norm.weight"] == Q.F32
    text = npllm.load(out).generate("Once upon a time", max_new_tokens=20, temperature=0)
    assert text.strip()
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    on_disk = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("on disk:"))
    q4_bytes = sum(t.n_bytes for t in gguf.GGUFReader(str(out)).tensors if t.tensor_type == Q.Q4_0)
    assert f"Q4_0 x" in on_disk and f"({q4_bytes / 2**20:.1f} MiB)" in on_disk


def test_cli_quantize_takes_a_mixture(tmp_path, stories260k, capsys):
    """stories260K's rows (64, 172) fill no super-block: the mixture's K-quants fall back as a K-quant type does."""
    out = tmp_path / "m.gguf"
    assert main(["quantize", str(stories260k), str(out), "--type", "q4_k_m"]) == 0
    err = capsys.readouterr().err
    assert "Q8_0 x" in err
    # and it says so: which matrices fell back, to what, and why
    assert "31 matrices with rows of 64 values stored as Q8_0: Q4_K_M needs rows that split into blocks of 256" in err
    assert "5 matrices with rows of 172 values stored as F16: Q4_K_M needs rows that split into blocks of 256" in err
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    assert types["token_embd.weight"] == Q.Q8_0 and types["blk.0.ffn_down.weight"] == Q.F16
    assert npllm.load(out).generate("Once upon a time", max_new_tokens=5, temperature=0).strip()


@pytest.mark.parametrize("kind, fallback", [("iq4_nl", None), ("iq4_xs", "Q8_0")])
def test_cli_quantize_writes_iq4(tmp_path, stories260k, capsys, kind, fallback):
    """`npllm quantize --type iq4_nl|iq4_xs`: the rows of 64 in IQ4_NL's blocks of 32, or (IQ4_XS's super-blocks of
    256) in Q8_0, as for a K-quant; the gguf package reads every tensor as npllm does."""
    out = tmp_path / f"{kind}.gguf"
    assert main(["quantize", str(stories260k), str(out), "--type", kind]) == 0
    err = capsys.readouterr().err
    stored = fallback or kind.upper()
    assert f"{stored} x" in err and (fallback is None) == (f"rows of 64 values stored as {fallback}" not in err)
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["token_embd.weight"] == Q[stored] and types["blk.0.ffn_down.weight"] == Q.F16  # rows of 172
    ours = read_gguf_file(out)
    for t in reader.tensors:
        assert same_bits(ours.tensor(t.name).reshape(-1), gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1))


def test_quantize_reports_progress_per_weight_and_on_a_terminal_only(tmp_path, stories260k):
    import io

    from npllm.cli import quantize_progress
    from npllm.convert import quantize_checkpoint

    calls = []
    tensors, _ = quantize_checkpoint(stories260k, tmp_path / "p.gguf", "Q8_0",
                                     progress=lambda done, total, name: calls.append((done, total, name)))
    assert calls == [(i + 1, len(tensors), t.name) for i, t in enumerate(tensors)]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert quantize_progress(io.StringIO()) is None  # a file or a pipe: the summary alone
    terminal = Terminal()
    show = quantize_progress(terminal)
    show(1, 2, "a.weight")
    show(2, 2, "b.weight")
    assert terminal.getvalue() == ("\r\033[K[npllm] quantized 1/2 tensors (a.weight)"
                                   "\r\033[K[npllm] quantized 2/2 tensors (b.weight)\n")


def test_gguf_matrices_stay_quantized_over_the_memory_map(tmp_path):
    rng = np.random.default_rng(3)
    values = rng.standard_normal((4, 256)).astype(np.float32)
    path = tmp_path / "q.gguf"
    write_gguf_file(path, {}, [TensorData("w", values.shape, "Q4_K", quant.quantize(values, "Q4_K"))])
    g = read_gguf_file(path)
    m = g.quantized("w")
    assert m.qtype == "Q4_K" and m.shape == (4, 256) and m.nbytes == 4 * 144
    assert not m.raw.flags.owndata and not m.raw.flags.writeable  # a view of the file, not a copy
    assert same_bits(m.dequantize(), g.tensor("w"))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K"])
def test_reference_model_runs_on_weights_kept_quantized(tmp_path, qtype):
    """The NumPy model over QuantizedMatrix weights (dequantized one product at a time) computes the same logits
    as over the whole file dequantized on load, and keeps only the file's bytes for its matrices."""
    from npllm.formats.gguf import read_gguf_quantized

    config, weights = read_hf(FIXTURES / "llama_gqa")
    tokens = np.load(FIXTURES / "llama_gqa" / "reference.npz")["tokens"]
    path = tmp_path / "m.gguf"
    write_gguf(path, config, weights, qtype)
    dense_config, dense = read_gguf(path)
    q_config, kept = read_gguf_quantized(path)
    matrices = [w for w in kept.values() if isinstance(w, quant.QuantizedMatrix)]
    assert matrices and all(not m.raw.flags.owndata for m in matrices)
    assert {m.qtype for m in matrices} <= {qtype, "Q8_0", "F16"}
    np.testing.assert_allclose(logits(q_config, kept, tokens), logits(dense_config, dense, tokens),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_quantize_checkpoint_from_hf_and_from_gguf(tmp_path, source):
    """A Hugging Face directory (half-split RoPE rows, a byte-level tokenizer npllm does not write yet) and a GGUF
    file both become Q8_0 files computing the model of their Q8_0-rounded weights."""
    from npllm.convert import quantize_checkpoint

    src = FIXTURES / "llama_gqa"
    config, weights = read_hf(src)
    if source == "gguf":
        src = tmp_path / "f32.gguf"
        write_gguf(src, config, weights, "F32")
    out = tmp_path / "q8.gguf"
    tensors, tokenizer = quantize_checkpoint(src, out, "Q8_0")
    assert tokenizer is None and read_vocab(read_gguf_file(out)) is None
    tokens = np.load(FIXTURES / "llama_gqa" / "reference.npz")["tokens"]
    rounded = {k: quant.dequantize(quant.quantize(v, "Q8_0"), "Q8_0", v.shape) if v.ndim == 2 else v
               for k, v in weights.items()}
    g_config, g_weights = read_gguf(out)
    np.testing.assert_allclose(logits(g_config, g_weights, tokens), logits(config, rounded, tokens),
                               rtol=1e-4, atol=1e-4)


def test_quantizing_a_llama2c_model_keeps_its_stop_at_bos_rule(tmp_path, stories260k, capsys):
    """llama2.c's checkpoints end a story at a generated BOS; the GGUF written from one stops there too (BOS as its
    end-of-turn id), with the same seed the same text, and `npllm info` says so for both."""
    from npllm.convert import quantize_checkpoint

    out = tmp_path / "f32.gguf"
    quantize_checkpoint(stories260k, out, "F32")
    assert read_gguf_file(out).metadata["tokenizer.ggml.eot_token_id"] == 1
    source, written = npllm.load(stories260k, backend="numpy"), npllm.load(out, backend="numpy")
    assert written.config.stop_at_bos and written.config.eos_ids == source.config.eos_ids == (2,)
    seed = 3  # this seed's story ends at a BOS well before the limit
    text = source.generate("Once", max_new_tokens=400, temperature=1.0, seed=seed)
    assert text != source.generate("Once", max_new_tokens=400, temperature=1.0, seed=seed, ignore_eos=True)
    assert written.generate("Once", max_new_tokens=400, temperature=1.0, seed=seed) == text
    for model in (stories260k, out):
        assert main(["info", str(model)]) == 0
        assert "end tokens:   2; BOS 1 too" in capsys.readouterr().out
