"""The math of a Llama block, one small NumPy function per stage. This module is npllm's reference.

Legend (as in config.py): V vocab, D model width, F FFN width, H query heads, K key/value heads, Dh head dim,
T query tokens in this call, S key positions attended to. Every function keeps the dtype of its input (float32 in practice; float64 for tests that need exact arithmetic).

    tokens --embed--> x --[rms_norm -> q,k,v -> rope -> attention -> wo]--> +x --[rms_norm -> swiglu]--> +x ...
           --rms_norm--> lm_head --> logits --softmax--> probabilities
"""

from __future__ import annotations

import numpy as np

from .config import RopeScaling


def embed(tok_embeddings: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Embedding lookup: x[t] = E[tokens[t]]. A lookup is just row indexing.  # [V, D], [T] -> [T, D]"""
    return np.array(tok_embeddings[tokens])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm: y = x / sqrt(mean(x^2) + eps) * g, over the last axis.  # [..., D], [D] -> [..., D]

    Unlike LayerNorm there is no mean subtraction and no bias: only the scale of x is normalised.
    """
    ms = np.mean(np.square(x), axis=-1, keepdims=True)  # [..., 1]
    return x * (1.0 / np.sqrt(ms + x.dtype.type(eps))) * weight


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None, context: int = 0,
                  rotary_dims: int | None = None) -> np.ndarray:
    """Inverse frequencies of the rotary embedding: w_i = theta^(-2i / r), i = 0 .. r/2 - 1.   # -> [r/2] f64

    r = rotary_dims (default head_dim): the first r dims of each head turn, the rest pass unrotated (Phi-3's
    partial_rotary_factor r / Dh). Pair i of a head is rotated by the angle pos * w_i: fast rotations for the first
    pairs, slow for the last. Scaling (for contexts longer than training) slows the low frequencies down; see
    RopeScaling. longrope's divisors and dynamic NTK's base depend on the `context` the model runs with.
    """
    r = head_dim if rotary_dims is None else rotary_dims
    if scaling is not None and scaling.kind == "dynamic":
        theta = dynamic_ntk_theta(theta, scaling, context, r)
    inv_freq = theta ** (-np.arange(0, r, 2, dtype=np.float64) / r)
    if scaling is None or scaling.kind == "dynamic":
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "longrope":
        return inv_freq / np.asarray(scaling.divisors(context), np.float64)
    if scaling.kind == "yarn":
        return yarn_inv_freq(inv_freq, theta, scaling)
    return _llama3_scaled(inv_freq, scaling)


def yarn_inv_freq(inv_freq: np.ndarray, theta: float, s: RopeScaling) -> np.ndarray:
    """YaRN ("NTK-by-parts") frequencies: each w_i blended between itself (extrapolation) and w_i / factor
    (interpolation) by how many turns it makes over the original context N.            # [r/2] -> [r/2] f64

        d(b)    = r ln(N / (2 pi b)) / (2 ln theta)        the pair index that turns b times over N
        lo, hi  = max(floor(d(beta_fast)), 0), min(ceil(d(beta_slow)), r - 1)   (no floor / ceil: truncate false)
        ramp_i  = clip((i - lo) / (hi - lo), 0, 1)          (hi == lo: hi + 0.001)
        w'_i    = w_i / factor * ramp_i + w_i * (1 - ramp_i)
    Fast pairs (more than beta_fast turns: ramp 0) keep their frequency, slow ones (fewer than beta_slow: ramp 1) are
    divided by factor. The rotated dims of queries and keys are also scaled by s.attention_factor (rope_angles'
    amplitude).
    """
    r = 2 * len(inv_freq)
    N = s.original_max_position_embeddings

    def pair_turning(turns: float) -> float:
        return r * np.log(N / (turns * 2 * np.pi)) / (2 * np.log(theta))

    lo, hi = pair_turning(s.beta_fast), pair_turning(s.beta_slow)
    if s.truncate:
        lo, hi = np.floor(lo), np.ceil(hi)
    lo, hi = max(lo, 0.0), min(hi, r - 1.0)
    if hi == lo:
        hi += 0.001
    ramp = np.clip((np.arange(r // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
    return inv_freq / s.factor * ramp + inv_freq * (1.0 - ramp)


def dynamic_ntk_theta(theta: float, s: RopeScaling, context: int, rotary_dims: int) -> float:
    """Dynamic NTK scaling's RoPE base for a model run with `context` positions, N the original context:

        theta' = theta (factor L / N - (factor - 1))^(r / (r - 2)),   L = max(context, N)
    theta' = theta up to the original context; past it the base grows, so the slow pairs stretch over the longer
    context while the fastest pair keeps its frequency. (transformers grows it by each call's length, max position
    + 1, keeping cached keys as they were rotated; npllm by the context, the same for a prompt of that length.)
    """
    N = s.original_max_position_embeddings
    length = max(context, N)
    return theta * (s.factor * length / N - (s.factor - 1)) ** (rotary_dims / (rotary_dims - 2))


def _llama3_scaled(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1 scaling: wavelengths longer than original_max / low_freq_factor are stretched by `factor`,
    shorter than original_max / high_freq_factor kept, and the band between interpolated linearly in
    original_max / wavelength."""
    wavelen = 2 * np.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return np.where(wavelen < high_freq_wavelen, inv_freq,
                    np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, blended))


def rope_angles(positions: np.ndarray, inv_freq: np.ndarray, dtype=np.float32,
                amplitude=1.0) -> tuple[np.ndarray, np.ndarray]:
    """a cos and a sin of the rotation angles pos * w_i, computed in float64.  # [T], [Dh/2] -> [T, Dh/2] x2

    a = amplitude (a number, or one per pair [Dh/2]): longrope's and yarn's attention factor, which scales the
    rotated dims of queries and keys alike (so their scores by a^2), as transformers and llama.cpp apply it."""
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (np.cos(angles) * amplitude).astype(dtype), (np.sin(angles) * amplitude).astype(dtype)


def rope_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE on adjacent pairs (x[2i], x[2i+1]), the layout of Meta's and llama2.c's checkpoints.

        x'[2i]   = x[2i] cos(pos w_i) - x[2i+1] sin(pos w_i)
        x'[2i+1] = x[2i] sin(pos w_i) + x[2i+1] cos(pos w_i)          # [T, n, Dh], [T, r/2] x2 -> [T, n, Dh]
    for i < r/2: the first r = 2 cos.shape[-1] dims turn, x[r:] passes as it is (partial rotary; r = Dh: all).
    """
    r = 2 * cos.shape[-1]
    even, odd = x[..., 0:r:2], x[..., 1:r:2]  # [T, n, r/2] each
    c, s = cos[:, None, :], sin[:, None, :]  # broadcast over the heads
    out = x.copy()
    out[..., 0:r:2] = even * c - odd * s
    out[..., 1:r:2] = even * s + odd * c
    return out


def rope_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE on pairs (x[i], x[i + r/2]), i < r/2, the layout of Hugging Face checkpoints (their q/k rows are
    permuted so that this equals rope_interleaved on Meta's layout).    # [T, n, Dh], [T, r/2] x2 -> [T, n, Dh]
    The first r = 2 cos.shape[-1] dims turn, x[r:] passes as it is (partial rotary; r = Dh: all).
    """
    half = cos.shape[-1]
    first, second, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([first * c - second * s, first * s + second * c, rest], axis=-1)


def attention_mask(q_positions: np.ndarray, k_positions: np.ndarray, window: int | None = None) -> np.ndarray:
    """Additive causal mask: 0 where query t may see key s, -inf elsewhere.  # [T], [S] -> [T, S]

    A query at position p sees keys at positions p - window < k <= p (all k <= p when window is None). Key slots
    holding position -1 (an empty cache slot) are never seen. Adding -inf before the softmax gives those keys
    exp(-inf) = 0 weight, so the mask is arithmetic, not control flow.
    """
    q = np.asarray(q_positions)[:, None]
    k = np.asarray(k_positions)[None, :]
    visible = (k <= q) & (k >= 0)
    if window is not None:
        visible &= k > q - window
    return np.where(visible, 0.0, -np.inf).astype(np.float32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """softmax(x)_i = exp(x_i - max x) / sum_j exp(x_j - max x); subtracting the max keeps exp from overflowing."""
    z = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=axis, keepdims=True)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """Soft-capping (Gemma 2): c tanh(x / c), which is ~x for |x| << c and never leaves (-c, c); c = 0: x as is."""
    if not cap:
        return x
    c = x.dtype.type(cap)
    return c * np.tanh(x / c)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float | None = None,
              cap: float = 0.0) -> np.ndarray:
    """Causal scaled dot-product attention with grouped-query heads.

        out_h = softmax(softcap(s q_h k_g^T, cap) + mask) v_g,   g = h // (H / K),   s = 1/sqrt(Dh) by default
                                                            # [T, H, Dh], [S, K, Dh], [S, K, Dv], [T, S] -> [T, H, Dv]
    Each KV head serves H/K consecutive query heads (GQA; K == H is plain multi-head attention). Every query
    must see at least one key (its own position), so no softmax row is all -inf. Gemma scales by
    query_pre_attn_scalar^-1/2 instead of Dh^-1/2 and (Gemma 2) soft-caps the scores before the mask.
    """
    T, H, Dh = q.shape
    S, K, _ = k.shape
    G = H // K
    qg = q.reshape(T, K, G, Dh).transpose(1, 2, 0, 3)  # [K, G, T, Dh]
    kg = k.transpose(1, 2, 0)[:, None]  # [K, 1, Dh, S]
    vg = v.transpose(1, 0, 2)[:, None]  # [K, 1, S, Dh]
    s = q.dtype.type(1.0 / np.sqrt(Dh) if scale is None else scale)
    scores = softcap((qg @ kg) * s, cap) + mask.astype(q.dtype)  # [K, G, T, S]
    weights = softmax(scores, axis=-1)
    out = weights @ vg  # [K, G, T, Dh]
    return out.transpose(2, 0, 1, 3).reshape(T, H, v.shape[-1])


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU (swish): x * sigmoid(x) = x / (1 + e^-x)."""
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (Gemma): x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    c = x.dtype.type(np.sqrt(2.0 / np.pi))
    return x.dtype.type(0.5) * x * (1 + np.tanh(c * (x + x.dtype.type(0.044715) * x * x * x)))


def swiglu(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray, act=silu) -> np.ndarray:
    """SwiGLU feed-forward: FFN(x) = (silu(x W1^T) * (x W3^T)) W2^T.   # [T, D], [F, D], [D, F], [F, D] -> [T, D]

    W1 is the gate, W3 the "up" projection; the gate's SiLU decides how much of each hidden unit passes.
    act=gelu_tanh gives GeGLU (Gemma): the same gate with GELU in place of SiLU.
    """
    gate = x @ w1.T  # [T, F]
    up = x @ w3.T  # [T, F]
    return (act(gate) * up) @ w2.T


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}  # ModelConfig.ffn_activation -> the gate's function


def route(x: np.ndarray, router: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Mixture-of-experts router: which k experts each token uses, and with what weight.  # [T, D], [E, D] ->
                                                                                         #   [T, k] ids, [T, k]
        p = softmax(x Wr^T) over the E experts;  chosen = the k largest p;  weight = p[chosen]
    normalize (Mixtral, Qwen3-MoE's norm_topk_prob): weights / their sum, which equals a softmax over the k
    chosen logits alone. The router's softmax runs in float64, as the reference frameworks run it in float32 at
    least, so near ties between experts break the same way.
    """
    p = softmax((x @ router.T).astype(np.float64), axis=-1)  # [T, E]
    chosen = np.argsort(-p, axis=-1, kind="stable")[:, :k]  # [T, k], the largest first
    weights = np.take_along_axis(p, chosen, axis=-1)  # [T, k]
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return chosen, weights.astype(x.dtype)


def moe_ffn(x: np.ndarray, chosen: np.ndarray, weights: np.ndarray, w1: np.ndarray, w2: np.ndarray,
            w3: np.ndarray, act=silu) -> np.ndarray:
    """Routed feed-forward: FFN(x_t) = sum over chosen e of weight_e * swiglu(x_t, W1[e], W2[e], W3[e]).
                                           # [T, D], [T, k], [T, k], [E, Fe, D], [E, D, Fe], [E, Fe, D] -> [T, D]
    Only the chosen experts run: tokens are grouped by expert, so each expert's weights are read once per call.
    """
    out = np.zeros_like(x)
    for e in np.unique(chosen):
        t, j = np.nonzero(chosen == e)  # the tokens that chose expert e, and in which of their k places
        out[t] += weights[t, j, None] * swiglu(x[t], w1[e], w2[e], w3[e], act)
    return out


def lm_head(x: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Logits: one score per vocabulary entry, x W_out^T (W_out is the embedding when tied).  # [T, D] -> [T, V]"""
    return x @ output.T


def final_logits(logits: np.ndarray, multiplier: float = 1.0, cap: float = 0.0) -> np.ndarray:
    """What some families do to the head's output: logits * m (Granite: m = 1 / logits_scaling), then
    softcap(., cap) (Gemma 2). Both keep the order of the logits, so greedy choices never change.  # [T, V] -> [T, V]
    """
    if multiplier != 1.0:
        logits = logits * logits.dtype.type(multiplier)
    return softcap(logits, cap)
