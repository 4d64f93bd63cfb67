"""Q8_0 weight storage on the CUDA backend (numba's simulator here; scripts/gpu_check.sh runs it on a GPU).

The reference for every kernel is NumPy on the dequantized blocks (quant.dequantize, which tests/test_quant.py
holds bit-exact to the gguf package): y = x @ dequantize(W).T. The kernels widen each int8 value, multiply by its
block's float16 scale (exact in float32: 8 bits times 11) and sum in float32, so tolerances are those of the float32
kernels: 1e-4 relative.
"""

import numpy as np
import pytest

from npllm.device import cuda_problem, use_cuda_simulator

use_cuda_simulator()
if cuda_problem() is not None:
    pytest.skip(f"CUDA unavailable: {cuda_problem()}", allow_module_level=True)

from numba import cuda  # noqa: E402

import npllm  # noqa: E402
from npllm import ops, quant  # noqa: E402
from npllm.errors import ConfigError  # noqa: E402
from npllm.formats.gguf import read_gguf_file  # noqa: E402
from npllm.formats.gguf_write import write_gguf  # noqa: E402
from npllm.formats.random import random_weights  # noqa: E402
from npllm.kernels import cuda as ck  # noqa: E402
from npllm.models import make_model  # noqa: E402
from npllm.models.cuda import q8_0_blocks  # noqa: E402
from npllm.models.reference import Transformer  # noqa: E402
from npllm.tokenizer import load_tokenizer  # noqa: E402

from test_cuda_kernels import EPS, SMALL, meta_rows, normal  # noqa: E402
from test_cuda_model import GQA, fast_thread_switching  # noqa: E402,F401

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def blocks_and_values(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Q8_0 blocks as the device holds them, the float32 matrix they stand for: the reference's dequantize)."""
    blocks = q8_0_blocks(w, ck.Q8_0_BLOCK)
    N, K = w.shape
    values = quant.dequantize(blocks.view(np.uint8).reshape(-1), "Q8_0", (N, blocks.shape[1] * 32))[:, :K]
    return blocks, values


@pytest.mark.parametrize("rows, T, K", [(1, 1, 64), (8, 5, 45)])
def test_q8_0_matvec_variants(rows, T, K):
    """Plain, RMSNorm-ed, residual and SwiGLU-gated products; K = 45 pads each row to two blocks."""
    rng = np.random.default_rng(K)
    N = 11
    x, g, y0 = normal(rng, T, K), normal(rng, K), normal(rng, T, N)
    w, w32 = blocks_and_values(normal(rng, N, K))
    gate, gate32 = blocks_and_values(normal(rng, N, K))
    up, up32 = blocks_and_values(normal(rng, N, K))
    xn = ops.rms_norm(x, g, 1e-5)
    cases = {(False, False, False): x @ w32.T, (True, False, False): xn @ w32.T,
             (False, True, False): y0 + x @ w32.T,
             (True, False, True): ops.silu(xn @ gate32.T) * (xn @ up32.T)}
    for (norm, residual, gated), expected in cases.items():
        y = cuda.to_device(y0)
        kernel = ck.matvec_kernel(rows, SMALL.threads, SMALL.lanes, norm, residual, gated, True)
        kernel[2, SMALL.threads](cuda.to_device(x), cuda.to_device(g), EPS,
                                 cuda.to_device(np.stack([gate, up]) if gated else w), y, np.float32(1), np.int32(0))
        np.testing.assert_allclose(y.copy_to_host(), expected, rtol=1e-4, atol=1e-4,
                                   err_msg=f"norm={norm} residual={residual} gated={gated}")


@pytest.mark.parametrize("M, N, K", [(9, 13, 37), (3, 5, 64)])
def test_q8_0_matmul_tiles(M, N, K):
    rng = np.random.default_rng(M * N * K)
    x, y0 = normal(rng, M, K), normal(rng, M, N)
    w, w32 = blocks_and_values(normal(rng, N, K))
    for residual, expected in ((False, x @ w32.T), (True, y0 + x @ w32.T)):
        y = cuda.to_device(y0)
        ck.matmul_kernel(SMALL.tile, residual, True)[3, SMALL.matmul_threads](cuda.to_device(x), cuda.to_device(w), y,
                                                                              np.float32(1))
        np.testing.assert_allclose(y.copy_to_host(), expected, rtol=1e-4, atol=1e-4)


def test_q8_0_embedding_rows_are_the_dequantized_rows():
    rng = np.random.default_rng(3)
    table, values = blocks_and_values(normal(rng, 7, 40))
    tokens = np.array([6, 0, 3, 3])
    x = cuda.device_array((4, 40), np.float32)
    ck.embed_kernel(True)[2, SMALL.threads](cuda.to_device(table), meta_rows(tokens, tokens * 0, tokens * 0), x,
                                            np.float32(1))
    np.testing.assert_array_equal(x.copy_to_host(), values[tokens])


def test_q8_0_blocks_keep_a_files_bytes_and_pad_other_rows():
    rng = np.random.default_rng(4)
    w = normal(rng, 3, 64)
    stored = quant.QuantizedMatrix.from_values(w, "Q8_0")
    assert q8_0_blocks(stored, ck.Q8_0_BLOCK).tobytes() == stored.raw.tobytes()
    padded = q8_0_blocks(w[:, :40], ck.Q8_0_BLOCK)  # 40 values: a full block and 8 values, then zeros
    assert padded.shape == (3, 2) and np.all(padded["qs"][:, 1, 8:] == 0)


def test_q8_0_model_is_the_model_of_its_blocks():
    """The CUDA model with Q8_0 storage computes the float32 model of the dequantized blocks: one-launch decode
    (up to 8 tokens), one-launch batches (more), and stage-by-stage launches."""
    config = GQA.replace(n_layers=1)
    weights = random_weights(config, seed=5)
    rounded = {name: blocks_and_values(w)[1] if w.ndim == 2 else w for name, w in weights.items()}
    host, device = Transformer(config, rounded), make_model(config, weights, "cuda", weight_dtype="q8_0")
    assert device.weight_dtype == ck.Q8_0_BLOCK and device.wqkv.shape == (1, 48, 1)  # D = 24: one padded block
    for tokens in ([1, 7], list(range(1, 10))):
        np.testing.assert_allclose(device.logits(tokens), host.logits(tokens), rtol=1e-4, atol=1e-4)
    device.one_launch = False
    np.testing.assert_allclose(device.logits([2, 3]), host.logits([2, 3]), rtol=1e-4, atol=1e-4)


def test_q8_0_experts_are_the_numpy_models_of_their_blocks():
    """A mixture of experts with Q8_0 storage: each expert's matrices kept as blocks, the router (read as float32)
    holding the values the NumPy model computes with under weight_dtype q8_0 (rounded as its blocks): the same
    experts chosen, the same logits."""
    config = GQA.replace(dim=64, head_dim=16, n_layers=1, n_experts=4, n_experts_used=2, expert_hidden_dim=32)
    weights = random_weights(config, seed=3)
    host = make_model(config, weights, "numpy", weight_dtype="q8_0")
    device = make_model(config, weights, "cuda", weight_dtype="q8_0")
    assert device.w13_exps.dtype == ck.Q8_0_BLOCK and device.w13_exps.shape == (1, 4, 2, 32, 2)
    tokens = list(range(1, 12))
    np.testing.assert_allclose(device.logits(tokens), host.logits(tokens), rtol=1e-4, atol=1e-4)


def test_a_q8_0_gguf_keeps_its_blocks_on_the_device(tmp_path, stories260k):
    """npllm.load(file.gguf, backend="cuda", weight_dtype="q8_0"): the embedding and layer matrices on the device
    are the file's bytes, and the logits are the dequantized file's (the numpy model's on the same file).
    (A small model: stories260K takes ~2 s a token in the simulator.)"""
    # rows of 32 and 64 values: every matrix is Q8_0 in the file (no F16 fallback); stories260K's vocabulary
    config = GQA.replace(dim=32, head_dim=8, hidden_dim=64, n_layers=1, vocab_size=512)
    path = tmp_path / "small-q8_0.gguf"
    written = write_gguf(path, config, random_weights(config, seed=2), "Q8_0",
                         load_tokenizer(stories260k.parent / "tok512.bin"))
    assert {t.type_name for t in written} == {"Q8_0", "F32"}
    device = npllm.load(path, backend="cuda", weight_dtype="q8_0")
    file = read_gguf_file(path)
    embedding = device.model.tok_embeddings.copy_to_host()
    assert embedding.dtype == ck.Q8_0_BLOCK
    assert embedding.tobytes() == file.raw("token_embd.weight").tobytes()
    assert device.model.w2.copy_to_host()[0].tobytes() == file.raw("blk.0.ffn_down.weight").tobytes()
    assert device.model.w13.copy_to_host()[0, 1].tobytes() == file.raw("blk.0.ffn_up.weight").tobytes()
    tokens = [1, 17]
    exact = npllm.load(path, backend="numpy").model.logits(tokens)  # the numba model takes 8-bit activations
    np.testing.assert_allclose(device.model.logits(tokens), exact, rtol=1e-4, atol=1e-4)


def test_weight_dtypes_are_one_list_for_every_backend():
    for backend in ("numba", "cuda"):
        with pytest.raises(ConfigError, match="weight_dtype must be one of file, float32, float16, q8_0"):
            make_model(GQA, random_weights(GQA), backend, weight_dtype="q4_0")
