"""Dissect a VLKV file for `edge-llm kv inspect`: data for a byte-by-byte walkthrough, no printing."""

from __future__ import annotations

import os
from typing import Any

import crc32c

from edge_llm.errors import (
    SnapshotError,
    SnapshotExtension,
    SnapshotNotRegular,
    SnapshotTokenHash,
    SnapshotTrailerCRC,
)
from edge_llm.files import open_regular
from edge_llm.snapshot.format import (
    F32,
    FLAG_EXTENSION,
    HEADER,
    HEADER_FIELDS,
    KV_NAMES,
    SnapshotHeader,
    n_blocks,
    read_header,
    snapshot_size,
)


def describe(path: str | os.PathLike, max_blocks: int | None = 64) -> dict[str, Any]:
    """Dissect a file: header fields with offsets, sections, size formula, block map, first error.

    Works on bad files: what could be parsed is returned and `error` names the first failed check
    ({reason, message}). Sections and the block map are listed only once the exact size matched
    (nothing is sized from an unchecked field); `max_blocks` caps the block map (None = all).
    A path that is not a regular file (a FIFO, a device) raises SnapshotNotRegular, unread.
    """
    out: dict[str, Any] = {"path": os.fspath(path), "valid": False, "error": None, "header": [],
                           "size_formula": None, "sections": [], "tokens": None, "blocks": [],
                           "n_blocks_total": 0}
    with open_regular(path, SnapshotNotRegular, buffering=0) as f:  # a FIFO: SnapshotNotRegular, never read
        size = out["file_size"] = os.fstat(f.fileno()).st_size
        if size >= HEADER.size:
            raw = os.pread(f.fileno(), HEADER.size, 0)
            values = dict(zip((name for name, _, _ in HEADER_FIELDS), HEADER.unpack(raw)))
            out["header"] = [{"name": name, "offset": off, "size": sz, "hex": raw[off:off + sz].hex(" "),
                              "value": values[name]} for name, off, sz in HEADER_FIELDS]
            out["header_crc_actual"] = crc32c.crc32c(raw[:60])
            L, n, kv_dim, kv_bs = (values[k] for k in ("n_layers", "n_tokens", "kv_dim", "kv_bs"))
            E = values["reserved"] if values["flags"] & FLAG_EXTENSION else 0
            if kv_bs > 0:
                B = n_blocks(n, kv_bs)
                ext = ([E], " + E") if E else ([], "")  # E: the extension section, if any
                out["size_formula"] = {
                    "formula": f"64 + 4*n{ext[1]} + 2*L*n*kv_dim*4 + 8*L*B", "n": n, "L": L, "kv_dim": kv_dim,
                    "kv_bs": kv_bs, "B": B, "E": E,
                    "terms": [HEADER.size, 4 * n, *ext[0], 2 * L * n * kv_dim * F32, 8 * L * B],
                    "expected": snapshot_size(L, n, kv_dim, kv_bs, E), "actual": size}
        try:
            h, tokens = read_header(f, None, None, None, size)
            out["valid"], out["tokens"] = True, tokens.tolist()
            out["images"] = [{"rows": (s.start, s.end), "grid": s.grid, "pos0": s.pos0,
                              "next_pos": s.next_pos, "digest": s.digest.hex()} for s in h.spans]
            if h.base is not None:  # a delta: it holds rows [base_n, n); the formula counts r = n - base_n
                out["base"] = {"name": h.base.name, "n_tokens": h.base.n_tokens,
                               "trailer_crc": h.base.trailer_crc, "rows_held": (h.row0, h.n_tokens)}
                r, B = h.n_rows, h.n_blocks
                out["size_formula"].update(
                    formula="64 + 4*n + E + 2*L*r*kv_dim*4 + 8*L*B, r = n - base_n", B=B, r=r,
                    terms=[HEADER.size, 4 * n, E, 2 * L * r * kv_dim * F32, 8 * L * B], expected=h.file_size)
        except (SnapshotTokenHash, SnapshotExtension, SnapshotTrailerCRC) as e:  # after the size check
            out["error"] = {"reason": e.reason, "message": str(e)}
            h = SnapshotHeader(*(values[k] for k in ("n_layers", "n_kv_heads", "head_dim", "kv_bs",
                                                     "n_tokens", "kv_dim", "tokens_fnv", "model_id")),
                               ext_size=E)
        except SnapshotError as e:
            out["error"] = {"reason": e.reason, "message": str(e)}
            return out
    out["sections"] = [
        {"name": "header", "offset": 0, "size": HEADER.size},
        {"name": "token ids", "offset": h.tokens_offset, "size": 4 * h.n_tokens},
        *([{"name": "extension", "offset": h.ext_offset, "size": h.ext_size}] if h.ext_size else []),
        {"name": "payload", "offset": h.payload_offset, "size": h.n_layers * h.layer_bytes},
        {"name": "trailer", "offset": h.trailer_offset, "size": h.trailer_size}]
    out["n_blocks_total"] = total = 2 * h.n_layers * h.n_blocks
    for i in range(total if max_blocks is None else min(max_blocks, total)):
        (layer, b), kv = divmod(i // 2, h.n_blocks), i % 2
        start, stop = h.block_rows(b)
        out["blocks"].append({
            "layer": layer, "block": b, "kv": KV_NAMES[kv], "rows": (start, stop),
            "offset": h.block_offset(layer, b, kv), "size": (stop - start) * h.kv_dim * F32,
            "trailer_offset": h.trailer_offset + 4 * i,
            "crc_stored": h.block_crc(layer, b, kv) if h.trailer else None})
    return out
