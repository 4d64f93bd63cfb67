"""Backends: which class runs the math of a loaded model.

    numpy  model.Transformer        the readable reference (float32 or float64, BLAS matrix products)
    numba  numba_model.NumbaTransformer   compiled CPU kernels (float32), the default
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .errors import ConfigError

BACKENDS = ("numba", "numpy")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r} (npllm has {', '.join(BACKENDS)})")


def make_model(config: ModelConfig, weights: dict[str, np.ndarray], backend: str = "numba",
               threads: int | None = None):
    """A model over `weights` run by `backend`, on `threads` cores (default: all)."""
    check_backend(backend)
    if backend == "numba":
        from .numba_model import NumbaTransformer

        return NumbaTransformer(config, weights, threads)
    if backend == "numpy":
        from .model import Transformer

        if threads is not None:
            limit_blas_threads(threads)
        return Transformer(config, weights)


def limit_blas_threads(threads: int) -> None:
    """Make NumPy's BLAS use `threads` threads from now on (threadpoolctl reaches OpenBLAS/MKL at run time)."""
    from threadpoolctl import threadpool_limits

    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    threadpool_limits(threads, user_api="blas")
