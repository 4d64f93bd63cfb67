"""Cost per multiply-add of each quantized type's products, single thread, CPU time: the kernels the model runs
(kernels.quant.matmul_rows_interleaved on rows interleaved by eight, quant.interleave_rows; the types of activations
"two_part" on two 8-bit parts), for each interleaved type at 1, 4, 16 and 64 tokens, with each type's ratio to Q4_0
measured in the same rounds (the types alternate, best of --repeat rounds of 3 calls; this VM's speed moves within
a minute, so the ratios mean more than the picoseconds).

    python scripts/bench/bench_tiles.py [--rows 2048] [--cols 768] [--repeat 7]
    python scripts/bench/bench_tiles.py --quantizer [--repeat 7]

--quantizer times the activations' quantization to 8 bits (kernels.quant.quantize_activations_q8_into, what every
product of the model starts with) on 64 tokens. (The one-row kernels this script also timed, and the rows decoded
into float32, are gone: the model runs every block type interleaved.)
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


def file_rows(W: np.ndarray, qtype: str) -> np.ndarray:
    """W in qtype's blocks; arbitrary blocks with finite scales for the types npllm reads but does not write (the
    kernels' speed does not depend on the values).                                # [N, K] -> [N, row bytes] uint8"""
    if qtype in quant.QUANTIZE:
        return quant.quantize(W, qtype).reshape(W.shape[0], -1)
    t = quant.TYPES[qtype]
    blocks = np.random.default_rng(0).integers(0, 256, (W.size // t.block_size, t.block_bytes), dtype=np.uint8)
    for at in quant.SCALE_FIELDS[qtype]:
        blocks[:, at:at + 2] = np.array([0.01], np.float16).view(np.uint8)
    return blocks.reshape(W.shape[0], -1)


def interleaved(W: np.ndarray, x: np.ndarray, repeat: int) -> None:
    """ps per multiply-add of the interleaved kernels and the ratio to Q4_0, types alternating in each round."""
    (N, K), types = W.shape, ["Q4_0"] + [t for t in quant.INTERLEAVED_TYPES if t != "Q4_0"]
    rows = {t: (quant.interleave_rows(file_rows(W, t), t),
                np.int64(quant.TYPES[t].type_id + kq.INTERLEAVED_CODE)) for t in types}
    print("interleaved, ps per multiply-add (ratio to Q4_0), one thread")
    for T in (1, 4, 16, 64):
        q, d, s = np.empty((T, K), np.int8), np.empty((T, K // 32), np.float32), np.empty((T, K // 32), np.float32)
        s16, out = np.empty((T, K // 16), np.int32), np.empty((T, N), np.float32)
        kq.quantize_activations_q8_into(x[:T], T, q, d, s, s16)
        one = (q, d, s, s16)
        two = (np.empty((T, 2 * K), np.int8), np.empty_like(d), np.empty_like(s), np.empty_like(s16))
        kq.two_part_activations_into(x[:T], T, q, d, *two)  # Q2_K's and Q3_K's (quant.TWO_PART_ACTIVATION_TYPES)
        runs = {t: (lambda w8=w8, code=code, a=two if t in quant.TWO_PART_ACTIVATION_TYPES else one:
                    kq.matmul_rows_interleaved(code, w8, *a, np.int64(T), out, np.int64(0), np.int64(0),
                                               np.int64(N)))
                for t, (w8, code) in rows.items()}
        best = {t: float("inf") for t in types}
        for run in runs.values():
            run()  # compile or load from the cache
        for _ in range(repeat):
            for t, run in runs.items():
                start = time.process_time()
                for _ in range(3):
                    run()
                best[t] = min(best[t], (time.process_time() - start) / 3)
        print(f"T={T:<3d} " + "  ".join(f"{t} {1e12 * best[t] / (N * K * T):5.1f} ({best[t] / best['Q4_0']:.2f})"
                                        for t in types))


def quantizer(x: np.ndarray, repeat: int) -> None:
    """ns per value of quantize_activations_q8_into on x [T, K], one thread, best of `repeat` rounds of 10 calls."""
    T, K = x.shape
    q, d, s = np.empty((T, K), np.int8), np.empty((T, K // 32), np.float32), np.empty((T, K // 32), np.float32)
    s16 = np.empty((T, K // 16), np.int32)
    seconds = best_seconds(lambda: [kq.quantize_activations_q8_into(x, T, q, d, s, s16) for _ in range(10)], repeat)
    print(f"activations quantized to 8 bits: {1e9 * seconds / (10 * T * K):.2f} ns per value ([{T}, {K}], one thread)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=768)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quantizer", action="store_true", help="the activations' quantizer alone")
    args = parser.parse_args()
    N, K = args.rows, args.cols
    rng = np.random.default_rng(0)
    W = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((64, K)).astype(np.float32)
    if args.quantizer:
        quantizer(x, args.repeat)
        return
    interleaved(W, x, args.repeat)

if __name__ == "__main__":
    main()
