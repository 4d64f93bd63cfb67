"""npllm's command line: it parses arguments and calls the Python API, nothing more.

    npllm generate [PROMPT] --model M --tokenizer T --max-new-tokens N --temperature T --top-p P --seed S
    npllm generate --prompt-file FILE ...      one prompt per line, generated together (ragged batching)
    npllm generate [PROMPT] ... --explain [--json]     (each token's candidates through the sampling pipeline)

stdout gets the prompt followed by the completion and nothing else (with --prompt-file, each prompt and its
completion, separated by blank lines); timings go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from .errors import GenerationError, NpllmError


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
    gen.add_argument("--prompt-file", default=None,
                     help="a file with one prompt per line (blank lines skipped), all generated as one batch")
    gen.add_argument("--explain", action="store_true",
                     help="for each token, a table of the top candidates through every sampling stage")
    gen.add_argument("--json", action="store_true", help="with --explain: one JSON object per token instead")
    gen.set_defaults(run=run_generate)
    info = commands.add_parser("info", help="describe a checkpoint: architecture, size, context, tokenizer")
    info.add_argument("model", nargs="?", default="stories260K", help="checkpoint path or known name")
    info.set_defaults(run=run_info)
    return parser


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", default="stories260K",
                        help="checkpoint path or known name (stories260K, stories15M, stories42M, stories110M)")
    parser.add_argument("--tokenizer", "-z", default=None, help="tokenizer path (default: found beside the model)")


def run_generate(args) -> int:
    from . import load

    if args.json and not args.explain:
        raise GenerationError("--json is the machine-readable form of --explain: pass both")
    if args.explain and args.prompt_file is not None:
        raise GenerationError("--explain follows a single prompt: give a PROMPT, not --prompt-file")
    if args.prompt_file is not None:
        return run_generate_batch(args)
    llm = load(args.model, args.tokenizer)
    prompt_ids = llm.tokenizer.encode(args.prompt, bos=True)
    if args.explain:
        from .explain import print_explained
        from .sampling import SamplingParams

        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        print_explained(llm, prompt_ids, args.max_new_tokens, params, as_json=args.json)
        return 0
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


def read_prompt_file(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line for line in f.read().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationError(f"--prompt-file {path}: cannot read it ({e})") from None
    if not prompts:
        raise GenerationError(f"--prompt-file {path}: no prompts in it")
    return prompts


def run_generate_batch(args) -> int:
    from . import load

    if args.prompt:
        raise GenerationError("give either a PROMPT or --prompt-file, not both")
    prompts = read_prompt_file(args.prompt_file)
    llm = load(args.model, args.tokenizer)
    start = time.perf_counter()
    completions = llm.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                               seed=args.seed)
    seconds = time.perf_counter() - start
    sys.stdout.write("\n\n".join(p + c for p, c in zip(prompts, completions)) + "\n")
    sys.stdout.flush()
    print(f"[npllm] {len(prompts)} prompts completed together in {seconds:.2f} s", file=sys.stderr)
    return 0


def run_info(args) -> int:
    from .formats import read_checkpoint
    from .formats.info import describe
    from .hub import resolve

    checkpoint, _ = resolve(args.model)
    config, weights = read_checkpoint(checkpoint)
    print(describe(config, weights, checkpoint))
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
