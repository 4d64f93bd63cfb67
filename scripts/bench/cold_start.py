"""Time to first token on a fresh install: `npllm generate PROMPT` with an empty Numba cache, then again once the
detached compile that first run started has filled it.

    python scripts/bench/cold_start.py                                   # the README's first command (stories260K)
    python scripts/bench/cold_start.py --model tinyllama-1.1B-Q4_0.gguf  # a quantized file

Prints, for each run, the seconds from starting the process to the first byte on stdout (the CLI echoes the prompt
only once the first token is computed, so this is the time to the first token), the whole run's seconds and its
peak RSS, and how long the detached compile took (from the first run's start to its lock's release). The CPU
model and the load average go with them: the machine's other work moves every figure.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from npllm.kernels.compiler import LOCK_NAME, compiling_elsewhere, wait_for_lock


def timed_run(argv: list[str], env: dict) -> tuple[float, float, str]:
    """(seconds to the first stdout byte, seconds in all, stderr) of one run."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.read(1)
    first = time.monotonic() - start
    proc.stdout.read()
    stderr = proc.stderr.read().decode()
    proc.wait()
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{stderr}")
    return first, time.monotonic() - start, stderr


def wait_for_compile(cache: Path, timeout: float) -> bool:
    """Wait for the detached compile into `cache`: until it holds its lock (it starts within seconds), then until
    it lets go of it; whether it ended within `timeout` seconds."""
    start = time.monotonic()
    deadline = start + timeout
    while not any(compiling_elsewhere(lock) for lock in cache.rglob(LOCK_NAME)):
        if time.monotonic() - start > 60:
            return False  # none started within a minute
        time.sleep(0.1)
    return all(wait_for_lock(lock, max(0.0, deadline - time.monotonic())) for lock in cache.rglob(LOCK_NAME))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint (default: npllm's default model)")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--compile-timeout", type=float, default=1800, help="most seconds to wait for the compile")
    args = parser.parse_args()
    argv = [sys.executable, "-m", "npllm", "generate", args.prompt, "--max-new-tokens", str(args.max_new_tokens)]
    argv += ["--model", args.model] if args.model else []
    print(f"{cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at the start")
    with tempfile.TemporaryDirectory(prefix="npllm-numba-") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        env.pop("NPLLM_WAIT_COMPILE", None)
        start = time.monotonic()
        first, total, stderr = timed_run(argv, env)
        print(f"empty cache: first token after {first:.2f} s, run {total:.2f} s, peak RSS "
              f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f} MiB")
        print("  " + "\n  ".join(line for line in stderr.splitlines() if line.startswith("[npllm]")))
        done = wait_for_compile(Path(cache), args.compile_timeout)
        print(f"detached compile: {'done' if done else 'NOT done'} {time.monotonic() - start:.1f} s after the "
              f"first run started")
        first, total, stderr = timed_run(argv, env)
        print(f"filled cache: first token after {first:.2f} s, run {total:.2f} s; load average "
              f"{os.getloadavg()[0]:.1f}")
        print("  " + "\n  ".join(line for line in stderr.splitlines() if line.startswith("[npllm]")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
