"""PrefixCache: the keys and values of prompt beginnings seen before, so that a prompt sharing one prefills only the
rest.

    restore(cache, slot, tokens) -> n   copy the longest cached prefix of `tokens` (whole blocks, fewer than all the
                                        tokens: the last one is always run, its logits are what is sampled from)
                                        into an empty slot; the caller feeds tokens[n:] at positions n, n+1, ...
    store(cache, slot, tokens)          after a prefill: keep the whole blocks of `tokens` the slot now holds
    deferred(tokens, capacity, pending) whether a prompt should wait a step because a prompt started in the same
                                        step computes its next missing block (it then finds it cached)

The unit is a block of BLOCK tokens at fixed positions: block i holds positions i*BLOCK .. (i+1)*BLOCK - 1 of every
layer, keys already rotated by RoPE, in the KV cache's own dtype (float16 KV stays float16, so a restored key is the
very value a fresh prefill would have stored). Block i is keyed by a chained hash: blake2b of block i-1's key and
block i's tokens, the chain seeded with what else decides the keys and values (the model object, its config with
its RoPE settings, its backend's key layout, the KV dtype). Equal keys mean equal tokens at every earlier position,
so equal keys and values: the model computes position p's from tokens 0..p alone.

Blocks are copied into a slot, never shared with it, so a running sequence never holds one: any block may be
evicted at any time. Eviction is least-recently-used under a byte budget; a chain's blocks are touched deepest first,
its first block last, so the leaves of old chains go before the roots that many prompts share (a chain missing a
block is only usable up to it).

Past the ring. Position p lives at ring entry p % capacity, and a query sees at most the ring's last `capacity`
positions, so keys and values computed while the ring had wrapped depend on the ring's size. Only positions below
the ring's capacity are ever stored or restored: a slot whose sequence went past its ring (or whose sinks moved, or
whose head was truncated: npllm.context) stores nothing beyond what the ring still holds in a fresh run's layout, and
a restore never fills more than the ring holds. Within those positions a sliding-window layer sees the same keys
whatever the ring's size, so blocks serve every capacity.

Backends: any whose cache is a host RingKVCache (numpy, numba; float32 and float16 KV). A cache on a GPU
(CudaKVCache) is not one: applies() says False and the callers run without a prefix cache.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .cache import RingKVCache
from .errors import GenerationError

BLOCK = 32  # tokens per block: small enough that most of a shared prompt is reused, large enough to hash cheaply
DEFAULT_MIB = 256  # the default budget of npllm serve and npllm batch


@dataclass
class PrefixStats:
    """Counts since the cache was made. Hit rate: the share of the prompt tokens looked up found cached."""

    lookups: int = 0  # prompts looked up
    hits: int = 0  # prompts that found at least one block
    prompt_tokens: int = 0  # tokens of the prompts looked up
    cached_tokens: int = 0  # of those, restored from the cache
    stored_blocks: int = 0  # blocks inserted
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixCache:
    """Blocks of keys and values of one model's prompts, keyed by chained hashes, LRU under budget_bytes."""

    def __init__(self, model, budget_bytes: int, block: int = BLOCK):
        if budget_bytes < 0 or block <= 0:
            raise GenerationError(f"a prefix cache needs a budget >= 0 and a block > 0, got {budget_bytes}, {block}")
        self.model, self.budget, self.block = model, int(budget_bytes), int(block)
        # What decides the keys and values besides the tokens. id(model): two models of one shape (random fixtures,
        # fine-tunes) share a config but not weights; the cache keeps a reference, so the id stays this model's.
        self.identity = repr((id(model), type(model).__qualname__, getattr(model, "key_layout", ""),
                              str(getattr(model, "dtype", "")), repr(model.config))).encode()
        self.blocks: OrderedDict[bytes, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # oldest use first
        self.nbytes = 0
        self.stats = PrefixStats()
        self.lock = threading.Lock()  # a server's engine thread and an LLM's callers may share one

    @classmethod
    def of_mib(cls, model, mib: float | None, block: int = BLOCK) -> PrefixCache | None:
        """A cache of `mib` MiB for `model`, or None when mib is 0 or None (the cache is off)."""
        if mib is None or mib == 0:
            return None
        if mib < 0:
            raise GenerationError(f"the prefix cache's budget must be >= 0 MiB, got {mib}")
        return cls(model, int(mib * 2**20), block)

    @staticmethod
    def applies(cache) -> bool:
        """Whether blocks can be copied into and out of this KV cache (a host ring: numpy and numba)."""
        return isinstance(cache, RingKVCache)

    def chain(self, tokens, dtype) -> list[bytes]:
        """The keys of the whole blocks of `tokens`, block 0 first."""
        ids = np.asarray(tokens, np.int64)
        key = hashlib.blake2b(self.identity + np.dtype(dtype).str.encode(), digest_size=16).digest()
        keys = []
        for start in range(0, len(ids) - self.block + 1, self.block):
            key = hashlib.blake2b(key + ids[start:start + self.block].tobytes(), digest_size=16).digest()
            keys.append(key)
        return keys

    def usable(self, tokens, capacity: int) -> int:
        """How many of `tokens` a restore may fill: fewer than all (the last one is run), none past the ring."""
        return min(len(tokens) - 1, capacity)

    def _found(self, keys: list[bytes]) -> int:
        """How many leading keys of a chain are cached."""
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def deferred(self, tokens, cache, pending: set) -> bool:
        """True when the first block of `tokens` missing from the cache is one that a prompt started in this step
        will store (its key is in `pending`): starting a step later, this prompt restores it instead of computing
        it again. Otherwise False, and this prompt's missing blocks join `pending`."""
        keys = self.chain(tokens[:self.usable(tokens, cache.capacity)], cache.k.dtype)
        with self.lock:
            missing = keys[self._found(keys):]
        if missing and missing[0] in pending:
            return True
        pending.update(missing)
        return False

    def restore(self, cache, slot: int, tokens) -> int:
        """Copy the longest cached prefix of `tokens` into `slot` (which must be empty); how many tokens it holds
        (a multiple of the block, at most usable()). The slot then reads as if those tokens had been prefilled."""
        if int(cache.lengths[slot]) != 0:
            raise GenerationError(f"a prefix is restored only into an empty slot; slot {slot} holds "
                                  f"{int(cache.lengths[slot])} positions")
        keys = self.chain(tokens[:self.usable(tokens, cache.capacity)], cache.k.dtype)
        with self.lock:
            n = self._found(keys)
            for key in reversed(keys[:n]):  # the first block touched last: the most recently used
                self.blocks.move_to_end(key)
            found = [self.blocks[key] for key in keys[:n]]
            self.stats.lookups += 1
            self.stats.hits += n > 0
            self.stats.prompt_tokens += len(tokens)
            self.stats.cached_tokens += n * self.block
        B = self.block
        for i, (k, v) in enumerate(found):
            cache.k[:, slot, i * B:(i + 1) * B] = k
            cache.v[:, slot, i * B:(i + 1) * B] = v
        if found:
            cache.positions[slot, :n * B] = np.arange(n * B)
            cache.lengths[slot] = n * B
        return n * B

    def store(self, cache, slot: int, tokens) -> None:
        """Keep the whole blocks of `tokens` that `slot` holds at their own positions (ring entry = position: the
        ring never wrapped), as many as the budget takes, first blocks first."""
        B, capacity = self.block, cache.capacity
        held = min(len(tokens), int(cache.lengths[slot]), capacity)
        if int(cache.lengths[slot]) > capacity:  # the ring wrapped: its early entries hold later positions
            return
        held = held - held % B
        if held == 0 or not np.array_equal(cache.positions[slot, :held], np.arange(held)):
            return  # not a fresh prefill's layout (moved sinks, a truncated head): nothing to share
        block_bytes = 2 * cache.k[:, slot, :B].nbytes
        fits = min(held // B, self.budget // block_bytes)
        keys = self.chain(tokens[:fits * B], cache.k.dtype)
        with self.lock:
            for i in reversed(range(fits)):  # deepest first: the first block ends the most recently used
                if keys[i] in self.blocks:
                    self.blocks.move_to_end(keys[i])
                    continue
                k, v = cache.k[:, slot, i * B:(i + 1) * B].copy(), cache.v[:, slot, i * B:(i + 1) * B].copy()
                self.blocks[keys[i]] = (k, v)
                self.nbytes += block_bytes
                self.stats.stored_blocks += 1
                self._evict()

    def _evict(self) -> None:
        while self.nbytes > self.budget and self.blocks:
            _, (k, v) = self.blocks.popitem(last=False)
            self.nbytes -= k.nbytes + v.nbytes
            self.stats.evicted_blocks += 1

    def clear(self) -> None:
        with self.lock:
            self.blocks.clear()
            self.nbytes = 0

    def report(self) -> dict:
        """Size and hit counts, as /health and the logs show them."""
        s = self.stats
        return {"blocks": len(self.blocks), "block_tokens": self.block, "bytes": self.nbytes,
                "budget_bytes": self.budget, "lookups": s.lookups, "hits": s.hits, "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens, "hit_rate": round(s.hit_rate, 4), "evicted_blocks": s.evicted_blocks}
