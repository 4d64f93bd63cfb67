"""The other families (issue 43) on the CUDA backend, end to end: a Hugging Face checkpoint of another family read into
the device model gives transformers' logits (the tiny random-weight fixture of tests/fixtures/hf, see
test_families.py) within 1e-4, through both forward kernels: a prefill of all but the last tokens (tiled products),
then single-token decode steps (matrix-vector products).

Without a GPU the device is numba's CUDA simulator (see test_cuda_kernels.py), where a fixture takes 12-30 s. So the
fixtures that run here are Phi-3's (longrope's long factors chosen by the context, fused projections split at load)
and the long-context RoPE variants' (partial rotary, NoPE layers, YaRN, dynamic NTK, and their attention factors on
the rotated dims only); every other option is held to the NumPy model on small random configs by test_cuda_model.py
(SANDWICH, POST, MOE: ~2 s each), and the NumPy model to transformers on every family's fixture by test_families.py."""

from pathlib import Path

import numpy as np
import pytest

from npllm.device import cuda_problem, use_cuda_simulator

use_cuda_simulator()
if cuda_problem() is not None:
    pytest.skip(f"CUDA unavailable: {cuda_problem()}", allow_module_level=True)

import npllm  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")
HF = Path(__file__).parent / "fixtures" / "hf"
# fixture -> the options it brings to the device (the others: see the module docstring)
FIXTURES = {
    "phi3": "longrope (long factors: the context is past the original), fused qkv/gate_up split at load",
    "phi3_partial": "partial rotary in HF's layout: q/k rows permuted into the interleaved one at upload",
    "smollm3_nope": "a layer without RoPE: its own row of zero frequencies",
    "qwen2_yarn": "YaRN's frequencies and attention factor, with q/k/v biases",
    "llama_dynamic": "dynamic NTK's base, grown by the context of 80 positions",
    "phi3_partial_longrope": "longrope's attention factor on the rotated dims of a partial rotary only",
    "smollm3_yarn": "YaRN's attention factor on the RoPE layers only",
}
DECODE_STEPS = 3
# The first TOKENS of each fixture's sequence: past the 16-position windows, and the logits of a prefix are the
# prefix of the reference's (causal attention), so the simulator runs half the work. The context stays the whole
# sequence's: longrope's factors are the ones transformers chose for it.
TOKENS = 24


from test_cuda_model import fast_thread_switching  # noqa: E402,F401  (autouse: the simulator's threads switch often)


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_match_transformers_on_the_device(name):
    reference = np.load(HF / name / "reference.npz")
    tokens, expected = reference["tokens"], reference["logits"]
    # run with a context of exactly the sequence, as test_families.py: longrope picks its factors by the context
    model = npllm.load(HF / name, backend="cuda", context=len(tokens)).model
    cache = model.new_cache()
    tokens, expected = tokens[:TOKENS], expected[:TOKENS]
    n = len(tokens) - DECODE_STEPS
    logits = [model.lm_head(model.forward(tokens[:n], np.arange(n), cache))]
    logits += [model.lm_head(model.forward(tokens[p:p + 1], [p], cache)) for p in range(n, len(tokens))]
    assert np.abs(np.concatenate(logits) - expected).max() < 1e-4


def test_embeddings_on_the_device_match_transformers():
    """npllm.embed pools the device's final hidden states as the host backends' (tests/test_embed.py)."""
    from test_embed import FIXTURE, REFERENCE, reference

    vectors = npllm.load(FIXTURE, backend="cuda").embed(REFERENCE["texts"][1:2])
    for i, v in enumerate(vectors):
        np.testing.assert_allclose(v, reference(1 + i, "last", True), atol=1e-4, rtol=0)
