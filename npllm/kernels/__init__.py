"""Compiled kernels for the stages of ops.py: cpu.py (Numba, multicore CPU; models/numba.py runs them), simd.py (its
vector types) and cuda.py (numba.cuda, NVIDIA GPUs; models/cuda.py runs them, imported only there).

Between parallel regions Numba's OpenMP threads either spin or sleep, and which is faster depends on the machine:
- A thread that sleeps must be woken for the next region: tens of microseconds, paid ~61 times per decode step
  (five regions per layer). On a 2-vCPU VM with nothing else running, a stories110M Q4_K_M decode step's forward took
  7.1 ms with sleeping threads, 2.7 ms with threads that spin ~0.15 ms before they sleep (GOMP_SPINCOUNT=3000).
- A thread that spins holds a core that the main thread or another process wants: with another process busy on
  one of those two cores, the same step took 5.4 ms sleeping and 10.0 ms spinning.
So the threads spin briefly (GOMP_SPINCOUNT=SPIN_COUNT) when the machine had a core free for each of them over the
last minute (load average), and sleep (OMP_WAIT_POLICY=PASSIVE) otherwise. Either variable set in the environment
wins. This must be decided before the OpenMP runtime starts, hence here; SPINNING records the decision
(models/numba.py sizes its parallel regions by it, `npllm bench` reports it).
"""

import os

SPIN_COUNT = 3000  # libgomp's busy-wait iterations before a thread sleeps (~0.15 ms here)


def _spare_cores() -> float:
    """Cores this process may use minus the ones its threads need, minus the 1-minute load average."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        threads = int(os.environ.get("NUMBA_NUM_THREADS", cores))
    except ValueError:
        threads = cores  # Numba itself reports a malformed NUMBA_NUM_THREADS
    try:
        load = os.getloadavg()[0]
    except OSError:
        return -1.0  # no load average (not Linux or macOS): sleep, the safe choice
    return cores - threads - load


def _choose_wait_policy() -> bool:
    """Sets the OpenMP wait policy unless the environment has; True where the threads spin."""
    if "GOMP_SPINCOUNT" in os.environ:  # libgomp takes it over the policy
        return os.environ["GOMP_SPINCOUNT"].strip() not in ("0", "")
    if "OMP_WAIT_POLICY" in os.environ:
        return os.environ["OMP_WAIT_POLICY"].strip().upper() != "PASSIVE"
    if _spare_cores() >= -0.5:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
        return True
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return False


SPINNING = _choose_wait_policy()
