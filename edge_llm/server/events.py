"""Log lines as server-sent events: `GET /v1/edge/events` (docs/api.md, "The page and its
endpoints"; the lines: docs/logs.md).

`EventHub` is a `logging.Handler` on the root logger: each record whose message starts with one of
`TAGS` (`[KV-DISK] ...`) becomes one event `{"ts", "tag", "line"}`, `line` being the message as the
log file holds it (`safetext.one_line`, what `logsetup.OneLineFormatter` writes). The handler runs
on whatever thread logs (the engine's worker, the snapshot writer): it only hands the event to each
client's event loop (`call_soon_threadsafe`, which never waits), and there each client has a
bounded queue; a client that does not read fills its queue and then loses events, counted, so a
stalled page never holds up the engine. A stream ends when its client disconnects or the server
begins to stop (so an open page does not hold up SIGTERM).

The hub keeps the last `BACKLOG_EVENTS` events, from the server's first line on (the start-up
scan's `[KV-DISK] index:` line is logged before any page can connect), and sends them first to
every new stream: a page that reconnects after a restart shows what the new process did. Each
event has an SSE `id:` `<process token>-<n>`; a reconnect that sends `Last-Event-ID` of this
process gets only the backlog after it, one of another process (or none) the whole backlog
(docs/api.md, `GET /v1/edge/events`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request

from edge_llm.safetext import one_line

TAGS = ("KV-DISK", "PREFILL-TIMING")  # the bracketed tags of docs/logs.md the page shows
BACKLOG_EVENTS = 50  # the last events kept and sent first to a new stream
QUEUE_EVENTS = 256  # events waiting per client; beyond, that client's new events are dropped
KEEPALIVE_S = 15.0  # a comment line this often when nothing else was sent (proxies, dead peers)
POLL_S = 0.5  # how often a waiting stream checks for its client's disconnect and for the stop
_TAG = re.compile(r"\[([A-Z][A-Z0-9-]*)\]")


class Client:
    """One open stream: its queue lives on the event loop that serves it."""

    def __init__(self, hub: EventHub, loop: asyncio.AbstractEventLoop, size: int):
        self.hub, self.loop = hub, loop
        self.queue: asyncio.Queue[dict] = asyncio.Queue(size)
        self.dropped = 0  # not yet told to the client

    def offer(self, event: dict) -> None:
        """From any thread: never waits (the loop runs `_put` when it gets to it)."""
        try:
            self.loop.call_soon_threadsafe(self._put, event)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def _put(self, event: dict) -> None:
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1
            self.hub.count_drop()


class EventHub(logging.Handler):
    """The log handler and its clients (`subscribe`, `stream`)."""

    def __init__(self, tags: tuple[str, ...] = TAGS, queue_events: int = QUEUE_EVENTS,
                 backlog_events: int = BACKLOG_EVENTS):
        super().__init__(logging.INFO)
        self.tags, self.queue_events = frozenset(tags), queue_events
        self._clients: set[Client] = set()
        self._clients_lock = threading.Lock()  # guards the clients, the backlog and the count
        self._backlog: deque[tuple[int, dict]] = deque(maxlen=backlog_events)  # (number, event)
        self._seq = 0  # events numbered in this process (the SSE id's second part)
        self.token = secrets.token_hex(4)  # the SSE id's first part: tells this process from the last
        self.dropped = 0  # events dropped for slow clients, all clients, since start

    @property
    def clients(self) -> int:
        with self._clients_lock:
            return len(self._clients)

    def count_drop(self) -> None:
        with self._clients_lock:
            self.dropped += 1

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging's own handler reports it on stderr
            self.handleError(record)
            return
        m = _TAG.match(message)
        if m is None or m.group(1) not in self.tags:
            return
        event = {"ts": record.created, "tag": m.group(1), "line": one_line(message)}
        with self._clients_lock:  # numbered, kept and handed out in one order (`offer` never waits)
            self._seq += 1
            event["id"] = f"{self.token}-{self._seq}"
            self._backlog.append((self._seq, event))
            for c in self._clients:
                c.offer(event)

    def subscribe(self, last_event_id: str | None = None) -> tuple[Client, list[dict]]:
        """A new client and the backlog it is sent first: the events after `last_event_id` when
        that is one of this process's ids, else all of it. Taken under the lock that `emit` holds,
        so every event is either in that backlog or offered to the client, never both or neither."""
        c = Client(self, asyncio.get_running_loop(), self.queue_events)
        after = self._seq_of(last_event_id)
        with self._clients_lock:
            backlog = [e for n, e in self._backlog if n > after]
            self._clients.add(c)
        return c, backlog

    def _seq_of(self, event_id: str | None) -> int:
        """This process's number in an SSE id, 0 for another process's id, none or a malformed one."""
        token, _, n = (event_id or "").strip().partition("-")
        return int(n) if token == self.token and n.isdigit() and len(n) < 20 else 0

    def unsubscribe(self, c: Client) -> None:
        with self._clients_lock:
            self._clients.discard(c)

    async def stream(self, request: Request, stopping: Callable[[], bool]) -> AsyncIterator[str]:
        """One client's SSE text until it disconnects or `stopping()` turns true: a comment line
        first (sent once the client is subscribed), the backlog, then `event: log` per line,
        `event: dropped` before the first event after a loss, `: keep-alive` after KEEPALIVE_S of
        silence."""
        loop = asyncio.get_running_loop()
        c, backlog = self.subscribe(request.headers.get("last-event-id"))
        gone = asyncio.create_task(_disconnected(request))
        try:
            yield ": edge-llm events\n\n"
            for event in backlog:
                yield _log_event(event)
            quiet_since = loop.time()
            while not gone.done() and not stopping():
                try:
                    event = await asyncio.wait_for(c.queue.get(), POLL_S)
                except TimeoutError:
                    if loop.time() - quiet_since >= KEEPALIVE_S:
                        yield ": keep-alive\n\n"
                        quiet_since = loop.time()
                    continue
                if c.dropped:
                    yield f"event: dropped\ndata: {json.dumps({'dropped': c.dropped})}\n\n"
                    c.dropped = 0
                yield _log_event(event)
                quiet_since = loop.time()
        finally:
            gone.cancel()
            self.unsubscribe(c)


def _log_event(event: dict) -> str:
    return f"id: {event['id']}\nevent: log\ndata: {json.dumps(event)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (a GET has no body: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
