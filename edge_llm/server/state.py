"""Server lifecycle state: background model load, readiness, health, and the shutdown sequence.

The HTTP socket is bound before the model is loaded (so systemd and clients can see "loading"
on /health); the load runs on its own thread and starts the worker when done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_llm import __version__
from edge_llm.engine import Engine, GenerationEvent
from edge_llm.errors import ConfigError
from edge_llm.footprint import MemoryRefused
from edge_llm.sdnotify import Notifier
from edge_llm.server.errors import APIKeys
from edge_llm.server.metrics import Metrics
from edge_llm.server.prefetch import Prefetch
from edge_llm.server.worker import Job, Worker
from edge_llm.settings import Settings
from edge_llm.snapshot.store import SnapshotStore

log = logging.getLogger(__name__)

# each start-up step (a tensor loaded, 256 MiB hashed, a stage begun) must finish within this
# many seconds of the previous one, or systemd's start timeout (extended by each step) fires
STARTUP_STEP_TIMEOUT = 120.0
# at stop, each layer of the pending snapshot save must be written within this many seconds
# (an 8K-token Qwen3-VL-2B layer is 67 MB: under 2 s at 40 MB/s)
STOP_STEP_TIMEOUT = 30.0
# the text of the warm-up forward before the ready line (`warm_up`)
WARM_UP_TEXT = "Hello, this is the warm-up."


def warm_up(engine: Engine) -> int:
    """Start-up work the first request would otherwise pay, done before the ready line
    (docs/logs.md, "Process lifecycle"): the tokenizer's length bound (built from its JSON, 50 ms
    for SmolLM2's, 170 ms for Qwen3's here), and a prompt and one decode step through the real
    model, so every kernel path has run once (onnxruntime's first run of each graph, the first
    touch of mapped weights such as the embedding and the head). It runs on a scratch cache of
    its own: the clients' cache, the snapshots and every bit of an answer stay as they are (the
    kernels hold no state across calls). Returns the prompt's token count."""
    tok, model = engine.tokenizer, engine.model
    tok.min_tokens(WARM_UP_TEXT)
    ids = tok.encode(WARM_UP_TEXT)[:16]
    cache = model.new_cache(len(ids) + 1, check_memory=False)
    if len(ids) > 1:  # the prompt path: rows in a chunk, then the last token alone
        model.prefill(ids[:-1], cache, chunk=engine.align, logits=False)
    logits = model.forward(ids[-1:], cache)
    model.forward([int(logits.argmax())], cache, decode=True)
    return len(ids)


def model_id_for(settings: Settings) -> str:
    """The id /v1/models lists: the model directory's name, or "default"."""
    if settings.model == "default":
        return "default"
    return Path(settings.model).name or settings.model


class AppState:
    """Everything the routes need; owned by one app instance."""

    def __init__(self, settings: Settings, notifier: Notifier | None = None,
                 loader: Callable[[], Engine] | None = None, on_fatal: Callable[[Exception], None] | None = None):
        self.settings = settings
        self.notifier = notifier
        self.on_fatal = on_fatal
        self.keys = APIKeys.from_file(settings.api_key_file)  # unreadable key file: fail at start
        self.model_id = model_id_for(settings)
        self.created = int(time.time())
        self.started = time.monotonic()
        self.status = "loading"
        self.error: str | None = None
        self.engine: Engine | None = None
        self.worker: Worker | None = None
        self.prefetch: Prefetch | None = None  # disk_kv_prefetch (edge_llm/server/prefetch.py)
        self.exit_reason: str | None = None
        self._stop_t0 = 0.0
        # the loading thread's "stopping? else publish ok" and a stop's "stopping" are one step each
        self._publish = threading.Lock()
        self._loader = loader or self._default_loader
        self._load_thread: threading.Thread | None = None
        self.metrics = Metrics(self.metrics_state)

    # ---- loading ---------------------------------------------------------------------------
    def _default_loader(self) -> Engine:
        from edge_llm.runtime import load_runtime

        return load_runtime(self.settings, progress=self._load_progress,
                            import_progress=lambda done, total, what: self._load_progress(
                                f"importing the default model {done >> 20}/{total >> 20} MiB"))

    def _load_progress(self, text: str) -> None:
        """A start-up step finished: extend systemd's start timeout from now, say what we do."""
        if self.notifier is not None:
            self.notifier.extend_timeout(STARTUP_STEP_TIMEOUT)
            self.notifier.status(text)

    def start_loading(self) -> None:
        self._status("loading model")
        self._load_thread = threading.Thread(target=self._load, name="edge-llm-load", daemon=True)
        self._load_thread.start()

    def _load(self) -> None:
        t0 = time.monotonic()
        try:
            engine = self._loader()
        except Exception as e:  # reported on /health and as a failed start
            self.status = "failed"
            if isinstance(e, MemoryRefused):  # its own one line: estimate, available, the fix
                self.error = str(e)
                log.error("%s", e)
            else:
                self.error = f"{type(e).__name__}: {e}"
                log.error("model load failed: %s", self.error,
                          exc_info=not isinstance(e, (ConfigError, OSError)))
            self._status(f"failed: {self.error}")
            if self.on_fatal is not None:
                self.on_fatal(e)
            return
        if self.status == "stopping":  # SIGTERM arrived while loading: nothing to serve
            engine.close()
            return
        t1 = time.monotonic()
        self._status("warming up")
        try:
            n = warm_up(engine)
        except Exception as e:  # the model cannot compute: as a failed load
            engine.close()
            self.status, self.error = "failed", f"warm-up: {type(e).__name__}: {e}"
            log.error("%s", self.error, exc_info=True)
            self._status(f"failed: {self.error}")
            if self.on_fatal is not None:
                self.on_fatal(e)
            return
        log.info("warm-up: a %d-token prompt and a decode step in %.2fs (before the ready line)", n,
                 time.monotonic() - t1)
        with self._publish:  # a stop now either finds no engine (closed here) or a worker to stop
            if self.status == "stopping":
                engine.close()
                return
            self.engine = engine
            self.prefetch = self._make_prefetch(engine)
            worker = Worker(engine, self.settings.queue_size, self.notifier, on_finish=self._finished,
                            prefetch=self.prefetch)
            self.worker = worker
            self.status = "ok"
        snap = self.snapshot_summary()
        log.info("ready: url=http://%s:%d model=%s backend=%s namespace=%s index=%d checkpoint(s) %d bytes "
                 "max_seq=%d queue_size=%d load=%.1fs", self.settings.host, self.settings.port, self.model_id,
                 self.backend,
                 self.namespace, snap["count"], snap["bytes"], self.settings.max_seq,
                 self.settings.queue_size, time.monotonic() - t0)
        if self.notifier is not None:
            self.notifier.ready(self._status_text())
        worker.start()  # after READY=1: its watchdog pings only count once systemd sees us ready

    def _make_prefetch(self, engine: Engine) -> Prefetch | None:
        if self.settings.disk_kv_prefetch == "off":
            return None
        if engine.store is None:
            log.info("[KV-DISK] disk_kv_prefetch = %s: no snapshots to prefetch (disk KV is off)",
                     self.settings.disk_kv_prefetch)
            return None
        return Prefetch(engine, engine.store, self.metrics.prefetch_outcome)

    def _finished(self, job: Job, last: GenerationEvent) -> None:
        self.metrics.observe_generation(last.timings, last.usage, last.finish_reason)

    def _status(self, text: str) -> None:
        if self.notifier is not None:
            self.notifier.status(text)

    def _status_text(self) -> str:
        snap = self.snapshot_summary()
        return (f"serving {self.model_id} on {self.settings.host}:{self.settings.port}; "
                f"{snap['count']} snapshot(s)")

    # ---- introspection ---------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.status == "ok" and self.worker is not None

    @property
    def store(self) -> SnapshotStore | None:
        return self.engine.store if self.engine is not None else None

    @property
    def namespace(self) -> str | None:
        store = self.store
        return store.ns.name if store is not None else None

    def store_stats(self) -> dict[str, Any]:
        """The store's counters plus the cost gate's running estimates (kv-disk read bandwidth,
        prefill rate: edge_llm/costgate.py), exported as edge_llm_snapshot_* metrics."""
        store = self.store
        if store is None:
            return {}
        return {**store.stats(), **self.engine.gate.stats()}

    def snapshot_summary(self) -> dict[str, Any]:
        st = self.store_stats()
        return {"enabled": self.store is not None, "count": int(st.get("files", 0)),
                "bytes": int(st.get("bytes_on_disk", 0)), "directory": self.settings.disk_kv or None}

    def degraded(self) -> list[str]:
        """Human-readable conditions that reduce service (e.g. "snapshot disk full")."""
        flags = [str(v) for v in self.store_stats().get("degraded", ())]
        if self.engine is not None and self.engine.disk_kv_error:
            flags.append(self.engine.disk_kv_error)
        if self.status == "failed":
            flags.append("model load failed")
        return flags

    @property
    def backend(self) -> str:
        """The backend that runs (`auto` resolves to rknn, cpu-q or cpu at load), else the setting."""
        return self.engine.model.backend.name if self.engine is not None else self.settings.backend

    @property
    def backend_reason(self) -> str | None:
        return self.engine.backend_reason or None if self.engine is not None else None

    def health(self) -> dict[str, Any]:
        w = self.worker
        return {
            "status": self.status, "version": __version__, "model": self.model_id,
            "backend": self.backend, "backend_reason": self.backend_reason, "namespace": self.namespace,
            "max_seq": self.settings.max_seq, "snapshots": self.snapshot_summary(),
            "queue_depth": w.depth if w else 0, "queue_size": self.settings.queue_size,
            "busy": bool(w and w.busy), "degraded": self.degraded(), "error": self.error,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "sampling_defaults": self.engine.sampling_defaults.to_dict() if self.engine is not None else None,
            "prefetch": self.prefetch.state if self.prefetch is not None else "off",
            "npu_selftest": self.engine.npu_selftest if self.engine is not None else None,
        }

    def metrics_state(self) -> dict[str, Any]:
        w = self.worker
        return {"queue_depth": w.depth if w else 0, "busy": bool(w and w.busy), "ready": self.ready,
                "store": self.store_stats() if self.store is not None else None}

    # ---- shutdown ----------------------------------------------------------------------------
    def begin_shutdown(self, reason: str) -> None:
        """First signal: refuse new work, tell systemd we are stopping. Safe to call twice."""
        with self._publish:
            if self.exit_reason is None:
                self.exit_reason = reason
            if self.status == "stopping":
                return
            self.status = "stopping"
            # the grace period runs from the signal, not from the HTTP server's own connection
            # draining, which happens before `close` (set inside the lock: a `close` racing the
            # signal's thread must not read the 0 of "not stopping yet")
            self._stop_t0 = time.monotonic()
        log.info("shutdown requested (%s): refusing new requests", reason)
        if self.notifier is not None:
            self.notifier.stopping(f"stopping ({reason})")
        if self.worker is not None:
            self.worker.begin_shutdown()
            timer = threading.Timer(self.settings.grace_seconds, self.worker.cancel_running,
                                    args=("shutdown grace period over",))
            timer.daemon = True
            timer.start()

    def cut_grace(self, reason: str) -> None:
        """A second signal: the grace period ends now. The running job stops at its next step or
        layer and is answered with finish_reason "cancelled"; the stop goes on as after the grace
        period (the pending snapshot is still flushed)."""
        log.info("%s: grace period cut short", reason)
        if self.worker is not None:
            self.worker.cancel_running(f"{reason}: grace period cut short")

    def close(self, grace: float | None = None) -> None:
        """Finish/cancel the running job, flush the pending snapshot save, close the store."""
        self.begin_shutdown(self.exit_reason or "shutdown")
        grace = self.settings.grace_seconds if grace is None else grace
        if self.worker is not None:
            self.worker.stop(max(0.0, grace - (time.monotonic() - self._stop_t0)))
        if self.engine is None:
            return
        store, t0 = self.engine.store, time.monotonic()
        if store is not None:
            pending = store.pending_tokens()
            if pending:
                eta = store.predicted_save_s(pending)
                log.info("stop: flushing a %d-token snapshot%s", pending, "" if eta is None else
                         f", ~{eta:.1f} s at the measured {store.write_bps / 1e6:.0f} MB/s")
            try:
                # progress-driven, like the start: each layer written extends systemd's stop
                # timeout, so a slow eMMC finishes the save and a stalled one does not hang the stop
                store.flush_with_progress(self._stop_progress, STOP_STEP_TIMEOUT)
            except Exception:  # the process is exiting; published snapshots are already safe
                log.exception("snapshot store flush failed")
        try:  # the store's writer, then NPU contexts / the simulator's worker: after the last save
            self.engine.close(timeout=5)
        except Exception:
            log.exception("engine close failed")
        if store is not None:
            log.info("snapshot store flushed and closed in %.0f ms", (time.monotonic() - t0) * 1e3)

    def _stop_progress(self, text: str) -> None:
        if self.notifier is not None:
            self.notifier.extend_timeout(STOP_STEP_TIMEOUT)
            self.notifier.status(text)
