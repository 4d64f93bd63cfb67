"""The generation step every loop is built on, and the loop for one prompt.

    step       one forward call and one draw per sequence:
                   hidden = forward(tokens, positions, cache, slots)      # [T, D]
                   logits = lm_head(hidden at each sequence's last token)  # [B, V]
                   ids    = the sampling pipeline on each row              # [B]
    take       one draw per Sequence from its last hidden state, offered to the Sequence, which keeps it or ends
               (a stop id, the token limit, a full context: Sequence.accept, the one place these rules live)
    advance    a step over Sequences in one cache: the whole prompt of each starting one, the last token of each
               running one, then `take`
    decode     the one single-sequence loop, on a Context (npllm.context: a cache kept between calls, and the
               context policies): prefill, then `take` and a feed per token

Every loop uses these: `decode` runs generate_ids / generate_steps, LLM.stream, explain and chat; ragged and
continuous batching run `advance` (many sequences, batching.py), static batching (Meta's grid) calls `step`
directly. A loop watches a step through its `observe` hook, which sees the logits and the draws; explain builds its
tables there.

A stop happens at an end-of-sequence id (and at BOS for llama2.c's TinyStories checkpoints, as run.c does; neither
with ignore_eos), at a request's own stop ids, at the token limit, or when the next token would fall outside the
context (under the context policy "error"; "truncate" and "sinks" go past it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import accumulate
from dataclasses import dataclass, field, replace

import numpy as np

from .context import Context, check_prompt
from .errors import GenerationError
from .sampling import Sampled, SamplingParams, constrain, log_softmax, sample_step, sample_with


def stop_ids(config) -> frozenset[int]:
    """Token ids that end a generation: the EOS ids, plus BOS where the checkpoint uses BOS as a separator."""
    ids = set(config.eos_ids)
    if config.stop_at_bos and config.bos_id is not None:
        ids.add(config.bos_id)
    return frozenset(ids)


def check_request(config, prompt_ids, max_new_tokens: int) -> None:
    """A generation request the model can serve: a prompt that fits (check_prompt) and a token limit >= 0."""
    check_prompt(config, prompt_ids)
    if max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


def token_logprobs(logits: np.ndarray, ids) -> np.ndarray:
    """log p(ids[t]) under softmax(logits[t]), in float64.   # [T, V], [T] -> [T]"""
    if len(logits) == 0:
        return np.zeros(0)
    logp = log_softmax(np.asarray(logits, dtype=np.float64))  # [T, V]
    return logp[np.arange(len(logp)), np.asarray(ids, dtype=np.int64)]


# ----------------------------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """What drawing one sequence's next token needs: its parameters, its own generator (may be None when greedy),
    its history (prompt + tokens so far, which the penalties look at), and under a structured-output constraint its
    state (npllm.constraint.ConstraintState) with the ids that end the sequence (allowed where the language may
    end)."""

    params: SamplingParams  # rows with equal params are drawn in one call; a Sequence leaves the seed out (rng has it)
    rng: np.random.Generator | None
    history: list[int] | np.ndarray
    constraint: object | None = None
    stops: frozenset[int] = frozenset()
    last_allowed: np.ndarray | None = None  # [V] the constraint's mask at the last draw (None without a constraint)

    def allowed(self, V: int) -> np.ndarray:
        """[V] bool: the tokens this row may draw next (all of them without a constraint)."""
        return np.ones(V, bool) if self.constraint is None else self.constraint.allowed(self.stops)


def draw(rows: list[Row], logits: np.ndarray, report: bool) -> Sampled:
    """One token per row, row i drawn for rows[i].                                      # [B, V] -> Sampled of [B]

    Rows with equal params are drawn in one call, each from its own generator and history, so a row's draw never
    depends on its neighbours. With `report`, each row's log-probability and its params.logprobs alternatives come
    too (sample_step); otherwise only the ids (sample_with), the log-probabilities NaN and no alternatives.
    """
    if len(rows) == 1:  # one sequence: no grouping, gathering and scattering of rows
        return _draw_group(rows[0].params, rows, logits, report)
    groups: dict[SamplingParams, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(row.params, []).append(i)
    if len(groups) == 1:
        return _draw_group(next(iter(groups)), rows, logits, report)
    B, width = len(rows), max(p.logprobs for p in groups) if report else 0
    ids, lp = np.empty(B, np.int64), np.full(B, np.nan)
    top_ids, top_lp = np.full((B, width), -1, np.int64), np.full((B, width), -np.inf)
    for params, members in groups.items():
        got = _draw_group(params, [rows[i] for i in members], logits[members], report)
        n = got.top_ids.shape[1]
        ids[members], lp[members], top_ids[members, :n], top_lp[members, :n] = got
    return Sampled(ids, lp, top_ids, top_lp)


def _draw_group(params: SamplingParams, rows: list[Row], logits: np.ndarray, report: bool) -> Sampled:
    """draw() for rows that share params.                                              # [B, V] -> Sampled of [B]"""
    rng = None if params.is_greedy else [row.rng for row in rows]  # a greedy draw consumes no uniform
    histories = [row.history for row in rows]
    if report:
        return sample_step(params, logits, rng, histories)
    B = len(rows)
    return Sampled(sample_with(params, logits, rng, histories), np.full(B, np.nan), np.empty((B, 0), np.int64),
                   np.empty((B, 0)))


# observe(rows, logits [B, V], drawn Sampled of [B]): called after each draw made from host logits.
Observer = Callable[[list[Row], np.ndarray, Sampled], None]


def step(model, cache, tokens, positions, slots, ends, rows: list[Row], report: bool = False,
         observe: Observer | None = None) -> tuple[object, Sampled]:
    """One forward call and one draw per row: (hidden [T, D], Sampled of [B]).

        hidden = model.forward(tokens, positions, cache, slots)       # [T], [T], [T] -> [T, D]
        drawn  = draw_rows(model, hidden[ends], rows, report, observe)  # ends[b]: row b's last token -> [B]
    """
    hidden = model.forward(tokens, positions, cache, slots)
    return hidden, draw_rows(model, hidden[ends], rows, report, observe)


def draw_rows(model, last, rows: list[Row], report: bool = False, observe: Observer | None = None) -> Sampled:
    """One draw per row from the rows' final hidden states last [B, D]: draw() on logits = lm_head(last) [B, V],
    then observe(rows, logits, drawn).

    A lone row nobody needs the logits of (no observer) is drawn by draw_next: through the model's own sampler
    where it has one, so that only the id travels back, the same id draw() would pick. Rows under a constraint
    draw from logits with the forbidden tokens at -inf (sampling.constrain, before every other stage; the mask
    stays in row.last_allowed); `observe` sees the model's own logits.
    """
    constrained = any(row.constraint is not None for row in rows)
    if len(rows) == 1 and observe is None and not constrained:
        return as_batch(draw_next(model, last, rows[0], report))
    logits = model.lm_head(last)  # [B, V]
    drawn_from = logits
    if constrained:
        for row in rows:
            row.last_allowed = None if row.constraint is None else row.allowed(logits.shape[-1])
        drawn_from = constrain(logits, np.stack([row.allowed(logits.shape[-1]) if row.last_allowed is None
                                                 else row.last_allowed for row in rows]))
    drawn = draw(rows, drawn_from, report)
    if observe is not None:
        observe(rows, logits, drawn)
    return drawn


def draw_next(model, last, row: Row, report: bool = False) -> Sampled:
    """One sequence's next token from its final hidden state last [1, D], as sample_step returns a [V] row's (an
    int id, a float log-probability, [N] alternatives).

    Without `report`, through the model's sample_next: its compiled sampler (which draws the id sample_with would
    draw, from the same uniform) when it has one for the options in use, so only the id leaves it. With `report`,
    draw() on host logits, for the log-probability and the alternatives."""
    sample_next = getattr(model, "sample_next", None)
    if report or sample_next is None:
        return row_of(draw([row], model.lm_head(last), report), 0)
    return Sampled(sample_next(last, row.params, row.rng, row.history), NAN, NO_IDS, NO_LOGPROBS)


# What a draw without log-probabilities reports besides its id (read-only: every such draw shares them)
NAN = float("nan")
NO_IDS = np.empty(0, np.int64)
NO_LOGPROBS = np.empty(0)
NO_IDS.flags.writeable = NO_LOGPROBS.flags.writeable = False


def as_batch(drawn: Sampled) -> Sampled:
    """A one-row draw as a batched Sampled of [1] (row_of's inverse)."""
    return Sampled(np.array([drawn.token_ids]), np.array([drawn.logprobs]), drawn.top_ids[None],
                   drawn.top_logprobs[None])


def row_of(drawn: Sampled, i: int) -> Sampled:
    """Row i of a batched Sampled, as sample_step returns it for [V] logits."""
    return Sampled(int(drawn.token_ids[i]), float(drawn.logprobs[i]), drawn.top_ids[i], drawn.top_logprobs[i])


# ----------------------------------------------------------------------------------------------------------------
# Requests and sequences
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One generation job: a prompt (token ids), how to sample, and when to stop.

    The request's generator is seeded with params.seed, so its draws are the same whatever else runs beside it.
    Generation ends at a model stop id (unless ignore_eos) or one of `stop_ids` (neither is returned), after
    `max_new_tokens`, or when the context is full (Sequence), whether the request runs alone (decode) or batched
    (npllm.batching).
    """

    prompt: tuple[int, ...]
    max_new_tokens: int = 256
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()  # ends the generation besides the model's own stop ids
    logprobs: bool = False  # record log p(token | everything before it) of each new token
    prompt_logprobs: bool = False  # ... and of each prompt token after the first
    ignore_eos: bool = False  # the model's own stop ids do not end the generation (stop_ids still do)
    constraint: object | None = None  # a BoundConstraint (npllm.constraint): the output must be in its language

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "stop_ids", frozenset(int(t) for t in self.stop_ids))
        if int(self.max_new_tokens) < 0:
            raise GenerationError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        if not isinstance(self.params, SamplingParams):
            raise GenerationError(f"params must be a SamplingParams, got {type(self.params).__name__}")
        if self.params.stop:  # stop strings are text: the token-level engine would silently ignore them
            raise GenerationError(f"params.stop {self.params.stop!r}: a Request stops on token ids (stop_ids); "
                                  f"stop strings are handled by LLM.generate / LLM.stream")


class Sequence:
    """A request being generated: its Row (params, generator, history), its new tokens, its cache slot, and the
    rules that end it (accept).

    context: the Context it runs on alone (decode), whose policy says how far it may go (Context.room: the cache
    under "error", no end under "truncate" and "sinks"); None for a slot of a batch's cache, which holds the model's
    context. A request that ignores EOS and cannot fit that room is refused here, before anything runs.
    """

    def __init__(self, request: Request, config, id: int, slot: int | None = None,
                 rng: np.random.Generator | None = None, context: Context | None = None):
        self.request, self.id, self.slot = request, id, slot
        self.cached = 0  # prompt tokens the slot already held when it started (restored from a prefix cache)
        rng = np.random.default_rng(request.params.seed) if rng is None else rng
        self.stops = (frozenset() if request.ignore_eos else stop_ids(config)) | request.stop_ids
        constraint = None if request.constraint is None else request.constraint.start()
        self.row = Row(replace(request.params, seed=None), rng, list(request.prompt), constraint, self.stops)
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = [] if request.logprobs else None
        self.prompt_logprobs: list[float] | None = None
        self.room = config.max_seq_len if context is None else context.room
        reach = len(request.prompt) + request.max_new_tokens - 1  # the last token drawn is never fed
        if request.ignore_eos and self.room is not None and reach > self.room:
            raise GenerationError(f"{len(request.prompt)} prompt tokens + {request.max_new_tokens} new ones do not "
                                  f"fit the context of {self.room} (context_policy='truncate' or 'sinks' go past it)")
        self.finish_reason: str | None = None if request.max_new_tokens > 0 else "length"

    @property
    def history(self) -> list[int]:
        return self.row.history

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token: int, logprob: float | None) -> bool:
        """Take a drawn token; False when it is a stop id (which ends the sequence and is not kept). A kept token
        ends the sequence when it completes its constraint's language (nothing but the end is allowed after it:
        "stop", without another forward), when it is the last one asked for, or when its position falls outside
        the room (it cannot be fed: the last token drawn is never fed back)."""
        if token in self.stops:
            self.finish_reason = "stop"
            return False
        self.tokens.append(token)
        self.history.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if self.row.constraint is not None:
            self.row.constraint.advance(token)
            if self.row.constraint.finished:
                self.finish_reason = "stop"
                return True
        if len(self.tokens) == self.request.max_new_tokens:
            self.finish_reason = "length"
        elif self.room is not None and len(self.history) - 1 >= self.room:
            self.finish_reason = "context"
        return True


def advance(model, cache, starting: list[Sequence], running: list[Sequence], work=None, report: bool = False,
            observe: Observer | None = None) -> list[tuple[Sequence, Sampled]]:
    """One step: the prompt of each starting sequence (past the `cached` tokens its slot already holds), the last
    token of each running one; then one drawn token for each. Returns the (sequence, its draw) pairs kept (stop ids
    end a sequence and are not returned).

        tokens    = prompt_1[cached_1:] ++ ... ++ prompt_m[cached_m:] ++ [last_1, ..., last_r]   # [T]
        positions = cached_1..len_1-1 ++ ... ++ [len(history_1) - 1, ...]                     # [T]
        slots     = each token's sequence slot                                                # [T]

    Attention runs per slot, so no sequence sees another's keys and no padding is computed. `work` (a
    batching.Work) records the call; `report` and `observe` are step's. A sequence asking for prompt_logprobs
    must start with nothing cached (every prompt row is scored).
    """
    sequences = starting + running
    sizes = [len(s.history) - s.cached for s in starting] + [1] * len(running)
    firsts = [s.cached for s in starting] + [len(s.history) - 1 for s in running]
    tokens = [t for s in starting for t in s.history[s.cached:]] + [s.history[-1] for s in running]  # [T]
    positions = [p for s in starting for p in range(s.cached, len(s.history))] + firsts[len(starting):]  # [T]
    slots = [s.slot for s, n in zip(sequences, sizes) for _ in range(n)]  # [T]
    ends = [end - 1 for end in accumulate(sizes)]  # each sequence's last token in the call
    hidden = model.forward(np.array(tokens, np.int64), np.array(positions, np.int64), cache, np.array(slots, np.int64))
    kept = take(model, hidden[ends], sequences, report, observe)
    for s, end, n in zip(starting, ends, sizes):
        if s.request.prompt_logprobs:  # rows 0 .. n-2 of the prompt predict prompt tokens 1 .. n-1
            if s.cached:
                raise GenerationError("prompt_logprobs need every prompt row: start such a sequence uncached")
            s.prompt_logprobs = [float(x) for x in token_logprobs(model.lm_head(hidden[end - n + 1:end]),
                                                                  s.history[1:n])]
    if work is not None:
        work.record([(s.id, a, int(n), False) for s, a, n in zip(sequences, firsts, sizes)])
    return kept


def take(model, last, sequences: list[Sequence], report: bool = False,
         observe: Observer | None = None) -> list[tuple[Sequence, Sampled]]:
    """One draw per sequence from its final hidden state last [B, D] (draw_rows), offered to the sequence
    (Sequence.accept): the (sequence, its draw) pairs kept, a stop id ending its sequence unreturned. Sequences
    whose request asked for logprobs record log p(drawn token) at temperature 1 (Meta's)."""
    scored = {}  # row -> log p(drawn token), for the sequences that asked
    wanted = [i for i, s in enumerate(sequences) if s.logprobs is not None]
    if wanted:
        observe = _scoring(wanted, scored, observe)
    drawn = draw_rows(model, last, [s.row for s in sequences], report, observe)
    kept = [(i, s) for i, s in enumerate(sequences) if s.accept(int(drawn.token_ids[i]), scored.get(i))]
    return [(s, row_of(drawn, i)) for i, s in kept]


def _scoring(wanted: list[int], scored: dict, observe: Observer | None) -> Observer:
    """An observer that puts log p(drawn token) under softmax(logits) of the rows `wanted` into `scored` (under a
    constraint, of the logits it masked: the constrained distribution), then calls `observe`."""
    def record(rows, logits, drawn):
        rows_logits = [logits[i] if rows[i].last_allowed is None else constrain(logits[i], rows[i].last_allowed)
                       for i in wanted]
        scored.update(zip(wanted, token_logprobs(np.stack(rows_logits), drawn.token_ids[wanted])))
        if observe is not None:
            observe(rows, logits, drawn)

    return record


# ----------------------------------------------------------------------------------------------------------------
# One prompt
# ----------------------------------------------------------------------------------------------------------------


def decode(model, request: Request, context: Context | None = None, rng: np.random.Generator | None = None,
           report: bool = False, observe: Observer | None = None) -> Iterator[Sampled]:
    """The single-sequence loop: prefill the prompt through `context`, then take a draw (stop, length and context
    rules: Sequence.accept) and feed the kept token, until the sequence ends. Yields each kept draw (stop ids are
    not yielded; `observe` sees them).

    context: a Context holding the sequence's cache (a chat's keeps earlier turns, whose common prefix is not run
    again) and its policy past the context; default a fresh "error" one with room for every position this request
    can reach. rng: the sequence's generator (default: seeded from params.seed).
    """
    if context is None:  # not the whole context: a model claiming a huge one still serves a short request (the last
        # token is never fed back, so len(prompt) + max_new_tokens positions suffice)
        room = min(model.config.max_seq_len, len(request.prompt) + max(request.max_new_tokens, 1))
        context = Context(model, "error", capacity=room)
    sequence = Sequence(request, model.config, id=0, slot=0, rng=rng, context=context)
    context.check(request.prompt)
    if sequence.done:
        return
    hidden = context.prefill(request.prompt)  # [1, D]
    while True:
        for _, drawn in take(model, hidden, [sequence], report, observe):
            yield drawn
        if sequence.done:
            return
        hidden = context.feed(sequence.history[-1:])


def generate_ids(model, prompt_ids, max_new_tokens: int, params: SamplingParams,
                 rng: np.random.Generator | None = None) -> Iterator[int]:
    """Yield new token ids one by one (stop tokens are not yielded).

    The last sampled token is yielded without being fed back, so a context of N positions yields up to
    N - len(prompt) + 1 tokens, as llama2.c's run.c does.
    """
    for drawn in generate_steps(model, prompt_ids, max_new_tokens, params, rng):
        yield drawn.token_ids


def generate_steps(model, prompt_ids, max_new_tokens: int, params: SamplingParams,
                   rng: np.random.Generator | None = None) -> Iterator[Sampled]:
    """generate_ids, yielding each step's whole draw. Its log-probability and (params.logprobs = N) the N most
    probable alternatives are computed only when N >= 1; otherwise the step draws the id alone (logprob NaN)."""
    check_request(model.config, prompt_ids, max_new_tokens)
    request = Request(prompt_ids, max_new_tokens, replace(params, stop=()))  # stop strings: the caller's (text)
    return decode(model, request, rng=rng, report=params.logprobs > 0)
