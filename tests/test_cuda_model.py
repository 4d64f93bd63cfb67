"""CudaTransformer against the NumPy Transformer, and stories260K's greedy golden text through the device path.
Every CUDA model here is built as users get one: make_model / npllm.load with backend="cuda".

Without a GPU the device is numba's CUDA simulator (see test_cuda_kernels.py): a stories260K token takes about ten
seconds there on CI's two cores, so CI checks the golden text's first GOLDEN_PREFIX tokens (the CPU backends check
all 200); on a GPU, or with NPLLM_CUDA_GOLDEN_FULL=1, it runs all 200.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from npllm.device import cuda_problem, cuda_simulated, use_cuda_simulator

use_cuda_simulator()
if cuda_problem() is not None:
    pytest.skip(f"CUDA unavailable: {cuda_problem()}", allow_module_level=True)

import npllm  # noqa: E402
from npllm import LLM, batching  # noqa: E402
from npllm.config import ModelConfig, RopeScaling  # noqa: E402
from npllm.errors import ConfigError, DeviceError, GenerationError  # noqa: E402
from npllm.formats import read_checkpoint  # noqa: E402
from npllm.formats.random import random_weights  # noqa: E402
from npllm.models import make_model, resolve_backend  # noqa: E402
from npllm.models.base import kernel_samples  # noqa: E402
from npllm.models.cuda import CudaTransformer  # noqa: E402
from npllm.models.reference import Transformer  # noqa: E402
from npllm.tokenizer import load_tokenizer  # noqa: E402
from npllm.sampling import SamplingParams, sample_with  # noqa: E402
from tests_support import assert_padding_never_drawn, pad_vocabulary  # noqa: E402

# The one-launch kernels fall back to stage-by-stage launches with a RuntimeWarning: here that is a failure.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")
GOLDEN_PREFIX = 8  # eight decode steps through the device's cache and argmax; see the module docstring
GQA = ModelConfig(dim=24, hidden_dim=40, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, max_seq_len=64)
# Hugging Face's RoPE layout, q/k/v biases (Qwen2) and a sliding window shorter than the ring (Mistral)
VARIANT = GQA.replace(rope_layout="half", attention_bias=True, sliding_window=6, n_kv_heads=1)
# The other families' options at once, as run-time data of the one forward kernel: Gemma's (GeGLU, embedding scale,
# its own score scale, soft-capped scores, sandwich norms, per-head q/k norms, sliding and full layers with their
# own RoPE bases, the final soft-cap) with Granite's multipliers; OLMo 2's (post-norms only, q/k norms over the
# projection) with Phi-3's longrope (the long factors: the context, 64, is past the original 32); and Qwen3-MoE's
# experts (top-2 of 4, their weights renormalised; test_cuda_kernels.py's routed-FFN test holds the unnormalised).
# (tests/test_families.py holds the NumPy model to transformers on each family's checkpoint; these hold the device
# to the NumPy model, option by option, on models small enough for the simulator.)
SANDWICH = GQA.replace(rope_layout="half", ffn_activation="gelu_tanh", embedding_multiplier=4.9,
                       residual_multiplier=0.6, attention_scale=0.3, attn_logit_softcap=1.5, qk_norm="head",
                       block_norms="sandwich", sliding_window=3, sliding_layers=(True, False), rope_local_theta=100.0,
                       final_logit_softcap=2.0, logit_multiplier=0.7)
POST = GQA.replace(rope_layout="half", qk_norm="projection", block_norms="post",
                   rope_scaling=RopeScaling("longrope", 1.0, original_max_position_embeddings=32,
                                            short_factor=(1.0, 1.2, 1.5), long_factor=(1.0, 2.5, 6.0),
                                            attention_factor=1.2))
MOE = GQA.replace(n_experts=4, n_experts_used=2, expert_hidden_dim=16, expert_weights_norm=True)


@pytest.fixture(autouse=True, scope="module")
def fast_thread_switching():
    before = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)  # see test_cuda_kernels.py
    yield
    sys.setswitchinterval(before)


def assert_hidden_close(device_hidden, host_hidden):
    np.testing.assert_allclose(device_hidden.copy_to_host(), host_hidden, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", [GQA, VARIANT, SANDWICH, POST, MOE],
                         ids=["gqa", "half-bias-window", "sandwich", "post", "experts"])
def test_prefill_and_decode_match_numpy(config):
    """A 10-token prefill (the per-stage path), then single-token decode steps (the one-launch path) over a ring
    smaller than the sequence, so it wraps; hidden states, logits and the cache all as the NumPy model."""
    weights = random_weights(config, seed=3)
    host, device = Transformer(config, weights), make_model(config, weights, "cuda")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, 14)
    host_cache, device_cache = host.new_cache(capacity=8), device.new_cache(capacity=8)
    assert_hidden_close(device.forward(tokens[:10], np.arange(10), device_cache),
                        host.forward(tokens[:10], np.arange(10), host_cache))
    for p in range(10, 14):
        h_dev = device.forward(tokens[p:p + 1], [p], device_cache)
        h_host = host.forward(tokens[p:p + 1], [p], host_cache)
        assert_hidden_close(h_dev, h_host)
    np.testing.assert_allclose(device.lm_head(h_dev), host.lm_head(h_host), rtol=1e-4, atol=1e-4)
    copy = device_cache.to_host()
    np.testing.assert_array_equal(copy.positions, host_cache.positions)
    np.testing.assert_array_equal(copy.lengths, host_cache.lengths)
    np.testing.assert_allclose(copy.k, host_cache.k, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(copy.v, host_cache.v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "stage-by-stage"])
def test_ragged_batch_in_one_call(one_launch):
    """Three sequences at different positions in one decode call, then two prompts concatenated in one prefill
    call, each token in its own cache slot: through the one-launch kernels (matrix-vector, then tiled products)
    and stage by stage."""
    weights = random_weights(GQA, seed=4)
    host, device = Transformer(GQA, weights), make_model(GQA, weights, "cuda", one_launch=one_launch)
    host_cache, device_cache = host.new_cache(slots=3), device.new_cache(slots=3)
    tokens, positions, slots = [3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 0, 1, 0, 1], [0, 0, 0, 1, 1, 2, 2]
    assert_hidden_close(device.forward(tokens, positions, device_cache, slots),
                        host.forward(tokens, positions, host_cache, slots))
    step = ([10, 11, 12], [3, 2, 2], [0, 1, 2])
    assert_hidden_close(device.forward(*step[:2], device_cache, step[2]), host.forward(*step[:2], host_cache, step[2]))
    device_cache.reset(1)
    host_cache.reset(1)
    # a fresh 9-token prompt in slot 1 and 3 more tokens of slot 2, concatenated: 12 tokens, the per-stage path
    chunk = (list(range(5, 17)), list(range(9)) + [3, 4, 5], [1] * 9 + [2] * 3)
    assert_hidden_close(device.forward(chunk[0], chunk[1], device_cache, chunk[2]),
                        host.forward(chunk[0], chunk[1], host_cache, chunk[2]))


@pytest.mark.parametrize("config", [VARIANT, SANDWICH, MOE], ids=["half-bias-window", "sandwich", "experts"])
def test_step_by_step_is_the_one_launch_bit_for_bit(config):
    """The fallback runs the one-launch kernel's own schedule of steps, one a launch and on another grid (the
    simulator's cooperative grid is one block, the step-by-step one max_blocks): the same bits, and the same cache,
    through the tiled kernel (a 12-token prefill) and the matrix-vector one (decode calls of 1 and 3 tokens), with
    the post-norm steps idle (Llama's options) and working (the sandwich options), and the experts' steps."""
    weights = random_weights(config, seed=11)
    one, steps = (make_model(config, weights, "cuda", one_launch=flag) for flag in (True, False))
    caches = one.new_cache(capacity=16, slots=2), steps.new_cache(capacity=16, slots=2)
    calls = [(list(range(1, 13)), list(range(8)) + list(range(4)), [0] * 8 + [1] * 4), ([20], [8], [0]),
             ([21, 22, 23], [9, 4, 5], [0, 1, 1])]
    for tokens, positions, slots in calls:
        a, b = (model.forward(tokens, positions, cache, slots).copy_to_host() for model, cache in zip((one, steps),
                                                                                                       caches))
        np.testing.assert_array_equal(a, b)
    assert one.one_launch and not steps.one_launch
    for name in ("k", "v", "positions"):
        np.testing.assert_array_equal(getattr(caches[0].to_host(), name), getattr(caches[1].to_host(), name))


def test_hidden_states_index_like_numpy_arrays():
    """What generation code does with hidden states (rows by index, reshape, strided views) works on the device
    and gives the host's values."""
    weights = random_weights(GQA, seed=8)
    device = make_model(GQA, weights, "cuda")
    hidden = device.forward(list(range(1, 13)), list(range(12)), device.new_cache())  # [12, D]
    host = hidden.copy_to_host()
    np.testing.assert_array_equal(np.asarray(hidden[[3, -1, 0]]), host[[3, -1, 0]])
    np.testing.assert_array_equal(np.asarray(hidden[np.array([], np.int64)]), host[[]])
    grid, host_grid = hidden.reshape(3, 4, -1), host.reshape(3, 4, -1)
    np.testing.assert_array_equal(np.asarray(grid[:, :-1].reshape(9, -1)), host_grid[:, :-1].reshape(9, -1))
    np.testing.assert_array_equal(np.asarray(grid[:, -1]), host_grid[:, -1])
    np.testing.assert_allclose(device.lm_head(grid[:, -1]), device.lm_head(host_grid[:, -1]), rtol=1e-6)
    with pytest.raises(IndexError, match="out of range"):
        hidden[[12]]


@pytest.mark.parametrize("strategy", ["static", "ragged", "continuous"])
def test_batched_generation_on_the_device(strategy):
    """npllm.batching's three strategies drive the CUDA model as they drive the NumPy one: same tokens, same
    log-probabilities (prompts of 3, 1 and 10 tokens: prefills through both forward paths)."""
    weights = random_weights(GQA, seed=9)
    prompts = [[1, 5, 9], [1], [1, 7, 3, 8, 20, 6, 4, 10, 11, 12]]
    host = batching.generate_tokens(Transformer(GQA, weights), prompts, 5, 0.0, 1.0, True, False, strategy)
    device = batching.generate_tokens(make_model(GQA, weights, "cuda"), prompts, 5, 0.0, 1.0, True, False, strategy)
    assert device[0] == host[0]
    for got, expected in zip(device[1], host[1]):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_a_failed_one_launch_falls_back_to_stage_by_stage(monkeypatch):
    """Where a cooperative launch cannot run, the model warns once and gives the same results stage by stage."""
    import npllm.models.cuda

    def refuse(*args):
        raise RuntimeError("cooperative launches unsupported here")

    monkeypatch.setattr(npllm.models.cuda, "cooperative_blocks", refuse)
    weights = random_weights(GQA, seed=10)
    host, device = Transformer(GQA, weights), make_model(GQA, weights, "cuda")
    host_cache, device_cache = host.new_cache(), device.new_cache()
    with pytest.warns(RuntimeWarning, match="stage"):
        assert_hidden_close(device.forward([3, 4], [0, 1], device_cache), host.forward([3, 4], [0, 1], host_cache))
    assert not device.one_launch
    assert_hidden_close(device.forward([5], [2], device_cache), host.forward([5], [2], host_cache))


def test_float16_storage_is_the_rounded_model():
    """float16 storage with float32 sums computes the float32 model of the float16-rounded matrices (norm gains
    and biases, tiny, stay float32)."""
    weights = random_weights(GQA, seed=5)
    rounded = {name: w.astype(np.float16).astype(np.float32) if w.ndim == 2 else w for name, w in weights.items()}
    host, device = Transformer(GQA, rounded), make_model(GQA, weights, "cuda", weight_dtype="float16")
    tokens = [1, 7, 9, 30]
    np.testing.assert_allclose(device.logits(tokens), host.logits(tokens), rtol=1e-4, atol=1e-4)


def test_device_sampling_draws_what_the_host_draws():
    """sample_next on the device picks the id sampling.sample_with picks from the host logits, for the same rng."""
    weights = random_weights(GQA, seed=6)
    device = make_model(GQA, weights, "cuda")
    hidden = device.forward([4, 5, 6], [0, 1, 2], device.new_cache())[-1:]
    logits = device.lm_head(hidden)[0]
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=1),
                   SamplingParams(temperature=1.2, min_p=0.05, seed=2), SamplingParams(top_p=0.5, seed=3),
                   SamplingParams(seed=4, stop=("the",))):
        assert kernel_samples(params)
        expected = int(sample_with(params, logits, params.generator()))
        assert device.sample_next(hidden, params, params.generator()) == expected


def test_a_padded_vocabulary_is_never_drawn_on_the_device():
    """A vocabulary padded past the tokenizer (config.usable_vocab): lm_head's padding ids are -inf, and the device
    sampler computes and draws from the tokenizer's ids alone, the unpadded model's draws."""
    weights = random_weights(GQA, seed=6)
    plain = make_model(GQA, weights, "cuda")
    hidden = plain.forward([4, 5, 6], [0, 1, 2], plain.new_cache())
    padded = make_model(*pad_vocabulary(GQA, weights, np.resize(plain.lm_head(hidden).argmax(axis=1), 6)), "cuda")
    assert_padding_never_drawn(plain, padded, hidden, seeds=2)


def test_sampling_options_the_device_lacks_go_to_the_host():
    """Penalties, typical-p, logit bias and log-probabilities need the host sampler: the logits go there, and the
    draw is still sample_with's."""
    host_only = dict(typical_p=0.5, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5,
                     no_repeat_ngram=3, logit_bias={5: 1.0}, logprobs=2)
    for name, value in host_only.items():
        assert not kernel_samples(SamplingParams(**{name: value})), name
    weights = random_weights(GQA, seed=6)
    device = make_model(GQA, weights, "cuda")
    hidden = device.forward([4, 5, 6], [0, 1, 2], device.new_cache())[-1:]
    logits = device.lm_head(hidden)[0]
    history = [4, 5, 6]
    for params in (SamplingParams(repetition_penalty=1.3, seed=4), SamplingParams(typical_p=0.8, seed=5),
                   SamplingParams(logit_bias={3: 5.0}, seed=6), SamplingParams(logprobs=2, seed=7)):
        expected = int(sample_with(params, logits, params.generator(), history))
        assert device.sample_next(hidden, params, params.generator(), history) == expected


def test_bad_input_is_refused_before_the_device_sees_it():
    device = make_model(GQA, random_weights(GQA, seed=7), "cuda")
    cache = device.new_cache(slots=2)
    with pytest.raises(GenerationError, match="token ids"):
        device.forward([50], [0], cache)
    with pytest.raises(GenerationError, match="slots"):
        device.forward([1], [0], cache, [2])
    with pytest.raises(GenerationError, match="one length"):
        device.forward([1, 2], [0], cache)


def gpu_present() -> bool:
    """An NVIDIA GPU is attached: its device nodes exist (Linux; /dev/dxg under WSL), whatever numba is set to."""
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/dxg")


def test_device_selection_without_a_gpu_names_what_is_missing():
    """Outside the simulator, on a machine without a GPU: backend "cuda" raises DeviceError naming the driver,
    "auto" falls back to numba. (In the simulator "auto" never picks CUDA either.)"""
    if gpu_present():
        pytest.skip("this machine has a GPU")
    assert resolve_backend("auto") == "numba"
    assert resolve_backend("cuda") == "cuda"  # the simulator runs explicit requests
    with pytest.raises(ConfigError, match="unknown backend"):
        resolve_backend("tpu")
    code = ("from npllm.models import resolve_backend\n"
            "print(resolve_backend('auto'))\n"
            "try:\n    resolve_backend('cuda')\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=300).stdout
    auto, error = out.splitlines()[:2]
    assert auto == "numba"
    assert error.startswith("DeviceError") and "driver" in error


def test_a_missing_cuda_target_is_named(monkeypatch):
    """Without numba's CUDA target (numba-cuda not installed, a numba without the built-in one), the error says
    so and how to install it."""
    import importlib

    from npllm import device

    def no_cuda(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", no_cuda)
    assert "pip install -e '.[cuda]'" in device.cuda_problem()
    with pytest.raises(DeviceError, match="CUDA target cannot be imported"):
        resolve_backend("cuda")
    with pytest.raises(DeviceError, match="CUDA target cannot be imported"):
        npllm.load("stories260K", backend="cuda")
    assert resolve_backend("auto") == "numba"


def test_a_target_that_cannot_compile_is_named(monkeypatch):
    """A driver and NVVM but a target that breaks at its first compile (seen on an H200: numba-cuda 0.30.4 with
    NumPy 2.5.2 raised AttributeError: np.row_stack from inside numba for every kernel): cuda_problem says so in
    one sentence, naming the NumPy version, instead of every forward call failing deep inside numba."""
    from numba import cuda

    from npllm import device

    def broken(*args, **kwargs):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    monkeypatch.setattr(cuda, "compile_ptx", broken)
    device.first_compile_problem.cache_clear()
    try:
        problem = device.first_compile_problem()
    finally:
        device.first_compile_problem.cache_clear()
    assert problem.startswith("numba's CUDA target cannot compile a kernel here (AttributeError: ")
    assert f"NumPy {np.__version__}" in problem and "NumPy < 2.5" in problem


def test_stories260k_greedy_golden_through_the_device(stories260k, golden_200, weights_dir):
    """Greedy generation from BOS, the argmax taken on the device: the NumPy model's text, the golden's start
    (GOLDEN_PREFIX tokens under the simulator, all 200 on a GPU or with NPLLM_CUDA_GOLDEN_FULL=1)."""
    config, weights = read_checkpoint(stories260k)
    tokenizer = load_tokenizer(weights_dir / "stories260K" / "tok512.bin", vocab_size=config.vocab_size)
    full = not cuda_simulated() or os.environ.get("NPLLM_CUDA_GOLDEN_FULL") == "1"
    n = 200 if full else GOLDEN_PREFIX
    text = LLM(make_model(config, weights, "cuda"), tokenizer).generate("", n, temperature=0)
    assert text == LLM(Transformer(config, weights), tokenizer).generate("", n, temperature=0)
    assert golden_200.startswith(text)
    if n == 200:
        assert text == golden_200


def test_one_switch_gives_the_same_logits_on_every_backend(stories260k):
    """npllm.load(stories260K, backend=b).logits(ids) agrees across numpy, numba and cuda; float16 storage is
    reachable from the same switch and stays close."""
    llms = {b: npllm.load(stories260k, backend=b) for b in ("numpy", "numba", "cuda")}
    assert isinstance(llms["cuda"].model, CudaTransformer)
    ids = llms["numpy"].tokenizer.encode("Lily and Ben", bos=True)
    want = llms["numpy"].logits(ids)
    for backend in ("numba", "cuda"):
        np.testing.assert_allclose(llms[backend].logits(ids), want, atol=1e-4 * np.abs(want).max(), err_msg=backend)
    half = npllm.load(stories260k, backend="cuda", weight_dtype="float16")
    assert half.model.weight_dtype == np.float16
    np.testing.assert_allclose(half.logits(ids), want, atol=2e-2 * np.abs(want).max())
    with pytest.raises(ConfigError, match="weight_dtype q8_0"):  # rows of 172 values hold no whole Q8_0 block
        npllm.load(stories260k, backend="numba", weight_dtype="q8_0")
