"""Every family through the generation machinery beyond one greedy sequence, on the Numba backend (the one users
run): continuous batching gives each request what it gives alone, and attention sinks past the context (the ring
slid, cached keys re-rotated per layer: Gemma 3's local and global RoPE bases differ) agree with the reference."""

from pathlib import Path

import numpy as np
import pytest

import npllm
from npllm.batching import Request, continuous_generate
from npllm.context import Context
from npllm.generate import generate_ids
from npllm.sampling import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ["gemma2", "gemma3", "phi3", "qwen3", "qwen3_moe", "mixtral", "olmo2", "granite"]


@pytest.mark.parametrize("name", FAMILIES)
def test_continuous_batching_gives_each_request_its_solo_output(name):
    llm = npllm.load(FIXTURES / name, backend="numba")
    tokens = [int(t) for t in np.load(FIXTURES / name / "reference.npz")["tokens"]]
    requests = [Request(tokens[:5], 12, SamplingParams(temperature=0)),
                Request(tokens[3:30], 9, SamplingParams(temperature=0.9, top_p=0.9, seed=7)),
                Request(tokens[10:12], 16, SamplingParams(temperature=0.7, top_k=20, seed=3))]
    completions = continuous_generate(llm.model, requests, slots=2)  # 3 requests through 2 slots: one waits
    for request, completion in zip(requests, completions):
        solo = list(generate_ids(llm.model, list(request.prompt), request.max_new_tokens, request.params))
        assert list(completion.tokens) == solo


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe", "phi3"])
def test_sinks_past_the_context_agree_across_backends(name):
    """A 24-position ring with 4 sinks fed 60 tokens: the window slid 36 times; the Numba kernels over the slid ring
    give the reference's logits at every step."""
    ids = [int(t) for t in np.load(FIXTURES / name / "reference.npz")["tokens"]][:60]
    logits = {}
    for backend in ("numba", "numpy"):
        model = npllm.load(FIXTURES / name, backend=backend).model
        context = Context(model, "sinks", 4, capacity=24)
        logits[backend] = np.array([model.lm_head(context.feed([t]))[0] for t in ids])
    assert np.abs(logits["numba"] - logits["numpy"]).max() <= 1e-4
