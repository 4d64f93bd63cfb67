# %% [markdown]
# # 07 · Batching: static, ragged, continuous
#
# A decode step for one sequence reads every weight matrix to produce one token. Serving $B$ sequences in the same
# forward reads the weights once for all of them ($[B, D] \times [D, N]$ instead of $[1, D] \times [D, N]$), so
# batching is how an engine turns memory bandwidth into throughput. The hard part is that prompts have different
# lengths and sequences end at different times. `npllm.batching` implements three answers:
#
# * **static**: Meta's reference `generate()`. A $[B, \text{total\_len}]$ buffer; every row starts decoding at the
#   *shortest* prompt's length; a row whose prompt is longer is fed its own prompt one token per step, and the
#   token the model predicted there is thrown away (the prompt token is *forced* over it). Every row runs until
#   the last one is done.
# * **ragged**: all prompts prefilled in full in one forward (concatenated, each token with its own position and
#   cache slot), then every unfinished sequence decodes together, each at its own position.
# * **continuous**: a fixed number of cache slots; requests join the running batch at any step and leave when
#   done, freeing their slot for the next.
#
# Every forward call is logged (`Work(log=[])`): which sequence fed how many tokens at which position, and whether
# its prediction was overwritten. The pictures below are drawn from those logs.

# %%
import inspect
import os
import time

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # small model: one BLAS thread is faster and steadier

import npllm
from npllm import batching
from npllm.formats import read_checkpoint
from npllm.generate import generate_ids
from npllm.hub import embedded
from npllm.models.reference import Transformer
from npllm.sampling import SamplingParams
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
model = llm.model
GREEDY = SamplingParams(temperature=0)

# %% [markdown]
# ## Meta's loop
#
# The teaching version follows Meta's `generate()` step for step:

# %%
show(batching.static_generate)

# %% [markdown]
# ## The seed's workload: one 1-token prompt and three 100-token prompts
#
# The 1-token prompt is BOS alone; the others are the first 100 tokens of three stories. Each asks for 20 new
# tokens, greedily, so every strategy must return exactly what each prompt gets alone.

# %%
MAX_NEW = 20
stories = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends.",
    "Tom had a red ball. He liked to throw it high in the sky and catch it. One day, the ball went over the fence.",
    "The sun was hot and the sky was blue. Sam and his dog Max went to the beach to build a big sand castle.",
]
long_prompts = [(llm.tokenizer.encode(" ".join([s] * 6), bos=True))[:100] for s in stories]
prompts = [[llm.config.bos_id]] + long_prompts
print("prompt lengths:", [len(p) for p in prompts])
assert [len(p) for p in prompts] == [1, 100, 100, 100]

solo = [list(generate_ids(model, p, MAX_NEW, GREEDY)) for p in prompts]


def run(strategy, prompts, max_new, slots=None):
    """Run one strategy with a work log; returns (completions, work, seconds)."""
    work = batching.Work(log=[])
    requests = [batching.Request(p, max_new, GREEDY) for p in prompts]
    start = time.perf_counter()
    if strategy == "static":
        out = batching.static_generate(model, prompts, max_new, GREEDY, work=work)
    elif strategy == "ragged":
        out = batching.ragged_generate(model, requests, work=work)
    else:
        out = batching.continuous_generate(model, requests, slots=slots, work=work)
    return out, work, time.perf_counter() - start


results = {name: run(name, prompts, MAX_NEW, slots=2) for name in ("static", "ragged", "continuous")}
for name, (out, work, seconds) in results.items():
    assert [c.tokens for c in out] == solo, name  # every strategy gives each prompt its solo output
    print(f"{name:10s}: {work.steps:3d} forward calls, {work.rows:4d} token-rows computed ({work.needed_rows} needed, "
          f"{work.wasted_rows} wasted), {work.samples:3d} predictions drawn ({work.needed_samples} needed, "
          f"{work.wasted_samples} thrown away)")

# %% [markdown]
# The waste of static batching here follows from the seed's description alone: decoding starts at
# min_prompt_len = 1, so each 100-token prompt is fed positions 0-99 one per step and the 99 predictions for
# positions 1-99 are overwritten by the prompt: 3 × 99 = 297 thrown away. And the 1-token sequence, done after 20
# tokens, is still fed every position until the longest row ends at 100 + 20: 99 more rows and predictions for
# nothing (297 + 99 = 396).

# %%
static_out, static_work, _ = results["static"]
forced = sum(forced for call in static_work.log for (_, _, _, forced) in call)
min_len = min(len(p) for p in prompts)
assert forced == sum(len(p) - min_len for p in prompts) == 297
assert static_work.wasted_samples == 297 + 99 and static_work.wasted_rows == 99
assert results["ragged"][1].wasted_rows == results["ragged"][1].wasted_samples == 0
assert results["continuous"][1].wasted_rows == results["continuous"][1].wasted_samples == 0
print(f"static: {forced} forced prompt positions (the seed's 3 x 99)")

# %% [markdown]
# ## What each strategy computes, step by step
#
# One column per forward call, one row per sequence; each cell says what that sequence did in that call. A column
# is a call, not a unit of time: ragged's first column prefills 301 tokens in one matrix-matrix pass, while each
# orange column of the static loop feeds one token per row.

# %%
KINDS = ["not in the batch", "prefill (whole prompt)", "decode, prediction kept",
         "prompt token forced, prediction thrown away", "computed after the sequence was done"]
COLOURS = ["white", "tab:blue", "tab:green", "tab:orange", "tab:red"]


def timeline(work, completions):
    """[sequences, calls] kind index for every (sequence, forward call) of a work log."""
    needed_end = [len(c.prompt) + c.sampled for c in completions]  # positions whose predictions are used
    grid = np.zeros((len(completions), len(work.log)), int)
    for step, call in enumerate(work.log):
        for seq, first, n, was_forced in call:
            predicts = first + n  # the position whose token this call's prediction is for
            if was_forced:
                grid[seq, step] = 3
            elif predicts >= needed_end[seq]:
                grid[seq, step] = 4
            elif first == 0:
                grid[seq, step] = 1
            else:
                grid[seq, step] = 2
    return grid


notes = {"static": "", "ragged": "",
         "continuous": " (2 cache slots: the last two requests wait, then reuse the freed slots)"}
fig, axes = plt.subplots(3, 1, figsize=(15, 7.5), sharex=True)
longest = max(len(work.log) for _, work, _ in results.values())
for ax, (name, (out, work, _)) in zip(axes, results.items()):
    grid = timeline(work, out)
    padded = np.zeros((grid.shape[0], longest), int)
    padded[:, : grid.shape[1]] = grid
    ax.imshow(padded, cmap=ListedColormap(COLOURS), vmin=0, vmax=len(COLOURS) - 1, aspect="auto",
              interpolation="nearest")
    ax.set_yticks(range(len(prompts)), [f"prompt of {len(p)}" for p in prompts], fontsize=8)
    ax.set_title(f"{name}: {work.steps} forward calls, {work.wasted_rows} wasted token-rows, "
                 f"{work.wasted_samples} predictions thrown away{notes[name]}", fontsize=10, loc="left")
axes[-1].set_xlabel("forward call")
fig.legend([Patch(facecolor=c, edgecolor="grey") for c in COLOURS[1:]], KINDS[1:], loc="lower center", ncol=4,
           fontsize=9)
plt.tight_layout(rect=(0, 0.05, 1, 1))
plt.show()

# %% [markdown]
# The first steps of the static loop, as a table (sequence 0 is the 1-token prompt):

# %%
for step, call in enumerate(static_work.log[:4]):
    print(f"call {step}: " + " | ".join(
        f"seq {seq} feeds position {first}, predicts {first + n}: " + ("forced" if was_forced else "kept")
        for seq, first, n, was_forced in call))

# %% [markdown]
# ## A realistic mixed workload
#
# Sixteen prompts of random lengths between 1 and 200 tokens, 48 new tokens each (greedy). The static loop runs
# every row to the longest prompt plus 48; ragged and continuous (8 slots) compute only what the outputs use.

# %%
rng = np.random.default_rng(0)
story = llm.generate("", max_new_tokens=200, temperature=0)  # the model's greedy story (llama2.c's, notebook 06)
corpus = llm.tokenizer.encode(story * 2, bos=True)
mixed = [corpus[:n] for n in rng.integers(1, 201, 16)]
mixed_results = {name: run(name, mixed, 48, slots=8) for name in ("static", "ragged", "continuous")}
reference = [c.tokens for c in mixed_results["ragged"][0]]
for name, (out, work, seconds) in mixed_results.items():
    assert [c.tokens for c in out] == reference, name
    print(f"{name:10s}: {work.steps:3d} calls, {work.rows:5d} rows ({work.wasted_rows:5d} wasted), "
          f"{work.samples:4d} predictions ({work.wasted_samples:4d} thrown away), {seconds:.2f} s")

fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(15, 3.8))
names = list(mixed_results)
works = [mixed_results[n][1] for n in names]
ax0.bar(names, [w.needed_rows for w in works], color="tab:green", label="needed")
ax0.bar(names, [w.wasted_rows for w in works], bottom=[w.needed_rows for w in works], color="tab:red",
        label="wasted")
ax0.set_title("token-rows pushed through the layers")
ax0.legend()
ax1.bar(names, [w.needed_samples for w in works], color="tab:green")
ax1.bar(names, [w.wasted_samples for w in works], bottom=[w.needed_samples for w in works], color="tab:orange")
ax1.set_title("next-token predictions (orange: thrown away)")
ax2.bar(names, [mixed_results[n][2] for n in names], color="grey")
ax2.set_title("wall-clock seconds (this machine)")
plt.tight_layout()
plt.show()
assert works[0].wasted_rows > 0 and works[1].wasted_rows == works[2].wasted_rows == 0
