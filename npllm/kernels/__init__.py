"""Compiled kernels for the stages of ops.py: cpu.py (Numba, multicore CPU; models/numba.py runs them), simd.py (its
vector types) and cuda.py (numba.cuda, NVIDIA GPUs; models/cuda.py runs them, imported only there).

Between parallel regions Numba's OpenMP threads either spin or sleep, and which is faster depends on the machine:
- A thread that sleeps must be woken for the next region: tens of microseconds, paid ~61 times per decode step
  (five regions per layer). On a 2-vCPU VM with nothing else running, a stories110M Q4_K_M decode step's forward took
  7.1 ms with sleeping threads, 2.7 ms with threads that spin ~0.15 ms before they sleep (GOMP_SPINCOUNT=3000).
- A thread that spins holds a core that the main thread or another process wants: with another process busy on
  one of those two cores, the same step took 5.4 ms sleeping and 10.0 ms spinning.
- Where the host is busy (a VM whose vCPUs lose time to other guests: "steal"), a thread waits longer for the other
  to reach the end of a region, and a short spin ran out 3-30 times per 110M decode step: each sleep a wake-up
  through the host's scheduler, and the step took up to three times as long. Spinning ten times as long (30000
  iterations: 0.5-1 ms on that VM, where 3000 ran out in 0.05-0.1 ms), the threads slept 0.01-0.05 times per step
  on a quiet host (0.3-1.8 under steal), and decoded as fast as with the short spin while the host was quiet.
So the threads spin (GOMP_SPINCOUNT=SPIN_COUNT) when the machine has a core free for each of them (no other task
running or waiting, as the kernel counts them at import), and sleep (OMP_WAIT_POLICY=PASSIVE) otherwise.
Either variable set in the environment wins. This must be decided before the OpenMP runtime starts, hence here;
SPINNING records the decision (models/numba.py sizes its parallel regions by it, `npllm bench` reports it).
"""

import os
import time

SPIN_COUNT = 30000  # libgomp's busy-wait iterations before a thread sleeps (0.5-1 ms; 3000 slept mid-step)


def _running_here() -> int:
    """Threads of this process running or waiting for a core (OpenBLAS's threads spin for a while after NumPy
    starts them)."""
    running = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                running += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            pass  # a thread that ended meanwhile
    return running


def _busy_elsewhere(samples: int = 8, gap_s: float = 0.001) -> float:
    """Tasks of other processes running or waiting for a core right now: the running count of /proc/loadavg less
    this process's own, the least over a few milliseconds (a busy neighbour is counted in every sample; the short
    tasks around a process's start, a shell or a kernel worker, are not). Where there is no /proc/loadavg, the
    1-minute load average. (Not the load average everywhere: it remembers the last minute, so a benchmark started
    right after another program would see that program's load, and a busy neighbour that just started would not.)"""
    try:
        counts = []
        for _ in range(samples):
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - _running_here())
            time.sleep(gap_s)
        return max(0, min(counts))
    except (OSError, ValueError, IndexError):
        if not hasattr(os, "getloadavg"):  # Windows
            raise OSError("no way to count the busy tasks here") from None
        return os.getloadavg()[0]  # OSError where there is none either


def _spare_cores() -> float:
    """Cores this process may use, minus the ones its threads need, minus the tasks busy elsewhere."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        threads = int(os.environ.get("NUMBA_NUM_THREADS", cores))
    except ValueError:
        threads = cores  # Numba itself reports a malformed NUMBA_NUM_THREADS
    try:
        return cores - threads - _busy_elsewhere()
    except OSError:
        return -1.0  # no way to tell: sleep, the safe choice


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

# Before any cached kernel is made: their cache entries follow every file of the package (compiler.py says why).
from .compiler import stamp_package_caches  # noqa: E402

stamp_package_caches()
