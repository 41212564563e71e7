"""Names and keys checked (docs/api.md "Allowed host names" and "API keys"): a request for a name
that is not the server's is refused before anything else (DNS rebinding), a request without Host
(HTTP/1.0, HAProxy's health check) passes, and an API key is compared as the bytes the client
sent. Real servers on real sockets; headers sent as raw bytes (http.client, plain sockets)."""

from __future__ import annotations

import http.client
import json
import re
import socket

import pytest
from serverutil import ServerProc, wait_for

from edge_llm.server.hosts import default_allowed_hosts, host_of
from edge_llm.server.ui import HEADERS

KEY = "clé-été-🔑".encode()  # UTF-8, as curl sends what is typed
EVIL = ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "EVIL.example.", "localhost.evil.example")
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def open_srv(tiny_synth_dir, tmp_path_factory):
    """No key, the page on, bound to 127.0.0.1: what docs/api.md calls the protection without a key."""
    work = tmp_path_factory.mktemp("srv-names")
    s = ServerProc(work / "home", work, "--model", str(tiny_synth_dir), "--max-seq", "128")
    s.start()
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def keyed_srv(tiny_synth_dir, tmp_path_factory):
    """A UTF-8 key, an ASCII key, keys no client can send, and allowed_hosts from the TOML file."""
    work = tmp_path_factory.mktemp("srv-keys")
    (work / "keys").write_bytes(b"# keys\n" + KEY + b"\nascii-key\nctl\x01key\n\xff\xfekey\n")
    (work / "edge-llm.toml").write_text('allowed_hosts = ["fleet.example.", "*.lan", "[FD00::1]"]\n')
    s = ServerProc(work / "home", work, "--model", str(tiny_synth_dir), "--max-seq", "128",
                   "--api-key-file", str(work / "keys"), "--config", str(work / "edge-llm.toml"))
    s.start()
    yield s
    assert s.stop() == 0


def request(srv: ServerProc, method: str, path: str, headers: dict[str, str | bytes],
            body: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with exactly these headers (Host included, as given; values sent as bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        data = json.dumps(body).encode() if body is not None else b""
        for name, value in {**headers, "Content-Length": str(len(data)),
                            **({"Content-Type": "application/json"} if body is not None else {})}.items():
            conn.putheader(name, value)
        conn.endheaders(data)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def raw(srv: ServerProc, request_bytes: bytes) -> tuple[int, bytes, bytes]:
    """Send bytes as they are; read until the server closes. (status, head, body)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=120) as s:
        s.sendall(request_bytes)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, body


def refused(status: int, headers: dict[str, str], body: bytes, code: str = "host_not_allowed") -> dict:
    assert status == (421 if code == "host_not_allowed" else 400), (status, body)
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    for name, value in HEADERS.items():  # the page's security headers on the refusal too
        assert headers[name.lower()] == value, (name, headers)
    return err


def test_a_rebinding_name_is_refused_before_anything(open_srv):
    """A web page that rebinds its own name to 127.0.0.1 sends that name as Host: refused on the
    data, the chat, the page, /health and an unknown path alike, naming the setting to change;
    the chat never ran and the store saw nothing."""
    targets = [("GET", "/v1/edge/store", None), ("POST", "/v1/chat/completions", CHAT), ("GET", "/ui/", None),
               ("GET", "/health", None), ("GET", "/no-such-path", None), ("GET", "/metrics", None)]
    for host in EVIL:
        for method, path, body in targets:
            err = refused(*request(open_srv, method, path, {"Host": host}, body))
            assert "allowed_hosts" in err["message"] and "--allowed-hosts" in err["message"], err
    status, headers, body = request(open_srv, "HEAD", "/ui/", {"Host": "evil.example"})
    assert status == 421 and body == b"" and headers["content-security-policy"] == HEADERS["Content-Security-Policy"]
    status, _, body = request(open_srv, "GET", "/metrics", {"Host": "127.0.0.1"})
    assert status == 200
    counts = dict(re.findall(r'edge_llm_requests_total\{endpoint="/v1/chat/completions",status="(\d+)"\} (\S+)',
                             body.decode()))
    assert counts == {"421": str(float(len(EVIL)))}, counts  # every chat refused, none ran
    store = json.loads(request(open_srv, "GET", "/v1/edge/store", {"Host": "127.0.0.1"})[2])
    assert store["snapshots"] == [], store
    log = open_srv.log()
    assert log.count("refused a request for the name evil.example (Host header)") == 1, log[-3000:]


def test_the_names_of_the_server_pass(open_srv):
    """The bound address, the loopback names, with a port or not, any case, a trailing dot, the
    IPv6 loopback in brackets (also spelled long)."""
    port = open_srv.port
    for host in (f"127.0.0.1:{port}", "127.0.0.1", "localhost", f"LocalHost.:{port}", f"[::1]:{port}", "[::1]",
                 "[0:0:0:0:0:0:0:1]:80"):
        for path in ("/v1/edge/store", "/ui/", "/health"):
            status, headers, body = request(open_srv, "GET", path, {"Host": host})
            assert status == 200, (host, path, status, body[:300])
    status, _, body = request(open_srv, "POST", "/v1/chat/completions", {"Host": f"localhost:{port}"}, CHAT)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1, body


def test_a_malformed_or_doubled_host_is_400(open_srv):
    for host in ("[::1", "127.0.0.1:80x", "a b", "evil.example:8080:1", "[not-v6]:80"):
        refused(*request(open_srv, "GET", "/v1/edge/store", {"Host": host}), code="bad_host")
    status, head, body = raw(open_srv, b"GET /v1/edge/store HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n"
                                       b"Connection: close\r\n\r\n")
    # uvicorn's HTTP parser (h11) refuses this one itself, in plain text; the middleware's own rule
    # is for a parser that passes it on
    assert status == 400 and b"snapshots" not in body, (head, body)


def test_http10_without_host_reaches_health(open_srv):
    """HAProxy's `option httpchk GET /health` is HTTP/1.0 without Host: no browser sends that, so
    it is no rebinding; it passes (Starlette's TrustedHostMiddleware would refuse it)."""
    status, head, body = raw(open_srv, b"GET /health HTTP/1.0\r\n\r\n")
    assert status == 200 and json.loads(body)["status"] == "ok", (head, body)


def test_the_setting_names_other_names(keyed_srv):
    """allowed_hosts from the TOML file: its names (any case, trailing dot or not), subdomains of
    a `*.` entry and the loopback names pass; the bound address is no longer implied."""
    auth = {"Authorization": b"Bearer ascii-key"}
    for host in ("fleet.example", "FLEET.EXAMPLE.:8080", "board-1.lan", "a.b.lan", "[fd00::1]:8080", "localhost",
                 f"127.0.0.1:{keyed_srv.port}"):
        status, _, body = request(keyed_srv, "GET", "/v1/models", {"Host": host, **auth})
        assert status == 200, (host, status, body)
    for host in ("lan", "evil.example", "fleet.example.evil", "[fd00::2]"):
        refused(*request(keyed_srv, "GET", "/v1/models", {"Host": host, **auth}))
    # the Host check comes before the key: no key and a foreign name is a 421, not a 401
    refused(*request(keyed_srv, "GET", "/v1/models", {"Host": "evil.example"}))


def test_a_utf8_key_is_accepted_as_sent(keyed_srv):
    """The key file's UTF-8 key, sent as its UTF-8 bytes, is accepted; the same text as Latin-1
    bytes (what a client that encodes headers as Latin-1 sends) and a near miss are not."""
    host = {"Host": "localhost"}
    status, _, body = request(keyed_srv, "GET", "/v1/models", {**host, "Authorization": b"Bearer " + KEY})
    assert status == 200, body
    status, _, body = request(keyed_srv, "POST", "/v1/chat/completions",
                              {**host, "Authorization": b"bearer  " + KEY + b" "}, CHAT)
    assert status == 200, body  # the gate's check (before the body) and the route's agree
    latin1 = KEY.decode().replace("🔑", "").encode("latin-1")
    for sent in (b"Bearer " + latin1, b"Bearer " + KEY[:-1], b"Bearer " + KEY + b"x", b"Basic " + KEY):
        status, _, body = request(keyed_srv, "GET", "/v1/models", {**host, "Authorization": sent})
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", (sent, body)


def test_a_key_no_client_can_send_is_warned_about_at_start(keyed_srv):
    log = wait_for(lambda: keyed_srv.log() if "line 5" in keyed_srv.log() else None, timeout=60)
    lines = [ln for ln in log.splitlines() if "api_key_file" in ln and "WARNING" in ln]
    assert any("line 2: the key holds characters that are not ASCII" in ln for ln in lines), lines
    assert any("line 4: the key holds control characters (U+0001)" in ln for ln in lines), lines
    assert any("line 5: the key is not UTF-8 text" in ln for ln in lines), lines
    assert not any("line 3" in ln for ln in lines), lines  # the ASCII key is fine
    assert "clé" not in log and "ascii-key" not in log  # the log names lines, never a key


def test_the_default_for_a_wildcard_bind_is_this_machine():
    """host 0.0.0.0: the hostname, <label>.local and every interface address (the loopback among
    them); a bound address: itself and the loopback names only."""
    names = default_allowed_hosts("0.0.0.0")
    label = socket.gethostname().split(".")[0].lower()
    assert {"localhost", "127.0.0.1", "::1", label, f"{label}.local"} <= set(names), names
    import psutil
    v4 = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    assert v4 and v4 <= set(names), (v4, names)
    assert default_allowed_hosts("127.0.0.1") == ("localhost", "127.0.0.1", "::1")
    assert host_of(b"[::1]:8080") == "::1" and host_of(b"Example.COM.:1") == "example.com"
    assert host_of(b"caf\xc3\xa9.example") is None and host_of(b"::1") is None
