"""Reading a chain of snapshot files back into the KV cache, sequentially or pipelined by layer.

`ChainRead` opens every file of a hit's chain (root first), re-validates each header against the
index (ids compared, not re-hashed; the base links against the headers) and reads, per layer,
each file's rows below m straight into the cache arrays, every block CRC-checked before the layer
counts. `PipelinedRestore` does that in one reader thread under the cache's `RestoreLease`
(edge_llm/kvcache.py): layer l becomes usable to the model as soon as it is read and checked,
while layer l+1 is being read. A failure leaves the lease failed, so the model never computes on
an unchecked row; the store then resets the cache and quarantines the bad file.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from edge_llm.config import Geometry
from edge_llm.errors import SnapshotBaseMismatch, SnapshotError
from edge_llm.kvcache import KVCache, RestoreLease
from edge_llm.progress import Cancelled, Work
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot.index import Entry

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
        self.parts: list[tuple[Entry, object, fmt.SnapshotHeader]] = []
        try:
            prev: fmt.SnapshotHeader | None = None
            for e in chain:
                if prev is not None and e.row0 >= m:
                    break  # rows [0, m) all lie below this delta
                f = open(e.path, "rb", buffering=0)
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


class PipelinedRestore:
    """One reader thread filling the cache layer by layer under a RestoreLease; `join()` waits
    for it and returns (bytes read, seconds) or raises the reader's error."""

    def __init__(self, reader: ChainRead, cache: KVCache, tokens: Sequence[int], spans, work: Work):
        self.reader, self.cache = reader, cache
        self.lease: RestoreLease = cache.begin_restore(reader.rows_needed, tokens, spans)
        self.cancel_only = Work(cancel=work.cancel)  # no progress calls from this thread
        self.nbytes, self.error = 0, None
        self.t0 = time.monotonic()
        self.read_s = 0.0
        self.thread = threading.Thread(target=self._run, name="kv-disk-reader", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n_layers = self.cache.geometry.n_layers
        try:
            for layer in range(n_layers):
                if self.cancel_only.cancelled:
                    raise Cancelled("restore", layer, n_layers)
                k = self.cache.restore_rows(layer, 0, self.cancel_only)  # waits for a pending save
                v = self.cache.restore_rows(layer, 1, self.cancel_only)
                self.nbytes += self.reader.read_layer(layer, k, v)
                self.lease.layer_ready(layer + 1)
        except BaseException as e:  # noqa: BLE001 - handed to join() in the request thread
            self.error = e
            self.lease.fail(e)
        finally:
            self.read_s = time.monotonic() - self.t0
            self.reader.close()

    def join(self) -> tuple[int, float]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.nbytes, self.read_s

    def end(self) -> None:
        """Release the lease (after join(), and after a failure was handled)."""
        self.lease.end()


def write_compacted(f, reader: ChainRead, tip: Entry, geometry: Geometry, model_id: int, kv_bs: int,
                    should_stop, done: list) -> int:
    """Write the chain's rows [0, n) as one full file, layer by layer through one reused buffer
    (every block CRC-checked on the way in). Raises InterruptedError if should_stop() turns true
    between layers (a save arrived: it goes first). Appends the finished writer to `done`."""
    n = tip.n_tokens
    buf = np.empty((2, n + kv_bs, geometry.kv_dim), np.float32)  # + kv_bs: whole-block reads
    w = fmt.SnapshotWriter(f, tip.tokens, model_id, geometry, kv_bs, tip.tokens_fnv, tip.spans)
    w.begin()
    for layer in range(geometry.n_layers):
        if should_stop():
            raise InterruptedError("a save is waiting")
        reader.read_layer(layer, buf[0], buf[1])
        w.write_layer(layer, buf[0], buf[1])
    done.append(w)
    return w.finish()
