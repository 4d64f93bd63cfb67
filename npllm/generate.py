"""The autoregressive loop: prefill the prompt once, then decode one token at a time against the cache.

    prompt ids --prefill (one [T, D] forward)--> logits of the last token --sample--> id
    id --decode (one [1, D] forward at the next position)--> logits --sample--> id --> ...

It stops at an end-of-sequence id (and at BOS for llama2.c's TinyStories checkpoints, as run.c does), at the token
limit, or when the next token would fall outside the model's context.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .errors import GenerationError
from .sampling import Sampled, SamplingParams, sample_step


def stop_ids(config) -> frozenset[int]:
    """Token ids that end a generation: the EOS ids, plus BOS where the checkpoint uses BOS as a separator."""
    ids = set(config.eos_ids)
    if config.stop_at_bos and config.bos_id is not None:
        ids.add(config.bos_id)
    return frozenset(ids)


def check_prompt(config, prompt_ids) -> None:
    if len(prompt_ids) == 0:
        raise GenerationError("the prompt has no tokens (encode with bos=True to start from BOS)")
    if len(prompt_ids) > config.max_seq_len:
        raise GenerationError(f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                              f"{config.max_seq_len} tokens")
    bad = [t for t in prompt_ids if not 0 <= int(t) < config.vocab_size]
    if bad:
        raise GenerationError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {config.vocab_size})")


def check_request(config, prompt_ids, max_new_tokens: int) -> None:
    """A generation request the model can serve: a prompt that fits (check_prompt) and a token limit >= 0."""
    check_prompt(config, prompt_ids)
    if max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


def generate_ids(model, prompt_ids, max_new_tokens: int, params: SamplingParams,
                 rng: np.random.Generator | None = None) -> Iterator[int]:
    """Yield new token ids one by one (stop tokens are not yielded).

    The last sampled token is yielded without being fed back, so a context of N positions yields up to
    N - len(prompt) + 1 tokens, as llama2.c's run.c does.
    """
    for step in generate_steps(model, prompt_ids, max_new_tokens, params, rng):
        yield step.token_ids


def generate_steps(model, prompt_ids, max_new_tokens: int, params: SamplingParams,
                   rng: np.random.Generator | None = None) -> Iterator[Sampled]:
    """generate_ids, yielding each step's whole draw: the id, its log-probability and (with params.logprobs = N)
    the N most probable alternatives."""
    config = model.config
    check_request(config, prompt_ids, max_new_tokens)
    rng = np.random.default_rng(params.seed) if rng is None else rng
    stops = stop_ids(config)
    # room for every position this request can reach, not the whole context: a model claiming a huge context
    # still serves a short request (the last token is never fed back, so len(prompt) + max_new_tokens suffices)
    cache = model.new_cache(min(config.max_seq_len, len(prompt_ids) + max(max_new_tokens, 1)))
    history = [int(t) for t in prompt_ids]
    hidden = model.forward(history, np.arange(len(history)), cache)[-1:]  # prefill: [T, D] -> last [1, D]
    for _ in range(max_new_tokens):
        step = next_step(model, hidden, params, rng, history)
        if step.token_ids in stops:
            return
        yield step
        history.append(step.token_ids)
        position = len(history) - 1
        if position >= config.max_seq_len:  # no room to feed it back: the context is full
            return
        hidden = model.forward([step.token_ids], [position], cache)  # decode: [1, D]


def next_step(model, hidden, params: SamplingParams, rng: np.random.Generator, history) -> Sampled:
    """The draw after final hidden state `hidden` [1, D]. A model with its own sampler (CudaTransformer's
    sample_next) picks the id where its activations live, so only the id travels (its log-probability is then
    not computed: NaN); when log-probabilities are asked for, or the model has no sampler, the logits are
    sampled here."""
    sample_next = getattr(model, "sample_next", None)
    if sample_next is not None and params.logprobs == 0:
        token = int(sample_next(hidden, params, rng, history))
        return Sampled(token, float("nan"), np.empty(0, np.int64), np.empty(0))
    return sample_step(params, model.lm_head(hidden)[0], rng, history)
