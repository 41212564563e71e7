"""Files that vanish under a running store (docs/store.md, "Files that vanish"): a snapshot deleted
by hand or by `kv rm` / `kv gc`, or its whole namespace directory removed. The next save of that
conversation writes it again, lookup finds no hit in a missing file, and the counts are what is on
disk. Real files in a temp dir; the server-level tests are tests/test_server_vanish.py."""

from __future__ import annotations

import logging
import shutil
import statistics
import time

import numpy as np

from edge_llm.config import Geometry
from edge_llm.kvcache import KVCache
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot.identity import IDENTITY_FILE, Identity
from edge_llm.snapshot.store import SnapshotStore

G = Geometry(n_layers=2, n_kv_heads=2, head_dim=8)
KV_BS = 4
ID = Identity(config={"model": "vanish"}, weights_digest="cc" * 32)


def make_cache(tokens, seed=0) -> KVCache:
    c = KVCache(G, max_seq=128, kv_bs=KV_BS, check_memory=False)
    c.data[:] = np.random.default_rng(seed).standard_normal(c.data.shape, dtype=np.float32)
    c.set_tokens(list(tokens))
    return c


def new_store(kv_dir, **kw) -> SnapshotStore:
    s = SnapshotStore(kv_dir, ID, G, kv_bs=KV_BS, compact_idle=None, **kw)
    s.scan()
    return s


def save(store, cache) -> None:
    store.save_async(cache)
    assert store.flush(timeout=60)


def on_disk(store) -> tuple[int, int]:
    files = sorted(store.ns.glob(fmt.SNAPSHOT_GLOB)) if store.ns.is_dir() else []
    return len(files), sum(p.stat().st_size for p in files)


def counts(store) -> tuple[int, int]:
    st = store.stats()
    return st["files"], st["bytes_on_disk"]


def seq(n, start=1000):
    return list(range(start, start + n))


def test_deleted_snapshot_is_written_again_and_not_counted(tmp_path, caplog):
    s = new_store(tmp_path)
    save(s, make_cache(seq(40)))
    (path,) = s.ns.glob(fmt.SNAPSHOT_GLOB)
    rows = path.read_bytes()
    path.unlink()  # `kv rm`, or a user, while the service runs
    assert counts(s) == on_disk(s) == (0, 0)  # main: (1, <its size>) for a file that is gone
    assert s.lookup(seq(40)) is None
    caplog.set_level(logging.INFO, logger="edge_llm.kvdisk")
    save(s, make_cache(seq(40)))  # the same conversation again: main skipped it as "already stored"
    assert path.is_file() and path.read_bytes() == rows
    assert counts(s) == on_disk(s) == (1, len(rows))
    text = caplog.text
    assert f"{path.name} vanished from {s.ns.name}" in text and "already stored" not in text
    assert s.stats()["vanished"] == 1 and s.stats()["saves"] == 2
    s.close()
    s2 = new_store(tmp_path)  # a restart restores from the file written again
    hit = s2.lookup(seq(40) + [1])
    assert hit is not None and hit.m == 40
    assert s2.restore(hit, make_cache(seq(2))).n_tokens == 40
    s2.close()


def test_removed_namespace_directory_is_recreated(tmp_path, caplog):
    s = new_store(tmp_path)
    save(s, make_cache(seq(40)))
    save(s, make_cache(seq(30, start=5000), seed=1))
    ns = s.ns
    shutil.rmtree(ns)
    assert counts(s) == (0, 0)
    caplog.set_level(logging.INFO, logger="edge_llm.kvdisk")
    save(s, make_cache(seq(40)))
    assert (ns / IDENTITY_FILE).is_file() and Identity.from_json((ns / IDENTITY_FILE).read_text()) == ID
    assert counts(s) == on_disk(s) and counts(s)[0] == 1
    assert f"namespace directory {ns.name} was removed under the running store: recreated" in caplog.text
    assert s.stats()["save_failures"] == 0 and not s.degraded
    s.close()
    s2 = new_store(tmp_path)
    assert s2.lookup(seq(40) + [1]).m == 40 and s2.lookup(seq(30, start=5000) + [1]) is None
    s2.close()


def test_delta_whose_base_vanished_is_quarantined_and_the_save_writes_a_full_file(tmp_path):
    s = new_store(tmp_path)
    base = seq(40)
    save(s, make_cache(base))
    save(s, make_cache(base + seq(20, start=7000)))  # a delta on the 40-token file
    (delta,) = [e for e in s.entries() if e.base is not None]
    base_path = s.ns / delta.base.name
    base_path.unlink()
    assert counts(s) == (0, 0)  # the delta cannot be restored without its base: not counted
    assert not delta.path.exists() and any((s.ns / "quarantine").glob(f"*{delta.name}"))
    longer = base + seq(20, start=7000) + seq(10, start=9000)
    save(s, make_cache(longer))
    (e,) = s.entries()
    assert e.base is None and e.n_tokens == len(longer)  # a full file: no base to rest on any more
    assert counts(s) == on_disk(s)
    s.close()


def test_file_replaced_by_a_directory_leaves_the_index(tmp_path):
    s = new_store(tmp_path)
    save(s, make_cache(seq(40)))
    (path,) = s.ns.glob(fmt.SNAPSHOT_GLOB)
    path.unlink()
    path.mkdir()  # not a snapshot any more: neither counted nor looked up
    assert counts(s) == (0, 0) and s.lookup(seq(40) + [1]) is None
    s.close()


def write_files(store, n: int, length: int = 40) -> list[str]:
    """`n` full snapshot files of `length` ids each (conversation i starts at id i * 100), written
    straight into the namespace and indexed by a scan, as a restart would find them."""
    data = np.random.default_rng(0).standard_normal((length, G.kv_dim), dtype=np.float32)
    names = []
    for i in range(n):
        tokens = np.array(seq(length, start=i * 100), dtype="<u4")
        name = fmt.snapshot_name(fmt.fnv1a64(tokens.tobytes()))
        with open(store.ns / name, "wb") as f:
            fmt.write_snapshot(f, tokens, store.model_id, G, KV_BS, lambda _layer, _kv: data)
        names.append(name)
    assert store.scan() == n
    return names


def median_ms(fn, calls: int = 300) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def test_lookup_stats_only_its_hits_chain_and_the_counts_stat_every_file(tmp_path):
    """With 300 indexed files (raised caps): a lookup stats the files of its hit only, so a file
    removed elsewhere is found by the next count, not by the lookup; the counts stat every file.
    Prints the per-call medians docs/store.md quotes (`pytest -s`)."""
    s = new_store(tmp_path, max_files=1000)
    names = write_files(s, 300)
    (s.ns / names[-1]).unlink()  # another conversation's file, removed under the running store
    hit = s.lookup(seq(40, start=0) + [1])
    assert hit is not None and hit.m == 40 and s.catalog.counters["vanished"] == 0
    st = s.stats()
    assert st["files"] == 299 and st["vanished"] == 1
    (s.ns / names[0]).unlink()  # the hit's own file: the lookup finds it gone
    assert s.lookup(seq(40, start=0) + [1]) is None and s.catalog.counters["vanished"] == 2
    hit_ms = median_ms(lambda: s.lookup(seq(40, start=100) + [1]))
    miss_ms = median_ms(lambda: s.lookup(seq(40, start=10**6) + [1]))
    present_ms, stats_ms = median_ms(s.catalog.present), median_ms(s.stats)
    s._dir_mtime = 0  # as after a save of the store's own: the next miss reads the directory's names

    def listing_miss():
        s._dir_mtime = 0
        s.lookup(seq(40, start=10**6) + [1])
    listing_ms = median_ms(listing_miss)
    print(f"\n298 indexed files, medians of 300 calls: lookup hit {hit_ms:.3f} ms, lookup miss "
          f"{miss_ms:.3f} ms, miss that reads the directory's names {listing_ms:.3f} ms, "
          f"Catalog.present {present_ms:.3f} ms, store.stats() {stats_ms:.3f} ms")
    s.close()
