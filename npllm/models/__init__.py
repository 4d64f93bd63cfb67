"""The transformer behind one interface (base.Model), run by one of three backends:

    numpy  reference.Transformer      the readable reference (float32 or float64, BLAS matrix products)
    numba  numba.NumbaTransformer     compiled CPU kernels (float32 sums; every matrix in its type), the default on a
                                      CPU
    cuda   cuda.CudaTransformer       numba.cuda kernels on an NVIDIA GPU (float32 sums; float32 or float16 storage)
    auto   cuda where a real GPU is usable, else numba

make_model is the one place a model is built; weights.py names the tensors every backend starts from.

The Numba backend's code is compiled the first time a kind of model runs on a machine (a minute or more), then
loaded from Numba's cache. make_model's cold_start says whether a model waits for that compile:
    wait       compile first (the default)
    exact      don't wait where the NumPy reference gives the compiled model's greedy tokens (float32 weights):
               a detached process compiles the code into the cache (compile_behind) while the model is the
               reference computing as the Numba model would (stand_in.py); a GGUF file's quantized matrices wait
    reference  don't wait, quantized matrices too (their tokens can part from the compiled model's after some
               tens of tokens: stand_in.py), for runs whose tokens are drawn at random anyway
The runs after it load the compiled code.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError, DeviceError
from .base import KV_DTYPES, Model, check_runs, kv_storage

BACKENDS = ("numba", "numpy", "cuda", "auto")
WEIGHT_DTYPES = ("file", "float32", "float16", "q8_0")
BLOCK_TYPE = {"float16": "F16", "q8_0": "Q8_0"}  # weight_dtype -> the block type its matrices are stored in
COLD_STARTS = ("wait", "exact", "reference")
BEHIND = "npllm:compile-behind"  # the event raised when a model's code is left to a detached compile (the CLI's notice)
LOCK_WAIT_S = 900  # at most this long, a run that waits for the compile waits for a detached one to end


def resolve_backend(backend: str) -> str:
    """"numba", "numpy" or "cuda" for a requested backend ("auto": cuda when a real GPU is usable, else numba).
    "cuda" without what CUDA needs raises DeviceError naming the missing piece, before any weight is read."""
    from ..device import cuda_available, cuda_problem

    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r} (npllm has {', '.join(BACKENDS)})")
    if backend == "auto":
        return "cuda" if cuda_available() else "numba"
    if backend == "cuda":
        problem = cuda_problem()
        if problem is not None:
            raise DeviceError(f"backend='cuda' was asked for but {problem}; use backend='numba' or 'auto'")
    return backend


def make_model(config: ModelConfig, weights: dict[str, np.ndarray], backend: str = "numba",
               threads: int | None = None, weight_dtype: str = "file", kv_dtype: str | None = None,
               cold_start: str = "wait", **options) -> Model:
    """A model over `weights` (a format reader's dict: arrays, and quant.QuantizedMatrix for matrices kept in their
    file types) run by `backend`, on `threads` CPU cores (default: all).

    weight_dtype, the same on every backend, says how the matrices are stored (storage() is the one place it is
    resolved): "file" each in its file type (the default), "float32", "float16" or "q8_0" (GGUF Q8_0 blocks;
    a matrix already of the type is kept byte for byte, any other is rounded to it). The numba backend computes
    with any of them in place (float32 panels, or its block kernels); numpy computes in float32 from the stored
    values (a block type is decoded once); cuda stores one type for every matrix: float32 ("file"), float16 or
    Q8_0 (float32 sums either way, see cuda.CudaTransformer). kv_dtype "float16" makes the model's caches store
    keys and values in half precision (numpy and numba backends; None: the compute dtype). options go to the CUDA
    model (geometry, one_launch: see cuda.CudaTransformer). cold_start: what the numba backend does when its code
    is not compiled yet, "wait" (compile it first), "exact" or "reference" (see the module's docstring).
    """
    if cold_start not in COLD_STARTS:
        raise ConfigError(f"cold_start must be one of {', '.join(COLD_STARTS)}, got {cold_start!r}")
    backend = resolve_backend(backend)
    kv = None if kv_dtype is None else kv_storage(kv_dtype)
    if backend == "cuda" and kv not in (None, np.float32):
        raise ConfigError(f"kv_dtype {kv_dtype}: the cuda backend's cache stores float32 (float16 is for the numba "
                          f"and numpy backends)")
    if backend != "cuda" and options:
        raise ConfigError(f"{', '.join(sorted(options))}: options of the cuda backend, not of {backend}")
    model = _make(config, storage(weights, weight_dtype, backend), backend, threads, kv, cold_start, **options)
    if kv is not None:
        model.kv_dtype = kv.name
    return model


@dataclasses.dataclass(frozen=True)
class Storage:
    """How a backend stores a model's matrices, as storage() decides it: `weights`, the arrays it is built from
    (already in the types the CPU backends keep), and `device`, the one type a GPU model gives every matrix on
    the device ("float32", "float16" or "q8_0"; None on the CPU backends). The model only carries it out."""

    weights: dict
    device: str | None = None


def storage(weights: dict, weight_dtype: str, backend: str) -> Storage:
    """How `backend` stores the weights under `weight_dtype` (see make_model), the one place that is decided:
    "file" leaves them as read, "float32" decodes every matrix to float32, "float16"/"q8_0" round every matrix to
    that block type; the numpy backend then decodes the stored values to float32 (it computes with arrays). The
    cuda backend gives every matrix one type, float32 for "file" (it has no kernels for a file's other types),
    and converts each matrix to it while uploading (no host copy of the model): its weights stay as read."""
    from ..quant import QuantizationError, dequantized, stored_as

    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    if backend == "cuda":
        return Storage(weights, "float32" if weight_dtype == "file" else weight_dtype)
    if weight_dtype in BLOCK_TYPE:
        try:
            weights = stored_as(weights, BLOCK_TYPE[weight_dtype])
        except QuantizationError as e:
            raise ConfigError(f"weight_dtype {weight_dtype}: {e}") from None
    return Storage(dequantized(weights) if backend == "numpy" or weight_dtype == "float32" else weights)


def _make(config: ModelConfig, stored: Storage, backend: str, threads: int | None, kv: np.dtype | None,
          cold_start: str, **options) -> Model:
    weights = stored.weights
    if backend == "cuda":
        from .cuda import CudaTransformer

        return CudaTransformer(config, weights, stored.device, **options)
    if backend == "numba":
        from ..quant import in_block_type
        from .numba import NumbaTransformer, link_ahead

        check_runs(NumbaTransformer, config)  # before a stand-in or a compile starts
        quantized = any(in_block_type(w) for w in weights.values())  # whether the stand-in's tokens can part
        start_compile = None if cold_start == "wait" else compile_behind(quantized, kv, cold_start)
        if start_compile is not None:
            from .stand_in import stand_in

            model = stand_in(config, weights)
            start_compile()
            # BLAS leaves the compile a core: its threads wait for each other by spinning, and a core that
            # another process holds makes every product wait (a TinyLlama prefill: 12 s on 2 threads, 2.6 on 1)
            return _reference(model, threads or max(1, (os.cpu_count() or 1) - 1))
        wait_for_detached()
        link_ahead(kv)  # the code, then the weights
        return NumbaTransformer(config, weights, threads)
    from .reference import Transformer

    return _reference(Transformer(config, weights), threads)


def _reference(model: Model, threads: int | None) -> Model:
    """A NumPy model, its BLAS held to `threads` threads (None: all)."""
    if threads is not None:
        limit_blas_threads(threads)
    return model


def compile_behind(quantized: bool, kv: np.dtype | None, cold_start: str):
    """Where the Numba model's code is not in Numba's cache yet and a detached process can compile it there: a
    function that starts that process (kernels/compiler.py, start_detached; it does nothing where one is compiling
    into that cache already), to call once this run's stand-in is made. None where the code is cached, where no
    detached compile can run here, or for a model of quantized matrices (weights in block types) under cold_start
    "exact": the caller compiles as always (waiting for a compile under way first). The event BEHIND (data: {"quantized": ..., "waits": ...}) says which, unless
    the code is cached.

    The compile starts after the stand-in is made because its first seconds slowed the making: a TinyLlama-shape
    Q4_0 file's 4.4 GB of decoded weights took 16.6 s with a compile starting beside them, 9.6 s without."""
    from numba.core import event

    from ..kernels.compiler import cache_lock, compiling, start_detached
    from .numba import COMPILE_LABEL, FORWARD, child_code, code_cached

    lock = cache_lock(FORWARD)
    if lock is None:
        return None
    # a compile still running may have cached the forward and not the rest: its end says done
    running = compiling(lock)
    if running is None and code_cached():
        return None
    waits = quantized and cold_start == "exact"
    with event.trigger_event(BEHIND, data={"quantized": quantized, "waits": waits}):
        pass
    if waits:
        return None

    def start() -> None:
        if running is None:
            start_detached(*child_code(kv), lock, COMPILE_LABEL)  # one started since: it exits

    return start


def wait_for_detached() -> None:
    """Let a detached compile of the Numba model's code finish (at most LOCK_WAIT_S), so that this process loads its
    code rather than compiling the same code beside it; raised as a "numba:compile" event (the CLI's notice)."""
    from numba.core import event

    from ..kernels.compiler import cache_lock, compiling, wait_for_lock
    from .numba import FORWARD

    lock = cache_lock(FORWARD)
    if lock is not None and compiling(lock) is not None:
        with event.trigger_event("numba:compile", data={"dispatcher": FORWARD, "args": None,
                                                        "return_type": None}):
            wait_for_lock(lock, LOCK_WAIT_S)


def limit_blas_threads(threads: int) -> None:
    """Make NumPy's BLAS use `threads` threads from now on (threadpoolctl reaches OpenBLAS/MKL at run time)."""
    from threadpoolctl import threadpool_limits

    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    threadpool_limits(threads, user_api="blas")
