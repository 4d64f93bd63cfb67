"""`npllm quantize`: any checkpoint npllm reads written as a GGUF file, with its tokenizer's vocabulary.

It joins three layers the readers keep apart (a known name or path resolved by the hub, the checkpoint read by a
format reader, the vocabulary by a tokenizer) and hands the lot to formats.gguf_write.write_gguf.
"""

from __future__ import annotations

import os

from .formats import read_checkpoint
from .formats.gguf import read_gguf_file, read_vocab
from .formats.gguf_write import TensorData, check_output_path, write_gguf
from .hub import resolve
from .tokenizer import load_tokenizer


def quantize_checkpoint(model: str | os.PathLike, out: str | os.PathLike, type_name: str,
                        tokenizer: str | os.PathLike | None = None, progress=None) -> tuple[list[TensorData], object]:
    """Any checkpoint npllm reads (llama2.c .bin, HF directory, GGUF; a path or a known name) written as a GGUF file
    of `type_name`, with the vocabulary of its tokenizer (given, or found beside it) when npllm can write it.
    Returns (tensors written, the tokenizer embedded or None). progress: see formats.gguf_write.model_tensors."""
    check_output_path(out)  # before minutes of quantizing
    checkpoint, found = resolve(model)
    config, weights = read_checkpoint(checkpoint)
    if tokenizer is None and found == checkpoint and read_vocab(read_gguf_file(checkpoint)) is None:
        found = None  # a GGUF input without a vocabulary: the output has none either
    tok_path = tokenizer if tokenizer is not None else found
    tok = None if tok_path is None else load_tokenizer(tok_path, vocab_size=config.vocab_size)
    if tok is not None and not hasattr(tok, "score"):
        tok = None  # byte-level vocabularies are not written yet; the GGUF then needs a tokenizer beside it
    tensors = write_gguf(out, config, weights, type_name, tok, progress=progress)
    return tensors, tok
