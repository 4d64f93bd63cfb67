# %% [markdown]
# # 05 · From logits to a token: temperature, top-k, top-p, min-p, penalties
#
# The model's last output is one score per vocabulary entry, the logits $x \in \mathbb{R}^V$. Choosing the next
# token from them is a small pipeline, `npllm.sampling`, each stage a pure function over logits:
#
# $$\text{penalties} \;\to\; \text{temperature} \;\to\; \text{top-}k \;\to\; \text{top-}p \;\to\; \text{min-}p
# \;\to\; \text{draw}$$
#
# Filters never renormalise anything themselves: they set the removed logits to $-\infty$, and the final softmax
# spreads the probability over what is left. Here every stage is run on made-up numbers (the seed's tables) and on
# the real `stories260K` distributions.

# %%
import inspect

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

import npllm
from npllm import sampling
from npllm.explain import explain_ids, format_step
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


def piece(i):
    return llm.tokenizer.id_to_piece(int(i)).replace("▁", " ")

# %% [markdown]
# ## Softmax with a temperature
#
# $$\pi_i(T) = \frac{e^{(x_i - \max x)/T}}{\sum_j e^{(x_j - \max x)/T}}$$
#
# Dividing by $T < 1$ stretches the gaps between logits (sharper); $T > 1$ shrinks them (flatter); $T \to 0$ puts
# all the mass on the argmax, which npllm treats as greedy decoding.

# %%
show(sampling.softmax)

# %% [markdown]
# The seed's tables, recomputed by `sampling.softmax` (the notebook stops here if a number drifts):

# %%
print("softmax([11, 12, 13])       =", sampling.softmax([11.0, 12.0, 13.0]).round(4))
print("softmax([0.01, 0.02, 0.03]) =", sampling.softmax([0.01, 0.02, 0.03]).round(4))
assert np.allclose(sampling.softmax([11.0, 12.0, 13.0]), [0.0900, 0.2447, 0.6652], atol=5e-5)
assert np.allclose(sampling.softmax([0.01, 0.02, 0.03]), [0.3300, 0.3333, 0.3367], atol=5e-5)

SEED_LOGITS = np.array([2.0, 1.0, 0.5, 0.1])
SEED_TABLE = {0.5: [0.828, 0.112, 0.041, 0.019], 1.0: [0.575, 0.211, 0.128, 0.086], 2.0: [0.406, 0.246, 0.192, 0.157]}
rows = ["| T | token 0 (x=2.0) | token 1 (x=1.0) | token 2 (x=0.5) | token 3 (x=0.1) |", "|---|---|---|---|---|"]
for T, expected in SEED_TABLE.items():
    p = sampling.softmax(SEED_LOGITS, T)
    assert np.allclose(p, expected, atol=5e-4), (T, p)
    rows.append(f"| {T} | " + " | ".join(f"{v:.3f}" for v in p) + " |")
display(Markdown("\n".join(rows)))

# %% [markdown]
# The same four logits as small multiples over $T$, and the real model's next-token distribution after
# "Once upon a time, there was a" at the same temperatures (its 20 most probable tokens):

# %%
temperatures = [0.25, 0.5, 1.0, 2.0, 4.0]
open_ids = llm.tokenizer.encode("Once upon a time, there was a", bos=True)
open_logits = llm.logits(open_ids)[-1]
order = np.argsort(-open_logits)[:20]

fig, axes = plt.subplots(2, len(temperatures), figsize=(16, 6), sharey="row")
for ax, T in zip(axes[0], temperatures):
    ax.bar(range(4), sampling.softmax(SEED_LOGITS, T), color="tab:blue")
    ax.set_xticks(range(4), ["2.0", "1.0", "0.5", "0.1"])
    ax.set_title(f"T = {T}")
    ax.set_ylim(0, 1)
axes[0, 0].set_ylabel("seed logits\nprobability")
for ax, T in zip(axes[1], temperatures):
    ax.bar(range(20), sampling.softmax(open_logits, T)[order], color="tab:orange")
    ax.set_xticks(range(20), [piece(i) for i in order], rotation=90, fontsize=7)
    ax.set_ylim(0, 1)
axes[1, 0].set_ylabel("stories260K\nprobability")
plt.suptitle("temperature reshapes the same logits: sharper below 1, flatter above")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## A confident step and an open one
#
# The seed contrasts a prompt with one obvious continuation ("The capital of France is" → Paris) and one with many.
# A 260K-parameter model trained on children's stories knows no geography, so for it the France prompt is the open
# one, and "Once upon a" is the confident one:

# %%
steps = {}
for prompt in ("Once upon a", "The capital of France is"):
    logits = llm.logits(llm.tokenizer.encode(prompt, bos=True))[-1]
    p = sampling.softmax(logits.astype(np.float64))
    entropy = -np.sum(p * np.log(p))
    steps[prompt] = logits
    top = np.argsort(-p)[:5]
    print(f"{prompt!r:28} entropy {entropy:.2f} nats; top 5:",
          ", ".join(f"{piece(i)!r} {p[i]:.3f}" for i in top))
assert sampling.softmax(steps["Once upon a"]).max() > 0.99  # " time", almost surely

# %% [markdown]
# ## top-k and top-p (the nucleus)
#
# * **top-k** keeps the $k$ largest logits (ties with the $k$-th are kept too);
# * **top-p** keeps the smallest set of most probable tokens whose mass reaches $p$: with $\tau$ the largest
#   probability such that $\sum_{\pi_j \ge \tau} \pi_j \ge p$, keep $\pi_i \ge \tau$.
#
# A fixed $k$ is too many on a confident step and may be too few on an open one; the nucleus adapts.

# %%
show(sampling.top_k)
show(sampling.top_p)

# %%
K, P = 10, 0.9
fig, axes = plt.subplots(2, 2, figsize=(14, 7))
for row, (prompt, logits) in enumerate(steps.items()):
    p = sampling.softmax(logits)
    order = np.argsort(-p)[:30]
    for col, (name, kept) in enumerate((("top-k, k = 10", sampling.top_k(logits, K) > -np.inf),
                                        ("top-p, p = 0.9", sampling.top_p(logits, P) > -np.inf))):
        ax = axes[row, col]
        ax.bar(range(30), p[order], color=np.where(kept[order], "tab:green", "lightgrey"))
        ax.set_xticks(range(30), [piece(i) for i in order], rotation=90, fontsize=7)
        n = int(kept.sum())
        ax.set_title(f"{prompt!r}: {name} keeps {n} token{'s' * (n != 1)}, {p[kept].sum():.1%} of the mass",
                     fontsize=10)
        ax.set_yscale("log")
        ax.set_ylim(1e-4, 1.5)
    kept_p = sampling.top_p(logits, P) > -np.inf
    assert p[kept_p].sum() >= P  # the nucleus reaches p ...
    assert p[kept_p].sum() - p[kept_p].min() < P  # ... and would not without its least probable member
plt.suptitle("green: kept (log scale: the long tail is where the junk lives)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## min-p
#
# **min-p** keeps tokens with $\pi_i \ge p_{\min} \cdot \max_j \pi_j$: a threshold relative to the best token, so it
# is strict when the model is sure and lenient when it is not. It is decided on logits as
# $x_i - \max x \ge \ln p_{\min}$, without any exponential.

# %%
show(sampling.min_p)
fig, axes = plt.subplots(1, 2, figsize=(14, 3.6))
for ax, (prompt, logits) in zip(axes, steps.items()):
    p = sampling.softmax(logits)
    order = np.argsort(-p)[:30]
    kept = sampling.min_p(logits, 0.1) > -np.inf
    ax.bar(range(30), p[order], color=np.where(kept[order], "tab:purple", "lightgrey"))
    ax.axhline(0.1 * p.max(), color="black", ls="--", lw=1, label="0.1 · max π")
    ax.set_xticks(range(30), [piece(i) for i in order], rotation=90, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(1e-4, 1.5)
    ax.legend()
    ax.set_title(f"{prompt!r}: min-p 0.1 keeps {kept.sum()}", fontsize=10)
    assert np.all(p[kept] >= 0.1 * p.max() * (1 - 1e-5)) and np.all(p[~kept] < 0.1 * p.max() * (1 + 1e-5))
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Repetition penalty
#
# The CTRL rule, for every token already in the text (each once, however often it occurs): divide a positive
# logit by the penalty, multiply a negative one by it. Both make the token less likely.

# %%
show(sampling.repetition_penalty)
story = llm.tokenizer.encode("Once upon a time, there was a little girl named Lily. Lily", bos=True)
logits = llm.logits(story)[-1]
penalised = sampling.repetition_penalty(logits, story, 1.5)
p0, p1 = sampling.softmax(logits), sampling.softmax(penalised)
order = np.argsort(-p0)[:15]
seen = np.isin(order, story)
fig, ax = plt.subplots(figsize=(11, 3.6))
ax.bar(np.arange(15) - 0.2, p0[order], 0.4, label="no penalty")
ax.bar(np.arange(15) + 0.2, p1[order], 0.4, label="repetition penalty 1.5")
ax.set_xticks(range(15), [piece(i) + (" *" if s else "") for i, s in zip(order, seen)], rotation=90, fontsize=8)
ax.set_yscale("log")
ax.legend()
ax.set_title("after '... named Lily. Lily': * marks tokens already in the text; they lose, the rest gain")
plt.show()
assert np.all(p1[np.isin(np.arange(len(p0)), story)] <= p0[np.isin(np.arange(len(p0)), story)] + 1e-9)

# %% [markdown]
# ## The whole pipeline on one step, and the dice
#
# `sampling.explain_steps` returns the probability vector after every active stage; it is what
# `npllm generate --explain` prints as a table, row per candidate, with the token the sampler then drew:

# %%
params = sampling.SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=42)
prompt_ids = llm.tokenizer.encode("One day, Lily saw a", bos=True)
for step in explain_ids(llm.model, llm.tokenizer, prompt_ids, 2, params, top=10):
    print(format_step(step), "\n")
    assert abs(step.drawn_probability - np.exp(step.logprob)) < 1e-6  # the table shows the sampler's probability

# %% [markdown]
# ## Each strategy's samples
#
# Three seeded continuations per strategy (30 tokens each). Greedy gives one answer; temperature alone wanders
# into the tail; the filters keep the variety but cut the junk.

# %%
strategies = {
    "greedy (T = 0)": dict(temperature=0.0),
    "T = 1.0": dict(temperature=1.0),
    "T = 1.5": dict(temperature=1.5),
    "T = 1.5, top-k 10": dict(temperature=1.5, top_k=10),
    "T = 1.5, top-p 0.8": dict(temperature=1.5, top_p=0.8),
    "T = 1.5, min-p 0.1": dict(temperature=1.5, min_p=0.1),
    "T = 0.8, repetition penalty 1.3": dict(temperature=0.8, repetition_penalty=1.3),
}
PROMPT = "One day, Lily saw a"
for name, kwargs in strategies.items():
    print(f"--- {name}")
    for seed in (1, 2, 3):
        print("   ", repr(PROMPT + llm.generate(PROMPT, max_new_tokens=30, seed=seed, **kwargs)))
        if kwargs["temperature"] == 0:
            break

# %% [markdown]
# ## A constraint: the mask before every stage
#
# Structured outputs (docs/structured.md) add one stage in front of all the others: a constraint (a JSON Schema, a
# regular expression, a grammar) says which tokens keep the text in its language, and `sampling.constrain` sets
# every other logit to $-\infty$. What follows sees only the allowed tokens: without filters the distribution is
# the model's, restricted to them and renormalised,
#
# $$p_i \;=\; \frac{\pi_i \,[i \in A]}{\sum_{j \in A} \pi_j}.$$
#
# Here the model continues "One day, Lily saw a" under the regular expression ` (cat|dog|bird)s?`: the mask comes
# from the constraint's state (npllm.constraint, the masks computed by llguidance), and the plot shows the raw
# distribution's top tokens beside the constrained one.

# %%
from npllm import Constraint

prompt_ids = llm.tokenizer.encode("One day, Lily saw a", bos=True)
state = Constraint.regex(" (cat|dog|bird)s?").bind(llm.tokenizer).start()
allowed = state.allowed([llm.tokenizer.eos_id])
raw_logits = llm.logits(prompt_ids)[-1]
raw = sampling.softmax(raw_logits)
masked = sampling.softmax(sampling.constrain(raw_logits, allowed))
assert np.allclose(masked[allowed], raw[allowed] / raw[allowed].sum()) and (masked[~allowed] == 0).all()
print(f"the mask allows {allowed.sum()} of {len(allowed)} tokens, holding {raw[allowed].sum():.2%} of the raw "
      f"probability: {[piece(i) for i in np.flatnonzero(allowed)]}")

shown = list(np.argsort(-raw)[:10]) + [i for i in np.argsort(-masked)[:4] if i not in np.argsort(-raw)[:10]]
fig, ax = plt.subplots(figsize=(10, 3.5))
ax.bar(np.arange(len(shown)) - 0.2, raw[shown], width=0.4, label="raw softmax")
ax.bar(np.arange(len(shown)) + 0.2, masked[shown], width=0.4, label="after the constraint")
ax.set_xticks(range(len(shown)), [piece(i) for i in shown], rotation=90, fontsize=8)
ax.legend()
ax.set_title("the mask removes the model's favourites; the allowed tokens share all the probability")
plt.show()

# %% [markdown]
# `--explain` shows the same thing per generated token, the mask as the column after the raw softmax:

# %%
for step in explain_ids(llm.model, llm.tokenizer, prompt_ids, 3, sampling.SamplingParams(seed=1), top=6,
                        constraint=llm.bind_constraint(Constraint.regex(" (cat|dog|bird)s?"))):
    print(format_step(step), "\n")
print(repr(llm.generate("One day, Lily saw a", 10, seed=1, constraint=Constraint.regex(" (cat|dog|bird)s?"))))
