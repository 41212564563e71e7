"""Background snapshot writer: one thread, at most one queued save, atomic publish of a file.

The request path only enqueues (`submit`): the KV payload is never copied, the writer streams
it from the cache's rows through the job's `RowLease`, layer by layer, and reports each finished
layer on the lease. The lease (taken when the job is queued, released when it ends or is
superseded) is what makes a following request wait before overwriting rows the save still needs:
the rules live in `edge_llm/kvcache/cache.py`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from edge_llm import files
from edge_llm.kvcache import ImageSpan, RowLease

log = logging.getLogger(__name__)


@dataclass
class SaveJob:
    """One requested save: rows [0, n) under `lease` for `tokens` (a private copy of the ids)."""

    lease: RowLease
    tokens: np.ndarray  # (n,) uint32
    spans: tuple[ImageSpan, ...] = ()  # image runs among rows [0, n)
    requested: float = field(default_factory=time.monotonic)

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class Modes:
    """Permissions of everything the store creates, whatever the umask: a snapshot holds the
    conversation (its token ids are plain), so owner-only by default; `group_read` lets the
    service group read (the operator's choice, docs/store.md)."""

    group_read: bool = False

    @property
    def file(self) -> int:
        return 0o640 if self.group_read else 0o600

    @property
    def dir(self) -> int:
        return 0o750 if self.group_read else 0o700

    def mkdir(self, path: Path) -> None:
        """Create `path` (and missing parents) with the directory mode; fix an existing one we own."""
        for p in [*reversed(path.parents[:_missing_parents(path)]), path]:
            try:
                p.mkdir(mode=self.dir)
            except FileExistsError:
                if p != path:
                    continue
            os.chmod(p, self.dir)  # mkdir's mode is filtered by the umask; chmod is not

    def too_open(self, kv_dir: Path) -> tuple[list[str], int]:
        """The rule `edge-llm doctor` checks: under a kv dir nothing may be readable by others,
        and a snapshot by the group only where `group_read` allows it. Returns ("path (mode)" of
        each offender, paths checked)."""
        bad, n = [], 0
        for q in [kv_dir, *sorted(kv_dir.glob("*")), *sorted(kv_dir.glob("*/*")),
                  *sorted(kv_dir.glob("*/quarantine/*"))]:
            try:
                mode = q.stat().st_mode & 0o777
            except OSError:
                continue
            n += 1
            if mode & 0o007 or (mode & 0o070 and not self.group_read and q.name.startswith("kv_")):
                bad.append(f"{q} ({mode:o})")
        return bad, n


def _missing_parents(path: Path) -> int:
    """How many of path's parents do not exist yet (those are created with the store's mode)."""
    n = 0
    for p in path.parents:
        if p.exists():
            break
        n += 1
    return n


def write_atomic(path: Path, data: bytes, modes: Modes | None = None) -> None:
    """A small file of the store (identity, counters, notes), atomically, with the file mode."""
    files.write_atomic(path, data, mode=(modes or Modes()).file)


def publish_file(directory: Path, final_name: str, size: int, write: Callable[[BinaryIO], int],
                 modes: Modes | None = None) -> int:
    """Write a snapshot atomically (files.atomic_file): a temp file `<name>.<pid>-<hex>.tmp`
    with the store's file mode, `size` bytes preallocated, `write(f)`, fsync, rename (over an
    existing file of that name: a compaction), dir fsync.

    Returns the bytes written. On any error the temp file is removed and the error re-raised;
    the final name either does not change or points at the complete new file. The scan removes
    temp files whose writer is gone (`files.orphaned_temp`).
    """
    with files.atomic_file(directory / final_name, mode=(modes or Modes()).file, size=size) as f:
        written = write(f)
        if written != size:
            raise OSError(errno.EIO, f"wrote {written} bytes, expected {size}")
    return written


class BackgroundWriter:
    """A daemon thread running `work(job)` for the latest submitted job, one at a time."""

    def __init__(self, work: Callable[[SaveJob], None], name: str = "kv-disk-writer",
                 idle: Callable[[Callable[[], bool]], None] | None = None, idle_after: float | None = None):
        self._work = work
        # idle(should_stop): runs once after `idle_after` seconds without a job (compaction); it
        # must return soon after should_stop() turns true (a job arrived, or closing)
        self._idle, self._idle_after = idle, idle_after
        self._idle_done = True  # nothing to do until the first job
        self._cond = threading.Condition()
        self._pending: SaveJob | None = None
        self._active: SaveJob | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> SaveJob | None:
        """Queue `job`; a queued job not yet started is superseded (returned) — only the latest matters."""
        with self._cond:
            if self._closing:
                job.lease.release()
                raise RuntimeError("snapshot writer is closed")
            old, self._pending = self._pending, job
            self._cond.notify_all()
        if old is not None:
            old.lease.release()
        return old

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and self._active is None, timeout)

    def progress_of_pending(self) -> tuple[int, int] | None:
        """(rows, layers written) of the running save, (rows, 0) of a queued one, or None."""
        with self._cond:
            job = self._active or self._pending
            return None if job is None else (job.n, job.lease.layers_done)

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._pending is not None or self._active is not None

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued save, then stop the thread; False if it did not stop in time."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _should_stop(self) -> bool:
        with self._cond:
            return self._pending is not None or self._closing

    def _run(self) -> None:
        while True:
            with self._cond:
                wait = None if self._idle is None or self._idle_done else self._idle_after
                self._cond.wait_for(lambda: self._pending is not None or self._closing, wait)
                if self._pending is None and not self._closing:
                    self._idle_done = True
                    run_idle = True
                else:
                    run_idle = False
            if run_idle:
                try:
                    self._idle(self._should_stop)
                except Exception:  # the writer must survive anything
                    log.exception("[KV-DISK] idle work failed")
                continue
            with self._cond:
                if self._pending is None:
                    return  # closing and nothing left
                job, self._pending = self._pending, None
                self._active = job
                self._idle_done = False
            try:
                self._work(job)
            except BaseException:  # the writer must survive anything; the store counts failures
                log.exception("[KV-DISK] save failed: unexpected error in the writer thread")
            finally:
                job.lease.release()
                with self._cond:
                    self._active = None
                    self._cond.notify_all()
