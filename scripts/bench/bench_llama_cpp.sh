#!/usr/bin/env bash
# Decode and prefill speed side by side: llama.cpp's llama-bench and npllm on the same GGUF files (random weights at
# a model shape, F32, Q8_0 and Q4_0, written by npllm's write_gguf). (The kernel-level pass that followed,
# scripts/bench/bench_quant.py, timed kernels the model no longer runs and is gone; scripts/bench/bench_tiles.py times the
# model's.)
#
#   bash scripts/bench/bench_llama_cpp.sh [SHAPE] [THREADS]         # defaults: stories110M, "1,2"
#
# llama.cpp is the build scripts/bench/build_llama_cpp.sh makes in $LLAMA_CPP_DIR (default /tmp/npllm-llama.cpp); run
# that script once first if $LLAMA_CPP_DIR/bin/llama-bench is missing. The GGUF files go to $GGUF_DIR (default
# /tmp/npllm-bench-gguf) and are kept for reruns. Runs are short (3 repetitions, 64 decode steps after a 128-token
# prompt): on a shared machine, read the figures with the load average printed beside them.
#
# $LLAMA_BENCH_ARGS goes to llama-bench as extra options. On a VM that advertises AMX (amx_tile in /proc/cpuinfo)
# without enabling it, a native build's weight repacking runs AMX tile instructions and dies of SIGILL on Q8_0 and
# Q4_0: there, LLAMA_BENCH_ARGS="--repack 0" (llama.cpp's plain CPU kernels on the file's own blocks).
set -euo pipefail
cd "$(dirname "$0")/../.."
shape=${1:-stories110M}
threads=${2:-1,2}
build=${LLAMA_CPP_DIR:-/tmp/npllm-llama.cpp}
out=${GGUF_DIR:-/tmp/npllm-bench-gguf}
python=${PYTHON:-.venv/bin/python}
npllm=${NPLLM:-.venv/bin/npllm}
tokenizer=${TOKENIZER:-weights/llama2-tokenizer/tokenizer.model}
if [ ! -x "$build/bin/llama-bench" ]; then
  echo "no $build/bin/llama-bench: build llama.cpp first (scripts/bench/build_llama_cpp.sh)" >&2
  exit 1
fi

mkdir -p "$out"
for type in F32 Q8_0 Q4_0; do
  file="$out/$shape-$type.gguf"
  [ -f "$file" ] || "$python" - "$shape" "$type" "$file" "$tokenizer" <<'PY'
import sys
from npllm.formats.gguf import write_gguf
from npllm.formats.random import NAMED_SHAPES, random_weights
from npllm.tokenizer import load_tokenizer
shape, qtype, path, tokenizer = sys.argv[1:]
config = NAMED_SHAPES[shape]
write_gguf(path, config, random_weights(config), qtype, load_tokenizer(tokenizer))
PY
done

echo "== load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== llama.cpp: $build/bin/llama-bench -m <file> -p 128 -n 64 -t $threads -r 3 ${LLAMA_BENCH_ARGS:-}"
# shellcheck disable=SC2086  # LLAMA_BENCH_ARGS is a list of options
"$build/bin/llama-bench" -m "$out/$shape-F32.gguf,$out/$shape-Q8_0.gguf,$out/$shape-Q4_0.gguf" \
  -p 128 -n 64 -t "$threads" -r 3 ${LLAMA_BENCH_ARGS:-} -o md 2>/dev/null
echo "== npllm (model level, main's load path): $npllm bench --model <file> --batch 1 --prompt-len 128 --gen-len 64"
# npllm's threads sleep between parallel regions by default (OMP_WAIT_POLICY=PASSIVE, kernels/__init__.py: safe on a
# busy machine); llama.cpp's spin. Both are measured: the second pass lets npllm's threads spin too.
for policy in PASSIVE ACTIVE; do
  for type in F32 Q8_0 Q4_0; do
    for t in ${threads//,/ }; do
      echo "-- $type, threads $t, OMP_WAIT_POLICY=$policy"
      OMP_WAIT_POLICY=$policy "$npllm" bench --model "$out/$shape-$type.gguf" --batch 1 --prompt-len 128 --gen-len 64 \
        --repeat 2 --threads "$t" 2>/dev/null
    done
  done
done
echo "== load average: $(cut -d' ' -f1-3 /proc/loadavg)"
