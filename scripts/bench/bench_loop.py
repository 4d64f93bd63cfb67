"""How much the generation loop costs beyond the model: `npllm generate`'s loop against the model alone.

    python scripts/bench/bench_loop.py [--model weights/stories260K/stories260K.bin] [--tokens 256] [--repeat 7]
    python scripts/bench/bench_loop.py --wall --threads 2     # wall clock, as `npllm generate` and `npllm bench` run

Both run from BOS in one process, on one thread, timed in CPU time (robust to a machine shared with other jobs):
the CLI's loop (LLM.stream with an on_step callback, as `npllm generate` drives it) and the model alone (`npllm bench`'s
decode loop: forward of one token, LM head, greedy id). The loop runs twice: greedy, and with the CLI's default
sampling (temperature 1, top-p 0.9). Prints tokens per CPU-second of each, best of --repeat, and their ratios to
the model alone (1.0 would be a loop that costs nothing).
"""

import argparse
import time
from pathlib import Path


import npllm
from npllm.bench import Session

WEIGHTS = Path(__file__).resolve().parents[2] / "weights" / "stories260K"


GREEDY = {"temperature": 0.0}
CLI_DEFAULT = {"temperature": 1.0, "top_p": 0.9, "seed": 0}  # what `npllm generate` samples with unless told


CLOCK = time.process_time  # --wall: time.perf_counter


def cli_loop(llm, tokens: int, sampling: dict) -> float:
    """Tokens per second (CLOCK) of LLM.stream from BOS (ignoring EOS, so that every run makes `tokens` tokens)."""
    count = 0

    def on_step(step) -> None:
        nonlocal count
        count += 1

    start = CLOCK()
    for _ in llm.stream("", tokens, echo=True, on_step=on_step, ignore_eos=True, **sampling):
        pass
    return count / (CLOCK() - start)


def model_alone(llm, tokens: int) -> float:
    """Tokens per second (CLOCK) of `npllm bench`'s own decode loop (bench.Session: forward of one token, then the
    greedy id through the model's sampler), after the same one-token prompt."""
    session = Session(llm.model)
    cache, token, _, _ = session.prefill(1, 1, tokens + 1)
    wall_seconds, cpu_seconds = session.decode(cache, token, 1, tokens)
    return tokens / (wall_seconds if CLOCK is time.perf_counter else cpu_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(WEIGHTS / "stories260K.bin"))
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true", help="time in wall-clock seconds, not CPU seconds")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.wall else time.process_time
    llm = npllm.load(args.model, args.tokenizer, threads=args.threads)
    cli_loop(llm, 16, GREEDY), cli_loop(llm, 16, CLI_DEFAULT), model_alone(llm, 16)  # compile and warm up
    best = {"greedy": 0.0, "sampled": 0.0, "alone": 0.0}
    for _ in range(args.repeat):  # interleaved, so that a slow spell of the machine hits all three
        best["greedy"] = max(best["greedy"], cli_loop(llm, args.tokens, GREEDY))
        best["sampled"] = max(best["sampled"], cli_loop(llm, args.tokens, CLI_DEFAULT))
        best["alone"] = max(best["alone"], model_alone(llm, args.tokens))
    alone = best["alone"]
    print(f"model alone {alone:.0f} tok/s; generate loop greedy {best['greedy']:.0f} tok/s (ratio "
          f"{best['greedy'] / alone:.2f}), temperature 1 + top-p 0.9 {best['sampled']:.0f} tok/s (ratio "
          f"{best['sampled'] / alone:.2f}) ({'wall clock' if args.wall else 'CPU time'}, {args.threads} thread(s), best of "
          f"{args.repeat})")


if __name__ == "__main__":
    main()
