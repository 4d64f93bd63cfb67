"""Time CudaTransformer on a real GPU: prefill and greedy decode (argmax on the device) for a named shape with
random weights, set against the GPU's memory bandwidth measured in the same run. One JSON object per line.

    python scripts/cuda_timing.py --model tinyllama-1.1B --batch 1 32 --prompt-len 128 512 --gen-len 128

Decode at batch B reads every weight once per step for B tokens: weight_bytes / step time is the achieved
bandwidth, and bandwidth / weight_bytes * B the roofline tok/s. The device runs asynchronously: every timed
interval ends with a synchronize, so the figures are of work done, not of work queued.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def device_bandwidth_gb_s(cuda, mib: int = 2048, repeat: int = 5) -> float:
    """Device-to-device copy of `mib` MiB, best of `repeat`: it reads and writes each byte once."""
    a = cuda.to_device(np.ones(mib * 2**20 // 4, np.float32))
    b = cuda.device_array_like(a)
    best = float("inf")
    for _ in range(repeat):
        cuda.synchronize()
        start = time.perf_counter()
        b.copy_to_device(a)
        cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * a.nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="stories15M")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    args = parser.parse_args()

    from numba import cuda

    from npllm.cuda_model import CudaTransformer
    from npllm.formats.random import NAMED_SHAPES, random_weights

    config = NAMED_SHAPES[args.model]
    start = time.perf_counter()
    model = CudaTransformer(config, random_weights(config), dtype=np.dtype(args.dtype))
    load_s = time.perf_counter() - start
    bandwidth = device_bandwidth_gb_s(cuda)
    rng = np.random.default_rng(0)

    def prefill(batch, prompt_len):
        cache = model.new_cache(prompt_len + args.gen_len + 1, batch)
        tokens = rng.integers(0, config.vocab_size, batch * prompt_len)
        positions, slots = np.tile(np.arange(prompt_len), batch), np.repeat(np.arange(batch), prompt_len)
        cuda.synchronize()
        start = time.perf_counter()
        hidden = model.forward(tokens, positions, cache, slots)
        cuda.synchronize()
        prefill_s = time.perf_counter() - start
        ids = model.sample(hidden[prompt_len - 1::prompt_len], 0, 0, 1.0, 0.0)  # copies ids back: synchronous
        return cache, ids, prefill_s, time.perf_counter() - start

    start = time.perf_counter()
    prefill(1, args.prompt_len[0])  # compiles every kernel it uses
    cold_s = time.perf_counter() - start
    for batch in args.batch:
        for prompt_len in args.prompt_len:
            prefill(batch, prompt_len)  # warm: the decode kernel for this batch is compiled below
            cache, ids, prefill_s, first_s = prefill(batch, prompt_len)
            slots = np.arange(batch)
            ids = model.sample(model.forward(ids, np.full(batch, prompt_len), cache, slots), 0, 0, 1.0, 0.0)
            start = time.perf_counter()
            for step in range(1, args.gen_len):
                hidden = model.forward(ids, np.full(batch, prompt_len + step), cache, slots)
                ids = model.sample(hidden, 0, 0, 1.0, 0.0)  # only the ids come back
            step_s = (time.perf_counter() - start) / (args.gen_len - 1)
            weight_bytes = model.step_weight_bytes
            print(json.dumps({
                "model": args.model, "device": "cuda", "dtype": args.dtype, "batch": batch,
                "prompt_len": prompt_len, "gen_len": args.gen_len, "load_s": round(load_s, 2),
                "first_token_cold_ms": round(1e3 * cold_s, 1), "prefill_tok_s": round(batch * prompt_len / prefill_s, 1),
                "first_token_ms": round(1e3 * first_s, 2), "decode_tok_s": round(batch / step_s, 1),
                "ms_per_token": round(1e3 * step_s, 3), "weight_bytes_per_token": weight_bytes // batch,
                "achieved_gb_s": round(weight_bytes / step_s / 1e9, 1), "bandwidth_gb_s": round(bandwidth, 1),
                "roofline_tok_s": round(batch * bandwidth * 1e9 / weight_bytes, 1),
                "fraction_of_roofline": round(weight_bytes / step_s / 1e9 / bandwidth, 3)}), flush=True)


if __name__ == "__main__":
    main()
