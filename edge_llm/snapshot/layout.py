"""VLKV version 1 layout: header, extension records, size formula, block map, raw I/O helpers.

Layout: 64-byte header | n_tokens u32 token ids | [extension section] | payload | trailer. The
optional extension section (flags bit 1; its byte length in the header's `reserved` field) holds
typed records: the image runs of a Qwen3-VL conversation (type 1) and, in a delta file, the
reference to its base (type 2). A file holds the K/V rows [row0, n_tokens): row0 = 0 for a full
file, the base's token count for a delta. Payload: for each layer, for each block of `kv_bs` rows
counted from row0, the K rows then the V rows (F32, the tail block holds only valid rows).
Trailer: CRC32C of every K block then V block, same order. Files without an extension section
are the plain v1 files. See docs/snapshot-format.md. Reading: `decode.py`; writing: `encode.py`.
"""

from __future__ import annotations

import io
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np

from edge_llm.config import Geometry
from edge_llm.errors import SnapshotExtension, SnapshotSize
from edge_llm.kvcache import ImageSpan

# magic, version, n_layers, n_kv_heads, head_dim, kv_bs, n_tokens, kv_dim, tokens_fnv (C engine, 0-39)
# model_id, flags, reserved, trailer_crc, header_crc (this product, 40-63)
HEADER = struct.Struct("<8IQQ4I")
HEADER_FIELDS = (  # (name, offset, size): the header table of docs/snapshot-format.md, for inspect
    ("magic", 0, 4), ("version", 4, 4), ("n_layers", 8, 4), ("n_kv_heads", 12, 4),
    ("head_dim", 16, 4), ("kv_bs", 20, 4), ("n_tokens", 24, 4), ("kv_dim", 28, 4),
    ("tokens_fnv", 32, 8), ("model_id", 40, 8), ("flags", 48, 4), ("reserved", 52, 4),
    ("trailer_crc", 56, 4), ("header_crc", 60, 4),
)
MAGIC = 0x564C4B56
VERSION = 1
FLAG_TRAILER = 1
FLAG_EXTENSION = 2  # an extension section follows the token ids; `reserved` holds its byte length
KNOWN_FLAGS = FLAG_TRAILER | FLAG_EXTENSION
EXT_MAX = 1 << 20  # an extension section is small (an image run record is 52 bytes)
EXT_RECORD = struct.Struct("<II")  # type, byte length of the record body
EXT_IMAGES = 1  # record: u32 count, then count x IMAGE_SPAN
IMAGE_SPAN = struct.Struct("<5I32s")  # start row, t, h, w, pos0, sha256 digest
EXT_BASE = 2  # record: BASE_REF (a delta file: rows [0, base_n) live in the base file)
BASE_REF = struct.Struct("<IIQ")  # base_n, the base's trailer_crc, the base's tokens_fnv
F32 = 4
FNV_OFFSET, FNV_PRIME, U64 = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
KV_NAMES = ("K", "V")


def fnv1a64(buf: bytes | bytearray | memoryview, cut: int | None = None) -> int | tuple[int, int]:
    """FNV-1a 64 over `buf` (token-id bytes: at most 32 KiB, a few ms in pure Python).

    With `cut`, returns (hash of buf[:cut], hash of buf) from one pass: FNV is a running state,
    so a delta's base name (the hash of its first base_n ids) costs nothing extra."""
    h, p, mask = FNV_OFFSET, FNV_PRIME, U64
    data = bytes(buf)
    for b in data[:cut] if cut is not None else data:
        h = ((h ^ b) * p) & mask
    if cut is None:
        return h
    head = h
    for b in data[cut:]:
        h = ((h ^ b) * p) & mask
    return head, h


def n_blocks(n_rows: int, kv_bs: int) -> int:
    return -(-n_rows // kv_bs)


def snapshot_size(n_layers: int, n_tokens: int, kv_dim: int, kv_bs: int, ext_size: int = 0,
                  row0: int = 0) -> int:
    """Exact file size: 64 + 4n + E + 2*L*r*kv_dim*4 + 8*L*ceil(r / kv_bs), r = n - row0 rows held
    (row0 = 0 for a full file, base_n for a delta; E = extension section bytes)."""
    r = n_tokens - row0
    return HEADER.size + 4 * n_tokens + ext_size + 2 * n_layers * r * kv_dim * F32 + 8 * n_layers * n_blocks(r, kv_bs)


# a snapshot's file name: the FNV-1a 64 of its token ids; the one definition of the pattern
# (a glob for directory scans, a regex for names given by a user or found in a log line)
SNAPSHOT_GLOB = "kv_*.kv"
SNAPSHOT_NAME = r"kv_[0-9a-f]{16}\.kv"  # unanchored, to embed in other patterns
SNAPSHOT_RE = re.compile(rf"^{SNAPSHOT_NAME}\Z")  # \Z: `$` would let a final newline through


def snapshot_name(tokens_fnv: int) -> str:
    return "kv_%016x.kv" % tokens_fnv


def is_snapshot_name(name: str) -> bool:
    return SNAPSHOT_RE.match(name) is not None


@dataclass(frozen=True)
class BaseRef:
    """A delta file's base: the file holding rows [0, n_tokens) of the same token ids."""

    n_tokens: int  # base_n: the delta holds rows [n_tokens, its own n_tokens)
    trailer_crc: int  # the base's trailer_crc: a digest of exactly the rows it holds
    tokens_fnv: int  # FNV-1a of the first n_tokens ids: the base's file name

    @property
    def name(self) -> str:
        return snapshot_name(self.tokens_fnv)


def encode_extension(spans: Sequence[ImageSpan] = (), base: BaseRef | None = None) -> bytes:
    """The extension section for these image runs and base reference (b"" if neither)."""
    records = b""
    if spans:
        body = struct.pack("<I", len(spans)) + b"".join(
            IMAGE_SPAN.pack(s.start, *s.grid, s.pos0, s.digest) for s in spans)
        records += EXT_RECORD.pack(EXT_IMAGES, len(body)) + body  # bodies are multiples of 4 bytes
    if base is not None:
        records += EXT_RECORD.pack(EXT_BASE, BASE_REF.size) + BASE_REF.pack(
            base.n_tokens, base.trailer_crc, base.tokens_fnv)
    if not records:
        return b""
    return records + struct.pack("<I", crc32c.crc32c(records))


def decode_extension(raw: bytes, n_tokens: int) -> tuple[tuple[ImageSpan, ...], BaseRef | None]:
    """Parse + validate an extension section: (image runs, base reference or None).

    SnapshotExtension names what is wrong. The base's tokens_fnv is checked against the ids by
    the caller (decode.read_header), which hashes them anyway."""
    if crc32c.crc32c(raw[:-4]) != struct.unpack_from("<I", raw, len(raw) - 4)[0]:
        raise SnapshotExtension("extension section fails its CRC32C")
    spans: list[ImageSpan] = []
    base: BaseRef | None = None
    seen: set[int] = set()
    off, end = 0, len(raw) - 4
    while off < end:
        if off + EXT_RECORD.size > end:
            raise SnapshotExtension(f"extension record header at {off} runs past the section")
        tag, length = EXT_RECORD.unpack_from(raw, off)
        off += EXT_RECORD.size
        if length > end - off:
            raise SnapshotExtension(f"extension record {tag} ({length} bytes) runs past the section")
        if tag in seen:
            raise SnapshotExtension(f"extension record type {tag} appears twice")
        seen.add(tag)
        if tag == EXT_IMAGES:
            spans = _decode_images(raw, off, length, n_tokens)
        elif tag == EXT_BASE:
            if length != BASE_REF.size:
                raise SnapshotExtension(f"base record of {length} bytes (expected {BASE_REF.size})")
            base = BaseRef(*BASE_REF.unpack_from(raw, off))
            if not 1 <= base.n_tokens < n_tokens:
                raise SnapshotExtension(f"base of {base.n_tokens} rows outside [1, {n_tokens})")
        else:
            raise SnapshotExtension(f"unknown extension record type {tag}")
        off += length
    return tuple(spans), base


def _decode_images(raw: bytes, off: int, length: int, n_tokens: int) -> list[ImageSpan]:
    (count,) = struct.unpack_from("<I", raw, off)
    if length != 4 + count * IMAGE_SPAN.size:
        raise SnapshotExtension(f"image record of {length} bytes cannot hold {count} runs")
    spans: list[ImageSpan] = []
    for i in range(count):
        start, t, h, w, pos0, digest = IMAGE_SPAN.unpack_from(raw, off + 4 + i * IMAGE_SPAN.size)
        if min(t, h, w) < 1 or start >= n_tokens or (spans and start < spans[-1].end):
            raise SnapshotExtension(f"image run {i} (rows from {start}, grid {t}x{h}x{w}) is not "
                                    f"inside the file's {n_tokens} rows in order")
        spans.append(ImageSpan(start, (t, h, w), pos0, digest))
    return spans


@dataclass(frozen=True)
class SnapshotHeader:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    kv_bs: int
    n_tokens: int
    kv_dim: int
    tokens_fnv: int
    model_id: int
    flags: int = FLAG_TRAILER
    trailer_crc: int = 0
    header_crc: int = 0
    ext_size: int = 0  # bytes of the extension section (the header's `reserved` field)
    spans: tuple[ImageSpan, ...] = ()  # image runs (from the extension section)
    base: BaseRef | None = None  # a delta's base (from the extension section); None: a full file
    # the CRC-checked trailer bytes (set by read_header), so a restore needs no second trailer read
    trailer: bytes = field(default=b"", repr=False, compare=False)

    @property
    def row0(self) -> int:
        """First row held by the file: 0, or the base's token count for a delta."""
        return 0 if self.base is None else self.base.n_tokens

    @property
    def n_rows(self) -> int:
        return self.n_tokens - self.row0

    @property
    def n_blocks(self) -> int:
        return n_blocks(self.n_rows, self.kv_bs)

    @property
    def file_size(self) -> int:
        return snapshot_size(self.n_layers, self.n_tokens, self.kv_dim, self.kv_bs, self.ext_size, self.row0)

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.n_layers, self.n_kv_heads, self.head_dim)

    @property
    def tokens_offset(self) -> int:
        return HEADER.size

    @property
    def ext_offset(self) -> int:
        return HEADER.size + 4 * self.n_tokens

    @property
    def payload_offset(self) -> int:
        return HEADER.size + 4 * self.n_tokens + self.ext_size

    @property
    def layer_bytes(self) -> int:
        return 2 * self.n_rows * self.kv_dim * F32

    @property
    def trailer_offset(self) -> int:
        return self.payload_offset + self.n_layers * self.layer_bytes

    @property
    def trailer_size(self) -> int:
        return 8 * self.n_layers * self.n_blocks

    def block_rows(self, block: int) -> tuple[int, int]:
        """Rows [start, stop) held by `block` (blocks count from row0; the tail block holds only
        valid rows)."""
        start = self.row0 + block * self.kv_bs
        return start, min(self.n_tokens, start + self.kv_bs)

    def block_offset(self, layer: int, block: int, kv: int) -> int:
        """File offset of the K (kv=0) or V (kv=1) bytes of one block."""
        start, stop = self.block_rows(block)
        row = self.kv_dim * F32
        return (self.payload_offset + layer * self.layer_bytes + 2 * (start - self.row0) * row
                + kv * (stop - start) * row)

    def block_crc(self, layer: int, block: int, kv: int) -> int:
        """Stored CRC32C of a block, from the trailer read by read_header."""
        return struct.unpack_from("<I", self.trailer, 4 * (2 * (layer * self.n_blocks + block) + kv))[0]

    def rows_needed(self, m: int) -> int:
        """Rows a read of this file's rows below m writes: whole blocks, so up to the end of the
        block holding row m-1 (m in (row0, n_tokens])."""
        return self.block_rows(n_blocks(m - self.row0, self.kv_bs) - 1)[1]

    def pack(self) -> bytes:
        """The 64 header bytes, header_crc computed over bytes 0..59 (self.header_crc ignored)."""
        head = HEADER.pack(MAGIC, VERSION, self.n_layers, self.n_kv_heads, self.head_dim, self.kv_bs,
                           self.n_tokens, self.kv_dim, self.tokens_fnv, self.model_id, self.flags, self.ext_size,
                           self.trailer_crc, 0)
        return head[:60] + struct.pack("<I", crc32c.crc32c(head[:60]))


# ---- low-level I/O -------------------------------------------------------------------------------
def fileno(f: Any) -> int | None:
    try:
        return f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def pread_into(f: Any, views: list[memoryview], offset: int) -> int:
    """Fill every view (byte memoryviews) from consecutive file bytes at `offset`; all or raise.

    One preadv per group of <= IOV_MAX views straight into the destinations (no copies); a short
    read means the file shrank after its size was checked: SnapshotSize, never partial success.
    """
    total = sum(v.nbytes for v in views)
    fd = fileno(f)
    pending = [v for v in views if v.nbytes]
    pos = offset
    while pending:
        if fd is not None:
            got = os.preadv(fd, pending[:_IOV_MAX], pos)
        else:
            f.seek(pos)
            got = f.readinto(pending[0]) or 0
        if got <= 0:
            raise SnapshotSize(f"short read at offset {pos}: file changed while reading")
        pos += got
        while got and pending:  # drop filled views, trim a partly filled one
            if got >= pending[0].nbytes:
                got -= pending.pop(0).nbytes
            else:
                pending[0], got = pending[0][got:], 0
    return total


def read_exact(f: Any, offset: int, size: int) -> bytearray:
    buf = bytearray(size)
    pread_into(f, [memoryview(buf)], offset)
    return buf


def write_all(f: Any, view: memoryview) -> None:
    while view.nbytes:  # raw (unbuffered) files may accept fewer bytes than asked
        n = f.write(view)
        if not n:  # None: a non-blocking file would drop data silently; snapshots never use one
            raise OSError(f"write accepted {n!r} of {view.nbytes} bytes")
        view = view[n:]


def byte_view(arr: np.ndarray, start: int, stop: int, kv_dim: int, writable: bool = False) -> memoryview:
    """Byte view of rows [start, stop) of a (rows, kv_dim) float32 C-contiguous array."""
    if (not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.ndim != 2
            or arr.shape[1] != kv_dim or not arr.flags.c_contiguous):
        raise ValueError(f"KV rows must be a C-contiguous float32 (rows, {kv_dim}) array, "
                         f"got {getattr(arr, 'dtype', type(arr))} {getattr(arr, 'shape', '')}")
    if writable and not arr.flags.writeable:
        raise ValueError("destination KV array is read-only")
    if arr.shape[0] < stop:
        raise ValueError(f"KV rows array has {arr.shape[0]} rows, need {stop}")
    return memoryview(arr[start:stop]).cast("B")


def file_size(f: Any) -> int:
    fd = fileno(f)
    if fd is not None:
        return os.fstat(fd).st_size
    return f.seek(0, io.SEEK_END)
