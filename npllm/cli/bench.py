"""npllm bench: prefill and decode throughput against the memory bandwidth (npllm.bench)."""

from __future__ import annotations


def run_bench(args) -> int:
    from .. import bench

    return bench.run(args)
