"""Matrix-vector products on quantized weights (npllm/kernels/quant.py) against the float32 kernel of the same shape,
for every weight matrix of a model shape: the weight-reading part of one decode step.

    python scripts/bench/bench_quant.py [--model stories110M] [--threads 1 2] [--repeat 7] [--resident]

For each type it prints the time of one pass over every matrix of the model (all layers and the LM head, random
weights; attention, norms and sampling not included), the weight bytes read, the rate in GB/s of those bytes, the
time per weight, and the speed relative to float32: best of `repeat` passes (wall clock: the best pass is the one
least disturbed on a machine that other processes share; the best pass's process CPU time follows in brackets:
with one thread, the time the pass ran, however long it waited for a core). Each quantized type with an int8
kernel runs twice: with float32 activations (`matvec`) and with activations quantized to 8-bit blocks (`int8`:
the integer dot products, the activation quantization included in the time); a last column compares the two.
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
    """(best wall-clock seconds, best process CPU seconds) of `repeat` runs after one warm-up run."""
    run()
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        run()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return min(wall), min(cpu)


def matrices(c):
    """(name, [N, K], count per decode step) of a model shape: the products of one token."""
    return [("wqkv", ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim), c.n_layers),
            ("wo", (c.dim, c.n_heads * c.head_dim), c.n_layers), ("w1+w3", (2 * c.hidden_dim, c.dim), c.n_layers),
            ("w2", (c.dim, c.hidden_dim), c.n_layers), ("lm_head", (c.vocab_size, c.dim), 1)]


def build_steps(c, types, int8_types, threads, resident=False):
    """For each kernel ("F32", a type, or "<type> int8"): (run, weight bytes) per matrix of one decode step.
    resident: one array per layer matrix, multiplied once per layer, and no LM head, so the weights stay in cache
    and the pass measures the arithmetic rather than the memory."""
    rng = np.random.default_rng(0)
    kernels = ["F32"] + [k for t in types for k in ([t, f"{t} int8"] if t in int8_types else [t])]
    steps = {k: [] for k in kernels}
    # Every matrix of every layer is its own array, so a pass streams the whole model from memory as decode does
    # (timing one matrix again and again would measure it from cache instead).
    for name, (N, K), count in matrices(c)[:-1] if resident else matrices(c):
        x = rng.standard_normal(K, dtype=np.float32)
        for _ in range(1 if resident else count):
            w = rng.standard_normal((N, K), dtype=np.float32) * 0.02
            panels = cpu.pack_panels(w)
            out = np.empty((1, panels.shape[0] * cpu.PANEL), np.float32)
            steps["F32"].append((lambda x=x, p=panels, o=out: cpu.matmul_into(x[None, :], p, o, 1, threads), w.nbytes))
            for t in types:
                raw = quant.quantize(w, t).reshape(N, -1)
                steps[t].append((lambda x=x, r=raw, t=t: kq.matvec(r, t, x, threads), raw.nbytes))
                if t in int8_types:
                    o = np.empty((1, N), np.float32)
                    steps[f"{t} int8"].append((lambda x=x[None, :], r=raw, o=o, f=kq.INT8_MATMUL_INTO[t]:
                                               f(x, r, o, 1, threads), raw.nbytes))
        if resident:
            for k in steps:
                steps[k] += steps[k][-1:] * (count - 1)
    return steps


def report(c, model, steps, threads, repeat, resident=False):
    shapes = matrices(c)[:-1] if resident else matrices(c)
    weights = sum(N * K * count for _, (N, K), count in shapes)
    what = "the layer matrices, one array each, in cache" if resident else f"{c.n_layers} layers + LM head"
    print(f"{model}, threads={threads}: every matrix product of one decode step ({what}, "
          f"{weights / 1e6:.1f} M weights), best of {repeat} passes")
    seconds = {}
    for kernel, runs in steps.items():
        def one_pass():
            for run, _ in runs:
                run()

        seconds[kernel], cpu_seconds = best(one_pass, repeat)
        nbytes = sum(n for _, n in runs)
        float_act = kernel.removesuffix(" int8")
        versus = f"  {seconds[float_act] / seconds[kernel]:5.2f}x float32 activations" if kernel != float_act else ""
        print(f"  {kernel:10s} {nbytes / 2**20:7.1f} MiB  {seconds[kernel] * 1e3:7.2f} ms  "
              f"{nbytes / seconds[kernel] / 1e9:6.2f} GB/s  {seconds[kernel] / weights * 1e9:6.3f} ns/weight  "
              f"{seconds['F32'] / seconds[kernel]:5.2f}x F32{versus}  (CPU {cpu_seconds * 1e3:.2f} ms)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="stories110M", choices=sorted(NAMED_SHAPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--resident", action="store_true", help="weights kept in cache: the arithmetic's speed")
    args = parser.parse_args()
    numba.set_num_threads(max(args.threads))
    c = NAMED_SHAPES[args.model]
    blocks_fit = [t for t in kq.KERNEL_TYPES if all(K % quant.TYPES[t].block_size == 0 for _, (_, K), _ in matrices(c))]
    for threads in args.threads:
        steps = build_steps(c, blocks_fit, kq.INT8_KERNEL_TYPES, threads, args.resident)
        report(c, args.model, steps, threads, args.repeat, args.resident)


if __name__ == "__main__":
    main()
