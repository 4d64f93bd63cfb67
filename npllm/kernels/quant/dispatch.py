"""The table of every block type's Numba pieces (record.BlockKernels, one per quant.QuantType of the same name), and
the dispatchers generated from it: each takes a type's code (its GGML id, plus INTERLEAVED_CODE for a matrix held
interleaved) and calls that type's piece. Numba cannot look a function up in a Python table at run time, so each
dispatcher is built once at import as a chain of compiled cases (`_cases`), one per record: adding a type adds a
record, not a branch.

    matmul_rows_interleaved(code, w, q, d, s, s16, T, out, col, n0, n1)   the products of every block type (a walk)
    matvec_rows(code, w, x, sums, out, col, n0, n1)                       one token, float types
    matmul_rows(code, w, x, T, out, col, n0, n1)                          T tokens, float types (panels of 16 rows)
    decode_row(code, w, n, out), decode_any_row(code, w, n, out, scratch) a row as float32 (embedding lookups)
    held_interleaved(code), held_in_panels(code)                         the layout a model's code names
    gather_interleaved_row(code, w8, n, row)                              an interleaved row back in its file's bytes
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ... import quant
from ...quant import INTERLEAVE, QuantizationError
from ..cpu import PANEL, REASSOC, TILE_T, tile_6x16
from ..simd import vstore
from . import floats, iq4, kquants, legacy
from .activations import quantize_activations_q8_into, two_part_activations_into
from .expanded import expand_starts, expanded_bytes, expanded_tile
from .intrinsics import PAIRED

KERNELS = {k.name: k for k in floats.RECORDS + legacy.RECORDS + kquants.RECORDS + iq4.RECORDS}
# The type codes of a model's table (models/numba_weights.py): the GGML type id, plus where the model holds the matrix in
# a layout of its own: INTERLEAVED_CODE, rows interleaved by eight (quant.interleave_rows: every block type's
# products), or PANELS_CODE, float32 panels of 16 rows (cpu.pack_panels: F32's products, cpu.matmul_panel_rows).
INTERLEAVED_CODE = 1000
PANELS_CODE = 2000
PANEL_TYPES = ("F32",)
INTERLEAVED_TYPES = tuple(name for name in quant.INTERLEAVED_TYPES if KERNELS[name].tile is not None)
ROW_TYPES = tuple(KERNELS)  # the types decode_row reads
FLOAT_TYPES = tuple(name for name, k in KERNELS.items() if k.matvec is not None)

# values and bytes per block, and whether the products take two 8-bit parts, indexed by GGML type id
_IDS = max(t.type_id for t in quant.TYPES.values()) + 1
TYPE_BLOCK_SIZE, TYPE_BLOCK_BYTES = np.ones(_IDS, np.int64), np.ones(_IDS, np.int64)
TWO_PART = np.zeros(_IDS, np.bool_)
for _t in quant.TYPES.values():
    TYPE_BLOCK_SIZE[_t.type_id], TYPE_BLOCK_BYTES[_t.type_id] = _t.block_size, _t.block_bytes
    TWO_PART[_t.type_id] = _t.activations == "two_part"


def _code(name: str, interleaved: bool = False) -> int:
    return quant.TYPES[name].type_id + (INTERLEAVED_CODE if interleaved else 0)


@njit(inline="always")
def held_interleaved(code) -> bool:
    """Whether a model's matrix of this code is held as interleaved rows (INTERLEAVED_CODE + its GGML id)."""
    return INTERLEAVED_CODE <= code < PANELS_CODE


@njit(inline="always")
def held_in_panels(code) -> bool:
    """Whether a model's matrix of this code is held as float32 panels (PANELS_CODE + F32's id)."""
    return code >= PANELS_CODE


# ---------------------------------------------------------------------------------------------- the chains

def _case(code: int, then, rest):
    """case(c, args): then(*args) where c == code, else rest(c, args). Inlined into its caller (Numba's IR), so a
    chain of cases compiles to the branches one would write by hand."""

    @njit(inline="always")
    def case(c, args):
        if c == code:
            then(*args)
        else:
            rest(c, args)

    return case


@njit(inline="always")
def _no_case(c, args):
    raise ValueError("no kernel for this type code (kernels.quant.dispatch: a GGML type id, + INTERLEAVED_CODE for "
                     "a matrix held interleaved)")


def _cases(cases: list) -> object:
    """One dispatcher from [(code, function)]: dispatch(code, args) calls the function of that code with the tuple
    args; an unknown code raises ValueError."""
    call = _no_case
    for code, function in reversed(cases):
        call = _case(code, function, call)
    return call


# ---------------------------------------------------------------------------------------------- interleaved walks

def _group_walker(tile):
    """walk(w, q, d, s, s16, T, out, col, g): out[t, col + 8g + r] for t < T and r < 8 (16 for a pair), four tokens at a
    time."""

    @njit(fastmath=REASSOC, inline="always")
    def walk(w, q, d, s, s16, T, out, col, g):
        stride, at = out.shape[1], col + 8 * g
        for t in range(0, T, 4):
            n = min(4, T - t)
            a0, a1, a2, a3 = tile(w, g, q, d, s, s16, t, n)
            vstore(out, t * stride + at, a0)
            if n > 1:
                vstore(out, (t + 1) * stride + at, a1)
            if n > 2:
                vstore(out, (t + 2) * stride + at, a2)
            if n > 3:
                vstore(out, (t + 3) * stride + at, a3)

    return walk


@njit(inline="always")
def _no_group(w, g, e, j):
    """Expansion.group of a type without one (never called: its walk is never wide)."""


@njit(inline="always")
def _no_walk(w, q, d, s, s16, T, out, col, g):
    """The walk over expanded groups of a type without them (never called; a no-op, so no tile is compiled twice)."""


def interleaved_kernels(qtype: str, pairs: bool = PAIRED):
    """rows_into(w8, q, d, s, s16, T, out, col, n0, n1) of one interleaved type, n0 a multiple of 8: pairs of
    groups where `pairs` (PAIRED: the machine's walk), then single groups, then the rows of a last group that n1
    cuts (a matrix whose rows are not a multiple of 8: its last group is padded with zero rows, computed aside and
    not stored). Each tile asks for its groups' next bytes itself (intrinsics.ask_ahead). From its Expansion's
    tokens on, a type with one decodes each group once into a scratch that every four tokens' tile then reads
    (expanded.py)."""
    tile, x = KERNELS[qtype].tile, KERNELS[qtype].expand
    walk8, walk16 = _group_walker(tile(1)), _group_walker(tile(2))
    expands = x is not None
    size, mins, expand_from = (x.size, x.mins, x.tokens) if expands else (32, False, 0)
    bias8, bias16 = (x.bias(1), x.bias(2)) if expands else (0, 0)
    group = x.group if expands else _no_group
    wide8, wide16 = (_group_walker(expanded_tile(x)(1)), _group_walker(expanded_tile(x)(2))) if expands else (
        _no_walk, _no_walk)

    @njit(fastmath=REASSOC, cache=True)
    def rows_into(w, q, d, s, s16, T, out, col, n0, n1):
        """out[t, col + n] for t < T, n0 <= n < n1 (out C-contiguous float32 [>=T, >=col + n1])."""
        g, end = n0 // 8, -(-n1 // 8)
        wide = expands and T >= expand_from
        e = np.empty((2 if wide else 0, expanded_bytes(q.shape[1], size, mins)), np.uint8)
        starts8 = np.empty((T if wide else 0, q.shape[1] // size), np.int32)
        starts16 = np.empty_like(starts8)
        minus_ds = np.empty((T if wide else 0, q.shape[1] // 32 if mins else 0), np.float32)
        if wide:
            expand_starts(d, s, s16, T, bias8, size, minus_ds, starts8)
            expand_starts(d, s, s16, T, bias16, size, minus_ds[:0], starts16)
        while pairs and g + 2 <= n1 // 8:
            if wide:
                group(w, g, e, 0)
                group(w, g + 1, e, 1)
                wide16(e, q, d, minus_ds, starts16, T, out, col + 8 * g, 0)
            else:
                walk16(w, q, d, s, s16, T, out, col, g)
            g += 2
        aside = np.empty((T if n1 % 8 else 0, 8), np.float32)
        while g < end:
            cut = 8 * g + 8 > n1  # a last group that n1 cuts: its eight rows into aside[t, 0:8] (one call site, so
            if wide:  # one inlined tile)
                group(w, g, e, 0)
                wide8(e, q, d, minus_ds, starts8, T, aside if cut else out, 0 if cut else col + 8 * g, 0)
            else:
                walk8(w, q, d, s, s16, T, aside if cut else out, -8 * g if cut else col, g)
            g += 1
        for t in range(aside.shape[0]):
            for r in range(n1 % 8):
                out[t, col + n1 - n1 % 8 + r] = aside[t, r]

    return rows_into


_matmul_rows_interleaved = _cases([(_code(name, True), interleaved_kernels(name)) for name in INTERLEAVED_TYPES])


@njit(cache=True)
def matmul_rows_interleaved(code, w, q, d, s, s16, T, out, col, n0, n1):
    """out[t, col + n] = W[n] . x[t] for t < T, n0 <= n < n1 (n0 a multiple of 8), W held as interleaved rows
    (quant.interleave_rows) of the type whose GGML id is code - INTERLEAVED_CODE, x given by
    quantize_activations_q8_into(x, T, q, d, s, s16) (once per input, shared by every row range and matrix), or for
    the types of activations "two_part" by two_part_activations_into (q [>=T, 2K]: the two 8-bit parts): what the
    Numba model runs for every block type.
          # q [>=T, K] int8, d, s [>=T, K / 32] float32, s16 [>=T, K / 16] int32 -> out [>=T, >=col + n1] float32"""
    _matmul_rows_interleaved(code, (w, q, d, s, s16, T, out, col, n0, n1))


@njit(inline="always")
def takes_two_parts(code) -> bool:
    """Whether a matrix of this code (interleaved) meets its activations in two 8-bit parts (quant.QuantType's
    activations "two_part")."""
    return held_interleaved(code) and TWO_PART[code - INTERLEAVED_CODE]


# ---------------------------------------------------------------------------------------------- rows

def _decode_row(decode, block_size: int, block_bytes: int):
    @njit(cache=True)
    def decode_row(w, n, out):
        """Row n of W as float32 into out[:K]."""
        for b in range(w.shape[1] // block_bytes):
            decode(w, n, b, out, b * block_size)

    return decode_row


_decode_row_of = _cases([(_code(name), _decode_row(k.decode, quant.TYPES[name].block_size,
                                                    quant.TYPES[name].block_bytes)) for name, k in KERNELS.items()])


@njit(cache=True)
def decode_row(code, w, n, out):
    """Row n of W (GGML type `code`) as float32 into out[:K]: an embedding lookup reads no other row."""
    _decode_row_of(code, (w, n, out))


def _gather(gather):
    @njit
    def gather_row(w, base, r, group_bytes, row):
        gather(w, base, r, group_bytes, row)

    return gather_row


_gather_of = _cases([(_code(name, True), _gather(KERNELS[name].gather)) for name in INTERLEAVED_TYPES])


@njit(cache=True)
def gather_interleaved_row(code, w8, n, row):
    """Row n of an interleaved matrix (quant.interleave_rows; code: INTERLEAVED_CODE + its GGML type id) back in its
    file's layout, into row [row bytes] uint8 (an embedding lookup on a table held interleaved for the LM head)."""
    _gather_of(code, (w8.reshape(w8.size), n // INTERLEAVE * w8.shape[1], n % INTERLEAVE, w8.shape[1], row))


@njit(cache=True)
def file_row_bytes(code, K):
    """Bytes a row of K values takes in its file's layout, for a GGML type id (+ INTERLEAVED_CODE: interleaved)."""
    t = code % INTERLEAVED_CODE
    return K // TYPE_BLOCK_SIZE[t] * TYPE_BLOCK_BYTES[t]


@njit(cache=True)
def decode_any_row(code, w, n, out, scratch):
    """decode_row, also for a matrix held interleaved (held_interleaved: its row gathered into scratch
    [file_row_bytes(code, K)] uint8 first) or in panels (w [P, 16 row bytes]: held_in_panels)."""
    if held_in_panels(code):
        panel_row(w, n, out)
    elif held_interleaved(code):
        gather_interleaved_row(code, w, n, scratch)
        decode_row(code - INTERLEAVED_CODE, scratch.reshape(1, scratch.size), 0, out)
    else:
        decode_row(code, w, n, out)


@njit(cache=True)
def panel_row(w, n, out):
    """Row n of a float32 matrix held as panels (cpu.pack_panels' layout, as bytes [P, 16 * 4 K]) into out[:K]:
    value k of row 16 p + j is float (p K + k) 16 + j."""
    K, p, j = w.shape[1] // (4 * PANEL), n // PANEL, n % PANEL
    for k in range(K):
        out[k] = floats.load_f32(w, 4 * ((p * K + k) * PANEL + j))


_matvec_rows = _cases([(_code(name), KERNELS[name].matvec) for name in FLOAT_TYPES])


@njit(cache=True)
def matvec_rows(code, w, x, sums, out, col, n0, n1):
    """out[col + n] = W[n] . x for n0 <= n < n1, W of a float type `code` (F32, F16, BF16: the block types' products
    run interleaved, matmul_rows_interleaved)."""
    _matvec_rows(code, (w, x, sums, out, col, n0, n1))


@njit(fastmath=REASSOC, cache=True)
def matmul_rows(code, w, x, T, out, col, n0, n1):
    """out[t, col + n] = W[n] . x[t] for t < T, n0 <= n < n1 (n0 a multiple of 16), W of GGML type `code`: 16 rows
    at a time decoded into one float32 panel (cpu.pack_panels' layout), then cpu.py's register tile over every
    token, so the decoding is paid once per row whatever T is."""
    K = w.shape[1] // TYPE_BLOCK_BYTES[code] * TYPE_BLOCK_SIZE[code]
    panel = np.zeros(K * PANEL, np.float32)
    row = np.empty(K, np.float32)
    tile = np.empty((T, PANEL), np.float32)
    for p0 in range(n0, n1, PANEL):
        rows = min(PANEL, n1 - p0)
        for j in range(rows):
            decode_row(code, w, p0 + j, row)
            for k in range(K):
                panel[k * PANEL + j] = row[k]
        for j in range(rows, PANEL):  # past the last row: zeros, computed and not stored
            for k in range(K):
                panel[k * PANEL + j] = 0
        for t in range(0, T, TILE_T):
            tile_6x16(x, t, min(TILE_T, T - t), panel, 0, K, tile, 0)
        for t in range(T):
            for j in range(rows):
                out[t, col + p0 + j] = tile[t, j]


# ---------------------------------------------------------------------------------------------- from Python

def matmul_int8_interleaved(w8: np.ndarray, qtype: str, x: np.ndarray, rows: int | None = None) -> np.ndarray:
    """x W^T with x quantized to 8-bit blocks (in two parts for the types of activations "two_part"), W's first `rows`
    rows (default all 8 G) held as quant.interleave_rows(w, qtype), on the calling thread.
                                                 # [G, interleaved row bytes] uint8, [T, K] float32 -> [T, rows]"""
    if qtype not in INTERLEAVED_TYPES:
        raise QuantizationError(f"npllm interleaves the rows of {', '.join(INTERLEAVED_TYPES)} only, not {qtype}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, K = x.shape
    N, t = 8 * w8.shape[0] if rows is None else rows, quant.TYPES[qtype]
    if not 8 * w8.shape[0] - 8 < N <= 8 * w8.shape[0]:
        raise QuantizationError(f"{w8.shape[0]} interleaved groups hold {8 * w8.shape[0] - 7} to "
                                f"{8 * w8.shape[0]} rows, not {N}")
    if (w8.dtype != np.uint8 or w8.ndim != 2 or K % t.block_size
            or w8.shape[1] != K // t.block_size * t.interleaved_bytes):
        raise QuantizationError(f"interleaved {qtype} weights of shape {w8.shape} do not hold rows of {K} values")
    if not np.all(np.isfinite(x)):
        raise QuantizationError("cannot quantize activations that are not finite (inf or NaN)")
    q, d, s = np.empty((T, K), np.int8), np.empty((T, K // 32), np.float32), np.empty((T, K // 32), np.float32)
    s16 = np.empty((T, K // 16), np.int32)
    quantize_activations_q8_into(x, T, q, d, s, s16)
    if t.activations == "two_part":
        v, d_v, s_v, s16_v = np.empty((T, 2 * K), np.int8), np.empty_like(d), np.empty_like(s), np.empty_like(s16)
        two_part_activations_into(x, T, q, d, v, d_v, s_v, s16_v)
        q, d, s, s16 = v, d_v, s_v, s16_v
    out = np.empty((T, N), np.float32)
    matmul_rows_interleaved(_code(qtype, True), w8, q, d, s, s16, T, out, 0, 0, N)
    return out
