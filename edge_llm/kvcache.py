"""The KV cache: preallocated F32 rows, the only owner of KV memory.

Layout: one array `(n_layers, 2, max_seq, kv_dim)` float32 (axis 1: 0 = K, 1 = V). For a layer,
K rows `[a, b)` are one contiguous run of bytes, so a snapshot block can be read or written
straight from/into `rows(...)` (or `data[layer, kv]`) without an intermediate copy.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Sequence

import numpy as np
import psutil

from edge_llm.config import Geometry
from edge_llm.errors import KVCacheError
from edge_llm.settings import DEFAULTS

log = logging.getLogger(__name__)

K, V = 0, 1
# leave this much RAM free after allocating the cache (OS, page cache for snapshots, the server)
MEMORY_HEADROOM = 256 * 1024 * 1024


class KVCache:
    def __init__(self, geometry: Geometry, max_seq: int = DEFAULTS.max_seq, kv_bs: int = DEFAULTS.kv_bs,
                 check_memory: bool = True):
        if max_seq <= 0:
            raise KVCacheError(f"max_seq must be > 0, got {max_seq}")
        if kv_bs <= 0:
            raise KVCacheError(f"kv_bs must be > 0, got {kv_bs}")
        self.geometry = geometry
        self.max_seq = max_seq
        self.kv_bs = kv_bs
        nbytes = geometry.kv_bytes_per_token * max_seq
        if check_memory:
            avail = psutil.virtual_memory().available
            if nbytes + MEMORY_HEADROOM > avail:
                raise KVCacheError(
                    f"KV cache for max_seq={max_seq} needs {nbytes / 2**20:.0f} MiB "
                    f"({geometry.kv_bytes_per_token} B/token) but only {avail / 2**20:.0f} MiB are "
                    f"available (keeping {MEMORY_HEADROOM >> 20} MiB headroom): lower --max-seq"
                )
        self.data = _committed_zeros((geometry.n_layers, 2, max_seq, geometry.kv_dim))
        self.tokens: list[int] = []  # token ids whose rows [0, len) are valid
        # called as guard(layer, start) before rows >= start of a layer are overwritten: the
        # snapshot writer may still be streaming them to disk (set by the engine)
        self.write_guard: Callable[[int, int], float] | None = None
        self.write_wait_s = 0.0  # total time spent in the guard

    # ---- state ----------------------------------------------------------------------
    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def truncate(self, m: int) -> None:
        """Keep rows [0, m). Rows beyond are left in place and overwritten later."""
        if not 0 <= m <= self.length:
            raise KVCacheError(f"truncate({m}) outside [0, {self.length}]")
        del self.tokens[m:]

    def reset(self) -> None:
        self.tokens.clear()

    def set_tokens(self, tokens: Sequence[int]) -> None:
        """Declare rows [0, len(tokens)) valid for these ids (after a restore wrote the rows)."""
        if len(tokens) > self.max_seq:
            raise KVCacheError(f"{len(tokens)} tokens exceed max_seq={self.max_seq}")
        self.tokens = list(tokens)

    def append_tokens(self, tokens: Sequence[int]) -> None:
        """Declare the next len(tokens) rows valid (the model wrote them)."""
        if self.length + len(tokens) > self.max_seq:
            raise KVCacheError(f"{self.length + len(tokens)} tokens exceed max_seq={self.max_seq}")
        self.tokens.extend(tokens)

    def before_write(self, layer: int, start: int) -> None:
        """The model is about to write rows [start, ...) of `layer`: wait for the guard if any."""
        if self.write_guard is not None:
            self.write_wait_s += self.write_guard(layer, start)

    def common_prefix(self, tokens: Sequence[int]) -> int:
        """Length of the longest common prefix between the cached ids and `tokens`."""
        return lcp(self.tokens, tokens)

    # ---- views ------------------------------------------------------------------------
    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) arrays of one layer, each (max_seq, kv_dim)."""
        return self.data[layer, K], self.data[layer, V]

    def rows(self, layer: int, kv: int, start: int, stop: int) -> np.ndarray:
        """Contiguous (stop-start, kv_dim) view of K (kv=0) or V (kv=1) rows of one layer."""
        if not 0 <= start <= stop <= self.max_seq:
            raise KVCacheError(f"rows [{start}, {stop}) outside [0, {self.max_seq})")
        return self.data[layer, kv, start:stop]


def _committed_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """Zeroed float32 array whose pages are all resident now.

    Committing up front makes the memory check meaningful (no OOM kill later) and keeps page
    faults off the restore path: the first restore after a restart would otherwise fault once per
    4 KiB it reads. MAP_POPULATE lets the kernel fault everything in one call (~5x faster here
    than touching pages from numpy); elsewhere we touch them.
    """
    nbytes = int(np.prod(shape)) * 4
    populate = getattr(mmap, "MAP_POPULATE", 0)
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    arr = np.frombuffer(buf, dtype=np.float32, count=nbytes // 4).reshape(shape)
    if not populate:
        arr.fill(0)
    return arr


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Longest common prefix length of two id sequences (numpy-vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n
