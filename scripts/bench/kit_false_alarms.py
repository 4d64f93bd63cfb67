"""Measure npllm.testing on correct implementations: false alarms over repeated random searches, and CPU time.

    python scripts/bench/kit_false_alarms.py [runs]      # default 20 runs of every correct implementation

The correct implementations are the independent NumPy ones of tests/test_testing_kit.py. Each run is a fresh
random Hypothesis search (derandomize=False, a new seed) with check_filter's default number of examples; a run
that raises is a false alarm. Prints, per implementation, the alarms and the mean and max CPU seconds of one
check_filter call; then check_sampler on two correct samplers.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from test_testing_kit import CORRECT, name_of, sample_choice, sample_ok  # noqa: E402

from npllm.testing import LawFailure, check_filter, check_sampler  # noqa: E402


def main(runs: int) -> None:
    total_alarms = 0
    for case in CORRECT:
        kind, fn, ties = case
        alarms, seconds = [], []
        for run in range(runs):
            start = time.process_time()
            try:
                check_filter(fn, kind, ties=ties, derandomize=False, seed=1000 + run)
            except LawFailure as failure:
                alarms.append(f"run {run}: {str(failure).splitlines()[0]}")
            seconds.append(time.process_time() - start)
        total_alarms += len(alarms)
        print(f"{name_of(case):55s} alarms {len(alarms)}/{runs}  cpu mean {sum(seconds) / runs:.2f} s  "
              f"max {max(seconds):.2f} s", flush=True)
        for line in alarms:
            print("   ", line)
    for sampler in (sample_ok, sample_choice):
        start = time.process_time()
        check_sampler(sampler)
        print(f"check_sampler({sampler.__name__}): pass, cpu {time.process_time() - start:.2f} s")
    print(f"false alarms in total: {total_alarms}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
