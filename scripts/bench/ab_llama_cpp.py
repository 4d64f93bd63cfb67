"""Two npllm checkouts and llama.cpp on the same files, in interleaved rounds: the A/B of a kernel change against
llama.cpp's pp128 on a noisy shared machine (scripts/bench/llama_cpp_table.py makes the whole table for one checkout).

    python scripts/bench/ab_llama_cpp.py BASE_NPLLM NEW_NPLLM FILES THREADS ROUNDS
    # e.g. python scripts/bench/ab_llama_cpp.py /work/main/.venv/bin/npllm .venv/bin/npllm \\
    #          stories110M-llamacpp-Q6_K.gguf,stories110M-llamacpp-Q5_K_M.gguf 1,2 3

FILES are names in $NPLLM_BENCH_GGUF (default /tmp/npllm-bench-gguf), llama-bench is $LLAMA_CPP_DIR/bin/llama-bench
(default /tmp/npllm-llama.cpp), run with `--repack 0` (llama_cpp_table.py says why). Each round runs, in an order
reversed every other round: llama-bench -p 128 -n 0 -r 2 and -p 0 -n 16 -d 128; `npllm bench --batch 1
--prompt-len 128 --gen-len 16 --repeat 2 --kv-dtype float16` of each checkout. With WARM=1 each npllm first runs
once on each file (its compile kept out of the rounds). Prints per file and thread count the medians of pp128 and
decode tok/s, the ratios to llama.cpp, the median of the paired new/base prefill ratios, the load average, and
the raw figures.
"""
import json
import os
import subprocess
import sys

import numpy as np

GGUF = os.environ.get("NPLLM_BENCH_GGUF", "/tmp/npllm-bench-gguf")
LLAMA_BENCH = os.path.join(os.environ.get("LLAMA_CPP_DIR", "/tmp/npllm-llama.cpp"), "bin", "llama-bench")


def json_lines(args):
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout.strip()
    return json.loads(out) if out.startswith("[") else [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def llama(path, threads):
    """(pp128, decode) tok/s of llama-bench."""
    args = [LLAMA_BENCH, "-m", path, "-t", str(threads), "-r", "2", "-o", "json", "--repack", "0"]
    return (json_lines(args + ["-p", "128", "-n", "0"])[0]["avg_ts"],
            json_lines(args + ["-p", "0", "-n", "16", "-d", "128"])[0]["avg_ts"])


def npllm(exe, path, threads, prompt=128, steps=16, repeat=2):
    """(pp128, decode) tok/s of one checkout's `npllm bench`."""
    row = json_lines([exe, "bench", "--model", path, "--batch", "1", "--prompt-len", str(prompt), "--gen-len",
                      str(steps), "--repeat", str(repeat), "--threads", str(threads), "--kv-dtype", "float16",
                      "--json"])[0]
    return row["prefill_tok_s"], row["decode_tok_s"]


def rounds(engines, path, threads, count):
    """{engine: [(pp, decode)] per round}, the order reversed every other round."""
    runs = {name: [] for name in engines}
    for r in range(count):
        for name, exe in (list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]):
            runs[name].append(llama(path, threads) if exe is None else npllm(exe, path, threads))
    return runs


def main():
    base, new, files, threads, count = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4], int(sys.argv[5])
    engines = {"llama": None, "base": base, "new": new}
    if os.environ.get("WARM"):
        for name in files:
            for exe in (base, new):
                npllm(exe, os.path.join(GGUF, name), 1, prompt=16, steps=2, repeat=1)
    for name in files:
        for t in map(int, threads.split(",")):
            runs = rounds(engines, os.path.join(GGUF, name), t, count)
            pp, tg = ({k: np.median([r[i] for r in v]) for k, v in runs.items()} for i in (0, 1))
            paired = np.median([n[0] / b[0] for n, b in zip(runs["new"], runs["base"])])
            print(f"{name} threads {t}: pp128 llama.cpp {pp['llama']:.1f} base {pp['base']:.1f} new {pp['new']:.1f} "
                  f"(new/llama.cpp {pp['new'] / pp['llama']:.2f}, base/llama.cpp {pp['base'] / pp['llama']:.2f}, "
                  f"new/base paired {paired:.2f}); decode {tg['llama']:.1f} / {tg['base']:.1f} / {tg['new']:.1f}; "
                  f"load {os.getloadavg()[0]:.1f}; raw {json.dumps(runs)}", flush=True)


if __name__ == "__main__":
    main()
