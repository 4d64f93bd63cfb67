"""Where a prefill's time goes: the whole forward of T tokens against its matrix products alone (products_into on
the same weights, every layer's four calls), in one process, interleaved, best of `repeat`. The difference is
everything else: norms, RoPE, attention, SwiGLU, and quantizing the activations to 8 bits (serial, inside
products_into but outside its parallel region).

    python scripts/bench/prefill_split.py FILE.gguf [THREADS] [T] [REPEAT]      # defaults: 2 threads, 128 tokens, 5

The numba model on any checkpoint (a quantized GGUF, a float32 file: every matrix in its type, F32 as panels).
"""
import sys
import time

import numba
import numpy as np

import npllm
from npllm.models.numba import PER_LAYER, W1, W2, W3, WO, WQ
from npllm.models.numba_products import products_into

path = sys.argv[1]
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
T = int(sys.argv[3]) if len(sys.argv) > 3 else 128
repeat = int(sys.argv[4]) if len(sys.argv) > 4 else 5
llm = npllm.load(path, backend="numba", threads=threads)
model = llm.model
c = model.config
w = model.packed
F = (w.mats[W1, 2] + w.mats[W3, 2]) // 2  # gate and up may be one run of rows (W1 counting both)
D, H, K, Dh = c.dim, c.n_heads, c.n_kv_heads, c.head_dim
rng = np.random.default_rng(0)
h = rng.standard_normal((T, D)).astype(np.float32)
hid = rng.standard_normal((T, F)).astype(np.float32)
qkv = np.empty((T, (H + 2 * K) * Dh), np.float32)
o = np.empty((T, D), np.float32)
gate_up = np.empty((T, 2 * F), np.float32)
tokens = rng.integers(0, c.vocab_size, T)


def products():
    """Every layer's four products_into calls, as _forward makes them (inputs random)."""
    numba.set_num_threads(threads)
    for l in range(c.n_layers):
        m = PER_LAYER * l
        products_into(w.pool, w.mats, m + WQ, np.int64(3), h, T, qkv, threads)
        products_into(w.pool, w.mats, m + WO, np.int64(1), h, T, o, threads)
        products_into(w.pool, w.mats, m + W1, np.int64(2), h, T, gate_up, threads)
        products_into(w.pool, w.mats, m + W2, np.int64(1), hid, T, o, threads)


def forward():
    """The model's forward of T tokens into a fresh cache (no LM head, as npllm bench's prefill)."""
    cache = model.new_cache(T + 8, 1)
    model.forward(tokens, np.arange(T), cache)


products()
forward()
best = {"forward": 1e9, "products": 1e9}
for _ in range(repeat):
    for name, f in (("forward", forward), ("products", products)):
        start = time.perf_counter()
        f()
        best[name] = min(best[name], time.perf_counter() - start)
print(f"{path} threads={threads} T={T}: forward {best['forward']*1e3:.1f} ms, products {best['products']*1e3:.1f} ms, "
      f"the rest {(best['forward'] - best['products'])*1e3:.1f} ms ({1 - best['products'] / best['forward']:.0%})")
