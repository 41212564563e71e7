"""`NpuInt8Matmul`: the `Int8Matmul` engine on the RK3588 NPU through librknnrt's matmul API.

Per weight B (K, N): N split over the NPU cores in parts that are multiples of 32 (one matmul
context per core: a three-core mask is refused for matmul contexts), each part converted once to
the native layout (`rknn_B_normal_layout_to_native_layout`) into a buffer of its context,
`RKNN_INT8_MM_INT8_TO_INT32`, all contexts in one IOMMU domain (the decoder's: 1, leaving
domain 0 to the vision tower's `.rknn`). M varies per call: each context is created with the
dynamic shapes `M_SHAPES`; a call pads its rows up to the next shape with zero rows and splits
above the largest (rows never mix, so padding changes no bit). A, B and C are buffers from
`rknn_create_mem`, allocated once per context, with numpy views onto them: a call copies the
int8 rows in and the int32 rows out, nothing else. The parts of one call run concurrently: the
first on the caller's thread, the others on one pool thread each (ctypes releases the GIL for the
call). docs/npu.md, "The matmul API binding".
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from edge_llm.backends import rknn_matmul_api as api
from edge_llm.backends.int8mm import ALIGN, check_rows, check_weight
from edge_llm.errors import ConfigError, RknnMatmulError
from edge_llm.weights import sha256_file

log = logging.getLogger(__name__)

M_SHAPES = (1, 2, 4, 8, 16, 32, 64, 128)  # the dynamic shapes of every context (rows per call)
DECODER_DOMAIN = 1  # the decoder's IOMMU domain; the vision tower's .rknn stays in domain 0
CORES = (0, 1, 2)  # the RK3588's three NPU cores


def split_columns(n: int, parts: int) -> list[tuple[int, int]]:
    """[n0, n1) column ranges of `n` (a multiple of 32) over at most `parts` cores, each a multiple
    of 32, as even as 32-column blocks allow (the first ones one block larger); no empty part."""
    blocks = n // ALIGN
    base, extra = divmod(blocks, parts)
    out, n0 = [], 0
    for i in range(parts):
        width = (base + (i < extra)) * ALIGN
        if width:
            out.append((n0, n0 + width))
            n0 += width
    return out


def shape_for(rows: int) -> int:
    """The smallest dynamic shape that holds `rows` (<= the largest)."""
    return next(m for m in M_SHAPES if m >= rows)


@dataclass
class _Part:
    """One context: columns [n0, n1) of a weight on one core."""

    ctx: int
    core: int
    n0: int
    n1: int
    attrs: list[api.IoAttr] = field(default_factory=list)
    mems: list[ctypes._Pointer] = field(default_factory=list)  # rknn_tensor_mem pointers (A, B, C)
    a: np.ndarray | None = None  # int8 view of the A buffer (largest shape)
    c: np.ndarray | None = None  # int32 view of the C buffer
    m: int = 0  # the dynamic shape set now (0: none yet)


def _view(mem: ctypes._Pointer, dtype: type, count: int) -> np.ndarray:
    m = mem.contents
    return np.frombuffer((ctypes.c_byte * m.size).from_address(m.virt_addr), dtype=dtype, count=count)


def _loaded_file(path: str) -> str | None:
    """The file the dynamic loader opened for `path` (a bare name is searched in /proc/self/maps)."""
    if os.sep in path:
        return path if os.path.isfile(path) else None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and os.path.basename(fields[5]) == path:
                    return fields[5]
    except OSError:
        pass
    return None


def library_id(path: str) -> str:
    """The first 12 hex digits of the library file's sha256 (the matmul API has no version query)."""
    real = _loaded_file(path)
    if real is None:
        return "unknown"
    return sha256_file(real)[:12]


class NpuInt8Matmul:
    """int8 x int8 -> int32 on the NPU: the `Int8Matmul` protocol of `int8mm.py`."""

    def __init__(self, lib: api.MatmulLib, cores: Sequence[int] = CORES, domain: int = DECODER_DOMAIN):
        if not cores or any(c not in CORES for c in cores) or len(set(cores)) != len(cores):
            raise ConfigError(f"NPU cores {list(cores)}: need distinct cores out of {list(CORES)}")
        self.lib, self.cores, self.domain = lib, tuple(cores), domain
        self.weights: dict[str, list[_Part]] = {}
        self.k: dict[str, int] = {}
        self.n: dict[str, int] = {}
        # the first part of a call runs on the caller's thread, the others on one thread per core
        self.pool = ThreadPoolExecutor(len(self.cores) - 1, thread_name_prefix="npu-mm") if len(self.cores) > 1 else None
        self.numerics = f"librknnrt-{library_id(lib.path)}-cores{','.join(map(str, self.cores))}"

    # ---- load ------------------------------------------------------------------------------
    def add(self, name: str, w: np.ndarray) -> None:
        check_weight(name, w, self.weights)
        K, N = w.shape
        parts: list[_Part] = []
        try:
            for core, (n0, n1) in zip(self.cores, split_columns(N, len(self.cores))):
                parts.append(self._part(core, n0, n1, w))
        except BaseException:
            self._release(parts)
            raise
        self.weights[name], self.k[name], self.n[name] = parts, K, N

    def _part(self, core: int, n0: int, n1: int, w: np.ndarray) -> _Part:
        K, n = w.shape[0], n1 - n0
        info = api.MatmulInfo(K=K, N=n, type=api.MatmulType.INT8_MM_INT8_TO_INT32, B_layout=api.Layout.NATIVE,
                              AC_layout=api.Layout.NORM, iommu_domain_id=self.domain)
        ctx, attrs = self.lib.create_dynamic_shape(info, [api.Shape(m, K, n) for m in M_SHAPES])
        part = _Part(ctx, core, n0, n1, attrs)
        try:
            self.lib.set_core_mask(ctx, api.CORE_MASKS[core])
            big = attrs[-1]
            for size in (big.A.size, big.B.size, big.C.size):
                part.mems.append(self.lib.create_mem(ctx, size))
            a_mem, b_mem, c_mem = part.mems
            b = np.ascontiguousarray(w[:, n0:n1])
            self.lib.b_to_native(b.ctypes.data, b_mem.contents.virt_addr, K, n, info)
            self.lib.set_io_mem(ctx, b_mem, big.B)
            part.a = _view(a_mem, np.int8, M_SHAPES[-1] * K)
            part.c = _view(c_mem, np.int32, M_SHAPES[-1] * n)
        except BaseException:
            self._release([part])
            raise
        return part

    # ---- run -------------------------------------------------------------------------------
    def run(self, name: str, a: np.ndarray) -> np.ndarray:
        parts = self.weights.get(name)
        if parts is None:
            raise KeyError(f"int8 matmul weight {name!r} was never added")
        K = self.k[name]
        check_rows(name, a, K)
        rows = a.shape[0]
        out = np.empty((rows, self.n[name]), dtype=np.int32)
        step = M_SHAPES[-1]
        for r0 in range(0, rows, step):
            self._chunk(parts, a[r0:r0 + step], out[r0:r0 + step], K)
        return out

    def _chunk(self, parts: list[_Part], a: np.ndarray, out: np.ndarray, K: int) -> None:
        m = a.shape[0]
        shape = shape_for(m)
        for p in parts:
            assert p.a is not None
            p.a[:m * K] = a.reshape(-1)
            p.a[m * K:shape * K] = 0  # padding rows: zero (they never mix into the real rows)
            if p.m != shape:
                self._set_shape(p, shape, K)
        if self.pool is not None and len(parts) > 1:
            others = [self.pool.submit(self.lib.run, p.ctx) for p in parts[1:]]
            try:
                self.lib.run(parts[0].ctx)
            finally:
                for f in others:
                    f.result()  # waits for every part; the first error is raised
        else:
            for p in parts:
                self.lib.run(p.ctx)
        for p in parts:
            assert p.c is not None
            n = p.n1 - p.n0
            out[:, p.n0:p.n1] = p.c[:m * n].reshape(m, n)

    def _set_shape(self, p: _Part, m: int, K: int) -> None:
        attrs = p.attrs[M_SHAPES.index(m)]
        p.m = 0  # unusable until both buffers are bound to the new shape
        self.lib.set_dynamic_shape(p.ctx, api.Shape(m, K, p.n1 - p.n0))
        self.lib.set_io_mem(p.ctx, p.mems[0], attrs.A)
        self.lib.set_io_mem(p.ctx, p.mems[2], attrs.C)
        p.m = m

    # ---- release ---------------------------------------------------------------------------
    def _release(self, parts: list[_Part]) -> None:
        """Destroy the buffers, then the context, of each part; errors are logged, not raised (a
        release runs after another error or at close, and must release the rest)."""
        for p in parts:
            p.a = p.c = None
            for mem in p.mems:
                try:
                    self.lib.destroy_mem(p.ctx, mem)
                except RknnMatmulError as e:
                    log.error("NPU matmul: %s", e)
            p.mems.clear()
            try:
                self.lib.destroy(p.ctx)
            except RknnMatmulError as e:
                log.error("NPU matmul: %s", e)

    def close(self) -> None:
        """Release every context and buffer; a second call does nothing."""
        for parts in self.weights.values():
            self._release(parts)
        self.weights.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


def open_npu_matmul(lib: str | None = None, cores: Sequence[int] = CORES,
                    domain: int = DECODER_DOMAIN) -> NpuInt8Matmul:
    """The NPU engine over `lib` (None: `$EDGE_LLM_LIBRKNNRT`, else librknnrt.so from the loader)."""
    return NpuInt8Matmul(api.load_library(api.library_path(lib)), cores, domain)
