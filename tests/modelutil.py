"""Shared model drivers and checks for the backend comparison tests."""

from __future__ import annotations

import numpy as np


def greedy_run(model, prompt, steps: int, max_seq: int, chunk: int | None = None) -> tuple[list[int], np.ndarray]:
    """Prefill `prompt`, then `steps` greedy tokens: (tokens, the logits row before each token)."""
    cache = model.new_cache(max_seq, check_memory=False)
    logits = model.prefill(prompt, cache) if chunk is None else model.prefill(prompt, cache, chunk=chunk)
    out, rows = [], []
    for _ in range(steps):
        rows.append(logits)
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]], cache)
    return out, np.stack(rows)


def f32_bits(a: np.ndarray) -> np.ndarray:
    """The float32 bit patterns of `a`, for bitwise comparisons (-0.0 != 0.0, NaN == same NaN)."""
    return np.ascontiguousarray(a, np.float32).view(np.uint32)
