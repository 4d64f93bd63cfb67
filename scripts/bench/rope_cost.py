"""What a long-context RoPE variant costs per decode step: a fixture with it beside the same weights without it.

    python scripts/bench/rope_cost.py [--fixtures qwen2_yarn phi3_partial] [--runs 30] [--backend numba]

For each fixture of tests/fixtures/hf a copy is written (in a temporary folder) whose config.json has plain RoPE
(rope_parameters of rope_type "default" with the same base, no partial_rotary_factor); both are loaded on the backend
with one thread, prefilled with 32 tokens, then decoded one token a step for 90 steps, `--runs` times. It prints the
fastest and the median run's time per step. The variants change only the RoPE frequency table, which is built
once per context (Model.rope_frequencies), so the two should match within the machine's noise. Tiny models: the
step is mostly per-call overhead, which is what would show a cost added per token.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import npllm

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "hf"


def plain_copy(fixture: Path, folder: Path) -> Path:
    """The fixture with plain RoPE: same weights, rope_parameters default with its base, whole-head rotation."""
    out = folder / (fixture.name + "_plain")
    shutil.copytree(fixture, out)
    config = json.loads((out / "config.json").read_text())
    theta = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta", 10000.0))
    config.pop("rope_scaling", None)
    config.pop("partial_rotary_factor", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    (out / "config.json").write_text(json.dumps(config))
    return out


def step_times(path: Path, backend: str, runs: int) -> list[float]:
    """Seconds per decode step of each run (32-token prefill, then 90 steps)."""
    model = npllm.load(path, backend=backend, threads=1).model
    tokens = np.arange(2, 124) % 300
    times = []
    for _ in range(runs):
        cache = model.new_cache()
        model.forward(tokens[:32], np.arange(32), cache)
        start = time.perf_counter()
        for p in range(32, 122):
            model.forward(tokens[p:p + 1], [p], cache)
        times.append((time.perf_counter() - start) / 90)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", nargs="+", default=["qwen2_yarn", "phi3_partial"])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--backend", default="numba")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.fixtures:
            for path in (FIXTURES / name, plain_copy(FIXTURES / name, Path(scratch))):
                t = step_times(path, args.backend, args.runs)
                print(f"{path.name:22s} decode step: fastest {min(t) * 1e6:.1f} us, median "
                      f"{statistics.median(t) * 1e6:.1f} us ({args.runs} runs of 90 steps, {args.backend}, 1 thread)")


if __name__ == "__main__":
    main()
