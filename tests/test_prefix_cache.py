"""The prefix cache (npllm.prefix_cache): a prompt's cached beginning is restored, not computed, and everything
computed after it equals a run without the cache (greedy tokens identical, logits within 1e-5), whatever the hit
pattern: a full hit, a partial one, a miss, an eviction between two requests, two requests racing for one prefix."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import npllm
from npllm.batching import ContinuousEngine, Request, ragged_generate
from npllm.config import ModelConfig
from npllm.context import Context
from npllm.errors import GenerationError
from npllm.formats.random import random_weights
from npllm.generate import decode
from npllm.models.reference import Transformer
from npllm.prefix_cache import PrefixCache
from npllm.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
TINY = dict(dim=16, hidden_dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, max_seq_len=64, eos_ids=(2,))


def tiny_model(kv_dtype=None, **options):
    """A small random float64 model (its arithmetic leaves no near-ties to chance); options: sliding windows."""
    config = ModelConfig(**{**TINY, **options})
    model = Transformer(config, random_weights(config, seed=3, dtype=np.float64))
    model.kv_dtype = kv_dtype
    return model


def ids(n, seed):
    return [1] + [int(t) for t in np.random.default_rng(seed).integers(3, 32, n - 1)]


def prefill_logits(model, prefix, prompt, capacity=None):
    """(tokens restored, logits of the rest) of `prompt` in a fresh slot that first takes its cached prefix."""
    cache = model.new_cache(capacity, 1)
    n = prefix.restore(cache, 0, prompt) if prefix is not None else 0
    hidden = model.forward(prompt[n:], np.arange(n, len(prompt)), cache)
    if prefix is not None:
        prefix.store(cache, 0, prompt)
    return n, model.lm_head(hidden)


@pytest.mark.parametrize("kv_dtype", [None, "float16"])
@pytest.mark.parametrize("sliding", [False, True])
def test_restored_prefix_gives_the_logits_of_a_full_prefill(kv_dtype, sliding):
    options = dict(sliding_window=6, sliding_layers=(True, False)) if sliding else {}
    model = tiny_model(kv_dtype, **options)
    prefix = PrefixCache(model, 1 << 20, block=4)
    first, second = ids(30, 0), ids(30, 0)[:22] + ids(20, 1)[1:]  # share 22 tokens: 5 whole blocks
    for prompt, expect in ((first, 0), (second, 20), (first, 28), (first[:9], 8), (first[:8], 4)):
        n, logits = prefill_logits(model, prefix, prompt)
        _, full = prefill_logits(model, None, prompt)
        assert n == expect
        np.testing.assert_allclose(logits, full[n:], rtol=0, atol=1e-5)


def requests_sharing(n_requests, shared=24, seed=0, max_new=6):
    base = ids(shared + 12, seed)
    rng = np.random.default_rng(seed + 1)
    out = []
    for i in range(n_requests):
        keep = int(rng.integers(1, len(base)))
        prompt = base[:keep] + [int(t) for t in rng.integers(3, 32, int(rng.integers(0, 8)))]
        out.append(Request(prompt, max_new, GREEDY, logprobs=True))
    return out


def run_engine(model, requests, slots, prefix=None):
    engine = ContinuousEngine(model, slots=slots, prefix_cache=prefix)
    handles = [engine.submit(r) for r in requests]
    for _ in engine.run():
        pass
    return [h.result() for h in handles], handles, engine


def assert_same(off, on):
    for a, b in zip(off, on):
        assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 8), slots=st.integers(1, 4), budget_blocks=st.integers(0, 12), seed=st.integers(0, 50),
       kv=st.sampled_from([None, "float16"]))
def test_engine_outputs_equal_the_cache_off_whatever_the_hits(n, slots, budget_blocks, seed, kv):
    """Any mix of shared beginnings, slot counts and budgets (0 blocks: nothing fits; 12: a few prompts' worth,
    so blocks are evicted between requests) gives the outputs of the engine without a prefix cache."""
    model = tiny_model(kv)
    requests = requests_sharing(n, seed=seed)
    block_bytes = 2 * 2 * 4 * 2 * 4 * model.new_cache(4, 1).k.itemsize  # k and v: L x block x K x Dh
    prefix = PrefixCache(model, budget_blocks * block_bytes, block=4)
    off, _, _ = run_engine(model, requests, slots)
    on, handles, engine = run_engine(model, requests, slots, prefix)
    assert_same(off, on)
    assert prefix.nbytes <= prefix.budget
    assert engine.work.wasted_rows == 0  # the cached tokens were not computed, and not counted as needed
    for h in handles:
        assert h.cached % 4 == 0 and h.cached < len(h.request.prompt)
        assert h.timings()["cache_n"] + h.timings()["prompt_n"] == len(h.request.prompt)


def test_a_full_hit_a_partial_hit_and_a_miss():
    model = tiny_model()
    prefix = PrefixCache(model, 1 << 20, block=4)
    a = ids(26, 0)
    requests = [Request(p, 5, GREEDY, logprobs=True) for p in (a, a, a[:13] + ids(9, 7)[1:], ids(20, 9))]
    off, _, _ = run_engine(model, requests, 1)
    on, handles, _ = run_engine(model, requests, 1, prefix)
    assert_same(off, on)
    assert [h.cached for h in handles] == [0, 24, 12, 0]  # full (all but the last token, whole blocks), partial, miss
    assert prefix.stats.lookups == 4 and prefix.stats.hits == 2


def test_two_requests_racing_for_one_prefix_compute_it_once():
    """Both submitted before a step: the second waits one step, then restores what the first stored."""
    model = tiny_model()
    prefix = PrefixCache(model, 1 << 20, block=4)
    shared = ids(21, 2)
    requests = [Request(shared + [5, 6], 4, GREEDY, logprobs=True), Request(shared + [7], 4, GREEDY, logprobs=True),
                Request(ids(10, 3), 4, GREEDY, logprobs=True)]
    off, _, _ = run_engine(model, requests, 3)
    on, handles, _ = run_engine(model, requests, 3, prefix)
    assert_same(off, on)
    assert [h.cached for h in handles] == [0, 20, 0]
    assert [h.started_at for h in handles] == [0, 1, 1]  # the third keeps its place behind the second


def test_eviction_between_two_requests_stays_correct():
    """A budget of one prompt's blocks: alternating prompts evict each other and each is computed again."""
    model = tiny_model()
    a, b = ids(17, 4), ids(17, 5)
    one_prompt = 4 * 2 * 2 * 4 * 2 * 4 * 8  # 4 blocks of 4 positions, k and v, 2 layers, 2 kv heads x 4 dims
    prefix = PrefixCache(model, one_prompt, block=4)
    requests = [Request(p, 4, GREEDY, logprobs=True) for p in (a, b, a, a)]
    off, _, _ = run_engine(model, requests, 1)
    on, handles, _ = run_engine(model, requests, 1, prefix)
    assert_same(off, on)
    assert [h.cached for h in handles] == [0, 0, 0, 16]
    assert prefix.stats.evicted_blocks == 8 and prefix.nbytes <= one_prompt


def test_ragged_batches_restore_and_race_like_the_engine():
    model = tiny_model()
    prefix = PrefixCache(model, 1 << 20, block=4)
    requests = requests_sharing(6, seed=3)
    off = ragged_generate(model, requests)
    on = ragged_generate(model, requests, prefix_cache=prefix)
    assert_same(off, on)
    assert any(c.cached for c in on)
    again = ragged_generate(model, requests, prefix_cache=prefix)
    assert_same(off, again)
    assert [c.cached for c in again] == [(len(r.prompt) - 1) // 4 * 4 for r in requests]  # all stored: full hits


def test_prompt_logprobs_are_scored_in_full():
    model = tiny_model()
    prefix = PrefixCache(model, 1 << 20, block=4)
    p = ids(20, 6)
    requests = [Request(p, 3, GREEDY, prompt_logprobs=True), Request(p, 3, GREEDY, prompt_logprobs=True)]
    off, _, _ = run_engine(model, requests, 1)
    on, handles, _ = run_engine(model, requests, 1, prefix)
    assert [h.cached for h in handles] == [0, 0]
    np.testing.assert_allclose(off[1].prompt_logprobs, on[1].prompt_logprobs, atol=1e-9)


@pytest.mark.parametrize("policy", ["sinks", "truncate", "error"])
@pytest.mark.parametrize("sliding", [False, True])
def test_contexts_past_their_ring_stay_correct_with_a_cached_prefix(policy, sliding):
    """A ring of 24 positions: blocks are stored and restored only below it; prompts and generations past it
    (sinks sliding, truncate recomputing) give the tokens and logits of the same contexts without a cache."""
    options = dict(sliding_window=6, sliding_layers=(True, False)) if sliding else {}
    model = tiny_model(**options)
    prefix = PrefixCache(model, 1 << 20, block=4)
    prompts = [ids(20, 8), ids(20, 8) + ids(22, 9)[1:], ids(20, 8)[:18]]
    if policy == "error":
        prompts = [p[:24] for p in prompts]
    for prompt in prompts:
        runs = []
        for cache in (None, prefix):
            logits = []
            context = Context(model, policy, 4, 24, cache)
            request = Request(prompt, 30, GREEDY, ignore_eos=policy != "error")
            tokens = [d.token_ids for d in decode(model, request, context, observe=lambda r, l, d: logits.append(l))]
            runs.append((tokens, np.concatenate(logits), context.restored))
        assert runs[0][0] == runs[1][0]
        np.testing.assert_allclose(runs[0][1], runs[1][1], rtol=0, atol=1e-5)
    assert prefix.stats.cached_tokens == 20 + 16  # the second prompt takes the first one's 5 blocks, the third 4


def test_blocks_never_cover_positions_past_the_ring():
    model = tiny_model()
    prefix = PrefixCache(model, 1 << 20, block=4)
    context = Context(model, "sinks", 4, 24, prefix)
    list(decode(model, Request(ids(40, 10), 2, GREEDY, ignore_eos=True), context))
    assert not prefix.blocks  # the ring wrapped while the prompt was fed: its early entries hold later positions
    cache = model.new_cache(24, 1)
    prefix.store(cache, 0, ids(40, 10))
    assert not prefix.blocks  # an empty slot holds nothing to store
    context = Context(model, "error", capacity=24, prefix_cache=prefix)
    list(decode(model, Request(ids(23, 10), 1, GREEDY), context))
    assert len(prefix.blocks) == 5  # 23 tokens: 5 whole blocks
    cache = model.new_cache(8, 1)
    assert prefix.restore(cache, 0, ids(23, 10)) == 8  # a smaller ring takes what it holds


def test_keys_depend_on_the_model_and_the_kv_dtype():
    a, b = tiny_model(), tiny_model()
    pa, pb = PrefixCache(a, 1 << 20, block=4), PrefixCache(b, 1 << 20, block=4)
    tokens = ids(12, 0)
    assert pa.chain(tokens, np.float32) != pb.chain(tokens, np.float32)
    assert pa.chain(tokens, np.float32) != pa.chain(tokens, np.float16)
    assert pa.chain(tokens, np.float32)[1] != pa.chain(tokens[:4] + ids(12, 1)[4:], np.float32)[1]
    with pytest.raises(GenerationError, match="another model"):
        ContinuousEngine(b, slots=1, prefix_cache=pa)
    with pytest.raises(GenerationError, match="budget"):
        PrefixCache.of_mib(a, -1)
    assert PrefixCache.of_mib(a, 0) is None


def test_restore_refuses_a_slot_in_use():
    model = tiny_model()
    prefix = PrefixCache(model, 1 << 20, block=4)
    cache = model.new_cache(None, 1)
    model.forward([1, 2, 3], np.arange(3), cache)
    with pytest.raises(GenerationError, match="empty slot"):
        prefix.restore(cache, 0, ids(10, 0))


@pytest.fixture(scope="module")
def story_llm(stories260k):
    return npllm.load(stories260k, prefix_cache_mib=16)


def test_stories260k_numba_serves_shared_prompts_from_the_cache(story_llm, stories260k):
    """The compiled backend, float32 and float16 KV: LLM.generate over prompts sharing a beginning, then again,
    equals the outputs of an LLM without a cache."""
    plain = npllm.load(stories260k)
    shared = "Once upon a time there was a little girl named Lily who loved to play outside in the park. "
    prompts = [shared + end for end in ("One day", "She saw a dog", "Her mom said")]
    expected = plain.generate(prompts, 20, temperature=0.0)
    assert story_llm.generate(prompts, 20, temperature=0.0) == expected
    assert story_llm.generate(prompts, 20, temperature=0.0) == expected
    assert story_llm.generate(prompts[1], 20, temperature=0.0) == expected[1]
    stats = story_llm.prefix_cache.stats
    assert stats.cached_tokens >= 4 * 32 and stats.hits >= 4
    model, cached = story_llm.model, story_llm.prefix_cache
    prompt = story_llm.tokenizer.encode(shared * 3, bos=True)
    own = model.kv_dtype
    for kv in ("float32", "float16"):
        model.kv_dtype = kv
        try:
            n, logits = prefill_logits(model, cached, prompt)
            n, logits = prefill_logits(model, cached, prompt)
            _, full = prefill_logits(model, None, prompt)
        finally:
            model.kv_dtype = own
        assert n == (len(prompt) - 1) // 32 * 32
        np.testing.assert_allclose(logits, full[n:], rtol=0, atol=1e-5)


def test_npllm_batch_reports_the_hit_rate_and_its_results_equal_the_cache_off(tmp_path, capsys):
    from npllm.cli import main

    shared = "Once upon a time there was a little girl named Lily who loved to play outside in the park. " * 3
    rows = [{"id": i, "prompt": shared + end, "max_tokens": 12, "temperature": 0}
            for i, end in enumerate(["One day", "She saw a dog", "Her mom said", "The sun"])]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    outputs = {}
    for mib in ("0", "8"):
        capsys.readouterr()
        out = tmp_path / f"out{mib}.jsonl"
        assert main(["batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--batch-size", "2",
                     "--prefix-cache-mib", mib]) == 0
        err = capsys.readouterr().err
        outputs[mib] = [json.loads(line) for line in out.read_text().splitlines()]
        assert ("prefix cache:" in err) == (mib != "0")
    assert [(r["text"], r["tokens"]) for r in outputs["0"]] == [(r["text"], r["tokens"]) for r in outputs["8"]]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in outputs["8"]]
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:])  # the second waits a step for the first's blocks
    assert "of 4 prompts hit" in err
    assert main(["batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--ray",
                 "--prefix-cache-mib", "1"]) == 2
    assert "--prefix-cache-mib needs no --ray" in capsys.readouterr().err


def test_a_new_chat_session_takes_its_system_prompt_from_the_cache(stories260k):
    """Two sessions (sinks 4 and 5: two sessions of one LLM) with one long system prompt: the second restores it
    and replies as a session of an LLM without the cache does."""
    system = "You are a storyteller. Tell short happy stories about animals in the forest and their friends. " * 4
    cached, plain = (npllm.load(stories260k, backend="numpy", prefix_cache_mib=mib) for mib in (8, 0))
    replies = []
    for llm, sinks in ((cached, 4), (cached, 5), (plain, 4)):
        session = llm.chat_session("chatml", system=system, sinks=sinks)
        text = "".join(session.send("Tell me about a fox.", 16, temperature=0.0))
        replies.append((text, session.context.restored))
    assert replies[0][0] == replies[1][0] == replies[2][0]
    assert replies[0][1] == 0 and replies[1][1] >= 64 and replies[2][1] == 0
