"""Batched generation: many sequences through one model, one read of the weights per step for all of them.

One decode step of one sequence is vector-matrix work: every weight matrix is read from memory to serve a single
token. With B sequences the same read serves B tokens ([B, D] @ [D, N] instead of [1, D] @ [D, N]), so tokens per
second grow with B until arithmetic, not memory traffic, is the limit. The three strategies differ in what they
put into each forward call:

    static      Meta's reference generate(): a [B, total_len] token buffer; every row starts decoding at the
                shortest prompt's length, and a row whose prompt is longer has its own prompt token written over
                the sampled one, one position per step. Every row runs until the last one ends. Kept as the
                teaching version, with a count of what it wastes.
    ragged      every prompt prefilled in full in one forward (prompts concatenated, each token with its own
                position and cache slot), then all sequences decode together, each at its own position; a finished
                sequence leaves the batch. Nothing is computed that the outputs do not use.
    continuous  ContinuousEngine: a fixed number of cache slots; requests join the running batch at any step
                (their prompt is prefilled in the same forward as the others' decode tokens), leave when done,
                and their slot is reused.

docs/batching.md draws what each one computes at each step.

Only model.forward(tokens, positions, cache, slots), model.lm_head(h), model.new_cache(capacity, slots),
model.config and cache.reset(slot) are used, so every backend with that interface batches the same way.

Dimension letters: B sequences in a call, T tokens in a call, D model width, V vocabulary.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from .errors import GenerationError
from .generate import check_prompt, stop_ids
from .sampling import SamplingParams, log_softmax, sample_with

STRATEGIES = ("static", "ragged", "continuous")


# ----------------------------------------------------------------------------------------------------------------
# Requests, results, and the accounting of work
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One generation job: a prompt (token ids), how to sample, and when to stop.

    The request's generator is seeded with params.seed, so its draws are the same whatever else runs beside it.
    Generation ends at a model stop id or one of `stop_ids` (neither is returned), after `max_new_tokens`, or when
    the context is full, exactly as npllm.generate.generate_ids does for one prompt.
    """

    prompt: tuple[int, ...]
    max_new_tokens: int = 256
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()  # ends the generation besides the model's own stop ids
    logprobs: bool = False  # record log p(token | everything before it) of each new token
    prompt_logprobs: bool = False  # ... and of each prompt token after the first

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


@dataclass
class Completion:
    """What a request produced. Log-probabilities are those of the model (log-softmax of the raw logits at
    temperature 1), as Meta's generate reports them, whatever distribution the token was drawn from."""

    prompt: tuple[int, ...]
    tokens: list[int]  # new tokens, without the stop token
    logprobs: list[float] | None  # [len(tokens)] when requested
    prompt_logprobs: list[float] | None  # [len(prompt) - 1]: tokens 1.. of the prompt, when requested
    finish_reason: str  # "stop" (a stop id was drawn), "length" (max_new_tokens), "context" (the context is full)

    @property
    def sampled(self) -> int:
        """Tokens drawn that the result depends on: the returned ones, plus the stop token when there was one."""
        return len(self.tokens) + (self.finish_reason == "stop")


def needed_rows(prompt_len: int, sampled: int) -> int:
    """Token-positions a sequence needs computed: its prompt and every drawn token but the last (the last one is
    never fed back), i.e. positions 0 .. prompt_len + sampled - 2. Nothing at all when nothing was drawn."""
    return prompt_len + sampled - 1 if sampled else 0


@dataclass
class Work:
    """What a strategy computed, against what its outputs needed.

    A row is one token-position (one token of one sequence) pushed through every layer; a sample is one
    next-token prediction (a row through lm_head) that was drawn from. Rows or samples beyond what the outputs
    need are wasted: static batching computes rows past a sequence's end and draws predictions that a prompt token
    then overwrites. With `log` set to a list, every forward call appends its entries
    (sequence, first position, tokens fed, forced) — forced: the drawn token was overwritten by a prompt token.
    """

    steps: int = 0  # forward calls
    rows: int = 0
    samples: int = 0
    needed_rows: int = 0
    needed_samples: int = 0
    log: list | None = None

    @property
    def wasted_rows(self) -> int:
        return self.rows - self.needed_rows

    @property
    def wasted_samples(self) -> int:
        return self.samples - self.needed_samples

    def record(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One forward call feeding `entries` and drawing one prediction for each."""
        self.steps += 1
        self.rows += sum(n for _, _, n, _ in entries)
        self.samples += len(entries)
        if self.log is not None:
            self.log.append(entries)

    def count_needed(self, completions: list[Completion]) -> None:
        for c in completions:
            self.needed_rows += needed_rows(len(c.prompt), c.sampled)
            self.needed_samples += c.sampled


def token_logprobs(logits: np.ndarray, ids) -> np.ndarray:
    """log p(ids[t]) under softmax(logits[t]), in float64.   # [T, V], [T] -> [T]"""
    if len(logits) == 0:
        return np.zeros(0)
    logp = log_softmax(np.asarray(logits, dtype=np.float64))  # [T, V]
    return logp[np.arange(len(logp)), np.asarray(ids, dtype=np.int64)]


# ----------------------------------------------------------------------------------------------------------------
# Static batching: Meta's generate() loop
# ----------------------------------------------------------------------------------------------------------------


def static_generate(model, prompts: list[list[int]], max_gen_len: int, params: SamplingParams, rngs=None,
                    logprobs: bool = False, work: Work | None = None) -> list[Completion]:
    """Meta's reference batching, step for step.

        total_len = min(max_seq_len, max_gen_len + max_prompt_len);   tokens = [B, total_len] buffer of pad
        for cur_pos in min_prompt_len .. total_len - 1:
            logits = forward(tokens[:, prev_pos:cur_pos])             # the first call is a prefill of
            next = sample(logits[:, -1])                              # min_prompt_len tokens, then one per row
            next = tokens[:, cur_pos] where that position is still prompt, else next
            tokens[:, cur_pos] = next;   prev_pos = cur_pos;   stop when every row has drawn a stop id

    Every row is fed every position up to where the loop stops, so rows whose output is complete keep computing
    (wasted rows), and rows whose prompt is longer than min_prompt_len are fed their prompt one token per step, each
    step drawing a prediction that the prompt token then overwrites (wasted samples). Each row is cut to
    len(prompt) + max_gen_len and at its first stop id. rngs holds one generator per row (None when greedy);
    logprobs also computes, as Meta does, the log-probability of every buffer position after the first.
    """
    config = model.config
    B = len(prompts)
    if B == 0:
        return []
    for p in prompts:
        check_prompt(config, p)
    if max_gen_len < 0:
        raise GenerationError(f"max_gen_len must be >= 0, got {max_gen_len}")
    lengths = np.array([len(p) for p in prompts])
    min_len, max_len = int(lengths.min()), int(lengths.max())
    total_len = min(config.max_seq_len, max_gen_len + max_len)
    pad = -1
    tokens = np.full((B, total_len), pad, np.int64)  # [B, total_len]
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    is_prompt = tokens != pad  # [B, total_len]
    buffer_logprobs = np.zeros((B, total_len)) if logprobs else None
    stops = np.array(sorted(stop_ids(config)))
    ended = np.zeros(B, bool)
    cache = model.new_cache(total_len, B)
    work = Work() if work is None else work

    if min_len == total_len:  # every prompt already fills the buffer: nothing to generate, only to score
        h = _forward_grid(model, cache, tokens, 0)  # [B, total_len, D]
        work.steps, work.rows = work.steps + 1, work.rows + B * total_len
        if logprobs:
            buffer_logprobs[:, 1:] = _grid_logprobs(_grid_logits(model, h[:, :-1]), tokens[:, 1:])
    prev_pos = 0
    for cur_pos in range(min_len, total_len):
        h = _forward_grid(model, cache, tokens[:, prev_pos:cur_pos], prev_pos)  # [B, n, D]
        all_logits = _grid_logits(model, h) if logprobs else None  # [B, n, V]: Meta scores every position
        logits = all_logits[:, -1] if logprobs else model.lm_head(h[:, -1])  # [B, V]
        drawn = sample_with(params, logits, rngs, [row[:cur_pos] for row in tokens])  # [B]
        forced = is_prompt[:, cur_pos]
        tokens[:, cur_pos] = np.where(forced, tokens[:, cur_pos], drawn)
        if logprobs:
            scored = slice(prev_pos + 1, cur_pos + 1)  # each fed position scores the token after it
            buffer_logprobs[:, scored] = _grid_logprobs(all_logits, tokens[:, scored])
        work.record([(b, prev_pos, cur_pos - prev_pos, bool(forced[b])) for b in range(B)])
        ended |= ~forced & np.isin(tokens[:, cur_pos], stops)
        prev_pos = cur_pos
        if ended.all():
            break

    completions = [_cut_row(prompts[b], tokens[b], None if buffer_logprobs is None else buffer_logprobs[b],
                            max_gen_len, stops) for b in range(B)]
    work.count_needed(completions)
    return completions


def _forward_grid(model, cache, grid: np.ndarray, start: int) -> np.ndarray:
    """Forward a [B, n] block of tokens at positions start .. start + n - 1, row b in cache slot b.  # -> [B, n, D]"""
    B, n = grid.shape
    positions = np.tile(np.arange(start, start + n), B)  # [B * n], row-major like grid.reshape(-1)
    slots = np.repeat(np.arange(B), n)
    return model.forward(grid.reshape(-1), positions, cache, slots).reshape(B, n, -1)


def _grid_logits(model, h: np.ndarray) -> np.ndarray:
    """lm_head over a block of hidden states.                                      # [B, n, D] -> [B, n, V]"""
    B, n, D = h.shape
    return model.lm_head(h.reshape(B * n, D)).reshape(B, n, -1)


def _grid_logprobs(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(targets[b, i]) under softmax(logits[b, i]): Meta's -cross_entropy.   # [B, n, V], [B, n] -> [B, n]"""
    B, n, V = logits.shape
    return token_logprobs(logits.reshape(B * n, V), targets.reshape(-1)).reshape(B, n)


def _cut_row(prompt, row: np.ndarray, row_logprobs, max_gen_len: int, stops: np.ndarray) -> Completion:
    """Meta's post-processing of one buffer row: keep len(prompt) + max_gen_len positions, cut at the first stop id.

    Meta also cuts at a stop id inside the prompt when echoing it; only the generated part is searched here, since
    llama2.c checkpoints start every prompt with BOS, which is one of their stop ids.
    """
    P = len(prompt)
    new = [int(t) for t in row[P:P + max_gen_len]]
    hits = [i for i, t in enumerate(new) if t in stops]
    if hits:
        new, reason = new[:hits[0]], "stop"
    else:
        reason = "length" if len(new) == max_gen_len else "context"
    lp = None if row_logprobs is None else [float(x) for x in row_logprobs[P:P + len(new)]]
    prompt_lp = None if row_logprobs is None else [float(x) for x in row_logprobs[1:P]]
    return Completion(tuple(int(t) for t in prompt), new, lp, prompt_lp, reason)


# ----------------------------------------------------------------------------------------------------------------
# Sequences and the shared step of ragged and continuous batching
# ----------------------------------------------------------------------------------------------------------------


class Sequence:
    """A request being generated: its history (prompt + new tokens), its own generator, its cache slot."""

    def __init__(self, request: Request, config, id: int, slot: int | None = None):
        self.request, self.id, self.slot = request, id, slot
        self.history = list(request.prompt)
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = [] if request.logprobs else None
        self.prompt_logprobs: list[float] | None = None
        self.rng = np.random.default_rng(request.params.seed)
        # Rows that share everything but the seed are drawn in one call (each with its own generator).
        self.shared_params = replace(request.params, seed=None)
        self.stops = stop_ids(config) | request.stop_ids
        self.max_seq_len = config.max_seq_len
        self.finish_reason: str | None = None if request.max_new_tokens > 0 else "length"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token: int, logprob: float | None) -> bool:
        """Take a drawn token; False when it is a stop id (which ends the sequence and is not kept)."""
        if token in self.stops:
            self.finish_reason = "stop"
            return False
        self.tokens.append(token)
        self.history.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if len(self.tokens) == self.request.max_new_tokens:
            self.finish_reason = "length"
        elif len(self.history) - 1 >= self.max_seq_len:  # its position is outside the context: it cannot be fed
            self.finish_reason = "context"
        return True

    def completion(self) -> Completion:
        return Completion(self.request.prompt, list(self.tokens), self.logprobs, self.prompt_logprobs,
                          self.finish_reason)


def choose(sequences: list[Sequence], logits: np.ndarray) -> tuple[np.ndarray, list[float | None]]:
    """One token per row, row i drawn for sequences[i].                            # [B, V] -> [B] ids, [B] logprobs

    Rows whose sampling parameters agree (seeds aside) are drawn in one sample_with call, each row from its own
    generator and history, so a row's draw never depends on its neighbours.
    """
    ids = np.empty(len(sequences), np.int64)
    groups: dict[SamplingParams, list[int]] = {}
    for i, s in enumerate(sequences):
        groups.setdefault(s.shared_params, []).append(i)
    for params, rows in groups.items():
        ids[rows] = sample_with(params, logits[rows], [sequences[i].rng for i in rows],
                                [sequences[i].history for i in rows])
    logprobs: list[float | None] = [None] * len(sequences)
    wanted = [i for i, s in enumerate(sequences) if s.logprobs is not None]
    if wanted:
        for i, lp in zip(wanted, token_logprobs(logits[wanted], ids[wanted])):
            logprobs[i] = float(lp)
    return ids, logprobs


def advance(model, cache, starting: list[Sequence], running: list[Sequence], work: Work) -> list[tuple[Sequence, int]]:
    """One forward call: the whole prompt of each starting sequence, the last token of each running one; then one
    drawn token for each. Returns the (sequence, token) pairs kept (stop ids end a sequence and are not returned).

        tokens    = prompt_1 ++ ... ++ prompt_m ++ [last_1, ..., last_r]                   # [T]
        positions = 0..len_1-1 ++ ... ++ [len(history_1) - 1, ...]                         # [T]
        slots     = each token's sequence slot                                             # [T]
        hidden    = forward(tokens, positions, slots)                                      # [T, D]
        logits    = lm_head(hidden at each sequence's last row)                            # [m + r, V]

    Attention runs per slot, so no sequence sees another's keys and no padding is computed.
    """
    sequences = starting + running
    feeds = [s.history for s in starting] + [s.history[-1:] for s in running]
    firsts = [0] * len(starting) + [len(s.history) - 1 for s in running]
    sizes = np.array([len(f) for f in feeds])
    tokens = np.concatenate([np.asarray(f, np.int64) for f in feeds])  # [T]
    positions = np.concatenate([np.arange(a, a + n) for a, n in zip(firsts, sizes)])  # [T]
    slots = np.repeat([s.slot for s in sequences], sizes)  # [T]
    hidden = model.forward(tokens, positions, cache, slots)  # [T, D]
    ends = np.cumsum(sizes) - 1
    for s, end, n in zip(starting, ends, sizes):
        if s.request.prompt_logprobs:  # rows 0 .. n-2 of the prompt predict prompt tokens 1 .. n-1
            s.prompt_logprobs = [float(x) for x in token_logprobs(model.lm_head(hidden[end - n + 1:end]),
                                                                  s.history[1:n])]
    ids, logprobs = choose(sequences, model.lm_head(hidden[ends]))  # [m + r, V] -> [m + r]
    work.record([(s.id, a, int(n), False) for s, a, n in zip(sequences, firsts, sizes)])
    return [(s, int(t)) for s, t, lp in zip(sequences, ids, logprobs) if s.accept(int(t), lp)]


# ----------------------------------------------------------------------------------------------------------------
# Ragged batching
# ----------------------------------------------------------------------------------------------------------------


def ragged_generate(model, requests: list[Request], work: Work | None = None) -> list[Completion]:
    """All prompts prefilled in one forward, then one decode forward per step for every unfinished sequence.

    Sequence i lives in cache slot i. Each slot holds len(prompt) + max_new_tokens positions (at most the
    context), so every sequence attends to exactly what it would attend to alone.
    """
    config = model.config
    if not requests:
        return []
    for r in requests:
        check_prompt(config, r.prompt)
    work = Work() if work is None else work
    capacity = min(config.max_seq_len, max(len(r.prompt) + r.max_new_tokens for r in requests))
    cache = model.new_cache(capacity, len(requests))
    sequences = [Sequence(r, config, id=i, slot=i) for i, r in enumerate(requests)]
    starting = [s for s in sequences if not s.done]
    if starting:
        advance(model, cache, starting, [], work)
    while running := [s for s in sequences if not s.done]:
        advance(model, cache, [], running, work)
    completions = [s.completion() for s in sequences]
    work.count_needed(completions)
    return completions


# ----------------------------------------------------------------------------------------------------------------
# Continuous batching
# ----------------------------------------------------------------------------------------------------------------


class Handle:
    """A submitted request, as the caller sees it: tokens so far, whether it is done, and when things happened.

    Iterating a handle streams its tokens, stepping the engine whenever it has none new (so a single caller can
    drive the engine through one handle; the other requests advance too).
    """

    def __init__(self, engine: ContinuousEngine, sequence: Sequence, on_token: Callable | None):
        self.engine, self.sequence, self.on_token = engine, sequence, on_token
        self.submitted_at = engine.steps  # engine step counts at each event
        self.started_at: int | None = None
        self.finished_at: int | None = engine.steps if sequence.done else None

    @property
    def id(self) -> int:
        return self.sequence.id

    @property
    def request(self) -> Request:
        return self.sequence.request

    @property
    def slot(self) -> int | None:
        """The cache slot the request runs (or ran) in; None before it starts."""
        return self.sequence.slot

    @property
    def tokens(self) -> list[int]:
        return self.sequence.tokens

    @property
    def done(self) -> bool:
        return self.sequence.done

    @property
    def finish_reason(self) -> str | None:
        return self.sequence.finish_reason

    def __iter__(self) -> Iterator[int]:
        seen = 0
        while True:
            while seen < len(self.sequence.tokens):
                seen += 1
                yield self.sequence.tokens[seen - 1]
            if self.done:
                return
            self.engine.step()

    def result(self) -> Completion:
        """Step the engine until this request is done; its completion."""
        while not self.done:
            self.engine.step()
        return self.sequence.completion()


class ContinuousEngine:
    """Continuous batching over a fixed number of cache slots.

        submit(request) -> handle       queue a request (any time, also between steps of a running batch)
        step() -> [(handle, token)]     admit waiting requests into free slots, then one forward: the new
                                        requests' prompts and one token of every running request
        run() -> iterator of (handle, token) until nothing is waiting or running

    A finished request leaves at once and its slot is cleared for the next waiting one. Requests are admitted in
    the order they were submitted, never overtaking one another, so none starves: each step either admits the
    oldest waiting request or has no room for it, and every running request frees its slot within max_new_tokens
    steps. max_step_tokens caps the tokens of one forward (new prompts + one per running request) so that a burst
    of long prompts does not stall the running ones; a prompt longer than the cap runs once nothing else does.
    Each slot keeps the whole context, so a request computes exactly what it would compute alone.
    """

    def __init__(self, model, slots: int = 8, max_step_tokens: int | None = None, work: Work | None = None):
        if slots <= 0:
            raise GenerationError(f"slots must be positive, got {slots}")
        if max_step_tokens is not None and max_step_tokens <= 0:
            raise GenerationError(f"max_step_tokens must be positive or None, got {max_step_tokens}")
        self.model = model
        self.slots, self.max_step_tokens = slots, max_step_tokens
        self.cache = model.new_cache(None, slots)
        self.free = deque(range(slots))
        self.waiting: deque[Handle] = deque()
        self.running: list[Handle] = []
        self.steps = 0
        self.submitted = 0
        self.work = Work() if work is None else work

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, request: Request, on_token: Callable[[Handle, int], None] | None = None) -> Handle:
        """Queue a request; on_token(handle, token) is called for each of its tokens as it is produced."""
        check_prompt(self.model.config, request.prompt)
        handle = Handle(self, Sequence(request, self.model.config, id=self.submitted), on_token)
        self.submitted += 1
        if not handle.done:  # max_new_tokens == 0 needs no forward
            self.waiting.append(handle)
        return handle

    def step(self) -> list[tuple[Handle, int]]:
        starting = self._admit()
        if not starting and not self.running:
            return []
        handles = {h.sequence.id: h for h in starting + self.running}
        kept = advance(self.model, self.cache, [h.sequence for h in starting], [h.sequence for h in self.running],
                       self.work)
        self.steps += 1
        self.running = starting + self.running
        for h in [h for h in self.running if h.done]:
            self._release(h)
        self.running = [h for h in self.running if not h.done]
        events = [(handles[s.id], t) for s, t in kept]
        for h, t in events:
            if h.on_token is not None:
                h.on_token(h, t)
        return events

    def run(self) -> Iterator[tuple[Handle, int]]:
        while self.busy:
            yield from self.step()

    def _admit(self) -> list[Handle]:
        """Move the oldest waiting requests into free slots while the step's token budget allows."""
        budget = self.max_step_tokens
        used = len(self.running)
        admitted: list[Handle] = []
        while self.waiting and self.free:
            cost = len(self.waiting[0].sequence.history)
            alone = not admitted and not self.running
            if budget is not None and used + cost > budget and not alone:
                break  # the oldest waits for room; nothing younger may overtake it
            h = self.waiting.popleft()
            h.sequence.slot = self.free.popleft()
            h.started_at = self.steps
            admitted.append(h)
            used += cost
        return admitted

    def _release(self, h: Handle) -> None:
        self.cache.reset(h.sequence.slot)
        self.free.append(h.sequence.slot)
        h.finished_at = self.steps
        self.work.count_needed([h.sequence.completion()])


def continuous_generate(model, requests: list[Request], slots: int | None = None,
                        work: Work | None = None) -> list[Completion]:
    """Run requests through a ContinuousEngine (all submitted at once) and return their completions in order."""
    engine = ContinuousEngine(model, slots=slots or max(1, len(requests)), work=work)
    handles = [engine.submit(r) for r in requests]
    for _ in engine.run():
        pass
    return [h.result() for h in handles]


# ----------------------------------------------------------------------------------------------------------------
# Meta's generate() interface over the three strategies
# ----------------------------------------------------------------------------------------------------------------


def generate_tokens(model, prompt_tokens: list[list[int]], max_gen_len: int, temperature: float = 0.6,
                    top_p: float = 0.9, logprobs: bool = False, echo: bool = False, strategy: str = "ragged",
                    seed: int | None = None) -> tuple[list[list[int]], list[list[float]] | None]:
    """Meta's generate(): for each prompt, its new tokens cut at the first stop id (with echo, the prompt first),
    and with logprobs the chosen tokens' log-probabilities (with echo, the prompt's too, 0.0 for its first token).

    Each sequence generates at most min(max_gen_len, max_seq_len - len(prompt)) tokens. Every row's generator is
    seeded with `seed`, so under ragged and continuous batching a prompt gets the tokens it would get alone (under
    static batching the draws also depend on the shortest prompt: Meta's algorithm draws, and throws away, a token
    at every forced prompt position).
    """
    if strategy not in STRATEGIES:
        raise GenerationError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if max_gen_len < 0:
        raise GenerationError(f"max_gen_len must be >= 0, got {max_gen_len}")
    prompts = [[int(t) for t in p] for p in prompt_tokens]
    config = model.config
    for p in prompts:
        check_prompt(config, p)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    if strategy == "static":
        rngs = [np.random.default_rng(seed) for _ in prompts]
        completions = static_generate(model, prompts, max_gen_len, params, rngs, logprobs)
    else:
        requests = [Request(p, min(max_gen_len, config.max_seq_len - len(p)), params, logprobs=logprobs,
                            prompt_logprobs=logprobs and echo) for p in prompts]
        run = ragged_generate if strategy == "ragged" else continuous_generate
        completions = run(model, requests)
    out_tokens = [(list(c.prompt) if echo else []) + c.tokens for c in completions]
    if not logprobs:
        return out_tokens, None
    return out_tokens, [([0.0] + c.prompt_logprobs if echo else []) + c.logprobs for c in completions]
