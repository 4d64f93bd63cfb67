"""Compile every CUDA kernel of npllm, in every variant the model launches, to PTX for a GPU architecture.

No GPU is needed, only numba's CUDA target and the CUDA toolkit's NVVM (pip install '.[cuda]'): this is how a
machine without a GPU checks that the kernels, which its tests run in numba's Python simulator, also pass numba's
CUDA compiler (typing, constant shapes, lowering). Run it outside the simulator:

    NUMBA_ENABLE_CUDASIM=0 python scripts/compile_cuda_kernels.py [--cc 9.0]

Prints one line per kernel and exits non-zero if any fails to compile.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cc", default="9.0", help="compute capability to compile for (default 9.0, Hopper)")
    parser.add_argument("--quick", action="store_true",
                        help="one variant of each kind (rows 1 and 8; float32, float16, q8_0): a quarter of the time")
    args = parser.parse_args()
    cc = tuple(int(p) for p in args.cc.split("."))

    from numba import cuda, typeof

    from npllm.kernels import cuda as k

    if not cuda.is_available():
        # numba compiles device functions for "the current device"; without a GPU, name the target ourselves
        from numba.cuda import dispatcher

        class Target:
            compute_capability = cc

        dispatcher.get_current_device = Target

    def arr(dtype, ndim, layout="C"):
        return typeof(np.empty((2,) * ndim, dtype)).copy(layout=layout)

    f32, f16, i32, q80 = np.float32, np.float16, np.int32, k.Q8_0_BLOCK
    f, i = typeof(np.float32(0)), typeof(np.int32(0))
    g = k.HARDWARE
    cases = {}
    for rows in (1, 2, 4, 8):
        for norm, residual, gated in ((False, False, False), (True, False, False), (False, True, False),
                                      (True, False, True)):
            for wt in (f32, f16, q80):
                w = arr(wt, 3 if gated else 2)
                for layout in ("C", "A"):  # lm_head may get a strided slice of the hidden states
                    cases[f"matvec rows={rows} norm={norm} residual={residual} gated={gated} {name_of(wt)} "
                          f"{layout}"] = (k.matvec_kernel(rows, g.threads, g.lanes, norm, residual, gated,
                                                          wt is q80),
                                          (arr(f32, 2, layout), arr(f32, 1), f, w, arr(f32, 2), f, i))
    for residual in (False, True):
        for wt in (f32, f16, q80):
            cases[f"matmul residual={residual} {name_of(wt)}"] = (
                k.matmul_kernel(g.tile, residual, wt is q80), (arr(f32, 2), arr(wt, 2), arr(f32, 2), f))
    cases["sample"] = (k.sample_kernel(g.sampler_threads),
                       (arr(f32, 2), arr(f32, 2), arr(f32, 2), arr(i32, 1)))
    cases["gather_rows"] = (k.gather_rows_kernel(), (arr(f32, 2), arr(i32, 1), arr(f32, 2)))
    for ndim in (2, 3):
        cases[f"compact {ndim}-D"] = (k.compact_kernel(ndim), (arr(f32, ndim, "A"), arr(f32, ndim)))
    def step_args(wt, w13_ndim):
        """The step kernels' argument types: (weights, shape, cos, sin, meta, cache, work, hidden)."""
        def record(cls, *members):
            return typeof(cls(*(np.empty((2,) * ndim, dtype) if ndim else dtype(0) for dtype, ndim in members)))

        weights = record(k.StepWeights, (wt, 2), (f32, 3), (wt, 3), (f32, 2), (wt, 3), (wt, w13_ndim), (wt, 3),
                         (f32, 1), (f32, 2), (f32, 2), (f32, 3), (f32, 3), (wt, 5), (wt, 4))
        shape = record(k.StepShape, (f32, 0), (i32, 0), (i32, 0), (i32, 0), (f32, 0), (f32, 0), (i32, 0), (f32, 0),
                       (f32, 0), (i32, 1), (i32, 1), (i32, 0))
        cache = record(k.StepCache, (f32, 5), (f32, 5), (i32, 2))
        work = record(k.StepWork, *[(f32, 2)] * 8, (f32, 2), (i32, 2), (f32, 2), (f32, 3))
        return (weights, shape, arr(f32, 3), arr(f32, 3), arr(i32, 2), cache, work, arr(f32, 2), i, i)

    for cooperative in (True, False):  # one launch, or one step a launch (no grid barrier, no cudadevrt)
        way = "" if cooperative else " step-by-step"
        for rows in (1, 8):
            for interleaved in (True, False):
                for wt in (f32, f16, q80):
                    cases[f"decode_step rows={rows} interleaved={interleaved} {name_of(wt)}{way}"] = (
                        k.decode_step_kernel(rows, g.threads, g.lanes, interleaved, wt is q80, cooperative),
                        step_args(wt, 4))
        for interleaved in (True, False):
            for wt in (f32, f16, q80):
                cases[f"batch_step interleaved={interleaved} {name_of(wt)}{way}"] = (
                    k.batch_step_kernel(g.tile, interleaved, wt is q80, cooperative), step_args(wt, 3))
    if args.quick:
        cases = {name: case for name, case in cases.items() if quick(name)}
    failed = 0
    for name, (kernel, argtypes) in cases.items():
        try:
            ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=cc)
            barrier = "cudaCGGetIntrinsicHandle" in ptx  # the grid barrier's handle: a cooperative launch's kernel
            if name.startswith(("decode_step", "batch_step")) and barrier == ("step-by-step" in name):
                raise AssertionError("a step-by-step kernel holds the grid barrier, or a one-launch one lacks it")
            print(f"ok    {name}  ({len(ptx) // 1024} KiB of PTX)", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL  {name}\n{traceback.format_exc(limit=-3)}", flush=True)
    print(f"{len(cases) - failed} of {len(cases)} kernels compile for sm_{cc[0]}{cc[1]}")
    return 1 if failed else 0


def name_of(dtype) -> str:
    """float32, float16, or q8_0 for the Q8_0 block record."""
    return "q8_0" if np.dtype(dtype).names else np.dtype(dtype).name


def quick(name: str) -> bool:
    """The --quick subset: every kernel and variant flag at least once, each weight dtype at least once."""
    if name.startswith("matvec"):
        return ("rows=1 " in name or "rows=8 " in name) and name.endswith(" C") and (
            "float32" in name or "gated=True" in name) and ("q8_0" not in name or "rows=8 " in name)
    if name.startswith("matmul"):
        return "f16" not in name
    if name.startswith(("decode_step", "batch_step")):
        return name in ("decode_step rows=1 interleaved=True float32", "decode_step rows=8 interleaved=False float16",
                        "decode_step rows=8 interleaved=True q8_0", "batch_step interleaved=True float32",
                        "batch_step interleaved=False q8_0", "decode_step rows=1 interleaved=True float32 step-by-step",
                        "batch_step interleaved=False q8_0 step-by-step")
    return "f16" not in name or name == "embed f16"


if __name__ == "__main__":
    sys.exit(main())
