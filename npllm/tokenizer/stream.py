"""Incremental decoding: turn ids into text one at a time without ever printing half a character.

A character outside the vocabulary is spelled as several byte pieces (<0xE6> <0x97> <0xA5> for "日"), so a single
byte piece is not yet printable text. The decoder keeps the bytes of an unfinished character until the character is
complete, or until it is certain it never will be (then each stray byte prints as U+FFFD, as SentencePiece does).
"""

from __future__ import annotations

import weakref

from .pieces import SPACE_SYMBOL, TokenType

REPLACEMENT = "\ufffd"
# Each tokenizer's plain pieces as printed mid-text (U+2581 read as a space), filled as ids are first decoded and
# shared by its decoders: a generation prints one piece a step, and looking the piece up again costs more than
# the rest of the step's Python.
_TEXTS: "weakref.WeakKeyDictionary[object, dict[int, str]]" = weakref.WeakKeyDictionary()
# How SentencePiece renders <unk> when decoding.
UNK_SURFACE = " \u2047 "


def utf8_length(lead: int) -> int:
    """Bytes in the UTF-8 character that starts with byte `lead`; 0 when `lead` cannot start one.

    Well-formed leads (Unicode Table 3-7): 00..7F alone, C2..DF + 1, E0..EF + 2, F0..F4 + 3. C0, C1 and F5..FF
    would only give overlong or out-of-range encodings, and 80..BF are continuation bytes.
    """
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def second_byte_range(lead: int) -> tuple[int, int]:
    """Allowed range of the byte after `lead`: narrower than 80..BF for a few leads, which rules out overlong forms
    (E0, F0), UTF-16 surrogates D800..DFFF (ED) and code points above 10FFFF (F4)."""
    return {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(lead, (0x80, 0xBF))


def well_formed_prefix(chunk: bytes | bytearray) -> bool:
    """True when `chunk` (lead byte first, no longer than its character) can still be, or is, a valid character."""
    lo, hi = second_byte_range(chunk[0])
    if len(chunk) > 1 and not lo <= chunk[1] <= hi:
        return False
    return all(0x80 <= b <= 0xBF for b in chunk[2:])


class StreamDecoder:
    """Feed ids one at a time; each feed returns the text that became printable, flush() returns the rest.

    Rules (those of SentencePiece's decoder, so that concatenating every feed and the flush equals decode(ids)):
    - a CONTROL id prints nothing, and bytes pending before it can no longer be completed: they print as U+FFFD;
    - a BYTE id appends its byte to the pending bytes; every complete character at their front is printed, and a
      byte that cannot start a well-formed character (or whose character cannot be completed) prints as U+FFFD;
      an incomplete but well-formed character waits for the next id;
    - any other id first settles the pending bytes, then prints its piece with U+2581 read as a space (<unk> as
      " \u2047 ");
    - the first non-control piece loses one leading U+2581 (the dummy prefix the encoder added) unless the
      tokenizer adds none or `continuation` says the ids continue text already printed.
    `tokenizer`: a Tokenizer (base.py), asked for _check_id, token_type, byte_value, id_to_piece and
    add_dummy_prefix.
    """

    def __init__(self, tokenizer, continuation: bool = False):
        self.tokenizer = tokenizer
        self._pending = bytearray()
        self._at_start = tokenizer.add_dummy_prefix and not continuation
        self._texts = _TEXTS.setdefault(tokenizer, {})

    def feed(self, token_id: int) -> str:
        """Add one id; return the newly printable text (possibly empty)."""
        text = self._texts.get(token_id)
        if text is not None and not self._pending and not self._at_start:
            return text  # the common case, once per token of a generation: a piece seen before, nothing pending
        return self._feed(token_id)

    def _feed(self, token_id: int) -> str:
        tok = self.tokenizer
        token_id = tok._check_id(token_id)
        kind = tok.token_type(token_id)
        if kind == TokenType.CONTROL:
            return self._drain(final=True)
        if kind == TokenType.BYTE:
            self._at_start = False
            self._pending.append(tok.byte_value(token_id))
            return self._drain(final=False)
        text = self._drain(final=True)
        if kind == TokenType.UNKNOWN:
            piece = UNK_SURFACE
        else:
            piece = tok.id_to_piece(token_id)
            self._texts[token_id] = piece.replace(SPACE_SYMBOL, " ")  # as printed after the start
            if self._at_start and piece.startswith(SPACE_SYMBOL):
                piece = piece[1:]
            piece = piece.replace(SPACE_SYMBOL, " ")
        self._at_start = False
        return text + piece

    def flush(self) -> str:
        """End of the ids: print what is pending, each byte of an unfinished character as U+FFFD."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> str:
        """Print the pending bytes from the front as far as they are settled; with `final` all of them are."""
        pending = self._pending
        if not pending:
            return ""
        out = []
        i = 0
        while i < len(pending):
            n = utf8_length(pending[i])
            chunk = pending[i : i + n]
            if n and well_formed_prefix(chunk):
                if len(chunk) == n:  # a whole well-formed character
                    out.append(chunk.decode("utf-8"))
                    i += n
                    continue
                if not final:  # well-formed so far: the rest may come with the next ids
                    break
            out.append(REPLACEMENT)  # this byte starts no character: it alone becomes U+FFFD
            i += 1
        del pending[:i]
        return "".join(out)
