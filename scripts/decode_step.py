"""One decode step split in two: the forward of one token (after a prompt) and the LM head, medians over many steps,
in one process. The threads' wait policy is whatever npllm.kernels chose (printed), unless OMP_WAIT_POLICY or
GOMP_SPINCOUNT is set; run each setting in its own process, since OpenMP reads them once.

    python scripts/decode_step.py FILE [PROMPT] [STEPS]          # defaults: 128-token prompt, 200 steps

The numba model, weights kept in their file types (a GGUF) or packed float32 panels (other checkpoints).
"""
import sys
import time

import numpy as np

from npllm import kernels
from npllm.formats import read_checkpoint
from npllm.models import make_model

path = sys.argv[1]
prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 128
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 200
model = make_model(*read_checkpoint(path, keep_quantized=True), "numba")
cache = model.new_cache(prompt + steps)
model.forward(np.arange(1, prompt + 1) % model.config.vocab_size, np.arange(prompt), cache)
forward_s, head_s = [], []
for i in range(steps):
    start = time.perf_counter()
    h = model.forward([5], [prompt + i], cache)
    middle = time.perf_counter()
    model.lm_head(h)
    forward_s.append(middle - start)
    head_s.append(time.perf_counter() - middle)
step = np.median(np.add(forward_s, head_s))
print(f"threads {'spin' if kernels.SPINNING else 'sleep'}: forward {1e3 * np.median(forward_s):.3f} ms, LM head "
      f"{1e3 * np.median(head_s):.3f} ms, step {1e3 * step:.3f} ms ({1 / step:.0f} tok/s)")
