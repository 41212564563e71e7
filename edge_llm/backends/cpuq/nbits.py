"""Weight-only blocked quantization in the layout of onnxruntime's `MatMulNBits`, and the GGUF
blocks that layout holds exactly.

`MatMulNBits` (com.microsoft) computes Y = A @ W with W (K, N) stored per output column n in
blocks of `block` consecutive k: `W[k, n] = scale[n, b] * (q[n, k] - zp[n, b])`, q and zp
unsigned `bits`-bit integers. A `QuantWeight` adds one optional term, `mins[b, n]`, a float added
to every weight of block b (GGUF Q4_1 stores `d * q + m`: a float minimum that an integer zero
point cannot hold); the graph adds it as `blocksum(A) @ mins`, exactly that sum over the block.

Quantization from float (`quantize`) is per block asymmetric min/max with the range widened to
include 0, round half to even, as onnxruntime's own quantizer does (written here in numpy
because the same layout also receives GGUF blocks, and onnxruntime's public quantizer rewrites
whole ONNX files instead of producing arrays); `clip` shrinks each block's range by the MSE clip,
and `quantize_gptq` rounds the same blocks by GPTQ (backends/gptq.py) on the rows the weight reads
(docs/quantization.md, "GPTQ for re-quantized weights"). GGUF blocks (`from_gguf`) are copied bit
for bit:

| GGUF | here | exact |
|---|---|---|
| Q4_0: d * (q - 8) | 4-bit, scale d, zp 8 | yes |
| Q4_1: d * q + m | 4-bit, scale d, zp 0, mins m | yes |
| Q5_0: d * (q - 16), 5-bit q | 8-bit, scale d, zp 16 | yes |
| Q5_1: d * q + m, 5-bit q | 8-bit, scale d, zp 0, mins m | yes |
| Q8_0: d * q (signed) | 8-bit, scale d, q + 128, zp 128 | yes |
| Q4_K: per 32-sub-block (d sc) * q - (dmin m) | 4-bit, scale d sc, zp 0, mins -dmin m | yes |
| Q5_K: the same with 5-bit q | 8-bit, the same | yes |
| anything else (Q6_K, Q2_K/Q3_K, F16, BF16, F32) | quantized from the F32 values | no |

`dequantize` computes the weights in the same float order as gguf-py's dequantizer, so a
GGUF-imported model's F32 tensor compares bitwise with the blocks it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from edge_llm.backends.gptq import factor, solve

GGUF_EXACT = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K")
DEFAULT_ZP = {4: 8, 8: 128}  # MatMulNBits' zero point when the input is absent
_CHUNK_COLS = 4096  # columns quantized at a time (the 2B lm_head is 151936 columns)


@dataclass
class QuantWeight:
    """W (K, N) as blocks along K; see the module docstring for the formula."""

    bits: int
    block: int
    K: int
    N: int
    q: np.ndarray  # (N, n_blocks, block) uint8 levels in [0, 2**bits)
    scales: np.ndarray  # (N, n_blocks) float32
    zp: np.ndarray  # (N, n_blocks) uint8
    mins: np.ndarray | None  # (n_blocks, N) float32 additive term, or None
    origin: str  # "Q4_1" etc. for GGUF blocks, "F32"/"BF16"/... when quantized here
    exact: bool  # True when the blocks hold the source weights bit for bit

    @property
    def n_blocks(self) -> int:
        return self.q.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the packed form (what a matmul streams per token)."""
        n = self.N * self.n_blocks
        zp = 0 if self.default_zp else n * self.bits // 8
        return self.q.size * self.bits // 8 + n * 4 + zp + (0 if self.mins is None else self.mins.nbytes)

    @property
    def default_zp(self) -> bool:
        return bool(np.all(self.zp == DEFAULT_ZP[self.bits]))

    def packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(B (N, n_blocks, block*bits/8) uint8, scales (N*n_blocks,) f32, packed zp or None)."""
        if self.bits == 8:
            return self.q, self.scales.reshape(-1), None if self.default_zp else self.zp.reshape(-1)
        b = (self.q[..., 0::2] | (self.q[..., 1::2] << 4)).astype(np.uint8)
        zp = None
        if not self.default_zp:
            z = self.zp if self.n_blocks % 2 == 0 else np.pad(self.zp, ((0, 0), (0, 1)))
            zp = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
        return b, self.scales.reshape(-1), zp


# the MSE clip's candidate ranges: each block's min/max range (0 included) times one of these
CLIP_RATIOS = np.round(np.arange(1.0, 0.6999, -0.02), 2).astype(np.float32)


def _grid(lo: np.ndarray, hi: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """scale, zero point (as float32) of the range [lo, hi] (0 included) over `levels` steps."""
    s = (hi - lo) / np.float32(levels)
    s[s == 0] = 1
    return s, np.clip(np.rint(-lo / s), 0, levels)


def block_params(wt: np.ndarray, levels: int, clip: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """wt (..., block) -> scale, zero point (...) of each block: its min/max range widened to
    include 0; `clip`: that range times the ratio of CLIP_RATIOS with the least squared error of
    the block's weights (ties: the wider range)."""
    lo, hi = np.minimum(wt.min(axis=-1), 0), np.maximum(wt.max(axis=-1), 0)
    s, z = _grid(lo, hi, levels)
    if not clip:
        return s, z
    best = np.full(s.shape, np.inf, np.float32)
    for r in CLIP_RATIOS:
        sr, zr = _grid(lo * r, hi * r, levels)
        q = np.clip(np.rint(wt / sr[..., None]) + zr[..., None], 0, levels)
        err = np.square((q - zr[..., None]) * sr[..., None] - wt).sum(axis=-1)
        better = err < best
        best[better], s[better], z[better] = err[better], sr[better], zr[better]
    return s, z


def quantize(w: np.ndarray, bits: int, block: int, origin: str = "F32", clip: bool = False) -> QuantWeight:
    """Blocked asymmetric quantization of W (K, N) float32 (range includes 0, ties to even),
    round to nearest; `clip`: each block's range by the MSE clip (`block_params`)."""
    K, N = w.shape
    nb = -(-K // block)
    levels = (1 << bits) - 1
    q = np.empty((N, nb, block), np.uint8)
    scales = np.empty((N, nb), np.float32)
    zp = np.empty((N, nb), np.uint8)
    for a in range(0, N, _CHUNK_COLS):
        b = min(N, a + _CHUNK_COLS)
        wt = np.zeros((b - a, nb * block), np.float32)
        wt[:, :K] = w[:, a:b].T
        wt = wt.reshape(b - a, nb, block)
        s, z = block_params(wt, levels, clip)
        q[a:b] = np.clip(np.rint(wt / s[..., None]) + z[..., None], 0, levels)
        scales[a:b], zp[a:b] = s, z
    return QuantWeight(bits, block, K, N, q, scales, zp, None, origin, exact=False)


class _BlockGrid:
    """GPTQ's grid (backends/gptq.py) for the blocks above: a block's scale and zero point are
    taken from its rows as GPTQ has updated them when it reaches the block's first row."""

    def __init__(self, q: np.ndarray, scales: np.ndarray, zp: np.ndarray, bits: int, block: int, clip: bool):
        self.q, self.scales, self.zp = q, scales, zp  # views of the weight's arrays: (n, nb, block), (n, nb)
        self.levels, self.group, self.clip = (1 << bits) - 1, block, clip
        self._s = self._z = np.empty(0, np.float32)

    def begin(self, k: int, rows: np.ndarray) -> None:
        self._s, self._z = block_params(np.ascontiguousarray(rows.T), self.levels, self.clip)
        self.scales[:, k // self.group], self.zp[:, k // self.group] = self._s, self._z

    def round(self, k: int, row: np.ndarray) -> np.ndarray:
        q = np.clip(np.rint(row / self._s) + self._z, 0, self.levels)
        self.q[:, k // self.group, k % self.group] = q
        return self._s * (q - self._z)


# GPTQ's damping for these blocks, of the mean Hessian diagonal (backends/gptq.py DAMP: the
# paper's 1 %); docs/quantization.md, "GPTQ for re-quantized weights"
BLOCK_DAMP = 0.1


def quantize_gptq(w: np.ndarray, h: np.ndarray, bits: int, block: int, origin: str = "F32",
                  clip: bool = False) -> QuantWeight:
    """W (K, N) float32 as `quantize` lays it out, rounded by GPTQ (backends/gptq.py) against the
    Hessian `h` (K, K) of the rows it reads, rows in order along K (K a multiple of `block`)."""
    K, N = w.shape
    if K % block:
        raise ValueError(f"GPTQ's blocks need K = {K} to be a multiple of {block}")
    nb = K // block
    q = np.empty((N, nb, block), np.uint8)
    scales = np.empty((N, nb), np.float32)
    zp = np.empty((N, nb), np.uint8)
    f = factor(h, damp=BLOCK_DAMP)
    for a in range(0, N, _CHUNK_COLS):  # the columns are independent: a chunk at a time (peak RAM)
        b = min(N, a + _CHUNK_COLS)
        solve(w[:, a:b], f, _BlockGrid(q[a:b], scales[a:b], zp[a:b], bits, block, clip))
    return QuantWeight(bits, block, K, N, q, scales, zp, None, origin, exact=False)


def dequantize(qw: QuantWeight) -> np.ndarray:
    """W (K, N) float32, in gguf-py's float order (d * q + m; d * (q - zp))."""
    lv = qw.q.astype(np.float32) - qw.zp[..., None].astype(np.float32)  # exact small integers
    w = qw.scales[..., None] * lv
    if qw.mins is not None:
        w += qw.mins.T[..., None]
    return np.ascontiguousarray(w.reshape(qw.N, -1)[:, :qw.K].T)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF 4-bit blocks: byte j holds element j (low nibble) and j + 16 (high nibble)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.uint8)


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...) float32: a little-endian float16 field of every block."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: (..., 4) uint8, a little-endian uint32 whose bit j is element j's fifth bit."""
    h = np.ascontiguousarray(qh).view("<u4")  # (..., 1)
    return ((h >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 bytes of 6-bit scales and minima of a super-block's 8 sub-blocks (ggml's
    get_scale_min_k4) -> (sc, m), each (..., 8) uint8."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale, mins


def from_gguf(type_name: str, raw: np.ndarray, K: int, N: int) -> QuantWeight | None:
    """GGUF rows (N, bytes per row) uint8 of a (N out, K in) tensor -> QuantWeight, exactly;
    None when this type has no exact form here. 5-bit blocks go into 8-bit ones (their levels are
    8-bit levels); a K-quant's 32-element sub-blocks are the blocks, its sub-block scale and
    minimum computed in float32 as gguf-py does (`d * sc`, `dmin * m`)."""
    if type_name not in GGUF_EXACT or K % (256 if type_name.endswith("_K") else 32):
        return None
    nb = K // 32
    if type_name in ("Q4_K", "Q5_K"):
        sb = np.ascontiguousarray(raw).reshape(N, K // 256, -1)  # super-blocks of 256
        sc, m = _k_scales(sb[..., 4:16])
        d = (_f16(sb[..., 0:2])[..., None] * sc.astype(np.float32)).reshape(N, nb)
        dm = (_f16(sb[..., 2:4])[..., None] * m.astype(np.float32)).reshape(N, nb)
        qs = sb[..., -128:].reshape(N, K // 256, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 0x0F).reshape(N, K // 256, 8, 32)
        bits = 4
        if type_name == "Q5_K":  # sub-block s takes bit s of each of the 32 qh bytes
            qh = sb[..., 16:48].reshape(N, K // 256, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q, bits = q | ((qh & 1) << 4), 8
        return QuantWeight(bits, 32, K, N, q.reshape(N, nb, 32).astype(np.uint8), d, np.zeros((N, nb), np.uint8),
                           np.ascontiguousarray((-dm).T), type_name, True)
    blocks = np.ascontiguousarray(raw).reshape(N, nb, -1)
    d = _f16(blocks[..., 0:2])
    mins = None
    if type_name == "Q8_0":
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return QuantWeight(8, 32, K, N, q, d, np.full((N, nb), 128, np.uint8), None, type_name, True)
    if type_name == "Q5_0":  # d (q - 16), q = low nibble | fifth bit << 4
        q = _nibbles(blocks[..., 6:]) | (_high_bits(blocks[..., 2:6]) << 4)
        return QuantWeight(8, 32, K, N, q, d, np.full((N, nb), 16, np.uint8), None, type_name, True)
    if type_name == "Q5_1":  # d q + m
        mins = np.ascontiguousarray(_f16(blocks[..., 2:4]).T)
        q = _nibbles(blocks[..., 8:]) | (_high_bits(blocks[..., 4:8]) << 4)
        return QuantWeight(8, 32, K, N, q, d, np.zeros((N, nb), np.uint8), mins, type_name, True)
    if type_name == "Q4_0":
        q, zp = _nibbles(blocks[..., 2:]), np.full((N, nb), 8, np.uint8)
    else:  # Q4_1
        mins = np.ascontiguousarray(_f16(blocks[..., 2:4]).T)
        q, zp = _nibbles(blocks[..., 4:]), np.zeros((N, nb), np.uint8)
    return QuantWeight(4, 32, K, N, q, d, zp, mins, type_name, True)


def widen(qw: QuantWeight, bits: int) -> QuantWeight:
    """The same weights in a wider container (4 -> 8 bits: every 4-bit level and zero point is an
    8-bit one), so a fused weight whose parts come in different widths is held exactly."""
    if qw.bits == bits:
        return qw
    if qw.bits > bits:
        raise ValueError(f"cannot narrow {qw.bits}-bit blocks to {bits} bits exactly")
    return QuantWeight(bits, qw.block, qw.K, qw.N, qw.q, qw.scales, qw.zp, qw.mins, qw.origin, qw.exact)


def center(qw: QuantWeight) -> QuantWeight:
    """The same weights with the block minimum moved into an integer zero point where exact.

    Q4_1's form `d * q + m` (zp 0) works, but the kernel multiplies `d * q`, all of one sign
    and up to 15 d, by int8-quantized activations, and their rounding error grows with it. With
    z = round(-m / d), `d * (q - z) + (m + z d)` is the same weight (checked exactly in float64
    per block; a block where `m + z d` would round keeps z = 0): the kernel's part is centred on
    zero like any quantized weight and the remainder |m + z d| <= d / 2 stays in the float term.
    On SmolLM2 (Q4_1) it cut the mean logit KL against F32 from 0.015 to 0.0035
    (docs/quantization.md)."""
    if qw.mins is None:
        return qw
    levels = (1 << qw.bits) - 1
    d, m = qw.scales, qw.mins.T  # (N, n_blocks)
    ratio = np.divide(-m, d, out=np.zeros_like(m), where=d != 0)  # a K-quant sub-block's scale may be 0
    z = np.clip(np.rint(ratio), 0, levels).astype(np.uint8)
    r = (m + z.astype(np.float32) * d).astype(np.float32)
    ok = r.astype(np.float64) == m.astype(np.float64) + z.astype(np.float64) * d.astype(np.float64)
    z[~ok], r[~ok] = qw.zp[~ok], m[~ok]
    return QuantWeight(qw.bits, qw.block, qw.K, qw.N, qw.q, qw.scales, z, np.ascontiguousarray(r.T),
                       qw.origin, qw.exact)


def concat(parts: list[QuantWeight]) -> QuantWeight:
    """Parts along N (fused q/k/v): same bits, block and K; a missing `mins` becomes zeros."""
    p0 = parts[0]
    if len(parts) == 1:
        return p0
    if any((p.bits, p.block, p.K) != (p0.bits, p0.block, p0.K) for p in parts):
        raise ValueError("concat needs parts of one bit width, block size and K")
    mins = None
    if any(p.mins is not None for p in parts):
        mins = np.concatenate([p.mins if p.mins is not None else np.zeros((p.n_blocks, p.N), np.float32)
                               for p in parts], axis=1)
    origins = sorted({p.origin for p in parts})
    return QuantWeight(p0.bits, p0.block, p0.K, sum(p.N for p in parts),
                       np.concatenate([p.q for p in parts]), np.concatenate([p.scales for p in parts]),
                       np.concatenate([p.zp for p in parts]), mins, "+".join(origins),
                       all(p.exact for p in parts))


def rows(qw: QuantWeight, lo: int, hi: int) -> QuantWeight:
    """Output columns [lo, hi) (a head split part)."""
    return QuantWeight(qw.bits, qw.block, qw.K, hi - lo, qw.q[lo:hi], qw.scales[lo:hi], qw.zp[lo:hi],
                       None if qw.mins is None else qw.mins[:, lo:hi], qw.origin, qw.exact)


def permute_rows(qw: QuantWeight, order: np.ndarray) -> QuantWeight:
    """Output columns reordered (undoing llama.cpp's Q/K row permutation)."""
    return QuantWeight(qw.bits, qw.block, qw.K, qw.N, qw.q[order], qw.scales[order], qw.zp[order],
                       None if qw.mins is None else qw.mins[:, order], qw.origin, qw.exact)


# ---- where stored blocks come from -----------------------------------------------------------
@dataclass(frozen=True)
class SourceTensor:
    """One weight as a checkpoint file stores it: what `from_gguf` takes, plus the row order."""

    type_name: str  # GGUF type name ("Q4_1", "Q8_0", "F32", ...)
    data: np.ndarray  # the stored rows, (N, bytes per row) uint8 for a block type
    K: int  # input features
    N: int  # output rows
    order: np.ndarray | None = None  # HF row i is stored row order[i] (permute_rows); None: same


class BlockSource(Protocol):
    """A model's weights as blocks of the file it was imported from, by HF tensor name.

    Declared here, where the blocks are used, and passed in by the caller of the backend
    (checkpoints/gguf_blocks.py implements it for GGUF files): the backend knows no file format
    of the checkpoint tooling and imports nothing of it."""

    path: Path  # the file, for messages

    def tensor(self, name: str) -> SourceTensor | None:
        """The stored form of HF tensor `name`, None when the file has no such tensor."""
        ...


class Calibration(Protocol):
    """The rows a model's linears read on calibration text, for GPTQ on the weights that are
    re-quantized (backends/gptq.py). Declared here and passed in by the caller of the backend
    (convert/gptq.py `CpuqInputs` implements it: it runs the F32 model, which the backend does not
    import), asked only when a weight has no exact blocks."""

    tokens: int  # calibration tokens (for the manifest)

    def hessian(self, kind: str, layer: int) -> np.ndarray | None:
        """H = X^T X (K, K) float64 of the rows weight `kind` ("qkv", "o", "gate_up", "gate",
        "up", "down", "head") of `layer` reads, as the weight reads them (norm gains applied); None
        when unknown."""
        ...
