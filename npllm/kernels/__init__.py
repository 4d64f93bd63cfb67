"""Compiled kernels for the stages of ops.py: cpu.py (Numba, multicore CPU; models/numba.py runs them), simd.py (its
vector types) and cuda.py (numba.cuda, NVIDIA GPUs; models/cuda.py runs them, imported only there).

Numba's OpenMP threads sleep as soon as a parallel region ends (OMP_WAIT_POLICY=PASSIVE), unless the environment
already says otherwise. Threads that spin while they wait (the OpenMP default, ~5 ms) hold a core that the main
thread, BLAS or another process wants: on a busy 2-core machine that turned 0.25 ms matrix products into 8-16 ms
ones, and made decode slower than on one thread. Sleeping costs a wake-up per parallel region instead. On a
machine with nothing else to run, a short spin is faster (GOMP_SPINCOUNT=10000, ~0.3 ms; see docs/bench.md).
This must be set before the OpenMP runtime starts, hence here.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
