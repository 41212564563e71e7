"""The KV cache: preallocated F32 rows, the only owner of KV memory and of the rules for writing it.

Layout: one array `(n_layers, 2, max_seq, kv_dim)` float32 (axis 1: 0 = K, 1 = V). For a layer,
K rows `[a, b)` are one contiguous run of bytes, so a snapshot block can be read or written
straight from/into a row view without an intermediate copy.

Who may overwrite a row, and when (the one place that answers it):
- A snapshot save streams rows `[0, n)` to disk layer by layer, straight from this cache. It
  holds a `RowLease` from the moment it is queued; the lease reports each layer written out.
- The model writes new rows with `write` (rows `[start, start + T)` of one layer); the store
  restores rows with `restore_rows` (rows from 0 of one layer). Both first wait until no lease
  still has to write those rows of that layer, so a following request runs right behind a
  pending save instead of waiting for the whole file. Each layer the save finishes while we wait
  is progress (`Work.report`, stage save-wait); a cancel is honoured while waiting.
- A restore from disk writes rows from 0 of each layer. A pipelined restore takes a
  `RestoreLease` (`begin_restore`): the rows `[0, m)` are declared valid at once, but layer l is
  readable (`valid`) and writable (`write` of rows below the lease's end) only once the reader
  thread has read it and checked its block CRCs (`layer_ready`). So the model computes the tail
  on layer l while layer l+1 is still being read, and never sees a row that has not passed its
  CRC: if the reader fails (`fail`), every wait raises `RestoreFailed` and the engine resets the
  cache and recomputes. A sequential restore (`restore_rows`) takes no lease: nothing computes
  while it runs. A save may not be queued while a restore lease is active.
- Rows `[0, length)` are valid for `tokens`; rows beyond are garbage and may be overwritten.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import psutil

from edge_llm.config import Geometry
from edge_llm.errors import KVCacheError, RestoreFailed
from edge_llm.progress import NO_WORK, RESTORE, SAVE_WAIT, Work
from edge_llm.settings import DEFAULTS

log = logging.getLogger(__name__)

K, V = 0, 1
# leave this much RAM free after allocating the cache (OS, page cache for snapshots, the server)
MEMORY_HEADROOM = 256 * 1024 * 1024


@dataclass(frozen=True)
class ImageSpan:
    """One image's run of KV rows and its MRoPE grid (Qwen3-VL): rows [start, start + t*h*w).

    Row start + (i*h + j)*w + k sits at MRoPE position (pos0 + i, pos0 + j, pos0 + k); the text
    after the run continues at `next_pos` = pos0 + max(h, w), not at the row count.
    """

    start: int
    grid: tuple[int, int, int]  # (t, h, w) of the decoder tokens (patch grid after the merge)
    pos0: int
    digest: bytes  # sha256 of the preprocessed pixels + grid: what makes the rows this image's

    @property
    def length(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def next_pos(self) -> int:
        return self.pos0 + max(self.grid[1], self.grid[2])


def next_position(n: int, spans: Sequence[ImageSpan]) -> int:
    """MRoPE position of row n (text), given the image runs among rows [0, n)."""
    done = [s for s in spans if s.end <= n]
    if not done:
        return n
    last = max(done, key=lambda s: s.end)
    return last.next_pos + (n - last.end)


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
        # image runs among the valid rows (their token ids are image keys, see vision.positions)
        self.spans: list[ImageSpan] = []
        self._cond = threading.Condition()
        self._leases: list[RowLease] = []
        self._restore: RestoreLease | None = None  # a pipelined restore still filling layers
        self.write_wait_s = 0.0  # total time writers spent waiting for pending saves
        self.restore_wait_s = 0.0  # total time the model spent waiting for restored layers

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
        self.spans = [s for s in self.spans if s.start < m]

    def reset(self) -> None:
        self.tokens.clear()
        self.spans = []

    def set_tokens(self, tokens: Sequence[int], spans: Sequence[ImageSpan] = ()) -> None:
        """Declare rows [0, len(tokens)) valid for these ids (after a restore wrote the rows)."""
        if len(tokens) > self.max_seq:
            raise KVCacheError(f"{len(tokens)} tokens exceed max_seq={self.max_seq}")
        self.tokens = list(tokens)
        self.spans = [s for s in spans if s.start < len(tokens)]

    def add_spans(self, spans: Sequence[ImageSpan]) -> None:
        """Record image runs among rows the model wrote (or is about to write)."""
        known = {s.start for s in self.spans}
        self.spans += [s for s in spans if s.start not in known]
        self.spans.sort(key=lambda s: s.start)

    @property
    def next_pos(self) -> int:
        """MRoPE position of the next row (== length for text-only rows)."""
        return next_position(self.length, self.spans) if self.spans else self.length

    def append_tokens(self, tokens: Sequence[int]) -> None:
        """Declare the next len(tokens) rows valid (the model wrote them)."""
        if self.length + len(tokens) > self.max_seq:
            raise KVCacheError(f"{self.length + len(tokens)} tokens exceed max_seq={self.max_seq}")
        self.tokens.extend(tokens)

    # ---- writing rows (see the module docstring) ------------------------------------------
    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray, work: Work = NO_WORK) -> None:
        """Write K/V rows [start, start + T) of `layer` (k, v: (T, kv_dim)) once no save needs them."""
        stop = start + k.shape[0]
        if not 0 <= start <= stop <= self.max_seq:
            raise KVCacheError(f"rows [{start}, {stop}) outside [0, {self.max_seq})")
        self._wait_restored(layer, start, work)
        self._wait_free(layer, start, work)
        self.data[layer, K, start:stop] = k
        self.data[layer, V, start:stop] = v

    def restore_rows(self, layer: int, kv: int, work: Work = NO_WORK) -> np.ndarray:
        """The whole (max_seq, kv_dim) K or V array of `layer`, for a restore to read rows from 0
        into, once no save needs them. Call `reset()` first and `set_tokens()` after success."""
        self._wait_free(layer, 0, work)
        return self.data[layer, kv]

    def begin_restore(self, n_rows: int, tokens: Sequence[int], spans: Sequence[ImageSpan] = ()) -> "RestoreLease":
        """A pipelined restore of rows [0, n_rows) of every layer starts (n_rows >= len(tokens): whole
        blocks): the tokens are valid now, each layer becomes usable when the lease says so."""
        if not len(tokens) <= n_rows <= self.max_seq:
            raise KVCacheError(f"restore of {n_rows} rows for {len(tokens)} tokens outside [0, {self.max_seq}]")
        with self._cond:
            if self._restore is not None:
                raise KVCacheError("a restore is already in progress")
            self.set_tokens(tokens, spans)
            self._restore = lease = RestoreLease(self, n_rows)
        return lease

    def lease(self, n: int) -> "RowLease":
        """Protect rows [0, n) of every layer until the lease reports them written out."""
        if not 0 < n <= self.length:
            raise KVCacheError(f"lease of {n} rows outside (0, {self.length}]")
        with self._cond:
            if self._restore is not None:
                raise KVCacheError("cannot save rows while a restore is still filling them")
            lease = RowLease(self, n)
            self._leases.append(lease)
        return lease

    def _blocking(self, layer: int, start: int) -> "RowLease | None":
        return next((x for x in self._leases if x.n > start and x.layers_done <= layer), None)

    def _wait_free(self, layer: int, start: int, work: Work) -> None:
        with self._cond:
            if self._blocking(layer, start) is None:
                return
            t0 = time.monotonic()
            try:
                while (lease := self._blocking(layer, start)) is not None:
                    seen = lease.layers_done
                    self._cond.wait(0.25)  # wake now and then to honour a cancel
                    if lease.layers_done != seen:  # the save wrote a layer: real progress
                        work.report(SAVE_WAIT, lease.layers_done, self.geometry.n_layers)
                    else:
                        work.check(SAVE_WAIT)
            finally:
                self.write_wait_s += time.monotonic() - t0

    def _wait_restored(self, layer: int, start: int, work: Work) -> None:
        """Wait until a pipelined restore has read and checked `layer` (if it covers row `start`)."""
        with self._cond:
            r = self._restore
            if r is None or start >= r.n or layer < r.layers_ready:
                return
            t0 = time.monotonic()
            try:
                while r.error is None and r.active and layer >= r.layers_ready:
                    seen = r.layers_ready
                    self._cond.wait(0.25)  # wake now and then to honour a cancel
                    if r.layers_ready != seen:
                        work.report(RESTORE, r.layers_ready, self.geometry.n_layers)
                    else:
                        work.check(RESTORE)
                if r.error is not None:
                    raise RestoreFailed(f"restore failed at layer {r.layers_ready}: {r.error}") from r.error
            finally:
                self.restore_wait_s += time.monotonic() - t0

    def _restore_progress(self, lease: "RestoreLease", layers_ready: int | None = None,
                          error: BaseException | None = None, end: bool = False) -> None:
        with self._cond:
            if layers_ready is not None:
                lease.layers_ready = layers_ready
            if error is not None and lease.error is None:
                lease.error = error
            if end:
                lease.active = False
                if self._restore is lease:
                    self._restore = None
            self._cond.notify_all()

    def _lease_progress(self, lease: "RowLease", layers_done: int, release: bool = False) -> None:
        with self._cond:
            lease.layers_done = layers_done
            if release:
                lease.active = False
                self._leases = [x for x in self._leases if x.active]
            self._cond.notify_all()

    def common_prefix(self, tokens: Sequence[int]) -> int:
        """Length of the longest common prefix between the cached ids and `tokens`."""
        return lcp(self.tokens, tokens)

    # ---- views ------------------------------------------------------------------------
    def valid(self, layer: int, stop: int, work: Work = NO_WORK) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) rows [0, stop) of one layer for reading (attention), each (stop, kv_dim); waits
        for a pipelined restore to deliver the layer."""
        self._wait_restored(layer, 0, work)
        return self.data[layer, K, :stop], self.data[layer, V, :stop]

    def rows(self, layer: int, kv: int, start: int, stop: int) -> np.ndarray:
        """Contiguous (stop-start, kv_dim) view of K (kv=0) or V (kv=1) rows of one layer (read)."""
        if not 0 <= start <= stop <= self.max_seq:
            raise KVCacheError(f"rows [{start}, {stop}) outside [0, {self.max_seq})")
        return self.data[layer, kv, start:stop]


class RowLease:
    """A pending or running snapshot save's claim on rows [0, n) of every layer (`KVCache.lease`)."""

    def __init__(self, cache: KVCache, n: int):
        self.cache, self.n = cache, n
        self.layers_done = 0  # layers whose rows are written out: writers may overwrite them
        self.active = True

    def rows(self, layer: int, kv: int) -> np.ndarray:
        """The saver's read view: rows [0, n) of one layer's K or V."""
        return self.cache.data[layer, kv, :self.n]

    def layer_done(self, layers_done: int) -> None:
        """Layers [0, layers_done) are written out; wake writers waiting for them."""
        self.cache._lease_progress(self, layers_done)

    def release(self) -> None:
        """The save finished, failed or was superseded: the rows are free. Idempotent."""
        self.cache._lease_progress(self, self.cache.geometry.n_layers, release=True)


class RestoreLease:
    """A pipelined restore's hold on rows [0, n) of every layer (`KVCache.begin_restore`).

    The reader thread calls `layer_ready(l + 1)` after layer l's blocks passed their CRC checks and
    `fail(err)` on any error (every wait then raises RestoreFailed, until `end()`). Whoever
    started the restore calls `end()` once the reader has stopped and a failure was handled
    (the cache reset): a failed lease must keep blocking until then."""

    def __init__(self, cache: KVCache, n: int):
        self.cache, self.n = cache, n
        self.layers_ready = 0
        self.error: BaseException | None = None
        self.active = True

    def dest(self, layer: int, kv: int) -> np.ndarray:
        """The reader's write view: the whole (max_seq, kv_dim) K or V array of one layer. Only the
        reader writes it until the layer is declared ready."""
        return self.cache.data[layer, kv]

    def layer_ready(self, layers_ready: int) -> None:
        self.cache._restore_progress(self, layers_ready=layers_ready)

    def fail(self, error: BaseException) -> None:
        self.cache._restore_progress(self, error=error)

    def end(self) -> None:
        """The reader stopped and its outcome was handled. Idempotent."""
        self.cache._restore_progress(self, end=True)


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
