"""Structured outputs: a constraint (JSON, a JSON Schema, a regular expression, a grammar) as a sampling stage.

    Constraint          what the output must be: Constraint.json(schema=None), .regex(pattern), .grammar(text);
                        checked when made (a schema keyword that is not enforced is refused, naming it and its path)
    Constraint.bind     the constraint for one tokenizer and model vocabulary: a BoundConstraint, compiled once
    BoundConstraint.start()  one sequence's ConstraintState:
        allowed(stops)  [V] bool: the tokens the language allows next; the stop ids exactly where it may end
        advance(token)  take the token drawn
        finished        nothing but the end is allowed: the sequence ends without another forward

The generation loop (npllm.generate) sets every token outside allowed() to -inf before the first stage of the
sampling pipeline (npllm.sampling.constrain), so penalties, temperature, the filters and the draw all act on the
allowed set only. The masks come from llguidance, the engine llama.cpp, vLLM and SGLang use; npllm gives it each id's
bytes (Tokenizer.token_bytes: SentencePiece's U+2581 as a space and <0xNN> pieces as their byte, byte-level BPE's
byte table), which ids are special (never allowed: llguidance allows only EOS among them, and npllm replaces EOS by
the sequence's own stop ids), and the model's vocabulary size (ids past the tokenizer's, a padded embedding's
rows, are never allowed). docs/structured.md states the languages, what is refused and the laws.
"""

from __future__ import annotations

import functools
import json
import weakref
from dataclasses import dataclass

import numpy as np

from .errors import ConstraintError, GenerationError

__all__ = ["Constraint", "BoundConstraint", "ConstraintState", "check_schema"]


def _llguidance():
    """The llguidance module (a dependency; imported on first use so that `import npllm` stays light)."""
    import llguidance

    return llguidance


# ----------------------------------------------------------------------------------------------------------------
# JSON Schema: what llguidance enforces, what changes nothing, and everything else refused
# ----------------------------------------------------------------------------------------------------------------

# Keywords whose every instance llguidance enforces (its json_schema.md, and each tried in tests/test_constraint.py).
ENFORCED = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
# Annotations: Draft 2020-12 gives them no say over which instances are valid, so nothing is lost by not enforcing.
ANNOTATIONS = frozenset({
    "$schema", "$id", "$anchor", "$comment", "title", "description", "default", "examples", "deprecated",
    "readOnly", "writeOnly", "contentEncoding", "contentMediaType",
})
# The string formats llguidance enforces; any other `format` would be a promise it cannot keep.
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"})
MOST_DEPTH = 256  # nested subschemas: far past any real schema, well inside Python's recursion limit
# Where a keyword's value holds subschemas: one schema, a list of them, or a name -> schema map.
_ONE, _LIST, _MAP = ("items", "additionalProperties"), ("prefixItems", "anyOf", "oneOf", "allOf"), (
    "properties", "patternProperties", "$defs", "definitions")


def check_schema(schema, path: str = "") -> None:
    """Refuse a JSON Schema with a keyword npllm would not enforce: ConstraintError naming the keyword and its
    JSON Pointer (a misspelt keyword too: a validator would ignore it, and so would the output). A top-level
    "x-guidance" (llguidance's whitespace and separator options) is allowed."""
    if isinstance(schema, bool):
        return
    if path.count("/") > MOST_DEPTH:
        raise ConstraintError(f"JSON schema is nested more than {MOST_DEPTH} levels deep (at {path[:80]}...)")
    if not isinstance(schema, dict):
        raise ConstraintError(f"JSON schema at {path or '/'} must be an object or a boolean, got "
                              f"{type(schema).__name__}")
    for key, value in schema.items():
        where = f"{path}/{_pointer(key)}"
        if key == "x-guidance" and not path:
            continue
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise ConstraintError(f"JSON schema keyword {key!r} at {where} is not enforced by npllm's constraint "
                                  f"engine, so the output could break it: remove it (docs/structured.md lists the "
                                  f"keywords enforced)")
        _check_value(key, value, where)


def _check_value(key: str, value, where: str) -> None:
    """The subschemas under one keyword, and the values of `format` and `$ref` that cannot be kept."""
    if key == "format" and value not in FORMATS:
        raise ConstraintError(f"JSON schema format {value!r} at {where} is not enforced (enforced: "
                              f"{', '.join(sorted(FORMATS))})")
    if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
        raise ConstraintError(f"JSON schema $ref {value!r} at {where}: only references inside the schema "
                              f"(starting with '#') are resolved")
    if key in _ONE:
        check_schema(value, where)
    elif key in _LIST:
        if not isinstance(value, list):
            raise ConstraintError(f"JSON schema keyword {key!r} at {where} must hold a list of schemas")
        for i, sub in enumerate(value):
            check_schema(sub, f"{where}/{i}")
    elif key in _MAP:
        if not isinstance(value, dict):
            raise ConstraintError(f"JSON schema keyword {key!r} at {where} must hold an object of schemas")
        for name, sub in value.items():
            check_schema(sub, f"{where}/{_pointer(name)}")


def _pointer(name: str) -> str:
    """One JSON Pointer reference token (RFC 6901: ~ and / escaped)."""
    return str(name).replace("~", "~0").replace("/", "~1")


# ----------------------------------------------------------------------------------------------------------------
# Constraints
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Constraint:
    """What an output must be. Make one with Constraint.json(), .regex() or .grammar(); each is checked (and its
    grammar built and validated by llguidance) when made, so a bad one fails before anything is generated.

    kind: "json_schema", "regex" or "grammar"; source: the schema as JSON text, the pattern, or the grammar.
    """

    kind: str
    source: str

    @classmethod
    def json(cls, schema=None) -> "Constraint":
        """Any JSON value (schema None), or JSON valid against `schema` (a dict, a bool, or its JSON text)."""
        if schema is None:
            schema = {}
        try:
            if isinstance(schema, (str, bytes)):
                try:
                    schema = json.loads(schema)
                except ValueError as err:
                    raise ConstraintError(f"JSON schema is not valid JSON: {err}") from None
            check_schema(schema)
            return cls("json_schema", json.dumps(schema, sort_keys=False))
        except RecursionError:  # the JSON parser, the walk and json.dumps recurse once per level
            raise ConstraintError("JSON schema is nested too deeply") from None

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """Text that matches `pattern` whole (Rust regex syntax, as llguidance reads it; no look-around)."""
        if not isinstance(pattern, str):
            raise ConstraintError(f"regex must be a string, got {type(pattern).__name__}")
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> "Constraint":
        """Text in the language of a context-free grammar: Lark-style EBNF (llguidance's syntax, rule `start`) or
        llama.cpp's GBNF (rule `root`), told apart by their syntax."""
        if not isinstance(text, str):
            raise ConstraintError(f"grammar must be a string, got {type(text).__name__}")
        return cls("grammar", text)

    def __post_init__(self):
        if self.kind not in ("json_schema", "regex", "grammar"):
            raise ConstraintError(f"constraint kind must be json_schema, regex or grammar, got {self.kind!r}")
        _grammar_of(self)  # built and validated now: a bad constraint fails where it is made

    @property
    def schema(self):
        """The JSON Schema of a json_schema constraint (None for the others)."""
        return json.loads(self.source) if self.kind == "json_schema" else None

    def bind(self, tokenizer, vocab_size: int | None = None) -> "BoundConstraint":
        """This constraint for `tokenizer`'s ids, on a model with `vocab_size` logits per row (default the
        tokenizer's; more when the embedding is padded). Bound once per (constraint, tokenizer, size): kept."""
        vocabulary = Vocabulary.of(tokenizer, tokenizer.vocab_size if vocab_size is None else int(vocab_size))
        return _bound(self, vocabulary)


# JSON without whitespace between tokens, as OpenAI's and llama.cpp's outputs come: a small model given room for
# whitespace may spend its tokens there. A schema's top-level "x-guidance" ({"whitespace_flexible": true}) opens it.
JSON_DEFAULTS = {"whitespace_flexible": False}


@functools.lru_cache(maxsize=256)
def _grammar_of(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint, validated without a tokenizer (ConstraintError on any error)."""
    llg = _llguidance()
    try:
        if constraint.kind == "json_schema":  # compact JSON unless the schema's "x-guidance" says otherwise
            grammar = llg.LLMatcher.grammar_from_json_schema(constraint.source, defaults=JSON_DEFAULTS)
        else:
            grammar = llg.grammar_from(constraint.kind, constraint.source)
    except ValueError as err:
        raise ConstraintError(f"{constraint.kind} constraint: {err}") from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConstraintError(f"{constraint.kind} constraint refused: {_short(messages[0])}")
    return grammar


def _short(message: str) -> str:
    """llguidance's message without its trace of the grammar (the first lines say what is wrong)."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3])


# ----------------------------------------------------------------------------------------------------------------
# A tokenizer as the mask engine sees it
# ----------------------------------------------------------------------------------------------------------------


class Vocabulary:
    """A tokenizer's ids as bytes, for llguidance: built once per (tokenizer, model vocabulary size) and kept."""

    _kept: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer, size: int):
        n = tokenizer.vocab_size
        if size < n:
            raise ConstraintError(f"the model's vocabulary ({size}) is smaller than its tokenizer's ({n})")
        self.size, self.known = size, n
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)]
        self.special = [i for i in range(n) if tokenizer.is_special(i)]
        self._tokenizer = weakref.ref(tokenizer)  # weak: the table is kept per tokenizer, not the tokenizer by it
        self._by_bytes = {}
        for i in range(n - 1, -1, -1):  # the lowest id spells each byte string, specials never
            if i not in self.special:
                self._by_bytes.setdefault(self.tokens[i], i)
        self._special_set = frozenset(self.special)
        self._longest = max(map(len, self._by_bytes), default=1)
        eos = tokenizer.eos_id if tokenizer.eos_id is not None and 0 <= tokenizer.eos_id < n else self.special[0]
        self.engine = _llguidance().LLTokenizer(_llguidance().TokenizerWrapper(_Wrapper(self, eos, tokenizer)))

    @classmethod
    def of(cls, tokenizer, size: int) -> "Vocabulary":
        sizes = cls._kept.setdefault(tokenizer, {})
        if size not in sizes:
            sizes[size] = cls(tokenizer, size)
        return sizes[size]

    def encode(self, text) -> list[int]:
        """Ids whose bytes are exactly `text`'s (llguidance asks for forced text): the tokenizer's own encoding
        where it spells the bytes exactly (no dummy prefix, valid UTF-8), else the longest tokens first."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        tokenizer = self._tokenizer()
        try:
            if tokenizer is None:
                raise ValueError("the tokenizer is gone")
            ids = tokenizer.encode(data.decode("utf-8"), bos=False)
            if b"".join(self.tokens[i] for i in ids) == data and not self._special_set.intersection(ids):
                return ids
        except (UnicodeDecodeError, ValueError):
            pass
        return self._longest_first(data)

    def _longest_first(self, data: bytes) -> list[int]:
        ids, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                token = self._by_bytes.get(data[i:i + n])
                if token is not None:
                    ids.append(token)
                    i += n
                    break
            else:  # a byte no token spells (a vocabulary without byte fallback): the mask never allows it either
                i += 1
        return ids


class _Wrapper:
    """What llguidance's TokenizerWrapper reads: the ids' bytes, EOS, BOS, the special ids, and an encoder."""

    def __init__(self, vocabulary: Vocabulary, eos: int, tokenizer):
        self.tokens, self.special_token_ids = vocabulary.tokens, vocabulary.special
        self.eos_token_id = eos
        bos = getattr(tokenizer, "bos_id", None)
        self.bos_token_id = bos if bos is not None and 0 <= bos < vocabulary.known else None
        self._vocabulary = vocabulary

    def __call__(self, text) -> list[int]:
        return self._vocabulary.encode(text)


@functools.lru_cache(maxsize=64)
def _bound(constraint: Constraint, vocabulary: Vocabulary) -> "BoundConstraint":
    return BoundConstraint(constraint, vocabulary)


# ----------------------------------------------------------------------------------------------------------------
# A bound constraint, and one sequence's state
# ----------------------------------------------------------------------------------------------------------------


class BoundConstraint:
    """A constraint compiled for one vocabulary: start() gives each sequence its own state (a copy of the compiled
    matcher, so the grammar is compiled once)."""

    def __init__(self, constraint: Constraint, vocabulary: Vocabulary):
        self.constraint, self.vocabulary = constraint, vocabulary
        llg = _llguidance()
        self._matcher = llg.LLMatcher(vocabulary.engine, _grammar_of(constraint), log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(f"{constraint.kind} constraint refused: {_short(self._matcher.get_error())}")

    def start(self) -> "ConstraintState":
        return ConstraintState(self, self._matcher.deep_copy())

    def __repr__(self) -> str:
        return f"BoundConstraint({self.constraint.kind}, vocabulary={self.vocabulary.size})"


class ConstraintState:
    """One sequence's place in the language: the tokens allowed next, the token drawn, and whether it is done."""

    def __init__(self, bound: BoundConstraint, matcher):
        self.bound, self._matcher = bound, matcher
        self.tokens: list[int] = []

    @property
    def accepting(self) -> bool:
        """The text so far is in the language: the output may end here."""
        return self._matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing but the end is allowed: the output is complete (and in the language)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def allowed(self, stops=()) -> np.ndarray:
        """[V] bool: the ids whose bytes keep the text a prefix of the language, and the ids in `stops` (the
        sequence's stop ids) exactly where the language may end. Ids past the tokenizer's are never allowed."""
        vocabulary = self.bound.vocabulary
        bits = np.frombuffer(self._matcher.compute_bitmask(), np.uint8)
        self._check()
        mask = np.zeros(vocabulary.size, bool)
        mask[:vocabulary.known] = np.unpackbits(bits, bitorder="little")[:vocabulary.known]
        mask[vocabulary.engine.eos_tokens] = False  # the end is the sequence's stop ids, below
        stops = [t for t in stops if t is not None and 0 <= t < vocabulary.size]
        mask[stops] = self.accepting
        return mask

    def copy(self) -> "ConstraintState":
        """An independent state at the same place (speculative decoding walks a draft's proposals on one)."""
        twin = ConstraintState(self.bound, self._matcher.deep_copy())
        twin.tokens = list(self.tokens)
        return twin

    def advance(self, token: int) -> None:
        """Take the drawn token (a stop id ends the sequence and is not taken)."""
        token = int(token)
        if not self._matcher.consume_token(token):
            raise GenerationError(f"token {token} is outside the {self.bound.constraint.kind} constraint's "
                                  f"language: {_short(self._matcher.get_error())}")
        self.tokens.append(token)

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GenerationError(f"{self.bound.constraint.kind} constraint: {_short(self._matcher.get_error())}")
