"""The byte-vector intrinsics every block type's kernels are built from (LLVM IR, through numba.extending.intrinsic),
and what the machine Numba compiles for offers them.

An interleaved group's block (quant.interleave_rows) keeps words of 32 bytes whose lane r (bytes 4r .. 4r + 3) holds
four values of row r. A word's integer dot with four int8 activations broadcast to every lane advances eight rows
at once: vpdpbusd where the machine has AVX-VNNI (unsigned bytes times signed ones, summed by four into int32
lanes), vpmaddubsw + vpmaddwd on AVX2, plain LLVM integer vectors elsewhere (the same sums, slower). A pair of groups
(16 rows) is one 512-bit word where the machine has a 512-bit vpdpbusd (PAIRED).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import target
from ..simd import f32_vector, f32x8, f32x16, prefetch

I8_IR, I16_IR, I32_IR = ir.IntType(8), ir.IntType(16), ir.IntType(32)


# ---------------------------------------------------------------------------------------------- the machine

AVX2 = target.has("avx2")  # what the machine Numba compiles for offers (kernels/target.py)
# a 256-bit vpdpbusd: AVX-VNNI, or AVX512-VNNI with AVX512-VL
VNNI = AVX2 and (target.has("avxvnni") or target.has("avx512vnni", "avx512vl"))
# PAIRED: the kernels walk two groups at a time as one 16-lane register (rows 8g .. 8g + 15), where the machine
# has a 512-bit vpdpbusd. It runs two per cycle here, as the 256-bit one does, so a pair costs the instructions of
# one group: ~1.7x the multiply-adds per second at 128 tokens (docs/quant.md). Elsewhere groups go one at a time.
PAIRED = VNNI and target.has("avx512vnni", "avx512bw")  # a 512-bit vpdpbusd
GFNI = AVX2 and target.has("gfni")  # Q5_K's fifth bit and Q6_K's top two in one instruction (high_bits_ir)


def variant() -> str:
    """The integer-dot path the block kernels were built for on this machine (chosen from the CPU's features at
    import, NUMBA_CPU_NAME / NUMBA_CPU_FEATURES included), in words for `npllm bench`."""
    if not AVX2:
        return "portable LLVM vectors (no AVX2)"
    dots = "512-bit vpdpbusd, two groups a step" if PAIRED else "256-bit vpdpbusd" if VNNI else "AVX2 vpmaddubsw"
    return dots + (", GFNI high bits" if GFNI else "")


Q8_0_BIAS = 0 if AVX2 and not VNNI else 128  # a group's Q8_0 bytes go back to q on AVX2 without VNNI: no bias
ROWS_AT_ONCE = 16 if PAIRED else 8  # the rows an interleaved kernel walks together: a thread's range is a multiple
CHAINS = 2  # independent integer sums per dot, so that vpdpbusd's 5-cycle latency is not a chain of eight

# A one-token product streams each group's bytes from memory once, and spends on every line it reads as long as the
# line takes to arrive: the hardware prefetcher keeps too few lines in flight for that (and starts over at every
# 4 KiB page), so a walk left to it pays its unpacking and its memory time one after the other. Each block step of a
# tile therefore asks for the bytes AHEAD_BYTES further on in each of its groups (ask_ahead), a few lines at a time
# between the products, not in bursts (a burst of a whole group's lines before each group: 1.2x faster from memory,
# 0.8x in cache, where the burst held the fill buffers the products' own loads wait on). docs/quant.md, "Decode
# walks ask for their next block".
AHEAD_BYTES = 1536


@njit(inline="always")
def ask_ahead(w, at, span, groups, t):
    """Ask for the cache lines of bytes at + AHEAD_BYTES .. + span of each of a walk's `groups` groups (w [G, group
    bytes] uint8; w.flat[at:] the first group's current block, the next group's one row further), in the tile of a
    call's first tokens (t = 0) only: the tiles of its later tokens find the group in the cache. A hint: no fault
    past w's end, no effect on any value."""
    if t != 0:
        return
    for j in range(groups):
        start = at + j * w.shape[1] + AHEAD_BYTES
        for i in range(start, start + span, 64):
            prefetch(w, i)


# ---------------------------------------------------------------------------------------------- scalars

def _is_byte_c_array(ty) -> bool:
    return isinstance(ty, types.Array) and ty.dtype in (types.uint8, types.int8) and ty.layout == "C"


def idot_args_ok(w, locators, x, ix) -> bool:
    return (_is_byte_c_array(w) and _is_byte_c_array(x) and isinstance(ix, types.Integer)
            and all(isinstance(i, types.Integer) for i in locators))


def byte_reader(result, load):
    """An intrinsic f(array, index) -> `result` (a Numba type) over a C-contiguous byte array: load(builder, at)
    builds the value from `at`, the i8 pointer to array.flat[index]."""

    def typer(typingctx, array, index):
        if not (_is_byte_c_array(array) and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            return load(builder, builder.gep(data, [args[1]]))

        return result(array, index), codegen

    return intrinsic(typer)


def half_at(builder, at):
    return builder.fpext(builder.load(builder.bitcast(at, ir.HalfType().as_pointer()), align=1), ir.FloatType())


# load_half(array, index): the float16 at bytes array.flat[index : index + 2], widened to float32 (one vcvtph2ps
# where the CPU has F16C)
load_half = byte_reader(types.float32, half_at)


@njit(inline="always")
def as_int8(byte):
    v = np.int32(byte)
    return v - ((v >> 7) << 8)


# ---------------------------------------------------------------------------------------------- LLVM helpers

def ivec(t, lanes):
    return ir.VectorType(t, lanes)


def llvm_intrinsic(builder, name, result, arguments):
    """An LLVM intrinsic function (x86's, or a generic one such as llvm.abs) declared in the module being built."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, arguments), name)


def _dot_avx2(builder, unsigned, signed, vnni: bool):
    """<8 x i32> partial sums of unsigned (<32 x i8>, 0..255) times signed (<32 x i8>): vpmaddubsw, vpmaddwd; or one
    vpdpbusd where the CPU has VNNI (Q8_0 and Q4_0 one-token rows ~5% faster on a Xeon with AVX-VNNI). The same
    sums for every input here: vpmaddubsw saturates a pair's sum to int16, but the unsigned factors are at most 128
    (|w| of a signed weight) or 63, so a pair stays within 2 * 128 * 127."""
    if vnni:  # declared with <8 x i32> operands, the form every LLVM since 10 reads (LLVM 22 upgrades it to bytes)
        i32x8 = ivec(I32_IR, 8)
        function = llvm_intrinsic(builder, "llvm.x86.avx512.vpdpbusd.256", i32x8, [i32x8] * 3)
        return builder.call(function, [ir.Constant(i32x8, [0] * 8), builder.bitcast(unsigned, i32x8),
                                       builder.bitcast(signed, i32x8)])
    pmaddubsw = llvm_intrinsic(builder, "llvm.x86.avx2.pmadd.ub.sw", ivec(I16_IR, 16), [ivec(I8_IR, 32)] * 2)
    pairs16 = builder.call(pmaddubsw, [unsigned, signed])
    return builder.call(llvm_intrinsic(builder, "llvm.x86.avx2.pmadd.wd", ivec(I32_IR, 8), [ivec(I16_IR, 16)] * 2),
                        [pairs16, ir.Constant(ivec(I16_IR, 16), [1] * 16)])


def _dot_generic(builder, a, b, a_signed):
    """The same sums from plain LLVM integer vectors (a signed or unsigned, b signed): lane i sums the products of
    bytes 4i .. 4i + 3, as vpmaddubsw then vpmaddwd group them."""
    count = a.type.count  # 32 bytes, or 64 for a pair of interleaved groups
    wide = ivec(I32_IR, count)
    a32 = builder.sext(a, wide) if a_signed else builder.zext(a, wide)
    products = builder.mul(a32, builder.sext(b, wide))
    total = None
    for k in range(4):
        part = builder.shuffle_vector(products, products, ir.Constant(ivec(I32_IR, count // 4),
                                                                      list(range(k, count, 4))))
        total = part if total is None else builder.add(total, part)
    return total


def _dot(builder, w, x, w_signed: bool, avx2: bool, vnni: bool):
    """<8 x i32>: lane i = sum of w[4i + k] x[4i + k], k < 4, for <32 x i8> w (signed, |w| <= 128, or unsigned <= 63)
    and x (|x| <= 127)."""
    if not avx2:
        return _dot_generic(builder, w, x, w_signed)
    if not w_signed:
        return _dot_avx2(builder, w, x, vnni)
    # |w| times x with w's sign moved onto it: the unsigned factor is |w| <= 128
    absolute = llvm_intrinsic(builder, "llvm.abs.v32i8", ivec(I8_IR, 32), [ivec(I8_IR, 32), ir.IntType(1)])
    magnitude = builder.call(absolute, [w, ir.Constant(ir.IntType(1), 0)])
    psign = llvm_intrinsic(builder, "llvm.x86.avx2.psign.b", ivec(I8_IR, 32), [ivec(I8_IR, 32)] * 2)
    signed = builder.call(psign, [x, w])
    return _dot_avx2(builder, magnitude, signed, vnni)


def _load_bytes(builder, context, array_type, array, index, count):
    data = context.make_array(array_type)(context, builder, array).data
    pointer = builder.bitcast(builder.gep(data, [index]), ivec(I8_IR, count).as_pointer())
    return builder.load(pointer, align=1)


def field_of(builder, bytes_, shift, mask):
    """(bytes >> shift) & mask per byte, shift a run-time integer with mask << shift < 256 (every field here: a
    nibble at 0 or 4, two bits at 0..6, one bit at 0..7). The shift is taken on 16-bit lanes (x86 has no byte
    shift; LLVM would build a per-shift byte mask for one): the bits it brings down from a lane's high byte land at
    8 - shift and up, above the mask."""
    count = bytes_.type.count
    words = builder.bitcast(bytes_, ivec(I16_IR, count // 2))
    shift16 = builder.trunc(shift, I16_IR) if shift.type.width > 16 else builder.zext(shift, I16_IR)
    lane = builder.insert_element(ir.Constant(ivec(I16_IR, count // 2), ir.Undefined), shift16, ir.Constant(I32_IR, 0))
    shifts = builder.shuffle_vector(lane, lane, ir.Constant(ivec(I32_IR, count // 2), [0] * (count // 2)))
    shifted = builder.bitcast(builder.lshr(words, shifts), ivec(I8_IR, count))
    return builder.and_(shifted, ir.Constant(ivec(I8_IR, count), [mask] * count))


def _at(builder, base, stride, group: int, delta: int):
    """base + group * stride + delta, as an i64 (the byte index of a field of group `group` of a pair)."""
    i64 = ir.IntType(64)
    base = builder.sext(base, i64) if base.type.width < 64 else base
    if group:
        base = builder.add(base, builder.sext(stride, i64) if stride.type.width < 64 else stride)
    return builder.add(base, ir.Constant(i64, delta))


def group_bytes_of(builder, context, array_type, w, iw, stride, groups: int, delta: int, count: int = 32):
    """<groups * count x i8>: the count bytes at w.flat[iw + j stride + delta:] of each group j < groups, side by
    side (one group's word, or a pair's as one 512-bit word)."""
    parts = [_load_bytes(builder, context, array_type, w, _at(builder, iw, stride, j, delta), count)
             for j in range(groups)]
    if groups == 1:
        return parts[0]
    return builder.shuffle_vector(parts[0], parts[1], ir.Constant(ivec(I32_IR, 2 * count), list(range(2 * count))))


def offset_of(builder, value, add):
    return builder.add(value, ir.Constant(value.type, add))


def splat(builder, value, lanes: int):
    """<lanes x T> of a value of type T."""
    vector = ir.VectorType(value.type, lanes)
    lane = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(I32_IR, 0))
    everywhere = ir.Constant(ivec(I32_IR, lanes), [0] * lanes)
    return builder.shuffle_vector(lane, ir.Constant(vector, ir.Undefined), everywhere)


def splat32(builder, value, lanes: int):
    """<lanes x i32> of an i32 value."""
    return splat(builder, value, lanes)


def broadcast4(builder, context, array_type, array, index, lanes: int):
    """<4 lanes x i8>: the four bytes at array.flat[index:] repeated in each of the 32-bit lanes."""
    word = builder.bitcast(_load_bytes(builder, context, array_type, array, index, 4), I32_IR)
    return builder.bitcast(splat32(builder, word, lanes), ivec(I8_IR, 4 * lanes))


def _dot_lanes(builder, acc, w, x, w_signed: bool, avx2: bool, vnni: bool):
    """acc + (lane i: the sum of w[4i + k] x[4i + k], k < 4), for 8 or 16 lanes: one vpdpbusd where the machine
    has it and w is unsigned, vpmaddubsw + vpmaddwd on AVX2, plain LLVM integer vectors otherwise."""
    lanes = acc.type.count
    if not avx2:
        return builder.add(acc, _dot_generic(builder, w, x, w_signed))
    if vnni and not w_signed:
        vector = ivec(I32_IR, lanes)
        function = llvm_intrinsic(builder, f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", vector, [vector] * 3)
        return builder.call(function, [acc, builder.bitcast(w, vector), builder.bitcast(x, vector)])
    return builder.add(acc, _dot(builder, w, x, w_signed, avx2, vnni))  # 8 lanes: no 16-lane code without VNNI


def _run_length(most: int) -> int:
    """How many words' vpmaddubsw outputs may be added in int16 before one vpmaddwd widens them: a pair's sum is at
    most 2 * most * 127 (unsigned values <= most, |x| <= 127), and the run's sum must stay within 32767."""
    return max(1, min(8, 32767 // (2 * most * 127)))


def _runs_of_pairs(builder, words, xs, most: int):
    """<8 x i32> partial dots on AVX2 without VNNI, a run of words at a time: vpmaddubsw per word, the int16 pairs
    of a run added (exact: _run_length), one vpmaddwd per run. vpmaddubsw and vpmaddwd both take the multiply
    ports; a widening per word (Q4's nibbles: 8 words, 8 vpmaddwd -> 1) left those ports half the work."""
    pmaddubsw = llvm_intrinsic(builder, "llvm.x86.avx2.pmadd.ub.sw", ivec(I16_IR, 16), [ivec(I8_IR, 32)] * 2)
    pmaddwd = llvm_intrinsic(builder, "llvm.x86.avx2.pmadd.wd", ivec(I32_IR, 8), [ivec(I16_IR, 16)] * 2)
    ones, length, dots = ir.Constant(ivec(I16_IR, 16), [1] * 16), _run_length(most), []
    for k0 in range(0, len(words), length):
        parts = [builder.call(pmaddubsw, [word, x]) for word, x in zip(words[k0:k0 + length], xs[k0:k0 + length])]
        while len(parts) > 1:  # a balanced tree: 3 adds deep for 8 words, not 7 (a one-token walk waits on it)
            parts = [builder.add(a, b) for a, b in zip(parts[::2], parts[1::2])] + parts[len(parts) // 2 * 2:]
        dots.append(builder.call(pmaddwd, [parts[0], ones]))
    return dots


def chained_dots(builder, start, words, xs, w_signed: bool, avx2: bool, vnni: bool, most: int = 255):
    """start + the dots of words[k] with xs[k], in CHAINS independent sums added at the end (the same integer).
    most: the largest unsigned value in the words (on AVX2 without VNNI the products are summed in int16 runs)."""
    zero = ir.Constant(start.type, [0] * start.type.count)
    chains = [start] + [zero] * (CHAINS - 1)
    if avx2 and not vnni and not w_signed and start.type.count == 8:
        for k, dot in enumerate(_runs_of_pairs(builder, words, xs, most)):
            chains[k % CHAINS] = builder.add(chains[k % CHAINS], dot)
    else:
        for k, (word, x) in enumerate(zip(words, xs)):
            chains[k % CHAINS] = _dot_lanes(builder, chains[k % CHAINS], word, x, w_signed, avx2, vnni)
    total = chains[0]
    for chain in chains[1:]:
        total = builder.add(total, chain)
    return total

def _field_const(builder, bytes_, shift: int, mask: int):
    """(bytes >> shift) & mask per byte, shift a constant."""
    count = bytes_.type.count
    if shift:
        bytes_ = builder.lshr(bytes_, ir.Constant(ivec(I8_IR, count), [shift] * count))
    return builder.and_(bytes_, ir.Constant(ivec(I8_IR, count), [mask] * count))


def high_bits_ir(builder, qh, shift, count: int, gfni: bool, to: int = 4):
    """((qh >> shift) & (2^count - 1)) << to per byte, shift a run-time integer (Q5_K's fifth bit: count 1; Q6_K's
    top two: count 2; Q3_K's third bit: count 1, to 2): one GFNI affine byte op where the machine has it, else a
    shift, a mask and a shift. GFNI's output bit j of a byte is the parity of (byte 7 - j of the qword matrix) AND
    the input byte, so the matrix that takes input bit shift + c to output bit to + c holds 1 << (shift + c) in
    byte 7 - to - c of each qword."""
    lanes = qh.type.count
    if not gfni:
        return builder.shl(field_of(builder, qh, shift, 2 ** count - 1), ir.Constant(ivec(I8_IR, lanes), [to] * lanes))
    i64 = ir.IntType(64)
    shift = builder.sext(shift, i64) if shift.type.width < 64 else shift
    row = ir.Constant(i64, 0)
    for c in range(count):
        bit = builder.shl(ir.Constant(i64, 1), builder.add(shift, ir.Constant(i64, c + 8 * (7 - to - c))))
        row = builder.or_(row, bit)
    matrix = builder.bitcast(splat(builder, row, lanes // 8), ivec(I8_IR, lanes))
    function = llvm_intrinsic(builder, f"llvm.x86.vgf2p8affineqb.{8 * lanes}", ivec(I8_IR, lanes),
                    [ivec(I8_IR, lanes), ivec(I8_IR, lanes), I8_IR])
    return builder.call(function, [qh, matrix, ir.Constant(I8_IR, 0)])



F32XN_IR = {1: f32x8, 2: f32x16}  # the float vector of one group or a pair


def _scales(kind: str, groups: int):
    """load(w, i, stride) -> f32x8 (f32x16 for a pair) of eight rows' scales at bytes w.flat[i:] (and a pair's
    second group's at i + stride): "halves" eight float16, "floats" eight float32 (store_floats'), "bytes" eight
    unsigned bytes (Q4_K's 6-bit scales and mins), "int8s" eight signed ones (Q6_K's and Q3_K's scales),
    "low_nibbles" / "high_nibbles" the low or high nibbles of eight bytes (Q2_K's scales and mins)."""

    def typer(typingctx, array, index, stride):
        if not (_is_byte_c_array(array) and isinstance(index, types.Integer) and isinstance(stride, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            count = {"halves": 16, "floats": 32}.get(kind, 8)
            raw = group_bytes_of(builder, context, signature.args[0], args[0], args[1], args[2], groups, 0, count)
            if kind == "floats":
                return builder.bitcast(raw, f32_vector(8 * groups))
            if kind == "halves":
                return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), 8 * groups)),
                                     f32_vector(8 * groups))
            if kind.endswith("nibbles"):
                raw = _field_const(builder, raw, 4 if kind == "high_nibbles" else 0, 15)
            return (builder.sitofp if kind == "int8s" else builder.uitofp)(raw, f32_vector(8 * groups))

        return F32XN_IR[groups](array, index, stride), codegen


    return intrinsic(typer)


_SCALE_KINDS = ("halves", "bytes", "int8s", "low_nibbles", "high_nibbles", "floats")
_LOADERS = {groups: tuple(_scales(kind, groups) for kind in _SCALE_KINDS) for groups in (1, 2)}


def scale_loaders(groups: int):
    """(halves, bytes, int8s, low_nibbles, high_nibbles, floats): the scale loaders of one group (groups 1) or a pair
    (2) (see _scales)."""
    return _LOADERS[groups]


def machine(groups: int) -> tuple[bool, bool]:
    """(avx2, vnni): the instructions a walk of one group (groups 1) or a pair (2) is compiled with: the machine's
    for one group; for a pair, its 512-bit vpdpbusd where it has one (PAIRED), else plain LLVM."""
    return (AVX2, VNNI) if groups == 1 else (PAIRED, PAIRED)


def byte_table(builder, indices, table: list[int], shuffle: bool):
    """<n x i8>: table[index] for each byte of indices (<n x i8>, each 0..15): with `shuffle` (AVX2 for 32 bytes,
    AVX512-BW for 64) one vpshufb, the 16-entry table in each 128-bit lane; else a select per entry (plain LLVM)."""
    count = indices.type.count
    lookup = ir.Constant(ivec(I8_IR, count), [table[i % 16] for i in range(count)])
    name = {32: "llvm.x86.avx2.pshuf.b", 64: "llvm.x86.avx512.pshuf.b.512"}[count]
    if shuffle:
        shuffle_bytes = llvm_intrinsic(builder, name, ivec(I8_IR, count), [ivec(I8_IR, count)] * 2)
        return builder.call(shuffle_bytes, [lookup, indices])
    out = ir.Constant(ivec(I8_IR, count), [table[0]] * count)
    for i in range(1, 16):
        hit = builder.icmp_unsigned("==", indices, ir.Constant(ivec(I8_IR, count), [i] * count))
        out = builder.select(hit, ir.Constant(ivec(I8_IR, count), [table[i]] * count), out)
    return out


def interleaved_idot(words, groups: int, avx2: bool, vnni: bool, most: int, stored_plus_128: bool = False):
    """idot(w, iw, stride, x, ix, start) -> f32x8 (f32x16 for a pair): lane r = start + the exact integer dot of
    row r's 32 unsigned values in the interleaved block at w.flat[iw:] (a pair's second group at iw + stride) with
    the int8 activations x.flat[ix : ix + 32]. A start of -bias times the activations' sum makes it the dot of the
    values minus bias.

    words(builder, context, array_type, w, iw, stride, groups, gfni) -> the eight <32 groups x i8> words (word k:
    four unsigned values of each row, meeting x[4k .. 4k+3]; or four: a run of 16 values); most: the largest of
    those values. stored_plus_128: the values are signed ones stored + 128 (Q8_0's, IQ4's levels); on AVX2 without
    VNNI they go back to signed and take the sign trick (vpmaddubsw would saturate on 255 x 127), the caller's bias
    then 0."""
    flip_back = stored_plus_128 and avx2 and not vnni
    width = 32 * groups
    gfni = avx2 and GFNI  # avx2 is only set for a pair where the machine has AVX-512 (machine(2))

    def typer(typingctx, w, iw, stride, x, ix, start):
        if not (idot_args_ok(w, (iw, stride), x, ix) and start in (types.int32, types.int64)):
            return None

        def codegen(context, builder, signature, args):
            ws = words(builder, context, signature.args[0], args[0], args[1], args[2], groups, gfni)
            if flip_back:  # the signed values themselves
                ws = [builder.xor(u, ir.Constant(ivec(I8_IR, width), [128] * width)) for u in ws]
            start = builder.trunc(args[5], I32_IR) if args[5].type.width > 32 else args[5]
            xs = [broadcast4(builder, context, signature.args[3], args[3], offset_of(builder, args[4], 4 * k),
                              8 * groups) for k in range(len(ws))]
            acc = chained_dots(builder, splat32(builder, start, 8 * groups), ws, xs, flip_back, avx2, vnni, most)
            return builder.sitofp(acc, f32_vector(8 * groups))

        return F32XN_IR[groups](w, iw, stride, x, ix, start), codegen

    return intrinsic(typer)


def nibble_words(builder, context, array_type, w, iw, stride, groups: int, at: int = 0):
    """The eight words of a 32-value block's 16 bytes of nibbles per row (four packed words at w.flat[iw + at:]):
    the low nibbles of the four (values 0..15 of each row), then the high ones (values 16..31)."""
    packed = [group_bytes_of(builder, context, array_type, w, iw, stride, groups, at + 32 * m) for m in range(4)]
    return [_field_const(builder, p, 0, 15) for p in packed] + [_field_const(builder, p, 4, 15) for p in packed]


@njit(inline="always")
def gather_words(w, at, r, words, row, to):
    """row[to + 4k + i] = w.flat[at + 32k + 4r + i], k < words, i < 4: lane r's bytes of a run of interleaved words."""
    for k in range(words):
        for i in range(4):
            row[to + 4 * k + i] = w[at + 32 * k + 4 * r + i]


@intrinsic
def store_floats(typingctx, array, index, vector):
    """array.flat[index : index + 32] = the bytes of an f32x8 (a byte array: an expanded group's scales, which the
    "floats" scale loader reads back)."""
    if not (_is_byte_c_array(array) and isinstance(index, types.Integer) and vector == f32x8):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        builder.store(args[2], builder.bitcast(builder.gep(data, [args[1]]), f32_vector(8).as_pointer()), align=1)
        return context.get_dummy_value()

    return types.none(array, index, vector), codegen


def field_unpacker(words: int, bits: int, high_bits: int = 0, table: list[int] | None = None):
    """unpack(w, iql, ql_shift, iqh, qh_shift, e, ie): e.flat[ie + 32k : ie + 32k + 32] = the values of word k < words
    of one group, q = (ql >> ql_shift) & (2^bits - 1) | ((qh >> qh_shift) & (2^high_bits - 1)) << bits per byte from
    the words at w.flat[iql + 32k:] and w.flat[iqh + 32k:] (no qh where high_bits = 0), then table[q] where given
    (IQ4's levels): a K-quant's or IQ4's packed values as plain bytes, what its tile's dot unpacks (expanded.py)."""
    gfni, shuffle = AVX2 and GFNI, AVX2

    def typer(typingctx, w, iql, ql_shift, iqh, qh_shift, e, ie):
        if not (idot_args_ok(w, (iql, ql_shift, iqh, qh_shift), e, ie)):
            return None

        def codegen(context, builder, signature, args):
            w_type, w, iql, ql_shift, iqh, qh_shift, e, ie = signature.args[0], *args
            for k in range(words):
                q = field_of(builder, group_bytes_of(builder, context, w_type, w, iql, iql, 1, 32 * k), ql_shift,
                           2 ** bits - 1)
                if high_bits:
                    qh = group_bytes_of(builder, context, w_type, w, iqh, iqh, 1, 32 * k)
                    q = builder.or_(q, high_bits_ir(builder, qh, qh_shift, high_bits, gfni, to=bits))
                if table is not None:
                    q = byte_table(builder, q, table, shuffle)
                data = context.make_array(signature.args[5])(context, builder, e).data
                at = builder.gep(data, [_at(builder, ie, ie, 0, 32 * k)])
                builder.store(q, builder.bitcast(at, ivec(I8_IR, 32).as_pointer()), align=1)
            return context.get_dummy_value()

        return types.none(w, iql, ql_shift, iqh, qh_shift, e, ie), codegen

    return intrinsic(typer)
