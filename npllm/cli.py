"""npllm's command line: it parses arguments and calls the Python API, nothing more.

    npllm generate [PROMPT] --model M --tokenizer T --max-new-tokens N --temperature T --top-p P --seed S

stdout gets the prompt followed by the completion and nothing else; timings go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from .errors import NpllmError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npllm", description="A readable NumPy Llama inference engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="continue a prompt, streaming text to stdout")
    gen.add_argument("prompt", nargs="?", default="", help="text to continue (default: start from BOS)")
    add_model_arguments(gen)
    gen.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    gen.add_argument("--top-p", type=float, default=0.9, help="nucleus mass in (0, 1] (default 0.9)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    gen.set_defaults(run=run_generate)
    return parser


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", default="stories260K",
                        help="checkpoint path or known name (stories260K, stories15M, stories42M, stories110M)")
    parser.add_argument("--tokenizer", "-z", default=None, help="tokenizer path (default: found beside the model)")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                        help="cpu, cuda (NVIDIA GPU via numba.cuda) or auto (CUDA when usable; default cpu)")


def run_generate(args) -> int:
    from . import load

    llm = load(args.model, args.tokenizer, device=args.device)
    prompt_ids = llm.tokenizer.encode(args.prompt, bos=True)
    decoder = llm.tokenizer.stream_decoder()
    sys.stdout.write("".join(decoder.feed(t) for t in prompt_ids))
    start, first, count = time.perf_counter(), None, 0
    for token in llm.generate_ids(prompt_ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed):
        first = first or time.perf_counter()
        count += 1
        sys.stdout.write(decoder.feed(token))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    end = time.perf_counter()
    rate = (count - 1) / (end - first) if count > 1 else float("nan")
    print(f"[npllm] {len(prompt_ids)} prompt + {count} new tokens; first token {1e3 * ((first or end) - start):.1f} ms;"
          f" {rate:.1f} tok/s after it", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except NpllmError as e:
        print(f"npllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
