"""The Numba attention kernel alone (kernels/cpu.py attention_ring_into), as the model calls it: a prefill of T
tokens into an empty ring, and one decode step after S positions. Prints ns per (query head, key) pair, best of
`repeat` (one thread unless THREADS says otherwise).

    python scripts/bench/bench_attention.py [H] [K] [Dh] [T] [S] [THREADS] [REPEAT]   # defaults: 12 12 64 128 128 1 9

To compare two versions, run it with PYTHONPATH at a checkout of each, in alternated processes (this VM's speed
moves by up to 2x between minutes): `PYTHONPATH=/tmp/old python scripts/bench/bench_attention.py`.
"""
import sys
import time

import numba
import numpy as np

from npllm.kernels import cpu

H, K, Dh, T, S, threads, repeat = [int(a) for a in sys.argv[1:8]] + [12, 12, 64, 128, 128, 1, 9][len(sys.argv) - 1:]
numba.set_num_threads(threads)
rng = np.random.default_rng(0)


def ring(capacity, held):
    """An empty ring of one slot, or one holding positions 0 .. held-1."""
    k = rng.standard_normal((1, capacity, K, Dh)).astype(np.float32)
    v = rng.standard_normal((1, capacity, K, Dh)).astype(np.float32)
    positions = np.full((1, capacity), -1, np.int64)
    positions[0, :held] = np.arange(held)
    return k, v, positions


def call(first, n, capacity, held):
    """attention_ring_into of n tokens at positions first .. first+n-1 of one sequence."""
    qkv = rng.standard_normal((n, (H + 2 * K) * Dh)).astype(np.float32)
    k, v, ring_pos = ring(capacity, held)
    out = np.empty((n, H * Dh), np.float32)
    args = (qkv, H, K, np.arange(first, first + n), cpu.Sequences(np.arange(n), np.array([0, n]), np.array([0])),
            np.array([0], np.int64), cpu.LayerRing(k, v, ring_pos),
            cpu.AttentionOptions(capacity, 1.0 / np.sqrt(Dh), 0.0), out)
    return lambda: cpu.attention_ring_into(*args)


def best(f, calls):
    f()
    fastest = 1e9
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        fastest = min(fastest, (time.perf_counter() - start) / calls)
    return fastest


prefill = best(call(0, T, T + 8, 0), 1)
decode = best(call(S, 1, S + 8, S), 100)
print(f"H={H} K={K} Dh={Dh}, {threads} thread(s): prefill of {T}: {prefill * 1e3:.3f} ms, "
      f"{prefill * 1e9 / (T * (T + 1) / 2 * H):.1f} ns per (query head, key); decode after {S}: {decode * 1e6:.1f} us, "
      f"{decode * 1e9 / ((S + 1) * H):.1f} ns per (query head, key)")
