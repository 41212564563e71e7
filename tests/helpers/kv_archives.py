"""`kv import` archives built by hand for the tests of its bounds: real VLKV files of a small
identity (a full file and a delta on it) in a real tar, and the crafted variants an adversary
sends (sparse members of every GNU flavour, lying sizes, bad identities, bad times)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np

from edge_llm.config import Geometry
from edge_llm.snapshot import format as F
from edge_llm.snapshot.identity import Identity

GEOM = Geometry(n_layers=2, n_kv_heads=2, head_dim=3)
KV_BS = 3
IDENTITY = Identity(config={"n_layers": 2, "rope_scaling": {"theta": 1e6, "factors": [1, 2]}},
                    weights_digest="ab" * 32, model_dir="tiny-model")
NS = IDENTITY.namespace
MODEL_ID = IDENTITY.model_id
GIB = 1 << 30
MTIME = 1_700_000_000


def _ids(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def snapshot(tokens: list[int], base: bytes | None = None, base_n: int = 0) -> tuple[str, bytes]:
    """(name, bytes) of a VLKV file of these ids: a full file, or with `base` a delta on it."""
    rng = np.random.default_rng(len(tokens))
    rows = rng.standard_normal((GEOM.n_layers, 2, len(tokens), GEOM.kv_dim)).astype(np.float32)
    ref = None
    if base is not None:
        hdr, _ = F.read_header(io.BytesIO(base), None, None)
        ref = F.BaseRef(base_n, hdr.trailer_crc, F.fnv1a64(_ids(tokens[:base_n])))
    f = io.BytesIO()
    F.write_snapshot(f, np.asarray(tokens, dtype=np.uint32), MODEL_ID, GEOM, KV_BS, lambda l, kv: rows[l, kv],
                     base=ref)
    return F.snapshot_name(F.fnv1a64(_ids(tokens))), f.getvalue()


def good_members() -> list[tuple[str, bytes]]:
    """A base of 7 ids and a delta of 11 on it (its extension section holds the base record)."""
    base_ids = list(range(100, 107))
    base = snapshot(base_ids)
    delta = snapshot(base_ids + [7, 8, 9, 10], base[1], len(base_ids))
    return [base, delta]


def tar_bytes(members: list[Member | tuple[str, bytes]], namespace: bytes | None = None,
              identity: bytes | None = None) -> bytes:
    """An archive: `namespace`, `identity.json`, then `members` ((name, data), or a TarInfo whose
    data is in its `data` attribute, for crafted headers)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        head = [("namespace", NS.encode() if namespace is None else namespace),
                ("identity.json", IDENTITY.to_json().encode() if identity is None else identity)]
        for m in [*head, *members]:
            if isinstance(m, Member):
                t.addfile(m, io.BytesIO(m.data))
                continue
            info = tarfile.TarInfo(m[0])
            info.size, info.mode, info.mtime = len(m[1]), 0o600, MTIME
            t.addfile(info, io.BytesIO(m[1]))
    return buf.getvalue()


class Member(tarfile.TarInfo):
    """A TarInfo that carries its data (TarInfo has slots)."""

    __slots__ = ("data",)


def member(name: str, data: bytes, size: int | None = None, pax: dict[str, str] | None = None,
           kind: bytes = tarfile.REGTYPE) -> Member:
    """A TarInfo with its data attached; `size` may lie about it (tarfile writes what it declares)."""
    info = Member(name)
    info.size, info.mode, info.mtime, info.type = len(data) if size is None else size, 0o600, MTIME, kind
    info.pax_headers = dict(pax or {})
    info.data = data.ljust(info.size, b"\0")[: info.size]
    return info


SPARSE_DATA = 8 << 10  # stored bytes of a sparse member: its tail, after 1 GiB - 8 KiB of holes


def pax_sparse(version: str, name: str) -> Member:
    """A PAX sparse member (GNU 0.0, 0.1 or 1.0) of `name` whose real size is 1 GiB."""
    data, off = b"\x5a" * SPARSE_DATA, GIB - SPARSE_DATA
    if version == "1.0":
        sparse_map = f"1\n{off}\n{SPARSE_DATA}\n".encode().ljust(512, b"\0")
        return member(f"GNUSparseFile.0/{name}", sparse_map + data, pax={
            "GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name,
            "GNU.sparse.realsize": str(GIB)})
    if version == "0.1":
        return member(name, data, pax={"GNU.sparse.map": f"{off},{SPARSE_DATA}", "GNU.sparse.size": str(GIB)})
    return member(name, data, pax={"GNU.sparse.size": str(GIB), "GNU.sparse.numblocks": "1",
                                   "GNU.sparse.offset": str(off), "GNU.sparse.numbytes": str(SPARSE_DATA)})


def raw_head() -> bytes:
    """The tar blocks of `namespace` and `identity.json`, to which crafted raw blocks are appended
    (tarfile would pad and close the stream)."""
    head = b""
    for n, d in (("namespace", NS.encode()), ("identity.json", IDENTITY.to_json().encode())):
        info = tarfile.TarInfo(n)
        info.size, info.mode, info.mtime = len(d), 0o600, MTIME
        head += info.tobuf(tarfile.PAX_FORMAT) + d.ljust(-(-len(d) // 512) * 512, b"\0")
    return head


def _octal(n: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, n)


def gnu_sparse_archive(name: str) -> bytes:
    """An archive whose snapshot member is an old-style GNU sparse file (type 'S', the sparse map
    in the header): 8 KiB stored, 1 GiB when tarfile reads it. tarfile cannot write one: the
    header is patched by hand (map at 386, real size at 483, checksum at 148)."""
    head = raw_head()
    data, off = b"\x5a" * SPARSE_DATA, GIB - SPARSE_DATA
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type = SPARSE_DATA, 0o600, MTIME, tarfile.GNUTYPE_SPARSE
    block = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    block[386:410] = _octal(off, 12) + _octal(SPARSE_DATA, 12)
    block[482] = 0  # no extension blocks
    block[483:495] = _octal(GIB, 12)
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return head + bytes(block) + data + b"\0" * 1024


def tree(root: Path) -> dict[str, tuple[bytes | None, int, int]]:
    """Every path under `root` (relative) -> (bytes, mode, mtime_ns) of a file, (None, mode, 0) of
    a directory: what 'the kv dir as it was' means (a refused import's temp files came and went,
    so a directory's mtime may have moved: a server's next lookup miss re-reads it, finds nothing new)."""
    out = {}
    for p in sorted(root.rglob("*")) if root.exists() else ():
        st = p.lstat()
        is_file = p.is_file()
        out[str(p.relative_to(root))] = (p.read_bytes() if is_file else None, st.st_mode,
                                         st.st_mtime_ns if is_file else 0)
    return out


def written_bytes() -> int:
    """Bytes this process has passed to write() so far (Linux /proc/self/io `wchar`)."""
    with open(f"/proc/{os.getpid()}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
