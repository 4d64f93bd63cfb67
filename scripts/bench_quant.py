"""Matrix-vector products on quantized weights (npllm/kernels/quant.py) against the float32 kernel of the same shape:
GB/s of weight bytes read per product, and the time per product, which is what decode speed follows.

    python scripts/bench_quant.py [--threads 2] [--repeat 7] [--shape 2048 768] [--tokens 0]

Best of `repeat` runs, wall clock and CPU time (on a machine that other processes share, CPU time is the figure to
trust). With --tokens T > 0 it also times the matrix-matrix product for T tokens (GFLOP/s).
"""

import argparse
import time

import numba
import numpy as np

from npllm import quant
from npllm.kernels import cpu
from npllm.kernels import quant as kq


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
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--shape", type=int, nargs=2, default=[2048, 768], metavar=("N", "K"),
                        help="weight matrix [N, K] (default: stories110M's FFN gate, 2048 x 768)")
    parser.add_argument("--tokens", type=int, default=0, help="also time x @ W.T for this many tokens")
    args = parser.parse_args()
    numba.set_num_threads(args.threads)
    N, K = args.shape
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, K), dtype=np.float32)
    x = rng.standard_normal(K, dtype=np.float32)
    xs = rng.standard_normal((args.tokens, K), dtype=np.float32)

    panels = cpu.pack_panels(w)
    x1 = x[None, :]
    out = np.empty((1, panels.shape[0] * cpu.PANEL), np.float32)
    f32 = best(lambda: cpu.matmul_into(x1, panels, out, 1, args.threads), args.repeat)
    print(f"[{N}, {K}] threads={args.threads}: matvec, weight bytes per second (wall / cpu) and time per product")
    print(f"  {'F32':5s} {w.nbytes / 2**20:7.2f} MiB  {w.nbytes / f32[0] / 1e9:6.2f} / {w.nbytes / f32[1] / 1e9:6.2f} "
          f"GB/s  {f32[0] * 1e6:8.1f} us   (npllm's float32 panel kernel)")
    for qtype in kq.KERNEL_TYPES:
        if K % quant.TYPES[qtype].block_size:
            continue
        raw = quant.quantize(w, qtype).reshape(N, -1)
        t = best(lambda: kq.matvec(raw, qtype, x, args.threads), args.repeat)
        line = (f"  {qtype:5s} {raw.nbytes / 2**20:7.2f} MiB  {raw.nbytes / t[0] / 1e9:6.2f} / "
                f"{raw.nbytes / t[1] / 1e9:6.2f} GB/s  {t[0] * 1e6:8.1f} us   {f32[0] / t[0]:.2f}x F32's speed")
        if args.tokens:
            m = best(lambda: kq.matmul(raw, qtype, xs, args.threads), args.repeat)
            line += f";  matmul T={args.tokens}: {2 * args.tokens * N * K / m[0] / 1e9:.1f} GFLOP/s"
        print(line)


if __name__ == "__main__":
    main()
