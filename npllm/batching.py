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

All three draw through npllm.generate's step (one forward call, one draw per sequence); ragged and continuous
batching advance Sequences exactly as a lone prompt is generated. Only model.forward(tokens, positions, cache,
slots), model.lm_head(h), model.new_cache(capacity, slots), model.config and cache.reset(slot) are used, so every
backend with that interface batches the same way.

Dimension letters: B sequences in a call, T tokens in a call, D model width, V vocabulary.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from .errors import GenerationError
from .generate import Request, Row, Sequence, advance, check_prompt, step, stop_ids, token_logprobs
from .sampling import Sampled, SamplingParams

STRATEGIES = ("static", "ragged", "continuous")


# ----------------------------------------------------------------------------------------------------------------
# Requests, results, and the accounting of work
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Completion:
    """What a request produced. Log-probabilities are those of the model (log-softmax of the raw logits at
    temperature 1), as Meta's generate reports them, whatever distribution the token was drawn from; under a
    structured-output constraint, of the masked logits (the model renormalised over the allowed tokens)."""

    prompt: tuple[int, ...]
    tokens: list[int]  # new tokens, without the stop token
    logprobs: list[float] | None  # [len(tokens)] when requested
    prompt_logprobs: list[float] | None  # [len(prompt) - 1]: tokens 1.. of the prompt, when requested
    finish_reason: str  # "stop" (a stop id was drawn), "length" (max_new_tokens), "context" (the context is full)
    cached: int = 0  # prompt tokens taken from a prefix cache rather than computed

    @property
    def sampled(self) -> int:
        """Tokens drawn that the result depends on: the returned ones, plus the stop token when there was one."""
        return len(self.tokens) + (self.finish_reason == "stop")


def completion(sequence: Sequence) -> Completion:
    """What a finished (or stopped) sequence produced."""
    return Completion(sequence.request.prompt, list(sequence.tokens), sequence.logprobs, sequence.prompt_logprobs,
                      sequence.finish_reason, sequence.cached)


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
            self.needed_rows += needed_rows(len(c.prompt) - c.cached, c.sampled)
            self.needed_samples += c.sampled


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
    B = len(prompts)
    if B == 0:
        return []
    for p in prompts:
        check_prompt(model.config, p)
    if max_gen_len < 0:
        raise GenerationError(f"max_gen_len must be >= 0, got {max_gen_len}")
    grid = Grid(prompts, min(model.config.max_seq_len, max_gen_len + max(len(p) for p in prompts)), logprobs)
    cache = model.new_cache(grid.total_len, B)
    work = Work() if work is None else work
    rows = [Row(params, None if rngs is None else rngs[b], grid.tokens[b, :0]) for b in range(B)]
    stops = np.array(sorted(stop_ids(model.config)))
    if grid.min_len == grid.total_len:  # every prompt already fills the buffer: nothing to generate, only to score
        h = _forward_grid(model, cache, grid.tokens, 0)  # [B, total_len, D]
        work.steps, work.rows = work.steps + 1, work.rows + B * grid.total_len
        if logprobs:
            grid.logprobs[:, 1:] = _grid_logprobs(_grid_logits(model, h[:, :-1]), grid.tokens[:, 1:])
    ended = np.zeros(B, bool)
    prev_pos = 0
    for cur_pos in range(grid.min_len, grid.total_len):
        forced = _static_step(model, cache, grid, rows, prev_pos, cur_pos)
        work.record([(b, prev_pos, cur_pos - prev_pos, bool(forced[b])) for b in range(B)])
        ended |= ~forced & np.isin(grid.tokens[:, cur_pos], stops)
        prev_pos = cur_pos
        if ended.all():
            break
    completions = [_cut_row(prompts[b], grid.tokens[b], None if grid.logprobs is None else grid.logprobs[b],
                            max_gen_len, stops) for b in range(B)]
    work.count_needed(completions)
    return completions


class Grid:
    """Meta's [B, total_len] token buffer: each prompt written at the start of its row, pad (-1) after it."""

    def __init__(self, prompts: list[list[int]], total_len: int, logprobs: bool):
        lengths = [len(p) for p in prompts]
        self.min_len, self.total_len = min(lengths), total_len
        self.tokens = np.full((len(prompts), total_len), -1, np.int64)  # [B, total_len]
        for b, p in enumerate(prompts):
            self.tokens[b, :len(p)] = p
        self.is_prompt = self.tokens != -1  # [B, total_len]
        self.logprobs = np.zeros((len(prompts), total_len)) if logprobs else None  # log p of each position


def _static_step(model, cache, grid: Grid, rows: list[Row], prev_pos: int, cur_pos: int) -> np.ndarray:
    """Feed every row positions prev_pos .. cur_pos - 1, draw position cur_pos, keep the prompt's token where the
    row's prompt is still running there. Returns which rows were forced.                            # -> [B] bool"""
    B, n = len(rows), cur_pos - prev_pos
    for b, row in enumerate(rows):
        row.history = grid.tokens[b, :cur_pos]  # what the penalties see: the buffer up to the drawn position
    positions = np.tile(np.arange(prev_pos, cur_pos), B)  # [B * n], row-major like the grid block
    slots = np.repeat(np.arange(B), n)
    ends = np.arange(1, B + 1) * n - 1  # each row's last fed token
    hidden, drawn = step(model, cache, grid.tokens[:, prev_pos:cur_pos].reshape(-1), positions, slots, ends, rows)
    forced = grid.is_prompt[:, cur_pos]
    grid.tokens[:, cur_pos] = np.where(forced, grid.tokens[:, cur_pos], drawn.token_ids)
    if grid.logprobs is not None:  # Meta scores every fed position by the token after it
        scored = slice(prev_pos + 1, cur_pos + 1)
        all_logits = _grid_logits(model, hidden.reshape(B, n, -1))  # [B, n, V]
        grid.logprobs[:, scored] = _grid_logprobs(all_logits, grid.tokens[:, scored])
    return forced


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
# Ragged batching
# ----------------------------------------------------------------------------------------------------------------


def ragged_generate(model, requests: list[Request], work: Work | None = None,
                    on_draw: Callable[[int, Sampled], None] | None = None, prefix_cache=None) -> list[Completion]:
    """All prompts prefilled in one forward, then one decode forward per step for every unfinished sequence.

    Sequence i lives in cache slot i. Each slot holds len(prompt) + max_new_tokens positions (at most the
    context), so every sequence attends to exactly what it would attend to alone. on_draw(i, Sampled) sees each
    kept draw of request i (stop ids are not kept), with its log-probability and top alternatives when the
    request's params.logprobs >= 1. prefix_cache (a PrefixCache of this model): each prompt starts from its longest
    cached prefix, and a prompt whose missing prefix an earlier one computes starts one step later, from the cache.
    """
    config = model.config
    if not requests:
        return []
    for r in requests:
        check_prompt(config, r.prompt)
    work = Work() if work is None else work
    capacity = min(config.max_seq_len, max(len(r.prompt) + r.max_new_tokens for r in requests))
    cache = model.new_cache(capacity, len(requests))
    prefix = prefix_cache if prefix_cache is not None and prefix_cache.applies(cache) else None
    sequences = [Sequence(r, config, id=i, slot=i) for i, r in enumerate(requests)]
    report = on_draw is not None and any(r.params.logprobs for r in requests)
    later, running = [s for s in sequences if not s.done], []
    while later or running:
        starting, later = _first_of_each_prefix(prefix, cache, later)
        _restore(prefix, cache, starting)
        for s, drawn in advance(model, cache, starting, running, work, report):
            if on_draw is not None:
                on_draw(s.id, drawn)
        _store(prefix, cache, starting)
        waiting = {s.id for s in later}
        running = [s for s in sequences if not s.done and s.id not in waiting]
    completions = [completion(s) for s in sequences]
    work.count_needed(completions)
    return completions


def _first_of_each_prefix(prefix, cache, sequences: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """(start now, start later): a sequence whose first uncached block an earlier one of this step computes waits
    a step, then restores it (PrefixCache.deferred). Everything starts now without a prefix cache."""
    if prefix is None:
        return sequences, []
    pending: set = set()
    now, later = [], []
    for s in sequences:
        wait = _uses_prefix(s) and prefix.deferred(s.request.prompt, cache, pending)
        (later if wait else now).append(s)
    return now, later


def _uses_prefix(s: Sequence) -> bool:
    """Whether a sequence may start from a cached prefix: not when its every prompt row is to be scored."""
    return not s.request.prompt_logprobs


def _restore(prefix, cache, starting: list[Sequence]) -> None:
    """Each starting sequence's longest cached prefix into its (empty) slot."""
    if prefix is not None:
        for s in starting:
            if _uses_prefix(s):
                s.cached = prefix.restore(cache, s.slot, s.request.prompt)


def _store(prefix, cache, started: list[Sequence]) -> None:
    """The whole blocks of the prompts just prefilled, into the prefix cache (before a finished slot is cleared)."""
    if prefix is not None:
        for s in started:
            prefix.store(cache, s.slot, s.request.prompt)


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
        self.drawn: Sampled | None = None  # the latest kept draw (with log-probabilities when params.logprobs)
        self.clock: dict[str, float] = {}  # time.perf_counter() at "admitted", "first" (prefill done), "finished"

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
    def cached(self) -> int:
        """Prompt tokens taken from the engine's prefix cache (0 before the request starts)."""
        return self.sequence.cached

    def timings(self) -> dict:
        """llama.cpp's `timings` of the request: prompt tokens computed (prompt_n) and the milliseconds from its
        admission to its first token (prompt_ms, which includes the others' work in the same forward), tokens
        kept (predicted_n) and the milliseconds from the first to the end (predicted_ms, up to now while it
        runs: a stop string ends it before the engine does), prompt tokens from the prefix cache (cache_n)."""
        t = self.clock
        admitted, first = t.get("admitted"), t.get("first")
        end = t.get("finished", time.perf_counter())
        prompt_ms = 1000 * (first - admitted) if admitted is not None and first is not None else 0.0
        predicted_ms = 1000 * (end - first) if first is not None else 0.0
        return {"cache_n": self.cached, "prompt_n": len(self.request.prompt) - self.cached,
                "prompt_ms": round(prompt_ms, 3), "predicted_n": len(self.tokens),
                "predicted_ms": round(predicted_ms, 3)}

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
        return completion(self.sequence)


class ContinuousEngine:
    """Continuous batching over a fixed number of cache slots.

        submit(request) -> handle       queue a request (any time, also between steps of a running batch)
        step() -> [(handle, token)]     admit waiting requests into free slots, then one forward: the new
                                        requests' prompts and one token of every running request
        run() -> iterator of (handle, token) until nothing is waiting or running
        cancel(handle) -> bool          end a waiting or running request now ("cancelled"), freeing its slot

    A finished request leaves at once and its slot is cleared for the next waiting one. Requests are admitted in
    the order they were submitted, never overtaking one another, so none starves: each step either admits the
    oldest waiting request or has no room for it, and every running request frees its slot within max_new_tokens
    steps. max_step_tokens caps the tokens of one forward (new prompts + one per running request) so that a burst
    of long prompts does not stall the running ones; a prompt longer than the cap runs once nothing else does.
    Each slot keeps the whole context, so a request computes exactly what it would compute alone.

    prefix_cache (a PrefixCache of this model, npllm.prefix_cache): a request starts from the longest cached prefix of
    its prompt and prefills only the rest; each prefill stores its whole blocks. A request whose first uncached
    block is being computed by one admitted in the same step waits for the next step (keeping its place in the
    queue), and then takes it from the cache. Off (None) by default, and on backends whose cache is not a host ring.

    submit, step and cancel may be called from several threads: one lock makes each of them whole (a step's
    forward runs under it, so a submit or cancel from another thread waits for the step to end, never lands
    inside it). A request with params.logprobs >= 1 makes the step report draws (sample_step); its handle's
    `drawn` then holds the latest token's log-probability and alternatives.
    """

    def __init__(self, model, slots: int = 8, max_step_tokens: int | None = None, work: Work | None = None,
                 prefix_cache=None):
        if slots <= 0:
            raise GenerationError(f"slots must be positive, got {slots}")
        if max_step_tokens is not None and max_step_tokens <= 0:
            raise GenerationError(f"max_step_tokens must be positive or None, got {max_step_tokens}")
        self.model = model
        self.slots, self.max_step_tokens = slots, max_step_tokens
        self.cache = model.new_cache(None, slots)
        if prefix_cache is not None and prefix_cache.model is not model:
            raise GenerationError("the prefix cache belongs to another model")
        self.prefix = prefix_cache if prefix_cache is not None and prefix_cache.applies(self.cache) else None
        self.free = deque(range(slots))
        self.waiting: deque[Handle] = deque()
        self.running: list[Handle] = []
        self.steps = 0
        self.submitted = 0
        self.work = Work() if work is None else work
        self.lock = threading.RLock()  # reentrant: an on_token callback may submit or cancel

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, request: Request, on_token: Callable[[Handle, int], None] | None = None) -> Handle:
        """Queue a request; on_token(handle, token) is called for each of its tokens as it is produced."""
        check_prompt(self.model.config, request.prompt)
        with self.lock:
            handle = Handle(self, Sequence(request, self.model.config, id=self.submitted), on_token)
            self.submitted += 1
            if not handle.done:  # max_new_tokens == 0 needs no forward
                self.waiting.append(handle)
            return handle

    def step(self) -> list[tuple[Handle, int]]:
        with self.lock:
            return self._step()

    def cancel(self, handle: Handle) -> bool:
        """End a request that is waiting or running: it leaves the queue or frees its slot at once, keeps the tokens
        it has, and finishes with reason "cancelled". False (and nothing changes) when it had already finished."""
        with self.lock:
            if handle.done:
                return False
            handle.sequence.finish_reason = "cancelled"
            if handle in self.waiting:
                self.waiting.remove(handle)
                handle.finished_at = self.steps
            else:  # running, or admitted by a step that raised before it joined `running`
                if handle in self.running:
                    self.running.remove(handle)
                self._release(handle)
            return True

    def _step(self) -> list[tuple[Handle, int]]:
        starting = self._admit()
        if not starting and not self.running:
            return []
        handles = {h.sequence.id: h for h in starting + self.running}
        report = any(h.sequence.row.params.logprobs for h in handles.values())
        kept = advance(self.model, self.cache, [h.sequence for h in starting], [h.sequence for h in self.running],
                       self.work, report=report)
        _store(self.prefix, self.cache, [h.sequence for h in starting])
        now = time.perf_counter()
        for h in starting:
            h.clock["first"] = now
        self.steps += 1
        self.running = starting + self.running
        for h in [h for h in self.running if h.done]:
            self._release(h)
        self.running = [h for h in self.running if not h.done]
        events = [(handles[s.id], drawn) for s, drawn in kept]
        for h, drawn in events:
            h.drawn = drawn
            if h.on_token is not None:
                h.on_token(h, drawn.token_ids)
        return [(h, drawn.token_ids) for h, drawn in events]

    def run(self) -> Iterator[tuple[Handle, int]]:
        while self.busy:
            yield from self.step()

    def _admit(self) -> list[Handle]:
        """Move the oldest waiting requests into free slots while the step's token budget allows."""
        budget = self.max_step_tokens
        used = len(self.running)
        admitted: list[Handle] = []
        pending: set = set()  # prefix blocks the admitted requests compute in this step
        while self.waiting and self.free:
            s = self.waiting[0].sequence
            cost = len(s.history)
            alone = not admitted and not self.running
            if budget is not None and used + cost > budget and not alone:
                break  # the oldest waits for room; nothing younger may overtake it
            if self.prefix is not None and _uses_prefix(s) and self.prefix.deferred(s.request.prompt, self.cache,
                                                                                    pending):
                break  # its prefix is being computed in this step: next step it is cached (and nobody overtakes)
            h = self.waiting.popleft()
            s.slot = self.free.popleft()
            h.started_at, h.clock["admitted"] = self.steps, time.perf_counter()
            admitted.append(h)
            used += cost
        _restore(self.prefix, self.cache, [h.sequence for h in admitted])
        return admitted

    def _release(self, h: Handle) -> None:
        self.cache.reset(h.sequence.slot)
        self.free.append(h.sequence.slot)
        h.finished_at, h.clock["finished"] = self.steps, time.perf_counter()
        self.work.count_needed([completion(h.sequence)])


def continuous_generate(model, requests: list[Request], slots: int | None = None,
                        work: Work | None = None, prefix_cache=None) -> list[Completion]:
    """Run requests through a ContinuousEngine (all submitted at once) and return their completions in order."""
    engine = ContinuousEngine(model, slots=slots or max(1, len(requests)), work=work, prefix_cache=prefix_cache)
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
