"""The snapshot store of one identity namespace (docs/store.md).

`<kv-dir>/<model_id hex>/kv_<tokens_fnv hex>.kv` files, indexed at start-up from their headers and
token ids only; LCP lookup; for a restore, the hit's chain opened and validated (`open`) and handed
to the KV cache, which runs the restore (edge_llm/kvcache/cache.py); the store accounts for the
read and quarantines what turned out bad. The store is the one object the engine, server and
CLI hold: saves and compaction are `saver.py` (`Saver`, the writer thread), the index and every
removal of a file (eviction of whole chains, quarantine of bad files and of deltas whose base is
gone) are `catalog.py`, the chain policies `chains.py`, reading a chain `chain_read.py`. Faults
(ENOSPC, EIO, corrupt files) are logged and counted and never reach the request path except as a
restore failure, after which the engine recomputes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edge_llm.config import Geometry
from edge_llm.errors import SnapshotChainError, SnapshotError, SnapshotNotRegular
from edge_llm.files import TMP_SUFFIX, check_writable, open_regular, orphaned_temp
from edge_llm.kvcache import KVCache, Restored
from edge_llm.progress import NO_WORK, Work
from edge_llm.safetext import printable
from edge_llm.settings import DEFAULTS
from edge_llm.snapshot import chains
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot.catalog import Catalog
from edge_llm.snapshot.identity import IDENTITY_FILE, Identity, ensure_namespace
from edge_llm.snapshot.chain_read import READ_MAX_TOKENS, ChainRead, ChainReadError
from edge_llm.snapshot.entries import Entry, Hit, lcp
from edge_llm.snapshot.saver import Saver
from edge_llm.snapshot.writer import Modes

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
        self.min_lcp = min_lcp
        self.modes = Modes(group_read)
        self.kv_dir = Path(kv_dir)
        self.ns = ensure_namespace(kv_dir, identity, self.modes)
        check_writable(self.ns)  # an existing namespace on a read-only mount: found now, not at a save
        self.catalog = Catalog(self.ns, self.modes, max_files, max_bytes, recreate=self._recreate_namespace)
        self.saver = Saver(self.catalog, geometry, self.model_id, min_lcp, max_tokens, kv_bs, max_chain, compact_idle)
        self._dir_mtime = 0  # the namespace directory's mtime when its names were last read (`_adopt_new`)

    def _recreate_namespace(self) -> bool:
        """The namespace directory or its identity.json removed under us: make them again (the
        writer thread, before a save). True if it had to."""
        if (self.ns / IDENTITY_FILE).is_file():
            return False
        ensure_namespace(self.kv_dir, self.identity, self.modes)
        return True

    @property
    def write_bps(self) -> float | None:
        """This disk's measured write speed (bytes / second, moving average over saves)."""
        return self.saver.write_bps

    @property
    def last_save(self) -> dict[str, Any] | None:
        """The latest save: bytes written vs bytes of new KV."""
        return self.saver.last_save

    # ---- index ------------------------------------------------------------------------------
    def scan(self) -> int:
        """Index the namespace from headers + token ids (no payload); quarantine bad files and
        deltas whose base is gone; remove files a kill left behind."""
        t0 = time.monotonic()
        self._dir_mtime = self._ns_mtime()
        for tmp in self.ns.glob("*" + TMP_SUFFIX):  # debris of killed writers, not a live one's file
            if orphaned_temp(tmp, self.saver.writer.busy):
                self.catalog.unlink(tmp, "leftover temp file")
        entries, rejected = {}, 0
        for path in sorted(self.ns.glob(fmt.SNAPSHOT_GLOB)):
            try:
                entry = self._read_entry(path)
            except SnapshotNotRegular:  # a FIFO or device would block or mislead the reader: never read
                log.warning("[KV-DISK] skipped %s: not a regular file", printable(path.name))
                continue
            except (SnapshotError, OSError) as e:
                self.catalog.quarantine(path, _reason(e))
                rejected += 1
                continue
            entries[entry.name] = entry
        cat = self.catalog
        with cat.lock:
            cat.index = entries
        # a delta without its base (deleted, corrupt, replaced by other rows) is a miss: quarantined
        while bad := chains.broken(cat.index):
            for e, err in bad:
                cat.drop_quarantined(e, _reason(err))
                rejected += 1
        # a kill between publishing a file and removing what it extends or compacts leaves extra files
        cat.drop_redundant("replaced by {}, which extends it")
        cat.evict()
        extra = f", {rejected} rejected" if rejected else ""
        log.info("[KV-DISK] index: %d checkpoint(s)%s (%s, %.1f ms)", len(cat.index), extra, self.ns.name,
                 (time.monotonic() - t0) * 1e3)
        return len(cat.index)

    def _read_entry(self, path: Path) -> Entry:
        return read_entry(path, self.geometry, self.model_id)

    def entries(self) -> list[Entry]:
        """Indexed snapshots, most recently used first."""
        return self.catalog.entries()

    def chain(self, entry: Entry) -> list[Entry]:
        """The files a restore of `entry` reads, root first (SnapshotChainError if broken)."""
        return self.catalog.chain(entry)

    # ---- lookup / restore ---------------------------------------------------------------------
    def lookup(self, tokens: Any) -> Hit | None:
        """Best snapshot for a request: longest common prefix, >= min_lcp, at most len - 1 rows."""
        req = np.asarray(tokens, dtype=np.int64)
        if req.ndim != 1 or req.shape[0] < 2 or req.min() < 0 or req.max() > 0xFFFFFFFF:
            return None
        req = req.astype(np.uint32)
        while True:
            best = self._best(req, req.shape[0] - 1)  # at least one token is prefilled: it yields the logits
            if best is None:
                if self._adopt_new():  # files imported since the scan (docs/fleet.md)
                    continue
                return None
            try:
                chain = self.catalog.chain(best.entry)
            except SnapshotChainError:
                return best  # `open` quarantines it
            # only the hit's files are checked; one removed under us is no hit (docs/store.md, "Files that vanish")
            if self.catalog.still_there(chain):
                return best

    def _best(self, req: np.ndarray, limit: int) -> Hit | None:
        best: Hit | None = None
        with self.catalog.lock:
            for e in self.catalog.index.values():
                m = min(lcp(req, e.tokens), limit)
                if m >= self.min_lcp and (best is None or m > best.m
                                          or (m == best.m and e.last_use > best.entry.last_use)):
                    best = Hit(e, m)
        return best

    def _ns_mtime(self) -> int:
        try:
            return os.stat(self.ns).st_mtime_ns
        except OSError:
            return 0

    def _adopt_new(self) -> int:
        """On a lookup miss: if the namespace directory changed since its names were last read,
        index the snapshot files that are not indexed yet and whose whole chain is readable (files
        `edge-llm kv import` published into the live kv dir: docs/fleet.md). One stat when nothing
        changed; headers are read only for new names. A bad new file is left for the next scan.
        The store's own saves change the directory too: the first miss after a save reads its
        names once (a plain listing, no stat per file: docs/store.md, "Files that vanish")."""
        mtime = self._ns_mtime()
        if mtime == self._dir_mtime:
            return 0
        self._dir_mtime = mtime
        try:
            names = set(os.listdir(self.ns))
        except OSError:
            return 0
        with self.catalog.lock:
            names.difference_update(self.catalog.index)
        new: dict[str, Entry] = {}
        for name in filter(fmt.is_snapshot_name, names):
            try:
                new[name] = self._read_entry(self.ns / name)
            except (SnapshotError, OSError):
                continue
        with self.catalog.lock:
            index = {**new, **self.catalog.index}
            adopted = {}
            for name, e in new.items():
                try:
                    if name not in self.catalog.index and chains.chain_of(index, e):
                        adopted[name] = e
                except SnapshotChainError:
                    continue
            self.catalog.index.update(adopted)
        if adopted:
            log.info("[KV-DISK] index: %d new file(s) in %s since the scan (kv import): indexed",
                     len(adopted), self.ns.name)
            self.catalog.evict()
        return len(adopted)

    def open(self, hit: Hit, max_seq: int) -> "ChainSource | None":
        """The files a restore of hit.m rows reads, opened and validated (header reads only), for
        a cache of `max_seq` rows to restore from (`KVCache.restore`); None if one is bad: it is
        quarantined and logged, and no cache row was touched (the caller uses what it has)."""
        try:
            return self._open(hit, max_seq)
        except SnapshotError as e:
            log.warning("[KV-DISK] restore of %s not started: %s", hit.entry.name, e)
            return None

    def _open(self, hit: Hit, max_seq: int) -> "ChainSource":
        try:
            return ChainSource(self, hit.entry, self.chain(hit.entry), hit.m, max_seq)
        except (SnapshotError, OSError) as err:
            raise self._quarantine(hit.entry, err) from err

    def restore(self, hit: Hit, cache: KVCache, work: Work = NO_WORK, pipelined: bool = False) -> Restored:
        """Restore rows [0, hit.m) of the hit's chain into `cache` and set its tokens: `open`,
        then the cache's restore, finished (no tail computed behind it). Raises SnapshotError
        (the subclass names the reason; the cache is reset and the bad file quarantined) or
        `Cancelled` (the cache is reset)."""
        if cache.geometry != self.geometry:
            raise ValueError(f"cache geometry {cache.geometry} != store geometry {self.geometry}")
        restore = cache.restore(self._open(hit, cache.max_seq), pipelined, work)
        restore.finish()
        return restore.restored

    def _loaded(self, source: "ChainSource", r: Restored) -> None:
        cat = self.catalog
        with cat.lock:
            members = [cat.index[n] for n in source.files if n in cat.index]
        for m in members:
            cat.touch(m)
        cat.count(loads=1, bytes_read=r.nbytes)
        chain = f" ({r.files} files)" if r.files > 1 else ""
        log.info("[KV-DISK] loaded %d-token KV prefix from disk file %s (%d bytes, %.1f ms, %.1f MB/s)%s",
                 r.n_tokens, r.name, r.nbytes, r.ms, r.mbps, chain)

    def _quarantine(self, e: Entry, err: BaseException) -> SnapshotError:
        """A restore of `e` failed: count, quarantine the bad file and every delta on it; the
        SnapshotError to raise (the subclass names the reason)."""
        bad = err.entry if isinstance(err, ChainReadError) else e
        cause = err.err if isinstance(err, ChainReadError) else err
        cat = self.catalog
        cat.count(load_failures=1)
        if isinstance(cause, FileNotFoundError):
            cat.drop_vanished(bad, "file vanished during a restore")
            return SnapshotError(f"{bad.name}: file vanished")
        cat.drop_quarantined(bad, _reason(cause))
        if isinstance(cause, SnapshotError):
            return cause
        return SnapshotError(f"{bad.name}: read failed: {cause}")

    # ---- saving, eviction (saver.py, catalog.py) ---------------------------------------------------
    def save_async(self, cache: KVCache) -> None:
        """Queue a snapshot of the cache's valid rows; never raises I/O errors (`Saver.save_async`)."""
        self.saver.save_async(cache)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the pending save (e.g. at SIGTERM); False on timeout."""
        return self.saver.writer.flush(timeout)

    def flush_with_progress(self, on_step: Callable[[str], None], stall_s: float) -> bool:
        """At shutdown: wait for the pending save while it makes progress (`Saver.flush_with_progress`)."""
        return self.saver.flush_with_progress(on_step, stall_s)

    def pending_tokens(self) -> int:
        """Rows of the running or queued save (0 if none)."""
        state = self.saver.writer.progress_of_pending()
        return 0 if state is None else state[0]

    def predicted_save_s(self, n_tokens: int) -> float | None:
        """Seconds to write an n-token snapshot at the measured write speed (None before a save)."""
        return self.saver.predicted_save_s(n_tokens)

    def compact(self, tip: Entry, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Rewrite a chain's tip as one full file (`Saver.compact`)."""
        return self.saver.compact(tip, should_stop)

    def close(self, timeout: float | None = None) -> bool:
        """Finish the pending save and stop the writer thread."""
        return self.saver.writer.close(timeout)

    # ---- health -----------------------------------------------------------------------------------
    @property
    def degraded(self) -> list[str]:
        with self.catalog.lock:
            return list(self.catalog.degraded.values())

    def stats(self) -> dict[str, Any]:
        """Counters and state for /health and /metrics. Files and bytes are those of the indexed
        files still on disk, sizes as stat reads them now (`Catalog.present`: one stat per entry)."""
        cat = self.catalog
        there = cat.present()
        with cat.lock:
            c = cat.counters
            return {**c, "files": len(there), "chains": len(chains.units(cat.index)),
                    "bytes_on_disk": sum(size for _, size in there),
                    "write_ratio": c["bytes_written"] / c["new_kv_bytes"] if c["new_kv_bytes"] else 0.0,
                    "degraded": list(cat.degraded.values()), "namespace": self.ns.name,
                    "save_pending": self.saver.writer.busy}


class ChainSource(ChainRead):
    """A hit's chain opened for a restore (`SnapshotStore.open`): the cache reads it, the store
    accounts for the read and quarantines a bad file (`done` / `failed`)."""

    def __init__(self, store: SnapshotStore, entry: Entry, chain: list[Entry], m: int, max_seq: int):
        super().__init__(chain, m, store.geometry, store.model_id, max_seq)
        self.store, self.entry = store, entry

    def done(self, restored: Restored) -> None:
        self.store._loaded(self, restored)

    def failed(self, err: BaseException) -> SnapshotError:
        return self.store._quarantine(self.entry, err)


def _reason(err: BaseException) -> str:
    if isinstance(err, SnapshotError):
        return f"{err.reason}: {err}"
    return f"read error: {err}"


def read_entry(path: Path, geometry: Geometry | None, model_id: int | None, name: str | None = None) -> Entry:
    """An index entry from a snapshot file's header (no payload read); raises SnapshotError.
    `name`: the snapshot name the file must have (default its own; `kv import` reads a staged
    file under a temp name)."""
    name = path.name if name is None else name
    with open_regular(path, SnapshotNotRegular, buffering=0) as f:
        st = os.fstat(f.fileno())
        hdr, tokens = fmt.read_header(f, geometry, model_id, READ_MAX_TOKENS, st.st_size)
    if fmt.snapshot_name(hdr.tokens_fnv) != name:
        raise SnapshotError(f"file name does not match its tokens hash {hdr.tokens_fnv:016x}")
    return Entry(name, path, tokens, st.st_size, st.st_mtime, hdr.spans, hdr.base, hdr.trailer_crc)
