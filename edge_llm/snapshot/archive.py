"""The bounds `kv import` holds an archive to before it writes a byte (docs/fleet.md, "What an
archive may hold"): member kinds, each snapshot member's declared size against the size its own
VLKV header implies, a total cap, last-use times, and the small members' sizes.

An archive is untrusted input: a member that is not a plain regular file (a sparse one expands
to its "real size" of holes when read, a link or device is no snapshot) is refused from its tar
header alone; a snapshot member's first bytes (header, and for a file with an extension section
its ids and that section) are read into memory, bounded by the store's own token bound, and the
size they imply must equal the member's declared size; the sum of declared sizes must fit the cap
(`ImportCap`). Only then are the remaining bytes copied, at most the declared size.
"""

from __future__ import annotations

import math
import os
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from edge_llm.errors import SnapshotError
from edge_llm.snapshot.chain_read import READ_MAX_TOKENS
from edge_llm.snapshot.format import size_from_head

NAMESPACE_MAX = 64  # bytes of the `namespace` member (16 hex digits and a newline, at most)
IDENTITY_MAX = 64 << 10  # bytes of the archive's identity.json (a real one is about 2 KiB)
FUTURE_SLACK = 86400.0  # a last use up to a day ahead of this clock (boards' clocks differ) is now
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE)  # not CONTTYPE, not GNUTYPE_SPARSE
_COPY = 1 << 20


class TransferError(SnapshotError):
    reason = "transfer"


def open_stream(src: BinaryIO) -> tarfile.TarFile:
    """The archive as a tar stream (read once, front to back; opening reads the first header)."""
    try:
        return tarfile.open(fileobj=src, mode="r|")
    except (ValueError, OverflowError) as e:
        raise TransferError(f"not a readable archive: a header tarfile cannot parse ({e})") from None


def next_member(tar: tarfile.TarFile) -> tarfile.TarInfo | None:
    """tar.next(), with the errors tarfile lets through on crafted headers (a sparse map or size
    that is no number: ValueError) as TransferError; its own TarError the caller turns into one."""
    try:
        return tar.next()
    except (ValueError, OverflowError) as e:
        raise TransferError(f"not a readable archive: a header tarfile cannot parse ({e})") from None


def check_regular(info: tarfile.TarInfo) -> None:
    """A plain regular file, or TransferError: sparse members (GNU 'S', PAX 0.0 / 0.1 / 1.0),
    links, devices, FIFOs, directories and contiguous files are refused by their header."""
    sparse = info.sparse is not None or info.type == tarfile.GNUTYPE_SPARSE or any(
        k.startswith("GNU.sparse.") for k in info.pax_headers)
    if sparse:
        raise TransferError(f"archive member {info.name!r} is a sparse file: refused (an archive "
                            f"holds plain regular files only)")
    if info.type not in _REGULAR:
        raise TransferError(f"archive member {info.name!r} is not a regular file (tar type "
                            f"{info.type!r}): refused")


def last_use(info: tarfile.TarInfo, now: float | None = None) -> float:
    """The member's mtime as a last-use time: refused if it is not a number, negative or more
    than FUTURE_SLACK ahead of this clock; one ahead within the slack is now."""
    now = time.time() if now is None else now
    t = info.mtime
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 or t > now + FUTURE_SLACK:
        raise TransferError(f"archive member {info.name!r} has modification time {t!r}: not a time "
                            f"between 1970 and now")
    return min(float(t), now)


def small_member(tar: tarfile.TarFile, name: str, limit: int) -> bytes:
    """The bytes of the small member `name` that must come next (namespace, identity.json)."""
    info = next_member(tar)
    if info is None or info.name != name:
        raise TransferError(f"not an edge-llm kv archive: expected {name!r} next, "
                            f"found {info.name if info else 'the end'!r}")
    check_regular(info)
    if info.size > limit:
        raise TransferError(f"the archive's {name} declares {info.size} bytes (at most {limit})")
    f = tar.extractfile(info)
    assert f is not None  # a regular member
    return f.read()


@dataclass
class ImportCap:
    """The total an import may write: the sum of the snapshot members' declared sizes must fit
    the free space of the kv dir's filesystem less RESERVE_FRACTION of its size, and `max_bytes`
    (`kv import --max-bytes`) when given. Checked per member before its first byte is written."""

    limit: int
    why: str
    used: int = 0

    RESERVE_FRACTION = 0.05  # left free for the store's own saves and the rest of the system

    @classmethod
    def for_dir(cls, kv_dir: Path, max_bytes: int | None = None) -> "ImportCap":
        existing = next(p for p in (kv_dir, *kv_dir.parents) if p.exists())
        usage = shutil.disk_usage(existing)
        free = max(0, usage.free - int(usage.total * cls.RESERVE_FRACTION))
        if max_bytes is not None and max_bytes < free:
            return cls(max_bytes, f"--max-bytes {max_bytes}")
        return cls(free, f"the {free} bytes free on the kv dir's filesystem less "
                         f"{cls.RESERVE_FRACTION:.0%} of its size")

    def take(self, name: str, size: int) -> None:
        if self.used + size > self.limit:
            raise TransferError(f"archive member {name!r} ({size} bytes) would take the import to "
                                f"{self.used + size} bytes, over {self.why}: refused, nothing imported")
        self.used += size


def stage_member(tar: tarfile.TarFile, info: tarfile.TarInfo, dest: BinaryIO, cap: ImportCap) -> None:
    """Copy one snapshot member into `dest` once its header implies its declared size and the
    cap holds (check_regular first). Raises TransferError, or OSError from the writes."""
    src = tar.extractfile(info)
    assert src is not None  # a regular member
    try:
        want, head = size_from_head(src.read, READ_MAX_TOKENS)
    except SnapshotError as e:
        raise TransferError(f"{info.name}: {e.reason}: {e}") from None
    if want != info.size:
        raise TransferError(f"{info.name}: the archive declares {info.size} bytes, its VLKV header "
                            f"implies {want}: refused")
    cap.take(info.name, info.size)
    dest.write(head)
    left = info.size - len(head)
    while left:
        chunk = src.read(min(left, _COPY))
        if not chunk:
            raise TransferError(f"{info.name}: the archive ends inside this member")
        dest.write(chunk)
        left -= len(chunk)
    dest.flush()
    os.fsync(dest.fileno())
