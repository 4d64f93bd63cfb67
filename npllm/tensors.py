"""Canonical weights as both the readers (npllm.formats) and the backends (npllm.models) see them, so that neither
imports the other: the set a config implies (expected_shapes, check_weights), the RoPE row permutations between
Hugging Face's half-split q/k layout and Meta's interleaved one, and the release of a memory-mapped weight's pages
once it is copied or checked.

Canonical names and layouts: npllm/formats/__init__.py.
"""

from __future__ import annotations

import mmap

import numpy as np

from .config import ModelConfig
from .errors import ConfigError, FormatError


# ----------------------------------------------------------------------------------------------------------------
# The weights a config implies


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical weight the model needs, with its shape ([out, in] for matrices)."""
    D, V = config.dim, config.vocab_size
    shapes = {"tok_embeddings": (V, D), "norm": (D,)}
    if not config.tied_embeddings:
        shapes["output"] = (V, D)
    for l in range(config.n_layers):
        shapes |= {f"layers.{l}.{name}": shape for name, shape in layer_shapes(config).items()}
    return shapes


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The weights of one block, by the options the config names (config.py), with their shapes."""
    D, F, Dh, E, Fe = config.dim, config.hidden_dim, config.head_dim, config.n_experts, config.moe_hidden_dim
    HD, KD = config.n_heads * Dh, config.n_kv_heads * Dh
    pre = config.block_norms != "post"  # in Llama's order, so files written from this set keep their layout
    shapes = {"attention_norm": (D,)} if pre else {}
    shapes |= {"wq": (HD, D), "wk": (KD, D), "wv": (KD, D), "wo": (D, HD)} | ({"ffn_norm": (D,)} if pre else {})
    if E:
        shapes |= {"router": (E, D), "w1_exps": (E, Fe, D), "w2_exps": (E, D, Fe), "w3_exps": (E, Fe, D)}
    else:
        shapes |= {"w1": (F, D), "w2": (D, F), "w3": (F, D)}
    if config.attention_bias:
        shapes |= {"bq": (HD,), "bk": (KD,), "bv": (KD,)}
    if config.block_norms != "pre":
        shapes |= {"post_attention_norm": (D,), "post_ffn_norm": (D,)}
    if config.qk_norm == "head":
        shapes |= {"q_norm": (Dh,), "k_norm": (Dh,)}
    elif config.qk_norm == "projection":
        shapes |= {"q_norm": (HD,), "k_norm": (KD,)}
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """Every needed weight present with the shape the config implies, nothing left over (no silent garbage model);
    returns the needed set.

    A stored lm_head equal in role to the tied embedding is dropped for tied models (some exports save both).
    """
    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in weights]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise FormatError(f"{source}: missing weight {missing[0]!r}{more}")
    extra = [n for n in weights if n not in shapes and not (n == "output" and config.tied_embeddings)]
    if extra:
        raise FormatError(f"{source}: weight {extra[0]!r} does not belong to a model with this config")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            what = "vocabulary size" if name in ("tok_embeddings", "output") else "shape"
            raise FormatError(
                f"{source}: weight {name!r} has shape {tuple(weights[name].shape)}, but the config implies {shape} "
                f"(wrong {what}?)"
            )
    return {name: weights[name] for name in shapes}


# ----------------------------------------------------------------------------------------------------------------
# RoPE layouts


def permute_qk_half_to_interleaved(w: np.ndarray, n_heads: int, head_dim: int,
                                   rotary_dims: int | None = None) -> np.ndarray:
    """Reorder the rows of a q or k projection (or its bias) from HF's half-split layout to the interleaved one.

    Within each head, half-split output j < r/2 pairs with j + r/2; interleaved pairs are (2i, 2i+1). So the new
    row 2i of a head is old row i, and new row 2i+1 is old row i + r/2; rows r .. Dh-1 (not rotated: partial
    rotary, r = rotary_dims, default Dh) stay where they are:

        [n_heads * Dh, ...] -> view [n_heads, Dh, ...]; its first r rows [2, r/2] -> swap -> [r/2, 2] -> flat rows
    """
    return _permute_rotated(w, n_heads, head_dim, rotary_dims, (2, -1))


def permute_qk_interleaved_to_half(w: np.ndarray, n_heads: int, head_dim: int,
                                   rotary_dims: int | None = None) -> np.ndarray:
    """Inverse of permute_qk_half_to_interleaved: each head's first r rows [r/2, 2] -> swap -> [2, r/2]."""
    return _permute_rotated(w, n_heads, head_dim, rotary_dims, (-1, 2))


def _permute_rotated(w: np.ndarray, n_heads: int, head_dim: int, rotary_dims: int | None, split) -> np.ndarray:
    _check_qk(w, n_heads, head_dim)
    r = head_dim if rotary_dims is None else rotary_dims
    if r % 2 or not 0 < r <= head_dim:
        raise ConfigError(f"rotary dims {r} must be even and in (0, head_dim {head_dim}]")
    rest = w.shape[1:]
    heads = w.reshape(n_heads, head_dim, *rest)
    rotated = heads[:, :r].reshape(n_heads, *[r // 2 if a == -1 else a for a in split], *rest).swapaxes(1, 2)
    return np.concatenate([rotated.reshape(n_heads, r, *rest), heads[:, r:]], axis=1).reshape(w.shape)


def _check_qk(w: np.ndarray, n_heads: int, head_dim: int) -> None:
    if head_dim % 2 or w.ndim < 1 or w.shape[0] != n_heads * head_dim:
        raise ConfigError(f"q/k rows {w.shape} do not split into {n_heads} heads of even size {head_dim}")


# ----------------------------------------------------------------------------------------------------------------
# Pages of memory-mapped weights


def release(*weights) -> None:
    """Drop the pages of weights read from a memory-mapped file from this process's resident memory.

    Reading a mapped weight makes its pages resident, and they stay counted in the process's memory as long as the
    map lives. A backend that copies the weights into its own layout (the numba model's panels) would then hold the
    model twice; releasing each weight once it is copied keeps one copy. Nothing is lost: a released page is read
    back from the file (usually from the OS's page cache) if the weight is ever read again. Weights that are not
    views of a read-only file mapping (arrays in memory, copies) are left alone; so is everything on a system
    without madvise.
    """
    from .quant import matrix_bytes

    for w in weights:
        a = matrix_bytes(w)
        mapping = _file_mapping(a)
        if mapping is None or not a.flags.c_contiguous or a.nbytes == 0:
            continue
        start = a.ctypes.data - np.frombuffer(mapping, np.uint8, count=1).ctypes.data
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the weight: neighbours keep theirs
        end = (start + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first:
            mapping.madvise(mmap.MADV_DONTNEED, first, end - first)


def release_files(weights) -> None:
    """release() of every page of each read-only file mapping the weights view, one call per mapping, once the
    caller is done with all of them (a check of every weight, a copy into a backend's layout). A weight's own
    release() keeps the pages it shares with its neighbours, and reading the next weight can map some of its pages
    back in (the kernel maps cached neighbours around a fault: up to a large folio, 2 MiB): 10-14 MB of a 110M
    Q4_0 GGUF stayed resident after the pass of check_finite that way, ~18 MB after loading its F32 twin."""
    from .quant import matrix_bytes

    mappings = {}
    for w in weights:
        mapping = _file_mapping(matrix_bytes(w))
        if mapping is not None:
            mappings[id(mapping)] = mapping
    for mapping in mappings.values():
        mapping.madvise(mmap.MADV_DONTNEED, 0, len(mapping))


def _file_mapping(a) -> mmap.mmap | None:
    """The read-only mmap.mmap an array is a view of, or None."""
    if not isinstance(a, np.ndarray) or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    base = a
    while base is not None:
        if isinstance(base, np.memmap) and isinstance(getattr(base, "_mmap", None), mmap.mmap):
            base = base._mmap
        if isinstance(base, mmap.mmap):
            # only a mapping that cannot be written is dropped: its pages always equal the file's
            return base if _read_only(base) else None
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return None


def _read_only(mapping: mmap.mmap) -> bool:
    try:
        with memoryview(mapping) as view:
            return view.readonly
    except (TypeError, ValueError):  # a closed mapping
        return False
