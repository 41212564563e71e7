"""`disk_kv_prefetch = "latest"`: restore the most recently used conversation while idle after start-up.

Runs once, on the worker thread, before it takes its first job (so the cache keeps its one
writer): the indexed snapshot with the newest last-use time (docs/store.md, "Prefetch") is opened
through the store and restored into the KV cache like a request's restore (the same reader, CRC
checks and failure channel: a bad file is quarantined, the cache reset, the server serves on).
The rows are then the cache's current rows, as a finished request would leave them, and the next
request reuses them through the engine's RAM-prefix path; the engine reports that request's
`cache_source` as `disk-prefetch` and logs the file the rows were read from (docs/logs.md).

A request that arrives meanwhile is looked at between two restored layers: if it would reuse
this snapshot's rows (its longest disk match is this chain, at least `disk_kv_min_lcp` tokens) it
joins: the read goes on and the request then starts from the RAM rows, having waited only for the
rest of the read its own restore would have done. Otherwise, or at shutdown, the prefetch is
preempted through the restore's cancellation: the cache is reset (no row is half valid) and the
request runs as on a cold cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from edge_llm.engine import Engine, GenerationRequest
from edge_llm.errors import ImageError, SnapshotError
from edge_llm.kvcache import lcp
from edge_llm.progress import Cancelled, OnProgress, Work
from edge_llm.snapshot.entries import Entry, Hit
from edge_llm.snapshot.store import SnapshotStore

log = logging.getLogger("edge_llm.kvdisk")

PREFETCH = "prefetch"  # the progress stage the worker reports (STATUS=, the log)

# the requests waiting for the worker, next first; None once the server is shutting down
Waiting = Callable[[], "list[GenerationRequest] | None"]


def latest(store: SnapshotStore) -> Entry | None:
    """The snapshot a prefetch restores: the newest last-use time (a save wrote it or a restore read
    it; kept in the file's mtime across restarts), the longer one on a tie."""
    entries = store.entries()
    return max(entries, key=lambda e: (e.last_use, e.n_tokens)) if entries else None


class Prefetch:
    """One start-up prefetch for `engine` and its `store`; `on_outcome` counts each outcome (started,
    loaded, joined, preempted, failed: the metrics' PREFETCH_OUTCOMES)."""

    def __init__(self, engine: Engine, store: SnapshotStore,
                 on_outcome: Callable[[str], None] = lambda _o: None):
        self.engine, self.store, self.on_outcome = engine, store, on_outcome
        self.state = "pending"  # pending | running | loaded | joined | preempted | failed | none

    def joins(self, req: GenerationRequest, tokens: list[int]) -> bool:
        """Would `req` reuse the prefetched rows? Its longest disk match must be this chain."""
        try:
            keys = self.engine.plan(list(req.prompt_tokens), list(req.images)).keys
        except (ImageError, ValueError):  # the request fails on its own when it runs
            return False
        m = min(lcp(tokens, keys), len(keys) - 1)
        if m < self.store.min_lcp:
            return False
        hit = self.store.lookup(keys)
        return hit is None or hit.m <= m

    def run(self, waiting: Waiting, on_step: OnProgress) -> None:
        """Restore the latest snapshot into the cache unless a request preempts it (module docstring)."""
        entry = latest(self.store)
        if entry is None:
            self.state = "none"
            log.info("[KV-DISK] prefetch: no snapshot to prefetch")
            return
        cache = self.engine.cache
        t0 = time.monotonic()
        source = self.store.open(Hit(entry, min(entry.n_tokens, cache.max_seq)), cache.max_seq)
        if source is None:  # the store quarantined and logged the bad file; nothing was touched
            self._end("failed")
            return
        self.state = "running"
        self.on_outcome("started")
        tokens = list(source.tokens)
        log.info("[KV-DISK] prefetch: restoring %d-token KV prefix from disk file %s while idle", len(tokens),
                 source.name)
        cancel = threading.Event()
        decided: dict[int, bool] = {}
        why: list[str] = []
        joined: list[bool] = []

        def step(stage: str, done: int, total: int) -> None:
            on_step(PREFETCH, done, total)
            if done >= total:  # every row is read: a request only has to truncate
                return
            reqs = waiting()
            if reqs is None:
                why.append("shutdown")
            elif reqs:
                req = reqs[0]
                if id(req) not in decided:
                    decided[id(req)] = self.joins(req, tokens)
                    if decided[id(req)]:
                        log.info("[KV-DISK] prefetch: a request for this conversation joins the read at "
                                 "layer %d/%d", done, total)
                        joined.append(True)
                if decided[id(req)]:
                    return
                why.append("a request for another conversation arrived")
            else:
                return
            cancel.set()  # Work.report raises Cancelled right after this callback

        restore = cache.restore(source, pipelined=False, work=Work(cancel, step))
        try:
            restore.finish()
        except Cancelled as c:  # the cache was reset by the restore
            log.info("[KV-DISK] prefetch of %s preempted at layer %d/%d: %s", source.name, c.done, c.total,
                     why[-1] if why else "cancelled")
            self._end("preempted")
            return
        except SnapshotError as e:  # quarantined by the store, the cache reset: serve without it
            log.warning("[KV-DISK] prefetch of %s failed: %s; serving without it", source.name, e)
            self._end("failed")
            return
        r = restore.restored
        self.engine.gate.observe_read(r.nbytes, r.ms / 1e3)
        self.engine.prefetched = r
        ms = (time.monotonic() - t0) * 1e3
        # counted and stated before the line: whoever reads "is in RAM" (an operator, a test) and
        # then asks /health or /metrics finds the outcome there already
        self.on_outcome("loaded")
        if joined:
            self.on_outcome("joined")
        self.state = "joined" if joined else "loaded"
        log.info("[KV-DISK] prefetch: %d-token KV prefix of %s is in RAM (%.0f ms)", r.n_tokens, r.name, ms)

    def _end(self, outcome: str) -> None:
        """Counted first, then the state: a reader that sees the state on /health finds the outcome
        counted on /metrics too."""
        self.on_outcome(outcome)
        self.state = outcome

