"""`CRound`: one round of the NPU matmul engine in C (`_rounds.c` in the operator library; docs/npu.md,
"The matmul API binding": "A round in C").

A round is one product of `NpuInt8Matmul`: its parts (one matmul context per NPU core) run at the
same time. `rknn_matmul_run` blocks its thread until its core is done, so the parts need a thread
each; `CRound` keeps helper threads for the engine's lifetime (they spin for `SPIN_NS` after a
round, then sleep) and does a chunk's copies in and out in the same C call, where Python's
thread pool takes several times as long to hand the calls over (`bench npu`'s micro-benchmark
measures both: docs/npu.md, "A round in C"). The engine falls back to that pool when the
operator library is not built.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from ctypes import POINTER, Structure, c_int, c_int64, c_uint64, c_void_p

import numpy as np

from edge_llm.backends import kernels
from edge_llm.backends.npu.matmul.binding import ERRORS
from edge_llm.errors import RknnMatmulError, RunnerError

SPIN_NS = 200_000  # how long a helper spins for the next round before it sleeps (a decode token's
# CPU work between two rounds is tens to hundreds of microseconds: docs/npu.md, "Prediction")


class CPart(Structure):  # edge_npu_part in _rounds.c
    _fields_ = [("ctx", c_uint64), ("k0", c_int64), ("k1", c_int64), ("n0", c_int64), ("n1", c_int64),
                ("adds", c_int64), ("a", c_void_p), ("c", c_void_p)]


def table(parts: Sequence[CPart]) -> ctypes.Array:
    """A weight's parts as one C array (made once, at `add`), in the order they are applied."""
    return (CPart * len(parts))(*parts)


def _declare(lib: ctypes.CDLL) -> None:
    lib.edge_npu_pool_new.argtypes = [c_void_p, c_int, c_int64]
    lib.edge_npu_pool_new.restype = c_void_p
    lib.edge_npu_pool_free.argtypes = [c_void_p]
    lib.edge_npu_pool_free.restype = None
    lib.edge_npu_chunk.argtypes = [c_void_p, POINTER(CPart), c_int, c_void_p, c_int64, c_int64, c_int64, c_void_p,
                                   c_int64, POINTER(c_int)]
    lib.edge_npu_chunk.restype = c_int


class CRound:
    """The parts of a round on `helpers` threads + the caller's, calling `run_addr` (the loaded
    library's `rknn_matmul_run`)."""

    def __init__(self, lib: ctypes.CDLL, run_addr: int, helpers: int, spin_ns: int = SPIN_NS):
        _declare(lib)
        self.lib = lib
        self.pool = lib.edge_npu_pool_new(run_addr, helpers, spin_ns)
        if not self.pool:
            raise RunnerError(f"NPU round: could not start {helpers} helper threads")
        self.rcs = (c_int * (helpers + 1))()

    def chunk(self, table: ctypes.Array, a: np.ndarray, out: np.ndarray, m: int, shape: int) -> None:
        """a (m, K) int8 C-contiguous -> out (m, N) int32 C-contiguous, the contexts already at `shape`."""
        n = len(table)
        failed = self.lib.edge_npu_chunk(self.pool, table, n, a.ctypes.data, m, shape, a.shape[1], out.ctypes.data,
                                         out.shape[1], self.rcs)
        if failed < 0:
            raise ValueError(f"NPU round: {n} parts for a pool of {len(self.rcs) - 1} helpers, {m} rows in {shape}")
        if failed:
            i, rc = next((i, rc) for i, rc in enumerate(self.rcs[:n]) if rc != 0)
            raise RknnMatmulError("rknn_matmul_run", rc, ERRORS.get(rc, "unknown code"), f"part {i} of {n}")

    def close(self) -> None:
        """Stop and join the helper threads; a second call does nothing."""
        if self.pool:
            self.lib.edge_npu_pool_free(self.pool)
            self.pool = None


def c_round(run_addr: int, helpers: int) -> CRound | None:
    """A `CRound`, or None when the operator library is not built."""
    lib = kernels.library()
    return None if lib is None else CRound(lib, run_addr, helpers)
