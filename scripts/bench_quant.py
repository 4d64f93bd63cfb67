"""Matrix-vector products on quantized weights (npllm/kernels/quant.py) against the float32 kernel of the same shape,
for every weight matrix of a model shape: the weight-reading part of one decode step.

    python scripts/bench_quant.py [--model stories110M] [--threads 2] [--repeat 15]

For each type it prints the time of one pass over every matrix of the model (all layers and the LM head, random
weights; attention, norms and sampling not included), the weight bytes read, the rate in GB/s of those bytes, and
the speed relative to float32: best of `repeat` passes (wall clock: the best pass is the one least disturbed on a
machine that other processes share).
"""

import argparse
import time

import numba
import numpy as np

from npllm import quant
from npllm.formats.random import NAMED_SHAPES
from npllm.kernels import cpu
from npllm.kernels import quant as kq


def best(run, repeat):
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def matrices(c):
    """(name, [N, K], count per decode step) of a model shape: the products of one token."""
    return [("wqkv", ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim), c.n_layers),
            ("wo", (c.dim, c.n_heads * c.head_dim), c.n_layers), ("w1+w3", (2 * c.hidden_dim, c.dim), c.n_layers),
            ("w2", (c.dim, c.hidden_dim), c.n_layers), ("lm_head", (c.vocab_size, c.dim), 1)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="stories110M", choices=sorted(NAMED_SHAPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    c = NAMED_SHAPES[args.model]
    shapes = matrices(c)
    types = ["F32"] + [t for t in kq.KERNEL_TYPES if all(K % quant.TYPES[t].block_size == 0 for _, (_, K), _ in shapes)]
    # Every matrix of every layer is its own array, so a pass streams the whole model from memory as decode does
    # (timing one matrix again and again would measure it from cache instead).
    steps = {t: [] for t in types}
    for name, (N, K), count in shapes:
        x = rng.standard_normal(K, dtype=np.float32)
        for _ in range(count):
            w = rng.standard_normal((N, K), dtype=np.float32) * 0.02
            panels = cpu.pack_panels(w)
            out = np.empty((1, panels.shape[0] * cpu.PANEL), np.float32)
            steps["F32"].append((lambda x=x, p=panels, o=out: cpu.matmul_into(x[None, :], p, o, 1, args.threads),
                                 w.nbytes))
            for t in types[1:]:
                raw = quant.quantize(w, t).reshape(N, -1)
                steps[t].append((lambda x=x, r=raw, t=t: kq.matvec(r, t, x, args.threads), raw.nbytes))
    print(f"{args.model}, threads={args.threads}: every matrix product of one decode step "
          f"({c.n_layers} layers + LM head), best of {args.repeat} passes")
    f32_seconds = None
    for t in types:
        def one_pass():
            for run, _ in steps[t]:
                run()

        seconds = best(one_pass, args.repeat)
        nbytes = sum(n for _, n in steps[t])
        f32_seconds = f32_seconds or seconds
        print(f"  {t:5s} {nbytes / 2**20:8.1f} MiB  {seconds * 1e3:7.2f} ms  {nbytes / seconds / 1e9:6.2f} GB/s  "
              f"{f32_seconds / seconds:5.2f}x F32's speed")


if __name__ == "__main__":
    main()
