"""Byte-level BPE, the tokenizer of Llama 3, Qwen2, SmolLM and GPT-2, read from a Hugging Face tokenizer.json.

Encoding a text runs four steps:

1. Added tokens (chat specials such as <|eot_id|>) are cut out of the text first and map straight to their ids.
2. Each remaining span is normalized (Qwen2: NFC) and pre-tokenized: a regex splits it into words, e.g. Llama 3's
       (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|...
3. Each word's UTF-8 bytes become printable characters, one per byte (the byte-to-unicode table below), so that the
   vocabulary is a set of plain strings over a 256-letter alphabet and no byte is ever unknown.
4. BPE: starting from single characters, repeatedly merge the adjacent pair with the lowest merge rank (leftmost
   first among equal ranks) until no adjacent pair has a rank; each resulting string is a vocabulary entry.

Decoding maps each token back to bytes (inverting step 3) and decodes the bytes as UTF-8.

The `regex` package provides the Unicode classes (\\p{L}, \\p{N}) these patterns use.
"""

from __future__ import annotations

import codecs
import json
import os
import unicodedata
from dataclasses import dataclass
from functools import cached_property, lru_cache

import regex

from ..errors import TokenizerError
from .base import Tokenizer, TokenType

# GPT-2's word splitter, used by a ByteLevel pre-tokenizer with use_regex = true.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# How many times shorter (in UTF-8) one Unicode normalization can make a text: NFKC makes the 4-byte U+107A5 one
# byte, and composes U+1D414 (4 bytes) + U+0308 + U+0304 (2 each) into U+01D5 (2 bytes); NFC's worst is 3.5
# (U+1FBE U+0308 U+0341 -> U+0390). tests/test_serve_load.py checks the single characters of every form.
NORMALIZED_SHRINK = 4


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """Byte -> printable character. The 188 bytes that are printable Latin-1 characters map to themselves; the other
    68 (controls, space, DEL, NBSP, soft hyphen) map to chr(256), chr(257), ... in byte order. So b' ' -> 'Ġ'."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


# ----------------------------------------------------------------------------------------------------------------
# Pre-tokenizers: each maps a list of text pieces to a finer list.


def split_by_regex(pieces: list[str], pattern: regex.Pattern, behavior: str, invert: bool) -> list[str]:
    """Split every piece at the pattern's matches. `behavior` says where a match goes:
    Isolated: its own piece;  Removed: dropped;  MergedWithPrevious / MergedWithNext: glued to the neighbouring
    non-match;  Contiguous: runs of adjacent matches form one piece. `invert` swaps matches and non-matches."""
    out = []
    for piece in pieces:
        spans, pos = [], 0  # (text, is_match), covering the piece
        for m in pattern.finditer(piece):
            if m.start() == m.end():
                continue
            if m.start() > pos:
                spans.append((piece[pos : m.start()], invert))
            spans.append((m.group(), not invert))
            pos = m.end()
        if pos < len(piece):
            spans.append((piece[pos:], invert))
        out += _apply_behavior(spans, behavior)
    return out


def _apply_behavior(spans: list[tuple[str, bool]], behavior: str) -> list[str]:
    if behavior == "Isolated":
        return [text for text, _ in spans]
    if behavior == "Removed":
        return [text for text, is_match in spans if not is_match]
    if behavior == "MergedWithPrevious":
        out = []
        for text, is_match in spans:
            if is_match and out:
                out[-1] += text
            else:
                out.append(text)
        return out
    if behavior == "MergedWithNext":
        out, carry = [], ""
        for text, is_match in spans:
            if is_match:
                carry += text
            else:
                out.append(carry + text)
                carry = ""
        return out + [carry] if carry else out
    if behavior == "Contiguous":
        out, previous_match = [], False
        for text, is_match in spans:
            if is_match and previous_match:
                out[-1] += text
            else:
                out.append(text)
            previous_match = is_match
        return out
    raise TokenizerError(f"unsupported Split behavior {behavior!r}")


def split_digits(pieces: list[str], individual: bool) -> list[str]:
    """Isolate digits: each digit alone (individual) or each run of digits."""
    pattern = regex.compile(r"\p{N}" if individual else r"\p{N}+")
    return split_by_regex(pieces, pattern, "Isolated", False)


@dataclass(frozen=True)
class AddedToken:
    """An entry of tokenizer.json's added_tokens: matched in the raw text before any splitting."""

    id: int
    content: str
    special: bool = False
    lstrip: bool = False  # the match also swallows whitespace on its left
    rstrip: bool = False  # ... and on its right
    single_word: bool = False  # only matches when not inside a word


class ByteLevelBPE(Tokenizer):
    """Byte-level BPE tokenizer (see the module docstring for the algorithm).

    `vocab` maps byte-mapped strings to ids and `merges` lists pairs in rank order. `pre_tokenizers` are callables
    list[str] -> list[str] applied in turn; `normalizers` are unicodedata forms ("NFC", ...). `prefix_ids` and
    `suffix_ids` are what encode(bos=True) puts around the text (the tokenizer's template).
    """

    add_dummy_prefix = False  # byte-level BPE spells spaces as bytes: nothing to add or take off

    def __init__(
        self,
        vocab: dict[str, int],
        merges: list[tuple[str, str]],
        pre_tokenizers: list = (),
        added_tokens: list[AddedToken] = (),
        normalizers: list[str] = (),
        ignore_merges: bool = False,
        prefix_ids: list[int] = (),
        suffix_ids: list[int] = (),
        bos_id: int | None = None,
        eos_id: int | None = None,
        source: str = "tokenizer",
    ):
        self.source = self.name = source
        self.vocab = dict(vocab)
        self.ranks = {}
        for rank, (left, right) in enumerate(merges):
            if left + right not in self.vocab:
                raise TokenizerError(f"{source}: merge {left!r} + {right!r} makes a token missing from the vocab")
            self.ranks.setdefault((left, right), rank)
        missing = [c for c in bytes_to_unicode().values() if c not in self.vocab]
        if missing:
            raise TokenizerError(f"{source}: the vocabulary lacks {len(missing)} of the 256 byte characters "
                                 f"(e.g. {missing[0]!r}): not a byte-level BPE")
        self.pre_tokenizers = list(pre_tokenizers)  # callables: list[str] -> list[str]
        self.normalizers = list(normalizers)
        self.ignore_merges = ignore_merges
        self.added = {t.content: t for t in added_tokens}
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        for token in added_tokens:
            self.id_to_token[token.id] = token.content
        self.added_ids = {t.id for t in added_tokens}
        self.special_ids = {t.id for t in added_tokens if t.special}
        self.prefix_ids, self.suffix_ids = list(prefix_ids), list(suffix_ids)
        # BOS is what the template puts first; a vocabulary without one (Qwen2) has none, and eos is the model's
        # business (config.json lists it), so both may be None here.
        self.bos_id = bos_id if bos_id is not None else (self.prefix_ids[0] if self.prefix_ids else None)
        self.eos_id = eos_id
        self.unk_id = None
        self.vocab_size = max(self.id_to_token) + 1
        self._added_pattern = self._compile_added(added_tokens)
        self._cache: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def _compile_added(added_tokens) -> regex.Pattern | None:
        """One alternation, longest content first, so the leftmost match is also the longest there."""
        if not added_tokens:
            return None
        alternatives = []
        for t in sorted(added_tokens, key=lambda t: -len(t.content)):
            body = regex.escape(t.content)
            if t.single_word:
                body = rf"(?<![\w]){body}(?![\w])"
            left = r"\s*" if t.lstrip else ""
            right = r"\s*" if t.rstrip else ""
            alternatives.append(rf"{left}(?P<t{t.id}>{body}){right}")
        return regex.compile("|".join(alternatives))

    # -- encoding ------------------------------------------------------------------------------------------------

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of `text`; with bos=True the tokenizer's own template is applied (e.g. Llama 3 prepends
        <|begin_of_text|>; Qwen2 adds nothing), as Hugging Face does with add_special_tokens=True."""
        ids = self._text_ids(text)
        if bos:
            ids = self.prefix_ids + ids + self.suffix_ids
        if eos:
            if self.eos_id is None:
                raise TokenizerError(f"{self.source}: this tokenizer does not know its EOS id")
            ids.append(self.eos_id)
        return ids

    def encode_at_most(self, text: str, most: int, bos: bool = True) -> list[int] | None:
        """encode(text, bos), or None once past `most` ids: words are merged one by one, and the merging (most of
        the time a megabyte takes) stops there."""
        ids = self._text_ids(text, most)
        if ids is None:
            return None
        return self.prefix_ids + ids + self.suffix_ids if bos else ids

    def _text_ids(self, text: str, most: int | None = None) -> list[int] | None:
        """The ids of the text alone; None once past `most` of them (None: no limit)."""
        ids = []
        for span, token_id in self._split_added(text):
            if token_id is not None:
                ids.append(token_id)
            else:
                ids += self._encode_ordinary(span, None if most is None else most - len(ids))
            if most is not None and len(ids) > most:
                return None
        return ids

    def _split_added(self, text: str):
        """Yield (span, None) for ordinary text and (match, id) for each added token, in order."""
        if self._added_pattern is None:
            if text:
                yield text, None
            return
        pos = 0
        for m in self._added_pattern.finditer(text):
            if m.start() > pos:
                yield text[pos : m.start()], None
            yield m.group(), int(m.lastgroup[1:])
            pos = m.end()
        if pos < len(text):
            yield text[pos:], None

    def _encode_ordinary(self, text: str, most: int | None = None) -> list[int]:
        """The ids of a span without added tokens; once past `most` of them (None: no limit) the rest is left."""
        for form in self.normalizers:
            text = unicodedata.normalize(form, text)
        pieces = [text]
        for pre_tokenize in self.pre_tokenizers:
            pieces = pre_tokenize(pieces)
        table = bytes_to_unicode()
        ids = []
        for piece in pieces:
            if piece:
                ids += self._bpe("".join(table[b] for b in piece.encode("utf-8")))
                if most is not None and len(ids) > most:
                    break
        return ids

    def _bpe(self, word: str) -> tuple[int, ...]:
        """Merge the word's characters by rank: each step merges the leftmost occurrence of the lowest-rank pair."""
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        if self.ignore_merges and word in self.vocab:
            symbols = [word]
        else:
            symbols = list(word)
            while len(symbols) > 1:
                best, best_rank = -1, None
                for i in range(len(symbols) - 1):
                    rank = self.ranks.get((symbols[i], symbols[i + 1]))
                    if rank is not None and (best_rank is None or rank < best_rank):
                        best, best_rank = i, rank
                if best_rank is None:
                    break
                symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
        ids = tuple(self.vocab[s] for s in symbols)
        if len(self._cache) < 100_000:
            self._cache[word] = ids
        return ids

    @cached_property
    def longest_piece_bytes(self) -> int | None:
        """The most bytes of the text one token stands for. An ordinary token is one character per byte of the
        normalized text, which each normalizer may have made up to NORMALIZED_SHRINK times shorter; an added token is
        matched in the text as given. None where a token can stand for any length of text: an added token that
        swallows the whitespace beside it (lstrip, rstrip), a pre-tokenizer that drops what it matches."""
        if any(t.lstrip or t.rstrip for t in self.added.values()) or any(
                getattr(step, "drops_text", False) for step in self.pre_tokenizers):
            return None
        ordinary = max(len(token) for token in self.vocab) * NORMALIZED_SHRINK ** len(self.normalizers)
        return max([ordinary] + [len(content.encode("utf-8")) for content in self.added])

    # -- decoding ------------------------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for. A token whose characters all come from the byte table (every vocabulary
        entry) maps back through it; other added tokens (specials like <|eot_id|>) stand for their own UTF-8."""
        token = self.id_to_piece(token_id)
        back = unicode_to_bytes()
        try:
            return bytes(back[c] for c in token)
        except KeyError:
            return token.encode("utf-8")

    def text_bytes(self, token_id: int) -> bytes:
        """What a token contributes to decoded text: its bytes, or nothing for a special (control) token, which
        marks structure (<|begin_of_text|>, <|eot_id|>) rather than text, as in the SentencePiece tokenizers."""
        return b"" if int(token_id) in self.special_ids else self.token_bytes(token_id)

    def decode(self, ids, continuation: bool = False) -> str:
        """Text of the ids without special tokens; each maximal run of bytes that is not valid UTF-8 becomes one
        U+FFFD (Hugging Face's decode with skip_special_tokens=True)."""
        return b"".join(self.text_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self, continuation: bool = False) -> "ByteStreamDecoder":
        return ByteStreamDecoder(self)

    def id_to_piece(self, token_id: int) -> str:
        token = self.id_to_token.get(int(token_id))
        if token is None:
            raise TokenizerError(f"{self.source}: token id {token_id} is outside the vocabulary ({self.vocab_size})")
        return token

    def token_type(self, token_id: int) -> TokenType:
        token_id = self._check_id(token_id)
        if token_id in self.special_ids:
            return TokenType.CONTROL
        if token_id in self.added_ids:
            return TokenType.USER_DEFINED
        return TokenType.NORMAL

    # -- loading -------------------------------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ByteLevelBPE":
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
        except FileNotFoundError:
            raise TokenizerError(f"{path}: not found") from None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise TokenizerError(f"{path}: cannot read as JSON: {e}") from None
        return cls.from_spec(spec, path)

    @classmethod
    def from_spec(cls, spec: dict, source: str = "tokenizer.json") -> "ByteLevelBPE":
        """Build from a parsed tokenizer.json; parts npllm does not implement raise TokenizerError, never ignored,
        and so does every field of the wrong JSON type (a list where an object belongs, a string for a flag)."""
        try:
            return cls._from_spec(spec, source)
        except RecursionError:  # "Sequence" steps nested past Python's recursion limit
            raise TokenizerError(f"{source}: its steps are nested too deeply") from None

    @classmethod
    def _from_spec(cls, spec: dict, source: str) -> "ByteLevelBPE":
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
            raise TokenizerError(f"{source}: no 'model' section")
        model = spec["model"]
        if _field(model, "type", str, source, "model", "BPE") != "BPE":
            raise TokenizerError(f"{source}: model type {model.get('type')!r} is not BPE")
        for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
            if model.get(key):
                raise TokenizerError(f"{source}: BPE option {key}={model[key]!r} is not supported")
        if model.get("byte_fallback"):
            raise TokenizerError(f"{source}: byte_fallback BPE (SentencePiece-style) is not byte-level; "
                                 "use the tokenizer.model beside it")
        vocab = model.get("vocab")
        if not isinstance(vocab, dict) or not all(_is_id(i) for i in vocab.values()):
            raise TokenizerError(f"{source}: model.vocab must map tokens to integer ids >= 0")
        merges = [_parse_merge(m, source) for m in _field(model, "merges", list, source, "model", [])]
        added = [_added_token(entry, source) for entry in _field(spec, "added_tokens", list, source, "", [])]
        _check_decoder(spec.get("decoder"), source)
        prefix, suffix = _template_ids(spec.get("post_processor"), source)
        return cls(
            vocab,
            merges,
            pre_tokenizers=_pre_tokenizers(spec.get("pre_tokenizer"), source),
            added_tokens=added,
            normalizers=_normalizers(spec.get("normalizer"), source),
            ignore_merges=_field(model, "ignore_merges", bool, source, "model", False),
            prefix_ids=prefix,
            suffix_ids=suffix,
            source=source,
        )


class ByteStreamDecoder:
    """Feed ids one at a time; each feed returns the text whose UTF-8 bytes are complete, flush() the rest.
    Concatenating every feed and the flush gives exactly decode(ids)."""

    def __init__(self, tokenizer: ByteLevelBPE):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.text_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


JSON_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "true or false", int: "an integer"}


def _field(spec: dict, key: str, kind: type, source: str, where: str, default=None, required: bool = False):
    """spec[key] when it is of the JSON type `kind` (dict, list, str, bool, int), `default` when absent or null
    (unless required); any other type is a TokenizerError naming the field. (JSON's true is no integer here, nor 1
    a flag.)"""
    value = spec.get(key)
    if value is None and not required:
        return default
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        name = f"{where}.{key}" if where else key
        raise TokenizerError(f"{source}: {name} must be {JSON_NAMES[kind]}, got {value!r:.80}")
    return value


def _step(spec, source: str, what: str) -> dict | None:
    """A normalizer / pre-tokenizer / decoder / post-processor object (None: absent): it must be a JSON object."""
    if spec is not None and not isinstance(spec, dict):
        raise TokenizerError(f"{source}: {what} must be an object, got {spec!r:.80}")
    return spec


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _added_token(entry, source: str) -> AddedToken:
    """One added_tokens entry: an integer id >= 0, a string content, and true/false flags."""
    if not isinstance(entry, dict) or not _is_id(entry.get("id")) or not isinstance(entry.get("content"), str):
        raise TokenizerError(f"{source}: malformed added token {entry!r:.80} (needs an integer id >= 0 and a "
                             "string content)")
    flags = [_field(entry, key, bool, source, "added token", False)
             for key in ("special", "lstrip", "rstrip", "single_word")]
    if not entry["content"]:
        raise TokenizerError(f"{source}: added token {entry['id']} has an empty content")
    return AddedToken(entry["id"], entry["content"], *flags)


def _parse_merge(merge, source: str) -> tuple[str, str]:
    """A merge is "left right" (older files) or ["left", "right"] (newer files)."""
    if isinstance(merge, str):
        parts = merge.split(" ")
    else:
        parts = merge
    if not isinstance(parts, list) or len(parts) != 2 or not all(isinstance(p, str) for p in parts):
        raise TokenizerError(f"{source}: malformed merge {merge!r}")
    return parts[0], parts[1]


def _normalizers(spec, source: str) -> list[str]:
    if _step(spec, source, "normalizer") is None:
        return []
    kind = spec.get("type")
    if kind == "Sequence":
        subs = _field(spec, "normalizers", list, source, "normalizer", [])
        return [form for sub in subs for form in _normalizers(sub, source)]
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return [kind]
    raise TokenizerError(f"{source}: normalizer {kind!r} is not supported")


def _pre_tokenizers(spec, source: str) -> list:
    if _step(spec, source, "pre-tokenizer") is None:
        return []
    kind = spec.get("type")
    where = f"pre-tokenizer {kind}"
    if kind == "Sequence":
        subs = _field(spec, "pretokenizers", list, source, where, [])
        return [step for sub in subs for step in _pre_tokenizers(sub, source)]
    if kind == "Split":
        pattern = _field(spec, "pattern", dict, source, where, {})
        if "Regex" in pattern:
            compiled = _compile(_field(pattern, "Regex", str, source, where + " pattern", required=True), source)
        elif "String" in pattern:
            text = _field(pattern, "String", str, source, where + " pattern", required=True)
            compiled = regex.compile(regex.escape(text))
        else:
            raise TokenizerError(f"{source}: Split pattern {pattern!r:.80} is neither Regex nor String")
        behavior = _field(spec, "behavior", str, source, where, "Isolated")
        invert = _field(spec, "invert", bool, source, where, False)
        _apply_behavior([], behavior)  # reject an unknown behavior now, not at the first encode

        def split(pieces):
            return split_by_regex(pieces, compiled, behavior, invert)

        split.drops_text = behavior == "Removed"  # text then stands for no token: longest_piece_bytes has no bound
        return [split]
    if kind == "ByteLevel":
        steps = []
        if _field(spec, "add_prefix_space", bool, source, where, False):
            steps.append(lambda pieces: [p if p.startswith(" ") else " " + p for p in pieces])
        if _field(spec, "use_regex", bool, source, where, True):
            gpt2 = _compile(GPT2_SPLIT, source)
            steps.append(lambda pieces: split_by_regex(pieces, gpt2, "Isolated", False))
        return steps  # the byte-to-character mapping itself happens for every tokenizer of this class
    if kind == "Digits":
        individual = _field(spec, "individual_digits", bool, source, where, False)
        return [lambda pieces: split_digits(pieces, individual)]
    raise TokenizerError(f"{source}: pre-tokenizer {kind!r} is not supported")


def _compile(pattern: str, source: str) -> regex.Pattern:
    try:
        return regex.compile(pattern)
    except regex.error as e:
        raise TokenizerError(f"{source}: pre-tokenizer regex does not compile: {e}") from None


def _check_decoder(spec, source: str) -> None:
    if _step(spec, source, "decoder") is None:
        return
    kind = spec.get("type")
    if kind == "Sequence":
        for sub in _field(spec, "decoders", list, source, "decoder", []):
            _check_decoder(sub, source)
    elif kind != "ByteLevel":
        raise TokenizerError(f"{source}: decoder {kind!r} is not supported (npllm decodes byte-level BPE)")


def _template_ids(spec, source: str) -> tuple[list[int], list[int]]:
    """Ids a TemplateProcessing post-processor puts before and after a single sequence."""
    if _step(spec, source, "post-processor") is None:
        return [], []
    kind = spec.get("type")
    if kind == "ByteLevel":
        return [], []
    if kind == "Sequence":
        prefix, suffix = [], []
        for sub in _field(spec, "processors", list, source, "post-processor", []):
            p, s = _template_ids(sub, source)
            prefix, suffix = prefix + p, s + suffix
        return prefix, suffix
    if kind != "TemplateProcessing":
        raise TokenizerError(f"{source}: post-processor {kind!r} is not supported")
    where = "post-processor TemplateProcessing"
    specials = _field(spec, "special_tokens", dict, source, where, {})
    prefix, suffix, seen_sequence = [], [], False
    for item in _field(spec, "single", list, source, where, []):
        item = _step(item, source, f"an item of {where}'s single") or {}
        if "Sequence" in item:
            seen_sequence = True
        elif "SpecialToken" in item:
            name = _field(item, "SpecialToken", dict, source, where, {}).get("id")
            special = specials.get(name) if isinstance(name, str) else None
            if special is None:
                raise TokenizerError(f"{source}: template names special token {name!r:.80} without its ids")
            ids = _field(_step(special, source, f"special token {name!r}"), "ids", list, source, name, [])
            if not all(_is_id(i) for i in ids):
                raise TokenizerError(f"{source}: special token {name!r}'s ids must be integers >= 0, got {ids!r:.80}")
            (suffix if seen_sequence else prefix).extend(ids)
    return prefix, suffix


# ----------------------------------------------------------------------------------------------------------------
# GGUF "gpt2" vocabularies name their pre-tokenizer instead of spelling it out: llama.cpp's names (src/llama-vocab.cpp)
# -> the regex splits applied in turn, each match its own piece. "refact" / "starcoder" / "smollm" (Granite, SmolLM)
# first isolate every digit; "dbrx" (cl100k: OLMo 2, Phi-4) splits as Llama 3; "gpt-4o" is o200k's split.
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DIGITS_THEN_GPT2 = (r"\p{N}", GPT2_SPLIT)
GGUF_PRE_TOKENIZERS = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "dbrx": LLAMA3_SPLIT,
                       "smaug-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, "gpt-2": GPT2_SPLIT, "olmo": GPT2_SPLIT,
                       "phi-2": GPT2_SPLIT, "default": GPT2_SPLIT, "refact": DIGITS_THEN_GPT2,
                       "starcoder": DIGITS_THEN_GPT2, "smollm": DIGITS_THEN_GPT2, "gpt-4o": GPT4O_SPLIT}


def _isolating(pattern: regex.Pattern):
    """A pre-tokenizer step: every match of `pattern` its own piece."""
    return lambda pieces: split_by_regex(pieces, pattern, "Isolated", False)


def from_gguf_vocab(tokens: list[str], merges: list[str], token_types, pre: str | None,
                    bos_id: int | None, eos_id: int | None, add_bos: bool | None, source: str) -> ByteLevelBPE:
    """A byte-level BPE from GGUF metadata (tokenizer.ggml.model = "gpt2"). Control and user-defined tokens
    (types 3 and 4) are matched whole in the text, like tokenizer.json's added tokens."""
    patterns = GGUF_PRE_TOKENIZERS.get(pre or "default")
    if patterns is None:
        raise TokenizerError(f"{source}: GGUF pre-tokenizer {pre!r} is not one npllm knows "
                             f"({', '.join(GGUF_PRE_TOKENIZERS)})")
    steps = [_isolating(_compile(p, source)) for p in ((patterns,) if isinstance(patterns, str) else patterns)]
    types = list(token_types) if token_types is not None else [1] * len(tokens)
    added = [AddedToken(i, t, special=types[i] == 3) for i, t in enumerate(tokens) if types[i] in (3, 4)]
    vocab = {t: i for i, t in enumerate(tokens) if types[i] not in (3, 4)}
    return ByteLevelBPE(
        vocab,
        [_parse_merge(m, source) for m in merges],
        pre_tokenizers=steps,
        added_tokens=added,
        prefix_ids=[bos_id] if add_bos and bos_id is not None else [],
        bos_id=bos_id,
        eos_id=eos_id,
        source=source,
    )
