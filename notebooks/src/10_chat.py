# %% [markdown]
# # 10 · Chat: a template, the tokens of a turn, and a cache that survives turns
#
# An instruct model answers well only inside the text layout it was tuned on: its **chat template**, a Jinja
# program shipped in `tokenizer_config.json` (or GGUF's `tokenizer.chat_template`). `npllm.chat` renders templates
# exactly as transformers' `apply_chat_template` does; `ChatSession` (behind `LLM.chat` and `npllm chat`) renders
# the whole conversation every turn and lets the model run only the tokens its KV cache does not hold yet.
#
# stories260K is not an instruct model and ships no template, so its replies are stories whatever is asked; the
# built-in ChatML template (`chat_template="chatml"`) shows the machinery all the same.

# %%
import inspect
import time

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display
from matplotlib.patches import Patch

import npllm
from npllm.chat import BUILTIN_TEMPLATES, render_chat_template
from npllm.chat.session import ChatSession
from npllm.context import Context, common_prefix

llm = npllm.load("stories260K")  # the copy shipped inside npllm, with its llama2.c tokenizer (tok512.bin)
tok = llm.tokenizer


def show(obj):
    """Display the source of an npllm function as it is installed."""
    display(Markdown(f"```python\n{inspect.getsource(obj)}```"))

# %% [markdown]
# ## A template rendered
#
# The same conversation through two built-in templates: ChatML (Qwen, many fine-tunes) marks each message with
# `<|im_start|>role` ... `<|im_end|>`; Llama 2 folds the system prompt into the first `[INST]` block between
# `<<SYS>>` marks and closes each exchange with EOS. `add_generation_prompt=True` ends with what opens the
# assistant's turn, which is where the model takes over.

# %%
conversation = [{"role": "system", "content": "You tell short stories."},
                {"role": "user", "content": "Tell me about a cat."},
                {"role": "assistant", "content": "Once upon a time, a cat sat in the sun."},
                {"role": "user", "content": "What did the cat do next?"}]
print(BUILTIN_TEMPLATES["chatml"])
for name in ("chatml", "llama2"):
    text = render_chat_template(BUILTIN_TEMPLATES[name], conversation, add_generation_prompt=True,
                                bos_token="<s>", eos_token="</s>")
    display(Markdown(f"**{name}**\n```text\n{text}\n```"))

# %% [markdown]
# ## The tokens of a turn
#
# The rendered text is tokenized in one go (BOS/EOS written by the template become their ids). With stories260K's
# 512-piece vocabulary the markup is expensive: `<|im_start|>` is not one special token here but several pieces.
# Each box is one token, coloured by what it spells: template markup, the system message, the user's words.

# %%
session = ChatSession(llm, "chatml", system="You tell short stories.")
turn = session.messages + [{"role": "user", "content": "Tell me about a cat."}]
ids = session.prompt_ids(turn)
text = tok.decode(ids)
spans = {"system": text.find("You tell short stories."), "user": text.find("Tell me about a cat.")}
lengths = {"system": len("You tell short stories."), "user": len("Tell me about a cat.")}
ends = [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]  # each token's end in the text
starts = [0] + ends[:-1]


def kind(start, end):
    for role, at in spans.items():
        if at <= start and end <= at + lengths[role]:
            return role
    return "template"


colours = {"template": "#d9d9d9", "system": "#fdd49e", "user": "#9ecae1"}
fig, ax = plt.subplots(figsize=(11, 2.6))
x, y = 0.0, 0.0
for i, (a, b) in enumerate(zip(starts, ends)):
    piece = tok.id_to_piece(ids[i]).replace("\u2581", "\u2423")
    width = 0.18 + 0.11 * len(piece)
    if x + width > 11:
        x, y = 0.0, y - 1.0
    ax.add_patch(plt.Rectangle((x, y), width - 0.05, 0.8, color=colours[kind(a, b)]))
    ax.text(x + (width - 0.05) / 2, y + 0.4, piece, ha="center", va="center", fontsize=7, family="monospace")
    x += width
ax.set_xlim(0, 11)
ax.set_ylim(y - 0.2, 1)
ax.axis("off")
ax.legend(handles=[Patch(color=c, label=k) for k, c in colours.items()], loc="upper right", ncol=3, fontsize=8,
          bbox_to_anchor=(1, 1.25))
ax.set_title(f"{len(ids)} tokens of the first turn (ChatML on stories260K's vocabulary)", fontsize=10)
plt.show()
counts = {k: sum(kind(a, b) == k for a, b in zip(starts, ends)) for k in colours}
print(counts)
assert tok.decode(ids) == render_chat_template(BUILTIN_TEMPLATES["chatml"], turn, add_generation_prompt=True)

# %% [markdown]
# ## The cache across turns
#
# Every turn sends the whole conversation. `Context.prefill` finds the longest common prefix with the tokens its
# cache holds, rewinds the cache there (`RingKVCache.rewind`) and runs only the rest:

# %%
show(Context.prefill)

# %% [markdown]
# Five turns of a conversation, each answered twice: by the kept session (cache reused) and by a fresh one (the
# whole conversation prefilled). The greedy replies must be identical; what differs is the work.

# %%
questions = ["Tell me about a cat.", "What did the cat do next?", "Was there a dog?", "How did it end?",
             "Tell me another one."]
kept = ChatSession(llm, "chatml", system="You tell short stories.")
"".join(ChatSession(llm, "chatml").stream([{"role": "user", "content": "Hi"}], 2))  # a warm-up: compiled code loaded
rows = []
for q in questions:
    messages = kept.messages + [{"role": "user", "content": q}]
    prompt = kept.prompt_ids(messages)
    reused = common_prefix(kept.context.tokens, prompt)
    before = kept.context.prefilled
    marks = []
    start = time.perf_counter()
    reply = "".join(kept.send(q, 24, temperature=0.0,
                              on_step=lambda s: marks or marks.append(time.perf_counter())))
    kept_ms = 1e3 * (marks[0] - start)
    fresh_session = ChatSession(llm, "chatml", system="You tell short stories.")
    fresh_marks = []
    start = time.perf_counter()
    fresh = "".join(fresh_session.stream(messages, 24, temperature=0.0,
                                         on_step=lambda s: fresh_marks or fresh_marks.append(time.perf_counter())))
    assert fresh == reply  # reuse changes the work, not the answer
    rows.append(dict(prompt=len(prompt), reused=reused, prefilled=len(prompt) - reused,
                     generated=kept.context.prefilled - before - (len(prompt) - reused) + 1,
                     kept_ms=kept_ms, fresh_ms=1e3 * (fresh_marks[0] - start)))

fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.2))
turns = np.arange(1, len(rows) + 1)
reused = np.array([r["reused"] for r in rows])
prefilled = np.array([r["prefilled"] for r in rows])
generated = np.array([r["generated"] for r in rows])
ax.barh(turns, reused, color="#bdbdbd", label="in the cache (reused)")
ax.barh(turns, prefilled, left=reused, color="#3182bd", label="prefilled this turn")
ax.barh(turns, generated, left=reused + prefilled, color="#fd8d3c", label="reply (fed back one by one)")
ax.invert_yaxis()
ax.set_xlabel("tokens of the conversation")
ax.set_ylabel("turn")
ax.legend(fontsize=8, loc="upper right")
ax.set_title("what each turn runs through the model", fontsize=10)
bx.plot(turns, [r["fresh_ms"] for r in rows], "o-", color="C3", label="fresh cache: whole conversation")
bx.plot(turns, [r["kept_ms"] for r in rows], "o-", color="C0", label="kept cache: new tokens only")
bx.set_xlabel("turn")
bx.set_ylabel("time to first token (ms)")
bx.set_ylim(bottom=0)
bx.set_xticks(turns)
bx.legend(fontsize=8)
bx.set_title("time to first token (shared machine: indicative)", fontsize=10)
plt.tight_layout()
plt.show()
for t, r in zip(turns, rows):
    print(f"turn {t}: conversation {r['prompt']} tokens, {r['reused']} reused, {r['prefilled']} prefilled; "
          f"TTFT kept {r['kept_ms']:.1f} ms, fresh {r['fresh_ms']:.1f} ms")
assert all(r["prefilled"] < 80 for r in rows[1:])  # a turn costs its new tokens, not the conversation's
assert rows[-1]["prompt"] > 4 * rows[-1]["prefilled"]

# %% [markdown]
# Why the common prefix covers the whole previous turn here: the reply's tokens were drawn by the model, decoded to
# text, stored in the conversation, and tokenized again inside the next render. When that round trip gives the same
# tokens (as it does for this vocabulary and this reply), everything up to the new user message is reused; when it
# does not (a tokenizer that would merge differently), the prefix ends earlier and the rest is recomputed, which
# costs time but never changes the answer (the assert above). `scripts/bench/bench_chat.py` measures the same over a
# conversation that grows until the context is full.
