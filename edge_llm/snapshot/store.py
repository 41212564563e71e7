"""The snapshot store of one identity namespace (docs/store.md).

`<kv-dir>/<model_id hex>/kv_<tokens_fnv hex>.kv` files, indexed at start-up from their headers and
token ids only; LCP lookup; restore straight into the KV cache arrays; background saves with
atomic publish; dedupe; LRU eviction; quarantine of bad files. Faults (ENOSPC, EIO, corrupt
files) are logged and counted and never reach the request path except as a restore failure,
after which the engine recomputes.
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
from edge_llm.errors import SnapshotError
from edge_llm.kvcache import KVCache
from edge_llm.progress import NO_WORK, RESTORE, Cancelled, Work
from edge_llm.settings import DEFAULTS
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot.identity import Identity, ensure_namespace
from edge_llm.snapshot.index import (
    Entry,
    Hit,
    RestoreResult,
    is_prefix,
    lcp,
    lru_victims,
    mbps,
    quarantine_file,
)
from edge_llm.snapshot.writer import (
    TMP_SUFFIX,
    BackgroundWriter,
    SaveJob,
    fsync_dir,
    orphaned_temp,
    publish_file,
)

log = logging.getLogger("edge_llm.kvdisk")

# scan/read bound: well above any save cap, so lowering --disk-kv-max-tokens doesn't reject
# valid older files; token ids are read only after the exact size check anyway
READ_MAX_TOKENS = 1 << 18


class SnapshotStore:
    """Snapshots of one identity under `<kv_dir>/<model_id hex>/`; see the module docstring."""

    def __init__(self, kv_dir: str | Path, identity: Identity, geometry: Geometry,
                 min_lcp: int = DEFAULTS.disk_kv_min_lcp, max_files: int = DEFAULTS.disk_kv_max_files,
                 max_bytes: int | None = DEFAULTS.disk_kv_max_bytes,
                 max_tokens: int = DEFAULTS.disk_kv_max_tokens, kv_bs: int = DEFAULTS.kv_bs):
        if min_lcp < 1 or max_files < 1 or max_tokens < 1 or kv_bs < 1:
            raise ValueError("min_lcp, max_files, max_tokens and kv_bs must be >= 1")
        self.identity, self.geometry = identity, geometry
        self.model_id = identity.model_id
        self.min_lcp, self.max_files, self.max_bytes = min_lcp, max_files, max_bytes
        self.max_tokens, self.kv_bs = max_tokens, kv_bs
        self.ns = ensure_namespace(kv_dir, identity)
        self._lock = threading.RLock()
        self._index: dict[str, Entry] = {}
        self._counters = dict(saves=0, save_failures=0, saves_skipped=0, saves_superseded=0, loads=0,
                              load_failures=0, rejections=0, evictions=0, bytes_written=0, bytes_read=0)
        self._degraded: dict[str, str] = {}  # kind -> message; cleared by the next successful save
        self.write_bps: float | None = None  # measured: moving average over saves (bytes / second)
        self._writer = BackgroundWriter(self._save)

    # ---- index ------------------------------------------------------------------------------
    def scan(self) -> int:
        """Index the namespace from headers + token ids (no payload); quarantine bad files."""
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
        # a kill between publishing a file and removing what it replaces/evicts leaves extra files
        for e in list(entries.values()):
            longer = [o for o in entries.values() if o.n_tokens > e.n_tokens and is_prefix(e.tokens, o.tokens)]
            if longer:
                self._remove(e, f"replaced by {longer[0].name}, which extends it")
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
        return Entry(path.name, path, tokens, st.st_size, st.st_mtime, hdr.spans)

    def entries(self) -> list[Entry]:
        """Indexed snapshots, most recently used first."""
        with self._lock:
            return sorted(self._index.values(), key=lambda e: e.last_use, reverse=True)

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

    def restore(self, hit: Hit, cache: KVCache, work: Work = NO_WORK) -> RestoreResult:
        """Read rows [0, hit.m) of the hit's file straight into `cache` and set its tokens.

        Each layer read is reported to `work` (stage restore) and a cancel is honoured between
        layers (`Cancelled` propagates; the cache is then reset). Raises SnapshotError (the
        subclass names the reason) if the file is bad or unreadable: the cache is then reset (its
        rows are garbage), the file quarantined (unless it vanished), and the caller recomputes.
        """
        if cache.geometry != self.geometry:
            raise ValueError(f"cache geometry {cache.geometry} != store geometry {self.geometry}")
        e, m = hit.entry, hit.m
        w0 = cache.write_wait_s
        cache.reset()  # from here on the rows are being rewritten from 0
        t0 = time.monotonic()
        n_layers = self.geometry.n_layers
        try:
            with open(e.path, "rb", buffering=0) as f:
                hdr, tokens = fmt.read_header(f, self.geometry, self.model_id, READ_MAX_TOKENS)
                if not is_prefix(e.tokens[:m], tokens):
                    raise SnapshotError("token ids changed since the index was built")
                m = min(m, hdr.n_tokens)
                # whole blocks are read: stay within the cache (max_seq need not be a block multiple)
                while m > 0 and fmt.rows_needed(hdr, m) > cache.max_seq:
                    m = (fmt.n_blocks(m, hdr.kv_bs) - 1) * hdr.kv_bs
                if m < 1:
                    raise SnapshotError(f"cache of {cache.max_seq} rows cannot hold one block of {hdr.kv_bs}")
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                nbytes = fmt.read_rows_into(f, hdr, m, lambda layer, kv: cache.restore_rows(layer, kv, work),
                                            on_layer=lambda layer: work.report(RESTORE, layer + 1, n_layers))
        except Cancelled:
            cache.reset()
            raise
        except (SnapshotError, OSError) as err:
            cache.reset()
            with self._lock:
                self._counters["load_failures"] += 1
                self._index.pop(e.name, None)
            if isinstance(err, FileNotFoundError):
                log.warning("[KV-DISK] rejected %s: file vanished (%s)", e.name, err)
                raise SnapshotError(f"{e.name}: file vanished") from err
            self._quarantine(e.path, _reason(err))
            if isinstance(err, SnapshotError):
                raise
            raise SnapshotError(f"{e.name}: read failed: {err}") from err
        cache.set_tokens(e.tokens[:m].tolist(), hdr.spans)
        waited = cache.write_wait_s - w0  # for a pending save of the same rows, per layer
        secs = time.monotonic() - t0 - waited
        res = RestoreResult(m, nbytes, secs * 1e3, mbps(nbytes, secs), e.name, waited * 1e3)
        self._touch(e)
        with self._lock:
            self._counters["loads"] += 1
            self._counters["bytes_read"] += nbytes
        log.info("[KV-DISK] loaded %d-token KV prefix from disk file %s (%d bytes, %.1f ms, %.1f MB/s)",
                 m, e.name, nbytes, res.ms, res.mbps)
        return res

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
        the first save)."""
        rate = self.write_bps
        if not rate:
            return None
        return fmt.snapshot_size(self.geometry.n_layers, n_tokens, self.geometry.kv_dim, self.kv_bs) / rate

    def close(self, timeout: float | None = None) -> bool:
        """Finish the pending save and stop the writer thread."""
        return self._writer.close(timeout)

    def _save(self, job: SaveJob) -> None:
        """Writer thread: dedupe, write + publish, replace extended snapshots, evict."""
        tokens, n = job.tokens, job.n
        with self._lock:
            covering = [e for e in self._index.values() if is_prefix(tokens, e.tokens)]
        if covering:  # identical, or a prefix of a stored one: any hit it gives, that one gives too
            e = max(covering, key=lambda c: c.n_tokens)
            self._touch(e)
            with self._lock:
                self._counters["saves_skipped"] += 1
            how = "already stored" if e.n_tokens == n else f"prefix of {e.name}"
            log.info("[KV-DISK] skipped %d-token KV -> %s (%s)", n, e.name, how)
            return
        fnv = fmt.fnv1a64(tokens.astype("<u4").tobytes())
        name = fmt.snapshot_name(fnv)
        size = fmt.snapshot_size(self.geometry.n_layers, n, self.geometry.kv_dim, self.kv_bs,
                                 len(fmt.encode_extension(job.spans)))
        if self.max_bytes is not None and size > self.max_bytes:
            log.info("[KV-DISK] skipped %d-token KV -> %s (%d bytes exceed max_bytes %d)",
                     n, name, size, self.max_bytes)
            with self._lock:
                self._counters["saves_skipped"] += 1
            return
        self._make_room(size)
        lease, n_layers = job.lease, self.geometry.n_layers

        def rows(layer: int, kv: int):
            if kv == 0:  # asked for layer l's rows: layers < l are written, their rows are free
                lease.layer_done(layer)
            return lease.rows(layer, kv)

        def write(f) -> int:
            nbytes = fmt.write_snapshot(f, tokens, self.model_id, self.geometry, self.kv_bs, rows, fnv,
                                        job.spans)
            lease.layer_done(n_layers)  # before the fsync: the rows are in the file now
            return nbytes

        t0 = time.monotonic()
        try:
            written = publish_file(self.ns, name, size, write)
        except (OSError, ValueError) as e:
            self._save_failed(name, n, e)
            return
        secs = time.monotonic() - t0
        now = time.time()
        entry = Entry(name, self.ns / name, tokens, written, now, job.spans)
        with self._lock:
            replaced = [e for e in self._index.values() if e.name != name and is_prefix(e.tokens, tokens)]
            for e in replaced:
                del self._index[e.name]
            self._index[name] = entry
            self._counters["saves"] += 1
            self._counters["bytes_written"] += written
            self._degraded.clear()
            rate = written / max(secs, 1e-6)
            self.write_bps = rate if self.write_bps is None else 0.7 * self.write_bps + 0.3 * rate
        log.info("[KV-DISK] saved %d-token KV -> %s (%d bytes, %.1f ms, %.1f MB/s)",
                 n, name, written, secs * 1e3, mbps(written, secs))
        for e in replaced:
            self._remove(e, f"replaced by {name}, which extends it")
        self.evict(keep=name)

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

    def _make_room(self, size: int) -> None:
        """Evict LRU files first if the new file cannot fit in free space but would after that."""
        try:
            st = os.statvfs(self.ns)
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        if free >= size:
            return
        with self._lock:
            lru = sorted(self._index.values(), key=lambda e: e.last_use)
        if free + sum(e.size for e in lru) < size:
            return  # evicting everything would not help: let the write fail and be counted
        for e in lru:
            if free >= size:
                break
            self._remove(e, f"making room: {free} bytes free, {size} needed")
            free += e.size

    # ---- eviction / files ---------------------------------------------------------------------------
    def evict(self, keep: str | None = None) -> list[str]:
        """Apply max_files / max_bytes, least recently used first, never `keep`. Returns names."""
        with self._lock:
            victims = lru_victims(self._index.values(), self.max_files, self.max_bytes, keep)
        for e, reason in victims:
            self._remove(e, reason)
        return [e.name for e, _ in victims]

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
        quarantine_file(self.ns, path, reason)

    # ---- health -----------------------------------------------------------------------------------
    @property
    def degraded(self) -> list[str]:
        with self._lock:
            return list(self._degraded.values())

    def stats(self) -> dict[str, Any]:
        """Counters and state for /health and /metrics."""
        with self._lock:
            return {**self._counters, "files": len(self._index),
                    "bytes_on_disk": sum(e.size for e in self._index.values()),
                    "degraded": list(self._degraded.values()), "namespace": self.ns.name,
                    "save_pending": self._writer.busy}


def _reason(err: BaseException) -> str:
    if isinstance(err, SnapshotError):
        return f"{err.reason}: {err}"
    return f"read error: {err}"
