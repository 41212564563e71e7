"""The operator library, shared by cpu-q and the NPU matmul path: where it is, what it runs.

`pip install` builds one shared object (`_ops`, next to this file; setup.py) from every backend's
C sources, each kept beside the Python that loads it: the two onnxruntime operators this module
registers, `_attn.c` (`ai.edge_llm.AttnRow`, attention over the cache's rows: cpu-q's decode
graph, and the matmul path's row step through ctypes) and `_qmatmul.c` (`ai.edge_llm.MatMulQ`,
cpu-q's 4-bit linears), with `_ortop.h` (what both declare), and the matmul path's `backends/npu/matmul/_row_ops.c` and `_rounds.c` (ctypes only, declared by their
modules). It is an onnxruntime custom operator library, registered into the decode graph's
session options (`register`). It is optional: without a C compiler at install time the package
installs, and backend cpu-q runs one-row steps on its per-layer graphs instead (`library_path()`
is None). The library also exports the same computations on one thread (`edge_attn_row` for one
query row, `edge_attn_rows` for T, `edge_qmatmul`; used by the tests) and the code paths it
picked for this CPU: `isa()` (attention's, part of cpu-q's numerics) and `qmatmul_isa()` (the
same bits on every path, so not in the numerics).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from functools import lru_cache
from pathlib import Path
from typing import Any

OPS_DOMAIN = "ai.edge_llm"
ATTN_DOMAIN, ATTN_OP = OPS_DOMAIN, "AttnRow"
QMATMUL_OP = "MatMulQ"  # _qmatmul.c, the decode graph's 4- and 8-bit linears


def library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (p := here / f"_ops{suffix}").is_file():
            return p
    return None


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The library through ctypes (the GIL is released during calls), or None if not built."""
    path = library_path()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.edge_attn_row.argtypes = [P, P, P, P, P, I64, I64, I, I, I, P, P]
    lib.edge_attn_row.restype = I
    lib.edge_attn_rows.argtypes = [P, P, P, P, P, I64, I64, I64, I, I, I, P, P]
    lib.edge_attn_rows.restype = I
    lib.edge_attn_rows_work_size.argtypes = [I64, I64, I, I]
    lib.edge_attn_rows_work_size.restype = I64
    lib.edge_attn_work_size.argtypes = [I64, I, I]
    lib.edge_attn_work_size.restype = I64
    lib.edge_qmatmul.argtypes = [P, P, I64, I64, I64, I, I, P, P]
    lib.edge_qmatmul.restype = I
    lib.edge_qmatmul_work_size.argtypes = [I64, I64]
    lib.edge_qmatmul_work_size.restype = I64
    lib.edge_qmatmul_passes.argtypes = [P, P, I64, I64, I64, I, I, I, P, P]
    lib.edge_qmatmul_passes.restype = I
    lib.edge_qmatmul_passes_work_size.argtypes = [I64, I64, I64, I]
    lib.edge_qmatmul_passes_work_size.restype = I64
    lib.edge_qmatmul_isa.restype = ctypes.c_char_p
    lib.edge_qmatmul_force.argtypes = [ctypes.c_char_p]
    lib.edge_qmatmul_force.restype = I
    lib.edge_attn_isa.restype = ctypes.c_char_p
    lib.edge_attn_chunk.restype = I
    return lib


def isa() -> str:
    """e.g. `x86_64-avx512f-c256`: the clone this CPU runs and the chunk size (both decide bits)."""
    lib = library()
    return "none" if lib is None else f"{lib.edge_attn_isa().decode()}-c{lib.edge_attn_chunk()}"


def qmatmul_isa() -> str:
    """MatMulQ's path on this CPU: avx512vnni, avxvnni, avx2, sdot or c."""
    lib = library()
    return "none" if lib is None else lib.edge_qmatmul_isa().decode()


def register(opts: Any) -> None:
    """Make `AttnRow` available to sessions made with these onnxruntime SessionOptions."""
    path = library_path()
    if path is None:
        raise FileNotFoundError("the attention operator (_attn.c) was not built at install")
    opts.register_custom_ops_library(str(path))
