"""Write budget of a multi-turn conversation: full rewrite vs delta saves, on the same files.

A conversation grows from `start` to `end` tokens over `turns` turns (synthetic random F32 rows
of the given geometry in a real KVCache, no model). Each turn is saved through a real
SnapshotStore (background writer, fsync, rename), once with deltas (disk_kv_max_chain 8) and
once with every save a full file (max_chain 1). Bytes written and bytes of new KV come from the
store's own counters; the last turn is restored cold from each layout and compared bitwise.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from edge_llm.bench.disk import MB, drop_file_cache
from edge_llm.bench.restore import bench_store, fill_random, rows_equal
from edge_llm.config import Geometry
from edge_llm.kvcache import KVCache
from edge_llm.snapshot.layout import SNAPSHOT_GLOB


def turn_sizes(start: int, end: int, turns: int) -> list[int]:
    return [round(start + (end - start) * i / (turns - 1)) for i in range(turns)]


def write_budget(directory: Path, geometry: Geometry, kv_bs: int, start: int = 2048, end: int = 8192,
                 turns: int = 6, seed: int = 0, step=lambda _m: None) -> dict:
    sizes = turn_sizes(start, end, turns)
    src = KVCache(geometry, max_seq=end, kv_bs=kv_bs)
    tokens = fill_random(src, end, np.random.default_rng(seed))
    out: dict = {"turn_tokens": sizes, "layouts": {}}
    for label, chain in (("delta", 8), ("full", 1)):
        store = bench_store(directory, geometry, kv_bs, end, f"conversation-{label}", max_files=2, max_chain=chain)
        rows = []
        try:
            for n in sizes:
                step(f"write budget ({label}): turn of {n} tokens")
                src.set_tokens(tokens[:n])
                t0 = time.perf_counter()
                store.save_async(src)
                store.flush()
                secs = time.perf_counter() - t0
                ls = dict(store.last_save)
                rows.append({"tokens": n, "new_rows": ls["new_rows"], "bytes_written": ls["bytes"],
                             "new_kv_bytes": ls["new_kv_bytes"], "ratio": ls["bytes"] / ls["new_kv_bytes"],
                             "seconds": secs, "mb_s": ls["bytes"] / MB / secs})
            step(f"write budget ({label}): cold restore of the last turn")
            for p in store.ns.glob(SNAPSHOT_GLOB):
                drop_file_cache(p)
            dst = KVCache(geometry, max_seq=end, kv_bs=kv_bs)
            t0 = time.perf_counter()
            res = store.restore(store.lookup(tokens[:end] + [0]), dst)
            restore_s = time.perf_counter() - t0
            st = store.stats()
        finally:
            store.close()
            shutil.rmtree(store.ns, ignore_errors=True)
        out["layouts"][label] = {
            "turns": rows, "bytes_written": st["bytes_written"], "new_kv_bytes": st["new_kv_bytes"],
            "ratio": st["bytes_written"] / st["new_kv_bytes"], "files": st["files"],
            "restore_files": res.files, "restore_ms": restore_s * 1e3, "restore_mb_s": res.nbytes / MB / restore_s,
            "restored_bitwise_equal": rows_equal(src, dst, end) and dst.tokens == tokens[:end]}
        del dst
    return out


def markdown(res: dict) -> str:
    d, f = res["layouts"]["delta"], res["layouts"]["full"]
    lines = ["| turn | tokens | new rows | full rewrite bytes | delta bytes | delta / new KV | full / new KV |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for i, (a, b) in enumerate(zip(d["turns"], f["turns"])):
        lines.append(f"| {i + 1} | {a['tokens']} | {a['new_rows']} | {b['bytes_written']:,} | {a['bytes_written']:,} "
                     f"| {a['ratio']:.4f} | {b['ratio']:.3f} |")
    lines += ["", f"Whole conversation: delta {d['bytes_written']:,} bytes ({d['ratio']:.4f} x the new KV, "
              f"{d['files']} files), full rewrite {f['bytes_written']:,} bytes ({f['ratio']:.3f} x). "
              f"Cold restore of the last turn: delta chain of {d['restore_files']} files {d['restore_ms']:.0f} ms "
              f"({d['restore_mb_s']:.0f} MB/s), one full file {f['restore_ms']:.0f} ms ({f['restore_mb_s']:.0f} MB/s); "
              f"bitwise equal: {d['restored_bitwise_equal'] and f['restored_bitwise_equal']}."]
    return "\n".join(lines) + "\n"
