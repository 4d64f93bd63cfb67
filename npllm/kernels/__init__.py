"""Compiled kernels for the stages of ops.py: cpu.py (Numba, multicore CPU) and simd.py (its vector type).

Numba's OpenMP threads are told to sleep, not spin, while they wait for work (OMP_WAIT_POLICY=PASSIVE, unless the
environment already says otherwise). A spinning thread holds a core that the main thread, BLAS or another process
wants; on a 2-core machine that turned a 0.25 ms matrix product into 8-16 ms. Sleeping costs ~2 us per parallel
region instead. This must be set before the OpenMP runtime starts, hence here, before any kernel runs.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
