"""Reading one VLKV file: validation in the documented order, partial reads of rows straight into
KV arrays (layer by layer, every block CRC-checked before its rows count), full verification.
The layout is `layout.py`; docs/snapshot-format.md explains the order."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import BinaryIO

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
    SnapshotNotRegular,
    SnapshotSize,
    SnapshotTokenCount,
    SnapshotTokenHash,
    SnapshotTooShort,
    SnapshotTrailerCRC,
)
from edge_llm.files import open_regular
from edge_llm.settings import DEFAULTS
from edge_llm.snapshot.layout import (
    EXT_MAX,
    EXT_RECORD,
    F32,
    FLAG_EXTENSION,
    FLAG_TRAILER,
    HEADER,
    KNOWN_FLAGS,
    KV_NAMES,
    MAGIC,
    VERSION,
    BaseRef,
    SnapshotHeader,
    byte_view,
    decode_extension,
    fnv1a64,
    n_blocks,
    pread_into,
    read_exact,
    snapshot_size,
)
from edge_llm.snapshot.layout import (
    file_size as size_of,
)

log = logging.getLogger("edge_llm.snapshot.format")


def read_header(f: BinaryIO, geometry: Geometry | None, model_id: int | None,
                max_tokens: int | None = DEFAULTS.disk_kv_max_tokens,
                file_size: int | None = None,
                known_tokens: Sequence[int] | np.ndarray | None = None) -> tuple[SnapshotHeader, np.ndarray]:
    """Validate everything but the payload, in the documented order; return (header, ids as uint32).

    geometry / model_id / max_tokens None = don't check (inspecting foreign files). Each failure
    raises its own SnapshotError subclass; no buffer is sized from a field before the file size
    has been checked against it. `known_tokens`: ids an earlier read already hashed (the store's
    index); the stored ids must equal them, which replaces re-hashing (FNV is ~10 ms per 8K ids).
    """
    size = size_of(f) if file_size is None else file_size
    if size < HEADER.size:
        raise SnapshotTooShort(f"file is {size} bytes, shorter than the {HEADER.size}-byte header")
    raw = bytes(read_exact(f, 0, HEADER.size))
    hdr = _check_fields(raw, geometry, max_tokens)
    n_tokens, reserved, mid, tokens_fnv = hdr.n_tokens, hdr.ext_size, hdr.model_id, hdr.tokens_fnv
    # step 9: the exact size when the layout is known from the header alone (no extension section);
    # with one, the ids + section must lie inside the file now and the exact size (which depends
    # on a base record's row0) is checked as soon as the section is decoded
    if not reserved and size != hdr.file_size:
        raise SnapshotSize(f"file is {size} bytes, header implies {hdr.file_size}")
    if reserved and size < hdr.payload_offset:
        raise SnapshotSize(f"file is {size} bytes, shorter than its header + ids + extension "
                           f"({hdr.payload_offset})")
    if model_id is not None and mid != model_id:
        raise SnapshotModelID(f"model_id {mid:016x} != loaded model {model_id:016x}")
    token_bytes = read_exact(f, HEADER.size, 4 * n_tokens)
    spans, base, ext_err = (), None, None
    if reserved:
        try:
            spans, base = decode_extension(bytes(read_exact(f, hdr.ext_offset, reserved)), n_tokens)
        except SnapshotExtension as e:  # reported after the token check, in the documented order
            ext_err = e
    _check_tokens(token_bytes, tokens_fnv, base, known_tokens)
    if ext_err is not None:
        raise ext_err
    hdr = SnapshotHeader(**{**hdr.__dict__, "spans": spans, "base": base})
    if size != hdr.file_size:
        raise SnapshotSize(f"file is {size} bytes, header + extension imply {hdr.file_size}")
    trailer = bytes(read_exact(f, hdr.trailer_offset, hdr.trailer_size))
    if crc32c.crc32c(trailer) != hdr.trailer_crc:
        raise SnapshotTrailerCRC(f"trailer CRC32C {crc32c.crc32c(trailer):08x} != stored {hdr.trailer_crc:08x}")
    tokens = np.frombuffer(token_bytes, dtype="<u4").astype(np.uint32)
    return SnapshotHeader(**{**hdr.__dict__, "trailer": trailer}), tokens


def _check_fields(raw: bytes, geometry: Geometry | None, max_tokens: int | None) -> SnapshotHeader:
    """Steps 1-8 of the documented order, on the 64 header bytes alone."""
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
    return SnapshotHeader(n_layers, n_kv_heads, head_dim, kv_bs, n_tokens, kv_dim, tokens_fnv, mid, flags,
                          trailer_crc, header_crc, ext_size=reserved)


def size_from_head(read: Callable[[int], bytes], max_tokens: int) -> tuple[int, bytes]:
    """The exact size a file must have, from its first bytes: the header checked as read_header
    checks it (steps 1-8) and, with an extension section, the ids and the section read and its
    base record decoded (a delta's size depends on it). `read(n)` returns the next n bytes of a
    stream (fewer at its end). Returns (size, every byte read): `kv import` compares a tar
    member's declared size with it before it copies the rest (docs/fleet.md)."""
    raw = read(HEADER.size)
    if len(raw) < HEADER.size:
        raise SnapshotTooShort(f"file is {len(raw)} bytes, shorter than the {HEADER.size}-byte header")
    hdr = _check_fields(raw, None, max_tokens)
    if not hdr.ext_size:
        return hdr.file_size, raw
    rest = read(hdr.payload_offset - HEADER.size)  # <= 4 * max_tokens + EXT_MAX bytes
    if len(rest) < hdr.payload_offset - HEADER.size:
        raise SnapshotTooShort(f"file ends at {HEADER.size + len(rest)}, inside its ids and extension "
                               f"({hdr.payload_offset})")
    _, base = decode_extension(rest[4 * hdr.n_tokens:], hdr.n_tokens)
    return snapshot_size(hdr.n_layers, hdr.n_tokens, hdr.kv_dim, hdr.kv_bs, hdr.ext_size,
                         0 if base is None else base.n_tokens), raw + rest


def _check_tokens(token_bytes: bytearray, tokens_fnv: int, base: BaseRef | None,
                  known: Sequence[int] | np.ndarray | None) -> None:
    """Step 11: the ids hash to tokens_fnv (and their first base_n to the base's name)."""
    if known is not None:
        ids = np.frombuffer(token_bytes, dtype="<u4")
        if ids.shape[0] != len(known) or not np.array_equal(ids, np.asarray(known, dtype=np.uint32)):
            raise SnapshotTokenHash("token ids differ from the ones indexed (the file changed)")
        return
    if base is None or base.n_tokens > len(token_bytes) // 4:
        head, actual = None, fnv1a64(token_bytes)
    else:
        head, actual = fnv1a64(token_bytes, cut=4 * base.n_tokens)
    if actual != tokens_fnv:
        raise SnapshotTokenHash(f"token ids hash to {actual:016x}, header says {tokens_fnv:016x}")
    if base is not None and head != base.tokens_fnv:
        raise SnapshotExtension(f"base record names {base.name}, but the first {base.n_tokens} ids "
                                f"hash to {head:016x}")


def rows_needed(hdr: SnapshotHeader, m: int) -> int:
    """Rows a restore of [0, m) writes from a full file: whole blocks, up to the end of the block
    holding row m-1 (`hdr.rows_needed` for any file)."""
    return hdr.rows_needed(m)


def read_layer_into(f: BinaryIO, hdr: SnapshotHeader, layer: int, m: int, k_arr: np.ndarray,
                    v_arr: np.ndarray) -> int:
    """Read this file's rows [row0, m) of one layer into k_arr / v_arr (absolute row numbers) and
    CRC-check exactly those blocks. Whole blocks are read, so rows [m, hdr.rows_needed(m)) are
    overwritten too. One preadv straight into the arrays. On SnapshotBlockCRC / SnapshotSize the
    rows are garbage. Returns bytes read."""
    views = []  # K0, V0, K1, V1, ...: the same order as on disk, so one contiguous read
    for b in range(n_blocks(m - hdr.row0, hdr.kv_bs)):  # byte_view checks the arrays' capacity
        start, stop = hdr.block_rows(b)
        views += [byte_view(k_arr, start, stop, hdr.kv_dim, True), byte_view(v_arr, start, stop, hdr.kv_dim, True)]
    total = pread_into(f, views, hdr.block_offset(layer, 0, 0))
    for i, view in enumerate(views):
        b, kv = divmod(i, 2)
        if crc32c.crc32c(view) != hdr.block_crc(layer, b, kv):
            raise SnapshotBlockCRC(f"layer {layer} block {b} ({KV_NAMES[kv]}, rows "
                                   f"{hdr.block_rows(b)}) fails its CRC32C")
    return total


def read_rows_into(f: BinaryIO, hdr: SnapshotHeader, m: int,
                   dest: Callable[[int, int], np.ndarray],
                   on_layer: Callable[[int], None] | None = None) -> int:
    """Read this file's rows [row0, m) of every layer into dest(layer, kv) and CRC-check exactly
    those blocks (see read_layer_into). `on_layer(l)` runs after layer l is read and checked.
    Returns payload bytes read."""
    if not hdr.row0 < m <= hdr.n_tokens:
        raise ValueError(f"m={m} outside {hdr.row0 + 1}..{hdr.n_tokens}")
    if len(hdr.trailer) != hdr.trailer_size:
        raise ValueError("header has no verified trailer: use the header returned by read_header")
    total = 0
    for layer in range(hdr.n_layers):
        total += read_layer_into(f, hdr, layer, m, dest(layer, 0), dest(layer, 1))
        if on_layer is not None:
            on_layer(layer)
    log.debug("read rows [%d, %d) of a %d-token snapshot: %d payload bytes", hdr.row0, m, hdr.n_tokens, total)
    return total


def verify_file(path: str | os.PathLike, geometry: Geometry | None = None, model_id: int | None = None,
                max_tokens: int | None = None) -> SnapshotHeader:
    """Check every field and every block CRC of one file (not its base), block by block into one
    reusable buffer."""
    with open_regular(path, SnapshotNotRegular, buffering=0) as f:  # a FIFO: refused, never read
        hdr, _ = read_header(f, geometry, model_id, max_tokens)
        buf = bytearray(min(hdr.kv_bs, hdr.n_rows) * hdr.kv_dim * F32)
        for layer in range(hdr.n_layers):
            for b in range(hdr.n_blocks):
                start, stop = hdr.block_rows(b)
                view = memoryview(buf)[: (stop - start) * hdr.kv_dim * F32]
                for kv in (0, 1):
                    pread_into(f, [view], hdr.block_offset(layer, b, kv))
                    if crc32c.crc32c(view) != hdr.block_crc(layer, b, kv):
                        raise SnapshotBlockCRC(f"layer {layer} block {b} ({KV_NAMES[kv]}) fails its CRC32C")
    return hdr

