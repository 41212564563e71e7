"""A throttled kv directory, to imitate the board's eMMC (150-250 MB/s) on a development machine.

A sparse image file is attached to a loop device with direct I/O (the host never caches the
image's pages, so a dropped page cache inside it means a real device read), formatted ext4 and
mounted. A cgroup v1 `blkio` group limits reads and writes of that loop device only
(`blkio.throttle.read_bps_device` / `write_bps_device`), and this process joins it: every thread
(the store's reader and writer too) and every child process (the servers of `bench recovery`)
reads and writes the directory at the limit, while the model, the other disks and everyone else
on the machine are untouched. The raw sequential write+fsync and cold read of the directory are
measured before and after the limit is set, so the report shows the throttle working.

Needs root, the cgroup v1 blkio hierarchy (`/sys/fs/cgroup/blkio`), losetup, mkfs.ext4, mount.
On a board, measure the eMMC itself with `--dir` instead. Written by hand: no library sets up a
loop device and a blkio group, and these are a handful of system calls and commands.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from edge_llm.bench.disk import MB, RawDisk, measure_raw

log = logging.getLogger(__name__)

BLKIO = Path("/sys/fs/cgroup/blkio")
TOOLS = ("losetup", "mkfs.ext4", "mount", "umount")
TOLERANCE = 1.5  # a throttled raw read faster than this x the limit: the throttle does not work


class ThrottleError(RuntimeError):
    """The throttled directory cannot be made here (not root, no blkio, ...) or does not throttle."""


@dataclass
class ThrottledDir:
    path: Path  # the mounted filesystem: put the kv directory here
    device: str  # /dev/loopN
    mbps: float  # the limit, 1e6 bytes per second, reads and writes
    raw_before: RawDisk  # the loop filesystem without the limit
    raw_after: RawDisk  # with it

    def to_dict(self) -> dict:
        return {"mbps": self.mbps, "device": self.device, "raw_before": self.raw_before.to_dict(),
                "raw_after": self.raw_after.to_dict()}


def check_supported() -> None:
    """Raise ThrottleError with what is missing."""
    if os.geteuid() != 0:
        raise ThrottleError("--throttle-mbps needs root (a loop device, a mount and a blkio cgroup)")
    if not (BLKIO / "blkio.throttle.read_bps_device").is_file():
        raise ThrottleError(f"--throttle-mbps needs the cgroup v1 blkio controller mounted at {BLKIO}; "
                            "use --dir on a slow disk instead")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise ThrottleError(f"--throttle-mbps needs {', '.join(missing)} (util-linux, e2fsprogs)")


def _run(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise ThrottleError(f"{' '.join(cmd)} failed: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout.strip()


def _own_blkio_cgroup() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "blkio" in controllers.split(","):
            return BLKIO / path.lstrip("/")
    return BLKIO


def fs_size(geometry, synthetic_tokens: int, models: list[tuple[str, Path]], contexts: list[int], kv_bs: int) -> int:
    """Bytes the throttled filesystem must hold: a synthetic snapshot of `synthetic_tokens` rows
    next to the raw probe of the same size, or one snapshot per context and model, whichever
    is more, with room to spare."""
    from edge_llm.config import ModelArgs
    from edge_llm.snapshot.format import snapshot_size

    need = 2 * snapshot_size(geometry.n_layers, synthetic_tokens, geometry.kv_dim, kv_bs) if synthetic_tokens else 0
    for _, d in models:
        g = ModelArgs.from_dir(d).geometry
        need = max(need, sum(snapshot_size(g.n_layers, n, g.kv_dim, kv_bs) for n in contexts))
    return int(need * 1.2) + (512 << 20)


@contextmanager
def throttled_dir(parent: Path, size_bytes: int, mbps: float, probe_bytes: int = 256 << 20) -> Iterator[ThrottledDir]:
    """A directory on a loop-mounted ext4 image of `size_bytes` under `parent`, read and written by
    this process (and its children) at `mbps` MB/s. Everything is undone on exit."""
    check_supported()
    if mbps <= 0:
        raise ThrottleError(f"--throttle-mbps must be > 0, got {mbps}")
    work = parent / f"throttle-{os.getpid()}-{secrets.token_hex(3)}"
    mnt = work / "mnt"
    mnt.mkdir(parents=True)
    with ExitStack() as undo:
        undo.callback(shutil.rmtree, work, True)
        image = work / "disk.img"
        with open(image, "wb") as f:
            f.truncate(size_bytes + (64 << 20))  # + room for ext4's own metadata
        device = _run("losetup", "--find", "--show", "--direct-io=on", str(image))
        undo.callback(_run, "losetup", "-d", device)
        _run("mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=0,lazy_journal_init=0", device)
        _run("mount", device, str(mnt))
        undo.callback(_run, "umount", str(mnt))
        majmin = Path(f"/sys/class/block/{Path(device).name}/dev").read_text().strip()
        raw_before = measure_raw(mnt, probe_bytes)
        group = BLKIO / f"edge-llm-bench-{os.getpid()}-{secrets.token_hex(3)}"
        group.mkdir()
        undo.callback(group.rmdir)
        limit = int(mbps * MB)
        (group / "blkio.throttle.read_bps_device").write_text(f"{majmin} {limit}\n")
        (group / "blkio.throttle.write_bps_device").write_text(f"{majmin} {limit}\n")
        home = _own_blkio_cgroup()
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")  # every thread of this process
        undo.callback((home / "cgroup.procs").write_text, f"{os.getpid()}\n")
        raw_after = measure_raw(mnt, probe_bytes)
        log.info("throttled dir %s on %s (%s): limit %.0f MB/s; raw read %.0f -> %.0f MB/s, write %.0f -> %.0f MB/s",
                 mnt, device, majmin, mbps, raw_before.read.mb_s, raw_after.read.mb_s, raw_before.write.mb_s,
                 raw_after.write.mb_s)
        if raw_after.read.mb_s > TOLERANCE * mbps or raw_after.write.mb_s > TOLERANCE * mbps:
            raise ThrottleError(f"the blkio limit of {mbps:.0f} MB/s on {device} does not hold: raw read "
                                f"{raw_after.read.mb_s:.0f} MB/s, write {raw_after.write.mb_s:.0f} MB/s")
        yield ThrottledDir(mnt, device, mbps, raw_before, raw_after)


def markdown(throttles: list[dict]) -> str:
    """The raw I/O of each throttled directory without and with its limit (`ThrottledDir.to_dict`)."""
    lines = ["| limit MB/s | device | raw write / cold read MB/s without the limit | with it |", "|---:|---|---:|---:|"]
    for t in throttles:
        b, a = t["raw_before"], t["raw_after"]
        lines.append(f"| {t['mbps']:g} | {t['device']} | {b['write']['mb_s']:.0f} / {b['read']['mb_s']:.0f} "
                     f"| {a['write']['mb_s']:.0f} / {a['read']['mb_s']:.0f} |")
    return "\n".join(lines) + "\n"
