#!/usr/bin/env bash
# npllm on a real NVIDIA GPU, everything written to one file:
#   1. the environment (driver, GPU, numba / numba-cuda / toolkit versions, what npllm.device says)
#   2. the CUDA tests without the simulator, the stories260K golden text in full (200 tokens)
#   3. scripts/bench/cuda_timing.py (npllm bench's timing, plus the bandwidth roofline) on the stories15M, stories110M and
#      tinyllama-1.1B shapes (random weights), float32, float16 and Q8_0 weight storage: prefill tok/s, decode
#      tok/s at batch 1 and 32, the device-to-device bandwidth measured in the run and the fraction of it reached
#   4. (not QUICK) tinyllama-1.1B with one launch per stage instead of one per forward call
#
#     scripts/gpu_check.sh [RESULTS_FILE]      default $OUT/gpu_check.txt when $OUT is set, else gpu_check.txt
#
# Needs an NVIDIA driver, numba's CUDA target with a CUDA toolkit (pip install '.[cuda,test]', or numba 0.68's
# own target and a system toolkit), and the stories260K files in $NPLLM_WEIGHTS or weights/stories260K (else the
# golden test skips, saying so). Each step has its own time limit; a failing step does not stop the others.
# QUICK=1 (for a short device session): shorter limits, the 110M and 1.1B shapes, prompts of 128.
set -u
cd "$(dirname "$0")/.."
RESULTS="${1:-${OUT:+$OUT/gpu_check.txt}}"
RESULTS="${RESULTS:-gpu_check.txt}"
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NUMBA_ENABLE_CUDASIM=0
: > "$RESULTS"

step() {  # step SECONDS TITLE COMMAND...: run it, its output and exit status appended to the results file
  local limit="$1" title="$2" start=$SECONDS
  shift 2
  echo "=== $title" | tee -a "$RESULTS"
  timeout "$limit" "$@" >> "$RESULTS" 2>&1
  echo "--- exit $? after $((SECONDS - start)) s" | tee -a "$RESULTS"
}

step 120 "environment" bash -c "nvidia-smi; $PY - <<'PYEOF'
import sys
from importlib import metadata
import numba, numpy
print(sys.version)
for dist in ('numba', 'numpy', 'numba-cuda', 'cuda-bindings', 'cuda-toolkit', 'nvidia-cuda-nvcc-cu12',
             'nvidia-cuda-runtime-cu12'):
    try:
        print(dist, metadata.version(dist))
    except metadata.PackageNotFoundError:
        print(dist, 'not installed')
from npllm.device import cuda_problem
print('npllm.device.cuda_problem():', cuda_problem())
from numba import cuda
print('numba.cuda implementation:', getattr(cuda, 'implementation', '?'))
try:
    cuda.detect()
except Exception as e:
    print('numba.cuda.detect() failed:', e)
from numba.cuda.cudadrv import libs
try:
    print('cudadevrt (one-launch decode):', libs.get_cudalib('cudadevrt', static=True))
except Exception as e:
    print('cudadevrt not found (decode falls back to one launch per stage):', e)
PYEOF"
# QUICK=1 fits one short device session (~8 minutes at most): shorter limits, the 110M and 1.1B shapes only.
TESTS_LIMIT=900; BENCH_LIMIT=600; MODELS="stories15M stories110M tinyllama-1.1B"; PROMPTS="128 512"; GEN=64
if [ -n "${QUICK:-}" ]; then TESTS_LIMIT=300; BENCH_LIMIT=150; MODELS="stories110M tinyllama-1.1B"; PROMPTS="128"; GEN=32; fi
step "$TESTS_LIMIT" "CUDA tests on the GPU, golden in full" env NPLLM_CUDA_GOLDEN_FULL=1 \
  "$PY" -m pytest -q -rs -p no:cacheprovider -W error::RuntimeWarning --timeout 150 --durations=15 \
  tests/test_cuda_model.py tests/test_cuda_kernels.py tests/test_cuda_q8_0.py tests/test_cuda_compile.py

# npllm bench's timing (bench.Session) with the roofline columns: float32, float16 and Q8_0 storage, batch 1 and 32
for model in $MODELS; do
  step "$BENCH_LIMIT" "cuda_timing $model: float32, float16, q8_0 storage" "$PY" scripts/bench/cuda_timing.py \
    --model "$model" --dtype float32 float16 q8_0 --batch 1 32 --prompt-len $PROMPTS --gen-len "$GEN"
done
if [ -z "${QUICK:-}" ]; then
  step 600 "cuda_timing tinyllama-1.1B stage by stage (against the one-launch figures above)" "$PY" \
    scripts/bench/cuda_timing.py --model tinyllama-1.1B --stage-by-stage --batch 1 32 --prompt-len 128 --gen-len 64
fi
echo "results in $RESULTS"
