"""snapshot/maintenance.py: what `kv rm` / `kv gc` remove, on a namespace a real store wrote
(a base with a delta on it, and a separate conversation), returned in removal order."""

from __future__ import annotations

import os

import numpy as np

from edge_llm.config import Geometry
from edge_llm.kvcache import KVCache
from edge_llm.snapshot import maintenance
from edge_llm.snapshot.identity import Identity
from edge_llm.snapshot.catalog import QUARANTINE
from edge_llm.snapshot.store import SnapshotStore

G = Geometry(n_layers=2, n_kv_heads=2, head_dim=8)
IDENT = Identity(config={"model": "maintenance"}, weights_digest="cd" * 32)


def namespace(tmp_path):
    """Files by role: base (40 rows), delta (60, written on base), other (50, its own chain);
    last use other < base < delta."""
    s = SnapshotStore(tmp_path / "kv", IDENT, G, kv_bs=4, compact_idle=None)
    s.scan()
    made = []
    for tokens in ([7] * 10 + list(range(40)), list(range(100, 140)), list(range(100, 160))):
        c = KVCache(G, max_seq=64, kv_bs=4, check_memory=False)
        c.data[:] = np.random.default_rng(len(tokens)).standard_normal(c.data.shape, dtype=np.float32)
        c.set_tokens(tokens)
        s.save_async(c)
        assert s.flush(60)
        made.append(next(e for e in s.entries() if e.n_tokens == len(tokens)))
    s.close()
    other, base, delta = (e.path for e in made)
    assert made[2].base is not None and made[2].base.name == base.name  # a delta on base
    for k, p in enumerate((other, base, delta)):
        os.utime(p, (1_700_000_000 + k,) * 2)
    return s.ns, base, delta, other


def test_remove_takes_the_deltas_of_a_named_file_first(tmp_path):
    ns, base, delta, other = namespace(tmp_path)
    assert maintenance.namespace_dirs(ns.parent) == [ns]
    assert maintenance.snapshot_files(ns) == sorted([base, delta, other])
    removed = maintenance.remove(ns, {base.name})
    assert [(r.path, r.dependent) for r in removed] == [(delta, True), (base, False)]
    assert maintenance.snapshot_files(ns) == [other]


def test_remove_all_takes_temp_and_quarantined_files_and_keeps_the_identity(tmp_path):
    ns, base, delta, other = namespace(tmp_path)
    (ns / f"{other.name}.1-ab.tmp").write_bytes(b"x")
    (ns / QUARANTINE).mkdir()
    (ns / QUARANTINE / "20240101T000000-1-kv_x.kv").write_bytes(b"x")
    removed = {r.path.name for r in maintenance.remove(ns, None)}
    assert {base.name, delta.name, other.name, f"{other.name}.1-ab.tmp", "20240101T000000-1-kv_x.kv"} == removed
    assert sorted(p.name for p in ns.iterdir() if p.is_file()) == ["identity.json", "io-stats.json"]


def test_evict_removes_whole_chains_lru_first_and_dry_run_removes_nothing(tmp_path):
    ns, base, delta, other = namespace(tmp_path)
    would = maintenance.evict(ns, 1, None, dry_run=True)
    assert [e.path for e, _ in would] == [other] and other.exists()
    assert [(e.path, why) for e, why in maintenance.evict(ns, 1, None)] == [(other, "lru: 2 chains > max_files 1")]
    assert not other.exists() and maintenance.evict(ns, 1, None) == []
    gone = maintenance.evict(ns, None, 1)  # one byte: the remaining chain goes whole, delta first
    assert [e.path for e, _ in gone] == [delta, base] and "max_bytes 1" in gone[0][1]
    assert maintenance.snapshot_files(ns) == []
