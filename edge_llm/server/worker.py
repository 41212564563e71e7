"""The single inference worker thread and its bounded FIFO queue.

The event loop only enqueues jobs and awaits their events; every model computation and snapshot
I/O happens on this thread. Events cross back to the loop with `call_soon_threadsafe`, so the
loop never blocks. A job's `cancel` event (client gone, shutdown) stops it at the next step or
layer (a decoder layer of a prefill chunk, a restored layer, a vision block, a decode step); a
job cancelled while still queued is skipped without computing.

Watchdog: while idle the worker pings on every turn of its loop; while a job runs it pings only
when the engine reports progress (every decoder layer included, so a ping never waits for a
whole prefill chunk), so a request that truly hangs stops the pings and systemd restarts the
service. Steps also become the `STATUS=` line ("prefill 3072/8192"); a layer only pings.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from edge_llm.engine import Engine, GenerationEvent, GenerationRequest
from edge_llm.progress import DECODE, LAYER
from edge_llm.sdnotify import Notifier
from edge_llm.server.prefetch import Prefetch
from edge_llm.settings import DEFAULTS

log = logging.getLogger(__name__)

_DONE = object()
_ids = itertools.count(1)
STATUS_EVERY = 1.0  # seconds between STATUS= lines of decode steps
PROGRESS_LOG_EVERY = 5.0  # seconds between INFO progress lines of a long job (prefill, restore, decode)
_STAGES = {"prefill": "prefill {done}/{total}", "restore": "restoring layer {done}/{total}",
           "save-wait": "waiting for the previous snapshot save (layer {done}/{total} written)",
           "vision": "vision encoder block {done}/{total}", "decode": "decode {done}/{total}",
           "prefetch": "prefetching the latest conversation, layer {done}/{total}"}


def status_text(stage: str, done: int, total: int) -> str:
    return _STAGES.get(stage, stage + " {done}/{total}").format(done=done, total=total)


class QueueFull(Exception):
    """The FIFO already holds `queue_size` waiting jobs."""


class ShuttingDown(Exception):
    """The server stopped accepting work."""


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    label: str = ""
    id: int = field(default_factory=lambda: next(_ids))
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str | None = None
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    enqueued: float = field(default_factory=time.monotonic)
    done: bool = False
    at: str = "queued"  # the last step the engine reported ("prefill 1152/6000"), for the log

    def cancel_with(self, reason: str) -> None:
        """Ask the worker to stop this job at its next step or layer (or skip it if still queued).

        The log line names the last step reported *after* the event was set; the engine stops
        within the step in flight then (at its next layer) or right after it: "cancel requested
        at prefill 1152/6000" is followed by "cancelled during prefill at 1152/6000" or at
        1280/6000 (the rows of complete chunks)."""
        if not self.done and not self.cancel.is_set():
            self.cancel_reason = reason
            self.cancel.set()
            log.info("job %d: cancel requested (%s) at %s", self.id, reason, self.at)

    async def events(self) -> AsyncIterator[GenerationEvent]:
        """Events as the worker produces them; re-raises the worker's exception, if any."""
        while True:
            item = await self.out.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Worker:
    """One thread runs `engine.generate` for one job at a time, in FIFO order."""

    def __init__(self, engine: Engine, queue_size: int = DEFAULTS.queue_size, notifier: Notifier | None = None,
                 on_finish: Callable[[Job, GenerationEvent], None] | None = None,
                 prefetch: Prefetch | None = None):
        self.engine = engine
        self.prefetch = prefetch  # run once on this thread before the first job (edge_llm/server/prefetch.py)
        self.queue_size = queue_size
        self.notifier = notifier
        self.on_finish = on_finish  # callback(job, last_event) for metrics; runs on this thread
        # Queue(maxsize) would count a sentinel too; the explicit bound below is what clients see
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._accepting = True
        self._stopped = False  # stop() came first: start() must not run the thread (see start)
        self._last_status = 0.0
        self._last_log = 0.0  # when the running job's last progress line was logged
        self.current: Job | None = None
        self._thread = threading.Thread(target=self._run, name="edge-llm-worker", daemon=True)

    # ---- loop side ----------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return self._q.qsize()

    @property
    def busy(self) -> bool:
        return self.current is not None

    def start(self) -> None:
        """Run the thread, unless `stop` already ran: the server publishes "ok" just before this
        call, and a stop (SIGTERM, a test's close) can land between the two."""
        with self._lock:
            if not self._stopped:
                self._thread.start()

    def submit(self, job: Job) -> Job:
        """Enqueue, or raise QueueFull / ShuttingDown (never blocks)."""
        with self._lock:
            if not self._accepting:
                raise ShuttingDown()
            if self._q.qsize() >= self.queue_size:
                raise QueueFull()
            self._q.put_nowait(job)
        log.debug("job %d queued (%s, depth %d)", job.id, job.label, self._q.qsize())
        return job

    def begin_shutdown(self) -> int:
        """Stop accepting; fail the queued (not yet started) jobs with ShuttingDown."""
        with self._lock:
            self._accepting = False
            dropped = []
            while True:
                try:
                    job = self._q.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    dropped.append(job)
        for job in dropped:
            job.done = True
            self._deliver(job, ShuttingDown())
            self._deliver(job, _DONE)
        if dropped:
            log.info("shutdown: refused %d queued request(s)", len(dropped))
        return len(dropped)

    def cancel_running(self, reason: str) -> None:
        """Cancel the job being computed, if any (it stops at its next step)."""
        job = self.current
        if job is not None and not job.done:
            log.warning("shutdown: cancelling job %d (%s)", job.id, reason)
            job.cancel_with(reason)

    def stop(self, grace: float) -> bool:
        """Let the running job finish for up to `grace` seconds, then cancel it; join the thread.

        A cancelled prefill keeps its complete chunks and queues them as a snapshot, which the
        caller flushes (the stop budget in docs/board.md)."""
        self.begin_shutdown()
        with self._lock:
            self._stopped = True
            if self._thread.ident is None:  # never started: nothing ran, nothing to join
                return True
        self._q.put(None)
        self._thread.join(grace)
        if self._thread.is_alive():
            self.cancel_running("shutdown grace period over")
            # the engine checks `cancel` between steps and layers: one decoder layer of a
            # prefill chunk (or a restored layer, a vision block) is the longest wait
            self._thread.join()
        return True

    # ---- worker thread ----------------------------------------------------------------------
    def _deliver(self, job: Job, item: Any) -> None:
        try:
            job.loop.call_soon_threadsafe(job.out.put_nowait, item)
        except RuntimeError:  # the loop is gone (process exiting): nobody is listening
            pass

    def _ping(self) -> None:
        if self.notifier is not None:
            self.notifier.watchdog()

    def _progress(self, stage: str, done: int, total: int) -> None:
        """Engine progress (worker thread): ping the watchdog, say what is happening."""
        if stage == LAYER:  # a part of the step in flight, up to 30 a decode step: the ping only
            if self.notifier is not None:
                self.notifier.watchdog()
            return
        job = self.current
        now = time.monotonic()
        if job is not None:
            job.at = status_text(stage, done, total)
            if now - self._last_log >= PROGRESS_LOG_EVERY and done < total:  # the log shows long work too
                self._last_log = now
                log.info("job %d: %s", job.id, job.at)
        if self.notifier is None:
            return
        self.notifier.watchdog()
        # prefill chunks, restored layers and save waits are slow steps: each gets its line;
        # decode steps can be hundreds a second, so those lines are thinned out
        if stage != DECODE or now - self._last_status >= STATUS_EVERY or done == total:
            self._last_status = now
            self.notifier.status(status_text(stage, done, total))

    def _run(self) -> None:
        wd = self.notifier.watchdog_interval if self.notifier is not None else None
        # wake at least every half watchdog interval even when idle
        idle_wait = min(wd, 1.0) if wd else 1.0
        if self.prefetch is not None:
            self._prefetch(self.prefetch)
        while True:
            self._ping()
            try:
                job = self._q.get(timeout=idle_wait)
            except queue.Empty:
                continue
            if job is None:
                return
            self._execute(job)

    def _waiting(self) -> list[GenerationRequest] | None:
        """The requests of the queued, not cancelled jobs, next first; None once shutting down."""
        with self._q.mutex:
            jobs = list(self._q.queue)
        if not self._accepting or None in jobs:
            return None
        return [j.request for j in jobs if j is not None and not j.cancel.is_set()]

    def _prefetch(self, prefetch: Prefetch) -> None:
        # a request queued already (it came with the ready line) is looked at after the first
        # restored layer, like one that arrives later: it joins the read or preempts it
        self._ping()
        try:
            prefetch.run(self._waiting, self._progress)
        except Exception:  # never stops the worker: requests are served as without a prefetch
            prefetch.state = "failed"
            log.exception("[KV-DISK] prefetch failed")
            self.engine.cache.reset()
        if self.notifier is not None:
            self.notifier.status(f"idle (prefetch {prefetch.state})")

    def _execute(self, job: Job) -> None:
        if job.cancel.is_set():
            log.info("job %d skipped: cancelled while queued (%s)", job.id, job.cancel_reason)
            job.done = True
            self._deliver(job, _DONE)
            return
        self.current = job
        self._last_log = time.monotonic()
        wait_ms = (self._last_log - job.enqueued) * 1e3
        log.info("job %d started (%s): prompt %d token(s), max_tokens %d", job.id, job.label,
                 len(job.request.prompt_tokens), job.request.max_tokens)
        last: GenerationEvent | None = None
        n = 0
        try:
            for ev in self.engine.generate(job.request, cancel=job.cancel, progress=self._progress):
                last = ev
                n += 1
                self._deliver(job, ev)
        except Exception as e:  # reported to the client; the worker keeps serving
            log.exception("job %d failed: %s", job.id, e)
            self._deliver(job, e)
        finally:
            job.done = True
            self.current = None
            try:  # the job's line and metrics first: a client that reads its answer and then the log
                self._finish(job, last, wait_ms)  # or /metrics finds them there
            finally:
                self._deliver(job, _DONE)

    def _finish(self, job: Job, last: GenerationEvent | None, wait_ms: float) -> None:
        if last is not None and last.finish_reason is not None:
            t, u = last.timings, last.usage
            if last.finish_reason == "cancelled":
                log.info("job %d cancelled after %d token(s): %s", job.id, u.completion_tokens,
                         job.cancel_reason or "cancelled")
            else:
                log.info("job %d done (%s): prompt %d (cached %d, %s), completion %d, queue %.0fms, "
                         "ttft %.0fms, finish %s", job.id, job.label, u.prompt_tokens, u.cached_tokens,
                         t.cache_source, u.completion_tokens, wait_ms, t.ttft_ms, last.finish_reason)
            if self.on_finish is not None:
                try:
                    self.on_finish(job, last)
                except Exception:
                    log.exception("metrics callback failed")
