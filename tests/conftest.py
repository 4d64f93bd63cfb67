"""Shared fixtures: where the reference weights are, and Hypothesis profiles.

Reference weights come from $NPLLM_WEIGHTS, else the repo's weights/ folder (CI copies ../shared/weights there).
Tests that need a file skip, saying which, when it is absent.
"""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent

settings.register_profile("ci", derandomize=True, max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# "ci" (derandomised, 200 examples a law) by default; HYPOTHESIS_PROFILE=dev for a longer local search.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def weights_root() -> Path:
    return Path(os.environ["NPLLM_WEIGHTS"]) if os.environ.get("NPLLM_WEIGHTS") else REPO / "weights"


def require(relative: str) -> Path:
    path = weights_root() / relative
    if not path.exists():
        pytest.skip(f"reference file {path} is absent (set NPLLM_WEIGHTS or fill weights/)")
    return path


@pytest.fixture(scope="session")
def weights_dir() -> Path:
    return weights_root()


@pytest.fixture(scope="session")
def stories260k() -> Path:
    return require("stories260K/stories260K.bin")


@pytest.fixture(scope="session")
def golden_200() -> str:
    return require("stories260K/greedy_200.txt").read_text(encoding="utf-8")
