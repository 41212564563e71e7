"""GPTQ's error compensation for any weight grid, numpy only (docs/quantization.md, "GPTQ").

GPTQ (Frantar et al. 2022) quantizes one input row k of W (K, N) at a time and moves its rounding
error onto the rows not yet quantized, weighted by the inverse Hessian H = X^T X of the layer's
real inputs X, so the layer's output on inputs like X changes least. What "rounding" means is the
`Grid`'s: the matmul path's per-channel int8 (`convert/gptq.py`), or cpu-q's 4-bit blocks of 32
along K with a scale and zero point per block (`cpuq/nbits.py`), whose parameters are fixed from
the block's updated rows when GPTQ reaches the block's first row (the paper's grouped variant).
Written here because the maintained implementations (AutoGPTQ, GPTQModel, llm-compressor) need
torch and quantize whole checkpoints into their own formats; cpu-q and `convert npu-mm` run with
numpy alone (on the board too). Used by the builds, which sit in different layers, so it lives
below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

LAZY = 128  # rows of W updated together before the rest gets one matrix product (the paper's lazy batch)
DAMP = 0.01  # of the mean Hessian diagonal, added to it (the paper's default)


class Grid(Protocol):
    """Where the rows of one weight land. `group`: rows sharing parameters (0: none); the solver
    calls `begin(k, rows)` with the rows [k, k + group) as updated so far, before row k is rounded."""

    group: int

    def begin(self, k: int, rows: np.ndarray) -> None: ...

    def round(self, k: int, row: np.ndarray) -> np.ndarray:
        """Row k (N,) float32 -> its value on the grid (N,) float32; the grid keeps the codes."""
        ...


def hessian(x: np.ndarray) -> np.ndarray:
    """H = X^T X in float64 of the input rows X (T, K)."""
    x64 = x.astype(np.float64)
    return x64.T @ x64


@dataclass(frozen=True)
class Factor:
    """What `solve` needs of one Hessian, computed once for every column chunk of its weight."""

    u: np.ndarray  # (K, K) float32, the upper Cholesky factor of the damped H^-1 (in `order`)
    order: np.ndarray  # (K,) the rows in the order they are quantized
    dead: np.ndarray  # (K,) bool, input channels that are always 0 (their weights do not matter)


def factor(h: np.ndarray, act_order: bool = False, damp: float = DAMP) -> Factor:
    """`h`: the Hessian (K, K) of the layer's inputs (`hessian`), damped here (a copy) by `damp`
    times its mean diagonal.
    `act_order`: the rows with the largest inputs first, while the most rows are left to absorb
    their error (only for grids without groups)."""
    K = h.shape[0]
    H = np.array(h, np.float64)
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    H[np.diag_indices(K)] += damp * float(np.mean(np.diag(H)))
    order = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(K)
    if act_order:
        H = H[np.ix_(order, order)]
    # the upper Cholesky factor U of H^-1 (H^-1 = U^T U): row i holds the update coefficients
    return Factor(np.linalg.cholesky(np.linalg.inv(H)).T.astype(np.float32), order, dead)


def solve(w: np.ndarray, f: Factor, grid: Grid) -> None:
    """Quantize W (K, N) onto `grid`, rows in `f.order`, each row's error moved onto the rest."""
    K = w.shape[0]
    in_order = bool(np.array_equal(f.order, np.arange(K)))
    if grid.group and (not in_order or LAZY % grid.group or K % grid.group):
        raise ValueError(f"a grouped grid needs rows in order and groups dividing {LAZY} and K = {K}")
    W = np.array(w, np.float32)  # float32 updates (half the memory traffic of float64); H and its inverse in float64
    W[f.dead, :] = 0.0
    if not in_order:
        W = W[f.order]
    U = f.u
    for a in range(0, K, LAZY):
        b = min(a + LAZY, K)
        W1, U1, E = W[a:b], U[a:b, a:b], np.empty((b - a, W.shape[1]), np.float32)
        for i in range(b - a):
            if grid.group and (a + i) % grid.group == 0:
                grid.begin(a + i, W1[i:i + grid.group])
            E[i] = (W1[i] - grid.round(int(f.order[a + i]), W1[i])) / U1[i, i]
            W1[i + 1:] -= np.outer(U1[i, i + 1:], E[i])
        W[b:] -= U[a:b, b:].T @ E
