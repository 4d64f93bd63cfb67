"""How much the generation loop costs beyond the model: `npllm generate`'s loop against the model alone.

    python scripts/bench_loop.py [--model weights/stories260K/stories260K.bin] [--tokens 256] [--repeat 7]

Both run greedy decoding from BOS in one process, on one thread, timed in CPU time (robust to a machine shared with
other jobs): the CLI's loop (LLM.stream with an on_step callback, as `npllm generate` drives it) and the model alone
(forward of one token, LM head, argmax: what `npllm bench` times). Prints tokens per CPU-second of each, best of
--repeat, and their ratio (1.0 would be a loop that costs nothing).
"""

import argparse
import time
from pathlib import Path

import numpy as np

import npllm

WEIGHTS = Path(__file__).resolve().parent.parent / "weights" / "stories260K"


def cli_loop(llm, tokens: int) -> float:
    """Tokens per CPU-second of LLM.stream, greedy, from BOS."""
    count = 0

    def on_step(step) -> None:
        nonlocal count
        count += 1

    start = time.process_time()
    for _ in llm.stream("", tokens, echo=True, on_step=on_step, temperature=0.0):
        pass
    return count / (time.process_time() - start)


def model_alone(llm, tokens: int) -> float:
    """Tokens per CPU-second of forward + lm_head + argmax, one token at a time."""
    model, cache, token = llm.model, llm.model.new_cache(), [llm.config.bos_id]
    model.forward(token, [0], cache)
    start = time.process_time()
    for position in range(1, tokens + 1):
        token = [int(np.argmax(model.lm_head(model.forward(token, [position], cache))[0]))]
    return tokens / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(WEIGHTS / "stories260K.bin"))
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    llm = npllm.load(args.model, args.tokenizer, threads=1)
    cli_loop(llm, 16), model_alone(llm, 16)  # compile and warm up
    loop = max(cli_loop(llm, args.tokens) for _ in range(args.repeat))
    alone = max(model_alone(llm, args.tokens) for _ in range(args.repeat))
    print(f"generate loop {loop:.0f} tok/s, model alone {alone:.0f} tok/s (CPU time, best of {args.repeat}); "
          f"ratio {loop / alone:.2f}")


if __name__ == "__main__":
    main()
