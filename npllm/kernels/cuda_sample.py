"""numba.cuda sampling: one token id per row drawn on the device, as sampling.sample_with draws it, so that only
the chosen ids travel back to the host (kernels/cuda.py's conventions: block-strided rows, shared-memory
reductions, no warp shuffles)."""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from .cuda import NEG_INF, block_best, block_sum

ONE_BITS = 0x3F800000  # the bit pattern of float32 1.0; 0 .. ONE_BITS are the bits of the floats in [0, 1], in order


@cuda.jit(device=True)
def mass_from(probs, b, v, red, redi):
    """(count, sum) of the probabilities p[b, i] >= v."""
    count = 0
    mass = np.float32(0)
    for i in range(cuda.threadIdx.x, probs.shape[1], cuda.blockDim.x):
        p = probs[b, i]
        if p >= v:
            count += 1
            mass += p
    return block_sum(count, redi), block_sum(mass, red)


@cuda.jit(device=True)
def largest_value(probs, b, need, by_mass, red, redi, bits):
    """The largest v in [0, 1] with count(p >= v) >= need (or, by_mass, sum(p >= v) >= need): a bisection over
    the bit patterns of float32, which order like the floats they encode. With v one of the p, it is exact.
    bits: a local int32 [1] array, read as float32 through a view."""
    as_float = bits.view(np.float32)
    lo, hi = 0, ONE_BITS + 1  # v = 0 always satisfies the condition, v just above 1 never does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        bits[0] = mid
        count, mass = mass_from(probs, b, as_float[0], red, redi)
        if (mass >= need) if by_mass else (count >= need):
            lo = mid
        else:
            hi = mid
    bits[0] = lo
    return as_float[0]


@cuda.jit(device=True)
def exclusive_scan(values, n):
    """values[j] = values[0] + ... + values[j-1] for j < n, and values[n] = the total (one thread does it: n is the
    number of threads, small next to the work around it)."""
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        run = values[0] - values[0]  # a zero of the array's type
        for j in range(n):
            here = values[j]
            values[j] = run
            run += here
        values[n] = run
    cuda.syncthreads()


@cuda.jit(device=True)
def inverse_cdf(probs, b, floor, u, red, redi):
    """Among the kept tokens p >= floor taken by ascending id, the first whose running mass exceeds u times their
    total (sampling.py's draw). Each thread walks a contiguous chunk of ids; a block scan gives every chunk the
    mass before it. red, redi: shared [threads + 1]."""
    tid, threads = cuda.threadIdx.x, cuda.blockDim.x
    V = probs.shape[1]
    chunk = (V + threads - 1) // threads
    lo = tid * chunk if tid * chunk < V else V
    hi = lo + chunk if lo + chunk < V else V
    mass = np.float32(0)
    for i in range(lo, hi):
        if probs[b, i] >= floor:
            mass += probs[b, i]
    red[tid] = mass
    exclusive_scan(red, threads)
    target = u * red[threads]
    run = red[tid]
    cuda.syncthreads()
    first, last = V, -1
    for i in range(lo, hi):
        p = probs[b, i]
        if p >= floor and p > 0:
            run += p
            last = i
            if run > target and first == V:
                first = i
    first = block_best(first, redi, False)
    last = block_best(last, redi, True)
    return first if first < V else last  # rounding can leave u * total at the very end: the last kept token


@cuda.jit(device=True)
def sample_rows(logits, params, probs, ids, red, redi, block, nblocks):
    """One token id per row, drawn as sampling.sample_with draws it with temperature, top-k, top-p and min-p.
                                                                                       # [B, V], [B, 5] -> [B] int32

    params[b] = (temperature, top_k, top_p, min_p, u), u uniform in [0, 1) drawn on the host (the row's one
    rng.random()). temperature 0: the first index of the largest logit (np.argmax). Otherwise, with
    p_i = exp((l_i - max l) / temperature) (so max p = 1), each filter keeps the tokens at or above a floor, ties
    at the floor kept whole:
        top_k  the k-th largest p
        top_p  the largest v with sum(p_j >= v) >= top_p * (the mass top_k kept)
        min_p  min_p (= min_p * max p)
    and the id is the inverse CDF at u over the kept tokens by ascending id. No sort: a floor is found by
    bisection on the probability value (largest_value). probs [B, V]: scratch. Shared red, redi: [threads + 1].
    """
    tid, threads = cuda.threadIdx.x, cuda.blockDim.x
    V = logits.shape[1]
    bits = cuda.local.array(1, np.int32)
    for b in range(block, logits.shape[0], nblocks):
        temperature, top_k, top_p, min_p, u = params[b, 0], int(params[b, 1]), params[b, 2], params[b, 3], \
            params[b, 4]
        top = NEG_INF
        for i in range(tid, V, threads):
            if logits[b, i] > top:
                top = logits[b, i]
        top = block_best(top, red, True)
        if temperature == 0:
            first = V
            for i in range(tid, V, threads):
                if logits[b, i] == top and i < first:
                    first = i
            first = block_best(first, redi, False)
            if tid == 0:
                ids[b] = first
            continue
        for i in range(tid, V, threads):
            probs[b, i] = math.exp((logits[b, i] - top) / temperature)
        cuda.syncthreads()
        floor = np.float32(0)
        if 0 < top_k < V:
            floor = largest_value(probs, b, top_k, False, red, redi, bits)
        if top_p < 1:
            target = top_p * mass_from(probs, b, floor, red, redi)[1]
            floor = largest_value(probs, b, target, True, red, redi, bits)  # never below the top-k floor
        if min_p > floor:
            floor = min_p
        chosen = inverse_cdf(probs, b, floor, u, red, redi)
        if tid == 0:
            ids[b] = chosen


@functools.cache
def sample_kernel(threads: int):
    size = threads + 1

    @cuda.jit
    def kernel(logits, params, probs, ids):
        red = cuda.shared.array(size, np.float32)
        redi = cuda.shared.array(size, np.int32)
        sample_rows(logits, params, probs, ids, red, redi, cuda.blockIdx.x, cuda.gridDim.x)

    return kernel


