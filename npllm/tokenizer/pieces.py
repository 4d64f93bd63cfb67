"""What a vocabulary entry is: the kinds of pieces (TokenType) and SentencePiece's spelling of a space.

Shared by the Tokenizer interface (base.py) and the decoder every SentencePiece-family tokenizer uses (stream.py),
which both import it: neither imports the other's module for these.
"""

from __future__ import annotations

import enum

# SentencePiece writes a space as this symbol ("lower one eighth block") inside its pieces.
SPACE_SYMBOL = "\u2581"


class TokenType(enum.IntEnum):
    """What an id stands for, numbered as SentencePiece's ModelProto and GGUF's tokenizer.ggml.token_type do."""

    NORMAL = 1  # a piece of text, spaces written as SPACE_SYMBOL
    UNKNOWN = 2  # <unk>: text the vocabulary cannot spell (never produced when byte fallback exists)
    CONTROL = 3  # <s>, </s>, ...: structure, never text; decodes to nothing
    USER_DEFINED = 4  # a piece matched whole in the input and never merged further
    UNUSED = 5  # a piece BPE may form on the way but never emits (it is split back into its halves)
    BYTE = 6  # <0xXX>: one raw byte, the fallback for characters outside the vocabulary
