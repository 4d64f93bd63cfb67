"""A sequence's cache kept between calls (npllm.context): reuse equals recomputation; the context policies
error, truncate and sinks (StreamingLLM) past the context; ignore_eos."""

import numpy as np
import pytest

import npllm
from npllm import ops
from npllm.config import ModelConfig
from npllm.context import Context, common_prefix
from npllm.errors import GenerationError
from npllm.formats.random import random_weights
from npllm.generate import Request, decode
from npllm.models import make_model
from npllm.sampling import SamplingParams, log_softmax

GREEDY = SamplingParams(temperature=0.0)
TINY = ModelConfig(dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64)


@pytest.fixture(scope="module")
def llm(stories260k):
    return npllm.load(stories260k)


def story_ids(llm, n, seed=0):
    """n token ids: BOS and random tokens (a fixed, cheap sequence longer than any cache used here)."""
    return [1] + [int(t) for t in np.random.default_rng(seed).integers(3, llm.config.vocab_size, n - 1)]


def last_logits(model, hidden):
    return model.lm_head(hidden)[0]


def continue_steps(context, prompt_ids, max_new_tokens, params, ignore_eos=False):
    """The single-sequence loop (generate.decode) on `context`."""
    return decode(context.model, Request(prompt_ids, max_new_tokens, params, ignore_eos=ignore_eos), context)


def streaming_logits(model, tokens, sinks: int, capacity: int) -> np.ndarray:
    """StreamingLLM computed plainly, one token at a time, without a ring and without moving keys: the token at
    position P attends, in every layer, to all tokens so far while P < capacity; past that, to the first `sinks`
    tokens placed at positions P - capacity + 1 + i and the most recent capacity - sinks at their own (the paper's
    in-cache distances). Keys are kept unrotated and rotated at those positions anew at every step. model: the NumPy
    reference, for its weights, RoPE, feed-forward and head.                                     # [N] -> [N, V]"""
    c, w = model.config, model.weights
    raw_k = np.empty((c.n_layers, len(tokens), c.n_kv_heads, c.head_dim), model.dtype)  # each token's unrotated keys
    raw_v = np.empty_like(raw_k)
    logits = []
    for P, token in enumerate(tokens):
        seen = np.arange(P + 1) if P < capacity else np.r_[0:sinks, P - capacity + sinks + 1:P + 1]
        at = np.where(seen < sinks, P - capacity + 1 + seen, seen) if P >= capacity else seen
        cos, sin = ops.rope_angles(at, model.rope_frequencies()[0], model.dtype)  # [S, Dh/2]
        x = ops.embed(w.tok_embeddings, np.array([token]))  # [1, D]
        for layer, lw in enumerate(w.layers):
            h = ops.rms_norm(x, lw.attention_norm, c.norm_eps)
            raw_k[layer, P] = (h @ lw.wk.T).reshape(c.n_kv_heads, c.head_dim)
            raw_v[layer, P] = (h @ lw.wv.T).reshape(c.n_kv_heads, c.head_dim)
            q = model.rope((h @ lw.wq.T).reshape(1, c.n_heads, c.head_dim), cos[-1:], sin[-1:])
            k = model.rope(raw_k[layer, seen], cos, sin)  # [S, K, Dh]
            out = ops.attention(q, k, raw_v[layer, seen], np.zeros((1, len(seen)), np.float32))
            x = x + out.reshape(1, -1) @ lw.wo.T
            x = x + model.ffn_block(layer, x)
        logits.append(model.lm_head(ops.rms_norm(x, w.norm, c.norm_eps))[0])
    return np.array(logits)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_reuse_runs_only_the_new_tokens_and_equals_recomputation(llm):
    """A second prefill that shares 40 tokens with the first runs only the rest; its logits are a fresh run's
    (bit for bit on the Numba model: its float32 sums do not depend on how tokens are split into calls)."""
    model, first = llm.model, story_ids(llm, 60)
    second = first[:40] + story_ids(llm, 25, seed=1)[1:]
    context = Context(model)
    context.prefill(first)
    before = context.prefilled
    hidden = context.prefill(second)
    assert context.prefilled - before == len(second) - 40
    assert context.tokens == second
    np.testing.assert_array_equal(last_logits(model, hidden), model.logits(second)[-1])
    again = context.prefilled
    context.prefill(second)  # nothing new: the last token alone runs again, for its logits
    assert context.prefilled - again == 1


def test_error_policy_stops_at_the_context_and_refuses_what_cannot_fit(llm):
    context = Context(llm.model, "error", capacity=32)
    out = list(continue_steps(context, story_ids(llm, 20), 13, GREEDY, ignore_eos=True))
    assert len(out) == 32 - 20 + 1 and context.positions_held == 32  # the last token is drawn, never fed
    with pytest.raises(GenerationError, match="do not fit"):
        list(continue_steps(Context(llm.model, "error", capacity=32), story_ids(llm, 20), 14, GREEDY,
                            ignore_eos=True))
    with pytest.raises(GenerationError, match="context"):
        Context(llm.model).prefill(story_ids(llm, llm.config.max_seq_len + 1))


def test_only_the_error_policy_ends_the_loop_at_the_cache(llm):
    """The one loop's context rule (Sequence.accept): under "error" a 32-position cache ends the generation after
    32 - 20 + 1 tokens; "truncate" and "sinks" run the 40 asked for through the same cache, and refuse nothing."""
    ends = {policy: len(list(continue_steps(Context(llm.model, policy, capacity=32), story_ids(llm, 20), 40, GREEDY,
                                            ignore_eos=policy != "error")))
            for policy in ("error", "truncate", "sinks")}
    assert ends == {"error": 13, "truncate": 40, "sinks": 40}


def test_truncate_recomputes_the_most_recent_half_context(llm):
    """Past a 32-position cache the model sees the last 16 tokens again from position 0: the logits are a fresh
    run's over exactly those tokens."""
    model, ids = llm.model, story_ids(llm, 45)
    context = Context(model, "truncate", capacity=32)
    hidden = context.prefill(ids[:30])
    hidden = context.feed(ids[30:33])  # 33 tokens > 32: keep the last 16
    assert (context.base, context.positions_held) == (33 - 16, 16)
    np.testing.assert_array_equal(last_logits(model, hidden), model.logits(ids[17:33])[-1])
    for t in ids[33:45]:
        hidden = context.feed([t])
    np.testing.assert_array_equal(last_logits(model, hidden), model.logits(ids[17:45])[-1])


def test_sinks_with_room_to_spare_are_the_plain_cache(llm):
    ids = story_ids(llm, 40)
    plain = list(continue_steps(Context(llm.model), ids, 30, GREEDY, ignore_eos=True))
    sinks = list(continue_steps(Context(llm.model, "sinks"), ids, 30, GREEDY, ignore_eos=True))
    assert [s.token_ids for s in sinks] == [s.token_ids for s in plain]


@pytest.mark.parametrize("backend,layout,dtype,tol", [("numba", "interleaved", np.float32, 5e-5),
                                                      ("numpy", "half", np.float64, 1e-9)])
def test_sink_keys_are_the_sink_tokens_keys_at_their_new_positions(backend, layout, dtype, tol):
    """After the window has slid 37 times, the cached sinks hold exactly the keys (every layer) and values the sink
    tokens get when run fresh at the positions they were moved to: re-rotation in each backend's key layout
    (the Numba model caches keys interleaved; the reference in the checkpoint's layout, here Hugging Face's)."""
    config = TINY.replace(rope_layout=layout)
    model = make_model(config, random_weights(config, seed=3, dtype=dtype), backend)
    C, S = 16, 4
    ids = [int(t) for t in np.random.default_rng(4).integers(0, 64, C + 37)]
    context = Context(model, "sinks", S, capacity=C)
    for t in ids:
        context.feed([t])
    first = len(ids) - C  # the sinks now sit at positions first .. first + S - 1
    ring = np.arange(first, first + S) % C
    np.testing.assert_array_equal(context.cache.positions[0, ring], np.arange(first, first + S))
    fresh = model.new_cache(C)
    model.forward(np.array(ids[:S]), np.arange(first, first + S), fresh)
    assert np.abs(context.cache.k[:, 0, ring] - fresh.k[:, 0, ring]).max() <= tol
    assert np.abs(context.cache.v[:, 0, ring] - fresh.v[:, 0, ring]).max() <= tol


def test_sinks_agree_across_backends_past_the_window(stories260k):
    """The Numba kernels over the slid ring give the reference's logits at every step (a 24-position cache,
    70 tokens: the window slid 46 times)."""
    ids = [1] + [int(t) for t in np.random.default_rng(5).integers(3, 512, 69)]
    logits = {}
    for backend in ("numba", "numpy"):
        model = npllm.load(stories260k, backend=backend).model
        context = Context(model, "sinks", 4, capacity=24)
        logits[backend] = np.array([last_logits(model, context.feed([t])) for t in ids])
    assert np.abs(logits["numba"] - logits["numpy"]).max() <= 1e-4


def test_generate_1500_tokens_with_sinks_in_a_512_context(llm, stories260k):
    """The acceptance request: 1,500 tokens from stories260K (context 512), memory bounded by the cache. Every token's
    reported log-probabilities (its own and the top 5) are those of streaming_logits, StreamingLLM computed without
    the ring by the NumPy reference; the ring holds exactly the last 512 positions, and never grew."""
    counted = []
    text = "".join(llm.stream("Once upon a time", max_new_tokens=1500, ignore_eos=True, context_policy="sinks",
                              temperature=0.0, logprobs=5, on_step=counted.append))
    assert len(counted) == 1500 and len(text) > 3000
    prompt = llm.tokenizer.encode("Once upon a time", bos=True)
    full = prompt + [int(s.token_ids) for s in counted]
    C = llm.config.max_seq_len
    reference = streaming_logits(npllm.load(stories260k, backend="numpy").model, full[:-1], 4, C)[len(prompt) - 1:]
    logp = log_softmax(reference.astype(np.float64))  # [1500, V]
    rows = np.arange(len(counted))[:, None]
    reported = np.array([s.top_logprobs for s in counted])  # [1500, 5]
    assert np.abs(logp[rows, np.array([s.top_ids for s in counted])] - reported).max() <= 1e-4
    context = Context(llm.model, "sinks")
    context.prefill(full[:-1])  # the last token drawn is never fed
    assert context.cache.k.shape[2] == C  # the ring never grew
    assert (context.cache.positions[0] >= 0).sum() == C
    assert context.cache.positions[0].max() == len(full) - 2


def test_ignore_eos_continues_where_greedy_stops(llm):
    plain = list(llm.generate_ids(llm.tokenizer.encode("Once upon a time"), 400, temperature=0.0))
    assert len(plain) < 400  # stories260K ends its story
    longer = []
    llm.generate("Once upon a time", 400, temperature=0.0, ignore_eos=True, on_step=longer.append)
    assert len(longer) == 400 and [s.token_ids for s in longer[:len(plain)]] == plain


def test_bad_policy_and_unsupported_combinations(llm):
    with pytest.raises(GenerationError, match="context_policy"):
        llm.generate("Once", 5, context_policy="forever")
    with pytest.raises(GenerationError, match="sinks"):
        Context(llm.model, "sinks", sinks=-1)
    with pytest.raises(GenerationError, match="single prompt"):
        llm.generate(["a", "b"], 5, context_policy="sinks")
    with pytest.raises(GenerationError, match="speculative"):
        llm.generate("Once", 5, draft_layers=2, ignore_eos=True)


def test_cuda_backend_says_sinks_are_not_supported():
    from npllm.models.cuda import CudaTransformer

    with pytest.raises(GenerationError, match="cuda backend"):
        CudaTransformer.move_cached_keys(None, None, 0, [], [], 1)


def test_streaming_nll_policies(llm):
    """recompute is a fresh run over each window; window is the plain ring (a cache of `window` entries, one token
    at a time); all three agree until the first token leaves the memory; sinks=0 is the plain window."""
    from npllm.evaluate import _nll, streaming_nll

    model, W = llm.model, 16
    ids = np.array(story_ids(llm, 70, seed=7))
    recompute = streaming_nll(model, ids, W, "recompute", batch=5)
    fresh = [_nll(model.logits(ids[max(0, i - W + 1):i + 1])[-1:], ids[i + 1:i + 2])[0] for i in range(69)]
    np.testing.assert_allclose(recompute, fresh, rtol=0, atol=1e-5)
    ring = model.new_cache(W)
    plain = [_nll(model.lm_head(model.forward([t], [i], ring)), ids[i + 1:i + 2])[0] for i, t in enumerate(ids[:-1])]
    window = streaming_nll(model, ids, W, "window")
    np.testing.assert_allclose(window, plain, rtol=0, atol=1e-5)
    sinks = streaming_nll(model, ids, W, "sinks", sinks=4)
    np.testing.assert_allclose(sinks[:W], recompute[:W], rtol=0, atol=1e-5)
    assert np.abs(sinks[W:] - window[W:]).max() > 1e-3  # the sinks change what later tokens see
    np.testing.assert_array_equal(streaming_nll(model, ids, W, "sinks", sinks=0), window)
