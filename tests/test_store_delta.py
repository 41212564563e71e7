"""Delta chains on real files: a save writes only the rows its longest stored prefix lacks; chains
restore bitwise; compaction, the chain bound and eviction keep every published conversation
restorable; a missing or corrupt base makes its deltas quarantined misses; files and directories
are owner-only whatever the umask (docs/store.md, docs/snapshot-format.md)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from edge_llm.config import Geometry
from edge_llm.errors import SnapshotError
from edge_llm.kvcache import KVCache
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot.identity import Identity
from edge_llm.snapshot.store import SnapshotStore

G = Geometry(n_layers=3, n_kv_heads=2, head_dim=8)  # 192 B of KV per token
KV_BS = 4
ID = Identity(config={"model": "delta"}, weights_digest="de" * 32)
ROWS = np.random.default_rng(7).standard_normal((G.n_layers, 2, 400, G.kv_dim), dtype=np.float32)


def conv(n: int, branch: int = 0) -> list[int]:
    """Token ids of a conversation; branches share their first 30 ids."""
    return [1000 + t if t < 30 else 5000 + branch * 1000 + t for t in range(n)]


def cache_for(tokens, branch: int = 0) -> KVCache:
    c = KVCache(G, max_seq=400, kv_bs=KV_BS, check_memory=False)
    c.data[:] = ROWS
    if branch:  # rows after the shared 30 differ per branch
        c.data[:, :, 30:] += branch
    c.set_tokens(tokens)
    return c


def new_store(kv_dir, **kw) -> SnapshotStore:
    kw.setdefault("kv_bs", KV_BS)
    kw.setdefault("compact_idle", None)
    s = SnapshotStore(kv_dir, ID, G, **kw)
    s.scan()
    return s


def save(s, cache):
    s.save_async(cache)
    assert s.flush(60)


def restore_rows(s, tokens, m=None):
    hit = s.lookup(list(tokens) + [0])
    assert hit is not None, "no hit"
    if m is not None:
        from edge_llm.snapshot.entries import Hit

        hit = Hit(hit.entry, m)
    dst = KVCache(G, max_seq=400, kv_bs=KV_BS, check_memory=False)
    dst.data[:] = np.nan
    res = s.restore(hit, dst)
    return res, dst


def same(a: KVCache, ref: np.ndarray, n: int) -> bool:
    return bool(np.array_equal(a.data[:, :, :n].view(np.uint32), ref[:, :, :n].view(np.uint32)))


def test_six_turns_write_only_new_rows_and_restore_bitwise(tmp_path):
    s = new_store(tmp_path)
    sizes = [37, 81, 120, 175, 233, 301]  # not block multiples: deltas start mid-block
    for n in sizes:
        save(s, cache_for(conv(n)))
    st = s.stats()
    assert st["saves"] == 6 and st["saves_delta"] == 5 and st["files"] == 6 and st["chains"] == 1
    bpt = G.kv_bytes_per_token
    assert st["new_kv_bytes"] == 301 * bpt
    # bytes written: the KV of the new rows + per file a header, all ids, the base record, CRCs
    overhead = sum(64 + 4 * n + 8 * G.n_layers * -(-(n - p) // KV_BS) for p, n in zip([0] + sizes, sizes))
    assert st["bytes_written"] == 301 * bpt + overhead + 5 * 28
    tip = max(s.entries(), key=lambda e: e.n_tokens)
    assert [e.n_tokens for e in s.chain(tip)] == sizes and tip.row0 == 233
    s.close()
    s2 = new_store(tmp_path)  # a restart: the chain is indexed from headers
    for m in (20, 37, 38, 100, 233, 234, 300):  # inside the root, at and across every boundary
        res, dst = restore_rows(s2, conv(301), m)
        assert res.n_tokens == m and same(dst, ROWS, m) and dst.tokens == conv(m)
    res, dst = restore_rows(s2, conv(301))
    assert res.files == 6 and res.n_tokens == 301 and same(dst, ROWS, 301)
    for p in s2.ns.glob(fmt.SNAPSHOT_GLOB):
        fmt.verify_file(p, G, ID.model_id)
    s2.close()


def test_chain_bound_compaction_and_eviction_keep_conversations_restorable(tmp_path, caplog):
    s = new_store(tmp_path, max_chain=3, max_files=2)
    for n in (40, 60, 80):
        save(s, cache_for(conv(n)))
    assert s.stats()["files"] == 3
    save(s, cache_for(conv(100)))  # a 4th file would exceed max_chain 3: one full file instead
    assert [e.name for e in s.entries()] == [fmt.snapshot_name(fmt.fnv1a64(np.asarray(conv(100), "<u4").tobytes()))]
    assert s.entries()[0].base is None
    # a branch shares the first 30 ids only: its delta sits on nothing shorter than 30 -> full file
    save(s, cache_for(conv(50, branch=1), branch=1))
    save(s, cache_for(conv(90, branch=1), branch=1))
    assert s.stats()["chains"] == 2
    # idle compaction rewrites the branch's chain as one file under the tip's name
    tip = max((e for e in s.entries() if e.base is not None), key=lambda e: e.n_tokens)
    assert s.compact(tip)
    assert s.stats()["compactions"] == 1 and all(e.base is None for e in s.entries())
    ref1 = ROWS.copy()
    ref1[:, :, 30:] += 1
    res, dst = restore_rows(s, conv(90, branch=1))
    assert res.files == 1 and same(dst, ref1, 90)
    # a third conversation evicts the least recently used chain as a whole, never half of one
    save(s, cache_for(conv(50, branch=2), branch=2))
    save(s, cache_for(conv(70, branch=2), branch=2))
    s.close()
    s2 = new_store(tmp_path, max_chain=3, max_files=2)
    assert s2.stats()["chains"] == 2 and s2.stats()["rejections"] == 0
    for e in s2.entries():  # every file left has its whole chain
        assert s2.chain(e)[0].base is None
    ref2 = ROWS.copy()
    ref2[:, :, 30:] += 2
    assert same(restore_rows(s2, conv(70, branch=2))[1], ref2, 70)
    assert same(restore_rows(s2, conv(90, branch=1))[1], ref1, 90)
    assert s2.lookup(conv(100) + [0]).m == 30  # the evicted chain: only the shared prefix matches
    s2.close()


@pytest.mark.parametrize("damage", ["delete", "corrupt-block", "replace"])
def test_missing_or_bad_base_makes_deltas_quarantined_misses(tmp_path, damage):
    s = new_store(tmp_path)
    for n in (40, 80, 120):
        save(s, cache_for(conv(n)))
    root, mid, tip = sorted(s.entries(), key=lambda e: e.n_tokens)
    s.close()
    if damage == "delete":
        mid.path.unlink()
    elif damage == "replace":  # same ids, other rows: the name matches, the trailer CRC does not
        other = cache_for(conv(80))
        other.data[:, :, 50] += 1
        tmp = new_store(tmp_path / "other", max_chain=1)
        save(tmp, other)
        tmp.close()
        os.replace(next(tmp.ns.glob(fmt.SNAPSHOT_GLOB)), mid.path)
    else:  # a bit flip in the middle file's payload: only a restore sees it
        hdr, _ = fmt.read_header(open(mid.path, "rb"), G, ID.model_id)
        with open(mid.path, "r+b") as f:
            f.seek(hdr.block_offset(1, 0, 0) + 3)
            b = f.read(1)
            f.seek(hdr.block_offset(1, 0, 0) + 3)
            f.write(bytes([b[0] ^ 4]))
    s2 = new_store(tmp_path)
    qdir = s2.ns / "quarantine"
    if damage == "corrupt-block":
        assert s2.stats()["files"] == 3  # the scan reads no payload
        hit = s2.lookup(conv(120) + [0])
        dst = KVCache(G, max_seq=400, kv_bs=KV_BS, check_memory=False)
        with pytest.raises(SnapshotError, match="block-crc|CRC"):
            s2.restore(hit, dst)
        assert dst.length == 0
    names = {e.name for e in s2.entries()}
    # "replace": the new middle file is a sound full snapshot of its own (it covers the root)
    keep = mid if damage == "replace" else root
    assert names == {keep.name}, "the damaged file and every delta on it are gone from the index"
    quarantined = " ".join(p.name for p in qdir.iterdir())
    assert tip.name in quarantined and not tip.path.exists()
    reasons = " ".join(p.read_text() for p in qdir.glob("*.reason"))
    assert "base-missing" in reasons or "base-mismatch" in reasons
    # a miss for the rows above the root, never wrong data: the root still restores
    res, dst = restore_rows(s2, conv(120))
    assert res.n_tokens == keep.n_tokens
    assert same(dst, other.data if damage == "replace" else ROWS, keep.n_tokens)
    s2.close()


def test_delta_is_not_published_without_its_base(tmp_path, monkeypatch):
    """The base vanishes (quarantined by a failed restore) while its delta is being written."""
    s = new_store(tmp_path)
    save(s, cache_for(conv(40)))
    base = s.entries()[0]
    from edge_llm.snapshot import saver as saver_mod

    real = saver_mod.publish_file

    def racing(*a, **kw):
        out = real(*a, **kw)
        s.catalog.drop_quarantined(s.catalog.index[base.name], "block-crc: simulated")
        return out

    monkeypatch.setattr(saver_mod, "publish_file", racing)
    save(s, cache_for(conv(80)))
    assert s.stats()["files"] == 0 and not list(s.ns.glob(fmt.SNAPSHOT_GLOB))
    s.close()


def test_owner_only_files_and_dirs_under_umask_022(tmp_path):
    code = f"""
import os, sys
sys.path.insert(0, {str(os.getcwd())!r})
os.umask(0o022)
from tests.test_store_delta import new_store, save, cache_for, conv
s = new_store({str(tmp_path / 'home' / 'kv')!r})
for n in (40, 80):
    save(s, cache_for(conv(n)))
s.catalog.drop_quarantined(s.entries()[0], "test")
s.close()
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.getcwd())
    kv = tmp_path / "home" / "kv"
    seen = 0
    for p in [kv.parent, kv, *kv.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        want = 0o700 if p.is_dir() else 0o600
        assert mode == want, f"{p}: {oct(mode)} != {oct(want)}"
        seen += 1
    assert seen >= 7  # home, kv, namespace, identity.json, io-stats.json, quarantine + files
    # the operator's choice: the service group may read
    s = new_store(tmp_path / "lab", group_read=True)
    save(s, cache_for(conv(40)))
    s.close()
    assert stat.S_IMODE(next(s.ns.glob(fmt.SNAPSHOT_GLOB)).stat().st_mode) == 0o640
    assert stat.S_IMODE(s.ns.stat().st_mode) == 0o750


def test_kv_ls_warns_about_snapshots_readable_by_others(tmp_path):
    from click.testing import CliRunner

    from edge_llm.cli.kv import kv

    s = new_store(tmp_path)
    for n in (40, 80):
        save(s, cache_for(conv(n)))
    s.close()
    res = CliRunner().invoke(kv, ["ls", "--kv-dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "readable by others" not in res.output, res.output
    assert "delta" in res.output and "written" in res.output
    f = next(s.ns.glob(fmt.SNAPSHOT_GLOB))
    os.chmod(f, 0o644)
    os.chmod(s.ns, 0o755)
    res = CliRunner().invoke(kv, ["ls", "--kv-dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert res.output.count("readable by others") == 2, res.output


def test_kv_gc_evicts_a_chain_as_one_unit_deltas_first(tmp_path):
    """The offline `kv gc` keeps the store's rule: it never leaves a delta without its base."""
    from click.testing import CliRunner

    from edge_llm.cli.kv import kv

    s = new_store(tmp_path)
    for n in (40, 80, 120):  # one conversation: a full file and two deltas on it
        save(s, cache_for(conv(n)))
    save(s, cache_for(conv(60, branch=1), branch=1))  # another conversation, used last
    st = s.stats()
    assert (st["chains"], st["files"]) == (2, 4), st
    rows = {e.name: e.n_tokens for e in s.entries()}
    s.close()
    res = CliRunner().invoke(kv, ["gc", "--kv-dir", str(tmp_path), "--max-files", "1"])
    assert res.exit_code == 0, res.output
    evicted = [line.split("/")[1].split()[0] for line in res.output.splitlines() if line.startswith("evicted")]
    assert [rows[n] for n in evicted] == [120, 80, 40], res.output  # deltas first, the base last
    assert "(lru: 2 chains > max_files 1)" in res.output
    assert [rows[p.name] for p in s.ns.glob(fmt.SNAPSHOT_GLOB)] == [60]
    again = new_store(tmp_path)  # the survivor is intact: nothing quarantined at scan
    assert again.stats()["files"] == 1 and again.lookup(conv(60, branch=1) + [0]) is not None
    again.close()


def test_kv_rm_of_a_base_takes_its_deltas(tmp_path):
    from click.testing import CliRunner

    from edge_llm.cli.kv import kv

    s = new_store(tmp_path)
    for n in (40, 80, 120):
        save(s, cache_for(conv(n)))
    save(s, cache_for(conv(60, branch=1), branch=1))
    by_rows = {e.n_tokens: e.name for e in s.entries()}
    s.close()
    res = CliRunner().invoke(kv, ["rm", "--kv-dir", str(tmp_path), by_rows[80]])
    assert res.exit_code == 0, res.output
    removed = [line.split("/")[1].split()[0] for line in res.output.splitlines() if line.startswith("removed")]
    assert removed == [by_rows[120], by_rows[80]], res.output  # the delta on it first, then it
    assert "a delta resting on a removed snapshot" in res.output
    assert sorted(p.name for p in s.ns.glob(fmt.SNAPSHOT_GLOB)) == sorted([by_rows[40], by_rows[60]])
    again = new_store(tmp_path)
    assert again.stats()["files"] == 2  # nothing left to quarantine
    again.close()
