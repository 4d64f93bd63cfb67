"""What the numba.cuda kernels of kernels/cuda.py take and how they are launched: the launch geometry, the weight
storages (float32, float16, GGUF's Q8_0 blocks) and their reader, the forward kernels' argument records, and the
kernels that only move rows (no stage of the model). kernels/cuda.py imports all of it; its conventions hold here.

Device code here calls no device function of another module: numba's CUDA simulator swaps the `cuda` module of a
device function's own module for its duration, which is only safe for device functions that never name `cuda`
(weight_reader's) or for kernels whose whole body lives in their module.
"""

from __future__ import annotations

import functools
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
from numba import cuda

from ..errors import ConfigError


@dataclass(frozen=True)
class Geometry:
    """How kernels are launched. Every choice is correct; they differ in speed only.

    threads: threads per block of the row kernels (norm, matrix-vector, RoPE, attention), a power of two.
    lanes: threads sharing one weight row in the matrix-vector kernels: a warp (32) on hardware, so that a
        warp's loads are consecutive.
    tile: the matrix-matrix product's block tile (BM, BN, BK) and per-thread tile (TM, TN): each block computes a
        BM x BN tile of the output with (BM / TM) (BN / TN) threads, stepping through K in slices of BK.
    sampler_threads: threads of the one block that samples each row.
    max_blocks: most blocks of a launch (blocks loop over the remaining items).
    attention_blocks: most blocks of an attention launch (each has a row of score scratch, C + T floats).
    """

    threads: int = 256
    lanes: int = 32
    tile: tuple[int, int, int, int, int] = (64, 64, 16, 4, 4)
    sampler_threads: int = 1024
    max_blocks: int = 8192
    attention_blocks: int = 1024

    def __post_init__(self):
        BM, BN, BK, TM, TN = self.tile
        for n in (self.threads, self.lanes, self.sampler_threads, (BM // TM) * (BN // TN)):
            if n < 1 or n & (n - 1):
                raise ConfigError(f"block sizes must be powers of two, got {self}")
        if self.threads % self.lanes:
            raise ConfigError(f"threads {self.threads} must be a multiple of lanes {self.lanes}")
        if BM % TM or BN % TN:
            raise ConfigError(f"tile {self.tile}: BM must be a multiple of TM and BN of TN")

    @property
    def matmul_threads(self) -> int:
        BM, BN, _, TM, TN = self.tile
        return (BM // TM) * (BN // TN)

    def grid(self, items: int) -> int:
        return max(1, min(items, self.max_blocks))


HARDWARE = Geometry()
# The simulator runs each GPU thread as a Python thread: few threads and blocks keep tests fast; the loops are the
# same, only their trip counts change.
SIMULATOR = Geometry(threads=8, lanes=8, tile=(8, 8, 8, 2, 4), sampler_threads=8, max_blocks=2,
                     attention_blocks=2)


# ---------------------------------------------------------------------------------------------------------------
# Weight storage: float32, float16, or Q8_0 blocks
# ---------------------------------------------------------------------------------------------------------------

# GGUF's Q8_0 block, byte for byte: float16 scale d, then 32 int8 values q; value j of the block is d * q[j].
#     bytes 0-1: d (little-endian float16) | bytes 2-33: q[0] .. q[31]
# A Q8_0 matrix W [N, K] is held as blocks [N, K / 32] of this record type (the file's bytes, viewed), so the
# kernels read 34 bytes per 32 weights (1.06 bytes a weight) and widen each value in registers.
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
Q8_0_VALUES = 32


@functools.cache
def weight_reader(q8_0: bool):
    """A device function weight(w, n, k) = W[n, k] as float32: w[n, k] widened (float32 or float16 storage), or,
    with q8_0, from Q8_0 blocks w [N, K / 32]: d * q[k % 32] of block k // 32. Kernels built for Q8_0 (a flag of
    their factory, fixed at compile time) take every weight matrix, the embedding included, as blocks."""
    if q8_0:
        @cuda.jit(device=True)
        def weight(w, n, k):
            block = w[n, k // Q8_0_VALUES]
            return np.float32(block.d) * np.float32(block.qs[k % Q8_0_VALUES])
    else:
        @cuda.jit(device=True)
        def weight(w, n, k):
            return np.float32(w[n, k])

    return weight


@functools.cache
def gather_rows_kernel():
    """dst[i] = src[index[i]]: rows picked by index (model code's hidden[ids]).       # [R, D], [N] -> [N, D]"""

    @cuda.jit
    def kernel(src, index, dst):
        for i in range(cuda.blockIdx.x, dst.shape[0], cuda.gridDim.x):
            for d in range(cuda.threadIdx.x, dst.shape[1], cuda.blockDim.x):
                dst[i, d] = src[index[i], d]

    return kernel


@functools.cache
def compact_kernel(ndim: int):
    """dst = src, element by element: a strided 2-D or 3-D view made contiguous, so that it can be reshaped."""
    if ndim == 2:
        @cuda.jit
        def kernel(src, dst):
            for r in range(cuda.blockIdx.x, dst.shape[0], cuda.gridDim.x):
                for d in range(cuda.threadIdx.x, dst.shape[1], cuda.blockDim.x):
                    dst[r, d] = src[r, d]
    else:
        @cuda.jit
        def kernel(src, dst):
            for r in range(cuda.blockIdx.x, dst.shape[0] * dst.shape[1], cuda.gridDim.x):
                a, b = r // dst.shape[1], r % dst.shape[1]
                for d in range(cuda.threadIdx.x, dst.shape[2], cuda.blockDim.x):
                    dst[a, b, d] = src[a, b, d]

    return kernel


# The step kernels' arguments, grouped by meaning (numba.cuda passes a tuple of device arrays and numbers to a kernel
# as its members; models/cuda.py kernel_record makes the simulator do the same). A family's options are data here,
# never a compiled variant: a gain absent from a family is an empty axis (n = 0), a multiplier 1, a cap 0.
#     weights  tok_embeddings [V, D], stacked over layers norms [L, 2, n] (attention, ffn; n = D, or 0 for
#              block_norms "post"), wqkv [L, W, D], bqkv [L, W], wo [L, D, H Dh], w13 (see each kernel), w2 [L, D, F];
#              final_norm [D]; q_norm [L, nq], k_norm [L, nk] (nq = nk = Dh per head, H Dh and K Dh over the
#              projection, 0 without); post_norms [L, 2, n] (after attention, after the FFN; n = D for "sandwich" and
#              "post", else 0); experts (E = 0 for a dense model; w13, w2 then [L, 2, 0, D], [L, D, 0]): router
#              [L, E, D] float32, w13_exps [L, E, 2, Fe, D], w2_exps [L, E, D, Fe] (q8_0: matrices in blocks)
#     shape    eps (float32), n_heads, n_kv, head_dim (int32), scale (float32, config.score_scale), cap (float32,
#              attn_logit_softcap, 0 off), act (int32, ACTIVATIONS' code), embed (float32, embedding_multiplier),
#              residual (float32, residual_multiplier), windows [L] int32 (each layer's window), rope [L] int32
#              (each layer's row of the cos, sin tables: 0 full attention, 1 sliding layers' own base), experts_norm
#              (int32, 1: the chosen experts' weights renormalised to sum 1)
#     cache    the ring: k, v [L, B, C, K, Dh], positions [B, C] int32
#     work     buffers x, xn [T, D], qkv [T, W], att [T, H Dh], gate_up [T, 2F], h [T, F], scores [blocks, C + T],
#              o [T, D] (a block's output before its post-norm: zero between steps but that pair); experts: probs
#              [T, E], chosen [T, k] int32, routed [T, k] (their weights), he [T, k, Fe] (their hidden units)
StepWeights = namedtuple("StepWeights", ["tok_embeddings", "norms", "wqkv", "bqkv", "wo", "w13", "w2", "final_norm",
                                         "q_norm", "k_norm", "post_norms", "router", "w13_exps", "w2_exps"])
StepShape = namedtuple("StepShape", ["eps", "n_heads", "n_kv", "head_dim", "scale", "cap", "act", "embed",
                                     "residual", "windows", "rope", "experts_norm"])
StepCache = namedtuple("StepCache", ["k", "v", "positions"])
StepWork = namedtuple("StepWork", ["x", "xn", "qkv", "att", "gate_up", "h", "scores", "o", "probs", "chosen", "routed",
                                   "he"])


STEP_PARTS = {False: (1, 1), True: (2, 3)}  # steps of (normed, gated) in a layer: fused matvec products, tiled ones
