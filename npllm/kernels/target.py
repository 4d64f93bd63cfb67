"""What the machine Numba compiles for offers: the one CPU-feature probe every kernel module asks.

Numba compiles for the host unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES (its own settings for compiling for another
machine) say otherwise. When either is set, the features are exactly those NUMBA_CPU_FEATURES lists ("+avx2,+fma,...";
a bare NUMBA_CPU_NAME lists none, so every wide path is off: the portable kernels, never an instruction the named
CPU may lack); else the host's, as LLVM sees them.
"""

from __future__ import annotations

import os
from functools import lru_cache

import llvmlite.binding


@lru_cache(maxsize=1)
def features() -> frozenset[str]:
    """The target's features as LLVM names them, without the '+' ("avx2", "avx512vnni", ...)."""
    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES"):
        listed = os.environ.get("NUMBA_CPU_FEATURES", "").split(",")
        return frozenset(f.strip()[1:] for f in listed if f.strip().startswith("+"))
    return frozenset(name for name, on in llvmlite.binding.get_host_cpu_features().items() if on)


def has(*names: str) -> bool:
    """Whether the target offers every one of `names`."""
    return set(names) <= features()
