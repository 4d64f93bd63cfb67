"""Float32 vectors for Numba kernels: the one thing Numba cannot be asked for in plain Python.

A matrix product keeps a tile of partial sums in registers while it walks the shared axis. LLVM will not keep an
array of partial sums in registers across a loop, and it will not turn eight scalar sums into one vector sum, so
the tile is written with an explicit vector type:

    f32x8, f32x16       8 or 16 float32 lanes (one AVX or one AVX-512 register; LLVM splits them where the
                        machine's registers are narrower)
    vzero(), vzero16()  all lanes 0
    vload(a, i)         a.flat[i : i + 8]     (a: C-contiguous float32 array; no bounds check)
    vload16(a, i)       a.flat[i : i + 16]
    vstore(a, i, v)     a.flat[i : i + lanes] = v
    vfma(acc, x, w)     acc + x * w per lane, with ONE rounding (a fused multiply-add), x a scalar
    vfmav(acc, a, b)    acc + a * b per lane, a and b vectors
    vadd(a, b)          a + b per lane
    vsplat(x)           f32x8 with every lane x (a float32 scalar)
    vsum(v)             of 8 lanes: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)), always in that order

A KV cache may be stored in float16 (cache.py). Numba has no float16 type on the CPU, so such a cache reaches the
kernels as its bits, a uint16 array; these read and write either kind of cache array, always in float32 lanes:

    vload_kv(a, i)      a.flat[i : i + 8] as f32x8 (uint16: the float16 bits widened, exactly)
    load_kv(a, i)       a.flat[i] as a float32
    store_kv(a, i, x)   a.flat[i] = x (uint16: x rounded to the nearest float16, ties to even, as NumPy's astype)

Each lane of `acc` is a separate output, so a lane's sum is added strictly in the order the caller walks the shared
axis. That order, not the tile's shape nor the vector width, fixes every rounding: a product computed 1 token at a
time (decode) and 6 at a time (prefill) gives bit-identical results.

WIDE says whether the machine Numba compiles for has 16-lane (AVX-512) registers: the prefill tile uses f32x16
there. NUMBA_CPU_NAME / NUMBA_CPU_FEATURES (Numba's own settings for compiling for another machine) are obeyed.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from . import target

LANES = 8


WIDE = target.has("avx512f")


class F32xN(types.Type):
    def __init__(self, lanes: int):
        self.lanes = lanes
        super().__init__(name=f"f32x{lanes}")


f32x8, f32x16 = F32xN(8), F32xN(16)


def f32_vector(lanes: int) -> ir.VectorType:
    return ir.VectorType(ir.FloatType(), lanes)


@register_model(F32xN)
class _F32xNModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, f32_vector(fe_type.lanes))


def is_f32_c_array(ty) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == types.float32 and ty.layout == "C"


def lane_pointer(context, builder, array_type, array, index, lanes):
    """Address of array.flat[index], as a pointer to `lanes` floats."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [index]), f32_vector(lanes).as_pointer())


def _zero(vector_type):
    def codegen(context, builder, signature, args):
        return ir.Constant(f32_vector(vector_type.lanes), [0.0] * vector_type.lanes)

    return vector_type(), codegen


def _load(vector_type, array, index):
    if not (is_f32_c_array(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        pointer = lane_pointer(context, builder, signature.args[0], args[0], args[1], vector_type.lanes)
        return builder.load(pointer, align=4)

    return vector_type(array, index), codegen


@intrinsic
def vzero(typingctx):
    return _zero(f32x8)


@intrinsic
def vzero16(typingctx):
    return _zero(f32x16)


@intrinsic
def vload(typingctx, array, index):
    return _load(f32x8, array, index)


@intrinsic
def vload16(typingctx, array, index):
    return _load(f32x16, array, index)


@intrinsic
def vstore(typingctx, array, index, vector):
    if not (is_f32_c_array(array) and isinstance(index, types.Integer) and isinstance(vector, F32xN)):
        return None

    def codegen(context, builder, signature, args):
        pointer = lane_pointer(context, builder, signature.args[0], args[0], args[1], vector.lanes)
        builder.store(args[2], pointer, align=4)
        return context.get_dummy_value()

    return types.none(array, index, vector), codegen


def _fma(builder, a, b, acc, lanes):
    vec = f32_vector(lanes)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                         f"llvm.fma.v{lanes}f32")
    return builder.call(fma, [a, b, acc])


@intrinsic
def vfma(typingctx, acc, x, w):
    if not (isinstance(acc, F32xN) and w == acc and x == types.float32):
        return None

    def codegen(context, builder, signature, args):
        acc_value, x_value, w_value = args
        lanes = acc.lanes
        lane0 = builder.insert_element(ir.Constant(f32_vector(lanes), ir.Undefined), x_value,
                                       ir.Constant(ir.IntType(32), 0))
        xs = builder.shuffle_vector(lane0, ir.Constant(f32_vector(lanes), ir.Undefined),
                                    ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))
        return _fma(builder, xs, w_value, acc_value, lanes)

    return acc(acc, x, w), codegen


@intrinsic
def vfmav(typingctx, acc, a, b):
    if not (isinstance(acc, F32xN) and a == acc and b == acc):
        return None

    def codegen(context, builder, signature, args):
        return _fma(builder, args[1], args[2], args[0], acc.lanes)

    return acc(acc, a, b), codegen


@intrinsic
def vadd(typingctx, a, b):
    if not (isinstance(a, F32xN) and b == a):
        return None

    def codegen(context, builder, signature, args):
        return builder.fadd(args[0], args[1])

    return a(a, b), codegen


@intrinsic
def vsplat(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        undefined = ir.Constant(f32_vector(8), ir.Undefined)
        lane0 = builder.insert_element(undefined, args[0], ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(lane0, lane0, ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8))

    return f32x8(x), codegen


@intrinsic
def vsum(typingctx, v):
    if v != f32x8:
        return None

    def codegen(context, builder, signature, args):
        def halve(vec, n):  # lanes i + (i + n), i < n
            lanes = ir.VectorType(ir.IntType(32), n)
            lo = builder.shuffle_vector(vec, vec, ir.Constant(lanes, list(range(n))))
            hi = builder.shuffle_vector(vec, vec, ir.Constant(lanes, list(range(n, 2 * n))))
            return builder.fadd(lo, hi)

        pair = halve(halve(halve(args[0], 4), 2), 1)
        return builder.extract_element(pair, ir.Constant(ir.IntType(32), 0))

    return types.float32(v), codegen


@intrinsic
def vsum8(typingctx, v0, v1, v2, v3, v4, v5, v6, v7):
    """Lane k = vsum(vk): eight horizontal sums at once, each the same tree of additions as vsum (lanes i + i+4,
    then i + i+2, then 0 + 1), so the same bits, for 14 shuffles and 7 additions instead of 24 and 24."""
    if not all(v == f32x8 for v in (v0, v1, v2, v3, v4, v5, v6, v7)):
        return None

    def codegen(context, builder, signature, args):
        def level(a, b, lo, hi):  # shuffle(a, b, lo) + shuffle(a, b, hi): the next level of two vectors' trees
            take = ir.VectorType(ir.IntType(32), 8)
            return builder.fadd(builder.shuffle_vector(a, b, ir.Constant(take, lo)),
                                builder.shuffle_vector(a, b, ir.Constant(take, hi)))

        halves = ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])  # -> a0..a3 | b0..b3
        quarters = ([0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15])  # -> a0 a1 b0 b1 c0 c1 d0 d1
        eighths = ([0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15])  # -> a b c d e f g h
        s = [level(args[i], args[i + 1], *halves) for i in range(0, 8, 2)]
        t = [level(s[0], s[1], *quarters), level(s[2], s[3], *quarters)]
        return level(t[0], t[1], *eighths)

    return f32x8(v0, v1, v2, v3, v4, v5, v6, v7), codegen


# ------------------------------------------------------------------------------------ float32 or float16 KV arrays

def _kv_element(ty):
    """The LLVM type a KV array stores (float, or half for uint16 bits), or None for any other array."""
    if isinstance(ty, types.Array) and ty.layout == "C":
        if ty.dtype == types.float32:
            return ir.FloatType()
        if ty.dtype == types.uint16:
            return ir.HalfType()
    return None


def _kv_pointer(context, builder, array_type, array, index, element):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [index]), element.as_pointer())


@intrinsic
def vload_kv(typingctx, array, index):
    element = _kv_element(array)
    if element is None or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(element, LANES)
        pointer = _kv_pointer(context, builder, signature.args[0], args[0], args[1], vector)
        lanes = builder.load(pointer, align=4 if element == ir.FloatType() else 2)
        return lanes if element == ir.FloatType() else builder.fpext(lanes, f32_vector(LANES))

    return f32x8(array, index), codegen


@intrinsic
def load_kv(typingctx, array, index):
    element = _kv_element(array)
    if element is None or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = builder.load(_kv_pointer(context, builder, signature.args[0], args[0], args[1], element))
        return value if element == ir.FloatType() else builder.fpext(value, ir.FloatType())

    return types.float32(array, index), codegen


@intrinsic
def store_kv(typingctx, array, index, value):
    element = _kv_element(array)
    if element is None or not isinstance(index, types.Integer) or value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        value = args[2] if element == ir.FloatType() else builder.fptrunc(args[2], element)
        builder.store(value, _kv_pointer(context, builder, signature.args[0], args[0], args[1], element))
        return context.get_dummy_value()

    return types.none(array, index, value), codegen


@intrinsic
def prefetch(typingctx, array, index):
    """Ask the CPU to bring the cache line holding array.flat[index] into its caches (llvm.prefetch, a hint: no
    fault, no effect on results); array a C-contiguous KV array (float32, or uint16 bits of float16) or uint8
    bytes. Attention reads a head's keys at a stride of K heads x Dh values, a pattern the hardware prefetcher does
    not follow; a decode product reads faster from memory when each tile asks for its groups' next bytes itself
    (kernels.quant.intrinsics.ask_ahead)."""
    element = _kv_element(array)
    if isinstance(array, types.Array) and array.layout == "C" and array.dtype == types.uint8:
        element = ir.IntType(8)
    if element is None or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        pointer = _kv_pointer(context, builder, signature.args[0], args[0], args[1], ir.IntType(8))
        i32 = ir.IntType(32)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32]), "llvm.prefetch.p0")
        builder.call(function, [pointer, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(array, index), codegen
