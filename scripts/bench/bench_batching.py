"""Benchmark of batched generation: aggregate decode throughput by batch size, and the work each strategy wastes.

    python scripts/bench/bench_batching.py                      # everything (a few minutes on 2 cores)
    python scripts/bench/bench_batching.py --only throughput    # or: --only waste

Throughput: B greedy requests with 8-token prompts decode together (ContinuousEngine, B slots); the first step
(the prefill) is not timed, the rest are: tokens produced / seconds = aggregate decode tok/s. Models: stories260K
(the real checkpoint, found through $NPLLM_WEIGHTS or weights/) and a random model with the stories15M shape (its
stop ids removed, so every sequence runs to the token limit).

Waste: token-positions (rows through the layers) and predictions (rows through lm_head that were drawn from)
computed beyond what the outputs need, for the seed's workload (one 1-token prompt and three 100-token prompts)
and a mixed workload (64 story prompts of 1..~200 tokens, sampled until each story ends or 384 tokens, at most 16
at a time: static and ragged take them in batches of 16 in order, continuous keeps 16 slots busy). Occupancy is the
share of slot-steps that produced a token some output keeps.

Timings on a shared machine vary with its load; the header prints the load average and OPENBLAS_NUM_THREADS (with
other processes on the cores, OPENBLAS_NUM_THREADS=1 avoids OpenBLAS threads waiting on each other).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import npllm  # noqa: E402
from npllm.batching import ContinuousEngine, Request, Work, ragged_generate, static_generate  # noqa: E402
from npllm.formats.random import NAMED_SHAPES, random_weights  # noqa: E402
from npllm.models.reference import Transformer  # noqa: E402
from npllm.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0)


def weights_root() -> Path:
    return Path(os.environ["NPLLM_WEIGHTS"]) if os.environ.get("NPLLM_WEIGHTS") else REPO / "weights"


def decode_rate(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(aggregate decode tok/s, ms per decode step) for all prompts decoding together, prefill excluded."""
    engine = ContinuousEngine(model, slots=len(prompts))
    for p in prompts:
        engine.submit(Request(p, new_tokens, GREEDY))
    engine.step()  # the prefill of every prompt, and each one's first token
    start, produced, steps = time.perf_counter(), 0, 0
    while engine.busy:
        produced += len(engine.step())
        steps += 1
    seconds = time.perf_counter() - start
    return produced / seconds, 1e3 * seconds / steps


def throughput(story: list[int]) -> None:
    real = npllm.load(weights_root() / "stories260K" / "stories260K.bin").model
    shape = NAMED_SHAPES["stories15M"].replace(eos_ids=())
    fake = Transformer(shape, random_weights(shape, seed=0))
    rng = np.random.default_rng(0)
    models = [("stories260K (real)", real, lambda b: [[1] + story[8 * b + 1:8 * b + 8] for b in range(64)], 64),
              ("stories15M shape (random)", fake, lambda b: [list(rng.integers(3, 32000, 8)) for _ in range(64)], 32)]
    print("aggregate decode throughput (greedy, 8-token prompts, prefill not timed; best of 2 runs)")
    print(f"{'model':28} {'batch':>5} {'tok/s':>9} {'ms/step':>8} {'x batch 1':>9}")
    for name, model, make_prompts, new_tokens in models:
        prompts = make_prompts(0)
        base = None
        for B in (1, 4, 16, 64):
            rate, ms = max(decode_rate(model, prompts[:B], new_tokens) for _ in range(2))
            base = base or rate
            print(f"{name:28} {B:5d} {rate:9.1f} {ms:8.2f} {rate / base:9.2f}")


def work_row(name: str, work: Work, seconds: float, slots: int) -> str:
    occupancy = work.needed_samples / (work.steps * slots)  # slot-steps that produced a token the output keeps
    return (f"{name:11} {work.steps:6d} {work.rows:8d} {work.needed_rows:8d} {work.wasted_rows:8d} "
            f"{work.samples:8d} {work.wasted_samples:8d} {occupancy:9.2f} {seconds:7.1f}")


def run_strategies(model, requests: list[Request], max_gen_len: int, slots: int) -> list[str]:
    """Static and ragged in consecutive batches of `slots` requests, continuous with `slots` slots."""
    lines = []
    batches = [requests[i:i + slots] for i in range(0, len(requests), slots)]
    work, start = Work(), time.perf_counter()
    for batch in batches:  # Meta's algorithm has one parameter set per batch; requests here share theirs
        rngs = [np.random.default_rng(r.params.seed) for r in batch]
        static_generate(model, [list(r.prompt) for r in batch], max_gen_len, batch[0].params, rngs, work=work)
    lines.append(work_row("static", work, time.perf_counter() - start, slots))
    work, start = Work(), time.perf_counter()
    for batch in batches:
        ragged_generate(model, batch, work=work)
    lines.append(work_row("ragged", work, time.perf_counter() - start, slots))
    engine, start = ContinuousEngine(model, slots=slots), time.perf_counter()
    for r in requests:
        engine.submit(r)
    for _ in engine.run():
        pass
    lines.append(work_row("continuous", engine.work, time.perf_counter() - start, slots))
    return lines


def waste(story: list[int]) -> None:
    model = npllm.load(weights_root() / "stories260K" / "stories260K.bin").model
    header = (f"{'strategy':11} {'steps':>6} {'rows':>8} {'needed':>8} {'wasted':>8} {'samples':>8} {'wasted':>8} "
              f"{'occupancy':>9} {'seconds':>7}")

    print("\nseed workload: one 1-token prompt and three 100-token prompts, greedy, max_gen_len 64, stories260K")
    print(header)
    seed_prompts = [[1]] + [[1] + story[100 * i + 1:100 * i + 100] for i in range(3)]
    for line in run_strategies(model, [Request(p, 64, GREEDY) for p in seed_prompts], 64, slots=4):
        print(line)

    print("\nmixed workload: 64 story prompts (lengths 1..~200, long-tailed), temperature 1.0, top-p 0.95, a seed "
          "each,\nmax_gen_len 384 (most stories end earlier), at most 16 sequences at a time, stories260K")
    print(header)
    rng = np.random.default_rng(0)
    lengths = np.minimum(1 + rng.lognormal(3.0, 1.0, 64).astype(int), 200)
    starts = rng.integers(1, len(story) - 200, 64)
    requests = [Request([1] + story[s:s + n - 1], 384, SamplingParams(temperature=1.0, top_p=0.95, seed=i))
                for i, (s, n) in enumerate(zip(starts, lengths))]
    for line in run_strategies(model, requests, 384, slots=16):
        print(line)
    print(f"(prompt lengths: min {lengths.min()}, median {int(np.median(lengths))}, max {lengths.max()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["throughput", "waste"], default=None)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    llm = npllm.load(weights_root() / "stories260K" / "stories260K.bin")
    story = llm.tokenizer.encode((weights_root() / "stories260K" / "greedy_200.txt").read_text() * 4, bos=True)
    if args.only in (None, "throughput"):
        throughput(story)
    if args.only in (None, "waste"):
        waste(story)


if __name__ == "__main__":
    main()
