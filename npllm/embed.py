"""Embeddings: one vector per text from the decoder's final-norm hidden states.

    h = forward(ids)                       # [T] -> [T, D]: the hidden states the LM head would read
    e = pool(h, pooling)                   # [T, D] -> [D]
        last   h[T-1]                      a causal decoder's last token is the only one that has seen the whole text
        mean   (1/T) sum_t h[t]
        cls    h[0]
    e = e / max(||e||_2, eps)              # normalize: unit length, so that e_a . e_b is the cosine similarity

Qwen3-Embedding and other decoder embedders take the last token, normalized (their sentence-transformers files say
so, and GGUF's pooling_type; ModelConfig.pooling and normalize_embeddings hold what the files say). Each text is
its own forward on a fresh cache, so a text's vector is the same whatever else is embedded beside it.
"""

from __future__ import annotations

import numpy as np

from .errors import GenerationError

POOLINGS = ("last", "mean", "cls")
NORM_EPS = 1e-12  # sentence-transformers' Normalize divides by max(||e||, 1e-12)


def pool(h: np.ndarray, pooling: str) -> np.ndarray:
    """One vector from a text's hidden states.                                             # [T, D] -> [D]"""
    if pooling == "last":
        return h[-1]
    if pooling == "mean":
        return h.mean(axis=0, dtype=np.float64).astype(h.dtype)
    if pooling == "cls":
        return h[0]
    raise GenerationError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")


def l2_normalize(e: np.ndarray) -> np.ndarray:
    """e scaled to unit Euclidean length (a zero vector stays zero).                          # [D] -> [D]"""
    norm = float(np.linalg.norm(e.astype(np.float64)))
    return (e / max(norm, NORM_EPS)).astype(e.dtype)


def hidden_states(model, ids) -> np.ndarray:
    """The final-norm hidden states of one text, on a cache of its own, as a float32 host array.  # [T] -> [T, D]"""
    ids = np.asarray(ids, dtype=np.int64)
    cache = model.new_cache(capacity=len(ids))
    h = model.forward(ids, np.arange(len(ids)), cache)
    return np.array(np.asarray(h), dtype=np.float32)  # a copy: a backend may reuse its output buffer


def embed_ids(model, ids, pooling: str, normalize: bool) -> np.ndarray:
    """One text's embedding from its token ids.                                                # [T] -> [D]"""
    check_ids(model.config, ids)
    e = pool(hidden_states(model, ids), pooling)
    return l2_normalize(e) if normalize else e


def check_ids(config, ids) -> None:
    """A text to embed: 1 .. context tokens of the vocabulary."""
    if len(ids) == 0:
        raise GenerationError("an empty text has no embedding (it encodes to no tokens)")
    if len(ids) > config.max_seq_len:
        raise GenerationError(f"a text of {len(ids)} tokens is longer than the model's context "
                              f"({config.max_seq_len} tokens)")
    bad = [int(t) for t in ids if not 0 <= int(t) < config.vocab_size]
    if bad:
        raise GenerationError(f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")


def resolve_pooling(config, pooling: str | None, normalize: bool | None) -> tuple[str, bool]:
    """The pooling and normalization a call uses: what it names, else what the model's files say; a model whose
    files say nothing takes "last" (a decoder's only token that saw the whole text) unnormalized, as given."""
    pooling = pooling or config.pooling or "last"
    if pooling not in POOLINGS:
        raise GenerationError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
    return pooling, config.normalize_embeddings if normalize is None else bool(normalize)
