"""CudaTransformer on a real GPU against its memory-bandwidth roofline, float32, float16 or Q8_0 weight storage.

    python scripts/bench/cuda_timing.py --model stories110M tinyllama-1.1B --dtype float32 float16 q8_0 --batch 1 32

(`npllm bench --backend cuda --weight-dtype float16` gives the same timings without the roofline columns.)

The timing is `npllm bench`'s (bench.Session: random prompts prefilled in one call, greedy decode steps with the
argmax on the device); this script adds the weight storage type and the roofline: a decode step streams every
weight once for the B tokens of the batch, so bandwidth / step bytes * B is the most tokens per second memory
allows. One JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["stories15M"],
                        help="named shapes (random weights) or checkpoints, each loaded once for every --dtype")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=("float32", "float16", "q8_0"))
    parser.add_argument("--stage-by-stage", action="store_true",
                        help="one launch per stage instead of one cooperative launch per forward call")
    args = parser.parse_args()

    from npllm.bench import load_weights
    from npllm.models.cuda import device_bandwidth_gb_s

    bandwidth = device_bandwidth_gb_s()
    print(json.dumps({"device_to_device_gb_s": round(bandwidth, 1)}), flush=True)
    for name in args.model:
        config, weights, kind = load_weights(name)
        for dtype in args.dtype:
            time_one(args, name, kind, config, weights, dtype, bandwidth)
        del weights


def time_one(args, name, kind, config, weights, dtype, bandwidth) -> None:
    """Build the CUDA model of `weights` stored as `dtype`, then one JSON line per batch and prompt length."""
    import gc

    from npllm.bench import Session
    from npllm.models import make_model

    start = time.perf_counter()
    model = make_model(config, weights, "cuda", weight_dtype=dtype, one_launch=not args.stage_by_stage)
    load_s = time.perf_counter() - start
    session = Session(model)
    cold = session.prefill(1, args.prompt_len[0], args.prompt_len[0] + args.gen_len)[3]  # compiles the kernels
    step_bytes = model.step_weight_bytes
    for batch in args.batch:
        for prompt_len in args.prompt_len:
            session.prefill(batch, prompt_len, prompt_len + args.gen_len)  # warm: compiles this batch's kernels
            cache, tokens, prefill_s, first_s = session.prefill(batch, prompt_len, prompt_len + args.gen_len)
            decode_s = session.decode(cache, tokens, prompt_len, args.gen_len)[0]
            step = decode_s / args.gen_len
            print(json.dumps({
                "model": name, "weights": kind, "device": "cuda", "dtype": dtype,
                "launches": "per stage" if args.stage_by_stage else "one per forward", "batch": batch,
                "prompt_len": prompt_len, "gen_len": args.gen_len, "load_s": round(load_s, 2),
                "first_token_cold_ms": round(1e3 * cold, 1),
                "prefill_tok_s": round(batch * prompt_len / prefill_s, 1), "first_token_ms": round(1e3 * first_s, 2),
                "decode_tok_s": round(batch / step, 1), "ms_per_token": round(1e3 * step, 3),
                "weight_bytes_per_step": step_bytes, "achieved_gb_s": round(step_bytes / step / 1e9, 1),
                "bandwidth_gb_s": round(bandwidth, 1), "roofline_tok_s": round(batch * bandwidth * 1e9 / step_bytes, 1),
                "fraction_of_roofline": round(step_bytes / step / 1e9 / bandwidth, 3)}), flush=True)
    del model, session
    gc.collect()

if __name__ == "__main__":
    main()
