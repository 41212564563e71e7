"""Crash-test writer (run as a subprocess by tests/test_store_crash.py, killed with SIGKILL).

Loops forever saving snapshots of growing token sequences with a real SnapshotStore: each save
is a delta on the previous one (chains of up to MAX_CHAIN files, then a full rewrite), and every
third save is followed by a compaction of the chain into one file. Token ids and KV rows are pure
functions of (seed, branch, token index), so the test can check every file that survives a kill
bit for bit. Prints "ready" once the first snapshot is published, then "saved BRANCH N" after
each save is published (so the test knows what must survive).

usage: kv_crash_writer.py KV_DIR SEED
"""

from __future__ import annotations

import sys

import numpy as np

from edge_llm.config import Geometry
from edge_llm.kvcache import KVCache
from edge_llm.snapshot.identity import Identity

GEOMETRY = Geometry(n_layers=4, n_kv_heads=4, head_dim=64)  # 8 KiB of KV per token
KV_BS = 16
MAX_SEQ = 640
STEP = 48  # tokens added per save; a branch restarts from 16 tokens when it would pass MAX_SEQ
IDENTITY = Identity(config={"test": "crash-writer"}, weights_digest="5e" * 32)
MAX_CHAIN = 4


def tokens_for(seed: int, branch: int, n: int) -> list[int]:
    """Token ids of `branch`: the first id encodes (seed, branch) so a file names its own origin."""
    return [seed * 1000 + branch] + [(seed * 7919 + branch * 104729 + t * 31) % 150000 + 1000 for t in range(1, n)]


def rows_for(seed: int, branch: int, n: int) -> np.ndarray:
    """(n_layers, 2, n, kv_dim) float32 rows whose bits are a hash of (seed, branch, l, kv, t, d)."""
    g = GEOMETRY
    idx = np.indices((g.n_layers, 2, n, g.kv_dim), dtype=np.uint64)
    # mix in Python ints (arbitrary precision, masked): numpy scalar uint64 overflow warns
    x = np.uint64((seed * 0x9E3779B97F4A7C15 + branch * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF)
    for a, mult in zip(idx, (0x94D049BB133111EB, 0x2545F4914F6CDD1D, 0xD6E8FEB86659FD93, 0xA0761D6478BD642F)):
        x = (x ^ (a * np.uint64(mult))) * np.uint64(0xFF51AFD7ED558CCD)
        x ^= x >> np.uint64(29)
    return (x & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)


def origin(first_token: int) -> tuple[int, int]:
    """(seed, branch) from a sequence's first token id."""
    return divmod(first_token, 1000)


def schedule(step: int) -> tuple[int, int]:
    """(branch, n_tokens) of save number `step`: growing sequences, a new branch when full."""
    per_branch = (MAX_SEQ - 16) // STEP + 1
    return step // per_branch, 16 + STEP * (step % per_branch)


def main() -> None:
    from edge_llm.snapshot.store import SnapshotStore

    kv_dir, seed = sys.argv[1], int(sys.argv[2])
    store = SnapshotStore(kv_dir, IDENTITY, GEOMETRY, min_lcp=16, max_files=3, kv_bs=KV_BS, max_chain=MAX_CHAIN,
                          compact_idle=None)
    store.scan()
    cache = KVCache(GEOMETRY, max_seq=MAX_SEQ, kv_bs=KV_BS, check_memory=False)
    step, rows = 0, {}
    while True:
        branch, n = schedule(step)
        if branch not in rows:  # rows_for(n) == rows_for(MAX_SEQ)[:, :, :n]: hash per index
            rows = {branch: rows_for(seed, branch, MAX_SEQ)}
        cache.reset()
        for layer in range(GEOMETRY.n_layers):  # through the cache, which waits for the pending save
            cache.write(layer, 0, rows[branch][layer, 0, :n], rows[branch][layer, 1, :n])
        cache.set_tokens(tokens_for(seed, branch, n))
        store.save_async(cache)
        store.flush()
        if step == 0:
            print("ready", flush=True)
        print(f"saved {branch} {n}", flush=True)
        if step % 3 == 2:  # a compaction, as after an idle period
            tip = max(store.entries(), key=lambda e: (e.last_use, e.n_tokens))
            if tip.base is not None:
                store.compact(tip)
        step += 1


if __name__ == "__main__":
    main()
