# %% [markdown]
# # 01 · Tokenization: text → token ids
#
# A Llama model never sees characters. It sees integers, one per *piece* of a fixed vocabulary: 512 pieces for
# the tiny `stories260K`, 32000 for Llama 2. This notebook runs npllm's two tokenizer implementations side by side:
#
# * `SentencePieceTokenizer` reads a `.model` file and lets the `sentencepiece` package encode;
# * `BPETokenizer` reads llama2.c's `tokenizer.bin` (just pieces and scores) and encodes with npllm's own BPE.
#
# They must agree id for id. Every function shown below is printed from the installed npllm with
# `inspect.getsource`, so what you read is what runs.
#
# stories260K's tokenizer files ship inside npllm. Llama 2's do not: the first cell says where to get them, and
# without them the notebook shows stories260K's vocabulary alone.

# %%
import inspect
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

import npllm
from npllm.hub import embedded, weights_dirs
from npllm.tokenizer import BPETokenizer, SentencePieceTokenizer, load_tokenizer
from npllm.tokenizer.stream import StreamDecoder

# stories260K's two tokenizer files ship inside npllm (npllm/data/stories260K), beside its checkpoint.
CHECKPOINT, TOK512_BIN = embedded("stories260K")
TOK512_MODEL = CHECKPOINT.with_name("tok512.model")

# Llama 2's tokenizer is not part of npllm. Where to get each file; the notebook runs without them (stories260K only).
LLAMA2_FILES = {
    "tokenizer.model": "run `npllm generate --model stories15M` once (npllm downloads it into its cache), or take "
                       "tokenizer.model from the Hugging Face repository hf-internal-testing/llama-tokenizer",
    "tokenizer.bin": "take tokenizer.bin from llama2.c's repository (https://github.com/karpathy/llama2.c)",
}


def llama2_file(name: str) -> Path | None:
    """A Llama 2 tokenizer file from <folder>/llama2-tokenizer/ ($NPLLM_WEIGHTS, npllm's cache, the repository's
    weights/ folder) or <folder>/stories15M/ (where npllm puts it with stories15M); None when none has it."""
    folders = [Path(d) / "llama2-tokenizer" for d in [*weights_dirs(), "../weights"]]
    folders += [Path(d) / "stories15M" for d in weights_dirs()]
    return next((d / name for d in folders if (d / name).is_file()), None)


def show(obj):
    """Display the source of an npllm function as it is installed."""
    display(Markdown(f"```python\n{inspect.getsource(obj)}```"))


# %% [markdown]
# ## Two vocabularies, two implementations each
#
# `load_tokenizer` picks the reader by the file's suffix.

# %%
tok = {
    ("stories260K", "sentencepiece"): load_tokenizer(TOK512_MODEL),
    ("stories260K", "npllm BPE"): load_tokenizer(TOK512_BIN),
}
missing = {name: how for name, how in LLAMA2_FILES.items() if llama2_file(name) is None}
if missing:
    print("Llama 2's tokenizer is not here, so this notebook shows stories260K's alone. To add Llama 2, put these "
          "files in $NPLLM_WEIGHTS/llama2-tokenizer/:\n" + "\n".join(f"  {n}: {how}" for n, how in missing.items()))
else:
    tok[("Llama 2", "sentencepiece")] = load_tokenizer(llama2_file("tokenizer.model"))
    tok[("Llama 2", "npllm BPE")] = load_tokenizer(llama2_file("tokenizer.bin"))
VOCABS = list(dict.fromkeys(vocab for vocab, _ in tok))  # "stories260K", then "Llama 2" where it is at hand
for (vocab, impl), t in tok.items():
    print(f"{vocab:12s} {impl:14s} {type(t).__name__:24s} V={t.vocab_size:5d}  BOS={t.bos_id} EOS={t.eos_id} "
          f"unk={t.unk_id}  dummy prefix={t.add_dummy_prefix}")

# The seed material's numbers: a 32000-piece Llama 2 vocabulary with <unk>=0, <s>=1, </s>=2; 512 pieces for
# stories260K. The notebook fails if the files say otherwise.
for (vocab, _), t in tok.items():
    assert t.vocab_size == {"stories260K": 512, "Llama 2": 32000}[vocab]
    assert (t.unk_id, t.bos_id, t.eos_id) == (0, 1, 2)

# %% [markdown]
# ## The seed's sentence
#
# `encode(text, bos=True)` puts BOS (`<s>`, id 1) in front. The pieces spell a space as `▁` (U+2581), so a word
# and its leading space are one piece: `▁cat`.

# %%
SENTENCE = "The cat sat on the mat curiously."
rows = []
for vocab in VOCABS:
    sp, bpe = tok[(vocab, "sentencepiece")], tok[(vocab, "npllm BPE")]
    ids_sp, ids_bpe = sp.encode(SENTENCE, bos=True), bpe.encode(SENTENCE, bos=True)
    assert ids_sp == ids_bpe, (vocab, ids_sp, ids_bpe)  # the two implementations agree id for id
    print(f"{vocab}: {len(ids_sp)} ids (same from both implementations)")
    print("  ids   ", ids_sp)
    print("  pieces", [sp.id_to_piece(i) for i in ids_sp])
    assert sp.decode(ids_sp) == SENTENCE  # and decoding gives the text back
    rows.append((vocab, ids_sp))

# %% [markdown]
# The small vocabulary has to spell `curiously` letter by letter; Llama 2 has `▁curious` and `ly`. A picture of
# the same sentence cut both ways (each box one token):

# %%
def draw_pieces(ax, tokenizer, ids, title):
    """One box per token: its piece inside, its id below."""
    x = 0.0
    colours = plt.cm.Pastel1.colors
    for i, token_id in enumerate(ids):
        piece = tokenizer.id_to_piece(token_id)
        width = 0.35 + 0.16 * len(piece)
        ax.add_patch(plt.Rectangle((x, 0), width, 1, facecolor=colours[i % len(colours)], edgecolor="grey"))
        ax.text(x + width / 2, 0.5, piece, ha="center", va="center", family="monospace", fontsize=9)
        ax.text(x + width / 2, -0.3, str(token_id), ha="center", va="center", fontsize=7, color="dimgrey")
        x += width + 0.05
    ax.set_xlim(0, 16)
    ax.set_ylim(-0.5, 1)
    ax.axis("off")
    ax.set_title(f"{title}: {len(ids)} tokens", loc="left", fontsize=10)


fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.3 * len(rows)), squeeze=False)
for ax, (vocab, ids) in zip(axes[:, 0], rows):
    draw_pieces(ax, tok[(vocab, "sentencepiece")], ids, vocab)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## How npllm's BPE encodes
#
# SentencePiece-style BPE, in four steps (`npllm/tokenizer/bpe.py`):
#
# 1. **normalise**: every space becomes `▁`, and one `▁` is put in front (the *dummy prefix*);
# 2. **split** into one symbol per character;
# 3. **merge**: among all adjacent pairs whose concatenation is a piece, join the one with the highest score,
#    $\arg\max_{i} \mathrm{score}(s_i s_{i+1})$ (ties: the leftmost), until no pair is a piece;
# 4. **emit** each symbol's id, or, for a character the vocabulary lacks, its UTF-8 bytes as `<0xXX>` pieces.

# %%
show(BPETokenizer._normalize)
show(BPETokenizer._encode_text)
show(BPETokenizer._emit)

# %% [markdown]
# ## The dummy-prefix space
#
# Because of step 1, `"cat"` and `" cat"` differ only by one extra `▁`: the first word of a text is spelled like
# any word after a space. Decoding removes that one leading space again.

# %%
demo = tok[(VOCABS[-1], "sentencepiece")]  # Llama 2's where it is at hand, else stories260K's
print(f"({VOCABS[-1]}'s vocabulary)")
for text in ["cat", " cat", "  two  spaces"]:
    ids = demo.encode(text, bos=False)
    print(f"{text!r:16} -> {ids} {[demo.id_to_piece(i) for i in ids]} -> decodes to {demo.decode(ids)!r}")


def pieces(text):
    return [demo.id_to_piece(i) for i in demo.encode(text, bos=False)]


# " cat" is "cat" with one more ▁ in front: the dummy prefix made the first word look like any other word.
assert pieces(" cat") == ["▁"] + pieces("cat")
assert pieces("cat") == {"Llama 2": ["▁cat"], "stories260K": ["▁c", "at"]}[VOCABS[-1]]

# %% [markdown]
# ## BOS, EOS and control pieces
#
# `<s>` and `</s>` are CONTROL pieces: structure, not text. They decode to nothing, and no text ever encodes to
# them (the string `"<s>"` is spelled with ordinary pieces).

# %%
ids = demo.encode("Hi", bos=True, eos=True)
print(ids, [demo.id_to_piece(i) for i in ids], [demo.token_type(i).name for i in ids], repr(demo.decode(ids)))
literal = demo.encode("<s>", bos=False)
print("the text '<s>' ->", literal, [demo.id_to_piece(i) for i in literal])
assert demo.bos_id not in literal

# %% [markdown]
# ## Byte fallback
#
# A character outside the vocabulary is not lost to `<unk>`: it is spelled as its UTF-8 bytes, one `<0xXX>` piece
# each. In 512 pieces even `日` has to be spelled that way; Llama 2 knows `日` and `本` but not the cat emoji.

# %%
TEXT = "日本 🐈"
for vocab in VOCABS:
    sp, bpe = tok[(vocab, "sentencepiece")], tok[(vocab, "npllm BPE")]
    ids = bpe.encode(TEXT, bos=False)
    assert ids == sp.encode(TEXT, bos=False)
    print(f"{vocab:12s}", [bpe.id_to_piece(i) for i in ids])
print("UTF-8 of 🐈:", " ".join(f"{b:02X}" for b in "🐈".encode()))

# %% [markdown]
# Printing token by token, a byte piece alone is not yet text. npllm's `StreamDecoder` holds the bytes of an
# unfinished character back until it is complete, so a stream never shows half a character:

# %%
show(StreamDecoder.feed)
stream = demo.stream_decoder()
for i in demo.encode("🐈!", bos=True):
    print(f"feed {i:5d} {demo.id_to_piece(i)!r:10} -> prints {stream.feed(i)!r}")
print("flush -> prints", repr(stream.flush()))

# %% [markdown]
# ## Both implementations on more text
#
# The test suite holds npllm's BPE to sentencepiece under Hypothesis; here is a quick tally over some varied text
# (tabs, runs of spaces, accents, CJK, emoji), and a picture of how long the pieces of each vocabulary are.

# %%
samples = [
    "Once upon a time, there was a little girl named Lily.",
    "\tTabs\tand   runs of   spaces  ",
    "Crème brûlée, naïve café — déjà vu.",
    "東京タワーは高い。 🗼✨",
    "x = f(y) + 2**10 // 3",
    "   leading spaces",
]
for vocab in VOCABS:
    sp, bpe = tok[(vocab, "sentencepiece")], tok[(vocab, "npllm BPE")]
    agree = sum(sp.encode(s) == bpe.encode(s) for s in samples)
    print(f"{vocab}: {agree}/{len(samples)} texts encode identically; tokens per text:",
          [len(sp.encode(s, bos=False)) for s in samples])
    assert agree == len(samples)

fig, ax = plt.subplots(figsize=(7, 3))
for vocab in VOCABS:
    t = tok[(vocab, "sentencepiece")]
    lengths = [len(t.id_to_piece(i)) for i in range(t.vocab_size) if t.token_type(i).name == "NORMAL"]
    ax.hist(lengths, bins=np.arange(1, 18) - 0.5, density=True, alpha=0.6, label=f"{vocab} (V={t.vocab_size})")
ax.set_xlabel("characters in a piece (▁ counts as one)")
ax.set_ylabel("share of the vocabulary")
ax.legend()
ax.set_title("A bigger vocabulary holds longer pieces, so a text needs fewer tokens")
plt.show()
