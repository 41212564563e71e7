"""The shipped HAProxy config's routing rules, run as shipped (docs/fleet.md): a real HAProxy in
front of stand-in boards (real HTTP servers on loopback that name themselves in X-Edge-LLM-Node;
edge_llm/bench/fleet_load.py). No model runs: where each request lands is HAProxy's decision.

Image chats bigger than the 64 KiB routing buffer with their key in the header or the body, the
page's no-body requests following the board of its chat (the EDGE_BOARD cookie), HAProxy's own
errors as JSON, and bounded loads (hash-balance-factor) capping a hot board.
"""

from __future__ import annotations

import base64
import http.cookiejar
import json
import math
import random
import re
import shutil
import socket
import threading
import urllib.request

import pytest

from edge_llm.bench.fleet import SHIPPED_CONFIG, HAProxy, fleet_config
from edge_llm.bench.fleet_load import (
    KEY_HEADER,
    NODE_HEADER,
    ROUTE_HEADER,
    home_of,
    send,
    skewed_keys,
    stand_ins,
    with_balance_factor,
)

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None,
                                reason="haproxy is not installed (make test-deps installs it as root)")

# every status HAProxy 2.6 can answer by itself (its http-error list; 200 is monitor-uri's)
PROXY_STATUSES = {400, 401, 403, 404, 405, 407, 408, 410, 413, 421, 422, 425, 429, 500, 501, 502, 503, 504}


@pytest.fixture
def fleet(tmp_path):
    """The shipped config, 3 stand-in boards; yields (proxy, boards). The routing rules as shipped,
    with bounded loads off: these tests send one request after another from several clients
    (connections), and HAProxy may count a request in flight for a moment after its client has
    the answer, enough for `hash-balance-factor` to move the next one on a busy machine
    (docs/fleet.md, "Bounded loads"); the bound has its own test below."""
    boards = stand_ins(3)
    text = with_balance_factor(fleet_config(SHIPPED_CONFIG.read_text(), 3), 0)
    proxy = HAProxy(text, [b.address for b in boards], tmp_path).start()
    try:
        yield proxy.wait_boards(), boards
    finally:
        proxy.stop()
        for b in boards:
            b.stop()


def _photo(rng: random.Random, size: int = 96 * 1024) -> str:
    """A data: URL like a camera's JPEG: the same first 2 KiB (headers, tables) for every photo,
    then bytes of its own; well over the 64 KiB buffer once base64-encoded."""
    head = bytes(random.Random(0).getrandbits(8) for _ in range(2048))
    return "data:image/jpeg;base64," + base64.b64encode(head + rng.randbytes(size)).decode()


def test_image_chats_route_by_their_key_on_every_turn(fleet):
    """8 photos, 8 keys, 3 turns each through the official `openai` client: with the key in the
    X-Prompt-Cache-Key header (extra_headers) every turn lands on the key's board whatever the
    body's size; the client writes `prompt_cache_key` after `messages`, so a body-only key past the
    buffer is not seen, and the response says so (X-Edge-Route: body-prefix;truncated). A body
    that has the key before the image is routed by it (key;truncated)."""
    import openai

    proxy, _ = fleet
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    rng = random.Random(49)
    keys = [f"photo-chat-{i}" for i in range(8)]
    homes = {k: home_of(proxy.url, k) for k in keys}
    assert len(set(homes.values())) > 1, homes  # the keys spread: a board per key is a real check
    photos = {k: _photo(rng) for k in keys}
    fallback_nodes = set()
    for turn in range(3):
        for k in keys:
            history = [{"role": "user", "content": [{"type": "text", "text": "What is in this photo?"},
                                                    {"type": "image_url", "image_url": {"url": photos[k]}}]}]
            history += [{"role": "user", "content": f"turn {t}"} for t in range(1, turn + 1)]
            assert len(json.dumps(history)) > 64 * 1024
            r = client.chat.completions.with_raw_response.create(
                model="m", messages=history, prompt_cache_key=k, max_tokens=1, extra_headers={KEY_HEADER: k})
            assert (r.headers[NODE_HEADER], r.headers[ROUTE_HEADER]) == (homes[k], "header"), (k, turn)
            r = client.chat.completions.with_raw_response.create(
                model="m", messages=history, prompt_cache_key=k, max_tokens=1)
            assert r.headers[ROUTE_HEADER] == "body-prefix;truncated", (k, turn)
            fallback_nodes.add(r.headers[NODE_HEADER])
            first = send(proxy.url, body={"prompt_cache_key": k, "messages": history, "max_tokens": 1})
            assert (first.status, first.node, first.route) == (200, homes[k], "key;truncated"), (k, turn)
    # the fall-back, by the photos' common first bytes, put all 8 on one board: what the header fixes
    assert len(fallback_nodes) == 1, fallback_nodes
    # a body that fits: its prompt_cache_key (json_query), the same board as the header's
    for k in keys:
        r = send(proxy.url, body={"messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": k})
        assert (r.node, r.route) == (homes[k], "key"), k


def test_the_page_follows_the_board_of_its_chat(fleet):
    """The page's no-body requests (state, store, events, /ui/) go to the board its latest chat ran
    on, by the EDGE_BOARD cookie the proxy sets on a keyed answer; a keyed request ignores the
    cookie (a client with a cookie jar keeps every conversation on its own board)."""
    proxy, _ = fleet
    jar = http.cookiejar.CookieJar()
    page = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))

    def get(path: str) -> tuple[str, str]:
        with page.open(proxy.url + path, timeout=60) as r:
            r.read()
            return r.headers[NODE_HEADER], r.headers[ROUTE_HEADER]

    def chat(first: str) -> str:  # the page's chat body: messages, no key (routed by its first message)
        body = json.dumps({"messages": [{"role": "user", "content": first}], "stream": True}).encode()
        req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with page.open(req, timeout=60) as r:
            r.read()
            assert r.headers[ROUTE_HEADER] == "first-message"
            return r.headers[NODE_HEADER]

    get("/ui/")  # before any chat: no cookie yet
    # first messages whose boards differ: the page's panels must move with the chat
    firsts, seen = [], set()
    for i in range(200):
        text = f"Tell me about topic {i}."
        node = send(proxy.url, body={"messages": [{"role": "user", "content": text}]}).node
        if node not in seen:
            seen.add(node)
            firsts.append((text, node))
    assert len(firsts) == 3, firsts
    for text, node in [*firsts, firsts[0]]:
        assert chat(text) == node
        for path in ("/v1/edge/state", "/v1/edge/store", "/v1/edge/events", "/ui/", "/ui/app.js"):
            assert get(path) == (node, "cookie"), (path, text, node)
    # a keyed request with a cookie naming another board still goes to its key's board
    last = firsts[0][1]
    other_key = next(f"k{i}" for i in range(500) if home_of(proxy.url, f"k{i}") != last)
    req = urllib.request.Request(proxy.url + "/v1/chat/completions", method="POST",
                                 data=json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
                                 headers={"Content-Type": "application/json", KEY_HEADER: other_key})
    with page.open(req, timeout=60) as r:
        r.read()
        assert (r.headers[NODE_HEADER], r.headers[ROUTE_HEADER]) == (home_of(proxy.url, other_key), "header")


def _raw(port: int, *parts: bytes, pause: float = 0.0, timeout: float = 60.0) -> bytes:
    """Bytes on one connection (with a pause between parts), then everything until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        for i, p in enumerate(parts):
            if i and pause:
                threading.Event().wait(pause)
            s.sendall(p)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _json_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert re.search(rb"(?im)^content-type: application/json\r?$", head), raw[:400]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"], err
    return status, err


def test_every_proxy_status_has_a_json_error_in_the_shipped_file():
    """One `http-error` line per status HAProxy 2.6 can produce, each an OpenAI-style error body."""
    lines = re.findall(r"^\s*http-error status (\d+) content-type application/json (?:hdr \S+ \S+ )?string '(.*)'$",
                       SHIPPED_CONFIG.read_text(), re.M)
    assert {int(s) for s, _ in lines} == PROXY_STATUSES
    for _, body in lines:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] in ("invalid_request_error", "rate_limit_error", "server_error"), err


def test_proxy_errors_are_json(fleet):
    """A body that never completes: HAProxy's 408 (timeout http-request) as JSON; a chunked body
    that breaks after the head: its 400 as JSON; no board up: the 503, with X-Edge-Route. None of
    the broken requests reaches a board."""
    proxy, boards = fleet
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    status, err = _json_error(_raw(proxy.port, head + b"Content-Length: 100\r\n\r\n{\"messages\""))
    assert (status, err["code"]) == (408, "request_timeout")
    status, err = _json_error(_raw(proxy.port, head + b"Transfer-Encoding: chunked\r\n\r\n", b"zz\r\n\r\n",
                                   pause=0.5))
    assert (status, err["code"]) == (400, "bad_request")
    assert not any(b.requests() for b in boards)
    for b in boards:
        b.stop()
    proxy.wait_servers({"b1": "DOWN", "b2": "DOWN", "b3": "DOWN"})
    raw = _raw(proxy.port, head + b"Content-Length: 2\r\nConnection: close\r\n" + KEY_HEADER.encode()
               + b": k\r\n\r\n{}")
    status, err = _json_error(raw)
    assert (status, err["code"]) == (503, "no_board")
    assert re.search(rb"(?im)^x-edge-route: header\r?$", raw.partition(b"\r\n\r\n")[0]), raw[:400]


MALFORMED = {
    "duplicate Content-Length": b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                                b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "a header over the buffer": b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Big: "
                                + b"a" * 70000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("what", MALFORMED)
def test_malformed_requests_get_400_and_reach_no_board(fleet, what):
    proxy, boards = fleet
    raw = _raw(proxy.port, MALFORMED[what])
    assert raw.startswith(b"HTTP/1.1 400 "), raw[:200]
    assert not any(b.requests() for b in boards) and not any(b.requests("/v1/models") for b in boards)


@pytest.mark.xfail(strict=True, reason="HAProxy 2.6's H1 mux answers errors found while parsing a request's "
                   "head with its built-in HTML, whatever http-error or errorfile say (docs/fleet.md)")
@pytest.mark.parametrize("what", MALFORMED)
def test_malformed_request_400s_are_json_too(fleet, what):
    proxy, _ = fleet
    assert _json_error(_raw(proxy.port, MALFORMED[what]))[0] == 400


@pytest.mark.parametrize("factor", [200, 0], ids=["shipped-200", "unbounded"])
def test_bounded_loads_cap_a_hot_board(tmp_path, factor):
    """12 conversations whose keys all map to b1, all in flight at once (the boards hold every
    request until released): with the shipped hash-balance-factor 200, b1 takes at most 2 x the
    mean and the others take the rest; unbounded, b1 takes all 12. With the load gone, every key
    is back on b1."""
    gate = threading.Event()
    boards = stand_ins(3, gate=gate)
    text = fleet_config(SHIPPED_CONFIG.read_text(), 3)
    assert "    hash-balance-factor 200\n" in text
    proxy = HAProxy(with_balance_factor(text, factor), [b.address for b in boards], tmp_path).start()
    n = 12
    try:
        url = proxy.wait_boards().url
        keys = list(skewed_keys(url, n, hot_share=1.0))
        results: list = []
        threads = []
        for i, k in enumerate(keys):  # one at a time: each in flight before the next is sent
            t = threading.Thread(target=lambda k=k: results.append(
                send(url, body={"messages": [{"role": "user", "content": k}]}, headers={KEY_HEADER: k})))
            t.start()
            threads.append(t)
            _wait_total(boards, i + 1)
        counts = {b.name: len(b.requests()) for b in boards}
        gate.set()
        for t in threads:
            t.join(timeout=120)
        assert sorted(r.status for r in results) == [200] * n
        if factor:
            assert counts["b1"] <= math.ceil(factor / 100 * n / 3) and counts["b2"] and counts["b3"], counts
        else:
            assert counts == {"b1": n, "b2": 0, "b3": 0}, counts
        assert {home_of(url, k) for k in keys} == {"b1"}
    finally:
        proxy.stop()
        for b in boards:
            b.stop()


def _wait_total(boards, n: int) -> None:
    """Until the boards together have received n chat requests (polled; the deadline bounds a hang)."""
    import time

    deadline = time.monotonic() + 120
    while sum(len(b.requests()) for b in boards) < n:
        assert time.monotonic() < deadline, [len(b.requests()) for b in boards]
        time.sleep(0.01)


def test_bench_fleet_bounded_cli(tmp_path):
    """`edge-llm bench fleet --bounded` end to end: its results file has each factor's affinity and
    balance (unbounded: every turn at home, b1's hot share as max/mean); a bad --factors is a usage
    error that names the option."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "edge_llm", "bench", "fleet", "--bounded", "--conversations", "8", "--turns", "2",
           "--clients", "3", "--hold-ms", "5", "--hot-share", "0.5", "--out", str(tmp_path)]
    r = subprocess.run([*cmd, "--factors", "0,200"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(next(tmp_path.glob("*-bench-fleet-bounded/fleet-bounded.json")).read_text())
    assert set(res["factors"]) == {"0", "200"}
    off = res["factors"]["0"]
    assert off["turns"] == 16 and off["turns_on_home"] == 1.0
    assert off["turns_per_board"] == {"b1": 8, "b2": 4, "b3": 4} and off["max_over_mean"] == 1.5
    assert 0 < res["factors"]["200"]["turns_on_home"] <= 1.0
    bad = subprocess.run([*cmd, "--factors", "0,90"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--factors" in bad.stderr, bad.stderr
