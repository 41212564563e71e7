"""One request at a time: RAM prefix reuse, disk restore, tail prefill, decode, stop, timings.

Bit-exactness rule: the last prompt token is always computed on its own (a one-row step, like a
decode step), after the rest of the tail was prefilled in chunks. So the logits that pick the
first generated token depend only on the KV rows before it, never on how many rows were
prefilled together — a request restored from disk (rows [0, n-1) read back bitwise) produces
bitwise the same text as the cold run that wrote the snapshot, and as a server that kept its
RAM cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from edge_llm.errors import ContextOverflowError, SnapshotError
from edge_llm.kvcache import KVCache
from edge_llm.sampling import Sampler, SamplingParams
from edge_llm.settings import DEFAULTS
from edge_llm.tokenizer import StopMatcher

log = logging.getLogger(__name__)
timing_log = logging.getLogger("edge_llm.prefill")


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    save_snapshot: bool = True


@dataclass
class Timings:
    ttft_ms: float = 0.0
    prefill_tokens: int = 0
    prefill_ms: float = 0.0
    decode_tokens: int = 0
    decode_ms: float = 0.0
    cache_source: str = "none"  # none | ram | disk
    ram_cached_tokens: int = 0
    disk_cached_tokens: int = 0
    restore_ms: float = 0.0
    restore_bytes: int = 0
    save_wait_ms: float = 0.0  # time spent waiting for a pending snapshot save to release rows

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class GenerationEvent:
    text: str = ""
    token_id: int | None = None
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    timings: Timings | None = None
    usage: Usage | None = None
    completion_ids: list[int] | None = None  # on the last event: every sampled id, stop id included


class Engine:
    """Owns the model, tokenizer, the one KV cache and (optionally) the snapshot store."""

    def __init__(self, model, tokenizer, cache: KVCache, store=None,
                 prefill_chunk: int = DEFAULTS.prefill_chunk, model_dir=None):
        self.model = model
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.cache = cache
        self.store = store
        self.prefill_chunk = prefill_chunk
        self.stop_ids = set(tokenizer.stop_token_ids)
        if store is not None:  # the model waits per layer for rows a pending save still streams
            cache.write_guard = store.wait_write

    @property
    def max_seq(self) -> int:
        return self.cache.max_seq

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        """Raise ContextOverflowError unless prompt + max_tokens fits the cache (SPEC: 400)."""
        if n_prompt + max_tokens > self.max_seq:
            raise ContextOverflowError(n_prompt, max_tokens, self.max_seq)

    # ---- prefix -------------------------------------------------------------------------
    def _reuse_prefix(self, tokens: list[int], t: Timings) -> int:
        """Make cache rows [0, m) valid for tokens[:m] from RAM or disk; return m (<= len-1)."""
        limit = len(tokens) - 1  # at least one token is computed: it yields the logits
        m_ram = min(self.cache.common_prefix(tokens), limit)
        hit = self.store.lookup(tokens) if self.store is not None else None
        if hit is not None and hit.m > m_ram:
            try:  # the store first waits for a pending save: a restore rewrites rows from 0
                res = self.store.restore(hit, self.cache)
            except (SnapshotError, OSError) as e:
                log.warning("disk restore failed (%s): recomputing from scratch", e)
                self.cache.reset()
                return 0
            t.cache_source, t.disk_cached_tokens = "disk", res.n_tokens
            t.restore_ms, t.restore_bytes = res.ms, res.nbytes
            t.save_wait_ms += res.wait_ms
            return res.n_tokens
        self.cache.truncate(m_ram)  # rows >= m_ram are overwritten later, behind the write guard
        if m_ram > 0:
            t.cache_source, t.ram_cached_tokens = "ram", m_ram
        return m_ram

    def _prefill_tail(self, tail: list[int]):
        """Chunked prefill of tail[:-1], then the last token alone (see module docstring)."""
        body, last = tail[:-1], tail[-1:]
        if body:
            self.model.prefill(body, self.cache, chunk=self.prefill_chunk)
        return self.model.forward(last, self.cache)

    def prefill_prompt(self, tokens: list[int]) -> tuple[np.ndarray, Timings]:
        """Reuse the longest cached prefix (RAM or disk), prefill the rest; logits of the last token."""
        if not tokens:
            raise ValueError("prompt is empty")
        t0 = time.perf_counter()
        t = Timings()
        w0 = self.cache.write_wait_s
        m = self._reuse_prefix(tokens, t)
        t_pf = time.perf_counter()
        logits = self._prefill_tail(tokens[m:])
        t1 = time.perf_counter()
        t.save_wait_ms += (self.cache.write_wait_s - w0) * 1e3
        t.prefill_tokens, t.prefill_ms = len(tokens) - m, (t1 - t_pf) * 1e3
        # total = restore/reuse + tail prefill: what a restart costs before the first token
        timing_log.info("[PREFILL-TIMING] n=%d total=%.1fms", t.prefill_tokens, (t1 - t0) * 1e3)
        return logits, t

    # ---- one request ----------------------------------------------------------------------
    def generate(self, req: GenerationRequest, cancel: threading.Event | None = None
                 ) -> Iterator[GenerationEvent]:
        """Run one request; yields text deltas, the last event has finish_reason/timings/usage."""
        tokens = list(req.prompt_tokens)
        self.check_fits(len(tokens), req.max_tokens)
        t0 = time.perf_counter()
        logits, t = self.prefill_prompt(tokens)
        sampler = Sampler(req.sampling)
        detok = self.tokenizer.incremental_decoder()
        stops = StopMatcher(req.stop)
        generated: list[int] = []
        finish = "length"
        t_dec = time.perf_counter()
        while len(generated) < req.max_tokens:
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            tok = sampler(logits)
            if not generated:
                t.ttft_ms = (time.perf_counter() - t0) * 1e3
            generated.append(tok)
            if tok in self.stop_ids:
                finish = "stop"
                break
            delta, stopped = stops.feed(detok.feed(tok))
            if delta:
                yield GenerationEvent(text=delta, token_id=tok)
            if stopped:
                finish = "stop"
                break
            if len(generated) < req.max_tokens:
                logits = self.model.forward([tok], self.cache)
        t.decode_tokens = len(generated)
        t.decode_ms = (time.perf_counter() - t_dec) * 1e3
        tail = "" if finish == "cancelled" or stops.stopped else stops.feed(detok.flush())[0] + stops.flush()
        if finish != "cancelled" and req.save_snapshot and self.store is not None:
            self.store.save_async(self.cache)
        cached = t.ram_cached_tokens + t.disk_cached_tokens
        yield GenerationEvent(text=tail, finish_reason=finish, timings=t,
                              usage=Usage(len(tokens), len(generated), cached), completion_ids=generated)
