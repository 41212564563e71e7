"""VLKV version 1: one KV snapshot file (docs/snapshot-format.md). Knows nothing of directories.

Layout: 64-byte header | n_tokens u32 token ids | [extension section] | payload | trailer. The
optional extension section (flags bit 1; its byte length in the header's `reserved` field) holds
typed records, e.g. the image runs of a Qwen3-VL conversation; files without it are plain v1. Payload: for each layer, for
each block of `kv_bs` rows, the K rows then the V rows (F32, tail block holds only valid rows).
Trailer: CRC32C of every K block then V block, same order. See docs/snapshot-format.md.
"""

from __future__ import annotations

import io
import logging
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import crc32c
import numpy as np

from edge_llm.config import Geometry
from edge_llm.errors import (
    SnapshotBadMagic,
    SnapshotBadVersion,
    SnapshotBlockCRC,
    SnapshotExtension,
    SnapshotFlags,
    SnapshotGeometry,
    SnapshotHeaderCRC,
    SnapshotKVDim,
    SnapshotModelID,
    SnapshotSize,
    SnapshotTokenCount,
    SnapshotTokenHash,
    SnapshotTooShort,
    SnapshotTrailerCRC,
)
from edge_llm.kvcache import ImageSpan
from edge_llm.settings import DEFAULTS

log = logging.getLogger(__name__)

# magic, version, n_layers, n_kv_heads, head_dim, kv_bs, n_tokens, kv_dim, tokens_fnv (C engine, 0-39)
# model_id, flags, reserved, trailer_crc, header_crc (this product, 40-63)
HEADER = struct.Struct("<8IQQ4I")
HEADER_FIELDS = (  # (name, offset, size): the header table of docs/snapshot-format.md, used by inspect.describe()
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
EXT_RECORD = struct.Struct("<II")  # tag, length of the record body
EXT_IMAGES = 1  # record: u32 count, then count x IMAGE_SPAN
IMAGE_SPAN = struct.Struct("<5I32s")  # start row, t, h, w, pos0, sha256 digest
F32 = 4
FNV_OFFSET, FNV_PRIME, U64 = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
KV_NAMES = ("K", "V")


def fnv1a64(buf: bytes | bytearray | memoryview) -> int:
    """FNV-1a 64 over `buf` (token-id bytes: at most 32 KiB, a few ms in pure Python)."""
    h, p, mask = FNV_OFFSET, FNV_PRIME, U64
    for b in bytes(buf):
        h = ((h ^ b) * p) & mask
    return h


def n_blocks(n_tokens: int, kv_bs: int) -> int:
    return -(-n_tokens // kv_bs)


def snapshot_size(n_layers: int, n_tokens: int, kv_dim: int, kv_bs: int, ext_size: int = 0) -> int:
    """Exact file size: 64 + 4n + E + 2*L*n*kv_dim*4 + 8*L*B (B = ceil(n / kv_bs), E = extension)."""
    return (HEADER.size + 4 * n_tokens + ext_size + 2 * n_layers * n_tokens * kv_dim * F32
            + 8 * n_layers * n_blocks(n_tokens, kv_bs))


def encode_extension(spans: Sequence[ImageSpan]) -> bytes:
    """The extension section for these image runs (b"" if none): records + CRC32C of them."""
    if not spans:
        return b""
    body = struct.pack("<I", len(spans)) + b"".join(
        IMAGE_SPAN.pack(s.start, *s.grid, s.pos0, s.digest) for s in spans)
    records = EXT_RECORD.pack(EXT_IMAGES, len(body)) + body  # body is a multiple of 4 bytes
    return records + struct.pack("<I", crc32c.crc32c(records))


def decode_extension(raw: bytes, n_tokens: int) -> tuple[ImageSpan, ...]:
    """Parse + validate an extension section; SnapshotExtension names what is wrong."""
    if crc32c.crc32c(raw[:-4]) != struct.unpack_from("<I", raw, len(raw) - 4)[0]:
        raise SnapshotExtension("extension section fails its CRC32C")
    spans: list[ImageSpan] = []
    off, end = 0, len(raw) - 4
    while off < end:
        if off + EXT_RECORD.size > end:
            raise SnapshotExtension(f"extension record header at {off} runs past the section")
        tag, length = EXT_RECORD.unpack_from(raw, off)
        off += EXT_RECORD.size
        if length > end - off:
            raise SnapshotExtension(f"extension record {tag} ({length} bytes) runs past the section")
        if tag != EXT_IMAGES:
            raise SnapshotExtension(f"unknown extension record type {tag}")
        (count,) = struct.unpack_from("<I", raw, off)
        if length != 4 + count * IMAGE_SPAN.size:
            raise SnapshotExtension(f"image record of {length} bytes cannot hold {count} runs")
        for i in range(count):
            start, t, h, w, pos0, digest = IMAGE_SPAN.unpack_from(raw, off + 4 + i * IMAGE_SPAN.size)
            span = ImageSpan(start, (t, h, w), pos0, digest)
            if min(t, h, w) < 1 or start >= n_tokens or (spans and start < spans[-1].end):
                raise SnapshotExtension(f"image run {i} (rows from {start}, grid {t}x{h}x{w}) is not "
                                        f"inside the file's {n_tokens} rows in order")
            spans.append(span)
        off += length
    return tuple(spans)


def snapshot_name(tokens_fnv: int) -> str:
    return "kv_%016x.kv" % tokens_fnv


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
    # the CRC-checked trailer bytes (set by read_header), so a restore needs no second trailer read
    trailer: bytes = field(default=b"", repr=False, compare=False)

    @property
    def n_blocks(self) -> int:
        return n_blocks(self.n_tokens, self.kv_bs)

    @property
    def file_size(self) -> int:
        return snapshot_size(self.n_layers, self.n_tokens, self.kv_dim, self.kv_bs, self.ext_size)

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
        return 2 * self.n_tokens * self.kv_dim * F32

    @property
    def trailer_offset(self) -> int:
        return self.payload_offset + self.n_layers * self.layer_bytes

    @property
    def trailer_size(self) -> int:
        return 8 * self.n_layers * self.n_blocks

    def block_rows(self, block: int) -> tuple[int, int]:
        """Rows [start, stop) held by `block` (the tail block holds only valid rows)."""
        start = block * self.kv_bs
        return start, min(self.n_tokens, start + self.kv_bs)

    def block_offset(self, layer: int, block: int, kv: int) -> int:
        """File offset of the K (kv=0) or V (kv=1) bytes of one block."""
        start, stop = self.block_rows(block)
        row = self.kv_dim * F32
        return self.payload_offset + layer * self.layer_bytes + 2 * start * row + kv * (stop - start) * row

    def block_crc(self, layer: int, block: int, kv: int) -> int:
        """Stored CRC32C of a block, from the trailer read by read_header."""
        return struct.unpack_from("<I", self.trailer, 4 * (2 * (layer * self.n_blocks + block) + kv))[0]

    def pack(self) -> bytes:
        """The 64 header bytes, header_crc computed over bytes 0..59 (self.header_crc ignored)."""
        head = HEADER.pack(MAGIC, VERSION, self.n_layers, self.n_kv_heads, self.head_dim, self.kv_bs,
                           self.n_tokens, self.kv_dim, self.tokens_fnv, self.model_id, self.flags, self.ext_size,
                           self.trailer_crc, 0)
        return head[:60] + struct.pack("<I", crc32c.crc32c(head[:60]))


# ---- low-level I/O -------------------------------------------------------------------------------
def _fileno(f: Any) -> int | None:
    try:
        return f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _pread_into(f: Any, views: list[memoryview], offset: int) -> int:
    """Fill every view (byte memoryviews) from consecutive file bytes at `offset`; all or raise.

    One preadv per group of <= IOV_MAX views straight into the destinations (no copies); a short
    read means the file shrank after its size was checked: SnapshotSize, never partial success.
    """
    total = sum(v.nbytes for v in views)
    fd = _fileno(f)
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


def _read_exact(f: Any, offset: int, size: int) -> bytearray:
    buf = bytearray(size)
    _pread_into(f, [memoryview(buf)], offset)
    return buf


def _write_all(f: Any, view: memoryview) -> None:
    while view.nbytes:  # raw (unbuffered) files may accept fewer bytes than asked
        n = f.write(view)
        if not n:  # None: a non-blocking file would drop data silently; snapshots never use one
            raise OSError(f"write accepted {n!r} of {view.nbytes} bytes")
        view = view[n:]


def _byte_view(arr: np.ndarray, start: int, stop: int, kv_dim: int, writable: bool = False) -> memoryview:
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


# ---- writing ---------------------------------------------------------------------------------------
class SnapshotWriter:
    """Streaming writer: begin(), write_layer(l, k, v) for l = 0..L-1 in order, finish().

    The header is written last, so a file cut short at any point fails its header or size checks.
    """

    def __init__(self, f: BinaryIO, tokens: Sequence[int] | np.ndarray, model_id: int,
                 geometry: Geometry, kv_bs: int, tokens_fnv: int | None = None,
                 spans: Sequence[ImageSpan] = ()):
        ids = np.asarray(tokens, dtype=np.int64).ravel()
        if ids.size == 0:
            raise ValueError("a snapshot needs at least one token")
        if ids.min() < 0 or ids.max() > 0xFFFFFFFF:
            raise ValueError("token ids must fit in u32")
        if kv_bs <= 0:
            raise ValueError(f"kv_bs must be > 0, got {kv_bs}")
        if not 0 <= model_id <= U64:
            raise ValueError("model_id must fit in u64")
        self.f = f
        self.token_bytes = ids.astype("<u4").tobytes()
        if any(s.start >= ids.size for s in spans):
            raise ValueError("an image run starts beyond the snapshot's rows")
        self.ext = encode_extension(spans)
        self.hdr = SnapshotHeader(geometry.n_layers, geometry.n_kv_heads, geometry.head_dim, kv_bs,
                                  int(ids.size), geometry.kv_dim,
                                  fnv1a64(self.token_bytes) if tokens_fnv is None else tokens_fnv, model_id,
                                  FLAG_TRAILER | (FLAG_EXTENSION if self.ext else 0),
                                  ext_size=len(self.ext), spans=tuple(spans))
        self.crcs = np.zeros((geometry.n_layers, self.hdr.n_blocks, 2), dtype="<u4")
        self.next_layer = -1
        self.written = 0

    def begin(self) -> None:
        """Write a zeroed header placeholder (fails magic/CRC checks if never finalised) + token ids."""
        self.f.seek(0)
        _write_all(self.f, memoryview(bytes(HEADER.size)))
        _write_all(self.f, memoryview(self.token_bytes))
        if self.ext:
            _write_all(self.f, memoryview(self.ext))
        self.written = HEADER.size + len(self.token_bytes) + len(self.ext)
        self.next_layer = 0

    def write_layer(self, layer: int, k_rows: np.ndarray, v_rows: np.ndarray) -> int:
        """Write K/V blocks of one layer from views of the row arrays (no payload copies)."""
        if layer != self.next_layer:
            raise ValueError(f"write_layer({layer}): expected layer {self.next_layer} (begin() first, in order)")
        h, n = self.hdr, 0
        for b in range(h.n_blocks):
            start, stop = h.block_rows(b)
            for kv, arr in enumerate((k_rows, v_rows)):
                view = _byte_view(arr, start, stop, h.kv_dim)
                self.crcs[layer, b, kv] = crc32c.crc32c(view)
                _write_all(self.f, view)
                n += view.nbytes
        self.written += n
        self.next_layer += 1
        return n

    def finish(self) -> int:
        """Append the trailer, then write the real header at offset 0. Returns the file size."""
        if self.next_layer != self.hdr.n_layers:
            raise ValueError(f"finish(): {self.next_layer} of {self.hdr.n_layers} layers written")
        trailer = self.crcs.tobytes()
        _write_all(self.f, memoryview(trailer))
        self.written += len(trailer)
        self.hdr = SnapshotHeader(**{**self.hdr.__dict__, "trailer_crc": crc32c.crc32c(trailer),
                                     "trailer": trailer})
        self.f.seek(0)
        _write_all(self.f, memoryview(self.hdr.pack()))
        self.f.seek(self.written)
        self.f.flush()
        if self.written != self.hdr.file_size:  # a bug here would publish a file every reader rejects
            raise RuntimeError(f"wrote {self.written} bytes, format says {self.hdr.file_size}")
        log.debug("snapshot written: %d tokens, %d bytes, kv_bs %d", self.hdr.n_tokens, self.written,
                  self.hdr.kv_bs)
        return self.written


def write_snapshot(f: BinaryIO, tokens: Sequence[int] | np.ndarray, model_id: int, geometry: Geometry,
                   kv_bs: int, rows: Callable[[int, int], np.ndarray], tokens_fnv: int | None = None,
                   spans: Sequence[ImageSpan] = ()) -> int:
    """Write a whole snapshot; rows(layer, kv) -> (>= n_tokens, kv_dim) f32 array. Returns bytes.

    `tokens_fnv`: the ids' FNV-1a if the caller already has it (it named the file with it).
    `spans`: image runs among the rows (written to the extension section; none = plain v1)."""
    w = SnapshotWriter(f, tokens, model_id, geometry, kv_bs, tokens_fnv, spans)
    w.begin()
    for layer in range(geometry.n_layers):
        w.write_layer(layer, rows(layer, 0), rows(layer, 1))
    return w.finish()


# ---- reading ---------------------------------------------------------------------------------------
def _file_size(f: Any) -> int:
    fd = _fileno(f)
    if fd is not None:
        return os.fstat(fd).st_size
    return f.seek(0, io.SEEK_END)


def read_header(f: BinaryIO, geometry: Geometry | None, model_id: int | None,
                max_tokens: int | None = DEFAULTS.disk_kv_max_tokens,
                file_size: int | None = None) -> tuple[SnapshotHeader, np.ndarray]:
    """Validate everything but the payload, in the documented order (docs/snapshot-format.md); return (header, token ids as uint32).

    geometry / model_id / max_tokens None = don't check (inspecting foreign files). Each failure
    raises its own SnapshotError subclass; no buffer is sized from a field before the exact file
    size has been checked against it.
    """
    size = _file_size(f) if file_size is None else file_size
    if size < HEADER.size:
        raise SnapshotTooShort(f"file is {size} bytes, shorter than the {HEADER.size}-byte header")
    raw = bytes(_read_exact(f, 0, HEADER.size))
    (magic, version, n_layers, n_kv_heads, head_dim, kv_bs, n_tokens, kv_dim, tokens_fnv, mid, flags,
     reserved, trailer_crc, header_crc) = HEADER.unpack(raw)
    if magic != MAGIC:
        raise SnapshotBadMagic(f"magic {raw[:4].hex(' ')} is not VLKV (56 4b 4c 56)")
    if version != VERSION:
        raise SnapshotBadVersion(f"version {version} is not supported (this runtime reads {VERSION})")
    if crc32c.crc32c(raw[:60]) != header_crc:
        raise SnapshotHeaderCRC(f"header CRC32C {crc32c.crc32c(raw[:60]):08x} != stored {header_crc:08x}")
    if not flags & FLAG_TRAILER or flags & ~KNOWN_FLAGS:
        raise SnapshotFlags(f"flags {flags:#x}: expected {FLAG_TRAILER:#x}, optionally | {FLAG_EXTENSION:#x}")
    if flags & FLAG_EXTENSION:
        if not (EXT_RECORD.size + 4 < reserved <= EXT_MAX and reserved % 4 == 0):
            raise SnapshotFlags(f"extension size {reserved} outside ({EXT_RECORD.size + 4}, {EXT_MAX}] "
                                "or not a multiple of 4")
    elif reserved != 0:
        raise SnapshotFlags(f"reserved {reserved:#x} must be 0 without the extension flag")
    got = (n_layers, n_kv_heads, head_dim)
    if geometry is not None and got != (geometry.n_layers, geometry.n_kv_heads, geometry.head_dim):
        raise SnapshotGeometry(f"snapshot geometry (layers, kv heads, head_dim) {got} != model "
                               f"{(geometry.n_layers, geometry.n_kv_heads, geometry.head_dim)}")
    if min(got) == 0 or kv_bs == 0:
        raise SnapshotGeometry(f"zero-sized geometry field: layers, kv heads, head_dim {got}, kv_bs {kv_bs}")
    if kv_dim != n_kv_heads * head_dim:
        raise SnapshotKVDim(f"kv_dim {kv_dim} != n_kv_heads * head_dim = {n_kv_heads * head_dim}")
    if n_tokens < 1 or (max_tokens is not None and n_tokens > max_tokens):
        raise SnapshotTokenCount(f"n_tokens {n_tokens} outside 1..{max_tokens}")
    hdr = SnapshotHeader(n_layers, n_kv_heads, head_dim, kv_bs, n_tokens, kv_dim, tokens_fnv, mid, flags,
                         trailer_crc, header_crc, ext_size=reserved)
    if size != hdr.file_size:
        raise SnapshotSize(f"file is {size} bytes, header implies {hdr.file_size}")
    if model_id is not None and mid != model_id:
        raise SnapshotModelID(f"model_id {mid:016x} != loaded model {model_id:016x}")
    token_bytes = _read_exact(f, HEADER.size, 4 * n_tokens)
    if (actual := fnv1a64(token_bytes)) != tokens_fnv:
        raise SnapshotTokenHash(f"token ids hash to {actual:016x}, header says {tokens_fnv:016x}")
    spans: tuple[ImageSpan, ...] = ()
    if hdr.ext_size:
        spans = decode_extension(bytes(_read_exact(f, hdr.ext_offset, hdr.ext_size)), n_tokens)
    trailer = bytes(_read_exact(f, hdr.trailer_offset, hdr.trailer_size))
    if crc32c.crc32c(trailer) != trailer_crc:
        raise SnapshotTrailerCRC(f"trailer CRC32C {crc32c.crc32c(trailer):08x} != stored {trailer_crc:08x}")
    tokens = np.frombuffer(token_bytes, dtype="<u4").astype(np.uint32)
    return SnapshotHeader(**{**hdr.__dict__, "trailer": trailer, "spans": spans}), tokens


def rows_needed(hdr: SnapshotHeader, m: int) -> int:
    """Rows a restore of [0, m) writes: whole blocks, so up to the end of the block holding row m-1."""
    return hdr.block_rows(n_blocks(m, hdr.kv_bs) - 1)[1]


def read_rows_into(f: BinaryIO, hdr: SnapshotHeader, m: int,
                   dest: Callable[[int, int], np.ndarray],
                   on_layer: Callable[[int], None] | None = None) -> int:
    """Read rows [0, m) of every layer into dest(layer, kv) and CRC-check exactly those blocks.

    Whole blocks are read, so rows [m, rows_needed(hdr, m)) of the destination are overwritten
    too; only [0, m) is meaningful to the caller. One preadv per layer reads the needed K/V blocks
    straight into the destination arrays. On SnapshotBlockCRC / SnapshotSize the destination
    holds garbage and must be discarded. `on_layer(l)` runs after layer l is read and checked.
    Returns payload bytes read.
    """
    if not 1 <= m <= hdr.n_tokens:
        raise ValueError(f"m={m} outside 1..{hdr.n_tokens}")
    if len(hdr.trailer) != hdr.trailer_size:
        raise ValueError("header has no verified trailer: use the header returned by read_header")
    nb, total = n_blocks(m, hdr.kv_bs), 0
    for layer in range(hdr.n_layers):
        k_arr, v_arr = dest(layer, 0), dest(layer, 1)
        views = []  # K0, V0, K1, V1, ...: the same order as on disk, so one contiguous read
        for b in range(nb):  # _byte_view checks capacity: rows up to rows_needed(hdr, m)
            start, stop = hdr.block_rows(b)
            views += [_byte_view(k_arr, start, stop, hdr.kv_dim, True),
                      _byte_view(v_arr, start, stop, hdr.kv_dim, True)]
        total += _pread_into(f, views, hdr.block_offset(layer, 0, 0))
        for i, view in enumerate(views):
            b, kv = divmod(i, 2)
            if crc32c.crc32c(view) != hdr.block_crc(layer, b, kv):
                raise SnapshotBlockCRC(f"layer {layer} block {b} ({KV_NAMES[kv]}, rows "
                                       f"{hdr.block_rows(b)}) fails its CRC32C")
        if on_layer is not None:
            on_layer(layer)
    log.debug("read rows [0, %d) of a %d-token snapshot: %d payload bytes", m, hdr.n_tokens, total)
    return total


def verify_file(path: str | os.PathLike, geometry: Geometry | None = None, model_id: int | None = None,
                max_tokens: int | None = None) -> SnapshotHeader:
    """Check every field and every block CRC of a file, block by block into one reusable buffer."""
    with open(path, "rb", buffering=0) as f:
        hdr, _ = read_header(f, geometry, model_id, max_tokens)
        buf = bytearray(min(hdr.kv_bs, hdr.n_tokens) * hdr.kv_dim * F32)
        for layer in range(hdr.n_layers):
            for b in range(hdr.n_blocks):
                start, stop = hdr.block_rows(b)
                view = memoryview(buf)[: (stop - start) * hdr.kv_dim * F32]
                for kv in (0, 1):
                    _pread_into(f, [view], hdr.block_offset(layer, b, kv))
                    if crc32c.crc32c(view) != hdr.block_crc(layer, b, kv):
                        raise SnapshotBlockCRC(f"layer {layer} block {b} ({KV_NAMES[kv]}) fails its CRC32C")
    return hdr
