"""The KV cache: preallocated F32 rows, the only owner of KV memory and of the rules for writing it.

Layout: one array `(n_layers, 2, max_seq, kv_dim)` float32 (axis 1: 0 = K, 1 = V). For a layer,
K rows `[a, b)` are one contiguous run of bytes, so a snapshot block can be read or written
straight from/into a row view without an intermediate copy.

Who may overwrite a row, and when (the one place that answers it):
- A snapshot save streams rows `[0, n)` to disk layer by layer, straight from this cache. It
  holds a `RowLease` from the moment it is queued; the lease reports each layer written out.
- The model writes new rows with `write` (rows `[start, start + T)` of one layer); a restore
  rewrites rows from 0 of one layer. Both first wait until no lease
  still has to write those rows of that layer, so a following request runs right behind a
  pending save instead of waiting for the whole file. Each layer the save finishes while we wait
  is progress (`Work.report`, stage save-wait); a cancel is honoured while waiting.
- A restore from disk rewrites rows from 0 of each layer, and the cache runs it (`restore`):
  the store hands it a `RowSource` (an opened, validated snapshot chain) and gets one handle
  back, `Restore`, whose `finish()` is the only way a restore's failure comes out. Pipelined, the
  rows `[0, m)` are declared valid at once, but layer l is readable (`valid`) and writable (`write`
  of rows below the restore's end) only once the reader thread has read it and checked its block
  CRCs. So the model computes the tail on layer l while layer l+1 is still being read, and never
  sees a row that has not passed its CRC: `finish(behind=tail)` runs the tail behind the reader,
  and if the reader fails the tail is abandoned at its next wait, the cache reset, and the
  source's error raised. Sequential, `finish` reads every layer first (nothing computes
  meanwhile). A save may not be queued while a pipelined restore is active.
- Rows `[0, length)` are valid for `tokens`; rows beyond are garbage and may be overwritten.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import psutil

from edge_llm.config import Geometry
from edge_llm.errors import KVCacheError, SnapshotError
from edge_llm.progress import NO_WORK, RESTORE, SAVE_WAIT, Cancelled, Work
from edge_llm.kvcache.records import ImageSpan, Restored, RowSource, lcp, next_position
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
        # image runs among the valid rows (their token ids are image keys, see vision.positions)
        self.spans: list[ImageSpan] = []
        self._cond = threading.Condition()
        self._leases: list[RowLease] = []
        self._restore: Restore | None = None  # a pipelined restore still filling layers
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

    def restore(self, source: "RowSource", pipelined: bool, work: Work = NO_WORK) -> "Restore":
        """Rewrite rows [0, len(source.tokens)) from `source`; the rows are this cache's tokens once the
        handle's `finish()` returned (module docstring). Pipelined, the reader starts now."""
        return Restore(self, source, pipelined, work)

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
                if r.error is not None and layer >= r.layers_ready:  # abandoned: Restore.finish raises
                    raise _ReaderFailed from r.error
            finally:
                self.restore_wait_s += time.monotonic() - t0

    def _restore_progress(self, r: "Restore", layers_ready: int | None = None,
                          error: BaseException | None = None, end: bool = False) -> None:
        with self._cond:
            if layers_ready is not None:
                r.layers_ready = layers_ready
            if error is not None and r.error is None:
                r.error = error
            if end:
                r.active = False
                if self._restore is r:
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


T = TypeVar("T")
PIPELINED, SEQUENTIAL = "pipelined", "sequential"


class _ReaderFailed(Exception):
    """Raised by a wait on a layer the failed reader never delivered; caught by `Restore.finish`."""


class Restore:
    """One restore of rows [0, len(source.tokens)) into the cache (`KVCache.restore`); see the module docstring.

    Pipelined, one reader thread fills the cache layer by layer and `layer l` becomes usable as soon
    as it is read and checked; sequential, `finish` reads every layer before anything computes."""

    def __init__(self, cache: KVCache, source: RowSource, pipelined: bool, work: Work):
        if not len(source.tokens) <= source.rows_needed <= cache.max_seq:
            raise KVCacheError(f"restore of {source.rows_needed} rows for {len(source.tokens)} tokens "
                               f"outside [0, {cache.max_seq}]")
        self.cache, self.source, self.work = cache, source, work
        self.mode = PIPELINED if pipelined else SEQUENTIAL
        self.n = source.rows_needed  # rows a pipelined restore holds (waits below it)
        self.layers_ready, self.error, self.active = 0, None, pipelined
        self.nbytes, self.read_s = 0, 0.0
        self._w0 = cache.write_wait_s
        self._thread: threading.Thread | None = None
        with cache._cond:
            if cache._restore is not None:  # checked before a row is given up
                raise KVCacheError("a restore is already in progress")
            cache.reset()  # from here on the rows are being rewritten from 0
            if pipelined:
                cache.set_tokens(source.tokens, source.spans)
                cache._restore = self
        if pipelined:
            # the reader only honours a cancel: progress is reported by the waits of the tail
            self._thread = threading.Thread(target=self._read, args=(Work(cancel=work.cancel), True),
                                            name="kv-disk-reader", daemon=True)
            self._thread.start()

    def _read(self, work: Work, pipelined: bool) -> None:
        t0, n_layers = time.monotonic(), self.cache.geometry.n_layers
        try:
            for layer in range(n_layers):
                work.check(RESTORE, layer, n_layers)
                self.cache._wait_free(layer, 0, work)  # a pending save of these rows goes first
                self.nbytes += self.source.read_layer(layer, self.cache.data[layer, K], self.cache.data[layer, V])
                if pipelined:
                    self.cache._restore_progress(self, layers_ready=layer + 1)
                else:
                    work.report(RESTORE, layer + 1, n_layers)
        except BaseException as e:  # noqa: BLE001 - raised again by finish() in the request thread
            self.error = e
            if pipelined:
                self.cache._restore_progress(self, error=e)
        finally:
            self.read_s = time.monotonic() - t0
            self.source.close()

    def finish(self, behind: Callable[[], T] | None = None) -> T | None:
        """Complete the restore, running `behind()` (the tail's prefill) behind a pipelined reader
        or after a sequential one, and return what it returned. The only failure channel: the
        source's SnapshotError (the cache is reset, the bad file quarantined), or `Cancelled`
        (reset too unless every row was read). `self.restored` says what was read."""
        out, cancelled = None, None
        try:
            if self._thread is None:
                self._read(self.work, False)
                if self.error is None:
                    self.cache.set_tokens(self.source.tokens, self.source.spans)
            if self.error is None:
                try:
                    out = behind() if behind is not None else None
                except _ReaderFailed:
                    pass  # the reader's own error follows
                except Cancelled as c:
                    cancelled = c  # the rows read stay valid if the reader finished
        finally:
            if self._thread is not None:
                self._thread.join()
                self.cache._restore_progress(self, end=True)
        if self.error is not None:
            self.cache.reset()
            err = self.error
            if isinstance(err, (SnapshotError, OSError)):  # quarantine, also if the request was cancelled
                err = self.source.failed(err)
                err.__cause__ = self.error if err is not self.error else None
            raise cancelled or err
        waited = self.cache.write_wait_s - self._w0
        self.restored = Restored(len(self.source.tokens), self.nbytes, max(self.read_s - waited, 0.0) * 1e3, waited * 1e3, self.mode,
                                 self.source.name, len(self.source.files))
        self.source.done(self.restored)
        if cancelled is not None:
            raise cancelled
        return out


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
