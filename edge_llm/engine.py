"""One request at a time: RAM prefix reuse, disk restore, tail prefill, decode, stop, timings.

Bit-exactness rule: every prompt row is computed in the batch a cold prefill of the whole prompt
would put it in, on every CPU, whatever a kernel's per-row result does with its batch:
- prefill chunks are cut at absolute multiples of the chunk size `align` (`Model.prefill`);
- the last prompt token is computed on its own (a one-row step, like a decode step);
- a prefix reused from RAM or disk is cut back to a multiple of `align` (`_aligned`), so the
  tail after it is batched as in the cold run. The matched rows given up for this are recomputed
  and reported (`Timings.align_rows`, `[PREFILL-TIMING] ... aligned=K`); the cost gate decides on
  the aligned prefix. One unaligned reuse is exact as well: the same-length prompt again from RAM
  (m = n - 1 is where the last prefill's chunks ended: `_chunk_end`).
So a request restored from disk (rows read back bitwise) produces bitwise the logits and text of
a cold run and of a server that kept its RAM cache. Rows that decode steps wrote (an answer
resent as history) are reused as they are: exact against the run that wrote them, not against
a cold prefill (docs/store.md, "Restore and recompute").

Long work reports progress and honours cancellation between steps (`edge_llm/progress.py`): a
prefill chunk, a restored layer, a layer of a pending save we wait for, a block of the vision
tower, a decode step; and within a forward after each decoder layer, so a cancel lands within one
layer and the watchdog is fed at any chunk length. A request cancelled during its prefill
(client gone, shutdown) keeps the rows of every complete chunk (never a part of the interrupted
one) and queues them as a snapshot, so a retry after a restart prefills only what was not done.

Images (Qwen3-VL) keep the bit-exactness rule: the engine matches on the prompt's prefix key
(image rows carry ids derived from the image's digest, see `vision.positions`), never reuses part
of an image run or another image's run, feeds the tail its MRoPE positions, and takes the decode
steps' position from the cache (`KVCache.next_pos`: after an image it is not the row count). The
engine never sees pixels: it asks the vision model for the image rows of the tail.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edge_llm.costgate import SEQUENTIAL, CostGate
from edge_llm.drafting import DraftConfig, Drafter, verify
from edge_llm.errors import ContextOverflowError, ImageError, SnapshotError
from edge_llm.kvcache import KVCache, Restore, Restored
from edge_llm.progress import DECODE, NO_WORK, PREFILL, Cancelled, OnProgress, Work
from edge_llm.sampling import (
    OPENAI_DEFAULTS,
    Sampler,
    SamplingParams,
    model_sampling_defaults,
)
from edge_llm.settings import DEFAULTS
from edge_llm.snapshot.entries import Hit
from edge_llm.tokenizer import StopMatcher
from edge_llm.vision.model import VisionModel
from edge_llm.vision.positions import PromptPlan, plan_prompt
from edge_llm.vision.preprocess import PreparedImage

if TYPE_CHECKING:  # annotations only: the engine is handed these, it never builds them
    from edge_llm.models.qwen3 import Model
    from edge_llm.snapshot.store import SnapshotStore
    from edge_llm.tokenizer import Tokenizer

log = logging.getLogger(__name__)
timing_log = logging.getLogger("edge_llm.prefill")
kvdisk_log = logging.getLogger("edge_llm.kvdisk")
DISK_PREFETCH = "disk-prefetch"  # cache_source of rows a start-up prefetch read (edge_llm/server/prefetch.py)


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    save_snapshot: bool = True
    # one per image placeholder run in prompt_tokens, in order (opaque to the engine)
    images: list[PreparedImage] = field(default_factory=list)


@dataclass
class Timings:
    ttft_ms: float = 0.0
    prefill_tokens: int = 0
    prefill_ms: float = 0.0
    decode_tokens: int = 0
    decode_ms: float = 0.0
    cache_source: str = "none"  # none | ram | disk | disk-prefetch
    ram_cached_tokens: int = 0
    disk_cached_tokens: int = 0
    restore_ms: float = 0.0
    restore_bytes: int = 0
    save_wait_ms: float = 0.0  # time spent waiting for a pending snapshot save to release rows
    images: int = 0  # images in the prompt
    image_tokens: int = 0  # prompt rows that are image tokens
    images_encoded: int = 0  # images that ran through the vision encoder (the others were cached)
    vision_ms: float = 0.0  # vision encoder time
    # the cost gate (edge_llm/costgate.py): what it chose for a disk hit and why
    restore_mode: str = ""  # pipelined | sequential: the restore that ran (empty: none)
    gate: str = ""  # restore | split | recompute | unmeasured (restore, no estimates yet)
    gate_rows_loaded: int = 0
    gate_rows_recomputed: int = 0
    gate_predicted_ms: float = 0.0  # predicted time of the chosen way to the prompt's logits
    gate_restore_ms: float = 0.0  # predicted: restore every matched row
    gate_recompute_ms: float = 0.0  # predicted: recompute from the RAM prefix
    gate_actual_ms: float = 0.0  # measured: restore + prefill of this request
    restore_files: int = 0  # files of the snapshot chain that were read
    align_rows: int = 0  # matched rows recomputed so that chunks align with a cold run's (module docstring)
    # speculative decoding (docs/speculative.md)
    decode_forwards: int = 0  # forwards after the prompt's (one per token without drafts)
    draft_forwards: int = 0  # of them, forwards that verified a draft
    drafted_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of them, kept

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

    def __init__(self, model: Model, tokenizer: Tokenizer, cache: KVCache, store: SnapshotStore | None = None,
                 prefill_chunk: int = DEFAULTS.prefill_chunk, model_dir: Path | None = None,
                 vision: VisionModel | None = None, restore_mode: str = DEFAULTS.disk_kv_restore,
                 gate: CostGate | None = None, disk_kv_error: str | None = None,
                 backend_reason: str = "", draft: DraftConfig = DraftConfig(), npu_selftest: dict | None = None):
        self.model = model
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.cache = cache
        self.store = store
        self.disk_kv_error = disk_kv_error  # why disk KV is off although configured (/health: degraded)
        self.backend_reason = backend_reason  # which backend runs and why (/health, /v1/models)
        self.npu_selftest = npu_selftest  # the NPU matmul path's self-test report, if it ran (/health)
        self.align = model.chunk_size(prefill_chunk)  # the chunk, and the alignment unit (module docstring)
        self.vision = vision
        self.draft = draft  # speculative decoding (docs/speculative.md)
        self.restore_mode = restore_mode
        self.gate = gate or CostGate(cache.geometry.kv_bytes_per_token, restore_mode, self.align)
        # k when the last prefill ended its last chunk at row k (then ran row k alone): the rows
        # after its reuse point are batched as in a cold prefill of a (k + 1)-row prompt
        self._chunk_end: int | None = None
        # set by the start-up prefetch (edge_llm/server/prefetch.py): the cache's rows were read from
        # this snapshot, not computed; the next request consumes it (docs/store.md, "Prefetch")
        self.prefetched: Restored | None = None
        self.stop_ids = set(tokenizer.stop_token_ids)
        # what requests get for omitted temperature / top_p / top_k
        self.sampling_defaults = (model_sampling_defaults(model_dir) if model_dir is not None
                                  else OPENAI_DEFAULTS)

    def close(self, timeout: float | None = None) -> None:
        """At shutdown, once the last request ran: finish the pending save and stop the store's
        writer (the caller may flush first, e.g. with progress), then release the backend (NPU
        contexts, the simulator's worker). Nothing is called after it."""
        try:
            if self.store is not None:
                self.store.close(timeout)
        finally:
            self.model.close()

    @property
    def max_seq(self) -> int:
        return self.cache.max_seq

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        """Raise ContextOverflowError unless prompt + max_tokens fits the cache (HTTP 400, docs/api.md)."""
        if n_prompt + max_tokens > self.max_seq:
            raise ContextOverflowError(n_prompt, max_tokens, self.max_seq)

    def plan(self, tokens: list[int], images: list[PreparedImage] = ()) -> PromptPlan:
        """The prompt's prefix key and positions; ImageError if images and placeholders disagree."""
        if self.vision is None:
            if images:
                raise ImageError("this model has no vision encoder: it cannot take images")
            return plan_prompt(tokens, [], None)
        return self.vision.plan(tokens, images)

    # ---- prefix -------------------------------------------------------------------------
    def _aligned(self, plan: PromptPlan, m: int, spans, ram: bool = False) -> int:
        """The largest reuse point <= m that is a multiple of `align` and that `plan.reusable`
        accepts (never inside an image run): a cold prefill starts a chunk there. From RAM, m =
        n - 1 stays when the last prefill's chunks ended there (`_chunk_end`): same batching."""
        if ram and m == plan.n - 1 == self._chunk_end:
            return m
        while (a := plan.reusable(m // self.align * self.align, spans)) != m:
            m = a
        return m

    def _reuse_prefix(self, plan: PromptPlan, t: Timings, work: Work) -> tuple[int, Restore | None]:
        """Make cache rows [0, m) valid for the plan's first m keys from RAM, or start restoring
        them from disk; return m (<= len-1, aligned: module docstring) and the restore to finish
        (None: the rows are in RAM). `plan.reusable` decides for both sources how much of a match
        may be used; the cost gate decides how much of a disk match is worth loading."""
        keys = plan.keys
        prefetched, self.prefetched = self.prefetched, None  # this request reuses or overwrites those rows
        limit = len(keys) - 1  # at least one token is computed: it yields the logits
        raw_ram = plan.reusable(min(self.cache.common_prefix(keys), limit), self.cache.spans)
        m_ram = self._aligned(plan, raw_ram, self.cache.spans, ram=True)
        hit = self.store.lookup(keys) if self.store is not None else None
        if hit is not None:
            raw_disk = plan.reusable(hit.m, hit.entry.spans)
            m_disk = self._aligned(plan, raw_disk, hit.entry.spans)
            hit = Hit(hit.entry, m_disk) if m_disk >= self.store.min_lcp else None
        if hit is not None and hit.m > m_ram:
            d = self.gate.decide(plan.n, m_ram, hit.m, self.cache.kv_bs, self.store.min_lcp)
            k = self._aligned(plan, d.load_rows, hit.entry.spans)
            t.gate, t.gate_predicted_ms = d.action, d.predicted_ms
            t.gate_restore_ms, t.gate_recompute_ms = d.restore_ms, d.recompute_ms
            if k > m_ram:
                # header reads only: None if a file is bad (quarantined); the RAM rows stay
                source = self.store.open(Hit(hit.entry, k), self.cache.max_seq)
                if source is not None:
                    t.align_rows = raw_disk - hit.m
                    t.cache_source, t.disk_cached_tokens = "disk", source.m
                    return source.m, self.cache.restore(source, pipelined=self.restore_mode != SEQUENTIAL, work=work)
            else:
                log.info("cost gate: recomputing %d rows is faster than loading %d (%.0f ms vs %.0f ms predicted)",
                         plan.n - m_ram, hit.m, d.recompute_ms, d.restore_ms)
        self.cache.truncate(m_ram)  # rows >= m_ram are overwritten later, behind the write guard
        t.align_rows = raw_ram - m_ram
        if m_ram > 0:
            t.cache_source, t.ram_cached_tokens = "ram", m_ram
            if prefetched is not None:  # the RAM rows were read from disk at start: say so (docs/logs.md)
                t.cache_source, t.ram_cached_tokens, t.disk_cached_tokens = DISK_PREFETCH, 0, m_ram
                kvdisk_log.info("[KV-DISK] reused %d-token KV prefix read from disk file %s at start (prefetch: "
                                "%d tokens, %d bytes, %.1f ms)", m_ram, prefetched.name, prefetched.n_tokens,
                                prefetched.nbytes, prefetched.ms)
        return m_ram, None

    def _prefill_tail(self, plan: PromptPlan, m: int, t: Timings, work: Work):
        """Chunked prefill of rows [m, n-1), then the last token alone (see module docstring)."""
        n, keys = plan.n, plan.keys
        vis = None
        if self.vision is not None and plan.spans:
            vis, t.vision_ms, t.images_encoded = self.vision.visual_rows(plan, m, n, work)
            self.cache.add_spans([s for s in plan.spans if s.start >= m])
        pos = plan.positions_for(m, n)
        if n - 1 > m:
            self.model.prefill(keys[m:n - 1], self.cache, chunk=self.align, work=work,
                               positions=None if pos is None else pos[:, :-1],
                               visual=None if vis is None else vis.slice(0, n - 1 - m), logits=False)
        logits = self.model.forward(keys[n - 1:], self.cache, work=work,
                                    positions=None if pos is None else pos[:, -1:],
                                    visual=None if vis is None else vis.slice(n - 1 - m, n - m))
        work.report(PREFILL, self.cache.length, self.cache.length)
        return logits

    def prefill_prompt(self, tokens: list[int], t: Timings | None = None, work: Work = NO_WORK,
                       images: list[PreparedImage] = ()) -> tuple[np.ndarray, Timings]:
        """Reuse the longest cached prefix (RAM or disk), prefill the rest; logits of the last token.

        Raises `Cancelled` at the next step or layer if `work` is cancelled (the cache then holds
        the rows of the complete chunks)."""
        if not tokens:
            raise ValueError("prompt is empty")
        t0 = time.perf_counter()
        t = Timings() if t is None else t
        plan = self.plan(tokens, list(images))
        t.images, t.image_tokens = len(plan.spans), plan.image_tokens
        w0, r0 = self.cache.write_wait_s, self.cache.restore_wait_s
        m, restore = self._reuse_prefix(plan, t, work)
        self._chunk_end = None  # set again once this prefill has completed
        t_pf = time.perf_counter()

        def tail():  # the prefill's time starts here (after a sequential restore's reads)
            nonlocal t_pf
            t_pf = time.perf_counter()
            return self._prefill_tail(plan, m, t, work)

        try:
            if restore is None:
                logits = tail()
            else:
                try:  # pipelined: the tail computes behind the reader, layer by layer
                    logits = restore.finish(behind=tail)
                    r = restore.restored
                    t.restore_mode, t.restore_ms, t.restore_bytes, t.restore_files = r.mode, r.ms, r.nbytes, r.files
                    self.gate.observe_read(r.nbytes, r.ms / 1e3)
                except SnapshotError as e:  # the rows were never used: recompute, bitwise as a cold run
                    log.warning("disk restore failed (%s): recomputing from scratch", e)
                    t.cache_source, t.disk_cached_tokens, t.align_rows = "none", 0, 0
                    m = 0
                    logits = tail()
        finally:
            t1 = time.perf_counter()
            t.save_wait_ms += (self.cache.write_wait_s - w0) * 1e3  # restore and prefill waits alike
            t.prefill_tokens, t.prefill_ms = self.cache.length - m, (t1 - t_pf) * 1e3
        if t.gate:
            t.gate_rows_loaded, t.gate_rows_recomputed = t.disk_cached_tokens, t.prefill_tokens
            t.gate_actual_ms = (t1 - t0) * 1e3
        waited = self.cache.restore_wait_s - r0  # pipelined: the tail waited for rows, not computing
        self.gate.observe_prefill(t.prefill_tokens, (t1 - t_pf) - waited - (self.cache.write_wait_s - w0))
        # total = restore/reuse + tail prefill: what a restart costs before the first token
        # aligned: rows of the n that were matched but recomputed to batch as a cold run (docstring)
        timing_log.info("[PREFILL-TIMING] n=%d total=%.1fms aligned=%d", t.prefill_tokens, (t1 - t0) * 1e3,
                        t.align_rows)
        self._chunk_end = plan.n - 1
        return logits, t

    # ---- one request ----------------------------------------------------------------------
    def generate(self, req: GenerationRequest, cancel: threading.Event | None = None,
                 progress: OnProgress | None = None) -> Iterator[GenerationEvent]:
        """Run one request; yields text deltas, the last event has finish_reason/timings/usage.

        `progress(stage, done, total)` is called after every step (see edge_llm/progress.py);
        `cancel` is honoured between steps and layers and ends the request with finish_reason
        "cancelled".
        """
        tokens = list(req.prompt_tokens)
        self.check_fits(len(tokens), req.max_tokens)
        work = Work(cancel, progress)
        t0 = time.perf_counter()
        t = Timings()
        generated: list[int] = []
        try:
            logits, _ = self.prefill_prompt(tokens, t, work, req.images)
        except Cancelled as c:
            self._save_interrupted(req, c)
            yield self._last_event("", "cancelled", t, len(tokens), generated)
            return
        sampler = Sampler(req.sampling)
        detok = self.tokenizer.incremental_decoder()
        stops = StopMatcher(req.stop)
        drafter = (Drafter(self.draft, self.model.backend.forward_cost, self._draft_context(tokens), req.max_tokens)
                   if self.draft.enabled else None)
        finish = "length"
        t_dec = time.perf_counter()
        try:
            queue = [sampler(logits)]  # sampled tokens not yet emitted (a verified run)
            while queue:
                work.check(DECODE, len(generated), req.max_tokens)
                tok = queue.pop(0)
                if not generated:
                    t.ttft_ms = (time.perf_counter() - t0) * 1e3
                generated.append(tok)
                if drafter is not None:
                    drafter.append(tok)
                if tok in self.stop_ids:
                    finish = "stop"
                    break
                delta, stopped = stops.feed(detok.feed(tok))
                if delta:
                    yield GenerationEvent(text=delta, token_id=tok)
                if stopped:
                    finish = "stop"
                    break
                if len(generated) < req.max_tokens and not queue:
                    queue = self._step(tok, sampler, drafter, req.max_tokens - len(generated), t, work)
                    work.report(DECODE, len(generated), req.max_tokens)
        except Cancelled:
            finish = "cancelled"
        # rows of verified tokens after a stop were computed but are not part of the answer: the
        # cache ends, as after plain steps, at the last emitted token's predecessor
        if generated and self.cache.length > len(tokens) + len(generated) - 1:
            self.cache.truncate(len(tokens) + len(generated) - 1)
        t.decode_tokens = len(generated)
        t.decode_ms = (time.perf_counter() - t_dec) * 1e3
        tail = "" if finish == "cancelled" or stops.stopped else stops.feed(detok.flush())[0] + stops.flush()
        if req.save_snapshot and self.store is not None:
            self.store.save_async(self.cache)  # a cancelled decode keeps its prompt rows too
        self.gate.persist()  # after the answer, only when the estimates moved
        yield self._last_event(tail, finish, t, len(tokens), generated)

    def _draft_context(self, tokens: list[int]) -> np.ndarray:
        """The prompt as the drafter sees it: image rows (no token ids) are -1."""
        ctx = np.asarray(tokens, dtype=np.int64).copy()
        for s in self.cache.spans:
            ctx[s.start:s.end] = -1
        return ctx

    def _step(self, tok: int, sampler: Sampler, drafter: Drafter | None, room: int, t: Timings,
              work: Work) -> list[int]:
        """Forward `tok` (+ a draft: speculative decoding, docs/speculative.md); the tokens sampled
        from it: one, or the verified draft prefix and the model's token after it.

        Verification (`drafting.verify`) keeps a draft token exactly when the request's sampler
        chooses it, so the output is the model's (seeded: the same tokens as plain steps, up to
        batched-vs-one-row rounding). The rows of rejected draft tokens are dropped
        (`KVCache.truncate`): no save or later request sees them."""
        step = self.model.backend.row_step  # a verify forward stays within one call of it
        limit = room - 1 if step is None else min(room - 1, step.max_rows - 1)
        draft = drafter.propose(limit) if drafter is not None else ()
        ids = [tok, *map(int, draft)]
        start = self.cache.length
        pos = None
        if self.cache.spans:  # after an image the next MRoPE position is not the row count
            pos = np.repeat((self.cache.next_pos + np.arange(len(ids)))[None], 3, axis=0)
        logits = self.model.forward(ids, self.cache, all_logits=len(ids) > 1, positions=pos, work=work, decode=True)
        t.decode_forwards += 1
        if len(ids) == 1:
            return [sampler(logits)]
        out = verify(logits, ids[1:], sampler)
        accepted = len(out) - 1
        self.cache.truncate(start + 1 + accepted)
        drafter.verified(len(draft), accepted)
        t.draft_forwards += 1
        t.drafted_tokens += len(draft)
        t.accepted_tokens += accepted
        return out

    def _save_interrupted(self, req: GenerationRequest, c: Cancelled) -> None:
        """A cancelled prefill/restore: queue the rows of its complete chunks for a retry."""
        n = self.cache.length
        log.info("request cancelled during %s at %d/%d: %d prompt row(s) are complete", c.stage, c.done,
                 c.total, n)
        if req.save_snapshot and self.store is not None and n > 0:
            self.store.save_async(self.cache)  # the store skips fewer than min_lcp rows

    def _last_event(self, text: str, finish: str, t: Timings, n_prompt: int,
                    generated: list[int]) -> GenerationEvent:
        cached = t.ram_cached_tokens + t.disk_cached_tokens
        return GenerationEvent(text=text, finish_reason=finish, timings=t,
                               usage=Usage(n_prompt, len(generated), cached), completion_ids=generated)
