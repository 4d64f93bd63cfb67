"""Placeholder sampling (greedy, temperature, top-p) until the full sampling module lands."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import GenerationError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")


def sample_with(params: SamplingParams, logits: np.ndarray, rng: np.random.Generator, token_ids=()) -> int:
    if params.temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.searchsorted(np.cumsum(p[order]), params.top_p) + 1
    kept = order[:keep]
    return int(kept[rng.choice(len(kept), p=p[kept] / p[kept].sum())])
