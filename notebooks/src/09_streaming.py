# %% [markdown]
# # 09 · Past the context: attention sinks (StreamingLLM) on stories260K
#
# A KV cache of $C$ positions holds $C$ tokens. To generate, or read, past that, something has to leave. Xiao et al.
# (2023, *Efficient Streaming Language Models with Attention Sinks*) compare three ways (their figure 3):
#
# * **sliding window with recomputation**: predict each token from a *fresh* run over the last $C$ tokens. Exact
#   for a window, but $O(C)$ forward work per token instead of $O(1)$.
# * **window attention**: keep the KV states of the last $C$ tokens, each computed once (npllm's ring cache does
#   exactly this when a position wraps). Cheap, but on Llama-2 the perplexity explodes as soon as the *first*
#   tokens leave the cache.
# * **StreamingLLM**: keep the first $S = 4$ tokens (the *attention sinks*, where heads with nothing to look at
#   park their attention) and the last $C - S$; positions are assigned inside the cache.
#
# npllm implements the last one as `context_policy="sinks"` (`npllm.context`), and the comparison as
# `npllm.evaluate.streaming_nll`. This notebook runs both on stories260K and sets what we measure beside what the
# paper reports.

# %%
import inspect
import os
import time

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # small model: one BLAS thread is faster and steadier

import npllm
from npllm import ops
from npllm.context import Context
from npllm.evaluate import streaming_nll
from npllm.models.base import Model

llm = npllm.load("stories260K")  # the copy shipped inside npllm, with its llama2.c tokenizer (tok512.bin)
model, cfg = llm.model, llm.config


def show(obj):
    """Display the source of an npllm function as it is installed."""
    display(Markdown(f"```python\n{inspect.getsource(obj)}```"))


print(f"stories260K: context {cfg.max_seq_len} tokens, {cfg.n_layers} layers, {cfg.n_heads} heads, "
      f"head dim {cfg.head_dim}")

# %% [markdown]
# ## Positions inside the cache, with keys that are already rotated
#
# StreamingLLM numbers positions *inside* the cache: sink $i$ at $i$, the window right after. npllm caches keys
# already rotated by RoPE to their absolute position, and within the window absolute distances already are the
# in-cache ones. Only the sinks must look as if they sat just before the window's oldest token, so each time the
# window slides, each sink key is rotated one more position, $R(p+1)k = R(1)R(p)k$, and moved one ring entry
# forward. The backend provides only its key layout (the Numba model caches keys with interleaved pairs, the
# reference in the checkpoint's layout):

# %%
show(Context._slide_sinks)
show(Model.move_cached_keys)

# %% [markdown]
# The check that matters: after the window has slid, the sink entries hold the keys the sink tokens get when run
# fresh at the positions they were moved to (every layer).

# %%
C, S = 32, 4
ids = llm.tokenizer.encode("Once upon a time, there was a little girl named Lily. She liked to play in the park "
                           "with her dog. One day, the dog saw a big red ball and ran after it very fast.")
context = Context(model, "sinks", S, capacity=C)
for t in ids:
    context.feed([t])
first = len(ids) - C
ring = np.arange(first, first + S) % C
fresh = model.new_cache(C)
model.forward(np.array(ids[:S]), np.arange(first, first + S), fresh)
gap = np.abs(context.cache.k[:, 0, ring] - fresh.k[:, 0, ring]).max()
print(f"{len(ids)} tokens through a {C}-entry ring: the window slid {len(ids) - C} times; sinks now at positions "
      f"{context.cache.positions[0, ring].tolist()}; largest key difference from a fresh run {gap:.1e}")
assert gap < 1e-4

# %% [markdown]
# ## 1,500 tokens from a 512-token model, memory bounded by the cache

# %%
counted = []
start = time.perf_counter()
text = llm.generate("Once upon a time", max_new_tokens=1500, ignore_eos=True, context_policy="sinks",
                    temperature=0.8, seed=1, on_step=counted.append)
seconds = time.perf_counter() - start
held = Context(model, "sinks").cache.nbytes
print(f"{len(counted)} tokens in {seconds:.1f} s; KV cache {held / 1024:.0f} KiB whatever the length "
      f"({cfg.max_seq_len} positions)")
print("...", text[-400:])
assert len(counted) == 1500

# %% [markdown]
# ## The figure: log-perplexity per position over a text 16 windows long
#
# The text: stories sampled from stories260K itself (temperature 1, seeds 0, 1, 2, ...), run together with no BOS
# between them, 768 tokens, BOS only at the very start, as one long document. The memory is a **48-token**
# window rather than the model's 512: full-context recomputation over a text several contexts long costs
# $O(N \cdot C)$ forward work (minutes on this machine), while a 48-token window gives 16 windows' worth of text in
# seconds, and the question (does anything break once the first tokens leave?) is the same.

# %%
N, W = 768, 48
text_ids = [cfg.bos_id]
seed = 0
while len(text_ids) < N:
    text_ids += list(llm.generate_ids([cfg.bos_id], 400, temperature=1.0, seed=seed))
    seed += 1
text_ids = np.array(text_ids[:N])
curves, times = {}, {}
for policy in ("recompute", "window", "sinks"):
    start = time.perf_counter()
    curves[policy] = streaming_nll(model, text_ids, W, policy, sinks=4)
    times[policy] = time.perf_counter() - start
    print(f"{policy:9s} {times[policy]:5.1f} s")

# %%
def rolling(x, n=32):
    return np.convolve(x, np.ones(n) / n, mode="valid")


fig, ax = plt.subplots(figsize=(9, 4))
styles = {"recompute": ("sliding window, recomputed", "k", "-"), "window": ("window attention (no sinks)", "C3", "-"),
          "sinks": ("StreamingLLM: 4 sinks + 44 recent", "C0", "--")}
for policy, nll in curves.items():
    label, colour, line = styles[policy]
    ax.plot(np.arange(len(rolling(nll))) + 32, rolling(nll), line, color=colour, label=label, lw=1.3)
ax.axvline(W, color="grey", lw=0.8, ls=":")
ax.text(W + 5, ax.get_ylim()[1] * 0.97, "first token leaves the window", va="top", fontsize=8, color="grey")
ax.set_xlabel("position in the text")
ax.set_ylabel("log-perplexity (mean NLL over 32 tokens)")
ax.set_title(f"stories260K, {N} tokens, memory of {W} tokens")
ax.legend(loc="upper right", fontsize=8)
plt.tight_layout()
plt.show()

# %%
after = {p: float(c[W:].mean()) for p, c in curves.items()}
rows = [f"| memory | mean NLL, positions < {W} | mean NLL, positions >= {W} | PPL >= {W} | time |", "|---|---|---|---|---|"]
for p, c in curves.items():
    rows.append(f"| {styles[p][0]} | {c[:W].mean():.3f} | {after[p]:.3f} | {np.exp(after[p]):.2f} | "
                f"{times[p]:.1f} s |")
display(Markdown("\n".join(rows)))
assert np.allclose(curves["window"][:W], curves["recompute"][:W], atol=1e-5)  # same until something leaves
assert abs(after["sinks"] - after["recompute"]) < 0.1  # StreamingLLM stays with the recomputed window

# %% [markdown]
# ## Why window attention does not collapse here
#
# Record `ops.attention` in the NumPy reference over 256 tokens and measure how much attention each layer's
# queries (positions 64 and later) give to position 0, the BOS token:

# %%
ref = npllm.load("stories260K", backend="numpy").model
calls, original = [], ops.attention


def recording_attention(q, k, v, mask, *options):  # options: the score scale and soft-cap some families set
    calls.append((q, k, mask))
    return original(q, k, v, mask, *options)


ops.attention = recording_attention
try:
    ref.forward(text_ids[:256], np.arange(256), ref.new_cache())
finally:
    ops.attention = original
H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
to_first = []
for q, k, mask in calls:
    weights = np.stack([ops.softmax(q[:, h] @ k[:, h // (H // K)].T / np.sqrt(Dh) + mask) for h in range(H)])
    to_first.append(weights[:, 64:, 0].mean(axis=1))  # [H]: mean weight on position 0 of queries 64..255
to_first = np.array(to_first)  # [L, H]
uniform = np.mean(1 / np.arange(65, 257))
print("mean attention on position 0, layer x head (queries 64..255):")
print(np.array2string(to_first, precision=3))
print(f"a uniform head would give {uniform:.4f}")

# %% [markdown]
# ## What we measured, against what the paper reports
#
# **The paper** (Llama-2, Falcon, Pythia, MPT; 7B to 70B; PG19 books, 20K tokens, cache 1,024-4,096): window
# attention's perplexity explodes (to the hundreds and thousands) once the text passes the cache size and the first
# tokens are evicted; StreamingLLM with 4 sinks tracks the sliding window with recomputation within a few tenths of
# perplexity, at constant cost per token; the recomputed window is the quality reference but is orders of
# magnitude slower.
#
# **stories260K** (260K parameters, 5 layers; llama2.c trains it on random 512-token slices of the concatenated
# stories, so the token at a window's position 0 is usually from the middle of a story):
#
# * StreamingLLM stays with the recomputed window, as in the paper (the table: within 0.1 nat of mean NLL, asserted;
#   measured 1.499 against 1.449 on this text), at the window's cost per token, and decodes 1,500 tokens from a
#   512-token model in a fixed 640 KiB cache.
# * Window attention does **not** collapse here: its curve stays with the recomputed one (1.443), slightly *below*
#   StreamingLLM's, which spends 4 of its 48 entries on tokens this model does not use. The attention table shows
#   why: nearly every head gives position 0 *less* than a uniform head would (largest share 0.016 against 0.007),
#   so evicting it takes nothing away. The model has not learnt the sink heads that make large models depend on
#   their first tokens (its training windows start anywhere), and the collapse the paper shows is a property of
#   those models that this checkpoint cannot reproduce.
# * Recomputation is the slow one, as in the paper (the times in the table), even with a window of only 48 tokens.
#
# The machine was shared with other jobs while this ran; the times are indicative.
