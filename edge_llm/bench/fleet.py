"""Several boards behind HAProxy, driven from outside: the shipped config, the proxy process and
multi-turn chats that remember which board answered (docs/fleet.md).

Used by `edge-llm bench fleet` and by tests/test_fleet.py, both with the config the repo ships
(`board/haproxy.cfg.example`) and only its documented knobs: the EDGE_FLEET_BIND / EDGE_BOARD<n>
environment variables HAProxy expands itself, the commented fourth board's server lines uncommented to add
a board, and `balance roundrobin` in place of the hash for the comparison (or another `hash-type`
for `bench fleet --spread`). Standard library only.
"""

from __future__ import annotations

import collections
import csv
import io
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from edge_llm.bench.client import HTTPFailure, free_port, http_call
from edge_llm.bench.keepalive import call

log = logging.getLogger(__name__)

NODE_HEADER = "X-Edge-LLM-Node"  # edge_llm/server/node.py
SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "board" / "haproxy.cfg.example"
HASH_BALANCE = "balance hash var(txn.key)"
ROUND_ROBIN = "balance roundrobin"
HASH_TYPE = "consistent crc32"  # the shipped `hash-type`
# `hash-type <method> <function> [avalanche]` of HAProxy 2.6: every consistent function, and map-based
HASH_TYPES = (*(f"consistent {fn}{mod}" for fn in ("crc32", "sdbm", "djb2", "wt6") for mod in ("", " avalanche")),
              "map-based crc32")
_FOURTH = re.compile(r"^(\s*)# (server b4 .*)$", re.M)
BACKEND = "boards"  # the shipped backend's name; its servers are b1..b4


class FleetError(RuntimeError):
    pass


def fleet_config(text: str, boards: int = 3, balance: str = HASH_BALANCE, hash_type: str = HASH_TYPE) -> str:
    """The shipped config for 3 or 4 boards (the commented b4 line enabled), hash or round-robin,
    with the shipped `hash-type` or another (HASH_TYPES)."""
    if boards not in (3, 4):
        raise FleetError(f"the shipped config has lines for 3 or 4 boards, not {boards}")
    if HASH_BALANCE not in text or f"hash-type {HASH_TYPE}\n" not in text or not _FOURTH.search(text):
        raise FleetError("the config lacks the shipped 'balance hash' or 'hash-type' line or the commented b4 line")
    if boards == 4:
        text = _FOURTH.sub(r"\1\2", text)
    return text.replace(HASH_BALANCE, balance).replace(f"hash-type {HASH_TYPE}\n", f"hash-type {hash_type}\n")


class HAProxy:
    """One `haproxy -f <config>` process in the foreground, on a loopback port of its own."""

    def __init__(self, config_text: str, boards: list[str], workdir: Path, port: int | None = None):
        self.port = port or free_port()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config = self.workdir / f"haproxy-{self.port}.cfg"
        self.config.write_text(config_text)
        # addresses as the shipped config reads them: EDGE_FLEET_BIND, EDGE_BOARD1..n
        self.env = {**os.environ, "EDGE_FLEET_BIND": f"127.0.0.1:{self.port}",
                    **{f"EDGE_BOARD{i}": addr for i, addr in enumerate(boards, 1)}}
        self.proc: subprocess.Popen | None = None
        self.stderr_path = self.workdir / f"haproxy-{self.port}.stderr"
        # a second file, read after the config, adds only the stats socket (a `global` section of
        # its own): the config under test stays the one given, and the boards' UP/DOWN state, as
        # HAProxy's checks decided it, can be read instead of waited for with a fixed sleep
        self.stats_port = free_port()
        self.stats_config = self.workdir / f"haproxy-{self.port}.stats.cfg"
        self.stats_config.write_text(f"global\n    stats socket ipv4@127.0.0.1:{self.stats_port} level user\n")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> "HAProxy":
        exe = shutil.which("haproxy")
        if exe is None:
            raise FleetError("haproxy is not installed (Debian: apt-get install haproxy)")
        files = ["-f", str(self.config), "-f", str(self.stats_config)]
        check = subprocess.run([exe, "-c", *files], env=self.env, capture_output=True,
                               text=True, timeout=timeout)
        if check.returncode != 0:
            raise FleetError(f"haproxy -c refused the config: {check.stderr.strip()[-2000:]}")
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen([exe, "-db", *files], env=self.env,
                                         stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise FleetError(f"haproxy exited with {self.proc.returncode}: {self.stderr()[-2000:]}")
            try:
                http_call("GET", self.url + "/health", timeout=2)
                return self  # listening (a 503 while the checks have not passed yet)
            except HTTPFailure:
                time.sleep(0.05)
        raise FleetError(f"haproxy not listening on {self.url} within {timeout:.0f} s")

    def server_states(self) -> dict[str, tuple[str, str]]:
        """Each server of the backend: (status, last check) from the stats socket, e.g. ("UP", "L7OK"),
        ("DOWN", "L4CON"); a status with a count ("UP 1/2", "DOWN 1/2") is a board changing state."""
        with socket.create_connection(("127.0.0.1", self.stats_port), timeout=30) as sock:
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        rows = csv.DictReader(io.StringIO(data.decode(errors="replace").lstrip("# ")))
        return {r["svname"]: (r["status"], r["check_status"]) for r in rows
                if r.get("pxname") == BACKEND and r.get("svname") not in ("FRONTEND", "BACKEND")}

    def wait_servers(self, want: dict[str, str] | None = None, timeout: float = 120.0) -> "HAProxy":
        """Until HAProxy's checks have put each server in `want` ("UP" or "DOWN"; default: every
        server UP): "UP" is a board whose latest check passed and that takes new requests, "DOWN"
        one that takes none. Polled, not slept: how long the checks take (inter 1s, rise/fall 2,
        a /health answered slowly by a busy board) does not matter, the deadline only bounds a
        board that never gets there."""
        deadline = time.monotonic() + timeout
        states: dict[str, tuple[str, str]] = {}
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise FleetError(f"haproxy exited with {self.proc.returncode}: {self.stderr()[-2000:]}")
            try:
                states = self.server_states()
            except OSError:  # the stats socket not listening yet
                states = {}
            goal = want if want is not None else {name: "UP" for name in states}
            if states and all(name in states and (states[name] == ("UP", "L7OK") if state == "UP"
                                                   else states[name][0].startswith("DOWN"))
                              for name, state in goal.items()):
                return self
            if time.monotonic() > deadline:
                raise FleetError(f"haproxy's servers not {goal or 'listed'} within {timeout:.0f} s: {states}")
            time.sleep(0.2)

    def wait_boards(self, timeout: float = 120.0) -> "HAProxy":
        """Until every board of the config is up behind the proxy (its checks passed)."""
        return self.wait_servers(None, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGUSR1)  # soft stop: finish what is in flight
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


@dataclass
class Reply:
    status: int
    node: str | None
    body: dict
    wall_ms: float

    @property
    def text(self) -> str:
        return self.body["choices"][0]["message"]["content"]

    @property
    def cached(self) -> int:
        return self.body["usage"]["prompt_tokens_details"]["cached_tokens"]

    @property
    def source(self) -> str:
        return self.body["timings"]["cache_source"]


def post(url: str, body: dict, timeout: float = 120.0) -> Reply:
    """POST JSON on this thread's kept-alive connection (bench/keepalive.py); any HTTP status is a
    Reply. Connection errors raise HTTPFailure."""
    t0 = time.perf_counter()
    status, headers, parsed = call("POST", url, body, timeout=timeout)
    return Reply(status, headers.get(NODE_HEADER), parsed, (time.perf_counter() - t0) * 1e3)


@dataclass
class Conversation:
    """A chat whose user turns are fixed; the assistant turns are what the service answered."""
    name: str
    questions: list[str]
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    nodes: list[str | None] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)

    def body(self, turn: int, max_tokens: int) -> dict:
        head = [{"role": "system", "content": self.system}] if self.system else []
        if not self.messages:
            self.messages = head
        return {"messages": [*self.messages, {"role": "user", "content": self.questions[turn]}],
                "max_tokens": max_tokens, "temperature": 0}

    def send(self, base_url: str, turn: int, max_tokens: int, timeout: float = 120.0) -> Reply:
        """Send user turn `turn`; on a 200 the answer joins the history."""
        body = self.body(turn, max_tokens)
        r = post(base_url + "/v1/chat/completions", body, timeout)
        if r.status == 200:
            self.messages = [*body["messages"], {"role": "assistant", "content": r.text}]
        self.nodes.append(r.node)
        self.replies.append(r)
        return r


TOPICS = ("tides", "volcanoes", "bread", "bees", "glaciers", "kites", "owls", "rust", "comets", "moss",
          "chess", "ferns", "lighthouses", "salt", "clocks", "coral")


def conversations(n: int, turns: int, system: str | None = None) -> list[Conversation]:
    """n distinct chats of `turns` short questions each (the first question differs per chat)."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f" {i}")
        qs = [f"Tell me one fact about {topic}.", "Why is that?", "Say it in five words.",
              "Thanks. One more fact?", "And another?"]
        out.append(Conversation(f"c{i}", [qs[t % len(qs)] for t in range(turns)], system))
    return out


def probe_routes(base_url: str, n: int, timeout: float = 30.0) -> list[str | None]:
    """Which board each of `n` chats with a common system prompt is routed to, without running the
    model: each body asks for n = 2, which every board refuses (400) before tokenizing."""
    nodes = []
    for i in range(n):
        body = {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                             {"role": "user", "content": f"Question {i}: what is {i} times {i + 7}?"}],
                "n": 2}
        r = post(base_url + "/v1/chat/completions", body, timeout)
        if r.status != 400:
            raise FleetError(f"routing probe {i}: expected the board's 400, got {r.status} {r.body}")
        nodes.append(r.node)
    return nodes


# ---- bench fleet: consistent hashing vs round-robin, the same conversations ----------------------
def long_conversations(n: int, turns: int, history_tokens: int) -> list[Conversation]:
    """Chats whose first message carries a history of about `history_tokens` (a prefix long enough
    to be worth restoring, as a lab's or an assistant's chats are), then short follow-ups."""
    from edge_llm.bench.prompts import history

    out = []
    for c in conversations(n, turns):
        c.questions[0] = history(history_tokens, nonce=c.name) + "\n" + c.questions[0]
        out.append(c)
    return out


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def follow_up_stats(convs: list[Conversation]) -> dict:
    """Follow-ups (turn >= 2): server TTFT and where their prefix came from."""
    ups = [r for c in convs for r in c.replies[1:] if r.status == 200]
    ttft = [r.body["timings"]["ttft_ms"] for r in ups]
    src = collections.Counter(r.source if r.cached > 0 else "none" for r in ups)
    stay = sum(len(set(c.nodes)) == 1 for c in convs)
    return {"follow_ups": len(ups), "failed": sum(r.status != 200 for c in convs for r in c.replies),
            "ttft_median_ms": percentile(ttft, 0.5), "ttft_p90_ms": percentile(ttft, 0.9),
            "hit_rate": (src["ram"] + src["disk"] + src["disk-prefetch"]) / max(1, len(ups)),
            "ram_hits": src["ram"], "disk_hits": src["disk"] + src["disk-prefetch"], "misses": src["none"],
            "conversations_on_one_board": stay, "conversations": len(convs)}


def run_policy(config_text: str, boards: list[str], workdir: Path, convs: list[Conversation], max_tokens: int,
               step=lambda msg: None) -> dict:
    """One HAProxy with `config_text` in front of `boards`; every conversation's turns, interleaved."""
    proxy = HAProxy(config_text, boards, workdir).start()
    try:
        proxy.wait_boards()
        for t in range(len(convs[0].questions)):
            step(f"turn {t + 1} of {len(convs[0].questions)}")
            # every turn in another order (the same for every policy): clients do not arrive in a
            # fixed cycle, and a fixed cycle of N x boards chats would make round-robin sticky
            for c in random.Random(t).sample(convs, len(convs)):
                c.send(proxy.url, t, max_tokens, timeout=900)
    finally:
        proxy.stop()
    return follow_up_stats(convs)


# ---- bench fleet --spread: the key spread of HAProxy's hash functions -----------------------------
def hash_spread(text: str, boards: list[str], workdir: Path, keys: int, hash_types=HASH_TYPES,
                step=lambda msg: None) -> dict:
    """Per `hash-type`: where `keys` chat keys sharing a system prompt (probe_routes) go on the
    first 3 boards, and which of them move when the 4th joins; no model run."""
    out = {}
    for fn in hash_types:
        routes = {}
        for n in (3, 4):
            step(f"{fn}: {n} boards")
            proxy = HAProxy(fleet_config(text, n, hash_type=fn), boards[:n], workdir).start()
            try:
                routes[n] = probe_routes(proxy.wait_boards().url, keys)
            finally:
                proxy.stop()
        moved = collections.Counter(b for a, b in zip(routes[3], routes[4]) if a != b)
        out[fn] = {"spread": dict(sorted(collections.Counter(routes[3]).items())),
                   "moved": sum(moved.values()), "moved_to": dict(sorted(moved.items()))}
    return out

