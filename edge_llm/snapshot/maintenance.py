"""Offline maintenance of snapshot directories: what `edge-llm kv rm` and `kv gc` remove.

Functions over a kv dir or one namespace directory, without a store or a model: they decide,
remove (unless told not to) and return what they removed, in removal order; the CLI only parses
arguments and prints. The rules are the server's own (docs/store.md): a delta never outlives
its base (removing a file removes the deltas resting on it, deltas first), and the caps evict
whole chains, least recently used first (`chains.unit_victims`). A running service may hold the
namespace: it stats its index before trusting it, so a file removed here is written again by the
conversation's next save and not counted meanwhile (docs/store.md, "Files that vanish").
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_llm.errors import SnapshotError
from edge_llm.files import TMP_SUFFIX, fsync_dir
from edge_llm.snapshot import chains
from edge_llm.snapshot.identity import NAMESPACE_RE
from edge_llm.snapshot.catalog import QUARANTINE
from edge_llm.snapshot.entries import Entry
from edge_llm.snapshot.layout import is_snapshot_name
from edge_llm.snapshot.store import read_entry


def namespace_dirs(kv_dir: Path, only: str | None = None) -> list[Path]:
    """The namespace directories of a kv dir (all, or the one named `only`), in name order."""
    return sorted(p for p in kv_dir.iterdir() if p.is_dir() and NAMESPACE_RE.match(p.name)
                  and (only is None or p.name == only))


def snapshot_files(ns: Path) -> list[Path]:
    """The snapshot files of a namespace, in name order (no temp or quarantined files; never a
    FIFO or device named like one: opening it could block)."""
    return sorted(p for p in ns.iterdir() if is_snapshot_name(p.name) and p.is_file())


def _entry(ns: Path, path: Path) -> Entry:
    """An index entry from the file's header; an unreadable file stands alone (no base)."""
    try:
        return read_entry(path, None, int(ns.name, 16))
    except (SnapshotError, OSError):
        st = path.stat()
        return Entry(path.name, path, np.empty(0, np.uint32), st.st_size, st.st_mtime)


def _with_dependents(ns: Path, named: list[Path]) -> list[Path]:
    """`named` plus every delta that rests on one of them, the deltas of a chain before its base."""
    index = {p.name: _entry(ns, p) for p in snapshot_files(ns)}
    out = {p.name: index[p.name] for p in named}
    out.update({d.name: d for p in named for d in chains.descendants(index, p.name)})
    return [e.path for e in chains.removal_order(out.values())]


@dataclass(frozen=True)
class Removed:
    path: Path
    dependent: bool = False  # a delta removed because it rests on a removed snapshot


def remove(ns: Path, names: Collection[str] | None) -> list[Removed]:
    """`kv rm`: the snapshots `names` of this namespace (those it holds), or every snapshot, temp
    file and quarantined file when `names` is None; with the deltas resting on them."""
    named = [p for p in snapshot_files(ns) if names is None or p.name in names]
    victims = [Removed(p, names is not None and p.name not in names) for p in _with_dependents(ns, named)]
    if names is None:
        victims += [Removed(p) for p in ns.iterdir() if p.name.endswith(TMP_SUFFIX)]
        q = ns / QUARANTINE
        victims += [Removed(p) for p in q.iterdir()] if q.is_dir() else []
    for v in victims:
        v.path.unlink(missing_ok=True)
    if victims:
        fsync_dir(ns)
    return victims


def evict(ns: Path, max_files: int | None, max_bytes: int | None, dry_run: bool = False) -> list[tuple[Entry, str]]:
    """`kv gc`: whole chains, least recently used first, until the namespace holds at most
    `max_files` chains and `max_bytes` bytes; (file, reason) in removal order. `dry_run`: only
    say what would go."""
    index = {p.name: _entry(ns, p) for p in snapshot_files(ns)}
    victims = [(e, reason) for unit, reason in chains.unit_victims(index, max_files, max_bytes)
               for e in chains.removal_order(unit.members)]
    if not dry_run:
        for e, _ in victims:
            e.path.unlink(missing_ok=True)
        if victims:
            fsync_dir(ns)
    return victims
