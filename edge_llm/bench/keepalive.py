"""HTTP/1.1 requests on one kept-alive connection per thread and host, as the `openai` client and
browsers send them (docs/fleet.md, "Bounded loads").

The fleet's measurements and tests send turn after turn through HAProxy. A client that opens a new
connection per request can send its next request before HAProxy has closed the books on the last
one (the stream still counts as in flight on its board), and `hash-balance-factor` then sees a
load that is gone; on one connection the next request starts only after the last one ended.
Standard library only.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from email.message import Message

from edge_llm.bench.client import HTTPFailure

_local = threading.local()


def _connection(netloc: str, timeout: float, fresh: bool) -> http.client.HTTPConnection:
    pool = _local.__dict__.setdefault("pool", {})
    conn = pool.get(netloc)
    if conn is None or fresh:
        if conn is not None:
            conn.close()
        host, _, port = netloc.rpartition(":")
        conn = pool[netloc] = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.timeout = timeout
    if conn.sock is not None:
        conn.sock.settimeout(timeout)
    return conn


def call(method: str, url: str, body: dict | None = None, headers: dict[str, str] | None = None,
         timeout: float = 600.0) -> tuple[int, Message, dict]:
    """One request; returns (status, response headers, parsed JSON body, or {"raw": text}).
    A kept connection the server closed while idle is opened again once (the request never
    reached it); any other connection error raises HTTPFailure."""
    u = urllib.parse.urlsplit(url)
    path = u.path + (f"?{u.query}" if u.query else "")
    data = None if body is None else json.dumps(body).encode()
    hdrs = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
    for attempt in range(2):
        conn = _connection(u.netloc, timeout, fresh=False)
        reused = conn.sock is not None
        try:
            conn.request(method, path, body=data, headers=hdrs)
            r = conn.getresponse()
            raw = r.read()
            break
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
            conn.close()
            if not reused or attempt:
                raise HTTPFailure(f"{method} {url}: {e}") from e
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise HTTPFailure(f"{method} {url}: {e}") from e
    if r.will_close:
        conn.close()
    try:
        return r.status, r.headers, json.loads(raw or b"{}")
    except json.JSONDecodeError:
        return r.status, r.headers, {"raw": raw.decode("utf-8", errors="replace")}
