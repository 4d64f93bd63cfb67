"""npllm quantize: any checkpoint npllm reads, written as a GGUF file of a quantized type."""

from __future__ import annotations

import sys

from ..quant import MIXTURES
from .shared import one_model


def quantize_progress(stream=None):
    """A progress line for `npllm quantize` on a terminal (stderr), rewritten after each weight, or None where
    stderr is a file or a pipe (a log keeps only the summary)."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None

    def show(done: int, total: int, name: str) -> None:
        print(f"\r\033[K[npllm] quantized {done}/{total} tensors ({name})", end="\n" if done == total else "",
              file=stream, flush=True)

    return show


def run_quantize(args) -> int:
    from collections import Counter

    from ..convert import quantize_checkpoint
    from ..formats.gguf_write import fallbacks, quant_type

    source = one_model(args.input, args.model_option)
    tensors, tokenizer = quantize_checkpoint(source, args.output, args.type.upper(), args.tokenizer,
                                             progress=quantize_progress())
    counts, sizes = Counter(t.type_name for t in tensors), Counter()
    for t in tensors:
        sizes[t.type_name] += t.raw.size
    parts = ", ".join(f"{name} x{counts[name]} ({sizes[name] / 2**20:.2f} MiB)" for name in sorted(counts))
    vocab = f"vocabulary of {tokenizer.name}" if tokenizer is not None else "no vocabulary (pass --tokenizer)"
    print(f"[npllm] wrote {args.output}: {len(tensors)} tensors: {parts}; {vocab}", file=sys.stderr)
    wanted = args.type.upper()
    block = quant_type(MIXTURES.get(wanted, (wanted,))[0]).block_size
    for (stored, row), n in sorted(fallbacks(tensors, wanted).items()):
        print(f"[npllm] {n} {'matrix' if n == 1 else 'matrices'} with rows of {row} values stored as {stored}: "
              f"{wanted} needs rows that split into blocks of {block}", file=sys.stderr)
    return 0
