"""Hadamard matrices and the randomized Hadamard rotation, numpy only (docs/npu.md: w8a8 graphs'
residual rotation, and the matmul path's residual and online down_proj rotations)."""

from __future__ import annotations

import numpy as np

ROTATIONS = ("none", "hadamard")
ROTATION_SEED = 20260  # the random signs of the Hadamard rotation (part of cpu_side.npz, so of the identity)


def hadamard(n: int) -> np.ndarray | None:
    """A Hadamard matrix of order n (entries +-1, H H^T = n I) as Sylvester's 2^k times a Paley
    block of order m = q + 1 (q prime, q = 3 mod 4), or None if n has no such form."""
    factors = hadamard_factors(n)
    if factors is None:
        return None
    h, k = factors
    for _ in range(k):
        h = np.block([[h, h], [h, -h]])
    assert np.array_equal(h @ h.T, n * np.eye(n)), n
    return h


def hadamard_factors(n: int) -> tuple[np.ndarray, int] | None:
    """`hadamard(n)` = H_{2^k} ⊗ block (Sylvester's order outer): (block (m, m) of +-1, k), the
    smallest k that has a construction; None if none."""
    for k in range(n.bit_length()):
        m, rest = n >> k, n - ((n >> k) << k)
        if rest or m < 1:
            continue
        if m == 1:
            block = np.ones((1, 1))
        else:
            q = m - 1
            if q < 3 or q % 4 != 3 or any(q % d == 0 for d in range(2, int(q ** 0.5) + 1)):
                continue
            chi = np.full(q, -1.0)
            chi[[(i * i) % q for i in range(1, q)]] = 1.0
            chi[0] = 0.0
            jac = chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]  # Jacobsthal matrix
            block = np.eye(m)
            block[0, 1:], block[1:, 0], block[1:, 1:] = 1.0, -1.0, block[1:, 1:] + jac
        return block, k
    return None


def orthogonal(n: int, seed: int = ROTATION_SEED) -> np.ndarray:
    """The residual stream's rotation: a Hadamard matrix with random column signs, divided by
    sqrt(n) (QuaRot's randomized Hadamard: one massive channel becomes n entries of equal size);
    for an n without a Hadamard construction here, a random orthogonal matrix (QR)."""
    rng = np.random.default_rng(seed)
    h = hadamard(n)
    if h is None:
        q, r = np.linalg.qr(rng.standard_normal((n, n)))
        return (q * np.sign(np.diag(r))).astype(np.float32)
    return (h * rng.choice([-1.0, 1.0], n)[None, :] / np.sqrt(n)).astype(np.float32)


def orthogonal_factors(n: int, seed: int = ROTATION_SEED) -> tuple[np.ndarray, np.ndarray] | None:
    """`orthogonal(n)` = (H_{2^k} ⊗ block) diag(col_scale) as (block (m, m) of +-1, col_scale (n,) =
    its random signs / sqrt(n)), both float32: the fast transform's factors (`_row_ops.c`,
    `edge_mm8_rotate`); None where `orthogonal` is not a Hadamard matrix."""
    factors = hadamard_factors(n)
    if factors is None:
        return None
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], n)  # orthogonal's draw
    return factors[0].astype(np.float32), (signs / np.sqrt(n)).astype(np.float32)


def dense_hadamard(block: np.ndarray, n: int) -> np.ndarray:
    """The (n, n) matrix `backends.row_ops.fwht` multiplies by: `block` (normalized, (m, m)) ⊗
    Sylvester's H_{n/m} / sqrt(n/m), in float64 for the converter (it folds the transpose into W_down)."""
    s = n // block.shape[0]
    syl = np.ones((1, 1))
    while syl.shape[0] < s:  # Sylvester's order, as fwht's butterflies: not hadamard(s), which may pick Paley
        syl = np.block([[syl, syl], [syl, -syl]])
    return np.kron(block.astype(np.float64), syl / np.sqrt(s))
