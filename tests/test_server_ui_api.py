"""The page's server side (docs/api.md, "The page and its endpoints"): the static files and their
headers, the `ui` setting, the key on the data endpoints, the store and state JSON, and the
`[KV-DISK]` / `[PREFILL-TIMING]` log lines as server-sent events. Real servers on real sockets,
the default model (SmolLM2-135M); the event hub's bound is also driven in-process with a real
logger and a real event loop that is held still (what a client that stopped reading leaves)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from serverutil import ServerProc, wait_for

from edge_llm.server.events import QUEUE_EVENTS, EventHub
from edge_llm.server.storeview import basenames
from edge_llm.server.ui import STATIC_DIR
from edge_llm.snapshot.inspect import describe

KEY = "page-secret-key"
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
AUTH = {"Authorization": f"Bearer {KEY}"}
DATA = ("/v1/edge/state", "/v1/edge/store", "/v1/edge/events")
# a prompt whose conversation is saved (longer than disk_kv_min_lcp)
PROMPT = ("Tell me about the old harbour town of Saint-Malo in Brittany: its granite walls, the "
          "tides, the corsairs who sailed from it, and what a visitor should eat there.")


@pytest.fixture(scope="module")
def srv(edge_home, tmp_path_factory):
    work = tmp_path_factory.mktemp("srv-ui")
    (work / "keys").write_text(KEY + "\n")
    s = ServerProc(edge_home, work, "--api-key-file", str(work / "keys"), "--max-seq", "1024")
    s.api_key = KEY
    s.start()
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def srv_no_ui(tiny_synth_dir, tmp_path_factory):
    """ui = false (from the TOML file, as a board sets it), no key, the tiny random Qwen3-VL (no
    number of it is checked: it has a vision tower, the default model has none); ends with the
    SIGTERM test. The grace period is long (600 s) so that a server that waited for an open stream
    is told from one that did not by a bound that only a hang reaches on a busy machine."""
    work = tmp_path_factory.mktemp("srv-no-ui")
    (work / "edge-llm.toml").write_text("ui = false\n")
    s = ServerProc(work / "home", work, "--model", str(tiny_synth_dir), "--config", str(work / "edge-llm.toml"),
                   "--max-seq", "256", "--grace-seconds", "600")
    s.start()
    yield s
    s.stop()


class Events:
    """An SSE reader on its own thread: the parsed events (`event`, `data`) and comments, in order."""

    def __init__(self, url: str, headers: dict[str, str]):
        self.items: list[tuple[str, str]] = []  # (event name or ":" for a comment, data)
        self.ended = threading.Event()
        self.status: int | None = None
        self._t = threading.Thread(target=self._run, args=(url, headers), daemon=True)
        self._t.start()

    def _run(self, url: str, headers: dict[str, str]) -> None:
        try:
            with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(10, read=None)) as r:
                self.status = r.status_code
                self.content_type = r.headers.get("content-type", "")
                name, data = "message", []
                for line in r.iter_lines():
                    if line.startswith(":"):
                        self.items.append((":", line[1:].strip()))
                    elif line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].strip())
                    elif line == "" and data:
                        self.items.append((name, "\n".join(data)))
                        name, data = "message", []
        except httpx.HTTPError:
            pass
        finally:
            self.ended.set()

    def logs(self) -> list[dict]:
        return [json.loads(d) for n, d in list(self.items) if n == "log"]

    def opened(self) -> bool:
        return any(n == ":" and d == "edge-llm events" for n, d in list(self.items))


def chat(srv: ServerProc, text: str, max_tokens: int = 8, before: list[dict] | None = None) -> dict:
    messages = [*(before or []), {"role": "user", "content": text}]
    r = httpx.post(srv.url + "/v1/chat/completions", headers=AUTH if srv.api_key else {}, timeout=600,
                   json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def log_messages(srv: ServerProc) -> list[str]:
    """The log file's messages: each line after "<time> <level> <logger>: "."""
    return [m.group(1) for line in srv.log().splitlines()
            if (m := re.match(r"\S+ [A-Z]+ [\w.]+: (.*)$", line))]


def strings(doc) -> list[str]:
    if isinstance(doc, str):
        return [doc]
    if isinstance(doc, dict):
        return [s for k, v in doc.items() for s in [k, *strings(v)]]
    if isinstance(doc, list):
        return [s for v in doc for s in strings(v)]
    return []


# The tests on the module's servers carry no timeout mark of their own: pytest-timeout counts the
# fixture's setup (a server start, up to READY_TIMEOUT on a busy machine) in the first test that
# uses it, so the suite's global timeout bounds them (a hang, not slowness).

# ---- the page's files ----------------------------------------------------------------------------
def test_page_files_are_public_with_strict_headers(srv):
    """The files need no key (they hold no data), each comes with the CSP exactly, nosniff and
    no-cache; /ui and / redirect to /ui/; nothing outside the folder is reachable."""
    index = httpx.get(srv.url + "/ui/", timeout=30)
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    assert index.text == (STATIC_DIR / "index.html").read_text()
    others = sorted(p.name for p in STATIC_DIR.iterdir() if p.is_file() and p.name != "index.html")
    assert others, "the page has only index.html"
    for r in [index] + [httpx.get(f"{srv.url}/ui/{name}", timeout=30) for name in others]:
        assert r.status_code == 200, (r.url, r.status_code)
        assert r.headers["content-security-policy"] == CSP, r.url
        assert r.headers["x-content-type-options"] == "nosniff", r.url
        assert r.headers["cache-control"] == "no-cache", r.url
    js = [n for n in others if n.endswith(".js")]
    assert all(httpx.get(f"{srv.url}/ui/{n}", timeout=30).headers["content-type"].startswith("text/javascript")
               for n in js)  # nosniff: a script served as anything else would not run
    for path in ("/ui", "/"):
        r = httpx.get(srv.url + path, timeout=30)
        assert r.status_code == 307 and r.headers["location"] == "/ui/", path
    for path in ("/ui/../ui.py", "/ui/%2e%2e/ui.py", "/ui/..%2fapp.py", "/ui/nothing.js"):
        assert httpx.get(srv.url + path, timeout=30).status_code == 404, path


def test_errors_carry_the_page_headers(srv):
    """A /ui/ path that is no file is answered outside the page's mount (the router's 404): it and
    every other error (401, 404, 405, the Host check's 421) carry the page's headers too."""
    for method, path, headers, status in (
            ("GET", "/ui/nothing.js", {}, 404), ("GET", "/ui/%2e%2e/ui.py", {}, 404), ("HEAD", "/ui/nothing", {}, 404),
            ("GET", "/v1/nothing-here", {}, 404), ("GET", "/v1/chat/completions", AUTH, 405),
            ("GET", "/v1/edge/store", {}, 401), ("GET", "/ui/", {"Host": "evil.example"}, 421)):
        r = httpx.request(method, srv.url + path, headers=headers, timeout=30)
        assert r.status_code == status, (path, r.status_code, r.text)
        assert r.headers.get("content-security-policy") == CSP, (path, r.headers)
        assert r.headers.get("x-content-type-options") == "nosniff", (path, r.headers)
        assert r.headers.get("referrer-policy") == "no-referrer", (path, r.headers)


def test_ui_false_turns_the_page_off(srv_no_ui):
    for path in ("/ui/", "/ui/index.html", "/ui", "/"):
        r = httpx.get(srv_no_ui.url + path, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path
    state = httpx.get(srv_no_ui.url + "/v1/edge/state", timeout=30)  # the API stays
    assert state.status_code == 200 and state.json()["vision"] is True  # a Qwen3-VL: images allowed


# ---- the key ------------------------------------------------------------------------------------
def test_every_data_endpoint_needs_the_key(srv):
    for path in DATA:
        for headers, code in (({}, "missing_api_key"), ({"Authorization": "Bearer nope"}, "invalid_api_key")):
            r = httpx.get(srv.url + path, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == code, (path, r.text)
            assert "text/event-stream" not in r.headers.get("content-type", "")
    for path in DATA[:2]:
        assert httpx.get(srv.url + path, headers=AUTH, timeout=30).status_code == 200, path
    ev = Events(srv.url + "/v1/edge/events", AUTH)
    wait_for(ev.opened, 30, what="the event stream's first line")
    assert ev.status == 200 and ev.content_type.startswith("text/event-stream")


# ---- state, store, events -------------------------------------------------------------------------
def test_state(srv):
    st = httpx.get(srv.url + "/v1/edge/state", headers=AUTH, timeout=30).json()
    health = srv.health().json()
    for k in ("status", "version", "model", "backend", "namespace", "max_seq"):
        assert st[k] == health[k], k
    assert st["backend_reason"] == basenames(health["backend_reason"])
    assert st["status"] == "ok" and st["max_seq"] == 1024 and st["settings"]["api_key"] is True
    assert st["vision"] is False  # SmolLM2 has no vision tower
    mem = st["memory"]
    assert mem["estimate_bytes"] == sum(mem["parts"].values()) > 0
    assert mem["parts"]["KV"] == 1024 * 2 * 30 * 3 * 64 * 4  # max_seq x 2 x layers x kv_dim x F32
    assert mem["available_bytes"] > mem["rss_bytes"] > 0
    assert not [s for s in strings(st) if "/" in s or os.sep in s], "a path in /v1/edge/state"


def test_messages_shown_to_the_page_name_no_paths():
    """backend_reason and the degraded flags can name a device node, rknn_dir or the kv dir: the
    state document keeps only their last parts."""
    assert (basenames("NPU at /dev/dri/card1 but /opt/m/rknn-out does not match the model: x")
            == "NPU at card1 but rknn-out does not match the model: x")
    assert basenames("disk KV unavailable: /var/lib/edge-llm/kv: Read-only file system") == (
        "disk KV unavailable: kv: Read-only file system")
    assert basenames("backend auto -> cpu-q (no RKNPU device node; onnxruntime 1.32.0 importable)") == (
        "backend auto -> cpu-q (no RKNPU device node; onnxruntime 1.32.0 importable)")


def test_store_and_events_after_a_request(srv):
    """A request with an open event stream: its [PREFILL-TIMING] line and the [KV-DISK] line of
    its save arrive as events with the log file's text; the store then lists the file with its
    tokens, its size on disk, the size formula of its header, and its first words."""
    ev = Events(srv.url + "/v1/edge/events", AUTH)
    wait_for(ev.opened, 30, what="the event stream's first line")
    out = chat(srv, PROMPT)
    n_prefill = out["timings"]["prefill_tokens"]  # rows computed: the line's n=
    # a save's fsyncs wait behind the disk's other writers: the deadlines only bound a hang
    saved = wait_for(lambda: [e for e in ev.logs() if e["tag"] == "KV-DISK" and " saved " in e["line"]], 300,
                     what="a [KV-DISK] saved event")[0]
    prefill = [e for e in ev.logs() if e["tag"] == "PREFILL-TIMING"]
    assert prefill and f"n={n_prefill} " in prefill[-1]["line"]
    messages = log_messages(srv)
    for e in (saved, prefill[-1]):
        assert e["line"] in messages, e  # the same text as the log file's line
        assert abs(e["ts"] - time.time()) < 600
    name = re.search(r"-> (kv_[0-9a-f]{16}\.kv)", saved["line"]).group(1)
    n_saved = int(re.search(r"saved (\d+)-token", saved["line"]).group(1))

    doc = httpx.get(srv.url + "/v1/edge/store", headers=AUTH, timeout=30).json()
    assert doc["enabled"] and doc["namespace"] == srv.health().json()["namespace"]
    snap = next(s for s in doc["snapshots"] if s["file"] == name)
    path = srv.kv_dir / doc["namespace"] / name
    assert snap["tokens"] == n_saved and snap["bytes"] == path.stat().st_size
    assert snap["formula_bytes"] == describe(path)["size_formula"]["expected"]
    assert snap["chain_base"] is None and snap["chain_files"] == 1
    # the save sets the file's mtime to the entry's LRU time (a scan after a restart reads it back):
    # the same number, whatever the fsyncs took (up to the float's rounding through nanoseconds)
    assert snap["last_used"] == pytest.approx(path.stat().st_mtime, abs=1e-3)
    assert snap["first_words"].startswith("Tell me about the old harbour town of Saint-Malo")
    assert len(snap["first_words"]) <= 80 and snap["first_words"].isprintable()
    assert doc["limits"] == {"max_files": 8, "max_bytes": None, "max_tokens": 8192, "max_chain": 8}
    assert doc["free_bytes"] > 0 and doc["cost_gate"]["mode"] == "pipelined"
    assert doc["cost_gate"]["compute_tokens_per_s"] > 0  # this prefill measured the rate
    assert not [s for s in strings(doc) if "/" in s or os.sep in s], "a path in /v1/edge/store"

    # the next turn is saved as a delta on that file: its formula counts only the rows it holds
    chat(srv, "And what should I eat there?", 4,
         [{"role": "user", "content": PROMPT}, out["choices"][0]["message"]])
    delta = wait_for(lambda: [e for e in ev.logs() if e["tag"] == "KV-DISK" and " saved " in e["line"]
                              and f"-> {name}" not in e["line"]], 300, what="the second turn's save")[0]
    assert f"delta on {name}" in delta["line"]
    dname = re.search(r"-> (kv_[0-9a-f]{16}\.kv)", delta["line"]).group(1)
    doc = httpx.get(srv.url + "/v1/edge/store", headers=AUTH, timeout=30).json()
    d = next(s for s in doc["snapshots"] if s["file"] == dname)
    dpath = srv.kv_dir / doc["namespace"] / dname
    assert d["chain_base"] == name and d["chain_files"] == 2, d
    assert d["formula_bytes"] == describe(dpath)["size_formula"]["expected"] == d["bytes"] == dpath.stat().st_size
    assert doc["snapshots"][0]["file"] == dname  # most recently used first


def test_a_stalled_client_holds_nothing_up(srv):
    """A stream whose client never reads (a raw socket with a small receive buffer): requests are
    answered, the other streams get their events, and the server counts the client."""
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    raw.connect(("127.0.0.1", srv.port))
    raw.sendall(f"GET /v1/edge/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    try:
        ev = Events(srv.url + "/v1/edge/events", AUTH)
        wait_for(ev.opened, 30, what="the event stream's first line")
        state = lambda: httpx.get(srv.url + "/v1/edge/state", headers=AUTH, timeout=30).json()  # noqa: E731
        wait_for(lambda: state()["events"]["clients"] >= 2, 30, what="both streams open")
        before = len([e for e in ev.logs() if e["tag"] == "PREFILL-TIMING"])
        chat(srv, "Another question: " + PROMPT, max_tokens=2)
        wait_for(lambda: len([e for e in ev.logs() if e["tag"] == "PREFILL-TIMING"]) > before, 60,
                 what="the reading stream's event")
    finally:
        raw.close()


def test_the_hub_never_waits_and_counts_what_it_drops():
    """The bound, in-process: the client's event loop is held still (it runs nothing: a stream
    whose client stopped reading is one that never takes from its queue), and a logger on another
    thread logs 3x the bound. Every emit returns (a hub that waited on the loop would hang here:
    the timeout fails it); once the loop runs again, the queue holds the bound and the rest is
    counted as dropped, and the stream tells its client how many it lost before the next event."""
    hub = EventHub()
    logger = logging.getLogger("edge_llm.test_ui_hub")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(hub)
    loop = asyncio.new_event_loop()
    hold, held = threading.Event(), threading.Event()
    chunks: list[str] = []

    class FakeRequest:  # the stream only asks it for the disconnect: this client stays
        headers: dict[str, str] = {}

        async def receive(self):
            await asyncio.sleep(3600)

    async def consume():
        gen = hub.stream(FakeRequest(), lambda: False)
        chunks.append(await gen.__anext__())  # subscribed
        held.set()
        hold.wait()  # the loop is stuck: nothing on it runs until released
        await asyncio.sleep(0.2)  # the queued hand-overs run
        while len(chunks) < 3:
            chunks.append(await gen.__anext__())
        await gen.aclose()

    t = threading.Thread(target=loop.run_until_complete, args=(consume(),), daemon=True)
    t.start()
    try:
        assert held.wait(30)
        n = 3 * QUEUE_EVENTS
        done = threading.Event()

        def log_all():
            for i in range(n):
                logger.info("[KV-DISK] line %d", i)
            logger.info("[OTHER] not a page tag")
            done.set()

        threading.Thread(target=log_all, daemon=True).start()
        assert done.wait(30), "logging waited on a stalled client"
        hold.set()
        t.join(30)
        assert not t.is_alive()
        assert hub.dropped == n - QUEUE_EVENTS
        assert chunks[1] == f'event: dropped\ndata: {{"dropped": {n - QUEUE_EVENTS}}}\n\n'
        first = json.loads(chunks[2].split("data: ", 1)[1])
        assert chunks[2].startswith(f"id: {hub.token}-1\nevent: log\n") and first["line"] == "[KV-DISK] line 0"
        assert first["tag"] == "KV-DISK" and hub.clients == 0
    finally:
        logger.removeHandler(hub)
        hold.set()
        t.join(5)
        if not t.is_alive():
            loop.close()


def test_sigterm_ends_open_streams(srv_no_ui):
    """With a page's stream open, SIGTERM ends the stream and the server exits 0: it does not wait
    for the stream (the grace period here is 600 s, uvicorn waits that long for open responses).
    The 300 s bound only tells that wait from a slow exit on a busy machine; it is not a speed."""
    ev = Events(srv_no_ui.url + "/v1/edge/events", {})
    wait_for(ev.opened, 60, what="the event stream's first line")
    srv_no_ui.send(signal.SIGTERM)
    assert srv_no_ui.proc.wait(300) == 0  # a server waiting for the stream: TimeoutExpired
    assert ev.ended.wait(60)
    assert "reason=SIGTERM code=0" in srv_no_ui.log()
