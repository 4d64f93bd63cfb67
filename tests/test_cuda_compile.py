"""Every CUDA kernel, in every variant the model launches, through numba's real CUDA compiler (to PTX for sm_90).

The other CUDA tests run the kernels in numba's Python simulator, which never types or compiles them; this test
does, without a GPU: it needs only the CUDA toolkit's NVVM library (the `cuda` extra brings it) and skips, saying
so, where that is absent. It runs scripts/compile_cuda_kernels.py --quick (every kernel, each variant flag at
least once) in a child process outside the simulator; the script without --quick compiles all 142 variants.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def hardware_env():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def test_every_kernel_compiles_for_the_gpu():
    probe = subprocess.run([sys.executable, "-c", "from numba.cuda.cudadrv import nvvm; print(nvvm.is_available())"],
                           env=hardware_env(), capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "True":
        pytest.skip("numba's CUDA compiler (NVVM, from the CUDA toolkit) is not installed: pip install '.[cuda]'")
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "compile_cuda_kernels.py"), "--cc", "9.0", "--quick"],
                         env=hardware_env(), capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
