"""The one interface every npllm tokenizer offers, and the checks shared by all of them.

A tokenizer maps text to ids (encode) and ids back to text (decode). Decoding is the same for every vocabulary of the
SentencePiece family, so it lives here once: each piece is one of a few kinds (TokenType, pieces.py) and the
StreamDecoder (stream.py) turns a sequence of (kind, piece) into text. Subclasses only say how to encode and what each
id is.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Iterable

from ..errors import TokenizerError
from .pieces import SPACE_SYMBOL, TokenType  # noqa: F401  (re-exported: the kinds every tokenizer names)
from .stream import StreamDecoder


class Tokenizer(ABC):
    """Text <-> token ids for a Llama-family vocabulary.

    Attributes every implementation sets: `vocab_size` (number of ids), `bos_id`, `eos_id`, `unk_id`, `name` (the
    file it came from, for messages) and `add_dummy_prefix` (whether encode puts a space before the text, in which
    case decode takes that one space off again).
    """

    vocab_size: int
    bos_id: int
    eos_id: int
    unk_id: int
    name: str
    add_dummy_prefix: bool

    @abstractmethod
    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of `text`, with BOS in front when `bos` and EOS at the end when `eos`."""

    @abstractmethod
    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` in SentencePiece's spelling (spaces as U+2581, bytes as <0xXX>)."""

    @abstractmethod
    def token_type(self, token_id: int) -> TokenType:
        """The kind of piece `token_id` is; decoding depends only on this and on id_to_piece."""

    @property
    def longest_piece_bytes(self) -> int | None:
        """The most bytes of text (its UTF-8, as given to encode) that one token encode() makes can stand for, or
        None where no such bound holds (a run of characters the vocabulary lacks becoming one <unk>, whitespace
        that an added token swallows). Each tokenizer class computes it once from its vocabulary."""
        return None

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text, bos=False)), found without encoding the text: no token stands for
        more than longest_piece_bytes of its bytes (0 where no bound is known). Encoding is slow (npllm's BPE is
        Python: seconds per megabyte); this is one pass over the text in C."""
        longest = self.longest_piece_bytes
        if not longest:
            return 0
        return -(-self.encoded_bytes(text) // longest)

    def encode_at_most(self, text: str, most: int, bos: bool = True) -> list[int] | None:
        """encode(text, bos), or None where the encoder stopped once past `most` ids and left the rest of the text
        unencoded. This default encodes the whole text (a count past `most` is returned, and says how far past);
        an encoder that works word by word (ByteLevelBPE) stops early."""
        return self.encode(text, bos=bos)

    def encoded_bytes(self, text: str) -> int:
        """How many bytes long `text` is where longest_piece_bytes counts them: its UTF-8 (a lone surrogate, which
        encode refuses, counted as 3 bytes rather than raising here)."""
        return len(text.encode("utf-8", "surrogatepass"))

    def byte_value(self, token_id: int) -> int:
        """The byte a BYTE piece stands for: its text is '<0xXX>' with XX the byte in hexadecimal."""
        return int(self.id_to_piece(token_id)[3:5], 16)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to the text of a completion (decoded as a continuation, so a leading U+2581 is a
        space): a BYTE piece its byte, any other piece its UTF-8 with U+2581 read as a space. CONTROL and UNKNOWN
        pieces (which decode to nothing, or to " \u2047 ") give their spelling; a constraint never allows them."""
        token_id = self._check_id(token_id)
        if self.token_type(token_id) == TokenType.BYTE:
            return bytes([self.byte_value(token_id)])
        return self.id_to_piece(token_id).replace(SPACE_SYMBOL, " ").encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        """Whether an id stands for structure rather than text (CONTROL: BOS, EOS, <|eot_id|>, ...; UNKNOWN)."""
        return self.token_type(token_id) in (TokenType.CONTROL, TokenType.UNKNOWN)

    def decode(self, ids: Iterable[int], continuation: bool = False) -> str:
        """Text of `ids`, exactly as SentencePiece decodes them.

        Control pieces (BOS, EOS, ...) vanish; <unk> reads " \u2047 "; SPACE_SYMBOL reads as a space; runs of byte
        pieces are joined and read as UTF-8, each byte that does not belong to a valid character becoming U+FFFD.
        The first non-control piece loses one leading space: the dummy prefix encode added. Pass
        `continuation=True` when the ids continue text already shown, so that space is a real one and stays.
        """
        stream = self.stream_decoder(continuation)
        return "".join(stream.feed(i) for i in ids) + stream.flush()

    def stream_decoder(self, continuation: bool = False) -> StreamDecoder:
        """A decoder fed one id at a time that returns only complete characters; see StreamDecoder."""
        return StreamDecoder(self, continuation)

    def _check_id(self, token_id: int) -> int:
        """`token_id` as a plain int, or TokenizerError when it is not an id of this vocabulary."""
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside tokenizer {self.name}'s vocabulary of {self.vocab_size}")
        return token_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


def check_vocab(tokenizer: Tokenizer, vocab_size: int, path: str | os.PathLike) -> None:
    """Raise TokenizerError unless `tokenizer` has exactly the model's `vocab_size` ids.

    A mismatch means the tokenizer belongs to another model: ids would index the wrong embedding rows (or past the
    end), so it is refused at load time rather than producing plausible-looking garbage. `path` names the tokenizer.
    """
    if tokenizer.vocab_size != vocab_size:
        raise TokenizerError(
            f"tokenizer {os.fspath(path)} has {tokenizer.vocab_size} pieces but the model's vocabulary is {vocab_size}"
        )
