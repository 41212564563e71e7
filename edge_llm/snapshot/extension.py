"""The optional extension section of a VLKV file (flags bit 1; its byte length in the header's
`reserved` field): typed records after the token ids, closed by a CRC32C. Record type 1 holds a
conversation's image runs (Qwen3-VL). New record types are how the format grows without a new
version. See docs/snapshot-format.md."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import crc32c

from edge_llm.errors import SnapshotExtension
from edge_llm.kvcache import ImageSpan

FLAG_EXTENSION = 2  # header flag: an extension section follows the token ids
EXT_MAX = 1 << 20  # an extension section is small (an image run record is 52 bytes)
EXT_RECORD = struct.Struct("<II")  # tag, length of the record body
EXT_IMAGES = 1  # record: u32 count, then count x IMAGE_SPAN
IMAGE_SPAN = struct.Struct("<5I32s")  # start row, t, h, w, pos0, sha256 digest


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
