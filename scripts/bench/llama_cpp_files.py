"""GGUF files written by llama.cpp's own quantizer, loaded and run by npllm: each file's tensor types as npllm keeps
them, and the quality bar of issue 12 (mean KL divergence of npllm's next-token distribution from the exact
dequantized model <= 1e-3, top-1 agreement >= 98%, llama.cpp's --kl-divergence measure).

    python scripts/bench/llama_cpp_files.py [--model stories260K-wide|SHAPE] [--types Q8_0 Q4_K_M ...] [--ctx 128]

llama.cpp's `llama-quantize` is the build scripts/bench/build_llama_cpp.sh makes in $LLAMA_CPP_DIR (default
/tmp/npllm-llama.cpp); files go to $GGUF_DIR (default /tmp/npllm-bench-gguf). K-quants need rows that are multiples
of 256 (llama.cpp falls back to Q5_0/Q8_0 elsewhere), which stories260K's 64 and 172 are not, so the default source
is stories260K *widened*: the same function at dim 256 and FFN 256 (widen() below), written as an F32 GGUF; the
text scored is stories sampled from it (a real model's peaked distributions, where top-1 agreement means
something). `--model SHAPE` takes a random-weight model of a named shape instead (e.g. stories110M: its top-1
agreement is low for every engine, since random logits have near-ties). For each preset:

    llama-quantize SHAPE-F32.gguf SHAPE-PRESET.gguf PRESET
    npllm:  npllm.load(file) (numba, weights kept in their types: every block type's products on 8-bit
            activations, on rows interleaved by eight)  vs  the numpy reference on the file's weights dequantized
            (the exact dequantized model), on the same token ids.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import npllm
from npllm.evaluate import DECISIVE_LEAD, kl_divergence
from npllm.formats import read_checkpoint
from npllm.models import make_model

PRESETS = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S",
           "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS"]


def widen(config, weights, dim: int, hidden: int):
    """The same function at a wider dim and FFN. Padded dims of the residual stream stay zero (zero embedding
    columns, zero rows of wo and w2); RMSNorm then averages over dim/D times more entries, so its gain is scaled by
    sqrt(D/dim) and its epsilon by D/dim: g' x / sqrt(sum x^2 / dim + eps') = g x / sqrt(sum x^2 / D + eps). The
    FFN's extra units add silu(0) * 0 = 0. Heads keep their size (head_dim stays config.head_dim)."""
    D, F = config.dim, config.hidden_dim
    gain = np.float32(np.sqrt(D / dim))

    def pad(w, rows, cols):
        out = np.zeros((rows, cols), np.float32)
        out[:w.shape[0], :w.shape[1]] = w
        return out

    wide = {}
    for name, w in weights.items():
        kind = name.split(".")[-1]
        if w.ndim == 1:  # attention_norm, ffn_norm, norm
            wide[name] = np.concatenate([w * gain, np.zeros(dim - D, np.float32)])
        elif kind in ("wq", "wk", "wv", "tok_embeddings", "output"):
            wide[name] = pad(w, w.shape[0], dim)
        elif kind == "wo":
            wide[name] = pad(w, dim, w.shape[1])
        elif kind in ("w1", "w3"):
            wide[name] = pad(w, hidden, dim)
        elif kind == "w2":
            wide[name] = pad(w, dim, hidden)
        else:
            raise ValueError(f"widen: unexpected weight {name}")
    return config.replace(dim=dim, hidden_dim=hidden, norm_eps=config.norm_eps * D / dim,
                          head_dim=config.head_dim), wide


def source(model: str, out: Path, stories: int) -> tuple[Path, list[int]]:
    """(the F32 GGUF every preset is quantized from, the token ids to score): stories260K widened to 256 with
    stories sampled from it, or a named shape's random weights with random ids."""
    from npllm.formats.gguf_write import write_gguf
    from npllm.tokenizer import load_tokenizer

    if model == "stories260K-wide":
        from npllm.formats.llama2c import read_llama2c

        config, weights = widen(*read_llama2c("weights/stories260K/stories260K.bin"), 256, 256)
        tokenizer = load_tokenizer("weights/stories260K/tok512.bin")
        path = out / "stories260K-wide-F32.gguf"
        write_gguf(path, config, weights, "F32", tokenizer)
        llm = npllm.load(path)
        ids = []
        for seed in range(1, stories + 1):
            ids += [config.bos_id] + list(llm.generate_ids([config.bos_id], 256, temperature=1.0, top_p=0.95,
                                                           seed=seed))
        return path, ids
    from npllm.formats.random import NAMED_SHAPES, random_weights

    path = out / f"{model}-F32.gguf"
    if not path.exists():
        config = NAMED_SHAPES[model]
        write_gguf(path, config, random_weights(config), "F32", load_tokenizer(llama2_tokenizer()))
    return path, [int(i) for i in np.random.default_rng(0).integers(3, 32000, 4 * 128)]


def llama2_tokenizer() -> Path:
    """The Llama 2 vocabulary the random shapes are written with: weights/llama2-tokenizer/tokenizer.model in the
    repository, else in a folder named models are looked for ($NPLLM_WEIGHTS, the user cache)."""
    from npllm.hub import weights_dirs

    for folder in [Path("weights"), *weights_dirs()]:
        if (path := folder / "llama2-tokenizer" / "tokenizer.model").is_file():
            return path
    raise SystemExit("no llama2-tokenizer/tokenizer.model in weights/ or $NPLLM_WEIGHTS: the random shapes need it")


def llama_cpp_folders() -> tuple[Path, Path] | None:
    """($LLAMA_CPP_DIR, where llama-quantize is built; $GGUF_DIR, created), or None, the reason on stderr."""
    build = Path(os.environ.get("LLAMA_CPP_DIR", "/tmp/npllm-llama.cpp"))
    out = Path(os.environ.get("GGUF_DIR", "/tmp/npllm-bench-gguf"))
    if not (build / "bin" / "llama-quantize").exists():
        print(f"no {build}/bin/llama-quantize: build llama.cpp first (scripts/bench/build_llama_cpp.sh)", file=sys.stderr)
        return None
    out.mkdir(parents=True, exist_ok=True)
    return build, out


def quantize(build: Path, source: Path, preset: str, out: Path) -> Path:
    path = out / f"{source.stem.replace('-F32', '')}-llamacpp-{preset}.gguf"
    if not path.exists():
        subprocess.run([str(build / "bin" / "llama-quantize"), str(source), str(path), preset, str(os.cpu_count())],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def check(path: Path, ids: list[int], ctx: int):
    """(npllm's tensor types with their MB, the Divergence of npllm's numba model from the exact dequantized one)."""
    model = npllm.load(path).model  # numba: the file's types kept
    config, dequantized = read_checkpoint(path)  # every matrix dequantized to float32
    exact = make_model(config, dequantized, "numpy")
    return model.weight_types, kl_divergence(model, exact, ids, ctx)


def size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="stories260K-wide", help="stories260K-wide or a named random shape")
    parser.add_argument("--types", nargs="+", default=PRESETS)
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--stories", type=int, default=24, help="stories sampled as the text (stories260K-wide)")
    args = parser.parse_args()
    if (folders := llama_cpp_folders()) is None:
        return 1
    build, out = folders
    src, ids = source(args.model, out, args.stories)
    print(f"{args.model}: {len(ids)} tokens scored in chunks of {args.ctx}; load average {os.getloadavg()[0]:.2f}")
    print(f"| llama.cpp preset | file | tensors as npllm holds them | mean KL | top-1 (positions) | top-1 where the "
          f"reference leads by >= {DECISIVE_LEAD} (positions) | bar |")
    print("|---|---|---|---|---|---|---|")
    failed = 0
    for preset in args.types:
        start = time.perf_counter()
        path = quantize(build, src, preset, out)
        types, d = check(path, ids, args.ctx)
        ok = d.mean_kl <= 1e-3 and d.top1_agreement >= 0.98
        failed += not ok
        held = ", ".join(f"{t} {size(b)}" for t, b in sorted(types.items(), key=lambda kv: -kv[1]))
        print(f"| {preset} | {size(path.stat().st_size)} | {held} | {d.mean_kl:.2e} | "
              f"{100 * d.top1_agreement:.2f}% ({d.tokens}) | {100 * d.decisive_agreement:.2f}% ({d.decisive}) | "
              f"{'meets' if ok else 'MISSES'} "
              f"({time.perf_counter() - start:.0f} s) |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
