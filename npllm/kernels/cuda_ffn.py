"""The feed-forward's gate functions and the routed (mixture-of-experts) feed-forward as numba.cuda device functions,
for kernels/cuda.py's forward kernel.

Device code here never names `cuda` (no thread index, no barrier): the caller passes each thread's index in the
grid and the grid's size, and each function gives every thread whole work items. numba's CUDA simulator swaps the
`cuda` module of a device function's own module while it runs, which races between threads when the kernel lives
in another module; functions that never name it are safe (see kernels/cuda_layout.py).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from .cuda_layout import weight_reader


@cuda.jit(device=True)
def silu(v):
    """SiLU: v / (1 + e^-v)."""
    return v / (np.float32(1) + math.exp(-v))


GELU_C = np.float32(np.sqrt(2.0 / np.pi))
ACTIVATIONS = ("silu", "gelu_tanh")  # ModelConfig.ffn_activation by its code in StepShape.act


@cuda.jit(device=True)
def gelu_tanh(v):
    """GELU, tanh approximation (Gemma): v/2 (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))."""
    return np.float32(0.5) * v * (np.float32(1) + math.tanh(GELU_C * (v + np.float32(0.044715) * v * v * v)))


@cuda.jit(device=True)
def activation(v, act):
    """The FFN gate's function by its code in ACTIVATIONS: silu (0, SwiGLU) or gelu_tanh (1, GeGLU)."""
    return gelu_tanh(v) if act == 1 else silu(v)


@functools.cache
def routed_ffn(q8_0: bool = False):
    """(route, experts_gate_up, experts_down): ops.route and ops.moe_ffn as three steps of the forward kernel, each
    a thread per work item (gid: this thread's index in the grid, threads: the grid's), the grid barrier between.
        route           p = softmax(xn Wr^T) over the E experts; chosen = the k largest (ties: the lower id first,
                        as a stable sort); weight = p[chosen], / their sum when `normalize`
                                               # xn [T, D], router [E, D] -> probs [T, E], chosen, routed [T, k]
        experts_gate_up he[t, j] = act(xn_t W1[e]^T) * (xn_t W3[e]^T),  e = chosen[t, j]
                                               # w13 [E, 2, Fe, D] (or Q8_0 blocks) -> he [T, k, Fe]
        experts_down    y[t] += alpha sum_j routed[t, j] (he[t, j] W2[e]^T)     # w2 [E, D, Fe] -> y [T, D]
    Only the chosen experts are computed, each token's own (no grouping by expert yet)."""
    weight = weight_reader(q8_0)

    @cuda.jit(device=True)
    def route(xn, router, normalize, probs, chosen, routed, gid, threads):
        E, k = router.shape[0], chosen.shape[1]
        for t in range(gid, xn.shape[0], threads):
            top = np.float32(-np.inf)
            for e in range(E):
                logit = np.float32(0)
                for d in range(xn.shape[1]):
                    logit += xn[t, d] * router[e, d]
                probs[t, e] = logit
                top = logit if logit > top else top
            total = np.float32(0)
            for e in range(E):
                probs[t, e] = math.exp(probs[t, e] - top)
                total += probs[t, e]
            kept = np.float32(0)
            for j in range(k):
                best = -1
                for e in range(E):
                    taken = False
                    for i in range(j):
                        taken = taken or chosen[t, i] == e
                    if not taken and (best < 0 or probs[t, e] > probs[t, best]):
                        best = e
                chosen[t, j] = best
                routed[t, j] = probs[t, best] / total
                kept += routed[t, j]
            if normalize:
                for j in range(k):
                    routed[t, j] = routed[t, j] / kept

    @cuda.jit(device=True)
    def experts_gate_up(xn, w13, chosen, act, he, gid, threads):
        k, F = he.shape[1], he.shape[2]
        for item in range(gid, xn.shape[0] * k * F, threads):
            t, j, f = item // (k * F), (item // F) % k, item % F
            w = w13[chosen[t, j]]
            gate, up = np.float32(0), np.float32(0)
            for d in range(xn.shape[1]):
                gate += xn[t, d] * weight(w[0], f, d)
                up += xn[t, d] * weight(w[1], f, d)
            he[t, j, f] = activation(gate, act) * up

    @cuda.jit(device=True)
    def experts_down(he, w2, chosen, routed, alpha, y, gid, threads):
        k, F, D = he.shape[1], he.shape[2], y.shape[1]
        for item in range(gid, y.shape[0] * D, threads):
            t, n = item // D, item % D
            total = np.float32(0)
            for j in range(k):
                w = w2[chosen[t, j]]
                dot = np.float32(0)
                for f in range(F):
                    dot += he[t, j, f] * weight(w, n, f)
                total += routed[t, j] * dot
            y[t, n] += alpha * total

    return route, experts_gate_up, experts_down


@functools.cache
def routed_ffn_kernel(piece: int, q8_0: bool = False):
    """One of routed_ffn's three steps a launch (piece 0, 1, 2), for tests: the forward kernel runs them inside."""
    route, experts_gate_up, experts_down = routed_ffn(q8_0)

    @cuda.jit
    def kernel(xn, router, normalize, w13, w2, act, alpha, probs, chosen, routed, he, y):
        gid, threads = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, cuda.gridDim.x * cuda.blockDim.x
        if piece == 0:
            route(xn, router, normalize, probs, chosen, routed, gid, threads)
        elif piece == 1:
            experts_gate_up(xn, w13, chosen, act, he, gid, threads)
        else:
            experts_down(he, w2, chosen, routed, alpha, y, gid, threads)

    return kernel
