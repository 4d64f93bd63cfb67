"""Speculative decoding: a cheap draft model proposes K tokens, the model checks all K in one forward call.

One round, with n tokens known (the caches hold all but the last):

    draft   d_1 ~ q_1, ..., d_K ~ q_K            K small calls of the draft, each on its own proposal
    verify  p_1 .. p_{K+1} = the model's distributions after x_n, d_1, ..., d_K      ONE call of K + 1 tokens
    accept  d_i with probability min(1, p_i(d_i) / q_i(d_i)), in order; at the first rejection draw instead from
            the residual  r_i = max(0, p_i - q_i) / sum(max(0, p_i - q_i))  and end the round; if all K pass,
            draw one more token from p_{K+1}
    rewind  both caches forget the positions of rejected tokens

Leviathan et al. and Chen et al. (2023) show the accepted-or-resampled token is distributed exactly as p_i:
P(token = v) = q(v) min(1, p(v)/q(v)) + (1 - sum_u min(q(u), p(u))) r(v) = min(q(v), p(v)) + max(0, p(v) - q(v))
= p(v). So the output has the model's distribution, only cheaper when the draft guesses well. p and q are the
distributions the sampling pipeline draws from (penalties, temperature, top-k, top-p, ...), each computed with the
history it would have at that position. Greedy decoding accepts d_i when it is the model's own choice, so its output
is the plain greedy output, token for token.

The draft is any model with the same vocabulary, or this model's first N layers with its final norm and LM head
(`first_layers`: self-speculative decoding, so every checkpoint has a draft).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import numpy as np

from .errors import GenerationError
from .generate import Request, Sequence, advance, check_prompt
from .sampling import SamplingParams, constrain, explain_steps, sample_with


@dataclass
class SpeculationStats:
    """What a speculative generation did: proposals made and kept, and forward calls of each model."""

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0  # verifying calls of the model (plus one prefill)
    draft_calls: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


@dataclass(frozen=True)
class Speculative:
    """How LLM.stream decodes speculatively, one record whose fields are also stream's keywords: draft (another LLM,
    or a checkpoint path, with the same vocabulary) or draft_layers (this model's first N layers) proposes num_draft
    tokens a round; speculation: a SpeculationStats to fill in. With neither draft it is off."""

    draft: object = None
    draft_layers: int | None = None
    num_draft: int = 4
    speculation: SpeculationStats | None = None

    @property
    def on(self) -> bool:
        return self.draft is not None or self.draft_layers is not None

    @classmethod
    def split_keywords(cls, base: "Speculative | None", keywords: dict) -> tuple["Speculative", dict]:
        """(base, default Speculative(), with the keywords named by its fields replacing its own; the other
        keywords)."""
        names = {f.name for f in fields(cls)}
        mine = {k: v for k, v in keywords.items() if k in names}
        rest = {k: v for k, v in keywords.items() if k not in names}
        return replace(cls() if base is None else base, **mine), rest


def first_layers(config, weights: dict, n_layers: int):
    """(config, weights) of the model cut after its first n_layers layers, keeping the final norm and LM head."""
    if not 1 <= n_layers <= config.n_layers:
        raise GenerationError(f"draft layers must lie in [1, {config.n_layers}], got {n_layers}")
    kept = {k: v for k, v in weights.items() if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers}
    return replace(config, n_layers=n_layers), kept


def distribution(params: SamplingParams, logits: np.ndarray, history) -> np.ndarray:
    """The distribution the sampling pipeline draws the next token from.      # [V] -> [V] float64 (sums to 1)"""
    return explain_steps(logits, params, history)[-1][1]


def speculative_decode(model, draft, request: Request, num_draft: int = 4, rng: np.random.Generator | None = None,
                       stats: SpeculationStats | None = None) -> Iterator[int]:
    """Yield the new token ids of `request` (stop ids not yielded), drafted by `draft` and checked by `model`."""
    if draft.config.vocab_size != model.config.vocab_size:
        raise GenerationError(f"the draft's vocabulary ({draft.config.vocab_size} ids) differs from the model's "
                              f"({model.config.vocab_size})")
    if not isinstance(num_draft, (int, np.integer)) or num_draft < 1:
        raise GenerationError(f"num_draft must be a positive integer, got {num_draft!r}")
    check_prompt(model.config, request.prompt)
    stats = SpeculationStats() if stats is None else stats
    sequence = Sequence(request, model.config, id=0, slot=0, rng=rng)
    cache, draft_cache = model.new_cache(), draft.new_cache()
    for s, drawn in advance(model, cache, [sequence], []):  # the prefill draws the first token, as plain decoding
        yield int(drawn.token_ids)
    stats.rounds += 1
    while not sequence.done:
        k = min(num_draft, request.max_new_tokens - len(sequence.tokens) - 1,
                model.config.max_seq_len - len(sequence.history), draft.config.max_seq_len - len(sequence.history))
        if k < 1:  # no room to speculate: one plain step
            for _, drawn in advance(model, cache, [], [sequence]):
                yield int(drawn.token_ids)
            stats.rounds += 1
            continue
        yield from _round(model, draft, cache, draft_cache, sequence, k, stats)


def _round(model, draft, cache, draft_cache, sequence: Sequence, k: int, stats: SpeculationStats) -> Iterator[int]:
    """Draft k tokens, verify them in one call, keep what passes; yields the tokens kept."""
    params, rng, n = sequence.row.params, sequence.row.rng, len(sequence.history)
    proposals, q, masks = _draft(draft, draft_cache, sequence, k, stats)
    k = len(proposals)  # fewer where a constraint's language ended among them
    tokens = [sequence.history[-1]] + proposals  # positions n-1 .. n-1+k
    hidden = model.forward(np.array(tokens), np.arange(n - 1, n + k), cache)
    logits = np.asarray(model.lm_head(hidden), np.float64)  # [k + 1, V]
    if masks:  # under a constraint, the model is checked on the very masks the draft drew from
        logits[:len(masks)] = constrain(logits[:len(masks)], np.stack(masks))
    stats.rounds += 1
    stats.drafted += k
    for i in range(k + 1):
        history = sequence.history + proposals[:i]
        if i == k:  # every proposal passed: the model's own next token comes free
            token = int(sample_with(params, logits[i], rng, history))
        elif params.is_greedy:
            token = int(sample_with(params, logits[i], None, history))
        else:
            token = _accept_or_resample(distribution(params, logits[i], history), q[i], proposals[i], rng)
        passed = i < k and token == proposals[i]
        stats.accepted += passed
        if not sequence.accept(token, None):
            break
        yield token
        if not passed or sequence.done:
            break
    # the caches keep every token but the last, which the next round feeds
    cache.rewind(0, len(sequence.history) - 1)
    draft_cache.rewind(0, min(n - 1 + k, len(sequence.history) - 1))


def _draft(draft, draft_cache, sequence: Sequence, k: int, stats: SpeculationStats):
    """Up to k proposals from the draft, each drawn from its pipeline distribution q_i: (ids [k], q [k] of [V],
    masks). Under a constraint the draft draws from masked logits, walking a copy of the sequence's state along
    its proposals; masks[i] is the mask at proposal i (one more after the last: the bonus token's), and drafting
    stops early at a stop id or where the language is complete."""
    params, rng = sequence.row.params, sequence.row.rng
    state = None if sequence.row.constraint is None else sequence.row.constraint.copy()
    masks = []
    known = int(draft_cache.lengths[0])  # the draft may lag by a token (the last round's bonus token)
    feed = list(sequence.history[known:])
    position = known
    proposals, q = [], []
    for _ in range(k):
        hidden = draft.forward(np.array(feed), np.arange(position, position + len(feed)), draft_cache)
        logits = np.asarray(draft.lm_head(hidden[len(feed) - 1:]), np.float64)[0]  # [V]
        stats.draft_calls += 1
        if state is not None:
            masks.append(state.allowed(sequence.stops))
            logits = constrain(logits, masks[-1])
        history = sequence.history + proposals
        if params.is_greedy:
            token, dist = int(sample_with(params, logits, None, history)), None
        else:
            dist = distribution(params, logits, history)
            token = int(_draw(dist, rng))
        position += len(feed)
        proposals.append(token)
        q.append(dist)
        feed = [token]
        if state is not None:
            if token in sequence.stops:
                return proposals, q, masks
            state.advance(token)
            if state.finished:
                return proposals, q, masks
    if state is not None:
        masks.append(state.allowed(sequence.stops))
    return proposals, q, masks


def _accept_or_resample(p: np.ndarray, q: np.ndarray, proposal: int, rng) -> int:
    """The proposal with probability min(1, p/q) at it, else a draw from the residual max(0, p - q)."""
    if rng.random() * q[proposal] < p[proposal]:  # u < p/q without dividing by a q that may be tiny
        return proposal
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0:  # p == q to rounding: the proposal could not have been rejected but for float noise
        return proposal
    return int(_draw(residual / total, rng))


def _draw(p: np.ndarray, rng) -> int:
    """Inverse-CDF draw of one id from a probability vector, one uniform consumed."""
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(p) - 1))
