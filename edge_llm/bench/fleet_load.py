"""Routing under load, measured on HAProxy itself: stand-in boards and a skewed set of
conversation keys (docs/fleet.md, "Bounded loads").

A stand-in board is a real HTTP server on loopback that answers like a board does for routing:
`/health` 200, `X-Edge-LLM-Node` on every response, and chat completions one at a time (a board
has one inference thread and queues the rest), each held for a fixed service time or until a test
releases it. No model runs: what is measured is where HAProxy sends each request (its
`hash-balance-factor` counts the requests in flight per board), not how fast a board answers.
Used by `edge-llm bench fleet --bounded` and tests/test_fleet_routing.py. Standard library only.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import http.server
import json
import logging
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from edge_llm.bench.fleet import NODE_HEADER, FleetError, HAProxy, fleet_config
from edge_llm.bench.keepalive import call

log = logging.getLogger(__name__)

ROUTE_HEADER = "X-Edge-Route"
KEY_HEADER = "X-Prompt-Cache-Key"
_FACTOR = re.compile(r"^(\s*)hash-balance-factor \d+\n", re.M)
CHAT_PATH = "/v1/chat/completions"


def with_balance_factor(text: str, factor: int) -> str:
    """The shipped config with another `hash-balance-factor` (0: unbounded consistent hashing)."""
    if not _FACTOR.search(text):
        raise FleetError("the config lacks the shipped 'hash-balance-factor' line")
    return _FACTOR.sub(rf"\g<1>hash-balance-factor {factor}\n", text)


@dataclass
class Seen:
    """One request as a stand-in board received it."""
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        board: StandInBoard = self.server.board  # type: ignore[attr-defined]
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        board.arrived(Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        if self.path == "/health":
            out = b'{"status":"ok"}'
        elif self.command == "POST" and self.path == CHAT_PATH:
            with board.worker:  # one at a time, the others wait: a board's inference thread
                board.serve()
            out = json.dumps({
                "id": "chatcmpl-standin", "object": "chat.completion", "created": 0, "model": "stand-in",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": board.name},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
        else:
            out = json.dumps({"node": board.name, "path": self.path}).encode()
        board.done(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header(NODE_HEADER, board.name)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer  # noqa: N815 - http.server's names

    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # HAProxy's checks close their connection once answered (a reset the next read sees)
        log.debug("stand-in board: connection from %s ended: %r", client_address, sys.exc_info()[1])


class StandInBoard:
    """A loopback HTTP server named like a board. Chat completions are served one at a time and
    each takes `hold` seconds, or, with `gate`, waits until the gate is set."""

    def __init__(self, name: str, hold: float = 0.0, gate: threading.Event | None = None):
        self.name, self.hold, self.gate = name, hold, gate
        self.worker = threading.Lock()
        self._lock = threading.Condition()
        self.seen: list[Seen] = []
        self.in_flight = self.peak_in_flight = 0
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.board = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> "StandInBoard":
        self.thread.start()
        return self

    def arrived(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)
            if seen.path != "/health":
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self._lock.notify_all()

    def done(self, path: str) -> None:
        with self._lock:
            if path != "/health":
                self.in_flight -= 1

    def serve(self) -> None:
        if self.gate is not None:
            self.gate.wait()
        elif self.hold:
            time.sleep(self.hold)

    def requests(self, path: str = CHAT_PATH) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.path == path]

    def wait_requests(self, n: int, path: str = CHAT_PATH, timeout: float = 120.0) -> None:
        """Until this board has received `n` requests for `path` (a bound on a hang only)."""
        with self._lock:
            if not self._lock.wait_for(lambda: sum(s.path == path for s in self.seen) >= n, timeout):
                raise FleetError(f"{self.name}: {n} requests for {path} not received within {timeout:.0f} s")

    def stop(self) -> None:
        if self.gate is not None:
            self.gate.set()
        self.server.shutdown()
        self.server.server_close()


def stand_ins(n: int, hold: float = 0.0, gate: threading.Event | None = None) -> list[StandInBoard]:
    return [StandInBoard(f"b{i}", hold, gate).start() for i in range(1, n + 1)]


@dataclass
class Routed:
    status: int
    node: str | None
    route: str | None
    headers: dict[str, str] = field(default_factory=dict)


def send(url: str, path: str = CHAT_PATH, body: dict | None = None, headers: dict[str, str] | None = None,
         timeout: float = 120.0) -> Routed:
    """One request through the proxy, on this thread's kept-alive connection: which board
    answered and which rule routed it."""
    status, hdrs, _ = call("POST" if body is not None else "GET", url + path, body, headers, timeout)
    return Routed(status, hdrs.get(NODE_HEADER), hdrs.get(ROUTE_HEADER), {k.lower(): v for k, v in hdrs.items()})


def home_of(url: str, key: str) -> str | None:
    """The board a key maps to with no load (a GET carrying the key header: no generation)."""
    return send(url, "/v1/models", headers={KEY_HEADER: key}).node


def skewed_keys(url: str, n: int, hot_share: float, hot: str = "b1", boards: int = 3) -> dict[str, str]:
    """`n` conversation keys, `hot_share` of them on board `hot` and the rest spread evenly over the
    others: a hot key range. Returns key -> its board with no load."""
    want = {hot: round(n * hot_share)}
    rest = [f"b{i}" for i in range(1, boards + 1) if f"b{i}" != hot]
    for i, b in enumerate(rest):
        want[b] = (n - want[hot]) // len(rest) + (1 if i < (n - want[hot]) % len(rest) else 0)
    out: dict[str, str] = {}
    have = collections.Counter()
    i = 0
    while len(out) < n:
        if i > 100 * n:
            raise FleetError(f"no {n} keys with the wanted spread {want} among {i} candidates: {dict(have)}")
        key = f"conv-{i:05d}"
        i += 1
        node = home_of(url, key)
        if node in want and have[node] < want[node]:
            out[key] = node
            have[node] += 1
    return out


def run_conversations(url: str, homes: dict[str, str], turns: int, clients: int) -> dict[str, list[str | None]]:
    """Every conversation's `turns` chat requests, in order, with its key in the header; `clients`
    conversations at once. Returns key -> the board of each turn."""
    def one(key: str) -> list[str | None]:
        nodes = []
        for t in range(turns):
            r = send(url, body={"messages": [{"role": "user", "content": f"{key} turn {t}"}], "max_tokens": 1},
                     headers={KEY_HEADER: key}, timeout=900)
            if r.status != 200:
                raise FleetError(f"{key} turn {t}: {r.status}")
            nodes.append(r.node)
        return nodes

    with cf.ThreadPoolExecutor(clients) as pool:
        futs = {k: pool.submit(one, k) for k in homes}
        return {k: f.result() for k, f in futs.items()}


def load_stats(homes: dict[str, str], nodes: dict[str, list[str | None]], boards: list[StandInBoard],
               wall_s: float) -> dict:
    """Affinity (turns on their key's board; conversations that never left it) and balance (each
    board's share of the turns, max/mean, and its peak of requests in flight)."""
    turns = [(homes[k], n) for k, ns in nodes.items() for n in ns]
    per_board = collections.Counter(n for _, n in turns)
    counts = [per_board.get(b.name, 0) for b in boards]
    return {"turns": len(turns), "turns_on_home": sum(h == n for h, n in turns) / max(1, len(turns)),
            "conversations_on_home": sum(all(n == homes[k] for n in ns) for k, ns in nodes.items()) / len(nodes),
            "turns_per_board": {b.name: per_board.get(b.name, 0) for b in boards},
            "max_over_mean": max(counts) / (sum(counts) / len(counts)),
            "peak_in_flight": {b.name: b.peak_in_flight for b in boards},
            "wall_s": wall_s}


def bounded_loads(text: str, workdir: Path, factors: tuple[int, ...], conversations: int, turns: int,
                  clients: int, hold: float, hot_share: float, step=lambda msg: None) -> dict:
    """Per `hash-balance-factor` (0 = off): the same skewed conversations, `clients` at a time,
    through the shipped config (3 boards) in front of fresh stand-in boards."""
    out = {}
    for factor in factors:
        step(f"hash-balance-factor {factor or 'off'}")
        boards = stand_ins(3, hold)
        proxy = HAProxy(with_balance_factor(fleet_config(text, 3), factor), [b.address for b in boards],
                        workdir).start()
        try:
            url = proxy.wait_boards().url
            homes = skewed_keys(url, conversations, hot_share)  # no load: every key on its ring board
            for b in boards:
                b.peak_in_flight = 0
            t0 = time.perf_counter()
            nodes = run_conversations(url, homes, turns, clients)
            out[factor] = load_stats(homes, nodes, boards, time.perf_counter() - t0)
        finally:
            proxy.stop()
            for b in boards:
                b.stop()
    return out
