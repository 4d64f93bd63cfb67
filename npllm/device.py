"""Whether numba.cuda can run here: what the cuda backend needs (models/__init__.py: resolve_backend picks it).

numba.cuda needs three things that a CPU machine usually lacks: the CUDA target itself (the `numba-cuda` package,
npllm's `cuda` extra), an NVIDIA driver with a GPU, and the CUDA toolkit's NVVM compiler library (brought by the
extra's `cuda-toolkit` wheels). `cuda_problem()` names the first one missing.

numba can also *simulate* CUDA on the CPU (NUMBA_ENABLE_CUDASIM=1: every GPU thread becomes a Python thread). The
simulator runs the same kernels, thousands of times slower: tests use it, backend "auto" never picks it.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

from .errors import DeviceError

INSTALL_HINT = "pip install -e '.[cuda]' in npllm's folder"


def cuda_simulated() -> bool:
    """True when numba runs CUDA kernels in its CPU simulator (NUMBA_ENABLE_CUDASIM=1)."""
    from numba.core import config

    return bool(config.ENABLE_CUDASIM)


def cuda_problem() -> str | None:
    """Why CUDA cannot be used here, in words (None when it can: real hardware or the simulator)."""
    try:
        importlib.import_module("numba.cuda")  # the target itself, whichever package provides it
    except ImportError as e:
        return f"numba's CUDA target cannot be imported ({e}); install it with {INSTALL_HINT}"
    if cuda_simulated():
        return None
    from numba.cuda.cudadrv import driver, nvvm
    from numba.cuda.cudadrv.error import CudaSupportError

    try:
        driver_ok = driver.driver.is_available
    except CudaSupportError:
        driver_ok = False
    if not driver_ok:
        reason = " ".join(str(driver.driver.initialization_error or "driver initialisation failed").split())
        return f"no usable NVIDIA driver or GPU was found ({reason})"
    if not nvvm.is_available():
        return (f"the NVIDIA driver works but the CUDA toolkit's NVVM library was not found; {INSTALL_HINT} "
                "installs it (or install the CUDA toolkit and set CUDA_HOME)")
    return first_compile_problem()


@functools.cache
def first_compile_problem() -> str | None:
    """Why numba's CUDA target cannot compile even a one-line kernel here (None when it can), checked once.

    A driver and NVVM are not enough: the target's first compile imports the rest of it, which can fail against
    the installed NumPy (numba-cuda 0.30 registers an overload of `np.row_stack`, which NumPy 2.5 removed, so on
    an H200 with NumPy 2.5.2 every kernel failed with an AttributeError from inside numba). Saying so here turns
    that into one sentence at `backend="cuda"` instead of a traceback at the first forward call."""
    import numpy as np
    from numba import cuda, types

    def touch(x):  # the smallest kernel body: one store
        x[0] = 0.0

    try:
        cuda.compile_ptx(touch, (types.float32[::1],))
    except Exception as e:  # noqa: BLE001 - whatever breaks inside the compiler, the user needs its one line
        return (f"numba's CUDA target cannot compile a kernel here ({type(e).__name__}: {e}) with NumPy "
                f"{np.__version__}; {INSTALL_HINT} installs versions that work together (NumPy < 2.5)")
    return None


def cuda_available() -> bool:
    """True when a real GPU can run npllm's CUDA kernels (the simulator does not count)."""
    return cuda_problem() is None and not cuda_simulated()


def use_cuda_simulator() -> None:
    """Run numba.cuda in its CPU simulator from now on in this process, unless NUMBA_ENABLE_CUDASIM is set already
    (NUMBA_ENABLE_CUDASIM=0 keeps real hardware). Call it before numba.cuda is first imported: numba binds the
    simulator or the driver at that import."""
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    from numba.core import config

    config.reload_config()  # numba read the environment when it was imported, maybe before the line above
    imported = sys.modules.get("numba.cuda")
    if imported is not None and imported.is_available.__module__.endswith("simulator_init") != cuda_simulated():
        raise DeviceError("numba.cuda was imported before use_cuda_simulator() and is bound to the other target")
    if cuda_simulated():
        _lock_simulated_shared_arrays()


def _lock_simulated_shared_arrays() -> None:
    """Make the simulator's shared arrays shared. It creates a block's `cuda.shared.array` when the first thread
    reaches the line, with no lock: two threads arriving together can each create (and keep) their own array,
    and the block's reductions then read garbage, now and then. Creation is serialised here."""
    import threading

    import numpy as np
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    shared = kernelapi.FakeCUDAShared
    if getattr(shared, "npllm_locked", False):
        return
    unlocked = shared.array
    lock = threading.Lock()

    def array(self, shape, dtype):
        if shape == 0:  # dynamic shared memory: one buffer for all, nothing created here
            return unlocked(self, shape, dtype)
        caller = sys._getframe(1)  # the kernel line: one array per line, as the simulator does
        key = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            found = self._allocations.get(key)
            if found is None:
                dtype = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)
                found = self._allocations[key] = np.empty(shape, dtype)
        return found

    shared.array = array
    shared.npllm_locked = True
