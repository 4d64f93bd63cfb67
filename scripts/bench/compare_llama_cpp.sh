#!/usr/bin/env bash
# Perplexity side by side: npllm and llama.cpp on the same GGUF files and the same text (llama.cpp's method).
#
#   bash scripts/bench/compare_llama_cpp.sh [CHECKPOINT] [TOKENIZER] [CTX]
#
# llama.cpp is built once by scripts/bench/build_llama_cpp.sh (from the llama-cpp-python source package on PyPI; cmake and a
# C++ compiler needed; ~15 minutes on 2 cores) in $LLAMA_CPP_DIR (default /tmp/npllm-llama.cpp). The text is
# twelve stories sampled from the checkpoint itself (seeds 1..12); the GGUFs are written by `npllm quantize`.
set -euo pipefail
cd "$(dirname "$0")/../.."
checkpoint=${1:-weights/stories260K/stories260K.bin}
tokenizer=${2:-weights/stories260K/tok512.model}
ctx=${3:-128}
build=${LLAMA_CPP_DIR:-/tmp/npllm-llama.cpp}
npllm=${NPLLM:-.venv/bin/npllm}

LLAMA_CPP_DIR=$build bash scripts/bench/build_llama_cpp.sh

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for seed in $(seq 1 12); do
  "$npllm" generate "" --model "$checkpoint" --tokenizer "$tokenizer" --temperature 1 --top-p 0.95 --seed "$seed" \
    --max-new-tokens 400 2>/dev/null
  echo
done > "$work/text.txt"

printf '%-6s %-28s %-28s\n' type "llama.cpp PPL" "npllm PPL"
for type in f32 q8_0 q4_0; do
  "$npllm" quantize "$checkpoint" "$work/$type.gguf" --type "$type" --tokenizer "$tokenizer" 2>/dev/null
  theirs=$("$build/bin/llama-perplexity" -m "$work/$type.gguf" -f "$work/text.txt" -c "$ctx" -b "$ctx" 2>&1 \
           | sed -n 's/.*Final estimate: PPL = \([0-9.]* +\/- [0-9.]*\).*/\1/p')
  ours=$("$npllm" perplexity --model "$work/$type.gguf" --text "$work/text.txt" --ctx "$ctx" 2>/dev/null \
         | sed -n 's/PPL = \([0-9.]* +\/- [0-9.]*\).*/\1/p')
  printf '%-6s %-28s %-28s\n' "$type" "$theirs" "$ours"
done
