"""Evaluation: how well a model predicts a text (perplexity), and how far one model's predictions are from another's.

Perplexity is exp(mean negative log-likelihood) of the text's tokens, each predicted from the tokens before it:

    PPL = exp( -1/N * sum_i log p(x_i | x_<i) )

Which tokens are scored, with how much context, decides the number, so two engines agree only if they cut the text
the same way. npllm follows llama.cpp's `llama-perplexity` exactly:

    tokens = tokenize(text) with BOS in front
    chunks = tokens cut into n = len(tokens) // ctx pieces of ctx tokens (the tail is dropped)
    each chunk: its first token is replaced by BOS, the chunk runs on a fresh cache, and only the second half is
                scored: logits at positions first .. ctx-2 (first = ctx // 2) predict tokens first+1 .. ctx-1
    PPL = exp(mean nll),  stderr = PPL * sqrt((mean(nll^2) - mean(nll)^2) / (N - 1))

Scoring only the second half means every scored token sees at least ctx/2 tokens of context. The Hugging Face
"strided" method (`strided_perplexity`) instead slides a window of max_length tokens by `stride` and scores the
tokens each window adds, so a token sees up to max_length - stride tokens of context.

The KL divergence between a base model P and a model Q (a quantized file, say) at each scored position is
    KL(P || Q) = sum_v P(v) * (log P(v) - log Q(v)),
averaged over positions, with the share of positions where both models' most probable tokens agree (top-1
agreement): the figures llama.cpp's `--kl-divergence` reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np

from .errors import GenerationError
from .sampling import log_softmax


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    ppl_stderr: float
    tokens: int  # tokens scored (the N of the mean)
    chunks: int  # chunks (llama.cpp method) or windows (strided method)
    seconds: float
    method: str  # "llama.cpp" or "strided"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Divergence:
    mean_kl: float  # mean over scored positions of KL(base || model), in nats
    kl_stderr: float
    top1_agreement: float  # share of positions where both argmaxes agree
    ppl: float  # the model's perplexity on the same positions
    base_ppl: float
    tokens: int
    chunks: int
    seconds: float
    decisive_agreement: float  # top-1 agreement where the base's top logit leads its second by >= DECISIVE_LEAD
    decisive: int  # how many such positions (a near-tie's argmax is a coin toss between two ids)

    def as_dict(self) -> dict:
        return asdict(self)


DECISIVE_LEAD = 0.1  # logits


def llama_cpp_chunks(token_ids, ctx: int, bos_id: int) -> np.ndarray:
    """The text cut as llama.cpp cuts it: [n_chunks, ctx] token ids, each chunk's first id replaced by BOS."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    if ctx < 4:
        raise GenerationError(f"ctx must be at least 4 tokens (half of each chunk is scored), got {ctx}")
    if len(tokens) < 2 * ctx:
        raise GenerationError(f"the text has {len(tokens)} tokens; perplexity with ctx {ctx} needs at least "
                              f"{2 * ctx} (two chunks): give a longer text or a smaller --ctx")
    chunks = tokens[: len(tokens) // ctx * ctx].reshape(-1, ctx).copy()
    chunks[:, 0] = bos_id
    return chunks


def scored_logits(model, chunks: np.ndarray, batch: int = 1) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """For groups of `batch` chunks run together (one cache slot each): the logits at the scored positions and the
    tokens they predict.        # [n_chunks, ctx] -> yields ([b * n, V], [b * n]), n = ctx - 1 - ctx // 2"""
    n_chunks, ctx = chunks.shape
    first = ctx // 2
    if batch < 1:
        raise GenerationError(f"batch must be at least 1, got {batch}")
    if ctx > model.config.max_seq_len:
        raise GenerationError(f"ctx {ctx} is longer than the model's context ({model.config.max_seq_len})")
    for start in range(0, n_chunks, batch):
        group = chunks[start: start + batch]  # [b, ctx]
        b = len(group)
        cache = model.new_cache(capacity=ctx, slots=b)
        positions = np.tile(np.arange(ctx), b)  # [b * ctx]
        slots = np.repeat(np.arange(b), ctx)
        hidden = model.forward(group.reshape(-1), positions, cache, slots)  # [b * ctx, D]
        rows = (np.arange(b)[:, None] * ctx + np.arange(first, ctx - 1)[None, :]).reshape(-1)  # scored positions
        yield np.asarray(model.lm_head(hidden[rows]), dtype=np.float64), group.reshape(-1)[rows + 1]


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row.       # [N, V], [N] -> [N] float64"""
    return -log_softmax(logits)[np.arange(len(targets)), targets]


def _mean_and_stderr(values: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error, sqrt((E[x^2] - E[x]^2) / (N - 1)) as llama.cpp states it; the variance is
    summed as E[(x - mean)^2], the same number without the cancellation of two large terms."""
    mean = float(values.mean())
    variance = float(((values - mean) ** 2).mean())
    return mean, (float(np.sqrt(variance / (len(values) - 1))) if len(values) > 1 else 0.0)


def perplexity(model, token_ids, ctx: int, batch: int = 1, bos_id: int | None = None,
               progress: bool = False) -> Perplexity:
    """Perplexity of a tokenized text by llama.cpp's method (see the module docstring)."""
    start = time.perf_counter()
    bos = model.config.bos_id if bos_id is None else bos_id
    chunks = llama_cpp_chunks(token_ids, ctx, bos)
    return perplexity_of(chunk_nll(model, chunks, batch, progress), time.perf_counter() - start)


def chunk_nll(model, chunks: np.ndarray, batch: int = 1, progress: bool = False) -> np.ndarray:
    """-log p of each scored token of each chunk, `batch` chunks per forward call (the rows do not depend on which
    chunks share a call).               # [n_chunks, ctx] -> [n_chunks, n] float64, n = ctx - 1 - ctx // 2"""
    n_chunks, ctx = chunks.shape
    nll = [_nll(logits, targets) for logits, targets in
           _progress(scored_logits(model, chunks, batch), n_chunks, batch, progress)]
    return np.concatenate(nll).reshape(n_chunks, ctx - 1 - ctx // 2)


def perplexity_of(nll: np.ndarray, seconds: float = 0.0) -> Perplexity:
    """llama.cpp's figures from the chunks' scored tokens in chunk order: PPL = exp(mean nll) and its standard
    error (the module docstring).                                                         # [n_chunks, n] -> Perplexity"""
    values = np.asarray(nll, dtype=np.float64).reshape(-1)
    mean, stderr = _mean_and_stderr(values)
    ppl = float(np.exp(mean))
    return Perplexity(ppl, ppl * stderr, len(values), len(nll), seconds, "llama.cpp")


def kl_divergence(model, base, token_ids, ctx: int, batch: int = 1, bos_id: int | None = None,
                  progress: bool = False) -> Divergence:
    """KL(base || model) and top-1 agreement over the positions perplexity() scores."""
    if model.config.vocab_size != base.config.vocab_size:
        raise GenerationError(f"the models' vocabularies differ ({model.config.vocab_size} and "
                              f"{base.config.vocab_size} ids): their distributions cannot be compared")
    start = time.perf_counter()
    chunks = llama_cpp_chunks(token_ids, ctx, base.config.bos_id if bos_id is None else bos_id)
    kl, agree, nll, base_nll, decisive = [], [], [], [], []
    pairs = zip(scored_logits(model, chunks, batch), scored_logits(base, chunks, batch))
    for (q_logits, targets), (p_logits, _) in _progress(pairs, len(chunks), batch, progress):
        log_q, log_p = log_softmax(q_logits), log_softmax(p_logits)  # [N, V] each
        kl.append((np.exp(log_p) * (log_p - log_q)).sum(axis=-1))
        agree.append(q_logits.argmax(axis=-1) == p_logits.argmax(axis=-1))
        second, first = np.partition(p_logits, -2, axis=-1)[:, -2:].T
        decisive.append(first - second >= DECISIVE_LEAD)
        nll.append(-log_q[np.arange(len(targets)), targets])
        base_nll.append(-log_p[np.arange(len(targets)), targets])
    kl_all, agree, decisive = np.concatenate(kl), np.concatenate(agree), np.concatenate(decisive)
    mean, stderr = _mean_and_stderr(kl_all)
    return Divergence(mean, stderr, float(agree.mean()), float(np.exp(np.concatenate(nll).mean())),
                      float(np.exp(np.concatenate(base_nll).mean())), len(kl_all), len(chunks),
                      time.perf_counter() - start, float(agree[decisive].mean()) if decisive.any() else float("nan"),
                      int(decisive.sum()))


def strided_windows(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """Hugging Face's sliding windows: (begin, end, first scored position) for each window. Window w covers
    tokens [begin, end) and scores the tokens it adds beyond the previous window's end, except its first token,
    which nothing in the window predicts: with stride < max_length every token after the first is scored once;
    with stride == max_length (windows that do not overlap) each window's first token goes unscored, as in
    Hugging Face's own loop."""
    if max_length < 2:
        raise GenerationError(f"windows need at least 2 tokens (one predicts the next), got {max_length}")
    if not 1 <= stride <= max_length:
        raise GenerationError(f"stride must lie in [1, max_length = {max_length}], got {stride}")
    if n_tokens < 2:
        raise GenerationError(f"the text has {n_tokens} tokens; at least 2 are needed to score one")
    windows, previous_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        windows.append((begin, end, max(previous_end, begin + 1)))
        previous_end = end
        if end == n_tokens:
            break
    return windows


def strided_perplexity(model, token_ids, max_length: int, stride: int, progress: bool = False) -> Perplexity:
    """Perplexity by Hugging Face's strided method: windows of max_length tokens, `stride` apart."""
    start = time.perf_counter()
    tokens = np.asarray(token_ids, dtype=np.int64)
    if max_length > model.config.max_seq_len:
        raise GenerationError(f"max_length {max_length} is longer than the model's context "
                              f"({model.config.max_seq_len})")
    windows = strided_windows(len(tokens), max_length, stride)
    nll = []
    for begin, end, first in _progress(windows, len(windows), 1, progress):
        hidden = model.forward(tokens[begin:end], np.arange(end - begin), model.new_cache(capacity=end - begin))
        rows = np.arange(first - 1, end - 1) - begin  # logits at t - 1 predict token t
        nll.append(_nll(np.asarray(model.lm_head(hidden[rows]), np.float64), tokens[first:end]))
    values = np.concatenate(nll)
    mean, stderr = _mean_and_stderr(values)
    ppl = float(np.exp(mean))
    return Perplexity(ppl, ppl * stderr, len(values), len(windows), time.perf_counter() - start, "strided")


def _progress(items, chunks: int, batch: int, enabled: bool):
    """A tqdm bar on stderr counting chunks, when enabled."""
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, total=-(-chunks // batch), unit="batch", desc=f"{chunks} chunks", leave=False)


# ----------------------------------------------------------------------------------------------------------------
# Streaming: a text longer than the cache, token by token (StreamingLLM's figure)
# ----------------------------------------------------------------------------------------------------------------

STREAMING_POLICIES = ("recompute", "window", "sinks")


def streaming_nll(model, token_ids, window: int, policy: str, sinks: int = 4, batch: int = 32) -> np.ndarray:
    """Negative log-likelihood of every token after the first, each predicted with a bounded memory of `window`
    tokens, the way StreamingLLM (Xiao et al. 2023, figure 3) compares them:     # [N] ids -> [N - 1] nll

        "recompute"  sliding window with recomputation: token i is predicted from a fresh run over the last
                     `window` tokens (positions 0 .. window-1); exact but O(window) work per token
        "window"     window attention: the KV cache keeps the last `window` tokens, computed once each (a ring
                     that overwrites its oldest entry; no sinks)
        "sinks"      the cache keeps the first `sinks` tokens and the last window - sinks (npllm.context "sinks")

    The first `window` predictions are the same for all three (nothing has left the memory yet). "recompute" runs
    `batch` windows per forward call, each in its own cache slot (the same numbers, fewer passes over the weights).
    """
    from .context import Context

    if policy not in STREAMING_POLICIES:
        raise GenerationError(f"policy must be one of {', '.join(STREAMING_POLICIES)}, got {policy!r}")
    ids = np.asarray(token_ids, dtype=np.int64)
    if len(ids) < 2 or window < 2:
        raise GenerationError(f"need at least 2 tokens and a window of at least 2, got {len(ids)} and {window}")
    nll = np.empty(len(ids) - 1)
    head = min(window, len(ids) - 1)  # predictions made before anything leaves the memory: one causal run
    nll[:head] = _nll(model.logits(ids[:head]), ids[1:head + 1])
    if policy == "recompute":
        nll[head:] = _recomputed_nll(model, ids, window, head, batch)
        return nll
    context = Context(model, "sinks", sinks if policy == "sinks" else 0, capacity=window)
    context.feed(ids[:head])
    for i in range(head, len(ids) - 1):
        hidden = context.feed(ids[i:i + 1])
        nll[i] = _nll(model.lm_head(hidden), ids[i + 1:i + 2])[0]
    return nll


def _recomputed_nll(model, ids: np.ndarray, window: int, first: int, batch: int) -> np.ndarray:
    """nll of ids[i + 1] from a fresh run over ids[i - window + 1 .. i], for i = first .. len(ids) - 2, `batch`
    windows per forward call (window b in cache slot b, positions 0 .. window-1).       # -> [len(ids) - 1 - first]"""
    ends = np.arange(first, len(ids) - 1)
    out = np.empty(len(ends))
    cache = model.new_cache(window, slots=min(batch, len(ends)) or 1)
    for at in range(0, len(ends), batch):
        group = ends[at:at + batch]
        tokens = np.concatenate([ids[i - window + 1:i + 1] for i in group])  # [b * window]
        positions = np.tile(np.arange(window), len(group))
        slots = np.repeat(np.arange(len(group)), window)
        cache.reset()
        hidden = model.forward(tokens, positions, cache, slots)
        last = np.arange(1, len(group) + 1) * window - 1  # each window's last token
        out[at:at + len(group)] = _nll(model.lm_head(np.asarray(hidden)[last]), ids[group + 1])
    return out
