"""Index records of the snapshot store and the pure policies on them (LCP, LRU caps, quarantine).

Shared by `SnapshotStore` and the `edge-llm kv` CLI (which applies the same caps offline).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edge_llm.files import fsync_dir
from edge_llm.kvcache import ImageSpan
from edge_llm.snapshot.layout import BaseRef
from edge_llm.snapshot.writer import Modes, write_atomic

log = logging.getLogger("edge_llm.kvdisk")

QUARANTINE = "quarantine"
IO_STATS = "io-stats.json"
MAX_QUARANTINED = 4  # quarantined files can be GBs: keep only the newest few for post-mortems


@dataclass
class Entry:
    """One indexed snapshot file."""

    name: str
    path: Path
    tokens: np.ndarray  # (n,) uint32
    size: int
    last_use: float  # wall-clock seconds; mirrored in the file's mtime so LRU survives restarts
    spans: tuple[ImageSpan, ...] = ()  # image runs among the rows (the file's extension section)
    base: BaseRef | None = None  # a delta's base (rows [0, base.n_tokens) live there)
    trailer_crc: int = 0  # what a delta written on this file records about it

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def row0(self) -> int:
        return 0 if self.base is None else self.base.n_tokens

    @property
    def tokens_fnv(self) -> int:
        return int(self.name[3:19], 16)  # kv_<16 hex>.kv: checked against the header at scan


@dataclass(frozen=True)
class Hit:
    entry: Entry
    m: int  # rows to restore: min_lcp <= m <= min(len(request) - 1, entry.n_tokens)


@dataclass(frozen=True)
class RestoreResult:
    n_tokens: int
    nbytes: int
    ms: float
    mbps: float  # 1e6 bytes per second
    name: str
    wait_ms: float = 0.0  # waited for a pending save before rows could be rewritten
    files: int = 1  # files of the chain that were read


def mbps(nbytes: int, seconds: float) -> float:
    """Throughput in MB/s (1e6 bytes), the unit of flash data sheets."""
    return nbytes / 1e6 / seconds if seconds > 0 else 0.0


def is_prefix(short: np.ndarray, long: np.ndarray) -> bool:
    """True if `short` is a (not necessarily strict) prefix of `long`."""
    return short.shape[0] <= long.shape[0] and bool(np.array_equal(long[: short.shape[0]], short))


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Longest common prefix of two id arrays (vectorised)."""
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass
class IOStats:
    """Bytes written to a namespace's files and bytes of new KV rows they carried, across restarts
    (`io-stats.json`, rewritten atomically after each save; `edge-llm kv ls` shows them)."""

    bytes_written: int = 0
    new_kv_bytes: int = 0

    @classmethod
    def load(cls, ns: Path) -> "IOStats":
        try:
            doc = json.loads((ns / IO_STATS).read_text())
            return cls(int(doc["bytes_written"]), int(doc["new_kv_bytes"]))
        except (OSError, ValueError, KeyError, TypeError):
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
        log.warning("[KV-DISK] could not quarantine %s (%s); deleting it", path.name, e)
        try:
            path.unlink(missing_ok=True)
        except OSError as e2:
            log.warning("[KV-DISK] could not delete %s: %s", path.name, e2)
        return None
