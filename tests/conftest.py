"""Shared fixtures: where the reference weights are, and Hypothesis profiles.

Reference weights come from $NPLLM_WEIGHTS, else the repo's weights/ folder (CI copies ../shared/weights there);
stories260K's checkpoint and tokenizers, which ship inside the package (npllm/data), are taken from there when the
folder lacks them. Tests that need another file skip, saying which, when it is absent; under CI (CI=true) they fail
instead, so a run without the reference weights cannot pass.
"""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests_support import require, weights_root, weights_with_embedded

settings.register_profile("ci", derandomize=True, max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# "ci" (derandomised, 200 examples a law) by default; HYPOTHESIS_PROFILE=dev for a longer local search.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
