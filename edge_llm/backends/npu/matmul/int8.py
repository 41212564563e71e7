"""int8 x int8 -> int32 matmuls: the engine seam of the w8a8 matmul path, its host emulation, and
the quantization around it (docs/npu.md, "The matmul path (w8a8 on librknnrt)").

An `Int8Matmul` holds int8 weights B (K, N) registered by name and multiplies int8 activation rows
A (M, K) by them into int32 C (M, N). On the board the engine is librknnrt's matmul API
(`engine.NpuInt8Matmul`); here it is `HostInt8Matmul`, the reference. Both compute exact integer
arithmetic, so a host run gives the bits a board gives and accuracy is measured here.

The scaling around the engine is on the CPU, the same numpy code for every engine:
`quantize_rows` (one scale per activation row, at run time), `quantize_weight` (one scale per
output channel, at conversion) and `dequantize` (int32 -> float32 with both scales).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from edge_llm.errors import ConfigError

QMAX = 127  # symmetric int8: -128 is never produced, so |a * b| <= 127 * 127
ALIGN = 32  # K and N must be multiples of it (int8 B in librknnrt's native layout)
MAX_K = 10240  # librknnrt's matmul limit on K
# float32 sums of products of int8 values are exact integers while they stay below 2**24:
# 128 * 128 * 1024 = 2**24, so a block of K <= 1024 is exact in any summation order (docs/npu.md)
EXACT_K_BLOCK = 1024


class SelfTestAnswers(Protocol):
    """What an engine's start-up self-test reports (selftest.SelfTestReport; docs/npu.md, "The start-up self-test")."""

    def to_dict(self) -> dict: ...


class Int8Matmul(Protocol):
    """C (M, N) int32 = A (M, K) int8 @ B (K, N) int8, exact integer arithmetic (docs/npu.md, "The matmul path")."""

    numerics: str  # goes into the backend's numerics (e.g. "host-f32", "librknnrt-<version>-cores3")
    selftest: SelfTestAnswers | None  # the start-up self-test it was opened after (NPU engines; docs/npu.md)

    def add(self, name: str, w: np.ndarray) -> None:
        """Register weight `name`: int8 (K, N), C-contiguous, K % 32 == 0, N % 32 == 0, K <= 10240. Once, at load."""

    def run(self, name: str, a: np.ndarray) -> np.ndarray:
        """int8 (M, K), any M >= 1 -> int32 (M, N). Rows never mix (row i of C depends only on row i of A). The result
        may be a buffer the next run() of the same name overwrites: copy or consume it first."""

    def close(self) -> None:
        """Release what the engine holds (NPU contexts and buffers). Nothing is called after it."""


def check_weight(name: str, w: np.ndarray, known: set[str] | dict[str, object]) -> None:
    """The refusals every engine makes at `add` (one place, so host and NPU refuse alike)."""
    if name in known:
        raise ConfigError(f"int8 matmul weight {name!r} registered twice")
    if w.dtype != np.int8 or w.ndim != 2 or not w.flags.c_contiguous:
        raise ConfigError(f"int8 matmul weight {name!r}: need a C-contiguous int8 (K, N) array, got "
                          f"{w.dtype} {w.shape}")
    K, N = w.shape
    if K % ALIGN or N % ALIGN or not 0 < K <= MAX_K:
        raise ConfigError(f"int8 matmul weight {name!r}: K={K}, N={N}; need K and N multiples of {ALIGN}, "
                          f"K <= {MAX_K}")


def check_rows(name: str, a: np.ndarray, k: int) -> None:
    if a.dtype != np.int8 or a.ndim != 2 or a.shape[0] < 1 or a.shape[1] != k:
        raise ValueError(f"int8 matmul {name!r}: need int8 (M >= 1, {k}) rows, got {a.dtype} {a.shape}")


class HostInt8Matmul:
    """The host emulation, the reference engine: exact int8 x int8 -> int32 on the CPU's BLAS.

    The weights are held as float32 in blocks of at most `EXACT_K_BLOCK` rows of K: every partial
    sum inside a block is an integer of magnitude < 2**24, exact in float32 whatever order or
    kernel (FMA or not, any thread split) the BLAS uses, so the block products are exact integers
    and their int32 sum is the integer product. The bits depend on nothing but A and B (4 bytes of
    RAM per weight: the 135M default model's decoder and head take about 0.5 GB)."""

    numerics = "host-exact"
    selftest = None  # the reference has no start-up self-test

    def __init__(self) -> None:
        self.blocks: dict[str, list[np.ndarray]] = {}
        self.k: dict[str, int] = {}

    def add(self, name: str, w: np.ndarray) -> None:
        check_weight(name, w, self.blocks)
        K = w.shape[0]
        self.blocks[name] = [w[i:i + EXACT_K_BLOCK].astype(np.float32) for i in range(0, K, EXACT_K_BLOCK)]
        self.k[name] = K

    def run(self, name: str, a: np.ndarray) -> np.ndarray:
        blocks = self.blocks.get(name)
        if blocks is None:
            raise KeyError(f"int8 matmul weight {name!r} was never added")
        check_rows(name, a, self.k[name])
        af = a.astype(np.float32)
        out: np.ndarray | None = None
        for i, b in enumerate(blocks):
            part = (af[:, i * EXACT_K_BLOCK:(i + 1) * EXACT_K_BLOCK] @ b).astype(np.int32)
            out = part if out is None else np.add(out, part, out=out)
        assert out is not None
        return out

    def close(self) -> None:
        self.blocks.clear()


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 (M, K) -> (q int8 (M, K), scale float32 (M,)): per row, scale = absmax / 127 and
    q = rint(x / scale) (round half to even) in [-127, 127]; a zero row gets scale 1 and q 0.
    Elementwise float32 ops only: a row's bits depend on that row alone."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(x), axis=1)
    scale = amax / np.float32(QMAX)
    scale[amax == 0] = np.float32(1.0)
    q = np.rint(x / scale[:, None])
    np.clip(q, -QMAX, QMAX, out=q)
    return q.astype(np.int8), scale


def quantize_weight(w: np.ndarray, clip: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float32 (K, N) -> (q int8 (K, N), scale float32 (N,)), symmetric per output channel:
    scale = absmax of the column (times `clip` in (0, 1] per column, if given) / 127, q = rint(w /
    scale) clipped to [-127, 127]; an all-zero column gets scale 1."""
    w = np.asarray(w, dtype=np.float32)
    amax = np.max(np.abs(w), axis=0)
    if clip is not None:
        amax = amax * np.asarray(clip, dtype=np.float32)
    scale = (amax / np.float32(QMAX)).astype(np.float32)
    scale[amax == 0] = np.float32(1.0)
    q = np.rint(w / scale[None, :])
    np.clip(q, -QMAX, QMAX, out=q)
    return np.ascontiguousarray(q.astype(np.int8)), scale


def dequantize(c: np.ndarray, row_scale: np.ndarray, col_scale: np.ndarray) -> np.ndarray:
    """int32 (M, N) -> float32 (M, N) = (float32(c) * row_scale[:, None]) * col_scale[None, :], in
    that order, each step one float32 rounding (int32 -> float32 rounds to nearest above 2**24).
    Elementwise only, so each element's bits depend on its row's scale, its column's and c."""
    y = c.astype(np.float32)
    y *= row_scale[:, None]
    y *= col_scale[None, :]
    return y
