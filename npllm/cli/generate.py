"""npllm generate: one prompt streamed (sampled, speculative, beam search or explained), or a file's prompts as one
batch."""

from __future__ import annotations

import sys
import time

from ..errors import GenerationError
from . import shared
from .parser import GENERATE_MODES, GENERATE_NEEDS, check_combinations
from .shared import context_options, print_logprobs, sampling_params, write_out


def check_generate_args(args) -> None:
    """Combinations of generate's options that mean nothing together, refused before anything loads."""
    check_combinations(args, GENERATE_MODES, GENERATE_NEEDS)


def run_generate(args) -> int:
    from ..context import encode_prompt
    from ..generate import check_request

    check_generate_args(args)
    if args.prompt_file is not None:
        return run_generate_batch(args)
    prompt = read_prompt(args.prompt)
    params = sampling_params(args)
    constraint = shared.constraint_of(args)
    llm = shared.load_with_tokenizer(args, kv_dtype=args.kv_dtype)
    if args.context_policy == "error":  # a prompt far past the context is refused before it is encoded whole
        prompt_ids = encode_prompt(llm.tokenizer, llm.config, prompt)
        check_request(llm.config, prompt_ids, args.max_new_tokens)
    else:
        prompt_ids = llm.tokenizer.encode(prompt, bos=True)
    if args.explain:
        from ..explain import print_explained

        print_explained(llm, prompt_ids, args.max_new_tokens, params, as_json=args.json, constraint=constraint)
        return 0
    if args.num_beams > 1:
        return run_beam_search(args, llm, prompt_ids, constraint)
    return stream_generate(args, llm, prompt, len(prompt_ids), params, constraint)


def read_prompt(prompt: str) -> str:
    """The prompt as valid text: "-" reads stdin (one trailing newline dropped). Bytes that are not UTF-8 (which
    Python hands over from argv as lone surrogates) are refused here, not deep inside the tokenizer."""
    if prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GenerationError(f"the prompt read from stdin is not UTF-8 (byte {data[e.start]:#04x} at offset "
                                  f"{e.start})") from None
        prompt = prompt.removesuffix("\n").removesuffix("\r")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GenerationError(f"the prompt is not valid UTF-8 text (character {e.start}: "
                              f"{ascii(prompt[e.start])}); pass text, or '-' to read it from stdin") from None
    return prompt


def stream_generate(args, llm, prompt: str, prompt_len: int, params, constraint=None) -> int:
    """Print the prompt and its completion as the tokens come, then one line of timings on stderr."""
    speculation = speculation_options(args)
    start, first, count = time.perf_counter(), None, 0

    def on_step(step) -> None:
        nonlocal first, count
        first = first or time.perf_counter()
        count += 1
        if params.logprobs:
            print_logprobs(llm.tokenizer, step)

    for piece in llm.stream(prompt, args.max_new_tokens, echo=True, on_step=on_step, params=params, **speculation,
                            constraint=constraint, **context_options(args)):
        write_out(piece)
    write_out("\n")
    print(timing_line(prompt_len, count, start, first, time.perf_counter()), file=sys.stderr)
    if speculation:
        stats = speculation["speculation"]
        print(f"[npllm] speculative: {stats.accepted}/{stats.drafted} drafted tokens accepted (acceptance "
              f"{stats.acceptance_rate:.2f}); {count / max(stats.rounds, 1):.2f} tokens per forward call of the model "
              f"({stats.rounds} calls, {stats.draft_calls} draft calls)", file=sys.stderr)
    return 0


def timing_line(prompt_len: int, count: int, start: float, first: float | None, end: float) -> str:
    """generate's stderr summary: the time to the first new token, and the rate after it where there is one (it
    needs two tokens: with --max-new-tokens 0 or 1, or an immediate end token, there is none to give)."""
    line = f"[npllm] {prompt_len} prompt + {count} new tokens"
    if first is None:
        return f"{line} in {1e3 * (end - start):.1f} ms"
    line += f"; first token {1e3 * (first - start):.1f} ms"
    return f"{line}; {(count - 1) / (end - first):.1f} tok/s after it" if count > 1 else line


def speculation_options(args) -> dict:
    """llm.stream's speculative-decoding keywords from --draft / --draft-layers / --num-draft (empty: off)."""
    if args.draft is None and args.draft_layers is None:
        return {}
    from ..speculative import SpeculationStats

    return {"draft": args.draft, "draft_layers": args.draft_layers, "num_draft": args.num_draft,
            "speculation": SpeculationStats()}


def run_beam_search(args, llm, prompt_ids, constraint=None) -> int:
    """--num-beams: the prompt and the best hypothesis's text on stdout, every hypothesis's score on stderr."""
    from ..generate import stop_ids

    found = llm.beam_search(prompt_ids, args.num_beams, args.max_new_tokens, stop=tuple(args.stop),
                            constraint=constraint)
    best = [t for t in found[0].tokens if t not in stop_ids(llm.config)]
    write_out(llm.completion_text(prompt_ids, best, echo=True, stop=tuple(args.stop)) + "\n")
    for rank, h in enumerate(found):
        print(f"[beam {rank}] score {h.score:.4f} over {len(h.tokens)} tokens", file=sys.stderr)
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
    """--prompt-file: every prompt with its completion on stdout (blank lines between); with --logprobs, each
    prompt's tokens on stderr after the batch, numbered by prompt ("[logprobs 2]")."""
    prompts = read_prompt_file(args.prompt_file)
    params = sampling_params(args)
    constraint = shared.constraint_of(args)
    llm = shared.load_with_tokenizer(args, kv_dtype=args.kv_dtype)

    def on_step(index: int, step) -> None:
        print_logprobs(llm.tokenizer, step, f"[logprobs {index + 1}]")

    start = time.perf_counter()
    completions = llm.generate(prompts, args.max_new_tokens, params=params, constraint=constraint,
                               on_step=on_step if params.logprobs else None)
    seconds = time.perf_counter() - start
    write_out("\n\n".join(p + c for p, c in zip(prompts, completions)) + "\n")
    print(f"[npllm] {len(prompts)} prompts completed together in {seconds:.2f} s", file=sys.stderr)
    return 0
