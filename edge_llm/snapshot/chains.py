"""Delta chains of one namespace: pure policies over the index (no I/O), shared by the store and
the `edge-llm kv` CLI.

A delta file holds only rows [base_n, n) and names its base: the file of the same first base_n
token ids (`BaseRef`). Its chain is the list root (a full file) ... delta, read in that order by
a restore. Files linked by base references form a tree (a conversation and its branches): the
unit of eviction, so a delta is never left without its base. Only files that no delta depends on
are ever rewritten or removed on their own; see docs/store.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from edge_llm.errors import (
    SnapshotBaseMismatch,
    SnapshotBaseMissing,
    SnapshotChainError,
)
from edge_llm.snapshot.entries import Entry, is_prefix


def chain_of(index: Mapping[str, Entry], entry: Entry) -> list[Entry]:
    """Root first, `entry` last. Raises SnapshotBaseMissing / SnapshotBaseMismatch if a link is
    broken: a base that is gone, or a file of that name that is not the base the delta was
    written on (other row count, other rows: its trailer CRC differs, other ids)."""
    chain = [entry]
    while (ref := chain[-1].base) is not None:
        base = index.get(ref.name)
        if base is None:
            raise SnapshotBaseMissing(f"{chain[-1].name}: base {ref.name} ({ref.n_tokens} tokens) is gone")
        if (base.n_tokens != ref.n_tokens or base.trailer_crc != ref.trailer_crc
                or not is_prefix(base.tokens, chain[-1].tokens) or len(chain) > len(index)):
            raise SnapshotBaseMismatch(f"{chain[-1].name}: {ref.name} is not the base it was written on "
                                       f"({base.n_tokens} tokens, trailer CRC {base.trailer_crc:08x}; "
                                       f"expected {ref.n_tokens}, {ref.trailer_crc:08x})")
        chain.append(base)
    return chain[::-1]


def dependents(index: Mapping[str, Entry]) -> dict[str, list[Entry]]:
    """name -> the deltas written directly on it."""
    out: dict[str, list[Entry]] = {}
    for e in index.values():
        if e.base is not None:
            out.setdefault(e.base.name, []).append(e)
    return out


def descendants(index: Mapping[str, Entry], name: str) -> list[Entry]:
    """Every file whose chain passes through `name` (not `name` itself), nearest first."""
    deps, out, todo = dependents(index), [], [name]
    while todo:
        for d in deps.get(todo.pop(0), []):
            out.append(d)
            todo.append(d.name)
    return out


def removal_order(entries: Iterable[Entry]) -> list[Entry]:
    """Deltas before their bases (a delta holds more tokens than anything below it), so a
    removal interrupted half way never leaves a delta whose base is gone first."""
    return sorted(entries, key=lambda e: e.n_tokens, reverse=True)


def broken(index: Mapping[str, Entry]) -> list[tuple[Entry, SnapshotChainError]]:
    """Files whose chain cannot be read (a missing or mismatched base somewhere below them)."""
    out = []
    for e in index.values():
        try:
            chain_of(index, e)
        except SnapshotChainError as err:
            out.append((e, err))
    return out


def redundant(index: Mapping[str, Entry]) -> list[tuple[Entry, Entry]]:
    """(file, the longer file that covers it): files whose ids are a strict prefix of another
    file's and that no delta depends on. Any hit they give, the longer one gives too. A kill
    between publishing a file and removing what it extends or compacts leaves such files."""
    deps = dependents(index)
    out = []
    for e in index.values():
        if e.name in deps:
            continue
        longer = [o for o in index.values() if o.n_tokens > e.n_tokens and is_prefix(e.tokens, o.tokens)]
        if longer:
            out.append((e, longer[0]))
    return out


@dataclass
class Unit:
    """A tree of files linked by base references: evicted as one."""

    root: str
    members: list[Entry] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(e.size for e in self.members)

    @property
    def last_use(self) -> float:
        return max(e.last_use for e in self.members)

    @property
    def names(self) -> set[str]:
        return {e.name for e in self.members}


def units(index: Mapping[str, Entry]) -> list[Unit]:
    """Group the files by the root of their chain (files with a broken chain form their own)."""
    groups: dict[str, Unit] = {}
    for e in index.values():
        try:
            root = chain_of(index, e)[0].name
        except SnapshotChainError:
            root = e.name
        groups.setdefault(root, Unit(root)).members.append(e)
    return list(groups.values())


def unit_victims(index: Mapping[str, Entry], max_units: int | None, max_bytes: int | None,
                 keep: str | None = None) -> list[tuple[Unit, str]]:
    """Whole units to evict, least recently used first, until at most `max_units` units and
    `max_bytes` bytes remain; never the unit holding `keep`."""
    all_units = units(index)
    count, total = len(all_units), sum(u.size for u in all_units)
    victims = []
    for u in sorted((u for u in all_units if keep not in u.names), key=lambda u: u.last_use):
        if max_units is not None and count > max_units:
            reason = f"lru: {count} chains > max_files {max_units}"
        elif max_bytes is not None and total > max_bytes:
            reason = f"lru: {total} bytes > max_bytes {max_bytes}"
        else:
            break
        victims.append((u, reason))
        count, total = count - 1, total - u.size
    return victims


def depth(index: Mapping[str, Entry], entry: Entry) -> int:
    """Files in the entry's chain (1 for a full file)."""
    return len(chain_of(index, entry))


def compaction_candidates(index: Mapping[str, Entry], min_depth: int) -> list[Entry]:
    """Files that no delta depends on whose chain has at least `min_depth` files, longest first:
    rewriting one as a full file under the same name changes nothing a delta relies on."""
    deps = dependents(index)
    out = []
    for e in index.values():
        if e.name in deps or e.base is None:
            continue
        try:
            d = depth(index, e)
        except SnapshotChainError:
            continue
        if d >= min_depth:
            out.append((d, e))
    return [e for _, e in sorted(out, key=lambda x: -x[0])]


def best_base(index: Mapping[str, Entry], tokens, min_rows: int) -> Entry | None:
    """The longest stored file whose ids are a strict prefix of `tokens` (>= min_rows), with a
    readable chain: a save of `tokens` can then write only the rows after it."""
    best = None
    for e in index.values():
        if min_rows <= e.n_tokens < tokens.shape[0] and (best is None or e.n_tokens > best.n_tokens) \
                and is_prefix(e.tokens, tokens):
            best = e
    if best is not None:
        try:
            chain_of(index, best)
        except SnapshotChainError:
            return None
    return best
