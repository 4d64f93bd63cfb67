# %% [markdown]
# # 06 · Generation and the KV cache
#
# A model maps a sequence to the logits of its *next* token. Generating text is a loop: sample a token, append it,
# run the model again. Run naively, step $n$ re-reads all $n$ tokens. But a token's keys and values never change
# once computed (causality: nothing later can affect them), so npllm keeps them in a **KV cache** and each new
# token costs one row of work:
#
# * **prefill**: the whole prompt in one forward, $[T, D]$ through every layer (matrix-matrix products);
# * **decode**: one token at a time, $[1, D]$, attending to the cached keys and values of everything before it.

# %%
import inspect
import os
import time
from pathlib import Path

# One BLAS thread (set before NumPy loads): for a model this small a second thread costs more than it saves, and
# on a busy machine idle BLAS threads turn the timings below into noise.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

import npllm
from npllm import generate
from npllm.cache import RingKVCache
from npllm.formats import read_checkpoint
from npllm.hub import embedded
from npllm.models.reference import Transformer
from npllm.tokenizer import load_tokenizer

# stories260K ships inside npllm: embedded() finds its checkpoint in the package (npllm/data/stories260K), and
# tok512.model, its 512 pieces as a SentencePiece model, sits beside it. No weights folder is needed.
CHECKPOINT, _ = embedded("stories260K")
TOK512_MODEL = CHECKPOINT.with_name("tok512.model")


def reference_file(relative: str) -> Path | None:
    """An optional reference file (not part of npllm): in $NPLLM_WEIGHTS, else in the repository's weights/ folder;
    None when neither has it."""
    for folder in (os.environ.get("NPLLM_WEIGHTS"), "../weights"):
        if folder and (Path(folder) / relative).is_file():
            return Path(folder) / relative
    return None


def show(obj):
    """Display the source of an npllm function as it is installed."""
    display(Markdown(f"```python\n{inspect.getsource(obj)}```"))


# The NumPy reference model (ops.py's stages wired together in models/reference.py): what these notebooks read.
config, weights = read_checkpoint(CHECKPOINT)
llm = npllm.LLM(Transformer(config, weights), load_tokenizer(TOK512_MODEL))
model, cfg = llm.model, llm.config

# %% [markdown]
# ## The loop
#
# `generate_ids` prefills the prompt once, then feeds back one token per step at the next position:

# %%
show(generate.generate_ids)

# %% [markdown]
# It reproduces llama2.c exactly: greedy decoding from BOS gives, token for token, the 200 tokens llama2.c's
# `run.c -t 0 -n 200` printed for this checkpoint (`greedy_200.txt`; not part of npllm, so the cell compares only
# where it finds the file, in `$NPLLM_WEIGHTS/stories260K/` or the repository's `weights/stories260K/`).

# %%
text = llm.generate("", max_new_tokens=200, temperature=0)
print(text[:300], "...")
golden = reference_file("stories260K/greedy_200.txt")
if golden is None:
    print("\n(greedy_200.txt not found, so not compared: it is what llama2.c's run.c prints for `run stories260K.bin "
          "-z tok512.bin -t 0 -n 200` (https://github.com/karpathy/llama2.c); put that output, trailing newline "
          "removed, in $NPLLM_WEIGHTS/stories260K/greedy_200.txt to compare)")
else:
    assert text == golden.read_text(encoding="utf-8")
    print(f"\nidentical to {golden.name}")

# %% [markdown]
# ## Prefill and decode compute the same function
#
# One prefill of $T$ tokens and $T$ single-token decode steps through the cache must give the same logits. In
# float64 they agree to rounding; in float32 the two differ by about $10^{-5}$, because BLAS rounds a
# matrix-matrix product (prefill) differently from a matrix-vector one (decode).

# %%
def prefill_and_decode(m, ids):
    """Logits of every position, once from a single prefill, once from len(ids) decode steps."""
    prefill = m.logits(ids)  # [T, V]
    cache = m.new_cache()
    decode = np.concatenate([m.lm_head(m.forward([t], [p], cache)) for p, t in enumerate(ids)])  # [T, V]
    return prefill, decode


ids = llm.tokenizer.encode(text, bos=True)[:128]
model64 = Transformer(cfg, {name: t.astype(np.float64) for name, t in weights.items()})
for name, m in (("float32", model), ("float64", model64)):
    prefill, decode = prefill_and_decode(m, ids)
    print(f"{name}: max |prefill - decode| over {len(ids)} positions x {cfg.vocab_size} logits = "
          f"{np.abs(prefill - decode).max():.1e}")
    assert np.abs(prefill - decode).max() <= (1e-9 if name == "float64" else 1e-4)

# %% [markdown]
# ## What the cache saves: measured
#
# Without a cache, producing the token after $n$ tokens means a forward over all $n$; with it, a forward over 1
# token plus attention over $n$ cached keys. Below, one step of each is timed at several lengths (the best of a few
# repeats, so expect some noise). The no-cache step grows at least linearly with $n$ (the projections and the FFN
# over $n$ rows; attention's $n \times n$ scores make it worse as $n$ grows), so its total over a generation grows
# quadratically or faster; the cached step stays nearly flat.

# %%
def best_time(fn, repeats=3):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


stream_ids = llm.tokenizer.encode(text, bos=True) * 2  # 402 tokens of text; what they say does not change the cost
lengths = [8, 32, 64, 128, 192, 256, 320, 400]
no_cache, with_cache = [], []
for n in lengths:
    context = stream_ids[:n]
    no_cache.append(best_time(lambda: model.logits(context)[-1]))  # a fresh forward over all n tokens
    cache = model.new_cache()

    def decode_step():
        cache.reset()
        model.forward(context[:-1], np.arange(n - 1), cache)  # the cache holds the first n - 1 tokens (untimed)
        start = time.perf_counter()
        model.lm_head(model.forward(context[-1:], [n - 1], cache))
        return time.perf_counter() - start

    with_cache.append(min(decode_step() for _ in range(3)))
    print(f"n = {n:3d}: no cache {1e3 * no_cache[-1]:7.2f} ms/token   KV cache {1e3 * with_cache[-1]:5.2f} ms/token")

n_axis = np.arange(1, 401)
# Fits of the per-step cost, never below the cheapest step measured: a + b n + c n^2 without the cache (n rows, then
# n x n attention scores), a + b n with it (one row against n cached keys).
fit_no = np.maximum(np.polyval(np.polyfit(lengths, no_cache, 2), n_axis), min(no_cache))
fit_kv = np.maximum(np.polyval(np.polyfit(lengths, with_cache, 1), n_axis), min(with_cache))
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.2))
ax0.plot(lengths, 1e3 * np.array(no_cache), "o", color="tab:red", label="no cache: forward over all n tokens")
ax0.plot(lengths, 1e3 * np.array(with_cache), "o", color="tab:green", label="KV cache: forward over 1 token")
ax0.plot(n_axis, 1e3 * fit_no, color="tab:red", alpha=0.4)
ax0.plot(n_axis, 1e3 * fit_kv, color="tab:green", alpha=0.4)
ax0.set_xlabel("tokens so far, n")
ax0.set_ylabel("ms for the next token")
ax0.legend()
ax0.set_title("cost of one step (measured; lines: fits)")
ax1.plot(n_axis, np.cumsum(fit_no), color="tab:red", label="no cache: n(n+1)/2 token-forwards")
ax1.plot(n_axis, np.cumsum(fit_kv), color="tab:green", label="KV cache: n token-forwards")
ax1.set_xlabel("tokens generated")
ax1.set_ylabel("seconds in total")
ax1.legend()
ax1.set_title("total cost of a generation (the sum of the fits)")
plt.tight_layout()
plt.show()
assert no_cache[-1] > with_cache[-1]

# %% [markdown]
# The same comparison for prompt processing: a prefill of $T$ tokens is one matrix-matrix pass over the weights;
# $T$ decode steps are $T$ matrix-vector passes. Both fill the same cache; prefill does it in one go.

# %%
for T in (16, 64, 128):
    prompt = stream_ids[:T]
    one_pass = best_time(lambda: model.forward(prompt, np.arange(T), model.new_cache()))

    def step_by_step():
        cache = model.new_cache()
        for p, t in enumerate(prompt):
            model.forward([t], [p], cache)

    steps = best_time(step_by_step)
    print(f"T = {T:3d}: prefill {T / one_pass:8,.0f} tok/s   decode steps {T / steps:6,.0f} tok/s")

# %% [markdown]
# ## The ring buffer
#
# npllm's cache has a fixed capacity $C$ per sequence slot: position $p$ lives at ring index $p \bmod C$, so memory
# never grows. Once $p \ge C$ the oldest entry is overwritten and attention sees the last $C$ positions: a sliding
# window. Keys are stored already rotated by RoPE, so an entry never needs recomputing.
#
# $$\text{memory} = 2 \cdot L \cdot C \cdot K \cdot D_h \cdot \text{bytes per number}$$

# %%
show(RingKVCache.write)
show(RingKVCache.read)
full = model.new_cache()
print(f"stories260K, C = {full.capacity}: {full.nbytes / 2**10:.0f} KiB "
      f"(= 2 x {cfg.n_layers} layers x {full.capacity} x {cfg.n_kv_heads} kv heads x {cfg.head_dim} x 4 bytes)")
assert full.nbytes == 2 * cfg.n_layers * full.capacity * cfg.n_kv_heads * cfg.head_dim * 4
print(f"Llama 2 7B at C = 4096 in float16: {2 * 32 * 4096 * 32 * 128 * 2 / 2**30:.1f} GiB per sequence")

# %% [markdown]
# A ring of capacity 8, fed 20 decode steps of the real model. Each row is the ring after one step; the number in a
# cell is the position that index holds, the framed cell the one just written.

# %%
C, steps = 8, 20
ring = model.new_cache(capacity=C)
snapshots = []
for p, t in enumerate(stream_ids[:steps]):
    model.forward([t], [p], ring)
    snapshots.append(ring.positions[0].copy())
    assert ring.positions[0, p % C] == p  # position p sits at index p mod C
snapshots = np.array(snapshots)  # [steps, C], -1 = empty

fig, ax = plt.subplots(figsize=(7, 8))
ax.imshow(np.where(snapshots < 0, np.nan, snapshots // C), cmap="Pastel2", aspect="auto", vmin=0, vmax=7)
for step in range(steps):
    for index in range(C):
        held = snapshots[step, index]
        ax.text(index, step, "" if held < 0 else str(held), ha="center", va="center", fontsize=9,
                weight="bold" if held == step else "normal")
    ax.add_patch(plt.Rectangle((step % C - 0.5, step - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.5))
ax.set_xticks(range(C), [f"index {i}" for i in range(C)], fontsize=8)
ax.set_yticks(range(steps), [f"after position {s}" for s in range(steps)], fontsize=8)
ax.set_title(f"RingKVCache, capacity {C}: position p at index p mod {C}\n(colour: which lap of the ring)")
plt.tight_layout()
plt.show()

# %% [markdown]
# Past position 7 the ring holds the last 8 positions only. `read` returns them oldest first, so a decode step at
# position 19 attends to positions 12-19: what a sliding-window model such as Mistral does by design, and what a
# model trained for full attention does only once its context outgrows the ring.

# %%
_, _, seen = ring.read(0, 0)
print("positions a query at position 19 can attend to:", seen)
assert list(seen) == list(range(steps - C, steps))
