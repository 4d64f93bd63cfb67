"""npllm info: a checkpoint's architecture, size, context and tokenizer."""

from __future__ import annotations

from .shared import one_model


def run_info(args) -> int:
    from ..formats import read_checkpoint
    from ..info import describe
    from ..hub import resolve

    checkpoint, _ = resolve(one_model(args.model, args.model_option, default="stories260K"))
    config, weights = read_checkpoint(checkpoint)  # a GGUF file's matrices as stored
    print(describe(config, weights, checkpoint))
    return 0
