"""Tokenizers: one interface (Tokenizer: encode, decode, stream_decoder), several vocabulary files.

    load_tokenizer("tok512.model")  -> SentencePieceTokenizer  (the sentencepiece package)
    load_tokenizer("tok512.bin")    -> BPETokenizer            (llama2.c's format, npllm's own BPE encoder)
    load_tokenizer("tokenizer.json") -> ByteLevelBPE           (Hugging Face byte-level BPE: Llama 3, Qwen2, SmolLM)
    load_tokenizer("model.gguf")    -> the vocabulary the GGUF file embeds (BPETokenizer or ByteLevelBPE)

SentencePieceTokenizer and BPETokenizer spell pieces the SentencePiece way (U+2581 for a space, <0xXX> for a byte)
and decode through the same StreamDecoder; ByteLevelBPE spells every byte as a printable character and has its own
ByteStreamDecoder. Either way, text printed token by token never shows half a character.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import TokenizerError
from .base import SPACE_SYMBOL, Tokenizer, TokenType, check_vocab
from .bpe import BPETokenizer
from .sentencepiece import SentencePieceTokenizer
from .stream import StreamDecoder

__all__ = [
    "BPETokenizer",
    "SPACE_SYMBOL",
    "SentencePieceTokenizer",
    "StreamDecoder",
    "TokenType",
    "Tokenizer",
    "check_vocab",
    "load_tokenizer",
]


def load_tokenizer(path: str | os.PathLike, vocab_size: int | None = None) -> Tokenizer:
    """Open a tokenizer file, choosing the reader by its suffix: `.model` SentencePiece, `.bin` llama2.c,
    `.json` Hugging Face byte-level BPE, `.gguf` the vocabulary a GGUF file embeds.

    With `vocab_size` (the model's), the tokenizer must have exactly that many ids (check_vocab); for a `.bin`, which
    does not record its own size, this also catches a file cut off between two records.
    """
    path = Path(path)
    if not path.exists():
        raise TokenizerError(f"tokenizer file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".model":
        tokenizer: Tokenizer = SentencePieceTokenizer(path)
    elif suffix == ".bin":
        tokenizer = BPETokenizer.from_llama2c(path, vocab_size)
    elif suffix == ".json":
        from .bytelevel import ByteLevelBPE

        tokenizer = ByteLevelBPE.from_file(path)
    elif suffix == ".gguf":
        from .gguf import gguf_tokenizer

        tokenizer = gguf_tokenizer(path)
    else:
        raise TokenizerError(
            f"tokenizer file {path}: unknown kind {suffix or '(no suffix)'!r}; "
            "npllm reads SentencePiece .model, llama2.c tokenizer .bin, tokenizer.json and .gguf files"
        )
    if vocab_size is not None:
        check_vocab(tokenizer, vocab_size, path)
    return tokenizer
