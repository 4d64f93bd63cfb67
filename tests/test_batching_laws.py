"""Laws of the three strategies on small random float64 models: each prompt gets its solo tokens whatever the
batch, and the work each strategy does is what its algorithm implies (static wastes, ragged/continuous do not)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from npllm.batching import STRATEGIES, Request, Work, continuous_generate, generate_tokens, ragged_generate, \
    static_generate
from npllm.config import ModelConfig
from npllm.formats.random import random_weights
from npllm.generate import generate_ids
from npllm.models.reference import Transformer
from npllm.sampling import SamplingParams

CONTEXT = 40


def tiny_model(eos_ids, seed=5):
    config = ModelConfig(dim=16, hidden_dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=24,
                         max_seq_len=CONTEXT, eos_ids=eos_ids)
    return Transformer(config, random_weights(config, seed=seed, dtype=np.float64))


STOPPING = tiny_model(eos_ids=(2, 3))  # stops now and then
ENDLESS = tiny_model(eos_ids=())  # never stops: only the token limit ends a sequence

prompts_st = st.lists(st.lists(st.integers(0, 23), min_size=1, max_size=18), min_size=1, max_size=6)


@settings(max_examples=50)  # each example runs five generation loops; 50 keep the law within seconds
@given(prompts=prompts_st, max_gen_len=st.integers(0, 24), seed=st.integers(0, 2**32 - 1),
       sampled=st.booleans())
def test_every_prompt_gets_its_solo_tokens(prompts, max_gen_len, seed, sampled):
    temperature = 0.9 if sampled else 0.0
    alone = [list(generate_ids(STOPPING, p, min(max_gen_len, CONTEXT - len(p)),
                               SamplingParams(temperature=temperature, top_p=0.9, seed=seed))) for p in prompts]
    # static batching draws at forced prompt positions too, so only greedy output is batch-independent there
    for strategy in STRATEGIES if not sampled else ("ragged", "continuous"):
        tokens, _ = generate_tokens(STOPPING, prompts, max_gen_len, temperature, 0.9, strategy=strategy, seed=seed)
        assert tokens == alone, strategy


@settings(max_examples=50)
@given(lengths=st.lists(st.integers(1, 18), min_size=1, max_size=6), max_gen_len=st.integers(1, 20))
def test_work_of_each_strategy_without_stops(lengths, max_gen_len):
    """With no stop ids: static feeds every row up to max(P) + G - 1 positions and draws at every step; ragged and
    continuous feed each prompt once and each new token but the last, and waste nothing."""
    prompts = [[1] * n for n in lengths]
    B, G, P, lo, hi = len(lengths), max_gen_len, sum(lengths), min(lengths), max(lengths)
    greedy = SamplingParams(temperature=0)

    static = Work()
    static_generate(ENDLESS, prompts, G, greedy, work=static)
    total_len = min(CONTEXT, hi + G)
    assert static.steps == total_len - lo
    assert static.rows == B * (total_len - 1)
    needed = sum(min(G, CONTEXT - n) + n - 1 for n in lengths)
    assert static.needed_rows == needed and static.wasted_rows == B * (total_len - 1) - needed
    assert static.samples == B * (total_len - lo)
    assert static.wasted_samples == B * (total_len - lo) - sum(min(G, CONTEXT - n) for n in lengths)

    requests = [Request(p, min(G, CONTEXT - len(p)), greedy) for p in prompts]
    for run in (ragged_generate, continuous_generate):
        work = Work()
        run(ENDLESS, requests, work=work)
        assert (work.rows, work.wasted_rows, work.wasted_samples) == (needed, 0, 0)
        assert work.steps == max(r.max_new_tokens for r in requests)


def test_the_seed_workload():
    """One 1-token prompt and three 100-token prompts, 20 new tokens each (a model that never stops): static
    batching starts every row at position 1, feeds the long prompts one token per step (99 drawn tokens thrown
    away per long row), and keeps the short row running 99 positions past its end."""
    model = Transformer(ENDLESS.config.replace(max_seq_len=256), ENDLESS.weights)
    prompts = [[1]] + [[1] * 100] * 3
    greedy = SamplingParams(temperature=0)
    static = Work(log=[])
    static_generate(model, prompts, 20, greedy, work=static)
    assert (static.steps, static.rows, static.wasted_rows) == (119, 4 * 119, 99)
    assert static.wasted_samples == 3 * 99 + 99
    assert sum(forced for entries in static.log for _, _, _, forced in entries) == 3 * 99
    ragged = Work(log=[])
    ragged_generate(model, [Request(p, 20, greedy) for p in prompts], work=ragged)
    assert (ragged.steps, ragged.rows, ragged.wasted_rows, ragged.wasted_samples) == (20, 301 + 4 * 19, 0, 0)
    assert ragged.log[0] == [(0, 0, 1, False), (1, 0, 100, False), (2, 0, 100, False), (3, 0, 100, False)]
    assert ragged.log[1] == [(0, 1, 1, False), (1, 100, 1, False), (2, 100, 1, False), (3, 100, 1, False)]
