"""What the page shows besides the chat: the server's state (`GET /v1/edge/state`) and the
serving namespace's snapshots (`GET /v1/edge/store`), both behind the API key (docs/api.md, "The
page and its endpoints").

Nothing here is a second implementation: the snapshots are the store's index (`Catalog.present`:
the indexed files still on disk, sizes as stat reads them), their expected size is the store's
formula (`snapshot_size` of the header's fields), the rates are the cost gate's, the memory figures
are start-up's admission (`estimate_memory`, `available_memory`). No string holds a path: files are
named by their basename, the namespace by its directory's name.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Literal

from pydantic import BaseModel

from edge_llm import __version__
from edge_llm.engine import Engine
from edge_llm.errors import SnapshotChainError, TokenizerError
from edge_llm.footprint import MemoryEstimate, ModelSizes, available_memory, estimate_memory
from edge_llm.safetext import printable
from edge_llm.server.events import EventHub
from edge_llm.server.state import AppState
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot.entries import Entry
from edge_llm.snapshot.store import SnapshotStore

FIRST_WORDS_CHARS = 80  # the longest `first_words`
FIRST_WORDS_TOKENS = 512  # token ids decoded for it: a system prompt and the first user words
_SENTINEL = "\ue000first words\ue000"  # a private-use marker: where the user's text starts
_PATH = re.compile(r"(?<![\w.~])~?/(?:[^\s/,;()'\"]+/)*([^\s/,;()'\"]*)")  # an absolute path in a message


# ---- the documents (response models: /openapi.json, and FastAPI checks every answer) ---------------
class Memory(BaseModel):
    estimate_bytes: int  # start-up's estimate for this configuration (docs/board.md, "Memory")
    parts: dict[str, int]  # the estimate's parts (weights, KV, runtime, ...)
    available_bytes: int  # what the process may use now: its RSS + MemAvailable or the cgroup's room
    available_source: str  # "MemAvailable" or "cgroup memory.max"
    rss_bytes: int


class EventsState(BaseModel):
    clients: int  # open /v1/edge/events streams
    dropped: int  # events dropped for slow clients since start


class EdgeState(BaseModel):
    status: Literal["loading", "ok", "failed", "stopping"]
    version: str
    model: str
    backend: str
    backend_reason: str | None
    npu_selftest: str | None  # the NPU self-test's one-line summary; None when it did not run
    vision: bool  # the model has a vision tower: chat messages may carry images
    namespace: str | None
    max_seq: int
    uptime_s: float
    degraded: list[str]
    busy: bool
    queue_depth: int
    queue_size: int
    memory: Memory | None  # None until the model is loaded
    settings: dict[str, bool | int | str | None]
    events: EventsState


class Limits(BaseModel):
    max_files: int
    max_bytes: int | None
    max_tokens: int
    max_chain: int


class CostGateRates(BaseModel):
    mode: str  # disk_kv_restore
    read_bytes_per_s: float | None  # the kv disk's read bandwidth measured by restores (None: not yet)
    compute_tokens_per_s: float | None  # the backend's prefill rate measured by requests
    decisions: dict[str, int]  # restore / split / recompute / unmeasured, since start


class Snapshot(BaseModel):
    file: str  # basename
    tokens: int
    bytes: int  # the file's size on disk now
    formula_bytes: int  # the store's size formula for its header (docs/store.md)
    chain_base: str | None  # a delta's base file (basename), None for a full file
    chain_files: int  # files a restore of it reads (1 for a full file)
    last_used: float  # unix seconds (the file's mtime)
    first_words: str  # the conversation's first user words via the tokenizer, printable, <= 80 chars


class EdgeStore(BaseModel):
    namespace: str | None
    enabled: bool
    free_bytes: int | None
    limits: Limits
    cost_gate: CostGateRates | None
    snapshots: list[Snapshot]


# ---- building them -----------------------------------------------------------------------------
class StoreView:
    """The two documents for one app; caches what does not change (each file's first words, keyed
    by its name, which is the hash of its token ids; the memory estimate)."""

    def __init__(self, state: AppState, events: EventHub):
        self.state, self.events = state, events
        self._words: dict[str, str] = {}
        self._user_prefix: str | None = None
        self._estimate: MemoryEstimate | None = None
        self._lock = threading.Lock()

    def state_doc(self) -> EdgeState:
        st, s = self.state, self.state.settings
        h = st.health()
        return EdgeState(
            status=h["status"], version=__version__, model=st.model_id, backend=st.backend,
            backend_reason=basenames(st.backend_reason) if st.backend_reason else None,
            npu_selftest=(st.engine.npu_selftest or {}).get("summary") if st.engine is not None else None,
            vision=st.engine is not None and st.engine.vision is not None, namespace=st.namespace,
            max_seq=s.max_seq, uptime_s=h["uptime_s"], degraded=[basenames(d) for d in h["degraded"]], busy=h["busy"], queue_depth=h["queue_depth"], queue_size=s.queue_size,
            memory=self._memory(st.engine) if st.engine is not None else None,
            settings={"disk_kv": s.disk_kv is not None, "disk_kv_restore": s.disk_kv_restore,
                      "disk_kv_prefetch": s.disk_kv_prefetch, "disk_kv_min_lcp": s.disk_kv_min_lcp,
                      "prefill_chunk": s.prefill_chunk, "kv_bs": s.kv_bs, "draft": s.draft,
                      "draft_max": s.draft_max, "default_max_tokens": s.default_max_tokens,
                      "api_key": st.keys is not None, "node_name": s.node_name},
            events=EventsState(clients=self.events.clients, dropped=self.events.dropped))

    def _memory(self, engine: Engine) -> Memory:
        with self._lock:
            if self._estimate is None and engine.model_dir is not None:  # as start-up computed it
                self._estimate = estimate_memory(self.state.settings, self.state.backend,
                                                 ModelSizes.of_dir(engine.model_dir), engine.model_dir)
            est = self._estimate
        avail = available_memory()
        by_cgroup = avail.source != "MemAvailable" and avail.cgroup_room is not None
        room = avail.cgroup_room if by_cgroup else avail.mem_available
        return Memory(estimate_bytes=est.total if est else 0, parts=dict(est.parts) if est else {},
                      available_bytes=avail.bytes, rss_bytes=avail.bytes - room,
                      available_source="cgroup memory.max" if by_cgroup else "MemAvailable")

    def store_doc(self) -> EdgeStore:
        s, engine = self.state.settings, self.state.engine
        store = engine.store if engine is not None else None
        limits = Limits(max_files=s.disk_kv_max_files, max_bytes=s.disk_kv_max_bytes,
                        max_tokens=s.disk_kv_max_tokens, max_chain=s.disk_kv_max_chain)
        if store is None:
            return EdgeStore(namespace=None, enabled=False, free_bytes=None, limits=limits, cost_gate=None,
                             snapshots=[])
        gate = engine.gate
        rates = CostGateRates(mode=gate.mode, read_bytes_per_s=gate.read_bps, compute_tokens_per_s=gate.prefill_tps,
                              decisions=dict(gate.counts))
        there = sorted(store.catalog.present(), key=lambda p: p[0].last_use, reverse=True)
        snaps = [self._snapshot(store, engine, e, size) for e, size in there]
        with self._lock:  # forget the words of files that left the index
            for name in set(self._words) - {e.name for e, _ in there}:
                del self._words[name]
        try:
            st = os.statvfs(store.ns)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = None
        return EdgeStore(namespace=store.ns.name, enabled=True, free_bytes=free, limits=limits, cost_gate=rates,
                         snapshots=snaps)

    def _snapshot(self, store: SnapshotStore, engine: Engine, e: Entry, size: int) -> Snapshot:
        g = store.geometry
        formula = fmt.snapshot_size(g.n_layers, e.n_tokens, g.kv_dim, store.saver.kv_bs,
                                    len(fmt.encode_extension(e.spans, e.base)), e.row0)
        try:
            chain = len(store.chain(e))
        except SnapshotChainError:  # its base vanished just now: the next lookup drops it
            chain = 0
        return Snapshot(file=e.name, tokens=e.n_tokens, bytes=size, formula_bytes=formula,
                        chain_base=e.base.name if e.base is not None else None, chain_files=chain,
                        last_used=e.last_use, first_words=self.first_words(engine, e))

    def first_words(self, engine: Engine, e: Entry) -> str:
        """The conversation's first words: its first ids decoded, the chat template's own text before
        the user's first message left out when the conversation starts with it; whitespace runs as
        one space, escaped (`printable`), cut at a word to FIRST_WORDS_CHARS."""
        with self._lock:
            cached = self._words.get(e.name)
        if cached is not None:
            return cached
        tok = engine.tokenizer
        text = tok.decode([int(t) for t in e.tokens[:FIRST_WORDS_TOKENS]], skip_special_tokens=True)
        prefix = self._template_prefix(engine)
        if prefix and text.startswith(prefix):
            text = text[len(prefix):]
        words = _shorten(printable(re.sub(r"\s+", " ", text).strip()), FIRST_WORDS_CHARS)
        with self._lock:
            self._words[e.name] = words
        return words

    def _template_prefix(self, engine: Engine) -> str:
        """The chat template's text (special tokens left out) before a first user message: its
        default system prompt and role words ("system You are ... user")."""
        if self._user_prefix is None:
            tok = engine.tokenizer
            try:
                ids = tok.apply_chat_template_ids([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
                rendered = tok.decode(ids, skip_special_tokens=True)
            except TokenizerError:  # a template that refuses a lone user turn: show the decoded start as it is
                rendered = ""
            self._user_prefix = rendered.split(_SENTINEL)[0] if _SENTINEL in rendered else ""
        return self._user_prefix


def basenames(text: str) -> str:
    """`text` with each absolute path cut to its last part ("NPU at /dev/rknpu" -> "NPU at rknpu"): the
    page's documents name no place on the board's disk."""
    return _PATH.sub(lambda m: m.group(1), text)


def _shorten(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut) + "\u2026"

