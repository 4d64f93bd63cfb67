"""The prefix cache (npllm.prefix_cache) measured, for docs/serve.md and docs/batch.md.

    python scripts/bench/bench_prefix.py make  --shape tinyllama-1.1B          # a random-weight Q4_K_M file
    python scripts/bench/bench_prefix.py ttft  --model FILE.gguf [--prefix 1000] [--requests 4] [--threads 2]
    python scripts/bench/bench_prefix.py batch --model FILE.gguf [--prompts 200] [--system 500] [--tokens 8]

make: random weights at a named shape (npllm.formats.random.NAMED_SHAPES), written by npllm's own quantizer as
Q4_K_M with the Llama 2 vocabulary ($NPLLM_WEIGHTS/llama2-tokenizer), to $PREFIX_BENCH_DIR (default
/tmp/prefix-bench).

ttft: time to first token of requests that share a PREFIX-token beginning (BOS and random ids) and differ in their
last 16 ids, one after another through a ContinuousEngine of one slot (the server's engine, without HTTP), with the
prefix cache on: the first request computes the prefix, the later ones restore it. Then the same requests with the
cache off. Each time is from submit to the first token.

batch: `npllm batch` processes (model load included) over PROMPTS token-id prompts: a shared SYSTEM-token
beginning then 16 ids of each prompt's own, cache off (--prefix-cache-mib 0) and on (the default); then PROMPTS
distinct prompts of SYSTEM + 16 ids (a 0% hit rate), off and on, in alternation for --rounds rounds, reporting each
run's wall time and the best of each. Also printed: the seconds the cache's own work (hashing, copying blocks in and
out) took in a run of the distinct prompts in this process, the part of the 0%-hit cost that is not noise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FOLDER = Path(os.environ.get("PREFIX_BENCH_DIR", "/tmp/prefix-bench"))
OWN = 16  # ids of each prompt's own after the shared beginning


def make(shape: str) -> Path:
    from npllm.formats.gguf_write import write_gguf
    from npllm.formats.random import NAMED_SHAPES, random_weights
    from npllm.hub import weights_dirs
    from npllm.tokenizer import load_tokenizer

    FOLDER.mkdir(parents=True, exist_ok=True)
    path = FOLDER / f"{shape}-Q4_K_M.gguf"
    vocab = next(p for d in [Path("weights"), *weights_dirs()]
                 if (p := d / "llama2-tokenizer" / "tokenizer.model").is_file())
    start = time.perf_counter()
    config = NAMED_SHAPES[shape]
    write_gguf(path, config, random_weights(config), "Q4_K_M", load_tokenizer(vocab))
    print(f"{path}: {time.perf_counter() - start:.0f} s")
    return path


def prompts(n: int, shared: int, vocab: int, seed: int, distinct: bool = False) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    head = [1] + [int(t) for t in rng.integers(3, vocab, shared - 1)]
    out = []
    for _ in range(n):
        if distinct:
            head = [1] + [int(t) for t in rng.integers(3, vocab, shared - 1)]
        out.append(head + [int(t) for t in rng.integers(3, vocab, OWN)])
    return out


def ttft(args) -> None:
    import npllm
    from npllm.batching import ContinuousEngine, Request
    from npllm.sampling import SamplingParams

    llm = npllm.load(args.model, threads=args.threads, prefix_cache_mib=1024)
    asked = prompts(args.requests, args.prefix, llm.config.vocab_size, seed=0)
    print(f"| cache | request | prompt tokens | cached | time to first token (s) |\n| --- | --- | --- | --- | --- |")
    for cache in (llm.prefix_cache, None):
        engine = ContinuousEngine(llm.model, slots=1, prefix_cache=cache)
        for i, prompt in enumerate(asked):
            start = time.perf_counter()
            handle = engine.submit(Request(prompt, 4, SamplingParams(temperature=0.0)))
            while not handle.tokens and not handle.done:
                engine.step()
            seconds = time.perf_counter() - start
            while not handle.done:
                engine.step()
            print(f"| {'on' if cache else 'off'} | {i + 1} | {len(prompt)} | {handle.cached} | {seconds:.3f} |",
                  flush=True)


def batch_file(folder: Path, name: str, asked: list[list[int]], tokens: int) -> Path:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": tokens, "temperature": 0,
                                        "logit_bias": {"2": -100}}) + "\n" for i, p in enumerate(asked)))
    return path


def timed_batch(args, inp: Path, mib: str) -> tuple[float, str]:
    """(wall seconds, the prefix cache's stderr line) of one `npllm batch` process."""
    out = inp.with_name(f"out-{time.monotonic_ns()}.jsonl")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "npllm", "batch", "--model", args.model, "-i", str(inp), "-o",
                           str(out), "--threads", str(args.threads), "--batch-size", str(args.batch_size),
                           "--prefix-cache-mib", mib], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    seconds = time.perf_counter() - start
    line = next((l for l in done.stderr.splitlines() if "prefix cache" in l), "")
    return seconds, line.replace("[npllm] batch: ", "")


def cache_work(args, asked: list[list[int]]) -> tuple[float, float]:
    """(seconds in the prefix cache's restore, deferred and store; seconds of the whole run) of the distinct
    prompts through a ContinuousEngine in this process."""
    import npllm
    from npllm.batching import ContinuousEngine, Request
    from npllm.prefix_cache import DEFAULT_MIB, PrefixCache
    from npllm.sampling import SamplingParams

    llm = npllm.load(args.model, threads=args.threads, prefix_cache_mib=DEFAULT_MIB)
    spent = [0.0]

    def timing(method):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                spent[0] += time.perf_counter() - start
        return run

    cache: PrefixCache = llm.prefix_cache
    cache.restore, cache.store, cache.deferred = timing(cache.restore), timing(cache.store), timing(cache.deferred)
    engine = ContinuousEngine(llm.model, slots=args.batch_size, prefix_cache=cache)
    start = time.perf_counter()
    for p in asked:
        engine.submit(Request(p, args.tokens, SamplingParams(temperature=0.0)))
    for _ in engine.run():
        pass
    return spent[0], time.perf_counter() - start


def batch(args) -> None:
    from npllm.formats import read_config

    vocab = read_config(args.model).vocab_size
    shared = prompts(args.prompts, args.system, vocab, seed=1)
    distinct = prompts(args.prompts, args.system, vocab, seed=2, distinct=True)
    with tempfile.TemporaryDirectory() as folder:
        files = {"shared": batch_file(Path(folder), "shared", shared, args.tokens),
                 "distinct": batch_file(Path(folder), "distinct", distinct, args.tokens)}
        timed_batch(args, batch_file(Path(folder), "warm", shared[:2], 2), "0")  # Numba's cache, the page cache
        print("| prompts | cache | wall s | prompts/s | prefix cache |\n| --- | --- | --- | --- | --- |")
        best: dict = {}
        for round_ in range(args.rounds):
            for kind in ("shared", "distinct"):
                for mib in (("0", "256") if round_ % 2 == 0 else ("256", "0")):
                    seconds, line = timed_batch(args, files[kind], mib)
                    best[kind, mib] = min(best.get((kind, mib), seconds), seconds)
                    print(f"| {kind} | {'off' if mib == '0' else 'on'} | {seconds:.1f} | "
                          f"{args.prompts / seconds:.2f} | {line} |", flush=True)
    for kind in ("shared", "distinct"):
        off, on = best[kind, "0"], best[kind, "256"]
        print(f"{kind}: best off {off:.1f} s, best on {on:.1f} s: on/off throughput {off / on:.3f}")
    spent, total = cache_work(args, distinct)
    print(f"distinct prompts in this process: the cache's own work {spent:.2f} s of {total:.1f} s "
          f"({100 * spent / total:.2f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["make", "ttft", "batch"])
    parser.add_argument("--shape", default="tinyllama-1.1B")
    parser.add_argument("--model", default=str(FOLDER / "tinyllama-1.1B-Q4_K_M.gguf"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--system", type=int, default=500)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if args.what == "make":
        make(args.shape)
    elif args.what == "ttft":
        ttft(args)
    else:
        batch(args)


if __name__ == "__main__":
    main()
