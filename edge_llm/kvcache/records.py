"""The KV cache's records: image runs among the rows, what a restore reads from and what it read.

Shared by the cache (`cache.py`), the snapshot store (which stores spans and implements
`RowSource`) and the engine; no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge_llm.errors import SnapshotError


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


class RowSource(Protocol):
    """What a restore reads rows from: the store's opened and validated snapshot chain."""

    name: str  # the file named in logs and timings (the chain's tip)
    files: list[str]  # every file read, root first
    tokens: list[int]  # ids of the rows [0, len(tokens)) it provides
    spans: Sequence[ImageSpan]  # image runs among them

    @property
    def rows_needed(self) -> int: ...  # >= len(tokens): whole blocks are read

    def read_layer(self, layer: int, k: np.ndarray, v: np.ndarray) -> int:
        """Its rows of one layer into k, v (each (max_seq, kv_dim)), checked; bytes read."""

    def close(self) -> None: ...

    def done(self, restored: "Restored") -> None:
        """The rows are in: account for the read (index, counters, the `[KV-DISK]` line)."""

    def failed(self, err: BaseException) -> SnapshotError:
        """A read failed: quarantine what is bad; the error `Restore.finish` raises."""


@dataclass(frozen=True)
class Restored:
    """What a finished restore read (`Restore.finish`)."""

    n_tokens: int
    nbytes: int
    ms: float  # reading, without the waits for a pending save
    wait_ms: float  # waited for a pending save of the same rows
    mode: str  # pipelined | sequential: the path that ran
    name: str
    files: int

    @property
    def mbps(self) -> float:
        """Throughput in MB/s (1e6 bytes), the unit of flash data sheets."""
        return self.nbytes / 1e3 / self.ms if self.ms > 0 else 0.0


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Longest common prefix length of two id sequences (numpy-vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n
