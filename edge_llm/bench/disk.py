"""Raw disk bandwidth of a directory: the yardstick that snapshot save/restore are compared to.

Write = sequential write + fsync of a fresh file (what a snapshot save must at least pay).
Cold read = sequential read after the file's pages were dropped from the page cache with
posix_fadvise(DONTNEED) (clean pages only, hence the fsync first). `/proc/self/io` read_bytes
tells whether the bytes really came from the device (0 on filesystems that keep data in RAM).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MB = 1e6
CHUNK = 8 << 20  # large sequential requests, like the snapshot writer's per-block writes


@dataclass
class Throughput:
    nbytes: int
    seconds: float
    device_read_bytes: int | None = None  # /proc/self/io read_bytes delta (None: not available)

    @property
    def mb_s(self) -> float:
        return self.nbytes / MB / self.seconds if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict:
        return {**asdict(self), "mb_s": round(self.mb_s, 1)}


def proc_read_bytes() -> int | None:
    """Bytes this process caused to be fetched from storage (Linux /proc/self/io)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def drop_file_cache(path: str | os.PathLike) -> None:
    """Drop a file's pages from the page cache (dirty pages are written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _pattern(chunk: int) -> memoryview:
    # random bytes: no filesystem/device can compress or dedupe them away
    return memoryview(secrets.token_bytes(chunk))


def raw_write(path: str | os.PathLike, nbytes: int, chunk: int = CHUNK) -> Throughput:
    """Write `nbytes` sequentially to a new file and fsync it; time both."""
    buf = _pattern(min(chunk, nbytes))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, buf[: min(left, buf.nbytes)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return Throughput(nbytes, time.perf_counter() - t0)


def cold_read(path: str | os.PathLike, chunk: int = CHUNK) -> Throughput:
    """Drop the file's cached pages, then read it sequentially into one reused buffer."""
    drop_file_cache(path)
    buf = bytearray(chunk)
    view = memoryview(buf)
    rb0 = proc_read_bytes()
    t0 = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
    dt = time.perf_counter() - t0
    rb1 = proc_read_bytes()
    return Throughput(total, dt, None if rb0 is None or rb1 is None else rb1 - rb0)


@dataclass
class RawDisk:
    write: Throughput
    read: Throughput

    def to_dict(self) -> dict:
        return {"write": self.write.to_dict(), "read": self.read.to_dict()}


def measure_raw(directory: str | os.PathLike, nbytes: int, chunk: int = CHUNK) -> RawDisk:
    """Raw sequential write+fsync and cold read of `nbytes` in `directory` (file removed after)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"raw-bandwidth-{secrets.token_hex(4)}.bin"
    try:
        w = raw_write(path, nbytes, chunk)
        r = cold_read(path, chunk)
    finally:
        path.unlink(missing_ok=True)
    log.info("raw disk %s: write+fsync %.1f MB/s, cold read %.1f MB/s (%d bytes)",
             directory, w.mb_s, r.mb_s, nbytes)
    return RawDisk(w, r)


def utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def new_results_dir(base: str | os.PathLike, kind: str) -> Path:
    """Create `<base>/<UTC timestamp>-<kind>/`; never reuses an existing folder."""
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    stamp = utc_stamp()
    for i in range(1000):
        path = base / (f"{stamp}-{kind}" if i == 0 else f"{stamp}-{kind}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free results folder name under {base}")
