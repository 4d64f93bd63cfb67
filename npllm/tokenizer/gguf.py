"""The vocabulary a GGUF file embeds, as an npllm tokenizer: formats.gguf reads the metadata (read_vocab), this
module builds the tokenizer from it (the readers never import the tokenizers)."""

from __future__ import annotations

import os

from ..errors import TokenizerError
from ..formats.gguf import read_gguf_file, read_vocab
from .bpe import BPETokenizer
from .bytelevel import from_gguf_vocab


def gguf_tokenizer(path: str | os.PathLike):
    """npllm's tokenizer for the vocabulary a GGUF file embeds: "llama" vocabularies (tokens, scores, token types,
    SentencePiece spelling) feed BPETokenizer; "gpt2" ones (tokens and merges) feed ByteLevelBPE."""
    g = read_gguf_file(path)
    vocab = read_vocab(g)
    if vocab is None:
        raise TokenizerError(f"{g.path}: carries no tokenizer (no tokenizer.ggml.model): pass a tokenizer file")
    if vocab.model == "llama":
        unk = g.metadata.get("tokenizer.ggml.unknown_token_id", 0)  # types checked by read_vocab
        add_space = g.metadata.get("tokenizer.ggml.add_space_prefix", True)
        return BPETokenizer(vocab.tokens, vocab.scores, vocab.token_types,
                            bos_id=1 if vocab.bos_id is None else vocab.bos_id,
                            eos_id=2 if vocab.eos_id is None else vocab.eos_id,
                            unk_id=unk, add_dummy_prefix=add_space, name=g.path)
    if vocab.model == "gpt2":
        return from_gguf_vocab(vocab.tokens, vocab.merges, vocab.token_types, vocab.pre, vocab.bos_id, vocab.eos_id,
                               vocab.add_bos, g.path)
    raise TokenizerError(f"{g.path}: tokenizer model {vocab.model!r} is not supported (npllm reads llama and gpt2)")
