"""Moving a namespace's snapshots between boards: `edge-llm kv export` / `kv import` (docs/fleet.md).

An archive is an uncompressed tar: `namespace` (the 16 hex digits), `identity.json` (what the
snapshots were computed with: model, backend numerics, geometry, prefill chunk), then the snapshot
files, every base before the deltas written on it. Export takes a namespace's snapshots (all, or
the named ones with every base of their chains) and checks each fully first; a file that fails is
an error, never an archive member.

Import refuses an archive of another identity than the target namespace's (or than the one the
caller names), stages every file under a temp name of the store's rule (`files.temp_name`: a kill
leaves debris the next scan removes), verifies each one fully (header, ids, model id, every block
CRC, its name = its ids' hash) and every chain (each delta's base in the archive or already on
disk, and the very file it was written on), and only then publishes them, bases first, each by
one rename: a reader sees a whole file or none, a bad archive leaves nothing behind (not even a
new namespace's identity.json, written only before the first rename). Before a member's first
byte is written, `archive.py` holds it to the archive's bounds (regular, its declared size the one
its header implies, the total cap, its time). A name
already on disk is the same token ids: it is kept, not replaced (deltas resting on it stay valid).
A running server indexes the published files at its next lookup miss (`SnapshotStore._adopt_new`).
"""

from __future__ import annotations

import itertools
import logging
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from edge_llm.errors import SnapshotChainError, SnapshotError, SnapshotNotRegular
from edge_llm.files import fsync_dir, open_regular, read_regular, temp_name
from edge_llm.snapshot import chains
from edge_llm.snapshot.archive import (
    IDENTITY_MAX,
    NAMESPACE_MAX,
    ImportCap,
    TransferError,
    check_regular,
    last_use,
    next_member,
    open_stream,
    small_member,
    stage_member,
)
from edge_llm.snapshot.decode import verify_file
from edge_llm.snapshot.entries import Entry
from edge_llm.snapshot.identity import IDENTITY_FILE, NAMESPACE_RE, Identity, ensure_namespace
from edge_llm.snapshot.layout import is_snapshot_name
from edge_llm.snapshot.maintenance import snapshot_files
from edge_llm.snapshot.store import read_entry
from edge_llm.snapshot.writer import Modes

log = logging.getLogger(__name__)

NAMESPACE_MEMBER = "namespace"
__all__ = ["TransferError", "Imported", "export", "import_archive"]


@dataclass(frozen=True)
class Imported:
    namespace: str
    published: list[str]  # bases first
    kept: list[str]  # already on disk (same name = same token ids)


def _identity_text(ns: Path) -> str:
    try:
        text = read_regular(ns / IDENTITY_FILE, SnapshotNotRegular).decode()
        Identity.from_json(text)
    except (OSError, ValueError, KeyError, SnapshotNotRegular) as e:
        raise TransferError(f"{ns}: no readable {IDENTITY_FILE} ({e})") from None
    return text


def export(ns: Path, names: list[str] | None, out: BinaryIO) -> list[Entry]:
    """Write the archive of namespace directory `ns` to `out`: every snapshot, or `names` and the
    bases of their chains. Every file is verified first. Returns the entries written, in order."""
    if not NAMESPACE_RE.match(ns.name):
        raise TransferError(f"{ns}: not a namespace directory (16 hex digits)")
    ident = _identity_text(ns).encode()
    model_id = int(ns.name, 16)
    index: dict[str, Entry] = {}
    for p in snapshot_files(ns):
        try:
            index[p.name] = read_entry(p, None, model_id)
        except (SnapshotError, OSError) as e:
            if names is None:
                raise TransferError(f"{p.name}: {getattr(e, 'reason', 'io-error')}: {e} "
                                    f"(kv rm it, or export by name)") from None
    wanted = list(index) if names is None else names
    chosen: dict[str, Entry] = {}
    for name in wanted:
        if name not in index:
            raise TransferError(f"{name}: not a readable snapshot of namespace {ns.name}")
        try:
            chosen.update((e.name, e) for e in chains.chain_of(index, index[name]))
        except SnapshotChainError as e:
            raise TransferError(f"{name}: its chain is broken: {e}") from None
    order = sorted(chosen.values(), key=lambda e: (e.n_tokens, e.name))  # a base holds fewer ids than its deltas
    for e in order:
        try:
            verify_file(e.path, None, model_id)
        except (SnapshotError, OSError) as err:
            raise TransferError(f"{e.name}: {getattr(err, 'reason', 'io-error')}: {err}") from None
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for member, data in ((NAMESPACE_MEMBER, ns.name.encode()), (IDENTITY_FILE, ident)):
            info = tarfile.TarInfo(member)
            info.size, info.mode = len(data), 0o600
            tar.addfile(info, _Bytes(data))
        for e in order:
            try:
                with open_regular(e.path, SnapshotNotRegular, buffering=0) as f:  # a FIFO swapped in: refused, unread
                    info = tarfile.TarInfo(e.name)
                    info.size, info.mode, info.mtime = os.fstat(f.fileno()).st_size, 0o600, int(e.last_use)
                    tar.addfile(info, f)
            except (SnapshotError, OSError) as err:  # removed or replaced since its check: the archive is void
                raise TransferError(f"{e.name}: {err}") from None
    return order


class _Bytes:
    """A readable object over bytes, for tarfile.addfile."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.pos + n
        chunk, self.pos = self.data[self.pos:end], min(end, len(self.data))
        return chunk


def import_archive(src: BinaryIO, kv_dir: Path, expect_namespace: str | None = None,
                   modes: Modes | None = None, max_bytes: int | None = None) -> Imported:
    """Verify and publish an archive's snapshots into `kv_dir` (see the module docstring); any
    refusal is a TransferError and leaves the kv dir as it was (`archive.py`: the bounds)."""
    modes = modes or Modes()
    staged: list[tuple[Path, Path]] = []  # (temp, final), in archive order
    created: list[Path] = []  # directories this import made, deepest first: removed on failure
    try:
        with open_stream(src) as tar:
            identity = _read_identity(tar, expect_namespace)
            ns = kv_dir / identity.namespace
            fresh = not os.path.lexists(ns / IDENTITY_FILE)  # (a killed import's empty directory too)
            if not fresh:
                here = Identity.from_json(_identity_text(ns))
                if here.canonical_json() != identity.canonical_json():
                    raise TransferError(f"{ns} holds another identity than the archive's")
            cap = ImportCap.for_dir(kv_dir, max_bytes)
            created = list(itertools.takewhile(lambda p: not p.exists(), (ns, kv_dir, *kv_dir.parents)))
            modes.mkdir(ns)
            while (info := next_member(tar)) is not None:  # (iterating would start again at the first member)
                check_regular(info)
                if not is_snapshot_name(info.name):
                    raise TransferError(f"unexpected archive member {info.name!r}")
                mtime = last_use(info)
                final = ns / info.name
                tmp = ns / temp_name(info.name)
                staged.append((tmp, final))
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, modes.file)
                with os.fdopen(fd, "wb") as f:
                    os.fchmod(f.fileno(), modes.file)
                    stage_member(tar, info, f, cap)
                os.utime(tmp, (mtime, mtime))  # its last use on the old board: the LRU order moves along
        result = _verify_and_publish(ns, staged, identity if fresh else None, modes)
        created = []
        return result
    except tarfile.TarError as e:
        raise TransferError(f"not a readable archive: {e}") from None
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        for d in created:  # only if still empty: nothing of anyone else's is removed
            try:
                d.rmdir()
            except OSError:
                break


def _read_identity(tar: tarfile.TarFile, expect_namespace: str | None) -> Identity:
    """The archive's first two members, `namespace` and `identity.json`, checked strictly."""
    ns_name = small_member(tar, NAMESPACE_MEMBER, NAMESPACE_MAX).decode(errors="replace").strip()
    try:
        identity = Identity.from_json(small_member(tar, IDENTITY_FILE, IDENTITY_MAX).decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise TransferError(f"the archive's {IDENTITY_FILE} is not an identity: {e}") from None
    if not NAMESPACE_RE.match(ns_name) or identity.namespace != ns_name:
        raise TransferError(f"the archive's namespace {ns_name!r} is not its identity's "
                            f"({identity.namespace})")
    if expect_namespace is not None and expect_namespace != ns_name:
        raise TransferError(f"the archive holds namespace {ns_name} ({identity.backend_numerics}), not "
                            f"{expect_namespace}: snapshots are portable only between boards of the "
                            f"same identity (model, backend numerics, geometry, prefill chunk)")
    return identity


def _staged_entry(tmp: Path, final: Path, model_id: int) -> Entry:
    """Verify a staged file fully (every field and block CRC) and that its name is its ids' hash
    (with the store's own bound on ids: what its scan would refuse is not imported); its index
    entry, pointing at the staged file."""
    verify_file(tmp, None, model_id)
    return read_entry(tmp, None, model_id, name=final.name)


def _verify_and_publish(ns: Path, staged: list[tuple[Path, Path]], new: Identity | None,
                        modes: Modes) -> Imported:
    """Verify every staged file and chain, then publish (`new`: the identity of a namespace this
    import created, whose identity.json is written only now: a refused archive leaves none)."""
    model_id = int(ns.name, 16)
    incoming: dict[str, Entry] = {}
    for tmp, final in staged:
        if final.name in incoming:
            raise TransferError(f"{final.name} is twice in the archive; nothing imported")
        try:
            incoming[final.name] = _staged_entry(tmp, final, model_id)
        except (SnapshotError, OSError) as err:
            raise TransferError(f"{final.name}: {getattr(err, 'reason', 'io-error')}: {err}; "
                                f"nothing imported") from None
    index: dict[str, Entry] = {}
    for p in snapshot_files(ns):
        try:
            index[p.name] = read_entry(p, None, model_id)
        except (SnapshotError, OSError):
            continue  # the server's scan quarantines it; it is no base of anything imported
    kept = sorted(n for n in incoming if n in index)
    index.update((n, e) for n, e in incoming.items() if n not in index)
    for name in incoming:
        try:
            chains.chain_of(index, index[name])
        except SnapshotChainError as err:
            raise TransferError(f"{name}: {err.reason}: {err}; nothing imported") from None
    if new is not None:
        ensure_namespace(ns.parent, new, modes)
    published = []
    for tmp, final in staged:  # archive order: bases first
        if final.name in kept:
            continue
        os.replace(tmp, final)
        published.append(final.name)
    fsync_dir(ns)
    log.info("[KV-DISK] imported %d snapshot(s) into %s (%d already there)", len(published), ns.name, len(kept))
    return Imported(ns.name, published, kept)
