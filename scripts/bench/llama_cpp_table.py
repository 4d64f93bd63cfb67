"""npllm against llama.cpp on the same GGUF files, in one command: decode and prefill at batch 1 for every shape x
type x thread count, then batched decode, printed as markdown tables with the CPU model, the threads, the load
average, each run's steal time, and the ratios npllm / llama.cpp below 1.0 named at the end.

    python scripts/bench/llama_cpp_table.py [--shapes stories110M tinyllama-1.1B] [--types F32 Q8_0 Q4_0 ...]
        [--f32-shapes stories110M] [--threads 1 2] [--rounds 1] [--batch 4 16] [--batch-shapes stories110M]
        [--batch-types Q8_0 Q4_0 Q4_K_M] [--repack auto|0|1]
    bash scripts/bench/bench_llama_cpp.sh [the same options]      # builds llama.cpp first where it is missing

Files: SHAPE-F32.gguf holds random weights at a named shape (npllm's write_gguf, the Llama 2 vocabulary); every other
type is made from it by llama.cpp's own `llama-quantize` (scripts/bench/llama_cpp_files.py: SHAPE-llamacpp-TYPE.gguf,
so the Q4_0 and Q8_0 files carry llama.cpp's choice for the output matrix too). They go to $GGUF_DIR (default
/tmp/npllm-bench-gguf) and are kept for reruns; llama.cpp is the build in $LLAMA_CPP_DIR (default /tmp/npllm-llama.cpp,
scripts/bench/build_llama_cpp.sh, which also builds llama-batched-bench).

Pairs: each llama.cpp run is followed at once by npllm's on the same file and thread count, so the two figures of a
pair come from the same minute of a shared machine; rounds repeat the whole walk. The same work on both sides:
prefill of 128 tokens into an empty cache (`llama-bench -p 128`, npllm bench's prefill_tok_s); 64 decode steps after
those 128 tokens (`llama-bench -n 64 -d 128`, `npllm bench --batch 1 --prompt-len 128 --gen-len 64`); the KV cache in
float16 on both (llama.cpp's default; npllm's `--kv-dtype float16`); two repetitions each (`-r 2`, `--repeat 2`).
Batched decode: `llama-batched-bench -npp 128 -ntg 64 -npl 4,16` (B sequences, each its own 128-token prompt, then
64 steps of B tokens) against `npllm bench --batch 4 16 --prompt-len 128 --gen-len 64`, the same pattern.

llama.cpp repacks some matrices (Q4_0, Q4_K, IQ4_NL, ...) at load; on a VM that lists AMX without enabling it, the
repacked kernels die (SIGSEGV or SIGILL). `--repack auto` (the default) tries a short run first and, where it dies,
runs llama.cpp with repacking off (`--repack 0`, `--no-repack`), saying so; `--repack 0` or `1` forces one.
Steal: the CPUs the host took from this VM while a run ran (/proc/stat's steal column before and after, per second of
wall time, loads included); above ~0.05 a figure is partly the host's.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from llama_cpp_files import llama_cpp_folders, quantize, source

from npllm.bench import steal_seconds

TYPES = ["F32", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"]
X86_OPTIONS = ("GGML_NATIVE", "GGML_AVX", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AMX", "GGML_SSE",
               "GGML_CPU_REPACK", "GGML_LLAMAFILE", "GGML_OPENMP")  # CMake options that shape x86 CPU kernels
WAITS = set()  # what npllm's threads did between parallel regions in its runs (npllm bench's threads_wait)
FEATURES = ["avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "gfni", "amx_int8"]


def cpu_lines() -> list[str]:
    """The CPU model (lscpu's "Model name"), its CPU count, L3 and the vector features that pick kernels."""
    info = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = set(info.get("Flags", "").split())
    lines = [f"CPU: {info.get('Model name', 'unknown')} ({os.cpu_count()} CPUs, L3 {info.get('L3 cache', '?')}, "
             f"hypervisor {info.get('Hypervisor vendor', 'none')}); features: "
             f"{' '.join(f for f in FEATURES if f in flags) or 'none listed'}"]
    if os.environ.get("NUMBA_CPU_NAME"):
        lines.append(f"npllm compiled for NUMBA_CPU_NAME={os.environ['NUMBA_CPU_NAME']} "
                     f"NUMBA_CPU_FEATURES={os.environ.get('NUMBA_CPU_FEATURES', '')}")
    return lines


def llama_build_line(build: Path) -> str:
    """How llama.cpp was built: the GGML_* options set in its CMakeCache.txt."""
    cache = build / "cmake" / "CMakeCache.txt"
    if not cache.exists():
        return f"llama.cpp: {build}/bin (no CMakeCache.txt to say how it was built)"
    options = [line.split(":BOOL=")[0] for line in cache.read_text().splitlines()
               if line.startswith(X86_OPTIONS) and line.endswith(":BOOL=ON")]
    return f"llama.cpp: {build}/bin, built with {' '.join(options) or 'no GGML_* options on'}"


class Steal:
    """Steal time in CPUs over a block: with Steal() as s: ...; s.cpus (None without /proc/stat)."""

    def __enter__(self):
        self.start, self.wall = steal_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        end = steal_seconds()
        wall = time.perf_counter() - self.wall
        self.cpus = None if end is None or self.start is None else round((end - self.start) / wall, 2)
        return False


def run_json_lines(args: list[str]) -> list[dict]:
    """The JSON objects a command prints on stdout, one a line (or one JSON array); raises on failure."""
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout.strip()
    if out.startswith("["):
        return json.loads(out)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def llama_bench(build: Path, path: Path, threads: int, repack: str):
    """(prefill tok/s, decode tok/s, steal) of llama-bench: -p 128 from an empty cache, -n 64 after 128 tokens."""
    args = [str(build / "bin" / "llama-bench"), "-m", str(path), "-t", str(threads), "-r", "2", "-o", "json"]
    args += [] if repack == "1" else ["--repack", "0"]
    with Steal() as steal:
        pp = run_json_lines(args + ["-p", "128", "-n", "0"])[0]["avg_ts"]
        tg = run_json_lines(args + ["-p", "0", "-n", "64", "-d", "128"])[0]["avg_ts"]
    return pp, tg, steal.cpus


def npllm_bench(path: Path, threads: int, batches=(1,)) -> dict[int, dict]:
    """{batch: npllm bench's JSON row} for --prompt-len 128 --gen-len 64 --kv-dtype float16 --repeat 2."""
    npllm = Path(sys.executable).parent / "npllm"
    args = [str(npllm), "bench", "--model", str(path), "--batch", *map(str, batches), "--prompt-len", "128",
            "--gen-len", "64", "--repeat", "2", "--threads", str(threads), "--kv-dtype", "float16", "--json"]
    rows = run_json_lines(args)
    WAITS.update(row.get("threads_wait", "sleep") for row in rows)
    return {row["batch"]: row for row in rows}


def batched_bench(build: Path, path: Path, threads: int, batches, repack: str):
    """({B: (prefill tok/s, decode tok/s)}, steal) of llama-batched-bench -npp 128 -ntg 64 -npl B,..."""
    args = [str(build / "bin" / "llama-batched-bench"), "-m", str(path), "-c", str(max(batches) * 192),
            "-npp", "128", "-ntg", "64", "-npl", ",".join(map(str, batches)), "-t", str(threads),
            "--output-format", "jsonl"] + ([] if repack == "1" else ["--no-repack"])
    with Steal() as steal:
        rows = run_json_lines(args)
    return {r["pl"]: (r["speed_pp"], r["speed_tg"]) for r in rows}, steal.cpus


def choose_repack(build: Path, path: Path, wanted: str) -> str:
    """"1" (llama.cpp's default, repacked rows) or "0": auto tries a short repacked run on path first."""
    if wanted != "auto":
        return wanted
    probe = [str(build / "bin" / "llama-bench"), "-m", str(path), "-p", "8", "-n", "4", "-r", "1", "-t", "1"]
    died = subprocess.run(probe, capture_output=True).returncode != 0
    if died:
        print(f"llama.cpp's repacked kernels died on {path.name} here (AMX listed, not enabled?): "
              "running it with repacking off (--repack 0 / --no-repack)")
    return "0" if died else "1"


def files(build: Path, out: Path, shapes, types) -> dict[tuple[str, str], Path]:
    """{(shape, type): GGUF path}, writing the F32 source and llama-quantize's files where missing."""
    paths = {}
    for shape in shapes:
        f32, _ = source(shape, out, 0)
        for qtype in types:
            paths[shape, qtype] = f32 if qtype == "F32" else quantize(build, f32, qtype, out)
    return paths


def ratio(ours: float, theirs: float) -> str:
    """ours / theirs as 1.23x, in bold where below 1.0."""
    r = ours / theirs
    return f"**{r:.2f}x**" if r < 1.0 else f"{r:.2f}x"


def pairs(build, paths, args, repack, below):
    """The batch-1 table: one row per round x shape x type x thread count, printed as each pair finishes."""
    print("\n| shape, type | threads | round | decode llama.cpp / npllm tok/s | decode ratio | prefill pp128 "
          "llama.cpp / npllm | prefill ratio | npllm decode GB/s of measured | steal llama.cpp / npllm |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in range(1, args.rounds + 1):
        for (shape, qtype), path in paths.items():
            for t in args.threads:
                try:
                    lp, lt, lsteal = llama_bench(build, path, t, repack)
                    row = npllm_bench(path, t)[1]
                except subprocess.CalledProcessError as e:
                    print(f"| {shape} {qtype} | {t} | {r} | failed: {' '.join(e.cmd[:2])} exited {e.returncode} |")
                    continue
                op, ot = row["prefill_tok_s"], row["decode_tok_s"]
                for test, o, l in (("decode", ot, lt), ("prefill", op, lp)):
                    if o < l:
                        below.append(f"{shape} {qtype} {test} at {t} thread(s), round {r}: {o / l:.2f}x")
                print(f"| {shape} {qtype} | {t} | {r} | {lt:.1f} / {ot:.1f} | {ratio(ot, lt)} | {lp:.1f} / {op:.1f} "
                      f"| {ratio(op, lp)} | {row['achieved_gb_s']:.1f} of {row['bandwidth_gb_s']:.1f} "
                      f"({100 * row['achieved_gb_s'] / row['bandwidth_gb_s']:.0f}%) | {lsteal} / {row['steal_cpus']} |",
                      flush=True)


def batched(build, paths, args, repack, below):
    """The batched-decode table: llama-batched-bench against npllm bench --batch, per shape x type."""
    print(f"\n| shape, type | threads | sequences | decode llama.cpp / npllm tok/s | decode ratio | prefill "
          f"llama.cpp / npllm | prefill ratio | steal llama.cpp / npllm |")
    print("|---|---|---|---|---|---|---|---|")
    t = max(args.threads)
    for shape in args.batch_shapes:
        for qtype in args.batch_types:
            path = paths[shape, qtype]
            try:
                theirs, lsteal = batched_bench(build, path, t, args.batch, repack)
                ours = npllm_bench(path, t, args.batch)
            except subprocess.CalledProcessError as e:
                print(f"| {shape} {qtype} | {t} | | failed: {' '.join(e.cmd[:2])} exited {e.returncode} |")
                continue
            for b in args.batch:
                (lp, lt), row = theirs[b], ours[b]
                op, ot = row["prefill_tok_s"], row["decode_tok_s"]
                for test, o, l in (("decode", ot, lt), ("prefill", op, lp)):
                    if o < l:
                        below.append(f"{shape} {qtype} batched {test} of {b} at {t} thread(s): {o / l:.2f}x")
                print(f"| {shape} {qtype} | {t} | {b} | {lt:.1f} / {ot:.1f} | {ratio(ot, lt)} | {lp:.1f} / {op:.1f} | "
                      f"{ratio(op, lp)} | {lsteal} / {row['steal_cpus']} |", flush=True)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["stories110M", "tinyllama-1.1B"])
    parser.add_argument("--types", nargs="+", default=TYPES, help="F32 or llama-quantize presets")
    parser.add_argument("--f32-shapes", nargs="*", default=["stories110M"],
                        help="the shapes whose F32 file is timed too (TinyLlama's 4.4 GB decodes at ~2 tok/s: "
                             "~10 minutes of pairs)")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch", nargs="*", type=int, default=[4, 16], help="sequences (none: no batched table)")
    parser.add_argument("--batch-shapes", nargs="+", default=["stories110M"])
    parser.add_argument("--batch-types", nargs="+", default=["Q8_0", "Q4_0", "Q4_K_M"])
    parser.add_argument("--repack", choices=["auto", "0", "1"], default="auto")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if (folders := llama_cpp_folders()) is None:
        return 1
    build, out = folders
    shapes = list(dict.fromkeys(args.shapes + (args.batch_shapes if args.batch else [])))
    types = list(dict.fromkeys(args.types + (args.batch_types if args.batch else [])))
    paths = files(build, out, shapes, types)
    quantized = next((p for (_, qtype), p in paths.items() if qtype != "F32"), None)
    repack = choose_repack(build, quantized, args.repack) if quantized else "1"  # F32 alone: nothing to repack
    for line in cpu_lines() + [llama_build_line(build), f"llama.cpp repacking: {'on' if repack == '1' else 'off'}"]:
        print(line)
    load, start = open("/proc/loadavg").read().split()[:3], time.time()
    print(f"threads {' and '.join(map(str, args.threads))}; load average at start {' '.join(load)}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    below = []
    with Steal() as steal:
        pairs(build, {(shape, qtype): path for (shape, qtype), path in paths.items() if shape in args.shapes
                      and qtype in args.types and (qtype != "F32" or shape in args.f32_shapes)}, args, repack, below)
        if args.batch:
            batched(build, paths, args, repack, below)
    print(f"\nload average at end {' '.join(open('/proc/loadavg').read().split()[:3])}; steal over the whole run "
          f"{steal.cpus} CPUs; {time.time() - start:.0f} s")
    print(f"npllm's threads between parallel regions: {', '.join(sorted(WAITS)) or 'not reported'} "
          "(llama.cpp's spin)")
    print("below 1.0 (npllm / llama.cpp): " + ("; ".join(below) if below else "none"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
