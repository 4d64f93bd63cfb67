"""Model: what every backend's transformer shares, and the contract generation code relies on.

    config      ModelConfig
    forward(tokens, positions, cache, slots)   final-norm hidden states [T, D] of any set of tokens, each at its
                own position in its own cache slot (prefill, batched decode and ragged batches are all one call)
    lm_head(h)  logits on the host, the ids past the tokenizer (config.usable_vocab..) -inf   # [T, D] -> [T, V]
    new_cache(capacity, slots, kv_dtype)   a KV cache this model's forward fills (kv_dtype: how it stores keys and
                values; default the model's kv_dtype)
    window(cache)  how many recent positions a query sees (windows(capacity): per layer)
    rope_frequencies()  the RoPE inverse frequencies of each kind of layer (rope_rows(): each layer's)  # [R, r/2]
    logits(tokens) every position's logits of one sequence                            # [T] -> [T, V]
    sample(h, ...) a compiled sampler right after the LM head where a backend has one (None otherwise)
    sample_next(h, params, rng, history)   the next token of one sequence: through `sample` when it implements
                every option in use, else sampling.sample_with on host logits

A backend subclass lays out its weights its own way from the named weights (weights.Weights, built from a format
reader's dict) and implements forward and head_logits (every row of the LM head; lm_head masks the padding), and
new_cache where its cache is not a host RingKVCache, and a compiled `sample` that never draws a padding id where it
has one; the rest lives here.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..cache import RingKVCache
from ..config import ModelConfig
from ..errors import ConfigError, GenerationError
from ..sampling import SamplingParams, sample_with


# How a KV cache may store keys and values. float16 halves the cache's bytes, which attention reads at every decode
# step; keys and values are rounded to float16 when stored and widened to the compute dtype when read, so a prefill
# and the decode steps that follow see the same rounded keys.
KV_DTYPES = ("float32", "float16")


# What the compiled samplers (kernels.cpu.sample_rows, kernels.cuda.sample_rows) implement: stop strings are the
# generation loop's business and the seed is the caller's generator's. Any other option in use (penalties, typical_p,
# log-probabilities) sends the logits to sampling.sample_with.
KERNEL_SAMPLING = frozenset({"temperature", "top_k", "top_p", "min_p", "seed", "stop"})


def kernel_samples(params: SamplingParams) -> bool:
    """True when every sampling option in use is one the compiled samplers implement."""
    return params.options_in_use <= KERNEL_SAMPLING


def sampler_rows(B: int, temperature, top_k, top_p, min_p, uniforms, dtype) -> np.ndarray:
    """The compiled samplers' [B, 5] table of (temperature, top_k, top_p, min_p, u) rows; each option one value for
    every row or one per row."""
    options = (temperature, top_k, top_p, min_p, uniforms)
    if B == 1 and all(isinstance(v, (int, float)) for v in options):  # a decode step of one sequence: the quick way
        return np.array([options], dtype)
    rows = np.empty((B, 5), dtype)
    rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4] = options
    return rows


class Model:
    dtype = np.dtype(np.float32)  # what forward computes in
    kv_dtype = None  # how new_cache stores keys and values by default: one of KV_DTYPES, or None for `dtype`
    sample = None  # sample(h, temperature, top_k, top_p, min_p, uniforms) -> [B] ids, where the hidden states live
    # The options beyond Llama's (ModelConfig.features) this backend's forward implements. lm_head applies the
    # logit multiplier and soft-cap for every backend.
    FEATURES = frozenset({"logit_multiplier", "final_logit_softcap"})
    backend = "numpy"

    def __init__(self, config: ModelConfig):
        check_runs(type(self), config)
        self.config = config

    def forward(self, tokens, positions, cache, slots=None):
        """Final-norm hidden states of the given tokens, updating the cache.     # [T], [T], [T] -> [T, D]

        slots[t] is the cache slot (sequence) of token t (all 0 when omitted). Within a slot, tokens come in
        increasing position order and follow what the slot's cache already holds.
        """
        raise NotImplementedError

    def lm_head(self, h) -> np.ndarray:
        """Logits from final hidden states, on the host.                                 # [T, D] -> [T, V]

        A vocabulary padded past the tokenizer (config.usable_vocab < V) has rows no text maps to: their ids get
        -inf, so no sampler, search or score ever produces or counts them."""
        c = self.config
        logits = ops.final_logits(self.head_logits(h), c.logit_multiplier, c.final_logit_softcap)
        n = self.config.usable_vocab
        if n is not None and n < logits.shape[-1]:
            logits[..., n:] = -np.inf  # the backends' heads return new arrays: masked in place
        return logits

    def head_logits(self, h) -> np.ndarray:
        """The backend's LM head: logits of every row of the output matrix, padding included, as a new array on
        the host.                                                                         # [T, D] -> [T, V]"""
        raise NotImplementedError

    def sample_next(self, h, params: SamplingParams, rng, history=()) -> int:
        """The next token after final hidden state h [1, D], drawn as sampling.sample_with draws it (the same one
        rng.random() for a sampled step, none for a greedy one): by the backend's compiled sampler when it has one
        that implements every option in use, else by sample_with on the host logits."""
        if self.sample is None or not kernel_samples(params) or (self.transforms_logits and not params.is_greedy):
            return int(sample_with(params, self.lm_head(h)[0], rng, history))
        u = 0.0 if params.is_greedy else rng.random()
        return int(self.sample(h, params.temperature, params.top_k, params.top_p, params.min_p, u)[0])

    def new_cache(self, capacity: int | None = None, slots: int = 1, kv_dtype: str | None = None) -> RingKVCache:
        """A RingKVCache of `slots` sequences x `capacity` positions (default the context), storing keys and values
        as kv_dtype (one of KV_DTYPES; default self.kv_dtype, or the compute dtype when that is None too)."""
        kv_dtype = self.kv_dtype if kv_dtype is None else kv_dtype
        return RingKVCache(self.config, capacity, slots, self.dtype if kv_dtype is None else kv_storage(kv_dtype))

    @property
    def transforms_logits(self) -> bool:
        """Whether lm_head scales or soft-caps the head's output (Granite, Gemma 2): the compiled samplers, which
        read the head's output directly, then draw only greedy tokens (both transforms keep the argmax)."""
        return self.config.logit_multiplier != 1.0 or self.config.final_logit_softcap > 0

    def window(self, cache) -> int:
        """How many most recent positions a query sees: the model's sliding window, capped by the ring's size."""
        return min(self.config.sliding_window or cache.capacity, cache.capacity)

    def windows(self, capacity: int) -> np.ndarray:
        """Per layer, how many most recent positions a query sees: the sliding window in sliding layers, the
        whole ring elsewhere, never more than the ring holds.                                       # -> [L]"""
        c = self.config
        return np.array([min(c.sliding_window if c.is_sliding(l) else capacity, capacity) for l in range(c.n_layers)],
                        np.int64)

    def rope_frequencies(self) -> np.ndarray:
        """RoPE inverse frequencies of each kind of layer, one row each, and each layer's row: row 0 full-attention
        layers, then where the family has them a row for sliding layers (rope_local_theta, unscaled: Gemma 3) and
        a row of zeros for layers without RoPE (rope_layers: SmolLM3's NoPE; angle 0 turns nothing).
                                                                            # -> [R, r/2] f64 (rope_rows: [L])
        r = config.rotary_dims (the first r dims of each head turn; a backend that rotates whole heads pads the rows
        with zeros: padded_rope_tables). The frequencies depend on the context the model runs with,
        config.max_seq_len, never on a call's length or its cache's size: longrope's factors (as llama.cpp chooses by
        its n_ctx) and dynamic NTK's base, so a sequence computes the same whether it runs alone, in a batch or
        under a perplexity window. transformers chooses per call by the sequence's length, so it agrees where both
        are past (or both within) the original context (dynamic: a prompt of the context's length in one call)."""
        return self._rope_tables()[0]

    def rope_rows(self) -> np.ndarray:
        """Each layer's row of rope_frequencies().                                                  # -> [L] int64"""
        return self._rope_tables()[1]

    def rope_amplitudes(self) -> np.ndarray:
        """What each row's cos and sin are multiplied by: the full-attention row by longrope's or yarn's
        attention_factor (queries and keys both, so their rotated dims' scores by its square, as transformers and
        llama.cpp scale cos and sin); sliding and NoPE rows by 1.                                    # -> [R] f64"""
        return self._rope_tables()[2]

    def _rope_tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = self.config
        if getattr(self, "_rope_config", None) is not c:  # worked out once per context (config)
            full = ops.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, c.max_seq_len, c.rotary_dims)
            kinds = [full]
            if c.rope_local_theta and any(c.is_sliding(l) for l in range(c.n_layers)):
                kinds.append(ops.rope_inv_freq(c.head_dim, c.rope_local_theta, rotary_dims=c.rotary_dims))
            if not all(c.has_rope(l) for l in range(c.n_layers)):
                kinds.append(np.zeros_like(full))
            local, nope = (1 if len(kinds) > 1 and c.rope_local_theta else 0), len(kinds) - 1
            rows = [nope if not c.has_rope(l) else local if c.is_sliding(l) else 0 for l in range(c.n_layers)]
            amplitudes = np.ones(len(kinds))
            amplitudes[0] = c.rope_scaling.attention_factor if c.rope_scaling is not None else 1.0
            self._rope_cache = (np.stack(kinds), np.array(rows, np.int64), amplitudes)
            self._rope_config = c
        return self._rope_cache

    def padded_rope_tables(self) -> np.ndarray:
        """For kernels that rotate every pair of a head in the interleaved layout: per row, rope_frequencies()
        padded with zeros past config.rotary_dims (angle 0: cos 1, sin 0, exactly the identity), and each pair's
        amplitude (rope_amplitudes() over the rotated pairs, 1 past them).          # -> [R, 2, Dh/2] f64"""
        freqs = self.rope_frequencies()
        pad = ((0, 0), (0, self.config.head_dim // 2 - freqs.shape[1]))
        amplitudes = np.repeat(self.rope_amplitudes()[:, None], freqs.shape[1], axis=1)
        return np.stack([np.pad(freqs, pad), np.pad(amplitudes, pad, constant_values=1.0)], axis=1)

    def logits(self, tokens, positions=None, cache=None) -> np.ndarray:
        """Logits of every token of one sequence on a fresh cache (or the given one).  # [T] -> [T, V]"""
        tokens = np.asarray(tokens, dtype=np.int64)
        if positions is None:
            positions = np.arange(len(tokens))
        cache = self.new_cache() if cache is None else cache
        return self.lm_head(self.forward(tokens, positions, cache))

    @property
    def key_layout(self) -> str:
        """How the cached keys pair their dimensions for RoPE: "interleaved" (2i, 2i+1) or "half" (i, i + Dh/2).
        The reference caches keys in the checkpoint's layout; a backend that permutes q/k rows says so."""
        return self.config.rope_layout

    def move_cached_keys(self, cache, slot: int, src, dst, shift: int) -> None:
        """Move ring entries src -> dst of one slot in every layer, each key rotated `shift` positions further.
                                                                                    # src, dst [n] ring indices
        Keys are cached already rotated by RoPE to their position p. RoPE is a rotation, R(p + d) k = R(d) R(p) k,
        so the cached key of position p becomes the key of position p + d by one more rotation by d, in the
        cache's own pairing of dimensions (key_layout), without recomputing its token. Values carry no position
        and move as they are. The positions table follows: dst now holds src's positions + shift, src is emptied
        (then refilled where it is also a destination). Attention sinks slide forward this way (npllm.context).
        """
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        k = cache.k[:, slot, src].astype(np.float64)  # [L, n, K, Dh]
        L, Dh = k.shape[0], k.shape[-1]
        freqs = self.rope_frequencies()  # the first r dims turn in either layout (partial rotary: r < Dh)
        layer_freqs = freqs[self.rope_rows()]  # [L, r/2]: each layer's keys turn at their own rates
        angles = float(shift) * layer_freqs[:, None, :]  # [L, 1, r/2]: one angle table per layer
        rope = ops.rope_interleaved if self.key_layout == "interleaved" else ops.rope_half
        rotated = np.stack([rope(k[l].reshape(-1, 1, Dh), np.cos(angles[l]), np.sin(angles[l])) for l in range(L)])
        rotated = rotated.reshape(k.shape)
        v, moved = cache.v[:, slot, src].copy(), cache.positions[slot, src] + shift
        cache.positions[slot, src] = -1
        cache.k[:, slot, dst] = rotated.astype(cache.k.dtype)
        cache.v[:, slot, dst] = v
        cache.positions[slot, dst] = moved

    def synchronize(self) -> None:
        """Wait until queued work is done (a GPU's launches return at once; on the CPU nothing is queued)."""

    def call_arrays(self, tokens, positions, slots) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """tokens, positions and slots of a forward call as int64 arrays (slots all 0 when omitted), with one
        position and one slot per token."""
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        slots = np.zeros(tokens.shape, np.int64) if slots is None else np.asarray(slots, dtype=np.int64)  # not zeros_like: 1.5 µs a decode step
        if tokens.ndim != 1 or tokens.shape != positions.shape or tokens.shape != slots.shape:
            raise GenerationError(f"forward needs 1-D tokens, positions and slots of one length, got shapes "
                                  f"{tokens.shape}, {positions.shape}, {slots.shape}")
        return tokens, positions, slots

    def check_call(self, tokens, positions, slots, cache) -> None:
        """Ids inside the vocabulary, positions >= 0, slots inside the cache (the compiled backends check the
        same in their own way, on every decode step)."""
        V = self.config.vocab_size
        if tokens.size and not (0 <= tokens.min() and tokens.max() < V):
            raise GenerationError(f"token ids must lie in [0, {V}), got {tokens.min()}..{tokens.max()}")
        if slots.size and not (0 <= slots.min() and slots.max() < cache.slots):
            raise GenerationError(f"slots must lie in [0, {cache.slots}), got {slots.min()}..{slots.max()}")
        if positions.size and positions.min() < 0:
            raise GenerationError(f"positions must be >= 0, got {positions.min()}")


def check_runs(model_class, config: ModelConfig) -> None:
    """A ConfigError naming what the backend does not implement of the family's options, before any work."""
    missing = config.features - model_class.FEATURES
    if missing:
        raise ConfigError(f"the {model_class.backend} backend does not run {', '.join(sorted(missing))} "
                          f"({config.arch}) yet; backend='numpy' runs every family npllm reads")


def kv_storage(kv_dtype) -> np.dtype:
    """The NumPy dtype of a KV_DTYPES name or dtype (a ConfigError names the choices for anything else)."""
    name = kv_dtype if isinstance(kv_dtype, str) else getattr(np.dtype(kv_dtype), "name", None)
    if name not in KV_DTYPES:
        raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return np.dtype(name)
