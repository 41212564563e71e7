"""Token sampling: greedy, temperature, top-k, top-p, reproducible with a seed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 => greedy
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1 => off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """Picks the next token from a logits vector. One instance per request (owns the RNG)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        x = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < x.size:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x = np.where(x < kth, -np.inf, x)
        x -= x.max()
        probs = np.exp(x)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = order[: int(np.searchsorted(cum, p.top_p) + 1)]
            mask = np.zeros_like(probs, dtype=bool)
            mask[keep] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))
