"""The server's shutdown order: the running job stops, the pending snapshot is flushed, and only
then the backend releases what it holds outside the heap (NPU contexts, the simulator's worker)."""

from __future__ import annotations

import time

from edge_llm.engine import GenerationRequest
from edge_llm.runtime import load_runtime
from edge_llm.server.state import AppState
from edge_llm.settings import Settings
from edge_llm.snapshot.layout import SNAPSHOT_GLOB


def test_close_releases_the_backend_after_the_last_save(tiny_synth_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    settings = Settings(model=str(tiny_synth_dir), backend="cpu", disk_kv=str(tmp_path / "kv"), max_seq=512)
    seen = []

    def loader():
        engine = load_runtime(settings)
        store_close = engine.store.close

        def closing_store(*a, **kw):
            seen.append(("store", engine.store.pending_tokens()))
            return store_close(*a, **kw)

        engine.store.close = closing_store
        engine.model.backend.close = lambda: seen.append(("backend", engine.store.pending_tokens()))  # via Engine.close
        return engine

    state = AppState(settings, loader=loader)
    state.start_loading()
    deadline = time.monotonic() + 120
    while state.status == "loading" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.status == "ok", state.error
    list(state.engine.generate(GenerationRequest(prompt_tokens=list(range(100, 300)), max_tokens=2)))
    state.close(grace=0)
    assert seen == [("store", 0), ("backend", 0)]  # flushed, closed, then the backend
    assert list((tmp_path / "kv").rglob(SNAPSHOT_GLOB)), "the request's snapshot was saved before the close"


def test_a_stop_during_loading_releases_the_backend(tiny_synth_dir, tmp_path, monkeypatch):
    import threading

    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    settings = Settings(model=str(tiny_synth_dir), backend="cpu", disk_kv=str(tmp_path / "kv"), max_seq=512)
    go, closed = threading.Event(), threading.Event()

    def loader():
        engine = load_runtime(settings)
        engine.model.backend.close = closed.set
        go.wait(60)  # still loading when the stop arrives
        return engine

    state = AppState(settings, loader=loader)
    state.start_loading()
    state.begin_shutdown("SIGTERM")
    go.set()
    assert closed.wait(60), "the engine loaded after the stop was never released"
    assert state.engine is None and state.status == "stopping"


def _serve_degraded(settings) -> AppState:
    state = AppState(settings, loader=lambda: load_runtime(settings))
    state.start_loading()
    deadline = time.monotonic() + 120
    while state.status == "loading" and time.monotonic() < deadline:
        time.sleep(0.05)
    return state


def test_a_kv_dir_that_cannot_be_created_starts_degraded(tiny_synth_dir, tmp_path, monkeypatch, caplog):
    """A kv dir below a regular file (NotADirectoryError at mkdir): the service starts and serves
    without snapshots, and /health says why, instead of failing its start (a crash loop)."""
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    (tmp_path / "a-file").write_text("not a directory")
    state = _serve_degraded(Settings(model=str(tiny_synth_dir), backend="cpu", disk_kv=str(tmp_path / "a-file" / "kv"), max_seq=512))
    assert state.status == "ok", state.error
    health = state.health()
    assert any("disk KV unavailable" in d for d in health["degraded"]) and not health["snapshots"]["enabled"]
    assert "[KV-DISK] disk KV unavailable" in caplog.text
    last = list(state.engine.generate(GenerationRequest(prompt_tokens=list(range(100, 200)), max_tokens=2)))[-1]
    assert last.finish_reason in ("length", "stop")
    state.close(grace=0)


def test_a_read_only_kv_filesystem_starts_degraded(tiny_synth_dir, tmp_path, monkeypatch):
    """The EROFS of a read-only mount, for real (a tmpfs; needs root): first a kv dir that does
    not exist yet, then one whose namespace exists from an earlier run (nothing to create: the
    store's write check finds it at start, not the first save)."""
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True, text=True)
    if r.returncode != 0:
        import pytest

        pytest.skip(f"cannot mount a read-only tmpfs here (needs root): {r.stderr.strip()}")
    try:
        monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
        settings = Settings(model=str(tiny_synth_dir), backend="cpu", disk_kv=str(ro / "kv"), max_seq=512)
        state = _serve_degraded(settings)
        assert state.status == "ok", state.error
        assert any("Read-only file system" in d for d in state.health()["degraded"]), state.health()["degraded"]
        state.close(grace=0)

        subprocess.run(["mount", "-o", "remount,rw", str(ro)], check=True)
        state = _serve_degraded(settings)  # a run that creates the namespace
        assert state.status == "ok" and state.store is not None and not state.health()["degraded"]
        ns = state.store.ns
        state.close(grace=0)
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        state = _serve_degraded(settings)
        assert state.status == "ok", state.error
        degraded = state.health()["degraded"]
        assert any("disk KV unavailable" in d and "Read-only file system" in d for d in degraded), degraded
        assert ns.is_dir() and state.store is None
        state.close(grace=0)
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_a_stop_between_ready_and_the_workers_start(tiny_synth_dir, tmp_path, monkeypatch):
    """The server publishes status "ok" a moment before it starts the worker thread; a stop in that
    window (a SIGTERM, a test's close) used to join a thread never started ("cannot join thread
    before it is started"). The stop now returns at once, and the late start runs nothing."""
    from edge_llm.server.worker import Worker

    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    engine = load_runtime(Settings(model=str(tiny_synth_dir), backend="cpu", disk_kv=None, max_seq=512))
    try:
        worker = Worker(engine)
        assert worker.stop(grace=0) is True
        worker.start()  # the loading thread's start, after the stop
        assert worker._thread.ident is None, "a start after the stop ran the worker thread"
    finally:
        engine.close()


def test_a_request_queued_before_the_worker_starts_joins_the_prefetch(tiny_synth_dir, tmp_path, monkeypatch):
    """A request that reaches the queue with the ready line, before the worker thread has begun its
    start-up prefetch, is looked at after the first restored layer like one that comes later: a
    follow-up of the prefetched conversation joins the read (it used to skip the prefetch and
    restore on demand). And the job's metrics are counted before its client sees the end (a slow
    callback here: the client's end comes after it). The real store, reader and worker thread; the
    tiny model."""
    import asyncio

    from edge_llm.server.prefetch import Prefetch
    from edge_llm.server.worker import Job, Worker

    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    settings = Settings(model=str(tiny_synth_dir), backend="cpu", disk_kv=str(tmp_path / "kv"), max_seq=512)
    first = list(range(100, 260))
    engine = load_runtime(settings)
    answer = [ev.token_id for ev in engine.generate(GenerationRequest(prompt_tokens=first, max_tokens=4))
              if ev.token_id is not None]
    engine.store.flush()
    engine.close()

    engine = load_runtime(settings)  # a restart: the cache is empty, the snapshot on disk
    try:
        prefetch = Prefetch(engine, engine.store)
        order: list[str] = []  # a slow callback: without the order, the client's end would come first
        worker = Worker(engine, prefetch=prefetch,
                        on_finish=lambda _job, _last: (time.sleep(0.5), order.append("counted")))

        async def follow_up():
            job = Job(GenerationRequest(prompt_tokens=first + answer + list(range(300, 340)), max_tokens=2),
                      asyncio.get_running_loop())
            worker.submit(job)  # queued before the thread runs
            worker.start()
            events = [ev async for ev in job.events()]
            order.append("client's end")
            return events

        last = asyncio.run(follow_up())[-1]
        worker.stop(grace=60)
        assert order == ["counted", "client's end"], order
        assert prefetch.state == "joined", prefetch.state
        assert last.timings.cache_source == "disk-prefetch", last.timings.cache_source
    finally:
        engine.close()


def test_a_stop_while_the_load_publishes_is_not_overwritten(tiny_synth_dir, tmp_path, monkeypatch):
    """The loading thread checks "stopping?" and then publishes "ok"; a SIGTERM's `begin_shutdown`
    between the two used to be overwritten by "ok" (the server took requests again). Here the stop
    comes from inside that step (the Worker's construction); it now waits for the publish and wins."""
    import threading

    from edge_llm.server import state as state_module

    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    settings = Settings(model=str(tiny_synth_dir), backend="cpu", disk_kv=None, max_seq=512)
    app = AppState(settings, loader=lambda: load_runtime(settings))
    stops: list[threading.Thread] = []

    class StoppedWhileBuilt(state_module.Worker):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            stops.append(threading.Thread(target=app.begin_shutdown, args=("SIGTERM",)))
            stops[0].start()
            stops[0].join(1)  # the old code ran it to the end here; now it waits for the publish

    monkeypatch.setattr(state_module, "Worker", StoppedWhileBuilt)
    app.start_loading()
    app._load_thread.join(120)
    stops[0].join(60)
    try:
        assert app.status == "stopping" and app.exit_reason == "SIGTERM", app.status
    finally:
        app.close(grace=0)
