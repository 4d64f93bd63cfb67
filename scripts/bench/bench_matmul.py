"""Matrix products of the model shapes: npllm's Numba kernel against NumPy's BLAS, the measurement behind the
choice to run prefill on npllm's own kernel (docs/bench.md).

    python scripts/bench/bench_matmul.py [--threads T] [--tokens 512] [--repeat 7]

For each weight matrix of stories15M / stories110M it prints GFLOP/s of x @ W.T for T tokens (a prefill) and GB/s
of weights read for one token (a decode step): best of `repeat`, wall clock and CPU time (CPU time is what the
threads spent working, the figure to trust on a machine other processes share).
"""

import argparse
import time

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from npllm.formats.random import NAMED_SHAPES
from npllm.kernels import cpu


def best(run, repeat):
    run()
    wall, cpu_time = [], []
    for _ in range(repeat):
        start, cpu_start = time.perf_counter(), time.process_time()
        run()
        wall.append(time.perf_counter() - start)
        cpu_time.append(time.process_time() - cpu_start)
    return min(wall), min(cpu_time)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    numba.set_num_threads(args.threads)
    threadpool_limits(args.threads, user_api="blas")
    rng = np.random.default_rng(0)
    print(f"threads={args.threads}  prefill: GFLOP/s for {args.tokens} tokens (wall / cpu-per-thread);  "
          f"decode: GB/s for 1 token")
    for name in ("stories15M", "stories110M"):
        c = NAMED_SHAPES[name]
        shapes = {"wqkv": ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim), "wo": (c.dim, c.n_heads * c.head_dim),
                  "w1+w3": (2 * c.hidden_dim, c.dim), "w2": (c.dim, c.hidden_dim), "lm_head": (c.vocab_size, c.dim)}
        for matrix, (N, D) in shapes.items():
            w = rng.standard_normal((N, D), dtype=np.float32)
            panels = cpu.pack_panels(w)
            line = f"{name:12s} {matrix:8s} [{N:5d}, {D:4d}]"
            for T in (args.tokens, 1):
                x = rng.standard_normal((T, D), dtype=np.float32)
                out = np.empty((T, panels.shape[0] * cpu.PANEL), np.float32)
                ours = best(lambda: cpu.matmul_into(x, panels, out, T, args.threads), args.repeat)
                blas = best(lambda: x @ w.T, args.repeat)
                if T > 1:
                    work, unit = 2 * T * N * D / 1e9, "GFLOP/s"
                else:
                    work, unit = w.nbytes / 1e9, "GB/s"
                line += (f" | {'prefill' if T > 1 else 'decode'} numba {work / ours[0]:6.1f} / "
                         f"{work / ours[1] * args.threads:6.1f}  blas {work / blas[0]:6.1f} / "
                         f"{work / blas[1] * args.threads:6.1f} {unit}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
