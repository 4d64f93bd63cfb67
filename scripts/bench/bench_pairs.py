"""llama.cpp and npllm side by side in PAIRS: each round runs llama-bench, then `npllm bench`, on the same GGUF file,
type after type, so the two figures of a pair come from the same minute of a noisy shared machine. Prints each
pair's ratio (npllm / llama.cpp) and, at the end, the median ratio per type and test.

    python scripts/bench/bench_pairs.py [SHAPE] [THREADS] [ROUNDS] [TYPES]   # defaults: stories110M 2 3 F32,Q8_0,Q4_0

The files are scripts/bench/bench_llama_cpp.sh's ($GGUF_DIR, default /tmp/npllm-bench-gguf: run that script once to
write them), llama.cpp its build ($LLAMA_CPP_DIR, default /tmp/npllm-llama.cpp); $LLAMA_BENCH_ARGS goes to
llama-bench (e.g. "--repack 0" on a VM that lists AMX without enabling it; "--repack 0,1" pairs npllm with both of
llama.cpp's CPU paths, its kernels on the file's own blocks and on the rows it repacks at load, each ratio labelled
with its path). The same work on both sides: prefill of 128 tokens into an empty cache; 64 decode steps after 128
tokens (llama-bench's `-d 128`; from an empty cache each step would read 128 fewer keys and values); and the KV cache
in float16, llama.cpp's default (`npllm bench --kv-dtype`; $KV_DTYPE=float32 pairs npllm's float32 cache with it
instead). npllm's threads spin briefly or sleep between parallel regions as npllm.kernels decides (printed at the end)
unless OMP_WAIT_POLICY or GOMP_SPINCOUNT says otherwise. Beside each pair, each engine's steal: the CPUs the host
took from this VM while it ran (npllm bench's steal_cpus; /proc/stat around llama-bench's two runs, loads included).
"""
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from npllm.bench import steal_seconds

shape = sys.argv[1] if len(sys.argv) > 1 else "stories110M"
threads = sys.argv[2] if len(sys.argv) > 2 else "2"
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
file_types = (sys.argv[4] if len(sys.argv) > 4 else "F32,Q8_0,Q4_0").split(",")  # {SHAPE}-{TYPE}.gguf, e.g. Q4_K_M
gguf = Path(os.environ.get("GGUF_DIR", "/tmp/npllm-bench-gguf"))
llama_bench = Path(os.environ.get("LLAMA_CPP_DIR", "/tmp/npllm-llama.cpp")) / "bin" / "llama-bench"
npllm = Path(sys.executable).parent / "npllm"
kv_dtype = os.environ.get("KV_DTYPE", "float16")


def llama_cpp(path):
    """({path: (prefill tok/s, decode tok/s)}, steal in CPUs) of llama-bench -p 128 (from an empty cache) and -n 64
    -d 128 (after 128 tokens), one entry per CPU path the arguments ask for: "" alone unless LLAMA_BENCH_ARGS lists
    "--repack 0,1"; the steal as npllm bench's steal_cpus, over both runs (None without /proc/stat)."""
    args = [str(llama_bench), "-m", str(path), "-t", threads, "-r", "2", "-o", "json"]
    args += os.environ.get("LLAMA_BENCH_ARGS", "").split()
    steal_start, wall_start = steal_seconds(), time.perf_counter()
    runs = [run for test in (["-p", "128", "-n", "0"], ["-p", "0", "-n", "64", "-d", "128"])
            for run in json.loads(subprocess.run(args + test, capture_output=True, text=True, check=True).stdout)]
    wall = time.perf_counter() - wall_start
    steal = None if steal_start is None else round((steal_seconds() - steal_start) / wall, 2)
    labels = {r.get("repack") for r in runs}
    by_test = {}
    for r in runs:
        label = "" if len(labels) == 1 else ("repacked " if r["repack"] else "plain ")
        by_test.setdefault(label, {})["pp" if r["n_gen"] == 0 else "tg"] = r["avg_ts"]
    return {label: (tests["pp"], tests["tg"]) for label, tests in by_test.items()}, steal


def ours(path):
    """(prefill tok/s, decode tok/s, steal_cpus) of npllm bench --batch 1 --prompt-len 128 --gen-len 64."""
    args = [str(npllm), "bench", "--model", str(path), "--batch", "1", "--prompt-len", "128", "--gen-len", "64",
            "--repeat", "2", "--threads", threads, "--kv-dtype", kv_dtype, "--json"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    waits.add(row.get("threads_wait", "sleep"))
    return row["prefill_tok_s"], row["decode_tok_s"], row.get("steal_cpus")


ratios, waits = {}, set()
print(f"{shape}, {threads} threads, {rounds} rounds, npllm's KV cache {kv_dtype} (llama.cpp's float16); "
      f"load average {open('/proc/loadavg').read().split()[:3]}")
for r in range(rounds):
    for qtype in file_types:
        path = gguf / f"{shape}-{qtype}.gguf"
        (theirs, their_steal), (op, ot, steal) = llama_cpp(path), ours(path)
        for label, (lp, lt) in theirs.items():
            ratios.setdefault((qtype, label + "prefill"), []).append(op / lp)
            ratios.setdefault((qtype, label + "decode"), []).append(ot / lt)
            print(f"round {r + 1} {qtype:6} prefill llama.cpp {label}{lp:8.1f} npllm {op:8.1f} ({op / lp:.2f}x)   "
                  f"decode llama.cpp {label}{lt:7.1f} npllm {ot:7.1f} ({ot / lt:.2f}x)   "
                  f"steal llama.cpp {their_steal} npllm {steal}",
                  flush=True)
print("median ratio npllm / llama.cpp: " + ", ".join(f"{t} {test} {statistics.median(v):.2f}x"
                                                      for (t, test), v in ratios.items()))
print(f"npllm's threads between parallel regions: {', '.join(sorted(waits))} (llama.cpp's spin)")
