"""`edge-llm bench restore`: snapshot save / cold restore / index scan vs the raw disk.

Synthetic KV (random F32 rows in a real KVCache, no model) of a given geometry is saved through
the SnapshotStore (background writer: temp file, VLKV writer, fsync, rename, dir fsync), restored
by the store with a cold page cache straight into a second KVCache, and compared bitwise. Each figure sits
next to the raw sequential write+fsync / cold read bandwidth of the same directory, measured in
the same run. The scan part indexes N files the way the store does (header + token ids + trailer)
and reports the device bytes read, to show that no payload is touched.
"""

from __future__ import annotations

import logging
import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np

from edge_llm.bench.disk import (
    MB,
    Throughput,
    drop_file_cache,
    measure_raw,
    proc_read_bytes,
)
from edge_llm.config import Geometry
from edge_llm.kvcache import KVCache
from edge_llm.settings import DEFAULTS
from edge_llm.snapshot.format import (
    SNAPSHOT_GLOB,
    fnv1a64,
    snapshot_name,
    snapshot_size,
)
from edge_llm.snapshot.identity import Identity
from edge_llm.snapshot.store import SnapshotStore

log = logging.getLogger(__name__)

PRESETS = {"qwen3-vl-2b": Geometry(28, 8, 128)}
SAVE_GOAL, RESTORE_GOAL = 0.80, 0.90


def fill_random(cache: KVCache, n: int, rng: np.random.Generator) -> list[int]:
    """Random rows [0, n) for every layer/K/V, random token ids; returns the ids."""
    for layer in range(cache.geometry.n_layers):
        for kv in (0, 1):
            rows = cache.rows(layer, kv, 0, n)
            rows[...] = rng.standard_normal(rows.shape, dtype=np.float32)
    tokens = rng.integers(0, 151936, size=n).tolist()
    cache.set_tokens(tokens)
    return tokens


def bench_store(directory: Path, geometry: Geometry, kv_bs: int, max_tokens: int, tag: str,
                max_files: int = 8, max_chain: int = DEFAULTS.disk_kv_max_chain) -> SnapshotStore:
    """A SnapshotStore in its own namespace (identity of a synthetic, never-served model)."""
    ident = Identity(config={"bench": tag, "n_layers": geometry.n_layers, "n_kv_heads": geometry.n_kv_heads,
                             "head_dim": geometry.head_dim}, weights_digest="synthetic-random-rows")
    store = SnapshotStore(directory, ident, geometry, max_files=max_files, max_tokens=max_tokens, kv_bs=kv_bs,
                          max_chain=max_chain)
    store.scan()
    return store


def save_snapshot(store: SnapshotStore, cache: KVCache) -> tuple[Path, Throughput]:
    """Save through the store (background writer: temp, write, fsync, rename, dir fsync); wait for it."""
    t0 = time.perf_counter()
    store.save_async(cache)
    store.flush()
    dt = time.perf_counter() - t0
    tokens = np.asarray(cache.tokens, dtype=np.uint32)
    path = store.ns / snapshot_name(fnv1a64(tokens.astype("<u4").tobytes()))
    if not path.is_file():
        raise OSError(f"the store did not publish {path.name}: see the [KV-DISK] log lines")
    return path, Throughput(path.stat().st_size, dt)


def restore_cold(store: SnapshotStore, path: Path, cache: KVCache, tokens: list[int]) -> Throughput:
    """Drop the file's pages, then look it up and restore every row into `cache` via the store."""
    drop_file_cache(path)
    cache.reset()
    rb0 = proc_read_bytes()
    t0 = time.perf_counter()
    hit = store.lookup(list(tokens) + [0])  # one extra token: the store restores at most len - 1 rows
    if hit is None or hit.m != len(tokens) or hit.entry.path != path:
        raise RuntimeError(f"lookup did not find the whole {len(tokens)}-token snapshot {path.name}")
    store.restore(hit, cache)
    dt = time.perf_counter() - t0
    rb1 = proc_read_bytes()
    return Throughput(path.stat().st_size, dt, None if rb0 is None or rb1 is None else rb1 - rb0)


def _raw_round(directory: Path, size: int, runs: dict, step, label: str) -> None:
    """Raw sequential write+fsync and cold read of `size` bytes in the kv directory."""
    step(f"{label}: raw disk")
    raw = measure_raw(directory, size)
    runs["raw_write"].append(raw.write)
    runs["raw_read"].append(raw.read)


def _store_round(store: SnapshotStore, src: KVCache, dst: KVCache, runs: dict, step, label: str,
                 first: bool) -> tuple[bool, int]:
    """Save `src` through the store, restore it cold into `dst`; (bitwise equal, file size)."""
    step(f"{label}: save + cold restore")
    n = src.length
    path, save = save_snapshot(store, src)
    runs["save"].append(save)
    equal = True
    if first:  # first restore into a cache no restore wrote yet: a freshly started server
        runs["restore_fresh"].append(restore_cold(store, path, dst, src.tokens))
        equal &= rows_equal(src, dst, n) and dst.tokens == src.tokens
    runs["restore"].append(restore_cold(store, path, dst, src.tokens))
    equal &= rows_equal(src, dst, n) and dst.tokens == src.tokens
    on_disk = path.stat().st_size
    forget(store, path)
    return equal, on_disk


def forget(store: SnapshotStore, path: Path) -> None:
    """Delete a benchmark file and re-index, so the next save of the same rows is not deduped."""
    path.unlink()
    store.scan()


def scan_cold(store: SnapshotStore) -> dict:
    """The store's start-up scan with every file's pages dropped first; device bytes read."""
    files = sorted(store.ns.glob(SNAPSHOT_GLOB))
    for p in files:
        drop_file_cache(p)
    rb0 = proc_read_bytes()
    t0 = time.perf_counter()
    indexed = store.scan()
    dt = time.perf_counter() - t0
    rb1 = proc_read_bytes()
    return {"files": indexed, "file_bytes": sum(p.stat().st_size for p in files), "seconds": dt,
            "device_read_bytes": None if rb0 is None or rb1 is None else rb1 - rb0}


def _median(runs: list[Throughput]) -> Throughput:
    """The run with the median throughput (upper median for an even count)."""
    return sorted(runs, key=lambda t: t.mb_s)[len(runs) // 2]


def rows_equal(a: KVCache, b: KVCache, n: int) -> bool:
    """Bitwise equality of rows [0, n) (compared as u32 so that NaN payloads count too)."""
    return bool(np.array_equal(a.data[:, :, :n].view(np.uint32), b.data[:, :, :n].view(np.uint32)))


def run(directory: Path, geometry: Geometry, contexts: list[int], kv_bs: int = DEFAULTS.kv_bs, scan_files: int = DEFAULTS.disk_kv_max_files,
        scan_tokens: int | None = None, seed: int = 0, repeats: int = 3, progress=None) -> dict:
    """The whole benchmark; returns a JSON-ready dict. `progress(description)` is called per step."""
    step = progress or (lambda _msg: None)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    need = snapshot_size(geometry.n_layers, max(contexts), geometry.kv_dim, kv_bs) * 2
    free = shutil.disk_usage(directory).free
    if need > free:
        raise OSError(f"{directory}: needs ~{need / MB:.0f} MB free, has {free / MB:.0f} MB")
    out = {"geometry": {"n_layers": geometry.n_layers, "n_kv_heads": geometry.n_kv_heads,
                        "head_dim": geometry.head_dim, "bytes_per_token": geometry.kv_bytes_per_token},
           "kv_bs": kv_bs, "directory": str(directory), "contexts": []}
    store = bench_store(directory, geometry, kv_bs, max(contexts), "restore")
    for n in contexts:
        size = snapshot_size(geometry.n_layers, n, geometry.kv_dim, kv_bs)
        step(f"{n} tokens: random KV rows")
        src = KVCache(geometry, max_seq=n, kv_bs=kv_bs)
        fill_random(src, n, rng)
        dst = KVCache(geometry, max_seq=n, kv_bs=kv_bs)  # fresh: its pages are not committed yet
        runs: dict[str, list[Throughput]] = {"raw_write": [], "raw_read": [], "save": [],
                                             "restore_fresh": [], "restore": []}
        equal, on_disk = True, 0
        for i in range(repeats):
            label = f"{n} tokens ({size / MB:.0f} MB), run {i + 1}/{repeats}"
            rounds = [partial(_raw_round, directory, size, runs, step, label),
                      partial(_store_round, store, src, dst, runs, step, label, first=i == 0)]
            # alternate the order: a virtual disk that throttles after a burst must not always
            # penalise the same side of the comparison
            for fn in (rounds if i % 2 == 0 else rounds[::-1]):
                result = fn()
                if result is not None:
                    same, on_disk = result
                    equal &= same
        del src, dst
        med = {k: _median(v) for k, v in runs.items()}
        row = {"tokens": n, "snapshot_bytes": on_disk,
               "formula_bytes": 64 + 4 * n + n * geometry.kv_bytes_per_token + 8 * geometry.n_layers * -(-n // kv_bs),
               "repeats": repeats, **{k: t.to_dict() for k, t in med.items()},
               "all_mb_s": {k: [round(t.mb_s, 1) for t in v] for k, v in runs.items()},
               "save_vs_raw": med["save"].mb_s / med["raw_write"].mb_s,
               "restore_vs_raw": med["restore"].mb_s / med["raw_read"].mb_s,
               "restore_fresh_vs_raw": med["restore_fresh"].mb_s / med["raw_read"].mb_s,
               "restored_bitwise_equal": equal}
        row["save_goal_met"] = row["save_vs_raw"] >= SAVE_GOAL
        row["restore_goal_met"] = row["restore_vs_raw"] >= RESTORE_GOAL
        out["contexts"].append(row)
        log.info("restore bench %d tokens: save %.1f MB/s (raw %.1f), restore %.1f MB/s / fresh cache %.1f MB/s "
                 "(raw %.1f), equal=%s", n, med["save"].mb_s, med["raw_write"].mb_s, med["restore"].mb_s,
                 med["restore_fresh"].mb_s, med["raw_read"].mb_s, equal)
    n_scan = scan_tokens or min(contexts)
    step(f"scan: writing {scan_files} snapshots of {n_scan} tokens")
    store.close()
    scan_store = bench_store(directory, geometry, kv_bs, n_scan, "scan", max_files=scan_files)
    cache = KVCache(geometry, max_seq=n_scan, kv_bs=kv_bs)
    try:
        for _ in range(scan_files):
            fill_random(cache, n_scan, rng)  # distinct tokens -> distinct files
            save_snapshot(scan_store, cache)
        step("scan: index (cold)")
        scan = scan_cold(scan_store)
    finally:
        scan_store.close()
        for ns in (store.ns, scan_store.ns):
            shutil.rmtree(ns, ignore_errors=True)
    payload = scan_files * n_scan * geometry.kv_bytes_per_token
    scan["payload_bytes"] = payload
    # the scan reads header + ids + trailer (plus page-size readahead): far below any payload
    scan["reads_no_payload"] = scan["device_read_bytes"] is not None and scan["device_read_bytes"] < payload / 10
    out["scan"] = scan
    return out


def markdown(res: dict) -> str:
    g = res["geometry"]
    lines = [f"Geometry: {g['n_layers']} layers x {g['n_kv_heads']} KV heads x {g['head_dim']} dims "
             f"({g['bytes_per_token']:,} B/token), kv_bs {res['kv_bs']}.", "",
             "| tokens | snapshot bytes | raw write+fsync MB/s | save MB/s | save/raw | raw cold read MB/s "
             "| restore MB/s | restore/raw | restore into fresh cache MB/s | bitwise equal |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in res["contexts"]:
        lines.append(
            f"| {r['tokens']} | {r['snapshot_bytes']:,} | {r['raw_write']['mb_s']:.1f} | {r['save']['mb_s']:.1f} "
            f"| {r['save_vs_raw']:.0%} {'ok' if r['save_goal_met'] else 'below 80%'} "
            f"| {r['raw_read']['mb_s']:.1f} | {r['restore']['mb_s']:.1f} "
            f"| {r['restore_vs_raw']:.0%} {'ok' if r['restore_goal_met'] else 'below 90%'} "
            f"| {r['restore_fresh']['mb_s']:.1f} ({r['restore_fresh_vs_raw']:.0%}) "
            f"| {'yes' if r['restored_bitwise_equal'] else 'NO'} |")
    lines += ["", f"Medians of {res['contexts'][0]['repeats']} runs each; every read is cold (the file's pages are "
              "dropped with posix_fadvise(DONTNEED) first). 'fresh cache' is the first restore into a KVCache "
              "whose pages were never touched, as in a freshly started server: it includes the page faults "
              "that commit the cache memory."]
    s = res["scan"]
    dev = "n/a" if s["device_read_bytes"] is None else f"{s['device_read_bytes']:,}"
    lines += ["", f"Index scan of {s['files']} files ({s['file_bytes']:,} bytes on disk, "
              f"{s['payload_bytes']:,} payload): {s['seconds'] * 1e3:.1f} ms, device bytes read {dev} "
              f"-> {'no payload read' if s['reads_no_payload'] else 'PAYLOAD READ or not measurable'}."]
    return "\n".join(lines) + "\n"
