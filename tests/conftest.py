"""Shared pytest fixtures."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def weights_dir() -> Path:
    """The reference weights folder: $NPLLM_WEIGHTS, else the repository's weights/; skips when it is absent."""
    root = Path(os.environ.get("NPLLM_WEIGHTS") or Path(__file__).resolve().parents[1] / "weights")
    if not root.is_dir():
        pytest.skip(f"reference weights not found at {root} (set NPLLM_WEIGHTS)")
    return root
