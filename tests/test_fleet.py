"""Several boards as one service (docs/fleet.md): a real HAProxy started with the shipped
board/haproxy.cfg.example in front of real servers on loopback.

One run, in phases: a single-board reference of every conversation; then the fleet (3 boards):
every follow-up on its conversation's board with a cache hit; one board SIGKILLed mid-request
(the request in flight gets HAProxy's JSON 502, its conversations continue on other boards with
the reference's answers, the others stay); the board restarted (its conversations come back and
restore their snapshots from disk); a fourth board added (few conversations move, only to it).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import http.server
import shutil
import subprocess
import threading
import time

import pytest

from edge_llm.bench.fleet import (
    HASH_TYPES,
    SHIPPED_CONFIG,
    Conversation,
    HAProxy,
    conversations,
    fleet_config,
    post,
    probe_routes,
)
from serverutil import ServerProc, wait_for

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None,
                                reason="haproxy is not installed (make test-deps installs it as root)")

N_CONV, MAX_TOKENS, PROBES = 6, 4, 300
# the same on every board (part of the snapshot identity): a reused prefix is cut to a multiple of
# it (docs/store.md), so short chats reuse rows only with a chunk well below their length
CHUNK = "16"


def _boards(edge_home, tmp_path, n):
    return [ServerProc(edge_home, tmp_path / f"b{i}", "--node-name", f"b{i}", "--prefill-chunk", CHUNK)
            for i in range(1, n + 1)]


def _start_all(servers):
    # one after another: four model loads at once on a busy two-core machine would share one
    # ready deadline; each board gets the whole of its own
    for s in servers:
        s.start()


def _turn(convs: list[Conversation], url: str, turn: int) -> None:
    for c in convs:  # interleaved: every conversation's turn t before any turn t+1
        r = c.send(url, turn, MAX_TOKENS)
        assert r.status == 200, (c.name, turn, r.status, r.body)


@pytest.mark.timeout(1800)  # four servers started (one twice) and ~2000 requests, on two busy cores
def test_fleet_affinity_failover_rejoin_and_growth(edge_home, tmp_path):
    b1, b2, b3, b4 = boards = _boards(edge_home, tmp_path, 4)
    proxies: list[HAProxy] = []
    try:
        _start_all(boards)
        for s in boards:  # the header names the board on every response, errors included
            assert s.health().headers["x-edge-llm-node"] == s.args[1]
        # the reference: every conversation on one board alone (b4, before it joins the fleet)
        ref = conversations(N_CONV, 4)
        for t in range(4):
            _turn(ref, b4.url, t)
        answers = {c.name: [r.text for r in c.replies] for c in ref}

        text = SHIPPED_CONFIG.read_text()
        three = [f"127.0.0.1:{s.port}" for s in (b1, b2, b3)]
        proxy = HAProxy(fleet_config(text, 3), three, tmp_path / "haproxy").start()
        proxies.append(proxy)
        proxy.wait_boards()  # all three up (HAProxy's stats: their checks passed)
        routes3 = probe_routes(proxy.url, PROBES)
        spread = collections.Counter(routes3)
        assert set(spread) == {"b1", "b2", "b3"} and min(spread.values()) >= PROBES / 3 * 0.6, spread
        print(f"spread of {PROBES} keys over 3 boards: {dict(sorted(spread.items()))}")

        convs = conversations(N_CONV, 4)
        _turn(convs, proxy.url, 0)
        _turn(convs, proxy.url, 1)
        home = {c.name: c.nodes[0] for c in convs}
        for c in convs:
            assert c.nodes == [home[c.name]] * 2, c.nodes
            assert c.replies[1].cached > 0 and c.replies[1].source in ("ram", "disk"), c.replies[1].body["timings"]
            assert [r.text for r in c.replies] == answers[c.name][:2]
        by_board = collections.Counter(home.values())
        victim_name = by_board.most_common(1)[0][0]
        victim = {"b1": b1, "b2": b2, "b3": b3}[victim_name]
        theirs = [c for c in convs if home[c.name] == victim_name]

        # a long request in flight on the victim when it is killed: a JSON error, not a hang
        inflight = Conversation("inflight", ["Count from 1 to 500, separated by commas."])
        inflight.messages = list(theirs[0].messages)
        size0 = victim.log_size()
        with cf.ThreadPoolExecutor(1) as pool:
            # the deadlines only bound a hang (a busy machine is slow, not wrong)
            fut = pool.submit(inflight.send, proxy.url, 0, 400, 300.0)
            wait_for(lambda: "[PREFILL-TIMING]" in victim.log(size0), timeout=300, what="the long request running")
            victim.kill()
            t_kill = time.monotonic()
            r = fut.result(timeout=360)
            print(f"in flight at the kill: {r.status} {r.body.get('error', r.body)} "
                  f"{(time.monotonic() - t_kill) * 1e3:.0f} ms after the SIGKILL")
        assert r.status in (502, 503), (r.status, r.body)
        assert r.body["error"]["type"] == "server_error" and r.body["error"]["code"], r.body

        # turn 3 at once: the victim's conversations are retried/redispatched to the next board
        _turn(convs, proxy.url, 2)
        for c in convs:
            assert c.replies[2].text == answers[c.name][2], c.name  # recomputed or reused: same greedy text
            if c in theirs:
                assert c.nodes[2] not in (victim_name, None), c.nodes
            else:
                assert c.nodes[2] == home[c.name] and c.replies[2].cached > 0, (c.name, c.nodes)

        # the board leaving moved only its own keys, once HAProxy's checks marked it down: its state
        # is polled on the stats socket (the others up), not assumed after a fixed sleep
        others = {n: "UP" for n in ("b1", "b2", "b3") if n != victim_name}
        proxy.wait_servers({victim_name: "DOWN", **others})
        routes2 = probe_routes(proxy.url, PROBES)
        for a, b in zip(routes3, routes2):
            assert (b != victim_name) if a == victim_name else (b == a), (a, b)
        print(f"{victim_name} left: {sum(a == victim_name for a in routes3)} of {PROBES} keys moved, "
              f"{dict(sorted(collections.Counter(b for a, b in zip(routes3, routes2) if a != b).items()))}")

        # the victim comes back: its share moves back and restores its snapshots from disk
        victim.start()
        proxy.wait_boards()  # its checks passed again (polled)
        assert probe_routes(proxy.url, PROBES) == routes3  # exactly its keys came back
        _turn(convs, proxy.url, 3)
        for c in convs:
            assert c.nodes[3] == home[c.name], (c.name, c.nodes)
            assert c.replies[3].text == answers[c.name][3], c.name
            assert c.replies[3].cached > 0, (c.name, c.replies[3].body["timings"])
            if c in theirs:  # a fresh process: the rows came from its kv dir
                assert c.replies[3].source == "disk", c.replies[3].body["timings"]

        # a fourth board joins (b4, the reference board): only conversations that move to it move
        before = probe_routes(proxy.url, PROBES)
        proxy.stop()
        four = [*three, f"127.0.0.1:{b4.port}"]
        proxy = HAProxy(fleet_config(text, 4), four, tmp_path / "haproxy", port=proxy.port).start()
        proxies.append(proxy)
        proxy.wait_boards()
        after = probe_routes(proxy.url, PROBES)
        moved = [(a, b) for a, b in zip(before, after) if a != b]
        assert all(b == "b4" for _, b in moved), collections.Counter(moved)
        assert 0 < len(moved) <= 1.5 / 4 * PROBES, len(moved)
        print(f"3 -> 4 boards: {len(moved)} of {PROBES} keys moved, all to b4; conversations per board "
              f"{dict(sorted(by_board.items()))}, killed {victim_name}")
        for c in convs:  # the chats: the same rule
            r = c.send(proxy.url, 0, 1)
            assert r.status == 200 and r.node in (home[c.name], "b4"), (c.name, r.node)
        # no board left: HAProxy's own 503, as the API's JSON error
        for s in boards:
            s.kill()
        r = post(proxy.url + "/v1/chat/completions", convs[0].body(0, 1), timeout=30)
        assert r.status == 503 and r.body["error"]["code"] == "no_board", (r.status, r.body)
    finally:
        for p in proxies:
            p.stop()
        for s in boards:
            if s.proc is not None and s.proc.poll() is None:
                s.stop()


def test_node_header_and_prompt_cache_key(edge_home, tmp_path):
    """One board: X-Edge-LLM-Node on every response (200, 400 from the gate, 404); a string
    prompt_cache_key is accepted, another type is a 400 naming it."""
    with ServerProc(edge_home, tmp_path / "one", "--node-name", "board-7").start() as s:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        ok = post(s.url + "/v1/chat/completions", {**body, "prompt_cache_key": "conv-42"})
        assert (ok.status, ok.node) == (200, "board-7"), ok.body
        bad = post(s.url + "/v1/chat/completions", {**body, "prompt_cache_key": 42})
        assert bad.status == 400 and bad.node == "board-7", bad.body
        assert "prompt_cache_key" in str(bad.body["error"]), bad.body
        done = post(s.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "prompt_cache_key": "k"})
        assert done.status == 200, done.body
        assert post(s.url + "/nowhere", {}).node == "board-7"


def test_node_name_is_a_header_token():
    """node_name goes into a response header: a name with a space or a control byte is refused."""
    from edge_llm.errors import ConfigError
    from edge_llm.settings import load_settings

    assert load_settings({"node_name": "board-3.lab:a"}, env={}).node_name == "board-3.lab:a"
    for bad in ("board 3", "b3\r\nSet-Cookie: x", "", "x" * 65):
        with pytest.raises(ConfigError, match="node_name must be"):
            load_settings({"node_name": bad}, env={})
    assert load_settings(env={"EDGE_LLM_NODE_NAME": "b9"}).node_name == "b9"


def test_bench_fleet_spread_configs_differ_from_the_shipped_file_only_in_hash_type(tmp_path):
    """`bench fleet --spread` measures HASH_TYPES with the shipped file: each config is one HAProxy
    accepts (`haproxy -c`) and differs from the shipped one only in the `hash-type` line (and b4's)."""
    text = SHIPPED_CONFIG.read_text()
    for hash_type in HASH_TYPES:
        for n in (3, 4):
            cfg = fleet_config(text, n, hash_type=hash_type)
            changed = {a for a, b in zip(text.splitlines(), cfg.splitlines()) if a != b}
            assert all(ln.strip().startswith(("hash-type ", "# server b4 ")) for ln in changed), changed
            assert f"    hash-type {hash_type}\n" in cfg
            path = tmp_path / f"{n}.cfg"
            path.write_text(cfg)
            r = subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, (hash_type, r.stderr)



class _Board(http.server.BaseHTTPRequestHandler):
    """A stub board: `/health` answers 200 after the server's `delay` seconds (a busy board)."""

    def do_GET(self):  # noqa: N802 - http.server's name
        time.sleep(self.server.delay)
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def _stub_boards(delays: list[float]) -> list[http.server.ThreadingHTTPServer]:
    servers = []
    for d in delays:
        s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Board)
        s.delay, s.daemon_threads = d, True
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
    return servers


@pytest.mark.parametrize("timeout_check", [True, False], ids=["shipped", "without-timeout-check"])
def test_a_board_slow_to_answer_health_stays_up(tmp_path, timeout_check):
    """The shipped `timeout check 10s`: a board whose /health takes 1.5 s (busy generating or writing
    a snapshot) passes its checks and stays in; without the line a check must finish within
    `inter` (1 s), and the same board is taken out (L7TOUT). Judged by HAProxy's own server states."""
    text = fleet_config(SHIPPED_CONFIG.read_text(), 3)
    assert "    timeout check 10s\n" in text
    if not timeout_check:
        text = text.replace("    timeout check 10s\n", "")
    boards = _stub_boards([0.0, 1.5, 0.0])
    proxy = HAProxy(text, [f"127.0.0.1:{s.server_address[1]}" for s in boards], tmp_path).start()
    try:
        if timeout_check:
            proxy.wait_servers({"b1": "UP", "b2": "UP", "b3": "UP"})  # b2's last check passed: L7OK
        else:
            proxy.wait_servers({"b1": "UP", "b2": "DOWN", "b3": "UP"})
            assert proxy.server_states()["b2"][1] == "L7TOUT"
    finally:
        proxy.stop()
        for s in boards:
            s.shutdown()
