"""ctypes binding of `_attn.c`: one query row of GQA attention over a layer's F32 KV rows.

The shared library is built by `pip install` (setup.py) next to this file; it is not a Python
module (no Python.h), so it is loaded with ctypes, which releases the GIL during the call.
`load()` returns None, with the reason logged once, when it was not built (no C compiler at
install time); cpu-q then runs one-row steps on its per-layer graphs.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
from functools import lru_cache
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class AttnKernel:
    """`edge_attn_row` for one model geometry, with its scratch buffer."""

    def __init__(self, lib: ctypes.CDLL, heads: int, kv_heads: int, head_dim: int, threads: int):
        self.lib, self.threads = lib, threads
        self.H, self.n_kv, self.D = heads, kv_heads, head_dim
        self.max_rows = 0
        self.work = np.empty(0, np.float32)

    @property
    def isa(self) -> str:
        return self.lib.edge_attn_isa().decode()

    @property
    def chunk(self) -> int:
        return int(self.lib.edge_attn_chunk())

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
                 out: np.ndarray) -> None:
        """out (1, H * D) = attention of q (1, H * D) over rows k/v (S, kv) and the new row
        k_new/v_new (1, kv). All float32 C-contiguous; nothing but `out` is written."""
        S, kv = k.shape
        if S > self.max_rows:  # scratch grows by doubling: decode adds one row per call
            self.max_rows = max(S, 2 * self.max_rows, 4096)
            self.work = np.empty(self.lib.edge_attn_work_size(self.max_rows, self.H, self.D), np.float32)
        for name, a, shape in (("q", q, (1, self.H * self.D)), ("out", out, (1, self.H * self.D)),
                               ("k", k, (S, self.n_kv * self.D)), ("v", v, (S, self.n_kv * self.D)),
                               ("k_new", k_new, (1, kv)), ("v_new", v_new, (1, kv))):
            if a.dtype != np.float32 or a.shape != shape or not a.flags.c_contiguous:
                raise ValueError(f"attention {name}: {a.dtype}{list(a.shape)}, expected C-contiguous float32{list(shape)}")
        rc = self.lib.edge_attn_row(q.ctypes.data, k.ctypes.data, v.ctypes.data, k_new.ctypes.data,
                                    v_new.ctypes.data, S, kv, self.H, self.n_kv, self.D, out.ctypes.data,
                                    self.work.ctypes.data, self.threads)
        if rc != 0:
            raise ValueError(f"attention kernel refused H={self.H} n_kv={self.n_kv} D={self.D} S={S}")


def library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (p := here / f"_attn{suffix}").is_file():
            return p
    return None


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    path = library_path()
    if path is None:
        log.warning("cpu-q: the attention kernel (_attn.c) was not built at install (no C compiler?): "
                    "one-row steps run on the per-layer graphs; see docs/quantization.md")
        return None
    lib = ctypes.CDLL(str(path))
    lib.edge_attn_row.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I, _I, _I, _P, _P, _I]
    lib.edge_attn_row.restype = _I
    lib.edge_attn_work_size.argtypes = [_I64, _I, _I]
    lib.edge_attn_work_size.restype = _I64
    lib.edge_attn_isa.restype = ctypes.c_char_p
    lib.edge_attn_chunk.restype = _I
    return lib


def load(heads: int, kv_heads: int, head_dim: int, threads: int) -> AttnKernel | None:
    lib = _library()
    return None if lib is None else AttnKernel(lib, heads, kv_heads, head_dim, threads)
