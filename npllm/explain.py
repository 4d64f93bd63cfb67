"""`npllm generate --explain`: every generated token shown with the distribution it was drawn from.

For each step, the most probable candidates with their probability after each stage of the sampling pipeline
(`sampling.explain_steps`: the raw softmax, each active penalty, temperature, top-k, top-p, min-p, typical-p),
whether the filters kept them, and the token the sampler drew with the log-probability it reports:

    step 1, position 10: drew ' g' (id 298), p = 0.7186 in column 'top_p' (logprob -0.3304)
          id  piece                raw      temp     top_p   fate
         298  ' g'              0.6403    0.6805    0.7186   drawn
         268  ' b'              0.2754    0.2665    0.2814   kept
         400  ' do'             0.0215    0.0156         -   cut by top_p
      ...
      the filters kept 2 tokens, 94.7% of the probability before filtering

The loop is generate_ids' own loop (npllm.generate.decode, the one single-sequence loop: prefill, then one decode
step per token, the same stop rules and the same random draws), watched through the step's observe hook, so a
seeded run explains exactly the tokens `npllm generate` prints; the tests hold the two to that.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TextIO

import numpy as np

from .generate import Request, check_prompt, decode, stop_ids
from .sampling import PIPELINE, SamplingParams, constrain, explain_steps, softmax

FILTERS = tuple(stage.name for stage in PIPELINE if stage.kind == "filter")  # top_k, top_p, min_p, typical_p
# the stages that can remove a token (give it -inf); "constraint" is a structured-output constraint's mask
BANS = FILTERS + ("logit_bias", "no_repeat_ngram", "constraint")
# Column headings of the terminal table, one per pipeline stage.
HEADINGS = {"logits": "raw", "repetition_penalty": "rep_pen", "presence_frequency_penalty": "pres_freq",
            "logit_bias": "bias", "no_repeat_ngram": "ngram", "temperature": "temp", "typical_p": "typical",
            "constraint": "mask"}


@dataclass(frozen=True)
class Candidate:
    token_id: int
    piece: str  # the vocabulary entry, SentencePiece spelling
    probs: tuple[float, ...]  # probability after each stage, in Step.stages order


@dataclass(frozen=True)
class Step:
    """One generated token and the distributions it came from."""

    index: int  # 0 for the first generated token
    position: int  # the position the drawn token takes in the sequence
    stages: tuple[str, ...]  # pipeline stages, "logits" (the raw softmax) first
    drawn_from: int  # index into stages of the distribution the sampler's logprob refers to
    candidates: tuple[Candidate, ...]  # the most probable raw candidates, plus the drawn token if not among them
    token_id: int
    piece: str
    text: str  # what the token adds to the printed text (may be "" while a UTF-8 character is incomplete)
    logprob: float  # the log-probability the sampler reported for token_id
    kept: int  # tokens left with nonzero probability in the distribution drawn from
    kept_mass: float  # their probability before the first filter (1.0 when no filter is active)
    stop: bool  # the drawn token ends the generation (EOS, or BOS for llama2.c's checkpoints)
    allowed: int | None = None  # under a constraint: how many tokens its mask allowed
    allowed_mass: float | None = None  # ... and their probability under the raw softmax

    @property
    def drawn_probability(self) -> float:
        """The drawn token's probability as the table shows it (its row, the drawn-from column)."""
        row = next(c for c in self.candidates if c.token_id == self.token_id)
        return row.probs[self.drawn_from]

    def fate(self, candidate: Candidate) -> str:
        """'drawn', 'kept', 'cut by <stage>' (the stage that removed it), '0 after <stage>' (its probability
        underflowed there, e.g. at a low temperature), or '-' (not chosen by greedy decoding)."""
        if candidate.token_id == self.token_id:
            return "drawn"
        if self.stages[-1] == "greedy":
            return "-"
        for stage, p in zip(self.stages[: self.drawn_from + 1], candidate.probs):
            if p == 0.0:
                return f"cut by {stage}" if stage in BANS else f"0 after {stage}"
        return "kept"


def explain_ids(model, tokenizer, prompt_ids, max_new_tokens: int, params: SamplingParams,
                top: int = 8, constraint=None) -> Iterator[Step]:
    """Yield one Step per generated token, the stopping token included (with stop=True).

    The generation is generate_steps' own (npllm.generate.decode); this only watches each step's logits and draw.
    constraint: a BoundConstraint; its mask shows as the "constraint" stage, right after the raw softmax.
    """
    check_prompt(model.config, prompt_ids)
    decoder = tokenizer.stream_decoder()
    for t in prompt_ids:
        decoder.feed(int(t))
    steps: list[Step] = []

    def observe(rows, logits, drawn):  # one row: [1, V] logits and its draw, before the token joins the history
        history, token = rows[0].history, int(drawn.token_ids[0])
        stop = token in stops
        text = "" if stop else decoder.feed(token)
        steps.append(describe(len(steps), len(history), logits[0], params, history, token,
                              float(drawn.logprobs[0]), text, stop, tokenizer, top, rows[0].last_allowed))

    stops = stop_ids(model.config)
    request = Request(prompt_ids, max_new_tokens, replace(params, stop=()), constraint=constraint)
    shown = 0
    for _ in decode(model, request, rng=params.generator(), report=True, observe=observe):
        yield from steps[shown:]
        shown = len(steps)
    yield from steps[shown:]  # the stop token's step, which decode does not yield


def describe(index, position, logits, params, history, token, logprob, text, stop, tokenizer, top,
             allowed=None) -> Step:
    """The Step for one draw: the stage-by-stage distributions of `logits` (after the raw softmax, the mask
    `allowed` of a constraint where there is one), reduced to the rows worth showing."""
    if allowed is None:
        stages = explain_steps(logits, params, history)  # [(name, [V] probabilities)]
    else:
        masked = explain_steps(constrain(logits, allowed), params, history)
        stages = [("logits", softmax(np.asarray(logits, np.float64))), ("constraint", masked[0][1]), *masked[1:]]
    names = tuple(name for name, _ in stages)
    probs = np.stack([p for _, p in stages])  # [stages, V]
    # Greedy decoding draws from a point mass; its logprob refers to the distribution before that (see Sampled).
    drawn_from = len(names) - 2 if names[-1] == "greedy" else len(names) - 1
    raw = probs[0]
    shown = list(np.argsort(-raw, kind="stable")[:top])
    if token not in shown:
        shown.append(token)
    first_filter = next((i for i, n in enumerate(names) if n in FILTERS), None)
    final = probs[-1] > 0  # the tokens the choice was made among (one, for greedy)
    kept_mass = 1.0 if first_filter is None else float(probs[first_filter - 1][final].sum())
    candidates = tuple(Candidate(int(i), tokenizer.id_to_piece(int(i)), tuple(float(p) for p in probs[:, i]))
                       for i in shown)
    kept_by_mask = (None, None) if allowed is None else (int(allowed.sum()), float(raw[allowed].sum()))
    return Step(index, position, names, drawn_from, candidates, token, tokenizer.id_to_piece(token), text, logprob,
                int(final.sum()), kept_mass, stop, *kept_by_mask)


def format_step(step: Step) -> str:
    """A terminal table: one row per candidate, one column per pipeline stage, and each candidate's fate.

    A probability shows as "-" where a filter removed the token (exactly 0), so 0.0000 means "tiny but kept".
    """
    heading = [HEADINGS.get(s, s) for s in step.stages]
    head = (f"step {step.index}, position {step.position}: drew {printable(step.piece)} (id {step.token_id}), "
            f"p = {step.drawn_probability:.4f} in column '{heading[step.drawn_from]}' (logprob {step.logprob:.4f})")
    if step.stop:
        head += ", which stops the generation"
    lines = [head, f"  {'id':>6}  {'piece':14}" + "".join(f"{h:>10}" for h in heading) + "   fate"]
    for c in step.candidates:
        cells = "".join(f"{p:>10.4f}" if p > 0 else f"{'-':>10}" for p in c.probs)
        lines.append(f"  {c.token_id:>6}  {printable(c.piece):14}{cells}   {step.fate(c)}")
    if step.allowed is not None:
        lines.append(f"  the constraint allowed {step.allowed} token{'s' if step.allowed != 1 else ''}, "
                     f"{step.allowed_mass:.1%} of the raw probability")
    if any(s in FILTERS for s in step.stages):
        lines.append(f"  the filters kept {step.kept} token{'s' if step.kept != 1 else ''}, "
                     f"{step.kept_mass:.1%} of the probability before filtering")
    return "\n".join(lines)


def printable(piece: str) -> str:
    """A piece quoted, with SentencePiece's space symbol shown as a space."""
    return repr(piece.replace("\u2581", " "))


def step_json(step: Step) -> str:
    """One JSON object per step, for tools (`--explain --json`)."""
    return json.dumps({
        "index": step.index,
        "position": step.position,
        "token_id": step.token_id,
        "piece": step.piece,
        "text": step.text,
        "logprob": step.logprob,
        "stop": step.stop,
        "stages": list(step.stages),
        "drawn_from": step.stages[step.drawn_from],
        "kept": step.kept,
        "kept_mass": step.kept_mass,
        **({} if step.allowed is None else {"allowed": step.allowed, "allowed_mass": step.allowed_mass}),
        "candidates": [{"token_id": c.token_id, "piece": c.piece, "fate": step.fate(c),
                        "probs": dict(zip(step.stages, c.probs))} for c in step.candidates],
    }, ensure_ascii=False)


def print_explained(llm, prompt_ids, max_new_tokens: int, params: SamplingParams, as_json: bool = False,
                    out: TextIO = sys.stdout, constraint=None) -> None:
    """What `npllm generate --explain` prints: a table per generated token, then the prompt and completion as text.

    With `as_json`, one JSON object per token and nothing else; their "text" fields concatenate to the completion
    (up to a UTF-8 character left unfinished by the last token).
    """
    ids = list(prompt_ids)
    for step in explain_ids(llm.model, llm.tokenizer, prompt_ids, max_new_tokens, params,
                            constraint=llm.bind_constraint(constraint)):
        out.write(step_json(step) + "\n" if as_json else format_step(step) + "\n\n")
        out.flush()
        if not step.stop:
            ids.append(step.token_id)
    if not as_json:
        out.write(llm.tokenizer.decode(ids) + "\n")
