"""`npllm serve` with its prefix cache, through the official openai client: requests sharing a 512-token beginning
get the answers of a server without the cache, `usage.prompt_tokens_details.cached_tokens` says how much of each
prompt came from the cache, and a budget too small for two prefixes evicts and stays correct."""

import contextlib
import json
import sys

import httpx
import numpy as np
import openai
import pytest

import npllm
from npllm.batching import ContinuousEngine
from npllm.serve.app import Limits, Server
from npllm.serve.engine import EngineThread
from test_serve import running

SHARED = 512
BLOCK = 32  # npllm.prefix_cache.BLOCK


@pytest.fixture(scope="module")
def llms(stories260k):
    """stories260K run with a context of 1,024 (its RoPE goes past the 512 it was trained for): the same model with
    a prefix cache of 64 MiB, of 1 MiB (a 512-token prefix takes 0.63 MiB), and without one."""
    return {mib: npllm.load(stories260k, context=1024, prefix_cache_mib=mib) for mib in (64, 1, 0)}


@contextlib.contextmanager
def clients(*llms):
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(running(Server(llm, "stories260K", Limits(max_slots=4, max_tokens_limit=64))))
                for llm in llms]
        yield [(openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60), url) for url in urls]


def prompts(llm, n, seed):
    """n prompts: one 512-token beginning (BOS and random ids), then 1..40 ids, each prompt's first one its own."""
    rng = np.random.default_rng(seed)
    V = llm.config.vocab_size
    shared = [1] + [int(t) for t in rng.integers(3, V, SHARED - 1)]
    return [shared + [3 + i] + [int(t) for t in rng.integers(3, V, int(rng.integers(0, 40)))] for i in range(n)]


def ask(client, prompt):
    return client.completions.create(model="stories260K", prompt=prompt, max_tokens=12, temperature=0, logprobs=1)


def assert_same_answer(on, off):
    assert on.choices[0].text == off.choices[0].text
    np.testing.assert_allclose(on.choices[0].logprobs.token_logprobs, off.choices[0].logprobs.token_logprobs,
                               rtol=0, atol=1e-5)


def test_eight_requests_sharing_512_tokens_equal_a_cache_off_server(llms):
    with clients(llms[64], llms[0]) as [(on, url), (off, _)]:
        asked = prompts(llms[64], 8, seed=0)
        cached = []
        for prompt in asked:
            a, b = ask(on, prompt), ask(off, prompt)
            assert_same_answer(a, b)
            assert b.usage.prompt_tokens_details.cached_tokens == 0
            cached.append(a.usage.prompt_tokens_details.cached_tokens)
            timings = a.model_extra["timings"]
            assert timings["cache_n"] == cached[-1] and timings["prompt_n"] == len(prompt) - cached[-1]
            assert timings["predicted_n"] == a.usage.completion_tokens and timings["prompt_ms"] > 0
        assert cached == [0] + [SHARED // BLOCK * BLOCK] * 7
        stream = on.completions.create(model="stories260K", prompt=asked[0], max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "timings" in chunks[-2].model_extra  # the chunk with the finish_reason
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (len(asked[0]) - 1) // BLOCK * BLOCK
        health = httpx.get(url + "/health").json()["prefix_cache"]
        assert health["lookups"] == 9 and health["hits"] == 8 and 0 < health["hit_rate"] < 1
        assert health["bytes"] <= health["budget_bytes"] == 64 << 20
        metrics = httpx.get(url + "/metrics").text
        assert f"npllm_prefix_cache_hit_rate {health['hit_rate']}" in metrics
        assert "npllm_prefix_cache_cached_tokens" in metrics


def test_a_budget_too_small_for_two_prefixes_evicts_and_stays_correct(llms):
    with clients(llms[1], llms[0]) as [(on, url), (off, _)]:
        a, b = prompts(llms[1], 1, seed=1)[0], prompts(llms[1], 1, seed=2)[0]
        cached = []
        for prompt in (a, b, a, b, b):
            got, expected = ask(on, prompt), ask(off, prompt)
            assert_same_answer(got, expected)
            cached.append(got.usage.prompt_tokens_details.cached_tokens)
        health = httpx.get(url + "/health").json()["prefix_cache"]
        assert health["evicted_blocks"] > 0 and health["bytes"] <= health["budget_bytes"] == 1 << 20
        assert cached[:2] == [0, 0] and all(c < SHARED for c in cached[2:4])  # each evicted (part of) the other
        assert cached[4] == (len(b) - 1) // BLOCK * BLOCK  # the most recent prompt is whole


def test_health_says_the_cache_is_off(llms):
    with clients(llms[0]) as [(_, url)]:
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert "off" in httpx.get(url + "/metrics").text


def test_the_engine_thread_logs_the_hit_rate_each_minute(llms, caplog):
    prefix = llms[64].prefix_cache
    thread = EngineThread(ContinuousEngine(llms[64].model, slots=1, prefix_cache=prefix))  # not started
    then = thread.reported[0]
    with caplog.at_level("INFO", logger="npllm.serve.prefix"):
        thread._report_prefix(then + 30)
        assert not caplog.records  # not a minute yet
        prefix.stats.prompt_tokens += 100
        prefix.stats.cached_tokens += 64
        thread._report_prefix(then + 61)
    assert "64 of 100 prompt tokens from the cache" in caplog.text and "64.0%" in caplog.text
    json.dumps(thread.prefix_report())


def test_npllm_serve_prints_the_prefix_log_lines_on_stderr(capsys):
    import logging

    from npllm.serve.app import show_prefix_log
    from npllm.serve.engine import prefix_log

    try:
        show_prefix_log(sys.stderr)
        show_prefix_log(sys.stderr)  # once per process
        prefix_log.info("prefix cache: a line")
        assert capsys.readouterr().err.count("[npllm] prefix cache: a line") == 1
        assert prefix_log.level == logging.INFO
    finally:  # the handler holds this test's captured stderr
        for handler in [h for h in prefix_log.handlers if getattr(h, "npllm_prefix", False)]:
            prefix_log.removeHandler(handler)
        prefix_log.setLevel(logging.NOTSET)
