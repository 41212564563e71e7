"""A `RowSource` over arrays in memory: what the store's `ChainSource` is for snapshot files.

The cache's restore protocol (edge_llm/kvcache/records.py) is ours; this implements it without
files so the cache's side can be tested alone (the store's tests use the real files)."""

from __future__ import annotations

import threading

import numpy as np

from edge_llm.errors import SnapshotBlockCRC, SnapshotError


class RowsFrom:
    """Rows [0, m) of `data` ((n_layers, 2, >= m, kv_dim)); `fail_at` raises a CRC error at that
    layer; `gate[l]` (an Event) holds the read of layer l until set."""

    def __init__(self, data: np.ndarray, tokens: list[int], fail_at: int | None = None,
                 gate: dict[int, threading.Event] | None = None):
        self.data, self.tokens, self.fail_at, self.gate = data, list(tokens), fail_at, gate or {}
        self.name, self.files, self.spans = "memory", ["memory"], ()
        self.outcome: object = None  # the Restored, or the error given to failed()
        self.closed = False

    @property
    def m(self) -> int:
        return len(self.tokens)

    @property
    def rows_needed(self) -> int:
        return self.m

    def read_layer(self, layer: int, k: np.ndarray, v: np.ndarray) -> int:
        if layer in self.gate:
            assert self.gate[layer].wait(30)
        if layer == self.fail_at:
            raise SnapshotBlockCRC(f"layer {layer}: block CRC mismatch")
        k[:self.m], v[:self.m] = self.data[layer, 0, :self.m], self.data[layer, 1, :self.m]
        return self.data[layer, :, :self.m].nbytes

    def close(self) -> None:
        self.closed = True

    def done(self, restored) -> None:
        self.outcome = restored

    def failed(self, err: BaseException) -> SnapshotError:
        self.outcome = err
        return err if isinstance(err, SnapshotError) else SnapshotError(str(err))
