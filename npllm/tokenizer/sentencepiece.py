"""SentencePiece `.model` files, encoded by the sentencepiece package itself (the reference npllm's BPE matches)."""

from __future__ import annotations

import math
import os
from functools import cached_property
from pathlib import Path

import sentencepiece as spm

from ..errors import TokenizerError
from .base import SPACE_SYMBOL, Tokenizer, TokenType


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model: encode is sentencepiece's own; decode is the shared one, which agrees with
    sentencepiece's decode (tests compare them on arbitrary id sequences) and also streams."""

    def __init__(self, path: str | os.PathLike):
        self.name = os.fspath(path)
        if not Path(path).exists():
            raise TokenizerError(f"tokenizer file {self.name} does not exist")
        if not Path(path).is_file():
            raise TokenizerError(f"tokenizer {self.name} is not a file")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.name)
        except (OSError, RuntimeError) as e:  # sentencepiece reports a bad protobuf as OSError or RuntimeError
            raise TokenizerError(f"tokenizer {self.name} is not a readable SentencePiece model: {e}") from None
        except UnicodeDecodeError as e:
            # sentencepiece quotes the piece it refuses ("byte piece <0x6\xc3> is invalid"); a piece that is not
            # UTF-8 makes that message itself undecodable, so its bytes are shown escaped
            said = e.object.decode("utf-8", "backslashreplace") if isinstance(e.object, bytes) else str(e)
            raise TokenizerError(f"tokenizer {self.name} is not a readable SentencePiece model: {said}") from None
        kind = model_type(self._sp.serialized_model_proto())
        if kind not in ("unigram", "BPE"):  # word and char models split text in ways no Llama-family model was fed
            raise TokenizerError(f"tokenizer {self.name} declares SentencePiece model type {kind}; npllm reads BPE "
                                 "and unigram models (the Llama family's tokenizers)")
        self.vocab_size = self._sp.vocab_size()
        self.bos_id, self.eos_id, self.unk_id = self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise TokenizerError(f"tokenizer {self.name} defines no BOS or no EOS piece; npllm needs both")
        self._check_pieces()
        # Whether the normaliser puts a U+2581 in front of the text; decode then removes one from the first piece.
        self.add_dummy_prefix = self._sp.normalize("a").startswith(SPACE_SYMBOL)

    def _check_pieces(self) -> None:
        """Every piece valid UTF-8 and every score a finite number: a protobuf does not enforce either, and a bad
        piece would otherwise fail only when first decoded, mid-generation; a NaN score would reorder merges."""
        for i in range(self.vocab_size):
            try:
                self._sp.id_to_piece(i)
            except UnicodeDecodeError as e:
                raise TokenizerError(f"tokenizer {self.name}: piece {i} is not valid UTF-8 ({e.reason} at byte "
                                     f"{e.start})") from None
            if not math.isfinite(self._sp.get_score(i)):
                raise TokenizerError(f"tokenizer {self.name}: piece {i} has score {self._sp.get_score(i)}; scores "
                                     "must be finite numbers")

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """sentencepiece's ids for `text`, with BOS/EOS added when asked."""
        if not isinstance(text, str):
            raise TokenizerError(f"tokenizer {self.name}: encode takes a str, not {type(text).__name__}")
        return self._sp.encode(text, add_bos=bos, add_eos=eos)

    def id_to_piece(self, token_id: int) -> str:
        """The piece of `token_id` as the model stores it."""
        return self._sp.id_to_piece(self._check_id(token_id))

    def score(self, token_id: int) -> float:
        """The piece's score (its merge priority; higher merges first)."""
        return self._sp.get_score(self._check_id(token_id))

    @cached_property
    def longest_piece_bytes(self) -> int | None:
        """The longest piece, in UTF-8 bytes of the normalized text (encoded_bytes) it stands for; a byte piece
        stands for one. Only with byte fallback: without it a run of unknown characters is one <unk> (None)."""
        if not self._falls_back_to_bytes():
            return None
        sp = self._sp
        return max([len(sp.id_to_piece(i).encode("utf-8")) for i in range(self.vocab_size)
                    if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))] + [1])

    def _falls_back_to_bytes(self) -> bool:
        """Whether a character the vocabulary lacks is encoded as its bytes (else as <unk>): asked of the encoder
        itself, with a private-use character no vocabulary trains on (the flag lives in the trainer's spec)."""
        probe = "\U000FFFFD"
        ids = self._sp.encode(probe)
        return self._sp.piece_to_id(probe) == self.unk_id and self.unk_id not in ids and any(
            self._sp.is_byte(i) for i in ids)

    def encoded_bytes(self, text: str) -> int:
        """The UTF-8 length of the text as sentencepiece normalizes it before encoding (its normalizer may drop or
        fold characters, or squeeze whitespace): the pieces cover that text. Normalizing is C++, about 30 times
        cheaper than encoding. 0 for a text sentencepiece cannot take (a lone surrogate): encode says why."""
        try:
            return len(self._sp.normalize(text).encode("utf-8"))
        except (UnicodeError, TypeError):
            return 0

    def token_type(self, token_id: int) -> TokenType:
        """The TokenType of `token_id` (sentencepiece exposes no user-defined flag: those read as NORMAL)."""
        token_id = self._check_id(token_id)
        sp = self._sp
        if sp.is_control(token_id):
            return TokenType.CONTROL
        if sp.is_unknown(token_id):
            return TokenType.UNKNOWN
        if sp.is_byte(token_id):
            return TokenType.BYTE
        if sp.is_unused(token_id):
            return TokenType.UNUSED
        return TokenType.NORMAL


# TrainerSpec.model_type's values (sentencepiece_model.proto); a model that does not set it is unigram.
MODEL_TYPES = {1: "unigram", 2: "BPE", 3: "word", 4: "char"}


def model_type(proto: bytes) -> str:
    """The model type a ModelProto as sentencepiece re-serializes it declares (its trainer_spec, field 2, holds
    model_type, field 3), read with a few lines of protobuf wire format rather than a dependency on the protobuf
    package. The first model_type counts: sentencepiece writes the value it uses first and keeps a value it does not
    know behind it, as an unknown field; one that is alone is not a type sentencepiece knows, and said so."""
    found = 1
    for number, value in _fields(proto):
        if number == 2 and isinstance(value, bytes):
            found = next((v for n, v in _fields(value) if n == 3 and isinstance(v, int)), found)
    return MODEL_TYPES.get(found, f"{found} (not a type sentencepiece knows)")


def _fields(data: bytes):
    """(field number, value) of each field of a protobuf message: an int for a varint, bytes otherwise."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            size, i = _varint(data, i)
            value, i = data[i:i + size], i + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, i = data[i:i + size], i + size
        else:
            raise TokenizerError(f"a SentencePiece model with protobuf wire type {wire}, which it never holds")
        yield key >> 3, value


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise TokenizerError("a SentencePiece model that ends inside a number")
        value |= (data[i] & 0x7F) << shift
        shift += 7
        i += 1
        if data[i - 1] < 0x80:
            return value, i
