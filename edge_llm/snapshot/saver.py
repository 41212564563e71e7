"""Writing snapshots: background saves that write only the rows not on disk yet, and compaction.

`Saver` owns the store's writer thread (`writer.BackgroundWriter`). A save is deduped against
the index, written as a delta on the longest stored prefix (or as a full file when there is none
or its chain is at `max_chain`), published atomically, and then the files it covers are removed
and the caps applied (`catalog.py`). When no save came for `compact_idle` seconds, each chain is
rewritten as one full file under its tip's name. Every byte written is counted against the bytes
of KV that were new (the write budget, docs/store.md). I/O errors are logged and counted, never
raised to the request path.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from edge_llm.config import Geometry
from edge_llm.errors import SnapshotError
from edge_llm.kvcache import KVCache
from edge_llm.snapshot import chains
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot.catalog import Catalog
from edge_llm.snapshot.chain_read import ChainRead
from edge_llm.snapshot.entries import Entry, is_prefix, mbps
from edge_llm.snapshot.writer import BackgroundWriter, SaveJob, publish_file

log = logging.getLogger("edge_llm.kvdisk")


class Saver:
    """Saves and compaction of one namespace; see the module docstring."""

    def __init__(self, catalog: Catalog, geometry: Geometry, model_id: int, min_lcp: int, max_tokens: int,
                 kv_bs: int, max_chain: int, compact_idle: float | None):
        self.catalog, self.geometry, self.model_id = catalog, geometry, model_id
        self.min_lcp, self.max_tokens, self.kv_bs, self.max_chain = min_lcp, max_tokens, kv_bs, max_chain
        self.write_bps: float | None = None  # measured: moving average over saves (bytes / second)
        self.last_save: dict[str, Any] | None = None  # the latest save: bytes written vs new KV bytes
        self.writer = BackgroundWriter(self._save, idle=self._compact_idle, idle_after=compact_idle)

    # ---- the request side -----------------------------------------------------------------------
    def save_async(self, cache: KVCache) -> None:
        """Queue a snapshot of the cache's valid rows (capped at max_tokens); never raises I/O errors.

        Only the token ids are copied; the writer streams rows from the cache under a `RowLease`
        (taken here), so later writers wait for rows the save still needs (edge_llm/kvcache/cache.py).
        """
        n = min(cache.length, self.max_tokens)
        if n < self.min_lcp:  # could never be used: a hit needs >= min_lcp rows
            log.debug("[KV-DISK] not saving %d-token KV (below min_lcp %d)", n, self.min_lcp)
            return
        job = SaveJob(cache.lease(n), np.asarray(cache.tokens[:n], dtype=np.uint32),
                      tuple(s for s in cache.spans if s.start < n))
        try:
            superseded = self.writer.submit(job)
        except RuntimeError as e:  # closed (shutting down): a lost save is fine, an exception is not
            log.warning("[KV-DISK] save failed: %s", e)
            return
        if superseded is not None:
            self.catalog.count(saves_superseded=1)

    def flush_with_progress(self, on_step: Callable[[str], None], stall_s: float) -> bool:
        """At shutdown: wait for the pending save as long as it makes progress (a layer written
        within `stall_s` seconds), calling `on_step(text)` on each; False if it stalled."""
        last, last_t = None, time.monotonic()
        while not self.writer.flush(timeout=0.5):
            now, state = time.monotonic(), self.writer.progress_of_pending()
            if state != last:
                last, last_t = state, now
                if state is not None:
                    on_step(f"flushing a {state[0]}-token snapshot: layer {state[1]}/{self.geometry.n_layers} written")
            elif now - last_t > stall_s:
                log.error("[KV-DISK] the pending save made no progress for %.0f s: giving up", stall_s)
                return False
        return True

    def predicted_save_s(self, n_tokens: int) -> float | None:
        """Seconds to write an n-token snapshot at this disk's measured write speed (None before
        the first save; an upper bound: a delta writes fewer rows)."""
        rate = self.write_bps
        if not rate:
            return None
        return fmt.snapshot_size(self.geometry.n_layers, n_tokens, self.geometry.kv_dim, self.kv_bs) / rate

    # ---- the writer thread ------------------------------------------------------------------------
    def _save(self, job: SaveJob) -> None:
        """Dedupe, write a delta on the longest stored prefix (or a full file when there is none or
        its chain is at max_chain), publish, drop what it covers, evict. Only a file still there
        counts as stored (`Catalog.still_there` on the one it would skip for, or the chain of its
        base: a file removed under us is written again)."""
        cat, tokens, n = self.catalog, job.tokens, job.n
        while True:
            with cat.lock:
                covering = [e for e in cat.index.values() if is_prefix(tokens, e.tokens)]
                e = max(covering, key=lambda c: c.n_tokens) if covering else None
                base = None if covering else chains.best_base(cat.index, tokens, 1)
                base_chain = chains.chain_of(cat.index, base) if base is not None else []  # best_base: readable
            if cat.still_there([e] if e is not None else base_chain):
                break
        depth = len(base_chain)
        if e is not None:  # identical, or a prefix of a stored one: any hit it gives, that one gives too
            cat.touch(e)
            cat.count(saves_skipped=1)
            how = "already stored" if e.n_tokens == n else f"prefix of {e.name}"
            log.info("[KV-DISK] skipped %d-token KV -> %s (%s)", n, e.name, how)
            return
        known = 0 if base is None else base.n_tokens  # rows already on disk: not new KV, even if rewritten
        if base is not None and depth + 1 > self.max_chain:  # bound the chain: one full file instead
            log.info("[KV-DISK] chain of %s has %d file(s) (max_chain %d): writing %d tokens as one file",
                     base.name, depth, self.max_chain, n)
            base = None
        ref = None if base is None else fmt.BaseRef(base.n_tokens, base.trailer_crc, base.tokens_fnv)
        fnv = fmt.fnv1a64(tokens.astype("<u4").tobytes())
        name = fmt.snapshot_name(fnv)
        size = fmt.snapshot_size(self.geometry.n_layers, n, self.geometry.kv_dim, self.kv_bs,
                                 len(fmt.encode_extension(job.spans, ref)), 0 if ref is None else ref.n_tokens)
        if cat.max_bytes is not None and size > cat.max_bytes:
            log.info("[KV-DISK] skipped %d-token KV -> %s (%d bytes exceed max_bytes %d)",
                     n, name, size, cat.max_bytes)
            cat.count(saves_skipped=1)
            return
        try:
            cat.ensure_dir()  # its namespace directory removed under us: made again, then written
        except OSError as e:
            self._save_failed(name, n, e)
            return
        cat.make_room(size, keep=None if base is None else base.name)
        t0 = time.monotonic()
        try:
            written, trailer_crc = self._write(job, name, fnv, size, ref)
        except (OSError, ValueError) as e:
            self._save_failed(name, n, e)
            return
        secs = time.monotonic() - t0
        entry = Entry(name, cat.ns / name, tokens, written, time.time(), job.spans, ref, trailer_crc)
        # its first use, mirrored into the mtime as every later one: the file's own mtime is its last
        # write's, before the fsyncs, and would lag the index by them on a slow disk
        cat.touch(entry)
        new_kv = (n - known) * self.geometry.kv_bytes_per_token
        with cat.lock:
            cat.index[name] = entry
            cat.count(saves=1, saves_delta=int(ref is not None), bytes_written=written, new_kv_bytes=new_kv)
            cat.degraded.clear()
            rate = written / max(secs, 1e-6)
            self.write_bps = rate if self.write_bps is None else 0.7 * self.write_bps + 0.3 * rate
            self.last_save = {"name": name, "tokens": n, "new_rows": n - known, "bytes": written,
                              "new_kv_bytes": new_kv, "base": None if ref is None else ref.name}
            orphaned = ref is not None and ref.name not in cat.index  # base gone meanwhile (quarantined)
        cat.io.add(cat.ns, written, new_kv)
        delta = (f"; delta on {ref.name}: {n - known} new rows, written/new KV {written / new_kv:.3f}"
                 if ref is not None else (f"; {n - known} new rows, written/new KV {written / new_kv:.3f}"
                                          if known else ""))
        log.info("[KV-DISK] saved %d-token KV -> %s (%d bytes, %.1f ms, %.1f MB/s)%s",
                 n, name, written, secs * 1e3, mbps(written, secs), delta)
        if orphaned:
            cat.drop_quarantined(entry, f"base-missing: base {ref.name} was removed during the save")
            return
        cat.drop_redundant("replaced by {}, which extends it")
        cat.evict(keep=name)

    def _write(self, job: SaveJob, name: str, fnv: int, size: int, ref: fmt.BaseRef | None) -> tuple[int, int]:
        """Stream the job's rows into a published file; (bytes written, trailer CRC)."""
        lease, n_layers = job.lease, self.geometry.n_layers

        def rows(layer: int, kv: int):
            if kv == 0:  # asked for layer l's rows: layers < l are written, their rows are free
                lease.layer_done(layer)
            return lease.rows(layer, kv)

        done: list[fmt.SnapshotWriter] = []

        def write(f) -> int:
            w = fmt.SnapshotWriter(f, job.tokens, self.model_id, self.geometry, self.kv_bs, fnv, job.spans, ref)
            w.begin()
            for layer in range(n_layers):
                w.write_layer(layer, rows(layer, 0), rows(layer, 1))
            lease.layer_done(n_layers)  # before the fsync: the rows are in the file now
            done.append(w)
            return w.finish()

        written = publish_file(self.catalog.ns, name, size, write, self.catalog.modes)
        return written, done[0].hdr.trailer_crc

    def _save_failed(self, name: str, n: int, err: Exception) -> None:
        code = getattr(err, "errno", None)
        kind, msg = {errno.ENOSPC: ("disk_full", "snapshot disk full"),
                     errno.EDQUOT: ("disk_full", "snapshot disk quota exceeded"),
                     errno.EIO: ("io_error", "snapshot disk I/O error")}.get(
            code, ("save_failed", f"snapshot save failed: {err}"))
        self.catalog.count(save_failures=1)
        with self.catalog.lock:
            self.catalog.degraded[kind] = msg
        log.error("[KV-DISK] save failed: %d-token KV -> %s: %s (%s)", n, name, err, msg)

    # ---- compaction -------------------------------------------------------------------------------
    def _compact_idle(self, should_stop: Callable[[], bool]) -> None:
        """Writer thread, idle for compact_idle seconds: rewrite each chain as one full file."""
        self.catalog.present()  # a chain whose file was removed under us is not compacted
        while not should_stop():
            with self.catalog.lock:
                todo = chains.compaction_candidates(self.catalog.index, 2)
            if not todo or not self.compact(todo[0], should_stop):
                return

    def compact(self, tip: Entry, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Rewrite `tip` (no delta depends on it) as one full file under the same name: temp file,
        rows read from its chain (every block CRC-checked), fsync, rename over the tip. Then the
        files below it that nothing else needs are removed. False if stopped or failed."""
        cat = self.catalog
        try:
            chain = cat.chain(tip)
            reader = ChainRead(chain, tip.n_tokens, self.geometry, self.model_id, tip.n_tokens)
        except (SnapshotError, OSError) as err:
            log.warning("[KV-DISK] compaction of %s skipped: %s", tip.name, err)
            return False
        size = fmt.snapshot_size(self.geometry.n_layers, tip.n_tokens, self.geometry.kv_dim, self.kv_bs,
                                 len(fmt.encode_extension(tip.spans)))
        t0 = time.monotonic()
        try:
            done: list[fmt.SnapshotWriter] = []
            written = publish_file(cat.ns, tip.name, size, lambda f: write_compacted(
                f, reader, tip, self.geometry, self.model_id, self.kv_bs, should_stop, done), cat.modes)
            trailer_crc = done[0].hdr.trailer_crc
        except InterruptedError:
            log.info("[KV-DISK] compaction of %s interrupted by a save", tip.name)
            return False
        except (OSError, ValueError, SnapshotError) as err:
            log.warning("[KV-DISK] compaction of %s failed: %s", tip.name, err)
            return False
        finally:
            reader.close()
        with cat.lock:
            cat.index[tip.name] = Entry(tip.name, tip.path, tip.tokens, written, tip.last_use, tip.spans,
                                        None, trailer_crc)
            cat.count(compactions=1, bytes_written=written, compaction_bytes_written=written)
        cat.io.add(cat.ns, written, 0)
        os.utime(tip.path, (tip.last_use, tip.last_use))
        log.info("[KV-DISK] compacted %d files -> %s (%d tokens, %d bytes, %.1f ms)", len(chain), tip.name,
                 tip.n_tokens, written, (time.monotonic() - t0) * 1e3)
        cat.drop_redundant("compacted into {}")
        return True


def write_compacted(f, reader: ChainRead, tip: Entry, geometry: Geometry, model_id: int, kv_bs: int,
                    should_stop, done: list) -> int:
    """Write the chain's rows [0, n) as one full file, layer by layer through one reused buffer
    (every block CRC-checked on the way in). Raises InterruptedError if should_stop() turns true
    between layers (a save arrived: it goes first). Appends the finished writer to `done`."""
    n = tip.n_tokens
    buf = np.empty((2, n + kv_bs, geometry.kv_dim), np.float32)  # + kv_bs: whole-block reads
    w = fmt.SnapshotWriter(f, tip.tokens, model_id, geometry, kv_bs, tip.tokens_fnv, tip.spans)
    w.begin()
    for layer in range(geometry.n_layers):
        if should_stop():
            raise InterruptedError("a save is waiting")
        reader.read_layer(layer, buf[0], buf[1])
        w.write_layer(layer, buf[0], buf[1])
    done.append(w)
    return w.finish()
