"""What the matmul path checks in a converted directory before it trusts it (docs/npu.md,
"Verification at load").

`open_weights` opens `weights.npz` once and hashes it through that descriptor: the digest must be
the manifest's `weights_sha256`, and the caller loads the arrays from the same descriptor, so a
file renamed over the name after the check is never the one loaded. `check_array` refuses a
scale (`*.s`) that holds a NaN, an Inf or a zero, a bias (`*.b`) that is not finite, and a
rotation (`rotation`, `down_block`, and `rotation_block` over sqrt of its order: a +-1 Hadamard
block) that is not finite or not orthogonal; the
rotation's sign/scale vector (`rotation_scale`) must be finite and non-zero. Every refusal is a
ConfigError naming the file and what differs.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from edge_llm.errors import ConfigError
from edge_llm.files import open_regular
from edge_llm.weights import hash_into

ORTHO_TOL = 1e-3  # |R R^T - I| allowed: float32 rounding of an orthogonal matrix is ~1e-6
ORTHO_ROWS = 16  # rows of a large rotation whose products with every row are checked
REDO = "re-run `edge-llm convert npu-mm`"
ROTATIONS = ("rotation", "rotation_block", "down_block")


def open_weights(path: Path, claimed: str) -> tuple[BinaryIO, str]:
    """`path` opened for reading, positioned at 0, and its sha256; ConfigError when the file is
    missing, not a regular file, or its digest is not `claimed` (the manifest's)."""
    try:
        f = open_regular(path, ConfigError, buffering=0)
    except OSError as e:
        raise ConfigError(f"{path}: unreadable ({e}): {REDO}") from None
    try:
        h = hashlib.sha256()
        hash_into(h, f)
        digest = h.hexdigest()
        if digest != claimed:
            size = os.fstat(f.fileno()).st_size
            raise ConfigError(f"{path}: sha256 {digest[:16]}... ({size} bytes) is not the manifest.json's "
                              f"weights_sha256 {str(claimed)[:16]}...: the file was changed, truncated or "
                              f"replaced after the conversion wrote it; {REDO}")
        f.seek(0)
        return f, digest
    except BaseException:
        f.close()
        raise


def _bad_values(arr: np.ndarray, zero: bool) -> str | None:
    """What is wrong with arr's values: 'N NaN values (first at index i)', Inf, or zeros."""
    flat = arr.reshape(-1)
    for what, mask in (("NaN", np.isnan(flat)), ("Inf", np.isinf(flat))) + ((("zero", flat == 0),) if zero else ()):
        if (count := int(np.count_nonzero(mask))):
            return f"{count} {what} value{'s' if count > 1 else ''} (first at index {int(np.argmax(mask))})"
    return None


def _not_orthogonal(r: np.ndarray) -> float | None:
    """The largest |R R^T - I| found over every row's norm and ORTHO_ROWS rows' products with
    every row (all rows for a matrix that small), or None within ORTHO_TOL."""
    if r.ndim != 2 or r.shape[0] != r.shape[1]:
        return float("inf")
    n = r.shape[0]
    r64 = r.astype(np.float64)
    err = float(np.abs(np.einsum("ij,ij->i", r64, r64) - 1.0).max())
    rows = np.arange(n) if n <= ORTHO_ROWS else np.linspace(0, n - 1, ORTHO_ROWS).astype(int)
    prod = r64[rows] @ r64.T
    prod[np.arange(len(rows)), rows] -= 1.0
    err = max(err, float(np.abs(prod).max()))
    return err if err > ORTHO_TOL else None


def check_array(path: Path, key: str, arr: np.ndarray) -> None:
    """ConfigError when the array `key` of `path` cannot be trusted (the module docstring)."""
    kind = key.rsplit(".", 1)[-1]
    if kind == "s" or key == "rotation_scale":
        bad = _bad_values(arr, zero=True)
        what = "scale"
    elif kind == "b" or key in ROTATIONS:
        bad = _bad_values(arr, zero=False)
        what = "bias" if kind == "b" else "rotation"
        # rotation_block is the fast transform's +-1 Hadamard block (B B^T = m I): checked as B / sqrt(m)
        unit = arr / np.sqrt(arr.shape[0]) if key == "rotation_block" and arr.ndim == 2 else arr
        if bad is None and key in ROTATIONS and (err := _not_orthogonal(unit)) is not None:
            bad = f"not orthogonal (|R R^T - I| up to {err:.3g} > {ORTHO_TOL})"
    else:
        return
    if bad is not None:
        raise ConfigError(f"{path}: {what} {key!r} of shape {tuple(arr.shape)} has {bad}: {REDO}"
                          if not bad.startswith("not ") else f"{path}: {what} {key!r} is {bad}: {REDO}")
