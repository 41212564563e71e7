"""The event stream's backlog (docs/api.md, `GET /v1/edge/events`): a page that connects after the
server started, or reconnects after a restart, is sent the recent lines first, among them the
start-up scan's `[KV-DISK] index:` line that was logged before any client could connect; a
reconnect to the same process with `Last-Event-ID` is not sent a line twice. A real server process
on a real socket (the tiny random Qwen3-VL: fast), stopped with SIGTERM and started again on the
same kv dir, as the lab does (docs/lab-a.md)."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from serverutil import ServerProc, wait_for

# long enough to be saved (more than disk_kv_min_lcp tokens)
PROMPT = ("Tell me about the old harbour town of Saint-Malo in Brittany: its granite walls, the "
          "tides, the corsairs who sailed from it, and what a visitor should eat there.")


class Stream:
    """One SSE stream read on its own thread: the `log` events' data, with the SSE `id:` of each."""

    def __init__(self, url: str, last_event_id: str | None = None):
        self.events: list[dict] = []
        self.ids: list[str] = []
        self.opened = threading.Event()
        self._stop = threading.Event()
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        self._t = threading.Thread(target=self._run, args=(url + "/v1/edge/events", headers), daemon=True)
        self._t.start()

    def _run(self, url: str, headers: dict[str, str]) -> None:
        try:
            with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(10, read=None)) as r:
                name, data, ev_id = "message", [], None
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    if line == ": edge-llm events":
                        self.opened.set()
                    elif line.startswith("id:"):
                        ev_id = line[3:].strip()
                    elif line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].strip())
                    elif line == "" and data:
                        if name == "log":
                            self.ids.append(ev_id)
                            self.events.append(json.loads("\n".join(data)))
                        name, data, ev_id = "message", [], None
        except httpx.HTTPError:
            pass

    def lines(self, start: str) -> list[dict]:
        return [e for e in list(self.events) if e["line"].startswith(start)]

    def close(self) -> None:
        self._stop.set()  # the reader returns at the next line (the server's keep-alive at the latest)


def chat(srv: ServerProc, text: str, max_tokens: int = 2) -> None:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=600,
                   json={"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                         "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.mark.timeout(1800)  # two server starts, two generations and a save on a busy machine: bounds a hang
def test_backlog_shows_the_start_and_the_restart(tiny_synth_dir, tmp_path):
    srv = ServerProc(tmp_path / "home", tmp_path / "srv", "--model", str(tiny_synth_dir), "--max-seq", "512")
    srv.start()
    streams: list[Stream] = []
    try:
        # connected after the server is ready: the start-up scan's line comes from the backlog
        first = Stream(srv.url)
        streams.append(first)
        (index,) = wait_for(lambda: first.lines("[KV-DISK] index: "), 60, what="the backlog's index line")
        assert index["line"].startswith("[KV-DISK] index: 0 checkpoint(s)"), index
        assert index["line"] in srv.log() and index["id"] in first.ids
        token = index["id"].split("-")[0]

        chat(srv, PROMPT)
        saved = wait_for(lambda: first.lines("[KV-DISK] saved "), 300, what="the save's line")[0]
        last_id = first.ids[-1]
        assert all(i.startswith(token + "-") for i in first.ids), first.ids
        first.close()

        # a reconnect to the same process with Last-Event-ID: only what came after it. The next
        # request's line is the first event of that stream (none of the lines already seen again)
        again = Stream(srv.url, last_event_id=last_id)
        streams.append(again)
        assert again.opened.wait(60)
        chat(srv, "Another question: " + PROMPT)
        wait_for(lambda: again.lines("[PREFILL-TIMING] "), 120, what="the next request's line")
        seen = set(first.ids)
        assert not seen & set(again.ids), (first.ids, again.ids)
        assert again.events[0]["line"].startswith("[PREFILL-TIMING] "), again.events[:3]
        again.close()

        # SIGTERM, a start on the same kv dir: a reconnect (with the old process's last id, as the
        # page sends it) is sent the new process's backlog, its index line counting the saved file
        assert srv.stop(signal.SIGTERM) == 0
        srv.start()
        after = Stream(srv.url, last_event_id=last_id)
        streams.append(after)
        (index2,) = wait_for(lambda: after.lines("[KV-DISK] index: "), 60, what="the new process's index line")
        assert index2["line"].startswith("[KV-DISK] index: 2 checkpoint(s)") or \
            index2["line"].startswith("[KV-DISK] index: 1 checkpoint(s)"), index2
        assert not index2["id"].startswith(token + "-"), (index2, token)  # another process's numbering
        assert index2["ts"] > saved["ts"]
    finally:
        for s in streams:
            s.close()
        srv.stop()
