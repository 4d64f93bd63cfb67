"""Time `npllm batch` in one process and on Ray Data (a local cluster each run starts), for docs/batch.md.

    python scripts/bench/bench_batch.py [--model stories260K] [--prompts 64] [--tokens 256] [--batch-size 8]

Each configuration is a fresh `npllm batch` process on a fresh output file, so its wall time includes loading the
model (and, with --ray, starting Ray and its actors). Tokens/s is completion tokens over that wall time. The last
two rows run a small job (4 prompts of 16 tokens) plainly and on Ray: the difference is Ray's fixed overhead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ["Once upon a time", "Lily and Ben", "The little dog", "A big red ball", "Tom was sad", "The sun was hot",
         "Mia had a kite", "The old cat"]


def job(folder: Path, name: str, prompts: int, tokens: int) -> Path:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": f"{WORDS[i % len(WORDS)]}{' ' * (i // len(WORDS) % 2)}",
                                        "max_tokens": tokens, "temperature": 0}) + "\n" for i in range(prompts)))
    return path


def timed(model: str, inp: Path, options: list[str]) -> tuple[float, int]:
    """(wall seconds, completion tokens written) of one `npllm batch` run."""
    out = inp.with_name(f"out-{time.monotonic_ns()}.jsonl")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "npllm", "batch", "--model", model, "-i", str(inp), "-o", str(out),
                    *options], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    return seconds, sum(json.loads(line)["usage"]["completion_tokens"] for line in out.read_text().splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stories260K")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch-size", default="8")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        big = job(Path(folder), "big", args.prompts, args.tokens)
        small = job(Path(folder), "small", 4, 16)
        timed(args.model, small, [])  # warm Numba's cache and the page cache
        runs = [("plain, 1 thread", big, ["--threads", "1"]), ("plain, 2 threads", big, []),
                ("--ray --workers 1 (1 CPU)", big, ["--ray", "--workers", "1"]),
                ("--ray --workers 2 (1 CPU each)", big, ["--ray", "--workers", "2"]),
                ("small job, plain", small, []), ("small job, --ray --workers 1", small, ["--ray"])]
        print(f"| run | requests x tokens | wall s | tokens/s |\n| --- | --- | --- | --- |")
        for name, inp, options in runs:
            seconds, tokens = timed(args.model, inp, options + ["--batch-size", args.batch_size])
            n = args.prompts if inp is big else 4
            print(f"| {name} | {n} x {tokens // n} | {seconds:.1f} | {tokens / seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
