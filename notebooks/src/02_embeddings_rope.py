# %% [markdown]
# # 02 · Embeddings and RoPE: token ids → vectors that know their position
#
# The first stage of the model turns each id into a row of the embedding matrix $E \in \mathbb{R}^{V \times D}$.
# Nothing in that row says *where* the token stands; Llama adds position inside attention instead, by rotating
# queries and keys (RoPE). This notebook takes both apart on `stories260K` (V = 512, D = 64, 8 heads of Dh = 8).

# %%
import inspect
import os

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
E = weights["tok_embeddings"]  # [V, D], from the checkpoint's tensors by name
print(cfg)
print("embedding matrix", E.shape, E.dtype)

# %% [markdown]
# ## The lookup is indexing
#
# $x_t = E[\mathrm{id}_t]$. Written as linear algebra it is a product with one-hot rows,
# $x = \mathrm{onehot}(\mathrm{ids})\,E$, but there is no reason to multiply by zeros: the lookup picks rows.

# %%
show(ops.embed)
ids = llm.tokenizer.encode("Once upon a time, there was a cat.", bos=True)
x = ops.embed(E, np.array(ids))  # [T, D]
one_hot = np.eye(cfg.vocab_size, dtype=E.dtype)[ids]  # [T, V]
assert np.array_equal(x, one_hot @ E)  # exactly the same numbers (each sum has one nonzero term)
print("ids", ids, "-> x", x.shape)

fig, ax = plt.subplots(figsize=(9, 3.2))
im = ax.imshow(x, aspect="auto", cmap="RdBu_r", vmin=-np.abs(x).max(), vmax=np.abs(x).max())
ax.set_yticks(range(len(ids)), [repr(llm.tokenizer.id_to_piece(i)) for i in ids], fontsize=8)
ax.set_xlabel("embedding dimension d (D = 64)")
ax.set_title("x = E[ids]: one row of the embedding matrix per token (the same row wherever the token stands)")
fig.colorbar(im, ax=ax)
plt.show()

# %% [markdown]
# ## RoPE: rotate pairs of coordinates by an angle proportional to the position
#
# Each head vector of length $D_h$ is cut into $D_h/2$ pairs. Pair $i$ of a token at position $m$ is rotated by
# the angle $m\,\omega_i$, with frequencies
#
# $$\omega_i = \theta^{-2i/D_h}, \qquad i = 0, \dots, D_h/2 - 1, \qquad \theta = 10000.$$
#
# $$\begin{pmatrix} x'_{2i} \\ x'_{2i+1} \end{pmatrix} =
#   \begin{pmatrix} \cos m\omega_i & -\sin m\omega_i \\ \sin m\omega_i & \cos m\omega_i \end{pmatrix}
#   \begin{pmatrix} x_{2i} \\ x_{2i+1} \end{pmatrix}$$

# %%
show(ops.rope_inv_freq)
show(ops.rope_angles)
show(ops.rope_interleaved)

# %% [markdown]
# For this model's $D_h = 8$ the four frequencies are $10000^{0}, 10000^{-1/4}, 10000^{-1/2}, 10000^{-3/4}$:
# exactly 1, 0.1, 0.01, 0.001 radians per position.

# %%
inv_freq = ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta)
print("stories260K w_i:", inv_freq, " wavelengths 2π/w_i:", np.round(2 * np.pi / inv_freq, 1), "positions")
assert np.allclose(inv_freq, [1.0, 0.1, 0.01, 0.001], rtol=1e-12)
assert np.array_equal(inv_freq, model.rope_frequencies()[0])  # the frequencies the model itself uses

llama_freq = ops.rope_inv_freq(128, 10000.0)  # a Llama 2 head: Dh = 128, 64 pairs
print("Llama 2 (Dh=128): first w", llama_freq[:3], "... last", llama_freq[-1])

# %% [markdown]
# The first pairs turn fast (pair 0 once every 2π ≈ 6.3 positions), the last ones barely move: together they act
# like the hands of a clock with many speeds. Left: pair 0 and pair 1 of a stories260K head turning over positions
# 0-12. Right: $\cos(m\,\omega_i)$ for every pair of a 128-dimensional Llama 2 head.

# %%
positions = np.arange(512)
cos, sin = ops.rope_angles(positions, llama_freq, dtype=np.float64)  # [512, 64] each

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.6]})
c, s = ops.rope_angles(np.arange(13), inv_freq, dtype=np.float64)
for pair, colour, labelled in ((0, "tab:red", (0, 1, 2, 3, 12)), (1, "tab:blue", (0, 6, 12))):
    ax0.plot(c[:, pair], s[:, pair], "o:", color=colour, label=f"pair {pair}: w = {inv_freq[pair]:g} rad/position")
    for m in labelled:
        ax0.annotate(f"m={m}", (c[m, pair], s[m, pair]), fontsize=7, xytext=(3, 3), textcoords="offset points",
                     color=colour)
ax0.add_patch(plt.Circle((0, 0), 1, fill=False, color="lightgrey"))
ax0.set_aspect("equal")
ax0.set_xlim(-1.3, 1.3)
ax0.set_ylim(-1.3, 1.3)
ax0.legend(fontsize=8, loc="lower left")
ax0.set_title("(cos mw, sin mw): where position m turns the unit vector")
im = ax1.imshow(cos.T, aspect="auto", cmap="RdBu_r", origin="lower", interpolation="nearest")
ax1.set_xlabel("position m")
ax1.set_ylabel("pair i")
ax1.set_title("cos(m w_i), Llama 2 head (Dh = 128)")
fig.colorbar(im, ax=ax1)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## The proof by numbers: $q \cdot k$ depends only on $m - n$
#
# Rotations compose: $R(m\omega)^\top R(n\omega) = R((n - m)\omega)$, so
# $(R_m q)\cdot(R_n k) = q^\top R_{n-m}\, k$ — a function of the offset alone. Take the real layer-0 query and
# key of one token of this model, rotate them as if the query stood at position $m$ and the key at $n$, and
# tabulate the score for all $m, n < 64$ (in float64, so equality is to rounding):

# %%
w = weights  # the checkpoint's tensors by name: "layers.0.wq", ...
token = llm.tokenizer.encode("cat", bos=False)[0]
h = ops.rms_norm(E[[token]].astype(np.float64), w["layers.0.attention_norm"], cfg.norm_eps)  # [1, D]
q = (h @ w["layers.0.wq"].T).reshape(cfg.n_heads, cfg.head_dim)[0]  # head 0's query, [Dh]
k = (h @ w["layers.0.wk"].T).reshape(cfg.n_kv_heads, cfg.head_dim)[0]  # kv head 0's key, [Dh]

N = 64
cos, sin = ops.rope_angles(np.arange(N), inv_freq, dtype=np.float64)  # [N, Dh/2]
q_rot = ops.rope_interleaved(np.broadcast_to(q, (N, 1, cfg.head_dim)), cos, sin)[:, 0]  # [N, Dh]: q at 0..N-1
k_rot = ops.rope_interleaved(np.broadcast_to(k, (N, 1, cfg.head_dim)), cos, sin)[:, 0]
scores = q_rot @ k_rot.T  # scores[m, n] = (R_m q) . (R_n k)

offsets = np.arange(-(N - 1), N)
spread = max(np.ptp(np.diagonal(scores, d)) for d in offsets)  # how much one diagonal (fixed n - m) varies
print(f"largest spread of q.k along a diagonal n - m = const: {spread:.2e} (the scores range over "
      f"{scores.min():.3f} .. {scores.max():.3f})")
assert spread < 1e-12
norms = np.linalg.norm(q_rot, axis=1)
assert np.allclose(norms, np.linalg.norm(q), rtol=1e-12)  # a rotation never changes a vector's length

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2))
im = ax0.imshow(scores, cmap="viridis", origin="upper")
ax0.set_xlabel("key position n")
ax0.set_ylabel("query position m")
ax0.set_title("(R_m q)·(R_n k): constant along every diagonal")
fig.colorbar(im, ax=ax0)
ax1.plot(offsets, [np.diagonal(scores, d)[0] for d in offsets], ".-")
ax1.set_xlabel("offset n - m")
ax1.set_ylabel("q·k")
ax1.set_title("the score as a function of the offset alone")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Two layouts of the same rotation
#
# Meta's and llama2.c's checkpoints pair adjacent coordinates $(x_{2i}, x_{2i+1})$; Hugging Face checkpoints pair
# $(x_i, x_{i + D_h/2})$ and permute the rows of $W_q, W_k$ to match. Reordering the coordinates of a vector
# (evens first, then odds) turns one rotation into the other exactly:

# %%
show(ops.rope_half)
rng = np.random.default_rng(0)
v = rng.standard_normal((5, 2, cfg.head_dim))  # [T, heads, Dh]
c5, s5 = ops.rope_angles(np.arange(5), inv_freq, dtype=np.float64)
evens_then_odds = np.r_[0:cfg.head_dim:2, 1:cfg.head_dim:2]
assert np.allclose(ops.rope_half(v[..., evens_then_odds], c5, s5), ops.rope_interleaved(v, c5, s5)[..., evens_then_odds])
print("rope_half on permuted coordinates == permuted rope_interleaved")
