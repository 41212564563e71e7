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
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request

from edge_llm.safetext import one_line

TAGS = ("KV-DISK", "PREFILL-TIMING")  # the bracketed tags of docs/logs.md the page shows
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

    def __init__(self, tags: tuple[str, ...] = TAGS, queue_events: int = QUEUE_EVENTS):
        super().__init__(logging.INFO)
        self.tags, self.queue_events = frozenset(tags), queue_events
        self._clients: set[Client] = set()
        self._clients_lock = threading.Lock()
        self.dropped = 0  # events dropped for slow clients, all clients, since start

    @property
    def clients(self) -> int:
        with self._clients_lock:
            return len(self._clients)

    def count_drop(self) -> None:
        with self._clients_lock:
            self.dropped += 1

    def emit(self, record: logging.LogRecord) -> None:
        with self._clients_lock:
            clients = list(self._clients)
        if not clients:
            return
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging's own handler reports it on stderr
            self.handleError(record)
            return
        m = _TAG.match(message)
        if m is None or m.group(1) not in self.tags:
            return
        event = {"ts": record.created, "tag": m.group(1), "line": one_line(message)}
        for c in clients:
            c.offer(event)

    def subscribe(self) -> Client:
        c = Client(self, asyncio.get_running_loop(), self.queue_events)
        with self._clients_lock:
            self._clients.add(c)
        return c

    def unsubscribe(self, c: Client) -> None:
        with self._clients_lock:
            self._clients.discard(c)

    async def stream(self, request: Request, stopping: Callable[[], bool]) -> AsyncIterator[str]:
        """One client's SSE text until it disconnects or `stopping()` turns true: a comment line
        first (sent once the client is subscribed), then `event: log` per line, `event: dropped`
        before the first event after a loss, `: keep-alive` after KEEPALIVE_S of silence."""
        loop = asyncio.get_running_loop()
        c = self.subscribe()
        gone = asyncio.create_task(_disconnected(request))
        try:
            yield ": edge-llm events\n\n"
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
                yield f"event: log\ndata: {json.dumps(event)}\n\n"
                quiet_since = loop.time()
        finally:
            gone.cancel()
            self.unsubscribe(c)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (a GET has no body: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
