"""SnapshotStore on real files: save/scan/lookup/restore, dedupe, LRU, quarantine, identity, and
writers waiting (through the KV cache's row leases) only for rows a pending save still needs."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

from edge_llm.config import Geometry
from edge_llm.errors import SnapshotBlockCRC, SnapshotError
from edge_llm.kvcache import KVCache
from edge_llm.progress import Cancelled, Work
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot import saver as saver_mod
from edge_llm.snapshot.identity import Identity
from edge_llm.snapshot.store import SnapshotStore
from helpers.rows_source import RowsFrom
from threadutil import LookedAt, blocked, finishes

G = Geometry(n_layers=2, n_kv_heads=2, head_dim=8)
KV_BS = 4
ID_A = Identity(config={"model": "a"}, weights_digest="aa" * 32)
ID_B = Identity(config={"model": "a"}, weights_digest="bb" * 32)  # same geometry, other weights


def make_cache(tokens, seed=0, max_seq=128, geometry=G) -> KVCache:
    c = KVCache(geometry, max_seq=max_seq, kv_bs=KV_BS, check_memory=False)
    c.data[:] = np.random.default_rng(seed).standard_normal(c.data.shape, dtype=np.float32)
    c.set_tokens(list(tokens))
    return c


def new_store(kv_dir, identity=ID_A, **kw) -> SnapshotStore:
    kw.setdefault("kv_bs", KV_BS)
    s = SnapshotStore(kv_dir, identity, G, **kw)
    s.scan()
    return s


def save(store, cache) -> None:
    store.save_async(cache)
    assert store.flush(timeout=60)


def seq(n, start=1000):
    return list(range(start, start + n))


def kv_files(store):
    return sorted(p.name for p in store.ns.glob(fmt.SNAPSHOT_GLOB))


def name_of(tokens):
    return fmt.snapshot_name(fmt.fnv1a64(np.asarray(tokens, dtype="<u4").tobytes()))


@pytest.fixture(autouse=True)
def _logs(caplog):
    caplog.set_level(logging.INFO, logger="edge_llm.kvdisk")


def kv_lines(caplog, word):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"[KV-DISK] {word}")]


def test_save_scan_lookup_restore_bitwise(tmp_path, caplog):
    tokens = seq(40)
    src = make_cache(tokens, seed=1)
    s1 = new_store(tmp_path)
    save(s1, src)
    name = name_of(tokens)
    assert kv_files(s1) == [name]
    size = fmt.snapshot_size(G.n_layers, 40, G.kv_dim, KV_BS)
    assert re.fullmatch(rf"\[KV-DISK\] saved 40-token KV -> {name} \({size} bytes, \d+\.\d ms, \d+\.\d MB/s\)",
                        kv_lines(caplog, "saved")[0])
    s1.close()
    fmt.verify_file(s1.ns / name, G, ID_A.model_id)

    s2 = new_store(tmp_path)  # a new process would do exactly this
    assert kv_lines(caplog, "index")[-1].startswith("[KV-DISK] index: 1 checkpoint(s)")
    request = tokens[:30] + [7, 8, 9]
    hit = s2.lookup(request)
    assert hit is not None and hit.m == 30 and hit.entry.name == name
    dst = make_cache([], seed=2)
    res = s2.restore(hit, dst)
    assert (res.n_tokens, res.name) == (30, name) and res.nbytes > 0
    assert dst.tokens == tokens[:30]
    assert np.array_equal(dst.data[:, :, :30].view(np.uint32), src.data[:, :, :30].view(np.uint32))
    assert re.fullmatch(rf"\[KV-DISK\] loaded 30-token KV prefix from disk file {name} "
                        rf"\({res.nbytes} bytes, \d+\.\d ms, \d+\.\d MB/s\)", kv_lines(caplog, "loaded")[0])
    st = s2.stats()
    assert st["loads"] == 1 and st["bytes_read"] == res.nbytes and st["files"] == 1
    s2.close()


def test_lookup_min_lcp_and_len_minus_one_cap(tmp_path):
    tokens = seq(40)
    s = new_store(tmp_path, min_lcp=16)
    save(s, make_cache(tokens))
    assert s.lookup(tokens[:15] + [1, 2, 3]) is None  # LCP 15 < 16
    assert s.lookup(tokens[:16] + [1]).m == 16
    assert s.lookup(tokens[:17]).m == 16  # whole request is a prefix: one token left to prefill
    assert s.lookup(tokens).m == 39
    assert s.lookup(tokens + [5, 6]).m == 40  # capped by the snapshot's length
    assert s.lookup([]) is None and s.lookup(tokens[:1]) is None
    # the longest match wins among several snapshots
    other = tokens[:20] + seq(30, start=5000)
    save(s, make_cache(other, seed=3))
    assert s.lookup(other[:45] + [1]).entry.name == name_of(other)
    assert s.lookup(tokens[:35] + [1]).entry.name == name_of(tokens)
    s.close()


def test_save_caps_tokens_and_skips_useless_short(tmp_path):
    s = new_store(tmp_path, max_tokens=32, min_lcp=16)
    save(s, make_cache(seq(10)))
    assert kv_files(s) == []  # shorter than min_lcp: could never be a hit
    save(s, make_cache(seq(50)))
    assert kv_files(s) == [name_of(seq(32))]
    assert s.entries()[0].n_tokens == 32
    s.close()


def test_identical_not_rewritten_only_touched(tmp_path, caplog):
    tokens = seq(40)
    s = new_store(tmp_path)
    save(s, make_cache(tokens))
    path = s.ns / name_of(tokens)
    os.utime(path, (1_000_000, 1_000_000))  # pretend it was last used long ago
    ino = path.stat().st_ino
    save(s, make_cache(tokens))
    assert path.stat().st_ino == ino and path.stat().st_mtime > 1_000_000
    assert s.stats()["saves"] == 1 and s.stats()["saves_skipped"] == 1
    assert kv_lines(caplog, "skipped")[0] == f"[KV-DISK] skipped 40-token KV -> {path.name} (already stored)"
    save(s, make_cache(tokens[:30]))  # a prefix of a stored snapshot adds nothing
    assert kv_files(s) == [path.name] and s.stats()["saves_skipped"] == 2
    s.close()


def test_extension_replaces_older_snapshot_without_deltas(tmp_path, caplog):
    s = new_store(tmp_path, max_chain=1)  # every save a full file (tests/test_store_delta.py: deltas)
    save(s, make_cache(seq(20)))
    save(s, make_cache(seq(40)))
    assert kv_files(s) == [name_of(seq(40))]
    assert f"[KV-DISK] evicted {name_of(seq(20))}" in kv_lines(caplog, "evicted")[0]
    assert s.stats()["files"] == 1
    s.close()


def test_lru_eviction_by_use_under_max_files(tmp_path, caplog):
    s = new_store(tmp_path, max_files=3)
    a, b, c, d = (seq(20, start=k * 100) for k in range(1, 5))
    for t in (a, b, c):
        save(s, make_cache(t))
    s.restore(s.lookup(a + [1]), make_cache([]))  # a hit counts as a use: a is now the newest
    save(s, make_cache(d))
    assert kv_files(s) == sorted([name_of(a), name_of(c), name_of(d)])
    assert kv_lines(caplog, "evicted")[-1].startswith(f"[KV-DISK] evicted {name_of(b)} (lru")
    # LRU order survives a restart (mtime): c is now the oldest
    s.close()
    s2 = new_store(tmp_path, max_files=3)
    save(s2, make_cache(seq(20, start=900)))
    assert name_of(c) not in kv_files(s2) and name_of(a) in kv_files(s2)
    assert s2.stats()["evictions"] == 1
    s2.close()


def test_max_bytes_and_never_evicts_file_just_written(tmp_path):
    one = fmt.snapshot_size(G.n_layers, 20, G.kv_dim, KV_BS)
    s = new_store(tmp_path, max_bytes=2 * one + 10)
    a, b, c = (seq(20, start=k * 100) for k in range(1, 4))
    for t in (a, b, c):
        save(s, make_cache(t))
    assert kv_files(s) == sorted([name_of(b), name_of(c)])
    assert s.stats()["bytes_on_disk"] <= 2 * one + 10
    big = seq(60, start=5000)  # alone it fits, but only after everything else goes
    s.catalog.max_bytes = fmt.snapshot_size(G.n_layers, 60, G.kv_dim, KV_BS)
    save(s, make_cache(big))
    assert kv_files(s) == [name_of(big)]
    s.catalog.max_bytes = 100  # nothing fits: the save is skipped, nothing is evicted
    save(s, make_cache(seq(30, start=7000)))
    assert kv_files(s) == [name_of(big)]
    s.close()


def test_corrupt_files_quarantined_at_scan_tmp_removed(tmp_path, caplog):
    s = new_store(tmp_path)
    good, bad_hdr, short, foreign = (seq(20, start=k * 100) for k in range(1, 5))
    for t in (good, bad_hdr, short):
        save(s, make_cache(t))
    s.close()
    ns = s.ns
    with open(ns / name_of(bad_hdr), "r+b") as f:
        f.seek(8)
        f.write(b"\x07")  # n_layers: header CRC now fails
    with open(ns / name_of(short), "r+b") as f:
        f.truncate(os.path.getsize(ns / name_of(short)) - 1)
    # a valid file of another model_id dropped into this namespace
    with open(ns / name_of(foreign), "wb") as f:
        fmt.write_snapshot(f, foreign, ID_B.model_id, G, KV_BS, lambda l, kv: make_cache(foreign).data[l, kv])
    (ns / "kv_1234.kv.abc.tmp").write_bytes(b"partial")  # an old-style name: no writer named
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (ns / f"kv_1235.kv.{dead.pid}-ab12.tmp").write_bytes(b"partial")  # its writer is gone
    live = ns / f"kv_1236.kv.{os.getppid()}-ab12.tmp"  # a live process (a server sharing the dir)
    live.write_bytes(b"in progress")
    (ns / "notes.txt").write_text("not a snapshot")  # unrelated files are left alone

    s2 = new_store(tmp_path)
    assert [e.name for e in s2.entries()] == [name_of(good)]
    assert kv_lines(caplog, "index")[-1].startswith("[KV-DISK] index: 1 checkpoint(s), 3 rejected")
    rejected = "\n".join(kv_lines(caplog, "rejected"))
    assert f"rejected {name_of(bad_hdr)}: header-crc" in rejected
    assert f"rejected {name_of(short)}: size" in rejected
    assert f"rejected {name_of(foreign)}: model-id" in rejected
    assert list(ns.glob("*.tmp")) == [live] and (ns / "notes.txt").exists()
    live.unlink()
    q = sorted(p.name for p in (ns / "quarantine").iterdir())
    assert len([n for n in q if n.endswith(".reason")]) == 3 and len(q) == 6
    assert s2.stats()["rejections"] == 3
    s2.close()


def test_block_crc_failure_mid_restore(tmp_path, caplog):
    tokens = seq(40)
    s = new_store(tmp_path)
    save(s, make_cache(tokens))
    s.close()
    path = s.ns / name_of(tokens)
    hdr, _ = fmt.read_header(open(path, "rb"), G, ID_A.model_id)
    off = hdr.block_offset(1, 2, 1) + 5  # layer 1, block 2, V: read by a restore of 30 rows
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0x10]))

    s2 = new_store(tmp_path)  # the header is intact: indexed
    hit = s2.lookup(tokens[:30] + [1])
    cache = make_cache(seq(5, start=1))
    with pytest.raises(SnapshotBlockCRC):
        s2.restore(hit, cache)
    assert cache.length == 0  # rows are garbage: the engine recomputes
    assert not path.exists() and any((s2.ns / "quarantine").glob(f"*{path.name}"))
    assert s2.lookup(tokens[:30] + [1]) is None
    st = s2.stats()
    assert (st["load_failures"], st["rejections"], st["loads"]) == (1, 1, 0)
    assert kv_lines(caplog, "rejected")[0].startswith(f"[KV-DISK] rejected {path.name}: block-crc")
    s2.close()


def test_restore_of_vanished_file_fails_cleanly(tmp_path):
    s = new_store(tmp_path)
    save(s, make_cache(seq(40)))
    hit = s.lookup(seq(40))
    hit.entry.path.unlink()
    cache = make_cache(seq(3))
    with pytest.raises(SnapshotError, match="vanished"):
        s.restore(hit, cache)
    # the open failed before a row was touched: the cache keeps its own rows (the engine reuses them)
    assert cache.length == 3 and s.stats()["load_failures"] == 1 and s.lookup(seq(40)) is None
    s.close()


def test_identity_isolation_and_reuse(tmp_path):
    tokens = seq(40)
    a = new_store(tmp_path, ID_A)
    save(a, make_cache(tokens))
    a.close()
    b = new_store(tmp_path, ID_B)
    assert b.ns != a.ns and b.lookup(tokens) is None and b.stats()["files"] == 0
    save(b, make_cache(tokens, seed=9))  # B's own snapshot of the same tokens, own namespace
    b.close()
    a2 = new_store(tmp_path, ID_A)  # A comes back: its snapshot is still there and used
    hit = a2.lookup(tokens)
    assert hit is not None and hit.entry.path.parent == a.ns
    dst = make_cache([])
    a2.restore(hit, dst)
    assert np.array_equal(dst.data[:, :, :39], make_cache(tokens).data[:, :, :39])
    a2.close()


@pytest.fixture
def gated(monkeypatch):
    """Hold the writer thread before it writes, until the test opens the gate (the real write follows)."""
    gate, started = threading.Event(), threading.Event()
    real = saver_mod.publish_file

    def held(*args, **kw):
        started.set()
        assert gate.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(saver_mod, "publish_file", held)
    return gate, started


def test_writers_wait_only_for_rows_a_pending_save_still_needs(tmp_path, gated):
    gate, started = gated
    s = new_store(tmp_path)
    cache = make_cache(seq(40))
    s.save_async(cache)
    assert started.wait(60)  # the save holds rows [0, 40) of every layer; nothing is written yet
    z = np.zeros((1, G.kv_dim), np.float32)
    assert finishes(cache.write, 1, 40, z, z)  # rows >= 40 are not being saved
    assert s.flush(timeout=0.05) is False
    writer = blocked(cache.write, 1, 39, z, z)
    same_rows = RowsFrom(cache.data.copy(), list(cache.tokens))  # a restore of identical rows
    restorer = blocked(lambda: cache.restore(same_rows, False).finish())
    assert writer is not None and restorer is not None  # both must wait for the file
    gate.set()
    writer.join(60)
    restorer.join(60)
    assert not writer.is_alive() and not restorer.is_alive()
    assert s.flush(timeout=60) and s.stats()["saves"] == 1 and kv_files(s) == [name_of(seq(40))]
    fmt.verify_file(s.ns / name_of(seq(40)), G, ID_A.model_id)  # written before the rows changed
    assert finishes(cache.write, 0, 0, z, z)  # the lease is gone
    s.close()


def test_queued_save_is_superseded_by_newer(tmp_path, gated):
    gate, started = gated
    s = new_store(tmp_path)
    s.save_async(make_cache(seq(20, start=100)))
    assert started.wait(60)  # first job is running (held); the next two queue up
    superseded = make_cache(seq(20, start=200))
    s.save_async(superseded)
    s.save_async(make_cache(seq(20, start=300)))
    z = np.zeros((1, G.kv_dim), np.float32)
    assert finishes(superseded.write, 0, 0, z, z)  # a superseded save releases its rows
    gate.set()
    assert s.flush(timeout=60)
    assert kv_files(s) == sorted([name_of(seq(20, start=100)), name_of(seq(20, start=300))])
    assert s.stats()["saves_superseded"] == 1
    s.close()


def test_restore_right_behind_a_real_large_save(tmp_path):
    """A restore into the cache that a pending save is still reading waits per layer for it."""
    big = Geometry(n_layers=4, n_kv_heads=8, head_dim=128)  # 32 KiB per token
    ident = Identity(config={"model": "big"}, weights_digest="cc" * 32)
    s = SnapshotStore(tmp_path, ident, big, kv_bs=64)
    s.scan()
    older = make_cache(seq(2048, start=5), max_seq=2048, geometry=big, seed=9)
    save(s, older)
    cache = make_cache(seq(2048), max_seq=2048, geometry=big)  # 64 MiB of rows
    want = cache.data[:, :, :2048].copy()
    s.save_async(cache)  # still streaming when the restore below starts
    reports = []
    res = s.restore(s.lookup(seq(2048, start=5)), cache, Work(on_progress=lambda *a: reports.append(a)))
    assert res.n_tokens == 2047 and np.array_equal(cache.data[:, :, :2047], older.data[:, :, :2047])
    assert [r for r in reports if r[0] == "restore"] == [("restore", i, 4) for i in range(1, 5)]
    assert s.flush(timeout=120)
    fresh = make_cache([], max_seq=2048, geometry=big, seed=1)
    s.restore(s.lookup(seq(2048) + [7]), fresh)
    assert np.array_equal(fresh.data[:, :, :2048], want)  # the file got the rows from before the restore
    s.close()


def test_scan_drops_superseded_prefix_and_applies_caps(tmp_path, caplog):
    import shutil

    s = new_store(tmp_path, max_chain=1)
    save(s, make_cache(seq(20)))
    old = s.ns / name_of(seq(20))
    shutil.copy2(old, tmp_path / "saved-old")
    save(s, make_cache(seq(40)))  # replaces the 20-token file
    save(s, make_cache(seq(20, start=5000)))
    s.close()
    shutil.copy2(tmp_path / "saved-old", old)  # as if killed before the old file was deleted
    s2 = new_store(tmp_path, max_chain=1)
    assert kv_files(s2) == sorted([name_of(seq(40)), name_of(seq(20, start=5000))])
    assert f"[KV-DISK] evicted {old.name} (replaced by {name_of(seq(40))}" in "\n".join(kv_lines(caplog, "evicted"))
    s2.close()
    s3 = new_store(tmp_path, max_files=1, max_chain=1)  # a lowered cap applies at start-up
    assert kv_files(s3) == [name_of(seq(20, start=5000))]  # the most recently saved stays
    s3.close()


def test_save_after_close_never_raises(tmp_path):
    s = new_store(tmp_path)
    assert s.close(timeout=30)
    s.save_async(make_cache(seq(40)))  # shutdown race: the save is dropped, the request is not
    assert kv_files(s) == []


def test_lease_releases_each_layer_as_soon_as_it_is_written(tmp_path, monkeypatch):
    """A following request overwrites layer l's rows right behind the writer, not after the file;
    each layer the save finishes while a writer waits is reported as progress."""
    gate, at_layer1 = threading.Event(), threading.Event()
    real = fmt.SnapshotWriter.write_layer

    def held(self, layer, k_rows, v_rows):
        if layer == 1:  # layer 0 is written; hold the writer before layer 1
            at_layer1.set()
            assert gate.wait(60)
        return real(self, layer, k_rows, v_rows)

    monkeypatch.setattr(fmt.SnapshotWriter, "write_layer", held)
    s = new_store(tmp_path)
    cache = make_cache(seq(40))
    want = cache.data[:, :, :40].copy()
    s.save_async(cache)
    assert at_layer1.wait(60)
    z = np.zeros((4, G.kv_dim), np.float32)
    assert finishes(cache.write, 0, 0, z, z)  # layer 0's rows are in the file already
    assert s.stats()["save_pending"]
    reports = []
    waiting = LookedAt()  # a cancel flag never set: it tells when the writer waits
    work = Work(cancel=waiting, on_progress=lambda *a: reports.append(a))
    layer1 = blocked(cache.write, 1, 0, z, z, work)  # layer 1 is not written yet: blocked
    assert layer1 is not None
    # the save goes on only once the writer waits in its loop (a thread a busy machine started
    # late would otherwise find layer 1 written already and have no progress to report)
    assert waiting.asked.wait(30)
    gate.set()
    layer1.join(60)
    assert not layer1.is_alive() and ("save-wait", 2, 2) in reports
    assert s.flush(timeout=60)
    s2 = new_store(tmp_path)
    dst = make_cache([], seed=3)
    s2.restore(s2.lookup(seq(40) + [1]), dst)
    assert np.array_equal(dst.data[:, :, :40], want)  # the file holds the rows from before the writes
    s.close()
    s2.close()


def test_cancel_while_waiting_for_a_save(tmp_path, gated):
    gate, started = gated
    s = new_store(tmp_path)
    cache = make_cache(seq(40))
    s.save_async(cache)
    assert started.wait(60)
    cancel = threading.Event()
    err: list[BaseException] = []

    def write():
        z = np.zeros((1, G.kv_dim), np.float32)
        try:
            cache.write(0, 0, z, z, Work(cancel=cancel))
        except Cancelled as e:
            err.append(e)

    th = blocked(write)
    assert th is not None
    cancel.set()
    th.join(30)  # bounds a hang only
    assert not th.is_alive() and isinstance(err[0], Cancelled) and err[0].stage == "save-wait"
    gate.set()
    assert s.flush(timeout=60)
    fmt.verify_file(s.ns / name_of(seq(40)), G, ID_A.model_id)
    s.close()


def test_a_fifo_named_like_a_snapshot_is_skipped_not_opened(tmp_path, caplog):
    """Opening a FIFO for reading blocks until a writer comes: the scan must not open it."""
    s = new_store(tmp_path)
    save(s, make_cache(seq(40)))
    s.close()
    fifo = s.ns / ("kv_" + "0" * 16 + ".kv")
    os.mkfifo(fifo)
    done = []
    t = threading.Thread(target=lambda: done.append(new_store(tmp_path)), daemon=True)
    t.start()
    t.join(30)
    assert done, "the scan blocked on the FIFO"
    s2 = done[0]
    assert [e.name for e in s2.entries()] == [name_of(seq(40))] and fifo.exists()
    assert "skipped kv_0000000000000000.kv: not a regular file" in caplog.text
    s2.close()


def test_a_snapshot_replaced_by_a_fifo_after_the_scan_is_a_miss_not_a_hang(tmp_path, caplog):
    """The restore's open meets a FIFO where the scan indexed a file: refused unread (a plain
    open would block the engine for good), quarantined like any bad file, the cache untouched."""
    s = new_store(tmp_path)
    save(s, make_cache(seq(40)))
    hit = s.lookup(seq(40))
    path = hit.entry.path
    path.unlink()
    os.mkfifo(path)
    cache = make_cache(seq(3))
    got = []
    t = threading.Thread(target=lambda: got.append(s.open(hit, cache.max_seq)), daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # let the blocked reader go
        pytest.fail("the restore blocked on the FIFO")
    assert got == [None] and cache.length == 3
    assert kv_lines(caplog, "rejected")[0].startswith(f"[KV-DISK] rejected {path.name}: not-regular: ")
    assert not path.exists() and list((s.ns / "quarantine").glob("*-" + path.name))
    st = s.stats()
    assert (st["load_failures"], st["rejections"], st["files"]) == (1, 1, 0) and s.lookup(seq(40)) is None
    save(s, make_cache(seq(40)))  # the name is free again: the next save writes a real file
    assert s.lookup(seq(40)) is not None
    s.close()
