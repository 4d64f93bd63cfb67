"""Shared fixtures: where the reference weights are, and Hypothesis profiles.

Reference weights come from $NPLLM_WEIGHTS, else the repo's weights/ folder (CI copies ../shared/weights there);
stories260K's checkpoint and tokenizers, which ship inside the package (npllm/data), are taken from there when the
folder lacks them. Tests that need another file skip, saying which, when it is absent; under CI (CI=true) they fail
instead, so a run without the reference weights cannot pass.
"""

import os
from pathlib import Path

# Each pytest-xdist worker compiles into a Numba cache of its own (set before anything imports Numba, which reads it
# once). Numba's cache index has no lock between processes: two workers saving new entries of one index at once can
# each give its entry the same data file, and the one that writes last leaves the other's key pointing at its code
# (seen: a quantized model computing with another type's kernels, then aborts). One model class compiles every
# block type's kernels, so the workers now write the same indexes at the same time at the start of a run. The
# npllm children a test starts inherit their worker's cache; tests of the cache itself set their own.
if os.environ.get("PYTEST_XDIST_WORKER") and "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = str(Path(__file__).resolve().parent.parent / ".numba-cache"
                                        / os.environ["PYTEST_XDIST_WORKER"])

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings

from tests_support import require, weights_root, weights_with_embedded

settings.register_profile("ci", derandomize=True, max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# "ci" (derandomised, 200 examples a law) by default; HYPOTHESIS_PROFILE=dev for a longer local search.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# The CLI runs the tests start wait for the numba backend's compile where it is not cached, as they always did: a
# run that answered with the NumPy reference would leave a detached compile behind it (tests/test_cold_start.py
# tests that path, with this unset, on caches of its own).
os.environ.setdefault("NPLLM_WAIT_COMPILE", "1")


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml): one worker per CPU this process may run on, at most 4 (past that, the workers wait
    on each other's Numba compiles more than they run tests)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@pytest.fixture(scope="session")
def weights_dir(tmp_path_factory) -> Path:
    """The reference weights folder, completed by the files the package embeds (stories260K) where it lacks them."""
    return weights_with_embedded(weights_root(), tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="session")
def stories260k() -> Path:
    return require("stories260K/stories260K.bin")


@pytest.fixture(scope="session")
def golden_200() -> str:
    return require("stories260K/greedy_200.txt").read_text(encoding="utf-8")
