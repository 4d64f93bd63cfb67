"""RingKVCache: keys and values of past positions, kept in a fixed-size ring per sequence slot.

    k, v       [L, B, C, K, Dh]   L layers, B sequence slots, C capacity (positions kept), K kv heads, Dh head dim
    positions  [B, C] int64       which position each ring entry holds; -1 = empty

Position p of slot b lives at ring index p % C, so memory never grows, and once p >= C the oldest entry is
overwritten: a sequence then attends to its last C positions (a sliding window of C). Keys are stored already
rotated by RoPE, so a cached key never needs its position again except for the causal mask.
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .errors import GenerationError


class RingKVCache:
    def __init__(self, config: ModelConfig, capacity: int | None = None, slots: int = 1, dtype=np.float32):
        capacity = config.max_seq_len if capacity is None else int(capacity)
        if capacity <= 0 or slots <= 0:
            raise GenerationError(f"KV cache capacity and slots must be positive, got {capacity} and {slots}")
        self.capacity, self.slots = capacity, slots
        shape = (config.n_layers, slots, capacity, config.n_kv_heads, config.head_dim)
        try:
            self.k = np.zeros(shape, dtype)  # [L, B, C, K, Dh]
            self.v = np.zeros(shape, dtype)  # [L, B, C, K, Dh]
            self.positions = np.full((slots, capacity), -1, np.int64)  # [B, C]
        except MemoryError:
            gib = 2 * np.prod(shape, dtype=np.float64) * np.dtype(dtype).itemsize / 2**30
            raise GenerationError(f"a KV cache of {capacity:,} positions x {slots} slots needs {gib:,.1f} GiB, more "
                                  f"than this machine can allocate (context {config.max_seq_len:,} tokens, "
                                  f"{config.n_layers} layers)") from None
        self.lengths = np.zeros(slots, np.int64)  # [B] next position of each slot

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def read(self, layer: int, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The filled entries of one slot, oldest position first.   # -> [S, K, Dh], [S, K, Dh], [S] positions

        Position order (rather than ring order) makes a decode step sum its attention terms in the same order as
        a prefill of the same tokens, so the two agree to float32 rounding.
        """
        order = self.filled_in_order(slot)
        return self.k[layer, slot, order], self.v[layer, slot, order], self.positions[slot, order]

    def filled_in_order(self, slot: int) -> np.ndarray:
        """Ring indices of the filled entries of a slot, sorted by position.  # -> [S] with S <= C"""
        filled = np.flatnonzero(self.positions[slot] >= 0)
        return filled[np.argsort(self.positions[slot, filled], kind="stable")]

    def write(self, layer: int, slot: int, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store rotated keys and values of `positions` at ring indices positions % C.  # [T], [T, K, Dh] x2

        When T > C only the last C positions survive, exactly as if they had been written one by one.
        """
        positions = np.asarray(positions)[-self.capacity:]
        index = positions % self.capacity
        self.k[layer, slot, index] = k[-self.capacity:]
        self.v[layer, slot, index] = v[-self.capacity:]
        if layer == self.k.shape[0] - 1:  # the positions table is shared by all layers: commit it once
            self.positions[slot, index] = positions
            self.lengths[slot] = max(self.lengths[slot], int(positions[-1]) + 1)

    def reorder(self, parents) -> None:
        """Slot b takes over the contents of slot parents[b], for every b at once (beam search forks and drops
        sequences this way).   # parents [B] -> k, v [L, B, C, K, Dh], positions, lengths reordered in place

        In place, so a compiled model holding these arrays sees the new contents."""
        parents = np.asarray(parents, dtype=np.int64)
        if parents.shape != (self.slots,) or (parents.size and not (0 <= parents.min() and
                                                                   parents.max() < self.slots)):
            raise GenerationError(f"reorder needs one parent slot in [0, {self.slots}) per slot, got {parents}")
        self.k[:] = self.k[:, parents]
        self.v[:] = self.v[:, parents]
        self.positions[:] = self.positions[parents]
        self.lengths[:] = self.lengths[parents]

    def rewind(self, slot: int, length: int) -> None:
        """Forget positions >= length of one slot, as if they had never been written (speculative decoding drops
        the keys of rejected draft tokens this way). Entries the ring overwrote on the way are not brought back:
        rewind within the last `capacity` positions."""
        if not 0 <= slot < self.slots or length < 0:
            raise GenerationError(f"rewind needs a slot in [0, {self.slots}) and a length >= 0, got {slot}, {length}")
        self.positions[slot, self.positions[slot] >= length] = -1
        self.lengths[slot] = min(int(self.lengths[slot]), length)

    def reset(self, slot: int | None = None) -> None:
        """Forget one slot (or all): its entries become empty and its next position 0."""
        if slot is None:
            self.positions[:] = -1
            self.lengths[:] = 0
        else:
            self.positions[slot] = -1
            self.lengths[slot] = 0
