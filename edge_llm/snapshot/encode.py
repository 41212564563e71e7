"""Writing one VLKV file in one pass (full or delta); the layout is `layout.py`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import BinaryIO

import crc32c
import numpy as np

from edge_llm.config import Geometry
from edge_llm.kvcache import ImageSpan
from edge_llm.snapshot.layout import (
    FLAG_EXTENSION,
    FLAG_TRAILER,
    HEADER,
    U64,
    BaseRef,
    SnapshotHeader,
    byte_view,
    encode_extension,
    fnv1a64,
    write_all,
)

log = logging.getLogger("edge_llm.snapshot.format")


class SnapshotWriter:
    """Streaming writer: begin(), write_layer(l, k, v) for l = 0..L-1 in order, finish().

    `base`: write a delta that holds only rows [base.n_tokens, n) (the token ids are all stored).
    The header is written last, so a file cut short at any point fails its header or size checks.
    """

    def __init__(self, f: BinaryIO, tokens: Sequence[int] | np.ndarray, model_id: int,
                 geometry: Geometry, kv_bs: int, tokens_fnv: int | None = None,
                 spans: Sequence[ImageSpan] = (), base: BaseRef | None = None):
        ids = np.asarray(tokens, dtype=np.int64).ravel()
        if ids.size == 0:
            raise ValueError("a snapshot needs at least one token")
        if ids.min() < 0 or ids.max() > 0xFFFFFFFF:
            raise ValueError("token ids must fit in u32")
        if kv_bs <= 0:
            raise ValueError(f"kv_bs must be > 0, got {kv_bs}")
        if not 0 <= model_id <= U64:
            raise ValueError("model_id must fit in u64")
        if base is not None and not 1 <= base.n_tokens < ids.size:
            raise ValueError(f"a delta's base of {base.n_tokens} rows must be in [1, {ids.size})")
        self.f = f
        self.token_bytes = ids.astype("<u4").tobytes()
        if any(s.start >= ids.size for s in spans):
            raise ValueError("an image run starts beyond the snapshot's rows")
        self.ext = encode_extension(spans, base)
        self.hdr = SnapshotHeader(geometry.n_layers, geometry.n_kv_heads, geometry.head_dim, kv_bs,
                                  int(ids.size), geometry.kv_dim,
                                  fnv1a64(self.token_bytes) if tokens_fnv is None else tokens_fnv, model_id,
                                  FLAG_TRAILER | (FLAG_EXTENSION if self.ext else 0),
                                  ext_size=len(self.ext), spans=tuple(spans), base=base)
        self.crcs = np.zeros((geometry.n_layers, self.hdr.n_blocks, 2), dtype="<u4")
        self.next_layer = -1
        self.written = 0

    def begin(self) -> None:
        """Write a zeroed header placeholder (fails magic/CRC checks if never finalised) + token ids."""
        self.f.seek(0)
        write_all(self.f, memoryview(bytes(HEADER.size)))
        write_all(self.f, memoryview(self.token_bytes))
        if self.ext:
            write_all(self.f, memoryview(self.ext))
        self.written = HEADER.size + len(self.token_bytes) + len(self.ext)
        self.next_layer = 0

    def write_layer(self, layer: int, k_rows: np.ndarray, v_rows: np.ndarray) -> int:
        """Write K/V blocks of one layer from views of the row arrays (absolute row numbers: rows
        [row0, n) are written; no payload copies)."""
        if layer != self.next_layer:
            raise ValueError(f"write_layer({layer}): expected layer {self.next_layer} (begin() first, in order)")
        h, n = self.hdr, 0
        for b in range(h.n_blocks):
            start, stop = h.block_rows(b)
            for kv, arr in enumerate((k_rows, v_rows)):
                view = byte_view(arr, start, stop, h.kv_dim)
                self.crcs[layer, b, kv] = crc32c.crc32c(view)
                write_all(self.f, view)
                n += view.nbytes
        self.written += n
        self.next_layer += 1
        return n

    def finish(self) -> int:
        """Append the trailer, then write the real header at offset 0. Returns the file size."""
        if self.next_layer != self.hdr.n_layers:
            raise ValueError(f"finish(): {self.next_layer} of {self.hdr.n_layers} layers written")
        trailer = self.crcs.tobytes()
        write_all(self.f, memoryview(trailer))
        self.written += len(trailer)
        self.hdr = SnapshotHeader(**{**self.hdr.__dict__, "trailer_crc": crc32c.crc32c(trailer),
                                     "trailer": trailer})
        self.f.seek(0)
        write_all(self.f, memoryview(self.hdr.pack()))
        self.f.seek(self.written)
        self.f.flush()
        if self.written != self.hdr.file_size:  # a bug here would publish a file every reader rejects
            raise RuntimeError(f"wrote {self.written} bytes, format says {self.hdr.file_size}")
        log.debug("snapshot written: %d tokens (rows from %d), %d bytes, kv_bs %d", self.hdr.n_tokens,
                  self.hdr.row0, self.written, self.hdr.kv_bs)
        return self.written


def write_snapshot(f: BinaryIO, tokens: Sequence[int] | np.ndarray, model_id: int, geometry: Geometry,
                   kv_bs: int, rows: Callable[[int, int], np.ndarray], tokens_fnv: int | None = None,
                   spans: Sequence[ImageSpan] = (), base: BaseRef | None = None) -> int:
    """Write a whole snapshot; rows(layer, kv) -> (>= n_tokens, kv_dim) f32 array. Returns bytes.

    `tokens_fnv`: the ids' FNV-1a if the caller already has it (it named the file with it).
    `spans`: image runs among the rows; `base`: write a delta of rows [base.n_tokens, n) (both go
    to the extension section; neither = a plain v1 file)."""
    w = SnapshotWriter(f, tokens, model_id, geometry, kv_bs, tokens_fnv, spans, base)
    w.begin()
    for layer in range(geometry.n_layers):
        w.write_layer(layer, rows(layer, 0), rows(layer, 1))
    return w.finish()
