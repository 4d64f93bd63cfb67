# %% [markdown]
# # 03 · Attention: which earlier tokens each token reads
#
# For every head $h$ (with $g = h \,/\!/\, (H/K)$ its key/value head):
#
# $$\mathrm{out}_h = \mathrm{softmax}\!\left(\frac{q_h k_g^\top}{\sqrt{D_h}} + M\right) v_g,
# \qquad M_{ts} = \begin{cases} 0 & s \le t \\ -\infty & s > t \end{cases}$$
#
# The mask $M$ is arithmetic, not control flow: $e^{-\infty} = 0$, so a future key gets exactly zero weight.
# Below, the real `stories260K` model runs a prompt, and we listen in on its own calls to `ops.attention` to draw
# what every head attends to.

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

import npllm
from npllm import ops
from npllm.formats import read_checkpoint
from npllm.hub import embedded
from npllm.models.reference import Transformer
from npllm.tokenizer import load_tokenizer

# stories260K ships inside npllm: embedded() finds its checkpoint in the package (npllm/data/stories260K), and
# tok512.model, its 512 pieces as a SentencePiece model, sits beside it. No weights folder is needed.
CHECKPOINT, _ = embedded("stories260K")
TOK512_MODEL = CHECKPOINT.with_name("tok512.model")


def show(obj):
    """Display the source of an npllm function as it is installed."""
    display(Markdown(f"```python\n{inspect.getsource(obj)}```"))


# The NumPy reference model (ops.py's stages wired together in models/reference.py): what these notebooks read.
config, weights = read_checkpoint(CHECKPOINT)
llm = npllm.LLM(Transformer(config, weights), load_tokenizer(TOK512_MODEL))
model, cfg = llm.model, llm.config
H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
print(f"{cfg.n_layers} layers, H = {H} query heads, K = {K} key/value heads (each serves H/K = {H // K}), Dh = {Dh}")

# %% [markdown]
# ## Softmax, and the seed's numbers
#
# $\mathrm{softmax}(x)_i = e^{x_i - \max x} / \sum_j e^{x_j - \max x}$: subtracting the maximum changes nothing but
# keeps `exp` from overflowing. Only differences between scores matter, so `[11, 12, 13]` is as peaked as
# `[0, 1, 2]`, while `[0.01, 0.02, 0.03]` is almost uniform.

# %%
show(ops.softmax)
a = ops.softmax(np.array([11.0, 12.0, 13.0]))
b = ops.softmax(np.array([0.01, 0.02, 0.03]))
print("softmax([11, 12, 13])       =", a.round(4))
print("softmax([0.01, 0.02, 0.03]) =", b.round(4))
assert np.allclose(a, [0.0900, 0.2447, 0.6652], atol=5e-5)  # the seed's table
assert np.allclose(b, [0.3300, 0.3333, 0.3367], atol=5e-5)
assert np.allclose(ops.softmax(np.array([0.0, 1.0, 2.0])), a)  # shift invariance
print("softmax([1000, 1001, 1002]) =", ops.softmax(np.array([1000.0, 1001.0, 1002.0])).round(4), "(no overflow)")

# %%
show(ops.attention_mask)
show(ops.attention)

# %% [markdown]
# ## Listening in on the model
#
# `Transformer.attention_block` calls `ops.attention(q, keys, values, mask)` once per layer. Wrapping that function
# for the length of one forward records exactly the arrays the model used.

# %%
PROMPT = "Once upon a time, there was a little cat named Tom. Tom liked to play"
ids = llm.tokenizer.encode(PROMPT, bos=True)
labels = [llm.tokenizer.id_to_piece(i).replace("▁", " ") for i in ids]
T = len(ids)

calls = []
original = ops.attention


def recording_attention(q, k, v, mask, *options):  # options: the score scale and soft-cap some families set
    out = original(q, k, v, mask, *options)
    calls.append({"q": q, "k": k, "v": v, "mask": mask, "out": out})
    return out


ops.attention = recording_attention
try:
    hidden = model.forward(ids, np.arange(T), model.new_cache())
finally:
    ops.attention = original
assert len(calls) == cfg.n_layers
print(f"{T} tokens; recorded {len(calls)} attention calls: q {calls[0]['q'].shape}, k {calls[0]['k'].shape}, "
      f"mask {calls[0]['mask'].shape}")

# %% [markdown]
# The weights themselves are never returned by `ops.attention` (it only needs their product with $v$), so we
# recompute them here the straight way, one head at a time, and check that multiplying by $v$ gives back the
# model's own output.

# %%
def attention_weights(call):
    """[H, T, S] softmax(q_h k_g^T / sqrt(Dh) + mask) for each head h, g = h // (H / K)."""
    q, k, mask = call["q"], call["k"], call["mask"]
    scores = np.stack([q[:, h] @ k[:, h // (H // K)].T / np.sqrt(Dh) + mask for h in range(H)])
    return scores, ops.softmax(scores)


for layer, call in enumerate(calls):
    scores, weights = attention_weights(call)
    out = np.stack([weights[h] @ call["v"][:, h // (H // K)] for h in range(H)], axis=1)  # [T, H, Dh]
    assert np.allclose(out, call["out"], atol=1e-5), layer  # the straight computation reproduces ops.attention
    assert np.allclose(weights.sum(-1), 1, atol=1e-6)  # every row is a distribution
    assert np.all(weights[:, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)  # nothing from the future
print("per-head recomputation == ops.attention in all layers; rows sum to 1; the future gets weight 0")

# %% [markdown]
# ## The causal-mask table
#
# The seed shows the mask as a table: raw scores with $-\infty$ above the diagonal, then the softmax of each row.
# Here it is for the first tokens of the prompt, layer 0, head 0, computed from the real model:

# %%
n = 7
scores, weights = attention_weights(calls[0])


def table(matrix, fmt):
    head = "| query \\ key | " + " | ".join(f"`{l}`" for l in labels[:n]) + " |"
    rule = "|---" * (n + 1) + "|"
    body = [f"| `{labels[t]}` | " + " | ".join(fmt(matrix[t, s]) for s in range(n)) + " |" for t in range(n)]
    return "\n".join([head, rule] + body)


display(Markdown("**scores** $q k^\\top/\\sqrt{D_h} + M$\n\n"
                 + table(scores[0], lambda x: "−∞" if np.isneginf(x) else f"{x:.2f}")))
display(Markdown("**softmax of each row** (each sums to 1)\n\n" + table(weights[0], lambda x: f"{x:.3f}")))
# Row 0 (BOS) can only see itself; every row is a distribution over its own past.
assert weights[0, 0, 0] == 1.0 and np.isneginf(scores[0, 0, 1:]).all()

# %% [markdown]
# ## Every head of a layer
#
# The same prompt, all 8 heads of layer 2. Rows are queries, columns keys; the upper triangle is the mask's zero.
# Some heads look at the previous token, some back at BOS (a "sink" that absorbs attention when nothing else is
# relevant), some spread out.

# %%
LAYER = 2
_, weights = attention_weights(calls[LAYER])
fig, axes = plt.subplots(2, 4, figsize=(16, 8.4))
for h, ax in enumerate(axes.flat):
    ax.imshow(weights[h], cmap="Blues", vmin=0, vmax=1)
    ax.set_title(f"layer {LAYER}, head {h} (kv head {h // (H // K)})", fontsize=10)
    ax.set_xticks(range(T), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(T), labels, fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# And every layer at a glance (no labels): a row per layer, a column per head.

# %%
fig, axes = plt.subplots(cfg.n_layers, H, figsize=(16, 10))
for layer, call in enumerate(calls):
    _, weights = attention_weights(call)
    for h in range(H):
        ax = axes[layer, h]
        ax.imshow(weights[h], cmap="Blues", vmin=0, vmax=1)
        ax.set_xticks([])
        ax.set_yticks([])
        if layer == 0:
            ax.set_title(f"head {h}", fontsize=9)
        if h == 0:
            ax.set_ylabel(f"layer {layer}")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Grouped-query attention
#
# This model has $H = 8$ query heads but only $K = 4$ key/value heads: heads $2g$ and $2g+1$ share key/value
# head $g$. The cache stores $K$ heads, not $H$ — half the memory here, an 8× saving for Llama 2 70B
# (64 query heads, 8 KV heads). `ops.attention` reshapes the queries into $K$ groups instead of copying keys, and
# gives exactly what multi-head attention over repeated key/value heads gives:

# %%
call = calls[LAYER]
G = H // K
mha = original(call["q"], np.repeat(call["k"], G, axis=1), np.repeat(call["v"], G, axis=1), call["mask"])
assert np.allclose(mha, call["out"], atol=1e-6)
print(f"GQA output == MHA with each kv head repeated {G}x; cache per token per layer: {2 * K * Dh} floats "
      f"instead of {2 * H * Dh}")

fig, ax = plt.subplots(figsize=(10, 3))
for h in range(H):
    ax.add_patch(plt.Rectangle((h * 1.2, 2), 1, 0.8, facecolor=plt.cm.tab10(h // G), alpha=0.5))
    ax.text(h * 1.2 + 0.5, 2.4, f"q head {h}", ha="center", va="center", fontsize=9)
    g = h // G
    x_kv = g * 2.4 + 0.6
    ax.annotate("", xy=(x_kv + 0.5, 0.8), xytext=(h * 1.2 + 0.5, 2), arrowprops=dict(arrowstyle="->", color="grey"))
for g in range(K):
    ax.add_patch(plt.Rectangle((g * 2.4 + 0.6, 0), 1, 0.8, facecolor=plt.cm.tab10(g), alpha=0.8))
    ax.text(g * 2.4 + 1.1, 0.4, f"k,v head {g}", ha="center", va="center", fontsize=9, color="white")
ax.set_xlim(-0.2, H * 1.2)
ax.set_ylim(-0.2, 3)
ax.axis("off")
ax.set_title(f"grouped-query attention in stories260K: {H} query heads read {K} cached key/value heads")
plt.show()
