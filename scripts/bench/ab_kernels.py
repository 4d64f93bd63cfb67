"""Two versions of npllm's interleaved block kernels in ONE process, their calls alternated: the A/B that a noisy
shared machine allows. The host takes time from this VM in bursts (docs/bench.md), so two versions timed one after
the other can differ by 1.5x with no change at all; alternating the calls of both in one process gives each pair of
calls the same machine, and the median of the paired ratios is what the change did.

    python scripts/bench/ab_kernels.py BASE_QUANT [TOKENS] [TYPES] [CALLS] [ROWS] [COLUMNS]
    # e.g. git worktree add /tmp/base HEAD~1, then
    #      python scripts/bench/ab_kernels.py /tmp/base/npllm/kernels/quant 16 Q4_0,Q4_K,Q8_0 300

BASE_QUANT is another checkout's npllm/kernels/quant package (or, before it was split, its npllm/kernels/quant.py),
loaded beside this one's under another module name; its imports outside it are this checkout's, so only the kernels
may differ. Each type: a ROWS x COLUMNS matrix (default 512 x
1024) of Gaussian weights quantized by npllm and interleaved, TOKENS [T, COLUMNS] activations,
`matmul_int8_interleaved` on one thread (the matrix stays in L2 by default: the tile's cost, not memory's; one
larger than the last-level cache streams). Both versions must give the same bits (checked first). Prints
ps per multiply-add (min and median of each) and base/new, the median of the paired ratios. The machine's own
instruction set, or another (NUMBA_CPU_NAME and NUMBA_CPU_FEATURES, which npllm's kernels follow) with its own
NUMBA_CACHE_DIR.
"""
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

from npllm import quant
from npllm.kernels import quant as new


def load_base(path: str):
    package = Path(path).is_dir()
    spec = importlib.util.spec_from_file_location("npllm.kernels.quant_base", Path(path, "__init__.py") if package
                                                  else path, submodule_search_locations=[path] if package else None)
    base = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = base
    spec.loader.exec_module(base)
    return base


def paired_times(base, w8, qtype, x, calls: int) -> dict:
    """Seconds of each call of each version, the order of a pair swapped each time."""
    times = {"base": [], "new": []}
    for i in range(calls):
        order = (("base", base), ("new", new)) if i % 2 else (("new", new), ("base", base))
        for name, module in order:
            t0 = time.perf_counter()
            module.matmul_int8_interleaved(w8, qtype, x)
            times[name].append(time.perf_counter() - t0)
    return {k: np.array(v) for k, v in times.items()}


def main():
    base = load_base(sys.argv[1])
    T = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    qtypes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]
    calls = int(sys.argv[4]) if len(sys.argv) > 4 else 300
    N, K = (int(a) for a in (sys.argv[5:7] + ["512", "1024"][len(sys.argv[5:7]):]))
    rng = np.random.default_rng(0)
    for qtype in qtypes:
        raw = getattr(quant, "quantize_" + qtype.lower())(rng.standard_normal((N, K)).astype(np.float32))
        w8 = quant.interleave_rows(raw.reshape(N, -1), qtype)
        x = rng.standard_normal((T, K)).astype(np.float32)
        if not np.array_equal(base.matmul_int8_interleaved(w8, qtype, x), new.matmul_int8_interleaved(w8, qtype, x)):
            sys.exit(f"{qtype}: the two versions give different results")
        times = paired_times(base, w8, qtype, x, calls)
        ps = {k: v / (N * K * T) * 1e12 for k, v in times.items()}
        ratio = np.median(times["base"] / times["new"])
        print(f"{qtype} T={T}  base {ps['base'].min():.1f} / {np.median(ps['base']):.1f}  new {ps['new'].min():.1f}"
              f" / {np.median(ps['new']):.1f} ps (min / median)  base/new {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
