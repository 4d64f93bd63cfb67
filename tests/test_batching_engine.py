"""Continuous batching: requests join at any step, leave when done, reuse slots, and never starve."""

import itertools
from collections import defaultdict

import numpy as np
import pytest

import npllm
from npllm.batching import ContinuousEngine, Request
from npllm.config import ModelConfig
from npllm.errors import GenerationError
from npllm.formats.random import random_weights
from npllm.generate import generate_ids
from npllm.models.reference import Transformer
from npllm.sampling import SamplingParams, log_softmax


@pytest.fixture(scope="module")
def llm(stories260k):
    return npllm.load(stories260k)


@pytest.fixture(scope="module")
def story_ids(llm, golden_200):
    return llm.tokenizer.encode(golden_200, bos=True)


def tiny_model(max_seq_len=64, eos_ids=(2,)):
    """A small random model in float64 (fast; its arithmetic leaves no near-ties to chance)."""
    config = ModelConfig(dim=16, hidden_dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32,
                         max_seq_len=max_seq_len, eos_ids=eos_ids)
    return Transformer(config, random_weights(config, seed=3, dtype=np.float64))


def solo(model, request: Request) -> tuple[list[int], str]:
    """What the request produces alone: the single-sequence loop, cut at the request's own stop ids."""
    out = list(generate_ids(model, list(request.prompt), request.max_new_tokens, request.params))
    hits = [i for i, t in enumerate(out) if t in request.stop_ids]
    if hits:
        return out[:hits[0]], "stop"
    if len(out) == request.max_new_tokens:
        return out, "length"
    return out, "stop" if len(request.prompt) + len(out) <= model.config.max_seq_len else "context"


def mixed_requests(story_ids, n, seed=0):
    """n requests with different prompt lengths, sampling settings, seeds, token limits and stop ids."""
    rng = np.random.default_rng(seed)
    ids, counts = np.unique(story_ids, return_counts=True)
    common = [int(t) for t in ids[np.argsort(-counts)][:40]]  # the 40 most frequent tokens
    settings = [dict(temperature=0), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=30),
                dict(temperature=1.1, min_p=0.05, repetition_penalty=1.2)]
    requests = []
    for i in range(n):
        length = int(rng.integers(1, 90))
        start = int(rng.integers(1, len(story_ids) - length))
        prompt = [1] + story_ids[start:start + length - 1]
        stops = frozenset(int(t) for t in rng.choice(common, 2)) if i % 3 == 0 else frozenset()
        params = SamplingParams(seed=1000 + i, **settings[i % len(settings)])
        requests.append(Request(prompt, int(rng.integers(1, 36)), params, stop_ids=stops, logprobs=i % 5 == 0))
    return requests


def test_64_staggered_requests_complete_with_their_solo_outputs(llm, story_ids):
    requests = mixed_requests(story_ids, 64)
    arrivals = np.sort(np.random.default_rng(1).integers(0, 150, len(requests)))  # request i arrives at arrivals[i]
    slots = 8
    engine = ContinuousEngine(llm.model, slots=slots, max_step_tokens=160)
    streamed = defaultdict(list)
    handles, waiting_ahead = [], []
    for clock in itertools.count():
        while len(handles) < len(requests) and arrivals[len(handles)] <= clock:
            waiting_ahead.append(len(engine.waiting))
            handles.append(engine.submit(requests[len(handles)], on_token=lambda h, t: streamed[h.id].append(t)))
        engine.step()
        if len(handles) == len(requests) and not engine.busy:
            break

    for h, request in zip(handles, requests):
        tokens, reason = solo(llm.model, request)
        completion = h.result()
        assert (completion.tokens, completion.finish_reason) == (tokens, reason), f"request {h.id}"
        assert streamed[h.id] == tokens
        if request.logprobs:
            seq = list(request.prompt) + tokens
            ref = log_softmax(llm.logits(seq).astype(np.float64))[np.arange(len(seq) - 1), seq[1:]]
            np.testing.assert_allclose(completion.logprobs, ref[len(request.prompt) - 1:], rtol=0, atol=1e-4)

    # Slots: 64 requests through 8 slots, every slot reused, never two requests in one slot at once.
    by_slot = defaultdict(list)
    for h in handles:
        by_slot[h.slot].append((h.started_at, h.finished_at))
    assert sorted(by_slot) == list(range(slots))
    assert all(len(spans) >= 2 for spans in by_slot.values())
    for spans in by_slot.values():
        spans.sort()
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))

    # No starvation: admitted in arrival order, each within the rounds that the requests ahead of it need.
    started = [h.started_at for h in handles]
    assert started == sorted(started)
    longest = max(r.max_new_tokens for r in requests)
    for h, ahead in zip(handles, waiting_ahead):
        assert h.started_at - h.submitted_at <= (ahead // slots + 2) * longest
    assert engine.work.wasted_rows == 0 and engine.work.wasted_samples == 0


def test_a_long_prompt_over_the_token_budget_is_not_overtaken():
    """Short requests keep arriving; a prompt longer than the step budget waits for the running ones to drain, and
    no request submitted after it starts before it."""
    model = tiny_model()
    engine = ContinuousEngine(model, slots=4, max_step_tokens=12)
    greedy = SamplingParams(temperature=0)
    first = [engine.submit(Request([1, 5, 6], 8, greedy)) for _ in range(3)]
    engine.step()
    long = engine.submit(Request([1] + list(range(3, 30)), 4, greedy))
    later = []
    for _ in range(40):
        later.append(engine.submit(Request([1, 7], 3, greedy)))
        engine.step()
    for _ in engine.run():
        pass
    assert long.done and long.tokens == solo(model, long.request)[0]
    assert all(h.done for h in first + later)
    assert all(h.started_at >= long.started_at for h in later)
    assert long.started_at <= 1 + max(h.finished_at for h in first)


def test_streaming_by_iteration_callback_and_events():
    model = tiny_model()
    engine = ContinuousEngine(model, slots=2)
    requests = [Request([1, 4 + i, 9], 10 + i, SamplingParams(temperature=1.0, seed=i)) for i in range(5)]
    seen = defaultdict(list)
    handles = [engine.submit(r, on_token=lambda h, t: seen[h.id].append(t)) for r in requests]
    streamed = list(handles[3])  # iterating one handle drives the engine for everyone
    assert handles[3].done and not handles[4].done
    before = {h.id: len(h.tokens) for h in handles}
    events = defaultdict(list)
    for h, t in engine.run():
        events[h.id].append(t)
    for h in handles:
        assert h.tokens == solo(model, h.request)[0] == seen[h.id]
        assert events[h.id] == h.tokens[before[h.id]:]
    assert streamed == handles[3].tokens


def test_a_request_submitted_from_a_callback_joins_the_running_batch():
    model = tiny_model()
    engine = ContinuousEngine(model, slots=3)
    greedy = SamplingParams(temperature=0)
    joined = []

    def on_token(handle, token):
        if len(handle.tokens) == 4 and not joined:
            joined.append(engine.submit(Request([1, 11, 12, 13], 6, greedy)))

    first = engine.submit(Request([1, 3], 12, greedy), on_token=on_token)
    for _ in engine.run():
        pass
    (late,) = joined
    assert first.started_at < late.started_at < first.finished_at  # it ran beside the first one
    assert late.tokens == solo(model, late.request)[0] and first.tokens == solo(model, first.request)[0]


def test_zero_token_requests_finish_without_a_slot_and_bad_input_raises():
    model = tiny_model()
    engine = ContinuousEngine(model, slots=1)
    h = engine.submit(Request([1, 2, 3], 0))
    assert h.done and h.result().tokens == [] and not engine.busy and engine.work.rows == 0
    with pytest.raises(GenerationError, match="no tokens"):
        engine.submit(Request([], 4))
    with pytest.raises(GenerationError, match="context"):
        engine.submit(Request([1] * 65, 4))
    with pytest.raises(GenerationError, match="max_new_tokens"):
        Request([1], -1)
    with pytest.raises(GenerationError, match="stop_ids"):
        Request([1], 4, SamplingParams(stop=("The end",)))
    with pytest.raises(GenerationError, match="slots"):
        ContinuousEngine(model, slots=0)
    with pytest.raises(GenerationError, match="max_step_tokens"):
        ContinuousEngine(model, max_step_tokens=0)


def test_a_request_that_fills_the_context_stops_there():
    model = tiny_model(max_seq_len=16, eos_ids=())  # nothing stops it but the context
    engine = ContinuousEngine(model, slots=2)
    h = engine.submit(Request([1] + [5] * 9, 50, SamplingParams(temperature=0)))
    assert h.result().tokens == solo(model, h.request)[0]
    assert len(h.tokens) == 16 - 10 + 1 and h.finish_reason == "context"  # the last token is never fed back


def test_cancel_frees_the_slot_and_the_others_keep_their_solo_outputs(llm, story_ids):
    requests = mixed_requests(story_ids, 6, seed=4)
    requests = [Request(r.prompt, 30, r.params, r.stop_ids) for r in requests]
    engine = ContinuousEngine(llm.model, slots=2)
    handles = [engine.submit(r) for r in requests]
    engine.step()
    running, waiting = handles[0], handles[4]
    assert running.slot is not None and waiting in engine.waiting
    kept = list(running.tokens)
    assert engine.cancel(running) and engine.cancel(waiting)
    assert (running.finish_reason, waiting.finish_reason) == ("cancelled", "cancelled")
    assert running.tokens == kept and waiting not in engine.waiting and running.slot in engine.free
    assert not engine.cancel(running)  # already over: nothing changes
    for _ in engine.run():
        pass
    for h, r in zip(handles, requests):
        if h not in (running, waiting):
            assert (h.tokens, h.finish_reason) == solo(llm.model, r)
    assert not engine.cancel(handles[1]) and sorted(engine.free) == [0, 1]


def test_submit_step_and_cancel_from_several_threads(llm, story_ids):
    """One thread steps; four others submit (and one cancels): every uncancelled request gets its solo output."""
    import threading

    requests = [Request(r.prompt, 12, r.params, r.stop_ids) for r in mixed_requests(story_ids, 16, seed=5)]
    engine = ContinuousEngine(llm.model, slots=3)
    handles: dict[int, object] = {}
    submitted = threading.Event()

    def submitter(k):
        for i in range(k, len(requests), 4):
            if i == 7:
                with engine.lock:  # no step between the two: it is cancelled while waiting, never finished
                    handles[i] = engine.submit(requests[i])
                    assert engine.cancel(handles[i])
            else:
                handles[i] = engine.submit(requests[i])

    def stepper():
        while not submitted.is_set() or engine.busy:
            engine.step()

    stepping = threading.Thread(target=stepper)
    stepping.start()
    workers = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    submitted.set()
    stepping.join(60)
    assert handles[7].finish_reason == "cancelled"
    for i, r in enumerate(requests):
        if i != 7:
            assert (handles[i].tokens, handles[i].finish_reason) == solo(llm.model, r)
    assert sorted(engine.free) == [0, 1, 2]
