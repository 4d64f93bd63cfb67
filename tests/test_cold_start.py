"""A first run that does not wait for the compile: on an empty Numba cache, `npllm generate` answers with the NumPy
reference (computing as the Numba model does) while a detached process fills the cache, and later runs load the
compiled code (npllm.models.make_model's cold_start, kernels/compiler.py's detached compiles)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import npllm
from npllm import quant
from npllm.quant import oracle
from npllm.config import ModelConfig
from npllm.errors import ConfigError
from npllm.formats import read_checkpoint
from npllm.hub import resolve
from npllm.kernels.compiler import (BACKGROUND_NICE, LOCK_NAME, cache_lock, compiling, compiling_elsewhere,
                                    start_detached, wait_for_lock)
from npllm.models import make_model
from npllm.models.numba import COMPILE_LABEL
from npllm.models.numba import FORWARD
from npllm.models.reference import Transformer
from npllm.models.stand_in import DecodedInt8Matrix, numba_weights, stand_in
from npllm.generate import generate_ids
from npllm.sampling import SamplingParams
from test_golden import golden, golden_cases
from tests_support import REPO, process_alive, wait_gone

TIED = ModelConfig(dim=64, hidden_dim=64, n_layers=1, n_heads=1, n_kv_heads=1, vocab_size=8, max_seq_len=8,
                   tied_embeddings=True)
COMPILE_S = 540  # at most this long for a detached compile of the float model (niced, on a busy 2-core machine)
QUICK_S = 30  # a first run that waits for the compile takes >= 50 s here; the reference answers in 2-5 s


def run_cli(*args, env):
    return subprocess.run([sys.executable, "-m", "npllm", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=COMPILE_S)


def lock_pid(lock: Path) -> int | None:
    """The pid a detached compile wrote into its lock, while it holds it (None once released)."""
    text = lock.read_text().split() if lock.exists() else []
    return int(text[0]) if text and compiling_elsewhere(lock) else None


@pytest.fixture
def empty_cache(tmp_path):
    """An empty Numba cache directory, as on a fresh install; any detached compile still running into it at the
    end of the test is killed (none is left behind)."""
    folder = tmp_path / "numba-cache"
    folder.mkdir()
    yield folder
    for lock in folder.rglob(LOCK_NAME):
        pid = lock_pid(lock)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            assert wait_gone(pid, 10)


def detached_compile(cache: Path, seconds: float = 20) -> int:
    """The pid of the detached compile into `cache`, once it holds its lock (a bounded wait)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for lock in cache.rglob(LOCK_NAME):
            pid = lock_pid(lock)
            if pid is not None:
                return pid
        time.sleep(0.1)
    raise AssertionError(f"no detached compile holds a lock in {cache} after {seconds} s")


def test_a_first_run_answers_at_once_and_a_detached_compile_serves_the_next(empty_cache):
    """Fresh cache: the golden's first tokens from the reference within seconds, with the notice; a compile killed
    half-way leaves a cache the next run uses correctly (again the reference, and a new compile); a run asking to
    wait (NPLLM_WAIT_COMPILE=1) waits for the detached compile and then runs on the compiled kernels, which every
    run after it loads."""
    prompt, _, expected = golden(golden_cases()[0].values[0])
    env = {**os.environ, "NUMBA_CACHE_DIR": str(empty_cache)}
    env.pop("NPLLM_WAIT_COMPILE", None)
    args = ("generate", prompt, "--temperature", "0", "--max-new-tokens", "12")

    start = time.monotonic()
    first = run_cli(*args, env=env)
    seconds = time.monotonic() - start
    assert first.returncode == 0, first.stderr
    assert expected.startswith(first.stdout.rstrip("\n")) and len(first.stdout.rstrip("\n")) > len(prompt)
    assert "background process compiles them" in first.stderr and "NPLLM_WAIT_COMPILE=1" in first.stderr
    assert "compiling kernels" not in first.stderr
    assert seconds < QUICK_S, first.stderr

    killed = detached_compile(empty_cache)
    time.sleep(5)
    os.kill(killed, signal.SIGKILL)  # half-way through its compile
    assert wait_gone(killed, 10)
    again = run_cli(*args, env=env)
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout and "background process compiles them" in again.stderr
    compiling = detached_compile(empty_cache)
    assert compiling != killed

    waited = run_cli(*args, env={**env, "NPLLM_WAIT_COMPILE": "1"})
    assert waited.returncode == 0, waited.stderr
    assert waited.stdout == first.stdout
    assert "compiling kernels" in waited.stderr and "background process" not in waited.stderr
    assert not process_alive(compiling)

    code = ("import npllm; llm = npllm.load(cold_start='reference'); "
            "print(type(llm.model).__name__, llm.backend)")
    later = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                           timeout=COMPILE_S)
    assert later.returncode == 0, later.stderr
    assert later.stdout.split() == ["NumbaTransformer", "numba"]


def test_a_detached_process_is_alone_niced_in_its_own_session_and_its_lock_goes_when_it_is_killed(tmp_path):
    lock = tmp_path / LOCK_NAME
    report = tmp_path / "report"
    code = (f"import os, time\nopen({str(report)!r}, 'w').write(f'{{os.getppid()}} {{os.getsid(0)}} "
            f"{{os.nice(0)}}')\ntime.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert start_detached(code, env, lock, "Label")
    pid = None
    try:
        deadline = time.monotonic() + 30
        while not report.exists() or not report.read_text():
            assert time.monotonic() < deadline, "the detached process did not start"
            time.sleep(0.05)
        pid = lock_pid(lock)
        parent, session, nice = map(int, report.read_text().split())
        assert parent != os.getpid() and session != os.getsid(0)
        assert nice >= os.nice(0) + BACKGROUND_NICE
        assert compiling_elsewhere(lock) and compiling(lock) == "Label"
        # a second one finds the lock held and runs nothing
        second = subprocess.run([sys.executable, "-c", "from npllm.kernels.compiler import hold_lock; "
                                 f"print(hold_lock({str(lock)!r}))"], capture_output=True, text=True, env=env,
                                timeout=60)
        assert second.stdout.strip() == "False", second.stderr
        assert not wait_for_lock(lock, 0.3)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid, 10)
    assert wait_for_lock(lock, 5) and not compiling_elsewhere(lock) and compiling(lock) is None


def test_compiles_a_run_waits_for_take_the_cache_lock_one_at_a_time(tmp_path):
    """hold_lock_waiting (compile_in_child's child): a second compile into a cache waits until the first lets go of
    the lock, so two first runs at once never save entries of one Numba index together (which once left a key
    naming another function's code)."""
    lock, log = tmp_path / LOCK_NAME, tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = ("import sys, time\nfrom npllm.kernels.compiler import hold_lock_waiting\n"
            f"hold_lock_waiting({str(lock)!r}, 'NumbaTransformer')\n"
            f"open({str(log)!r}, 'a').write(sys.argv[1] + ' in\\n'); time.sleep(1.5)\n"
            f"open({str(log)!r}, 'a').write(sys.argv[1] + ' out\\n')\n")
    first = subprocess.Popen([sys.executable, "-c", code, "first"], env=env)
    deadline = time.monotonic() + 30
    while not log.exists():
        assert time.monotonic() < deadline, "the first compile did not start"
        time.sleep(0.02)
    assert compiling(lock) == "NumbaTransformer"
    second = subprocess.Popen([sys.executable, "-c", code, "second"], env=env)
    assert first.wait(60) == 0 and second.wait(60) == 0
    assert log.read_text().split("\n")[:4] == ["first in", "first out", "second in", "second out"]
    assert compiling(lock) is None


def test_a_run_while_a_compile_is_running_does_not_start_another():
    """With the lock of this process's cache held by a detached compile, cold_start "exact" gives the reference even
    where the code is cached (the compile may not have cached all of it yet), and starts nothing."""
    lock = cache_lock(FORWARD)
    if lock is None:
        pytest.skip("no detached compiles here (no flock, or a Numba outside the tested versions)")
    config, weights = read_checkpoint(resolve("stories260K")[0])
    make_model(config, weights, "numba")  # the model's code cached (compiled first, where it was not)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert start_detached("import time\ntime.sleep(60)\n", env, lock, COMPILE_LABEL)
    pid = None
    try:
        deadline = time.monotonic() + 30
        while pid is None:
            assert time.monotonic() < deadline, "the detached process did not take the lock"
            pid = lock_pid(lock)
            time.sleep(0.05)
        model = make_model(config, weights, "numba", cold_start="exact")
        assert type(model) is Transformer
        assert lock_pid(lock) == pid
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid, 10)


@pytest.mark.parametrize("case", golden_cases())
def test_the_reference_standing_in_gives_run_c_tokens(case):
    """The float32 reference, which stands in for the Numba model on a fresh cache, continues every golden prompt
    as run.c does (its closest top-2 logit gap on these: 1e-3, against float32 differences of ~1e-5)."""
    prompt, new_tokens, expected = golden(case)
    config, weights = read_checkpoint(resolve("stories260K")[0])
    llm = npllm.LLM(stand_in(config, weights), npllm.load("stories260K", backend="numpy").tokenizer)
    assert prompt + llm.generate(prompt, max_new_tokens=new_tokens, temperature=0) == expected


def test_the_reference_standing_in_gives_the_numba_models_greedy_tokens():
    """Beyond the goldens: prompts of story words, the stand-in's greedy tokens are the Numba model's (measured
    over 100 prompts x 200 tokens: all the same; here 8 x 100)."""
    config, weights = read_checkpoint(resolve("stories260K")[0])
    numba_model, reference = make_model(config, weights, "numba"), stand_in(config, weights)
    tokenizer = npllm.load("stories260K", backend="numpy").tokenizer
    words = "Once upon a time there was a little girl named Lily she loved to play outside in the park".split()
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0)
    for _ in range(8):
        ids = tokenizer.encode(" ".join(rng.choice(words, rng.integers(1, 7))), bos=True)
        assert list(generate_ids(reference, ids, 100, greedy)) == list(generate_ids(numba_model, ids, 100, greedy))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q2_K", "Q3_K"])
def test_a_decoded_matrix_multiplies_as_the_int8_kernels_statement(qtype):
    """DecodedInt8Matrix's float32 product is quant.oracle.matmul_t_q8_activations's (two parts for Q2_K, Q3_K), to
    float32 rounding: the weights decoded once, the activations rounded as the Numba model rounds them."""
    rng = np.random.default_rng(1)
    w = quant.QuantizedMatrix.from_values(rng.standard_normal((24, 512)).astype(np.float32), qtype)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    decoded = numba_weights(TIED, {"w": w})["w"]
    assert isinstance(decoded, DecodedInt8Matrix) and decoded.two_part == (qtype in ("Q2_K", "Q3_K"))
    exact = oracle.with_int8_activations({"w": w})["w"].matmul_t(x)
    np.testing.assert_allclose(x @ decoded.T, exact, rtol=1e-5, atol=1e-4)
    plain = x @ w.dequantize().T  # what the reference alone computes: the rounding of x shows
    assert np.abs(plain - exact).max() > 1e-3


def test_decoded_weights_keep_float_types_plain_a_tied_head_decoded_once_and_a_lookup_table_as_stored():
    rng = np.random.default_rng(2)
    table, head = (quant.QuantizedMatrix.from_values(rng.standard_normal((8, 64)).astype(np.float32), "Q8_0")
                   for _ in range(2))
    half = quant.QuantizedMatrix.from_values(rng.standard_normal((8, 64)).astype(np.float32), "F16")
    norm = np.ones(64, np.float32)
    out = numba_weights(TIED, {"tok_embeddings": table, "output": table, "wo": half, "norm": norm})
    assert out["output"] is out["tok_embeddings"] and isinstance(out["output"], DecodedInt8Matrix)
    untied = numba_weights(TIED.replace(tied_embeddings=False), {"tok_embeddings": table, "output": head})
    assert untied["tok_embeddings"] is table and isinstance(untied["output"], DecodedInt8Matrix)
    assert type(out["wo"]) is np.ndarray and out["wo"].dtype == np.float32
    np.testing.assert_array_equal(out["wo"], half.dequantize())
    assert out["norm"] is norm


def test_cold_start_is_checked():
    config, weights = read_checkpoint(resolve("stories260K")[0])
    with pytest.raises(ConfigError, match="cold_start"):
        make_model(config, weights, "numpy", cold_start="later")


def test_a_quantized_model_waits_for_the_compile_where_its_tokens_are_to_be_reproduced(empty_cache):
    """cold_start "exact": a float32 model does not wait, a quantized one does (the reference's tokens can part from
    the compiled model's); "reference": neither waits. Each decision raises BEHIND saying which. Nothing is started
    (the returned function starts the compile)."""
    code = ("from numba.core import event\n"
            "from npllm.models import BEHIND, compile_behind\n"

            "seen = []\n"
            "class Seen(event.Listener):\n"
            "    def on_start(self, ev): seen.append(ev.data)\n"
            "    def on_end(self, ev): pass\n"
            "event.register(BEHIND, Seen())\n"
            "print([compile_behind(True, None, 'exact') is None, compile_behind(True, None, 'reference') is None,\n"
            "       compile_behind(False, None, 'exact') is None], seen)\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(empty_cache), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("[True, False, False] [{'quantized': True, 'waits': True}, "
                                     "{'quantized': True, 'waits': False}, {'quantized': False, 'waits': False}]")
    assert not list(empty_cache.rglob(LOCK_NAME))


@pytest.mark.parametrize("argv, expected", [
    (["generate", "Once"], "reference"),
    (["generate", "Once", "--temperature", "0"], "exact"),
    (["generate", "Once", "--seed", "3"], "exact"),
    (["generate", "Once", "--num-beams", "2"], "exact"),
    (["chat"], "reference"),
    (["perplexity", "--text", "t.txt"], "wait"),
])
def test_the_cli_waits_for_the_compile_only_where_it_should(argv, expected, monkeypatch):
    from npllm.cli import build_parser, cold_start

    monkeypatch.delenv("NPLLM_WAIT_COMPILE", raising=False)
    assert cold_start(build_parser().parse_args(argv)) == expected
    monkeypatch.setenv("NPLLM_WAIT_COMPILE", "1")
    assert cold_start(build_parser().parse_args(argv)) == "wait"


@pytest.mark.parametrize("quantized, waits, says", [
    (False, False, "uses the NumPy reference (the same greedy tokens)"),
    (True, False, "uses the NumPy reference, slower per token"),
    (True, True, "a greedy or seeded run of a quantized model waits for them"),
])
def test_the_notice_says_what_happens_and_how_long_it_takes_once(quantized, waits, says, capsys):
    from numba.core import event

    from npllm import cli
    from npllm.models import BEHIND

    with cli.compile_notice(True):
        with event.trigger_event(BEHIND, data={"quantized": quantized, "waits": waits}):
            pass
        with event.trigger_event("numba:compile", data={"dispatcher": None, "args": None, "return_type": None}):
            pass
    err = capsys.readouterr().err
    assert err.count("[npllm]") == 1 and says in err
    assert "2-4 minutes" in err
    assert ("NPLLM_WAIT_COMPILE=1" in err) != waits
    assert event._registered[BEHIND] == []
