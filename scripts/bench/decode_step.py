"""One decode step split in two: the forward of one token (after a prompt) and the LM head, medians over many steps,
in one process. The threads' wait policy is whatever npllm.kernels chose (printed), unless OMP_WAIT_POLICY or
GOMP_SPINCOUNT is set; run each setting in its own process, since OpenMP reads them once.

    python scripts/bench/decode_step.py FILE [PROMPT] [STEPS]          # defaults: 128-token prompt, 200 steps

The numba model, every matrix kept in its type (a GGUF file's blocks; float32 ones as panels). Also
printed: how often the process's threads went to sleep per step (voluntary context switches: each one a wake-up to
pay for at the next parallel region), and the steal time of the machine's CPUs meanwhile (time a VM's vCPUs were
ready to run but the host ran another guest).
"""
import os
import sys
import time

import numpy as np

from npllm import kernels
from npllm.bench import steal_seconds
from npllm.formats import read_checkpoint
from npllm.models import make_model

path = sys.argv[1]
prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 128
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 200
model = make_model(*read_checkpoint(path), "numba")
cache = model.new_cache(prompt + steps)
model.forward(np.arange(1, prompt + 1) % model.config.vocab_size, np.arange(prompt), cache)


def sleeps() -> int:
    """Voluntary context switches of this process's threads so far."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return total


forward_s, head_s = [], []
sleeps_before, steal_before, wall_before = sleeps(), steal_seconds(), time.perf_counter()
for i in range(steps):
    start = time.perf_counter()
    h = model.forward([5], [prompt + i], cache)
    middle = time.perf_counter()
    model.lm_head(h)
    forward_s.append(middle - start)
    head_s.append(time.perf_counter() - middle)
sleeps_per_step = (sleeps() - sleeps_before) / steps
stolen = (steal_seconds() - steal_before) / (time.perf_counter() - wall_before)
step = np.median(np.add(forward_s, head_s))
print(f"threads {'spin' if kernels.SPINNING else 'sleep'}: forward {1e3 * np.median(forward_s):.3f} ms, LM head "
      f"{1e3 * np.median(head_s):.3f} ms, step {1e3 * step:.3f} ms ({1 / step:.0f} tok/s); {sleeps_per_step:.2f} "
      f"sleeps per step, steal {stolen:.2f} CPUs")
