"""What a quantizer loses: `npllm quantize` and llama.cpp's `llama-quantize` on the same F32 file, type by type,
each file scored against the F32 model (not against its own dequantized weights, as scripts/bench/llama_cpp_files.py
does for the kernels): how far the weights moved, and how far the model's next-token distribution moved.

    python scripts/bench/quantizer_quality.py [--types Q2_K Q3_K Q4_K Q5_K Q6_K Q4_0 Q8_0 Q4_K_M Q5_K_M] [--ctx 128]

The F32 source and the text are scripts/bench/llama_cpp_files.py's: stories260K widened to dim and FFN 256 (the same
function with rows K-quants can hold), and stories sampled from it. llama.cpp writes every matrix in the type
(`llama-quantize --pure --token-embedding-type T SRC OUT T`, no importance matrix), npllm too
(`npllm quantize SRC OUT --type t`); a mixture (Q4_K_M, Q5_K_M) is each one's preset of that name. Both files are dequantized and run by npllm's NumPy reference, so the only
difference between two rows is the bytes each quantizer chose. Per type it prints the relative RMS error of the
weights (all matrices together, |W' - W| / |W|), then mean KL(F32 || quantized), top-1 agreement and perplexity.
llama.cpp is the build scripts/bench/build_llama_cpp.sh makes in $LLAMA_CPP_DIR (default /tmp/npllm-llama.cpp).
"""

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

from llama_cpp_files import llama_cpp_folders, source
from npllm.evaluate import kl_divergence
from npllm.formats import read_checkpoint
from npllm.quant import MIXTURES
from npllm.models import make_model

TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0", "Q4_K_M", "Q5_K_M"]


def write_both(build: Path, src: Path, qtype: str, out: Path) -> dict[str, Path]:
    """The F32 source in `qtype` by each quantizer: {"llama.cpp": path, "npllm": path}."""
    paths = {"llama.cpp": out / f"{src.stem}-llamacpp-{'' if qtype in MIXTURES else 'pure-'}{qtype}.gguf",
             "npllm": out / f"{src.stem}-npllm-{qtype}.gguf"}
    pure = [] if qtype in MIXTURES else ["--pure", "--token-embedding-type", qtype.lower()]
    subprocess.run([str(build / "bin" / "llama-quantize"), *pure, str(src), str(paths["llama.cpp"]), qtype],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([sys.executable, "-m", "npllm", "quantize", str(src), str(paths["npllm"]), "--type",
                    qtype.lower()], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return paths


def weight_error(reference: dict, weights: dict) -> float:
    """|W' - W| / |W| over every matrix together."""
    names = [n for n, w in reference.items() if np.ndim(w) == 2]
    moved = sum(float(np.sum((np.asarray(weights[n], np.float64) - reference[n]) ** 2)) for n in names)
    return np.sqrt(moved / sum(float(np.sum(np.asarray(reference[n], np.float64) ** 2)) for n in names))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=TYPES)
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--stories", type=int, default=24, help="stories sampled from the model as the text")
    args = parser.parse_args()
    if (folders := llama_cpp_folders()) is None:
        return 1
    build, out = folders
    src, ids = source("stories260K-wide", out, args.stories)
    config, reference = read_checkpoint(src)
    f32 = make_model(config, reference, "numpy")
    print(f"stories260K widened: {len(ids)} tokens scored in chunks of {args.ctx}")
    print("| type | quantizer | weights' relative RMS error | mean KL from F32 | top-1 agreement | perplexity (F32) |")
    print("|---|---|---|---|---|---|")
    for qtype in args.types:
        for who, path in write_both(build, src, qtype, out).items():
            _, weights = read_checkpoint(path)
            d = kl_divergence(make_model(config, weights, "numpy"), f32, ids, args.ctx)
            print(f"| {qtype} | {who} | {weight_error(reference, weights):.4f} | {d.mean_kl:.2e} | "
                  f"{100 * d.top1_agreement:.2f}% | {d.ppl:.4f} ({d.base_ppl:.4f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
