"""The snapshot index's records (`Entry`, `Hit`) and the pure functions on token ids; no I/O.

Shared by `SnapshotStore`, the chain policies (`chains.py`) and the `edge-llm kv` CLI.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_llm.kvcache import ImageSpan
from edge_llm.snapshot.layout import BaseRef


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
