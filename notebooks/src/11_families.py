# %% [markdown]
# # 11 · Other families: soft-capping and a mixture of experts
#
# Gemma, Qwen3, Mixtral, OLMo 2, Granite and Phi-3 are the Llama block with a few options switched on, each a
# `ModelConfig` field with its formula in `npllm/ops.py` (the whole list, and which family sets what, is in
# [docs/architectures.md](../docs/architectures.md)). Two of them change what a layer *does* rather than a
# constant in it, and are drawn here:
#
# - **soft-capping** (Gemma 2) squashes attention scores and final logits smoothly into $(-c, c)$;
# - a **mixture of experts** (Qwen3-MoE, Mixtral) replaces the FFN by $E$ expert FFNs, of which a router picks
#   $k$ per token.
#
# The second part runs a real (tiny, random-weight) Qwen3-MoE checkpoint that transformers made for the tests,
# `tests/fixtures/hf/qwen3_moe`, and records the router's choices from the model's own calls.

# %%
import inspect
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

import npllm
from npllm import ops

# The test fixtures of this repository (not part of the installed package): beside the notebooks (they run in
# notebooks/), else beside the npllm this notebook imported (a checkout on the path).
FIXTURES = next((d for d in (Path("../tests/fixtures/hf"), Path(npllm.__file__).parents[1] / "tests/fixtures/hf")
                 if (d / "qwen3_moe").is_dir()), None)
if FIXTURES is None:
    raise FileNotFoundError("tests/fixtures/hf/qwen3_moe is not here: run this notebook in notebooks/ of a clone of "
                            "the repository (the fixtures are part of the repository, not of the package)")


def show(obj):
    """Display the source of an npllm function as it is installed."""
    display(Markdown(f"```python\n{inspect.getsource(obj)}```"))

# %% [markdown]
# ## Soft-capping: $c \tanh(x / c)$
#
# Gemma 2 caps every attention score (before the causal mask, so $-\infty$ stays $-\infty$) and the final
# logits:
#
# $$\mathrm{scores} = \mathrm{softcap}\!\left(s\, q \cdot k,\ c_\mathrm{attn}\right) + M, \qquad
# \mathrm{logits} = \mathrm{softcap}(h W^\top,\ c_\mathrm{final}), \qquad
# \mathrm{softcap}(x, c) = c \tanh(x / c)$$
#
# with $c_\mathrm{attn} = 50$ and $c_\mathrm{final} = 30$ in the published Gemma 2 configs. Near zero $\tanh(u)
# \approx u$, so small values pass unchanged; large ones approach $\pm c$ but never reach it, and the curve stays
# smooth (a hard clip would stop the gradient of every clipped value in training).

# %%
show(ops.softcap)
show(ops.final_logits)

# %%
CAPS = {"attention scores (c = 50)": 50.0, "final logits (c = 30)": 30.0}
x = np.linspace(-150.0, 150.0, 1201)
fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
ax.plot(x, x, color="0.6", lw=1, ls="--", label="identity")
for (label, c), colour in zip(CAPS.items(), ("C0", "C3")):
    y = ops.softcap(x, c)
    ax.plot(x, y, color=colour, lw=2, label=label)
    ax.axhline(c, color=colour, lw=0.6, ls=":")
    ax.axhline(-c, color=colour, lw=0.6, ls=":")
    positive = x > 0
    bx.plot(x[positive], y[positive] / x[positive], color=colour, lw=2, label=label)
    bx.plot([c], [np.tanh(1.0)], "o", color=colour)
    # the laws the curve shows: inside (-c, c), odd, monotone, ~identity near 0, tanh(1) of x kept at x = c
    assert np.all(np.abs(y) < c) and np.allclose(ops.softcap(-x, c), -y) and np.all(np.diff(y) > 0)
    small = np.abs(x) < c / 20
    assert np.allclose(y[small], x[small], rtol=2e-3)
    assert np.isclose(ops.softcap(np.array([c]), c)[0], c * np.tanh(1.0))
ax.set_ylim(-110, 110)
ax.set_xlabel("x (a score or a logit)")
ax.set_ylabel("softcap(x, c)")
ax.set_title("c·tanh(x / c) against the identity", fontsize=10)
ax.legend(fontsize=8, loc="upper left")
bx.set_xlabel("x")
bx.set_ylabel("softcap(x, c) / x")
bx.set_ylim(0, 1.05)
bx.set_title("share of x kept (dot: x = c keeps tanh(1) = 76%)", fontsize=10)
bx.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# The cap keeps the order of the logits, so a greedy choice never changes; what changes is how far apart large
# logits can be. Near the cap they are squeezed together, so among the tokens that compete at the top the
# distribution is flatter:

# %%
logits = np.array([40.0, 32.0, 30.0, 10.0, -5.0])
capped = ops.final_logits(logits, cap=30.0)
for name, values in (("raw", logits), ("capped at 30", capped)):
    q = ops.softmax(values)
    print(f"{name:>13}: logits {np.round(values, 2)}  p {np.round(q, 4)}  p0 / p1 = {q[0] / q[1]:,.1f}")
assert np.array_equal(np.argsort(capped), np.argsort(logits))  # the same order: the same greedy token
assert ops.softmax(capped)[0] < ops.softmax(logits)[0]  # less sure of the top token

# %% [markdown]
# ## A mixture of experts: what the router chooses
#
# In a Qwen3-MoE layer the FFN is $E$ small SwiGLU experts. For each token a router (one matrix $W_r$, $[E, D]$)
# scores every expert, and only the $k$ most probable run:
#
# $$p = \mathrm{softmax}(x W_r^\top), \qquad \mathrm{chosen} = \operatorname{top-}k(p), \qquad
# \mathrm{FFN}(x) = \sum_{e \in \mathrm{chosen}} w_e\, \mathrm{SwiGLU}_e(x)$$
#
# with $w_e = p_e / \sum_{j \in \mathrm{chosen}} p_j$ when the family renormalises (Mixtral; Qwen3-MoE with
# `norm_topk_prob`), else $w_e = p_e$. `Transformer.ffn_block` calls `ops.route` once per layer; wrapping it for
# one forward records exactly what the model chose.

# %%
show(ops.route)
show(ops.moe_ffn)

# %%
llm = npllm.load(FIXTURES / "qwen3_moe", backend="numpy")
model, cfg = llm.model, llm.config
E, k = cfg.n_experts, cfg.n_experts_used
print(f"{cfg.arch}: {cfg.n_layers} layers, E = {E} experts of width {cfg.moe_hidden_dim}, k = {k} per token, "
      f"weights renormalised: {cfg.expert_weights_norm}")

PROMPT = "Lily loved to play outside in the park."
ids = llm.tokenizer.encode(PROMPT)
labels = ["BOS" if i == cfg.bos_id else llm.tokenizer.decode([i]).replace(" ", "\u2423") for i in ids]
T = len(ids)


def record_routes(model, ids):
    """Run one forward of `ids` on `model`, returning what each of its ops.route calls got and gave."""
    calls, original = [], ops.route

    def recording_route(h, router, n, normalize):
        chosen, weights = original(h, router, n, normalize)
        calls.append({"h": h, "router": router, "chosen": chosen, "weights": weights})
        return chosen, weights

    ops.route = recording_route
    try:
        model.forward(ids, np.arange(len(ids)), model.new_cache())
    finally:
        ops.route = original
    return calls


calls = record_routes(model, ids)
assert len(calls) == cfg.n_layers
print(f"{T} tokens; recorded {len(calls)} router calls: h {calls[0]['h'].shape}, chosen {calls[0]['chosen'].shape}")

# %% [markdown]
# `ops.route` returns only the chosen experts and their weights; the probabilities of all $E$ experts are
# recomputed here from the recorded inputs and the layer's router, and checked against what the model chose.

# %%
probs = []
for layer, call in enumerate(calls):
    assert call["router"] is model.weights.layers[layer].router  # the layer's own router matrix
    p = ops.softmax((call["h"] @ call["router"].T).astype(np.float64))  # [T, E], as ops.route computes it
    top = np.sort(np.argsort(-p, axis=-1)[:, :k], axis=-1)
    assert np.array_equal(top, np.sort(call["chosen"], axis=-1)), layer  # the k most probable were chosen
    mass = np.take_along_axis(p, call["chosen"], -1)  # [T, k]
    expected = mass / mass.sum(-1, keepdims=True) if cfg.expert_weights_norm else mass
    assert np.allclose(call["weights"], expected, atol=1e-6), layer
    probs.append(p)
    print(f"layer {layer}: the chosen {k} of {E} hold {mass.sum(-1).mean():.0%} of the router's probability on "
          f"average (min {mass.sum(-1).min():.0%})")

# %% [markdown]
# One layer drawn: each column is a token, each row an expert, the colour the router's probability; the boxes
# mark the $k$ experts each token was sent to. The bars count how many tokens each expert received. An expert that
# nobody chooses costs nothing for this prompt: only the chosen experts' weights are read (`ops.moe_ffn` groups
# the tokens by expert).

# %%
LAYER = cfg.n_layers - 1
p, chosen = probs[LAYER], calls[LAYER]["chosen"]
counts = np.bincount(chosen.ravel(), minlength=E)
fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 0.42 * E + 1.8), sharey=True,
                             gridspec_kw={"width_ratios": [5, 1], "wspace": 0.04})
image = ax.imshow(p.T, aspect="auto", cmap="viridis", vmin=0, vmax=1)
for t in range(T):
    for e in chosen[t]:
        ax.add_patch(plt.Rectangle((t - 0.5, e - 0.5), 1, 1, fill=False, edgecolor="white", lw=1.5))
ax.set_xticks(range(T))
ax.set_xticklabels(labels, fontsize=8, family="monospace")
ax.set_yticks(range(E))
ax.set_ylabel("expert")
ax.set_title(f"layer {LAYER}: router probability of each expert for each token (boxes: the top {k})", fontsize=10)
fig.colorbar(image, ax=bx, fraction=0.25, pad=0.08, label="p")
bx.barh(range(E), counts, color="C1")
bx.axvline(T * k / E, color="0.4", ls="--", lw=1)
bx.set_xlabel(f"tokens routed\n(dashed: an even share, {T}·{k}/{E})", fontsize=8)
plt.show()
assert counts.sum() == T * k  # every token went to exactly k experts
assert all(len(set(row)) == k for row in chosen.tolist())  # k different ones
print("tokens per expert, by layer:")
for layer, call in enumerate(calls):
    print(f"  layer {layer}: {np.bincount(call['chosen'].ravel(), minlength=E).tolist()}")

# %% [markdown]
# ## The two normalisations
#
# `tests/fixtures/hf/qwen3_moe_unnormed` is the same kind of model with `norm_topk_prob` false: its chosen
# experts are weighted by their router probabilities as they are, so the weights of a token sum to the probability
# mass the router gave its top $k$, not to 1, and the FFN's output is smaller where the router is unsure.

# %%
unnormed = npllm.load(FIXTURES / "qwen3_moe_unnormed", backend="numpy")
assert not unnormed.config.expert_weights_norm and unnormed.config.n_experts_used == k
sums = {"qwen3_moe (renormalised)": np.concatenate([c["weights"].sum(-1) for c in calls]),
        "qwen3_moe_unnormed": np.concatenate([c["weights"].sum(-1) for c in record_routes(unnormed.model, ids)])}
fig, ax = plt.subplots(figsize=(9, 2.8))
for (name, total), colour in zip(sums.items(), ("C0", "C3")):
    ax.hist(total, bins=np.linspace(k / E, 1.0, 31), color=colour, alpha=0.7, label=name)
    print(f"{name}: the weights of a token sum to {total.mean():.3f} on average (min {total.min():.3f})")
ax.set_xlabel(f"sum of a token's {k} expert weights (every token, every layer; the least possible is k / E = {k / E:.2f})")
ax.set_ylabel("tokens")
ax.legend(fontsize=8, loc="upper left")
plt.show()
assert np.allclose(sums["qwen3_moe (renormalised)"], 1.0, atol=1e-6)
assert np.all(sums["qwen3_moe_unnormed"] < 1.0) and np.all(sums["qwen3_moe_unnormed"] >= k / E - 1e-6)
