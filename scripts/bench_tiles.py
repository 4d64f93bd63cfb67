"""Cost per multiply-add of each quantized type's products, single thread, CPU time: the 8-bit-activation integer
dots (kernels.quant.matmul_int8) at 1, 4, 16 and 64 tokens, and the rows decoded into float32 then multiplied
(kernels.quant.matmul_rows, what the model takes for types without integer dots; until the K-quants were
interleaved, for those from 16-100 tokens a call). The one-row kernels: the interleaved ones are in docs/quant.md.

    python scripts/bench_tiles.py [--rows 2048] [--cols 768] [--repeat 5]
"""

import argparse
import time

import numpy as np

from npllm import quant
from npllm.kernels import quant as kq


def best_seconds(run, repeat: int) -> float:
    run()  # compile or load from the cache
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=768)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    N, K = args.rows, args.cols
    rng = np.random.default_rng(0)
    W = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((64, K)).astype(np.float32)
    out = np.empty((64, N), np.float32)
    print("ps per multiply-add, one thread   " + "  ".join(f"T={T:<3d}" for T in (1, 4, 16, 64)))
    for qtype in kq.INT8_KERNEL_TYPES:
        w = quant.quantize(W, qtype).reshape(N, -1)
        code = np.int64(quant.TYPES[qtype].type_id)
        int8 = [best_seconds(lambda: kq.matmul_int8(w, qtype, x[:T], 1), args.repeat) / (N * K * T) for T in
                (1, 4, 16, 64)]
        rows = [best_seconds(lambda: kq.matmul_rows(code, w, x, np.int64(T), out, np.int64(0), np.int64(0),
                                                    np.int64(N)), args.repeat) / (N * K * T) for T in (1, 4, 16, 64)]
        print(f"{qtype:5s} integer dots on 8-bit x   " + "  ".join(f"{1e12 * c:5.0f}" for c in int8))
        print(f"{qtype:5s} rows decoded to float32   " + "  ".join(f"{1e12 * c:5.0f}" for c in rows))


if __name__ == "__main__":
    main()
