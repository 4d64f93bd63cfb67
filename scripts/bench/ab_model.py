"""Two versions of npllm on one model file in ONE process, their prefills and decode steps alternated: the A/B of
a change to the model or its kernels that a noisy shared machine allows (scripts/bench/ab_kernels.py does the same for
quant.py's tiles alone). Timed one process after the other, two runs of the same code here differ by up to 1.5x when
the host takes CPUs from this VM in bursts; alternated in one process, each pair of timings meets the same machine.

    python scripts/bench/ab_model.py BASE_CHECKOUT FILE.gguf [THREADS] [PROMPT] [STEPS] [ROUNDS]
    # e.g. git worktree add /tmp/base HEAD~1, then
    #      python scripts/bench/ab_model.py /tmp/base stories110M-Q4_K_M.gguf 2 128 64 5

BASE_CHECKOUT's npllm package is copied to $TMPDIR/npllm-ab/<its path, flattened>/npllm_base (every import inside
npllm is relative, so it runs as a second package; set NUMBA_CACHE_DIR to keep its compiled code between runs) and
loaded beside this checkout's. Each round, in turn for each version (the order swapped every round): a prefill of
PROMPT tokens into an empty cache (as `npllm bench`'s, no LM head), then STEPS decode steps after it (forward and
LM head, greedy), float16 K/V. Prints the best and median rate of each, and base/new: the median of the paired
ratios of wall time and of the process's CPU time (steal left out: with THREADS 1 the steadier measure). Compile
for another CPU with NUMBA_CPU_NAME and NUMBA_CPU_FEATURES (npllm's kernels follow them) and a NUMBA_CACHE_DIR of
its own.

The model loaded first decodes faster here: the same code on both sides (BASE_CHECKOUT this checkout) read decode
new/base 0.91 (prefill 1.01), and 1.04 (prefill 0.97) with this checkout's model loaded first (AB_NEW_FIRST=1;
110M Q4_0, one thread). So run it both ways and take the geometric mean of the two ratios.
"""
import importlib
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import npllm


def base_package(checkout: str):
    """BASE_CHECKOUT/npllm imported as npllm_base: copied afresh each run (the checkout may have changed), to the
    same place with the same times, where a NUMBA_CACHE_DIR's compiled code for it is found again."""
    home = Path(tempfile.gettempdir()) / "npllm-ab" / re.sub(r"[^A-Za-z0-9]+", "_", str(Path(checkout).resolve()))
    shutil.rmtree(home / "npllm_base", ignore_errors=True)
    shutil.copytree(Path(checkout) / "npllm", home / "npllm_base", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(home))
    return importlib.import_module("npllm_base")


def clocks() -> np.ndarray:
    """(wall, CPU) seconds: the process's CPU time leaves out what the host steals (with one thread it is the step's
    own time; threads that spin between parallel regions add their spinning to it)."""
    return np.array([time.perf_counter(), time.process_time()])


def prefill_s(model, tokens) -> np.ndarray:
    cache = model.new_cache(len(tokens) + 8, 1, "float16")
    start = clocks()
    model.forward(tokens, np.arange(len(tokens)), cache)
    return clocks() - start


def decode_s(model, tokens, steps: int) -> tuple[np.ndarray, list]:
    """(wall, CPU) seconds of `steps` greedy steps after the prompt, and the tokens they picked."""
    cache = model.new_cache(len(tokens) + steps + 8, 1, "float16")
    h = model.forward(tokens, np.arange(len(tokens)), cache)
    token, picked = int(np.argmax(model.lm_head(h[-1:])[0])), []
    start = clocks()
    for i in range(steps):
        h = model.forward(np.array([token]), np.array([len(tokens) + i]), cache)
        token = int(np.argmax(model.lm_head(h[-1:])[0]))
        picked.append(token)
    return clocks() - start, picked


def main():
    base_npllm = base_package(sys.argv[1])
    path, threads = sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2
    prompt, steps, rounds = (int(a) for a in (sys.argv[4:7] + ["128", "64", "5"][len(sys.argv[4:7]):]))
    order = (("new", npllm), ("base", base_npllm)) if os.environ.get("AB_NEW_FIRST") else (
        ("base", base_npllm), ("new", npllm))
    models = dict((name, package.load(path, backend="numba", threads=threads).model) for name, package in order)
    tokens = np.random.default_rng(0).integers(1, models["new"].config.vocab_size, prompt)
    picks = {name: decode_s(model, tokens, 4)[1] for name, model in models.items()}  # compiled, warm
    if picks["base"] != picks["new"]:
        print("note: the two versions pick different tokens", picks)
    times = {(name, kind): [] for name in models for kind in ("prefill", "decode")}
    for r in range(rounds):
        for name in (("base", "new") if r % 2 else ("new", "base")):
            times[name, "prefill"].append(prefill_s(models[name], tokens))
            times[name, "decode"].append(decode_s(models[name], tokens, steps)[0])
    for kind, count in (("prefill", prompt), ("decode", steps)):
        base, new = np.array(times["base", kind]), np.array(times["new", kind])  # [rounds, (wall, CPU)]
        print(f"{Path(path).name} {kind}: base {count / base[:, 0].min():.1f} / {count / np.median(base[:, 0]):.1f} "
              f"tok/s, new {count / new[:, 0].min():.1f} / {count / np.median(new[:, 0]):.1f} (best / median), "
              f"new/base {np.median(base[:, 0] / new[:, 0]):.2f} wall, {np.median(base[:, 1] / new[:, 1]):.2f} CPU "
              f"(medians of {rounds} pairs)", flush=True)


if __name__ == "__main__":
    main()
