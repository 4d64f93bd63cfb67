"""One sequence whose KV cache is kept between calls, and what happens when the context is full.

    Context(model, policy, sinks, capacity)
        tokens      every token the model has been fed for this sequence, in order
        prefill(ids)  make the sequence equal `ids`: keep the longest common prefix with `tokens` in the cache
                    (rewound there) and run only the rest through the model -> hidden state of the last token
        feed(ids)   append tokens -> hidden state of the last one

Generation on a Context is the one single-sequence loop, npllm.generate.decode(model, request, context): prefill,
then a draw and a feed per token, its stop, length and context rules those of generate.Sequence.

A chat sends the whole conversation every turn; everything up to the new user message is already in the cache, so
a turn costs only its new tokens (`prefilled` counts what went through the model). With a prefix_cache (a
PrefixCache of the model, npllm.prefix_cache), a context that holds nothing of the new prompt (a fresh one, or one
that started over) first takes the prompt's longest cached prefix from it, and every prefill stores its prompt's
whole blocks there, as long as the ring holds them in a fresh run's layout (before it wraps, sinks move or
"truncate" drops a head).

Context policies, for a sequence longer than the cache (`capacity` positions, default the model's context):

    "error"     the sequence never passes the context: a prompt that does not fit is an error, generation ends when
                the context is full (as generate always has), and with ignore_eos a request whose max_new_tokens
                cannot fit is refused before it starts.
    "truncate"  when a token does not fit, the cache is emptied and the most recent capacity // 2 tokens are run
                through the model again at positions 0, 1, ... (the oldest tokens, BOS included, are dropped);
                generation continues with half a context of room before the next recomputation. A prompt longer
                than the context keeps its last capacity // 2 tokens the same way.
    "sinks"     StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"): the
                ring keeps the first `sinks` tokens (the attention sinks) and the most recent capacity - sinks
                tokens, and every query sees exactly those. Nothing is recomputed; memory stays the cache's.

How "sinks" assigns positions. StreamingLLM numbers positions inside the cache: sink i at i, the window after
them, so a query is (sinks + its window distance) from sink i. Keys here are cached rotated by their absolute
position, and within the window absolute distances already are the in-cache ones; only the sinks must look as if
they sat just before the window's oldest token. So when the ring is full and position P comes in, the window's
oldest token leaves, and each sink moves one ring entry forward, its key rotated by one more position
(Model.move_cached_keys: R(p + 1) k = R(1) R(p) k, in the backend's own key layout) and its position entry + 1.
Sink i then sits at P - capacity + 1 + i, the window at P - capacity + sinks + 1 .. P: every entry of the ring is
visible to the query at P, and the distance to sink i is capacity - 1 - i, StreamingLLM's. Tokens past the full
ring are fed one at a time, since each one slides the sinks.
"""

from __future__ import annotations

import numpy as np

from .cache import RingKVCache
from .errors import GenerationError

POLICIES = ("error", "truncate", "sinks")
DEFAULT_SINKS = 4  # StreamingLLM's choice: four initial tokens suffice as attention sinks


def check_policy(policy: str, sinks: int = DEFAULT_SINKS) -> None:
    if policy not in POLICIES:
        raise GenerationError(f"context_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not isinstance(sinks, (int, np.integer)) or sinks < 0:
        raise GenerationError(f"sinks must be an integer >= 0, got {sinks!r}")


def check_prompt(config, prompt_ids) -> None:
    """A prompt the model can start from: at least one token, every id in the vocabulary, no longer than the
    context."""
    if len(prompt_ids) == 0:
        raise GenerationError("the prompt has no tokens (encode with bos=True to start from BOS)")
    if len(prompt_ids) > config.max_seq_len:
        raise GenerationError(f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                              f"{config.max_seq_len} tokens")
    bad = [t for t in prompt_ids if not 0 <= int(t) < config.vocab_size]
    if bad:
        raise GenerationError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {config.vocab_size})")


def encode_prompt(tokenizer, config, text: str, bos: bool = True) -> list[int]:
    """`text` as the token ids of a prompt the model can start from (check_prompt). A text that cannot fit the
    context is refused before it is encoded whole: encoding takes seconds a megabyte (npllm's BPE is Python), and a
    server would spend them on every such request. No token stands for more than tokenizer.longest_piece_bytes of
    the text's bytes, so a text of B bytes is at least ceil(B / that) tokens (Tokenizer.fewest_tokens); past that
    bound, an encoder that can stops as soon as the count passes the context (Tokenizer.encode_at_most)."""
    most = config.max_seq_len
    fewest = tokenizer.fewest_tokens(text)
    if fewest > most:
        raise GenerationError(f"the prompt has at least {fewest} tokens ({tokenizer.encoded_bytes(text)} bytes) but "
                              f"the model's context is {most} tokens")
    ids = tokenizer.encode_at_most(text, most, bos=bos)
    if ids is None:
        raise GenerationError(f"the prompt has more than {most} tokens, the model's context")
    check_prompt(config, ids)
    return ids


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Context:
    """One sequence (cache slot 0) of `model`, its tokens and its cache, under a context policy (module docstring).

    tokens[i] sits at position i - base (base > 0 only after "truncate" dropped a head). `prefilled` counts the
    tokens run through the model, recomputations included.
    """

    def __init__(self, model, policy: str = "error", sinks: int = DEFAULT_SINKS, capacity: int | None = None,
                 prefix_cache=None):
        check_policy(policy, sinks)
        self.model, self.policy, self.sinks = model, policy, int(sinks)
        self.cache = model.new_cache(model.config.max_seq_len if capacity is None else int(capacity))
        self.prefix = prefix_cache if prefix_cache is not None and prefix_cache.applies(self.cache) else None
        self.capacity = self.cache.capacity
        if policy == "sinks" and not isinstance(self.cache, RingKVCache):
            model.move_cached_keys(self.cache, 0, [], [], 0)  # the backend says why it cannot (cuda)
        if policy == "sinks" and self.sinks >= self.capacity:
            raise GenerationError(f"{self.sinks} sinks leave no room for a window in a cache of {self.capacity}")
        self.tokens: list[int] = []
        self.base = 0
        self.prefilled = 0
        self.restored = 0  # tokens taken from the prefix cache

    @property
    def positions_held(self) -> int:
        """How many of the sequence's positions have been written (the next token's position)."""
        return len(self.tokens) - self.base

    def reset(self) -> None:
        self.cache.reset()
        self.tokens, self.base = [], 0

    def prefill(self, ids) -> np.ndarray:
        """Make the sequence `ids`, reusing the cache for the longest common prefix.  # [N] -> hidden [1, D]

        At least the last token is run again (its hidden state is what the caller samples from)."""
        ids = [int(t) for t in ids]
        self.check(ids)
        keep = min(common_prefix(self.tokens, ids), len(ids) - 1)
        if keep < len(self.tokens):
            self._rewind(keep)
        if self.prefix is not None and not self.tokens:
            n = self.prefix.restore(self.cache, 0, ids)
            self.tokens, self.restored = ids[:n], self.restored + n
        hidden = self.feed(ids[len(self.tokens):])
        if self.prefix is not None and self.base == 0:  # a truncated head: positions are not token indices
            self.prefix.store(self.cache, 0, ids)  # stores only what the ring holds as a fresh prefill would
        return hidden

    def check(self, ids) -> None:
        """A prompt this context can start from (check_prompt; longer than the context only when its policy goes
        past the context)."""
        ids = [int(t) for t in ids]
        check_prompt(self.model.config, ids if self.policy == "error" else ids[:1])  # the others go past the context
        bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            check_prompt(self.model.config, bad[:1])  # its message names the ids outside the vocabulary

    @property
    def room(self) -> int | None:
        """The positions a sequence may fill here: the cache's under "error"; None (no end) for the policies that
        go past the context."""
        return self.capacity if self.policy == "error" else None

    def _rewind(self, length: int) -> None:
        """Forget tokens[length:]. The ring can go back only while it still holds everything before `length` in
        the layout a fresh run would give: never wrapped, sinks never moved, the truncation base not passed;
        otherwise the cache starts over (and the caller feeds the whole sequence again)."""
        wrapped = len(self.tokens) - self.base > self.capacity
        if wrapped or length < self.base or not hasattr(self.cache, "rewind"):
            self.reset()
            return
        self.cache.rewind(0, length - self.base)
        del self.tokens[length:]

    def feed(self, ids) -> np.ndarray:
        """Append tokens and run them through the model.               # [n] -> last hidden state [1, D]"""
        ids = [int(t) for t in ids]
        if not ids:
            raise GenerationError("nothing to feed")
        room = self.capacity - self.positions_held
        if len(ids) <= room:
            return self._forward(ids)
        if self.policy == "error":
            raise GenerationError(f"the sequence needs {self.positions_held + len(ids)} positions but the context "
                                  f"is {self.capacity} tokens (context_policy='truncate' or 'sinks' go past it)")
        if self.policy == "truncate":
            return self._recompute(self.tokens + ids)
        hidden = self._forward(ids[:room]) if room > 0 else None
        for token in ids[max(room, 0):]:
            self._slide_sinks()
            hidden = self._forward([token])
        return hidden

    def _forward(self, ids) -> np.ndarray:
        first = self.positions_held
        positions = np.arange(first, first + len(ids), dtype=np.int64)
        hidden = self.model.forward(np.asarray(ids, np.int64), positions, self.cache)
        self.tokens.extend(ids)
        self.prefilled += len(ids)
        return hidden[len(ids) - 1:len(ids)]  # [1, D]: a slice, so a GPU model keeps it on the device

    def _recompute(self, tokens: list[int]) -> np.ndarray:
        """"truncate": an empty cache, then the last capacity // 2 tokens at positions 0, 1, ..."""
        keep = max(1, self.capacity // 2)
        self.cache.reset()
        self.base = len(tokens) - keep
        self.tokens = tokens[:self.base]
        return self._forward(tokens[self.base:])

    def _slide_sinks(self) -> None:
        """Make room for position P = positions_held in a full ring: the window's oldest token leaves, each sink
        moves one entry forward, its key rotated one position further (see the module docstring)."""
        P, C, S = self.positions_held, self.capacity, self.sinks
        if S == 0:
            return  # a plain sliding window: the ring overwrites its oldest entry by itself
        src = (P - C + np.arange(S)) % C
        self.model.move_cached_keys(self.cache, 0, src, (src + 1) % C, 1)
