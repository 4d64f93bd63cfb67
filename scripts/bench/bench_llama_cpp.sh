#!/usr/bin/env bash
# npllm against llama.cpp on the same GGUF files, in one command: builds llama.cpp where it is missing
# (scripts/bench/build_llama_cpp.sh: llama-bench, llama-batched-bench, llama-quantize, llama-perplexity in
# $LLAMA_CPP_DIR, default /tmp/npllm-llama.cpp; ~12-15 minutes on 2 cores the first time), then runs
# scripts/bench/llama_cpp_table.py with the arguments given: by default the 110M and TinyLlama-1.1B shapes in F32,
# Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K and IQ4_XS (files made by llama.cpp's llama-quantize from random-weight F32
# GGUFs, in $GGUF_DIR, default /tmp/npllm-bench-gguf; F32 timed at 110M only, --f32-shapes), at 1 and 2 threads,
# llama-bench and `npllm bench` paired run by run, then batched decode at 4 and 16 sequences (llama-batched-bench
# against `npllm bench --batch 4 16`). The output names the CPU model, the threads, the load average and each run's
# steal time; llama_cpp_table.py's docstring says what each figure is.
#
#   bash scripts/bench/bench_llama_cpp.sh                                   # the whole table (~15-20 minutes)
#   bash scripts/bench/bench_llama_cpp.sh --shapes stories110M --types Q4_0 Q4_K_M --threads 2 --batch
#   LLAMA_CPP_DIR=/tmp/npllm-llama.cpp-avx2 NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=... \
#     bash scripts/bench/bench_llama_cpp.sh       # another instruction set on both sides (docs/bench.md, "A laptop's
#                                                 # instruction set": the build and feature lists)
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-.venv/bin/python}
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-/tmp/npllm-llama.cpp} bash scripts/bench/build_llama_cpp.sh >&2
exec "$python" scripts/bench/llama_cpp_table.py "$@"
