# %% [markdown]
# # 04 · The transformer block: RMSNorm, the residual stream, SwiGLU
#
# A Llama layer adds two things to a running vector, the *residual stream* $x$:
#
# $$x \leftarrow x + \mathrm{Attention}(\mathrm{RMSNorm}(x)), \qquad x \leftarrow x + \mathrm{FFN}(\mathrm{RMSNorm}(x))$$
#
# and after the last layer one more RMSNorm and the LM head turn $x$ into logits. This notebook looks at the
# pieces that are not attention, on the real `stories260K`.

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
w = weights  # the checkpoint's tensors by name: "layers.0.wq", ...

# %% [markdown]
# ## The shapes, and where the 260K parameters are
#
# stories260K: D = 64, F = 172, 5 layers, 8 query heads and 4 key/value heads of Dh = 8, a 512-piece vocabulary,
# and an LM head tied to the embedding. Counting every tensor gives the model its name:

# %%
assert (cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (64, 172, 5, 8, 4, 512)
groups = {"embedding (= LM head)": 0, "attention wq wk wv wo": 0, "SwiGLU w1 w2 w3": 0, "RMSNorm gains": 0}
for name, tensor in w.items():
    kind = name.rsplit(".", 1)[-1]
    if kind == "tok_embeddings":
        groups["embedding (= LM head)"] += tensor.size
    elif kind in ("wq", "wk", "wv", "wo"):
        groups["attention wq wk wv wo"] += tensor.size
    elif kind in ("w1", "w2", "w3"):
        groups["SwiGLU w1 w2 w3"] += tensor.size
    else:
        groups["RMSNorm gains"] += tensor.size
for group, count in groups.items():
    print(f"{group:24s} {count:7,d}")
total = sum(groups.values())
print(f"{'total':24s} {total:7,d}")
assert total == 260_032  # "260K"

# %% [markdown]
# ## RMSNorm
#
# $$\mathrm{RMSNorm}(x) = \frac{x}{\sqrt{\tfrac{1}{D}\sum_i x_i^2 + \epsilon}} \odot g$$
#
# Unlike LayerNorm there is no mean subtraction and no bias: only the *scale* of $x$ is normalised, then a learned
# gain $g$ per channel re-weights it. Before the gain, every output has root-mean-square 1 (up to $\epsilon$):

# %%
show(ops.rms_norm)
rng = np.random.default_rng(0)
x = rng.standard_normal((1000, cfg.dim)) * rng.uniform(0.01, 100, (1000, 1))  # vectors of wildly different scales
y = ops.rms_norm(x, np.ones(cfg.dim), cfg.norm_eps)
rms = np.sqrt(np.mean(y**2, axis=-1))
print(f"input RMS from {np.sqrt(np.mean(x**2, -1)).min():.3f} to {np.sqrt(np.mean(x**2, -1)).max():.1f}; "
      f"output RMS from {rms.min():.6f} to {rms.max():.6f}")
assert np.allclose(rms, 1, atol=1e-3)  # eps = 1e-5 matters only for the smallest inputs
assert np.allclose(ops.rms_norm(7 * x, np.ones(cfg.dim), 0.0), ops.rms_norm(x, np.ones(cfg.dim), 0.0))  # scale-free

# %% [markdown]
# ## The residual stream through the layers
#
# Every RMSNorm reads the residual stream, so recording the inputs of `ops.rms_norm` during one forward gives $x$
# at every point: before each layer's attention, before its FFN, and before the final norm.

# %%
PROMPT = "Once upon a time, there was a little cat named Tom. Tom liked to play"
ids = llm.tokenizer.encode(PROMPT, bos=True)
labels = [llm.tokenizer.id_to_piece(i).replace("▁", " ") for i in ids]

stream = []
original = ops.rms_norm


def recording_rms_norm(x, weight, eps):
    stream.append(x.copy())
    return original(x, weight, eps)


ops.rms_norm = recording_rms_norm
try:
    final = model.forward(ids, np.arange(len(ids)), model.new_cache())
finally:
    ops.rms_norm = original
assert len(stream) == 2 * cfg.n_layers + 1
assert np.array_equal(final, original(stream[-1], w["norm"], cfg.norm_eps))  # the last one is the final norm's input

# Each step of the stream is the previous one plus a block's output: check the FFN halves with the model's own method.
for layer in range(cfg.n_layers):
    x_mid = stream[2 * layer + 1]
    x_next = stream[2 * layer + 2] if layer + 1 < cfg.n_layers else stream[-1]
    assert np.allclose(x_next - x_mid, model.ffn_block(layer, x_mid), atol=1e-5)
print("residual stream recorded at", len(stream), "points; x_next - x == ffn_block(x) in every layer")

points = ["embedding"] + [f"L{l} {part}" for l in range(cfg.n_layers) for part in ("+attn", "+ffn")]
norms = np.array([np.linalg.norm(s, axis=-1) for s in stream])  # [points, T]
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.2))
for t in range(len(ids)):
    ax0.plot(norms[:, t], color=plt.cm.viridis(t / len(ids)), alpha=0.8)
ax0.set_xticks(range(len(points)), points, rotation=45, fontsize=8)
ax0.set_ylabel("‖x‖ per token")
ax0.set_title("the residual stream grows as blocks add to it (colour: token position)")
updates = np.array([np.linalg.norm(stream[i + 1] - stream[i], axis=-1).mean() for i in range(len(stream) - 1)])
ax1.bar(range(len(updates)), updates, color=["tab:blue", "tab:orange"] * cfg.n_layers)
ax1.set_xticks(range(len(updates)), points[1:], rotation=45, fontsize=8)
ax1.set_ylabel("mean ‖block output‖")
ax1.set_title("what each attention (blue) and FFN (orange) adds")
plt.tight_layout()
plt.show()

# %% [markdown]
# RMSNorm is why this growth is harmless: every block sees its input at unit scale, and the gains decide which
# channels matter. The gains of each norm, per channel:

# %%
gains = np.stack([w[f"layers.{l}.{n}"] for l in range(cfg.n_layers) for n in ("attention_norm", "ffn_norm")]
                 + [w["norm"]])
fig, ax = plt.subplots(figsize=(11, 3.4))
im = ax.imshow(gains, aspect="auto", cmap="magma")
ax.set_yticks(range(len(gains)), [f"L{l} {n}" for l in range(cfg.n_layers) for n in ("attn", "ffn")] + ["final"],
              fontsize=8)
ax.set_xlabel("channel")
ax.set_title("RMSNorm gains g")
fig.colorbar(im, ax=ax)
plt.show()

# %% [markdown]
# ## SwiGLU: a gated feed-forward
#
# $$\mathrm{FFN}(x) = \big(\mathrm{SiLU}(x W_1^\top) \odot x W_3^\top\big) W_2^\top, \qquad
#   \mathrm{SiLU}(z) = z\,\sigma(z) = \frac{z}{1 + e^{-z}}$$
#
# $W_1$ is the gate, $W_3$ the "up" projection, $W_2$ the "down" projection ($D \to F \to D$, here 64 → 172 → 64).
# The classic transformer FFN was $\mathrm{ReLU}(x W_1^\top) W_2^\top$: a hard gate that is exactly zero for
# negative inputs. SiLU is smooth and lets a little through below zero (its minimum is about −0.28 at z ≈ −1.28).

# %%
show(ops.silu)
show(ops.swiglu)
z = np.linspace(-6, 6, 601)
silu = ops.silu(z)
assert ops.silu(np.array([0.0]))[0] == 0 and abs(ops.silu(np.array([20.0]))[0] - 20) < 1e-6
print(f"SiLU minimum {silu.min():.4f} at z = {z[np.argmin(silu)]:.2f}")

# The gate pre-activations x W1^T the real model computes at each layer, for the prompt above.
gates = [original(stream[2 * l + 1], w[f"layers.{l}.ffn_norm"], cfg.norm_eps) @ w[f"layers.{l}.w1"].T
         for l in range(cfg.n_layers)]  # [T, F] each
all_gates = np.concatenate([g.ravel() for g in gates])

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4))
ax0.plot(z, silu, label="SiLU(z) = z σ(z)")
ax0.plot(z, np.maximum(z, 0), "--", label="ReLU(z)")
ax0.axhline(0, color="lightgrey", lw=0.8)
ax0.legend()
ax0.set_title("the gate functions")
ax1.hist(all_gates, bins=80, color="grey")
ax1.set_xlabel("gate pre-activation x W1ᵀ (all layers, all tokens)")
ax1.set_title(f"{np.mean(all_gates < 0):.0%} of the real gates are negative: ReLU would zero them")
plt.tight_layout()
plt.show()

# %% [markdown]
# The real gates live in |z| < 2, exactly where SiLU and ReLU differ most (SiLU(1) = 0.73, SiLU(−1) = −0.27).
# Swap the gate for ReLU in every layer's FFN (a what-if written here, not npllm code) and compare each FFN's
# output with the real one on the same inputs: the model's weights were trained for the smooth gate.

# %%
for layer in range(cfg.n_layers):
    h = original(stream[2 * layer + 1], w[f"layers.{layer}.ffn_norm"], cfg.norm_eps)
    real = ops.swiglu(h, w[f"layers.{layer}.w1"], w[f"layers.{layer}.w2"], w[f"layers.{layer}.w3"])
    relu_gated = (np.maximum(h @ w[f"layers.{layer}.w1"].T, 0) * (h @ w[f"layers.{layer}.w3"].T)) @ w[f"layers.{layer}.w2"].T
    change = np.linalg.norm(relu_gated - real) / np.linalg.norm(real)
    print(f"layer {layer}: ReLU gate changes the FFN output by {change:.0%}")
