#!/usr/bin/env bash
# Build llama.cpp for the side-by-side scripts, from the llama-cpp-python source package on PyPI (its vendored
# llama.cpp; cmake and a C++ compiler needed; ~12-15 minutes on 2 cores): llama-perplexity
# (scripts/bench/compare_llama_cpp.sh), llama-bench and llama-batched-bench (scripts/bench/bench_llama_cpp.sh,
# scripts/bench/llama_cpp_table.py) and llama-quantize (scripts/bench/llama_cpp_files.py,
# scripts/bench/quantizer_quality.py), into $LLAMA_CPP_DIR/bin (default /tmp/npllm-llama.cpp). Builds only the ones
# missing (an existing build folder keeps its options: a new $LLAMA_CMAKE_ARGS needs a new $LLAMA_CPP_DIR); does
# nothing when all four are there.
#
#   bash scripts/bench/build_llama_cpp.sh
#   LLAMA_CPP_DIR=/tmp/npllm-llama.cpp-avx2 LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
#     -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" bash scripts/bench/build_llama_cpp.sh    # a laptop's AVX2, no AVX-512
#
# $LLAMA_CMAKE_ARGS chooses the instruction set (default -DGGML_NATIVE=ON: this machine's). On a VM that lists AMX
# without enabling it, a native build's repacked kernels die of SIGILL: there, list the machine's features without
# AMX (docs/bench.md gives the list used for its figures) or pass llama-bench "--repack 0".
set -euo pipefail
build=${LLAMA_CPP_DIR:-/tmp/npllm-llama.cpp}
targets=(llama-perplexity llama-bench llama-batched-bench llama-quantize)
missing=0
for target in "${targets[@]}"; do
  [ -x "$build/bin/$target" ] || missing=1
done
if [ "$missing" = 0 ]; then
  echo "llama.cpp already built in $build/bin"
  exit 0
fi
mkdir -p "$build/src"
if ! ls -d "$build"/src/llama_cpp_python-*/vendor/llama.cpp > /dev/null 2>&1; then
  pip download --no-binary :all: --no-deps -q llama-cpp-python -d "$build/src"
  tar xzf "$build"/src/llama_cpp_python-*.tar.gz -C "$build/src"
fi
source=$(ls -d "$build"/src/llama_cpp_python-*/vendor/llama.cpp | head -n 1)
if [ ! -f "$build/cmake/CMakeCache.txt" ]; then  # an existing build keeps the options it was configured with
  # shellcheck disable=SC2086  # LLAMA_CMAKE_ARGS is a list of options
  cmake -S "$source" -B "$build/cmake" -DCMAKE_BUILD_TYPE=Release ${LLAMA_CMAKE_ARGS:--DGGML_NATIVE=ON} \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF \
    > /dev/null
fi
nice cmake --build "$build/cmake" --target "${targets[@]}" -j"$(nproc)" > "$build/build.log" 2>&1 \
  || { tail -n 30 "$build/build.log" >&2; exit 1; }
mkdir -p "$build/bin" && cp -P "$build"/cmake/bin/* "$build/bin/"
echo "llama.cpp built in $build/bin ($(basename "$(dirname "$(dirname "$source")")"))"
