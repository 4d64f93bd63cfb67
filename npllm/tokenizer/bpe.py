"""npllm's own SentencePiece-style BPE encoder, for vocabularies given as plain lists of pieces and scores.

Two sources feed it: llama2.c's tokenizer.bin (BPETokenizer.from_llama2c) and, later, a GGUF file's
tokenizer.ggml.tokens / scores / token_type. The encoder reproduces SentencePiece's BPE encoding id for id:

1. normalise: every space becomes U+2581 and one U+2581 is put in front of the text (the "dummy prefix"), so
   " the" and "the" at the start of a text spell alike;
2. split into symbols: one per Unicode character, except that a USER_DEFINED piece is taken whole (longest match);
3. merge: among all adjacent symbol pairs whose concatenation is a piece, join the one whose piece has the highest
   score (ties: the leftmost pair); repeat until no adjacent pair forms a piece. A max-heap of candidate pairs over a
   doubly linked list of symbols makes this O(n log n) instead of rescanning all pairs after every merge;
4. emit: each symbol's id; an UNUSED piece is split back into the two halves it was merged from; a symbol the
   vocabulary lacks is spelled as its UTF-8 bytes with the <0xXX> pieces ("byte fallback"); without those, each run
   of such symbols becomes one <unk>.

CONTROL, UNKNOWN and BYTE pieces take no part in merging, so text never turns into <s>, </s> or <unk>.
"""

from __future__ import annotations

import heapq
import math
import os
import re
import struct
from functools import cached_property
from pathlib import Path
from typing import Sequence

from ..errors import TokenizerError
from .base import SPACE_SYMBOL, Tokenizer, TokenType

BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")
# Pieces BPE may build by merging; the others (CONTROL, UNKNOWN, BYTE) are never spelled out of text.
MERGEABLE = (TokenType.NORMAL, TokenType.USER_DEFINED, TokenType.UNUSED)


class BPETokenizer(Tokenizer):
    """A BPE vocabulary (pieces in SentencePiece spelling, one score each) with SentencePiece's encoding rules.

    `pieces[i]` is the text of id i with spaces written as U+2581 and byte pieces as '<0xXX>'; `scores[i]` its merge
    priority (higher merges first). `token_types` gives each id's TokenType (GGUF numbering); when omitted, `unk_id`
    is UNKNOWN, `bos_id` and `eos_id` are CONTROL, pieces spelled <0xXX> are BYTE and the rest NORMAL.
    """

    def __init__(
        self,
        pieces: Sequence[str],
        scores: Sequence[float],
        token_types: Sequence[int] | None = None,
        *,
        bos_id: int = 1,
        eos_id: int = 2,
        unk_id: int = 0,
        add_dummy_prefix: bool = True,
        name: str = "<in-memory vocabulary>",
    ):
        self.name = name
        self.vocab_size = len(pieces)
        if len(scores) != self.vocab_size or (token_types is not None and len(token_types) != self.vocab_size):
            counts = f"{len(pieces)} pieces, {len(scores)} scores"
            counts += "" if token_types is None else f", {len(token_types)} token types"
            raise TokenizerError(f"tokenizer {name}: {counts}; they must be equally many")
        for what, i in (("bos_id", bos_id), ("eos_id", eos_id), ("unk_id", unk_id)):
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"tokenizer {name}: {what} {i} is outside the vocabulary of {self.vocab_size}")
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        self.add_dummy_prefix = add_dummy_prefix
        self._pieces = [str(p) for p in pieces]
        self._scores = [float(s) for s in scores]
        try:
            types = [TokenType(int(t)) for t in token_types] if token_types is not None else self._infer_types()
        except ValueError as e:
            raise TokenizerError(f"tokenizer {name}: {e} (token types are 1..6)") from None
        self._types = types
        self._ids = self._mergeable_ids()
        self._byte_ids = self._byte_table()
        self._user_defined = self._user_defined_by_first_char()

    # ---- construction helpers -------------------------------------------------------------------------------------

    @classmethod
    def from_llama2c(cls, path: str | os.PathLike, vocab_size: int | None = None) -> "BPETokenizer":
        """Read llama2.c's tokenizer.bin.

        Layout (little endian): int32 max_token_length, then for every id in order: float32 score, int32 length,
        `length` bytes of UTF-8 text with spaces as real spaces. BOS is id 1 and EOS id 2 (stored as "\\n<s>\\n" and
        "\\n</s>\\n"), <unk> id 0. The file does not record how many ids it holds: give the model's `vocab_size` to
        read exactly that many and catch a file cut at a record boundary; otherwise records are read to the end.
        Byte pieces may be spelled "<0xXX>" or stored as 256 consecutive raw single bytes 00..FF; both become
        BYTE pieces spelled "<0xXX>".
        """
        raw, scores = read_llama2c_records(path, vocab_size)
        pieces = llama2c_pieces_to_sentencepiece(raw, path)
        return cls(pieces, scores, name=os.fspath(path))

    def _infer_types(self) -> list[TokenType]:
        """Token types for a vocabulary that carries none (llama2.c's tokenizer.bin)."""
        types = [TokenType.BYTE if BYTE_PIECE.fullmatch(p) else TokenType.NORMAL for p in self._pieces]
        types[self.unk_id] = TokenType.UNKNOWN
        types[self.bos_id] = types[self.eos_id] = TokenType.CONTROL
        return types

    def _mergeable_ids(self) -> dict[str, int]:
        """piece -> id for the pieces BPE may form; a piece listed twice would make encoding ambiguous."""
        ids: dict[str, int] = {}
        for i, (piece, kind) in enumerate(zip(self._pieces, self._types)):
            if kind not in MERGEABLE:
                continue
            if piece in ids:
                raise TokenizerError(f"tokenizer {self.name}: piece {piece!r} appears twice (ids {ids[piece]} and {i})")
            if not piece:
                raise TokenizerError(f"tokenizer {self.name}: piece {i} is empty")
            ids[piece] = i
        return ids

    def _byte_table(self) -> list[int] | None:
        """byte value -> id of its <0xXX> piece, or None when the vocabulary has no byte fallback."""
        table: list[int | None] = [None] * 256
        for i, kind in enumerate(self._types):
            if kind != TokenType.BYTE:
                continue
            match = BYTE_PIECE.fullmatch(self._pieces[i])
            if match is None:
                raise TokenizerError(f"tokenizer {self.name}: byte piece {i} is spelled {self._pieces[i]!r}, not <0xXX>")
            value = int(match.group(1), 16)
            if table[value] is not None:
                raise TokenizerError(f"tokenizer {self.name}: byte 0x{value:02X} has two pieces ({table[value]} and {i})")
            table[value] = i
        found = sum(t is not None for t in table)
        if found == 0:
            return None
        if found != 256:
            raise TokenizerError(f"tokenizer {self.name}: has {found} of the 256 byte pieces <0x00>..<0xFF>")
        return table  # type: ignore[return-value]

    def _user_defined_by_first_char(self) -> dict[str, list[str]]:
        """First character -> USER_DEFINED pieces starting with it, longest first (for longest-match splitting)."""
        table: dict[str, list[str]] = {}
        for piece, kind in zip(self._pieces, self._types):
            if kind == TokenType.USER_DEFINED:
                table.setdefault(piece[0], []).append(piece)
        for candidates in table.values():
            candidates.sort(key=len, reverse=True)
        return table

    # ---- the Tokenizer interface ----------------------------------------------------------------------------------

    def id_to_piece(self, token_id: int) -> str:
        """The piece of `token_id` as stored (SentencePiece spelling)."""
        return self._pieces[self._check_id(token_id)]

    def token_type(self, token_id: int) -> TokenType:
        """The TokenType of `token_id`."""
        return self._types[self._check_id(token_id)]

    def score(self, token_id: int) -> float:
        """Merge priority of `token_id`'s piece (higher merges earlier)."""
        return self._scores[self._check_id(token_id)]

    @cached_property
    def longest_piece_bytes(self) -> int | None:
        """The longest piece BPE may form, in UTF-8 bytes of its spelling. Normalizing only lengthens the text (a
        space, 1 byte, becomes U+2581, 3 bytes), and a symbol the vocabulary lacks is spelled one byte piece per
        byte; so no token stands for more of the text's bytes. Without byte pieces a run of unknown characters,
        however long, is one <unk>: no bound (None)."""
        if self._byte_ids is None:
            return None
        return max([len(piece.encode("utf-8")) for piece in self._ids] + [1])

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of `text` by the BPE described in the module docstring; BOS/EOS added when asked."""
        if not isinstance(text, str):
            raise TokenizerError(f"tokenizer {self.name}: encode takes a str, not {type(text).__name__}")
        ids = [self.bos_id] if bos else []
        if text:  # like SentencePiece, the empty text gets no dummy prefix and no pieces
            ids.extend(self._encode_text(text))
        if eos:
            ids.append(self.eos_id)
        return ids

    # ---- the encoder ----------------------------------------------------------------------------------------------

    def _normalize(self, text: str) -> str:
        """Step 1: spaces -> U+2581, plus the dummy prefix. (A U+2581 already in the text thus reads as a space.)"""
        text = text.replace(" ", SPACE_SYMBOL)
        return SPACE_SYMBOL + text if self.add_dummy_prefix else text

    def _split(self, text: str) -> tuple[list[str], list[bool]]:
        """Step 2: initial symbols and whether each is frozen (a USER_DEFINED piece, which never merges)."""
        if not self._user_defined:
            return list(text), [False] * len(text)
        symbols, frozen = [], []
        i = 0
        while i < len(text):
            match = next((p for p in self._user_defined.get(text[i], ()) if text.startswith(p, i)), None)
            symbols.append(match or text[i])
            frozen.append(match is not None)
            i += len(symbols[-1])
        return symbols, frozen

    def _encode_text(self, text: str) -> list[int]:
        """Steps 1-4 for a non-empty text."""
        symbols, frozen = self._split(self._normalize(text))
        n = len(symbols)
        prev = list(range(-1, n - 1))  # linked list over symbol slots; a merged-away slot holds ""
        next_ = list(range(1, n + 1))
        next_[-1] = -1
        ids, scores, types = self._ids, self._scores, self._types
        heap: list[tuple[float, int, int, int]] = []  # (-score, left slot, right slot, merged length)
        unused_halves: dict[str, tuple[str, str]] = {}  # an UNUSED piece -> the pair it was formed from

        def consider(left: int, right: int) -> None:
            """Queue the pair (left, right) if together they spell a piece."""
            if left < 0 or right < 0 or frozen[left] or frozen[right]:
                return
            merged = symbols[left] + symbols[right]
            piece_id = ids.get(merged)
            if piece_id is None:
                return
            heapq.heappush(heap, (-scores[piece_id], left, right, len(merged)))
            if types[piece_id] == TokenType.UNUSED:
                unused_halves[merged] = (symbols[left], symbols[right])

        for i in range(n - 1):
            consider(i, i + 1)
        while heap:
            _, left, right, length = heapq.heappop(heap)
            # A queued pair is stale once either side has merged with something else: then one side is empty or
            # longer than it was, so the lengths no longer add up (symbols only ever grow or vanish).
            if not symbols[left] or not symbols[right] or len(symbols[left]) + len(symbols[right]) != length:
                continue
            symbols[left] += symbols[right]
            symbols[right] = ""
            next_[left] = next_[right]
            if next_[left] >= 0:
                prev[next_[left]] = left
            consider(prev[left], left)
            consider(left, next_[left])

        out: list[int] = []
        slot = 0  # slot 0 is never merged away: nothing lies to its left
        while slot >= 0:
            self._emit(symbols[slot], unused_halves, out)
            slot = next_[slot]
        return out

    def _emit(self, symbol: str, unused_halves: dict[str, tuple[str, str]], out: list[int]) -> None:
        """Step 4 for one final symbol: its id, its halves if UNUSED, else its bytes (or <unk>)."""
        piece_id = self._ids.get(symbol)
        if piece_id is not None and self._types[piece_id] == TokenType.UNUSED and symbol in unused_halves:
            left, right = unused_halves[symbol]
            self._emit(left, unused_halves, out)
            self._emit(right, unused_halves, out)
        elif piece_id is not None:
            out.append(piece_id)
        elif self._byte_ids is not None:
            out.extend(self._byte_ids[b] for b in symbol.encode("utf-8"))
        elif not out or out[-1] != self.unk_id:  # a run of unknown symbols makes a single <unk>, as in SentencePiece
            out.append(self.unk_id)


def read_llama2c_records(path: str | os.PathLike, vocab_size: int | None) -> tuple[list[bytes], list[float]]:
    """The raw (piece bytes, score) records of a llama2.c tokenizer.bin, with every inconsistency a TokenizerError."""
    name = os.fspath(path)
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file {name} does not exist") from None
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer file {name}: {e.strerror or e}") from None
    if len(data) < 4:
        raise TokenizerError(f"tokenizer {name} is {len(data)} bytes long, too short for llama2.c's 4-byte header")
    (max_token_length,) = struct.unpack_from("<i", data, 0)
    if not 0 < max_token_length <= 1 << 16:
        raise TokenizerError(
            f"tokenizer {name} is not a llama2.c tokenizer.bin: its header gives max_token_length {max_token_length}"
        )
    raw: list[bytes] = []
    scores: list[float] = []
    offset = 4
    while offset < len(data) and (vocab_size is None or len(raw) < vocab_size):
        if offset + 8 > len(data):
            raise TokenizerError(f"tokenizer {name} is truncated: the record of piece {len(raw)} is cut off")
        score, length = struct.unpack_from("<fi", data, offset)
        if not 0 <= length <= max_token_length:
            raise TokenizerError(
                f"tokenizer {name} is corrupt: piece {len(raw)} claims {length} bytes "
                f"(max_token_length is {max_token_length})"
            )
        if offset + 8 + length > len(data):
            raise TokenizerError(f"tokenizer {name} is truncated: piece {len(raw)} is cut off")
        if not math.isfinite(score):
            raise TokenizerError(f"tokenizer {name} is corrupt: piece {len(raw)} has score {score}")
        raw.append(data[offset + 8 : offset + 8 + length])
        scores.append(score)
        offset += 8 + length
    if vocab_size is not None and len(raw) < vocab_size:
        raise TokenizerError(f"tokenizer {name} is truncated: it has {len(raw)} pieces, the model needs {vocab_size}")
    if offset != len(data):
        raise TokenizerError(
            f"tokenizer {name} has {len(data) - offset} bytes after its {len(raw)} pieces; "
            f"the model's vocabulary is {vocab_size}"
        )
    if len(raw) < 3:
        raise TokenizerError(f"tokenizer {name} has {len(raw)} pieces; llama2.c's need at least <unk>, <s>, </s>")
    return raw, scores


def llama2c_pieces_to_sentencepiece(raw: list[bytes], path: str | os.PathLike) -> list[str]:
    """llama2.c piece bytes -> SentencePiece spelling: text with spaces as U+2581, byte pieces as '<0xXX>'.

    A run of 256 consecutive single-byte pieces 00, 01, ..., FF is the byte-fallback block written as raw bytes;
    it is renamed '<0xXX>' so both spellings of a tokenizer.bin give the same vocabulary.
    """
    pieces: list[str | None] = [None] * len(raw)
    start = next(
        (i for i in range(len(raw) - 255) if raw[i] == b"\x00" and all(raw[i + b] == bytes([b]) for b in range(256))),
        None,
    )
    if start is not None:
        for b in range(256):
            pieces[start + b] = f"<0x{b:02X}>"
    for i, piece in enumerate(raw):
        if pieces[i] is not None:
            continue
        try:
            pieces[i] = piece.decode("utf-8").replace(" ", SPACE_SYMBOL)
        except UnicodeDecodeError:
            raise TokenizerError(f"tokenizer {os.fspath(path)}: piece {i} ({piece!r}) is not valid UTF-8") from None
    return pieces  # type: ignore[return-value]
