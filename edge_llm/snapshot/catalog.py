"""The in-memory index of one namespace directory and every removal of a file from it.

`Catalog` is the state the store's readers (scan, lookup, restore) and its writer (saves,
compaction: `saver.py`) share: the index of entries under one lock, the counters `/metrics`
shows, the `degraded` flags, the bytes-written totals across restarts (`io-stats.json`), and the
only code that takes a file away: LRU eviction of whole chains, making room before a write,
removing files a longer one covers, quarantining a bad file together with every delta on it;
and the check of the index against the disk (`still_there` for the files a lookup or a save
relies on, `present` for the counts: files removed under the running store leave the index,
docs/store.md "Files that vanish"). The chain policies it applies are `chains.py`;
docs/store.md states them.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from edge_llm.errors import SnapshotNotRegular
from edge_llm.files import fsync_dir, read_regular
from edge_llm.safetext import one_line, printable
from edge_llm.snapshot import chains
from edge_llm.snapshot.entries import Entry
from edge_llm.snapshot.writer import Modes, write_atomic

log = logging.getLogger("edge_llm.kvdisk")

QUARANTINE = "quarantine"
IO_STATS = "io-stats.json"
MAX_QUARANTINED = 4  # quarantined files can be GBs: keep only the newest few for post-mortems
COUNTERS = ("saves", "saves_delta", "save_failures", "saves_skipped", "saves_superseded", "loads",
            "load_failures", "rejections", "evictions", "vanished", "compactions", "bytes_written",
            "new_kv_bytes", "compaction_bytes_written", "bytes_read")


class Catalog:
    """Entries of one namespace `ns` (`index`, guarded by `lock`), counters and file removal."""

    def __init__(self, ns: Path, modes: Modes, max_files: int, max_bytes: int | None,
                 recreate: Callable[[], bool] | None = None):
        self.ns, self.modes = ns, modes
        # the store's: makes the namespace directory and its identity.json again if they are gone
        # (True if it had to)
        self._recreate = recreate
        self.max_files, self.max_bytes = max_files, max_bytes
        self.lock = threading.RLock()
        self.index: dict[str, Entry] = {}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.io = IOStats.load(ns)  # bytes written to this namespace across restarts (`kv ls`)
        self.degraded: dict[str, str] = {}  # kind -> message; cleared by the next successful save

    def count(self, **deltas: int) -> None:
        with self.lock:
            for k, v in deltas.items():
                self.counters[k] += v

    def chain(self, entry: Entry) -> list[Entry]:
        """The files to read for `entry`, root first (`chains.chain_of` under the lock)."""
        with self.lock:
            return chains.chain_of(self.index, entry)

    def entries(self) -> list[Entry]:
        """Indexed snapshots, most recently used first."""
        with self.lock:
            return sorted(self.index.values(), key=lambda e: e.last_use, reverse=True)

    # ---- the index against the disk ------------------------------------------------------------
    def present(self) -> list[tuple[Entry, int]]:
        """The indexed files that are still there, with their size on disk now: one `os.stat` per
        entry; those that are gone leave the index (`still_there`). For the counts (`stats`:
        /health, /metrics) and before idle compaction (docs/store.md, "Files that vanish")."""
        with self.lock:
            entries = list(self.index.values())
        there = [(e, size) for e in entries if (size := self._size_on_disk(e)) is not None]
        if len(there) == len(entries):
            return there
        with self.lock:
            return [(e, size) for e, size in there if self.index.get(e.name) is e]

    def still_there(self, entries: list[Entry]) -> bool:
        """True if every one of `entries` (a hit's chain, what a save dedupes against) is still a
        regular file: one `os.stat` each. One that is gone (deleted by `kv rm`/`kv gc` or by hand,
        its namespace directory removed) or is no longer a regular file leaves the index, and a
        delta resting on it is quarantined (`drop_vanished`); the caller then looks again."""
        return all(self._size_on_disk(e) is not None for e in entries)

    def _size_on_disk(self, e: Entry) -> int | None:
        """`e`'s size as stat reads it now; None (and `e` dropped) if its file is gone."""
        try:
            st = os.stat(e.path)
        except (FileNotFoundError, NotADirectoryError):
            self.drop_vanished(e, "file vanished")
            return None
        except OSError as err:  # e.g. EACCES: not proof of absence; a restore finds out
            log.debug("[KV-DISK] could not stat %s: %s", printable(e.name), err)
            return e.size
        if not stat.S_ISREG(st.st_mode):
            self.drop_vanished(e, "no longer a regular file")
            return None
        return st.st_size

    def drop_vanished(self, e: Entry, why: str) -> bool:
        """`e`'s file is gone: forget it (nothing to move) and quarantine every delta resting on it
        whose file is still there. False if `e` had already left the index (our own eviction, or a
        save or compaction replaced it)."""
        with self.lock:
            if self.index.get(e.name) is not e:
                return False
            del self.index[e.name]
            self.counters["vanished"] += 1
            deps = chains.descendants({**self.index, e.name: e}, e.name)
        log.warning("[KV-DISK] %s vanished from %s (%s): dropped from the index",
                    printable(e.name), self.ns.name, why)
        for d in deps:  # nearest first; dropping one takes its own deltas with it
            with self.lock:
                if self.index.get(d.name) is not d:
                    continue
            if d.path.exists():
                self.drop_quarantined(d, f"base-missing: base {e.name} vanished")
            else:
                self.drop_vanished(d, why)
        return True

    def ensure_dir(self) -> None:
        """Before a write: if the namespace directory (or its identity.json) was removed under the
        running store, make it again and say so; raises the OSError if that fails."""
        if self._recreate is not None and self._recreate():
            log.warning("[KV-DISK] namespace directory %s was removed under the running store: recreated",
                        self.ns.name)

    def touch(self, e: Entry) -> None:
        """Count a use: LRU time = now, mirrored into the file mtime so it survives restarts."""
        now = time.time()
        with self.lock:
            e.last_use = now
        try:
            os.utime(e.path, (now, now))
        except OSError as err:
            log.warning("[KV-DISK] could not touch %s: %s", printable(e.name), err)

    # ---- eviction ---------------------------------------------------------------------------------
    def evict(self, keep: str | None = None) -> list[str]:
        """Apply max_files (chains) / max_bytes, least recently used chain first, never the chain
        of `keep`. Returns the removed file names."""
        with self.lock:
            victims = chains.unit_victims(self.index, self.max_files, self.max_bytes, keep)
        names = []
        for u, reason in victims:
            names += self.remove_unit(u, reason)
        if names:
            self.sync()
        return names

    def make_room(self, size: int, keep: str | None) -> None:
        """Evict LRU chains first if a new file of `size` bytes cannot fit in free space but would
        after that (never the chain of `keep`, the base of the delta about to be written)."""
        try:
            st = os.statvfs(self.ns)
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        if free >= size:
            return
        with self.lock:
            lru = sorted((u for u in chains.units(self.index) if keep not in u.names), key=lambda u: u.last_use)
        if free + sum(u.size for u in lru) < size:
            return  # evicting everything would not help: let the write fail and be counted
        for u in lru:
            if free >= size:
                break
            self.remove_unit(u, f"making room: {free} bytes free, {size} needed")
            free += u.size
        self.sync()

    def drop_redundant(self, why: str) -> None:
        """Remove files a longer file covers and no delta needs, down the chain (a removed delta
        can leave its base without dependents). `why` is formatted with the longer file's name."""
        removed = False
        while True:
            with self.lock:
                extra = chains.redundant(self.index)
            if not extra:
                break
            for e, longer in extra:
                self.remove(e, why.format(longer.name))
            removed = True
        if removed:
            self.sync()

    def remove_unit(self, u: chains.Unit, reason: str) -> list[str]:
        """Remove a whole chain tree, deltas first (the caller syncs the directory once)."""
        order = chains.removal_order(u.members)
        for e in order:
            self.remove(e, reason)
        return [e.name for e in order]

    def remove(self, e: Entry, reason: str) -> None:
        """Unlink one file; `sync()` after a batch makes the removals durable. A crash in between
        can only leave a delta without its base, which the next scan quarantines (a miss)."""
        with self.lock:
            self.index.pop(e.name, None)
            self.counters["evictions"] += 1
        self.unlink(e.path, reason)
        log.info("[KV-DISK] evicted %s (%s)", printable(e.name), reason)

    def sync(self) -> None:
        """One directory fsync for the removals before it."""
        try:
            fsync_dir(self.ns)
        except OSError:
            pass

    # ---- bad files --------------------------------------------------------------------------------
    def drop_quarantined(self, e: Entry, reason: str) -> None:
        """Quarantine a bad file and every delta written on it (a miss, never wrong data)."""
        with self.lock:
            self.index.pop(e.name, None)
        self.quarantine(e.path, reason)
        self.drop_descendants(e, f"base-missing: base {e.name} was rejected ({reason})")

    def drop_descendants(self, e: Entry, reason: str) -> None:
        with self.lock:
            deps = chains.descendants({**self.index, e.name: e}, e.name)
            for d in deps:
                self.index.pop(d.name, None)
        for d in deps:
            self.quarantine(d.path, reason)

    def quarantine(self, path: Path, reason: str) -> None:
        """Move a bad file to quarantine/ (with a .reason note), keep the newest few, log, count."""
        self.count(rejections=1)
        # the name is the file system's (the scan quarantines files it could not read): escaped
        log.warning("[KV-DISK] rejected %s: %s", printable(path.name), one_line(reason))
        quarantine_file(self.ns, path, reason, modes=self.modes)

    def unlink(self, path: Path, why: str) -> None:
        try:
            path.unlink(missing_ok=True)
            log.debug("[KV-DISK] removed %s (%s)", printable(path.name), why)
        except OSError as e:
            log.warning("[KV-DISK] could not remove %s (%s): %s", printable(path.name), why, e)


@dataclass
class IOStats:
    """Bytes written to a namespace's files and bytes of new KV rows they carried, across restarts
    (`io-stats.json`, rewritten atomically after each save; `edge-llm kv ls` shows them)."""

    bytes_written: int = 0
    new_kv_bytes: int = 0

    @classmethod
    def load(cls, ns: Path) -> "IOStats":
        try:
            doc = json.loads(read_regular(ns / IO_STATS, SnapshotNotRegular))  # a FIFO: refused unread
            return cls(int(doc["bytes_written"]), int(doc["new_kv_bytes"]))
        except (OSError, ValueError, KeyError, TypeError, SnapshotNotRegular):
            return cls()

    def add(self, ns: Path, written: int, new_kv: int, modes: Modes | None = None) -> None:
        self.bytes_written += written
        self.new_kv_bytes += new_kv
        try:
            write_atomic(ns / IO_STATS, (json.dumps(asdict(self)) + "\n").encode(), modes)
        except OSError as e:  # counters are informational: never fail a save for them
            log.debug("could not update %s: %s", IO_STATS, e)


def quarantine_file(ns: Path, path: Path, reason: str, keep: int = MAX_QUARANTINED,
                    modes: Modes | None = None) -> Path | None:
    """Move a bad file to `<ns>/quarantine/` with a `.reason` note; keep the newest `keep` files.

    Best effort: if the move fails the file is deleted (a bad file must never stay in the
    namespace). Returns the quarantined path, or None.
    """
    qdir = ns / QUARANTINE
    try:
        (modes or Modes()).mkdir(qdir)
        dest = qdir / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{path.name}"
        os.replace(path, dest)
        write_atomic(dest.with_name(dest.name + ".reason"), (reason + "\n").encode(), modes)
        fsync_dir(ns)
        # names start with a timestamp: name order is age order
        kept = sorted(p.name for p in qdir.iterdir() if not p.name.endswith(".reason"))
        for old in kept[:-keep] if keep > 0 else kept:
            (qdir / old).unlink(missing_ok=True)
            (qdir / f"{old}.reason").unlink(missing_ok=True)
        return dest
    except OSError as e:
        log.warning("[KV-DISK] could not quarantine %s (%s); deleting it", printable(path.name), e)
        try:
            path.unlink(missing_ok=True)
        except OSError as e2:
            log.warning("[KV-DISK] could not delete %s: %s", printable(path.name), e2)
        return None
