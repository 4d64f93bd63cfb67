"""Speculative decoding against plain decoding, greedy, in one run: tokens/s, acceptance, tokens per model call.

    python scripts/bench/bench_decoding.py [--model weights/stories260K/stories260K.bin] [--shape stories15M] [--tokens 200]

For a checkpoint, drafts are its first N layers; for a named shape (random weights) too, where acceptance says how
often early layers already pick the final argmax of an untrained network (a floor, not a forecast).
"""

import argparse
import time

import numpy as np

from npllm.formats import read_checkpoint
from npllm.formats.random import NAMED_SHAPES, random_weights
from npllm.generate import Request, generate_ids
from npllm.models import make_model
from npllm.sampling import SamplingParams
from npllm.speculative import SpeculationStats, first_layers, speculative_decode


def run(name, config, weights, tokens, prompt, backend):
    model = make_model(config, weights, backend)
    greedy = SamplingParams(temperature=0)
    list(generate_ids(model, prompt, 8, greedy))  # compile
    start = time.perf_counter()
    plain = list(generate_ids(model, prompt, tokens, greedy))
    plain_s = time.perf_counter() - start
    print(f"{name}: plain greedy {len(plain)} tokens, {len(plain) / plain_s:.0f} tok/s")
    for layers in sorted({1, config.n_layers // 2, config.n_layers - 1}):
        for k in (2, 4):
            draft = make_model(*first_layers(config, weights, layers), backend)
            stats = SpeculationStats()
            request = Request(prompt, tokens, greedy)
            list(speculative_decode(model, draft, request, k))  # compile
            stats = SpeculationStats()
            start = time.perf_counter()
            out = list(speculative_decode(model, draft, request, k, stats=stats))
            seconds = time.perf_counter() - start
            assert out == plain, "greedy speculation must reproduce plain greedy"
            print(f"  draft {layers}/{config.n_layers} layers, K={k}: acceptance {stats.acceptance_rate:.2f}, "
                  f"{len(out) / stats.rounds:.2f} tokens per model call, {len(out) / seconds:.0f} tok/s "
                  f"(x{plain_s / seconds:.2f})")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="weights/stories260K/stories260K.bin")
    parser.add_argument("--shape", default="stories15M")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--backend", default="numba")
    args = parser.parse_args()
    config, weights = read_checkpoint(args.model)
    run(args.model, config, weights, args.tokens, [config.bos_id], args.backend)
    shape = NAMED_SHAPES[args.shape]
    run(f"{args.shape} shape (random weights)", shape, random_weights(shape), min(args.tokens, 120),
        [shape.bos_id, 100, 200], args.backend)


if __name__ == "__main__":
    main()
