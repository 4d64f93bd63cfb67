"""llama2.c's run.c and npllm side by side on one llama2.c checkpoint (the issue's small-model target: run.c's decode
of the stories15M shape).

    python scripts/bench/bench_run_c.py [SHAPE] [THREADS] [ROUNDS]     # defaults: stories15M 2 3

run.c comes from the package index: the `llamac2py` source package carries llama2.c's run.c of August 2023 (the
version whose file format npllm calls legacy: multi-head attention, RoPE tables read from the checkpoint). The script
downloads it (pip download, no dependencies; $RUN_C names a run.c to use instead), builds it as llama2.c's `make
runomp` does (gcc -Ofast -fopenmp -march=native) and writes random weights of SHAPE in the legacy format, with
the RoPE tables run.c reads filled in (npllm's writer leaves them zero: npllm computes them), beside a copy of the
Llama 2 tokenizer.bin (run.c reads it from its working directory; $NPLLM_WEIGHTS or weights/ holds it).

First a check that both engines compute the same model: run.c's greedy text from BOS against the pieces of npllm's
greedy tokens on the same file. Then, each round, the same work on both sides: decode steps after 128 tokens, one
token a step, float32 weights and KV cache, THREADS threads. run.c decodes one token a step from position 0 and
prints its rate over steps 1..S-1; its time for steps 128..191 is the difference of two runs (S = 192 and S = 128,
best of five each: its clock counts milliseconds). npllm's is `npllm bench --batch 1 --prompt-len 128 --gen-len 64
--kv-dtype float32` (forward, LM head and argmax each step). Also printed: run.c's own figure for all of its
seq_len steps, as its README quotes it.
"""
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from npllm.bench import steal_seconds
from npllm.formats import read_checkpoint
from npllm.formats.llama2c import write_llama2c
from npllm.formats.random import NAMED_SHAPES, random_weights
from npllm.models import make_model
from npllm.tokenizer.bpe import read_llama2c_records

RUN_C_PACKAGE = "llamac2py==0.1.4"
TOKENIZER = Path(os.environ.get("NPLLM_WEIGHTS", "weights")) / "llama2-tokenizer" / "tokenizer.bin"


def fetch_run_c(folder: Path) -> Path:
    """run.c from $RUN_C, or from the llamac2py source package (pip download)."""
    if os.environ.get("RUN_C"):
        return Path(os.environ["RUN_C"])
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d",
                    str(folder), RUN_C_PACKAGE], check=True)
    (archive,) = folder.glob("llamac2py-*.tar.gz")
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/run.c"))
        (folder / "run.c").write_bytes(tar.extractfile(member).read())
    return folder / "run.c"


def build(run_c: Path, folder: Path) -> Path:
    """run.c compiled as llama2.c's Makefile target `runomp` compiles it."""
    binary = folder / "run"
    subprocess.run(["gcc", "-Ofast", "-fopenmp", "-march=native", str(run_c), "-lm", "-o", str(binary)], check=True)
    return binary


def write_model(folder: Path, shape: str) -> Path:
    """SHAPE's random weights as a legacy llama2.c file, its RoPE tables (after every weight but a separate LM head:
    [seq_len, head_dim / 2] cosines, then sines) holding what npllm computes, so run.c computes the same model."""
    config = NAMED_SHAPES[shape]
    path = folder / "model.bin"
    write_llama2c(path, config, random_weights(config, seed=1))
    S, half = config.max_seq_len, config.head_dim // 2
    angles = np.outer(np.arange(S), config.rope_theta ** (-np.arange(half) * 2.0 / config.head_dim))
    tables = np.concatenate([np.cos(angles), np.sin(angles)]).astype(np.float32)
    after = 0 if config.tied_embeddings else config.vocab_size * config.dim * 4
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size - after - tables.nbytes)
        f.write(tables.tobytes())
    (folder / "tokenizer.bin").write_bytes(TOKENIZER.read_bytes())
    return path


def run_c(binary: Path, model: Path, steps: int, threads: str) -> tuple[float, bytes]:
    """(run.c's seconds for steps 1..steps-1, its output) of a greedy run from BOS."""
    out = subprocess.run([str(binary), str(model), "0", str(steps)], cwd=model.parent, capture_output=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": threads}).stdout
    rate = float(re.search(rb"achieved tok/s: ([0-9.]+)", out).group(1))
    return (steps - 1) / rate, out


def npllm_greedy_text(model: Path, steps: int) -> bytes:
    """What run.c prints for npllm's greedy tokens from BOS: each token's piece, the first without its leading space."""
    config, weights = read_checkpoint(model)
    net = make_model(config, weights, "numba")
    pieces, _ = read_llama2c_records(model.parent / "tokenizer.bin", config.vocab_size)
    cache, token, text = net.new_cache(steps), 1, b""  # run.c prints the token of each of its `steps` forwards
    for pos in range(steps):
        following = int(np.argmax(net.lm_head(net.forward([token], [pos], cache))[0]))
        piece = pieces[following]
        text += piece[1:] if token == 1 and piece.startswith(b" ") else piece
        token = following
    return text


def run_c_decode(binary: Path, model: Path, threads: str) -> tuple[float, float | None]:
    """(run.c's tok/s over steps 128..191, the CPUs the host took from this VM meanwhile, as npllm bench's
    steal_cpus; None without /proc/stat)."""
    steal_start, wall_start = steal_seconds(), time.perf_counter()
    short = min(run_c(binary, model, 128, threads)[0] for _ in range(5))
    long = min(run_c(binary, model, 192, threads)[0] for _ in range(5))
    wall = time.perf_counter() - wall_start
    return 64 / (long - short), None if steal_start is None else round((steal_seconds() - steal_start) / wall, 2)


def npllm_decode(model: Path, threads: str) -> tuple[float, float | None]:
    """(npllm bench's decode tok/s after 128 tokens, its steal_cpus)."""
    args = [str(Path(sys.executable).parent / "npllm"), "bench", "--model", str(model), "--batch", "1",
            "--prompt-len", "128", "--gen-len", "64", "--repeat", "3", "--threads", threads, "--kv-dtype", "float32",
            "--json"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return row["decode_tok_s"], row.get("steal_cpus")


def main() -> int:
    shape = sys.argv[1] if len(sys.argv) > 1 else "stories15M"
    threads = sys.argv[2] if len(sys.argv) > 2 else "2"
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    folder = Path(tempfile.mkdtemp(prefix="npllm-run-c-"))
    binary, model = build(fetch_run_c(folder), folder), write_model(folder, shape)
    _, theirs = run_c(binary, model, 64, threads)
    theirs = theirs.split(b"\n", 1)[1].rsplit(b"\nachieved", 1)[0]
    ours = npllm_greedy_text(model, 64)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    print(f"{shape}, {threads} threads; greedy text from BOS, 64 tokens: {same} of run.c's {len(theirs)} bytes "
          f"the same ({'identical' if ours == theirs else 'they differ'})\n  run.c: {theirs[:80]!r}\n"
          f"  npllm: {ours[:80]!r}", flush=True)
    seq_len = NAMED_SHAPES[shape].max_seq_len
    for r in range(rounds):
        (theirs, their_steal), (ours, steal) = run_c_decode(binary, model, threads), npllm_decode(model, threads)
        whole = min(run_c(binary, model, seq_len, threads)[0] for _ in range(3))
        print(f"round {r + 1}: decode after 128 tokens run.c {theirs:6.1f} tok/s, npllm {ours:6.1f} "
              f"({ours / theirs:.2f}x)   steal run.c {their_steal} npllm {steal}   run.c's own figure over {seq_len} "
              f"steps: {(seq_len - 1) / whole:.1f} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
