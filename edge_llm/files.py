"""Files and directories that a reader, a concurrent process or a crash never sees half-written.

One owner for the atomic-publish steps every writer of the product needs:

- `write_atomic(path, data)`: a small file (JSON, a tokenizer, a cache);
- `atomic_file(path)`: the same for a file written as a stream (safetensors shards, snapshots),
  with optional preallocation;
- `publish_dir(target, build, ready)`: a directory built once under a lock (the imported default
  model, cpu-q's quantized graphs) and swapped into place;
- `fsync_dir`, and the temp names (`temp_name`, `orphaned_temp`) a scan can attribute to a
  writer that is gone;
- `open_regular(path, error)` / `read_regular`: the one way to open a file whose path a client
  or the file system can influence (image paths, snapshots, checkpoints, tokenizers): anything
  but a regular file (a FIFO, a device, a directory) is refused with the caller's error class
  and never read, so it cannot block a thread (docs/store.md, "Faults").

A file is written under `<name>.<pid>-<hex>.tmp` in its own directory (the pid says whose it
is, the random part makes each attempt unique), flushed, fsynced, renamed over the final name,
and the directory is fsynced: the final name shows either the old content or all of the new.
Any error removes the temp file. `durable=False` skips both fsyncs (scratch files and caches,
where losing the new content after a power cut costs only its recomputation).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TypeVar

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
_TMP_RE = re.compile(r"\.(\d+)-[0-9a-f]+\.tmp$")
T = TypeVar("T")


# ---- files --------------------------------------------------------------------------------
def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], error: Callable[[str], Exception], *,
                 buffering: int = -1) -> BinaryIO:
    """`path` opened for reading in binary mode, only if it is a regular file.

    Anything else raises `error(message)` (the caller's class: a snapshot's SnapshotError, an
    image's ImageError...), the message naming the path and what it is. A FIFO or device is
    refused from a `stat` without being opened; one swapped in between that and the open is
    opened with O_NONBLOCK (a FIFO without a writer then returns at once instead of blocking the
    thread for good), found by `fstat` and closed unread. The descriptor is made blocking again
    before it is returned. OSErrors of the open itself (FileNotFoundError, PermissionError...)
    propagate. Symlinks are followed (what they point to must be a regular file).
    """
    if not stat.S_ISREG(mode := os.stat(path).st_mode):
        raise error(f"{os.fspath(path)}: not a regular file ({_kind(mode)})")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{os.fspath(path)}: not a regular file ({_kind(mode)})")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], error: Callable[[str], Exception], limit: int | None = None) -> bytes:
    """The bytes of a regular file (`open_regular`); with `limit`, at most limit + 1 of them (so a
    caller sees that the file is larger than it accepts without reading all of it)."""
    with open_regular(path, error) as f:
        return f.read() if limit is None else f.read(limit + 1)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that a rename or unlink in it survives a power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every regular file and directory under `root` (files written by other processes or
    without `atomic_file`, before the directory is published: `convert rknn`)."""
    for here, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(here, name)
            if os.path.isfile(path) and not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(here)


def check_writable(directory: str | os.PathLike[str]) -> None:
    """Create and remove a temp file in `directory`: raises the OSError (EROFS, EACCES, ENOSPC...)
    a first real write would meet, so a directory that exists but cannot be written is found when
    it is opened, not at its first save."""
    path = Path(directory) / temp_name(".write-check")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    os.unlink(path)


def temp_name(final_name: str) -> str:
    """`<final_name>.<pid>-<random hex>.tmp`: unique per attempt, and it names its writer."""
    return f"{final_name}.{os.getpid()}-{secrets.token_hex(6)}{TMP_SUFFIX}"


def orphaned_temp(path: Path, own_writer_busy: bool) -> bool:
    """True for a temp file whose writer is gone: another process that no longer runs, this
    process when its own writer is idle (`own_writer_busy` False), or no pid in the name."""
    m = _TMP_RE.search(path.name)
    if m is None:
        return True
    pid = int(m.group(1))
    if pid == os.getpid():
        return not own_writer_busy
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _preallocate(fd: int, size: int) -> None:
    try:
        # reserve the blocks up front: a full disk fails here, before GBs are written
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


@contextmanager
def atomic_file(path: str | os.PathLike[str], *, mode: int | None = None, durable: bool = True,
                size: int | None = None) -> Iterator[BinaryIO]:
    """A new buffered binary file that replaces `path` when the block ends without an error.

    `mode`: the file's permissions, whatever the umask (None: 0o666 filtered by the umask, as
    `open` does). `size`: preallocate that many bytes first. The temp file is created with
    O_EXCL (never clobbering), so two writers of one name never share a temp file.
    """
    path = Path(path)
    tmp = path.with_name(temp_name(path.name))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666 if mode is None else mode)
        try:
            if mode is not None:
                os.fchmod(fd, mode)  # the umask filtered os.open's mode; fchmod is not filtered
            f = os.fdopen(fd, "wb")
        except BaseException:
            os.close(fd)
            raise
        with f:
            if size:
                _preallocate(f.fileno(), size)
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError as e:  # the disk may be gone; a later scan removes the debris
            log.warning("could not remove %s: %s", tmp, e)
        raise
    if durable:
        fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, mode: int | None = None,
                 durable: bool = True) -> None:
    """Write a small file atomically (str is written as UTF-8); see `atomic_file`."""
    with atomic_file(path, mode=mode, durable=durable) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


# ---- directories ----------------------------------------------------------------------------
def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the C library
    or the filesystem has no such rename (the caller then renames twice)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _stale_temp_dir(name: str, entry: str) -> bool:
    # mkdtemp's suffix never holds a "-": `.tmp-<name>-x` is ours, `.tmp-<name>-v2-x` is another
    # target's; `.tmp-<name>-old-x` is where builders before publish_dir moved an old target
    return entry.startswith(f".tmp-{name}-") and "-" not in entry[len(name) + 6:].removeprefix("old-")


def publish_dir(target: str | os.PathLike[str], build: Callable[[Path], T], ready: Callable[[Path], T | None], *,
                mode: int = 0o755) -> T:
    """The directory `target`, built once: `ready(target)` when that is not None, else built.

    Building happens under an exclusive flock on `<parent>/.<name>.lock`: a second process waits,
    then finds `ready(target)` and reuses the result. The builder first removes the temp
    directories of killed builders (`.tmp-<name>-*`), then calls `build(tmp)` on a new, empty
    `.tmp-<name>-<random>` next to the target, and publishes it by rename. An existing target
    (stale: `ready` said no) is swapped with the new one in one rename where the filesystem can
    (RENAME_EXCHANGE), else moved aside just before; it is deleted only after the new one is
    in place, so a reader never meets a half-deleted directory. A failed build leaves nothing.
    Returns what `ready` or `build` returned.
    """
    target = Path(target)
    seen = _identity(target)
    if (got := ready(target)) is not None:
        return got
    parent, name = target.parent, target.name
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / f".{name}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        # another process built it while we waited: asked again only then (the target is only
        # ever replaced by a rename), so `ready`'s "stale" line is said once per build
        if _identity(target) != seen and (got := ready(target)) is not None:
            return got
        for entry in os.listdir(parent):
            if _stale_temp_dir(name, entry):
                shutil.rmtree(parent / entry, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=parent))
        try:
            os.chmod(tmp, mode)  # mkdtemp makes it private; the service user may differ from ours
            got = build(tmp)
            old = _swap_in(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return got


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Which directory is at `path` (a rename puts another inode there, and changes its ctime)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _swap_in(tmp: Path, target: Path) -> Path | None:
    """Put `tmp` at `target`; returns where the previous target now is (to delete), or None."""
    if not os.path.lexists(target):
        os.rename(tmp, target)
        return None
    if _exchange(tmp, target):
        return tmp  # the old directory now has the temp name
    aside = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    os.rename(target, aside / target.name)  # a rename over an empty directory is allowed
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(aside / target.name, target)  # the old one back rather than none
        raise
    return aside
