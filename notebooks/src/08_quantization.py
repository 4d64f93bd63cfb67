# %% [markdown]
# # 08 · Quantization: blocks, their error, their speed
#
# A GGUF file stores most matrices in *block types*: a run of 32 values (256 for the "K-quants") shares one or two
# float16 scales, and each value keeps only a few bits. `npllm.quant` reads every common type and writes the ones
# people make; `npllm.kernels.quant` multiplies by the blocks without widening them first.
#
# This notebook
#
# 1. **draws each block layout** (Q8_0, Q4_0, Q4_K, Q6_K) bit by bit. The pictures are not typed in by hand: every
#    bit of a block is flipped in turn and npllm's own `dequantize` says which values moved, so a picture cannot
#    disagree with the code that reads the files;
# 2. measures **the error of each type** on stories260K's real weights, per value and on the model's next-token
#    distribution (KL divergence, top-1 agreement);
# 3. sets out **speed and memory**: bytes per weight, model sizes, decode speed against llama.cpp's on the same
#    files (measured in `docs/bench.md`), and the float16 KV cache.

# %%
import inspect
import os

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display
from matplotlib.colors import ListedColormap

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # small model: one BLAS thread is faster and steadier

import npllm
from npllm import quant
from npllm.cache import RingKVCache
from npllm.evaluate import kl_divergence
from npllm.formats import read_checkpoint
from npllm.formats.random import NAMED_SHAPES
from npllm.hub import embedded
from npllm.models import make_model
from npllm.models.reference import Transformer
from npllm.tokenizer import load_tokenizer

# stories260K ships inside npllm: embedded() finds its checkpoint in the package (npllm/data/stories260K), and
# tok512.model, its 512 pieces as a SentencePiece model, sits beside it. No weights folder is needed.
CHECKPOINT, _ = embedded("stories260K")
TOK512_MODEL = CHECKPOINT.with_name("tok512.model")


def show(obj):
    """Display the source of an npllm function as it is installed."""
    display(Markdown(f"```python\n{inspect.getsource(obj)}```"))


config, weights = read_checkpoint(CHECKPOINT)
tokenizer = load_tokenizer(TOK512_MODEL)

# %% [markdown]
# ## 1 · Block layouts
#
# Each type's `dequantize_*` docstring draws its block in words. Q4_0, the simplest 4-bit type:

# %%
show(quant.dequantize_q4_0)

# %% [markdown]
# To draw a layout from the code itself, take a block of random bytes (its float16 scales set to 1, so every value
# is finite), flip each of its bits in turn, dequantize, and record which of the block's values changed:
#
# * a bit that moves **exactly one value** is one of that value's bits (its integer q);
# * a bit that moves **a run of values** belongs to a scale (or min): the whole block's, or one sub-block's.

# %%
HALF_ONE = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
SCALE_AT = {"Q8_0": [0], "Q4_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}  # where each type keeps its float16 scales


def bit_roles(type_name: str, seeds: int = 6) -> np.ndarray:
    """For every bit of one block, the values it moves in any of `seeds` random blocks (a scale bit leaves a value
    whose integer is 0 unmoved; over several blocks it moves them all): boolean [block_bytes, 8, block_size]."""
    t = quant.TYPES[type_name]
    moved = np.zeros((t.block_bytes, 8, t.block_size), bool)
    for seed in range(seeds):
        block = np.random.default_rng(seed).integers(0, 256, t.block_bytes).astype(np.uint8)
        for at in SCALE_AT[type_name]:
            block[at:at + 2] = HALF_ONE
        before = quant.dequantize(block, type_name)
        for byte in range(t.block_bytes):
            for bit in range(8):
                flipped = block.copy()
                flipped[byte] ^= np.uint8(1 << bit)
                with np.errstate(all="ignore"):  # a flipped exponent bit may make a scale infinite: that moves too
                    moved[byte, bit] |= ~(quant.dequantize(flipped, type_name) == before)
    return moved


def owners(moved: np.ndarray) -> np.ndarray:
    """Per bit: the value it belongs to (>= 0), -1 for a whole-block scale, -2 for a sub-block scale, -3 unused."""
    count = moved.sum(axis=-1)
    owner = np.where(count == 1, moved.argmax(axis=-1), -3)
    owner[count == moved.shape[-1]] = -1
    owner[(count > 1) & (count < moved.shape[-1])] = -2
    return owner


roles = {name: owners(bit_roles(name)) for name in ("Q8_0", "Q4_0", "Q4_K", "Q6_K")}
for name, owner in roles.items():
    t = quant.TYPES[name]
    value_bits = (owner >= 0).sum()
    print(f"{name}: {t.block_bytes} bytes = {8 * t.block_bytes} bits for {t.block_size} values: "
          f"{value_bits} value bits ({value_bits // t.block_size} per value), {(owner == -1).sum()} bits of "
          f"block scales, {(owner == -2).sum()} bits of sub-block scales and mins")
    assert value_bits == t.block_size * {"Q8_0": 8, "Q4_0": 4, "Q4_K": 4, "Q6_K": 6}[name]
    assert np.all(np.bincount(owner[owner >= 0], minlength=t.block_size) == value_bits // t.block_size)

# %% [markdown]
# Drawn: one column per byte (bit 0 at the bottom), 32 bytes per strip. A value's bits take the value's colour (the
# colour runs from value 0, dark, to the block's last value, light) and carry its index, once per nibble; block
# scales are red, sub-block scales and mins orange.

# %%
def draw_block(name: str, owner: np.ndarray, ax_rows) -> None:
    t = quant.TYPES[name]
    values = plt.get_cmap("viridis", t.block_size)
    colours = np.vstack([[0.85, 0.85, 0.85, 1], [0.95, 0.6, 0.2, 1], [0.85, 0.2, 0.2, 1],
                         values(np.arange(t.block_size))])
    cmap = ListedColormap(colours)  # -3 unused, -2 sub-block scale, -1 block scale, then values
    for strip, ax in enumerate(ax_rows):
        first = 32 * strip
        part = owner[first:first + 32]
        image = np.full((8, 32), -3)
        image[:, :len(part)] = part.T
        ax.imshow(image + 3, cmap=cmap, vmin=0, vmax=len(colours) - 1, origin="lower", aspect="auto",
                  interpolation="nearest")
        for byte in range(len(part)):
            for nibble in (0, 1):
                bits = part[byte, 4 * nibble:4 * nibble + 4]
                if bits[0] >= 0 and np.all(bits == bits[0]):
                    ax.text(byte, 4 * nibble + 1.5, str(bits[0]), ha="center", va="center", fontsize=5.5,
                            color="white" if bits[0] < t.block_size / 2 else "black")
        ax.set_yticks([0, 7])
        ax.set_xticks(range(0, 32, 4))
        ax.set_xticklabels([str(first + b) for b in range(0, 32, 4)], fontsize=7)
        ax.set_ylabel(f"bytes {first}-{min(first + 31, t.block_bytes - 1)}", fontsize=7)
    ax_rows[0].set_title(f"{name}: {t.block_bytes} bytes, {t.block_size} values, "
                         f"{t.bits_per_value:g} bits per value", fontsize=9)


strips = {name: -(-quant.TYPES[name].block_bytes // 32) for name in roles}
fig, axes = plt.subplots(sum(strips.values()), 1, figsize=(11, 1.0 * sum(strips.values()) + 1.5))
row = 0
for name, owner in roles.items():
    draw_block(name, owner, axes[row:row + strips[name]])
    row += strips[name]
fig.tight_layout()
plt.show()

# %% [markdown]
# What the pictures say, each one checked here against the bits:
#
# * **Q8_0**: bytes 0-1 the scale d, then value j in byte 2 + j.
# * **Q4_0**: after d, byte 2 + j holds value j in its low nibble and value j + 16 in its high nibble (not j and
#   j + 1: a kernel takes the 16 low nibbles as values 0-15 in one vector operation).
# * **Q4_K**: d and dmin, then 12 bytes of eight 6-bit scales and eight 6-bit mins (the high two bits of the last
#   four scales and mins sit in bits 6-7 of bytes 4-11), then four runs of 32 bytes: run r holds sub-block 2r in its
#   low nibbles and sub-block 2r + 1 in its high nibbles.
# * **Q6_K**: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs (bits 0-1 of byte 128 + l go to value l, bits
#   2-3 to l + 32, 4-5 to l + 64, 6-7 to l + 96), 16 int8 sub-block scales, and d last.

# %%
q8, q4, q4k, q6k = roles["Q8_0"], roles["Q4_0"], roles["Q4_K"], roles["Q6_K"]
assert np.all(q8[:2] == -1) and all(np.all(q8[2 + j] == j) for j in range(32))
assert all(np.all(q4[2 + j, :4] == j) and np.all(q4[2 + j, 4:] == j + 16) for j in range(16))
assert np.all(q4k[:4] == -1) and np.all(q4k[4:16] == -2)
assert all(np.all(q4k[16 + 32 * r + l, :4] == 64 * r + l) and np.all(q4k[16 + 32 * r + l, 4:] == 64 * r + 32 + l)
           for r in range(4) for l in range(32))
assert all(q6k[128 + l, 2 * k] == l + 32 * k for k in range(4) for l in range(32))  # first half's high bits
assert np.all(q6k[192:208] == -2) and np.all(q6k[208:] == -1)
print("every layout statement above holds for npllm's dequantizers")

# %% [markdown]
# ## 2 · The error of each type on real weights
#
# stories260K's matrices are 64 or 172 values wide, and the K-quants need rows of 256, so the values of every
# matrix are taken together, in order, as rows of 256 (1,012 rows): the error depends on the values and how they
# group, and each block then sees 32 or 256 consecutive values of one matrix, as in a real file. Each type
# quantizes with npllm's quantizer (`quant.quantize`, the same bytes as llama.cpp's reference for the 32-value
# types; npllm's own scale choice for the K-quants, see docs/quant.md), then dequantizes.

# %%
matrices = {name: np.asarray(w, np.float32) for name, w in weights.items() if w.ndim == 2}
values = np.concatenate([w.reshape(-1) for w in matrices.values()])
rows = values[: len(values) // 256 * 256].reshape(-1, 256)
TYPE_NAMES = ["F16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "Q3_K", "Q2_K"]


def round_trip(x: np.ndarray, type_name: str) -> np.ndarray:
    """x stored as type_name and read back.  # [N, K] -> [N, K], K a multiple of the type's block"""
    return quant.dequantize(quant.quantize(x, type_name), type_name, x.shape)


errors = {}
for name in TYPE_NAMES:
    back = round_trip(rows, name)
    errors[name] = float(np.sqrt(np.mean((back - rows) ** 2)) / np.sqrt(np.mean(rows ** 2)))
bits = {name: quant.TYPES[name].bits_per_value for name in TYPE_NAMES}

fig, ax = plt.subplots(figsize=(7, 4))
ax.scatter([bits[n] for n in TYPE_NAMES], [errors[n] for n in TYPE_NAMES], color="tab:blue")
for n in TYPE_NAMES:
    ax.annotate(n, (bits[n], errors[n]), textcoords="offset points", xytext=(5, 3), fontsize=8)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("bits per weight")
ax.set_ylabel("relative RMS error  |W' - W| / |W|")
ax.set_title(f"stories260K's {len(values):,} weights, each type")
ax.grid(alpha=0.3, which="both")
plt.show()
for n in TYPE_NAMES:
    print(f"{n:5s} {bits[n]:7.4g} bits/weight   relative RMS error {errors[n]:.4f}")
assert errors["Q8_0"] < errors["Q6_K"] < errors["Q5_K"] < errors["Q4_K"] < errors["Q3_K"] < errors["Q2_K"]
assert errors["Q5_1"] < errors["Q4_1"] and errors["Q5_0"] < errors["Q4_0"] and errors["F16"] < errors["Q8_0"]

# %% [markdown]
# Per value, Q8_0 is already ~16x closer than the 4-bit types. What matters is the model's output: the next-token
# distribution of the model with every matrix stored in a type, against the float model's, over llama2.c's greedy
# story in chunks of 64 tokens, each scored on its second half (the measure llama.cpp's `--kl-divergence`
# reports: mean KL(float ‖ quantized), and how often both pick the same top token). Each matrix's rows are
# zero-padded to whole blocks (a zero changes no 32-value block's scale; a K-quant's super-block scale sees the same
# largest values).

# %%
def stored_as(w: np.ndarray, type_name: str) -> np.ndarray:
    """A matrix as type_name stores it, rows zero-padded to whole blocks, then cut back.  # [N, K] -> [N, K]"""
    block = quant.TYPES[type_name].block_size
    padded = np.zeros((w.shape[0], -(-w.shape[1] // block) * block), np.float32)
    padded[:, :w.shape[1]] = w
    return round_trip(padded, type_name)[:, :w.shape[1]]


base = Transformer(config, weights)
story = npllm.LLM(base, tokenizer).generate("", max_new_tokens=200, temperature=0)  # llama2.c's too (notebook 06)
ids = tokenizer.encode(story, bos=True)
divergence = {}
for name in ["Q8_0", "Q6_K", "Q4_K", "Q4_0"]:
    stored = {k: stored_as(np.asarray(w, np.float32), name) if w.ndim == 2 else w for k, w in weights.items()}
    divergence[name] = kl_divergence(Transformer(config, stored), base, ids, ctx=64)
    d = divergence[name]
    print(f"{name}: mean KL {d.mean_kl:.2e} nats, top-1 agreement {100 * d.top1_agreement:.1f}% over {d.tokens} "
          f"tokens; perplexity {d.ppl:.4f} (float {d.base_ppl:.4f})")
assert divergence["Q8_0"].mean_kl < 1e-3 and divergence["Q8_0"].top1_agreement >= 0.98
assert divergence["Q8_0"].mean_kl < divergence["Q6_K"].mean_kl < divergence["Q4_0"].mean_kl

# %% [markdown]
# Q8_0 meets the quality bar of issue 12 (mean KL below 1e-3, top-1 agreement at least 98%); the 4-bit types move
# this tiny model's choices at one position in five to ten (a model of 260K parameters has little redundancy to
# spare; larger models are said to lose less, which this notebook does not measure).
#
# ## 3 · Speed and memory
#
# Bytes per weight decide the memory a model takes and, at batch 1, the time of a decode step (every weight is read
# once per token). The sizes of the stories110M shape's matrices in each type, from `quant.TYPES`:

# %%
shape = NAMED_SHAPES["stories110M"]
matrix_values = shape.n_params - shape.dim * (2 * shape.n_layers + 1)  # the norms stay float32
print(f"stories110M: {shape.n_params:,} parameters, {matrix_values:,} in matrices")
for name in ["F32", "F16", "Q8_0", "Q6_K", "Q4_K", "Q4_0"]:
    t = quant.TYPES[name]
    mib = matrix_values * t.bits_per_value / 8 / 2**20
    print(f"  {name:5s} {t.bits_per_value:7.4g} bits/weight   {mib:7.1f} MiB   {32 / t.bits_per_value:4.1f}x smaller "
          f"than F32")

# %% [markdown]
# Measured (docs/bench.md) with `LLAMA_BENCH_ARGS="--repack 0" python scripts/bench/bench_pairs.py stories110M 2 1
# F32,Q8_0,Q4_0,Q4_K_M,Q5_K_M,Q3_K_M,Q2_K` (since replaced by `bash scripts/bench/bench_llama_cpp.sh`), which ran llama.cpp's `llama-bench` and `npllm bench` on the same GGUF files
# (random weights of the stories110M shape, quantized by llama.cpp's own `llama-quantize`), type after type, so each
# pair comes from the same minute of a shared 2-core machine: decode after a 128-token prompt, two threads. Quoted
# here, not re-measured, so the notebook runs in seconds:

# %%
measured = {  # file: (MB on disk, decode tok/s npllm, llama.cpp), one round of the command above
    "F32": (438.8, 63.0, 53.6), "Q8_0": (117.2, 180.8, 104.6), "Q5_K_M": (81.1, 144.0, 126.0),
    "Q4_K_M": (72.1, 185.5, 144.2), "Q4_0": (68.7, 194.2, 135.7), "Q3_K_M": (62.0, 186.1, 177.6),
    "Q2_K": (52.2, 159.4, 178.6),
}
fig, ax = plt.subplots(figsize=(7, 4))
for name, (mb, ours, theirs) in measured.items():
    ax.scatter(mb, ours, color="tab:orange", label="npllm" if name == "F32" else None)
    ax.scatter(mb, theirs, color="tab:gray", marker="x", label="llama.cpp" if name == "F32" else None)
    ax.annotate(f"{name} {ours / theirs:.2f}x", (mb, ours), textcoords="offset points", xytext=(6, 2), fontsize=8)
ax.set_xscale("log", base=2)
ax.set_xlabel("MB of weights read per decode step (the file)")
ax.set_ylabel("decode tokens / s (2 threads)")
ax.set_title("stories110M: decode speed against bytes, npllm and llama.cpp on the same files")
ax.legend()
ax.grid(alpha=0.3, which="both")
plt.show()
print(f"Q8_0 reads {measured['F32'][0] / measured['Q8_0'][0]:.1f}x fewer bytes than F32 and decodes "
      f"{measured['Q8_0'][1] / measured['F32'][1]:.1f}x faster")

# %% [markdown]
# A decode step reads every weight once, so fewer bytes make faster steps until the arithmetic that unpacks them
# binds: Q8_0 reads 3.7x fewer bytes than F32 and runs ~2.9x faster; below it the 4-bit types gain little more on
# two cores. npllm multiplies integers, as llama.cpp does: each product's activations are quantized to 8 bits per
# block of 32, each weight block meets them in an integer dot product (`vpdpbusd`), and the rows are interleaved by
# eight at load so that one vector instruction advances eight rows (docs/quant.md). Q2_K and Q3_K take their
# activations in two 8-bit parts (15 bits), which keeps their files within the quality bar at the cost of twice the
# dot products: the one type here where llama.cpp decodes faster is Q2_K.
#
# What a process holds while it runs one of these files: the peak resident memory of `npllm generate --model FILE
# "Once upon a time" --max-new-tokens 32 --temperature 0` (`/usr/bin/time -f %M`, two runs a file). Above the file's
# bytes are the interpreter, NumPy, Numba and npllm's compiled code, loaded before the weights so that the
# compiler's own pages and LLVM's modules are handed back first (docs/quant.md, "The compiler's pages, then the
# weights"). Quoted, not re-measured:

# %%
peak_mib = {"F32": 530.0, "Q8_0": 220.9, "Q5_K_M": 185.9, "Q4_K_M": 178.5, "Q4_0": 173.1, "Q2_K": 158.7}
for name, peak in peak_mib.items():
    file_mib = measured[name][0] * 1e6 / 2**20
    print(f"{name:7s} file {file_mib:6.1f} MiB   peak {peak:6.1f} MiB = file + {peak - file_mib:5.1f}   "
          f"{peak / peak_mib['F32']:.2f}x the F32 model's")

# %% [markdown]
# The KV cache is the other memory a model takes, and after a long prompt at batch 8 it is what attention reads
# every step. `kv_dtype="float16"` halves it (`npllm.load(..., kv_dtype="float16")`, `--kv-dtype float16`):

# %%
shape15 = NAMED_SHAPES["stories15M"]
for kv in (np.float32, np.float16):
    cache = RingKVCache(shape15, capacity=512 + 256, slots=8, dtype=kv)
    print(f"stories15M, 8 sequences x 768 positions, {np.dtype(kv).name} cache: {cache.nbytes / 2**20:.1f} MiB")
assert RingKVCache(shape15, 768, 8, np.float16).nbytes * 2 == RingKVCache(shape15, 768, 8, np.float32).nbytes

half = make_model(config, weights, "numpy", kv_dtype="float16")
prompt = ids[:64]
full_logits = base.logits(prompt)
half_logits = half.logits(prompt)  # on a fresh cache from half.new_cache(): float16
print(f"stories260K, 64 tokens: largest logit change with a float16 cache {np.abs(half_logits - full_logits).max():.4f}"
      f" (logits up to {np.abs(full_logits).max():.1f}); same top token at "
      f"{np.mean(half_logits.argmax(-1) == full_logits.argmax(-1)):.0%} of positions")
