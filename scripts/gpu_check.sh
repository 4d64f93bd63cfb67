#!/usr/bin/env bash
# npllm on a real NVIDIA GPU: environment, the CUDA tests without the simulator (stories260K golden in full),
# `npllm bench --device cuda` and scripts/cuda_timing.py on the stories15M, stories110M and tinyllama-1.1B shapes.
# Everything goes to one file:
#
#     scripts/gpu_check.sh [RESULTS_FILE]        (default gpu_check_results.txt; $OUT/gpu_check.txt under $OUT)
#
# Needs: an NVIDIA driver, numba's CUDA target with the CUDA toolkit (pip install '.[cuda]'), the test extra, and
# the stories260K files in $NPLLM_WEIGHTS or weights/stories260K (else the golden test skips, saying so).
# Each step has its own time limit and the script goes on after a failure; QUICK=1 skips the 512-token prompts
# and the bench command, for a session with little device time.
set -u
cd "$(dirname "$0")/.."
RESULTS="${1:-${OUT:+$OUT/gpu_check.txt}}"
RESULTS="${RESULTS:-gpu_check_results.txt}"
PY="${PYTHON:-python}"
: > "$RESULTS"

step() {  # step SECONDS TITLE COMMAND...: run, append output and exit status to the results file
  local limit="$1" title="$2"; shift 2
  local start=$SECONDS
  echo "=== $title" | tee -a "$RESULTS"
  timeout "$limit" "$@" >> "$RESULTS" 2>&1
  local rc=$?
  echo "--- exit $rc after $((SECONDS - start)) s" | tee -a "$RESULTS"
}

export NUMBA_ENABLE_CUDASIM=0
step 60 "environment" bash -c "nvidia-smi; $PY -c '
import sys, numba, numpy; print(sys.version); print(\"numba\", numba.__version__, \"numpy\", numpy.__version__)
from importlib import metadata
for d in (\"numba-cuda\", \"cuda-bindings\", \"cuda-toolkit\", \"nvidia-cuda-nvcc-cu12\", \"nvidia-cuda-runtime-cu12\"):
    try: print(d, metadata.version(d))
    except metadata.PackageNotFoundError: print(d, \"not installed\")
from npllm.device import cuda_problem; print(\"npllm cuda_problem:\", cuda_problem())
from numba import cuda; print(\"numba.cuda implementation:\", getattr(cuda, \"implementation\", \"?\")); cuda.detect()
from numba.cuda.cudadrv import libs
try: print(\"cudadevrt (cooperative launches):\", libs.get_cudalib(\"cudadevrt\", static=True))
except Exception as e: print(\"cudadevrt not found:\", e)
'"
step 900 "CUDA tests on the GPU (golden in full)" env NPLLM_CUDA_GOLDEN_FULL=1 \
  "$PY" -m pytest -q -rs --durations=10 tests/test_cuda_kernels.py tests/test_cuda_model.py
PROMPTS="128 512"; [ -n "${QUICK:-}" ] && PROMPTS="128"
for model in stories15M stories110M tinyllama-1.1B; do
  step 600 "cuda_timing $model float32" "$PY" scripts/cuda_timing.py --model "$model" --batch 1 32 \
    --prompt-len $PROMPTS --gen-len 64
done
step 300 "cuda_timing tinyllama-1.1B float16 storage" "$PY" scripts/cuda_timing.py --model tinyllama-1.1B \
  --dtype float16 --batch 1 32 --prompt-len 128 --gen-len 64
if [ -z "${QUICK:-}" ]; then
  for model in stories15M stories110M tinyllama-1.1B; do
    step 600 "npllm bench --device cuda $model" "$PY" -m npllm bench --device cuda --model "$model" \
      --batch 1 32 --prompt-len 128 512 --gen-len 64 --repeat 2 --json
  done
fi
echo "results in $RESULTS"
