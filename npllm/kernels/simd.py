"""Eight-lane float32 vectors for Numba kernels: the one thing Numba cannot be asked for in plain Python.

A matrix product keeps a tile of partial sums in registers while it walks the shared axis. LLVM will not keep an
array of partial sums in registers across a loop, and it will not turn eight scalar sums into one vector sum, so
the tile is written with an explicit vector type:

    f32x8            eight float32 lanes (one AVX register; two SSE registers where AVX is absent)
    vzero()          [0, 0, 0, 0, 0, 0, 0, 0]
    vload(a, i)      a.flat[i : i + 8]           (a: C-contiguous float32 array; no bounds check)
    vstore(a, i, v)  a.flat[i : i + 8] = v
    vfma(acc, x, w)  acc + x * w per lane, with ONE rounding (a fused multiply-add), x a scalar
    vfmav(acc, a, b) acc + a * b per lane, a and b vectors
    vadd(a, b)       a + b per lane
    vsum(v)          ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)), always in that order

Each lane of `acc` is a separate output, so a lane's sum is added strictly in the order the caller walks the shared
axis. That order, not the tile's shape, fixes every rounding: a product computed 1 token at a time (decode) and 6 at
a time (prefill) gives bit-identical results.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

LANES = 8
_VEC = ir.VectorType(ir.FloatType(), LANES)


class F32x8(types.Type):
    def __init__(self):
        super().__init__(name="f32x8")


f32x8 = F32x8()


@register_model(F32x8)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC)


def _is_f32_c_array(ty) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == types.float32 and ty.layout == "C"


def _lane_pointer(context, builder, array_type, array, index):
    """Address of array.flat[index], as a pointer to eight floats."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [index]), _VEC.as_pointer())


@intrinsic
def vzero(typingctx):
    def codegen(context, builder, signature, args):
        return ir.Constant(_VEC, [0.0] * LANES)

    return f32x8(), codegen


@intrinsic
def vload(typingctx, array, index):
    if not (_is_f32_c_array(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        return builder.load(_lane_pointer(context, builder, signature.args[0], args[0], args[1]), align=4)

    return f32x8(array, index), codegen


@intrinsic
def vstore(typingctx, array, index, vector):
    if not (_is_f32_c_array(array) and isinstance(index, types.Integer) and vector == f32x8):
        return None

    def codegen(context, builder, signature, args):
        builder.store(args[2], _lane_pointer(context, builder, signature.args[0], args[0], args[1]), align=4)
        return context.get_dummy_value()

    return types.none(array, index, vector), codegen


@intrinsic
def vfma(typingctx, acc, x, w):
    if not (acc == f32x8 and w == f32x8 and x == types.float32):
        return None

    def codegen(context, builder, signature, args):
        acc, x, w = args
        lane0 = builder.insert_element(ir.Constant(_VEC, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
        xs = builder.shuffle_vector(lane0, ir.Constant(_VEC, ir.Undefined),
                                    ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC, _VEC, _VEC]),
                                             "llvm.fma.v8f32")
        return builder.call(fma, [xs, w, acc])

    return f32x8(acc, x, w), codegen


@intrinsic
def vfmav(typingctx, acc, a, b):
    if not (acc == f32x8 and a == f32x8 and b == f32x8):
        return None

    def codegen(context, builder, signature, args):
        acc, a, b = args
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC, _VEC, _VEC]),
                                             "llvm.fma.v8f32")
        return builder.call(fma, [a, b, acc])

    return f32x8(acc, a, b), codegen


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
def vadd(typingctx, a, b):
    if not (a == f32x8 and b == f32x8):
        return None

    def codegen(context, builder, signature, args):
        return builder.fadd(args[0], args[1])

    return f32x8(a, b), codegen
