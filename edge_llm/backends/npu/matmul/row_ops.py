"""The matmul path's per-row float32 ops between its int8 matmuls (docs/npu.md, "The matmul path
(w8a8 on librknnrt)": "The CPU side in C"), in two implementations of one interface, `RowOps`:

- `NumpyOps`: the readable reference, numpy's float32 operations (`cpu.backend.rms_norm`, `cpu.backend.swiglu`,
  `int8.quantize_rows` / `dequantize`, `fwht`, the dense rotation one row at a time);
- `COps`: the same formulas in C (`_row_ops.c`, compiled into the operator library beside the
  attention kernel, called through ctypes: the GIL is released), a few calls per layer instead of
  ~30 numpy calls, and the residual rotation as a fast transform from its factors.

Both keep rows apart (a row's bits depend on that row only, whatever the batch). They agree
within float32 rounding, not bitwise (the C sums of squares, the Hadamard block and the rotation
add in their own fixed order, and the C exp is not numpy's), so the backend's numerics name the
one it runs (`COps.tag`). `ops()` is the C one when the library is built, else the numpy one.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Protocol

import numpy as np

from edge_llm.backends import kernels
from edge_llm.backends.cpu.backend import rms_norm, swiglu
from edge_llm.backends.npu.matmul.int8 import dequantize, quantize_rows

# (block (m, m) of +-1, col_scale (n,)): R = (H_{n/m} ⊗ block) diag(col_scale), convert/hadamard.py
Factors = tuple[np.ndarray, np.ndarray]
Quantized = tuple[np.ndarray, np.ndarray]  # int8 rows (T, n), float32 row scales (T,)


class RowOps(Protocol):
    """What `MmBackend` runs on the CPU around its matmuls. x rows float32 (T, n); c int32 (T, N)
    products; rs (T,) the row scales the rows were quantized with; cs (N,) the weight's channel scales."""

    tag: str  # "" (numpy: the numerics as before) or what the backend's numerics append
    uses_factors: bool  # `rotate` applies the rotation's factors when given (the dense matrix is then not needed)

    def norm_quant(self, x: np.ndarray, eps: np.float32) -> Quantized:
        """RMSNorm with unit gain (the gains are folded into the weights), then quantize_rows."""

    def quant(self, x: np.ndarray) -> Quantized:
        """quantize_rows."""

    def dequant(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """((float32(c) * rs) * cs) (+ bias)."""

    def dequant_add(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, x: np.ndarray) -> np.ndarray:
        """x + dequant(c), a new array."""

    def dequant_add_norm_quant(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, x: np.ndarray,
                               eps: np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """h = x + dequant(c), and norm_quant(h): (h, q, scales)."""

    def swiglu_quant(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, inter: int,
                     block: np.ndarray | None) -> Quantized:
        """quantize_rows(fwht(swiglu(dequant(c)), block)) (no fwht for block None)."""

    def rotate(self, x: np.ndarray, dense: np.ndarray | None, factors: Factors | None) -> np.ndarray:
        """x @ R, R the residual rotation (dense (n, n); its factors if the converter wrote them;
        dense may be None when `uses_factors` and factors are given)."""


def fwht(x: np.ndarray, block: np.ndarray) -> np.ndarray:
    """x (T, m * 2^k) @ (block ⊗ H_{2^k}) / sqrt(2^k), `block` the normalized (m, m) factor (the
    1x1 identity for a power of two): Sylvester's butterflies over the last 2^k axis, then the
    small factor over the first. Per row, in float32 (the converter folds the transpose of the
    same dense matrix into W_down: `convert.hadamard.dense_hadamard`)."""
    T, n = x.shape
    m = block.shape[0]
    s = n // m
    y = x.reshape(T, m, s).copy()
    h = 1
    while h < s:
        v = y.reshape(T, m, s // (2 * h), 2, h)
        a, b = v[:, :, :, 0, :].copy(), v[:, :, :, 1, :]
        v[:, :, :, 0, :] += b
        np.subtract(a, b, out=v[:, :, :, 1, :])
        h *= 2
    y *= np.float32(1.0 / np.sqrt(s))
    if m > 1:
        y = np.matmul(block.T, y)  # (m, m) @ (T, m, s): one small gemm per row
    return y.reshape(T, n)


def rows_matmul(rows: np.ndarray, r: np.ndarray) -> np.ndarray:
    """rows @ r one row at a time: the same sgemv for every row, so a row's bits do not depend
    on how many rows came with it (a T-row sgemm may block differently from T = 1)."""
    out = np.empty((rows.shape[0], r.shape[1]), np.float32)
    for i in range(rows.shape[0]):
        np.matmul(rows[i], r, out=out[i])
    return out


class NumpyOps:
    """The reference: numpy float32 operations (the numerics the matmul path had before the C ops)."""

    tag = ""
    uses_factors = False

    def norm_quant(self, x: np.ndarray, eps: np.float32) -> Quantized:
        return quantize_rows(rms_norm(x, np.float32(1.0), eps))

    def quant(self, x: np.ndarray) -> Quantized:
        return quantize_rows(x)

    def dequant(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        y = dequantize(c, rs, cs)
        if bias is not None:
            y += bias
        return y

    def dequant_add(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, x: np.ndarray) -> np.ndarray:
        return x + dequantize(c, rs, cs)

    def dequant_add_norm_quant(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, x: np.ndarray,
                               eps: np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        h = self.dequant_add(c, rs, cs, x)
        return (h, *self.norm_quant(h, eps))

    def swiglu_quant(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, inter: int,
                     block: np.ndarray | None) -> Quantized:
        act = swiglu(dequantize(c, rs, cs), inter)
        return quantize_rows(act if block is None else fwht(act, block))

    def rotate(self, x: np.ndarray, dense: np.ndarray | None, factors: Factors | None) -> np.ndarray:
        assert dense is not None, "the numpy reference multiplies by the dense matrix"
        return rows_matmul(x, dense)


def _p(a: np.ndarray | None) -> ctypes.c_void_p | None:
    return None if a is None else ctypes.c_void_p(a.ctypes.data)


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _i32(c: np.ndarray) -> np.ndarray:
    if c.dtype != np.int32 or c.ndim != 2:
        raise ValueError(f"mm8 ops: need int32 (T, N) products, got {c.dtype} {c.shape}")
    return np.ascontiguousarray(c)


class COps:
    """`_row_ops.c` through ctypes (its bit rules are in the C file's header)."""

    tag = "ops-c1"  # the C ops' formulas and orders: a change of their bits changes this
    uses_factors = True

    def __init__(self, lib: ctypes.CDLL):
        P, I64, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.edge_mm8_norm_quant.argtypes = [P, I64, I64, F, P, P]
        lib.edge_mm8_quant.argtypes = [P, I64, I64, P, P]
        lib.edge_mm8_dequant.argtypes = [P, P, P, P, I64, I64, P]
        lib.edge_mm8_dequant_add.argtypes = [P, P, P, P, I64, I64, F, P, P, P]
        lib.edge_mm8_swiglu_quant.argtypes = [P, P, P, I64, I64, P, I64, P, P, P]
        lib.edge_mm8_rotate.argtypes = [P, I64, I64, P, I64, P, P, P]
        lib.edge_mm8_qk_rope.argtypes = [P, P, P, I64, I64, I64, I64, I64, P, P, F, P, P, F, P, P, P]
        for f in (lib.edge_mm8_norm_quant, lib.edge_mm8_quant, lib.edge_mm8_dequant, lib.edge_mm8_dequant_add,
                  lib.edge_mm8_swiglu_quant, lib.edge_mm8_rotate, lib.edge_mm8_qk_rope):
            f.restype = None
        self.lib = lib

    def norm_quant(self, x: np.ndarray, eps: np.float32) -> Quantized:
        x = _f32(x)
        T, n = x.shape
        q, s = np.empty((T, n), np.int8), np.empty(T, np.float32)
        self.lib.edge_mm8_norm_quant(_p(x), T, n, float(eps), _p(q), _p(s))
        return q, s

    def quant(self, x: np.ndarray) -> Quantized:
        x = _f32(x)
        T, n = x.shape
        q, s = np.empty((T, n), np.int8), np.empty(T, np.float32)
        self.lib.edge_mm8_quant(_p(x), T, n, _p(q), _p(s))
        return q, s

    def _check(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        if rs.shape != (c.shape[0],) or cs.shape != (n,):
            raise ValueError(f"mm8 ops: products {c.shape}, row scales {rs.shape}, channel scales {cs.shape}")
        return _f32(rs), _f32(cs)

    def dequant(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        c = _i32(c)
        T, n = c.shape
        rs, cs = self._check(c, rs, cs, n)
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"mm8 ops: bias {bias.shape} for {n} columns")
        b = None if bias is None else _f32(bias)
        y = np.empty((T, n), np.float32)
        self.lib.edge_mm8_dequant(_p(c), _p(rs), _p(cs), _p(b), T, n, _p(y))
        return y

    def _add(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, x: np.ndarray, eps: float,
             q: np.ndarray | None, s: np.ndarray | None) -> np.ndarray:
        c, x = _i32(c), _f32(x)
        T, n = c.shape
        rs, cs = self._check(c, rs, cs, n)
        if x.shape != (T, n):
            raise ValueError(f"mm8 ops: residual rows {x.shape} for products {c.shape}")
        h = np.empty((T, n), np.float32)
        self.lib.edge_mm8_dequant_add(_p(c), _p(rs), _p(cs), _p(x), T, n, eps, _p(h), _p(q), _p(s))
        return h

    def dequant_add(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, x: np.ndarray) -> np.ndarray:
        return self._add(c, rs, cs, x, 0.0, None, None)

    def dequant_add_norm_quant(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, x: np.ndarray,
                               eps: np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q, s = np.empty(c.shape, np.int8), np.empty(c.shape[0], np.float32)
        return self._add(c, rs, cs, x, float(eps), q, s), q, s

    def swiglu_quant(self, c: np.ndarray, rs: np.ndarray, cs: np.ndarray, inter: int,
                     block: np.ndarray | None) -> Quantized:
        c = _i32(c)
        T = c.shape[0]
        if c.shape[1] != 2 * inter:
            raise ValueError(f"mm8 ops: gate/up products {c.shape} for intermediate size {inter}")
        rs, cs = self._check(c, rs, cs, 2 * inter)
        m = 1 if block is None else block.shape[0]
        if block is not None and (block.shape != (m, m) or inter % m or (inter // m) & (inter // m - 1)):
            raise ValueError(f"mm8 ops: Hadamard block {block.shape} does not split {inter} into m x 2^k")
        b = None if block is None else _f32(block)
        q, s = np.empty((T, inter), np.int8), np.empty(T, np.float32)
        work = np.empty(2 * inter, np.float32)
        self.lib.edge_mm8_swiglu_quant(_p(c), _p(rs), _p(cs), T, inter, _p(b), m, _p(q), _p(s), _p(work))
        return q, s

    def rotate(self, x: np.ndarray, dense: np.ndarray | None, factors: Factors | None) -> np.ndarray:
        if factors is None:  # a conversion without them (older, or a QR rotation): the dense product
            return rows_matmul(x, dense)
        block, scale = factors
        x = _f32(x)
        T, n = x.shape
        m = block.shape[0]
        if block.shape != (m, m) or scale.shape != (n,) or n % m or (n // m) & (n // m - 1):
            raise ValueError(f"mm8 ops: rotation block {block.shape} and scales {scale.shape} for rows of {n}")
        y, work = np.empty((T, n), np.float32), np.empty(n, np.float32)
        self.lib.edge_mm8_rotate(_p(x), T, n, _p(_f32(block)), m, _p(_f32(scale)), _p(y), _p(work))
        return y

    def qk_rope(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: int, kv_heads: int,
                gains: tuple[np.ndarray, np.ndarray] | None, eps: np.float32, cos: np.ndarray, sin: np.ndarray,
                scale: np.float32, q_out: np.ndarray, k_out: np.ndarray, v_out: np.ndarray) -> None:
        """The row step's q/k/v after `MmBackend.qkv` (q, k, v: its column views of one (T, ld)
        product): per-head RMSNorm of q and k with `gains` (None: no q/k norms), RoPE by the half
        tables cos/sin (T, D/2), q times `scale`, into q_out (T, H D) and k_out, v_out (T, n_kv D),
        C-contiguous float32. The model's float32 steps, its sums of squares in the C file's order."""
        T, qd = q.shape
        D = qd // heads
        for a in (q, k, v):  # row stride of the one product they view (MmBackend.qkv's columns)
            if a.dtype != np.float32 or a.ndim != 2 or a.strides != q.strides or a.strides[1] != 4:
                raise ValueError("mm8 ops: q, k, v must be float32 column views of one C-contiguous product")
        want = {"k": (T, kv_heads * D), "v": (T, kv_heads * D), "cos": (T, D // 2), "sin": (T, D // 2),
                "q_out": (T, heads * D), "k_out": (T, kv_heads * D), "v_out": (T, kv_heads * D)}
        got = {"k": k, "v": v, "cos": cos, "sin": sin, "q_out": q_out, "k_out": k_out, "v_out": v_out}
        bad = [f"{n} {got[n].shape}" for n in want if got[n].shape != want[n]]
        if qd != heads * D or bad or (gains is not None and any(g.shape != (D,) for g in gains)):
            raise ValueError(f"mm8 ops: q {q.shape} for {heads} heads of {D}: {', '.join(bad) or 'gains'}")
        if not all(o.flags.c_contiguous and o.dtype == np.float32 for o in (q_out, k_out, v_out)):
            raise ValueError("mm8 ops: q/k/v outputs must be C-contiguous float32")
        qg, kg = (None, None) if gains is None else (_f32(gains[0]), _f32(gains[1]))
        c, s = _f32(cos), _f32(sin)
        self.lib.edge_mm8_qk_rope(_p(q), _p(k), _p(v), q.strides[0] // 4, T, heads, kv_heads, D, _p(qg), _p(kg),
                                  float(eps), _p(c), _p(s), float(scale), _p(q_out), _p(k_out), _p(v_out))


def ops() -> RowOps:
    """The C ops when the operator library is built, else the numpy reference."""
    return c_ops() or NumpyOps()


@lru_cache(maxsize=1)
def c_ops() -> COps | None:
    """The C ops, or None when the operator library is not built."""
    lib = kernels.library()
    return None if lib is None else COps(lib)
