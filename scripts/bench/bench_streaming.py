"""One decode product with its weights in the cache, and streamed from memory: whether decode is bound by the
kernel's instructions or by the memory bus on this machine.

    python scripts/bench/bench_streaming.py [--types Q4_0 Q8_0 Q4_K] [--rows 2048] [--cols 768] [--mb 300] [--rounds 3]

One thread, one token (what a decode step runs), the kernel the model runs (kernels.quant.matmul_rows_interleaved
on rows interleaved by eight): first the same matrix again and again (it stays in L2), then a new copy each call,
cycling through --mb megabytes of copies (more than the last-level cache, so each call reads its bytes from
memory). Beside them, NumPy's sum of the same number of megabytes: what one core can read from memory at all.
"""

import argparse
import time

import numpy as np

from npllm import quant
from npllm.kernels import quant as kq


def per_call(w8s, code, q, d, s, s16, out) -> float:
    """Seconds per call, cycling through w8s."""
    start = time.perf_counter()
    for w8 in w8s:
        kq.matmul_rows_interleaved(code, w8, q, d, s, s16, 1, out, 0, 0, out.shape[1])
    return (time.perf_counter() - start) / len(w8s)


def measure(qtype: str, rows: int, cols: int, mb: float, rounds: int) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w8 = quant.interleave_rows(quant.quantize(w, qtype).reshape(rows, -1), qtype)
    copies = [w8.copy() for _ in range(max(2, int(mb * 1e6 / w8.nbytes)))]
    x = rng.standard_normal((1, cols)).astype(np.float32)
    q, d = np.empty((1, cols), np.int8), np.empty((1, cols // 32), np.float32)
    s, s16 = np.empty((1, cols // 32), np.float32), np.empty((1, cols // 16), np.int32)
    kq.quantize_activations_q8_into(x, 1, q, d, s, s16)
    if qtype in quant.TWO_PART_ACTIVATION_TYPES:
        v, d_v, s_v, s16_v = np.empty((1, 2 * cols), np.int8), np.empty_like(d), np.empty_like(s), np.empty_like(s16)
        kq.two_part_activations_into(x, 1, q, d, v, d_v, s_v, s16_v)
        q, d, s, s16 = v, d_v, s_v, s16_v
    out, code = np.empty((1, rows), np.float32), kq.INTERLEAVED_CODE + quant.TYPES[qtype].type_id
    per_call([w8], code, q, d, s, s16, out)  # compile or load the kernel
    for r in range(rounds):
        resident = min(per_call([w8] * 20, code, q, d, s, s16, out) for _ in range(3))
        streamed = per_call(copies, code, q, d, s, s16, out)
        macs = rows * cols
        print(f"{qtype} round {r + 1}: in cache {resident / macs * 1e12:6.1f} ps per multiply-add "
              f"({w8.nbytes / resident / 1e9:5.1f} GB/s of weights); from memory {streamed / macs * 1e12:6.1f} "
              f"({w8.nbytes / streamed / 1e9:5.1f} GB/s)", flush=True)


def numpy_read_gb_s(mb: float) -> float:
    a = np.ones(int(mb * 1e6 / 8), np.float64)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - start) / 1e9)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0", "Q4_K"])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=768)
    parser.add_argument("--mb", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"NumPy's sum of {args.mb:.0f} MB on one core: {numpy_read_gb_s(args.mb):.1f} GB/s")
    for qtype in args.types:
        measure(qtype, args.rows, args.cols, args.mb, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
