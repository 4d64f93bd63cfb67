"""Peak resident memory of loading a GGUF model and decoding a few tokens, each file in a fresh process.

    python scripts/bench/bench_memory.py [--shape stories110M] [--types F32 Q8_0 Q4_0] [--dir /tmp] [--steps 16]
    python scripts/bench/bench_memory.py --files a.gguf b.gguf

Random weights of a named shape (formats/random.py) are written with npllm's own write_gguf into --dir (once; not
meant to be committed), then each file is loaded the way npllm.load loads it (backend numba: matrices kept in
their file types; an all-F32 file's as float32 panels) and decodes --steps tokens after an 8-token prompt
on a cache of exactly that many positions. Each child reports resource.getrusage(RUSAGE_SELF).ru_maxrss (memory
mapped file pages it touched included). A child that only imports npllm and compiles/loads the same kernels on a
tiny model gives the baseline: the interpreter, NumPy, Numba and LLVM with the compiled code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import numpy as np
from npllm.formats import read_checkpoint
from npllm.models import make_model

path, steps = sys.argv[1], int(sys.argv[2])
start = time.perf_counter()
model = make_model(*read_checkpoint(path), "numba")
load_s = time.perf_counter() - start
prompt = np.arange(1, 9)
cache = model.new_cache(len(prompt) + steps)
h = model.forward(prompt, np.arange(len(prompt)), cache)
token = int(np.argmax(model.lm_head(h[-1:])[0]))
for i in range(steps):
    token = int(np.argmax(model.lm_head(model.forward([token], [len(prompt) + i], cache))[0]))
print(json.dumps({"file": path, "model": type(model).__name__, "load_s": round(load_s, 2),
                  "file_mb": round(__import__("os").path.getsize(path) / 2**20, 1),
                  "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))
"""


WRITER = r"""
import sys
from npllm.formats.gguf_write import write_gguf
from npllm.formats.random import NAMED_SHAPES, random_weights

shape, folder, types = sys.argv[1], sys.argv[2], sys.argv[3:]
config, weights = NAMED_SHAPES[shape], random_weights(NAMED_SHAPES[shape])
for qtype in types:
    write_gguf(f"{folder}/npllm-{shape}-{qtype.lower()}.gguf", config, weights, qtype)
"""


def write_files(shape: str, types: list[str], folder: str) -> list[str]:
    """The files, written by a child process: ru_maxrss survives fork and exec, so this process stays small (its
    peak would otherwise become every later child's starting figure)."""
    paths = [os.path.join(folder, f"npllm-{shape}-{qtype.lower()}.gguf") for qtype in types]
    missing = [t for t, p in zip(types, paths) if not os.path.exists(p)]
    if missing:
        subprocess.run([sys.executable, "-c", WRITER, shape, folder, *missing], check=True)
    return paths


def measure(path: str, steps: int) -> dict:
    child = subprocess.run([sys.executable, "-c", CHILD, path, str(steps)], stdout=subprocess.PIPE, text=True,
                           check=True)
    return json.loads(child.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="stories110M")
    parser.add_argument("--types", nargs="+", default=["F32", "Q8_0", "Q4_0"])
    parser.add_argument("--files", nargs="+", help="GGUF files to measure instead of writing random ones")
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    paths = args.files or write_files(args.shape, args.types, args.dir)
    tiny = write_files("stories260K", ["Q4_0"], args.dir)[0]
    measure(tiny, args.steps)  # compiles what is not in Numba's cache yet (LLVM's peak is not the model's)
    baseline = measure(tiny, args.steps)
    print(json.dumps({"baseline (stories260K Q4_0)": baseline["peak_rss_mb"]}))
    results = [measure(p, args.steps) for p in paths]
    for r in results:
        r["vs_first"] = round(r["peak_rss_mb"] / results[0]["peak_rss_mb"], 3)
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
