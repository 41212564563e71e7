"""The snapshot store of one identity namespace (docs/store.md).

`<kv-dir>/<model_id hex>/kv_<tokens_fnv hex>.kv` files, indexed at start-up from their headers and
token ids only; LCP lookup; restore of a file's chain straight into the KV cache arrays
(sequential, or pipelined by layer); background saves with atomic publish that write only the
rows a stored file does not hold (a delta on it), compaction of long or idle chains, dedupe, LRU
eviction of whole chains, quarantine of bad files and of deltas whose base is gone. Faults
(ENOSPC, EIO, corrupt files) are logged and counted and never reach the request path except as a
restore failure, after which the engine recomputes. The chain policies are `chains.py`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from edge_llm.config import Geometry
from edge_llm.errors import SnapshotChainError, SnapshotError
from edge_llm.kvcache import KVCache
from edge_llm.progress import NO_WORK, RESTORE, Cancelled, Work
from edge_llm.settings import DEFAULTS
from edge_llm.snapshot import chains
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot.identity import Identity, ensure_namespace
from edge_llm.snapshot.index import (
    Entry,
    Hit,
    IOStats,
    RestoreResult,
    is_prefix,
    lcp,
    mbps,
    quarantine_file,
)
from edge_llm.snapshot.restore import READ_MAX_TOKENS, ChainRead, ChainReadError, PipelinedRestore, write_compacted
from edge_llm.snapshot.writer import (
    TMP_SUFFIX,
    BackgroundWriter,
    Modes,
    SaveJob,
    fsync_dir,
    orphaned_temp,
    publish_file,
)

log = logging.getLogger("edge_llm.kvdisk")


class SnapshotStore:
    """Snapshots of one identity under `<kv_dir>/<model_id hex>/`; see the module docstring."""

    def __init__(self, kv_dir: str | Path, identity: Identity, geometry: Geometry,
                 min_lcp: int = DEFAULTS.disk_kv_min_lcp, max_files: int = DEFAULTS.disk_kv_max_files,
                 max_bytes: int | None = DEFAULTS.disk_kv_max_bytes,
                 max_tokens: int = DEFAULTS.disk_kv_max_tokens, kv_bs: int = DEFAULTS.kv_bs,
                 max_chain: int = DEFAULTS.disk_kv_max_chain,
                 compact_idle: float | None = DEFAULTS.disk_kv_compact_idle,
                 group_read: bool = DEFAULTS.disk_kv_group_read):
        if min_lcp < 1 or max_files < 1 or max_tokens < 1 or kv_bs < 1 or max_chain < 1:
            raise ValueError("min_lcp, max_files, max_tokens, kv_bs and max_chain must be >= 1")
        self.identity, self.geometry = identity, geometry
        self.model_id = identity.model_id
        self.min_lcp, self.max_files, self.max_bytes = min_lcp, max_files, max_bytes
        self.max_tokens, self.kv_bs, self.max_chain = max_tokens, kv_bs, max_chain
        self.modes = Modes(group_read)
        self.ns = ensure_namespace(kv_dir, identity, self.modes)
        self._lock = threading.RLock()
        self._index: dict[str, Entry] = {}
        self._counters = dict(saves=0, saves_delta=0, save_failures=0, saves_skipped=0, saves_superseded=0,
                              loads=0, load_failures=0, rejections=0, evictions=0, compactions=0,
                              bytes_written=0, new_kv_bytes=0, compaction_bytes_written=0, bytes_read=0)
        self.io = IOStats.load(self.ns)  # bytes written to this namespace across restarts (`kv ls`)
        self._degraded: dict[str, str] = {}  # kind -> message; cleared by the next successful save
        self.write_bps: float | None = None  # measured: moving average over saves (bytes / second)
        self.last_save: dict[str, Any] | None = None  # the latest save: bytes written vs new KV bytes
        self._writer = BackgroundWriter(self._save, idle=self._compact_idle, idle_after=compact_idle)

    # ---- index ------------------------------------------------------------------------------
    def scan(self) -> int:
        """Index the namespace from headers + token ids (no payload); quarantine bad files and
        deltas whose base is gone; remove files a kill left behind."""
        t0 = time.monotonic()
        for tmp in self.ns.glob("*" + TMP_SUFFIX):  # debris of killed writers, not a live one's file
            if orphaned_temp(tmp, self._writer.busy):
                self._unlink(tmp, "leftover temp file")
        entries, rejected = {}, 0
        for path in sorted(self.ns.glob("kv_*.kv")):
            try:
                entry = self._read_entry(path)
            except (SnapshotError, OSError) as e:
                self._quarantine(path, _reason(e))
                rejected += 1
                continue
            entries[entry.name] = entry
        with self._lock:
            self._index = entries
        # a delta without its base (deleted, corrupt, replaced by other rows) is a miss: quarantined
        while bad := chains.broken(self._index):
            for e, err in bad:
                self._drop_quarantined(e, _reason(err))
                rejected += 1
        # a kill between publishing a file and removing what it extends or compacts leaves extra files
        self._drop_redundant("replaced by {}, which extends it")
        self.evict()
        extra = f", {rejected} rejected" if rejected else ""
        log.info("[KV-DISK] index: %d checkpoint(s)%s (%s, %.1f ms)", len(self._index), extra, self.ns.name,
                 (time.monotonic() - t0) * 1e3)
        return len(self._index)

    def _read_entry(self, path: Path) -> Entry:
        with open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            hdr, tokens = fmt.read_header(f, self.geometry, self.model_id, READ_MAX_TOKENS, st.st_size)
        if fmt.snapshot_name(hdr.tokens_fnv) != path.name:
            raise SnapshotError(f"file name does not match its tokens hash {hdr.tokens_fnv:016x}")
        return Entry(path.name, path, tokens, st.st_size, st.st_mtime, hdr.spans, hdr.base, hdr.trailer_crc)

    def entries(self) -> list[Entry]:
        """Indexed snapshots, most recently used first."""
        with self._lock:
            return sorted(self._index.values(), key=lambda e: e.last_use, reverse=True)

    def chain(self, entry: Entry) -> list[Entry]:
        """The files a restore of `entry` reads, root first (SnapshotChainError if broken)."""
        with self._lock:
            return chains.chain_of(self._index, entry)

    # ---- lookup / restore ---------------------------------------------------------------------
    def lookup(self, tokens: Any) -> Hit | None:
        """Best snapshot for a request: longest common prefix, >= min_lcp, at most len - 1 rows."""
        req = np.asarray(tokens, dtype=np.int64)
        if req.ndim != 1 or req.shape[0] < 2 or req.min() < 0 or req.max() > 0xFFFFFFFF:
            return None
        req = req.astype(np.uint32)
        limit = req.shape[0] - 1  # at least one token is prefilled: it yields the logits
        best: Hit | None = None
        with self._lock:
            for e in self._index.values():
                m = min(lcp(req, e.tokens), limit)
                if m >= self.min_lcp and (best is None or m > best.m
                                          or (m == best.m and e.last_use > best.entry.last_use)):
                    best = Hit(e, m)
        return best

    def open_chain(self, hit: Hit, cache: KVCache) -> ChainRead:
        """Open and validate the files a restore of hit.m rows reads (header reads only). Raises
        SnapshotError after quarantining what is bad (the request then recomputes)."""
        if cache.geometry != self.geometry:
            raise ValueError(f"cache geometry {cache.geometry} != store geometry {self.geometry}")
        try:
            chain = self.chain(hit.entry)
            return ChainRead(chain, hit.m, self.geometry, self.model_id, cache.max_seq)
        except (SnapshotError, OSError) as err:
            cache.reset()  # the contract of a failed restore, though no row was touched yet
            self._restore_failed(hit.entry, err)
            raise AssertionError("unreachable")  # pragma: no cover

    def restore(self, hit: Hit, cache: KVCache, work: Work = NO_WORK) -> RestoreResult:
        """Sequential restore: read rows [0, hit.m) of the hit's chain into `cache`, set its tokens.

        Each layer read is reported to `work` (stage restore) and a cancel is honoured between
        layers (`Cancelled` propagates; the cache is then reset). Raises SnapshotError (the
        subclass names the reason) if a file is bad or unreadable: the cache is then reset (its
        rows are garbage), the file (and the deltas on it) quarantined, and the caller recomputes.
        """
        reader = self.open_chain(hit, cache)
        w0 = cache.write_wait_s
        cache.reset()  # from here on the rows are being rewritten from 0
        t0, nbytes, n_layers = time.monotonic(), 0, self.geometry.n_layers
        try:
            for layer in range(n_layers):
                nbytes += reader.read_layer(layer, cache.restore_rows(layer, 0, work),
                                            cache.restore_rows(layer, 1, work))
                work.report(RESTORE, layer + 1, n_layers)
        except Cancelled:
            cache.reset()
            raise
        except (SnapshotError, OSError) as err:
            cache.reset()
            self._restore_failed(hit.entry, err)
        finally:
            reader.close()
        cache.set_tokens(hit.entry.tokens[:reader.m].tolist(), hit.entry.spans)
        waited = cache.write_wait_s - w0  # for a pending save of the same rows, per layer
        return self._restored(hit.entry, reader, nbytes, time.monotonic() - t0 - waited, waited)

    def restore_pipelined(self, hit: Hit, cache: KVCache, work: Work = NO_WORK) -> "PendingRestore":
        """Start a pipelined restore: returns at once with rows [0, m) declared valid; each layer
        becomes usable to the model when the reader thread has read and checked it
        (edge_llm/kvcache.py). The caller computes the tail, then calls `finish()`."""
        reader = self.open_chain(hit, cache)
        cache.reset()
        job = PipelinedRestore(reader, cache, hit.entry.tokens[:reader.m].tolist(), hit.entry.spans, work)
        return PendingRestore(self, hit, reader, job, cache)

    def _restored(self, e: Entry, reader: ChainRead, nbytes: int, secs: float, waited: float) -> RestoreResult:
        res = RestoreResult(reader.m, nbytes, secs * 1e3, mbps(nbytes, secs), e.name, waited * 1e3,
                            files=len(reader.parts))
        with self._lock:
            members = [self._index[n] for n in reader.files if n in self._index]
        for m in members:
            self._touch(m)
        with self._lock:
            self._counters["loads"] += 1
            self._counters["bytes_read"] += nbytes
        chain = f" ({len(reader.parts)} files)" if len(reader.parts) > 1 else ""
        log.info("[KV-DISK] loaded %d-token KV prefix from disk file %s (%d bytes, %.1f ms, %.1f MB/s)%s",
                 reader.m, e.name, nbytes, res.ms, res.mbps, chain)
        return res

    def _restore_failed(self, e: Entry, err: BaseException) -> None:
        """Count, quarantine the bad file and every delta on it, raise SnapshotError."""
        bad = err.entry if isinstance(err, ChainReadError) else e
        cause = err.err if isinstance(err, ChainReadError) else err
        with self._lock:
            self._counters["load_failures"] += 1
        if isinstance(cause, FileNotFoundError):
            log.warning("[KV-DISK] rejected %s: file vanished (%s)", bad.name, cause)
            with self._lock:
                self._index.pop(bad.name, None)
            self._drop_descendants(bad, f"base-missing: base {bad.name} vanished")
            raise SnapshotError(f"{bad.name}: file vanished") from err
        if isinstance(cause, SnapshotChainError):
            self._drop_quarantined(bad, _reason(cause))
            raise cause
        self._drop_quarantined(bad, _reason(cause))
        if isinstance(cause, SnapshotError):
            raise cause
        raise SnapshotError(f"{bad.name}: read failed: {cause}") from err

    # ---- saving ---------------------------------------------------------------------------------
    def save_async(self, cache: KVCache) -> None:
        """Queue a snapshot of the cache's valid rows (capped at max_tokens); never raises I/O errors.

        Only the token ids are copied; the writer streams rows from the cache under a `RowLease`
        (taken here), so later writers wait for rows the save still needs (edge_llm/kvcache.py).
        """
        n = min(cache.length, self.max_tokens)
        if n < self.min_lcp:  # could never be used: a hit needs >= min_lcp rows
            log.debug("[KV-DISK] not saving %d-token KV (below min_lcp %d)", n, self.min_lcp)
            return
        job = SaveJob(cache.lease(n), np.asarray(cache.tokens[:n], dtype=np.uint32),
                      tuple(s for s in cache.spans if s.start < n))
        try:
            superseded = self._writer.submit(job)
        except RuntimeError as e:  # closed (shutting down): a lost save is fine, an exception is not
            log.warning("[KV-DISK] save failed: %s", e)
            return
        if superseded is not None:
            with self._lock:
                self._counters["saves_superseded"] += 1

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the pending save (e.g. at SIGTERM); False on timeout."""
        return self._writer.flush(timeout)

    def flush_with_progress(self, on_step, stall_s: float) -> bool:
        """At shutdown: wait for the pending save as long as it makes progress (a layer written
        within `stall_s` seconds), calling `on_step(text)` on each; False if it stalled."""
        last, last_t = None, time.monotonic()
        while not self._writer.flush(timeout=0.5):
            now, state = time.monotonic(), self._writer.progress_of_pending()
            if state != last:
                last, last_t = state, now
                if state is not None:
                    on_step(f"flushing a {state[0]}-token snapshot: layer {state[1]}/{self.geometry.n_layers} written")
            elif now - last_t > stall_s:
                log.error("[KV-DISK] the pending save made no progress for %.0f s: giving up", stall_s)
                return False
        return True

    def pending_tokens(self) -> int:
        """Rows of the running or queued save (0 if none)."""
        state = self._writer.progress_of_pending()
        return 0 if state is None else state[0]

    def predicted_save_s(self, n_tokens: int) -> float | None:
        """Seconds to write an n-token snapshot at this disk's measured write speed (None before
        the first save; an upper bound: a delta writes fewer rows)."""
        rate = self.write_bps
        if not rate:
            return None
        return fmt.snapshot_size(self.geometry.n_layers, n_tokens, self.geometry.kv_dim, self.kv_bs) / rate

    def close(self, timeout: float | None = None) -> bool:
        """Finish the pending save and stop the writer thread."""
        return self._writer.close(timeout)

    def _save(self, job: SaveJob) -> None:
        """Writer thread: dedupe, write a delta on the longest stored prefix (or a full file when
        there is none or its chain is at max_chain), publish, drop what it covers, evict."""
        tokens, n = job.tokens, job.n
        with self._lock:
            covering = [e for e in self._index.values() if is_prefix(tokens, e.tokens)]
            base = None if covering else chains.best_base(self._index, tokens, 1)
            depth = chains.depth(self._index, base) if base is not None else 0
        if covering:  # identical, or a prefix of a stored one: any hit it gives, that one gives too
            e = max(covering, key=lambda c: c.n_tokens)
            self._touch(e)
            with self._lock:
                self._counters["saves_skipped"] += 1
            how = "already stored" if e.n_tokens == n else f"prefix of {e.name}"
            log.info("[KV-DISK] skipped %d-token KV -> %s (%s)", n, e.name, how)
            return
        known = 0 if base is None else base.n_tokens  # rows already on disk: not new KV, even if rewritten
        if base is not None and depth + 1 > self.max_chain:  # bound the chain: one full file instead
            log.info("[KV-DISK] chain of %s has %d file(s) (max_chain %d): writing %d tokens as one file",
                     base.name, depth, self.max_chain, n)
            base = None
        ref = None if base is None else fmt.BaseRef(base.n_tokens, base.trailer_crc, base.tokens_fnv)
        fnv = _fnv(tokens)
        name = fmt.snapshot_name(fnv)
        size = fmt.snapshot_size(self.geometry.n_layers, n, self.geometry.kv_dim, self.kv_bs,
                                 len(fmt.encode_extension(job.spans, ref)), 0 if ref is None else ref.n_tokens)
        if self.max_bytes is not None and size > self.max_bytes:
            log.info("[KV-DISK] skipped %d-token KV -> %s (%d bytes exceed max_bytes %d)",
                     n, name, size, self.max_bytes)
            with self._lock:
                self._counters["saves_skipped"] += 1
            return
        self._make_room(size, keep=None if base is None else base.name)
        lease, n_layers = job.lease, self.geometry.n_layers

        def rows(layer: int, kv: int):
            if kv == 0:  # asked for layer l's rows: layers < l are written, their rows are free
                lease.layer_done(layer)
            return lease.rows(layer, kv)

        done: list[fmt.SnapshotWriter] = []

        def write(f) -> int:
            w = fmt.SnapshotWriter(f, tokens, self.model_id, self.geometry, self.kv_bs, fnv, job.spans, ref)
            w.begin()
            for layer in range(n_layers):
                w.write_layer(layer, rows(layer, 0), rows(layer, 1))
            lease.layer_done(n_layers)  # before the fsync: the rows are in the file now
            done.append(w)
            return w.finish()

        t0 = time.monotonic()
        try:
            written = publish_file(self.ns, name, size, write, self.modes)
            trailer_crc = done[0].hdr.trailer_crc
        except (OSError, ValueError) as e:
            self._save_failed(name, n, e)
            return
        secs = time.monotonic() - t0
        entry = Entry(name, self.ns / name, tokens, written, time.time(), job.spans, ref, trailer_crc)
        new_kv = (n - known) * self.geometry.kv_bytes_per_token
        with self._lock:
            self._index[name] = entry
            self._counters["saves"] += 1
            self._counters["saves_delta"] += ref is not None
            self._counters["bytes_written"] += written
            self._counters["new_kv_bytes"] += new_kv
            self._degraded.clear()
            rate = written / max(secs, 1e-6)
            self.write_bps = rate if self.write_bps is None else 0.7 * self.write_bps + 0.3 * rate
            self.last_save = {"name": name, "tokens": n, "new_rows": n - known, "bytes": written,
                              "new_kv_bytes": new_kv, "base": None if ref is None else ref.name}
            orphaned = ref is not None and ref.name not in self._index  # base gone meanwhile (quarantined)
        self.io.add(self.ns, written, new_kv)
        delta = (f"; delta on {ref.name}: {n - known} new rows, written/new KV {written / new_kv:.3f}"
                 if ref is not None else (f"; {n - known} new rows, written/new KV {written / new_kv:.3f}"
                                          if known else ""))
        log.info("[KV-DISK] saved %d-token KV -> %s (%d bytes, %.1f ms, %.1f MB/s)%s",
                 n, name, written, secs * 1e3, mbps(written, secs), delta)
        if orphaned:
            self._drop_quarantined(entry, f"base-missing: base {ref.name} was removed during the save")
            return
        self._drop_redundant("replaced by {}, which extends it")
        self.evict(keep=name)

    def _compact_idle(self, should_stop) -> None:
        """Writer thread, idle for compact_idle seconds: rewrite each chain as one full file."""
        while not should_stop():
            with self._lock:
                todo = chains.compaction_candidates(self._index, 2)
            if not todo or not self.compact(todo[0], should_stop):
                return

    def compact(self, tip: Entry, should_stop=lambda: False) -> bool:
        """Rewrite `tip` (no delta depends on it) as one full file under the same name: temp file,
        rows read from its chain (every block CRC-checked), fsync, rename over the tip. Then the
        files below it that nothing else needs are removed. False if stopped or failed."""
        try:
            chain = self.chain(tip)
            reader = ChainRead(chain, tip.n_tokens, self.geometry, self.model_id, tip.n_tokens)
        except (SnapshotError, OSError) as err:
            log.warning("[KV-DISK] compaction of %s skipped: %s", tip.name, err)
            return False
        size = fmt.snapshot_size(self.geometry.n_layers, tip.n_tokens, self.geometry.kv_dim, self.kv_bs,
                                 len(fmt.encode_extension(tip.spans)))
        t0 = time.monotonic()
        try:
            done: list[fmt.SnapshotWriter] = []
            written = publish_file(self.ns, tip.name, size, lambda f: write_compacted(
                f, reader, tip, self.geometry, self.model_id, self.kv_bs, should_stop, done), self.modes)
            trailer_crc = done[0].hdr.trailer_crc
        except InterruptedError:
            log.info("[KV-DISK] compaction of %s interrupted by a save", tip.name)
            return False
        except (OSError, ValueError, SnapshotError) as err:
            log.warning("[KV-DISK] compaction of %s failed: %s", tip.name, err)
            return False
        finally:
            reader.close()
        with self._lock:
            self._index[tip.name] = Entry(tip.name, tip.path, tip.tokens, written, tip.last_use, tip.spans,
                                          None, trailer_crc)
            self._counters["compactions"] += 1
            self._counters["bytes_written"] += written
            self._counters["compaction_bytes_written"] += written
        self.io.add(self.ns, written, 0)
        os.utime(tip.path, (tip.last_use, tip.last_use))
        log.info("[KV-DISK] compacted %d files -> %s (%d tokens, %d bytes, %.1f ms)", len(chain), tip.name,
                 tip.n_tokens, written, (time.monotonic() - t0) * 1e3)
        self._drop_redundant("compacted into {}")
        return True

    def _drop_redundant(self, why: str) -> None:
        """Remove files a longer file covers and no delta needs, down the chain (a removed delta
        can leave its base without dependents)."""
        while True:
            with self._lock:
                extra = chains.redundant(self._index)
            if not extra:
                return
            for e, longer in extra:
                self._remove(e, why.format(longer.name))

    def _save_failed(self, name: str, n: int, err: Exception) -> None:
        code = getattr(err, "errno", None)
        kind, msg = {errno.ENOSPC: ("disk_full", "snapshot disk full"),
                     errno.EDQUOT: ("disk_full", "snapshot disk quota exceeded"),
                     errno.EIO: ("io_error", "snapshot disk I/O error")}.get(
            code, ("save_failed", f"snapshot save failed: {err}"))
        with self._lock:
            self._counters["save_failures"] += 1
            self._degraded[kind] = msg
        log.error("[KV-DISK] save failed: %d-token KV -> %s: %s (%s)", n, name, err, msg)

    def _make_room(self, size: int, keep: str | None) -> None:
        """Evict LRU chains first if the new file cannot fit in free space but would after that
        (never the chain of `keep`, the base of the delta about to be written)."""
        try:
            st = os.statvfs(self.ns)
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        if free >= size:
            return
        with self._lock:
            lru = sorted((u for u in chains.units(self._index) if keep not in u.names), key=lambda u: u.last_use)
        if free + sum(u.size for u in lru) < size:
            return  # evicting everything would not help: let the write fail and be counted
        for u in lru:
            if free >= size:
                break
            self._remove_unit(u, f"making room: {free} bytes free, {size} needed")
            free += u.size

    # ---- eviction / files ---------------------------------------------------------------------------
    def evict(self, keep: str | None = None) -> list[str]:
        """Apply max_files (chains) / max_bytes, least recently used chain first, never the chain
        of `keep`. Returns the removed file names."""
        with self._lock:
            victims = chains.unit_victims(self._index, self.max_files, self.max_bytes, keep)
        names = []
        for u, reason in victims:
            names += self._remove_unit(u, reason)
        return names

    def _remove_unit(self, u: chains.Unit, reason: str) -> list[str]:
        """Remove a whole chain tree, deltas first, so no delta ever outlives its base on disk."""
        order = sorted(u.members, key=lambda e: -e.n_tokens)
        for e in order:
            self._remove(e, reason)
        return [e.name for e in order]

    def _remove(self, e: Entry, reason: str) -> None:
        with self._lock:
            self._index.pop(e.name, None)
            self._counters["evictions"] += 1
        self._unlink(e.path, reason)
        try:
            fsync_dir(self.ns)
        except OSError:
            pass
        log.info("[KV-DISK] evicted %s (%s)", e.name, reason)

    def _drop_quarantined(self, e: Entry, reason: str) -> None:
        """Quarantine a bad file and every delta written on it (a miss, never wrong data)."""
        with self._lock:
            self._index.pop(e.name, None)
        self._quarantine(e.path, reason)
        self._drop_descendants(e, f"base-missing: base {e.name} was rejected ({reason})")

    def _drop_descendants(self, e: Entry, reason: str) -> None:
        with self._lock:
            deps = chains.descendants({**self._index, e.name: e}, e.name)
            for d in deps:
                self._index.pop(d.name, None)
        for d in deps:
            self._quarantine(d.path, reason)

    def _touch(self, e: Entry) -> None:
        """Count a use: LRU time = now, mirrored into the file mtime so it survives restarts."""
        now = time.time()
        with self._lock:
            e.last_use = now
        try:
            os.utime(e.path, (now, now))
        except OSError as err:
            log.warning("[KV-DISK] could not touch %s: %s", e.name, err)

    def _unlink(self, path: Path, why: str) -> None:
        try:
            path.unlink(missing_ok=True)
            log.debug("[KV-DISK] removed %s (%s)", path.name, why)
        except OSError as e:
            log.warning("[KV-DISK] could not remove %s (%s): %s", path.name, why, e)

    def _quarantine(self, path: Path, reason: str) -> None:
        """Move a bad file to quarantine/ (with a .reason note), keep the newest few, log, count."""
        with self._lock:
            self._counters["rejections"] += 1
        log.warning("[KV-DISK] rejected %s: %s", path.name, reason)
        quarantine_file(self.ns, path, reason, modes=self.modes)

    # ---- health -----------------------------------------------------------------------------------
    @property
    def degraded(self) -> list[str]:
        with self._lock:
            return list(self._degraded.values())

    def stats(self) -> dict[str, Any]:
        """Counters and state for /health and /metrics."""
        with self._lock:
            c = self._counters
            return {**c, "files": len(self._index), "chains": len(chains.units(self._index)),
                    "bytes_on_disk": sum(e.size for e in self._index.values()),
                    "write_ratio": c["bytes_written"] / c["new_kv_bytes"] if c["new_kv_bytes"] else 0.0,
                    "degraded": list(self._degraded.values()), "namespace": self.ns.name,
                    "save_pending": self._writer.busy}


class PendingRestore:
    """A pipelined restore the engine computes behind; `finish()` joins the reader."""

    def __init__(self, store: SnapshotStore, hit: Hit, reader: ChainRead, job: PipelinedRestore, cache: KVCache):
        self.store, self.hit, self.reader, self.job, self.cache = store, hit, reader, job, cache
        self.m = reader.m
        self.w0 = cache.write_wait_s

    def finish(self) -> RestoreResult:
        """Wait for the reader. On failure: reset the cache, quarantine, raise SnapshotError (or
        Cancelled); the lease is released either way."""
        try:
            nbytes, secs = self.job.join()
        except Cancelled:
            self.cache.reset()
            raise
        except (SnapshotError, OSError) as err:
            self.cache.reset()
            self.store._restore_failed(self.hit.entry, err)
        finally:
            self.job.end()
        waited = self.cache.write_wait_s - self.w0
        return self.store._restored(self.hit.entry, self.reader, nbytes, max(secs - waited, 0.0), waited)


def _fnv(tokens: np.ndarray) -> int:
    return fmt.fnv1a64(tokens.astype("<u4").tobytes())


def _reason(err: BaseException) -> str:
    if isinstance(err, SnapshotError):
        return f"{err.reason}: {err}"
    return f"read error: {err}"
