"""`npllm bench --json`: the interface other tools read (keys, one object per line, consistent arithmetic)."""

import json

import pytest

from npllm import kernels
from npllm.bench import decode_weight_bytes, load_weights
from npllm.cli import main
from npllm.errors import ConfigError
from npllm.formats.random import NAMED_SHAPES

KEYS = {"model", "backend", "threads", "batch", "prompt_len", "gen_len", "prefill_tok_s", "decode_tok_s",
        "first_token_ms", "weight_bytes_per_token", "achieved_gb_s", "bandwidth_gb_s", "peak_rss_mb",
        "threads_wait"}


def test_bench_json_lines(capsys):
    assert main(["bench", "--model", "stories260K", "--batch", "1", "3", "--prompt-len", "5", "--gen-len", "4",
                 "--repeat", "1", "--bandwidth-mib", "8", "--threads", "1", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["batch"], r["prompt_len"]) for r in lines] == [(1, 5), (3, 5)]
    for r in lines:
        assert KEYS <= r.keys()
        assert r["backend"] == "numba" and r["threads"] == 1 and r["gen_len"] == 4
        assert r["threads_wait"] == ("spin" if kernels.SPINNING else "sleep")  # what this process's threads do
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["bandwidth_gb_s"] > 0
        step_bytes = decode_weight_bytes(NAMED_SHAPES["stories260K"])
        assert r["weight_bytes_per_token"] == step_bytes // r["batch"]
        # achieved GB/s is the bytes of one decode step over the time of one step
        assert r["achieved_gb_s"] == pytest.approx(step_bytes / (r["ms_per_token"] / 1e3) / 1e9, rel=0.02)


def test_decode_weight_bytes_counts_every_matrix_once():
    c = NAMED_SHAPES["stories15M"]
    assert decode_weight_bytes(c) == 4 * (c.n_params + c.dim)  # the parameters, plus the embedding row looked up


def test_unknown_model_is_a_config_error():
    with pytest.raises(ConfigError, match="neither a checkpoint"):
        load_weights("stories7B")


def test_unknown_backend_is_reported(capsys):
    assert main(["bench", "--model", "stories260K", "--backend", "cobol", "--json"]) == 2
    assert "unknown backend" in capsys.readouterr().err
