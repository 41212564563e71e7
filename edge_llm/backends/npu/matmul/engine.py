"""`NpuInt8Matmul`: the `Int8Matmul` engine on the RK3588 NPU through librknnrt's matmul API.

Per weight B (K, N): cut over the NPU cores in parts that are multiples of 32 (`split_weight`: by
N, by K with the partial products summed in int32, or both, whichever makes the largest part
smallest; one matmul context per core: boards refuse multi-core masks for matmul contexts).
Each context follows the order of Rockchip's dynamic-shape demo: created with the dynamic shapes
`M_SHAPES` (info.M/K/N set to the largest shape), its core mask, its A, B and C buffers from
`rknn_create_mem` sized for the largest shape, B converted once to the native layout
(`rknn_B_normal_layout_to_native_layout` with that info), the first shape set, then B bound (once:
B is not dynamic), then A and C bound for that shape; at every shape change the shape is set
before A and C are bound again; release is the buffers, then the context.
`RKNN_INT8_MM_INT8_TO_INT32`, all contexts in IOMMU domain 0 (the driver attaches one domain at a
time: the vision tower's `.rknn` is there too, and both fit). A call pads its rows up to the next
shape with zero rows and splits above the largest (rows never mix, so padding changes no bit);
numpy views onto the buffers: a call copies the int8 rows in and the int32 rows out, nothing else.
The parts of one call (a round) run concurrently, the first on the caller's thread and the others
on helper threads: one C call per round (`rounds.CRound` over `_rounds.c`), or Python's thread
pool where the operator library is not built (ctypes releases the GIL for the calls).
docs/npu.md, "The matmul API binding".
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from edge_llm.backends.npu.matmul import rounds
from edge_llm.backends.npu.matmul import binding as api
from edge_llm.backends.npu.matmul.int8 import ALIGN, check_rows, check_weight
from edge_llm.errors import ConfigError, RknnMatmulError
from edge_llm.weights import sha256_file

log = logging.getLogger(__name__)

M_SHAPES = (1, 2, 4, 8, 16, 32, 64, 128)  # the dynamic shapes of every context (rows per call)
DECODER_DOMAIN = 0  # the decoder's IOMMU domain: the tower's too (one is attached at a time; docs/npu.md)
CORES = (0, 1, 2)  # the RK3588's three NPU cores


def split_columns(n: int, parts: int) -> list[tuple[int, int]]:
    """[n0, n1) ranges of `n` (a multiple of 32) over at most `parts`, each a multiple of 32, as
    even as 32-wide blocks allow (the first ones one block larger); no empty part."""
    blocks = n // ALIGN
    base, extra = divmod(blocks, parts)
    out, n0 = [], 0
    for i in range(parts):
        width = (base + (i < extra)) * ALIGN
        if width:
            out.append((n0, n0 + width))
            n0 += width
    return out


@dataclass(frozen=True)
class Block:
    """Rows [k0, k1) of K and columns [n0, n1) of N of a weight: one core's part."""

    k0: int
    k1: int
    n0: int
    n1: int

    @property
    def size(self) -> int:
        return (self.k1 - self.k0) * (self.n1 - self.n0)

    @property
    def adds(self) -> bool:
        """Its product is added to columns parts starting at row 0 wrote (a cut of K), not written."""
        return self.k0 > 0


def split_weight(k: int, n: int, parts: int) -> list[Block]:
    """How a (k, n) weight is cut over `parts` cores. Every core reads its part at its share of the
    bandwidth, so a linear takes as long as its largest part: of three cuts in 32 x 32 tiles the one
    with the smallest largest part wins, ties going to the first: N alone (no sum on the CPU), K
    alone (each core a partial product over its rows of K, summed in int32 on the CPU), or, for
    three cores, two halves of N over rows [0, k') and all of N over [k', k) on the third. In
    every cut the parts that start at row 0 come first and tile N once, and the others only add
    to columns they wrote (`Block.adds`). The
    2B's o (2048 x 2048: 64 x 64 tiles) is 1376 tiles on its largest core mixed, 1408 by N; its
    down (6144 x 2048) 4096 by K, 4224 by N (docs/npu.md, "The matmul API binding")."""
    cands = [[Block(0, k, n0, n1) for n0, n1 in split_columns(n, parts)],
             [Block(k0, k1, 0, n) for k0, k1 in split_columns(k, parts)]]
    kb = k // ALIGN
    if parts == 3 and n >= 2 * ALIGN and kb >= 2:
        (h0, h1), (h2, h3) = split_columns(n, 2)
        for kc in range(1, kb):
            k1 = kc * ALIGN
            cands.append([Block(0, k1, h0, h1), Block(0, k1, h2, h3), Block(k1, k, 0, n)])
    return min(cands, key=lambda c: max(b.size for b in c))  # min keeps the first of equals


def shape_for(rows: int) -> int:
    """The smallest dynamic shape that holds `rows` (<= the largest)."""
    return next(m for m in M_SHAPES if m >= rows)


@dataclass
class _Part:
    """One context: the block `blk` of a weight on one core."""

    ctx: int
    core: int
    blk: Block
    attrs: list[api.IoAttr] = field(default_factory=list)
    mems: list[ctypes._Pointer] = field(default_factory=list)  # rknn_tensor_mem pointers (A, B, C)
    a: np.ndarray | None = None  # int8 view of the A buffer (largest shape)
    c: np.ndarray | None = None  # int32 view of the C buffer
    m: int = 0  # the dynamic shape set now (0: none yet)

    def c_part(self) -> rounds.CPart:
        """This part as the C round reads it."""
        b = self.blk
        return rounds.CPart(self.ctx, b.k0, b.k1, b.n0, b.n1, int(b.adds), self.mems[0].contents.virt_addr,
                               self.mems[2].contents.virt_addr)


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
    """int8 x int8 -> int32 on the NPU: the `Int8Matmul` protocol of `int8.py`."""

    def __init__(self, lib: api.MatmulLib, cores: Sequence[int] = CORES, domain: int = DECODER_DOMAIN,
                 c_round: bool = True, sync: bool = False, serial: bool = False):
        if not cores or any(c not in CORES for c in cores) or len(set(cores)) != len(cores):
            raise ConfigError(f"NPU cores {list(cores)}: need distinct cores out of {list(CORES)}")
        self.lib, self.cores, self.domain = lib, tuple(cores), domain
        # the start-up self-test's answers (selftest.py): `sync` calls rknn_mem_sync on A before
        # and C after each run, `serial` runs a round's parts one after another on the caller's
        # thread; either takes the Python path (the C round calls rknn_matmul_run alone, at once)
        self.sync, self.serial = sync, serial
        if sync and not lib.has("rknn_mem_sync"):
            raise ConfigError(f"{lib.path} has no rknn_mem_sync: cannot keep A and C coherent")
        self.weights: dict[str, list[_Part]] = {}
        self.k: dict[str, int] = {}
        self.n: dict[str, int] = {}
        self.tables: dict[str, ctypes.Array] = {}
        # the first part of a call runs on the caller's thread, the others on one thread per core: C
        # helper threads (rounds.py), else (no operator library, or c_round False) Python's pool
        run_addr = ctypes.cast(lib.cdll.rknn_matmul_run, ctypes.c_void_p).value
        use_c = c_round and not sync and not serial
        self.round = rounds.c_round(run_addr, len(self.cores) - 1) if use_c else None
        self.pool = (ThreadPoolExecutor(len(self.cores) - 1, thread_name_prefix="npu-mm")
                     if self.round is None and len(self.cores) > 1 and not serial else None)
        self.numerics = f"librknnrt-{library_id(lib.path)}-cores{','.join(map(str, self.cores))}"
        self.selftest = None  # the SelfTestReport it was opened after (selftest.open_checked), if any

    # ---- load ------------------------------------------------------------------------------
    def add(self, name: str, w: np.ndarray) -> None:
        check_weight(name, w, self.weights)
        K, N = w.shape
        parts: list[_Part] = []
        try:
            for core, blk in zip(self.cores, split_weight(K, N, len(self.cores))):
                parts.append(self._part(core, blk, w))
        except BaseException:
            self._release(parts)
            raise
        self.weights[name], self.k[name], self.n[name] = parts, K, N
        if self.round is not None:
            self.tables[name] = rounds.table([p.c_part() for p in parts])

    def _part(self, core: int, blk: Block, w: np.ndarray) -> _Part:
        """One context for `blk`, in the dynamic-shape demo's order (docs/npu.md, "Call sequence")."""
        K, n = blk.k1 - blk.k0, blk.n1 - blk.n0
        info = api.MatmulInfo(M=M_SHAPES[-1], K=K, N=n, type=api.MatmulType.INT8_MM_INT8_TO_INT32,
                              B_layout=api.Layout.NATIVE, B_quant_type=api.QuantType.PER_LAYER_SYM,
                              AC_layout=api.Layout.NORM, iommu_domain_id=self.domain)
        ctx, attrs = self.lib.create_dynamic_shape(info, [api.Shape(m, K, n) for m in M_SHAPES])
        part = _Part(ctx, core, blk, attrs)
        try:
            self.lib.set_core_mask(ctx, api.CORE_MASKS[core])
            for t in "ABC":  # each sized for the largest shape; kept one by one, so a failure releases them
                part.mems.append(self.lib.create_mem(ctx, max(getattr(a, t).size for a in attrs)))
            a_mem, b_mem, c_mem = part.mems
            b = np.ascontiguousarray(w[blk.k0:blk.k1, blk.n0:blk.n1])
            self.lib.b_to_native(b.ctypes.data, b_mem.contents.virt_addr, K, n, info)
            first = M_SHAPES[0]
            self.lib.set_dynamic_shape(ctx, api.Shape(first, K, n))  # a shape before any binding
            self.lib.set_io_mem(ctx, b_mem, attrs[0].B)  # B is not dynamic: bound once
            self._bind_ac(part, first)
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
        check_rows(name, a, self.k[name])
        a = np.ascontiguousarray(a)  # the C round reads rows of K bytes
        rows = a.shape[0]
        out = np.empty((rows, self.n[name]), dtype=np.int32)
        step = M_SHAPES[-1]
        for r0 in range(0, rows, step):
            self._chunk(name, a[r0:r0 + step], out[r0:r0 + step])
        return out

    def _chunk(self, name: str, a: np.ndarray, out: np.ndarray) -> None:
        parts, m = self.weights[name], a.shape[0]
        shape = shape_for(m)
        for p in parts:
            if p.m != shape:
                self._set_shape(p, shape)
        if self.round is not None:  # copies in, runs the parts at once, copies out: _rounds.c
            self.round.chunk(self.tables[name], a, out, m, shape)
            return
        for p in parts:
            assert p.a is not None
            k = p.blk.k1 - p.blk.k0
            p.a[:m * k].reshape(m, k)[:] = a[:, p.blk.k0:p.blk.k1]
            p.a[m * k:shape * k] = 0  # padding rows: zero (they never mix into the real rows)
        if self.pool is not None and len(parts) > 1:
            others = [self.pool.submit(self._run, p) for p in parts[1:]]
            try:
                self._run(parts[0])
            finally:
                for f in others:
                    f.result()  # waits for every part; the first error is raised
        else:
            for p in parts:
                self._run(p)
        for p in parts:  # in order: a part that adds comes after the parts that wrote its columns
            assert p.c is not None
            b = p.blk
            c = p.c[:m * (b.n1 - b.n0)].reshape(m, b.n1 - b.n0)
            if b.adds:  # exact: |sum| <= 127 * 127 * K < 2**31 (check_weight's K bound)
                out[:, b.n0:b.n1] += c
            else:
                out[:, b.n0:b.n1] = c

    def _run(self, p: _Part) -> None:
        if self.sync:  # the CPU's writes of A to the NPU, the NPU's C to the CPU (docs/npu.md, "The start-up self-test")
            self.lib.mem_sync(p.ctx, p.mems[0], api.SYNC_TO_DEVICE)
        self.lib.run(p.ctx)
        if self.sync:
            self.lib.mem_sync(p.ctx, p.mems[2], api.SYNC_FROM_DEVICE)

    def _set_shape(self, p: _Part, m: int) -> None:
        p.m = 0  # unusable until both buffers are bound to the new shape
        self.lib.set_dynamic_shape(p.ctx, api.Shape(m, p.blk.k1 - p.blk.k0, p.blk.n1 - p.blk.n0))
        self._bind_ac(p, m)

    def _bind_ac(self, p: _Part, m: int) -> None:
        """Bind A and C with the attrs of shape `m`, the shape just set."""
        attrs = p.attrs[M_SHAPES.index(m)]
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
        self.tables.clear()
        if self.round is not None:
            self.round.close()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


def open_npu_matmul(lib: str | None = None, cores: Sequence[int] = CORES, domain: int = DECODER_DOMAIN,
                    c_round: bool = True, sync: bool = False, serial: bool = False) -> NpuInt8Matmul:
    """The NPU engine over `lib` (None: `$EDGE_LLM_LIBRKNNRT`, else librknnrt.so from the loader);
    `c_round` False: its rounds on Python's thread pool even where the C round is built (to compare).
    No self-test: the backend opens it through `selftest.open_checked`."""
    return NpuInt8Matmul(api.load_library(api.library_path(lib)), cores, domain, c_round, sync, serial)
