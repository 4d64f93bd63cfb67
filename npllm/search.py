"""Beam search: keep the B most probable continuations instead of one, with transformers' exact semantics.

Every running beam is a slot of the ring KV cache, so one forward call per step advances all B beams together:

    prefill the prompt into slot 0 and copy it to every slot          (all beams start as the prompt)
    each step:
      log p(beam, v) = score(beam) + log_softmax(logits(beam))[v]      [B, V]  (scores are summed log-probs)
      candidates     = the top 2B of the B*V (beam, v) pairs          (2B: enough to keep B alive when B end)
      finished       = candidates ranked within the top B whose token is EOS, or that reach max_new_tokens;
                       each is scored  sum log p / len(new tokens) ** length_penalty  (EOS included) and kept if
                       it is among the B best finished hypotheses so far
      running        = the B best candidates that did not finish; the cache slots are reordered to their parents
                       and their new tokens are forwarded at the next position
    stop when B hypotheses are finished (early_stopping=True), or when the best running beam can no longer beat
    the worst finished one (early_stopping=False), or at max_new_tokens.

At the first step every beam holds the same prompt, so beams 1..B-1 start at a score of -1e9: the 2B candidates
then all come from beam 0 and no continuation is proposed twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import GenerationError
from .generate import stop_ids
from .sampling import constrain, log_softmax

NEG = -1.0e9  # the score transformers gives a beam or candidate that must never be chosen


@dataclass(frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]  # the new tokens, the EOS that ended it included
    score: float  # sum of their log-probabilities / len(tokens) ** length_penalty
    logprob: float  # sum of their log-probabilities


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first; ties go to the lower index."""
    return np.argsort(-values, kind="stable")[:k]


@dataclass
class _Beams:
    """The B running beams (tokens so far and summed log-probabilities) and the B best finished hypotheses."""

    tokens: np.ndarray  # [B, g] new tokens of each running beam
    scores: np.ndarray  # [B] summed log-probabilities
    done_tokens: list  # up to B token tuples, best first
    done_scores: np.ndarray  # [B] their length-penalised scores (NEG = empty place)
    done_logprobs: np.ndarray  # [B]
    improvable: bool = True  # the early-stopping heuristic has not yet said no
    kept: np.ndarray | None = None  # the candidates the running beams came from at the last step

    def all_finished(self) -> bool:
        return bool((self.done_scores > NEG / 2).all())


def beam_search(model, prompt_ids, num_beams: int, max_new_tokens: int, length_penalty: float = 1.0,
                early_stopping: bool | str = True, eos_token_id=None, num_return_sequences: int | None = None,
                ends: Callable[[tuple[int, ...]], bool] | None = None, constraint=None) -> list[Hypothesis]:
    """The best hypotheses continuing `prompt_ids`, best first (see the module docstring).

    eos_token_id: an id or a list of ids that end a hypothesis (default: the model's stop ids, generate.stop_ids).
    early_stopping: True, False or "never", as in transformers. num_return_sequences: how many to return
    (default: num_beams). ends(new tokens): a further rule under which a candidate ends as an EOS candidate does,
    its last token kept (LLM.beam_search's stop strings). constraint: a BoundConstraint (npllm.constraint) every
    hypothesis follows, each beam with its own state: its logits are masked before the log-softmax (the scores are
    the constrained distribution's), EOS is allowed where its text may end, and a token that completes the
    language ends the hypothesis as EOS does (kept).
    """
    B, N, eos = _check(model, prompt_ids, num_beams, max_new_tokens, early_stopping, eos_token_id,
                       num_return_sequences)
    K = max(2, 1 + len(eos)) * B  # candidates kept per step
    cache = model.new_cache(slots=B)
    if not hasattr(cache, "reorder"):
        raise GenerationError("beam search needs a KV cache whose slots can be reordered (numpy and numba backends)")
    P = len(prompt_ids)
    hidden = model.forward(np.asarray(prompt_ids), np.arange(P), cache, np.zeros(P, np.int64))
    cache.reorder(np.zeros(B, np.int64))  # every beam starts as the prompt
    logits = np.repeat(np.asarray(model.lm_head(hidden[P - 1:]), np.float64), B, axis=0)  # [B, V]
    beams = _Beams(np.zeros((B, 0), np.int64), np.r_[0.0, np.full(B - 1, NEG)], [], np.full(B, NEG),
                   np.full(B, NEG))
    states = None if constraint is None else [constraint.start() for _ in range(B)]
    for g in range(N):
        if states is not None:
            logits = constrain(logits, np.stack([s.allowed(eos.tolist()) for s in states]))
        candidates = _candidates(beams, logits, K)
        stops = np.isin(candidates[1], eos) | (g + 1 == N)  # [K] the candidate stops (EOS or the length limit)
        if ends is not None:
            stops |= [ends(tuple(beams.tokens[p].tolist()) + (int(t),)) for p, t in zip(*candidates[:2])]
        if states is not None:
            after = _after(states, candidates, eos)
            stops |= [s is not None and s.finished for s in after]
        _finish(beams, candidates, stops, B, length_penalty, early_stopping)
        parents = _advance(beams, candidates, stops, B)
        if states is not None:
            states = [after[i] if after[i] is not None else states[candidates[0][i]] for i in beams.kept]
        beams.improvable = beams.improvable and _improvable(beams, g + 1, N, length_penalty, early_stopping)
        if not beams.improvable or (beams.all_finished() and early_stopping is True) or stops.all():
            break
        cache.reorder(parents)
        positions = np.full(B, P + g)
        logits = np.asarray(model.lm_head(model.forward(beams.tokens[:, -1], positions, cache, np.arange(B))),
                            np.float64)
    found = [Hypothesis(t, float(s), float(lp)) for t, s, lp in
             zip(beams.done_tokens, beams.done_scores, beams.done_logprobs) if s > NEG / 2]
    return found[: num_return_sequences or B]


def _after(states: list, candidates, eos) -> list:
    """Each candidate's constraint state once its token is taken: None for an EOS candidate and for one the mask
    forbade (a -inf total: picked only when fewer than K tokens are allowed, it never runs or finishes)."""
    parents, tokens, totals = candidates
    out = []
    for p, t, total in zip(parents, tokens, totals):
        if t in eos or total == -np.inf:
            out.append(None)
            continue
        state = states[p].copy()
        state.advance(int(t))
        out.append(state)
    return out


def _candidates(beams: _Beams, logits: np.ndarray, K: int):
    """The K best (beam, token) continuations: (parent beams [K], tokens [K], summed log-probabilities [K])."""
    V = logits.shape[1]
    totals = (log_softmax(logits) + beams.scores[:, None]).reshape(-1)  # [B * V]
    best = _top(totals, K)
    return best // V, best % V, totals[best]


def _finish(beams: _Beams, candidates, ends, B: int, length_penalty: float, early_stopping) -> None:
    """Candidates within the top B that end become finished hypotheses if they rank among the B best so far."""
    parents, tokens, totals = candidates
    length = beams.tokens.shape[1] + 1
    scores = totals / length ** length_penalty
    eligible = ends & (np.arange(len(tokens)) < B)
    closed = (beams.all_finished() and early_stopping is True) or not beams.improvable
    scores = np.where(eligible & (not closed), scores, NEG)
    merged_scores = np.concatenate([beams.done_scores, scores])
    keep = _top(merged_scores, B)
    new = [tuple(beams.tokens[p].tolist()) + (int(t),) for p, t in zip(parents, tokens)]
    merged_tokens = list(beams.done_tokens) + [None] * (B - len(beams.done_tokens)) + new
    merged_logprobs = np.concatenate([beams.done_logprobs, totals])
    beams.done_tokens = [merged_tokens[i] for i in keep]
    beams.done_scores, beams.done_logprobs = merged_scores[keep], merged_logprobs[keep]


def _advance(beams: _Beams, candidates, ends, B: int) -> np.ndarray:
    """The B best candidates that did not end become the running beams; returns their parents' slots [B]."""
    parents, tokens, totals = candidates
    running = totals + np.where(ends, NEG, 0.0)
    keep = _top(running, B)
    beams.kept = keep  # which candidates the beams continue (their constraint states follow them)
    beams.tokens = np.concatenate([beams.tokens[parents[keep]], tokens[keep, None]], axis=1)
    beams.scores = running[keep]
    return parents[keep]


def _improvable(beams: _Beams, generated: int, N: int, length_penalty: float, early_stopping) -> bool:
    """transformers' heuristic: can the best running beam still beat the worst finished hypothesis? Its score is
    estimated at the current length (at the maximum length with early_stopping="never" and a positive penalty)."""
    length = N if early_stopping == "never" and length_penalty > 0 else generated
    best_possible = beams.scores[0] / length ** length_penalty
    worst = beams.done_scores.min() if beams.all_finished() else NEG
    return bool(best_possible > worst)


def _check(model, prompt_ids, num_beams, max_new_tokens, early_stopping, eos_token_id, num_return_sequences):
    config = model.config
    if not isinstance(num_beams, (int, np.integer)) or num_beams < 1:
        raise GenerationError(f"num_beams must be a positive integer, got {num_beams!r}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if early_stopping not in (True, False, "never"):
        raise GenerationError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    if num_return_sequences is not None and not 1 <= num_return_sequences <= num_beams:
        raise GenerationError(f"num_return_sequences must lie in [1, num_beams = {num_beams}], "
                              f"got {num_return_sequences}")
    if len(prompt_ids) == 0:
        raise GenerationError("the prompt has no tokens (encode with bos=True to start from BOS)")
    if len(prompt_ids) + max_new_tokens > config.max_seq_len:
        raise GenerationError(f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens exceed the model's context "
                              f"of {config.max_seq_len}")
    eos = stop_ids(config) if eos_token_id is None else np.atleast_1d(eos_token_id).tolist()
    ids = [int(t) for t in eos] + [int(t) for t in prompt_ids]
    if any(not 0 <= t < config.vocab_size for t in ids):
        raise GenerationError(f"prompt and EOS ids must lie in [0, {config.vocab_size})")
    return int(num_beams), int(max_new_tokens), np.array(sorted(set(int(t) for t in eos)), np.int64)
