"""Reading a chain of snapshot files: the rows a restore or a compaction reads, layer by layer.

`ChainRead` opens every file of a hit's chain (root first), re-validates each header against the
index (ids compared, not re-hashed; the base links against the headers) and reads, per layer,
each file's rows below m straight into the destination arrays, every block CRC-checked before
the layer counts. It is the `RowSource` a restore reads from (edge_llm/kvcache/cache.py runs the
restore, sequential or pipelined); the store accounts for the read and quarantines a bad file
through `done` / `failed`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from edge_llm.config import Geometry
from edge_llm.errors import SnapshotBaseMismatch, SnapshotError, SnapshotNotRegular
from edge_llm.files import open_regular
from edge_llm.kvcache import ImageSpan, Restored
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot.entries import Entry

log = logging.getLogger("edge_llm.kvdisk")

# scan/read bound: well above any save cap, so lowering --disk-kv-max-tokens doesn't reject
# valid older files; token ids are read only after the size checks anyway
READ_MAX_TOKENS = 1 << 18


class ChainReadError(SnapshotError):
    """Wraps the error of one file of a chain; `entry` is the file to quarantine."""

    def __init__(self, entry: Entry, err: BaseException):
        super().__init__(f"{entry.name}: {err}")
        self.entry, self.err = entry, err
        self.reason = getattr(err, "reason", "read-error")


class ChainRead:
    """The files of one chain opened and validated for a restore of rows [0, m)."""

    def __init__(self, chain: Sequence[Entry], m: int, geometry: Geometry, model_id: int, max_seq: int):
        self.name = chain[-1].name
        self.parts: list[tuple[Entry, object, fmt.SnapshotHeader]] = []
        try:
            prev: fmt.SnapshotHeader | None = None
            for e in chain:
                if prev is not None and e.row0 >= m:
                    break  # rows [0, m) all lie below this delta
                try:
                    # a FIFO swapped in after the scan is refused unread (a plain open would block)
                    f = open_regular(e.path, SnapshotNotRegular, buffering=0)
                except (SnapshotError, OSError) as err:
                    raise ChainReadError(e, err) from err
                self.parts.append((e, f, None))  # type: ignore[arg-type]
                try:
                    hdr, _ = fmt.read_header(f, geometry, model_id, READ_MAX_TOKENS, known_tokens=e.tokens)
                    if prev is not None and (hdr.base is None or hdr.base.n_tokens != prev.n_tokens
                                             or hdr.base.trailer_crc != prev.trailer_crc):
                        raise SnapshotBaseMismatch(f"its base is not {chain[0].name}'s chain as indexed")
                except (SnapshotError, OSError) as err:
                    raise ChainReadError(e, err) from err
                self.parts[-1] = (e, f, hdr)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                prev = hdr
            last = self.parts[-1][2]
            m = min(m, last.n_tokens)
            # whole blocks are read: stay within the cache (max_seq need not be a block multiple)
            while m > last.row0 and last.rows_needed(m) > max_seq:
                m = last.row0 + (fmt.n_blocks(m - last.row0, last.kv_bs) - 1) * last.kv_bs
            if m <= last.row0:  # the last file cannot contribute a whole block: stop below it
                if len(self.parts) == 1:
                    raise ChainReadError(chain[-1], SnapshotError(
                        f"cache of {max_seq} rows cannot hold one block of {last.kv_bs}"))
                self.close(self.parts[-1:])
                self.parts.pop()
                m = last.row0
            self.m = m
            self.tokens: list[int] = chain[-1].tokens[:m].tolist()
            self.spans: tuple[ImageSpan, ...] = chain[-1].spans
        except BaseException:
            self.close()
            raise

    @property
    def rows_needed(self) -> int:
        last = self.parts[-1][2]
        return last.rows_needed(self.m)

    @property
    def files(self) -> list[str]:
        return [e.name for e, _, _ in self.parts]

    def read_layer(self, layer: int, k, v) -> int:
        """Rows [0, m) of one layer from every file of the chain, each block CRC-checked."""
        total = 0
        for e, f, hdr in self.parts:
            try:
                total += fmt.read_layer_into(f, hdr, layer, min(self.m, hdr.n_tokens), k, v)
            except (SnapshotError, OSError) as err:
                raise ChainReadError(e, err) from err
        return total

    def close(self, parts=None) -> None:
        for _, f, _ in parts if parts is not None else self.parts:
            try:
                f.close()  # type: ignore[attr-defined]
            except OSError:
                pass

    def done(self, restored: Restored) -> None:
        """A restore read the rows (the store's subclass accounts for it)."""

    def failed(self, err: BaseException) -> SnapshotError:
        """A read failed: the error to raise (the store's subclass quarantines first)."""
        return err if isinstance(err, SnapshotError) else SnapshotError(f"{self.name}: read failed: {err}")
